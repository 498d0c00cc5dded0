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
from typing import NoReturn, Sequence

from kvcompass.cli import chaos, cluster_demo, loadgen, plan, services, simulate, trace, up
from kvcompass.cli.plan import format_plan
from kvcompass.cli.simulate import DEFAULT_MIXED_REQUESTS
from kvcompass.errors import KVCompassError

__all__ = ["DEFAULT_MIXED_REQUESTS", "build_parser", "format_plan", "main"]

_MODULES = (plan, simulate, trace, services, up, loadgen, cluster_demo, chaos)


class _Parser(argparse.ArgumentParser):
    """argparse with the one-line refusal the rest of the command gives: ``kvcompass CMD:
    error: ...`` and a pointer to ``--help`` instead of the whole usage block (found by a
    newcomer's read of the README: a missing or unknown option printed the usage, and an
    unknown one was blamed on ``kvcompass`` rather than the subcommand). Its subcommands are
    of this class too (argparse makes them of their parent's)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="kvcompass", description="KVCompass: a KV-cache discovery plane for Internet-scale LLM serving")
    sub = parser.add_subparsers(dest="command", required=True)
    for m in _MODULES:
        m.add_parsers(sub)
    return parser


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    """The arguments, with options no subcommand knows refused by that subcommand's parser."""
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        sub.choices[args.command].error(f"unrecognized arguments: {' '.join(extra)}")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse(argv)
    try:
        return int(args.func(args))
    except (KVCompassError, OSError, ValueError) as e:
        print(f"kvcompass {args.command}: error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # a second Ctrl-C during a drain
        return 130


if __name__ == "__main__":
    sys.exit(main())
