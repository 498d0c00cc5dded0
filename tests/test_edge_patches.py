"""Edge views: patch application, gaps, epoch changes and their resync actions.

Writers are real ``LudoTable`` s; the edge sees only their bytes. A repair is driven the way a
maintenance unit's ``resume(table, epoch, seq)`` would answer the edge's :class:`ResyncAction`:
the batches after ``seq`` of that epoch, or a snapshot. After every repair the views must equal
their writers byte for byte (digests).
"""

from __future__ import annotations

import numpy as np
import pytest

import kvcompass as kc
from kvcompass.discovery.edge import Edge, ResyncAction
from kvcompass.discovery.layout import IndexLayout, TableSpec, WorkerSpec
from kvcompass.errors import MalformedPatchError, UninitialisedViewError, WrongTableError

NS = kc.Namespace("llama-3.1-8b", "public")
PLAN = {"A": [256, 512], "B": [1024]}
RTT = {"A": 2.0, "B": 100.0}


def make() -> tuple[Edge, dict[tuple[int, int], kc.LudoTable]]:
    layout = IndexLayout((TableSpec(0, "A", ("a0", "a1")), TableSpec(1, "B", ("b0",))), shards=2, fp_bits=8)
    specs = [WorkerSpec("a0", "A"), WorkerSpec("a1", "A"), WorkerSpec("b0", "B")]
    writers = {(t, s): kc.LudoTable(table=t, shard=s, capacity=64, fp_bits=8) for t in range(2) for s in range(2)}
    return Edge("A", layout, specs, PLAN, RTT), writers


def bootstrap(edge: Edge, writers: dict[tuple[int, int], kc.LudoTable]) -> None:
    for (t, s), w in writers.items():
        assert edge.bootstrap(t, s, w.export_snapshot()).snapshot


def edits(w: kc.LudoTable, n: int, start: int = 0) -> list[bytes]:
    """``n`` batches of this writer, each setting a few keys of its shard."""
    out = []
    first = 1 + start * 97
    first += (w.shard - first) % 2  # keys of this shard only (key % 2 shards)
    keys = list(range(first, first + 6 * n, 2))
    for i in range(n):
        for k in keys[3 * i : 3 * i + 3]:
            w.set_field(k, 0, 1)
        b = w.take_batch()
        assert b is not None
        out.append(b)
    return out


def in_sync(edge: Edge, writers: dict[tuple[int, int], kc.LudoTable]) -> bool:
    return all(edge.view(t, s).digest() == w.digest() for (t, s), w in writers.items())


def test_views_start_uninitialised_and_bootstrap_from_snapshots() -> None:
    edge, writers = make()
    assert not edge.healthy
    assert edge.uninitialised == {(0, 0), (0, 1), (1, 0), (1, 1)}
    assert edge.pending_resyncs() == [ResyncAction(t, s, "snapshot", 0, 0) for t in range(2) for s in range(2)]
    # A delta before any snapshot: the view needs one.
    b = edits(writers[(0, 0)], 1)[0]
    out = edge.apply_patch(b)
    assert out.status == "snapshot_needed" and out.resync == ResyncAction(0, 0, "snapshot", 0, 0)
    bootstrap(edge, writers)
    assert edge.healthy and edge.pending_resyncs() == [] and edge.behind == frozenset()
    assert in_sync(edge, writers)


def test_batches_in_order_keep_views_equal_to_writers() -> None:
    edge, writers = make()
    bootstrap(edge, writers)
    for w in writers.values():
        for i, b in enumerate(edits(w, 3)):
            out = edge.apply_patch(b)
            assert out.applied and (out.table, out.shard, out.epoch, out.seq) == (w.table, w.shard, 1, i + 1)
    assert in_sync(edge, writers) and edge.healthy
    assert edge.stats.batches_applied == 4 + 12


def test_gap_marks_behind_asks_for_replay_and_clears_after_it() -> None:
    edge, writers = make()
    bootstrap(edge, writers)
    w = writers[(1, 0)]
    b1, b2, b3, b4 = edits(w, 4)
    assert edge.apply_patch(b1).applied
    before = edge.view(1, 0).digest()
    out = edge.apply_patch(b3)  # b2 lost
    assert out.status == "gap"
    assert out.resync == ResyncAction(1, 0, "replay", 1, 1)  # the view's position: resume(1, epoch 1, seq 1)
    assert edge.view(1, 0).digest() == before  # refused batches change nothing
    assert edge.behind == {(1, 0)} and not edge.healthy
    out = edge.apply_patch(b4)  # still behind: no second request, but the known head moves to 4
    assert out.status == "gap" and out.resync is None
    assert edge.pending_resyncs() == [ResyncAction(1, 0, "replay", 1, 1)]
    # The maintenance unit replays everything after seq 1.
    for b in (b2, b3):
        assert edge.apply_patch(b).applied
        assert edge.behind == {(1, 0)}  # not yet at seq 4, which the writer is known to have reached
    assert edge.apply_patch(b4).applied
    assert edge.behind == frozenset() and edge.healthy and in_sync(edge, writers)
    # The live stream's copy of b4 (or any replayed batch) arriving again is stale.
    assert edge.apply_patch(b4).status == "stale"
    st = edge.stats
    assert (st.gaps, st.resyncs_requested, st.stale_batches) == (2, 1, 1)


def test_gap_repaired_by_snapshot() -> None:
    edge, writers = make()
    bootstrap(edge, writers)
    w = writers[(0, 1)]
    _, _, b3 = edits(w, 3)
    assert edge.apply_patch(b3).resync == ResyncAction(0, 1, "replay", 1, 0)
    out = edge.apply_patch(w.export_snapshot())  # the log no longer reached back: a snapshot
    assert out.applied and out.snapshot and out.resync is None
    assert edge.healthy and in_sync(edge, writers)


