"""Other engines beside the steps, on the same weights and prompts: Hugging Face's
``generate`` (``hf.py``) and CTranslate2 (``ct2.py``).

Each is optional: without its package (the ``hf`` and ``peers`` extras) its rows are skipped
with one line that says what to install. Both start from the model's Hugging Face twin, a
``LlamaForCausalLM`` holding the very same tensors (``front.hf``); CTranslate2 converts
it with its own converter. Their tokens must equal the dense reference's, like every row's.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

from common.config import ModelConfig
from front.hf import default_max_positions, hf_llama

from ..batch import Row, RunResult
from ..options import BenchOptions
from . import ct2, hf

Timed = Callable[[str, str, Callable[[], RunResult], bool], Row]  # name, fixes, run, warm-up


def peer_rows(
    cfg: ModelConfig,
    weights: Mapping[str, torch.Tensor] | None,
    workload,
    options: BenchOptions,
    timed: Timed,
    measure: Callable[[], None],
) -> list[Row]:
    """The peers' rows that can run here; each one that cannot says why in one line.

    ``measure`` runs the rows so far before CTranslate2's are made: while its ``Generator``
    lives, its threads slow torch's (at two threads, step14_8 ran 3x slower beside one), so
    its rows are measured apart, after every torch row, and the generator then let go."""
    with_hf = not options.no_hf
    with_ct2 = not options.no_ctranslate2 and ct2.available(cfg)
    if not (with_hf or with_ct2):
        return []
    twin = hf_twin(cfg, weights, workload)
    if twin is None:
        print("  (Hugging Face and CTranslate2 rows skipped: pip install -e '.[hf]' for them)")
        return []
    prompts = workload.prompts(cfg.vocab_size)
    rows = hf.rows(twin, cfg, prompts, workload, timed) if with_hf else []
    if with_ct2:
        measure()
        rows += ct2.rows(twin, cfg, prompts, workload, options.threads, timed)
    return rows


def hf_twin(cfg: ModelConfig, weights: Mapping[str, torch.Tensor] | None, workload):
    """``LlamaForCausalLM`` on the bench's weights, or None without transformers. Its
    ``max_position_embeddings`` (the checkpoint's, or a default) is raised to the workload's
    longest sequence when that is longer: transformers warns beyond it, and Llama computes
    nothing from it."""
    longest = max(workload.prompt_lengths()) + workload.max_new_tokens
    positions = max(cfg.max_position_embeddings or default_max_positions(cfg), longest)
    try:
        return hf_llama(cfg, weights, max_position_embeddings=positions)
    except ImportError:
        return None
