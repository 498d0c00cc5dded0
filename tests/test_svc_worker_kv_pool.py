"""The emulated worker's running sequences and its prefix cache share one KV pool, the
simulator's rule (``KvPool`` in the extension): a prompt whose blocks and answer do not fit
beside the running sequences waits for one of them to finish; a prompt they already hold
costs only its answer; ``kv_pool="unbounded"`` admits everything at once."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import numpy as np
import pytest

from kvcompass._core import KvPool
from kvcompass.errors import InvalidArgumentError
from kvcompass.services.emulated_worker import WorkerConfig

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
                await ra.read()  # A's answer to its end
                done.append("A")
                await c_task
            if pool == "shared":
                assert done == ["B", "A", "C"] and w.stats.kv_waits == 1
            else:
                assert done[-1] == "A" and w.stats.kv_waits == 0

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
