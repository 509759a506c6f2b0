"""The toy checkpoint's vocabulary, configuration and tokenizer, shared by the checkpoint tests.

A word-level ``tokenizer.json`` whose vocabulary is the model's (every generated id decodes to
a word), and a tiny Llama with what current checkpoints use: grouped-query attention, tied
embeddings, ``llama3`` RoPE scaling. Import it after ``pytest.importorskip("tokenizers")``.
"""

from __future__ import annotations

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from common.config import Llama3RopeScaling, preset

WORDS = [
    "the",
    "a",
    "cat",
    "dog",
    "bird",
    "sat",
    "ran",
    "flew",
    "on",
    "under",
    "over",
    "mat",
    "tree",
    "house",
    "red",
    "blue",
    "green",
    "small",
    "big",
    "old",
    "new",
    "one",
    "two",
    "three",
    "and",
    "or",
    "but",
    "then",
    "it",
    "is",
    "was",
    "were",
    "be",
    "here",
    "there",
    "today",
    "yesterday",
    "quick",
    "slow",
    "happy",
    "sad",
    "river",
    "hill",
    "road",
    "city",
    "sun",
    "moon",
    "star",
    "rain",
    "snow",
    "wind",
    "morning",
    "night",
    "bread",
    "milk",
    "tea",
    "book",
    "pen",
    "door",
]
SPECIAL = ["<unk>", "<s>", "</s>"]
VOCAB = SPECIAL + WORDS  # model vocab = tokenizer vocab: every generated id decodes
CFG = preset(
    "tiny",
    vocab_size=len(VOCAB),
    num_kv_heads=2,
    tie_word_embeddings=True,
    rope_scaling=Llama3RopeScaling(4.0, 1.0, 4.0, 64),  # all three bands: see test_hf_oracle
    rope_theta=500000.0,
    block_size=4,
)


def word_tokenizer() -> Tokenizer:
    """A word-level tokenizer whose post-processor adds ``<s>``, as Llama's does."""
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(VOCAB)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tok.add_special_tokens(SPECIAL)
    return tok


def byte_level_bpe(corpus: list[str], specials: list[str], vocab_size: int) -> Tokenizer:
    """A byte-level BPE tokenizer, as GPT-2, Llama 3 and SmolLM2 use, trained on ``corpus``:
    every byte is a token, and the merges learnt join the bytes of the corpus's characters."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus * 20, trainer)
    return tok
