#!/usr/bin/env python3
"""Service benchmark for kvcompass: gRPC ingest, patch propagation, the edge's HTTP door.

Every figure is measured in this run on loopback (nothing is hard-coded but the targets, which
are only compared against). Progress goes to stderr; the LAST line of stdout is one JSON object.

    python benches/bench_service.py --quick        # < 60 s on 2 cores
    python benches/bench_service.py                # ~ 3-5 min
    python benches/bench_service.py --profile DIR  # also cProfile every process into DIR/*.prof

Processes. The maintenance unit of shard 0 runs in its own process (this script re-executed with
a hidden ``--child unit`` argument: ``serve_maintenance`` with the default ``MaintenanceConfig``,
i.e. a 2 ms flush loop); the door runs in its own process (``--child door``: ``serve_door`` over
a ``LocalPlane`` edge, default tokenizer). The agents' ``IngestClient``s, the edge's
``EdgeSync``, the emulated worker and the HTTP client run in this process, so client and server
never share an event loop or a GIL. ``--pin`` pins the child to CPU 0 and this process to CPU 1
(off by default: on a shared host a pinned process queues behind whatever else runs on its CPU).
The host is shared and noisy: repeat runs vary, latency tails most of all; the CPU-normalised
figures (``*_cpu_*``) are the steadier ones.

How each figure is measured:

* ``ingest_ops_per_s``: key ops per second through ``Maintenance.Ingest`` into ONE unit
  process. ``ingest_agents`` agents (workers of three regions, so three tables), each with its
  own ``IngestClient`` (own HTTP/2 connection, the default 64-batch pipeline window), first fill
  their pool of held keys (untimed for this figure; reported as ``ingest_fill_ops_per_s``), then
  all send their steady-state batches at once. Batch sizes are uniform in
  ``ingest_batch_ops`` (512-4096); each batch is 1/3 inserts of fresh keys (tier 1 or 2), 1/3
  removes of held keys (tier 0) and 1/3 VRAM<->DRAM flips of held keys, so the tables stay at
  their filled size (the unit's ``capacity`` is set to that size: no growth rebuilds). Keys are
  random 63-bit keys of shard 0 (what SHA-256-derived prefix keys look like to the table).
  Timed from the first send to the last ack (every batch is acked after it was applied); the
  figure is all steady ops / that wall time. ``ingest_unit_cpu_util`` is the unit process's
  CPU time over the same window (1.0 = one core busy: the unit is the bottleneck; both it and
  ``ingest_client_cpu_util``, the agents' process, well below 1.0: both were starved by other
  load on the host).
* ``patch_p50_ms`` / ``patch_p99_ms``: one agent (``WorkerAgent`` of ``us-7``, block size 16)
  keys engine event batches of ``patch_prompts_per_batch`` fresh 2048-token prompts; its
  shard-0 key-op batch is sent with ``IngestClient.send`` and the clock stops when the
  resulting patch is applied to the edge's view by ``EdgeSync`` (timestamped inside
  ``Edge.apply_patch`` by a subclass; the view is checked to have advanced by exactly one
  batch). Same unit process as the ingest phase (tables full), the unit otherwise idle; one
  batch in flight at a time with a random 0-3 ms pause between samples, so batches land at
  random phases of the flush loop. ``patch_ack_*`` is send -> ack for the same samples.
* ``proxy_overhead_p50_ms`` / ``proxy_overhead_p99_ms``: one ``EmulatedWorker``
  (``time_scale=0``: no modelled sleeping) serves every worker id of the ``us`` edge. The same
  small non-streaming ``/v1/completions`` bodies (token-id prompts of ``door_prompt_tokens``,
  ``max_tokens`` ``door_max_tokens``; the prompts are indexed for ``us-3`` so the route hits)
  are sent one at a time, alternately to the worker directly and through the door (keep-alive
  connections both ways, order alternated per pair). Overhead = percentile of the door's
  latencies minus the same percentile of the direct latencies; ``proxy_pair_delta_*`` are
  percentiles of the per-pair differences (noisier: both legs' noise adds up).
* ``edge_req_per_s``: ``door_concurrency`` client tasks post the same bodies through a door
  for ``door_rps_seconds`` (closed loop); completed requests / wall time. The upstream here is a
  canned aiohttp app replaying, byte for byte, the emulated worker's recorded reply (body and
  ``x-kvcompass-*`` headers) to each body, so the door, not the worker, is the bottleneck (the
  emulated worker costs more CPU per request than the door on this host). ``edge_door_cpu_util``
  is the door process's CPU time over the window (near 1.0: the door was the bottleneck; well
  below: it was starved or waiting); ``edge_req_per_door_cpu_s`` = requests / door CPU seconds,
  its capacity per core whatever else runs on the host. ``*_emulated`` are the same with the
  emulated worker upstream; ``direct_req_per_s_*`` the same load sent to the upstream directly.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import cProfile
import datetime as _dt
import json
import os
import platform
import select
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np

from _provenance import core_build, git_info, meets
from kvcompass.services.lifecycle import loop_factory, stop_process

REPO = Path(__file__).resolve().parent.parent

TARGETS: dict[str, dict[str, float]] = {
    "ingest_ops_per_s": {"min": 200_000},
    "patch_p99_ms": {"max": 5.0},
    "proxy_overhead_p99_ms": {"max": 1.0},
    "edge_req_per_s": {"min": 2000},
}

TOPOLOGY = "testbed-14x3"
MODEL = "llama-3.1-8b"
TENANT = "public"  # the door's default namespace
SHARD = 0
BLOCK = 16
INGEST_WORKERS = ("us-0", "us-1", "eu-0", "asia-0")
PATCH_WORKER = "us-7"
DOOR_REGION = "us"
DOOR_HOLDER = "us-3"

_T0 = time.perf_counter()


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - _T0:7.2f}s] {msg}", file=sys.stderr, flush=True)


def pct(a: Any, q: float) -> float:
    return float(np.percentile(np.asarray(a, dtype=np.float64), q))


def rnd(x: float, nd: int = 3) -> float:
    return float(round(float(x), nd))


# ---------------------------------------------------------------------------------------------
# context


def cpu_model() -> str | None:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def proc_cpu_s(pid: int) -> float | None:
    """user + system CPU seconds of ``pid`` (Linux /proc), None where unavailable."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def pin(cpu: int | None) -> None:
    if cpu is not None and hasattr(os, "sched_setaffinity"):
        with contextlib.suppress(OSError):
            os.sched_setaffinity(0, {cpu})


