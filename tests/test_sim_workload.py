"""The simulator's workload layer: trace schema checks, token expansion, sessions and regions,
rate modes, tenants, the synthetic Mixed generator and the reuse statistics."""

from __future__ import annotations

import hashlib
import json
import math
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvcompass.discovery.topology import load_topology
from kvcompass.errors import InvalidArgumentError
from kvcompass.sim.workload import (
    MOONCAKE_BLOCK_SIZE,
    VOCAB,
    ChainBlocks,
    MixedConfig,
    Request,
    TraceBlocks,
    _mix64_np,
    dump_trace,
    expand_blocks,
    find_trace,
    load_mooncake,
    load_trace,
    region_weights,
    resolve_trace,
    reuse_stats,
    synthetic_mixed,
)

from _support import mix64 as _mix64

ROOT = Path(__file__).resolve().parents[1]
EXCERPT = ROOT / "tests" / "data" / "conversation_excerpt.jsonl"
REGIONS = ("us", "eu", "ap")


def write_trace(path: Path, rows: list[dict[str, Any]] | list[str]) -> Path:
    """One line per row: dicts as JSON, strings verbatim (for malformed lines)."""
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def row(ts: float, n_in: int, ids: list[int], n_out: int = 10, **extra: Any) -> dict[str, Any]:
    return {"timestamp": ts, "input_length": n_in, "output_length": n_out, "hash_ids": ids, **extra}


def gaps(reqs: list[Request]) -> np.ndarray:
    return np.diff([r.arrival_ms for r in reqs])


# --------------------------------------------------------------------------------------------
# Token expansion


def test_expansion_known_answer() -> None:
    # Pinned: a change here silently changes every workload's tokens and every key.
    assert expand_blocks([0, 1], 5, 4).tolist() == [85192, 20828, 103872, 6824, 75434]
    assert expand_blocks([2**63 - 1], 3, 8).tolist() == [85479, 93283, 118171]


def test_mix_scalar_and_vector_agree() -> None:
    xs = [0, 1, 2**63 - 1, 2**64 - 1, 0x9E3779B97F4A7C15, 123456789]
    assert _mix64_np(np.array(xs, dtype=np.uint64)).tolist() == [_mix64(x) for x in xs]


def test_mix_fold_is_the_scalar_mixing_folded() -> None:
    """Segment ids and prompt chains (``_core.mix_fold``) against the definition in Python."""
    from kvcompass import _core

    for h, parts in ((0, ()), (0x6B7663636861696E, (1, 0, 4096)), (2**64 - 1, (2**64 - 1, 0, 7, 123456789))):
        want = h
        for p in parts:
            want = _mix64(want ^ p)
        assert _core.mix_fold(h, parts) == want
    with pytest.raises(OverflowError):
        _core.mix_fold(0, (-1,))


