"""The Hugging Face row: ``LlamaForCausalLM.generate`` on the same weights and prompts.

Our parameter names are HF's, so the very same state dict loads into ``LlamaForCausalLM``
(``front.hf``, which the tests also use as their outside oracle). All prompts go in one
batch (one length: no padding), greedy, and HF keeps a dense KV cache, ``[batch, positions]``
per layer, every prompt token computed: nothing is shared.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from common.config import ModelConfig
from common.device import synchronize

from ..batch import Row, RunResult
from ..costs import dense_figures

NAME, WHAT = "HF generate", "transformers LlamaForCausalLM.generate, batched"


def rows(twin, cfg: ModelConfig, prompts: list[list[int]], workload, timed) -> list[Row]:
    """The HF row (warmed up: its first ``generate`` pays transformers' one-time setup), or
    none, with the reason, when the prompts differ in length."""
    if len({len(p) for p in prompts}) != 1:
        print("  (Hugging Face row skipped: it needs prompts of one length, no padding)")
        return []
    return [timed(NAME, WHAT, generate_run(twin, cfg, prompts, workload.max_new_tokens), True)]


def generate_run(
    model, cfg: ModelConfig, prompts: list[list[int]], new_tokens: int
) -> Callable[[], RunResult]:
    """A function that runs one batched greedy ``generate`` of exactly ``new_tokens`` tokens."""
    input_ids = torch.tensor(prompts, device=cfg.device)
    batch, prompt_len = input_ids.shape
    figures = dense_figures(cfg, batch, prompt_len, new_tokens)

    def run() -> RunResult:
        start = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(
                input_ids,
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
                attention_mask=torch.ones_like(input_ids),
            )
        synchronize(cfg.device)
        return RunResult(out[:, prompt_len:].tolist(), time.perf_counter() - start, **figures)

    return run
