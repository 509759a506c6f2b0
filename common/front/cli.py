"""Command-line checks shared by every step's demo (``run.py``) and ``python -m bench``.

They live in ``common/`` because a step must stand on its own: ``python -m step14_3.run`` may
import what never changes between steps, never the benchmark package.

Each function below is an argparse ``type=``: it turns the text of one flag into its value or
raises ``argparse.ArgumentTypeError``, which argparse prints as one ``error:`` line before it
exits with status 2. A bad value therefore stops the program before any model is built, instead
of surfacing minutes later as a traceback (or, worse, as a negative tokens/s).
"""

from __future__ import annotations

import argparse
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

from ..config import DTYPES


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """``--help`` shows every flag's default and keeps the description's line breaks."""


def int_range(minimum: int, maximum: int | None = None) -> Callable[[str], int]:
    """An integer type that refuses values outside ``[minimum, maximum]`` (a count of 0 or -3
    is a typo, not a request for an empty run)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
        if maximum is not None and value > maximum:
            raise argparse.ArgumentTypeError(f"must be <= {maximum}, got {value}")
        return value

    return parse


positive_int = int_range(1)
non_negative_int = int_range(0)
seed_int = int_range(0, 2**63 - 1)  # what torch.Generator.manual_seed takes


def dtype_name(text: str) -> str:
    """A dtype the model can be built in (``float32``, ``bfloat16``, ...)."""
    if text not in DTYPES:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a dtype; choose from {', '.join(DTYPES)}"
        )
    return text


def device_name(text: str) -> str:
    """``cpu``, ``cuda`` or ``cuda:N``, refused here when this torch cannot use it (a CPU-only
    build otherwise fails at the first tensor with "Torch not compiled with CUDA enabled")."""
    try:
        device = torch.device(text)
    except RuntimeError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a device; use cpu or cuda") from None
    if device.type == "cpu":
        return text
    if device.type != "cuda":
        raise argparse.ArgumentTypeError(f"{text!r}: only cpu and cuda are supported")
    if not torch.cuda.is_available():
        why = "it was built without CUDA" if torch.version.cuda is None else "it sees no GPU"
        raise argparse.ArgumentTypeError(
            f"{text!r}: torch {torch.__version__} cannot use CUDA ({why})"
        )
    if device.index is not None and device.index >= torch.cuda.device_count():
        raise argparse.ArgumentTypeError(
            f"{text!r}: there is no GPU {device.index} ({torch.cuda.device_count()} visible)"
        )
    return text


def writable_folder(text: str) -> str:
    """A folder to write results in: one that exists, or can be made, and takes a file.

    Checked when the flags are read, by writing (and removing) a temporary file in the
    folder or in its nearest existing parent, so that a run never does all its work and then
    fails to save it. Nothing is created here.
    """
    folder = Path(text).expanduser()
    existing = folder
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        where = "" if existing == folder else f" ({existing} is a file)"
        raise argparse.ArgumentTypeError(f"{text}: exists and is not a folder{where}")
    try:
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as exc:
        raise argparse.ArgumentTypeError(
            f"{text}: cannot write in {existing} ({exc.strerror or exc}); choose another folder"
        ) from None
    return text


def plural(count: int, word: str) -> str:
    """``plural(1, "token")`` -> "1 token", ``plural(2, "token")`` -> "2 tokens"."""
    return f"{count} {word}{'' if count == 1 else 's'}"
