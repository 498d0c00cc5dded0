"""Type stubs for the Rust extension ``kvcompass._core`` (checked by ``mypy.stubtest``)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import final

import numpy as np
import numpy.typing as npt

__all__ = [
    "EdgeCore",
    "apply_view_batches",
    "NO_KEY",
    "NO_PARENT",
    "MAX_QUEUE_MS",
    "PATCH_VERSION",
    "namespace_digest",
    "prefix_keys",
    "prefix_keys_batch",
    "prefix_memo_stats",
    "shard_of",
    "block_chain_hashes",
    "expand_block_tokens",
    "chain_block_ids",
    "mix_fold",
    "first_bad_token",
    "token_array",
    "pack_tokens",
    "BlockCache",
    "CacheEvents",
    "SimEngine",
    "KvPool",
    "AgentForest",
    "cost_prefill_ms",
    "cost_reload_ms",
    "cost_decode_step_ms",
    "cost_estimate_ms",
    "cost_chunk_step",
    "cost_saturated_ms",
    "busy_windows",
    "LudoTable",
    "LudoView",
    "ApplyResult",
    "decode_batch_header",
    "QueueEstimates",
    "Router",
    "RouteResult",
    "ByteLevelBpe",
    "bench_lookup_ns",
    "bench_remove_insert_ns",
    "bench_update_ns",
    "bench_route_ns",
    "bench_sha256_ns",
    "bench_mem_latency_ns",
    "bench_timer_ns",
]

NO_KEY: int
NO_PARENT: int
"""``SimEngine.set_parents``: a request that waits for no one."""
MAX_QUEUE_MS: float
"""Marks a prefix length beyond the prompt (keys are 63-bit, so this never collides)."""
PATCH_VERSION: int
"""The patch wire-format version this build reads and writes."""

def namespace_digest(model: str, tenant: str) -> bytes:
    """SHA-256 digest of (model, tenant): the namespace all keys of that sharing group live in."""

def prefix_keys(namespace: bytes, tokens: npt.NDArray[np.uint32], lengths: npt.NDArray[np.uint32]) -> npt.NDArray[np.uint64]:
    """Keys of ``tokens[:c]`` for each ``c`` in ``lengths``, in one SHA-256 pass; ``NO_KEY`` past the prompt."""

def prefix_memo_stats() -> tuple[int, int]:
    """``(hits, misses)`` of the process's prefix memo: plan lengths a route found hashed before,
    and lengths it hashed (``rust/prefix_memo.rs``)."""

def prefix_keys_batch(
    namespace: bytes, tokens: npt.NDArray[np.uint32], offsets: npt.NDArray[np.uint64], lengths: npt.NDArray[np.uint32]
) -> npt.NDArray[np.uint64]:
    """Prompt ``i`` is ``tokens[offsets[i]:offsets[i+1]]``; returns a (prompts, lengths) uint64 array.
    At most 2**32 keys (prompts x lengths): more is refused (InvalidArgumentError) before
    anything is allocated."""

def block_chain_hashes(tokens: npt.NDArray[np.uint32], block_size: int, seed: int) -> npt.NDArray[np.uint64]:
    """Chained 64-bit hashes of the full blocks of ``tokens`` (SHA-256 of domain, ``seed``,
    parent hash and the block's tokens): the emulated engine's block names."""

def expand_block_tokens(ids: npt.NDArray[np.uint64], input_length: int, block_size: int) -> npt.NDArray[np.uint32]:
    """The first ``input_length`` synthetic token ids of blocks ``ids`` (``block_size`` each).
    At most 2**32 tokens: a longer ``input_length`` is refused (InvalidArgumentError) before
    anything is allocated."""

def chain_block_ids(chains: npt.NDArray[np.uint64], counts: npt.NDArray[np.uint64]) -> npt.NDArray[np.uint64]:
    """Block ids ``mix64(chain + j * golden) & (2**63 - 1)`` for ``j = 1..count`` of every run.
    Counts summing past 2**32 (or past 64 bits) are refused (InvalidArgumentError) before
    anything is allocated; the ids are made with the GIL released."""

def mix_fold(h: int, parts: Sequence[int]) -> int:
    """``h`` folded with every part: ``h = mix64(h ^ part)`` (uint64 parts)."""

def token_array(tokens: list[int] | tuple[int, ...]) -> tuple[npt.NDArray[np.uint32], int]:
    """``(uint32 array, -1)``, or ``(empty, i)`` for the first item not an exact int in 0..2**32-1."""

def first_bad_token(tokens: list[int] | tuple[int, ...]) -> int:
    """Index of the first item that is not an exact int in 0..2**32-1 (bools are not), or -1."""

def pack_tokens(tokens: list[int] | tuple[int, ...]) -> bytes:
    """Token ids as little-endian u32 bytes. A bool is not a token id (TypeError), as for
    ``token_array`` and ``first_bad_token``."""

def shard_of(key: int, shards: int) -> int:
    """The shard that owns ``key`` (``key % shards``)."""

_RawStored = tuple[bool, int, npt.NDArray[np.uint64], int | None, npt.NDArray[np.uint32], int]
_RawRemoved = tuple[bool, int, npt.NDArray[np.uint64]]

@final
class BlockCache:
    """The emulated engine's two-tier prefix cache (``kvcompass.engine.cache.PrefixCache`` wraps it
    and documents the model). Tiers are 1 (VRAM) and 2 (DRAM); capacities are in blocks; chains
    are hashed from the tokens under ``salt_seed`` and named through ``name_seed``; ``salt`` is a
    caller's number for a cache salt (0: none), returned with stored runs that start a prompt."""

    def __new__(cls, block_size: int, vram_blocks: int, dram_blocks: int, lfu: bool, name_seed: int = 0) -> BlockCache: ...
    @staticmethod
    def memo_bytes() -> int:
        """Bytes of this thread's chain memo (shared by every cache)."""
    def lookup(self, tokens: npt.NDArray[np.uint32], salt_seed: int) -> tuple[int, int]:
        """``(vram_blocks, dram_blocks)`` of the longest cached prefix."""
    def prompt_hit(self, tokens: npt.NDArray[np.uint32], salt_seed: int) -> tuple[int, int]:
        """``(vram_blocks, dram_blocks)`` the prompt takes when scheduled: never its last token."""
    def place_vram(self, tokens: npt.NDArray[np.uint32], salt_seed: int, now: float, salt: int, request: bool, events: bool = True) -> list[_RawStored | _RawRemoved]:
        """Admit (``request``) or copy the prompt's full blocks into VRAM; the raw events, stores
        as ``(True, medium, hashes, parent, tokens, salt)`` and removals as ``(False, medium, hashes)``."""
    def place_dram(self, tokens: npt.NDArray[np.uint32], salt_seed: int, now: float, salt: int, events: bool = True) -> list[_RawStored | _RawRemoved]:
        """Store the blocks missing past the cached prefix into DRAM; the raw events."""
    def clear(self) -> None: ...
    def set_vram_capacity(self, blocks: int, events: bool = True) -> list[_RawStored | _RawRemoved]:
        """VRAM holds ``blocks`` (>= 1) from now: what no longer fits is demoted (dropped without
        DRAM); the events (empty unless ``events``)."""
    def __len__(self) -> int: ...
    def used(self, tier: int) -> int: ...
    def capacity(self, tier: int) -> int: ...
    def heap_len(self, tier: int) -> int: ...
    def memory_bytes(self) -> int:
        """Heap bytes the cache holds (Rust allocations, invisible to tracemalloc)."""
    def tier_of(self, block_hash: int) -> int: ...
    def stats(self) -> list[int]:
        """The 11 counters in ``CacheStats`` field order."""
    def blocks(self) -> list[tuple[int, int | None, int, int, int, float]]:
        """``(hash, parent, position, tier, uses, last)`` of every block, in storage order."""
    def chain(self, tokens: npt.NDArray[np.uint32], salt_seed: int) -> npt.NDArray[np.uint64]: ...