def cpus() -> tuple[int | None, int | None]:
    """(child CPU, parent CPU) when there are at least two to choose from."""
    if not hasattr(os, "sched_getaffinity"):
        return None, None
    avail = sorted(os.sched_getaffinity(0))
    return (avail[0], avail[1]) if len(avail) >= 2 else (None, None)


# ---------------------------------------------------------------------------------------------
# child processes (this script re-executed with --child KIND SPEC)


def _run(coro: Any, profile: str | None) -> None:
    # The services' own loop choice (uvloop where installed), so a child costs what a service does.
    from kvcompass.services.lifecycle import run

    if profile is None:
        run(coro)
        return
    prof = cProfile.Profile()
    prof.enable()
    try:
        run(coro)
    finally:
        prof.disable()
        prof.dump_stats(profile)


def _ready(payload: dict[str, Any]) -> None:
    print("READY " + json.dumps(payload), flush=True)


def child_unit(spec: dict[str, Any]) -> None:
    from kvcompass.discovery.plan import LevelPlan
    from kvcompass.discovery.topology import load_topology
    from kvcompass.services.maintenance_service import MaintenanceConfig, serve_maintenance

    pin(spec.get("cpu"))
    layout = LevelPlan(load_topology(spec["topology"])).layout()
    coro = serve_maintenance(
        layout, spec["shard"], port=0, metrics_port=0, config=MaintenanceConfig(), capacity=spec["capacity"],
        on_ready=lambda e: _ready({"grpc": e.grpc, "metrics": e.metrics}),
    )
    _run(coro, spec.get("profile"))


def child_door(spec: dict[str, Any]) -> None:
    from kvcompass.agent import BlockStored, WorkerAgent, encode_batch
    from kvcompass.discovery.plane import LocalPlane
    from kvcompass.discovery.topology import load_topology
    from kvcompass.index_types import Namespace
    from kvcompass.services.http_door import serve_door

    pin(spec.get("cpu"))
    plane = LocalPlane(load_topology(spec["topology"]), seed=3)
    edge = plane.edges[spec["region"]]
    holder = spec["holder"]
    region = next(w.region for w in plane.topology.workers if w.id == holder)
    agent = WorkerAgent(holder, Namespace(MODEL, TENANT), plane.plan.registration(region), plane.layout.shards, block_size=BLOCK)
    events = []
    base = 0
    for p in spec["prompts"]:
        n = len(p) // BLOCK
        events.append(BlockStored(tuple(range(base, base + n)), None, tuple(p[: n * BLOCK]), BLOCK, None, "GPU"))
        base += n
    for b in agent.on_message(encode_batch(events, seq=0)).batches:
        plane.ingest(b, sender=holder)
    plane.propagate()
    workers = {w: spec["worker_url"] for w in edge.workers}

    async def main() -> None:
        from prometheus_client import CollectorRegistry

        from kvcompass.services.dashboard import Dashboard
        from kvcompass.services.lifecycle import on_signals
        from kvcompass.services.metrics import MetricsServer

        stop = asyncio.Event()
        with on_signals(stop.set, (signal.SIGTERM,)):
            door = await serve_door(edge, workers, None, port=int(spec.get("port", 0)), reuse_port=bool(spec.get("reuse_port", False)))
            # The operators' page, on a listener of its own as an edge process serves it.
            dash = Dashboard(edge)
            dash.door = door.door
            listener = MetricsServer(CollectorRegistry(), lambda: True, dash.routes())
            port = await listener.start("127.0.0.1", 0)
            _ready({"url": door.url, "dashboard": f"http://127.0.0.1:{port}/dashboard"})
            await stop.wait()
            await door.stop(grace_s=1.0)
            await listener.close()

    _run(main(), spec.get("profile"))


