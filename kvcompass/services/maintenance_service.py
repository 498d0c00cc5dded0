"""The maintenance unit of one shard as a gRPC service (``kvcompass.v1.Maintenance``).

A thin driver around the sans-I/O :class:`~kvcompass.discovery.maintenance.MaintenanceUnit`:

* **Ingest** (bidirectional): one stream per agent and unit. The worker identity is the
  ``x-kvcompass-worker`` request metadata, checked against ``x-kvcompass-token`` when a token
  map is configured (UNAUTHENTICATED otherwise). Every ``KeyOps`` gets exactly one
  ``IngestAck`` in order; a refused batch is acked with its status code (the one table in
  :mod:`kvcompass.services.status`) and the stream stays open, so an ``ABORTED`` sequence gap
  is repaired on the same stream by a reset batch. A batch naming another worker than the
  metadata ends the stream with PERMISSION_DENIED before the unit sees it.
* **Subscribe** (server streaming): the catch-up (``MaintenanceUnit.resume`` per table: a replay
  from the log, or a snapshot), then every batch the flush loop emits, then periodic heartbeats
  with the published position of every table. Each subscriber has a bounded queue; one that
  falls behind is cut off with RESOURCE_EXHAUSTED and resubscribes from its position, so a slow
  edge costs the unit a bounded amount of memory.
* **Snapshot** (unary) and grpclib's Health service (SERVING between start and drain).

All access to the unit goes through one lock because large batches are applied in a worker
thread (the core releases the GIL) while the loop keeps serving.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hmac
import logging
import os
import ssl
import struct
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from collections.abc import AsyncIterator
from typing import Any, Callable, Mapping, TypeVar

import numpy as np
from grpclib.const import Cardinality, Handler
from grpclib.health.check import ServiceStatus
from grpclib.health.service import Health
from grpclib.server import Stream

from kvcompass._core import decode_batch_header
from kvcompass._proto.kvcompass.v1 import (
    IngestAck,
    KeyOps,
    MaintenanceBase,
    Patch,
    Position,
    SnapshotRequest,
    SnapshotResponse,
    SubscribeEvent,
    SubscribeRequest,
)
from kvcompass.discovery.layout import IndexLayout
from kvcompass.discovery.maintenance import ApplyReport, MaintenanceUnit, PatchBatch
from kvcompass.discovery.key_ops import KeyOpBatch
from kvcompass.errors import (
    AgentSequenceError,
    CapacityError,
    DrainingError,
    ForbiddenWriteError,
    InvalidArgumentError,
    KVCompassError,
    SubscriberLaggingError,
    UnauthenticatedError,
    UnknownWorkerError,
    WrongShardError,
    WrongTableError,
)
from kvcompass.services.codec import recv_request
from kvcompass.services.grpc_lifecycle import DrainingServer
from kvcompass.services.lifecycle import AsyncResource, hostport, on_signals
from kvcompass.services.metrics import MetricsServer, ServiceMetrics, export_states
from kvcompass.services.status import grpc_error, status_of
from kvcompass.services.wire import INGEST_PATH, SUBSCRIBE_PATH, TOKEN_HEADER, WORKER_HEADER

__all__ = [
    "MaintenanceConfig",
    "MaintenanceServer",
    "MaintenanceService",
    "default_epoch",
    "load_unit",
    "serve_maintenance",
    "write_atomic",
]

_T = TypeVar("_T")
_log = logging.getLogger("kvcompass.maintenance")


@dataclass(frozen=True, slots=True)
class MaintenanceConfig:
    """Knobs of the driver (the unit's own bounds are its constructor's)."""

    flush_interval_s: float = 0.002
    """The least time between two flushes (pending edits closed into batches and fanned out).
    Edits that arrive after a quiet spell go out at once; a stream of them is batched once an
    interval."""
    heartbeat_interval_s: float = 0.25
    """How often subscribers get every table's published position (detects a lost last batch)."""
    subscriber_queue: int = 1024
    """Flushes buffered per subscriber before it is cut off."""
    max_batch_ops: int = 1 << 20
    """Larger agent batches are refused (INVALID_ARGUMENT) without being decoded."""
    offload_ops: int = 8192
    """Batches at least this big are applied in a worker thread."""
    tokens: Mapping[str, str] | None = None
    """worker -> credential; None accepts any worker the metadata names (loopback clusters)."""
    memory_budget_bytes: int | None = None
    """Once the shard's writer tables hold this many bytes, the keys a batch would add are
    left out (counted and logged); its removals and tier changes still apply, and the batch is
    acknowledged."""
    view_budget_bytes: int | None = None
    """The same per table, for the bytes every edge replica of it holds (``view_memory_bytes``)."""
    state_path: str | None = None
    """Where the shard's state is written (atomically) for a restart to recover it."""
    persist_interval_s: float = 1.0