@final
class CacheEvents:
    """A batch of an emulated cache's events kept as Rust values (the simulator's engine hands one
    to its driver at every admit; ``AgentForest.cache_events`` reads it in place)."""

    def __new__(cls, raw: list[_RawStored | _RawRemoved], block_size: int) -> CacheEvents:
        """From the tuples ``BlockCache.place_*`` returns."""
    @property
    def block_size(self) -> int: ...
    def __len__(self) -> int: ...
    def raw(self) -> list[_RawStored | _RawRemoved]:
        """The events as the tuples ``BlockCache.place_*`` returns."""

_RngState = tuple[int, int, bool, int]
_CostArgs = tuple[float, float, float, float, float, float, float, int]

def cost_prefill_ms(cost: _CostArgs, uncached: int) -> float:
    """``kvcompass.engine.costs.CostModel.prefill_ms`` (the cost forms live here, once)."""
def cost_reload_ms(cost: _CostArgs, dram: int) -> float: ...
def cost_decode_step_ms(cost: _CostArgs, batch: int, context: int) -> float: ...
def cost_estimate_ms(cost: _CostArgs, length: int, vram_hit: int, dram_hit: int, batch: int, context: int, max_batched_tokens: int, chunked: bool) -> float:
    """A waiting prompt's prefill estimate; hits past the prompt (their sum saturating, never
    wrapping) leave nothing to compute."""
def cost_chunk_step(cost: _CostArgs, left: int, extra_ms: float, batch: int, context: int, max_batched_tokens: int) -> tuple[int, float, float]: ...
def cost_saturated_ms(cost: _CostArgs, inputs: npt.NDArray[np.uint64], outputs: npt.NDArray[np.uint64], max_batched_tokens: int, pool_tokens: int = 0) -> tuple[float, float, float, float]:
    """``(prefill_ms, mixed_decode_ms, batched_decode_ms, handed_decode_ms)`` a saturated worker
    (the last: a decode instance) spends per request with nothing reused
    (``kvcompass.sim.capacity``), its batch bounded by a KV pool of ``pool_tokens`` (0:
    unbounded)."""
