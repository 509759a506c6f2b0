"""Real checkpoints: ``from_pretrained`` on a directory written by HF's ``save_pretrained``,
the config fields it reads, text in and text out through every step, and what it refuses.

The checkpoint is a tiny ``LlamaForCausalLM`` with everything current Llama checkpoints use
(grouped-query attention, tied embeddings, ``llama3`` RoPE scaling) and a word-level
``tokenizer.json`` built here; HF's own ``generate`` on it is the oracle for the text. The same
checkpoint goes through ``--model DIR`` of ``python -m bench`` and of every step's ``run.py``.

- Loading: every tensor arrives where it belongs, from one file or from shards; the stored
  dtype is cast to the configured one; ``dtype`` may be a string, a ``torch.dtype`` or
  ``"auto"`` (the stored one); the weights are cast once and shared by every step's model.
- config.json, as transformers writes it today and wrote it before: both RoPE layouts;
  ``llama3`` fields left out take Llama 3.1's values (factor 8, low 1, high 4, original
  context 8192); ``tie_word_embeddings`` absent means untied (transformers' default: the
  model loads the checkpoint's own ``lm_head``); eos ids from generation_config.json or
  config.json.
- Text in, text out: the tokens of HF ``generate``, a request stopping at the checkpoint's
  eos, the shared system prompt served from the cache.
- Refusals, each naming what is wrong: weights that do not fit the config (checked from the
  files' headers, before any weight is read), unsupported fields (``partial_rotary_factor``
  below 1 wherever the config puts it), a folder that is not a checkpoint, eos ids that are
  not token ids, a missing optional package. A bad argument names the argument and does not
  blame config.json; ``generate_text`` refuses a bare string for its prompt list, ``model=``
  together with pool overrides, and a model of another shape.

What a command prints when it cannot serve a checkpoint (one ``error:`` line) is in
``tests/front/test_bad_input.py``; the chat template in ``tests/front/test_chat_template.py``.
"""

from __future__ import annotations

import importlib
import json
import re
import shutil
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("safetensors")
pytest.importorskip("tokenizers")

from safetensors.torch import load_file, save_file

import common.checkpoint as checkpoint_module
from bench.cli import main as bench_main
from common.checkpoint import config_from_hf, eos_token_ids, load_checkpoint
from common.config import ModelConfig, preset
from common.errors import CheckpointError
from front import text_cli
from front.codec import TextCodec, load_tokenizer
from front.hf import default_max_positions, hf_llama
from front.options import EngineOptions
from front.text import TextOptions, generate_text
from tests.helpers import STEP_NAMES, edit_json, has_fix, hf_greedy
from tests.toy_checkpoint import CFG, VOCAB, WORDS, word_tokenizer

SYSTEM = "a small happy bird sat on the old tree today and it was here"
PROMPTS = ["the cat sat on", "two red dog ran under the big", "it was morning"]
NEW_TOKENS = 10


def save_model(folder: Path, cfg: ModelConfig, **config_changes: object) -> Path:
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
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    """A checkpoint directory (and a sharded copy) plus HF's greedy answers on it.

    Its eos is a token HF really generates mid-answer for one prompt, so stopping at
    the checkpoint's eos is observable (a random model rarely produces ``</s>`` by itself).
    """
    root = tmp_path_factory.mktemp("llama")
    model = hf_llama(CFG, attn="eager")  # our seeded weights: decisive, so float32 greedy is stable
    single, sharded = root / "single", root / "sharded"
    model.save_pretrained(single)
    model.save_pretrained(sharded, max_shard_size="40KB")
    tokenizer = word_tokenizer()
    prompt_ids = [TextCodec(tokenizer, None, []).completion_ids(p, SYSTEM) for p in PROMPTS]
    free_run = hf_greedy(model, prompt_ids, NEW_TOKENS)
    eos = next(  # a token that some answer reaches after two others
        t for out in free_run for i, t in enumerate(out) if i >= 2 and t not in out[:i]
    )
    for folder in (single, sharded):
        tokenizer.save(str(folder / "tokenizer.json"))
        edit_json(folder / "config.json", eos_token_id=eos)
    return {
        "single": single,
        "sharded": sharded,
        "eos": eos,
        "prompt_ids": prompt_ids,
        "expected": hf_greedy(model, prompt_ids, NEW_TOKENS, eos),
        "tokenizer": tokenizer,
    }


