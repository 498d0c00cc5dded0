"""Router: the lookup-and-score loop over real replicated views.

Every scenario builds real writers (one LudoTable per shard of a region table), follower views
fed only by snapshot + batches, and registers prefixes with ``set_field`` at the keys from
``kvcompass.prefix_keys``. Expected scores are computed from the documented formula

    score(w) = wan + tq + (1 + lam) * beta * (L - b*m) + gamma * b * m * [tier == DRAM]

in the same operation order as the core, so they compare with ``==``.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import kvcompass as kc
from kvcompass import errors as E
from _support import follower

NS = kc.namespace_digest("llama-3.1-8b", "public")
PROMPT = np.arange(1000, 1064, dtype=np.uint32)  # L = 64
L = len(PROMPT)
PLAN1 = [[8, 16, 32, 64]]
VRAM, DRAM = 1, 2


def key_of(tokens: np.ndarray, c: int) -> int:
    return int(kc.prefix_keys(NS, np.ascontiguousarray(tokens, dtype=np.uint32), np.array([c], dtype=np.uint32))[0])


class Group:
    """One region table: a writer per shard and the edge's follower view of each shard.

    16-bit fingerprints keep never-registered prefixes from reading another key's slot (a
    structural false hit of the keyless view), so every expected match below is exact.
    """

    def __init__(self, region: int, workers: list[int], shards: int = 1, table: int = 0, value_bits: int = 64, fp_bits: int = 16) -> None:
        self.region = region
        self.workers = np.array(workers, dtype=np.uint32)
        self.tables = [kc.LudoTable(table=table, shard=s, capacity=16, value_bits=value_bits, fp_bits=fp_bits) for s in range(shards)]
        self.views = [follower(t) for t in self.tables]

    def writer(self, key: int) -> kc.LudoTable:
        return self.tables[key % len(self.tables)]

    def put(self, field: int, tier: int, lengths: list[int], tokens: np.ndarray = PROMPT) -> Group:
        for c in lengths:
            k = key_of(tokens, c)
            self.writer(k).set_field(k, field, tier)
        return self.sync()

    def put_raw(self, c: int, value: int, tokens: np.ndarray = PROMPT) -> Group:
        k = key_of(tokens, c)
        self.writer(k).set(k, value)
        return self.sync()

    def sync(self) -> Group:
        for t, v in zip(self.tables, self.views):
            b = t.take_batch()
            if b is not None:
                v.apply_batch(b)
        return self

    def spec(self) -> tuple[int, np.ndarray, list[kc.LudoView]]:
        return (self.region, self.workers, self.views)


def workers(n: int, *, region: list[int] | None = None, beta: float | list[float] = 1.0, wan: float | list[float] = 0.0, tq: float | list[float] = 0.0, belief: float | list[float] = 1.0) -> dict[str, np.ndarray]:
    def f(x: float | list[float]) -> np.ndarray:
        return np.array(x if isinstance(x, list) else [x] * n, dtype=np.float64)

    return {
        "region": np.array(region if region is not None else [0] * n, dtype=np.uint32),
        "beta": f(beta),
        "wan": f(wan),
        "tq": f(tq),
        "belief": f(belief),
    }


def route(router: kc.Router, w: dict[str, np.ndarray], tokens: np.ndarray = PROMPT, **kw: float | bool) -> kc.RouteResult:
    return router.route(tokens, NS, w["region"], w["beta"], w["wan"], w["tq"], w["belief"], **kw)  # type: ignore[arg-type]


def expected(w: dict[str, np.ndarray], matches: list[int], tiers: list[int], prompt_len: int = L, gamma: float = 0.005, lam: float = 0.0) -> list[float]:
    out = []
    for i in range(len(matches)):
        wan, tq, beta, b = float(w["wan"][i]), float(w["tq"][i]), float(w["beta"][i]), float(w["belief"][i])
        m = matches[i]
        dram = 1.0 if tiers[i] == DRAM else 0.0
        out.append(wan + tq + (1 + lam) * beta * (prompt_len - b * m) + gamma * b * m * dram)
    return out


def check(r: kc.RouteResult, w: dict[str, np.ndarray], matches: list[int], tiers: list[int], winner: int, **kw: float) -> None:
    assert r.matches.tolist() == matches
    assert r.tiers.tolist() == tiers
    want = expected(w, matches, tiers, **kw)
    assert r.scores.tolist() == want
    assert r.winner == winner == int(np.argmin(want))
    assert r.score == want[winner]


def test_near_best_local_match_and_winner_terms() -> None:
    """``near`` is numpy's ``scores <= best + tie_ms`` (the tie-break's candidates), ``local_match``
    the longest region-0 match, ``at(w)`` worker w's (match, tier, score)."""
    g0 = Group(0, [0, 1]).put(0, VRAM, [8, 16])
    g1 = Group(1, [2, 3]).put(1, DRAM, [8, 16, 32])  # field 1 of this table: worker 3
    router = kc.Router([[8, 16, 32, 64], [8, 16, 32, 64]], [g0.spec(), g1.spec()])
    w = workers(4, region=[0, 0, 1, 1], wan=[0.0, 0.0, 9.5, 10.0])
    for tie in (0.0, 0.5, 10.0, 100.0):
        r = route(router, w, tie_ms=tie)
        want = (r.scores <= r.score + tie).nonzero()[0].tolist()
        assert r.near == want and want  # the best is always among them
    assert route(router, w).near == []  # no tie_ms: nothing computed
    r = route(router, w, tie_ms=0.0)
    assert r.local_match == 16  # worker 3's 32 is another region's
    for i in range(4):
        assert r.at(i) == (int(r.matches[i]), int(r.tiers[i]), float(r.scores[i]))
    assert r.at(3)[:2] == (32, DRAM)
    with pytest.raises(IndexError):
        r.at(4)
    # No region-0 worker holds anything: 0.
    assert route(kc.Router(PLAN1, [Group(0, [0, 1]).spec()]), workers(2), tie_ms=0.0).local_match == 0


