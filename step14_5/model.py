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
        # Every context position's physical slot, computed once and used by every layer; the
        # chunk's own tokens are its tail, so the write's slot_mapping is a slice of it.
        context_slots = self._slot_mapping(block_table, 0, context_len)
        slot_mapping = context_slots[start_pos:]
        x = self.model.embed_tokens(ids)
        for layer_idx, layer in enumerate(self.model.layers):
            q, k, v = layer.self_attn.qkv(layer.input_layernorm(x), cos, sin)
            self._write_kv(layer_idx, k, v, slot_mapping)
            keys, values = self._gather_kv(layer_idx, context_slots)
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

    def _slot_mapping(self, block_table: list[int], start_pos: int, count: int) -> torch.Tensor:
        """Flat slot ids ``block_table[pos // bs] * bs + pos % bs`` for positions
        ``start_pos ... start_pos+count-1``: the two-step addressing, for all tokens at once."""
        block_size = self.cfg.block_size
        positions = torch.arange(start_pos, start_pos + count, device=self.device)
        table = torch.as_tensor(block_table, dtype=torch.long, device=self.device)
        return table[positions // block_size] * block_size + positions % block_size

    def _flat_slots(self, pool: torch.Tensor, layer_idx: int) -> torch.Tensor:
        """``pool[layer]`` seen as ``[total_blocks * block_size, KV, d_head]``: one row per slot.

        A view, not a copy: row ``block_id * block_size + offset`` is that block's slot, so an
        indexed assignment through it writes the pool itself.
        """
        return pool[layer_idx].flatten(0, 1)

    def _write_kv(
        self, layer_idx: int, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor
    ) -> None:
        """Store every token's K/V with one scatter: all T rows in one indexed assignment."""
        self._flat_slots(self.kv_pool_k, layer_idx)[slot_mapping] = k
        self._flat_slots(self.kv_pool_v, layer_idx)[slot_mapping] = v

    def _gather_kv(
        self, layer_idx: int, context_slots: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The context's K/V, ``[context_len, KV, d_head]`` each, in one indexed read.

        Through the same flat view as the write: row ``context_slots[p]`` holds position ``p``
        wherever its block lies, so one gather replaces the per-block slices and the cat.
        """
        # index_select is the plain row gather; pool[idx] would go through the more general
        # (and here ~3x slower) advanced-indexing machinery for the same rows.
        keys = self._flat_slots(self.kv_pool_k, layer_idx).index_select(0, context_slots)
        values = self._flat_slots(self.kv_pool_v, layer_idx).index_select(0, context_slots)
        return keys, values

    def _attention(
        self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, start_pos: int
    ) -> torch.Tensor:
        """Causal attention of the chunk's queries ``[T, H, d_head]`` over the whole context.

        Heads are independent, so they become the batch dimension of one batched matmul. The
        ``group`` query heads that read one K/V head (head ``h`` reads K/V head ``h // group``)
        are stacked as the rows of one matrix, so each K/V head is read once and never copied
        per query head: ``[KV, group*T, d_head] @ [KV, d_head, S]`` scores (seen as
        ``[KV, group, T, S]`` for the mask), ``[KV, group*T, S] @ [KV, S, d_head]`` outputs.
        Each head's numbers are the ones the per-head loop computed.
        """
        mask = self._causal_mask(q.shape[0], start_pos)
        scale = 1.0 / math.sqrt(self.cfg.d_head)
        group = self.cfg.num_queries_per_kv
        q_h = q.transpose(0, 1).unflatten(0, (-1, group)).flatten(1, 2)  # [KV, group*T, d_head]
        k_h, v_h = keys.transpose(0, 1), values.transpose(0, 1)  # [KV, S, d_head]
        scores = (q_h @ k_h.transpose(1, 2)).unflatten(1, (group, -1)) * scale  # [KV, group, T, S]
        if mask is not None:
            scores = scores + mask  # the mask broadcasts over heads
        probs = scores.to(compute_dtype(q.dtype)).softmax(dim=-1).to(q.dtype)
        out = probs.flatten(1, 2) @ v_h  # [KV, group*T, d_head]
        return out.unflatten(1, (group, -1)).flatten(0, 1).transpose(0, 1)  # [T, H, d_head]

    def _causal_mask(self, num_queries: int, start_pos: int) -> torch.Tensor | None:
        """Additive mask ``[T, start_pos+T]``: query i (at start_pos+i) sees keys 0..start_pos+i.

        One broadcast comparison of query positions (a column) against key positions (a row)
        builds the whole mask. A decode step (T = 1) needs none: its single query is the newest
        token, and every key in the context is at or before it.
        """
        if num_queries == 1:
            return None
        context_len = start_pos + num_queries
        key_pos = torch.arange(context_len, device=self.device)
        query_pos = key_pos[start_pos:, None]
        mask = torch.zeros(num_queries, context_len, dtype=self.cfg.dtype, device=self.device)
        return mask.masked_fill_(key_pos > query_pos, float("-inf"))
