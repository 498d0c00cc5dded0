"""A worker's prefix KV cache: block-granular, two tiers (VRAM and host DRAM), LRU or LFU,
publishing the KV events a vLLM worker with CPU offloading would.

Sans-I/O and deterministic: time is passed in, and every choice (block identity, victims, event
order) depends only on the calls made.

**Blocks.** A prompt is cut into blocks of ``block_size`` tokens; a trailing partial block is
never cached (vLLM caches full blocks only). A block is identified by a chained content hash:
XXH3-64 of the block's tokens (little-endian u32) seeded with its parent's hash (the first
block's seed derived from the salt seed), as :func:`kvcompass._core.block_chain_hashes` computes it for a whole prompt (salt seed 0
without a cache salt), so equal token prefixes give equal chains, a block's hash names its
whole prefix, and hashes are ints in 0..2**64-1 that are the same in every run. A cache with
``hash_seed`` s != 0 names block h ``mix64(h ^ s)`` (SplitMix64's finaliser, a bijection), so
emulated engines name the same block differently, as vLLM's per-process seed makes them do,
from one hash chain per prompt that every cache shares. The cached blocks form a forest (a
radix tree over blocks). Two blocks sharing a 64-bit hash are taken to be one block: the chance
of that among n blocks is about n²/2**65.

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
cache (compaction is amortised O(1) per push). The blocks, heaps and chain hashing live in Rust
(:class:`kvcompass._core.BlockCache`, ``rust/block_cache.rs``), which makes every choice above
exactly as this module's Python implementation did before it (same victims, same events, same
simulation results): a simulated fleet stores and looks up every block of every prompt, and one
Python object per block was most of a baseline scheme's run. The core remembers the chains of
the last four prompts hashed on the thread (compared token for token), since an engine looks a
prompt up on arrival, when it is queued and when its prefill starts before admitting it, and a
scheme with exact global state (the Central Directory) looks it up on every worker. A cache's
memory is reported by :attr:`PrefixCache.memory_bytes` (Python's heap profilers do not see it).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Literal

import numpy as np
import numpy.typing as npt

from kvcompass._core import BlockCache, KvPool
from kvcompass.agent.events import AllBlocksCleared, BlockRemoved, BlockStored, Event
from kvcompass.index_types import Tier, as_tokens

__all__ = ["CacheStats", "CachedBlock", "DEFAULT_DRAM_TOKENS", "DEFAULT_VRAM_TOKENS", "Policy", "PrefixCache", "GPU_MEDIUM", "CPU_MEDIUM", "salt_seed", "worker_capacities"]

Policy = Literal["lru", "lfu"]
Tokens = Sequence[int] | npt.NDArray[np.uint32]

# Used when a topology leaves a worker's capacities out: the testbed's figures (about 12 GiB of
# KV at 128 KiB/token in VRAM, 128 GiB of host DRAM; kvcompass/topologies/testbed-14x3.toml).
DEFAULT_VRAM_TOKENS = 98304
DEFAULT_DRAM_TOKENS = 1048576


def worker_capacities(vram_tokens: int | None, dram_tokens: int | None, block_size: int) -> tuple[int, int]:
    """A worker's VRAM and DRAM capacities in tokens, in whole blocks, as the simulator and the
    emulated workers size their caches. Only a capacity left out (None) takes the testbed's
    figure, and DRAM left out beside a given VRAM is 0 (a worker without offload): a stated 0
    is a tier with no cache, which a falsy default once turned into the testbed's 1 M tokens.
    VRAM is rounded down to whole blocks, so less than one block leaves none and the cache
    refuses it (the cache needs a VRAM block); DRAM above 0 keeps at least one block."""
    vram = DEFAULT_VRAM_TOKENS if vram_tokens is None else vram_tokens
    if dram_tokens is None:
        dram = DEFAULT_DRAM_TOKENS if vram_tokens is None else 0
    else:
        dram = dram_tokens
    return vram // block_size * block_size, max(block_size, dram // block_size * block_size) if dram > 0 else 0


GPU_MEDIUM = "GPU"
"""vLLM's medium name for its GPU prefix cache (the agent maps it to VRAM)."""
CPU_MEDIUM = "CPU"
"""vLLM's medium name for CPU-offloaded blocks (the agent maps ``CPU*`` to DRAM)."""

_V, _D = 1, 2  # the core's tier numbers (Tier.VRAM, Tier.DRAM)


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


_MEDIUM = {_V: GPU_MEDIUM, _D: CPU_MEDIUM}


