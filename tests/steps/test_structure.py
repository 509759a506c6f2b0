"""The tutorial's shape: each step is the one before it plus exactly one fix.

A learner runs ``diff -ru step14_3 step14_4`` and must see one idea; these tests fail as soon as
a change lands in a file that the design does not name for that step, or a shared fix reaches
only some of the steps. (That each step's fix is really there, and the inefficiency it removes
really there before it, is checked by the step's own file, ``test_step14_*.py``.)
"""

from __future__ import annotations

import ast
import difflib
from itertools import pairwise
from pathlib import Path

import pytest

from front.steps import FIXES, STEPS
from tests.helpers import ROOT, STEP_NAMES, step_files

PAIRS = [(a, b) for a, b in pairwise(STEPS) if a in STEP_NAMES and b in STEP_NAMES]


@pytest.mark.parametrize(("before", "after"), PAIRS, ids=[b for _, b in PAIRS])
def test_adjacent_steps_differ_only_in_the_named_files(before: str, after: str) -> None:
    old, new = step_files(before), step_files(after)
    assert old.keys() == new.keys(), "every step has the same files"
    changed = {name for name in new if old[name] != new[name]} - {"README.md"}
    assert changed == set(FIXES[after][0])


# A step's entry points: front ends of a few lines each, the same in every step.
ENTRY_POINTS = ("run.py", "serve.py")


@pytest.mark.parametrize("step_name", STEP_NAMES)
def test_step_has_its_own_readme_and_the_shared_entry_points(step_name: str) -> None:
    files = step_files(step_name)
    assert b"diff -ru" in files["README.md"] or step_name == "step14"
    for name in ENTRY_POINTS:
        assert files[name] == step_files("step14")[name], name


@pytest.mark.parametrize("step_name", STEP_NAMES)
def test_no_step_names_itself_in_code(step_name: str) -> None:
    """Relative imports only, so that copying a step changes nothing but the fix."""
    for name, content in step_files(step_name).items():
        if name.endswith(".py"):
            assert step_name.encode() not in content, name


def imported_modules(path: Path) -> set[str]:
    """The absolute names of the modules a file imports (relative imports resolved)."""
    package = path.relative_to(ROOT).parent.parts
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else ()
            module = ".".join([*base, *(node.module or "").split(".")]).strip(".")
            names |= {module} | {f"{module}.{alias.name}" for alias in node.names}
    return names


# The layout reads core, steps, applications: ``common/`` (the core) is what a step imports;
# the applications (front ends, the server, the bench, the tools) import the steps and the core.
APPLICATIONS = ("front", "bench", "tools", "tests")
# What only an application needs: a command line, a web server.
APPLICATION_PACKAGES = ("argparse", "fastapi", "starlette", "uvicorn", "prometheus_client")


def is_application_or_step(name: str) -> bool:
    return name.split(".")[0] in (*APPLICATIONS, *STEPS)


CORE = sorted((ROOT / "common").rglob("*.py"))


def test_the_core_is_one_flat_package() -> None:
    """``common/`` holds modules only: a front end, a server or a CLI is an application, and
    lives in ``front/`` (a subfolder here was once ``common/front/``, 4.6k lines of them)."""
    folders = [p.name for p in (ROOT / "common").iterdir() if p.is_dir()]
    assert [name for name in folders if name != "__pycache__"] == []


@pytest.mark.parametrize("path", CORE, ids=lambda p: p.name)
def test_the_core_imports_no_application_and_no_step(path: Path) -> None:
    """Imports run one way, applications -> steps -> core: ``common/`` imports neither an
    application nor a step, nor what only an application needs (argparse, a web server)."""
    names = imported_modules(path)
    assert not [name for name in names if is_application_or_step(name)]
    assert not [name for name in names if name.split(".")[0] in APPLICATION_PACKAGES]


@pytest.mark.parametrize("path", CORE, ids=lambda p: p.name)
def test_the_core_prints_nothing_and_never_exits(path: Path) -> None:
    """The core answers with values and exceptions (``UserError`` for what a user gave); what
    a person reads, and a program's exit status, are an application's (``front/exits.py``)."""
    calls = [
        node.func for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.Call)
    ]
    names = {ast.unparse(func) for func in calls}
    assert not names & {"print", "sys.exit", "os.kill", "exit", "os._exit"}


