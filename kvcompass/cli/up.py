"""``kvcompass up``: a whole cluster on loopback as separate, supervised processes
(:mod:`kvcompass.services.cluster`); Ctrl-C stops it."""

from __future__ import annotations

import argparse
import math
from typing import Any

from kvcompass.cli.services import TOPOLOGY_HELP, check_state_dir
from kvcompass.errors import UsageError

__all__ = ["add_parsers"]


def add_parsers(sub: Any) -> None:
    u = sub.add_parser("up", help="start a whole cluster on loopback as separate processes; Ctrl-C stops it")
    u.add_argument("--topology", default="testbed-14x3", metavar="NAME_OR_PATH", help=TOPOLOGY_HELP + " (default testbed-14x3)")
    u.add_argument("--state-file", default=None, metavar="PATH", help="write the endpoints here as JSON once every process is healthy")
    u.add_argument("--routing", choices=("kvcompass", "local"), default="kvcompass")
    u.add_argument("--time-scale", type=float, default=1.0, metavar="S", help="scales the workers' modelled time and the WAN delays alike")
    u.add_argument("--no-wan-delay", action="store_true", help="do not emulate WAN delays between regions")
    u.add_argument("--no-handoff", action="store_true", help="edges forward cross-region requests straight to the worker (no hand-off by the destination region's door)")
    u.add_argument("--workers-per-region", type=int, default=None, metavar="K", help="start at most K workers of each region")
    u.add_argument("--max-workers", type=int, default=None, metavar="N", help="start at most N workers (spread over regions)")
    u.add_argument("--run-dir", default=None, metavar="DIR", help="logs, state and peer files (default: a temporary directory)")
    u.add_argument("--startup-timeout", type=_positive, default=120.0, metavar="S", help="seconds every process may take to say it is ready (> 0)")
    u.add_argument("--drain-grace", type=_not_negative, default=15.0, metavar="S", help="seconds a stopping process may drain (>= 0)")
    u.add_argument("--no-auth", action="store_true", help="no per-worker credentials (any agent may claim any worker)")
    u.add_argument("--tls", action="store_true", help="mutual TLS on every hop with a CA made for this run (in RUN_DIR/secrets/pki)")
    u.add_argument("--open", action="store_true", help="doors without API keys: any client acts as any tenant it names (local experiments only)")
    u.add_argument("--key-rate", type=float, default=None, metavar="RPS", help="rate limit of every tenant's API key, requests per second (default: none; past it a 429 with Retry-After)")
    u.add_argument("--key-burst", type=float, default=None, metavar="N", help="with --key-rate: requests a key may send at once (default: the rate, at least 1)")
    u.add_argument("--tenants", default="", metavar="T1,T2,...", help="tenants besides the default one to make API keys for (all keys go to the state file's api_keys)")

    u.set_defaults(func=up_main)


def _positive(text: str) -> float:
    """argparse type: a finite number > 0 (found in review: a negative value was accepted and
    only refused by each process it was handed to, which the supervisor then killed)."""
    v = float(text)
    if not (v > 0 and v < float("inf")):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return v


def _not_negative(text: str) -> float:
    """argparse type: a finite number >= 0."""
    v = float(text)
    if not (v >= 0 and v < float("inf")):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text}")
    return v


def _tenants(text: str) -> tuple[str, ...]:
    from kvcompass.services.http_door import valid_tenant

    out = tuple(t.strip() for t in text.split(",") if t.strip())
    bad = [t for t in out if not valid_tenant(t)]
    if bad:
        raise UsageError(f"--tenants: {bad[0]!r} is not a valid tenant name")
    return out


def up_main(args: argparse.Namespace) -> int:
    from kvcompass.services.cluster import ClusterConfig, run_cluster

    if not (math.isfinite(args.time_scale) and args.time_scale >= 0):
        raise UsageError(f"--time-scale must be a finite number >= 0, got {args.time_scale}")
    for name in ("workers_per_region", "max_workers"):
        v = getattr(args, name)
        if v is not None and v < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be >= 1, got {v}")
    if args.key_rate is not None and not (math.isfinite(args.key_rate) and args.key_rate > 0):
        raise UsageError(f"--key-rate must be a number > 0, got {args.key_rate}")
    if args.key_burst is not None and not (math.isfinite(args.key_burst) and args.key_burst >= 1):
        raise UsageError(f"--key-burst must be a number >= 1 (a request), got {args.key_burst}")
    if args.key_burst is not None and args.key_rate is None:
        raise UsageError("--key-burst needs --key-rate")
    if args.open and args.key_rate is not None:
        raise UsageError("--key-rate limits API keys, which --open does without")
    check_state_dir("--state-file", args.state_file)
    cfg = ClusterConfig(
        topology=args.topology, routing=args.routing, time_scale=args.time_scale, wan_delay=not args.no_wan_delay, handoff=not args.no_handoff,
        workers_per_region=args.workers_per_region, max_workers=args.max_workers, state_file=args.state_file, run_dir=args.run_dir,
        startup_timeout_s=args.startup_timeout, drain_grace_s=args.drain_grace, auth=not args.no_auth, tls=args.tls, open=args.open,
        tenants=_tenants(args.tenants), key_rate_per_s=args.key_rate, key_burst=args.key_burst,
    )
    from kvcompass.services.lifecycle import run

    return int(run(run_cluster(cfg)))
