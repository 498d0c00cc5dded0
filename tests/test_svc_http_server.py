"""The OpenAI surface's HTTP/1.1 server (kvcompass.services.http_server) on raw sockets: what a
client of any make may send it, on asyncio's loop and on uvloop."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import pytest

from kvcompass.errors import InvalidArgumentError
from kvcompass.services.conn_guard import ConnGuard
from kvcompass.services.http_server import App, HttpServer, Request, Response, StreamResponse, json_response
from kvcompass.services.lifecycle import bind_socket
from kvcompass.services.openai_api import OpenAIError

LOOPS = ["asyncio", "uvloop"]


def run(loop: str, coro: Callable[[], Awaitable[None]]) -> None:
    if loop == "uvloop":
        uvloop = pytest.importorskip("uvloop")
        uvloop.run(asyncio.wait_for(coro(), 30))
    else:
        asyncio.run(asyncio.wait_for(coro(), 30))


class State:
    def __init__(self) -> None:
        self.gate = asyncio.Event()
        self.gate.set()
        self.stream_error: BaseException | None = None
        self.stream_ended = asyncio.Event()
        self.seen: list[tuple[str, str]] = []


def make_app(state: State, max_body: int = 1000, cors: tuple[str, ...] = ()) -> App:
    app = App(max_body_bytes=max_body, observe=lambda req, resp, err: state.seen.append((req.path, str(resp.status))), cors_origins=cors)

    async def echo(req: Request) -> Response:
        body = await req.read()
        return json_response({"len": len(body), "q": req.query_string, "ct": req.headers.get("content-type"), "x": req.headers.get("X-Many")})

    async def slow(req: Request) -> Response:
        await state.gate.wait()
        return Response(body=b"slow", headers={"Content-Type": "text/plain"})

    async def stream(req: Request) -> StreamResponse:
        resp = StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(req)
        try:
            for i in range(1000):
                await resp.write(b"data: %d\n\n" % i)
                if i >= 2:
                    await state.gate.wait()
            await resp.write_eof()
        except ConnectionResetError as e:
            state.stream_error = e
            raise  # as a handler that does not catch it would: the server must not log it
        finally:
            state.stream_ended.set()
        return resp

    async def broken(req: Request) -> Response:
        raise RuntimeError("a bug")

    async def bad_header(req: Request) -> Response:
        return Response(body=b"", headers={"X-Evil": "a\r\nSet-Cookie: x"})

    async def refuse(req: Request) -> Response:
        raise InvalidArgumentError("nope")

    async def unread(req: Request) -> Response:
        raise OpenAIError(401, "no key")

    async def health(req: Request) -> Response:
        return json_response({"ok": True})

    async def framed(req: Request) -> Response:
        # A handler naming the framing itself: the server's own lines win, no duplicates.
        return Response(body=b"abc", headers={"content-length": "99", "Transfer-Encoding": "chunked", "connection": "close", "Date": "never"})

    app.add_post("/echo", echo)
    app.add_get("/slow", slow)
    app.add_get("/stream", stream)
    app.add_get("/broken", broken)
    app.add_get("/bad-header", bad_header)
    app.add_post("/refuse", refuse)
    app.add_post("/unread", unread)
    app.add_get("/health", health)
    app.add_get("/framed", framed)
    return app


_OPEN: list[asyncio.StreamWriter] = []


async def connect(port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    r, w = await asyncio.open_connection("127.0.0.1", port)
    _OPEN.append(w)
    return r, w


def close_all() -> None:
    while _OPEN:
        _OPEN.pop().close()


@asynccontextmanager
async def serving(state: State, **kw: Any) -> AsyncIterator[tuple[HttpServer, int]]:
    sock = bind_socket("127.0.0.1", 0)
    max_body = kw.pop("max_body", 1000)
    server = HttpServer(make_app(state, max_body, kw.pop("cors", ())), sock, **kw)
    await server.start()
    try:
        yield server, sock.getsockname()[1]
    finally:
        close_all()
        await server.close(timeout_s=1.0)
        sock.close()
        await asyncio.sleep(0)


async def read_response(r: asyncio.StreamReader) -> tuple[int, dict[str, str], bytes]:
    head = await asyncio.wait_for(r.readuntil(b"\r\n\r\n"), 5)
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {k.lower(): v for k, _, v in (ln.partition(": ") for ln in lines[1:] if ln)}
    if status in (204, 304):
        body = b""
    elif "content-length" in headers:
        body = await r.readexactly(int(headers["content-length"]))
    elif headers.get("transfer-encoding") == "chunked":
        body = b""
        while True:
            size = int((await r.readuntil(b"\r\n")).strip(), 16)
            chunk = await r.readexactly(size + 2)
            if size == 0:
                break
            body += chunk[:-2]
    else:
        body = await asyncio.wait_for(r.read(), 5)
    return status, headers, body


def post(path: str, body: bytes, extra: str = "") -> bytes:
    return f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n{extra}\r\n".encode() + body


@pytest.mark.parametrize("loop", LOOPS)
def test_keep_alive_and_pipelined_requests_are_answered_in_order_on_one_connection(loop: str) -> None:
    async def go() -> None:
        state = State()
        async with serving(state) as (_, port):
            r, w = await connect(port)
            # Two requests in one write (pipelined), a slow one first: answers keep their order.
            state.gate.clear()
            w.write(b"GET /slow HTTP/1.1\r\nHost: x\r\n\r\n" + post("/echo?a=1", b'{"k": 1}', "X-Many: a\r\nX-many: b\r\n"))
            await w.drain()
            await asyncio.sleep(0.05)
            state.gate.set()
            s1, h1, b1 = await read_response(r)
            s2, h2, b2 = await read_response(r)
            assert (s1, b1) == (200, b"slow") and "date" in h1
            assert s2 == 200 and json.loads(b2) == {"len": 8, "q": "a=1", "ct": "application/json", "x": "a, b"}
            # The same connection serves a third.
            w.write(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            assert (await read_response(r))[0] == 200
            w.close()
            assert state.seen == [("/slow", "200"), ("/echo", "200"), ("/health", "200")]

    run(loop, go)


@pytest.mark.parametrize("loop", LOOPS)
def test_http10_expect_continue_head_and_connection_close(loop: str) -> None:
    async def go() -> None:
        state = State()
        async with serving(state) as (_, port):
            # HTTP/1.0 without keep-alive: answered, then closed.
            r, w = await connect(port)
            w.write(b"GET /health HTTP/1.0\r\n\r\n")
            status, h, body = await read_response(r)
            assert status == 200 and h["connection"] == "close" and json.loads(body) == {"ok": True}
            assert await asyncio.wait_for(r.read(), 5) == b""
            # An HTTP/1.0 stream has no chunks: its end is the close.
            r, w = await connect(port)
            w.write(b"GET /stream HTTP/1.0\r\n\r\n")
            state.gate.clear()
            head = await asyncio.wait_for(r.readuntil(b"\r\n\r\n"), 5)
            assert b"Transfer-Encoding" not in head and b"Connection: close" in head
            assert (await asyncio.wait_for(r.readuntil(b"data: 2\n\n"), 5)).startswith(b"data: 0\n\n")
            state.gate.set()
            rest = await asyncio.wait_for(r.read(), 5)
            assert rest.endswith(b"data: 999\n\n")
            # Expect: 100-continue (curl's habit for bodies over 1 KiB): told to go on, then answered.
            r, w = await connect(port)
            w.write(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\nExpect: 100-continue\r\n\r\n")
            assert await asyncio.wait_for(r.readuntil(b"\r\n\r\n"), 5) == b"HTTP/1.1 100 Continue\r\n\r\n"
            w.write(b"{}")
            assert (await read_response(r))[0] == 200
            # A handler that refuses on the head does not invite the body: no 100, its answer.
            r2, w2 = await connect(port)
            w2.write(b"POST /unread HTTP/1.1\r\nHost: x\r\nContent-Length: 5000\r\nExpect: 100-continue\r\n\r\n")
            status, h, _ = await read_response(r2)
            assert status == 401 and h["connection"] == "close"
            # Found in review: with a body within bounds the connection stayed to read and drop
            # it, and that read sent the invitation after the answer: a stray 100 before the next
            # response. A body the client was never invited to send is not waited for: closed.
            r2, w2 = await connect(port)
            w2.write(b"POST /unread HTTP/1.1\r\nHost: x\r\nContent-Length: 500\r\nExpect: 100-continue\r\n\r\n")
            status, h, _ = await read_response(r2)
            assert status == 401 and h["connection"] == "close"
            with contextlib.suppress(ConnectionError):
                w2.write(b"x" * 500 + b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            assert b"100 Continue" not in await asyncio.wait_for(r2.read(), 5)
            # A handler's own framing headers are dropped; its Connection: close still closes.
            r3, w3 = await connect(port)
            w3.write(b"GET /framed HTTP/1.1\r\nHost: x\r\n\r\n")
            head = (await asyncio.wait_for(r3.readuntil(b"\r\n\r\n"), 5)).lower()
            assert head.count(b"content-length:") == 1 and b"content-length: 3\r\n" in head and b"transfer-encoding" not in head
            assert head.count(b"connection:") == 1 and b"connection: close" in head and head.count(b"date:") == 1 and b"never" not in head
            assert await asyncio.wait_for(r3.read(), 5) == b"abc"
            # HEAD of a GET route: its head, no body; then Connection: close is honoured.
            w.write(b"HEAD /health HTTP/1.1\r\nHost: x\r\n\r\n")
            head = await asyncio.wait_for(r.readuntil(b"\r\n\r\n"), 5)
            assert head.startswith(b"HTTP/1.1 200") and b"Content-Length: 12" in head
            w.write(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            status, h, _ = await read_response(r)
            assert status == 200 and h["connection"] == "close"
            assert await asyncio.wait_for(r.read(), 5) == b""

    run(loop, go)


@pytest.mark.parametrize("loop", LOOPS)
def test_refusals_get_openai_error_bodies_and_the_connection_stays_usable(loop: str) -> None:
    async def go() -> None:
        state = State()
        async with serving(state) as (_, port):
            r, w = await connect(port)
            cases = [
                (b"GET /nope HTTP/1.1\r\nHost: x\r\n\r\n", 404, "not_found"),
                (b"POST /health HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n", 405, "method_not_allowed"),
                (post("/refuse", b"{}"), 400, None),
                (b"GET /broken HTTP/1.1\r\nHost: x\r\n\r\n", 500, "internal_error"),
                (b"GET /bad-header HTTP/1.1\r\nHost: x\r\n\r\n", 500, "internal_error"),
            ]
            for raw, want, code in cases:
                w.write(raw)
                status, h, body = await read_response(r)
                err = json.loads(body)["error"]
                assert status == want and set(err) == {"message", "type", "param", "code"}, (raw, status, body)
                if code is not None:
                    assert err["code"] == code
                if want == 405:
                    assert h["allow"] == "GET,HEAD"
            assert b"Set-Cookie" not in body
            w.write(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            assert (await read_response(r))[0] == 200
            assert ("/broken", "500") in state.seen and ("/nope", "404") in state.seen

    run(loop, go)


@pytest.mark.parametrize("loop", LOOPS)
def test_malformed_oversized_and_unread_requests_are_answered_and_closed(loop: str) -> None:
    async def go() -> None:
        state = State()
        async with serving(state, max_body=100, max_head_bytes=2048) as (_, port):
            for raw, want in (
                (b"NOT HTTP AT ALL\r\n\r\n", 400),
                (b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 4096 + b"\r\n\r\n", 431),
                (post("/echo", b"x" * 200), 413),  # a body past max_body_bytes
                (b"POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n" + b"c8\r\n" + b"x" * 200 + b"\r\n0\r\n\r\n", 413),
                # Malformed after a whole head (the handler is already reading the body): its
                # read fails and it answers 400, then the connection closes.
                (b"POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\nabc\r\n0\r\n\r\n", 400),
                (b"POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: gzip\r\n\r\nabc", 400),
                (b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n", 400),
            ):
                r, w = await connect(port)
                w.write(raw)
                status, _, body = await read_response(r)
                assert status == want, (raw[:40], status, body)
                assert json.loads(body)["error"]["message"]
                if want != 413:
                    assert await asyncio.wait_for(r.read(), 5) == b""
                w.close()
            # Garbage behind a pipelined request: the request is answered first, then the 400.
            r, w = await connect(port)
            w.write(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\nNOT HTTP AT ALL\r\n\r\n")
            assert (await read_response(r))[0] == 200
            status, h, body = await read_response(r)
            assert status == 400 and h["connection"] == "close" and json.loads(body)["error"]["message"]
            assert await asyncio.wait_for(r.read(), 5) == b""
            # A refusal before the body arrived, its length known and within the limit: answered,
            # the rest of the body read and dropped, and the connection serves the next request.
            r, w = await connect(port)
            w.write(b"POST /unread HTTP/1.1\r\nHost: x\r\nContent-Length: 50\r\n\r\n" + b"x" * 10)
            status, h, _ = await read_response(r)
            assert status == 401 and h.get("connection") != "close"
            w.write(b"y" * 40 + b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            status, h, body = await read_response(r)
            assert status == 200 and json.loads(body) == {"ok": True}
            # Past the limit, or of unknown length (chunked): the rest cannot be told from a next
            # request, so the connection closes after the answer.
            for head in (b"Content-Length: 5000", b"Transfer-Encoding: chunked"):
                r, w = await connect(port)
                w.write(b"POST /unread HTTP/1.1\r\nHost: x\r\n" + head + b"\r\n\r\n" + (b"x" * 10 if b"5000" in head else b"a\r\n0123456789\r\n"))
                status, h, _ = await read_response(r)
                assert status == 401 and h["connection"] == "close", head
                assert await asyncio.wait_for(r.read(), 5) == b""

    run(loop, go)


@pytest.mark.parametrize("loop", LOOPS)
def test_a_stream_is_chunked_flow_controlled_and_its_handler_learns_the_client_left(loop: str, caplog: pytest.LogCaptureFixture) -> None:
    async def go() -> None:
        state = State()
        async with serving(state) as (_, port):
            r, w = await connect(port)
            w.write(b"GET /stream HTTP/1.1\r\nHost: x\r\n\r\n")
            status, h, body = await read_response(r)
            assert status == 200 and h["transfer-encoding"] == "chunked" and body.count(b"data: ") == 1000
            # Gone mid-stream: the handler's next write raises ConnectionResetError.
            state.gate.clear()
            state.stream_ended.clear()
            w.write(b"GET /stream HTTP/1.1\r\nHost: x\r\n\r\n")
            await asyncio.wait_for(r.readuntil(b"data: 2\n\n\r\n"), 5)
            w.transport.abort()
            await asyncio.sleep(0.05)
            state.gate.set()
            await asyncio.wait_for(state.stream_ended.wait(), 5)
            assert isinstance(state.stream_error, ConnectionResetError)
            # A client leaving is not a handler's failure: nothing logged as one.
            await asyncio.sleep(0.05)
            assert not [r for r in caplog.records if r.name == "kvcompass.http" and r.levelno >= logging.ERROR]

    run(loop, go)


@pytest.mark.parametrize("loop", LOOPS)
def test_close_lets_handlers_in_flight_finish_and_idle_keep_alive_connections_expire(loop: str) -> None:
    async def go() -> None:
        state = State()
        sock = bind_socket("127.0.0.1", 0)
        port = sock.getsockname()[1]
        server = HttpServer(make_app(state), sock, keepalive_s=0.3)
        await server.start()
        # An idle kept-alive connection is closed past keepalive_s.
        r, w = await connect(port)
        w.write(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert (await read_response(r))[0] == 200
        assert await asyncio.wait_for(r.read(), 5) == b""
        # close(): the slow request in flight is answered (Connection: close), then all closes.
        state.gate.clear()
        r, w = await connect(port)
        w.write(b"GET /slow HTTP/1.1\r\nHost: x\r\n\r\n")
        await asyncio.sleep(0.05)
        closing = asyncio.ensure_future(server.close(timeout_s=5.0))
        await asyncio.sleep(0.05)
        state.gate.set()
        status, h, body = await read_response(r)
        assert (status, body, h["connection"]) == (200, b"slow", "close")
        await closing
        sock.close()
        with pytest.raises(OSError):
            await connect(port)
        close_all()
        await asyncio.sleep(0)

    run(loop, go)


@pytest.mark.parametrize("loop", LOOPS)
def test_guard_caps_connections_per_address_and_cuts_a_trickled_head(loop: str) -> None:
    async def go() -> None:
        state = State()
        guard = ConnGuard(3, 0.3)
        async with serving(state, guard=guard) as (_, port):
            conns = [await connect(port) for _ in range(3)]
            r, w = await connect(port)
            assert (await asyncio.wait_for(r.read(), 5)).startswith(b"HTTP/1.1 503")
            assert guard.refused == 1
            # The three that sent nothing are cut at the head deadline.
            for r, w in conns:
                assert await asyncio.wait_for(r.read(), 5) == b""
            assert guard.timed_out == 3 and not guard.open
            # A served connection idles past the deadline unharmed; a second head trickled is cut.
            r, w = await connect(port)
            w.write(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            assert (await read_response(r))[0] == 200
            await asyncio.sleep(0.5)
            w.write(b"GET /health HTTP/1.1\r\n")
            assert await asyncio.wait_for(r.read(), 5) == b""
            assert guard.timed_out == 4
            # The next head begun in the very packet that ended a body, then nothing: the head
            # deadline holds (it used to wait for the next packet, leaving the keep-alive limit).
            r, w = await connect(port)
            w.write(post("/echo", b"{}") + b"GET /health HTTP/1.1\r\nHo")
            assert (await read_response(r))[0] == 200
            t0 = asyncio.get_running_loop().time()
            assert await asyncio.wait_for(r.read(), 5) == b""
            assert asyncio.get_running_loop().time() - t0 < 2.0 and guard.timed_out == 5

    run(loop, go)


@pytest.mark.parametrize("loop", LOOPS)
def test_a_client_that_pipelines_and_does_not_read_cannot_make_the_server_buffer_its_answers(loop: str) -> None:
    # Found by probing: 1,000 pipelined requests for a 64 KB answer, never read, had the server
    # hold 2.6 GB of answers in its transport. Now the next request waits for the last answer
    # to leave, and reading pauses behind a bounded queue of heads.
    big = b"x" * 65536

    async def go() -> None:
        app = App()

        async def answer(req: Request) -> Response:
            return Response(body=big)

        app.add_get("/big", answer)
        sock = bind_socket("127.0.0.1", 0)
        server = HttpServer(app, sock)
        await server.start()
        try:
            r, w = await asyncio.open_connection("127.0.0.1", sock.getsockname()[1], limit=1 << 20)
            n = 200
            w.write(b"GET /big HTTP/1.1\r\nHost: x\r\n\r\n" * n)
            await asyncio.sleep(0.5)
            held = max((c.transport.get_write_buffer_size() for c in server.connections if c.transport is not None), default=0)
            assert held < 4 * len(big), held
            for _ in range(n):  # every answer arrives, in order, once the client reads
                status, _, body = await read_response(r)
                assert status == 200 and body == big
            w.close()
        finally:
            await server.close()
            sock.close()

    run(loop, go)


@pytest.mark.parametrize("loop", LOOPS)
def test_a_body_cut_short_by_a_half_close_is_a_400_not_a_handler_failure(loop: str, caplog: pytest.LogCaptureFixture) -> None:
    """Found in review: a client that stopped sending (a half-close) before its body was whole
    had the handler's read raise ConnectionResetError, taken for a handler's bug: a 500 and a
    logged traceback. The client can still read: it gets a 400 that says why."""

    async def go() -> None:
        state = State()
        async with serving(state) as (_, port):
            r, w = await connect(port)
            w.write(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{\"a\":")
            await w.drain()
            await asyncio.sleep(0.05)
            w.write_eof()
            status, h, body = await read_response(r)
            assert status == 400 and b"stopped sending" in body and h["connection"] == "close"
            w.close()

    with caplog.at_level("ERROR"):
        run(loop, go)
    assert not [rec for rec in caplog.records if rec.levelname == "ERROR"]


@pytest.mark.parametrize("loop", LOOPS)
def test_trailer_fields_are_not_headers_and_are_held_to_the_head_limit(loop: str) -> None:
    """Review, twenty-fifth session: trailer fields after a chunked body were merged into the
    request's headers (a header the handler reads after the body could be set by one) and were
    bounded by nothing (200 MB of them took 190 MB of memory)."""

    async def go() -> None:
        state = State()
        async with serving(state, max_head_bytes=2048) as (_, port):
            r, w = await connect(port)
            head = b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
            w.write(head + b"2\r\n{}\r\n0\r\nContent-Type: text/evil\r\nX-Many: trailer\r\n\r\n")
            status, _, body = await read_response(r)
            assert status == 200 and json.loads(body) == {"len": 2, "q": "", "ct": "application/json", "x": None}
            # The same connection goes on; then trailers past the head limit (still coming: the
            # message never ends) are refused and the connection closed.
            w.write(head + b"2\r\n{}\r\n0\r\n" + b"".join(b"X-T%d: %s\r\n" % (i, b"v" * 100) for i in range(40)))
            status, _, body = await read_response(r)
            assert status in (400, 431), body
            assert await asyncio.wait_for(r.read(), 5) == b""

    run(loop, go)


def test_a_prefix_route_needs_a_trailing_slash_and_yields_to_exact_routes() -> None:
    app = App()
    with pytest.raises(InvalidArgumentError, match="ends in '/'"):
        app.add_get_prefix("/v1/models", _noop)
    app.add_get_prefix("/v1/models/", _noop)
    app.add_get("/v1/models/special", _noop)
    assert app._prefixed("/v1/models/a%2Fb") == {"GET": _noop}
    assert app._prefixed("/v1/models/") is None and app._prefixed("/v1/modelsx") is None
    assert app.routes["/v1/models/special"] == {"GET": _noop}


async def _noop(request: Request) -> StreamResponse:
    return json_response({})


@pytest.mark.parametrize("loop", LOOPS)
def test_cors_preflights_are_answered_and_every_response_names_the_allowed_origin(loop: str) -> None:
    # Review: no CORS at all (a preflight got 405), so a browser chat UI could not call the door;
    # vLLM allows every origin by default.
    preflight = b"OPTIONS /echo HTTP/1.1\r\nHost: x\r\nOrigin: https://ui.example\r\nAccess-Control-Request-Method: POST\r\nAccess-Control-Request-Headers: authorization, content-type\r\n\r\n"

    async def go() -> None:
        async with serving(State(), cors=("*",)) as (_, port):
            r, w = await connect(port)
            w.write(preflight)
            status, h, _ = await read_response(r)
            assert status == 204 and h["access-control-allow-origin"] == "*" and "content-length" not in h, h
            assert "POST" in h["access-control-allow-methods"] and h["access-control-allow-headers"] == "authorization, content-type"
            w.write(post("/echo", b"{}", "Origin: https://ui.example\r\n"))  # a whole answer
            status, h, _ = await read_response(r)
            assert status == 200 and h["access-control-allow-origin"] == "*"
            w.write(b"GET /stream HTTP/1.1\r\nHost: x\r\nOrigin: https://ui.example\r\n\r\n")  # a stream's head
            head = await asyncio.wait_for(r.readuntil(b"\r\n\r\n"), 5)
            assert b"Access-Control-Allow-Origin: *\r\n" in head
        async with serving(State(), cors=("https://ui.example",)) as (_, port):
            r, w = await connect(port)
            w.write(preflight)
            status, h, _ = await read_response(r)
            assert h["access-control-allow-origin"] == "https://ui.example" and h["vary"] == "Origin"
            w.write(preflight.replace(b"ui.example", b"evil.example"))
            status, h, _ = await read_response(r)
            assert status == 204 and "access-control-allow-origin" not in h and "access-control-allow-methods" not in h
            w.write(b"GET /health HTTP/1.1\r\nHost: x\r\nOrigin: https://evil.example\r\n\r\n")
            status, h, _ = await read_response(r)
            assert status == 200 and "access-control-allow-origin" not in h and h["vary"] == "Origin"
            w.write(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")  # no origin: still keyed on it
            status, h, _ = await read_response(r)
            assert status == 200 and h["vary"] == "Origin"
            w.write(post("/echo", b"{}", "Origin: https://ui.example\r\n"))
            status, h, _ = await read_response(r)
            assert "x-kvcompass-worker" in h["access-control-expose-headers"]
        async with serving(State()) as (_, port):  # no CORS configured: no preflight answer
            r, w = await connect(port)
            w.write(preflight)
            status, h, _ = await read_response(r)
            assert status == 405 and "access-control-allow-origin" not in h
    with pytest.raises(InvalidArgumentError, match="CORS origin"):
        App(cors_origins=("https://a.example, https://b.example",))

    run(loop, go)
