"""``labserver`` on the command line: thin argument parsing over the package.

One module per group of commands, each adding its subcommands to the parser and
calling the package to do the work: ``serve`` (one server until Ctrl-C), ``compare``
(every strategy under the same load, and ``plot`` to redraw a results folder),
``bench`` (one load run, and ``sweep`` for the highest rate that meets an SLO),
``tiny-model`` and ``prepare`` (model folders). The
argument groups several commands share, and what they turn into (``Limits``, the
load generator's options), are in ``args``. Nothing here decides anything the rooms
below could: a new flag is a line in a group and a field where it is used.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from . import bench, compare, folders, serve
from .args import load_options

__all__ = ["build_parser", "load_options", "main"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="labserver", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    serve.add_serve(sub)
    compare.add_compare(sub)
    bench.add_bench(sub)
    bench.add_sweep(sub)
    compare.add_plot(sub)
    folders.add_tiny_model(sub)
    folders.add_prepare(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=getattr(args, "log_level", "info").upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return int(args.func(args) or 0)
    except (ValueError, TypeError) as e:
        print(f"labserver: {e}", file=sys.stderr)
        return 2
