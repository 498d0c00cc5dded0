"""gRPC servers and channels, drained and closed the same way by every service: a server that
closes its accepted connections when it stops (so clients notice and reconnect, to a successor
on the same port), and the channels a service opened itself, closed when it closes."""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import ssl
import weakref
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

from grpclib.client import Channel
from grpclib.const import Cardinality, Handler, Status
from grpclib.events import SendTrailingMetadata, listen
from grpclib.exceptions import StreamTerminatedError
from grpclib.protocol import H2Protocol
from h2.exceptions import StreamClosedError  # what grpclib raises, from its own HTTP/2 library
from grpclib.server import Server

from kvcompass.errors import InvalidArgumentError
from kvcompass.services.codec import REQUEST_TIMEOUT_S, StrictProtoCodec, install_receive_limit
from kvcompass.services.conn_guard import ConnGuard
from kvcompass.services.lifecycle import hostport
from kvcompass.services.lifecycle import bind_socket
from kvcompass.services.metrics import ServiceMetrics
from kvcompass.services.status import grpc_error
from kvcompass.services.tls import grpc_channel

__all__ = ["DrainingServer", "OwnedChannels"]


MAX_CONNECTIONS_PER_ADDRESS = 1024
"""Connections one client address may hold to a gRPC listener (loopback exempt)."""


def _is_loopback(host: str) -> bool:
    try:
        addr = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return False
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        return addr.ipv4_mapped.is_loopback
    return addr.is_loopback


class DrainingServer(Server):
    """A grpclib Server that can also close its accepted connections.

    ``Server.close`` stops listening and cancels handlers but leaves established HTTP/2
    connections open, and they keep accepting new streams; a client would then never notice
    the drain (nor reach a successor on the same port). :meth:`shut` closes them too, so every
    client sees the connection drop and reconnects. Malformed request bytes are
    INVALID_ARGUMENT, never UNKNOWN, and a message larger than its type's limit is
    RESOURCE_EXHAUSTED before it is read (:mod:`kvcompass.services.codec`).
    """

    def __init__(
        self,
        handlers: Sequence[Any],
        metrics: ServiceMetrics | None = None,
        limits: Mapping[type, int] | None = None,
        *,
        request_timeout_s: float = REQUEST_TIMEOUT_S,
        max_connections_per_address: int | None = MAX_CONNECTIONS_PER_ADDRESS,
        cap_loopback: bool = False,
    ) -> None:
        install_receive_limit()
        _quiet_ended_calls()
        super().__init__(handlers, codec=StrictProtoCodec(limits))
        # Connections held per client address, counted as the HTTP listeners count them (found
        # in review: the door had a cap and the gRPC listeners none). Loopback is exempt by
        # default: a `kvcompass up` cluster connects every process from 127.0.0.1. The guard's
        # head deadline is this listener's request deadline.
        self._guard_of = None if max_connections_per_address is None else ConnGuard(max_connections_per_address, request_timeout_s)
        self._cap_loopback = cap_loopback
        # Every call with one request message (ours, betterproto's generated ones, grpclib's
        # Health) waits for it at most request_timeout_s: a client sending headers alone held a
        # handler forever, as many as it opened calls (found in review). Streams of requests
        # (an agent's Ingest) may rest between messages and are left as they are.
        self._mapping = {
            path: Handler(_request_deadline(h.func, request_timeout_s), h.cardinality, h.request_type, h.reply_type) if h.cardinality in (Cardinality.UNARY_UNARY, Cardinality.UNARY_STREAM) else h
            for path, h in self._mapping.items()
        }
        self._protocols: weakref.WeakSet[H2Protocol] = weakref.WeakSet()
        if metrics is not None:
            m = metrics

            async def count(ev: SendTrailingMetadata) -> None:
                if ev.status is not Status.OK:
                    m.rpc_error(ev.status.name)

            listen(self, SendTrailingMetadata, count)

    @classmethod
    async def listen(
        cls, handlers: Sequence[Any], host: str, port: int, *, metrics: ServiceMetrics | None = None, limits: Mapping[type, int] | None = None, ssl_context: ssl.SSLContext | None = None
    ) -> tuple[DrainingServer, str]:
        """A server for ``handlers`` listening on ``host:port`` (0: a free port; over TLS with
        ``ssl_context``), and the ``host:port`` it bound."""
        sock = bind_socket(host, port)
        bound = int(sock.getsockname()[1])
        server = cls(handlers, metrics, limits)
        try:
            await server.start(sock=sock, ssl=ssl_context)
        except BaseException:
            sock.close()
            raise
        return server, hostport(host, bound)

    def _protocol_factory(self) -> H2Protocol:
        proto = super()._protocol_factory()
        self._protocols.add(proto)
        if self._guard_of is not None:
            self._guard(proto, self._guard_of)
        return proto

    @property
    def refused_connections(self) -> int:
        """Connections refused because their address held the cap."""
        return 0 if self._guard_of is None else self._guard_of.refused

    def _guard(self, proto: H2Protocol, guard: ConnGuard) -> None:
        """Count ``proto``'s connection against its address, refusing it (closed at once) past
        the cap."""
        made, lost, received = proto.connection_made, proto.connection_lost, proto.data_received
        state: dict[str, Any] = {}

        def connection_made(transport: Any) -> None:
            peer = transport.get_extra_info("peername")
            host = str(peer[0]) if isinstance(peer, tuple) and peer else None
            if host is not None and (self._cap_loopback or not _is_loopback(host)):
                if not guard.admit(host):
                    state["refused"] = True
                    transport.abort()
                    return
                state["host"] = host
            made(transport)

        def connection_lost(exc: BaseException | None) -> None:
            if state.get("refused"):
                return
            host = state.pop("host", None)
            if host is not None:
                guard.release(host)
            lost(exc)

        def data_received(data: bytes) -> None:
            if not state.get("refused"):
                received(data)

        proto.connection_made = connection_made  # type: ignore[method-assign]
        proto.connection_lost = connection_lost  # type: ignore[method-assign]
        proto.data_received = data_received  # type: ignore[method-assign]

    def close_connections(self) -> None:
        for proto in list(self._protocols):
            processor = getattr(proto, "processor", None)  # absent until the connection is made
            if processor is not None:
                processor.close("server shut down")

    async def shut(self) -> None:
        """Stop listening, close every accepted connection, and wait until all are gone."""
        self.close()
        self.close_connections()
        await self.wait_closed()


