"""A checkpoint's chat template: the markup an instruct model was trained on.

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

Needs ``jinja2`` (``pip install -e '.[real]'``), imported only when a template is used.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime
from functools import cache
from pathlib import Path
from typing import Any

from ..errors import CheckpointError, MissingPackageError, UserError

TEMPLATE_FILE = "chat_template.jinja"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
SPECIAL_TOKENS_MAP_FILE = "special_tokens_map.json"
# A request to the text front end: a prompt, or a conversation (chat messages, the last one the
# turn the model answers).
Prompt = str | list[dict[str, str]]
# Older jinja2 releases have sandbox escapes (transformers refuses them too).
MIN_JINJA2 = (3, 1, 6)
# The named special tokens a template may use, as transformers names them.
SPECIAL_TOKEN_NAMES = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)


class ChatTemplateError(UserError, ValueError):
    """The template refused the conversation (e.g. a model without a system role given
    ``--system``), or could not be compiled."""


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
    ...}``, strings both), or ``ValueError`` saying which message is wrong and how.

    Its last message must not be the assistant's: the template then writes the header of the
    assistant's turn, and the model would answer a turn that already has its answer. Other keys
    of a message (``name``, ...) are passed on to the template untouched.
    """
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
    """The checkpoint's chat template, or None when it has none.

    ``chat_template.jinja`` wins over ``tokenizer_config.json``'s ``chat_template``, as in
    transformers. The field may hold one template, or a list of named ones, of which the one
    named ``default`` is used.
    """
    config = _read_json(folder / TOKENIZER_CONFIG_FILE)
    if (folder / TEMPLATE_FILE).is_file():
        template, source = (folder / TEMPLATE_FILE).read_text(encoding="utf-8"), TEMPLATE_FILE
    else:
        template, source = _template_field(config), f"{TOKENIZER_CONFIG_FILE}'s chat_template"
    if not template:
        return None
    tokens = {
        **special_tokens(_read_json(folder / SPECIAL_TOKENS_MAP_FILE)),
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


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{path} is not valid JSON ({exc})") from None
    return data if isinstance(data, dict) else {}


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
