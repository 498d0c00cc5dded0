"""A whole discovery plane in one process: every maintenance unit and every edge of a topology,
wired by direct calls instead of sockets.

This is the assembly the simulator and the demo drive, and what integration tests use to check
agent -> maintenance -> patches -> edges -> route end to end. The gRPC services wire the very
same objects across processes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvcompass.discovery.edge import Edge, PatchOutcome
from kvcompass.discovery.maintenance import ApplyReport, MaintenanceUnit, PatchBatch
from kvcompass.discovery.key_ops import KeyOpBatch
from kvcompass.discovery.params import EdgeParams, layout_for
from kvcompass.discovery.plan import LevelPlan
from kvcompass.discovery.layout import IndexLayout
from kvcompass.discovery.topology import Topology
from kvcompass.errors import InvalidArgumentError, WrongShardError
from kvcompass.records import fast_init

__all__ = ["LocalPlane", "PropagationReport", "build_edge", "wire_edge"]


@fast_init
@dataclass(frozen=True, slots=True)
class PropagationReport:
    """What one round of patch delivery did."""

    batches: int
    deliveries: int
    resyncs: int
    patch_bytes: int


# The report of a round with nothing to deliver (a record is immutable: one serves every such round).
_NOTHING = PropagationReport(0, 0, 0, 0)


def wire_edge(plan: LevelPlan, layout: IndexLayout, region: str, params: EdgeParams, *, seed: int = 0) -> Edge:
    """The :class:`Edge` of ``region``: every indexed worker, and the plan's prefix lengths and
    RTTs toward its own region and every region that has a table. The one way an edge is wired,
    for a local plane and for ``kvcompass edge`` alike."""
    if region not in plan.edge_regions:
        raise InvalidArgumentError(f"region {region!r} has no edge: the topology's edge regions are {', '.join(plan.edge_regions)}")
    by_id = {w.id: w for w in plan.topology.workers}
    workers = [by_id[w] for w in layout.workers]
    targets = list(dict.fromkeys([region, *(t.region for t in layout.tables)]))
    # RTTs toward every edge region too: an edge whose region has no workers still receives
    # queue vectors, piggybacked on its requests' answers (found in review: such a topology
    # loaded, then KVCompass stopped at "unknown region" mid-run).
    peers = list(dict.fromkeys([*targets, *plan.edge_regions]))
    return Edge(region, layout, workers, {r: plan.lengths(region, r) for r in targets}, {r: plan.rtt_ms(region, r) for r in peers}, params, seed=seed, block_size=plan.topology.block_size)


def build_edge(topology: Topology, region: str, routing: str = "kvcompass", seed: int = 0, handoff: bool = True) -> Edge:
    """The edge of ``region`` for a process of its own (``kvcompass edge``), wired as
    :class:`LocalPlane` wires its edges. ``routing="local"`` is region-local cache-aware routing:
    no lookups toward other regions, own-region winners only. ``handoff`` False: requests routed
    to another region go straight to the worker, never through that region's door
    (``EdgeParams.handoff``)."""
    if routing not in ("kvcompass", "local"):
        raise InvalidArgumentError(f"routing must be kvcompass or local, got {routing!r}")
    params = EdgeParams(cross_region=routing == "kvcompass", handoff=handoff)
    plan = LevelPlan(topology)
    return wire_edge(plan, layout_for(plan.layout(), params), region, params, seed=seed)


class LocalPlane:
    """Maintenance units for every shard plus an edge per edge region, bootstrapped from the
    units' snapshots and kept current by :meth:`propagate`."""

    def __init__(self, topology: Topology, *, epoch: int = 1, capacity: int = 4096, params: EdgeParams = EdgeParams(), seed: int = 0, share_views: bool = False) -> None:
        self.topology = topology
        self.plan = LevelPlan(topology)
        self.layout = layout_for(self.plan.layout(), params)
        self.units = [MaintenanceUnit(s, self.layout, epoch, capacity=capacity) for s in range(self.layout.shards)]
        self.edges = {region: wire_edge(self.plan, self.layout, region, params, seed=seed + i) for i, region in enumerate(self.plan.edge_regions)}
        for edge in self.edges.values():
            for unit in self.units:
                for t in self.layout.tables:
                    edge.bootstrap(t.table_id, unit.shard, unit.snapshot(t.table_id))
        # With share_views every edge reads the first edge's views (Edge.read_views_of): the
        # batches are applied once, to it, and a loss is a loss for every edge. For a driver
        # that delivers every batch to every edge at the same instant (the simulator without
        # patch faults), where the replicas would be identical.
        self._appliers = list(self.edges.values())
        if share_views and self._appliers:
            first = self._appliers[0]
            for edge in self._appliers[1:]:
                edge.read_views_of(first)
            self._appliers = [first]
        # True while some view may still be behind its writer (a refused or lost batch).
        self._unsettled = False

    def unit_for(self, shard: int) -> MaintenanceUnit:
        return self.units[shard]

    def ingest(self, batch: KeyOpBatch, sender: str) -> ApplyReport:
        """Hand an agent's batch to the unit that owns its shard (``sender`` is the identity the
        transport authenticated). WrongShardError (``shard`` -1: no unit took it) for a shard
        the plane does not have, before any unit sees it."""
        n = len(self.units)
        if not 0 <= batch.shard < n:
            raise WrongShardError(f"batch for shard {batch.shard}: this plane's shards are 0..{n - 1}", shard=-1, got_shard=batch.shard, key=None)
        return self.units[batch.shard].apply(batch, sender)

    def propagate(self, drop: set[tuple[int, int, int]] | None = None) -> PropagationReport:
        """Flush every unit and deliver its batches to every edge; answer every resync action
        from the owning unit. ``drop`` names (table, shard, seq) batches to lose in transit, so
        tests can exercise gap repair."""
        lose = (lambda region, b: (b.table_id, b.shard, b.seq) in drop) if drop else None
        return self.deliver(self.flush(), lose, repair=True)

    @property
    def unsettled(self) -> bool:
        """Some view may still be behind its writer (a batch was lost or refused)."""
        return self._unsettled

    def flush(self) -> list[PatchBatch]:
        """Every unit's pending patch batches (what :meth:`deliver` then hands to the edges)."""
        return [b for u in self.units for b in u.flush()]

    def deliver(self, flushed: Sequence[PatchBatch], lose: Callable[[str, PatchBatch], bool] | None = None, *, repair: bool = True) -> PropagationReport:
        """Hand ``flushed`` to every edge; ``lose(edge_region, batch)`` says which deliveries go
        missing in transit. With ``repair`` every gap and refusal is answered now (the heartbeat
        of each unit's position makes even a lost last batch visible); without it the repair
        waits for the next call, one delivery round later, as a real repair waits for its round
        trip to the unit (the simulator's loss sweeps)."""
        if not flushed and not self._unsettled:
            # Nothing new and every view was current after the last round: a no-op (the
            # simulator calls this every few virtual milliseconds).
            return _NOTHING
        deliveries = resyncs = 0
        was_unsettled = self._unsettled
        if was_unsettled and not repair:
            resyncs += self._heal()  # the repairs asked for in the previous round arrive first
        refused = False
        for edge in self._appliers:
            mine: Sequence[PatchBatch] = flushed
            if lose is not None:
                mine = []
                for b in flushed:
                    if lose(edge.region, b):
                        refused = True
                    else:
                        mine.append(b)
            # The batches that apply cleanly, in one call; from the first that does not on, one
            # by one with its report and repair (exactly what the loop alone would do).
            done = edge.apply_patches_in_order([b.data for b in mine])
            deliveries += done
            for b in mine[done:]:
                out = edge.apply_patch(b.data)
                deliveries += 1
                if not out.applied:
                    refused = True
                    if repair:
                        resyncs += self._repair(edge, out)
        if repair and (refused or was_unsettled):
            resyncs += self._heal()
            self._unsettled = any(edge.pending_resyncs() for edge in self._appliers)
        else:
            self._unsettled = refused or (was_unsettled and any(edge.pending_resyncs() for edge in self._appliers))
        return PropagationReport(len(flushed), deliveries, resyncs, sum(len(b.data) for b in flushed))

    def _heal(self) -> int:
        """Heartbeats of every unit's position to every edge, then every open repair answered."""
        resyncs = 0
        for edge in self._appliers:
            for unit in self.units:
                for t in self.layout.tables:
                    epoch, seq = unit.position(t.table_id)
                    edge.note_writer_position(t.table_id, unit.shard, epoch, seq)
            for action in edge.pending_resyncs():
                resyncs += self._repair(edge, None, action.table, action.shard, action.epoch, action.seq)
        return resyncs

    def _repair(self, edge: Edge, out: PatchOutcome | None, table: int = -1, shard: int = -1, epoch: int = 0, seq: int = 0) -> int:
        if out is not None:
            if out.resync is None:
                return 0
            table, shard, epoch, seq = out.resync.table, out.resync.shard, out.resync.epoch, out.resync.seq
        for data in self.units[shard].resume(table, epoch, seq):
            edge.apply_patch(data)
        return 1

    def converged(self) -> bool:
        """Every edge's every view is byte-identical to its writer."""
        for edge in self.edges.values():
            for unit in self.units:
                for t in self.layout.tables:
                    if edge.view(t.table_id, unit.shard).digest() != unit.table_digest(t.table_id):
                        return False
        return True
