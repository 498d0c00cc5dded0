"""The simulator's prefix cache: block identity, tier split, the documented LRU/LFU victims,
contiguity, copies, events, and two model checks.

The model checks run random admit / copy / clear histories and, after every call, compare the
cache with (1) a naive O(cache) reference implementing the module's documented rules by full
scans (same state, stamps and victims: this checks the lazy heaps), and (2) a real
:class:`~kvcompass.agent.WorkerAgent` fed the emitted events as vLLM wire messages, whose held
keys must be exactly the prefixes the cache holds at the registration lengths, with tiers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import xxhash
import pytest
from hypothesis import given, note
from hypothesis import strategies as st

import kvcompass as kc
from _support import mix64 as _mix64
from kvcompass.agent import AllBlocksCleared, BlockRemoved, BlockStored, Event, WorkerAgent, encode_batch
from kvcompass.index_types import Tier
from kvcompass.engine.cache import CachedBlock, PrefixCache

NS = kc.Namespace("llama-3.1-8b", "public")


def chain_hashes(tokens: list[int], bs: int, seed: int = 0) -> list[int]:
    """The documented block identity, written out independently (with the reference XXH3)."""
    out: list[int] = []
    h = xxhash.xxh3_64_intdigest(b"kvcompass-block-v2", seed=seed)
    for i in range(len(tokens) // bs):
        h = xxhash.xxh3_64_intdigest(np.array(tokens[i * bs : (i + 1) * bs], dtype="<u4").tobytes(), seed=h)
        out.append(h)
    return out


def tiers(c: PrefixCache, tokens: list[int]) -> list[str]:
    return [c.tier_of(h).name[0] for h in c.block_hashes(tokens)]  # V / D / A


def check_invariants(c: PrefixCache) -> None:
    blocks = {b.block_hash: b for b in c.blocks()}
    assert len(blocks) == len(c)
    nv = sum(b.tier == Tier.VRAM for b in blocks.values())
    nd = sum(b.tier == Tier.DRAM for b in blocks.values())
    assert nv * c.block_size == c.vram_tokens <= c.vram_capacity_tokens
    assert nd * c.block_size == c.dram_tokens <= c.dram_capacity_tokens
    for b in blocks.values():
        assert 0 <= b.block_hash < 1 << 64
        if b.parent_hash is None:
            assert b.position == 0
            continue
        p = blocks.get(b.parent_hash)
        assert p is not None, "contiguity: a cached block's parent is cached"
        assert p.position == b.position - 1
        if b.tier == Tier.VRAM:
            assert p.tier == Tier.VRAM, "VRAM is prefix-closed"


# ---- identity and lookup --------------------------------------------------------------------


def test_block_hashes_are_chained_xxh3_and_deterministic() -> None:
    toks = list(range(10, 27))
    c = PrefixCache(4, 64)
    hs = c.block_hashes(toks)
    assert hs == chain_hashes(toks, 4) and len(hs) == 4  # the trailing partial block is not a block
    assert all(0 <= h < 1 << 64 for h in hs)
    assert PrefixCache(4, 64).block_hashes(np.array(toks, dtype=np.uint32)) == hs
    # Another engine names the same blocks through a bijection of the same chain.
    assert PrefixCache(4, 64, hash_seed=7).block_hashes(toks) == [_mix64(h ^ 7) for h in hs] != hs
    # The same block of tokens under another parent is another block.
    assert c.block_hashes([1, 2, 3, 4, 10, 11, 12, 13])[1] != hs[0]
    assert hs[0] == 13095952635848115055  # pinned: identical in every run and on every machine


def test_lookup_is_the_longest_cached_prefix_in_whole_blocks_split_by_tier() -> None:
    c = PrefixCache(2, vram_tokens=4, dram_tokens=8)
    a = [1, 2, 3, 4, 5, 6, 7]
    assert c.lookup(a) == (0, 0)
    c.admit(a[:4], now=1.0)
    assert c.lookup(a) == (4, 0) and c.lookup(a[:3]) == (2, 0) and c.lookup([1]) == (0, 0)
    assert c.lookup([1, 2, 9, 9]) == (2, 0)  # diverges in the second block
    c.admit([8, 8, 9, 9], now=2.0)  # VRAM holds 2 blocks: a's chain moves to DRAM
    assert tiers(c, a) == ["D", "D", "A"] and c.lookup(a) == (0, 4)
    c.admit([1, 2, 7, 7], now=3.0)  # a's first block is promoted, its second stays in DRAM
    assert tiers(c, a) == ["V", "D", "A"] and c.lookup(a) == (2, 2)
    check_invariants(c)


def test_a_prompt_never_reuses_its_last_token() -> None:
    """What an engine takes from its cache when it schedules a prompt: vLLM caps the hit at
    ``num_tokens - 1`` (the last token is computed for the first output's logits) in whole
    blocks, so a prompt of whole blocks, all cached, recomputes its last block (found in review:
    such a prompt computed nothing and its TTFT was the round trip alone)."""
    c = PrefixCache(2, vram_tokens=8, dram_tokens=0)
    c.admit([1, 2, 3, 4, 5], now=1.0)
    assert c.lookup([1, 2, 3, 4]) == (4, 0) and c.prompt_hit([1, 2, 3, 4]) == (2, 0)
    assert c.prompt_hit([1, 2, 3, 4, 5]) == (4, 0)  # the partial last block is computed anyway
    assert c.prompt_hit([1, 2]) == (0, 0) and c.prompt_hit([1]) == (0, 0) and c.prompt_hit([]) == (0, 0)


def test_lookup_changes_nothing() -> None:
    c = PrefixCache(2, 4, 4, "lfu")
    c.admit([1, 2, 3, 4], 1.0)
    before = list(c.blocks())
    for _ in range(5):
        c.lookup([1, 2, 3, 4])
    assert list(c.blocks()) == before and c.stats.admits == 1


# ---- policies ---------------------------------------------------------------------------------


def test_lru_demotes_the_least_recently_used_leaf() -> None:
    c = PrefixCache(1, vram_tokens=3, dram_tokens=3, policy="lru")
    for t, p in enumerate([[1], [2], [3]]):
        c.admit(p, float(t))
    c.admit([1], 3.0)  # [1] used again: [2] is now the least recent
    ev = c.admit([4], 4.0)
    assert [c.tier_of(h) for h in (c.block_hashes([x])[0] for x in (1, 2, 3, 4))] == [Tier.VRAM, Tier.DRAM, Tier.VRAM, Tier.VRAM]
    h2, h4 = c.block_hashes([2])[0], c.block_hashes([4])[0]
    assert ev == [
        BlockStored((h2,), None, (2,), 1, medium="CPU"),
        BlockRemoved((h2,), "GPU"),
        BlockStored((h4,), None, (4,), 1, medium="GPU"),
    ]
    assert c.stats.demoted_blocks == 1 and c.stats.evicted_blocks == 0


def test_lfu_demotes_the_least_frequently_used_leaf_ties_by_recency() -> None:
    c = PrefixCache(1, vram_tokens=3, dram_tokens=3, policy="lfu")
    c.admit([1], 0.0)
    c.admit([1], 1.0)
    c.admit([2], 2.0)
    c.admit([3], 3.0)
    # uses: [1] 2, [2] 1, [3] 1 -> the least used are [2] and [3]; the older of them goes.
    c.admit([4], 4.0)
    assert tiers(c, [2]) == ["D"] and tiers(c, [3]) == ["V"] and tiers(c, [1]) == ["V"]
    c.admit([5], 5.0)  # [3] and [4] have one use each: [3] is older
    assert tiers(c, [3]) == ["D"] and tiers(c, [4]) == ["V"] and tiers(c, [1]) == ["V"]
    # LRU would have taken [1] (last used at 1.0) both times.
    lru = PrefixCache(1, 3, 3, "lru")
    for t, p in enumerate([[1], [1], [2], [3], [4]]):
        lru.admit(p, float(t))
    assert tiers(lru, [1]) == ["D"]


def test_only_leaves_are_demoted_so_a_chain_stays_contiguous() -> None:
    # The chain's root block is the least recently used block, but it has a VRAM child: the
    # victim is the chain's VRAM leaf, and the chain keeps a VRAM head and a DRAM tail.
    c = PrefixCache(1, vram_tokens=4, dram_tokens=4, policy="lru")
    c.admit([1, 2, 3], 0.0)
    c.admit([9], 1.0)
    c.admit([8], 2.0)
    assert tiers(c, [1, 2, 3]) == ["V", "V", "D"]
    c.admit([7], 3.0)
    assert tiers(c, [1, 2, 3]) == ["V", "D", "D"]
    c.admit([6], 4.0)  # the next leaf is the chain's root now (t=0) before [9] (t=1)
    assert tiers(c, [1, 2, 3]) == ["D", "D", "D"] and tiers(c, [9]) == ["V"]
    check_invariants(c)
    # DRAM is full (3 of the chain + nothing else = 3 of 4); two more demotions evict from DRAM,
    # again leaf first: the chain loses its tail before its head.
    c.admit([5], 5.0)
    c.admit([4], 6.0)
    assert tiers(c, [1, 2, 3]) == ["D", "D", "A"]
    assert c.stats.evicted_blocks == 1
    check_invariants(c)


def test_an_evicted_dram_tail_is_reported_and_a_reused_prefix_promoted() -> None:
    c = PrefixCache(2, vram_tokens=4, dram_tokens=2)
    a, b = [1, 1, 2, 2], [3, 3, 4, 4]
    ha, hb = c.block_hashes(a), c.block_hashes(b)
    c.admit(a, 0.0)
    ev = c.admit(b, 1.0)  # a -> DRAM, but DRAM holds one block: a's tail is evicted
    assert ev == [
        BlockStored((ha[0],), None, (1, 1), 2, medium="CPU"),
        BlockRemoved((ha[1], ha[0]), "GPU"),
        BlockStored(tuple(hb), None, (3, 3, 4, 4), 2, medium="GPU"),
    ]
    assert tiers(c, a) == ["D", "A"]
    ev = c.admit(a, 2.0)  # reuse: a[0] promoted, a[1] stored, b demoted (its tail evicted)
    assert ev == [
        BlockStored((hb[0],), None, (3, 3), 2, medium="CPU"),
        BlockRemoved((hb[1], hb[0]), "GPU"),
        BlockStored(tuple(ha), None, (1, 1, 2, 2), 2, medium="GPU"),
        BlockRemoved((ha[0],), "CPU"),
    ]
    assert tiers(c, a) == ["V", "V"] and tiers(c, b) == ["D", "A"]
    s = c.stats
    assert (s.admits, s.prompt_tokens, s.vram_hit_tokens, s.dram_hit_tokens) == (3, 12, 0, 2)
    assert (s.stored_blocks, s.promoted_blocks, s.demoted_blocks, s.evicted_blocks) == (5, 1, 4, 2)


def test_without_dram_victims_leave_the_cache() -> None:
    c = PrefixCache(1, vram_tokens=2, dram_tokens=0)
    c.admit([1, 2], 0.0)
    h = c.block_hashes([1, 2])
    ev = c.admit([3], 1.0)
    assert ev[0] == BlockRemoved((h[1],), "GPU") and tiers(c, [1, 2]) == ["V", "A"]
    assert c.stats.evicted_blocks == 1 and c.stats.demoted_blocks == 0
    check_invariants(c)


def test_a_prompt_longer_than_vram_keeps_its_first_blocks() -> None:
    c = PrefixCache(1, vram_tokens=3, dram_tokens=2)
    c.admit([9, 9], 0.0)
    ev = c.admit([1, 2, 3, 4, 5], 1.0)
    assert tiers(c, [1, 2, 3, 4, 5]) == ["V", "V", "V", "A", "A"] and tiers(c, [9, 9]) == ["D", "D"]
    assert c.stats.truncated_blocks == 2
    assert isinstance(ev[-1], BlockStored) and ev[-1].token_ids == (1, 2, 3)
    # Blocks of the chain cached in DRAM beyond the cut stay there, below a VRAM head.
    c2 = PrefixCache(1, vram_tokens=2, dram_tokens=4)
    c2.copy_in([1, 2, 5], Tier.DRAM, 0.0)
    c2.admit([1, 2, 5], 1.0)
    assert tiers(c2, [1, 2, 5]) == ["V", "V", "D"] and c2.lookup([1, 2, 5]) == (2, 1)
    check_invariants(c)
    check_invariants(c2)


def test_a_prompt_shorter_than_a_block_caches_nothing() -> None:
    c = PrefixCache(4, 16, 16)
    assert c.admit([1, 2, 3], 0.0) == [] and len(c) == 0
    assert c.stats.admits == 1 and c.stats.prompt_tokens == 3


# ---- copies and clears ------------------------------------------------------------------------


def test_copy_into_dram_stores_the_missing_tail_and_moves_nothing() -> None:
    c = PrefixCache(2, vram_tokens=4, dram_tokens=4)
    a = [1, 1, 2, 2, 3, 3, 4, 4]
    h = c.block_hashes(a)
    c.admit(a[:2], 0.0)
    ev = c.copy_in(a, Tier.DRAM, 1.0)
    assert ev == [BlockStored(tuple(h[1:3]), h[0], (2, 2, 3, 3), 2, medium="CPU")]  # DRAM holds 2
    assert tiers(c, a) == ["V", "D", "D", "A"] and c.stats.truncated_blocks == 1
    assert c.stats.copies == 1 and c.stats.admits == 1 and c.stats.prompt_tokens == 2  # copies are not requests
    # A second copy of another prompt needs room: DRAM leaves go, never the chain it extends.
    b = [1, 1, 2, 2, 7, 7]
    hb = c.block_hashes(b)
    ev = c.copy_in(b, Tier.DRAM, 2.0)
    assert ev == [BlockRemoved((h[2],), "CPU"), BlockStored((hb[2],), h[1], (7, 7), 2, medium="CPU")]
    assert tiers(c, b) == ["V", "D", "D"]
    check_invariants(c)
    assert PrefixCache(2, 4, 0).copy_in(a, Tier.DRAM, 0.0) == []


def test_copy_into_vram_is_an_admit_without_a_request() -> None:
    c = PrefixCache(2, vram_tokens=4, dram_tokens=4)
    a = [1, 1, 2, 2]
    c.copy_in(a, Tier.DRAM, 0.0)
    ev = c.copy_in(a, Tier.VRAM, 1.0)
    h = c.block_hashes(a)
    assert ev == [BlockStored(tuple(h), None, (1, 1, 2, 2), 2, medium="GPU"), BlockRemoved(tuple(h), "CPU")]
    assert tiers(c, a) == ["V", "V"] and c.stats.copies == 2 and c.stats.admits == 0
    assert c.stats.promoted_blocks == 2
    with pytest.raises(ValueError, match="tier"):
        c.copy_in(a, Tier.ABSENT, 2.0)


def test_clear_drops_everything() -> None:
    c = PrefixCache(2, 4, 4)
    c.admit([1, 1, 2, 2], 0.0)
    c.admit([3, 3, 4, 4], 0.0)
    assert c.clear() == [AllBlocksCleared()]
    assert len(c) == 0 and c.vram_tokens == c.dram_tokens == 0 and c.lookup([1, 1, 2, 2]) == (0, 0)
    c.admit([1, 1], 1.0)
    assert tiers(c, [1, 1]) == ["V"] and c.stats.clears == 1


def test_arguments_are_checked() -> None:
    for kw in (
        dict(block_size=0, vram_tokens=4),
        dict(block_size=2, vram_tokens=0),
        dict(block_size=2, vram_tokens=5),
        dict(block_size=2, vram_tokens=4, dram_tokens=3),
        dict(block_size=2, vram_tokens=4, dram_tokens=-2),
        dict(block_size=2, vram_tokens=4, policy="fifo"),
        dict(block_size=2, vram_tokens=4, hash_seed=-1),
    ):
        with pytest.raises(ValueError):
            PrefixCache(**kw)
    c = PrefixCache(2, 4)
    for now in (math.nan, math.inf, True, "1"):
        with pytest.raises(ValueError, match="now"):
            c.admit([1, 2], now)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="tokens"):
        c.admit([1, -2], 0.0)
    with pytest.raises(ValueError, match="tokens"):
        c.lookup([1 << 32, 0])
    assert len(c) == 0


def test_worker_capacities_default_only_what_is_left_out() -> None:
    """A stated 0 DRAM is a worker without offloading; only a capacity left out (None) takes
    the testbed's figure (a falsy default once gave a ``dram_tokens = 0`` worker 1 M tokens)."""
    from kvcompass.engine.cache import DEFAULT_DRAM_TOKENS, DEFAULT_VRAM_TOKENS, worker_capacities

    assert worker_capacities(None, None, 16) == (DEFAULT_VRAM_TOKENS, DEFAULT_DRAM_TOKENS)
    assert worker_capacities(None, 0, 16) == (DEFAULT_VRAM_TOKENS, 0)
    assert worker_capacities(4096, 0, 16) == (4096, 0)
    assert worker_capacities(4096, None, 16) == (4096, 0)  # no DRAM beside a given VRAM
    assert worker_capacities(1000, 5, 16) == (992, 16)  # whole blocks, a DRAM tier keeps one
    # A stated 0 VRAM is not turned into the default: it stays 0, which the cache refuses.
    assert worker_capacities(0, None, 16) == (0, 0)
    with pytest.raises(ValueError, match="vram_tokens"):
        PrefixCache(16, *worker_capacities(0, 64, 16))


def test_victim_heaps_stay_bounded() -> None:
    # Lazy deletion leaves stale entries behind; compaction keeps them to O(cache size).
    c = PrefixCache(1, vram_tokens=8, dram_tokens=8, policy="lfu")
    for t in range(3000):
        c.admit([t % 11, t % 5], float(t))
    assert all(n <= 2 * 8 + 64 for n in c.heap_sizes())
    check_invariants(c)


# ---- model checks -----------------------------------------------------------------------------

PREFIXES = [tuple(range(100, 108)), tuple(range(200, 212)), (300, 301, 302, 303, 304), ()]
LENGTHS = [1, 2, 3, 4, 5, 7, 8, 9, 12, 13, 16, 17, 20, 24]


@dataclass
class Op:
    kind: str
    tokens: list[int]
    now: float


@st.composite
def histories(draw: Any) -> tuple[dict[str, Any], list[Op]]:
    bs = draw(st.sampled_from([1, 2, 4]))
    cfg = dict(
        block_size=bs,
        vram_tokens=bs * draw(st.integers(1, 6)),
        dram_tokens=bs * draw(st.integers(0, 6)),
        policy=draw(st.sampled_from(["lru", "lfu"])),
    )
    ops: list[Op] = []
    now = 0.0
    for _ in range(draw(st.integers(1, 30))):
        kind = draw(st.sampled_from(["admit"] * 6 + ["copy_vram", "copy_dram", "copy_dram", "clear"]))
        prefix = draw(st.sampled_from(PREFIXES))
        tail = draw(st.lists(st.integers(0, 3), max_size=10))
        now += draw(st.sampled_from([0.0, 0.5, 1.0]))  # equal times exercise the stamp order
        ops.append(Op(kind, list(prefix) + tail, now))
    return cfg, ops


def run_op(c: PrefixCache, op: Op) -> list[Event]:
    if op.kind == "admit":
        return c.admit(op.tokens, op.now)
    if op.kind == "copy_vram":
        return c.copy_in(op.tokens, Tier.VRAM, op.now)
    if op.kind == "copy_dram":
        return c.copy_in(op.tokens, Tier.DRAM, op.now)
    return c.clear()


def expected_held(c: PrefixCache, prompts: set[tuple[int, ...]], lengths: list[int] = LENGTHS) -> dict[int, Tier]:
    """Every registration-length prefix of every prompt seen that the cache holds, with the
    agent's tier rules: a chain is VRAM iff every one of its blocks is in VRAM, and a length
    that ends inside a block is covered by every chain through that block's first tokens (two
    prompts that agree on the first 9 tokens but not on the 12th hold length 9 through two
    chains), taking the best tier among them."""
    bs = c.block_size
    out: dict[int, Tier] = {}
    for p in prompts:
        toks = list(p)
        for length in lengths:
            nb = -(-length // bs)
            if nb > len(toks) // bs:
                break
            v, d = c.lookup(toks[: nb * bs])
            if v + d < nb * bs:
                break
            key = int(NS.keys(toks, [length])[0])
            tier = Tier.VRAM if d == 0 else Tier.DRAM
            out[key] = min(out.get(key, tier), tier)
    return out


@given(histories())
def test_a_worker_agent_fed_the_events_holds_exactly_the_cached_prefixes(h: tuple[dict[str, Any], list[Op]]) -> None:
    cfg, ops = h
    c = PrefixCache(**cfg)
    agent = WorkerAgent("w0", NS, LENGTHS, 2, block_size=cfg["block_size"])
    seen: set[tuple[int, ...]] = set()
    seq = 0
    for i, op in enumerate(ops):
        note(f"{i}: {op}")
        events = run_op(c, op)
        seen.add(tuple(op.tokens))
        if events:
            agent.on_message(encode_batch(events, seq, ts=op.now))
            seq += 1
        check_invariants(c)
        assert agent.held() == expected_held(c, seen)
    s = agent.stats
    assert (s.conflicts, s.unknown_removals, s.orphans, s.malformed, s.gaps) == (0, 0, 0, 0, 0)


class RefCache:
    """The documented rules by brute force: victims are found by scanning every block."""

    def __init__(self, block_size: int, vram_tokens: int, dram_tokens: int, policy: str) -> None:
        self.bs, self.lfu = block_size, policy == "lfu"
        self.cap = {"V": vram_tokens // block_size, "D": dram_tokens // block_size}
        self.nodes: dict[int, dict[str, Any]] = {}
        self.stamp = 0

    def used(self, t: str) -> int:
        return sum(x["tier"] == t for x in self.nodes.values())

    def key(self, h: int) -> tuple[float, float, int]:
        x = self.nodes[h]
        return (x["uses"] if self.lfu else 0, x["last"], x["stamp"])

    def has_child(self, h: int, tiers_: str) -> bool:
        return any(x["parent"] == h and x["tier"] in tiers_ for x in self.nodes.values())

    def victim(self, tier: str, exclude: set[int]) -> int:
        inside = "V" if tier == "V" else "VDM"  # a DRAM leaf has no cached child at all
        leaves = [h for h, x in self.nodes.items() if x["tier"] == tier and h not in exclude and not self.has_child(h, inside)]
        return min(leaves, key=self.key)

    def use(self, h: int, now: float) -> None:
        self.stamp += 1
        x = self.nodes[h]
        x["uses"] += 1
        x["last"], x["stamp"] = now, self.stamp

    def new(self, h: int, parent: int | None, pos: int, tier: str, now: float) -> None:
        self.nodes[h] = dict(parent=parent, pos=pos, tier=tier, uses=0, last=0.0, stamp=0)
        self.use(h, now)

    def prefix(self, ids: list[int]) -> tuple[int, int]:
        k = v = 0
        for h in ids:
            if h not in self.nodes:
                break
            k += 1
            v += self.nodes[h]["tier"] == "V"
        return k, v

    def to_vram(self, ids: list[int], now: float) -> None:
        k, v = self.prefix(ids)
        n_cap = min(len(ids), self.cap["V"])
        kept = min(k, n_cap)
        for h in ids[:kept]:
            self.use(h, now)
        for h in ids[v:kept]:
            self.nodes[h]["tier"] = "M"
        while self.used("V") + n_cap - v > self.cap["V"]:
            w = self.victim("V", set(ids[:v]))
            if self.cap["D"] == 0:
                del self.nodes[w]
                continue
            if self.used("D") >= self.cap["D"]:
                del self.nodes[self.victim("D", set())]
            self.nodes[w]["tier"] = "D"
        for h in ids[v:kept]:
            self.nodes[h]["tier"] = "V"
        for i in range(kept, n_cap):
            self.new(ids[i], ids[i - 1] if i else None, i, "V", now)

    def to_dram(self, ids: list[int], now: float) -> None:
        k, _ = self.prefix(ids)
        pinned = {h for h in ids[:k] if self.nodes[h]["tier"] == "D"}
        m = min(len(ids) - k, self.cap["D"] - len(pinned))
        if m <= 0:
            return
        while self.used("D") + m > self.cap["D"]:
            del self.nodes[self.victim("D", pinned)]
        for i in range(k, k + m):
            self.new(ids[i], ids[i - 1] if i else None, i, "D", now)

    def state(self) -> dict[int, tuple[Any, ...]]:
        return {h: (x["parent"], x["pos"], x["tier"], x["uses"], x["last"], x["stamp"]) for h, x in self.nodes.items()}


def state_of(c: PrefixCache) -> dict[int, tuple[Any, ...]]:
    def row(b: CachedBlock) -> tuple[Any, ...]:
        return (b.parent_hash, b.position, b.tier.name[0], b.uses, b.last_used)

    return {b.block_hash: row(b) for b in c.blocks()}


@given(histories())
def test_the_cache_matches_a_brute_force_reference(h: tuple[dict[str, Any], list[Op]]) -> None:
    cfg, ops = h
    c, ref = PrefixCache(**cfg), RefCache(**cfg)
    for i, op in enumerate(ops):
        note(f"{i}: {op}")
        run_op(c, op)
        ids = c.block_hashes(op.tokens)
        if op.kind in ("admit", "copy_vram"):
            ref.to_vram(ids, op.now)
        elif op.kind == "copy_dram":
            ref.to_dram(ids, op.now)
        else:
            ref.nodes.clear()
        want = {k: v[:5] for k, v in ref.state().items()}
        assert state_of(c) == want
        k, v = ref.prefix(ids)
        assert c.lookup(op.tokens) == (v * c.block_size, (k - v) * c.block_size)


def test_a_long_deterministic_history_at_engine_block_size() -> None:
    # vLLM's block size, a few hundred blocks of capacity, a Zipf-ish mix of shared preambles.
    rng = np.random.default_rng(7)
    bs = 16
    preambles = [rng.integers(0, 50_000, size=int(n)).tolist() for n in (64, 256, 512, 1024)]
    c = PrefixCache(bs, vram_tokens=bs * 96, dram_tokens=bs * 160, policy="lfu")
    lengths = [64, 128, 256, 512, 1024, 1536]
    agent = WorkerAgent("w0", NS, lengths, 4, block_size=bs)
    seen: list[list[int]] = []
    for t in range(400):
        pre = preambles[min(int(rng.zipf(1.6)) - 1, 3)]
        toks = pre + rng.integers(0, 50_000, size=int(rng.integers(0, 300))).tolist()
        seen.append(toks)
        ev = c.copy_in(toks, Tier.DRAM, float(t)) if t % 17 == 0 else c.admit(toks, float(t))
        agent.on_message(encode_batch(ev, t, ts=float(t)))
    check_invariants(c)
    want = expected_held(c, {tuple(t) for t in seen}, lengths)
    assert agent.held() == want and len(want) > 0
    s = c.stats
    assert s.vram_hit_tokens > 0 and s.dram_hit_tokens > 0 and s.demoted_blocks > 0 and s.evicted_blocks > 0


def test_salted_prompts_share_no_blocks_and_an_agent_keys_them_in_the_tenants_namespace() -> None:
    c = PrefixCache(4, 64, 64)
    toks = list(range(100, 116))
    ev = c.admit(toks, 1.0, salt="tenant-a")
    assert c.lookup(toks, salt="tenant-a") == (16, 0)
    assert c.lookup(toks) == (0, 0) and c.lookup(toks, salt="tenant-b") == (0, 0)
    assert c.block_hashes(toks, salt="tenant-a") != c.block_hashes(toks)
    stored = [e for e in ev if isinstance(e, BlockStored)]
    assert len(stored) == 1 and stored[0].extra_keys == (("tenant-a",), None, None, None)
    plain = c.admit(toks, 2.0)
    assert [e.extra_keys for e in plain if isinstance(e, BlockStored)] == [None]
    with pytest.raises(ValueError, match="salt"):
        c.lookup(toks, salt="")
    # An agent that serves the salt keys the salted chain in the tenant's namespace, the
    # unsalted one in its own; an agent that does not know the salt leaves it unindexed.
    ns_a = kc.Namespace("llama-3.1-8b", "tenant-a")
    lengths = [4, 16]
    agent = WorkerAgent("w0", NS, lengths, block_size=4, salts={"tenant-a": ns_a})
    blind = WorkerAgent("w0", NS, lengths, block_size=4)
    for a in (agent, blind):
        a.on_message(encode_batch(ev, 0, ts=1.0))
        a.on_message(encode_batch(plain, 1, ts=2.0))
    arr = np.array(toks, dtype=np.uint32)
    want_a = kc.prefix_keys(ns_a.digest, arr, np.array(lengths, dtype=np.uint32)).tolist()
    want_plain = kc.prefix_keys(NS.digest, arr, np.array(lengths, dtype=np.uint32)).tolist()
    assert agent.held() == dict.fromkeys(want_a + want_plain, Tier.VRAM)
    assert blind.held() == dict.fromkeys(want_plain, Tier.VRAM) and blind.stats.unindexed == 4
    # tenant_salts: a salt TENANT_SALT_PREFIX + tenant names that tenant without a mapping; a
    # salt without the prefix, or naming no valid tenant, stays unindexed.
    from kvcompass.agent import TENANT_SALT_PREFIX

    c2 = PrefixCache(4, 64, 64)
    ev_acme = c2.admit(toks, 1.0, salt=TENANT_SALT_PREFIX + "tenant-a")
    ev_other = c2.admit(toks, 2.0, salt="someone-else")
    ev_bad = c2.admit(toks, 3.0, salt=TENANT_SALT_PREFIX + "-bad")
    prefixed = WorkerAgent("w0", NS, lengths, block_size=4, tenant_salts=True)
    for seq, ev2 in enumerate((ev_acme, ev_other, ev_bad)):
        prefixed.on_message(encode_batch(ev2, seq, ts=1.0))
    assert prefixed.held() == dict.fromkeys(want_a, Tier.VRAM) and prefixed.stats.unindexed == 8


def test_publish_false_builds_no_events_and_changes_nothing_else() -> None:
    """A cache nobody listens to skips building events; its blocks, tiers and counters are those
    of a publishing one fed the same calls."""
    loud, quiet = PrefixCache(2, 6, 4, "lfu", hash_seed=3), PrefixCache(2, 6, 4, "lfu", hash_seed=3, publish=False)
    calls = [([1, 2, 3, 4, 5, 6], 1.0), ([1, 2, 7, 7], 2.0), ([9, 9, 8, 8, 7, 7], 3.0), ([1, 2, 3, 4], 4.0)]
    for tokens, now in calls:
        assert loud.admit(tokens, now)
        assert quiet.admit(tokens, now) == []
    assert loud.copy_in([5, 5, 6, 6], Tier.DRAM, 5.0) and quiet.copy_in([5, 5, 6, 6], Tier.DRAM, 5.0) == []
    assert list(loud.blocks()) == list(quiet.blocks()) and loud.stats == quiet.stats
    assert quiet.clear() == [AllBlocksCleared()]  # a clear is one event, cheap to say


def test_memory_bytes_counts_the_blocks() -> None:
    c = PrefixCache(16, 16 * 4096, 0)
    empty = c.memory_bytes
    c.admit(np.arange(16 * 2000, dtype=np.uint32), 1.0)
    # 2000 blocks of 16 four-byte tokens at least, plus their table entries.
    assert c.memory_bytes - empty >= 2000 * 16 * 4
