"""The built-in demonstration: the whole discovery plane of ``testbed-14x3`` in one process.

Workers in us-east-1, eu-central-1 and ap-northeast-1 (8/2/4, the paper's testbed shape) cache
prompts and publish KV events in vLLM's wire format; each worker's agent turns them into key ops;
the maintenance units (one per shard) turn those into sequenced patch batches; every region's
edge builds its views only from snapshots and batches and routes each prompt with the joint
score over its latency-derived level plan. It prints the plan, what the index holds (with every
edge's views checked byte-for-byte against the writers), who was found where, who won and why,
and how fast each step ran.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from typing import TextIO

import numpy as np
import numpy.typing as npt

from kvcompass.agent import BlockStored, WorkerAgent, encode_batch
from kvcompass.discovery.plane import LocalPlane
from kvcompass.discovery.topology import load_topology
from kvcompass.index_types import Namespace, Tier

__all__ = ["DemoConfig", "TOPOLOGY", "run_demo"]

TOPOLOGY = "testbed-14x3"
# The engines' KV block size (vLLM's default is 16 tokens).
BLOCK = 16


@dataclass(frozen=True, slots=True)
class DemoConfig:
    prompts: int = 24
    prompt_tokens: int = 4096
    seed: int = 7
    route_repeats: int = 20


def _prompts(cfg: DemoConfig, rng: np.random.Generator) -> list[npt.NDArray[np.uint32]]:
    """A few shared system preambles with private tails (what makes prefixes reusable)."""
    preambles = [rng.integers(0, 128_000, size=int(rng.integers(64, 192)) * BLOCK, dtype=np.uint32) for _ in range(4)]
    out = []
    for _ in range(cfg.prompts):
        pre = preambles[int(rng.integers(0, len(preambles)))]
        tail = rng.integers(0, 128_000, size=cfg.prompt_tokens - len(pre), dtype=np.uint32)
        out.append(np.concatenate([pre, tail]).astype(np.uint32))
    return out


def run_demo(cfg: DemoConfig = DemoConfig(), out: TextIO | None = None) -> dict[str, float]:
    """Run the demonstration; returns the headline figures (also printed)."""
    w = out or sys.stdout
    rng = np.random.default_rng(cfg.seed)
    ns = Namespace("llama-3.1-8b", "demo")
    t0 = time.perf_counter()
    plane = LocalPlane(load_topology(TOPOLOGY), seed=cfg.seed)
    boot_ms = (time.perf_counter() - t0) * 1e3
    topo, plan, layout = plane.topology, plane.plan, plane.layout
    label = {r.name: f"{r.name} ({r.aws_region})" for r in topo.regions}
    w.write(f"Topology {topo.name}: {len(topo.workers)} workers in {len(topo.regions)} regions; RTT matrix: {topo.rtt.source}\n")
    w.write("\nLevel plan (prefix lengths each edge queries, tokens; n1 = RTT / beta toward remote regions):\n")
    for src in plan.edge_regions:
        for dst in plan.target_regions:
            n1 = "own region" if src == dst else f"n1 {plan.n1(src, dst):.0f}"
            w.write(f"  edge {label[src]:>21} -> {label[dst]:<21} {n1:>10}  {list(plan.lengths(src, dst))}\n")

    # Workers cache prompts and publish vLLM KV events; agents key them; units index them.
    prompts = _prompts(cfg, rng)
    workers = list(layout.workers)
    region_of = {s.id: s.region for s in topo.workers}
    agents = {wk: WorkerAgent(wk, ns, plan.registration(region_of[wk]), layout.shards, block_size=BLOCK) for wk in workers}
    engine_seq = dict.fromkeys(workers, 0)
    holders: list[tuple[str, Tier]] = []
    t0 = time.perf_counter()
    ops = 0
    for i, p in enumerate(prompts):
        wk = workers[int(rng.integers(0, len(workers)))]
        medium = "GPU" if rng.random() < 0.7 else "CPU"
        holders.append((wk, Tier.VRAM if medium == "GPU" else Tier.DRAM))
        n = len(p) // BLOCK
        event = BlockStored(tuple(range(i * 10_000, i * 10_000 + n)), None, tuple(int(t) for t in p[: n * BLOCK]), BLOCK, None, medium)
        frames = encode_batch([event], seq=engine_seq[wk], ts=float(i))
        engine_seq[wk] += 1
        for batch in agents[wk].on_message(frames).batches:
            plane.ingest(batch, sender=wk)
            ops += len(batch.keys)
    ingest_ms = (time.perf_counter() - t0) * 1e3
    t0 = time.perf_counter()
    report = plane.propagate()
    propagate_ms = (time.perf_counter() - t0) * 1e3
    if not plane.converged():
        raise RuntimeError("an edge's view diverged from its writer")
    entries = sum(u.stats.entries for u in plane.units)
    w.write(
        f"\nIndex: {len(prompts)} prompts cached -> {ops} key ops from {len(agents)} agents ({ingest_ms:.1f} ms from vLLM event bytes), "
        f"{entries} entries in {len(layout.tables)} tables x {layout.shards} shards; {report.batches} patch batches "
        f"({report.patch_bytes} bytes) delivered to {len(plane.edges)} edges in {propagate_ms:.1f} ms; "
        f"every view's digest matches its writer (edges booted in {boot_ms:.1f} ms)\n"
    )

    # Route every prompt from a random region's edge.
    w.write("\nRoutes (score = WAN + queue + prefill + reload, ms):\n")
    w.write(f"  {'#':>2} {'edge':>6} {'holder':>14} {'winner':>8} {'match':>6} {'tier':>6} {'score':>7} {'wan':>6} {'prefill':>8} {'reload':>7} {'no-reuse':>9}\n")
    found = 0
    timings: list[float] = []
    edges = list(plane.edges)
    for i, p in enumerate(prompts):
        edge = plane.edges[edges[int(rng.integers(0, len(edges)))]]
        now = float(i)
        d = edge.route(p, ns, now)
        t0 = time.perf_counter()
        for _ in range(cfg.route_repeats):
            edge.route(p, ns, now)
        timings.append((time.perf_counter() - t0) / max(1, cfg.route_repeats))
        hk, ht = holders[i]
        found += d.expected_match > 0
        # What the winner would cost with nothing reused: the prefill the index saved.
        no_reuse = d.terms.wan + d.terms.queue + plan.beta(d.region) * len(p)
        w.write(
            f"  {i:>2} {edge.region:>6} {hk + '/' + ht.name:>14} {d.worker:>8} {d.expected_match:>6} {Tier(d.tier).name:>6} "
            f"{d.score:>7.1f} {d.terms.wan:>6.1f} {d.terms.prefill:>8.1f} {d.terms.reload:>7.1f} {no_reuse:>9.1f}\n"
        )
    p50_us = float(np.median(timings)) * 1e6
    w.write(
        f"\nFound a cached prefix for {found}/{len(prompts)} prompts; Edge.route p50 {p50_us:.1f} us per "
        f"{cfg.prompt_tokens}-token prompt ({len(workers)} workers, {len(topo.regions)} regions, "
        f"{sum(len(x) for x in plan.router_plan(edges[0]))} levels; Python, belief, queues and speculation included)\n"
    )
    return {"found": float(found), "prompts": float(len(prompts)), "route_us_p50": p50_us, "patch_bytes": float(report.patch_bytes)}
