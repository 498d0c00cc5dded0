"""Queue estimates: live own region, EWMA of piggybacked and broadcast remote vectors, and the
broadcast schedule with piggyback suppression (paper section 3.4)."""

from __future__ import annotations

import math

import numpy as np
import pytest

import kvcompass as kc
from kvcompass.discovery.edge import Edge, QueueBroadcast
from kvcompass.discovery.layout import IndexLayout, TableSpec, WorkerSpec
from functools import partial

from kvcompass.discovery.params import EdgeParams as _EdgeParams
from kvcompass.discovery.queues import BroadcastSchedule, QueueEstimates
from kvcompass.errors import InvalidArgumentError, UnknownWorkerError

# These scenarios compute expected scores with the paper's one-way WAN term (table 1);
# tests/test_plane.py covers the default full-RTT term end to end.
# Dispatch charges are off: each scenario sets the queues it scores against, and charges
# (tests/test_queues.py) would add the routes' own work between steps.
EdgeParams = partial(_EdgeParams, wan_fraction=0.5, dispatch_charge_ttl_s=0.0)


def test_remote_samples_fold_with_weight_w_and_the_first_replaces() -> None:
    q = QueueEstimates(2, weight=0.5, idle_threshold_ms=1.0)
    assert q[0] == 0.0 and not q.known(0) and q.age(0, 5.0) == math.inf
    assert q.fold(0, 100.0, 1.0) == 100.0
    assert q.fold(0, 20.0, 2.0) == 60.0
    assert q.fold(0, 0.0, 3.0) == 30.0
    assert q.age(0, 3.5) == 0.5
    q.set_live(1, 42.0, 1.0)
    q.set_live(1, 7.0, 2.0)  # live readings replace
    assert q.values.tolist() == [30.0, 7.0]


def test_persistent_idleness_needs_the_whole_window_at_zero() -> None:
    q = QueueEstimates(1, weight=0.5, idle_threshold_ms=1.0)
    assert not q.persistently_idle(0, 10.0, 1.0)  # never reported: unknown, not idle
    q.set_live(0, 0.0, 1.0)
    q.set_live(0, 0.5, 1.5)  # still "at zero" (below the threshold): the clock keeps running
    assert not q.persistently_idle(0, 1.9, 1.0)
    assert q.persistently_idle(0, 2.0, 1.0) and q.idle_for(0, 2.5) == 1.5
    q.set_live(0, 30.0, 2.6)  # busy: the clock resets
    q.set_live(0, 0.0, 2.7)
    assert not q.persistently_idle(0, 3.5, 1.0)
    assert q.persistently_idle(0, 3.7, 1.0)


@pytest.mark.parametrize("bad", [-1.0, math.nan, math.inf])
def test_bad_samples_are_refused(bad: float) -> None:
    q = QueueEstimates(1, 0.5, 1.0)
    with pytest.raises(ValueError):
        q.fold(0, bad, 0.0)
    with pytest.raises(ValueError):
        q.set_live(0, bad, 0.0)
    assert not q.known(0)


def test_broadcast_every_period_unless_a_piggyback_went_there() -> None:
    s = BroadcastSchedule(["B", "C"], period_s=0.1)
    assert s.due(0.0) == ["B", "C"]
    assert s.due(0.05) == []
    s.note_piggyback("B", 0.06)
    assert s.due(0.1) == ["C"]  # B got our vector 40 ms ago
    assert s.suppressed == 1
    assert s.due(0.2) == ["B", "C"]  # the piggyback is now older than Delta
    with pytest.raises(KeyError):
        s.note_piggyback("Z", 0.0)
    with pytest.raises(ValueError):
        BroadcastSchedule(["B"], 0.0)


