"""Sampling: ``SamplingParams``, the sampler and the round's ``RequestOutput``s.

Three oracles. Hugging Face's logits warpers say what the filtered distribution must be
(temperature, top-k, top-p, on random logits with ties and boundaries). A chi-square test says
the draws follow it (fixed seeds: it cannot flake). The dense reference model, sampling with
the same seeds, says which tokens every step must produce: the k-th draw of a request depends on
its seed, k and its logits alone, so batching, preemption and the prefix cache change nothing,
and the suite checks it the way it checks greedy decoding. Then the outputs each round hands
back: new tokens, every token so far, and why a request ended.
"""

from __future__ import annotations

import math
import random
from dataclasses import asdict, replace
from functools import cache

import pytest
import torch

from common import scoring
from common.errors import RequestError
from common.reference import reference_generate
from common.sampler import (
    SamplingState,
    apply_min_tokens_and_penalties,
    exponentials,
    filter_logits,
    sample,
)
from common.sampling_params import RequestOutput, SamplingParams, TokenLogprobs
from front.steps import load_step
from tests.engine.test_random_scenarios import new_engine, scenario
from tests.helpers import (
    EngineFactory,
    budget_args,
    has_fix,
    prefill_chunk,
    reference_model,
    tiny_config,
    tokens,
)


def drawn(logits: torch.Tensor, params: list[SamplingParams], ks: list[int]) -> list[int]:
    """The sampler's tokens for rows whose requests have drawn ``ks[i]`` tokens so far (which
    ones does not matter: no penalty here), nothing to hold back."""
    states = [SamplingState(p, (), [0] * k) for p, k in zip(params, ks, strict=True)]
    return sample(logits, states).token_ids


# ---- SamplingParams: vLLM's names, checked when made -------------------------------------------

BAD_PARAMS = {
    "max_tokens": [0, -1, 2.0, "4", None, True],
    "temperature": [-0.1, math.inf, math.nan, "1", None, True],
    "top_p": [0, 0.0, -0.5, 1.5, math.nan, None],
    "top_k": [-2, 1.5, "3", None],
    "seed": [-1, 2**63, 1.0, "7"],
    "stop_token_ids": [[-1], [1.5], "12", 3],
    "presence_penalty": [-2.01, 2.5, math.nan, math.inf, "1", None, True],
    "frequency_penalty": [-3, 2.01, math.nan, "0", None],
    "repetition_penalty": [0, 0.0, -1.2, math.inf, math.nan, None, True],
    "min_p": [-0.1, 1.01, math.nan, None, "0.1"],
    "min_tokens": [-1, 1.5, 17, None, True],  # 17: more than max_tokens (16)
    "logprobs": [-1, 1.5, "2", True],
    "prompt_logprobs": [-1, 2.0, "0", False],
}


@pytest.mark.parametrize(
    ("name", "value"), [(n, v) for n, values in BAD_PARAMS.items() for v in values]
)
def test_a_bad_value_is_refused_naming_its_field(name: str, value: object) -> None:
    with pytest.raises(ValueError, match=rf"SamplingParams\.{name} "):
        SamplingParams(**{name: value})


def test_good_values_are_kept_in_plain_types() -> None:
    params = SamplingParams(
        max_tokens=torch.tensor(3), temperature=1, top_k=-1, seed=5, stop_token_ids=[7, 2]
    )
    assert (params.max_tokens, params.temperature, params.top_k) == (3, 1.0, 0)
    assert type(params.max_tokens) is int and type(params.temperature) is float
    assert params.stop_token_ids == (7, 2)
    assert SamplingParams().greedy and not params.greedy
    vllm = SamplingParams(
        max_tokens=4,
        presence_penalty=-2,
        frequency_penalty=torch.tensor(2),
        repetition_penalty=3,
        min_p=1,
        min_tokens=4,
        logprobs=torch.tensor(0),
        prompt_logprobs=5,
    )
    values = (vllm.presence_penalty, vllm.frequency_penalty, vllm.repetition_penalty, vllm.min_p)
    assert values == (-2.0, 2.0, 3.0, 1.0) and {type(v) for v in values} == {float}
    assert (vllm.min_tokens, vllm.logprobs, vllm.prompt_logprobs) == (4, 0, 5)
    assert type(vllm.logprobs) is int and vllm.has_penalties
    assert not SamplingParams().has_penalties
    assert SamplingParams(repetition_penalty=1.01).has_penalties


