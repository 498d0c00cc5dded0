"""The worker agent: keys, tiers, incarnations, gaps and replays, refusals, and a model check.

The model check runs random store / remove / clear / restart histories through a reference
engine (a block cache keyed by content that publishes vLLM-format messages), delivers them
with losses, late arrivals and re-deliveries, serves the agent's replay requests from the
engine's ring, and checks that the key ops the agent emitted, applied to a plain dict, hold
exactly the keys (with tiers) that the engine's cache implies.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest
from hypothesis import event, given, note
from hypothesis import settings as hsettings
from hypothesis import strategies as st

import kvcompass as kc
from kvcompass.agent import (
    AgentOutput,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EngineBatch,
    ReplayRequest,
    WorkerAgent,
    boot_incarnation,
    encode_batch,
    encode_replay,
    encode_replay_end,
    medium_tier,
)
from kvcompass.discovery.layout import IndexLayout, TableSpec
from kvcompass.discovery.maintenance import MaintenanceUnit
from kvcompass.discovery.key_ops import KeyOpBatch
from kvcompass.errors import AgentSequenceError, InvalidArgumentError, InvalidEventError, StaleIncarnationError

NS = kc.Namespace("llama-3.1-8b", "public")
FIXTURES = json.loads((Path(__file__).parent / "fixtures" / "engine_messages.json").read_text())["streams"]


def frames_of(m: dict[str, Any]) -> list[bytes]:
    return [bytes.fromhex(f) for f in m["frames"]]


def keys_of(tokens: list[int], lengths: list[int]) -> list[int]:
    return [int(k) for k in NS.keys(np.array(tokens, dtype=np.uint32), [c for c in lengths if c <= len(tokens)])]


class Sink:
    """A maintenance unit's view of one worker: applies batches, checking their sequencing."""

    def __init__(self, shards: int) -> None:
        self.shards = shards
        self.keys: dict[int, int] = {}
        self.incarnation: int | None = None
        self.next: dict[int, int] = {}

    def apply(self, batches: tuple[KeyOpBatch, ...] | AgentOutput) -> None:
        if isinstance(batches, AgentOutput):
            batches = batches.batches
        for b in batches:
            if b.incarnation != self.incarnation:
                assert self.incarnation is None or b.incarnation > self.incarnation
                self.incarnation, self.next = b.incarnation, {}
            assert b.seq == self.next.get(b.shard, 1), (b.shard, b.seq, self.next)
            assert b.reset or b.seq > 1  # an incarnation opens every shard with a reset
            self.next[b.shard] = b.seq + 1
            if b.reset:
                self.keys = {k: t for k, t in self.keys.items() if k % self.shards != b.shard}
            for k, t in zip(b.keys.tolist(), b.tiers.tolist()):
                assert kc.shard_of(k, self.shards) == b.shard
                if t:
                    self.keys[k] = t
                else:
                    self.keys.pop(k, None)


def agent(lengths: list[int], shards: int = 3, **kw: Any) -> WorkerAgent:
    return WorkerAgent("w0", NS, lengths, shards, **kw)


def msg(seq: int, *events: Any, ts: float | None = None, **kw: Any) -> list[bytes]:
    return encode_batch(list(events), seq, float(seq) if ts is None else ts, **kw)


T = list(range(1000, 1016))
LENGTHS = [1, 3, 4, 6, 8, 10, 12, 16]


def tiers(sink: Sink, tokens: list[int], lengths: list[int]) -> list[int]:
    return [sink.keys.get(k, 0) for k in keys_of(tokens, lengths)]


# ---- keys -----------------------------------------------------------------------------------


def test_keys_are_prefix_keys_at_registration_lengths_only() -> None:
    a, sink = agent(LENGTHS, shards=3), Sink(3)
    out = a.on_message(msg(0, BlockStored((1, 2, 3), None, tuple(T[:12]), 4)))
    assert out.replay is None
    sink.apply(out)
    assert [b.shard for b in out.batches] == [0, 1, 2] and all(b.reset and b.seq == 1 for b in out.batches)
    expect = dict.fromkeys(keys_of(T[:12], LENGTHS), 1)
    assert sink.keys == expect == {k: int(t) for k, t in a.held().items()}
    assert len(expect) == 7  # 1, 3, 4, 6, 8, 10, 12
    out = a.on_message(msg(1, BlockStored((4,), 3, tuple(T[12:16]), 4)))
    sink.apply(out)
    assert sink.keys == dict.fromkeys(keys_of(T, LENGTHS), 1)
    assert sum(len(b.keys) for b in out.batches) == 1  # only length 16 is new
    assert all(b.seq == 2 and not b.reset for b in out.batches)


def test_in_block_lengths_and_unaligned_blocks() -> None:
    # SGLang cuts a node into pages; the last one may be short, so block sizes vary.
    a, sink = agent(LENGTHS), Sink(3)
    sink.apply(a.on_message(msg(0, BlockStored((1,), None, tuple(T[:5]), 5), BlockStored((2,), 1, tuple(T[5:7]), 2))))
    sink.apply(a.on_message(msg(1, BlockStored((3, 4), 2, tuple(T[7:13]), 3))))
    assert sink.keys == dict.fromkeys(keys_of(T[:13], LENGTHS), 1)


def test_fixture_vllm_stream_offload_eviction_and_restart() -> None:
    a, sink = agent(LENGTHS, shards=2), Sink(2)
    s = [frames_of(m) for m in FIXTURES["vllm_map"]]
    sink.apply(a.on_message(s[0]))
    assert tiers(sink, T, LENGTHS) == [1, 1, 1, 1, 1, 0, 0, 0]
    sink.apply(a.on_message(s[1]))  # block 2 on the GPU; blocks 0-1 also copied to the CPU
    assert tiers(sink, T, LENGTHS) == [1, 1, 1, 1, 1, 1, 1, 0]
    sink.apply(a.on_message(s[2]))  # block 2 evicted; blocks 0-1 leave the GPU but stay on the CPU
    assert tiers(sink, T, LENGTHS) == [2, 2, 2, 2, 2, 0, 0, 0]
    assert a.incarnation == 1 and a.last_seq == 2
    out = a.on_message(s[3])  # seq 0 again: the engine restarted
    sink.apply(out)
    assert a.incarnation == 2 and a.stats.restarts == 1
    assert [(b.shard, b.seq, b.reset, b.incarnation) for b in out.batches] == [(0, 1, True, 2), (1, 1, True, 2)]
    u = list(range(2000, 2008))
    assert sink.keys == dict.fromkeys(keys_of(u[:4], LENGTHS), 1)
    sink.apply(a.on_message(s[4]))  # the new engine reuses an old hash value for new content
    assert sink.keys == dict.fromkeys(keys_of(u, LENGTHS), 1)


def test_fixture_gap_filled_by_replay_applies_in_order() -> None:
    a, sink = agent(LENGTHS, shards=2), Sink(2)
    s = [frames_of(m) for m in FIXTURES["vllm_array"]]
    sink.apply(a.on_message(s[0]))
    sink.apply(a.on_message(s[1]))
    assert tiers(sink, T, LENGTHS) == [1, 1, 1, 1, 1, 0, 0, 0]
    out = a.on_message(s[2])  # seq 3: seq 2 was lost
    assert out.replay == ReplayRequest(2) and out.batches == ()
    assert out.replay.frame() == (2).to_bytes(8, "big")
    assert a.replay_pending == ReplayRequest(2) and a.buffered == 1 and a.stats.gaps == 1
    before = dict(sink.keys)
    out = a.on_replay(s[3])  # seq 2 stores blocks 2-3, then buffered seq 3 removes block 1 and clears
    sink.apply(out)
    assert a.last_seq == 3 and a.buffered == 0 and a.replay_pending is None
    assert sink.keys == {} and set(k for b in out.batches for k in b.keys.tolist()) == set(before)
    assert a.on_replay(s[4]).batches == () and a.stats.duplicates == 1
    assert a.on_replay(s[5]) == AgentOutput()
    assert a.stats.resyncs == 0


def test_fixture_sglang_signed_hashes_short_page_and_clear() -> None:
    a, sink = agent(LENGTHS), Sink(3)
    s = [frames_of(m) for m in FIXTURES["sglang"]]
    sink.apply(a.on_message(s[0]))
    assert sink.keys == dict.fromkeys(keys_of(T[:11], LENGTHS), 1)
    sink.apply(a.on_message(s[1]))  # the last two pages evicted, leaf first
    assert sink.keys == dict.fromkeys(keys_of(T[:4], LENGTHS), 1)
    sink.apply(a.on_message(s[2]))
    assert sink.keys == {} and len(a) == 0 and a.stats.clears == 1


def test_fixture_lora_and_extra_keys_blocks_are_not_indexed() -> None:
    a, sink = agent(LENGTHS), Sink(3)
    sink.apply(a.on_message(frames_of(FIXTURES["vllm_bytes"][0])))
    assert sink.keys == dict.fromkeys(keys_of(T[:8], LENGTHS), 1)
    assert a.stats.unindexed == 1 and a.stats.unknown_removals == 0


# ---- tiers and chains ------------------------------------------------------------------------


def test_medium_tier_mapping() -> None:
    assert [medium_tier(m) for m in (None, "GPU", "gpu", "CPU", "CPU_PINNED", "cpu", "DISK", "LMCACHE", "")] == [1, 1, 1, 2, 2, 2, 0, 0, 0]


