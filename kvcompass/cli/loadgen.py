"""``kvcompass loadgen``: replay a trace through the edges' HTTP doors and record each request
(:mod:`kvcompass.services.loadgen`)."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
from pathlib import Path
from typing import Any

from kvcompass.cli.services import tls_args
from kvcompass.errors import UsageError

__all__ = ["add_parsers"]


def add_parsers(sub: Any) -> None:
    g = sub.add_parser("loadgen", help="replay a trace through the edges' HTTP doors and record each request")
    src = g.add_mutually_exclusive_group(required=True)
    src.add_argument("--edge", default=None, metavar="URL", help="one edge door: every request goes there")
    src.add_argument("--state-file", default=None, metavar="PATH", help="kvcompass up's state file: each request goes to its region's edge")
    g.add_argument("--trace", required=True, metavar="PATH_OR_NAME", help="a Mooncake-schema JSONL file or a shared trace name (conversation, synthetic)")
    g.add_argument("--rate", type=float, required=True, metavar="R", help="offered load, req/s of wall time (the trace is rescaled to it)")
    g.add_argument("--max-requests", type=int, default=None, metavar="N")
    g.add_argument("--arrivals", choices=("rescale", "poisson"), default="rescale",
                   help="rescale: the trace's own arrival pattern at --rate; poisson: Poisson arrivals at --rate")
    g.add_argument("--out", default=None, metavar="records.jsonl")
    g.add_argument("--block-size", type=int, default=512, metavar="TOKENS", help="tokens per trace hash id (default 512, Mooncake's)")
    g.add_argument("--topology", default=None, metavar="NAME_OR_PATH", help="weights regions by prefill capacity (default: equal weights)")
    g.add_argument("--max-tokens", type=int, default=None, metavar="N", help="cap each request's output length")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--model", default="llama-3.1-8b")
    g.add_argument("--api-key", default=None, metavar="KEY",
                   help="the doors' API key (default: $KVCOMPASS_API_KEY, else the default tenant's key in --state-file)")
    g.add_argument("--no-progress", action="store_true")
    tls_args(g, client_only=True)

    g.set_defaults(func=loadgen_main)


def loadgen_main(args: argparse.Namespace) -> int:
    from kvcompass.services.loadgen import default_api_key, load_requests, replay, summarize, write_records

    if not (math.isfinite(args.rate) and args.rate > 0):
        raise UsageError(f"--rate must be > 0 req/s, got {args.rate}")
    for name in ("max_requests", "max_tokens", "block_size"):
        v = getattr(args, name)
        if v is not None and v < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be >= 1, got {v}")
    worker_regions: dict[str, str] = {}
    api_key = args.api_key or os.environ.get("KVCOMPASS_API_KEY") or None
    if args.state_file is not None:
        state = json.loads(Path(args.state_file).read_text())
        edges = {str(r): str(e["http"]) for r, e in state["edges"].items()}
        worker_regions = {str(w): str(d["region"]) for w, d in state.get("workers", {}).items()}
        if api_key is None:
            api_key = default_api_key(state)
    else:
        edges = {"default": str(args.edge)}
    topology = None
    if args.topology is not None:
        from kvcompass.discovery.topology import load_topology

        topology = load_topology(args.topology)
        if args.edge is not None:
            worker_regions = {w.id: w.region for w in topology.workers}
    plans = load_requests(
        args.trace, list(edges), rate=args.rate, block_size=args.block_size, max_requests=args.max_requests,
        topology=topology, seed=args.seed, max_tokens=args.max_tokens, model=args.model, arrivals=args.arrivals,
    )
    from kvcompass.services.tls import TLSConfig

    tls = TLSConfig(getattr(args, "tls_cert", None), getattr(args, "tls_key", None), getattr(args, "tls_ca", None))
    records = asyncio.run(replay(plans, edges, worker_regions=worker_regions, progress=not args.no_progress, ssl_context=tls.client_or_none("http"), api_key=api_key))
    if args.out is not None:
        write_records(args.out, records)
    print(json.dumps(summarize(records)))
    return 0
