"""A checkpoint's text side: ``TextCodec``, its tokenizer, its chat template and the ids that
end an answer, loaded once; and the checks of what a prompt may be (``check_prompts``).

An instruct checkpoint (SmolLM2-Instruct, Llama 3.2 Instruct, ...) expects its conversation
written in its own markup, e.g. ``<|im_start|>user\\n...<|im_end|>``. The checkpoint ships that
markup as a Jinja template: ``chat_template.jinja`` (what current transformers saves) or the
``chat_template`` field of ``tokenizer_config.json`` (what most checkpoints on the hub carry).
``ChatTemplate.render`` fills it in the way transformers' ``apply_chat_template`` does: the
same Jinja library in a sandbox, the same options (``trim_blocks``, ``lstrip_blocks``, loop
controls), the same helpers (``raise_exception``, ``strftime_now``, a ``tojson`` that keeps
non-ASCII text), the tokenizer's special tokens (``bos_token``, ``eos_token``, ...) as
variables; the text is then tokenized without adding special tokens, since the template
writes them itself.

Needs ``tokenizers`` (``pip install -e '.[real]'``), and ``jinja2``, imported only when a
template is used.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from functools import cache
from pathlib import Path
from typing import Any

from common.checkpoint import Checkpoint, read_optional_json
from common.errors import CheckpointError, MissingPackageError, RequestError, UserError

from .cli import plural

TEMPLATE_FILE = "chat_template.jinja"
TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
SPECIAL_TOKENS_MAP_FILE = "special_tokens_map.json"
# A request to the text front end: a prompt, or a conversation (chat messages, the last one the
# turn the model answers).
Prompt = str | list[dict[str, str]]
# Older jinja2 releases have sandbox escapes (transformers refuses them too).
MIN_JINJA2 = (3, 1, 6)
# The named special tokens a template may use, as transformers names them.
SPECIAL_TOKENS = ("bos", "eos", "unk", "sep", "pad", "cls", "mask")
SPECIAL_TOKEN_NAMES = tuple(f"{name}_token" for name in SPECIAL_TOKENS)


class ChatTemplateError(UserError, ValueError):
    """The template refused the conversation, or could not be compiled."""


@dataclass(frozen=True)
class ChatTemplate:
    """A chat template and the special tokens it may refer to."""

    source: str  # where it was found, for the banner: "chat_template.jinja", ...
    template: str
    special_tokens: dict[str, str]

    def render(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """The conversation as the model's markup; with ``add_generation_prompt`` it ends with
        the header of the assistant's turn, so that the model writes the answer next."""
        jinja2 = require_jinja2()
        try:
            return _compile(self.template).render(
                messages=messages,
                tools=None,
                documents=None,
                add_generation_prompt=add_generation_prompt,
                **self.special_tokens,
            )
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(
                f"the checkpoint's chat template ({self.source}) refused the conversation: "
                f"{exc} (--no-chat-template serves plain completions)"
            ) from None


def messages_for(prompt: str, system: str | None) -> list[dict[str, str]]:
    """One request as chat messages: the shared system prompt (if any), then the user's."""
    messages = [] if system is None else [{"role": "system", "content": system}]
    return [*messages, {"role": "user", "content": prompt}]


def check_messages(messages: object) -> list[dict[str, str]]:
    """A conversation as the chat template takes it (a list of ``{"role": ..., "content":
    ...}``), or ``ValueError`` saying which message is wrong. The last must not be the
    assistant's: the model would answer a turn that already has its answer."""
    shape = 'a chat message is {"role": "...", "content": "..."}'
    if not isinstance(messages, list) or not messages:
        got = "an empty list" if messages == [] else f"a {type(messages).__name__}"
        raise ValueError(f"a conversation is a non-empty list of chat messages, got {got}")
    for number, message in enumerate(messages, start=1):
        if not isinstance(message, dict):
            raise ValueError(f"message {number} is a {type(message).__name__}: {shape}")
        for key in ("role", "content"):
            if not isinstance(message.get(key), str):
                why = "has no" if key not in message else "has a non-string"
                raise ValueError(f"message {number} {why} {key!r}: {shape}")
        if not message["role"]:
            raise ValueError(f"message {number} has an empty 'role'")
    if messages[-1]["role"] == "assistant":
        raise ValueError(
            f"the last message ({len(messages)}) is the assistant's: end the conversation with "
            "the turn the model should answer (the user's)"
        )
    return messages


