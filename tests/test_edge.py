"""Edge routing: scenario tests whose expected decisions come from the joint score itself.

Every scenario builds real writers (one LudoTable per (table, shard)), edges fed only by their
snapshots and patch batches, and registers prefixes at the keys from ``kvcompass.prefix_keys``.
Expected scores are computed from the paper's formula (section 3.4)

    score(w) = WAN(o, w) + Tq(w) + (1 + lam) * beta * (L - b*m) + gamma * b * m * [tier == DRAM]
    lam = min(lambda_max, min_w Tq(w) / tau)

in the core's operation order, so they compare with ``==``. Each scenario would fail if its
term were missing or wrong.
"""

from __future__ import annotations

import math
from typing import Mapping, Sequence

import numpy as np
import numpy.typing as npt
import pytest

import kvcompass as kc
from kvcompass.discovery.edge import Decision, Edge
from kvcompass.discovery.layout import IndexLayout, TableSpec, WorkerSpec
from functools import partial

from kvcompass.discovery.params import EdgeParams as _EdgeParams, layout_for
from kvcompass.errors import InvalidArgumentError, TopologyError
from kvcompass.index_types import Tier

# These scenarios compute expected scores with the paper's one-way WAN term (table 1);
# tests/test_plane.py covers the default full-RTT term end to end.
# Dispatch charges are off: each scenario sets the queues it scores against, and charges
# (tests/test_queues.py) would add the routes' own work between steps.
EdgeParams = partial(_EdgeParams, wan_fraction=0.5, dispatch_charge_ttl_s=0.0)

NS = kc.Namespace("llama-3.1-8b", "public")
BETA = 0.1
GAMMA = 0.005
PLAN_A = [256, 512, 1024, 2048]
VRAM, DRAM = int(Tier.VRAM), int(Tier.DRAM)


def prompt(seed: int, n: int = 2048) -> npt.NDArray[np.uint32]:
    return np.random.default_rng(seed).integers(0, 100_000, size=n, dtype=np.uint32)


def key_of(tokens: npt.NDArray[np.uint32], c: int) -> int:
    return int(NS.keys(tokens, [c])[0])


def expected(wan: float, tq: float, lam: float, beta: float, L: int, b: float, m: int, tier: int, gamma: float = GAMMA) -> float:
    remaining = L - b * m
    prefill = (1.0 + lam) * beta * remaining if remaining > 0 else 0.0
    reload = gamma * b * m if tier == DRAM else 0.0
    return wan + tq + prefill + reload


class Fleet:
    """Workers per region (one table each), their writers, and edges fed only by batches."""

    def __init__(self, regions: Mapping[str, int], *, beta: float = BETA, shards: int = 1, fp_bits: int = 16, roles: Mapping[str, str] | None = None) -> None:
        tables, specs = [], []
        for t, (r, n) in enumerate(regions.items()):
            ids = tuple(f"{r.lower()}{i}" for i in range(n))
            tables.append(TableSpec(t, r, ids))
            specs += [WorkerSpec(w, r, role=(roles or {}).get(w, "both"), beta_ms_per_token=beta) for w in ids]
        self.layout = IndexLayout(tuple(tables), shards=shards, fp_bits=fp_bits)
        self.specs = specs
        self.writers = {
            (t.table_id, s): kc.LudoTable(table=t.table_id, shard=s, capacity=64, value_bits=self.layout.value_bits, fp_bits=fp_bits)
            for t in tables
            for s in range(shards)
        }
        self.edges: list[Edge] = []

    def edge(self, region: str, plan: Mapping[str, Sequence[int]], rtt: Mapping[str, float], params: EdgeParams = EdgeParams(), seed: int = 0) -> Edge:
        e = Edge(region, self.layout, self.specs, plan, rtt, params, seed)
        for (t, s), w in self.writers.items():
            assert e.bootstrap(t, s, w.export_snapshot()).applied
        assert e.healthy
        self.edges.append(e)
        return e

    def hold(self, worker: str, tokens: npt.NDArray[np.uint32], lengths: Sequence[int], tier: int = VRAM) -> None:
        ref = self.layout.field_of(worker)
        for c in lengths:
            k = key_of(tokens, c)
            self.writers[(ref.table_id, k % self.layout.shards)].set_field(k, ref.field, tier)
        self.sync()

    def sync(self) -> None:
        for w in self.writers.values():
            b = w.take_batch()
            if b is not None:
                for e in self.edges:
                    assert e.apply_patch(b).applied


def check_terms(d: Decision) -> None:
    t = d.terms
    assert t.wan + t.queue + t.prefill + t.reload == d.score


# -- the joint score, term by term ---------------------------------------------------------------


