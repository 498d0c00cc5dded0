"""The in-process fault harness: a whole discovery plane on a virtual clock, with seeded faults
on both of its streams and crashes of every kind of component.

What runs: one :class:`~kvcompass.discovery.maintenance.MaintenanceUnit` per shard and one
:class:`~kvcompass.discovery.edge.Edge` per edge region (built as
:class:`~kvcompass.discovery.plane.LocalPlane` builds them), and per worker a
:class:`~kvcompass.engine.cache.PrefixCache` (the engine: it publishes vLLM KV-event frames into a
replay ring) and a :class:`~kvcompass.agent.WorkerAgent`. A seeded request stream is routed by
the edges and admitted by the chosen worker's cache, so every key op is a real one.

The streams, each a :class:`_Link` that can drop, duplicate, reorder (a few ms late, so later
messages overtake it) and delay (tens to hundreds of ms late) what it carries:

* **agent batches** (agent -> unit): key-op batches, acknowledged one by one. A sender keeps
  every unacknowledged batch and re-sends them in order after ``resend_ms`` (what the ingest
  client does on a new stream); a unit's :class:`~kvcompass.errors.AgentSequenceError` is
  answered with :meth:`WorkerAgent.on_rejected` (its reset batches replace the queue).
* **patch batches** (unit -> edge): flushed batches, heartbeats of every table's position, and
  the answers to repairs. A refused batch or a heartbeat ahead of a view yields a
  :class:`~kvcompass.discovery.edge.ResyncAction`; its request goes back to the unit (also over
  a faulty link), which answers with :meth:`MaintenanceUnit.resume`; every ``resync_retry_ms``
  each edge re-asks whatever :meth:`Edge.pending_resyncs` still lists (what ``EdgeSync`` does
  by resubscribing).

Engine -> agent messages can be lost too (the agent asks the engine's replay ring).

**Region partitions** (emulated): every maintenance unit has a home region, round-robin over
the topology's regions in declaration order (shard ``s`` lives in ``region_names[s % n]``;
:attr:`ChaosHarness.unit_regions`); edges, agents and engines live in their own regions. While
one region is cut off from the rest, every message whose two ends lie on different sides of
the cut is dropped, whether it is sent during the cut or was in flight when the cut came:
agent batches and the units' acknowledgements and refusals, patch batches, heartbeats, repair
requests and their answers, and the re-reports of a unit's restart. Traffic within each side
flows (with the episode's other faults). Nothing is retransmitted specially: agents keep their
unacknowledged batches and edges their pending repairs, exactly as for any lost message, so the
ordinary repair recovers everything once the cut heals. Requests keep coming in on both sides,
and routing degrades to what each side knows: a client reaches only the doors on its side (the
nearest one if its own is down), and a door routes only to workers on its side (it cannot
connect across the cut, so it excludes those workers up front, as it excludes workers it found
down); its views of the units across the cut stay where the cut froze them. Every
``partition_every``-th episode cuts off a seeded region (one with a live edge, while another
side keeps one) at a seeded point of its ops; the cut heals when the episode's faults stop, so
that episode's convergence time is the partition's (:attr:`ChaosResult.partitions`). While a
side has only one live edge, that edge is not crashed (as the last live edge never is).

Crashes:

* a **maintenance unit** is down for a while (whatever reaches it is lost), then comes back from
  its last persisted :meth:`MaintenanceUnit.to_bytes` (written every ``persist_ms``) under a new
  epoch; every agent's stream to it reconnects and re-reports that shard
  (:meth:`WorkerAgent.on_rejected`), and the edges notice the epoch and resync;
* an **edge** is rebuilt empty and bootstrapped from the live units' snapshots (views of a unit
  that is down wait in ``pending_resyncs``);
* an **agent** comes back as a new process: a higher incarnation, the engine's replay ring read
  from seq 0, then a full re-report;
* an **engine** restarts: the worker serves nothing for a while, then comes back with an empty
  cache, a new block-hash seed and its seq back at 0 (it publishes nothing for the restart
  itself; the agent recognises it from the seq).

A run is ``episodes`` rounds of: faults on while the workload produces its share of the key ops
(crashes at seeded points of it), then faults off, everything down restarted, the workload
paused, and the plane left to repair itself until it has *converged*: every edge's every view
digest equals its unit's table digest and every unit holds, for every worker, exactly the keys
and tiers that worker's agent holds. The virtual time that takes is the episode's convergence
time. Requests that could not be served count as failed: a route that raised, or a worker that
was down after the door's retries (each retry excludes the workers found down), as the HTTP door
does.

Deterministic for a seed: every random draw comes from seeded generators, every iteration order
is fixed, and nothing reads a clock except to report the wall time of the run.
"""

from __future__ import annotations

