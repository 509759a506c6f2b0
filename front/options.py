"""``EngineOptions``: the engine options, typed (vLLM's ``EngineArgs``), whether read from the
flags every command shares (``cli.add_engine_flags`` defines them) or given in Python
(``TextOptions.engine``).

They are checked once, against the step whose engine they are for, before anything loads
(``refused_by``): a command says why in one ``error:`` line where it reads its flags, and
``generate_text`` raises a ``UserError`` before any weight is read. The engine builder
(``build.py``) trusts them: it hands each engine the options that engine takes
(``steps.step_engine_args``).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import TYPE_CHECKING

from common.errors import UserError
from common.inputs import check_token_budget
from common.kv_tiers import check_tier_spec

from .steps import not_taken_by

if TYPE_CHECKING:
    import argparse


@dataclass(frozen=True)
class EngineOptions:
    """The engine flags, read once into their types (the bench takes those its workloads
    read)."""

    device: str = "cpu"
    dtype: str = "float32"  # a DTYPES name, or "auto" (a checkpoint's stored dtype)
    block_size: int = 16
    total_blocks: int | None = 512  # None: the command sizes the pool itself
    max_running: int = 8
    # torch CPU threads; 0: torch's default, one per core. One by default: on a machine that
    # other programs share, two threads wait for each other at every small matmul (50x slower).
    threads: int = 1
    seed: int = 0
    max_model_len: int | None = None  # None: a checkpoint's max_position_embeddings
    no_memory_check: bool = False
    # Taken by the engines of step14_9 on (``steps.STEP_OPTIONS``); None: the engine's default.
    max_num_batched_tokens: int | None = None
    # Taken by step14_10 on: its second tier, as vLLM names the flags (a size alone: host
    # memory). None: no second tier.
    kv_offloading_backend: str | None = None
    kv_offloading_size: float | None = None

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> EngineOptions:
        """The options from parsed flags; a flag the parser left out keeps its default."""
        given = {f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)}
        return cls(**given)

    def model_overrides(self) -> dict[str, object]:
        """The options that build the model (``from_pretrained``'s overrides; None: keep)."""
        return {
            name: getattr(self, name) for name in MODEL_OPTIONS if getattr(self, name) is not None
        }

    def refused_by(self, step_name: str) -> str | None:
        """Why ``step_name``'s engine would refuse the options given (None: it takes them):
        the one check, made before anything loads. A command says it in one line."""
        return not_taken_by(step_name, self) or self.budget_refused() or self.tier_refused()

    def budget_refused(self) -> str | None:
        """A token budget too small for ``block_size`` and ``max_running`` (the core's rule)."""
        if self.max_num_batched_tokens is None:
            return None
        try:
            check_token_budget(self.max_num_batched_tokens, self.block_size, self.max_running)
        except ValueError as exc:
            return f"--max-num-batched-tokens: {exc}"
        return None

    def tier_refused(self) -> str | None:
        """A second tier that cannot be (an unknown backend, a size it does not take), said
        before anything is opened."""
        if self.kv_offloading_backend is None and self.kv_offloading_size is None:
            return None
        try:
            check_tier_spec(self.kv_offloading_backend or "host", self.kv_offloading_size)
        except (ValueError, ImportError) as exc:  # ImportError: redis:// without its package
            return f"--kv-offloading-backend: {exc}"
        return None

    def check_step(self, step_name: str) -> None:
        """``UserError`` when ``step_name``'s engine would refuse the options given."""
        why = self.refused_by(step_name)
        if why is not None:
            raise UserError(why)


# The engine options that shape the model, rather than the engine that serves it.
MODEL_OPTIONS = ("device", "dtype", "block_size", "total_blocks", "max_model_len")
