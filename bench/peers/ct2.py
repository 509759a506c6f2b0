"""The CTranslate2 rows: a C++ inference engine, given the bench's model through its own
converter, from the Hugging Face twin saved to a temporary folder.

Its ``Generator`` takes the shared prefix as a ``static_prompt``: computed once for the whole
batch, its state then copied to every request (a dense cache, as HF's, but without computing
the prefix once per request). Two rows: **cold**, the static prompt computed in every call
(``cache_static_prompt=False``), and **warm prefix**, its state kept from an earlier untimed
call, as the step's warm row keeps the prefix's blocks. Its threads are set as torch's are
(``--threads``: ``intra_threads``), so that every row computes on as many cores.

Needs ``pip install -e '.[peers]'`` (ctranslate2; its converter needs transformers).
"""

from __future__ import annotations

import importlib.util
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from common.config import ModelConfig

from ..batch import Row, RunResult
from ..costs import dense_figures

COMPUTE_TYPES = ("float32", "float16", "bfloat16")  # the model dtypes CTranslate2 computes in
# CTranslate2's Llama converter drops rope_scaling's original_max_position_embeddings, and its
# engine then assumes Llama 3's 8192: any other value would give other tokens.
LLAMA3_CONTEXT = 8192
COLD = ("CTranslate2", "ctranslate2 Generator, static_prompt computed once per batch")
WARM = ("CTranslate2 (warm prefix)", "the same, the static prompt's state cached")


def rows(twin, cfg: ModelConfig, prompts, workload, threads: int, timed) -> list[Row]:
    """The cold and warm rows, each warmed up (no warm row without a shared prefix); none,
    with CTranslate2's own reason in one line, when it cannot compute in the model's dtype on
    this device (its CPU build refuses bfloat16 and float16 when it loads the model)."""
    try:
        generator = load_generator(twin, cfg, threads)
    except ValueError as refused:
        print(f"  (CTranslate2 rows skipped: {cfg.dtype_name} on {cfg.device}: {refused})")
        return []
    shared = workload.prefix_len
    made = [timed(*COLD, static_prompt_run(generator, cfg, prompts, workload, shared, False), True)]
    if shared:
        warm = static_prompt_run(generator, cfg, prompts, workload, shared, True)
        made.append(timed(*WARM, warm, True))
    return made


def available(cfg: ModelConfig) -> bool:
    """Whether the rows can run here; if not, one line says why."""
    why_not = None
    if importlib.util.find_spec("ctranslate2") is None:
        why_not = "pip install -e '.[peers]' to add them"
    elif cfg.dtype_name not in COMPUTE_TYPES:
        why_not = f"it computes in {', '.join(COMPUTE_TYPES)}, not {cfg.dtype_name}"
    elif cfg.rope_scaling and cfg.rope_scaling.original_max_position_embeddings != LLAMA3_CONTEXT:
        why_not = (
            f"its converter takes llama3 RoPE scaling to start from {LLAMA3_CONTEXT} positions, "
            f"this model's from {cfg.rope_scaling.original_max_position_embeddings}"
        )
    if why_not:
        print(f"  (CTranslate2 rows skipped: {why_not})")
    return why_not is None


def load_generator(twin, cfg: ModelConfig, threads: int):
    """The twin saved, converted by CTranslate2's converter, and loaded (the folder is gone
    once the generator holds the model)."""
    import ctranslate2

    device, _, index = cfg.device.partition(":")
    with tempfile.TemporaryDirectory() as folder, quiet_transformers():
        source, target = Path(folder) / "hf", Path(folder) / "ct2"
        twin.save_pretrained(source)
        convert(source, target, cfg.vocab_size, cfg.dtype_name)
        return ctranslate2.Generator(
            str(target),
            device=device,
            device_index=int(index or 0),
            compute_type=cfg.dtype_name,
            intra_threads=threads,
            inter_threads=1,
        )


def static_prompt_run(
    generator, cfg: ModelConfig, prompts, workload, shared: int, cached: bool
) -> Callable[[], RunResult]:
    """One batch of every prompt, the first ``shared`` tokens the static prompt (``cached``)."""
    static = [str(t) for t in prompts[0][:shared]] or None
    tails = [[str(t) for t in prompt[shared:]] for prompt in prompts]
    batch, prompt_len, new = len(prompts), len(prompts[0]), workload.max_new_tokens
    figures = dense_figures(cfg, batch, prompt_len, new, shared, shared_cached=cached)

    def run() -> RunResult:
        start = time.perf_counter()
        results = generator.generate_batch(
            tails,
            static_prompt=static,
            cache_static_prompt=cached,
            max_length=new,
            end_token=[],  # no end token: every answer runs to its length, as the steps'
            include_prompt_in_result=False,
        )
        outputs = [result.sequences_ids[0] for result in results]
        return RunResult(outputs, time.perf_counter() - start, **figures)

    return run


def convert(source: Path, target: Path, vocab_size: int, quantization: str) -> None:
    """CTranslate2's own converter for Hugging Face models, told that the token ids are the
    vocabulary: the bench's prompts are ids, and its model comes without a tokenizer."""
    from ctranslate2.converters import TransformersConverter

    class IdsConverter(TransformersConverter):
        def load_tokenizer(self, *args: object, **kwargs: object) -> IdVocabulary:
            return IdVocabulary(vocab_size)

    IdsConverter(str(source)).convert(str(target), quantization=quantization)


class IdVocabulary:
    """What the converter reads of a tokenizer: token ``"i"`` is id ``i``. Its special tokens
    must name vocabulary entries; no run stops at them (``end_token=[]``)."""

    bos_token = eos_token = "0"
    unk_token = None

    def __init__(self, size: int) -> None:
        self.size = size

    def get_vocab(self) -> dict[str, int]:
        return {str(i): i for i in range(self.size)}


@contextmanager
def quiet_transformers() -> Iterator[None]:
    """No progress bar or info line from transformers while the twin is saved and read."""
    from transformers.utils import logging

    verbosity = logging.get_verbosity()
    logging.set_verbosity_error()
    logging.disable_progress_bar()
    try:
        yield
    finally:
        logging.enable_progress_bar()
        logging.set_verbosity(verbosity)
