"""The same model as a Hugging Face ``LlamaForCausalLM``: the outside oracle.

Our parameter names are HF's, so the very same state dict loads into ``LlamaForCausalLM``.
The tests compare every step with it (``tests/engine/test_hf_oracle.py``): a convention that the
project's own dense reference shares with the steps (the RoPE layout, the K/V head a query
head reads) cannot hide from a model written by someone else. ``bench/peers/hf.py`` times it.

Needs ``transformers`` (``pip install -e '.[hf]'``), imported only when called.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ..config import ModelConfig
from ..weights import make_state_dict


def default_max_positions(cfg: ModelConfig) -> int:
    """A ``max_position_embeddings`` for a config that comes without one (the seeded presets).

    Neither our model nor HF's Llama computes anything from it (the ``llama3`` scaling reads
    its own ``original_max_position_embeddings``), but transformers checks it: it must exceed
    the scaling's original context, or a warning lands in the middle of the output. A llama3
    model's context is the original one stretched by the scaling's factor.
    """
    if cfg.rope_scaling is None:
        return 8192
    scaling = cfg.rope_scaling
    return scaling.original_max_position_embeddings * max(2, int(scaling.factor))


def hf_config_dict(cfg: ModelConfig, max_position_embeddings: int | None = None) -> dict[str, Any]:
    """``cfg`` as the keyword arguments of ``LlamaConfig`` (the fields of a ``config.json``).

    RoPE goes in the older ``rope_theta`` + ``rope_scaling`` layout, which every transformers
    version reads (current ones convert it to ``rope_parameters`` themselves).
    ``max_position_embeddings``: the one given, else the checkpoint's own
    (``cfg.max_position_embeddings``), else ``default_max_positions``.
    """
    scaling = None
    if cfg.rope_scaling is not None:
        s = cfg.rope_scaling
        scaling = {
            "rope_type": "llama3",
            "factor": s.factor,
            "low_freq_factor": s.low_freq_factor,
            "high_freq_factor": s.high_freq_factor,
            "original_max_position_embeddings": s.original_max_position_embeddings,
        }
    return {
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model,
        "intermediate_size": cfg.d_ff,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
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
    ``cfg.dtype`` on ``cfg.device``, in eval mode.

    ``attn``: HF's attention implementation (``"eager"``: the plain matmul-softmax-matmul the
    tests compare with; None: HF's default, ``"sdpa"``, the fast one the benchmark times).
    ``max_position_embeddings``: the checkpoint's (see ``hf_config_dict``).
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    extra = {} if attn is None else {"attn_implementation": attn}
    hf_cfg = LlamaConfig(**hf_config_dict(cfg, max_position_embeddings), **extra)
    model = LlamaForCausalLM(hf_cfg)
    state = dict(make_state_dict(cfg) if weights is None else weights)
    if cfg.tie_word_embeddings:  # HF ties lm_head to the embedding itself
        state.setdefault("lm_head.weight", state["model.embed_tokens.weight"])
    model.load_state_dict(state)
    return model.to(device=cfg.device, dtype=cfg.dtype).eval()
