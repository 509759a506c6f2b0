"""vLLM's further request fields in every step: the penalties, ``min_p``, ``min_tokens``,
``logprobs`` and ``prompt_logprobs``.

The oracle is the dense reference model: its tokens, drawn with the same seeds by the core's
sampler (whose rules ``tests/core/test_sampling.py`` checks against a plain sampler), and the
log_softmax of its logits at each position, in float64. Every step must give them batched,
serial, under preemption and with a warm cache, and the same stats as step14. A request that
asks for its prompt's logprobs adopts nothing from the prefix cache (vLLM's rule), yet its
blocks are cached for the others, and it hands its prompt's logprobs out once, preempted or not.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from functools import cache
from types import ModuleType

import pytest
import torch

from common.errors import RequestError
from common.reference import reference_generate
from common.sampling_params import SamplingParams, TokenLogprobs
from front.steps import load_step
from tests.helpers import (
    EngineFactory,
    has_fix,
    reference_model,
    same_work_figures,
    tiny_config,
    tokens,
)

CFG = tiny_config(block_size=4, total_blocks=64)
PREFIX = tokens(60, 9)  # two full blocks and a token, shared
PROMPTS = [PREFIX + tokens(61 + i, n) for i, n in enumerate([3, 6, 1, 8])] + [tokens(65, 6)]
MAX_NEW = 9


@cache
def params() -> tuple[SamplingParams, ...]:
    """A request per prompt, each asking for some of the fields; greedy ones too (penalties and
    min_tokens change the argmax). The third would draw its stop id second, but its
    ``min_tokens`` holds it back to the end."""
    model = reference_model(CFG.replace(block_size=1, total_blocks=1))
    third = SamplingParams(max_tokens=MAX_NEW, frequency_penalty=-1.0, logprobs=3)
    stop_id = reference_generate(model, PROMPTS[2:3], MAX_NEW, None, third)[0][1]
    return (
        SamplingParams(max_tokens=MAX_NEW, repetition_penalty=0.6, logprobs=2, prompt_logprobs=1),
        SamplingParams(
            max_tokens=MAX_NEW,
            temperature=0.9,
            seed=7,
            presence_penalty=-2.0,
            frequency_penalty=-2.0,
            min_p=0.1,
            logprobs=0,
        ),
        replace(third, min_tokens=MAX_NEW, stop_token_ids=[stop_id]),
        SamplingParams(
            max_tokens=MAX_NEW,
            temperature=1.2,
            top_k=20,
            seed=8,
            min_p=0.5,
            repetition_penalty=0.7,
            prompt_logprobs=2,
        ),
        SamplingParams(max_tokens=MAX_NEW, prompt_logprobs=0),
    )


LOGPROB_TOLERANCE = 1e-9  # float64: summation order moves the last bits only


@dataclass
class Served:
    """What the outputs of one request said, put together."""

    token_ids: list[int]
    logprobs: list[TokenLogprobs] | None
    prompt_logprobs: list[list[TokenLogprobs | None]]  # each time it was handed out


def collect(engine, request_ids: list[int]) -> list[Served]:
    """Run the engine until it is idle; each request's tokens and logprobs, from its outputs."""
    outputs = []
    while engine.has_work:
        outputs += engine.step()
    served = []
    for rid in request_ids:
        mine = [o for o in outputs if o.request_id == rid]
        logprobs = [o.logprobs for o in mine]
        assert all(lp is None or len(lp) == len(o.new_token_ids) for lp, o in zip(logprobs, mine))
        served.append(
            Served(
                [t for o in mine for t in o.new_token_ids],
                None if logprobs[0] is None else [e for lp in logprobs for e in lp],
                [o.prompt_logprobs for o in mine if o.prompt_logprobs is not None],
            )
        )
    return served


def serve(engine, prompts=PROMPTS, sampling=None, serial: bool = False) -> list[Served]:
    sampling = sampling or params()
    if serial:
        return [s for p, sp in zip(prompts, sampling) for s in serve(engine, [p], [sp])]
    ids = [engine.add_request(p, sampling_params=sp) for p, sp in zip(prompts, sampling)]
    return collect(engine, ids)


def oracle_logprobs(logprobs: torch.Tensor, position: int, token: int, n: int) -> TokenLogprobs:
    """The entry for ``token`` at ``position`` from the rows of the reference's log_softmax:
    row ``position - 1`` predicts it."""
    row = logprobs[position - 1]
    top = row.topk(n)
    return TokenLogprobs(
        token, float(row[token]), tuple(zip(top.indices.tolist(), top.values.tolist()))
    )


