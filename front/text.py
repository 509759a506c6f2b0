"""Text in, text out: a real checkpoint's tokenizer around any step's engine.

``TextCodec`` is the checkpoint's text side, loaded once: it turns a prompt (written in the
checkpoint's chat template when it has one, ``codec.py``) or a whole conversation into token
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
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from common.config import ModelConfig
from common.errors import RequestError
from common.inputs import Request, as_eos_ids, check_requests, long_context_warning
from common.sampling_params import RequestOutput, SamplingParams

from .build import EngineBuilder, ModelSource
from .cli import plural
from .codec import Prompt, TextCodec, check_prompts, common_prefix_len, prompt_label
from .options import EngineOptions
from .stream import IncrementalDetokenizer, StopStrings, answer_ids, shorten

OnOutput = Callable[[int, RequestOutput], object]  # (the prompt's index, what a round made)
# The fields of a config that say which network it is; the others size the KV pool or choose
# where it runs, and may differ between a loaded model and its checkpoint's config.json.
NETWORK_FIELDS = ("vocab_size", "d_model", "num_heads", "num_kv_heads", "num_layers", "d_ff")


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
    ``stop``: stop strings (vLLM's ``stop``, a string or a list): an answer ends before the
    first one (after it, with ``include_stop_str_in_output``), and its request is aborted there.
    """

    system: str | None = None
    max_new_tokens: int | None = None
    sampling_params: SamplingParams | list[SamplingParams] | None = None
    eos_token_id: object = None
    chat_template: bool = True
    engine: EngineOptions = field(default_factory=EngineOptions)
    stop: str | tuple[str, ...] = ()
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        """``eos_token_id`` as sorted ids (checked against the vocabulary with each request);
        ``stop`` as a tuple of strings, checked (``StopStrings``)."""
        if self.eos_token_id is not None:
            ids = tuple(sorted(as_eos_ids(self.eos_token_id, None)))
            object.__setattr__(self, "eos_token_id", ids)
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        StopStrings(stop)  # a bad one is refused now, before any work
        object.__setattr__(self, "stop", stop)


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
    # why each request ended: "stop" (an eos, a stop id or a stop string) or "length" (max
    # tokens reached)
    finish_reasons: list[str] = field(default_factory=list)
    # Why the text the prompts share came from no cache: shorter than a block (``cache_note``).
    cache_note: str | None = None
    # the stop string that ended each answer, or None (vLLM's ``stop_reason``)
    stop_reasons: list[str | None] = field(default_factory=list)


