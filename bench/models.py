"""The bench's model: its config and weights (a preset or a checkpoint), checked against the
machine's memory before anything is read, and one step's model built on them."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import ModuleType

import torch

from common.config import ModelConfig, preset
from common.inputs import check_fits_pool
from common.memory import check_memory
from front.build import ModelSource, Weights
from front.steps import load_step, step_engine_args

from .options import BenchOptions
from .progress import Progress

# A prompt token, as a Python int in a list: the list's 8-byte slot and a 28-byte int object.
PROMPT_BYTES_PER_TOKEN = 36


def model_source(options: BenchOptions, total_blocks: int) -> ModelSource:
    """A preset's config, or a checkpoint's (no weight read), with a pool of ``total_blocks``
    (``--dtype auto``: a checkpoint's own)."""
    return ModelSource.open(options.model, options.engine_options(), total_blocks=total_blocks)


def model_config(options: BenchOptions, total_blocks: int) -> ModelConfig:
    return model_source(options, total_blocks).cfg


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
    source = model_source(options, total_blocks)
    return source.cfg, source.read_weights()


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
    # what only this step's engine takes, from the flags (step14_9's max_num_batched_tokens)
    engine_args: dict[str, object] = field(default_factory=dict)

    @property
    def cfg(self) -> ModelConfig:
        return self.model.cfg

    def engine(self, **kwargs: object):
        """A fresh ``PagedPrefixCacheEngine`` on this model (``max_running``, ...)."""
        return self.step.PagedPrefixCacheEngine(self.model, **self.engine_args, **kwargs)


def load_step_model(
    name: str, cfg: ModelConfig, weights: Weights | None = None, options: BenchOptions | None = None
) -> StepModel:
    """Step ``name``'s model of ``cfg``: seeded weights, or ``weights``, shared, not copied;
    its engines take the engine flags of ``options`` that only some steps' engines take."""
    step = load_step(name)
    args = step_engine_args(name, options) if options is not None else {}
    return StepModel(step, ModelSource(name, cfg).build_model(step, weights), args)
