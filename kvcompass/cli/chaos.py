"""``kvcompass chaos``: the fault harness, in-process (:mod:`kvcompass.chaos.harness`) or against a
real local cluster (:mod:`kvcompass.chaos.processes`)."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from kvcompass.errors import UsageError

__all__ = ["add_parsers"]


def add_parsers(sub: Any) -> None:
    p = sub.add_parser("chaos", help="the fault harness: seeded faults and restarts, then check that every view converged (in-process, or --processes)")
    p.set_defaults(func=chaos_main)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ops", type=int, default=None, metavar="N", help="key ops of workload (default 10000 in-process, 2000 with --processes)")
    p.add_argument("--processes", action="store_true", help="against a real local cluster (kill -9 and restart its processes) instead of in-process")
    p.add_argument("--topology", default="testbed-14x3", metavar="NAME_OR_PATH")
    p.add_argument("--episodes", type=int, default=8, metavar="K", help="in-process: fault/repair episodes")
    p.add_argument("--no-repair", action="store_true", help="in-process: edges never ask for repairs (shows that the check catches it)")
    p.add_argument("--max-workers", type=int, default=3, metavar="N", help="--processes: workers started")
    p.add_argument("--rounds", type=int, default=1, metavar="K", help="--processes: kill/restart rounds (one process of each kind per round)")
    p.add_argument("--rate", type=float, default=40.0, metavar="R", help="--processes: client requests per second")
    p.add_argument("--quiet", action="store_true", help="no progress lines on stderr")


def chaos_main(args: argparse.Namespace) -> int:
    if args.ops is not None and args.ops < 1:
        raise UsageError(f"--ops must be >= 1, got {args.ops}")
    if args.episodes < 1 or args.rounds < 1 or args.max_workers < 1 or not args.rate > 0:
        raise UsageError("--episodes, --rounds and --max-workers must be >= 1 and --rate > 0")

    def progress(line: str) -> None:
        if not args.quiet:
            print(line, file=sys.stderr, flush=True)

    if args.processes:
        from kvcompass.chaos.processes import ProcessChaosConfig, run_processes

        out = run_processes(
            ProcessChaosConfig(seed=args.seed, ops=args.ops or 2000, topology=args.topology, max_workers=args.max_workers, rounds=args.rounds, rate=args.rate),
            progress,
        )
    else:
        from kvcompass.chaos.harness import ChaosConfig, run_chaos

        out = run_chaos(ChaosConfig(seed=args.seed, ops=args.ops or 10_000, topology=args.topology, episodes=args.episodes, repair=not args.no_repair), progress)
    print(json.dumps(out), flush=True)
    ok = out["converged"] and out["divergent_views"] == 0 and out["failed_requests"] == 0
    return 0 if ok else 1
