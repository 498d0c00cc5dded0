"""The ``kvcompass`` command: one subcommand per module of this package, one error table.

Every subcommand's handler raises; :func:`main` turns what a user can cause (a bad option, a
file that cannot be read, an index or topology error: :class:`~kvcompass.errors.KVCompassError`,
:class:`OSError`, :class:`ValueError`) into one line ``kvcompass CMD: error: ...`` on stderr and
exit status 2, a second Ctrl-C during a drain into 130, and lets anything else (a bug) show its
traceback. The command line is the top layer of the package: nothing below imports it.
"""

from __future__ import annotations

import argparse
import sys
from typing import Sequence

from kvcompass.cli import chaos, cluster_demo, loadgen, plan, services, simulate, up
from kvcompass.cli.plan import format_plan
from kvcompass.cli.simulate import DEFAULT_MIXED_REQUESTS
from kvcompass.errors import KVCompassError

__all__ = ["DEFAULT_MIXED_REQUESTS", "build_parser", "format_plan", "main"]

_MODULES = (plan, simulate, services, up, loadgen, cluster_demo, chaos)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvcompass", description="KVCompass: a KV-cache discovery plane for Internet-scale LLM serving")
    sub = parser.add_subparsers(dest="command", required=True)
    for m in _MODULES:
        m.add_parsers(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except (KVCompassError, OSError, ValueError) as e:
        print(f"kvcompass {args.command}: error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # a second Ctrl-C during a drain
        return 130


if __name__ == "__main__":
    sys.exit(main())
