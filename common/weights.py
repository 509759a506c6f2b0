"""Deterministic weights: the same seed gives the same parameters in every step.

Weights are drawn in float64 on the CPU from one seeded generator, in a fixed order, and only
then cast to the model's dtype and device, so float32 and float64 models (and CPU and GPU ones)
share the same underlying numbers.

The scales are chosen for a *decisive* random model: logits with a wide spread (top-1/top-2
margins far above float32 rounding, so every step picks the same argmax) and attention sharp
enough that the output depends on the context, so greedy generations do not collapse into one
repeated token.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch

from .config import ModelConfig
from .errors import CheckpointError  # also imported from here, as common.weights.CheckpointError

LOGIT_SCALE = 8.0  # std of the logits for a unit-RMS final hidden state
QK_GAIN = 1.5  # >1 sharpens attention scores
# With tied embeddings the logits are <hidden, embedding>, and a residual stream still close to
# the input token's own embedding scores that token highest: greedy decoding would repeat the
# last token forever. Louder attention/MLP outputs (o_proj, down_proj) drown it out, as the
# residual stream of a trained model does.
TIED_RESIDUAL_GAIN = 6.0


def _layer_shapes(cfg: ModelConfig, i: int) -> list[tuple[str, tuple[int, ...], float]]:
    d, f = cfg.d_model, cfg.d_ff
    q_width = cfg.num_heads * cfg.d_head  # = d_model unless a checkpoint sets head_dim
    kv_width = cfg.num_kv_heads * cfg.d_head  # grouped-query attention: fewer K/V heads
    p = f"model.layers.{i}."
    proj = 1.0 / math.sqrt(d)
    out_gain = TIED_RESIDUAL_GAIN if cfg.tie_word_embeddings else 1.0
    return [
        (p + "input_layernorm.weight", (d,), 0.0),
        (p + "self_attn.q_proj.weight", (q_width, d), QK_GAIN * proj),
        (p + "self_attn.k_proj.weight", (kv_width, d), QK_GAIN * proj),
        (p + "self_attn.v_proj.weight", (kv_width, d), proj),
        (p + "self_attn.o_proj.weight", (d, q_width), out_gain / math.sqrt(q_width)),
        (p + "post_attention_layernorm.weight", (d,), 0.0),
        (p + "mlp.gate_proj.weight", (f, d), proj),
        (p + "mlp.up_proj.weight", (f, d), proj),
        (p + "mlp.down_proj.weight", (d, f), out_gain / math.sqrt(f)),
    ]


def weight_shapes(cfg: ModelConfig) -> list[tuple[str, tuple[int, ...], float]]:
    """(HF parameter name, shape, std) in generation order. A std of 0 marks a norm weight.

    This is also the list a checkpoint must hold, name for name and shape for shape. With tied
    embeddings there is no ``lm_head.weight``: the output projection *is* the embedding matrix,
    as in HF (whose ``save_pretrained`` leaves the tied copy out).
    """
    shapes = [("model.embed_tokens.weight", (cfg.vocab_size, cfg.d_model), 1.0)]
    for i in range(cfg.num_layers):
        shapes += _layer_shapes(cfg, i)
    shapes.append(("model.norm.weight", (cfg.d_model,), 0.0))
    if not cfg.tie_word_embeddings:
        lm_head_std = LOGIT_SCALE / math.sqrt(cfg.d_model)
        shapes.append(("lm_head.weight", (cfg.vocab_size, cfg.d_model), lm_head_std))
    return shapes


def make_state_dict(cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """A state dict with HF ``LlamaForCausalLM`` names (float64, CPU) from ``cfg.seed``."""
    if cfg.seed is None:
        raise ValueError("cfg.seed is None: this config's weights come from a checkpoint")
    gen = torch.Generator().manual_seed(cfg.seed)
    state = {}
    for name, shape, std in weight_shapes(cfg):
        noise = torch.randn(shape, generator=gen, dtype=torch.float64)
        # Norm weights near 1 (not exactly 1), so that a swapped or missing one changes outputs.
        state[name] = 1.0 + 0.1 * noise if std == 0.0 else std * noise
    return state


def check_weights(weights: Mapping[str, torch.Tensor], cfg: ModelConfig) -> None:
    """Raise ``CheckpointError`` unless ``weights`` has exactly the names and shapes of
    ``weight_shapes(cfg)``: every problem is listed, so one run shows what is wrong."""
    expected = {name: shape for name, shape, _ in weight_shapes(cfg)}
    problems = [
        f"missing tensor {name} {shape}" for name, shape in expected.items() if name not in weights
    ]
    for name, tensor in weights.items():
        if name not in expected:
            problems.append(f"unexpected tensor {name} {tuple(tensor.shape)}")
        elif tuple(tensor.shape) != expected[name]:
            problems.append(
                f"tensor {name} has shape {tuple(tensor.shape)}, the config implies "
                f"{expected[name]}"
            )
    if problems:
        shown = "\n  ".join(problems[:12])
        more = f"\n  ... and {len(problems) - 12} more" if len(problems) > 12 else ""
        raise CheckpointError(f"the weights do not fit the config:\n  {shown}{more}")
