"""The worker agent: an engine's KV events in, key-op batches for the maintenance units out.

Sans-I/O: the driver hands in the frames it received (``on_message`` for the PUB socket,
``on_replay`` for replay replies) and performs what comes back (send the key-op batches; when
``replay`` is set, ask the engine's replay socket from ``replay.start_seq``). Nothing here
opens a socket, sleeps or reads a clock: where time matters (the starting incarnation) the
driver decides, with :func:`boot_incarnation`.

**Driver contract.** A driver builds one agent per engine process it follows with
``WorkerAgent(..., incarnation=boot_incarnation(time.time_ns()))``, sends every returned batch
to the maintenance unit of its shard (``batch.shard``), and when a unit refuses one with
:class:`~kvcompass.errors.AgentSequenceError` (a gap: typically the unit restarted and lost its
agent sequence state) sends what :meth:`WorkerAgent.on_rejected` returns instead of the rest
of that shard's queue. A :class:`~kvcompass.errors.StaleIncarnationError` (a subclass) is
different: a newer agent process owns this worker, and this one should stop.

**Keys from tokens.** Engine block hashes are seeded per process, so they name blocks but are
useless as index keys. The agent keeps, per engine block, its parent, its token span and the
SHA-256 state after its last token (``hashlib`` objects copy their midstate), so a new block
costs one block of hashing and a key at a registration length ``c`` inside it costs a copy, the
partial block and a digest. Keys equal :func:`kvcompass.prefix_keys` of the same tokens.

**What counts as held.** The engine can reuse prefix ``[0, c)`` only if every block covering it
is cached somewhere. So prefix ``c`` is held iff the whole chain of blocks from the prompt start
to the block containing token ``c - 1`` is held, and its tier is the worst along that chain
(VRAM if every block is on the GPU, DRAM if any needs a reload from host memory). Media map to
tiers as ``GPU`` (or no medium) -> VRAM and ``CPU*`` -> DRAM; other media (disk, remote stores)
are tracked but not indexed (the paper indexes VRAM and DRAM only), so a block held only there
breaks the chain. A key held by several chains (the same tokens cut into blocks differently)
takes the best tier among them. Only registration lengths get keys, and an op is emitted only
when a key's tier changes (net of everything one call did).

**Block identity.** vLLM chains its block hashes (a block's hash covers its parent's), so a hash
names one position. SGLang's content-hash format hashes a page's tokens alone
(``hash(tuple(page_tokens))``): the same page content at two positions (page size 1 and a
repeated token, or two identical pages) carries the same hash. The agent therefore files a
block by its place in the chain: (KV-cache group ``group_idx`` (None read as 0), parent block,
hash). The same hash under two parents is two blocks, under one parent it is one block, and a
key counts as held while any group's chain holds it. The engine's events name blocks by hash
only, which is exact for chained hashes and needs two rules for content hashes:

* *Parents.* A BlockStored's first block names its parent by hash. Later blocks of the event
  follow the block before them exactly. If several blocks carry the parent hash, the agent
  picks the one most recently stored (or re-stored) among those still holding a medium (any
  among them if none does). That is exact for the pages of one SGLang radix node, which arrive
  as consecutive single-page events each chained to the one before. It is a guess when a new
  node hangs off a page whose content is cached at several positions; nothing in the event
  tells them apart (stats ``ambiguous_parents``).
* *Removals.* BlockRemoved names hashes only. The consecutive BlockRemoved events of a message
  are resolved together (removals commute). A hash named at least as often as blocks hold it
  on that medium removes them all. Otherwise the run is read as what a radix cache evicts:
  leaf-first, so together with every descendant that holds the medium (SGLang lists a node's
  pages first page first, so a page's children are usually still pending when it comes up). A
  candidate qualifies only if the run still names every hash of that subtree as often as the
  subtree has it. When no more candidates qualify than the run removes, they are the ones.
  If no pending removal can be placed this way, the agent removes the least recently stored
  qualifying leaf and counts it in ``ambiguous_removals``. With no qualifying leaf it takes any
  qualifying candidate, and with none of those any candidate. What stays ambiguous is two cached
  copies of one content that both qualify (``[a, b]`` and ``[c, b]``, one ``b`` evicted): the
  format cannot say which.

SGLang releases that hash pages by position (a chained ``hash_value`` per page) are exact, like
vLLM.

**Blocks the agent cannot key.** A block whose parent the agent never saw (it started after the
engine, or lost events) is kept with its tokens as an *orphan* and keyed as soon as a block with
the parent's hash is stored. Blocks with LoRA (``lora_id``/``lora_name``) or ``extra_keys``
(multimodal inputs, cache salt), and everything stored below them, are *unindexed*: their KV
depends on more than the tokens, so a token-derived key would claim a cache that another
request cannot reuse. One exception: a prompt's first block whose only extra key is a cache salt
the agent was given (``salts``, vLLM's per-request ``cache_salt`` as a tenant's private
namespace) roots a chain keyed in that tenant's namespace, so tenants with equal prompts get
different keys, as their engines' hashes differ. A removed block that still has stored descendants stays as a tombstone so
that the chain can be re-completed when the engine stores it again.

**Sequencing.** The engine's seq starts at 0 with no epoch. For message ``seq`` against the
last applied ``last`` (-1 before the first, so an agent that starts mid-stream asks for a
replay from 0 and gets the engine's whole history if the ring still holds it):

* ``seq == last + 1``: apply (then any buffered successors).
* ``seq > last + 1``: a gap. Buffer the message (at most ``max_buffered``) and return
  ``ReplayRequest(last + 1)`` (once per gap). Replayed messages are fed to ``on_replay``; when
  the gap is filled the buffered messages apply in order. If the replay ends with the gap still
  open (``on_replay`` of the end frame) or the driver reports it failed (``on_replay_failed``),
  or the buffer overflows, the agent resyncs: it applies what it has in seq order and re-reports
  its whole inventory in ``reset`` batches. That inventory is the engine's cache as far as the
  agent knows it: blocks stored or removed inside the lost messages are missed (with
  ``forget=True`` the agent instead drops everything it knew before the gap).
* ``seq <= last`` (or a seq already buffered): the agent remembers a digest of the payload of
  each of the last ``window`` applied messages. The same bytes again are a re-delivery
  (ignored, counted; replayed messages are only ever taken as re-deliveries); other bytes, or
  a seq too old to remember, mean the engine restarted: a new incarnation (bumped
  ``incarnation``, per-shard seqs back to 1, state cleared, ``reset`` batches for every shard)
  that then takes the message as its first, asking for a replay from 0 when it is not seq 0.
  An engine that restarts and publishes past ``last`` before the agent hears from it is
  indistinguishable from a gap on the wire; nothing the agent can do fixes that.

**Incarnations.** The first batch of every shard in an incarnation is a ``reset`` batch. A
maintenance unit accepts it, and so drops whatever the worker held in that shard, when its
incarnation is *higher* than any it has seen from the worker (or the unit has seen none). A
reset under an incarnation it has already seen up to a later seq is a duplicate and ignored,
and a lower one is refused as stale. So an agent process that starts, or restarts, clears
what an earlier agent process reported only if it starts above that process's last
incarnation. Engine restarts bump it by 1 within a process. Across agent processes the driver
passes :func:`boot_incarnation` of the wall clock at boot (or, if it persists state, any number
above the previous process's last).

**Malformed input** raises :class:`~kvcompass.errors.InvalidEventError`, counts in
``stats.malformed`` and leaves the agent's state as it was: a message is decoded and validated
completely before anything changes. (Its seq then never applies, so the next message opens a
gap and the replay / resync path takes over.) Engine-level oddities inside well-formed messages
are not errors: they are counted and skipped. These are a removal of an unknown block, a block
re-stored with another size, a known hash stored under a parent the agent never saw (with
chained hashes a contradiction, with content hashes a block the agent cannot place), and an
orphan whose adoption would close a cycle.
"""