@dataclass(frozen=True)
class TextRequests:
    """Requests ready to serve, checked without reading a single weight."""

    source: ModelSource  # the checkpoint, and the config the model will be built with
    codec: TextCodec
    prompts: list[Prompt]
    requests: list[Request]  # one per prompt, as the engine takes it
    eos_token_ids: list[int]
    system_tokens: int
    warning: str | None  # ``long_context_warning``'s, for a caller to show
    stop: tuple[str, ...] = ()
    include_stop_str_in_output: bool = False

    @property
    def cfg(self) -> ModelConfig:
        return self.source.cfg

    def stop_strings(self, index: int) -> StopStrings:
        """Request ``index``'s stop strings, with its ``min_tokens`` (none are looked for in
        the text of its first ``min_tokens`` tokens, as vLLM does)."""
        min_tokens = self.requests[index].sampling_params.min_tokens
        return StopStrings(self.stop, self.include_stop_str_in_output, min_tokens)


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
            attaches a ``front.trace.RoundTracer`` there).
        on_output: called as ``on_output(index, output)`` with each ``RequestOutput`` of each
            round as it comes (``index``: the prompt's place in ``prompts``);
            ``front.stream.StreamPrinter`` streams the text from there.

    Returns:
        A ``TextResult``. Everything but the weights is checked before they load: a
        ``RequestError`` or ``CheckpointError`` (both ``ValueError``) says what is wrong.
    """
    options = options or TextOptions()
    source = ModelSource.open(model_dir, options.engine)
    if model is not None:
        source = given_model(source, model, options.engine)
    requests = prepare_requests(source, prompts, options)
    step_name = step if isinstance(step, str) else step.__name__
    options.engine.check_step(step_name)  # the options' one check here: no command read them
    engine = EngineBuilder(step_name, source, options.engine)(model)
    return serve_requests(engine, requests, on_engine, on_output)


def prepare_requests(
    source: ModelSource, prompts: list[Prompt], options: TextOptions
) -> TextRequests:
    """Everything but the weights, checked: the text side, every request against the config,
    the weight files' names and shapes."""
    assert source.checkpoint is not None, "text needs a checkpoint: its tokenizer"
    cfg = source.cfg
    codec = TextCodec.of(source.checkpoint, options.chat_template)
    prompts = check_prompts(prompts)
    prompt_ids = codec.encode_all(prompts, options.system, cfg.vocab_size)
    system_tokens = codec.system_tokens(options.system, prompt_ids)
    labels = [prompt_label(i, prompt) for i, prompt in enumerate(prompts)]
    max_new_tokens = options.max_new_tokens
    if max_new_tokens is None and options.sampling_params is None:
        max_new_tokens = SamplingParams().max_tokens
    eos = codec.eos_token_ids if options.eos_token_id is None else list(options.eos_token_id)
    sampling, warning = options.sampling_params, long_context_warning(cfg)
    requests = check_requests(prompt_ids, max_new_tokens, eos, cfg, sampling, labels)
    source.checkpoint.check_shapes(cfg)  # the weight files' headers only: milliseconds
    return TextRequests(
        source,
        codec,
        prompts,
        requests,
        eos,
        system_tokens,
        warning,
        options.stop,
        options.include_stop_str_in_output,
    )


def given_model(source: ModelSource, model: torch.nn.Module, engine: EngineOptions) -> ModelSource:
    """The source of a ``model=`` already built: an engine option that would build another is
    refused (it would be ignored), and so is a model of another network."""
    defaults = EngineOptions().model_overrides()
    changed = {k: v for k, v in engine.model_overrides().items() if defaults.get(k) != v}
    if changed:
        given = ", ".join(f"{k}={v!r}" for k, v in changed.items())
        raise RequestError(
            f"model= is already built, so the engine options {given} would be ignored: pass "
            f"{given} to from_pretrained, or leave model= out",
            "model",
        )
    differ = [f for f in NETWORK_FIELDS if getattr(source.cfg, f) != getattr(model.cfg, f)]
    if differ:
        raise RequestError(
            f"model= does not match {source.name}: {differ[0]} is "
            f"{getattr(model.cfg, differ[0])} in the model, {getattr(source.cfg, differ[0])} in "
            "the checkpoint",
            "model",
        )
    return replace(source, cfg=model.cfg)


def serve_requests(
    engine: Any,
    requests: TextRequests,
    on_engine: Callable[[Any], object] | None = None,
    on_output: OnOutput | None = None,
) -> TextResult:
    """The checked requests through ``engine``, driven as a server drives it (every request
    queued, then ``step()`` until no work is left), decoded."""
    if on_engine is not None:
        on_engine(engine)
    start = time.perf_counter()
    answers = run_requests(engine, requests, on_output)
    seconds = time.perf_counter() - start
    template = requests.codec.template
    return TextResult(
        requests.prompts,
        [answer.text for answer in answers],
        [r.prompt_ids for r in requests.requests],
        [answer.ids for answer in answers],
        engine.stats,
        seconds,
        engine.model.cfg,
        list(requests.eos_token_ids),
        requests.system_tokens,
        template.source if template is not None else None,
        [answer.finish_reason for answer in answers],
        cache_note(requests),
        [answer.stop_reason for answer in answers],
    )


def cache_note(requests: TextRequests) -> str | None:
    """Why the system prompt was computed for every request: what the prompts share is shorter
    than one block, and only full blocks are shared (None when that is not so)."""
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


@dataclass
class TextAnswer:
    """One request's answer as the text side reads it: its last output, and its text."""

    detokenizer: IncrementalDetokenizer
    output: RequestOutput | None = None

    @property
    def done(self) -> bool:
        return self.detokenizer.stop_reason is not None or bool(
            self.output and self.output.finished
        )

    def read(self, output: RequestOutput) -> None:
        self.output = output
        ids = answer_ids(output)
        _ = self.detokenizer.finish(ids) if output.finished else self.detokenizer.update(ids)

    @property
    def ids(self) -> list[int]:
        """The answer's ids: without the eos that ended it, or up to the token that completed
        its stop string."""
        assert self.output is not None
        return answer_ids(self.output)[: self.detokenizer.num_tokens]

    @property
    def text(self) -> str:
        return self.detokenizer.text

    @property
    def stop_reason(self) -> str | None:
        return self.detokenizer.stop_reason

    @property
    def finish_reason(self) -> str:
        assert self.output is not None
        return "stop" if self.stop_reason is not None else str(self.output.finish_reason)


def run_requests(
    engine: Any, requests: TextRequests, on_output: OnOutput | None
) -> list[TextAnswer]:
    """Queue every request, run rounds until none is left; each request's answer. A request
    whose text reaches a stop string is aborted there, as vLLM aborts it: what the engine says
    of it after that (its "abort") is not the answer's."""
    eos = frozenset(requests.eos_token_ids) or None
    decode = requests.codec.decode
    answers = [
        TextAnswer(IncrementalDetokenizer(decode, requests.stop_strings(i), r.prompt_ids))
        for i, r in enumerate(requests.requests)
    ]
    with torch.inference_mode():
        index = {
            engine.add_request(r.prompt_ids, None, eos, sampling_params=r.sampling_params): i
            for i, r in enumerate(requests.requests)
        }
        while engine.has_work:
            for output in engine.step():
                answer = answers[index[output.request_id]]
                if answer.done:
                    continue
                answer.read(output)
                if answer.stop_reason is not None and not output.finished:
                    engine.abort(output.request_id)
                if on_output is not None:
                    on_output(index[output.request_id], output)
    return answers