def make_edge(params: EdgeParams = EdgeParams()) -> Edge:
    layout = IndexLayout((TableSpec(0, "A", ("a0", "a1")), TableSpec(1, "B", ("b0", "b1")), TableSpec(2, "C", ("c0",))))
    specs = [WorkerSpec("a0", "A"), WorkerSpec("a1", "A"), WorkerSpec("b0", "B"), WorkerSpec("b1", "B"), WorkerSpec("c0", "C")]
    e = Edge("A", layout, specs, {"A": [256], "B": [2048], "C": [2048]}, {"A": 1.0, "B": 100.0, "C": 150.0}, params)
    for t in layout.tables:
        e.bootstrap(t.table_id, 0, kc.LudoTable(table=t.table_id).export_snapshot())
    return e


def test_edge_folds_piggybacked_vectors_of_remote_responses_only() -> None:
    e = make_edge()
    e.on_response("b0", 1024, 1024, {"b0": 80.0, "b1": 10.0}, now=1.0)
    e.on_response("b1", 0, 0, {"b0": 40.0, "b1": 30.0}, now=2.0)
    assert (e.queue_estimate("b0"), e.queue_estimate("b1")) == (60.0, 20.0)
    assert e.queue_age("b0", 2.5) == 0.5 and e.queue_age("c0", 2.5) == math.inf
    # Entries outside the serving region, or unknown, are ignored and counted.
    e.on_response("b0", 0, 0, {"c0": 99.0, "zz": 1.0, "b0": 60.0}, now=3.0)
    assert e.queue_estimate("c0") == 0.0 and e.queue_estimate("b0") == 60.0
    assert e.stats.queue_samples_ignored == 2
    # A local worker's response carries nothing the edge does not read live.
    e.set_local_queue("a0", 5.0, 3.0)
    e.on_response("a0", 0, 0, {"a0": 500.0}, now=3.0)
    assert e.queue_estimate("a0") == 5.0
    # A bad vector changes nothing.
    with pytest.raises(InvalidArgumentError):
        e.on_broadcast("B", {"b0": 1.0, "b1": -5.0}, 4.0)
    assert e.queue_estimate("b0") == 60.0
    e.on_broadcast("C", {"c0": 12.0}, 4.0)
    e.on_broadcast("A", {"a0": 999.0}, 4.0)  # our own region's broadcast: read live instead
    assert (e.queue_estimate("c0"), e.queue_estimate("a0")) == (12.0, 5.0)
    assert e.stats.responses == 4


def test_edge_broadcasts_its_region_vector_with_suppression() -> None:
    e = make_edge()
    e.set_local_queue("a0", 3.0, 0.0)
    assert e.broadcast_due(0.0) == [QueueBroadcast("A", "B", {"a0": 3.0, "a1": 0.0}), QueueBroadcast("A", "C", {"a0": 3.0, "a1": 0.0})]
    assert e.piggyback_vector("C", 0.15) == {"a0": 3.0, "a1": 0.0}
    assert [b.target_region for b in e.broadcast_due(0.2)] == ["B"]
    assert [b.target_region for b in e.broadcast_due(0.3)] == ["B", "C"]
    st = e.stats
    assert (st.broadcasts_sent, st.broadcasts_suppressed) == (5, 1)
    with pytest.raises(InvalidArgumentError):
        e.note_piggyback_sent("Z", 0.0)


def test_edge_queue_api_validates_workers() -> None:
    e = make_edge()
    with pytest.raises(UnknownWorkerError):
        e.set_local_queue("zz", 1.0, 0.0)
    with pytest.raises(InvalidArgumentError, match="not this edge"):
        e.set_local_queue("b0", 1.0, 0.0)
    with pytest.raises(UnknownWorkerError):
        e.on_response("zz", 0, 0, None, 0.0)


def test_remote_estimates_feed_the_score() -> None:
    e = make_edge(EdgeParams(tie_ms=0.0))
    # Nothing is held anywhere; a0 and a1 are swamped, so the cheaper remote region wins.
    e.set_local_queue("a0", 1000.0, 0.0)
    e.set_local_queue("a1", 1000.0, 0.0)
    e.on_broadcast("B", {"b0": 300.0, "b1": 200.0}, 0.0)
    p = np.arange(100, dtype=np.uint32)
    d = e.route(p, kc.Namespace("m"), 0.0)
    assert (d.worker, d.terms.queue, d.terms.wan) == ("c0", 0.0, 75.0)
    e.on_broadcast("C", {"c0": 400.0}, 0.1)
    d = e.route(p, kc.Namespace("m"), 0.1)
    assert (d.worker, d.terms.queue) == ("b1", 200.0)


