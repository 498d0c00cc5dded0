"""pytest-benchmark suite of the Python-facing calls, named after the criterion benches
(``cargo bench``: ``benches/ludo.rs``, ``score.rs``, ``chunk_hash.rs``), so each operation's
cost through the bindings sits beside its Rust-only figure. Run by ``make bench`` (not by
``make test``):

    .venv/bin/python -m pytest benches/test_bench_core.py --benchmark-only

Each test's group is the criterion group and its ``extra_info["criterion"]`` the criterion id
it mirrors. Tables are 10^6 entries at 95 % of capacity, as in the criterion benches; keys are
seeded random 63-bit keys. The headline figures (P50s, bits per entry, bars) stay in
``benches/bench_core.py``'s JSON line; these are per-call timings as pytest-benchmark reports
them.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

pytest.importorskip("pytest_benchmark")

from kvcompass import _core  # noqa: E402
from kvcompass.agent import WorkerAgent, encode_batch  # noqa: E402
from kvcompass.agent.events import BlockStored  # noqa: E402
from kvcompass.index_types import Namespace, Tier, as_tokens, pack_tiers  # noqa: E402

CAPACITY = 1_000_000
BATCH = 1024
SEED = 7


def _keys(rng: np.random.Generator, n: int) -> np.ndarray:
    return rng.integers(1, 1 << 63, size=n, dtype=np.uint64)


@pytest.fixture(scope="module")
def filled() -> dict[str, Any]:
    """A writer table built at 95 % of its capacity, its keys, and a follower view."""
    rng = np.random.default_rng(SEED)
    probe = _core.LudoTable(capacity=CAPACITY, seed=SEED)
    n = int(probe.capacity * 0.95)
    keys = _keys(rng, n)
    values = (keys % np.uint64(0xFFFF) + np.uint64(1)).astype(np.uint64)
    table = _core.LudoTable.build(keys, values, capacity=probe.capacity, seed=SEED)
    view = _core.LudoView(0, 0)
    view.apply_batch(table.export_snapshot())
    return {"table": table, "view": view, "keys": keys, "rng": rng}


@pytest.mark.benchmark(group="ludo_view")
def test_ludo_view_lookup_fp0(benchmark: Any, filled: dict[str, Any]) -> None:
    benchmark.extra_info["criterion"] = "ludo_view/lookup/fp0"
    view, keys = filled["view"], filled["keys"].tolist()
    it = iter(range(10**9))

    def one() -> int:
        return view.lookup(keys[next(it) % len(keys)])

    assert benchmark(one) != 0


@pytest.mark.benchmark(group="ludo_view")
def test_ludo_view_lookup_batch_1024_fp0(benchmark: Any, filled: dict[str, Any]) -> None:
    benchmark.extra_info["criterion"] = "ludo_view/lookup_batch_1024/fp0"
    view, keys = filled["view"], filled["keys"]
    chunks = [np.ascontiguousarray(keys[i * BATCH : (i + 1) * BATCH]) for i in range(64)]
    it = iter(range(10**9))
    out = benchmark(lambda: view.lookup_batch(chunks[next(it) % len(chunks)]))
    assert len(out) == BATCH and int(out.min()) > 0


@pytest.mark.benchmark(group="ludo_write")
def test_ludo_write_set_update(benchmark: Any, filled: dict[str, Any]) -> None:
    benchmark.extra_info["criterion"] = "ludo_write/set_update"
    table, keys = filled["table"], filled["keys"].tolist()
    it = iter(range(10**9))

    def one() -> None:
        i = next(it)
        table.update(keys[i % len(keys)], (i % 0xFFFF) + 1)
        if i % 4096 == 4095:
            table.take_batch()

    benchmark(one)
    table.take_batch()


@pytest.mark.benchmark(group="ludo_write")
def test_ludo_write_remove_insert_pair_95pct(benchmark: Any, filled: dict[str, Any]) -> None:
    benchmark.extra_info["criterion"] = "ludo_write/remove_insert_pair_95pct"
    table, rng = filled["table"], filled["rng"]
    present = filled["keys"].tolist()
    fresh = iter(_keys(rng, 2_000_000).tolist())
    it = iter(range(10**9))

    def pair() -> None:
        i = next(it)
        j = (i * 7919) % len(present)
        table.remove(present[j])
        new = next(fresh)
        table.insert(new, (new % 0xFFFF) + 1)
        present[j] = new
        if i % 2048 == 2047:
            table.take_batch()

    benchmark(pair)
    table.take_batch()


@pytest.mark.benchmark(group="ludo_write")
def test_ludo_write_apply_field_ops_1024(benchmark: Any, filled: dict[str, Any]) -> None:
    benchmark.extra_info["criterion"] = "ludo_write/apply_field_ops_1024"
    table, keys = filled["table"], filled["keys"]
    fields = np.full(BATCH, 3, dtype=np.uint32)
    batches = [np.ascontiguousarray(keys[i * BATCH : (i + 1) * BATCH]) for i in range(32)]
    it = iter(range(10**9))

    def one() -> int:
        i = next(it)
        n = table.apply_field_ops(batches[i % len(batches)], fields, np.full(BATCH, 1 + i % 2, dtype=np.uint8))
        table.take_batch()
        return n

    assert benchmark(one) == BATCH


@pytest.mark.benchmark(group="ludo_patch")
def test_ludo_patch_take_batch_apply_256_ops(benchmark: Any) -> None:
    benchmark.extra_info["criterion"] = "ludo_patch/take_batch_apply_256_ops"
    rng = np.random.default_rng(SEED + 1)
    keys = _keys(rng, 100_000)
    table = _core.LudoTable.build(keys, np.ones(len(keys), np.uint64), capacity=120_000, seed=SEED)
    view = _core.LudoView(0, 0)
    view.apply_batch(table.export_snapshot())
    k = keys.tolist()
    it = iter(range(10**9))

    def one() -> int:
        i = next(it)
        base = (i * 256) % (len(k) - 256)
        for j in range(256):
            table.update(k[base + j], 2 + i % 0xFFFD)
        data = table.take_batch()
        assert data is not None
        return view.apply_batch(data).ops

    assert benchmark(one) == 256


def _router() -> tuple[_core.Router, np.ndarray, bytes, dict[str, np.ndarray]]:
    """14 workers in 3 regions, 2 shards, plan lengths as the criterion scenario; a 4,096-token
    prompt held at its longest length by a few workers."""
    ns = Namespace("llama-3.1-8b", "bench")
    tokens = (np.arange(4096, dtype=np.uint64) * 2654435761 % 128_000).astype(np.uint32)
    plan = [[256, 512, 1024, 2048, 4096], [1024, 1536, 2048, 3072], [2048, 3072, 4096]]
    region = np.array([0] * 8 + [1] * 2 + [2] * 4, dtype=np.uint32)
    tables = []
    for r, workers in enumerate((range(0, 8), range(8, 10), range(10, 14))):
        views = []
        for s in range(2):
            t = _core.LudoTable(table=r, shard=s, capacity=4096, seed=SEED)
            for c in plan[r]:
                key = int(ns.keys(tokens, [c])[0])
                if key % 2 == s:
                    t.set(key, pack_tiers([int(Tier.VRAM)] + [0] * (len(workers) - 1)))
            t.take_batch()
            v = _core.LudoView(r, s)
            v.apply_batch(t.export_snapshot())
            views.append(v)
        tables.append((r, np.array(list(workers), dtype=np.uint32), views))
    router = _core.Router(plan, tables)
    arrays = {
        "region": region,
        "beta": np.full(14, 0.085),
        "wan": np.array([2.0 if r == 0 else 35.0 if r == 1 else 80.0 for r in region]),
        "tq": np.arange(14, dtype=np.float64) % 13,
        "belief": np.ones(14),
    }
    return router, tokens, ns.digest, arrays


@pytest.mark.benchmark(group="route_14w_3r_2shards")
def test_route_14w_3r_2shards_route_with_hit_numpy(benchmark: Any) -> None:
    benchmark.extra_info["criterion"] = "route_14w_3r_2shards/route_with/hit"
    router, tokens, ns, a = _router()
    res = benchmark(lambda: router.route(tokens, ns, **a))
    assert res.matches.max() > 0


@pytest.mark.benchmark(group="route_14w_3r_2shards")
def test_route_14w_3r_2shards_route_with_hit_from_list(benchmark: Any) -> None:
    # What a caller pays when the prompt arrives as a list (a JSON body, a tokenizer's ids): the
    # list -> uint32 array step, as Edge.route takes it (as_tokens).
    benchmark.extra_info["criterion"] = "route_14w_3r_2shards/route_with/hit"
    router, tokens, ns, a = _router()
    as_list = tokens.tolist()
    res = benchmark(lambda: router.route(as_tokens(as_list), ns, **a))
    assert res.matches.max() > 0


def _edge_and_prompt() -> tuple[Any, np.ndarray, Any]:
    """An edge of paper-64x8 whose own region holds a 4,096-token prompt at its first plan lengths."""
    from kvcompass.discovery.plane import LocalPlane
    from kvcompass.discovery.topology import load_topology

    plane = LocalPlane(load_topology("paper-64x8"), seed=SEED)
    edge = next(iter(plane.edges.values()))
    ns = Namespace("llama-3.1-8b", "public")
    tokens = (np.arange(4096, dtype=np.uint64) * 2654435761 % 128_000).astype(np.uint32)
    return edge, tokens, ns


@pytest.mark.benchmark(group="edge")
def test_edge_route_4096(benchmark: Any) -> None:
    # Edge.route as the door and the simulator call it: the core's one call (expiries, price,
    # route, tie draw, charge, speculative entries) plus the belief and the Decision in Python;
    # beside route_14w_3r_2shards, the edge's own cost per request. The clock moves a second a
    # call, so speculative entries and charges expire as they would.
    edge, tokens, ns = _edge_and_prompt()
    clock = iter(range(1, 10**9))
    d = benchmark(lambda: edge.route(tokens, ns, float(next(clock))))
    assert d.prompt_tokens == 4096


@pytest.mark.benchmark(group="edge")
def test_edge_lookup_4096(benchmark: Any) -> None:
    edge, tokens, ns = _edge_and_prompt()
    d = benchmark(lambda: edge.lookup(tokens, ns, 1.0))
    assert d.prompt_tokens == 4096 and edge.speculative_entries == 0


@pytest.mark.benchmark(group="chunk_hash")
def test_chunk_hash_prefix_keys_4096(benchmark: Any) -> None:
    benchmark.extra_info["criterion"] = "chunk_hash"
    ns = Namespace("llama-3.1-8b", "bench")
    tokens = np.arange(4096, dtype=np.uint32)
    lengths = np.array([256, 512, 1024, 2048, 4096], dtype=np.uint32)
    keys = benchmark(lambda: _core.prefix_keys(ns.digest, tokens, lengths))
    assert len(keys) == 5


@pytest.mark.benchmark(group="agent")
def test_agent_ingest_one_engine_batch(benchmark: Any) -> None:
    # One engine message of 16 stored blocks (256 tokens) through WorkerAgent: decode, forest,
    # key ops. No criterion twin: the agent has no Rust-only bench.
    lengths = [64, 128, 256, 512, 1024, 2048]
    agent = WorkerAgent("w0", Namespace("llama-3.1-8b"), lengths, shards=4, block_size=16)
    it = iter(range(10**9))

    def one() -> int:
        i = next(it)
        base = i * 256
        toks = tuple(range(base, base + 256))
        ev = BlockStored(tuple(range(i * 16 + 1, i * 16 + 17)), None, toks, 16, None, "GPU")
        return len(agent.on_message(encode_batch([ev], seq=i)).batches)

    benchmark(one)


# A ~150-token English prompt with curly quotes and a dash (the fast path's blocks), as the door
# tokenizes one per request. No criterion twin: the fast path's merge table comes from a
# tokenizer.json, which only the Python side reads.
_PROMPT = (
    "The function takes a list of numbers and returns the largest one. First, check that the list "
    "is not empty; then keep the “largest” value seen so far — while walking through the list once. "
) * 3


@pytest.mark.benchmark(group="tokenizer")
def test_tokenizer_encode_fast(benchmark: Any) -> None:
    from kvcompass.engine.tokenizer import load_tokenizer

    tok = load_tokenizer(None)
    assert tok.fast
    ids = benchmark(lambda: tok.encode(_PROMPT))
    assert ids.tolist() == tok.hf.encode(_PROMPT, add_special_tokens=False).ids


@pytest.mark.benchmark(group="tokenizer")
def test_tokenizer_encode_hf(benchmark: Any) -> None:
    from kvcompass.engine.tokenizer import load_tokenizer

    tok = load_tokenizer(None)
    enc = benchmark(lambda: tok.hf.encode(_PROMPT, add_special_tokens=False))
    assert len(enc.ids) > 100
