"""The door's HTTP/1.1 client toward workers and peer doors: keep-alive connections per host,
responses parsed by ``httptools`` (llhttp, the parser uvicorn uses).

Why not aiohttp's client: in front of an instant backend on this project's 2-core host a bare
aiohttp proxy (its server and its client, no routing) spent 0.15-0.19 ms of CPU a request,
and the same aiohttp server with this client 0.072-0.078 ms (``docs/services.md``, nineteenth
session): the client's request and response objects, tracing hooks, cookie and timeout
machinery were half of the door's CPU. The door needs far less: POST a body it already holds,
read a head, then a body whole or as it streams, on connections it reuses.

What it keeps of a client's duties: a total connection limit (0 = none), a connect deadline,
a per-read deadline, keep-alive with an idle limit, TLS for ``https://`` hosts, flow control (a
stream the door relays slower than the worker writes pauses the socket), and one retry on a
fresh connection when a reused one turns out closed before any byte of the answer arrived
(the worker closed an idle connection as the request went out; nothing was processed).
Header values with CR or LF are refused (no request smuggling through forwarded headers).
"""

from __future__ import annotations

import asyncio
import functools
import ssl as _ssl
import time
from collections.abc import AsyncIterator, Callable, Mapping
from urllib.parse import urlsplit

import httptools
from multidict import CIMultiDict, CIMultiDictProxy

__all__ = ["UpstreamAbandoned", "UpstreamBusy", "UpstreamConnectError", "UpstreamConnectTimeout", "UpstreamDisconnected", "UpstreamError", "UpstreamPool", "UpstreamResponse", "UpstreamTooLarge"]

_HIGH_WATER = 256 * 1024  # buffered body bytes at which the socket stops being read
_MAX_HEAD = 64 * 1024  # bytes of an answer's head (status line and headers) before it is refused


class UpstreamError(Exception):
    """A worker (or peer door) could not be asked, or its answer did not arrive whole."""


class UpstreamConnectError(UpstreamError):
    """No connection could be opened (refused, unreachable, TLS failure)."""


class UpstreamConnectTimeout(UpstreamConnectError, TimeoutError):
    """No connection within the connect deadline: a connect failure (the worker unreachable),
    and a timeout for callers that only ask that (found in review: a plain TimeoutError here
    read as a slow answer to the door, which then gave up instead of trying another worker)."""


class UpstreamAbandoned(UpstreamError):
    """The caller stopped waiting for the answer's head (:meth:`UpstreamResponse.abandon`: its
    watch found the worker gone); the connection is closed."""


class UpstreamDisconnected(UpstreamError):
    """The connection closed, or the answer was not HTTP, before the answer was complete."""


class UpstreamBusy(UpstreamError):
    """No connection slot of the pool's limit came free before the head deadline: the pool is
    busy (its limit is for every worker at once), which says nothing of the worker asked."""


class UpstreamTooLarge(UpstreamError):
    """A whole answer was larger than the reader's limit (the connection is then closed)."""


@functools.lru_cache(maxsize=4096)
def _target(url: str) -> tuple[str, int, bool, bytes, bytes]:
    """(host, port, tls, request target, Host header) of ``url``; the door's URLs are a few
    per worker, so each is parsed once."""
    u = urlsplit(url)
    if u.scheme not in ("http", "https") or not u.hostname:
        raise ValueError(f"upstream URL must be http(s)://host[:port]/path, got {url!r}")
    tls = u.scheme == "https"
    port = u.port or (443 if tls else 80)
    path = (u.path or "/") + (f"?{u.query}" if u.query else "")
    return u.hostname, port, tls, path.encode("latin-1"), u.netloc.encode("latin-1")