def test_a_driver_ticking_every_period_broadcasts_every_tick() -> None:
    s = BroadcastSchedule(["B"], period_s=0.1)
    t, sent = 0.0, 0
    for _ in range(50):
        sent += len(s.due(t))
        t += 0.1  # accumulates float error: 0.1 + 0.1 + 0.1 > 0.3
    assert sent == 50


# -- dispatch charges (beyond the paper) -----------------------------------------------------------


def test_charges_add_to_the_estimate_until_a_sample_must_include_them() -> None:
    q = QueueEstimates(2, weight=0.5, idle_threshold_ms=1.0, charge_ttl_s=2.0)
    q.set_live(0, 10.0, 0.0)
    q.charge(0, 100.0, 1.0)
    q.charge(0, 50.0, 1.5)
    assert (q[0], q.observed(0), q.pending(0)) == (160.0, 10.0, 150.0)
    # A reading taken before the second request can have arrived settles only the first.
    q.set_live(0, 110.0, 1.6, settled_before=1.2)
    assert (q[0], q.pending(0)) == (160.0, 50.0)
    q.set_live(0, 150.0, 1.7, settled_before=1.6)
    assert (q[0], q.pending(0)) == (150.0, 0.0)
    # Remote: an EWMA sample folds into the observed part, charges stay until settled.
    q.fold(1, 40.0, 2.0)
    q.charge(1, 30.0, 2.5)
    assert q.fold(1, 20.0, 2.6, settled_before=2.4) == 30.0
    assert q[1] == 60.0
    # The TTL closes a charge no sample ever settles (times come from a monotonic clock).
    q.expire(4.49)
    assert q.pending(1) == 30.0
    q.expire(4.5)
    assert (q[1], q.pending(1)) == (30.0, 0.0)
    with pytest.raises(ValueError):
        q.charge(0, -1.0, 3.0)


def test_a_burst_routed_at_one_instant_spreads_instead_of_herding() -> None:
    # Four equal idle workers and a burst of 8 same-prefix prompts at one instant (the
    # Mooncake traces have many requests with one timestamp). The first route's speculative
    # entry makes its worker a "holder" of the shared prefix; without charges every later
    # request piles onto it while the queue estimates still read 0.
    def burst(params: EdgeParams) -> dict[str, int]:
        layout = IndexLayout((TableSpec(0, "A", ("a0", "a1", "a2", "a3")),))
        e = Edge("A", layout, [WorkerSpec(f"a{i}", "A") for i in range(4)], {"A": [256, 512]}, {"A": 1.0}, params, seed=3)
        e.bootstrap(0, 0, kc.LudoTable(table=0).export_snapshot())
        for i in range(4):
            e.set_local_queue(f"a{i}", 0.0, 0.0)
        shared = np.arange(512, dtype=np.uint32)
        counts: dict[str, int] = {}
        for j in range(8):
            p = np.concatenate([shared, np.arange(3000, dtype=np.uint32) + 10_000 * (j + 1)])
            w = e.route(p, kc.Namespace("m"), 1.0).worker
            counts[w] = counts.get(w, 0) + 1
        return counts

    herd = burst(EdgeParams(dispatch_charge_ttl_s=0.0))
    assert max(herd.values()) == 8  # the regression: everything on one worker
    spread = burst(EdgeParams(dispatch_charge_ttl_s=2.0))
    assert len(spread) == 4 and max(spread.values()) <= 3


