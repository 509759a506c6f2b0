"""What real Llama checkpoints use beyond the chapter's model: grouped-query attention,
``head_dim``, tied embeddings, ``llama3`` RoPE scaling. Exact float64 parity with the dense
reference for every step, and the pieces on their own (no Hugging Face needed here; the
outside oracle is ``tests/engine/test_hf_oracle.py``)."""

from __future__ import annotations

import math
import random
from types import ModuleType

import pytest
import torch

from common.config import Llama3RopeScaling, ModelConfig, preset
from common.layers import llama3_scaled_inv_freq, rope_inv_freq
from common.numbers import cdiv
from common.reference import ReferenceModel
from common.weights import CheckpointError, make_state_dict
from tests.helpers import reference_model, tiny_config

F64_REL_TOL = 1e-9  # as in tests/engine/test_model.py: only summation order differs
LLAMA3 = Llama3RopeScaling(4.0, 1.0, 4.0, 32)

FEATURES: dict[str, dict[str, object]] = {
    "gqa-2-per-kv": {"num_kv_heads": 2},
    "gqa-4-per-kv": {"num_heads": 8, "num_kv_heads": 2},
    "mqa": {"num_kv_heads": 1},
    "head-dim-32": {"head_dim": 32, "num_kv_heads": 2},
    "tied": {"tie_word_embeddings": True},
    "llama3-rope": {"rope_scaling": LLAMA3},
    "all": {"num_kv_heads": 2, "tie_word_embeddings": True, "rope_scaling": LLAMA3},
}


@pytest.mark.parametrize("name", FEATURES)
def test_paged_forward_matches_reference_exactly(step: ModuleType, name: str) -> None:
    """Ragged chunks through a scattered block table: the reference's logits, to float64
    precision, for each feature (and all together)."""
    cfg = tiny_config(**FEATURES[name])
    rng = random.Random(5)
    tokens = [rng.randrange(cfg.vocab_size) for _ in range(23)]
    table = rng.sample(range(cfg.total_blocks), cdiv(23, cfg.block_size))
    model = step.TinyTransformerPaged(cfg)
    logits, start = [], 0
    for size in (4, 1, 9, 1, 8):
        logits.append(model(tokens[start : start + size], table, start))
        start += size
    expected = reference_model(cfg)(tokens)
    err = (torch.cat(logits) - expected).abs().max().item()
    assert err <= F64_REL_TOL * expected.abs().max().item()


# ---- config ---------------------------------------------------------------------------------


