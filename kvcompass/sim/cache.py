"""A worker's prefix KV cache: block-granular, two tiers (VRAM and host DRAM), LRU or LFU,
publishing the KV events a vLLM worker with CPU offloading would.

Sans-I/O and deterministic: time is passed in, and every choice (block identity, victims, event
order) depends only on the calls made.

**Blocks.** A prompt is cut into blocks of ``block_size`` tokens; a trailing partial block is
never cached (vLLM caches full blocks only). A block is identified by a chained content hash:
the first 64 bits of SHA-256 over (seed, parent hash, the block's tokens as little-endian u32),
computed for a whole prompt in one Rust call (:func:`kvcompass._core.block_chain_hashes`), so
equal token prefixes give equal chains, a block's hash names its whole prefix, and hashes are
ints in 0..2**64-1 that are the same in every run (``hash_seed`` varies them per emulated
engine, as vLLM's per-process seed does). The cached blocks form a forest (a radix tree over blocks). Two blocks sharing a
64-bit hash are taken to be one block: the chance of that among n blocks is about n²/2**65.

**Cache salt.** Every call takes an optional ``salt`` (vLLM's per-request ``cache_salt``, a
tenant's private namespace): a salted prompt's chain is seeded by the salt as well, so prompts
with equal tokens and different salts share no block, and the stored event of a run that starts
a salted prompt carries ``extra_keys = [[salt], None, ...]`` as vLLM publishes it.

**Tiers.** Every cached block is in exactly one tier. Capacities are in tokens (multiples of
``block_size``; VRAM must hold at least one block, DRAM may be 0). Two invariants hold after
every call (the tests check both):

1. *Contiguity*: a cached block's parent is cached (in either tier). A cached prefix is a
   contiguous chain from the prompt start, which is what an engine can reuse.
2. *VRAM is prefix-closed*: a VRAM block's parent is in VRAM. Along any chain the VRAM blocks
   come first and the DRAM blocks, if any, are a suffix, so a lookup reuses a VRAM head and
   reloads a DRAM tail.

**Eviction only takes leaves, per tier**, which is what keeps both invariants:

* a *VRAM leaf* is a VRAM block with no child in VRAM (it may have DRAM children); when VRAM
  needs room the policy's least-valued VRAM leaf is *demoted* to DRAM (or dropped outright when
  DRAM capacity is 0);
* a *DRAM leaf* is a DRAM block with no cached child at all; when DRAM needs room the policy's
  least-valued DRAM leaf is *evicted* (removed from the cache).

LRU values a block by its last use ``(now, stamp)``; LFU by ``(uses, now, stamp)``: fewest uses
first, ties by recency. ``stamp`` is a counter that orders uses made at the same ``now`` (the
blocks of one prompt get increasing stamps, parent first). Every use of a block is a use of
its ancestors (copies to DRAM aside), so restricting victims to leaves costs the policies
little. Blocks the current call is storing or promoting (the prompt's own chain) are never
victims of that call.

**Operations.**

* :meth:`PrefixCache.lookup` (pure): the longest cached prefix of a prompt in whole blocks,
  split into the VRAM head and the DRAM tail.
* :meth:`PrefixCache.admit` after a prefill (the request was served): one use of every full
  block of the prompt, and every one of them ends in VRAM: DRAM blocks of the cached prefix are
  promoted, missing blocks stored, VRAM leaves demoted to make room (DRAM leaves evicted to
  make room for those). Hit statistics are taken here, from the state the request found. A
  prompt of more blocks than VRAM holds keeps only its first ``vram`` blocks.
* :meth:`PrefixCache.copy_in` for migrations: to VRAM (a same-region KV copy) it places the
  chain as ``admit`` does, without counting a request; to DRAM (a cross-region recompute that
  lands in host memory so it evicts nothing that serves from VRAM) it stores the missing blocks
  in DRAM and moves or touches nothing already cached. A copy to VRAM counts as one use of
  the chain, as an admit does; a copy to DRAM as one use of each block it stores.
* :meth:`PrefixCache.clear`.

**Events.** Every mutating call returns the events a vLLM worker would publish for it, in
:mod:`kvcompass.agent.events` types with ``medium`` "GPU" or "CPU", netted over the call:
``BlockStored`` (one per contiguous run, with the run's parent hash and tokens) for blocks that
entered a tier, ``BlockRemoved`` for blocks that left one. A demotion is ``BlockStored(CPU)``
then ``BlockRemoved(GPU)``; a promotion ``BlockStored(GPU)`` then ``BlockRemoved(CPU)``; an
eviction from DRAM ``BlockRemoved(CPU)``; a block demoted and then evicted within one call shows
only as ``BlockRemoved(GPU)``. Order within a call: the CPU stores of demotions, the GPU
removals, the CPU removals of evictions, then the GPU store of the prompt's chain and the CPU
removal of its promoted blocks. Fed to :class:`~kvcompass.agent.WorkerAgent`, they leave the
agent holding exactly the prefixes the cache holds (the property test checks it).

**Not modelled.** Blocks of requests still running are not reference-counted between calls
(vLLM never evicts those): a driver that admits at prefill start and decodes for a while may
see them demoted meanwhile. Generated (decode) tokens are not cached; a follow-up turn caches
them when it is admitted as part of its prompt.

**Cost.** Each call costs O(blocks of the prompt + blocks moved × log(cache)): per-tier heaps of
leaves with lazy deletion (an entry is live while its block is still a leaf of that tier with
the same stamp), compacted when stale entries outnumber the tier's blocks, so no call scans the
cache (compaction is amortised O(1) per push).
"""

