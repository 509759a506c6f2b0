"""The bench's figures beyond seconds (``bench/costs.py``, ``bench/batch.py``): model FLOPs,
the FLOP floor, peak KV memory, the warm-prefix row, the fastest-run statistic and the spread
flag.

Each formula is checked against something it does not share code with: a brute-force sum,
the model's own parameters and KV pool, the engine's counters, or Hugging Face's real cache.
"""

from __future__ import annotations

import json
from types import ModuleType

import pytest
import torch

from bench import rows as report
from bench.batch import BatchRunner, Row, RunResult
from bench.costs import (
    Floor,
    TokenWork,
    counting,
    dense_kv_bytes,
    dense_work,
    floor_work,
    model_flops,
)
from bench.models import bench_config, load_step_model
from bench.options import BenchOptions
from bench.workloads.shared_prefix import SharedPrefix
from common.config import preset
from common.memory import kv_bytes_per_block, linear_params_per_layer
from tests.helpers import STEP_NAMES

WORKLOAD = SharedPrefix(num_requests=3, prefix_len=12, tail_len=5, max_new_tokens=4, max_running=3)
CFG = bench_config(WORKLOAD, "tiny", num_kv_heads=2)  # grouped-query: k/v narrower than q
FLOOR = Floor(10**9, 100.0)  # 1 GFLOP at 100 GFLOP/s: 10 ms


def options(tmp_path: object = "unused", repeats: int = 3) -> BenchOptions:
    return BenchOptions("shared-prefix", "tiny", tuple(STEP_NAMES), repeats, str(tmp_path))


def runner(step_name: str) -> BatchRunner:
    return BatchRunner(load_step_model(step_name, CFG))


@pytest.mark.parametrize(("start", "length"), [(0, 1), (0, 16), (7, 1), (32, 16), (5, 0)])
def test_a_chunk_adds_its_tokens_and_their_context(start: int, length: int) -> None:
    work = TokenWork()
    work.add_chunk(start, length)
    assert work.tokens == length
    assert work.context == sum(p + 1 for p in range(start, start + length))


def test_linear_params_are_the_layer_matmuls_weights() -> None:
    """Every nn.Linear of a layer, counted from the model itself (k and v narrower with GQA)."""
    model = load_step_model(STEP_NAMES[-1], CFG).model
    layer = model.model.layers[0]
    linears = [m for m in layer.modules() if isinstance(m, torch.nn.Linear)]
    assert len(linears) == 7  # q k v o, gate up down
    assert linear_params_per_layer(CFG) == sum(m.weight.numel() for m in linears)


def test_model_flops_adds_up_per_term() -> None:
    """One token at position 0 generating nothing, then the attention and lm_head terms alone."""
    one = TokenWork(tokens=1, context=1, sampled=0)
    matmuls = 2 * CFG.num_layers * linear_params_per_layer(CFG)
    attention_per_key = 4 * CFG.num_layers * CFG.num_heads * CFG.d_head
    assert model_flops(CFG, one) == matmuls + attention_per_key
    assert model_flops(CFG, TokenWork(context=10)) == 10 * attention_per_key
    assert model_flops(CFG, TokenWork(sampled=3)) == 3 * 2 * CFG.d_model * CFG.vocab_size


def test_kv_bytes_per_block_is_the_pool_per_block() -> None:
    model = load_step_model(STEP_NAMES[-1], CFG).model
    pool = model.kv_pool_k.nbytes + model.kv_pool_v.nbytes
    assert kv_bytes_per_block(CFG) * CFG.total_blocks == pool


@pytest.fixture(scope="module")
def cold_runs() -> dict[str, RunResult]:
    prompts = WORKLOAD.prompts(CFG.vocab_size)
    return {name: runner(name).run(prompts, WORKLOAD) for name in STEP_NAMES}


