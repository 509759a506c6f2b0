"""Memory checked before the work: the weights and the KV pool against what the machine has.

A KV pool is one ``torch.zeros`` of ``2 x layers x total_blocks x block_size x kv_heads x
d_head`` numbers. Asked for more than the machine holds, it fails deep inside torch with a
raw traceback, or worse, the machine starts swapping and nothing happens for minutes. So every
step's model compares what it is about to allocate with the memory available (free RAM on the
CPU, free device memory on a GPU) first, and refuses with the figures and what to lower.

The check can be wrong (another program may free or take memory in between), so a user who
knows better sets ``PAGED_CACHE_NO_MEMORY_CHECK=1`` (``--no-memory-check`` on the command
lines) to skip it.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from .config import ModelConfig
from .errors import ResourceError

SKIP_ENV = "PAGED_CACHE_NO_MEMORY_CHECK"
GIB = 2**30


def kv_bytes_per_block(cfg: ModelConfig, kv_heads: int | None = None) -> int:
    """K and V of one block, every layer: ``block_size`` token slots (``kv_heads``: as if the
    model had that many K/V heads, to show what grouped-query attention saves)."""
    return cfg.block_size * cfg.kv_bytes_per_token(kv_heads)


def kv_pool_bytes(cfg: ModelConfig) -> int:
    """The paged KV pool of ``cfg``: K and V, every layer, every slot of every block."""
    return cfg.total_blocks * kv_bytes_per_block(cfg)


def linear_params_per_layer(cfg: ModelConfig) -> int:
    """Weights of one layer's matmuls: q, k, v, o (k and v shrink with grouped-query attention)
    and the three of the SwiGLU MLP; the work of a token is twice this many FLOPs."""
    q_width, kv_width = cfg.num_heads * cfg.d_head, cfg.num_kv_heads * cfg.d_head
    attention = cfg.d_model * (2 * q_width + 2 * kv_width)  # q_proj + o_proj, k_proj + v_proj
    return attention + 3 * cfg.d_model * cfg.d_ff


def param_count(cfg: ModelConfig) -> int:
    """The model's parameters: embedding, lm_head (unless tied), and per layer the matmuls and
    the two norms; then the final norm."""
    layer = linear_params_per_layer(cfg) + 2 * cfg.d_model
    vocab = cfg.vocab_size * cfg.d_model * (1 if cfg.tie_word_embeddings else 2)
    return vocab + cfg.num_layers * layer + cfg.d_model


def weight_bytes(cfg: ModelConfig) -> int:
    return param_count(cfg) * cfg.dtype.itemsize


def available_bytes(device: str | torch.device) -> int | None:
    """Memory free for new tensors on ``device`` now (None: this platform does not say)."""
    device = torch.device(device)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    if device.type != "cpu":
        return None
    meminfo = Path("/proc/meminfo")
    if meminfo.exists():  # Linux: what the kernel would give without swapping
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def gib(n: int) -> str:
    return f"{n / GIB:,.2f} GiB" if n >= GIB / 100 else f"{n / 2**20:,.1f} MiB"


def check_memory(
    cfg: ModelConfig, weights: bool | None = None, extra: dict[str, int] | None = None
) -> None:
    """Refuse, with a ``ResourceError``, a model whose KV pool (and ``weights``, by default
    when ``cfg`` draws seeded ones; a checkpoint's are loaded, and counted, before) and
    ``extra`` needs (name -> bytes) exceed the memory ``cfg.device`` has available."""
    if os.environ.get(SKIP_ENV):
        return
    free = available_bytes(cfg.device)
    if free is None:
        return
    pool = f"the KV pool ({cfg.total_blocks:,} blocks of {cfg.block_size} tokens)"
    needs = {pool: kv_pool_bytes(cfg)}
    if weights is None:
        weights = cfg.seed is not None  # seeded weights are drawn with the model
    if weights:
        needs["the weights"] = weight_bytes(cfg)
    needs.update(extra or {})
    total = sum(needs.values())
    if total <= free:
        return
    parts = " + ".join(f"{name} {gib(n)}" for name, n in needs.items())
    raise ResourceError(
        f"not enough memory: {parts} = {gib(total)}, but {cfg.device} has {gib(free)} "
        f"available. Lower total_blocks (--total-blocks), the workload or the model; "
        f"{SKIP_ENV}=1 (--no-memory-check) skips this check"
    )