def busy_windows(
    intervals: list[npt.NDArray[np.float64]], start: float, window: float, edges: npt.NDArray[np.float64]
) -> tuple[npt.NDArray[np.float64], npt.NDArray[np.float64]]:
    """Busy time per (worker, window), not yet divided by the windows' widths, and each
    worker's total busy time (``kvcompass.sim.summary``): ``intervals[w]`` holds worker ``w``'s
    flattened ``(begin, end)`` pairs."""

@final
class AgentForest:
    """The worker agent's block forest (``rust/agent_forest.rs``): ``kvcompass.agent.WorkerAgent``
    decodes and sequences the engine's messages and hands every event to it."""

    def __new__(cls, lengths: list[int], namespace: bytes) -> AgentForest: ...
    def stored(
        self,
        group: int,
        medium: str,
        block_size: int,
        tokens: bytes | npt.NDArray[np.uint32],
        lora: bool,
        parent: int | bytes | None,
        hashes: Sequence[int | bytes] | npt.NDArray[np.uint64],
        extra: list[bool] | None,
        salt_root: bytes | None,
    ) -> None:
        """One BlockStored. ``block_size`` must be in 1..65535 (ValueError otherwise); a forest
        tells at most 65,536 media apart, and a new medium past them is refused
        (InvalidArgumentError), nothing changed."""
    def copied(self, group: int, medium: str, hashes: Sequence[int | bytes] | npt.NDArray[np.uint64]) -> int:
        """Blocks named by hash alone copied to ``medium`` (a token-less, parent-less store, as
        vLLM's offloading connector reports): each held block gains the medium; returns how many
        hashes could not be placed (unknown, or carried by several blocks)."""
        ...
    def removed(self, run: list[tuple[int, str, Sequence[int | bytes] | npt.NDArray[np.uint64]]]) -> None: ...
    def cache_events(self, events: CacheEvents, roots: Sequence[bytes | None]) -> None:
        """An emulated cache's events, as ``stored`` and ``removed`` would take them; ``roots[s]``
        the namespace digest salt number ``s`` keys under (None: not served)."""
    def clear(self) -> None: ...
    def forget_changes(self) -> None: ...
    def flush(self, shards: int, reset: list[int]) -> list[tuple[int, npt.NDArray[np.uint64], npt.NDArray[np.uint8]]]:
        """``(shard, keys, tiers)`` of the key ops since the last flush, and every held key of
        the ``reset`` shards. ``shards`` must be >= 1 and every reset shard below it
        (InvalidArgumentError, nothing changed)."""
    def held(self) -> tuple[npt.NDArray[np.uint64], npt.NDArray[np.uint8]]: ...
    def digest(self) -> bytes: ...
    def __len__(self) -> int: ...
    def memory_bytes(self) -> int:
        """Bytes the forest holds on the heap (blocks, side tables, indexes, key counts)."""
    def memory_breakdown(self) -> dict[str, int]:
        """``memory_bytes`` by part: blocks, fingerprints, key_counts, children, other."""
    def stats(self) -> list[int]: ...

@final
class KvPool:
    """One worker's KV pool (``rust/sim/kv_pool.rs``): the VRAM its running sequences and its
    prefix cache share, counted in blocks; a block several sequences hold counts once. Chains
    are chained block ids (:meth:`BlockCache.chain`'s): an id names its whole prefix, which the
    exact count relies on."""

    def __new__(cls, blocks: int) -> KvPool: ...
    def fits(self, chain: npt.NDArray[np.uint64], extra: int) -> bool:
        """Whether a sequence of these full prompt blocks and ``extra`` reserved blocks fits
        beside the held ones (true when none are held)."""
    def hold(self, chain: npt.NDArray[np.uint64], extra: int) -> int:
        """Hold the chain and reserve ``extra`` blocks; the handle :meth:`release` takes."""
    def release(self, handle: int, cache: BlockCache | None = None, events: bool = True) -> None:
        """Let go of what ``handle`` holds (InvalidArgumentError if it holds nothing); with
        ``cache``, give it its room back at once (only grows it)."""
    def fit_cache(self, cache: BlockCache, events: bool = True) -> list[_RawStored | _RawRemoved]:
        """``cache`` keeps what the reservations leave of the pool (as a prefill lands); what no
        longer fits is demoted, its events returned (empty unless ``events``)."""
    @staticmethod
    def extra_blocks(prompt_len: int, answer: int, sequences: int, block_size: int) -> int:
        """Blocks a sequence reserves beyond its prompt's full blocks: the partial last block and
        ``sequences`` answers of ``answer`` tokens, each but its last token."""
    @property
    def cache_blocks(self) -> int:
        """Blocks the prefix cache keeps: the pool less the reservations, at least one."""
    @property
    def held(self) -> int: ...
    @property
    def reserved(self) -> int: ...

