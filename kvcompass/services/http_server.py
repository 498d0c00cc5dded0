"""The HTTP/1.1 server of the OpenAI surface (the door and the emulated worker): an asyncio
protocol around ``httptools`` (llhttp, the parser uvicorn and the door's upstream client use),
a route table, and request and response objects shaped like the few parts of aiohttp's the
handlers use.

Why not aiohttp's server: in front of an instant backend the door's whole budget is about
0.2 ms of CPU a request (issue 15: within 1.5x of sglang-router's), and aiohttp's request
parsing, handler chain and response writing were the largest share of the door's profile once
its client was replaced (docs/services.md, twentieth session). With this server the door spends
0.13-0.20 ms a request (docs/services.md, twenty-second session). What a front door needs of a server is
small and is all here:

* keep-alive and pipelining (requests on a connection answered in order), ``Connection:
  close`` and HTTP/1.0, ``Expect: 100-continue`` (answered when the handler reads the body),
  HEAD for GET routes;
* a handler started once a head is whole; its body read with :meth:`Request.read` (bounded by
  ``max_body_bytes``: :class:`~kvcompass.errors.MessageTooLargeError`), so a handler refuses a
  request (401, 413) before the body arrives;
* responses whole (``Content-Length``) or streamed (chunked; flow control: a writer waits while
  the client's socket is full), a ``Date`` header, CR/LF refused in header values;
* the limits a client-facing listener needs (:class:`~kvcompass.services.conn_guard.ConnGuard`):
  at most N connections per client address (over it: ``503`` and close), a deadline for every
  request head from its first byte (slowloris), heads at most ``max_head_bytes`` (``431``),
  malformed requests answered ``400`` and closed, and an idle keep-alive limit;
* a handler's :class:`~kvcompass.services.openai_api.OpenAIError` (or a
  :class:`~kvcompass.errors.KVCompassError`, through the one HTTP table) answered with OpenAI's
  error body, as are the server's own 404/405/413; anything else is a logged 500;
* :meth:`HttpServer.close`: stop accepting, let handlers in flight finish (up to a timeout),
  then close every connection.

A handler is not cancelled when its client disconnects (aiohttp's default as well): it notices
when it writes (``ConnectionResetError``), so the door's relay closes the upstream stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import email.utils
import http
import json
import logging
import socket
import ssl
import time
import urllib.parse
from collections import deque
from collections.abc import Awaitable, Callable, Iterator, Mapping
from typing import Any

import httptools

from kvcompass.errors import InvalidArgumentError, KVCompassError, MessageTooLargeError
from kvcompass.services.conn_guard import ConnGuard
from kvcompass.services.openai_api import OpenAIError, error_body

__all__ = ["App", "Headers", "HttpServer", "Request", "Response", "StreamResponse", "check_cors_origins", "json_response", "path_tail"]

_log = logging.getLogger("kvcompass.http")

Handler = Callable[["Request"], Awaitable["StreamResponse"]]
Observe = Callable[["Request", "StreamResponse", "OpenAIError | None"], None]

_REASONS = {s.value: s.phrase.encode() for s in http.HTTPStatus}
_REFUSED = b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\nConnection: close\r\nRetry-After: 1\r\n\r\n"
_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
_PIPELINE_DEPTH = 16  # heads queued on one connection before its socket stops being read
_BODY_DISCARD_S = 10.0  # how long the rest of a refused request's body may take to arrive
_HIGH_WATER = 1024 * 1024  # body bytes buffered ahead of a handler before the socket pauses


class Headers(Mapping[str, str]):
    """A request's headers by lower-cased name (repeated fields joined with ``", "``);
    lookups ignore case."""

    __slots__ = ("_d",)

    def __init__(self, d: dict[str, str] | None = None) -> None:
        self._d: dict[str, str] = d if d is not None else {}

    def __getitem__(self, name: str) -> str:
        return self._d[name.lower()]

    def get(self, name: str, default: Any = None) -> Any:
        return self._d.get(name.lower(), default)

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and name.lower() in self._d

    def __iter__(self) -> Iterator[str]:
        return iter(self._d)

    def __len__(self) -> int:
        return len(self._d)

    def __repr__(self) -> str:
        return f"Headers({self._d!r})"


class Request:
    """One request: ``method``, ``path`` (without the query), ``query_string``, ``headers``,
    ``remote`` (the client's address), ``content_length`` (None when chunked), and the body
    through :meth:`read`. Handlers may keep per-request values in it (``request[key]``)."""

    __slots__ = ("method", "path", "query_string", "headers", "remote", "content_length", "keep_alive", "_stream", "_chunks", "_size", "_complete", "_waiter", "_error", "_conn", "_store", "_continue", "_cors")

    def __init__(self, conn: _Connection, method: str, path: str, query: str, headers: Headers) -> None:
        self._conn = conn
        self.method = method
        self.path = path
        self.query_string = query
        self.headers = headers
        self.remote = conn.remote
        cl = headers._d.get("content-length")
        self.content_length: int | None = int(cl) if cl is not None and cl.isdigit() else None
        self.keep_alive = True
        self._stream: StreamResponse | None = None
        self._chunks: list[bytes] = []
        self._size = 0
        self._complete = False
        self._waiter: asyncio.Future[None] | None = None
        self._error: BaseException | None = None
        self._store: dict[Any, Any] | None = None
        self._continue = False
        self._cors = b""  # the CORS lines every response to this request carries (App.handle)

    @property
    def complete(self) -> bool:
        """The whole body has arrived (most requests: it came with the head)."""
        return self._complete

    @property
    def disconnected(self) -> bool:
        """The client closed its side of the connection, or lost it (:meth:`on_disconnect`'s
        event, for a handler about to start more work)."""
        return self._conn._client_done

    def on_disconnect(self, callback: Callable[[], None]) -> Callable[[], None]:
        """Call ``callback`` once, from the event loop, if the client closes its side of the
        connection (or loses it) before the returned function is called; a handler calls that
        when it is done. A handler that waits (for a prefill, for a pool's room) is not
        cancelled when its client goes away; one that should give up then, as an engine aborts
        a disconnected request (vLLM under uvicorn, which takes the client's end of sending for
        its going away), asks here. The server itself still answers a half-closed client."""
        return self._conn.watch_lost(callback)

    async def read(self) -> bytes:
        """The whole body. :class:`~kvcompass.errors.MessageTooLargeError` past the server's
        ``max_body_bytes``; ``ConnectionResetError`` when the client went away first."""
        if self._continue:
            self._continue = False
            if not self._complete and self._error is None:
                self._conn.write(_CONTINUE)
        while not self._complete and self._error is None:
            if self._waiter is None:
                self._waiter = asyncio.get_running_loop().create_future()
            self._conn.resume()
            await self._waiter
            self._waiter = None
        if self._error is not None:
            raise self._error
        if len(self._chunks) != 1:
            self._chunks = [b"".join(self._chunks)]
        return self._chunks[0]

    def _feed(self, data: bytes) -> None:
        self._size += len(data)
        if self._size > self._conn.server.max_body_bytes:
            if self._error is None:
                limit = self._conn.server.max_body_bytes
                self._fail(MessageTooLargeError(f"request body exceeds {limit} bytes", limit=limit))
            return
        if self._error is None:
            self._chunks.append(data)

    def _finish(self) -> None:
        self._complete = True
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def _fail(self, exc: BaseException) -> None:
        self._error = exc
        self._chunks = []
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def __getitem__(self, key: Any) -> Any:
        if self._store is None:
            raise KeyError(key)
        return self._store[key]

    def __setitem__(self, key: Any, value: Any) -> None:
        if self._store is None:
            self._store = {}
        self._store[key] = value

    def __contains__(self, key: Any) -> bool:
        return self._store is not None and key in self._store


_FRAMING = frozenset({"connection", "content-length", "transfer-encoding", "date"})
"""Headers the server writes itself: a handler's own are dropped, so the framing a client reads
is the one the server keeps (a handler's ``Connection: close``, in any case, still closes:
:func:`_head` reports it to :meth:`_Connection.connection_header`)."""


def _head(status: int, headers: Mapping[str, str]) -> tuple[bytearray, bool]:
    """The status line and a handler's headers (framing ones dropped), and whether the handler
    asked for ``Connection: close``, read in the same pass. ValueError on CR or LF."""
    out = bytearray(b"HTTP/1.1 %d %s\r\n" % (status, _REASONS.get(status, b"Unknown")))
    close = False
    for k, v in headers.items():
        if "\r" in v or "\n" in v or "\r" in k or "\n" in k:
            raise ValueError(f"header {k!r} holds CR or LF")
        lk = k.lower()
        if lk in _FRAMING:
            close = close or (lk == "connection" and v.lower() == "close")
            continue
        out += f"{k}: {v}\r\n".encode("latin-1")
    return out, close


class StreamResponse:
    """A response written as it is produced (chunked): :meth:`prepare` sends the head,
    :meth:`write` each part, :meth:`write_eof` the end."""

    __slots__ = ("status", "headers", "prepared", "_conn", "_request", "_chunked", "_ended")

    def __init__(self, *, status: int = 200, headers: Mapping[str, str] | None = None) -> None:
        self.status = status
        self.headers: dict[str, str] = dict(headers or {})
        self.prepared = False
        self._conn: _Connection | None = None
        self._request: Request | None = None
        self._chunked = True
        self._ended = False

    async def prepare(self, request: Request) -> StreamResponse:
        if self.prepared:
            return self
        conn = request._conn
        # HTTP/1.0 cannot take chunks: the body ends where the connection does.
        chunked = request.method != "HEAD" and not conn.http10
        head, close = _head(self.status, self.headers)  # ValueError before anything is sent
        head += b"Date: %s\r\n" % conn.server.date()
        head += request._cors
        if chunked:
            head += b"Transfer-Encoding: chunked\r\n"
        head += conn.connection_header(request, close, stream=True)
        self._conn, self._request, self._chunked = conn, request, chunked
        self.prepared = True
        request._stream = self
        conn.write(bytes(head))
        return self

    async def write(self, data: bytes) -> None:
        conn = self._conn
        if conn is None or self._ended:
            raise RuntimeError("write before prepare() or after write_eof()")
        if conn.gone:
            raise ConnectionResetError("the client closed the connection")
        if not data or (self._request is not None and self._request.method == "HEAD"):
            return
        conn.write(b"%x\r\n%s\r\n" % (len(data), data) if self._chunked else data)
        await conn.drain()

    async def write_eof(self) -> None:
        if self._ended or self._conn is None:
            return
        self._ended = True
        if self._chunked and not self._conn.lost:
            self._conn.write(b"0\r\n\r\n")


class Response(StreamResponse):
    """A whole response (``Content-Length``)."""

    __slots__ = ("body",)

    def __init__(self, *, body: bytes = b"", status: int = 200, headers: Mapping[str, str] | None = None, content_type: str | None = None) -> None:
        super().__init__(status=status, headers=headers)
        self.body = body
        if content_type is not None:
            self.headers["Content-Type"] = content_type

    def _send(self, request: Request) -> None:
        conn = request._conn
        self._conn, self._request = conn, request
        self.prepared = self._ended = True
        body = b"" if request.method == "HEAD" else self.body
        head, close = _head(self.status, self.headers)
        if self.status == 204 or self.status == 304:
            # No body by definition, and RFC 9110 forbids the field on a 204 (a CORS preflight).
            head += b"Date: %s\r\n" % conn.server.date()
            body = b""
        else:
            head += b"Content-Length: %d\r\nDate: %s\r\n" % (len(self.body), conn.server.date())
        head += request._cors
        head += conn.connection_header(request, close, stream=False)
        head += body
        conn.write(bytes(head))


def json_response(obj: Any, *, status: int = 200, headers: Mapping[str, str] | None = None) -> Response:
    return Response(body=json.dumps(obj).encode(), status=status, headers={**(headers or {}), "Content-Type": "application/json"})


def error_response(e: OpenAIError) -> Response:
    """OpenAI's error body for ``e``, with its extra headers."""
    return json_response(error_body(e.status, e.message, e.param, e.code, e.kind), status=e.status, headers=e.headers)


def path_tail(request: Request, prefix: str) -> str:
    """What follows ``prefix`` in the request's path, percent-decoded (a model id such as
    ``org/model`` arrives as ``org%2Fmodel`` from OpenAI's clients, or plain)."""
    return urllib.parse.unquote(request.path[len(prefix):])


_CORS_EXPOSE = b"Access-Control-Expose-Headers: retry-after, x-request-id, x-kvcompass-worker\r\n"
"""Response headers a browser's code may read besides the safelisted ones (a 429's wait, the
request id, which worker served)."""


def check_cors_origins(origins: tuple[str, ...]) -> tuple[str, ...]:
    """``origins`` if each is ``*`` or one origin (InvalidArgumentError otherwise)."""
    for o in origins:
        if not isinstance(o, str) or not o or not o.isascii() or any(c in o for c in "\r\n, "):
            raise InvalidArgumentError(f"a CORS origin is '*' or one origin such as https://chat.example.com, got {o!r}")
    return origins


class App:
    """The route table (path -> method -> handler), the hook that sees every response
    (``observe(request, response, error)``; ``error`` is the refusal or None), and the
    application's start and stop hooks (:meth:`HttpServer.start` runs them)."""

    def __init__(self, *, max_body_bytes: int = 1 << 20, observe: Observe | None = None, cors_origins: tuple[str, ...] = ()) -> None:
        self.max_body_bytes = max_body_bytes
        self.observe = observe
        # Browser clients (a chat UI on another origin) need CORS, and vLLM's server allows
        # every origin by default (found in review: a preflight got 405, so no browser could
        # call the door). "*" allows any origin; otherwise only the listed ones, echoed.
        self.cors_origins = frozenset(check_cors_origins(cors_origins))
        self.routes: dict[str, dict[str, Handler]] = {}
        # Path prefix -> GET handler, for a resource named in the path (``/v1/models/{id}``),
        # tried only when no exact route matches.
        self.prefixes: dict[str, Handler] = {}
        self.on_startup: list[Callable[[], Awaitable[None]]] = []
        self.on_cleanup: list[Callable[[], Awaitable[None]]] = []
        self.state: dict[str, Any] = {}

    def add_post(self, path: str, handler: Handler) -> None:
        self.routes.setdefault(path, {})["POST"] = handler

    def add_get(self, path: str, handler: Handler) -> None:
        self.routes.setdefault(path, {})["GET"] = handler

    def add_get_prefix(self, prefix: str, handler: Handler) -> None:
        """``handler`` answers GET (and HEAD) of every path under ``prefix`` (which ends in
        ``/``) that has no exact route; it reads the rest of the path itself (still
        percent-encoded: :func:`path_tail`)."""
        if not prefix.endswith("/"):
            raise InvalidArgumentError(f"a route prefix ends in '/', got {prefix!r}")
        self.prefixes[prefix] = handler

    @property
    def paths(self) -> list[str]:
        return sorted(self.routes)

    def _prefixed(self, path: str) -> dict[str, Handler] | None:
        for prefix, handler in self.prefixes.items():
            if path.startswith(prefix) and len(path) > len(prefix):
                return {"GET": handler}
        return None

    def _preflight(self, request: Request) -> Response:
        """A CORS preflight: allowed (204 with the methods and the asked-for headers) when the
        origin is, else a 204 without the allow lines, which the browser reads as a refusal."""
        headers: dict[str, str] = {}
        if b"Access-Control-Allow-Origin" in request._cors:
            headers["Access-Control-Allow-Methods"] = "GET, POST, OPTIONS"
            asked = request.headers._d.get("access-control-request-headers")
            if asked and not any(c in asked for c in "\r\n"):
                headers["Access-Control-Allow-Headers"] = asked
            headers["Access-Control-Max-Age"] = "600"
        resp = Response(status=204, headers=headers)
        if self.observe is not None:
            self.observe(request, resp, None)
        return resp

    async def handle(self, request: Request) -> StreamResponse:
        """The route's handler with refusals turned into OpenAI's error body, and a handler's
        failure into a logged 500 (``ConnectionResetError`` once the client is gone passes)."""
        err: OpenAIError | None = None
        if self.cors_origins:
            origin = request.headers._d.get("origin")
            star = "*" in self.cors_origins
            if not star:
                # The answer depends on the origin: a shared cache must key on it, for requests
                # from no origin or a refused one too (found in review).
                request._cors = b"Vary: Origin\r\n"
            if origin is not None:
                if star:
                    request._cors = b"Access-Control-Allow-Origin: *\r\n" + _CORS_EXPOSE
                elif origin in self.cors_origins:
                    request._cors = b"Access-Control-Allow-Origin: %s\r\nVary: Origin\r\n%s" % (origin.encode("latin-1"), _CORS_EXPOSE)
                if request.method == "OPTIONS" and "access-control-request-method" in request.headers._d:
                    return self._preflight(request)
        methods = self.routes.get(request.path)
        if methods is None and self.prefixes:
            methods = self._prefixed(request.path)
        handler = None if methods is None else methods.get(request.method) or (methods.get("GET") if request.method == "HEAD" else None)
        if methods is None or handler is None:
            # Not a refusal of a request the app serves: answered, observed with no error.
            if methods is None:
                miss = OpenAIError(404, f"Not Found: {request.method} {request.path}", None, "not_found")
            else:
                allow = ",".join(sorted({*methods, *(["HEAD"] if "GET" in methods else [])}))
                miss = OpenAIError(405, f"Method Not Allowed: {request.method} {request.path}", None, "method_not_allowed", headers={"Allow": allow})
            miss_resp = error_response(miss)
            if self.observe is not None:
                self.observe(request, miss_resp, None)
            return miss_resp
        resp: StreamResponse
        try:
            resp = await handler(request)
        except OpenAIError as e:
            err = e
            resp = error_response(e)
        except KVCompassError as e:  # a refusal the handler did not word itself: the HTTP table's
            err = OpenAIError.of(e)
            resp = error_response(err)
        except Exception as e:
            if isinstance(e, ConnectionResetError) and request._conn.gone:
                raise  # the client left; nobody to answer and nothing to log
            _log.exception("handler of %s %s failed", request.method, request.path)
            err = OpenAIError(500, "internal error: the handler failed", code="internal_error")
            resp = error_response(err)
        if self.observe is not None:
            self.observe(request, resp, err)
        return resp


def _nothing() -> None:
    return None


class _Connection(asyncio.Protocol):
    """One client connection: parses heads and bodies, runs one handler at a time, in order."""

    def __init__(self, server: HttpServer) -> None:
        self.server = server
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpRequestParser(self)
        self.remote: str | None = None
        self.lost = False
        self.http10 = False
        self._addr: str | None = None
        self._url = b""
        self._hdrs: dict[str, str] = {}
        self._head_bytes = 0
        self._head_started = False
        self._in_head = True
        self._current: Request | None = None  # the request whose body is being parsed
        self._queue: deque[Request] = deque()
        self._task: asyncio.Task[None] | None = None
        self._paused_reading = False
        self._write_paused = False
        self._drain: asyncio.Future[None] | None = None
        self._head_timer: asyncio.TimerHandle | None = None
        self.idle_since: float | None = time.monotonic()
        self._close_after = False
        self._rejected = False
        self._late_reject: tuple[int, str] | None = None
        self._too_big = False
        self._trailers_too_big = False
        self._trailer_size = 0
        self._head_size = 0
        self._lost_watchers: list[Callable[[], None]] = []
        self._client_done = False  # the client closed its side, or the connection is lost

    def watch_lost(self, callback: Callable[[], None]) -> Callable[[], None]:
        """:meth:`Request.on_disconnect`."""
        if self._client_done:
            asyncio.get_running_loop().call_soon(callback)
            return _nothing
        self._lost_watchers.append(callback)

        def forget() -> None:
            with contextlib.suppress(ValueError):
                self._lost_watchers.remove(callback)

        return forget

    def _client_gone(self) -> None:
        self._client_done = True
        watchers, self._lost_watchers = self._lost_watchers, []
        for callback in watchers:
            asyncio.get_running_loop().call_soon(callback)

    # -- transport events -----------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's are not asyncio.Transport subclasses
        srv = self.server
        peer = transport.get_extra_info("peername")
        addr = str(peer[0]) if isinstance(peer, (tuple, list)) and peer else "?"
        self.remote = addr
        g = srv.guard
        if g is not None:
            if not g.admit(addr):
                transport.write(_REFUSED)  # type: ignore[attr-defined]  # a transport that writes
                transport.close()
                self.lost = True
                return
            self._addr = addr
        srv.connections.add(self)
        self._arm_head()  # the first head's deadline runs from the connection

    def connection_lost(self, exc: Exception | None) -> None:
        if self._addr is not None and self.server.guard is not None:
            self.server.guard.release(self._addr)
            self._addr = None
        self.lost = True
        self.server.connections.discard(self)
        self._disarm_head()
        self._client_gone()
        gone = ConnectionResetError("the client closed the connection")
        if self._current is not None and not self._current._complete:
            self._current._fail(gone)
        for r in self._queue:
            if not r._complete:
                r._fail(gone)
        if self._drain is not None and not self._drain.done():
            self._drain.set_exception(gone)

    def data_received(self, data: bytes) -> None:
        if self._rejected:
            return
        self.idle_since = None
        if self._in_head:
            self._head_bytes += len(data)
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._reject(400, "protocol upgrades are not served here")
            return
        except httptools.HttpParserError as e:
            self._reject(400, f"malformed HTTP request: {e}")
            return
        if self._too_big:
            self._reject(431, f"the request head exceeds {self.server.max_head_bytes} bytes")
            return
        if self._trailers_too_big:
            self._reject(431, f"the request's trailer fields exceed {self.server.max_head_bytes} bytes")
            return
        if self._in_head and self.transport is not None and not self.lost:
            if self._head_bytes > self.server.max_head_bytes:
                self._reject(431, f"the request head exceeds {self.server.max_head_bytes} bytes")
                return
            if self._head_timer is None and self._head_started:
                self._arm_head()  # a head begun and not whole: its deadline runs from now

    def eof_received(self) -> bool | None:
        self._client_gone()
        if self._current is not None and not self._current._complete:
            # A half-close: the client can still read its answer, a 400 (found in review: as a
            # ConnectionResetError it was taken for a handler's bug, a 500 and a traceback).
            self._current._fail(InvalidArgumentError("the client stopped sending before the body was whole"))
        if self._task is not None or self._queue:
            self._close_after = True
            return True  # the client is done sending: answer what it asked, then close
        return None  # close our side as well

    def pause_writing(self) -> None:
        self._write_paused = True

    def resume_writing(self) -> None:
        self._write_paused = False
        if self._drain is not None and not self._drain.done():
            self._drain.set_result(None)

    # -- parser callbacks ---------------------------------------------------------------------------

    def on_message_begin(self) -> None:
        # A head's first byte, also when it came in the packet that ended the last body (a
        # client that stops there is held to the head deadline, not to the keep-alive limit).
        self._head_started = True
        self._url = b""
        self._hdrs = {}
        self._head_size = 0
        self._trailer_size = 0

    def on_url(self, url: bytes) -> None:
        self._url += url
        self._head_size += len(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        if not self._in_head:
            # A trailer field (after a chunked body): not merged into the request's headers
            # (RFC 9110 section 6.5.1), and held to the head's limit (found in review: trailers
            # were unbounded and could set a header the handler reads after the body).
            self._trailer_size += len(name) + len(value) + 4
            if self._trailer_size > self.server.max_head_bytes:
                self._trailers_too_big = True
            return
        self._head_size += len(name) + len(value) + 4
        k = name.decode("latin-1").lower()
        v = value.decode("latin-1")
        old = self._hdrs.get(k)
        self._hdrs[k] = v if old is None else f"{old}, {v}"

    def on_headers_complete(self) -> None:
        self._in_head = False
        self._head_started = False
        self._head_bytes = 0
        self._disarm_head()
        if self._head_size > self.server.max_head_bytes:
            self._too_big = True  # answered once feed_data returns
            return
        p = self.parser
        self.http10 = p.get_http_version() == "1.0"
        url = self._url.decode("latin-1")
        path, _, query = url.partition("?")
        req = Request(self, p.get_method().decode("latin-1"), path, query, Headers(self._hdrs))
        req.keep_alive = p.should_keep_alive()
        self._current = req
        # Expect: 100-continue is answered when the handler first reads the body, so a request
        # refused on its head (401, 413 by its length) is not invited to send it.
        req._continue = self._hdrs.get("expect", "").lower() == "100-continue"
        self._queue.append(req)
        if self._task is None:
            self._task = self.server.loop.create_task(self._run())
            self.server.tasks.add(self._task)
        elif len(self._queue) >= _PIPELINE_DEPTH:
            self.pause()

    def on_body(self, body: bytes) -> None:
        req = self._current
        if req is not None and not self._too_big:
            req._feed(body)
            if req._size > _HIGH_WATER and self._queue and self._queue[0] is not req:
                self.pause()  # a pipelined body piling up behind a running handler

    def on_message_complete(self) -> None:
        req = self._current
        self._in_head = True
        self._current = None
        if req is not None:
            req._finish()

    # -- requests -----------------------------------------------------------------------------------

    async def _run(self) -> None:
        app = self.server.app
        try:
            while self._queue and not self.lost:
                req = self._queue[0]
                try:
                    resp = await app.handle(req)
                except ConnectionResetError:
                    break  # the client went away mid-answer: nobody to tell
                if self.lost:
                    break
                if req._stream is not None and resp is not req._stream:
                    self._close()  # a stream began and failed: its end cannot be told but by closing
                    break
                if not isinstance(resp, Response) and not resp.prepared:
                    resp = error_response(OpenAIError(500, "internal error: the handler produced no response", code="internal_error"))
                if isinstance(resp, Response) and not resp.prepared:
                    try:
                        resp._send(req)
                    except ValueError:
                        _log.exception("the response of %s %s cannot be sent", req.method, req.path)
                        error_response(OpenAIError(500, "internal error: the response could not be sent", code="internal_error"))._send(req)
                else:
                    await resp.write_eof()
                if self._write_paused:
                    # A client that sends requests and does not read the answers: the next is
                    # not served until these leave (with the pipeline's bound on queued heads,
                    # that bounds what such a client can make the server hold).
                    try:
                        await self.drain()
                    except ConnectionResetError:
                        break
                self._queue.popleft()
                if not req._complete and not self._close_after and not self.server.closing:
                    # Answered before its body was whole (a 401 on the head): the body's length
                    # is known and bounded, so its rest is read and dropped and the connection
                    # stays (clients that send the body after the head keep their connection).
                    try:
                        async with asyncio.timeout(_BODY_DISCARD_S):
                            await req.read()
                    except (TimeoutError, KVCompassError, ConnectionResetError):
                        self._close()
                        break
                if self._rejected and self._queue:
                    continue  # requests in hand before a malformed one are answered first
                if self._close_after or not req._complete or self.server.closing:
                    # An unread body of unknown or excessive length leaves the stream unsynchronised.
                    if self._rejected:
                        self._send_reject()
                    else:
                        self._close()
                    break
                if self._paused_reading and len(self._queue) < _PIPELINE_DEPTH // 2:
                    self.resume()
        finally:
            task, self._task = self._task, None
            if task is not None:
                self.server.tasks.discard(task)
            if not self._queue:
                self.idle_since = time.monotonic()
                if self._in_head and not self._head_started:
                    self._disarm_head()  # idle: the keep-alive limit's business, not the head deadline's

    def connection_header(self, request: Request, close: bool, *, stream: bool) -> bytes:
        """The response's ``Connection`` line; remembers whether the connection closes once
        this response is sent (an HTTP/1.0 stream ends only by closing)."""
        # An unread body (a refusal before it arrived) cannot be told from a next request
        # unless its length is known and bounded: then it is read and dropped after the answer.
        # Nor when the client asked to be invited (Expect: 100-continue) and never was: it may
        # never send the body, and inviting it after the answer put a stray 100 before the next
        # response (found in review). The connection closes after the answer instead.
        unread = not request._complete and (
            request.content_length is None or request.content_length > self.server.max_body_bytes or request._error is not None or request._continue
        )
        if not request.keep_alive or unread or self.server.closing or (stream and self.http10) or close:
            self._close_after = True
        if self._close_after:
            return b"Connection: close\r\n\r\n"
        return b"Connection: keep-alive\r\n\r\n" if self.http10 else b"\r\n"

    # -- writing and flow ---------------------------------------------------------------------------

    @property
    def gone(self) -> bool:
        """The client left: the connection was lost, or a send failed (the peer reset it) and
        ``connection_lost`` is only scheduled (a handler writing without pause would not see
        that before its end)."""
        return self.lost or (self.transport is not None and self.transport.is_closing())

    def write(self, data: bytes) -> None:
        if self.transport is not None and not self.lost and not self.transport.is_closing():
            self.transport.write(data)

    async def drain(self) -> None:
        if self._write_paused and not self.lost:
            if self._drain is None or self._drain.done():
                self._drain = self.server.loop.create_future()
            limit = self.server.write_timeout_s
            if limit is None:
                await self._drain
                return
            try:
                await asyncio.wait_for(self._drain, limit)
            except asyncio.TimeoutError:
                # A client that stops reading held its handler, and a door's worker connection
                # behind it, for as long as it kept the socket open (found in review).
                if self.transport is not None:
                    self.transport.abort()
                raise ConnectionResetError(f"the client read nothing for {limit:g} s") from None

    def pause(self) -> None:
        if not self._paused_reading and self.transport is not None and not self.lost:
            self._paused_reading = True
            self.transport.pause_reading()

    def resume(self) -> None:
        if self._paused_reading and self.transport is not None and not self.lost:
            self._paused_reading = False
            self.transport.resume_reading()

    def _close(self) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.close()

    def _reject(self, status: int, message: str) -> None:
        """A request that cannot be parsed or is too big to: answered, then closed. Nothing more
        is read from the connection. With requests in hand (a malformed body after a whole head,
        or bytes that cannot be a request behind pipelined ones), those are answered first, in
        order: a body that broke fails its handler's read with a 400 (the handler answers it
        through the HTTP table), and what cannot be a request is answered once they are done."""
        if self.transport is None or self.lost:
            return
        self._rejected = True
        self.pause()
        cur = self._current
        if cur is not None and not cur._complete and cur._error is None:
            cur._fail(InvalidArgumentError(message))  # the handler's read raises; 400 through the table
            self._current = None
        elif cur is None or cur._complete:
            self._late_reject = (status, message)
        if self._task is None and not self._queue:
            self._send_reject()
            return
        self._close_after = True

    def _send_reject(self) -> None:
        """Answer the rejection kept for after the requests in hand, if any, and close."""
        if self._late_reject is not None and self.transport is not None and not self.lost:
            status, message = self._late_reject
            body = json.dumps(error_body(status, message)).encode()
            head = _head(status, {"Content-Type": "application/json"})[0]
            self.transport.write(bytes(head + b"Content-Length: %d\r\nConnection: close\r\n\r\n" % len(body)) + body)
        self._late_reject = None
        self._close()

    # -- the head deadline --------------------------------------------------------------------------

    def _arm_head(self) -> None:
        g = self.server.guard
        if g is not None and self._head_timer is None and not self.lost:
            self._head_timer = self.server.loop.call_later(g.header_timeout_s, self._head_expired)

    def _disarm_head(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_expired(self) -> None:
        self._head_timer = None
        if self._in_head and not self.lost and self.transport is not None and self.server.guard is not None:
            self.server.guard.timed_out += 1
            self.transport.abort()  # no lingering: the client sent nothing worth a reply


class HttpServer:
    """``app`` served on a bound, listening socket (TLS with ``ssl_context``); ``guard``
    limits connections per address and bounds heads in time. ``keepalive_s``: an idle
    kept-alive connection is closed after this long (75 s, aiohttp's and nginx's default).
    ``write_timeout_s``: a response write waits this long at most for a client that does not
    read (the connection is then cut; None: no limit)."""

    def __init__(
        self, app: App, sock: socket.socket, *, guard: ConnGuard | None = None, ssl_context: ssl.SSLContext | None = None, keepalive_s: float = 75.0, max_head_bytes: int = 64 * 1024,
        write_timeout_s: float | None = 60.0,
    ) -> None:
        self.app = app
        self.sock = sock
        self.guard = guard
        self.ssl_context = ssl_context
        self.keepalive_s = keepalive_s
        self.write_timeout_s = write_timeout_s
        self.max_head_bytes = max_head_bytes
        self.max_body_bytes = app.max_body_bytes
        self.connections: set[_Connection] = set()
        self.tasks: set[asyncio.Task[None]] = set()
        self.closing = False
        self._server: asyncio.Server | None = None
        self._sweeper: asyncio.Task[None] | None = None
        self._date = b""
        self._date_at = -1
        self.loop = asyncio.get_event_loop()

    def date(self) -> bytes:
        now = int(time.time())
        if now != self._date_at:
            self._date_at = now
            self._date = email.utils.formatdate(now, usegmt=True).encode()
        return self._date

    async def start(self) -> None:
        """Run the app's start hooks, then accept connections."""
        self.loop = asyncio.get_running_loop()
        for hook in self.app.on_startup:
            await hook()
        try:
            self._server = await self.loop.create_server(lambda: _Connection(self), sock=self.sock, ssl=self.ssl_context)
        except BaseException:
            await self._cleanup()
            raise
        self._sweeper = self.loop.create_task(self._sweep())

    async def _sweep(self) -> None:
        """Close kept-alive connections idle past ``keepalive_s`` (checked once a second: one
        timer for the server instead of one per request)."""
        while True:
            await asyncio.sleep(min(1.0, self.keepalive_s))
            cutoff = time.monotonic() - self.keepalive_s
            for c in [c for c in self.connections if c.idle_since is not None and c.idle_since < cutoff]:
                c._close()

    async def close(self, timeout_s: float = 1.0) -> None:
        """Stop accepting; idle connections close now, busy ones once their handler ends (up to
        ``timeout_s``, then they are cancelled); what they wrote is flushed within the same
        ``timeout_s`` before the rest is cut (found in review: answers still in the send buffer
        were aborted a second after the handlers ended, well inside a drain's grace); then the
        app's stop hooks."""
        if self.closing:
            return
        self.closing = True
        deadline = self.loop.time() + timeout_s
        if self._server is not None:
            self._server.close()
        if self._sweeper is not None:
            self._sweeper.cancel()
        for c in list(self.connections):
            if c._task is None:
                c._close()
        if self.tasks:
            _, pending = await asyncio.wait(set(self.tasks), timeout=timeout_s)
            for t in pending:
                t.cancel()
            if pending:
                await asyncio.wait(pending, timeout=1.0)
        for c in list(self.connections):
            c._close()  # a graceful close: the transport flushes what it holds, then closes
        while self.connections and self.loop.time() < deadline:
            await asyncio.sleep(0.05)
        for c in list(self.connections):
            if c.transport is not None:
                c.transport.abort()
        if self._server is not None:
            # Last: from Python 3.12 on, wait_closed waits for every connection to be gone.
            await self._server.wait_closed()
        await self._cleanup()

    async def _cleanup(self) -> None:
        for hook in self.app.on_cleanup:
            try:
                await hook()
            except Exception:
                _log.exception("a cleanup hook failed")
