"""The replicas workload's requests: tenants, each a long system prompt, several users per
tenant, each a multi-turn chat, the chats starting over time (``--workload replicas``).

A turn's prompt is the whole conversation so far: the tenant's system prompt, then each
earlier user message and answer, then the new message. So a turn shares its tenant's prefix
with every other user of the tenant, and its own history with its previous turn: what a prefix
cache can serve, if the request lands where that prefix is.

The prompts are words of the word-level checkpoint the bench writes (``w17 w3 ...``: one word,
one token, ``python -m front.toy_checkpoint``), sent as text through the router and each answer
read back as token ids, exactly. The client (``drive``) streams each request, times it (sent,
first text, last text) and sends the next turn when the answer is whole, or ``turn_delay``
seconds after it: the user reading the answer and typing the next message (GenAI-Perf's
session turn delay). While one user pauses, the others' turns go on, and a pool too small for
every open conversation evicts the paused one's blocks before it comes back.
"""

from __future__ import annotations

import asyncio
import json
import random
import re
import time
from dataclasses import dataclass, field
from typing import Any

from .endpoint import httpx_module
from .latency import poisson_arrivals

USERS_PER_TENANT = 2


@dataclass(frozen=True)
class TenantWorkload:
    tenants: int = 8
    turns: int = 5  # per conversation
    prefix_len: int = 256  # a tenant's system prompt
    tail_len: int = 16  # a user's message
    new_tokens: int = 16  # an answer
    rate: float = 2.0  # conversations starting per second (Poisson)
    seed: int = 0
    turn_delay: float = 0.0  # seconds a user waits after an answer before its next turn

    @property
    def conversations(self) -> int:
        return self.tenants * USERS_PER_TENANT

    @property
    def requests(self) -> int:
        return self.conversations * self.turns

    @property
    def longest(self) -> int:
        """The last turn's prompt and answer, in tokens."""
        return self.prefix_len + self.turns * (self.tail_len + self.new_tokens)

    def chats(self, vocab_size: int) -> list[Chat]:
        """Every conversation, in the order they start: its tenant's prompt and its messages."""
        rng = random.Random(self.seed)

        def words(n: int) -> list[int]:
            return [rng.randrange(1, vocab_size) for _ in range(n)]  # 0 is the unknown word

        systems = [words(self.prefix_len) for _ in range(self.tenants)]
        starts = poisson_arrivals(self.conversations, self.rate, self.seed)
        tenants = [c % self.tenants for c in range(self.conversations)]
        rng.shuffle(tenants)
        messages = [[words(self.tail_len) for _ in range(self.turns)] for _ in tenants]
        return [
            Chat(c, tenant, start, systems[tenant], messages[c], self.turn_delay)
            for c, (tenant, start) in enumerate(zip(tenants, starts))
        ]

    def describe(self) -> str:
        pause = f", {self.turn_delay:g} s between an answer and the next turn"
        pause = pause if self.turn_delay else ""
        return (
            f"{self.tenants} tenants, each a {self.prefix_len}-token system prompt and "
            f"{USERS_PER_TENANT} users; each user a {self.turns}-turn chat ({self.tail_len} tokens "
            f"a message, {self.new_tokens} an answer{pause}), the chats starting at "
            f"{self.rate:g}/s (Poisson, seed {self.seed}): {self.requests} requests"
        )


@dataclass(frozen=True)
class Chat:
    index: int
    tenant: int
    start: float  # seconds after the run's start
    system: list[int]
    messages: list[list[int]]
    delay: float = 0.0  # seconds between an answer and the next turn (the user's pause)


