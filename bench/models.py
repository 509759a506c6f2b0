"""The bench's model: its config and weights (a preset or a checkpoint), checked against the
machine's memory before anything is read, and one step's model built on them."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import ModuleType

import torch

from common.config import PRESETS, ModelConfig, preset
from common.front.cli import dtype_value
from common.front.steps import load_step
from common.inputs import check_fits_pool
from common.memory import check_memory

from .options import BenchOptions
from .progress import Progress

Weights = Mapping[str, torch.Tensor]

# A prompt token, as a Python int in a list: the list's 8-byte slot and a 28-byte int object.
PROMPT_BYTES_PER_TOKEN = 36


def _changes(options: BenchOptions, total_blocks: int) -> dict[str, object]:
    """What the flags change in the model's config (``--dtype auto``: a checkpoint's own)."""
    return {
        "block_size": options.block_size,
        "total_blocks": total_blocks,
        "device": options.device,
        "dtype": dtype_value(options.dtype),
    }


def model_config(options: BenchOptions, total_blocks: int) -> ModelConfig:
    """A preset's config, or a checkpoint's (no weight read), with a pool of ``total_blocks``."""
    if options.model in PRESETS:
        return preset(options.model, **_changes(options, total_blocks))
    from common.checkpoint import checkpoint_config

    return checkpoint_config(options.model, **_changes(options, total_blocks))


def bench_config(workload, model: str = "bench", **changes: object) -> ModelConfig:
    """The preset ``model`` with a KV pool sized for ``workload`` (the suites' and tests')."""
    cfg = preset(model, **changes)
    return cfg.replace(total_blocks=workload.pool_blocks(cfg.block_size))


def check_pool_fits(workload, block_size: int) -> None:
    """The core's check that the pool holds the largest request, on the flags alone."""
    pool = ModelConfig(block_size=block_size, total_blocks=workload.pool_blocks(block_size))
    check_fits_pool(max(workload.prompt_lengths()), workload.max_new_tokens, pool)


def check_workload_memory(options: BenchOptions, total_blocks: int, prompt_tokens: int) -> None:
    """The weights, one KV pool and the prompts against the machine's memory, before any is
    made: a size it cannot hold is one ``error:`` line."""
    cfg = model_config(options, total_blocks)
    check_memory(cfg, weights=True, extra={"the prompts": PROMPT_BYTES_PER_TOKEN * prompt_tokens})


def load_model(options: BenchOptions, total_blocks: int) -> tuple[ModelConfig, Weights | None]:
    """``(cfg, weights)``: a preset with seeded weights (``weights`` None: each model draws
    them), or a checkpoint read once (every step's model and every peer share its tensors)."""
    if options.model in PRESETS:
        return model_config(options, total_blocks), None
    from common.checkpoint import load_checkpoint  # needs safetensors: pip install -e '.[real]'

    return load_checkpoint(options.model, **_changes(options, total_blocks))


def load_workload_model(
    options: BenchOptions, workload, progress: Progress
) -> tuple[ModelConfig, Weights | None]:
    """The model for ``workload``'s pool, once the memory check has passed."""
    total = workload.pool_blocks(options.block_size)
    check_workload_memory(options, total, sum(workload.prompt_lengths()))
    with progress.task(f"loading {options.model}"):
        return load_model(options, total)


@dataclass
class StepModel:
    """One step's package and its model, built once; each run gets a fresh engine."""

    step: ModuleType
    model: torch.nn.Module

    @property
    def cfg(self) -> ModelConfig:
        return self.model.cfg

    def engine(self, **kwargs: object):
        """A fresh ``PagedPrefixCacheEngine`` on this model (``max_running``, ...)."""
        return self.step.PagedPrefixCacheEngine(self.model, **kwargs)


def load_step_model(name: str, cfg: ModelConfig, weights: Weights | None = None) -> StepModel:
    """Step ``name``'s model of ``cfg``: seeded weights, or ``weights``, shared, not copied."""
    step = load_step(name)
    model = step.TinyTransformerPaged(cfg)
    if weights is not None:
        model.load_weights(weights)
    return StepModel(step, model)
