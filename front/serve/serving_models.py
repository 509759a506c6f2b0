"""What the server serves (vLLM's ``serving_models.py``): its model, loaded once
(``ServedModel``), and a request's prompt as that model takes it (``EnginePrompt``). A module
of their own, so that the output processor (``output_processor.py``) names them without
importing the endpoints that use it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..codec import TextCodec


@dataclass(frozen=True)
class ServedModel:
    """What the server knows of its checkpoint, loaded once: its name, its text side (the
    tokenizer, the chat template, the eos ids), and what a request falls back on."""

    name: str
    codec: TextCodec
    max_model_len: int | None
    sampling_defaults: dict[str, Any]  # generation_config.json's temperature, top_p, ...

    def token_text(self, token_id: int) -> str:
        """One token's own text, special tokens shown (what a log-probability is about)."""
        return self.codec.tokenizer.decode([token_id], skip_special_tokens=False)


@dataclass(frozen=True)
class EnginePrompt:
    """A request's prompt as the engine takes it (vLLM's name): token ids, the request's field
    they came from, for the errors to name, and its text when it came as text (``echo``)."""

    ids: list[int]
    field: str  # "prompt" or "messages"
    text: str | None = None
