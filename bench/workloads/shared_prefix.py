"""--workload shared-prefix (the default): speed. The same shared-prefix requests through each
step --repeats times, each time through a fresh engine (a cold cache); by default all at once
(--max-running 0), as Hugging Face runs them in one batch. Then the last step again, twice:
after one earlier request has put the shared prefix in the cache (warm prefix: only the later
requests are timed), and with the prefix cache off. Then the peers on the same weights:
Hugging Face's generate, all prompts in one batch, and CTranslate2 with the prefix as its
static prompt (the peers extra). Every row must produce the dense reference model's tokens.

It answers the question a learner asks first: is the engine I built faster than what I use?
The first paragraph here is its part of ``python -m bench --help``.
"""

from __future__ import annotations

from dataclasses import dataclass

from common.numbers import cdiv
from front.workload import shared_prefix_prompts

from ..batch import BatchRunner, Row
from ..models import check_pool_fits
from ..options import BenchOptions
from ..peers import peer_rows
from ..progress import Progress
from ..rows import BatchRun

NAME = "shared-prefix"
SUMMARY = "requests behind one long prefix, all at once (speed)"
HELP = __doc__.split("\n\n")[0]
DEFAULTS = dict(
    requests=16,
    prefix_len=256,
    tail_len=32,
    new_tokens=32,
    max_running=0,
    block_size=16,
    total_blocks=None,
    model="demo",
)
NOT_READ = "draws its own prompts"  # never said: it reads every flag but a sweep's or a rate's


@dataclass(frozen=True)
class SharedPrefix:
    """``num_requests`` prompts, a shared prefix + a tail each (``describe`` says it all)."""

    num_requests: int = 16
    prefix_len: int = 256
    tail_len: int = 32
    max_new_tokens: int = 32
    max_running: int = 16
    seed: int = 0
    total_blocks: int | None = None  # the KV pool; None: room for every request at once
    eos: tuple[int, ...] | None = None  # every answer runs to max_new_tokens

    def prompts(self, vocab_size: int, count: int | None = None) -> list[list[int]]:
        """The requests' prompts (``count`` of them: the first ones are the same whatever the
        count, since the prefix is drawn first, then one tail per request)."""
        n = count or self.num_requests
        return shared_prefix_prompts(n, self.prefix_len, self.tail_len, vocab_size, self.seed)

    def prompt_lengths(self) -> list[int]:
        return [self.prefix_len + self.tail_len] * self.num_requests

    def describe(self) -> str:
        return (
            f"{self.num_requests} requests: a {self.prefix_len}-token shared prefix + "
            f"{self.tail_len} own tokens each, {self.max_new_tokens} new tokens, "
            f"max_running={self.max_running}"
        )

    def earlier_prompt(self, vocab_size: int) -> list[int]:
        """One more request behind the prefix: the traffic that warms the cache first."""
        return self.prompts(vocab_size, self.num_requests + 1)[-1]

    def pool_blocks(self, block_size: int) -> int:
        """``total_blocks`` when set; else room for every request's whole life at once, and
        for the earlier request's blocks too (the warm row keeps them cached)."""
        if self.total_blocks is not None:
            return self.total_blocks
        per_request = cdiv(self.prefix_len + self.tail_len + self.max_new_tokens, block_size)
        return per_request * (self.max_running + 1) + 8


def workload_of(options: BenchOptions) -> SharedPrefix:
    return SharedPrefix(
        num_requests=options.requests,
        prefix_len=options.prefix_len,
        tail_len=options.tail_len,
        max_new_tokens=options.new_tokens,
        max_running=options.running(options.requests),
        total_blocks=options.total_blocks,
    )


def check(options: BenchOptions) -> None:
    """A prompt needs a token; the pool must hold the largest request (before any work)."""
    if options.prefix_len + options.tail_len == 0:
        raise ValueError(
            "--prefix-len and --tail-len are both 0: a prompt needs at least one token"
        )
    check_pool_fits(workload_of(options), options.block_size)


def run(options: BenchOptions, progress: Progress) -> int:
    """Every row, the table, the notes, ``results.json``; 0 when every row's tokens agree."""
    workload = workload_of(options)
    batch = BatchRun(options, workload, progress)
    with batch.phase("steps"):
        rows, runner = batch.step_rows(workload)
        extra = last_step_variants(batch, runner, rows[-1].name, workload)
    if not (options.no_hf and options.no_ctranslate2):
        with batch.phase("peers"):
            extra += peer_rows(
                batch.cfg, batch.weights, workload, options, batch.timed, batch.measure_rows
            )
    batch.measure_rows()
    return batch.finish(workload, rows, extra)


def last_step_variants(
    batch: BatchRun, runner: BatchRunner, last: str, workload: SharedPrefix
) -> list[Row]:
    """The last step with the prefix cached by an earlier request, and with its cache off:
    what the prefix cache itself buys."""
    prompts, earlier = batch.prompts, workload.earlier_prompt(batch.cfg.vocab_size)
    warm = batch.timed(
        f"{last} (warm prefix)",
        "the same, after one earlier request cached the prefix",
        lambda: runner.run(prompts, workload, earlier_prompt=earlier),
        live=runner.computed_so_far,
    )
    cold = batch.timed(
        f"{last} (no cache)",
        "the same, prefix cache disabled",
        lambda: runner.run(prompts, workload, enable_prefix_cache=False),
        live=runner.computed_so_far,
    )
    return [warm, cold]
