"""The block hash of the prefix cache: ``h_i = H(h_{i-1}, tokens of block i)``.

Chaining makes a block's hash name its whole prefix, not just its own tokens: the same 16
tokens after a different history get a different hash, which is what a KV block needs, since
its keys and values depend on every earlier token.

Two traps of the chapter's listing are avoided here: ``bytes(tokens)`` fails for ids above 255,
so ids are packed as 8-byte integers; and Python's ``hash()`` of str/bytes is salted per process,
so a cryptographic digest is used instead, stable across processes and machines (vLLM likewise
hashes with sha256 when hashes must be reproducible).
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

ROOT_HASH = 0  # the "parent" of a prompt's first block


def hash_block(parent_hash: int, token_ids: Sequence[int]) -> int:
    """The chain hash of one full block, given the hash of the block before it."""
    payload = struct.pack(f"<Q{len(token_ids)}q", parent_hash, *token_ids)
    return int.from_bytes(hashlib.sha256(payload).digest()[:8], "little")


def hash_prefix_blocks(token_ids: Sequence[int], block_size: int) -> list[int]:
    """Chain hashes of every *full* block of ``token_ids`` (a trailing partial block has none)."""
    hashes, parent = [], ROOT_HASH
    for end in range(block_size, len(token_ids) + 1, block_size):
        parent = hash_block(parent, token_ids[end - block_size : end])
        hashes.append(parent)
    return hashes
