"""The paged model against the dense reference: same logits however a sequence is chunked and
wherever its blocks lie in the pool, the Hugging Face parameter layout, and the shared layers."""

from __future__ import annotations

import math
import random
from types import ModuleType

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from common.config import ModelConfig
from common.layers import RMSNorm, apply_rope, rope_cos_sin
from common.numbers import cdiv
from common.reference import ReferenceModel
from tests.helpers import reference_model, tiny_config

# float64 parity: only summation order differs, so errors are ~1e-14 of the logit scale.
F64_REL_TOL = 1e-9
# float32 against float64: observed ~2e-5 on logits of std ~8; 1e-3 is 50x that and still
# far below the top-1/top-2 margins that decide greedy tokens.
F32_ABS_TOL = 1e-3

SETTINGS = settings(
    max_examples=12,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)


# ---- helpers --------------------------------------------------------------------------------


def random_tokens(cfg: ModelConfig, n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(cfg.vocab_size) for _ in range(n)]


def blocks_for(cfg: ModelConfig, n_tokens: int) -> int:
    return cdiv(n_tokens, cfg.block_size)


def run_in_chunks(
    model: torch.nn.Module, tokens: list[int], chunk_sizes: list[int], block_table: list[int]
) -> torch.Tensor:
    """Feed ``tokens`` chunk by chunk, as prefill and decode do, and stack the logits."""
    assert sum(chunk_sizes) == len(tokens)
    logits, start = [], 0
    for size in chunk_sizes:
        logits.append(model(tokens[start : start + size], block_table, start))
        start += size
    return torch.cat(logits)


def oracle_logits(cfg: ModelConfig, tokens: list[int]) -> torch.Tensor:
    """The reference's logits over the full sequence, always in float64."""
    return reference_model(cfg.replace(dtype=torch.float64))(tokens)


def assert_max_error(actual: torch.Tensor, expected: torch.Tensor, atol: float) -> None:
    assert actual.shape == expected.shape
    err = (actual.double() - expected.double()).abs().max().item()
    assert err <= atol, f"max |error| {err:.3g} > {atol:.3g}"


def assert_matches_reference(
    model: torch.nn.Module, tokens: list[int], chunk_sizes: list[int], block_table: list[int]
) -> None:
    """Chunked paged logits equal the dense reference's to float64 precision."""
    expected = oracle_logits(model.cfg, tokens)
    actual = run_in_chunks(model, tokens, chunk_sizes, block_table)
    assert_max_error(actual, expected, F64_REL_TOL * expected.abs().max().item())


def split_evenly(n: int, size: int) -> list[int]:
    return [min(size, n - start) for start in range(0, n, size)]


@st.composite
def chunk_splits(draw: st.DrawFn, n_tokens: int) -> list[int]:
    """A random split of ``n_tokens`` into positive chunk sizes (1-token to multi-block)."""
    sizes, left = [], n_tokens
    while left:
        size = draw(st.integers(1, min(left, 11)))
        sizes.append(size)
        left -= size
    return sizes


# ---- paged forward == reference -------------------------------------------------------------


def table_layouts(cfg: ModelConfig, n_blocks: int) -> dict[str, list[int]]:
    """Block tables that put a sequence's blocks in very different places of the pool."""
    perm = random.Random(7).sample(range(cfg.total_blocks), n_blocks)
    return {
        "contiguous": list(range(n_blocks)),
        "offset": list(range(50, 50 + n_blocks)),
        "strided": list(range(1, 3 * n_blocks, 3)),
        "reversed": list(range(cfg.total_blocks - 1, cfg.total_blocks - 1 - n_blocks, -1)),
        "permutation": perm,
    }


@pytest.mark.parametrize("layout", ["contiguous", "offset", "strided", "reversed", "permutation"])
@pytest.mark.parametrize("chunking", ["whole", "block", "single", "ragged"])
def test_chunked_forward_matches_reference(step: ModuleType, layout: str, chunking: str) -> None:
    """Whatever blocks hold the sequence and however it is chunked, the logits are the same."""
    cfg = tiny_config()
    tokens = random_tokens(cfg, 23, seed=1)
    chunks = {
        "whole": [23],
        "block": split_evenly(23, cfg.block_size),
        "single": [1] * 23,
        "ragged": [3, 1, 9, 2, 1, 7],  # chunks that straddle block boundaries and span blocks
    }[chunking]
    table = table_layouts(cfg, blocks_for(cfg, 23))[layout]
    assert_matches_reference(step.TinyTransformerPaged(cfg), tokens, chunks, table)


