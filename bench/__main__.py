import sys

from front.exits import run_command


def main() -> int:
    from .cli import main as bench  # torch and the rest: once run_command holds Ctrl-C

    return bench()


sys.exit(run_command("python -m bench", main))
