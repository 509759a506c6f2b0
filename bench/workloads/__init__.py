"""The workloads of ``python -m bench``, one module each, side by side.

Every workload module has the same parts, so that ``bench/cli.py`` reads them all one way:

- ``NAME`` (``--workload NAME``), ``SUMMARY`` (its line in ``--help``) and ``HELP`` (its
  paragraph there);
- ``DEFAULTS``: the flags it reads, each with its default; a flag it does not read is refused
  on the command line, with ``NOT_READ`` as the reason (unless only one workload reads it);
- ``check(options)``: what the flags must satisfy beyond their types, before any work (a
  ``ValueError`` whose message is the ``error:`` line);
- ``run(options, progress) -> int``: the work, the table, the saved JSON; the exit status.
- ``OWN_TIERS`` (optional, True): it reads ``--kv-offloading-backend`` itself, so the command
  line does not check it as one engine's second tier.
"""

from __future__ import annotations

from types import ModuleType

from . import pressure, replicas, restart, scale, serving, shared_prefix

WORKLOADS: dict[str, ModuleType] = {
    module.NAME: module for module in (shared_prefix, pressure, scale, serving, replicas, restart)
}
