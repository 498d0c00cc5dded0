"""The level plan: the paper's formulas on hand-computed cases, registration as the union over
edges, the table layout, the JSON schema, and that the Rust Router accepts what the plan gives."""

from __future__ import annotations

import copy
import json
from typing import Any

import numpy as np
import pytest

import kvcompass as kc
from kvcompass.discovery.plan import LevelPlan, own_region_levels, remote_levels, round_up
from kvcompass.discovery.topology import BUNDLED_RTT, load_topology, topology_from_dict
from kvcompass.errors import TopologyError, UnknownWorkerError

RTT: dict[str, dict[str, float]] = {
    "a": {"a": 1.0, "b": 100.0, "c": 200.0},
    "b": {"a": 110.0, "b": 2.0, "c": 150.0},
    "c": {"a": 200.0, "b": 150.0, "c": 3.0},
}


def plan_of(**changes: Any) -> LevelPlan:
    d: dict[str, Any] = {
        "rtt_ms": copy.deepcopy(RTT),
        "regions": {"a": {}, "b": {}},
        "workers": [
            {"id": "a0", "region": "a", "beta_ms_per_token": 0.1},
            {"id": "b0", "region": "b", "beta_ms_per_token": 0.05},
        ],
    }
    d.update(changes)
    return LevelPlan(topology_from_dict(d))


# ------------------------------------------------------------------ formulas


def test_round_up() -> None:
    assert round_up(1000, 16) == 1008
    assert round_up(1008, 16) == 1008
    assert round_up(1008.0000000001, 16) == 1008  # float noise must not add a block
    assert round_up(0.0, 16) == 16 and round_up(3, 16) == 16  # at least one block


def test_remote_levels_hand_computed() -> None:
    # n1 = 100 ms / 0.1 ms/token = 1000; steps of n1/2; each rounded up to 16.
    assert remote_levels(100.0, 0.1, levels=6, block_size=16, max_prefix=131072) == (1008, 1504, 2000, 2512, 3008, 3504)


def test_remote_levels_merge_after_rounding() -> None:
    # n1 = 5 tokens: 5, 7.5, 10, 12.5, 15 all round to one block, 17.5 to two.
    assert remote_levels(0.5, 0.1, levels=6, block_size=16, max_prefix=131072) == (16, 32)


def test_remote_levels_drop_lengths_beyond_max_prefix() -> None:
    assert remote_levels(100.0, 0.1, levels=6, block_size=16, max_prefix=2500) == (1008, 1504, 2000)


def test_own_region_levels_double_from_the_rounded_minimum() -> None:
    assert own_region_levels(256, levels=6, block_size=16, max_prefix=131072) == (256, 512, 1024, 2048, 4096, 8192)
    assert own_region_levels(100, levels=3, block_size=16, max_prefix=131072) == (112, 224, 448)
    assert own_region_levels(256, levels=6, block_size=16, max_prefix=1024) == (256, 512, 1024)


def test_own_region_levels_with_steps_per_doubling() -> None:
    # 256 * 2**(k/4) rounded up to the block: 304.4 -> 320, 362.0 -> 368, 430.5 -> 432, 512, ...
    four = own_region_levels(256, levels=6, block_size=16, max_prefix=131072, steps=4)
    assert four[:9] == (256, 320, 368, 432, 512, 624, 736, 864, 1024)
    assert four[-5:] == (4096, 4880, 5808, 6896, 8192) and len(four) == 21
    # The same first and last lengths, every doubling length kept: the finer ladder only adds.
    assert set(own_region_levels(256, levels=6, block_size=16, max_prefix=131072)) < set(four)
    # The under-credit of an own-region match is bounded by the step (plus a block's rounding).
    for m in range(256, 8193, 37):
        credited = max(c for c in four if c <= m)
        assert (m - credited) / m <= 1 - 2 ** (-1 / 4) + 16 / 256
    assert own_region_levels(256, levels=6, block_size=16, max_prefix=1000, steps=2) == (256, 368, 512, 736)