class Child:
    """A child process of this script; :meth:`start` waits for its READY line."""

    def __init__(self, kind: str, spec: dict[str, Any], repo: Path | None = None) -> None:
        """``repo``: another checkout whose bench script and package the child runs (its code
        first on the path; benches/door_ab.py compares two builds so); default this one."""
        self.kind = kind
        root = REPO if repo is None else repo.resolve()
        env = None if repo is None else dict(os.environ, PYTHONPATH=str(root))
        self.proc = subprocess.Popen(
            [sys.executable, str(root / "benches" / "bench_service.py"), "--child", kind, json.dumps(spec)],
            stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True, cwd=root, env=env,
        )
        self.info: dict[str, Any] = {}

    @property
    def pid(self) -> int:
        return self.proc.pid

    def wait_ready(self, timeout: float = 60.0) -> dict[str, Any]:
        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or self.proc.poll() is not None:
                self.stop()
                raise RuntimeError(f"{self.kind} process did not become ready (exit code {self.proc.returncode})")
            r, _, _ = select.select([self.proc.stdout], [], [], min(left, 0.5))
            if r:
                line = self.proc.stdout.readline()
                if line.startswith("READY "):
                    self.info = json.loads(line[6:])
                    return self.info
                if line:
                    print(f"  [{self.kind}] {line.rstrip()}", file=sys.stderr)

    def cpu_s(self) -> float | None:
        return proc_cpu_s(self.proc.pid)

    def stop(self, timeout: float = 20.0) -> None:
        stop_process(self.proc, timeout)
        if self.proc.stdout is not None:
            self.proc.stdout.close()


def scrape(url: str) -> dict[str, float]:
    """The unlabelled-by-us samples of a Prometheus text page: name{labels} -> value."""
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            k, _, v = line.rpartition(" ")
            with contextlib.suppress(ValueError):
                out[k] = float(v)
    return out


# ---------------------------------------------------------------------------------------------
# workloads


def shard_keys(rng: np.random.Generator, n: int, shards: int, shard: int) -> np.ndarray:
    """``n`` random 63-bit keys of ``shard`` (key % shards == shard)."""
    hi = (2**63 - 1 - shard) // shards
    return (rng.integers(0, hi, size=n, dtype=np.uint64) * np.uint64(shards) + np.uint64(shard)).astype(np.uint64)


def ingest_workload(rng: np.random.Generator, worker: str, fill: int, steady_ops: int, lo: int, hi: int, shards: int) -> tuple[list[Any], list[Any]]:
    """(fill batches, steady batches) of one agent; see the module doc for the mix."""
    from kvcompass.discovery.key_ops import KeyOpBatch

    pool = shard_keys(rng, fill, shards, SHARD)
    tiers = rng.integers(1, 3, size=fill, dtype=np.uint8)
    seq = 0
    fill_b = []
    for i in range(0, fill, 4096):
        seq += 1
        fill_b.append(KeyOpBatch(worker, 1, SHARD, seq, pool[i:i + 4096].copy(), tiers[i:i + 4096].copy()))
    steady_b = []
    done = 0
    while done < steady_ops:
        n = int(rng.integers(lo, hi + 1))
        k = n // 3
        idx = rng.choice(fill, size=2 * k, replace=False)
        r_idx, f_idx = idx[:k], idx[k:]
        fresh = shard_keys(rng, n - 2 * k, shards, SHARD)
        ft = rng.integers(1, 3, size=len(fresh), dtype=np.uint8)
        rk = pool[r_idx]
        fk = pool[f_idx]
        flipped = (3 - tiers[f_idx]).astype(np.uint8)
        tiers[f_idx] = flipped
        # k fresh keys take the removed keys' places in the pool; the 0-2 left over when n is
        # not a multiple of 3 stay in the table untracked (never removed or flipped)
        pool[r_idx] = fresh[:k]
        tiers[r_idx] = ft[:k]
        keys = np.concatenate([rk, fresh, fk])
        tv = np.concatenate([np.zeros(k, np.uint8), ft, flipped])
        seq += 1
        steady_b.append(KeyOpBatch(worker, 1, SHARD, seq, keys, tv))
        done += n
    return fill_b, steady_b


def _no_reset(shard: int) -> tuple[Any, ...]:
    raise RuntimeError(f"the unit of shard {shard} refused a batch as out of sequence: benchmark invariant broken")