from __future__ import annotations

import hashlib
import re
from bisect import bisect_right
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

import numpy as np

from kvcompass import _core
from kvcompass.agent.events import (
    AllBlocksCleared,
    BlockHash,
    BlockRemoved,
    BlockStored,
    EngineBatch,
    decode_message,
    decode_replay,
    encode_replay_request,
)
from kvcompass.discovery.ops import KeyOpBatch
from kvcompass.errors import InvalidArgumentError, InvalidEventError
from kvcompass.index import Namespace, Tier

if TYPE_CHECKING:
    from hashlib import _Hash as Sha256
else:
    Sha256 = object

__all__ = ["TENANT_SALT_PREFIX", "AgentOutput", "AgentStats", "ReplayRequest", "WorkerAgent", "boot_incarnation", "medium_tier"]

_Frames = Sequence[bytes | bytearray | memoryview]

_Slot = tuple[int, BlockHash]
"""What an engine event names a block by: (KV-cache group index, block hash). With content
hashes several blocks can share one; the agent's own block ids are ints."""

_Removal = tuple[int, str, BlockHash]
"""One hash of a BlockRemoved: (group, medium name, hash)."""

BOOT_SHIFT = 8
""":func:`boot_incarnation` leaves ``2**BOOT_SHIFT`` incarnations per microsecond of boot time."""


def boot_incarnation(now_ns: int) -> int:
    """The incarnation an agent process should start at, from the wall clock at its boot:
    ``(now_ns // 1000) << 8``. Drivers pass ``boot_incarnation(time.time_ns())`` as
    ``WorkerAgent(..., incarnation=...)``; the agent itself never reads a clock.

    Why this works: a maintenance unit clears a worker's old keys only for a *higher*
    incarnation (see the module notes), and within one agent process the incarnation grows by 1
    per engine restart the agent observes. Observing one takes at least one message, which takes
    far longer than a microsecond to deliver and decode, while a process that boots ``d``
    microseconds after its predecessor booted starts ``256 * d`` above it. So the predecessor
    could only catch up with more than 256 engine restarts per microsecond of its life. That
    does not happen. The values stay below ``2**63`` until the year 3100 or so.

    The limit: the clock must not step back across an agent restart by more than the time
    between the two boots. A new process that gets a lower incarnation is refused by the units
    as :class:`~kvcompass.errors.StaleIncarnationError`, which the driver sees. A driver that
    persists state may pass any number above its predecessor's last incarnation instead.
    """
    if type(now_ns) is not int or now_ns < 0:
        raise InvalidArgumentError(f"now_ns must be a non-negative int (time.time_ns()), got {now_ns!r}")
    return (now_ns // 1_000) << BOOT_SHIFT


TENANT_SALT_PREFIX = "kvcompass:"
"""The cache salt a front door sets for a tenant's requests is this prefix + the tenant, so
engines keep tenants' KV apart and agents (``tenant_salts=True``) key it in the tenant's
namespace; a salt without the prefix never names a namespace."""

_TENANT_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:@/+-]{0,127}")


def medium_tier(medium: str | None) -> Tier:
    """The tier a storage medium maps to: GPU (or none given) VRAM, ``CPU*`` DRAM, else ABSENT."""
    m = _medium_name(medium)
    if m == "GPU":
        return Tier.VRAM
    if m.startswith("CPU"):
        return Tier.DRAM
    return Tier.ABSENT