def test_tier_is_worst_along_the_chain_and_best_across_media() -> None:
    a, sink = agent(LENGTHS), Sink(3)
    sink.apply(a.on_message(msg(0, BlockStored((1, 2), None, tuple(T[:8]), 4, medium="GPU"))))
    sink.apply(a.on_message(msg(1, BlockStored((1,), None, tuple(T[:4]), 4, medium="CPU"), BlockRemoved((1,), "GPU"))))
    assert tiers(sink, T[:8], LENGTHS) == [2, 2, 2, 2, 2]  # block 2 is on the GPU, but block 1 needs a reload
    sink.apply(a.on_message(msg(2, BlockStored((1,), None, tuple(T[:4]), 4))))  # back on the GPU (no medium: GPU)
    assert tiers(sink, T[:8], LENGTHS) == [1, 1, 1, 1, 1]
    sink.apply(a.on_message(msg(3, BlockStored((2,), 1, tuple(T[4:8]), 4, medium="DISK"), BlockRemoved((2,), None))))
    assert tiers(sink, T[:8], LENGTHS) == [1, 1, 1, 0, 0]  # disk is not indexed
    assert a.stats.unknown_removals == 0


def test_memory_bytes_counts_the_forest_blocks() -> None:
    # The forest lives in Rust, out of a heap profiler's sight: memory_bytes is how the
    # simulator's memory figures see it. 4,000 blocks cost at least their records.
    a = agent(LENGTHS)
    empty = a.memory_bytes
    toks = list(range(4 * 4000))
    a.on_message(msg(0, BlockStored(tuple(range(1, 4001)), None, tuple(toks), 4)))
    assert len(a) == 4000
    assert a.memory_bytes >= empty + 4000 * 100
    assert a.memory_bytes < empty + 4000 * 1000


def test_a_block_held_by_many_media_stays_until_the_last_lets_go() -> None:
    # The forest keeps the first 64 media of a block as bits and any further ones beside it: a
    # block held only by the 70th medium is still held, and goes with that medium's removal.
    a, sink = agent(LENGTHS), Sink(3)
    names = ["GPU", *(f"EXTRA{i}" for i in range(69))]
    for i, m in enumerate(names):
        sink.apply(a.on_message(msg(i, BlockStored((1,), None, tuple(T[:4]), 4, medium=m))))
    assert tiers(sink, T[:4], LENGTHS) == [1, 1, 1]
    n = len(names)
    sink.apply(a.on_message(msg(n, *(BlockRemoved((1,), m) for m in names[:-1]))))
    assert tiers(sink, T[:4], LENGTHS) == [0, 0, 0] and len(a) == 1  # EXTRA68 (not indexed) still holds it
    sink.apply(a.on_message(msg(n + 1, BlockRemoved((1,), names[-1]))))
    assert len(a) == 0 and a.stats.unknown_removals == 0


def test_interior_eviction_withdraws_descendants_until_restored() -> None:
    a, sink = agent(LENGTHS), Sink(3)
    sink.apply(a.on_message(msg(0, BlockStored((1, 2, 3), None, tuple(T[:12]), 4))))
    sink.apply(a.on_message(msg(1, BlockRemoved((1,)))))
    assert tiers(sink, T[:12], LENGTHS) == [0] * 7 and len(a) == 3  # block 1 stays as a tombstone
    sink.apply(a.on_message(msg(2, BlockStored((1,), None, tuple(T[:4]), 4, medium="CPU"))))
    assert tiers(sink, T[:12], LENGTHS) == [2] * 7
    sink.apply(a.on_message(msg(3, BlockRemoved((1,), "CPU"), BlockRemoved((3,)), BlockRemoved((2,)))))
    assert sink.keys == {} and len(a) == 0  # tombstones go with their last child


def test_orphans_are_keyed_when_their_parent_arrives() -> None:
    a, sink = agent(LENGTHS), Sink(3)
    sink.apply(a.on_message(msg(0, BlockStored((3,), 2, tuple(T[8:12]), 4), BlockStored((2,), 1, tuple(T[4:8]), 4))))
    assert sink.keys == {} and a.stats.orphans == 2
    sink.apply(a.on_message(msg(1, BlockStored((1,), None, tuple(T[:4]), 4))))
    assert sink.keys == dict.fromkeys(keys_of(T[:12], LENGTHS), 1) and a.stats.adopted == 2


def test_orphan_removed_before_adoption_is_forgotten() -> None:
    a = agent(LENGTHS)
    a.on_message(msg(0, BlockStored((2,), 1, tuple(T[4:8]), 4)))
    a.on_message(msg(1, BlockRemoved((2,))))
    assert len(a) == 0
    a.on_message(msg(2, BlockStored((1,), None, tuple(T[:4]), 4)))
    assert set(a.held()) == set(keys_of(T[:4], LENGTHS)) and a.stats.adopted == 0


def test_removals_given_as_arrays_act_as_tuples() -> None:
    """The simulator hands a removal's hashes over as the emulated engine's uint64 array
    (``PrefixCache.events_from_core(token_arrays=True)``): the same run as the tuples, events
    in a run mixed with tuple ones, a second medium and a group included."""
    outs = []
    for as_array in (False, True):
        a = agent(LENGTHS)
        a.on_batch(EngineBatch(0, 0.0, (BlockStored((1, 2, 3), None, tuple(T[:12]), 4), BlockStored((1, 2), None, tuple(T[:8]), 4, medium="CPU")), digest=b"0"))
        hashes = np.array([3, 2], dtype=np.uint64) if as_array else (3, 2)
        out = a.on_batch(EngineBatch(1, 1.0, (BlockRemoved(hashes), BlockRemoved((2,), medium="CPU"), BlockRemoved(np.array([9], dtype=np.uint64) if as_array else (9,), group_idx=1)), digest=b"1"))
        outs.append(([(b.shard, b.keys.tolist(), b.tiers.tolist()) for b in out.batches], sorted(a.held().items()), a.stats.unknown_removals))
    assert outs[0] == outs[1]
    assert outs[0][2] == 1 and outs[0][1]  # block 9 unknown; block 1 still held


def test_lora_blocks_and_their_descendants_are_not_indexed() -> None:
    a, sink = agent(LENGTHS), Sink(3)
    sink.apply(a.on_message(msg(0, BlockStored((1,), None, tuple(T[:4]), 4, lora_id=3), BlockStored((2,), 1, tuple(T[4:8]), 4))))
    sink.apply(a.on_message(msg(1, BlockStored((5,), None, tuple(T[:4]), 4, extra_keys=(("img", 1),)))))
    assert sink.keys == {} and a.stats.unindexed == 3
    # an orphan adopted by an unindexed parent is unindexed too
    a.on_message(msg(2, BlockStored((7,), 6, tuple(T[4:8]), 4), BlockStored((6,), None, tuple(T[:4]), 4, lora_name="x")))
    assert a.held() == {} and a.stats.unindexed == 5


def test_same_hash_in_another_group_is_another_block() -> None:
    a = agent(LENGTHS)
    a.on_message(msg(0, BlockStored((1,), None, tuple(T[:4]), 4, group_idx=0), BlockStored((1,), None, tuple(T[:4]), 4, group_idx=1)))
    a.on_message(msg(1, BlockRemoved((1,), group_idx=1)))
    assert set(a.held()) == set(keys_of(T[:4], LENGTHS)) and len(a) == 1


def test_two_chains_with_one_prefix_share_the_key() -> None:
    # the same 8 tokens cut 4+4 (one engine) and as 8 (a different block size): one key, two holders
    a = agent([8])
    a.on_message(msg(0, BlockStored((1, 2), None, tuple(T[:8]), 4), BlockStored((9,), None, tuple(T[:8]), 8, medium="CPU")))
    (k,) = keys_of(T[:8], [8])
    assert a.held() == {k: 1}
    a.on_message(msg(1, BlockRemoved((2,))))
    assert a.held() == {k: 2}
    a.on_message(msg(2, BlockRemoved((9,), "CPU")))
    assert a.held() == {}


def test_engine_oddities_are_counted_not_raised() -> None:
    a = agent(LENGTHS)
    a.on_message(msg(0, BlockStored((1,), None, tuple(T[:4]), 4)))
    d = a.digest()
    a.on_message(msg(1, BlockRemoved((99,)), BlockRemoved((1,), "CPU")))
    assert a.stats.unknown_removals == 2
    a.on_message(msg(2, BlockStored((1, 5), 7, tuple(T[:8]), 4)))  # hash 1 under another parent
    assert a.stats.conflicts == 1 and len(a) == 1
    assert a.digest() != d  # only seq bookkeeping moved
    assert set(a.held()) == set(keys_of(T[:4], LENGTHS))


def test_adoption_cycle_is_refused_quietly() -> None:
    a = agent(LENGTHS)
    a.on_message(msg(0, BlockStored((1,), 2, tuple(T[:4]), 4), BlockStored((2,), 1, tuple(T[4:8]), 4)))
    assert a.held() == {} and a.stats.conflicts == 1
    a.on_message(msg(1, BlockRemoved((1,)), BlockRemoved((2,))))
    a.full_report()


# ---- content hashes (SGLang): one hash, several places ---------------------------------------


def sglang_pages(tokens: list[int], page: int, parent: int | None = None) -> list[BlockStored]:
    """SGLang's events for a new radix node: one BlockStored per page, hashed by content alone,
    each chained to the one before (the first to ``parent``, the last page of the parent node)."""
    out = []
    for s in range(0, len(tokens), page):
        pt = tuple(tokens[s : s + page])
        out.append(BlockStored((hash(pt),), parent, pt, len(pt)))
        parent = hash(pt)
    return out


def sglang_removals(tokens: list[int], page: int) -> list[BlockRemoved]:
    """SGLang's events for an evicted radix node: one BlockRemoved per page, first page first."""
    return [BlockRemoved((hash(tuple(tokens[s : s + page])),)) for s in range(0, len(tokens), page)]