@SETTINGS
@given(data=st.data(), n_tokens=st.integers(1, 30), seed=st.integers(0, 2**16))
def test_random_chunks_and_tables_match_reference(
    step: ModuleType, data: st.DataObject, n_tokens: int, seed: int
) -> None:
    """Random splits and random permutations of pool blocks (spare blocks at the end too)."""
    cfg = tiny_config()
    n_blocks = blocks_for(cfg, n_tokens) + data.draw(st.integers(0, 2))
    block_ids = st.integers(0, cfg.total_blocks - 1)
    table = data.draw(st.lists(block_ids, min_size=n_blocks, max_size=n_blocks, unique=True))
    chunks = data.draw(chunk_splits(n_tokens))
    tokens = random_tokens(cfg, n_tokens, seed)
    assert_matches_reference(step.TinyTransformerPaged(cfg), tokens, chunks, table)


@pytest.mark.parametrize(
    "changes",
    [
        {"block_size": 1},
        {"block_size": 3},
        {"block_size": 16},
        {"rope_theta": 50.0},
        {"rms_norm_eps": 0.5},
        {"num_heads": 8, "seed": 3},
    ],
    ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()),
)
def test_other_configs_match_reference(step: ModuleType, changes: dict[str, object]) -> None:
    """Geometry and the config's rope_theta / rms_norm_eps are honoured, not hard-coded."""
    cfg = tiny_config(**changes)
    tokens = random_tokens(cfg, 19, seed=2)
    table = list(range(blocks_for(cfg, 19)))[::-1]
    assert_matches_reference(step.TinyTransformerPaged(cfg), tokens, [5, 1, 13], table)


@pytest.mark.parametrize("changes", [{"rope_theta": 50.0}, {"rms_norm_eps": 0.5}])
def test_config_changes_change_logits(changes: dict[str, object]) -> None:
    """Guards the test above: the changed fields really move the logits, so honouring them
    is observable."""
    tokens = random_tokens(tiny_config(), 19, seed=2)
    base = oracle_logits(tiny_config(), tokens)
    changed = oracle_logits(tiny_config(**changes), tokens)
    assert (base - changed).abs().max().item() > 1e-3


def run_interleaved(
    model: torch.nn.Module, seqs: list[list[int]], tables: list[list[int]], splits: list[list[int]]
) -> list[torch.Tensor]:
    """Feed several sequences' chunks round-robin, as the engine does; logits per sequence."""
    outputs: list[list[torch.Tensor]] = [[] for _ in seqs]
    starts = [0] * len(seqs)
    for round_ in range(max(map(len, splits))):
        for s, (tokens, table, sizes) in enumerate(zip(seqs, tables, splits)):
            if round_ < len(sizes):
                end = starts[s] + sizes[round_]
                outputs[s].append(model(tokens[starts[s] : end], table, starts[s]))
                starts[s] = end
    return [torch.cat(chunks) for chunks in outputs]


def test_interleaved_sequences_do_not_disturb_each_other(step: ModuleType) -> None:
    """Two sequences in one pool, chunks alternating, blocks interleaved: both stay exact."""
    cfg = tiny_config()
    seqs = [random_tokens(cfg, 21, seed=3), random_tokens(cfg, 17, seed=4)]
    tables = [[9, 2, 7, 0, 5, 11], [1, 8, 3, 6, 10]]  # disjoint, interleaved in the pool
    splits = [[4, 1, 6, 3, 7], [2, 5, 1, 9]]
    actual = run_interleaved(step.TinyTransformerPaged(cfg), seqs, tables, splits)
    for tokens, logits in zip(seqs, actual):
        expected = oracle_logits(cfg, tokens)
        assert_max_error(logits, expected, F64_REL_TOL * expected.abs().max().item())


