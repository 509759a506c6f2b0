"""Text in, text out: a real checkpoint's tokenizer around any step's engine.

``generate_text(step, model_dir, prompts, system=...)`` tokenizes with the checkpoint's
``tokenizer.json``, serves the requests through the step's ``PagedPrefixCacheEngine``, stops
each at the checkpoint's eos and decodes. ``run.py --model DIR`` (every step) and
``python -m bench --model DIR`` use it; ``add_model_args`` adds their flags.

The prompts are plain completions: no chat template is applied (that would need a template
engine; write the model's chat markup into ``--system`` / ``--prompt`` if it wants one). The
shared system prompt is tokenized once and put in front of every request, so all requests
share its token ids exactly, and the prefix cache can serve its full blocks.

Needs ``tokenizers`` and ``safetensors`` (``pip install -e '.[real]'``).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from .checkpoint import checkpoint_dir, eos_token_ids
from .config import ModelConfig, parse_dtype
from .steps import load_step
from .weights import CheckpointError

TOKENIZER_FILE = "tokenizer.json"


def load_tokenizer(model_dir: str | Path) -> Any:
    """The checkpoint's ``tokenizer.json`` as a ``tokenizers.Tokenizer``."""
    try:
        from tokenizers import Tokenizer
    except ImportError as exc:
        raise ImportError(
            "text in/out needs the 'tokenizers' package: pip install -e '.[real]'"
        ) from exc
    path = checkpoint_dir(model_dir) / TOKENIZER_FILE
    if not path.is_file():
        raise CheckpointError(f"{path.parent} has no {TOKENIZER_FILE} (the fast-tokenizer file)")
    return Tokenizer.from_file(str(path))


def encode_prompts(
    tokenizer: Any, prompts: list[str], system: str | None = None
) -> list[list[int]]:
    """Token ids per request: ``[bos] system`` then the prompt, or ``[bos] prompt``.

    The system prompt is encoded once, with the tokenizer's special tokens (BOS), and each
    prompt without them: encoding ``system + prompt`` as one string could merge tokens across
    the seam differently per request, and the requests would no longer share a token prefix.
    """
    if not prompts:
        raise ValueError("give at least one prompt")
    if system is None:
        return [tokenizer.encode(p).ids for p in prompts]
    prefix = tokenizer.encode(system).ids
    return [prefix + tokenizer.encode(p, add_special_tokens=False).ids for p in prompts]


def truncate_at_eos(ids: list[int], eos: list[int]) -> list[int]:
    """``ids`` up to, not including, the first eos id (the engine stops at one id only)."""
    for i, token in enumerate(ids):
        if token in eos:
            return ids[:i]
    return ids


@dataclass
class TextResult:
    """What ``generate_text`` returns: the texts, their token ids and the engine's figures."""

    prompts: list[str]
    outputs: list[str]
    prompt_ids: list[list[int]]
    output_ids: list[list[int]]  # without the eos token
    stats: Any  # the engine's EngineStats after serving
    seconds: float
    cfg: ModelConfig
    eos_token_ids: list[int] = field(default_factory=list)
    system_tokens: int = 0  # the shared prefix's length in tokens (BOS included)


