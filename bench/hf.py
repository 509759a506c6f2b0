"""The optional Hugging Face row: ``LlamaForCausalLM.generate`` on the same weights and prompts.

Our parameter names are HF's, so the very same state dict loads into ``LlamaForCausalLM``
(``common.front.hf``, which the tests also use as their outside oracle). It runs when
``transformers`` is installed (``pip install -e '.[hf]'``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping

import torch

from common.config import ModelConfig
from common.front.hf import default_max_positions, hf_llama

from .costs import dense_kv_bytes, dense_work, model_flops, wait_for
from .harness import RunResult, Workload


def load_hf_llama(
    cfg: ModelConfig,
    weights: Mapping[str, torch.Tensor] | None = None,
    max_position_embeddings: int | None = None,
):
    """HF's model with our seeded weights, or with ``weights`` (a checkpoint's, as
    ``common.checkpoint.load_checkpoint`` returns them: both rows then compute with the very
    same tensors) and the checkpoint's ``max_position_embeddings``."""
    return hf_llama(cfg, weights, max_position_embeddings=max_position_embeddings)


def hf_runner(
    cfg: ModelConfig,
    prompts: list[list[int]],
    workload: Workload,
    weights: Mapping[str, torch.Tensor] | None = None,
    max_position_embeddings: int | None = None,
) -> Callable[[], RunResult] | None:
    """A function that runs one batched greedy ``generate``, or None (with the reason printed).

    All prompts go in one batch (they have one length: no padding) and HF keeps a dense KV
    cache, ``[batch, positions]`` per layer; its figures come from the same formulas as the
    engine's (``bench.costs``), over what it computes: every prompt token, nothing shared.

    ``weights``: a checkpoint's tensors instead of the seeded weights of ``cfg``;
    ``max_position_embeddings``: the checkpoint's. HF's ``generate`` warns when a sequence
    would grow past it, so it is raised to the workload's length when that is longer (it
    changes no number: Llama computes nothing from it).
    """
    longest = max(len(p) for p in prompts) + workload.max_new_tokens
    positions = max(max_position_embeddings or default_max_positions(cfg), longest)
    try:
        model = load_hf_llama(cfg, weights, positions)
    except ImportError:
        print("  (Hugging Face row skipped: pip install -e '.[hf]' to add it)")
        return None
    if len({len(p) for p in prompts}) != 1:
        print("  (Hugging Face row skipped: it needs prompts of one length, no padding)")
        return None
    input_ids = torch.tensor(prompts, device=cfg.device)
    batch, prompt_len, new_tokens = len(prompts), len(prompts[0]), workload.max_new_tokens
    work = dense_work(batch, prompt_len, new_tokens)  # no cache: every prompt token computed

    def run() -> RunResult:
        start = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(
                input_ids,
                max_new_tokens=workload.max_new_tokens,
                min_new_tokens=workload.max_new_tokens,
                do_sample=False,
                attention_mask=torch.ones_like(input_ids),
            )
        wait_for(cfg.device)
        seconds = time.perf_counter() - start
        return RunResult(
            out[:, prompt_len:].tolist(),
            seconds,
            computed_prefill_tokens=batch * prompt_len,
            computed_decode_tokens=batch * (new_tokens - 1),
            kv_peak_bytes=dense_kv_bytes(cfg, batch, prompt_len, new_tokens),
            flops=model_flops(cfg, work),
        )

    return run