def test_min_tokens_is_checked_against_this_requests_max_tokens() -> None:
    assert SamplingParams(max_tokens=40, min_tokens=40).min_tokens == 40
    with pytest.raises(RequestError, match=r"min_tokens .*max_tokens is 3") as info:
        SamplingParams(max_tokens=3, min_tokens=4)
    assert info.value.param == "min_tokens"


# ---- the filters equal Hugging Face's warpers --------------------------------------------------


def hf_filtered(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Hugging Face's sampling filters, in the order ``generate`` applies them."""
    warpers = pytest.importorskip("transformers.generation.logits_process")
    scores = warpers.TemperatureLogitsWarper(params.temperature)(None, logits[None].float())
    if params.top_k:
        scores = warpers.TopKLogitsWarper(params.top_k)(None, scores)
    if params.top_p < 1:
        scores = warpers.TopPLogitsWarper(params.top_p)(None, scores)
    return scores[0]


def random_case(rng: random.Random, vocab: int) -> tuple[torch.Tensor, SamplingParams]:
    """Logits with ties (small integers) or without, and a mix of filters, temperature down to
    1e-4 (the distribution nearly one-hot)."""
    g = torch.Generator().manual_seed(rng.randrange(2**32))
    if rng.random() < 0.4:
        logits = torch.randint(0, 4, (vocab,), generator=g).float()
    else:
        logits = torch.randn(vocab, generator=g) * rng.choice([0.5, 3.0])
    params = SamplingParams(
        temperature=rng.choice([1e-4, 0.3, 0.7, 1.0, 1.9]),
        top_k=rng.choice([0, 1, 2, 5, vocab - 1, vocab + 10]),
        top_p=rng.choice([1.0, 0.9, 0.5, 0.05, rng.random() or 0.5]),
    )
    return logits, params


@pytest.mark.parametrize("seed", range(5))
def test_the_filtered_distribution_equals_hugging_faces(seed: int) -> None:
    """Row by row, and all rows at once (as step14_7 samples them): the same distribution, bit
    for bit, as transformers' temperature, top-k and top-p warpers. (Compared as
    probabilities: at top_p=1 Hugging Face does not run its warper, and the tokens whose
    probability is exactly 0 keep a finite logit there and -inf here; neither is ever drawn.)"""
    rng = random.Random(seed)
    cases = [random_case(rng, vocab=24) for _ in range(64)]
    rows = torch.stack([logits for logits, _ in cases])
    together = filter_logits(rows, [params for _, params in cases]).softmax(-1)
    for i, (logits, params) in enumerate(cases):
        expected = hf_filtered(logits, params).softmax(-1)
        assert torch.equal(filter_logits(logits[None], [params])[0].softmax(-1), expected)
        assert torch.equal(together[i], expected), params


def test_top_p_at_the_boundary_and_top_k_ties() -> None:
    """Probabilities 1/2, 1/4, 1/8, 1/8 (exact in binary): top_p=0.75 drops the two eighths,
    whose sum is exactly 1 - top_p, as Hugging Face does; top_k=2 on tied logits keeps every
    token tied with the second."""
    logits = torch.tensor([0.5, 0.25, 0.125, 0.125]).log()
    boundary = SamplingParams(temperature=1.0, top_p=0.75)
    kept = filter_logits(logits[None], [boundary])[0].isfinite()
    assert kept.tolist() == hf_filtered(logits, boundary).isfinite().tolist()
    assert kept.tolist() == [True, True, False, False]
    ties = torch.tensor([3.0, 1.0, 1.0, 1.0, 0.0])
    top2 = SamplingParams(temperature=1.0, top_k=2)
    assert filter_logits(ties[None], [top2])[0].isfinite().tolist() == [True] * 4 + [False]


# ---- the draws follow the distribution ---------------------------------------------------------

# The chi-square statistic's 0.1% critical value at 4 degrees of freedom: a correct sampler
# passes with fixed seeds every time; one drawing from the wrong distribution lands far above.
CHI2_4_DOF_999 = 18.47


def draws(logits: torch.Tensor, params: SamplingParams, n: int) -> torch.Tensor:
    """``n`` tokens of one request: its draws 0..n-1 (k is what varies)."""
    rows = logits.expand(n, -1)
    return torch.tensor(drawn(rows, [params] * n, list(range(n))))


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_the_draws_follow_the_filtered_distribution(seed: int) -> None:
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -4.0, -4.0])
    params = SamplingParams(temperature=0.8, top_k=5, seed=seed)
    n = 6000
    counts = torch.bincount(draws(logits, params, n), minlength=len(logits)).double()
    assert counts[5:].sum() == 0  # filtered out by top-k: never drawn
    probs = filter_logits(logits[None], [params])[0].softmax(-1).double()[:5]
    expected = n * probs
    chi2 = float(((counts[:5] - expected) ** 2 / expected).sum())
    assert chi2 < CHI2_4_DOF_999


