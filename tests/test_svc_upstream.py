"""The door's upstream client (``services/upstream.py``) against real loopback servers, under
both event loops the services run on: it reuses keep-alive connections, relays chunked and
streamed bodies piece by piece, says which failure happened (no connection, connection lost
mid-answer, no byte in time), honours its connection limit, retries once on a reused connection
the server had closed, and refuses header injection and non-HTTP URLs."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from contextlib import asynccontextmanager
from typing import Any, TypeVar

import pytest
from aiohttp import web

from kvcompass.services.upstream import UpstreamBusy, UpstreamConnectError, UpstreamDisconnected, UpstreamPool, UpstreamTooLarge

T = TypeVar("T")

_LOOPS = ["asyncio"]
try:
    import uvloop

    _LOOPS.append("uvloop")
except ImportError:  # pragma: no cover - uvloop is a runtime dependency where it builds
    uvloop = None  # type: ignore[assignment]


@pytest.fixture(params=_LOOPS)
def run(request: pytest.FixtureRequest) -> Callable[[Coroutine[Any, Any, T]], T]:
    factory = uvloop.new_event_loop if request.param == "uvloop" else None

    def _run(coro: Coroutine[Any, Any, T]) -> T:
        with asyncio.Runner(loop_factory=factory) as r:
            return r.run(asyncio.wait_for(coro, 15))

    return _run


async def _aiohttp_server(app: web.Application) -> tuple[web.AppRunner, str]:
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    return runner, f"http://127.0.0.1:{port}"


Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


async def _raw_server(handler: Handler) -> tuple[asyncio.Server, str]:
    """A socket-level server, for answers aiohttp's server would not give (cut bodies, stalls)."""
    async def owned(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await handler(reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass  # the client went away first: what some tests do on purpose
        finally:
            writer.close()

    srv = await asyncio.start_server(owned, "127.0.0.1", 0)
    port = srv.sockets[0].getsockname()[1]
    return srv, f"http://127.0.0.1:{port}"


@asynccontextmanager
async def _raw_pool(handler: Handler, **pool_kw: Any) -> AsyncIterator[tuple[UpstreamPool, str]]:
    """A raw server running ``handler`` and a pool to it: ``(pool, base URL)``, both closed on
    exit, the pool first."""
    srv, base = await _raw_server(handler)
    pool = UpstreamPool(**pool_kw)
    try:
        yield pool, base
    finally:
        await pool.close()
        srv.close()
        await srv.wait_closed()


async def _read_request(reader: asyncio.StreamReader) -> bytes:
    head = await reader.readuntil(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":", 1)[1])
    return head + await reader.readexactly(length)


def test_keep_alive_reuses_one_connection_and_sends_headers_and_body(run: Callable[[Coroutine[Any, Any, Any]], Any]) -> None:
    peers: list[Any] = []
    seen: list[tuple[str, bytes]] = []

    async def echo(request: web.Request) -> web.Response:
        peers.append(request.transport.get_extra_info("peername") if request.transport else None)
        seen.append((request.headers["X-Tenant"], await request.read()))
        return web.Response(body=b"ok:" + await request.read(), headers={"X-Queue-Ms": "3.5"})

    async def main() -> None:
        app = web.Application()
        app.router.add_post("/v1/completions", echo)
        runner, base = await _aiohttp_server(app)
        pool = UpstreamPool()
        try:
            for i in range(5):
                r = await pool.post(base + "/v1/completions", b"body%d" % i, {"X-Tenant": "acme", "Content-Type": "application/json"})
                assert r.status == 200 and r.headers["x-queue-ms"] == "3.5"
                assert await r.read() == b"ok:body%d" % i
                assert r.at_eof()
                r.release()
        finally:
            await pool.close()
            await runner.cleanup()
        assert seen == [("acme", b"body%d" % i) for i in range(5)]
        assert len(set(peers)) == 1, f"five requests used {len(set(peers))} connections"

    run(main())


def test_chunked_stream_arrives_piece_by_piece_before_the_end(run: Callable[[Coroutine[Any, Any, Any]], Any]) -> None:
    gate = asyncio.Event()

    async def sse(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)  # chunked: no Content-Length
        await resp.write(b"data: 1\n\n")
        await gate.wait()
        await resp.write(b"data: 2\n\n")
        await resp.write_eof()
        return resp

    async def main() -> None:
        app = web.Application()
        app.router.add_post("/s", sse)
        runner, base = await _aiohttp_server(app)
        pool = UpstreamPool(read_timeout_s=5)
        try:
            r = await pool.post(base + "/s", b"{}", {})
            assert r.headers["content-type"] == "text/event-stream"
            got: list[bytes] = []
            async for piece in r.iter_chunks():
                got.append(piece)
                if piece == b"data: 1\n\n":
                    assert not r.at_eof()
                    gate.set()  # the second event exists only after the first was relayed
            assert b"".join(got) == b"data: 1\n\ndata: 2\n\n" and got[0] == b"data: 1\n\n"
            assert r.at_eof()
            r.release()
        finally:
            await pool.close()
            await runner.cleanup()

    run(main())


def test_connection_refused_is_a_connect_error(run: Callable[[Coroutine[Any, Any, Any]], Any]) -> None:
    async def main() -> None:
        async def nothing(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            pass

        srv, base = await _raw_server(nothing)
        srv.close()
        await srv.wait_closed()  # the port is now closed
        pool = UpstreamPool(limit=1, connect_timeout_s=2)
        with pytest.raises(UpstreamConnectError, match="cannot connect"):
            await pool.post(base + "/x", b"", {})
        with pytest.raises(UpstreamConnectError):  # the failed attempt gave its slot back
            await asyncio.wait_for(pool.post(base + "/x", b"", {}), 2)
        await pool.close()

    run(main())


def test_a_body_cut_short_is_a_disconnect_and_the_connection_is_not_reused(run: Callable[[Coroutine[Any, Any, Any]], Any]) -> None:
    async def cut(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nonly-ten-b")
        await writer.drain()
        writer.close()

    async def main() -> None:
        async with _raw_pool(cut) as (pool, base):
            r = await pool.post(base + "/x", b"q", {})
            assert r.status == 200
            with pytest.raises(UpstreamDisconnected, match="before the answer was complete"):
                await r.read()
            assert not r.at_eof()
            r.close()
            assert not pool._free.get(("127.0.0.1", int(base.rsplit(":", 1)[1]), False))

    run(main())


def test_a_close_delimited_body_ends_at_the_close(run: Callable[[Coroutine[Any, Any, Any]], Any]) -> None:
    # No Content-Length, no chunking: the body is whatever comes before the server closes
    # (HTTP/1.0-style servers and some proxies answer so); the connection is not reused.
    async def until_close(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\nhello ")
        await writer.drain()
        await asyncio.sleep(0.02)
        writer.write(b"world")

    async def main() -> None:
        async with _raw_pool(until_close, read_timeout_s=5) as (pool, base):
            r = await pool.post(base + "/x", b"", {})
            assert r.status == 200 and not r.keep_alive
            assert await r.read() == b"hello world" and r.at_eof()
            r.release()
            assert not any(pool._free.values())

    run(main())


def test_garbage_instead_of_http_is_a_disconnect(run: Callable[[Coroutine[Any, Any, Any]], Any]) -> None:
    async def junk(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        writer.write(b"SSH-2.0-OpenSSH_9.6\r\n\r\n")
        await writer.drain()

    async def main() -> None:
        async with _raw_pool(junk) as (pool, base):
            with pytest.raises(UpstreamDisconnected, match="not HTTP"):
                await pool.post(base + "/x", b"", {})

    run(main())


def test_a_stalled_body_times_out_per_read(run: Callable[[Coroutine[Any, Any, Any]], Any]) -> None:
    release = asyncio.Event()

    async def stall(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nabc")
        await writer.drain()
        await release.wait()
        writer.close()

    async def main() -> None:
        async with _raw_pool(stall, read_timeout_s=0.2) as (pool, base):
            try:
                r = await pool.post(base + "/x", b"", {})
                with pytest.raises(TimeoutError):
                    await r.read()
                r.close()
            finally:
                release.set()

    run(main())


def test_the_connection_limit_is_honoured(run: Callable[[Coroutine[Any, Any, Any]], Any]) -> None:
    active = 0
    peak = 0

    async def slow(request: web.Request) -> web.Response:
        nonlocal active, peak
        active += 1
        peak = max(peak, active)
        await asyncio.sleep(0.02)
        active -= 1
        return web.Response(body=b"x")

    async def main() -> None:
        app = web.Application()
        app.router.add_post("/x", slow)
        runner, base = await _aiohttp_server(app)
        pool = UpstreamPool(limit=2)

        async def one() -> bytes:
            r = await pool.post(base + "/x", b"", {})
            try:
                return await r.read()
            finally:
                r.release()

        try:
            assert await asyncio.gather(*[one() for _ in range(8)]) == [b"x"] * 8
        finally:
            await pool.close()
            await runner.cleanup()
        assert peak == 2

    run(main())


def test_a_reused_connection_the_server_closed_is_retried_once_on_a_fresh_one(run: Callable[[Coroutine[Any, Any, Any]], Any]) -> None:
    served = 0

    async def one_then_close(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        # Answers one request keep-alive, then closes the idle connection without a word.
        nonlocal served
        await _read_request(reader)
        served += 1
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
        await writer.drain()
        await asyncio.sleep(0.05)
        writer.transport.abort()

    async def main() -> None:
        async with _raw_pool(one_then_close) as (pool, base):
            r = await pool.post(base + "/x", b"", {})
            assert await r.read() == b"ok"
            r.release()
            await asyncio.sleep(0.2)  # the server has closed the pooled connection by now
            r = await pool.post(base + "/x", b"", {})
            assert await r.read() == b"ok"
            r.release()
        assert served == 2

    run(main())


def test_header_injection_and_bad_urls_are_refused(run: Callable[[Coroutine[Any, Any, Any]], Any]) -> None:
    async def main() -> None:
        pool = UpstreamPool()
        with pytest.raises(ValueError, match="CR or LF"):
            await pool.post("http://127.0.0.1:1/x", b"", {"X-Tenant": "a\r\nX-Admin: 1"})
        with pytest.raises(ValueError, match="CR or LF"):
            await pool.post("http://127.0.0.1:1/x", b"", {"X-Tenant": "a\nb"})
        with pytest.raises(ValueError, match="http"):
            await pool.post("ftp://127.0.0.1/x", b"", {})
        await pool.close()
        with pytest.raises(UpstreamConnectError, match="closed"):
            await pool.post("http://127.0.0.1:1/x", b"", {})
        with pytest.raises(ValueError):
            UpstreamPool(limit=-1)

    run(main())


def test_a_whole_body_larger_than_the_read_buffer_arrives(run: Callable[[Coroutine[Any, Any, Any]], Any]) -> None:
    # Found by reading the code: the socket stops being read past 256 KB buffered, and a whole
    # read only resumed it when it handed the bytes out, after the end: an answer over 256 KB
    # (a completion with n > 1 and logprobs, say) waited for the read deadline and failed.
    big = bytes(range(256)) * (3 * 1024 * 1024 // 256)

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(big) + big)
        await writer.drain()
        await _read_request(reader)  # the connection is reused for the next one

    async def main() -> None:
        async with _raw_pool(answer, read_timeout_s=5.0) as (pool, base):
            r = await pool.post(base + "/x", b"q", {})
            assert await r.read() == big and r.at_eof()
            r.release()
            # A limit on what one answer may hold: past it, an error that says so.
            r = await pool.post(base + "/x", b"q", {})
            with pytest.raises(UpstreamTooLarge, match="exceeds 1048576 bytes"):
                await r.read(limit=1 << 20)
            r.close()

    run(main())


def test_an_endless_answer_head_is_refused(run: Callable[[Coroutine[Any, Any, Any]], Any]) -> None:
    async def endless(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\n")
        for i in range(10_000):
            writer.write(b"X-Pad-%d: %s\r\n" % (i, b"y" * 100))
            await writer.drain()

    async def main() -> None:
        async with _raw_pool(endless, read_timeout_s=5.0) as (pool, base):
            with pytest.raises(UpstreamDisconnected, match="head exceeds"):
                await pool.post(base + "/x", b"q", {})

    run(main())


def test_the_head_deadline_counts_from_the_call_and_ends_only_a_late_answer(run: Callable[[Coroutine[Any, Any, Any]], Any]) -> None:
    # The door's deadline for a worker's answer head is a timer of the pool's exchange (it was
    # an asyncio.timeout around the call). A head that never comes is a TimeoutError at the
    # deadline and its connection is dropped; a head in time cancels the timer, so a body read
    # after the deadline has passed is not cut by it; a wait for a connection slot counts too.
    release = asyncio.Event()
    served = 0

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal served
        while True:
            req = await _read_request(reader)
            served += 1
            if b"/silent" in req:
                await release.wait()
                return
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\n\r\n")
            await writer.drain()
            await asyncio.sleep(0.25)  # the body after the head deadline has passed
            writer.write(b"abc")
            await writer.drain()

    async def main() -> None:
        loop = asyncio.get_running_loop()
        async with _raw_pool(handler, limit=1) as (pool, base):
            try:
                t0 = loop.time()
                with pytest.raises(TimeoutError, match="no answer head within 0.15 s"):
                    await pool.post(base + "/silent", b"", {}, head_timeout=0.15)
                assert 0.14 <= loop.time() - t0 < 1.0
                assert pool._free == {} or all(not c for c in pool._free.values())  # not kept for reuse

                r = await pool.post(base + "/x", b"", {}, head_timeout=0.1)
                assert await r.read() == b"abc"  # read 0.25 s in, past the head deadline
                r.release()

                # The one slot is held: the wait for it is part of the deadline, said as such.
                held = await pool.post(base + "/x", b"", {}, head_timeout=1.0)
                with pytest.raises(UpstreamBusy, match="no connection slot"):  # the pool's limit, not the worker
                    await pool.post(base + "/x", b"", {}, head_timeout=0.05)
                assert await held.read() == b"abc"
                held.release()
            finally:
                release.set()

    run(main())


def test_one_endless_header_value_is_refused_at_the_head_limit(run: Callable[[Coroutine[Any, Any, Any]], Any]) -> None:
    # Review: the limit was checked per header, after a value ended; httptools grew one endless
    # value by copying it, taking the door's memory and loop until the head deadline.
    sent = [0]

    async def endless_value(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nX-Big: ")
        while True:
            writer.write(b"a" * 65536)
            sent[0] += 65536
            await writer.drain()

    async def main() -> None:
        async with _raw_pool(endless_value, read_timeout_s=5.0) as (pool, base):
            t0 = time.monotonic()
            with pytest.raises(UpstreamDisconnected, match="head exceeds"):
                await pool.post(base + "/x", b"q", {}, head_timeout=30)
            assert time.monotonic() - t0 < 5 and sent[0] < 64 << 20

    run(main())


def test_a_second_answer_to_one_request_is_never_read_into_any_answer(run: Callable[[Coroutine[Any, Any, Any]], Any]) -> None:
    # Review: bytes after a whole answer went into it (two answers relayed merged), or, on the
    # reused connection, into the next request's: another client's answer.
    def answer(body: bytes) -> bytes:
        return b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)

    conns = [0]

    async def twice(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conns[0] += 1
        await _read_request(reader)
        writer.write(answer(b"first") + b"HTTP/1.1 200 OK\r\nContent-Length: 6\r\n\r\n")
        await writer.drain()
        await _read_request(reader)
        writer.write(b"SECRET" + answer(b"second"))
        await writer.drain()
        await asyncio.sleep(1)

    async def main() -> None:
        async with _raw_pool(twice, read_timeout_s=5) as (pool, base):
            r = await pool.post(base + "/x", b"1", {})
            assert await r.read() == b"first"
            r.release()
            r2 = await pool.post(base + "/x", b"2", {})
            assert await r2.read() == b"first"  # a fresh connection's first answer, not the stray
            r2.release()
            assert conns[0] == 2

    run(main())


def test_a_body_without_length_or_final_chunking_runs_to_the_close(run: Callable[[Coroutine[Any, Any, Any]], Any]) -> None:
    # Review: "Transfer-Encoding: gzip" alone (close-delimited, RFC 9112 6.3) was read as a cut
    # answer, and the door marked a healthy worker dead.
    async def gzip_te(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip\r\n\r\nokbody")
        await writer.drain()

    async def main() -> None:
        async with _raw_pool(gzip_te, read_timeout_s=5) as (pool, base):
            r = await pool.post(base + "/x", b"", {})
            assert await r.read() == b"okbody" and r.at_eof() and not r.keep_alive
            r.release()

    run(main())
