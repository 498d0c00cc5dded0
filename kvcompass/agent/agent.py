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
SHA-256 state after its last token, so a new block costs one block of hashing and a key at a
registration length ``c`` inside it costs a copy, the partial block and a digest. Keys equal
:func:`kvcompass.prefix_keys` of the same tokens.

**Where it runs.** The block forest described below (blocks, chains, orphans, removal runs,
key counts) is Rust (``rust/agent_forest.rs``, :class:`kvcompass._core.AgentForest`), rule for
rule; this class decodes and sequences the engine's messages (gaps, replays, re-deliveries,
restarts, incarnations) and hands every event to it. The services' agent runner and the
simulator use the same object.

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
  (ignored, counted; replayed messages are only ever taken as re-deliveries). A seq too old
  to remember whose batch timestamp is older than the newest applied one is a message that
  waited in the socket's queue while a replay or resync moved past it: dropped, counted as
  ``stale`` (an agent far behind its queue when a gap was repaired used to take each such
  message for an engine restart, withdrawing and re-reporting everything thousands of times).
  Other bytes under a remembered seq, or an old seq with a timestamp no older than the newest
  applied, mean the engine restarted: a new incarnation (bumped
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
import logging
import math
import re
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass

import numpy as np
import numpy.typing as npt

from kvcompass import _core
from kvcompass.agent.events import (
    AllBlocksCleared,
    BlockHash,
    BlockRemoved,
    BlockStored,
    EngineBatch,
    SkippedEvent,
    decode_message,
    decode_replay,
    encode_replay_request,
)
from kvcompass.discovery.key_ops import KeyOpBatch
from kvcompass.errors import InvalidArgumentError, InvalidEventError
from kvcompass.index_types import Namespace, Tier
from kvcompass.records import fast_init

_log = logging.getLogger(__name__)

__all__ = ["AGENT_COUNTERS", "TENANT_SALT_PREFIX", "AgentOutput", "AgentStats", "ReplayRequest", "WorkerAgent", "boot_incarnation", "medium_tier"]

_Frames = Sequence[bytes | bytearray | memoryview]

_Removal = tuple[int, str, Sequence[BlockHash] | npt.NDArray[np.uint64]]
"""One BlockRemoved event: (group, medium name, its block hashes)."""

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


MAX_MEDIA = 256
"""Distinct medium names an agent tracks (see ``WorkerAgent._medium_known``)."""


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


@fast_init
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
    events_skipped: int = 0  # events of applied messages that could not be understood (skipped, the rest applied)
    duplicates: int = 0  # re-delivered messages ignored
    stale: int = 0  # messages older than the digest window and than the newest applied one, dropped
    unplaced_copies: int = 0  # blocks a token-less copy named that the agent could not place (unknown or ambiguous hash)
    other_groups: int = 0  # stores of a KV cache group other than 0: a hybrid model, whose claims may be stale (docs/engines.md)
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


AGENT_COUNTERS: dict[str, str] = {
    "gaps": "Gaps in the engine's message sequence (each repaired by a replay, or by a resync)",
    "resyncs": "Gaps the engine's replay ring could not fill: everything re-reported, and claims that events lost beyond the ring touched may be stale",
    "restarts": "Engine restarts seen (a new incarnation: every claim withdrawn, then learned again)",
    "duplicates": "Re-delivered engine messages ignored",
    "stale": "Engine messages older than the digest window and the newest applied one, dropped",
    "orphans": "Blocks stored under a parent the agent did not know (not indexed until the parent is)",
    "unindexed": "Blocks stored with LoRA or extra keys, and their descendants: not indexed",
    "unknown_removals": "Removals of a block or medium the agent did not hold",
    "unplaced_copies": "Blocks a token-less copy named that the agent could not place",
    "other_groups": "Stores of a KV cache group other than 0 (a hybrid model: claims may be stale)",
    "conflicts": "Blocks stored again with another size, known hashes under unknown parents, adoption cycles",
}
"""The :class:`AgentStats` fields an agent's driver exports (``kvcompass_agent_<field>_total``),
with their meaning: what an operator watches to know whether the index can be trusted."""


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
        self._lengths = tuple(lengths)
        self._salt_roots: dict[str, bytes] = {}  # salt -> the namespace digest it keys under
        for salt, ns in (salts or {}).items():
            if not isinstance(salt, str) or not salt or not isinstance(ns, Namespace):
                raise InvalidArgumentError(f"salts must map non-empty strings to Namespaces, got {salt!r}: {ns!r}")
            self._salt_roots[salt] = ns.digest
        self._tenant_salts = bool(tenant_salts)
        self._salts_seen: tuple[str, ...] | None = None
        self._salt_root_row: tuple[bytes | None, ...] = (None,)
        self._incarnation = incarnation
        # The block forest (blocks, chains, orphans, tombstones, key counts and the keys changed
        # since the last flush) is Rust's: rust/agent_forest.rs, rule for rule the module notes.
        self._forest = _core.AgentForest(list(self._lengths), namespace.digest)
        self._stats = AgentStats()
        self._next_seq = [1] * shards
        self._reset_pending: set[int] = set(range(shards))
        self._last_seq = -1
        self._seen: dict[int, bytes] = {}
        self._media: set[str] = set()  # medium names given to the forest (never more than MAX_MEDIA)
        self._newest_ts = -math.inf  # the latest batch timestamp applied in this incarnation
        self._seen_order: deque[int] = deque()
        self._buffer: dict[int, EngineBatch] = {}
        self._replay_from: int | None = None
        # A catch_up replay under way: a ring that starts past seq 0, or an engine not answering
        # yet, is the expected start of a fresh agent, not a gap it failed to fill.
        self._catching_up = False
        # Skipped events not yet taken by the driver (for its log): (seq, event), the latest 256.
        self._skips: deque[tuple[int, SkippedEvent]] = deque(maxlen=256)

    # ---- driver entry points ------------------------------------------------------------------

    def on_message(self, frames: Sequence[bytes | bytearray | memoryview]) -> AgentOutput:
        """Take one PUB message ``(topic, seq, payload)``."""
        b = self._decode(decode_message, frames)
        assert b is not None
        return self._live(b)

    def on_batch(self, batch: EngineBatch) -> AgentOutput:
        """Take one message already decoded (an in-process engine, such as the simulator's
        emulated workers, hands over its events without the wire round trip); the same checks
        and sequencing as :meth:`on_message`, the payload digest being ``batch.digest``."""
        b = self._decode(lambda _: batch, ())
        assert b is not None
        return self._live(b)

    def _live(self, b: EngineBatch) -> AgentOutput:
        """A live message: a re-delivery is ignored, other bytes under a seen seq mean the
        engine restarted (see the module notes), the rest is sequenced."""
        self._stats.messages += 1
        if b.seq <= self._last_seq or b.seq in self._buffer:
            known = self._seen.get(b.seq) if b.seq <= self._last_seq else self._buffer[b.seq].digest
            if known == b.digest:
                self._stats.duplicates += 1
                return AgentOutput()
            if known is None and b.seq <= self._last_seq and b.ts < self._newest_ts:
                self._stats.stale += 1  # queued from before a repair that moved past it
                return AgentOutput()
            self._new_incarnation()
        return self._accept(b, live=True)

    def on_replay(self, frames: Sequence[bytes | bytearray | memoryview]) -> AgentOutput:
        """Take one replay reply ``(seq, payload)``; the end frame (seq -1) closes the replay."""
        b = self._decode(decode_replay, frames)
        if b is None:
            self._catching_up = False
            if self._replay_from is None:
                return AgentOutput()
            self._replay_from = None
            if self._buffer:  # the ring no longer held what the gap needs
                self._resync(forget=False)
            return AgentOutput(self._flush())
        self._stats.replayed += 1
        if b.seq <= self._last_seq:
            self._stats.duplicates += 1
            return AgentOutput(self._flush())
        if b.seq in self._buffer:
            # Held from the live stream already: taken now, in its turn. Counted as a duplicate
            # and skipped, it was then dropped as stale when a later reply resynced past the
            # gap (found in review: a removal never applied, its block claimed for good).
            b = self._buffer.pop(b.seq)
        return self._accept(b, live=False)

    def catch_up(self) -> AgentOutput:
        """What an agent that starts beside a running engine asks first: a replay from seq 0, for
        everything the engine's ring still holds, before any live message (found in review: a
        restarted agent withdrew its worker's claims with its opening reset and learned them
        again only from the engine's next event, which an idle engine, or one serving only full
        hits, never publishes). Nothing once a message was taken or a replay is under way."""
        if self._last_seq >= 0 or self._replay_from is not None or self._buffer:
            return AgentOutput()
        self._replay_from = 0
        self._catching_up = True
        self._stats.replay_requests += 1
        return AgentOutput(replay=ReplayRequest(0))

    def on_replay_failed(self, *, forget: bool = False) -> AgentOutput:
        """The replay could not be had: resync (see the module notes); a no-op without a gap."""
        if self._replay_from is None and not self._buffer:
            return AgentOutput()
        if self._catching_up and not self._buffer:  # nothing was missed; nothing was learnt either
            self._catching_up = False
            self._replay_from = None
            return AgentOutput(self._flush())
        self._catching_up = False
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

    def on_engine_gone(self) -> tuple[KeyOpBatch, ...]:
        """The engine's event stream went away (its process ended, or the connection to it):
        nothing it held can be vouched for any more, so every claim is withdrawn now (a new
        incarnation whose ``reset`` batches hold nothing) rather than when a restarted
        engine's first event arrives, which may be much later, or never for an idle one
        (issue 19: a worker restarted empty kept its claims for seconds). An engine that comes
        back with its cache intact after a network cut is re-learned from its events, so its
        older blocks go unclaimed until stored again: under-claiming is the safe side."""
        self._new_incarnation()
        return self._flush()

    def heartbeat(self) -> tuple[KeyOpBatch, ...]:
        """An empty batch for every shard at its next seq, for an agent with nothing to send.

        A maintenance unit restored from a state older than what it had acknowledged (a crash
        between two saves) has lost this agent's sequence; it refuses the next batch, and the
        ``on_rejected`` reset that answers makes it exact again. A busy agent gets there with its
        next real batch; a quiet one would leave the unit stale indefinitely, so agent drivers
        send these every few seconds of silence.

        Shards still owed their incarnation's opening reset get it here (found in review: a new
        agent's first heartbeat opened each sequence without one, so a dead engine's claims
        stayed until the new engine published something)."""
        if self._reset_pending:
            return self._flush()
        out = []
        empty_k, empty_t = np.zeros(0, dtype=np.uint64), np.zeros(0, dtype=np.uint8)
        for s in range(self.shards):
            out.append(KeyOpBatch(self.worker_id, self._incarnation, s, self._next_seq[s], empty_k, empty_t))
            self._next_seq[s] += 1
        self._stats.batches_emitted += len(out)
        return tuple(out)

    # ---- inspection ---------------------------------------------------------------------------

    @property
    def stats(self) -> AgentStats:
        """The counters (the block forest's brought up to date)."""
        st = self._stats
        (
            st.blocks_stored,
            st.blocks_removed,
            st.orphans,
            st.adopted,
            st.unindexed,
            st.unknown_removals,
            st.conflicts,
            st.ambiguous_parents,
            st.ambiguous_removals,
        ) = self._forest.stats()
        return st

    @property
    def incarnation(self) -> int:
        return self._incarnation

    @property
    def resyncs(self) -> int:
        """``stats.resyncs`` without bringing the forest's counters up to date (a driver reads
        it after every message)."""
        return self._stats.resyncs

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
        return len(self._forest)

    @property
    def memory_bytes(self) -> int:
        """Bytes the block forest holds in Rust, out of a Python heap profiler's sight (at fleet
        scale in the simulator, most of a KVCompass run's memory)."""
        return int(self._forest.memory_bytes())

    def held(self) -> dict[int, Tier]:
        """Every key this worker holds now, with its tier."""
        keys, tiers = self._forest.held()
        return {k: Tier(t) for k, t in zip(keys.tolist(), tiers.tolist())}

    def digest(self) -> bytes:
        """SHA-256 of the agent's whole state (not its stats): equal digests, equal agents.

        The block forest digests itself (blocks named by their place, not by internal ids, and
        the store clock by rank, so equal histories of the engine's cache digest equally); the
        sequencing state is added here."""
        state = (
            self._incarnation,
            self._last_seq,
            self._next_seq,
            sorted(self._reset_pending),
            self._forest.digest(),
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
                ce = b.cache_events
                if ce is not None and len(ce) and ce.block_size != self.block_size:
                    raise InvalidEventError(
                        f"seq {b.seq}: cache_events are of blocks of {ce.block_size} tokens; this agent expects {self.block_size}",
                        seq=b.seq,
                        index=len(b.events),
                    )
        except InvalidEventError:
            self._stats.malformed += 1
            raise
        return b

    def _accept(self, b: EngineBatch, *, live: bool) -> AgentOutput:
        replay = None
        expected = self._last_seq + 1
        if b.seq == expected:
            self._apply(b)
            self._drain()
        elif not live:
            # A replay reply past the gap: the engine's ring no longer holds [expected, b.seq).
            # Buffering it filled the buffer on a long-running engine, whose resync then jumped
            # past the rest of the replay, dropped as duplicates: removals in it never reached
            # the index (found in review). The history before b.seq is gone either way: resync
            # from here (every shard re-reported) and take the rest of the replay in order. A
            # fresh agent's catch-up starting past seq 0 loses nothing it ever knew: no resync.
            if not (self._catching_up and self._last_seq == -1):
                self._stats.resyncs += 1
            self._reset_pending = set(range(self.shards))
            for s in [s for s in self._buffer if s < b.seq]:  # live ones from inside the lost span:
                del self._buffer[s]  # applied after it they would claim what it may have removed
                self._stats.stale += 1
            self._last_seq = b.seq - 1
            self._apply(b)
            self._drain()
        else:  # b.seq > expected: callers filtered older ones
            if not self._buffer:
                self._stats.gaps += 1
            self._buffer[b.seq] = b
            if len(self._buffer) > self.max_buffered:
                self._resync(forget=False)
            elif self._replay_from is None and live:
                self._replay_from = expected
                self._stats.replay_requests += 1
                replay = ReplayRequest(expected)
        return AgentOutput(self._flush(), replay)

    def _drain(self) -> None:
        while self._last_seq + 1 in self._buffer:
            self._apply(self._buffer.pop(self._last_seq + 1))
        if not self._buffer:
            self._replay_from = None

    def _resync(self, *, forget: bool) -> None:
        self._stats.resyncs += 1
        if forget:
            self._clear()
        for seq in sorted(self._buffer):
            self._apply(self._buffer[seq])
        self._buffer.clear()
        self._replay_from = None
        self._reset_pending = set(range(self.shards))

    def _new_incarnation(self) -> None:
        self._stats.restarts += 1
        self._incarnation += 1
        self._clear()
        self._forest.forget_changes()
        self._next_seq = [1] * self.shards
        self._reset_pending = set(range(self.shards))
        self._last_seq = -1
        self._newest_ts = -math.inf
        self._seen.clear()
        self._seen_order.clear()
        self._buffer.clear()
        self._replay_from = None
        self._catching_up = False

    def take_skipped(self) -> list[tuple[int, SkippedEvent]]:
        """The events skipped since the last call, as ``(seq, event)`` (the latest 256), for
        the driver to log; counted in ``stats.events_skipped`` and :attr:`skipped_total`."""
        out = list(self._skips)
        self._skips.clear()
        return out

    @property
    def skipped_total(self) -> int:
        """Every event skipped so far, logged or not (:meth:`take_skipped` keeps only the latest
        256 for a driver that has not asked for a while; a count must not stop there)."""
        return self._stats.events_skipped

    def _apply(self, b: EngineBatch) -> None:
        if b.skipped:
            self._stats.events_skipped += len(b.skipped)
            self._skips.extend((b.seq, sk) for sk in b.skipped)
        events, i = b.events, 0
        while i < len(events):
            e = events[i]
            i += 1
            if isinstance(e, (BlockStored, BlockRemoved)) and not self._medium_known(e, b, i - 1):
                continue
            if isinstance(e, BlockStored):
                self._stored(e)
            elif isinstance(e, BlockRemoved):
                run = [self._removal(e)]
                while i < len(events) and isinstance(nxt := events[i], BlockRemoved):
                    i += 1
                    if self._medium_known(nxt, b, i - 1):
                        run.append(self._removal(nxt))
                self._forest.removed(run)
            else:
                assert isinstance(e, AllBlocksCleared)
                self._clear()
                self._stats.clears += 1
        n = len(b.events)
        ce = b.cache_events
        if ce is not None:
            self._forest.cache_events(ce, self._cache_salt_roots(b.salts))
            n += len(ce)
        self._stats.events += n
        self._stats.applied += 1
        self._last_seq = b.seq
        if b.ts > self._newest_ts:
            self._newest_ts = b.ts
        self._seen[b.seq] = b.digest
        self._seen_order.append(b.seq)
        while len(self._seen_order) > self.window:
            self._seen.pop(self._seen_order.popleft(), None)

    def _flush(self) -> tuple[KeyOpBatch, ...]:
        out = []
        for s, keys, tiers in self._forest.flush(self.shards, sorted(self._reset_pending)):
            batch = KeyOpBatch(
                worker=self.worker_id,
                incarnation=self._incarnation,
                shard=s,
                seq=self._next_seq[s],
                keys=keys,
                tiers=tiers,
                reset=s in self._reset_pending,
            )
            self._next_seq[s] += 1
            self._stats.ops_emitted += len(keys)
            out.append(batch)
        self._stats.batches_emitted += len(out)
        self._reset_pending.clear()
        return tuple(out)

    # ---- the block forest (rust/agent_forest.rs) ------------------------------------------------

    def _clear(self) -> None:
        self._forest.clear()

    def _salt_root(self, extra: object) -> bytes | None:
        """The namespace digest of the tenant a first block's extra keys name: exactly one key, a
        salt this agent was given; None for anything else."""
        if not (isinstance(extra, tuple) and len(extra) == 1 and isinstance(extra[0], str)):
            return None
        salt = extra[0]
        root = self._salt_roots.get(salt)
        if root is None and self._tenant_salts and salt.startswith(TENANT_SALT_PREFIX):
            tenant = salt[len(TENANT_SALT_PREFIX) :]
            if _TENANT_RE.fullmatch(tenant):
                root = self._salt_roots[salt] = Namespace(self.namespace.model, tenant).digest
        return root

    def _cache_salt_roots(self, salts: tuple[str, ...]) -> tuple[bytes | None, ...]:
        """The namespace digest of each salt number of a batch's ``cache_events`` (0: none),
        as :meth:`_salt_root` reads each salt; kept for the last salt tuple seen (a simulated
        worker's batches all carry one)."""
        if salts is not self._salts_seen:
            self._salts_seen = salts
            self._salt_root_row = (None, *(self._salt_root((s,)) for s in salts))
        return self._salt_root_row

    def _stored(self, e: BlockStored) -> None:
        if e.group_idx:
            # A hybrid model: a prefix counts as held while any group holds it, where vLLM
            # needs every group (docs/engines.md, "Known gaps"). Said once, counted always.
            if not self._stats.other_groups:
                _log.warning("worker %s: the engine publishes KV cache group %d besides group 0; "
                             "claims of a hybrid model can outlive a group's eviction (docs/engines.md, Known gaps)", self.worker_id, e.group_idx)
            self._stats.other_groups += 1
        extra = e.extra_keys
        t = e.token_ids
        if len(t) == 0 and e.parent_block_hash is None and len(e.block_hashes):
            # A copy of known blocks to another medium (see BlockStored): vLLM's CPU offload.
            self._stats.unplaced_copies += self._forest.copied(e.group_idx or 0, _medium_name(e.medium), e.block_hashes)
            return
        self._forest.stored(
            e.group_idx or 0,
            _medium_name(e.medium),
            e.block_size,
            # little-endian u32, as struct.pack("<nI") would (a uint32 array is read in place)
            (t if t.dtype == np.uint32 else t.astype("<u4").tobytes()) if isinstance(t, np.ndarray) else _core.pack_tokens(t),
            e.lora_id is not None or e.lora_name is not None,
            e.parent_block_hash,
            e.block_hashes,
            None if extra is None else [k is not None for k in extra],
            self._salt_root(extra[0]) if extra is not None and extra and extra[0] is not None else None,
        )

    def _medium_known(self, e: BlockStored | BlockRemoved, b: EngineBatch, at: int) -> bool:
        """Whether ``e``'s medium is one the agent tracks, or may become one: at most
        :data:`MAX_MEDIA` distinct names (engines name a handful: GPU, CPU, a disk or a remote
        store). One past them is skipped like a malformed event. Found in review: every name
        got a permanent 16-bit id in the forest, so 65,536 made-up names wrapped an id round to
        GPU's, and a removal on the next one withdrew GPU copies."""
        name = _medium_name(e.medium)
        if name in self._media:
            return True
        if len(self._media) < MAX_MEDIA:
            self._media.add(name)
            return True
        # The event's index in its payload: decoded events skip the ones decoding skipped.
        index = at
        for j in sorted(x.index for x in b.skipped):
            if j <= index:
                index += 1
        why = SkippedEvent(index, f"seq {b.seq}: events[{index}] names medium {name[:64]!r}, one more than the {MAX_MEDIA} distinct media an agent tracks")
        self._stats.events_skipped += 1
        self._skips.append((b.seq, why))
        return False

    @staticmethod
    def _removal(e: BlockRemoved) -> _Removal:
        return e.group_idx or 0, _medium_name(e.medium), e.block_hashes
