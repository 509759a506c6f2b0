"""Model and memory configuration, shared by every step and by the reference model."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch


@dataclass(frozen=True)
class ModelConfig:
    """A Llama-style decoder plus the geometry of its paged KV pool.

    ``block_size`` and ``total_blocks`` describe memory, not the network: the reference model
    ignores them, and the paged model sizes ``kv_pool_k`` / ``kv_pool_v`` from them.
    """

    vocab_size: int = 1024
    d_model: int = 256
    num_heads: int = 8
    num_layers: int = 4
    d_ff: int = 688
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    block_size: int = 16
    total_blocks: int = 512
    dtype: torch.dtype = torch.float32
    device: str = "cpu"
    seed: int = 0

    def __post_init__(self) -> None:
        positive = (
            "vocab_size",
            "d_model",
            "num_heads",
            "num_layers",
            "d_ff",
            "block_size",
            "total_blocks",
        )
        for name in positive:
            if getattr(self, name) < 1:
                raise ValueError(f"ModelConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.d_model % self.num_heads:
            raise ValueError(
                f"d_model={self.d_model} is not divisible by num_heads={self.num_heads}"
            )
        if self.d_head % 2:
            raise ValueError(f"d_head={self.d_head} must be even for rotary embeddings")
        if not self.dtype.is_floating_point:
            raise ValueError(f"dtype must be a floating point dtype, got {self.dtype}")

    @property
    def d_head(self) -> int:
        return self.d_model // self.num_heads

    def replace(self, **changes: object) -> ModelConfig:
        return replace(self, **changes)


PRESETS: dict[str, ModelConfig] = {
    # Small enough that hundreds of random scenarios run in seconds.
    "tiny": ModelConfig(
        vocab_size=512,
        d_model=64,
        num_heads=4,
        num_layers=2,
        d_ff=172,
        block_size=4,
        total_blocks=128,
    ),
    # The chapter's demo (python -m stepN.run).
    "demo": ModelConfig(),
    # The side-by-side benchmark: big enough that the model's work is not all Python overhead.
    "bench": ModelConfig(
        vocab_size=2048,
        d_model=512,
        num_heads=8,
        num_layers=4,
        d_ff=1376,
        block_size=16,
        total_blocks=1024,
    ),
}


def preset(name: str, **changes: object) -> ModelConfig:
    """A named preset, optionally with some fields changed (``preset("tiny", block_size=8)``)."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose from {sorted(PRESETS)}")
    return PRESETS[name].replace(**changes)


DTYPES = {
    "float32": torch.float32,
    "float64": torch.float64,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}


def parse_dtype(name: str) -> torch.dtype:
    """Command-line dtype names (``float32``, ``bfloat16``, ...) to torch dtypes."""
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; choose from {sorted(DTYPES)}")
    return DTYPES[name]
