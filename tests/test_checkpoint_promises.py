"""What the checkpoint reader and the Python API promise, each pinned by a test that fails
when the promise is broken.

- ``tie_word_embeddings`` absent from config.json means untied (transformers' default): the
  model loads the checkpoint's own ``lm_head``.
- A ``llama3`` RoPE scaling with fields left out takes Llama 3.1's values (factor 8, low 1,
  high 4, original context 8192), in either config layout.
- ``partial_rotary_factor`` below 1 is refused, wherever the config puts it.
- ``dtype`` may be a string or a ``torch.dtype`` wherever it is accepted; a bad override names
  the argument, not config.json.
- ``generate_text`` refuses a bare string for its prompt list, and ``model=`` together with
  pool overrides.
- The weights' names and shapes are checked from the files' headers, before any weight is
  read.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("safetensors")
pytest.importorskip("tokenizers")

from safetensors.torch import load_file

import common.checkpoint as checkpoint_module
from common.checkpoint import config_from_hf, eos_token_ids, load_checkpoint
from common.config import ModelConfig, preset
from common.errors import CheckpointError
from common.front.hf import hf_llama
from common.front.text import generate_text
from tests.toy_checkpoint import CFG, word_tokenizer


def save(folder: Path, cfg: ModelConfig, **config_changes: object) -> Path:
    """``cfg``'s seeded model saved by transformers, a tokenizer, then config.json edited
    (a value of None deletes the key)."""
    hf_llama(cfg).save_pretrained(folder)
    word_tokenizer().save(str(folder / "tokenizer.json"))
    path = folder / "config.json"
    config = json.loads(path.read_text())
    for key, value in config_changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    path.write_text(json.dumps(config))
    return folder


@pytest.fixture(scope="module")
def tied(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save(tmp_path_factory.mktemp("tied") / "ckpt", CFG)


# ---- tie_word_embeddings ------------------------------------------------------------------


def test_config_without_tie_word_embeddings_is_untied(step: ModuleType, tmp_path: Path) -> None:
    """HF's LlamaConfig defaults to untied; such a checkpoint stores its own lm_head, and the
    model must use it, not the embedding."""
    untied = CFG.replace(tie_word_embeddings=False)
    folder = save(tmp_path / "ckpt", untied, tie_word_embeddings=None)
    assert "tie_word_embeddings" not in json.loads((folder / "config.json").read_text())
    stored = load_file(str(folder / "model.safetensors"))
    assert not torch.equal(stored["lm_head.weight"], stored["model.embed_tokens.weight"])
    model = step.TinyTransformerPaged.from_pretrained(folder)
    assert model.cfg.tie_word_embeddings is False
    assert model.lm_head.weight is not model.model.embed_tokens.weight
    assert torch.equal(model.lm_head.weight, stored["lm_head.weight"])


# ---- llama3 RoPE scaling ------------------------------------------------------------------


def hf_fields(**changes: object) -> dict[str, object]:
    return {
        "vocab_size": 62,
        "hidden_size": 64,
        "intermediate_size": 172,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        **changes,
    }


@pytest.mark.parametrize("layout", ["rope_scaling", "rope_parameters"])
def test_absent_llama3_fields_take_llama_3_1_values(layout: str) -> None:
    scaling = {"rope_type": "llama3", "factor": 32.0}  # only the factor given (Llama 3.2's)
    if layout == "rope_parameters":
        scaling["rope_theta"] = 500000.0
    cfg = config_from_hf(hf_fields(**{layout: scaling}))
    s = cfg.rope_scaling
    assert (s.factor, s.low_freq_factor, s.high_freq_factor) == (32.0, 1.0, 4.0)
    assert s.original_max_position_embeddings == 8192
    bare = config_from_hf(hf_fields(**{layout: {"rope_type": "llama3"}})).rope_scaling
    assert (bare.factor, bare.low_freq_factor, bare.high_freq_factor) == (8.0, 1.0, 4.0)
    assert bare.original_max_position_embeddings == 8192


def test_given_llama3_fields_are_kept() -> None:
    scaling = {
        "rope_type": "llama3",
        "factor": 4.0,
        "low_freq_factor": 2.0,
        "high_freq_factor": 8.0,
        "original_max_position_embeddings": 64,
    }
    s = config_from_hf(hf_fields(rope_scaling=scaling)).rope_scaling
    assert (s.factor, s.low_freq_factor, s.high_freq_factor) == (4.0, 2.0, 8.0)
    assert s.original_max_position_embeddings == 64


# ---- partial_rotary_factor ----------------------------------------------------------------


@pytest.mark.parametrize(
    "changes",
    [
        {"partial_rotary_factor": 0.5},
        {"rope_scaling": {"rope_type": "default", "partial_rotary_factor": 0.25}},
        {
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 1e4,
                "partial_rotary_factor": 0.5,
            }
        },
        {"rope_parameters": {"rope_type": "llama3", "factor": 8.0, "partial_rotary_factor": 0.5}},
    ],
    ids=["top-level", "rope_scaling", "rope_parameters", "llama3"],
)
def test_partial_rotary_below_one_is_refused(changes: dict[str, object]) -> None:
    with pytest.raises(CheckpointError, match="partial_rotary_factor=0"):
        config_from_hf(hf_fields(**changes))


def test_full_rotary_is_accepted() -> None:
    for value in (1.0, 1, None):
        assert config_from_hf(hf_fields(partial_rotary_factor=value)).rope_scaling is None


# ---- dtype, and errors that name the argument ----------------------------------------------


@pytest.mark.parametrize(
    ("given", "want"),
    [
        ("bfloat16", torch.bfloat16),
        ("torch.float64", torch.float64),
        (torch.float16, torch.float16),
        ("float32", torch.float32),
    ],
    ids=["bfloat16", "torch.float64", "torch-dtype", "float32"],
)
def test_dtype_as_a_string_or_a_torch_dtype(tied: Path, given: object, want: torch.dtype) -> None:
    from step14_7 import TinyTransformerPaged

    model = TinyTransformerPaged.from_pretrained(tied, dtype=given)
    assert model.cfg.dtype == want and model.kv_pool_k.dtype == want
    assert model.model.embed_tokens.weight.dtype == want
    assert preset("tiny", dtype=given).dtype == want
    assert ModelConfig(dtype=given).dtype == want


def test_dtype_auto_is_the_stored_one(tmp_path: Path) -> None:
    folder = save(tmp_path / "ckpt", CFG, dtype="bfloat16")
    cfg, weights = load_checkpoint(folder, dtype="auto")
    assert cfg.dtype == torch.bfloat16
    assert {w.dtype for w in weights.values()} == {torch.bfloat16}


@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        ({"total_blocks": 0}, "total_blocks=0"),
        ({"block_size": -4}, "block_size=-4"),
        ({"dtype": "float8"}, "dtype='float8'"),
        ({"dtype": torch.int64}, "dtype=torch.int64"),
    ],
    ids=["total_blocks", "block_size", "dtype-name", "dtype-int"],
)
def test_a_bad_argument_is_named_and_config_json_is_not_blamed(
    tied: Path, overrides: dict[str, object], named: str
) -> None:
    from step14_7 import TinyTransformerPaged

    with pytest.raises(ValueError) as info:
        TinyTransformerPaged.from_pretrained(tied, **overrides)
    assert not isinstance(info.value, CheckpointError), "the checkpoint is not at fault"
    assert named in str(info.value) and "config.json" not in str(info.value)


def test_an_unknown_argument_is_named(tied: Path) -> None:
    from step14_7 import TinyTransformerPaged

    with pytest.raises(TypeError, match="block_sise=4"):
        TinyTransformerPaged.from_pretrained(tied, block_sise=4)


def test_a_bad_config_json_is_still_the_checkpoints_fault(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match=r"config\.json"):
        config_from_hf(hf_fields(num_key_value_heads=3))


# ---- generate_text's arguments --------------------------------------------------------------


def test_one_string_is_not_a_list_of_prompts(tied: Path) -> None:
    with pytest.raises(ValueError, match="list of strings") as info:
        generate_text("step14_7", tied, "the cat sat on", max_new_tokens=2)
    assert "['the cat sat on']" in str(info.value), "the message shows the fix"


def test_model_and_pool_overrides_together_are_refused(tied: Path) -> None:
    from step14_7 import TinyTransformerPaged

    model = TinyTransformerPaged.from_pretrained(tied, total_blocks=64)
    with pytest.raises(ValueError, match="total_blocks=1"):
        generate_text("step14_7", tied, ["the cat"], model=model, total_blocks=1)
    result = generate_text("step14_7", tied, ["the cat"], max_new_tokens=2, model=model)
    assert result.cfg.total_blocks == 64


def test_a_model_from_another_checkpoint_is_refused(tied: Path) -> None:
    from step14_7 import TinyTransformerPaged

    other = TinyTransformerPaged(CFG.replace(num_layers=3))
    with pytest.raises(ValueError, match="num_layers"):
        generate_text("step14_7", tied, ["the cat"], model=other)


# ---- checked before the weights are read ----------------------------------------------------


def test_shapes_are_checked_from_the_headers_first(
    tied: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A config that does not fit the stored tensors is refused without reading them."""
    import shutil

    folder = tmp_path / "ckpt"
    shutil.copytree(tied, folder)
    config = json.loads((folder / "config.json").read_text())
    config["intermediate_size"] = 100
    (folder / "config.json").write_text(json.dumps(config))

    def refuse(*args: object) -> None:
        raise AssertionError("weights read before their shapes were checked")

    monkeypatch.setattr(checkpoint_module, "read_safetensors", refuse)
    with pytest.raises(CheckpointError, match=r"gate_proj.weight has shape \(172, 64\)"):
        load_checkpoint(folder)


@pytest.mark.parametrize(
    "eos", [[1, "2"], True, 2.5, [[1]]], ids=["str", "bool", "float", "nested"]
)
def test_eos_in_a_file_must_be_token_ids(tied: Path, tmp_path: Path, eos: object) -> None:
    import shutil

    folder = tmp_path / "ckpt"
    shutil.copytree(tied, folder)
    path = folder / "generation_config.json"
    path.write_text(json.dumps({"eos_token_id": eos}))
    with pytest.raises(CheckpointError, match=r"generation_config\.json: eos_token_id"):
        eos_token_ids(folder)
