"""``python -m <step>.run``: one command, several front ends, chosen by a flag.

``--model DIR`` serves a checkpoint's text (``text_cli.py``), ``--model DIR --chat`` talks with
it, turn after turn (``chat_loop.py``); without them, the chapter's demo runs (``demo.py``).
Every front end is a module with the same three functions: ``build_parser(prog)`` defines its
flags, ``read_options(parser, argv)`` checks them and reads them into a frozen options object,
and ``run(step_name, options)`` does the work and returns the exit status. A new front end is
one more entry of ``FRONT_ENDS``.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from dataclasses import dataclass
from types import ModuleType

from .exits import report_user_errors


@dataclass(frozen=True)
class FrontEnd:
    module: str  # in front/
    flag: str | None  # the flag that chooses it; None: the front end run without any
    what: str  # what it serves, for the line that refuses one of its flags elsewhere


FRONT_ENDS = (  # the first whose flag is given runs
    # The chat loop's flags are --chat and some of the text front end's: a stray one of them
    # needs what the text front end's do.
    FrontEnd("chat_loop", "--chat", "--model DIR (a checkpoint's text)"),
    FrontEnd("text_cli", "--model", "--model DIR (a checkpoint's text)"),
    FrontEnd("demo", None, "the demo's own requests"),
)


def main(step_name: str, argv: list[str] | None = None) -> int:
    """The front end that ``argv`` chooses, with ``argv``: its flags checked, then its run."""
    argv = sys.argv[1:] if argv is None else list(argv)
    given = {word.split("=")[0] for word in argv if word.startswith("--")}
    chosen = next(f for f in FRONT_ENDS if f.flag is None or f.flag in given)
    module = load(chosen)
    parser = module.build_parser(f"python -m {step_name}.run")
    refuse_strays(parser, chosen, given)
    options = module.read_options(parser, argv)
    # The engine options' one check, for this step's engine, on the options read once (stdin
    # may be a flag's): one ``error:`` line before anything loads; the builder trusts them.
    why = options.engine.refused_by(step_name)
    if why is not None:
        parser.error(why)
    # A problem with the checkpoint or a request is one ``error:`` line and exit status 1 (a
    # traceback is left for bugs), whichever front end met it.
    return report_user_errors(parser.prog, lambda: module.run(step_name, options))


def load(front_end: FrontEnd) -> ModuleType:
    return importlib.import_module(f"{__package__}.{front_end.module}")


def refuse_strays(parser: argparse.ArgumentParser, chosen: FrontEnd, given: set[str]) -> None:
    """A flag of another front end is refused in one line that says which flag it needs,
    rather than argparse's "unrecognized arguments"."""
    mine = flags_of(parser)
    for other in FRONT_ENDS:
        if other is not chosen:
            for flag in sorted(given & (flags_of(load(other).build_parser("")) - mine)):
                if other.flag is not None and other.flag not in given:
                    parser.error(f"{flag} needs {other.what}")
                parser.error(f"{flag} is for {other.what}: it does not go with {chosen.flag}")


def flags_of(parser: argparse.ArgumentParser) -> set[str]:
    """Every flag ``parser`` takes (argparse has no public list: its actions hold them)."""
    return {flag for action in parser._actions for flag in action.option_strings}
