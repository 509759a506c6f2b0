"""The correctness oracle: a dense, cache-free model with the same config and weights.

No KV cache, no blocks, no chunks: every call recomputes attention over the whole sequence
with a plain causal mask. It is slow on purpose and simple enough to trust; every step's paged
engine must reproduce its tokens, greedy or sampled with a seed.
"""

from __future__ import annotations

import math

import torch

from .config import ModelConfig
from .layers import CausalLM, compute_dtype, rope_cos_sin
from .sampler import SamplingState, sample
from .sampling_params import GREEDY, SamplingParams


class ReferenceModel(CausalLM):
    """``forward(token_ids [T]) -> logits [T, vocab]`` over the full sequence."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg)

    @torch.inference_mode()
    def forward(self, token_ids: torch.Tensor | list[int]) -> torch.Tensor:
        ids = self.token_tensor(token_ids)
        seq_len = ids.shape[0]
        cos, sin = rope_cos_sin(torch.arange(seq_len, device=ids.device), self.cfg)
        causal = torch.ones(seq_len, seq_len, dtype=torch.bool, device=ids.device).tril()
        x = self.model.embed_tokens(ids)
        for layer in self.model.layers:
            q, k, v = layer.self_attn.qkv(layer.input_layernorm(x), cos, sin)
            attn = dense_attention(q, k, v, causal)
            x = x + layer.self_attn.o_proj(attn.reshape(seq_len, -1))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return self.lm_head(self.model.norm(x))


def dense_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor
) -> torch.Tensor:
    """softmax(q·kᵀ/√d)·v for q ``[T, H, d_head]``, k and v ``[S, KV, d_head]``; softmax in
    float32 or wider.

    Grouped-query attention the plainest way: each K/V head is repeated for the query heads it
    serves (head ``h`` reads K/V head ``h // group``), then it is ordinary multi-head attention.
    """
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.einsum("thd,shd->hts", q, k) / math.sqrt(q.shape[-1])
    scores = scores.masked_fill(~allowed, float("-inf"))
    probs = scores.to(compute_dtype(q.dtype)).softmax(dim=-1).to(q.dtype)
    return torch.einsum("hts,shd->thd", probs, v)


@torch.inference_mode()
def reference_generate(
    model: ReferenceModel,
    prompts: list[list[int]],
    max_new_tokens: int,
    eos_token_id: int | None = None,
    sampling_params: SamplingParams | None = None,
) -> list[list[int]]:
    """Decoding by recomputing the whole sequence for every new token: greedy, or drawn as
    ``sampling_params`` says (its seed given, since there is no engine to give one) with the
    engines' own sampler, which makes the k-th draw depend on the seed, k and the logits alone.
    ``sampling_params.max_tokens`` and its stop ids do not end a request: ``max_new_tokens``
    and ``eos_token_id`` say when to stop (``min_tokens`` holds back both kinds of id)."""
    params = sampling_params or GREEDY
    if not params.greedy and params.seed is None:
        raise ValueError("the reference samples only with a seed")
    stop_ids = frozenset(params.stop_token_ids) | (
        frozenset() if eos_token_id is None else {eos_token_id}
    )
    outputs = []
    for prompt in prompts:
        tokens, generated = list(prompt), []
        for _ in range(max_new_tokens):
            state = SamplingState(params, prompt, generated, stop_ids)
            next_id = sample(model(tokens)[-1:], [state]).token_ids[0]
            generated.append(next_id)
            tokens.append(next_id)
            if next_id == eos_token_id:
                break
        outputs.append(generated)
    return outputs
