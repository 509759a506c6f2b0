"""The dense reference model: the tokens every cell of every workload must produce."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from common.config import ModelConfig
from common.reference import ReferenceModel, reference_generate


class Reference:
    """The dense, cache-free reference model on the bench's weights, built when first used."""

    def __init__(self, cfg: ModelConfig, weights: Mapping[str, torch.Tensor] | None) -> None:
        self.cfg, self.weights, self._model = cfg, weights, None

    @property
    def model(self) -> ReferenceModel:
        if self._model is None:
            self._model = ReferenceModel(self.cfg)
            if self.weights is not None:
                self._model.load_weights(self.weights)
        return self._model

    def tokens(
        self,
        prompts: list[list[int]],
        max_new_tokens: int,
        eos: Sequence[int] | None = None,
    ) -> list[list[int]]:
        """Greedy tokens for every prompt; with ``eos``, one id per request, each answer
        stops at its own (one batched call cannot: each prompt then goes alone)."""
        if eos is None:
            return reference_generate(self.model, prompts, max_new_tokens)
        return [
            reference_generate(self.model, [prompt], max_new_tokens, stop)[0]
            for prompt, stop in zip(prompts, eos, strict=True)
        ]


def reference_tokens(options, progress, cfg: ModelConfig, weights, workload) -> list | None:
    """The reference's tokens for ``workload``'s prompts, or None with ``--no-reference``."""
    if options.no_reference:
        return None
    with progress.task("dense reference"):
        prompts = workload.prompts(cfg.vocab_size)
        return Reference(cfg, weights).tokens(prompts, workload.max_new_tokens)