@pytest.mark.parametrize("wan_fraction", [0.5, 1.0])
def test_remote_holder_wins_exactly_when_saved_prefill_exceeds_extra_wan(wan_fraction: float) -> None:
    plan_b = list(range(384, 1537, 64))
    rtt = {"A": 2.0, "B": 100.0}
    fleet = Fleet({"A": 1, "B": 1})
    edge = fleet.edge("A", {"A": PLAN_A, "B": plan_b}, rtt, EdgeParams(wan_fraction=wan_fraction, tie_ms=0.0))
    extra = wan_fraction * rtt["B"] - wan_fraction * rtt["A"]
    went_remote = []
    for i, m in enumerate(plan_b):
        p = prompt(100 + i)
        fleet.hold("b0", p, [c for c in plan_b if c <= m])
        d = edge.route(p, NS, now=float(i))
        s_local = expected(wan_fraction * 2.0, 0.0, 0.0, BETA, len(p), 1.0, 0, 0)
        s_remote = expected(wan_fraction * 100.0, 0.0, 0.0, BETA, len(p), 1.0, m, VRAM)
        assert (d.worker == "b0") == (BETA * m > extra)
        assert d.score == min(s_local, s_remote)
        assert d.expected_match == (m if d.worker == "b0" else 0)
        check_terms(d)
        went_remote.append(d.worker == "b0")
    assert any(went_remote) and not all(went_remote)  # the crossover lies inside the sweep


def test_queueing_shifts_the_choice_away_from_a_busy_holder() -> None:
    fleet = Fleet({"A": 2})
    edge = fleet.edge("A", {"A": PLAN_A}, {"A": 2.0}, EdgeParams(tie_ms=0.0))
    edge.set_local_queue("a1", 0.0, now=0.0)
    for i, tq in enumerate([0.0, 100.0, 204.0, 205.0, 400.0]):
        p = prompt(200 + i)
        fleet.hold("a0", p, PLAN_A)
        edge.set_local_queue("a0", tq, now=float(i))
        d = edge.route(p, NS, now=float(i))
        s_holder = expected(1.0, tq, 0.0, BETA, 2048, 1.0, 2048, VRAM)
        s_idle = expected(1.0, 0.0, 0.0, BETA, 2048, 1.0, 0, 0)
        assert d.worker == ("a0" if s_holder < s_idle else "a1")
        assert d.worker == ("a0" if tq < BETA * 2048 else "a1")
        assert d.score == min(s_holder, s_idle)
        assert d.terms.lam == 0.0  # an idle worker exists: no capacity price


def test_dram_holder_pays_the_reload() -> None:
    fleet = Fleet({"A": 2})
    # No speculative entry: the second route must see only what the workers registered.
    edge = fleet.edge("A", {"A": PLAN_A}, {"A": 2.0}, EdgeParams(tie_ms=0.0, speculative_ttl_s=0.0))
    p = prompt(300)
    fleet.hold("a0", p, [256, 512, 1024], VRAM)
    fleet.hold("a1", p, [256, 512, 1024], DRAM)
    d = edge.route(p, NS, now=0.0)
    assert (d.worker, d.tier, d.terms.reload) == ("a0", Tier.VRAM, 0.0)
    assert d.score == expected(1.0, 0.0, 0.0, BETA, 2048, 1.0, 1024, VRAM)
    # The VRAM holder's queue now exceeds the DRAM holder's reload (gamma * m = 5.12 ms).
    q = 6.0
    assert q > GAMMA * 1024
    edge.set_local_queue("a0", q, now=1.0)
    edge.set_local_queue("a1", 0.0, now=1.0)
    d = edge.route(p, NS, now=1.0)
    assert (d.worker, d.tier, d.expected_match) == ("a1", Tier.DRAM, 1024)
    assert d.terms.reload == GAMMA * 1.0 * 1024
    assert d.score == expected(1.0, 0.0, 0.0, BETA, 2048, 1.0, 1024, DRAM)
    check_terms(d)


def test_capacity_price_rises_with_load_and_shifts_toward_holders() -> None:
    fleet = Fleet({"A": 1, "B": 1})
    params = EdgeParams(tie_ms=0.0, speculative_ttl_s=0.0)
    p = prompt(400)
    fleet.hold("b0", p, [256])  # a short remote match: worth it only when recompute is priced up
    seen = []
    for x in [0.0, 50.0, 200.0, 800.0, 1600.0, 5000.0]:
        edge = fleet.edge("A", {"A": PLAN_A, "B": [256, 512, 1024]}, {"A": 2.0, "B": 100.0}, params)
        edge.set_local_queue("a0", x, 0.0)
        edge.on_broadcast("B", {"b0": x}, 0.0)  # the first sample of a worker replaces the initial 0
        assert edge.queue_estimate("b0") == x
        lam = min(params.lambda_max, x / params.tau_ms)
        assert edge.capacity_price() == lam
        d = edge.route(p, NS, 0.0)
        assert d.terms.lam == lam
        s_a = expected(1.0, x, lam, BETA, 2048, 1.0, 0, 0)
        s_b = expected(50.0, x, lam, BETA, 2048, 1.0, 256, VRAM)
        assert d.worker == ("b0" if s_b < s_a else "a0")
        assert d.score == min(s_a, s_b)
        seen.append((lam, d.worker))
    assert [w for _, w in seen] == ["a0", "a0", "b0", "b0", "b0", "b0"]
    assert [lam for lam, _ in seen] == [0.0, 0.25, 1.0, 4.0, 8.0, 8.0]  # capped at lambda_max


