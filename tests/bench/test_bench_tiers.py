"""The bench's measurements of step14_10's second tier (``bench/workloads/replicas.py``'s tier
axis, ``bench/workloads/restart.py``, ``bench/fleet.py``'s ``RedisServer``).

- the flags: ``--kv-offloading-backend`` takes, for the replicas workload, a comma-separated
  list of tiers it makes itself (``none``, ``host``, ``disk``, ``redis``), each once; a Redis
  URL or a ``disk:DIR`` is refused (every run must start from an empty tier, and the bench
  empties only what it made); a step before step14_10 is refused; ``--workload restart``
  refuses a backend (it makes its own disk tier) and a step without the tier;
- each replica's flags: its own host tier, its own fresh folder, or the one Redis URL;
- the table: without tiers it is the table it always was; with them, a row per (tier, policy)
  and the tier's share of the prompt tokens; the saved runs print the same table again;
- a small run of the real fleet, round robin over two replicas without and with a Redis tier
  the bench starts: every answer equals one engine's, and with Redis a replica loads blocks
  the other stored (so the fleet computes less);
- a small restart: the prompt after the restart gets its whole prefix from the disk tier.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from bench import cli
from bench.conversations import Turn
from bench.workloads import replicas
from bench.workloads.replicas import NO_TIER, Fleet, PolicyRun, runs_of, table, tiers_of
from tests.helpers import bench_usage_error, run_python

SMALL = ["--tenants", "2", "--turns", "2", "--prefix-len", "32", "--tail-len", "8"]
SMALL += ["--new-tokens", "4", "--repeats", "1", "--steps", "step14_10"]


def needs_router() -> None:
    pytest.importorskip("vllm_router", reason="needs vllm-router: pip install -e '.[cluster]'")
    pytest.importorskip("zmq", reason="the replicas' KV events need pyzmq: '.[cluster]'")


def needs_redis() -> None:
    if shutil.which("redis-server") is None:
        pytest.skip("no redis-server on the PATH: apt-get install redis-server (.ci/run does)")
    pytest.importorskip("redis", reason="the 'redis' package is missing: '.[offload]'")


# ---- the flags ---------------------------------------------------------------------------------


def test_the_replicas_tiers_are_a_list_of_tiers_the_bench_makes() -> None:
    parse = cli.parse
    base = ["--workload", "replicas"]
    assert tiers_of(parse(base)) == (NO_TIER,)
    assert tiers_of(parse([*base, "--kv-offloading-size", "0.5"])) == ("host",)
    options = parse([*base, "--kv-offloading-backend", "none, host,redis ,disk"])
    assert tiers_of(options) == ("none", "host", "redis", "disk")


@pytest.mark.parametrize(
    ("backend", "said"),
    [
        ("redis://127.0.0.1:6379", "say redis, not a URL"),
        ("disk:/tmp/kv", "say disk, not disk:DIR"),
        ("none,swap", "no tier 'swap'"),
        ("host,host", "name each tier once"),
        (",", "name each tier once"),
    ],
)
def test_a_tier_the_bench_cannot_empty_is_refused(
    backend: str, said: str, capsys: pytest.CaptureFixture[str]
) -> None:
    line = bench_usage_error(["--workload", "replicas", "--kv-offloading-backend", backend], capsys)
    assert said in line and "--kv-offloading-backend" in line


def test_the_other_workloads_check_the_tier_as_one_engines(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["--steps", "step14_10", "--kv-offloading-backend", "none,host"]
    assert "unknown KV offloading backend 'none,host'" in bench_usage_error(argv, capsys)


def test_a_tier_needs_step14_10(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--workload", "replicas", "--steps", "step14_8", "--kv-offloading-backend", "host"]
    assert "needs step14_10" in bench_usage_error(argv, capsys)
    argv = ["--workload", "restart", "--steps", "step14_9"]
    assert "needs step14_10" in bench_usage_error(argv, capsys)


def test_the_restart_workload_makes_its_own_disk_tier(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--workload", "restart", "--kv-offloading-backend", "host"]
    assert "a fresh disk tier" in bench_usage_error(argv, capsys)
    assert "only --workload replicas reads it" in bench_usage_error(
        ["--workload", "restart", "--replicas", "2"], capsys
    )
    options = cli.parse(["--workload", "restart", "--kv-offloading-size", "0.25"])
    assert (options.prefix_len, options.kv_offloading_size) == (256, 0.25)


def test_each_replica_gets_its_own_tier_or_the_shared_one(tmp_path: Path) -> None:
    fleet = Fleet("step14_10", tmp_path, [], tmp_path, tmp_path, 0.5)
    assert fleet.tier_flags(NO_TIER, None, 2) == [[], []]
    size = ["--kv-offloading-size", "0.5"]
    assert fleet.tier_flags("host", None, 2) == [["--kv-offloading-backend", "host", *size]] * 2
    disks = [flags[1] for flags in fleet.tier_flags("disk", None, 2)]
    assert len(set(disks)) == 2 and all(d.startswith(f"disk:{tmp_path}") for d in disks)
    assert disks != [flags[1] for flags in fleet.tier_flags("disk", None, 2)]  # fresh each run

    class Redis:
        url = "redis://127.0.0.1:1/0"

    shared = fleet.tier_flags("redis", Redis(), 2)
    assert shared == [["--kv-offloading-backend", Redis.url]] * 2  # no size: the server's own


# ---- the table ---------------------------------------------------------------------------------


def fake_run(policy: str, tier: str, hits: float, tier_hits: float) -> PolicyRun:
    turn = Turn(0, 0, [1] * 10, 0.0, 0.05)
    turn.last_text = 1.0
    return PolicyRun(policy, [turn], [100.0, 100.0], [hits, 0.0], [1.0, 1.0], {}, tier,
                     [0.0, tier_hits], [0.0, 0.0])  # fmt: skip


def test_with_tiers_a_row_per_tier_and_policy_and_the_tiers_share() -> None:
    runs = [fake_run("round_robin", NO_TIER, 50, 0), fake_run("round_robin", "redis", 50, 40)]
    assert runs[1].computed == 200 - 50 - 40 and runs[1].reuse == 0.45
    text = table(runs, ("round_robin",), 100, (NO_TIER, "redis"))
    header, _, *rows = text.splitlines()
    titles = [cell.strip() for cell in header.strip("|").split("|")]
    assert titles[:5] == ["policy", "tier", "requests per replica (busiest first)",
                          "prefix reuse", "from the tier"]  # fmt: skip
    cells = [dict(zip(titles, (c.strip() for c in row.strip("|").split("|")))) for row in rows]
    assert [c["tier"] for c in cells] == ["none", "redis"]
    assert [c["vs ideal"] for c in cells] == ["1.50x", "1.10x"]
    assert [c["from the tier"] for c in cells] == ["0%", "20%"]
    plain = table(runs[:1], ("round_robin",), 100)
    assert "tier" not in plain.splitlines()[0]  # the table without tiers is as it was


# ---- the real fleet ----------------------------------------------------------------------------


def test_round_robin_with_a_shared_redis_tier(tmp_path: Path) -> None:
    """Two replicas, round robin, without and with a Redis tier the bench starts (and stops):
    with it a replica loads what the other computed; every answer is one engine's."""
    needs_router()
    needs_redis()
    argv = ["-m", "bench", "--workload", "replicas", *SMALL, "--policies", "round_robin"]
    done = run_python(*argv, "--kv-offloading-backend", "none,redis", "--out", str(tmp_path))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "every answer equals one step14_10 engine's" in done.stdout
    data = json.loads((tmp_path / "replicas.json").read_text())
    assert data["tiers"] == ["none", "redis"] and data["answers_equal_one_engine"] is True
    without, shared = runs_of(data)
    assert (without.tier, shared.tier) == ("none", "redis")
    assert sum(without.tier_hits) == 0 < sum(shared.tier_hits)
    assert shared.computed < without.computed
    assert sum(shared.prompt_tokens) == sum(without.prompt_tokens) == data["ideal"]["prompt_tokens"]
    assert (tmp_path / "redis.log").is_file() and (
        tmp_path / "router-round_robin-redis.log"
    ).is_file()
    printed = table(runs_of(data), ("round_robin",), data["ideal"]["computed"], ("none", "redis"))
    assert printed in done.stdout


