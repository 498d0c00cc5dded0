"""The maintenance unit of one shard: authenticated, validated key ops in; sequenced patch
batches out; replay, snapshots and restarts; views that follow it converge byte for byte."""

from __future__ import annotations

import struct
from collections.abc import Callable, Sequence

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import kvcompass as kc
from kvcompass import errors as E
from kvcompass.discovery.layout import IndexLayout, TableSpec
from kvcompass.discovery.maintenance import MaintenanceUnit, PatchBatch
from kvcompass.discovery.key_ops import KeyOpBatch

SHARDS = 3
SHARD = 2
LAYOUT = IndexLayout((TableSpec(0, "us", ("a", "b", "c")), TableSpec(1, "eu", ("d", "e"))), shards=SHARDS)
FIELD = {w: LAYOUT.field_of(w) for w in LAYOUT.workers}

Model = dict[int, dict[str, int]]  # key -> worker -> tier (nonzero only)


def shard_keys(seed: int, n: int, shard: int = SHARD) -> list[int]:
    """``n`` distinct 63-bit keys owned by ``shard``."""
    rng = np.random.default_rng(seed)
    raw = np.unique(rng.integers(0, 2**60, size=2 * n + 8, dtype=np.uint64))
    rng.shuffle(raw)
    return [int(k) * SHARDS + shard for k in raw[:n]]


KEYS = shard_keys(1, 64)


def batch(worker: str, seq: int, ops: Sequence[tuple[int, int]], *, inc: int = 1, reset: bool = False, shard: int = SHARD) -> KeyOpBatch:
    keys = np.array([k for k, _ in ops], dtype=np.uint64)
    tiers = np.array([t for _, t in ops], dtype=np.uint8)
    return KeyOpBatch(worker, inc, shard, seq, keys, tiers, reset)


class Agents:
    """Well-behaved agents: each batch gets the worker's next seq."""

    def __init__(self, unit: MaintenanceUnit) -> None:
        self.unit = unit
        self.seq: dict[str, int] = {}

    def send(self, worker: str, ops: Sequence[tuple[int, int]], *, reset: bool = False) -> None:
        self.seq[worker] = self.seq.get(worker, 0) + 1
        self.unit.apply(batch(worker, self.seq[worker], ops, reset=reset), worker)


def views_for(unit: MaintenanceUnit) -> list[kc.LudoView]:
    vs = []
    for t in LAYOUT.tables:
        v = kc.LudoView(t.table_id, SHARD)
        for b in unit.resume(t.table_id, 0, 0):
            v.apply_batch(b)
        vs.append(v)
    return vs


def deliver(unit: MaintenanceUnit, views: list[kc.LudoView], batches: list[PatchBatch]) -> None:
    """What an edge does: apply in order; on a gap or a new epoch, resume; drop stale batches."""
    for pb in batches:
        v = views[pb.table_id]
        try:
            v.apply_batch(pb.data)
        except E.StalePatchError:
            pass
        except (E.SequenceGapError, E.EpochChangedError):
            for b in unit.resume(pb.table_id, v.epoch, v.seq):
                v.apply_batch(b)


def assert_converged(unit: MaintenanceUnit, views: list[kc.LudoView]) -> None:
    for t, v in zip(LAYOUT.tables, views, strict=True):
        assert (v.epoch, v.seq) == unit.position(t.table_id)
        assert v.state_bytes() == unit.table(t.table_id).view_state()
        assert v.digest() == unit.table_digest(t.table_id)


def table_model(unit: MaintenanceUnit) -> Model:
    out: Model = {}
    for spec in LAYOUT.tables:
        keys, values = unit.table(spec.table_id).entries()
        for k, val in zip(keys.tolist(), values.tolist(), strict=True):
            for f, w in enumerate(spec.workers):
                if (tier := (val >> (2 * f)) & 3) != 0:
                    out.setdefault(k, {})[w] = tier
    return out


def snapshot_of(unit: MaintenanceUnit) -> tuple[object, ...]:
    """Everything a rejected batch must leave unchanged."""
    tables = tuple((t.digest(), t.pending_ops, t.seq, len(t)) for t in (unit.table(s.table_id) for s in LAYOUT.tables))
    return (unit.digest(), tables, {w: unit.agent_position(w) for w in LAYOUT.workers}, table_model(unit))


@pytest.fixture
def unit() -> MaintenanceUnit:
    return MaintenanceUnit(SHARD, LAYOUT, epoch=1, capacity=64)


# ---- the happy path -----------------------------------------------------------------------


