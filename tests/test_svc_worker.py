"""The emulated vLLM worker over real loopback sockets: OpenAI-shaped completions (whole and SSE),
prefix reuse in ``cached_tokens``, OpenAI error bodies, load headers, metrics and health, the KV
events on ZMQ in vLLM's wire format with the replay socket, and the drain on stop."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any, TypeVar

import aiohttp
import numpy as np
import pytest
import zmq
import zmq.asyncio

from _support import wait_until
from kvcompass.agent import BlockStored, decode_message, decode_payload
from kvcompass.discovery.layout import WorkerSpec
from kvcompass.services.emulated_worker import EmulatedWorker, WorkerConfig, serve_worker
from kvcompass.services.wire import CACHED_HEADER, QUEUE_MS_HEADER as QUEUE_HEADER, WORKER_HEADER
from kvcompass.engine.costs import CostModel

T = TypeVar("T")
END = (-1).to_bytes(8, "big", signed=True)


def run(coro: Coroutine[Any, Any, T], timeout: float = 15.0) -> T:
    return asyncio.run(asyncio.wait_for(coro, timeout))


@contextlib.asynccontextmanager
async def emulated(**kw: Any) -> AsyncIterator[EmulatedWorker]:
    cfg: dict[str, Any] = {"time_scale": 0.0, "vram_tokens": 1024, "dram_tokens": 1024, "max_model_len": 4096}
    cfg.update(kw)
    w = EmulatedWorker(WorkerConfig(**cfg))
    await w.start()
    try:
        yield w
    finally:
        await w.stop(drain_timeout_s=5)


async def post(s: aiohttp.ClientSession, url: str, body: object, *, raw: bytes | None = None, content_type: str = "application/json") -> tuple[int, dict[str, str], Any]:
    kw: dict[str, Any] = {"data": raw, "headers": {"Content-Type": content_type}} if raw is not None else {"json": body}
    async with s.post(url, **kw) as r:
        text = await r.text()
        ctype = r.headers.get("Content-Type", "")
        data = json.loads(text) if ctype.startswith("application/json") else text
        return r.status, dict(r.headers), data


def sse_events(text: str) -> list[Any]:
    """The ``data:`` payloads of an SSE body, checking the framing on the way."""
    assert text.endswith("\n\n")
    out: list[Any] = []
    for block in text.split("\n\n")[:-1]:
        assert block.startswith("data: "), block
        payload = block[len("data: ") :]
        out.append(payload if payload == "[DONE]" else json.loads(payload))
    return out


# ---- completions ------------------------------------------------------------------------------


def test_shared_prefix_is_reused_the_second_time() -> None:
    async def main() -> None:
        async with emulated() as w, aiohttp.ClientSession() as s:
            url = w.http_url + "/v1/completions"
            shared = list(range(1000, 1040))  # two full blocks of 16 and a partial one
            st, h, first = await post(s, url, {"prompt": shared + [7, 8, 9], "max_tokens": 3})
            assert st == 200 and first["usage"]["prompt_tokens_details"] is None  # vLLM: no details when nothing was cached
            assert h[CACHED_HEADER] == "0" and h[WORKER_HEADER] == "worker-0"
            st, h, second = await post(s, url, {"prompt": shared + [1, 2, 3, 4, 5, 6, 7, 8], "max_tokens": 3})
            assert st == 200
            usage = second["usage"]
            assert usage["prompt_tokens_details"]["cached_tokens"] == 32  # the two shared full blocks
            assert usage == {"prompt_tokens": 48, "total_tokens": 51, "completion_tokens": 3, "prompt_tokens_details": {"cached_tokens": 32}}
            assert h[CACHED_HEADER] == "32"
            # Text prompts go through the tokenizer; the same text hits the same blocks.
            text = "You are a helpful assistant. " * 20
            st, _, a = await post(s, url, {"prompt": text, "max_tokens": 1})
            st2, _, b = await post(s, url, {"prompt": [text], "max_tokens": 1})
            assert st == st2 == 200
            assert a["usage"]["prompt_tokens_details"] is None
            n = a["usage"]["prompt_tokens"]
            assert b["usage"]["prompt_tokens_details"]["cached_tokens"] == (n - 1) // 16 * 16 > 0
            assert w.stats.cached_tokens == 32 + (n - 1) // 16 * 16

    run(main())


def test_a_cache_salt_keeps_prompts_apart() -> None:
    async def main() -> None:
        async with emulated() as w, aiohttp.ClientSession() as s:
            url = w.http_url + "/v1/completions"
            prompt = list(range(2000, 2064))
            st, _, a = await post(s, url, {"prompt": prompt, "max_tokens": 1, "cache_salt": "kvcompass:acme"})
            assert st == 200 and a["usage"]["prompt_tokens_details"] is None
            st, _, b = await post(s, url, {"prompt": prompt, "max_tokens": 1})  # unsalted: a stranger
            assert st == 200 and b["usage"]["prompt_tokens_details"] is None
            st, _, c = await post(s, url, {"prompt": prompt, "max_tokens": 1, "cache_salt": "kvcompass:acme"})
            assert st == 200 and c["usage"]["prompt_tokens_details"]["cached_tokens"] == 48  # all but the last block, as vLLM

    run(main())


def test_completion_body_shape_and_determinism() -> None:
    async def main() -> None:
        async with emulated() as w, aiohttp.ClientSession() as s:
            body = {"model": "llama-3.1-8b", "prompt": [5] * 20, "max_tokens": 5}
            st, h, a = await post(s, w.http_url + "/v1/completions", body)
            assert st == 200 and h["Content-Type"].startswith("application/json")
            assert a["object"] == "text_completion" and a["id"].startswith("cmpl-") and a["model"] == "llama-3.1-8b"
            assert isinstance(a["created"], int)
            (choice,) = a["choices"]
            assert choice["index"] == 0 and choice["finish_reason"] == "length" and choice["logprobs"] is None
            _, _, b = await post(s, w.http_url + "/v1/completions", body)
            assert b["choices"][0]["text"] == choice["text"] != ""
            st, _, c = await post(s, w.http_url + "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_completion_tokens": 2})
            assert st == 200 and c["object"] == "chat.completion" and c["id"].startswith("chatcmpl-")
            assert c["choices"][0]["message"]["role"] == "assistant" and c["choices"][0]["finish_reason"] == "length"
            assert c["usage"]["completion_tokens"] == 2
            # vLLM's sampling bounds (found in review: max_tokens 0 and a negative temperature
            # were served); the door checks with the same function.
            for bad, param in (({"max_tokens": 0}, "max_tokens"), ({"temperature": -1}, "temperature"), ({"top_p": 0}, "top_p"), ({"presence_penalty": 2.5}, "presence_penalty")):
                st, _, z = await post(s, w.http_url + "/v1/completions", {"prompt": [1, 2, 3], **bad})
                assert st == 400 and z["error"]["param"] == param, z

    run(main())


def test_sse_stream_format_completions() -> None:
    async def main() -> None:
        async with emulated() as w, aiohttp.ClientSession() as s:
            url = w.http_url + "/v1/completions"
            prompt = list(range(50))
            _, _, whole = await post(s, url, {"prompt": prompt, "max_tokens": 4})
            async with s.post(url, json={"prompt": prompt, "max_tokens": 4, "stream": True, "stream_options": {}}) as r:  # include_usage defaults to true, as in vLLM
                assert r.status == 200
                assert r.headers["Content-Type"].startswith("text/event-stream")
                assert r.headers[CACHED_HEADER] == "48" and float(r.headers[QUEUE_HEADER]) >= 0
                events = sse_events(await r.text())
            assert events[-1] == "[DONE]"
            chunks, usage = events[:-2], events[-2]
            assert len(chunks) == 4
            assert len({c["id"] for c in events[:-1]}) == 1 and chunks[0]["id"].startswith("cmpl-")
            for i, c in enumerate(chunks):
                assert c["object"] == "text_completion" and c["model"] == "llama-3.1-8b"
                assert c["usage"] is None  # include_usage: null on every chunk but the last
                (ch,) = c["choices"]
                assert ch["index"] == 0 and ch["finish_reason"] == ("length" if i == 3 else None)
            assert "".join(c["choices"][0]["text"] for c in chunks) == whole["choices"][0]["text"]
            assert usage["choices"] == []
            assert usage["usage"] == {"prompt_tokens": 50, "total_tokens": 54, "completion_tokens": 4, "prompt_tokens_details": {"cached_tokens": 48}}
            # Without include_usage: no usage key at all, no usage chunk.
            async with s.post(url, json={"prompt": prompt, "max_tokens": 2, "stream": True}) as r:
                events = sse_events(await r.text())
            assert events[-1] == "[DONE]" and len(events) == 3 and all("usage" not in e for e in events[:-1])

    run(main())


def test_n_choices_decode_side_by_side_after_one_prefill() -> None:
    # n > 1 as vLLM serves it: one prefill, n sequences in the decode batch, one choice each
    # (indexed 0..n-1), usage counting every sequence's tokens; streamed chunks name their choice.
    async def main() -> None:
        async with emulated() as w, aiohttp.ClientSession() as s:
            url = w.http_url + "/v1/completions"
            prompt = list(range(40))
            st, _, whole = await post(s, url, {"prompt": prompt, "max_tokens": 3, "n": 3})
            assert st == 200 and [c["index"] for c in whole["choices"]] == [0, 1, 2]
            texts = [c["text"] for c in whole["choices"]]
            assert len(set(texts)) == 3 and all(c["finish_reason"] == "length" for c in whole["choices"])
            assert whole["usage"]["completion_tokens"] == 9 and whole["usage"]["total_tokens"] == 49
            assert w.stats.generated_tokens == 9 and w.stats.prompt_tokens == 40  # one prefill
            async with s.post(url, json={"prompt": prompt, "max_tokens": 3, "n": 3, "stream": True, "stream_options": {"include_usage": True}}) as r:
                events = sse_events(await r.text())
            assert events[-1] == "[DONE]" and events[-2]["usage"]["completion_tokens"] == 9
            by: dict[int, list[dict[str, Any]]] = {}
            for e in events[:-2]:
                (ch,) = e["choices"]
                by.setdefault(ch["index"], []).append(ch)
            assert sorted(by) == [0, 1, 2]
            for i, chs in by.items():
                assert "".join(c["text"] for c in chs) == texts[i]  # the same sequences
                assert [c["finish_reason"] for c in chs] == [None, None, "length"]
            chat = w.http_url + "/v1/chat/completions"
            st, _, c = await post(s, chat, {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "n": 2})
            assert st == 200 and [x["index"] for x in c["choices"]] == [0, 1] and c["usage"]["completion_tokens"] == 4

    run(main())


def test_a_list_of_prompts_is_served_as_vllm_serves_it() -> None:
    # A completions request listing prompts: each prefilled, n sequences each, choice i is
    # sequence i % n of prompt i // n; usage sums every prompt and sequence.
    async def main() -> None:
        async with emulated() as w, aiohttp.ClientSession() as s:
            url = w.http_url + "/v1/completions"
            prompts = [list(range(40)), list(range(100, 120)), "some text to tokenize"]
            st, _, whole = await post(s, url, {"prompt": prompts, "max_tokens": 2, "n": 2})
            assert st == 200 and [c["index"] for c in whole["choices"]] == [0, 1, 2, 3, 4, 5]
            text_tokens = len(w.tokenizer.encode("some text to tokenize"))
            assert whole["usage"]["prompt_tokens"] == 60 + text_tokens and whole["usage"]["completion_tokens"] == 12
            assert w.stats.prompt_tokens == 60 + text_tokens and w.stats.requests == 1
            async with s.post(url, json={"prompt": prompts[:2], "max_tokens": 2, "stream": True, "stream_options": {"include_usage": True}}) as r:
                events = sse_events(await r.text())
            assert events[-1] == "[DONE]" and events[-2]["usage"]["prompt_tokens"] == 60
            assert sorted({e["choices"][0]["index"] for e in events[:-2]}) == [0, 1]
            # Cached tokens are the last prompt's, as vLLM reports them (review, twenty-fifth
            # session: they were summed): the first prompt is cached now, the second is new.
            st, _, again = await post(s, url, {"prompt": [list(range(40)), list(range(500, 540))], "max_tokens": 1})
            assert st == 200 and again["usage"]["prompt_tokens_details"] is None
            st, _, again = await post(s, url, {"prompt": [list(range(600, 640)), list(range(40))], "max_tokens": 1})
            assert st == 200 and again["usage"]["prompt_tokens_details"] == {"cached_tokens": 32}

    run(main())


def test_sse_stream_format_chat() -> None:
    async def main() -> None:
        async with emulated() as w, aiohttp.ClientSession() as s:
            body = {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}], "max_tokens": 3, "stream": True, "stream_options": {"include_usage": True}}
            async with s.post(w.http_url + "/v1/chat/completions", json=body) as r:
                assert r.status == 200
                events = sse_events(await r.text())
            assert events[-1] == "[DONE]"
            first, *content, last, usage = events[:-1]
            assert all(e["object"] == "chat.completion.chunk" for e in events[:-1])
            assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
            assert len(content) == 3 and all(c["choices"][0]["finish_reason"] is None and c["choices"][0]["delta"]["content"] for c in content)
            assert last["choices"][0]["delta"] == {} and last["choices"][0]["finish_reason"] == "length"
            assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 3 and usage["usage"]["prompt_tokens"] > 5

    run(main())


BAD: list[tuple[str, object, bytes | None, int, str | None, str | None]] = [
    ("/v1/completions", None, b"{not json", 400, None, "invalid_json"),
    ("/v1/completions", None, b"[" * 50_000, 400, None, "invalid_json"),
    ("/v1/completions", [1, 2], None, 400, None, "invalid_type"),
    ("/v1/completions", {}, None, 400, "prompt", "missing_prompt"),
    ("/v1/completions", {"prompt": []}, None, 400, "prompt", "empty_prompt"),
    ("/v1/completions", {"prompt": ""}, None, 400, "prompt", "empty_prompt"),
    ("/v1/completions", {"prompt": [1, -1]}, None, 400, "prompt", "invalid_token_id"),
    ("/v1/completions", {"prompt": [1, 2**32]}, None, 400, "prompt", "invalid_token_id"),
    ("/v1/completions", {"prompt": [1.5]}, None, 400, "prompt", "invalid_token_id"),
    ("/v1/completions", {"prompt": [True]}, None, 400, "prompt", "invalid_token_id"),
    ("/v1/completions", {"prompt": [[1, 2], []]}, None, 400, "prompt[1]", "empty_prompt"),
    ("/v1/completions", {"prompt": [[1, 2], [3]], "n": 33}, None, 400, "n", None),
    ("/v1/completions", {"prompt": {"a": 1}}, None, 400, "prompt", "invalid_type"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": -1}, None, 400, "max_tokens", "invalid_type"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": "5"}, None, 400, "max_tokens", "invalid_type"),
    ("/v1/completions", {"prompt": "hi", "n": 0}, None, 400, "n", "invalid_type"),
    ("/v1/completions", {"prompt": "hi", "n": "2"}, None, 400, "n", "invalid_type"),
    ("/v1/completions", {"prompt": "hi", "n": 65}, None, 400, "n", "invalid_type"),
    ("/v1/completions", {"prompt": "hi", "n": 1.5}, None, 400, "n", "invalid_type"),
    ("/v1/completions", {"prompt": "hi", "n": 2, "best_of": 3}, None, 400, "best_of", None),
    ("/v1/completions", {"prompt": "hi", "stream": "yes"}, None, 400, "stream", None),
    ("/v1/completions", {"prompt": "hi", "stream_options": {"include_usage": True}}, None, 400, "stream_options", "invalid_value"),
    ("/v1/completions", {"prompt": "hi", "logprobs": 2}, None, 400, "logprobs", None),
    ("/v1/completions", {"prompt": "hi", "echo": True}, None, 400, "echo", None),
    ("/v1/completions", {"prompt": "hi", "cache_salt": ""}, None, 400, "cache_salt", None),
    ("/v1/completions", {"prompt": "hi", "cache_salt": 7}, None, 400, "cache_salt", None),
    ("/v1/completions", {"prompt": list(range(4000)), "max_tokens": 200}, None, 400, "prompt", "context_length_exceeded"),
    ("/v1/completions", {"prompt": "hi", "model": "gpt-9"}, None, 404, "model", "model_not_found"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function", "function": {"name": "f"}}]}, None, 400, "tools", "unsupported"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "tool_choice": "required"}, None, 400, "tool_choice", "unsupported"),
    ("/v1/chat/completions", {}, None, 400, "messages", "missing_messages"),
    ("/v1/chat/completions", {"messages": "hello"}, None, 400, "messages", "invalid_type"),
    ("/v1/chat/completions", {"messages": [{"role": "", "content": "x"}]}, None, 400, "messages", "invalid_messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": -2}, None, 400, "max_completion_tokens", "invalid_type"),
]


def test_bad_requests_get_openai_errors() -> None:
    async def main() -> None:
        async with emulated() as w, aiohttp.ClientSession() as s:
            for path, body, raw, status, param, code in BAD:
                st, h, data = await post(s, w.http_url + path, body, raw=raw)
                assert st == status, (path, body, data)
                assert h["Content-Type"].startswith("application/json")
                assert set(data) == {"error"} and set(data["error"]) == {"message", "type", "param", "code"}, data
                err = data["error"]
                assert isinstance(err["message"], str) and err["message"]
                assert err["type"] == "invalid_request_error"
                assert err["param"] == param and err["code"] == code, (body, err)
            # JSON under another media type is refused, as the door refuses it.
            st, _, data = await post(s, w.http_url + "/v1/completions", None, raw=b'{"prompt": [1, 2]}', content_type="text/plain")
            assert st == 415 and data["error"]["code"] == "unsupported_media_type"
            for method, path, status in (("GET", "/v1/nothing", 404), ("GET", "/v1/completions", 405)):
                async with s.request(method, w.http_url + path) as r:
                    assert r.status == status
                    data = await r.json()
                    assert set(data["error"]) == {"message", "type", "param", "code"}
            assert w.stats.requests == 0 and w.stats.rejected == len(BAD) + 1
            # The worker still serves after all that.
            st, _, _ = await post(s, w.http_url + "/v1/completions", {"prompt": [1, 2, 3]})
            assert st == 200

    run(main())


def test_models_health_metrics_and_load() -> None:
    async def main() -> None:
        async with emulated(model="qwen-test", worker_id="us-0") as w, aiohttp.ClientSession() as s:
            async with s.get(w.http_url + "/v1/models") as r:
                models = await r.json()
            assert models["object"] == "list" and [m["id"] for m in models["data"]] == ["qwen-test"]
            async with s.get(w.http_url + "/v1/models/qwen-test") as r:
                assert r.status == 200 and await r.json() == models["data"][0]
            async with s.get(w.http_url + "/v1/models/gpt-9") as r:
                assert r.status == 404 and (await r.json())["error"]["code"] == "model_not_found"
            async with s.get(w.http_url + "/health") as r:
                assert r.status == 200
            st, _, _ = await post(s, w.http_url + "/v1/completions", {"model": "qwen-test", "prompt": list(range(40)), "max_tokens": 2})
            assert st == 200
            async with s.get(w.http_url + "/metrics") as r:
                assert r.status == 200 and r.headers["Content-Type"].startswith("text/plain")
                text = await r.text()
            assert 'kvcompass_worker_requests_total{worker="us-0"} 1.0' in text
            assert 'kvcompass_worker_prompt_tokens_total{worker="us-0"} 40.0' in text
            assert 'kvcompass_worker_generation_tokens_total{worker="us-0"} 2.0' in text
            assert 'kvcompass_worker_cache_tokens{tier="vram",worker="us-0"} 32.0' in text
            async with s.get(w.http_url + "/kvcompass/load") as r:
                load = await r.json()
            assert load == {"worker": "us-0", "queue_ms": 0.0, "waiting": 0, "running": 0}

    run(main())


def test_queue_ms_counts_waiting_prefills() -> None:
    async def main() -> None:
        # 1 ms per token: three 100-token prompts, 300 ms of prefill.
        async with emulated(cost=CostModel(prefill_ms_per_token=1.0), time_scale=1.0) as w, aiohttp.ClientSession() as s:
            url = w.http_url + "/v1/completions"
            tasks = [asyncio.create_task(post(s, url, {"prompt": [i] * 100, "max_tokens": 1})) for i in range(3)]
            await wait_until(lambda: w.waiting == 2)
            q = w.queue_ms()
            assert 200.0 <= q <= 300.0, q
            results = await asyncio.gather(*tasks)
            assert all(st == 200 for st, _, _ in results)
            queued = sorted(float(h[QUEUE_HEADER]) for _, h, _ in results)
            assert queued[0] == 0.0 and queued[-1] > 0.0  # the last one out saw an empty queue
            assert w.queue_ms() == 0.0

    run(main())


@pytest.mark.parametrize(
    "kw",
    [
        {"worker_id": ""},
        {"block_size": 0},
        {"vram_tokens": 100},
        {"dram_tokens": -16},
        {"policy": "fifo"},
        {"time_scale": -1.0},
        {"max_model_len": 0},
        {"topic": "kv"},
        {"gpu_sharing": "shared"},
        {"max_batched_tokens": 0},
    ],
)
def test_config_is_checked(kw: dict[str, Any]) -> None:
    from kvcompass.errors import InvalidArgumentError

    with pytest.raises(InvalidArgumentError):
        WorkerConfig(**kw)


def test_from_spec_uses_topology_figures() -> None:
    cfg = WorkerConfig.from_spec(WorkerSpec("eu-1", "eu", beta_ms_per_token=0.05, vram_tokens=1000, dram_tokens=0), 16, time_scale=0.0)
    assert cfg.worker_id == "eu-1" and cfg.vram_tokens == 992 and cfg.dram_tokens == 0
    assert cfg.cost.prefill_ms_per_token == 0.05 and cfg.time_scale == 0.0
    d = WorkerConfig.from_spec(WorkerSpec("us-0", "us"), 16)
    assert d.vram_tokens == 98304 and d.dram_tokens == 1048576


# ---- KV events and replay -----------------------------------------------------------------------


def test_kv_events_on_the_wire_and_replay() -> None:
    async def main() -> None:
        ctx = zmq.asyncio.Context()
        sub = ctx.socket(zmq.SUB)
        dealer = ctx.socket(zmq.DEALER)
        try:
            async with emulated(replay_buffer=3) as w, aiohttp.ClientSession() as s:
                sub.setsockopt(zmq.SUBSCRIBE, b"")
                sub.connect(w.events_endpoint)
                await wait_until(lambda: w.subscribers == 1)
                url = w.http_url + "/v1/completions"
                base = list(range(500, 540))
                await post(s, url, {"prompt": base, "max_tokens": 1})  # blocks 0..31
                frames = await sub.recv_multipart()
                assert len(frames) == 3 and frames[0] == b"" and frames[1] == (0).to_bytes(8, "big")
                msg = decode_message(frames)
                (ev,) = msg.events
                assert isinstance(ev, BlockStored)
                assert ev.parent_block_hash is None and len(ev.block_hashes) == 2 and ev.block_size == 16
                assert list(ev.token_ids) == base[:32] and ev.medium == "GPU"
                await post(s, url, {"prompt": base[:32] + list(range(16)), "max_tokens": 1})  # one new block under it
                frames2 = await sub.recv_multipart()
                msg2 = decode_message(frames2)
                (ev2,) = msg2.events
                assert isinstance(ev2, BlockStored)
                assert msg2.seq == 1 and ev2.parent_block_hash == ev.block_hashes[-1] and list(ev2.token_ids) == list(range(16))
                await post(s, url, {"prompt": base[:32], "max_tokens": 1})  # all cached: nothing to publish
                assert w.next_seq == 2

                # vLLM's replay protocol: [b"", start seq] in, [b"", seq, payload]... then [b"", -1, b""].
                dealer.connect(w.replay_endpoint)
                await dealer.send_multipart([b"", (0).to_bytes(8, "big")])
                got = [await dealer.recv_multipart() for _ in range(3)]
                assert got == [[b"", frames[1], frames[2]], [b"", frames2[1], frames2[2]], [b"", END, b""]]
                await dealer.send_multipart([(1).to_bytes(8, "big")])  # no delimiter: ignored, as vLLM does
                await dealer.send_multipart([b"", (1).to_bytes(8, "big")])
                assert await dealer.recv_multipart() == [b"", frames2[1], frames2[2]]
                assert await dealer.recv_multipart() == [b"", END, b""]

                # The ring is bounded (3 here); messages lost on the PUB socket stay in it.
                w.lose_next_events(2)
                for i in range(2):
                    await post(s, url, {"prompt": [9000 + i] * 16, "max_tokens": 1})
                await post(s, url, {"prompt": [9100] * 16, "max_tokens": 1})
                live = await sub.recv_multipart()
                assert int.from_bytes(live[1], "big") == 4  # seqs 2 and 3 were lost
                await dealer.send_multipart([b"", (0).to_bytes(8, "big")])
                seqs = []
                while True:
                    r = await dealer.recv_multipart()
                    if r[1] == END:
                        break
                    seqs.append(int.from_bytes(r[1], "big"))
                    assert decode_payload(r[2]).events
                assert seqs == [2, 3, 4] and w.stats.lost == 2

                # An engine restart: seq back to 0, ring emptied, new hashes for the same tokens.
                w.restart_engine()
                await post(s, url, {"prompt": base, "max_tokens": 1})
                again = decode_message(await sub.recv_multipart())
                (ev3,) = again.events
                assert isinstance(ev3, BlockStored)
                assert again.seq == 0 and list(ev3.token_ids) == base[:32] and ev3.block_hashes != ev.block_hashes
        finally:
            sub.close(linger=0)
            dealer.close(linger=0)
            ctx.term()

    run(main())


def test_dram_tier_events_use_cpu_medium() -> None:
    async def main() -> None:
        ctx = zmq.asyncio.Context()
        sub = ctx.socket(zmq.SUB)
        try:
            async with emulated(vram_tokens=32, dram_tokens=64) as w, aiohttp.ClientSession() as s:
                sub.setsockopt(zmq.SUBSCRIBE, b"")
                sub.connect(w.events_endpoint)
                await wait_until(lambda: w.subscribers == 1)
                url = w.http_url + "/v1/completions"
                a, b = [1] * 32, [2] * 32
                await post(s, url, {"prompt": a, "max_tokens": 1})
                await post(s, url, {"prompt": b, "max_tokens": 1})  # pushes a to DRAM
                await sub.recv_multipart()
                demote = decode_message(await sub.recv_multipart())
                media = {(type(e).__name__, getattr(e, "medium", None)) for e in demote.events}
                assert ("BlockStored", "CPU") in media and ("BlockRemoved", "GPU") in media
                st, _, again = await post(s, url, {"prompt": a, "max_tokens": 1})  # reloaded from DRAM
                assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 16  # the first block; the last is recomputed
        finally:
            sub.close(linger=0)
            ctx.term()

    run(main())


def test_stop_drains_in_flight_requests() -> None:
    async def main() -> None:
        w = EmulatedWorker(WorkerConfig(time_scale=1.0, cost=CostModel(prefill_ms_per_token=1.0), vram_tokens=1024, dram_tokens=0))
        await w.start()
        try:
            async with aiohttp.ClientSession() as s:
                url = w.http_url + "/v1/completions"
                slow = asyncio.create_task(post(s, url, {"prompt": list(range(200)), "max_tokens": 1}))  # 200 ms prefill
                await wait_until(lambda: w.queue_ms() > 0)
                stopping = asyncio.create_task(w.stop(drain_timeout_s=5))
                await asyncio.sleep(0.02)
                async with s.get(w.http_url + "/health") as r:
                    assert r.status == 503
                st, _, data = await post(s, url, {"prompt": [1, 2, 3]})
                assert st == 503 and data["error"]["code"] == "draining" and data["error"]["param"] is None
                st, _, done = await slow
                assert st == 200 and done["usage"]["prompt_tokens"] == 200
                await stopping
                with pytest.raises(aiohttp.ClientConnectionError):
                    await post(s, url, {"prompt": [1, 2, 3]})
        finally:
            await w.stop()

    run(main())


def test_prompt_as_numpy_compatible_ids_round_trip() -> None:
    # Token ids above the tokenizer's vocabulary are accepted (trace replays send any u32).
    async def main() -> None:
        async with emulated() as w, aiohttp.ClientSession() as s:
            ids = np.arange(2**32 - 40, 2**32, dtype=np.uint64).tolist()
            st, _, data = await post(s, w.http_url + "/v1/completions", {"prompt": ids, "max_tokens": 1})
            assert st == 200 and data["usage"]["prompt_tokens"] == 40

    run(main())


def test_serve_worker_runs_until_stopped() -> None:
    async def main() -> None:
        stop = asyncio.Event()
        ready: list[EmulatedWorker] = []
        task = asyncio.create_task(serve_worker(WorkerConfig(time_scale=0.0), port=0, ready=ready.append, stop=stop, handle_signals=False))
        await wait_until(lambda: bool(ready))
        (w,) = ready
        assert w.events_endpoint.startswith("tcp://127.0.0.1:") and w.replay_endpoint.startswith("tcp://127.0.0.1:")
        async with aiohttp.ClientSession() as s:
            st, _, _ = await post(s, w.http_url + "/v1/completions", {"prompt": [1, 2, 3]})
            assert st == 200
            stop.set()
            await task
            with pytest.raises(aiohttp.ClientConnectionError):
                await post(s, w.http_url + "/v1/completions", {"prompt": [1, 2, 3]})

    run(main())


@pytest.mark.parametrize("sharing", ["chunked", "lanes"])
def test_a_long_prompt_stalls_the_sequences_decoding_beside_it_when_chunked(sharing: str) -> None:
    """A 400-token prompt at 1 ms/token arrives while a stream decodes (about 10 ms a token).
    Sharing the GPU in vLLM's steps, one of the stream's tokens waits for the whole chunk
    (sleeps never end early, so the gap is at least 400 ms); on separate lanes it never does."""

    async def main() -> None:
        async with emulated(cost=CostModel(prefill_ms_per_token=1.0), time_scale=1.0, gpu_sharing=sharing) as w, aiohttp.ClientSession() as s:
            url = w.http_url + "/v1/completions"
            stamps: list[float] = []
            loop = asyncio.get_running_loop()

            async def stream() -> None:
                async with s.post(url, json={"prompt": [7] * 16, "max_tokens": 60, "stream": True}) as r:
                    assert r.status == 200
                    async for _ in r.content.iter_any():
                        stamps.append(loop.time())

            task = asyncio.create_task(stream())
            await wait_until(lambda: w.running == 1 and len(stamps) >= 3)
            st, _, _ = await post(s, url, {"prompt": list(range(1, 401)), "max_tokens": 1})
            assert st == 200
            await task
            gap = max(b - a for a, b in zip(stamps, stamps[1:]))
            if sharing == "chunked":
                assert gap >= 0.4, gap
            else:
                assert gap < 0.3, gap

    run(main(), timeout=30.0)


def test_stop_strings_and_stop_token_ids_end_a_sequence_as_vllm_does() -> None:
    """``stop`` ends the text before the first stop string (with it under
    ``include_stop_str_in_output``), ``stop_token_ids`` end it without showing the token,
    ``finish_reason`` is ``stop`` with the ``stop_reason``, usage counts the tokens generated,
    and a stream never shows text a stop string takes back (found in review: ``stop`` was
    ignored, every answer ran to max_tokens)."""

    async def main() -> None:
        async with emulated() as w, aiohttp.ClientSession() as s:
            url = w.http_url + "/v1/completions"
            body = {"prompt": [5, 6, 7], "max_tokens": 12}
            _, _, full = await post(s, url, body)
            text = full["choices"][0]["text"]
            words = text.split(" ")[1:]  # each token is " word"
            assert len(words) == 12
            cut = " " + words[4][:2]  # the middle of the fifth token: a stop string across pieces
            _, _, got = await post(s, url, {**body, "stop": ["never there", cut]})
            c = got["choices"][0]
            assert (c["text"], c["finish_reason"], c["stop_reason"]) == (" " + " ".join(words[:4]), "stop", cut)
            assert got["usage"]["completion_tokens"] == 5
            _, _, kept = await post(s, url, {**body, "stop": cut, "include_stop_str_in_output": True})
            assert kept["choices"][0]["text"] == " " + " ".join(words[:4]) + cut
            # A stop token: the sixth token's id ends the sequence before it.
            ids = {word: i for i, word in w._words}
            _, _, tok = await post(s, url, {**body, "stop_token_ids": [ids[" " + words[5]]]})
            assert (tok["choices"][0]["text"], tok["choices"][0]["stop_reason"]) == (" " + " ".join(words[:5]), ids[" " + words[5]])
            # Streamed: the same text in pieces, nothing past the cut ever sent.
            async with s.post(url, json={**body, "stop": cut, "stream": True, "stream_options": {"include_usage": True}}) as r:
                events = sse_events(await r.text())
            pieces = [e["choices"][0] for e in events[:-1] if e != "[DONE]" and e["choices"]]
            assert "".join(p["text"] for p in pieces) == " " + " ".join(words[:4])
            assert pieces[-1]["finish_reason"] == "stop" and all(p["finish_reason"] is None for p in pieces[:-1])
            assert events[-2]["usage"]["completion_tokens"] == 5 and events[-1] == "[DONE]"
            for bad in ({"stop": 5}, {"stop": ["a", 1]}, {"stop_token_ids": ["x"]}, {"include_stop_str_in_output": "yes"}):
                st, _, err = await post(s, url, {**body, **bad})
                assert st == 400 and err["error"]["param"] == next(iter(bad)), err

    run(main())


def test_stops_take_the_lists_order_and_a_stop_tokens_text_is_kept_only_when_asked() -> None:
    """As vLLM checks them (found in review): the first string of the list that the text holds
    wins, not the earliest in the text; ``include_stop_str_in_output`` keeps a stop token's
    text too. And ``echo`` with ``max_tokens`` 0 (the prompt alone) passes the sampling check."""
    from kvcompass.services.emulated_worker import _Stops
    from kvcompass.services.openai_api import sampling_fields

    s = _Stops(("b", "ab"), frozenset(), False)
    assert s.feed(1, "x") == "" and s.feed(2, "ab") == "xa" and s.reason == "b"
    t = _Stops((), frozenset({7}), True)
    assert t.feed(1, "x") == "x" and t.feed(7, "y") == "y" and t.reason == 7
    u = _Stops((), frozenset({7}), False)
    assert u.feed(1, "x") == "x" and u.feed(7, "y") == "" and u.reason == 7
    assert sampling_fields({"prompt": "x", "echo": True, "max_tokens": 0}) == 1
