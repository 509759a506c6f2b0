"""The text front end's command line: ``run.py --model DIR`` (every step).

``build_parser`` defines the flags (the checkpoint, the requests, chat, streaming, sampling,
and the engine's and the trace's, shared with the other commands), ``read_options`` checks
what argparse alone cannot (flags that exclude each other, sampling without a temperature) and
reads them into a ``TextRun``, before anything loads. ``run`` then serves the requests through
``text.py``'s parts and prints each answer with why it stopped: at once, or as it grows with
``--stream`` (``stream.py``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from common.config import ModelConfig
from common.memory import kv_bytes_per_block
from common.sampling_params import SamplingParams

from .build import EngineBuilder, ModelSource
from .cli import (
    HelpFormatter,
    TraceOptions,
    add_engine_flags,
    add_model_flag,
    add_trace_flags,
    int_range,
    number_in,
    plural,
    positive_int,
    text_of,
    trace_options,
)
from .codec import Prompt, check_messages
from .options import EngineOptions
from .stream import StreamPrinter, answer_head, answer_tail
from .text import TextOptions, TextRequests, TextResult, prepare_requests, serve_requests
from .trace import RoundTracer
from .trace_plot import show_trace

EXAMPLE_PROMPT = "The capital of France is"  # what --model DIR answers without --prompt

DESCRIPTION = """\
Real text through this step's engine: a local Hugging Face Llama checkpoint (config.json,
*.safetensors, tokenizer.json) serves each --prompt behind the shared --system prompt (or
--prompt-file's lines, or --messages conversations), greedy or sampled (--temperature, --top-p,
--top-k), all at once or --stream'ed. The answers end with why they stopped, then what the
prefix cache did. --trace prints the run round by round, --trace-png FILE draws it.
"""


@dataclass(frozen=True)
class TextRun:
    """``run.py --model DIR``'s flags, read once: what to serve, how, and what to show."""

    model: str  # the checkpoint folder
    prompts: list[Prompt]
    text: TextOptions
    stream: bool = False
    trace: TraceOptions = field(default_factory=TraceOptions)
    asked: bool = True  # False: no request given, the example prompt is served

    @property
    def engine(self) -> EngineOptions:
        return self.text.engine


def build_parser(prog: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog, description=DESCRIPTION, formatter_class=HelpFormatter
    )
    add_model_flag(
        parser, "a local Hugging Face Llama checkpoint directory (nothing is downloaded)"
    )
    add_request_flags(parser)
    add_sampling_flags(parser)
    parser.add_argument(
        "--stream",
        action="store_true",
        help="print each answer as it grows, token by token; several answers come one after "
        "the other, in the order of the prompts (the ones behind are served meanwhile and "
        "catch up at once)",
    )
    add_engine_flags(parser)
    add_trace_flags(parser)
    return parser


def add_request_flags(parser: argparse.ArgumentParser) -> None:
    """What to serve, and whether the chat template writes it."""
    parser.add_argument(
        "--system", type=text_of("--system"), metavar="TEXT", help="a prompt every request shares"
    )
    parser.add_argument(
        "--prompt",
        type=text_of("--prompt"),
        metavar="TEXT",
        action="append",
        help=f"a prompt to complete; repeat it for several requests (none: {EXAMPLE_PROMPT!r})",
    )
    parser.add_argument(
        "--prompt-file",
        type=prompt_file,
        metavar="FILE",
        help="one prompt per line of FILE (- reads stdin), empty lines skipped; after the "
        "--prompt ones, if any",
    )
    parser.add_argument(
        "--messages",
        type=messages_file,
        action="append",
        metavar="FILE",
        help='a conversation to continue, a JSON list of {"role": ..., "content": ...} '
        "(multi-turn, ending with the user's), written in the checkpoint's chat template; "
        "repeat it for several. Instead of --prompt, --prompt-file and --system",
    )
    parser.add_argument(
        "--no-chat-template",
        action="store_true",
        help="plain completion even when the checkpoint has a chat template (by default "
        "--system and each --prompt become chat messages in its markup)",
    )