@final
class SimEngine:
    """The simulator's engine (``rust/sim/``): clock, workers, caches, in-flight accounting, WAN
    and fault draws, records, and the baselines that run inside it. ``kvcompass.sim.engine``
    builds it and drives it (``run(driver)``); see that module for every argument."""

    def __new__(
        cls,
        cost: tuple[float, float, float, float, float, float, float, int],
        transfer_gbps: float,
        chunked: bool,
        max_batched_tokens: int,
        wan_jitter: float,
        segment_steps: int,
        indexed: bool,
        handoff: bool,
        rtt: npt.NDArray[np.float64],
        has_edge: list[bool],
        region_workers: list[list[int]],
        decoders: list[list[int]],
        worker_regions: npt.NDArray[np.uint32],
        worker_beta: npt.NDArray[np.float64],
        caches: list[BlockCache],
        publish: list[bool],
        queue_to_edge: list[bool],
        arrival_ms: npt.NDArray[np.float64],
        region: npt.NDArray[np.uint32],
        edge_region: npt.NDArray[np.uint32],
        input_length: npt.NDArray[np.uint64],
        output_length: npt.NDArray[np.uint64],
        block_size: npt.NDArray[np.uint32],
        salt: npt.NDArray[np.uint32],
        salt_seed: npt.NDArray[np.uint64],
        ids: npt.NDArray[np.uint64],
        id_offsets: npt.NDArray[np.uint64],
        id_runs: list[bool],
        rng_state: _RngState,
        fault_state: _RngState,
        progress_every: int,
        kv_pool: bool = False,
    ) -> SimEngine: ...
    def return_caches(self, caches: list[BlockCache]) -> None:
        """Move the caches' blocks back into the constructor's ``BlockCache`` objects."""
    def run(self, driver: object) -> None:
        """Replay to the end, calling the driver's ``choose``, ``handoff``, ``events``,
        ``respond``, ``queue`` and ``progress`` and the callbacks given to ``at``."""
    def set_least_loaded(self, pools: list[list[int]], per_region: bool) -> None: ...
    def set_salts(self, h64: list[int], repr: list[str]) -> None: ...
    def set_consistent_hash(self, levels: list[int], rings: list[tuple[npt.NDArray[np.uint64], list[int]]]) -> None: ...
    def set_chord(self, levels: list[int], ids: list[int], nodes: list[int], regions: list[int], fingers: list[list[int]], entry: list[int | None]) -> None:
        """Chord: nodes sorted by id, their workers, regions and fingers, and ``entry``: one
        entry node (or None: the nearest) per region of the topology."""
    def set_oblivious(self, pool: list[int], round_robin: bool) -> None: ...
    def set_central_directory(self, workers: list[int], beta: list[float], seeds: list[int], coordinator: int, wan_fraction: float, lambda_max: float, tau_ms: float, gamma: float, tie_ms: float) -> None: ...
    def chord_lookup(self, origin: int, key: int) -> tuple[int, int, float]: ...
    def set_dynamo(self, period_ms: float, workers: list[int], beta: list[float], seeds: list[int], global_: tuple[list[int], list[float], list[list[int]]] | None = None) -> None: ...
    def dynamo_exact_blocks(self, worker: int, tokens: npt.NDArray[np.uint32], salt_seed: int) -> int: ...
    def set_planetserve(self, pools: list[list[int]], capacity: int) -> None: ...
    def set_skywalker(self, pools: list[list[int]], remote: list[list[int]], region_of: list[int], capacity: int) -> None: ...
    def set_sglang(self, workers: list[int], max_blocks: int, interval_ms: float, cache_threshold: float, balance_abs: int, balance_rel: float) -> None: ...
    def start(self) -> None:
        """Schedule every arrival (before anything scheduled after this call)."""
    def set_closed_loop(self, outstanding: int) -> None:
        """Closed loop (before ``start``): ``outstanding`` requests in flight; each completion issues the next."""
    def set_parents(self, parents: npt.NDArray[np.uint32]) -> None:
        """Follow-ups wait for their parents (before ``start``): request ``i`` is sent no earlier than
        request ``parents[i]``'s last token reaches its client (:data:`NO_PARENT`: none; a parent comes first)."""
    def issued(self) -> npt.NDArray[np.float64]:
        """When each request reached its edge (ms); empty before ``start``."""
    def transfer_ms(self, tokens: int) -> float:
        """Moving the KV of ``tokens`` between workers (ms); never smaller for more tokens (the
        bits are counted in 128 bits)."""
    def reserve_key(self) -> tuple[int, int]: ...
    def current(self) -> tuple[float, int, int]: ...
    def at(self, t: float, f: Callable[[], object]) -> None:
        """Call ``f()`` at ``t`` ms of virtual time."""
    @property
    def now(self) -> float: ...
    def quiet_until(self) -> float | None:
        """The next arrival's time (ms; inf when none is left) while nothing is in flight, else None."""
    def queued_ms(self, worker: int, now: float) -> float: ...
    def dispatched_ms(self, worker: int, origin: int | None = None) -> float: ...
    def waiting(self, worker: int) -> int: ...
    def pending(self, worker: int) -> int:
        """Requests routed to the worker whose prefill has not ended."""
    def cached(self, worker: int, tokens: npt.NDArray[np.uint32], salt_seed: int) -> tuple[int, int]: ...
    def way(self, a: int, b: int) -> float:
        """One WAN traversal (ms) from region ``a`` to ``b``, jittered when the run asks;
        InvalidArgumentError (and no draw) unless both are regions of the topology."""
    def rng_integers(self, n: int) -> int: ...
    def rng_random(self) -> float: ...
    def fault_random(self) -> float: ...
    def rng_states(self) -> tuple[_RngState, _RngState]: ...
    def copy_in(self, worker: int, tokens: npt.NDArray[np.uint32], tier: int, salt: int, salt_seed: int) -> CacheEvents: ...
    def migrate_recompute(self, t: float, worker: int, tokens: npt.NDArray[np.uint32], tier: int, region: int, salt: int, salt_seed: int) -> None: ...
    def busy_queues(self) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.float64]]: ...
    def set_live_sinks(self, sink_of: list[int], index_of: list[int], sinks: list[tuple[QueueEstimates, list[float]]]) -> None: ...
    def poll_live(self, now_s: float) -> int: ...
    def set_broadcast_edges(self, regions: list[int], sinks: list[QueueEstimates], maps: list[list[tuple[list[int], list[int] | None, list[float]] | None]]) -> None: ...
    def post_broadcast(self, src: int, targets: list[int], values: npt.NDArray[np.float64]) -> None: ...
    def settle_broadcasts(self, dst: int, bound: tuple[float, int, int] | None = None) -> int: ...
    @property
    def completed(self) -> int: ...
    @property
    def handoffs(self) -> int: ...
    @property
    def kv_waits(self) -> int:
        """Requests the shared KV pool held back at least once (``kv_pool=True``): a prefill, or
        a handed-off sequence on its decode instance."""
    @property
    def events_processed(self) -> int: ...
    @property
    def memo_bytes(self) -> int: ...
    def decoded(self, worker: int) -> int: ...
    def busy(self, worker: int) -> npt.NDArray[np.float64]: ...
    def records(self) -> tuple[npt.NDArray[np.uint32], npt.NDArray[np.uint32], npt.NDArray[np.float64], npt.NDArray[np.float64], npt.NDArray[np.float64], npt.NDArray[np.uint64], npt.NDArray[np.uint64], npt.NDArray[np.int64]]: ...
    def cache_memory_bytes(self) -> int: ...
    def cache_tables(self) -> list[tuple[int, int, int, int, int]]: ...