def test_float32_logits_close_to_float64_reference(step: ModuleType) -> None:
    """float32 paged logits within a small absolute tolerance of the float64 oracle, and the
    same greedy choice at every position."""
    cfg = tiny_config(dtype=torch.float32)
    tokens = random_tokens(cfg, 29, seed=5)
    table = random.Random(5).sample(range(cfg.total_blocks), blocks_for(cfg, 29))
    actual = run_in_chunks(step.TinyTransformerPaged(cfg), tokens, [6, 1, 1, 9, 12], table)
    assert actual.dtype == torch.float32
    expected = oracle_logits(cfg, tokens)
    assert expected.std().item() > 4.0  # the tolerance is small relative to this spread
    assert_max_error(actual, expected, F32_ABS_TOL)
    assert torch.equal(actual.argmax(-1), expected.argmax(-1))


@pytest.mark.parametrize(
    ("n_blocks", "start_pos", "chunk_len"),
    [(0, 0, 1), (1, 0, 5), (2, 6, 3), (3, 12, 1), (3, 0, 13)],
)
def test_short_block_table_raises(
    step: ModuleType, n_blocks: int, start_pos: int, chunk_len: int
) -> None:
    """A table that cannot hold positions 0 .. start_pos+T-1 is an error, not a silent write."""
    cfg = tiny_config()
    assert n_blocks * cfg.block_size < start_pos + chunk_len
    model = step.TinyTransformerPaged(cfg)
    with pytest.raises(ValueError):
        model(random_tokens(cfg, chunk_len, seed=6), list(range(n_blocks)), start_pos)


# ---- parameters and buffers -----------------------------------------------------------------


