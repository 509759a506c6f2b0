"""TinyTransformerPaged: a Llama-style decoder whose KV lives in a global paged pool.

There is no ``past_key_values``: ``forward`` writes the chunk's K/V into ``kv_pool_k`` /
``kv_pool_v`` at the slots its ``block_table`` names, then reads the whole context back through
the same table. Which physical blocks hold a sequence is invisible to the math.

The chapter's engine writes each helper the plain way (Python loops over tokens, blocks, heads
and mask rows); steps 14_1 to 14_4 replace them one at a time, and 14_7 adds
``forward_batched``. Which of them this copy has, its README says.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import torch

from common.config import ModelConfig
from common.layers import CausalLM, compute_dtype, rope_cos_sin
from common.memory import check_memory
from common.numbers import cdiv


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

    @torch.inference_mode()
    def forward_batched(
        self,
        chunks: list[list[int]],
        block_tables: list[list[int]],
        start_positions: list[int],
    ) -> torch.Tensor:
        """Run many sequences' chunks as one flat batch; return each chunk's last logits.

        The tokens of all sequences (prefill chunks and decode tokens alike) are concatenated
        into one ``[total_tokens, d_model]`` batch, so embedding, norms, projections and the MLP
        run once per layer for everyone, and one scatter writes every token's K/V. Only
        attention needs to know where one sequence ends: it runs as one padded call per layer
        (``FlatBatch``). Returns ``[num_seqs, vocab]``: only the last token of a chunk is ever
        sampled, so only those rows go through the final norm and ``lm_head``.
        """
        for table, start, chunk in zip(block_tables, start_positions, chunks):
            self._check_block_table(table, start + len(chunk))
        batch = FlatBatch.build(chunks, block_tables, start_positions, self.cfg, self.device)
        cos, sin = rope_cos_sin(batch.positions, self.cfg)
        x = self.model.embed_tokens(batch.token_ids)
        for layer_idx, layer in enumerate(self.model.layers):
            q, k, v = layer.self_attn.qkv(layer.input_layernorm(x), cos, sin)
            self._write_kv(layer_idx, k, v, batch.slot_mapping)  # one scatter for the whole batch
            attn = self._padded_attention(layer_idx, q, batch)
            x = x + layer.self_attn.o_proj(attn.flatten(1))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return self.lm_head(self.model.norm(x[batch.last_rows]))

    def _padded_attention(self, layer_idx: int, q: torch.Tensor, batch: FlatBatch) -> torch.Tensor:
        """Every sequence's attention in one ``scaled_dot_product_attention`` call, on the
        batch's ``[G, T]`` grid of query rows over ``[G, S]`` context keys; returns the flat
        ``[total_tokens, H, d_head]``.

        The contexts are gathered through the padded slot matrix (one ``index_select``), and the
        mask lets each query read its own sequence's keys up to its own position: the causal
        mask of a prefill chunk, and for a decode row only the padding hidden. The ``group``
        query heads of a K/V head are stacked as that head's query rows, so every K/V head is
        read once, as in ``_attention``.
        """
        (g, t, s), cfg = batch.grid, self.cfg
        kv_heads, per_kv, d_head = cfg.num_kv_heads, cfg.num_queries_per_kv, cfg.d_head
        keys, values = self._gather_kv(layer_idx, batch.context_slots)
        keys = keys.view(g, s, kv_heads, d_head).transpose(1, 2)  # [G, KV, S, d]
        values = values.view(g, s, kv_heads, d_head).transpose(1, 2)
        if batch.real_rows is not None:  # some chunks are shorter than T: pad their rows
            q = q.new_zeros(g * t, *q.shape[1:]).index_put_((batch.real_rows,), q)
        # [G, T, KV, group, d] -> [G, KV, group * T, d]
        q = q.view(g, t, kv_heads, per_kv, d_head).permute(0, 2, 3, 1, 4).flatten(2, 3)
        out = torch.nn.functional.scaled_dot_product_attention(
            q, keys, values, attn_mask=batch.mask, scale=1.0 / math.sqrt(d_head)
        )
        out = out.view(g, kv_heads, per_kv, t, d_head).permute(0, 3, 1, 2, 4).flatten(0, 1)
        return out if batch.real_rows is None else out[batch.real_rows]  # [total_tokens, H, d]

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


@dataclass
class FlatBatch:
    """One round's chunks as one flat batch, and the indices every layer needs, built once.

    Flat for everything but attention: one row per token, sequence after sequence. For
    attention the ``G`` sequences sit on a padded ``[G, T]`` grid of query rows (``T``: the
    longest chunk) over ``[G, S]`` context keys (``S``: the longest context).
    """

    token_ids: torch.Tensor  # [N], N = every chunk's tokens, one sequence after another
    positions: torch.Tensor  # [N] each token's absolute position (for RoPE)
    slot_mapping: torch.Tensor  # [N] the slot each token's K/V is written to
    last_rows: torch.Tensor  # [G] each chunk's last row: the one that is sampled
    context_slots: torch.Tensor  # [G * S] each sequence's context slots, padded with slot 0
    mask: torch.Tensor  # [G, 1, group * T, S] True where a query row may read a key
    real_rows: torch.Tensor | None  # [G * T] grid rows that hold a token; None: every row
    grid: tuple[int, int, int]  # G, T, S

    @classmethod
    def build(
        cls,
        chunks: list[list[int]],
        block_tables: list[list[int]],
        start_positions: list[int],
        cfg: ModelConfig,
        device: torch.device,
    ) -> FlatBatch:
        """Sequence ``i`` runs ``chunks[i]`` from position ``start_positions[i]`` on, through
        ``block_tables[i]``: its rows of the flat batch, and its row of the attention grid."""

        def tensor(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.long, device=device)

        block_size = cfg.block_size
        lengths = [len(chunk) for chunk in chunks]
        spans = [range(start, start + n) for start, n in zip(start_positions, lengths)]
        num_queries = max(lengths)  # T: the grid's query rows per sequence
        context_len = max(span.stop for span in spans)  # S: the grid's keys per sequence
        tables = tensor(padded(block_tables, cdiv(context_len, block_size)))
        starts = tensor(start_positions)
        ragged = min(lengths) < num_queries  # some chunks leave rows of the grid empty
        return cls(
            token_ids=tensor([token for chunk in chunks for token in chunk]),
            positions=tensor([pos for span in spans for pos in span]),
            slot_mapping=tensor(token_slots(block_tables, spans, block_size)),
            last_rows=tensor(list(itertools.accumulate(lengths))) - 1,
            context_slots=context_slots(tables, block_size, context_len),
            mask=attention_mask(starts, num_queries, context_len, cfg.num_queries_per_kv),
            real_rows=real_rows(tensor(lengths), num_queries) if ragged else None,
            grid=(len(chunks), num_queries, context_len),
        )


def padded(block_tables: list[list[int]], num_blocks: int) -> list[list[int]]:
    """Every table cut or padded (with block 0) to ``num_blocks``: one rectangle, one tensor.
    A padding block is never read: the mask hides every key past a sequence's context."""
    return [table[:num_blocks] + [0] * (num_blocks - len(table)) for table in block_tables]


