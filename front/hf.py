"""The same model as a Hugging Face ``LlamaForCausalLM``: the outside oracle.

Our parameter names are HF's, so the very same state dict loads into ``LlamaForCausalLM``.
The tests compare every step with it (``tests/engine/test_hf_oracle.py``): a convention that the
project's own dense reference shares with the steps (the RoPE layout, the K/V head a query
head reads) cannot hide from a model written by someone else. ``bench/peers/hf.py`` times it.

Needs ``transformers`` (``pip install -e '.[hf]'``), imported only when called.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch

from common.checkpoint import REQUIRED_FIELDS
from common.config import ModelConfig
from common.weights import make_state_dict


def default_max_positions(cfg: ModelConfig) -> int:
    """A ``max_position_embeddings`` for a config without one (the presets). No Llama computes
    anything from it, but transformers warns unless it exceeds a llama3 scaling's original
    context: that context stretched by the scaling's factor."""
    if cfg.rope_scaling is None:
        return 8192
    scaling = cfg.rope_scaling
    return scaling.original_max_position_embeddings * max(2, int(scaling.factor))


def hf_config_dict(cfg: ModelConfig, max_position_embeddings: int | None = None) -> dict[str, Any]:
    """``cfg`` as the keyword arguments of ``LlamaConfig`` (the fields of a ``config.json``,
    the inverse of ``common.checkpoint.config_from_hf``). RoPE goes in the older ``rope_theta``
    + ``rope_scaling`` layout, which every transformers version reads."""
    scaling = None
    if cfg.rope_scaling is not None:
        scaling = {"rope_type": "llama3", **dataclasses.asdict(cfg.rope_scaling)}
    return {
        **{theirs: getattr(cfg, ours) for theirs, ours in REQUIRED_FIELDS.items()},
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.d_head,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": scaling,
        "max_position_embeddings": (
            max_position_embeddings
            or cfg.max_position_embeddings
            or cfg.max_model_len
            or default_max_positions(cfg)
        ),
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": None,
        "eos_token_id": None,
        "pad_token_id": 0,
    }


def hf_llama(
    cfg: ModelConfig,
    weights: Mapping[str, torch.Tensor] | None = None,
    attn: str | None = None,
    max_position_embeddings: int | None = None,
) -> Any:
    """A ``LlamaForCausalLM`` holding ``weights`` (default: ours from ``cfg.seed``), in
    ``cfg.dtype`` on ``cfg.device``, in eval mode. ``attn``: HF's attention implementation
    (``"eager"``, the plain one the tests compare with; None: HF's default, ``"sdpa"``)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    extra = {} if attn is None else {"attn_implementation": attn}
    hf_cfg = LlamaConfig(**hf_config_dict(cfg, max_position_embeddings), **extra)
    model = LlamaForCausalLM(hf_cfg)
    state = dict(make_state_dict(cfg) if weights is None else weights)
    if cfg.tie_word_embeddings:  # HF ties lm_head to the embedding itself
        state.setdefault("lm_head.weight", state["model.embed_tokens.weight"])
    model.load_state_dict(state)
    return model.to(device=cfg.device, dtype=cfg.dtype).eval()
