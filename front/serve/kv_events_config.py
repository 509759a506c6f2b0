"""``--kv-events-config JSON``: where the engine's KV cache events go, with vLLM's keys and
meanings (``vllm/config/kv_events.py``: ``KVEventsConfig``).

    --kv-events-config '{"enable_kv_cache_events": true, "endpoint": "tcp://*:5557"}'

Light on purpose (no zmq, no msgspec), so that a bad key is one ``error:`` line before anything
is loaded; ``kv_events.py`` is the publisher these settings build. ``event_sources`` is what
``GET /kv_event_sources`` answers: where a router finds the events.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass, fields, replace

from typing_extensions import TypedDict  # pydantic reads it (typing's only from 3.12)

PUBLISHERS = ("null", "zmq")


@dataclass(frozen=True)
class KVEventsConfig:
    """vLLM's fields, each with vLLM's default."""

    enable_kv_cache_events: bool = False  # the engine records its events (take_events)
    publisher: str | None = None  # "zmq" or "null"; None: "zmq" when enabled, else "null"
    endpoint: str = "tcp://*:5557"  # the PUB socket: bound with * (or ::, ipc://), else connected
    replay_endpoint: str | None = None  # a ROUTER socket that resends missed batches
    buffer_steps: int = 10_000  # batches kept for the replay socket
    hwm: int = 100_000  # the PUB socket's high-water mark: past it, a slow subscriber misses some
    max_queue_size: int = 100_000  # batches waiting for the publisher's thread
    topic: str = ""  # the first frame of every message; subscribers filter on it

    @property
    def publishes(self) -> bool:
        """Events leave the process: on, and the publisher is zmq (vLLM's rule for the
        default: zmq when the events are on)."""
        return self.enable_kv_cache_events and (self.publisher or "zmq") == "zmq"


KEY_TYPES: dict[str, tuple[type, ...]] = {
    "enable_kv_cache_events": (bool,),
    "publisher": (str, type(None)),
    "endpoint": (str,),
    "replay_endpoint": (str, type(None)),
    "buffer_steps": (int,),
    "hwm": (int,),
    "max_queue_size": (int,),
    "topic": (str,),
}


def kv_events_config(text: str) -> KVEventsConfig:
    """``--kv-events-config``: a JSON object of vLLM's keys; any other key, a value of the
    wrong type, or an unknown publisher is refused by name (argparse prints one line)."""
    try:
        values = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not JSON ({exc.msg}): {text!r}") from None
    if not isinstance(values, dict):
        raise argparse.ArgumentTypeError(f"a JSON object of vLLM's keys, got {text!r}")
    known = [f.name for f in fields(KVEventsConfig)]
    for key, value in values.items():
        if key not in known:
            raise argparse.ArgumentTypeError(f"unknown key {key!r}; vLLM's: {', '.join(known)}")
        wanted = KEY_TYPES[key]
        if not isinstance(value, wanted) or (isinstance(value, bool) and bool not in wanted):
            names = " or ".join("null" if t is type(None) else t.__name__ for t in wanted)
            raise argparse.ArgumentTypeError(f"{key} must be {names}, got {value!r}")
    config = KVEventsConfig(**values)
    check(config)
    return config


def check(config: KVEventsConfig) -> None:
    if config.publisher is not None and config.publisher not in PUBLISHERS:
        raise argparse.ArgumentTypeError(
            f"publisher must be one of {', '.join(PUBLISHERS)}, got {config.publisher!r}"
        )
    for key in ("buffer_steps", "max_queue_size"):
        if getattr(config, key) < 1:
            raise argparse.ArgumentTypeError(f"{key} must be >= 1, got {getattr(config, key)}")
    if config.hwm < 0:
        raise argparse.ArgumentTypeError(f"hwm must be >= 0 (0: no limit), got {config.hwm}")
    if not config.endpoint.startswith(("tcp://", "ipc://", "inproc://")):
        raise argparse.ArgumentTypeError(
            f"endpoint must be tcp://HOST:PORT (ipc:// or inproc://), got {config.endpoint!r}"
        )


class KVEventSource(TypedDict):
    """One publisher in ``GET /kv_event_sources``: vLLM's ``KVEventsConfig``, every key."""

    enable_kv_cache_events: bool
    publisher: str
    endpoint: str
    replay_endpoint: str | None
    buffer_steps: int
    hwm: int
    max_queue_size: int
    topic: str


def event_sources(config: KVEventsConfig | None) -> dict[str, KVEventSource]:
    """``GET /kv_event_sources``, as vLLM 0.33 answers it (``EngineClient.get_kv_event_sources``):
    the publisher's settings, every key of ``KVEventsConfig`` with the publisher named, under
    each data-parallel rank that publishes (here one engine, rank ``"0"``); ``{}`` when no
    events leave the process (off, or the ``null`` publisher). The endpoints are as configured,
    ``tcp://*:5557`` included, as vLLM reports them for rank 0."""
    if config is None or not config.publishes:
        return {}
    return {"0": KVEventSource(**asdict(replace(config, publisher="zmq")))}
