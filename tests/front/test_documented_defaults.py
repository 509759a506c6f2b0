"""Every command's flag defaults, held to what its docs say: a changed default (``--max-running``
8 -> 16, say) fails here until the page says it. The server's table is held in
``tests/serve/test_serving_page.py``; here ``run.py``'s three commands (docs/real-models.md) and
each workload of the bench (docs/benchmarks.md)."""

from __future__ import annotations

import re

import pytest

from bench.workloads import WORKLOADS
from front.chat_loop import build_parser as chat_parser
from front.demo import build_parser as demo_parser
from front.text_cli import build_parser as text_parser
from tests.helpers import ROOT, assert_documented_defaults, documented_defaults

REAL_MODELS = (ROOT / "docs" / "real-models.md").read_text()
BENCHMARKS = " ".join((ROOT / "docs" / "benchmarks.md").read_text().split())  # one line
RUN_TABLE = REAL_MODELS[REAL_MODELS.index("| flag | demo |") : REAL_MODELS.index("## From Python")]
PARSERS = {"demo": demo_parser, "text": text_parser, "chat": chat_parser}


@pytest.mark.parametrize("command", list(PARSERS))
def test_run_pys_table_gives_every_flag_with_its_real_default(command: str) -> None:
    documented = documented_defaults(RUN_TABLE)[command]
    assert_documented_defaults(PARSERS[command]("run.py"), documented)


def flag_name(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def shown(value: object) -> str:
    """A default as the page writes it: ``toy`` in backquotes, a number as it is."""
    return f"`{value}`" if isinstance(value, str) else str(value)


def said_defaults(workload: str) -> dict[str, str]:
    """The page's "`--a`, `--b` and `--c` ... default to 1, 2 and 3" for ``--workload NAME``."""
    values = r"((?:[^,\s]+, )*[^,\s]+ and [^,.\s]+)"  # 1, 2 and `three`
    sentence = re.search(rf"`--workload {workload}` [^.]*? default to {values}", BENCHMARKS)
    assert sentence, f"docs/benchmarks.md does not say --workload {workload}'s defaults"
    before = sentence.group(0)[: sentence.start(1) - sentence.start(0)]
    values = re.split(r", | and ", sentence.group(1).strip())
    flags = re.findall(r"`(--[a-z-]+)`", before)[-len(values) :]  # the flags the values follow
    return dict(zip(flags, values, strict=True))


@pytest.mark.parametrize("workload", ["pressure", "scale", "serving"])
def test_the_workloads_defaults_are_the_pages(workload: str) -> None:
    said = said_defaults(workload)
    assert len(said) >= 4
    defaults = WORKLOADS[workload].DEFAULTS
    assert said == {flag: shown(defaults[flag[2:].replace("-", "_")]) for flag in said}


def test_the_default_workload_is_the_pages() -> None:
    d = WORKLOADS["shared-prefix"].DEFAULTS
    assert (
        f"{d['requests']} requests, each a {d['prefix_len']}-token shared prefix (a system "
        f"prompt) plus {d['tail_len']} tokens of its own, get {d['new_tokens']} new tokens each, "
        f"on the `{d['model']}` model, all {d['requests']} running at once (`--max-running "
        f"{d['max_running']}`"
    ) in BENCHMARKS
    pressure = WORKLOADS["pressure"].DEFAULTS["total_blocks"]
    assert f"`--total-blocks N` sets the KV pool: by default {pressure} blocks for `pressure`" in (
        BENCHMARKS
    )