def test_a_restart_on_the_disk_tier(tmp_path: Path) -> None:
    """The prompt after a restart: its whole prefix from the disk tier, the same answer."""
    argv = ["-m", "bench", "--workload", "restart", "--repeats", "1", "--prefix-len", "32"]
    argv += ["--tail-len", "16", "--new-tokens", "4", "--out", str(tmp_path)]
    done = run_python(*argv)
    assert done.returncode == 0, done.stdout + done.stderr
    (run,) = json.loads((tmp_path / "restart.json").read_text())["runs"]
    assert run["prompt_tokens"] == 48 and run["entries"] == 3  # three full blocks stored
    assert run["before"]["cached_tokens"] == 0 and run["before"]["tier_hits"] == 0
    assert run["after"]["tier_hits"] == 32 == run["after"]["cached_tokens"]  # the last block
    assert run["answers_equal"] is True  # is computed again: its logits give the first token
    assert "loaded from the tier after the restart: 100%" in done.stdout


def test_the_workloads_are_listed() -> None:
    assert replicas.NAME in cli.WORKLOADS and "restart" in cli.WORKLOADS


# ---- the pages' tables are the saved runs ------------------------------------------------------

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"


@pytest.mark.parametrize(
    ("saved", "page", "policies", "tiers"),
    [
        (
            "replicas-redis-cpu.json",
            "scale-out.md",
            ("round_robin", "cache_aware"),
            ("none", "redis"),
        ),
        ("replicas-host-cpu.json", "tier-measurements.md", ("round_robin",), ("none", "host")),
        (
            "replicas-host-smollm2-cpu.json",
            "tier-measurements.md",
            ("round_robin",),
            ("none", "host"),
        ),
    ],
)
def test_the_pages_tier_tables_are_the_saved_runs(
    saved: str, page: str, policies: tuple[str, ...], tiers: tuple[str, ...]
) -> None:
    data = json.loads((DOCS / saved).read_text())
    assert data["tiers"] == list(tiers) and data["answers_equal_one_engine"] is True
    assert data["settings"]["repeats"] == 3
    assert len(data["runs"]) == 3 * len(policies) * len(tiers)
    printed = table(runs_of(data), policies, data["ideal"]["computed"], tiers)
    assert printed in (DOCS / page).read_text()