def apply_view_batches(views: dict[tuple[int, int], LudoView], batches: list[bytes]) -> tuple[int, int]:
    """Apply ``batches`` in order to the views they name until one does not apply (left
    unapplied with every later one); (applied, snapshots among them)."""


def decode_batch_header(batch: bytes) -> dict[str, int]:
    """Header of an encoded batch (table, shard, epoch, seq, n_ops); raises MalformedPatchError."""

@final
class LudoTable:
    """The single writer of one (table, shard): keyed Ludo table plus a mirror of the keyless view.

    Every change becomes a patch edit; ``take_batch`` closes them into the next sequenced batch.
    """

    def __new__(
        cls,
        table: int = 0,
        shard: int = 0,
        epoch: int = 1,
        capacity: int = 1024,
        value_bits: int = 32,
        fp_bits: int = 0,
        seed: int = 0,
        max_capacity: int = ...,
        fallback_limit: int = 64,
    ) -> LudoTable: ...
    @staticmethod
    def build(
        keys: npt.NDArray[np.uint64],
        values: npt.NDArray[np.uint64],
        table: int = 0,
        shard: int = 0,
        epoch: int = 1,
        capacity: int = 0,
        value_bits: int = 32,
        fp_bits: int = 0,
        seed: int = 0,
        max_capacity: int = ...,
        fallback_limit: int = 64,
    ) -> LudoTable:
        """Bulk build (later duplicates win); emits no patches: views start from ``export_snapshot``."""
    def insert(self, key: int, value: int) -> str:
        """Insert a new key; returns "bucket" or "fallback". Raises if the key exists. The
        GIL is released (a write may rebuild the table), as for every write below."""
    def update(self, key: int, value: int) -> None:
        """Change an existing key's value (KeyNotFoundError if absent); 0 removes it."""
    def set(self, key: int, value: int) -> str:
        """Upsert; 0 removes. Returns "bucket", "fallback" or "updated"."""
    def remove(self, key: int) -> int | None:
        """Remove a key; returns its old value, or None if absent."""
    def get(self, key: int) -> int | None:
        """Keyed read: no false hits."""
    def __contains__(self, key: int, /) -> bool: ...
    def __len__(self) -> int: ...
    def set_field(self, key: int, field: int, tier: int) -> int:
        """Set one worker's 2-bit tier field; returns the key's new value."""
    def apply_field_ops(self, keys: npt.NDArray[np.uint64], fields: npt.NDArray[np.uint32], tiers: npt.NDArray[np.uint8]) -> int:
        """Validate then apply many field ops with the GIL released; returns how many. A batch
        that would take the table past its maximum at any point is refused whole
        (CapacityError), nothing applied."""
    def apply_agent_ops(
        self,
        keys: npt.NDArray[np.uint64],
        tiers: npt.NDArray[np.uint8],
        shard: int,
        shards: int,
        owned: npt.NDArray[np.uint64],
        field: int,
        max_capacity: int,
        apply: bool,
    ) -> tuple[int, int, int, int]:
        """One agent batch as a maintenance unit takes it: ``(bad, at, ops, cleared)``; ``bad`` 0
        when good (written if ``apply``), 1 (``keys[at]`` not 63-bit), 2 (another shard's), 3
        (``tiers[at]`` above 2), 4 (the writes would grow the table to ``at`` keys, past
        ``max_capacity``; nothing written). ``owned`` must be sorted ascending and ``shard``
        below ``shards`` (ValueError otherwise). The writes run with the GIL released."""
    def take_batch(self) -> bytes | None:
        """Close pending edits into the next batch; None when nothing changed."""
    def export_snapshot(self) -> bytes:
        """A snapshot batch at the last emitted seq (refused while edits are pending)."""
    def start_epoch(self, epoch: int) -> None:
        """Begin a new epoch (restarted writer); seq restarts at 0."""
    def rebuild(self, capacity: int | None = None) -> None:
        """Rebuild now with a new seed (the GIL released); the next batch carries a snapshot."""
    def view_lookup(self, key: int) -> int:
        """Keyless lookup through the mirror view (what an edge would answer)."""
    def view_state(self) -> bytes:
        """The mirror view's canonical state bytes."""
    def digest(self) -> bytes:
        """SHA-256 of the mirror view's state."""
    def entries(self) -> tuple[npt.NDArray[np.uint64], npt.NDArray[np.uint64]]:
        """All live (keys, values)."""
    def verify(self) -> None:
        """Raise unless every key resolves through the keyless mirror to its own value."""
    @property
    def table(self) -> int: ...
    @property
    def shard(self) -> int: ...
    @property
    def epoch(self) -> int: ...
    @property
    def seq(self) -> int: ...
    @property
    def capacity(self) -> int: ...
    @property
    def value_bits(self) -> int: ...
    @property
    def fp_bits(self) -> int: ...
    @property
    def fallback_len(self) -> int: ...
    @property
    def rebuilds(self) -> int: ...
    @property
    def pending_ops(self) -> int: ...
    @property
    def memory_bytes(self) -> int:
        """Bytes held by the writer (keys, Othello forest, mirror view with the values, scratch)."""
    @property
    def view_memory_bytes(self) -> int:
        """Bytes a replica of this table's view holds."""
    @property
    def memory_breakdown(self) -> dict[str, int]:
        """``memory_bytes`` by part: keys, meta, view, forest_nodes, forest_lists, scratch, pending."""
    def write_stats(self) -> dict[str, int | list[int]]:
        """Insert and Othello-walk counters since the table was created: ``inserts_by_moves``
        (inserts that needed k cuckoo moves, k = 0..), ``fallback_inserts``, ``joins`` /
        ``join_nodes``, ``toggles`` / ``toggle_nodes`` / ``toggle_flips``."""

