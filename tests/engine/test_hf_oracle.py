"""Hugging Face ``LlamaForCausalLM`` as an outside oracle for every step.

The dense reference (``common.reference``) shares ``common/layers.py`` with the steps, so a
convention that is wrong in both (the interleaved RoPE layout instead of Llama's rotate-half,
query head ``h`` reading K/V head ``h % kv`` instead of ``h // group``) would pass every parity
test. Here the same weights go into HF's model, and every step must give its greedy tokens,
token for token, and its logits within ``HF_ABS_TOL``. The last tests show that the tolerance
is far below what such a wrong convention costs.
"""

from __future__ import annotations

import random
from functools import cache
from types import ModuleType

import pytest
import torch

pytest.importorskip("transformers")

import common.layers
import common.reference
from common.config import Llama3RopeScaling, ModelConfig, preset
from common.numbers import cdiv
from common.reference import ReferenceModel
from front.hf import hf_llama
from tests.helpers import hf_greedy as hf_greedy_of

# HF computes its RoPE angles in float32 even for a float64 model, so against our float64
# logits it is off by ~1e-5 (observed 7e-6 .. 1.2e-5 on logits of std ~8); in float32, HF's
# eager attention and ours agree to ~1e-5 or better. 2e-4 is ~20x that; the wrong conventions
# in the last tests move logits by more than 20 (observed), five orders of magnitude above it.
HF_ABS_TOL = 2e-4
WRONG_CONVENTION_MIN_ERROR = 100 * HF_ABS_TOL

LLAMA3 = Llama3RopeScaling(
    factor=4.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=64
)

# name -> (preset, changes). original_max_position_embeddings=64 puts the tiny model's
# wavelengths in all three llama3 bands, below 16 kept, 16..64 blended, above 64 stretched: at
# θ = 500000 they are 6.3, 32.5, 168, ...; at θ = 10000, 6.3, 19.9, 62.8, 199, ...
CONFIGS: dict[str, tuple[str, dict[str, object]]] = {
    "tiny": ("tiny", {}),
    "demo": ("demo", {"num_layers": 2}),
    "gqa-2-per-kv": ("tiny", {"num_kv_heads": 2}),
    "gqa-4-per-kv": ("tiny", {"num_heads": 8, "num_kv_heads": 2}),
    "mqa": ("tiny", {"num_kv_heads": 1}),
    "head-dim-32": ("tiny", {"head_dim": 32, "num_kv_heads": 2}),
    "tied": ("tiny", {"tie_word_embeddings": True}),
    "llama3-rope": ("tiny", {"rope_scaling": LLAMA3, "rope_theta": 500000.0}),
    "theta-eps": ("tiny", {"rope_theta": 50.0, "rms_norm_eps": 0.25}),
    "float64-all": (
        "tiny",
        {
            "dtype": torch.float64,
            "num_kv_heads": 2,
            "tie_word_embeddings": True,
            "rope_scaling": LLAMA3,
        },
    ),
}


def config(name: str) -> ModelConfig:
    base, changes = CONFIGS[name]
    return preset(base, **changes)


