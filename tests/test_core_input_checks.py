"""The bindings refuse out-of-range input with a precise exception, before anything changes.

Each test pins one fault a review found in ``kvcompass._core`` (a panic, an aborting allocation,
a silently wrong answer, or state changed by a call that then failed) and asserts the exception
type and, where the fault was a partial change, that the state is as it was.
"""

from __future__ import annotations

import math
import threading
import time
from typing import Any, Callable

import numpy as np
import pytest

from kvcompass import _core
from kvcompass.errors import InvalidArgumentError, InvalidFieldError, WrongTableError

NS = _core.namespace_digest("m", "t")
COST = (0.1, 1.0, 0.01, 5.0, 0.1, 0.01, 0.0001, 1000)


def toks4(n_blocks: int = 1) -> bytes:
    return np.arange(4 * n_blocks, dtype=np.uint32).tobytes()


# ---- 1. AgentForest.flush ------------------------------------------------------------------


def test_forest_flush_refuses_zero_shards_and_foreign_reset_shards() -> None:
    f = _core.AgentForest([4], NS)
    f.stored(0, "GPU", 4, toks4(), False, None, [1], None, None)
    with pytest.raises(InvalidArgumentError):
        f.flush(0, [])
    with pytest.raises(InvalidArgumentError):
        f.flush(4, [9])
    # Nothing was consumed: the pending op is still reported, once.
    out = f.flush(4, [])
    assert sum(len(k) for _, k, _ in out) == 1
    assert f.flush(4, []) == []
    assert [s for s, _, _ in f.flush(4, [3])] == [3]


# ---- 2, 3, 6, 9. SimEngine ------------------------------------------------------------------


def _pcg(seed: int) -> tuple[int, int, bool, int]:
    s = np.random.default_rng(seed).bit_generator.state
    return (s["state"]["state"], s["state"]["inc"], bool(s["has_uint32"]), s["uinteger"])


def _sim(cache: _core.BlockCache, *, bad_cols: bool = False, publish: bool = True, regions: int = 2) -> _core.SimEngine:
    n = 1
    return _core.SimEngine(
        COST, 100.0, False, 8192, 0.0, 64, False, False, np.zeros(regions * regions), [True] * regions,
        [[0]] + [[] for _ in range(regions - 1)], [[] for _ in range(regions)],
        np.array([0], np.uint32), np.array([0.1]), [cache], [publish], [True],
        np.zeros(n), np.zeros(n + 1 if bad_cols else n, np.uint32), np.zeros(n, np.uint32),
        np.full(n, 32, np.uint64), np.full(n, 4, np.uint64), np.full(n, 16, np.uint32), np.zeros(n, np.uint32), np.zeros(n, np.uint64),
        np.arange(2 * n, dtype=np.uint64), np.arange(0, 2 * n + 1, 2, dtype=np.uint64), [False] * n, _pcg(1), _pcg(2), 1,
    )  # fmt: skip


def test_sim_way_refuses_regions_outside_the_topology() -> None:
    e = _sim(_core.BlockCache(16, 64, 64, False))
    assert e.way(0, 1) == 0.0
    with pytest.raises(InvalidArgumentError):
        e.way(0, 2)  # read another cell of the 2 x 2 RTT matrix
    with pytest.raises(InvalidArgumentError):
        e.way(5, 5)  # indexed past it (a panic)


def test_sim_chord_needs_one_entry_per_region() -> None:
    e = _sim(_core.BlockCache(16, 64, 64, False))
    with pytest.raises(InvalidArgumentError):
        e.set_chord([16], [1, 2**40], [0, 0], [0, 1], [[1], [0]], [])
    with pytest.raises(InvalidArgumentError):
        e.set_chord([16], [1, 2**40], [0, 0], [0, 1], [[1], [0]], [None])
    e.set_chord([16], [1, 2**40], [0, 0], [0, 1], [[1], [0]], [None, None])
    assert e.chord_lookup(0, 5)[0] == 0


def test_sim_transfer_time_never_shrinks_for_more_tokens() -> None:
    e = _sim(_core.BlockCache(16, 64, 64, False))
    small, big, bigger = e.transfer_ms(10), e.transfer_ms(2**61), e.transfer_ms(2**62)
    assert small == pytest.approx(10 * 1000 * 8 / 100e9 * 1e3)
    assert small < big < bigger  # 2**61 tokens' bits wrapped to 0 in 64 bits


