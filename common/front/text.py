"""Text in, text out: a real checkpoint's tokenizer around any step's engine.

``generate_text(step, model_dir, prompts, system=...)`` tokenizes with the checkpoint's
``tokenizer.json``, serves the requests through the step's ``PagedPrefixCacheEngine``, stops
each at the first of the checkpoint's eos ids and decodes. ``run.py --model DIR`` (every step)
uses it through ``run_text``; ``add_model_args`` adds its flags.

When the checkpoint carries a chat template (``common/front/chat.py``), the shared ``system`` prompt
and each prompt become chat messages in the model's own markup, ending with the header of the
assistant's turn; otherwise (or with ``chat_template=False``, ``--no-chat-template``) a prompt
is a plain completion behind the system prompt. Either way every request starts with the same
token ids for the shared part, so the prefix cache serves its full blocks.

Everything that can be checked without the weights is checked before they are read (the
config, the weight files, the tokenizer, the template, every request against the KV pool): a
mistake costs a second, not the minutes a large model takes to load.

Needs ``tokenizers`` and ``safetensors`` (``pip install -e '.[real]'``), and ``jinja2`` for
a chat template.
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

from ..checkpoint import check_stored_shapes, checkpoint_config, checkpoint_dir, eos_token_ids
from ..config import ModelConfig
from ..errors import CheckpointError, MissingPackageError, RequestError, report_user_errors
from ..inputs import (
    as_eos_ids,
    blocks_for_request,
    check_context_length,
    check_request,
    is_int,
)
from .chat import ChatTemplate, load_chat_template, messages_for
from .cli import plural, positive_int
from .steps import load_step

TOKENIZER_FILE = "tokenizer.json"
# The fields of a config that say which network it is; the others size the KV pool or choose
# where it runs, and may differ between a loaded model and its checkpoint's config.json.
NETWORK_FIELDS = ("vocab_size", "d_model", "num_heads", "num_kv_heads", "num_layers", "d_ff")


def load_tokenizer(model_dir: str | Path) -> Any:
    """The checkpoint's ``tokenizer.json`` as a ``tokenizers.Tokenizer``."""
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise MissingPackageError(
            "text in/out needs the 'tokenizers' package: pip install -e '.[real]'"
        ) from None
    path = checkpoint_dir(model_dir) / TOKENIZER_FILE
    if not path.is_file():
        raise CheckpointError(
            f"{path.parent} has no {TOKENIZER_FILE} (the fast-tokenizer file) to turn text into "
            "token ids; copy it from where the checkpoint came from"
        )
    try:
        return Tokenizer.from_file(str(path))
    except Exception as exc:  # the Rust library raises its own exception type
        raise CheckpointError(f"{path} cannot be read as a tokenizer: {exc}") from None


