"""``python -m bench``'s command line: one parser for every workload (``build_parser``), its
checks (``read_options``: every flag checked, and the options read once, before any work), and
the entry point (``main``).

The engine flags are the front ends' own (``front.cli.add_engine_flags``). A request
flag's default depends on the workload (``PerWorkload``: each workload module's ``DEFAULTS``),
and a flag the chosen workload does not read is refused rather than silently ignored.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace

from common.config import PRESETS
from front.build import set_threads
from front.cli import (
    ENGINE_FLAGS,
    HelpFormatter,
    add_engine_flags,
    checkpoint_folder,
    non_negative_int,
    number_in,
    positive_int,
    writable_folder,
)
from front.exits import report_user_errors
from front.steps import available_steps, not_taken_by

from .cells import SPREAD_FLAG
from .endpoint import endpoint_url
from .fleet import POLICIES
from .options import BenchOptions
from .progress import Progress
from .workloads import WORKLOADS

PROG = "python -m bench"
ALL_STEPS = "all"
UNUSED = "unused"  # a flag's default for a workload that does not read it: giving it is an error

DESCRIPTION = "\n\n".join(
    [
        "Every step on the same workload, side by side.",
        *(workload.HELP for workload in WORKLOADS.values()),
        f"Each row or cell shows its best run (the work is the same every run, so a slower run "
        f"only measures what else the machine was doing), flagged ! when its runs differ by "
        f"more than {SPREAD_FLAG}x. The runs go in passes, each row once per pass, so a busy "
        "moment costs one run of several rows, not every run of one. The first row and each "
        "peer get one untimed warm-up run (one-time setup). Results go to the --out folder: "
        "results.json (scale.json, serving.json), and the charts when matplotlib is installed.",
    ]
)


def model_name(text: str) -> str:
    """``--model``: a preset name (common/config.py), or a local checkpoint directory."""
    if text in PRESETS:
        return text
    try:
        return checkpoint_folder(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is neither a preset ({', '.join(PRESETS)}) nor a checkpoint directory "
            "(no config.json in it; nothing is downloaded)"
        ) from None


def step_list(text: str) -> tuple[str, ...]:
    """``--steps``: step names of this checkout, comma-separated, each once; or ``all``."""
    here = available_steps()
    if text == ALL_STEPS:
        return tuple(here)
    names = tuple(name.strip() for name in text.split(",") if name.strip())
    if not names:
        raise argparse.ArgumentTypeError(f"name at least one step, e.g. {here[0]},{here[-1]}")
    for name in names:
        if name not in here:
            raise argparse.ArgumentTypeError(f"no step {name!r}; steps: {','.join(here)}")
    if len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(f"a step is named twice in {text!r}")
    return names


def size_list(text: str) -> tuple[int, ...]:
    """``--sweep-requests`` / ``--sweep-cached``: sizes, comma-separated, in increasing order."""
    try:
        sizes = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a comma-separated list of integers"
        ) from None
    if any(size < 0 for size in sizes):
        raise argparse.ArgumentTypeError(f"sizes must be >= 0, got {text!r}")
    if len(sizes) < 2 or list(sizes) != sorted(set(sizes)):
        raise argparse.ArgumentTypeError(f"give two or more sizes, increasing: got {text!r}")
    return sizes


def request_rate(text: str) -> float:
    """``--request-rate``: requests per second, a number > 0, or ``inf`` (all at once)."""
    try:
        rate = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a number of requests per second (or inf: all at once)"
        ) from None
    if not rate > 0:  # nan too
        raise argparse.ArgumentTypeError(f"must be > 0 (or inf: all at once), got {text!r}")
    return rate


def policy_list(text: str) -> tuple[str, ...]:
    """``--policies``: vllm-router's policies, comma-separated, each once."""
    names = tuple(name.strip() for name in text.split(",") if name.strip())
    for name in names:
        if name not in POLICIES:
            raise argparse.ArgumentTypeError(f"no policy {name!r}; measured: {','.join(POLICIES)}")
    if not names or len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(f"name each policy once, e.g. {','.join(POLICIES)}")
    return names


class PerWorkload:
    """A flag's default that depends on ``--workload`` (each workload module's ``DEFAULTS``);
    ``--help`` shows each. A value still of this type after parsing was not given."""

    def __init__(self, dest: str, none: str = "") -> None:
        self.values = {
            name: workload.DEFAULTS.get(dest, UNUSED) for name, workload in WORKLOADS.items()
        }
        self.none = none  # what None means, for --help

    def __str__(self) -> str:
        def shown(value: object) -> str:
            if value is None:
                return self.none
            return ",".join(map(str, value)) if isinstance(value, tuple) else str(value)

        return ", ".join(f"{shown(value)} for {name}" for name, value in self.values.items())


