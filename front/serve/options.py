"""``python -m <step>.serve``'s command line: its flags, read once into ``ServeOptions``.

Light on purpose (argparse and the flags every command shares, no web package), so that a flag
it cannot use is one ``error:`` line before anything else is imported or loaded.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from ..cli import HelpFormatter, add_engine_flags, add_model_flag, int_range, positive_int
from ..options import EngineOptions
from .kv_events_config import KVEventsConfig, kv_events_config

# A server's requests come and go while others run, so it runs more at once than a batch
# command (8): vLLM's default is 256 sequences on a pool of tens of thousands of blocks; this
# pool's default of 512 blocks of 16 tokens holds 64 requests of 128 tokens at once.
SERVE_MAX_RUNNING = 64
MAX_RUNNING_HELP = (
    "requests the engine runs at once at most (more wait in its queue). A server's default: "
    "each running request gets --total-blocks / N blocks before the pool runs dry; raise it "
    "with --total-blocks, lower it when vllm:num_preemptions_total climbs (docs/serving.md)"
)
MAX_REQUEST_BYTES = 4 * 2**20  # a body over it is refused with 413 (--max-request-bytes)

DESCRIPTION = """\
An OpenAI-compatible server (vLLM's endpoints and metric names) over this step's engine. The
engine lives as long as the server, so the prefix cache serves every later request what an
earlier one computed: a shared system prompt, a conversation's history.

  curl http://127.0.0.1:8000/v1/chat/completions -H 'Content-Type: application/json' \\
       -d '{"messages": [{"role": "user", "content": "Hello"}]}'

docs/serving.md: the openai client, streaming, /metrics, and the map onto vllm serve."""


@dataclass(frozen=True)
class ServeOptions:
    """The command line, checked: the checkpoint, where to listen, the API's names, and the
    engine flags every command shares."""

    model: str
    host: str
    port: int
    api_key: str | None
    served_model_name: str | None
    engine: EngineOptions
    engine_in_thread: bool = False  # vLLM's VLLM_ENABLE_V1_MULTIPROCESSING=0
    max_request_bytes: int = MAX_REQUEST_BYTES
    kv_events: KVEventsConfig | None = None  # --kv-events-config (None: no events)


def build_parser(prog: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=DESCRIPTION, formatter_class=HelpFormatter)
    add_model_flag(p, "a local Hugging Face Llama checkpoint directory")
    p.add_argument(
        "--host",
        default="127.0.0.1",
        help="the address to listen on (0.0.0.0: every interface; mind --api-key)",
    )
    p.add_argument(
        "--port",
        type=int_range(0, 65535),
        default=8000,
        help="the port (0: any free one, printed at start)",
    )
    p.add_argument(
        "--api-key",
        metavar="KEY",
        help="require 'Authorization: Bearer KEY' on every route but /health and /metrics",
    )
    p.add_argument(
        "--served-model-name",
        metavar="NAME",
        help="the model's name in the API (None: the --model argument)",
    )
    p.add_argument(
        "--max-request-bytes",
        type=positive_int,
        default=MAX_REQUEST_BYTES,
        metavar="N",
        help="a request body over N bytes is refused (413) before it is read as JSON",
    )
    add_engine_flags(p, helps={"max_running": MAX_RUNNING_HELP}, max_running=SERVE_MAX_RUNNING)
    p.add_argument(
        "--engine-in-thread",
        action="store_true",
        help="run the engine on a thread of the server's process, not in a process of its own "
        "(vLLM's VLLM_ENABLE_V1_MULTIPROCESSING=0): one process, but the engine shares Python's "
        "GIL with the HTTP side, slower under load (docs/serving.md)",
    )
    p.add_argument(
        "--kv-events-config",
        type=kv_events_config,
        metavar="JSON",
        help="publish the prefix cache's KV events as vLLM does, for a KV-aware router: a JSON "
        'object of vLLM\'s keys, e.g. \'{"enable_kv_cache_events": true, "endpoint": '
        '"tcp://*:5557"}\' (enable_kv_cache_events, publisher, endpoint, replay_endpoint, '
        "topic, buffer_steps, hwm, max_queue_size; docs/scale-out.md); needs pip install -e "
        "'.[cluster]'",
    )
    return p


def parse_args(prog: str, argv: list[str] | None, step_name: str) -> ServeOptions:
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    engine = EngineOptions.from_args(args)
    why = engine.refused_by(step_name)  # the one check of the engine options, before any load
    if why is not None:
        parser.error(why)
    return ServeOptions(
        args.model,
        args.host,
        args.port,
        args.api_key,
        args.served_model_name,
        engine,
        args.engine_in_thread,
        args.max_request_bytes,
        args.kv_events_config,
    )