def test_belief_falls_after_false_claims_and_recovers() -> None:
    fleet = Fleet({"A": 2})
    params = EdgeParams(tie_ms=0.0, speculative_ttl_s=0.0, belief_half_life_s=0.0)  # the EWMA alone
    edge = fleet.edge("A", {"A": PLAN_A}, {"A": 2.0}, params)
    p = prompt(500)
    fleet.hold("a0", p, [256, 512, 1024])
    edge.set_local_queue("a0", 60.0, 0.0)
    edge.set_local_queue("a1", 0.0, 0.0)

    def route(now: float) -> Decision:
        d = edge.route(p, NS, now)
        b = edge.belief("a0")
        s0 = expected(1.0, 60.0, 0.0, BETA, 2048, b, 1024, VRAM)
        s1 = expected(1.0, 0.0, 0.0, BETA, 2048, 1.0, 0, 0)
        assert d.score == min(s0, s1)
        assert d.worker == ("a0" if s0 < s1 else "a1")
        return d

    assert route(0.0).worker == "a0"
    beliefs = []
    for i in range(3):  # a0 claims 1024 tokens but reuses none
        edge.on_response("a0", claimed_tokens=1024, reused_tokens=0, queue_vector=None, now=1.0 + i)
        beliefs.append(edge.belief("a0"))
    assert beliefs == pytest.approx([0.8, 0.64, 0.512])
    d = route(4.0)
    assert d.worker == "a1"  # 0.512 * 102.4 ms saved no longer covers a0's 60 ms queue
    # Routed to anyway (say a1 got busy), a0 proves its claim: belief recovers and it wins again.
    edge.on_response("a0", claimed_tokens=1024, reused_tokens=1024, queue_vector=None, now=5.0)
    assert edge.belief("a0") == pytest.approx(0.6096)
    assert route(6.0).worker == "a0"


def test_a_discounted_worker_is_trusted_again_after_its_half_life() -> None:
    """A worker driven to belief ~0 (here by false claims) wins no route on its claims, so no
    response could restore it: the belief drifts back toward the initial value with the
    half-life, and the holder wins again (issue 19)."""
    fleet = Fleet({"A": 2})
    edge = fleet.edge("A", {"A": PLAN_A}, {"A": 2.0}, EdgeParams(tie_ms=0.0, speculative_ttl_s=0.0, belief_half_life_s=30.0))
    p = prompt(500)
    fleet.hold("a0", p, [256, 512, 1024])
    edge.set_local_queue("a0", 60.0, 0.0)
    edge.set_local_queue("a1", 0.0, 0.0)
    assert edge.route(p, NS, 0.0).worker == "a0"
    for _ in range(200):
        edge.on_response("a0", claimed_tokens=1024, reused_tokens=0, queue_vector=None, now=0.5)
    assert edge.belief("a0") < 1e-15
    assert edge.route(p, NS, 0.9).worker == "a1"
    # Steps of less than a second change nothing; one half-life takes the gap to 1 in half.
    assert edge.belief("a0") < 1e-15
    edge.route(p, NS, 30.0)
    assert edge.belief("a0") == pytest.approx(0.5, abs=0.01)
    assert edge.route(p, NS, 60.0).worker == "a0"  # 0.75 * 102.4 ms saved covers the 60 ms queue
    # A worker that keeps over-claiming is pushed down again by its next responses.
    for _ in range(5):
        edge.on_response("a0", claimed_tokens=1024, reused_tokens=0, queue_vector=None, now=60.5)
    assert edge.route(p, NS, 60.9).worker == "a1"
    # Without recovery (the paper's belief) it stays at 0.
    flat = fleet.edge("A", {"A": PLAN_A}, {"A": 2.0}, EdgeParams(tie_ms=0.0, speculative_ttl_s=0.0, belief_half_life_s=0.0))
    flat.route(p, NS, 0.0)
    for _ in range(200):
        flat.on_response("a0", claimed_tokens=1024, reused_tokens=0, queue_vector=None, now=0.5)
    flat.route(p, NS, 600.0)
    assert flat.belief("a0") < 1e-15
    # No belief ablation: claims taken at face value throughout.
    flat = fleet.edge("A", {"A": PLAN_A}, {"A": 2.0}, EdgeParams(tie_ms=0.0, belief=False, speculative_ttl_s=0.0))
    flat.set_local_queue("a0", 60.0, 0.0)
    flat.set_local_queue("a1", 0.0, 0.0)
    for i in range(3):
        flat.on_response("a0", 1024, 0, None, 1.0 + i)
    d = flat.route(p, NS, 4.0)
    assert (d.worker, d.terms.belief) == ("a0", 1.0)