def test_large_batches_write_each_workers_own_field(unit: MaintenanceUnit) -> None:
    """Batches of hundreds of ops from workers of one table (the unit's run of field numbers
    grows past its first size) land in each sender's field and no other."""
    keys = shard_keys(5, 700)
    agents = Agents(unit)
    spans = {"a": (0, 400), "b": (300, 600), "c": (550, 700)}
    for w, (lo, hi) in spans.items():
        agents.send(w, [(k, 1 + (w == "c")) for k in keys[lo:hi]])
    for w, (lo, hi) in spans.items():
        assert np.array_equal(unit.held(w), np.sort(np.array(keys[lo:hi], dtype=np.uint64)))
    t = unit.table(0)  # a, b and c share table 0
    fa, fb, fc = FIELD["a"].field, FIELD["b"].field, FIELD["c"].field
    assert t.get(keys[350]) == (1 << (2 * fa)) | (1 << (2 * fb))
    assert t.get(keys[580]) == (1 << (2 * fb)) | (2 << (2 * fc))


def test_followers_converge_byte_for_byte(unit: MaintenanceUnit) -> None:
    rng = np.random.default_rng(7)
    views = views_for(unit)
    agents = Agents(unit)
    model: Model = {}
    for _ in range(40):
        for w in LAYOUT.workers:
            ops = [(KEYS[int(i)], int(rng.integers(0, 3))) for i in rng.integers(0, len(KEYS), size=int(rng.integers(0, 8)))]
            agents.send(w, ops)
            for k, t in ops:
                model.setdefault(k, {})[w] = t
        deliver(unit, views, unit.flush())
        assert_converged(unit, views)
    want = {k: {w: t for w, t in d.items() if t} for k, d in model.items()}
    assert table_model(unit) == {k: d for k, d in want.items() if d}
    for spec in LAYOUT.tables:
        unit.table(spec.table_id).verify()
    # Every held key reads back through the follower exactly as the writer holds it.
    for spec, v in zip(LAYOUT.tables, views, strict=True):
        keys, values = unit.table(spec.table_id).entries()
        assert v.lookup_batch(keys).tolist() == values.tolist()


def test_flush_batches_are_sequenced_per_table(unit: MaintenanceUnit) -> None:
    assert unit.flush() == []
    unit.apply(batch("a", 1, [(KEYS[0], 1)]), "a")
    unit.apply(batch("d", 1, [(KEYS[0], 2)]), "d")
    out = unit.flush()
    assert [(b.table_id, b.shard, b.epoch, b.seq, b.snapshot) for b in out] == [(0, SHARD, 1, 1, False), (1, SHARD, 1, 1, False)]
    for b in out:
        h = kc.decode_batch_header(b.data)
        assert (h["table"], h["shard"], h["epoch"], h["seq"]) == (b.table_id, b.shard, b.epoch, b.seq)
    unit.apply(batch("a", 2, [(KEYS[1], 1)]), "a")
    assert [(b.table_id, b.seq) for b in unit.flush()] == [(0, 2)]
    assert unit.flush() == []
    s = unit.stats
    assert (s.batches_in, s.ops_in, s.batches_out, s.log_batches) == (3, 3, 3, 3)
    assert s.bytes_out == s.log_bytes > 0
    assert s.entries == 3 and s.rejected == {}  # KEYS[0] in both tables, KEYS[1]


# ---- rejected input: precise errors, nothing changes --------------------------------------


@pytest.fixture
def busy(unit: MaintenanceUnit) -> MaintenanceUnit:
    unit.apply(batch("a", 1, [(KEYS[0], 1), (KEYS[1], 2)]), "a")
    unit.apply(batch("b", 1, [(KEYS[1], 1)]), "b")
    unit.flush()
    unit.apply(batch("a", 2, [(KEYS[2], 1)]), "a")  # left pending on purpose
    return unit


REJECTS: list[tuple[str, Callable[[], tuple[KeyOpBatch, str]], type[Exception], dict[str, object]]] = [
    ("forged", lambda: (batch("a", 3, [(KEYS[1], 0)]), "b"), E.ForbiddenWriteError, {"worker": "b", "target": "a"}),
    ("forged-unknown-sender", lambda: (batch("a", 3, [(KEYS[1], 0)]), "mallory"), E.ForbiddenWriteError, {"worker": "mallory"}),
    ("unknown-worker", lambda: (batch("zed", 1, [(KEYS[1], 1)]), "zed"), E.UnknownWorkerError, {"worker": "zed"}),
    ("batch-shard", lambda: (batch("a", 3, [(KEYS[1], 0)], shard=0), "a"), E.WrongShardError, {"shard": SHARD, "got_shard": 0, "key": None}),
    ("key-shard", lambda: (batch("a", 3, [(KEYS[3], 1), (KEYS[4] - 1, 1)]), "a"), E.WrongShardError, {"shard": SHARD, "got_shard": 1, "key": KEYS[4] - 1}),
    ("key-63-bit", lambda: (batch("a", 3, [(KEYS[3], 1), (2**63 + 1, 1)]), "a"), E.InvalidKeyError, {"key": 2**63 + 1}),
    ("tier-3", lambda: (batch("a", 3, [(KEYS[3], 1), (KEYS[4], 3)]), "a"), E.InvalidTierError, {"tier": 3}),
    ("tier-255", lambda: (batch("a", 3, [(KEYS[4], 255)]), "a"), E.InvalidTierError, {"tier": 255}),
    ("gap", lambda: (batch("a", 4, [(KEYS[3], 1)]), "a"), E.AgentSequenceError, {"expected": 3, "got": 4, "worker": "a"}),
    ("stale-incarnation", lambda: (batch("a", 3, [(KEYS[3], 1)], inc=0), "a"), E.StaleIncarnationError, {"expected": 1, "got": 0, "worker": "a"}),
    ("new-incarnation-not-at-1", lambda: (batch("a", 2, [(KEYS[3], 1)], inc=2), "a"), E.AgentSequenceError, {"expected": 1, "got": 2}),
    ("first-batch-not-at-1", lambda: (batch("c", 5, [(KEYS[3], 1)]), "c"), E.AgentSequenceError, {"expected": 1, "got": 5}),
]