def encode_prompts(
    tokenizer: Any, prompts: list[str], system: str | None = None
) -> list[list[int]]:
    """Token ids per request, plain completion: ``[bos] system`` then the prompt, or
    ``[bos] prompt``.

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


def encode_chat(
    tokenizer: Any, template: ChatTemplate, prompts: list[str], system: str | None = None
) -> list[list[int]]:
    """Token ids per request, as chat: ``system`` and the prompt as messages in the model's
    markup, ending with the assistant's header; the ids ``apply_chat_template`` gives.

    Each conversation is tokenized whole, exactly as transformers does. The requests still
    share the tokens of the system part: the template writes it the same way every time, and
    its text ends at the template's own markup before each user's text begins.
    """
    if not prompts:
        raise ValueError("give at least one prompt")
    texts = [template.render(messages_for(p, system)) for p in prompts]
    return [tokenizer.encode(text, add_special_tokens=False).ids for text in texts]


def common_prefix_len(sequences: list[list[int]]) -> int:
    """How many leading ids all ``sequences`` share."""
    shortest = min(sequences, key=len)
    for i, token in enumerate(shortest):
        if any(seq[i] != token for seq in sequences):
            return i
    return len(shortest)


def strip_eos(ids: list[int], eos: frozenset[int]) -> list[int]:
    """``ids`` without the eos that ended them (the engine stops at the first eos it makes,
    so an eos can only be the last id)."""
    return ids[:-1] if ids and ids[-1] in eos else ids


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
    system_tokens: int = 0  # the shared prefix's length in tokens (BOS, chat markup included)
    chat_template: str | None = None  # where the applied chat template came from, or None


@dataclass
class TextRequests:
    """Requests ready to serve, checked without reading a single weight."""

    tokenizer: Any
    prompt_ids: list[list[int]]
    eos: list[int]
    system_tokens: int
    chat_template: str | None


def check_prompt_list(prompts: object) -> list[str]:
    """``prompts`` as a list of strings; one bare string is refused (it would otherwise be
    served as one request per character)."""
    if isinstance(prompts, str):
        raise ValueError(
            f"prompts must be a list of strings, got one str ({prompts[:40]!r}); "
            f"for one prompt write [{prompts[:40]!r}]"
        )
    prompts = list(prompts)  # type: ignore[call-overload]
    bad = [type(p).__name__ for p in prompts if not isinstance(p, str)]
    if bad:
        raise ValueError(f"prompts must be strings, got a {bad[0]}")
    if not prompts:
        raise ValueError("give at least one prompt")
    return prompts


def prepare_requests(
    model_dir: str | Path,
    prompts: list[str],
    system: str | None,
    max_new_tokens: int,
    cfg: ModelConfig,
    chat_template: bool = True,
    eos_token_id: object = None,
) -> TextRequests:
    """Tokenize and check every request against ``cfg`` (its vocabulary and KV pool): the
    slow part (loading the weights) starts only when all of this passed."""
    folder = checkpoint_dir(model_dir)
    tokenizer = load_tokenizer(folder)
    template = load_chat_template(folder) if chat_template else None
    if template is None:
        prompt_ids = encode_prompts(tokenizer, prompts, system)
        shared = len(tokenizer.encode(system).ids) if system is not None else 0
    else:
        prompt_ids = encode_chat(tokenizer, template, prompts, system)
        shared = chat_system_tokens(tokenizer, template, system, prompt_ids)
    eos = (
        eos_token_ids(folder)
        if eos_token_id is None
        else sorted(as_eos_ids(eos_token_id, cfg.vocab_size))
    )
    check_text_requests(prompts, prompt_ids, max_new_tokens, eos, cfg)
    check_stored_shapes(folder, cfg)  # the weight files' headers only: milliseconds
    source = template.source if template is not None else None
    return TextRequests(tokenizer, prompt_ids, eos, shared, source)


def chat_system_tokens(
    tokenizer: Any, template: ChatTemplate, system: str | None, prompt_ids: list[list[int]]
) -> int:
    """The tokens every request shares because of ``system``: those of the system message in
    the template's markup that every request begins with (0 without a system prompt)."""
    if system is None:
        return 0
    alone = template.render([{"role": "system", "content": system}], add_generation_prompt=False)
    system_ids = tokenizer.encode(alone, add_special_tokens=False).ids
    return common_prefix_len([system_ids, *prompt_ids])


def check_text_requests(
    prompts: list[str],
    prompt_ids: list[list[int]],
    max_new_tokens: int,
    eos: list[int],
    cfg: ModelConfig,
) -> None:
    """Every request must be servable by a model of ``cfg``, or a ``RequestError`` (a
    ``CheckpointError`` when the tokenizer and the model disagree) says which and why."""
    if not is_int(max_new_tokens) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
    for i, (prompt, ids) in enumerate(zip(prompts, prompt_ids)):
        which = f"prompt {i + 1} ({_short(prompt)})"
        if not ids:
            raise RequestError(
                f"{which} is empty once tokenized (this tokenizer adds no BOS token): "
                "give it some text"
            )
        outside = [t for t in ids if not 0 <= t < cfg.vocab_size]
        if outside:
            raise CheckpointError(
                f"{which}: the tokenizer gives ids {outside[:5]} that the model's vocabulary "
                f"(vocab_size={cfg.vocab_size}) lacks: tokenizer.json does not belong to this "
                "checkpoint"
            )
        # The context length first: past it, no pool size would help.
        check_context_length(len(ids), int(max_new_tokens), cfg)
        need = blocks_for_request(len(ids), int(max_new_tokens), cfg.block_size)
        if need > cfg.total_blocks:
            raise RequestError(
                f"{which} is {len(ids)} tokens; with {max_new_tokens} new tokens it needs "
                f"{need} KV blocks of {cfg.block_size} tokens, and the pool has "
                f"{cfg.total_blocks}: raise --total-blocks (total_blocks=) to at least {need}, "
                "or lower --max-new-tokens"
            )
        check_request(ids, max_new_tokens, eos, cfg)  # whatever else the engine would refuse