# dest: (type, metavar, help) of the request flags, whose defaults are each workload's own
REQUEST_FLAGS = {
    "requests": (positive_int, "N", "requests"),
    "prefix_len": (non_negative_int, "N", "tokens of the prefix every request shares"),
    "tail_len": (non_negative_int, "N", "tokens of each request's own after the prefix"),
    "new_tokens": (
        positive_int,
        "N",
        "tokens generated per request (max_new_tokens: with pressure, each request stops at "
        "its eos long before); --max-new-tokens, as the demo names it, is the same flag",
    ),
    "max_running": (
        non_negative_int,
        "N",
        "requests the engine runs at once at most (0: all of them, as HF runs them in one batch)",
    ),
    "sweep_requests": (
        size_list,
        "N,N,...",
        "scale: requests per run of the requests sweep; the first is also the requests of "
        "every run of the cached sweep",
    ),
    "sweep_cached": (
        size_list,
        "N,N,...",
        "scale: blocks already in the cache, one run each, in a pool with room for the running "
        "requests only (every allocation evicts once the free pool is gone)",
    ),
    "request_rate": (
        request_rate,
        "R",
        "serving: requests per second, arriving as a seeded Poisson process (inf: all at once)",
    ),
    "endpoint": (
        endpoint_url,
        "URL",
        "serving: also send the requests to an OpenAI-compatible server at URL (python -m "
        "step14_7.serve, vllm serve; start it on the same --model) and time its answers",
    ),
    "replicas": (positive_int, "N", "replicas: servers of the step behind the router"),
    "policies": (
        policy_list,
        "P,...",
        "replicas: vllm-router's routing policies, each run in turn (round robin, the tree of "
        "the routed requests' tokens, the index built from the replicas' KV cache events)",
    ),
    "tenants": (positive_int, "N", "replicas: tenants, each a system prompt and two users"),
    "turns": (positive_int, "N", "replicas: turns of each user's conversation"),
    "turn_delay": (
        number_in(0),
        "S",
        "replicas: seconds each user waits after an answer before the next turn (reading, "
        "typing); the other users' turns go on meanwhile",
    ),
    "model": (
        model_name,
        "PRESET|DIR",
        f"the model: a config preset ({', '.join(PRESETS)}) or a local Hugging Face Llama "
        "checkpoint directory (its weights; the prompts stay random token ids)",
    ),
}


TIERS_HELP = (
    f"{ENGINE_FLAGS['kv_offloading_backend'][2]}. --workload replicas: a comma-separated list, "
    "each run side by side, of none, host, disk (a fresh folder per replica) and redis (a "
    "redis-server it starts, shared); --workload restart makes its own disk tier"
)


def build_parser() -> argparse.ArgumentParser:
    """Every flag, each value checked by its type: a bad one exits 2 with one ``error:`` line."""
    p = argparse.ArgumentParser(prog=PROG, description=DESCRIPTION, formatter_class=HelpFormatter)
    summaries = "; ".join(f"{name}: {w.SUMMARY}" for name, w in WORKLOADS.items())
    p.add_argument("--workload", choices=list(WORKLOADS), default="shared-prefix", help=summaries)
    for dest, (kind, metavar, text) in REQUEST_FLAGS.items():
        names = ["--" + dest.replace("_", "-")]
        names += ["--max-new-tokens"] if dest == "new_tokens" else []
        p.add_argument(
            *names, dest=dest, type=kind, default=PerWorkload(dest), metavar=metavar, help=text
        )
    # --max-running accepts 0 (all at once) and its default is the workload's; the workloads
    # draw their prompts from their own seeds, so that every run is the same work (no --seed);
    # their requests fit any model's context (no --max-model-len).
    add_engine_flags(
        p,
        omit=("max_running", "seed", "max_model_len"),
        helps={"kv_offloading_backend": TIERS_HELP},
        block_size=PerWorkload("block_size"),
        total_blocks=PerWorkload("total_blocks", none="room for every request at once"),
    )
    add_run_flags(p)
    return p


