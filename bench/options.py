"""``BenchOptions``: ``python -m bench``'s flags, read once into their types (``bench/cli.py``);
a field a workload does not read (no ``DEFAULTS`` entry in its module) is None."""

from __future__ import annotations

from dataclasses import dataclass

from front.options import EngineOptions


@dataclass(frozen=True)
class BenchOptions:
    workload: str
    model: str  # a preset name or a checkpoint directory
    steps: tuple[str, ...]  # the first is the baseline of every comparison
    repeats: int
    out: str
    # the requests, each workload's own (None: a workload that does not read it)
    requests: int | None = None
    prefix_len: int | None = None
    tail_len: int | None = None
    new_tokens: int | None = None
    max_running: int | None = None  # 0: every request at once
    sweep_requests: tuple[int, ...] | None = None
    sweep_cached: tuple[int, ...] | None = None
    request_rate: float | None = None
    endpoint: str | None = None  # serving: an OpenAI-compatible server's URL, served too
    replicas: int | None = None  # replicas: servers behind the router
    policies: tuple[str, ...] | None = None  # replicas: vllm-router's routing policies
    tenants: int | None = None  # replicas: system prompts, two users each
    turns: int | None = None  # replicas: requests per conversation
    turn_delay: float | None = None  # replicas: seconds between an answer and the next turn
    # the engine (cli.add_engine_flags)
    block_size: int = 16
    total_blocks: int | None = None  # None: the workload sizes the pool
    device: str = "cpu"
    dtype: str = "float32"
    threads: int = 1  # torch's (and every peer's) CPU threads; 0: one per core
    no_memory_check: bool = False
    max_num_batched_tokens: int | None = None  # step14_9 on; None: the engine's default
    kv_offloading_backend: str | None = None  # step14_10: its second tier; None: none
    kv_offloading_size: float | None = None
    # what else runs, and how it is shown
    no_hf: bool = False
    no_ctranslate2: bool = False
    no_reference: bool = False
    quiet: bool = False

    def engine_options(self) -> EngineOptions:
        """The engine flags as every command reads them (the pool: the workload's, unless
        ``--total-blocks``)."""
        return EngineOptions(
            device=self.device,
            dtype=self.dtype,
            block_size=self.block_size,
            total_blocks=self.total_blocks,
            threads=self.threads,
            no_memory_check=self.no_memory_check,
            max_num_batched_tokens=self.max_num_batched_tokens,
            kv_offloading_backend=self.kv_offloading_backend,
            kv_offloading_size=self.kv_offloading_size,
        )

    def running(self, requests: int) -> int:
        """``--max-running``, with 0 meaning all ``requests`` at once."""
        return self.max_running or requests
