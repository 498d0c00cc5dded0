"""The event-driven simulator (paper section 4, "Simulator"): the discovery plane's own objects
driven by a virtual clock, with modelled workers and WAN.

Everything the services run is the real thing here: a :class:`~kvcompass.discovery.plane.LocalPlane`
(every maintenance unit and every edge), one :class:`~kvcompass.agent.WorkerAgent` per worker
fed the vLLM wire frames its :class:`~kvcompass.sim.cache.PrefixCache` publishes, and the edges'
routes, beliefs and queue estimates. Only the workers' time and the network are modelled.

**Clock.** A heap of ``(time_ms, seq, action)``; ``seq`` orders equal times by scheduling
order, so a run is a pure function of its inputs and seed. There is no wall clock. The edge
API takes seconds: every ``now`` handed to it is ``time_ms / 1000``.

**A request's life.**

1. Arrival at the edge of its region (the nearest edge region by RTT if its region runs none).
   The scheme picks a worker (:mod:`kvcompass.sim.schemes`); a scheme whose lookup leaves the
   edge (a central coordinator, DHT hops) returns that lookup's time as ``Choice.delay_ms``,
   which passes before the request is forwarded.
2. Forward over the WAN: one way is half the topology's RTT between the two regions (the
   in-region RTT when they are the same).
3. Prompts are prefilled in FIFO order. At prefill start ``(vram_hit, dram_hit) =
   cache.lookup(tokens)`` and the prefill computes ``cost.prefill_ms(uncached) +
   cost.reload_ms(dram_hit)``, in steps it shares with the decode batch (see GPU sharing
   below). At prefill end ``cache.admit(tokens)``; its KV events are
   encoded as a vLLM PUB message, handed to the worker's agent, and the key-op batches reach
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
sequence joins that instance's continuous batch; its last token returns to the edge from the
decode instance's region. The first token is the prefill worker's, as before.

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
import gc
import heapq
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Literal

import numpy as np
import numpy.typing as npt

from kvcompass.agent import WorkerAgent, encode_batch
from kvcompass.agent.events import Event
from kvcompass.discovery.edge import Edge
from kvcompass.discovery.layout import WorkerSpec
from kvcompass.discovery.maintenance import PatchBatch
from kvcompass.discovery.migration import MigrationAction
from kvcompass.discovery.ops import KeyOpBatch
from kvcompass.discovery.params import EdgeParams
from kvcompass.discovery.plane import LocalPlane
from kvcompass.discovery.topology import Topology, load_topology
from kvcompass.errors import AgentSequenceError, InvalidArgumentError
from kvcompass.index import Namespace, Tier
from kvcompass.sim.cache import Policy, PrefixCache
from kvcompass.sim.costs import CostModel
from kvcompass.sim.metrics import RequestRecord, Summary, summarize
from kvcompass.sim.schemes import Choice, Fleet, Scheme, make_scheme, scheme_params
from kvcompass.sim.workload import ChainBlocks, Request

__all__ = ["DEFAULT_DRAM_TOKENS", "DEFAULT_VRAM_TOKENS", "GPU_SHARING", "GpuSharing", "SimConfig", "Simulator", "simulate"]

GpuSharing = Literal["chunked", "lanes"]
GPU_SHARING: tuple[GpuSharing, ...] = ("chunked", "lanes")

# Used when a topology leaves a worker's capacities out (0): the testbed's figures (about 12 GiB
# of KV at 128 KiB/token in VRAM, 128 GiB of host DRAM; kvcompass/topologies/testbed-14x3.toml).
DEFAULT_VRAM_TOKENS = 98304
DEFAULT_DRAM_TOKENS = 1048576


@dataclass(frozen=True, slots=True)
class SimConfig:
    """Knobs of one run besides the topology, workload and scheme."""

    seed: int = 0
    cost: CostModel = field(default_factory=CostModel)
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


@dataclass(slots=True, eq=False)
class _Job:
    request: Request
    tokens: npt.NDArray[np.uint32]
    choice: Choice
    edge_region: str
    one_way_ms: float
    at_worker_ms: float = 0.0
    estimate_ms: float = 0.0
    start_ms: float = 0.0
    vram_hit: int = 0
    dram_hit: int = 0
    ttft_ms: float = 0.0
    dispatched_ms: float = 0.0
    remaining: int = 0
    context: int = 0
    migration: MigrationAction | None = None
    back_ms: float = -1.0  # last token's way back to the edge when decode ran elsewhere
    left: int = 0  # chunked sharing: prompt tokens still to compute
    extra_ms: float = 0.0  # chunked sharing: fixed cost and DRAM reload, paid with the first chunk


class _Worker:
    def __init__(self, spec: WorkerSpec, index: int, cache: PrefixCache, agent: WorkerAgent | None) -> None:
        self.spec = spec
        self.index = index
        self.cache = cache
        self.agent = agent
        self.engine_seq = 0
        self.waiting: deque[_Job] = deque()
        self.waiting_ms = 0.0
        # Estimated prefill (ms) of requests on their way here, by the region they came from.
        self.dispatched: dict[str, float] = {}
        self.current: _Job | None = None
        self.busy_until = 0.0
        self.busy: list[tuple[float, float]] = []
        self.running: list[_Job] = []
        self.joining: list[_Job] = []
        self.stepping = False
        # The decode segment in flight (see Simulator._step): its first step's start, batch size,
        # context tokens at that start, fixed part of a step, steps until it ends, and a
        # generation that tells its scheduled end from one a joining sequence superseded.
        self.seg_start = 0.0
        self.seg_batch = 0
        self.seg_context = 0
        self.seg_linear = 0.0
        self.seg_steps = 0
        self.seg_gen = 0
        self.seg_mixed = False  # the step in flight carries a prefill chunk (not cut)
        self.seg_cut = False  # the decode segment in flight was cut already
        self.step_end = 0.0  # chunked sharing: end of the step in flight
        self.rest_ms = 0.0  # chunked sharing: estimated prefill left after the step in flight
        self.busy_job: _Job | None = None  # chunked sharing: the prompt the last busy interval is


_SEGMENT_STEPS = 64
"""Most decode steps one event covers (Simulator._step)."""


def _capacity(tokens: int, block: int, default: int) -> int:
    n = (tokens or default) // block * block
    return max(n, block)


class Simulator:
    """One run: build with the deployment and workload, then :meth:`run` once."""

    def __init__(self, topology: Topology, requests: Sequence[Request], scheme: str | Callable[[Fleet], Scheme], config: SimConfig = SimConfig()) -> None:
        namespaces = sorted({r.namespace for r in requests}) or ["public"]
        self.topology = topology
        self.config = config
        self._cost = config.cost
        self._requests = sorted(requests, key=lambda r: (r.arrival_ms, r.id))
        self._ns = Namespace(config.model, namespaces[0])
        # Several namespaces (tenants): each is a vLLM cache salt, so the emulated caches keep
        # tenants apart and the agents key each tenant's chains in its own namespace.
        self._ns_of = {name: Namespace(config.model, name) for name in namespaces}
        self._salted = len(namespaces) > 1
        self._tenant_of = {ns.digest: name for name, ns in self._ns_of.items()}
        self._rng = np.random.default_rng(config.seed)
        # Faults draw from their own stream, so turning one on leaves every other draw as it was.
        self._faults = np.random.default_rng([config.seed, 0x5EE5])
        # An ablation scheme runs the plane with its switch flipped (schemes.scheme_params).
        params = scheme_params(scheme, config.params)
        if topology.disaggregated and not params.disaggregated:
            params = dataclasses.replace(params, disaggregated=True)
        self.plane = LocalPlane(topology, capacity=config.plane_capacity, params=params, seed=config.seed)
        self._scheme = make_scheme(scheme, self) if isinstance(scheme, str) else scheme(self)
        self._indexed = self._scheme.uses_index
        # A scheme that follows the workers' KV events itself (a Dynamo-style router) gets every
        # admit's events at prefill end.
        self._on_kv: Callable[[str, Sequence[Event], float], None] | None = getattr(self._scheme, "on_kv_events", None)
        plan, block = self.plane.plan, topology.block_size
        self._workers: dict[str, _Worker] = {}
        for i, spec in enumerate(topology.workers):
            cache = PrefixCache(
                block,
                _capacity(spec.vram_tokens, block, DEFAULT_VRAM_TOKENS),
                _capacity(spec.dram_tokens, block, DEFAULT_DRAM_TOKENS) if spec.dram_tokens or not spec.vram_tokens else 0,
                config.policy,
                hash_seed=i,
                # Events are built only for someone to read them: the worker's agent or a scheme
                # that follows KV events (the others, the Oracle say, never look).
                publish=(self._indexed and spec.role != "decode") or self._on_kv is not None,
            )
            indexed = self._indexed and spec.role != "decode"
            agent = (
                WorkerAgent(spec.id, self._ns, plan.registration(spec.region), self.plane.layout.shards, block_size=block, salts=self._ns_of if self._salted else None)
                if indexed
                else None
            )
            self._workers[spec.id] = _Worker(spec, i, cache, agent)
        edge_regions = plan.edge_regions
        self._edge_of = {r: min(edge_regions, key=lambda e: (e != r, plan.rtt_ms(r, e))) for r in topology.region_names} if edge_regions else {}
        self._heap: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = 0
        self._now = 0.0
        self._records: list[RequestRecord] = []
        self._ran = False
        self._progress: Callable[[int, int], None] | None = None
        self._progress_every = 1
        self._migrate = self._indexed and params.migration
        self._chunked = config.gpu_sharing == "chunked"
        # Decode instances per region, and for each region where its prefill hands off.
        decoders = {r: [self._workers[w.id] for w in topology.workers_in(r) if w.role == "decode"] for r in topology.region_names}
        with_decode = [r for r in topology.region_names if decoders[r]]
        self._decoders: dict[str, list[_Worker]] = {}
        if topology.disaggregated:
            for r in topology.region_names:
                near = min(with_decode, key=lambda d: (d != r, topology.rtt_ms(r, d), topology.region_index(d)))
                self._decoders[r] = decoders[near]
        self.migrations: dict[str, int] = {"copy": 0, "recompute": 0}
        """Migration actions carried out, by kind."""
        self.migration_log: list[MigrationAction] = []
        self.handoffs = 0
        """Forwarded requests the destination region's edge moved to another of its workers."""
        self.decoded: dict[str, int] = dict.fromkeys(self._workers, 0)
        """Tokens each worker decoded after the first (its continuous batch's work)."""

    # ---- the Fleet a scheme reads ----------------------------------------------------------------

    def edge_for(self, region: str) -> Edge:
        try:
            return self.plane.edges[self._edge_of[region]]
        except KeyError:
            raise InvalidArgumentError(f"no edge serves region {region!r}") from None

    @property
    def caches(self) -> dict[str, PrefixCache]:
        """Every worker's emulated prefix cache, by worker id (for inspection after a run)."""
        return {w: x.cache for w, x in self._workers.items()}

    def namespace(self, request: Request) -> Namespace:
        return self._ns_of.get(request.namespace, self._ns)

    def salt(self, request: Request) -> str | None:
        return request.namespace if self._salted else None

    def queued_ms(self, worker: str, now_ms: float) -> float:
        w = self._workers[worker]
        if w.current is None:
            return w.waiting_ms
        if self._chunked:
            return w.waiting_ms + max(0.0, w.step_end - now_ms) + w.rest_ms
        return w.waiting_ms + max(0.0, w.busy_until - now_ms)

    def dispatched_ms(self, worker: str, origin: str | None = None) -> float:
        d = self._workers[worker].dispatched
        return sum(d.values()) if origin is None else d.get(origin, 0.0)

    def rng(self) -> np.random.Generator:
        return self._rng

    def cached(self, worker: str, tokens: npt.NDArray[np.uint32], salt: str | None = None) -> tuple[int, int]:
        return self._workers[worker].cache.lookup(tokens, salt)

    def waiting(self, worker: str) -> int:
        return len(self._workers[worker].waiting)

    # ---- the clock -------------------------------------------------------------------------------

    @property
    def now_ms(self) -> float:
        return self._now

    def _at(self, t: float, action: Callable[[], None]) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (t, self._seq, action))

    def run(self, progress: Callable[[int, int], None] | None = None) -> Summary:
        """Replay the workload to the last completion and summarise it. ``progress(done, total)``
        is called as requests complete (about every hundredth of the workload, and at the end),
        for a driver to show how far a long run has got."""
        if self._ran:
            raise RuntimeError("a Simulator runs once")
        self._ran = True
        self._progress = progress
        self._progress_every = max(1, len(self._requests) // 100)
        for r in self._requests:
            self._at(r.arrival_ms, partial(self._arrive, r))
        if self._indexed and self._requests:
            self._at(self._requests[0].arrival_ms, self._tick)
            # Edges read their own region's queues live: every worker starts reported idle
            # (a worker never reported is "unknown", never a migration target).
            t0 = self._requests[0].arrival_ms / 1e3
            for edge in self.plane.edges.values():
                for w in self.topology.workers_in(edge.region):
                    if w.role != "decode" and w.id in edge.workers:
                        edge.set_local_queue(w.id, 0.0, t0)
        # The cyclic garbage collector is off while the clock runs: a run builds millions of
        # long-lived objects (the agents' block trees, the caches' events) and creates no
        # reference cycles (a test checks that a run leaves none), so every collection was a
        # full traversal finding nothing, a third of a conversation-trace run. Reference
        # counting still frees everything; the collector's state is restored afterwards.
        collecting = gc.isenabled()
        gc.disable()
        try:
            while self._heap:
                t, _, action = heapq.heappop(self._heap)
                self._now = t
                action()
        finally:
            if collecting:
                gc.enable()
        if len(self._records) != len(self._requests):
            raise RuntimeError(f"{len(self._requests) - len(self._records)} requests never completed")
        ids = [w for w, x in self._workers.items() if x.spec.role != "decode"]  # prefill servers
        busy = [self._workers[w].busy for w in ids]
        return summarize(self._scheme.name, self.topology.name, self._records, ids, busy, window_ms=self.config.window_ms)

    def _tick(self) -> None:
        """Patch propagation and due queue broadcasts, every ``patch_interval_ms`` while work remains."""
        now = self._now
        cfg = self.config
        if cfg.patch_loss or cfg.patch_delay_ms:
            batches = self.plane.flush()
            if batches or self.plane.unsettled:
                lose = self._lose if cfg.patch_loss else None
                self._at(now + cfg.patch_delay_ms, lambda: self._deliver(batches, lose))
        else:
            self.plane.propagate()
        # Own-region queues are read live (a real edge polls its workers): a running prefill's
        # remainder shrinks between events, so the busy workers are re-read every tick.
        for w in self._workers.values():
            if w.current is not None:
                self._publish_queue(w)
        if self._migrate:
            for edge in self.plane.edges.values():
                for a in edge.migration_actions(now / 1e3):
                    self._start_migration(a)
        for edge in self.plane.edges.values():
            for b in edge.broadcast_due(now / 1e3):
                target = self.plane.edges.get(b.target_region)
                if target is not None:
                    t = now + self._way(b.source_region, b.target_region)
                    self._at(t, partial(target.on_broadcast, b.source_region, b.vector, t / 1e3))
        if len(self._records) < len(self._requests):
            self._at(now + self.config.patch_interval_ms, self._tick)

    # ---- a request's life ------------------------------------------------------------------------

    def _arrive(self, r: Request) -> None:
        tokens = r.input_tokens()
        choice = self._scheme.choose(r, tokens, self._now)
        w = self._workers.get(choice.worker)
        if w is None:
            raise InvalidArgumentError(f"scheme {self._scheme.name!r} chose unknown worker {choice.worker!r}")
        edge_region = self._edge_of.get(r.region, r.region)
        forward = self._way(edge_region, w.spec.region)
        job = _Job(r, tokens, choice, edge_region, self._way(w.spec.region, edge_region))
        v, d = w.cache.lookup(tokens, self.salt(r))
        job.dispatched_ms = self._estimate_ms(w, r.input_length, v, d)
        w.dispatched[r.region] = w.dispatched.get(r.region, 0.0) + job.dispatched_ms
        # A scheme's lookup (a coordinator round trip, DHT hops) delays the forward.
        self._at(self._now + choice.delay_ms + forward, lambda: self._land(w, job))

    def _land(self, w: _Worker, job: _Job) -> None:
        """The request reaches the worker's region: a scheme with a hand-off (KVCompass: the
        region's own edge re-places what another edge forwarded) may move it to another worker
        there, one in-region way further; the in-flight accounting moves with it."""
        hand = getattr(self._scheme, "handoff", None)
        region = w.spec.region
        if hand is None or region == job.edge_region:
            self._enqueue(w, job)
            return
        c = hand(job.request, job.tokens, w.spec.id, region, self._now)
        if c is None:
            self._enqueue(w, job)
            return
        job.choice = dataclasses.replace(job.choice, claimed=c.claimed)
        if c.worker == w.spec.id:
            self._enqueue(w, job)
            return
        w2 = self._workers.get(c.worker)
        if w2 is None or w2.spec.region != region:
            raise InvalidArgumentError(f"scheme {self._scheme.name!r} handed request {job.request.id} to {c.worker!r}, not a worker of {region!r}")
        origin = job.request.region
        if job.dispatched_ms:
            left = w.dispatched[origin] - job.dispatched_ms
            w.dispatched[origin] = left if left > 1e-9 else 0.0
        v, d = w2.cache.lookup(job.tokens, self.salt(job.request))
        job.dispatched_ms = self._estimate_ms(w2, job.request.input_length, v, d)
        w2.dispatched[origin] = w2.dispatched.get(origin, 0.0) + job.dispatched_ms
        job.choice = dataclasses.replace(job.choice, worker=c.worker)
        self.handoffs += 1
        self._at(self._now + self._way(region, region), lambda: self._enqueue(w2, job))

    def _deliver(self, batches: list[PatchBatch], lose: Callable[[str, PatchBatch], bool] | None) -> None:
        self.plane.deliver(batches, lose, repair=False)

    def _lose(self, region: str, batch: PatchBatch) -> bool:
        return bool(self._faults.random() < self.config.patch_loss)

    def _way(self, a: str, b: str) -> float:
        """One WAN traversal from region ``a`` to ``b`` (ms), jittered when asked."""
        base = self.plane.plan.rtt_ms(a, b) / 2
        j = self.config.wan_jitter
        return base * (1.0 + j * (2.0 * self._faults.random() - 1.0)) if j else base

    def _start_migration(self, a: MigrationAction) -> None:
        target = self._workers.get(a.target)
        if target is None:
            raise InvalidArgumentError(f"migration toward unknown worker {a.target!r}")
        tokens = np.ascontiguousarray(a.tokens[: a.length], dtype=np.uint32)
        self.migrations[a.kind] += 1
        self.migration_log.append(a)
        if a.kind == "copy":
            wire = self.plane.plan.rtt_ms(a.source_region, a.target_region) / 2
            ms = wire + self._cost.kv_bytes(len(tokens)) * 8 / (self.config.transfer_gbps * 1e9) * 1e3
            salt = self._tenant_of.get(a.namespace) if self._salted else None
            self._at(self._now + ms, lambda: self._land_copy(target, tokens, a.target_tier, salt))
            return
        block = self.topology.block_size
        req = Request(-1, self._now, a.target_region, 0, self._tenant_of.get(a.namespace, self._ns.tenant), len(tokens), 0, block, -1, -1, ChainBlocks(((a.family, -(-len(tokens) // block)),)), kind="migration")
        job = _Job(req, tokens, Choice(a.target), a.target_region, 0.0, migration=a)
        self._at(self._now + self.plane.plan.rtt_ms(a.target_region, a.target_region) / 2, lambda: self._enqueue(target, job))

    def _land_copy(self, w: _Worker, tokens: npt.NDArray[np.uint32], tier: Tier, salt: str | None) -> None:
        self._publish_events(w, w.cache.copy_in(tokens, tier, self._now / 1e3, salt))

    def _publish_events(self, w: _Worker, events: Sequence[Event]) -> None:
        """The worker's KV events: to a scheme that follows them and through its agent."""
        now = self._now
        if self._on_kv is not None and events:
            self._on_kv(w.spec.id, events, now)
        if w.agent is not None and events:
            frames = encode_batch(events, w.engine_seq, ts=now / 1e3)
            w.engine_seq += 1
            batches = w.agent.on_message(frames).batches
            if batches:
                self._at(now + self.config.event_delay_ms, lambda: self._ingest(w, batches))

    def _enqueue(self, w: _Worker, job: _Job) -> None:
        job.at_worker_ms = self._now
        if job.dispatched_ms:
            origin = job.request.region
            left = w.dispatched[origin] - job.dispatched_ms
            w.dispatched[origin] = left if left > 1e-9 else 0.0
        v, d = w.cache.lookup(job.tokens, self.salt(job.request))
        job.estimate_ms = self._estimate_ms(w, job.request.input_length, v, d)
        w.waiting.append(job)
        w.waiting_ms += job.estimate_ms
        if self._chunked:
            if w.stepping:
                self._poke(w)
            else:
                self._step(w)
        elif w.current is None:
            self._start_prefill(w)
        self._publish_queue(w)

    def _prefill_ms(self, length: int, vram_hit: int, dram_hit: int) -> float:
        reused = min(length, vram_hit + dram_hit)
        return self._cost.prefill_ms(length - reused) + self._cost.reload_ms(dram_hit)

    def _estimate_ms(self, w: _Worker, length: int, vram_hit: int, dram_hit: int) -> float:
        """The worker's estimate of a prompt's prefill: its compute and reload and, with chunked
        sharing, one step of the decode batch it holds now per chunk (what a vLLM worker that
        knows its running batch can tell)."""
        ms = self._prefill_ms(length, vram_hit, dram_hit)
        if not self._chunked:
            return ms
        uncached = length - min(length, vram_hit + dram_hit)
        batch = len(w.running) + len(w.joining)
        if not uncached or not batch:
            return ms
        context = sum(j.context for j in w.running) + sum(j.context for j in w.joining)
        room = max(self.config.max_batched_tokens - batch, 1)
        return ms + -(-uncached // room) * self._cost.decode_step_ms(batch, context)

    def _start_prefill(self, w: _Worker) -> None:
        job = w.waiting.popleft()
        w.waiting_ms = max(0.0, w.waiting_ms - job.estimate_ms) if w.waiting else 0.0
        job.start_ms = self._now
        job.vram_hit, job.dram_hit = w.cache.lookup(job.tokens, self.salt(job.request))
        end = self._now + self._prefill_ms(job.request.input_length, job.vram_hit, job.dram_hit)
        w.current, w.busy_until = job, end
        w.busy.append((self._now, end))
        self._at(end, lambda: self._end_prefill(w, job))

    def _end_prefill(self, w: _Worker, job: _Job) -> None:
        now = self._now
        if job.migration is not None:  # a recompute migration: the replica, no response
            self._publish_events(w, w.cache.copy_in(job.tokens, job.migration.target_tier, now / 1e3, self.salt(job.request)))
            w.current = None
            if w.waiting:
                self._start_prefill(w)
            self._publish_queue(w)
            return
        self._publish_events(w, w.cache.admit(job.tokens, now / 1e3, self.salt(job.request)))
        job.ttft_ms = now + job.one_way_ms - job.request.arrival_ms
        if self._indexed:
            self._respond(w, job)
        w.current = None
        if w.waiting:
            self._start_prefill(w)
        self._publish_queue(w)
        self._decode(w, job)

    def _decode(self, w: _Worker, job: _Job) -> None:
        """After the first token: the rest of the output in ``w``'s continuous batch, or in a
        decode instance's of the region (disaggregated), or nothing when one token was asked."""
        now = self._now
        out = job.request.output_length
        if out <= 1:
            self._complete(job)
            return
        job.remaining, job.context = out - 1, job.request.input_length + 1
        if not self._decoders:
            self._join(w, job)
            return
        pool = self._decoders[w.spec.region]
        d = pool[int(self._rng.integers(len(pool)))] if len(pool) > 1 else pool[0]
        wire = 0.0 if d.spec.region == w.spec.region else self.plane.plan.rtt_ms(w.spec.region, d.spec.region) / 2
        job.back_ms = self._way(d.spec.region, job.edge_region)
        hand_off = wire + self._cost.kv_bytes(job.request.input_length) * 8 / (self.config.transfer_gbps * 1e9) * 1e3
        self._at(now + hand_off, lambda: self._join(d, job))

    def _join(self, w: _Worker, job: _Job) -> None:
        w.joining.append(job)
        if not w.stepping:
            self._step(w)
        else:
            self._poke(w)

    def _poke(self, w: _Worker) -> None:
        """Work arrived for the next step (a sequence to decode; with chunked sharing, a prompt):
        a decode segment in flight ends at its next step boundary."""
        if not w.seg_mixed and not w.seg_cut:
            w.seg_cut = True
            self._cut(w)

    def _respond(self, w: _Worker, job: _Job) -> None:
        """The first chunk back at the edge: reuse report and, from another region, a queue vector."""
        edge = self.plane.edges.get(job.edge_region)
        if edge is None:
            return
        vector: dict[str, float] | None = None
        region = w.spec.region
        if region != job.edge_region:
            src = self.plane.edges.get(region)
            if src is not None:
                vector = src.piggyback_vector(job.edge_region, self._now / 1e3)
            else:
                vector = {s.id: self.queued_ms(s.id, self._now) for s in self.topology.workers_in(region)}
        t = self._now + job.one_way_ms
        reused = job.vram_hit + job.dram_hit
        self._at(t, lambda: edge.on_response(w.spec.id, job.choice.claimed, reused, vector, t / 1e3))

    def _ingest(self, w: _Worker, batches: Sequence[KeyOpBatch]) -> None:
        assert w.agent is not None
        for b in batches:
            try:
                self.plane.ingest(b, sender=w.spec.id)
            except AgentSequenceError:
                for again in w.agent.on_rejected(b.shard):
                    self.plane.ingest(again, sender=w.spec.id)

    def _publish_queue(self, w: _Worker) -> None:
        if not self._indexed:
            return
        edge = self.plane.edges.get(w.spec.region)
        if edge is not None:
            edge.set_local_queue(w.spec.id, self.queued_ms(w.spec.id, self._now), self._now / 1e3)

    def _step(self, w: _Worker) -> None:
        """At a step boundary: with chunked sharing and a prompt to prefill, one mixed step
        (:meth:`_mixed_step`); otherwise a decode segment, the steps the batch runs unchanged, up
        to the step in which its first sequence finishes (at most ``_SEGMENT_STEPS``, which
        bounds what a cut recomputes). Step ``i`` of a segment takes ``decode_step_ms(B, C + i*B)``
        (every step adds a token to each context), so one event ends the whole segment; work
        that arrives meanwhile (a sequence; with chunked sharing, a prompt) cuts it at the next
        step boundary (:meth:`_cut`). The step
        boundaries are the ones step-by-step events would give, float for float."""
        w.running.extend(w.joining)
        w.joining.clear()
        if self._chunked:
            if w.current is None and w.waiting:
                self._begin_prefill(w)
            if w.current is not None:
                self._mixed_step(w, w.current)
                return
        if not w.running:
            w.stepping = False
            return
        w.stepping, w.seg_mixed, w.seg_cut = True, False, False
        cost = self._cost
        batch = len(w.running)
        context = sum(j.context for j in w.running)
        steps = min(_SEGMENT_STEPS, min(j.remaining for j in w.running))
        cost.decode_step_ms(batch, context)  # validates the counts once per segment
        linear = max(cost.decode_base_ms + cost.decode_ms_per_seq * batch, cost.decode_compute_ms_per_token * batch)
        w.seg_start, w.seg_batch, w.seg_context, w.seg_linear, w.seg_steps = self._now, batch, context, linear, steps
        w.seg_gen += 1
        self._at(self._boundary(w, steps), partial(self._end_segment, w, w.seg_gen))

    def _boundary(self, w: _Worker, steps: int) -> float:
        """The end of the segment's ``steps``-th step."""
        t, b, batch, context, linear = w.seg_start, self._cost.decode_ms_per_context_token, w.seg_batch, w.seg_context, w.seg_linear
        for i in range(steps):
            t = t + max(linear + b * (context + i * batch), 1e-9)
        return t

    def _cut(self, w: _Worker) -> None:
        """Work arrived during a decode segment: end it at the first step boundary after now."""
        t, b, batch, context, linear = w.seg_start, self._cost.decode_ms_per_context_token, w.seg_batch, w.seg_context, w.seg_linear
        now = self._now
        for i in range(w.seg_steps):
            t = t + max(linear + b * (context + i * batch), 1e-9)
            if t > now:
                if i + 1 < w.seg_steps:
                    w.seg_steps = i + 1
                    w.seg_gen += 1
                    self._at(t, partial(self._end_segment, w, w.seg_gen))
                return

    def _begin_prefill(self, w: _Worker) -> None:
        """Chunked sharing: the head of the FIFO becomes the prompt the steps carry."""
        job = w.waiting.popleft()
        w.waiting_ms = max(0.0, w.waiting_ms - job.estimate_ms) if w.waiting else 0.0
        job.start_ms = self._now
        job.vram_hit, job.dram_hit = w.cache.lookup(job.tokens, self.salt(job.request))
        length = job.request.input_length
        job.left = length - min(length, job.vram_hit + job.dram_hit)
        job.extra_ms = (self._cost.prefill_base_ms if job.left else 0.0) + self._cost.reload_ms(job.dram_hit)
        w.current = job

    def _mixed_step(self, w: _Worker, job: _Job) -> None:
        """Chunked sharing: one step of every running sequence's next token plus the next chunk of
        the prompt, as vLLM schedules them (decodes first, the prompt fills the rest of the token
        budget). Its time is the chunk's prefill plus the decode step the batch alone would take,
        so a long prompt stalls the batch and a large batch slows the prompt."""
        cost, now = self._cost, self._now
        batch = len(w.running)
        room = max(self.config.max_batched_tokens - batch, 1)
        chunk = min(job.left, room)
        compute = cost.prefill_ms_per_token * chunk + job.extra_ms
        job.extra_ms = 0.0
        decode = cost.decode_step_ms(batch, sum(j.context for j in w.running)) if batch else 0.0
        rest = job.left - chunk
        w.rest_ms = cost.prefill_ms_per_token * rest + (-(-rest // room) * decode if rest else 0.0)
        if compute > 0:
            if w.busy_job is job:  # one interval per prompt: its compute, from its first chunk on
                b, e = w.busy[-1]
                w.busy[-1] = (b, e + compute)
            else:
                w.busy.append((now, now + compute))
                w.busy_job = job
        w.stepping, w.seg_mixed, w.seg_batch = True, True, batch
        w.seg_gen += 1
        w.step_end = now + compute + decode
        self._at(w.step_end, partial(self._end_mixed, w, job, chunk))

    def _end_mixed(self, w: _Worker, job: _Job, chunk: int) -> None:
        batch = w.seg_batch
        if batch:
            self.decoded[w.spec.id] += batch
            done = False
            for j in w.running:
                j.remaining -= 1
                j.context += 1
                if j.remaining == 0:
                    self._complete(j)
                    done = True
            if done:
                w.running = [j for j in w.running if j.remaining > 0]
        job.left -= chunk
        if job.left == 0:
            w.current = None
            self._prefilled(w, job)
        self._step(w)
        self._publish_queue(w)

    def _prefilled(self, w: _Worker, job: _Job) -> None:
        """Chunked sharing: the prompt's last chunk is done: its KV is admitted (a migration's
        replica lands in its tier), the first token leaves, and the sequence decodes from the
        next step on (here, or at the decode instance of a disaggregated topology)."""
        now = self._now
        if job.migration is not None:
            self._publish_events(w, w.cache.copy_in(job.tokens, job.migration.target_tier, now / 1e3, self.salt(job.request)))
            return
        self._publish_events(w, w.cache.admit(job.tokens, now / 1e3, self.salt(job.request)))
        job.ttft_ms = now + job.one_way_ms - job.request.arrival_ms
        if self._indexed:
            self._respond(w, job)
        self._decode(w, job)

    def _end_segment(self, w: _Worker, gen: int) -> None:
        if gen != w.seg_gen:
            return  # superseded by a cut
        steps = w.seg_steps
        self.decoded[w.spec.id] += w.seg_batch * steps
        done = False
        for j in w.running:
            j.remaining -= steps
            j.context += steps
            if j.remaining == 0:
                self._complete(j)
                done = True
        if done:
            w.running = [j for j in w.running if j.remaining > 0]
        self._step(w)

    def _complete(self, job: _Job) -> None:
        r = job.request
        w = self._workers[job.choice.worker]
        e2e = self._now + (job.back_ms if job.back_ms >= 0 else job.one_way_ms) - r.arrival_ms
        self._records.append(
            RequestRecord(
                id=r.id,
                region=r.region,
                worker=w.spec.id,
                worker_region=w.spec.region,
                arrival_ms=r.arrival_ms,
                ttft_ms=job.ttft_ms,
                e2e_ms=e2e,
                queue_ms=job.start_ms - job.at_worker_ms,
                input_tokens=r.input_length,
                output_tokens=r.output_length,
                vram_hit=job.vram_hit,
                dram_hit=job.dram_hit,
                claimed=job.choice.claimed,
            )
        )
        job.tokens = np.zeros(0, dtype=np.uint32)  # a finished request keeps no tokens
        done = len(self._records)
        if self._progress is not None and (done % self._progress_every == 0 or done == len(self._requests)):
            self._progress(done, len(self._requests))


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
    )
    return Simulator(topo, requests, scheme, config).run(progress)
