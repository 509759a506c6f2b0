"""TinyTransformerPaged: a Llama-style decoder whose KV lives in a global paged pool.

There is no ``past_key_values``: ``forward`` writes the chunk's K/V into ``kv_pool_k`` /
``kv_pool_v`` at the slots its ``block_table`` names, then reads the whole context back through
the same table. Which physical blocks hold a sequence is invisible to the math.

The chapter's engine writes each helper the plain way (Python loops over tokens, blocks, heads
and mask rows); steps 14_1 to 14_4 replace them one at a time, and 14_7 adds
``forward_batched``. Which of them this copy has, its README says.
"""

from __future__ import annotations

import array
import itertools
import math
from dataclasses import dataclass

import torch

from common.config import ModelConfig
from common.layers import CausalLM, compute_dtype, rope_cos_sin


class TinyTransformerPaged(CausalLM):
    def __init__(self, cfg: ModelConfig) -> None:
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
        self, chunks: list[list[int]], block_tables: list[list[int]], start_positions: list[int]
    ) -> torch.Tensor:
        """Run many sequences' chunks as one flat batch; return each chunk's last logits.

        The tokens of all sequences (prefill chunks and decode tokens alike) are concatenated
        into one ``[total_tokens, d_model]`` batch, so embedding, norms, projections and the MLP
        run once per layer for everyone, and one scatter writes every token's K/V. Only
        attention needs to know where one sequence ends; it runs as at most two padded calls
        per layer, one for the decode rows and one for the prefill chunks (``FlatBatch``).
        Returns ``[num_seqs, vocab]``: only the last token of a chunk is ever sampled, so only
        those rows go through the final norm and ``lm_head``.
        """
        for table, start, chunk in zip(block_tables, start_positions, chunks):
            self._check_block_table(table, start + len(chunk))
        batch = FlatBatch.build(chunks, block_tables, start_positions, self.cfg, self.device)
        cos, sin = rope_cos_sin(batch.positions, self.cfg)
        x = self.model.embed_tokens(batch.token_ids)
        for layer_idx, layer in enumerate(self.model.layers):
            q, k, v = layer.self_attn.qkv(layer.input_layernorm(x), cos, sin)
            self._write_kv(layer_idx, k, v, batch.slot_mapping)  # one scatter for the whole batch
            attn = self._batched_attention(layer_idx, q, batch.attention)
            x = x + layer.self_attn.o_proj(attn.flatten(1))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        if batch.last_rows is not None:  # None: every chunk is one token, every row is sampled
            x = x[batch.last_rows]
        return self.lm_head(self.model.norm(x))

    def _batched_attention(
        self, layer_idx: int, q: torch.Tensor, groups: list[PaddedAttention]
    ) -> torch.Tensor:
        """Every sequence's attention, ``[total_tokens, H, d_head]``, one padded call per group.

        When one group holds the whole batch in order (a decode round, or a prefill round of
        full chunks), its output already is the flat result: no scatter back.
        """
        if len(groups) == 1 and groups[0].rows is None:
            return self._padded_attention(layer_idx, q, groups[0])
        # One spare row at the end: padding queries read it (a zero query, harmless) and their
        # outputs land in it, so one index serves both directions. It is dropped at the end.
        q_spare = torch.cat([q, q.new_zeros(1, *q.shape[1:])])
        attn = torch.empty_like(q_spare)
        for group in groups:
            attn[group.rows] = self._padded_attention(layer_idx, q_spare, group)
        return attn[:-1]

    def _padded_attention(
        self, layer_idx: int, q: torch.Tensor, group: PaddedAttention
    ) -> torch.Tensor:
        """Attention of G sequences with up to T queries each, over contexts of up to S keys, in
        one ``scaled_dot_product_attention`` call; returns ``[G*T, H, d_head]``.

        The contexts are gathered through the padded ``[G, S]`` slot matrix (one
        ``index_select`` for all of them), and the mask says which key each query may read:
        its own sequence's keys up to its own position. That one comparison is the causal mask
        of a prefill chunk, and for a decode row (T = 1, the newest token) it only hides the
        padding. Grouped-query heads ride along for free: the ``group`` query heads of a K/V
        head are stacked as that head's query rows ``[G, KV, group*T, d]``, so every K/V head
        is read once, never copied per query head.
        """
        num_seqs, width = group.slots.shape
        cfg, t = self.cfg, group.query_len
        kv_heads, per_kv, d_head = cfg.num_kv_heads, cfg.num_queries_per_kv, cfg.d_head
        keys, values = self._gather_kv(layer_idx, group.slots.flatten())
        keys = keys.view(num_seqs, width, kv_heads, d_head).transpose(1, 2)  # [G, KV, S, d]
        values = values.view(num_seqs, width, kv_heads, d_head).transpose(1, 2)
        rows = q if group.rows is None else q[group.rows]  # [G*T, H, d]
        # [G, T, KV, group, d] -> [G, KV, group, T, d]: a view when T = 1 (decode)
        q_grouped = rows.view(num_seqs, t, kv_heads, per_kv, d_head).permute(0, 2, 3, 1, 4)
        out = torch.nn.functional.scaled_dot_product_attention(
            q_grouped.reshape(num_seqs, kv_heads, per_kv * t, d_head),
            keys,
            values,
            attn_mask=group.mask,
            scale=1.0 / math.sqrt(d_head),
        )
        out = out.view(num_seqs, kv_heads, per_kv, t, d_head).permute(0, 3, 1, 2, 4)
        return out.reshape(num_seqs * t, kv_heads * per_kv, d_head)

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