# ------------------------------------------------------------------ plan


def test_remote_n1_is_rtt_over_the_target_regions_beta() -> None:
    p = plan_of(long_tail=False)
    # a -> b: RTT 100 ms (the round trip, not one-way), beta_b 0.05: n1 = 2000.
    assert p.n1("a", "b") == pytest.approx(2000.0)
    assert p.lengths("a", "b") == (2000, 3008, 4000, 5008, 6000, 7008)
    # b -> a: RTT 110 ms in that direction, beta_a 0.1: n1 = 1100.
    assert p.lengths("b", "a") == (1104, 1664, 2208, 2752, 3312, 3856)


def test_own_region_uses_the_minimum_not_n1() -> None:
    p = plan_of(long_tail=False)
    assert p.lengths("a", "a") == p.lengths("b", "b") == (256, 512, 1024, 2048, 4096, 8192)


def test_long_tail_continues_every_ladder_with_the_doubling_lengths() -> None:
    p = plan_of(tail_steps=1)  # the tail before 2026-12-07: doubling
    tail = (16384, 32768, 65536, 131072)
    assert p.lengths("a", "a") == (256, 512, 1024, 2048, 4096, 8192) + tail
    # Remote: the paper's six n1 steps, then the doubling lengths above the last of them.
    assert p.lengths("a", "b") == (2000, 3008, 4000, 5008, 6000, 7008, 8192) + tail
    assert p.lengths("b", "a") == (1104, 1664, 2208, 2752, 3312, 3856, 4096, 8192) + tail
    # The remote tail is made of lengths the region registers for its own edge anyway.
    paper = plan_of(long_tail=False)
    for r in ("a", "b"):
        assert set(p.registration(r)) - set(paper.registration(r)) == set(tail)


def test_long_tail_has_four_lengths_per_doubling_by_default() -> None:
    p = plan_of()
    # 8192 * 2**(k/4), rounded up to the 16-token block: 9741.6 -> 9744, 11585.2 -> 11600, ...
    first = (9744, 11600, 13792, 16384, 19488, 23184, 27568, 32768)
    own = p.lengths("a", "a")
    assert own[:14] == (256, 512, 1024, 2048, 4096, 8192) + first
    assert own[-1] == 131072 and len(own) == 6 + 4 * 4
    # Every doubling length of the old tail is still there, so the finer tail only adds.
    assert set(plan_of(tail_steps=1).lengths("a", "a")) < set(own)
    # Toward a remote region the same lengths follow its own six; none added for it alone.
    assert p.lengths("a", "b") == (2000, 3008, 4000, 5008, 6000, 7008, 8192) + own[6:]
    paper = plan_of(long_tail=False)
    for r in ("a", "b"):
        assert set(p.registration(r)) - set(paper.registration(r)) == set(own[6:])
    # The under-credit of a long match is bounded by the step: at most 1 - 2**(-1/4) of it.
    for m in range(8192, 131073, 97):
        credited = max(c for c in own if c <= m)
        assert (m - credited) / m <= 1 - 2 ** (-1 / 4) + 16 / 8192


def test_long_tail_stops_at_max_prefix() -> None:
    p = plan_of(max_prefix=20000, tail_steps=1)
    assert p.lengths("a", "a") == (256, 512, 1024, 2048, 4096, 8192, 16384)
    assert p.lengths("a", "b")[-2:] == (8192, 16384)
    assert plan_of(max_prefix=20000).lengths("a", "a")[-4:] == (11600, 13792, 16384, 19488)


def test_long_tail_must_be_a_boolean() -> None:
    with pytest.raises(TopologyError, match="long_tail must be true or false"):
        plan_of(long_tail="yes")