@cache
def expected() -> tuple[Served, ...]:
    """The reference's tokens, and the log_softmax of its logits, for every request."""
    model = reference_model(CFG.replace(block_size=1, total_blocks=1))
    served = []
    for prompt, sp in zip(PROMPTS, params()):
        generated = reference_generate(model, [prompt], MAX_NEW, None, sp)[0]
        with torch.inference_mode():
            logprobs = model(prompt + generated).double().log_softmax(-1)
        place = range(len(prompt), len(prompt) + len(generated))
        sampled = [
            oracle_logprobs(logprobs, p, t, sp.logprobs or 0) for p, t in zip(place, generated)
        ]
        n = sp.prompt_logprobs
        prompt_lp = [None] + [
            oracle_logprobs(logprobs, p, prompt[p], n or 0) for p in range(1, len(prompt))
        ]
        served.append(
            Served(
                generated,
                None if sp.logprobs is None else sampled,
                [] if n is None else [prompt_lp],
            )
        )
    return tuple(served)


def assert_same(got: list[Served], want: tuple[Served, ...] | list[Served]) -> None:
    """The same tokens and top ids; the same logprobs within float64's last bits."""

    def close(a: TokenLogprobs | None, b: TokenLogprobs | None) -> bool:
        if a is None or b is None:
            return a is b
        ids = (a.token_id, [t for t, _ in a.top]) == (b.token_id, [t for t, _ in b.top])
        values = [a.logprob] + [v for _, v in a.top], [b.logprob] + [v for _, v in b.top]
        return ids and all(abs(x - y) <= LOGPROB_TOLERANCE for x, y in zip(*values))

    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want)):
        assert g.token_ids == w.token_ids, i
        assert (g.logprobs is None) == (w.logprobs is None), i
        assert all(close(a, b) for a, b in zip(g.logprobs or [], w.logprobs or [], strict=True)), i
        assert len(g.prompt_logprobs) == len(w.prompt_logprobs), i  # handed out once, or never
        for a, b in zip(g.prompt_logprobs, w.prompt_logprobs):
            assert all(close(x, y) for x, y in zip(a, b, strict=True)), i


def test_the_fields_change_what_is_sampled() -> None:
    """Not vacuous: without the penalties, min_p and min_tokens, each of the first four requests
    would say something else (the logprobs fields change no token, by design)."""
    model = reference_model(CFG.replace(block_size=1, total_blocks=1))
    plain = [
        SamplingParams(
            max_tokens=MAX_NEW, temperature=p.temperature, top_k=p.top_k, top_p=p.top_p, seed=p.seed
        )
        for p in params()
    ]
    changed = [
        reference_generate(model, [prompt], MAX_NEW, None, p)[0] != e.token_ids
        for prompt, p, e in zip(PROMPTS, plain, expected())
    ]
    assert changed == [True] * 4 + [False]


@pytest.mark.parametrize("cache", [True, False], ids=["cache", "no-cache"])
def test_batched_serial_and_warm_give_the_references_tokens_and_logprobs(
    make_engine: EngineFactory, cache: bool
) -> None:
    batched = make_engine(CFG, max_running=5, enable_prefix_cache=cache)
    assert_same(serve(batched), expected())
    assert_same(serve(batched), expected())  # warm: the plain requests adopt the prefix
    serial = make_engine(CFG, max_running=5, enable_prefix_cache=cache)
    assert_same(serve(serial, serial=True), expected())


def test_preempted_requests_give_the_same_and_their_prompt_logprobs_once(
    make_engine: EngineFactory,
) -> None:
    """A pool that sends requests back to prefill anew, some after their first token: the same
    tokens and logprobs, and each request's prompt logprobs handed out exactly once."""
    engine = make_engine(CFG.replace(total_blocks=12), max_running=5)
    assert_same(serve(engine), expected())
    assert engine.stats.preemptions > 0


def stats_cold_and_warm(engine, prompt_logprobs: bool) -> list[dict]:
    sampling = params() if prompt_logprobs else [replace(p, prompt_logprobs=None) for p in params()]
    stats = []
    for _ in range(2):
        serve(engine, sampling=sampling)
        stats.append(asdict(engine.stats))
    return stats


@cache
def step14_stats(total_blocks: int, prompt_logprobs: bool) -> list[dict]:
    step = load_step("step14")
    model = step.TinyTransformerPaged(CFG.replace(total_blocks=total_blocks))
    engine = step.PagedPrefixCacheEngine(model, max_running=5)
    return stats_cold_and_warm(engine, prompt_logprobs)