def test_closure_check_rejects_a_planted_structural_false_hit() -> None:
    fleet = Fleet({"A": 2})
    p = prompt(600)
    fleet.hold("a1", p, [256, 512, 1024])  # the true holder
    fleet.hold("a0", p, [2048])  # a claim at 2048 with no claim below it: a structural false hit
    on = fleet.edge("A", {"A": PLAN_A}, {"A": 2.0}, EdgeParams(tie_ms=0.0))
    off = fleet.edge("A", {"A": PLAN_A}, {"A": 2.0}, EdgeParams(tie_ms=0.0, closure=False))
    d = on.route(p, NS, 0.0)
    assert (d.worker, d.expected_match) == ("a1", 1024)
    assert d.score == expected(1.0, 0.0, 0.0, BETA, 2048, 1.0, 1024, VRAM)
    d = off.route(p, NS, 0.0)
    assert (d.worker, d.expected_match) == ("a0", 2048)
    assert d.score == expected(1.0, 0.0, 0.0, BETA, 2048, 1.0, 2048, VRAM)


# -- speculative entries and ties ---------------------------------------------------------------------


def test_speculative_entry_claims_the_chosen_worker_until_it_expires() -> None:
    fleet = Fleet({"A": 2})
    edge = fleet.edge("A", {"A": PLAN_A}, {"A": 2.0}, EdgeParams(tie_ms=0.0, speculative_ttl_s=2.0))
    p = prompt(700, 3000)
    d0 = edge.route(p, NS, 0.0)
    assert d0.tie_broken and d0.expected_match == 0
    assert edge.speculative_entries == 4  # every own-region plan length that fits 3000 tokens
    d1 = edge.route(p, NS, 1.0)  # already claimed in full: the entry is not extended
    assert (d1.worker, d1.expected_match, d1.tier, d1.tie_broken) == (d0.worker, 2048, Tier.VRAM, False)
    assert d1.score == expected(1.0, 0.0, 0.0, BETA, 3000, 1.0, 2048, VRAM)
    assert edge.expire(1.999) == 0
    assert edge.expire(2.0) == 4 and edge.speculative_entries == 0
    d2 = edge.route(p, NS, 2.0)
    assert d2.expected_match == 0 and d2.tie_broken
    # Speculation lives in private tables: the replicated views still equal their writers.
    for (t, s), w in fleet.writers.items():
        assert edge.view(t, s).digest() == w.digest()
    assert edge.stats.speculative_expired == 4


def test_speculative_entry_is_extended_when_the_worker_is_chosen_for_a_longer_prompt() -> None:
    fleet = Fleet({"A": 2})
    edge = fleet.edge("A", {"A": PLAN_A}, {"A": 2.0}, EdgeParams(tie_ms=0.0))
    edge.set_local_queue("a1", 50.0, 0.0)  # a0 wins every clear contest
    p = prompt(705, 3000)
    assert edge.route(p[:600], NS, 0.0).worker == "a0"  # entries at 256, 512 until 2.0
    d = edge.route(p, NS, 1.0)  # claims 512; 1024 and 2048 added, 256 and 512 refreshed: until 3.0
    assert (d.worker, d.expected_match) == ("a0", 512)
    assert edge.speculative_entries == 4
    assert edge.expire(2.5) == 0 and edge.expire(3.0) == 4


def test_speculative_entry_of_a_remote_winner_uses_the_plan_toward_its_region() -> None:
    fleet = Fleet({"A": 1, "B": 1})
    edge = fleet.edge("A", {"A": PLAN_A, "B": [1024, 1536]}, {"A": 2.0, "B": 100.0}, EdgeParams(tie_ms=0.0))
    p = prompt(710)
    fleet.hold("b0", p, [1024])
    assert edge.route(p, NS, 0.0).worker == "b0"
    assert edge.speculative_entries == 2  # 1024 and 1536 toward B
    d = edge.route(p, NS, 0.5)
    assert (d.worker, d.expected_match) == ("b0", 1536)


def test_ties_are_spread_and_reproducible() -> None:
    fleet = Fleet({"A": 6})
    edge = fleet.edge("A", {"A": PLAN_A}, {"A": 2.0}, EdgeParams(tie_ms=1.0), seed=1)
    edge.set_local_queue("a4", 0.5, 0.0)  # within the 1 ms band: still a candidate
    edge.set_local_queue("a5", 2.0, 0.0)  # outside it: never wins
    short = prompt(800, 100)  # shorter than every plan length: no lookups, equal scores
    counts = dict.fromkeys(edge.workers, 0)
    seq = []
    for i in range(500):
        d = edge.route(short, NS, float(i))
        assert d.tie_broken and d.candidates == 5
        counts[d.worker] += 1
        seq.append(d.worker)
    assert counts["a5"] == 0
    assert all(60 <= counts[w] <= 140 for w in ["a0", "a1", "a2", "a3", "a4"]), counts
    same = fleet.edge("A", {"A": PLAN_A}, {"A": 2.0}, EdgeParams(tie_ms=1.0), seed=1)
    other = fleet.edge("A", {"A": PLAN_A}, {"A": 2.0}, EdgeParams(tie_ms=1.0), seed=2)
    for e in (same, other):
        e.set_local_queue("a4", 0.5, 0.0)
        e.set_local_queue("a5", 2.0, 0.0)
    assert [same.route(short, NS, float(i)).worker for i in range(50)] == seq[:50]
    assert [other.route(short, NS, float(i)).worker for i in range(50)] != seq[:50]
    assert edge.stats.ties == 500


