"""Hot prefix families and migration, exactly as the paper's section 3.4 states the rule.

Scenarios run real edges (see ``test_edge.Fleet``'s twin below); the rule itself is also checked
directly on arrays with :func:`evaluate_trigger`.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np
import numpy.typing as npt
import pytest

import kvcompass as kc
from kvcompass.discovery.edge import Edge
from kvcompass.discovery.layout import IndexLayout, TableSpec, WorkerSpec
from kvcompass.discovery.migration import MigrationTrigger, evaluate_trigger
from functools import partial

from kvcompass.discovery.params import EdgeParams as _EdgeParams
from kvcompass.index_types import Tier

# These scenarios compute expected scores with the paper's one-way WAN term (table 1);
# tests/test_plane.py covers the default full-RTT term end to end.
# Dispatch charges are off: each scenario sets the queues it scores against, and charges
# (tests/test_queues.py) would add the routes' own work between steps.
EdgeParams = partial(_EdgeParams, wan_fraction=0.5, dispatch_charge_ttl_s=0.0)

NS = kc.Namespace("llama-3.1-8b", "public")
BETA = 0.1  # n1 toward B = 100 ms / 0.1 ms/token = 1000 tokens
PLAN = {"A": [256, 512, 1024, 2048], "B": [768, 1024, 1536, 2048]}
RTT = {"A": 2.0, "B": 100.0}
SHARED = np.random.default_rng(1).integers(0, 100_000, size=256, dtype=np.uint32)


def sibling(i: int) -> npt.NDArray[np.uint32]:
    """A prompt of the family rooted at SHARED (same first chunk, private tail)."""
    tail = np.random.default_rng(1000 + i).integers(0, 100_000, size=2048 - 256, dtype=np.uint32)
    return np.concatenate([SHARED, tail]).astype(np.uint32)


FAMILY = int(NS.keys(SHARED, [256])[0])


class Fleet:
    def __init__(self, regions: Mapping[str, int]) -> None:
        tables, self.specs = [], []
        for t, (r, n) in enumerate(regions.items()):
            ids = tuple(f"{r.lower()}{i}" for i in range(n))
            tables.append(TableSpec(t, r, ids))
            self.specs += [WorkerSpec(w, r, beta_ms_per_token=BETA) for w in ids]
        self.layout = IndexLayout(tuple(tables), fp_bits=16)
        self.writers = [kc.LudoTable(table=t.table_id, capacity=64, fp_bits=16) for t in tables]

    def hold(self, worker: str, tokens: npt.NDArray[np.uint32], lengths: Sequence[int]) -> None:
        ref = self.layout.field_of(worker)
        for c in lengths:
            self.writers[ref.table_id].set_field(int(NS.keys(tokens, [c])[0]), ref.field, int(Tier.VRAM))
        for w in self.writers:
            w.take_batch()

    def edge(self, params: EdgeParams = EdgeParams(tie_ms=0.0), queues: Mapping[str, float] | None = None, idle_at: float = 0.0) -> Edge:
        e = Edge("A", self.layout, self.specs, PLAN, RTT, params)
        for w in self.writers:
            e.bootstrap(w.table, 0, w.export_snapshot())
        for wid, q in (queues or {}).items():
            e.set_local_queue(wid, q, idle_at)
        return e


def remote_scenario(b0_lengths: Sequence[int] = (768, 1024, 1536, 2048)) -> Fleet:
    """A: a0, a1 (no holder); B: b0 holds every sibling at ``b0_lengths``."""
    fleet = Fleet({"A": 2, "B": 1})
    for i in range(8):
        fleet.hold("b0", sibling(i), b0_lengths)
    return fleet


def test_hot_family_with_only_a_remote_holder_is_recomputed_on_the_idle_worker_only() -> None:
    fleet = remote_scenario()
    edge = fleet.edge(queues={"a0": 0.0, "a1": 500.0})  # a0 idle since 0, a1 busy
    for i, now in enumerate([1.0, 1.3]):
        d = edge.route(sibling(i), NS, now)
        assert (d.worker, d.local_match, d.family) == ("b0", 0, FAMILY)  # b0: 50 ms < a0: 205.8 ms
        assert edge.migration_actions(now) == []
    p = sibling(2)
    assert edge.route(p, NS, 1.6).worker == "b0"
    assert edge.is_hot(FAMILY, 1.6)
    (a,) = edge.migration_actions(1.6)
    assert (a.kind, a.family, a.source, a.source_region, a.target, a.target_region) == ("recompute", FAMILY, "b0", "B", "a0", "A")
    assert (a.length, a.target_tier, a.namespace) == (2048, Tier.DRAM, NS.digest)
    assert np.array_equal(a.tokens, p[:2048])
    # Still hot, but the family is cooling down: no repeat.
    edge.route(sibling(3), NS, 1.9)
    assert edge.migration_actions(1.9) == []
    assert edge.stats.migrations_emitted == 1 and edge.stats.local_misses == 4


def test_misses_spread_wider_than_the_window_are_not_hot() -> None:
    edge = remote_scenario().edge(queues={"a0": 0.0, "a1": 500.0})
    for i, now in enumerate([1.0, 1.6, 2.2]):
        edge.route(sibling(i), NS, now)
    assert not edge.is_hot(FAMILY, 2.2)
    assert edge.migration_actions(2.2) == []


def test_no_action_without_a_persistently_idle_worker() -> None:
    edge = remote_scenario().edge(queues={"a0": 0.0, "a1": 500.0}, idle_at=1.0)
    for i, now in enumerate([1.0, 1.1, 1.2]):
        edge.route(sibling(i), NS, now)
    assert not edge.persistently_idle("a0", 1.2)  # idle for 0.2 s < idle_window_s
    assert edge.migration_actions(1.2) == []
    assert edge.stats.migrations_no_target == 1


def test_no_action_when_the_remote_match_is_within_n1() -> None:
    edge = remote_scenario(b0_lengths=(768,)).edge(queues={"a0": 0.0, "a1": 500.0})
    assert edge.n1("b0") == 1000.0
    for i, now in enumerate([1.0, 1.1, 1.2]):
        d = edge.route(sibling(i), NS, now)
        assert (d.worker, d.expected_match) == ("b0", 768)  # b0 still wins: 178 ms < 205.8 ms
    assert edge.is_hot(FAMILY, 1.2)
    assert edge.migration_actions(1.2) == []


def test_migration_ablation_emits_nothing() -> None:
    edge = remote_scenario().edge(EdgeParams(tie_ms=0.0, migration=False), queues={"a0": 0.0, "a1": 500.0})
    for i, now in enumerate([1.0, 1.1, 1.2]):
        d = edge.route(sibling(i), NS, now)
        assert d.family is None
    assert edge.migration_actions(1.2) == []


def _local_holder_losing_to_load() -> Edge:
    """a0 holds everything but is busy; a1 idle; a2 busy. b0 wins (50 ms) over a0 (301 ms), and
    a0 would have won without its queue (1 ms): it lost to load, three times by t=1.4."""
    fleet = Fleet({"A": 3, "B": 1})
    for i in range(4):
        fleet.hold("a0", sibling(i), PLAN["A"])
        fleet.hold("b0", sibling(i), PLAN["B"])
    edge = fleet.edge(queues={"a0": 300.0, "a1": 0.0, "a2": 400.0})
    for i, now in enumerate([1.0, 1.2, 1.4]):
        d = edge.route(sibling(i), NS, now)
        assert (d.worker, d.local_match) == ("b0", 2048)
    return edge


def test_local_holder_losing_to_load_is_copied_within_the_region() -> None:
    (a,) = _local_holder_losing_to_load().migration_actions(1.4)
    assert (a.kind, a.source, a.target, a.length, a.target_tier) == ("copy", "a0", "a1", 2048, Tier.DRAM)


def test_local_holder_losing_for_other_reasons_is_not_copied() -> None:
    fleet = Fleet({"A": 2, "B": 1})
    for i in range(4):
        fleet.hold("a0", sibling(i), [256])  # a short local match
        fleet.hold("b0", sibling(i), PLAN["B"])
    edge = fleet.edge(queues={"a0": 100.0, "a1": 0.0})
    for i, now in enumerate([1.0, 1.2, 1.4]):
        assert edge.route(sibling(i), NS, now).worker == "b0"
    assert edge.is_hot(FAMILY, 1.4)
    assert edge.migration_actions(1.4) == []  # a0 without its queue (180.2 ms) still loses to 50 ms


def test_local_hits_do_not_count_toward_hotness() -> None:
    fleet = Fleet({"A": 2, "B": 1})
    for i in range(4):
        fleet.hold("a0", sibling(i), PLAN["A"])
    edge = fleet.edge(queues={"a0": 0.0, "a1": 0.0})
    for i in range(4):
        d = edge.route(sibling(i), NS, 1.0 + 0.1 * i)
        assert d.worker == "a0"
    assert edge.stats.local_misses == 0 and not edge.is_hot(FAMILY, 1.3)


# -- the rule on arrays ---------------------------------------------------------------------------------


def arrays(matches: list[int], scores: list[float], tq: list[float]) -> tuple[npt.NDArray[np.uint32], npt.NDArray[np.float64], npt.NDArray[np.float64]]:
    return np.array(matches, dtype=np.uint32), np.array(scores, dtype=np.float64), np.array(tq, dtype=np.float64)


LOCAL = np.array([True, True, False, False])
N1 = np.array([20.0, 20.0, 1000.0, 1200.0])


@pytest.mark.parametrize(
    ("matches", "scores", "tq", "winner", "want"),
    [
        # no local holder; both remote holders beyond their n1: the longer match is the source
        ([0, 0, 1024, 1536], [200, 210, 60, 70], [0, 5, 0, 0], 2, MigrationTrigger("recompute", 3, 1536, frozenset())),
        # equal remote matches: the cheaper one
        ([0, 0, 1536, 1536], [200, 210, 80, 70], [0, 5, 0, 0], 3, MigrationTrigger("recompute", 3, 1536, frozenset())),
        # remote match not beyond n1 (strictly): nothing
        ([0, 0, 1000, 1200], [200, 210, 60, 70], [0, 5, 0, 0], 2, None),
        # a local holder won: a local hit
        ([512, 0, 1024, 0], [40, 210, 60, 70], [30, 0, 0, 0], 0, None),
        # the local holder lost to load (its score without its queue beats the winner)
        ([512, 0, 2048, 0], [340, 210, 60, 70], [300, 0, 0, 0], 2, MigrationTrigger("copy", 0, 512, frozenset({0}))),
        # ... but not every local holder did: nothing
        ([512, 256, 2048, 0], [340, 200, 60, 70], [300, 10, 0, 0], 2, None),
        # both lost to load: the longer one is the source, and the other already holds it
        ([512, 512, 2048, 0], [340, 330, 60, 70], [300, 310, 0, 0], 2, MigrationTrigger("copy", 0, 512, frozenset({0, 1}))),
    ],
)
def test_evaluate_trigger(matches: list[int], scores: list[float], tq: list[float], winner: int, want: MigrationTrigger | None) -> None:
    m, s, q = arrays(matches, scores, tq)
    assert evaluate_trigger(LOCAL, m, s, q, N1, winner) == want


def test_hot_families_lists_what_is_hot_now_for_the_dashboard() -> None:
    # The operators' view of hotness: the families hot at a time, most recently missed first,
    # gone once their misses leave the window; the dashboard shows them.
    from kvcompass.services.dashboard import Dashboard

    fleet = remote_scenario()
    edge = fleet.edge(queues={"a0": 0.0, "a1": 500.0})
    assert edge.hot_families(1.0) == []
    for i, now in enumerate([1.0, 1.3, 1.6]):
        edge.route(sibling(i), NS, now)
    assert edge.hot_families(1.6) == [(FAMILY, 3, 1.6)]
    d = Dashboard(edge, clock=lambda: 1.7).data()
    assert d["hot"] == [{"family": f"{FAMILY:016x}", "misses": 3, "age_s": 0.1}]
    assert edge.hot_families(2.45) == []  # the first miss left the 1 s window
    assert Dashboard(edge, clock=lambda: 5.0).data()["hot"] == []


def test_a_worker_this_edge_just_loaded_is_not_persistently_idle() -> None:
    """Found in review: the idle clock looked at the sampled estimate alone, so a worker this
    edge had just sent work (its open charges, which the score counts) still qualified as a
    migration target. A charge now stops the clock."""
    from kvcompass.discovery.params import EdgeParams

    fleet = remote_scenario()
    edge = fleet.edge(params=EdgeParams(wan_fraction=0.5, tie_ms=0.0), queues={"a0": 0.0, "a1": 5000.0})
    edge.on_broadcast("B", {"b0": 500.0}, 1.0)
    rng = np.random.default_rng(5)
    for k in range(2):  # unrelated work goes to a0 (a1 is busy)
        assert edge.route(rng.integers(0, 100_000, 2048, dtype=np.uint32), NS, 1.0 + 0.01 * k).worker == "a0"
    for i, now in enumerate([1.05, 1.1, 1.15]):
        edge.route(sibling(i), NS, now)
    assert edge.queue_estimate("a0") > 0 and not edge.persistently_idle("a0", 1.15)
    assert edge.migration_actions(1.15) == []


def test_migration_does_not_target_an_excluded_worker() -> None:
    """Found in review: a worker whose last reading was zero stays idle after it dies, and a
    door's dead workers could not be kept out of migration targets."""
    fleet = remote_scenario()
    edge = fleet.edge(queues={"a0": 0.0, "a1": 500.0})  # a0 read idle at t=0, then silence
    for i, now in enumerate([3600.0, 3600.3, 3600.6]):
        edge.route(sibling(i), NS, now)
    assert all(a.target != "a0" for a in edge.migration_actions(3600.6, exclude={"a0"}))


