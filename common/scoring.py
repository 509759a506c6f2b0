"""Prompt logprobs by a scoring pass of their own: the paged engine never computes them.

A request that asks for its prompt's logprobs (vLLM's ``prompt_logprobs``) needs the logits of
every prompt position, not only the last one the engine samples from. vLLM's model runner keeps
them for such a request in the same forward pass. Here they come from a dense pass over the
same weights, once, when the request's first token is handed out (``common/outputs.py``): the
steps' files, which teach the chapter, stay free of it.

It gives the engine's own numbers because such a request reads nothing from the prefix cache
(``SamplingParams.skip_reading_prefix_cache``, vLLM's rule): each prompt position would be
computed from the same weights and tokens anyway, and in float64 the two agree to the last bits
(the tests compare both with the reference model).
"""

from __future__ import annotations

import torch

from .layers import CausalLM, rope_cos_sin
from .reference import dense_attention
from .sampler import token_logprobs
from .sampling_params import TokenLogprobs

# The most attention scores held at once (query rows x keys x heads): a long prompt is scored
# a few query rows at a time, so its cost in memory grows with its length, not its square.
MAX_SCORES = 1 << 24


@torch.inference_mode()
def prompt_logprobs(
    model: CausalLM, prompt_ids: list[int], num_top: int
) -> list[TokenLogprobs | None]:
    """One entry per prompt token: None for the first (nothing comes before it), then each
    token's logprob given the ones before it, with the ``num_top`` most likely."""
    if len(prompt_ids) < 2:
        return [None]
    hidden = dense_hidden_states(model, prompt_ids[:-1])  # row i predicts token i + 1
    entries: list[TokenLogprobs | None] = [None]
    rows = max(1, MAX_SCORES // model.cfg.vocab_size)
    for a in range(0, hidden.shape[0], rows):
        logits = model.lm_head(model.model.norm(hidden[a : a + rows]))
        targets = prompt_ids[a + 1 : a + 1 + logits.shape[0]]
        entries += token_logprobs(logits, targets, [num_top] * len(targets))
    return entries


def dense_hidden_states(model: CausalLM, token_ids: list[int]) -> torch.Tensor:
    """The last layer's output ``[T, d_model]`` (before the final norm), every position at once,
    no KV pool: the reference model's pass, its attention cut into blocks of query rows."""
    ids = model.token_tensor(token_ids)
    seq_len, cfg = ids.shape[0], model.cfg
    positions = torch.arange(seq_len, device=ids.device)
    cos, sin = rope_cos_sin(positions, cfg)
    rows = max(1, MAX_SCORES // (cfg.num_heads * max(seq_len, 1)))
    x = model.model.embed_tokens(ids)
    for layer in model.model.layers:
        q, k, v = layer.self_attn.qkv(layer.input_layernorm(x), cos, sin)
        attn = torch.cat(
            [
                dense_attention(q[a : a + rows], k, v, positions <= positions[a : a + rows, None])
                for a in range(0, seq_len, rows)
            ]
        )
        x = x + layer.self_attn.o_proj(attn.reshape(seq_len, -1))
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    return x