def test_fold_many_equals_folding_one_by_one() -> None:
    rng = np.random.default_rng(5)
    a, b = QueueEstimates(12, 0.3, 1.0, charge_ttl_s=0.5), QueueEstimates(12, 0.3, 1.0, charge_ttl_s=0.5)
    now = 0.0
    for step in range(200):
        now += float(rng.uniform(0.0, 0.2))
        if rng.random() < 0.4:  # charges, to be settled by the samples that include them
            i, ms = int(rng.integers(12)), float(rng.uniform(0, 50))
            a.charge(i, ms, now)
            b.charge(i, ms, now)
        idx = rng.choice(12, size=int(rng.integers(1, 12)), replace=False).astype(np.int64)
        vals = np.where(rng.random(len(idx)) < 0.3, 0.0, rng.uniform(0, 100, len(idx)))
        before = now - rng.uniform(0, 0.3, len(idx))
        for j, i in enumerate(idx.tolist()):
            a.fold(i, float(vals[j]), now, float(before[j]))
        b.fold_many(idx, vals, now, before)
        assert np.allclose(a.values, b.values, rtol=0, atol=1e-9), step
        for i in range(12):
            assert a.observed(i) == pytest.approx(b.observed(i), abs=1e-9)
            assert a.pending(i) == pytest.approx(b.pending(i), abs=1e-9)
            assert a.idle_for(i, now) == b.idle_for(i, now)
            assert a.known(i) == b.known(i)


def test_idle_among_lists_the_persistently_idle_workers_in_order() -> None:
    q = QueueEstimates(5, 1.0, 1.0)
    for i, (v, t) in enumerate([(0.0, 0.0), (5.0, 0.0), (0.0, 0.9), (0.5, 0.2)]):
        q.set_live(i, v, t)  # worker 4 never reported: unknown, not idle
    idx = np.array([4, 3, 2, 1, 0], dtype=np.int64)
    assert q.idle_among(idx, 1.0, 0.5) == [3, 0]
    assert q.idle_among(idx, 1.0, 0.5) == [i for i in idx.tolist() if q.persistently_idle(i, 1.0, 0.5)]
    assert q.idle_among(idx, 2.0, 0.5) == [3, 2, 0]


def test_handoff_moves_a_forwarded_request_off_a_worker_that_filled_up_meanwhile() -> None:
    e = make_edge(_EdgeParams(wan_fraction=0.5, tie_ms=1.0))  # dispatch charges on
    p = np.arange(100, dtype=np.uint32)
    ns = kc.Namespace("m")
    e.set_local_queue("a0", 500.0, 0.0)  # another edge sent a0 work while it looked idle
    e.set_local_queue("a1", 0.0, 0.0)
    d = e.handoff(p, ns, "a0", 0.0)
    assert d.worker == "a1" and d.region == "A"
    # The edge charged a1 with the prefill it now expects there (its live reading was 0).
    assert e.queue_estimate("a1") == pytest.approx(d.terms.prefill / (1 + d.terms.lam)) and e.queue_estimate("a1") > 0
    st = e.stats
    assert (st.handoffs, st.handoffs_moved, st.routes) == (1, 1, 0)  # not a route: hotness untouched
    # Within the in-region hop plus tie_ms of the best: the origin's choice stands.
    e.set_local_queue("a0", 0.2, 1.0)
    e.set_local_queue("a1", 0.0, 1.0)
    assert e.handoff(p, ns, "a0", 1.0).worker == "a0"
    assert e.stats.handoffs_moved == 1
    with pytest.raises(InvalidArgumentError, match="not of this edge's region"):
        e.handoff(p, ns, "b0", 1.0)
    with pytest.raises(UnknownWorkerError):
        e.handoff(p, ns, "zz", 1.0)
    # A worker the caller cannot reach forces a move; none left is an error.
    assert e.handoff(p, ns, "a0", 1.0, exclude={"a0"}).worker == "a1"
    with pytest.raises(InvalidArgumentError, match="every worker"):
        e.handoff(p, ns, "a0", 1.0, exclude={"a0", "a1"})
    # Without load awareness there is nothing to re-score.
    blind = make_edge(EdgeParams(load_aware=False))
    blind.set_local_queue("a0", 500.0, 0.0)
    assert blind.handoff(p, ns, "a0", 0.0).worker == "a0"


