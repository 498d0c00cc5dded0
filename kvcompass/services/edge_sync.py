"""Keeps one :class:`~kvcompass.discovery.edge.Edge`'s views current from every maintenance unit.

One task per unit (shard): bootstrap every never-initialised view of the shard with
``Snapshot``, then ``Subscribe`` with the views' positions and apply what arrives. Repair is
always the same move -- end the subscription and subscribe again from the views' current
positions -- because the unit answers a subscription with exactly what those positions miss
(a replay from its log, or a snapshot). That move is made when:

* a batch is refused as a gap or an epoch change (``PatchOutcome`` gap/snapshot_needed),
* a heartbeat shows the writer ahead of a view (a lost *last* batch),
* the edge still lists a pending resync for the shard,
* the stream ends or fails (then after a backoff: the unit may be restarting),
* nothing (no batch, no heartbeat) arrives on it for ``silence_s``: a unit whose host died or
  whose network drops packets ends no stream, and without this deadline the edge's views froze
  while it reported ready (found in review). A unit heartbeats every 0.25 s by default.

Readiness (:attr:`EdgeSync.ready`, grpclib Health via :attr:`EdgeSync.health`, the metrics
``/healthz``) is ``Edge.healthy`` *and* every shard's subscription caught up: a view whose
unit is unreachable may be behind without the edge knowing it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
import time
import math
from typing import Callable, Mapping

from grpclib.client import Channel
from grpclib.const import Cardinality
from grpclib.exceptions import GRPCError, StreamTerminatedError
from grpclib.health.check import ServiceStatus

from kvcompass import _core
from kvcompass._proto.kvcompass.v1 import MaintenanceStub, Position, SnapshotRequest, SubscribeEvent, SubscribeRequest
from kvcompass.discovery.edge import Edge
from kvcompass.errors import InvalidArgumentError, KVCompassError
from kvcompass.services.wire import SUBSCRIBE_PATH
from kvcompass.services.metrics import ServiceMetrics, export_states
from kvcompass.services.grpc_lifecycle import OwnedChannels
from kvcompass.services.lifecycle import AsyncResource

__all__ = ["EdgeSync"]

_TRANSPORT_ERRORS = (GRPCError, StreamTerminatedError, OSError, asyncio.TimeoutError)
# How often an edge counts its views' entries for kvcompass_index_entries (a scan of every view).
_ENTRIES_EVERY_S = 10.0
_log = logging.getLogger("kvcompass.edge_sync")


class _Resubscribe(Exception):
    """A view needs repair: subscribe again from the current positions."""


class EdgeSync(AsyncResource):
    """Subscribes ``edge`` to every unit in ``units`` (shard -> grpclib Channel, shared and closed
    by the caller, or ``"host:port"``, opened and closed here, over TLS with ``ssl_context``)."""

    def __init__(
        self,
        edge: Edge,
        units: Mapping[int, Channel | str],
        *,
        name: str | None = None,
        metrics: ServiceMetrics | None = None,
        health: ServiceStatus | None = None,
        backoff_s: tuple[float, float] = (0.02, 1.0),
        rpc_timeout_s: float = 10.0,
        ssl_context: ssl.SSLContext | None = None,
        view_budget_bytes: int | None = None,
        silence_s: float = 5.0,
    ) -> None:
        self.edge = edge
        self.name = name if name is not None else f"edge-{edge.region}"
        self.metrics = metrics if metrics is not None else ServiceMetrics("edge")
        self.health = health if health is not None else ServiceStatus()
        self._backoff = backoff_s
        if not silence_s > 0:
            raise InvalidArgumentError(f"silence_s must be > 0, got {silence_s}")
        self._silence_s = silence_s
        self.silences = 0  # subscriptions ended because nothing arrived for silence_s
        self._timeout = rpc_timeout_s
        # A replica cannot refuse its writer's patches without diverging: the budget is
        # enforced by the maintenance units (MaintenanceConfig.view_budget_bytes) and only
        # reported here, so an operator sees an edge whose views outgrew what it was sized for.
        self._view_budget = view_budget_bytes
        self._entries_at = -math.inf  # when kvcompass_index_entries was last counted
        if view_budget_bytes is not None:
            self.metrics.memory_budget.labels(self.metrics.role, "view").set(view_budget_bytes)
        self._owned = OwnedChannels(ssl_context)
        self._channels: dict[int, Channel] = {shard: self._owned.get(target) for shard, target in units.items()}
        self._tables = _table_ids(edge)
        # What the fault harness compares with the writers' tables (computed only when scraped).
        export_states(self.metrics.registry, "edge", lambda: [(t, s, v.epoch, v.seq, v.digest()) for t in self._tables for s in sorted(self._channels) if (v := edge.view(t, s)).initialised])
        self._live = {s: False for s in self._channels}
        # Since when (monotonic s) each shard's subscription has not been current; None: it is.
        self._down_since: dict[int, float | None] = {s: time.monotonic() for s in self._channels}
        self._streak = {s: 0 for s in self._channels}  # resubscriptions since the shard was last current
        self._tasks: list[asyncio.Task[None]] = []
        self._changed = asyncio.Event()
        self.subscriptions = 0
        self.resubscribes = 0
        self.reconnects = 0
        self._ready_last: bool | None = None
        self._update()

    # ---- state -------------------------------------------------------------------------------

    @property
    def ready(self) -> bool:
        """Every view bootstrapped and current as far as its writer has said, every stream live."""
        return all(self._live.values()) and self.edge.healthy

    def _set_live(self, shard: int, live: bool) -> None:
        self._live[shard] = live
        if live:
            self._down_since[shard] = None
        elif self._down_since[shard] is None:
            self._down_since[shard] = time.monotonic()

    def stale_shards(self) -> dict[int, float]:
        """Shard -> seconds its subscription has not been current (a view of a shard whose unit
        is unreachable may be behind without the edge knowing it); current shards are absent."""
        now = time.monotonic()
        return {s: now - since for s, since in sorted(self._down_since.items()) if since is not None}

    def _update(self) -> None:
        r = self.ready
        if r != self._ready_last:
            self._ready_last = r
            self.health.set(r)
            self.metrics.ready.set(int(r))
        self._changed.set()

    async def wait_ready(self, timeout: float | None = None) -> None:
        """Until :attr:`ready` (asyncio.TimeoutError after ``timeout`` seconds)."""
        async with asyncio.timeout(timeout):
            while not self.ready:
                self._changed.clear()
                await self._changed.wait()

    async def wait_for(self, pred: Callable[[], bool], timeout: float | None = None) -> None:
        """Until ``pred()`` holds, re-checked after every event this syncer handles."""
        async with asyncio.timeout(timeout):
            while not pred():
                self._changed.clear()
                await self._changed.wait()

    # ---- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        for shard in sorted(self._channels):
            self._tasks.append(loop.create_task(self._follow(shard), name=f"{self.name}-shard-{shard}"))

    async def close(self) -> None:
        tasks, self._tasks = self._tasks, []
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t
        self._owned.close()
        for s in self._live:
            self._set_live(s, False)
        self._update()

    async def open(self) -> None:
        await self.start()

    # ---- the follower ------------------------------------------------------------------------

    async def _follow(self, shard: int) -> None:
        stub = MaintenanceStub(self._channels[shard])
        failures = 0
        while True:
            try:
                await self._bootstrap(stub, shard)
                await self._subscribe(shard)
                failures = 0  # the unit ended the stream cleanly (a drain): come back at once
            except _Resubscribe:
                self.resubscribes += 1
                self.metrics.resyncs.inc()
                self._streak[shard] += 1
                failures = 0
            except _TRANSPORT_ERRORS:
                failures += 1
                self.reconnects += 1
                self.metrics.reconnects.inc()
            except Exception:
                # Nothing may end a follower but close(): a dead one left the shard reported
                # live and never synced again (found in review: a heartbeat naming a table this
                # edge's layout lacks raised here). Said, then tried again after a backoff.
                _log.exception("%s: following shard %d failed; subscribing again", self.name, shard)
                failures += 1
                self.reconnects += 1
                self.metrics.reconnects.inc()
            self._set_live(shard, False)
            self._update()
            # A repair that does not take (the same refusal again and again) backs off like a
            # transport failure instead of spinning.
            n = failures or max(0, self._streak[shard] - 1)
            await asyncio.sleep(min(self._backoff[1], self._backoff[0] * 2 ** (n - 1)) if n else 0)

    async def _bootstrap(self, stub: MaintenanceStub, shard: int) -> None:
        missing = sorted(t for (t, s) in self.edge.uninitialised if s == shard)
        if not missing:
            return
        resp = await stub.snapshot(SnapshotRequest(shard=shard, tables=missing), timeout=self._timeout)
        for p in resp.snapshots:
            self.edge.bootstrap(p.table, p.shard, p.data)
            self.metrics.patches_in.inc()

    def _positions(self, shard: int) -> list[Position]:
        out = []
        for t in self._tables:
            v = self.edge.view(t, shard)
            e, q = (v.epoch, v.seq) if v.initialised else (0, 0)
            out.append(Position(table=t, shard=shard, epoch=e, seq=q))
        return out

    async def _subscribe(self, shard: int) -> None:
        ch = self._channels[shard]
        req = SubscribeRequest(shard=shard, positions=self._positions(shard), subscriber=self.name)
        async with ch.request(SUBSCRIBE_PATH, Cardinality.UNARY_STREAM, SubscribeRequest, SubscribeEvent) as stream:
            await stream.send_message(req, end=True)
            self.subscriptions += 1
            try:
                while True:
                    try:
                        async with asyncio.timeout(self._silence_s):
                            ev = await stream.recv_message()
                    except TimeoutError:
                        self.silences += 1
                        _log.warning("%s: nothing from the unit of shard %d for %g s; subscribing again", self.name, shard, self._silence_s)
                        await stream.cancel()
                        raise
                    if ev is None:
                        break
                    self._on_event(shard, ev)
            except _Resubscribe:
                await stream.cancel()
                raise

    def _adopt_other_epoch(self, data: bytes) -> bool:
        try:
            h = _core.decode_batch_header(data)
            v = self.edge.view(h["table"], h["shard"])
            if not v.initialised or h["epoch"] == v.epoch:
                return False
            self.edge.bootstrap(h["table"], h["shard"], data)
            return True
        except (KVCompassError, ValueError):
            return False  # not a snapshot: the heartbeat's position check asks for one

    def _on_event(self, shard: int, ev: SubscribeEvent) -> None:
        edge, m = self.edge, self.metrics
        broken = False
        now_ns = time.time_ns()
        for p in ev.patches:
            out = edge.apply_patch(p.data)
            if out.applied:
                m.patches_in.inc()
                if p.emitted_unix_ns:
                    m.patch_lag.observe(max(0.0, (now_ns - p.emitted_unix_ns) / 1e9))
            elif out.status == "stale":
                # A snapshot of another epoch on the current stream is the writer's state after
                # a restart to a lower epoch (its clock stepped back): the view takes it whole.
                # (A delta or same-epoch snapshot that is stale is a duplicate: dropped.)
                if self._adopt_other_epoch(p.data):
                    m.patches_in.inc()
            else:
                m.refused(out.status)
                if out.status in ("gap", "snapshot_needed"):
                    m.gaps.inc()
                broken = True
        for pos in ev.heartbeat:
            if edge.note_writer_position(pos.table, pos.shard, pos.epoch, pos.seq) is not None:
                m.gaps.inc()
            self._set_live(shard, True)
        if ev.heartbeat:
            self._update_memory()
        if broken or any(a.shard == shard for a in edge.pending_resyncs()):
            self._set_live(shard, False)
            self._update()
            raise _Resubscribe()
        if self._live[shard]:
            self._streak[shard] = 0
        self._update()


    def _update_memory(self) -> None:
        m, total, over, budget = self.metrics, 0, 0, self._view_budget
        for t in self._tables:
            for s in self._channels:
                b = self.edge.view(t, s).memory_bytes
                total += b
                over += budget is not None and b >= budget
                m.view_bytes.labels(m.role, str(t), str(s)).set(b)
        m.index_bytes.set(total)
        if budget is not None:
            m.over_budget.labels(m.role, "view").set(over)
        # The views' entries (found in review: the gauge stayed 0 on edges). Counting is a scan
        # of every view, so it runs at most every _ENTRIES_EVERY_S, not on every heartbeat.
        now = time.monotonic()
        if now - self._entries_at >= _ENTRIES_EVERY_S:
            self._entries_at = now
            m.index_entries.set(sum(self.edge.view(t, s).count_entries() for t in self._tables for s in self._channels))

    @property
    def views_over_budget(self) -> int:
        """Views at or over ``view_budget_bytes`` now (0 without a budget)."""
        budget = self._view_budget
        if budget is None:
            return 0
        return sum(self.edge.view(t, s).memory_bytes >= budget for t in self._tables for s in self._channels)


def _table_ids(edge: Edge) -> list[int]:
    """The layout's table ids (0..n-1 by its contract), read off the edge's views of shard 0."""
    n = 0
    while True:
        try:
            edge.view(n, 0)
        except InvalidArgumentError:
            return list(range(n))
        n += 1
