"""The maintenance unit of one shard: the single writer of every (table, shard) Ludo table.

Agents send :class:`~kvcompass.discovery.key_ops.KeyOpBatch` es; the unit authenticates and
validates each whole batch, applies it, and :meth:`MaintenanceUnit.flush` closes the resulting
edits into one sequenced patch batch per table. Views (edges) apply those in order; one that
fell behind asks :meth:`MaintenanceUnit.resume` and gets the batches it misses from a bounded
replay log, or a snapshot.

Sans-I/O: no sockets, no clock, no files. The driver moves bytes (and writes
:meth:`MaintenanceUnit.to_bytes` to disk if it wants a restart to keep the shard).

Agent sequencing, per worker (a unit is one shard, so one sequence per worker):

* A batch that *opens* a sequence (the worker's first since this unit started, or a higher
  incarnation) is accepted when it is ``seq == 1`` or a ``reset``.
* Within a sequence: ``seq == last + 1`` is applied; ``seq <= last`` is a duplicate and ignored
  (counted, and reported in :class:`ApplyReport`); ``seq > last + 1`` is a gap:
  :class:`~kvcompass.errors.AgentSequenceError` ``(expected, got)`` and nothing changes.
* A ``reset`` batch is self-contained (it replaces everything the worker held in this shard),
  so it is accepted at any ``seq > last``: that is how an agent recovers from a gap, by
  re-reporting its full inventory of the shard with ``reset=True`` and its next seq.
* A lower incarnation is a zombie: :class:`~kvcompass.errors.StaleIncarnationError`.

Sequence state is not persisted: after a restart (:meth:`MaintenanceUnit.from_bytes`) every
worker's sequence opens afresh, so an agent that keeps streaming ``seq = n`` gets a gap error
(``expected=1``) and re-reports with ``reset`` -- which it must do anyway, because the state on
disk may be older than its last batches.

Who holds what is not tracked beside the tables: a worker's keys are exactly the keys whose
value has its 2-bit field nonzero, so a reset reads them from the table (one vectorised scan;
resets are rare), and persistence needs nothing but the tables' entries.
"""

from __future__ import annotations

import hashlib
import struct
import zlib
from collections import deque
from dataclasses import dataclass, field
from typing import NoReturn

import numpy as np
import numpy.typing as npt

from kvcompass._core import LudoTable
from kvcompass.discovery.layout import IndexLayout
from kvcompass.discovery.key_ops import KeyOpBatch
from kvcompass.errors import (
    AgentSequenceError,
    CapacityError,
    ForbiddenWriteError,
    InvalidArgumentError,
    InvalidKeyError,
    InvalidTierError,
    KVCompassError,
    StaleIncarnationError,
    WrongShardError,
)
from kvcompass.records import fast_init

__all__ = ["ApplyReport", "MaintenanceStats", "MaintenanceUnit", "PatchBatch"]

KEY_LIMIT = 1 << 63
MAX_TIER = 2
_NO_KEYS = np.zeros(0, np.uint64)
DEFAULT_CAPACITY = 1024
DEFAULT_MAX_CAPACITY = 1 << 32  # the core's own default
DEFAULT_LOG_BYTES = 16 << 20
DEFAULT_LOG_BATCHES = 4096

_STATE_MAGIC = b"KVMU"
_STATE_VERSION = 1
# magic | version u8 | value_bits u8 | fp_bits u8 | pad u8 | shard u32 | shards u32 | epoch u64 | tables u32
_STATE_HEAD = struct.Struct("<4sBBBxIIQI")
_U16 = struct.Struct("<H")
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")


@fast_init
@dataclass(frozen=True, slots=True)
class PatchBatch:
    """One sequenced batch of one (table, shard), as every view of it must apply it.

    ``snapshot``: the batch starts with a snapshot (the core rebuilt the table), so any view not
    newer than it can apply it, whatever it missed before.
    """

    table_id: int
    shard: int
    epoch: int
    seq: int
    data: bytes = field(repr=False)
    snapshot: bool = False


@fast_init
@dataclass(frozen=True, slots=True)
class ApplyReport:
    """What :meth:`MaintenanceUnit.apply` did with one agent batch."""

    worker: str
    table_id: int
    incarnation: int
    seq: int
    ops: int
    """Ops in the batch as sent."""
    applied: int
    """Distinct keys written after coalescing (reset clears included); 0 for a duplicate."""
    cleared: int
    """Keys a reset dropped because the batch did not re-report them."""
    duplicate: bool
    reset: bool


