"""One OpenAI surface: the door and the emulated worker read requests with the same code
(``kvcompass.services.openai_api``), so a body one refuses the other refuses with the same
status, param and code, and both answer in OpenAI's error shape."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import numpy as np
import pytest

from kvcompass.discovery.plane import LocalPlane
from kvcompass.discovery.topology import load_topology
from kvcompass.services.emulated_worker import EmulatedWorker, WorkerConfig
from kvcompass.services.http_door import serve_door
from kvcompass.services.openai_api import INLINE_TOKENIZE_CHARS, OpenAIError, batch_prompt_tokens, chat_tokens, prompt_tokens, token_ids
from kvcompass.engine.tokenizer import load_tokenizer


@contextlib.asynccontextmanager
async def door_and_worker() -> AsyncIterator[tuple[str, EmulatedWorker]]:
    """An emulated worker and an open door in front of it (every worker of the edge's plan
    mapped to it); yields the door's URL and the worker."""
    topo = load_topology("testbed-14x3")
    edge = LocalPlane(topo).edges[topo.regions[0].name]
    worker = EmulatedWorker(WorkerConfig(time_scale=0.0, vram_tokens=1024, dram_tokens=1024, max_model_len=4096))
    await worker.start()
    try:
        door = await serve_door(edge, {w: worker.http_url for w in edge.workers}, load_tokenizer(None))
        try:
            yield door.url, worker
        finally:
            await door.stop(grace_s=1.0)
    finally:
        await worker.stop(drain_timeout_s=5)

# Bodies both surfaces refuse before any worker is chosen (the door) or any token prefilled (the
# worker). Raw bytes where the body is not a JSON object.
CASES: list[tuple[str, Any, bytes | None]] = [
    ("/v1/completions", None, b"{not json"),
    ("/v1/completions", None, b"[" * 50_000),
    # Strict JSON: NaN, Infinity and lone surrogates are not JSON (the standard library's reader
    # took them, and a NaN in a field the door does not check went on to the worker).
    ("/v1/completions", None, b'{"prompt": "hi", "logit_bias": {"1": NaN}}'),
    ("/v1/completions", None, b'{"prompt": "hi", "seed": Infinity}'),
    ("/v1/completions", None, b'{"prompt": "\\ud800"}'),
    ("/v1/completions", [1, 2], None),
    ("/v1/completions", {}, None),
    ("/v1/completions", {"prompt": None}, None),
    ("/v1/completions", {"prompt": []}, None),
    ("/v1/completions", {"prompt": ""}, None),
    ("/v1/completions", {"prompt": [1, -1]}, None),
    ("/v1/completions", {"prompt": [1, 2**32]}, None),
    ("/v1/completions", {"prompt": [1, 2**70]}, None),
    ("/v1/completions", {"prompt": [1.5]}, None),
    ("/v1/completions", {"prompt": [True]}, None),
    ("/v1/completions", {"prompt": [[1, 2], []]}, None),
    ("/v1/completions", {"prompt": ["fine", 7]}, None),
    ("/v1/completions", {"prompt": {"a": 1}}, None),
    ("/v1/chat/completions", {}, None),
    ("/v1/chat/completions", {"messages": "hello"}, None),
    ("/v1/chat/completions", {"messages": []}, None),
    ("/v1/chat/completions", {"messages": ["hi"]}, None),
    ("/v1/chat/completions", {"messages": [{"content": "x"}]}, None),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, None),
    ("/v1/chat/completions", {"messages": [{"role": 7, "content": "x"}]}, None),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"text": "no type"}]}]}, None),
    # vLLM's sampling bounds, one check for both (the door served max_tokens 0 and a negative
    # temperature; found in review).
    ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, None),
    ("/v1/completions", {"prompt": "hi", "temperature": -1}, None),
    ("/v1/completions", {"prompt": "hi", "top_p": 1.5}, None),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0}, None),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "frequency_penalty": -3}, None),
]


async def _answer(s: aiohttp.ClientSession, url: str, body: Any, raw: bytes | None) -> tuple[int, Any, Any, str]:
    kw: dict[str, Any] = {"data": raw, "headers": {"Content-Type": "application/json"}} if raw is not None else {"json": body}
    async with s.post(url, **kw) as r:
        data = await r.json()
    assert set(data) == {"error"} and set(data["error"]) == {"message", "type", "param", "code"}, data
    assert data["error"]["message"]
    return r.status, data["error"]["param"], data["error"]["code"], data["error"]["type"]


def test_the_door_and_the_worker_refuse_the_same_bodies_alike() -> None:
    async def main() -> None:
        async with door_and_worker() as (door_url, worker), aiohttp.ClientSession() as s:
            for path, body, raw in CASES:
                at_door = await _answer(s, door_url + path, body, raw)
                at_worker = await _answer(s, worker.http_url + path, body, raw)
                assert at_door == at_worker, (path, body, raw and raw[:20], at_door, at_worker)
                assert at_door[0] == 400 and at_door[2] is not None, (path, body, at_door)
        assert worker.stats.requests == 0  # nothing reached a prefill

    asyncio.run(main())