# -- ablations: each one changes a constructed decision -----------------------------------------------------


def test_ablation_no_load_awareness() -> None:
    fleet = Fleet({"A": 2})
    p = prompt(900)
    fleet.hold("a0", p, PLAN_A)
    edges = {la: fleet.edge("A", {"A": PLAN_A}, {"A": 2.0}, EdgeParams(tie_ms=0.0, load_aware=la)) for la in (True, False)}
    for e in edges.values():
        e.set_local_queue("a0", 500.0, 0.0)
        e.set_local_queue("a1", 0.0, 0.0)
    on, off = (edges[True].route(p, NS, 0.0), edges[False].route(p, NS, 0.0))
    assert on.worker == "a1"  # busy holder: recompute on the idle a1
    assert on.score == expected(1.0, 0.0, 0.0, BETA, 2048, 1.0, 0, 0)
    assert (off.worker, off.terms.queue, off.terms.lam) == ("a0", 0.0, 0.0)
    assert off.score == expected(1.0, 0.0, 0.0, BETA, 2048, 1.0, 2048, VRAM)


def test_ablation_no_cross_region_reuse() -> None:
    fleet = Fleet({"A": 1, "B": 1})
    p = prompt(910)
    fleet.hold("b0", p, [1024, 1536])
    plan = {"A": PLAN_A, "B": [1024, 1536]}
    rtt = {"A": 2.0, "B": 100.0}
    on = fleet.edge("A", plan, rtt, EdgeParams(tie_ms=0.0))
    off = fleet.edge("A", plan, rtt, EdgeParams(tie_ms=0.0, cross_region=False))
    assert on.route(p, NS, 0.0).worker == "b0"
    assert off.plan["B"] == ()
    # Even an idle remote worker with the best score may not win: a0 is swamped, b0 is not.
    for e in (on, off):
        e.set_local_queue("a0", 10_000.0, 0.0)
    d = off.route(p, NS, 0.0)
    assert (d.worker, d.expected_match) == ("a0", 0)
    assert on.route(prompt(911), NS, 0.0).worker == "b0"


def test_ablation_tier_blind() -> None:
    fleet = Fleet({"A": 2})
    p = prompt(920)
    fleet.hold("a0", p, PLAN_A, DRAM)
    fleet.hold("a1", p, PLAN_A, VRAM)
    aware = fleet.edge("A", {"A": PLAN_A}, {"A": 2.0}, EdgeParams(tie_ms=0.0))
    blind = fleet.edge("A", {"A": PLAN_A}, {"A": 2.0}, EdgeParams(tie_ms=0.0, tier_aware=False))
    for e in (aware, blind):
        e.set_local_queue("a0", 0.0, 0.0)
        e.set_local_queue("a1", 5.0, 0.0)  # less than the 10.24 ms reload, more than nothing
    d = aware.route(p, NS, 0.0)
    assert d.worker == "a1" and d.score == 1.0 + 5.0
    d = blind.route(p, NS, 0.0)
    assert (d.worker, d.tier, d.terms.reload) == ("a0", Tier.DRAM, 0.0)


def test_ablation_no_fingerprints_lets_a_structural_false_hit_through() -> None:
    # Fill a table to high occupancy for a0; find a never-registered prompt that reads an
    # occupied slot of the fingerprint-free view. The same entries with 16-bit fingerprints
    # answer "absent" for it.
    params0 = EdgeParams(tie_ms=0.0, fingerprints=False, closure=False)
    base = Fleet({"A": 2}).layout
    with pytest.raises(TopologyError, match="fingerprints"):
        Edge("A", base, Fleet({"A": 2}).specs, {"A": [256]}, {"A": 2.0}, params0)
    assert layout_for(base, params0).fp_bits == 0 and layout_for(base, EdgeParams()) is base
    results = {}
    for fp in (0, 16):
        fleet = Fleet({"A": 2}, fp_bits=fp)
        ref = fleet.layout.field_of("a0")
        w = fleet.writers[(0, 0)]
        for i in range(56):
            w.set_field(key_of(prompt(10_000 + i, 256), 256), ref.field, VRAM)
        fleet.sync()
        e = fleet.edge("A", {"A": [256]}, {"A": 2.0}, params0 if fp == 0 else EdgeParams(tie_ms=0.0, closure=False))
        e.set_local_queue("a0", 5.0, 0.0)  # a0 wins only on a (false) claim
        results[fp] = e
    probe = next(prompt(20_000 + i, 256) for i in range(1000) if results[0].view(0, 0).lookup(key_of(prompt(20_000 + i, 256), 256)) & 3)
    d0, d16 = results[0].route(probe, NS, 0.0), results[16].route(probe, NS, 0.0)
    assert (d0.worker, d0.expected_match) == ("a0", 256)
    assert (d16.worker, d16.expected_match) == ("a1", 0)


