"""``kvcompass cluster-demo``, the main job: a real multi-process cluster (``kvcompass up``) on
the default topology, a slice of the Mooncake conversation trace replayed through it once with
KVCompass routing and once with region-local cache-aware routing, a table and a PNG.

Each mode gets a fresh cluster (started, replayed, stopped), so neither run inherits the
other's warm caches; both see the same requests, regions and arrival times.

**What is scaled, and why.** The workers' modelled time (prefill, DRAM reload, decode) and the
emulated WAN delays are both multiplied by ``--time-scale`` (default 0.25), so a few minutes of
wall time cover a longer stretch of modelled traffic and the WAN-versus-prefill trade-off the
score makes is unchanged. Latencies are reported in *modelled* ms (wall ms / time scale), the
unit of the paper's figures; the fixed per-request cost of the processes themselves (Python
HTTP and JSON, a few ms) is inflated by the same division, so they read a little high. The
trace's arrivals are rescaled to ``--rate`` modelled req/s (default: the first 600 requests at
4 req/s, about 2 minutes of wall time for both modes on a 2-core machine). Prompts keep the trace's token
lengths (the cross-region levels start near 1-2.7k tokens, so shortening prompts would hide
exactly the reuse this compares); each request's output is capped at ``--max-tokens``
(default 16) tokens, which shortens E2E but not TTFT.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from kvcompass.errors import UsageError
from kvcompass.services.lifecycle import env_for_child, on_signals, stop_process_async

__all__ = ["add_parsers", "format_table", "run_cluster_demo", "write_figure"]

MODES = {"kvcompass": "KVCompass", "local": "Region-local"}


def add_parsers(sub: Any) -> None:
    """``kvcompass cluster-demo``."""
    p = sub.add_parser("cluster-demo", help="the main job: kvcompass up + a Mooncake conversation replay, KVCompass vs region-local routing")
    p.set_defaults(func=cluster_demo_main)
    p.add_argument("--topology", default="testbed-14x3", metavar="NAME_OR_PATH")
    p.add_argument("--trace", default="conversation", metavar="PATH_OR_NAME", help="default: the Mooncake conversation trace")
    p.add_argument("--requests", type=int, default=600, metavar="N", help="replay the first N requests of the trace (default 600)")
    p.add_argument("--rate", type=float, default=4.0, metavar="R", help="offered load in modelled req/s (default 4)")
    p.add_argument("--time-scale", type=float, default=0.25, metavar="S", help="wall seconds per modelled second (default 0.25)")
    p.add_argument("--max-tokens", type=int, default=16, metavar="N", help="cap on each request's output tokens (default 16)")
    p.add_argument("--modes", default="kvcompass,local", metavar="M1,M2", help="routing modes, in run order (default kvcompass,local)")
    p.add_argument("--workers-per-region", type=int, default=None, metavar="K")
    p.add_argument("--out", default="cluster-demo-out", metavar="DIR", help="records, summary.json and cluster_demo.png go here")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--hold", action="store_true", help="keep the last mode's cluster up after its replay, print its dashboards, and stop on Ctrl-C")


async def _wait_state(path: Path, proc: asyncio.subprocess.Process, timeout: float) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        if path.is_file():
            obj = json.loads(path.read_text())
            if isinstance(obj, dict):
                return obj
        if proc.returncode is not None:
            raise RuntimeError(f"kvcompass up exited with code {proc.returncode} before the cluster was ready")
        if time.monotonic() > deadline:
            raise RuntimeError(f"the cluster was not ready within {timeout:.0f} s")
        await asyncio.sleep(0.2)


async def _run_mode(args: argparse.Namespace, mode: str, plans: Sequence[Any], out: Path) -> list[dict[str, Any]]:
    from kvcompass.services.loadgen import default_api_key, replay

    state_path = out / f"state-{mode}.json"
    with contextlib.suppress(FileNotFoundError):
        state_path.unlink()
    argv = [
        sys.executable, "-m", "kvcompass", "up", "--topology", args.topology, "--routing", mode, "--time-scale", repr(args.time_scale),
        "--state-file", str(state_path), "--run-dir", str(out / f"run-{mode}"),
    ]
    if args.workers_per_region is not None:
        argv += ["--workers-per-region", str(args.workers_per_region)]
    t0 = time.perf_counter()
    print(f"[{mode}] starting kvcompass up ({args.topology}) ...", file=sys.stderr, flush=True)
    proc = await asyncio.create_subprocess_exec(*argv, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.DEVNULL, env=env_for_child(), start_new_session=True)
    try:
        state = await _wait_state(state_path, proc, 300)
        print(f"[{mode}] cluster of {len(state['workers'])} workers up in {time.perf_counter() - t0:.1f} s; replaying {len(plans)} requests", file=sys.stderr, flush=True)
        edges = {str(r): str(e["http"]) for r, e in state["edges"].items()}
        regions = {str(w): str(d["region"]) for w, d in state["workers"].items()}
        records = await replay(plans, edges, worker_regions=regions, progress=not args.no_progress, label=f"[{mode}] ", api_key=default_api_key(state))
        if getattr(args, "hold", False) and mode == args.modes.split(",")[-1].strip():
            await _hold(state, mode)
    finally:
        rc, _ = await stop_process_async(proc, 90)
    print(f"[{mode}] cluster stopped (exit {rc}); {time.perf_counter() - t0:.1f} s in all", file=sys.stderr, flush=True)
    return records


async def _hold(state: Mapping[str, Any], mode: str) -> None:
    """Keep the cluster up for a look at its dashboards until SIGINT/SIGTERM."""
    stop = asyncio.Event()
    # The handlers go in before the prompt: a Ctrl-C that follows the prompt at once must stop
    # the hold, not interrupt the process (a test's SIGINT right after the last line did).
    with on_signals(stop.set):
        print(f"[{mode}] holding the cluster (Ctrl-C stops it); dashboards:", flush=True)
        for r, e in state["edges"].items():
            print(f"  {r}: {e.get('dashboard')}", flush=True)
        keys = state.get("api_keys") or {}
        if keys:
            print(f"  doors need Authorization: Bearer {next(iter(keys.values()))} (state file: api_keys)", flush=True)
        await stop.wait()


def _modelled(s: Mapping[str, Any], scale: float) -> dict[str, Any]:
    out = dict(s)
    for k in ("ttft_p50_ms", "ttft_p99_ms", "e2e_p50_ms", "e2e_p99_ms"):
        out[k] = s[k] / scale if scale > 0 else s[k]
    return out


def format_table(summaries: Mapping[str, Mapping[str, Any]]) -> str:
    head = ["routing", "requests", "errors", "TTFT P50", "TTFT P99", "E2E P50", "E2E P99", "local hit", "x-region hit", "reused tokens"]
    rows = [head]
    for mode, s in summaries.items():
        rows.append([
            MODES.get(mode, mode), str(s["requests"]), str(s["errors"]),
            f"{s['ttft_p50_ms']:.0f}", f"{s['ttft_p99_ms']:.0f}", f"{s['e2e_p50_ms']:.0f}", f"{s['e2e_p99_ms']:.0f}",
            f"{100 * s['local_hit_rate']:.1f}%", f"{100 * s['xregion_hit_rate']:.1f}%", f"{s['reused_tokens']:,}",
        ])
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = ["  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True))) for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def write_figure(path: Path, summaries: Mapping[str, Mapping[str, Any]], records: Mapping[str, Sequence[Mapping[str, Any]]], scale: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    modes = list(summaries)
    names = [MODES.get(m, m) for m in modes]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    ax = axes[0]
    for m, name in zip(modes, names, strict=True):
        xs = np.sort([float(r["ttft_ms"]) / (scale or 1) for r in records[m] if r["ttft_ms"] is not None])
        if xs.size:
            ax.plot(xs, np.arange(1, xs.size + 1) / xs.size, label=name)
    ax.set_xscale("log")
    ax.set_xlabel("TTFT (modelled ms)")
    ax.set_ylabel("CDF")
    ax.set_title("TTFT distribution")
    ax.legend()
    ax = axes[1]
    keys = [("ttft_p50_ms", "TTFT P50"), ("ttft_p99_ms", "TTFT P99"), ("e2e_p50_ms", "E2E P50"), ("e2e_p99_ms", "E2E P99")]
    x = np.arange(len(keys))
    w = 0.8 / max(1, len(modes))
    for i, (m, name) in enumerate(zip(modes, names, strict=True)):
        ax.bar(x + i * w, [summaries[m][k] for k, _ in keys], w, label=name)
    ax.set_xticks(x + w * (len(modes) - 1) / 2, [lbl for _, lbl in keys])
    ax.set_ylabel("modelled ms")
    ax.set_title("Latency")
    ax.legend()
    ax = axes[2]
    local = [100 * summaries[m]["local_hit_rate"] for m in modes]
    cross = [100 * summaries[m]["xregion_hit_rate"] for m in modes]
    ax.bar(names, local, label="local")
    ax.bar(names, cross, bottom=local, label="cross-region")
    ax.set_ylabel("reused / prompt tokens (%)")
    ax.set_title("Prefix reuse (token-weighted)")
    ax.legend()
    fig.suptitle("kvcompass cluster-demo: Mooncake conversation replay on a live cluster")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


async def run_cluster_demo(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    from kvcompass.discovery.plan import LevelPlan
    from kvcompass.discovery.topology import load_topology
    from kvcompass.services.loadgen import load_requests, summarize, write_records

    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    for m in modes:
        if m not in MODES:
            raise UsageError(f"--modes: unknown mode {m!r} (known: {', '.join(MODES)})")
    if not (math.isfinite(args.time_scale) and args.time_scale > 0):
        raise UsageError(f"--time-scale must be > 0, got {args.time_scale}")
    if not (math.isfinite(args.rate) and args.rate > 0):
        raise UsageError(f"--rate must be > 0, got {args.rate}")
    if args.requests < 1 or args.max_tokens < 1:
        raise UsageError("--requests and --max-tokens must be >= 1")
    topo = load_topology(args.topology)
    regions = list(LevelPlan(topo).edge_regions)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    plans = load_requests(
        args.trace, regions, rate=args.rate / args.time_scale, max_requests=args.requests, topology=topo, seed=args.seed, max_tokens=args.max_tokens
    )
    records: dict[str, list[dict[str, Any]]] = {}
    summaries: dict[str, dict[str, Any]] = {}
    for m in modes:
        records[m] = await _run_mode(args, m, plans, out)
        write_records(out / f"records-{m}.jsonl", records[m])
        summaries[m] = _modelled(summarize(records[m]), args.time_scale)
    (out / "summary.json").write_text(json.dumps({"time_scale": args.time_scale, "rate_modelled_req_s": args.rate, "results": summaries}, indent=2) + "\n")
    write_figure(out / "cluster_demo.png", summaries, records, args.time_scale)
    return summaries


def cluster_demo_main(args: argparse.Namespace) -> int:
    t0 = time.perf_counter()
    summaries = asyncio.run(run_cluster_demo(args))
    print(
        f"\nMooncake conversation trace, first {args.requests} requests at {args.rate:g} modelled req/s on {args.topology} "
        f"(time scale {args.time_scale:g}: latencies in modelled ms = wall ms / {args.time_scale:g}; outputs capped at {args.max_tokens} tokens)"
    )
    print(format_table(summaries))
    print(f"\nwrote {os.path.join(args.out, 'cluster_demo.png')}, summary.json and records-*.jsonl in {args.out} ({time.perf_counter() - t0:.0f} s)")
    return 0