@final
class ApplyResult:
    """Outcome of applying a batch to a view."""

    @property
    def epoch(self) -> int: ...
    @property
    def seq(self) -> int: ...
    @property
    def ops(self) -> int: ...
    @property
    def snapshot(self) -> bool: ...

@final
class LudoView:
    """An edge's keyless replica of one (table, shard); shared by reference with Routers."""

    def __new__(cls, table: int, shard: int) -> LudoView: ...
    def apply_batch(self, batch: bytes) -> ApplyResult:
        """Apply the next batch (or a snapshot not older than the view); raises PatchError and changes nothing otherwise."""
    def lookup(self, key: int) -> int:
        """Value under ``key``; 0 means no holder (a false hit is possible without fingerprints)."""
    def lookup_batch(self, keys: npt.NDArray[np.uint64]) -> npt.NDArray[np.uint64]:
        """Prefetching batch lookup with the GIL released."""
    def state_bytes(self) -> bytes: ...
    def digest(self) -> bytes: ...
    def count_entries(self) -> int:
        """Occupied slots plus fallback entries (a full scan)."""
    def geometry(self) -> dict[str, int] | None:
        """The view's shape, or None before the first snapshot."""
    @property
    def table(self) -> int: ...
    @property
    def shard(self) -> int: ...
    @property
    def epoch(self) -> int: ...
    @property
    def seq(self) -> int: ...
    @property
    def initialised(self) -> bool: ...
    @property
    def fallback_len(self) -> int: ...
    @property
    def memory_bytes(self) -> int: ...

