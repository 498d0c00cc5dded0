"""The edge node's logic: replicated views, routing, and what it learns from responses.

One :class:`Edge` per edge node, sans-I/O: the gRPC services and the simulator drive the same
object, passing time in as ``now`` (seconds, non-decreasing) and moving bytes themselves.

* **Views.** One keyless :class:`~kvcompass.LudoView` per (table, shard), fed by
  :meth:`Edge.apply_patch`. A lost batch leaves the view *behind*: the outcome carries a
  :class:`ResyncAction` naming the view's current (epoch, seq), which is exactly what the
  maintenance unit's ``resume(table, epoch, seq)`` takes; its answer goes back through
  :meth:`Edge.apply_patch`. While any view is behind or was never bootstrapped,
  :attr:`Edge.healthy` is False (routing still works on the last consistent state).
* **Routing.** :meth:`Edge.route` runs the Rust lookup-and-score loop over every view,

      score(w) = WAN(o, w) + Tq(w) + (1 + lambda) beta_w (L - b_w m_w) + gamma b_w m_w [t_w = DRAM]

  with lambda = min(lambda_max, min_w Tq(w) / tau), then draws the winner uniformly among the
  workers within ``tie_ms`` of the best score (so edges sharing a stale estimate do not herd).
* **Hand-off** (beyond the paper; ``EdgeParams.handoff``). :meth:`Edge.handoff` is called by
  the edge of the region a request was forwarded *to*, when it arrives: that edge reads its own
  workers' queues live, re-scores the request among them and keeps the origin's choice unless
  another of its workers is better by more than the in-region hop. Remote edges all read the
  same stale vector, so an idle worker draws their work at once; this undoes such collisions.
* **Speculative entries.** The chosen worker is entered, for ``speculative_ttl_s``, as holding
  the prompt at every plan length toward its region that fits: a small private writer + view per
  logical table that the router reads as one more table with the same workers (the loop keeps
  the longest claim per worker). It covers the gap until the worker's own KV event is indexed.
* **Learning.** :meth:`Edge.on_response` folds the cache belief and any piggybacked queue vector;
  :meth:`Edge.set_local_queue`, :meth:`Edge.on_broadcast` and :meth:`Edge.broadcast_due` run the
  queue exchange (see :mod:`kvcompass.discovery.queues`).
* **Hotness and migration.** Every route that is a local miss counts toward its prefix family;
  a hot family whose triggering request satisfies the paper's rule queues a migration, and
  :meth:`Edge.migration_actions` hands out actions toward persistently idle workers (see
  :mod:`kvcompass.discovery.migration`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any, Collection, Literal, Mapping, Sequence

import numpy as np
import numpy.typing as npt

from kvcompass import _core
from kvcompass.discovery.belief import CacheBelief
from kvcompass.discovery.hotness import HotnessTracker
from kvcompass.discovery.layout import IndexLayout, WorkerSpec
from kvcompass.discovery.migration import MigrationAction, MigrationPlanner, evaluate_trigger
from kvcompass.discovery.params import EdgeParams
from kvcompass.discovery.queues import MAX_QUEUE_MS, BroadcastSchedule, QueueEstimates
from kvcompass.errors import (
    EpochChangedError,
    InvalidArgumentError,
    MalformedPatchError,
    SequenceGapError,
    StalePatchError,
    TopologyError,
    UninitialisedViewError,
    UnknownWorkerError,
    WrongTableError,
)
from kvcompass.index_types import Namespace, Tier, as_tokens
from kvcompass.records import fast_init

__all__ = [
    "Decision",
    "Edge",
    "EdgeStats",
    "PatchOutcome",
    "QueueBroadcast",
    "ResyncAction",
    "ScoreTerms",
    "unservable",
]

ResyncKind = Literal["replay", "snapshot"]
PatchStatus = Literal["applied", "stale", "gap", "snapshot_needed", "malformed", "wrong_table"]

# Speculative entries live in private tables: 16-bit fingerprints make a false claim from them
# (a never-registered prompt reading another entry's slot) ~occupancy * 2^-16 per level.
_SPEC_FP_BITS = 16
_SPEC_CAPACITY = 256
_TIERS = (Tier.ABSENT, Tier.VRAM, Tier.DRAM, Tier.ABSENT)  # 3 is reserved: the core reads it as absent


@dataclass(frozen=True, slots=True)
class ResyncAction:
    """A (table, shard) view needs repair: ask the maintenance unit of ``shard`` for
    ``resume(table, epoch, seq)`` and feed every batch it returns to :meth:`Edge.apply_patch`.

    ``(epoch, seq)`` is the view's current position: the last batch it applied ((0, 0) if it
    was never bootstrapped). ``kind`` says what the edge expects back: ``replay`` (the batches
    after ``seq`` of that epoch) or ``snapshot`` (the epoch changed or the view is empty); the
    unit may answer a replay with a snapshot when its log no longer reaches back, which is fine.
    """

    table: int
    shard: int
    kind: ResyncKind
    epoch: int
    seq: int


@dataclass(frozen=True, slots=True)
class PatchOutcome:
    """What :meth:`Edge.apply_patch` did with one batch.

    ``applied``: the view advanced (``snapshot`` if the batch was one). ``stale``: already
    applied, dropped. ``gap``/``snapshot_needed``: refused, the view is behind; ``resync`` is
    set the first time (later refusals while the same repair is outstanding leave it None: see
    :meth:`Edge.pending_resyncs` to retry). ``malformed``/``wrong_table``: refused, ``error``
    says why. A refused batch never changes a view.
    """

    status: PatchStatus
    table: int | None = None
    shard: int | None = None
    epoch: int | None = None
    seq: int | None = None
    ops: int = 0
    snapshot: bool = False
    resync: ResyncAction | None = None
    error: str | None = None

    @property
    def applied(self) -> bool:
        return self.status == "applied"


@dataclass(frozen=True, slots=True)
class QueueBroadcast:
    """This region's per-worker queue vector (ms), due toward ``target_region``."""

    source_region: str
    target_region: str
    vector: dict[str, float]