def test_sglang_repeated_token_at_page_size_1_keys_the_true_prefixes() -> None:
    # hash(5) names two pages: the second 5 is its own block, and 8 hangs under it, not under
    # the first 5 (which would claim [5, 8, 9, 10], a prefix the engine never cached)
    toks = [5, 6, 7, 5, 8, 9, 10, 11]
    a = agent([4, 8], shards=1)
    a.on_message(msg(0, *sglang_pages(toks, 1), hash_style="signed"))
    assert set(a.held()) == set(keys_of(toks, [4, 8])) and a.stats.conflicts == 0
    assert not set(a.held()) & set(keys_of([5, 8, 9, 10], [4]))
    assert len(a) == 8 and a.stats.ambiguous_parents == 1  # 8's parent: the later 5


def test_sglang_identical_consecutive_pages_are_accepted_with_the_rest_of_the_batch() -> None:
    a, sink = agent(LENGTHS), Sink(3)
    toks = [1, 2, 3, 4] * 2 + [9] * 4
    other = BlockStored((77,), None, tuple(T[:4]), 4)
    sink.apply(a.on_message(msg(0, other, *sglang_pages(toks, 4), hash_style="signed")))
    assert a.stats.malformed == 0 and len(a) == 4
    assert sink.keys == dict.fromkeys(keys_of(toks, LENGTHS) + keys_of(T[:4], LENGTHS), 1)
    # the same pages as one vLLM-style event: the hash repeats within it, and as its own parent
    b = agent(LENGTHS)
    h = hash((1, 2, 3, 4))
    b.on_message(msg(0, BlockStored((h,), None, (1, 2, 3, 4), 4), BlockStored((h, hash((9,) * 4)), h, tuple(toks[4:]), 4)))
    c = agent(LENGTHS)
    c.on_message(msg(0, BlockStored((h, h, hash((9,) * 4)), None, tuple(toks), 4)))
    assert set(b.held()) == set(c.held()) == set(keys_of(toks, LENGTHS)) and len(b) == len(c) == 3


def test_sglang_removals_resolve_leaf_first() -> None:
    # one node [X, X, X]: its removals name one hash three times; leaf-first peels it exactly
    a = agent([1, 2, 3], shards=1)
    a.on_message(msg(0, *sglang_pages([3, 3, 3], 1)))
    assert set(a.held()) == set(keys_of([3, 3, 3], [1, 2, 3]))
    a.on_message(msg(1, BlockRemoved((hash((3,)),))))  # the leaf node [3] evicted alone
    assert set(a.held()) == set(keys_of([3, 3], [1, 2]))
    a.on_message(msg(2, *sglang_removals([3, 3], 1)))
    assert a.held() == {} and len(a) == 0 and a.stats.ambiguous_removals == 0 and a.stats.unknown_removals == 0
    # a removal whose content also sits in a surviving ancestor goes to the leaf
    toks = [5, 6, 7, 5, 8]
    a.on_message(msg(3, *sglang_pages(toks, 1)))
    a.on_message(msg(4, *sglang_pages([9], 1, parent=hash((5,)))))  # [9] under the later 5
    a.on_message(msg(5, *sglang_removals([9], 1), *sglang_removals([8], 1)))  # two leaf nodes
    a.on_message(msg(6, *sglang_removals([5], 1)))  # the node [5] that has become a leaf
    assert set(a.held()) == set(keys_of(toks[:3], [1, 2, 3])) and a.stats.ambiguous_removals == 0
    # two cached copies that are both leaves: the format cannot say which; the oldest goes
    b = agent([1, 2], shards=1)
    b.on_message(msg(0, *sglang_pages([1, 4], 1), *sglang_pages([2, 4], 1)))
    b.on_message(msg(1, BlockRemoved((hash((4,)),))))
    assert set(b.held()) == set(keys_of([1], [1]) + keys_of([2, 4], [1, 2])) and b.stats.ambiguous_removals == 1


def test_same_hash_under_two_known_parents_is_two_blocks() -> None:
    a = agent([4, 8])
    a.on_message(msg(0, BlockStored((1, 2), None, tuple(T[:8]), 4), BlockStored((3,), None, tuple(T[8:12]), 4)))
    a.on_message(msg(1, BlockStored((2,), 3, tuple(T[4:8]), 4)))  # content-hash engines do this
    assert a.stats.conflicts == 0 and len(a) == 4
    assert set(a.held()) == set(keys_of(T[:8], [4, 8]) + keys_of(T[8:12] + T[4:8], [4, 8]))
    a.on_message(msg(2, BlockRemoved((2,))))  # both are leaves: ambiguous, the older one goes
    assert set(a.held()) == set(keys_of(T[:4], [4]) + keys_of(T[8:12] + T[4:8], [4, 8])) and a.stats.ambiguous_removals == 1


# ---- sequencing -------------------------------------------------------------------------------


def test_redelivery_is_ignored_and_other_bytes_under_an_old_seq_are_a_restart() -> None:
    a, sink = agent(LENGTHS), Sink(3)
    m0 = msg(0, BlockStored((1,), None, tuple(T[:4]), 4))
    sink.apply(a.on_message(m0))
    sink.apply(a.on_message(msg(1, BlockStored((2,), 1, tuple(T[4:8]), 4))))
    d = a.digest()
    assert a.on_message(m0) == AgentOutput() and a.stats.duplicates == 1 and a.digest() == d
    out = a.on_message(msg(0, BlockStored((1,), None, tuple(T[:4]), 4), ts=99.0))  # same seq, new bytes
    sink.apply(out)
    assert a.incarnation == 2 and {b.shard for b in out.batches if b.reset} == {0, 1, 2}
    assert sink.keys == dict.fromkeys(keys_of(T[:4], LENGTHS), 1)


def test_messages_queued_from_before_a_repair_past_them_are_stale_not_a_restart() -> None:
    """Found in review: an agent far behind its socket's queue when a gap opened repaired it
    with a replay or resync that took it to the engine's newest seq; every message still queued
    behind (a seq older than the digest window) was then taken for an engine restart: a new
    incarnation, everything withdrawn and re-reported, once per queued message. Their batch
    timestamps are older than the newest applied, which a restarted engine's are not: they are
    dropped as stale. A restart (new bytes, a newer timestamp) is still one."""
    window, ring, n = 8, 8, 60
    msgs = [msg(s, BlockStored((s + 1,), s or None, tuple(T[(4 * s) % 16 : (4 * s) % 16 + 4]), 4)) for s in range(n)]
    a, sink = agent(LENGTHS, window=window), Sink(3)
    for s in range(5):
        sink.apply(a.on_message(msgs[s]))
    out = a.on_message(msgs[20])  # 5..19 were lost at the socket; 21.. wait in its queue
    assert out.replay == ReplayRequest(5)
    sink.apply(out)
    for s in range(n - ring, n):  # the engine's ring holds only the newest
        sink.apply(a.on_replay(encode_replay(s, msgs[s][2])))
    sink.apply(a.on_replay(encode_replay_end()))
    assert a.last_seq == n - 1 and a.incarnation == 1
    held = dict(sink.keys)
    for s in range(21, 30):  # the queued ones, older than the window and than what was applied
        sink.apply(a.on_message(msgs[s]))
    # Ten stale: the nine queued ones, and live seq 20, buffered when the gap opened and
    # dropped when the replay jumped past it (applied after seq 59 it would claim blocks the
    # lost span may have removed).
    assert a.stats.stale == 10 and a.stats.restarts == 0 and a.incarnation == 1 and sink.keys == held
    out = a.on_message(msg(3, BlockStored((900,), None, (7, 7, 7, 7), 4), ts=1e6))  # a restarted engine
    assert a.stats.restarts == 1 and a.incarnation == 2 and out.replay == ReplayRequest(0)


def test_media_past_the_limit_are_skipped_and_cannot_alias_the_gpu() -> None:
    """Found in review: every medium name got a permanent 16-bit id, so after 65,536 made-up
    names the next one's id was GPU's and a removal on it withdrew GPU copies (and the names'
    table grew without bound). An agent now tracks at most MAX_MEDIA names; an event naming
    one more is skipped, logged and counted like a malformed one."""
    from kvcompass.agent.agent import MAX_MEDIA

    a, sink = agent(LENGTHS), Sink(3)
    sink.apply(a.on_message(msg(0, BlockStored((1,), None, tuple(T[:4]), 4))))  # GPU
    held = dict(sink.keys)
    junk = [BlockRemoved((999,), medium=f"X{i}") for i in range(MAX_MEDIA + 10)]
    sink.apply(a.on_message(msg(1, *junk)))
    skipped = a.take_skipped()
    assert len(skipped) == 11 and a.stats.events_skipped == 11  # GPU and MAX_MEDIA - 1 of them fit
    assert all("distinct media" in sk.reason for _, sk in skipped) and skipped[0][1].index == MAX_MEDIA - 1
    sink.apply(a.on_message(msg(2, BlockRemoved((1,), medium="ONE-MORE"))))
    assert sink.keys == held and a.stats.events_skipped == 12
    sink.apply(a.on_message(msg(3, BlockRemoved((1,)))))  # GPU is still GPU
    assert sink.keys == {}


