"""``python -m bench --workload replicas`` (``bench/workloads/replicas.py``, ``bench/fleet.py``,
``bench/conversations.py``): the flags, the conversations, a small run of the real fleet
(replicas of a step's server behind ``vllm-router``), and a replica killed mid-run.

- the flags: only this workload reads ``--replicas``, ``--policies``, ``--tenants``,
  ``--turns``; a policy it does not know and a checkpoint for ``--model`` are one line;
- the conversations: each turn's prompt is its conversation so far, behind its tenant's
  system prompt; the pool holds half of the tenants' prompts beside the running room;
- a small run: every answer equals one engine's; the fleet computes at least the ideal (it
  cannot beat one engine whose pool never evicts) and its /metrics count every request once;
  the prefix-aware policies got the prompts' tokens from the replicas (``/render``: no
  "missing_tokens" decision), and ``kv_aware`` found blocks through the replicas' events;
- a replica killed (SIGKILL) between requests: the router retries a failed request on the
  other replica, opens the dead one's circuit breaker, and every later request is answered.
"""

from __future__ import annotations

import asyncio
import json
import signal
import time
from dataclasses import replace
from itertools import pairwise
from pathlib import Path

import pytest

from bench.conversations import TenantWorkload, drive, ids_of, prompts_of, text
from bench.fleet import POLICIES
from bench.workloads.replicas import pool_blocks, reference, runs_of, table, write_checkpoint
from common.config import preset
from tests.helpers import bench_usage_error, run_python

SMOKE = ["--tenants", "2", "--turns", "2", "--prefix-len", "32", "--tail-len", "8"]
SMOKE += ["--new-tokens", "4", "--repeats", "1", "--steps", "step14_8"]


def needs_router() -> None:
    pytest.importorskip(
        "vllm_router", reason="the replicas need vllm-router: pip install -e '.[cluster]'"
    )
    pytest.importorskip(
        "zmq", reason="the replicas' KV events need pyzmq: pip install -e '.[cluster]'"
    )


# ---- the flags ---------------------------------------------------------------------------------


def test_only_the_replicas_workload_reads_its_flags(capsys: pytest.CaptureFixture[str]) -> None:
    line = bench_usage_error(["--replicas", "3"], capsys)
    assert "--replicas: only --workload replicas reads it" in line
    line = bench_usage_error(["--workload", "replicas", "--policies", "random"], capsys)
    assert "no policy 'random'; measured: round_robin,cache_aware,kv_aware" in line
    line = bench_usage_error(["--workload", "replicas", "--policies", "kv_aware,kv_aware"], capsys)
    assert "name each policy once" in line
    line = bench_usage_error(
        ["--workload", "replicas", "--model", str(Path(__file__).parent)], capsys
    )
    assert "checkpoint directory" in line or "takes a preset" in line
    line = bench_usage_error(["--turn-delay", "1"], capsys)
    assert "--turn-delay: only --workload replicas reads it" in line
    line = bench_usage_error(["--workload", "replicas", "--turn-delay", "-1"], capsys)
    assert "--turn-delay: must be >= 0, got -1" in line


# ---- the conversations -------------------------------------------------------------------------


def test_each_turn_is_its_conversation_so_far_behind_its_tenants_prompt() -> None:
    workload = TenantWorkload(tenants=3, turns=3, prefix_len=20, tail_len=5, new_tokens=4)
    chats = workload.chats(vocab_size=500)
    assert chats == workload.chats(vocab_size=500)  # seeded
    assert len(chats) == workload.conversations == 6 and workload.requests == 18
    assert sorted(c.tenant for c in chats) == [0, 0, 1, 1, 2, 2]  # two users a tenant
    assert [c.start for c in chats] == sorted(c.start for c in chats)
    for chat in chats:
        same = [c for c in chats if c.tenant == chat.tenant]
        assert all(c.system == chat.system for c in same) and len(chat.system) == 20
    answers = [[1, 2, 3, 4], [5, 6, 7, 8]]
    first, second, third = prompts_of(chats[0], answers)
    assert first == chats[0].system + chats[0].messages[0]
    assert second == first + answers[0] + chats[0].messages[1]
    assert third == second + answers[1] + chats[0].messages[2]
    assert len(third) + 4 == workload.longest  # the last turn and its answer
    assert ids_of(text([3, 14, 159])) == [3, 14, 159] and ids_of("w3w14 w1") == [3, 14, 1]