@fast_init
@dataclass(frozen=True, slots=True)
class ScoreTerms:
    """The winner's score, term by term (ms); ``wan + queue + prefill + reload == score``."""

    wan: float
    queue: float
    prefill: float
    reload: float
    lam: float
    belief: float


@fast_init
@dataclass(frozen=True, slots=True)
class Decision:
    """Where one request goes, and why."""

    worker: str
    worker_index: int
    region: str
    expected_match: int
    """Tokens the index claims the worker holds (before the belief discount)."""
    tier: Tier
    score: float
    terms: ScoreTerms
    tie_broken: bool
    """Several workers were within ``tie_ms`` of the best and the winner was drawn among them."""
    candidates: int
    """How many workers were within ``tie_ms`` of the best (1 = a clear winner)."""
    prompt_tokens: int
    local_match: int
    """The longest match of any own-region worker (0 = no local holder)."""
    family: int | None = field(default=None, repr=False)
    """The prefix family's key (the key at the shortest own-region plan length); None when the
    prompt is shorter than that or migration is off (hotness is then not tracked)."""


@dataclass(slots=True)
class EdgeStats:
    """Counters since the edge started (a copy; see :attr:`Edge.stats`)."""

    batches_applied: int = 0
    snapshots_applied: int = 0
    stale_batches: int = 0
    gaps: int = 0
    epoch_changes: int = 0
    malformed_batches: int = 0
    wrong_table_batches: int = 0
    resyncs_requested: int = 0
    routes: int = 0
    ties: int = 0
    speculative_registered: int = 0
    speculative_expired: int = 0
    responses: int = 0
    queue_samples_ignored: int = 0
    broadcasts_sent: int = 0
    broadcasts_suppressed: int = 0
    local_misses: int = 0
    handoffs: int = 0
    handoffs_moved: int = 0
    migrations_emitted: int = 0
    migrations_no_target: int = 0


@dataclass(frozen=True, slots=True)
class _Header:
    table: int
    shard: int
    epoch: int
    seq: int

    def outcome(self, status: PatchStatus, resync: ResyncAction | None = None, error: str | None = None) -> PatchOutcome:
        return PatchOutcome(status, self.table, self.shard, self.epoch, self.seq, resync=resync, error=error)


@dataclass(slots=True)
class _Behind:
    kind: ResyncKind
    target: tuple[int, int]
    """A position (epoch, seq) the writer is known to have reached: repaired once the view is there."""


def unservable(region: str, worker_regions: Sequence[str], params: EdgeParams) -> str | None:
    """Why the edge of ``region`` could route to no worker of ``worker_regions`` (the regions of
    the workers it indexes) under ``params``, or None: without cross-region reuse only its own
    region's workers may serve. A caller that builds edges for many configurations (the
    simulator's schemes) asks before building any."""
    if params.cross_region or region in worker_regions:
        return None
    return f"no worker may serve: cross_region is off and region {region!r} has no indexed worker"


def _check_now(now: float) -> None:
    """A route's time must be finite: a NaN made speculative entries and dispatch charges that
    never expire (found in review), false claims and a busy-looking worker for good."""
    if not math.isfinite(now):
        raise InvalidArgumentError(f"now must be a finite time in seconds, got {now!r}")


def _prompt(tokens: npt.NDArray[np.uint32] | Sequence[int], namespace: Namespace | bytes) -> tuple[npt.NDArray[np.uint32], bytes]:
    """A prompt as the core takes it: a uint32 array and its namespace's digest."""
    return as_tokens(tokens), namespace.digest if isinstance(namespace, Namespace) else bytes(namespace)


