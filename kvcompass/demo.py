"""The built-in demonstration of the index: three regions, one edge per region, real RTTs.

Workers of the built-in ``testbed-14x3`` topology (8/2/4 in us-east-1, eu-central-1 and
ap-northeast-1, the paper's testbed shape) cache prompts; their writers (one LudoTable per table
and shard of the plan's layout) turn tier-field writes into patch batches; each edge builds its
views only from snapshots and batches, then routes prompts with the Rust lookup-and-score loop
over the level plan of its region. It prints who was found where and how fast each step ran.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TextIO

import numpy as np
import numpy.typing as npt

from kvcompass import _core
from kvcompass.discovery.plan import LevelPlan
from kvcompass.discovery.topology import load_topology
from kvcompass.index import Namespace, Tier

__all__ = ["DemoConfig", "TOPOLOGY", "run_demo"]

TOPOLOGY = "testbed-14x3"
# DRAM reload over PCIe 4.0 (~25 GB/s) of 128 KiB/token of KV (DESIGN.md section 6).
GAMMA_MS_PER_TOKEN = 0.005


@dataclass(frozen=True, slots=True)
class DemoConfig:
    prompts: int = 24
    prompt_tokens: int = 4096
    seed: int = 7
    route_repeats: int = 200


def run_demo(cfg: DemoConfig = DemoConfig(), out: TextIO | None = None) -> dict[str, float]:
    """Run the demonstration; returns the headline figures (also printed)."""
    import sys

    w = out or sys.stdout
    plan = LevelPlan(load_topology(TOPOLOGY))
    topo = plan.topology
    layout = plan.layout()
    w.write(f"Topology {topo.name}; RTT matrix: {topo.rtt.source}\n")
    rng = np.random.default_rng(cfg.seed)
    ns = Namespace("llama-3.1-8b", "demo")
    regions = topo.region_names
    n_regions = len(regions)
    # Per-worker arrays in layout order (the order of the Router's worker indices).
    specs = {s.id: s for s in topo.workers}
    names = list(layout.workers)
    n_workers = len(names)
    worker_region = np.array([topo.region_index(specs[n].region) for n in names], dtype=np.uint32)
    beta = np.array([specs[n].beta_ms_per_token for n in names])
    index_of = {n: i for i, n in enumerate(names)}
    label = {r.name: f"{r.name} ({r.aws_region})" for r in topo.regions}

    # Each edge's plan toward each region; a worker registers at the union over all edges.
    plans = {o: plan.router_plan(regions[o]) for o in range(n_regions)}
    w.write("\nLevel plan (prefix lengths each edge queries, tokens; n1 = RTT / beta toward remote regions):\n")
    for src in regions:
        for dst in regions:
            n1 = "own region" if src == dst else f"n1 {plan.n1(src, dst):.0f}"
            w.write(f"  edge {label[src]:>21} -> {label[dst]:<21} {n1:>10}  {list(plan.lengths(src, dst))}\n")

    # Writers: one per (table, shard) of the plan's layout (a table per region here: <= 16 workers).
    shards = layout.shards
    writers = [
        [_core.LudoTable(table=spec.table_id, shard=sh, capacity=4096, value_bits=layout.value_bits, fp_bits=layout.fp_bits) for sh in range(shards)]
        for spec in layout.tables
    ]
    n_tables = len(writers)
    # What a booting edge fetches first: each writer's (empty) state at seq 0.
    initial = [[t.export_snapshot() for t in row] for row in writers]

    # Prompts: a few shared system preambles plus private suffixes.
    preambles = [rng.integers(0, 128_000, size=int(rng.integers(1024, 3072)), dtype=np.uint32) for _ in range(4)]
    prompts: list[npt.NDArray[np.uint32]] = []
    for _ in range(cfg.prompts):
        pre = preambles[int(rng.integers(0, len(preambles)))]
        tail = rng.integers(0, 128_000, size=cfg.prompt_tokens - len(pre), dtype=np.uint32)
        prompts.append(np.concatenate([pre, tail]).astype(np.uint32))

    # Workers cache prompts: every prompt is held by one random worker, in VRAM or DRAM; the
    # worker registers it at every length any edge queries toward its region.
    t0 = time.perf_counter()
    writes = 0
    holders: list[tuple[int, Tier]] = []
    for p in prompts:
        wk = int(rng.integers(0, n_workers))
        tier = Tier.VRAM if rng.random() < 0.7 else Tier.DRAM
        holders.append((wk, tier))
        ref = layout.field_of(names[wk])
        keys = ns.keys(p, plan.registration(specs[names[wk]].region))
        for k in keys[keys != _core.NO_KEY]:
            writers[ref.table_id][_core.shard_of(int(k), shards)].set_field(int(k), ref.field, int(tier))
            writes += 1
    batches = [[t.take_batch() for t in row] for row in writers]
    write_s = time.perf_counter() - t0
    batch_bytes = sum(len(b) for row in batches for b in row if b)

    # Edges: views built only from a snapshot plus the sequenced batches.
    t0 = time.perf_counter()
    edges: list[list[list[_core.LudoView]]] = []
    for _ in range(n_regions):
        views = []
        for t in range(n_tables):
            row = []
            for sh in range(shards):
                v = _core.LudoView(t, sh)
                v.apply_batch(initial[t][sh])
                b = batches[t][sh]
                if b is not None:
                    v.apply_batch(b)
                if v.digest() != writers[t][sh].digest():
                    raise RuntimeError(f"view of table {t} shard {sh} diverged from its writer")
                row.append(v)
            views.append(row)
        edges.append(views)
    apply_s = time.perf_counter() - t0
    view_bytes = sum(v.memory_bytes for row in edges[0] for v in row)
    w.write(
        f"\nIndex: {writes} tier writes -> {sum(len(t) for row in writers for t in row)} entries in "
        f"{n_tables * shards} (table, shard) writers ({n_tables} tables x {shards} shards, {layout.fp_bits}-bit fingerprints), "
        f"{batch_bytes} patch bytes, written in {write_s * 1e3:.1f} ms; every edge rebuilt {n_tables * shards} views from "
        f"snapshot + batches in {apply_s * 1e3:.1f} ms (digests match the writers); "
        f"one edge's views hold {view_bytes} bytes\n"
    )

    # Route: every prompt arrives at a random region's edge.
    belief = np.ones(n_workers)
    tq = rng.uniform(0.0, 40.0, size=n_workers)
    routers = []
    for o in range(n_regions):
        tables = [
            (topo.region_index(spec.region), np.array([index_of[n] for n in spec.workers], dtype=np.uint32), edges[o][spec.table_id])
            for spec in layout.tables
        ]
        routers.append(_core.Router(plans[o], tables))
    w.write("\nRoutes (WAN = one-way, RTT/2):\n")
    w.write(f"  {'#':>2} {'edge':>6} {'holder':>13} {'winner':>8} {'match':>6} {'tier':>5} {'score ms':>9} {'recompute ms':>13}\n")
    found = 0
    timings: list[float] = []
    for i, p in enumerate(prompts):
        o = int(rng.integers(0, n_regions))
        wan = np.array([plan.rtt_ms(regions[o], regions[int(r)]) / 2 for r in worker_region])
        res = routers[o].route(p, ns.digest, worker_region, beta, wan, tq, belief, gamma=GAMMA_MS_PER_TOKEN, lam=0.0)
        t0 = time.perf_counter()
        for _ in range(cfg.route_repeats // 10):
            routers[o].route(p, ns.digest, worker_region, beta, wan, tq, belief, gamma=GAMMA_MS_PER_TOKEN)
        timings.append((time.perf_counter() - t0) / max(1, cfg.route_repeats // 10))
        hk, ht = holders[i]
        m = int(res.matches[hk])
        found += m > 0
        win = res.winner
        # What the winner would cost with nothing reused: the prefill the index saved.
        recompute = float(wan[win] + tq[win] + beta[win] * len(p))
        w.write(
            f"  {i:>2} {regions[o]:>6} {names[hk] + ('' if m else ' (miss)'):>13} {names[win]:>8} "
            f"{int(res.matches[win]):>6} {Tier(int(res.tiers[win])).name:>5} {res.score:>9.1f} {recompute:>13.1f}\n"
        )
    p50_us = float(np.median(timings)) * 1e6
    w.write(
        f"\nFound the true holder's prefix for {found}/{len(prompts)} prompts; "
        f"route p50 {p50_us:.1f} us per {cfg.prompt_tokens}-token prompt "
        f"({n_workers} workers, {n_regions} regions, {sum(len(x) for x in plans[0])} levels, Python call included)\n"
    )
    return {"found": float(found), "prompts": float(len(prompts)), "route_us_p50": p50_us, "patch_bytes": float(batch_bytes)}