def load_chat_template(folder: Path) -> ChatTemplate | None:
    """The checkpoint's chat template, or None: ``chat_template.jinja``, else
    ``tokenizer_config.json``'s field (as in transformers; of a named list, ``default``)."""
    config = read_optional_json(folder / TOKENIZER_CONFIG_FILE)
    if (folder / TEMPLATE_FILE).is_file():
        template, source = (folder / TEMPLATE_FILE).read_text(encoding="utf-8"), TEMPLATE_FILE
    else:
        template, source = _template_field(config), f"{TOKENIZER_CONFIG_FILE}'s chat_template"
    if not template:
        return None
    tokens = {
        **special_tokens(read_optional_json(folder / SPECIAL_TOKENS_MAP_FILE)),
        **special_tokens(config),
    }
    return ChatTemplate(source, template, tokens)


def _template_field(config: dict[str, Any]) -> str | None:
    """``chat_template`` as a string: given as one, or the ``default`` of a named list."""
    field = config.get("chat_template")
    if field is None or isinstance(field, str):
        return field
    if isinstance(field, list):
        named = {t.get("name"): t.get("template") for t in field if isinstance(t, dict)}
        if "default" in named:
            return named["default"]
        raise CheckpointError(
            f"{TOKENIZER_CONFIG_FILE}: chat_template lists {sorted(map(str, named))} but none "
            "named 'default' (--no-chat-template serves plain completions)"
        )
    raise CheckpointError(f"{TOKENIZER_CONFIG_FILE}: chat_template is a {type(field).__name__}")


def special_tokens(config: dict[str, Any]) -> dict[str, str]:
    """``bos_token``, ``eos_token``, ... as strings; a token may be stored as a string or as
    an added-token object (``{"content": "<s>", ...}``)."""
    tokens = {}
    for name in SPECIAL_TOKEN_NAMES:
        value = config.get(name)
        if isinstance(value, dict):
            value = value.get("content")
        if isinstance(value, str):
            tokens[name] = value
    return tokens


Decode = Callable[[list[int]], str]  # an answer's ids to its text


def text_decoder(tokenizer: Any) -> Decode:
    """How every answer becomes text, streamed or not: special tokens skipped, spaces as the
    decoder writes them (a transformers tokenizer is told not to clean them up: "a ." into "a."
    would change text already printed)."""
    if hasattr(tokenizer, "convert_ids_to_tokens"):  # a transformers tokenizer
        return lambda ids: tokenizer.decode(
            ids, skip_special_tokens=True, clean_up_tokenization_spaces=False
        )
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=True)