from __future__ import annotations

import hashlib
import heapq
import math
import struct
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from typing import Literal

import numpy as np
import numpy.typing as npt

from kvcompass._core import block_chain_hashes
from kvcompass.agent.events import AllBlocksCleared, BlockRemoved, BlockStored, Event
from kvcompass.index import Tier, as_tokens

__all__ = ["CacheStats", "CachedBlock", "Policy", "PrefixCache", "GPU_MEDIUM", "CPU_MEDIUM"]

Policy = Literal["lru", "lfu"]
Tokens = Sequence[int] | npt.NDArray[np.uint32]

GPU_MEDIUM = "GPU"
"""vLLM's medium name for its GPU prefix cache (the agent maps it to VRAM)."""
CPU_MEDIUM = "CPU"
"""vLLM's medium name for CPU-offloaded blocks (the agent maps ``CPU*`` to DRAM)."""

_V, _D, _MOVING = 1, 2, 0  # a node's tier; _MOVING while a call lifts it out of DRAM
_COMPACT_SLACK = 64


@dataclass(frozen=True, slots=True)
class CachedBlock:
    """One cached block, as :meth:`PrefixCache.blocks` reports it."""

    block_hash: int
    parent_hash: int | None
    position: int
    """Index of the block in its chain (0: the first block of a prompt)."""
    tier: Tier
    uses: int
    last_used: float


@dataclass(slots=True)
class CacheStats:
    """Counters since construction (``clear`` does not reset them)."""

    admits: int = 0
    copies: int = 0
    clears: int = 0
    prompt_tokens: int = 0  # tokens of admitted prompts
    vram_hit_tokens: int = 0  # of those, found in VRAM
    dram_hit_tokens: int = 0  # of those, found in DRAM (reloaded)
    stored_blocks: int = 0  # blocks that entered the cache (admit and copy_in)
    promoted_blocks: int = 0  # DRAM -> VRAM
    demoted_blocks: int = 0  # VRAM -> DRAM
    evicted_blocks: int = 0  # left the cache (from DRAM, or from VRAM when there is no DRAM)
    truncated_blocks: int = 0  # prompt blocks beyond what VRAM (or DRAM, for copies) could take

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


class _Node:
    __slots__ = ("parent", "tokens", "position", "tier", "uses", "last", "stamp", "nv", "nc", "salt")

    def __init__(self, parent: int | None, tokens: bytes, position: int, tier: int) -> None:
        self.parent = parent
        self.tokens = tokens
        self.position = position
        self.tier = tier
        self.uses = 0
        self.last = 0.0
        self.stamp = 0
        self.nv = 0  # children in VRAM
        self.nc = 0  # children cached (either tier)
        self.salt: str | None = None  # a prompt-start block's cache salt


