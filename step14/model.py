"""TinyTransformerPaged: a Llama-style decoder whose KV lives in a global paged pool.

There is no ``past_key_values``: ``forward`` writes the chunk's K/V into ``kv_pool_k`` /
``kv_pool_v`` at the slots its ``block_table`` names, then reads the whole context back through
the same table. Which physical blocks hold a sequence is invisible to the math.

The chapter's engine writes each helper the plain way (Python loops over tokens, blocks, heads
and mask rows); steps 14_1 to 14_4 replace them one at a time, and 14_7 adds
``forward_batched``. Which of them this copy has, its README says.
"""

from __future__ import annotations

import math

import torch

from common.config import ModelConfig
from common.layers import CausalLM, compute_dtype, rope_cos_sin
from common.memory import check_memory


class TinyTransformerPaged(CausalLM):
    def __init__(self, cfg: ModelConfig) -> None:
        check_memory(cfg)  # the weights and the KV pool, before allocating either
        super().__init__(cfg)
        # [num_layers, total_blocks, block_size, num_kv_heads, d_head]: a block is a page frame
        # of block_size token slots; each slot holds every K/V head's vector. num_kv_heads =
        # num_heads unless the model uses grouped-query attention, which shrinks every block.
        # Non-persistent: KV is runtime state, not weights, so state_dict() holds weights only.
        shape = (cfg.num_layers, cfg.total_blocks, cfg.block_size, cfg.num_kv_heads, cfg.d_head)
        for name in ("kv_pool_k", "kv_pool_v"):
            pool = torch.zeros(shape, dtype=cfg.dtype, device=cfg.device)
            self.register_buffer(name, pool, persistent=False)

    @torch.inference_mode()
    def forward(
        self, chunk_ids: torch.Tensor | list[int], block_table: list[int], start_pos: int
    ) -> torch.Tensor:
        """Run tokens ``start_pos ... start_pos+T-1`` of a sequence; return logits ``[T, vocab]``.

        Positions ``0 ... start_pos-1`` must already be in the pool (computed by earlier chunks,
        or shared from the prefix cache); this call adds the chunk's own K/V.
        """
        ids = self.token_tensor(chunk_ids)
        context_len = start_pos + ids.shape[0]
        self._check_block_table(block_table, context_len)
        positions = torch.arange(start_pos, context_len, device=ids.device)
        cos, sin = rope_cos_sin(positions, self.cfg)
        x = self.model.embed_tokens(ids)
        for layer_idx, layer in enumerate(self.model.layers):
            q, k, v = layer.self_attn.qkv(layer.input_layernorm(x), cos, sin)
            self._write_kv(layer_idx, k, v, block_table, start_pos)
            keys, values = self._gather_kv(layer_idx, block_table, context_len)
            attn = self._attention(q, keys, values, start_pos)
            x = x + layer.self_attn.o_proj(attn.reshape(ids.shape[0], -1))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return self.lm_head(self.model.norm(x))

    def _check_block_table(self, block_table: list[int], context_len: int) -> None:
        if len(block_table) * self.cfg.block_size < context_len:
            raise ValueError(
                f"block_table of {len(block_table)} blocks cannot hold "
                f"{context_len} tokens at block_size={self.cfg.block_size}"
            )

    def _write_kv(
        self,
        layer_idx: int,
        k: torch.Tensor,
        v: torch.Tensor,
        block_table: list[int],
        start_pos: int,
    ) -> None:
        """Store each token's K/V in its slot: block ``pos // bs``, offset ``pos % bs``."""
        block_size = self.cfg.block_size
        for i in range(k.shape[0]):  # one small indexed write per token
            pos = start_pos + i
            block_id, offset = block_table[pos // block_size], pos % block_size
            self.kv_pool_k[layer_idx, block_id, offset] = k[i]
            self.kv_pool_v[layer_idx, block_id, offset] = v[i]

    def _gather_kv(
        self, layer_idx: int, block_table: list[int], context_len: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The context's K/V, ``[context_len, KV, d_head]`` each, read block by block."""
        block_size = self.cfg.block_size
        keys, values = [], []
        for j in range((context_len + block_size - 1) // block_size):
            used = min(block_size, context_len - j * block_size)  # the last block may be partial
            keys.append(self.kv_pool_k[layer_idx, block_table[j], :used])
            values.append(self.kv_pool_v[layer_idx, block_table[j], :used])
        return torch.cat(keys), torch.cat(values)

    def _attention(
        self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, start_pos: int
    ) -> torch.Tensor:
        """Causal attention of the chunk's queries ``[T, H, d_head]`` over the whole context.

        Query head ``h`` reads K/V head ``h // group``: with grouped-query attention, ``group``
        consecutive query heads share one K/V head (``group`` = 1: plain multi-head attention).
        """
        mask = self._causal_mask(q.shape[0], start_pos)
        scale = 1.0 / math.sqrt(self.cfg.d_head)
        group = self.cfg.num_queries_per_kv
        out = torch.empty_like(q)
        for h in range(q.shape[1]):  # one head at a time
            kv_h = h // group
            scores = q[:, h] @ keys[:, kv_h].T * scale + mask
            probs = scores.to(compute_dtype(q.dtype)).softmax(dim=-1).to(q.dtype)
            out[:, h] = probs @ values[:, kv_h]
        return out

    def _causal_mask(self, num_queries: int, start_pos: int) -> torch.Tensor:
        """Additive mask ``[T, start_pos+T]``: query i (at start_pos+i) sees keys 0..start_pos+i."""
        mask = torch.full(
            (num_queries, start_pos + num_queries),
            float("-inf"),
            dtype=self.cfg.dtype,
            device=self.device,
        )
        for i in range(num_queries):  # row by row
            mask[i, : start_pos + i + 1] = 0.0
        return mask
