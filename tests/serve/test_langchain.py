"""A client nobody here wrote: LangChain's ``OpenAI`` (which always sends ``prompt`` as a list)
and ``ChatOpenAI`` with ``invoke(..., stop=[...])`` (how prompt templates stop an answer), each
answered as the ``openai`` client is. Skipped, with one line, without ``langchain-openai``."""

from __future__ import annotations

import pytest

pytest.importorskip("langchain_openai", reason="langchain-openai is not installed")

from langchain_openai import ChatOpenAI, OpenAI

from tests.helpers import STEP_NAMES
from tests.serve.server_process import API_KEY, SERVED_NAME, ServerProcess
from tests.serve.test_openai_api import client

LAST = [STEP_NAMES[-1]]


@pytest.mark.parametrize("server", LAST, indirect=True)
def test_langchains_openai_sends_a_list_and_gets_the_answer(server: ServerProcess) -> None:
    llm = OpenAI(
        base_url=server.url + "/v1", api_key=API_KEY, model=SERVED_NAME, max_tokens=8,
        temperature=0, max_retries=0,
    )  # fmt: skip
    expected = client(server).completions.create(
        model=SERVED_NAME, prompt="The weather", max_tokens=8, temperature=0
    )
    assert llm.invoke("The weather") == expected.choices[0].text


@pytest.mark.parametrize("server", LAST, indirect=True)
def test_langchains_chat_stops_where_the_openai_client_stops(server: ServerProcess) -> None:
    messages = [{"role": "user", "content": "Is the cat happy?"}]
    free = client(server).chat.completions.create(
        model=SERVED_NAME, messages=messages, max_tokens=16, temperature=0
    )
    text = free.choices[0].message.content
    stop = text[len(text) // 2 : len(text) // 2 + 1]
    chat = ChatOpenAI(
        base_url=server.url + "/v1", api_key=API_KEY, model=SERVED_NAME, max_tokens=16,
        temperature=0, max_retries=0,
    )  # fmt: skip
    answer = chat.invoke([("user", "Is the cat happy?")], stop=[stop])
    assert answer.content == text.split(stop)[0]
    assert answer.response_metadata["finish_reason"] == "stop"