@pytest.mark.parametrize("step_name", STEP_NAMES)
def test_a_steps_engine_imports_only_its_own_files_and_the_core(step_name: str) -> None:
    """Every file of a step but its entry points (``run.py``, ``serve.py``: front ends) imports
    the core of ``common/`` and its own step's files (relatively), never an application or
    another step."""
    for path in sorted((ROOT / step_name).glob("*.py")):
        if path.name in ENTRY_POINTS:
            continue
        outside = {
            name
            for name in imported_modules(path)
            if is_application_or_step(name) and name.split(".")[0] != step_name
        }
        assert not outside, (path.name, outside)


def project_modules() -> dict[str, Path]:
    """Every module of the project's packages (the core, the steps, the applications), by
    its dotted name."""
    modules = {}
    for top in ("common", "front", "bench", *STEP_NAMES):
        for path in (ROOT / top).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            modules[name] = path
    return modules


def test_no_module_imports_itself_in_a_circle() -> None:
    """Imports form no circle (as ``serve/cli.py`` and ``serve/launch.py`` once did): each
    module can be read after the ones it imports. Imports inside functions count too."""
    modules = project_modules()
    graph = {
        name: {
            imported
            for imported in imported_modules(path)
            if imported in modules and not (name + ".").startswith(imported + ".")
        }
        for name, path in modules.items()
    }  # a module's own packages are imported before it by Python itself: no arrow
    done: set[str] = set()

    def visit(name: str, path: tuple[str, ...]) -> None:
        assert name not in path, " -> ".join([*path[path.index(name) :], name])
        if name not in done:
            for imported in sorted(graph[name]):
                visit(imported, (*path, name))
            done.add(name)

    for name in sorted(graph):
        visit(name, ())


# ---- the chapter first: line budgets ----------------------------------------------------------

ENGINE_BUDGET = 330  # step14/engine.py: the chapter's round loop and public API
# (before, after): most lines a step's diff adds and removes, README and bytecode aside (the
# count of ``diff -ru -x README.md -x __pycache__ before after``).
DIFF_BUDGETS = {
    ("step14_6", "step14_7"): 210,
    ("step14_8", "step14_9"): 140,
    ("step14_9", "step14_10"): 120,
}


def changed_lines(before: str, after: str) -> list[str]:
    """The lines ``after`` adds to and removes from ``before``'s files."""
    old, new = step_files(before), step_files(after)
    lines = []
    for name in sorted(set(old) - {"README.md"}):
        diff = difflib.unified_diff(
            old[name].decode().splitlines(), new[name].decode().splitlines(), lineterm="", n=0
        )
        lines += [ln for ln in diff if ln[:1] in "+-" and ln[:3] not in ("+++", "---")]
    return lines


def test_the_chapters_engine_fits_its_budget() -> None:
    """What only serving needs lives in common/: the engine a learner reads stays short."""
    lines = (ROOT / "step14" / "engine.py").read_text().count("\n")
    assert lines <= ENGINE_BUDGET, f"step14/engine.py has {lines} lines, over {ENGINE_BUDGET}"


@pytest.mark.parametrize(("before", "after"), list(DIFF_BUDGETS), ids=[a for _, a in DIFF_BUDGETS])
def test_a_steps_diff_fits_its_budget(before: str, after: str) -> None:
    if after not in STEP_NAMES:
        pytest.skip(f"{after} is not in this checkout")
    lines = changed_lines(before, after)
    assert len(lines) <= DIFF_BUDGETS[before, after], f"{before} -> {after}: {len(lines)} lines"
    assert not [ln for ln in lines if "logprob" in ln.lower()], "the diff says one idea"


@pytest.mark.parametrize("step_name", STEP_NAMES)
def test_no_step_file_mentions_prompt_logprobs(step_name: str) -> None:
    """A request's prompt logprobs are scored beside the steps (``common/scoring.py``)."""
    for name, content in step_files(step_name).items():
        if name.endswith(".py"):
            assert b"prompt_logprobs" not in content and b"prompt logprobs" not in content, name
