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
from collections.abc import Iterable
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
        num_shared_blocks: int = 0,
    ) -> torch.Tensor:
        """Run many sequences' chunks as one flat batch; return each chunk's last logits.

        The tokens of all sequences (prefill chunks and decode tokens alike) are concatenated
        into one ``[total_tokens, d_model]`` batch, so embedding, norms, projections and the MLP
        run once per layer for everyone, and one scatter writes every token's K/V. Only
        attention needs to know where one sequence ends: it runs as one padded call per layer
        (``FlatBatch``). Returns ``[num_seqs, vocab]``: only the last token of a chunk is ever
        sampled, so only those rows go through the final norm and ``lm_head``.

        A padded grid has a row per token of the round's longest chunk: a long prefill chunk
        would pad every decode row to its length. So chunks longer than a block attend on grids
        of their own, by length (``chunk_groups``), beside the grid of the rest; the flat batch
        holds the groups one after another, and the logits come back in the callers' order.

        ``num_shared_blocks``: the leading blocks every table holds, before every chunk (the
        engine counts them): attention reads them once for all (``_cascade_attention``).
        """
        for table, start, chunk in zip(block_tables, start_positions, chunks):
            self._check_block_table(table, start + len(chunk))
        self._check_shared_blocks(block_tables, start_positions, num_shared_blocks)
        groups = chunk_groups([len(chunk) for chunk in chunks], self.cfg.block_size)
        batches = [
            FlatBatch.build(
                [chunks[i] for i in group],
                [block_tables[i] for i in group],
                [start_positions[i] for i in group],
                self.cfg,
                self.device,
                num_shared_blocks,
            )
            for group in groups
        ]
        ends = list(itertools.accumulate(len(batch.token_ids) for batch in batches))
        spans = list(zip([0, *ends[:-1]], ends))
        cos, sin = rope_cos_sin(joined(b.positions for b in batches), self.cfg)
        x = self.model.embed_tokens(joined(b.token_ids for b in batches))
        slot_mapping = joined(b.slot_mapping for b in batches)
        for layer_idx, layer in enumerate(self.model.layers):
            q, k, v = layer.self_attn.qkv(layer.input_layernorm(x), cos, sin)
            self._write_kv(layer_idx, k, v, slot_mapping)  # one scatter for the whole batch
            attn = joined(
                self._attend(layer_idx, q[lo:hi], batch) for batch, (lo, hi) in zip(batches, spans)
            )
            x = x + layer.self_attn.o_proj(attn.flatten(1))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        last_rows = joined(b.last_rows + lo for b, (lo, _) in zip(batches, spans))
        logits = self.lm_head(self.model.norm(x[last_rows]))
        if len(groups) == 1:
            return logits
        order = torch.tensor([i for group in groups for i in group], device=logits.device)
        return torch.empty_like(logits).index_copy_(0, order, logits)  # the callers' order

    def _attend(self, layer_idx: int, q: torch.Tensor, batch: FlatBatch) -> torch.Tensor:
        """One grid's attention: cascaded when ``batch`` reads a shared prefix once."""
        if batch.shared_rows is None:
            return self._padded_attention(layer_idx, q, batch)
        return self._cascade_attention(layer_idx, q, batch)

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

    def _cascade_attention(self, layer_idx: int, q: torch.Tensor, batch: FlatBatch) -> torch.Tensor:
        """Cascade attention on ``_padded_attention``'s grid: every query of the round over the
        shared prefix, read once (one matmul per K/V head, ``[G * group * T, d] @ [d, P]``),
        each sequence's queries over its own blocks apart, the two merged exactly."""
        (g, t, s), cfg = batch.grid, self.cfg
        kv_heads, per_kv, d_head = cfg.num_kv_heads, cfg.num_queries_per_kv, cfg.d_head
        if batch.real_rows is not None:
            q = q.new_zeros(g * t, *q.shape[1:]).index_put_((batch.real_rows,), q)
        q = q.view(g, t, kv_heads, per_kv, d_head).permute(0, 2, 3, 1, 4).flatten(2, 3)
        q = q / math.sqrt(d_head)  # [G, KV, group * T, d]
        keys, values = self._gather_heads(layer_idx, batch.shared_rows, (kv_heads, -1, d_head))
        # The prefix lies before every query: nothing to mask.
        shared = partial_attention(q.transpose(0, 1).reshape(kv_heads, -1, d_head), keys, values)
        shared = tuple(x.view(kv_heads, g, -1, x.shape[-1]).transpose(0, 1) for x in shared)
        keys, values = self._gather_heads(layer_idx, batch.own_rows, (g, kv_heads, s, d_head))
        out = merge_attention(shared, partial_attention(q, keys, values, batch.mask))
        out = out.reshape(g, kv_heads, per_kv, t, d_head).permute(0, 3, 1, 2, 4).flatten(0, 1)
        return out if batch.real_rows is None else out[batch.real_rows]

    def _gather_heads(
        self, layer_idx: int, rows: torch.Tensor, shape: tuple[int, ...]
    ) -> tuple[torch.Tensor, ...]:
        """The K/V at ``rows`` of the pool seen as one row per slot and head (``head_rows``):
        each head's keys land in order, so the matmuls read them straight."""
        return tuple(
            pool[layer_idx].view(-1, self.cfg.d_head).index_select(0, rows).view(shape)
            for pool in (self.kv_pool_k, self.kv_pool_v)
        )

    def _check_shared_blocks(self, tables: list[list[int]], starts: list[int], n: int) -> None:
        """Shared blocks must be the same blocks in every table, before every chunk."""
        if any(table[:n] != tables[0][:n] for table in tables):
            raise ValueError(f"the block tables do not share their first {n} blocks")
        if n * self.cfg.block_size > min(starts):
            raise ValueError(f"{n} shared blocks reach past a chunk's first token")

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
    # Cascaded, read head by head (``head_rows``): the P slots of the blocks every sequence
    # shares, read once for all, and each one's own (the grid's keys: positions P on).
    shared_rows: torch.Tensor | None = None  # [KV * P]; None: every context read whole
    own_rows: torch.Tensor | None = None  # [G * KV * S]

    @classmethod
    def build(
        cls,
        chunks: list[list[int]],
        block_tables: list[list[int]],
        start_positions: list[int],
        cfg: ModelConfig,
        device: torch.device,
        num_shared_blocks: int = 0,
    ) -> FlatBatch:
        """Sequence ``i`` runs ``chunks[i]`` from position ``start_positions[i]`` on, through
        ``block_tables[i]``: its rows of the flat batch, and its row of the attention grid."""

        def tensor(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.long, device=device)

        block_size = cfg.block_size
        lengths = [len(chunk) for chunk in chunks]
        spans = [range(start, start + n) for start, n in zip(start_positions, lengths)]
        num_queries = max(lengths)  # T: the grid's query rows per sequence
        shared_len = num_shared_blocks * block_size  # P
        if not use_cascade_attention(len(chunks), shared_len, spans):
            num_shared_blocks = shared_len = 0  # every context read whole, as in step14_7
        context_len = max(span.stop for span in spans) - shared_len  # S: the grid's keys
        own_tables = [table[num_shared_blocks:] for table in block_tables]
        tables = tensor(padded(own_tables, cdiv(context_len, block_size)))
        starts = tensor(start_positions) - shared_len  # positions on the grid's keys
        slots = context_slots(tables, block_size, context_len)
        shared_rows = own_rows = None
        if shared_len:  # cascaded: both parts read head by head
            shared = tensor(block_tables[0][:num_shared_blocks])[None]
            shared_rows = head_rows(context_slots(shared, block_size, shared_len), cfg.num_kv_heads)
            own_rows = head_rows(slots.view(len(chunks), -1), cfg.num_kv_heads)
        ragged = min(lengths) < num_queries  # some chunks leave rows of the grid empty
        return cls(
            token_ids=tensor([token for chunk in chunks for token in chunk]),
            positions=tensor([pos for span in spans for pos in span]),
            slot_mapping=tensor(token_slots(block_tables, spans, block_size)),
            last_rows=tensor(list(itertools.accumulate(lengths))) - 1,
            context_slots=slots,
            mask=attention_mask(starts, num_queries, context_len, cfg.num_queries_per_kv),
            real_rows=real_rows(tensor(lengths), num_queries) if ragged else None,
            grid=(len(chunks), num_queries, context_len),
            shared_rows=shared_rows,
            own_rows=own_rows,
        )