# ---- the round's index tensors, built once per forward_batched call --------------------------


@dataclass
class PaddedAttention:
    """G sequences whose queries attend in one padded call: each has up to T query rows and a
    context of up to S keys. Built once per round, used by every layer."""

    slots: torch.Tensor  # [G, S] physical slot of each context position (padding: slots of block 0)
    mask: torch.Tensor  # [G, 1, group*T, S] True where a query row may read a key
    query_len: int  # T
    # [G*T] each padded query row's row in the flat batch, where its output goes too (padding
    # rows: the spare row past the end); None when the group is the whole batch, in order.
    rows: torch.Tensor | None


@dataclass
class FlatBatch:
    """One round's tokens as a flat batch, and every index the layers need, made once.

    The per-token lists (ids, positions, the write's slot mapping) are plain Python arithmetic
    on the block tables, sent over as one tensor; each attention group needs one more. That
    replaces a handful of small tensor operations per sequence per round.
    """

    token_ids: torch.Tensor  # [N]
    positions: torch.Tensor  # [N] absolute position of each token (for RoPE)
    slot_mapping: torch.Tensor  # [N] the slot each token's K/V is written to
    last_rows: torch.Tensor | None  # [num_seqs] each chunk's last row; None: all rows
    attention: list[PaddedAttention]

    @classmethod
    def build(
        cls,
        chunks: list[list[int]],
        block_tables: list[list[int]],
        start_positions: list[int],
        cfg: ModelConfig,
        device: torch.device,
    ) -> FlatBatch:
        bs = cfg.block_size
        lengths = [len(chunk) for chunk in chunks]
        # Where each chunk's rows begin in the flat batch (vLLM: query_start_loc).
        cu_seqlens = [0, *itertools.accumulate(lengths)]
        ids, positions, slots = [], [], []
        for chunk, table, start in zip(chunks, block_tables, start_positions):
            span = range(start, start + len(chunk))
            ids += chunk
            positions += span
            slots += [table[p // bs] * bs + p % bs for p in span]
        per_token = index_tensor(ids + positions + slots, device).view(3, -1)
        token_ids, positions, slot_mapping = per_token  # three contiguous rows
        last = [end - 1 for end in cu_seqlens[1:]]
        # Decode rows and prefill chunks attend in separate calls: padded together, each
        # one-token row would be padded to a whole chunk of queries.
        decode = [i for i, n in enumerate(lengths) if n == 1]
        prefill = [i for i, n in enumerate(lengths) if n > 1]
        groups = [
            _padded_attention_group(
                members, lengths, cu_seqlens, block_tables, start_positions, cfg, device
            )
            for members in (decode, prefill)
            if members
        ]
        last_rows = None if len(last) == cu_seqlens[-1] else index_tensor(last, device)
        return cls(token_ids, positions, slot_mapping, last_rows, groups)


def _padded_attention_group(
    members: list[int],
    lengths: list[int],
    cu_seqlens: list[int],
    block_tables: list[list[int]],
    start_positions: list[int],
    cfg: ModelConfig,
    device: torch.device,
) -> PaddedAttention:
    """The padded attention call of the sequences ``members`` (indices into the round)."""
    bs, num_seqs = cfg.block_size, len(members)
    t = max(lengths[i] for i in members)
    width = max(start_positions[i] + lengths[i] for i in members)  # S: the longest context
    num_blocks = -(-width // bs)
    # The block tables, cut or padded (with block 0) to num_blocks, then each sequence's first
    # position: one tensor, [G * num_blocks + G].
    flat = []
    for i in members:
        table = block_tables[i][:num_blocks]
        flat += table + [0] * (num_blocks - len(table))
    data = index_tensor(flat + [start_positions[i] for i in members], device)
    table, first_pos = data[: num_seqs * num_blocks].view(num_seqs, -1), data[-num_seqs:]
    steps = torch.arange(max(bs, width, t), device=device)
    slots = (table[:, :, None] * bs + steps[:bs]).view(num_seqs, -1)[:, :width].contiguous()
    # Query row j of a sequence sits at position start + j and may read keys 0 .. start + j.
    query_pos = first_pos[:, None] + steps[:t]  # [G, T]
    mask = steps[:width] <= query_pos[:, :, None]  # [G, T, S]
    per_kv = cfg.num_queries_per_kv
    mask = mask[:, None, None].expand(-1, 1, per_kv, t, width).reshape(num_seqs, 1, -1, width)
    rows = None
    if num_seqs < len(lengths) or any(lengths[i] < t for i in members):
        spare = cu_seqlens[-1]
        rows = index_tensor(
            [cu_seqlens[i] + j if j < lengths[i] else spare for i in members for j in range(t)],
            device,
        )
    return PaddedAttention(slots, mask, t, rows)


def index_tensor(values: list[int], device: torch.device) -> torch.Tensor:
    """A list of Python ints as an int64 tensor, cheaply.

    ``torch.tensor(values)`` inspects every element from Python (a round's few hundred indices
    took ~10x as long as a small tensor operation); ``array("q")`` packs them in C and
    ``torch.frombuffer`` wraps those bytes without a copy (the tensor keeps the array alive).
    """
    if not values:
        return torch.empty(0, dtype=torch.long, device=device)
    return torch.frombuffer(array.array("q", values), dtype=torch.long).to(device)
