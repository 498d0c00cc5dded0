"""The load generator's reading of answers against fake doors on loopback: CRLF event streams,
an error body that is not UTF-8, a stream kept open after ``[DONE]``, a run where nothing
succeeds, and ``--edge`` taking its region from the door's ``/health`` (each a review finding of
the twenty-fourth session)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from _support import serve_app
from aiohttp import web

from kvcompass.errors import UsageError

from kvcompass.services.loadgen import LoadPlan, replay, summarize

RELEASE = web.AppKey("release", asyncio.Event)
PLAN = LoadPlan(id=0, session=0, region="us", arrival_s=0.0, prompt_tokens=8, body=b"{}")


@contextlib.asynccontextmanager
async def fake_door(handler: Any) -> AsyncIterator[str]:
    app = web.Application()
    app[RELEASE] = asyncio.Event()
    app.router.add_post("/v1/completions", handler)
    async def health(request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "region": "eu"})

    app.router.add_get("/health", health)
    async with serve_app(app) as url:
        try:
            yield url
        finally:
            app[RELEASE].set()


def stream_handler(sep: bytes, *, hold_open: bool = False, gap_s: float = 0.2) -> Any:
    async def handler(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "x-kvcompass-worker": "eu-0"})
        await resp.prepare(request)
        chunk = {"choices": [{"text": "a"}]}
        await resp.write(b"data: " + json.dumps(chunk).encode() + sep)
        await asyncio.sleep(gap_s)
        await resp.write(b"data: " + json.dumps(chunk).encode() + sep)
        usage = {"choices": [], "usage": {"prompt_tokens_details": {"cached_tokens": 5}}}
        await resp.write(b"data: " + json.dumps(usage).encode() + sep + b"data: [DONE]" + sep)
        if hold_open:  # until the client has gone (the test's door then closes)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(request.app[RELEASE].wait(), 30)
        return resp

    return handler


def run_one(handler: Any, timeout_s: float = 10.0) -> dict[str, Any]:
    async def go() -> dict[str, Any]:
        async with fake_door(handler) as url:
            return (await replay([PLAN], {"us": url}, progress=False, timeout_s=timeout_s, worker_regions={"eu-0": "eu"}))[0]

    return asyncio.run(go())


def test_crlf_and_lf_event_streams_read_the_same() -> None:
    lf, crlf = run_one(stream_handler(b"\n\n")), run_one(stream_handler(b"\r\n\r\n"))
    for rec in (lf, crlf):
        assert rec["error"] is None and rec["output_tokens"] == 2 and rec["cached_tokens"] == 5
        # TTFT is the first event, a gap before the end (a CRLF stream used to read TTFT = E2E).
        assert rec["ttft_ms"] < rec["e2e_ms"] - 150


def test_an_answer_is_whole_at_done_even_if_the_stream_stays_open() -> None:
    rec = run_one(stream_handler(b"\n\n", hold_open=True, gap_s=0.0), timeout_s=3.0)
    assert rec["error"] is None and rec["output_tokens"] == 2 and rec["e2e_ms"] < 2000


def test_an_error_body_that_is_not_utf8_is_one_records_error() -> None:
    async def bad(request: web.Request) -> web.Response:
        return web.Response(status=502, body=b"\xff\xfe\x00bad gateway")

    rec = run_one(bad)
    assert rec["status"] == 502 and "bad gateway" in rec["error"]


def test_a_summary_with_no_success_is_json_and_the_command_fails(tmp_path: Path) -> None:
    s = summarize([{"status": 502, "error": "x", "ttft_ms": None, "e2e_ms": None, "prompt_tokens": 8, "cached_tokens": None, "worker_region": None, "region": "us"}])
    assert s["ok"] == 0 and s["ttft_p50_ms"] is None
    json.loads(json.dumps(s), parse_constant=lambda c: (_ for _ in ()).throw(ValueError(c)))
    trace = Path(__file__).parent / "data" / "conversation_excerpt.jsonl"
    r = subprocess.run(
        [sys.executable, "-m", "kvcompass", "loadgen", "--edge", "http://127.0.0.1:9", "--region", "us", "--trace", str(trace), "--rate", "50", "--arrivals", "poisson", "--max-requests", "2", "--no-progress", "--timeout", "5"],
        capture_output=True, timeout=60,
    )
    assert r.returncode == 1, r.stderr.decode()
    assert json.loads(r.stdout.decode().splitlines()[-1])["errors"] == 2


def test_a_state_file_without_edges_is_a_usage_error(tmp_path: Path) -> None:
    bad = tmp_path / "state.json"
    bad.write_text(json.dumps({"workers": {}}))
    trace = Path(__file__).parent / "data" / "conversation_excerpt.jsonl"
    r = subprocess.run([sys.executable, "-m", "kvcompass", "loadgen", "--state-file", str(bad), "--trace", str(trace), "--rate", "5"], capture_output=True, timeout=60)
    assert r.returncode == 2 and b"not a kvcompass up state file" in r.stderr and b"Traceback" not in r.stderr


def test_single_edge_runs_take_the_edges_region_and_count_reuse() -> None:
    from kvcompass.cli.loadgen import _edge_region

    async def go() -> str:
        async with fake_door(stream_handler(b"\n\n", gap_s=0.0)) as url:
            return await _edge_region(url, None)

    assert asyncio.run(go()) == "eu"
    # Reuse counts whether or not the serving worker's region is known.
    recs = [
        {"status": 200, "error": None, "ttft_ms": 1.0, "e2e_ms": 2.0, "prompt_tokens": 10, "cached_tokens": 4, "worker_region": None, "region": "eu"},
        {"status": 200, "error": None, "ttft_ms": 1.0, "e2e_ms": 2.0, "prompt_tokens": 10, "cached_tokens": 6, "worker_region": "eu", "region": "eu"},
    ]
    s = summarize(recs)
    assert s["reused_tokens"] == 10 and s["local_hit_rate"] == 0.3 and s["xregion_hit_rate"] == 0.0


def test_a_follow_up_waits_for_its_parents_answer_as_the_simulator_sends_it(tmp_path: Path) -> None:
    # A follow-up's prompt holds its parent's answer: sent before that answer exists, it would
    # find less cached than it can (the simulator's --follow-ups after-parent, loadgen alike).
    from kvcompass.services.loadgen import load_requests

    trace = tmp_path / "t.jsonl"
    rows = [
        {"timestamp": 0, "input_length": 32, "output_length": 2, "hash_ids": [1, 2], "chat_id": 10, "parent_chat_id": -1},
        {"timestamp": 1, "input_length": 48, "output_length": 2, "hash_ids": [1, 2, 3], "chat_id": 11, "parent_chat_id": 10},
        {"timestamp": 2, "input_length": 16, "output_length": 2, "hash_ids": [7], "chat_id": 12, "parent_chat_id": -1},
    ]
    trace.write_text("".join(json.dumps(r) + "\n" for r in rows))
    plans = load_requests(str(trace), ["us"], rate=1000.0, block_size=16)
    assert [p.parent for p in plans] == [-1, plans[0].id, -1]
    assert [p.parent for p in load_requests(str(trace), ["us"], rate=1000.0, block_size=16, follow_ups="on-time")] == [-1, -1, -1]
    # Replaying the follow-up alone: its parent is not replayed, so it waits for nothing.
    assert [p.parent for p in load_requests(str(trace), ["us"], rate=1000.0, block_size=16, max_requests=1)] == [-1]

    async def go() -> list[dict[str, Any]]:
        async with fake_door(stream_handler(b"\n\n", gap_s=0.3)) as url:
            return await replay(plans, {"us": url}, progress=False, worker_regions={"eu-0": "eu"})

    parent, child, other = asyncio.run(go())
    assert child["arrival_s"] < 0.01 and child["sent_s"] >= parent["sent_s"] + parent["e2e_ms"] / 1e3 - 0.005, (parent, child)
    assert other["sent_s"] < 0.2  # others keep their arrival times
    bad = [dataclasses.replace(plans[1], parent=99)]
    with pytest.raises(UsageError, match="parents that are not replayed"):
        asyncio.run(replay(bad, {"us": "http://127.0.0.1:1"}, progress=False))
