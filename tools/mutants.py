"""Mutation check of the test suite: plant one small bug at a time, run that step's tests.

Every mutant below is a realistic slip (a flipped comparison, an off-by-one, a dropped guard, a
wrong order, a removed line) in one file of one step, or in a shared file of ``common/``. The
suite must catch each of them: a mutant that survives names a promise no test pins. Nothing
here touches the working tree: the repository is copied to a temporary directory, and each
mutant is planted in that copy and undone before the next.

    python tools/mutants.py                      # every mutant (about an hour on 2 busy cores)
    python tools/mutants.py --only s14-kvm       # the mutants whose id starts with a prefix
    python tools/mutants.py --only s14_5,c-demo  # several prefixes
    python tools/mutants.py --list               # the mutants, each checked to still apply

A mutant counts as killed when its tests fail (or run past ``--timeout``). Its tests are those
of its step: every test whose ``step`` (or ``step_name``) parameter is that step, in every file
of ``tests/`` (the component files and the step-fix files ``tests/test_step14_*.py`` alike).
``tests/steps/test_structure.py`` is left out, since it flags any edit to a step's files whatever the
edit does. A mutant of ``common/`` is shared by every step, so one step's tests stand for all
(step14's), unless the mutant names test files of its own (``tests=``: the demo's checks live
in tests that run no step). ``--list`` reports a mutant whose text no longer occurs in its file
as stale: after a change to the code, bring its ``old`` text up to date.
"""

# ruff: noqa: E501  (the mutant table keeps each mutant on a few aligned lines)
from __future__ import annotations

import argparse
import io
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
IGNORED = shutil.ignore_patterns(".git", ".venv", "__pycache__", "*.egg-info", ".ruff_cache")


@dataclass(frozen=True)
class Mutant:
    id: str
    step: str  # the step whose tests must catch it (for common/, one step stands for all)
    file: str  # in the step's folder; or, starting with "common/", "front/" or "bench/", in the
    # repository
    old: str  # must occur exactly once in the file
    new: str
    what: str
    more: tuple[tuple[str, str], ...] = ()  # further (old, new) edits of the same file
    tests: tuple[str, ...] = ()  # test files to run whole instead of the step's tests

    @property
    def path(self) -> str:
        """The mutated file, relative to the repository."""
        shared = self.file.startswith(("common/", "front/", "bench/"))  # not in a step's folder
        return self.file if shared else f"{self.step}/{self.file}"


