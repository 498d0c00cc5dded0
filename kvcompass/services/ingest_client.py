"""The agent's side of ``Maintenance.Ingest``: one long-lived stream per maintenance unit.

:meth:`IngestClient.send` delivers key-op batches to the units owning their shards and returns
once every one is acknowledged, so the caller knows what the index holds. What it handles by
itself:

* **Pipelining.** Up to ``window`` batches are in flight per stream; acks come back in order.
* **Sequence errors.** An ``ABORTED`` ack (the unit lost the agent's sequence, typically after a
  restart) calls ``on_rejected(shard)`` -- :meth:`WorkerAgent.on_rejected` -- and sends the reset
  batches it returns instead of everything of that shard still queued (a reset re-reports the
  worker's whole inventory of the shard, so it subsumes them). Acks of batches that were
  already in flight before the reset are ignored: they were sent from the old sequence.
* **Transport failures.** The stream is re-opened with exponential backoff and the shard is
  re-reported in full (``on_rejected(shard)``'s reset batches replace everything queued), as
  docs/design.md section 7 asks of a reconnecting agent: the unit may have restarted from a state
  saved before batches it had already acknowledged, and only a reset makes it exact again. A
  caller whose ``on_rejected`` returns nothing gets the unacknowledged batches re-sent in order
  (the unit drops re-deliveries as duplicates).

Anything else refused (bad keys, wrong shard, a newer incarnation owns the worker, a credential
the unit does not accept) raises :class:`~kvcompass.errors.IngestRejectedError`, whose ``cause``
is the class the unit refused with: resending cannot help.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import ssl
import logging
import time
from collections import deque
from dataclasses import dataclass
from typing import AsyncIterator, Callable, Mapping, NoReturn, Sequence

from grpclib.client import Channel
from grpclib.client import Stream as ClientStream
from grpclib.const import Cardinality, Status
from grpclib.exceptions import GRPCError, StreamTerminatedError

from kvcompass._proto.kvcompass.v1 import IngestAck, KeyOps
from kvcompass.discovery.key_ops import KeyOpBatch
from kvcompass.errors import AgentSequenceError, IngestRejectedError
from kvcompass.services.status import error_class, error_from
from kvcompass.services.wire import INGEST_PATH, TOKEN_HEADER, WORKER_HEADER
from kvcompass.services.grpc_lifecycle import OwnedChannels
from kvcompass.services.lifecycle import AsyncResource

_log = logging.getLogger(__name__)

__all__ = ["IngestClient", "SendReport", "encode_key_ops"]

ResendFn = Callable[[int], Sequence[KeyOpBatch]]

# Statuses after which the same batches may go through on a new stream.
_TRANSIENT = {Status.UNAVAILABLE, Status.CANCELLED, Status.DEADLINE_EXCEEDED, Status.UNKNOWN, Status.INTERNAL, Status.RESOURCE_EXHAUSTED}


def _rejected(shard: int, seq: int, status: Status, reason: str | None, message: str) -> IngestRejectedError:
    """A final refusal, with the class the unit refused with read back through the status table
    (its ack's ``reason`` or the stream status's message names it)."""
    if reason:
        cause, text = error_class(reason, status), message
    else:  # a stream status: its message names the class ("Class: text")
        e = error_from(status, message)
        cause, text = type(e), e.message
    return IngestRejectedError(
        f"shard {shard} seq {seq}: {status.name} {cause.__name__}: {text}", shard=shard, seq=seq, status=status, reason=cause.__name__, cause=cause
    )


@dataclass(frozen=True, slots=True)
class SendReport:
    """What one :meth:`IngestClient.send` achieved."""

    batches: int
    """Batches acknowledged as applied or duplicate (resends included)."""
    applied: int
    """Distinct keys written."""
    duplicates: int
    resets: int
    """How many times a unit's sequence error was repaired by a reset re-report."""
    reconnects: int
    unreachable: tuple[int, ...] = ()
    """Shards whose unit could not be reached: their batches wait for a re-report once it is
    back (see :class:`IngestClient`)."""
    ops: int = 0
    """Key ops in the acknowledged batches (a reset sent in place of refused or lost batches
    counts its own ops, not theirs; unreachable shards' batches count nothing)."""


def encode_key_ops(b: KeyOpBatch) -> KeyOps:
    return KeyOps(
        worker=b.worker,
        incarnation=b.incarnation,
        shard=b.shard,
        seq=b.seq,
        reset=b.reset,
        keys=b.keys.astype("<u8", copy=False).tobytes(),
        tiers=b.tiers.tobytes(),
    )