@dataclass(frozen=True, slots=True)
class MaintenanceStats:
    """Counters since this unit (incarnation of the process) started, plus current sizes."""

    batches_in: int
    ops_in: int
    ops_applied: int
    duplicates: int
    resets: int
    rejected: dict[str, int]
    """Rejected agent batches by error class name."""
    batches_out: int
    bytes_out: int
    replays_served: int
    snapshots_served: int
    log_batches: int
    log_bytes: int
    rebuilds: int
    entries: int


@dataclass(slots=True)
class _Counters:
    batches_in: int = 0
    ops_in: int = 0
    ops_applied: int = 0
    duplicates: int = 0
    resets: int = 0
    rejected: dict[str, int] = field(default_factory=dict)
    batches_out: int = 0
    bytes_out: int = 0
    replays_served: int = 0
    snapshots_served: int = 0


@dataclass(slots=True)
class _Log:
    """The replay log of one table: the most recent batches, oldest dropped first."""

    batches: deque[PatchBatch] = field(default_factory=deque)
    nbytes: int = 0


class MaintenanceUnit:
    """The only writer of shard ``shard``: one :class:`~kvcompass.LudoTable` per layout table.

    ``capacity`` is each table's initial capacity (the core grows it, with a rebuild snapshot,
    as needed, up to ``max_capacity``); ``log_bytes`` and ``log_batches`` bound each table's
    replay log.
    """

    def __init__(
        self,
        shard: int,
        layout: IndexLayout,
        epoch: int,
        capacity: int = DEFAULT_CAPACITY,
        log_bytes: int = DEFAULT_LOG_BYTES,
        log_batches: int = DEFAULT_LOG_BATCHES,
        max_capacity: int = DEFAULT_MAX_CAPACITY,
    ) -> None:
        if not 0 <= shard < layout.shards:
            raise InvalidArgumentError(f"shard {shard} outside 0..{layout.shards - 1}")
        if epoch < 1:
            raise InvalidArgumentError(f"epoch must be >= 1, got {epoch}")
        if capacity < 1 or max_capacity < capacity:
            raise InvalidArgumentError(f"need 1 <= capacity <= max_capacity, got {capacity} and {max_capacity}")
        if log_bytes < 0 or log_batches < 0:
            raise InvalidArgumentError(f"log bounds must be >= 0, got {log_bytes} bytes and {log_batches} batches")
        self._shard = shard
        self._epoch = epoch
        self._layout = layout
        self._capacity = capacity
        self._max_capacity = max_capacity
        self._log_bytes = log_bytes
        self._log_batches = log_batches
        self._tables = [self._new_table(t.table_id, epoch, None) for t in layout.tables]
        self._init_runtime()

    # ---- construction ------------------------------------------------------------------------

    def _new_table(self, table_id: int, epoch: int, entries: tuple[npt.NDArray[np.uint64], npt.NDArray[np.uint64]] | None) -> LudoTable:
        lay = self._layout
        if entries is None:
            return LudoTable(
                table=table_id,
                shard=self._shard,
                epoch=epoch,
                capacity=self._capacity,
                value_bits=lay.value_bits,
                fp_bits=lay.fp_bits,
                max_capacity=self._max_capacity,
            )
        keys, values = entries
        return LudoTable.build(
            keys,
            values,
            table=table_id,
            shard=self._shard,
            epoch=epoch,
            capacity=max(self._capacity, len(keys)),
            value_bits=lay.value_bits,
            fp_bits=lay.fp_bits,
            max_capacity=max(self._max_capacity, len(keys)),
        )

    def _init_runtime(self) -> None:
        self._agents: dict[str, tuple[int, int]] = {}  # worker -> (incarnation, last seq)
        self._logs = [_Log() for _ in self._tables]
        self._outbox: list[PatchBatch] = []
        self._rebuilds_seen = [t.rebuilds for t in self._tables]
        # Tables that may have edits since the last flush (every one at first): a flush closes
        # only these, so a unit with nothing new costs a flush nothing (the simulator flushes
        # every unit every few virtual milliseconds).
        self._dirty: set[int] = {t.table_id for t in self._layout.tables}
        self._n = _Counters()

    # ---- properties --------------------------------------------------------------------------

    @property
    def shard(self) -> int:
        return self._shard

    @property
    def layout(self) -> IndexLayout:
        return self._layout

    @property
    def epoch(self) -> int:
        return self._epoch

    def position(self, table_id: int) -> tuple[int, int]:
        """(epoch, seq) of the last batch this table emitted (what an up-to-date view holds)."""
        t = self._table(table_id)
        return t.epoch, t.seq

    def table(self, table_id: int) -> LudoTable:
        """The writer table itself (read-only use: diagnostics and tests; a write through it is
        still closed into a batch by the next flush)."""
        t = self._table(table_id)
        self._dirty.add(table_id)
        return t

    def held(self, worker: str) -> npt.NDArray[np.uint64]:
        """Sorted keys of this shard that ``worker`` holds (any tier); UnknownWorkerError if none."""
        ref = self._layout.field_of(worker)
        return self._held(ref.table_id, ref.field)

    def agent_position(self, worker: str) -> tuple[int, int] | None:
        """(incarnation, last seq) accepted from ``worker`` since this unit started, or None."""
        return self._agents.get(worker)

    @property
    def stats(self) -> MaintenanceStats:
        n = self._n
        return MaintenanceStats(
            batches_in=n.batches_in,
            ops_in=n.ops_in,
            ops_applied=n.ops_applied,
            duplicates=n.duplicates,
            resets=n.resets,
            rejected=dict(n.rejected),
            batches_out=n.batches_out,
            bytes_out=n.bytes_out,
            replays_served=n.replays_served,
            snapshots_served=n.snapshots_served,
            log_batches=sum(len(g.batches) for g in self._logs),
            log_bytes=sum(g.nbytes for g in self._logs),
            rebuilds=sum(t.rebuilds for t in self._tables),
            entries=sum(len(t) for t in self._tables),
        )

    def digest(self) -> bytes:
        """SHA-256 over every table's view digest, in table order: equal iff all views are."""
        h = hashlib.sha256()
        for t in self._tables:
            h.update(t.digest())
        return h.digest()

    def table_digest(self, table_id: int) -> bytes:
        return self._table(table_id).digest()

    # ---- agent batches -----------------------------------------------------------------------

    def apply(self, batch: KeyOpBatch, sender: str) -> ApplyReport:
        """Apply one agent batch; ``sender`` is the identity the transport authenticated.

        The whole batch is checked before anything changes; a rejected batch raises a precise
        error, is counted in ``stats.rejected`` (by class name), and leaves the unit unchanged:
        ForbiddenWriteError (``sender`` is not ``batch.worker``; ``.worker`` is the sender,
        ``.target`` the worker it tried to write), UnknownWorkerError, WrongShardError,
        InvalidKeyError, InvalidTierError, AgentSequenceError / StaleIncarnationError (see the
        module doc), CapacityError (the batch would grow a table past ``max_capacity``).

        Ops on the same key coalesce (the last wins), so a key set and cleared in one batch
        costs nothing on the wire; a reset re-reporting a key at its current tier neither.
        """
        try:
            return self._apply(batch, sender)
        except KVCompassError as e:
            name = type(e).__name__
            self._n.rejected[name] = self._n.rejected.get(name, 0) + 1
            raise

    def _apply(self, batch: KeyOpBatch, sender: str) -> ApplyReport:
        worker = batch.worker
        if sender != worker:
            raise ForbiddenWriteError(f"{sender!r} may not write the fields of worker {worker!r}", worker=sender, target=worker)
        ref = self._layout.field_of(worker)
        if batch.shard != self._shard:
            raise WrongShardError(f"batch for shard {batch.shard} sent to the unit of shard {self._shard}", shard=self._shard, got_shard=batch.shard, key=None)
        keys, tiers = batch.keys, batch.tiers
        owned = self._held(ref.table_id, ref.field) if batch.reset else _NO_KEYS
        if batch.reset:
            # A reset is the batch plus "drop everything else I held": one coalesced write, so
            # a key re-reported at its current tier emits nothing.
            keys = np.concatenate([owned, keys])
            tiers = np.concatenate([np.zeros(len(owned), np.uint8), tiers])
        refusal, duplicate = self._sequence(batch)
        go = refusal is None and not duplicate
        if go:
            self._dirty.add(ref.table_id)
        # Every op checked, then one op per key (the last wins), removals first, and (in
        # sequence) the capacity checked and the writes made: one Rust call.
        bad, at, n_applied, cleared = self._tables[ref.table_id].apply_agent_ops(
            np.ascontiguousarray(keys), np.ascontiguousarray(tiers), self._shard, self._layout.shards, owned, ref.field, self._max_capacity, go
        )
        if bad and bad != 4:
            self._refuse_op(bad, int(batch.keys[at - len(owned)] if bad != 3 else batch.tiers[at - len(owned)]))
        if refusal is not None:
            raise refusal
        n_ops = len(batch.keys)
        if duplicate:
            self._n.batches_in += 1
            self._n.ops_in += n_ops
            self._n.duplicates += 1
            return ApplyReport(worker, ref.table_id, batch.incarnation, batch.seq, n_ops, 0, 0, True, batch.reset)
        if bad:
            raise CapacityError(f"batch would grow table {ref.table_id} to {at} keys, beyond {self._max_capacity}", needed=at, max=self._max_capacity)
        self._agents[worker] = (batch.incarnation, batch.seq)
        self._n.batches_in += 1
        self._n.ops_in += n_ops
        self._n.ops_applied += n_applied
        self._n.resets += int(batch.reset)
        return ApplyReport(worker, ref.table_id, batch.incarnation, batch.seq, n_ops, n_applied, cleared, False, batch.reset)

    def _refuse_op(self, bad: int, value: int) -> NoReturn:
        """The precise error for the first op ``LudoTable.apply_agent_ops`` found bad (its
        key, or its tier for a bad tier)."""
        if bad == 1:
            raise InvalidKeyError(f"key {value:#x} is not a 63-bit key", key=value)
        if bad == 2:
            owner = value % self._layout.shards
            raise WrongShardError(f"key {value:#x} belongs to shard {owner}, not {self._shard}", shard=self._shard, got_shard=owner, key=value)
        raise InvalidTierError(f"tier {value} is not 0 (absent), 1 (VRAM) or 2 (DRAM)", tier=value)

    def _sequence(self, batch: KeyOpBatch) -> tuple[KVCompassError | None, bool]:
        """Where the batch falls in its worker's sequence (see the module doc): the refusal to
        raise, if any (raised once the ops are known to be well formed), and whether it is a
        duplicate."""
        w, inc, seq = batch.worker, batch.incarnation, batch.seq
        cur = self._agents.get(w)
        if cur is None or inc > cur[0]:
            if seq == 1 or (batch.reset and seq >= 1):
                return None, False
            return AgentSequenceError(
                f"worker {w!r} incarnation {inc} must open with seq 1 or a reset batch, got seq {seq}", expected=1, got=seq, worker=w, incarnation=inc
            ), False
        cur_inc, last = cur
        if inc < cur_inc:
            return StaleIncarnationError(f"worker {w!r} sent incarnation {inc}, older than {cur_inc}", expected=cur_inc, got=inc, worker=w), False
        if seq <= last:
            return None, True
        if seq == last + 1 or batch.reset:
            return None, False
        return AgentSequenceError(
            f"worker {w!r} incarnation {inc}: expected seq {last + 1}, got {seq} (re-report with reset)", expected=last + 1, got=seq, worker=w, incarnation=inc
        ), False

    def _held(self, table_id: int, fld: int) -> npt.NDArray[np.uint64]:
        keys, values = self._tables[table_id].entries()
        mine = (values >> np.uint64(2 * fld)) & np.uint64(3) != 0
        return np.sort(keys[mine])

    # ---- patches out -------------------------------------------------------------------------

    def flush(self) -> list[PatchBatch]:
        """Close every table's pending edits into its next batch; returns the batches to send,
        in order (including any that :meth:`resume` or :meth:`snapshot` closed since)."""
        if self._dirty:
            dirty, self._dirty = self._dirty, set()
            for t in self._layout.tables:
                if t.table_id in dirty:
                    self._close(t.table_id)
        out, self._outbox = self._outbox, []
        return out

    def _close(self, table_id: int) -> None:
        t = self._tables[table_id]
        data = t.take_batch()
        if data is None:
            return
        # A rebuild replaces the pending edits with a snapshot, so the batch starts with one.
        snap = t.rebuilds != self._rebuilds_seen[table_id]
        self._rebuilds_seen[table_id] = t.rebuilds
        pb = PatchBatch(table_id, self._shard, t.epoch, t.seq, data, snap)
        log = self._logs[table_id]
        log.batches.append(pb)
        log.nbytes += len(data)
        while log.batches and (len(log.batches) > self._log_batches or log.nbytes > self._log_bytes):
            log.nbytes -= len(log.batches.popleft().data)
        self._outbox.append(pb)
        self._n.batches_out += 1
        self._n.bytes_out += len(data)

    def resume(self, table_id: int, epoch: int, seq: int) -> list[bytes]:
        """What a view of ``table_id`` at (``epoch``, ``seq``) must apply, in order, to catch up.

        ``[]`` if it is current; the batches after ``seq`` from the replay log (starting at the
        latest rebuild snapshot among them); otherwise (another epoch, a trimmed log, a seq this
        unit never emitted) one snapshot. Pending edits are closed into a batch first; it is
        part of the answer and also goes out with the next :meth:`flush`, which a view that
        resumed then drops as stale. A view *newer* than the unit (another life of it under the
        same epoch) refuses the snapshot as stale and must start a fresh view from it.
        """
        t = self._table(table_id)
        self._close(table_id)
        if epoch == t.epoch and seq == t.seq:
            return []
        if epoch == t.epoch and 0 <= seq < t.seq:
            log = [b for b in self._logs[table_id].batches if b.epoch == epoch and b.seq > seq]
            snaps = [i for i, b in enumerate(log) if b.snapshot]
            if log and (log[0].seq == seq + 1 or snaps):
                start = snaps[-1] if snaps else 0
                self._n.replays_served += 1
                return [b.data for b in log[start:]]
        self._n.snapshots_served += 1
        return [t.export_snapshot()]

    def snapshot(self, table_id: int) -> bytes:
        """A snapshot of ``table_id`` at its current position (pending edits closed first)."""
        t = self._table(table_id)
        self._close(table_id)
        self._n.snapshots_served += 1
        return t.export_snapshot()

    def _table(self, table_id: int) -> LudoTable:
        if not 0 <= table_id < len(self._tables):
            raise InvalidArgumentError(f"table {table_id} outside 0..{len(self._tables) - 1}")
        return self._tables[table_id]

    # ---- persistence -------------------------------------------------------------------------

    def to_bytes(self) -> bytes:
        """The shard's state (every table's entries, hence who holds what, and the epoch), for
        the driver to write to disk; CRC-32 checked. Pending edits are included."""
        lay = self._layout
        out = bytearray(_STATE_HEAD.pack(_STATE_MAGIC, _STATE_VERSION, lay.value_bits, lay.fp_bits, self._shard, lay.shards, self.epoch, len(self._tables)))
        for spec, t in zip(lay.tables, self._tables, strict=True):
            out += _U32.pack(spec.table_id) + _U32.pack(len(spec.workers))
            for w in spec.workers:
                name = w.encode()
                out += _U16.pack(len(name)) + name
            keys, values = t.entries()
            order = np.argsort(keys, kind="stable")
            out += _U64.pack(len(keys))
            out += keys[order].astype("<u8").tobytes() + values[order].astype("<u8").tobytes()
        out += _U32.pack(zlib.crc32(out))
        return bytes(out)

    @classmethod
    def from_bytes(
        cls,
        data: bytes,
        layout: IndexLayout,
        new_epoch: int,
        capacity: int = DEFAULT_CAPACITY,
        log_bytes: int = DEFAULT_LOG_BYTES,
        log_batches: int = DEFAULT_LOG_BATCHES,
        max_capacity: int = DEFAULT_MAX_CAPACITY,
    ) -> MaintenanceUnit:
        """Restore a restarted unit from :meth:`to_bytes` under ``new_epoch`` (> the saved epoch).

        Every table starts the new epoch at seq 0 with an empty replay log, so views get
        EpochChangedError on the next delta and :meth:`resume` answers them with a snapshot.
        Agents' sequences are not restored (see the module doc). Corrupt bytes or a layout that
        differs from the saved one: InvalidArgumentError, and nothing is built.
        """
        shard, epoch, tables = _decode_state(data, layout)
        if new_epoch <= epoch:
            raise InvalidArgumentError(f"new epoch {new_epoch} must exceed the saved epoch {epoch}")
        unit = cls(shard, layout, new_epoch, capacity, log_bytes, log_batches, max_capacity)
        unit._tables = [unit._new_table(spec.table_id, new_epoch, tables[spec.table_id]) for spec in layout.tables]
        unit._init_runtime()
        return unit