def test_epoch_change_needs_a_snapshot_then_a_replay_of_the_rest() -> None:
    edge, writers = make()
    bootstrap(edge, writers)
    w = writers[(0, 0)]
    for b in edits(w, 2):
        assert edge.apply_patch(b).applied
    w.start_epoch(2)  # the writer restarted
    snap = w.export_snapshot()  # (2, 0)
    b1, b2 = edits(w, 2, start=7)  # (2, 1), (2, 2)
    out = edge.apply_patch(b2)
    assert out.status == "snapshot_needed" and out.resync == ResyncAction(0, 0, "snapshot", 1, 2)
    assert edge.apply_patch(b1).resync is None  # same repair outstanding
    out = edge.apply_patch(snap)
    # The new epoch's snapshot is older than what the writer is known to have sent: replay the rest.
    assert out.applied and out.resync == ResyncAction(0, 0, "replay", 2, 0)
    assert edge.behind == {(0, 0)}
    assert edge.apply_patch(b1).applied and edge.apply_patch(b2).applied
    assert edge.healthy and in_sync(edge, writers)
    assert edge.stats.epoch_changes == 2


def test_bad_batches_are_counted_and_change_nothing() -> None:
    edge, writers = make()
    bootstrap(edge, writers)
    w = writers[(0, 0)]
    b = edits(w, 1)[0]
    digests = {k: edge.view(*k).digest() for k in writers}
    corrupt = bytearray(b)
    corrupt[-10] ^= 0xFF
    out = edge.apply_patch(bytes(corrupt))
    assert out.status == "malformed" and out.error
    assert edge.apply_patch(b"KVCP").status == "malformed"
    alien = kc.LudoTable(table=7, shard=0, capacity=64, fp_bits=8)
    out = edge.apply_patch(alien.export_snapshot())
    assert (out.status, out.table) == ("wrong_table", 7)
    assert {k: edge.view(*k).digest() for k in writers} == digests
    assert edge.healthy
    st = edge.stats
    assert (st.malformed_batches, st.wrong_table_batches) == (2, 1)
    assert edge.apply_patch(b).applied


def test_bootstrap_replaces_the_view_and_validates_its_input() -> None:
    edge, writers = make()
    bootstrap(edge, writers)
    w = writers[(1, 1)]
    with pytest.raises(WrongTableError):
        edge.bootstrap(1, 0, w.export_snapshot())
    with pytest.raises(MalformedPatchError):
        edge.bootstrap(1, 1, b"nope")
    delta = edits(w, 1)[0]
    with pytest.raises(UninitialisedViewError):
        edge.bootstrap(1, 1, delta)  # a delta is not a snapshot
    assert edge.apply_patch(delta).applied  # the view is at (1, 1)
    # A view the writer considers "newer" (another life under the same epoch): a plain
    # apply would refuse the writer's snapshot as stale; bootstrap starts over from it.
    fresh = kc.LudoTable(table=1, shard=1, capacity=64, fp_bits=8)
    assert edge.apply_patch(fresh.export_snapshot()).status == "stale"
    assert edge.bootstrap(1, 1, fresh.export_snapshot()).applied
    assert edge.view(1, 1).digest() == fresh.digest()


def test_routing_reads_views_replaced_by_bootstrap() -> None:
    edge, writers = make()
    bootstrap(edge, writers)
    p = np.arange(600, dtype=np.uint32)
    w = kc.LudoTable(table=0, shard=0, capacity=64, fp_bits=8)
    w2 = kc.LudoTable(table=0, shard=1, capacity=64, fp_bits=8)
    for c in (256, 512):
        k = int(NS.keys(p, [c])[0])
        (w if k % 2 == 0 else w2).set_field(k, 1, 1)
    w.take_batch()
    w2.take_batch()
    assert edge.route(p, NS, 0.0).expected_match == 0
    edge.bootstrap(0, 0, w.export_snapshot())
    edge.bootstrap(0, 1, w2.export_snapshot())
    d = edge.route(p, NS, 10.0)
    assert (d.worker, d.expected_match) == ("a1", 512)


def test_resync_actions_are_what_the_maintenance_unit_resumes_from() -> None:
    from kvcompass.discovery.maintenance import MaintenanceUnit
    from kvcompass.discovery.key_ops import KeyOpBatch

    layout = IndexLayout((TableSpec(0, "A", ("a0", "a1")), TableSpec(1, "B", ("b0",))), shards=1, fp_bits=8)
    unit = MaintenanceUnit(0, layout, epoch=1)
    edge = Edge("A", layout, [WorkerSpec("a0", "A"), WorkerSpec("a1", "A"), WorkerSpec("b0", "B")], PLAN, RTT)
    for t in (0, 1):
        edge.bootstrap(t, 0, unit.snapshot(t))
    p = np.arange(700, dtype=np.uint32)
    batches = []
    for seq, c in enumerate([256, 512], start=1):
        keys = NS.keys(p, [c])
        unit.apply(KeyOpBatch("a1", 1, 0, seq, keys, np.ones(1, dtype=np.uint8)), sender="a1")
        batches += [b.data for b in unit.flush()]
    assert len(batches) == 2
    out = edge.apply_patch(batches[1])  # the first was lost
    assert out.resync is not None and (out.resync.kind, out.resync.epoch, out.resync.seq) == ("replay", 1, 0)
    a = out.resync
    for b in unit.resume(a.table, a.epoch, a.seq):
        edge.apply_patch(b)
    assert edge.healthy and edge.view(0, 0).digest() == unit.table_digest(0)
    assert edge.route(p, NS, 0.0).worker == "a1"