# -- construction and modes ---------------------------------------------------------------------------------


def test_disaggregated_mode_routes_only_to_indexed_prefill_workers() -> None:
    with pytest.raises(TopologyError, match="decode"):
        Fleet({"A": 2}, roles={"a1": "decode"}).edge("A", {"A": PLAN_A}, {"A": 2.0})
    with pytest.raises(TopologyError, match="prefill"):
        Fleet({"A": 2}, roles={"a0": "prefill"}).edge("A", {"A": PLAN_A}, {"A": 2.0}, EdgeParams(disaggregated=True))
    fleet = Fleet({"A": 2}, roles={"a0": "prefill", "a1": "prefill"})
    edge = fleet.edge("A", {"A": PLAN_A}, {"A": 2.0}, EdgeParams(disaggregated=True, tie_ms=0.0))
    p = prompt(950)
    fleet.hold("a1", p, PLAN_A)
    assert edge.route(p, NS, 0.0).worker == "a1"


def test_constructor_validates_its_inputs() -> None:
    fleet = Fleet({"A": 1, "B": 1})
    ok = {"A": PLAN_A, "B": [1024]}
    rtt = {"A": 2.0, "B": 100.0}
    with pytest.raises(TopologyError, match="plan"):
        Edge("A", fleet.layout, fleet.specs, {"A": PLAN_A}, rtt)
    with pytest.raises(TopologyError, match="rtt"):
        Edge("A", fleet.layout, fleet.specs, ok, {"A": 2.0})
    with pytest.raises(TopologyError, match="ascending"):
        Edge("A", fleet.layout, fleet.specs, {"A": [512, 256], "B": [1024]}, rtt)
    with pytest.raises(TopologyError, match="order"):
        Edge("A", fleet.layout, list(reversed(fleet.specs)), ok, rtt)
    with pytest.raises(TopologyError, match="no worker may serve"):
        Edge("C", fleet.layout, fleet.specs, {**ok, "C": [256]}, {**rtt, "C": 1.0}, EdgeParams(cross_region=False))
    with pytest.raises(ValueError, match="tau_ms"):
        EdgeParams(tau_ms=0.0)
    # An edge in a region without workers still routes (to the cheapest region).
    e = Edge("C", fleet.layout, fleet.specs, {**ok, "C": [256]}, {**rtt, "C": 1.0, "A": 10.0})
    assert e.n1("b0") == 100.0 / BETA
    assert e.route(prompt(960), NS, 0.0).region == "A"


def test_route_accepts_lists_and_raw_digests_and_prompts_of_any_length() -> None:
    fleet = Fleet({"A": 2}, shards=2)
    edge = fleet.edge("A", {"A": PLAN_A}, {"A": 2.0}, EdgeParams(tie_ms=0.0))
    p = prompt(970)
    fleet.hold("a1", p, PLAN_A)
    d = edge.route([int(x) for x in p], NS.digest, 0.0)
    assert (d.worker, d.expected_match, d.local_match) == ("a1", 2048, 2048)
    d = edge.route(np.array([], dtype=np.uint32), NS, 0.0)
    assert d.prompt_tokens == 0 and d.score == 1.0 and d.family is None
    with pytest.raises(ValueError):
        edge.route([-1], NS, 0.0)


def test_a_batch_of_live_readings_is_the_same_as_one_at_a_time() -> None:
    fleet = Fleet({"A": 3, "B": 1})
    plans = {"A": PLAN_A, "B": [256, 512, 1024]}
    rtts = {"A": 2.0, "B": 100.0}
    one, many = fleet.edge("A", plans, rtts), fleet.edge("A", plans, rtts)
    # A route charges its worker the prefill it sent; the readings then settle that charge.
    assert one.route(prompt(900), NS, now=0.5).worker == many.route(prompt(900), NS, now=0.5).worker
    readings = [("a0", 12.5), ("a1", 0.0), ("a2", 300.0)]
    for w, q in readings:
        one.set_local_queue(w, q, now=1.0)
    idx = np.array([many.worker_index(w) for w, _ in readings], dtype=np.int64)
    many.set_local_queues(idx, np.array([q for _, q in readings]), now=1.0)
    for w in ("a0", "a1", "a2", "b0"):
        assert many.queue_estimate(w) == one.queue_estimate(w)
        assert many.queue_age(w, 2.0) == one.queue_age(w, 2.0)
    with pytest.raises(InvalidArgumentError, match="b0"):
        many.set_local_queues(np.array([many.worker_index("b0")], dtype=np.int64), np.array([1.0]), now=2.0)
    with pytest.raises(ValueError):
        many.set_local_queues(idx[:1], np.array([-1.0]), now=2.0)
    assert many.queue_estimate("a0") == 12.5  # a refused batch changes nothing


