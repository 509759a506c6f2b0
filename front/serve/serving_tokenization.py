"""``POST /tokenize`` and ``POST /detokenize`` (vLLM's ``serving_tokenization.py``): the
server's tokenizer, for a client that counts or aligns tokens before it asks (``vllm bench
serve`` does, to make prompts of an exact length).

``/tokenize`` takes a ``prompt`` (tokenized as ``/v1/completions`` tokenizes it, with the BOS
unless ``add_special_tokens: false``) or ``messages`` (written in the chat template as
``/v1/chat/completions`` writes them, ending with the assistant's header unless
``add_generation_prompt: false``), and answers ``count``, ``max_model_len``, ``tokens`` and,
with ``return_token_strs``, each token's text. ``/detokenize`` turns ``tokens`` back into text.
Both run on the worker thread, like every other tokenizing.
"""

from __future__ import annotations

from .protocol import DetokenizeRequest, OpenAIError, TokenizeRequest
from .responses import DetokenizeResponse, TokenizeResponse
from .serving_chat import OpenAIServingChat


class OpenAIServingTokenization(OpenAIServingChat):
    """The chat endpoint's way of writing a conversation, without generating anything."""

    async def create_tokenize(self, request: TokenizeRequest) -> TokenizeResponse:
        self.check_model(request)
        if (request.prompt is None) == (request.messages is None):
            raise OpenAIError(400, "give either prompt or messages", param="prompt")
        ids = await self.run(self.tokenize, request)
        strs = [self.model.token_text(t) for t in ids] if request.return_token_strs else None
        return TokenizeResponse(
            count=len(ids), max_model_len=self.model.max_model_len, tokens=ids, token_strs=strs
        )

    def tokenize(self, request: TokenizeRequest) -> list[int]:
        """The ids (on the worker thread). vLLM's defaults: a prompt gets the tokenizer's
        special tokens (its BOS), a conversation only those its template writes."""
        special = request.add_special_tokens
        if request.messages is not None:
            return self.chat_ids(request.messages, request.add_generation_prompt, bool(special))
        assert request.prompt is not None
        return self.model.codec.encode_text(request.prompt, special is not False)

    async def create_detokenize(self, request: DetokenizeRequest) -> DetokenizeResponse:
        self.check_model(request)
        vocab = self.llm.cfg.vocab_size
        outside = [t for t in request.tokens if t >= vocab]
        if outside:
            raise OpenAIError(
                400,
                f"token ids {outside[:5]} are outside the vocabulary [0, {vocab})",
                param="tokens",
            )
        return DetokenizeResponse(prompt=await self.run(self.model.codec.decode, request.tokens))