def add_sampling_flags(
    parser: argparse.ArgumentParser, max_new_tokens: int = SamplingParams().max_tokens
) -> None:
    """``--max-new-tokens`` (by default vLLM's 16; the chat loop wants longer answers),
    ``--temperature``, ``--top-p``, ``--top-k``."""
    vllms = " (vLLM's default)" if max_new_tokens == SamplingParams().max_tokens else ""
    parser.add_argument(
        "--max-new-tokens",
        type=positive_int,
        default=max_new_tokens,
        metavar="N",
        help=f"the most tokens generated per request{vllms}",
    )
    parser.add_argument(
        "--temperature",
        type=number_in(0),
        default=0.0,
        metavar="T",
        help="0 takes the most likely token (greedy); above 0, tokens are drawn, more freely "
        "the higher T (--seed seeds the draws; vLLM's default is 1)",
    )
    parser.add_argument(
        "--top-p",
        type=number_in(0, 1, low_open=True),
        default=1.0,
        metavar="P",
        help="with --temperature: draw among the most likely tokens whose probabilities add "
        "up to P (1: all)",
    )
    parser.add_argument(
        "--top-k",
        type=int_range(-1),
        default=0,
        metavar="K",
        help="with --temperature: draw among the K most likely tokens (0 or -1: all)",
    )


def read_options(parser: argparse.ArgumentParser, argv: list[str]) -> TextRun:
    """The flags, checked (one ``error:`` line and exit 2) and read, before anything loads."""
    args = parser.parse_args(argv)
    if args.messages:
        given = {"--prompt": args.prompt, "--prompt-file": args.prompt_file}
        given["--system"] = args.system
        others = [flag for flag, value in given.items() if value]
        if others:
            parser.error(
                f"--messages and {others[0]} do not go together: a conversation carries its "
                "own messages (put the system prompt in it, as its first message)"
            )
        if args.no_chat_template:
            parser.error("--messages is written in the chat template: drop --no-chat-template")
    prompts = args.messages or [*(args.prompt or []), *(args.prompt_file or [])]
    options = TextOptions(
        system=args.system,
        sampling_params=sampling_params(parser, args),
        chat_template=not args.no_chat_template,
        engine=EngineOptions.from_args(args),
    )
    trace = trace_options(parser, args)
    return TextRun(
        args.model, prompts or [EXAMPLE_PROMPT], options, args.stream, trace, bool(prompts)
    )


def sampling_params(parser: argparse.ArgumentParser, args: argparse.Namespace) -> SamplingParams:
    """The sampling flags as one ``SamplingParams`` for every request (no seed of its own:
    each request draws one from ``--seed``). A filter without a temperature is refused: the
    default, 0, takes the most likely token, so it would change nothing, where vLLM (whose
    default temperature is 1) would sample."""
    filters = [
        flag for flag, on in (("--top-k", args.top_k > 0), ("--top-p", args.top_p < 1)) if on
    ]
    if filters and args.temperature == 0:
        parser.error(
            f"{filters[0]} chooses among the tokens a draw may take, and --temperature 0 (the "
            "default here) draws none: it takes the most likely token. Give --temperature "
            "(vLLM's default is 1)"
        )
    return SamplingParams(
        max_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
    )


def read_text_arg(name: str) -> str:
    """The text of file ``name``, or of stdin for ``-``; a file that cannot be read is the
    flag's error (one line), not a traceback."""
    if name == "-":
        return sys.stdin.read()
    try:
        return Path(name).expanduser().read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise argparse.ArgumentTypeError(f"{name}: not UTF-8 text") from None
    except OSError as exc:
        raise argparse.ArgumentTypeError(f"{name}: {exc.strerror or exc}") from None


def prompt_file(name: str) -> list[str]:
    """``--prompt-file``: one prompt per line (``-``: stdin), empty lines skipped."""
    prompts = [line for line in read_text_arg(name).splitlines() if line.strip()]
    if not prompts:
        raise argparse.ArgumentTypeError(f"{name}: no prompt in it (one prompt per line)")
    return prompts


def messages_file(name: str) -> list[dict[str, str]]:
    """``--messages``: a conversation in JSON (``-``: stdin), checked before anything loads."""
    try:
        messages = json.loads(read_text_arg(name))
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"{name}: not valid JSON ({exc})") from None
    try:
        return check_messages(messages)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{name}: {exc}") from None


# ---- the run --------------------------------------------------------------------------------


