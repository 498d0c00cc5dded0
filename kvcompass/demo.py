"""The built-in demonstration of the index: three regions, one edge per region, real RTTs.

Workers in us-east-1, eu-central-1 and ap-northeast-1 (8/2/4, the paper's testbed shape) cache
prompts; their writers (one LudoTable per region table and shard) turn tier-field writes into
patch batches; each edge builds its views only from snapshots and batches, then routes prompts
with the Rust lookup-and-score loop. It prints who was found where and how fast each step ran.
"""

from __future__ import annotations

import csv
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

import numpy as np
import numpy.typing as npt

from kvcompass import _core
from kvcompass.index import Namespace, Tier

__all__ = ["DemoConfig", "load_rtt_matrix", "level_plan", "run_demo"]

# Prefill rate of Llama-3.1-8B BF16 on an RTX 5090 (paper section 5.2): 0.085 ms/token.
BETA_MS_PER_TOKEN = 0.085
# DRAM reload over PCIe 4.0 (~25 GB/s) of 128 KiB/token of KV (DESIGN.md section 6).
GAMMA_MS_PER_TOKEN = 0.005
BLOCK = 16
REGIONS = ("us-east-1", "eu-central-1", "ap-northeast-1")
WORKERS_PER_REGION = (8, 2, 4)
SHARDS = 2

_BUNDLED = Path(__file__).parent / "data" / "rtt_p50_excerpt.csv"


@dataclass(frozen=True, slots=True)
class DemoConfig:
    prompts: int = 24
    prompt_tokens: int = 4096
    seed: int = 7
    route_repeats: int = 200


def _shared_matrix() -> Path | None:
    env = os.environ.get("KVCOMPASS_DATA")
    candidates = [Path(env)] if env else []
    candidates += [Path.cwd() / ".." / "shared" / "data", Path(__file__).resolve().parents[2] / "shared" / "data"]
    for c in candidates:
        p = c / "aws_interregion_rtt_p50_symmetric_ms.csv"
        if p.is_file():
            return p
    return None


def load_rtt_matrix(path: Path | None = None) -> tuple[dict[tuple[str, str], float], Path]:
    """RTT in ms by (from, to); the measured matrix when present, else the bundled excerpt."""
    src = path or _shared_matrix() or _BUNDLED
    with open(src, newline="") as f:
        rows = list(csv.reader(f))
    header = rows[0][1:]
    rtt: dict[tuple[str, str], float] = {}
    for row in rows[1:]:
        for to, cell in zip(header, row[1:]):
            rtt[(row[0], to)] = float(cell)
    return rtt, src