@pytest.fixture(scope="module")
def tied(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The toy model as transformers saves it, config.json untouched."""
    return save_model(tmp_path_factory.mktemp("tied") / "ckpt", CFG)


# ---- loading -------------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["single", "sharded"])
def test_from_pretrained_loads_the_checkpoint(
    step: ModuleType, checkpoint: dict[str, object], layout: str
) -> None:
    """Every tensor arrives where it belongs: the loaded model equals the one that was saved,
    and its cfg carries the checkpoint's fields."""
    folder = checkpoint[layout]
    if layout == "sharded":
        assert (folder / "model.safetensors.index.json").is_file()
        assert len(list(folder.glob("*.safetensors"))) > 2
    model = step.TinyTransformerPaged.from_pretrained(folder, block_size=4, total_blocks=64)
    # max_model_len: the checkpoint's max_position_embeddings (hf_llama wrote the default one)
    positions = default_max_positions(CFG)
    assert model.cfg == CFG.replace(
        total_blocks=64, seed=None, max_model_len=positions, max_position_embeddings=positions
    )
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tied
    assert tuple(model.kv_pool_k.shape) == (2, 64, 4, 2, 16)  # 2 KV heads, not 4
    expected = step.TinyTransformerPaged(CFG).state_dict()
    actual = model.state_dict()
    assert actual.keys() == expected.keys()
    assert all(torch.equal(actual[k], expected[k]) for k in expected)


def test_stored_dtype_is_cast_to_the_configured_one(step: ModuleType, tmp_path: Path) -> None:
    """A bfloat16 checkpoint loads into float32 (the default) and float64 alike."""
    hf_llama(CFG).to(torch.bfloat16).save_pretrained(tmp_path)
    stored = load_file(str(tmp_path / "model.safetensors"))
    assert stored["model.norm.weight"].dtype == torch.bfloat16
    for dtype in (None, torch.float64):
        kwargs = {} if dtype is None else {"dtype": dtype}
        model = step.TinyTransformerPaged.from_pretrained(tmp_path, **kwargs)
        want = dtype or torch.float32
        assert model.cfg.dtype == want and model.kv_pool_v.dtype == want
        weight = model.model.layers[1].mlp.down_proj.weight
        assert weight.dtype == want
        assert torch.equal(weight, stored["model.layers.1.mlp.down_proj.weight"].to(want))


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
    folder = save_model(tmp_path / "ckpt", CFG, dtype="bfloat16")
    cfg, weights = load_checkpoint(folder, dtype="auto")
    assert cfg.dtype == torch.bfloat16
    assert {w.dtype for w in weights.values()} == {torch.bfloat16}


def test_loaded_weights_are_cast_once_and_shared(checkpoint: dict[str, object]) -> None:
    """``load_checkpoint`` casts; models built from its weights share them (one copy in memory
    however many steps ``python -m bench`` builds)."""
    from step14 import TinyTransformerPaged as First
    from step14_7 import TinyTransformerPaged as Last

    cfg, weights = load_checkpoint(checkpoint["single"], dtype=torch.float64)
    assert {t.dtype for t in weights.values()} == {torch.float64}
    first, last = First(cfg), Last(cfg)
    first.load_weights(weights)
    last.load_weights(weights)
    name = "model.layers.0.mlp.gate_proj.weight"
    assert first.state_dict()[name].data_ptr() == last.state_dict()[name].data_ptr()


# ---- config.json, old and new --------------------------------------------------------------------


def test_both_rope_config_layouts_give_the_same_config(checkpoint: dict[str, object]) -> None:
    """``rope_parameters`` (current transformers) and ``rope_theta`` + ``rope_scaling`` (older
    checkpoints, with ``rope_type`` or the even older ``type``) are read alike."""
    new = json.loads((checkpoint["single"] / "config.json").read_text())
    rope = dict(new.pop("rope_parameters"))
    theta = rope.pop("rope_theta")
    old = dict(new, rope_theta=theta, rope_scaling=dict(rope))
    rope["type"] = rope.pop("rope_type")
    oldest = dict(new, rope_theta=theta, rope_scaling=rope)
    expected = config_from_hf(json.loads((checkpoint["single"] / "config.json").read_text()))
    assert expected.rope_scaling == CFG.rope_scaling and expected.rope_theta == 500000.0
    assert config_from_hf(old) == expected
    assert config_from_hf(oldest) == expected
    plain = config_from_hf(dict(new, rope_theta=theta, rope_scaling=None))
    assert plain.rope_scaling is None and plain.rope_theta == 500000.0


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


def test_full_rotary_is_accepted() -> None:
    for value in (1.0, 1, None):
        assert config_from_hf(hf_fields(partial_rotary_factor=value)).rope_scaling is None


def test_config_without_tie_word_embeddings_is_untied(step: ModuleType, tmp_path: Path) -> None:
    """HF's LlamaConfig defaults to untied; such a checkpoint stores its own lm_head, and the
    model must use it, not the embedding."""
    untied = CFG.replace(tie_word_embeddings=False)
    folder = save_model(tmp_path / "ckpt", untied, tie_word_embeddings=None)
    assert "tie_word_embeddings" not in json.loads((folder / "config.json").read_text())
    stored = load_file(str(folder / "model.safetensors"))
    assert not torch.equal(stored["lm_head.weight"], stored["model.embed_tokens.weight"])
    model = step.TinyTransformerPaged.from_pretrained(folder)
    assert model.cfg.tie_word_embeddings is False
    assert model.lm_head.weight is not model.model.embed_tokens.weight
    assert torch.equal(model.lm_head.weight, stored["lm_head.weight"])


def test_eos_ids_from_generation_config_or_config(checkpoint: dict[str, object]) -> None:
    folder = checkpoint["single"]
    assert eos_token_ids(folder) == [checkpoint["eos"]]  # generation_config.json says null
    edit_json(folder / "generation_config.json", eos_token_id=[7, 9])
    try:
        assert eos_token_ids(folder) == [7, 9]
    finally:
        edit_json(folder / "generation_config.json", eos_token_id=None)


# ---- text in, text out ---------------------------------------------------------------------------


def after_prompt(tokenizer: object, prompt_ids: list[int], ids: list[int]) -> str:
    """HF's text of ``ids`` as the continuation of the prompt (vLLM's detokenizing, primed with
    the prompt): the prompt and answer decoded together, less the prompt's own text. A word-level
    tokenizer joins words with spaces, so an answer starts with one."""
    whole = tokenizer.decode(prompt_ids + ids, skip_special_tokens=True)
    head = tokenizer.decode(prompt_ids, skip_special_tokens=True)
    assert whole.startswith(head)
    return whole[len(head) :]


@pytest.mark.parametrize("layout", ["single", "sharded"])
def test_text_through_every_step_equals_hf(
    step: ModuleType, checkpoint: dict[str, object], layout: str
) -> None:
    """Same prompts, same tokens as HF ``generate``; a request stops at the checkpoint's eos;
    the shared system prompt is served from the cache."""
    options = TextOptions(SYSTEM, NEW_TOKENS, engine=EngineOptions(block_size=4))
    result = generate_text(step, checkpoint[layout], PROMPTS, options)
    expected = checkpoint["expected"]
    assert result.prompt_ids == checkpoint["prompt_ids"]
    assert result.output_ids == expected
    assert min(map(len, expected)) < NEW_TOKENS  # one answer stopped at the eos
    tokenizer, prompt_ids = checkpoint["tokenizer"], checkpoint["prompt_ids"]
    assert result.outputs == [
        after_prompt(tokenizer, prompt, ids) for prompt, ids in zip(prompt_ids, expected)
    ]
    assert all(text.split() and set(text.split()) <= set(WORDS) for text in result.outputs)
    s = result.stats
    # Admitted together, the requests leapfrog through the system prompt: each of its full
    # blocks is computed once, by one of them, and adopted by the other two. (From step14_9 on
    # the first computes all of it in one chunk: the other two hit.)
    assert s.requests_hit == len(PROMPTS) - has_fix(step, "step14_9")
    system_blocks = result.system_tokens // 4
    assert system_blocks >= 2
    assert s.cached_tokens == (len(PROMPTS) - 1) * system_blocks * 4
    assert s.computed_prefill_tokens == s.prompt_tokens - s.cached_tokens


def test_prompts_share_the_system_prompt_token_for_token(checkpoint: dict[str, object]) -> None:
    codec = TextCodec.load(checkpoint["single"])
    ids = [codec.encode(prompt, SYSTEM) for prompt in PROMPTS]
    prefix = codec.tokenizer.encode(SYSTEM).ids
    assert prefix[0] == 1  # <s>
    assert 0 not in prefix  # every word is in the vocabulary: no <unk>
    assert all(p[: len(prefix)] == prefix for p in ids)
    assert codec.encode("the cat") == [1, VOCAB.index("the"), VOCAB.index("cat")]
    assert codec.system_tokens(SYSTEM, ids) == len(prefix)


def test_run_text_prints_outputs_and_cache_figures(
    checkpoint: dict[str, object], capsys: pytest.CaptureFixture[str]
) -> None:
    """What ``run.py --model DIR --system ... --prompt ... --prompt ...`` prints."""
    parser = text_cli.build_parser("run")
    argv = ["--model", str(checkpoint["single"]), "--system", SYSTEM, "--block-size", "4"]
    argv += ["--max-new-tokens", str(NEW_TOKENS)]
    for prompt in PROMPTS:
        argv += ["--prompt", prompt]
    assert text_cli.run("step14_7", text_cli.read_options(parser, argv)) == 0
    out = capsys.readouterr().out
    decode = checkpoint["tokenizer"].decode
    for prompt, ids in zip(PROMPTS, checkpoint["expected"]):
        assert prompt in out
        assert decode(ids, skip_special_tokens=True) in out
    assert "2 KV heads" in out
    assert "prefix cache: 3/3 requests hit" in out


# ---- refusals: a checkpoint that does not fit ----------------------------------------------------


def copy_with_weights(src: Path, dst: Path, edit) -> Path:
    """A copy of checkpoint ``src`` whose weights went through ``edit(dict)``."""
    shutil.copytree(src, dst)
    weights = load_file(str(dst / "model.safetensors"))
    edit(weights)
    save_file(weights, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (
            lambda w: w.pop("model.layers.1.mlp.up_proj.weight"),
            "missing tensor model.layers.1.mlp.up_proj.weight",
        ),
        (
            lambda w: w.update({"model.layers.0.self_attn.k_proj.weight": torch.zeros(64, 64)}),
            "k_proj.weight has shape (64, 64), the config implies (32, 64)",
        ),
        (
            lambda w: w.update({"model.layers.0.self_attn.q_proj.bias": torch.zeros(64)}),
            "unexpected tensor model.layers.0.self_attn.q_proj.bias",
        ),
        (
            lambda w: w.update({"lm_head.weight": torch.zeros(len(VOCAB), 64)}),
            "lm_head.weight differs from model.embed_tokens.weight",
        ),
    ],
    ids=["missing", "wrong-shape", "unexpected", "untied-lm-head"],
)
def test_weights_that_do_not_fit_are_refused(
    checkpoint: dict[str, object], tmp_path: Path, edit, message: str
) -> None:
    folder = copy_with_weights(checkpoint["single"], tmp_path / "ckpt", edit)
    with pytest.raises(CheckpointError) as info:
        load_and_build(folder)
    assert message in str(info.value)


