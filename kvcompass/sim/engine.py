"""The event-driven simulator (paper section 4, "Simulator"): the discovery plane's own objects
driven by a virtual clock, with modelled workers and WAN.

Everything the services run is the real thing here: a :class:`~kvcompass.discovery.plane.LocalPlane`
(every maintenance unit and every edge), one :class:`~kvcompass.agent.WorkerAgent` per worker
fed the vLLM wire frames its :class:`~kvcompass.engine.cache.PrefixCache` publishes, and the edges'
routes, beliefs and queue estimates. Only the workers' time and the network are modelled.

**Clock.** A heap of ``(time_ms, seq, action)``; ``seq`` orders equal times by scheduling
order, so a run is a pure function of its inputs and seed. There is no wall clock. The edge
API takes seconds: every ``now`` handed to it is ``time_ms / 1000``.

**Where it runs.** The clock, the workers, their caches, the in-flight accounting, WAN draws
and the records are the Rust engine's (:class:`kvcompass._core.SimEngine`, ``rust/sim/``);
this module builds it and is its driver: the scheme's routing, the edges, the agents and the
units (the services' own objects) are called from it once per arrival, landing, published KV
batch, response and queue change, and on the patch tick. What the engine tells the driver
carries the sequence number the model schedules it at, so a callback the driver schedules in
reply sorts exactly where it would in one single-threaded loop: a run is the same, float for
float, as when all of it was Python (``tests/data/sim_golden.json`` pins every scheme).

**A request's life.**

1. Arrival at the edge of its region (the nearest edge region by RTT if its region runs none).
   The scheme picks a worker (:mod:`kvcompass.sim.schemes`); a scheme whose lookup leaves the
   edge (a central coordinator, DHT hops) returns that lookup's time as ``Choice.delay_ms``,
   which passes before the request is forwarded.
2. Forward over the WAN: one way is half the topology's RTT between the two regions (the
   in-region RTT when they are the same).
3. Prompts are prefilled in FIFO order. At prefill start ``(vram_hit, dram_hit) =
   cache.prompt_hit(tokens)`` (never the last token, as vLLM schedules) and the prefill computes ``cost.prefill_ms(uncached) +
   cost.reload_ms(dram_hit)`` at the worker's own prefill rate (the topology's
   ``beta_ms_per_token``, which the edges score with; ``SimConfig.cost`` gives the rest), in steps it shares with the decode batch (see GPU sharing
   below). At prefill end ``cache.admit(tokens)``; its KV events go to
   the worker's agent as one engine message (the events kept as Rust values,
   :class:`~kvcompass._core.CacheEvents`, up to the agent's forest), and the key-op batches reach
   ``plane.ingest`` ``event_delay_ms`` later (agent batching plus the hop to the unit).
4. Patches: the units' pending patches are flushed to every edge by ``plane.propagate()`` on
   a periodic tick every ``patch_interval_ms`` (default 10 ms, a unit's batching interval).
   Delivery to every edge happens at the tick; the WAN time of patches is not modelled.
5. The first token is produced at prefill end and reaches the edge one WAN way later: TTFT.
   The same first chunk carries the reuse report (``vram_hit + dram_hit``) and, for a worker
   outside the edge's region, its region's queue vector: ``Edge.on_response`` runs then.
6. Decode: continuous batching. A step decodes one token for every running sequence and
   takes ``cost.decode_step_ms(batch, context tokens)``; sequences join at the next step
   boundary. The last token reaches the edge one WAN way after its step: E2E. A
   request with ``output_length <= 1`` completes at prefill end. The clock does not stop at
   every step: one event ends a run of steps with an unchanged batch (a segment), at the
   boundary a step-by-step clock would reach, float for float.

**GPU sharing** (``SimConfig.gpu_sharing``). ``"chunked"`` (the default) is vLLM's scheduler
with chunked prefill: every step carries each running sequence's next token plus the next
chunk of the prompt being prefilled, up to ``max_batched_tokens`` (2048) in all, and takes the
chunk's prefill time plus the decode step of the batch. So a long prompt stalls every sequence
decoding beside it, and a large long-context batch slows each chunk. ``"lanes"``: a prefill
server and a decode lane that never slow each other down (this simulator's model before; it
leaves decode load out of time to first token, so a TTFT-priced router is never told about it).

**Queues.** A worker's queued prefill work (ms) is the remainder of the running prefill plus,
for each waiting request, its estimate from a cache lookup at enqueue time; with chunked
sharing each estimate adds one decode step of the worker's current batch per chunk (a vLLM
worker knows its running batch). Own-region edges
get ``set_local_queue`` whenever it changes (enqueue, prefill start, prefill end); remote
edges learn it from vectors piggybacked on responses and from the broadcasts
``Edge.broadcast_due`` asks for (checked on the patch tick, delivered a WAN way later).

**Migrations** (paper section 3.4): on every patch tick each edge's
``Edge.migration_actions`` are carried out. ``copy``: the KV blocks travel from the source to
the target in the same region (one in-region way plus ``kv_bytes / transfer_gbps``) and land
in the target's ``target_tier`` (DRAM) without using its prefill server. ``recompute``: the
prompt travels to the target (one in-region way), joins its FIFO like a request, is
prefilled there, and the blocks go to ``target_tier``. Either way the target publishes the
KV events of the new replica, which reach the index as any others. No request record is
made for a migration; :attr:`Simulator.migrations` counts them by kind.

**Prefill-decode disaggregation** (paper appendix C; a topology with ``role = "prefill"`` and
``"decode"`` workers): schemes route among prefill workers only and the plane indexes only
them. At prefill end the decode instance is drawn uniformly among the decode workers of the
prefill worker's region (the nearest region that has one, if none), the prompt's KV travels
there (``kv_bytes / transfer_gbps``, plus one way between the regions if they differ) and the
sequence joins that instance's continuous batch (with the shared KV pool, once that instance
has room for it: until then and through the transfer the prefill instance keeps its KV); its
last token returns to the edge from the decode instance's region. The first token is the prefill worker's, as before.

**Tenants** (``load_trace(tenants=K)``: several namespaces in one run): each namespace is a
vLLM cache salt. The emulated caches seed a salted prompt's block chain with its salt (equal
prompts of two tenants share no block), the stored events carry it in the first block's
``extra_keys`` as vLLM does, and every agent is given the run's salts, so it keys each tenant's
chains in that tenant's namespace; edges look requests up in their own namespace. Schemes read
a request's salt with :meth:`Simulator.salt` (None in a one-namespace run).

**Not modelled yet** (absent, not approximated): engine restarts and event loss.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from types import SimpleNamespace
from typing import Any, Literal

import numpy as np
import numpy.typing as npt

from kvcompass._core import NO_PARENT, CacheEvents, SimEngine
from kvcompass.agent import WorkerAgent
from kvcompass.agent.events import EngineBatch, Event
from kvcompass.discovery.edge import Edge
from kvcompass.discovery.layout import WorkerSpec
from kvcompass.discovery.maintenance import PatchBatch
from kvcompass.discovery.migration import MigrationAction
from kvcompass.discovery.key_ops import KeyOpBatch
from kvcompass.discovery.params import EdgeParams
from kvcompass.discovery.plane import LocalPlane
from kvcompass.discovery.topology import Topology, load_topology
from kvcompass.errors import AgentSequenceError, InvalidArgumentError, KVCompassError
from kvcompass.index_types import Namespace, Tier
from kvcompass.engine.cache import DEFAULT_DRAM_TOKENS, DEFAULT_VRAM_TOKENS, Policy, PrefixCache, salt_seed, worker_capacities
from kvcompass.engine.costs import CostModel
from kvcompass.sim.summary import RecordTable, Summary, mid_rate, summarize
from kvcompass.sim.schemes import Choice, Fleet, Scheme, make_scheme, salt_key, scheme_params
from kvcompass.sim.requests import Request, RequestTable
from kvcompass.sim.workload import check_context, collector_paused

__all__ = ["DEFAULT_DRAM_TOKENS", "DEFAULT_VRAM_TOKENS", "FOLLOW_UPS", "GPU_SHARING", "KV_POOLS", "FollowUps", "GpuSharing", "KvPool", "SimConfig", "Simulator", "simulate"]

GpuSharing = Literal["chunked", "lanes"]
GPU_SHARING: tuple[GpuSharing, ...] = ("chunked", "lanes")
FollowUps = Literal["after-parent", "on-time"]
FOLLOW_UPS: tuple[FollowUps, ...] = ("after-parent", "on-time")
KvPool = Literal["shared", "unbounded"]
KV_POOLS: tuple[KvPool, ...] = ("shared", "unbounded")

IDLE_SETTLE_MS = 60_000.0
"""A quiet fleet ticks this long before skipping (600 broadcasts: remote estimates halved 600
times, below 2^-500 of any queue); see ``Simulator._next_tick``."""
IDLE_RESUME_MS = 1_000.0
"""Ticks resume this long before the next arrival (ten broadcasts), so it is routed on
estimates as fresh as in a run that never skipped."""
# Requests built for the schemes a chunk of 2**bits at a time, and chunks kept (Simulator._request).
_ROW_CHUNK_BITS = 10
_ROW_CHUNKS_KEPT = 4


@dataclass(frozen=True, slots=True)
class SimConfig:
    """Knobs of one run besides the topology, workload and scheme."""

    seed: int = 0
    cost: CostModel = field(default_factory=CostModel)
    """Decode, reload, fixed costs and KV size; each worker's prefill rate is its topology's
    ``beta_ms_per_token`` (one source of truth with the routers' scores), not this model's."""
    model: str = "llama-3.1-8b"
    event_delay_ms: float = 5.0
    patch_interval_ms: float = 10.0
    window_ms: float = 1000.0
    policy: Policy = "lru"
    params: EdgeParams = field(default_factory=EdgeParams)
    plane_capacity: int = 4096
    wan_jitter: float = 0.0
    """Sensitivity (paper table 4): every WAN traversal takes ``(1 + u) * RTT / 2`` with u uniform
    in ``[-wan_jitter, +wan_jitter]`` (0.5 = +-50 %), while routing still scores the static matrix."""
    patch_loss: float = 0.0
    """Sensitivity: each patch batch is lost on its way to each edge with this probability; the
    edge's repair (a gap or the units' heartbeat, then a replay) lands one patch round later."""
    patch_delay_ms: float = 0.0
    """Sensitivity: patch batches reach the edges this long after their flush."""
    transfer_gbps: float = 100.0
    """Worker-to-worker KV transfer (Gbit/s), for copy migrations and the prefill-to-decode hand
    off: ours, a 100 GbE / RDMA NIC between GPU servers (the paper gives no figure)."""
    gpu_sharing: GpuSharing = "chunked"
    """How prefill and decode share a worker's GPU: ``"chunked"`` (vLLM's scheduler: every step
    carries each running sequence's next token plus up to ``max_batched_tokens`` minus that of
    one waiting prompt, so each slows the other) or ``"lanes"`` (a prefill server and a decode
    lane that never slow each other down; the model before chunked sharing)."""
    max_batched_tokens: int = 2048
    """Tokens one step may carry (vLLM's ``max_num_batched_tokens``): 2048 is vLLM's default for
    its OpenAI server on GPUs under 70 GiB and on A100 (``EngineArgs.get_batch_defaults``), the
    paper's RTX 5090 testbed and the A100 decode calibration."""
    closed_loop: int = 0
    """0: open loop, every request arrives at its own time (the offered rate). N > 0: closed
    loop, N requests outstanding; the first N arrive at their own times and each completion
    issues the next request in order when its client has the last token (no think time), so
    the throughput is what the fleet sustains under the scheme (the paper's ablation figure
    measures it so). Latencies then describe N requests in flight, not an offered rate."""
    follow_ups: FollowUps = "after-parent"
    """When a follow-up (a request whose workload names a parent: an agent's next call, a
    chat's next turn) is sent. ``"after-parent"``: at its own time, or when its parent's last
    token reaches the client if that is later, since its prompt holds the parent's answer and
    no client can send it before that answer exists. ``"on-time"``: at its own time whatever
    the parent's progress (the open-loop replay of earlier versions, in which a follow-up could
    arrive before its parent's answer and find less of its prompt cached)."""
    skip_idle: bool = True
    """Tick through a quiet fleet only as long as its state takes to settle (``IDLE_SETTLE_MS``),
    then skip to ``IDLE_RESUME_MS`` before the next arrival (``Simulator._next_tick``): a trace
    with idle hours (an operator's own log replayed at its own times) took minutes of ticks per
    idle day. False ticks through every idle millisecond (the differential test's reference)."""
    kv_pool: KvPool = "shared"
    """How a worker's VRAM is shared. ``"shared"``: as in an engine, its running sequences and
    its prefix cache share one KV pool; a prompt's prefill starts only when its blocks (those no
    running sequence holds already) and a reservation for its answer fit beside theirs (or when
    nothing runs), and the cache keeps the pool less the reservations, demoting what no longer
    fits. ``"unbounded"``: every prompt starts at once and the cache keeps all of VRAM beside
    any number of running sequences (the model before the twenty-seventh session, which let a
    worker's batch hold several times its VRAM at load 1 and above). With ``"shared"`` a
    disaggregated fleet's decode instance has a pool too: a prefill instance hands a sequence
    off only once it has room, and keeps the sequence's KV until then and through the
    transfer."""

    def __post_init__(self) -> None:
        if not self.event_delay_ms >= 0:
            raise InvalidArgumentError(f"event_delay_ms must be >= 0, got {self.event_delay_ms}")
        if not 0 <= self.wan_jitter <= 1:
            raise InvalidArgumentError(f"wan_jitter must be in [0, 1], got {self.wan_jitter}")
        if not 0 <= self.patch_loss < 1:
            raise InvalidArgumentError(f"patch_loss must be in [0, 1), got {self.patch_loss}")
        if not self.patch_delay_ms >= 0:
            raise InvalidArgumentError(f"patch_delay_ms must be >= 0, got {self.patch_delay_ms}")
        for name in ("patch_interval_ms", "window_ms", "transfer_gbps"):
            if not getattr(self, name) > 0:
                raise InvalidArgumentError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.gpu_sharing not in GPU_SHARING:
            raise InvalidArgumentError(f"gpu_sharing must be one of {', '.join(GPU_SHARING)}, got {self.gpu_sharing!r}")
        if type(self.max_batched_tokens) is not int or self.max_batched_tokens < 1:
            raise InvalidArgumentError(f"max_batched_tokens must be an int >= 1, got {self.max_batched_tokens!r}")
        if type(self.closed_loop) is not int or self.closed_loop < 0:
            raise InvalidArgumentError(f"closed_loop must be an int >= 0 (0: open loop), got {self.closed_loop!r}")
        if self.follow_ups not in FOLLOW_UPS:
            raise InvalidArgumentError(f"follow_ups must be one of {', '.join(FOLLOW_UPS)}, got {self.follow_ups!r}")
        if self.kv_pool not in KV_POOLS:
            raise InvalidArgumentError(f"kv_pool must be one of {', '.join(KV_POOLS)}, got {self.kv_pool!r}")


def _parent_positions(ids: npt.NDArray[np.int64], parent: npt.NDArray[np.int64]) -> npt.NDArray[np.uint32] | None:
    """Each request's parent as a position in the same (arrival-ordered) table, for
    :meth:`SimEngine.set_parents`; None when no request has a parent in it. A parent that is not
    in the table (cut off by ``max_requests``, or before the trace's window) or that does not
    arrive before its follow-up waits for no one."""
    n = len(ids)
    has = parent >= 0
    if not n or not has.any():
        return None
    order = np.argsort(ids, kind="stable")
    sorted_ids = ids[order]
    dup = np.flatnonzero(sorted_ids[1:] == sorted_ids[:-1])
    if dup.size:
        # A parent named by an id two requests share is ambiguous (found in review: the second
        # copy's follow-up waited on the first copy's parent).
        raise InvalidArgumentError(f"request id {int(sorted_ids[dup[0]])} is used twice; follow-ups need unique ids to find their parents")
    at = np.minimum(np.searchsorted(sorted_ids, parent), n - 1)
    pos = order[at]
    ok = has & (sorted_ids[at] == parent) & (pos < np.arange(n))
    if not ok.any():
        return None
    return np.where(ok, pos, NO_PARENT).astype(np.uint32)


class _Worker:
    """A worker as the driver sees it: its spec, its cache (inspectable after a run; the
    engine holds its blocks while the clock runs) and its agent."""

    __slots__ = ("spec", "index", "cache", "agent", "engine_seq")

    def __init__(self, spec: WorkerSpec, index: int, cache: PrefixCache, agent: WorkerAgent | None) -> None:
        self.spec = spec
        self.index = index
        self.cache = cache
        self.agent = agent
        self.engine_seq = 0


class _RunRng:
    """The run's generator as schemes draw from it (``integers``), continuing the engine's
    stream: numpy's PCG64 seeded by ``SimConfig.seed``, so every draw of the run, the engine's
    and the schemes', comes from one stream in one order."""

    __slots__ = ("_engine",)

    def __init__(self, engine: SimEngine) -> None:
        self._engine = engine

    def integers(self, n: int) -> int:
        """``Generator.integers(n)``: a draw in ``0..n``."""
        return int(self._engine.rng_integers(int(n)))

    def random(self) -> float:
        """``Generator.random()``: a draw in [0, 1)."""
        return float(self._engine.rng_random())


_SEGMENT_STEPS = 64
"""Most decode steps one event covers (a segment; see the engine's notes)."""


def _pcg_state(g: np.random.Generator) -> tuple[int, int, bool, int]:
    s = g.bit_generator.state
    if s["bit_generator"] != "PCG64":
        raise InvalidArgumentError(f"the simulator continues numpy's PCG64 stream, not {s['bit_generator']}")
    return int(s["state"]["state"]), int(s["state"]["inc"]), bool(s["has_uint32"]), int(s["uinteger"])


class Simulator:
    """One run: build with the deployment and workload, then :meth:`run` once."""

    @collector_paused()  # a fleet's set-up builds an object or more per request, no cycles
    def __init__(self, topology: Topology, requests: Sequence[Request], scheme: str | Callable[[Fleet], Scheme], config: SimConfig = SimConfig()) -> None:
        # The workload as columns, in arrival order (a Request is built only when a scheme
        # reads one: a paper-scale run holds no object per request).
        self._requests = RequestTable.from_requests(requests).by_arrival()
        self._rows: dict[int, list[Request]] = {}  # see _request
        namespaces = sorted(self._requests.namespaces_used()) or ["public"]
        self.topology = topology
        self.config = config
        self._cost = config.cost
        self._ns = Namespace(config.model, namespaces[0])
        # Several namespaces (tenants): each is a vLLM cache salt, so the emulated caches keep
        # tenants apart and the agents key each tenant's chains in its own namespace.
        self._ns_of = {name: Namespace(config.model, name) for name in namespaces}
        self._salted = len(namespaces) > 1
        self._tenant_of = {ns.digest: name for name, ns in self._ns_of.items()}
        # Cache salts by number (0: none) and their chain seeds, the same in every cache.
        self._salt_names = list(namespaces) if self._salted else []
        self._salt_tuple = tuple(self._salt_names)  # what the caches' salt numbers 1, 2, ... name
        self._salt_id = {name: i + 1 for i, name in enumerate(self._salt_names)}
        self._salt_seed = {name: salt_seed(name) for name in self._salt_names}
        # An ablation scheme runs the plane with its switch flipped (schemes.scheme_params).
        params = scheme_params(scheme, config.params)
        if topology.disaggregated and not params.disaggregated:
            params = dataclasses.replace(params, disaggregated=True)
        # Without patch faults every edge gets every batch at the same tick: one set of views
        # serves them all (LocalPlane's share_views), each batch applied once.
        self.plane = LocalPlane(topology, capacity=config.plane_capacity, params=params, seed=config.seed, share_views=not (config.patch_loss or config.patch_delay_ms))
        self._engine: SimEngine | None = None
        self._run_rng: _RunRng | None = None
        self._scheme = make_scheme(scheme, self) if isinstance(scheme, str) else scheme(self)
        self._indexed = self._scheme.uses_index
        # A scheme that follows the workers' KV events itself (a Dynamo-style router) gets every
        # admit's events at prefill end.
        self._on_kv: Callable[[str, Sequence[Event], float], None] | None = getattr(self._scheme, "on_kv_events", None)
        self._hand: Callable[..., Choice | None] | None = getattr(self._scheme, "handoff", None)
        plan, block = self.plane.plan, topology.block_size
        self._workers: dict[str, _Worker] = {}
        for i, spec in enumerate(topology.workers):
            cache = PrefixCache(
                block,
                *worker_capacities(spec.vram_tokens, spec.dram_tokens, block),
                config.policy,
                hash_seed=i,
                # Events are built only for someone to read them: the worker's agent or a scheme
                # that follows KV events (the others, the Oracle say, never look).
                publish=(self._indexed and spec.role != "decode") or self._on_kv is not None or bool(getattr(self._scheme, "follows_kv_events", False)),
            )
            cache.use_salts(self._salt_names)
            indexed = self._indexed and spec.role != "decode"
            agent = (
                WorkerAgent(spec.id, self._ns, plan.registration(spec.region), self.plane.layout.shards, block_size=block, salts=self._ns_of if self._salted else None)
                if indexed
                else None
            )
            self._workers[spec.id] = _Worker(spec, i, cache, agent)
        self._by_index = list(self._workers.values())
        self._index = {w: x.index for w, x in self._workers.items()}
        regions = topology.region_names
        self._region_names = regions
        self._region_index = {r: i for i, r in enumerate(regions)}
        edge_regions = plan.edge_regions
        self._edge_of = {r: min(edge_regions, key=lambda e: (e != r, plan.rtt_ms(r, e))) for r in topology.region_names} if edge_regions else {}
        self._ran = False
        self._progress: Callable[[int, int], None] | None = None
        self._migrate = self._indexed and params.migration
        # Decode instances per region, and for each region where its prefill hands off.
        decoders = {r: [self._workers[w.id].index for w in topology.workers_in(r) if w.role == "decode"] for r in regions}
        hand_to: list[list[int]] = [[] for _ in regions]
        if topology.disaggregated:
            for i, r in enumerate(regions):
                hand_to[i] = decoders[topology.decode_region(r)]
        self.migrations: dict[str, int] = {"copy": 0, "recompute": 0}
        """Migration actions carried out, by kind."""
        self.migration_log: list[MigrationAction] = []
        self._region_workers = {r: [w.id for w in topology.workers_in(r)] for r in regions}
        self._live_edges = list(self.plane.edges.values())
        self._next_broadcast_s = -math.inf  # the earliest edge's next broadcast (see _tick)
        self._quiet_since = math.inf  # the first tick of the current quiet stretch (_next_tick)
        # Idle stretches are skipped by whole broadcast periods on the tick grid, which needs
        # both in whole milliseconds (sums of them are then exact) and the one a multiple of
        # the other; else every tick runs.
        step, period = config.patch_interval_ms, config.params.broadcast_period_s * 1e3
        whole = float(step).is_integer() and float(round(period, 9)).is_integer() and round(period, 9) % step == 0
        self._skip_grid: float | None = round(period, 9) if whole else None
        reqs = self._requests
        region_of_name = np.array([self._region_index.get(r, -1) for r in reqs.region_names] or [0], dtype=np.int64)
        region = region_of_name[reqs.region_codes]
        if np.any(region < 0):
            k = int(np.flatnonzero(region < 0)[0])
            raise InvalidArgumentError(
                f"request {reqs.ids[k]} comes from region {reqs.region_names[reqs.region_codes[k]]!r}, which the topology {topology.name!r} does not have (regions: {', '.join(regions)})"
            )
        check_context(reqs, topology)
        edge_region = np.array([self._region_index[self._edge_of.get(r, r)] if r in self._region_index else 0 for r in reqs.region_names] or [0], dtype=np.uint32)[reqs.region_codes]
        # Block ids go over as they are held: a synthetic prompt's as its (chain, count) runs (the
        # engine expands them at arrival; 500,000 Mixed prompts' ids would be a gigabyte), a
        # trace's as its ids. A tenant's salt by namespace (0: none).
        # (A table may name namespaces none of its rows uses: those get no salt.)
        ns_salt_id = np.array([self._salt_id.get(ns, 0) for ns in reqs.namespace_names] or [0], dtype=np.uint32)
        ns_salt_seed = np.array([self._salt_seed.get(ns, 0) for ns in reqs.namespace_names] or [0], dtype=np.uint64)
        cost = config.cost
        faults = np.random.default_rng([config.seed, 0x5EE5])  # faults draw from their own stream
        self._engine = SimEngine(
            (cost.prefill_ms_per_token, cost.prefill_base_ms, cost.reload_ms_per_token, cost.decode_base_ms, cost.decode_ms_per_seq, cost.decode_compute_ms_per_token, cost.decode_ms_per_context_token, cost.kv_bytes_per_token),
            config.transfer_gbps,
            config.gpu_sharing == "chunked",
            config.max_batched_tokens,
            config.wan_jitter,
            _SEGMENT_STEPS,
            self._indexed,
            self._hand is not None,
            np.array([[plan.rtt_ms(a, b) for b in regions] for a in regions], dtype=np.float64).ravel(),
            [r in self.plane.edges for r in regions],
            [[self._index[w] for w in self._region_workers[r]] for r in regions],
            hand_to,
            np.array([self._region_index[w.region] for w in topology.workers], dtype=np.uint32),
            # Each worker prefills at its topology's rate, the one the edges' scores and the
            # level plan use (and the services' emulated workers run at).
            np.array([w.beta_ms_per_token for w in topology.workers], dtype=np.float64),
            [x.cache._core for x in self._by_index],
            [x.cache.publish for x in self._by_index],
            [w.region in self.plane.edges for w in topology.workers],
            reqs.arrival_ms,
            region.astype(np.uint32),
            edge_region,
            reqs.input_length.astype(np.uint64),
            reqs.output_length.astype(np.uint64),
            reqs.block_size.astype(np.uint32),
            ns_salt_id[reqs.namespace_codes],
            ns_salt_seed[reqs.namespace_codes],
            reqs.flat,
            reqs.offsets,
            reqs.runs.tolist(),
            _pcg_state(np.random.default_rng(config.seed)),
            _pcg_state(faults),
            max(1, len(reqs) // 100),
            config.kv_pool == "shared",
        )
        # For the tick's live queue poll: each worker's own-region edge (by number, -1: none, or
        # one that does not route to it, as a decode instance) and its index there.
        number = {e.region: k for k, e in enumerate(self._live_edges)}
        live_idx = [self._edge_index(number, x) for x in self._by_index]
        self._engine.set_live_sinks(
            [number.get(x.spec.region, -1) if i >= 0 else -1 for x, i in zip(self._by_index, live_idx)],
            [max(i, 0) for i in live_idx],
            [(q, lags.tolist()) for q, lags in (e.live_sink() for e in self._live_edges)],
        )
        if config.closed_loop:
            self._engine.set_closed_loop(config.closed_loop)
        if config.follow_ups == "after-parent":
            parents = _parent_positions(reqs.ids, reqs.parent)
            if parents is not None:
                self._engine.set_parents(parents)
        self._run_rng = _RunRng(self._engine)
        self._engine_holds_caches = True
        # Queue-vector broadcasts between edges travel in the engine (see _settle): where each
        # source's vector lands at each destination, resolved once.
        edges = self._live_edges
        self._edge_number = {e.region: k for k, e in enumerate(edges)}
        self._engine.set_broadcast_edges(
            [self._region_index[e.region] for e in edges],
            [e.live_sink()[0] for e in edges],
            [[None if d is e else d.vector_map(e.region, e.local_ids) for e in edges] for d in edges],
        )
        native = getattr(self._scheme, "engine_policy", None)
        if native is not None:
            # Content-keyed baselines key a salted prompt with its salt as schemes._h64 does.
            self._engine.set_salts([0] + [salt_key(s) for s in self._salt_names], ["None"] + [repr(s) for s in self._salt_names])
            p = native(self._requests)
            getattr(self._engine, f"set_{p.method}")(*p.args)
        elif not callable(getattr(self._scheme, "choose", None)):
            raise InvalidArgumentError(f"scheme {self._scheme.name!r} has neither choose nor engine_policy")

    # ---- the Fleet a scheme reads ----------------------------------------------------------------

    def _edge_index(self, number: dict[str, int], x: _Worker) -> int:
        """``x``'s index at its own region's edge (-1: no edge, or one that does not route to it,
        as a decode instance)."""
        k = number.get(x.spec.region)
        if k is None:
            return -1
        try:
            return self._live_edges[k].worker_index(x.spec.id)
        except KVCompassError:
            return -1

    def edge_for(self, region: str) -> Edge:
        try:
            edge = self.plane.edges[self._edge_of[region]]
        except KeyError:
            raise InvalidArgumentError(f"no edge serves region {region!r}") from None
        self._settle(edge)
        return edge

    def _settle(self, edge: Edge, bound: tuple[float, int, int] | None = None) -> None:
        """Deliver the queue-vector broadcasts that reached ``edge`` before the event being
        processed (or before ``bound``), in (time, seq) order.

        Broadcasts are not engine events: most arrive at an edge nobody reads before the next
        one (8 edges x 7 regions every 100 ms), so each is filed (in the engine:
        ``SimEngine.post_broadcast``, ``settle_broadcasts``) under the sequence key its
        delivery event would have had and applied when something next reads or folds a remote
        worker's estimate at that edge (:meth:`edge_for`, which routes; a response, which folds
        its vector). A broadcast touches only remote workers' estimates, and the accesses that
        skip this (live readings, piggybacked and broadcast vectors sent, migrations, patches)
        only own-region workers or views, so the edge is in exactly the state the
        event-per-broadcast clock gave it wherever a decision reads it."""
        self._eng().settle_broadcasts(self._edge_number[edge.region], bound)

    def _settle_all(self, bound: tuple[float, int, int] | None = None) -> None:
        for edge in self.plane.edges.values():
            self._settle(edge, bound)

    @property
    def caches(self) -> dict[str, PrefixCache]:
        """Every worker's emulated prefix cache, by worker id (for inspection after a run; the
        engine holds their blocks while it runs)."""
        return {w: x.cache for w, x in self._workers.items()}

    @property
    def agents(self) -> dict[str, WorkerAgent]:
        """Every indexed worker's agent, by worker id (for inspection; a scheme that does not
        use the index runs none)."""
        return {w: x.agent for w, x in self._workers.items() if x.agent is not None}

    def namespace(self, request: Request) -> Namespace:
        return self._ns_of.get(request.namespace, self._ns)

    def salt(self, request: Request) -> str | None:
        return request.namespace if self._salted else None

    def _eng(self) -> SimEngine:
        if self._engine is None:
            raise RuntimeError("the simulator's engine is not built yet (a scheme may read the fleet from its first choose on)")
        return self._engine

    def queued_ms(self, worker: str, now_ms: float) -> float:
        return float(self._eng().queued_ms(self._index[worker], now_ms))

    def dispatched_ms(self, worker: str, origin: str | None = None) -> float:
        if origin is None:
            return float(self._eng().dispatched_ms(self._index[worker]))
        r = self._region_index.get(origin)
        return 0.0 if r is None else float(self._eng().dispatched_ms(self._index[worker], r))

    def rng(self) -> Any:
        """The run's generator (``integers(n)``), shared with the engine's own draws."""
        if self._run_rng is None:
            self._eng()
        assert self._run_rng is not None
        return self._run_rng

    def cached(self, worker: str, tokens: npt.NDArray[np.uint32], salt: str | None = None) -> tuple[int, int]:
        if not self._engine_holds_caches:  # after the run, the blocks are back in the caches
            return self._workers[worker].cache.lookup(tokens, salt)
        seed = 0 if salt is None else self._salt_seed.get(salt)
        if seed is None:  # a salt no request of the run carries: no block of it is cached
            seed = salt_seed(salt) if salt is not None else 0
        v, d = self._eng().cached(self._index[worker], tokens, seed)
        return int(v), int(d)

    def waiting(self, worker: str) -> int:
        return int(self._eng().waiting(self._index[worker]))

    def pending(self, worker: str) -> int:
        return int(self._eng().pending(self._index[worker]))

    def worker_index(self, worker: str) -> int:
        try:
            return self._index[worker]
        except KeyError:
            raise InvalidArgumentError(f"unknown worker {worker!r}") from None

    def region_index(self, region: str) -> int:
        try:
            return self._region_index[region]
        except KeyError:
            raise InvalidArgumentError(f"unknown region {region!r}") from None

    def chord_lookup(self, origin: str, key: int) -> tuple[str, int, float]:
        """The engine's Chord lookup of ``key`` from ``origin`` (the chord scheme's runs only)."""
        w, hops, delay = self._eng().chord_lookup(self.region_index(origin), key)
        return self._by_index[w].spec.id, int(hops), float(delay)

    @property
    def handoffs(self) -> int:
        """Forwarded requests the destination region's edge moved to another of its workers."""
        return int(self._eng().handoffs)

    @property
    def decoded(self) -> dict[str, int]:
        """Tokens each worker decoded after the first (its continuous batch's work)."""
        e = self._eng()
        return {w: int(e.decoded(x.index)) for w, x in self._workers.items()}

    @property
    def events_processed(self) -> int:
        """Engine events the run's clock has processed (a measure of its work per request)."""
        return int(self._eng().events_processed)

    @property
    def engine_memo_bytes(self) -> int:
        """Bytes of the engine's memo of prompt runs (block names, partial sums; bounded at 32 MB
        each), for a memory account: they are Rust's, out of tracemalloc's sight."""
        return int(self._eng().memo_bytes)

    # ---- the clock -------------------------------------------------------------------------------

    @property
    def now_ms(self) -> float:
        return float(self._eng().now)

    def _at(self, t: float, action: Callable[[], None]) -> None:
        self._eng().at(t, action)

    def run(self, progress: Callable[[int, int], None] | None = None) -> Summary:
        """Replay the workload to the last completion and summarise it. ``progress(done, total)``
        is called as requests complete (about every hundredth of the workload, and at the end),
        for a driver to show how far a long run has got."""
        if self._ran:
            raise RuntimeError("a Simulator runs once")
        self._ran = True
        self._progress = progress
        engine = self._eng()
        engine.start()
        if self._indexed and len(self._requests):
            first = self._requests.arrival_ms.item(0)
            engine.at(first, self._tick)
            # Edges read their own region's queues live: every worker starts reported idle
            # (a worker never reported is "unknown", never a migration target).
            t0 = first / 1e3
            for edge in self.plane.edges.values():
                for w in self.topology.workers_in(edge.region):
                    if w.role != "decode" and w.id in edge.workers:
                        edge.set_local_queue(w.id, 0.0, t0)
        driver = SimpleNamespace(
            choose=self._choose,
            handoff=self._handoff if self._hand is not None else None,
            events=self._events,
            respond=self._respond,
            response=self._response,
            queue=self._queue,
            progress=self._report if progress is not None else None,
        )
        # The cyclic garbage collector is off while the clock runs (collector_paused: a run
        # builds millions of long-lived objects, the agents' block trees, and no cycles), and
        # while the records are built (a collection among those objects per few hundred new
        # records was most of that step).
        with collector_paused():
            try:
                engine.run(driver)
                self._settle_all((float("inf"), 0, 0))  # broadcasts still in flight when the last request completed
                n = len(self._requests)
                if engine.completed != n:
                    raise RuntimeError(f"{n - engine.completed} requests never completed")
                ids = [w for w, x in self._workers.items() if x.spec.role != "decode"]  # prefill servers
                busy = [engine.busy(self._index[w]) for w in ids]
                summary = summarize(self._scheme.name, self.topology.name, self._records(), ids, busy, window_ms=self.config.window_ms)
                kv_waits = int(engine.kv_waits)
            finally:
                engine.return_caches([x.cache._core for x in self._by_index])
                self._engine_holds_caches = False
        # Cache churn, for telling a run that reached steady state from one that never filled.
        stats = [x.cache.stats for x in self._by_index]
        drawn = mid_rate(self._requests.arrival_ms) if not self.config.closed_loop else 0.0
        return dataclasses.replace(
            summary, demoted_blocks=sum(c.demoted_blocks for c in stats), evicted_blocks=sum(c.evicted_blocks for c in stats), kv_waits=kv_waits, drawn_mid_req_s=drawn
        )

    def _records(self) -> RecordTable:
        """The engine's record columns as a :class:`RecordTable` (no object per request)."""
        order, worker, ttft, e2e, queue, vram, dram, claimed = self._eng().records()
        reqs = self._requests
        regions = list(self.topology.region_names)
        workers = [x.spec.id for x in self._by_index]
        names = regions + workers
        nr = len(regions)
        ri = self._region_index
        region = np.array([ri.get(r, -1) for r in reqs.region_names] or [0], dtype=np.int32)[reqs.region_codes]
        wregion = np.array([ri[x.spec.region] for x in self._by_index], dtype=np.int32)
        w = worker.astype(np.int64)
        cols: dict[str, npt.NDArray[Any]] = {
            "id": reqs.ids.copy(),
            "region": region,
            "worker": (w + nr).astype(np.int32),
            "worker_region": wregion[w],
            "arrival_ms": self._eng().issued(),  # a closed loop's requests arrive when issued
            "ttft_ms": ttft,
            "e2e_ms": e2e,
            "queue_ms": queue,
            "input_tokens": reqs.input_length.copy(),
            "output_tokens": reqs.output_length.copy(),
            "vram_hit": vram.astype(np.int64),
            "dram_hit": dram.astype(np.int64),
            "claimed": claimed.astype(np.int64),
        }
        return RecordTable(cols, names)

    # ---- the engine's calls ------------------------------------------------------------------------

    def _report(self, done: int) -> None:
        if self._progress is not None:
            self._progress(int(done), len(self._requests))

    def _request(self, i: int) -> Request:
        """Request ``i`` (in arrival order) as a scheme reads it. Built a chunk at a time, as
        arrivals reach it (a third of the cost of one at a time), the last few chunks kept for
        the hand-offs that follow their routes."""
        c = i >> _ROW_CHUNK_BITS
        rows = self._rows.get(c)
        if rows is None:
            lo = c << _ROW_CHUNK_BITS
            rows = self._rows[c] = self._requests.rows(lo, min(len(self._requests), lo + (1 << _ROW_CHUNK_BITS)))
            if len(self._rows) > _ROW_CHUNKS_KEPT:
                del self._rows[min(self._rows)]
        return rows[i - (c << _ROW_CHUNK_BITS)]

    def _choose(self, req: int, tokens: npt.NDArray[np.uint32]) -> tuple[int, int, float]:
        choice = self._scheme.choose(self._request(req), tokens, self._engine.now)  # type: ignore[attr-defined,union-attr]
        w = self._index.get(choice.worker)
        if w is None:
            raise InvalidArgumentError(f"scheme {self._scheme.name!r} chose unknown worker {choice.worker!r}")
        return w, int(choice.claimed), float(choice.delay_ms)

    def _handoff(self, job: int, req: int, tokens: npt.NDArray[np.uint32], worker: int, region: int) -> tuple[int, int] | None:
        """The request reaches its worker's region: a scheme with a hand-off (KVCompass: the
        region's own edge re-places what another edge forwarded) may move it to another worker
        there, one in-region way further; the engine moves the in-flight accounting with it."""
        assert self._hand is not None
        w = self._by_index[worker]
        r = self._request(req)
        c = self._hand(r, tokens, w.spec.id, w.spec.region, self._engine.now)  # type: ignore[union-attr]
        if c is None:
            return None
        w2 = self._workers.get(c.worker)
        if w2 is None or w2.spec.region != w.spec.region:
            raise InvalidArgumentError(f"scheme {self._scheme.name!r} handed request {r.id} to {c.worker!r}, not a worker of {w.spec.region!r}")
        return w2.index, int(c.claimed)

    def _events(self, worker: int, events: CacheEvents) -> None:
        self._publish_events(self._by_index[worker], events)

    def _respond(self, worker: int, edge_region: int, claimed: int, reused: int, t: float) -> None:
        """The first chunk leaves a worker for another region's edge, and the worker's own region
        runs an edge: that edge piggybacks its own-region queue vector, read as the chunk leaves;
        the chunk reaches its edge at ``t``."""
        w = self._by_index[worker]
        edge = self.plane.edges[self._region_names[edge_region]]
        vec = self.plane.edges[w.spec.region].piggyback_vector(edge.region, self._eng().now / 1e3)
        self._eng().at(t, partial(self._on_response, edge, w.spec.id, claimed, reused, vec, t / 1e3))

    def _response(self, worker: int, edge_region: int, claimed: int, reused: int, vector: npt.NDArray[np.float64] | None) -> None:
        """The first chunk reaches its edge now (the engine delivers it): the reuse report and,
        from a region without an edge, that region's queue vector as it stood when it left."""
        w = self._by_index[worker]
        vec = None if vector is None else dict(zip(self._region_workers[w.spec.region], vector.tolist()))
        self._on_response(self.plane.edges[self._region_names[edge_region]], w.spec.id, claimed, reused, vec, self._eng().now / 1e3)

    def _on_response(self, edge: Edge, worker: str, claimed: int, reused: int, vector: dict[str, float] | None, now: float) -> None:
        self._settle(edge)
        edge.on_response(worker, claimed, reused, vector, now)

    def _queue(self, worker: int, queued_ms: float) -> None:
        w = self._by_index[worker]
        edge = self.plane.edges[w.spec.region]
        edge.set_local_queue(w.spec.id, queued_ms, self._eng().now / 1e3)  # own region: no broadcast touches it

    def _ingest(self, w: _Worker, batches: Sequence[KeyOpBatch]) -> None:
        assert w.agent is not None
        for b in batches:
            try:
                self.plane.ingest(b, sender=w.spec.id)
            except AgentSequenceError:
                for again in w.agent.on_rejected(b.shard):
                    self.plane.ingest(again, sender=w.spec.id)

    def _publish_events(self, w: _Worker, events: CacheEvents) -> None:
        """The worker's KV events: to a scheme that follows them and through its agent."""
        if not len(events):
            return
        now = self._eng().now
        if self._on_kv is not None:
            self._on_kv(w.spec.id, w.cache.events_from_core(events.raw(), token_arrays=True), now)
        if w.agent is not None:
            # The events go to the agent as a decoded message (the emulated engine is in this
            # process), kept in Rust up to the agent's forest; the wire format's round trip is
            # the services' and their tests'.
            seq = w.engine_seq
            w.engine_seq += 1
            batches = w.agent.on_batch(EngineBatch(seq, now / 1e3, (), digest=seq.to_bytes(8, "big"), cache_events=events, salts=self._salt_tuple)).batches
            if batches:
                self._eng().at(now + self.config.event_delay_ms, partial(self._ingest, w, batches))

    def _tick(self) -> None:
        """Patch propagation and due queue broadcasts, every ``patch_interval_ms`` while work remains."""
        engine = self._eng()
        now = engine.now
        cfg = self.config
        # No broadcast is delivered here: nothing the tick does reads a remote worker's estimate
        # (patches touch views; live readings, broadcasts and migrations only the own region's
        # workers, which broadcasts never touch), so they wait for the next access that does.
        if cfg.patch_loss or cfg.patch_delay_ms:
            batches = self.plane.flush()
            if batches or self.plane.unsettled:
                lose = self._lose if cfg.patch_loss else None
                engine.at(now + cfg.patch_delay_ms, partial(self._deliver, batches, lose))
        else:
            self.plane.propagate()
        # Own-region queues are read live (a real edge polls its workers): a running prefill's
        # remainder shrinks between events, so the busy workers are re-read every tick.
        # (Edge.set_local_queues of each busy region's workers, in one call: set_live_sinks.)
        engine.poll_live(now / 1e3)
        t_s = now / 1e3
        if self._migrate:
            for edge in self._live_edges:
                if edge.migrations_pending:
                    for a in edge.migration_actions(t_s):
                        self._start_migration(a)
        # An edge's next broadcast time moves only when it broadcasts, so the earliest of them
        # (kept here) skips the scan on the nine ticks in ten that precede it.
        # The broadcasts' phase allows a skip from here (see _next_tick): every edge broadcast
        # to every target this tick, or no edge broadcasts at all (a lone region's edge).
        broadcast = self._next_broadcast_s == math.inf
        if t_s + 1e-9 >= self._next_broadcast_s:  # the schedule's own float slack
            num = self._edge_number
            for edge in self._live_edges:
                if t_s + 1e-9 < edge.next_broadcast_s:
                    continue
                targets = edge.broadcast_targets_due(t_s)
                if targets:
                    engine.post_broadcast(num[edge.region], [num[r] for r in targets if r in num], edge.local_values())
            self._next_broadcast_s = min((e.next_broadcast_s for e in self._live_edges), default=math.inf)
            broadcast = self._next_broadcast_s >= t_s + cfg.params.broadcast_period_s - 1e-9
        if engine.completed < len(self._requests):
            engine.at(self._next_tick(engine, now, broadcast), self._tick)

    def _next_tick(self, engine: SimEngine, now: float, broadcast: bool) -> float:
        """The next tick's time: ``patch_interval_ms`` on, or, once the fleet has been quiet for
        ``IDLE_SETTLE_MS`` (nothing in flight, no patch unsettled, no migration pending), a
        whole number of broadcast periods on, to ``IDLE_RESUME_MS`` before the next arrival.

        Why this is the same run: a quiet fleet's ticks change nothing but the remote queue
        estimates, which every broadcast halves (each worker's queue is 0, and the fold weighs a
        sample by w = 0.5), so after the settling time they are below 2^-500 of any queue; the
        tick grid and every edge's broadcast phase are kept (the skip is taken on a broadcast
        tick and is a multiple of the period and of the tick), and the ticks before the arrival
        run as always, so its route reads freshly broadcast estimates. What differs: estimates
        of order 2^-500 ms and the count of engine events. With WAN jitter nothing is skipped:
        every broadcast draws its way from the stream the requests draw theirs from, so the
        skipped ones would shift every later request's draws (found in review).
        ``tests/test_sim_idle.py`` checks that skipped and unskipped runs print the same
        figures."""
        cfg = self.config
        step = cfg.patch_interval_ms
        quiet_until = engine.quiet_until() if cfg.skip_idle and not cfg.wan_jitter else None
        if quiet_until is None or self.plane.unsettled or any(e.migrations_pending for e in self._live_edges):
            self._quiet_since = math.inf
            return now + step
        self._quiet_since = min(self._quiet_since, now)
        period = self._skip_grid
        if not broadcast or period is None or now - self._quiet_since < IDLE_SETTLE_MS or not math.isfinite(quiet_until):
            return now + step
        k = math.floor((quiet_until - IDLE_RESUME_MS - now) / period)
        return now + k * period if k >= 1 else now + step

    def _deliver(self, batches: list[PatchBatch], lose: Callable[[str, PatchBatch], bool] | None) -> None:
        self.plane.deliver(batches, lose, repair=False)  # views only: no broadcast needs delivering first

    def _lose(self, region: str, batch: PatchBatch) -> bool:
        return bool(self._eng().fault_random() < self.config.patch_loss)

    def _start_migration(self, a: MigrationAction) -> None:
        target = self._workers.get(a.target)
        if target is None:
            raise InvalidArgumentError(f"migration toward unknown worker {a.target!r}")
        engine = self._eng()
        tokens = np.ascontiguousarray(a.tokens[: a.length], dtype=np.uint32)
        self.migrations[a.kind] += 1
        self.migration_log.append(a)
        plan = self.plane.plan
        if a.kind == "copy":
            ms = plan.rtt_ms(a.source_region, a.target_region) / 2 + engine.transfer_ms(len(tokens))
            salt = self._tenant_of.get(a.namespace) if self._salted else None
            engine.at(engine.now + ms, partial(self._land_copy, target, tokens, a.target_tier, salt))
            return
        tenant = self._tenant_of.get(a.namespace, self._ns.tenant)
        sid, seed = (self._salt_id[tenant], self._salt_seed[tenant]) if self._salted else (0, 0)
        t = engine.now + plan.rtt_ms(a.target_region, a.target_region) / 2
        engine.migrate_recompute(t, target.index, tokens, int(a.target_tier), self._region_index[a.target_region], sid, seed)

    def _land_copy(self, w: _Worker, tokens: npt.NDArray[np.uint32], tier: Tier, salt: str | None) -> None:
        if tier not in (Tier.VRAM, Tier.DRAM):
            raise ValueError(f"copy_in tier must be Tier.VRAM or Tier.DRAM, got {tier!r}")
        sid, seed = (self._salt_id[salt], self._salt_seed[salt]) if salt is not None else (0, 0)
        self._publish_events(w, self._eng().copy_in(w.index, tokens, int(tier), sid, seed))


def simulate(
    topology: str | Topology,
    requests: Sequence[Request],
    scheme: str | Callable[[Fleet], Scheme] = "kvcompass",
    *,
    seed: int = 0,
    cost: CostModel | None = None,
    model: str = "llama-3.1-8b",
    event_delay_ms: float = 5.0,
    patch_interval_ms: float = 10.0,
    window_ms: float = 1000.0,
    policy: Policy = "lru",
    params: EdgeParams | None = None,
    wan_jitter: float = 0.0,
    patch_loss: float = 0.0,
    patch_delay_ms: float = 0.0,
    gpu_sharing: GpuSharing = "chunked",
    max_batched_tokens: int = 2048,
    closed_loop: int = 0,
    follow_ups: FollowUps = "after-parent",
    kv_pool: KvPool = "shared",
    progress: Callable[[int, int], None] | None = None,
) -> Summary:
    """Run ``requests`` through ``topology`` (a built-in name, a TOML path, or a Topology) with
    ``scheme`` (a name from :data:`kvcompass.sim.schemes.SCHEMES` or a factory) and summarise;
    ``progress`` as in :meth:`Simulator.run`."""
    topo = topology if isinstance(topology, Topology) else load_topology(topology)
    config = SimConfig(
        seed=seed,
        cost=cost if cost is not None else CostModel(),
        model=model,
        event_delay_ms=event_delay_ms,
        patch_interval_ms=patch_interval_ms,
        window_ms=window_ms,
        policy=policy,
        params=params if params is not None else EdgeParams(),
        wan_jitter=wan_jitter,
        patch_loss=patch_loss,
        patch_delay_ms=patch_delay_ms,
        gpu_sharing=gpu_sharing,
        max_batched_tokens=max_batched_tokens,
        closed_loop=closed_loop,
        follow_ups=follow_ups,
        kv_pool=kv_pool,
    )
    return Simulator(topo, requests, scheme, config).run(progress)
