"""``python -m front.toy_checkpoint DIR``: the newcomer's offline model (docs/serving.md).

- a folder it cannot use, or a flag it does not know, is one ``error:`` line and exit 2 before
  any weight is drawn; a missing package is one line and exit 1;
- what it writes is the preset's model (the weights ``python -m bench --model NAME`` draws), a
  word-level tokenizer whose every id decodes to a word of its own, and a chat template in
  ``tokenizer_config.json`` that this project and transformers render alike;
- a rerun into the same folder overwrites its own files.

The server answering a chat over it is in ``tests/serve/test_toy_checkpoint.py``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from common.config import preset
from common.weights import make_state_dict
from front import toy_checkpoint
from tests.helpers import usage_error

MESSAGES = [
    {"role": "system", "content": "w7 w8"},
    {"role": "user", "content": "w1 w2 w3"},
]


@pytest.fixture
def no_writing(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail the test if the command gets as far as writing the checkpoint."""

    def refuse(*args: object) -> None:
        raise AssertionError("the checkpoint was written before the checks")

    monkeypatch.setattr(toy_checkpoint, "save", refuse)


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        ([], "DIR"),
        (["{tmp}/new", "--preset", "nope"], "invalid choice: 'nope'"),
        (["{tmp}/someone-elses"], "holds files this command does not write (notes.txt)"),
        (["{tmp}/a-file/demo"], "is not a folder"),
        (["{tmp}/new", "--no-such-flag"], "unrecognized arguments"),
    ],
)
def test_a_bad_argument_is_one_line(
    argv: list[str], says: str, tmp_path: Path, no_writing: None, capsys
) -> None:
    (tmp_path / "someone-elses").mkdir()
    (tmp_path / "someone-elses" / "notes.txt").write_text("mine")
    (tmp_path / "a-file").write_text("")
    argv = [arg.replace("{tmp}", str(tmp_path)) for arg in argv]
    line = usage_error(toy_checkpoint.main, argv, capsys)
    assert line.startswith("python -m front.toy_checkpoint: error:") and says in line, line
    assert not (tmp_path / "new").exists()


def test_a_folder_it_cannot_write_in_is_one_line(no_writing: None, capsys) -> None:
    """Probed before any weight is drawn (/proc takes no file, even from root)."""
    if not Path("/proc").is_dir():
        pytest.skip("no /proc here")
    line = usage_error(toy_checkpoint.main, ["/proc/toy-demo"], capsys)
    assert "cannot write in /proc" in line


def test_a_missing_package_is_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    monkeypatch.setitem(sys.modules, "tokenizers", None)
    assert toy_checkpoint.main([str(tmp_path / "demo")]) == 1
    captured = capsys.readouterr()
    assert captured.out == "" and len(captured.err.splitlines()) == 1, captured
    assert "needs tokenizers: pip install -e '.[real]'" in captured.err


def test_it_writes_the_presets_model_a_word_tokenizer_and_a_chat_template(
    tmp_path: Path, capsys
) -> None:
    pytest.importorskip("safetensors")
    pytest.importorskip("jinja2")
    from safetensors.torch import load_file

    from front.codec import TextCodec

    folder = tmp_path / "tiny"
    assert toy_checkpoint.main([str(folder), "--preset", "tiny"]) == 0
    assert f"--model {folder}" in capsys.readouterr().out
    assert sorted(p.name for p in folder.iterdir()) == sorted(toy_checkpoint.FILES)

    cfg = preset("tiny")
    saved = load_file(str(folder / "model.safetensors"))
    drawn = make_state_dict(cfg)
    assert saved.keys() == drawn.keys()
    assert all(torch.equal(saved[name], t.float()) for name, t in drawn.items())

    codec = TextCodec.load(folder)
    assert codec.template is not None and "tokenizer_config.json" in codec.template.source
    assert codec.encode_text("w5 w17 w511") == [5, 17, 511]
    assert codec.encode_text("hello") == [0]  # the unknown word
    assert all(codec.decode([i]) == f"w{i}" for i in range(cfg.vocab_size))  # an event a token
    text = codec.template.render(MESSAGES)
    assert text == "system: w7 w8\nuser: w1 w2 w3\nassistant:"
    assert codec.chat_ids(MESSAGES) == [0, 0, 7, 8, 0, 0, 1, 2, 3, 0, 0]

    assert toy_checkpoint.main([str(folder), "--preset", "tiny"]) == 0  # a rerun overwrites


def test_transformers_renders_its_template_as_the_server_does(tmp_path: Path) -> None:
    """The template is where Hugging Face keeps it, in the form its tokenizer reads."""
    pytest.importorskip("safetensors")
    transformers = pytest.importorskip("transformers")
    from front.codec import TextCodec

    toy_checkpoint.save(tmp_path, "tiny")
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path)
    rendered = theirs.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert rendered == TextCodec.load(tmp_path).template.render(MESSAGES)
    assert theirs(rendered, add_special_tokens=False)["input_ids"] == TextCodec.load(
        tmp_path
    ).chat_ids(MESSAGES)