def add_run_flags(p: argparse.ArgumentParser) -> None:
    """What runs beside the steps, how often, and where the results go."""
    p.add_argument(
        "--steps",
        type=step_list,
        default=ALL_STEPS,
        metavar="STEP,...",
        help=f"the steps to run, comma-separated, or {ALL_STEPS}; the first is the baseline of "
        "the vs column",
    )
    p.add_argument(
        "--repeats", type=positive_int, default=3, metavar="N", help="runs per row; the best shows"
    )
    p.add_argument("--no-hf", action="store_true", help="skip the Hugging Face row")
    p.add_argument("--no-ctranslate2", action="store_true", help="skip the CTranslate2 rows")
    p.add_argument(
        "--no-reference",
        action="store_true",
        help="skip the check against the dense reference model (slow on big runs)",
    )
    p.add_argument(
        "--out",
        type=writable_folder,
        default="bench/results",
        metavar="DIR",
        help="folder for the results and the charts (checked before any work)",
    )
    p.add_argument(
        "--quiet",
        action="store_true",
        help="no status line on stderr while a slow row runs (it is shown only on a terminal)",
    )


def read_options(parser: argparse.ArgumentParser, args: argparse.Namespace) -> BenchOptions:
    """The options, once every flag is checked against the workload."""
    workload = WORKLOADS[args.workload]
    refuse_unread(parser, args)
    values = {
        dest: value.values[args.workload] if isinstance(value, PerWorkload) else value
        for dest, value in vars(args).items()
    }
    values = {dest: None if value == UNUSED else value for dest, value in values.items()}
    if values["dtype"] == "auto" and values["model"] in PRESETS:
        parser.error(
            "--dtype auto needs --model DIR: it means the dtype the checkpoint is stored in"
        )
    options = BenchOptions(**values)
    refuse_step_options(parser, options)
    try:
        workload.check(options)
    except ValueError as exc:
        parser.error(str(exc))
    return options


def refuse_step_options(parser: argparse.ArgumentParser, options: BenchOptions) -> None:
    """An engine flag that only later steps take (``--max-num-batched-tokens``) goes to the
    steps of ``--steps`` that take it; when none does, or its value is one the engine refuses
    (with the workload's ``max_running``; a second tier it cannot make), it is one ``error:``
    line."""
    running = options.max_running or options.requests or 1
    engine = replace(options.engine_options(), max_running=running)
    not_taken = [not_taken_by(step, engine) for step in options.steps]
    if all(not_taken):
        parser.error(f"{not_taken[-1]} (--steps {','.join(options.steps)})")
    if engine.budget_refused():
        parser.error(engine.budget_refused())
    if not getattr(WORKLOADS[options.workload], "OWN_TIERS", False) and engine.tier_refused():
        parser.error(engine.tier_refused())  # a workload with tiers of its own checks its own


def refuse_unread(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Flags the chosen workload does not read: one ``error:`` line, not a silent run."""
    reasons: dict[str, list[str]] = {}
    for dest, value in vars(args).items():
        default = parser.get_default(dest)
        given = not isinstance(value, PerWorkload)
        if given and isinstance(default, PerWorkload) and default.values[args.workload] == UNUSED:
            readers = [name for name, v in default.values.items() if v != UNUSED]
            reason = (  # a flag of one or two workloads names them; a common one, the reason
                f"only --workload {' and --workload '.join(readers)} "
                + ("reads it" if len(readers) == 1 else "read it")
                if len(readers) <= 2
                else f"--workload {args.workload} {WORKLOADS[args.workload].NOT_READ}"
            )
            reasons.setdefault(reason, []).append("--" + dest.replace("_", "-"))
    for reason, flags in reasons.items():
        parser.error(f"{' and '.join(flags)}: {reason}")


def run_workload(options: BenchOptions) -> int:
    """The work, once every flag has passed: the workload's run, at ``--threads``."""
    set_threads(options.threads)
    progress = Progress(enabled=False if options.quiet else None)
    return WORKLOADS[options.workload].run(options, progress)


def parse(argv: list[str] | None = None) -> BenchOptions:
    """The options of a command line; a bad flag exits 2 with one ``error:`` line."""
    parser = build_parser()
    return read_options(parser, parser.parse_args(argv))


def main(argv: list[str] | None = None) -> int:
    """``python -m bench``: a bad flag exits 2, a user error is one line and status 1."""
    options = parse(argv)
    return report_user_errors(PROG, lambda: run_workload(options))


if __name__ == "__main__":
    sys.exit(main())
