"""PagedScheduler: the queues of continuous batching. No memory operation happens here.

The scheduler only moves sequences between its queues, by three rules: first come, first served
for admission; the most recently admitted is the first to go back when memory runs short
(vLLM's FCFS policy); and a round that sent one back admits nobody, since memory is short.
The engine decides when, and its KV cache manager does every allocation and free: that is the
chapter's split. vLLM draws the line elsewhere: its ``Scheduler`` calls
``KVCacheManager.allocate_slots`` and ``free`` itself.
"""

from __future__ import annotations

from collections import deque

from .sequence import Sequence, SequenceStatus


class PagedScheduler:
    """``waiting``: the queue, head first. ``running``: the admitted sequences, oldest first."""

    def __init__(self, max_running: int) -> None:
        if max_running < 1:
            raise ValueError(f"max_running must be >= 1, got {max_running}")
        self.max_running = max_running
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.admission_open = True  # this round's: closed by a preemption until the next round

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def begin_round(self) -> None:
        """A new round: admission is open again."""
        self.admission_open = True

    def next_waiting(self) -> Sequence | None:
        """The head of the queue, if admission is open and the running set has room for one
        more. Nobody behind it is considered: the head waits rather than being overtaken."""
        if self.admission_open and self.waiting and len(self.running) < self.max_running:
            return self.waiting[0]
        return None

    def admit(self, seq: Sequence) -> None:
        """The head of the queue joins the running set (the engine found room for its chunk)."""
        if not self.waiting or self.waiting[0] is not seq:
            raise ValueError(f"sequence {seq.seq_id} is not at the head of the queue")
        self.running.append(self.waiting.popleft())
        seq.admit()

    def preempt(self) -> Sequence:
        """The youngest running sequence goes back to the head of the queue, to start its
        prefill again (vLLM: ``Scheduler._preempt_request``). Taking the youngest means the
        oldest always makes progress: the engine cannot livelock. Memory is short, so nobody
        is admitted for the rest of the round (vLLM's scheduler does the same)."""
        seq = self.running.pop()
        seq.preempt()
        self.waiting.appendleft(seq)
        self.admission_open = False
        return seq

    def remove_finished(self) -> None:
        self.running = [s for s in self.running if s.status is not SequenceStatus.FINISHED]

    def remove(self, seq_id: int) -> Sequence:
        """Take a queued or running sequence out of the queues (an abort); KeyError if none."""
        for queue in (self.running, self.waiting):
            for seq in queue:
                if seq.seq_id == seq_id:
                    queue.remove(seq)
                    return seq
        raise KeyError(f"request {seq_id} is not queued or running")