import heapq
import math
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from kvcompass import _core
from kvcompass.agent import WorkerAgent, encode_batch, encode_replay, encode_replay_end
from kvcompass.agent.events import Event
from kvcompass.discovery.edge import Edge, ResyncAction
from kvcompass.discovery.maintenance import MaintenanceUnit
from kvcompass.discovery.key_ops import KeyOpBatch
from kvcompass.discovery.plane import LocalPlane
from kvcompass.discovery.topology import Topology, load_topology
from kvcompass.errors import AgentSequenceError, InvalidArgumentError, KVCompassError, StaleIncarnationError
from kvcompass.index_types import Namespace
from kvcompass.engine.cache import PrefixCache

__all__ = ["ChaosConfig", "ChaosHarness", "ChaosResult", "PartitionRecord", "run_chaos"]

LINK_FAULTS = ("drop", "dup", "reorder", "delay")
CRASHES = ("unit_crash", "edge_crash", "agent_crash", "engine_restart")
PARTITION = "partition"
_NS = Namespace("llama-3.1-8b", "chaos")
_INCARNATION_STEP = 1 << 8  # a restarted agent process starts well above its predecessor (boot_incarnation's spacing)


@dataclass(frozen=True, slots=True)
class ChaosConfig:
    """One run. Times are virtual milliseconds; ``p_*`` are per-message fault probabilities."""

    seed: int = 0
    ops: int = 10_000
    """Key ops the agents emit from the workload (re-reports not counted) before the last episode ends."""
    topology: str = "testbed-14x3"
    episodes: int = 8
    crashes_per_episode: int = 1
    """Crashes of each kind (unit, edge, agent, engine) per episode."""
    p_patch: float = 0.03
    """Probability of each fault kind on a unit -> edge message (batch, heartbeat, repair answer)."""
    p_batch: float = 0.03
    """Probability of each fault kind on an agent -> unit key-op batch."""
    p_event_drop: float = 0.01
    """An engine -> agent KV-event message lost (the agent replays it from the engine's ring)."""
    p_request_drop: float = 0.03
    """A repair request (edge -> unit) lost."""
    request_interval_ms: float = 2.0
    flush_ms: float = 2.0
    heartbeat_ms: float = 250.0
    persist_ms: float = 1000.0
    resend_ms: float = 50.0
    resync_retry_ms: float = 50.0
    down_ms: tuple[float, float] = (5.0, 60.0)
    link_ms: tuple[float, float] = (0.2, 1.5)
    reorder_ms: tuple[float, float] = (2.0, 12.0)
    delay_ms: tuple[float, float] = (20.0, 200.0)
    max_repair_ms: float = 20_000.0
    docs: int = 48
    prompt_tokens: tuple[int, int] = (256, 4608)
    vram_tokens: int = 8192
    dram_tokens: int = 16384
    repair: bool = True
    """Off: edges never ask for repairs (to show that a broken repair path is caught)."""
    reconnect_reports: bool = True
    """Agents re-report a shard when their stream to its restarted unit reconnects."""
    partition_every: int = 2
    """Every this-many-th episode (the 2nd, 4th, ...) cuts one region off; 0: never."""
    partition_start: tuple[float, float] = (0.05, 0.5)
    """Where in its episode's share of the ops a partition starts (it heals when the faults stop)."""

    def check(self) -> None:
        if self.ops < 1 or self.episodes < 1 or self.crashes_per_episode < 0:
            raise InvalidArgumentError(f"need ops >= 1, episodes >= 1 and crashes_per_episode >= 0, got {self.ops}, {self.episodes}, {self.crashes_per_episode}")
        lo, hi = self.partition_start
        if self.partition_every < 0 or not (0.0 <= lo <= hi < 1.0):
            raise InvalidArgumentError(f"need partition_every >= 0 and 0 <= partition_start[0] <= partition_start[1] < 1, got {self.partition_every}, {self.partition_start}")
        for name in ("p_patch", "p_batch", "p_event_drop", "p_request_drop"):
            p = getattr(self, name)
            if not (0.0 <= p and p * (4 if name in ("p_patch", "p_batch") else 1) < 1.0):
                raise InvalidArgumentError(f"{name} = {p}: the fault probabilities of a link must add up to less than 1")


@dataclass(frozen=True, slots=True)
class PartitionRecord:
    """One region partition: which region was cut off, when (virtual ms), how many messages the
    cut dropped, and how long after healing the plane took to converge (``inf``: it did not)."""

    episode: int
    region: str
    start_ms: float
    heal_ms: float
    messages_cut: int
    converge_ms: float