def hf_llama_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The LlamaForCausalLM state dict layout, written out independently of common.weights."""
    d, f, v = cfg.d_model, cfg.d_ff, cfg.vocab_size
    shapes = {"model.embed_tokens.weight": (v, d), "model.norm.weight": (d,)}
    shapes["lm_head.weight"] = (v, d)
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        for proj in "qkvo":
            shapes[f"{p}self_attn.{proj}_proj.weight"] = (d, d)
        shapes[f"{p}mlp.gate_proj.weight"] = (f, d)
        shapes[f"{p}mlp.up_proj.weight"] = (f, d)
        shapes[f"{p}mlp.down_proj.weight"] = (d, f)
        shapes[f"{p}input_layernorm.weight"] = (d,)
        shapes[f"{p}post_attention_layernorm.weight"] = (d,)
    return shapes


@pytest.mark.parametrize("num_layers", [1, 3])
def test_state_dict_is_hf_llama(step: ModuleType, num_layers: int) -> None:
    """Weights only, under HF names and shapes: a real checkpoint could be loaded as is."""
    cfg = tiny_config(num_layers=num_layers, d_ff=100, vocab_size=300)
    state = step.TinyTransformerPaged(cfg).state_dict()
    assert {k: tuple(t.shape) for k, t in state.items()} == hf_llama_shapes(cfg)
    assert not any("kv_pool" in k for k in state)


@pytest.mark.parametrize("num_kv_heads", [None, 2, 1], ids=["mha", "gqa", "mqa"])
def test_kv_pool_shape(step: ModuleType, num_kv_heads: int | None) -> None:
    """``[layers, blocks, block_size, kv_heads, d_head]``: the chapter's num_heads by default;
    grouped-query attention stores only its K/V heads, so every block shrinks."""
    cfg = tiny_config(
        num_layers=3, total_blocks=17, block_size=5, num_heads=4, num_kv_heads=num_kv_heads
    )
    model = step.TinyTransformerPaged(cfg)
    shape = (3, 17, 5, num_kv_heads or 4, cfg.d_head)
    assert tuple(model.kv_pool_k.shape) == shape
    assert tuple(model.kv_pool_v.shape) == shape
    assert model.kv_pool_k.dtype == model.kv_pool_v.dtype == cfg.dtype


def weight_differences(a: torch.nn.Module, b: torch.nn.Module) -> dict[str, bool]:
    """For every parameter name: do the two models hold different values?"""
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    return {k: not torch.equal(sa[k], sb[k]) for k in sa}


def test_same_seed_same_weights_as_reference(step: ModuleType) -> None:
    cfg = tiny_config(seed=11)
    diffs = weight_differences(step.TinyTransformerPaged(cfg), ReferenceModel(cfg))
    assert not any(diffs.values()), [k for k, d in diffs.items() if d]


def test_different_seed_different_weights(step: ModuleType) -> None:
    a = step.TinyTransformerPaged(tiny_config(seed=11))
    b = step.TinyTransformerPaged(tiny_config(seed=12))
    diffs = weight_differences(a, b)
    assert all(diffs.values()), [k for k, d in diffs.items() if not d]


# ---- common.layers --------------------------------------------------------------------------


def random_heads(n: int, cfg: ModelConfig, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, cfg.num_heads, cfg.d_head, generator=gen, dtype=torch.float64)


def rotate(x: torch.Tensor, positions: list[int], cfg: ModelConfig) -> torch.Tensor:
    cos, sin = rope_cos_sin(torch.tensor(positions), cfg)
    return apply_rope(x, cos, sin)


def test_rope_at_position_zero_is_identity() -> None:
    cfg = tiny_config()
    x = random_heads(1, cfg, seed=0)
    assert torch.equal(rotate(x, [0], cfg), x)


def test_rope_preserves_norms() -> None:
    """A rotation: vector lengths survive at any position."""
    cfg = tiny_config()
    x = random_heads(5, cfg, seed=1)
    rotated = rotate(x, [1, 7, 100, 1000, 4095], cfg)
    assert_max_error(rotated.norm(dim=-1), x.norm(dim=-1), atol=1e-12 * x.norm(dim=-1).max())
    assert not torch.allclose(rotated, x)


@pytest.mark.parametrize("theta", [10000.0, 50.0])
def test_rope_scores_depend_on_relative_position_only(theta: float) -> None:
    """q at m and k at n score like q at m+s and k at n+s: what makes cached KV reusable."""
    cfg = tiny_config(rope_theta=theta)
    q, k = random_heads(1, cfg, seed=2), random_heads(1, cfg, seed=3)

    def score(m: int, n: int) -> torch.Tensor:
        return (rotate(q, [m], cfg) * rotate(k, [n], cfg)).sum(-1)

    base = score(9, 4)
    for shift in (1, 13, 250):
        assert_max_error(score(9 + shift, 4 + shift), base, atol=1e-9)
    assert not torch.allclose(score(9, 5), base)  # a different distance scores differently


def test_rope_uses_config_theta() -> None:
    pos = torch.tensor([3])
    cos_a, _ = rope_cos_sin(pos, tiny_config(rope_theta=10000.0))
    cos_b, _ = rope_cos_sin(pos, tiny_config(rope_theta=50.0))
    assert not torch.allclose(cos_a, cos_b)


def test_rmsnorm_normalizes_and_is_scale_invariant() -> None:
    norm = RMSNorm(64, eps=1e-12).double()
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    y = norm(x)
    assert_max_error(y.pow(2).mean(-1), torch.ones(3, dtype=torch.float64), atol=1e-9)
    assert_max_error(norm(37.0 * x), y, atol=1e-9)


def test_rmsnorm_weight_and_eps() -> None:
    """The weight scales each feature; eps is added to the mean square, as in HF Llama."""
    x = torch.full((1, 4), 2.0, dtype=torch.float64)
    norm = RMSNorm(4, eps=5.0).double()
    with torch.no_grad():
        norm.weight.copy_(torch.tensor([1.0, 2.0, 3.0, 4.0]))
    expected = torch.tensor([[1.0, 2.0, 3.0, 4.0]], dtype=torch.float64) * 2.0 / math.sqrt(9.0)
    assert_max_error(norm(x), expected, atol=1e-12)


def test_rmsnorm_keeps_low_precision_dtype() -> None:
    norm = RMSNorm(8, eps=1e-6).to(torch.bfloat16)
    assert norm(torch.randn(2, 8).to(torch.bfloat16)).dtype == torch.bfloat16