async def bench_ingest(unit: Child, layout: Any, args: argparse.Namespace, rng: np.random.Generator, res: dict[str, Any]) -> None:
    from kvcompass.services.ingest_client import IngestClient

    addr = unit.info["grpc"]
    lo, hi = args.batch_ops
    log(f"ingest: generating {len(INGEST_WORKERS)} agents x ({args.fill:,} fill + ~{args.steady_ops:,} steady ops)")
    loads = [ingest_workload(rng, w, args.fill, args.steady_ops, lo, hi, layout.shards) for w in INGEST_WORKERS]
    clients = [IngestClient(w, {SHARD: addr}, _no_reset) for w in INGEST_WORKERS]
    try:
        fill_ops = sum(len(b.keys) for f, _ in loads for b in f)
        t = time.perf_counter()
        reps = await asyncio.gather(*(c.send(f) for c, (f, _) in zip(clients, loads)))
        dt_fill = time.perf_counter() - t
        if sum(r.batches for r in reps) != sum(len(f) for f, _ in loads):
            raise RuntimeError("fill: not every batch was acknowledged")
        log(f"  fill: {fill_ops:,} ops in {dt_fill:.2f}s ({fill_ops / dt_fill:,.0f} ops/s)")
        await asyncio.sleep(0.1)  # let the last flush go out

        steady = [s for _, s in loads]
        ops = sum(len(b.keys) for s in steady for b in s)
        c0, p0 = unit.cpu_s(), time.process_time()
        t = time.perf_counter()
        reps = await asyncio.gather(*(c.send(s) for c, s in zip(clients, steady)))
        dt = time.perf_counter() - t
        c1, p1 = unit.cpu_s(), time.process_time()
        n_b = sum(len(s) for s in steady)
        if sum(r.batches for r in reps) != n_b or any(r.resets or r.duplicates for r in reps):
            raise RuntimeError(f"steady: {sum(r.batches for r in reps)} of {n_b} batches acknowledged cleanly")
        log(f"  steady: {ops:,} ops in {n_b} batches in {dt:.2f}s ({ops / dt:,.0f} ops/s)")
    finally:
        for c in clients:
            await c.close()
    await asyncio.sleep(0.1)
    m = scrape(unit.info["metrics"])
    served = m.get('kvcompass_key_ops_total{role="maintenance"}')
    if served is not None and int(served) != fill_ops + ops:
        raise RuntimeError(f"the unit counted {served} key ops, {fill_ops + ops} were sent")
    res["ingest_ops_per_s"] = rnd(ops / dt, 0)
    res["ingest_fill_ops_per_s"] = rnd(fill_ops / dt_fill, 0)
    res["ingest_ops"] = ops
    res["ingest_batches"] = n_b
    res["ingest_mean_batch_ops"] = rnd(ops / n_b, 1)
    res["ingest_unit_cpu_util"] = rnd((c1 - c0) / dt, 3) if c0 is not None and c1 is not None else None
    res["ingest_client_cpu_util"] = rnd((p1 - p0) / dt, 3)
    res["ingest_unit_patches_out"] = int(m.get('kvcompass_patches_out_total{role="maintenance"}', 0))
    res["ingest_unit_patch_bytes_out"] = int(m.get('kvcompass_patch_bytes_out_total{role="maintenance"}', 0))


def patch_samples(rng: np.random.Generator, plan: Any, layout: Any, n: int, prompts: int) -> tuple[Any, list[Any]]:
    """A fresh agent and its shard-0 key-op batches, one per engine event batch."""
    from kvcompass.agent import BlockStored, WorkerAgent, encode_batch
    from kvcompass.index_types import Namespace

    agent = WorkerAgent(PATCH_WORKER, Namespace(MODEL, TENANT), plan.registration("us"), layout.shards, block_size=BLOCK)
    out = []
    base = 0
    seq = 0
    while len(out) < n:
        evs = []
        for _ in range(prompts):
            toks = rng.integers(0, 100_000, size=2048, dtype=np.uint32)
            nb = len(toks) // BLOCK
            evs.append(BlockStored(tuple(range(base, base + nb)), None, tuple(toks.tolist()), BLOCK, None, "GPU"))
            base += nb
        r = agent.on_message(encode_batch(evs, seq=seq))
        seq += 1
        out += [b for b in r.batches if b.shard == SHARD]
    return agent, out[:n]


async def bench_patch(unit: Child, topo: Any, plan: Any, layout: Any, args: argparse.Namespace, rng: np.random.Generator, res: dict[str, Any]) -> None:
    from kvcompass.discovery.edge import Edge, PatchOutcome
    from kvcompass.services.edge_sync import EdgeSync
    from kvcompass.services.ingest_client import IngestClient

    class TimedEdge(Edge):
        applied: dict[tuple[int, int, int], float]

        def apply_patch(self, data: bytes) -> PatchOutcome:
            out = super().apply_patch(data)
            if out.applied and out.table is not None and out.shard is not None and out.seq is not None:
                self.applied[(out.table, out.shard, out.seq)] = time.perf_counter()
            return out

    log(f"patch latency: keying {args.patch_samples} agent batches ({args.patch_prompts} x 2048-token prompts each)")
    agent, batches = patch_samples(rng, plan, layout, args.patch_samples + args.patch_warmup, args.patch_prompts)
    by_id = {w.id: w for w in topo.workers}
    workers = [by_id[w] for w in layout.workers]
    targets = list(dict.fromkeys(["us", *(t.region for t in layout.tables)]))
    edge = TimedEdge("us", layout, workers, {r: plan.lengths("us", r) for r in targets}, {r: plan.rtt_ms("us", r) for r in targets}, seed=1)
    edge.applied = {}
    table = layout.field_of(PATCH_WORKER).table_id
    addr = unit.info["grpc"]
    lat: list[float] = []
    ack: list[float] = []
    async with EdgeSync(edge, {SHARD: addr}) as sync, IngestClient(PATCH_WORKER, {SHARD: addr}, agent.on_rejected) as client:
        await sync.wait_for(lambda: all(edge.view(t.table_id, SHARD).initialised for t in layout.tables), 30)
        await asyncio.sleep(0.6)  # a couple of heartbeats: the subscription is live and current
        view = edge.view(table, SHARD)  # bootstrap replaced the view object; a resync would too
        for i, b in enumerate(batches):
            view = edge.view(table, SHARD)
            before = view.seq
            t0 = time.perf_counter()
            rep = await client.send([b])
            t1 = time.perf_counter()
            if rep.applied == 0:
                raise RuntimeError("patch sample: the batch changed nothing")
            try:
                await sync.wait_for(lambda: edge.view(table, SHARD).seq > before, 10)
            except TimeoutError:
                raise RuntimeError(f"patch sample {i}: view at {view.epoch}/{view.seq}, before {before}, rep {rep}, "
                                   f"subs {sync.subscriptions} resubs {sync.resubscribes} reconnects {sync.reconnects} applied {sorted(edge.applied)[-3:]} "
                                   f"stats {edge.stats if hasattr(edge, 'stats') else None}") from None
            view = edge.view(table, SHARD)
            if view.seq != before + 1:
                raise RuntimeError(f"patch sample: the view moved {view.seq - before} batches, expected 1")
            t2 = edge.applied[(table, SHARD, before + 1)]
            if i >= args.patch_warmup:
                lat.append((t2 - t0) * 1e3)
                ack.append((t1 - t0) * 1e3)
            await asyncio.sleep(float(rng.uniform(0, 0.003)))
        if edge.view(table, SHARD).digest() != await _unit_digest(addr, table):
            raise RuntimeError("patch sample: the edge's view diverged from its writer")
    res["patch_p50_ms"] = rnd(pct(lat, 50))
    res["patch_p90_ms"] = rnd(pct(lat, 90))
    res["patch_p99_ms"] = rnd(pct(lat, 99))
    res["patch_max_ms"] = rnd(max(lat))
    res["patch_ack_p50_ms"] = rnd(pct(ack, 50))
    res["patch_ack_p99_ms"] = rnd(pct(ack, 99))
    res["patch_samples"] = len(lat)
    res["patch_batch_ops_mean"] = rnd(float(np.mean([len(b.keys) for b in batches])), 1)
    log(f"  p50 {res['patch_p50_ms']} ms, p99 {res['patch_p99_ms']} ms (ack p50 {res['patch_ack_p50_ms']} ms)")