def test_no_copy_comes_from_an_excluded_source() -> None:
    """Found in review: a copy's source (the local holder) was taken even when the door had
    excluded it as dead; the copy fails and the family's cooldown starts for nothing."""
    assert _local_holder_losing_to_load().migration_actions(1.4, exclude={"a0"}) == []


def test_stale_triggers_do_not_pile_up_when_nobody_asks_for_actions() -> None:
    """Review, twenty-fifth session: triggers older than ``max_age_s`` left only in resolve(),
    so an edge whose caller never asks for actions (the gRPC edge service, a door with
    migration_poll_s=0) kept every one, tokens included, for ever."""
    from kvcompass.discovery.migration import MigrationPlanner

    planner = MigrationPlanner(["a0", "a1"], ["a", "a"], cooldown_s=30.0, max_age_s=1.0, rng=np.random.default_rng(0))
    tokens = np.arange(4096, dtype=np.uint32)
    for k in range(5000):
        planner.offer(k, MigrationTrigger("recompute", 0, 2048, frozenset()), b"n" * 32, tokens, now=2.0 * k)
    assert planner.pending <= 128  # the stale ones swept as it grows, not 5,000
    # A trigger still within max_age survives the sweep.
    assert len(planner.resolve(2.0 * 4999 + 0.5, idle=[1])) == 1


def test_a_response_at_a_non_finite_time_is_refused_and_changes_nothing() -> None:
    """Review, twenty-fifth session: on_response took now=NaN (every belief reset) or inf (their
    recovery stopped for good); route and handoff already refused such times."""
    from kvcompass.errors import InvalidArgumentError

    edge = Fleet({"A": 2}).edge()
    edge.on_response("a0", 1000, 0, None, 1.0)  # a false claim: a0's belief falls
    before = edge.belief("a0")
    assert before < 1.0
    for bad in (float("nan"), float("inf")):
        with pytest.raises(InvalidArgumentError):
            edge.on_response("a0", 0, 0, None, bad)
    assert edge.belief("a0") == before