@dataclass(slots=True)
class ChaosResult:
    seed: int
    ops: int
    faults: dict[str, int]
    views_checked: int
    divergent_views: int
    workers_checked: int
    divergent_workers: int
    converged: bool
    converge_ms: list[float]
    requests: int
    failed_requests: int
    retried_requests: int
    virtual_ms: float
    wall_s: float
    repairs: int
    topology: str
    partitions: list[PartitionRecord] = field(default_factory=list)
    """Per partition; only ``faults["partition"]`` (their count) reaches the JSON."""

    def as_dict(self) -> dict[str, Any]:
        done = [x for x in self.converge_ms if math.isfinite(x)]
        return {
            "mode": "in-process",
            "seed": self.seed,
            "ops": self.ops,
            "faults_injected": sum(self.faults.values()),
            "views_checked": self.views_checked,
            "divergent_views": self.divergent_views,
            "converged": self.converged,
            "max_converge_ms": round(max(done), 3) if done and self.converged else None,
            "requests": self.requests,
            "failed_requests": self.failed_requests,
            "faults": dict(self.faults),
            "workers_checked": self.workers_checked,
            "divergent_workers": self.divergent_workers,
            "converge_ms": [round(x, 3) if math.isfinite(x) else None for x in self.converge_ms],
            "retried_requests": self.retried_requests,
            "repairs": self.repairs,
            "virtual_ms": round(self.virtual_ms, 3),
            "wall_s": round(self.wall_s, 3),
            "topology": self.topology,
        }


class _Link:
    """A one-way network path; while faults are on, each message may be dropped, duplicated,
    reordered or delayed (at most one of them), each with probability ``p``."""

    def __init__(self, h: ChaosHarness, stream: str, p: float) -> None:
        self._h = h
        self.stream = stream
        self.p = p
        self._last: dict[tuple[int | str, ...], float] = {}

    def send(self, key: tuple[int | str, ...], fn: Callable[[], None], src: str, dst: str) -> None:
        """Deliver ``fn`` later from region ``src`` to region ``dst``; messages of one ``key``
        (one connection) arrive in order unless a fault reorders or delays them, and none
        crosses a partition's cut (at sending or at arrival)."""
        h = self._h
        if h.severed(src, dst):
            h.messages_cut += 1
            return
        fn = h.across(src, dst, fn)
        cfg = h.cfg
        rng = h.fault_rng
        base = max(float(rng.uniform(*cfg.link_ms)), self._last.get(key, 0.0) - h.now)
        self._last[key] = h.now + base
        if h.faults_on and self.p > 0:
            x = float(rng.random())
            kind = LINK_FAULTS[int(x / self.p)] if x < 4 * self.p else None
            if kind is not None:
                h.count(f"{self.stream}_{kind}")
            if kind == "drop":
                return
            if kind == "dup":
                h.at(h.now + base, fn)
                h.at(h.now + base + float(rng.uniform(*cfg.reorder_ms)), fn)
                return
            if kind == "reorder":
                base += float(rng.uniform(*cfg.reorder_ms))
            elif kind == "delay":
                base += float(rng.uniform(*cfg.delay_ms))
        h.at(h.now + base, fn)


@dataclass(eq=False)
class _Worker:
    id: str
    index: int
    region: str
    cache: PrefixCache
    hash_seed: int
    seq: int = 0
    ring: deque[tuple[int, bytes]] = field(default_factory=lambda: deque(maxlen=10_000))
    down_until: float = -1.0

    def up(self, now: float) -> bool:
        return now >= self.down_until


class _Sender:
    """One agent process's ingest streams: every batch is kept until acknowledged."""

    def __init__(self, h: ChaosHarness, agent: WorkerAgent) -> None:
        self.h = h
        self.agent = agent
        self.region = h.workers[agent.worker_id].region
        self.alive = True
        shards = agent.shards
        self.unacked: list[dict[int, tuple[KeyOpBatch, float]]] = [{} for _ in range(shards)]
        self.floor = [0] * shards  # refusals of batches below this seq predate the last reset

    def send(self, batches: Sequence[KeyOpBatch]) -> None:
        for b in batches:
            self.unacked[b.shard][b.seq] = (b, self.h.now)
            self._transmit(b)

    def _transmit(self, b: KeyOpBatch) -> None:
        h = self.h
        h.batch_link.send((b.worker, b.shard), lambda: h.unit_receive(self, b), self.region, h.unit_regions[b.shard])

    def acked(self, b: KeyOpBatch) -> None:
        self.unacked[b.shard].pop(b.seq, None)

    def refused(self, b: KeyOpBatch) -> None:
        """The unit lost this agent's sequence: re-report the shard with a reset."""
        if not self.alive or b.incarnation != self.agent.incarnation or b.seq < self.floor[b.shard]:
            return
        self.reset_shard(b.shard)

    def reset_shard(self, shard: int) -> None:
        fresh = self.agent.on_rejected(shard)
        self.unacked[shard].clear()
        mine = [x for x in fresh if x.shard == shard]
        if mine:
            self.floor[shard] = min(x.seq for x in mine)
        self.send(fresh)

    def resend_due(self) -> None:
        now = self.h.now
        for q in self.unacked:
            if q and min(t for _, t in q.values()) <= now - self.h.cfg.resend_ms:
                for seq in sorted(q):
                    b, _ = q[seq]
                    q[seq] = (b, now)
                    self._transmit(b)


