"""``kvcompass chaos --processes``: the fault harness against a real local cluster.

A :class:`~kvcompass.services.cluster.Cluster` (what ``kvcompass up`` runs: every maintenance
unit, emulated worker, agent and edge its own process on loopback) is started with a few
workers, a client sends requests through the edges' HTTP doors the whole time, and one process
of each kind is killed with ``SIGKILL`` and started again on the same ports (so its peers find
it where it was): a maintenance unit (it recovers its shard from its state file under a new
epoch), an edge (it bootstraps from the units), an agent (a new incarnation; it re-reports from
the engine's replay ring), and an emulated worker (a new engine process: empty cache, seq back
at 0).

After each restart the harness polls every edge's ``/healthz`` and the view states every edge
and unit export on ``/metrics`` (``kvcompass_state_digest``, ``_epoch``, ``_seq``: each view's or table's epoch, seq
and the first 48 bits of its digest, computed at scrape time) until every edge is healthy and
every view equals its writer's table: that time is the restart's convergence time, counted both
from the restart (the new process spawned) and from the restarted process being ready (its
ready line). At the end the load pauses and every view is checked once more.

The client retries a request at another region's door when its own door cannot be reached (the
edge that was killed); every other failure counts: a door that answered anything but 200, or no
door answering at all.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import signal
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np

__all__ = ["ProcessChaosConfig", "run_processes"]

KINDS = ("maintenance", "edge", "agent", "worker")
_STATE_METRICS = ("kvcompass_state_digest", "kvcompass_state_epoch", "kvcompass_state_seq")


@dataclass(frozen=True, slots=True)
class ProcessChaosConfig:
    seed: int = 0
    ops: int = 2000
    """Key ops the agents should have sent (as their metrics count them) before the run ends."""
    topology: str = "testbed-14x3"
    max_workers: int = 3
    rounds: int = 1
    """Kill/restart rounds; each round kills one process of every kind."""
    rate: float = 40.0
    """Requests per second the client offers."""
    settle_timeout_s: float = 20.0
    startup_timeout_s: float = 120.0
    poll_s: float = 0.02
    run_dir: str | None = None
    max_wall_s: float = 300.0


@dataclass(slots=True)
class _Load:
    requests: int = 0
    failed: int = 0
    failovers: int = 0
    served_elsewhere: int = 0
    """Requests served only by another region's door, their own being down or draining."""
    errors: dict[str, int] | None = None


def parse_states(text: str) -> dict[tuple[int, int], tuple[int, int, int]]:
    """``(table, shard) -> (epoch, seq, digest48)`` from a ``/metrics`` page (the three
    ``kvcompass_state_*`` gauges of one scrape)."""
    parts: dict[str, dict[tuple[int, int], int]] = {name: {} for name in _STATE_METRICS}
    for line in text.splitlines():
        name = line.partition("{")[0]
        if name not in parts or "{" not in line:
            continue
        labels, _, value = line.rpartition(" ")
        lab = dict(kv.split("=", 1) for kv in labels[len(name) + 1 : -1].split(","))
        vals = {k: v.strip('"') for k, v in lab.items()}
        parts[name][(int(vals["table"]), int(vals["shard"]))] = int(float(value))
    digest, epoch, seq = (parts[name] for name in _STATE_METRICS)
    return {k: (epoch[k], seq[k], d) for k, d in digest.items() if k in epoch and k in seq}


