"""docs/serving.md, held to what the server does: its ``openai`` examples run against a real
server and print what the page says they print, and every metric it names is in
``/metrics``."""

from __future__ import annotations

import contextlib
import io
import re

import httpx
import pytest

from tests.helpers import ROOT, STEP_NAMES, assert_documented_defaults, documented_defaults
from tests.serve.server_process import API_KEY, ServerProcess

PAGE = (ROOT / "docs" / "serving.md").read_text()
CLIENT_BLOCKS = [
    block
    for block in re.findall(r"^```\n(.*?)^```$", PAGE, re.DOTALL | re.MULTILINE)
    if block.startswith("from openai import OpenAI")
]
LAST = [STEP_NAMES[-1]]  # the page's examples need one server, not one per step


def run_example(code: str, server: ServerProcess) -> str:
    """The example as a reader pastes it, pointed at ``server``: what it prints."""
    code = code.replace("http://127.0.0.1:8000", server.url)
    code = code.replace('api_key="none"', f'api_key="{API_KEY}"')
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, "docs/serving.md", "exec"), {"__name__": "__page__"})
    return out.getvalue()


@pytest.mark.parametrize("server", LAST, indirect=True)
def test_the_two_turn_example_shows_the_cache_serving_the_second_turn(
    server: ServerProcess,
) -> None:
    two_turns = next(block for block in CLIENT_BLOCKS if "Which is the longest?" in block)
    printed = re.findall(
        r"(\d+) prompt tokens, (\d+) from the prefix cache", run_example(two_turns, server)
    )
    (first_prompt, _), (second_prompt, second_cached) = [tuple(map(int, p)) for p in printed]
    assert second_prompt > first_prompt and second_cached > 0


@pytest.mark.parametrize("server", LAST, indirect=True)
def test_the_streaming_example_streams_and_ends_with_the_usage(server: ServerProcess) -> None:
    streaming = next(block for block in CLIENT_BLOCKS if "stream=True" in block)
    printed = run_example(streaming, server)
    assert "completion_tokens=32" in printed.splitlines()[-1]


@pytest.mark.parametrize("server", LAST, indirect=True)
def test_every_metric_the_page_names_is_served(server: ServerProcess) -> None:
    named = set(re.findall(r"`(vllm:[a-z0-9_]+)", PAGE))
    served = {
        line.split("{")[0].split(" ")[0]
        for line in httpx.get(server.url + "/metrics").text.splitlines()
        if line.startswith("vllm:")
    }
    served |= {re.sub(r"_(bucket|count|sum)$", "", name) for name in served}
    assert len(named) >= 12 and named <= served, named - served


@pytest.mark.parametrize("server", LAST, indirect=True)
def test_the_fields_example_prints_a_choice_per_prompt_and_n(server: ServerProcess) -> None:
    fields = next(block for block in CLIENT_BLOCKS if "extra_body" in block)
    lines = run_example(fields, server).splitlines()
    assert [line.split()[0] for line in lines[:4]] == ["0", "1", "2", "3"]
    assert "prompt_tokens" in lines[4]


FIELDS_TABLE = PAGE[PAGE.index("| field | endpoints | here |") : PAGE.index("`usage` counts each")]


def test_the_fields_table_names_what_the_request_models_declare() -> None:
    """Every field the request models declare is in the table (honoured or refused), and
    every field the table says is honoured or refused is declared; the table's ignored ones
    are not (nobody's field is ignored by being left undeclared but those)."""
    from front.serve.protocol import ChatCompletionRequest, CompletionRequest

    rows = [line.split("|")[1] for line in FIELDS_TABLE.splitlines()[2:] if line.startswith("|")]
    named = {name for row in rows for name in re.findall(r"`([a-z_]+)`", row)}
    ignored_row = next(row for row in rows if "`user`" in row)
    ignored = set(re.findall(r"`([a-z_]+)`", ignored_row)) - {"stream_options", "stream"}
    declared = set(CompletionRequest.model_fields) | set(ChatCompletionRequest.model_fields)
    assert declared - {"include_usage"} <= named, declared - named
    assert (named - ignored) <= declared | {"include_usage"}, (named - ignored) - declared
    assert not ignored & declared


FLAGS_TABLE = PAGE[PAGE.index("| flag | default | what |") : PAGE.index("**How many requests")]


def test_the_flags_table_gives_every_flag_with_its_real_default() -> None:
    """A changed default (``--max-running``, ``--max-request-bytes``...) fails here until the
    page says it; so does a flag the page leaves out."""
    from front.serve.options import build_parser

    assert_documented_defaults(build_parser("serve"), documented_defaults(FLAGS_TABLE)["default"])


def test_the_page_says_the_batch_commands_run_fewer_at_once() -> None:
    """The page compares the server's ``--max-running`` with ``run.py``'s: both pinned."""
    from front.options import EngineOptions

    assert f"`--max-running` is {EngineOptions().max_running})" in PAGE