def test_no_tail_toward_a_region_where_no_match_pays() -> None:
    # n1 = 250 ms / 0.03 ms/token = 8334 > max_prefix 8192: the paper's ladder toward b is
    # empty, and the tail must not fill it with the own ladder (found in review: 256..8192
    # queried and registered toward a region no crossing pays for).
    rtt = {"a": {"a": 1.0, "b": 250.0}, "b": {"a": 250.0, "b": 1.0}}
    workers = [{"id": "a0", "region": "a"}, {"id": "b0", "region": "b", "beta_ms_per_token": 0.03}]
    p = plan_of(rtt_ms=rtt, regions={"a": {}, "b": {"edges": 0}}, workers=workers, max_prefix=8192)
    assert p.lengths("a", "b") == () and p.registration("b") == ()
    assert p.lengths("a", "a") == (256, 512, 1024, 2048, 4096, 8192)


def test_tail_steps_with_the_tail_off_is_refused() -> None:
    with pytest.raises(TopologyError, match="long_tail = false"):
        plan_of(long_tail=False, tail_steps=2)
    assert plan_of(tail_steps=2).topology.tail_steps == 2


def test_value_bits_must_be_an_integer() -> None:
    import dataclasses

    t = plan_of().topology
    with pytest.raises(TopologyError, match="value_bits must be 32 or 64"):
        dataclasses.replace(t, value_bits=32.0)


@pytest.mark.parametrize("bad", [0, 17, -1, True, 2.0, "4"])
def test_tail_steps_must_be_an_integer_in_range(bad: Any) -> None:
    with pytest.raises(TopologyError, match="tail_steps must be an integer"):
        plan_of(tail_steps=bad)


def test_options_shape_the_plan() -> None:
    p = plan_of(block_size=64, levels=3, own_region_min=100, long_tail=False)
    assert p.lengths("a", "a") == (128, 256, 512)
    assert p.lengths("a", "b") == (2048, 3008, 4032)


def test_region_beta_is_the_mean_over_indexed_workers() -> None:
    workers = [
        {"id": "a0", "region": "a", "beta_ms_per_token": 0.1, "role": "prefill"},
        {"id": "b0", "region": "b", "beta_ms_per_token": 0.1, "role": "prefill"},
        {"id": "b1", "region": "b", "beta_ms_per_token": 0.3, "role": "prefill"},
        {"id": "b2", "region": "b", "beta_ms_per_token": 9.0, "role": "decode"},  # not indexed
    ]
    p = plan_of(workers=workers)
    assert p.beta("b") == pytest.approx(0.2)
    assert p.lengths("a", "b")[0] == round_up(100.0 / 0.2, 16)


def test_registration_is_the_union_over_edges() -> None:
    p = plan_of(regions={"a": {}, "b": {}, "c": {}}, workers=[{"id": "c0", "region": "c"}, {"id": "a0", "region": "a"}])
    for r in ("a", "c"):
        union = sorted({c for o in p.edge_regions for c in p.lengths(o, r)})
        assert list(p.registration(r)) == union
        assert all(set(p.lengths(o, r)) <= set(p.registration(r)) for o in p.edge_regions)
    assert p.registration("b") == ()  # an edge-only region registers nothing


def test_a_region_without_edges_queries_nothing_but_is_found() -> None:
    p = plan_of(regions={"a": {}, "b": {"edges": 0}})
    assert p.edge_regions == ("a",)
    assert p.registration("b") == p.lengths("a", "b")  # only a's edge queries toward b
    assert p.registration("a") == p.lengths("a", "a")
    with pytest.raises(TopologyError, match=r"region 'b' runs no edge"):
        p.lengths("b", "a")


def test_unknown_regions_are_errors() -> None:
    p = plan_of()
    for call in (lambda: p.lengths("a", "z"), lambda: p.lengths("z", "a"), lambda: p.registration("z"), lambda: p.beta("z")):
        with pytest.raises(TopologyError, match=r"region 'z' is not defined"):
            call()