def load_tokenizer(folder: str | Path) -> Any:
    """The ``tokenizer.json`` of the checkpoint in ``folder`` as a ``tokenizers.Tokenizer``."""
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise MissingPackageError(
            "text in/out needs the 'tokenizers' package: pip install -e '.[real]'"
        ) from None
    path = Path(folder).expanduser() / TOKENIZER_FILE
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
    none, or it is not wanted) and the ids that end an answer. ``encode`` turns a request (a
    prompt or a conversation) into ids; ``decode`` turns an answer's ids back into text."""

    def __init__(
        self, tokenizer: Any, template: ChatTemplate | None, eos_token_ids: list[int]
    ) -> None:
        self.tokenizer = tokenizer
        self.template = template
        self.eos_token_ids = eos_token_ids
        self.decode: Decode = text_decoder(tokenizer)

    @classmethod
    def load(cls, model_dir: str | Path, chat_template: bool = True) -> TextCodec:
        """The text side of the checkpoint in ``model_dir``."""
        return cls.of(Checkpoint.open(model_dir), chat_template)

    @classmethod
    def of(cls, checkpoint: Checkpoint, chat_template: bool = True) -> TextCodec:
        """``load`` for a checkpoint already open."""
        template = load_chat_template(checkpoint.folder) if chat_template else None
        return cls(load_tokenizer(checkpoint.folder), template, checkpoint.eos_token_ids)

    def encode(self, prompt: Prompt, system: str | None = None) -> list[int]:
        """One request as token ids: in the chat template when there is one (``system`` as a
        system message), else a plain completion."""
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

    def encode_text(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """``text``'s ids. Through ``encode_batch``, which lets go of Python's GIL while the
        Rust tokenizer works (``encode`` holds it): a server tokenizing a long prompt on a
        worker thread keeps its event loop running meanwhile."""
        return self.tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def completion_ids(self, text: str, system: str | None = None) -> list[int]:
        """A plain completion, ``[bos] system`` then ``text``: the system prompt encoded on its
        own (with BOS), the text without special tokens, since ``system + text`` as one string
        could merge tokens across the seam differently per request (no shared prefix then)."""
        if system is None:
            return self.encode_text(text)
        tail = self.encode_text(text, add_special_tokens=False)
        return self.encode_text(system) + tail

    def chat_ids(
        self,
        messages: list[dict[str, str]],
        add_generation_prompt: bool = True,
        add_special_tokens: bool = False,
    ) -> list[int]:
        """A conversation in the chat markup, ending with the assistant's header: transformers'
        ``apply_chat_template(..., add_generation_prompt=True)``, tokenized whole as it does.
        Requests still share a common system part: its text ends at the template's markup.
        (A server's ``/tokenize`` may ask for it without the header, or with the tokenizer's
        special tokens added on top of the template's.)"""
        if self.template is None:
            raise RequestError(
                "a conversation (--messages) is written in the checkpoint's chat template, and "
                "none is loaded: the checkpoint has none, or chat_template=False was given",
                "messages",
            )
        text = self.template.render(check_messages(messages), add_generation_prompt)
        return self.encode_text(text, add_special_tokens)

    def encode_all(
        self, prompts: list[Prompt], system: str | None, vocab_size: int
    ) -> list[list[int]]:
        """Every prompt's ids (``encode``); an id outside the model's vocabulary means that the
        tokenizer is not the checkpoint's (a ``CheckpointError`` naming the prompt)."""
        prompt_ids = [self.encode(prompt, system) for prompt in prompts]
        for i, ids in enumerate(prompt_ids):
            outside = [t for t in ids if not 0 <= t < vocab_size]
            if outside:
                raise CheckpointError(
                    f"{prompt_label(i, prompts[i])}: the tokenizer gives ids {outside[:5]} that "
                    f"the model's vocabulary (vocab_size={vocab_size}) lacks: tokenizer.json "
                    "does not belong to this checkpoint"
                )
        return prompt_ids

    def system_tokens(self, system: str | None, prompt_ids: list[list[int]]) -> int:
        """The tokens every request shares because of ``system`` (BOS and markup included)."""
        if system is None:
            return 0
        if self.template is None:
            return len(self.encode_text(system))
        message = [{"role": "system", "content": system}]
        alone = self.template.render(message, add_generation_prompt=False)
        system_ids = self.encode_text(alone, add_special_tokens=False)
        return common_prefix_len([system_ids, *prompt_ids])


def common_prefix_len(sequences: list[list[int]]) -> int:
    """How many leading ids all ``sequences`` share."""
    shortest = min(sequences, key=len)
    for i, token in enumerate(shortest):
        if any(seq[i] != token for seq in sequences):
            return i
    return len(shortest)


def check_prompts(prompts: object) -> list[Prompt]:
    """``prompts`` as a list of strings or conversations; one bare string is refused (it would
    be served as one request per character), and so is an empty prompt."""
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


def prompt_label(index: int, prompt: Prompt, limit: int = 30) -> str:
    """How a message about one of several prompts names it: ``prompt 2 ('The capital...')``."""
    return f"prompt {index + 1} ({_short(prompt, limit)})"


def _short(prompt: Prompt, limit: int) -> str:
    if not isinstance(prompt, str):  # a conversation: its last message says which
        return f"{plural(len(prompt), 'message')}, the last {_short(prompt[-1]['content'], limit)}"
    return repr(prompt if len(prompt) <= limit else prompt[:limit] + "...")


def require_jinja2() -> Any:
    """The ``jinja2`` module, or an error that says how to install it (or do without)."""
    try:
        import jinja2
        import jinja2.sandbox
    except ImportError:
        raise MissingPackageError(
            "the checkpoint has a chat template, and applying it needs the 'jinja2' package: "
            "pip install -e '.[real]' (or --no-chat-template for plain completions)"
        ) from None
    version = tuple(int(part) for part in jinja2.__version__.split(".")[:3] if part.isdigit())
    if version < MIN_JINJA2:
        raise MissingPackageError(
            f"jinja2 {jinja2.__version__} has known sandbox escapes, and a chat template comes "
            "with the checkpoint: pip install -U 'jinja2>=3.1.6' (or --no-chat-template)"
        )
    return jinja2


@cache
def _compile(template: str) -> Any:
    """The template compiled once (a few milliseconds each time otherwise)."""
    return _environment().from_string(template)


def _environment() -> Any:
    """A sandboxed Jinja environment with the options and helpers chat templates rely on."""
    jinja2 = require_jinja2()
    from jinja2.ext import Extension
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationBlock(Extension):
        """``{% generation %}...{% endgeneration %}`` marks the assistant's text for training
        masks; for inference it renders its body unchanged."""

        tags = {"generation"}  # noqa: RUF012 (Jinja's own class attribute)

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            call = self.call_method("_body")
            return jinja2.nodes.CallBlock(call, [], [], body).set_lineno(lineno)

        def _body(self, caller: Any) -> str:
            return caller()

    def raise_exception(message: str) -> None:
        raise jinja2.TemplateError(message)

    def tojson(value: Any, ensure_ascii: bool = False, indent: Any = None, **kwargs: Any) -> str:
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, **kwargs)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[GenerationBlock, "jinja2.ext.loopcontrols"],
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env
