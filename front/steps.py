"""The step registry: every step's name, what it fixes, and a loader by name."""

from __future__ import annotations

import importlib
import importlib.util
from types import ModuleType

STEPS = ["step14"] + [f"step14_{i}" for i in range(1, 10)]

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
}


def has_fix(step_name: str, fix_step: str) -> bool:
    """Does ``step_name`` hold ``fix_step``'s fix? Steps are cumulative: every step from
    ``fix_step`` on does."""
    return STEPS.index(step_name) >= STEPS.index(fix_step)


def available_steps() -> list[str]:
    """The steps whose package exists in this checkout, in order."""
    return [name for name in STEPS if importlib.util.find_spec(name) is not None]


def load_step(name: str) -> ModuleType:
    """Import a step package by name (``load_step("step14_3").PagedPrefixCacheEngine``)."""
    if name not in STEPS:
        raise ValueError(f"unknown step {name!r}; steps are {STEPS}")
    return importlib.import_module(name)
