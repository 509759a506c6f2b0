"""What a user waiting for an answer sees, measured the same way whoever serves the requests.

A way of serving (``Serve``) takes the timed requests (``TimedRequest``: a prompt, when it
arrives, how many tokens it asks for) and hands back a ``RunFigures``: when each request's
first and last token came (``RequestTimes``), how long the server was busy, its counters and
the tokens. The in-process engine of ``--workload serving`` is one way
(``workloads/serving.py``, ``engine_serve``); an OpenAI-compatible endpoint reached over HTTP
is another. The figures (TTFT, TPOT, their percentiles, tokens/s) come from here for both.

- **TTFT**, time to first token: from the request's arrival to the moment its first token is
  handed back. Queueing, then the prefill of its prompt: what the prefix cache shortens;
- **TPOT**, time per output token after the first: ``(last - first) / (tokens - 1)``, the pace
  of the answer once it streams (vLLM's ``benchmark_serving`` reports the same two).
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True)
class TimedRequest:
    prompt: list[int]
    arrival: float  # seconds after the first request's arrival
    max_tokens: int


def poisson_arrivals(count: int, rate: float, seed: int) -> list[float]:
    """``count`` arrival times of a Poisson process of ``rate`` per second (the gaps vLLM's
    ``benchmark_serving`` sleeps), the first at 0; infinite ``rate``: all at 0. Seeded apart
    from the prompts, by a string (hashed alike in every process)."""
    if math.isinf(rate):
        return [0.0] * count
    rng = random.Random(f"arrivals {seed}")
    times, now = [], 0.0
    for _ in range(count):
        times.append(now)
        now += rng.expovariate(rate)
    return times


@dataclass
class RequestTimes:
    """When a request arrived, and when its first and its last token were handed back."""

    arrival: float
    first_token: float | None = None
    last_token: float | None = None
    tokens: int = 0

    def record(self, now: float, tokens: int) -> None:
        """At ``now`` the request had ``tokens`` tokens."""
        if self.first_token is None:
            self.first_token = now
        self.last_token, self.tokens = now, tokens

    @property
    def ttft(self) -> float:
        """Time to first token: arrival to first token (queueing and prefill)."""
        assert self.first_token is not None, "the request produced no token"
        return self.first_token - self.arrival

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first (vLLM's TPOT); None for a one-token answer,
        which has no pace (vLLM leaves those out too)."""
        if self.tokens < 2:
            return None
        return (self.last_token - self.first_token) / (self.tokens - 1)


def percentile(values: Sequence[float], p: float) -> float:
    """The ``p``-th percentile, interpolated linearly between the two nearest ranks (numpy's
    default, so the figures compare with ``benchmark_serving``'s): the sorted values' position
    ``p / 100 * (n - 1)``. p50 of an even count is the mean of the middle two."""
    if not values:
        raise ValueError("no values")
    ordered = sorted(values)
    rank = p / 100 * (len(ordered) - 1)
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


@dataclass
class RunFigures:
    """One run: every request's times, the server's busy seconds, its counters, the tokens."""

    requests: list[RequestTimes]
    busy_s: float
    stats: dict[str, int] = field(default_factory=dict)
    outputs: list[list[int]] = field(default_factory=list, repr=False)

    @property
    def seconds(self) -> float:
        """What ranks runs: the busy time (the arrivals, and so the duration, are fixed)."""
        return self.busy_s

    @property
    def duration_s(self) -> float:
        """From the first arrival to the last token."""
        return max(r.last_token for r in self.requests) - min(r.arrival for r in self.requests)

    @property
    def output_tokens(self) -> int:
        return sum(r.tokens for r in self.requests)

    @property
    def tokens_per_s(self) -> float:
        """Output tokens per second of the run's duration (arrivals included: a server that
        keeps up with the arrivals shows the arrival rate's tokens, not its own top speed)."""
        return self.output_tokens / self.duration_s if self.duration_s else math.inf

    @property
    def busy(self) -> float:
        """The share of the run's duration the server was working."""
        return self.busy_s / self.duration_s if self.duration_s else 1.0

    def ttft(self, p: float) -> float:
        return percentile([r.ttft for r in self.requests], p)

    def tpot(self, p: float) -> float | None:
        paces = [r.tpot for r in self.requests if r.tpot is not None]
        return percentile(paces, p) if paces else None

    @property
    def prefix_reuse(self) -> float:
        """Prompt tokens the prefix cache served, of all prompt tokens."""
        return self.stats.get("cached_tokens", 0) / max(self.stats.get("prompt_tokens", 0), 1)

    def to_json(self) -> dict[str, object]:
        """The run's figures, and each request's TTFT and TPOT in ms, in request order."""
        return {
            "busy_s": self.busy_s,
            "duration_s": self.duration_s,
            "output_tokens_per_s": self.tokens_per_s,
            "ttft_ms": {"p50": in_ms(self.ttft(50)), "p99": in_ms(self.ttft(99))},
            "tpot_ms": {"p50": in_ms(self.tpot(50)), "p99": in_ms(self.tpot(99))},
            "stats": self.stats,
            "each_ttft_ms": [round(in_ms(r.ttft), 3) for r in self.requests],
            "each_tpot_ms": [
                None if r.tpot is None else round(in_ms(r.tpot), 3) for r in self.requests
            ],
        }


def in_ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1000


Serve = Callable[[list[TimedRequest]], RunFigures]  # one run of the requests, timed
