"""The top README: every ```python block runs, and its commands use one form.

A README that a newcomer copies from must not rot: each Python example is executed here (they
use the tiny model, so the whole file takes seconds), and the commands it shows are checked
against the rules it states (the venv activated once, then ``python -m ...`` everywhere).
"""

from __future__ import annotations

import re
from dataclasses import fields
from pathlib import Path

import pytest

from bench import report, showcase
from bench.harness import RunResult
from common.steps import available_steps, load_step

README = Path(__file__).resolve().parent.parent / "README.md"
TEXT = README.read_text()
PYTHON_BLOCKS = re.findall(r"^```python\n(.*?)^```$", TEXT, re.DOTALL | re.MULTILINE)


def test_the_readme_has_python_examples() -> None:
    assert len(PYTHON_BLOCKS) >= 1
    assert all(block.strip() for block in PYTHON_BLOCKS)


@pytest.mark.parametrize("index", range(len(PYTHON_BLOCKS)))
def test_python_block_runs(index: int, capsys: pytest.CaptureFixture) -> None:
    """Each block runs on its own, in a fresh namespace, as a reader would paste it."""
    code = compile(PYTHON_BLOCKS[index], f"README.md python block {index + 1}", "exec")
    exec(code, {"__name__": "__readme__"})


def shown_commands() -> list[str]:
    """The shell commands of indented code lines (four spaces, then a command)."""
    return [
        line.strip().split("  #")[0].strip()
        for line in TEXT.splitlines()
        if re.match(r"^    (python|pip|source|diff|\.venv)\b", line)
    ]


def test_commands_use_one_form() -> None:
    """Activate once, then ``python -m ...``: no ``.venv/bin/...`` prefix and no bare
    ``pytest``, which fail (or pick another Python) outside the venv."""
    commands = shown_commands()
    assert "source .venv/bin/activate" in commands
    for command in commands:
        assert not command.startswith(".venv/"), command
        assert not re.match(r"(pytest|bench)\b", command), command
    assert not re.search(r"`pytest ", TEXT), "inline commands too: python -m pytest"


def test_the_first_diff_shows_only_code() -> None:
    first_diff = next(c for c in shown_commands() if c.startswith("diff "))
    assert "-x README.md" in first_diff and "-x __pycache__" in first_diff


def test_bench_flags_in_the_readme_exist(capsys: pytest.CaptureFixture) -> None:
    """Every ``--flag`` the README gives ``python -m bench`` is one its parser knows."""
    shown = set()
    for match in re.finditer(r"python -m bench((?: --[a-z-]+(?: [\w,.]+)?)+)", TEXT):
        shown.update(re.findall(r"--[a-z-]+", match.group(1)))
    assert "--no-reference" in shown, "the README says how to skip the slow reference check"
    with pytest.raises(SystemExit):
        showcase.parse_args(["--help"])
    known = set(re.findall(r"--[a-z-]+", capsys.readouterr().out))
    assert shown <= known, shown - known


def test_every_engine_stats_field_is_documented() -> None:
    """The README's EngineStats table names every field and property, so a new counter cannot
    land undocumented."""
    stats = load_step(available_steps()[-1]).EngineStats
    names = [f.name for f in fields(stats)]
    names += [name for name, value in vars(stats).items() if isinstance(value, property)]
    assert {"computed_prefill_tokens", "computed_tokens", "hit_rate"} <= set(names)
    for name in names:
        assert f"| `{name}` |" in TEXT, f"EngineStats.{name} is not in the README's table"


def test_every_bench_column_is_explained() -> None:
    """The README's table of ``python -m bench`` columns names every column the showcase
    prints, so a new column cannot land unexplained."""
    row = showcase.Row("step14", "baseline", [1.0], RunResult([[1]], 1.0), new_tokens=1)
    header = report.table([row], []).splitlines()[1]
    titles = [cell.strip() for cell in header.split("|")[3:-1]]  # after step, what it fixed
    assert "peak KV MiB" in titles and "GFLOP/s" in titles
    for title in titles:
        assert f"`{title}`" in TEXT, f"the README does not explain the column {title!r}"
