"""The flags every command shares, defined once: ``run.py`` (the demo and the text front end),
``python -m bench`` and the server take them from here.

They live with the front ends, not in the bench, because a step's entry points must stand
on their own: ``python -m step14_3.run`` imports the front ends, never the benchmark package.

Most functions below are an argparse ``type=``: they turn the text of one flag into its value
or raise ``argparse.ArgumentTypeError``, which argparse prints as one ``error:`` line before it
exits with status 2. A bad value therefore stops the program before any model is built, instead
of surfacing minutes later as a traceback (or, worse, as a negative tokens/s). The flags of a
group (the engine's, the trace's) are read once into a frozen options object (``EngineOptions``,
in ``options.py``, and ``TraceOptions``) that the rest of the program reads instead of the flags.
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, fields
from pathlib import Path

import torch

from common.checkpoint import CONFIG_FILE
from common.config import DTYPES
from common.memory import SKIP_ENV

from .options import EngineOptions


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


def positive_float(text: str) -> float:
    """A size: a finite number above 0 (``--kv-offloading-size 0.5`` is half a GiB)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"must be a number above 0, got {text}")
    return value


def dtype_name(text: str) -> str:
    """A dtype the model can be built in, or ``auto``: a checkpoint's stored one."""
    if text not in DTYPES and text != "auto":
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a dtype; choose from {', '.join(DTYPES)}, or auto (a checkpoint's)"
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
    """A folder to write results in, probed with a temporary file (in it, or in its nearest
    parent) when the flags are read: a run never does all its work and then fails to save."""
    folder = Path(text).expanduser()
    existing = folder
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        where = "" if existing == folder else f" ({existing} is a file)"
        raise argparse.ArgumentTypeError(f"{text}: exists and is not a folder{where}")
    why = why_unwritable(existing)
    if why:
        raise argparse.ArgumentTypeError(
            f"{text}: cannot write in {existing} ({why}); choose another folder"
        )
    return text


def why_unwritable(folder: str | Path, file: str | Path | None = None) -> str | None:
    """What the system says when a file is written in `folder` (or `file` is appended to),
    or None when it can be. Nothing is left behind: the probe is a temporary file."""
    try:
        if file is not None and os.path.exists(file):
            with open(file, "ab"):
                pass
        else:
            with tempfile.TemporaryFile(dir=folder):
                pass
    except OSError as exc:
        return str(exc.strerror or exc)
    return None


def checkpoint_folder(text: str) -> str:
    """``--model DIR``: a directory holding ``config.json`` (nothing is downloaded)."""
    if not (Path(text).expanduser() / CONFIG_FILE).is_file():
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a checkpoint directory (no {CONFIG_FILE} in it); nothing is "
            "downloaded: give a local directory"
        )
    return text


def add_model_flag(parser: argparse.ArgumentParser, help: str) -> None:
    """``--model DIR``, as every front end over a checkpoint takes it (checked at parse)."""
    parser.add_argument("--model", type=checkpoint_folder, required=True, metavar="DIR", help=help)


def png_path(text: str) -> str:
    """A file a picture can be written to: its folder exists and takes a file."""
    folder = os.path.dirname(text) or "."
    if not text:
        raise argparse.ArgumentTypeError("an empty file name")
    if os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"{text!r} is a directory, not a file name")
    if not os.path.isdir(folder):
        raise argparse.ArgumentTypeError(f"{text!r}: there is no directory {folder!r}")
    why = why_unwritable(folder, text)  # what writing there would say, without the picture
    if why:
        raise argparse.ArgumentTypeError(
            f"{text!r}: cannot write there ({why}); choose another file"
        )
    return text


def text_of(flag: str) -> Callable[[str], str]:
    """A type for a flag whose text must not be empty (``--prompt ""`` asks for nothing)."""

    def parse(text: str) -> str:
        if not text:
            raise argparse.ArgumentTypeError(f"an empty {flag}: give it some text")
        return text

    return parse


def plural(count: int, word: str) -> str:
    """``plural(1, "token")`` -> "1 token", ``plural(2, "token")`` -> "2 tokens"."""
    return f"{count} {word}{'' if count == 1 else 's'}"


class SkipMemoryCheck(argparse.Action):
    """``--no-memory-check``: the memory check is skipped for the rest of the process."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        os.environ[SKIP_ENV] = "1"
        setattr(namespace, self.dest, True)


def add_memory_check_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--no-memory-check",
        action=SkipMemoryCheck,
        nargs=0,
        default=False,
        help="do not compare the KV pool and the weights with the memory available before "
        f"allocating them (the same as {SKIP_ENV}=1)",
    )


def number_in(
    low: float, high: float | None = None, low_open: bool = False
) -> Callable[[str], float]:
    """A float type that refuses values outside ``[low, high]`` (``(low, high]`` with
    ``low_open``), and ``nan`` and ``inf``, which float() accepts."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"must be a finite number, got {text!r}")
        too_low = value <= low if low_open else value < low
        if too_low or (high is not None and value > high):
            where = f"> {low:g}" if low_open else f">= {low:g}"
            where += "" if high is None else f" and <= {high:g}"
            raise argparse.ArgumentTypeError(f"must be {where}, got {text}")
        return value

    return parse


