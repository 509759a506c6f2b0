"""``POST /v1/completions`` (vLLM's ``serving_completion.py``): a prompt continued.

The prompt is a string, tokenized as ``generate_text`` tokenizes a plain prompt (so that
``temperature: 0`` gives exactly its answer), or token ids. An answer is 16 tokens long unless
the request says otherwise (OpenAI's and vLLM's default).
"""

from __future__ import annotations

from typing import Any

from . import protocol
from .protocol import CompletionRequest, OpenAIError
from .serving_engine import EnginePrompt, OpenAIServing


class OpenAIServingCompletion(OpenAIServing):
    id_prefix = "cmpl"
    whole_object = chunk_object = "text_completion"

    def engine_prompt(self, request: CompletionRequest) -> EnginePrompt:
        """A string, tokenized as ``generate_text`` does a plain prompt, or token ids."""
        prompt = request.prompt
        if isinstance(prompt, str):
            return EnginePrompt(self.model.codec.completion_ids(prompt), "prompt")
        if isinstance(prompt, list) and all(type(t) is int for t in prompt):
            return EnginePrompt(prompt, "prompt")
        raise OpenAIError(
            400,
            "prompt must be a string or a list of token ids (one prompt per request), got "
            f"{type(prompt).__name__}",
            param="prompt",
        )

    def whole_choice(self, text: str, finish_reason: str | None) -> dict[str, Any]:
        return protocol.text_choice(text, finish_reason)

    def chunk_choice(self, piece: str, finish_reason: str | None) -> dict[str, Any]:
        return protocol.text_choice(piece, finish_reason)