def test_the_restart_table_is_the_saved_run() -> None:
    from bench.workloads import restart

    data = json.loads((DOCS / "restart-cpu.json").read_text())
    runs = restart.runs_of(data)
    assert len(runs) == 3 and all(r.answers_equal for r in runs)
    assert restart.table(runs) in (DOCS / "tier-measurements.md").read_text()


def test_the_real_size_tier_run_is_the_command_the_page_shows() -> None:
    """The host tier at a real size: the saved run is of the command on the page (its model,
    its users' pause), and the TTFT figures the page quotes are the saved turns'."""
    data = json.loads((DOCS / "replicas-host-smollm2-cpu.json").read_text())
    settings, page = data["settings"], (DOCS / "tier-measurements.md").read_text()
    assert settings["model_name"] == "smollm2-135m" and settings["workload"]["turn_delay"] == 30
    assert "--steps step14_10 --model smollm2-135m --turn-delay 30\n" in page
    runs = runs_of(data)
    p50 = {tier: sorted(r.ttft(50) for r in runs if r.tier == tier) for tier in ("none", "host")}
    assert f"{p50['host'][1] * 1000:.0f} ms ({p50['host'][0] * 1000:.0f}-" in page
    assert f"against {p50['none'][1] * 1000:,.0f} ms" in page
    least = min(
        none / host
        for none, host in zip(
            *([r.ttft(50) for r in runs if r.tier == tier] for tier in ("none", "host"))
        )
    )
    assert f"at least {least:.1f} times in every pair of runs" in page