# ---- scenarios: one score term at a time ---------------------------------------------------


def test_no_cache_baseline_and_tie_break() -> None:
    g = Group(0, [0, 1, 2])
    router = kc.Router(PLAN1, [g.spec()])
    w = workers(3, wan=[5.0, 3.0, 3.0], beta=0.5)
    r = route(router, w)
    check(r, w, [0, 0, 0], [0, 0, 0], winner=1)  # 1 and 2 tie: the lowest index wins
    assert r.scores.tolist() == [5.0 + 32.0, 3.0 + 32.0, 3.0 + 32.0]


def test_result_types() -> None:
    g = Group(0, [0, 1]).put(1, VRAM, [8, 16])
    router = kc.Router(PLAN1, [g.spec()])
    r = route(router, workers(2))
    assert isinstance(r, kc.RouteResult)
    assert isinstance(r.winner, int) and isinstance(r.score, float)
    assert r.matches.dtype == np.uint32 and r.tiers.dtype == np.uint8 and r.scores.dtype == np.float64
    assert r.matches.shape == r.tiers.shape == r.scores.shape == (2,)
    assert r.matches.tolist() == [0, 16] and r.tiers.tolist() == [0, VRAM]
    assert "RouteResult(winner=1" in repr(r)
    assert router.n_tables == 1 and router.plan == PLAN1
    assert "Router(" in repr(router)


def test_wan_term() -> None:
    g = Group(0, [0, 1]).put(0, VRAM, [8, 16, 32, 64]).put(1, VRAM, [8, 16, 32, 64])
    router = kc.Router(PLAN1, [g.spec()])
    w = workers(2, wan=[12.5, 7.25])
    check(route(router, w), w, [64, 64], [VRAM, VRAM], winner=1)
    w = workers(2, wan=[7.0, 12.5])
    check(route(router, w), w, [64, 64], [VRAM, VRAM], winner=0)
    assert route(router, w).score == 7.0


def test_queue_term() -> None:
    g = Group(0, [0, 1]).put(0, VRAM, [8, 16]).put(1, VRAM, [8, 16])
    router = kc.Router(PLAN1, [g.spec()])
    w = workers(2, tq=[30.0, 10.0], wan=[1.0, 1.0], beta=0.25)
    r = route(router, w)
    check(r, w, [16, 16], [VRAM, VRAM], winner=1)
    assert r.score == 1.0 + 10.0 + 0.25 * 48


def test_prefill_term_longer_match_wins() -> None:
    g = Group(0, [0, 1, 2]).put(0, VRAM, [8, 16]).put(1, VRAM, [8, 16, 32, 64]).put(2, VRAM, [8])
    router = kc.Router(PLAN1, [g.spec()])
    w = workers(3, beta=2.0)
    r = route(router, w)
    check(r, w, [16, 64, 8], [VRAM, VRAM, VRAM], winner=1)
    assert r.scores.tolist() == [2.0 * 48, 0.0, 2.0 * 56]


