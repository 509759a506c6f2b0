"""``POST /v1/chat/completions`` (vLLM's ``serving_chat.py``): a conversation answered.

The messages are written in the checkpoint's chat template, ending with the assistant's
header: the ids ``generate_text`` gives the same messages. An answer may fill what the context
has left unless the request says otherwise (vLLM's default); a stream's first chunk of each
choice names the role, as OpenAI's does. ``logprobs: true`` reports each token's
log-probability, and ``top_logprobs`` that many alternatives (OpenAI's chat shape).
"""

from __future__ import annotations

from typing import Any

from common.errors import one_line

from .protocol import ChatCompletionRequest, OpenAIError
from .responses import ChatCompletionResponse, ChatCompletionStreamResponse
from .serving_engine import OpenAIServing
from .serving_models import EnginePrompt


class OpenAIServingChat(OpenAIServing):
    id_prefix = "chatcmpl"
    response_class = ChatCompletionResponse
    chunk_class = ChatCompletionStreamResponse

    def engine_prompts(self, request: ChatCompletionRequest) -> list[EnginePrompt]:
        """The conversation in the checkpoint's chat markup (on the worker thread)."""
        return [EnginePrompt(self.chat_ids(request.messages), "messages")]

    def chat_ids(self, messages: list[Any], *template_options: bool) -> list[int]:
        """The conversation's ids (``TextCodec.chat_ids``, whose options follow it)."""
        if self.model.codec.template is None:
            raise OpenAIError(
                400,
                "this model has no chat template (chat_template.jinja or tokenizer_config.json's "
                "chat_template): use /v1/completions",
                param="messages",
            )
        try:
            conversation = [text_only(message, i) for i, message in enumerate(messages, 1)]
            return self.model.codec.chat_ids(conversation, *template_options)
        except ValueError as exc:  # a bad message, or the template refused it
            raise OpenAIError(400, one_line(exc), param="messages") from None

    def default_max_tokens(self, prompt: EnginePrompt) -> int:
        """What the context has left (at least one: a prompt that fills it all is then
        refused, with the numbers)."""
        limit = self.model.max_model_len
        return (
            super().default_max_tokens(prompt) if limit is None else max(limit - len(prompt.ids), 1)
        )


def text_only(message: Any, number: int) -> Any:
    """A message whose content is a list of parts (OpenAI's newer form) with its text parts
    joined; any other part is refused: this model reads text only, and a text part without its
    ``text`` (a string) too, as the schema says."""
    if not isinstance(message, dict) or not isinstance(message.get("content"), list):
        return message
    texts = []
    for part in message["content"]:
        if not (isinstance(part, dict) and part.get("type") == "text"):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise ValueError(f"message {number}: only text parts are supported, got {kind!r}")
        if not isinstance(part.get("text"), str):
            raise ValueError(f"message {number}: a text part needs its 'text', a string")
        texts.append(part["text"])
    return {**message, "content": "\n".join(texts)}