class Edge:
    """One edge node's lookup unit, router and learner.

    ``workers`` are exactly the indexed workers in ``layout.workers`` order; ``plan[r]`` the
    ascending prefix lengths this edge queries toward region ``r`` (every worker region and the
    edge's own); ``rtt_ms[r]`` the RTT from this edge's region to ``r`` (own region: the
    in-region RTT). ``seed`` seeds the only randomness (tie-breaks, migration targets).
    ``block_size``: the engines' KV block size; a claim is capped at the whole blocks before a
    prompt's last token, which is all an engine reuses of it (``ScoreParams::block`` in
    ``rust/score.rs``; 0 leaves claims uncapped). :func:`kvcompass.discovery.plane.wire_edge`
    passes the topology's.
    """

    def __init__(
        self,
        region: str,
        layout: IndexLayout,
        workers: Sequence[WorkerSpec],
        plan: Mapping[str, Sequence[int]],
        rtt_ms: Mapping[str, float],
        params: EdgeParams = EdgeParams(),
        seed: int = 0,
        block_size: int = 0,
    ) -> None:
        self._params = params
        self._region = region
        self._layout = layout
        self._check_workers(layout, workers, params)
        if not 0 <= block_size < 2**32:
            raise TopologyError(f"block_size = {block_size}: must be a block size in tokens, or 0 (matches not capped)")
        if not params.fingerprints and layout.fp_bits != 0:
            raise TopologyError(
                f"EdgeParams(fingerprints=False) needs views without fingerprints, but the layout has fp_bits={layout.fp_bits}; "
                "build writers and edges with kvcompass.discovery.params.layout_for(layout, params)"
            )

        regions = list(dict.fromkeys([region, *(t.region for t in layout.tables)]))
        self._regions = tuple(regions)
        ridx = {r: i for i, r in enumerate(regions)}
        for r in regions:
            if r not in rtt_ms:
                raise TopologyError(f"rtt_ms has no entry for region {r!r}")
            if r not in plan:
                raise TopologyError(f"plan has no entry for region {r!r}")
        for r, x in rtt_ms.items():
            if not (math.isfinite(x) and x >= 0):
                raise TopologyError(f"rtt_ms[{r!r}] = {x}: must be finite and >= 0")
        full_plan: dict[str, tuple[int, ...]] = {}
        for r in regions:
            lengths = tuple(int(c) for c in plan[r])
            if any(c < 1 for c in lengths) or any(a >= b for a, b in zip(lengths, lengths[1:])):
                raise TopologyError(f"plan[{r!r}] = {list(lengths)}: must be strictly ascending lengths >= 1")
            full_plan[r] = lengths
        if not full_plan[region]:
            raise TopologyError(f"plan[{region!r}] (the own region) is empty: it names prefix families")
        # No cross-region reuse: nothing is looked up toward other regions ...
        self._plan = {r: (c if params.cross_region or r == region else ()) for r, c in full_plan.items()}
        self._plan_lists = [list(self._plan[r]) for r in regions]
        family_length = full_plan[region][0]  # the prefix family: the own region's first length

        self._ids = tuple(w.id for w in workers)
        self._index = {w: i for i, w in enumerate(self._ids)}
        self._worker_region = tuple(w.region for w in workers)
        n = len(workers)
        beta = np.array([w.beta_ms_per_token for w in workers], dtype=np.float64)
        rtt = np.array([float(rtt_ms[w.region]) for w in workers], dtype=np.float64)
        # n1 toward each worker: the shortest match worth crossing to it (paper section 3.2).
        self._n1 = rtt / beta
        self._local = np.array([w.region == region for w in workers], dtype=np.bool_)
        self._local_idx = [int(i) for i in np.flatnonzero(self._local)]
        self._local_ids = tuple(self._ids[i] for i in self._local_idx)
        self._local_idx_arr = np.array(self._local_idx, dtype=np.int64)
        # Python copies for per-worker reads (numpy scalar indexing is slow).
        self._wan_l: list[float] = (params.wan_fraction * rtt).tolist()
        self._local_l: list[bool] = self._local.tolist()
        # ... and only own-region workers may win.
        self._eligible = np.ones(n, dtype=np.bool_) if params.cross_region else self._local.copy()
        why = unservable(region, self._worker_region, params)
        if why is not None:
            raise TopologyError(why)
        self._all_eligible = bool(self._eligible.all())
        self._ineligible_inf = np.where(self._eligible, 0.0, math.inf)
        self._ones = np.ones(n, dtype=np.float64)

        # The global worker index of each table's fields.
        self._table_workers = [np.array([self._index[w] for w in t.workers], dtype=np.uint32) for t in layout.tables]
        self._table_region = [ridx[t.region] for t in layout.tables]
        self._views: dict[tuple[int, int], _core.LudoView] = {
            (t.table_id, s): _core.LudoView(t.table_id, s) for t in layout.tables for s in range(layout.shards)
        }
        # The views of each table's speculative entries (the router reads them; the core writes them).
        self._spec_views = [_core.LudoView(t.table_id, 0) for t in layout.tables]
        self._router = self._build_router()
        # The edge whose views this one reads (None: its own), and the edges reading ours.
        self._views_of: Edge | None = None
        self._readers: list[Edge] = []

        self._behind: dict[tuple[int, int], _Behind] = {}
        self._n = EdgeStats()
        self._rng = np.random.default_rng(seed)
        self._queues = QueueEstimates(n, params.queue_weight, params.idle_threshold_ms, params.dispatch_charge_ttl_s)
        # A sample settles the charges of requests it must include: those that reached the
        # worker before it was taken (one way) and, for a remote vector, that came back (round trip).
        self._settle_lag_s: list[float] = [(x / 2e3 if self._local_l[i] else x / 1e3) for i, x in enumerate(rtt.tolist())]
        self._settle_lag_s_arr = np.array(self._settle_lag_s, dtype=np.float64)
        # region -> (the ids of its last vector in order, their worker indices, how many of them
        # are not this region's workers (ignored), the positions of the others (None: all kept),
        # their settle lags)
        self._vector_ids: dict[str, tuple[tuple[str, ...], npt.NDArray[np.int64], int, npt.NDArray[np.int64] | None, npt.NDArray[np.float64]]] = {}
        self._belief = CacheBelief(n, params.belief_weight, params.belief_initial)
        self._known_regions = frozenset(rtt_ms) | frozenset(regions)
        others = sorted({r for r in self._known_regions if r != region})
        self._broadcast = BroadcastSchedule(others, params.broadcast_period_s)
        self._hotness = HotnessTracker(params.hot_misses, params.hot_window_s)
        self._planner = MigrationPlanner(self._ids, self._worker_region, params.migration_cooldown_s, params.hot_window_s, self._rng)
        # The per-request steps around the router (rust/python/edge_core.rs): expiries, the
        # capacity price, the route, the tie draw and the commit's side effects.
        if [t.table_id for t in layout.tables] != list(range(len(layout.tables))):  # pragma: no cover - IndexLayout numbers them so
            raise TopologyError("layout tables must be numbered 0, 1, ... in order")
        fields = [layout.field_of(w) for w in self._ids]
        self._core = _core.EdgeCore(
            self._router,
            self._queues,
            {
                "region": [ridx[w.region] for w in workers],
                "beta": beta.tolist(),
                "wan": self._wan_l,
                "local": self._local_l,
                "eligible": self._eligible.tolist(),
                "fields": [(ref.table_id, ref.field) for ref in fields],
            },
            self._plan_lists,
            family_length,
            self._spec_views,
            {
                "load_aware": params.load_aware,
                "lambda_max": params.lambda_max,
                "tau_ms": params.tau_ms,
                "gamma": params.gamma_ms_per_token if params.tier_aware else 0.0,
                "closure": params.closure,
                "tie_ms": params.tie_ms,
                "speculative_ttl_s": params.speculative_ttl_s,
                "charge": params.load_aware and params.dispatch_charge_ttl_s > 0,
                "migration": params.migration,
                "value_bits": layout.value_bits,
                "spec_capacity": _SPEC_CAPACITY,
                "spec_fp_bits": _SPEC_FP_BITS,
                "block_size": block_size,
            },
        )
        self._draw = self._rng.random

    @staticmethod
    def _check_workers(layout: IndexLayout, workers: Sequence[WorkerSpec], params: EdgeParams) -> None:
        ids = tuple(w.id for w in workers)
        if ids != layout.workers:
            raise TopologyError(f"workers must be exactly the layout's workers in order {list(layout.workers)}, got {list(ids)}")
        by_id = {w.id: w for w in workers}
        for t in layout.tables:
            for wid in t.workers:
                spec = by_id[wid]
                if spec.region != t.region:
                    raise TopologyError(f"worker {wid!r} is in region {spec.region!r} but its table {t.table_id} is in {t.region!r}")
        for w in workers:
            if w.role == "decode":
                raise TopologyError(f"worker {w.id!r} is a decode worker: only prefill workers are indexed and routed to (paper appendix C)")
            if params.disaggregated and w.role != "prefill":
                raise TopologyError(f"disaggregated mode: worker {w.id!r} has role {w.role!r}, every indexed worker must be 'prefill'")
            if not (math.isfinite(w.beta_ms_per_token) and w.beta_ms_per_token > 0):
                raise TopologyError(f"worker {w.id!r}: beta_ms_per_token = {w.beta_ms_per_token} must be finite and > 0")

    def _rebuild_router(self) -> None:
        self._router = self._build_router()
        self._core.set_router(self._router)

    def _build_router(self) -> _core.Router:
        tables: list[tuple[int, npt.NDArray[np.uint32], list[_core.LudoView]]] = []
        for t in self._layout.tables:
            shards = [self._views[(t.table_id, s)] for s in range(self._layout.shards)]
            tables.append((self._table_region[t.table_id], self._table_workers[t.table_id], shards))
        for t in self._layout.tables:
            tables.append((self._table_region[t.table_id], self._table_workers[t.table_id], [self._spec_views[t.table_id]]))
        return _core.Router(self._plan_lists, tables)

    # -- identity ----------------------------------------------------------------------------------

    @property
    def region(self) -> str:
        return self._region

    @property
    def params(self) -> EdgeParams:
        return self._params

    @property
    def layout(self) -> IndexLayout:
        """The index layout the views follow (tables, shards)."""
        return self._layout

    @property
    def workers(self) -> tuple[str, ...]:
        """Worker ids in index order (the order of every per-worker array)."""
        return self._ids

    @property
    def plan(self) -> dict[str, tuple[int, ...]]:
        """The lengths this edge actually queries per region (after the cross-region switch)."""
        return dict(self._plan)

    def worker_region(self, worker: str) -> str:
        """The region of ``worker`` (as the layout and topology place it)."""
        return self._worker_region[self.worker_index(worker)]

    def worker_index(self, worker: str) -> int:
        try:
            return self._index[worker]
        except KeyError:
            raise UnknownWorkerError(f"unknown worker {worker!r}", worker=worker) from None

    def n1(self, worker: str) -> float:
        """RTT(o, region of ``worker``) / beta of ``worker``: the shortest match worth crossing to it."""
        return float(self._n1[self.worker_index(worker)])

    @property
    def stats(self) -> EdgeStats:
        self._n.broadcasts_suppressed = self._broadcast.suppressed
        self._n.migrations_emitted = self._planner.emitted
        self._n.migrations_no_target = self._planner.no_target
        self._n.speculative_registered, self._n.speculative_expired = self._core.speculative_counts
        return replace(self._n)

    # -- views and patches ---------------------------------------------------------------------------

    def view(self, table: int, shard: int) -> _core.LudoView:
        """The live view of (table, shard) (for digests and metrics; apply batches via the edge)."""
        try:
            return self._views[(table, shard)]
        except KeyError:
            raise InvalidArgumentError(f"no view ({table}, {shard}): the layout has {len(self._layout.tables)} tables x {self._layout.shards} shards") from None

    def read_views_of(self, leader: Edge) -> None:
        """Route over ``leader``'s index views (and their repair state) instead of keeping a
        replica of its own.

        Why: a driver in one process whose edges all receive every patch batch at the same
        instant (the simulator without patch loss or delay) would otherwise keep byte-identical
        replicas and apply each batch once per edge, which at 16 regions was a tenth of a
        simulated request's cost. Only the views are shared: queue estimates, beliefs,
        speculative entries and hotness stay this edge's own. Patches, snapshots and writer
        positions then go to ``leader`` (this edge refuses them); a snapshot ``leader``
        bootstraps is seen here too."""
        if leader is self:
            return
        if leader._views_of is not None or self._readers:
            raise InvalidArgumentError(f"edge {self._region!r} cannot read the views of {leader._region!r}: one level of sharing only")
        if leader._layout != self._layout:
            raise InvalidArgumentError(f"edge {self._region!r} cannot read the views of {leader._region!r}: their layouts differ")
        if self._views_of is not None:
            self._views_of._readers.remove(self)
        self._views = leader._views
        self._behind = leader._behind
        self._views_of = leader
        leader._readers.append(self)
        self._rebuild_router()

    @property
    def views_of(self) -> str | None:
        """The region of the edge whose views this one reads (:meth:`read_views_of`), or None."""
        return None if self._views_of is None else self._views_of._region

    def _own_views(self, what: str) -> None:
        if self._views_of is not None:
            raise InvalidArgumentError(f"edge {self._region!r} reads the views of {self._views_of._region!r}: {what} go there")

    @property
    def behind(self) -> frozenset[tuple[int, int]]:
        """(table, shard) views known to miss batches, until repaired."""
        return frozenset(self._behind)

    @property
    def uninitialised(self) -> frozenset[tuple[int, int]]:
        """(table, shard) views that never received a snapshot."""
        return frozenset(k for k, v in self._views.items() if not v.initialised)

    @property
    def healthy(self) -> bool:
        """Every view bootstrapped and none behind (health turns NOT_SERVING otherwise)."""
        return not self._behind and all(v.initialised for v in self._views.values())

    def pending_resyncs(self) -> list[ResyncAction]:
        """Every repair still needed, in (table, shard) order: re-send them if answers got lost."""
        out = []
        for key in sorted(self._views):
            v = self._views[key]
            b = self._behind.get(key)
            if b is not None:
                out.append(ResyncAction(key[0], key[1], b.kind, v.epoch, v.seq))
            elif not v.initialised:
                out.append(ResyncAction(key[0], key[1], "snapshot", 0, 0))
        return out

    def apply_patch(self, data: bytes) -> PatchOutcome:
        """Apply one encoded batch to the view it names; never raises for a bad batch (an
        edge that reads another's views raises InvalidArgumentError: see :meth:`read_views_of`)."""
        self._own_views("patches")
        try:
            h = _core.decode_batch_header(data)
        except MalformedPatchError as e:
            self._n.malformed_batches += 1
            return PatchOutcome("malformed", error=str(e))
        key = (h["table"], h["shard"])
        base = _Header(key[0], key[1], h["epoch"], h["seq"])
        view = self._views.get(key)
        if view is None:
            self._n.wrong_table_batches += 1
            return base.outcome("wrong_table", error=f"no view ({key[0]}, {key[1]}) in this layout")
        try:
            r = view.apply_batch(data)
        except SequenceGapError as e:
            self._n.gaps += 1
            return self._fell_behind(key, "replay", (e.epoch, e.got), base, str(e))
        except StalePatchError:
            self._n.stale_batches += 1
            return base.outcome("stale")
        except EpochChangedError as e:
            self._n.epoch_changes += 1
            return self._fell_behind(key, "snapshot", (h["epoch"], h["seq"]), base, str(e))
        except UninitialisedViewError as e:
            return self._fell_behind(key, "snapshot", (h["epoch"], h["seq"]), base, str(e))
        except WrongTableError as e:
            self._n.wrong_table_batches += 1
            return base.outcome("wrong_table", error=str(e))
        except MalformedPatchError as e:
            self._n.malformed_batches += 1
            return base.outcome("malformed", error=str(e))
        return self._applied(key, r)

    def apply_patches_in_order(self, batches: list[bytes]) -> int:
        """Apply the longest prefix of ``batches`` that applies cleanly, as :meth:`apply_patch`
        would one by one, in one Rust call; returns its length. The first batch that does not
        apply, and every one after it, is left for :meth:`apply_patch` (which reports and
        repairs). A view already behind its writer takes nothing here (its bookkeeping is
        :meth:`apply_patch`'s)."""
        self._own_views("patches")
        if self._behind or not batches:
            return 0
        done, snaps = _core.apply_view_batches(self._views, batches)
        self._n.batches_applied += done
        self._n.snapshots_applied += snaps
        return done

    def note_writer_position(self, table: int, shard: int, epoch: int, seq: int) -> ResyncAction | None:
        """The writer of (table, shard) says it has emitted up to (epoch, seq) (a heartbeat on
        the patch stream). A lost *last* batch is otherwise invisible until the next one
        arrives; this turns it into a resync action at once. None when the view is current or a
        repair is already outstanding."""
        self._own_views("writer positions")
        v = self.view(table, shard)
        if not v.initialised:
            target_kind: ResyncKind = "snapshot"
        elif epoch == v.epoch and v.seq >= seq:
            return None
        else:
            # Another epoch, lower included: the writer restarted (a lower one after its clock
            # stepped back without a state file); its word is the current state, and a view of
            # a higher epoch is not "ahead" of it (found in review: such a view stayed stale
            # while the edge reported ready).
            target_kind = "replay" if epoch == v.epoch else "snapshot"
        base = _Header(table, shard, epoch, seq)
        return self._fell_behind((table, shard), target_kind, (epoch, seq), base, "writer is ahead").resync

    def bootstrap(self, table: int, shard: int, snapshot: bytes) -> PatchOutcome:
        """Replace the view of (table, shard) by one built from ``snapshot`` alone (whatever the
        old view held). Raises on anything that is not a valid snapshot of that (table, shard)."""
        self._own_views("snapshots")
        key = (table, shard)
        self.view(table, shard)
        h = _core.decode_batch_header(snapshot)
        if (h["table"], h["shard"]) != key:
            raise WrongTableError(
                f"snapshot of ({h['table']}, {h['shard']}) offered for ({table}, {shard})",
                table=table,
                shard=shard,
                got_table=h["table"],
                got_shard=h["shard"],
            )
        fresh = _core.LudoView(table, shard)
        r = fresh.apply_batch(snapshot)
        if not r.snapshot:  # pragma: no cover - an empty view accepts nothing else
            raise UninitialisedViewError("bootstrap needs a snapshot batch")
        self._views[key] = fresh
        self._rebuild_router()
        for reader in self._readers:
            reader._rebuild_router()
        b = self._behind.get(key)
        if b is not None and b.target[0] != fresh.epoch:
            # The open repair aimed at another incarnation of the writer; this snapshot is the
            # one the writer now serves (found in review: a unit restarted at a lower epoch
            # during a gap left the repair open for good, the edge never ready). A writer
            # further on flags the view again at its next heartbeat.
            del self._behind[key]
        return self._applied(key, r)

    def _applied(self, key: tuple[int, int], r: _core.ApplyResult) -> PatchOutcome:
        self._n.batches_applied += 1
        self._n.snapshots_applied += int(r.snapshot)
        v = self._views[key]
        resync = None
        b = self._behind.get(key)
        if b is not None:
            if (v.epoch, v.seq) >= b.target:
                del self._behind[key]
            elif b.kind == "snapshot" and v.epoch == b.target[0]:
                # The new epoch's snapshot landed but the writer is further on: replay the rest.
                b.kind = "replay"
                resync = ResyncAction(key[0], key[1], "replay", v.epoch, v.seq)
                self._n.resyncs_requested += 1
        return PatchOutcome("applied", key[0], key[1], r.epoch, r.seq, r.ops, r.snapshot, resync)

    def _fell_behind(self, key: tuple[int, int], kind: ResyncKind, target: tuple[int, int], base: _Header, err: str) -> PatchOutcome:
        prev = self._behind.get(key)
        if prev is None:
            self._behind[key] = _Behind(kind, target)
            emit = True
        else:
            emit = kind == "snapshot" and prev.kind == "replay"
            prev.target = max(prev.target, target)
            if emit:
                prev.kind = "snapshot"
        v = self._views[key]
        resync = None
        if emit:
            resync = ResyncAction(key[0], key[1], kind, v.epoch, v.seq)
            self._n.resyncs_requested += 1
        status: PatchStatus = "gap" if kind == "replay" else "snapshot_needed"
        return base.outcome(status, resync=resync, error=err)

    # -- routing ---------------------------------------------------------------------------------

    def capacity_price(self) -> float:
        """lambda = min(lambda_max, min over servable workers of Tq / tau); 0 without load awareness."""
        return self._core.capacity_price()

    def _belief_now(self, now: float) -> npt.NDArray[np.float64]:
        if not self._params.belief:
            return self._ones
        self._belief.relax(now, self._params.belief_half_life_s)
        return self._belief.values

    def route(self, tokens: npt.NDArray[np.uint32] | Sequence[int], namespace: Namespace | bytes, now: float, exclude: Collection[str] = ()) -> Decision:
        """Pick the worker for one prompt (see the module docs); registers the speculative entry
        and counts hotness as side effects. ``exclude`` names workers that may not win (a
        front door retrying after a worker failed); InvalidArgumentError if nobody is left."""
        return self._route(tokens, namespace, now, exclude, effects=True)

    def lookup(self, tokens: npt.NDArray[np.uint32] | Sequence[int], namespace: Namespace | bytes, now: float, exclude: Collection[str] = ()) -> Decision:
        """What :meth:`route` would decide now, with none of its side effects: no dispatch
        charge, no speculative entry, no hotness count. For a gateway that only asks who holds
        a prompt: a query that registered a speculative claim made the next query see a hit
        nobody holds (issue 16). Ties are still drawn, so a lookup may name another of equally
        good workers than the route that follows it."""
        return self._route(tokens, namespace, now, exclude, effects=False)

    def _route(self, tokens: npt.NDArray[np.uint32] | Sequence[int], namespace: Namespace | bytes, now: float, exclude: Collection[str], *, effects: bool) -> Decision:
        _check_now(now)
        toks, ns = _prompt(tokens, namespace)
        belief = self._belief_now(now)
        if self._all_eligible and not exclude:
            res, c = self._core.route(toks, ns, now, belief, self._draw, effects, effects)
        else:
            res = self._core.score(toks, ns, now, belief)
            w, n_cand = self._choose(res, exclude)
            c = self._core.commit(res, w, n_cand, now, effects, effects)
        if effects:
            self._n.routes += 1
            self._n.ties += c[1] > 1
        return self._decide(res, c, toks, ns, now)

    def _choose(self, res: _core.RouteResult, exclude: Collection[str]) -> tuple[int, int]:
        """The winner among the near-best eligible workers not in ``exclude`` (within ``tie_ms``),
        drawn uniformly, and how many there were."""
        p = self._params
        scores = res.scores + self._ineligible_inf  # a fresh array
        if exclude:
            scores[[self.worker_index(x) for x in exclude]] = math.inf
        best = float(scores.min())
        if not math.isfinite(best):
            raise InvalidArgumentError(f"every worker this edge may route to is excluded ({len(exclude)} excluded)")
        cand = (scores <= best + p.tie_ms).nonzero()[0].tolist()
        n_cand = len(cand)
        # random() in [0, 1): a uniform index, at a third of integers()' call cost.
        w = cand[int(self._rng.random() * n_cand)] if n_cand > 1 else cand[0]
        return w, n_cand

    def handoff(
        self, tokens: npt.NDArray[np.uint32] | Sequence[int], namespace: Namespace | bytes, worker: str, now: float, exclude: Collection[str] = ()
    ) -> Decision:
        """Another region's edge forwarded this prompt to ``worker``, one of ours, and it has just
        arrived here: keep ``worker`` unless another own-region worker now scores better by more
        than the in-region hop (plus ``tie_ms``), and charge the one chosen.

        Why: remote edges read our queues from vectors at least a WAN way plus up to Delta old,
        and every remote edge reads the same ones, so an idle worker here draws work from all of
        them at once (cross-edge herding) while this edge, which reads the queues live, has not
        seen any of it coming. Re-scoring at the arrival among our own workers (the request
        has paid its WAN way already) undoes a collision for the price of one in-region hop, and
        the charge lets this edge's own routes see the work before the worker's next reading.
        Hotness is not counted again (the origin counted the request). With ``load_aware`` off
        there is nothing to re-score and ``worker`` is kept. ``exclude``: workers that may not
        serve (a door that cannot reach them); ``worker`` itself among them forces a move, and
        InvalidArgumentError says that no own-region worker is left."""
        i = self.worker_index(worker)
        if not self._local_l[i]:
            raise InvalidArgumentError(f"handoff of {worker!r}: a worker of region {self._worker_region[i]!r}, not of this edge's region {self._region!r}")
        p = self._params
        _check_now(now)
        toks, ns = _prompt(tokens, namespace)
        # Only own-region workers may take it: their tables alone are read (region 0 is ours).
        res = self._core.score(toks, ns, now, self._belief_now(now), True)
        w = i
        scores = res.scores  # every other region's workers already score inf
        if exclude:
            scores[[self.worker_index(x) for x in exclude]] = math.inf
        best = int(scores.argmin())
        if not math.isfinite(float(scores[best])):
            raise InvalidArgumentError(f"handoff of {worker!r}: every worker of region {self._region!r} is excluded")
        if not math.isfinite(float(scores[i])) or (p.load_aware and float(scores[i]) > float(scores[best]) + p.tie_ms + self._wan_l[best]):
            w = best
            self._n.handoffs_moved += 1
        self._n.handoffs += 1
        return self._decide(res, self._core.commit(res, w, 1, now, False), toks, ns, now)

    def _decide(self, res: _core.RouteResult, c: tuple[Any, ...], toks: npt.NDArray[np.uint32], ns: bytes, now: float) -> Decision:
        """The :class:`Decision` of the core's commit tuple ``c`` (see ``EdgeCore.commit``); on a
        local miss of a tracked family, hotness is counted and the migration rule evaluated."""
        w, n_cand, m, tier, score, terms, n_tokens, local_match, family, local_miss = c
        if local_miss:
            self._n.local_misses += 1
            if self._hotness.observe_miss(family, now) and not self._planner.cooling(family, now):
                trig = evaluate_trigger(self._local, res.matches, res.scores, res.tq, self._n1, w)
                if trig is not None:
                    self._planner.offer(family, trig, ns, toks, now)
        # worker, worker_index, region, expected_match, tier, score, terms (wan, queue, prefill,
        # reload, lam, belief), tie_broken, candidates, prompt_tokens, local_match, family
        # (positional: a frozen record built by keyword costs half as much again, per route)
        return Decision(self._ids[w], w, self._worker_region[w], m, _TIERS[tier], score, ScoreTerms(*terms), n_cand > 1, n_cand, n_tokens, local_match, family)

    # -- speculative entries ---------------------------------------------------------------------------

    @property
    def speculative_entries(self) -> int:
        """Live (table, key, field) speculative entries."""
        return int(self._core.speculative_entries)

    def expire(self, now: float) -> int:
        """Drop speculative entries whose TTL ran out by ``now`` (also done on every route);
        returns how many."""
        return int(self._core.expire(now))

    # -- belief and queue estimates -----------------------------------------------------------------

    def belief(self, worker: str) -> float:
        return self._belief[self.worker_index(worker)]

    def queue_estimate(self, worker: str) -> float:
        """The current estimate (ms), whether or not load awareness is on."""
        return self._queues[self.worker_index(worker)]

    def queue_age(self, worker: str, now: float) -> float:
        """Seconds since the last sample for ``worker`` (inf if none)."""
        return self._queues.age(self.worker_index(worker), now)

    def set_local_queue(self, worker: str, tq_ms: float, now: float) -> None:
        """A live queue reading of an own-region worker."""
        i = self.worker_index(worker)
        if not self._local[i]:
            raise InvalidArgumentError(f"worker {worker!r} is in region {self._worker_region[i]!r}, not this edge's {self._region!r}: use on_response/on_broadcast")
        self._queues.set_live(i, tq_ms, now, now - self._settle_lag_s[i])

    def set_local_queues(self, indices: npt.NDArray[np.int64], tq_ms: npt.NDArray[np.float64], now: float) -> None:
        """Live readings of several own-region workers at once, by :meth:`worker_index` (a poll
        of the region's busy workers): :meth:`set_local_queue` for each, in one pass."""
        ii = np.ascontiguousarray(indices, dtype=np.int64)
        if len(ii) and not bool(self._local[ii].all()):
            bad = self._ids[int(ii[~self._local[ii]][0])]
            raise InvalidArgumentError(f"worker {bad!r} is not in this edge's region {self._region!r}: use on_response/on_broadcast")
        self._queues.set_live_many(ii, np.ascontiguousarray(tq_ms, dtype=np.float64), now, now - self._settle_lag_s_arr[ii])

    def live_sink(self) -> tuple[_core.QueueEstimates, npt.NDArray[np.float64]]:
        """``(estimates, settle lags)`` for a driver in one process that polls this region's
        workers itself and writes the readings straight into the estimates (the simulator's
        engine: one call a tick for every edge). A reading ``tq`` of own-region worker ``i``
        at ``now`` is ``estimates.set_live_many([i], [tq], now, [now - lags[i]])``, which is
        what :meth:`set_local_queues` does."""
        return self._queues, self._settle_lag_s_arr.copy()

    def on_response(self, worker: str, claimed_tokens: int, reused_tokens: int, queue_vector: Mapping[str, float] | None, now: float) -> None:
        """A response from ``worker``: the edge had claimed ``claimed_tokens`` (the decision's
        ``expected_match``), the worker reports ``reused_tokens``; a remote worker's response
        may carry its region's queue vector (worker id -> ms)."""
        _check_now(now)  # a NaN reset every belief, an inf stopped their recovery (found in review)
        i = self.worker_index(worker)
        claimed, reused = int(claimed_tokens), int(reused_tokens)
        if claimed < 0 or reused < 0:
            raise InvalidArgumentError(f"claimed ({claimed}) and reused ({reused}) tokens must be >= 0")
        # Fold the queue vector first: it validates every sample before changing anything, so a
        # bad report leaves belief and queues untouched.
        if queue_vector and not self._local[i]:
            self._fold_vector(self._worker_region[i], queue_vector, now)
        self._n.responses += 1
        # Relaxed to now first: otherwise the next route's relaxation covered the time before
        # this report too, and on a quiet edge a false claim reported long after the last route
        # was mostly undone by the next (found in review).
        self._belief_now(now)
        self._belief.observe(i, claimed, reused)

    def on_broadcast(self, region: str, vector: Mapping[str, float], now: float) -> None:
        """A periodic queue vector from ``region`` (our own region's is ignored: it is read live).
        A region this edge does not know is refused: each region's vector layout is kept, so
        made-up names grew the edge without bound (found in review)."""
        if region == self._region:
            return
        if region not in self._known_regions:
            raise InvalidArgumentError(f"queue vector from unknown region {region!r}")
        self._fold_vector(region, vector, now)

    def _fold_vector(self, region: str, vector: Mapping[str, float], now: float) -> None:
        # A region sends the same worker ids in the same order every time: once a vector's ids
        # have been resolved, the next one with those ids is checked and folded as arrays.
        keys = tuple(vector)
        known = self._vector_ids.get(region)
        if known is not None and known[0] == keys:
            ii, ignored, pos, lag = known[1], known[2], known[3], known[4]
            try:
                vals = np.fromiter(vector.values(), dtype=np.float64, count=len(keys))
                self._queues.fold_lagged(ii, vals if pos is None else vals[pos], now, lag)
            except (TypeError, ValueError):
                pass  # a sample that is not a number, or not finite and >= 0: the full check names it
            else:
                self._n.queue_samples_ignored += ignored
                return
        self._fold_vector_checked(region, vector, now, keys)

    def _fold_vector_checked(self, region: str, vector: Mapping[str, float], now: float, keys: tuple[str, ...]) -> None:
        # Validate every sample first so a bad vector changes nothing.
        vals: list[float] = []
        for wid, x in vector.items():
            v = float(x)
            if not (math.isfinite(v) and 0 <= v <= MAX_QUEUE_MS):
                raise InvalidArgumentError(f"queue vector of {region!r}: {wid!r} = {x!r} ms must be finite and in [0, {MAX_QUEUE_MS:g}]")
            vals.append(v)
        ii, ignored, kept, lag = self._vector_layout(region, keys)
        self._n.queue_samples_ignored += ignored
        self._vector_ids[region] = (keys, ii, ignored, kept, lag)
        if len(ii):
            arr = np.array(vals, dtype=np.float64)
            self._queues.fold_many(ii, arr if kept is None else arr[kept], now, now - self._settle_lag_s_arr[ii])

    def _vector_layout(self, region: str, keys: Sequence[str]) -> tuple[npt.NDArray[np.int64], int, npt.NDArray[np.int64] | None, npt.NDArray[np.float64]]:
        """Where the samples of ``region``'s vector with worker ids ``keys`` go: this edge's
        indices of the kept ones (``region``'s own workers), how many are ignored, the kept
        positions (None: all) and their settle lags."""
        pos: list[int] = []
        idx: list[int] = []
        index, worker_region = self._index, self._worker_region
        for k, wid in enumerate(keys):
            i = index.get(wid)
            if i is None or worker_region[i] != region:
                continue
            pos.append(k)
            idx.append(i)
        ignored = len(keys) - len(idx)
        ii = np.fromiter(idx, dtype=np.int64, count=len(idx))
        kept = None if ignored == 0 else np.fromiter(pos, dtype=np.int64, count=len(pos))
        return ii, ignored, kept, np.ascontiguousarray(self._settle_lag_s_arr[ii])

    def vector_map(self, region: str, ids: Sequence[str]) -> tuple[list[int], list[int] | None, list[float]]:
        """``(indices, positions, lags)``: how a queue vector of ``region`` with worker ids
        ``ids`` (in that order) folds here: the samples at ``positions`` (None: all, in order)
        go to this edge's ``indices`` with those settle lags, as :meth:`on_broadcast` folds
        them. For a driver in one process that delivers broadcasts itself (the simulator's
        engine). Ids of workers not in ``region`` (which a broadcast would ignore and count)
        are refused: a region broadcasts its own workers."""
        if region == self._region:
            raise InvalidArgumentError(f"vector_map of {region!r}: this edge's own region (its estimates are read live)")
        ii, ignored, kept, lag = self._vector_layout(region, tuple(ids))
        if ignored:
            raise InvalidArgumentError(f"vector_map of {region!r}: {ignored} of its {len(ids)} ids are not workers of {region!r} at this edge")
        return ii.tolist(), None if kept is None else kept.tolist(), lag.tolist()

    @property
    def local_ids(self) -> tuple[str, ...]:
        """This region's workers in the order of :meth:`local_values` (one tuple object)."""
        return self._local_ids

    def local_values(self) -> npt.NDArray[np.float64]:
        """This region's per-worker queue estimates (ms) in :attr:`local_ids` order."""
        return self._queues.values[self._local_idx_arr]

    def local_vector(self) -> dict[str, float]:
        """This region's per-worker queue vector (ms), as piggybacked and broadcast."""
        return self._queues.vector(self._local_idx, self._local_ids)

    def note_piggyback_sent(self, target_region: str, now: float) -> None:
        """A response carrying :meth:`local_vector` left toward ``target_region`` at ``now``:
        the next broadcast there is suppressed if due within Delta."""
        try:
            self._broadcast.note_piggyback(target_region, now)
        except KeyError:
            raise InvalidArgumentError(f"unknown region {target_region!r}") from None

    def piggyback_vector(self, target_region: str, now: float) -> dict[str, float]:
        """:meth:`local_vector` for a response about to leave toward ``target_region`` (recorded)."""
        self.note_piggyback_sent(target_region, now)
        return self.local_vector()

    @property
    def next_broadcast_s(self) -> float:
        """The earliest time (s) a broadcast can be due (a driver polling every few
        milliseconds skips :meth:`broadcast_due` until then)."""
        return self._broadcast.next_due

    @property
    def migrations_pending(self) -> bool:
        """Whether :meth:`migration_actions` has anything to resolve."""
        return self._params.migration and bool(self._planner.pending)

    def broadcast_due(self, now: float) -> list[QueueBroadcast]:
        """Broadcasts to send now: every other region, every Delta, unless it just got a piggyback."""
        targets = self.broadcast_targets_due(now)
        if not targets:
            return []
        vec = self.local_vector()
        return [QueueBroadcast(self._region, r, dict(vec)) for r in targets]

    def broadcast_targets_due(self, now: float) -> list[str]:
        """The regions :meth:`broadcast_due` would send to now (the schedule advances as it
        does); the vector to send is :meth:`local_values` in :attr:`local_ids` order."""
        targets = self._broadcast.due(now)
        self._n.broadcasts_sent += len(targets)
        return targets

    # -- hotness and migration ------------------------------------------------------------------------

    def is_hot(self, family: int, now: float) -> bool:
        return self._hotness.is_hot(family, now)

    def hot_families(self, now: float) -> list[tuple[int, int, float]]:
        """The prefix families hot at ``now`` (H local misses within T_h): ``(family key,
        misses, last miss time)``, most recent first."""
        return self._hotness.hot(now)

    def persistently_idle(self, worker: str, now: float) -> bool:
        """Whether ``worker``'s estimate has been at zero for ``idle_window_s``."""
        return self._queues.persistently_idle(self.worker_index(worker), now, self._params.idle_window_s)

    def migration_actions(self, now: float, exclude: Collection[str] = ()) -> list[MigrationAction]:
        """Actions for the families that turned hot since the last call, each toward a
        persistently idle own-region worker not in ``exclude`` (a door's dead workers: an idle
        estimate is the last reading, and a worker that died idle stays so; found in review),
        and no copy from a source in ``exclude``; none without one, none with migration off."""
        if not self._params.migration or not self._planner.pending:
            return []  # nothing triggered since the last call: no idle scan needed
        idle = self._queues.idle_among(self._local_idx_arr, now, self._params.idle_window_s)
        out: set[int] = set()
        if exclude:
            out = {self.worker_index(w) for w in exclude if w in self._index}
            idle = [i for i in idle if i not in out]
        return self._planner.resolve(now, idle, out)