@final
class RouteResult:
    """The decision for one request and the per-worker evidence behind it."""

    @property
    def winner(self) -> int: ...
    @property
    def score(self) -> float: ...
    @property
    def matches(self) -> npt.NDArray[np.uint32]: ...
    @property
    def tiers(self) -> npt.NDArray[np.uint8]: ...
    @property
    def scores(self) -> npt.NDArray[np.float64]: ...
    @property
    def tq(self) -> npt.NDArray[np.float64]:
        """The queue estimates an ``EdgeCore`` route scored with (empty from ``Router.route``)."""
    @property
    def near(self) -> list[int]:
        """Workers within the route's ``tie_ms`` of the best score, in index order (empty without ``tie_ms``)."""
    @property
    def local_match(self) -> int:
        """The longest match among region 0's workers (the edge's own region)."""
    def at(self, w: int) -> tuple[int, int, float]:
        """``(match, tier, score)`` of worker ``w``."""
    def keys_at(self, lengths: list[int]) -> list[int]:
        """Keys of the prompt's prefixes of ``lengths``, each one this route hashed."""

_Commit = tuple[int, int, int, int, float, tuple[float, float, float, float, float, float], int, int, int | None, bool]

@final
class EdgeCore:
    """An edge's per-request steps around its router: expiries, the capacity price, the route, the
    tie draw and the commit's side effects (``kvcompass.discovery.edge.Edge`` uses it).

    The constructor refuses (ValueError) ``lambda_max``, ``gamma``, ``tie_ms`` or
    ``speculative_ttl_s`` not finite and >= 0 and ``tau_ms`` not finite and > 0, and
    (InvalidFieldError) a worker field past ``value_bits / 2``; it checks every speculative
    view before it changes any. ``now`` must be finite (ValueError) in ``score``, ``commit``,
    ``route`` and ``expire``; a refused commit changes neither the charges nor the
    speculative entries."""

    def __new__(
        cls,
        router: Router,
        queues: QueueEstimates,
        workers: dict[str, list[int] | list[float] | list[bool] | list[tuple[int, int]]],
        plan: list[list[int]],
        family_length: int,
        spec_views: list[LudoView],
        params: dict[str, float | bool],
    ) -> EdgeCore: ...
    def set_router(self, router: Router) -> None: ...
    def score(self, tokens: npt.NDArray[np.uint32], namespace: bytes, now: float, belief: npt.NDArray[np.float64], own_region: bool = False) -> RouteResult: ...
    def commit(self, res: RouteResult, w: int, n_cand: int, now: float, track: bool, effects: bool = True) -> _Commit:
        """``(w, n_cand, match, tier, score, (wan, queue, prefill, reload, lam, belief), prompt_tokens, local_match, family, local_miss)``."""
    def route(
        self, tokens: npt.NDArray[np.uint32], namespace: bytes, now: float, belief: npt.NDArray[np.float64], draw: Callable[[], float], track: bool = True, effects: bool = True
    ) -> tuple[RouteResult, _Commit]: ...
    def expire(self, now: float) -> int: ...
    def capacity_price(self) -> float: ...
    @property
    def speculative_entries(self) -> int: ...
    @property
    def speculative_counts(self) -> tuple[int, int]: ...

@final
class ByteLevelBpe:
    """HF's ByteLevel + BPE encoding, id for id, of text made of ASCII, Latin-1, Latin Extended-A and
    General Punctuation characters (``kvcompass.engine.tokenizer``'s fast path)."""

    def __new__(cls, byte_ids: list[int], merges: list[tuple[int, int, int]]) -> ByteLevelBpe: ...
    def encode(self, text: str) -> npt.NDArray[np.uint32] | None:
        """Ids of ``text``, or None when it holds a character outside those blocks."""
    @staticmethod
    def pieces(text: str) -> list[tuple[int, int]] | None:
        """The GPT-2 pre-tokenizer's pieces of ``text`` as (start, end) character offsets; None outside those blocks."""