async def _unit_digest(addr: str, table: int) -> bytes:
    """The writer's view digest of (table, SHARD), from a Snapshot it serves."""
    from kvcompass import _core
    from kvcompass._proto.kvcompass.v1 import MaintenanceStub, SnapshotRequest
    from kvcompass.services.tls import grpc_channel

    ch = grpc_channel(addr)
    try:
        resp = await MaintenanceStub(ch).snapshot(SnapshotRequest(shard=SHARD, tables=[table]), timeout=30)
    finally:
        ch.close()
    v = _core.LudoView(table, SHARD)
    v.apply_batch(resp.snapshots[0].data)
    return v.digest()


JSON = {"Content-Type": "application/json"}


Post = Callable[[str, bytes], Awaitable[tuple[int, bytes]]]
"""One POST of a body to a URL on some client: (status, body). The loads below take one, so the
same loop drives an aiohttp session here and the package's own client in bench_door."""


def aiohttp_post(s: Any) -> Post:
    """:data:`Post` on aiohttp session ``s``."""

    async def post(url: str, body: bytes) -> tuple[int, bytes]:
        async with s.post(url, data=body, headers=JSON) as r:
            return r.status, await r.read()

    return post


async def post_once(post: Post, url: str, body: bytes) -> float:
    """One POST of ``body``; its latency in ms (an error unless 200)."""
    t = time.perf_counter()
    status, data = await post(url, body)
    if status != 200:
        raise RuntimeError(f"{url} answered {status}: {data[:200]!r}")
    return (time.perf_counter() - t) * 1e3


async def closed_loop(post: Post, url: str, bodies: list[bytes], concurrency: int, seconds: float) -> tuple[int, float]:
    """Closed loop: ``concurrency`` lanes posting ``bodies`` in turn, back to back, for
    ``seconds``; (requests completed, wall seconds)."""
    stop_at = time.perf_counter() + seconds
    count = 0

    async def lane(j: int) -> None:
        nonlocal count
        k = j
        while time.perf_counter() < stop_at:
            status, data = await post(url, bodies[k % len(bodies)])
            if status != 200:
                raise RuntimeError(f"{url} answered {status} under load: {data[:200]!r}")
            count += 1
            k += 1

    t = time.perf_counter()
    await asyncio.gather(*(lane(j) for j in range(concurrency)))
    return count, time.perf_counter() - t


async def open_loop(posts: list[Post], url: str, bodies: list[bytes], rate: float, seconds: float) -> tuple[int, float, float]:
    """Open loop: requests started at ``rate`` a second for ``seconds`` whatever the answers
    (each millisecond, every request due by then), ``bodies`` in turn, request ``i`` through
    ``posts[i % len(posts)]`` (clients of their own, so that the requests keep as many
    connections busy as there are clients: one pool would reuse its one or two idle
    connections, and every request would reach one server of a shared port); the first failure
    (a status other than 200, a lost connection) is raised once the requests in flight end; (requests completed,
    wall seconds from the first start to the last answer, the largest lag of a start behind
    its schedule in ms, which says whether this process kept the rate)."""
    loop = asyncio.get_running_loop()
    n = int(rate * seconds)
    tasks: set[asyncio.Task[None]] = set()
    failures: list[BaseException] = []
    done = 0
    lag = 0.0

    async def one(post: Post, body: bytes) -> None:
        nonlocal done
        status, data = await post(url, body)
        if status != 200:
            raise RuntimeError(f"{url} answered {status} under load: {data[:200]!r}")
        done += 1

    def finished(t: asyncio.Task[None]) -> None:
        tasks.discard(t)
        if not t.cancelled() and t.exception() is not None:
            failures.append(t.exception())  # type: ignore[arg-type]

    t0 = loop.time()
    i = 0
    while i < n and not failures:
        due = min(n, int((loop.time() - t0) * rate) + 1)
        if due > i + 1:
            lag = max(lag, (loop.time() - t0 - (i + 1) / rate) * 1e3)
        while i < due:
            t = loop.create_task(one(posts[i % len(posts)], bodies[i % len(bodies)]))
            tasks.add(t)
            t.add_done_callback(finished)
            i += 1
        await asyncio.sleep(0.001)
    if tasks:
        await asyncio.wait(list(tasks))
    if failures:
        raise failures[0]
    return done, loop.time() - t0, lag