def test_a_bad_vector_changes_nothing() -> None:
    """A vector with a repeated or out-of-range index, a bad sample, or mismatched lengths is
    refused whole, before anything changes."""
    q = QueueEstimates(3, 0.5, 0.0)
    q.set_live(1, 7.0, 0.5)
    q.charge(1, 3.0, 0.6)
    state = (q.values.tolist(), [q.observed(i) for i in range(3)], [q.pending(i) for i in range(3)], [q.known(i) for i in range(3)], q.version)
    for idx, smp, what in (([0, 0], [1.0, 2.0], "repeated"), ([3], [1.0], "out of range"), ([-1], [1.0], "out of range"), ([1], [-1.0], "must be finite and in"), ([1], [np.nan], "finite"), ([1], [1e300], "must be finite and in"), ([0, 1], [1.0], "differ in length")):
        with pytest.raises(ValueError, match=what):
            q.fold_many(np.array(idx, dtype=np.int64), np.array(smp, dtype=np.float64), 1.0, np.zeros(len(idx)))
        assert (q.values.tolist(), [q.observed(i) for i in range(3)], [q.pending(i) for i in range(3)], [q.known(i) for i in range(3)], q.version) == state
    with pytest.raises(IndexError):
        q.set_live(3, 1.0, 1.0)
    with pytest.raises(IndexError):
        q.charge(-1, 1.0, 1.0)
    q.fold_many(np.array([2], dtype=np.int64), np.array([4.0]), 1.0, np.array([1.0]))
    assert q[2] == 4.0 and q.known(2) and q.age(2, 1.5) == 0.5


def test_estimates_follow_the_reference_rules_step_by_step() -> None:
    """Seeded random operations against a plain-Python model of the module notes' rules (the
    class this replaced): every estimate, charge, age and idle clock agrees after every step."""
    import random

    from _queues_reference import ReferenceEstimates

    rng = random.Random(7)
    for trial in range(20):
        n = rng.randint(1, 6)
        w, idle, ttl = rng.choice([0.5, 0.25, 1.0]), rng.choice([0.0, 1.0]), rng.choice([0.0, 0.5, 2.0])
        ours, ref = QueueEstimates(n, w, idle, ttl), ReferenceEstimates(n, w, idle, ttl)
        now = 0.0
        for step in range(300):
            now += rng.choice([0.0, 0.01, 0.1, 0.7])
            op = rng.randrange(7)
            i = rng.randrange(n)
            x = rng.choice([0.0, 0.5, 3.0, 250.0, rng.uniform(0, 1000)])
            before = now - rng.choice([0.0, 0.05, 0.3, 3.0])
            if op == 0:
                ours.charge(i, x, now), ref.charge(i, x, now)
            elif op == 1:
                ours.expire(now), ref.expire(now)
            elif op == 2:
                b = rng.choice([None, before])
                ours.set_live(i, x, now, b), ref.set_live(i, x, now, b)
            elif op == 3:
                b = rng.choice([None, before])
                assert ours.fold(i, x, now, b) == ref.fold(i, x, now, b)
            else:
                k = rng.randint(0, n)
                idx = np.array(rng.sample(range(n), k), dtype=np.int64)
                smp = np.array([rng.uniform(0, 500) for _ in range(k)])
                bb = np.array([now - rng.choice([0.0, 0.2, 1.0]) for _ in range(k)])
                if op == 4:
                    ours.fold_many(idx, smp, now, bb), ref.fold_many(idx, smp, now, bb)
                elif op == 5:
                    ours.set_live_many(idx, smp, now, bb), ref.set_live_many(idx, smp, now, bb)
                else:
                    ours.fold_lagged(idx, smp, now, now - bb), ref.fold_lagged(idx, smp, now, now - bb)
            where = (trial, step, op)
            assert ours.values.tolist() == pytest.approx(ref.values.tolist(), rel=1e-12, abs=1e-9), where
            for j in range(n):
                assert ours.observed(j) == ref.observed(j), where
                assert ours.pending(j) == pytest.approx(ref.pending(j), rel=1e-12, abs=1e-9), where
                assert (ours.known(j), ours.age(j, now + 1)) == (ref.known(j), ref.age(j, now + 1)), where
                assert ours.idle_for(j, now + 1) == ref.idle_for(j, now + 1), where
            win = rng.choice([0.0, 0.5, 2.0])
            assert ours.idle_among(np.arange(n, dtype=np.int64), now, win) == ref.idle_among(np.arange(n, dtype=np.int64), now, win)