def test_testbed_plan_from_the_bundled_matrix() -> None:
    p = LevelPlan(load_topology("testbed-14x3", rtt_path=BUNDLED_RTT))
    tail = (4096, 8192) + tuple(round_up(8192 * 2 ** (k / 4), 16) for k in range(1, 17))
    # us-east-1 <-> eu-central-1: 92.905 ms / 0.085 ms/token = 1093 tokens.
    assert p.lengths("us", "eu") == (1104, 1648, 2192, 2736, 3280, 3840) + tail
    assert p.lengths("eu", "us") == p.lengths("us", "eu")  # symmetric matrix, equal betas
    assert p.lengths("asia", "asia") == (256, 512, 1024, 2048) + tail
    assert all(c % 16 == 0 for o in p.edge_regions for r in p.target_regions for c in p.lengths(o, r))
    assert len(p.registration("us")) == 18 + 16  # the paper's 18, and the own ladder's tail past 8k (four a doubling)


# ------------------------------------------------------------------ layout


def big(n: int, value_bits: int) -> LevelPlan:
    workers = [{"id": "a0", "region": "a"}] + [{"id": f"b{i}", "region": "b"} for i in range(n)]
    return plan_of(workers=workers, value_bits=value_bits)


def test_layout_groups_of_16_for_u32() -> None:
    lay = big(30, 32).layout()
    assert [(t.table_id, t.region, len(t.workers)) for t in lay.tables] == [(0, "a", 1), (1, "b", 16), (2, "b", 14)]
    assert lay.tables[2].workers[0] == "b16"  # worker order kept
    assert lay.field_of("b17").table_id == 2 and lay.field_of("b17").field == 1


def test_layout_groups_of_32_for_u64() -> None:
    lay = big(33, 64).layout()
    assert [len(t.workers) for t in lay.tables] == [1, 32, 1] and lay.value_bits == 64


def test_layout_carries_shards_and_fingerprints() -> None:
    lay = plan_of(shards=3, fp_bits=0).layout()
    assert (lay.shards, lay.fp_bits, lay.value_bits) == (3, 0, 32)


def test_disaggregated_layout_indexes_only_prefill_workers() -> None:
    p = LevelPlan(load_topology("testbed-pd-10x3", rtt_path=BUNDLED_RTT))
    lay = p.layout()
    assert len(lay.workers) == 7 and all("-p" in w for w in lay.workers)
    with pytest.raises(UnknownWorkerError):
        lay.field_of("us-d0")


def test_decode_only_region_is_not_a_target() -> None:
    p = plan_of(workers=[{"id": "a0", "region": "a", "role": "prefill"}, {"id": "b0", "region": "b", "role": "decode"}])
    assert p.target_regions == ("a",)
    assert p.lengths("a", "b") == () and p.registration("b") == ()
    # An edge in b still has its own-region ladder: its shortest length names prefix families.
    assert p.lengths("b", "b") == p.lengths("a", "a") != ()
    assert p.router_plan("b") == [list(p.lengths("b", "a")), list(p.lengths("b", "b"))]


@pytest.mark.parametrize(("name", "tables"), [("testbed-14x3", 3), ("paper-64x8", 8), ("paper-128x16", 16)])
def test_builtin_layouts(name: str, tables: int) -> None:
    p = LevelPlan(load_topology(name, rtt_path=BUNDLED_RTT))
    lay = p.layout()
    assert len(lay.tables) == tables  # one table per region
    assert [t.region for t in lay.tables] == list(p.topology.region_names)
    assert len(lay.workers) == len(p.topology.workers)


# ------------------------------------------------------------------ JSON


def test_to_json_schema() -> None:
    p = LevelPlan(load_topology("testbed-pd-10x3", rtt_path=BUNDLED_RTT))
    j = json.loads(json.dumps(p.to_json()))
    assert {"block_size", "beta_ms_per_token", "rtt_ms", "plan", "registration", "tables"} <= set(j)
    assert j["block_size"] == 16
    assert j["beta_ms_per_token"] == {"us": 0.085, "eu": 0.085, "asia": 0.085}
    assert j["rtt_ms"]["us"]["eu"] == 92.905 and j["rtt_ms"]["us"]["us"] == 5.506
    assert j["plan"]["eu"]["us"] == list(p.lengths("eu", "us"))
    assert j["registration"]["asia"] == list(p.registration("asia"))
    assert j["tables"] == {"us": [["us-p0", "us-p1", "us-p2"]], "eu": [["eu-p0", "eu-p1"]], "asia": [["asia-p0", "asia-p1"]]}
    assert (j["value_bits"], j["shards"], j["levels"]) == (32, 4, 6)