@pytest.mark.parametrize(("make", "cls", "attrs"), [pytest.param(m, c, a, id=i) for i, m, c, a in REJECTS])
def test_rejected_batch_changes_nothing(busy: MaintenanceUnit, make: Callable[[], tuple[KeyOpBatch, str]], cls: type[Exception], attrs: dict[str, object]) -> None:
    before = snapshot_of(busy)
    b, sender = make()
    with pytest.raises(cls) as info:
        busy.apply(b, sender)
    for name, value in attrs.items():
        assert getattr(info.value, name) == value, name
    assert str(info.value)
    assert snapshot_of(busy) == before
    assert busy.stats.rejected == {cls.__name__: 1}
    assert busy.stats.batches_in == 3
    # The unit still works: the agent's real next batch is applied.
    busy.apply(batch("a", 3, [(KEYS[5], 2)]), "a")
    assert table_model(busy)[KEYS[5]] == {"a": 2}


def test_error_classes() -> None:
    assert issubclass(E.WrongShardError, E.KVCompassError) and issubclass(E.WrongShardError, ValueError)
    assert issubclass(E.StaleIncarnationError, E.AgentSequenceError)
    assert issubclass(E.ForbiddenWriteError, PermissionError)
    for name in ("WrongShardError", "StaleIncarnationError"):
        assert name in E.__all__


def test_capacity_is_checked_before_anything_changes() -> None:
    u = MaintenanceUnit(SHARD, LAYOUT, epoch=1, capacity=4, max_capacity=6)
    u.apply(batch("a", 1, [(k, 1) for k in KEYS[:5]]), "a")
    before = snapshot_of(u)
    with pytest.raises(E.CapacityError) as info:
        u.apply(batch("a", 2, [(k, 1) for k in KEYS[5:7]]), "a")
    assert (info.value.needed, info.value.max) == (7, 6)
    assert snapshot_of(u) == before
    # Removals in the same batch make room: exactly at the limit is fine.
    u.apply(batch("a", 2, [(KEYS[0], 0), (KEYS[5], 1), (KEYS[6], 2)]), "a")
    assert len(u.table(0)) == 6
    # Another worker's tier on a key that exists costs no room.
    u.apply(batch("b", 1, [(k, 2) for k in KEYS[1:7]]), "b")
    assert len(u.table(0)) == 6


def test_refusals_come_in_a_fixed_order_and_change_nothing() -> None:
    """A malformed op is named before the batch's place in its worker's sequence, and a refused
    or duplicate place before the table's capacity: the error does not depend on which other
    checks would fail, and no refused batch changes the unit."""
    u = MaintenanceUnit(SHARD, LAYOUT, epoch=1, capacity=4, max_capacity=6)
    u.apply(batch("a", 1, [(k, 1) for k in KEYS[:5]]), "a")
    before = snapshot_of(u)
    with pytest.raises(E.InvalidTierError):  # out of sequence (3 after 1) too
        u.apply(batch("a", 3, [(KEYS[5], 1), (KEYS[6], 7)]), "a")
    with pytest.raises(E.InvalidKeyError):  # a stale incarnation too
        u.apply(batch("a", 2, [(1 << 63 | KEYS[5], 1)], inc=0), "a")
    with pytest.raises(E.AgentSequenceError) as seq:  # over capacity too
        u.apply(batch("a", 3, [(k, 1) for k in KEYS[5:8]]), "a")
    assert (seq.value.expected, seq.value.got) == (2, 3)
    assert snapshot_of(u) == before
    dup = u.apply(batch("a", 1, [(k, 1) for k in KEYS[5:8]]), "a")  # over capacity: a duplicate all the same
    assert dup.duplicate and dup.applied == 0 and snapshot_of(u) == before
    with pytest.raises(E.CapacityError):
        u.apply(batch("a", 2, [(k, 1) for k in KEYS[5:8]]), "a")
    assert snapshot_of(u) == before
    assert u.stats.rejected == {"InvalidTierError": 1, "InvalidKeyError": 1, "AgentSequenceError": 1, "CapacityError": 1}


# ---- agent sequencing ----------------------------------------------------------------------