class PrefixCache:
    """A worker's two-tier, block-granular prefix cache (see the module notes).

    ``vram_tokens`` / ``dram_tokens``: capacities in tokens, multiples of ``block_size``
    (VRAM at least one block). ``policy``: ``"lru"`` or ``"lfu"``. ``hash_seed``: varies the
    block hashes (two caches with different seeds name the same block differently, as two vLLM
    processes do); the events' ``token_ids`` are what the agent keys by, so seeds never change
    what is indexed. ``publish``: whether the mutating calls build their events (a driver
    nobody listens to, such as a simulated worker under a scheme that follows no KV events,
    passes False and gets empty lists; the cache itself is the same either way).
    """

    def __init__(self, block_size: int, vram_tokens: int, dram_tokens: int = 0, policy: Policy = "lru", *, hash_seed: int = 0, publish: bool = True) -> None:
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
        self.publish = bool(publish)
        self._core = BlockCache(block_size, vram_tokens // block_size, dram_tokens // block_size, policy == "lfu", hash_seed)
        # Cache salts by number (0: none), as the core keeps them on prompt-start blocks.
        self._salt_ids: dict[str, tuple[int, int]] = {}  # salt -> (id, the salt's chain seed)
        self._salts: list[str] = [""]

    # ---- inspection -------------------------------------------------------------------------

    @property
    def stats(self) -> CacheStats:
        """A snapshot of the counters."""
        return CacheStats(*self._core.stats())

    @property
    def vram_capacity_tokens(self) -> int:
        return self._core.capacity(_V) * self.block_size

    @property
    def dram_capacity_tokens(self) -> int:
        return self._core.capacity(_D) * self.block_size

    @property
    def vram_tokens(self) -> int:
        """Tokens cached in VRAM now."""
        return self._core.used(_V) * self.block_size

    @property
    def dram_tokens(self) -> int:
        """Tokens cached in DRAM now."""
        return self._core.used(_D) * self.block_size

    def __len__(self) -> int:
        """Blocks cached (both tiers)."""
        return len(self._core)

    def tier_of(self, block_hash: int) -> Tier:
        """Where block ``block_hash`` is cached (ABSENT if it is not)."""
        if type(block_hash) is not int or not 0 <= block_hash < 1 << 64:
            return Tier.ABSENT
        return Tier(self._core.tier_of(block_hash))

    def blocks(self) -> Iterator[CachedBlock]:
        """Every cached block, in the order they were stored (O(cache size); for inspection and tests)."""
        for h, parent, position, tier, uses, last in self._core.blocks():
            yield CachedBlock(h, parent, position, Tier(tier), uses, last)

    @property
    def memory_bytes(self) -> int:
        """Bytes the cache's blocks, tables and heaps take (they live in Rust, where Python's
        heap profilers do not look)."""
        return int(self._core.memory_bytes())

    def heap_sizes(self) -> tuple[int, int]:
        """Entries (live or stale) in the VRAM and DRAM victim heaps: O(cache size) by compaction."""
        return self._core.heap_len(_V), self._core.heap_len(_D)

    def block_hashes(self, tokens: Tokens, salt: str | None = None) -> list[int]:
        """The chain of hashes of the full blocks of ``tokens`` (cached or not)."""
        arr, seed, _ = self._args(tokens, salt)
        out: list[int] = self._core.chain(arr, seed).tolist()
        return out

    def lookup(self, tokens: Tokens, salt: str | None = None) -> tuple[int, int]:
        """``(vram_hit_tokens, dram_hit_tokens)``: the longest cached prefix of ``tokens`` in whole
        blocks, split into its VRAM head and its DRAM tail (to be reloaded). Changes nothing."""
        arr, seed, _ = self._args(tokens, salt)
        v, d = self._core.lookup(arr, seed)
        return v * self.block_size, d * self.block_size

    def prompt_hit(self, tokens: Tokens, salt: str | None = None) -> tuple[int, int]:
        """``(vram_hit_tokens, dram_hit_tokens)`` the prompt ``tokens`` reuses when an engine
        schedules it: :meth:`lookup` of all but its last token. vLLM computes the last token
        again for the first output's logits (``max_cache_hit_length = num_tokens - 1``), so a
        prompt of whole blocks that is all cached recomputes its last block, and its usage's
        ``cached_tokens`` says so. Changes nothing."""
        arr, seed, _ = self._args(tokens, salt)
        v, d = self._core.prompt_hit(arr, seed)
        return v * self.block_size, d * self.block_size

    # ---- mutation ---------------------------------------------------------------------------

    def admit(self, tokens: Tokens, now: float, salt: str | None = None) -> list[Event]:
        """Record that a request for ``tokens`` was served at ``now``: every full block of the
        prompt (up to VRAM capacity) ends in VRAM. Returns the KV events to publish."""
        _check_now(now)
        arr, seed, sid = self._args(tokens, salt)
        return self._events(self._core.place_vram(arr, seed, float(now), sid, True, self.publish))

    def copy_in(self, tokens: Tokens, tier: Tier, now: float, salt: str | None = None) -> list[Event]:
        """Place a replica of the full blocks of ``tokens`` in ``tier`` (a migration target).

        VRAM: as :meth:`admit` (promotes, stores, demotes to make room) but counts a copy, not a
        request. DRAM: stores the blocks missing past the cached prefix into DRAM, evicting DRAM
        leaves for room, and leaves cached blocks where they are (so a VRAM head stays in VRAM);
        with no DRAM capacity it does nothing. Returns the KV events to publish."""
        if tier not in (Tier.VRAM, Tier.DRAM):
            raise ValueError(f"copy_in tier must be Tier.VRAM or Tier.DRAM, got {tier!r}")
        _check_now(now)
        arr, seed, sid = self._args(tokens, salt)
        if tier == Tier.VRAM:
            raw = self._core.place_vram(arr, seed, float(now), sid, False, self.publish)
        else:
            raw = self._core.place_dram(arr, seed, float(now), sid, self.publish)
        return self._events(raw)

    def fit_to_pool(self, pool: KvPool) -> list[Event]:
        """VRAM keeps what ``pool``'s reservations leave of it (``KvPool.fit_cache``, the
        simulator's engine's rule), as a prefill lands: what no longer fits is demoted to DRAM
        (dropped without DRAM). Returns the KV events to publish."""
        return self._events(pool.fit_cache(self._core, self.publish))

    def release_to_pool(self, pool: KvPool, handle: int) -> None:
        """A sequence lets go of its KV in ``pool``: VRAM gets its room back at once (only
        grows, the engine's rule; a later reservation takes its room as its prompt lands)."""
        pool.release(handle, self._core, self.publish)

    def clear(self) -> list[Event]:
        """Drop everything (vLLM's ``reset_prefix_cache``): ``[AllBlocksCleared()]``."""
        self._core.clear()
        return [AllBlocksCleared()]

    # ---- arguments and events -----------------------------------------------------------------

    def _args(self, tokens: Tokens, salt: str | None) -> tuple[npt.NDArray[np.uint32], int, int]:
        """The prompt as a uint32 array, its chain seed (a salted prompt's chain is seeded by the
        salt, so no block is shared across salts; 0 without one) and the salt's number."""
        arr = as_tokens(tokens)
        if salt is None:
            return arr, 0, 0
        known = self._salt_ids.get(salt)
        if known is None:
            known = self._salt_ids[salt] = (len(self._salts), salt_seed(salt))
            self._salts.append(salt)
        return arr, known[1], known[0]

    def use_salts(self, salts: Sequence[str]) -> None:
        """Number the cache salts ``salts`` 1, 2, ... (before any call names another): a driver
        that hands the core salt numbers itself (the simulator's engine) uses one numbering for
        every cache."""
        if len(self._salts) > 1:
            raise ValueError("use_salts must come before any salted call")
        for s in salts:
            self._salt_ids[s] = (len(self._salts), salt_seed(s))
            self._salts.append(s)

    def events_from_core(self, raw: list[tuple[Any, ...]], *, token_arrays: bool = False) -> list[Event]:
        """The core's raw events (``BlockCache.place_*``) as :mod:`kvcompass.agent.events` objects.
        With ``token_arrays`` a stored event's ``token_ids`` and ``block_hashes`` (and a removed
        event's ``block_hashes``) stay the core's uint32 and uint64 arrays (a tuple of thousands
        of Python ints a prompt was a twentieth of a KVCompass simulation). The simulator's
        agents take the engine's events without these objects (``kvcompass._core.CacheEvents``);
        a scheme that follows KV events reads them as objects."""
        return self._events(raw, token_arrays)

    def _events(self, raw: list[tuple[Any, ...]], token_arrays: bool = False) -> list[Event]:
        out: list[Event] = []
        for e in raw:
            if e[0]:
                _, medium, hashes, parent, tokens, salt = e
                ids = hashes if token_arrays else tuple(hashes.tolist())
                # vLLM puts a request's cache salt in the extra keys of its prompt's first block.
                extra = ((self._salts[salt],),) + (None,) * (len(ids) - 1) if salt else None
                toks = tokens if token_arrays else tuple(tokens.tolist())
                out.append(BlockStored(block_hashes=ids, parent_block_hash=parent, token_ids=toks, extra_keys=extra, block_size=self.block_size, medium=_MEDIUM[medium]))
            else:
                out.append(BlockRemoved(e[2] if token_arrays else tuple(e[2].tolist()), _MEDIUM[e[1]]))
        return out


def salt_seed(salt: str) -> int:
    """The chain seed of cache salt ``salt``: a salted prompt's block chain starts from it."""
    if not isinstance(salt, str) or not salt:
        raise ValueError(f"salt must be a non-empty string or None, got {salt!r}")
    return int.from_bytes(hashlib.sha256(b"kvcompass-salt\x00" + salt.encode()).digest()[:8], "little")


def _check_now(now: float) -> None:
    if isinstance(now, bool) or not isinstance(now, (int, float)) or not math.isfinite(now):
        raise ValueError(f"now must be a finite number, got {now!r}")