def run(step_name: str, options: TextRun) -> int:
    """Check, load, serve, print (``--stream``: as the answers grow), trace on request."""
    source = ModelSource.open(options.model, options.text.engine)
    requests = prepare_requests(source, options.prompts, options.text)
    if requests.warning:
        print(f"warning: {requests.warning}", file=sys.stderr)
    if not options.asked:  # said once the checkpoint and the request are known to be sound
        print(f"no --prompt given: completing {EXAMPLE_PROMPT!r} (--prompt TEXT asks your own)")
    start = time.perf_counter()
    engine = EngineBuilder(step_name, source, options.text.engine)()
    print(f"{step_name}: {options.model} (loaded in {time.perf_counter() - start:.1f} s)")
    print_banner(requests, options.text)
    tracers: list[RoundTracer] = []
    attach = (lambda engine: tracers.append(RoundTracer(engine))) if options.trace.wanted else None
    prompt_ids = [request.prompt_ids for request in requests.requests]
    printer = None
    if options.stream:
        printer = StreamPrinter(requests.codec.decode, options.prompts, prompt_ids=prompt_ids)
    result = serve_requests(engine, requests, attach, printer)
    if printer is None:
        print_answers(result)
    print_summary(result)
    if tracers:
        running = options.text.engine.max_running
        title = f"{step_name}: serving the prompts, max_running={running}"
        show_trace(options.trace, "serving the prompts", tracers[0].rounds, title)
    return 0


def print_banner(requests: TextRequests, options: TextOptions) -> None:
    """The model, its KV pool, the chat template and how tokens are drawn, indented; then the
    shared system prompt, before the answers (before they stream, with ``--stream``)."""
    params, template = options.sampling_params, requests.codec.template
    sampled = isinstance(params, SamplingParams) and not params.greedy
    sampling = describe_sampling(params, options.engine.seed) if sampled else None
    lines = describe(requests.cfg)
    if template is not None:
        lines.append(f"chat template: {template.source} (--no-chat-template: plain completion)")
    if sampling:
        lines.append(f"sampling: {sampling}")
    for line in lines:
        print(f"  {line}")
    if options.system is not None:
        shared = f"{plural(requests.system_tokens, 'token')}, shared by every request"
        print(f"system prompt: {options.system!r} ({shared})")


def describe(cfg: ModelConfig) -> list[str]:
    """Two lines about the loaded model and its KV pool (and what GQA saves per block)."""
    heads = f"{cfg.num_heads} heads"
    if cfg.num_kv_heads != cfg.num_heads:
        heads += f" / {cfg.num_kv_heads} KV heads"
    block = f"{kv_bytes_per_block(cfg) / 1024:g} KiB of K and V per block"
    if cfg.num_kv_heads != cfg.num_heads:
        full = kv_bytes_per_block(cfg, kv_heads=cfg.num_heads) / 1024
        block += f" ({full:g} KiB without grouped-query attention)"
    return [
        f"{cfg.num_layers} layers, d_model {cfg.d_model}, {heads} of {cfg.d_head}, "
        f"vocab {cfg.vocab_size}, {cfg.dtype_name} on {cfg.device}",
        f"KV pool: {cfg.total_blocks} blocks x {cfg.block_size} tokens, {block}",
    ]


def describe_sampling(params: SamplingParams, seed: int) -> str:
    """The banner's line about a sampled run, with the seed that repeats it."""
    among = [f"temperature {params.temperature:g}"]
    if params.top_k > 0:
        among.append(f"top_k {params.top_k}")
    if params.top_p < 1:
        among.append(f"top_p {params.top_p:g}")
    return f"{', '.join(among)}; seed {seed} (--seed N repeats a run, in every step)"


def print_answers(result: TextResult) -> None:
    """Each answer under its prompt, as ``--stream`` prints them while they grow."""
    for i, (prompt, output, ids, reason) in enumerate(
        zip(result.prompts, result.outputs, result.output_ids, result.finish_reasons)
    ):
        print(answer_head(i + 1, prompt) + output + answer_tail(len(ids), reason), end="")


def print_summary(result: TextResult) -> None:
    """After the answers: what the prefix cache did, the time, and ``cache_note``."""
    s = result.stats
    new_tokens = sum(len(ids) for ids in result.output_ids)
    print(
        f"\nprefix cache: {s.requests_hit}/{s.requests} requests hit, "
        f"{s.cached_tokens}/{s.prompt_tokens} prompt tokens ({s.token_hit_rate:.0%}) from the "
        f"cache; {plural(new_tokens, 'new token')} in {result.seconds:.2f} s"
    )
    if result.cache_note:
        print(result.cache_note)
