"""``kvcompass loadgen``: replays a trace through the edges' HTTP doors, open loop, and records
what every request saw.

Each request goes to the edge of its region (the trace's sessions are assigned regions as the
simulator assigns them, :func:`kvcompass.sim.workload.load_trace`), at its rescaled arrival
time whether or not earlier requests have finished (open loop: a slow cluster must show up as
latency, not as a lower offered load), except that a follow-up whose prompt continues another
request's answer (a trace's ``parent_chat_id``) waits for that answer, as the simulator's
default ``--follow-ups after-parent`` does: its prompt holds output that does not exist before. Prompts are sent as token ids, so the ids the workers
cache are exactly the trace's. Every request streams with ``include_usage``, because the first
content event is the only honest TTFT and the final usage chunk carries ``cached_tokens``.

A record per request (JSONL with ``--out``): ``id, session, region, edge, arrival_s, sent_s, status,
worker, worker_region, prompt_tokens, cached_tokens, output_tokens, ttft_ms, e2e_ms, error``.
:func:`summarize` turns records into the figures the main job tabulates; hit rates are
token-weighted (reused tokens / prompt tokens), split by whether the serving worker is in the
request's own region (local) or not (cross-region).
"""

from __future__ import annotations

import asyncio
import json
import re
import ssl
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np

from kvcompass.errors import UsageError
from kvcompass.services.wire import WORKER_HEADER

__all__ = ["LoadPlan", "load_requests", "replay", "summarize"]


@dataclass(frozen=True, slots=True)
class LoadPlan:
    """One request, ready to send."""

    id: int
    session: int
    region: str
    arrival_s: float
    prompt_tokens: int
    body: bytes
    parent: int = -1
    """The id of the request whose answer this one's prompt continues (-1: none, or not waited
    for): it is sent no earlier than that answer has arrived."""


