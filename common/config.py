"""Model and memory configuration, shared by every step and by the reference model."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

# The dtypes a model can be built in, under the names --dtype takes.
DTYPES = {
    "float32": torch.float32,
    "float64": torch.float64,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}


def parse_dtype(value: str | torch.dtype, name: str = "dtype") -> torch.dtype:
    """A dtype the model can compute in, given as a torch dtype or by name.

    Hugging Face users write ``dtype="bfloat16"`` (or ``"torch.bfloat16"``), command lines
    ``--dtype bfloat16``; both mean ``torch.bfloat16`` here. Anything else is a ``ValueError``
    that names the argument (``name``) and the choices.
    """
    if isinstance(value, torch.dtype):
        if value not in DTYPES.values():
            raise ValueError(f"{name}={value}: choose from {', '.join(DTYPES)}")
        return value
    if isinstance(value, str) and value.removeprefix("torch.") in DTYPES:
        return DTYPES[value.removeprefix("torch.")]
    raise ValueError(f"{name}={value!r} is not a dtype; choose from {', '.join(DTYPES)}")


@dataclass(frozen=True)
class Llama3RopeScaling:
    """The ``llama3`` RoPE frequency scaling of Llama 3.1/3.2 checkpoints (HF's field names).

    Long wavelengths (low frequencies) are stretched by ``factor`` so that positions beyond the
    pre-training context still rotate slowly; short wavelengths are left alone; the band between
    is interpolated smoothly. A frozen dataclass, not a dict, so that ``ModelConfig`` stays
    hashable.
    """

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self) -> None:
        if self.factor <= 0 or self.original_max_position_embeddings < 1:
            raise ValueError(f"invalid llama3 rope scaling {self}")
        if not 0 < self.low_freq_factor < self.high_freq_factor:
            raise ValueError(
                f"llama3 rope scaling needs 0 < low_freq_factor < high_freq_factor, got {self}"
            )


# Fields whose default is derived from others: None means "derive it".
_DERIVED = ("num_kv_heads", "head_dim")


@dataclass(frozen=True)
class ModelConfig:
    """A Llama-style decoder plus the geometry of its paged KV pool.

    ``block_size`` and ``total_blocks`` describe memory, not the network: the reference model
    ignores them, and the paged model sizes ``kv_pool_k`` / ``kv_pool_v`` from them.

    ``num_kv_heads`` (grouped-query attention) defaults to ``num_heads``, the chapter's plain
    multi-head attention; ``head_dim`` defaults to ``d_model // num_heads``. Both are resolved
    when the config is built, and re-derived by ``replace`` unless they were given explicitly.
    ``seed=None`` builds a model without weights, for a loader to fill (``from_pretrained``).
    ``max_model_len`` is the longest a request may be, prompt + max_new_tokens (vLLM's name);
    None, no limit. A checkpoint sets it to its ``max_position_embeddings``, the positions it
    was trained on, kept beside it so that a caller who raises the limit can be told so.
    """

    vocab_size: int = 1024
    d_model: int = 256
    num_heads: int = 8
    num_layers: int = 4
    d_ff: int = 688
    num_kv_heads: int | None = None
    head_dim: int | None = None
    tie_word_embeddings: bool = False
    rope_theta: float = 10000.0
    rope_scaling: Llama3RopeScaling | None = None
    rms_norm_eps: float = 1e-6
    block_size: int = 16
    total_blocks: int = 512
    dtype: torch.dtype | str = torch.float32  # a name ("bfloat16") becomes the torch dtype
    device: str = "cpu"
    seed: int | None = 0
    max_model_len: int | None = None
    max_position_embeddings: int | None = None  # a checkpoint's trained positions, if known

    def __post_init__(self) -> None:
        # Which of _DERIVED were left to their default, so that replace() derives them again.
        # A plain attribute, not a field: not part of the config's value (==, hash, asdict).
        derived = frozenset(name for name in _DERIVED if getattr(self, name) is None)
        object.__setattr__(self, "_derived", derived)
        object.__setattr__(self, "dtype", parse_dtype(self.dtype))
        if self.num_kv_heads is None:
            object.__setattr__(self, "num_kv_heads", self.num_heads)
        if self.head_dim is None:
            if self.num_heads >= 1 and self.d_model % self.num_heads:
                raise ValueError(
                    f"d_model={self.d_model} is not divisible by num_heads={self.num_heads}"
                )
            object.__setattr__(self, "head_dim", self.d_model // max(self.num_heads, 1))
        positive = (
            "vocab_size",
            "d_model",
            "num_heads",
            "num_layers",
            "d_ff",
            "num_kv_heads",
            "head_dim",
            "block_size",
            "total_blocks",
        )
        positive += tuple(
            name
            for name in ("max_model_len", "max_position_embeddings")
            if getattr(self, name) is not None
        )
        for name in positive:
            if getattr(self, name) < 1:
                raise ValueError(f"ModelConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads={self.num_heads} is not a multiple of num_kv_heads="
                f"{self.num_kv_heads}: each KV head must serve the same number of query heads"
            )
        if self.d_head % 2:
            raise ValueError(f"d_head={self.d_head} must be even for rotary embeddings")

    @property
    def d_head(self) -> int:
        """Per-head width (HF's ``head_dim``): ``d_model // num_heads`` unless given."""
        assert self.head_dim is not None  # resolved in __post_init__
        return self.head_dim

    @property
    def num_queries_per_kv(self) -> int:
        """How many query heads share one K/V head (vLLM's name; 1 = multi-head attention)."""
        assert self.num_kv_heads is not None  # resolved in __post_init__
        return self.num_heads // self.num_kv_heads

    @property
    def dtype_name(self) -> str:
        """``float32``, ``bfloat16``...: the dtype under the name ``--dtype`` takes."""
        return str(self.dtype).removeprefix("torch.")

    def kv_bytes_per_token(self, kv_heads: int | None = None) -> int:
        """K and V of one token position in every layer: what any KV cache stores per token,
        paged (``x block_size`` per block) or dense (``x positions``). Grouped-query attention
        shrinks it by storing ``num_kv_heads`` heads, not ``num_heads`` (``kv_heads`` overrides
        them, to show what a model without GQA would need)."""
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        heads = self.num_kv_heads if kv_heads is None else kv_heads
        return 2 * self.num_layers * heads * self.d_head * itemsize

    def replace(self, **changes: object) -> ModelConfig:
        """A copy with some fields changed; derived defaults follow the fields they come from
        (``tiny.replace(num_heads=8)`` still has 8 K/V heads, not tiny's 4)."""
        for name in self._derived:
            changes.setdefault(name, None)
        return replace(self, **changes)


# Small enough that hundreds of random scenarios run in seconds.
_TINY = ModelConfig(
    vocab_size=512, d_model=64, num_heads=4, num_layers=2, d_ff=172, block_size=4, total_blocks=128
)

PRESETS: dict[str, ModelConfig] = {
    "tiny": _TINY,
    # One layer of tiny: the model's share of a request is small, so the engine's own cost
    # shows (python -m bench --workload scale), and a pool of a million blocks takes 2 GiB.
    "toy": _TINY.replace(num_layers=1),
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
    # A real size: the shapes of SmolLM2-135M (HuggingFaceTB/SmolLM2-135M's config.json), with
    # seeded random weights, so that python -m bench --model smollm2-135m shows the steps where
    # a user's model lives, with nothing downloaded (its text needs the real checkpoint).
    "smollm2-135m": ModelConfig(
        vocab_size=49152,
        d_model=576,
        num_heads=9,
        num_kv_heads=3,
        num_layers=30,
        d_ff=1536,
        tie_word_embeddings=True,
        rope_theta=100000.0,
        rms_norm_eps=1e-5,
        block_size=16,
        total_blocks=1024,
        max_position_embeddings=8192,
    ),
}


def preset(name: str, **changes: object) -> ModelConfig:
    """A named preset, optionally with some fields changed (``preset("tiny", block_size=8)``)."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose from {sorted(PRESETS)}")
    return PRESETS[name].replace(**changes)
