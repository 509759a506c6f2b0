"""PagedPrefixCacheEngine: paged KV + block-granular prefix cache + chunked prefill +
continuous batching, in one loop.

Each round (``step``): every running sequence, oldest first, takes its next step, then waiting
ones are admitted while their first chunk fits. A prefilling sequence first adopts whatever
blocks the cache already holds, then advances one chunk of as many whole blocks as the round's
token budget has left (``max_num_batched_tokens``, after one token for each decoding sequence;
the prompt's last chunk may end inside a block), so chunk boundaries are still cache
boundaries; a decoding sequence produces one token.
Memory comes on demand: a block is taken when a token first needs it, and when none is left
the youngest running sequence is preempted (its blocks go back; it recomputes later). Each new
token is greedy or drawn (``common/sampler.py``). Finished sequences give their blocks back.
Every block that fills up, prompt or output, is cached at once, so the next sequence can adopt
it. Every memory operation is the KV cache manager's (``kv_cache_manager.py``); this file is
the round loop and the public API. What only serving needs (the outputs, KV events,
watchers) lives in ``common/``, reached by a named call or two. With a second tier
(``kv_offloading_backend``), every cached block is also written through to it after the round's
forward pass, and the cache's lookups go on in it: a prefix the pool evicted is loaded back
instead of computed.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass, replace

import torch

from common.inputs import Request, check_request, check_requests, check_token_budget
from common.kv_events import KVCacheEvent, KVEventLog
from common.kv_offload import KVOffload
from common.kv_tiers import KVTier, make_tier
from common.observer import Observers
from common.outputs import OutputProcessor
from common.sampler import SamplingState, sample
from common.sampling_params import RequestOutput, SamplingParams, with_seed
from common.snapshot import PoolSnapshot
from common.stats import EngineStats

from .kv_cache_manager import KVCacheManager
from .model import TinyTransformerPaged
from .scheduler import PagedScheduler
from .sequence import Sequence, SequenceStatus

# Tokens a round computes at most, decode rows first (vLLM's ``max_num_batched_tokens``). On a
# CPU a prefill matmul of a few hundred rows already runs near the machine's rate; a longer
# chunk buys little more, and holds the round's decode rows back longer (README).
MAX_NUM_BATCHED_TOKENS = 512


@dataclass
class ScheduledChunk:
    """What one sequence computes in a round: a prefill chunk, or its newest token."""

    seq: Sequence
    token_ids: list[int]
    start: int  # the position of its first token

    @property
    def end(self) -> int:
        """The KV of the sequence's first ``end`` tokens is in the pool once it is computed."""
        return self.start + len(self.token_ids)