def chunk_groups(lengths: list[int], block_size: int) -> list[list[int]]:
    """The round's sequences (by index, each group in the round's order) that share an
    attention grid: chunks of up to a block (decode rows, step14_8's chunks) on one grid, and
    longer chunks by length, each group within twice its shortest, so that a grid's padding
    stays below its real rows. A round of decode rows and block chunks is one group."""

    def group(n: int) -> int:
        return 0 if n <= block_size else (cdiv(n, block_size) - 1).bit_length()

    keys = [group(n) for n in lengths]
    return [[i for i, key in enumerate(keys) if key == k] for k in sorted(set(keys))]


def joined(parts: Iterable[torch.Tensor]) -> torch.Tensor:
    """The parts one after another (the only part itself, not a copy)."""
    parts = list(parts)
    return parts[0] if len(parts) == 1 else torch.cat(parts)


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


def use_cascade_attention(num_seqs: int, shared_len: int, spans: list[range]) -> bool:
    """Does reading the shared prefix once pay? The own blocks are then attended outside the
    fused kernel, at a higher cost per key. Measured (README): from four sequences on, with a
    prefix at least as long as the longest own part. (vLLM's asks for 256 tokens, 8 requests.)"""
    own_len = max(span.stop for span in spans) - shared_len
    return num_seqs >= 4 and shared_len >= own_len