def test_a_token_less_copy_adds_a_medium_to_known_blocks_as_vllms_offloading_connector_sends_it() -> None:
    """Found in review: vLLM's offloading connector (0.11 on) reports its CPU copies as
    ``BlockStored(hashes, parent=None, token_ids=[], block_size=n or 0, medium="CPU")``; the
    agent skipped them, so an offloaded prefix was withdrawn when its GPU copy went. Now the
    copy adds CPU to the blocks it names; a hash it cannot place is counted, never guessed."""
    a, sink = agent(LENGTHS), Sink(3)
    sink.apply(a.on_message(msg(0, BlockStored((11, 12), None, tuple(T[:8]), 4))))  # GPU
    keys = keys_of(T[:8], LENGTHS)
    assert tiers(sink, T[:8], LENGTHS) == [1] * len(keys)
    sink.apply(a.on_message(msg(1, BlockStored((11, 12), None, (), 4, medium="CPU"))))
    sink.apply(a.on_message(msg(2, BlockStored((11, 12), None, (), 0, medium="CPU"))))  # later releases: 0
    assert a.take_skipped() == [] and a.stats.unplaced_copies == 0
    sink.apply(a.on_message(msg(3, BlockRemoved((11, 12)))))  # the GPU copy goes; the CPU one stays
    assert tiers(sink, T[:8], LENGTHS) == [2] * len(keys)
    sink.apply(a.on_message(msg(4, BlockRemoved((11, 12), "CPU"))))
    assert sink.keys == {}
    sink.apply(a.on_message(msg(5, BlockStored((77,), None, (), 0, medium="CPU"))))  # never stored: cannot be placed
    assert sink.keys == {} and a.stats.unplaced_copies == 1 and a.take_skipped() == []


def test_restart_seen_after_its_first_messages_asks_for_them() -> None:
    a, sink = agent(LENGTHS), Sink(3)
    for s in range(4):
        sink.apply(a.on_message(msg(s, BlockStored((s + 1,), s or None, tuple(T[4 * s : 4 * s + 4]), 4))))
    out = a.on_message(msg(2, BlockStored((50,), None, (7, 7, 7, 7), 4), ts=-1.0))  # a new engine's seq 2
    sink.apply(out)
    assert out.replay == ReplayRequest(0) and a.incarnation == 2
    assert sink.keys == {} and all(b.reset for b in out.batches)
    sink.apply(a.on_replay(encode_replay(0, msg(0, AllBlocksCleared(), ts=-3.0)[2])))
    sink.apply(a.on_replay(encode_replay(1, msg(1, BlockStored((40,), None, tuple(T[:4]), 4), ts=-2.0)[2])))
    sink.apply(a.on_replay(encode_replay(2, msg(2, BlockStored((50,), None, (7, 7, 7, 7), 4), ts=-1.0)[2])))
    assert a.on_replay(encode_replay_end()).batches == ()
    assert sink.keys == dict.fromkeys(keys_of(T[:4], LENGTHS) + keys_of([7] * 4, LENGTHS), 1)


def test_agent_started_mid_stream_asks_from_zero_then_resyncs() -> None:
    a, sink = agent(LENGTHS), Sink(3)
    out = a.on_message(msg(7, BlockStored((8,), None, tuple(T[:4]), 4)))
    assert out.replay == ReplayRequest(0)
    assert [(b.reset, len(b.keys)) for b in out.batches] == [(True, 0)] * 3  # a new agent clears its worker early
    sink.apply(out)
    # The ring starts at 5: seqs 0-4 are gone. The first reply past the gap resyncs from there
    # (every shard re-reported) and the rest of the replay and the queued live message follow
    # in order (review, twenty-fourth session: buffering replies filled the buffer on a
    # long-running engine, and the resync it forced dropped the rest of the replay).
    out = a.on_replay(encode_replay(5, msg(5, BlockStored((6,), None, tuple(T[4:8]), 4))[2]))
    sink.apply(out)
    assert a.stats.resyncs == 1 and all(b.reset for b in out.batches) and {b.shard for b in out.batches} == {0, 1, 2}
    sink.apply(a.on_replay(encode_replay(6, msg(6, BlockRemoved((6,)))[2])))
    assert a.last_seq == 7 and a.buffered == 0  # the queued live message drained behind seq 6
    sink.apply(a.on_replay(encode_replay_end()))
    assert a.stats.resyncs == 1 and a.last_seq == 7 and a.buffered == 0
    assert sink.keys == dict.fromkeys(keys_of(T[:4], LENGTHS), 1)
    sink.apply(a.on_message(msg(8, BlockRemoved((8,)))))
    assert sink.keys == {}


def test_replay_failed_resyncs_with_or_without_forgetting() -> None:
    for forget in (False, True):
        a, sink = agent(LENGTHS), Sink(3)
        sink.apply(a.on_message(msg(0, BlockStored((1,), None, tuple(T[:4]), 4))))
        assert a.on_message(msg(2, BlockStored((9,), None, (5, 5, 5, 5), 4))).replay == ReplayRequest(1)
        out = a.on_replay_failed(forget=forget)
        sink.apply(out)
        assert all(b.reset for b in out.batches) and a.last_seq == 2
        expect = keys_of([5] * 4, LENGTHS) + ([] if forget else keys_of(T[:4], LENGTHS))
        assert sink.keys == dict.fromkeys(expect, 1)
    assert a.on_replay_failed() == AgentOutput()


def test_second_gap_during_a_replay_waits_for_the_same_replay() -> None:
    a, sink = agent(LENGTHS), Sink(3)
    frames = [msg(s, BlockStored((s + 1,), s or None, tuple(T[4 * s : 4 * s + 4]), 4)) for s in range(4)]
    sink.apply(a.on_message(frames[0]))
    assert a.on_message(frames[2]).replay == ReplayRequest(1)
    assert a.on_message(frames[3]).replay is None and a.buffered == 2
    sink.apply(a.on_replay(encode_replay(1, frames[1][2])))
    assert a.buffered == 0 and sink.keys == dict.fromkeys(keys_of(T, LENGTHS), 1)


def test_buffer_overflow_resyncs() -> None:
    a, sink = agent(LENGTHS, max_buffered=2), Sink(3)
    sink.apply(a.on_message(msg(0, BlockStored((1,), None, tuple(T[:4]), 4))))
    assert a.on_message(msg(2, BlockStored((2,), 1, tuple(T[4:8]), 4))).replay == ReplayRequest(1)
    a.on_message(msg(3, AllBlocksCleared()))
    out = a.on_message(msg(4, BlockStored((3,), None, tuple(T[:4]), 4)))
    sink.apply(out)
    assert a.stats.resyncs == 1 and a.buffered == 0 and a.replay_pending is None and a.last_seq == 4
    assert sink.keys == dict.fromkeys(keys_of(T[:4], LENGTHS), 1)
    # the replay's late answers are harmless now
    assert a.on_replay(encode_replay(1, msg(1, AllBlocksCleared())[2])).batches == ()
    assert a.on_replay(encode_replay_end()) == AgentOutput()


def test_full_report_is_idempotent() -> None:
    a, sink = agent(LENGTHS), Sink(3)
    sink.apply(a.on_message(msg(0, BlockStored((1, 2), None, tuple(T[:8]), 4), BlockStored((3,), 2, tuple(T[8:12]), 4, medium="CPU"))))
    r1, r2 = a.full_report(), a.full_report()
    assert [b.shard for b in r1] == [0, 1, 2] and all(b.reset for b in r1 + r2)
    assert [(b.keys.tolist(), b.tiers.tolist()) for b in r1] == [(b.keys.tolist(), b.tiers.tolist()) for b in r2]
    assert [b.seq for b in r2] == [b.seq + 1 for b in r1]
    fresh = Sink(3)
    fresh.incarnation, fresh.next = 1, {s: r1[s].seq for s in range(3)}
    fresh.apply(r1)
    sink.apply(r1)
    sink.apply(r2)
    assert fresh.keys == sink.keys == {k: int(t) for k, t in a.held().items()}


# ---- refusals -----------------------------------------------------------------------------------


def test_malformed_messages_leave_the_agent_unchanged() -> None:
    a = agent(LENGTHS, block_size=4)
    a.on_message(msg(0, BlockStored((1,), None, tuple(T[:4]), 4)))
    d, last = a.digest(), a.last_seq
    good = msg(1, BlockStored((2,), 1, tuple(T[4:8]), 4))
    bad = [
        good[:2],
        [good[0], good[1][:7], good[2]],
        [good[0], good[1], good[2][:-1]],
        msg(1, BlockStored((2,), 1, tuple(T[4:6]), 2)),  # the wrong block size for this agent
        msg(1, BlockStored((2,), 1, tuple(T[4:8]), 4), BlockStored((3,), 2, (1, 2, 3, 4), 4), BlockRemoved((1,)))[:2]
        + [encode_batch([BlockStored((2,), 1, tuple(T[4:8]), 4)], 1)[2][:-2]],
    ]
    for i, frames in enumerate(bad, start=1):
        with pytest.raises(InvalidEventError):
            a.on_message(frames)
        assert a.stats.malformed == i and a.digest() == d and a.last_seq == last
    with pytest.raises(InvalidEventError, match="expects 4"):
        a.on_replay(encode_replay(1, msg(1, BlockStored((2,), 1, tuple(T[4:6]), 2))[2]))
    with pytest.raises(InvalidEventError):
        a.on_replay([b"\x00"])
    assert a.digest() == d and a.stats.malformed == len(bad) + 2
    assert a.on_message(good).batches and a.stats.messages == 2


def test_an_event_that_cannot_be_understood_is_skipped_and_the_rest_of_its_message_applies() -> None:
    # issue 16: one bad event used to cost its whole scheduler step (the message was refused,
    # the replay brought the same bytes, refused again).
    a, sink = agent(LENGTHS, block_size=4), Sink(3)
    ts = 1.0
    payload = msgpack.packb([ts, [["BlockStored", [1], None, list(T[:4]), 4, None, "GPU"], ["BlockStored", [9]], ["BlockStored", [2], 1, list(T[4:8]), 4, None, "GPU"]]])
    out = a.on_message([b"", (0).to_bytes(8, "big"), payload])
    sink.apply(out)
    assert out.replay is None and a.last_seq == 0  # the sequence advanced: nothing to replay
    assert a.stats.events_skipped == 1 and a.stats.malformed == 0
    (seq, skipped), = a.take_skipped()
    assert seq == 0 and skipped.index == 1 and "needs at least 4 fields" in skipped.reason
    assert a.take_skipped() == []
    reference = agent(LENGTHS, block_size=4)
    reference.on_message(msg(0, BlockStored((1, 2), None, tuple(T[:8]), 4)))
    assert sink.keys == {k: int(t) for k, t in reference.held().items()}