def test_duplicates_are_ignored_and_counted(unit: MaintenanceUnit) -> None:
    unit.apply(batch("a", 1, [(KEYS[0], 1)]), "a")
    unit.apply(batch("a", 2, [(KEYS[0], 2)]), "a")
    before = snapshot_of(unit)
    r = unit.apply(batch("a", 1, [(KEYS[0], 1)]), "a")
    assert r.duplicate and r.applied == 0 and r.ops == 1
    assert unit.apply(batch("a", 2, [(KEYS[0], 1)]), "a").duplicate
    assert unit.apply(batch("a", 2, [], reset=True), "a").duplicate  # a reset is no exception
    assert snapshot_of(unit) == before
    s = unit.stats
    assert (s.duplicates, s.batches_in, s.ops_applied) == (3, 5, 2)
    assert table_model(unit) == {KEYS[0]: {"a": 2}}


def test_gap_then_reset_re_report_recovers(unit: MaintenanceUnit) -> None:
    unit.apply(batch("a", 1, [(KEYS[0], 1), (KEYS[1], 1)]), "a")
    # Batches 2 and 3 were lost (they had removed KEYS[0] and added KEYS[2]).
    with pytest.raises(E.AgentSequenceError) as info:
        unit.apply(batch("a", 4, [(KEYS[3], 1)]), "a")
    assert (info.value.expected, info.value.got) == (2, 4)
    # The agent re-reports its full inventory of the shard at its next seq.
    r = unit.apply(batch("a", 5, [(KEYS[1], 1), (KEYS[2], 2), (KEYS[3], 1)], reset=True), "a")
    assert r.reset and not r.duplicate and r.cleared == 1
    assert unit.agent_position("a") == (1, 5)
    assert table_model(unit) == {KEYS[1]: {"a": 1}, KEYS[2]: {"a": 2}, KEYS[3]: {"a": 1}}
    unit.apply(batch("a", 6, [(KEYS[1], 0)]), "a")
    assert unit.held("a").tolist() == sorted([KEYS[2], KEYS[3]])


def test_incarnations(unit: MaintenanceUnit) -> None:
    unit.apply(batch("a", 1, [(KEYS[0], 1)]), "a")
    unit.apply(batch("a", 2, [(KEYS[1], 1)]), "a")
    # The engine restarted: a new incarnation opens at seq 1 (here without a reset).
    unit.apply(batch("a", 1, [(KEYS[2], 1)], inc=2), "a")
    assert unit.agent_position("a") == (2, 1)
    with pytest.raises(E.StaleIncarnationError):
        unit.apply(batch("a", 3, [(KEYS[3], 1)], inc=1), "a")
    # ... or with a reset at any seq, which drops what the old incarnation held.
    unit.apply(batch("a", 7, [(KEYS[4], 2)], inc=3, reset=True), "a")
    assert table_model(unit) == {KEYS[4]: {"a": 2}}
    assert unit.agent_position("a") == (3, 7)


def test_reset_clears_only_that_workers_fields(unit: MaintenanceUnit) -> None:
    other = MaintenanceUnit(0, LAYOUT, epoch=1, capacity=64)  # shard 0 of the same layout
    k0 = shard_keys(2, 3, shard=0)
    other.apply(batch("a", 1, [(k, 1) for k in k0], shard=0), "a")
    unit.apply(batch("a", 1, [(KEYS[0], 1), (KEYS[1], 2), (KEYS[2], 1)]), "a")
    unit.apply(batch("b", 1, [(KEYS[1], 1), (KEYS[2], 2)]), "b")
    unit.apply(batch("d", 1, [(KEYS[0], 2)]), "d")  # another table, same key
    views = views_for(unit)
    deliver(unit, views, unit.flush())

    # Re-report KEYS[2] at its current tier: the reset drops KEYS[0] and KEYS[1] only.
    r = unit.apply(batch("a", 2, [(KEYS[2], 1)], reset=True), "a")
    assert (r.cleared, r.applied) == (2, 3)
    assert table_model(unit) == {KEYS[0]: {"d": 2}, KEYS[1]: {"b": 1}, KEYS[2]: {"a": 1, "b": 2}}
    assert unit.held("a").tolist() == [KEYS[2]]
    assert other.held("a").tolist() == sorted(k0)
    out = unit.flush()
    assert [b.table_id for b in out] == [0]  # table 1 untouched
    assert kc.decode_batch_header(out[0].data)["n_ops"] == 2  # KEYS[2] unchanged emits nothing
    deliver(unit, views, out)
    assert_converged(unit, views)
    # An empty reset clears everything the worker held.
    unit.apply(batch("a", 3, [], reset=True), "a")
    assert unit.held("a").size == 0 and unit.held("b").tolist() == sorted([KEYS[1], KEYS[2]])