def test_dram_reload_term() -> None:
    g = Group(0, [0, 1]).put(0, VRAM, [8, 16, 32]).put(1, DRAM, [8, 16, 32, 64])
    router = kc.Router(PLAN1, [g.spec()])
    w = workers(2, beta=1.0)
    # Cheap reload: the DRAM copy of the whole prompt beats recomputing half of it.
    r = route(router, w, gamma=0.1)
    check(r, w, [32, 64], [VRAM, DRAM], winner=1, gamma=0.1)
    assert r.scores.tolist() == [32.0, 0.1 * 64]
    # Expensive reload: the VRAM half wins.
    r = route(router, w, gamma=2.0)
    check(r, w, [32, 64], [VRAM, DRAM], winner=0, gamma=2.0)
    assert r.scores.tolist() == [32.0, 128.0]
    # The default gamma is 0.005 ms/token.
    check(route(router, w), w, [32, 64], [VRAM, DRAM], winner=1, gamma=0.005)


def test_equal_match_vram_beats_dram_by_the_reload_cost() -> None:
    g = Group(0, [0, 1]).put(0, DRAM, [8, 16, 32]).put(1, VRAM, [8, 16, 32])
    router = kc.Router(PLAN1, [g.spec()])
    w = workers(2)
    r = route(router, w, gamma=0.5)
    check(r, w, [32, 32], [DRAM, VRAM], winner=1, gamma=0.5)
    assert r.scores[0] - r.scores[1] == 0.5 * 32


def test_lambda_term() -> None:
    g = Group(0, [0, 1]).put(1, VRAM, [8, 16, 32])
    router = kc.Router(PLAN1, [g.spec()])
    w = workers(2, wan=[0.0, 40.0], beta=1.0)
    r = route(router, w, lam=0.0)
    check(r, w, [0, 32], [0, VRAM], winner=0, lam=0.0)
    assert r.scores.tolist() == [64.0, 72.0]
    # Pricing capacity makes the cache hit worth the longer network path.
    r = route(router, w, lam=1.0)
    check(r, w, [0, 32], [0, VRAM], winner=1, lam=1.0)
    assert r.scores.tolist() == [128.0, 104.0]


def test_belief_term() -> None:
    g = Group(0, [0, 1, 2]).put(0, VRAM, [8, 16, 32, 64]).put(1, DRAM, [8, 16, 32, 64]).put(2, VRAM, [8, 16, 32])
    router = kc.Router(PLAN1, [g.spec()])
    # belief 0 cancels the claim entirely (prefill of the whole prompt, no reload cost), but
    # the claimed match is still reported as evidence.
    w = workers(3, belief=[0.0, 0.0, 1.0], wan=[0.0, 0.0, 5.0])
    r = route(router, w, gamma=1.0)
    check(r, w, [64, 64, 32], [VRAM, DRAM, VRAM], winner=2, gamma=1.0)
    assert r.scores.tolist() == [64.0, 64.0, 5.0 + 32.0]
    w = workers(3, belief=[0.5, 0.5, 1.0])
    r = route(router, w, gamma=1.0)
    check(r, w, [64, 64, 32], [VRAM, DRAM, VRAM], winner=0, gamma=1.0)
    assert r.scores.tolist() == [32.0, 32.0 + 32.0, 32.0]


def test_closure_check() -> None:
    # w0 holds 8, 16 and 64 but not 32; w1 holds only 64; w2 holds everything.
    g = Group(0, [0, 1, 2]).put(0, VRAM, [8, 16, 64]).put(1, VRAM, [64]).put(2, VRAM, [8, 16, 32, 64])
    router = kc.Router(PLAN1, [g.spec()])
    w = workers(3, wan=[1.0, 0.0, 2.0])
    r = route(router, w, closure=True)
    check(r, w, [16, 0, 64], [VRAM, 0, VRAM], winner=2)
    r = route(router, w, closure=False)
    check(r, w, [64, 64, 64], [VRAM, VRAM, VRAM], winner=1)
    assert route(router, w).matches.tolist() == [16, 0, 64]  # closure is the default


def test_tier_mix_along_the_chain() -> None:
    # VRAM at short levels, DRAM at the longest: the match takes the tier of its own level.
    g = Group(0, [0]).put(0, VRAM, [8, 16, 32]).put(0, DRAM, [64])
    router = kc.Router(PLAN1, [g.spec()])
    w = workers(1)
    check(route(router, w, gamma=0.25), w, [64], [DRAM], winner=0, gamma=0.25)