class _EndedCallFilter(logging.Filter):
    """grpclib logs a traceback ("Failed to handle cancellation") when a call's deadline fires
    as its client gives up on it: the handler then ends with the client's stream reset, not the
    cancellation it expected. Nothing failed but the call (its client's timeout; an edge busy
    relaying streams answers an ``ExchangeQueues`` late), and the tracebacks filled the edges'
    logs (found in review): logged as one INFO line instead."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if record.msg == "Failed to handle cancellation" and isinstance(exc, (StreamTerminatedError, StreamClosedError)):
            record.msg, record.args = "call ended by its client as its deadline fired: %s", (exc,)
            record.levelno, record.levelname = logging.INFO, "INFO"
            record.exc_info = record.exc_text = None
        return True


_ENDED_CALLS = _EndedCallFilter()


def _quiet_ended_calls() -> None:
    logger = logging.getLogger("grpclib.server")
    if _ENDED_CALLS not in logger.filters:
        logger.addFilter(_ENDED_CALLS)


def _request_deadline(func: Callable[[Any], Awaitable[None]], timeout_s: float = REQUEST_TIMEOUT_S) -> Callable[[Any], Awaitable[None]]:
    """``func`` with its stream's first ``recv_message`` bounded by ``timeout_s``
    (INVALID_ARGUMENT past it)."""

    async def handler(stream: Any) -> None:
        recv = stream.recv_message

        async def first() -> Any:
            stream.recv_message = recv
            try:
                return await asyncio.wait_for(recv(), timeout_s)
            except asyncio.TimeoutError:
                raise grpc_error(InvalidArgumentError(f"no request message within {timeout_s:g} s of the call's headers")) from None

        stream.recv_message = first
        await func(stream)

    return handler


class OwnedChannels:
    """gRPC channels by key: a ``host:port`` target is opened here (over TLS with
    ``ssl_context``) and closed by :meth:`close`; a :class:`Channel` given instead (tests, an
    in-process server) is the caller's and left open."""

    def __init__(self, ssl_context: ssl.SSLContext | None = None) -> None:
        self._ssl = ssl_context
        self._owned: list[Channel] = []

    def get(self, target: str | Channel) -> Channel:
        if not isinstance(target, str):
            return target
        ch = grpc_channel(target, self._ssl)
        self._owned.append(ch)
        return ch

    def reset(self, channel: Channel) -> None:
        """Drop the connection of ``channel`` if it is one of ours (grpclib opens a new one on
        the next call): what a stalled connection needs, whose HTTP/2 window a peer that stopped
        reading never refills. A caller's channel is left as it is."""
        if any(ch is channel for ch in self._owned):
            channel.close()

    def close(self) -> None:
        for ch in self._owned:
            ch.close()
        self._owned.clear()
