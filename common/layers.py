"""Llama-style building blocks whose math is identical in every step and in the reference.

Module and parameter names mirror Hugging Face's ``LlamaForCausalLM`` so that a state dict of
this model reads like one of a real checkpoint. Attention itself is not here: how K/V are stored
and read is what the steps are about, so each step's ``model.py`` owns it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .config import ModelConfig
from .weights import make_state_dict


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


def rope_cos_sin(positions: torch.Tensor, cfg: ModelConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables ``[T, d_head]`` for absolute ``positions`` ("rotate half" layout).

    Positions are absolute (``start_pos + i``): a chunk prefilled at offset 32 must rotate its
    keys exactly as a full-prompt forward would, or cached KV would not match recomputed KV.
    """
    cdt = compute_dtype(cfg.dtype)
    exponents = torch.arange(0, cfg.d_head, 2, dtype=cdt, device=positions.device) / cfg.d_head
    inv_freq = 1.0 / (cfg.rope_theta**exponents)
    freqs = positions.to(cdt)[:, None] * inv_freq[None, :]
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
    """The four projections of multi-head attention (K/V heads = query heads, no biases)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.num_heads, self.d_head = cfg.num_heads, cfg.d_head
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            setattr(self, name, nn.Linear(cfg.d_model, cfg.d_model, bias=False))

    def qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """``x [T, d_model]`` → rotated q, rotated k, v, each ``[T, H, d_head]``."""
        shape = (x.shape[0], self.num_heads, self.d_head)
        q = self.q_proj(x).view(shape)
        k = self.k_proj(x).view(shape)
        v = self.v_proj(x).view(shape)
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


class CausalLM(nn.Module):
    """Backbone + untied ``lm_head``, with deterministic weights from ``cfg.seed``.

    The paged model of every step and the dense reference both derive from this, so they hold
    the very same parameters under the very same names.
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.model = LlamaBackbone(cfg)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.load_state_dict(make_state_dict(cfg))
        self.to(device=cfg.device, dtype=cfg.dtype)
        self.eval()

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    def token_tensor(self, token_ids: torch.Tensor | list[int]) -> torch.Tensor:
        return torch.as_tensor(token_ids, dtype=torch.long, device=self.device)
