"""README.md and docs/*.md: every ```python block runs, and what the pages show is checked.

Pages that a newcomer copies from must not rot. Each Python example is executed here (they use
the tiny model, so all of them take seconds). The commands the pages show follow the rules the
README states (the venv activated once, then ``python -m ...`` everywhere) and name modules,
paths, scripts, extras and flags that exist. Every relative link leads to a file, and an anchor to a
heading of that file. The reference tables name every ``EngineStats`` field and every column of
``python -m bench``, and the results tables show the figures of ``docs/results-cpu.json``. The
top README stays short, in the order a newcomer needs.

Examples that load a real checkpoint name ``~/models/SmolLM2-135M``. Here that path is replaced
by a toy Llama checkpoint (random weights, a word-level tokenizer) written with transformers'
``save_pretrained``; without transformers, safetensors or tokenizers those examples skip.
"""

from __future__ import annotations

import importlib.util
import json
import re
import shlex
import subprocess
import sys
from dataclasses import fields
from functools import cache
from pathlib import Path

import pytest

from bench.batch import Row, RunResult
from bench.costs import Floor
from bench.rows import table
from common.sampling_params import RequestOutput, SamplingParams
from front.steps import STEPS, available_steps, load_step

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
PAGES = [README, *sorted(DOCS.glob("*.md"))]
TEXT = {page: page.read_text() for page in PAGES}
STEP_PAGES = sorted(ROOT.glob("step14*/README.md"))  # their commands are checked too
RESULTS = json.loads((DOCS / "results-cpu.json").read_text())

MAX_README_LINES = 250
# The order the top README keeps: what it is, the steps (the syllabus) and how to read a step,
# quickstart, layout, the concept map to vLLM, results, links (words of its ## headings).
README_SECTIONS = ["steps", "How to read", "Quickstart", "Layout", "vLLM", "Results", "reading"]
STEPS_TABLE_BY_LINE = 40  # a newcomer sees what the steps are before anything else
CHECKPOINT_PLACEHOLDER = "~/models/SmolLM2-135M"
OPTIONAL_PACKAGES = {"transformers", "safetensors", "tokenizers"}


def page_name(page: Path) -> str:
    return page.relative_to(ROOT).as_posix()