def test_a_vector_map_folds_a_broadcast_as_on_broadcast_does() -> None:
    """``vector_map`` (for a driver that delivers broadcasts itself) and ``live_sink``: folding
    a vector through them is ``on_broadcast`` of it, charges settled included."""
    fleet = Fleet({"A": 2, "B": 3})
    plans = {"A": PLAN_A, "B": [256, 512, 1024]}
    rtts = {"A": 2.0, "B": 100.0}
    one, other = fleet.edge("A", plans, rtts), fleet.edge("A", plans, rtts)
    for e in (one, other):  # a dispatch charge toward b1 that a sample may settle
        e.route(prompt(901), NS, now=0.5, exclude=["a0", "a1", "b0", "b2"])
    ids = ("b2", "b0", "b1")
    for k, t in enumerate((1.0, 1.05, 3.0)):
        vals = np.array([10.0 * k, 5.0 + k, 40.0 / (k + 1)])
        one.on_broadcast("B", dict(zip(ids, vals.tolist())), t)
        ix, pos, lags = other.vector_map("B", ids)
        q, all_lags = other.live_sink()
        assert pos is None and lags == [float(all_lags[i]) for i in ix]
        q.fold_lagged(np.array(ix, dtype=np.int64), vals, t, np.array(lags))
    for w in ("a0", "a1", "b0", "b1", "b2"):
        assert other.queue_estimate(w) == one.queue_estimate(w)
        assert other.queue_age(w, 4.0) == one.queue_age(w, 4.0)
    with pytest.raises(InvalidArgumentError, match="own region"):
        other.vector_map("A", ("a0",))
    with pytest.raises(InvalidArgumentError, match="not workers of 'B'"):
        other.vector_map("B", ("b0", "a1"))


def test_a_lookup_decides_as_a_route_would_and_changes_nothing() -> None:
    # issue 16: a gateway that only asks who holds a prompt used to register a 2 s claim, so
    # its next question saw a hit nobody held.
    fleet = Fleet({"A": 2})
    edge = fleet.edge("A", {"A": PLAN_A}, {"A": 2.0}, EdgeParams(tie_ms=0.0, speculative_ttl_s=2.0, dispatch_charge_ttl_s=2.0))
    p = prompt(710, 3000)
    queues = [edge.queue_estimate(w) for w in edge.workers]
    for t in (0.0, 0.5):
        d = edge.lookup(p, NS, t)
        assert d.expected_match == 0 and d.prompt_tokens == 3000
    assert edge.speculative_entries == 0 and edge.stats.routes == 0
    assert [edge.queue_estimate(w) for w in edge.workers] == queues  # no dispatch charge
    d0 = edge.route(p, NS, 1.0)
    assert edge.speculative_entries == 4 and edge.queue_estimate(d0.worker) > 0
    other = next(w for w in edge.workers if w != d0.worker)
    seen = edge.lookup(p, NS, 1.5, exclude=[other])  # a lookup sees what routes did
    assert (seen.worker, seen.expected_match) == (d0.worker, 2048) and edge.stats.routes == 1
    # The same family as the route names (found in review: None from a lookup or a hand-off),
    # while only the route counted it.
    assert d0.family is not None and seen.family == d.family == d0.family
    assert edge.handoff(p, NS, d0.worker, 1.6).family == d0.family
    assert edge.stats.local_misses == 1


def test_the_one_call_route_decides_as_score_choose_commit() -> None:
    """``Edge.route`` takes one Rust call (``EdgeCore.route``: expiries, price, route, tie draw,
    commit); a door's retry with ``exclude`` goes through ``score``, the Python tie-break over
    the scores and ``commit``. With nothing excluded both must decide alike, route after route,
    and leave the same speculative entries, charges and counters behind (two edges, one seed)."""
    fleet = Fleet({"A": 4, "B": 3})
    plan = {"A": PLAN_A, "B": [512, 1024, 2048]}
    params = _EdgeParams(tie_ms=5.0, speculative_ttl_s=0.7, dispatch_charge_ttl_s=0.5)
    one, split = fleet.edge("A", plan, {"A": 2.0, "B": 60.0}, params, seed=7), fleet.edge("A", plan, {"A": 2.0, "B": 60.0}, params, seed=7)
    rng = np.random.default_rng(3)
    prompts = [prompt(900 + i, 3000 if i < 2 else int(rng.integers(200, 3000))) for i in range(12)]
    fleet.hold("b1", prompts[0], [512, 1024], DRAM)
    fleet.hold("a2", prompts[1], [256, 512])

    def via_score(edge: Edge, p: npt.NDArray[np.uint32], now: float) -> Decision:
        res = edge._core.score(p, NS.digest, now, edge._belief_now(now))
        w, n = edge._choose(res, ())
        edge._n.routes += 1
        edge._n.ties += n > 1
        return edge._decide(res, edge._core.commit(res, w, n, now, True), p, NS.digest, now)

    now, ties = 0.0, 0
    for step in range(300):
        now += float(rng.exponential(0.05))
        p = prompts[int(rng.integers(len(prompts)))]
        a, b = one.route(p, NS, now), via_score(split, p, now)
        assert a == b, f"step {step}"
        ties += a.tie_broken
        if step % 25 == 0:
            tq = float(rng.uniform(0, 40))
            for e in (one, split):
                e.set_local_queue("a0", tq, now)
    assert ties > 20  # the draw among near-equal workers was exercised
    assert one.speculative_entries == split.speculative_entries > 0
    assert one.stats == split.stats
    assert [one.queue_estimate(w) for w in one.workers] == [split.queue_estimate(w) for w in split.workers]