def generate_text(
    step: ModuleType | str,
    model_dir: str | Path,
    prompts: list[str],
    system: str | None = None,
    max_new_tokens: int = 32,
    max_running: int = 8,
    model: torch.nn.Module | None = None,
    on_engine: Callable[[Any], object] | None = None,
    **overrides: Any,
) -> TextResult:
    """Load ``model_dir`` into ``step``'s model (or use ``model``), serve ``prompts`` (behind
    the shared ``system`` prompt) through the step's engine, and decode.

    ``overrides`` go to ``from_pretrained`` (``block_size``, ``total_blocks``, ``dtype``,
    ``device``). Each request ends at the first of the checkpoint's eos ids or after
    ``max_new_tokens``. ``on_engine`` is called with the engine before it serves anything
    (``run.py --trace`` attaches a ``common.trace.RoundTracer`` there).
    """
    step = load_step(step) if isinstance(step, str) else step
    tokenizer = load_tokenizer(model_dir)
    if model is None:
        model = step.TinyTransformerPaged.from_pretrained(model_dir, **overrides)
    eos = eos_token_ids(model_dir)
    prompt_ids = encode_prompts(tokenizer, prompts, system)
    engine = step.PagedPrefixCacheEngine(model, max_running=max_running)
    if on_engine is not None:
        on_engine(engine)
    start = time.perf_counter()
    with torch.inference_mode():
        raw = engine.generate(prompt_ids, max_new_tokens, eos[0] if eos else None)
    seconds = time.perf_counter() - start
    output_ids = [truncate_at_eos(ids, eos) for ids in raw]
    outputs = [tokenizer.decode(ids, skip_special_tokens=True) for ids in output_ids]
    system_tokens = len(tokenizer.encode(system).ids) if system is not None else 0
    return TextResult(
        prompts,
        outputs,
        prompt_ids,
        output_ids,
        engine.stats,
        seconds,
        model.cfg,
        eos,
        system_tokens,
    )


# ---- the command line -----------------------------------------------------------------------


def model_dir_arg(text: str) -> str:
    """``--model``: a directory holding ``config.json`` (else exit 2 with one error line)."""
    if not (Path(text).expanduser() / "config.json").is_file():
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a checkpoint directory (no config.json in it); nothing is "
            "downloaded: give a local directory"
        )
    return text


def add_model_args(parser: argparse.ArgumentParser) -> None:
    """``--model DIR``, ``--system TEXT`` and ``--prompt TEXT`` (repeatable)."""
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
    """The answers, then the prefix cache's figures."""
    s = result.stats
    if system is not None:
        print(f"system prompt: {system!r} ({result.system_tokens} tokens, shared by every request)")
    for i, (prompt, output, ids) in enumerate(
        zip(result.prompts, result.outputs, result.output_ids)
    ):
        print(f"\n[{i + 1}] {prompt}")
        print(f"  -> {output}  ({len(ids)} tokens)")
    new_tokens = sum(len(ids) for ids in result.output_ids)
    print(
        f"\nprefix cache: {s.requests_hit}/{s.requests} requests hit, "
        f"{s.cached_tokens}/{s.prompt_tokens} prompt tokens ({s.token_hit_rate:.0%}) from the "
        f"cache; {new_tokens} new tokens in {result.seconds:.2f} s"
    )


def run_text(
    step: ModuleType | str,
    args: argparse.Namespace,
    on_engine: Callable[[Any], object] | None = None,
) -> int:
    """What ``run.py --model DIR`` does: load, serve ``--prompt``s behind ``--system``, print.

    Reads ``args.model``, ``args.prompt``, ``args.system`` and, when the parser has them,
    ``device``, ``dtype``, ``block_size``, ``total_blocks``, ``max_new_tokens``, ``max_running``.
    ``on_engine``: as in ``generate_text``.
    """
    prompts = args.prompt or ["The capital of France is"]
    overrides: dict[str, Any] = {}
    for name in ("device", "block_size", "total_blocks"):
        if getattr(args, name, None) is not None:
            overrides[name] = getattr(args, name)
    if getattr(args, "dtype", None) is not None:
        overrides["dtype"] = parse_dtype(args.dtype)
    step = load_step(step) if isinstance(step, str) else step
    start = time.perf_counter()
    model = step.TinyTransformerPaged.from_pretrained(args.model, **overrides)
    print(f"{step.__name__}: {args.model} (loaded in {time.perf_counter() - start:.1f} s)")
    for line in describe(model.cfg):
        print(f"  {line}")
    result = generate_text(
        step,
        args.model,
        prompts,
        system=args.system,
        max_new_tokens=getattr(args, "max_new_tokens", None) or 32,
        max_running=getattr(args, "max_running", None) or 8,
        model=model,
        on_engine=on_engine,
    )
    print_result(result, args.system)
    return 0
