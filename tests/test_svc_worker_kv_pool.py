"""The emulated worker's running sequences and its prefix cache share one KV pool, the
simulator's rule (``KvPool`` in the extension): a prompt whose blocks and answer do not fit
beside the running sequences waits for one of them to finish; a prompt they already hold
costs only its answer; ``kv_pool="unbounded"`` admits everything at once."""

from __future__ import annotations

import asyncio
import contextlib
import json
from typing import Any

import aiohttp
import numpy as np
import pytest

from kvcompass._core import KvPool
from kvcompass.errors import InvalidArgumentError
from kvcompass.services.emulated_worker import EmulatedWorker, WorkerConfig

from test_svc_worker import emulated, post, run


def _first_token(r: aiohttp.ClientResponse) -> Any:
    return r.content.readuntil(b"\n\n")


@pytest.mark.parametrize("pool", ["shared", "unbounded"])
def test_a_prompt_waits_for_room_unless_the_running_sequence_holds_it(pool: str) -> None:
    """2,048 tokens of VRAM (128 blocks). A holds a 1,024-token prompt (64 blocks) and 25 blocks
    for its 401-token answer while it decodes. B, the same prompt, needs only its own 25: it
    runs beside A. C, another 1,024-token prompt, needs 89 more: it waits until A is done."""

    async def main() -> None:
        async with emulated(vram_tokens=2048, time_scale=0.02, kv_pool=pool) as w, aiohttp.ClientSession() as s:
            url = w.http_url + "/v1/completions"
            a = list(range(1, 1025))
            c = list(range(5000, 6024))
            async with s.post(url, json={"prompt": a, "max_tokens": 401, "stream": True}) as ra:
                await _first_token(ra)  # A's prefill is done; it decodes
                done: list[str] = []

                async def short(name: str, prompt: list[int]) -> None:
                    st, _, _ = await post(s, url, {"prompt": prompt, "max_tokens": 2})
                    assert st == 200
                    done.append(name)

                b_task = asyncio.ensure_future(short("B", a))
                c_task = asyncio.ensure_future(short("C", c))
                await b_task
                assert done == ["B"]  # B fit beside A (C may be waiting or done)
                if pool == "shared":
                    await asyncio.sleep(0.05)
                    assert w.waiting == 1 and w.queue_ms() > 0  # C, waiting for room, is in the load report
                await c_task
                generated_by_then = w.stats.generated_tokens
                await ra.read()  # A's answer to its end
            if pool == "shared":
                # C started once A's sequence was generated (its KV let go then, whatever A's
                # client had read: vLLM frees a finished sequence's blocks at once).
                assert generated_by_then == 401 + 2 + 2 and w.stats.kv_waits == 1
            else:
                assert generated_by_then < 401 + 2 + 2 and w.stats.kv_waits == 0

    run(main(), timeout=30)


def test_the_cache_gives_the_answers_their_room_and_gets_it_back() -> None:
    """A 1,024-token prompt cached whole (64 of 128 blocks), then another prompt whose 1,601-token
    answer reserves 100 blocks: the cache keeps 28, so most of the first prompt goes to DRAM;
    once that answer is done the cache has all 128 again."""

    async def main() -> None:
        async with emulated(vram_tokens=2048, dram_tokens=4096) as w, aiohttp.ClientSession() as s:
            url = w.http_url + "/v1/completions"
            first = list(range(1, 1025))
            await post(s, url, {"prompt": first, "max_tokens": 1})
            assert w.cache.lookup(first) == (1024, 0)
            await post(s, url, {"prompt": list(range(9000, 9016)), "max_tokens": 1601})
            v, d = w.cache.lookup(first)
            assert v + d == 1024 and d >= (64 - 28) * 16
            assert w.cache.vram_capacity_tokens == 2048  # given back

    run(main())


def test_the_pool_refuses_what_it_cannot_mean() -> None:
    with pytest.raises(InvalidArgumentError, match="kv_pool must be 'shared' or 'unbounded', got 'none'"):
        WorkerConfig(kv_pool="none")
    with pytest.raises(InvalidArgumentError, match="at least one block"):
        KvPool(0)
    p = KvPool(4)
    h = p.hold(np.array([1, 2], dtype=np.uint64), 1)
    assert (p.held, p.reserved, p.cache_blocks) == (1, 1, 3)
    p.release(h)
    with pytest.raises(InvalidArgumentError, match="holds nothing"):
        p.release(h)


def test_a_list_of_prompts_is_queued_whole_so_no_waiting_prompt_gets_between() -> None:
    """Request A lists two 1,024-token prompts with 401-token answers; request B, another
    1,024-token prompt, arrives during A's first prefill and must wait for room that only A's
    end frees. Queued one by one, A's second prompt sat behind B for good (found in review: the
    worker stalled); queued together, A runs to its end and then B does."""

    async def main() -> None:
        async with emulated(vram_tokens=2048, time_scale=0.5, kv_pool="shared") as w, aiohttp.ClientSession() as s:
            url = w.http_url + "/v1/completions"
            a = post(s, url, {"prompt": [list(range(1, 1025)), list(range(2000, 3024))], "max_tokens": 401})
            a_task = asyncio.ensure_future(a)
            await asyncio.sleep(0.02)  # A's first prefill takes about 43 ms here
            b = await post(s, url, {"prompt": list(range(5000, 6024)), "max_tokens": 2})
            st_a, _, body_a = await a_task
            assert st_a == 200 and len(body_a["choices"]) == 2 and b[0] == 200
            assert w._kv is not None and w._kv.held == 0 and w.cache.vram_capacity_tokens == 2048

    run(main(), timeout=20)