def _round_up(n: float, block: int) -> int:
    return max(block, int(-(-n // block)) * block)


def level_plan(rtt: dict[tuple[str, str], float], origin: str, target: str, levels: int = 6) -> list[int]:
    """Paper section 3.2: toward a remote region n1 = RTT/beta, then equal steps of n1/2; in the
    own region a short minimum doubling upward. Lengths rounded to the KV block size."""
    if origin == target:
        return [256 * 2**i for i in range(levels - 1)]
    n1 = rtt[(origin, target)] / BETA_MS_PER_TOKEN
    return sorted({_round_up(n1 * (1 + 0.5 * i), BLOCK) for i in range(levels)})


def _name(k: int, worker_region: npt.NDArray[np.uint32]) -> str:
    return f"{REGIONS[int(worker_region[k])]}/w{k}"


def run_demo(cfg: DemoConfig = DemoConfig(), out: TextIO | None = None) -> dict[str, float]:
    """Run the demonstration; returns the headline figures (also printed)."""
    import sys

    w = out or sys.stdout
    rtt, src = load_rtt_matrix()
    w.write(f"RTT matrix: {src}\n")
    rng = np.random.default_rng(cfg.seed)
    ns = Namespace("llama-3.1-8b", "demo")
    n_regions = len(REGIONS)
    worker_region = np.concatenate([np.full(n, r, dtype=np.uint32) for r, n in enumerate(WORKERS_PER_REGION)])
    n_workers = len(worker_region)
    first_of_region = np.concatenate([[0], np.cumsum(WORKERS_PER_REGION)[:-1]])

    # Each edge's plan toward each region; a worker registers at the union over all edges.
    plans = {o: [level_plan(rtt, REGIONS[o], REGIONS[r]) for r in range(n_regions)] for o in range(n_regions)}
    registration = [sorted({c for o in range(n_regions) for c in plans[o][r]}) for r in range(n_regions)]
    w.write("\nLevel plan (prefix lengths each edge queries, tokens):\n")
    for o in range(n_regions):
        for r in range(n_regions):
            w.write(f"  edge {REGIONS[o]:>15} -> {REGIONS[r]:<15} {plans[o][r]}\n")

    # Writers: one table per region (<= 16 workers), SHARDS shards each.
    writers = [[_core.LudoTable(table=r, shard=s, capacity=4096) for s in range(SHARDS)] for r in range(n_regions)]
    # What a booting edge fetches first: each writer's (empty) state at seq 0.
    initial = [[t.export_snapshot() for t in row] for row in writers]

    # Prompts: a few shared system preambles plus private suffixes.
    preambles = [rng.integers(0, 128_000, size=int(rng.integers(1024, 3072)), dtype=np.uint32) for _ in range(4)]
    prompts: list[npt.NDArray[np.uint32]] = []
    for _ in range(cfg.prompts):
        pre = preambles[int(rng.integers(0, len(preambles)))]
        tail = rng.integers(0, 128_000, size=cfg.prompt_tokens - len(pre), dtype=np.uint32)
        prompts.append(np.concatenate([pre, tail]).astype(np.uint32))

    # Workers cache prompts: every prompt is held by one random worker, in VRAM or DRAM.
    t0 = time.perf_counter()
    writes = 0
    holders: list[tuple[int, Tier]] = []
    for p in prompts:
        wk = int(rng.integers(0, n_workers))
        tier = Tier.VRAM if rng.random() < 0.7 else Tier.DRAM
        holders.append((wk, tier))
        r = int(worker_region[wk])
        field = wk - int(first_of_region[r])
        keys = ns.keys(p, registration[r])
        for k in keys[keys != _core.NO_KEY]:
            writers[r][_core.shard_of(int(k), SHARDS)].set_field(int(k), field, int(tier))
            writes += 1
    batches = [[t.take_batch() for t in row] for row in writers]
    write_s = time.perf_counter() - t0
    batch_bytes = sum(len(b) for row in batches for b in row if b)

    # Edges: views built only from a snapshot plus the sequenced batches.
    t0 = time.perf_counter()
    edges: list[list[list[_core.LudoView]]] = []
    for _ in range(n_regions):
        views = []
        for r in range(n_regions):
            row = []
            for sh in range(SHARDS):
                v = _core.LudoView(r, sh)
                v.apply_batch(initial[r][sh])
                b = batches[r][sh]
                if b is not None:
                    v.apply_batch(b)
                if v.digest() != writers[r][sh].digest():
                    raise RuntimeError(f"view of table {r} shard {sh} diverged from its writer")
                row.append(v)
            views.append(row)
        edges.append(views)
    apply_s = time.perf_counter() - t0
    view_bytes = sum(v.memory_bytes for row in edges[0] for v in row)
    w.write(
        f"\nIndex: {writes} tier writes -> {sum(len(t) for row in writers for t in row)} entries in "
        f"{n_regions * SHARDS} (table, shard) writers, {batch_bytes} patch bytes, "
        f"written in {write_s * 1e3:.1f} ms; every edge rebuilt {n_regions * SHARDS} views from "
        f"snapshot + batches in {apply_s * 1e3:.1f} ms (digests match the writers); "
        f"one edge's views hold {view_bytes} bytes\n"
    )

    # Route: every prompt arrives at a random region's edge.
    beta = np.full(n_workers, BETA_MS_PER_TOKEN)
    belief = np.ones(n_workers)
    tq = rng.uniform(0.0, 40.0, size=n_workers)
    routers = []
    for o in range(n_regions):
        tables = [(r, np.arange(first_of_region[r], first_of_region[r] + WORKERS_PER_REGION[r], dtype=np.uint32), edges[o][r]) for r in range(n_regions)]
        routers.append(_core.Router(plans[o], tables))
    w.write("\nRoutes (WAN = one-way, RTT/2):\n")
    w.write(f"  {'#':>2} {'edge':>15} {'holder':>18} {'winner':>18} {'match':>6} {'tier':>5} {'score ms':>9} {'recompute ms':>13}\n")
    found = 0
    timings: list[float] = []
    for i, p in enumerate(prompts):
        o = int(rng.integers(0, n_regions))
        wan = np.array([rtt[(REGIONS[o], REGIONS[int(r)])] / 2 for r in worker_region])
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
            f"  {i:>2} {REGIONS[o]:>15} {_name(hk, worker_region) + ('' if m else ' (miss)'):>18} {_name(win, worker_region):>18} "
            f"{int(res.matches[win]):>6} {Tier(int(res.tiers[win])).name:>5} {res.score:>9.1f} {recompute:>13.1f}\n"
        )
    p50_us = float(np.median(timings)) * 1e6
    w.write(
        f"\nFound the true holder's prefix for {found}/{len(prompts)} prompts; "
        f"route p50 {p50_us:.1f} us per {cfg.prompt_tokens}-token prompt "
        f"({n_workers} workers, {n_regions} regions, {sum(len(x) for x in plans[0])} levels, Python call included)\n"
    )
    return {"found": float(found), "prompts": float(len(prompts)), "route_us_p50": p50_us, "patch_bytes": float(batch_bytes)}