def _medium_name(medium: str | None) -> str:
    return "GPU" if medium is None else medium.upper()


@dataclass(frozen=True, slots=True)
class ReplayRequest:
    """Ask the engine's replay socket for every message from ``start_seq`` on."""

    start_seq: int

    def frame(self) -> bytes:
        """The request frame: ``start_seq`` as 8 bytes big-endian."""
        return encode_replay_request(self.start_seq)


@dataclass(frozen=True, slots=True)
class AgentOutput:
    """What one call asks the driver to do: send ``batches`` (in order), then perform ``replay``."""

    batches: tuple[KeyOpBatch, ...] = ()
    replay: ReplayRequest | None = None


@dataclass(slots=True)
class AgentStats:
    """Counters (never part of the agent's state digest)."""

    messages: int = 0  # live messages decoded
    replayed: int = 0  # replayed messages decoded
    applied: int = 0  # messages applied
    events: int = 0  # events applied
    blocks_stored: int = 0  # new engine blocks filed
    blocks_removed: int = 0  # (block, medium) removals applied
    clears: int = 0  # AllBlocksCleared applied
    malformed: int = 0  # InvalidEventError raised
    duplicates: int = 0  # re-delivered messages ignored
    gaps: int = 0  # gaps opened
    replay_requests: int = 0
    resyncs: int = 0  # full re-reports after an unfilled gap
    restarts: int = 0  # engine restarts (new incarnations)
    orphans: int = 0  # blocks stored under a parent the agent did not know
    adopted: int = 0  # orphans keyed once their parent arrived
    unindexed: int = 0  # blocks stored with LoRA / extra keys (and their descendants)
    unknown_removals: int = 0  # removals of a block (or medium) the agent did not hold
    conflicts: int = 0  # a block re-stored with another size, a known hash under an unknown parent, an adoption cycle
    ambiguous_parents: int = 0  # a parent hash naming several blocks (content hashes): the most recent one taken
    ambiguous_removals: int = 0  # a removal no rule could place (content hashes): the oldest qualifying leaf taken
    batches_emitted: int = 0
    ops_emitted: int = 0

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


class _Block:
    """One engine block at one place in a chain. ``parent`` is the parent's block id (None at a
    prompt start, and for an orphan, whose ``wait`` is the parent hash it waits for).
    Keyed (``state`` set) once its whole ancestry is known; until then an orphan keeps its
    tokens. ``chain`` is the tier of the prefix ending at this block (0: not held), ``own`` the
    best tier among the media holding this block itself, ``touched`` the store clock when the
    engine last stored it (ties between content-hash look-alikes go by it)."""

    __slots__ = ("group", "hash", "parent", "wait", "size", "start", "state", "tokens", "keys", "media", "own", "chain", "kids", "opaque", "touched", "root")

    def __init__(self, group: int, h: BlockHash, parent: int | None, wait: BlockHash | None, size: int, opaque: bool, touched: int) -> None:
        self.group = group
        self.hash = h
        self.parent = parent
        self.wait = wait
        self.size = size
        self.start = -1
        self.state: Sha256 | None = None
        self.tokens: bytes | None = None
        self.keys: tuple[int, ...] = ()
        self.media: set[str] = set()
        self.own = 0
        self.chain = 0
        self.kids: dict[BlockHash, int] = {}  # children by hash: one block per (parent, hash)
        self.opaque = opaque
        self.touched = touched
        self.root: Sha256 | None = None  # a salted prompt start: its tenant's hash root


