"""eos as a set: a request stops at the first of several eos ids, in every step, with the same
stats; any integer kind names an id; the text front end passes the checkpoint's whole list.

Llama 3 chat checkpoints list several eos ids (``eos_token_id: [128001, 128008, 128009]``): the
model may end a turn with any of them. A request that stopped only at the first would keep
computing after the model said it was done.
"""

from __future__ import annotations

import json
from dataclasses import replace
from functools import cache
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest
import torch

from tests.helpers import hf_greedy, reference_tokens, same_work_figures, tiny_config

CFG = tiny_config()
SYSTEM = list(range(1, 13))  # three blocks of 4, shared
PROMPTS = [[*SYSTEM, 100 + i, 200 + i] for i in range(4)]
MAX_NEW = 12


def cut_at_first(ids: list[int], eos: set[int]) -> list[int]:
    """What a request stopped by ``eos`` returns: up to and including the first eos."""
    for i, token in enumerate(ids):
        if token in eos:
            return ids[: i + 1]
    return ids


@cache
def free_run() -> list[list[int]]:
    """The oracle's tokens with no eos at all."""
    return reference_tokens(CFG, PROMPTS, MAX_NEW)


@cache
def two_eos_ids() -> tuple[int, int]:
    """Two ids, each generated mid-answer by a different request, neither occurring earlier in
    the other's answer: with both as eos, those two requests stop at different ids, and each
    stop changes the output (a request that ignored one of them would run on)."""
    outs = free_run()
    firsts = [
        (i, pos, t) for i, out in enumerate(outs) for pos, t in enumerate(out) if t not in out[:pos]
    ]
    for i, pos_a, a in firsts:
        for j, pos_b, b in firsts:
            mid_way = 1 <= pos_a < MAX_NEW - 2 and 1 <= pos_b < MAX_NEW - 2
            apart = b not in outs[i][: pos_a + 1] and a not in outs[j][: pos_b + 1]
            if j != i and a != b and mid_way and apart:
                return a, b
    raise AssertionError("the free run has no two usable eos ids")


def expected() -> list[list[int]]:
    return [cut_at_first(out, set(two_eos_ids())) for out in free_run()]


def engine_for(step: ModuleType):
    return step.PagedPrefixCacheEngine(step.TinyTransformerPaged(CFG), max_running=4)


def stats_figures(engine) -> dict[str, int]:
    names = (
        "requests",
        "requests_hit",
        "prompt_tokens",
        "cached_tokens",
        "computed_prefill_tokens",
        "computed_decode_tokens",
        "blocks_peak",
    )
    return {name: getattr(engine.stats, name) for name in names}


@cache
def step14_stats() -> dict[str, int]:
    from step14 import PagedPrefixCacheEngine, TinyTransformerPaged

    engine = PagedPrefixCacheEngine(TinyTransformerPaged(CFG), max_running=4)
    engine.generate(PROMPTS, MAX_NEW, list(two_eos_ids()))
    return stats_figures(engine)


def test_the_two_ids_stop_two_different_requests() -> None:
    a, b = two_eos_ids()
    want = expected()
    stopped_by = {out[-1] for out, free in zip(want, free_run()) if out != free}
    assert stopped_by == {a, b}, "each eos id ends a request early"


EOS_FORMS = {
    "list": lambda a, b: [a, b],
    "tuple": lambda a, b: (a, b),
    "set": lambda a, b: {a, b},
    "frozenset": lambda a, b: frozenset((a, b)),
    "1-d tensor": lambda a, b: torch.tensor([a, b]),
    "numpy array": lambda a, b: np.array([a, b]),
    "numpy ints": lambda a, b: [np.int64(a), np.int32(b)],
    "0-d tensors": lambda a, b: [torch.tensor(a), torch.tensor(b, dtype=torch.int32)],
}


@pytest.mark.parametrize("form", EOS_FORMS, ids=list(EOS_FORMS))
def test_a_request_stops_at_any_of_the_eos_ids(step: ModuleType, form: str) -> None:
    eos = EOS_FORMS[form](*two_eos_ids())
    engine = engine_for(step)
    assert engine.generate(PROMPTS, MAX_NEW, eos) == expected()
    figures = same_work_figures(stats_figures(engine), step)
    assert figures == same_work_figures(step14_stats(), step), "every step computes the same"
    assert engine.ref_count_problems() == []


def test_serial_and_streaming_stop_at_any_eos_too(step: ModuleType) -> None:
    eos = list(two_eos_ids())
    engine = engine_for(step)
    assert engine.generate_serial(PROMPTS, MAX_NEW, eos) == expected()
    ids = [engine.add_request(p, MAX_NEW, eos_token_id=eos) for p in PROMPTS]
    while engine.has_work:
        engine.step()
    assert [engine.pop_output(i) for i in ids] == expected()


ONE_ID_FORMS = {
    "int": int,
    "numpy int64": np.int64,
    "numpy int32": np.int32,
    "0-d tensor": torch.tensor,
    "0-d int32 tensor": lambda t: torch.tensor(t, dtype=torch.int32),
    "0-d numpy array": np.array,
}