def test_to_json_keys_follow_edges_and_targets() -> None:
    p = plan_of(regions={"a": {}, "b": {"edges": 0}, "c": {}}, workers=[{"id": "a0", "region": "a"}, {"id": "b0", "region": "b"}])
    j = p.to_json()
    assert list(j["plan"]) == ["a", "c"]  # edge regions
    assert list(j["plan"]["c"]) == ["a", "b"]  # regions with indexed workers
    assert list(j["tables"]) == ["a", "b"] and j["tables"]["b"] == [["b0"]]


# ------------------------------------------------------------------ the Rust router accepts the plan


def test_router_finds_a_holder_with_the_plan_and_layout(namespace: kc.Namespace, rng: np.random.Generator) -> None:
    p = LevelPlan(load_topology("testbed-pd-10x3", rtt_path=BUNDLED_RTT))
    t = p.topology
    lay = p.layout()
    names = list(lay.workers)
    writers = {(s.table_id, sh): kc.LudoTable(s.table_id, sh, capacity=256, value_bits=lay.value_bits, fp_bits=lay.fp_bits) for s in lay.tables for sh in range(lay.shards)}
    views = {k: kc.LudoView(*k) for k in writers}
    for k, w in writers.items():
        views[k].apply_batch(w.export_snapshot())
    tokens = rng.integers(0, 100_000, size=6000, dtype=np.uint32)
    holder = "eu-p1"
    ref = lay.field_of(holder)
    keys = namespace.keys(tokens, p.registration("eu"))
    for key in keys[keys != kc.NO_KEY]:
        writers[(ref.table_id, kc.shard_of(int(key), lay.shards))].set_field(int(key), ref.field, int(kc.Tier.VRAM))
    for k, w in writers.items():
        b = w.take_batch()
        if b is not None:
            views[k].apply_batch(b)
    region = np.array([t.region_index(next(w.region for w in t.workers if w.id == n)) for n in names], dtype=np.uint32)
    tables = [(t.region_index(s.region), np.array([names.index(n) for n in s.workers], dtype=np.uint32), [views[(s.table_id, sh)] for sh in range(lay.shards)]) for s in lay.tables]
    for edge in p.edge_regions:
        router = kc.Router(p.router_plan(edge), tables)
        zeros = np.zeros(len(names))
        res = router.route(tokens, namespace.digest, region, np.full(len(names), 0.085), zeros, zeros, np.ones(len(names)))
        # The holder is found at the longest length this edge queries toward eu that fits.
        want = max(c for c in p.lengths(edge, "eu") if c <= len(tokens))
        assert int(res.matches[names.index(holder)]) == want
        assert res.winner == names.index(holder)


def test_own_steps_refine_the_own_ladder_and_the_remote_tails_above_their_six() -> None:
    p, paper = plan_of(own_steps=4), plan_of()
    own = p.lengths("a", "a")
    assert own[:21] == own_region_levels(256, levels=6, block_size=16, max_prefix=131072, steps=4)
    assert own[21:] == paper.lengths("a", "a")[6:]  # the long tail is unchanged
    # Toward b: the paper's six n1 steps, then the own lengths above the last of them.
    assert p.lengths("a", "b") == (2000, 3008, 4000, 5008, 6000, 7008) + tuple(c for c in own if c > 7008)
    assert p.topology.own_steps == 4


@pytest.mark.parametrize("bad", [0, 17, -1, True, 2.0, "4"])
def test_own_steps_must_be_an_integer_in_range(bad: Any) -> None:
    with pytest.raises(TopologyError, match="own_steps must be an integer"):
        plan_of(own_steps=bad)