class _Conn(asyncio.Protocol):
    """One keep-alive connection; at most one exchange at a time."""

    __slots__ = ("transport", "parser", "resp", "closed", "idle_since", "key", "reused", "head_bytes")

    def __init__(self, key: tuple[str, int, bool]) -> None:
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.resp: UpstreamResponse | None = None
        self.closed = False
        self.idle_since = 0.0
        self.key = key
        self.reused = False
        self.head_bytes = 0

    # -- asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's is no asyncio.Transport subclass

    def data_received(self, data: bytes) -> None:
        r = self.resp
        if r is None:  # bytes nobody asked for: the connection cannot be trusted any more
            self.abort()
            return
        r._got_bytes = True
        try:
            if not r._head_waiter.done():
                # The head is bounded by the bytes that carry it: httptools collects a header
                # value until it ends (growing it by copying), so a limit checked per header let
                # one endless value take the door's memory and loop (found in review). Only the
                # bytes up to the limit are parsed while the head is incomplete.
                room = _MAX_HEAD - self.head_bytes
                if len(data) > room:
                    self.parser.feed_data(data[:room])
                    self.head_bytes = _MAX_HEAD
                    if not r._head_waiter.done():
                        r._fail(UpstreamDisconnected(f"the answer's head exceeds {_MAX_HEAD} bytes"))
                        self.abort()
                        return
                    data = data[room:]
                    if self.closed:
                        return
                else:
                    self.head_bytes += len(data)
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            r._fail(UpstreamDisconnected("the worker switched protocols"))
            self.abort()
        except httptools.HttpParserError as e:
            r._fail(UpstreamDisconnected(f"the answer is not HTTP/1.1: {e}"))
            self.abort()

    def eof_received(self) -> bool | None:
        # A close-delimited body (no Content-Length, no chunking: HTTP/1.0-style servers) ends
        # here; llhttp cannot know it ended (httptools exposes no finish), so the head says so.
        r = self.resp
        if r is not None and r._until_eof and not r._done:
            r._finish()
        return None

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        r = self.resp
        if r is not None and not r._done:
            r._fail(UpstreamDisconnected(f"the connection closed before the answer was complete{f': {exc!r}' if exc else ''}"))

    def pause_writing(self) -> None:  # the request bodies are small; nothing to pause
        pass

    def resume_writing(self) -> None:
        pass

    # -- httptools callbacks
    def on_message_begin(self) -> None:
        r = self.resp
        if r is not None and r._done:
            # A second answer on one request (a confused worker or a proxy before it): it would
            # otherwise be read into this answer, or into the next request's on a reused
            # connection, another client's (found in review). The answer already whole stands;
            # the connection is not trusted again.
            self.abort()

    def on_header(self, name: bytes, value: bytes) -> None:
        r = self.resp
        assert r is not None
        if r._done:
            return
        r._raw_headers.append((name.decode("latin-1"), value.decode("latin-1")))

    def on_headers_complete(self) -> None:
        r = self.resp
        assert r is not None
        if r._done:
            return  # refused while its head arrived, or a stray answer after it
        r.status = self.parser.get_status_code()
        if r.status < 200:  # 1xx: the real head follows (httptools parses it as a new message)
            r._raw_headers.clear()
            return
        r.headers = h = CIMultiDictProxy(CIMultiDict(r._raw_headers))
        r.keep_alive = bool(self.parser.should_keep_alive())
        # Without a length and without chunking last, the body runs to the close (RFC 9112 6.3;
        # "Transfer-Encoding: gzip" alone is close-delimited too, and was taken for broken).
        r._until_eof = "content-length" not in h and not h.get("transfer-encoding", "").lower().rstrip().endswith("chunked") and r.status not in (204, 304)
        r._head_done()

    def on_body(self, body: bytes) -> None:
        r = self.resp
        assert r is not None
        if not r._done:
            r._feed(body)

    def on_message_complete(self) -> None:
        r = self.resp
        if r is not None and r.status >= 200:
            r._finish()

    def abort(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.abort()


class UpstreamResponse:
    """An answer whose head has arrived; the body is read with :meth:`read` or
    :meth:`iter_chunks` (chunked transfer coding already removed). :meth:`release` (or
    :meth:`close`) must follow; a connection goes back to the pool only once its answer was
    read to the end and both sides keep it alive."""

    __slots__ = ("status", "headers", "keep_alive", "_raw_headers", "_chunks", "_buffered", "_done", "_error", "_waiter", "_conn", "_pool", "_released", "_got_bytes", "_read_timeout", "_paused", "_head_waiter", "_until_eof")

    def __init__(self, conn: _Conn, pool: UpstreamPool, read_timeout: float | None) -> None:
        self.status = 0
        self.headers: CIMultiDictProxy[str] = _NO_HEADERS
        self.keep_alive = False
        self._raw_headers: list[tuple[str, str]] = []
        self._chunks: list[bytes] = []
        self._buffered = 0
        self._done = False
        self._error: UpstreamError | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._conn = conn
        self._pool = pool
        self._released = False
        self._got_bytes = False
        self._read_timeout = read_timeout
        self._paused = False
        self._until_eof = False
        self._head_waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    # -- fed by the connection
    def _wake(self) -> None:
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    def _head_done(self) -> None:
        if not self._head_waiter.done():
            self._head_waiter.set_result(None)

    def abandon(self, reason: str) -> None:
        """Stop waiting: for the head (the post raises :class:`UpstreamAbandoned`) or, once it
        came, for the rest of the body (reading it raises it, and the connection is closed, so
        the server sees its client go: an engine aborts the request). Nothing once the body is
        complete. Why not cancel the waiting task: a cancellation cannot be told from the
        server's own (a drain) and races the head's arrival (found in review)."""
        if not self._head_waiter.done():
            self._head_waiter.set_exception(UpstreamAbandoned(reason))
        elif not self._done:
            self._fail(UpstreamAbandoned(reason))
            self._conn.abort()

    def _head_late(self, seconds: float | None) -> None:
        """The head deadline passed (a timer of :meth:`UpstreamPool._exchange`)."""
        if not self._head_waiter.done():
            self._head_waiter.set_exception(TimeoutError(f"no answer head within {seconds:g} s of the request"))

    def _feed(self, data: bytes) -> None:
        self._chunks.append(data)
        self._buffered += len(data)
        if self._buffered > _HIGH_WATER and not self._paused and self._conn.transport is not None:
            self._paused = True
            self._conn.transport.pause_reading()
        self._wake()

    def _finish(self) -> None:
        self._done = True
        self._wake()

    def _fail(self, e: UpstreamError) -> None:
        if self._done:
            return
        self._error = e
        self._done = True
        if not self._head_waiter.done():
            self._head_waiter.set_exception(e)
        self._wake()

    async def _wait(self) -> None:
        self._waiter = asyncio.get_running_loop().create_future()
        try:
            async with asyncio.timeout(self._read_timeout):
                await self._waiter
        finally:
            self._waiter = None

    def _take(self) -> bytes:
        data = self._chunks[0] if len(self._chunks) == 1 else b"".join(self._chunks)
        self._chunks.clear()
        self._buffered = 0
        if self._paused and self._conn.transport is not None and not self._conn.closed:
            self._paused = False
            self._conn.transport.resume_reading()
        return data

    # -- the caller's side
    def at_eof(self) -> bool:
        """The whole answer arrived and was handed out."""
        return self._done and self._error is None and not self._chunks

    async def read(self, limit: int | None = None) -> bytes:
        """The rest of the body, whole. Raises :class:`UpstreamDisconnected`, TimeoutError (no
        byte for the read deadline) or, past ``limit`` bytes, :class:`UpstreamTooLarge`.

        The pieces are taken as they come, so the socket, paused past a quarter MiB buffered,
        is read on (waiting for the end with it paused would wait for the read deadline)."""
        parts: list[bytes] = []
        size = 0
        while True:
            if self._chunks:
                data = self._take()
                size += len(data)
                if limit is not None and size > limit:
                    raise UpstreamTooLarge(f"the answer's body exceeds {limit} bytes")
                parts.append(data)
                continue
            if self._done:
                break
            await self._wait()
        if self._error is not None:
            raise self._error
        return parts[0] if len(parts) == 1 else b"".join(parts)

    async def iter_chunks(self) -> AsyncIterator[bytes]:
        """The body as it arrives, in the pieces the socket delivered them."""
        while True:
            if self._chunks:
                yield self._take()
                continue
            if self._done:
                if self._error is not None:
                    raise self._error
                return
            await self._wait()

    def release(self) -> None:
        """Done with the answer: its connection is reused if it can be, closed otherwise."""
        if self._released:
            return
        self._released = True
        conn = self._conn
        conn.resp = None
        if self.at_eof() and self.keep_alive and not conn.closed:
            self._pool._put(conn)
        else:
            conn.abort()
        self._pool._free_slot()

    def close(self) -> None:
        """Done with the answer, whatever is left of it: the connection is closed."""
        if not self._released:
            self._conn.abort()
        self.release()


_NO_HEADERS: CIMultiDictProxy[str] = CIMultiDictProxy(CIMultiDict())


class UpstreamPool:
    """Keep-alive connections per (host, port, TLS), shared by every request of one door."""

    def __init__(self, *, limit: int = 0, connect_timeout_s: float | None = None, read_timeout_s: float | None = None, keepalive_s: float = 30.0, ssl: _ssl.SSLContext | None = None) -> None:
        if limit < 0:
            raise ValueError(f"limit must be >= 0, got {limit}")
        self._free: dict[tuple[str, int, bool], list[_Conn]] = {}
        self._slots = asyncio.Semaphore(limit) if limit else None
        self._connect_timeout = connect_timeout_s
        self._read_timeout = read_timeout_s
        self._keepalive = keepalive_s
        self._ssl = ssl
        self._closed = False

    async def post(self, url: str, body: bytes, headers: Mapping[str, str], *, head_timeout: float | None = None, method: bytes = b"POST", slot_timeout: float | None = None, on_exchange: Callable[[UpstreamResponse], None] | None = None) -> UpstreamResponse:
        """POST ``body`` to ``url`` with ``headers`` (Host and Content-Length are added; ``method``
        another verb, e.g. ``b"GET"`` with an empty body for a health probe); returns
        once the answer's head arrived. Raises :class:`UpstreamConnectError`,
        :class:`UpstreamDisconnected`, TimeoutError (the connect deadline, or ``head_timeout``
        seconds from this call without a whole head: waiting for a slot, connecting and the
        answer all count), :class:`UpstreamBusy` (no slot of ``limit`` in that time) or
        ValueError (a header with CR or LF, a URL that is not http(s)). ``slot_timeout``, when
        shorter, bounds the wait for a slot alone (a whole answer may take far longer than a slot
        should). ``on_exchange`` is handed the answer being waited for once the request is
        sent (to :meth:`UpstreamResponse.abandon` it).

        Why the head deadline is here and not an ``asyncio.timeout`` around the call: it is one
        timer handle on the exchange, cancelled when the head arrives, where the context manager
        cost a task lookup, a handle and its bookkeeping per request (a few per cent of the
        door's CPU, py-spy)."""
        if self._closed:
            raise UpstreamConnectError("the upstream pool is closed")
        host, port, tls, path, hosthdr = _target(url)
        block = "".join([f"{k}: {v}\r\n" for k, v in headers.items()])
        if block.count("\n") != len(headers) or block.count("\r") != len(headers):
            raise ValueError("a header name or value holds CR or LF")
        head = b"%s %s HTTP/1.1\r\nHost: %s\r\nContent-Length: %d\r\n%s\r\n" % (method, path, hosthdr, len(body), block.encode("latin-1"))
        deadline = None if head_timeout is None else asyncio.get_running_loop().time() + head_timeout
        if self._slots is not None:
            if deadline is None or not self._slots.locked():
                await self._slots.acquire()
            else:
                wait = head_timeout if slot_timeout is None or head_timeout is None else min(head_timeout, slot_timeout)
                try:
                    async with asyncio.timeout(wait):
                        await self._slots.acquire()
                except TimeoutError:
                    raise UpstreamBusy(f"no connection slot to {host}:{port} within {wait} s") from None
        try:
            key = (host, port, tls)
            conn = self._take(key)
            if conn is not None:
                try:
                    return await self._exchange(conn, head, body, deadline, head_timeout, on_exchange)
                except UpstreamDisconnected:
                    if conn.resp is not None and conn.resp._got_bytes:
                        raise
                    # A reused connection the worker had closed: once more on a fresh one.
            return await self._exchange(await self._connect(key, deadline), head, body, deadline, head_timeout, on_exchange)
        except BaseException:
            self._free_slot()
            raise

    async def close(self) -> None:
        """Close every idle connection; answers in flight keep theirs until released."""
        self._closed = True
        for conns in self._free.values():
            for c in conns:
                c.abort()
        self._free.clear()

    # -- internals
    def _take(self, key: tuple[str, int, bool]) -> _Conn | None:
        free = self._free.get(key)
        now = time.monotonic()
        while free:
            c = free.pop()
            if not c.closed and now - c.idle_since < self._keepalive:
                c.reused = True
                return c
            c.abort()
        return None

    def _put(self, conn: _Conn) -> None:
        if self._closed:
            conn.abort()
            return
        conn.idle_since = time.monotonic()
        self._free.setdefault(conn.key, []).append(conn)

    def _free_slot(self) -> None:
        if self._slots is not None:
            self._slots.release()

    async def _connect(self, key: tuple[str, int, bool], deadline: float | None = None) -> _Conn:
        host, port, tls = key
        ctx = (self._ssl or _default_tls()) if tls else None
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        until = None if self._connect_timeout is None else t0 + self._connect_timeout
        if deadline is not None and (until is None or deadline < until):
            until = deadline  # the head's deadline comes first: the error below names the connect
        try:
            async with asyncio.timeout_at(until):
                _, conn = await loop.create_connection(lambda: _Conn(key), host, port, ssl=ctx, server_hostname=host if ctx is not None else None)
        except TimeoutError:
            raise UpstreamConnectTimeout(f"connecting to {host}:{port} took longer than {(until or t0) - t0:.3g} s") from None
        except (OSError, _ssl.SSLError) as e:
            raise UpstreamConnectError(f"cannot connect to {host}:{port}: {e}") from None
        return conn

    async def _exchange(
        self, conn: _Conn, head: bytes, body: bytes, deadline: float | None = None, seconds: float | None = None, on_exchange: Callable[[UpstreamResponse], None] | None = None
    ) -> UpstreamResponse:
        resp = UpstreamResponse(conn, self, self._read_timeout)
        if on_exchange is not None:
            on_exchange(resp)
        conn.resp = resp
        conn.head_bytes = 0
        assert conn.transport is not None
        if conn.closed:
            resp._fail(UpstreamDisconnected("the connection was closed"))
        elif resp._head_waiter.done():
            pass  # abandoned by on_exchange (its client gone, its server silent): nothing is sent
        else:
            conn.transport.write(head + body if len(body) < 65536 else head)
            if len(body) >= 65536:
                conn.transport.write(body)
        timer = None
        if deadline is not None and not resp._head_waiter.done():
            timer = asyncio.get_running_loop().call_at(deadline, resp._head_late, seconds)
        try:
            await resp._head_waiter
        except BaseException:
            conn.resp = resp  # keep for the caller's retry check (bytes arrived or not)
            conn.abort()
            raise
        finally:
            if timer is not None:
                timer.cancel()
        return resp


@functools.lru_cache(maxsize=1)
def _default_tls() -> _ssl.SSLContext:
    return _ssl.create_default_context()