def test_kv_heads_and_head_dim_default_and_follow_replace() -> None:
    cfg = preset("tiny")
    assert (cfg.num_kv_heads, cfg.d_head, cfg.num_queries_per_kv) == (4, 16, 1)
    wider = cfg.replace(num_heads=8)  # derived defaults are derived again
    assert (wider.num_kv_heads, wider.d_head) == (8, 8)
    gqa = cfg.replace(num_kv_heads=2)  # a given value stays given
    assert gqa.replace(num_heads=8).num_kv_heads == 2
    assert gqa.replace(num_heads=8).num_queries_per_kv == 4
    assert cfg.replace(head_dim=32).replace(num_heads=2).d_head == 32


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"num_kv_heads": 3}, "not a multiple of num_kv_heads"),
        ({"num_kv_heads": 0}, "num_kv_heads must be >= 1"),
        ({"head_dim": 7}, "must be even"),
        ({"num_heads": 5}, "not divisible by num_heads"),
    ],
)
def test_bad_geometry_is_refused(changes: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        preset("tiny", **changes)


def test_head_dim_need_not_divide_d_model() -> None:
    """Some checkpoints set ``head_dim`` so that heads x head_dim != hidden_size."""
    cfg = preset("tiny", num_heads=5, head_dim=16, num_kv_heads=1)
    shapes = {k: tuple(v.shape) for k, v in make_state_dict(cfg).items()}
    assert shapes["model.layers.0.self_attn.q_proj.weight"] == (80, 64)
    assert shapes["model.layers.0.self_attn.k_proj.weight"] == (16, 64)
    assert shapes["model.layers.0.self_attn.o_proj.weight"] == (64, 80)


def test_llama3_scaling_config_is_checked() -> None:
    with pytest.raises(ValueError, match="low_freq_factor < high_freq_factor"):
        Llama3RopeScaling(8.0, 4.0, 1.0, 8192)


# ---- llama3 RoPE scaling ---------------------------------------------------------------------


def test_llama3_scaling_bands() -> None:
    """Short wavelengths kept, long ones divided by ``factor``, the band between blended
    monotonically, with no jump at either edge."""
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, 128, 2, dtype=torch.float64) / 128))
    s = Llama3RopeScaling(8.0, 1.0, 4.0, 8192)
    scaled = llama3_scaled_inv_freq(inv_freq, s)
    wavelen = 2 * math.pi / inv_freq
    short, long_ = wavelen < 8192 / 4, wavelen > 8192 / 1
    middle = ~short & ~long_
    assert short.any() and long_.any() and middle.any()
    assert torch.equal(scaled[short], inv_freq[short])
    assert torch.allclose(scaled[long_], inv_freq[long_] / 8.0, rtol=1e-15)
    ratio = scaled[middle] / inv_freq[middle]  # strictly between 1 and 1/8, decreasing
    assert (ratio < 1).all() and (ratio > 1 / 8).all()
    assert (ratio[1:] < ratio[:-1]).all()
    # Halfway through the band (8192 / wavelength = 2.5): half kept, half stretched.
    mid = llama3_scaled_inv_freq(torch.tensor([2.5 * 2 * math.pi / 8192], dtype=torch.float64), s)
    assert torch.allclose(mid, torch.tensor([2.5 * 2 * math.pi / 8192 * (0.5 + 0.5 / 8)]).double())
    edges = llama3_scaled_inv_freq(torch.tensor([2 * math.pi / 2048, 2 * math.pi / 8192]), s)
    assert torch.allclose(edges, torch.tensor([2 * math.pi / 2048, 2 * math.pi / 8192 / 8]))


def test_rope_inv_freq_uses_the_scaling() -> None:
    plain = rope_inv_freq(tiny_config())
    scaled = rope_inv_freq(tiny_config(rope_scaling=LLAMA3))
    assert plain[0] == scaled[0]  # the fastest pair is local order: untouched
    assert torch.allclose(scaled[-1], plain[-1] / 4.0)  # the slowest is stretched


# ---- weights ---------------------------------------------------------------------------------


def test_tied_model_has_one_matrix(step: ModuleType) -> None:
    model = step.TinyTransformerPaged(tiny_config(tie_word_embeddings=True))
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert "lm_head.weight" not in make_state_dict(model.cfg)


def test_gqa_pool_is_smaller(step: ModuleType) -> None:
    mha = step.TinyTransformerPaged(tiny_config())
    gqa = step.TinyTransformerPaged(tiny_config(num_kv_heads=1))
    assert mha.kv_pool_k.numel() == 4 * gqa.kv_pool_k.numel()


def test_load_weights_refuses_what_does_not_fit() -> None:
    cfg = tiny_config(num_kv_heads=2)
    weights = make_state_dict(cfg)
    weights["model.layers.0.self_attn.v_proj.weight"] = torch.zeros(64, 64)
    del weights["model.norm.weight"]
    with pytest.raises(CheckpointError) as info:
        ReferenceModel(cfg.replace(seed=None)).load_weights(weights)
    text = str(info.value)
    assert "missing tensor model.norm.weight" in text
    assert "v_proj.weight has shape (64, 64), the config implies (32, 64)" in text


def test_seedless_model_has_no_weights_until_loaded() -> None:
    """``seed=None`` (what ``from_pretrained`` builds): shapes only, nothing drawn."""
    cfg: ModelConfig = tiny_config(seed=None)
    model = ReferenceModel(cfg)
    assert model.lm_head.weight.is_meta
    model.load_weights(make_state_dict(cfg.replace(seed=0)))
    assert not model.lm_head.weight.is_meta
    assert model.lm_head.weight.dtype == torch.float64