def test_a_refused_message_is_recovered_through_the_replay_path() -> None:
    a, sink = agent(LENGTHS), Sink(3)
    sink.apply(a.on_message(msg(0, BlockStored((1,), None, tuple(T[:4]), 4))))
    with pytest.raises(InvalidEventError):
        a.on_message([b"", (1).to_bytes(8, "big"), b"\xc1"])
    out = a.on_message(msg(2, BlockStored((3,), None, (9, 9, 9, 9), 4)))
    assert out.replay == ReplayRequest(1)
    with pytest.raises(InvalidEventError):
        a.on_replay([(1).to_bytes(8, "big"), b"\xc1"])
    sink.apply(a.on_replay(encode_replay(2, msg(2, BlockStored((3,), None, (9, 9, 9, 9), 4))[2])))
    sink.apply(a.on_replay(encode_replay_end()))
    assert a.stats.resyncs == 1
    assert sink.keys == dict.fromkeys(keys_of(T[:4], LENGTHS) + keys_of([9] * 4, LENGTHS), 1)


@pytest.mark.parametrize(
    ("args", "kw"),
    [
        (("", NS, [4]), {}),
        (("w", NS, [0, 4]), {}),
        (("w", NS, [2**32]), {}),
        (("w", NS, [4], 0), {}),
        (("w", NS, [4]), {"window": 0}),
        (("w", NS, [4]), {"max_buffered": 0}),
        (("w", NS, [4]), {"incarnation": -1}),
        (("w", NS, [4]), {"block_size": 0}),
    ],
)
def test_constructor_validates(args: tuple[Any, ...], kw: dict[str, Any]) -> None:
    with pytest.raises(InvalidArgumentError):
        WorkerAgent(*args, **kw)


def test_registration_lengths_are_sorted_and_deduplicated() -> None:
    a = WorkerAgent("w", NS, [8, 4, 8], incarnation=5)
    assert a.registration_lengths == (4, 8) and a.incarnation == 5
    out = a.on_message(msg(0, AllBlocksCleared()))
    assert [(b.incarnation, b.reset, len(b.keys)) for b in out.batches] == [(5, True, 0)]


# ---- the model check --------------------------------------------------------------------------

BS = 2
MEDIA = [None, "GPU", "CPU", "cpu_pinned", "DISK"]


