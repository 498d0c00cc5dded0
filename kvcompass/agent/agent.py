"""The worker agent: an engine's KV events in, key-op batches for the maintenance units out.

Sans-I/O: the driver hands in the frames it received (``on_message`` for the PUB socket,
``on_replay`` for replay replies) and performs what comes back (send the key-op batches; when
``replay`` is set, ask the engine's replay socket from ``replay.start_seq``). Nothing here
opens a socket, sleeps or reads a clock.

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

**Blocks the agent cannot key.** A block whose parent the agent never saw (it started after the
engine, or lost events) is kept with its tokens as an *orphan* and keyed as soon as that parent
is stored. Blocks with LoRA (``lora_id``/``lora_name``) or ``extra_keys`` (multimodal inputs,
cache salt), and everything stored below them, are *unindexed*: their KV depends on more than
the tokens, so a token-derived key would claim a cache that another request cannot reuse. A
removed block that still has stored descendants stays as a tombstone so that the chain can be
re-completed when the engine stores it again. Blocks are filed per KV-cache group
(``group_idx``, None read as 0), so removals resolve within their group; a key counts as held
while any group's chain holds it.

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

The first batch of every shard in an incarnation is a ``reset`` batch, so an agent that starts
(or restarts) clears whatever an earlier agent process had reported for this worker.

**Malformed input** raises :class:`~kvcompass.errors.InvalidEventError`, counts in
``stats.malformed`` and leaves the agent's state as it was: a message is decoded and validated
completely before anything changes. (Its seq then never applies, so the next message opens a
gap and the replay / resync path takes over.) Engine-level oddities inside well-formed messages
(a removal of an unknown block, a hash stored twice under different parents) are not errors:
they are counted and skipped.
"""

from __future__ import annotations

import hashlib
import struct
from bisect import bisect_right
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

import numpy as np

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

__all__ = ["AgentOutput", "AgentStats", "ReplayRequest", "WorkerAgent", "medium_tier"]

_Frames = Sequence[bytes | bytearray | memoryview]

BlockId = tuple[int, BlockHash]
"""An engine block as the agent files it: (KV-cache group index, block hash)."""


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
    conflicts: int = 0  # a known hash stored again under another parent or size
    batches_emitted: int = 0
    ops_emitted: int = 0

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


class _Block:
    """One engine block. Keyed (``state`` set) once its whole ancestry is known; until then an
    orphan keeps its tokens. ``chain`` is the tier of the prefix ending at this block (0: not
    held), ``own`` the best tier among the media holding this block itself."""

    __slots__ = ("parent", "size", "start", "state", "tokens", "keys", "media", "own", "chain", "children", "opaque")

    def __init__(self, parent: BlockId | None, size: int, opaque: bool) -> None:
        self.parent = parent
        self.size = size
        self.start = -1
        self.state: Sha256 | None = None
        self.tokens: bytes | None = None
        self.keys: tuple[int, ...] = ()
        self.media: set[str] = set()
        self.own = 0
        self.chain = 0
        self.children: set[BlockId] = set()
        self.opaque = opaque