M = Mutant
T10 = "tests/steps/test_step14_10_second_tier.py"  # step14_10's tests take no step parameter
# fmt: off
MUTANTS = [
    # ---- step14/scheduler.py --------------------------------------------------------------------
    M("s14-sched-max-running", "step14", "scheduler.py",
      "len(self.running) < self.max_running", "len(self.running) <= self.max_running",
      "admits one sequence more than max_running"),
    M("s14-sched-keep-finished", "step14", "scheduler.py",
      "        self.running = [s for s in self.running if s.status is not SequenceStatus.FINISHED]\n",
      "        pass\n", "finished sequences keep their place in the running set"),
    M("s14-sched-has-work", "step14", "scheduler.py",
      "return bool(self.waiting or self.running)", "return bool(self.waiting)",
      "has_work false while requests run"),
    M("s14-sched-lifo", "step14", "scheduler.py",
      "            return self.waiting[0]\n", "            return self.waiting[-1]\n",
      "the newest waiting request is admitted first",
      more=(("if not self.waiting or self.waiting[0] is not seq:",
             "if not self.waiting or self.waiting[-1] is not seq:"),
            ("self.running.append(self.waiting.popleft())", "self.running.append(self.waiting.pop())"))),
    # ---- step14/sequence.py ---------------------------------------------------------------------
    M("s14-seq-max-new", "step14", "sequence.py",
      "len(self.generated_ids) >= self.max_new_tokens", "len(self.generated_ids) > self.max_new_tokens",
      "one token more than max_new_tokens"),
    M("s14-seq-no-eos", "step14", "sequence.py",
      "        if token_id in self.eos_token_ids:\n            self._finish(\"stop\")\n        elif",
      "        if", "eos ignored"),
    M("s14-seq-prefill-done", "step14", "sequence.py",
      "self.prefill_offset >= self.num_tokens", "self.prefill_offset > self.num_tokens",
      "prefill done one token late"),
    # ---- step14/block_manager.py ----------------------------------------------------------------
    M("s14-bm-allocate-bound", "step14", "block_manager.py",
      "if n > len(self._free_ids):", "if n >= len(self._free_ids):",
      "allocating the whole free pool is refused"),
    M("s14-bm-negative-n", "step14", "block_manager.py",
      "        if n < 0:\n            raise ValueError(f\"cannot allocate {n} blocks\")\n", "",
      "allocate(-1) silently returns nothing"),
    M("s14-bm-free-precheck", "step14", "block_manager.py",
      "if self._block(block_id).ref_count < n:", "if self._block(block_id).ref_count < 1:",
      "free() checks each id once, not how often it is named"),
    M("s14-bm-retain-free", "step14", "block_manager.py",
      "        if block.ref_count == 0:\n            raise ValueError(f\"cannot retain",
      "        if block.ref_count < 0:\n            raise ValueError(f\"cannot retain",
      "retaining a free block is allowed"),
    M("s14-bm-range", "step14", "block_manager.py",
      "if not 0 <= block_id < self.total_blocks:", "if not block_id < self.total_blocks:",
      "block id -1 means the last block"),
    M("s14-bm-free-stays", "step14", "block_manager.py",
      "            if block.ref_count == 0:\n                self._free_ids.append(block_id)\n",
      "            if block.ref_count == 0 and block_id:\n                self._free_ids.append(block_id)\n",
      "block 0 never returns to the free pool"),
    # ---- step14/prefix_cache.py -----------------------------------------------------------------
    M("s14-pc-evict-any", "step14", "prefix_cache.py",
      "            if victim.num_children:  # only if a caller let go of a chain head first\n",
      "            if False:\n",
      "eviction may take a block whose cached children stay (not leaf-only)"),
    M("s14-pc-evict-in-use", "step14", "prefix_cache.py",
      "if self.block_manager.ref_count(block_id) == 1:",
      "if self.block_manager.ref_count(block_id) >= 1:",
      "blocks that requests still hold join the eviction queue"),
    M("s14-pc-evictable", "step14", "prefix_cache.py",
      "return len(self._evictable)", "return len(self._by_block)",
      "blocks held by requests counted as evictable"),
    M("s14-pc-match-parent", "step14", "prefix_cache.py",
      " or entry.parent_id != parent", "", "hits not verified against their parent"),
    M("s14-pc-match-tokens", "step14", "prefix_cache.py",
      " or entry.token_ids != tokens", "", "hits not verified against their tokens"),
    M("s14-pc-touch-order", "step14", "prefix_cache.py",
      "self._evictable.move_to_end(block_id)", "self._evictable.move_to_end(block_id, last=False)",
      "a block let go of joins the eviction queue at its head (least recently used)"),
    M("s14-pc-insert-no-retain", "step14", "prefix_cache.py",
      "        self.block_manager.retain(block_id)  # the cache's own reference\n", "",
      "the cache holds no reference to its blocks"),
    M("s14-pc-count-evictions", "step14", "prefix_cache.py",
      "            self.num_evictions += 1\n", "", "evictions not counted"),
    M("s14-pc-children", "step14", "prefix_cache.py",
      "            self._by_block[entry.parent_id].num_children -= 1\n", "            pass\n",
      "a parent never becomes a leaf again"),
    M("s14-pc-last-wins", "step14", "prefix_cache.py",
      "if block_hash in self._by_hash or block_id in self._by_block:", "if block_id in self._by_block:",
      "a second block under a cached hash replaces the first"),
    M("s14-pc-evict-newest", "step14", "prefix_cache.py",
      "victim = next(iter(self._evictable.values()))", "victim = next(reversed(self._evictable.values()))",
      "most recently used evicted first"),
    M("s14-pc-count-by-scan", "step14", "prefix_cache.py",
      "return len(self._evictable)",
      "return sum(1 for b in self._by_block if self.block_manager.ref_count(b) == 1)",
      "evictable blocks counted by a scan of the cache (right, but O(cache) per allocation)"),
    M("s14-pc-evict-by-scan", "step14", "prefix_cache.py",
      "victim = next(iter(self._evictable.values()))",
      "victim = next(e for b, e in self._by_block.items() if b in self._evictable and not e.num_children)",
      "the victim found by walking the cache from its oldest block (O(held blocks) per eviction)"),
    M("s14_7-kvm-available-by-scan", "step14_7", "kv_cache_manager.py",
      "        return self.block_manager.num_free + evictable\n",
      "        return sum(self.block_manager.ref_count(b) == 0 for b in range(self.block_manager.total_blocks)) + evictable\n",
      "free blocks counted by a scan of the pool"),
    # ---- step14/kv_cache_manager.py --------------------------------------------------------------
    M("s14-kvm-touch-head-first", "step14", "kv_cache_manager.py",
      "self.prefix_cache.update_eviction_queue(seq.block_table[::-1])",
      "self.prefix_cache.update_eviction_queue(seq.block_table)",
      "a finished request's blocks touched head first"),
    M("s14-kvm-no-touch", "step14", "kv_cache_manager.py",
      "            self.prefix_cache.update_eviction_queue(seq.block_table[::-1])  # tail first\n",
      "            pass\n", "blocks a finished request lets go of never become evictable"),
    M("s14-kvm-adopt-no-touch", "step14", "kv_cache_manager.py",
      "            self.prefix_cache.update_eviction_queue(computed_blocks)\n", "            pass\n",
      "an adopted block stays in the eviction queue while a request holds it"),
    M("s14-kvm-lookup-no-parent", "step14", "kv_cache_manager.py",
      "parent_id = seq.block_table[-1] if seq.block_table else None", "parent_id = None",
      "a later lookup does not continue the block table's chain"),
    M("s14-kvm-lookup-last", "step14", "kv_cache_manager.py",
      "last = (seq.num_tokens - 1) // self.block_size", "last = seq.num_tokens // self.block_size",
      "a full-prompt hit takes the block of the last prompt token"),
    M("s14-kvm-adopt-evictable", "step14", "kv_cache_manager.py",
      "if missing + adopted_evictable > self.num_available_blocks:",
      "if missing > self.num_available_blocks:",
      "adopting a cache-only block is forgotten to make it unevictable (room over-counted)"),
    M("s14-kvm-admit-bound", "step14", "kv_cache_manager.py",
      "if missing + adopted_evictable > self.num_available_blocks:",
      "if missing + adopted_evictable >= self.num_available_blocks:",
      "a chunk that exactly fits the pool is refused"),
    M("s14-kvm-evict-extra", "step14", "kv_cache_manager.py",
      "shortfall = n - self.block_manager.num_free", "shortfall = n - self.block_manager.num_free + 1",
      "evicts one block more than the free pool lacks"),
    M("s14-kvm-no-parent", "step14", "kv_cache_manager.py",
      "parent_id = seq.block_table[block_idx - 1] if block_idx else None", "parent_id = None",
      "blocks cached without their parent"),
    M("s14-kvm-partial-block", "step14", "kv_cache_manager.py",
      "if self.prefix_cache is None or num_tokens % self.block_size:",
      "if self.prefix_cache is None:", "a partial block is offered to the cache"),
    M("s14-kvm-hits-leak", "step14", "kv_cache_manager.py",
      "            self.block_manager._blocks[block_id].ref_count -= 1\n", "            pass\n",
      "adopted blocks keep the finished request's reference"),
    M("s14-kvm-no-retain", "step14", "kv_cache_manager.py",
      "            self.block_manager.retain(block_id)\n", "            pass\n",
      "an adopted block gets no reference of its adopter"),
    # ---- step14/engine.py -----------------------------------------------------------------------
    M("s14-eng-adopt-at-admission-only", "step14", "engine.py",
      "hits = self.kv_cache_manager.get_computed_blocks(seq)",
      "hits = self.kv_cache_manager.get_computed_blocks(seq) if seq.prefill_offset == 0 else []",
      "the cache is looked up only before the first chunk (no leapfrogging)"),
    M("s14-seq-prefill-done-always", "step14", "sequence.py",
      "        return self.is_prefill_done\n", "        return True\n",
      "a chunk in the middle of a prompt samples a token"),
    M("s14-seq-prefill-done-prompt", "step14", "sequence.py",
      "        if self.is_prefill_done:\n            self.status = SequenceStatus.RUNNING\n",
      "        if num_tokens >= self.prompt_len:\n            self.status = SequenceStatus.RUNNING\n",
      "a resumed request decodes before its output is prefilled again"),
    M("s14-eng-abort-not-work", "step14", "engine.py",
      "return self.scheduler.has_work or bool(self.outputs.aborted)", "return self.scheduler.has_work",
      "the abort of the last request is never seen by a has_work loop"),
    M("c-stats-no-cached-tokens", "step14", "common/stats.py",
      "        seq.num_cached_tokens += adopted\n", "",
      "a request's outputs never say what the cache served"),
    M("s14-eng-waiting-uncounted", "step14", "engine.py",
      "requests_waiting=len(self.scheduler.waiting)", "requests_waiting=0",
      "the stats never count the waiting queue"),
    M("c-observers-stay", "step14", "common/observer.py",
      "        self._watchers.remove(watcher)\n", "        pass\n",
      "a removed observer still hears every event"),
    M("s14-eng-hit-counted-twice", "step14", "engine.py",
      "first_hit = bool(hits) and not seq.hit_block_ids", "first_hit = bool(hits)",
      "a request that adopts twice counts as two hits"),
    M("s14-eng-no-output-blocks", "step14", "engine.py",
      "            self.kv_cache_manager.cache_blocks(seq, work.end)  # its KV is in the pool\n",
      "            if seq.status is SequenceStatus.PREFILLING:  # its KV is in the pool\n"
      "                self.kv_cache_manager.cache_blocks(seq, work.end)\n",
      "output blocks are not cached"),
    M("s14-eng-output-block-late", "step14", "engine.py",
      "self.kv_cache_manager.cache_blocks(seq, work.end)  # its KV is in the pool",
      "self.kv_cache_manager.cache_blocks(seq, work.end - (seq.status is SequenceStatus.RUNNING))",
      "an output block is cached one token late"),
    M("s14-eng-start-after-adopt", "step14", "engine.py",
      "        self._counters.count_prefill_chunk(seq, len(hits) * self.block_size, len(chunk), first_hit)\n"
      "        seq.advance_prefill(start)  # the adopted blocks' tokens are in the pool\n",
      "        seq.advance_prefill(start)  # the adopted blocks' tokens are in the pool\n"
      "        self._counters.count_prefill_chunk(seq, len(hits) * self.block_size, len(chunk), first_hit)\n",
      "a request that hits at once is never counted (its offset moved past 0 before it is counted)"),
    M("s14-kvm-blocks-used", "step14", "kv_cache_manager.py",
      "\"blocks_used\": bm.total_blocks - self.num_available_blocks,",
      "\"blocks_used\": bm.total_blocks - bm.num_free - (len(cache) if cache is not None else 0),",
      "cached blocks that requests hold are not counted as used"),
    M("c-stats-token-hit-rate", "step14", "common/stats.py",
      "return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0",
      "return self.cached_tokens / self.computed_tokens if self.computed_tokens else 0.0",
      "token hit rate over computed tokens"),
    M("c-stats-hit-rate", "step14", "common/stats.py",
      "return self.requests_hit / self.requests if self.requests else 0.0",
      "return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0",
      "hit rate counts tokens, not requests"),
    M("s14-eng-reset-cache", "step14", "engine.py",
      "        self._counters = EngineStats()\n\n    def ref_count_problems",
      "        self._counters = EngineStats()\n        cache = self.kv_cache_manager.prefix_cache\n"
      "        if cache is not None:\n            cache.evict(cache.num_evictable)\n\n    def ref_count_problems",
      "reset_stats empties the cache"),
    M("c-outputs-pop-twice", "step14", "common/outputs.py",
      "return self.finished.pop(request_id)", "return self.finished[request_id]",
      "an output can be taken twice"),
    M("s14-eng-serial-validate", "step14", "engine.py",
      "        requests = check_requests(prompts, max_new_tokens, eos_token_id, cfg, sampling_params)\n"
      "        return [self._run([self.add_checked_request(r)])[0] for r in requests]\n",
      "        return [self.generate([p], max_new_tokens, eos_token_id, sampling_params=sampling_params)[0] for p in prompts]\n",
      "generate_serial serves good prompts before a bad one"),
    M("s14-eng-generate-revalidate", "step14", "engine.py",
      "        return self._run([self.add_checked_request(r) for r in requests])\n",
      "        return self._run([self.add_request(p, max_new_tokens, eos_token_id) for p in prompts])\n",
      "generate queues the prompts as given, so a one-shot iterator is read twice"),
    M("s14-eng-first-logits", "step14", "engine.py",
      "self._sample(logits[-1:], [seq])", "self._sample(logits[:1], [seq])",
      "first token from the chunk's first position"),
    # ---- step14: memory on demand (admission, preemption, resume) -------------------------------
    M("s14-sched-preempt-oldest", "step14", "scheduler.py",
      "seq = self.running.pop()", "seq = self.running.pop(0)",
      "the oldest running sequence is preempted instead of the youngest"),
    M("s14-sched-preempt-to-back", "step14", "scheduler.py",
      "self.waiting.appendleft(seq)", "self.waiting.append(seq)",
      "a preempted sequence goes to the back of the queue"),
    M("s14-seq-preempt-offset", "step14", "sequence.py",
      "        self.prefill_offset = 0\n", "",
      "prefill_offset not reset on preemption"),
    M("s14-sched-admit-after-preempt", "step14", "scheduler.py",
      "        self.admission_open = False\n", "",
      "a round that preempted still admits waiting requests"),
    M("s14-eng-admission-stays-closed", "step14", "engine.py",
      "        self.scheduler.begin_round()\n", "",
      "after a first preemption nobody is ever admitted again"),
    M("s14-eng-admission-preempts", "step14", "engine.py",
      "work = self._schedule_prefill_chunk(seq, may_preempt=False)",
      "work = self._schedule_prefill_chunk(seq)",
      "a waiting request preempts running ones to get in"),
    M("s14-eng-preempted-not-skipped", "step14", "engine.py",
      "            if seq.status is SequenceStatus.PREEMPTED:  # an older one needed its blocks\n"
      "                continue\n", "",
      "a sequence preempted earlier in the round is still scheduled in it"),
    M("s14-eng-self-preempt-goes-on", "step14", "engine.py",
      "            if victim is seq:\n                return False\n", "",
      "a sequence that preempted itself goes on allocating"),
    M("s14-eng-preemptions-uncounted", "step14", "engine.py",
      "            self._counters.preemptions += 1\n", "",
      "preemptions not counted"),
    M("s14-eng-resume-prompt-only", "step14", "engine.py",
      "chunk = seq.token_ids[start : start + self.block_size]",
      "chunk = seq.prompt_ids[start : start + self.block_size]",
      "a resumed sequence's chunks are taken from its prompt only"),
    M("s14-seq-resume-prompt-only", "step14", "sequence.py",
      "return self.prefill_offset >= self.num_tokens", "return self.prefill_offset >= self.prompt_len",
      "a resumed sequence's prefill ends with its prompt (its output's KV is never recomputed)"),
    M("c-stats-resumed-as-cached", "step14", "common/stats.py",
      "self.resumed_cached_tokens += adopted", "self.cached_tokens += adopted",
      "a resumed sequence's adoption counted as cached prompt tokens"),
    M("c-stats-resumed-counted-again", "step14", "common/stats.py",
      "            self.resumed_cached_tokens += adopted\n            return\n",
      "            self.resumed_cached_tokens += adopted\n",
      "a resumed sequence counted again as a request (and its adoption as cached)"),
    M("s14-eng-rounds-idle", "step14", "engine.py",
      "self._counters.rounds += bool(scheduled)", "self._counters.rounds += 1",
      "a round that ran nothing is counted"),
    M("s14-kvm-not-atomic", "step14", "kv_cache_manager.py",
      "        computed_blocks = computed_blocks or []\n",
      "        computed_blocks = computed_blocks or []\n"
      "        for block_id in computed_blocks:\n            self.block_manager.retain(block_id)\n",
      "allocate_slots retains the adopted blocks before it checks for room (not all or nothing)",
      more=(("        for block_id in computed_blocks:\n            self.block_manager.retain(block_id)\n"
             "        if computed_blocks:",
             "        if computed_blocks:"),)),
    M("s14-kvm-free-hits-stay", "step14", "kv_cache_manager.py",
      "        seq.block_table, seq.hit_block_ids = [], []\n", "        seq.block_table = []\n",
      "free leaves hit_block_ids behind (a resumed sequence releases them again)"),
    # ---- step14: abort, reset_prefix_cache, KV cache events -------------------------------------
    M("s14-sched-remove-keeps", "step14", "scheduler.py",
      "                    queue.remove(seq)\n", "                    pass\n",
      "an aborted request stays in its queue"),
    M("s14-eng-abort-no-free", "step14", "engine.py",
      "        self.kv_cache_manager.free(seq)\n        seq.abort()\n",
      "        seq.abort()\n",
      "abort keeps the request's blocks"),
    M("s14-eng-abort-ids", "step14", "engine.py",
      "return list(seq.generated_ids)", "return list(seq.token_ids)",
      "abort returns the prompt with the output"),
    M("s14-eng-reset-while-running", "step14", "engine.py",
      "        if self.scheduler.running:\n            return False\n", "",
      "reset_prefix_cache empties the cache under running requests"),
    M("s14-eng-reset-while-queued", "step14", "engine.py",
      "        if self.scheduler.running:\n            return False\n",
      "        if self.scheduler.has_work:\n            return False\n",
      "reset_prefix_cache refused while requests only wait"),
    M("s14-pc-clear-no-free", "step14", "prefix_cache.py",
      "        self.block_manager.free(cleared)\n", "",
      "reset_prefix_cache forgets the cached blocks without freeing them"),
    M("c-kv-events-clear-no-event", "step14", "common/kv_events.py",
      "        self.events.append(AllBlocksCleared())\n", "        pass\n",
      "a reset emits no AllBlocksCleared"),
    M("s14-pc-evict-no-event", "step14", "prefix_cache.py",
      "        self.observer.block_removed(entry.block_hash)\n", "",
      "an eviction is not told to the observer: no BlockRemoved"),
    M("s14-pc-stored-parent-id", "step14", "prefix_cache.py",
      "parent_hash = self._by_block[parent_id].block_hash if parent_id is not None else None",
      "parent_hash = parent_id",
      "BlockStored names the parent's block id, not its hash"),
    M("c-kv-events-take-no-drain", "step14", "common/kv_events.py",
      "        taken, self.events = self.events, []\n", "        taken = list(self.events)\n",
      "take_events hands the same events out again"),
    M("c-kv-events-take-clears-taken", "step14", "common/kv_events.py",
      "        taken, self.events = self.events, []\n",
      "        taken = self.events\n        self.events.clear()\n",
      "take_events empties in place the very list it hands out: always empty"),
    M("s14-seq-eos-min", "step14", "sequence.py",
      "token_id in self.eos_token_ids", "token_id == min(self.eos_token_ids, default=None)",
      "only the smallest of several eos ids stops a request"),
    # ---- step14/model.py ------------------------------------------------------------------------
    M("s14-model-mask", "step14", "model.py",
      "mask[i, : start_pos + i + 1] = 0.0", "mask[i, : start_pos + i] = 0.0",
      "a query cannot see itself"),
    M("s14-model-gather-partial", "step14", "model.py",
      "used = min(block_size, context_len - j * block_size)", "used = block_size",
      "the last block's unused slots are attended"),
    M("s14-model-write-pos", "step14", "model.py",
      "pos = start_pos + i\n", "pos = i\n", "K/V written at chunk-relative positions"),
    M("s14-model-rope-pos", "step14", "model.py",
      "positions = torch.arange(start_pos, context_len, device=ids.device)",
      "positions = torch.arange(0, ids.shape[0], device=ids.device)",
      "rotary positions restart at every chunk"),
    M("s14-model-table-check", "step14", "model.py",
      "if len(block_table) * self.cfg.block_size < context_len:",
      "if len(block_table) * self.cfg.block_size <= context_len:",
      "a block table that exactly fits is refused"),
    # ---- step14_1 .. step14_4: the model's fixes ------------------------------------------------
    M("s14_1-slot-offset", "step14_1", "model.py",
      "return table[positions // block_size] * block_size + positions % block_size",
      "return table[positions // block_size] * block_size + positions // block_size",
      "slot offset from the block index"),
    M("s14_2-context-slots", "step14_2", "model.py",
      "context_slots = self._slot_mapping(block_table, 0, context_len)",
      "context_slots = self._slot_mapping(block_table, start_pos, context_len - start_pos)",
      "the gather reads only the chunk's own slots"),
    M("s14_3-gqa-group", "step14_3", "model.py",
      "q_h = q.transpose(0, 1).unflatten(0, (-1, group))",
      "q_h = q.transpose(0, 1).unflatten(0, (group, -1)).transpose(0, 1)",
      "query heads grouped round-robin instead of consecutively"),
    M("s14_4-mask-diagonal", "step14_4", "model.py",
      "key_pos > query_pos", "key_pos >= query_pos", "the mask hides the diagonal"),
    M("s14_4-no-mask-for-two", "step14_4", "model.py",
      "if num_queries == 1:", "if num_queries <= 2:", "no mask for a two-token chunk"),
    # ---- step14_5: the hash chain on Sequence ---------------------------------------------------
    M("s14_5-unchained", "step14_5", "sequence.py",
      "parent = self.block_hashes[-1] if self.block_hashes else hashing.ROOT_HASH",
      "parent = hashing.ROOT_HASH", "block hashes not chained"),
    M("s14_5-prompt-only", "step14_5", "sequence.py",
      "        token_ids = self.token_ids\n", "        token_ids = self.prompt_ids\n",
      "output blocks hashed from the prompt alone"),
    M("s14_5-lookup-short", "step14_5", "kv_cache_manager.py",
      "seq.extend_block_hashes(last, self.block_size)",
      "seq.extend_block_hashes(last - 1, self.block_size)",
      "lookup hashes one block too few"),
    M("s14_5-cache-last-hash", "step14_5", "kv_cache_manager.py",
      "block_hash = seq.block_hashes[block_idx]", "block_hash = seq.block_hashes[-1]",
      "a block cached under the newest hash computed"),
    M("s14_5-rehash", "step14_5", "sequence.py",
      "        while len(self.block_hashes) < num_blocks:\n",
      "        self.block_hashes.clear()\n        while len(self.block_hashes) < num_blocks:\n",
      "the chain is hashed again from its first block at every use"),
    M("s14_5-preempt-rehash", "step14_5", "sequence.py",
      "        self.prefill_offset = 0\n", "        self.prefill_offset = 0\n        self.block_hashes.clear()\n",
      "a preempted sequence forgets its hash chain and hashes every block again"),
    # ---- step14_6: BlockManager.release ---------------------------------------------------------
    M("s14_6-release-free", "step14_6", "block_manager.py",
      "            raise ValueError(f\"cannot release block {block_id}: it is already free\")\n",
      "            return\n", "releasing a free block is silently ignored"),
    M("s14_6-release-no-pool", "step14_6", "block_manager.py",
      "        block.ref_count -= 1\n        if block.ref_count == 0:\n            self._free_ids.append(block_id)\n\n    def _block",
      "        block.ref_count -= 1\n\n    def _block",
      "a released block never returns to the pool"),
    M("s14_6-free-no-precheck", "step14_6", "block_manager.py",
      "if self._block(block_id).ref_count < n:", "if self._block(block_id).ref_count < 0:",
      "free() half-applies a bad call"),
    M("s14_6-double-release", "step14_6", "kv_cache_manager.py",
      "        for block_id in seq.block_table:\n            self.block_manager.release(block_id)\n",
      "        for block_id in seq.block_table + seq.hit_block_ids:\n            self.block_manager.release(block_id)\n",
      "adopted blocks released twice"),
    M("s14_6-poke-internals", "step14_6", "kv_cache_manager.py",
      "            self.block_manager.release(block_id)\n",
      "            self.block_manager._blocks[block_id].ref_count -= 1\n"
      "            if self.block_manager._blocks[block_id].ref_count == 0:\n"
      "                self.block_manager._free_ids.append(block_id)\n",
      "the engine goes back to poking BlockManager's internals (same effect, no release())"),
    M("s14_6-free-skips-hits", "step14_6", "kv_cache_manager.py",
      "        for block_id in seq.block_table:\n            self.block_manager.release(block_id)\n",
      "        for block_id in [b for b in seq.block_table if b not in seq.hit_block_ids]:\n"
      "            self.block_manager.release(block_id)\n",
      "free releases only the blocks the sequence allocated: adopted ones keep its reference"),
    M("s14_6-free-keeps-table", "step14_6", "kv_cache_manager.py",
      "        seq.block_table, seq.hit_block_ids = [], []\n", "        seq.hit_block_ids = []\n",
      "free leaves the block table behind (a resumed sequence releases it again)"),
    # ---- step14_7: forward_batched and scheduling-time registration -----------------------------
    M("s14_7-last-rows", "step14_7", "model.py",
      "last_rows=tensor(list(itertools.accumulate(lengths))) - 1,",
      "last_rows=tensor([0, *itertools.accumulate(lengths)][:-1]),",
      "each chunk's first row sampled"),
    M("s14_7-attend-before-write", "step14_7", "model.py",
      "            self._write_kv(layer_idx, k, v, batch.slot_mapping)  # one scatter for the whole batch\n"
      "            attn = self._padded_attention(layer_idx, q, batch)\n",
      "            attn = self._padded_attention(layer_idx, q, batch)\n"
      "            self._write_kv(layer_idx, k, v, batch.slot_mapping)  # one scatter for the whole batch\n",
      "attention reads the pool before this layer's K/V is written"),
    M("s14_7-rope-positions", "step14_7", "model.py",
      "positions=tensor([pos for span in spans for pos in span]),",
      "positions=tensor([pos - span.start for span in spans for pos in span]),",
      "batched rotary positions restart per chunk"),
    M("s14_7-pad-mask", "step14_7", "model.py",
      "mask = key_pos <= query_pos[:, :, None]", "mask = key_pos <= query_pos[:, :, None] + 1",
      "each query attends one key past its own position"),
    M("s14_7-no-padding-rows", "step14_7", "model.py",
      "ragged = min(lengths) < num_queries", "ragged = max(lengths) < num_queries",
      "a round with chunks shorter than the longest is taken as unpadded"),
    M("s14_7-decode-gqa", "step14_7", "model.py",
      "q = q.view(g, t, kv_heads, per_kv, d_head).permute(0, 2, 3, 1, 4).flatten(2, 3)",
      "q = q.view(g, t, per_kv, kv_heads, d_head).permute(0, 3, 2, 1, 4).flatten(2, 3)",
      "query heads grouped round-robin over the KV heads"),
    M("s14_7-register-late", "step14_7", "engine.py",
      "        self.kv_cache_manager.cache_blocks(seq, start + len(chunk))\n"
      "        return ScheduledChunk(seq, chunk, start)\n",
      "        return ScheduledChunk(seq, chunk, start)\n",
      "prompt blocks never registered"),
    M("s14_7-decode-register", "step14_7", "engine.py",
      "self.kv_cache_manager.cache_blocks(seq, position + 1)  # registered before it is written",
      "self.kv_cache_manager.cache_blocks(seq, position)  # registered before it is written",
      "an output block registered one token late"),
    M("s14_7-empty-round", "step14_7", "engine.py",
      "        if work:\n            last_logits", "        if True:\n            last_logits",
      "a round with nothing to run crashes"),
    M("s14_7-decode-first", "step14_7", "engine.py",
      "        for seq in list(self.scheduler.running):\n",
      "        for seq in sorted(self.scheduler.running, key=lambda s: s.status is SequenceStatus.PREFILLING):\n",
      "decode tokens scheduled (and their blocks registered) before prefill chunks"),
    M("s14_7-prefill-done-always", "step14_7", "sequence.py",
      "        return self.is_prefill_done\n", "        return True\n",
      "a chunk in the middle of a prompt samples a token"),
    M("s14_7-touch-head-first", "step14_7", "kv_cache_manager.py",
      "self.prefix_cache.update_eviction_queue(seq.block_table[::-1])",
      "self.prefix_cache.update_eviction_queue(seq.block_table)",
      "a finished request's blocks touched head first"),
    M("s14_7-preempt-oldest", "step14_7", "scheduler.py",
      "seq = self.running.pop()", "seq = self.running.pop(0)",
      "the oldest is preempted: a victim already scheduled leaves registered blocks unwritten"),
    M("s14_7-no-output-blocks", "step14_7", "engine.py",
      "        self.kv_cache_manager.cache_blocks(seq, position + 1)  # registered before it is written\n", "",
      "output blocks never registered"),
    M("s14_7-admit-after-preempt", "step14_7", "scheduler.py",
      "        self.admission_open = False\n", "",
      "a round that preempted still admits waiting requests"),
    # ---- step14_8, beyond the chapter: cascade attention ------------------------------------------
    M("s14_8-kvm-cache-owner", "step14_8", "kv_cache_manager.py",
      "if self.block_manager.ref_count(block_id) - cached != num_running:",
      "if self.block_manager.ref_count(block_id) != num_running:",
      "the cache's reference taken for a running sequence's: cached shared blocks never count"),
    M("s14_8-eng-past-chunk", "step14_8", "engine.py",
      "return min(common, min(w.start for w in work) // self.block_size)", "return common",
      "shared blocks counted past the earliest chunk's first token"),
    M("s14_8-eng-alone", "step14_8", "engine.py",
      "        if len(work) < 2:\n            return 0\n", "",
      "a lone sequence shares all of its blocks with itself"),
    M("s14_8-merge-swapped", "step14_8", "model.py",
      "torch.sigmoid(lse_a - lse_b)", "torch.sigmoid(lse_b - lse_a)",
      "the merge weighs each part by the other's log-sum-exp"),
    M("s14_8-lse-no-max", "step14_8", "model.py",
      "return out, top + total.log()", "return out, total.log()",
      "a part's log-sum-exp forgets the max it subtracted"),
    M("s14_8-own-no-mask", "step14_8", "model.py",
      "    if mask is not None:\n        scores.masked_fill_(~mask, float(\"-inf\"))\n", "",
      "the own blocks' padding and causal mask ignored"),
    M("s14_8-grid-positions", "step14_8", "model.py",
      "starts = tensor(start_positions) - shared_len", "starts = tensor(start_positions)",
      "the own part's mask compares absolute positions with positions after the prefix"),
    M("s14_8-shared-heads", "step14_8", "model.py",
      "partial_attention(q.transpose(0, 1).reshape(kv_heads, -1, d_head), keys, values)",
      "partial_attention(q.reshape(kv_heads, -1, d_head), keys, values)",
      "the prefix's K/V heads read by the wrong query rows"),
    M("s14_8-own-tables", "step14_8", "model.py",
      "own_tables = [table[num_shared_blocks:] for table in block_tables]",
      "own_tables = block_tables",
      "each sequence's own part read from the start of its table, the prefix again"),
    M("s14_8-rule-rows", "step14_8", "model.py",
      "num_seqs >= 4 and", "num_seqs > 4 and",
      "four sequences behind a long prefix not cascaded"),
    M("s14_8-rule-length", "step14_8", "model.py",
      "shared_len >= own_len", "shared_len > own_len",
      "a prefix as long as the longest own part not cascaded"),
    M("s14_8-unchecked-tables", "step14_8", "model.py",
      "        if any(table[:n] != tables[0][:n] for table in tables):\n",
      "        if False:\n",
      "blocks called shared are not checked to be the same in every table"),
    # ---- step14_9, beyond the chapter: chunks of many blocks under a token budget -----------------
    M("s14_9-decode-not-first", "step14_9", "engine.py",
      "budget = self.max_num_batched_tokens - sum(", "budget = self.max_num_batched_tokens + 0 * sum(",
      "decode tokens not counted against the budget: a round computes more than it"),
    M("s14_9-running-chunk-free", "step14_9", "engine.py",
      "                budget -= len(work.token_ids) if work else 0\n", "",
      "a running sequence's chunk spends nothing of the budget"),
    M("s14_9-admitted-chunk-free", "step14_9", "engine.py",
      "            budget -= len(work.token_ids)\n            self.scheduler.admit(seq)",
      "            self.scheduler.admit(seq)",
      "a newly admitted sequence's chunk spends nothing of the budget"),
    M("s14_9-chunk-mid-block", "step14_9", "engine.py",
      "return max(budget, 0) // self.block_size * self.block_size", "return max(budget, 0)",
      "a chunk cut by the budget ends inside a block"),
    M("s14_9-last-chunk-cut", "step14_9", "engine.py",
      "if num_left <= budget:", "if num_left < budget:",
      "a prompt's rest that exactly fills the budget is cut to whole blocks"),
    M("s14_9-one-block-cached", "step14_9", "engine.py",
      "        for end in range(start + self.block_size, start + len(chunk) + 1, self.block_size):\n"
      "            self.kv_cache_manager.cache_blocks(seq, end)\n",
      "        self.kv_cache_manager.cache_blocks(seq, start + len(chunk))\n",
      "only a chunk's last block is registered in the cache (step14_8's one line)"),
    M("s14_9-last-block-not-cached", "step14_9", "engine.py",
      "range(start + self.block_size, start + len(chunk) + 1, self.block_size)",
      "range(start + self.block_size, start + len(chunk), self.block_size)",
      "a chunk's last full block is never registered"),
    M("s14_9-empty-chunk", "step14_9", "engine.py",
      "        if not chunk:\n            return None\n", "",
      "a sequence the budget has no room for is scheduled with an empty chunk"),
    M("s14_9-default-too-small", "step14_9", "engine.py",
      "max(MAX_NUM_BATCHED_TOKENS, self.block_size + max_running - 1)", "MAX_NUM_BATCHED_TOKENS",
      "the default budget refuses a large max_running"),
    M("s14_9-one-grid", "step14_9", "model.py",
      "return 0 if n <= block_size else (cdiv(n, block_size) - 1).bit_length()", "return 0",
      "a long chunk pads every row of the round to its length again (one grid)"),
    M("s14_9-order-lost", "step14_9", "model.py",
      "return torch.empty_like(logits).index_copy_(0, order, logits)", "return logits",
      "the logits come back in the groups' order, not the round's"),
    M("s14_9-last-rows-unshifted", "step14_9", "model.py",
      "last_rows = joined(b.last_rows + lo for", "last_rows = joined(b.last_rows + 0 * lo for",
      "each grid's last rows read as if it started the flat batch"),
    M("c-scoring-blocks-unshifted", "step14", "common/scoring.py",
      "targets = prompt_ids[a + 1 : a + 1 + logits.shape[0]]",
      "targets = prompt_ids[1 : 1 + logits.shape[0]]",
      "every block of logits rows scored against the first block's tokens", tests=("tests/core/test_sampling.py",)),
    M("s14_9-budget-least", "step14_9", "common/inputs.py",
      "least = block_size + max_running - 1", "least = block_size",
      "a budget with no room for a block beside the decode tokens is taken"),
    # ---- step14_10, beyond the chapter: a second tier behind the prefix cache ----------------------
    M("s14_10-loads-elsewhere", "step14_10", "kv_cache_manager.py",
      "self.offload.load(entries, block_ids)", "self.offload.load(entries, block_ids[::-1])",
      "the tier's blocks are copied into each other's pool blocks", tests=(T10,)),
    M("s14_10-hits-evicted", "step14_10", "kv_cache_manager.py",
      "        self.prefix_cache.update_eviction_queue(pool_hits[::-1])  # not evicted for the loads\n", "",
      "the pool hits a load continues may be evicted to make room for it", tests=(T10,)),
    M("s14_10-room-counts-hits", "step14_10", "kv_cache_manager.py",
      "limit=self.num_available_blocks - held,", "limit=self.num_available_blocks,",
      "the loads take the room of the pool hits they continue (and evict them)", tests=(T10,)),
    M("s14_10-no-write-through", "step14_10", "engine.py",
      "            self.kv_cache_manager.write_through()  # the blocks cached this round, to the tier\n", "",
      "nothing reaches the tier", tests=(T10,)),
    M("s14_10-written-before-forward", "step14_10", "engine.py",
      "            last_logits = self._forward(work)\n            self.kv_cache_manager.write_through()",
      "            self.kv_cache_manager.write_through()\n            last_logits = self._forward(work)",
      "blocks written through before the forward fills them (the tier holds zeros)", tests=(T10,)),
    M("s14_10-untaken-stored", "step14_10", "kv_cache_manager.py",
      "if taken and self.offload is not None:", "if self.offload is not None:",
      "blocks the cache refused are written through too (a hash stored twice)", tests=(T10,)),
    M("s14_10-resumed-counted", "step14_10", "kv_cache_manager.py",
      "resumed=seq.num_preemptions > 0,", "resumed=False,",
      "a resumed request's loads counted as its prompt's tier hits (/metrics' pool hits go wrong)",
      tests=("tests/serve/test_metrics_tier.py",)),
    M("c-offload-tokens-unchecked", "step14_10", "common/kv_offload.py",
      "(entry.parent_hash, entry.token_ids) != (parent_hash, tokens)", "entry.parent_hash != parent_hash",
      "a tier entry is trusted without comparing its tokens", tests=(T10,)),
    M("c-offload-no-crc", "step14_10", "common/kv_offload.py",
      "        if zlib.crc32(payload) != header[\"crc32\"]:\n", "        if False:\n",
      "a corrupt entry's bytes are loaded", tests=(T10,)),
    M("c-offload-model-unchecked", "step14_10", "common/kv_offload.py",
      "            \"model\": self.fingerprint,\n            \"block_hash\": block_hash,",
      "            \"block_hash\": block_hash,",
      "another model's entry is loaded", tests=(T10,)),
    M("c-offload-pending-unread", "step14_10", "common/kv_offload.py",
      "            entry = self._pending.get(key)", "            entry = None",
      "a block on its way to the tier cannot be found", tests=(T10,)),
    M("c-offload-stores-uncounted", "step14_10", "common/kv_offload.py",
      "elif self.tier.put(key, self._encode(entry)):",
      "elif self.tier.put(key, self._encode(entry)) or True:",
      "a store the tier refused is counted as stored (and never announced removed)", tests=(T10,)),
    M("c-tier-evictions-unsaid", "step14_10", "common/kv_tiers.py",
      "                self._note_evicted(oldest)\n", "",
      "the host tier's evictions are never announced: a router credits blocks it lost",
      tests=(T10,)),
    M("c-offload-flush-unreported", "step14_10", "common/kv_offload.py",
      "        self._queue.join()\n        self._report_evicted()\n", "        self._queue.join()\n",
      "what the tier evicted after the last round is never announced", tests=(T10,)),
    # ---- sampling: the filters, the draw, the seeds, the outputs of a round --------------------
    M("c-sampling-k-ignored", "step14", "common/sampler.py",
      'f"{seed}:{k}".encode()', 'f"{seed}".encode()',
      "every draw of a request uses the same numbers", tests=("tests/core/test_sampling.py",)),
    M("c-sampling-top-k-drops-ties", "step14", "common/sampler.py",
      "logits.masked_fill(logits < kth, -math.inf)", "logits.masked_fill(logits <= kth, -math.inf)",
      "top-k drops the k-th token and its ties", tests=("tests/core/test_sampling.py",)),
    M("c-sampling-top-p-boundary", "step14", "common/sampler.py",
      "drop = tail <= torch.tensor", "drop = tail < torch.tensor",
      "top-p keeps tokens whose sum is exactly 1 - top_p", tests=("tests/core/test_sampling.py",)),
    M("c-sampling-race-times", "step14", "common/sampler.py",
      "(probs / race).argmax", "(probs * race).argmax",
      "the race multiplies: draws skewed away from the distribution", tests=("tests/core/test_sampling.py",)),
    M("c-sampling-no-temperature", "step14", "common/sampler.py",
      "    logits = logits / temperature[:, None]\n", "",
      "the temperature is ignored", tests=("tests/core/test_sampling.py",)),
    M("c-sampling-one-engine-seed", "step14", "common/sampling_params.py",
      "seed=seeds.randrange(MAX_SEED)", "seed=0",
      "every seedless request gets the same seed", tests=("tests/core/test_sampling.py",)),
    M("c-sampling-draw-index", "step14", "common/sampler.py",
      "        return len(self.output_ids)\n", "        return 0\n",
      "every token of a request is its first draw", tests=("tests/core/test_sampling.py",)),
    M("s14-eng-engine-seed-ignored", "step14", "engine.py",
      "random.Random(seed)", "random.Random(0)",
      "the engine's seed= is ignored", tests=("tests/core/test_sampling.py",)),
    M("c-outputs-abort-unreported", "step14", "common/outputs.py",
      "        self.aborted.append(self.output(seq, [], []))\n", "        pass\n",
      "an aborted request's end is never reported", tests=("tests/core/test_sampling.py",)),
    M("s14-seq-length-before-stop", "step14", "sequence.py",
      'if token_id in self.eos_token_ids:\n            self._finish("stop")\n        elif len(self.generated_ids) >= self.max_new_tokens:\n            self._finish("length")',
      'if len(self.generated_ids) >= self.max_new_tokens:\n            self._finish("length")\n        elif token_id in self.eos_token_ids:\n            self._finish("stop")',
      "a stop token at max_tokens is reported as length", tests=("tests/core/test_sampling.py",)),
    M("s14_7-eng-sample-wrong-rows", "step14_7", "engine.py",
      "self._sample(last_logits[rows], [work[i].seq for i in rows])",
      "self._sample(last_logits[: len(rows)], [work[i].seq for i in rows])",
      "the sampled rows are the round's first ones, not the ones that sample", tests=("tests/core/test_sampling.py",)),
    # ---- vLLM's further request fields: penalties, min_p, min_tokens, logprobs ------------------
    M("c-sampling-presence-sign", "step14", "common/sampler.py",
      "row = row - params.presence_penalty *", "row = row + params.presence_penalty *",
      "the presence penalty rewards a repeat", tests=("tests/core/test_sampling.py",)),
    M("c-sampling-frequency-as-presence", "step14", "common/sampler.py",
      "params.frequency_penalty * output_counts.to(row.dtype)",
      "params.frequency_penalty * (output_counts > 0).to(row.dtype)",
      "the frequency penalty counts a token once however often it came", tests=("tests/core/test_sampling.py",)),
    M("c-sampling-repetition-flipped", "step14", "common/sampler.py",
      "torch.where(row > 0, row / penalty, row * penalty)", "torch.where(row > 0, row * penalty, row / penalty)",
      "repetition multiplies positive logits and divides negative ones", tests=("tests/core/test_sampling.py",)),
    M("c-sampling-repetition-output-only", "step14", "common/sampler.py",
      "seen = (token_counts(state.prompt_ids, vocab, row.device) > 0) | (output_counts > 0)",
      "seen = output_counts > 0",
      "the repetition penalty forgets the prompt", tests=("tests/core/test_sampling.py",)),
    M("c-sampling-greedy-unpenalized", "step14", "common/sampler.py",
      "tokens = processed.argmax(dim=-1)", "tokens = logits.argmax(dim=-1)",
      "greedy requests take the argmax before the penalties and min_tokens", tests=("tests/core/test_sampling.py",)),
    M("c-sampling-min-tokens-one-more", "step14", "common/sampler.py",
      "return self.num_drawn < self.params.min_tokens and", "return self.num_drawn <= self.params.min_tokens and",
      "min_tokens holds the stop ids back one token too long", tests=("tests/core/test_sampling.py",)),
    M("c-sampling-min-p-boundary", "step14", "common/sampler.py",
      "logits.masked_fill(probs < threshold, -math.inf)", "logits.masked_fill(probs <= threshold, -math.inf)",
      "min_p drops the token exactly at its threshold", tests=("tests/core/test_sampling.py",)),
    M("c-sampling-min-p-before-temperature", "step14", "common/sampler.py",
      "    logits = logits / temperature[:, None]\n    if any(p.min_p for p in params):\n        logits = apply_min_p(logits, [p.min_p for p in params])\n",
      "    if any(p.min_p for p in params):\n        logits = apply_min_p(logits, [p.min_p for p in params])\n    logits = logits / temperature[:, None]\n",
      "min_p applied before the temperature", tests=("tests/core/test_sampling.py",)),
    M("c-sampling-logprobs-processed", "step14", "common/sampler.py",
      "sampled_logprobs(logits, token_ids, states)", "sampled_logprobs(processed, token_ids, states)",
      "logprobs after the penalties, not the model's raw ones", tests=("tests/core/test_sampling.py",)),
    M("c-sampling-penalties-in-place", "step14", "common/sampler.py",
      "logits = logits.to(wide_dtype(logits.dtype), copy=True)", "logits = logits.to(wide_dtype(logits.dtype))",
      "the penalties write into the model's logits, which the logprobs then read", tests=("tests/core/test_sampling.py",)),
    M("c-sampling-top-one-more", "step14", "common/sampler.py",
      "tuple(zip(top_ids[i][:n], top_values[i][:n]))", "tuple(zip(top_ids[i][: n + 1], top_values[i][: n + 1]))",
      "one alternative more than asked", tests=("tests/core/test_sampling.py",)),
    M("c-scoring-own-token", "step14", "common/scoring.py",
      "targets = prompt_ids[a + 1 : a + 1 + logits.shape[0]]",
      "targets = prompt_ids[a : a + logits.shape[0]]",
      "a prompt position's logits scored against its own token, not the next", tests=("tests/core/test_sampling.py",)),
    M("c-scoring-rows-again", "step14", "common/scoring.py",
      "logits = model.lm_head(model.model.norm(hidden[a : a + rows]))",
      "logits = model.lm_head(model.model.norm(hidden[a:]))",
      "each block of logits rows runs to the prompt's end: the rows after it are scored again", tests=("tests/core/test_sampling.py",)),
    M("c-sampling-min-tokens-unbounded", "step14", "common/sampling_params.py",
      "and 0 <= self.min_tokens <= (self.max_tokens if is_int(self.max_tokens) else 0),",
      "and 0 <= self.min_tokens,",
      "min_tokens past max_tokens accepted", tests=("tests/core/test_sampling.py",)),
    M("c-sampling-penalty-unbounded", "step14", "common/sampling_params.py",
      "return is_number(value) and -2 <= value <= 2", "return is_number(value)",
      "presence and frequency penalties outside [-2, 2] accepted", tests=("tests/core/test_sampling.py",)),
    M("c-sampling-output-add-drops-logprobs", "step14", "common/sampling_params.py",
      "logprobs=None if logprobs is None else (self.logprobs or []) + logprobs,",
      "logprobs=logprobs,",
      "a slow reader loses the logprobs of the outputs merged", tests=("tests/core/test_sampling.py",)),
    M("c-inputs-logprobs-vocab", "step14", "common/inputs.py",
      "if asked is not None and asked > vocab:", "if asked is not None and asked >= vocab:",
      "logprobs of the whole vocabulary refused", tests=("tests/engine/test_request_fields.py",)),
    M("s14-kvm-prompt-logprobs-read-cache", "step14", "kv_cache_manager.py",
      "if self.prefix_cache is None or seq.sampling_params.skip_reading_prefix_cache:",
      "if self.prefix_cache is None:",
      "a request that wants its prompt's logprobs adopts cached blocks (skip_reading_prefix_cache ignored)", tests=("tests/engine/test_request_fields.py",)),
    M("c-sampling-no-stop-ids-held", "step14", "common/sampler.py",
      "return cls(seq.sampling_params, seq.prompt_ids, seq.generated_ids, seq.eos_token_ids)",
      "return cls(seq.sampling_params, seq.prompt_ids, seq.generated_ids)",
      "min_tokens does not know the request's eos and stop ids", tests=("tests/engine/test_request_fields.py",)),
    M("c-outputs-prompt-logprobs-every-output", "step14", "common/outputs.py",
      "bool(new_token_ids) and len(generated) == 1", "bool(new_token_ids)",
      "the prompt's logprobs handed out with every token", tests=("tests/engine/test_request_fields.py",)),
    M("c-scoring-last-block-only", "step14", "common/scoring.py",
      "entries += token_logprobs(logits, targets, [num_top] * len(targets))",
      "entries = [None, *token_logprobs(logits, targets, [num_top] * len(targets))]",
      "only the last block of logits rows gives prompt logprobs", tests=("tests/core/test_sampling.py",)),
    M("c-outputs-logprobs-lost", "step14", "common/outputs.py",
      "self.output(seq, seq.generated_ids[-1:], [lp])", "self.output(seq, seq.generated_ids[-1:], [None])",
      "the round's outputs carry no logprobs", tests=("tests/engine/test_request_fields.py",)),
    M("c-scoring-block-own-keys", "step14", "common/scoring.py",
      "dense_attention(q[a : a + rows], k, v, positions <= positions[a : a + rows, None])",
      "dense_attention(q[a : a + rows], k[a : a + rows], v[a : a + rows], positions[a : a + rows] <= positions[a : a + rows, None])",
      "each block of query rows attends only the keys of its own block", tests=("tests/core/test_sampling.py",)),
    M("c-scoring-no-final-norm", "step14", "common/scoring.py",
      "logits = model.lm_head(model.model.norm(hidden[a : a + rows]))",
      "logits = model.lm_head(hidden[a : a + rows])",
      "the prompt's logits taken before the final norm", tests=("tests/core/test_sampling.py",)),
    M("c-scoring-sees-next-token", "step14", "common/scoring.py",
      "positions <= positions[a : a + rows, None]", "positions <= positions[a : a + rows, None] + 1",
      "each prompt position attends one token past its own: the token it predicts", tests=("tests/core/test_sampling.py",)),
    # ---- the guards before the work: memory, context length, Ctrl-C ---------------------------
    M("s14-model-no-memory-check", "step14", "model.py",
      "        check_memory(cfg)  # the weights and the KV pool, before allocating either\n", "",
      "a model allocates its pool without comparing it with the memory there is"),
    M("c-memory-never-refuses", "step14", "common/memory.py",
      "    if total <= free:\n        return\n", "    if True:\n        return\n",
      "the memory check lets everything through", tests=("tests/core/test_guards.py",)),
    M("c-memory-kv-per-block", "step14", "common/memory.py",
      "    return cfg.total_blocks * kv_bytes_per_block(cfg)",
      "    return cfg.total_blocks * cfg.kv_bytes_per_token()",
      "the KV pool counted by blocks as if by tokens", tests=("tests/core/test_guards.py",)),
    M("c-bench-memory-after-prompts", "step14", "bench/models.py",
      "    check_workload_memory(options, total, sum(workload.prompt_lengths()))\n", "",
      "the bench draws the prompts before it checks the memory", tests=("tests/core/test_guards.py",)),
    M("c-inputs-context-bound", "step14", "common/inputs.py",
      "if limit is None or prompt_len + max_new_tokens <= limit:",
      "if limit is None or prompt_len + max_new_tokens < limit:",
      "a request exactly as long as the context is refused"),
    M("c-errors-no-interrupt", "step14", "front/exits.py",
      "        return 1\n    except KeyboardInterrupt:\n        return interrupted(prog)\n",
      "        return 1\n", "Ctrl-C ends a command with a traceback",
      tests=("tests/core/test_guards.py",)),
    # ---- common/inputs.py: the request checks of every step (step14's tests stand for all) ----
    M("c-inputs-need-plus-one", "step14", "common/inputs.py",
      "cdiv(prompt_len + max_new_tokens - 1, block_size)",
      "cdiv(prompt_len + max_new_tokens, block_size)",
      "the need counts a slot for the last generated token"),
    M("c-inputs-need-minus-two", "step14", "common/inputs.py",
      "cdiv(prompt_len + max_new_tokens - 1, block_size)",
      "cdiv(prompt_len + max_new_tokens - 2, block_size)",
      "the need is one token short"),
    M("c-inputs-cdiv-floor", "step14", "common/numbers.py",
      "return -(-a // b)", "return a // b", "cdiv rounds down"),
    M("c-inputs-pool", "step14", "common/inputs.py",
      "if need <= cfg.total_blocks:", "if need < cfg.total_blocks:",
      "a request that needs the whole pool is refused"),
    M("c-inputs-vocab-edge", "step14", "common/inputs.py",
      "bad = [t for t in prompt if not 0 <= t < vocab]",
      "bad = [t for t in prompt if not 0 <= t <= vocab]",
      "token id vocab_size accepted"),
    M("c-inputs-eos-range", "step14", "common/inputs.py",
      "is_int(t) and 0 <= t < end for t in ids", "is_int(t) and 0 < t < end for t in ids",
      "eos id 0 refused"),
    M("c-inputs-bool", "step14", "common/numbers.py",
      "    if isinstance(x, bool):\n        return False\n", "", "a bool passes for an integer"),
    M("c-inputs-max-new", "step14", "common/inputs.py",
      "if not is_int(max_new_tokens) or max_new_tokens < 1:",
      "if not is_int(max_new_tokens) or max_new_tokens < 0:", "max_new_tokens=0 accepted"),
    M("c-inputs-empty", "step14", "common/inputs.py",
      "    if not prompt:\n        raise RequestError(", "    if prompt is None:\n        raise RequestError(",
      "an empty prompt accepted"),
    M("c-inputs-eos-first-only", "step14", "common/inputs.py",
      "return frozenset(int(t) for t in ids)", "return frozenset(int(t) for t in ids[:1])",
      "only the first of several eos ids is kept"),
    M("c-inputs-prompts-str", "step14", "common/inputs.py",
      "if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Iterable):",
      "if not isinstance(prompts, Iterable):",
      "generate accepts a str for its list of prompts"),
    # ---- common/stats.py: EngineStats' derived figures ------------------------------------------
    M("c-stats-seqs-per-round", "step14", "common/stats.py",
      "return self.seqs_scheduled / self.rounds if self.rounds else 0.0",
      "return self.seqs_scheduled // self.rounds if self.rounds else 0.0",
      "seqs_per_round rounded down"),
    # ---- front/demo.py: the chapter's demo, for every step ------------------------------------
    M("c-demo-pool-bound", "step14", "front/demo.py",
      "return max(len(p) for p in demo_prompts(", "return min(len(p) for p in demo_prompts(",
      "the demo checks its pool against its shortest request, not its longest",
      tests=("tests/front/test_cli.py", "tests/front/test_run_demo.py")),
    M("c-demo-inexact-passes", "step14", "front/demo.py",
      "    if ok or exact:\n", "    if ok:\n",
      "a float32 token mismatch only warns",
      tests=("tests/front/test_cli.py", "tests/front/test_run_demo.py")),
    M("c-demo-decode-note", "step14", "front/demo.py",
      "    if off.computed_decode_tokens:\n", "    if True:\n",
      "the note on decode shows when nothing was decoded",
      tests=("tests/front/test_cli.py", "tests/front/test_run_demo.py")),
    M("c-demo-checks-pass", "step14", "front/demo.py",
      "return 0 if all(ok for ok, _ in checks) else 1", "return 0",
      "the demo exits 0 whatever its checks say",
      tests=("tests/front/test_cli.py", "tests/front/test_run_demo.py")),
    M("c-demo-small-pool-always-ok", "step14", "front/demo.py",
      "f\"Small pool: outputs identical to the reference ({n})\", small.outputs, reference, exact",
      "f\"Small pool: outputs identical to the reference ({n})\", small.outputs, small.outputs, exact",
      "the small-pool check compares the outputs with themselves: always ✅",
      tests=("tests/front/test_cli.py", "tests/front/test_run_demo.py")),
    M("c-demo-small-pool-refcounts", "step14", "front/demo.py",
      "    if small.problems:\n        return False, f\"{line}; ref counts broken",
      "    if False:\n        return False, f\"{line}; ref counts broken",
      "the small-pool check ignores broken ref counts",
      tests=("tests/front/test_cli.py", "tests/front/test_run_demo.py")),
    # ---- front/main.py, text.py, text_cli.py, stream.py: run.py's front ends -----------------
    M("c-exits-ctrl-c-in-imports", "step14", "front/exits.py",
      "    signal.signal(signal.SIGINT, partial(on_ctrl_c, prog))\n", "",
      "Ctrl-C while torch and numpy are imported is raised inside them (swallowed, a traceback)",
      tests=("tests/front/test_ctrl_c.py",)),
    M("c-serve-engine-hears-ctrl-c", "step14", "front/serve/engine_core.py",
      "        start_deaf(self.process)\n", "        self.process.start()\n",
      "the engine process hears Ctrl-C while it starts: a traceback of its own",
      tests=("tests/front/test_ctrl_c.py",)),
    M("c-serve-stop-said-at-its-end", "step14", "front/serve/launch.py",
      "            asyncio.get_running_loop().call_soon_threadsafe(say, line)\n", "",
      "a stop says nothing as it begins: its only line comes at its end",
      tests=("tests/serve/test_serve_cli.py",)),
    M("c-exits-say-to-a-gone-reader", "step14", "front/exits.py",
      "    with contextlib.suppress(OSError):\n        sys.stderr.write(f\"{line}\\n\")\n        sys.stderr.flush()",
      "    sys.stderr.write(f\"{line}\\n\")\n    sys.stderr.flush()",
      "a stop whose reader is gone (| tee, ended by the same Ctrl-C) ends in a BrokenPipeError",
      tests=("tests/serve/test_serve_cli.py",)),
    M("c-text-filter-without-temperature", "step14", "front/text_cli.py",
      "if filters and args.temperature == 0:", "if filters and args.temperature < 0:",
      "--top-k / --top-p without --temperature are silently greedy",
      tests=("tests/front/test_streaming.py",)),
    M("c-text-empty-prompt", "step14", "front/codec.py",
      "        if prompt == \"\":\n", "        if prompt is None:\n",
      "generate_text serves an empty prompt (a BOS alone)",
      tests=("tests/front/test_streaming.py",)),
    M("c-text-cache-note-without-system", "step14", "front/text.py",
      "if not requests.system_tokens or not text or shared >= block_size:",
      "if not text or shared >= block_size:",
      "the note on a short shared prefix comes without a system prompt (the chat markup alone)",
      tests=("tests/front/test_streaming.py",)),
    M("c-inputs-one-item-list", "step14", "common/inputs.py",
      "if not isinstance(sampling_params, (list, tuple)):",
      "if not isinstance(sampling_params, (list, tuple)) or len(sampling_params) == 1:",
      "a one-item sampling_params list is spread over every prompt",
      tests=("tests/front/test_streaming.py",)),
    M("c-stream-hold-at-any-fffd", "step14", "front/stream.py",
      "if not final and text.endswith(REPLACEMENT_CHAR):", "if not final and REPLACEMENT_CHAR in text:",
      "the stream freezes after a byte no token completes, until the answer ends",
      tests=("tests/front/test_streaming.py",)),
    # ---- front/trace.py: the round-by-round trace ----------------------------------------------
    M("c-trace-copy-as-orphan", "step14", "front/trace.py",
      "        elif block_index and seq.block_table[block_index - 1] not in cache:",
      "        elif seq.block_table[block_index - 1] not in cache:",
      "a refused first block is traced as an orphan (its 'parent' read off the table's end)",
      tests=("tests/front/test_trace.py",)),
    M("c-trace-short-of-chunk", "step14", "front/trace.py",
      "        self._next[seq.seq_id] = \"token\" if work.kind == \"decode\" or work.last_chunk else \"chunk\"",
      "        self._next[seq.seq_id] = \"token\" if work.kind == \"decode\" else \"chunk\"",
      "a request whose prefill just ended is traced as short of its next chunk, not token",
      tests=("tests/front/test_trace.py",)),
    M("s14-eng-observer-no-preempted", "step14", "engine.py",
      "            self.observer.preempted(victim, seq)\n", "",
      "the observer is not told of a preemption"),
    M("s14-kvm-observer-no-evicted", "step14", "kv_cache_manager.py",
      "        self.observer.allocated(seq, computed_blocks, new, evicted)\n",
      "        self.observer.allocated(seq, computed_blocks, new, [])\n",
      "the observer is not told which blocks were evicted"),
    M("c-trace-resumed-as-new", "step14", "front/trace.py",
      "work.resumed = seq.num_preemptions > 0", "work.resumed = seq.num_preemptions > 1",
      "a request resumed after its first preemption is traced as new",
      tests=("tests/front/test_trace.py",)),
    M("c-trace-abort-of-preempted", "step14", "front/trace.py",
      "work.ended = ENDINGS[seq.status] if self._in_round else \"aborted\"",
      "work.ended = ENDINGS.get(seq.status, \"aborted\")",
      "an aborted request that was preempted is traced as preempted",
      tests=("tests/front/test_trace.py",)),
    # ---- bench/: what python -m bench promises ---------------------------------------------------
    M("c-bench-scale-growth-inverted", "step14", "bench/workloads/scale.py",
      "return by_size[max(by_size)].best.total_ms / by_size[min(by_size)].best.total_ms",
      "return by_size[min(by_size)].best.total_ms / by_size[max(by_size)].best.total_ms",
      "the scale growth is the smallest size over the largest: a growing cost reads under 1x",
      tests=("tests/bench/test_bench_scale.py",)),
    M("c-bench-scale-flat-bound", "step14", "bench/workloads/scale.py",
      "    if ratio <= FLAT:\n", "    if ratio < FLAT:\n",
      "a growth of exactly FLAT is called growing", tests=("tests/bench/test_bench_scale.py",)),
    M("c-bench-floor-prefix-per-request", "step14", "bench/costs.py",
      "            if token not in node:\n", "            if True:\n",
      "the FLOP floor computes a shared prefix once per request", tests=("tests/bench/test_bench_costs.py",)),
    M("c-bench-fit-check-dropped", "step14", "bench/models.py",
      "    check_fits_pool(max(workload.prompt_lengths()), workload.max_new_tokens, pool)\n", "",
      "a pool too small for the largest request is not refused before the work",
      tests=("tests/bench/test_bench_pressure.py",)),
    M("c-bench-unread-flag-ignored", "step14", "bench/cli.py",
      "    for reason, flags in reasons.items():\n        parser.error(", "    for reason, flags in []:\n        parser.error(",
      "a flag the workload does not read is silently ignored", tests=("tests/bench/test_bench_scale.py",)),
    M("c-bench-tokens-best-run-only", "step14", "bench/rows.py",
      "differ = [r.name for r in rows if any(run.outputs != first for run in r.runs)]",
      "differ = [r.name for r in rows if r.best.outputs != first]",
      "only each row's fastest run is checked against the tokens", tests=("tests/bench/test_bench_cli.py",)),
    M("c-bench-ct2-threads", "step14", "bench/peers/ct2.py",
      "intra_threads=threads,", "intra_threads=0,",
      "CTranslate2 runs on its own default threads, not --threads", tests=("tests/bench/test_bench_peers.py",)),
]
# fmt: on


