"""Text in, text out: a real checkpoint's tokenizer around any step's engine.

``generate_text(step, model_dir, prompts, system=...)`` tokenizes with the checkpoint's
``tokenizer.json``, serves the requests through the step's ``PagedPrefixCacheEngine``, stops
each at the first of the checkpoint's eos ids and decodes. ``run.py --model DIR`` (every step)
uses its parts through ``text_cli.py``, the command line's flags and printing.

When the checkpoint carries a chat template (``common/front/chat.py``), the shared ``system`` prompt
and each prompt become chat messages in the model's own markup, ending with the header of the
assistant's turn; otherwise (or with ``chat_template=False``, ``--no-chat-template``) a prompt
is a plain completion behind the system prompt. Either way every request starts with the same
token ids for the shared part, so the prefix cache serves its full blocks. A prompt may also be
a whole conversation, a list of chat messages (``--messages FILE``), multi-turn.

Each request is decoded as ``SamplingParams`` say (greedy unless ``--temperature`` > 0; vLLM's
names), and the engine is driven round by round (``add_request``, then ``step()``): each
round's ``RequestOutput``s say which tokens came and why a request ended, and ``--stream``
prints the text as it grows (``common/front/stream.py``).

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
from ..errors import CheckpointError, MissingPackageError, RequestError
from ..inputs import as_eos_ids, blocks_for_request, check_context_length, check_request
from ..numbers import is_int
from ..sampling import RequestOutput, SamplingParams
from .chat import ChatTemplate, Prompt, check_messages, load_chat_template, messages_for
from .cli import plural
from .steps import load_step
from .stream import Decode, answer_ids, text_decoder

TOKENIZER_FILE = "tokenizer.json"
DEFAULT_MAX_NEW_TOKENS = 32  # generate_text's, when neither max_new_tokens nor sampling_params
OnOutput = Callable[[int, RequestOutput], object]  # (the prompt's index, what a round made)
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


class TextCodec:
    """A checkpoint's text side, loaded once: its tokenizer, its chat template (None when it has
    none, or it is not wanted) and the ids that end an answer (``eos_token_ids``).

    ``encode`` turns one request, a text prompt or a conversation, into the token ids the engine
    takes; ``decode`` turns an answer's ids back into text. ``generate_text`` encodes every
    prompt with one; a server loads one at start and encodes each request as it comes.
    """

    def __init__(
        self, tokenizer: Any, template: ChatTemplate | None, eos_token_ids: list[int]
    ) -> None:
        self.tokenizer = tokenizer
        self.template = template
        self.eos_token_ids = eos_token_ids
        self.decode: Decode = text_decoder(tokenizer)

    @classmethod
    def load(cls, model_dir: str | Path, chat_template: bool = True) -> TextCodec:
        """The tokenizer, the chat template (unless ``chat_template`` is False) and the eos ids
        of the checkpoint in ``model_dir``."""
        folder = checkpoint_dir(model_dir)
        template = load_chat_template(folder) if chat_template else None
        return cls(load_tokenizer(folder), template, eos_token_ids(folder))

    def encode(self, prompt: Prompt, system: str | None = None) -> list[int]:
        """One request as token ids: a conversation in the chat template; a text prompt in the
        chat template too when there is one (behind ``system``, as a system message), else as
        a plain completion (``completion_ids``)."""
        if isinstance(prompt, list):
            if system is not None:
                raise RequestError(
                    "system= is for text prompts: a conversation carries its own system message",
                    "system",
                )
            return self.chat_ids(prompt)
        if self.template is not None:
            return self.chat_ids(messages_for(prompt, system))
        return self.completion_ids(prompt, system)

    def completion_ids(self, text: str, system: str | None = None) -> list[int]:
        """A plain completion: ``[bos] system`` then ``text``, or ``[bos] text``.

        The system prompt is encoded on its own, with the tokenizer's special tokens (BOS), and
        the text without them: encoding ``system + text`` as one string could merge tokens
        across the seam differently per request, and the requests would no longer share a
        token prefix.
        """
        if system is None:
            return self.tokenizer.encode(text).ids
        tail = self.tokenizer.encode(text, add_special_tokens=False).ids
        return self.tokenizer.encode(system).ids + tail

    def chat_ids(self, messages: list[dict[str, str]]) -> list[int]:
        """A conversation in the checkpoint's chat markup, ending with the assistant's header:
        the ids transformers' ``apply_chat_template(..., add_generation_prompt=True)`` gives.

        Each conversation is tokenized whole, exactly as transformers does. Requests still
        share the tokens of a common system part: the template writes it the same way every
        time, and its text ends at the template's own markup before each user's text begins.
        """
        if self.template is None:
            raise RequestError(
                "a conversation is written in the checkpoint's chat template, and none is loaded",
                "messages",
            )
        text = self.template.render(check_messages(messages))
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def system_tokens(self, system: str | None, prompt_ids: list[list[int]]) -> int:
        """The tokens every request shares because of ``system``: the system prompt (BOS
        included), or the system message in the template's markup that every request begins
        with; 0 without a system prompt."""
        if system is None:
            return 0
        if self.template is None:
            return len(self.tokenizer.encode(system).ids)
        message = [{"role": "system", "content": system}]
        alone = self.template.render(message, add_generation_prompt=False)
        system_ids = self.tokenizer.encode(alone, add_special_tokens=False).ids
        return common_prefix_len([system_ids, *prompt_ids])


def common_prefix_len(sequences: list[list[int]]) -> int:
    """How many leading ids all ``sequences`` share."""
    shortest = min(sequences, key=len)
    for i, token in enumerate(shortest):
        if any(seq[i] != token for seq in sequences):
            return i
    return len(shortest)


@dataclass
class TextResult:
    """What ``generate_text`` returns: the texts, their token ids and the engine's figures."""

    prompts: list[Prompt]
    outputs: list[str]
    prompt_ids: list[list[int]]
    output_ids: list[list[int]]  # without the eos (or stop) token that ended them
    stats: Any  # the engine's EngineStats after serving
    seconds: float
    cfg: ModelConfig
    eos_token_ids: list[int] = field(default_factory=list)
    system_tokens: int = 0  # the shared prefix's length in tokens (BOS, chat markup included)
    chat_template: str | None = None  # where the applied chat template came from, or None
    # why each request ended: "stop" (an eos or stop id) or "length" (max tokens reached)
    finish_reasons: list[str] = field(default_factory=list)