def test_coalescing_within_a_batch(unit: MaintenanceUnit) -> None:
    unit.apply(batch("a", 1, [(KEYS[0], 1), (KEYS[0], 0)]), "a")
    assert unit.flush() == []  # set then clear: nothing on the wire
    assert len(unit.table(0)) == 0
    unit.apply(batch("a", 2, [(KEYS[0], 1), (KEYS[1], 2), (KEYS[0], 2), (KEYS[1], 1), (KEYS[0], 1)]), "a")
    assert table_model(unit) == {KEYS[0]: {"a": 1}, KEYS[1]: {"a": 1}}
    out = unit.flush()
    assert len(out) == 1 and kc.decode_batch_header(out[0].data)["n_ops"] == 2
    # Change and change back within one batch: nothing on the wire.
    r = unit.apply(batch("a", 3, [(KEYS[0], 2), (KEYS[0], 0), (KEYS[0], 1)]), "a")
    assert (r.ops, r.applied) == (3, 1)
    assert unit.flush() == []


# ---- resume --------------------------------------------------------------------------------


def fill(unit: MaintenanceUnit, agents: Agents, rounds: int, start: int = 0) -> list[PatchBatch]:
    """``rounds`` agent batches, each a net change, each flushed into exactly one batch."""
    out = []
    for i in range(start, start + rounds):
        agents.send("a", [(KEYS[i], 1 + i % 2), (KEYS[max(i - 3, 0) + 32], 0)])
        out += unit.flush()
    assert len(out) == rounds
    return out


def test_resume_from_current_and_from_the_log(unit: MaintenanceUnit) -> None:
    agents = Agents(unit)
    v = views_for(unit)[0]
    assert unit.resume(0, 1, 0) == []  # current (nothing emitted yet)
    early = fill(unit, agents, 3)
    for b in early:
        v.apply_batch(b.data)
    assert unit.resume(0, v.epoch, v.seq) == []
    later = fill(unit, agents, 5, start=3)
    got = unit.resume(0, v.epoch, v.seq)
    assert got == [b.data for b in later]
    for data in got:
        assert not v.apply_batch(data).snapshot
    assert (v.epoch, v.seq) == unit.position(0) and v.state_bytes() == unit.table(0).view_state()
    assert unit.stats.replays_served == 1
    # From the middle of the log: exactly the tail.
    assert unit.resume(0, 1, 5) == [b.data for b in later[2:]]


def test_resume_closes_pending_edits_first(unit: MaintenanceUnit) -> None:
    agents = Agents(unit)
    views = views_for(unit)
    deliver(unit, views, fill(unit, agents, 2))
    agents.send("a", [(KEYS[40], 2)])  # pending
    # A view that is current so far gets the just-closed batch...
    got = unit.resume(0, 1, 2)
    assert len(got) == 1 and kc.decode_batch_header(got[0])["seq"] == 3
    late = kc.LudoView(0, SHARD)
    for b in unit.resume(0, 0, 0):  # ...and a fresh one a snapshot that already contains it
        late.apply_batch(b)
    assert late.seq == 3
    views[0].apply_batch(got[0])
    # The closed batch also goes out with the next flush; views that resumed drop it as stale.
    out = unit.flush()
    assert [(b.table_id, b.seq) for b in out] == [(0, 3)]
    with pytest.raises(E.StalePatchError):
        late.apply_batch(out[0].data)
    agents.send("a", [(KEYS[41], 1)])
    nxt = unit.flush()
    late.apply_batch(nxt[0].data)
    deliver(unit, views, nxt)
    assert late.state_bytes() == views[0].state_bytes() == unit.table(0).view_state()
    # snapshot() also closes pending edits first.
    agents.send("a", [(KEYS[42], 1)])
    s = unit.snapshot(0)
    assert kc.decode_batch_header(s)["seq"] == 5 and [b.seq for b in unit.flush()] == [5]


def test_resume_after_trimming_gives_a_snapshot() -> None:
    u = MaintenanceUnit(SHARD, LAYOUT, epoch=1, capacity=64, log_batches=3)
    agents = Agents(u)
    v = views_for(u)[0]
    fill(u, agents, 2)  # v stays at seq 0
    assert u.stats.log_batches == 2
    assert len(u.resume(0, 1, 0)) == 2  # still in the log
    fill(u, agents, 4, start=2)
    assert u.stats.log_batches == 3  # seqs 4..6
    assert len(u.resume(0, 1, 3)) == 3
    got = u.resume(0, 1, 1)
    assert len(got) == 1
    r = v.apply_batch(got[0])
    assert r.snapshot and (r.epoch, r.seq) == (1, 6)
    assert v.state_bytes() == u.table(0).view_state()
    agents.send("a", [(KEYS[50], 1)])
    v.apply_batch(u.flush()[0].data)  # the snapshot is followed by the next live batch
    assert v.state_bytes() == u.table(0).view_state()
    assert u.stats.snapshots_served == 3  # views_for bootstraps both tables by snapshots too