def prompts_for(cfg: ModelConfig) -> list[list[int]]:
    """Three prompts behind a shared prefix of 2.5 blocks, of different lengths."""
    rng = random.Random(cfg.vocab_size)
    shared = [rng.randrange(cfg.vocab_size) for _ in range(cfg.block_size * 5 // 2)]
    return [shared + [rng.randrange(cfg.vocab_size) for _ in range(n)] for n in (1, 6, 11)]


@cache
def hf_model(cfg: ModelConfig) -> torch.nn.Module:
    return hf_llama(cfg, attn="eager")


@cache
def hf_greedy(cfg: ModelConfig, max_new_tokens: int) -> list[list[int]]:
    """HF ``generate`` per prompt (no padding), greedy, exactly ``max_new_tokens`` tokens."""
    return hf_greedy_of(hf_model(cfg), prompts_for(cfg), max_new_tokens)


def hf_logits(cfg: ModelConfig, tokens: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return hf_model(cfg)(torch.tensor([tokens])).logits[0].double()


def max_error(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape
    return (a.double() - b.double()).abs().max().item()


def chunked_logits(model: torch.nn.Module, tokens: list[int], sizes: list[int]) -> torch.Tensor:
    """The paged model fed chunk by chunk through a scattered block table."""
    cfg = model.cfg
    n_blocks = cdiv(len(tokens), cfg.block_size)
    table = random.Random(1).sample(range(cfg.total_blocks), n_blocks)
    logits, start = [], 0
    for size in sizes:
        logits.append(model(tokens[start : start + size], table, start))
        start += size
    return torch.cat(logits)


@pytest.mark.parametrize("name", CONFIGS)
def test_logits_match_hf(step: ModuleType, name: str) -> None:
    """A prompt fed in ragged chunks (prefill-sized, decode-sized) gives HF's logits."""
    cfg = config(name)
    tokens = prompts_for(cfg)[2]
    sizes = [5, 1, cfg.block_size + 3, 1, len(tokens) - cfg.block_size - 10]
    actual = chunked_logits(step.TinyTransformerPaged(cfg), tokens, sizes)
    expected = hf_logits(cfg, tokens)
    assert expected.std().item() > 4.0  # the tolerance is tiny next to the logits' spread
    assert max_error(actual, expected) <= HF_ABS_TOL
    assert torch.equal(actual.argmax(-1), expected.argmax(-1))


@pytest.mark.parametrize("name", CONFIGS)
def test_tokens_match_hf_generate(step: ModuleType, name: str) -> None:
    """The engine (batched, prefix cache on) generates HF's greedy tokens, token for token."""
    cfg = config(name)
    engine = step.PagedPrefixCacheEngine(step.TinyTransformerPaged(cfg), max_running=2)
    outputs = engine.generate(prompts_for(cfg), max_new_tokens=8)
    assert outputs == hf_greedy(cfg, 8)
    assert engine.stats.requests_hit >= 1  # the shared prefix really was served from the cache


def test_configs_really_differ() -> None:
    """Guards the tests above: each feature changes the logits, so honouring it is visible."""
    tokens = prompts_for(config("tiny"))[2]
    base = ReferenceModel(config("tiny"))(tokens)
    for name in ("tied", "llama3-rope", "theta-eps"):
        assert max_error(ReferenceModel(config(name))(tokens), base) > 1.0, name


# ---- the tolerance is meaningful: wrong conventions miss it by orders of magnitude ----------


def interleaved_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """GPT-J / original-paper RoPE: rotate pairs (0,1), (2,3), ... instead of (i, i + d/2)."""
    pairs = x.unflatten(-1, (-1, 2))
    c, s = cos[:, None, : x.shape[-1] // 2, None], sin[:, None, : x.shape[-1] // 2, None]
    x1, x2 = pairs[..., :1], pairs[..., 1:]
    return torch.cat((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1).flatten(-2)


def tiled_kv_attention(q, k, v, allowed):
    """Query head ``h`` reading K/V head ``h % kv``: ``repeat``, not ``repeat_interleave``."""
    group = q.shape[1] // k.shape[1]
    return ORIGINAL_DENSE_ATTENTION(q, k.repeat(1, group, 1), v.repeat(1, group, 1), allowed)


ORIGINAL_DENSE_ATTENTION = common.reference.dense_attention


@pytest.mark.parametrize(
    ("name", "target", "wrong"),
    [
        ("tiny", "common.layers.apply_rope", interleaved_rope),
        ("gqa-2-per-kv", "common.reference.dense_attention", tiled_kv_attention),
        ("gqa-4-per-kv", "common.reference.dense_attention", tiled_kv_attention),
    ],
    ids=["interleaved-rope", "kv-head-h%kv-2", "kv-head-h%kv-4"],
)
def test_wrong_convention_breaks_the_tolerance(
    monkeypatch: pytest.MonkeyPatch, name: str, target: str, wrong: object
) -> None:
    """The reference with a plausible wrong convention is far outside ``HF_ABS_TOL``; with the
    right one it is inside (so the comparison, not luck, separates them)."""
    cfg = config(name).replace(dtype=torch.float64)
    tokens = prompts_for(cfg)[2]
    expected = hf_logits(cfg, tokens)
    assert max_error(ReferenceModel(cfg)(tokens), expected) <= HF_ABS_TOL
    module, attr = target.rsplit(".", 1)
    modules = {"common.layers": common.layers, "common.reference": common.reference}
    monkeypatch.setattr(modules[module], attr, wrong)
    assert max_error(ReferenceModel(cfg)(tokens), expected) > WRONG_CONVENTION_MIN_ERROR