@dataclass
class TextRequests:
    """Requests ready to serve, checked without reading a single weight."""

    codec: TextCodec
    prompt_ids: list[list[int]]
    eos: list[int]
    system_tokens: int
    chat_template: str | None
    sampling_params: list[SamplingParams]  # one per request


def check_prompt_list(prompts: object) -> list[Prompt]:
    """``prompts`` as a list of strings or conversations (lists of chat messages); one bare
    string is refused (it would otherwise be served as one request per character)."""
    if isinstance(prompts, str):
        raise ValueError(
            f"prompts must be a list of strings, got one str ({prompts[:40]!r}); "
            f"for one prompt write [{prompts[:40]!r}]"
        )
    prompts = list(prompts)  # type: ignore[call-overload]
    bad = [type(p).__name__ for p in prompts if not isinstance(p, (str, list))]
    if bad:
        raise ValueError(
            f"prompts must be strings (or conversations: lists of chat messages), got a {bad[0]}"
        )
    if not prompts:
        raise ValueError("give at least one prompt")
    for i, prompt in enumerate(prompts):
        if isinstance(prompt, list):
            try:
                check_messages(prompt)
            except ValueError as exc:
                raise ValueError(f"prompt {i + 1}: {exc}") from None
    return prompts


def sampling_params_for(
    num_prompts: int,
    max_new_tokens: object = None,
    sampling_params: SamplingParams | list[SamplingParams] | None = None,
) -> list[SamplingParams]:
    """One ``SamplingParams`` per request: ``sampling_params`` (one for all, or a list with one
    per prompt), or greedy decoding of ``max_new_tokens`` (None: 32) tokens; not both, since
    ``max_new_tokens`` and ``sampling_params.max_tokens`` could disagree (the engine's rule)."""
    if sampling_params is None:
        n = DEFAULT_MAX_NEW_TOKENS if max_new_tokens is None else max_new_tokens
        if not is_int(n) or n < 1:
            raise ValueError(f"max_new_tokens must be an integer >= 1, got {n!r}")
        return [SamplingParams(max_tokens=int(n))] * num_prompts
    if max_new_tokens is not None:
        raise ValueError(
            "give max_new_tokens or sampling_params (its max_tokens), not both: "
            f"got max_new_tokens={max_new_tokens!r}"
        )
    given = sampling_params if isinstance(sampling_params, list) else [sampling_params]
    bad = [type(p).__name__ for p in given if not isinstance(p, SamplingParams)]
    if bad:
        raise ValueError(f"sampling_params must be SamplingParams, got a {bad[0]}")
    if len(given) == 1:
        return given * num_prompts
    if len(given) != num_prompts:
        raise ValueError(
            f"{len(given)} sampling_params for {num_prompts} prompts: give one for all, or one "
            "per prompt"
        )
    return given