def test_reserved_tier_and_foreign_bits_read_as_absent() -> None:
    g = Group(0, [0, 1])
    for c in [8, 16, 32, 64]:
        # field 0 = 3 (reserved), field 1 = VRAM, field 5 (beyond the table's 2 workers) = DRAM
        g.put_raw(c, 0b11 | (VRAM << 2) | (DRAM << 10))
    router = kc.Router(PLAN1, [g.spec()])
    w = workers(2)
    for closure in (True, False):
        check(route(router, w, closure=closure), w, [0, 64], [0, VRAM], winner=1)


def test_worker_in_several_tables_keeps_the_best_claim() -> None:
    plan = [[8, 16, 32, 64], [16, 64]]
    a = Group(0, [0, 1], table=0).put(0, VRAM, [8, 16]).put(1, VRAM, [8, 16, 32])
    b = Group(1, [1, 0], table=1).put(1, DRAM, [16, 64]).put(0, DRAM, [16])
    router = kc.Router(plan, [a.spec(), b.spec()])
    w = workers(2)
    # w0: VRAM 16 (a) vs DRAM 64 (b) -> longer wins. w1: VRAM 32 (a) vs DRAM 16 (b) -> 32.
    check(route(router, w, gamma=0.0), w, [64, 32], [DRAM, VRAM], winner=0, gamma=0.0)
    # Equal length in two tables: VRAM beats DRAM whatever the table order.
    c = Group(0, [0], table=2).put(0, DRAM, [8, 16, 32, 64])
    d = Group(0, [0], table=3).put(0, VRAM, [8, 16, 32, 64])
    w1 = workers(1)
    for specs in ([c.spec(), d.spec()], [d.spec(), c.spec()]):
        check(route(kc.Router(PLAN1, specs), w1, gamma=1.0), w1, [64], [VRAM], winner=0, gamma=1.0)


def test_plan_restricts_probed_lengths() -> None:
    plan = [[8, 16, 32, 64], [16, 64]]
    g = Group(1, [0, 1]).put(0, VRAM, [8, 16, 32]).put(1, VRAM, [32])
    router = kc.Router(plan, [g.spec()])
    w = workers(2, region=[0, 1])
    # Region 1's plan never asks for 8 or 32, so w0 matches at 16 and w1 (only at 32) not at all.
    check(route(router, w), w, [16, 0], [VRAM, 0], winner=0)


def test_lengths_beyond_the_prompt_are_not_probed() -> None:
    g = Group(0, [0]).put(0, VRAM, [8, 16, 32, 64])
    router = kc.Router(PLAN1, [g.spec()])
    w = workers(1)
    short = PROMPT[:40]
    check(route(router, w, tokens=short), w, [32], [VRAM], winner=0, prompt_len=40)
    check(route(router, w, tokens=PROMPT[:8]), w, [8], [VRAM], winner=0, prompt_len=8)
    check(route(router, w, tokens=PROMPT[:7]), w, [0], [0], winner=0, prompt_len=7)
    empty = np.array([], dtype=np.uint32)
    check(route(router, w, tokens=empty), w, [0], [0], winner=0, prompt_len=0)
    # A different prompt with the same first 16 tokens shares those prefixes only.
    other = PROMPT.copy()
    other[20] += 1
    check(route(router, w, tokens=other), w, [16], [VRAM], winner=0)


def test_namespace_isolates_routes() -> None:
    g = Group(0, [0]).put(0, VRAM, [8, 16, 32, 64])
    router = kc.Router(PLAN1, [g.spec()])
    w = workers(1)
    r = router.route(PROMPT, kc.namespace_digest("llama-3.1-8b", "other-tenant"), w["region"], w["beta"], w["wan"], w["tq"], w["belief"])
    assert r.matches.tolist() == [0]


@pytest.mark.parametrize("shards", [3, 4, 5])  # the prompt's 4 keys land on >1 shard for these
def test_sharded_tables_route_like_one_shard(shards: int) -> None:
    def build(n: int) -> Group:
        return Group(0, [0, 1, 2], shards=n).put(0, VRAM, [8, 16]).put(1, DRAM, [8, 16, 32, 64]).put(2, VRAM, [8, 32, 64])

    w = workers(3, wan=[1.0, 2.0, 0.5])
    one, many = build(1), build(shards)
    assert sum(len(t) > 0 for t in many.tables) > 1  # keys really spread over shards
    for s, t in enumerate(many.tables):
        assert all(k % shards == s for k in t.entries()[0].tolist())
    for closure in (True, False):
        r1 = route(kc.Router(PLAN1, [one.spec()]), w, closure=closure, gamma=0.1)
        rn = route(kc.Router(PLAN1, [many.spec()]), w, closure=closure, gamma=0.1)
        assert rn.matches.tolist() == r1.matches.tolist()
        assert rn.tiers.tolist() == r1.tiers.tolist()
        assert rn.scores.tolist() == r1.scores.tolist()
    check(route(kc.Router(PLAN1, [many.spec()]), w, gamma=0.1), w, [16, 64, 8], [VRAM, DRAM, VRAM], winner=1, gamma=0.1)