def test_rust_expansion_and_chain_ids_match_the_scalar_definition() -> None:
    """The Rust arithmetic (rust/token_ids.rs) against the definition written out in Python."""
    from kvcompass.sim.workload import _GOLDEN, _M64, _MAX_ID, _TOKEN_SALT

    rng = np.random.default_rng(5)
    ids = [int(x) for x in rng.integers(0, 2**63 - 1, size=7, dtype=np.int64)] + [0, 2**63 - 1]
    for bs, length in ((16, 16 * len(ids)), (5, 5 * len(ids) - 3), (512, 512 * (len(ids) - 1) + 1)):
        want = []
        for i in range(length):
            z = _mix64((_mix64(ids[i // bs] ^ _TOKEN_SALT) + (i % bs) * _GOLDEN) & _M64)
            want.append(((z >> 32) * VOCAB) >> 32)
        assert expand_blocks(ids, length, bs).tolist() == want
    runs = ((int(rng.integers(0, 2**63)), 3), (2**64 - 1, 2), (0, 0), (77, 1))
    want_ids = [_mix64((c + j * _GOLDEN) & _M64) & _MAX_ID for c, n in runs for j in range(1, n + 1)]
    assert ChainBlocks(runs).hash_ids().tolist() == want_ids
    assert ChainBlocks(()).hash_ids().tolist() == []


def test_expansion_shape_dtype_and_range() -> None:
    tok = expand_blocks(np.arange(10, dtype=np.uint64), 150, 16)
    assert tok.dtype == np.uint32 and tok.shape == (150,)
    assert int(tok.max()) < VOCAB
    assert len(np.unique(tok)) > 140  # no degenerate streams


def test_shared_leading_ids_share_exactly_those_tokens() -> None:
    bs = 16
    a = expand_blocks([7, 8, 9, 11], 4 * bs, bs)
    b = expand_blocks([7, 8, 10, 11], 4 * bs, bs)
    assert np.array_equal(a[: 2 * bs], b[: 2 * bs])
    assert not np.array_equal(a[2 * bs : 3 * bs], b[2 * bs : 3 * bs])
    # Same id, same tokens, wherever it sits: block 11 expands alike in both.
    assert np.array_equal(a[3 * bs :], b[3 * bs :])
    # A partial last block is a prefix of the full block with the same id.
    assert np.array_equal(expand_blocks([7, 8], 20, bs), a[:20])


def test_expansion_rejects_wrong_block_count() -> None:
    with pytest.raises(InvalidArgumentError, match="ceil"):
        expand_blocks([1, 2], 33, 16)
    with pytest.raises(InvalidArgumentError):
        expand_blocks([-1], 4, 16)


def test_request_tokens_follow_hash_ids() -> None:
    reqs = load_trace(EXCERPT, MOONCAKE_BLOCK_SIZE, regions=REGIONS, max_requests=3)
    r = reqs[0]
    assert r.input_tokens().shape == (r.input_length,)
    assert np.array_equal(r.input_tokens(), expand_blocks(r.hash_ids(), r.input_length, 512))
    # Every row of the conversation trace starts with id 0: a shared first 512 tokens.
    assert np.array_equal(reqs[0].input_tokens()[:512], reqs[1].input_tokens()[:512])
    assert not np.array_equal(reqs[0].input_tokens()[512:1024], reqs[1].input_tokens()[512:1024])


# --------------------------------------------------------------------------------------------
# Schema validation

GOOD = row(0, 20, [1, 2])
BAD_LINES: list[tuple[str, Any, str | None, str]] = [
    ("missing field", {"timestamp": 5, "input_length": 20, "output_length": 3}, "hash_ids", "missing"),
    ("missing timestamp", {"input_length": 20, "output_length": 3, "hash_ids": [1, 2]}, "timestamp", "missing"),
    ("length as string", row(5, "20", [1, 2]), "input_length", "integer"),  # type: ignore[arg-type]
    ("length as float", row(5, 20.0, [1, 2]), "input_length", "integer"),  # type: ignore[arg-type]
    ("length as bool", row(5, True, [1]), "input_length", "integer"),
    ("zero input", row(5, 0, []), "input_length", "[1, "),
    ("negative output", row(5, 20, [1, 2], n_out=-1), "output_length", "[0, "),
    ("output past any model", row(5, 20, [1, 2], n_out=5_000_000_000), "output_length", "16777215"),  # review: 5.8 TiB asked
    ("output past 64 bits", row(5, 20, [1, 2], n_out=2**64), "output_length", "16777215"),
    ("too few ids", row(5, 20, [1]), "hash_ids", "ceil"),
    ("too many ids", row(5, 20, [1, 2, 3]), "hash_ids", "ceil"),
    ("ids not a list", row(5, 20, "1,2"), "hash_ids", "list"),  # type: ignore[arg-type]
    ("id not an int", row(5, 20, [1, 2.5]), "hash_ids", "element 1"),  # type: ignore[list-item]
    ("negative id", row(5, 20, [1, -2]), "hash_ids", "element 1"),
    ("id past 63 bits", row(5, 20, [2**63, 1]), "hash_ids", "element 0"),
    ("negative time", row(-1, 20, [1, 2]), "timestamp", ">= 0"),
    ("time as string", row("5", 20, [1, 2]), "timestamp", "number"),  # type: ignore[arg-type]
    ("time past float range", row(10**400, 20, [1, 2]), "timestamp", "number"),
    ("time NaN", '{"timestamp": NaN, "input_length": 20, "output_length": 3, "hash_ids": [1, 2]}', "timestamp", "number"),
    ("not JSON", '{"timestamp": 5, "input_length": 20,', None, "not valid JSON"),
    ("not an object", "[5, 20, 3, [1, 2]]", None, "JSON object"),
    ("chat_id negative", row(5, 20, [1, 2], chat_id=-1), "chat_id", ">= 0"),
    ("chat_id reused", row(5, 20, [1, 2], chat_id=1), "chat_id", "already used"),
    ("parent below -1", row(5, 20, [1, 2], chat_id=9, parent_chat_id=-2), "parent_chat_id", ">= -1"),
    ("parent is self", row(5, 20, [1, 2], chat_id=9, parent_chat_id=9), "parent_chat_id", "own chat_id"),
]


@pytest.mark.parametrize(("bad", "field", "text"), [c[1:] for c in BAD_LINES], ids=[c[0] for c in BAD_LINES])
def test_schema_errors_name_line_and_field(tmp_path: Path, bad: Any, field: str | None, text: str) -> None:
    # Line 2 is blank (skipped, still counted), so the bad row is on line 4.
    path = write_trace(tmp_path / "t.jsonl", [row(1, 20, [1, 2], chat_id=1), "", row(2, 5, [3], chat_id=2), bad])
    with pytest.raises(InvalidArgumentError) as info:
        load_trace(path, 16, regions=REGIONS)
    err = info.value
    assert isinstance(err, ValueError)
    assert (err.line, err.field, err.path) == (4, field, str(path))  # type: ignore[attr-defined]
    assert "line 4" in str(err) and text in str(err)
    if field:
        assert repr(field) in str(err)


def test_decreasing_timestamp_is_refused(tmp_path: Path) -> None:
    path = write_trace(tmp_path / "t.jsonl", [row(10, 20, [1, 2]), row(10, 20, [1, 2]), row(9.5, 20, [1, 2])])
    with pytest.raises(InvalidArgumentError, match="line 3, field 'timestamp'.*non-decreasing") as info:
        load_trace(path, 16, regions=REGIONS)
    assert info.value.line == 3  # type: ignore[attr-defined]


def test_block_size_is_part_of_the_schema(tmp_path: Path) -> None:
    path = write_trace(tmp_path / "t.jsonl", [row(0, 600, [1, 2])])
    assert load_trace(path, 512, regions=REGIONS)[0].n_blocks == 2
    with pytest.raises(InvalidArgumentError, match="ceil\\(600 / 16\\) = 38"):
        load_trace(path, 16, regions=REGIONS)


def test_empty_trace_and_extra_fields(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgumentError, match="no requests"):
        load_trace(write_trace(tmp_path / "e.jsonl", ["", "  "]), 16, regions=REGIONS)
    # Unknown keys (Qwen-Bailian's "type", "turn") are ignored.
    reqs = load_trace(write_trace(tmp_path / "x.jsonl", [row(0, 20, [1, 2], type="text", turn=1)]), 16, regions=REGIONS)
    assert len(reqs) == 1 and reqs[0].kind == "trace"


@pytest.mark.parametrize("key", ["parent_chat", "chatid", "regions", "Timestamp"])
def test_unknown_keys_are_refused_by_name(tmp_path: Path, key: str) -> None:
    """A misspelt session link made every turn a root; it was read past in silence (an
    operator's review)."""
    rows = [row(0, 20, [1, 2], chat_id=1), row(1, 20, [1, 3], chat_id=2, parent_chat_id=1), row(2, 20, [1, 4], **{key: 1})]
    path = write_trace(tmp_path / "t.jsonl", rows)
    with pytest.raises(InvalidArgumentError) as info:
        load_trace(path, 16, regions=REGIONS)
    err = info.value
    assert (err.path, err.line, err.field) == (str(path), 3, key)  # type: ignore[attr-defined]
    assert str(err).startswith(f"{path}, line 3, field {key!r}: unknown key (accepted: timestamp, input_length, output_length, hash_ids, chat_id, parent_chat_id, region, type, turn)")


def test_a_lines_region_is_where_it_enters_and_its_follow_ups_inherit_it(tmp_path: Path) -> None:
    """An operator's log knows where each request entered: a line's ``region`` wins, a follow-up
    without one takes its root's, and the lines without one keep the regions they were drawn
    (a region given on some lines moves no other line's draw)."""
    rows = [row(i, 20, [i, i + 100], chat_id=i) for i in range(40)]
    rows[3]["region"] = "ap"
    rows[4] |= {"parent_chat_id": 3}  # a follow-up of the ap root, no region of its own
    rows[5] |= {"parent_chat_id": 3, "region": "eu"}  # a follow-up that names its own
    given = load_trace(write_trace(tmp_path / "r.jsonl", rows), 16, regions=REGIONS, seed=7)
    for r in rows:
        r.pop("region", None)
    drawn = load_trace(write_trace(tmp_path / "d.jsonl", rows), 16, regions=REGIONS, seed=7)
    assert [r.region for r in given[3:6]] == ["ap", "ap", "eu"]
    assert drawn[4].region == drawn[3].region  # without: the follow-up inherits the draw
    assert [r.region for r in given[6:]] == [r.region for r in drawn[6:]] and [r.region for r in given[:3]] == [r.region for r in drawn[:3]]
    assert len({r.region for r in drawn}) == 3  # the draw covers every region: the test has teeth


def test_a_region_the_fleet_lacks_is_refused_by_line(tmp_path: Path) -> None:
    path = write_trace(tmp_path / "t.jsonl", [row(0, 20, [1, 2]), row(1, 20, [1, 3], region="us-east-1")])
    with pytest.raises(InvalidArgumentError) as info:
        load_trace(path, 16, regions=REGIONS)
    assert (info.value.line, info.value.field) == (2, "region")  # type: ignore[attr-defined]
    assert "'us-east-1' is not a region of the fleet (its regions: us, eu, ap)" in str(info.value)
    with pytest.raises(InvalidArgumentError, match="field 'region'"):
        load_trace(write_trace(tmp_path / "n.jsonl", [row(0, 20, [1, 2], region=3)]), 16, regions=REGIONS)


def test_a_trace_read_at_another_block_size_says_so(tmp_path: Path) -> None:
    path = write_trace(tmp_path / "t.jsonl", [row(0, 600, list(range(38)))])
    with pytest.raises(InvalidArgumentError, match="another block size.*--block-size"):
        load_trace(path, 512, regions=REGIONS)


def test_the_shared_traces_keys_are_all_accepted() -> None:
    """Every key of the traces shipped or shared here loads (the excerpt is the shared
    conversation trace's head; the full files, when present, are read whole)."""
    names = [n for n in ("conversation", "synthetic") if (ROOT.parent / "shared" / "data" / "traces" / f"{n}_trace.jsonl").is_file()]
    for path in [EXCERPT, ROOT / "kvcompass" / "data" / "traces" / "conversation_trace.jsonl", *(find_trace(n) for n in names)]:
        assert len(load_trace(path, MOONCAKE_BLOCK_SIZE, regions=REGIONS)) == sum(1 for line in path.read_text().splitlines() if line.strip())


def test_a_prompt_past_the_topologys_context_window_is_refused_by_line(tmp_path: Path) -> None:
    """Simulated as if some engine served it, before an operator's review: no engine of a fleet
    whose model's window is ``max_prefix`` tokens does."""
    import dataclasses

    topo = dataclasses.replace(load_topology("testbed-14x3"), max_prefix=8192)
    path = write_trace(tmp_path / "t.jsonl", [row(0, 8192, list(range(16))), row(1, 8193, list(range(17)))])
    with pytest.raises(InvalidArgumentError) as info:
        load_trace(path, 512, regions=topo)
    err = info.value
    assert (err.line, err.field) == (2, "input_length")  # type: ignore[attr-defined]
    assert f"{path}, line 2, field 'input_length': 8193 tokens, longer than the context window of topology 'testbed-14x3' (max_prefix 8192)" in str(err)
    assert "raise max_prefix in the topology" in str(err)
    assert len(load_trace(path, 512, regions=topo, max_requests=1)) == 1  # the first line fits
    assert len(load_trace(path, 512, regions=REGIONS)) == 2  # plain region names: no window
    with pytest.raises(InvalidArgumentError, match="line 1, field 'input_length': 8192 tokens, longer than max_input_length 8000"):
        load_trace(path, 512, regions=REGIONS, max_input_length=8000)


@pytest.mark.parametrize(
    ("kwargs", "text"),
    [
        ({"mode": "trace", "rate": 5.0}, "rate must be None"),
        ({"mode": "rescale"}, "needs a rate"),
        ({"mode": "poisson", "rate": 0.0}, "needs a rate"),
        ({"mode": "fast"}, "mode must be"),
        ({"tenants": 0}, "tenants"),
        ({"max_requests": 0}, "max_requests"),
        ({"weights": [1.0, 2.0]}, "3 regions"),
        ({"weights": [1.0, -1.0, 1.0]}, ">= 0"),
        ({"weights": [0.0, 0.0, 0.0]}, "not all 0"),
        ({"regions": "us"}, "sequence of region names"),
        ({"regions": ["us", "us"]}, "distinct"),
        ({"regions": []}, "empty"),
    ],
)
def test_argument_errors(kwargs: dict[str, Any], text: str) -> None:
    args: dict[str, Any] = {"regions": REGIONS} | kwargs
    with pytest.raises(InvalidArgumentError, match=text):
        load_trace(EXCERPT, 512, **args)


def test_block_size_argument() -> None:
    with pytest.raises(InvalidArgumentError, match="block_size"):
        load_trace(EXCERPT, 0, regions=REGIONS)


# --------------------------------------------------------------------------------------------
# Sessions and regions


def session_trace(tmp_path: Path, sessions: int, turns: int) -> Path:
    rows: list[dict[str, Any]] = []
    chat = 0
    for turn in range(turns):
        for s in range(sessions):
            cid = s * turns + turn
            parent = -1 if turn == 0 else cid - 1
            rows.append(row(chat, 20, [cid * 2, cid * 2 + 1], chat_id=cid, parent_chat_id=parent))
            chat += 1
    return write_trace(tmp_path / "sessions.jsonl", rows)


def test_follow_ups_inherit_their_roots_region(tmp_path: Path) -> None:
    reqs = load_trace(session_trace(tmp_path, 300, 4), 16, regions=REGIONS, seed=3)
    by_id = {r.id: r for r in reqs}
    roots = [r for r in reqs if r.is_root]
    assert len(roots) == 300 and all(r.session == r.id for r in roots)
    for r in reqs:
        assert r.region == by_id[r.session].region
        if not r.is_root:
            assert by_id[r.parent].session == r.session and r.parent < r.id
    assert Counter(len([r for r in reqs if r.session == s.id]) for s in roots) == {4: 300}
    assert len({r.region for r in roots}) == 3


def test_unknown_parent_starts_a_session(tmp_path: Path) -> None:
    path = write_trace(
        tmp_path / "t.jsonl",
        [row(0, 20, [1, 2], chat_id=5, parent_chat_id=77), row(1, 20, [1, 3], chat_id=6, parent_chat_id=5), row(2, 20, [1, 4])],
    )
    a, b, c = load_trace(path, 16, regions=REGIONS)
    assert a.is_root and a.session == 0
    assert (b.parent, b.session, b.region) == (0, 0, a.region)
    assert c.is_root and c.session == 2  # no session fields: every request is a root


def test_weights_are_respected(tmp_path: Path) -> None:
    path = write_trace(tmp_path / "t.jsonl", [row(i, 20, [2 * i, 2 * i + 1]) for i in range(6000)])
    reqs = load_trace(path, 16, regions=("a", "b", "c", "d"), weights=[6, 3, 1, 0], seed=11)
    share = Counter(r.region for r in reqs)
    assert share["d"] == 0
    for name, w in (("a", 0.6), ("b", 0.3), ("c", 0.1)):
        assert abs(share[name] / 6000 - w) < 0.025
    # Seeded: the same seed gives the same draws, another seed others.
    again = load_trace(path, 16, regions=("a", "b", "c", "d"), weights=[6, 3, 1, 0], seed=11)
    other = load_trace(path, 16, regions=("a", "b", "c", "d"), weights=[6, 3, 1, 0], seed=12)
    assert [r.region for r in again] == [r.region for r in reqs] != [r.region for r in other]


def test_default_weights_follow_topology_capacity() -> None:
    topo = load_topology("testbed-14x3")
    names, caps = region_weights(topo)
    workers = Counter(w.region for w in topo.indexed_workers)
    betas = {w.beta_ms_per_token for w in topo.indexed_workers}
    assert len(betas) == 1  # equal rates: capacity is the worker count
    beta = betas.pop()
    assert [c * beta for c in caps] == pytest.approx([workers[n] for n in names])
    reqs = load_trace(EXCERPT, 512, regions=topo, seed=1, tenants=40)  # 4800 roots
    share = Counter(r.region for r in reqs)
    for name in names:
        assert abs(share[name] / len(reqs) - workers[name] / 14) < 0.03


def test_max_requests_keeps_the_first_rows_and_their_regions() -> None:
    # Logged times as they are: spreading the last bucket depends on what follows it.
    full = load_trace(EXCERPT, 512, regions=REGIONS, seed=5, ties="keep")
    head = load_trace(EXCERPT, 512, regions=REGIONS, seed=5, max_requests=30, ties="keep")
    assert len(head) == 30
    assert [(r.region, r.input_length, r.arrival_ms) for r in head] == [(r.region, r.input_length, r.arrival_ms) for r in full[:30]]


@pytest.mark.parametrize("mode", ["trace", "rescale", "poisson"])
def test_max_total_keeps_the_first_requests_of_the_merged_copies(mode: str) -> None:
    """``max_total`` counts requests, not rows: K copies share it, interleaved, each from the
    file's first rows, and a rescaled rate holds for the requests kept."""
    rate = None if mode == "trace" else 20.0
    reqs = load_trace(EXCERPT, 512, regions=REGIONS, tenants=3, max_total=30, mode=mode, rate=rate, seed=4, ties="keep")  # type: ignore[arg-type]
    assert len(reqs) == 30 and [r.id for r in reqs] == list(range(30))
    assert Counter(r.tenant for r in reqs) == {0: 10, 1: 10, 2: 10}
    for k in range(3):  # each copy: the file's first ten rows, sessions and parents in the kept set
        assert [r.input_length for r in reqs if r.tenant == k] == [r.input_length for r in load_trace(EXCERPT, 512, regions=REGIONS, max_requests=10)]
    assert all(0 <= r.session <= r.id and r.parent < r.id for r in reqs)
    if mode == "rescale":
        assert (len(reqs) - 1) * 1e3 / (reqs[-1].arrival_ms - reqs[0].arrival_ms) == pytest.approx(20.0)
    # max_requests still counts rows: K copies of each.
    assert len(load_trace(EXCERPT, 512, regions=REGIONS, tenants=3, max_requests=10)) == 30


# --------------------------------------------------------------------------------------------
# Rates


def test_trace_mode_keeps_the_file_times() -> None:
    stamps = [json.loads(line)["timestamp"] for line in EXCERPT.read_text().splitlines()]
    reqs = load_trace(EXCERPT, 512, regions=REGIONS)
    assert [r.arrival_ms for r in reqs] == stamps
    assert [r.id for r in reqs] == list(range(len(reqs)))


@pytest.mark.parametrize("tenants", [1, 3])
def test_rescale_hits_the_target_mean_rate(tenants: int) -> None:
    base = load_trace(EXCERPT, 512, regions=REGIONS, tenants=tenants)
    reqs = load_trace(EXCERPT, 512, regions=REGIONS, tenants=tenants, mode="rescale", rate=250.0, ties="keep")
    n = len(reqs)
    assert n == 120 * tenants and reqs[0].arrival_ms == 0.0
    assert (n - 1) / (reqs[-1].arrival_ms / 1000.0) == pytest.approx(250.0, rel=1e-12)
    # A pure time scaling: same order, gaps proportional.
    assert [(r.tenant, r.input_length) for r in reqs] == [(r.tenant, r.input_length) for r in base]
    scale = reqs[-1].arrival_ms / (base[-1].arrival_ms - base[0].arrival_ms)
    assert np.allclose(gaps(reqs), gaps(base) * scale)


def test_rescale_needs_a_time_span(tmp_path: Path) -> None:
    path = write_trace(tmp_path / "t.jsonl", [row(7, 20, [1, 2]), row(7, 20, [1, 3])])
    with pytest.raises(InvalidArgumentError, match="same timestamp"):
        load_trace(path, 16, regions=REGIONS, mode="rescale", rate=10.0)
    assert [r.arrival_ms for r in load_trace(path, 16, regions=REGIONS, mode="poisson", rate=10.0)][0] == 0.0


def test_poisson_inter_arrivals() -> None:
    rate = 40.0
    base = load_trace(EXCERPT, 512, regions=REGIONS, tenants=50, seed=9)
    reqs = load_trace(EXCERPT, 512, regions=REGIONS, tenants=50, mode="poisson", rate=rate, seed=9)
    g = gaps(reqs)
    assert g.size == 5999 and np.all(g >= 0)
    assert abs(g.mean() - 1000.0 / rate) < 0.04 * 1000.0 / rate
    assert abs(g.std() / g.mean() - 1.0) < 0.05  # exponential: coefficient of variation 1
    assert [(r.tenant, r.input_length, r.region) for r in reqs] == [(r.tenant, r.input_length, r.region) for r in base]
    again = load_trace(EXCERPT, 512, regions=REGIONS, tenants=50, mode="poisson", rate=rate, seed=9)
    assert [r.arrival_ms for r in again] == [r.arrival_ms for r in reqs]


# --------------------------------------------------------------------------------------------
# Tenants


def test_tenants_are_separated_by_namespace() -> None:
    one = load_trace(EXCERPT, 512, regions=REGIONS)
    three = load_trace(EXCERPT, 512, regions=REGIONS, tenants=3, namespace="acme")
    assert len(three) == 360
    assert {r.namespace for r in three} == {"acme/tenant-0", "acme/tenant-1", "acme/tenant-2"}
    assert {r.namespace for r in one} == {"public"}
    for k in range(3):
        copy = [r for r in three if r.tenant == k]
        assert len({r.namespace for r in copy}) == 1
        # Identical rows, identical ids (and one shared array: memory stays flat in K).
        assert all(a.blocks is b.blocks for a, b in zip(copy, [r for r in three if r.tenant == 0]))
        assert [r.input_length for r in copy] == [r.input_length for r in one]
    # Tenants interleave: copy k is shifted by k/K of the trace's mean gap, not stacked on copy 0.
    gap = (one[-1].arrival_ms - one[0].arrival_ms) / (len(one) - 1)
    for k in (1, 2):
        shifted = [r.arrival_ms for r in three if r.tenant == k]
        assert np.allclose(np.array(shifted) - [r.arrival_ms for r in one], k * gap / 3)
    assert {r.tenant for r in three[:30]} == {0, 1, 2}
    # The namespace keeps copies apart: K copies reuse exactly K times what one copy does.
    s1, s3 = reuse_stats(one), reuse_stats(three)
    assert (s3.input_tokens, s3.reused_global) == (3 * s1.input_tokens, 3 * s1.reused_global)
    assert not three[0].hash_ids().flags.writeable


# --------------------------------------------------------------------------------------------
# Reuse statistics


def trace_request(i: int, region: str, ids: list[int], n_in: int, namespace: str = "public") -> Request:
    arr = np.array(ids, dtype=np.uint64)
    return Request(i, float(i), region, 0, namespace, n_in, 1, 16, i, -1, TraceBlocks(arr))


def test_reuse_stats_by_hand() -> None:
    reqs = [
        trace_request(0, "us", [1, 2, 3], 48),
        trace_request(1, "us", [1, 2, 4], 40),  # 32 reused (blocks 1, 2), same region
        trace_request(2, "eu", [1, 2], 20),  # 20 reused globally, 0 in eu
        trace_request(3, "eu", [1, 2, 3], 48),  # 48 globally; in eu only 16 + 4 (the partial block)
        trace_request(4, "eu", [1, 2, 3], 48, namespace="other"),  # another namespace: nothing
        trace_request(5, "us", [9, 2, 3], 48),  # same block ids after a different first: no prefix
    ]
    s = reuse_stats(reqs)
    assert (s.requests, s.input_tokens) == (6, 48 + 40 + 20 + 48 + 48 + 48)
    assert s.reused_global == 32 + 20 + 48
    assert s.reused_same_region == 32 + 0 + 20
    assert s.remote_only_fraction == pytest.approx((48 + 20 - 20) / s.input_tokens)


@pytest.mark.skipif(not any(p.is_dir() for p in (ROOT.parent / "shared" / "data" / "traces",)), reason="../shared/data/traces is absent")
def test_real_conversation_trace() -> None:
    reqs = load_mooncake("conversation", regions=REGIONS, seed=0)
    assert len(reqs) == 12031
    assert all(int(r.hash_ids()[0]) == 0 for r in reqs)
    assert sum(r.input_length for r in reqs) / len(reqs) == pytest.approx(12035, abs=1)
    s = reuse_stats(reqs)
    # The data README measures 0.366 block reuse with an infinite cache; tokens weigh alike.
    assert 0.33 < s.global_fraction < 0.42
    # Three regions split each session's audience: local reuse is lower, remote-only reuse real.
    assert 0.1 < s.region_fraction < s.global_fraction
    assert s.remote_only_fraction > 0.05


def test_find_trace(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "traces").mkdir()
    target = write_trace(tmp_path / "traces" / "tiny_trace.jsonl", [row(0, 20, [1, 2])])
    monkeypatch.setenv("KVCOMPASS_DATA", str(tmp_path))
    assert find_trace("tiny") == target.resolve()
    assert resolve_trace("tiny") == target.resolve()
    assert resolve_trace(target) == target
    with pytest.raises(FileNotFoundError, match=r"'nope' not found.*conversation.*looked at: .*nope_trace\.jsonl"):
        find_trace("nope")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        resolve_trace(tmp_path / "missing.jsonl")
    with pytest.raises(InvalidArgumentError, match="plain name"):
        find_trace("../etc/passwd")


# --------------------------------------------------------------------------------------------
# Synthetic Mixed


def synth(n: int = 600, **kw: Any) -> list[Request]:
    args: dict[str, Any] = {"regions": REGIONS, "seed": 4, "tenants": 5, "rate": 20.0} | kw
    return synthetic_mixed(n, **args)


def digest(reqs: list[Request]) -> str:
    h = hashlib.sha256()
    for r in reqs:
        h.update(repr(r._scalars()).encode())
        h.update(r.hash_ids().tobytes())
    return h.hexdigest()


def test_synthetic_is_deterministic_for_a_seed() -> None:
    a, b = synth(), synth()
    assert a == b and digest(a) == digest(b)
    assert synth(seed=5) != a
    # Stable across processes too (no salted hash(), no clocks).
    code = (
        "import hashlib; from kvcompass.sim.workload import synthetic_mixed\n"
        "h = hashlib.sha256()\n"
        "for r in synthetic_mixed(600, regions=('us','eu','ap'), seed=4, tenants=5, rate=20.0):\n"
        "    h.update(repr(r._scalars()).encode()); h.update(r.hash_ids().tobytes())\n"
        "print(h.hexdigest())"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == digest(a)


def test_synthetic_shape() -> None:
    reqs = synth(2000, tenants=3)
    kinds = Counter(r.kind for r in reqs)
    assert abs(kinds["tool"] / 2000 - 0.50) < 0.05 and abs(kinds["coding"] / 2000 - 0.45) < 0.05 and kinds["docqa"] > 40
    assert [r.id for r in reqs] == list(range(2000))
    for r in reqs:
        assert r.n_blocks == math.ceil(r.input_length / 16) and r.block_size == 16
        assert r.output_length >= 8 and r.namespace == "public"
        if r.kind == "docqa":
            assert r.input_length >= 8192 + 300
    assert {r.tenant for r in reqs} == {0, 1, 2}
    g = gaps(reqs)
    assert abs(g.mean() - 50.0) < 5.0  # Poisson at 20 req/s


def test_synthetic_multi_turn_prompts_grow() -> None:
    reqs = synth(800)
    by_id = {r.id: r for r in reqs}
    follow = [r for r in reqs if not r.is_root]
    assert len(follow) > 100 and all(r.kind == "tool" for r in follow)
    for r in follow[:60]:
        p = by_id[r.parent]
        assert (p.region, p.tenant, p.session) == (r.region, r.tenant, r.session)
        assert r.input_length > p.input_length + p.output_length - 16
        assert np.array_equal(r.input_tokens()[: p.input_length], p.input_tokens())
        assert r.arrival_ms >= p.arrival_ms


def test_synthetic_tenants_share_tool_preambles_only() -> None:
    reqs = synth(1500, tenants=4)
    first = {(r.kind, r.tenant): set() for r in reqs}  # type: dict[tuple[str, int], set[int]]
    for r in reqs:
        first[(r.kind, r.tenant)].add(int(r.hash_ids()[0]))
    # Tool sessions start with a shared catalogue: the same first blocks across tenants.
    assert len(set.intersection(*(first[("tool", k)] for k in range(4)))) >= 3
    # Everything else starts with the tenant's private system prompt: one first block per
    # tenant, never another tenant's.
    for kind in ("coding", "docqa"):
        per = [first[(kind, k)] for k in range(4) if (kind, k) in first]
        assert all(len(s) == 1 for s in per)
    assert len({next(iter(first[("coding", k)])) for k in range(4)}) == 4


def test_synthetic_shows_substantial_reuse() -> None:
    s = reuse_stats(synth(1000, tenants=1))
    assert s.global_fraction > 0.6
    assert s.region_fraction < s.global_fraction
    # More tenants, more private prefixes: less reuse, but the shared preambles keep some.
    many = reuse_stats(synth(1000, tenants=50))
    assert 0.2 < many.global_fraction < s.global_fraction


def test_synthetic_roundtrips_through_the_trace_schema(tmp_path: Path) -> None:
    reqs = synth(300)
    path = tmp_path / "mixed.jsonl"
    dump_trace(reqs, path)
    back = load_trace(path, 16, regions=REGIONS)
    assert [(r.input_length, r.output_length, r.parent, r.session, r.arrival_ms) for r in back] == [
        (r.input_length, r.output_length, r.parent, r.session, r.arrival_ms) for r in reqs
    ]
    assert all(np.array_equal(a.hash_ids(), b.hash_ids()) for a, b in zip(reqs, back))
    assert reuse_stats(back).reused_global == reuse_stats(reqs).reused_global
    with pytest.raises(InvalidArgumentError, match="namespaces"):
        dump_trace(load_trace(EXCERPT, 512, regions=REGIONS, tenants=2), tmp_path / "x.jsonl")


def test_synthetic_arguments() -> None:
    with pytest.raises(InvalidArgumentError, match="rate"):
        synth(rate=0.0)
    with pytest.raises(InvalidArgumentError, match="n must be"):
        synth(0)
    with pytest.raises(InvalidArgumentError, match="shares"):
        MixedConfig(shares=(0.0, 0.0, 0.0))
    only_code = synth(200, config=MixedConfig(shares=(0.0, 0.0, 1.0)))
    assert {r.kind for r in only_code} == {"coding"}
    # Same sessions whatever the tenant count: only the tenant labels (and prompts) change.
    assert [r.kind for r in synth(300, tenants=1)] == [r.kind for r in synth(300, tenants=7)]


def test_chain_blocks_form_a_prefix_tree() -> None:
    reqs = synth(1000)
    parent_of: dict[int, int] = {}
    for r in reqs:
        ids = r.hash_ids().tolist()
        assert isinstance(r.blocks, ChainBlocks)
        for prev, cur in zip([-1, *ids], ids):
            assert parent_of.setdefault(cur, prev) == prev  # an id always follows the same id


def test_the_package_ships_a_conversation_excerpt_found_last() -> None:
    from kvcompass.sim import workload

    dirs = workload._data_dirs()
    bundled = dirs[-1] / "traces" / "conversation_trace.jsonl"
    assert dirs[-1] == Path(workload.__file__).resolve().parents[1] / "data" and bundled.is_file()
    lines = bundled.read_text().splitlines()
    assert len(lines) == 600
    shared = Path(workload.__file__).resolve().parents[2].parent / "shared" / "data" / "traces" / "conversation_trace.jsonl"
    if shared.is_file():
        with shared.open() as f:
            assert [next(f).rstrip("\n") for _ in range(600)] == lines


def test_shared_timestamps_are_spread_over_their_logging_interval() -> None:
    from kvcompass.sim.workload import spread_ties

    ts = np.array([0, 0, 0, 3000, 3000, 6000, 6000, 6000, 6000], dtype=np.float64)
    out = spread_ties(ts, seed=4)
    assert np.all(np.diff(out) > 0)  # file order kept, no two equal
    assert np.all((out >= ts) & (out < np.array([3000] * 3 + [6000] * 2 + [9000] * 4)))  # last run: the median interval
    assert np.array_equal(out, spread_ties(ts, seed=4)) and not np.array_equal(out, spread_ties(ts, seed=5))
    assert np.array_equal(spread_ties(np.array([0.0, 5.0, 9.0]), seed=1), [0.0, 5.0, 9.0])  # nothing shared: unchanged


def test_load_trace_spreads_ties_when_rescaling_and_keeps_logged_times_in_trace_mode() -> None:
    from kvcompass.sim.workload import load_trace

    path = Path(__file__).parent / "data" / "conversation_excerpt.jsonl"
    kept = load_trace(path, 512, regions=["a", "b"], mode="trace", seed=1)  # trace mode: as logged
    spread = load_trace(path, 512, regions=["a", "b"], mode="trace", ties="spread", seed=1)
    rescaled = load_trace(path, 512, regions=["a", "b"], mode="rescale", rate=10.0, seed=1)  # rescaling spreads
    assert len({r.arrival_ms for r in rescaled}) == len(rescaled)
    assert len({r.arrival_ms for r in kept}) < len(kept)
    assert len({r.arrival_ms for r in spread}) == len(spread)
    # The same requests in the same order, parents always first.
    assert [r.input_length for r in kept] == [r.input_length for r in spread]
    assert all(spread[r.parent].arrival_ms < r.arrival_ms for r in spread if r.parent >= 0)
    with pytest.raises(InvalidArgumentError):
        load_trace(path, 512, regions=["a"], ties="both")  # type: ignore[arg-type]


def test_collector_paused_restores_the_collector() -> None:
    import gc

    from kvcompass.sim.workload import collector_paused

    assert gc.isenabled()
    with collector_paused():
        assert not gc.isenabled()
    assert gc.isenabled()
    with pytest.raises(RuntimeError):
        with collector_paused():
            raise RuntimeError("inside")
    assert gc.isenabled()
    gc.disable()
    try:
        with collector_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()  # a caller's own pause is left as it was
        synthetic_mixed(5, regions=["eu"], seed=1)
        assert not gc.isenabled()
    finally:
        gc.enable()
    synthetic_mixed(5, regions=["eu"], seed=1)
    assert gc.isenabled()


def test_a_workload_of_runs_and_plain_ids_simulates_as_runs_alone() -> None:
    """The simulator hands the engine every prompt's blocks in one flat array: runs of a
    synthetic prompt and plain ids of a trace's, in request order. The same prompts given half
    as runs and half as their ids must give the same run as all of them as runs."""
    import dataclasses

    from kvcompass.sim.engine import SimConfig, Simulator
    from kvcompass.sim.workload import TraceBlocks

    topo = load_topology("paper-64x8")
    reqs = synthetic_mixed(300, regions=topo, seed=5, rate=40.0, block_size=topo.block_size)
    mixed = [dataclasses.replace(r, blocks=TraceBlocks(r.hash_ids())) if i % 3 == 1 else r for i, r in enumerate(reqs)]
    assert sum(isinstance(r.blocks, TraceBlocks) for r in mixed) == 100
    a = Simulator(topo, reqs, "kvcompass", SimConfig(seed=5)).run()
    b = Simulator(topo, mixed, "kvcompass", SimConfig(seed=5)).run()
    assert a.records == b.records and a.requests == b.requests == 300
    np.testing.assert_array_equal(a.load_factor, b.load_factor)
    assert (a.ttft_ms, a.hit_rate, a.cross_region_hit_rate) == (b.ttft_ms, b.hit_rate, b.cross_region_hit_rate)
    assert a.reused_tokens > 0


def test_region_weights_must_sum_to_a_finite_number() -> None:
    """Finite weights whose sum overflows gave NaN shares, and every session went to the last
    region, one weighted 0 included (found in review): refused, naming the rule."""
    from kvcompass.sim.workload import regions_and_cdf

    with pytest.raises(InvalidArgumentError, match="of a finite sum"):
        regions_and_cdf(("us", "eu", "asia"), [1e308, 1e308, 0.0])
    names, cdf = regions_and_cdf(("us", "eu", "asia"), [1e307, 1e307, 0.0])
    assert names == ("us", "eu", "asia") and cdf.tolist() == [0.5, 1.0, 1.0]
