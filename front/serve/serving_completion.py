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

from typing import Any

from . import responses
from .answer import Answer, Choice
from .protocol import CompletionRequest
from .serving_engine import OpenAIServing
from .serving_models import EnginePrompt


class OpenAIServingCompletion(OpenAIServing):
    id_prefix = "cmpl"
    whole_object = chunk_object = "text_completion"

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

    def whole_choice(self, answer: Answer, choice: Choice) -> dict[str, Any]:
        prefix, ids, entries = answer.echoed_prompt(choice)
        ids, entries = ids + choice.token_ids, entries + choice.entries[: choice.num_tokens]
        return self.text_choice(answer, choice, prefix + choice.text.text, ids, entries)

    def chunk_choice(
        self, answer: Answer, choice: Choice, piece: str, ids: list[int], entries: list
    ) -> dict[str, Any]:
        prefix, prompt_ids, prompt_entries = answer.echoed_prompt(choice)
        return self.text_choice(
            answer, choice, prefix + piece, prompt_ids + ids, prompt_entries + entries
        )

    def text_choice(
        self, answer: Answer, choice: Choice, text: str, ids: list[int], entries: list
    ) -> dict[str, Any]:
        """One choice's text, and the log-probabilities of its tokens ``ids`` when asked; the
        choice's finish reason once it is done."""
        logprobs = None
        if answer.logprobs:
            token_text = self.model.token_text
            logprobs = responses.completion_logprobs(ids, entries, token_text, choice.text_offset)
            choice.text_offset += sum(len(token) for token in logprobs["tokens"])
        done = choice.done
        return responses.choice(
            choice.index,
            choice.finish_reason if done else None,
            choice.stop_reason if done else None,
            text=text,
            logprobs=logprobs,
        )