def test_log_is_bounded_by_bytes() -> None:
    u = MaintenanceUnit(SHARD, LAYOUT, epoch=1, capacity=64, log_bytes=400)
    agents = Agents(u)
    out = fill(u, agents, 30)
    s = u.stats
    assert 0 < s.log_bytes <= 400 and s.log_batches < 30
    assert s.bytes_out == sum(len(b.data) for b in out)
    kept = u.resume(0, 1, 30 - s.log_batches)
    assert kept == [b.data for b in out[-s.log_batches :]]
    # A bound smaller than one batch keeps nothing: every catch-up is a snapshot.
    tiny = MaintenanceUnit(SHARD, LAYOUT, epoch=1, capacity=64, log_bytes=1)
    fill(tiny, Agents(tiny), 3)
    assert tiny.stats.log_batches == 0
    assert kc.LudoView(0, SHARD).apply_batch(tiny.resume(0, 1, 2)[0]).snapshot


@pytest.mark.parametrize(
    ("unit_epoch", "epoch", "seq"),
    [(1, 0, 0), (2, 1, 0), (2, 1, 2), (1, 2, 1), (1, 1, 99)],
    ids=["never", "old-epoch-seq0", "old-epoch", "future-epoch", "future-seq"],
)
def test_resume_from_another_epoch_or_the_future_gives_a_snapshot(unit_epoch: int, epoch: int, seq: int) -> None:
    u = MaintenanceUnit(SHARD, LAYOUT, epoch=unit_epoch, capacity=64)
    fill(u, Agents(u), 3)
    got = u.resume(0, epoch, seq)
    assert len(got) == 1
    h = kc.decode_batch_header(got[0])
    assert (h["epoch"], h["seq"], h["n_ops"]) == (*u.position(0), 1)
    v = kc.LudoView(0, SHARD)
    assert v.apply_batch(got[0]).snapshot and v.state_bytes() == u.table(0).view_state()


def test_unknown_table_is_refused(unit: MaintenanceUnit) -> None:
    for call in (lambda: unit.resume(2, 1, 0), lambda: unit.snapshot(-1), lambda: unit.table_digest(5), lambda: unit.position(9)):
        with pytest.raises(E.InvalidArgumentError):
            call()


# ---- growth and rebuilds --------------------------------------------------------------------


def test_growth_rebuild_snapshots_flow_through() -> None:
    u = MaintenanceUnit(SHARD, LAYOUT, epoch=1, capacity=8)
    keys = shard_keys(3, 3000)
    views = views_for(u)
    lagging = views_for(u)[0]
    agents = Agents(u)
    snaps = 0
    for i in range(0, len(keys), 150):
        agents.send("b", [(k, 1) for k in keys[i : i + 150]])
        agents.send("e", [(k, 2) for k in keys[i : i + 150 : 3]])
        out = u.flush()
        snaps += sum(b.snapshot for b in out)
        for b in out:
            assert views[b.table_id].apply_batch(b.data).snapshot == b.snapshot
        assert_converged(u, views)
    assert 2 <= snaps <= u.stats.rebuilds  # several rebuilds between two flushes make one snapshot
    assert u.table(0).capacity >= 3000
    # A view that missed everything catches up from the log's latest rebuild snapshot on.
    got = u.resume(0, lagging.epoch, lagging.seq)
    assert kc.LudoView(0, SHARD).apply_batch(got[0]).snapshot
    assert len(got) < u.position(0)[1]
    for data in got:
        lagging.apply_batch(data)
    assert lagging.state_bytes() == u.table(0).view_state()
    u.table(0).verify()
    u.table(1).verify()


# ---- restart --------------------------------------------------------------------------------


def test_restart_from_bytes_under_a_new_epoch() -> None:
    u = MaintenanceUnit(SHARD, LAYOUT, epoch=3, capacity=128)  # no growth: deltas, not snapshots
    agents = Agents(u)
    views = views_for(u)
    for i in range(6):
        agents.send("a", [(KEYS[j], 1 + (i + j) % 2) for j in range(i, i + 20)])
        agents.send("c", [(KEYS[j], 2) for j in range(i * 3, i * 3 + 5)])
        agents.send("e", [(KEYS[j], 1) for j in range(i, 40, 4)])
        deliver(u, views, u.flush())
    agents.send("a", [(KEYS[60], 1)])  # pending at the crash: persisted anyway
    model = table_model(u)
    held = {w: u.held(w).tolist() for w in LAYOUT.workers}
    data = u.to_bytes()

    r = MaintenanceUnit.from_bytes(data, LAYOUT, new_epoch=4, capacity=128)
    assert r.epoch == 4 and r.position(0) == (4, 0) and r.position(1) == (4, 0)
    assert table_model(r) == model and {w: r.held(w).tolist() for w in LAYOUT.workers} == held
    assert r.stats.log_batches == 0 and r.agent_position("a") is None

    # The agents' sequences open afresh: a plain next batch is a gap; a reset re-report is taken.
    with pytest.raises(E.AgentSequenceError) as info:
        r.apply(batch("c", agents.seq["c"] + 1, [(KEYS[0], 1)]), "c")
    assert (info.value.expected, info.value.got) == (1, agents.seq["c"] + 1)
    r.apply(batch("c", agents.seq["c"] + 1, [(KEYS[0], 1)], reset=True), "c")
    r.apply(batch("a", agents.seq["a"] + 1, [(k, model[k]["a"]) for k in held["a"]] + [(KEYS[61], 2)], reset=True), "a")
    out = r.flush()
    assert [(b.epoch, b.seq, b.snapshot) for b in out] == [(4, 1, False)]
    for b in out:
        with pytest.raises(E.EpochChangedError):
            views[b.table_id].apply_batch(b.data)
    deliver(r, views, out)  # table 0: EpochChangedError, then resume gives a snapshot
    assert [b.table_id for b in out] == [0]
    v1 = views[1]  # table 1 had no delta in the new epoch yet: its edge asks
    assert v1.epoch == 3
    (snap,) = r.resume(1, v1.epoch, v1.seq)
    assert v1.apply_batch(snap).snapshot
    assert_converged(r, views)
    want: Model = {}
    for k, d in model.items():
        rest = {w: t for w, t in d.items() if w != "c"}
        if rest:
            want[k] = rest
    want.setdefault(KEYS[0], {})["c"] = 1
    want[KEYS[61]] = {"a": 2}
    assert table_model(r) == want