def _short(text: str, limit: int = 30) -> str:
    return repr(text if len(text) <= limit else text[:limit] + "...")


def model_config_for(
    model_dir: str | Path, model: torch.nn.Module | None, overrides: dict[str, Any]
) -> ModelConfig:
    """The config the requests are checked against: the given model's, or the checkpoint's
    with ``overrides``. Both at once is refused: the model is built, the overrides would be
    ignored."""
    if model is None:
        return checkpoint_config(model_dir, **overrides)
    if overrides:
        given = ", ".join(f"{k}={v!r}" for k, v in overrides.items())
        raise ValueError(
            f"model= is already built, so {given} would be ignored: pass {given} to "
            "from_pretrained, or leave model= out"
        )
    on_disk = checkpoint_config(model_dir)
    differ = [f for f in NETWORK_FIELDS if getattr(on_disk, f) != getattr(model.cfg, f)]
    if differ:
        raise ValueError(
            f"model= does not match {model_dir}: {differ[0]} is "
            f"{getattr(model.cfg, differ[0])} in the model, {getattr(on_disk, differ[0])} in "
            "the checkpoint"
        )
    return model.cfg


def generate_text(
    step: ModuleType | str,
    model_dir: str | Path,
    prompts: list[str],
    system: str | None = None,
    max_new_tokens: int = 32,
    max_running: int = 8,
    model: torch.nn.Module | None = None,
    eos_token_id: object = None,
    chat_template: bool = True,
    on_engine: Callable[[Any], object] | None = None,
    threads: int | None = 1,
    **overrides: Any,
) -> TextResult:
    """Load ``model_dir`` into ``step``'s model (or use ``model``, loaded from it), serve
    ``prompts`` (behind the shared ``system`` prompt) through the step's engine, and decode.

    ``overrides`` go to ``from_pretrained`` (``block_size``, ``total_blocks``, ``dtype``,
    ``device``); with ``model`` they are refused. Each request ends at the first of the eos
    ids or after ``max_new_tokens``: ``eos_token_id`` None takes the checkpoint's (all of
    them, when it lists several), an id or a collection of ids replaces them, ``()`` means
    none. ``chat_template=False`` serves plain completions even when the checkpoint has a
    chat template. ``on_engine`` is called with the engine before it serves anything
    (``run.py --trace`` attaches a ``common.front.trace.RoundTracer`` there).

    ``threads``: torch's CPU threads, set (for the whole process) before serving, as the
    command lines do: one by default, since on a machine that other programs share two threads
    wait for each other at every small matmul (50x slower was measured). None leaves torch's
    setting alone; on an idle machine more threads speed up a big model.
    """
    if threads is not None:
        torch.set_num_threads(threads)
    prompts = check_prompt_list(prompts)
    step = load_step(step) if isinstance(step, str) else step
    cfg = model_config_for(model_dir, model, overrides)
    requests = prepare_requests(
        model_dir, prompts, system, max_new_tokens, cfg, chat_template, eos_token_id
    )
    if model is None:
        model = step.TinyTransformerPaged.from_pretrained(model_dir, **overrides)
    return serve(step, model, prompts, requests, max_new_tokens, max_running, on_engine)