async def _canned_worker(replies: dict[bytes, tuple[bytes, dict[str, str]]]) -> tuple[Any, str]:
    """An aiohttp app answering each known body with the emulated worker's recorded reply
    (body and x-kvcompass headers): an upstream that costs next to nothing, so the door is the
    bottleneck of the throughput figure."""
    from aiohttp import web

    # A body it did not record (the door's edge replicating a hot prefix onto an idle worker,
    # which its migration policy does under this load) gets the first recorded answer: a worker
    # would answer it, and a 500 from here would make the door count the worker as failing.
    fallback = next(iter(replies.values()))

    async def handle(request: web.Request) -> web.Response:
        body, headers = replies.get(await request.read(), fallback)
        return web.Response(body=body, headers=headers)

    app = web.Application()
    app.router.add_post("/v1/completions", handle)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    return runner, f"http://127.0.0.1:{port}"


async def bench_door(door_cpu: int | None, args: argparse.Namespace, prompts: list[list[int]], res: dict[str, Any]) -> None:
    import aiohttp

    from kvcompass.services.emulated_worker import EmulatedWorker, WorkerConfig

    bodies = [json.dumps({"model": MODEL, "prompt": p, "max_tokens": args.door_max_tokens}).encode() for p in prompts]
    hdr = {"Content-Type": "application/json"}
    spec = {"topology": TOPOLOGY, "region": DOOR_REGION, "holder": DOOR_HOLDER, "prompts": prompts, "cpu": door_cpu}
    conn = aiohttp.TCPConnector(limit=0, keepalive_timeout=60)
    async with aiohttp.ClientSession(connector=conn) as s:

        post = aiohttp_post(s)

        async def once(url: str, body: bytes) -> float:
            return await post_once(post, url, body)

        async def load(url: str, seconds: float) -> tuple[int, float]:
            return await closed_loop(post, url, bodies, args.door_concurrency, seconds)

        async def door_load(door: Child, url: str, seconds: float) -> tuple[int, float, float | None]:
            await load(url, 0.5)  # open the connections, warm up
            c0 = door.cpu_s()
            n, dt = await load(url, seconds)
            c1 = door.cpu_s()
            return n, dt, (c1 - c0) if c0 is not None and c1 is not None and c1 > c0 else None

        replies: dict[bytes, tuple[bytes, dict[str, str]]] = {}
        async with EmulatedWorker(WorkerConfig(worker_id=DOOR_HOLDER, time_scale=0.0)) as worker:
            direct_u = worker.http_url + "/v1/completions"
            for b in bodies:  # what the canned upstream will replay
                async with s.post(direct_u, data=b, headers=hdr) as r:
                    keep = {k: v for k, v in r.headers.items() if k.lower().startswith("x-kvcompass") or k.lower() == "content-type"}
                    replies[b] = (await r.read(), keep)
            door = Child("door", {**spec, "worker_url": worker.http_url, "profile": _prof(args, "door")})
            try:
                door_u = door.wait_ready()["url"] + "/v1/completions"
                log(f"door -> emulated worker: overhead over {args.door_pairs} sequential pairs (+{args.door_warmup} warm-up)")
                d_lat, p_lat = [], []
                for i in range(args.door_warmup + args.door_pairs):
                    body = bodies[i % len(bodies)]
                    if i % 2:
                        a = await once(direct_u, body)
                        b = await once(door_u, body)
                    else:
                        b = await once(door_u, body)
                        a = await once(direct_u, body)
                    if i >= args.door_warmup:
                        d_lat.append(a)
                        p_lat.append(b)
                d, p = np.asarray(d_lat), np.asarray(p_lat)
                res["proxy_overhead_p50_ms"] = rnd(pct(p, 50) - pct(d, 50))
                res["proxy_overhead_p99_ms"] = rnd(pct(p, 99) - pct(d, 99))
                res["proxy_door_p50_ms"] = rnd(pct(p, 50))
                res["proxy_door_p99_ms"] = rnd(pct(p, 99))
                res["proxy_direct_p50_ms"] = rnd(pct(d, 50))
                res["proxy_direct_p99_ms"] = rnd(pct(d, 99))
                res["proxy_pair_delta_p50_ms"] = rnd(pct(p - d, 50))
                res["proxy_pair_delta_p99_ms"] = rnd(pct(p - d, 99))
                res["proxy_pairs"] = len(d)
                log(f"  door p50/p99 {res['proxy_door_p50_ms']}/{res['proxy_door_p99_ms']} ms, direct "
                    f"{res['proxy_direct_p50_ms']}/{res['proxy_direct_p99_ms']} ms")
                n, dt, cpu = await door_load(door, door_u, args.door_rps_seconds / 2)
                res["edge_req_per_s_emulated"] = rnd(n / dt, 1)
                res["edge_req_per_door_cpu_s_emulated"] = rnd(n / cpu, 1) if cpu else None
                n2, dt2 = await load(direct_u, args.door_rps_seconds / 2)
                res["direct_req_per_s_emulated"] = rnd(n2 / dt2, 1)
                log(f"  {args.door_concurrency} concurrent: {n / dt:,.0f} req/s through the door, {n2 / dt2:,.0f} req/s directly")
            finally:
                door.stop()

        runner, canned_url = await _canned_worker(replies)
        door = Child("door", {**spec, "worker_url": canned_url, "profile": _prof(args, "door_canned")})
        try:
            door_u = door.wait_ready()["url"] + "/v1/completions"
            log(f"door -> canned upstream: {args.door_concurrency} concurrent for {args.door_rps_seconds}s")
            n, dt, cpu = await door_load(door, door_u, args.door_rps_seconds)
            res["edge_req_per_s"] = rnd(n / dt, 1)
            res["edge_requests"] = n
            res["edge_door_cpu_util"] = rnd(cpu / dt) if cpu else None
            res["edge_req_per_door_cpu_s"] = rnd(n / cpu, 1) if cpu else None
            n2, dt2 = await load(canned_url + "/v1/completions", max(1.0, args.door_rps_seconds / 4))
            res["direct_req_per_s_canned"] = rnd(n2 / dt2, 1)
            log(f"  {n} requests in {dt:.2f}s: {n / dt:,.0f} req/s, door CPU {res['edge_door_cpu_util']} "
                f"({res['edge_req_per_door_cpu_s']} req per door CPU-second); canned directly {n2 / dt2:,.0f} req/s")
            await bench_dashboard(s, door, door_u, args, res, door_load)
        finally:
            door.stop()
            await runner.cleanup()