class ProcessChaos:
    def __init__(self, cfg: ProcessChaosConfig, progress: Callable[[str], None] | None = None) -> None:
        self.cfg = cfg
        self.progress = progress or (lambda _s: None)
        self.rng = np.random.default_rng([cfg.seed, 3])
        self.load = _Load(errors={})
        self.ops_banked = 0.0
        self._ops_seen: dict[str, float] = {}
        self.views_checked = 0
        self.divergent_views = 0
        self.restarts: list[dict[str, Any]] = []

    # ---- cluster access ------------------------------------------------------------------------

    async def _get(self, http: aiohttp.ClientSession, url: str) -> tuple[int, str]:
        try:
            async with http.get(url) as r:
                return r.status, await r.text()
        except (aiohttp.ClientError, TimeoutError, OSError):
            return 0, ""

    def _live(self, role: str) -> list[Any]:
        return [c for c in self.cluster.children if c.role == role and c.proc is not None and c.proc.returncode is None and not c.stopping]

    async def _ops(self, http: aiohttp.ClientSession) -> float:
        total = 0.0
        for a in self._live("agent"):
            status, text = await self._get(http, f"{a.ready['metrics']}/metrics")
            if status == 200:
                v = sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith("kvcompass_agent_sent_key_ops_total"))
                self._ops_seen[a.name + str(a.proc.pid)] = v
        for v in self._ops_seen.values():
            total += v
        return total

    async def views(self, http: aiohttp.ClientSession) -> tuple[bool, int, int]:
        """(every edge healthy, views compared, views whose state differs from the writer's at
        the same position or whose position differs)."""
        units: dict[tuple[int, int], tuple[int, int, int]] = {}
        for u in self._live("maintenance"):
            status, text = await self._get(http, f"{u.ready['metrics']}/metrics")
            if status != 200:
                return False, 0, 0
            units.update(parse_states(text))
        healthy = True
        checked = bad = 0
        edges = self._live("edge")
        if len(edges) < len(self.cluster.plan.edge_regions) or len(self._live("maintenance")) < self.cluster.topology.shards:
            return False, 0, 0
        for e in edges:
            status, _ = await self._get(http, f"{e.ready['metrics']}/healthz")
            healthy &= status == 200
            status, text = await self._get(http, f"{e.ready['metrics']}/metrics")
            views = parse_states(text) if status == 200 else {}
            for key, want in units.items():
                checked += 1
                bad += views.get(key) != want
        return healthy, checked, bad

    # ---- the client ----------------------------------------------------------------------------

    async def _client(self, stop: asyncio.Event, paused: asyncio.Event) -> None:
        doors = {r: str(e.ready["http"]) for e in self.cluster.children if e.role == "edge" for r in [str(e.ready["region"])]}
        regions = sorted(doors)
        docs = [self.rng.integers(0, 30_000, size=int(self.rng.integers(300, 3000))).tolist() for _ in range(64)]
        timeout = aiohttp.ClientTimeout(total=10)
        inflight: set[asyncio.Task[None]] = set()
        auth = {"Authorization": f"Bearer {self._api_key}"} if self._api_key else None
        async with aiohttp.ClientSession(timeout=timeout, headers=auth) as http:

            async def one(prompt: list[int], origin: str) -> None:
                body = {"model": "llama-3.1-8b", "prompt": prompt, "max_tokens": 2, "stream": False}
                self.load.requests += 1
                order = [origin] + sorted((r for r in regions if r != origin), key=lambda r: self.cluster.plan.rtt_ms(origin, r))
                for i, r in enumerate(order):
                    try:
                        async with http.post(doors[r] + "/v1/completions", json=body) as resp:
                            await resp.read()
                            if resp.status == 200:
                                if i:
                                    self.load.served_elsewhere += 1  # its own region's door was down
                                return
                            why = f"http {resp.status}"
                            if resp.status == 503 and i + 1 < len(order):
                                self.load.failovers += 1  # a draining door: try the next one
                                continue
                    except (aiohttp.ClientConnectionError, OSError) as e:
                        why = type(e).__name__
                        if i + 1 < len(order):
                            self.load.failovers += 1
                            continue
                    except TimeoutError:
                        why = "timeout"
                    assert self.load.errors is not None
                    self.load.errors[why] = self.load.errors.get(why, 0) + 1
                    self.load.failed += 1
                    return

            while not stop.is_set():
                if paused.is_set():
                    await asyncio.sleep(0.01)
                    continue
                doc = docs[min(int(self.rng.zipf(1.2)) - 1, len(docs) - 1)]
                prompt = doc + self.rng.integers(0, 30_000, size=int(self.rng.integers(1, 200))).tolist()
                t = asyncio.get_running_loop().create_task(one(prompt, regions[int(self.rng.integers(len(regions)))]))
                inflight.add(t)
                t.add_done_callback(inflight.discard)
                await asyncio.sleep(float(self.rng.exponential(1.0 / self.cfg.rate)))
            if inflight:
                await asyncio.gather(*inflight, return_exceptions=True)

    # ---- faults --------------------------------------------------------------------------------

    async def _restart(self, http: aiohttp.ClientSession, kind: str) -> dict[str, Any]:
        victims = self._live(kind)
        c = victims[int(self.rng.integers(len(victims)))]
        assert c.proc is not None
        c.stopping = True  # the supervisor's "exited" notice is expected here
        t_kill = time.monotonic()
        with contextlib.suppress(ProcessLookupError):
            c.proc.send_signal(signal.SIGKILL)
        await c.proc.wait()
        t_spawn = time.monotonic()
        from kvcompass.services.cluster import fixed_ports

        new = await self.cluster.spawn(c.name, c.role, [*c.base, *fixed_ports(c.role, c.ready)], base=c.base)
        await self.cluster.wait_ready([new], self.cfg.startup_timeout_s)
        t_ready = time.monotonic()
        deadline = t_spawn + self.cfg.settle_timeout_s
        conv = math.inf
        while time.monotonic() < deadline:
            healthy, checked, bad = await self.views(http)
            if healthy and checked and not bad:
                conv = time.monotonic()
                break
            await asyncio.sleep(self.cfg.poll_s)
        rec = {
            "kind": kind,
            "process": c.name,
            "down_ms": round((t_spawn - t_kill) * 1e3, 1),
            "ready_ms": round((t_ready - t_spawn) * 1e3, 1),
            "converge_ms_from_restart": round((conv - t_spawn) * 1e3, 1) if math.isfinite(conv) else None,
            "converge_ms_from_ready": round((conv - t_ready) * 1e3, 1) if math.isfinite(conv) else None,
        }
        self.progress(f"chaos: {json.dumps(rec)}")
        return rec

    async def _final_check(self, http: aiohttp.ClientSession, paused: asyncio.Event) -> tuple[bool, int, int]:
        """Load paused: the views must settle on their writers' tables (strict once quiet)."""
        paused.set()
        await asyncio.sleep(0.5)
        deadline = time.monotonic() + self.cfg.settle_timeout_s
        healthy, checked, bad = False, 0, 0
        while time.monotonic() < deadline:
            healthy, checked, bad = await self.views(http)
            if healthy and checked and not bad:
                break
            await asyncio.sleep(0.1)
        paused.clear()
        return healthy, checked, bad

    async def run(self) -> dict[str, Any]:
        from kvcompass.services.cluster import Cluster, ClusterConfig
        from kvcompass.services.loadgen import default_api_key

        cfg = self.cfg
        t0 = time.monotonic()
        own = cfg.run_dir is None
        run_dir = Path(tempfile.mkdtemp(prefix="kvcompass-chaos-")) if cfg.run_dir is None else Path(cfg.run_dir)
        ccfg = ClusterConfig(topology=cfg.topology, time_scale=0.0, wan_delay=False, max_workers=cfg.max_workers, run_dir=str(run_dir),
                             startup_timeout_s=cfg.startup_timeout_s, drain_grace_s=2.0)
        self.cluster = Cluster(ccfg, run_dir)
        stop, paused = asyncio.Event(), asyncio.Event()
        client: asyncio.Task[None] | None = None
        converged = True
        try:
            state = await self.cluster.start()
            self._api_key = default_api_key(state)
            self.progress(f"chaos: cluster up in {time.monotonic() - t0:.1f} s ({len(self.cluster.children)} processes)")
            client = asyncio.get_running_loop().create_task(self._client(stop, paused))
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as http:
                await asyncio.sleep(1.0)
                kinds = [k for _ in range(cfg.rounds) for k in KINDS]
                for kind in kinds:
                    rec = await self._restart(http, kind)
                    converged &= rec["converge_ms_from_restart"] is not None
                    self.restarts.append(rec)
                    await asyncio.sleep(0.5)
                while await self._ops(http) < cfg.ops and time.monotonic() - t0 < cfg.max_wall_s:
                    await asyncio.sleep(0.2)
                healthy, checked, bad = await self._final_check(http, paused)
                ops = await self._ops(http)
                self.views_checked += checked
                self.divergent_views += bad
                converged &= healthy and checked > 0 and bad == 0
                stop.set()
                await client
                client = None
        finally:
            stop.set()
            if client is not None:
                client.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await client
            await self.cluster.stop()
            if own:
                import shutil

                shutil.rmtree(run_dir, ignore_errors=True)
        from_restart = [r["converge_ms_from_restart"] for r in self.restarts]
        from_ready = [r["converge_ms_from_ready"] for r in self.restarts]
        return {
            "mode": "processes",
            "seed": cfg.seed,
            "ops": int(ops),
            "faults_injected": len(self.restarts),
            "views_checked": self.views_checked,
            "divergent_views": self.divergent_views,
            "converged": converged,
            "max_converge_ms": max(x for x in from_ready if x is not None) if converged and from_ready else None,
            "requests": self.load.requests,
            "failed_requests": self.load.failed,
            "faults": {k: sum(r["kind"] == k for r in self.restarts) for k in KINDS},
            "max_converge_ms_from_restart": max(x for x in from_restart if x is not None) if converged and from_restart else None,
            "restarts": self.restarts,
            "door_failovers": self.load.failovers,
            "served_by_another_region": self.load.served_elsewhere,
            "request_errors": self.load.errors,
            "topology": cfg.topology,
            "workers": cfg.max_workers,
            "wall_s": round(time.monotonic() - t0, 1),
        }


def run_processes(cfg: ProcessChaosConfig, progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Run the process chaos; SIGTERM stops it as Ctrl-C does, through the cleanup that stops
    the cluster and removes its run directory (found in review: a SIGTERM left the directory,
    API keys and peer key included, in the temporary folder), then exits 143."""
    import signal

    from kvcompass.services.lifecycle import on_signals

    terminated = False

    async def main() -> dict[str, Any]:
        task = asyncio.current_task()
        assert task is not None

        def stop() -> None:
            nonlocal terminated
            terminated = True
            task.cancel()

        with on_signals(stop, (signal.SIGTERM,)):
            return await ProcessChaos(cfg, progress).run()

    try:
        return asyncio.run(main())
    except asyncio.CancelledError:
        if terminated:
            raise SystemExit(128 + signal.SIGTERM) from None
        raise