def test_restore_refuses_bad_state(unit: MaintenanceUnit) -> None:
    unit.apply(batch("a", 1, [(KEYS[0], 1)]), "a")
    data = unit.to_bytes()
    with pytest.raises(E.InvalidArgumentError, match="exceed"):
        MaintenanceUnit.from_bytes(data, LAYOUT, new_epoch=1)
    for bad in (b"", data[:-1], data[:20] + bytes([data[20] ^ 1]) + data[21:], b"XXXX" + data[4:]):
        with pytest.raises(E.InvalidArgumentError):
            MaintenanceUnit.from_bytes(bad, LAYOUT, new_epoch=2)
    other = IndexLayout((TableSpec(0, "us", ("a", "c", "b")), TableSpec(1, "eu", ("d", "e"))), shards=SHARDS)
    with pytest.raises(E.InvalidArgumentError, match="workers"):
        MaintenanceUnit.from_bytes(data, other, new_epoch=2)
    with pytest.raises(E.InvalidArgumentError, match="shards"):
        MaintenanceUnit.from_bytes(data, IndexLayout(LAYOUT.tables, shards=4), new_epoch=2)


def crafted_state(keys: list[int], values: list[int]) -> bytes:
    """A well-checksummed state holding arbitrary entries in table 0 (mirrors to_bytes)."""
    import zlib

    out = bytearray(struct.pack("<4sBBBxIIQI", b"KVMU", 1, 32, 8, SHARD, SHARDS, 1, 2))
    for spec, (ks, vs) in zip(LAYOUT.tables, [(keys, values), ([], [])], strict=True):
        out += struct.pack("<II", spec.table_id, len(spec.workers))
        for w in spec.workers:
            out += struct.pack("<H", len(w)) + w.encode()
        out += struct.pack("<Q", len(ks)) + np.array(ks, "<u8").tobytes() + np.array(vs, "<u8").tobytes()
    return bytes(out + struct.pack("<I", zlib.crc32(out)))


@pytest.mark.parametrize(
    ("keys", "values"),
    [([KEYS[0]], [0]), ([KEYS[0]], [3]), ([KEYS[0]], [1 << 6]), ([KEYS[0] + 1], [1]), ([2**63 + 2], [1]), ([KEYS[0], KEYS[0]], [1, 1])],
    ids=["empty-value", "tier-3", "field-beyond-group", "wrong-shard", "64-bit-key", "duplicate-key"],
)
def test_restore_refuses_entries_no_unit_could_write(keys: list[int], values: list[int]) -> None:
    assert MaintenanceUnit.from_bytes(crafted_state([KEYS[0]], [1]), LAYOUT, new_epoch=2).held("a").tolist() == [KEYS[0]]
    with pytest.raises(E.InvalidArgumentError):
        MaintenanceUnit.from_bytes(crafted_state(keys, values), LAYOUT, new_epoch=2)


def test_constructor_arguments() -> None:
    for kw in ({"shard": 3}, {"shard": -1}, {"epoch": 0}, {"capacity": 0}, {"max_capacity": 8}, {"log_bytes": -1}):
        args: dict[str, int] = {"shard": SHARD, "epoch": 1, "capacity": 16, **kw}
        with pytest.raises(E.InvalidArgumentError):
            MaintenanceUnit(args.pop("shard"), LAYOUT, **args)


# ---- property: random agents against a dict model -----------------------------------------

POOL = KEYS[:12]
WORKERS = list(LAYOUT.workers)