def test_cost_estimate_hits_saturate_instead_of_wrapping() -> None:
    full_hit = _core.cost_estimate_ms(COST, 100, 100, 1, 0, 0, 8192, False)
    # vram + dram = 2**64 wrapped to 0: the whole prompt was priced as uncached.
    assert _core.cost_estimate_ms(COST, 100, 2**64 - 1, 1, 0, 0, 8192, False) == full_hit
    assert _core.cost_estimate_ms(COST, 100, 2**63, 2**63, 0, 0, 8192, False) <= _core.cost_estimate_ms(COST, 100, 2**63, 2**63 + 1, 0, 0, 8192, False)
    assert _core.cost_estimate_ms(COST, 100, 0, 0, 0, 0, 8192, False) == pytest.approx(1.0 + 0.1 * 100)


@pytest.mark.parametrize("publish, bad_cols", [(True, True), (False, False)])
def test_a_refused_sim_engine_leaves_the_callers_cache_alone(publish: bool, bad_cols: bool) -> None:
    bc = _core.BlockCache(16, 64, 64, False)
    bc.place_vram(np.arange(64, dtype=np.uint32), 0, 0.0, 0, True)
    before = (len(bc), bc.capacity(1), bc.capacity(2))
    # Mismatched request columns; or a filled cache that keeps tokens handed over unpublished
    # (it cannot stop keeping them): both refused after the blocks had moved.
    with pytest.raises(InvalidArgumentError):
        _sim(bc, bad_cols=bad_cols, publish=publish)
    assert (len(bc), bc.capacity(1), bc.capacity(2)) == before == (4, 64, 64)


# ---- 4. sizes -------------------------------------------------------------------------------


@pytest.mark.parametrize("counts", [[2**40], [2**62], [2**32 + 1], [2**63, 2**63]])
def test_chain_block_ids_refuses_oversized_or_wrapping_counts(counts: list[int]) -> None:
    chains = np.arange(1, len(counts) + 1, dtype=np.uint64)
    with pytest.raises(InvalidArgumentError):
        _core.chain_block_ids(chains, np.array(counts, np.uint64))


def test_chain_block_ids_still_answers_in_range() -> None:
    ids = _core.chain_block_ids(np.array([5, 9], np.uint64), np.array([2, 1], np.uint64))
    assert ids.shape == (3,) and ids.dtype == np.uint64 and int(ids.max()) < 2**63


@pytest.mark.parametrize("n", [2**40, 2**62])
def test_expand_block_tokens_refuses_oversized_prompts(n: int) -> None:
    with pytest.raises(InvalidArgumentError):
        _core.expand_block_tokens(np.array([1], np.uint64), n, n)
    assert list(_core.expand_block_tokens(np.array([0, 1], np.uint64), 5, 4)) == [85192, 20828, 103872, 6824, 75434]


def test_prefix_keys_batch_refuses_an_oversized_matrix() -> None:
    # (2**17 - 1) prompts x 2**16 lengths > 2**32 keys.
    with pytest.raises(InvalidArgumentError):
        _core.prefix_keys_batch(NS, np.zeros(0, np.uint32), np.zeros(2**17, np.uint64), np.ones(2**16, np.uint32))


@pytest.mark.parametrize("n", [2**24 + 1, 2**40, 2**62])
def test_queue_estimates_refuse_absurd_worker_counts(n: int) -> None:
    with pytest.raises(ValueError):
        _core.QueueEstimates(n, 0.5, 1.0)


@pytest.mark.parametrize("call", [lambda: _core.bench_timer_ns(2**62), lambda: _core.bench_sha256_ns(np.zeros(1, np.uint32), 2**62)])
def test_bench_probes_refuse_absurd_sample_counts(call: Callable[[], Any]) -> None:
    with pytest.raises(InvalidArgumentError):
        call()


# ---- 5. medium ids --------------------------------------------------------------------------


def test_forest_refuses_a_medium_past_65536() -> None:
    f = _core.AgentForest([4], NS)
    f.copied(0, "GPU", [])  # medium id 0
    for i in range(1, 65536):
        f.copied(0, f"M{i}", [])
    # The 65,537th name wrapped to id 0 (GPU): a DISK block was held as VRAM.
    with pytest.raises(InvalidArgumentError):
        f.stored(0, "DISK", 4, toks4(), False, None, [11], None, None)
    assert len(f) == 0 and len(f.held()[0]) == 0
    f.stored(0, "M7", 4, toks4(), False, None, [11], None, None)  # a known one still works
    assert len(f) == 1


