"""The checkpoint's chat template: the text front end writes each request in the model's own
markup, token for token as transformers' ``apply_chat_template`` does, and the shared system
part still comes from the prefix cache.

The checkpoint is built as a user would meet it: a byte-level BPE ``tokenizer.json`` (trained
here, in a second, on a few sentences), saved by transformers' ``save_pretrained`` with a chat
template, next to a tiny Llama with grouped-query attention, tied embeddings and ``llama3``
RoPE. transformers saves the template as ``chat_template.jinja``; checkpoints on the hub carry
it in ``tokenizer_config.json``: both are tested, and when a folder has both, the file wins, as
in transformers. Without ``add_generation_prompt`` the text ends with the last message, no
assistant header after it.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import ModuleType

import pytest

pytest.importorskip("transformers")
pytest.importorskip("safetensors")
pytest.importorskip("tokenizers")
pytest.importorskip("jinja2")

from tokenizers import Tokenizer, processors

from common.config import Llama3RopeScaling, preset
from common.errors import UserError
from front.codec import (
    TextCodec,
    common_prefix_len,
    load_chat_template,
    load_tokenizer,
    messages_for,
)
from front.hf import hf_llama
from front.options import EngineOptions
from front.text import TextOptions, generate_text
from tests.helpers import edit_json
from tests.toy_checkpoint import byte_level_bpe

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CORPUS = [
    "The capital of France is Paris. Water boils at one hundred degrees.",
    "You are a concise assistant. Answer in one sentence, and be kind.",
    "The moon is bright tonight; the stars are out over the quiet city.",
]
# Newlines after block tags and indented tags: rendered right only with trim_blocks and
# lstrip_blocks, as transformers renders them. Without a system message it writes a default
# one; an unknown role is refused through raise_exception.
TEMPLATE = """{{ bos_token }}
{% if messages[0]['role'] != 'system' %}
<|im_start|>system
You are a helpful assistant.<|im_end|>
{% endif %}
{% for message in messages %}
    {% if message['role'] not in ['system', 'user', 'assistant'] %}
        {{ raise_exception('unknown role ' + message['role']) }}
    {% endif %}