def prepare_requests(
    model_dir: str | Path,
    prompts: list[Prompt],
    system: str | None,
    max_new_tokens: int | None,
    cfg: ModelConfig,
    chat_template: bool = True,
    eos_token_id: object = None,
    sampling_params: SamplingParams | list[SamplingParams] | None = None,
) -> TextRequests:
    """Tokenize and check every request against ``cfg`` (its vocabulary and KV pool): the
    slow part (loading the weights) starts only when all of this passed. A conversation
    among ``prompts`` needs the checkpoint's chat template, and brings its own system message
    (``system`` is refused with one)."""
    params = sampling_params_for(len(prompts), max_new_tokens, sampling_params)
    folder = checkpoint_dir(model_dir)
    codec = TextCodec.load(folder, chat_template)
    check_conversations(prompts, system, codec.template, chat_template, folder)
    prompt_ids = [codec.encode(prompt, system) for prompt in prompts]
    eos = (
        codec.eos_token_ids
        if eos_token_id is None
        else sorted(as_eos_ids(eos_token_id, cfg.vocab_size))
    )
    check_text_requests(prompts, prompt_ids, params, eos, cfg)
    check_stored_shapes(folder, cfg)  # the weight files' headers only: milliseconds
    source = codec.template.source if codec.template is not None else None
    shared = codec.system_tokens(system, prompt_ids)
    return TextRequests(codec, prompt_ids, eos, shared, source, params)


def check_conversations(
    prompts: list[Prompt],
    system: str | None,
    template: ChatTemplate | None,
    chat_template: bool,
    folder: Path,
) -> None:
    """A conversation is written in the checkpoint's chat markup, so it needs the template,
    and it has its own system message, if any, so ``system`` would be a second one."""
    if all(isinstance(p, str) for p in prompts):
        return
    if system is not None:
        raise ValueError(
            "system= is for text prompts: a conversation carries its own system message"
        )
    if template is None:
        why = "chat_template=False was given" if not chat_template else f"{folder} has none"
        raise RequestError(
            f"a conversation (--messages) is written in the checkpoint's chat template, and {why}"
        )


def check_text_requests(
    prompts: list[Prompt],
    prompt_ids: list[list[int]],
    sampling_params: list[SamplingParams],
    eos: list[int],
    cfg: ModelConfig,
) -> None:
    """Every request must be servable by a model of ``cfg``, or a ``RequestError`` (a
    ``CheckpointError`` when the tokenizer and the model disagree) says which and why."""
    for i, (prompt, ids, params) in enumerate(zip(prompts, prompt_ids, sampling_params)):
        which = f"prompt {i + 1} ({_short(prompt)})"
        max_new_tokens = params.max_tokens
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
        check_request(ids, None, eos, cfg, params)  # whatever else the engine would refuse


