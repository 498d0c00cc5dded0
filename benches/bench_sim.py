"""Simulator speed: simulated requests per second of wall time, per scheme, on paper-64x8.

Prints progress to stderr and one JSON object as the last line of stdout:
``{"requests_per_s": {SCHEME: r}, "events_per_request": {SCHEME: e}, "requests": n,
"target_requests_per_s": {SCHEME: t}, "meets": {SCHEME: bool}, "host_speed": {...}, ...}``
(``host_speed``: a fixed Python loop's ns an iteration and the host's dependent-load latency,
before and after the timed runs, to tell a slow host from a slow build). Each scheme's figure is
its ``Simulator.run`` alone (building the fleet, the plane and the workload is not timed). The
workload is the seeded Mixed-like generator (agent, document and coding prompts, about 5,000
tokens on average) at a loaded rate. Targets (issue 13): 10,000 req/s for the KVCompass
schemes, 50,000 for every other (the engine's own floor).

    python benches/bench_sim.py --quick          # every scheme (the KVCompass ablations too), 20,000 requests each
    python benches/bench_sim.py --schemes kvcompass,oracle   # some of them
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import json
import sys
import time
import tracemalloc

from kvcompass._core import BlockCache
from kvcompass.discovery.topology import Topology, load_topology
from kvcompass.sim.engine import SimConfig, Simulator
from kvcompass.sim.schemes import SCHEMES
from kvcompass.sim.workload import synthetic_mixed

from _provenance import core_build, git_info

TARGET = 50_000.0
TARGET_KVCOMPASS = 10_000.0


def _host_speed() -> dict[str, float]:
    """Two readings of how fast this host runs right now, taken before and after the timed
    runs: a fixed pure-Python loop (ns an iteration: the interpreter's share of a KVCompass run)
    and a dependent load over 64 MiB (ns: the memory-bound share of every scheme's per-block
    tables). Why: the same build measured 5,400 and 11,500 kvcompass req/s on two days; the
    bars are absolute, but a reader comparing runs across days needs to know which host ran."""
    from kvcompass import _core

    n = 2_000_000
    t0 = time.perf_counter()
    x = 0
    for i in range(n):
        x += i & 7
    loop_ns = (time.perf_counter() - t0) / n * 1e9
    return {"python_loop_ns": round(loop_ns, 2), "mem_latency_ns_64mib": round(float(_core.bench_mem_latency_ns(64)), 1)}


def _target(scheme: str) -> float:
    return TARGET_KVCOMPASS if scheme.startswith("kvcompass") else TARGET


def _scaled_caches(topo: Topology, f: float) -> Topology:
    """``topo`` with every worker's capacities times ``f``, in whole blocks (at least one in VRAM)."""
    if not f > 0:
        raise SystemExit(f"--cache-scale must be > 0, got {f}")
    b = topo.block_size
    from kvcompass.engine.cache import worker_capacities

    def scaled(tokens: int, least: int) -> int:
        return max(least, int(tokens * f) // b * b)

    # From the capacities the simulator would give (a stated 0 DRAM stays 0, not the default).
    caps = [worker_capacities(w.vram_tokens, w.dram_tokens, b) for w in topo.workers]
    workers = tuple(dataclasses.replace(w, vram_tokens=scaled(v, b), dram_tokens=scaled(d, 0)) for w, (v, d) in zip(topo.workers, caps))
    return dataclasses.replace(topo, workers=workers)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="every scheme, the KVCompass ablations included, 20,000 requests each")
    ap.add_argument("--requests", type=int, default=None, help="requests per scheme (default 20000)")
    ap.add_argument("--schemes", default=None, help="comma list or 'all' (default: all but the ablations with --quick, else all)")
    ap.add_argument("--topology", default="paper-64x8")
    ap.add_argument("--rate", type=float, default=150.0, help="offered load, req/s of simulated time (150: about 0.8 of paper-64x8's prefill-only capacity for this workload, about 1.10 of its no-reuse capacity with chunked decode and the KV pool, kvcompass.sim.capacity)")
    ap.add_argument("--memory-requests", type=int, default=2000, help="requests of the memory pass (first scheme; 0 skips it)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument(
        "--cache-scale",
        type=float,
        default=1.0,
        metavar="F",
        help="scale every worker's VRAM and DRAM capacity by F (e.g. 0.001): small caches fill within the run, "
        "so the memory figure shows what the heap does once they are full",
    )
    args = ap.parse_args()
    n = args.requests or 20000
    if args.schemes is None:
        # Every scheme, the KVCompass ablations included, as issue 13's bar reads (found in
        # review: --quick left them out, and they run 0.8x kvcompass's rate).
        schemes = list(SCHEMES)
    else:
        schemes = list(SCHEMES) if args.schemes == "all" else [s.strip() for s in args.schemes.split(",") if s.strip()]
    topo = load_topology(args.topology)
    if args.cache_scale != 1.0:
        topo = _scaled_caches(topo, args.cache_scale)
    requests = synthetic_mixed(n, regions=topo, seed=args.seed, rate=args.rate, block_size=topo.block_size)
    rates: dict[str, float] = {}
    events: dict[str, float] = {}
    host_before = _host_speed()
    for name in schemes:
        sim = Simulator(topo, requests, name, SimConfig(seed=args.seed))
        t0 = time.perf_counter()
        summary = sim.run()
        wall = time.perf_counter() - t0
        rates[name] = round(summary.requests / wall, 1)
        events[name] = round(sim.events_processed / summary.requests, 2)
        print(f"{name}: {summary.requests} requests in {wall:.2f} s -> {rates[name]:.0f} req/s, {events[name]} engine events per request", file=sys.stderr)
        del sim, summary
    # Memory for half and all of the requests, first scheme: the Python heap's peak (tracemalloc,
    # numpy included) plus what the emulated caches and the agents' block forests hold in Rust at
    # the end (their blocks live there, out of tracemalloc's sight, and only grow until the
    # caches are full; the index tables are bounded by their capacity).
    first = schemes[0]
    peaks: dict[str, float] = {}
    caches: dict[str, float] = {}
    forests: dict[str, float] = {}
    m = min(n, args.memory_requests)
    for label, k in ((("half", m // 2), ("full", m)) if m else ()):
        tracemalloc.start()
        sim = Simulator(topo, requests[:k], first, SimConfig(seed=args.seed))
        sim.run()
        py_peak = tracemalloc.get_traced_memory()[1] / 2**20
        tracemalloc.stop()
        # + the caches' shared chain memo and the engine's memo of prompt runs
        caches[label] = (sum(c.memory_bytes for c in sim.caches.values()) + BlockCache.memo_bytes() + sim.engine_memo_bytes) / 2**20
        forests[label] = sum(a.memory_bytes for a in sim.agents.values()) / 2**20
        peaks[label] = py_peak + caches[label] + forests[label]
        del sim
    host_after = _host_speed()
    growth_kb = (peaks["full"] - peaks["half"]) * 1024 / max(1, m - m // 2) if m else 0.0
    if m:
        print(
            f"{first}: peak {peaks['half']:.1f} MiB at {m // 2} requests, {peaks['full']:.1f} MiB at {m} "
            f"(of which emulated caches {caches['half']:.1f} / {caches['full']:.1f} MiB, agents' forests "
            f"{forests['half']:.1f} / {forests['full']:.1f} MiB): {growth_kb:.2f} KiB per request",
            file=sys.stderr,
        )
    out = {
        "topology": args.topology,
        "requests": n,
        "rate": args.rate,
        "requests_per_s": rates,
        "events_per_request": events,
        "target_requests_per_s": {k: _target(k) for k in rates},
        "meets": {k: v >= _target(k) for k, v in rates.items()},
        "memory_scheme": first,
        "memory_requests": m,
        "heap_peak_mb": {k: round(v, 2) for k, v in peaks.items()},
        "cache_mb": {k: round(v, 2) for k, v in caches.items()},
        "forest_mb": {k: round(v, 2) for k, v in forests.items()},
        "heap_growth_kb_per_request": round(growth_kb, 3),
        "cache_scale": args.cache_scale,
        "host_speed": {"before": host_before, "after": host_after},
        "mode": "quick" if args.quick else "full",
        "git_commit": git_info()[0],
        "git_dirty": git_info()[1],
        "core_build": core_build(),
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
    }
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