class _Lost(Exception):
    """The stream broke; re-open it and re-send what is unacknowledged."""


class _UnitStream:
    """The stream to one unit, opened lazily and re-opened after a failure."""

    def __init__(self, shard: int, channel: Channel, metadata: Mapping[str, str]) -> None:
        self.shard = shard
        self.channel = channel
        self.metadata = dict(metadata)
        self.lock = asyncio.Lock()
        self._stack: contextlib.AsyncExitStack | None = None
        self._stream: ClientStream[KeyOps, IngestAck] | None = None

    async def open(self) -> ClientStream[KeyOps, IngestAck]:
        if self._stream is None:
            stack = contextlib.AsyncExitStack()
            try:
                st = await stack.enter_async_context(self.channel.request(INGEST_PATH, Cardinality.STREAM_STREAM, KeyOps, IngestAck, metadata=self.metadata))
                await st.send_request()
            except BaseException as e:
                await _close_quietly(stack)
                if isinstance(e, (StreamTerminatedError, OSError, asyncio.TimeoutError)) or (isinstance(e, GRPCError) and e.status in _TRANSIENT):
                    raise _Lost(str(e)) from e
                raise
            self._stack, self._stream = stack, st
        return self._stream

    async def drop(self) -> None:
        stack, st, self._stack, self._stream = self._stack, self._stream, None, None
        if stack is not None:
            if st is not None:
                # RST_STREAM first: a plain exit would wait for trailers that a stuck unit may
                # never send, and drop() is how a stalled or cancelled send lets go of it.
                with contextlib.suppress(Exception):
                    await st.cancel()
            await _close_quietly(stack)

    async def _terminated(self, e: BaseException) -> NoReturn:
        """The stream was reset: the unit may have sent a final status first (a refused
        credential ends the stream before any ack), which the stream's exit turns into a
        GRPCError; anything else is a lost stream."""
        stack, self._stack, self._stream = self._stack, None, None
        if stack is not None:
            try:
                await stack.__aexit__(type(e), e, e.__traceback__)
            except GRPCError as g:
                if g.status not in _TRANSIENT:
                    raise g from None
            except Exception:  # noqa: BLE001 - whatever else, the stream is gone
                pass
        raise _Lost(str(e)) from e

    @contextlib.asynccontextmanager
    async def _losses(self) -> AsyncIterator[None]:
        """A broken stream (reset, connection gone, timed out, or a transient status) becomes
        _Lost, which the client answers by reconnecting and resending; a final status stays a
        GRPCError."""
        try:
            yield
        except GRPCError as e:
            if e.status in _TRANSIENT:
                raise _Lost(str(e)) from e
            raise
        except StreamTerminatedError as e:
            await self._terminated(e)
        except (ConnectionError, OSError, asyncio.TimeoutError) as e:
            raise _Lost(str(e)) from e

    async def recv(self) -> IngestAck:
        """The next ack; raises _Lost on a broken stream and GRPCError for a final status."""
        st = self._stream
        assert st is not None
        async with self._losses():
            ack = await st.recv_message()
            if ack is None:
                # The unit ended the stream: its trailers say why.
                with contextlib.suppress(StreamTerminatedError):
                    await st.end()
                await st.recv_trailing_metadata()
                raise _Lost("stream ended by the unit")
        return ack

    async def send(self, msg: KeyOps) -> None:
        st = self._stream
        assert st is not None
        async with self._losses():
            await st.send_message(msg)


def _read_outcome(t: asyncio.Task[object]) -> None:
    if not t.cancelled():
        t.exception()


async def _close_quietly(stack: contextlib.AsyncExitStack) -> None:
    # Leaving a half-open stream cancels it (RST_STREAM); whatever the server said last no
    # longer matters to us.
    with contextlib.suppress(Exception):
        await stack.aclose()