class _Changes:
    """What one call did, for netting into events."""

    __slots__ = ("cpu_stored", "gpu_removed", "cpu_removed")

    def __init__(self) -> None:
        self.cpu_stored: list[int] = []  # demoted into DRAM
        self.gpu_removed: list[int] = []  # demoted or dropped from VRAM
        self.cpu_removed: list[int] = []  # evicted from DRAM


class PrefixCache:
    """A worker's two-tier, block-granular prefix cache (see the module notes).

    ``vram_tokens`` / ``dram_tokens``: capacities in tokens, multiples of ``block_size``
    (VRAM at least one block). ``policy``: ``"lru"`` or ``"lfu"``. ``hash_seed``: varies the
    block hashes (two caches with different seeds name the same block differently, as two vLLM
    processes do); the events' ``token_ids`` are what the agent keys by, so seeds never change
    what is indexed.
    """

    def __init__(self, block_size: int, vram_tokens: int, dram_tokens: int = 0, policy: Policy = "lru", *, hash_seed: int = 0) -> None:
        if type(block_size) is not int or block_size < 1:
            raise ValueError(f"block_size must be a positive int, got {block_size!r}")
        for name, v, lo in (("vram_tokens", vram_tokens, block_size), ("dram_tokens", dram_tokens, 0)):
            if type(v) is not int or v < lo or v % block_size:
                raise ValueError(f"{name} must be an int >= {lo} and a multiple of block_size {block_size}, got {v!r}")
        if policy not in ("lru", "lfu"):
            raise ValueError(f"policy must be 'lru' or 'lfu', got {policy!r}")
        if type(hash_seed) is not int or not 0 <= hash_seed < 1 << 64:
            raise ValueError(f"hash_seed must be an int in 0..2**64-1, got {hash_seed!r}")
        self.block_size = block_size
        self.policy: Policy = policy
        self.stats = CacheStats()
        self._cap = {_V: vram_tokens // block_size, _D: dram_tokens // block_size}
        self._used = {_V: 0, _D: 0}
        self._lfu = policy == "lfu"
        self._seed = hash_seed
        self._block = struct.Struct(f"<{block_size}I")
        self._nodes: dict[int, _Node] = {}
        self._heaps: dict[int, list[tuple[int, float, int, int]]] = {_V: [], _D: []}
        self._stamp = 0

    # ---- inspection -------------------------------------------------------------------------

    @property
    def vram_capacity_tokens(self) -> int:
        return self._cap[_V] * self.block_size

    @property
    def dram_capacity_tokens(self) -> int:
        return self._cap[_D] * self.block_size

    @property
    def vram_tokens(self) -> int:
        """Tokens cached in VRAM now."""
        return self._used[_V] * self.block_size

    @property
    def dram_tokens(self) -> int:
        """Tokens cached in DRAM now."""
        return self._used[_D] * self.block_size

    def __len__(self) -> int:
        """Blocks cached (both tiers)."""
        return len(self._nodes)

    def tier_of(self, block_hash: int) -> Tier:
        """Where block ``block_hash`` is cached (ABSENT if it is not)."""
        x = self._nodes.get(block_hash)
        return Tier.ABSENT if x is None else Tier(x.tier)

    def blocks(self) -> Iterator[CachedBlock]:
        """Every cached block (O(cache size); for inspection and tests)."""
        for h, x in self._nodes.items():
            yield CachedBlock(h, x.parent, x.position, Tier(x.tier), x.uses, x.last)

    def block_hashes(self, tokens: Tokens, salt: str | None = None) -> list[int]:
        """The chain of hashes of the full blocks of ``tokens`` (cached or not)."""
        return self._bytes(tokens, salt)[1]

    def lookup(self, tokens: Tokens, salt: str | None = None) -> tuple[int, int]:
        """``(vram_hit_tokens, dram_hit_tokens)``: the longest cached prefix of ``tokens`` in whole
        blocks, split into its VRAM head and its DRAM tail (to be reloaded). Changes nothing."""
        v = d = 0
        nodes = self._nodes
        for h in self._bytes(tokens, salt)[1]:
            x = nodes.get(h)
            if x is None:
                break
            if x.tier == _V:
                v += 1
            else:
                d += 1
        return v * self.block_size, d * self.block_size

    # ---- mutation ---------------------------------------------------------------------------

    def admit(self, tokens: Tokens, now: float, salt: str | None = None) -> list[Event]:
        """Record that a request for ``tokens`` was served at ``now``: every full block of the
        prompt (up to VRAM capacity) ends in VRAM. Returns the KV events to publish."""
        return self._to_vram(tokens, now, salt, request=True)

    def copy_in(self, tokens: Tokens, tier: Tier, now: float, salt: str | None = None) -> list[Event]:
        """Place a replica of the full blocks of ``tokens`` in ``tier`` (a migration target).

        VRAM: as :meth:`admit` (promotes, stores, demotes to make room) but counts a copy, not a
        request. DRAM: stores the blocks missing past the cached prefix into DRAM, evicting DRAM
        leaves for room, and leaves cached blocks where they are (so a VRAM head stays in VRAM);
        with no DRAM capacity it does nothing. Returns the KV events to publish."""
        if tier == Tier.VRAM:
            return self._to_vram(tokens, now, salt, request=False)
        if tier == Tier.DRAM:
            return self._to_dram(tokens, now, salt)
        raise ValueError(f"copy_in tier must be Tier.VRAM or Tier.DRAM, got {tier!r}")

    def clear(self) -> list[Event]:
        """Drop everything (vLLM's ``reset_prefix_cache``): ``[AllBlocksCleared()]``."""
        self._nodes.clear()
        self._heaps = {_V: [], _D: []}
        self._used = {_V: 0, _D: 0}
        self.stats.clears += 1
        return [AllBlocksCleared()]

    # ---- the two placements -------------------------------------------------------------------

    def _to_vram(self, tokens: Tokens, now: float, salt: str | None, *, request: bool) -> list[Event]:
        _check_now(now)
        buf, chain = self._bytes(tokens, salt)
        n = len(chain)
        nodes, bs = self._nodes, self.block_size
        k = v = 0  # cached prefix (blocks), its VRAM head
        for h in chain:
            x = nodes.get(h)
            if x is None:
                break
            k += 1
            if x.tier == _V:
                v += 1
        if request:
            self.stats.admits += 1
            self.stats.prompt_tokens += len(buf) // 4
            self.stats.vram_hit_tokens += v * bs
            self.stats.dram_hit_tokens += (k - v) * bs
        else:
            self.stats.copies += 1
        n_cap = min(n, self._cap[_V])
        self.stats.truncated_blocks += n - n_cap
        if n_cap == 0:
            return []
        ids = chain[:n_cap]
        kept = min(k, n_cap)
        # One use of the chain, parent first. Touched blocks get stamps no heap entry carries,
        # so they cannot be picked as victims below; the chain's last block is re-entered at the
        # end (it is the only one of them that can be a VRAM leaf).
        for i in range(kept):
            self._use(nodes[ids[i]], now)
        lifted = ids[v:kept]
        for h in lifted:  # out of DRAM; back in VRAM below
            nodes[h].tier = _MOVING
        self._used[_D] -= len(lifted)
        ch = _Changes()
        self._make_vram_room(n_cap - v, ch, set(ids[:v]))
        for h in lifted:
            x = nodes[h]
            x.tier = _V
            if x.parent is not None:
                nodes[x.parent].nv += 1
        self._used[_V] += len(lifted)
        self.stats.promoted_blocks += len(lifted)
        self._store_run(ids, kept, n_cap, buf, now, salt)
        last = nodes[ids[n_cap - 1]]
        if last.nv == 0:
            self._push(_V, ids[n_cap - 1], last)
        events = self._net(ch)
        if n_cap > v:
            events.append(self._stored_event(ids[v:n_cap], GPU_MEDIUM))
        if lifted:
            events.append(BlockRemoved(tuple(lifted), CPU_MEDIUM))
        return events

    def _to_dram(self, tokens: Tokens, now: float, salt: str | None) -> list[Event]:
        _check_now(now)
        buf, chain = self._bytes(tokens, salt)
        n = len(chain)
        nodes = self._nodes
        self.stats.copies += 1
        parent: int | None = None
        chain_dram: list[int] = []  # the cached prefix's DRAM tail: room it already takes
        k = 0
        for h in chain:
            x = nodes.get(h)
            if x is None:
                break
            if x.tier == _D:
                chain_dram.append(h)
            parent = h
            k += 1
        m = min(n - k, self._cap[_D] - len(chain_dram))
        self.stats.truncated_blocks += n - k - max(m, 0)
        if m <= 0:
            return []
        ch = _Changes()
        pinned = set(chain_dram)
        held: list[int] = []
        while self._used[_D] + m > self._cap[_D]:
            h = self._pop(_D, pinned, held)
            self._remove(h, ch)
        for h in held:
            self._push(_D, h, nodes[h])
        ids: list[int] = []
        for i in range(k, k + m):
            h = chain[i]
            self._store(h, parent, buf, i, _D, now, salt)
            ids.append(h)
            parent = h
        self._push(_D, ids[-1], nodes[ids[-1]])
        events = self._net(ch)
        events.append(self._stored_event(ids, CPU_MEDIUM))
        return events

    def _make_vram_room(self, needed: int, ch: _Changes, pinned: set[int]) -> None:
        """Demote (or, without DRAM, drop) VRAM leaves other than ``pinned`` (the prompt's VRAM
        head, which a demotion below it can turn into a leaf) until ``needed`` more blocks fit."""
        nodes, cap, used = self._nodes, self._cap, self._used
        held: list[int] = []
        while used[_V] + needed > cap[_V]:
            h = self._pop(_V, pinned, held)
            x = nodes[h]
            ch.gpu_removed.append(h)
            if cap[_D] == 0:
                self._remove(h, ch)
                continue
            if used[_D] >= cap[_D]:
                self._remove(self._pop(_D), ch)
            x.tier = _D
            used[_V] -= 1
            used[_D] += 1
            self.stats.demoted_blocks += 1
            ch.cpu_stored.append(h)
            if x.parent is not None:
                p = nodes[x.parent]
                p.nv -= 1
                if p.nv == 0 and p.tier == _V:
                    self._push(_V, x.parent, p)
            if x.nc == 0:
                self._push(_D, h, x)
        for h in held:
            self._push(_V, h, nodes[h])

    # ---- block bookkeeping --------------------------------------------------------------------

    def _use(self, x: _Node, now: float) -> None:
        self._stamp += 1
        x.uses += 1
        x.last = now
        x.stamp = self._stamp

    def _store(self, h: int, parent: int | None, buf: bytes, i: int, tier: int, now: float, salt: str | None = None) -> None:
        w = self._block.size
        x = _Node(parent, buf[i * w : (i + 1) * w], i, tier)
        if parent is None:
            x.salt = salt
        self._use(x, now)
        self._nodes[h] = x
        self._used[tier] += 1
        self.stats.stored_blocks += 1
        if parent is not None:
            p = self._nodes[parent]
            p.nc += 1
            if tier == _V:
                p.nv += 1

    def _store_run(self, ids: list[int], lo: int, hi: int, buf: bytes, now: float, salt: str | None) -> None:
        """``_store`` of blocks ``lo..hi`` of a chain into VRAM, each the child of the one before
        (the first, of block ``lo - 1``, which is cached), in one pass."""
        if lo >= hi:
            return
        nodes, w = self._nodes, self._block.size
        prev = ids[lo - 1] if lo else None
        up = None if prev is None else nodes[prev]
        stamp = self._stamp
        for i in range(lo, hi):
            h = ids[i]
            x = _Node(prev, buf[i * w : (i + 1) * w], i, _V)
            stamp += 1
            x.uses, x.last, x.stamp = 1, now, stamp
            if up is None:
                x.salt = salt
            else:
                up.nc += 1
                up.nv += 1
            nodes[h] = x
            prev, up = h, x
        self._stamp = stamp
        self._used[_V] += hi - lo
        self.stats.stored_blocks += hi - lo

    def _remove(self, h: int, ch: _Changes) -> None:
        """Drop leaf ``h`` from the cache (a DRAM leaf, or a VRAM leaf when there is no DRAM)."""
        x = self._nodes.pop(h)
        self._used[x.tier] -= 1
        self.stats.evicted_blocks += 1
        if x.tier == _D:
            ch.cpu_removed.append(h)
        if x.parent is None:
            return
        p = self._nodes[x.parent]
        p.nc -= 1
        if x.tier == _V:
            p.nv -= 1
            if p.nv == 0 and p.tier == _V:
                self._push(_V, x.parent, p)
        elif p.nc == 0 and p.tier == _D:
            self._push(_D, x.parent, p)

    # ---- victim heaps -----------------------------------------------------------------------

    def _push(self, tier: int, h: int, x: _Node) -> None:
        heap = self._heaps[tier]
        heapq.heappush(heap, (x.uses if self._lfu else 0, x.last, x.stamp, h))
        if len(heap) > 2 * self._used[tier] + _COMPACT_SLACK:
            live = {e for e in heap if self._live(tier, e)}
            self._heaps[tier] = heap = sorted(live)

    def _live(self, tier: int, e: tuple[int, float, int, int]) -> bool:
        x = self._nodes.get(e[3])
        if x is None or x.tier != tier or x.stamp != e[2]:
            return False
        return x.nv == 0 if tier == _V else x.nc == 0

    def _pop(self, tier: int, pinned: set[int] | None = None, held: list[int] | None = None) -> int:
        """The policy's least-valued leaf of ``tier`` (skipping ``pinned``, collected in ``held``
        for the caller to push back)."""
        heap = self._heaps[tier]
        while heap:
            e = heapq.heappop(heap)
            if not self._live(tier, e):
                continue
            if pinned is not None and e[3] in pinned:
                assert held is not None
                held.append(e[3])
                continue
            return e[3]
        raise AssertionError("no evictable leaf in a full tier: the cache invariants are broken")

    # ---- events -------------------------------------------------------------------------------

    def _net(self, ch: _Changes) -> list[Event]:
        events: list[Event] = []
        evicted = set(ch.cpu_removed)
        demoted = set(ch.cpu_stored)
        stored = [h for h in ch.cpu_stored if h not in evicted]
        if stored:
            stored.sort(key=lambda h: self._nodes[h].position)
            for run in self._runs(stored):
                events.append(self._stored_event(run, CPU_MEDIUM))
        if ch.gpu_removed:
            events.append(BlockRemoved(tuple(ch.gpu_removed), GPU_MEDIUM))
        gone = [h for h in ch.cpu_removed if h not in demoted]
        if gone:
            events.append(BlockRemoved(tuple(gone), CPU_MEDIUM))
        return events

    def _runs(self, ids: list[int]) -> list[list[int]]:
        """Group blocks (parents before children) into parent-to-child chains."""
        runs: list[list[int]] = []
        tails: dict[int, int] = {}
        for h in ids:
            p = self._nodes[h].parent
            r = tails.pop(p, None) if p is not None else None
            if r is None:
                r = len(runs)
                runs.append([])
            runs[r].append(h)
            tails[h] = r
        return runs

    def _stored_event(self, run: Sequence[int], medium: str) -> BlockStored:
        nodes = self._nodes
        raw = b"".join([nodes[h].tokens for h in run])
        first = nodes[run[0]]
        # vLLM puts a request's cache salt in the extra keys of its prompt's first block.
        extra = None if first.parent is not None or first.salt is None else ((first.salt,),) + (None,) * (len(run) - 1)
        return BlockStored(
            block_hashes=tuple(run),
            parent_block_hash=first.parent,
            token_ids=struct.unpack(f"<{len(raw) // 4}I", raw),
            extra_keys=extra,
            block_size=self.block_size,
            medium=medium,
        )

    # ---- hashing ------------------------------------------------------------------------------

    def _bytes(self, tokens: Tokens, salt: str | None = None) -> tuple[bytes, list[int]]:
        """The prompt's bytes (blocks are cut from them when stored) and its block chain (a
        salted prompt's chain is seeded by the salt too, so no block is shared across salts)."""
        arr = np.ascontiguousarray(as_tokens(tokens), dtype=np.uint32)
        seed = self._seed if salt is None else self._seed ^ _salt_seed(salt)
        return arr.astype("<u4", copy=False).tobytes(), block_chain_hashes(arr, self.block_size, seed).tolist()


def _salt_seed(salt: str) -> int:
    if not isinstance(salt, str) or not salt:
        raise ValueError(f"salt must be a non-empty string or None, got {salt!r}")
    return int.from_bytes(hashlib.sha256(b"kvcompass-salt\x00" + salt.encode()).digest()[:8], "little")


def _check_now(now: float) -> None:
    if isinstance(now, bool) or not isinstance(now, (int, float)) or not math.isfinite(now):
        raise ValueError(f"now must be a finite number, got {now!r}")