def load_and_build(folder: Path) -> torch.nn.Module:
    from step14 import TinyTransformerPaged

    return TinyTransformerPaged.from_pretrained(folder)


def test_redundant_tensors_are_accepted(checkpoint: dict[str, object], tmp_path: Path) -> None:
    """A tied checkpoint that also stores the (identical) lm_head, and an old-style
    ``rotary_emb.inv_freq`` buffer: both carry nothing new, both load."""

    def add(w: dict[str, torch.Tensor]) -> None:
        w["lm_head.weight"] = w["model.embed_tokens.weight"].clone()
        w["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)

    model = load_and_build(copy_with_weights(checkpoint["single"], tmp_path / "ckpt", add))
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_shapes_are_checked_from_the_headers_first(
    tied: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A config that does not fit the stored tensors is refused without reading them."""
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
    ("changes", "field"),
    [
        ({"attention_bias": True}, "attention_bias"),
        ({"mlp_bias": True}, "mlp_bias"),
        ({"sliding_window": 4096}, "sliding_window"),
        ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0}}, "yarn"),
        ({"rope_parameters": None, "rope_scaling": {"type": "linear", "factor": 2.0}}, "linear"),
        ({"model_type": "mistral"}, "model_type"),
        ({"architectures": ["Qwen2ForCausalLM"]}, "architectures"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"quantization_config": {"quant_method": "gptq"}}, "quantization_config"),
        ({"num_key_value_heads": 3}, "num_kv_heads"),
        ({"hidden_size": None}, "hidden_size"),
    ],
    ids=lambda x: x if isinstance(x, str) else None,
)
def test_unsupported_fields_are_refused_by_name(
    checkpoint: dict[str, object], tmp_path: Path, changes: dict[str, object], field: str
) -> None:
    """Refused at load, before any weight is read, with the field named."""
    (tmp_path / "config.json").write_text((checkpoint["single"] / "config.json").read_text())
    edit_json(tmp_path / "config.json", **changes)  # no weights here: refused before reading
    with pytest.raises(CheckpointError, match=field):
        load_checkpoint(tmp_path)


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


def test_a_bad_config_json_is_still_the_checkpoints_fault(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match=r"config\.json"):
        config_from_hf(hf_fields(num_key_value_heads=3))


def test_not_a_checkpoint_directory(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="downloads nothing"):
        load_checkpoint(tmp_path / "meta-llama/Llama-3.2-1B")
    with pytest.raises(CheckpointError, match=r"config\.json"):
        load_checkpoint(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(CheckpointError, match="lacks vocab_size"):
        load_checkpoint(tmp_path)


def test_no_safetensors_is_refused(checkpoint: dict[str, object], tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text((checkpoint["single"] / "config.json").read_text())
    with pytest.raises(CheckpointError, match=r"no \*\.safetensors"):
        load_checkpoint(tmp_path)


@pytest.mark.parametrize(
    "eos", [[1, "2"], True, 2.5, [[1]]], ids=["str", "bool", "float", "nested"]
)
def test_eos_in_a_file_must_be_token_ids(tied: Path, tmp_path: Path, eos: object) -> None:
    folder = tmp_path / "ckpt"
    shutil.copytree(tied, folder)
    path = folder / "generation_config.json"
    path.write_text(json.dumps({"eos_token_id": eos}))
    with pytest.raises(CheckpointError, match=r"generation_config\.json: eos_token_id"):
        eos_token_ids(folder)


def test_a_tokenizer_that_is_not_the_checkpoints_is_refused_naming_the_prompt(
    checkpoint: dict[str, object],
) -> None:
    """Ids past the model's vocabulary mean tokenizer.json belongs to another checkpoint."""
    codec = TextCodec.load(checkpoint["single"])
    ids = codec.encode_all(PROMPTS, SYSTEM, CFG.vocab_size)
    assert ids == checkpoint["prompt_ids"]
    with pytest.raises(CheckpointError, match=r"prompt 1 \('.*'\): the tokenizer gives ids"):
        codec.encode_all(PROMPTS, SYSTEM, vocab_size=2)


def test_missing_optional_packages_say_how_to_install(
    checkpoint: dict[str, object], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "safetensors.torch", None)
    with pytest.raises(ImportError, match=r"pip install -e '\.\[real\]'"):
        load_checkpoint(checkpoint["single"])
    monkeypatch.setitem(sys.modules, "tokenizers", None)
    with pytest.raises(ImportError, match=r"pip install -e '\.\[real\]'"):
        load_tokenizer(checkpoint["single"])


def test_model_flag_wants_a_local_checkpoint_directory(
    checkpoint: dict[str, object], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    parser = text_cli.build_parser("run")
    argv = ["--model", str(checkpoint["single"]), "--prompt", "a", "--prompt", "b"]
    options = text_cli.read_options(parser, argv)
    assert options.prompts == ["a", "b"] and options.text.system is None
    with pytest.raises(SystemExit) as info:
        parser.parse_args(["--model", "meta-llama/Llama-3.2-1B"])
    assert info.value.code == 2
    assert "not a checkpoint directory" in capsys.readouterr().err


# ---- refusals: the caller's arguments ------------------------------------------------------------


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


def test_one_string_is_not_a_list_of_prompts(tied: Path) -> None:
    with pytest.raises(ValueError, match="list of strings") as info:
        generate_text("step14_7", tied, "the cat sat on", TextOptions(max_new_tokens=2))
    assert "['the cat sat on']" in str(info.value), "the message shows the fix"


def test_model_and_pool_overrides_together_are_refused(tied: Path) -> None:
    from step14_7 import TinyTransformerPaged

    model = TinyTransformerPaged.from_pretrained(tied, total_blocks=64)
    with pytest.raises(ValueError, match="total_blocks=1"):
        pool = TextOptions(engine=EngineOptions(total_blocks=1))
        generate_text("step14_7", tied, ["the cat"], pool, model=model)
    options = TextOptions(max_new_tokens=2, engine=EngineOptions(max_running=2))
    result = generate_text("step14_7", tied, ["the cat"], options, model=model)
    assert result.cfg.total_blocks == 64


def test_a_model_from_another_checkpoint_is_refused(tied: Path) -> None:
    from step14_7 import TinyTransformerPaged

    other = TinyTransformerPaged(CFG.replace(num_layers=3))
    with pytest.raises(ValueError, match="num_layers"):
        generate_text("step14_7", tied, ["the cat"], model=other)


# ---- --model DIR: python -m bench and every step's run.py ----------------------------------------


def test_bench_runs_on_a_checkpoint(checkpoint: dict[str, object], tmp_path: Path, capsys) -> None:
    """Every row (two steps, warm prefix, no cache, HF) computes with the checkpoint's weights
    and config, and all of them give the dense reference's tokens."""
    folder = checkpoint["single"]
    argv = "--requests 3 --prefix-len 8 --tail-len 3 --new-tokens 3 --repeats 1 --block-size 4"
    steps = f"{STEP_NAMES[0]},{STEP_NAMES[-1]}"
    code = bench_main(
        [*argv.split(), "--model", str(folder), "--steps", steps, "--out", str(tmp_path)]
    )
    out = capsys.readouterr().out
    assert code == 0, out
    assert f"model {folder}: d_model=64, 2 layers, 4 heads, vocab 62," in out
    assert "| HF generate " in out and f"| {STEP_NAMES[-1]} (warm prefix) " in out
    assert "every row produced the same tokens as the dense reference model" in out
    data = json.loads((tmp_path / "results.json").read_text())
    model = data["settings"]["model"]
    assert (model["num_kv_heads"], model["tie_word_embeddings"], model["seed"]) == (
        "2",
        "True",
        "None",
    )
    assert data["settings"]["model_name"] == str(folder)


@pytest.mark.parametrize("step_name", [STEP_NAMES[0], STEP_NAMES[-1]])
def test_run_py_serves_text_from_a_checkpoint(
    step_name: str, checkpoint: dict[str, object], capsys
) -> None:
    """``python -m <step>.run --model DIR --system ... --prompt ...``: HF's answers, word for
    word, and the shared system prompt served from the prefix cache."""
    run = importlib.import_module(f"{step_name}.run")
    argv = ["--model", str(checkpoint["single"]), "--system", SYSTEM, "--block-size", "4"]
    argv += ["--max-new-tokens", str(NEW_TOKENS)]
    for prompt in PROMPTS:
        argv += ["--prompt", prompt]
    assert run.main(argv) == 0
    out = capsys.readouterr().out
    tokenizer = checkpoint["tokenizer"]
    answers = zip(PROMPTS, checkpoint["prompt_ids"], checkpoint["expected"])
    for prompt, prompt_ids, ids in answers:
        assert f"] {prompt}\n" in out
        count = f"{len(ids)} token{'' if len(ids) == 1 else 's'}"
        reason = "length" if len(ids) == NEW_TOKENS else "stop"  # the eos is not shown
        text = after_prompt(tokenizer, prompt_ids, ids)
        assert f"-> {text}  ({count}, finish_reason={reason})" in out
    assert out.startswith(f"{step_name}: {checkpoint['single']}")
    cache = re.search(r"prefix cache: \d+/3 requests hit, (\d+)/(\d+) prompt tokens", out)
    assert cache is not None, out
    assert 0 < int(cache[1]) < int(cache[2])
