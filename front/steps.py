"""The step registry: every step's name, what it fixes, which engine options only later steps'
engines take, and a loader by name."""

from __future__ import annotations

import importlib
import importlib.util
from types import ModuleType

STEPS = ["step14"] + [f"step14_{i}" for i in range(1, 11)]

# What each step changes against the one before: (files, one-line summary).
FIXES: dict[str, tuple[tuple[str, ...], str]] = {
    "step14": ((), "baseline: the complete engine, with seven inefficiencies"),
    "step14_1": (("model.py",), "KV write: one scatter instead of a per-token loop"),
    "step14_2": (("model.py",), "KV gather: one flat-index gather instead of per-block cat"),
    "step14_3": (("model.py",), "attention: all heads in one batched matmul"),
    "step14_4": (("model.py",), "causal mask: one broadcast compare, none for decode"),
    "step14_5": (
        ("kv_cache_manager.py", "sequence.py"),
        "hash chain kept on Sequence: each block hashed once",
    ),
    "step14_6": (
        ("block_manager.py", "kv_cache_manager.py"),
        "BlockManager.release(): no poking internals",
    ),
    "step14_7": (("model.py", "engine.py"), "forward_batched: one flat batch per round"),
    # Beyond the chapter.
    "step14_8": (
        ("model.py", "engine.py", "kv_cache_manager.py"),
        "cascade attention: the shared prefix read once per round",
    ),
    "step14_9": (
        ("engine.py", "model.py"),
        "prefill in chunks of many blocks under a per-round token budget",
    ),
    "step14_10": (
        ("kv_cache_manager.py", "engine.py"),
        "a second tier for the prefix cache (swap): blocks written through, loaded back",
    ),
}


def has_fix(step_name: str, fix_step: str) -> bool:
    """Does ``step_name`` hold ``fix_step``'s fix? Steps are cumulative: every step from
    ``fix_step`` on does."""
    return STEPS.index(step_name) >= STEPS.index(fix_step)


# The engine options (``EngineOptions``' fields, named as the engines' keyword arguments) that
# only the engines of later steps take, and the first step that does. Every command has their
# flags; one given to an earlier step's command is refused by name (``not_taken_by``, where the
# flags are read), and the bench passes it to the steps that take it (``step_engine_args``).
STEP_OPTIONS = {
    "max_num_batched_tokens": "step14_9",
    "kv_offloading_backend": "step14_10",
    "kv_offloading_size": "step14_10",
}


def step_engine_args(step_name: str, options: object) -> dict[str, object]:
    """The ``STEP_OPTIONS`` given in ``options`` (an ``EngineOptions``, or any object with
    those fields; None: not given) that ``step_name``'s engine takes: keyword arguments for it,
    beside ``max_running``. The values are trusted: checked once, where the flags are read."""
    return {
        name: getattr(options, name)
        for name, first in STEP_OPTIONS.items()
        if getattr(options, name, None) is not None and has_fix(step_name, first)
    }


def not_taken_by(step_name: str, options: object) -> str | None:
    """The first ``STEP_OPTIONS`` given in ``options`` that ``step_name``'s engine does not
    take, said in one line (None: it takes them all)."""
    for name, first in STEP_OPTIONS.items():
        if getattr(options, name, None) is not None and not has_fix(step_name, first):
            flag = "--" + name.replace("_", "-")
            return f"{flag} needs {first} or later: {step_name}'s engine has no {name}"
    return None


def available_steps() -> list[str]:
    """The steps whose package exists in this checkout, in order."""
    return [name for name in STEPS if importlib.util.find_spec(name) is not None]


def load_step(name: str) -> ModuleType:
    """Import a step package by name (``load_step("step14_3").PagedPrefixCacheEngine``)."""
    if name not in STEPS:
        raise ValueError(f"unknown step {name!r}; steps are {STEPS}")
    return importlib.import_module(name)
