"""The optional Hugging Face row: ``LlamaForCausalLM.generate`` on the same weights and prompts.

Our parameter names are HF's, so the very same state dict loads into ``LlamaForCausalLM``. It
runs when ``transformers`` is installed (``pip install -e '.[hf]'``).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from common.config import ModelConfig
from common.weights import make_state_dict

from .harness import RunResult, Workload


def load_hf_llama(cfg: ModelConfig):
    from transformers import LlamaConfig, LlamaForCausalLM

    hf_cfg = LlamaConfig(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.d_model,
        intermediate_size=cfg.d_ff,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_heads,
        rms_norm_eps=cfg.rms_norm_eps,
        rope_theta=cfg.rope_theta,
        max_position_embeddings=8192,
        tie_word_embeddings=False,
        attention_bias=False,
        mlp_bias=False,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=0,
    )
    model = LlamaForCausalLM(hf_cfg)
    model.load_state_dict(make_state_dict(cfg))
    return model.to(device=cfg.device, dtype=cfg.dtype).eval()


def hf_runner(
    cfg: ModelConfig, prompts: list[list[int]], workload: Workload
) -> Callable[[], RunResult] | None:
    """A function that runs one batched greedy ``generate``, or None (with the reason printed)."""
    try:
        model = load_hf_llama(cfg)
    except ImportError:
        print("  (Hugging Face row skipped: pip install -e '.[hf]' to add it)")
        return None
    if len({len(p) for p in prompts}) != 1:
        print("  (Hugging Face row skipped: it needs prompts of one length, no padding)")
        return None
    input_ids = torch.tensor(prompts, device=cfg.device)

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
        seconds = time.perf_counter() - start
        return RunResult(out[:, input_ids.shape[1] :].tolist(), seconds)

    return run