def test_every_step_counts_the_tokens_its_engine_computed(cold_runs) -> None:
    """The counted chunks are exactly what the engine says it computed, in every step (per
    sequence calls up to step14_6, one batched call per round in step14_7), and so every step
    did the same FLOPs."""
    first = cold_runs[STEP_NAMES[0]]
    for name, result in cold_runs.items():
        assert result.outputs == first.outputs, name
        assert (result.computed_prefill_tokens, result.computed_decode_tokens) == (
            first.computed_prefill_tokens,
            first.computed_decode_tokens,
        ), name
        assert result.flops == first.flops, name
    assert 0 < first.cached_tokens < first.prompt_tokens  # the prefix was shared


def test_counted_work_equals_the_engine_counters() -> None:
    engine = runner(STEP_NAMES[-1]).engine(WORKLOAD)
    with counting(engine) as work:
        engine.generate(WORKLOAD.prompts(CFG.vocab_size), WORKLOAD.max_new_tokens)
    assert work.tokens == engine.stats.computed_tokens
    assert work.context > work.tokens  # later tokens attend to more than themselves


@pytest.mark.parametrize("step_name", [STEP_NAMES[0], STEP_NAMES[-1]])
def test_counting_watches_and_leaves_the_engine_as_it_was(step_name: str) -> None:
    """The count is an observer of the engine: nothing of the engine or its model is replaced,
    and afterwards nobody watches."""
    model = runner(step_name).model
    engine = model.engine(max_running=WORKLOAD.max_running)
    attributes = (set(vars(engine)), set(vars(model.model)))
    with counting(engine) as work:
        pass
    assert (set(vars(engine)), set(vars(model.model))) == attributes
    engine.generate(WORKLOAD.prompts(CFG.vocab_size), WORKLOAD.max_new_tokens)
    assert work.tokens == 0  # detached: it counts nothing more


@pytest.mark.parametrize("step_name", [STEP_NAMES[0], STEP_NAMES[-1]])
def test_every_chunk_is_counted_at_its_positions(step_name: str) -> None:
    """One request alone, prompt of 2 blocks + 1 token, 3 new tokens: prefill chunks at 0 and
    at each block boundary, then the 2 tokens fed back, at positions 9 and 10 (block size 4)."""
    engine = runner(step_name).engine(WORKLOAD)
    block, prompt = CFG.block_size, list(range(1, 2 * CFG.block_size + 2))
    with counting(engine) as work:
        engine.generate([prompt], 3)
    expected = TokenWork()
    for start in range(0, len(prompt), block):
        expected.add_chunk(start, min(block, len(prompt) - start))
    for position in (len(prompt), len(prompt) + 1):
        expected.add_chunk(position, 1)
    assert (work.tokens, work.context) == (expected.tokens, expected.context)


def test_without_the_cache_the_engine_does_hf_s_work() -> None:
    """Cache off, every prompt token is computed, as by a dense generate: the same formula
    gives the same FLOPs for both rows."""
    result = runner(STEP_NAMES[-1]).run(
        WORKLOAD.prompts(CFG.vocab_size), WORKLOAD, enable_prefix_cache=False
    )
    prompt_len = WORKLOAD.prefix_len + WORKLOAD.tail_len
    dense = dense_work(WORKLOAD.num_requests, prompt_len, WORKLOAD.max_new_tokens)
    assert result.flops == model_flops(CFG, dense)
    assert result.computed_prefill_tokens + result.computed_decode_tokens == dense.tokens


def test_warm_prefix_serves_the_prefix_from_the_cache(cold_runs) -> None:
    """After one earlier request, every timed request adopts the whole shared prefix (its full
    blocks); the tokens do not change; the cached prefix is counted in the peak memory."""
    prompts = WORKLOAD.prompts(CFG.vocab_size)
    earlier = WORKLOAD.earlier_prompt(CFG.vocab_size)
    assert earlier[: WORKLOAD.prefix_len] == prompts[0][: WORKLOAD.prefix_len]
    assert earlier not in prompts
    warm = runner(STEP_NAMES[-1]).run(prompts, WORKLOAD, earlier_prompt=earlier)
    cold = cold_runs[STEP_NAMES[-1]]
    assert warm.outputs == cold.outputs
    prefix_blocks = WORKLOAD.prefix_len // CFG.block_size
    assert warm.requests == WORKLOAD.num_requests  # the earlier request is not counted
    assert warm.requests_hit == WORKLOAD.num_requests
    assert warm.cached_tokens == WORKLOAD.num_requests * prefix_blocks * CFG.block_size
    assert warm.flops < cold.flops
    assert warm.blocks_peak > cold.blocks_peak  # + the earlier request's cached blocks


