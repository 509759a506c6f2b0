"""The text front end's command line: ``run.py --model DIR`` (every step).

``add_model_args`` adds the flags (the checkpoint, the requests, chat, streaming, sampling) and
``check_text_args`` checks what argparse alone cannot (flags that need ``--model``, flags that
exclude each other), both while the flags are read, before anything loads. ``run_text`` then
serves the requests through ``text.generate_text``'s parts and prints each answer with why it
stopped: at once, or as it grows with ``--stream`` (``stream.py``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from ..checkpoint import checkpoint_config
from ..config import ModelConfig
from ..errors import report_user_errors
from ..sampling import SamplingParams
from .chat import Prompt, check_messages
from .cli import int_range, number_in, plural
from .steps import load_step
from .stream import StreamPrinter, answer_head, answer_tail
from .text import (
    DEFAULT_MAX_NEW_TOKENS,
    TextRequests,
    TextResult,
    model_dir_arg,
    prepare_requests,
    serve,
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
    """``--prompt-file``: one prompt per line of the file (``-``: stdin); empty lines are
    skipped, and a file without a prompt is refused."""
    lines = read_text_arg(name).splitlines()
    prompts = [line for line in lines if line.strip()]
    if not prompts:
        raise argparse.ArgumentTypeError(f"{name}: no prompt in it (one prompt per line)")
    return prompts


def messages_file(name: str) -> list[dict[str, str]]:
    """``--messages``: a conversation, a JSON list of ``{"role": ..., "content": ...}``
    (``-``: read from stdin), checked here: a file the chat template could not take is
    refused before anything loads."""
    try:
        messages = json.loads(read_text_arg(name))
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"{name}: not valid JSON ({exc})") from None
    try:
        return check_messages(messages)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{name}: {exc}") from None


def add_model_args(parser: argparse.ArgumentParser) -> None:
    """``--model DIR``, the requests (``--system TEXT``, ``--prompt TEXT`` (repeatable),
    ``--prompt-file FILE``, ``--messages FILE``), ``--no-chat-template``,
    ``--stream`` and the sampling flags (``--temperature``, ``--top-p``, ``--top-k``)."""
    parser.add_argument(
        "--model",
        type=model_dir_arg,
        metavar="DIR",
        help="a local Hugging Face Llama checkpoint directory (config.json, *.safetensors, "
        "tokenizer.json): serve real text instead of the demo",
    )
    parser.add_argument(
        "--system", metavar="TEXT", help="a system prompt shared by every --prompt (with --model)"
    )
    parser.add_argument(
        "--prompt",
        metavar="TEXT",
        action="append",
        help="a prompt to complete (with --model); repeat it for several requests",
    )
    parser.add_argument(
        "--no-chat-template",
        action="store_true",
        help="with --model: plain completion even when the checkpoint has a chat template "
        "(by default --system and each --prompt become chat messages in its markup)",
    )
    parser.add_argument(
        "--prompt-file",
        type=prompt_file,
        metavar="FILE",
        help="with --model: one prompt per line of FILE (- reads stdin), empty lines skipped; "
        "after the --prompt ones, if any",
    )
    parser.add_argument(
        "--messages",
        type=messages_file,
        action="append",
        metavar="FILE",
        help='with --model: a conversation to continue, a JSON list of {"role": ..., '
        "\"content\": ...} (multi-turn, ending with the user's), written in the checkpoint's "
        "chat template; repeat it for several. Instead of --prompt, --prompt-file and --system",
    )
    parser.add_argument(
        "--stream",
        action="store_true",
        help="with --model: print each answer as it grows, token by token; several answers "
        "come one after the other, in the order of the prompts (the ones behind are served "
        "meanwhile and catch up at once)",
    )
    parser.add_argument(
        "--temperature",
        type=number_in(0),
        default=0.0,
        metavar="T",
        help="with --model: 0 takes the most likely token (greedy); above 0, tokens are drawn, "
        "more freely the higher T (--seed seeds the draws)",
    )
    parser.add_argument(
        "--top-p",
        type=number_in(0, 1, low_open=True),
        default=1.0,
        metavar="P",
        help="with --model and --temperature > 0: draw among the most likely tokens whose "
        "probabilities add up to P (1: all)",
    )
    parser.add_argument(
        "--top-k",
        type=int_range(-1),
        default=0,
        metavar="K",
        help="with --model and --temperature > 0: draw among the K most likely tokens "
        "(0 or -1: all)",
    )


# The flags only the text front end reads, with their defaults: given without --model, the
# demo refuses them rather than ignore them.
TEXT_ONLY_FLAGS = {
    "prompt_file": None,
    "messages": None,
    "stream": False,
    "temperature": 0.0,
    "top_p": 1.0,
    "top_k": 0,
}


def check_text_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """The combinations of the text flags, checked with the other flags (``parser.error``:
    one line, exit 2), before anything loads. Without ``--model`` the text-only flags are
    refused (a value equal to the default cannot be told from none, and changes nothing)."""
    if args.model is None:
        given = [
            name for name, default in TEXT_ONLY_FLAGS.items() if getattr(args, name) != default
        ]
        if given:
            flag = "--" + given[0].replace("_", "-")
            parser.error(
                f"{flag} needs --model DIR (a checkpoint's text): the demo serves its own "
                "requests, greedily"
            )
        return
    if args.messages:
        others = [
            flag
            for flag, value in (
                ("--prompt", args.prompt),
                ("--prompt-file", args.prompt_file),
                ("--system", args.system),
            )
            if value
        ]
        if others:
            parser.error(
                f"--messages and {others[0]} do not go together: a conversation carries its own "
                "messages (put the system prompt in it, as its first message)"
            )
        if args.no_chat_template:
            parser.error("--messages is written in the chat template: drop --no-chat-template")


def sampling_params_from(args: argparse.Namespace) -> SamplingParams:
    """The flags as one ``SamplingParams`` for every request. No seed of its own: each request
    draws one from the engine's seed (``--seed``), so two requests for the same prompt may
    differ, and the run as a whole is repeatable."""
    return SamplingParams(
        max_tokens=getattr(args, "max_new_tokens", None) or DEFAULT_MAX_NEW_TOKENS,
        temperature=getattr(args, "temperature", 0.0),
        top_p=getattr(args, "top_p", 1.0),
        top_k=getattr(args, "top_k", 0),
    )


def requests_from(args: argparse.Namespace) -> list[Prompt]:
    """What to serve: the ``--messages`` conversations, or the ``--prompt``s then the
    ``--prompt-file``'s lines; none of them: the example prompt."""
    if getattr(args, "messages", None):
        return list(args.messages)
    prompts = [*(args.prompt or []), *(getattr(args, "prompt_file", None) or [])]
    return prompts or [EXAMPLE_PROMPT]


