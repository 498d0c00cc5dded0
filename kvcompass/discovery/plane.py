"""A whole discovery plane in one process: every maintenance unit and every edge of a topology,
wired by direct calls instead of sockets.

This is the assembly the simulator and the demo drive, and what integration tests use to check
agent -> maintenance -> patches -> edges -> route end to end. The gRPC services wire the very
same objects across processes.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvcompass.discovery.edge import Edge, PatchOutcome
from kvcompass.discovery.maintenance import ApplyReport, MaintenanceUnit, PatchBatch
from kvcompass.discovery.ops import KeyOpBatch
from kvcompass.discovery.params import EdgeParams, layout_for
from kvcompass.discovery.plan import LevelPlan
from kvcompass.discovery.topology import Topology

__all__ = ["LocalPlane", "PropagationReport"]


@dataclass(frozen=True, slots=True)
class PropagationReport:
    """What one round of patch delivery did."""

    batches: int
    deliveries: int
    resyncs: int
    patch_bytes: int


class LocalPlane:
    """Maintenance units for every shard plus an edge per edge region, bootstrapped from the
    units' snapshots and kept current by :meth:`propagate`."""

    def __init__(self, topology: Topology, *, epoch: int = 1, capacity: int = 4096, params: EdgeParams = EdgeParams(), seed: int = 0) -> None:
        self.topology = topology
        self.plan = LevelPlan(topology)
        self.layout = layout_for(self.plan.layout(), params)
        self.units = [MaintenanceUnit(s, self.layout, epoch, capacity=capacity) for s in range(self.layout.shards)]
        by_id = {w.id: w for w in topology.workers}
        workers = [by_id[w] for w in self.layout.workers]
        regions = list(dict.fromkeys(t.region for t in self.layout.tables))
        self.edges: dict[str, Edge] = {}
        for i, region in enumerate(self.plan.edge_regions):
            targets = list(dict.fromkeys([region, *regions]))
            self.edges[region] = Edge(
                region,
                self.layout,
                workers,
                {r: self.plan.lengths(region, r) for r in targets},
                {r: self.plan.rtt_ms(region, r) for r in targets},
                params,
                seed=seed + i,
            )
        for edge in self.edges.values():
            for unit in self.units:
                for t in self.layout.tables:
                    edge.bootstrap(t.table_id, unit.shard, unit.snapshot(t.table_id))
        # True while some view may still be behind its writer (a refused or lost batch).
        self._unsettled = False

    def unit_for(self, shard: int) -> MaintenanceUnit:
        return self.units[shard]

    def ingest(self, batch: KeyOpBatch, sender: str) -> ApplyReport:
        """Hand an agent's batch to the unit that owns its shard (``sender`` is the identity the
        transport authenticated)."""
        return self.units[batch.shard].apply(batch, sender)

    def propagate(self, drop: set[tuple[int, int, int]] | None = None) -> PropagationReport:
        """Flush every unit and deliver its batches to every edge; answer every resync action
        from the owning unit. ``drop`` names (table, shard, seq) batches to lose in transit, so
        tests can exercise gap repair."""
        flushed: list[PatchBatch] = [b for u in self.units for b in u.flush()]
        if not flushed and not drop and not self._unsettled:
            # Nothing new and every view was current after the last round: a no-op (the
            # simulator calls this every few virtual milliseconds).
            return PropagationReport(0, 0, 0, 0)
        deliveries = resyncs = 0
        refused = False
        for edge in self.edges.values():
            for b in flushed:
                if drop and (b.table_id, b.shard, b.seq) in drop:
                    refused = True
                    continue
                out = edge.apply_patch(b.data)
                deliveries += 1
                refused |= not out.applied
                resyncs += self._repair(edge, out)
        if refused or drop or self._unsettled:
            # Something went missing or was refused: the heartbeat (each unit's position per
            # table) makes even a lost *last* batch visible, then every open repair is answered.
            for edge in self.edges.values():
                for unit in self.units:
                    for t in self.layout.tables:
                        epoch, seq = unit.position(t.table_id)
                        edge.note_writer_position(t.table_id, unit.shard, epoch, seq)
                for action in edge.pending_resyncs():
                    resyncs += self._repair(edge, None, action.table, action.shard, action.epoch, action.seq)
        self._unsettled = any(edge.pending_resyncs() for edge in self.edges.values()) if (refused or drop or self._unsettled) else False
        return PropagationReport(len(flushed), deliveries, resyncs, sum(len(b.data) for b in flushed))

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