def serve(
    step: ModuleType,
    model: torch.nn.Module,
    prompts: list[str],
    requests: TextRequests,
    max_new_tokens: int,
    max_running: int,
    on_engine: Callable[[Any], object] | None = None,
) -> TextResult:
    """The checked requests through ``step``'s engine, decoded."""
    engine = step.PagedPrefixCacheEngine(model, max_running=max_running)
    if on_engine is not None:
        on_engine(engine)
    eos = frozenset(requests.eos)
    start = time.perf_counter()
    with torch.inference_mode():
        raw = engine.generate(requests.prompt_ids, max_new_tokens, eos or None)
    seconds = time.perf_counter() - start
    output_ids = [strip_eos(ids, eos) for ids in raw]
    outputs = [requests.tokenizer.decode(ids, skip_special_tokens=True) for ids in output_ids]
    return TextResult(
        prompts,
        outputs,
        requests.prompt_ids,
        output_ids,
        engine.stats,
        seconds,
        model.cfg,
        list(requests.eos),
        requests.system_tokens,
        requests.chat_template,
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
    """``--model DIR``, ``--system TEXT``, ``--prompt TEXT`` (repeatable) and
    ``--no-chat-template``."""
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
        "--max-model-len",
        type=positive_int,
        metavar="N",
        help="with --model: the longest request, prompt + --max-new-tokens; None: the "
        "checkpoint's max_position_embeddings. More is allowed, at your own risk: the model "
        "never saw those positions",
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
    """The answers, then the prefix cache's figures (and why nothing could hit, when the
    shared system prompt is shorter than one block)."""
    s = result.stats
    if system is not None:
        print(
            f"system prompt: {system!r} ({plural(result.system_tokens, 'token')}, shared by "
            "every request)"
        )
    for i, (prompt, output, ids) in enumerate(
        zip(result.prompts, result.outputs, result.output_ids)
    ):
        print(f"\n[{i + 1}] {prompt}")
        print(f"  -> {output}  ({plural(len(ids), 'token')})")
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
    """What ``run.py --model DIR`` does: check, load, serve ``--prompt``s behind ``--system``,
    print. A problem with the checkpoint or a request is one ``error:`` line on stderr and
    exit status 1 (a traceback is left for bugs).

    Reads ``args.model``, ``args.prompt``, ``args.system``, ``args.no_chat_template`` and,
    when the parser has them, ``device``, ``dtype``, ``block_size``, ``total_blocks``,
    ``max_new_tokens``, ``max_running``. ``on_engine``: as in ``generate_text``.
    """
    step = load_step(step) if isinstance(step, str) else step
    return report_user_errors(
        f"python -m {step.__name__}.run", lambda: _run_text(step, args, on_engine)
    )


def _run_text(
    step: ModuleType, args: argparse.Namespace, on_engine: Callable[[Any], object] | None
) -> int:
    prompts = args.prompt or [EXAMPLE_PROMPT]
    max_new_tokens = getattr(args, "max_new_tokens", None) or 32
    overrides = overrides_from(args)
    cfg = checkpoint_config(args.model, **overrides)
    use_template = not getattr(args, "no_chat_template", False)
    requests = prepare_requests(args.model, prompts, args.system, max_new_tokens, cfg, use_template)
    if not args.prompt:  # said once the checkpoint and the request are known to be sound
        print(f"no --prompt given: completing {EXAMPLE_PROMPT!r} (--prompt TEXT asks your own)")
    start = time.perf_counter()
    model = step.TinyTransformerPaged.from_pretrained(args.model, **overrides)
    print(f"{step.__name__}: {args.model} (loaded in {time.perf_counter() - start:.1f} s)")
    for line in describe(model.cfg):
        print(f"  {line}")
    if requests.chat_template is not None:
        print(f"  chat template: {requests.chat_template} (--no-chat-template: plain completion)")
    max_running = getattr(args, "max_running", None) or 8
    result = serve(step, model, prompts, requests, max_new_tokens, max_running, on_engine)
    print_result(result, args.system)
    return 0
