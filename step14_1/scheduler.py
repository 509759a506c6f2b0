"""PagedScheduler: who runs this round. No memory operation happens here.

The scheduler only moves sequences between its queues; the engine owns the KV cache manager and
does every allocation and free. That is the chapter's split. vLLM draws the line elsewhere: its
``Scheduler`` calls ``KVCacheManager.allocate_slots`` and ``free`` itself.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from .sequence import Sequence, SequenceStatus


class PagedScheduler:
    """Continuous batching: each round, refill the running set from the queue and split it into
    sequences that still prefill and sequences that decode, so both kinds share every round."""

    def __init__(self, max_running: int) -> None:
        if max_running < 1:
            raise ValueError(f"max_running must be >= 1, got {max_running}")
        self.max_running = max_running
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting) or any(
            s.status is not SequenceStatus.FINISHED for s in self.running
        )

    def schedule(
        self,
        can_admit: Callable[[Sequence], bool] = lambda seq: True,
    ) -> tuple[list[Sequence], list[Sequence]]:
        """Return ``(prefill_seqs, decode_seqs)`` for this round.

        ``can_admit`` is the engine's answer to "is there memory for this one?". Admission is
        first come, first served: the head of the queue waits rather than being overtaken.
        """
        self.running = [s for s in self.running if s.status is not SequenceStatus.FINISHED]
        while self.waiting and len(self.running) < self.max_running and can_admit(self.waiting[0]):
            seq = self.waiting.popleft()
            seq.status = SequenceStatus.PREFILLING
            self.running.append(seq)
        prefill = [s for s in self.running if s.status is SequenceStatus.PREFILLING]
        decode = [s for s in self.running if s.status is SequenceStatus.RUNNING]
        return prefill, decode