def test_hf_dense_cache_formula_matches_its_real_cache() -> None:
    """``dense_kv_bytes`` against the cache ``generate`` really returns."""
    pytest.importorskip("transformers")
    from front.hf import hf_llama

    cfg = preset("tiny", num_kv_heads=2)
    model = hf_llama(cfg)
    batch, prompt_len, new_tokens = 3, 9, 5
    ids = torch.randint(0, cfg.vocab_size, (batch, prompt_len), generator=torch.Generator())
    with torch.inference_mode():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            return_dict_in_generate=True,
        )
    cache = out["cache"] if "cache" in out else out["past_key_values"]  # renamed in transformers 5
    tensors = cache_tensors(cache)
    assert len(tensors) == 2 * cfg.num_layers
    real = sum(t.nbytes for t in tensors)
    assert real == dense_kv_bytes(cfg, batch, prompt_len, new_tokens)


def cache_tensors(cache: object) -> list[torch.Tensor]:
    """Every K and V tensor of HF's ``DynamicCache`` (per-layer objects since transformers 5,
    two lists before)."""
    layers = getattr(cache, "layers", None)
    if layers is not None:
        return [t for layer in layers for t in (layer.keys, layer.values)]
    return [*cache.key_cache, *cache.value_cache]


# ---- the FLOP floor ----------------------------------------------------------------------------


def test_the_floor_computes_a_shared_prefix_once() -> None:
    """Three prompts behind one 4-token prefix, tails of 2: the prefix once, each tail, then
    each answer's tokens but the last; a brute-force count of distinct prompt prefixes."""
    prompts = [[1, 2, 3, 4, 10 + i, 20 + i] for i in range(3)]
    answers = [[7, 8, 9], [7], [7, 8]]
    work = floor_work(prompts, answers)
    distinct = {tuple(p[: n + 1]) for p in prompts for n in range(len(p))}
    decode = sum(len(a) - 1 for a in answers)
    assert work.tokens == len(distinct) + decode == 4 + 3 * 2 + 3
    assert work.sampled == 6
    positions = [len(k) for k in distinct]  # a token at position p attends to p + 1 keys
    decode_context = sum(
        len(p) + 1 + k for p, a in zip(prompts, answers) for k in range(len(a) - 1)
    )
    assert work.context == sum(positions) + decode_context


def test_the_floor_is_what_the_engine_computes_cold_and_less_than_hf(cold_runs) -> None:
    """On the shared-prefix workload (block-aligned prefix) a cold engine computes exactly the
    floor: each prefix block once. HF computes the prefix once per request."""
    prompts = WORKLOAD.prompts(CFG.vocab_size)
    cold = cold_runs[STEP_NAMES[-1]]
    floor = floor_work(prompts, cold.outputs)
    assert model_flops(CFG, floor) == cold.flops
    batch, length = WORKLOAD.num_requests, WORKLOAD.prefix_len + WORKLOAD.tail_len
    hf = dense_work(batch, length, WORKLOAD.max_new_tokens)
    static = dense_work(batch, length, WORKLOAD.max_new_tokens, shared=WORKLOAD.prefix_len)
    assert model_flops(CFG, hf) > model_flops(CFG, static) == model_flops(CFG, floor)
    cached = dense_work(batch, length, WORKLOAD.max_new_tokens, WORKLOAD.prefix_len, True)
    assert cached.tokens == static.tokens - WORKLOAD.prefix_len


def test_a_row_s_multiple_of_the_floor() -> None:
    """1 GFLOP at 100 GFLOP/s is 10 ms: a row of 50 ms is 5x the floor, shown and saved."""
    assert FLOOR.seconds == pytest.approx(0.01)
    assert FLOOR.multiple(0.05) == pytest.approx(5.0)
    lines = report.table([row("step14", [0.05])], [], FLOOR).splitlines()
    titles = [cell.strip() for cell in lines[1].split("|")]
    assert lines[3].split("|")[titles.index("vs floor")].strip() == "5.0x"


