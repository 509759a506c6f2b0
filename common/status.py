"""SequenceStatus: the life of a request, the same in every step.

Every step's ``Sequence`` moves through these states (``sequence.py`` has the methods that move
it), and every step re-exports the enum. It lives in the core so that whoever watches an engine
(the trace, a server) compares statuses as enum members, whichever step it watches.
"""

from __future__ import annotations

from enum import Enum, auto


class SequenceStatus(Enum):
    WAITING = auto()  # queued, no blocks yet
    PREFILLING = auto()  # admitted; prompt being processed one block-sized chunk per round
    RUNNING = auto()  # prompt done; one decode token per round
    PREEMPTED = auto()  # its blocks were taken back; queued again, to recompute its tokens
    FINISHED = auto()  # max_new_tokens reached, an eos produced, or aborted; blocks released