def head_rows(slots: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """``[..., KV * S]``: where each head of each of ``slots [..., S]`` lies in the pool seen
    as one row per slot and head (row ``slot * KV + head``), head after head."""
    heads = torch.arange(num_kv_heads, device=slots.device)[:, None]
    return (slots[..., None, :] * num_kv_heads + heads).flatten()


def real_rows(lengths: torch.Tensor, num_queries: int) -> torch.Tensor:
    """The ``[G, T]`` grid rows that hold a token (row ``j`` of a sequence, ``j`` < its chunk's
    length), as flat indices in the flat batch's order: where the flat rows go in, and come
    back out."""
    rows = torch.arange(num_queries, device=lengths.device) < lengths[:, None]  # [G, T]
    return rows.flatten().nonzero().squeeze(1)


def partial_attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of ``q [..., R, d]`` (already scaled by ``1/sqrt(d)``) over these keys alone,
    and each row's log-sum-exp of its scores, ``[..., R, 1]``: how much weight these keys
    hold, which is what merging two parts needs. ``mask``: True where a row may read a key.
    The softmax is written out (max, exp, sum) to keep its sum."""
    scores = (q @ keys.transpose(-1, -2)).to(compute_dtype(q.dtype))
    if mask is not None:
        scores.masked_fill_(~mask, float("-inf"))
    top = scores.amax(-1, keepdim=True)
    weights = scores.sub_(top).exp_()
    total = weights.sum(-1, keepdim=True)
    out = (weights.to(values.dtype) @ values).div_(total)
    return out, top + total.log()


def merge_attention(
    a: tuple[torch.Tensor, torch.Tensor], b: tuple[torch.Tensor, torch.Tensor]
) -> torch.Tensor:
    """Two attentions of the same queries over two disjoint sets of keys, as one over both.

    With ``L = log(e^La + e^Lb)``, full attention is ``e^(La - L) * out_a + e^(Lb - L) *
    out_b``, and ``e^(La - L) = sigmoid(La - Lb)``: the share of the weight that ``a``'s keys
    hold. Exact: nothing is dropped or approximated, only the sums are grouped differently.
    """
    (out_a, lse_a), (out_b, lse_b) = a, b
    return torch.lerp(out_b, out_a, torch.sigmoid(lse_a - lse_b).to(out_a.dtype))