class ChaosHarness:
    """See the module docstring; :meth:`run` does the whole run."""

    def __init__(self, cfg: ChaosConfig, topology: Topology | None = None) -> None:
        cfg.check()
        self.cfg = cfg
        self.topology = topology if topology is not None else load_topology(cfg.topology)
        plane = LocalPlane(self.topology, capacity=4096, seed=cfg.seed)
        self.plan = plane.plan
        self.layout = plane.layout
        self._plane = plane
        self.units: list[MaintenanceUnit | None] = list(plane.units)
        self.epochs = [u.epoch for u in plane.units]
        self.saved: list[bytes | None] = [None] * len(plane.units)
        self.edges: dict[str, Edge | None] = dict(plane.edges)
        self._edge_seed = {r: cfg.seed + i for i, r in enumerate(plane.edges)}
        self.regions = sorted(plane.edges)
        self.tables = [t.table_id for t in self.layout.tables]
        self.shards = self.layout.shards
        names = self.topology.region_names
        self.unit_regions = [names[s % len(names)] for s in range(self.shards)]
        """Each maintenance unit's home region: round-robin over the topology's regions."""
        self.cut: str | None = None
        """The region cut off from the rest by a partition, or None."""
        self.messages_cut = 0
        self._cut_since = (0.0, 0)
        self.partitions: list[PartitionRecord] = []

        self.rng = np.random.default_rng([cfg.seed, 1])  # workload
        self.fault_rng = np.random.default_rng([cfg.seed, 2])  # links and crashes
        self.now = 0.0
        self._heap: list[tuple[float, int, Callable[[], None]]] = []
        self._n = 0
        self.faults_on = False
        self.faults: dict[str, int] = {f"{s}_{k}": 0 for s in ("patch", "batch") for k in LINK_FAULTS}
        self.faults.update({"event_drop": 0, "request_drop": 0, **{c: 0 for c in CRASHES}, PARTITION: 0})

        self.batch_link = _Link(self, "batch", cfg.p_batch)
        self.patch_link = _Link(self, "patch", cfg.p_patch)

        block = self.topology.block_size
        self.workers: dict[str, _Worker] = {}
        self.agents: dict[str, WorkerAgent | None] = {}
        self.senders: dict[str, _Sender] = {}
        for i, w in enumerate(self.layout.workers):
            region = next(s.region for s in self.topology.workers if s.id == w)
            self.workers[w] = _Worker(w, i, region, self._cache(i), i)
            agent = WorkerAgent(w, _NS, self.plan.registration(region), self.shards, block_size=block)
            self.agents[w] = agent
            self.senders[w] = _Sender(self, agent)
        self._docs = self._make_docs()
        self.ops = 0
        self.requests = 0
        self.failed = 0
        self.retried = 0
        self.repairs = 0
        self._asked: dict[tuple[str, int, int], float] = {}
        self._restarts: list[Callable[[], None]] = []
        self._timers = 0

    # ---- the virtual clock ----------------------------------------------------------------------

    def at(self, t: float, fn: Callable[[], None]) -> None:
        self._n += 1
        heapq.heappush(self._heap, (t, self._n, fn))

    def _every(self, period: float, fn: Callable[[], None]) -> None:
        def tick() -> None:
            fn()
            self.at(self.now + period, tick)

        self.at(self.now + period, tick)

    def _step(self) -> bool:
        if not self._heap:
            return False
        t, _, fn = heapq.heappop(self._heap)
        self.now = max(self.now, t)
        fn()
        return True

    def count(self, kind: str) -> None:
        self.faults[kind] += 1

    def _start_timers(self) -> None:
        if self._timers:
            return
        cfg = self.cfg
        self._every(cfg.flush_ms, self._flush)
        self._every(cfg.heartbeat_ms, self._heartbeat)
        self._every(cfg.persist_ms, self._persist)
        self._every(cfg.resend_ms / 2, self._resend)
        self._every(cfg.resync_retry_ms / 2, self._retry_resyncs)
        self._timers = len(self._heap)

    def advance(self, ms: float) -> None:
        """Run the virtual clock ``ms`` forward (starting the periodic timers if need be); no
        requests are made."""
        self._start_timers()
        until = self.now + ms
        while self._heap and self._heap[0][0] <= until:
            self._step()
        self.now = until

    # ---- region partitions --------------------------------------------------------------------

    def severed(self, a: str, b: str) -> bool:
        """Whether regions ``a`` and ``b`` are on different sides of the current cut."""
        return self.cut is not None and (a == self.cut) != (b == self.cut)

    def across(self, src: str, dst: str, fn: Callable[[], None]) -> Callable[[], None]:
        """``fn`` as a message from ``src`` to ``dst``: lost if a cut separates them when it arrives."""

        def deliver() -> None:
            if self.severed(src, dst):
                self.messages_cut += 1
            else:
                fn()

        return deliver

    def partition(self, region: str) -> None:
        """Cut ``region`` off from every other region (until :meth:`heal`)."""
        self.topology.region(region)
        if self.cut is not None:
            raise InvalidArgumentError(f"region {self.cut!r} is already cut off")
        self.cut = region
        self.count(PARTITION)
        self._cut_since = (self.now, self.messages_cut)

    def heal(self) -> tuple[str, float, int] | None:
        """End the partition: (the region that was cut off, when the cut began, messages it
        dropped), or None if there was none."""
        if self.cut is None:
            return None
        region, (since, cut0) = self.cut, self._cut_since
        self.cut = None
        return region, since, self.messages_cut - cut0

    def _sides_with_doors(self, r: str) -> bool:
        """Whether cutting ``r`` off leaves a live edge on both sides."""
        live = [x for x in self.regions if self.edges[x] is not None]
        return r in live and any(x != r for x in live)

    def _start_partition(self) -> None:
        names = [r for r in self.topology.region_names if self._sides_with_doors(r)]
        if self.cut is None and names:
            self.partition(names[int(self.fault_rng.integers(len(names)))])

    def visible_prefix(self, region: str, worker: str, tokens: npt.NDArray[np.uint32]) -> int:
        """The longest of ``worker``'s registration lengths at which the edge of ``region``'s
        views (the index alone: no speculative entries) say the worker holds ``tokens``'
        prefix; 0 if none."""
        edge = self.edges[region]
        if edge is None:
            return 0
        lengths = [c for c in self.plan.registration(self.workers[worker].region) if c <= len(tokens)]
        if not lengths:
            return 0
        keys = _core.prefix_keys(_NS.digest, np.asarray(tokens, dtype=np.uint32), np.array(lengths, dtype=np.uint32)).tolist()
        ref = self.layout.field_of(worker)
        best = 0
        for c, k in zip(lengths, keys):
            if (edge.view(ref.table_id, k % self.shards).lookup(k) >> (2 * ref.field)) & 3:
                best = c
        return best

    def cache_prompt(self, worker: str, tokens: npt.NDArray[np.uint32]) -> None:
        """``worker``'s engine computes ``tokens`` (admits it and publishes its KV events)."""
        w = self.workers[worker]
        self._publish(w, w.cache.admit(tokens, self.now / 1e3))

    # ---- construction helpers ------------------------------------------------------------------

    def _cache(self, seed: int) -> PrefixCache:
        return PrefixCache(self.topology.block_size, self.cfg.vram_tokens, self.cfg.dram_tokens, "lru", hash_seed=seed)

    def _make_docs(self) -> list[npt.NDArray[np.uint32]]:
        lo, hi = self.cfg.prompt_tokens
        return [self.rng.integers(0, 120_000, size=int(self.rng.integers(lo, hi)), dtype=np.uint32) for _ in range(self.cfg.docs)]

    def _new_edge(self, region: str) -> Edge:
        old = self._plane.edges[region]
        workers = {w.id: w for w in self.topology.workers}
        targets = list(dict.fromkeys([region, *(t.region for t in self.layout.tables)]))
        return Edge(
            region,
            self.layout,
            [workers[w] for w in self.layout.workers],
            {r: self.plan.lengths(region, r) for r in targets},
            {r: self.plan.rtt_ms(region, r) for r in targets},
            old.params,
            seed=self._edge_seed[region] + 7919 * int(self.now + 1),
            block_size=self.topology.block_size,
        )

    # ---- the workload --------------------------------------------------------------------------

    def _prompt(self) -> npt.NDArray[np.uint32]:
        rng = self.rng
        # Zipf-like popularity over shared documents, each with its own suffix.
        doc = self._docs[min(int(rng.zipf(1.3)) - 1, len(self._docs) - 1)]
        cut = int(rng.integers(len(doc) // 2, len(doc) + 1))
        suffix = rng.integers(0, 120_000, size=int(rng.integers(0, 512)), dtype=np.uint32)
        return np.concatenate([doc[:cut], suffix])

    def _request(self) -> None:
        self.requests += 1
        tokens = self._prompt()
        origin = self.regions[int(self.rng.integers(len(self.regions)))]
        live = [r for r in self.regions if self.edges[r] is not None and not self.severed(origin, r)]
        if not live:
            self.failed += 1
            return
        # A client whose door is down goes to the nearest other one (on its side of a cut).
        door = origin if origin in live else min(live, key=lambda r: self.plan.rtt_ms(origin, r))
        edge = self.edges[door]
        assert edge is not None
        # A door cannot connect to workers across a cut: they may not win.
        excluded: list[str] = [w for w in self.layout.workers if self.severed(door, self.workers[w].region)] if self.cut is not None else []
        for _ in range(3):
            try:
                d = edge.route(tokens, _NS, self.now / 1e3, exclude=excluded)
            except (KVCompassError, ValueError):
                break
            w = self.workers[d.worker]
            if not w.up(self.now):
                excluded.append(d.worker)  # the door's connection failed: retry elsewhere
                self.retried += 1
                continue
            v, dr = w.cache.prompt_hit(tokens)
            edge.on_response(d.worker, d.expected_match, v + dr, None, self.now / 1e3)
            self._publish(w, w.cache.admit(tokens, self.now / 1e3))
            return
        self.failed += 1

    def _publish(self, w: _Worker, events: Sequence[Event]) -> None:
        if not events:
            return
        frames = encode_batch(events, w.seq, ts=self.now / 1e3)
        w.ring.append((w.seq, frames[2]))
        w.seq += 1
        if self.faults_on and self.cfg.p_event_drop > 0 and float(self.fault_rng.random()) < self.cfg.p_event_drop:
            self.count("event_drop")
            return
        self.at(self.now + 0.1, lambda: self._agent_message(w.id, frames))

    # ---- agents --------------------------------------------------------------------------------

    def _agent_message(self, wid: str, frames: list[bytes]) -> None:
        agent = self.agents[wid]
        if agent is None:
            return  # the agent process is down: the PUB message is gone
        out = agent.on_message(frames)
        self._emit(wid, agent, out.batches)
        if out.replay is not None:
            start = out.replay.start_seq
            self.at(self.now + 0.5, lambda: self._replay(wid, agent, start))

    def _replay(self, wid: str, agent: WorkerAgent, start: int) -> None:
        """The engine's replay socket answers from its ring (reliably: a lost replay is the
        same as an unanswered one, which the agent resyncs from)."""
        if self.agents[wid] is not agent:
            return
        w = self.workers[wid]
        for seq, payload in list(w.ring):
            if seq >= start:
                self._emit(wid, agent, agent.on_replay(encode_replay(seq, payload)).batches)
        self._emit(wid, agent, agent.on_replay(encode_replay_end()).batches)
        if agent.buffered:
            self._emit(wid, agent, agent.on_replay_failed().batches)

    def _emit(self, wid: str, agent: WorkerAgent, batches: Sequence[KeyOpBatch]) -> None:
        if not batches:
            return
        self.ops += sum(len(b.keys) for b in batches if not b.reset)
        self.senders[wid].send(batches)

    def unit_receive(self, sender: _Sender, b: KeyOpBatch) -> None:
        unit = self.units[b.shard]
        if unit is None:
            return  # the unit is down: no ack, the sender re-sends later
        src = self.unit_regions[b.shard]
        try:
            unit.apply(b, b.worker)
        except StaleIncarnationError:
            return  # a batch of an agent process that is gone
        except AgentSequenceError:
            self.at(self.now + 0.5, self.across(src, sender.region, lambda: sender.refused(b)))
            return
        self.at(self.now + 0.5, self.across(src, sender.region, lambda: sender.acked(b)))

    # ---- units and edges ----------------------------------------------------------------------

    def _flush(self) -> None:
        for unit in self.units:
            if unit is None:
                continue
            for b in unit.flush():
                for r in self.regions:
                    data = [b.data]
                    self.patch_link.send((unit.shard, r), lambda r=r, data=data: self._edge_receive(r, data), self.unit_regions[unit.shard], r)  # type: ignore[misc]

    def _heartbeat(self) -> None:
        for unit in self.units:
            if unit is None:
                continue
            pos = [(t, unit.shard, *unit.position(t)) for t in self.tables]
            for r in self.regions:
                self.patch_link.send((unit.shard, r), lambda r=r, pos=pos: self._edge_heartbeat(r, pos), self.unit_regions[unit.shard], r)  # type: ignore[misc]

    def _persist(self) -> None:
        for s, unit in enumerate(self.units):
            if unit is not None:
                self.saved[s] = unit.to_bytes()

    def _edge_receive(self, region: str, batches: list[bytes]) -> None:
        edge = self.edges[region]
        if edge is None:
            return
        for data in batches:
            out = edge.apply_patch(data)
            if out.resync is not None:
                self._ask(region, edge, out.resync)

    def _edge_heartbeat(self, region: str, pos: list[tuple[int, int, int, int]]) -> None:
        edge = self.edges[region]
        if edge is None:
            return
        for t, s, epoch, seq in pos:
            a = edge.note_writer_position(t, s, epoch, seq)
            if a is not None:
                self._ask(region, edge, a)

    def _ask(self, region: str, edge: Edge, a: ResyncAction) -> None:
        if not self.cfg.repair:
            return
        self._asked[(region, a.table, a.shard)] = self.now
        home = self.unit_regions[a.shard]
        if self.severed(region, home):
            self.messages_cut += 1
            return
        if self.faults_on and float(self.fault_rng.random()) < self.cfg.p_request_drop:
            self.count("request_drop")
            return
        self.at(self.now + float(self.fault_rng.uniform(*self.cfg.link_ms)), self.across(region, home, lambda: self._answer(region, edge, a)))

    def _answer(self, region: str, edge: Edge, a: ResyncAction) -> None:
        unit = self.units[a.shard]
        if unit is None or self.edges[region] is not edge:
            return
        self.repairs += 1
        # One answer on the subscription: the batches arrive (or get lost) together, in order.
        data = unit.resume(a.table, a.epoch, a.seq)
        self.patch_link.send((a.shard, region), lambda: self._edge_receive(region, data), self.unit_regions[a.shard], region)

    def _retry_resyncs(self) -> None:
        for r in self.regions:
            edge = self.edges[r]
            if edge is None:
                continue
            for a in edge.pending_resyncs():
                if self._asked.get((r, a.table, a.shard), -math.inf) <= self.now - self.cfg.resync_retry_ms:
                    self._ask(r, edge, a)

    def _resend(self) -> None:
        for w in self.layout.workers:
            if self.agents[w] is not None:
                self.senders[w].resend_due()

    # ---- crashes -------------------------------------------------------------------------------

    def _crash(self, kind: str) -> None:
        if kind == PARTITION:
            self._start_partition()
            return
        rng = self.fault_rng
        down = float(rng.uniform(*self.cfg.down_ms))
        self.count(kind)
        if kind == "unit_crash":
            up = [s for s, u in enumerate(self.units) if u is not None]
            if not up:
                return
            s = up[int(rng.integers(len(up)))]
            self.units[s] = None
            self._pending_restart(down, lambda: self._restart_unit(s))
        elif kind == "edge_crash":
            # Never the last live edge of a side (of the plane when nothing is cut off).
            up_r = [r for r in self.regions if self.edges[r] is not None and any(x != r and self.edges[x] is not None and not self.severed(r, x) for x in self.regions)]
            if not up_r:
                return
            r = up_r[int(rng.integers(len(up_r)))]
            self.edges[r] = None
            self._pending_restart(down, lambda: self._restart_edge(r))
        elif kind == "agent_crash":
            up_w = [w for w in self.layout.workers if self.agents[w] is not None]
            w = up_w[int(rng.integers(len(up_w)))]
            old = self.agents[w]
            assert old is not None
            self.agents[w] = None
            self.senders[w].alive = False
            self._pending_restart(down, lambda: self._restart_agent(w, old.incarnation))
        else:
            up_e = [w for w in self.layout.workers if self.workers[w].up(self.now)]
            w = up_e[int(rng.integers(len(up_e)))]
            self._restart_engine(self.workers[w], down)

    def _pending_restart(self, down: float, fn: Callable[[], None]) -> None:
        done = [False]

        def once() -> None:
            if not done[0]:
                done[0] = True
                fn()

        self._restarts.append(once)
        self.at(self.now + down, once)

    def _restart_unit(self, s: int) -> None:
        self.epochs[s] += 1
        saved = self.saved[s]
        unit = MaintenanceUnit.from_bytes(saved, self.layout, self.epochs[s], capacity=4096) if saved is not None else MaintenanceUnit(s, self.layout, self.epochs[s], capacity=4096)
        self.units[s] = unit
        if self.cfg.reconnect_reports:
            for w in self.layout.workers:
                if self.agents[w] is not None:
                    snd = self.senders[w]
                    self.at(self.now + float(self.fault_rng.uniform(*self.cfg.link_ms)), lambda snd=snd: snd.reset_shard(s) if snd.alive else None)  # type: ignore[misc]

    def _restart_edge(self, r: str) -> None:
        edge = self._new_edge(r)
        self.edges[r] = edge
        for unit in self.units:
            if unit is None or self.severed(r, self.unit_regions[unit.shard]):
                continue  # its views wait in pending_resyncs until the unit is back (or reachable)
            for t in self.tables:
                edge.bootstrap(t, unit.shard, unit.snapshot(t))

    def _restart_agent(self, w: str, last_incarnation: int) -> None:
        worker = self.workers[w]
        agent = WorkerAgent(w, _NS, self.plan.registration(worker.region), self.shards, block_size=self.topology.block_size, incarnation=last_incarnation + _INCARNATION_STEP)
        self.agents[w] = agent
        self.senders[w] = _Sender(self, agent)
        # A new agent process reads the engine's ring from seq 0, then re-reports everything.
        self._replay(w, agent, 0)
        self._emit(w, agent, agent.full_report())

    def _restart_engine(self, w: _Worker, down: float) -> None:
        w.down_until = self.now + down
        w.hash_seed += 1_000_003
        w.cache = self._cache(w.hash_seed)
        w.seq = 0
        w.ring.clear()

    # ---- convergence ---------------------------------------------------------------------------

    def positions_match(self) -> bool:
        """Cheap necessary condition of convergence: everything up and every view at its
        writer's position (the digests are compared only then)."""
        if any(u is None for u in self.units) or any(a is None for a in self.agents.values()):
            return False
        for r in self.regions:
            edge = self.edges[r]
            if edge is None or edge.behind:
                return False
            for unit in self.units:
                assert unit is not None
                for t in self.tables:
                    v = edge.view(t, unit.shard)
                    if not v.initialised or (v.epoch, v.seq) != unit.position(t):
                        return False
        return True

    def check(self) -> tuple[int, int]:
        """(divergent views, divergent workers) right now."""
        bad_views = 0
        for r in self.regions:
            edge = self.edges[r]
            for unit in self.units:
                for t in self.tables:
                    if edge is None or unit is None or edge.view(t, unit.shard).digest() != unit.table_digest(t):
                        bad_views += 1
        bad_workers = 0
        for w in self.layout.workers:
            agent = self.agents[w]
            if agent is None or any(u is None for u in self.units):
                bad_workers += 1
                continue
            held = agent.held()
            ref = self.layout.field_of(w)
            keys = np.array(sorted(held), dtype=np.uint64)
            tiers = np.array([int(held[int(k)]) for k in keys], dtype=np.uint64)
            ok = True
            for unit in self.units:
                assert unit is not None
                k, v = unit.table(ref.table_id).entries()
                f = (v >> np.uint64(2 * ref.field)) & np.uint64(3)
                mine = f != 0
                order = np.argsort(k[mine])
                sel = (keys % np.uint64(self.shards)) == np.uint64(unit.shard)
                if not (np.array_equal(k[mine][order], keys[sel]) and np.array_equal(f[mine][order], tiers[sel])):
                    ok = False
                    break
            bad_workers += not ok
        return bad_views, bad_workers

    def _quiet(self) -> bool:
        """No message in flight (only the periodic timers are queued)."""
        return len(self._heap) <= self._timers

    # ---- the run -------------------------------------------------------------------------------

    def run(self, progress: Callable[[str], None] | None = None) -> ChaosResult:
        cfg = self.cfg
        t0 = time.perf_counter()
        self._start_timers()
        converge: list[float] = []
        views_checked = divergent_views = workers_checked = divergent_workers = 0
        all_converged = True
        for ep in range(cfg.episodes):
            target = cfg.ops * (ep + 1) // cfg.episodes
            start_ops = self.ops
            share = max(1, target - start_ops)
            # Crashes at seeded points of this episode's share of the ops.
            points = sorted((float(self.fault_rng.uniform(0.05, 0.85)), k) for k in CRASHES for _ in range(cfg.crashes_per_episode))
            if cfg.partition_every and ep % cfg.partition_every == cfg.partition_every - 1:
                points = sorted([*points, (float(self.fault_rng.uniform(*cfg.partition_start)), PARTITION)])
            self.faults_on = True
            self._restarts = []
            while self.ops < target:
                while points and self.ops - start_ops >= points[0][0] * share:
                    self._crash(points.pop(0)[1])
                self._request()
                until = self.now + float(self.rng.exponential(cfg.request_interval_ms))
                while self._heap and self._heap[0][0] <= until:
                    self._step()
                self.now = until
            for _, k in points:
                self._crash(k)
            # Faults stop: a cut heals, everything down comes back now, the workload pauses.
            self.faults_on = False
            healed = self.heal()
            for fn in self._restarts:
                fn()
            for w in self.workers.values():
                w.down_until = min(w.down_until, self.now)
            stop = self.now
            done = math.inf
            last_check = -math.inf
            while self.now - stop <= cfg.max_repair_ms and self._step():
                if self.now > last_check and (not self._heap or self._heap[0][0] > self.now):
                    last_check = self.now
                    if self.positions_match() and self.check() == (0, 0):
                        done = self.now - stop
                        break
            # Let whatever is still in flight land, then check again: convergence must hold.
            while not self._quiet() and self.now - stop <= cfg.max_repair_ms + 1000:
                self._step()
            bad_v, bad_w = self.check()
            ok = math.isfinite(done) and bad_v == 0 and bad_w == 0
            all_converged &= ok
            converge.append(done if ok else math.inf)
            cut_note = ""
            if healed is not None:
                region, since, cut = healed
                self.partitions.append(PartitionRecord(ep, region, since, stop, cut, done if ok else math.inf))
                cut_note = f", partition of {region} for {stop - since:.1f} ms ({cut} messages cut)"
            views_checked += len(self.regions) * self.shards * len(self.tables)
            divergent_views += bad_v
            workers_checked += len(self.layout.workers)
            divergent_workers += bad_w
            if progress is not None:
                progress(f"episode {ep + 1}/{cfg.episodes}: ops {self.ops}, converged in {done:.1f} virtual ms, divergent views {bad_v}, workers {bad_w}{cut_note}")
        return ChaosResult(
            seed=cfg.seed,
            ops=self.ops,
            faults=dict(self.faults),
            views_checked=views_checked,
            divergent_views=divergent_views,
            workers_checked=workers_checked,
            divergent_workers=divergent_workers,
            converged=all_converged,
            converge_ms=converge,
            requests=self.requests,
            failed_requests=self.failed,
            retried_requests=self.retried,
            virtual_ms=self.now,
            wall_s=time.perf_counter() - t0,
            repairs=self.repairs,
            topology=self.topology.name,
            partitions=list(self.partitions),
        )


def run_chaos(cfg: ChaosConfig, progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Run the in-process harness; the result as the JSON-able dict ``kvcompass chaos`` prints."""
    return ChaosHarness(cfg).run(progress).as_dict()
