"""One way to build an engine: a model (a preset's name or a checkpoint folder) and the typed
engine options, checked before any weight is read; then the model and the engine of any step.

Every application builds its engine here, so what is checked, and in which order, is written
once: the text run and the chat loop (``run.py --model DIR``), the server's engine process
(``serve.py``) and the bench (every step's model on one set of weights).

1. ``ModelSource.open(model, options)``: a preset's config, or the checkpoint opened once and
   its ``config.json`` read with the options applied (``block_size``, ``total_blocks``,
   ``dtype``...). Nothing heavy yet: a front end checks its requests against ``source.cfg``
   and the weight files' shapes before the slow part.
2. ``source.build_model(step)``: the memory check, then the weights, a preset's seeded ones
   drawn or a checkpoint's read (or ``weights`` read once and shared by several steps' models).
3. ``EngineBuilder(step_name, source, options)()``: torch's threads set in the process that
   computes (``set_threads``), the model built, the engine on it, given the options its step
   takes. Plain fields, so it pickles: the server's engine process is handed one and builds its
   engine there.

The options were checked where they were read (``EngineOptions.refused_by``: a command's
flags, ``generate_text``'s arguments); the builder trusts them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from common.checkpoint import Checkpoint
from common.config import PRESETS, ModelConfig, preset
from common.errors import UserError

from .options import EngineOptions
from .steps import load_step, step_engine_args

Weights = Mapping[str, torch.Tensor]


@dataclass(frozen=True)
class ModelSource:
    """A model's config and where its weights come from: a preset's seed, or a checkpoint."""

    name: str  # the preset's name, or the checkpoint folder as it was given
    cfg: ModelConfig
    checkpoint: Checkpoint | None = None  # None: a preset, its weights drawn from cfg.seed

    @classmethod
    def open(
        cls, model: str | Path | Checkpoint, options: EngineOptions, **changes: object
    ) -> ModelSource:
        """``model``'s config with the engine options (and ``changes``) applied; a checkpoint
        is opened once and no weight is read. A bad folder or field is a ``UserError``."""
        overrides = {**options.model_overrides(), **changes}
        if isinstance(model, str) and model in PRESETS:
            if overrides.get("dtype") == "auto":
                raise UserError("--dtype auto needs --model DIR: the dtype a checkpoint is in")
            return cls(model, preset(model, seed=options.seed, **overrides))
        checkpoint = Checkpoint.open(model)
        name = str(model.folder if isinstance(model, Checkpoint) else model)
        return cls(name, checkpoint.model_config(**overrides), checkpoint)

    def read_weights(self) -> Weights | None:
        """A checkpoint's weights, read once for several models to share (None: a preset's
        are drawn by each model from its seed, the same in every step)."""
        if self.checkpoint is None:
            return None
        return self.checkpoint.read_weights(self.cfg)

    def build_model(self, step: ModuleType, weights: Weights | None = None) -> torch.nn.Module:
        """``step``'s model: ``weights`` when given (shared, not copied), else a preset's
        seeded weights or the checkpoint's, each after the memory check."""
        if weights is not None:
            model = step.TinyTransformerPaged(self.cfg.replace(seed=None))
            model.load_weights(weights)
            return model
        if self.checkpoint is None:
            return step.TinyTransformerPaged(self.cfg)
        return step.TinyTransformerPaged.from_pretrained(self.checkpoint, config=self.cfg)


@dataclass(frozen=True)
class EngineBuilder:
    """Everything an engine is built from, checked: calling it builds the engine."""

    step_name: str
    source: ModelSource
    options: EngineOptions

    def __call__(self, model: torch.nn.Module | None = None, **engine_args: Any) -> Any:
        """The step's engine on ``model`` (None: built now from the source), with the options'
        ``max_running``, ``seed`` and those only later steps take, for the steps that take
        them; ``engine_args`` adds others (``enable_prefix_cache``). The options are trusted:
        checked where they were read (``EngineOptions.refused_by``)."""
        options = self.options
        set_threads(options.threads)
        step = load_step(self.step_name)
        if model is None:
            model = self.source.build_model(step)
        return step.PagedPrefixCacheEngine(
            model,
            max_running=options.max_running,
            seed=options.seed,
            **step_engine_args(self.step_name, options),
            **engine_args,
        )


def set_threads(threads: int) -> None:
    """torch's CPU threads, for the whole process (0 leaves torch's default): set by whoever
    computes, before the model is built (``EngineOptions.threads``, ``--threads``)."""
    if threads:
        torch.set_num_threads(threads)
