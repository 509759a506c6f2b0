"""A preset's seeded model saved as a checkpoint a server can load: the weights, a
``config.json``, and a word-level ``tokenizer.json`` whose every token is a word of its own
(``w0``, ``w1``, ...).

    python tools/toy_checkpoint.py DIR [--preset demo]

The server needs a tokenizer to start, and the benchmark over HTTP needs one event per token:
a word-level tokenizer decodes every token to text of its own, where a byte-level one holds
back the bytes of a cut character. The weights are those ``python -m bench --model demo``
draws from the preset's seed, so ``--model DIR`` there computes the same tokens. Needs the
``real`` extra (safetensors, tokenizers).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from common.config import PRESETS, preset
from common.weights import make_state_dict
from front.hf import hf_config_dict


def save(folder: Path, preset_name: str) -> None:
    from safetensors.torch import save_file
    from tokenizers import Tokenizer, models, pre_tokenizers

    cfg = preset(preset_name)
    folder.mkdir(parents=True, exist_ok=True)
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama"}
    config |= hf_config_dict(cfg) | {"torch_dtype": "float32"}
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    state = {name: t.float().contiguous() for name, t in make_state_dict(cfg).items()}
    save_file(state, str(folder / "model.safetensors"))
    words = {f"w{i}": i for i in range(cfg.vocab_size)}
    tokenizer = Tokenizer(models.WordLevel(words, unk_token="w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(folder / "tokenizer.json"))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("folder", type=Path, metavar="DIR")
    p.add_argument("--preset", choices=list(PRESETS), default="demo")
    args = p.parse_args()
    save(args.folder, args.preset)
    print(f"{args.folder}: the {args.preset} preset's model, a word-level tokenizer")
    return 0


if __name__ == "__main__":
    sys.exit(main())
