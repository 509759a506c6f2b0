"""OutputProcessor: what an engine's rounds hand back, request by request (vLLM's name).

The engine's loop says what happened (these sequences sampled a token, that one finished, this
one was aborted); this class turns it into ``RequestOutput``s, with the logprobs each request
asked for, and keeps a finished request's ids until ``pop_output`` hands them out. The prompt's
logprobs, when asked, come once, with the request's first token, from a scoring pass of their
own (``common/scoring.py``).
"""

from __future__ import annotations

from typing import Any

from .layers import CausalLM
from .sampler import SamplerOutput
from .sampling_params import RequestOutput, TokenLogprobs
from .scoring import prompt_logprobs
from .status import SequenceStatus

Seq = Any  # a step's Sequence (each step has its own class; this module imports none)


class OutputProcessor:
    def __init__(self, model: CausalLM) -> None:
        self.model = model  # its weights score a prompt, for a request that wants its logprobs
        self.finished: dict[int, list[int]] = {}  # finished requests' ids, until popped
        self.aborted: list[RequestOutput] = []  # reported by the next round
        self._sampled: list[tuple[Seq, TokenLogprobs | None]] = []  # this round's, so far

    def abort(self, seq: Seq) -> None:
        """``seq`` was aborted: the next round reports its end."""
        self.aborted.append(self.output(seq, [], []))

    def sampled(self, seqs: list[Seq], out: SamplerOutput) -> None:
        """Each of ``seqs`` got a new token this round: ``out``, the sampler's, has its
        logprobs (None where the request did not ask), one per sequence."""
        self._sampled += zip(seqs, out.logprobs, strict=True)

    def round_outputs(self, finished: list[Seq]) -> list[RequestOutput]:
        """The round's outputs: the aborts since the last round, then one per sequence that
        sampled a token. ``finished`` sequences leave their ids for ``pop_output``."""
        for seq in finished:
            self.finished[seq.seq_id] = seq.generated_ids
        outputs, self.aborted = self.aborted, []
        new, self._sampled = self._sampled, []
        return outputs + [self.output(seq, seq.generated_ids[-1:], [lp]) for seq, lp in new]

    def pop_output(self, request_id: int) -> list[int]:
        if request_id not in self.finished:
            raise KeyError(f"request {request_id} has not finished, or its output was taken")
        return self.finished.pop(request_id)

    def output(
        self, seq: Seq, new_token_ids: list[int], logprobs: list[TokenLogprobs | None]
    ) -> RequestOutput:
        """What the round did for ``seq``. Logprobs only if the request asked: the new
        tokens' (``logprobs``), and the prompt's once, with the request's first token."""
        params, generated = seq.sampling_params, list(seq.generated_ids)
        first_token = bool(new_token_ids) and len(generated) == 1
        scored = params.prompt_logprobs is not None and first_token
        return RequestOutput(
            seq.seq_id,
            new_token_ids,
            generated,
            seq.status is SequenceStatus.FINISHED,
            seq.finish_reason,
            seq.num_cached_tokens,
            logprobs=None if params.logprobs is None else list(logprobs),
            prompt_logprobs=(
                prompt_logprobs(self.model, seq.prompt_ids, params.prompt_logprobs)
                if scored
                else None
            ),
        )
