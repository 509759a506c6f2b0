"""What every workload saves: one JSON file in ``--out``, whose first keys say when, on what
machine and with which settings it was measured."""

from __future__ import annotations

import json
import platform
import re
import time
from dataclasses import asdict
from pathlib import Path

import torch

from common.config import ModelConfig

from .options import BenchOptions


def machine() -> dict[str, object]:
    """What a saved run was measured on: the platform, the versions, torch's thread count."""
    return {
        "platform": platform.platform(),
        "processor": platform.processor(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
    }


def saved_run_head(
    cfg: ModelConfig, workload: dict, options: BenchOptions, omit: tuple[str, ...] = ()
) -> dict[str, object]:
    """The first keys of every saved run: when, on what, with which workload and model."""
    return {
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "machine": machine(),
        "settings": {
            "workload": workload,
            "model": {k: str(v) for k, v in asdict(cfg).items() if k not in omit},
            "model_name": options.model,
            "repeats": options.repeats,
        },
    }


def dumps(data: object) -> str:
    """``data`` as indented JSON, each list of plain numbers on one line."""
    text = json.dumps(data, indent=2)
    numbers = re.compile(r"\[\s*((?:-?[\d.eE+-]+|null)(?:,\s*(?:-?[\d.eE+-]+|null))*)\s*\]")
    return numbers.sub(lambda m: "[" + " ".join(m.group(1).split()) + "]", text) + "\n"


def write_json(out: str, name: str, data: object) -> str:
    """``data`` in ``out/name`` (the folder made if need be); returns the path."""
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    path.write_text(dumps(data))
    return str(path)
