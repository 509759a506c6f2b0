"""Text in, text out: a real checkpoint's tokenizer around any step's engine.

``TextCodec`` is the checkpoint's text side, loaded once: it turns a prompt (written in the
checkpoint's chat template when it has one, ``chat.py``) or a whole conversation into token
ids, and an answer's ids back into text. ``generate_text(step, model_dir, prompts,
TextOptions(...))`` serves the prompts through the step's engine, round by round as a server
drives it, and decodes; ``run.py --model DIR`` (``text_cli.py``) does the same from its flags.

Requests behind one system prompt begin with the same token ids, so the prefix cache serves its
full blocks. Everything that can be checked without the weights is checked before they are
read (the config, the tokenizer, the template, every request against the context and the KV
pool, the weights' names and shapes): a mistake costs a second, not the minutes a large model
takes to load.

Needs ``tokenizers`` and ``safetensors`` (``pip install -e '.[real]'``), and ``jinja2`` for a
chat template.
"""

from __future__ import annotations

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
from ..inputs import Request, as_eos_ids, check_request, sampling_params_per_prompt
from ..sampling import RequestOutput, SamplingParams
from .chat import ChatTemplate, Prompt, check_messages, load_chat_template, messages_for
from .cli import EngineOptions, plural
from .steps import load_step
from .stream import Decode, answer_ids, shorten, text_decoder

TOKENIZER_FILE = "tokenizer.json"
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
                "a conversation (--messages) is written in the checkpoint's chat template, and "
                "none is loaded: the checkpoint has none, or chat_template=False was given",
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


@dataclass(frozen=True)
class TextOptions:
    """What ``generate_text`` takes besides the prompts (and what ``run.py --model DIR``'s flags
    give): how each prompt becomes a request, how it is decoded, and the engine that serves it.

    ``system``: a system prompt every text prompt shares (a conversation brings its own).
    ``max_new_tokens`` decodes greedily (None, and no ``sampling_params``: 16, vLLM's default);
    ``sampling_params`` decodes as it says, one for every prompt or a list with one per prompt;
    not both, since they could disagree. ``eos_token_id``: None stops at the checkpoint's eos
    ids, an id or a collection of ids replaces them, ``()`` means none.
    ``chat_template=False`` serves plain completions even when the checkpoint has a template.
    ``engine``: where the model runs, its KV pool, the running set, the seed that requests
    without their own draw from, and torch's CPU threads: one by default, since on a machine
    that other programs share two threads wait for each other at every small matmul (50x
    slower was measured); 0 leaves torch's own setting.
    """

    system: str | None = None
    max_new_tokens: int | None = None
    sampling_params: SamplingParams | list[SamplingParams] | None = None
    eos_token_id: object = None
    chat_template: bool = True
    engine: EngineOptions = field(default_factory=EngineOptions)


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
    # Why the text the prompts share came from no cache: shorter than a block (``cache_note``).
    cache_note: str | None = None


@dataclass(frozen=True)
class TextRequests:
    """Requests ready to serve, checked without reading a single weight."""

    folder: Path  # the checkpoint
    cfg: ModelConfig  # what the model will be built with
    codec: TextCodec
    prompts: list[Prompt]
    requests: list[Request]  # one per prompt, as the engine takes it
    eos_token_ids: list[int]
    system_tokens: int


def generate_text(
    step: ModuleType | str,
    model_dir: str | Path,
    prompts: list[Prompt],
    options: TextOptions | None = None,
    *,
    model: torch.nn.Module | None = None,
    on_engine: Callable[[Any], object] | None = None,
    on_output: OnOutput | None = None,
) -> TextResult:
    """Serve ``prompts`` through ``step``'s engine (a step package, or its name) with the
    weights of ``model_dir``, and decode: text in, text out.

    Args:
        prompts: strings, or conversations: lists of chat messages (``{"role": ...,
            "content": ...}``) ending with the turn the model answers, written in the
            checkpoint's chat template (it needs one). One bare string is refused.
        options: ``TextOptions``: the system prompt, greedy or sampled decoding, the eos ids,
            the chat template, the engine.
        model: the checkpoint already loaded (``from_pretrained``), to reuse its weights; an
            engine option that would build another model is then refused, not ignored.
        on_engine: called with the engine before it serves anything (``run.py --trace``
            attaches a ``common.front.trace.RoundTracer`` there).
        on_output: called as ``on_output(index, output)`` with each ``RequestOutput`` of each
            round as it comes (``index``: the prompt's place in ``prompts``);
            ``common.front.stream.StreamPrinter`` streams the text from there.

    Returns:
        A ``TextResult``. Everything but the weights is checked before they load: a
        ``RequestError`` or ``CheckpointError`` (both ``ValueError``) says what is wrong.
    """
    options = options or TextOptions()
    options.engine.set_threads()
    requests = prepare_requests(model_dir, prompts, options, model)
    step = load_step(step) if isinstance(step, str) else step
    if model is None:
        model = step.TinyTransformerPaged.from_pretrained(requests.folder, config=requests.cfg)
    return serve(step, model, requests, options.engine, on_engine, on_output)