def test_long_texts_are_tokenized_off_the_event_loop() -> None:
    # Past the threshold the tokenizer runs in another thread, below it on the loop's own.
    import threading

    seen: list[str] = []

    def encode(text: str) -> list[int]:
        seen.append(threading.current_thread().name)
        return [1] * len(text)

    def template(msgs: list[dict[str, Any]], tools: Any = None, options: Any = None) -> list[int]:
        seen.append(threading.current_thread().name)
        return [2]

    async def main() -> None:
        main_thread = threading.current_thread().name
        short = await prompt_tokens({"prompt": "ab"}, encode, 10)
        long = await prompt_tokens({"prompt": "a" * 11}, encode, 10)
        chat = await chat_tokens({"messages": [{"role": "user", "content": "x" * 11}]}, template, 10)
        assert short.dtype == np.uint32 and len(short) == 2 and len(long) == 11 and list(chat) == [2]
        assert seen[0] == main_thread and seen[1] != main_thread and seen[2] != main_thread
        # Text inside content parts counts too (review: a 4 MB text part ran on the loop).
        await chat_tokens({"messages": [{"role": "user", "content": [{"type": "text", "text": "x" * 11}]}]}, template, 10)
        await chat_tokens({"messages": [{"role": "user", "content": [{"type": "text", "text": "x"}]}]}, template, 10)  # 9 characters with the role and type
        assert seen[3] != main_thread and seen[4] == main_thread
        # Given the body's length, that decides: numbers count (review: a part of millions of
        # integers counted as no text and stalled the loop for seconds).
        numbers = {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"data": list(range(20))}}]}]}
        await chat_tokens(numbers, template, 20)
        await chat_tokens(numbers, template, 20, raw_bytes=len(json.dumps(numbers)))
        assert seen[5] == main_thread and seen[6] != main_thread

    asyncio.run(main())
    assert INLINE_TOKENIZE_CHARS == WorkerConfig().inline_tokenize_chars


def test_a_batch_leaves_the_loop_by_its_total_characters() -> None:
    """Review, twenty-fifth session: each prompt of a batch was held to the threshold alone, so
    256 prompts just under it (5 million characters) were tokenized on the event loop."""
    import threading

    seen: list[str] = []

    def encode(text: str) -> list[int]:
        seen.append(threading.current_thread().name)
        return [1] * len(text)

    async def main() -> None:
        loop_thread = threading.current_thread().name
        small = await batch_prompt_tokens(["ab", "cd", [5, 6]], encode, 10)
        assert [len(x) for x in small] == [2, 2, 2] and seen == [loop_thread] * 2
        seen.clear()
        big = await batch_prompt_tokens(["a" * 6, "b" * 6], encode, 10)  # 12 > 10, each under it
        assert [len(x) for x in big] == [6, 6] and loop_thread not in seen and len(seen) == 2
        with pytest.raises(OpenAIError) as e:
            await batch_prompt_tokens(["a" * 6, ""], encode, 10)
        assert e.value.param == "prompt[1]"

    asyncio.run(main())


def test_token_ids_and_tokenizer_errors() -> None:
    assert token_ids([0, 2**32 - 1]).tolist() == [0, 2**32 - 1]
    for bad in ([-1], [2**32], [2**64], [1.0], [None], [False]):
        with pytest.raises(OpenAIError) as e:
            token_ids(bad)
        assert (e.value.status, e.value.param, e.value.code) == (400, "prompt", "invalid_token_id")

    def broken(text: str) -> list[int]:
        raise ValueError("no such byte")

    with pytest.raises(OpenAIError) as e:
        asyncio.run(prompt_tokens({"prompt": "x"}, broken))
    assert (e.value.status, e.value.code) == (400, "invalid_prompt") and "no such byte" in e.value.message

    def nothing(text: str) -> list[int]:
        return []

    with pytest.raises(OpenAIError) as e:
        asyncio.run(prompt_tokens({"prompt": "x"}, nothing))
    assert e.value.code == "empty_prompt"


def test_n_and_sampling_fields_pass_through_the_door() -> None:
    # n > 1 reaches the worker (which decodes n sequences after one prefill) and comes back as
    # n choices; the door refuses only what is malformed (n not a positive integer).
    async def main() -> None:
        async with door_and_worker() as (door_url, _), aiohttp.ClientSession() as s:
            body = {"prompt": list(range(64)), "max_tokens": 2, "n": 3, "seed": 7, "temperature": 0.5}
            async with s.post(door_url + "/v1/completions", json=body) as r:
                assert r.status == 200
                data = await r.json()
            assert [c["index"] for c in data["choices"]] == [0, 1, 2] and data["usage"]["completion_tokens"] == 6
            assert await _answer(s, door_url + "/v1/completions", {**body, "n": 0}, None) == (400, "n", "invalid_type", "invalid_request_error")
            # Integral floats are the integers (engines' lax pydantic takes them; review found
            # the door refusing max_tokens 16.0); fractions, bools and strings are not.
            async with s.post(door_url + "/v1/completions", json={**body, "n": 2.0, "max_tokens": 2.0}) as r:
                assert r.status == 200, await r.text()
                data = await r.json()
            assert [c["index"] for c in data["choices"]] == [0, 1] and data["usage"]["completion_tokens"] == 4
            async with s.post(door_url + "/v1/completions", json={"prompt": [list(range(64)), list(range(9, 73))], "max_tokens": 1, "n": 2.0}) as r:
                assert r.status == 200, await r.text()
                assert [c["index"] for c in (await r.json())["choices"]] == [0, 1, 2, 3]
            for bad in ({"n": 1.5}, {"max_tokens": 2.5}, {"max_tokens": True}, {"max_tokens": "16"}, {"max_tokens": -1.0}, {"max_tokens": 1e300}, {"n": 2**40}):
                (field,) = bad
                assert await _answer(s, door_url + "/v1/completions", {**body, **bad}, None) == (400, field, "invalid_type", "invalid_request_error"), bad

    asyncio.run(main())