def kv_bytes_per_block(cfg: ModelConfig, kv_heads: int | None = None) -> int:
    """K and V of one block, all layers: what grouped-query attention shrinks."""
    return cfg.block_size * cfg.kv_bytes_per_token(kv_heads)


def describe(cfg: ModelConfig) -> list[str]:
    """Two lines about the loaded model and its KV pool (and what GQA saves per block)."""
    heads = f"{cfg.num_heads} heads"
    if cfg.num_kv_heads != cfg.num_heads:
        heads += f" / {cfg.num_kv_heads} KV heads"
    dtype = str(cfg.dtype).removeprefix("torch.")
    block = f"{kv_bytes_per_block(cfg) / 1024:g} KiB of K and V per block"
    if cfg.num_kv_heads != cfg.num_heads:
        full = kv_bytes_per_block(cfg, kv_heads=cfg.num_heads) / 1024
        block += f" ({full:g} KiB without grouped-query attention)"
    return [
        f"{cfg.num_layers} layers, d_model {cfg.d_model}, {heads} of {cfg.d_head}, "
        f"vocab {cfg.vocab_size}, {dtype} on {cfg.device}",
        f"KV pool: {cfg.total_blocks} blocks x {cfg.block_size} tokens, {block}",
    ]


def print_result(result: TextResult, system: str | None) -> None:
    """The answers, then the prefix cache's figures (and why nothing could hit, when the
    shared system prompt is shorter than one block)."""
    print_system(system, result.system_tokens)
    reasons = result.finish_reasons or [None] * len(result.outputs)
    for i, (prompt, output, ids, reason) in enumerate(
        zip(result.prompts, result.outputs, result.output_ids, reasons)
    ):
        print(answer_head(i + 1, prompt) + output + answer_tail(len(ids), reason), end="")
    print_summary(result, system)


def print_system(system: str | None, system_tokens: int) -> None:
    """The shared system prompt, before the answers (before they stream, with ``--stream``)."""
    if system is not None:
        print(
            f"system prompt: {system!r} ({plural(system_tokens, 'token')}, shared by every request)"
        )


def print_summary(result: TextResult, system: str | None) -> None:
    """After the answers: what the prefix cache did, and the time."""
    s = result.stats
    new_tokens = sum(len(ids) for ids in result.output_ids)
    print(
        f"\nprefix cache: {s.requests_hit}/{s.requests} requests hit, "
        f"{s.cached_tokens}/{s.prompt_tokens} prompt tokens ({s.token_hit_rate:.0%}) from the "
        f"cache; {plural(new_tokens, 'new token')} in {result.seconds:.2f} s"
    )
    if system is not None and result.system_tokens < result.cfg.block_size:
        print(short_system_note(result.system_tokens, result.cfg.block_size))