def test_edge_core_refuses_inconsistent_wiring() -> None:
    """The core checks what it is built from: per-worker lists of one length, regions the plan
    covers, tables that have a speculative view, every parameter present."""
    fleet = Fleet({"A": 2})
    edge = fleet.edge("A", {"A": PLAN_A}, {"A": 2.0})
    workers = {"region": [0, 0], "beta": [BETA, BETA], "wan": [1.0, 1.0], "local": [True, True], "eligible": [True, True], "fields": [(0, 0), (0, 1)]}
    params = {"load_aware": True, "lambda_max": 1.0, "tau_ms": 200.0, "gamma": GAMMA, "closure": True, "tie_ms": 0.0, "speculative_ttl_s": 1.0}
    params |= {"charge": False, "migration": False, "value_bits": 32, "spec_capacity": 64, "spec_fp_bits": 16, "block_size": 16}

    def core(w: dict[str, object], p: dict[str, object], plan: list[list[int]] = [PLAN_A]) -> object:
        return kc._core.EdgeCore(edge._router, edge._queues, w, plan, 256, [kc._core.LudoView(0, 0)], p)  # type: ignore[arg-type]

    core(workers, params)  # the consistent wiring builds
    with pytest.raises(ValueError, match="every per-worker list must have 2 entries"):
        core(workers | {"beta": [BETA]}, params)
    with pytest.raises(ValueError, match="region 1 has no plan"):
        core(workers | {"region": [0, 1]}, params)
    with pytest.raises(ValueError, match="table 1 has no speculative view"):
        core(workers | {"fields": [(0, 0), (1, 0)]}, params)
    with pytest.raises(KeyError, match="tau_ms"):
        core(workers, {k: v for k, v in params.items() if k != "tau_ms"})


def test_a_false_claim_reported_long_after_the_last_route_is_not_forgiven_by_the_next() -> None:
    """Found in review: beliefs relaxed toward 1 over the whole time since the last route, so a
    report arriving long after it had its effect undone by the next route on a quiet edge:
    three false claims at t=120 s left 0.512, the route 10 ms later scored with 0.878."""
    from kvcompass.discovery.params import EdgeParams

    fleet = Fleet({"A": 2})
    edge = fleet.edge("A", {"A": [256, 512, 1024, 2048]}, {"A": 2.0}, EdgeParams(tie_ms=0.0))
    edge.route(prompt(1), NS, 0.0)
    for _ in range(3):
        edge.on_response("a0", 2048, 0, None, 120.0)
    after = edge.belief("a0")
    edge.route(prompt(2), NS, 120.01)
    assert after < 0.6 and edge.belief("a0") == pytest.approx(after, abs=0.01)


def test_a_draw_outside_zero_one_is_a_clear_error_not_a_panic() -> None:
    """Found in review: EdgeCore.route indexed the near-best candidates with a draw of 1.0 past
    their end (a PanicException); the edge's own generator never returns 1.0, a caller's may."""
    from kvcompass.discovery.layout import IndexLayout, TableSpec, WorkerSpec

    layout = IndexLayout((TableSpec(0, "A", ("a0", "a1")),), shards=1, fp_bits=8)
    edge = Edge("A", layout, [WorkerSpec("a0", "A"), WorkerSpec("a1", "A")], {"A": [256]}, {"A": 2.0})
    edge._draw = lambda: 1.0  # type: ignore[method-assign]
    with pytest.raises(ValueError, match=r"draw\(\) must return a number in \[0, 1\)"):
        edge.route(list(range(10)), b"n" * 32, 1.0)


def test_a_non_finite_time_is_refused_before_it_leaves_anything_behind() -> None:
    """Found in review: one route with now=NaN left speculative entries and a dispatch charge
    that never expired (false claims and a busy-looking worker for good)."""
    fleet = Fleet({"A": 2})
    edge = fleet.edge("A", {"A": [256, 512]}, {"A": 2.0})
    for bad in (math.nan, math.inf):
        with pytest.raises(InvalidArgumentError, match="finite"):
            edge.route(prompt(1), NS, bad)
    assert edge.speculative_entries == 0