def prepare_requests(
    model_dir: str | Path,
    prompts: list[Prompt],
    options: TextOptions,
    model: torch.nn.Module | None = None,
) -> TextRequests:
    """Everything but the weights, checked: the config (the model's, or the checkpoint's with
    the engine options), the tokenizer and template, every request against the config (its
    vocabulary, context length and KV pool), the weight files' names and shapes. The slow
    part, loading the weights, starts only when all of this passed."""
    prompts = check_prompt_list(prompts)
    folder = checkpoint_dir(model_dir)
    cfg = model_config_for(folder, model, options.engine)
    codec = TextCodec.load(folder, options.chat_template)
    prompt_ids = [codec.encode(prompt, options.system) for prompt in prompts]
    eos = codec.eos_token_ids
    if options.eos_token_id is not None:
        eos = sorted(as_eos_ids(options.eos_token_id, cfg.vocab_size))
    requests = check_text_requests(prompts, prompt_ids, options, eos, cfg)
    check_stored_shapes(folder, cfg)  # the weight files' headers only: milliseconds
    system_tokens = codec.system_tokens(options.system, prompt_ids)
    return TextRequests(folder, cfg, codec, prompts, requests, eos, system_tokens)


def check_prompt_list(prompts: object) -> list[Prompt]:
    """``prompts`` as a list of strings or conversations (lists of chat messages); one bare
    string is refused (it would otherwise be served as one request per character), and so is
    an empty prompt (it asks for nothing)."""
    if isinstance(prompts, str):
        raise RequestError(
            f"prompts must be a list of strings, got one str ({prompts[:40]!r}); "
            f"for one prompt write [{prompts[:40]!r}]",
            "prompts",
        )
    prompts = list(prompts)  # type: ignore[call-overload]
    bad = [type(p).__name__ for p in prompts if not isinstance(p, (str, list))]
    if bad:
        raise RequestError(
            f"prompts must be strings (or conversations: lists of chat messages), got a {bad[0]}",
            "prompts",
        )
    if not prompts:
        raise RequestError("give at least one prompt", "prompts")
    for i, prompt in enumerate(prompts):
        if prompt == "":
            raise RequestError(f"prompt {i + 1} is empty: give it some text", "prompts")
        if isinstance(prompt, list):
            try:
                check_messages(prompt)
            except ValueError as exc:
                raise RequestError(f"prompt {i + 1}: {exc}", "prompts") from None
    return prompts


def check_text_requests(
    prompts: list[Prompt],
    prompt_ids: list[list[int]],
    options: TextOptions,
    eos: list[int],
    cfg: ModelConfig,
) -> list[Request]:
    """Every request as the engine will take it (``check_request``: its context length and the
    KV pool among the rest), an error naming its prompt; ids outside the model's vocabulary
    mean that the tokenizer is not the checkpoint's (a ``CheckpointError``)."""
    max_new_tokens = options.max_new_tokens
    if max_new_tokens is None and options.sampling_params is None:
        max_new_tokens = SamplingParams().max_tokens
    params = sampling_params_per_prompt(options.sampling_params, len(prompts))
    requests = []
    for i, (prompt, ids, sampling) in enumerate(zip(prompts, prompt_ids, params)):
        which = f"prompt {i + 1} ({_short(prompt)})"
        outside = [t for t in ids if not 0 <= t < cfg.vocab_size]
        if outside:
            raise CheckpointError(
                f"{which}: the tokenizer gives ids {outside[:5]} that the model's vocabulary "
                f"(vocab_size={cfg.vocab_size}) lacks: tokenizer.json does not belong to this "
                "checkpoint"
            )
        try:
            requests.append(check_request(ids, max_new_tokens, eos, cfg, sampling))
        except RequestError as exc:
            exc.args = (f"{which}: {exc}",)  # the same error, and which prompt it is about
            raise
    return requests


def _short(prompt: Prompt, limit: int = 30) -> str:
    if not isinstance(prompt, str):  # a conversation: its last message says which
        return f"{plural(len(prompt), 'message')}, the last {_short(prompt[-1]['content'])}"
    return repr(prompt if len(prompt) <= limit else prompt[:limit] + "...")