def test_forest_refuses_block_size_zero() -> None:
    f = _core.AgentForest([4], NS)
    with pytest.raises(ValueError):
        f.stored(0, "GPU", 0, b"", False, None, [1, 2, 3], None, None)
    assert len(f) == 0 and f.stats()[0] == 0


# ---- 7, 11. QueueEstimates ------------------------------------------------------------------


def test_queue_charge_and_expire_refuse_nan_now_without_dropping_charges() -> None:
    q = _core.QueueEstimates(2, 0.5, 1.0, 2.0)
    q.charge(1, 10.0, 1.0)
    v = q.version
    with pytest.raises(ValueError):
        q.charge(0, 5.0, math.nan)
    with pytest.raises(ValueError):
        q.expire(math.nan)
    with pytest.raises(ValueError):
        q.expire(math.inf)
    assert (q.pending(0), q.pending(1), q[1], q.version) == (0.0, 10.0, 10.0, v)
    q.expire(1e6)  # the charge still runs out (a NaN expire had lost it: never settled)
    assert (q.pending(1), q[1]) == (0.0, 0.0)


@pytest.mark.parametrize(
    "call",
    [
        lambda q: q.fold(0, 5.0, math.nan),
        lambda q: q.set_live(0, 5.0, math.inf),
        lambda q: q.set_live(0, 5.0, 1.0, math.nan),
        lambda q: q.fold_many(np.array([0], np.int64), np.array([5.0]), math.nan, np.array([0.0])),
        lambda q: q.set_live_many(np.array([0], np.int64), np.array([5.0]), 1.0, np.array([math.nan])),
        lambda q: q.fold_lagged(np.array([0], np.int64), np.array([5.0]), math.nan, np.array([0.0])),
    ],
)
def test_queue_setters_refuse_times_that_are_not_numbers(call: Callable[[_core.QueueEstimates], Any]) -> None:
    q = _core.QueueEstimates(2, 0.5, 1.0, 2.0)
    q.charge(0, 10.0, 1.0)
    v = q.version
    with pytest.raises(ValueError):
        call(q)
    assert (q.known(0), q.pending(0), q[0], q.version) == (False, 10.0, 10.0, v)


def test_queue_vector_refuses_mismatched_lengths() -> None:
    q = _core.QueueEstimates(3, 0.5, 1.0)
    with pytest.raises(ValueError):
        q.vector([0, 1, 2], ["a"])
    with pytest.raises(ValueError):
        q.vector([0], ["a", "b", "c"])
    assert q.vector([0, 2], ["a", "c"]) == {"a": 0.0, "c": 0.0}


# ---- 7, 8, 10, 14. EdgeCore and Router -----------------------------------------------------

TOKS = np.arange(16, dtype=np.uint32)
BEL = np.ones(2)


def _params(**kw: Any) -> dict[str, Any]:
    p: dict[str, Any] = {"load_aware": True, "lambda_max": 1.0, "tau_ms": 100.0, "gamma": 0.005, "closure": True, "tie_ms": 0.0, "speculative_ttl_s": 1.0, "charge": True, "migration": False, "value_bits": 32, "spec_capacity": 1024, "spec_fp_bits": 0, "block_size": 0}
    p.update(kw)
    return p


def _edge(plan: list[list[int]] | None = None, fields: list[tuple[int, int]] | None = None, family_length: int = 8, **kw: Any) -> tuple[_core.EdgeCore, _core.QueueEstimates]:
    plan = plan or [[4, 8], [4, 8]]
    v0, v1 = _core.LudoView(0, 0), _core.LudoView(1, 0)
    for v, t in ((v0, 0), (v1, 1)):
        v.apply_batch(_core.LudoTable(table=t).export_snapshot())
    s0, s1 = _core.LudoView(0, 0), _core.LudoView(1, 0)
    tables = [(0, np.array([0], np.uint32), [v0]), (1, np.array([1], np.uint32), [v1]), (0, np.array([0], np.uint32), [s0]), (1, np.array([1], np.uint32), [s1])]
    r = _core.Router(plan, tables)
    q = _core.QueueEstimates(2, 0.5, 1.0, 2.0)
    workers = {"region": [0, 1], "beta": [0.1, 0.1], "wan": [0.0, 5.0], "local": [True, False], "eligible": [True, True], "fields": fields or [(0, 0), (1, 0)]}
    return _core.EdgeCore(r, q, workers, plan, family_length, [s0, s1], _params(**kw)), q