@pytest.mark.parametrize("prompt_logprobs", [True, False], ids=["prompt-logprobs", "plain"])
@pytest.mark.parametrize("total_blocks", [64, 12], ids=["roomy", "preempting"])
def test_every_step_reports_step14s_stats(
    step: ModuleType, make_engine: EngineFactory, total_blocks: int, prompt_logprobs: bool
) -> None:
    """The same blocks computed and adopted, cold and warm, in a roomy pool and in one that
    preempts: batching changes nothing.

    step14_9 cuts the work into other rounds, so its figures of rounds and its peak of blocks
    held are left out, and two things of it differ on purpose: in a pool that preempts, its long
    chunks take their blocks sooner, so who is preempted when differs (test_random_scenarios.py
    pins its figures); and a request that asks for its prompt's logprobs adopts nothing, so it
    computes again whatever blocks of its prompt the others computed before it did, which
    depends on how the rounds were cut: in step14 the requests leapfrog through the prefix, in
    step14_9 the first computes it alone."""
    engine = make_engine(CFG.replace(total_blocks=total_blocks), max_running=5)
    stats = stats_cold_and_warm(engine, prompt_logprobs)
    if has_fix(step, "step14_9") and (total_blocks == 12 or prompt_logprobs):
        return
    expected = [same_work_figures(s, step) for s in step14_stats(total_blocks, prompt_logprobs)]
    stats = [same_work_figures(s, step) for s in stats]
    if has_fix(step, "step14_9"):  # a long chunk takes its blocks in one round: another peak
        for figures in (*stats, *expected):
            figures.pop("blocks_peak")
    assert stats == expected


def test_a_prompt_logprobs_request_adopts_nothing_but_leaves_its_blocks_cached(
    make_engine: EngineFactory,
) -> None:
    """Cold, it computes its whole prompt and caches its full blocks: a plain request after it
    adopts them. Warm, it adopts none of them (a request with no hit in the stats) and still
    gives the reference's tokens and prompt logprobs."""
    prompt, asks, plain = PROMPTS[3], params()[3], SamplingParams(max_tokens=2)
    full_blocks = (len(prompt) - 1) // CFG.block_size
    engine = make_engine(CFG)
    assert_same(serve(engine, [prompt], [asks]), expected()[3:4])
    s = engine.stats
    assert (s.requests_hit, s.cached_tokens, s.computed_prefill_tokens) == (0, 0, len(prompt))
    assert s.blocks_cached == (len(prompt) + MAX_NEW - 1) // CFG.block_size  # prompt and output
    serve(engine, [prompt], [plain])
    assert (engine.stats.requests_hit, engine.stats.cached_tokens) == (
        1,
        full_blocks * CFG.block_size,
    )
    engine.reset_stats()
    assert_same(serve(engine, [prompt], [asks]), expected()[3:4])
    s = engine.stats
    assert (s.requests, s.requests_hit, s.cached_tokens) == (1, 0, 0)
    assert s.computed_prefill_tokens == len(prompt)


def test_min_tokens_holds_back_eos_and_stop_ids(make_engine: EngineFactory) -> None:
    """An eos the request would draw second, and a stop id it would draw third, end it there;
    with ``min_tokens`` 5 neither can be drawn before the fifth token, and the tokens are the
    reference's, held back the same way."""
    model = reference_model(CFG.replace(block_size=1, total_blocks=1))
    prompt = PROMPTS[1]
    free = reference_generate(model, [prompt], MAX_NEW)[0]
    eos, stop = free[1], free[2]
    assert len({eos, stop}) == 2 and eos not in free[:1] and stop not in free[:2]
    engine = make_engine(CFG)
    early = engine.generate(
        [prompt], eos_token_id=eos, sampling_params=SamplingParams(max_tokens=MAX_NEW)
    )
    assert early == [free[:2]]
    held = SamplingParams(max_tokens=MAX_NEW, min_tokens=5, stop_token_ids=[stop])
    (out,) = engine.generate([prompt], eos_token_id=eos, sampling_params=held)
    assert not {eos, stop} & set(out[:5])
    assert out == reference_generate(model, [prompt], MAX_NEW, eos, held)[0][: len(out)]
    assert len(out) >= 5 and (len(out) == MAX_NEW or out[-1] in (eos, stop))


def test_an_abort_carries_no_logprobs_and_no_prompt_logprobs(make_engine: EngineFactory) -> None:
    engine = make_engine(CFG)
    rid = engine.add_request(PROMPTS[0], sampling_params=params()[0])
    while not engine.step():
        pass
    engine.abort(rid)
    (ended,) = engine.step()
    assert (ended.finish_reason, ended.logprobs, ended.prompt_logprobs) == ("abort", [], None)


@pytest.mark.parametrize("name", ["logprobs", "prompt_logprobs"])
def test_more_logprobs_than_the_vocabulary_are_refused(
    make_engine: EngineFactory, name: str
) -> None:
    engine = make_engine(CFG)
    too_many = SamplingParams(**{name: CFG.vocab_size + 1})
    with pytest.raises(
        RequestError, match=rf"SamplingParams\.{name} {CFG.vocab_size + 1} "
    ) as info:
        engine.add_request(PROMPTS[0], sampling_params=too_many)
    assert info.value.param == name and not engine.has_work
    all_of_them = SamplingParams(max_tokens=1, **{name: CFG.vocab_size})
    (out,) = serve(engine, PROMPTS[:1], [all_of_them])
    entry = out.logprobs[0] if name == "logprobs" else out.prompt_logprobs[0][1]
    assert len(entry.top) == CFG.vocab_size