@dataclass
class Engine:
    """A block cache keyed by content (the chain of tokens up to a block's end), publishing
    vLLM-format messages with per-process random hashes, as a real engine does."""

    form: str
    style: str
    incarnation: int = 0
    cache: dict[tuple[int, ...], set[str]] = field(default_factory=dict)
    ring: list[list[bytes]] = field(default_factory=list)
    ts: float = 0.0

    def h(self, content: tuple[int, ...]) -> int:
        return int.from_bytes(hashlib.blake2b(repr((self.incarnation, content)).encode(), digest_size=8).digest(), "big")

    def publish(self, events: list[Any]) -> list[bytes]:
        self.ts += 1.0
        frames = encode_batch(events, len(self.ring), self.ts, 0, form=self.form, hash_style=self.style)  # type: ignore[arg-type]
        self.ring.append(frames)
        return frames

    def store(self, p: list[int], i: int, k: int, medium: str | None) -> Any:
        blocks = [tuple(p[: (j + 1) * BS]) for j in range(i, k)]
        for b in blocks:
            self.cache.setdefault(b, set()).add("GPU" if medium is None else medium.upper())
        parent = self.h(tuple(p[: i * BS])) if i else None
        return BlockStored(tuple(self.h(b) for b in blocks), parent, tuple(p[i * BS : k * BS]), BS, medium=medium)

    def remove(self, p: list[int], j: int, medium: str | None) -> Any:
        b = tuple(p[: (j + 1) * BS])
        held = self.cache.get(b, set())
        held.discard("GPU" if medium is None else medium.upper())
        if not held:
            self.cache.pop(b, None)
        return BlockRemoved((self.h(b),), medium)

    def implied(self, prompts: list[list[int]], lengths: list[int]) -> dict[int, int]:
        """Every registration-length prefix whose every block is cached in an indexed medium."""
        out: dict[int, int] = {}
        for p in prompts:
            for c, key in zip([c for c in lengths if c <= len(p)], keys_of(p, lengths)):
                worst = 0
                for j in range(-(-c // BS)):
                    best = min((t for t in (int(medium_tier(m)) for m in self.cache.get(tuple(p[: (j + 1) * BS]), ())) if t), default=0)
                    if not best:
                        break
                    worst = max(worst, best)
                else:
                    out[key] = min(worst, out.get(key, worst))  # the best chain holding the key
        return out


# Weighted by repetition: mostly stores, some removals, rare clears and restarts, so that
# histories build up state worth checking.
store_op = st.tuples(st.just("store"), st.integers(0, 5), st.integers(0, 4), st.integers(1, 5), st.sampled_from(MEDIA))
remove_op = st.tuples(st.just("remove"), st.integers(0, 5), st.integers(0, 4), st.sampled_from(MEDIA))
op = st.sampled_from(["store"] * 6 + ["remove"] * 3 + ["clear"]).flatmap(
    lambda kind: store_op if kind == "store" else remove_op if kind == "remove" else st.just(("clear",))
)
message = st.lists(op, min_size=1, max_size=3)
send = st.tuples(st.just("send"), message, st.sampled_from(["ok", "ok", "ok", "drop", "drop", "dup", "late"]), st.integers(0, 2))
step = st.sampled_from(["send"] * 12 + ["restart"]).flatmap(lambda kind: send if kind == "send" else st.just(("restart",)))


@hsettings(max_examples=4 * hsettings.default.max_examples)  # cheap: ~10 ms an example
@given(
    prompts=st.lists(st.lists(st.integers(0, 2), min_size=2 * BS, max_size=5 * BS).map(lambda p: p[: len(p) // BS * BS]), min_size=1, max_size=6),
    lengths=st.lists(st.integers(1, 10), min_size=1, max_size=6),
    steps=st.lists(step, min_size=1, max_size=30),
    form=st.sampled_from(["array", "map"]),
    style=st.sampled_from(["int", "signed", "bytes"]),
    shards=st.integers(1, 4),
)
def test_agent_matches_the_engine_cache(
    prompts: list[list[int]], lengths: list[int], steps: list[Any], form: str, style: str, shards: int
) -> None:
    engine = Engine(form, style)
    a, sink = WorkerAgent("w0", NS, lengths, shards), Sink(shards)
    undelivered: list[int] = []  # seqs of the current engine not yet seen live
    pending: list[tuple[int, ReplayRequest]] = []  # (steps left before serving, request)
    delivered: list[list[bytes]] = []

    def serve(req: ReplayRequest) -> None:
        for s in range(req.start_seq, len(engine.ring)):
            sink.apply(a.on_replay(encode_replay(s, engine.ring[s][2])))
        sink.apply(a.on_replay(encode_replay_end()))

    def deliver(frames: list[bytes], delay: int) -> None:
        out = a.on_message(frames)
        sink.apply(out)
        if out.replay is not None:
            pending.append((delay, out.replay))

    def settle() -> None:
        while pending:
            serve(pending.pop(0)[1])

    for n, s in enumerate(steps):
        if s[0] == "restart":
            settle()
            engine.incarnation += 1
            engine.cache.clear()
            engine.ring.clear()
            undelivered.clear()
            continue
        _, ops, fate, delay = s
        events: list[Any] = []
        for o in ops:
            if o[0] == "clear":
                engine.cache.clear()
                events.append(AllBlocksCleared())
                continue
            p = prompts[o[1] % len(prompts)]
            nb = len(p) // BS
            if o[0] == "store":
                i = o[2] % nb
                events.append(engine.store(p, i, max(i + 1, min(nb, o[3])), o[4]))
            else:
                events.append(engine.remove(p, o[2] % nb, o[3]))
        frames = engine.publish(events)
        last_of_incarnation = n + 1 == len(steps) or steps[n + 1][0] == "restart"
        first_of_incarnation = len(engine.ring) == 1
        if fate == "drop" and not last_of_incarnation and not first_of_incarnation:
            undelivered.append(len(engine.ring) - 1)
        else:
            deliver(frames, delay)
            delivered.append(frames)
            if fate == "dup":
                deliver(frames, delay)
            elif fate == "late" and undelivered:
                deliver(engine.ring[undelivered.pop(0)], delay)
        ready = [r for d, r in pending if d == 0]
        pending[:] = [(d - 1, r) for d, r in pending if d > 0]
        for r in ready:
            serve(r)
        if not pending and a.buffered == 0 and a.last_seq == len(engine.ring) - 1:
            expect = engine.implied(prompts, lengths)
            note(f"step {n}: {s}")
            assert sink.keys == expect
    settle()
    if not engine.ring:  # the engine restarted last: the agent learns it from the next message
        deliver(engine.publish([]), 0)
    expect = engine.implied(prompts, lengths)
    assert sink.keys == expect
    assert {k: int(t) for k, t in a.held().items()} == expect
    assert a.stats.malformed == 0 and a.stats.resyncs == 0
    for name in ("restarts", "replay_requests", "duplicates", "orphans", "adopted", "unknown_removals", "clears"):
        event(f"{name}: {'some' if getattr(a.stats, name) else 'none'}")
    event(f"tiers held: {sorted(set(expect.values()))}")
    report = Sink(shards)
    batches = a.full_report()
    report.incarnation, report.next = batches[0].incarnation, {b.shard: b.seq for b in batches}
    report.apply(batches)
    assert report.keys == expect


# ---- with real maintenance units ----------------------------------------------------------------

LAYOUT = IndexLayout((TableSpec(0, "r", ("w0", "w1")),), shards=3)
BOOT_NS = 1_767_225_600_000_000_000  # 2026-01-01, as time.time_ns() reads it


class Units:
    """A maintenance unit per shard of LAYOUT, fed as a driver does (``on_rejected`` included)."""

    def __init__(self, epoch: int = 1) -> None:
        self.units = [MaintenanceUnit(s, LAYOUT, epoch) for s in range(LAYOUT.shards)]
        self.rejected = 0

    def send(self, a: WorkerAgent, batches: tuple[KeyOpBatch, ...] | AgentOutput) -> None:
        if isinstance(batches, AgentOutput):
            batches = batches.batches
        for b in batches:
            try:
                self.units[b.shard].apply(b, b.worker)
            except StaleIncarnationError:
                raise  # a newer agent process owns the worker: nothing to resend
            except AgentSequenceError:
                self.rejected += 1
                for r in a.on_rejected(b.shard):
                    self.units[r.shard].apply(r, r.worker)

    def holds(self, worker: str = "w0") -> dict[int, int]:
        ref = LAYOUT.field_of(worker)
        out: dict[int, int] = {}
        for u in self.units:
            keys, values = u.table(ref.table_id).entries()
            for k, v in zip(keys.tolist(), values.tolist()):
                if t := (v >> (2 * ref.field)) & 3:
                    out[k] = t
        return out

    def restart(self, saved: list[bytes], epoch: int) -> None:
        self.units = [MaintenanceUnit.from_bytes(b, LAYOUT, epoch) for b in saved]


def held(a: WorkerAgent) -> dict[int, int]:
    return {k: int(t) for k, t in a.held().items()}


def chain(seq: int, first: int, n: int, **kw: Any) -> list[bytes]:
    """Blocks ``first..first+n-1`` of T as one chained (vLLM) BlockStored."""
    return msg(seq, BlockStored(tuple(range(first + 1, first + n + 1)), first or None, tuple(T[4 * first : 4 * (first + n)]), 4, **kw))


def test_boot_incarnation() -> None:
    assert boot_incarnation(BOOT_NS) == (BOOT_NS // 1000) << 8 < 2**63
    assert boot_incarnation(BOOT_NS + 1000) - boot_incarnation(BOOT_NS) == 256  # restarts per us of separation
    assert boot_incarnation(2**63 // 256 * 1000 - 1000) < 2**63  # until about the year 3100
    for bad in (-1, 1.5, "1", True):
        with pytest.raises(InvalidArgumentError):
            boot_incarnation(bad)  # type: ignore[arg-type]
    a = WorkerAgent("w0", NS, [4], incarnation=boot_incarnation(BOOT_NS))
    assert a.incarnation == boot_incarnation(BOOT_NS)


def test_units_follow_an_engine_restart() -> None:
    a, units = WorkerAgent("w0", NS, LENGTHS, 3, incarnation=boot_incarnation(BOOT_NS)), Units()
    units.send(a, a.on_message(chain(0, 0, 3)))
    units.send(a, a.on_message(chain(1, 3, 1)))
    assert units.holds() == held(a) == dict.fromkeys(keys_of(T, LENGTHS), 1)
    units.send(a, a.on_message(msg(0, BlockStored((1,), None, (7, 7, 7, 7), 4))))  # a new engine
    assert a.incarnation == boot_incarnation(BOOT_NS) + 1
    assert units.holds() == held(a) == dict.fromkeys(keys_of([7] * 4, LENGTHS), 1)
    assert units.rejected == 0 and all(u.agent_position("w0") == (a.incarnation, 1) for u in units.units)


def run_agent_restart(first: int, second: int, *, ring: bool) -> tuple[Units, WorkerAgent]:
    """Agent process 1 (incarnation ``first``) follows an engine that restarts once, then dies;
    the engine evicts blocks 3-4 and stores another; agent process 2 (incarnation ``second``)
    takes over mid-stream and replays the engine's history (``ring``) or finds it gone."""
    units = Units()
    a1 = WorkerAgent("w0", NS, LENGTHS, 3, incarnation=first)
    units.send(a1, a1.on_message(chain(0, 0, 1)))
    engine = [chain(0, 0, 2), chain(1, 2, 2)]  # the engine restarts: new bytes under seq 0
    for frames in engine:
        units.send(a1, a1.on_message(frames))
    assert a1.incarnation == first + 1 and units.holds() == held(a1) == dict.fromkeys(keys_of(T, LENGTHS), 1)
    engine.append(msg(2, BlockRemoved((3,))))  # published while no agent runs
    engine.append(msg(3, BlockStored((9,), None, (7, 7, 7, 7), 4)))
    a2 = WorkerAgent("w0", NS, LENGTHS, 3, incarnation=second)
    out = a2.on_message(engine[3])
    units.send(a2, out)
    assert out.replay == ReplayRequest(0)
    for s in range(3 if ring else 0):
        units.send(a2, a2.on_replay(encode_replay(s, engine[s][2])))
    units.send(a2, a2.on_replay(encode_replay_end()))
    assert a2.stats.resyncs == (0 if ring else 1)
    return units, a2


def test_agent_restart_with_boot_incarnation_clears_stale_keys() -> None:
    for ring, expect in (
        (True, dict.fromkeys(keys_of(T[:8], LENGTHS) + keys_of([7] * 4, LENGTHS), 1)),
        (False, dict.fromkeys(keys_of([7] * 4, LENGTHS), 1)),  # all the new agent knows of
    ):
        units, a2 = run_agent_restart(boot_incarnation(BOOT_NS), boot_incarnation(BOOT_NS + 5_000_000_000), ring=ring)
        assert held(a2) == expect and units.holds() == expect  # blocks 3 and 4 are gone from the units too
        assert units.rejected == 0
    # The hazard boot_incarnation removes: a second process that starts at its predecessor's
    # last incarnation (here 2: 1 plus an engine restart) sends resets under seqs the units have
    # already seen from that incarnation, so they are ignored as duplicates and stale keys stay.
    units, a2 = run_agent_restart(1, 2, ring=False)
    stale = (set(keys_of(T, LENGTHS)) - set(keys_of(T[:8], LENGTHS))) & set(units.holds())  # blocks 3-4
    assert held(a2) == expect and units.holds() != expect and stale
    with pytest.raises(StaleIncarnationError):  # and one that starts below it is refused
        run_agent_restart(1, 1, ring=True)


def test_maintenance_restart_is_answered_by_on_rejected() -> None:
    a, units = WorkerAgent("w0", NS, LENGTHS, 3, incarnation=boot_incarnation(BOOT_NS)), Units()
    units.send(a, a.on_message(chain(0, 0, 2)))
    saved = [u.to_bytes() for u in units.units]  # what the units wrote to disk
    units.send(a, a.on_message(chain(1, 2, 2)))  # accepted, but not in the saved state
    units.send(a, a.on_message(msg(2, BlockRemoved((1,)))))
    assert units.holds() == held(a) == {}
    units.restart(saved, epoch=2)  # every unit comes back older and without agent sequences
    assert units.holds() == dict.fromkeys(keys_of(T[:8], LENGTHS), 1) and all(u.agent_position("w0") is None for u in units.units)
    out = a.on_message(msg(3, BlockStored((1,), None, tuple(T[:4]), 4, medium="CPU")))
    assert {b.shard for b in out.batches} == {0, 1, 2} and not any(b.reset or b.seq == 1 for b in out.batches)
    units.send(a, out)
    assert units.rejected == 3  # each unit refused the gap, and took the reset instead
    assert units.holds() == held(a) == dict.fromkeys(keys_of(T, LENGTHS), 2)
    # later batches flow normally again
    units.send(a, a.on_message(msg(4, BlockRemoved((4,)))))
    assert units.holds() == held(a) == dict.fromkeys(keys_of(T[:12], LENGTHS), 2) and units.rejected == 3


def test_on_rejected_resets_one_shard_or_all() -> None:
    a = agent(LENGTHS)
    assert [(b.shard, b.seq) for b in a.on_message(chain(0, 0, 2)).batches] == [(0, 1), (1, 1), (2, 1)]
    one = a.on_rejected(1)
    assert [(b.shard, b.seq, b.reset) for b in one] == [(1, 2, True)]
    assert set(one[0].keys.tolist()) == {k for k in a.held() if k % 3 == 1}
    every = a.on_rejected()
    assert [(b.shard, b.seq, b.reset) for b in every] == [(0, 2, True), (1, 3, True), (2, 2, True)]
    assert {k for b in every for k in b.keys.tolist()} == set(a.held())
    for bad in (3, -1, "0"):
        with pytest.raises(InvalidArgumentError):
            a.on_rejected(bad)  # type: ignore[arg-type]


@dataclass
class RadixNode:
    key: list[int]
    parent: RadixNode | None
    children: dict[tuple[int, ...], RadixNode] = field(default_factory=dict)


class SGLangEngine:
    """SGLang's radix cache at page granularity, publishing its content-hash events: a new node
    stores its pages chained from the parent node's last page; an evicted leaf node removes its
    pages first page first; splits publish nothing."""

    def __init__(self, page: int) -> None:
        self.page = page
        self.root = RadixNode([], None)
        self.seq = 0
        self.ambiguous = False  # a new node hung off a page whose content is cached elsewhere too

    def publish(self, events: list[Any]) -> list[bytes]:
        self.seq += 1
        return msg(self.seq - 1, *events, hash_style="signed")

    def insert(self, tokens: list[int]) -> list[bytes]:
        p, node, i = self.page, self.root, 0
        while i < len(tokens) and (child := node.children.get(tuple(tokens[i : i + p]))) is not None:
            k = 0
            while k < len(child.key) and child.key[k : k + p] == tokens[i + k : i + k + p]:
                k += p
            if k < len(child.key):  # split the child at k
                head = RadixNode(child.key[:k], node, {tuple(child.key[k : k + p]): child})
                node.children[tuple(child.key[:p])] = head
                child.key, child.parent = child.key[k:], head
                child = head
            node, i = child, i + k
        events: list[Any] = []
        if i < len(tokens):
            if node is not self.root and self.pages_with(node.key[-p:]) > 1:
                self.ambiguous = True
            new = RadixNode(tokens[i:], node)
            node.children[tuple(tokens[i : i + p])] = new
            events = sglang_pages(new.key, p, None if node is self.root else hash(tuple(node.key[-p:])))
        return self.publish(events)

    def evict(self, *paths: list[int]) -> list[bytes]:
        """Evict the leaf nodes that end the cached sequences ``paths``, in one message."""
        events: list[Any] = []
        for path in paths:
            node = self.root
            i = 0
            while i < len(path):
                node = node.children[tuple(path[i : i + self.page])]
                i += len(node.key)
            assert i == len(path) and not node.children and node.parent is not None
            del node.parent.children[tuple(node.key[: self.page])]
            events += sglang_removals(node.key, self.page)
        return self.publish(events)

    def nodes(self) -> list[tuple[RadixNode, list[int]]]:
        """Every node but the root, with the cached sequence it ends."""
        out, stack = [], [(self.root, list[int]())]
        while stack:
            node, prefix = stack.pop()
            path = prefix + node.key
            if node is not self.root:
                out.append((node, path))
            stack.extend((c, path) for c in node.children.values())
        return sorted(out, key=lambda np: np[1])

    def pages_with(self, content: list[int]) -> int:
        p = self.page
        return sum(n.key[s : s + p] == content for n, _ in self.nodes() for s in range(0, len(n.key), p))

    def implied(self, lengths: list[int]) -> dict[int, int]:
        out: dict[int, int] = {}
        stack = [(self.root, list[int]())]
        while stack:
            node, prefix = stack.pop()
            path = prefix + node.key
            out.update(dict.fromkeys(keys_of(path, lengths), 1))
            stack.extend((c, path) for c in node.children.values())
        return out


@pytest.mark.parametrize(
    ("page", "steps", "ambiguous"),
    [
        (
            1,
            [
                ("insert", [5, 6, 7, 5, 8, 9, 10, 11]),
                ("insert", [5, 6, 7, 5, 8, 9, 12]),
                ("insert", [5, 6, 7, 5, 6, 7, 5]),  # a new node under the later 5
                ("evict", [5, 6, 7, 5, 8, 9, 12]),
                ("evict", [5, 6, 7, 5, 6, 7, 5]),  # removes 6, 7, 5, each also cached higher up
                ("insert", [5, 6, 7, 5, 5, 5]),  # 5 at four places
                ("evict", [5, 6, 7, 5, 5, 5]),  # two removals of 5, peeled leaf by leaf
                ("evict", [5, 6, 7, 5, 8, 9, 10, 11]),
                ("evict", [5, 6, 7, 5, 8, 9]),
                ("evict", [5, 6, 7, 5]),  # two removals of 5 and two blocks: both go
            ],
            0,
        ),
        (
            4,
            [
                ("insert", [1, 2, 3, 4, 1, 2, 3, 4, 9, 9, 9, 9]),  # two identical consecutive pages
                ("insert", [1, 2, 3, 4, 1, 2, 3, 4, 1, 2, 3, 4, 7, 7, 7, 7]),
                ("insert", [1, 2, 3, 4, 1, 2, 3, 4, 1, 2, 3, 4, 7, 7, 7, 7, 1, 2, 3, 4]),
                ("evict", [1, 2, 3, 4, 1, 2, 3, 4, 1, 2, 3, 4, 7, 7, 7, 7, 1, 2, 3, 4]),
                ("evict", [1, 2, 3, 4, 1, 2, 3, 4, 1, 2, 3, 4, 7, 7, 7, 7]),
                ("evict", [1, 2, 3, 4, 1, 2, 3, 4, 9, 9, 9, 9]),
                ("insert", [9, 9, 9, 9, 1, 2, 3, 4]),
                # [1, 2, 3, 4] twice, three cached copies, two of them leaves: ambiguous in
                # SGLang's format; the oldest leaf goes first, which is the true one here
                ("evict", [1, 2, 3, 4, 1, 2, 3, 4]),
                ("evict", [9, 9, 9, 9, 1, 2, 3, 4]),
            ],
            2,
        ),
    ],
    ids=["page-1", "page-4"],
)
def test_sglang_repeated_content_matches_the_engine_cache(page: int, steps: list[tuple[str, list[int]]], ambiguous: int) -> None:
    engine, units = SGLangEngine(page), Units()
    lengths = [1, 2, 3, 4, 5, 6, 8, 12, 16, 20]
    a = WorkerAgent("w0", NS, lengths, 3, incarnation=boot_incarnation(BOOT_NS))
    for n, (what, tokens) in enumerate(steps):
        frames = engine.insert(tokens) if what == "insert" else engine.evict(tokens)
        units.send(a, a.on_message(frames))
        expect = engine.implied(lengths)
        assert held(a) == expect, (n, what, tokens)
        assert units.holds() == expect, n
    assert a.stats.conflicts == a.stats.unknown_removals == units.rejected == 0 and a.stats.ambiguous_removals == ambiguous
    assert a.stats.ambiguous_parents > 0 and held(a) == {} and len(a) == 0


@given(
    page=st.sampled_from([1, 2]),
    prompts=st.lists(st.lists(st.integers(0, 5), min_size=1, max_size=10), min_size=1, max_size=6),
    steps=st.lists(st.tuples(st.sampled_from(["insert", "insert", "evict"]), st.integers(0, 99), st.integers(1, 3)), min_size=1, max_size=24),
)
def test_sglang_content_hashes_match_the_engine_cache_until_ambiguous(page: int, prompts: list[list[int]], steps: list[tuple[str, int, int]]) -> None:
    """Random radix histories with repeated content: the agent is exact until SGLang's format
    is itself ambiguous (a new node under a page whose content is cached at several places, or
    a removal the agent reports as ambiguous)."""
    prompts = [p[: len(p) // page * page] for p in prompts if len(p) >= page]
    if not prompts:
        return
    lengths = [1, 2, 3, 5, 8]
    engine, a, sink = SGLangEngine(page), WorkerAgent("w0", NS, lengths, 2), Sink(2)
    for n, (kind, i, k) in enumerate(steps):
        if kind == "insert":
            frames = engine.insert(prompts[i % len(prompts)])
        else:
            leaves = [path for node, path in engine.nodes() if not node.children]
            if not leaves:
                continue
            frames = engine.evict(*(list(t) for t in {tuple(leaves[(i + j) % len(leaves)]): None for j in range(k)}))
        before = a.stats.ambiguous_removals
        sink.apply(a.on_message(frames))
        if engine.ambiguous or a.stats.ambiguous_removals != before:
            event(f"ambiguous after {'a few' if n < 8 else 'many'} steps")
            return
        note(f"step {n}: {kind} {i} {k}")
        assert held(a) == sink.keys == engine.implied(lengths)
    event("never ambiguous")
    event(f"look-alike parents: {'some' if a.stats.ambiguous_parents else 'none'}")
    assert a.stats.conflicts == a.stats.unknown_removals == 0


def test_array_events_from_an_in_process_engine_key_like_decoded_tuples() -> None:
    """The simulator hands its emulated engine's uint64 hashes and uint32 tokens over as arrays
    (no Python int per block or token); the forest must key them exactly as the decoded tuples
    a wire message gives, for int hashes and salted (extra-keyed) first blocks alike."""
    from kvcompass.agent import EngineBatch

    rng = np.random.default_rng(7)
    toks = rng.integers(0, 50_000, 8 * 4, dtype=np.uint32)
    hashes = np.array([11, 12, 13, 14], dtype=np.uint64)
    tail = np.array([21, 22], dtype=np.uint64)
    tail_toks = rng.integers(0, 50_000, 8 * 2, dtype=np.uint32)
    lengths = [4, 8, 16, 24, 32, 40, 48]

    def run(as_arrays: bool) -> tuple[dict[int, int], bytes]:
        a = WorkerAgent("w0", NS, lengths, 2, block_size=8)
        sink = Sink(2)
        first = BlockStored(
            block_hashes=hashes if as_arrays else tuple(hashes.tolist()),
            parent_block_hash=None,
            token_ids=toks if as_arrays else tuple(toks.tolist()),
            block_size=8,
        )
        more = BlockStored(
            block_hashes=tail if as_arrays else tuple(tail.tolist()),
            parent_block_hash=14,
            token_ids=tail_toks if as_arrays else tuple(tail_toks.tolist()),
            block_size=8,
            medium="CPU",
        )
        for seq, e in enumerate([first, more]):
            sink.apply(a.on_batch(EngineBatch(seq, float(seq), (e,), digest=bytes([seq]))))
        return sink.keys, a.digest()

    keys, digest = run(as_arrays=True)
    assert (keys, digest) == run(as_arrays=False)
    whole = np.concatenate([toks, tail_toks]).tolist()
    assert [keys.get(k, 0) for k in keys_of(whole, lengths)] == [1, 1, 1, 1, 1, 2, 2]  # GPU to 32, then CPU


def test_cache_events_feed_the_forest_as_the_event_objects_do() -> None:
    """The simulator hands an emulated cache's events to the agent as ``CacheEvents`` (Rust
    values, no object per event): the same batches, keys, stats and state as the same events
    as :mod:`kvcompass.agent.events` objects, through stores in both media, demotions, evictions
    (removal runs), and salts served, named by the tenant prefix, and not served."""
    from kvcompass._core import BlockCache, CacheEvents
    from kvcompass.engine.cache import PrefixCache, salt_seed

    salts = ("t1", "t2", "kvcompass:t3", "stranger")
    served = {"t1": kc.Namespace("llama-3.1-8b", "t1"), "t2": kc.Namespace("llama-3.1-8b", "t2")}
    core = BlockCache(4, 24, 40, False, 3)
    objects = PrefixCache(4, 24 * 4, 40 * 4, hash_seed=3)  # turns the raw tuples into event objects
    objects.use_salts(salts)
    a = agent(LENGTHS, salts=served, tenant_salts=True, block_size=4)
    b = agent(LENGTHS, salts=served, tenant_salts=True, block_size=4)
    rng = np.random.default_rng(11)
    heads = [rng.integers(0, 50_000, size=24, dtype=np.uint32) for _ in range(5)]
    kinds: set[str] = set()
    for seq in range(300):
        tokens = np.concatenate([heads[int(rng.integers(5))][: int(rng.integers(4, 25))], rng.integers(0, 50_000, size=int(rng.integers(0, 13)), dtype=np.uint32)])
        salt = int(rng.integers(0, len(salts) + 1))
        seed = salt_seed(salts[salt - 1]) if salt else 0
        raw = core.place_dram(tokens, seed, float(seq), salt) if rng.random() < 0.25 else core.place_vram(tokens, seed, float(seq), salt, True)
        kinds.update(("stored" if e[0] else "removed") + str(e[1]) for e in raw)
        digest = seq.to_bytes(8, "big")
        out_a = a.on_batch(EngineBatch(seq, float(seq), tuple(objects.events_from_core(raw, token_arrays=True)), digest=digest))
        out_b = b.on_batch(EngineBatch(seq, float(seq), (), digest=digest, cache_events=CacheEvents(raw, 4), salts=salts))
        assert [(x.shard, x.seq, x.reset, x.keys.tolist(), x.tiers.tolist()) for x in out_a.batches] == [
            (x.shard, x.seq, x.reset, x.keys.tolist(), x.tiers.tolist()) for x in out_b.batches
        ]
    assert a.digest() == b.digest() and a.held() == b.held() and a.stats == b.stats
    assert kinds == {"stored1", "stored2", "removed1", "removed2"}
    assert a.stats.unindexed > 0 and set(a.held().values()) == {kc.Tier.VRAM, kc.Tier.DRAM}  # "stranger" chains unindexed; both tiers held


def test_cache_events_of_another_block_size_are_refused_whole() -> None:
    from kvcompass._core import BlockCache, CacheEvents

    raw = BlockCache(4, 8, 0, False).place_vram(np.arange(16, dtype=np.uint32), 0, 0.0, 0, True)
    a = agent(LENGTHS, block_size=8)
    before = a.digest()
    with pytest.raises(InvalidEventError, match="blocks of 4 tokens; this agent expects 8"):
        a.on_batch(EngineBatch(0, 0.0, (), digest=b"0", cache_events=CacheEvents(raw, 4)))
    assert a.digest() == before and a.stats.malformed == 1
    with pytest.raises(ValueError, match=r"events\[0\]: 16 tokens for 4 blocks of 8"):
        CacheEvents(raw, 8)


def test_the_forest_refuses_a_store_whose_tokens_do_not_fill_its_blocks() -> None:
    """The forest places a block's tokens by its size (a block's start is where its parent's
    hashed bytes end), so a store whose tokens are not exactly its blocks' is refused whole."""
    from kvcompass._core import AgentForest

    f = AgentForest([4, 8], NS.digest)
    for tokens in (np.arange(3, dtype=np.uint32), np.arange(3, dtype="<u4").tobytes() + b"\x00\x00"):
        with pytest.raises(ValueError, match=r"tokens: (12|14) bytes for 1 blocks of 4 tokens"):
            f.stored(0, "GPU", 4, tokens, False, None, [1], None, None)
    assert len(f) == 0 and f.flush(3, []) == []
    # A block keeps its group and size in 16 bits: a larger one is refused, not truncated.
    for group, size in ((65536, 4), (0, 65536)):
        with pytest.raises(ValueError, match="a block forest keeps each below 65536"):
            f.stored(group, "GPU", size, np.arange(size, dtype=np.uint32), False, None, [1], None, None)
    assert len(f) == 0
    f.stored(65535, "GPU", 4, np.arange(4, dtype=np.uint32), False, None, [9], None, None)
    f.removed([(65535, "GPU", [9])])
    assert len(f) == 0
    f.stored(0, "GPU", 4, np.arange(8, dtype=np.uint32), False, None, [1, 2], None, None)
    assert len(f) == 2 and sorted(k for _, keys, _ in f.flush(3, []) for k in keys.tolist()) == sorted(keys_of(list(range(8)), [4, 8]))


def test_cache_events_with_a_salt_the_roots_do_not_name_change_nothing() -> None:
    from kvcompass._core import AgentForest, BlockCache, CacheEvents
    from kvcompass.engine.cache import salt_seed

    core = BlockCache(4, 16, 0, False)
    plain = core.place_vram(np.arange(8, dtype=np.uint32), 0, 0.0, 0, True)
    salted = core.place_vram(np.arange(100, 108, dtype=np.uint32), salt_seed("t2"), 1.0, 2, True)
    f = AgentForest([4, 8], NS.digest)
    for roots, match in (((None, None), "no entry for salt number 2"), ((None, None, b"short"), r"roots\[2\]: expected 32 bytes or None")):
        with pytest.raises(ValueError, match=match):
            f.cache_events(CacheEvents(plain + salted, 4), roots)
        assert len(f) == 0 and f.flush(3, []) == []
    f.cache_events(CacheEvents(plain + salted, 4), (None, None, kc.Namespace("llama-3.1-8b", "t2").digest))
    assert len(f) == 4


def test_joining_a_long_running_engine_replays_the_whole_ring_in_order() -> None:
    """Review, twenty-fourth session: an agent joining an engine whose ring had moved far past
    seq 0 buffered every reply, overflowed its buffer, resynced to the live seq and dropped the
    rest of the replay as duplicates: a block stored early in the ring and evicted late stayed
    claimed."""
    a, sink = agent(LENGTHS, max_buffered=16), Sink(3)
    ring, live = range(100, 200), 200

    def payload(seq: int) -> bytes:
        if seq == 110:
            return msg(seq, BlockStored((777,), None, tuple(T[:4]), 4))[2]
        if seq == 190:
            return msg(seq, BlockRemoved((777,)))[2]
        return msg(seq)[2]

    out = a.on_message(msg(live))
    assert out.replay == ReplayRequest(0)
    sink.apply(out)
    for s in ring:
        sink.apply(a.on_replay(encode_replay(s, payload(s))))
    sink.apply(a.on_replay(encode_replay_end()))
    assert a.last_seq == live and a.stats.resyncs == 1 and a.stats.duplicates == 0
    assert sink.keys == {}  # stored at 110, evicted at 190: not claimed


def test_a_hybrid_models_other_kv_groups_are_counted_and_said_once(caplog: pytest.LogCaptureFixture) -> None:
    """Review, twenty-fourth session: with several KV cache groups a prefix counts as held while
    any group holds it (vLLM needs every group): a known gap (docs/engines.md). The agent says
    so once in its log and counts such stores."""
    import logging

    a = agent(LENGTHS)
    with caplog.at_level(logging.WARNING, logger="kvcompass.agent.agent"):
        for seq in range(3):
            a.on_message(encode_batch([BlockStored((11 + 10 * seq,), None, tuple(T[:4]), 4, group_idx=g) for g in (0, 1)], seq, float(seq)))
    assert a.stats.other_groups == 3
    assert sum("KV cache group 1" in r.getMessage() for r in caplog.records) == 1


def test_a_new_agents_first_heartbeat_is_its_reset() -> None:
    """Review, twenty-fourth session: an agent restarted with its engine (both empty) sent
    heartbeats that opened each shard's sequence without a reset, so the dead engine's claims
    stayed at the units until the new engine published something."""
    a = agent(LENGTHS)
    hb = a.heartbeat()
    assert [b.reset for b in hb] == [True] * 3 and [b.seq for b in hb] == [1, 1, 1]
    sink = Sink(3)
    sink.keys = {k: 1 for k in range(30)}  # what the unit held for the dead incarnation
    sink.apply(hb)
    assert sink.keys == {}
    assert [b.reset for b in a.heartbeat()] == [False] * 3  # one reset per incarnation


def test_a_replay_that_starts_at_a_message_held_live_applies_it() -> None:
    """Review, twenty-fifth session: a live message that opened a gap was buffered; when the
    engine's replay ring started exactly at it, its reply counted as a duplicate, and the next
    reply, resyncing past the gap, dropped it as stale: a removal never applied."""
    tokens = tuple(range(1000, 1016))

    def msg(seq: int, *ev: Any) -> list[bytes]:
        return encode_batch(list(ev), seq, float(seq))

    eng = {s: msg(s) for s in range(12)}
    eng[0] = msg(0, BlockStored((1,), None, tokens[:4], 4))
    eng[10] = msg(10, BlockRemoved((1,)))  # block 1 evicted at seq 10
    a = WorkerAgent("w0", NS, [4, 8], 1)
    a.on_message(eng[0])
    assert len(a.held()) == 1
    assert a.on_message(eng[10]).replay is not None  # seqs 1..9 lost
    for s in (10, 11):  # the ring now starts at 10, the live message itself
        a.on_replay(encode_replay(s, eng[s][2]))
    a.on_replay(encode_replay_end())
    assert a.last_seq == 11 and dict(a.held()) == {}  # the engine holds nothing