def add_dtype_flag(parser: argparse.ArgumentParser) -> None:
    """``--dtype``: one of ``DTYPES``, or ``auto``, a checkpoint's own."""
    parser.add_argument(
        "--dtype",
        type=dtype_name,
        default="float32",
        help=", ".join(DTYPES) + ", or auto (with --model DIR: the dtype it is stored in)",
    )


# ---- the engine flags: one definition for every command that builds an engine ------------------


def flag_of(dest: str) -> str:
    return "--" + dest.replace("_", "-")


ENGINE_FLAGS: dict[str, tuple[Callable[[str], object], str, str]] = {
    # dest: (type, metavar, help)
    "device": (device_name, "DEVICE", "cpu, cuda or cuda:N"),
    "block_size": (positive_int, "N", "tokens per KV block"),
    "total_blocks": (positive_int, "N", "KV blocks in the pool"),
    "max_running": (positive_int, "N", "requests the engine runs at once at most"),
    "threads": (
        non_negative_int,
        "N",
        "torch CPU threads (0: torch's default, one per core); one keeps timings steady on a "
        "busy machine; a real --model runs faster on more of an idle machine's cores",
    ),
    "seed": (
        seed_int,
        "N",
        "seed of a preset model's random weights, and of the sampling of requests that bring "
        "no seed of their own (the same N, the same run, in every step)",
    ),
    "max_model_len": (
        positive_int,
        "N",
        "the longest request, prompt + new tokens; default: a checkpoint's "
        "max_position_embeddings (more runs the model on positions it never saw)",
    ),
    "max_num_batched_tokens": (
        positive_int,
        "N",
        "step14_9 on: the tokens a round computes at most, one per decoding request first, "
        "then prefill chunks of whole blocks (vLLM's flag); default: the engine's, 512",
    ),
    "kv_offloading_backend": (
        str,
        "TIER",
        "step14_10: the prefix cache's second tier, where every cached block is also written "
        "and evicted prefixes are loaded back from: host (host memory; vLLM's native), "
        "disk:DIR (survives a restart) or redis://HOST:PORT (shared by a fleet)",
    ),
    "kv_offloading_size": (
        positive_float,
        "GiB",
        "step14_10: the second tier's size (host or disk; vLLM's flag); alone, a host tier",
    ),
}


def add_engine_flags(
    parser: argparse.ArgumentParser,
    omit: tuple[str, ...] = (),
    helps: dict[str, str] | None = None,
    **defaults: object,
) -> None:
    """Every ``EngineOptions`` field as a flag, defined here once for every command, with its
    default unless ``defaults`` changes it (and its help, ``helps``); those in ``omit`` left
    out."""
    base = EngineOptions()
    for dest in (f.name for f in fields(EngineOptions)):
        if dest in omit:
            continue
        if dest == "dtype":
            add_dtype_flag(parser)
        elif dest == "no_memory_check":
            add_memory_check_flag(parser)
        else:
            kind, metavar, text = ENGINE_FLAGS[dest]
            flag = flag_of(dest)
            default = defaults.get(dest, getattr(base, dest))
            text = (helps or {}).get(dest, text)
            parser.add_argument(flag, type=kind, default=default, metavar=metavar, help=text)


# ---- the trace flags: --trace and --trace-png, for the demo and the text front end -------------


@dataclass(frozen=True)
class TraceOptions:
    """``--trace`` (the run printed round by round) and ``--trace-png FILE`` (drawn)."""

    show: bool = False
    png: str | None = None

    @property
    def wanted(self) -> bool:
        return self.show or self.png is not None


def add_trace_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--trace",
        action="store_true",
        help="print a run round by round: every block each request adopts, allocates, caches "
        "and frees, and the pool after each round",
    )
    parser.add_argument(
        "--trace-png",
        type=png_path,
        metavar="FILE",
        help="draw the traced run as a PNG: blocks x rounds, each cell coloured by what holds "
        "the block (needs matplotlib: pip install -e '.[plot]')",
    )


def trace_options(parser: argparse.ArgumentParser, args: argparse.Namespace) -> TraceOptions:
    """The trace flags, checked (a picture needs matplotlib) and read."""
    if args.trace_png is not None and importlib.util.find_spec("matplotlib") is None:
        parser.error("--trace-png needs matplotlib: pip install -e '.[plot]'")
    return TraceOptions(args.trace, args.trace_png)