def test_a_draw_depends_on_the_seed_and_k_alone() -> None:
    """The same (seed, k, logits): the same token, alone or among other rows, in any order;
    another seed or another k draws anew."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 50, generator=g)
    params = [SamplingParams(temperature=1.0, seed=s) for s in (1, 2, 3, 1, 2, 3)]
    ks = [0, 0, 0, 1, 1, 1]
    together = drawn(logits, params, ks)
    alone = [drawn(logits[i : i + 1], [params[i]], [ks[i]])[0] for i in range(6)]
    reversed_rows = drawn(logits.flip(0), params[::-1], ks[::-1])[::-1]
    assert together == alone == reversed_rows
    flat = torch.zeros(1, 1000)  # uniform: the token is the draw itself
    picks = {drawn(flat, [SamplingParams(temperature=1.0, seed=s)], [k])[0]
             for s in range(5) for k in range(5)}  # fmt: skip
    assert len(picks) > 20


def test_greedy_rows_take_the_argmax_among_sampled_ones() -> None:
    logits = torch.tensor([[0.0, 5.0, 1.0], [0.0, 5.0, 1.0]])
    params = [SamplingParams(), SamplingParams(temperature=1.0, top_k=1, seed=0)]
    assert drawn(logits, params, [0, 0]) == [1, 1]


# ---- vLLM's further rules, each against a plain sampler written here -------------------------


def plain_processed(row: torch.Tensor, state: SamplingState) -> torch.Tensor:
    """min_tokens and the penalties, vLLM's rules written the plainest way: one token at a time,
    in Python floats (the logits are float64, so nothing is rounded on the way)."""
    params, output = state.params, list(state.output_ids)
    values = row.tolist()
    if len(output) < params.min_tokens:
        for token in state.stop_ids:
            values[token] = -math.inf
    if params.repetition_penalty != 1:
        for token in set(state.prompt_ids) | set(output):
            rp = params.repetition_penalty
            values[token] = values[token] / rp if values[token] > 0 else values[token] * rp
    for token in set(output):
        values[token] -= params.frequency_penalty * output.count(token)
        values[token] -= params.presence_penalty
    return torch.tensor(values, dtype=torch.float64)


def plain_token(row: torch.Tensor, state: SamplingState) -> int:
    """The whole sampler on one row: the argmax of the processed logits, or the temperature,
    min_p (kept: probability at least min_p times the top one's), Hugging Face's top-k and
    top-p, and the race with the request's k-th exponentials."""
    params, logits = state.params, plain_processed(row, state)
    if params.greedy:
        return int(logits.argmax())
    scaled = logits.float() / params.temperature
    probs = scaled.softmax(-1)
    scaled = scaled.masked_fill(probs < params.min_p * probs.max(), -math.inf)
    filtered = hf_filtered(scaled, replace(params, temperature=1.0)).softmax(-1)
    race = exponentials(params.seed, state.num_drawn, len(filtered))
    return int((filtered / race).argmax())


def plain_fields(params: SamplingParams) -> dict[str, object]:
    """What a request sets when it asks only for the filters and the draw."""
    return {k: getattr(params, k) for k in ("temperature", "top_k", "top_p", "seed")}


def random_state(rng: random.Random, vocab: int) -> SamplingState:
    """A request with a mix of the rules (some of it none), its prompt and output with repeats."""
    output = [rng.randrange(vocab) for _ in range(rng.randint(0, 12))]
    params = SamplingParams(
        max_tokens=20,
        temperature=rng.choice([0.0, 0.0, 0.6, 1.3]),
        top_k=rng.choice([0, 5]),
        top_p=rng.choice([1.0, 0.8]),
        seed=rng.randrange(1000),
        presence_penalty=rng.choice([0.0, -1.5, 0.7, 2.0]),
        frequency_penalty=rng.choice([0.0, 0.4, -0.9]),
        repetition_penalty=rng.choice([1.0, 1.0, 0.5, 1.3, 2.0]),
        min_p=rng.choice([0.0, 0.0, 0.05, 0.3]),
        min_tokens=rng.choice([0, 3, 8, 20]),
    )
    prompt = [rng.randrange(vocab) for _ in range(rng.randint(1, 12))]
    stop = frozenset(rng.sample(range(vocab), rng.randint(0, 3)))
    return SamplingState(params, prompt, output, stop)


@pytest.mark.parametrize("seed", range(4))
def test_the_rules_follow_a_plain_sampler_row_by_row(seed: int) -> None:
    """Penalties, min_tokens, min_p, greedy and drawn rows mixed in one batch: each row's
    processed logits and token are the plain sampler's, alone."""
    rng = random.Random(seed)
    vocab, rows = 30, 48
    states = [random_state(rng, vocab) for _ in range(rows)]
    for i in range(0, rows, 4):  # and rows that ask for none of it, among them
        states[i] = replace(states[i], params=SamplingParams(**plain_fields(states[i].params)))
    logits = torch.randn(
        rows, vocab, dtype=torch.float64, generator=torch.Generator().manual_seed(seed)
    )
    logits[::5] *= 6  # decisive rows too, where a penalty must beat a wide margin
    processed = apply_min_tokens_and_penalties(logits, states)
    tokens = sample(logits, states).token_ids
    for i, state in enumerate(states):
        assert torch.equal(processed[i], plain_processed(logits[i], state)), state.params
        assert tokens[i] == plain_token(logits[i], state), state.params
    penalized = [s.params.has_penalties for s in states]
    assert any(penalized) and not all(penalized)
    assert sum(t != int(r.argmax()) for t, r in zip(tokens, logits)) > rows // 4


def test_a_round_where_no_row_asks_costs_no_copy() -> None:
    """The default path: no row holds back ids or has a penalty, so the logits are not
    even copied (the rows that ask are the only ones that pay)."""
    logits = torch.randn(3, 10)
    plain = [SamplingState(SamplingParams(min_tokens=2), [1], [], frozenset()) for _ in range(3)]
    assert apply_min_tokens_and_penalties(logits, plain) is logits
    done = [SamplingState(SamplingParams(max_tokens=4, min_tokens=2), [1], [3, 3], {4})] * 3
    assert apply_min_tokens_and_penalties(logits, done) is logits


def test_a_penalty_applies_to_greedy_requests_too() -> None:
    """vLLM penalizes before the argmax: the repeated favourite loses to the runner-up."""
    logits = torch.tensor([[0.0, 3.0, 2.5, -1.0]])
    for params in (
        SamplingParams(presence_penalty=1.0),
        SamplingParams(frequency_penalty=0.3),  # twice: 0.6 off
        SamplingParams(repetition_penalty=1.5),  # 3.0 / 1.5 = 2.0
    ):
        state = SamplingState(params, [0], [1, 1])
        assert sample(logits, [state]).token_ids == [2], params
        assert sample(logits, [SamplingState(params, [1], [])]).token_ids == [
            2 if params.repetition_penalty != 1 else 1  # the prompt counts for repetition only
        ], params


def test_repetition_divides_positive_logits_and_multiplies_negative_ones() -> None:
    logits = torch.tensor([[2.0, -2.0, 0.0, 1.0]], dtype=torch.float64)
    state = SamplingState(SamplingParams(repetition_penalty=2.0), [0, 1], [2])
    processed = apply_min_tokens_and_penalties(logits, [state])
    assert processed.tolist() == [[1.0, -4.0, 0.0, 1.0]]


def test_min_tokens_holds_back_eos_and_stop_ids_until_then() -> None:
    """The two likeliest tokens are stop ids: the third is taken until ``min_tokens`` tokens
    are out, then the first again; a sampled request never draws them either."""
    logits = torch.tensor([[5.0, 4.0, 1.0, 0.0]])
    for temperature in (0.0, 1.0):
        params = SamplingParams(max_tokens=9, min_tokens=3, temperature=temperature, seed=1)
        for num_drawn, expected in ((0, {2, 3}), (2, {2, 3}), (3, {0, 1, 2, 3})):
            state = SamplingState(params, [2], [2] * num_drawn, frozenset({0, 1}))
            picks = {sample(logits, [replace(state, params=replace(params, seed=s))]).token_ids[0]
                     for s in range(40)}  # fmt: skip
            assert picks <= expected and (temperature or picks == {min(expected)})


def test_min_p_runs_before_top_p_as_in_vllm() -> None:
    """Probabilities .4 .3 .2 .1, min_p 0.3, top_p 0.75: min_p first drops .1, and top-p over
    what is left keeps two tokens; Hugging Face's order (top-p first) would keep three."""
    logits = torch.tensor([0.4, 0.3, 0.2, 0.1]).log()
    params = SamplingParams(temperature=1.0, min_p=0.3, top_p=0.75)
    assert filter_logits(logits[None], [params])[0].isfinite().tolist() == [
        True,
        True,
        False,
        False,
    ]
    hf_order = hf_filtered(logits, replace(params, min_p=0.0)).softmax(-1)
    assert (hf_order > 0).sum() == 3


def test_min_p_keeps_the_threshold_and_drops_below_it() -> None:
    """Probabilities 1/2, 1/4, 1/8, 1/8 (exact): min_p 0.25 keeps 1/8 (exactly 0.25 * 1/2)."""
    logits = torch.tensor([0.5, 0.25, 0.125, 0.125]).log()
    keep = filter_logits(logits[None], [SamplingParams(temperature=1.0, min_p=0.25)])[0]
    assert keep.isfinite().all()
    drop = filter_logits(logits[None], [SamplingParams(temperature=1.0, min_p=0.26)])[0]
    assert drop.isfinite().tolist() == [True, True, False, False]


def plain_logprobs(row: torch.Tensor, token: int, n: int) -> TokenLogprobs:
    """log_softmax of the model's own logits, and the n most likely, sorted the plain way."""
    logprobs = torch.log_softmax(row.double(), dim=-1).tolist()
    ranked = sorted(range(len(logprobs)), key=lambda t: -logprobs[t])[:n]
    return TokenLogprobs(token, logprobs[token], tuple((t, logprobs[t]) for t in ranked))


def test_logprobs_are_the_models_raw_ones() -> None:
    """Penalties, temperature and filters change the draw, never the logprobs reported:
    log_softmax of the model's own logits (vLLM's "raw_logprobs"); 0 asks for the token's
    own only; a row that asks nothing gets None."""
    rng = random.Random(5)
    logits = torch.randn(6, 40, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    asks = [3, 0, None, 1, 40, 2]
    states = [
        replace(random_state(rng, 40), params=replace(random_state(rng, 40).params, logprobs=n))
        for n in asks
    ]
    out = sample(logits, states)
    for i, n in enumerate(asks):
        if n is None:
            assert out.logprobs[i] is None
        else:
            assert out.logprobs[i] == plain_logprobs(logits[i], out.token_ids[i], n)
    assert out.logprobs[1].top == () and len(out.logprobs[4].top) == 40


@pytest.mark.parametrize("max_scores", [scoring.MAX_SCORES, 64], ids=["whole", "blocks"])
def test_the_scoring_pass_gives_the_references_prompt_logprobs(
    monkeypatch: pytest.MonkeyPatch, max_scores: int
) -> None:
    """``common/scoring.py``: row ``p - 1`` of the dense reference's log_softmax, in float64,
    for every prompt token ``p`` but the first (None); cut into blocks of a few query rows and
    a few rows of logits, the same numbers. A one-token prompt has nothing to score."""
    monkeypatch.setattr(scoring, "MAX_SCORES", max_scores)
    cfg = tiny_config(dtype=torch.float64)
    model, prompt = reference_model(cfg), tokens(7, 11)
    with torch.inference_mode():
        logprobs = model(prompt).double().log_softmax(-1)
    got = scoring.prompt_logprobs(model, prompt, 2)
    assert got[0] is None and len(got) == len(prompt)
    for p in range(1, len(prompt)):
        want = plain_logprobs(logprobs[p - 1], prompt[p], 2)
        assert got[p].token_id == want.token_id
        assert [t for t, _ in got[p].top] == [t for t, _ in want.top]
        assert abs(got[p].logprob - want.logprob) <= 1e-9
    assert scoring.prompt_logprobs(model, prompt[:1], 2) == [None]


def test_request_outputs_merge_for_a_slow_reader() -> None:
    """``add``: the next output's state, both outputs' tokens and logprobs, the prompt's kept."""
    first = TokenLogprobs(1, -0.5, ((1, -0.5),))
    second = TokenLogprobs(2, -1.5, ((3, -0.1),))
    a = RequestOutput(0, [1], [1], False, None, 4, [first], [None, second])
    b = RequestOutput(0, [2], [1, 2], True, "length", 4, [second], None)
    merged = a.add(b)
    assert merged == RequestOutput(
        0, [1, 2], [1, 2], True, "length", 4, [first, second], a.prompt_logprobs
    )
    plain = RequestOutput(0, [1], [1], False, None).add(RequestOutput(0, [2], [1, 2], True, "stop"))
    assert (plain.new_token_ids, plain.logprobs, plain.prompt_logprobs) == ([1, 2], None, None)


# ---- every step samples the reference's tokens -----------------------------------------------

CFG = tiny_config(block_size=4, total_blocks=64)
PREFIX = tokens(40, 9)
PROMPTS = [PREFIX + tokens(41 + i, n) for i, n in enumerate([3, 6, 1, 8])] + [tokens(45, 5)]
MAX_NEW = 10


def seeded(i: int, **changes: object) -> SamplingParams:
    values = {"max_tokens": MAX_NEW, "temperature": 0.9, "top_p": 0.95, "top_k": 30, "seed": i}
    return SamplingParams(**{**values, **changes})


PARAMS = [seeded(100 + i) for i in range(len(PROMPTS))]


def reference_samples(cfg, prompts, params) -> list[list[int]]:
    model = reference_model(cfg.replace(block_size=1, total_blocks=1))
    return [
        reference_generate(model, [prompt], s.max_tokens, None, s)[0]
        for prompt, s in zip(prompts, params, strict=True)
    ]


@pytest.fixture(scope="module")
def expected() -> list[list[int]]:
    return reference_samples(CFG, PROMPTS, PARAMS)


@pytest.mark.parametrize("cache", [True, False], ids=["cache", "no-cache"])
def test_every_step_samples_the_references_tokens(
    make_engine: EngineFactory, expected: list[list[int]], cache: bool
) -> None:
    """Batched and serial, with the prefix cache on and off: the dense reference's draws."""
    batched = make_engine(CFG, max_running=4, enable_prefix_cache=cache)
    assert batched.generate(PROMPTS, sampling_params=PARAMS) == expected
    serial = make_engine(CFG, max_running=4, enable_prefix_cache=cache)
    assert serial.generate_serial(PROMPTS, sampling_params=PARAMS) == expected
    assert expected != reference_samples(CFG, PROMPTS, [seeded(0) for _ in PROMPTS])


def test_preemption_changes_no_sampled_token(
    make_engine: EngineFactory, expected: list[list[int]]
) -> None:
    """A pool that makes requests give their blocks back and recompute: a resumed request
    never draws a token again, so the tokens are the reference's."""
    small = CFG.replace(total_blocks=12)
    engine = make_engine(small, max_running=5)
    assert engine.generate(PROMPTS, sampling_params=PARAMS) == expected
    assert engine.stats.preemptions > 0


def test_requests_without_a_seed_are_reproducible(make_engine: EngineFactory, step) -> None:
    """Each takes the next seed of the engine's generator (``seed=`` at construction), so two
    engines built alike sample alike, batched or serial; another engine seed samples anew."""
    params = seeded(None)
    a = make_engine(CFG).generate(PROMPTS, sampling_params=params)
    b = make_engine(CFG).generate_serial(PROMPTS, sampling_params=params)
    other = step.PagedPrefixCacheEngine(step.TinyTransformerPaged(CFG), seed=1)
    assert a == b != other.generate(PROMPTS, sampling_params=params)
    assert len({tuple(o) for o in a}) > 1  # one seed each, not one for all


SCENARIO_SEEDS = range(0, 320, 8)


@cache
def scenario_params(seed: int) -> tuple[SamplingParams, ...]:
    """Each request of a random scenario sampled with its own seed and filters (some greedy)."""
    case, rng = scenario(seed), random.Random(seed)
    return tuple(
        seeded(
            1000 * seed + i,
            max_tokens=case.max_new_tokens,
            temperature=rng.choice([0.0, 0.5, 1.0, 1.5]),
            top_k=rng.choice([0, 3]),
            top_p=rng.choice([1.0, 0.8]),
        )
        for i in range(len(case.prompts))
    )


@cache
def scenario_expected(seed: int) -> list[list[int]]:
    case = scenario(seed)
    return reference_samples(case.cfg, case.prompt_lists, scenario_params(seed))


def serve_scenario(engine, seed: int) -> list[dict]:
    """Serve the scenario (twice if it has a hot round), checking each round's tokens against
    the reference; returns the stats after each."""
    case = scenario(seed)
    run = engine.generate_serial if case.serial else engine.generate
    stats = []
    for _ in range(2 if case.hot_round else 1):
        params = list(scenario_params(seed))
        assert run(case.prompt_lists, sampling_params=params) == scenario_expected(seed)
        stats.append(asdict(engine.stats))
    return stats


@cache
def step14_sampled_stats(seed: int) -> list[dict]:
    return serve_scenario(new_engine(load_step("step14"), scenario(seed)), seed)


@pytest.mark.parametrize("seed", SCENARIO_SEEDS)
def test_random_scenarios_sample_the_references_tokens(
    step, make_engine: EngineFactory, seed: int
) -> None:
    """The random scenarios' workloads (pools from barely enough to roomy, cache on and off,
    batched and serial, hot rounds, step14_9's token budgets), each request sampled with its
    own seed and filters: the reference's tokens in every step, and step14's stats up to
    step14_8 (step14_9's chunks change the rounds, and in a tight pool who is preempted)."""
    case = scenario(seed)
    engine = make_engine(
        case.cfg,
        max_running=case.max_running,
        enable_prefix_cache=case.enable_prefix_cache,
        **budget_args(step, case.budget),
    )
    stats = serve_scenario(engine, seed)
    if not has_fix(step, "step14_9"):
        assert stats == step14_sampled_stats(seed)


# ---- what each round hands back ----------------------------------------------------------------


def collect(engine) -> list:
    outputs = []
    while engine.has_work:
        outputs.extend(engine.step())
    return outputs


def test_each_round_reports_the_new_tokens_and_the_end(make_engine: EngineFactory) -> None:
    """One output per request per token, in order; the last says finished, "length"; the
    tokens add up to what generate returns."""
    engine = make_engine(CFG)
    ids = [engine.add_request(p, sampling_params=s) for p, s in zip(PROMPTS, PARAMS)]
    outputs = collect(engine)
    for rid in ids:
        mine = [o for o in outputs if o.request_id == rid]
        assert all(len(o.new_token_ids) == 1 for o in mine)
        streamed = [t for o in mine for t in o.new_token_ids]
        assert [o.token_ids for o in mine] == [streamed[: i + 1] for i in range(len(mine))]
        assert [o.finished for o in mine] == [False] * (len(mine) - 1) + [True]
        assert mine[-1].finish_reason == "length" and mine[0].finish_reason is None
        assert streamed == engine.pop_output(rid)
    twin = make_engine(CFG)
    assert twin.generate(PROMPTS, sampling_params=PARAMS) == [
        [t for o in outputs if o.request_id == rid for t in o.new_token_ids] for rid in ids
    ]


def test_eos_and_a_stop_id_end_with_stop(make_engine: EngineFactory, expected) -> None:
    """An eos id and a stop id both end the request with "stop", the stop token included, as
    eos is; max_tokens with "length"."""
    stop_at = expected[0][3]
    cut = expected[0][: expected[0].index(stop_at) + 1]
    for how in ("eos", "stop"):
        engine = make_engine(CFG)
        if how == "eos":
            engine.add_request(PROMPTS[0], eos_token_id=stop_at, sampling_params=PARAMS[0])
        else:
            params = seeded(100, stop_token_ids=[stop_at])
            engine.add_request(PROMPTS[0], sampling_params=params)
        last = collect(engine)[-1]
        assert (last.token_ids, last.finished, last.finish_reason) == (cut, True, "stop")
    engine = make_engine(CFG)  # the stop id is also the last token max_tokens allows: "stop"
    engine.add_request(PROMPTS[0], sampling_params=seeded(100, max_tokens=len(cut)))
    engine.add_request(
        PROMPTS[0], sampling_params=seeded(100, max_tokens=len(cut), stop_token_ids=[stop_at])
    )
    assert [o.finish_reason for o in collect(engine) if o.finished] == ["length", "stop"]


def test_abort_is_reported_by_the_next_round(make_engine: EngineFactory) -> None:
    engine = make_engine(CFG)
    rid = engine.add_request(PROMPTS[0], sampling_params=PARAMS[0])
    other = engine.add_request(PROMPTS[1], sampling_params=PARAMS[1])
    while not engine.step():
        pass
    so_far = engine.abort(rid)
    assert so_far
    outputs = engine.step()
    ended = [o for o in outputs if o.request_id == rid]
    assert len(ended) == 1
    assert (ended[0].new_token_ids, ended[0].token_ids) == ([], so_far)
    assert (ended[0].finished, ended[0].finish_reason) == (True, "abort")
    assert all(o.request_id == other for o in collect(engine))


def test_a_mid_prompt_chunk_reports_nothing(step, make_engine: EngineFactory) -> None:
    # step14_9: a budget of a block beside the other three requests' decode tokens
    engine = make_engine(CFG, **budget_args(step, 2 * CFG.block_size - 1))
    assert prefill_chunk(engine) == CFG.block_size
    engine.add_request(tokens(50, 3 * CFG.block_size), 2)
    assert engine.step() == [] and engine.step() == []
    assert [o.new_token_ids != [] for o in engine.step()] == [True]


def test_sampling_params_and_max_new_tokens_together_are_refused(
    make_engine: EngineFactory,
) -> None:
    engine = make_engine(CFG)
    with pytest.raises(ValueError, match="not both"):
        engine.add_request(PROMPTS[0], 4, sampling_params=PARAMS[0])
    with pytest.raises(ValueError, match="2 sampling_params for 5 prompts"):
        engine.generate(PROMPTS, sampling_params=PARAMS[:2])
    assert not engine.has_work