class IngestClient(AsyncResource):
    """Streams one worker's key-op batches to the maintenance units.

    ``units`` maps shard -> grpclib Channel (shared: the caller closes it) or ``"host:port"``
    (this client opens and closes the channel). ``on_rejected(shard)`` returns the reset batches
    to send after a sequence error (pass ``agent.on_rejected``); ``token`` is sent as
    ``x-kvcompass-token``; ``ssl_context`` (:meth:`TLSConfig.client_context
    <kvcompass.services.tls.TLSConfig.client_context>`) makes the channels this client opens
    speak TLS.

    Memory is bounded: at most ``window`` batches per unit are sent and not yet acknowledged,
    and :meth:`send` returns only once all of its batches are, so a caller that awaits it (the
    agent runner does) stops reading engine events while a unit is slow.

    A unit unreachable after ``max_attempts``, or that acknowledged nothing for ``give_up_s``
    and then failed, does not stop the others: its shard is left out of sends for ``down_retry_s`` (its
    batches dropped, the shard marked owed), and the first send after that re-reports the shard
    in full (``on_rejected``) before anything else, in one attempt (a probe). A probe that has
    no answer within ``probe_wait_s`` goes on in the background, its shard's batches dropped
    and owed meanwhile, so a hung unit (its port open, nothing answering) holds the other
    shards' sends for at most that long. One unit left down used to end every agent's runner,
    over and over; later a hung one held every shard's updates for 200 s, then 10 s of every 15
    (found in review).
    """

    def __init__(
        self,
        worker: str,
        units: Mapping[int, Channel | str],
        on_rejected: ResendFn,
        *,
        token: str | None = None,
        window: int = 64,
        backoff_s: tuple[float, float] = (0.02, 1.0),
        max_attempts: int = 20,
        max_resets: int = 4,
        ssl_context: ssl.SSLContext | None = None,
        ack_timeout_s: float = 10.0,
        down_retry_s: float = 5.0,
        give_up_s: float = 5.0,
        probe_wait_s: float = 0.5,
    ) -> None:
        if window < 1 or max_attempts < 1 or max_resets < 0:
            raise ValueError("window and max_attempts must be >= 1 and max_resets >= 0")
        if not ack_timeout_s > 0:
            raise ValueError(f"ack_timeout_s must be > 0, got {ack_timeout_s}")
        if not down_retry_s >= 0:
            raise ValueError(f"down_retry_s must be >= 0, got {down_retry_s}")
        if not (give_up_s >= 0 and probe_wait_s >= 0):
            raise ValueError(f"give_up_s and probe_wait_s must be >= 0, got {give_up_s} and {probe_wait_s}")
        self._down_retry = down_retry_s
        self._give_up = give_up_s
        self._probe_wait = probe_wait_s
        self._probing: dict[int, asyncio.Task[tuple[list[int], list[KeyOpBatch]]]] = {}  # shard -> a probe left running
        self._failed: BaseException | None = None  # a final refusal a background probe met
        self._down: dict[int, float] = {}  # shard -> monotonic time before which it is skipped
        self._owed: set[int] = set()  # shards that missed batches: re-reported before the next
        self.last_unreachable: str | None = None
        """Why the last unreachable unit was given up on (also logged)."""
        # An acknowledgement that does not come within this is a lost stream: a unit whose host
        # died or whose network drops packets ends no stream, and send() waited forever (found
        # in review; the agent runner stops reading engine events while it waits).
        self._ack_timeout = ack_timeout_s
        self.worker = worker
        self._on_rejected = on_rejected
        self._window = window
        self._backoff = backoff_s
        self._max_attempts = max_attempts
        self._max_resets = max_resets
        md = {WORKER_HEADER: worker}
        if token is not None:
            md[TOKEN_HEADER] = token
        self._owned = OwnedChannels(ssl_context)
        self._units = {shard: _UnitStream(shard, self._owned.get(target), md) for shard, target in units.items()}
        self.reconnects = 0

    async def send(self, batches: Sequence[KeyOpBatch]) -> SendReport:
        """Deliver ``batches`` (any shards, each shard's in seq order) and wait for every ack.
        Raises IngestRejectedError when a unit refuses one for good. A unit unreachable after
        ``max_attempts`` failed attempts in a row is named in the report's ``unreachable`` (see
        the class notes); the other units' batches are delivered all the same."""
        by_shard: dict[int, list[KeyOpBatch]] = {}
        for b in batches:
            if b.worker != self.worker:
                raise ValueError(f"batch of worker {b.worker!r} given to the client of {self.worker!r}")
            if b.shard not in self._units:
                raise ValueError(f"no maintenance unit configured for shard {b.shard}")
            by_shard.setdefault(b.shard, []).append(b)
        if self._failed is not None:
            e, self._failed = self._failed, None
            raise e
        totals = [0, 0, 0, 0, 0, 0]
        unreachable: set[int] = set()
        probe: set[int] = set()
        while by_shard:
            now = time.monotonic()
            for shard in list(by_shard):
                if self._down.get(shard, 0.0) > now or shard in self._probing:  # down, or its probe still out: owed
                    del by_shard[shard]
                    self._owed.add(shard)
                    unreachable.add(shard)
                elif shard in self._owed:  # back (or to be tried): the re-report goes first
                    # A shard given up on is tried once, not max_attempts times: a unit left
                    # down held every other shard's sends (gathered with it) for the whole
                    # retry ladder, 14 s of every 19 (found in review). One whose unit has
                    # answered since (owed for what was dropped while its probe was out) goes
                    # through the ladder: a probe's short wait made a merely slow unit a loop of
                    # background re-reports, every batch of its shard dropped (review).
                    if shard in self._down:
                        probe.add(shard)
                    fresh = list(self._on_rejected(shard))
                    for b in fresh:
                        if b.shard != shard:
                            by_shard.setdefault(b.shard, []).append(b)
                    mine = [b for b in fresh if b.shard == shard]
                    if mine:
                        by_shard[shard] = mine
                    self._owed.discard(shard)
            shards = sorted(by_shard)
            tasks = {s: asyncio.ensure_future(self._send_unit(self._units[s], by_shard[s], 1 if s in probe else self._max_attempts)) for s in shards}
            try:
                ladders = [t for s, t in tasks.items() if s not in probe]
                if ladders:
                    await asyncio.wait(ladders)
                probes = [t for s, t in tasks.items() if s in probe]
                if probes:
                    await asyncio.wait(probes, timeout=self._probe_wait)
            except BaseException:
                for t in tasks.values():
                    t.cancel()
                    t.add_done_callback(_read_outcome)  # nothing left for a finalizer to log
                raise
            probe.clear()
            by_shard = {}
            # Every ended task's outcome read before any is raised: an exception left unread is
            # logged by the task's finalizer whenever the collector gets to it (found in review:
            # in the middle of a later compile, which CPython 3.11 then failed).
            outcomes = {s: (t.exception() or t.result()) for s, t in tasks.items() if t.done()}
            for shard in shards:
                t = tasks[shard]
                if not t.done():  # a probe with no answer yet: it goes on without holding the rest
                    self._probing[shard] = t
                    t.add_done_callback(functools.partial(self._probe_ended, shard))
                    unreachable.add(shard)
                    continue
                r = outcomes[shard]
                if isinstance(r, ConnectionError):
                    _log.warning("worker %s: %s; its batches wait for a re-report in %g s", self.worker, r, self._down_retry)
                    self.last_unreachable = str(r)
                    self._down[shard] = time.monotonic() + self._down_retry
                    self._owed.add(shard)
                    unreachable.add(shard)
                    continue
                if isinstance(r, BaseException):
                    raise r
                self._down.pop(shard, None)
                counts, extra = r
                totals = [a + b for a, b in zip(totals, counts, strict=True)]
                for b in extra:  # a resend may carry batches of other shards
                    by_shard.setdefault(b.shard, []).append(b)
        n_ok, applied, dups, resets, reconnects, ops = totals
        return SendReport(n_ok, applied, dups, resets, reconnects, unreachable=tuple(sorted(unreachable)), ops=ops)

    def _probe_ended(self, shard: int, t: asyncio.Task[tuple[list[int], list[KeyOpBatch]]]) -> None:
        """A probe left running in the background ended: its unit is back (owed only if batches
        of its shard were dropped meanwhile: the next send re-reports it through the ladder),
        down again, or refused for good (raised by the next send)."""
        self._probing.pop(shard, None)
        if t.cancelled():
            return
        e = t.exception()
        if e is None:
            self._down.pop(shard, None)
            _, extra = t.result()
            for b in extra:  # a re-report of another shard: owed there too
                self._owed.add(b.shard)
        elif isinstance(e, ConnectionError):
            _log.warning("worker %s: %s; its batches wait for a re-report in %g s", self.worker, e, self._down_retry)
            self.last_unreachable = str(e)
            self._down[shard] = time.monotonic() + self._down_retry
            self._owed.add(shard)
        else:
            self._failed = e
            self._owed.add(shard)

    async def _send_unit(self, u: _UnitStream, batches: Sequence[KeyOpBatch], max_attempts: int) -> tuple[list[int], list[KeyOpBatch]]:
        n_ok = applied = dups = resets = reconnects = ops = 0
        extra: list[KeyOpBatch] = []
        todo: deque[KeyOpBatch] = deque(batches)
        inflight: deque[KeyOpBatch] = deque()
        reset_floor = 0  # acks of batches below this seq predate the last reset: ignore them
        failures = 0
        last_ok = time.monotonic()  # the start, then the last acknowledgement
        async with u.lock:
            try:
                while todo or inflight:
                    try:
                        # One deadline for the whole step, sends included: a unit that stops
                        # reading never returns HTTP/2 flow-control credit, and a send waiting
                        # for it had no deadline (found in review: send() hung for good once a
                        # few re-reports had filled the connection's window).
                        try:
                            async with asyncio.timeout(self._ack_timeout):
                                await u.open()
                                while todo and len(inflight) < self._window:
                                    b = todo.popleft()
                                    inflight.append(b)
                                    await u.send(encode_key_ops(b))
                                ack = await u.recv()
                        except TimeoutError:
                            # The connection's window may be spent: start the next attempt on a
                            # fresh connection, not just a fresh stream.
                            self._owned.reset(u.channel)
                            raise _Lost(f"no acknowledgement within {self._ack_timeout:g} s") from None
                    except _Lost as e:
                        await u.drop()
                        failures += 1
                        if failures >= max_attempts or time.monotonic() - last_ok >= self._give_up:
                            raise ConnectionError(f"maintenance unit of shard {u.shard} unreachable after {failures} attempts: {e}") from e
                        reconnects += 1
                        self.reconnects += 1
                        await asyncio.sleep(min(self._backoff[1], self._backoff[0] * 2 ** (failures - 1)))
                        # A reconnect re-reports the shard in full (docs/design.md section 7): the unit
                        # may have restarted from a state saved before what was in flight, or
                        # before batches it had acknowledged, and only a reset makes it exact.
                        fresh = list(self._on_rejected(u.shard))
                        mine = [x for x in fresh if x.shard == u.shard]
                        extra += [x for x in fresh if x.shard != u.shard]
                        if mine:
                            resets += 1
                            todo = deque(mine)
                            reset_floor = min(x.seq for x in mine)
                        else:  # nothing to re-report with: resend what is unacknowledged
                            todo.extendleft(reversed(inflight))
                        inflight.clear()
                        continue
                    except GRPCError as e:
                        await u.drop()
                        b0 = inflight[0] if inflight else None
                        raise _rejected(u.shard, b0.seq if b0 else 0, e.status, None, e.message or "") from None
                    failures = 0
                    last_ok = time.monotonic()
                    b = inflight.popleft()
                    if ack.code == 0:
                        n_ok += 1
                        ops += len(b.keys)
                        applied += ack.applied
                        dups += int(ack.duplicate)
                        continue
                    status = Status(ack.code)
                    if b.seq < reset_floor:
                        continue  # sent before the reset went out: superseded by it
                    if error_class(ack.reason, status) is AgentSequenceError:  # a gap: re-report, not a refusal
                        resets += 1
                        if resets > self._max_resets:
                            raise _rejected(u.shard, b.seq, status, ack.reason, f"{ack.message} (still refused after {self._max_resets} resets)")
                        fresh = list(self._on_rejected(u.shard))
                        mine = [x for x in fresh if x.shard == u.shard]
                        extra += [x for x in fresh if x.shard != u.shard]
                        if not mine:
                            # Nothing to re-report the shard with: the refused batch and those
                            # behind it would be dropped while send() returned (found in review).
                            raise _rejected(u.shard, b.seq, status, ack.reason, f"{ack.message} (and no re-report of shard {u.shard} was given to repair it)")
                        todo = deque(mine)
                        reset_floor = min(x.seq for x in mine)
                        continue
                    raise _rejected(u.shard, b.seq, status, ack.reason, ack.message)
            except BaseException:
                # Unread acks would be taken for the next send's: start that one on a fresh stream.
                if inflight:
                    await u.drop()
                raise
        return [n_ok, applied, dups, resets, reconnects, ops], extra

    async def close(self) -> None:
        """End every stream and close the channels this client opened."""
        for t in list(self._probing.values()):
            t.cancel()
            with contextlib.suppress(BaseException):
                await t
        for u in self._units.values():
            async with u.lock:
                await u.drop()
        self._owned.close()