def default_epoch() -> int:
    """Milliseconds since the Unix epoch: a restarted unit comes back above its predecessor
    (what the views need to notice the restart) without having to remember anything."""
    return time.time_ns() // 1_000_000


# The epoch sits at a fixed offset of MaintenanceUnit.to_bytes' header ("<4sBBBxIIQI");
# MaintenanceUnit.from_bytes validates everything else.
_STATE_EPOCH = struct.Struct("<4s12xQ")


def load_unit(
    layout: IndexLayout, shard: int, *, state_path: str | None = None, epoch: int | None = None, capacity: int = 1024, max_keys: int | None = None
) -> MaintenanceUnit:
    """The unit of ``shard``: restored from ``state_path`` when that file exists (under an
    epoch above the saved one), else empty. ``epoch`` defaults to :func:`default_epoch`;
    ``max_keys`` caps each table (the unit's ``max_capacity``; None: the core's maximum)."""
    ep = default_epoch() if epoch is None else epoch
    if max_keys is not None:
        capacity = min(capacity, max_keys)
        bounds = {"capacity": capacity, "max_capacity": max_keys}
    else:
        bounds = {"capacity": capacity}
    if state_path is not None and os.path.exists(state_path):
        data = Path(state_path).read_bytes()
        saved = 0
        if len(data) >= _STATE_EPOCH.size:
            magic, saved = _STATE_EPOCH.unpack_from(data)
            if magic != b"KVMU":
                saved = 0
        try:
            unit = MaintenanceUnit.from_bytes(data, layout, max(ep, saved + 1), **bounds)
        except KVCompassError as e:
            # Name the file: a state left by another run or topology is otherwise a riddle.
            raise type(e)(f"state file {state_path}: {e.message}", **{k: v for k, v in vars(e).items() if k != "message"}) from None
        if unit.shard != shard:
            raise InvalidArgumentError(f"state file {state_path} holds shard {unit.shard}, not {shard}")
        return unit
    return MaintenanceUnit(shard, layout, ep, **bounds)


