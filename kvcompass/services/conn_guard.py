"""Connection limits for an HTTP listener that faces clients: a cap on open connections per
client address, and a deadline for every request head.

Why: aiohttp bounds a request's size and, with the door's ``body_timeout_s``, how long its body
may take, but it keeps a connection that trickles its first request's headers (slowloris) open
as long as bytes arrive, and it accepts any number of them from one address; 200 such
connections held a door's file descriptors and memory until the attacker stopped.

How: :class:`ConnGuard` wraps the listener's protocol factory (:class:`GuardedSite` is an aiohttp
``SockSite`` that installs it). A connection from an address already at its cap is answered
``503`` and closed before the application sees it. Every other one gets a timer; the first
request that reaches the application (``mark(request)``, called from the door's middleware)
stops it, and a connection whose first head has not arrived when it fires is closed. On a
kept-alive connection the deadline starts again with the first byte that arrives after a
request's handler finished (``done(request)``, from the same middleware): the next head must
be whole within ``header_timeout_s`` of its first byte. An idle kept-alive connection (no
bytes) is left to aiohttp's keep-alive timeout, so a client's connection pool is not cut
while it waits; a client trickling its second head is, as its first would have been.
"""

from __future__ import annotations

import asyncio
import ssl
import weakref
from collections import Counter
from typing import Any, Callable

from aiohttp import web

__all__ = ["ConnGuard", "GuardedSite"]

_REFUSED = b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\nConnection: close\r\nRetry-After: 1\r\n\r\n"


class ConnGuard:
    """The limits and their counters (``refused``: connections over an address's cap;
    ``timed_out``: connections closed before a request head was whole)."""

    def __init__(self, max_per_address: int, header_timeout_s: float) -> None:
        if max_per_address < 1:
            raise ValueError(f"max_per_address must be >= 1, got {max_per_address}")
        if not header_timeout_s > 0:
            raise ValueError(f"header_timeout_s must be > 0, got {header_timeout_s}")
        self.max_per_address = max_per_address
        self.header_timeout_s = header_timeout_s
        self.open: Counter[str] = Counter()
        self.refused = 0
        self.timed_out = 0
        self._waiting: weakref.WeakKeyDictionary[Any, asyncio.TimerHandle] = weakref.WeakKeyDictionary()
        self._conns: weakref.WeakKeyDictionary[Any, _Guarded] = weakref.WeakKeyDictionary()

    def factory(self, inner: Callable[[], asyncio.Protocol]) -> Callable[[], asyncio.Protocol]:
        return lambda: _Guarded(self, inner)

    def mark(self, request: web.Request) -> None:
        """A request head arrived on this connection: its deadline no longer applies."""
        transport = request.transport
        if transport is not None:
            handle = self._waiting.pop(transport, None)
            if handle is not None:
                handle.cancel()

    def done(self, request: web.Request) -> None:
        """This connection's request was handled: the next bytes on it start the next head's
        deadline."""
        transport = request.transport
        conn = self._conns.get(transport) if transport is not None else None
        if conn is not None:
            conn.between = True

    def _arm(self, transport: asyncio.BaseTransport) -> None:
        loop = asyncio.get_running_loop()
        self._waiting[transport] = loop.call_later(self.header_timeout_s, self._expire, transport)

    def _expire(self, transport: asyncio.BaseTransport) -> None:
        if self._waiting.pop(transport, None) is not None and not transport.is_closing():
            self.timed_out += 1
            if isinstance(transport, asyncio.WriteTransport):
                transport.abort()  # no lingering: the client sent nothing worth a reply
            else:
                transport.close()

    def _disarm(self, transport: asyncio.BaseTransport) -> None:
        handle = self._waiting.pop(transport, None)
        if handle is not None:
            handle.cancel()


class _Guarded(asyncio.Protocol):
    """The application's protocol behind the limits (created only for an admitted connection)."""

    def __init__(self, guard: ConnGuard, inner: Callable[[], asyncio.Protocol]) -> None:
        self._guard = guard
        self._make = inner
        self._inner: asyncio.Protocol | None = None
        self._addr: str | None = None
        self._transport: asyncio.BaseTransport | None = None
        self.between = False
        """A request was handled and the next has not sent a byte yet."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        g = self._guard
        peer = transport.get_extra_info("peername")
        addr = str(peer[0]) if isinstance(peer, (tuple, list)) and peer else "?"
        if g.open[addr] >= g.max_per_address:
            g.refused += 1
            if isinstance(transport, asyncio.WriteTransport):
                transport.write(_REFUSED)
            transport.close()
            return
        g.open[addr] += 1
        self._addr, self._transport = addr, transport
        self._inner = self._make()
        self._inner.connection_made(transport)
        g._conns[transport] = self
        g._arm(transport)

    def connection_lost(self, exc: Exception | None) -> None:
        g = self._guard
        if self._addr is not None:
            g.open[self._addr] -= 1
            if g.open[self._addr] <= 0:
                del g.open[self._addr]
        if self._transport is not None:
            g._disarm(self._transport)
        if self._inner is not None:
            self._inner.connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self.between and self._transport is not None:
            self.between = False
            self._guard._arm(self._transport)  # the next head's first bytes: its deadline starts
        if self._inner is not None:
            self._inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self._inner.eof_received() if self._inner is not None else None

    def pause_writing(self) -> None:
        if self._inner is not None:
            self._inner.pause_writing()

    def resume_writing(self) -> None:
        if self._inner is not None:
            self._inner.resume_writing()


class GuardedSite(web.SockSite):
    """``web.SockSite`` whose connections go through ``guard`` first."""

    def __init__(self, runner: web.BaseRunner, sock: Any, guard: ConnGuard, *, ssl_context: ssl.SSLContext | None = None) -> None:
        super().__init__(runner, sock, ssl_context=ssl_context)
        self._guard = guard

    async def start(self) -> None:
        await web.BaseSite.start(self)  # registers the site (SockSite.start would bind unguarded)
        server = self._runner.server
        assert server is not None
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(self._guard.factory(server), sock=self._sock, ssl=self._ssl_context, backlog=self._backlog)