async def bench_dashboard(s: Any, door: Child, door_u: str, args: argparse.Namespace, res: dict[str, Any], door_load: Any) -> None:
    """What an open dashboard costs the routing path: the door's CPU per request under the same
    closed loop with and without a client polling ``/dashboard/data`` at ``dashboard_hz`` (the
    page polls once a second; 10 is ten open pages), interleaved A B A B so the host's drift
    falls on both."""
    data_u = door.info["dashboard"] + "/data"
    fetched = 0

    async def poll(stop: asyncio.Event) -> None:
        nonlocal fetched
        while not stop.is_set():
            async with s.get(data_u) as r:
                await r.read()
                if r.status != 200:
                    raise RuntimeError(f"dashboard data answered {r.status}")
            fetched += 1
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 1.0 / args.dashboard_hz)

    per: dict[bool, list[tuple[int, float]]] = {False: [], True: []}
    for open_page in (False, True, False, True):
        stop = asyncio.Event()
        poller = asyncio.create_task(poll(stop)) if open_page else None
        n, _, cpu = await door_load(door, door_u, args.door_rps_seconds / 2)
        stop.set()
        if poller is not None:
            await poller
        if cpu:
            per[open_page].append((n, cpu))
    closed = sum(n for n, _ in per[False]) / sum(c for _, c in per[False]) if per[False] else None
    opened = sum(n for n, _ in per[True]) / sum(c for _, c in per[True]) if per[True] else None
    res["dashboard_poll_hz"] = args.dashboard_hz
    res["dashboard_fetches"] = fetched
    res["edge_req_per_door_cpu_s_page_closed"] = rnd(closed, 1) if closed else None
    res["edge_req_per_door_cpu_s_page_open"] = rnd(opened, 1) if opened else None
    if closed and opened:
        res["dashboard_cpu_cost_pct"] = rnd(100.0 * (closed / opened - 1.0), 2)
    log(f"  dashboard polled at {args.dashboard_hz} Hz ({fetched} fetches): {res['edge_req_per_door_cpu_s_page_open']} req per door CPU-second "
        f"with it, {res['edge_req_per_door_cpu_s_page_closed']} without ({res.get('dashboard_cpu_cost_pct')} % more CPU a request)")


def _prof(args: argparse.Namespace, name: str) -> str | None:
    return str(Path(args.profile).resolve() / f"{name}.prof") if args.profile else None


# ---------------------------------------------------------------------------------------------
# main


