"""``POST /v1/completions`` (vLLM's ``serving_completion.py``): prompts continued.

``prompt`` is a string, a list of strings, token ids or a list of token-id lists (OpenAI's four
forms): one prompt or several, each with ``n`` choices, numbered as OpenAI numbers them
(prompt ``i``'s choice ``j`` is ``i * n + j``). A string is tokenized as ``generate_text``
tokenizes a plain prompt, so that ``temperature: 0`` gives exactly its answer. An answer is 16
tokens long unless the request says otherwise (OpenAI's and vLLM's default). ``echo`` puts
the prompt before the answer, and with ``logprobs`` the prompt's log-probabilities too (the
first ``null``: nothing predicts it), which is how an evaluation harness scores a text.
"""

from __future__ import annotations

from .protocol import CompletionRequest
from .responses import CompletionResponse, CompletionStreamResponse
from .serving_engine import OpenAIServing
from .serving_models import EnginePrompt


class OpenAIServingCompletion(OpenAIServing):
    id_prefix = "cmpl"
    response_class = CompletionResponse
    chunk_class = CompletionStreamResponse

    def engine_prompts(self, request: CompletionRequest) -> list[EnginePrompt]:
        """Each prompt: a string, tokenized as ``generate_text`` does a plain prompt, or token
        ids (``protocol.as_prompts`` checked the form)."""
        codec = self.model.codec
        return [
            EnginePrompt(codec.completion_ids(p), "prompt", p)
            if isinstance(p, str)
            else EnginePrompt(p, "prompt")
            for p in request.prompt
        ]