def model_config_for(
    folder: Path, model: torch.nn.Module | None, engine: EngineOptions
) -> ModelConfig:
    """The config the requests are checked against: the checkpoint's with the engine options,
    or the given model's. With a model, an engine option that would build another model is
    refused (it would be ignored), and so is a model of another network."""
    if model is None:
        return checkpoint_config(folder, **engine.model_overrides())
    defaults = EngineOptions().model_overrides()
    changed = {k: v for k, v in engine.model_overrides().items() if defaults.get(k) != v}
    if changed:
        given = ", ".join(f"{k}={v!r}" for k, v in changed.items())
        raise RequestError(
            f"model= is already built, so the engine options {given} would be ignored: pass "
            f"{given} to from_pretrained, or leave model= out",
            "model",
        )
    on_disk = checkpoint_config(folder)
    differ = [f for f in NETWORK_FIELDS if getattr(on_disk, f) != getattr(model.cfg, f)]
    if differ:
        raise RequestError(
            f"model= does not match {folder}: {differ[0]} is "
            f"{getattr(model.cfg, differ[0])} in the model, {getattr(on_disk, differ[0])} in "
            "the checkpoint",
            "model",
        )
    return model.cfg


def long_context_warning(cfg: ModelConfig) -> str | None:
    """A ``max_model_len`` past the positions the checkpoint was trained on is allowed (vLLM
    allows it too, when asked), but deserves a word: the model never saw those positions."""
    trained, limit = cfg.max_position_embeddings, cfg.max_model_len
    if trained is None or limit is None or limit <= trained:
        return None
    return (
        f"max_model_len {limit} is past the {trained} positions the checkpoint was trained on "
        "(its max_position_embeddings): a longer request runs the model on positions it never "
        "saw, and its text may fall apart"
    )


def serve(
    step: ModuleType,
    model: torch.nn.Module,
    requests: TextRequests,
    engine_options: EngineOptions,
    on_engine: Callable[[Any], object] | None = None,
    on_output: OnOutput | None = None,
) -> TextResult:
    """The checked requests through ``step``'s engine, round by round, decoded.

    The engine is driven as a server drives it: every request queued with ``add_request``,
    then ``step()`` until no work is left; each round's ``RequestOutput``s go to ``on_output``
    as they come, and the last one of each request (``finished``) says why it ended.
    """
    engine = step.PagedPrefixCacheEngine(
        model, max_running=engine_options.max_running, seed=engine_options.seed
    )
    if on_engine is not None:
        on_engine(engine)
    start = time.perf_counter()
    finals = run_requests(engine, requests, on_output)
    seconds = time.perf_counter() - start
    output_ids = [answer_ids(output) for output in finals]
    template = requests.codec.template
    return TextResult(
        requests.prompts,
        [requests.codec.decode(ids) for ids in output_ids],
        [r.prompt_ids for r in requests.requests],
        output_ids,
        engine.stats,
        seconds,
        model.cfg,
        list(requests.eos_token_ids),
        requests.system_tokens,
        template.source if template is not None else None,
        [str(output.finish_reason) for output in finals],
        cache_note(requests),
    )


def cache_note(requests: TextRequests) -> str | None:
    """Why the system prompt that every request begins with was computed for each of them:
    what the prompts share is shorter than one block, and only full blocks are shared. None
    without a system prompt, or when they share a block."""
    ids = [request.prompt_ids for request in requests.requests]
    shared, block_size = common_prefix_len(ids) if len(ids) > 1 else 0, requests.cfg.block_size
    text = requests.codec.decode(ids[0][:shared]).strip()
    if not requests.system_tokens or not text or shared >= block_size:
        return None
    return short_prefix_note(shared, text, block_size)


def short_prefix_note(shared: int, text: str, block_size: int) -> str:
    """``cache_note``'s words: what the prompts share, and the block size they would fill."""
    smaller = 1 << (shared.bit_length() - 1)  # a power of two that the shared tokens fill
    return (
        f"The prompts share their first {plural(shared, 'token')} ({shorten(text, 30)!r}), fewer "
        f"than one block of {block_size}: only full blocks are shared, so none of it came from "
        f"the cache. A longer system prompt, or a block_size of {smaller} "
        f"(--block-size {smaller}), would let the requests share it."
    )


def run_requests(
    engine: Any, requests: TextRequests, on_output: OnOutput | None
) -> list[RequestOutput]:
    """Queue every request, run rounds until none is left; each request's last output."""
    eos = frozenset(requests.eos_token_ids) or None
    last: dict[int, RequestOutput] = {}  # each request's latest output, by prompt index
    with torch.inference_mode():
        index = {
            engine.add_request(r.prompt_ids, None, eos, sampling_params=r.sampling_params): i
            for i, r in enumerate(requests.requests)
        }
        while engine.has_work:
            for output in engine.step():
                last[index[output.request_id]] = output
                if on_output is not None:
                    on_output(index[output.request_id], output)
    return [last[i] for i in range(len(requests.requests))]