async def run_all(args: argparse.Namespace, res: dict[str, Any]) -> None:
    from kvcompass.discovery.plan import LevelPlan
    from kvcompass.discovery.topology import load_topology

    rng = np.random.default_rng(args.seed)
    topo = load_topology(TOPOLOGY)
    plan = LevelPlan(topo)
    layout = plan.layout()
    child_cpu, own_cpu = cpus() if args.pin else (None, None)
    pin(own_cpu)
    res["cpu_pinning"] = {"child": child_cpu, "parent": own_cpu}

    # Unit capacity: the filled size of the biggest table (two ingest agents share "us").
    per_table: dict[int, int] = {}
    for w in INGEST_WORKERS:
        t = layout.field_of(w).table_id
        per_table[t] = per_table.get(t, 0) + args.fill
    capacity = max(per_table.values()) + args.batch_ops[1] + 4096
    res["unit_capacity"] = capacity
    if args.phases & {"ingest", "patch"}:
        unit = Child("unit", {"topology": TOPOLOGY, "shard": SHARD, "capacity": capacity, "cpu": child_cpu, "profile": _prof(args, "unit")})
        try:
            info = unit.wait_ready()
            log(f"unit of shard {SHARD}: {info}")
            if "ingest" in args.phases:
                await bench_ingest(unit, layout, args, rng, res)
            if "patch" in args.phases:
                await bench_patch(unit, topo, plan, layout, args, rng, res)
        finally:
            unit.stop()

    if "door" in args.phases:
        prompts = [rng.integers(1000, 100_000, size=args.door_prompt_tokens, dtype=np.uint32).tolist() for _ in range(args.door_prompts)]
        await bench_door(child_cpu, args, prompts, res)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer ops, samples and seconds (< 60 s on 2 cores)")
    ap.add_argument("--seed", type=int, default=20240601)
    ap.add_argument("--out", type=Path, default=None, help="also write the JSON object to this file")
    ap.add_argument("--profile", type=Path, default=None, help="cProfile every process into DIR/{bench,unit,door}.prof")
    ap.add_argument("--pin", action="store_true", help="pin the child process to CPU 0 and this one to CPU 1 (off by default: on a shared host a pinned process waits behind whatever else runs on its CPU)")
    ap.add_argument("--phases", default="ingest,patch,door", help="comma-separated subset of ingest,patch,door (default: all)")
    ap.add_argument("--child", nargs=2, metavar=("KIND", "SPEC"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)

    if args.child:
        kind, spec = args.child
        {"unit": child_unit, "door": child_door}[kind](json.loads(spec))
        return 0

    args.phases = set(args.phases.split(","))
    if not args.phases <= {"ingest", "patch", "door"}:
        ap.error(f"--phases: unknown {sorted(args.phases - {'ingest', 'patch', 'door'})}")
    quick = args.quick
    mode = "quick" if quick else "full"
    args.fill = 50_000 if quick else 250_000                 # held keys per ingest agent
    args.steady_ops = 400_000 if quick else 2_500_000        # steady key ops per ingest agent
    args.batch_ops = (512, 4096)
    args.patch_samples = 300 if quick else 1500
    args.patch_warmup = 20
    args.patch_prompts = 4
    args.door_prompts = 16
    args.door_prompt_tokens = 256
    args.door_max_tokens = 8
    args.door_pairs = 800 if quick else 3000
    args.door_warmup = 100
    args.door_concurrency = 16
    args.door_rps_seconds = 4.0 if quick else 15.0
    args.dashboard_hz = 10.0
    if args.profile:
        args.profile.mkdir(parents=True, exist_ok=True)

    res: dict[str, Any] = {"mode": mode, "seed": args.seed, "topology": TOPOLOGY, "shard": SHARD, "phases": sorted(args.phases)}
    res["config"] = {
        "ingest_agents": list(INGEST_WORKERS),
        "ingest_fill_keys_per_agent": args.fill,
        "ingest_steady_ops_per_agent": args.steady_ops,
        "ingest_batch_ops": list(args.batch_ops),
        "ingest_mix": "steady batches: 1/3 insert fresh key, 1/3 remove held key, 1/3 VRAM<->DRAM flip",
        "ingest_window": 64,
        "maintenance_config": "MaintenanceConfig() defaults (flush 2 ms, heartbeat 250 ms, offload >= 8192 ops)",
        "patch_worker": PATCH_WORKER,
        "patch_prompts_per_batch": args.patch_prompts,
        "patch_prompt_tokens": 2048,
        "patch_block_size": BLOCK,
        "door_region": DOOR_REGION,
        "door_prompts": args.door_prompts,
        "door_prompt_tokens": args.door_prompt_tokens,
        "door_max_tokens": args.door_max_tokens,
        "door_pairs": args.door_pairs,
        "door_concurrency": args.door_concurrency,
        "door_rps_seconds": args.door_rps_seconds,
        "worker": "EmulatedWorker(time_scale=0), every edge worker id mapped to it (overhead); canned replay of its replies (edge_req_per_s)",
        # The services (these children) run on lifecycle's choice; this driver on the standard loop.
        "event_loop": f"services: {'uvloop' if loop_factory() is not None else 'asyncio'}; load driver: asyncio",
    }
    res["method"] = {
        "ingest_ops_per_s": "steady key ops / wall time from first send to last ack, 4 concurrent IngestClients into one unit process",
        "patch_ms": "IngestClient.send of one agent batch -> the resulting patch applied at the edge's view (EdgeSync), one in flight",
        "proxy_overhead_ms": "percentile(door latency) - percentile(direct latency), sequential alternating requests",
        "edge_req_per_s": "completed requests / wall time through one door process, 16 concurrent client lanes, canned upstream replaying the emulated worker's replies",
    }
    log(f"mode={mode} seed={args.seed}")
    if args.profile:
        prof = cProfile.Profile()
        prof.enable()
        try:
            asyncio.run(run_all(args, res))
        finally:
            prof.disable()
            prof.dump_stats(str(args.profile / "bench.prof"))
    else:
        asyncio.run(run_all(args, res))

    commit, dirty = git_info()
    res.update({
        "date": _dt.datetime.now(_dt.timezone.utc).replace(microsecond=0).isoformat(),
        "git_commit": commit,
        "git_dirty": dirty,
        "core_build": core_build(),
        "python": platform.python_version(),
        "cpu": cpu_model(),
        "cpu_count": os.cpu_count(),
        "elapsed_s": rnd(time.perf_counter() - _T0, 1),
    })
    res["targets"] = TARGETS
    res["meets"] = meets(res, TARGETS)
    line = json.dumps(res, sort_keys=False)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(line + "\n")
    log(f"done in {time.perf_counter() - _T0:.1f}s; misses: {[k for k, ok in res['meets'].items() if ok is False]}")
    print(line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