def python_blocks(text: str) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```$", text, re.DOTALL | re.MULTILINE)


BLOCKS = [(page, i, code) for page in PAGES for i, code in enumerate(python_blocks(TEXT[page]))]


def without_fences(text: str) -> str:
    """The page with its fenced code blocks removed (a ``# comment`` there is no heading)."""
    return re.sub(r"^```.*?^```$", "", text, flags=re.DOTALL | re.MULTILINE)


def headings(text: str, level: str = "#{1,6}") -> list[str]:
    return re.findall(rf"^{level} (.+)$", without_fences(text), re.MULTILINE)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def shown_commands(text: str) -> list[str]:
    """The shell commands of indented code lines (four spaces, then a command), with their
    ``\\`` continuation lines joined and their ``  # comment`` dropped."""
    commands, lines = [], text.splitlines()
    for i, line in enumerate(lines):
        if not re.match(r"^    (python|pip|source|diff|vllm-router|\.venv)\b", line):
            continue
        command = line.strip()
        while command.endswith("\\") and i + 1 < len(lines):
            i += 1
            command = command[:-1] + " " + lines[i].strip()
        commands.append(command.split("  #")[0].strip())
    return commands


def inline_commands(text: str) -> list[str]:
    """``python -m ...`` and ``pip install ...`` written inline, in backticks."""
    return [c for c in re.findall(r"`((?:python -m|pip install) [^`]+)`", text) if "..." not in c]


def all_commands() -> list[tuple[str, str]]:
    """(page, command): every command of every page and step README, one ``&&`` part at a
    time."""
    texts = {**TEXT, **{page: page.read_text() for page in STEP_PAGES}}
    return [
        (page_name(page), part.strip())
        for page, text in texts.items()
        for command in shown_commands(text) + inline_commands(text)
        for part in command.split("&&")
    ]


# ---- the Python examples ------------------------------------------------------------------------


def test_the_pages_have_python_examples() -> None:
    assert python_blocks(TEXT[README]), "the README shows the API in one short example"
    assert python_blocks(TEXT[DOCS / "api.md"])
    assert all(code.strip() for _, _, code in BLOCKS)


def test_every_code_block_is_plain_or_python() -> None:
    """A block fenced as ``py`` or ``Python`` would escape the execution below."""
    for page in PAGES:
        languages = set(re.findall(r"^```(\S+)$", TEXT[page], re.MULTILINE))
        assert languages <= {"python"}, (page_name(page), languages)


@pytest.mark.parametrize(
    ("page", "index", "code"), BLOCKS, ids=[f"{page_name(p)}-{i + 1}" for p, i, _ in BLOCKS]
)
def test_python_block_runs(
    page: Path, index: int, code: str, request: pytest.FixtureRequest
) -> None:
    """Each block runs on its own, in a fresh namespace, as a reader would paste it."""
    if CHECKPOINT_PLACEHOLDER in code:
        folder = request.getfixturevalue("toy_checkpoint")
        code = code.replace(f'"{CHECKPOINT_PLACEHOLDER}"', repr(str(folder)))
    compiled = compile(code, f"{page_name(page)} python block {index + 1}", "exec")
    try:
        exec(compiled, {"__name__": "__readme__"})
    except ModuleNotFoundError as exc:
        if exc.name in OPTIONAL_PACKAGES:
            pytest.skip(f"needs {exc.name} (pip install -e '.[test]')")
        raise


# ---- the commands -------------------------------------------------------------------------------


def test_commands_use_one_form() -> None:
    """Activate once, then ``python -m ...``: no ``.venv/bin/...`` prefix and no bare
    ``pytest``, which fail (or pick another Python) outside the venv."""
    assert "source .venv/bin/activate" in shown_commands(TEXT[README])
    for page in PAGES:
        for command in shown_commands(TEXT[page]):
            assert not command.startswith(".venv/"), (page_name(page), command)
            assert not re.match(r"(pytest|bench)\b", command), (page_name(page), command)
        assert not re.search(r"`pytest ", TEXT[page]), "inline commands too: python -m pytest"


def test_the_first_diff_shows_only_code() -> None:
    first_diff = next(c for c in shown_commands(TEXT[README]) if c.startswith("diff "))
    assert "-x README.md" in first_diff and "-x __pycache__" in first_diff


def test_commands_name_modules_paths_and_extras_that_exist() -> None:
    """What a fresh clone needs for each command: ``python -m`` modules, ``python`` scripts,
    the test paths given to pytest, the directories given to diff, the extras given to pip."""
    pyproject = (ROOT / "pyproject.toml").read_text()
    for page, command in all_commands():
        words = shlex.split(command)
        if words[:2] == ["python", "-m"]:
            assert importlib.util.find_spec(words[2]) is not None, (page, command)
        if words[0] == "python" and words[1].endswith(".py"):
            assert (ROOT / words[1]).is_file(), (page, command)
        if words[:3] == ["python", "-m", "pytest"]:
            args = iter(words[3:])
            for arg in args:
                if arg == "-k":
                    next(args)
                elif not arg.startswith("-"):
                    assert (ROOT / arg.split("::")[0]).exists(), (page, command)
        if words[0] == "diff":
            assert all((ROOT / d).is_dir() for d in words[-2:]), (page, command)
        if words[:2] == ["pip", "install"]:
            for extras in re.findall(r"\.\[([\w,-]+)\]", command):
                for extra in extras.split(","):
                    assert re.search(rf"^{extra} = \[", pyproject, re.M), (page, command)


@cache
def known_flags(program: str) -> set[str]:
    """The flags ``python -m <module> --help`` (or ``python <script.py> --help``) lists; for a
    step's ``run``, those of every front end it routes to (the demo's, and ``--model``'s)."""
    if program.endswith(".run"):
        from front import main

        parsers = [main.load(front_end).build_parser(program) for front_end in main.FRONT_ENDS]
        return set().union(*map(main.flags_of, parsers))
    target = [program] if program.endswith(".py") else ["-m", program]
    out = subprocess.run(
        [sys.executable, *target, "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    ).stdout
    return set(re.findall(r"--[a-z][a-z0-9-]*", out))


def test_flags_in_the_pages_exist() -> None:
    """Every ``--flag`` a page gives ``python -m bench``, a step's ``run`` or
    ``tools/mutants.py`` is one its parser knows."""
    shown: dict[str, set[str]] = {}
    for _, command in all_commands():
        words = shlex.split(command)
        if words[:2] == ["python", "-m"] and words[2] != "pytest":
            flags = {w.split("=")[0] for w in words[3:] if w.startswith("--")}
            shown.setdefault(words[2], set()).update(flags)
        if words[0] == "python" and words[1].endswith(".py"):
            flags = {w.split("=")[0] for w in words[2:] if w.startswith("--")}
            shown.setdefault(words[1], set()).update(flags)
    assert "--no-reference" in shown["bench"], "the pages say how to skip the slow check"
    assert "--model" in shown["step14_7.run"], "docs/real-models.md serves a checkpoint"
    assert "--list" in shown["tools/mutants.py"], "docs/testing.md shows the mutation check"
    for module, flags in shown.items():
        assert flags <= known_flags(module), (module, flags - known_flags(module))


def test_the_router_commands_and_event_configs_exist() -> None:
    """docs/scale-out.md's ``vllm-router`` commands use flags and policies the installed router
    has, and every ``--kv-events-config`` a page gives is one the server takes."""
    from front.serve.kv_events_config import kv_events_config

    commands = [shlex.split(command) for _, command in all_commands()]
    configs = [w[i + 1] for w in commands for i, a in enumerate(w) if a == "--kv-events-config"]
    assert configs and all(kv_events_config(config).publishes for config in configs)
    routers = [words for words in commands if words[0] == "vllm-router"]
    assert {w[w.index("--policy") + 1] for w in routers} == {"cache_aware", "kv_aware"}
    if importlib.util.find_spec("vllm_router") is None:
        pytest.skip("vllm-router is not installed: pip install -e '.[cluster]'")
    from bench.fleet import router_path

    help_text = subprocess.run(
        [router_path(), "--help"], capture_output=True, text=True, check=True, timeout=120
    ).stdout
    for words in routers:
        flags = {w for w in words if w.startswith("--")}
        assert flags <= set(re.findall(r"--[a-z][a-z0-9-]*", help_text)), words


def test_the_profile_a_step_readme_shows_comes_from_its_command() -> None:
    """A page's operator profile (``python -m tools.profile_ops``) is the output of the command
    it shows: the command runs and prints the header and the columns quoted, and a step README
    that shows the command quotes its header."""
    shown = [(page, c) for page, c in all_commands() if c.startswith("python -m tools.profile_ops")]
    assert shown, "step14_8's README profiles step14_7 with tools/profile_ops.py"
    for page, command in shown:
        words = shlex.split(command)
        run = [sys.executable, *words[1:], "--top", "3"]
        out = subprocess.run(run, cwd=ROOT, capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, (page, command, out.stderr[-2000:])
        step = words[words.index("--step") + 1]
        threads = words[words.index("--threads") + 1] if "--threads" in words else "1"
        header = f"{step}, warm prefix, {threads} thread(s):"
        assert header in out.stdout, (page, out.stdout)
        assert "operator" in out.stdout and "self CPU" in out.stdout and "share" in out.stdout
        if page.startswith("step14"):
            assert header in (ROOT / page).read_text(), page


# ---- links and structure ------------------------------------------------------------------------


def links(text: str) -> list[str]:
    return re.findall(r"\]\(([^)\s]+)\)", without_fences(text))


def test_relative_links_lead_to_files_and_headings() -> None:
    """In README.md, docs/ and the steps' READMEs (whose detail moved to docs/)."""
    for page in [*PAGES, *STEP_PAGES]:
        for target in links(page.read_text()):
            if re.match(r"[a-z]+:", target):
                continue  # https:, mailto:
            path, _, anchor = target.partition("#")
            file = (page.parent / path).resolve() if path else page
            assert file.exists(), f"{page_name(page)}: {target} does not exist"
            if anchor:
                anchors = {slug(h) for h in headings(file.read_text())}
                assert anchor in anchors, f"{page_name(page)}: no heading for {target}"


def test_the_readme_is_short_and_in_order() -> None:
    lines = TEXT[README].count("\n")
    assert lines <= MAX_README_LINES, f"README.md has {lines} lines: move detail to docs/"
    sections = headings(TEXT[README], "##")
    positions = [next(i for i, h in enumerate(sections) if word in h) for word in README_SECTIONS]
    assert positions == sorted(positions), sections
    lines = TEXT[README].splitlines()
    last_row = max(i for i, line in enumerate(lines) if line.startswith("| [step14"))
    assert last_row < STEPS_TABLE_BY_LINE, f"the steps table ends at line {last_row + 1}"


def test_the_readme_links_every_guide_and_the_chapter() -> None:
    readme_links = links(TEXT[README])
    for page in PAGES[1:]:
        assert page_name(page) in readme_links, f"README.md does not link {page_name(page)}"
    assert "step14/README.md#the-chapter" in readme_links


def test_the_steps_table_names_every_step_in_order() -> None:
    rows = [line for line in TEXT[README].splitlines() if re.match(r"\| \[step14", line)]
    assert [re.match(r"\| \[(\w+)\]", row).group(1) for row in rows] == STEPS
    assert all(f"({name}/README.md)" in row for name, row in zip(STEPS, rows))


# ---- the reference tables -----------------------------------------------------------------------


def test_every_engine_stats_field_is_documented() -> None:
    """docs/api.md's EngineStats table names every field and property, so a new counter cannot
    land undocumented."""
    stats = load_step(available_steps()[-1]).EngineStats
    names = [f.name for f in fields(stats)]
    names += [name for name, value in vars(stats).items() if isinstance(value, property)]
    assert {"computed_prefill_tokens", "computed_tokens", "hit_rate"} <= set(names)
    for name in names:
        assert f"| `{name}` |" in TEXT[DOCS / "api.md"], f"EngineStats.{name} is not in api.md"


def test_every_sampling_field_and_output_field_is_documented() -> None:
    """docs/api.md's tables name every ``SamplingParams`` and ``RequestOutput`` field, so a
    new request field cannot land undocumented."""
    for cls in (SamplingParams, RequestOutput):
        names = [f.name for f in fields(cls)]
        assert {"min_tokens", "logprobs"} & set(names)
        for name in names:
            assert f"| `{name}` |" in TEXT[DOCS / "api.md"], (
                f"{cls.__name__}.{name} is not in api.md"
            )


def test_every_bench_column_is_explained() -> None:
    """docs/benchmarks.md's table of ``python -m bench`` columns names every column the bench
    prints, so a new column cannot land unexplained."""
    row = Row("step14", "baseline", [RunResult([[1]], 1.0)])
    header = table([row], [], Floor(1, 1.0)).splitlines()[1]
    titles = [cell.strip() for cell in header.split("|")[3:-1]]  # after step, what it fixed
    assert "peak KV MiB" in titles and "GFLOP/s" in titles
    for title in titles:
        assert f"`{title}`" in TEXT[DOCS / "benchmarks.md"], f"column {title!r} is unexplained"


def expected_cells(row: dict, baseline: str = RESULTS["baseline"]) -> dict[str, str]:
    """A results row as ``python -m bench`` prints it, by column title."""
    reuse = f"{row['cached_tokens'] / row['prompt_tokens']:.0%}" if row["prompt_tokens"] else "-"
    return {
        "min s": f"{row['min_s']:.3f}",
        "tokens/s": f"{row['tokens_per_s']:.1f}",
        f"vs {baseline}": f"{row['speedup_vs_baseline']:.2f}x",
        "vs floor": f"{row['floor_multiple']:.1f}x",
        "prefix reuse": reuse,
        "computed tokens": f"{row['computed_prefill_tokens']} + {row['computed_decode_tokens']}",
        "peak KV MiB": f"{row['kv_peak_mib']:.2f}",
        "GFLOP": f"{row['flops'] / 1e9:.2f}",
        "GFLOP/s": f"{row['gflops_per_s']:.1f}",
    }


def results_table(text: str, after: str = "") -> list[dict[str, str]]:
    """The rows of a page's results table (the first with a ``min s`` column after the text
    ``after``), by column title."""
    lines = text[text.index(after) :].splitlines()
    start = next(i for i, line in enumerate(lines) if re.match(r"\| step .*\| +min s +\|", line))
    titles = [cell.strip() for cell in lines[start].strip("|").split("|")]
    rows = []
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        rows.append(dict(zip(titles, (c.strip() for c in line.strip("|").split("|")))))
    return rows


@pytest.mark.parametrize("page", [README, DOCS / "benchmarks.md"], ids=page_name)
def test_results_tables_show_the_saved_run(page: Path) -> None:
    """The figures shown are those of docs/results-cpu.json, on the machine it names: when the
    run is redone, the pages must follow."""
    text, machine = TEXT[page], RESULTS["machine"]
    rows = results_table(text)
    assert [r["step"] for r in rows] == [r["name"] for r in RESULTS["rows"]]
    for shown, saved in zip(rows, RESULTS["rows"]):
        for title, cell in expected_cells(saved).items():
            if title in shown:
                assert shown[title].rstrip("!").strip() == cell, (saved["name"], title)
    assert f"Measured on {RESULTS['date'].split()[0]}" in text
    assert f"Python {machine['python']}, torch {machine['torch']}" in text
    assert machine["threads"] == 1 and "one torch thread" in text


REAL_SIZE = json.loads((DOCS / "results-smollm2-cpu.json").read_text())
REAL_SIZE_COMMAND = (
    "python -m bench --model smollm2-135m --requests 8 --prefix-len 512 "
    "--steps step14_8,step14_9 --no-reference"
)


@pytest.mark.parametrize("page", [DOCS / "benchmarks.md", ROOT / "step14_9" / "README.md"])
def test_the_real_size_table_shows_its_saved_run(page: Path) -> None:
    """The table of the smollm2-135m preset is docs/results-smollm2-cpu.json's run, of the
    command the page shows, at one thread, on the date the page names."""
    text = page.read_text()
    assert REAL_SIZE_COMMAND in " ".join(text.split())
    settings = REAL_SIZE["settings"]
    assert settings["model_name"] == "smollm2-135m" and REAL_SIZE["machine"]["threads"] == 1
    assert (settings["workload"]["num_requests"], settings["workload"]["prefix_len"]) == (8, 512)
    rows = results_table(text, after=REAL_SIZE_COMMAND.split(" --no-reference")[0][-40:])
    assert [r["step"] for r in rows] == [r["name"] for r in REAL_SIZE["rows"]]
    for shown, saved in zip(rows, REAL_SIZE["rows"]):
        for title, cell in expected_cells(saved, REAL_SIZE["baseline"]).items():
            if title in shown:
                assert shown[title].rstrip("!").strip() == cell, (saved["name"], title)
    assert REAL_SIZE["date"].split()[0] in text


SCALE = json.loads((DOCS / "scale-cpu.json").read_text())


def scale_growth(sweep: str) -> dict[str, float]:
    """Each step's fastest time per request at the sweep's largest size over its smallest, in
    docs/scale-cpu.json."""
    growth = {}
    for step in dict.fromkeys(c["step"] for c in SCALE["cells"]):
        mine = sorted(
            (c for c in SCALE["cells"] if c["step"] == step and c["sweep"] == sweep),
            key=lambda c: c["size"],
        )
        growth[step] = min(mine[-1]["total_ms"]) / min(mine[0]["total_ms"])
    return growth


def test_scale_figures_are_those_of_the_saved_run() -> None:
    """docs/benchmarks.md's scale table and the top README's "at most" growths are
    docs/scale-cpu.json's figures, from a one-thread run of every step."""
    text = TEXT[DOCS / "benchmarks.md"]
    assert SCALE["machine"]["threads"] == 1
    assert list(dict.fromkeys(c["step"] for c in SCALE["cells"])) == STEPS
    for sweep in ("requests", "cached"):
        for step, growth in scale_growth(sweep).items():
            row = next(line for line in text.splitlines() if line.startswith(f"| {step} | "))
            assert f" {growth:.2f}x |" in row, (step, sweep, row)
    for cell in SCALE["cells"]:
        best = min(range(len(cell["total_ms"])), key=cell["total_ms"].__getitem__)
        shown = f"{cell['total_ms'][best]:.3f} ({cell['engine_ms'][best]:.3f})"
        row = next(line for line in text.splitlines() if line.startswith(f"| {cell['step']} | "))
        assert shown in row, (cell["step"], cell["sweep"], cell["size"])
    readme = " ".join(TEXT[README].split())
    for sweep in ("requests", "cached"):
        assert f"(at most {max(scale_growth(sweep).values()):.2f}×)" in readme, sweep
    assert f"Measured on {SCALE['date'].split()[0]}" in text
