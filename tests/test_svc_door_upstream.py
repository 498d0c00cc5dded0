"""The door against workers and clients that misbehave at the socket level (a review of the
twenty-fourth session): a client that stops reading, a pool whose connection limit is busy, a
migration target that never answers, and a drain while a large answer is still being written.
Workers here are raw asyncio servers on loopback."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
import numpy as np

from _support import ByteTokenizer
from kvcompass.discovery.migration import MigrationAction
from kvcompass.discovery.plane import LocalPlane
from kvcompass.discovery.topology import load_topology
from kvcompass.index_types import Namespace, Tier
from kvcompass.services.http_door import DoorConfig, DoorServer, serve_door

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


async def read_request(reader: asyncio.StreamReader) -> dict[str, Any]:
    head = await reader.readuntil(b"\r\n\r\n")
    n = next((int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length:")), 0)
    return json.loads(await reader.readexactly(n))  # type: ignore[no-any-return]


def whole(body: bytes) -> bytes:
    return b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)


ANSWER = json.dumps({"id": "c", "object": "text_completion", "choices": [{"index": 0, "text": "ok", "finish_reason": "stop"}], "usage": {"prompt_tokens": 2, "completion_tokens": 1, "total_tokens": 3}}).encode()


@asynccontextmanager
async def door_before(handler: Handler, **cfg: Any) -> AsyncIterator[tuple[DoorServer, list[asyncio.StreamWriter]]]:
    """A door of testbed-14x3's us edge whose one worker (us-0) is ``handler``."""
    conns: list[asyncio.StreamWriter] = []

    async def owned(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        conns.append(w)
        try:
            await handler(r, w)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            w.close()

    srv = await asyncio.start_server(owned, "127.0.0.1", 0)
    base = f"http://127.0.0.1:{srv.sockets[0].getsockname()[1]}"
    edge = LocalPlane(load_topology("testbed-14x3"), seed=3).edges["us"]
    cfg.setdefault("migration_poll_s", 0)
    door = await serve_door(edge, {"us-0": base}, ByteTokenizer(), config=DoorConfig(**cfg))
    try:
        yield door, conns
    finally:
        await door.stop(grace_s=0.5)
        for w in conns:
            w.transport.abort()
        srv.close()


def raw_client(port: int, body: dict[str, Any], rcvbuf: int = 4096) -> socket.socket:
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    s.connect(("127.0.0.1", port))
    s.setblocking(False)
    b = json.dumps(body).encode()
    s.send(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(b) + b)
    return s


def test_a_client_that_stops_reading_is_cut_and_frees_the_workers_connection() -> None:
    # Review: the relay waited on the client without a deadline, holding the worker's stream
    # and the pool's one slot; other requests then timed out and marked the worker dead.
    async def worker(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        while True:
            body = await read_request(r)
            if not body.get("stream"):
                w.write(whole(ANSWER))
                await w.drain()
                continue
            w.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")
            ev = b"data: " + json.dumps({"choices": [{"index": 0, "text": "x" * 60000}]}).encode() + b"\n\n"
            while True:
                w.write(b"%x\r\n%s\r\n" % (len(ev), ev))
                await w.drain()

    async def go() -> None:
        async with door_before(worker, max_upstream_connections=1, client_write_timeout_s=0.5, head_timeout_s=5.0) as (door, _):
            s = raw_client(door.port, {"model": "llama-3.1-8b", "prompt": "hi", "max_tokens": 2, "stream": True})
            try:
                await asyncio.sleep(0.3)
                t0 = time.monotonic()
                async with aiohttp.ClientSession() as c:
                    async with c.post(door.url + "/v1/completions", json={"model": "llama-3.1-8b", "prompt": "other", "max_tokens": 2}) as r:
                        assert r.status == 200, await r.text()
                assert time.monotonic() - t0 < 4.0
                assert door.door.dead_workers() == set()
            finally:
                s.close()

    asyncio.run(go())


def test_a_busy_connection_limit_is_a_503_and_marks_no_worker_dead() -> None:
    release = asyncio.Event()

    async def worker(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await read_request(r)  # a stream: its head at once, its end when released (the slot held)
        w.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")
        ev = b"data: " + json.dumps({"choices": [{"index": 0, "text": "x"}]}).encode() + b"\n\n"
        w.write(b"%x\r\n%s\r\n" % (len(ev), ev))
        await w.drain()
        await release.wait()
        w.write(b"%x\r\n%s\r\n0\r\n\r\n" % (len(b"data: [DONE]\n\n"), b"data: [DONE]\n\n"))
        await w.drain()

    async def go() -> None:
        async with door_before(worker, max_upstream_connections=1, head_timeout_s=0.3) as (door, _):
            async with aiohttp.ClientSession() as c:
                held = await c.post(door.url + "/v1/completions", json={"model": "llama-3.1-8b", "prompt": "a", "max_tokens": 1, "stream": True})
                assert held.status == 200
                async with c.post(door.url + "/v1/completions", json={"model": "llama-3.1-8b", "prompt": "b", "max_tokens": 1}) as r:
                    body = await r.json()
                    assert r.status == 503 and body["error"]["code"] == "busy", body
                assert door.door.dead_workers() == set()
                release.set()
                assert b"[DONE]" in await held.read()
                held.release()

    asyncio.run(go())


def test_a_migration_target_that_never_answers_fails_within_the_head_deadline() -> None:
    # Review: the migration's POST had no head deadline; four such targets stopped migrations
    # for the life of the process.
    async def silent(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await read_request(r)
        await asyncio.sleep(30)

    async def go() -> None:
        async with door_before(silent, head_timeout_s=0.3) as (door, _):
            ns = Namespace("llama-3.1-8b", "public")
            door.door._names[ns.digest] = (ns.model, ns.tenant)
            tokens = np.arange(64, dtype=np.uint32)
            action = MigrationAction("recompute", 1, ns.digest, 64, "eu-0", "eu", "us-0", "us", Tier.DRAM, 0.0, tokens)
            t0 = time.monotonic()
            row = await asyncio.wait_for(door.door.migrate(action), 5)
            assert row["outcome"] == "failed" and time.monotonic() - t0 < 2.0, row

    asyncio.run(go())


def test_a_drain_lets_a_large_answer_finish_reaching_a_slow_reader() -> None:
    # Review: the handler returned with 16 MB still to send; a second later the drain aborted
    # the connection, well inside its 30 s grace.
    big = json.dumps({"id": "x", "choices": [{"index": 0, "text": "y" * (8 << 20)}]}).encode()

    async def worker(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        while True:
            await read_request(r)
            w.write(whole(big))
            await w.drain()

    async def go() -> None:
        async with door_before(worker) as (door, _):
            loop = asyncio.get_running_loop()
            s = raw_client(door.port, {"model": "llama-3.1-8b", "prompt": "hi", "max_tokens": 2}, rcvbuf=65536)
            got = bytearray()

            async def reader() -> None:
                while True:
                    d = await loop.sock_recv(s, 65536)
                    if not d:
                        return
                    got.extend(d)
                    await asyncio.sleep(0.02)  # about 3 MB/s: past the drain's old 1 s

            rt = asyncio.ensure_future(reader())
            try:
                await asyncio.sleep(0.3)
                await asyncio.gather(door.stop(grace_s=20), rt)
            finally:
                s.close()
            head, _, body = bytes(got).partition(b"\r\n\r\n")
            length = int(next(line for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")).split(b":")[1])
            assert len(body) == length == len(big)

    asyncio.run(go())