def test_edge_commit_refuses_nan_now_before_any_effect() -> None:
    e, q = _edge()
    res = e.score(TOKS, NS, 1.0, BEL)
    with pytest.raises(ValueError):
        e.commit(res, 0, 1, math.nan, True)
    assert (q.pending(0), e.speculative_entries) == (0.0, 0)
    for call in (lambda: e.score(TOKS, NS, math.nan, BEL), lambda: e.expire(math.nan), lambda: e.route(TOKS, NS, math.inf, BEL, lambda: 0.5)):
        with pytest.raises(ValueError):
            call()
    assert (q.pending(0), e.speculative_entries) == (0.0, 0)
    e.commit(res, 0, 1, 1.0, True)
    assert q.pending(0) > 0 and e.speculative_entries == 2


def test_edge_commit_resolves_every_key_before_charging() -> None:
    # A remote worker's lengths were never hashed by a route scored for the own region only.
    e, q = _edge(plan=[[4], [8]])
    res = e.score(TOKS, NS, 1.0, BEL, own_region=True)
    with pytest.raises(ValueError):
        e.commit(res, 1, 1, 1.0, True)
    assert (q.pending(1), q.version, e.speculative_entries) == (0.0, 0, 0)
    # The family length is not a plan length: the commit had charged and speculated first.
    e, q = _edge(plan=[[4], [4]], family_length=8, migration=True)
    res = e.score(TOKS, NS, 1.0, BEL)
    with pytest.raises(ValueError):
        e.commit(res, 0, 1, 1.0, True)
    assert (q.pending(0), e.speculative_entries) == (0.0, 0)


def test_edge_refuses_a_field_past_the_value_width() -> None:
    with pytest.raises(InvalidFieldError):
        _edge(fields=[(0, 20), (1, 0)])  # 32-bit values hold 16 fields


@pytest.mark.parametrize(
    "name, value",
    [("tau_ms", -1.0), ("tau_ms", 0.0), ("tau_ms", math.nan), ("tie_ms", math.nan), ("tie_ms", -5.0), ("lambda_max", -1.0), ("gamma", math.inf), ("speculative_ttl_s", math.nan)],
)
def test_edge_params_are_checked_up_front_by_name(name: str, value: float) -> None:
    with pytest.raises(ValueError, match=name):
        _edge(**{name: value})


def test_a_refused_edge_core_leaves_every_view_alone() -> None:
    t = _core.LudoTable.build(np.array([5], np.uint64), np.array([1], np.uint64))
    v0 = _core.LudoView(0, 0)
    v0.apply_batch(t.export_snapshot())
    before = (v0.lookup(5), v0.digest(), v0.seq, v0.epoch)
    r = _core.Router([[4]], [(0, np.array([0], np.uint32), [v0])])
    q = _core.QueueEstimates(1, 0.5, 1.0)
    workers = {"region": [0], "beta": [0.1], "wan": [0.0], "local": [True], "eligible": [True], "fields": [(0, 0)]}
    with pytest.raises(WrongTableError):
        _core.EdgeCore(r, q, workers, [[4]], 4, [v0, _core.LudoView(9, 0)], _params())
    assert (v0.lookup(5), v0.digest(), v0.seq, v0.epoch) == before and before[0] == 1


@pytest.mark.parametrize("tie", [math.nan, -5.0, math.inf])
def test_router_refuses_a_tie_margin_that_is_not_a_finite_non_negative_number(tie: float) -> None:
    v = _core.LudoView(0, 0)
    v.apply_batch(_core.LudoTable(table=0).export_snapshot())
    r = _core.Router([[4]], [(0, np.array([0, 1], np.uint32), [v])])
    args = (TOKS, NS, np.zeros(2, np.uint32), np.ones(2) * 0.1, np.zeros(2), np.zeros(2), np.ones(2))
    assert r.route(*args, tie_ms=0.0).near == [0, 1]
    with pytest.raises(InvalidArgumentError):
        r.route(*args, tie_ms=tie)


# ---- 12, 13. LudoTable ----------------------------------------------------------------------


def test_apply_agent_ops_refuses_unsorted_owned_keys() -> None:
    t = _core.LudoTable()
    keys, tiers = np.array([4, 8], np.uint64), np.array([0, 0], np.uint8)
    assert t.apply_agent_ops(keys, tiers, 0, 4, np.array([4, 8], np.uint64), 0, 100, False) == (0, 0, 2, 2)
    with pytest.raises(ValueError, match="owned"):
        t.apply_agent_ops(keys, tiers, 0, 4, np.array([8, 4], np.uint64), 0, 100, False)
    with pytest.raises(ValueError):
        t.apply_agent_ops(keys, tiers, 7, 4, np.array([], np.uint64), 0, 100, False)  # shard 7 of 4


