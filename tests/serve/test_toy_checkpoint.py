"""docs/serving.md's first commands, as a newcomer runs them with no download: ``python -m
front.toy_checkpoint DIR`` writes the model, ``python -m <step>.serve --model DIR`` serves it,
and a chat completion comes back, whole or streamed, each piece of the stream whole words
(a word-level tokenizer holds nothing back: what the bench's ``--endpoint`` runs time), and the
other routes take it too."""

from __future__ import annotations

import re
from pathlib import Path

import httpx

from tests.helpers import ROOT, STEP_NAMES, run_python
from tests.serve.server_process import ServerProcess, sse_events

PAGE = (ROOT / "docs" / "serving.md").read_text()
TOP = PAGE[: PAGE.index("## Start it")]
MAX_TOKENS = 8


def test_the_page_names_the_command_before_anything_else() -> None:
    assert "python -m front.toy_checkpoint ~/models/demo\n" in TOP
    assert "serve --model ~/models/demo\n" in TOP
    assert "/v1/chat/completions" in TOP


def test_the_toy_checkpoint_answers_a_chat(tmp_path: Path) -> None:
    folder = tmp_path / "demo"
    written = run_python("-m", "front.toy_checkpoint", str(folder))
    assert written.returncode == 0, written.stderr
    step = STEP_NAMES[-1]
    assert f"python -m {step}.serve --model {folder}" in written.stdout
    server = ServerProcess(step, folder, "--threads", "1")
    try:
        messages = [{"role": "user", "content": "w1 w2 w3"}]
        chat = {"messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0}
        answer = httpx.post(f"{server.url}/v1/chat/completions", json=chat, timeout=60)
        assert answer.status_code == 200, answer.text
        body = answer.json()
        content = body["choices"][0]["message"]["content"]
        # decoded after the prompt, as vLLM's DecodeStream does: a word-level tokenizer with no
        # decoder joins tokens with spaces, so the first word comes after one too
        assert re.fullmatch(r" w\d+( w\d+)*", content) and len(content.split()) == MAX_TOKENS
        # "user: w1 w2 w3\nassistant:": the role names and colons are unknown words (w0)
        assert body["usage"]["prompt_tokens"] == 7
        with httpx.stream(
            "POST", f"{server.url}/v1/chat/completions", json={**chat, "stream": True}, timeout=60
        ) as streamed:
            events = list(sse_events(streamed.iter_lines()))
        pieces = [e["choices"][0]["delta"].get("content") for e in events]
        pieces = [piece for piece in pieces if piece]
        assert "".join(pieces) == content  # greedy: the same answer
        # no piece holds back part of a word (a busy server may send several in one event)
        assert all(re.fullmatch(r" ?w\d+( w\d+)*", piece) for piece in pieces), pieces
        tokens = {"messages": chat["messages"], "return_token_strs": True}
        tokenized = httpx.post(f"{server.url}/tokenize", json=tokens, timeout=60).json()
        assert tokenized["tokens"] == [0, 0, 1, 2, 3, 0, 0], tokenized
        plain = {"prompt": "w5 w6", "max_tokens": 3}
        completion = httpx.post(f"{server.url}/v1/completions", json=plain, timeout=60)
        assert completion.status_code == 200 and completion.json()["usage"]["prompt_tokens"] == 2
    finally:
        server.kill()
