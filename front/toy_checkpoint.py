"""A model to serve with no download: a preset's seeded weights saved as a checkpoint folder,
with a tokenizer and a chat template, so that every route of the server can be tried.

    python -m front.toy_checkpoint DIR [--preset demo]
    python -m step14_9.serve --model DIR

It writes four files, as a Hugging Face checkpoint holds them:

- ``config.json`` and ``model.safetensors``: the preset's weights, those ``python -m bench
  --model demo`` draws from the preset's seed, so ``--model DIR`` computes the same tokens;
- ``tokenizer.json``: a word-level tokenizer, one word per id of the model (``w0``, ``w1``,
  ...). Every token decodes to text of its own, so a stream over HTTP has one event per token
  (what the bench's ``--endpoint`` runs time); a byte-level tokenizer holds back the bytes of a
  cut character. A word outside the vocabulary (any English word) reads as ``w0``, the unknown
  word;
- ``tokenizer_config.json``: the chat template (its ``chat_template`` field, as most
  checkpoints on the hub carry it) and the unknown word, the one special token the tokenizer
  has. The template writes each turn as ``role: text`` on a line of its own and ends with
  ``assistant:``. Every id is a word the bench's workloads send, and the weights have one row
  per id, so there is no room for markup tokens of its own: the template is plain text.

The weights are random: the answers are words of the vocabulary in no order. What the folder
gives is the server's whole surface, ``/v1/chat/completions`` included, on any machine.
Needs the ``real`` extra (safetensors, tokenizers).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

from common.errors import MissingPackageError

from .exits import report_user_errors, run_command
from .steps import available_steps

PROG = "python -m front.toy_checkpoint"
CONFIG, WEIGHTS = "config.json", "model.safetensors"
TOKENIZER, TOKENIZER_CONFIG = "tokenizer.json", "tokenizer_config.json"
FILES = (CONFIG, WEIGHTS, TOKENIZER, TOKENIZER_CONFIG)
UNKNOWN_WORD = "w0"
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


def words(vocab_size: int) -> dict[str, int]:
    """The vocabulary: ``w<i>`` is id ``i``, one word for every id of the model."""
    return {f"w{i}": i for i in range(vocab_size)}


@dataclass(frozen=True)
class ToyOptions:
    folder: Path
    preset: str


def toy_folder(text: str) -> str:
    """DIR: a folder that can be written in and that holds nothing but what this command writes
    (a rerun overwrites its own files; a folder with anything else is someone else's)."""
    from .cli import writable_folder

    writable_folder(text)
    folder = Path(text).expanduser()
    if folder.is_dir():
        others = sorted(p.name for p in folder.iterdir() if p.name not in FILES)
        if others:
            shown = ", ".join(others[:3]) + (", ..." if len(others) > 3 else "")
            raise argparse.ArgumentTypeError(
                f"{text} holds files this command does not write ({shown}); give a new or "
                "empty folder"
            )
    return text


def build_parser(prog: str = PROG) -> argparse.ArgumentParser:
    from common.config import PRESETS  # torch: imported once ``run_command`` holds Ctrl-C

    from .cli import HelpFormatter

    parser = argparse.ArgumentParser(
        prog=prog, description=__doc__.split("\n\n")[0], formatter_class=HelpFormatter
    )
    parser.add_argument(
        "folder",
        type=toy_folder,
        metavar="DIR",
        help="where to write the checkpoint (made if missing; a rerun overwrites it)",
    )
    parser.add_argument(
        "--preset",
        choices=list(PRESETS),
        default="demo",
        help="whose seeded weights (python -m bench --model NAME draws the same)",
    )
    return parser


def read_options(parser: argparse.ArgumentParser, argv: list[str] | None) -> ToyOptions:
    args = parser.parse_args(argv)
    return ToyOptions(Path(args.folder).expanduser(), args.preset)


def save(folder: Path, preset_name: str) -> None:
    """Write the preset's checkpoint in ``folder`` (the four ``FILES``)."""
    try:
        from safetensors.torch import save_file
        from tokenizers import Tokenizer, models, pre_tokenizers
    except ImportError as exc:
        package = (exc.name or "safetensors").split(".")[0]
        raise MissingPackageError(
            f"writing a checkpoint needs {package}: pip install -e '.[real]'"
        ) from None
    from common.config import preset
    from common.weights import make_state_dict

    from .hf import hf_config_dict

    cfg = preset(preset_name)
    folder.mkdir(parents=True, exist_ok=True)
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama"}
    config |= hf_config_dict(cfg) | {"torch_dtype": "float32"}
    (folder / CONFIG).write_text(json.dumps(config, indent=2))
    state = {name: t.float().contiguous() for name, t in make_state_dict(cfg).items()}
    save_file(state, str(folder / WEIGHTS))
    tokenizer = Tokenizer(models.WordLevel(words(cfg.vocab_size), unk_token=UNKNOWN_WORD))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(folder / TOKENIZER))
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": UNKNOWN_WORD,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    (folder / TOKENIZER_CONFIG).write_text(json.dumps(tokenizer_config, indent=2))


def write(options: ToyOptions) -> int:
    from common.config import preset

    save(options.folder, options.preset)
    vocab = preset(options.preset).vocab_size
    print(
        f"{options.folder}: the {options.preset} preset's weights, a word-level tokenizer "
        f"(w0 ... w{vocab - 1}) and a chat template; serve it with\n"
        f"    python -m {available_steps()[-1]}.serve --model {options.folder}"
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    """Write the checkpoint; a folder it cannot use is one ``error:`` line and exit 2, before
    any weight is drawn; a missing package one line and exit 1."""
    options = read_options(build_parser(), argv)
    return report_user_errors(PROG, lambda: write(options))


if __name__ == "__main__":
    sys.exit(run_command(PROG, main))