<|im_start|>{{ message['role'] }}
{{ message['content'] | trim }}<|im_end|>
{% endfor %}
{% if add_generation_prompt %}
<|im_start|>assistant
{% endif %}"""
SYSTEM = "You are a concise assistant. Answer in one sentence, and be kind to everyone."
PROMPTS = ["The capital of France is", "Water boils at", "Is the moon bright tonight?"]


def bpe_tokenizer(add_bos: bool = True) -> Tokenizer:
    """A byte-level BPE tokenizer (as GPT-2, Llama 3 and SmolLM2 use), trained on CORPUS.
    With ``add_bos`` its post-processor puts ``<|endoftext|>`` first, as Llama 3's puts
    ``<|begin_of_text|>``: a chat template that writes the BOS itself must not get two."""
    tok = byte_level_bpe(CORPUS, SPECIALS, vocab_size=320)
    if add_bos:
        bos = (SPECIALS[0], tok.token_to_id(SPECIALS[0]))
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos[0]} $A", special_tokens=[bos]
        )
    return tok


def save_chat_checkpoint(
    folder: Path,
    template: str | None = TEMPLATE,
    rope_scaling: Llama3RopeScaling = Llama3RopeScaling(4.0, 1.0, 4.0, 64),  # noqa: B008
    max_position_embeddings: int | None = None,
    add_bos: bool = True,
) -> Path:
    """A Llama checkpoint whose tokenizer files carry ``template`` (as transformers saves
    them: ``chat_template.jinja``), with eos ``<|im_end|>``. The default ``rope_scaling``
    puts the tiny model's positions in all three of llama3's bands; Llama 3.2's own is
    ``Llama3RopeScaling(32.0, 1.0, 4.0, 8192)`` with ``max_position_embeddings=131072``."""
    from transformers import PreTrainedTokenizerFast

    tok = bpe_tokenizer(add_bos)
    cfg = preset(
        "tiny",
        vocab_size=tok.get_vocab_size(),
        num_kv_heads=2,
        tie_word_embeddings=True,
        rope_scaling=rope_scaling,
        rope_theta=500000.0,
    )
    hf_llama(cfg, max_position_embeddings=max_position_embeddings).save_pretrained(folder)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|endoftext|>", eos_token="<|im_end|>"
    )
    if template is not None:
        fast.chat_template = template
    fast.save_pretrained(folder)
    config = json.loads((folder / "config.json").read_text())
    config["eos_token_id"] = tok.token_to_id("<|im_end|>")
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def move_template_into_tokenizer_config(folder: Path) -> None:
    """The layout most hub checkpoints have: ``chat_template`` inside tokenizer_config.json."""
    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = (folder / "chat_template.jinja").read_text()
    config_path.write_text(json.dumps(config))
    (folder / "chat_template.jinja").unlink()


@pytest.fixture(scope="module")
def chat_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("chat")
    jinja = save_chat_checkpoint(root / "jinja")
    assert (jinja / "chat_template.jinja").is_file()
    in_config = root / "in-config"
    shutil.copytree(jinja, in_config)
    move_template_into_tokenizer_config(in_config)
    return {"jinja": jinja, "tokenizer_config": in_config}


def transformers_ids(folder: Path, messages: list[dict[str, str]]) -> list[int]:
    """What transformers' own ``apply_chat_template`` makes of the conversation."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    out = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def transformers_text(
    folder: Path, messages: list[dict[str, str]], add_generation_prompt: bool
) -> str:
    """The text transformers' own ``apply_chat_template`` writes for the conversation."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    return tok.apply_chat_template(
        messages, add_generation_prompt=add_generation_prompt, tokenize=False
    )


CONVERSATIONS = {
    "system+user": (SYSTEM, "The capital of France is"),
    "user only": (None, "Water boils at"),
    "padded": ("  Be brief.  ", "  Is the moon bright tonight?\n"),
    "non-ascii": ("Réponds en français.", "La capitale de la France est"),
}


@pytest.mark.parametrize("layout", ["jinja", "tokenizer_config"])
@pytest.mark.parametrize("case", CONVERSATIONS, ids=list(CONVERSATIONS))
def test_chat_ids_equal_transformers_apply_chat_template(
    chat_checkpoints: dict[str, Path], layout: str, case: str
) -> None:
    folder = chat_checkpoints[layout]
    system, prompt = CONVERSATIONS[case]
    codec = TextCodec.load(folder)
    assert codec.template is not None
    ours = codec.encode(prompt, system)
    messages = [{"role": "system", "content": system}] if system is not None else []
    messages.append({"role": "user", "content": prompt})
    assert ours == transformers_ids(folder, messages)


# Tool-calling templates serialize with tojson: transformers' keeps non-ASCII text as it is
# (Jinja's own would write \\u escapes and HTML-escape "<").
TOJSON_TEMPLATE = """{% for message in messages %}
<|im_start|>{{ message['role'] }}
{{ message | tojson }}<|im_end|>
{% endfor %}
{% if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""


def test_without_the_generation_prompt_the_text_ends_with_the_last_message(
    chat_checkpoints: dict[str, Path],
) -> None:
    """``render(..., add_generation_prompt=False)`` writes the conversation alone, as
    transformers does: it ends with the user's message, no assistant header after it (a
    conversation to continue, or to score). With it, the same text and then the header, so
    that the model writes the answer next."""
    folder = chat_checkpoints["jinja"]
    template = load_chat_template(folder)
    messages = messages_for(PROMPTS[0], SYSTEM)
    conversation = template.render(messages, add_generation_prompt=False)
    assert conversation.endswith(f"{PROMPTS[0]}<|im_end|>\n")
    assert "<|im_start|>assistant" not in conversation
    assert template.render(messages) == conversation + "<|im_start|>assistant\n"
    assert conversation == transformers_text(folder, messages, add_generation_prompt=False)


def test_the_jinja_file_wins_over_the_tokenizer_config_field(
    chat_checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    """A folder with both ``chat_template.jinja`` and a ``chat_template`` field in
    tokenizer_config.json (say, a field left behind when the template was saved anew) is read
    as transformers reads it: the file's template, not the field's. The tokens agree with
    transformers' ``apply_chat_template`` on that folder."""
    folder = tmp_path / "both"
    shutil.copytree(chat_checkpoints["jinja"], folder)
    field = "{% for m in messages %}{{ m['content'] }}{% endfor %}"  # no markup at all
    edit_json(folder / "tokenizer_config.json", chat_template=field)
    template = load_chat_template(folder)
    assert template.source == "chat_template.jinja"
    assert template.template == (folder / "chat_template.jinja").read_text()
    assert template.template != field
    messages = messages_for(PROMPTS[1], SYSTEM)
    ours = TextCodec(load_tokenizer(folder), template, []).encode(PROMPTS[1], SYSTEM)
    assert ours == transformers_ids(folder, messages)
    assert "<|im_start|>user" in load_tokenizer(folder).decode(ours, skip_special_tokens=False)


def test_tojson_as_transformers_writes_it(tmp_path: Path) -> None:
    folder = save_chat_checkpoint(tmp_path / "tojson", template=TOJSON_TEMPLATE)
    messages = [{"role": "user", "content": "Réponds: <b>café</b> & thé"}]
    template = load_chat_template(folder)
    assert "café" in template.render(messages)
    ours = TextCodec.load(folder).encode(messages)
    assert ours == transformers_ids(folder, messages)


def test_template_sees_the_special_tokens_of_tokenizer_config(
    chat_checkpoints: dict[str, Path],
) -> None:
    """``{{ bos_token }}`` renders the tokenizer's BOS, whichever way the config stores it."""
    folder = chat_checkpoints["tokenizer_config"]
    template = load_chat_template(folder)
    assert template.special_tokens["bos_token"] == "<|endoftext|>"
    assert template.render([{"role": "user", "content": "hi"}]).startswith("<|endoftext|>")


def test_a_template_that_refuses_is_a_user_error(chat_checkpoints: dict[str, Path]) -> None:
    template = load_chat_template(chat_checkpoints["jinja"])
    with pytest.raises(UserError, match=r"unknown role tool.*--no-chat-template"):
        template.render([{"role": "tool", "content": "{}"}])


@pytest.mark.parametrize("step_name", ["step14", "step14_7"])
def test_the_chat_system_prompt_is_computed_once_for_all_requests(
    chat_checkpoints: dict[str, Path], step_name: str
) -> None:
    """Admitted together, the requests share every full block of the chat-formatted system
    part: each block is computed by one request and adopted by the others."""
    block = 4
    result = generate_text(
        step_name,
        chat_checkpoints["jinja"],
        PROMPTS,
        TextOptions(SYSTEM, max_new_tokens=4, engine=EngineOptions(block_size=block)),
    )
    assert result.chat_template == "chat_template.jinja"
    shared = common_prefix_len(result.prompt_ids)
    assert result.system_tokens >= 3 * block  # several blocks of system prompt
    assert shared >= result.system_tokens
    shared_text = load_tokenizer(chat_checkpoints["jinja"]).decode(result.prompt_ids[0][:shared])
    assert SYSTEM in shared_text, "the system prompt itself is in the shared part"
    s = result.stats
    assert s.requests_hit == len(PROMPTS)
    assert s.cached_tokens == (len(PROMPTS) - 1) * (shared // block) * block
    assert s.computed_prefill_tokens == s.prompt_tokens - s.cached_tokens


def test_no_chat_template_serves_plain_completions(chat_checkpoints: dict[str, Path]) -> None:
    folder = chat_checkpoints["jinja"]
    chat = generate_text("step14_7", folder, PROMPTS[:1], TextOptions(max_new_tokens=2))
    plain_options = TextOptions(max_new_tokens=2, chat_template=False)
    plain = generate_text("step14_7", folder, PROMPTS[:1], plain_options)
    tok = load_tokenizer(folder)
    assert plain.chat_template is None
    assert plain.prompt_ids == [tok.encode(PROMPTS[0]).ids]
    assert chat.prompt_ids != plain.prompt_ids
    assert "<|im_start|>assistant" in tok.decode(chat.prompt_ids[0], skip_special_tokens=False)


def test_a_checkpoint_without_template_is_served_plain(tmp_path: Path) -> None:
    folder = save_chat_checkpoint(tmp_path / "plain", template=None)
    assert load_chat_template(folder) is None
    result = generate_text("step14_7", folder, ["Water boils at"], TextOptions(max_new_tokens=2))
    assert result.chat_template is None
    conversation = [{"role": "user", "content": "Water boils at"}]
    with pytest.raises(UserError, match="the checkpoint has none"):
        generate_text("step14_7", folder, [conversation])


def test_a_named_template_list_uses_the_default(chat_checkpoints: dict[str, Path]) -> None:
    """Some tokenizer_config.json files list named templates; ``default`` is the chat one."""
    folder = chat_checkpoints["tokenizer_config"]
    config = json.loads((folder / "tokenizer_config.json").read_text())
    original = config["chat_template"]
    config["chat_template"] = [
        {"name": "tool_use", "template": "{{ raise_exception('not this one') }}"},
        {"name": "default", "template": original},
    ]
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    try:
        assert load_chat_template(folder).template == original
    finally:
        config["chat_template"] = original
        (folder / "tokenizer_config.json").write_text(json.dumps(config))


def test_run_py_says_it_applies_the_template(
    chat_checkpoints: dict[str, Path], capsys: pytest.CaptureFixture[str], step: ModuleType
) -> None:
    import importlib

    run = importlib.import_module(f"{step.__name__}.run")
    argv = ["--model", str(chat_checkpoints["jinja"]), "--max-new-tokens", "2"]
    assert run.main([*argv, "--prompt", "Water boils at"]) == 0
    assert "chat template: chat_template.jinja" in capsys.readouterr().out
    assert run.main([*argv, "--prompt", "Water boils at", "--no-chat-template"]) == 0
    assert "chat template" not in capsys.readouterr().out