def test_thirty_two_worker_fields() -> None:
    g = Group(0, list(range(32)))
    for f in range(32):
        g.put(f, DRAM if f == 31 else VRAM, [8, 16, 32, 64][: 1 + f % 4])
    router = kc.Router(PLAN1, [g.spec()])
    w = workers(32, wan=[float(32 - i) for i in range(32)])
    r = route(router, w)
    want_m = [[8, 16, 32, 64][f % 4] for f in range(32)]
    want_t = [DRAM if f == 31 else VRAM for f in range(32)]
    check(r, w, want_m, want_t, winner=int(np.argmin(expected(w, want_m, want_t))))


# ---- shared views --------------------------------------------------------------------------


def test_router_sees_patches_applied_after_construction() -> None:
    g = Group(0, [0, 1])
    router = kc.Router(PLAN1, [g.spec()])  # views are shared, not copied
    w = workers(2, wan=[0.0, 1.0])
    check(route(router, w), w, [0, 0], [0, 0], winner=0)
    g.put(1, VRAM, [8, 16, 32, 64])
    check(route(router, w), w, [0, 64], [0, VRAM], winner=1)
    # A rebuild replaces the view's whole state through a snapshot batch.
    g.tables[0].rebuild(capacity=1000)
    g.sync()
    assert g.views[0].geometry()["capacity"] >= 1000  # type: ignore[index]
    check(route(router, w), w, [0, 64], [0, VRAM], winner=1)
    # So does an epoch restart resynced from a fresh snapshot.
    t = g.tables[0]
    t.set_field(key_of(PROMPT, 32), 1, 0)  # w1 drops level 32
    t.start_epoch(2)
    g.views[0].apply_batch(t.export_snapshot())
    check(route(router, w), w, [0, 16], [0, VRAM], winner=1)
    # Removal is seen too.
    g.put(1, 0, [8])
    check(route(router, w), w, [0, 0], [0, 0], winner=0)


def test_router_over_an_uninitialised_view_sees_nothing() -> None:
    router = kc.Router(PLAN1, [(0, np.array([0], np.uint32), [kc.LudoView(0, 0)])])
    w = workers(1)
    check(route(router, w), w, [0], [0], winner=0)


# ---- input validation ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def small_router() -> kc.Router:
    g = Group(0, [0, 1]).put(0, VRAM, [8, 16])
    return kc.Router([[8, 16, 32, 64], [16]], [g.spec()])


def good_args() -> dict[str, object]:
    w = workers(2)
    return {"tokens": PROMPT, "namespace": NS, **w}


