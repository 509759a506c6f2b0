"""--workload pressure: memory, not speed. Two dozen short prompts whose answers stop at their
own eos within 13 tokens (picked from the dense reference's answers), asked with
--new-tokens 64, in a pool of 48 blocks of 4 tokens, up to 8 at a time. Only the step rows:
no warm prefix or no cache row (there is no shared prefix), and no peer row (one batched
generate cannot stop each request at its own eos). The requests/round and preemptions columns
show how many requests memory on demand runs at once, and a line under the table how many
worst-case reservation would (prompt + max new tokens reserved for each).

It shows what memory on demand buys over reserving each request's worst case. Each eos is a
token the dense reference's own answer has at a seeded position 5 to 12
(``front/workload.py``, ``pressure_eos``). The first paragraph here is its part of
``python -m bench --help``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

from front.workload import (
    PRESSURE_EOS_AT,
    pressure_eos,
    pressure_prompt_lengths,
    pressure_prompts,
)

from ..models import check_pool_fits
from ..options import BenchOptions
from ..progress import Progress
from ..reference import Reference
from ..rows import BatchRun

NAME = "pressure"
SUMMARY = "short answers asked with a long --new-tokens in a small pool (memory)"
DEFAULTS = dict(
    requests=24, new_tokens=64, max_running=8, block_size=4, total_blocks=48, model="demo"
)
NOT_READ = "draws its own prompts (no shared prefix)"
HELP = __doc__.split("\n\n")[0]


@dataclass(frozen=True)
class Pressure:
    """Short unrelated prompts whose answers stop at their own ``eos`` (``with_eos``) long
    before ``max_new_tokens``, in a small pool."""

    num_requests: int = 24
    max_new_tokens: int = 64
    max_running: int = 8
    seed: int = 7
    total_blocks: int = 48
    eos: tuple[int, ...] | None = None

    def prompts(self, vocab_size: int) -> list[list[int]]:
        return pressure_prompts(self.num_requests, vocab_size, self.seed)

    def prompt_lengths(self) -> list[int]:
        """Every prompt's length, without drawing the prompts (no vocabulary needed)."""
        return pressure_prompt_lengths(self.num_requests, self.seed)

    def describe(self) -> str:
        lengths = self.prompt_lengths()
        return (
            f"{self.num_requests} requests: unrelated prompts of {min(lengths)} to "
            f"{max(lengths)} tokens, each stopping at its own eos within "
            f"{PRESSURE_EOS_AT[1] + 1} tokens, max_new_tokens={self.max_new_tokens}, "
            f"max_running={self.max_running}"
        )

    def pool_blocks(self, block_size: int) -> int:
        return self.total_blocks

    def with_eos(self, answers: list[list[int]]) -> Pressure:
        """One eos id per request, from the reference's ``answers`` (``pressure_eos``)."""
        return replace(self, eos=tuple(pressure_eos(answers, self.seed)))


def workload_of(options: BenchOptions) -> Pressure:
    return Pressure(
        num_requests=options.requests,
        max_new_tokens=options.new_tokens,
        max_running=options.running(options.requests),
        total_blocks=options.total_blocks,
    )


def check(options: BenchOptions) -> None:
    check_pool_fits(workload_of(options), options.block_size)


def run(options: BenchOptions, progress: Progress) -> int:
    """The step rows, the table, ``results.json``; 0 when every row gives the same tokens."""
    batch = BatchRun(options, workload_of(options), progress)
    with batch.phase("picking eos"), progress.task("dense reference: picking eos ids"):
        workload = pick_eos(workload_of(options), batch.prompts, batch.reference)
    with batch.phase("steps"):
        rows, _ = batch.step_rows(workload)
    batch.measure_rows()
    if not (options.no_hf and options.no_ctranslate2):
        print(
            "  (Hugging Face and CTranslate2 rows skipped: one batched generate cannot stop "
            "each request at its own eos)"
        )
    return batch.finish(workload, rows, [])


def pick_eos(workload: Pressure, prompts: list[list[int]], reference: Reference) -> Pressure:
    """The workload with one eos id per request, from the dense reference's first 13 tokens of
    every answer (with or without --no-reference)."""
    start = time.perf_counter()
    picked = workload.with_eos(reference.tokens(prompts, PRESSURE_EOS_AT[1] + 1))
    print(
        f"  each request's eos: a token its dense-reference answer has at position "
        f"{PRESSURE_EOS_AT[0]} to {PRESSURE_EOS_AT[1]} (picked in "
        f"{time.perf_counter() - start:.2f} s)"
    )
    return picked