def _beats_during(f: Callable[[], object]) -> int:
    """How many times another Python thread ran while ``f`` did (0 or 1 when ``f`` holds the GIL)."""
    beats = [0]
    stop = threading.Event()

    def beat() -> None:
        while not stop.is_set():
            beats[0] += 1
            time.sleep(0.0005)

    th = threading.Thread(target=beat)
    th.start()
    time.sleep(0.02)
    b0 = beats[0]
    f()
    b1 = beats[0]
    stop.set()
    th.join()
    return b1 - b0


def _full_table(n: int = 400_000) -> _core.LudoTable:
    keys = np.random.default_rng(0).integers(1, 2**59, n, dtype=np.uint64) * np.uint64(4)  # shard 0 of 4
    return _core.LudoTable.build(keys, np.ones(n, np.uint64), capacity=n)


def test_a_small_agent_batch_that_rebuilds_the_table_releases_the_gil() -> None:
    t = _full_table()
    extra = (np.arange(1, 11, dtype=np.uint64) + np.uint64(2**59)) * np.uint64(4)
    r0 = t.rebuilds
    beats = _beats_during(lambda: t.apply_agent_ops(extra, np.ones(len(extra), np.uint8), 0, 4, np.array([], np.uint64), 0, 2**32, True))
    assert t.rebuilds > r0  # the ten ops grew the table
    assert beats >= 5


def test_rebuild_releases_the_gil() -> None:
    t = _full_table()
    r0 = t.rebuilds
    beats = _beats_during(t.rebuild)
    assert t.rebuilds == r0 + 1
    assert beats >= 5


# ---- tokens ---------------------------------------------------------------------------------


def test_pack_tokens_refuses_bools_as_token_array_does() -> None:
    assert _core.token_array([1, True])[1] == 1
    with pytest.raises(TypeError):
        _core.pack_tokens([True])
    with pytest.raises(TypeError):
        _core.pack_tokens((1, False))
    assert _core.pack_tokens([1, 2]) == np.array([1, 2], "<u4").tobytes()


# ---- 7. the boundary under concurrency (review of the twenty-sixth session) -------------------


def _sim_of(caches: list[_core.BlockCache]) -> _core.SimEngine:
    """A one-region engine over ``caches`` (one worker each) and one request."""
    n, regions, w = 1, 2, len(caches)
    return _core.SimEngine(
        COST, 100.0, False, 8192, 0.0, 64, False, False, np.zeros(regions * regions), [True] * regions,
        [list(range(w))] + [[] for _ in range(regions - 1)], [[] for _ in range(regions)],
        np.zeros(w, np.uint32), np.full(w, 0.1), caches, [True] * w, [True] * w,
        np.zeros(n), np.zeros(n, np.uint32), np.zeros(n, np.uint32),
        np.full(n, 32, np.uint64), np.full(n, 4, np.uint64), np.full(n, 16, np.uint32), np.zeros(n, np.uint32), np.zeros(n, np.uint64),
        np.arange(2 * n, dtype=np.uint64), np.arange(0, 2 * n + 1, 2, dtype=np.uint64), [False] * n, _pcg(1), _pcg(2), 1,
    )  # fmt: skip


def test_a_sim_engine_over_a_cache_in_use_is_refused_with_nothing_moved() -> None:
    # Review: SimEngine borrowed each cache with a panicking borrow_mut (a cache busy in another
    # thread, or given twice, was a PanicException) after moving the blocks of those before it.
    a, b = _core.BlockCache(16, 64, 64, False), _core.BlockCache(16, 64, 64, False)
    a.place_vram(np.arange(64, dtype=np.uint32), 0, 0.0, 0, True)
    e = _sim_of([a, b])
    e.return_caches([a, b])
    assert len(a) == 4
    with pytest.raises(InvalidArgumentError, match=r"caches\[1\]: Already borrowed"):
        _sim_of([a, a])
    assert len(a) == 4  # the first cache's blocks did not move