@pytest.mark.parametrize(
    ("name", "bad"),
    [
        ("tokens", PROMPT.astype(np.int64)),
        ("tokens", PROMPT.tolist()),
        ("tokens", np.ascontiguousarray(np.repeat(PROMPT, 2))[::2]),
        ("region", np.zeros(2, dtype=np.int64)),
        ("region", np.zeros(2, dtype=np.uint64)),
        ("beta", np.ones(2, dtype=np.float32)),
        ("beta", [1.0, 1.0]),
        ("wan", np.zeros(2, dtype=np.int64)),
        ("tq", np.zeros((2, 1))),
        ("belief", np.ones(4)[::2]),
        ("namespace", NS[:31]),
        ("namespace", NS.hex()),
    ],
)
def test_route_wrong_dtype_is_value_error(small_router: kc.Router, name: str, bad: object) -> None:
    args = good_args()
    args[name] = bad
    with pytest.raises(ValueError, match=name):
        small_router.route(**args)  # type: ignore[arg-type]
    assert isinstance(small_router.route(**good_args()), kc.RouteResult)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("edit", "needle"),
    [
        ({"region": np.array([0, 2], np.uint32)}, "region 2"),
        ({"beta": np.ones(3)}, "beta"),
        ({"belief": np.ones(1)}, "belief"),
        ({"beta": np.array([1.0, -1.0])}, "beta"),
        ({"wan": np.array([np.nan, 0.0])}, "wan"),
        ({"tq": np.array([0.0, np.inf])}, "tq"),
        ({"belief": np.array([1.5, 0.0])}, "belief"),
        ({"belief": np.array([-0.1, 0.0])}, "belief"),
        ({"belief": np.array([np.nan, 0.0])}, "belief"),
        ({"gamma": -0.5}, "gamma"),
        ({"gamma": float("inf")}, "gamma"),
        ({"lam": float("nan")}, "lambda"),
        ({"lam": -1.0}, "lambda"),
        ({"region": np.array([], np.uint32), "beta": np.array([]), "wan": np.array([]), "tq": np.array([]), "belief": np.array([])}, "no workers"),
    ],
)
def test_route_bad_arguments_are_invalid_argument(small_router: kc.Router, edit: dict[str, object], needle: str) -> None:
    args = good_args()
    args.update(edit)
    with pytest.raises(E.InvalidArgumentError, match=needle):
        small_router.route(**args)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("plan", "needle"),
    [([[8, 16, 16]], "ascending"), ([[16, 8]], "ascending"), ([[0, 8]], ">= 1")],
)
def test_bad_plan_is_refused_at_construction(plan: list[list[int]], needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        kc.Router(plan, [(0, np.array([0], np.uint32), [kc.LudoView(0, 0)])])


@pytest.mark.parametrize(
    ("workers_", "n_workers", "needle"),
    [([0, 3], 2, "worker index"), (list(range(33)), 33, "33 worker fields")],
)
def test_bad_table_is_invalid_argument_at_route(workers_: list[int], n_workers: int, needle: str) -> None:
    router = kc.Router([[8]], [(0, np.array(workers_, np.uint32), [kc.LudoView(0, 0)])])
    w = workers(n_workers)
    with pytest.raises(E.InvalidArgumentError, match=needle):
        route(router, w)


def test_bad_router_construction() -> None:
    views = [kc.LudoView(0, 0)]
    with pytest.raises(ValueError, match="region 1"):
        kc.Router([[8]], [(1, np.array([0], np.uint32), views)])
    with pytest.raises(ValueError, match="shard"):
        kc.Router([[8]], [(0, np.array([0], np.uint32), [])])
    with pytest.raises(ValueError, match="workers"):
        kc.Router([[8]], [(0, np.array([0], np.int64), views)])
    with pytest.raises((TypeError, ValueError)):
        kc.Router([[8]], [(0, np.array([0], np.uint32), ["not a view"])])  # type: ignore[list-item]
    with pytest.raises((OverflowError, TypeError, ValueError)):
        kc.Router([[-8]], [])
    # A router with no tables is valid: nobody holds anything.
    r = kc.Router([[8]], [])
    assert r.n_tables == 0
    assert route(r, workers(1)).matches.tolist() == [0]


# ---- agreement with a reference over random configurations ---------------------------------

MAXLEN = 24


@st.composite
def configs(draw: st.DrawFn) -> dict[str, object]:
    n_w = draw(st.integers(1, 5))
    n_r = draw(st.integers(1, 2))
    plan = [sorted(draw(st.sets(st.integers(1, MAXLEN), max_size=5))) for _ in range(n_r)]
    tables = []
    for _ in range(draw(st.integers(0, 3))):
        fields = draw(st.lists(st.integers(0, n_w - 1), max_size=4))
        rows = draw(st.lists(st.lists(st.sampled_from([0, 1, 1, 2, 2, 3]), min_size=len(fields), max_size=len(fields)), min_size=MAXLEN, max_size=MAXLEN))
        junk = draw(st.integers(0, 2**64 - 1))
        tables.append((draw(st.integers(0, n_r - 1)), fields, draw(st.integers(1, 3)), rows, junk))
    return {
        "tokens": draw(st.lists(st.integers(0, 2**32 - 1), max_size=MAXLEN + 4)),
        "plan": plan,
        "tables": tables,
        "region": draw(st.lists(st.integers(0, n_r - 1), min_size=n_w, max_size=n_w)),
        "beta": draw(st.lists(st.floats(0, 3), min_size=n_w, max_size=n_w)),
        "wan": draw(st.lists(st.floats(0, 50), min_size=n_w, max_size=n_w)),
        "tq": draw(st.lists(st.floats(0, 50), min_size=n_w, max_size=n_w)),
        "belief": draw(st.lists(st.one_of(st.just(0.0), st.just(1.0), st.floats(0, 1)), min_size=n_w, max_size=n_w)),
        "gamma": draw(st.floats(0, 3)),
        "lam": draw(st.floats(0, 3)),
    }


def reference(cfg: dict[str, object], closure: bool) -> tuple[list[int], list[int], list[float]]:
    tokens: list[int] = cfg["tokens"]  # type: ignore[assignment]
    plan: list[list[int]] = cfg["plan"]  # type: ignore[assignment]
    n_w = len(cfg["region"])  # type: ignore[arg-type]
    prompt_len = len(tokens)
    m, tier = [0] * n_w, [0] * n_w
    for region, fields, _, rows, _ in cfg["tables"]:  # type: ignore[attr-defined]
        fit = [c for c in plan[region] if c <= prompt_len]
        for f, wk in enumerate(fields):
            best = (0, 0)
            for c in fit:
                t = rows[c - 1][f]
                t = 0 if t == 3 else t
                if t:
                    best = (c, t)
                elif closure:
                    break
            if best[0] > m[wk] or (best[0] == m[wk] and best[0] > 0 and best[1] < tier[wk]):
                m[wk], tier[wk] = best
    w = {k: np.array(cfg[k], dtype=np.float64) for k in ("beta", "wan", "tq", "belief")}
    return m, tier, expected(w, m, tier, prompt_len=prompt_len, gamma=cfg["gamma"], lam=cfg["lam"])  # type: ignore[arg-type]


@given(configs())
def test_route_matches_reference(cfg: dict[str, object]) -> None:
    tokens = np.array(cfg["tokens"], dtype=np.uint32)
    long = np.concatenate([tokens, np.full(max(0, MAXLEN - len(tokens)), 7, dtype=np.uint32)])[:MAXLEN]
    long = np.concatenate([long, tokens[MAXLEN:]]).astype(np.uint32)
    specs = []
    for ti, (region, fields, shards, rows, junk) in enumerate(cfg["tables"]):  # type: ignore[attr-defined]
        g = Group(region, fields, shards=shards, table=ti)
        hi = (junk << (2 * len(fields))) & (2**64 - 1) if fields else junk
        for c in range(1, MAXLEN + 1):
            # Stored under a long prompt sharing the real prompt's prefix, so lengths beyond the
            # real prompt exist in the table but must never be found.
            value = hi
            for f, t in enumerate(rows[c - 1]):
                value |= t << (2 * f)
            if value:
                k = key_of(long, c)
                g.writer(k).set(k, value)
        g.sync()
        specs.append(g.spec())
    router = kc.Router(cfg["plan"], specs)  # type: ignore[arg-type]
    w = {k: np.array(cfg[k], dtype=np.uint32 if k == "region" else np.float64) for k in ("region", "beta", "wan", "tq", "belief")}
    for closure in (False, True):
        r = router.route(tokens, NS, w["region"], w["beta"], w["wan"], w["tq"], w["belief"], gamma=cfg["gamma"], lam=cfg["lam"], closure=closure)  # type: ignore[arg-type]
        m, tier, scores = reference(cfg, closure)
        assert r.matches.tolist() == m
        assert r.tiers.tolist() == tier
        assert r.scores.tolist() == scores
        assert r.winner == int(np.argmin(scores))
        assert r.score == scores[r.winner]


# ---- the GIL -------------------------------------------------------------------------------


def test_route_releases_the_gil() -> None:
    """While one thread is inside a long route call, another thread keeps running Python.
    (Prompts up to 65,536 tokens are routed with the GIL held, reading them in place: such a
    route is over in tens of microseconds.)

    A route over a 16M-token prompt whose plan reaches the last token hashes 64 MiB (tens of
    milliseconds or more). If the GIL were held for the call, the counting thread could not run
    at all between the route's start and end; with it released it runs throughout. The check
    only needs *some* progress in the middle of the call, so scheduling noise cannot fail it
    unless the counting thread gets no CPU for the whole middle third (retried 3 times).
    """
    n = 16 * 1024 * 1024
    tokens = np.arange(n, dtype=np.uint32)
    g = Group(0, [0]).put(0, VRAM, [8])
    router = kc.Router([[8, n]], [g.spec()])
    w = workers(1)
    for _attempt in range(3):
        window: list[float] = []
        done = threading.Event()

        def work() -> None:
            window.append(time.perf_counter())
            route(router, w, tokens=tokens)
            window.append(time.perf_counter())
            done.set()

        stamps: list[float] = []
        th = threading.Thread(target=work)
        th.start()
        while not done.is_set():
            stamps.append(time.perf_counter())  # pure-Python work
        th.join()
        t0, t1 = window
        lo, hi = t0 + (t1 - t0) / 3, t1 - (t1 - t0) / 3
        if sum(lo <= s <= hi for s in stamps) > 10:
            return
    pytest.fail("no Python progress while Router.route ran: the GIL seems to be held")


def test_concurrent_routes_agree_with_sequential() -> None:
    # Concurrent callers must not share per-call scratch: each gets its own answer.
    g = Group(0, [0, 1, 2])
    prompts = [np.arange(1000 + 100 * i, 1064 + 100 * i, dtype=np.uint32) for i in range(4)]
    for i, p in enumerate(prompts):
        g.put(i % 3, VRAM if i % 2 else DRAM, [8, 16, 32, 64][: i + 1], tokens=p)
    router = kc.Router(PLAN1, [g.spec()])
    w = workers(3, wan=[1.0, 2.0, 3.0])
    want = [route(router, w, tokens=p) for p in prompts]
    assert len({tuple(r.matches.tolist()) for r in want}) == 4  # the prompts really differ
    errors: list[str] = []

    def worker(i: int) -> None:
        for _ in range(300):
            r = route(router, w, tokens=prompts[i])
            if r.matches.tolist() != want[i].matches.tolist() or r.scores.tolist() != want[i].scores.tolist():
                errors.append(f"prompt {i}: {r.matches.tolist()} != {want[i].matches.tolist()}")
                return

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert errors == []


def test_route_result_gives_the_keys_it_hashed() -> None:
    """The edge registers speculative entries and counts families from the keys the route
    already hashed (no second SHA-256 pass over the prompt): they must be prefix_keys' own."""
    plan = [[8, 16, 32, 64], [16, 48]]
    g = Group(0, [0]).put(0, VRAM, [8])
    w = workers(2, region=[0, 1])
    r = route(kc.Router(plan, [g.spec()]), w, tokens=PROMPT[:40])
    assert r.keys_at([8, 16, 32]) == [key_of(PROMPT, c) for c in (8, 16, 32)]
    with pytest.raises(ValueError, match="did not hash length 48"):
        r.keys_at([48])  # beyond the prompt
    with pytest.raises(ValueError, match="did not hash length 12"):
        r.keys_at([12])  # in no plan


def test_prefix_memo_gives_the_hashed_keys_and_counts_hits() -> None:
    """A route takes the plan lengths it hashed before from the process's prefix memo
    (``rust/prefix_memo.rs``): the keys stay prefix_keys' own, for the same prompt, for one
    that shares only a head with it, and in another namespace (which shares nothing)."""
    plan = [[8, 16, 32, 64]]
    g = Group(0, [0]).put(0, VRAM, [8, 16])
    router = kc.Router(plan, [g.spec()])
    w = workers(1)
    rng = np.random.default_rng(5)
    head = rng.integers(0, 50_000, 24).astype(np.uint32)  # a head no other test uses
    a = np.concatenate([head, rng.integers(0, 50_000, 40).astype(np.uint32)])
    b = np.concatenate([head, rng.integers(0, 50_000, 40).astype(np.uint32)])
    want = {id(t): [int(k) for k in kc.prefix_keys(NS, t, np.array(plan[0], dtype=np.uint32))] for t in (a, b)}
    hits0, misses0 = kc._core.prefix_memo_stats()
    first = route(router, w, tokens=a)
    assert first.keys_at(plan[0]) == want[id(a)]
    hits1, misses1 = kc._core.prefix_memo_stats()
    assert misses1 - misses0 >= 4  # a new prompt: every length hashed
    again = route(router, w, tokens=a)
    assert again.keys_at(plan[0]) == want[id(a)]
    assert again.matches.tolist() == first.matches.tolist() and again.scores.tolist() == first.scores.tolist()
    hits2, misses2 = kc._core.prefix_memo_stats()
    assert hits2 - hits1 >= 4
    other = route(router, w, tokens=b)  # shares lengths 8 and 16 with a
    assert other.keys_at(plan[0]) == want[id(b)]
    assert kc._core.prefix_memo_stats()[0] - hits2 >= 2
    ns2 = kc.namespace_digest("llama-3.1-8b", "memo-test-tenant")
    r2 = router.route(a, ns2, w["region"], w["beta"], w["wan"], w["tq"], w["belief"])
    assert r2.keys_at(plan[0]) == [int(k) for k in kc.prefix_keys(ns2, a, np.array(plan[0], dtype=np.uint32))]