def _decode_state(data: bytes, layout: IndexLayout) -> tuple[int, int, list[tuple[npt.NDArray[np.uint64], npt.NDArray[np.uint64]]]]:
    """(shard, epoch, per-table (keys, values)) of a saved state, fully validated."""
    bad = _bad_state
    if len(data) < _STATE_HEAD.size + 4:
        raise bad(f"{len(data)} bytes is too short")
    body, (crc,) = data[:-4], _U32.unpack_from(data, len(data) - 4)
    if zlib.crc32(body) != crc:
        raise bad("checksum mismatch (corrupt or truncated)")
    magic, version, value_bits, fp_bits, shard, shards, epoch, n_tables = _STATE_HEAD.unpack_from(body)
    if magic != _STATE_MAGIC or version != _STATE_VERSION:
        raise bad(f"not a version-{_STATE_VERSION} state (magic {magic!r}, version {version})")
    if (shards, value_bits, fp_bits, n_tables) != (layout.shards, layout.value_bits, layout.fp_bits, len(layout.tables)):
        raise bad(
            f"saved for {shards} shards, {value_bits}-bit values, {fp_bits}-bit fingerprints, {n_tables} tables; "
            f"the layout has {layout.shards}, {layout.value_bits}, {layout.fp_bits}, {len(layout.tables)}"
        )
    if not 0 <= shard < shards:
        raise bad(f"shard {shard} outside 0..{shards - 1}")
    pos = _STATE_HEAD.size
    tables = []
    try:
        for spec in layout.tables:
            (tid, n_workers) = struct.unpack_from("<II", body, pos)
            pos += 8
            workers = []
            for _ in range(n_workers):
                (ln,) = _U16.unpack_from(body, pos)
                workers.append(body[pos + 2 : pos + 2 + ln].decode())
                pos += 2 + ln
            if tid != spec.table_id or tuple(workers) != spec.workers:
                raise bad(f"table {tid} was saved with workers {workers}; the layout's table {spec.table_id} has {list(spec.workers)}")
            (n,) = _U64.unpack_from(body, pos)
            pos += 8
            if pos + 16 * n > len(body):
                raise bad(f"table {tid} claims {n} entries beyond the end of the data")
            keys = np.frombuffer(body, dtype="<u8", count=n, offset=pos).astype(np.uint64)
            values = np.frombuffer(body, dtype="<u8", count=n, offset=pos + 8 * n).astype(np.uint64)
            pos += 16 * n
            _check_entries(tid, keys, values, shard, layout.shards, len(spec.workers))
            tables.append((keys, values))
    except (struct.error, UnicodeDecodeError) as e:
        raise bad(f"truncated or garbled ({e})") from None
    if pos != len(body):
        raise bad(f"{len(body) - pos} trailing bytes")
    return shard, epoch, tables


def _bad_state(why: str) -> InvalidArgumentError:
    return InvalidArgumentError(f"maintenance state: {why}")


def _check_entries(tid: int, keys: npt.NDArray[np.uint64], values: npt.NDArray[np.uint64], shard: int, shards: int, n_workers: int) -> None:
    """Refuse entries no unit of this layout could have written (a crafted or mismatched file)."""
    bad = _bad_state
    if len(keys) == 0:
        return
    if (keys >= np.uint64(KEY_LIMIT)).any() or (keys % np.uint64(shards) != np.uint64(shard)).any():
        raise bad(f"table {tid} holds a key that is not a 63-bit key of shard {shard}")
    if len(np.unique(keys)) != len(keys):
        raise bad(f"table {tid} holds a key twice")
    used = np.uint64((1 << (2 * n_workers)) - 1)
    if (values == 0).any() or (values & ~used).any():
        raise bad(f"table {tid} holds a value that is empty or sets a field beyond its {n_workers} workers")
    for f in range(n_workers):
        if (((values >> np.uint64(2 * f)) & np.uint64(3)) == np.uint64(3)).any():
            raise bad(f"table {tid} holds the reserved tier 3 in field {f}")