def _short(prompt: Prompt, limit: int = 30) -> str:
    if not isinstance(prompt, str):  # a conversation: its last message says which
        return f"{plural(len(prompt), 'message')}, the last {_short(prompt[-1]['content'])}"
    return repr(prompt if len(prompt) <= limit else prompt[:limit] + "...")


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
    prompts: list[Prompt],
    system: str | None = None,
    max_new_tokens: int | None = None,
    max_running: int = 8,
    model: torch.nn.Module | None = None,
    eos_token_id: object = None,
    chat_template: bool = True,
    on_engine: Callable[[Any], object] | None = None,
    threads: int | None = 1,
    *,
    sampling_params: SamplingParams | list[SamplingParams] | None = None,
    seed: int = 0,
    on_output: OnOutput | None = None,
    **overrides: Any,
) -> TextResult:
    """Load ``model_dir`` into ``step``'s model (or use ``model``, loaded from it), serve
    ``prompts`` (behind the shared ``system`` prompt) through the step's engine, and decode.

    A prompt is a string, or a conversation: a list of chat messages (``{"role": ...,
    "content": ...}``) ending with the turn the model answers, written in the checkpoint's chat
    template (it needs one, and brings its own system message: no ``system`` with it).

    ``overrides`` go to ``from_pretrained`` (``block_size``, ``total_blocks``, ``dtype``,
    ``device``); with ``model`` they are refused. Each request ends at the first of the eos
    ids or after its max tokens: ``eos_token_id`` None takes the checkpoint's (all of
    them, when it lists several), an id or a collection of ids replaces them, ``()`` means
    none. ``chat_template=False`` serves plain completions even when the checkpoint has a
    chat template. ``on_engine`` is called with the engine before it serves anything
    (``run.py --trace`` attaches a ``common.front.trace.RoundTracer`` there).

    Decoding: greedy ``max_new_tokens`` tokens (None: 32), or as ``sampling_params`` say (one
    ``SamplingParams`` for every prompt, or a list with one per prompt; not both). ``seed`` is
    the engine's: a request whose ``SamplingParams`` has no seed of its own gets one from it,
    so a sampled run is repeatable, and the same in every step. ``on_output(index, output)``
    is called with each ``RequestOutput`` of each round as it comes (``index``: the prompt's
    place in ``prompts``): ``common.front.stream.StreamPrinter`` streams the text from there.

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
        model_dir,
        prompts,
        system,
        max_new_tokens,
        cfg,
        chat_template,
        eos_token_id,
        sampling_params,
    )
    if model is None:
        model = step.TinyTransformerPaged.from_pretrained(model_dir, **overrides)
    return serve(step, model, prompts, requests, max_running, on_engine, on_output, seed)


def serve(
    step: ModuleType,
    model: torch.nn.Module,
    prompts: list[Prompt],
    requests: TextRequests,
    max_running: int,
    on_engine: Callable[[Any], object] | None = None,
    on_output: OnOutput | None = None,
    seed: int = 0,
) -> TextResult:
    """The checked requests through ``step``'s engine, round by round, decoded.

    The engine is driven as a server drives it: every request queued with ``add_request``,
    then ``step()`` until no work is left; each round's ``RequestOutput``s go to ``on_output``
    as they come, and the last one of each request (``finished``) says why it ended.
    """
    engine = step.PagedPrefixCacheEngine(model, max_running=max_running, seed=seed)
    if on_engine is not None:
        on_engine(engine)
    eos = frozenset(requests.eos) or None
    last: dict[int, RequestOutput] = {}  # each request's latest output, by prompt index
    start = time.perf_counter()
    with torch.inference_mode():
        index = {
            engine.add_request(ids, None, eos, sampling_params=params): i
            for i, (ids, params) in enumerate(zip(requests.prompt_ids, requests.sampling_params))
        }
        while engine.has_work:
            for output in engine.step():
                last[index[output.request_id]] = output
                if on_output is not None:
                    on_output(index[output.request_id], output)
    seconds = time.perf_counter() - start
    finals = [last[i] for i in range(len(prompts))]
    output_ids = [answer_ids(output) for output in finals]
    return TextResult(
        prompts,
        [requests.codec.decode(ids) for ids in output_ids],
        requests.prompt_ids,
        output_ids,
        engine.stats,
        seconds,
        model.cfg,
        list(requests.eos),
        requests.system_tokens,
        requests.chat_template,
        [str(output.finish_reason) for output in finals],
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