class PagedPrefixCacheEngine:
    def __init__(
        self,
        model: TinyTransformerPaged,
        max_running: int = 8,
        enable_prefix_cache: bool = True,
        enable_kv_cache_events: bool = False,
        seed: int = 0,
        max_num_batched_tokens: int | None = None,
        kv_offloading_backend: str | KVTier | None = None,
        kv_offloading_size: float | None = None,
    ) -> None:
        self.model = model
        self.block_size = model.cfg.block_size
        if max_num_batched_tokens is None:  # the default, raised if max_running needs more
            max_num_batched_tokens = max(MAX_NUM_BATCHED_TOKENS, self.block_size + max_running - 1)
        self.max_num_batched_tokens = check_token_budget(
            max_num_batched_tokens, self.block_size, max_running
        )
        self.kv_events = KVEventLog(self.block_size)  # vLLM's KV cache events, when enabled
        # Whoever watches (``observer.add(watcher)``): the trace, the bench, the KV events.
        self.observer = Observers([self.kv_events] if enable_kv_cache_events else [])
        self.kv_cache_manager = KVCacheManager(
            model.cfg.total_blocks,
            self.block_size,
            enable_prefix_cache,
            self.observer,
            self._second_tier(kv_offloading_backend, kv_offloading_size, enable_prefix_cache),
        )
        self.scheduler = PagedScheduler(max_running)
        self.outputs = OutputProcessor(model)  # RequestOutputs, and finished ids until popped
        self._counters = EngineStats()
        self._next_id = 0
        self._seeds = random.Random(seed)  # a seed for each request that brings none

    # ---- public API -------------------------------------------------------------------------

    def add_request(
        self,
        prompt_ids: list[int],
        max_new_tokens: int | None = None,
        eos_token_id: object = None,
        *,
        sampling_params: SamplingParams | None = None,
    ) -> int:
        """Queue a request; returns its id. ``eos_token_id``: None, one id or a collection of
        ids (the request stops at any). ``sampling_params`` stands in for ``max_new_tokens``
        and says how to sample (greedy by default). Bad input raises ValueError and changes
        nothing."""
        cfg = self.model.cfg
        return self.add_checked_request(
            check_request(prompt_ids, max_new_tokens, eos_token_id, cfg, sampling_params)
        )

    @property
    def has_work(self) -> bool:
        """A request is queued or running, or an abort waits for ``step()`` to report it: a
        ``while engine.has_work: engine.step()`` loop sees every request end."""
        return self.scheduler.has_work or bool(self.outputs.aborted)

    def step(self) -> list[RequestOutput]:
        """One round of continuous batching: every scheduled sequence in one model call.
        Returns the round's outputs: one per request that produced a token or ended."""
        work = list(self._schedule())
        if work:
            last_logits = self._forward(work)
            self.kv_cache_manager.write_through()  # the blocks cached this round, to the tier
            rows = [i for i, w in enumerate(work) if self._computed(w)]  # rows that give a token
            self._sample(last_logits[rows], [work[i].seq for i in rows])  # sampled together
        return self._finish_round([w.seq for w in work])

    def generate(
        self,
        prompts: list[list[int]],
        max_new_tokens: int | None = None,
        eos_token_id: object = None,
        *,
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
    ) -> list[list[int]]:
        """Serve all prompts together (continuous batching); returns generated ids per prompt.
        ``sampling_params``: one for every prompt, or a list with one per prompt."""
        cfg = self.model.cfg
        requests = check_requests(prompts, max_new_tokens, eos_token_id, cfg, sampling_params)
        return self._run([self.add_checked_request(r) for r in requests])

    def generate_serial(
        self,
        prompts: list[list[int]],
        max_new_tokens: int | None = None,
        eos_token_id: object = None,
        *,
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
    ) -> list[list[int]]:
        """Serve prompts one at a time, through the same engine and cache."""
        cfg = self.model.cfg
        requests = check_requests(prompts, max_new_tokens, eos_token_id, cfg, sampling_params)
        return [self._run([self.add_checked_request(r)])[0] for r in requests]

    def abort(self, request_id: int) -> list[int]:
        """Cancel a queued or running request at once: its blocks go back (full ones stay
        cached). Returns the ids generated so far; KeyError if it is not queued or running. The
        next ``step()`` reports its end ("abort"); ``has_work`` stays True until it has."""
        seq = self.scheduler.remove(request_id)
        self.kv_cache_manager.free(seq)
        seq.abort()
        self.outputs.abort(seq)
        return list(seq.generated_ids)

    def reset_prefix_cache(self) -> bool:
        """Empty the prefix cache, every cached block back to the free pool. Only with no
        request running (vLLM's rule): otherwise nothing changes and it returns False."""
        if self.scheduler.running:
            return False
        self.kv_cache_manager.reset_prefix_cache()
        return True

    def take_events(self) -> list[KVCacheEvent]:
        """The prefix cache's changes since the last call, oldest first: vLLM's KV cache events
        (``common/kv_events.py``). Empty unless ``enable_kv_cache_events=True``."""
        return self.kv_events.take()

    def snapshot(self) -> PoolSnapshot:
        """The pool now, and who holds which block: a copy for a watcher to read."""
        return PoolSnapshot.of(
            self.kv_cache_manager, self.scheduler.running, self.scheduler.waiting
        )

    def pop_output(self, request_id: int) -> list[int]:
        """The generated ids of a finished request, handed out once."""
        return self.outputs.pop_output(request_id)

    @property
    def stats(self) -> EngineStats:
        """The counters of the work done, and the queues and the pool as they are now."""
        return replace(
            self._counters,
            requests_running=len(self.scheduler.running),
            requests_waiting=len(self.scheduler.waiting),
            **self.kv_cache_manager.pool_figures(),
        )

    def reset_stats(self) -> None:
        """Zero the request/token counters (the cache, evictions and peak are kept)."""
        self._counters = EngineStats()

    def ref_count_problems(self) -> list[str]:
        """What is wrong with the pool at rest (empty: every block free or cached alone)."""
        if self.has_work:
            return ["engine is not at rest"]
        return self.kv_cache_manager.ref_count_problems()

    # ---- requests in, outputs out -----------------------------------------------------------

    def add_checked_request(self, request: Request) -> int:
        """Queue a request that ``common.inputs.check_request`` passed against this model's
        config, without checking it again (the server checks on its tokenizer thread)."""
        params = with_seed(request.sampling_params, self._seeds)
        r = request
        seq = Sequence(self._next_id, r.prompt_ids, r.max_new_tokens, r.eos_token_ids, params)
        self._next_id += 1
        self.scheduler.add(seq)
        return seq.seq_id

    def _second_tier(
        self, backend: str | KVTier | None, size_gib: float | None, enable_prefix_cache: bool
    ) -> KVOffload | None:
        """The second tier (vLLM's ``--kv-offloading-backend`` and ``--kv-offloading-size``):
        a size alone means host memory; neither, none. A tier holds the prefix cache's blocks
        by their chain hash: with the cache off there is none."""
        if (backend is None and size_gib is None) or not enable_prefix_cache:
            return None
        tier = backend if isinstance(backend, KVTier) else make_tier(backend or "host", size_gib)
        return KVOffload(tier, self.model, self.observer)

    def _run(self, request_ids: list[int]) -> list[list[int]]:
        while self.has_work:
            self.step()
        return [self.pop_output(i) for i in request_ids]

    # ---- one round's work -------------------------------------------------------------------

    def _schedule(self) -> Iterator[ScheduledChunk]:
        """This round's work, oldest first: each running sequence's next chunk or token, then
        the first chunk of each waiting one that fits (vLLM's ``Scheduler.schedule`` order).

        The whole round is scheduled before its one model call, and each block is registered
        in the cache when it is scheduled, so a sequence can adopt a block that one scheduled
        before it fills in the same call. The round computes ``max_num_batched_tokens`` tokens
        at most: each decoding sequence's one counts first (vLLM's budget), and prefill chunks
        share what is left, oldest first. When a running sequence needs a block the pool
        cannot give, the youngest running one is preempted (perhaps itself). It has not been
        scheduled yet, so nobody loses blocks it was given (or registered) this round. After a
        preemption nobody is admitted this round: memory is short.
        """
        self.scheduler.begin_round()
        self.observer.round_started()
        running = self.scheduler.running
        budget = self.max_num_batched_tokens - sum(
            s.status is SequenceStatus.RUNNING for s in running
        )
        for seq in list(running):
            if seq.status is SequenceStatus.PREEMPTED:  # an older one needed its blocks
                continue
            if seq.status is SequenceStatus.PREFILLING:
                work = self._schedule_prefill_chunk(seq, budget)
                budget -= len(work.token_ids) if work else 0
            else:
                work = self._schedule_decode_token(seq)
            if work is not None:
                yield work
        while seq := self.scheduler.next_waiting():  # none after a preemption this round
            work = self._schedule_prefill_chunk(seq, budget, may_preempt=False)
            if work is None:
                self.observer.waits(seq)  # its first chunk does not fit: it waits at the head
                return
            budget -= len(work.token_ids)
            self.scheduler.admit(seq)
            self.observer.admitted(seq)
            yield work

    def _schedule_prefill_chunk(
        self, seq: Sequence, budget: int, may_preempt: bool = True
    ) -> ScheduledChunk | None:
        """The sequence's next chunk and the position of its first token, with room for it;
        None when ``budget`` (tokens the round has left) cannot take a block of it.

        Before each chunk, not only at admission, the sequence adopts the next blocks the cache
        already holds: requests that run together then leapfrog through a shared prefix, each
        computing blocks nobody has yet, so every shared block is computed exactly once.
        """
        hits = self.kv_cache_manager.get_computed_blocks(seq)
        start = seq.prefill_offset + len(hits) * self.block_size
        chunk = seq.token_ids[start : start + self._chunk_len(seq.num_tokens - start, budget)]
        if not chunk:
            return None
        first_hit = bool(hits) and not seq.hit_block_ids
        if not self._allocate_slots(seq, start + len(chunk), hits, may_preempt):
            return None
        self._counters.count_prefill_chunk(seq, len(hits) * self.block_size, len(chunk), first_hit)
        seq.advance_prefill(start)  # the adopted blocks' tokens are in the pool
        self.observer.scheduled(seq, start, len(chunk))
        # Registered now, before the forward pass that writes them: a sequence scheduled later
        # in this round adopts them instead of computing them. Safe because forward_batched
        # writes every token's K/V of a layer before any attention of that layer reads the pool.
        for end in range(start + self.block_size, start + len(chunk) + 1, self.block_size):
            self.kv_cache_manager.cache_blocks(seq, end)
        return ScheduledChunk(seq, chunk, start)

    def _chunk_len(self, num_left: int, budget: int) -> int:
        """How many of the sequence's ``num_left`` tokens to prefill now: all of them if the
        budget takes them (the prompt's last chunk may end inside a block), else the whole
        blocks it takes, so that every chunk but the last ends on a block boundary, where the
        prefix cache names blocks. 0: not even one block fits this round."""
        if num_left <= budget:
            return num_left
        return max(budget, 0) // self.block_size * self.block_size

    def _schedule_decode_token(self, seq: Sequence) -> ScheduledChunk | None:
        """The newest token, whose KV is not in the pool yet, and its position."""
        position = seq.num_tokens - 1
        if not self._allocate_slots(seq, position + 1):
            return None
        self.kv_cache_manager.cache_blocks(seq, position + 1)  # registered before it is written
        self._counters.computed_decode_tokens += 1
        self.observer.scheduled(seq, position, 1)
        return ScheduledChunk(seq, [seq.last_token_id], position)

    def _num_shared_blocks(self, work: list[ScheduledChunk]) -> int:
        """The leading blocks that every sequence of the round holds, up to the earliest chunk's
        first token: cascade attention reads them once for all (vLLM's scheduler counts these
        ``num_common_prefix_blocks`` every step). The round runs every running sequence, so
        blocks that all running ones hold are the round's shared blocks. Alone, none."""
        if len(work) < 2:
            return 0
        running = len(self.scheduler.running)
        common = self.kv_cache_manager.num_common_prefix_blocks(work[0].seq, running)
        return min(common, min(w.start for w in work) // self.block_size)

    def _allocate_slots(
        self,
        seq: Sequence,
        num_tokens: int,
        hits: list[int] | None = None,
        may_preempt: bool = True,
    ) -> bool:
        """Room for the sequence's first ``num_tokens`` tokens. While the pool is short,
        preempt the youngest running sequence: its blocks go back (full ones stay cached) and
        it will recompute. Returns False if the sequence itself had to go, or may not preempt.
        """
        while not self.kv_cache_manager.allocate_slots(seq, num_tokens, hits):
            if not may_preempt:
                return False
            victim = self.scheduler.preempt()
            self.observer.preempted(victim, seq)
            self.kv_cache_manager.free(victim)
            self._counters.preemptions += 1
            if victim is seq:
                return False
        return True

    @staticmethod
    def _computed(work: ScheduledChunk) -> bool:
        """The model has computed ``work``: a prefilling sequence's KV now reaches the chunk's
        end, and once that is the whole prompt it decodes. Returns whether the chunk's last row
        gives the sequence's next token: yes once it decodes (a decode token, or the chunk that
        ended its prompt); a chunk in the middle of a prompt has nothing to say yet."""
        if work.seq.status is SequenceStatus.PREFILLING:
            work.seq.advance_prefill(work.end)
        return work.seq.status is SequenceStatus.RUNNING

    def _forward(self, work: list[ScheduledChunk]) -> torch.Tensor:
        """The round's one model call; returns each chunk's last row of logits (the one a
        sampling sequence samples from)."""
        return self.model.forward_batched(
            [w.token_ids for w in work],
            [w.seq.block_table for w in work],
            [w.start for w in work],
            self._num_shared_blocks(work),
        )

    def _sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> None:
        """The next token of each sequence from its row of logits, appended and handed to the
        outputs. A sequence's k-th draw depends on its own params, tokens, seed and k alone:
        batching, preemption and the cache never change it."""
        out = sample(logits, [SamplingState.of(seq) for seq in seqs])
        for seq, token in zip(seqs, out.token_ids):
            seq.append_token(token)
        self.outputs.sampled(seqs, out)

    def _finish_round(self, scheduled: list[Sequence]) -> list[RequestOutput]:
        """Finished sequences give their blocks back; the round's outputs: one per sequence that
        produced a token, and one per abort since the last round."""
        self._counters.rounds += bool(scheduled)
        self._counters.seqs_scheduled += len(scheduled)
        finished = [seq for seq in scheduled if seq.status is SequenceStatus.FINISHED]
        for seq in finished:
            self.kv_cache_manager.free(seq)
        self.scheduler.remove_finished()
        self.observer.round_ended()
        return self.outputs.round_outputs(finished)