def selected_tests(root: Path, mutant: Mutant) -> list[str]:
    """Node ids of the tests that must catch ``mutant``: the files it names, whole; otherwise
    the tests that run its step (their ``step`` / ``step_name`` parameter)."""
    if mutant.tests:
        return list(mutant.tests)
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--collect-only"],
        cwd=root,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    mine = re.compile(rf"\[{re.escape(mutant.step)}[-\]]")
    return [
        line
        for line in out.splitlines()
        if "::" in line
        and mine.search(line)
        and not line.startswith("tests/steps/test_structure.py")
    ]


def baseline_failures(root: Path, tests: list[str], timeout: int) -> list[str]:
    """The tests among ``tests`` that fail with no mutant planted."""
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *tests],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=timeout * 4,
    )
    return re.findall(r"^(?:FAILED|ERROR) (\S+)", proc.stdout, re.MULTILINE)


def plant(root: Path, mutant: Mutant) -> str:
    """Apply ``mutant`` in ``root``; returns the original text of the file."""
    path = root / mutant.path
    original = text = path.read_text()
    for old, new in ((mutant.old, mutant.new), *mutant.more):
        if text.count(old) != 1:
            raise LookupError(f"{mutant.id}: expected text found {text.count(old)} times")
        text = text.replace(old, new)
    path.write_text(text)
    return original