def test_the_pool_holds_half_the_tenants_prompts_beside_the_running_room() -> None:
    workload = TenantWorkload(tenants=8, turns=5, prefix_len=256, tail_len=16, new_tokens=16)
    prefixes, room = pool_blocks(workload, block_size=16, max_running=4)
    assert prefixes == 4 * 16  # four of eight 16-block prompts
    assert room == 4 * (160 // 16 + 1)  # four conversations' own blocks, a partial one each
    assert pool_blocks(TenantWorkload(tenants=3, prefix_len=32), 16, 1)[0] == 2 * 2


def test_a_user_pauses_between_an_answer_and_the_next_turn(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """--turn-delay: each turn after the first is sent ``turn_delay`` seconds after the answer
    before it came back whole; the first, at the chat's start; with no delay, at once."""
    from bench import conversations

    async def answered(client, model, turn, new_tokens, start) -> None:  # an instant server
        turn.first_text = turn.last_text = time.perf_counter() - start
        turn.answer = [1] * new_tokens

    monkeypatch.setattr(conversations, "send", answered)
    pause = 0.3
    for delay in (0.0, pause):
        workload = TenantWorkload(tenants=1, turns=3, prefix_len=4, tail_len=2, turn_delay=delay)
        chat = replace(workload.chats(vocab_size=50)[0], start=0.0)
        assert chat.delay == delay and (f"{delay:g} s between" in workload.describe()) == bool(
            delay
        )
        turns = asyncio.run(conversations.chat_turns(None, "toy", chat, 2, time.perf_counter()))
        gaps = [later.sent - earlier.last_text for earlier, later in pairwise(turns)]
        assert len(gaps) == 2 and turns[0].sent < pause
        waited = [gap >= pause for gap in gaps]  # no delay: the next turn at once
        assert waited == [bool(delay)] * 2, (delay, gaps)


# ---- the real fleet ----------------------------------------------------------------------------


def test_a_small_run_through_the_real_router(tmp_path: Path) -> None:
    needs_router()
    done = run_python("-m", "bench", "--workload", "replicas", *SMOKE, "--out", str(tmp_path))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "every answer equals one step14_8 engine's" in done.stdout
    data = json.loads((tmp_path / "replicas.json").read_text())
    assert data["answers_equal_one_engine"] is True
    ideal = data["ideal"]["computed"]
    by_policy = {run["policy"]: run for run in data["runs"]}
    assert set(by_policy) == {"round_robin", "cache_aware", "kv_aware"}
    for policy, run in by_policy.items():
        replicas = run["per_replica"]
        assert sum(replicas["requests"]) == 8 == len(run["turns"]), policy
        computed = sum(replicas["prompt_tokens"]) - sum(replicas["prefix_cache_hits"])
        assert computed >= ideal, f"{policy} computed less than one engine that never evicts"
        assert sum(replicas["prompt_tokens"]) == data["ideal"]["prompt_tokens"], policy
    for policy in ("cache_aware", "kv_aware"):
        decisions = by_policy[policy]["router_metrics"]
        assert not any("missing_tokens" in series for series in decisions), decisions
        assert any("prefix_routing_decisions" in series for series in decisions), decisions
    lookups = by_policy["kv_aware"]["router_metrics"]
    assert lookups.get('vllm_router_kv_placement_lookups_total{result="hit"}', 0) > 0, lookups
    assert (tmp_path / "router-kv_aware.log").is_file()


def test_a_replica_killed_mid_run(tmp_path: Path) -> None:
    """Requests through round robin, a replica killed, more requests: each answered, with one
    engine's answer; the router's own metrics say it retried and opened the breaker."""
    needs_router()
    from bench.fleet import Router, start_replicas

    checkpoint = write_checkpoint(tmp_path / "demo", "demo")
    flags = ["--served-model-name", "toy", "--max-model-len", "512", "--threads", "1"]
    workload = TenantWorkload(tenants=2, turns=1, prefix_len=32, tail_len=8, new_tokens=4, rate=50)
    before = workload.chats(1024)
    after = [replace(chat, index=chat.index + 10) for chat in replace(workload, seed=1).chats(1024)]
    replicas = start_replicas(2, "step14_8", checkpoint, flags, tmp_path)
    try:
        router = Router("round_robin", replicas, 16, "toy", tmp_path / "router.log").started()
        try:
            first = asyncio.run(drive(router.url, "toy", before, 4))
            replicas[1].stop(signal.SIGKILL)
            second = asyncio.run(drive(router.url, "toy", after, 4))
            own = router.own_metrics()
        finally:
            router.stop()
    finally:
        for replica in replicas:
            replica.stop()
    assert all(turn.error is None for turn in first + second), [t.error for t in first + second]
    expected = reference("step14_8", preset("demo", total_blocks=64), before + after, 4).answers
    assert [t.answer for t in first + second] == [expected[t.chat, t.turn] for t in first + second]
    assert own.get('vllm_router_retries_total{route="/v1/completions"}', 0) >= 1, own


def test_the_pages_table_is_the_saved_runs() -> None:
    """docs/scale-out.md's table is what the bench prints for docs/replicas-cpu.json."""
    root = Path(__file__).resolve().parents[2]
    saved = json.loads((root / "docs" / "replicas-cpu.json").read_text())
    printed = table(runs_of(saved), POLICIES, saved["ideal"]["computed"])
    assert printed in (root / "docs" / "scale-out.md").read_text()
    assert saved["answers_equal_one_engine"] is True
    assert saved["settings"]["repeats"] == 3 and len(saved["runs"]) == 9
