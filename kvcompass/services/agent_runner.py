"""``kvcompass agent``: drives one :class:`~kvcompass.agent.WorkerAgent` from an engine's ZMQ
KV-event stream and hands the key-op batches it produces to a sink.

The agent itself is sans-I/O; this is its socket driver. It works against vLLM (and SGLang, and
``kvcompass worker --emulate``) as they are:

* **Events**: a SUB socket connected to the engine's PUB endpoint (vLLM's
  ``--kv-events-config`` ``endpoint``, ``tcp://*:5557`` by default), subscribed to ``topic``
  (vLLM's default topic is empty, which matches everything). Each message
  ``(topic, seq, payload)`` goes to :meth:`WorkerAgent.on_message`. ZMQ reconnects by itself
  when the engine restarts on the same endpoint; the agent recognises the restart from the seq
  going back (a new incarnation: every shard re-reported from scratch).
* **Replay**: when the agent reports a gap (``AgentOutput.replay``), a DEALER socket sends
  ``[b"", start_seq]`` to the engine's ROUTER replay endpoint (``replay_endpoint`` in vLLM's
  config). vLLM's ROUTER wants exactly ``[identity, b"", start_seq]`` (the empty frame a REQ
  socket would add), and answers each with ``[b"", seq, payload]`` (some vLLM releases put
  the topic first: ``[b"", topic, seq, payload]``; both are read) until a ``seq`` of -1. Each
  reply goes to :meth:`WorkerAgent.on_replay`. No reply frame within ``replay_timeout_s``, or
  no replay endpoint at all, calls :meth:`WorkerAgent.on_replay_failed` (the agent resyncs
  with a full re-report), and the DEALER is replaced so a late reply cannot leak into the next
  replay. Live messages that arrive during a replay wait in the SUB socket's queue; the agent
  buffers or drops them by seq when they are read.
* **Sink**: an async callable that takes each non-empty tuple of batches, in order, and
  returns when they are sent (the gRPC ingest client, in a deployment). It is awaited inline,
  so a slow sink slows event reading (ZMQ queues, then drops at its high-water mark, and the
  agent's gap handling recovers). When the sink raises
  :class:`~kvcompass.errors.AgentSequenceError` (a maintenance unit lost the agent's sequence,
  usually by restarting), the runner sends what :meth:`WorkerAgent.on_rejected` returns for that
  shard (the error's ``shard`` attribute if it has one, else every shard), as the agent's
  driver contract asks. :class:`~kvcompass.errors.StaleIncarnationError` (a newer agent owns
  the worker) and any other sink error end :meth:`AgentRunner.run` with that error.

A malformed engine message is counted and skipped (the agent's state is untouched, and its seq
never applies, so the next message opens a gap that the replay repairs).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from kvcompass.agent import AgentOutput, ReplayRequest, WorkerAgent, boot_incarnation
from kvcompass.discovery.key_ops import KeyOpBatch
from kvcompass.discovery.plan import LevelPlan
from kvcompass.discovery.topology import Topology
from kvcompass.errors import AgentSequenceError, IngestRejectedError, InvalidArgumentError, InvalidEventError, StaleIncarnationError, UnknownWorkerError
from kvcompass.index_types import Namespace
from kvcompass.services.ingest_client import SendReport

__all__ = ["AgentRunner", "RunnerStats", "Sink", "agent_for_worker"]

Sink = Callable[[Sequence[KeyOpBatch]], Awaitable[object]]
"""Where key-op batches go: awaited once per non-empty group, in order; what it returns is
ignored (``IngestClient.send`` returns a report and fits as it is)."""

_log = logging.getLogger(__name__)
_MAX_REJECTIONS = 8  # on_rejected rounds for one send before the sink's error is final


def agent_for_worker(
    topology: Topology,
    worker_id: str,
    namespace: Namespace,
    *,
    incarnation: int | None = None,
    block_size: int | None = None,
) -> WorkerAgent:
    """The agent of a topology's worker: its region's registration lengths and the topology's
    shard count. ``incarnation`` None: :func:`~kvcompass.agent.boot_incarnation` of the wall
    clock (what a freshly started agent process must use). ``block_size`` None accepts any
    engine block size (keys come from token ids, so they do not depend on it)."""
    spec = next((w for w in topology.workers if w.id == worker_id), None)
    if spec is None:
        raise UnknownWorkerError(f"worker {worker_id!r} is not in topology {topology.name!r}", worker=worker_id)
    plan = LevelPlan(topology)
    inc = boot_incarnation(time.time_ns()) if incarnation is None else incarnation
    # Doors salt every tenant's requests but the default one's (TENANT_SALT_PREFIX + tenant), so
    # the engine keeps tenants' KV apart; the agent keys each salted chain in its tenant's namespace.
    return WorkerAgent(worker_id, namespace, plan.registration(spec.region), topology.shards, block_size=block_size, incarnation=inc, tenant_salts=True)


@dataclass(slots=True)
class RunnerStats:
    """What the driver did (the agent's own counters are in ``agent.stats``)."""

    messages: int = 0  # live messages read
    malformed: int = 0  # of those, refused by the agent (InvalidEventError)
    replays: int = 0  # replay requests sent
    replay_frames: int = 0  # replay reply frames read (end frames included)
    replay_failures: int = 0  # replays that timed out, could not be sent, or had no endpoint
    sent_batches: int = 0  # acknowledged by the units when the sink reports it (IngestClient), else handed to the sink
    sent_ops: int = 0
    rejections: int = 0  # AgentSequenceError from the sink, answered with on_rejected
    heartbeats: int = 0  # rounds of empty batches sent after heartbeat_s of silence
    engine_gone: int = 0  # disconnections from the engine's publisher, each withdrawing every claim
    dropped_after_gone: int = 0  # messages the gone engine had sent that were taken only after it went: discarded
    events_skipped: int = 0  # events the agent could not understand (logged, the latest 256 each by index; the rest of its message applied)
    capacity_refusals: int = 0  # sends a unit refused for its key or memory budget (logged; the runner goes on)


class AgentRunner:
    """Feeds ``agent`` from the engine at ``events`` (and ``replay``), sending its batches to
    ``sink``. ``await start()`` / ``await stop()``, or ``await run()`` until cancelled.

    ``ctx``: a ZMQ asyncio context to use (None: the runner makes and terminates its own).
    ``catch_up``: with a ``replay`` endpoint, first replay what the engine's ring holds
    (:meth:`WorkerAgent.catch_up`), so an agent restarted beside a running engine claims its
    cache at once instead of at the engine's next event."""

    def __init__(
        self,
        agent: WorkerAgent,
        sink: Sink,
        events: str,
        replay: str | None = None,
        *,
        topic: bytes = b"",
        replay_timeout_s: float = 2.0,
        ctx: zmq.asyncio.Context | None = None,
        heartbeat_s: float | None = None,
        catch_up: bool = True,
    ) -> None:
        if not isinstance(events, str) or "://" not in events:
            raise InvalidArgumentError(f"events must be a ZMQ endpoint such as tcp://HOST:PORT, got {events!r}")
        if replay is not None and (not isinstance(replay, str) or "://" not in replay):
            raise InvalidArgumentError(f"replay must be a ZMQ endpoint such as tcp://HOST:PORT or None, got {replay!r}")
        if isinstance(replay_timeout_s, bool) or not isinstance(replay_timeout_s, (int, float)) or not 0 < replay_timeout_s < float("inf"):
            raise InvalidArgumentError(f"replay_timeout_s must be a positive number, got {replay_timeout_s!r}")
        if heartbeat_s is not None and (isinstance(heartbeat_s, bool) or not isinstance(heartbeat_s, (int, float)) or not 0 < heartbeat_s < float("inf")):
            raise InvalidArgumentError(f"heartbeat_s must be a positive number or None, got {heartbeat_s!r}")
        if not isinstance(topic, bytes):
            raise InvalidArgumentError(f"topic must be bytes, got {type(topic).__name__}")
        self.agent = agent
        self.sink = sink
        self.events = events
        self.replay = replay
        self.topic = topic
        self.replay_timeout_s = float(replay_timeout_s)
        self.catch_up = bool(catch_up)
        self.stats = RunnerStats()
        self._own_ctx = ctx is None
        self._ctx = ctx
        self._sub: zmq.asyncio.Socket | None = None
        self._dealer: zmq.asyncio.Socket | None = None
        self._task: asyncio.Task[None] | None = None
        self._lock = asyncio.Lock()  # one sender at a time: the read loop or resend_full_report
        # After this long without sending, empty batches (WorkerAgent.heartbeat) let a unit that
        # restarted from an older state notice the lost sequence and get a full re-report.
        self.heartbeat_s = None if heartbeat_s is None else float(heartbeat_s)
        self._last_sent = 0.0
        self._hb: asyncio.Task[None] | None = None
        self._gone = 0  # engine disconnections seen: a message read before one is handled after it
        self._resyncs = agent.resyncs  # resyncs already logged
        # What ended the heartbeats, if a sink error did: the runner then ends with it.
        self._fatal: BaseException | None = None
        self._reader: asyncio.Task[object] | None = None
        self._monitor: zmq.asyncio.Socket | None = None

    # ---- lifecycle --------------------------------------------------------------------------

    def _open(self) -> None:
        if self._sub is not None:
            return
        if self._ctx is None:
            self._ctx = zmq.asyncio.Context()
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.RCVHWM, 100_000)
        sub.setsockopt(zmq.SUBSCRIBE, self.topic)
        # Told when the publisher's connection drops (the engine died or restarts): see _watch_engine.
        self._monitor = sub.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        sub.connect(self.events)
        self._sub = sub

    def _close(self) -> None:
        if self._sub is not None and self._monitor is not None:
            with contextlib.suppress(zmq.ZMQError):
                self._sub.disable_monitor()
        for s in (self._monitor, self._sub, self._dealer):
            if s is not None:
                s.close(linger=0)
        self._sub = self._dealer = self._monitor = None
        if self._own_ctx and self._ctx is not None:
            self._ctx.term()
            self._ctx = None

    async def start(self) -> None:
        """Connect and start reading in a background task (its errors surface in :meth:`stop`
        and :meth:`wait`)."""
        if self._task is not None:
            raise RuntimeError("AgentRunner.start called twice")
        self._open()
        self._task = asyncio.create_task(self._loop())
        self._start_heartbeats()

    async def stop(self) -> None:
        """Stop reading and close the sockets. Re-raises the error that ended the loop (or the
        heartbeats), if any."""
        task, self._task = self._task, None
        await self._stop_heartbeats()
        try:
            if task is not None:
                if not task.done():
                    task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        finally:
            self._close()
        if self._fatal is not None:
            raise self._fatal

    async def wait(self) -> None:
        """Until the loop ends (only by an error, or by :meth:`stop`); re-raises its error,
        or the sink error that ended the heartbeats."""
        if self._task is not None:
            try:
                await asyncio.shield(self._task)
            except asyncio.CancelledError:
                if self._fatal is not None and self._task.cancelled():
                    raise self._fatal from None
                raise

    async def run(self) -> None:
        """Connect and read until cancelled (or a fatal sink error, which is raised)."""
        self._open()
        self._reader = asyncio.current_task()
        self._start_heartbeats()
        try:
            await self._loop()
        except asyncio.CancelledError:
            if self._fatal is not None:
                raise self._fatal from None
            raise
        finally:
            self._reader = None
            await self._stop_heartbeats()
            self._close()

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()

    # ---- the loop ---------------------------------------------------------------------------

    async def _watch_engine(self) -> None:
        """Withdraw every claim the moment the engine's publisher disconnects: an engine that
        went away took its KV cache with it, and waiting for its next event would leave the
        index claiming blocks nobody holds (WorkerAgent.on_engine_gone)."""
        mon = self._monitor
        assert mon is not None
        while True:
            frames = await mon.recv_multipart()
            try:
                event = parse_monitor_message(frames)["event"]
            except (ValueError, KeyError, IndexError):
                continue
            if event != zmq.EVENT_DISCONNECTED:
                continue
            async with self._lock:
                self.stats.engine_gone += 1
                self._gone += 1
                dropped = self._drop_queued()
                _log.warning("worker %s: the engine's event stream disconnected: withdrawing its claims (%d queued messages of it discarded)", self.agent.worker_id, dropped)
                await self._send(self.agent.on_engine_gone())

    def _drop_queued(self) -> int:
        """Discard what the gone engine left queued in the SUB socket. Found in review: those
        messages, read after the withdrawal, looked like a new engine's stream with a gap; the
        replay asked of the dead engine timed out, and the resync claimed their blocks again,
        for an engine that no longer existed (heartbeats then kept the claims alive). A
        restarted engine cannot have published yet: it connects anew, after this."""
        sub = self._sub
        n = 0
        while sub is not None:
            f = asyncio.ensure_future(sub.recv_multipart(flags=zmq.NOBLOCK))  # resolved at once: a message, or zmq.Again
            if not f.done() or f.exception() is not None:
                if not f.done():
                    f.cancel()
                break
            n += 1
        self.stats.dropped_after_gone += n
        return n

    async def _loop(self) -> None:
        assert self._sub is not None
        sub = self._sub
        loop = asyncio.get_running_loop()
        tasks = {loop.create_task(self._read(sub))}
        if self._monitor is not None:
            tasks.add(loop.create_task(self._watch_engine()))
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            for t in done:
                t.result()  # either ends only by an error: raise it
        finally:
            for t in tasks:
                t.cancel()
            for t in tasks:
                with contextlib.suppress(asyncio.CancelledError):
                    await t

    async def _read(self, sub: zmq.asyncio.Socket) -> None:
        if self.replay is not None and self.catch_up:
            # First what the engine's ring holds (WorkerAgent.catch_up); live messages published
            # meanwhile wait in the SUB socket, connected already.
            async with self._lock:
                await self._handle(self.agent.catch_up())
        while True:
            frames = await sub.recv_multipart()
            self.stats.messages += 1
            gone = self._gone
            # The agent numbers batches as it makes them, so making and sending them is one
            # critical section (resend_full_report takes the same lock).
            async with self._lock:
                if gone != self._gone:
                    # Read before the engine went away, its turn after the withdrawal: it speaks
                    # for a cache that is gone (see _drop_queued).
                    self.stats.dropped_after_gone += 1
                    continue
                out = self._decoded(lambda: self.agent.on_message(frames), "KV-event message")
                if out is not None:
                    await self._handle(out)

    def _decoded(self, decode: Callable[[], AgentOutput], what: str, *, live: bool = True) -> AgentOutput | None:
        """``decode()``, or None for a message the agent cannot read (counted and logged; the
        stream goes on: a whole message that is not msgpack is the engine's to resend). A
        replayed copy is neither counted nor logged again: the gap a malformed live message
        leaves asks for a replay that brings it back (found in review: each bad message
        counted once per replay that covered it)."""
        try:
            return decode()
        except InvalidEventError as e:
            if live:
                self.stats.malformed += 1
                _log.warning("worker %s: skipping a malformed %s: %s", self.agent.worker_id, what, e)
            else:
                _log.debug("worker %s: skipping a malformed %s: %s", self.agent.worker_id, what, e)
            return None

    def _log_skipped(self) -> None:
        listed = self.agent.take_skipped()
        total = self.agent.skipped_total
        for seq, sk in listed:
            _log.warning("worker %s: skipped event %d of seq %d (the rest of the message applied): %s", self.agent.worker_id, sk.index, seq, sk.reason)
        unlisted = total - self.stats.events_skipped - len(listed)
        if unlisted > 0:
            _log.warning("worker %s: %d more events skipped without a line each (only the latest %d are kept for the log)", self.agent.worker_id, unlisted, len(listed))
        self.stats.events_skipped = total

    async def _handle(self, out: AgentOutput) -> None:
        self._log_skipped()
        await self._send(out.batches)
        replay = out.replay
        while replay is not None:
            replay = await self._replay(replay)
        self._log_resyncs()

    def _log_resyncs(self) -> None:
        """A warning for each gap the engine's ring could not fill (found in review: silent, and
        after one the index may claim blocks that events lost beyond the ring removed)."""
        n = self.agent.resyncs
        if n > self._resyncs:
            _log.warning(
                "worker %s: %d gap(s) in the engine's events could not be filled from its replay ring; everything the agent knows was re-reported, "
                "and blocks that the lost events removed may stay claimed until the engine stores or removes them again",
                self.agent.worker_id,
                n - self._resyncs,
            )
            self._resyncs = n

    async def _replay(self, req: ReplayRequest) -> ReplayRequest | None:
        """Run one replay to its end; returns a further request if the agent makes one."""
        if self.replay is None:
            self.stats.replay_failures += 1
            await self._send(self.agent.on_replay_failed().batches)
            return None
        assert self._ctx is not None
        if self._dealer is None:
            d = self._ctx.socket(zmq.DEALER)
            d.setsockopt(zmq.LINGER, 0)
            # No receive limit: vLLM's ROUTER writes its whole ring at once with the default
            # send limit, and a ROUTER drops what a full peer cannot take, END frame included
            # (found in review: half of a 10,000-message replay lost, its span never applied).
            # The ring is bounded by the engine, so this buffer is too.
            d.setsockopt(zmq.RCVHWM, 0)
            d.connect(self.replay)
            self._dealer = d
        dealer = self._dealer
        self.stats.replays += 1
        sent, _ = await _within(dealer.send_multipart([b"", req.frame()]), self.replay_timeout_s)
        while sent:
            got, frames = await _within(dealer.recv_multipart(), self.replay_timeout_s)
            if not got or frames is None:
                break
            self.stats.replay_frames += 1
            reply = _replay_frames(frames)
            if reply is None:
                _log.warning("worker %s: ignoring a replay reply of %d frames", self.agent.worker_id, len(frames))
                continue
            out = self._decoded(lambda: self.agent.on_replay(reply), "replayed message", live=False)
            if out is None:
                continue
            self._log_skipped()
            await self._send(out.batches)
            if out.replay is not None:
                return out.replay
            if reply[0] == _END:
                return None
        self.stats.replay_failures += 1
        _log.warning("worker %s: replay from seq %d got no answer within %.1f s; resyncing", self.agent.worker_id, req.start_seq, self.replay_timeout_s)
        # A late answer must not be read as the next replay's: start over with a new socket.
        dealer.close(linger=0)
        self._dealer = None
        await self._send(self.agent.on_replay_failed().batches)
        return None

    def _start_heartbeats(self) -> None:
        if self.heartbeat_s is not None and self._hb is None:
            self._last_sent = asyncio.get_running_loop().time()
            self._hb = asyncio.create_task(self._heartbeats(self.heartbeat_s))
            self._hb.add_done_callback(self._heartbeats_ended)

    def _heartbeats_ended(self, hb: asyncio.Task[None]) -> None:
        """A sink error ended the heartbeats: it ends the runner too, as the same error ends it
        when the read loop meets it. Found in review: the heartbeat task died alone, so an agent
        whose engine was quiet never sent another heartbeat while it looked alive."""
        if hb.cancelled() or hb.exception() is None:
            return
        self._fatal = hb.exception()
        _log.error("worker %s: a heartbeat's send failed: %r; stopping", self.agent.worker_id, self._fatal)
        for t in (self._task, self._reader):
            if t is not None and not t.done():
                t.cancel()

    async def _stop_heartbeats(self) -> None:
        hb, self._hb = self._hb, None
        if hb is not None:
            hb.cancel()
            # A sink error that ended them is kept in _fatal (raised by stop, wait and run).
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await hb

    async def _heartbeats(self, period: float) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(max(period - (loop.time() - self._last_sent), period / 4))
            if loop.time() - self._last_sent >= period:
                async with self._lock:
                    self.stats.heartbeats += 1
                    await self._send(self.agent.heartbeat())

    async def _send(self, batches: Sequence[KeyOpBatch]) -> None:
        """Hand ``batches`` to the sink (the caller holds the lock)."""
        if not batches:
            return
        self._last_sent = asyncio.get_running_loop().time()
        pending: Sequence[KeyOpBatch] = batches
        for _ in range(_MAX_REJECTIONS):
            try:
                report = await self.sink(pending)
            except StaleIncarnationError:
                raise
            except IngestRejectedError as e:
                if e.reason != "CapacityError":
                    raise
                # A unit out of budget refuses growth: ending the runner (and, supervised,
                # restarting it into the same refusal) stopped every shard's updates and the
                # engine's events with them (found in review). The refused shard's claims stay
                # as they were until the budget allows the re-report its next batch triggers.
                self.stats.capacity_refusals += 1
                _log.warning("worker %s: %s", self.agent.worker_id, e)
                return
            except AgentSequenceError as e:
                self.stats.rejections += 1
                shard = getattr(e, "shard", None)
                pending = self.agent.on_rejected(shard if isinstance(shard, int) and 0 <= shard < self.agent.shards else None)
                continue
            if isinstance(report, SendReport):  # what the units acknowledged (resets, not what they replaced)
                self.stats.sent_batches += report.batches
                self.stats.sent_ops += report.ops
            else:
                self.stats.sent_batches += len(pending)
                self.stats.sent_ops += sum(len(b.keys) for b in pending)
            return
        raise AgentSequenceError(f"worker {self.agent.worker_id}: the sink refused {_MAX_REJECTIONS} full re-reports in a row", expected=-1, got=-1)

    async def resend_full_report(self) -> None:
        """Send the agent's whole inventory as ``reset`` batches (after the sink reconnected to
        a maintenance unit that may have lost track of this worker)."""
        async with self._lock:
            await self._send(self.agent.full_report())


_END = b"\xff" * 8
T = TypeVar("T")


async def _within(op: Awaitable[T], timeout_s: float) -> tuple[bool, T | None]:
    """``(True, result)`` of a socket operation, or ``(False, None)`` when it did not complete in
    time (it is then cancelled, and the caller drops the socket). Sink errors never pass here,
    so a sink's own TimeoutError is not mistaken for a silent engine."""
    try:
        return True, await asyncio.wait_for(op, timeout_s)
    except TimeoutError:
        return False, None


def _replay_frames(frames: Sequence[bytes]) -> list[bytes] | None:
    """A DEALER's view of a replay reply, as the agent's ``(seq, payload)``; None if unreadable."""
    rest = list(frames)
    if rest and rest[0] == b"":  # the delimiter a ROUTER puts before a REQ-style reply
        rest = rest[1:]
    if len(rest) == 3:  # releases that send the topic first
        rest = rest[1:]
    if len(rest) != 2:
        return None
    return rest