def write_atomic(path: str, data: bytes) -> None:
    """Replace ``path`` by ``data`` so that a crash leaves either the old or the new file."""
    p = Path(path)
    tmp = p.with_name(f".{p.name}.tmp-{os.getpid()}-{threading.get_ident()}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, p)
    with contextlib.suppress(OSError):  # not every filesystem lets a directory be fsynced
        fd = os.open(p.parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


class _StateWriter:
    """Writes states in the order they were taken, whatever order the threads run in: a write
    cancelled on the loop side still finishes in its thread, and must not land after a newer
    one."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._taken = 0
        self._written = 0

    def take(self) -> int:
        self._taken += 1
        return self._taken

    def write(self, gen: int, data: bytes) -> bool:
        with self._lock:
            if gen <= self._written:
                return False
            write_atomic(self.path, data)
            self._written = gen
            return True


@dataclass(eq=False)
class _Subscriber:
    name: str
    queue: asyncio.Queue[SubscribeEvent | None]
    cut: bool = False


@dataclass
class _Counts:
    acks: int = 0
    persist_failures: int = 0
    subscriptions: int = 0
    cut: int = 0
    flushes: int = 0
    persisted: int = 0
    trimmed_keys: int = 0  # new keys left out of batches that would have passed a budget


def _patch(b: PatchBatch, emitted_ns: int) -> Patch:
    return Patch(table=b.table_id, shard=b.shard, epoch=b.epoch, seq=b.seq, snapshot=b.snapshot, data=b.data, emitted_unix_ns=emitted_ns)


def _catchup_patch(data: bytes, snapshot: bool) -> Patch:
    h = decode_batch_header(data)
    return Patch(table=h["table"], shard=h["shard"], epoch=h["epoch"], seq=h["seq"], snapshot=snapshot, data=data)


def decode_key_ops(msg: KeyOps, max_ops: int) -> KeyOpBatch:
    """The wire batch as a :class:`KeyOpBatch`; InvalidArgumentError for bad array bytes."""
    if len(msg.keys) % 8:
        raise InvalidArgumentError(f"keys: {len(msg.keys)} bytes is not a whole number of little-endian u64")
    n = len(msg.keys) // 8
    if n > max_ops:
        raise InvalidArgumentError(f"batch of {n} key ops exceeds the limit of {max_ops}")
    if len(msg.tiers) != n:
        raise InvalidArgumentError(f"{n} keys but {len(msg.tiers)} tiers")
    keys = np.frombuffer(msg.keys, dtype="<u8").astype(np.uint64, copy=False)
    tiers = np.frombuffer(msg.tiers, dtype=np.uint8)
    return KeyOpBatch(msg.worker, msg.incarnation, msg.shard, msg.seq, keys, tiers, msg.reset)


class MaintenanceService(MaintenanceBase):
    """``kvcompass.v1.Maintenance`` over one unit. :meth:`start` runs the flush loop;
    :meth:`stop` drains (health NOT_SERVING, last flush and persist, subscriber streams ended)."""

    def message_limits(self) -> dict[type, int]:
        """The largest request of each type this service reads: a batch of ``max_batch_ops``
        key ops (8 bytes a key, 1 a tier) plus its envelope; positions and names are small."""
        small = 64 << 10
        return {KeyOps: 9 * self._cfg.max_batch_ops + small, SubscribeRequest: small, SnapshotRequest: small}

    def __init__(self, unit: MaintenanceUnit, config: MaintenanceConfig = MaintenanceConfig(), metrics: ServiceMetrics | None = None) -> None:
        self._unit = unit
        self._cfg = config
        self.metrics = metrics if metrics is not None else ServiceMetrics("maintenance")
        export_states(self.metrics.registry, "maintenance", lambda: [(t.table_id, self._unit.shard, *self._unit.position(t.table_id), self._unit.table_digest(t.table_id)) for t in self._unit.layout.tables])
        self.health = ServiceStatus()
        self._lock = asyncio.Lock()
        self._subs: set[_Subscriber] = set()
        self._published = {t.table_id: unit.position(t.table_id) for t in unit.layout.tables}
        self._task: asyncio.Task[None] | None = None
        self._applying: asyncio.Future[ApplyReport] | None = None
        self._writer = _StateWriter(config.state_path) if config.state_path is not None else None
        self._dirty = False
        self._draining = False
        self._last_persist = 0.0
        self._last_heartbeat = 0.0
        self._edits = asyncio.Event()  # set when a batch is applied: the flush loop has work
        self.counts = _Counts()
        m = self.metrics
        m.queue_capacity.labels(m.role, "subscriber").set(config.subscriber_queue)
        for scope, budget in (("shard", config.memory_budget_bytes), ("view", config.view_budget_bytes)):
            if budget is not None:
                m.memory_budget.labels(m.role, scope).set(budget)

    @property
    def unit(self) -> MaintenanceUnit:
        return self._unit

    @property
    def subscribers(self) -> int:
        return len(self._subs)

    def published(self, table_id: int) -> tuple[int, int]:
        """(epoch, seq) of the last batch of ``table_id`` fanned out to subscribers."""
        return self._published[table_id]

    # ---- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> None:
        self._draining = False
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._flush_loop(), name=f"flush-shard-{self._unit.shard}")
        self.health.set(True)
        self.metrics.ready.set(1)

    async def stop(self) -> None:
        """Drain: :meth:`begin_drain` then :meth:`finish_drain` (a server closes its
        connections in between, so that no batch is applied after the final persist)."""
        await self.begin_drain()
        await self.finish_drain()

    async def begin_drain(self) -> None:
        """Report NOT_SERVING, refuse new streams, stop the loop, fan out what is pending and
        end every subscription (subscribers resume from wherever this unit comes back)."""
        self._draining = True
        self.health.set(False)
        self.metrics.ready.set(0)
        if self._task is not None:
            task, self._task = self._task, None
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await self.flush_now()
        for sub in list(self._subs):
            self._end(sub, cut=False)

    async def finish_drain(self) -> None:
        """Once no stream can deliver batches any more: let a threaded apply finish, close its
        edits into the log and write the state."""
        if self._applying is not None:
            with contextlib.suppress(Exception, asyncio.CancelledError):
                await self._applying
            self._applying = None
        await self.flush_now()
        if self._cfg.state_path is not None:
            await self.persist_now()

    def _applied_off_loop(self, fut: asyncio.Future[ApplyReport]) -> None:
        """A threaded apply ended: the flush loop has edits to close. Its outcome is read here
        so that one whose handler was cancelled (nobody left to read it) logs no "exception
        never retrieved"; the handler, when there is one, reads it again through the shield."""
        self._edits.set()
        if not fut.cancelled():
            fut.exception()

    @contextlib.asynccontextmanager
    async def _unit_held(self) -> AsyncIterator[None]:
        """The lock, with the unit free of any apply still running in a worker thread: an ingest
        cancelled while its batch was applied off the loop (a dropped connection) releases the
        lock, but its thread cannot be stopped, and nothing else may touch the unit until it
        ends."""
        async with self._lock:
            fut = self._applying
            if fut is not None and not fut.done():
                await asyncio.wait([fut])
            yield

    async def _flush_loop(self) -> None:
        """Flush at the leading edge: as soon as a batch has been applied and
        ``flush_interval_s`` has passed since the last flush, else at the end of that interval;
        with nothing written, wake only for the heartbeat and the state file.

        Why: flushing on a fixed tick made every patch wait for the tick (half an interval on
        average, a whole one plus the timer's slack at worst, on top of the RPCs), the floor of
        patch lag for an agent that sends now and then; batching under a steady stream of writes,
        which is what the interval is for, is the same either way (one flush an interval)."""
        loop = asyncio.get_running_loop()
        cfg = self._cfg
        last = loop.time()
        while True:
            tick = last + cfg.flush_interval_s  # the soonest this loop turns again
            if not self._edits.is_set():
                wake = self._last_heartbeat + cfg.heartbeat_interval_s
                if cfg.state_path is not None and self._dirty:
                    wake = min(wake, self._last_persist + cfg.persist_interval_s)
                if wake > tick:
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout_at(wake):
                            await self._edits.wait()
            wait = tick - loop.time()
            if wait > 0:
                await asyncio.sleep(wait)
            self._edits.clear()
            try:
                await self.flush_now()
                now = last = loop.time()
                if now - self._last_heartbeat >= cfg.heartbeat_interval_s:
                    self._last_heartbeat = now
                    self._fanout(SubscribeEvent(heartbeat=self._heartbeat()))
                    self._update_gauges()
                if cfg.state_path is not None and self._dirty and now - self._last_persist >= cfg.persist_interval_s:
                    self._last_persist = now
                    await self.persist_now()
            except Exception:
                # Nothing may end this loop but a stop: without it no batch is published and no
                # heartbeat sent while ingest goes on acknowledging. Said, then tried again.
                _log.exception("maintenance unit of shard %d: flush loop step failed; retrying", self._unit.shard)
                last = loop.time()
                await asyncio.sleep(cfg.heartbeat_interval_s)

    async def flush_now(self) -> list[PatchBatch]:
        """Close pending edits and fan the batches out (the flush loop calls this; tests call it
        to step deterministically)."""
        async with self._unit_held():
            batches = self._unit.flush()
            if batches:
                now_ns = time.time_ns()
                for b in batches:
                    self._published[b.table_id] = (b.epoch, b.seq)
                    self.metrics.patch_bytes_out.inc(len(b.data))
                self.metrics.patches_out.inc(len(batches))
                self._dirty = True
                self._fanout(SubscribeEvent(patches=[_patch(b, now_ns) for b in batches]))
            self.counts.flushes += 1
        return batches

    async def persist_now(self) -> bool:
        """Write the unit's state to ``state_path`` (atomically, off the event loop); False when
        the write failed (a full disk, a directory gone, permissions): the unit keeps serving,
        counts and logs the failure and writes again at the next interval, since stopping would
        lose more than a state file one interval old."""
        w = self._writer
        if w is None:
            return True
        async with self._unit_held():
            data = self._unit.to_bytes()
            gen = w.take()
            self._dirty = False
        try:
            if await asyncio.to_thread(w.write, gen, data):
                self.counts.persisted += 1
        except OSError as e:
            self._dirty = True
            self.counts.persist_failures += 1
            self.metrics.state_write_failures.inc()
            _log.error("maintenance unit of shard %d: cannot write its state to %s: %s (retrying every %g s)", self._unit.shard, w.path, e, self._cfg.persist_interval_s)
            return False
        return True

    def _heartbeat(self) -> list[Position]:
        s = self._unit.shard
        return [Position(table=t, shard=s, epoch=e, seq=q) for t, (e, q) in sorted(self._published.items())]

    def _update_gauges(self) -> None:
        u, m, cfg = self._unit, self.metrics, self._cfg
        tables = [u.table(t.table_id) for t in u.layout.tables]
        m.index_entries.set(sum(len(t) for t in tables))
        total = 0
        views_over = 0
        for t in tables:
            lbl = (m.role, str(t.table), str(u.shard))
            total += t.memory_bytes
            m.table_bytes.labels(*lbl).set(t.memory_bytes)
            m.view_bytes.labels(*lbl).set(t.view_memory_bytes)
            views_over += cfg.view_budget_bytes is not None and t.view_memory_bytes >= cfg.view_budget_bytes
        m.index_bytes.set(total)
        if cfg.memory_budget_bytes is not None:
            m.over_budget.labels(m.role, "shard").set(int(total >= cfg.memory_budget_bytes))
        if cfg.view_budget_bytes is not None:
            m.over_budget.labels(m.role, "view").set(views_over)
        m.queue_depth.labels(m.role, "subscriber").set(max((sub.queue.qsize() for sub in self._subs), default=0))

    def _check_budget(self, batch: KeyOpBatch, worker: str) -> None:
        """CapacityError when a memory budget is spent and ``batch`` would add a key (the unit
        is unchanged; see :class:`MaintenanceConfig`). Cheap until a budget is reached."""
        cfg, u = self._cfg, self._unit
        if cfg.memory_budget_bytes is None and cfg.view_budget_bytes is None:
            return
        adds = batch.keys[batch.tiers != 0]
        if len(adds) == 0:
            return
        try:
            table = u.table(u.layout.field_of(worker).table_id)
        except UnknownWorkerError:
            return  # the unit refuses the batch itself, with its own error
        over: tuple[str, int, int] | None = None
        if cfg.memory_budget_bytes is not None:
            used = sum(u.table(t.table_id).memory_bytes for t in u.layout.tables)
            if used >= cfg.memory_budget_bytes:
                over = ("shard", used, cfg.memory_budget_bytes)
        if over is None and cfg.view_budget_bytes is not None and table.view_memory_bytes >= cfg.view_budget_bytes:
            over = ("view", table.view_memory_bytes, cfg.view_budget_bytes)
        if over is None:
            return
        new = int(np.count_nonzero(~np.isin(adds, table.entries()[0])))
        if new == 0:
            return  # tier changes of keys already held cost no memory
        scope, used, budget = over
        self.metrics.budget_refusals.labels(self.metrics.role, scope).inc()
        where = f"shard {u.shard}" if scope == "shard" else f"the view of table {table.table}, shard {u.shard}"
        raise CapacityError(
            f"memory budget spent: {where} holds {used} bytes (budget {budget}); refusing {new} new keys of worker {worker!r}", needed=used, max=budget
        )

    def _fanout(self, ev: SubscribeEvent) -> None:
        for sub in list(self._subs):
            if sub.cut:
                continue
            try:
                sub.queue.put_nowait(ev)
            except asyncio.QueueFull:
                self._end(sub, cut=True)

    def _end(self, sub: _Subscriber, *, cut: bool) -> None:
        """Wake the subscriber's stream with the end marker. A drain (``cut`` False) puts it
        behind what the stream has not sent yet, the unit's last flush among it (found in
        review: it was dropped, so edges stayed behind batches the unit had acknowledged); a cut,
        or a drain whose queue is full, drops that: the subscriber resumes from its own
        position, which the log or a snapshot covers."""
        if cut:
            sub.cut = True
            self.counts.cut += 1
            self.metrics.subscribers_cut.inc()
        else:
            try:
                sub.queue.put_nowait(None)
                return
            except asyncio.QueueFull:
                pass
        while not sub.queue.empty():
            sub.queue.get_nowait()
        sub.queue.put_nowait(None)

    # ---- RPCs --------------------------------------------------------------------------------

    def __mapping__(self) -> dict[str, Handler]:
        # Ingest and Subscribe need the raw stream (metadata, flow control); Snapshot keeps the
        # generated adapter.
        m: dict[str, Handler] = dict(super().__mapping__())
        m[INGEST_PATH] = Handler(self._rpc_ingest, Cardinality.STREAM_STREAM, KeyOps, IngestAck)
        m[SUBSCRIBE_PATH] = Handler(self._rpc_subscribe, Cardinality.UNARY_STREAM, SubscribeRequest, SubscribeEvent)
        return m

    def _authenticate(self, stream: Stream[KeyOps, IngestAck]) -> str:
        md = stream.metadata
        worker = md.get(WORKER_HEADER) if md is not None else None
        if not isinstance(worker, str) or not worker:
            self.metrics.reject("Unauthenticated")
            raise grpc_error(UnauthenticatedError(f"missing {WORKER_HEADER} metadata"))
        tokens = self._cfg.tokens
        if tokens is not None:
            want = tokens.get(worker)
            got = md.get(TOKEN_HEADER) if md is not None else None
            if want is None or not isinstance(got, str) or not hmac.compare_digest(want.encode(), got.encode()):
                self.metrics.reject("Unauthenticated")
                raise grpc_error(UnauthenticatedError(f"bad or missing {TOKEN_HEADER} for worker {worker!r}", worker=worker))
        return worker

    def _refuse_if_draining(self) -> None:
        if self._draining:
            raise grpc_error(DrainingError("maintenance unit is draining: reconnect"))

    async def _rpc_ingest(self, stream: Stream[KeyOps, IngestAck]) -> None:
        self._refuse_if_draining()
        worker = self._authenticate(stream)
        async for msg in stream:
            if msg.worker != worker:
                self.metrics.reject("ForbiddenWriteError")
                raise grpc_error(ForbiddenWriteError(f"stream of worker {worker!r} carries a batch of worker {msg.worker!r}", worker=msg.worker))
            await stream.send_message(await self._ingest_one(msg, worker))

    async def _ingest_one(self, msg: KeyOps, worker: str) -> IngestAck:
        ack = IngestAck(shard=msg.shard, seq=msg.seq)
        try:
            batch = decode_key_ops(msg, self._cfg.max_batch_ops)
            async with self._unit_held():
                try:
                    self._check_budget(batch, worker)
                    rep = await self._apply(batch, worker)
                except CapacityError:
                    # Out of budget (memory or --max-keys): the batch applies without the keys
                    # it would add, so removals and tier changes still do, and the sequence
                    # goes on (found in review: the whole batch was refused, which ended the
                    # agent and froze its claims). The dropped keys are under-claimed, the safe
                    # side; the refusal was checked before anything changed.
                    trimmed = self._held_only(batch, worker)
                    if trimmed is None:
                        raise
                    dropped = len(batch.keys) - len(trimmed.keys)
                    self.counts.trimmed_keys += dropped
                    self.metrics.trimmed_keys.labels(self.metrics.role).inc(dropped)  # found in review: no metric showed them
                    _log.warning("shard %d: out of budget, %d new keys of worker %r not indexed (seq %d)", self._unit.shard, dropped, worker, batch.seq)
                    rep = await self._apply(trimmed, worker)
                self._edits.set()
        except KVCompassError as e:
            self.metrics.reject(type(e).__name__)
            ack.code = int(status_of(e).value)
            ack.reason = type(e).__name__
            ack.message = e.message
            if isinstance(e, AgentSequenceError):
                ack.expected = int(e.expected)
            return ack
        self.metrics.batches_in.inc()
        self.metrics.events_in.inc(rep.ops)
        ack.applied, ack.cleared, ack.duplicate = rep.applied, rep.cleared, rep.duplicate
        self.counts.acks += 1
        return ack

    async def _apply(self, batch: KeyOpBatch, worker: str) -> Any:
        """Apply ``batch`` (the caller holds the unit), in a worker thread when it is large."""
        if len(batch.keys) >= self._cfg.offload_ops:
            # Kept so a drain can wait for it: cancelling this handler (a dropped connection)
            # releases the lock but cannot stop the thread.
            fut = self._applying = asyncio.ensure_future(asyncio.to_thread(self._unit.apply, batch, worker))
            # The flush loop learns of the edits when the thread ends, even if this handler is
            # cancelled before it does. Shielded: cancelling the handler must not cancel this
            # future too, or it would be done (and the unit look free) while the thread still
            # writes.
            fut.add_done_callback(self._applied_off_loop)
            return await asyncio.shield(fut)
        return self._unit.apply(batch, worker)

    def _held_only(self, batch: KeyOpBatch, worker: str) -> KeyOpBatch | None:
        """``batch`` without its ops that would add a key the worker's table does not hold
        (None when it has none to drop)."""
        u = self._unit
        try:
            table = u.table(u.layout.field_of(worker).table_id)
        except UnknownWorkerError:
            return None
        keep = np.fromiter((t == 0 or table.get(k) is not None for k, t in zip(batch.keys.tolist(), batch.tiers.tolist())), dtype=bool, count=len(batch.keys))
        if keep.all():
            return None
        return dataclasses.replace(batch, keys=np.ascontiguousarray(batch.keys[keep]), tiers=np.ascontiguousarray(batch.tiers[keep]))

    async def _rpc_subscribe(self, stream: Stream[SubscribeRequest, SubscribeEvent]) -> None:
        self._refuse_if_draining()
        req = await recv_request(stream, SubscribeRequest)
        shard = self._unit.shard
        if req.shard != shard:
            raise grpc_error(WrongShardError(f"this unit serves shard {shard}, not {req.shard}", shard=shard, got_shard=req.shard, key=None))
        want = {t.table_id: (0, 0) for t in self._unit.layout.tables}
        for p in req.positions:
            if p.table not in want or p.shard != shard:
                raise grpc_error(WrongTableError(f"no table ({p.table}, {p.shard}) on the unit of shard {shard}", table=p.table, shard=shard, got_table=p.table, got_shard=p.shard))
            want[p.table] = (p.epoch, p.seq)
        sub = _Subscriber(req.subscriber or str(stream.peer), asyncio.Queue(self._cfg.subscriber_queue))
        async with self._unit_held():
            # Computed and registered under the lock, with no await in between: every batch
            # the flush loop emits from here on reaches the queue, and every earlier one is in
            # the catch-up (a batch both places is dropped by the view as stale).
            patches: list[Patch] = []
            for t, (e, q) in sorted(want.items()):
                before = self._unit.stats.snapshots_served
                datas = self._unit.resume(t, e, q)
                snap = self._unit.stats.snapshots_served != before
                if datas:
                    self.metrics.catchup("snapshot" if snap else "replay")
                patches += [_catchup_patch(d, snap) for d in datas]
            self._edits.set()  # a catch-up may have closed pending edits: they go out next
            first = SubscribeEvent(patches=patches, heartbeat=self._heartbeat())
            self._subs.add(sub)
        self.counts.subscriptions += 1
        self.metrics.subscribers.set(len(self._subs))
        try:
            await stream.send_message(first)
            while True:
                ev = await sub.queue.get()
                if ev is None:
                    if sub.cut:
                        raise grpc_error(SubscriberLaggingError("subscriber fell behind: resubscribe from your positions"))
                    return
                await stream.send_message(ev)
        finally:
            self._subs.discard(sub)
            self.metrics.subscribers.set(len(self._subs))

    async def snapshot(self, snapshot_request: SnapshotRequest) -> SnapshotResponse:
        shard = self._unit.shard
        if snapshot_request.shard != shard:
            raise grpc_error(WrongShardError(f"this unit serves shard {shard}, not {snapshot_request.shard}", shard=shard, got_shard=snapshot_request.shard, key=None))
        tables = list(snapshot_request.tables) or [t.table_id for t in self._unit.layout.tables]
        try:
            async with self._unit_held():
                datas = [self._unit.snapshot(t) for t in tables]
        except KVCompassError as e:
            raise grpc_error(e) from None
        self.metrics.catchup("snapshot")
        return SnapshotResponse(snapshots=[_catchup_patch(d, True) for d in datas])


@dataclass(frozen=True, slots=True)
class MaintenanceEndpoints:
    """Where a started :class:`MaintenanceServer` listens."""

    shard: int
    grpc: str
    metrics: str | None


class MaintenanceServer(AsyncResource):
    """A :class:`MaintenanceService` plus Health on a grpclib server, and the metrics endpoint:
    the whole process of ``kvcompass maintenance``, as an async context manager."""

    def __init__(self, service: MaintenanceService) -> None:
        self.service = service
        self.health = Health({service: [service.health]})
        self._server: DrainingServer | None = None
        self._metrics: MetricsServer | None = None
        self.endpoints: MaintenanceEndpoints | None = None

    async def start(
        self, host: str = "127.0.0.1", port: int = 0, *, metrics_port: int | None = None, ssl_context: ssl.SSLContext | None = None
    ) -> MaintenanceEndpoints:
        """Listen on ``host:port`` (0: a free port; over TLS with ``ssl_context``, see
        :mod:`kvcompass.services.tls`) and, unless ``metrics_port`` is None, serve ``/metrics``
        and ``/healthz`` there (0: a free port)."""
        server, bound = await DrainingServer.listen(
            [self.service, self.health], host, port, metrics=self.service.metrics, limits=self.service.message_limits(), ssl_context=ssl_context
        )
        self._server = server
        await self.service.start()
        murl = None
        if metrics_port is not None:
            svc = self.service
            self._metrics = MetricsServer(svc.metrics.registry, lambda: svc.health.__status__() is True)
            mport = await self._metrics.start(host, metrics_port)
            murl = f"http://{hostport(host, mport)}"
        self.endpoints = MaintenanceEndpoints(self.service.unit.shard, bound, murl)
        return self.endpoints

    async def close(self) -> None:
        """Drain and stop: NOT_SERVING, subscriptions ended after a last flush, connections
        closed (agents reconnect and resend what was not acknowledged), state written; the
        server and metrics endpoint are closed even if the final persist fails."""
        try:
            await self.service.begin_drain()
            for _ in range(3):  # let ended subscription streams send their trailers
                await asyncio.sleep(0)
        finally:
            if self._server is not None:
                server, self._server = self._server, None
                await server.shut()
            try:
                await self.service.finish_drain()
            finally:
                if self._metrics is not None:
                    m, self._metrics = self._metrics, None
                    await m.close()



async def serve_maintenance(
    layout: IndexLayout,
    shard: int,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    metrics_port: int | None = 0,
    config: MaintenanceConfig = MaintenanceConfig(),
    epoch: int | None = None,
    capacity: int = 1024,
    max_keys: int | None = None,
    on_ready: Callable[[MaintenanceEndpoints], None] | None = None,
    stop: asyncio.Event | None = None,
    ssl_context: ssl.SSLContext | None = None,
) -> None:
    """Run the unit of ``shard`` until SIGTERM/SIGINT (or ``stop`` is set), then drain.

    The unit is restored from ``config.state_path`` when that file exists. ``on_ready`` gets the
    bound endpoints once the server accepts connections (so a parent can wait for it).
    """
    unit = load_unit(layout, shard, state_path=config.state_path, epoch=epoch, capacity=capacity, max_keys=max_keys)
    service = MaintenanceService(unit, config)
    stop_ev = stop if stop is not None else asyncio.Event()
    with on_signals(stop_ev.set):
        async with MaintenanceServer(service) as server:
            ends = await server.start(host, port, metrics_port=metrics_port, ssl_context=ssl_context)
            if on_ready is not None:
                on_ready(ends)
            await stop_ev.wait()