def token_slots(block_tables: list[list[int]], spans: list[range], block_size: int) -> list[int]:
    """The slot each token's K/V is written to, sequence after sequence: position ``p`` of a
    sequence lives at ``block_table[p // block_size] * block_size + p % block_size``."""
    return [
        table[pos // block_size] * block_size + pos % block_size
        for table, span in zip(block_tables, spans)
        for pos in span
    ]


def context_slots(tables: torch.Tensor, block_size: int, context_len: int) -> torch.Tensor:
    """``[G * S]``: the slot of every position ``0 ... S-1`` of every sequence, read through
    its ``[G, blocks]`` table, sequence after sequence (one gather reads them all)."""
    offsets = torch.arange(block_size, device=tables.device)
    slots = tables[:, :, None] * block_size + offsets  # [G, blocks, block_size]
    return slots.flatten(1)[:, :context_len].flatten()


def attention_mask(
    start_positions: torch.Tensor, num_queries: int, context_len: int, per_kv: int
) -> torch.Tensor:
    """``[G, 1, per_kv * T, S]``, True where a query row may read a key.

    Query row ``j`` of a sequence sits at position ``start + j`` and may read keys ``0 ...
    start + j``: one comparison is a prefill chunk's causal mask, and for a decode row it only
    hides the padding. The ``per_kv`` query heads of a K/V head are that head's query rows,
    so each sequence's mask is repeated for them.
    """
    device = start_positions.device
    query_pos = start_positions[:, None] + torch.arange(num_queries, device=device)  # [G, T]
    key_pos = torch.arange(context_len, device=device)
    mask = key_pos <= query_pos[:, :, None]  # [G, T, S]
    return mask[:, None].expand(-1, per_kv, -1, -1).flatten(1, 2)[:, None]


def real_rows(lengths: torch.Tensor, num_queries: int) -> torch.Tensor:
    """The ``[G, T]`` grid rows that hold a token (row ``j`` of a sequence, ``j`` < its chunk's
    length), as flat indices in the flat batch's order: where the flat rows go in, and come
    back out."""
    rows = torch.arange(num_queries, device=lengths.device) < lengths[:, None]  # [G, T]
    return rows.flatten().nonzero().squeeze(1)
