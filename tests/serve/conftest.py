"""The server's fixtures: a chat checkpoint, and real servers in subprocesses.

- ``chat_checkpoint``: a tiny Llama with random weights, a byte-level BPE tokenizer and a chat
  template, saved by transformers. It has no eos, so an answer ends at ``max_tokens`` unless a
  request brings ``stop_token_ids``: every length in these tests is known in advance. Its
  context is 2048 tokens, long enough for an answer that outlives a disconnect;
- ``bos_checkpoint``: the same with a tokenizer that adds a BOS, as Llama's does;
- ``server``: ``python -m <step>.serve`` on that checkpoint, one per step for the whole
  session (pytest groups the tests by step), with an API key and a served name
  (``server_process.py`` starts, stops and reads servers).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers import STEP_NAMES

for _package in ("fastapi", "uvicorn", "prometheus_client", "openai", "httpx", "transformers"):
    pytest.importorskip(_package)

from tests.serve.server_process import API_KEY, CONTEXT, ENGINE_FLAGS, SERVED_NAME, ServerProcess  # noqa: E402

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CORPUS = [
    "You are a helpful assistant. Answer briefly, politely and in plain words.",
    "The weather is nice today and the cat is happy in the sun.",
    "Grüße aus München! Café crème, s'il vous plaît. 你好，世界 🙂",
]
TEMPLATE = """{% for message in messages %}<|im_start|>{{ message['role'] }}
{{ message['content'] }}<|im_end|>
{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""


BOS = "<|begin_of_text|>"  # Llama 3's


def save_chat_checkpoint(folder: Path, bos: str | None = None) -> Path:
    """The tiny Llama and its tokenizer in ``folder``; with ``bos``, a tokenizer whose
    post-processor puts that token first, as Llama's does (``add_special_tokens``)."""
    from tokenizers import processors
    from transformers import PreTrainedTokenizerFast

    from common.config import preset
    from front.hf import hf_llama
    from tests.toy_checkpoint import byte_level_bpe

    tokenizer = byte_level_bpe(CORPUS, ([bos] if bos else []) + SPECIALS, vocab_size=320)
    if bos is not None:
        bos_id = tokenizer.token_to_id(bos)
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_id)]
        )
    cfg = preset("tiny", vocab_size=tokenizer.get_vocab_size())
    hf_llama(cfg, max_position_embeddings=CONTEXT).save_pretrained(folder)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token=bos)
    fast.chat_template = TEMPLATE
    fast.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def chat_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_chat_checkpoint(tmp_path_factory.mktemp("serve") / "toy-chat")


@pytest.fixture(scope="session")
def bos_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``chat_checkpoint`` whose tokenizer adds a BOS to a prompt, as Llama's does (the
    other's, byte-level BPE as GPT-2's, adds none): what tells a prompt's ids with special
    tokens from those without."""
    return save_chat_checkpoint(tmp_path_factory.mktemp("serve") / "toy-bos", BOS)


@pytest.fixture(scope="session", params=STEP_NAMES)
def server(request: pytest.FixtureRequest, chat_checkpoint: Path) -> Iterator[ServerProcess]:
    """Each step's server, shared by every test of that step; with an API key."""
    flags = ["--api-key", API_KEY, "--served-model-name", SERVED_NAME, *ENGINE_FLAGS]
    process = ServerProcess(request.param, chat_checkpoint, *flags)
    try:
        yield process
    finally:
        process.kill()