@final
class QueueEstimates:
    """Per-worker queue estimates (ms), ages, idle clocks and open dispatch charges
    (``kvcompass.discovery.queues`` documents the rules)."""

    def __new__(cls, n_workers: int, weight: float, idle_threshold_ms: float, charge_ttl_s: float = 2.0) -> QueueEstimates:
        """At most 2**24 workers (ValueError past them, before anything is allocated). Every
        method that changes the estimates refuses (ValueError, nothing changed) a ``now`` that
        is not finite and a NaN ``settled_before`` or lag."""
    @property
    def values(self) -> npt.NDArray[np.float64]: ...
    def minimum(self) -> float:
        """The smallest estimate over every worker (inf with none)."""
    @property
    def version(self) -> int: ...
    def __len__(self) -> int: ...
    def __getitem__(self, index: int, /) -> float: ...
    def observed(self, index: int) -> float: ...
    def pending(self, index: int) -> float: ...
    def known(self, index: int) -> bool: ...
    def age(self, index: int, now: float) -> float: ...
    def charge(self, index: int, work_ms: float, now: float) -> None: ...
    def expire(self, now: float) -> None: ...
    def set_live(self, index: int, tq_ms: float, now: float, settled_before: float | None = None) -> None: ...
    def fold(self, index: int, tq_ms: float, now: float, settled_before: float | None = None) -> float: ...
    def set_live_many(self, indices: npt.NDArray[np.int64], tq_ms: npt.NDArray[np.float64], now: float, settled_before: npt.NDArray[np.float64]) -> None: ...
    def fold_many(self, indices: npt.NDArray[np.int64], tq_ms: npt.NDArray[np.float64], now: float, settled_before: npt.NDArray[np.float64]) -> None: ...
    def fold_lagged(self, indices: npt.NDArray[np.int64], tq_ms: npt.NDArray[np.float64], now: float, lag_s: npt.NDArray[np.float64]) -> None: ...
    def idle_for(self, index: int, now: float) -> float: ...
    def persistently_idle(self, index: int, now: float, window_s: float) -> bool: ...
    def idle_among(self, indices: npt.NDArray[np.int64], now: float, window_s: float) -> list[int]: ...
    def vector(self, indices: Sequence[int], ids: Sequence[str]) -> dict[str, float]:
        """``{ids[j]: estimate of indices[j]}``; ValueError when the two differ in length."""

@final
class Router:
    """Runs the lookup-and-score loop over shared views in one call with the GIL released.

    ``plan[r]`` lists the ascending prefix lengths queried toward region ``r``; each table is
    ``(region, workers, shard_views)`` where ``workers[f]`` is the global worker index of field f.
    """

    def __new__(cls, plan: list[list[int]], tables: list[tuple[int, npt.NDArray[np.uint32], list[LudoView]]]) -> Router: ...
    def route(
        self,
        tokens: npt.NDArray[np.uint32],
        namespace: bytes,
        region: npt.NDArray[np.uint32],
        beta: npt.NDArray[np.float64],
        wan: npt.NDArray[np.float64],
        tq: npt.NDArray[np.float64],
        belief: npt.NDArray[np.float64],
        gamma: float = 0.005,
        lam: float = 0.0,
        closure: bool = True,
        only_region: int | None = None,
        tie_ms: float | None = None,
    ) -> RouteResult:
        """score(w) = wan + tq + (1+lam)*beta*(L - b*m) + gamma*b*m*[tier == DRAM]; argmin wins.
        ``only_region``: read that region's plan and tables only; every other worker scores inf.
        ``tie_ms``: also list the workers within ``tie_ms`` of the best (``RouteResult.near``);
        finite and >= 0 (InvalidArgumentError otherwise)."""
    @property
    def n_tables(self) -> int: ...
    @property
    def plan(self) -> list[list[int]]: ...

def bench_lookup_ns(view: LudoView, keys: npt.NDArray[np.uint64], block: int = 256) -> npt.NDArray[np.float64]:
    """Mean ns per single-key lookup, one sample per block (timed in Rust)."""

def bench_remove_insert_ns(
    table: LudoTable, old: npt.NDArray[np.uint64], new: npt.NDArray[np.uint64], value: int
) -> tuple[npt.NDArray[np.float64], npt.NDArray[np.float64]]:
    """Per-op ns of (insert, remove) pairs at steady occupancy (timed in Rust)."""

def bench_update_ns(table: LudoTable, keys: npt.NDArray[np.uint64], block: int = 256) -> npt.NDArray[np.float64]:
    """Mean ns per value update, one sample per block (timed in Rust)."""

def bench_route_ns(
    router: Router,
    tokens: npt.NDArray[np.uint32],
    namespace: bytes,
    region: npt.NDArray[np.uint32],
    beta: npt.NDArray[np.float64],
    wan: npt.NDArray[np.float64],
    tq: npt.NDArray[np.float64],
    belief: npt.NDArray[np.float64],
    n: int,
    gamma: float = 0.005,
    lam: float = 0.0,
    closure: bool = True,
    memo: bool = False,
) -> npt.NDArray[np.float64]:
    """Per-call ns of the route loop (timed in Rust, no FFI); each call hashes the prompt afresh
    unless ``memo`` (repeats then come through the process's prefix memo)."""

def bench_sha256_ns(tokens: npt.NDArray[np.uint32], n: int) -> npt.NDArray[np.float64]:
    """Per-call ns of a plain SHA-256 of the tokens' bytes (``n`` at most 2**32, as for every
    probe's sample count: InvalidArgumentError past it)."""

def bench_timer_ns(n: int = 100000) -> float:
    """Median ns of an empty timer pair: what each per-op sample of the probes above carries."""

def bench_mem_latency_ns(mib: int = 64, steps: int = 2000000, seed: int = 1) -> float:
    """ns per dependent load over ``mib`` MiB (a pointer chase on huge pages when large): the
    host's memory latency, the unit the writer's per-op latencies are read in."""