@pytest.mark.parametrize("block_size", [2**62, 2**63, 2**62 + 1])
def test_a_block_size_past_any_prompt_names_no_block_instead_of_panicking(block_size: int) -> None:
    # Review: block_size * 4 wrapped to 0 and chunks_exact(0) panicked.
    toks = np.arange(64, dtype=np.uint32)
    assert len(_core.block_chain_hashes(toks, block_size, 0)) == 0
    bc = _core.BlockCache(block_size, 1, 1, False)
    assert bc.lookup(toks, 0) == (0, 0) and len(bc.chain(toks, 0)) == 0


def test_vector_calls_name_the_argument_and_dtype_they_want() -> None:
    t = _core.LudoTable(value_bits=32)
    with pytest.raises(ValueError, match="keys: expected a 1-D numpy array of uint64"):
        t.apply_agent_ops(np.array([1], np.int64), np.array([1], np.uint8), 0, 1, np.zeros(0, np.uint64), 0, 2**20, True)
    with pytest.raises(ValueError, match="owned: array must be C-contiguous"):
        t.apply_agent_ops(np.array([1], np.uint64), np.array([1], np.uint8), 0, 1, np.zeros(4, np.uint64)[::2], 0, 2**20, True)
    q = _core.QueueEstimates(4, 0.5, 1.0)
    with pytest.raises(ValueError, match="indices: expected a 1-D numpy array of int64"):
        q.fold_many(np.array([0], np.int32), np.array([1.0]), 1.0, np.array([0.0]))
    with pytest.raises(ValueError, match="lag_s: expected a 1-D numpy array of float64"):
        q.fold_lagged(np.array([0], np.int64), np.array([1.0]), 1.0, np.array([0], np.int64))


_DEADLOCK = """
import threading, time
import numpy as np
from kvcompass._core import LudoTable, LudoView, Router, namespace_digest
from kvcompass.errors import InvalidArgumentError, KVCompassError

t = LudoTable(value_bits=32)
t.set_field(12345, 0, 1)
t.take_batch()
snap = t.export_snapshot()
v = LudoView(0, 0)
v.apply_batch(snap)
W = 1_000_000  # many workers: the core scans them under the read locks
r = Router([[16]], [(0, np.array([0], dtype=np.uint32), [v])])
tokens = np.arange(70_000, dtype=np.uint32)  # past 65,536: routed with the GIL released
region, beta, wan, tq = np.zeros(W, np.uint32), np.full(W, 0.1), np.ones(W), np.zeros(W)
belief = np.ones(W); belief[-1] = 1.5  # refused by the core, after the views were read-locked
ns = namespace_digest("m", "t")
stop = False
def route():
    while not stop:
        try:
            r.route(tokens, ns, region, beta, wan, tq, belief)
        except InvalidArgumentError:
            pass
def write():
    while not stop:
        try:
            v.apply_batch(snap)
        except KVCompassError:
            pass
threads = [threading.Thread(target=f) for f in (route, write)]
for th in threads:
    th.start()
end = time.monotonic() + 3
while time.monotonic() < end:
    v.lookup(12345)
stop = True
for th in threads:
    th.join()
print("done")
"""


def test_a_long_route_refused_by_the_core_does_not_deadlock_against_view_readers_and_writers() -> None:
    # Review: the route built its Python exception (which takes the GIL back) while it still held
    # the views' read locks; a thread holding the GIL and reading a view queued behind a waiting
    # writer, so the three waited on each other for good (within seconds, found by stress).
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _DEADLOCK], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "done", out.stderr[-2000:]


@pytest.mark.parametrize("edges", [[0.0, float("nan")], [10.0, 5.0], [0.0, float("inf")]])
def test_busy_windows_refuse_edges_that_are_not_finite_and_ascending(edges: list[float]) -> None:
    # Review: NaN or descending window edges were taken and gave meaningless windows.
    with pytest.raises(ValueError, match="edges ascending"):
        _core.busy_windows([np.array([0.0, 1.0])], 0.0, 1.0, np.array(edges))
    out, totals = _core.busy_windows([np.array([0.0, 1.0])], 0.0, 1.0, np.array([0.0, 1.0, 2.0]))
    assert out.shape == (1, 2) and totals[0] == 1.0


def test_forest_stored_takes_one_extra_flag_a_block_or_none() -> None:
    f = _core.AgentForest([4], NS)
    with pytest.raises(ValueError, match="extra: 1 flags for 2 blocks"):
        f.stored(0, "GPU", 4, toks4(2), False, None, [1, 2], [False], None)
    f.stored(0, "GPU", 4, toks4(2), False, None, [1, 2], [False, False], None)
    f.stored(0, "GPU", 4, toks4(2), False, None, [3, 4], None, None)