@dataclass
class Turn:
    """One request as the client saw it."""

    chat: int
    turn: int
    prompt: list[int]
    sent: float
    first_text: float | None = None
    last_text: float | None = None
    answer: list[int] = field(default_factory=list)
    usage: dict[str, Any] = field(default_factory=dict)
    error: str | None = None

    @property
    def ttft(self) -> float:
        assert self.first_text is not None
        return self.first_text - self.sent

    @classmethod
    def from_json(cls, saved: dict[str, Any]) -> Turn:
        """What ``to_json`` kept (the prompt by its length only)."""
        ttft, sent = saved["ttft_s"], saved["sent_s"]
        first = None if ttft is None else sent + ttft
        turn = cls(saved["chat"], saved["turn"], [0] * saved["prompt_tokens"], sent, first)
        turn.last_text, turn.answer, turn.error = (
            saved["last_text_s"],
            saved["answer"],
            saved["error"],
        )
        return turn

    def to_json(self) -> dict[str, Any]:
        return {
            "chat": self.chat,
            "turn": self.turn,
            "prompt_tokens": len(self.prompt),
            "sent_s": self.sent,
            "ttft_s": None if self.first_text is None else self.ttft,
            "last_text_s": self.last_text,
            "answer": self.answer,
            "cached_tokens": (self.usage.get("prompt_tokens_details") or {}).get("cached_tokens"),
            "error": self.error,
        }


def text(ids: list[int]) -> str:
    return " ".join(f"w{i}" for i in ids)


def ids_of(answer: str) -> list[int]:
    return [int(word) for word in re.findall(r"w(\d+)", answer)]


def prompts_of(chat: Chat, answers: list[list[int]]) -> list[list[int]]:
    """Each turn's prompt, given the answers to the turns before it."""
    history, prompts = list(chat.system), []
    for message, answer in zip(chat.messages, [*answers, []]):
        prompts.append(history + message)
        history = history + message + answer
    return prompts[: len(answers) + 1]


async def drive(url: str, model: str, chats: list[Chat], new_tokens: int) -> list[Turn]:
    """Every chat through the server at ``url``, each turn after the last one's answer: the
    turns as the client saw them (a failed request ends its chat, with its error)."""
    httpx = httpx_module()
    limits = httpx.Limits(max_connections=len(chats))
    async with httpx.AsyncClient(base_url=url, timeout=None, limits=limits) as client:
        start = time.perf_counter()
        runs = [chat_turns(client, model, chat, new_tokens, start) for chat in chats]
        return [turn for turns in await asyncio.gather(*runs) for turn in turns]


async def chat_turns(client: Any, model: str, chat: Chat, new_tokens: int, start: float):
    await asyncio.sleep(max(0.0, start + chat.start - time.perf_counter()))
    turns: list[Turn] = []
    for t in range(len(chat.messages)):
        if t:
            await asyncio.sleep(chat.delay)
        prompt = prompts_of(chat, [turn.answer for turn in turns])[t]
        turn = Turn(chat.index, t, prompt, time.perf_counter() - start)
        turns.append(turn)
        await send(client, model, turn, new_tokens, start)
        if turn.error is not None:
            break
    return turns


async def send(client: Any, model: str, turn: Turn, new_tokens: int, start: float) -> None:
    """One streamed completion, greedy, exactly ``new_tokens`` long (``ignore_eos``)."""
    body = {
        "model": model,
        "prompt": text(turn.prompt),
        "max_tokens": new_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    pieces = []
    try:
        async with client.stream("POST", "/v1/completions", json=body) as answer:
            if answer.status_code != 200:
                turn.error = f"{answer.status_code}: {(await answer.aread()).decode()[:200]}"
                return
            async for line in answer.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                event = json.loads(line.removeprefix("data: "))
                piece = event["choices"][0].get("text") if event["choices"] else None
                if piece:
                    now = time.perf_counter() - start
                    turn.first_text = turn.first_text or now
                    turn.last_text = now
                    pieces.append(piece)
                turn.usage = event.get("usage") or turn.usage
    except Exception as exc:  # the connection dropped: what the client sees, kept
        turn.error = f"{type(exc).__name__}: {exc}"
        return
    turn.answer = ids_of("".join(pieces))
    if len(turn.answer) != new_tokens:
        turn.error = f"{len(turn.answer)} tokens came back, not {new_tokens}"