op_list = st.lists(st.tuples(st.integers(0, len(POOL) - 1), st.integers(0, 2)), max_size=8)
step = st.one_of(
    st.tuples(st.just("ops"), st.sampled_from(WORKERS), op_list, st.booleans()),
    st.tuples(st.just("dup"), st.sampled_from(WORKERS), op_list, st.booleans()),
    st.tuples(st.just("gap"), st.sampled_from(WORKERS), op_list, st.booleans()),
    st.tuples(st.just("forge"), st.sampled_from(WORKERS), op_list, st.booleans()),
    st.tuples(st.just("bad"), st.sampled_from(WORKERS), op_list, st.booleans()),
    st.tuples(st.just("incarnate"), st.sampled_from(WORKERS), op_list, st.booleans()),
    st.tuples(st.just("flush"), st.sampled_from(WORKERS), op_list, st.booleans()),
    st.tuples(st.just("lose"), st.sampled_from(WORKERS), op_list, st.booleans()),
    st.tuples(st.just("restart"), st.sampled_from(WORKERS), op_list, st.booleans()),
)


@given(steps=st.lists(step, max_size=40), capacity=st.sampled_from([4, 64]), log_batches=st.sampled_from([2, 100]))
def test_random_agents_match_a_dict_model(steps: list[tuple[str, str, list[tuple[int, int]], bool]], capacity: int, log_batches: int) -> None:
    unit = MaintenanceUnit(SHARD, LAYOUT, epoch=1, capacity=capacity, log_batches=log_batches)
    views = views_for(unit)
    model: dict[str, dict[int, int]] = {w: {} for w in WORKERS}  # worker -> key -> tier
    inc = {w: 1 for w in WORKERS}
    seq = {w: 0 for w in WORKERS}
    last: dict[str, KeyOpBatch] = {}
    fresh = {w: True for w in WORKERS}  # the unit has no sequence for w: open with a reset
    epoch = 1
    lost: set[int] = set()

    def send(w: str, ops: list[tuple[int, int]], reset: bool) -> None:
        seq[w] += 1
        reset = reset or (fresh[w] and seq[w] > 1)
        b = batch(w, seq[w], [(POOL[i], t) for i, t in ops], inc=inc[w], reset=reset)
        r = unit.apply(b, w)
        assert not r.duplicate
        if reset:
            model[w].clear()
        for i, t in ops:
            model[w][POOL[i]] = t
        last[w], fresh[w] = b, False

    for kind, w, ops, flag in steps:
        before = snapshot_of(unit)
        if kind == "ops":
            send(w, ops, flag)
        elif kind == "dup" and w in last and not fresh[w]:
            assert unit.apply(last[w], w).duplicate
            assert snapshot_of(unit) == before
        elif kind in ("gap", "forge", "bad"):
            b = batch(w, seq[w] + (2 if kind == "gap" else 1), [(POOL[i], t) for i, t in ops], inc=inc[w])
            sender = w
            if kind == "forge":
                sender = WORKERS[(WORKERS.index(w) + 1) % len(WORKERS)]
            elif kind == "bad":
                b = batch(w, seq[w] + 1, [(POOL[i], t) for i, t in ops] + [(POOL[0], 3)], inc=inc[w])
            with pytest.raises((E.AgentSequenceError, E.ForbiddenWriteError, E.InvalidTierError)):
                unit.apply(b, sender)
            assert snapshot_of(unit) == before
        elif kind == "incarnate":
            inc[w] += 1
            seq[w] = 0
            send(w, ops, True)
        elif kind == "flush":
            out = unit.flush()
            deliver(unit, views, [b for b in out if b.table_id not in lost])
            lost.clear()
        elif kind == "lose":
            lost.add(FIELD[w].table_id)
        elif kind == "restart":
            epoch += 1
            unit = MaintenanceUnit.from_bytes(unit.to_bytes(), LAYOUT, new_epoch=epoch, capacity=capacity, log_batches=log_batches)
            fresh = {x: True for x in WORKERS}
        want = {w2: {k: t for k, t in m.items() if t} for w2, m in model.items()}
        for w2 in WORKERS:
            assert unit.held(w2).tolist() == sorted(want[w2])
        by_key: Model = {}
        for w2, m in want.items():
            for k, t in m.items():
                by_key.setdefault(k, {})[w2] = t
        assert table_model(unit) == by_key

    deliver(unit, views, unit.flush())
    for spec in LAYOUT.tables:  # views that never saw a delta of the current epoch ask
        v = views[spec.table_id]
        for data in unit.resume(spec.table_id, v.epoch, v.seq):
            v.apply_batch(data)
    assert_converged(unit, views)
    for spec in LAYOUT.tables:
        unit.table(spec.table_id).verify()


def test_model_helper_sanity() -> None:
    u = MaintenanceUnit(SHARD, LAYOUT, epoch=1, capacity=8)
    u.apply(batch("b", 1, [(KEYS[0], 2)]), "b")
    u.apply(batch("e", 1, [(KEYS[0], 1)]), "e")
    assert table_model(u) == {KEYS[0]: {"b": 2, "e": 1}}
    assert u.table(0).get(KEYS[0]) == 2 << 2 and u.table(1).get(KEYS[0]) == 1 << 2

