"""Llama-style building blocks whose math is identical in every step and in the reference.

Module and parameter names mirror Hugging Face's ``LlamaForCausalLM`` so that a state dict of
this model reads like one of a real checkpoint. Attention itself is not here: how K/V are stored
and read is what the steps are about, so each step's ``model.py`` owns it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import TypeVar

import torch
import torch.nn.functional as F
from torch import nn

from .checkpoint import Checkpoint
from .config import Llama3RopeScaling, ModelConfig
from .memory import check_memory
from .weights import check_weights, make_state_dict


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Precision for norms, rotary angles and softmax: float32, or the model dtype if wider."""
    return torch.float64 if dtype == torch.float64 else torch.float32


class RMSNorm(nn.Module):
    """``weight * x / rms(x)``, normalized in float32 or wider, cast back before the weight."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.to(compute_dtype(x.dtype))
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def rope_inv_freq(cfg: ModelConfig, device: torch.device | str = "cpu") -> torch.Tensor:
    """Rotation speed of each dimension pair: ``1 / theta^(2i / d_head)``, then scaled.

    Pair ``i`` of every head turns by ``inv_freq[i]`` radians per position; the first pairs
    turn fast (fine position), the last ones slowly (coarse position).
    """
    cdt = compute_dtype(cfg.dtype)
    exponents = torch.arange(0, cfg.d_head, 2, dtype=cdt, device=device) / cfg.d_head
    inv_freq = 1.0 / (cfg.rope_theta**exponents)
    if cfg.rope_scaling is not None:
        inv_freq = llama3_scaled_inv_freq(inv_freq, cfg.rope_scaling)
    return inv_freq


def llama3_scaled_inv_freq(inv_freq: torch.Tensor, scaling: Llama3RopeScaling) -> torch.Tensor:
    """Llama 3.1's RoPE scaling: slow pairs are slowed by ``factor``, fast ones kept.

    A pair whose wavelength (positions per full turn) is longer than the pre-training context
    divided by ``low_freq_factor`` never completed a turn in training: it is stretched by
    ``factor``, so a longer context maps onto angles the model has seen. A pair shorter than the
    context divided by ``high_freq_factor`` encodes local order and is kept. Pairs in between
    are blended linearly in ``context / wavelength``, so the spectrum has no jump.
    """
    context = scaling.original_max_position_embeddings
    wavelen = 2 * math.pi / inv_freq
    stretched = inv_freq / scaling.factor
    # 0 at the long end of the band (all stretched), 1 at the short end (all kept).
    smooth = (context / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    blended = (1 - smooth) * stretched + smooth * inv_freq
    long_wave = wavelen > context / scaling.low_freq_factor
    short_wave = wavelen < context / scaling.high_freq_factor
    return torch.where(long_wave, stretched, torch.where(short_wave, inv_freq, blended))


def rope_cos_sin(positions: torch.Tensor, cfg: ModelConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables ``[T, d_head]`` for absolute ``positions`` ("rotate half" layout).

    Positions are absolute (``start_pos + i``): a chunk prefilled at offset 32 must rotate its
    keys exactly as a full-prompt forward would, or cached KV would not match recomputed KV.
    """
    inv_freq = rope_inv_freq(cfg, positions.device)
    freqs = positions.to(inv_freq.dtype)[:, None] * inv_freq[None, :]
    angles = torch.cat((freqs, freqs), dim=-1)
    return angles.cos().to(cfg.dtype), angles.sin().to(cfg.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` of shape ``[T, H, d_head]`` by the angles of its token's position."""
    return x * cos[:, None, :] + rotate_half(x) * sin[:, None, :]


class MLP(nn.Module):
    """SwiGLU: ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.d_model, cfg.d_ff, bias=False)
        self.up_proj = nn.Linear(cfg.d_model, cfg.d_ff, bias=False)
        self.down_proj = nn.Linear(cfg.d_ff, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class AttentionProjections(nn.Module):
    """The four projections of attention (no biases), with grouped-query attention.

    ``num_heads`` query heads but only ``num_kv_heads`` K/V heads: each K/V head serves
    ``num_heads // num_kv_heads`` consecutive query heads (query head ``h`` reads K/V head
    ``h // group``, HF's ``repeat_kv`` order). K and V are what a KV cache stores, so fewer K/V
    heads shrink every block of the pool by the same factor.
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.d_head = cfg.num_heads, cfg.num_kv_heads, cfg.d_head
        q_width, kv_width = cfg.num_heads * cfg.d_head, cfg.num_kv_heads * cfg.d_head
        self.q_proj = nn.Linear(cfg.d_model, q_width, bias=False)
        self.k_proj = nn.Linear(cfg.d_model, kv_width, bias=False)
        self.v_proj = nn.Linear(cfg.d_model, kv_width, bias=False)
        self.o_proj = nn.Linear(q_width, cfg.d_model, bias=False)

    def qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """``x [T, d_model]`` → rotated q ``[T, H, d_head]``; rotated k, v ``[T, KV, d_head]``."""
        q = self.q_proj(x).view(x.shape[0], self.num_heads, self.d_head)
        k = self.k_proj(x).view(x.shape[0], self.num_kv_heads, self.d_head)
        v = self.v_proj(x).view(x.shape[0], self.num_kv_heads, self.d_head)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.self_attn = AttentionProjections(cfg)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.d_model, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.d_model, cfg.rms_norm_eps)


class LlamaBackbone(nn.Module):
    """Embedding, decoder layers and final norm: HF's ``LlamaForCausalLM.model``."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.d_model, cfg.rms_norm_eps)


ModelT = TypeVar("ModelT", bound="CausalLM")


class CausalLM(nn.Module):
    """Backbone + ``lm_head`` (tied to the embedding when the config says so).

    The paged model of every step and the dense reference both derive from this, so they hold
    the very same parameters under the very same names. Weights come from ``cfg.seed``
    (deterministic, the same in every step) or, with ``from_pretrained``, from a checkpoint.
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        # Shapes only, on the meta device: no memory and no throw-away random init, which for a
        # real model would cost seconds and gigabytes. load_weights assigns the real tensors.
        with torch.device("meta"):
            self.model = LlamaBackbone(cfg)
            self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.seed is not None:
            self.load_weights(make_state_dict(cfg))
        self.eval()

    def load_weights(self, weights: Mapping[str, torch.Tensor]) -> None:
        """Take every parameter from ``weights`` (HF names), cast to ``cfg.dtype`` and device.

        The names and shapes must be exactly those the config implies (``check_weights``): a
        missing tensor would leave a layer without weights, an unexpected one means the
        checkpoint is a different architecture. Either is an error, never a silent skip.
        """
        check_weights(weights, self.cfg)
        cast = {
            name: tensor.to(device=self.cfg.device, dtype=self.cfg.dtype)
            for name, tensor in weights.items()
        }
        tied = self.cfg.tie_word_embeddings
        self.load_state_dict(cast, strict=not tied, assign=True)
        if tied:  # one matrix both ways: token id -> vector, and vector -> score per token id
            self.lm_head.weight = self.model.embed_tokens.weight

    @classmethod
    def from_pretrained(
        cls: type[ModelT],
        path: str | Path | Checkpoint,
        config: ModelConfig | None = None,
        **overrides: object,
    ) -> ModelT:
        """A model from a local Hugging Face checkpoint directory (``config.json`` and
        ``*.safetensors``, sharded or not). Nothing is downloaded.

        ``path``: the directory, or a ``common.checkpoint.Checkpoint`` already open (a front
        end that checked its requests against it first), which is not opened again.
        ``overrides`` set the fields a checkpoint does not decide (``block_size``,
        ``total_blocks``, ``dtype``, ``device``); fields the engine cannot honour (biases,
        sliding windows, other RoPE scalings) are refused by name. See ``common.checkpoint``.
        ``config``: the checkpoint's config already read (``checkpoint.model_config(**overrides)``),
        in place of reading it again; as in Hugging Face's ``from_pretrained(config=...)``.
        """
        if config is not None and overrides:
            raise TypeError("give config= or overrides, not both: the config already has them")
        checkpoint = Checkpoint.open(path)
        cfg = config if config is not None else checkpoint.model_config(**overrides)
        check_memory(cfg, weights=True)  # the weights and the KV pool, before reading a weight
        model = cls(cfg)  # cfg.seed is None: shapes only, no random weights drawn
        model.load_weights(checkpoint.read_weights(cfg))
        return model

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    def token_tensor(self, token_ids: torch.Tensor | list[int]) -> torch.Tensor:
        return torch.as_tensor(token_ids, dtype=torch.long, device=self.device)
