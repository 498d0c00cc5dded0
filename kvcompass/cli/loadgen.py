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
    g.add_argument("--follow-ups", choices=("after-parent", "on-time"), default="after-parent",
                   help="after-parent: a request with a parent_chat_id is sent no earlier than its parent's answer arrived (as the simulator); on-time: at its arrival time")
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
    g.add_argument("--region", default=None, metavar="NAME",
                   help="with --edge: the edge's region (default: asked of its /health), so hit rates split local from cross-region")
    g.add_argument("--timeout", type=float, default=600.0, metavar="S", help="seconds a request may take in all (default 600)")
    g.add_argument("--no-progress", action="store_true")
    tls_args(g, client_only=True)

    g.set_defaults(func=loadgen_main)


def loadgen_main(args: argparse.Namespace) -> int:
    from kvcompass.services.loadgen import default_api_key, load_requests, replay, summarize, write_records

    if not (math.isfinite(args.rate) and args.rate > 0):
        raise UsageError(f"--rate must be > 0 req/s, got {args.rate}")
    if not (math.isfinite(args.timeout) and args.timeout > 0):
        raise UsageError(f"--timeout must be > 0 seconds, got {args.timeout}")
    if args.region is not None and args.edge is None:
        raise UsageError("--region names the region of --edge; a state file names every edge's")
    for name in ("max_requests", "max_tokens", "block_size"):
        v = getattr(args, name)
        if v is not None and v < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be >= 1, got {v}")
    worker_regions: dict[str, str] = {}
    api_key = args.api_key or os.environ.get("KVCOMPASS_API_KEY") or None
    from kvcompass.services.tls import TLSConfig

    tls = TLSConfig(getattr(args, "tls_cert", None), getattr(args, "tls_key", None), getattr(args, "tls_ca", None))
    ssl_context = tls.client_or_none("http")
    if args.state_file is not None:
        try:
            state = json.loads(Path(args.state_file).read_text())
            edges = {str(r): str(e["http"]) for r, e in state["edges"].items()}
            worker_regions = {str(w): str(d["region"]) for w, d in state.get("workers", {}).items()}
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise UsageError(f"--state-file {args.state_file}: not a kvcompass up state file ({type(e).__name__}: {e})") from None
        if api_key is None:
            api_key = default_api_key(state)
    else:
        region = args.region if args.region is not None else asyncio.run(_edge_region(str(args.edge), ssl_context))
        edges = {region: str(args.edge)}
    topology = None
    if args.topology is not None:
        from kvcompass.discovery.topology import load_topology

        topology = load_topology(args.topology)
        if args.edge is not None:
            worker_regions = {w.id: w.region for w in topology.workers}
    plans = load_requests(
        args.trace, list(edges), rate=args.rate, block_size=args.block_size, max_requests=args.max_requests,
        topology=topology, seed=args.seed, max_tokens=args.max_tokens, model=args.model, arrivals=args.arrivals, follow_ups=args.follow_ups,
    )
    records = asyncio.run(replay(plans, edges, worker_regions=worker_regions, progress=not args.no_progress, ssl_context=ssl_context, api_key=api_key, timeout_s=args.timeout))
    if args.out is not None:
        write_records(args.out, records)
    summary = summarize(records)
    print(json.dumps(summary))
    # A run in which no request succeeded is a failure a script must see (it exited 0).
    return 1 if records and summary["ok"] == 0 else 0


async def _edge_region(url: str, ssl_context: Any) -> str:
    """The region an edge's door names on ``/health`` (whatever its status: a draining or
    not-ready door still says where it is)."""
    import aiohttp

    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as http:
            async with http.get(url.rstrip("/") + "/health", ssl=ssl_context if ssl_context is not None else True) as resp:
                body = await resp.json(content_type=None)
    except (aiohttp.ClientError, TimeoutError, OSError, ValueError) as e:
        raise UsageError(f"--edge {url}: could not read its region from /health ({type(e).__name__}: {e}); give it with --region") from None
    region = body.get("region") if isinstance(body, dict) else None
    if not isinstance(region, str) or not region:
        raise UsageError(f"--edge {url}: its /health names no region; give it with --region")
    return region