class WorkerAgent:
    """Turns one engine's KV events into key-op batches for one worker.

    ``registration_lengths``: the prefix lengths (tokens) this worker registers, i.e. the union
    of what the edges query toward its region. ``shards``: the number of maintenance shards
    (a key belongs to ``key % shards``). ``block_size``: when given, a BlockStored of any other
    block size is refused as malformed (leave it None for SGLang, whose last page of a node may
    be short). ``incarnation``: the first incarnation number (a restarted agent process should
    pass a larger one than its predecessor used). ``window``: how many applied payload digests
    are remembered to tell re-deliveries from a restarted engine (vLLM's replay ring holds
    10,000 batches). ``max_buffered``: messages held while a gap waits for its replay.
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
        self._incarnation = incarnation
        self._blocks: dict[BlockId, _Block] = {}
        self._orphans: dict[BlockId, set[BlockId]] = {}  # missing parent -> children waiting for it
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
        """SHA-256 of the agent's whole state (not its stats): equal digests, equal agents."""
        blocks = []
        for bid in sorted(self._blocks, key=_order):
            x = self._blocks[bid]
            blocks.append(
                (
                    bid,
                    x.parent,
                    x.size,
                    x.start,
                    None if x.state is None else x.state.copy().digest(),
                    x.tokens,
                    x.keys,
                    sorted(x.media),
                    x.own,
                    x.chain,
                    sorted(x.children, key=_order),
                    x.opaque,
                )
            )
        state = (
            self._incarnation,
            self._last_seq,
            self._next_seq,
            sorted(self._reset_pending),
            blocks,
            sorted(((p, sorted(c, key=_order)) for p, c in self._orphans.items()), key=lambda pc: _order(pc[0])),
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
        for e in b.events:
            if isinstance(e, BlockStored):
                self._stored(e)
            elif isinstance(e, BlockRemoved):
                self._removed(e)
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
        self._orphans.clear()

    def _stored(self, e: BlockStored) -> None:
        group = e.group_idx or 0
        medium = _medium_name(e.medium)
        n = e.block_size
        tokens = struct.pack(f"<{len(e.token_ids)}I", *e.token_ids)
        lora = e.lora_id is not None or e.lora_name is not None
        parent: BlockId | None = None if e.parent_block_hash is None else (group, e.parent_block_hash)
        for i, h in enumerate(e.block_hashes):
            bid: BlockId = (group, h)
            x = self._blocks.get(bid)
            if x is not None:
                if x.parent != parent or x.size != n:
                    self.stats.conflicts += 1
                    return  # the rest of the event hangs off a block we cannot place
                if medium not in x.media:
                    x.media.add(medium)
                    self._set_own(bid, x)
                parent = bid
                continue
            opaque = lora or (e.extra_keys is not None and e.extra_keys[i] is not None)
            x = _Block(parent, n, opaque)
            x.media.add(medium)
            x.own = _own(x.media)
            self._blocks[bid] = x
            self.stats.blocks_stored += 1
            p = None if parent is None else self._blocks.get(parent)
            if parent is not None and p is None:
                self._orphans.setdefault(parent, set()).add(bid)
                self.stats.orphans += 1
            elif p is not None:
                p.children.add(bid)
                x.opaque = x.opaque or p.opaque
            chunk = tokens[i * n * 4 : (i + 1) * n * 4]
            if x.opaque:
                self.stats.unindexed += 1
            elif parent is None or (p is not None and p.state is not None):
                self._key(x, chunk)
                self._refresh(bid)
            else:
                x.tokens = chunk
            for child in sorted(self._orphans.pop(bid, ()), key=_order):
                self._adopt(bid, child)
            parent = bid

    def _removed(self, e: BlockRemoved) -> None:
        group = e.group_idx or 0
        medium = _medium_name(e.medium)
        for h in e.block_hashes:
            bid: BlockId = (group, h)
            x = self._blocks.get(bid)
            if x is None or medium not in x.media:
                self.stats.unknown_removals += 1
                continue
            x.media.discard(medium)
            self.stats.blocks_removed += 1
            self._set_own(bid, x)
            self._collect(bid)

    def _set_own(self, bid: BlockId, x: _Block) -> None:
        own = _own(x.media)
        if own != x.own:
            x.own = own
            self._refresh(bid)

    def _key(self, x: _Block, tokens: bytes) -> None:
        """Key block ``x`` (its parent is keyed, or it starts the prompt) from its tokens."""
        if x.parent is None:
            start, h = 0, self._root.copy()
        else:
            p = self._blocks[x.parent]
            assert p.state is not None
            start, h = p.start + p.size, p.state.copy()
        end = start + x.size
        lengths = self._lengths
        lo, hi = bisect_right(lengths, start), bisect_right(lengths, end)
        keys = []
        view = memoryview(tokens)
        pos = start
        for c in lengths[lo:hi]:
            h.update(view[(pos - start) * 4 : (c - start) * 4])
            pos = c
            keys.append(int.from_bytes(h.copy().digest()[:8], "big") >> 1)
        h.update(view[(pos - start) * 4 :])
        x.start, x.state, x.keys, x.tokens = start, h, tuple(keys), None

    def _adopt(self, pid: BlockId, cid: BlockId) -> None:
        """Orphan ``cid`` was waiting for ``pid``, which has just been stored."""
        p, c = self._blocks[pid], self._blocks[cid]
        self.stats.adopted += 1
        if self._is_ancestor(cid, pid):  # the engine contradicted itself; never key this loop
            self.stats.conflicts += 1
            self._make_opaque(pid)
        p.children.add(cid)
        if p.opaque:
            self._make_opaque(cid)
        elif p.state is not None:
            self._key_subtree(cid)

    def _is_ancestor(self, a: BlockId, b: BlockId) -> bool:
        seen: set[BlockId] = set()
        cur: BlockId | None = b
        while cur is not None and cur not in seen:
            if cur == a:
                return True
            seen.add(cur)
            x = self._blocks.get(cur)
            cur = None if x is None else x.parent
        return False

    def _make_opaque(self, bid: BlockId) -> None:
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
            stack.extend(x.children)

    def _key_subtree(self, bid: BlockId) -> None:
        """Key ``bid`` and every orphan below it (their ancestry is complete now)."""
        stack = [bid]
        while stack:
            cid = stack.pop()
            x = self._blocks[cid]
            if x.opaque or x.state is not None or x.tokens is None:
                continue
            self._key(x, x.tokens)
            self._refresh(cid)
            stack.extend(x.children)

    def _refresh(self, bid: BlockId) -> None:
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
            stack.extend(x.children)

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

    def _collect(self, bid: BlockId) -> None:
        """Drop ``bid`` and then its ancestors while they hold nothing and have no children."""
        cur: BlockId | None = bid
        while cur is not None:
            x = self._blocks.get(cur)
            if x is None or x.media or x.children:
                return
            del self._blocks[cur]
            parent = x.parent
            if parent is None:
                return
            p = self._blocks.get(parent)
            if p is not None:
                p.children.discard(cur)
            else:
                waiting = self._orphans.get(parent)
                if waiting is not None:
                    waiting.discard(cur)
                    if not waiting:
                        del self._orphans[parent]
            cur = parent


def _own(media: set[str]) -> int:
    best = 0
    for m in media:
        t = int(medium_tier(m))
        if t and (not best or t < best):
            best = t
    return best


def _tier(c: list[int]) -> int:
    return 1 if c[0] else 2 if c[1] else 0


def _order(bid: BlockId) -> tuple[int, int, int | bytes]:
    g, h = bid
    return (g, 1, h) if isinstance(h, bytes) else (g, 0, h)