def short_system_note(system_tokens: int, block_size: int) -> str:
    """Why a system prompt shorter than one block is never served from the cache."""
    smaller = 1 << (max(system_tokens, 1).bit_length() - 1)  # a power of two that fits
    return (
        f"The shared system prompt is {plural(system_tokens, 'token')}, shorter than one block "
        f"of {block_size}: only full blocks are shared, so no request can hit it. A longer "
        f"--system, or --block-size {smaller}, would let the requests share it."
    )


def overrides_from(args: argparse.Namespace) -> dict[str, Any]:
    """``from_pretrained``'s overrides: the flags this parser has and the user set."""
    names = ("device", "dtype", "block_size", "total_blocks", "max_model_len")
    return {name: getattr(args, name) for name in names if getattr(args, name, None) is not None}


EXAMPLE_PROMPT = "The capital of France is"  # what --model DIR answers without --prompt


def run_text(
    step: ModuleType | str,
    args: argparse.Namespace,
    on_engine: Callable[[Any], object] | None = None,
) -> int:
    """What ``run.py --model DIR`` does: check, load, serve ``--prompt``s behind ``--system``
    (or ``--messages`` conversations), print (``--stream``: as the answers grow). A problem
    with the checkpoint or a request is one ``error:`` line on stderr and exit status 1 (a
    traceback is left for bugs).

    Reads ``args.model``, ``args.prompt``, ``args.system``, ``args.no_chat_template`` and,
    when the parser has them, ``prompt_file``, ``messages``, ``stream``, ``temperature``,
    ``top_p``, ``top_k``, ``seed``, ``device``, ``dtype``, ``block_size``, ``total_blocks``,
    ``max_new_tokens``, ``max_running``. ``on_engine``: as in ``generate_text``.
    """
    step = load_step(step) if isinstance(step, str) else step
    return report_user_errors(
        f"python -m {step.__name__}.run", lambda: _run_text(step, args, on_engine)
    )


def _run_text(
    step: ModuleType, args: argparse.Namespace, on_engine: Callable[[Any], object] | None
) -> int:
    prompts = requests_from(args)
    params = sampling_params_from(args)
    overrides = overrides_from(args)
    cfg = checkpoint_config(args.model, **overrides)
    use_template = not getattr(args, "no_chat_template", False)
    requests = prepare_requests(
        args.model, prompts, args.system, None, cfg, use_template, sampling_params=params
    )
    asked = args.prompt or getattr(args, "prompt_file", None) or getattr(args, "messages", None)
    if not asked:  # said once the checkpoint and the request are known to be sound
        print(f"no --prompt given: completing {EXAMPLE_PROMPT!r} (--prompt TEXT asks your own)")
    start = time.perf_counter()
    model = step.TinyTransformerPaged.from_pretrained(args.model, **overrides)
    print(f"{step.__name__}: {args.model} (loaded in {time.perf_counter() - start:.1f} s)")
    for line in describe(model.cfg):
        print(f"  {line}")
    if requests.chat_template is not None:
        print(f"  chat template: {requests.chat_template} (--no-chat-template: plain completion)")
    if not params.greedy:
        print(f"  sampling: {describe_sampling(params, getattr(args, 'seed', 0))}")
    serve_and_print(step, model, prompts, requests, args, on_engine)
    return 0


def serve_and_print(
    step: ModuleType,
    model: torch.nn.Module,
    prompts: list[Prompt],
    requests: TextRequests,
    args: argparse.Namespace,
    on_engine: Callable[[Any], object] | None,
) -> None:
    """Serve, and print the answers once all are done or, with ``--stream``, as they grow:
    the same lines either way."""
    max_running = getattr(args, "max_running", None) or 8
    seed = getattr(args, "seed", 0)
    if not getattr(args, "stream", False):
        result = serve(step, model, prompts, requests, max_running, on_engine, seed=seed)
        print_result(result, args.system)
        return
    print_system(args.system, requests.system_tokens)
    printer = StreamPrinter(requests.codec.decode, prompts)
    result = serve(step, model, prompts, requests, max_running, on_engine, printer, seed)
    print_summary(result, args.system)


def describe_sampling(params: SamplingParams, seed: int) -> str:
    """The banner's line about a sampled run: what is drawn from, and the seed that repeats
    it."""
    among = [f"temperature {params.temperature:g}"]
    if params.top_k:
        among.append(f"top_k {params.top_k}")
    if params.top_p < 1:
        among.append(f"top_p {params.top_p:g}")
    return f"{', '.join(among)}; seed {seed} (--seed N repeats a run, in every step)"