class WorkerAgent:
    """Turns one engine's KV events into key-op batches for one worker.

    ``registration_lengths``: the prefix lengths (tokens) this worker registers, i.e. the union
    of what the edges query toward its region. ``shards``: the number of maintenance shards
    (a key belongs to ``key % shards``). ``block_size``: when given, a BlockStored of any other
    block size is refused as malformed (leave it None for SGLang, whose last page of a node may
    be short). ``incarnation``: the first incarnation number. Drivers pass
    ``boot_incarnation(time.time_ns())`` so that a restarted agent process starts above its
    predecessor and its first (reset) batches replace what that one reported; the default 1
    suits tests only (a second process starting at 1 would be ignored as a duplicate by units
    that saw the first). ``window``: how many applied payload digests
    are remembered to tell re-deliveries from a restarted engine (vLLM's replay ring holds
    10,000 batches). ``max_buffered``: messages held while a gap waits for its replay.
    ``salts``: cache salts this engine serves, each with its tenant's namespace (see the module
    notes on extra keys); prompts without a salt are keyed in ``namespace``. ``tenant_salts``:
    also read a salt ``TENANT_SALT_PREFIX + tenant`` (what the front door sets for every tenant
    but the default) as ``Namespace(namespace.model, tenant)``.
    """

    def __init__(
        self,
        worker_id: str,
        namespace: Namespace,
        registration_lengths: Sequence[int],
        shards: int = 1,
        *,
        block_size: int | None = None,
        incarnation: int = 1,
        window: int = 10_000,
        max_buffered: int = 4096,
        salts: Mapping[str, Namespace] | None = None,
        tenant_salts: bool = False,
    ) -> None:
        if not isinstance(worker_id, str) or not worker_id:
            raise InvalidArgumentError(f"worker_id must be a non-empty string, got {worker_id!r}")
        lengths = sorted({int(c) for c in registration_lengths})
        if lengths and not (1 <= lengths[0] and lengths[-1] <= 0xFFFFFFFF):
            raise InvalidArgumentError(f"registration lengths must be in 1..2**32-1, got {lengths[0]}..{lengths[-1]}")
        for name, v, lo in (("shards", shards, 1), ("window", window, 1), ("max_buffered", max_buffered, 1), ("incarnation", incarnation, 0)):
            if type(v) is not int or v < lo:
                raise InvalidArgumentError(f"{name} must be an int >= {lo}, got {v!r}")
        if block_size is not None and (type(block_size) is not int or block_size < 1):
            raise InvalidArgumentError(f"block_size must be a positive int or None, got {block_size!r}")
        self.worker_id = worker_id
        self.namespace = namespace
        self.shards = shards
        self.block_size = block_size
        self.window = window
        self.max_buffered = max_buffered
        self.stats = AgentStats()
        self._lengths = tuple(lengths)
        self._root: Sha256 = hashlib.sha256(namespace.digest)
        self._salt_roots: dict[str, Sha256] = {}
        for salt, ns in (salts or {}).items():
            if not isinstance(salt, str) or not salt or not isinstance(ns, Namespace):
                raise InvalidArgumentError(f"salts must map non-empty strings to Namespaces, got {salt!r}: {ns!r}")
            self._salt_roots[salt] = hashlib.sha256(ns.digest)
        self._tenant_salts = bool(tenant_salts)
        self._incarnation = incarnation
        self._blocks: dict[int, _Block] = {}  # block id -> block
        self._roots: dict[_Slot, int] = {}  # blocks that start a prompt
        self._by_hash: dict[_Slot, dict[int, None]] = {}  # every block carrying a hash (ordered set)
        self._orphans: dict[_Slot, dict[BlockHash, int]] = {}  # (group, missing parent hash) -> {hash: orphan}
        self._ids = 0  # the next block id
        self._tick = 0  # the store clock (``_Block.touched``)
        self._counts: dict[int, list[int]] = {}  # key -> [chains holding it in VRAM, in DRAM]
        self._step_old: dict[int, int] = {}  # key -> its tier before this call first touched it
        self._next_seq = [1] * shards
        self._reset_pending: set[int] = set(range(shards))
        self._last_seq = -1
        self._seen: dict[int, bytes] = {}
        self._seen_order: deque[int] = deque()
        self._buffer: dict[int, EngineBatch] = {}
        self._replay_from: int | None = None

    # ---- driver entry points ------------------------------------------------------------------

    def on_message(self, frames: Sequence[bytes | bytearray | memoryview]) -> AgentOutput:
        """Take one PUB message ``(topic, seq, payload)``."""
        b = self._decode(decode_message, frames)
        assert b is not None
        self.stats.messages += 1
        if b.seq <= self._last_seq or b.seq in self._buffer:
            known = self._seen.get(b.seq) if b.seq <= self._last_seq else self._buffer[b.seq].digest
            if known == b.digest:
                self.stats.duplicates += 1
                return AgentOutput()
            self._new_incarnation()
        return self._accept(b, live=True)

    def on_batch(self, batch: EngineBatch) -> AgentOutput:
        """Take one message already decoded (an in-process engine, such as the simulator's
        emulated workers, hands over its events without the wire round trip); the same checks
        and sequencing as :meth:`on_message`, the payload digest being ``batch.digest``."""
        b = self._decode(lambda _: batch, ())
        assert b is not None
        self.stats.messages += 1
        if b.seq <= self._last_seq or b.seq in self._buffer:
            known = self._seen.get(b.seq) if b.seq <= self._last_seq else self._buffer[b.seq].digest
            if known == b.digest:
                self.stats.duplicates += 1
                return AgentOutput()
            self._new_incarnation()
        return self._accept(b, live=True)

    def on_replay(self, frames: Sequence[bytes | bytearray | memoryview]) -> AgentOutput:
        """Take one replay reply ``(seq, payload)``; the end frame (seq -1) closes the replay."""
        b = self._decode(decode_replay, frames)
        if b is None:
            if self._replay_from is None:
                return AgentOutput()
            self._replay_from = None
            if self._buffer:  # the ring no longer held what the gap needs
                self._resync(forget=False)
            return AgentOutput(self._flush())
        self.stats.replayed += 1
        if b.seq <= self._last_seq or b.seq in self._buffer:
            self.stats.duplicates += 1
            return AgentOutput(self._flush())
        return self._accept(b, live=False)

    def on_replay_failed(self, *, forget: bool = False) -> AgentOutput:
        """The replay could not be had: resync (see the module notes); a no-op without a gap."""
        if self._replay_from is None and not self._buffer:
            return AgentOutput()
        self._resync(forget=forget)
        return AgentOutput(self._flush())

    def full_report(self) -> tuple[KeyOpBatch, ...]:
        """``reset`` batches for every shard carrying every key held now (reconnects; idempotent)."""
        self._reset_pending = set(range(self.shards))
        return self._flush()

    def on_rejected(self, shard: int | None = None) -> tuple[KeyOpBatch, ...]:
        """A maintenance unit refused a batch of ``shard`` (None: of any or every shard) with
        :class:`~kvcompass.errors.AgentSequenceError`: the full-report ``reset`` batches to send
        instead, at the next seqs of this incarnation.

        The usual cause is a unit that restarted (``MaintenanceUnit.from_bytes``) and so lost
        every agent sequence. Its tables may also be older than the batches it had accepted. A
        reset is accepted at any seq (it opens a sequence, or jumps a gap) and replaces the
        worker's keys in that shard, so after it the unit holds exactly :meth:`held`. Batches of
        that shard still queued behind the refused one may be dropped. Sent anyway, they are
        duplicates (lower seqs) once the reset is in, or refused again before it, which calls for
        one more ``on_rejected``.

        Not for :class:`~kvcompass.errors.StaleIncarnationError` (a subclass): that one means
        a newer agent process (a higher incarnation) owns the worker; resending cannot help.
        """
        if shard is None:
            self._reset_pending = set(range(self.shards))
        elif type(shard) is int and 0 <= shard < self.shards:
            self._reset_pending = {shard}
        else:
            raise InvalidArgumentError(f"shard must be None or an int in 0..{self.shards - 1}, got {shard!r}")
        return self._flush()

    def heartbeat(self) -> tuple[KeyOpBatch, ...]:
        """An empty batch for every shard at its next seq, for an agent with nothing to send.

        A maintenance unit restored from a state older than what it had acknowledged (a crash
        between two saves) has lost this agent's sequence; it refuses the next batch, and the
        ``on_rejected`` reset that answers makes it exact again. A busy agent gets there with its
        next real batch; a quiet one would leave the unit stale indefinitely, so agent drivers
        send these every few seconds of silence."""
        out = []
        empty_k, empty_t = np.zeros(0, dtype=np.uint64), np.zeros(0, dtype=np.uint8)
        for s in range(self.shards):
            out.append(KeyOpBatch(self.worker_id, self._incarnation, s, self._next_seq[s], empty_k, empty_t))
            self._next_seq[s] += 1
        self.stats.batches_emitted += len(out)
        return tuple(out)

    # ---- inspection ---------------------------------------------------------------------------

    @property
    def incarnation(self) -> int:
        return self._incarnation

    @property
    def last_seq(self) -> int:
        """The last applied engine seq of this incarnation (-1 before the first)."""
        return self._last_seq

    @property
    def replay_pending(self) -> ReplayRequest | None:
        """The replay this agent is waiting for, if any."""
        return None if self._replay_from is None else ReplayRequest(self._replay_from)

    @property
    def buffered(self) -> int:
        return len(self._buffer)

    @property
    def registration_lengths(self) -> tuple[int, ...]:
        return self._lengths

    def __len__(self) -> int:
        """Engine blocks tracked (including orphans, unindexed blocks and tombstones)."""
        return len(self._blocks)

    def held(self) -> dict[int, Tier]:
        """Every key this worker holds now, with its tier."""
        return {k: Tier(_tier(c)) for k, c in self._counts.items()}

    def digest(self) -> bytes:
        """SHA-256 of the agent's whole state (not its stats): equal digests, equal agents.

        Blocks are named by their place (group, then the chain of hashes from the prompt start
        or from an orphan's missing parent), not by the agent's internal ids, and the store
        clock by rank, so equal histories of the engine's cache digest equally."""
        names: dict[int, bytes] = {}

        def name(bid: int) -> bytes:
            path: list[int] = []
            cur: int | None = bid
            while cur is not None and cur not in names:
                path.append(cur)
                cur = self._blocks[cur].parent
            for b in reversed(path):
                x = self._blocks[b]
                up = names[x.parent] if x.parent is not None else repr((x.group, None if x.wait is None else _hk(x.wait))).encode()
                names[b] = hashlib.sha256(up + repr(_hk(x.hash)).encode()).digest()
            return names[bid]

        rank = {bid: i for i, bid in enumerate(sorted(self._blocks, key=lambda b: self._blocks[b].touched))}
        blocks = []
        for bid, x in self._blocks.items():
            blocks.append(
                (
                    name(bid),
                    None if x.parent is None else name(x.parent),
                    None if x.wait is None else _hk(x.wait),
                    x.size,
                    x.start,
                    None if x.state is None else x.state.copy().digest(),
                    x.tokens,
                    x.keys,
                    sorted(x.media),
                    x.own,
                    x.chain,
                    x.opaque,
                    rank[bid],
                )
            )
        blocks.sort()
        state = (
            self._incarnation,
            self._last_seq,
            self._next_seq,
            sorted(self._reset_pending),
            blocks,
            sorted((k, c) for k, c in self._counts.items()),
            sorted(self._seen.items()),
            sorted((s, b.digest) for s, b in self._buffer.items()),
            self._replay_from,
        )
        return hashlib.sha256(repr(state).encode()).digest()

    # ---- sequencing ---------------------------------------------------------------------------

    def _decode(self, fn: Callable[[_Frames], EngineBatch | None], frames: _Frames) -> EngineBatch | None:
        try:
            b = fn(frames)
            if b is not None and self.block_size is not None:
                for i, e in enumerate(b.events):
                    if isinstance(e, BlockStored) and e.block_size != self.block_size:
                        raise InvalidEventError(
                            f"seq {b.seq}: events[{i}] (BlockStored).block_size is {e.block_size}; this agent expects {self.block_size}",
                            seq=b.seq,
                            index=i,
                        )
        except InvalidEventError:
            self.stats.malformed += 1
            raise
        return b

    def _accept(self, b: EngineBatch, *, live: bool) -> AgentOutput:
        replay = None
        expected = self._last_seq + 1
        if b.seq == expected:
            self._apply(b)
            self._drain()
        else:  # b.seq > expected: callers filtered older ones
            if not self._buffer:
                self.stats.gaps += 1
            self._buffer[b.seq] = b
            if len(self._buffer) > self.max_buffered:
                self._resync(forget=False)
            elif self._replay_from is None and live:
                self._replay_from = expected
                self.stats.replay_requests += 1
                replay = ReplayRequest(expected)
        return AgentOutput(self._flush(), replay)

    def _drain(self) -> None:
        while self._last_seq + 1 in self._buffer:
            self._apply(self._buffer.pop(self._last_seq + 1))
        if not self._buffer:
            self._replay_from = None

    def _resync(self, *, forget: bool) -> None:
        self.stats.resyncs += 1
        if forget:
            self._clear()
        for seq in sorted(self._buffer):
            self._apply(self._buffer[seq])
        self._buffer.clear()
        self._replay_from = None
        self._reset_pending = set(range(self.shards))

    def _new_incarnation(self) -> None:
        self.stats.restarts += 1
        self._incarnation += 1
        self._clear()
        self._step_old.clear()
        self._next_seq = [1] * self.shards
        self._reset_pending = set(range(self.shards))
        self._last_seq = -1
        self._seen.clear()
        self._seen_order.clear()
        self._buffer.clear()
        self._replay_from = None

    def _apply(self, b: EngineBatch) -> None:
        events, i = b.events, 0
        while i < len(events):
            e = events[i]
            i += 1
            if isinstance(e, BlockStored):
                self._stored(e)
            elif isinstance(e, BlockRemoved):
                run = self._removals(e)
                while i < len(events) and isinstance(nxt := events[i], BlockRemoved):
                    run += self._removals(nxt)
                    i += 1
                self._removed(run)
            else:
                assert isinstance(e, AllBlocksCleared)
                self._clear()
                self.stats.clears += 1
        self.stats.events += len(b.events)
        self.stats.applied += 1
        self._last_seq = b.seq
        self._seen[b.seq] = b.digest
        self._seen_order.append(b.seq)
        while len(self._seen_order) > self.window:
            self._seen.pop(self._seen_order.popleft(), None)

    def _flush(self) -> tuple[KeyOpBatch, ...]:
        changed: dict[int, list[tuple[int, int]]] = {}
        for key, old in self._step_old.items():
            c = self._counts.get(key)
            new = 0 if c is None else _tier(c)
            if new != old:
                changed.setdefault(key % self.shards, []).append((key, new))
        self._step_old.clear()
        for s in self._reset_pending:
            changed[s] = []
        if self._reset_pending:
            for key, c in self._counts.items():
                s = key % self.shards
                if s in self._reset_pending:
                    changed[s].append((key, _tier(c)))
        out = []
        for s in sorted(changed):
            ops = sorted(changed[s])
            batch = KeyOpBatch(
                worker=self.worker_id,
                incarnation=self._incarnation,
                shard=s,
                seq=self._next_seq[s],
                keys=np.array([k for k, _ in ops], dtype=np.uint64),
                tiers=np.array([t for _, t in ops], dtype=np.uint8),
                reset=s in self._reset_pending,
            )
            self._next_seq[s] += 1
            self.stats.ops_emitted += len(ops)
            out.append(batch)
        self.stats.batches_emitted += len(out)
        self._reset_pending.clear()
        return tuple(out)

    # ---- the block forest ---------------------------------------------------------------------

    def _clear(self) -> None:
        for key, c in self._counts.items():
            if key not in self._step_old:
                self._step_old[key] = _tier(c)
        self._counts.clear()
        self._blocks.clear()
        self._roots.clear()
        self._by_hash.clear()
        self._orphans.clear()

    def _parent_of(self, group: int, ph: BlockHash | None, first: BlockHash | None) -> tuple[int | None, BlockHash | None]:
        """Where a BlockStored's first block hangs: (parent block id, None), or (None, ``ph``)
        under a parent the agent does not know (an orphan), or (None, None) at a prompt start."""
        if ph is None:
            return None, None
        slot = (group, ph)
        waiting = self._orphans.get(slot)
        if waiting is not None and first in waiting:  # that orphan, stored again
            return None, ph
        cands = self._by_hash.get(slot)
        if not cands:
            return None, ph
        if len(cands) == 1:
            return next(iter(cands)), None
        # Content hashes: the same page at several places. The pages of one node arrive chained,
        # each right after its parent, so the most recently stored live candidate is the one.
        self.stats.ambiguous_parents += 1
        blocks = self._blocks
        return max(cands, key=lambda c: (bool(blocks[c].media), blocks[c].touched)), None

    def _salt_root(self, extra: object) -> Sha256 | None:
        """The hash root of the tenant a first block's extra keys name: exactly one key, a salt
        this agent was given; None for anything else."""
        if not (isinstance(extra, tuple) and len(extra) == 1 and isinstance(extra[0], str)):
            return None
        salt = extra[0]
        root = self._salt_roots.get(salt)
        if root is None and self._tenant_salts and salt.startswith(TENANT_SALT_PREFIX):
            tenant = salt[len(TENANT_SALT_PREFIX) :]
            if _TENANT_RE.fullmatch(tenant):
                root = self._salt_roots[salt] = hashlib.sha256(Namespace(self.namespace.model, tenant).digest)
        return root

    def _child(self, group: int, parent: int | None, wait: BlockHash | None, h: BlockHash) -> int | None:
        """The block with hash ``h`` at that place, if the agent has it."""
        if parent is not None:
            return self._blocks[parent].kids.get(h)
        if wait is not None:
            waiting = self._orphans.get((group, wait))
            return None if waiting is None else waiting.get(h)
        return self._roots.get((group, h))

    def _stored(self, e: BlockStored) -> None:
        group = e.group_idx or 0
        medium = _medium_name(e.medium)
        n = e.block_size
        tokens = _core.pack_tokens(e.token_ids)  # little-endian u32, as struct.pack("<nI") would
        lora = e.lora_id is not None or e.lora_name is not None
        parent, wait = self._parent_of(group, e.parent_block_hash, e.block_hashes[0] if e.block_hashes else None)
        own_new = _own({medium})  # a new block is held by this medium alone
        blocks, by_hash, orphans, stats = self._blocks, self._by_hash, self._orphans, self.stats
        for i, h in enumerate(e.block_hashes):
            self._tick += 1
            bid = blocks[parent].kids.get(h) if parent is not None else self._child(group, parent, wait, h)
            if bid is not None:
                x = blocks[bid]
                if x.size != n:
                    stats.conflicts += 1
                    return  # the rest of the event hangs off a block we cannot place
                x.touched = self._tick
                if medium not in x.media:
                    x.media.add(medium)
                    self._set_own(bid, x)
                parent, wait = bid, None
                continue
            slot = (group, h)
            if wait is not None and slot in by_hash:
                # A known hash under a parent never seen: a contradiction with chained hashes,
                # and with content hashes a block that orphan adoption could put anywhere.
                stats.conflicts += 1
                return
            bid, self._ids = self._ids, self._ids + 1
            root: Sha256 | None = None
            opaque = lora
            if e.extra_keys is not None and e.extra_keys[i] is not None:
                # A prompt's first block salted with a salt we serve: keyed in that tenant's
                # namespace. Any other extra key (multimodal inputs, an unknown salt): unindexed.
                if i == 0 and parent is None and wait is None:
                    root = self._salt_root(e.extra_keys[0])
                opaque = opaque or root is None
            x = _Block(group, h, parent, wait, n, opaque, self._tick)
            x.root = root
            x.media.add(medium)
            x.own = own_new
            blocks[bid] = x
            same = by_hash.get(slot)
            if same is None:
                by_hash[slot] = {bid: None}
            else:
                same[bid] = None
            stats.blocks_stored += 1
            p = None if parent is None else blocks[parent]
            if p is not None:
                p.kids[h] = bid
                x.opaque = x.opaque or p.opaque
            elif wait is not None:
                orphans.setdefault((group, wait), {})[h] = bid
                stats.orphans += 1
            else:
                self._roots[slot] = bid
            chunk = tokens[i * n * 4 : (i + 1) * n * 4]
            if x.opaque:
                stats.unindexed += 1
            elif wait is None and (p is None or p.state is not None):
                self._key(x, chunk)
                # _refresh(bid) for a block with no children and no chain tier yet (_chain_of
                # of a keyed block held by ``medium``):
                if not own_new:
                    tier = 0
                elif p is None:
                    tier = own_new
                else:
                    tier = (own_new if own_new > p.chain else p.chain) if p.chain else 0
                if tier:
                    if x.keys:
                        self._count(x.keys, tier, +1)
                    x.chain = tier
            else:
                x.tokens = chunk
            waiting = orphans.get(slot)
            if waiting:
                for child in list(waiting.values()):
                    if child != bid:  # an orphan waits for *another* block with its parent's hash
                        self._adopt(bid, child)
            parent, wait = bid, None

    @staticmethod
    def _removals(e: BlockRemoved) -> list[_Removal]:
        group, medium = e.group_idx or 0, _medium_name(e.medium)
        return [(group, medium, h) for h in e.block_hashes]

    def _removed(self, run: list[_Removal]) -> None:
        """Apply a run of removals (consecutive BlockRemoved events; they commute).

        A hash named at least as often as blocks hold it removes them all. Otherwise (content
        hashes) the run is taken as what a radix cache evicts, a set closed under descendants,
        so a candidate can go only if every child that holds the medium goes too (its hash is
        still pending in the run, recursively). When no more candidates than removals pass
        that test, they are the ones. When no rule places any pending removal, the oldest
        passing candidate goes (leaves first, then any) and ``ambiguous_removals`` counts it."""
        todo: dict[_Removal, int] = {}
        for r in run:
            todo[r] = todo.get(r, 0) + 1
        while todo:
            progress = False
            for r, n in list(todo.items()):  # each entry changes only on its own turn
                medium = r[1]
                cands = self._holding(r)
                if len(cands) > n:
                    cands = self._removable(cands, r, todo)
                    if not cands or len(cands) > n:
                        continue
                elif len(cands) < n:
                    self.stats.unknown_removals += n - len(cands)  # they name nothing held
                    n = len(cands)
                for c in cands:
                    self._remove(c, medium)
                if len(cands) == n:
                    del todo[r]
                else:
                    todo[r] = n - len(cands)
                progress = True
            if not progress:  # stuck: no rule places any of them; the oldest candidate goes
                r = next(iter(todo))
                cands = self._holding(r)
                cands = self._removable(cands, r, todo) or cands
                cands = [c for c in cands if self._is_leaf(c, r[1])] or cands
                self.stats.ambiguous_removals += 1
                self._remove(min(cands, key=lambda c: self._blocks[c].touched), r[1])
                self._done(todo, r)

    def _removable(self, cands: list[int], r: _Removal, todo: dict[_Removal, int]) -> list[int]:
        """The candidates that the run can remove with every descendant holding the medium:
        the run still names each hash in that subtree at least as often as the subtree has it."""
        group, medium, _ = r
        out = []
        for c in cands:
            need: dict[BlockHash, int] = {}
            stack = [c]
            while stack:  # visits at most as many blocks as the run names, plus one
                x = self._blocks[stack.pop()]
                n = need[x.hash] = need.get(x.hash, 0) + 1
                if n > todo.get((group, medium, x.hash), 0):
                    break
                stack.extend(kid for kid in x.kids.values() if medium in self._blocks[kid].media)
            else:
                out.append(c)
        return out

    @staticmethod
    def _done(todo: dict[_Removal, int], r: _Removal) -> None:
        if todo[r] == 1:
            del todo[r]
        else:
            todo[r] -= 1

    def _holding(self, r: _Removal) -> list[int]:
        group, medium, h = r
        return [c for c in self._by_hash.get((group, h), ()) if medium in self._blocks[c].media]

    def _is_leaf(self, bid: int, medium: str) -> bool:
        return not any(medium in self._blocks[k].media for k in self._blocks[bid].kids.values())

    def _remove(self, bid: int, medium: str) -> None:
        x = self._blocks[bid]
        x.media.discard(medium)
        self.stats.blocks_removed += 1
        self._set_own(bid, x)
        self._collect(bid)

    def _set_own(self, bid: int, x: _Block) -> None:
        own = _own(x.media)
        if own != x.own:
            x.own = own
            self._refresh(bid)

    def _key(self, x: _Block, tokens: bytes) -> None:
        """Key block ``x`` (its parent is keyed, or it starts the prompt) from its tokens."""
        if x.parent is None:
            start, h = 0, (self._root if x.root is None else x.root).copy()
        else:
            p = self._blocks[x.parent]
            assert p.state is not None
            start, h = p.start + p.size, p.state.copy()
        end = start + x.size
        lengths = self._lengths
        lo = bisect_right(lengths, start)
        if lo == len(lengths) or lengths[lo] > end:  # most blocks: no registration length ends in it
            h.update(tokens)
            x.start, x.state, x.keys, x.tokens = start, h, (), None
            return
        hi = bisect_right(lengths, end, lo)
        keys = []
        view = memoryview(tokens)
        pos = start
        for c in lengths[lo:hi]:
            h.update(view[(pos - start) * 4 : (c - start) * 4])
            pos = c
            keys.append(int.from_bytes(h.copy().digest()[:8], "big") >> 1)
        h.update(view[(pos - start) * 4 :])
        x.start, x.state, x.keys, x.tokens = start, h, tuple(keys), None

    def _adopt(self, pid: int, cid: int) -> None:
        """Orphan ``cid`` was waiting for a block with ``pid``'s hash, which has just been stored."""
        p, c = self._blocks[pid], self._blocks[cid]
        if self._is_ancestor(cid, pid) or c.hash in p.kids:  # the engine contradicted itself
            self.stats.conflicts += 1
            self._make_opaque(cid)  # never key this loop; it stays an orphan
            return
        assert c.wait is not None
        self._unlink_orphan(c.group, c.wait, c.hash)
        c.parent, c.wait = pid, None
        p.kids[c.hash] = cid
        self.stats.adopted += 1
        if p.opaque:
            self._make_opaque(cid)
        elif p.state is not None:
            self._key_subtree(cid)

    def _unlink_orphan(self, group: int, wait: BlockHash, h: BlockHash) -> None:
        slot = (group, wait)
        waiting = self._orphans[slot]
        del waiting[h]
        if not waiting:
            del self._orphans[slot]

    def _is_ancestor(self, a: int, b: int) -> bool:
        cur: int | None = b
        while cur is not None:  # parent links never form a cycle (_adopt refuses one)
            if cur == a:
                return True
            cur = self._blocks[cur].parent
        return False

    def _make_opaque(self, bid: int) -> None:
        stack = [bid]
        while stack:
            cid = stack.pop()
            x = self._blocks[cid]
            if x.opaque:
                continue
            x.opaque, x.tokens = True, None
            if x.state is not None:  # was keyed: withdraw its keys
                x.state = None
                self._refresh(cid)
                x.keys = ()
            self.stats.unindexed += 1
            stack.extend(x.kids.values())

    def _key_subtree(self, bid: int) -> None:
        """Key ``bid`` and every orphan below it (their ancestry is complete now)."""
        stack = [bid]
        while stack:
            cid = stack.pop()
            x = self._blocks[cid]
            if x.opaque or x.state is not None or x.tokens is None:
                continue
            self._key(x, x.tokens)
            self._refresh(cid)
            stack.extend(x.kids.values())

    def _refresh(self, bid: int) -> None:
        """Recompute the chain tier of ``bid`` and, where it changed, of its descendants."""
        stack = [bid]
        while stack:
            cid = stack.pop()
            x = self._blocks[cid]
            new = self._chain_of(x)
            if new == x.chain:
                continue
            if x.chain:
                self._count(x.keys, x.chain, -1)
            if new:
                self._count(x.keys, new, +1)
            x.chain = new
            stack.extend(x.kids.values())

    def _chain_of(self, x: _Block) -> int:
        if x.state is None or not x.own:
            return 0
        if x.parent is None:
            return x.own
        p = self._blocks[x.parent]
        return max(x.own, p.chain) if p.chain else 0

    def _count(self, keys: Iterable[int], tier: int, delta: int) -> None:
        step_old, counts, i = self._step_old, self._counts, tier - 1
        for k in keys:
            c = counts.get(k)
            if k not in step_old:
                step_old[k] = 0 if c is None else _tier(c)
            if c is None:
                c = counts[k] = [0, 0]
            c[i] += delta
            if not c[0] and not c[1]:
                del counts[k]

    def _collect(self, bid: int) -> None:
        """Drop ``bid`` and then its ancestors while they hold nothing and have no children."""
        cur: int | None = bid
        while cur is not None:
            x = self._blocks.get(cur)
            if x is None or x.media or x.kids:
                return
            del self._blocks[cur]
            slot = (x.group, x.hash)
            same = self._by_hash[slot]
            del same[cur]
            if not same:
                del self._by_hash[slot]
            if x.parent is not None:
                del self._blocks[x.parent].kids[x.hash]
            elif x.wait is not None:
                self._unlink_orphan(x.group, x.wait, x.hash)
            else:
                del self._roots[slot]
            cur = x.parent


def _own(media: set[str]) -> int:
    best = 0
    for m in media:
        t = int(medium_tier(m))
        if t and (not best or t < best):
            best = t
    return best


def _tier(c: list[int]) -> int:
    return 1 if c[0] else 2 if c[1] else 0


def _hk(h: BlockHash) -> tuple[int, int | bytes]:
    """A sort key for a hash of either kind."""
    return (1, h) if isinstance(h, bytes) else (0, h)