def test_a_release_never_shrinks_the_cache_behind_the_agents_back() -> None:
    """A 1,024-token prompt X is cached (64 of 128 blocks). Y (2 blocks reserved) is decoding and
    Z's prefill has started, reserving 75: the cache still has the 126 blocks of Y's time until
    Z's prefill ends. When Y finishes then, its release gives room back and takes none (found
    in review: it shrank the cache to 53 blocks, demoting X's blocks without an event)."""
    w = EmulatedWorker(WorkerConfig(time_scale=0.0, vram_tokens=2048, dram_tokens=4096, max_model_len=4096))
    assert w._kv is not None
    x = np.arange(1, 1025, dtype=np.uint32)
    w.cache.admit(x, 0.0)
    y = w._kv.hold(np.array([1], dtype=np.uint64), 2)
    w.cache.fit_to_pool(w._kv)  # Y's prefill ended: 126 blocks
    w._kv.hold(np.arange(100, 164, dtype=np.uint64), 75)  # Z's prefill is under way
    w._kv_release(y)
    assert w.cache.vram_capacity_tokens == 126 * 16 and w.cache.lookup(x) == (1024, 0)


def test_a_client_reading_slowly_does_not_hold_the_pool() -> None:
    """A's 40,000-token answer goes to a client that reads only its first event (a receive
    buffer of 4 KiB: the answer cannot all be sent). Once A's sequence is generated its KV is
    free, so C, which needs that room, is served while A's client still has not read. Before,
    the worker let go of A's KV only after the last byte went out: C waited for A's reader."""
    import socket

    async def main() -> None:
        async with emulated(vram_tokens=48_000, dram_tokens=0, max_model_len=65_536) as w, aiohttp.ClientSession() as s:
            host, port = w.http_url.removeprefix("http://").rsplit(":", 1)
            body = json.dumps({"prompt": list(range(1, 65)), "max_tokens": 40_000, "stream": True}).encode()
            sock = socket.socket()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            sock.setblocking(False)
            loop = asyncio.get_running_loop()
            await loop.sock_connect(sock, (host, int(port)))
            head = f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n".encode()
            await loop.sock_sendall(sock, head + body)
            got = b""
            while b"data:" not in got:
                got += await loop.sock_recv(sock, 1024)
            try:
                async with asyncio.timeout(20):
                    while w.stats.generated_tokens < 40_000:
                        await asyncio.sleep(0.01)
                async with asyncio.timeout(10):
                    st, _, _ = await post(s, w.http_url + "/v1/completions", {"prompt": list(range(5000, 5000 + 8192)), "max_tokens": 2})
                assert st == 200 and w.stats.kv_waits <= 1
            finally:
                sock.close()

    run(main(), timeout=60)


def test_a_request_whose_client_leaves_while_it_waits_for_room_is_aborted() -> None:
    """C waits for room behind A's sequence; its client goes away. The worker aborts C at once,
    as vLLM aborts a disconnected request (found in review: C stayed first in line until A
    ended, holding D, which fits, behind it)."""

    async def main() -> None:
        async with emulated(vram_tokens=2048, time_scale=0.5) as w, aiohttp.ClientSession() as s:
            url = w.http_url + "/v1/completions"
            async with s.post(url, json={"prompt": list(range(1, 1025)), "max_tokens": 401, "stream": True}) as ra:
                await _first_token(ra)  # A decodes, holding 89 of 128 blocks
                c = asyncio.ensure_future(post(s, url, {"prompt": list(range(5000, 6024)), "max_tokens": 2}))
                async with asyncio.timeout(5):
                    while w.stats.kv_waits < 1:
                        await asyncio.sleep(0.01)
                c.cancel()  # C's client goes away
                with contextlib.suppress(asyncio.CancelledError):
                    await c
                st, _, _ = await post(s, url, {"prompt": list(range(9000, 9016)), "max_tokens": 2})  # D: 2 blocks
                assert st == 200 and w.running == 1  # served while A still decodes
                assert w.waiting == 0
                await ra.read()

    run(main(), timeout=30)


def test_a_whole_answer_whose_client_leaves_stops_decoding() -> None:
    """A non-streamed request's client goes away while its sequence decodes: the worker stops it
    at the next token and lets go of its KV, as vLLM aborts a disconnected request (found in
    review: it decoded its 400 tokens for nobody)."""
    from _support import wait_until

    async def main() -> None:
        async with emulated(vram_tokens=2048, time_scale=0.5) as w, aiohttp.ClientSession() as s:
            url = w.http_url + "/v1/completions"
            c = asyncio.ensure_future(post(s, url, {"prompt": list(range(1, 1025)), "max_tokens": 400}))
            await wait_until(lambda: w.running == 1, timeout=5.0)
            c.cancel()  # its client goes away mid-answer
            with contextlib.suppress(asyncio.CancelledError):
                await c
            await wait_until(lambda: w.running == 0, timeout=2.0)  # 400 tokens would take far longer
            st, _, _ = await post(s, url, {"prompt": list(range(9000, 9016)), "max_tokens": 2})
            assert st == 200

    run(main(), timeout=30)