# ---- the statistic and the flag -------------------------------------------------------------


def row(name: str, seconds: list[float], flops: int = 2 * 10**9) -> Row:
    """A row whose runs took ``seconds`` and gave 16 new tokens."""
    runs = [RunResult([[1] * 16], s, 4, 3, 160, 96, 64, 12, 8, 8 * 2**20, flops) for s in seconds]
    return Row(name, "what it fixed", runs)


def test_a_row_is_its_fastest_run_and_flagged_when_runs_are_far_apart() -> None:
    steady, noisy = row("steady", [1.2, 1.0, 1.5]), row("noisy", [2.0, 3.1, 2.2])
    assert (steady.best.seconds, steady.spread) == (1.0, 1.5)
    assert not steady.flagged  # exactly 1.5x apart is still within the threshold
    assert noisy.best.seconds == 2.0 and noisy.flagged
    lines = report.table([steady, noisy], [], FLOOR).splitlines()
    cells = {t.strip(): c.strip() for t, c in zip(lines[1].split("|"), lines[3].split("|"))}
    assert cells["tokens/s"] == "16.0" and cells["GFLOP/s"] == "2.0"
    assert lines[3].split("|")[3].strip() == "1.000"
    assert lines[4].split("|")[3].strip() == "2.000!"
    assert lines[4].split("|")[5].strip() == "0.50x"  # speeds from the fastest runs
    text = report.notes([steady, noisy], CFG, WORKLOAD, options(), FLOOR)
    assert "runs more than 1.5x apart (slowest / fastest): noisy." in text


def test_notes_state_both_kv_formulas() -> None:
    text = report.notes([row("a", [1.0])], CFG, WORKLOAD, options(), FLOOR).replace("\n", " ")
    kib = kv_bytes_per_block(CFG) / 1024
    assert f"blocks_peak x {kib:g} KiB" in text
    positions = WORKLOAD.prefix_len + WORKLOAD.tail_len + WORKLOAD.max_new_tokens - 1
    assert f"dense cache of {WORKLOAD.num_requests} x {positions} positions" in text
    assert "apart" not in text  # no flagged row, no warning


def test_table_and_json_carry_memory_and_flops(tmp_path) -> None:
    rows = [row("step14", [2.0]), row("step14_7", [1.0])]
    lines = report.table(rows, [], FLOOR).splitlines()
    titles = [cell.strip() for cell in lines[1].split("|")]
    cells = dict(zip(titles, (c.strip() for c in lines[3].split("|"))))
    assert cells["peak KV MiB"] == "8.00" and cells["GFLOP"] == "2.00"
    assert cells["computed tokens"] == "64 + 12" and cells["prefix reuse"] == "60%"
    report.save(options(tmp_path, 1), CFG, WORKLOAD, (rows, []), True, Floor(10**9, 123.0))
    data = json.loads((tmp_path / "results.json").read_text())
    assert data["statistic"] == "min" and data["machine"]["matmul_gflops"] == 123.0
    assert data["kv_bytes_per_block"] == kv_bytes_per_block(CFG)
    first = data["rows"][0]
    assert first["kv_peak_mib"] == 8.0 and first["flops"] == 2 * 10**9
    assert first["min_s"] == 2.0 and first["flagged"] is False
    assert first["floor_multiple"] == pytest.approx(2.0 / (10**9 / 123e9))


def test_the_step_model_takes_a_checkpoint_s_weights(step: ModuleType) -> None:
    """A seedless cfg builds shapes only; the given weights fill them (shared, not copied)."""
    from common.weights import make_state_dict

    # in the model's dtype already, as load_checkpoint hands them out
    weights = {name: w.to(CFG.dtype) for name, w in make_state_dict(CFG).items()}
    model = load_step_model(step.__name__, CFG.replace(seed=None), weights).model
    name = "model.layers.0.mlp.up_proj.weight"
    assert model.state_dict()[name].data_ptr() == weights[name].data_ptr()