def test_edge_repeated_vectors_fold_as_the_first_did() -> None:
    """An edge resolves a region's vector ids once and folds later vectors with the same ids as
    arrays: the estimates, ignored counts and refusals are those of the full check."""
    fast, slow = make_edge(), make_edge()
    vectors = [{"b0": 80.0, "zz": 3.0, "b1": 10.0}, {"b0": 40.0, "zz": 1.0, "b1": 30.0}, {"b0": 5, "zz": 0, "b1": 7}, {"b1": 1.0, "b0": 2.0}]
    for k, v in enumerate(vectors):
        fast.on_broadcast("B", v, float(k))
        slow._fold_vector_checked("B", v, float(k), tuple(v))  # noqa: SLF001 (the reference path)
        assert (fast.queue_estimate("b0"), fast.queue_estimate("b1")) == (slow.queue_estimate("b0"), slow.queue_estimate("b1"))
        assert fast.queue_age("b0", 9.0) == slow.queue_age("b0", 9.0)
    assert fast.stats.queue_samples_ignored == slow.stats.queue_samples_ignored == 3
    before = fast.queue_estimate("b0")
    for bad in ({"b1": 1.0, "b0": -2.0}, {"b1": 1.0, "b0": math.nan}, {"b1": 1.0, "b0": "x"}):
        with pytest.raises((InvalidArgumentError, ValueError)):
            fast.on_broadcast("B", bad, 9.0)
        assert fast.queue_estimate("b0") == before and fast.queue_age("b0", 9.0) == 6.0


def test_an_edge_exposes_its_own_vector_and_broadcast_targets_for_a_driver() -> None:
    """``local_ids`` / ``local_values`` (the vector a driver sends, as arrays) and
    ``broadcast_targets_due`` (who is due, the schedule advanced)."""
    a = make_edge()
    a.set_local_queue("a0", 20.0, 0.0)
    assert a.local_ids == ("a0", "a1") and a.local_values().tolist() == [20.0, 0.0]
    assert a.broadcast_targets_due(0.0) == ["B", "C"] and a.broadcast_targets_due(0.05) == []


def test_minimum_is_the_smallest_estimate_with_charges() -> None:
    from kvcompass import _core

    q = _core.QueueEstimates(4, 0.5, 1.0, 2.0)
    assert q.minimum() == 0.0 == float(q.values.min())
    for i, v in enumerate([5.0, 3.0, 7.0, 4.0]):
        q.set_live(i, v, 1.0)
    assert q.minimum() == 3.0
    q.charge(1, 2.5, 1.0)  # an open dispatch charge counts
    assert q.minimum() == 4.0 == float(q.values.min())
    q.expire(10.0)  # the charge's TTL ran out
    assert q.minimum() == 3.0 == float(q.values.min())
    assert _core.QueueEstimates(0, 0.5, 1.0, 2.0).minimum() == float("inf")


def test_settling_charges_never_leaves_an_estimate_below_zero() -> None:
    """Found in review: a charge far smaller than the running total is lost to rounding when
    added and then subtracted whole when a reading settles it; with another charge still open
    the pending work read -6e-14, the estimate went negative, and every route refused the
    estimates until the last open charge expired."""
    from kvcompass.discovery.queues import QueueEstimates

    tiny = 1.9e-14
    q = QueueEstimates(1, 0.5, 1.0, 2.0)
    q.charge(0, 1000.0, 0.0)
    q.charge(0, tiny, 0.1)
    q.charge(0, tiny, 0.2)
    q.set_live(0, 0.0, 0.3, 0.15)  # settles the first two; the third stays open
    assert q.pending(0) >= 0.0 and q[0] >= 0.0 and q.minimum() >= 0.0