def load_requests(
    trace: str,
    regions: Sequence[str],
    *,
    rate: float,
    block_size: int = 512,
    max_requests: int | None = None,
    topology: Any = None,
    seed: int = 0,
    max_tokens: int | None = None,
    model: str = "llama-3.1-8b",
    arrivals: str = "rescale",
    follow_ups: str = "after-parent",
) -> list[LoadPlan]:
    """The trace as request bodies, arrivals rescaled to ``rate`` req/s of wall time
    (``arrivals="poisson"``: Poisson at ``rate``, for a slice whose timestamps are all equal). Regions are
    drawn among ``regions`` (weighted by prefill capacity when ``topology`` is given).
    ``follow_ups="after-parent"`` (the simulator's default, :class:`kvcompass.sim.engine.SimConfig`)
    holds a request with a replayed parent until the parent's answer arrived; ``"on-time"``
    sends every request at its arrival time."""
    from kvcompass.sim.workload import load_trace, region_weights, resolve_trace

    weights: list[float] | None = None
    if topology is not None:
        names, caps = region_weights(topology)
        cap = dict(zip(names, caps, strict=True))
        weights = [cap.get(r, 0.0) for r in regions]
        if not any(w > 0 for w in weights):
            weights = None
    from kvcompass.sim.engine import FOLLOW_UPS

    if follow_ups not in FOLLOW_UPS:
        raise UsageError(f"--follow-ups must be one of {', '.join(FOLLOW_UPS)}, got {follow_ups!r}")
    mode: Any = arrivals
    reqs = load_trace(resolve_trace(trace), block_size, regions=list(regions), weights=weights, seed=seed, rate=rate, mode=mode, max_requests=max_requests)
    out: list[LoadPlan] = []
    t0 = reqs[0].arrival_ms if reqs else 0.0
    replayed = {r.id for r in reqs}
    for r in reqs:
        n_out = max(1, r.output_length if max_tokens is None else min(r.output_length, max_tokens))
        body = {
            "model": model,
            "prompt": r.input_tokens().tolist(),
            "max_tokens": n_out,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        parent = r.parent if follow_ups == "after-parent" and r.parent in replayed else -1
        out.append(LoadPlan(r.id, r.session, r.region, (r.arrival_ms - t0) / 1e3, r.input_length, json.dumps(body, separators=(",", ":")).encode(), parent))
    return out


async def _one(http: aiohttp.ClientSession, url: str, p: LoadPlan, worker_regions: Mapping[str, str], edge: str) -> dict[str, Any]:
    rec: dict[str, Any] = {
        "id": p.id, "session": p.session, "region": p.region, "edge": edge, "arrival_s": round(p.arrival_s, 6), "status": 0,
        "worker": None, "worker_region": None, "prompt_tokens": p.prompt_tokens, "cached_tokens": None, "output_tokens": 0,
        "ttft_ms": None, "e2e_ms": None, "error": None,
    }
    t0 = time.perf_counter()
    try:
        async with http.post(url, data=p.body, headers={"Content-Type": "application/json"}) as resp:
            rec["status"] = resp.status
            w = resp.headers.get(WORKER_HEADER)
            rec["worker"] = w
            rec["worker_region"] = worker_regions.get(w) if w else None
            if resp.status != 200:
                # An error body need not be UTF-8 (a proxy's own page): one that is not used to
                # end the whole replay with every record lost (found in review).
                text = (await resp.read()).decode("utf-8", errors="replace")
                try:
                    rec["error"] = json.loads(text)["error"]["message"]
                except (ValueError, KeyError, TypeError):
                    rec["error"] = text[:200]
                return rec
            buf = b""
            finished = False
            async for chunk in resp.content.iter_any():
                buf += chunk
                # Events end at a blank line, CRLF or LF (CRLF is sse-starlette's: split on LF
                # alone, a CRLF stream was one event at its end and TTFT read as E2E; review).
                while not finished and (m := _EVENT_END.search(buf)) is not None:
                    event, buf = buf[: m.start()], buf[m.end() :]
                    finished = _event(event, rec, t0)
                if finished:  # [DONE]: the answer is whole even if the server keeps the stream open
                    break
            if not finished and buf.strip():
                _event(buf, rec, t0)
            rec["e2e_ms"] = (time.perf_counter() - t0) * 1e3
    except (aiohttp.ClientError, TimeoutError, OSError) as e:
        rec["error"] = f"{type(e).__name__}: {e}"
    except Exception as e:  # noqa: BLE001 - one request's surprise is its record's error, not the replay's end
        rec["error"] = f"{type(e).__name__}: {e}"
    return rec


_EVENT_END = re.compile(rb"\r?\n\r?\n")


def _event(event: bytes, rec: dict[str, Any], t0: float) -> bool:
    """Fold one server-sent event into ``rec``; True at ``[DONE]``."""
    for line in event.split(b"\n"):
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]":
            return True
        try:
            obj = json.loads(data)
        except ValueError:
            continue
        if not isinstance(obj, dict):
            continue
        if "error" in obj:
            rec["error"] = str(obj["error"])
        choices = obj.get("choices") or []
        if choices:
            if rec["ttft_ms"] is None:
                rec["ttft_ms"] = (time.perf_counter() - t0) * 1e3
            rec["output_tokens"] += 1
        usage = obj.get("usage")
        if isinstance(usage, dict):
            details = usage.get("prompt_tokens_details")
            if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
                rec["cached_tokens"] = details["cached_tokens"]
    return False


