"""``lmserve bench NAME [flags]``: every benchmark through one harness (harness.py), listed in registry.py.

The load generator (load.py, with its workloads and statistics beside it) and the mixed workload
(mixed.py) drive a running server; the benchmarks in lmserve.server.bench run on this machine.
"""

from __future__ import annotations

import argparse

from .registry import BENCHMARKS


def add_subcommand(subparsers: argparse._SubParsersAction) -> None:
    """Registers ``lmserve bench``; a benchmark's own flags are parsed once it is named (no torch here)."""
    width = max(map(len, BENCHMARKS))
    listing = "\n".join(f"  {b.name:<{width}}  {b.summary}" for b in BENCHMARKS.values())
    p = subparsers.add_parser(
        "bench", help="run a benchmark (lmserve bench --help lists them)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Run one benchmark and write its report, stamped with date, git revision, machine, torch "
                    "version and settings.",
        epilog=f"benchmarks:\n{listing}\n\n`lmserve bench NAME --help` gives a benchmark's flags.")
    p.add_argument("name", nargs="?", choices=list(BENCHMARKS), metavar="NAME", help="the benchmark (listed below)")
    p.add_argument("args", nargs=argparse.REMAINDER, help="its flags")
    p.set_defaults(func=cmd_bench)


def cmd_bench(args: argparse.Namespace) -> int:
    from ..cli_args import CliUsageError
    from .harness import run

    if args.name is None:
        raise CliUsageError(f"name a benchmark: lmserve bench {{{','.join(BENCHMARKS)}}} [flags] "
                            "(lmserve bench --help says what each measures)")
    return run(args.name, args.args)