@pytest.mark.parametrize("form", ONE_ID_FORMS, ids=list(ONE_ID_FORMS))
def test_one_eos_id_of_any_integer_kind(step: ModuleType, form: str) -> None:
    a, _ = two_eos_ids()
    engine = engine_for(step)
    want = [cut_at_first(out, {a}) for out in free_run()]
    assert engine.generate(PROMPTS, MAX_NEW, ONE_ID_FORMS[form](a)) == want


@pytest.mark.parametrize(
    "bad",
    [
        2.0,
        torch.tensor(2.0),
        "2",
        [1, 2.5],
        [-1],
        [CFG.vocab_size],
        torch.tensor([[1, 2]]),
        np.array(True),
        True,
    ],
    ids=[
        "float",
        "float tensor",
        "str",
        "float in list",
        "negative",
        "vocab",
        "2-d tensor",
        "numpy bool",
        "bool",
    ],
)
def test_what_is_not_an_eos_id_is_refused(bad: object) -> None:
    from step14_7 import PagedPrefixCacheEngine, TinyTransformerPaged

    engine = PagedPrefixCacheEngine(TinyTransformerPaged(CFG))
    with pytest.raises(ValueError, match="eos_token_id"):
        engine.generate(PROMPTS[:1], 2, bad)
    assert not engine.has_work


# ---- the text front end: the checkpoint's whole list ---------------------------------------


@pytest.fixture(scope="module")
def text_checkpoint() -> ModuleType:
    """tests/core/test_checkpoint.py: its tiny Llama, word-level tokenizer, prompts (skips when
    transformers, safetensors or tokenizers is missing)."""
    return pytest.importorskip("tests.core.test_checkpoint")


def hf_generate(
    folder: Path, prompt_ids: list[list[int]], eos: list[int], new_tokens: int
) -> list[list[int]]:
    """transformers' own greedy generate on the saved checkpoint, stopped by the eos list,
    the eos dropped as the text front end drops it."""
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(folder, attn_implementation="eager").eval()
    return hf_greedy(model, prompt_ids, new_tokens, eos)


@pytest.fixture(scope="module")
def llama3_eos(
    text_checkpoint: ModuleType, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, object]:
    """test_checkpoint's Llama, saved by transformers, whose generation_config.json lists two
    eos ids, Llama 3 style: two ids its answers reach mid-way, in different requests."""
    from front.hf import hf_llama
    from front.options import EngineOptions
    from front.text import TextOptions, generate_text

    tc = text_checkpoint
    folder = tmp_path_factory.mktemp("llama3-eos") / "ckpt"
    hf_llama(tc.CFG, attn="eager").save_pretrained(folder)
    tc.word_tokenizer().save(str(folder / "tokenizer.json"))
    options = TextOptions(tc.SYSTEM, tc.NEW_TOKENS, engine=EngineOptions(block_size=4))
    args = ("step14_7", folder, tc.PROMPTS, options)
    free = generate_text(*args[:3], replace(options, eos_token_id=())).output_ids
    eos: list[int] = []
    for out in free:
        fresh = [t for pos, t in enumerate(out) if pos >= 1 and t not in out[:pos]]
        usable = [t for t in fresh if t not in eos and all(t not in o[:2] for o in free)]
        eos += usable[:1]
    assert len(eos) >= 2
    eos = eos[:2]
    config = json.loads((folder / "generation_config.json").read_text())
    config["eos_token_id"] = [eos[1], eos[0]]  # a list, as Llama 3's file gives it
    (folder / "generation_config.json").write_text(json.dumps(config))
    return {"folder": folder, "eos": eos, "free": free, "args": args}


def test_text_stops_at_any_of_the_checkpoints_eos_ids(
    step: ModuleType, llama3_eos: dict[str, object]
) -> None:
    """The front end passes every eos id to the engine: the answers equal HF generate's with
    the same list, and the engine computed no token past any of them."""
    from front.text import generate_text

    folder, eos, (_, _, prompts, options) = (
        llama3_eos["folder"],
        llama3_eos["eos"],
        llama3_eos["args"],
    )
    new_tokens = options.max_new_tokens
    result = generate_text(step, folder, prompts, options)
    assert sorted(result.eos_token_ids) == sorted(eos)
    assert result.output_ids == hf_generate(folder, result.prompt_ids, eos, new_tokens)
    free = llama3_eos["free"]
    stopped_by = {free[i][len(ids)] for i, ids in enumerate(result.output_ids) if ids != free[i]}
    assert stopped_by == set(eos), "each of the two ids ends an answer"
    # Every generated token (an eos included) was fed back through the model but the last.
    generated = sum(len(ids) + (len(ids) < new_tokens) for ids in result.output_ids)
    assert result.stats.computed_decode_tokens == generated - len(prompts)


def test_text_eos_override(llama3_eos: dict[str, object]) -> None:
    """``eos_token_id=`` replaces the checkpoint's list; ``()`` means no eos at all."""
    from front.text import generate_text

    (*args, options), eos, free = llama3_eos["args"], llama3_eos["eos"], llama3_eos["free"]
    assert generate_text(*args, replace(options, eos_token_id=())).output_ids == free
    first = replace(options, eos_token_id=np.int64(eos[0]))
    only_first = generate_text(*args, first).output_ids
    assert only_first == [out[: out.index(eos[0])] if eos[0] in out else out for out in free]