async def replay(
    plans: Sequence[LoadPlan],
    edges: Mapping[str, str],
    *,
    worker_regions: Mapping[str, str] | None = None,
    progress: bool = True,
    label: str = "",
    timeout_s: float = 600.0,
    ssl_context: ssl.SSLContext | None = None,
    api_key: str | None = None,
) -> list[dict[str, Any]]:
    """Send every request at its arrival time (a follow-up once its parent's answer arrived,
    too: :attr:`LoadPlan.parent`) to ``edges[region]`` (or the only edge) and return the records
    in request order; a follow-up's ``sent_s`` says when it went. ``ssl_context`` verifies
    ``https://`` edges (None: the system trust store)."""
    if not edges:
        raise UsageError("no edge to send to")
    single = next(iter(edges.values())) if len(edges) == 1 else None
    wr = dict(worker_regions or {})
    conn = aiohttp.TCPConnector(limit=0, ssl=ssl_context if ssl_context is not None else True)
    done = 0
    errors = 0
    n = len(plans)
    t_start = time.perf_counter()

    def bar(final: bool = False) -> None:
        if not progress:
            return
        width = 30
        filled = int(width * done / n) if n else width
        el = time.perf_counter() - t_start
        sys.stderr.write(f"\r{label}[{'#' * filled}{'.' * (width - filled)}] {done}/{n} requests, {errors} errors, {el:5.1f} s")
        if final:
            sys.stderr.write("\n")
        sys.stderr.flush()

    # A parent's answer, arrived (failed answers too: the follow-up is sent and shows what it
    # finds, rather than waiting for ever).
    answered = {p.parent: asyncio.Event() for p in plans if p.parent >= 0}
    missing = sorted(answered.keys() - {p.id for p in plans})
    if missing:
        raise UsageError(f"requests name parents that are not replayed: {missing[:5]}")
    auth = {"Authorization": f"Bearer {api_key}"} if api_key else None
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=timeout_s), headers=auth) as http:

        async def fire(p: LoadPlan) -> dict[str, Any]:
            nonlocal done, errors
            delay = p.arrival_s - (time.perf_counter() - t_start)
            if delay > 0:
                await asyncio.sleep(delay)
            if p.parent >= 0:
                await answered[p.parent].wait()
            base = single if single is not None else edges.get(p.region)
            if base is None:
                raise UsageError(f"no edge for region {p.region!r} (edges: {', '.join(edges)})")
            sent_s = time.perf_counter() - t_start
            try:
                rec = await _one(http, base.rstrip("/") + "/v1/completions", p, wr, base)
            finally:
                if p.id in answered:
                    answered[p.id].set()
            rec["sent_s"] = round(sent_s, 6)
            done += 1
            errors += rec["status"] != 200 or rec["error"] is not None
            return rec

        async def ticker() -> None:
            while True:
                bar()
                await asyncio.sleep(0.25)

        tick = asyncio.ensure_future(ticker())
        try:
            records = await asyncio.gather(*(fire(p) for p in plans))
        finally:
            tick.cancel()
            try:
                await tick
            except asyncio.CancelledError:
                pass
        bar(final=True)
    return list(records)


def _pct(xs: Sequence[float], q: float) -> float | None:
    """None (JSON null) with no sample: NaN is not JSON, and strict parsers refuse the line."""
    return float(np.percentile(np.asarray(xs, dtype=np.float64), q)) if xs else None


def summarize(records: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The main job's figures over successful requests (latencies in wall ms). Reused tokens
    count every request's ``cached_tokens``; the local and cross-region shares only those whose
    serving worker's region is known (found in review: a single edge's run counted none)."""
    ok = [r for r in records if r["status"] == 200 and r["error"] is None and r["ttft_ms"] is not None]
    ttft = [float(r["ttft_ms"]) for r in ok]
    e2e = [float(r["e2e_ms"]) for r in ok]
    prompt = sum(int(r["prompt_tokens"]) for r in ok)
    reused = sum(int(r["cached_tokens"] or 0) for r in ok)
    local = sum(int(r["cached_tokens"] or 0) for r in ok if r["worker_region"] is not None and r["worker_region"] == r["region"])
    cross = sum(int(r["cached_tokens"] or 0) for r in ok if r["worker_region"] is not None and r["worker_region"] != r["region"])
    return {
        "requests": len(records),
        "ok": len(ok),
        "errors": len(records) - len(ok),
        "ttft_p50_ms": _pct(ttft, 50),
        "ttft_p99_ms": _pct(ttft, 99),
        "e2e_p50_ms": _pct(e2e, 50),
        "e2e_p99_ms": _pct(e2e, 99),
        "prompt_tokens": prompt,
        "reused_tokens": reused,
        "local_hit_rate": local / prompt if prompt else 0.0,
        "xregion_hit_rate": cross / prompt if prompt else 0.0,
        "xregion_requests": sum(1 for r in ok if r["worker_region"] is not None and r["worker_region"] != r["region"]),
    }


def write_records(path: str | Path, records: Sequence[Mapping[str, Any]]) -> None:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    with open(p, "w") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")


def default_api_key(state: Mapping[str, Any]) -> str | None:
    """The default tenant's key from ``kvcompass up``'s state (None: the doors are open)."""
    keys = state.get("api_keys") or {}
    return next(iter(keys.values()), None) if isinstance(keys, dict) else None