def run_tests(root: Path, tests: list[str], timeout: int) -> tuple[str, float, str]:
    start = time.monotonic()
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *tests],
            cwd=root,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired:
        return "killed (timeout)", time.monotonic() - start, ""
    failed = re.findall(r"^(?:FAILED|ERROR) (\S+)", proc.stdout, re.MULTILINE)
    verdict = "survived" if proc.returncode == 0 else "killed"
    return verdict, time.monotonic() - start, failed[0] if failed else ""


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--only", default="", help="run the mutants whose id starts with this (comma: any of)"
    )
    p.add_argument(
        "--tests-from",
        metavar="REV",
        help="run the tests/ of this git revision (e.g. to measure an older suite)",
    )
    p.add_argument("--timeout", type=int, default=300, help="seconds per mutant")
    p.add_argument("--list", action="store_true", help="list the mutants and check each applies")
    args = p.parse_args(argv)
    mutants = [m for m in MUTANTS if m.id.startswith(tuple(args.only.split(",")))]
    assert len({m.id for m in MUTANTS}) == len(MUTANTS), "mutant ids must be unique"
    with tempfile.TemporaryDirectory(prefix="mutants-") as tmp:
        root = Path(tmp) / "repo"
        shutil.copytree(REPO, root, ignore=IGNORED)
        if args.tests_from:
            shutil.rmtree(root / "tests")
            archive = subprocess.run(
                ["git", "archive", args.tests_from, "tests"], cwd=REPO, capture_output=True
            )
            archive.check_returncode()
            with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
                tar.extractall(root, filter="data")
        if args.list:
            stale = 0
            for m in mutants:
                try:
                    original = plant(root, m)
                except LookupError as error:
                    print(f"{m.id:32} stale: {error}")
                    stale += 1
                    continue
                (root / m.path).write_text(original)
                print(f"{m.id:32} {m.path:30} {m.what}")
            print(f"{len(mutants)} mutants, {stale} stale")
            return 1 if stale else 0
        tests_of: dict[tuple[str, tuple[str, ...]], list[str]] = {}
        killed = stale = 0
        for m in mutants:
            key = (m.step, m.tests)
            if key not in tests_of:
                tests_of[key] = selected_tests(root, m)
                broken = baseline_failures(root, tests_of[key], args.timeout)
                if broken:  # e.g. someone's work in progress: leave those tests out
                    print(f"{m.step}: left out, failing without any mutant: {broken}")
                    tests_of[key] = [t for t in tests_of[key] if t not in broken]
            try:
                original = plant(root, m)
            except LookupError as error:  # the code changed under the mutant: say so, go on
                print(f"{m.id:32} {'stale':17}        {error}", flush=True)
                stale += 1
                continue
            try:
                verdict, secs, first = run_tests(root, tests_of[key], args.timeout)
            finally:
                (root / m.path).write_text(original)
            killed += verdict.startswith("killed")
            print(f"{m.id:32} {verdict:17} {secs:5.0f}s  {first or m.what}", flush=True)
        print(f"killed {killed} of {len(mutants) - stale}" + (f" ({stale} stale)" if stale else ""))
        return 0 if killed + stale == len(mutants) and not stale else 1


if __name__ == "__main__":
    sys.exit(main())
