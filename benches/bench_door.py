#!/usr/bin/env python3
"""The door against sglang-router, side by side: CPU per proxied request, requests per second
and the latency each adds, in front of the same instant backend (issue 15).

    python benches/bench_door.py --quick      # about a minute once the peer is installed
    python benches/bench_door.py              # longer phases
    python benches/bench_door.py --no-peer    # ours only

Progress goes to stderr; the last line of stdout is one JSON object: ``ours_cpu_ms_per_req``,
``peer_cpu_ms_per_req``, ``cpu_ratio`` (ours / peer), ``ours_req_per_s``, ``peer_req_per_s``,
``ours_added_p50_ms``/``p99`` and ``peer_added_p50_ms``/``p99``, ``tokenize_ms_per_prompt`` (what
the built-in tokenizer costs per prompt, measured in the driver: our door pays it, the peer's
character tree does not), ``doors_cpu_ms_per_req`` / ``doors_req_per_s`` / ``doors_cpu_share`` by door process count (N
doors on one ``SO_REUSEPORT`` port, each its own edge, at saturation), ``doors_rate_*`` by N (the
same N doors at a fixed ``--door-rate`` per door, open loop: CPU per request, the rate served,
each door's share, how far the driver's starts lagged) and ``doors_rate_cpu_growth`` (CPU per
request with the most doors over one door at that fixed rate: "flat" is 1.0, the target 1.1),
the targets and whether each is met. When the peer cannot be installed or started the line says why (``peer_error``) and
the peer's figures and the ratio are absent, never guessed.

Set-up, the same for both routers:

* **Backend.** This process serves ``--ports`` loopback ports (14: the testbed's workers) with
  an instant OpenAI completion (a fixed body) and 404 on the model-info paths, which keeps
  sglang-router from trying to fetch a tokenizer from a model hub (../shared/PEERS.md). It and
  the load below run on the package's own HTTP server and keep-alive client
  (``services/http_server.py``, ``services/upstream.py``), not aiohttp's, so this process takes
  less of the two cores from the routers (``driver_cpu_ms_per_req`` says how much).
* **Ours.** ``serve_door`` over the testbed's ``us`` edge in a child process (bench_service's
  door child: a ``LocalPlane`` edge whose index holds the prompts for ``us-3``; the built-in
  tokenizer). It does what a door does: tokenizes the text, routes it (hash, lookup, score),
  forwards it and learns from the reply.
* **Peer.** sglang-router (``--policy cache_aware``) in its own virtual environment
  (``benches/.peers/sglang-router``, created with pip on first use; ``--peer-python`` names
  another interpreter that has it), with the same ports as workers.
* **Load.** Text prompts (sglang-router refuses token-id prompts), the same bodies for both.
  Added latency: ``--pairs`` sequential requests at one connection, alternately to the backend
  directly and through the router; the percentile through it minus the same percentile direct.
  Throughput: ``--concurrency`` connections in a closed loop for ``--seconds``; CPU per request
  is the router process's user + system CPU time over the window (``/proc``, all its threads)
  divided by the requests it served, so it holds whatever else the host runs.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as _dt
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np

from _provenance import core_build, git_info, meets
from kvcompass.services.lifecycle import stop_process
from bench_service import DOOR_HOLDER, DOOR_REGION, MODEL, TOPOLOGY, Child, Post, closed_loop, cpu_model, log, open_loop, pct, post_once, proc_cpu_s, rnd

REPO = Path(__file__).resolve().parent.parent
PEER_VENV = REPO / "benches" / ".peers" / "sglang-router"
TARGETS = {"cpu_ratio": {"max": 1.5}, "ours_added_p99_ms": {"max": 1.0}, "doors_rate_cpu_growth": {"max": 1.1}}
_WORDS = ("the request reaches the nearest edge which looks up every table of the index and forwards it to the worker "
          "holding the longest prefix unless its queue is longer than the prefill it saves").split()


def _prompts(n: int, words: int, seed: int) -> list[str]:
    rng = np.random.default_rng(seed)
    shared = " ".join(_WORDS)  # a shared opening, as a system prompt would be
    return [shared + " " + " ".join(rng.choice(_WORDS, size=words).tolist()) + f" [{i}]" for i in range(n)]


class _Backend:
    """The instant backend on ``ports`` loopback ports, served by the package's own HTTP server
    (lighter than aiohttp's), so that the routers under test, not the backend, hold most of the
    host's two cores."""

    def __init__(self) -> None:
        self.servers: list[Any] = []
        self.urls: list[str] = []

    async def start(self, ports: int) -> list[str]:
        from kvcompass.services.http_server import App, HttpServer, Request, Response, json_response
        from kvcompass.services.lifecycle import bind_socket

        reply = json.dumps(
            {
                "id": "cmpl-bench",
                "object": "text_completion",
                "created": 0,
                "model": MODEL,
                "choices": [{"index": 0, "text": " ok", "finish_reason": "length", "logprobs": None}],
                "usage": {"prompt_tokens": 64, "completion_tokens": 1, "total_tokens": 65, "prompt_tokens_details": {"cached_tokens": 0}},
            }
        ).encode()

        async def completion(request: Request) -> Response:
            await request.read()
            return Response(body=reply, content_type="application/json")

        async def ok(_: Request) -> Response:
            return Response(body=b"ok", content_type="text/plain")

        async def models(_: Request) -> Response:
            return json_response({"object": "list", "data": [{"id": MODEL, "object": "model"}]})

        # 404 on the model-info paths (not routed) keeps sglang-router from fetching a tokenizer.
        app = App(max_body_bytes=1 << 22)
        app.add_post("/v1/completions", completion)
        app.add_post("/generate", completion)
        app.add_get("/health", ok)
        app.add_get("/health_generate", ok)
        app.add_get("/v1/models", models)
        for _ in range(ports):
            sock = bind_socket("127.0.0.1", 0)
            server = HttpServer(app, sock)
            await server.start()
            self.servers.append(server)
            self.urls.append(f"http://127.0.0.1:{sock.getsockname()[1]}")
        return self.urls

    async def close(self) -> None:
        for server in self.servers:
            await server.close()
            server.sock.close()


def _pool_post(pool: Any) -> Post:
    """bench_service's :data:`Post` on the package's keep-alive client."""

    async def post(url: str, body: bytes) -> tuple[int, bytes]:
        r = await pool.post(url, body, _JSON)
        data = await r.read()
        r.release()
        return r.status, data

    return post


_JSON = {"Content-Type": "application/json"}


def _peer_python(args: argparse.Namespace) -> str:
    """An interpreter with sglang-router: --peer-python, or the bench's own venv (made on first
    use; a RuntimeError saying why when pip cannot install it)."""
    if args.peer_python:
        return str(args.peer_python)
    py = PEER_VENV / "bin" / "python"
    probe = [str(py), "-c", "import sglang_router"]
    if py.exists() and subprocess.run(probe, capture_output=True).returncode == 0:
        return str(py)
    log(f"installing sglang-router into {PEER_VENV} (first use)")
    subprocess.run([sys.executable, "-m", "venv", str(PEER_VENV)], check=True, capture_output=True)
    r = subprocess.run([str(py), "-m", "pip", "install", "-q", "sglang-router"], capture_output=True, text=True, timeout=900)
    if r.returncode != 0 or subprocess.run(probe, capture_output=True).returncode != 0:
        raise RuntimeError(f"pip could not install sglang-router: {(r.stderr or r.stdout).strip()[-300:]}")
    return str(py)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _start_peer(python: str, urls: list[str]) -> tuple[subprocess.Popen[bytes], str]:
    port = _free_port()
    cmd = [python, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(port), "--worker-urls", *urls, "--policy", "cache_aware", "--log-level", "warn"]
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    body = json.dumps({"model": MODEL, "prompt": "warm up", "max_tokens": 1}).encode()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            err = proc.stderr.read().decode(errors="replace")[-400:] if proc.stderr else ""
            raise RuntimeError(f"sglang-router exited with {proc.returncode}: {err}")
        with contextlib.suppress(OSError):
            req = urllib.request.Request(url + "/v1/completions", data=body, headers={"Content-Type": "application/json"}, method="POST")
            with urllib.request.urlopen(req, timeout=2) as r:
                if r.status == 200:
                    return proc, url
        time.sleep(0.25)
    proc.kill()
    raise RuntimeError("sglang-router did not answer within 60 s")


async def _measure(s: Post, name: str, router_url: str, direct_url: str, pids: list[int], bodies: list[bytes], args: argparse.Namespace, res: dict[str, Any]) -> None:
    """Added latency at one connection, then a closed loop: requests per second, and the
    router's CPU per request (every process in ``pids`` together) and each process's share."""
    through_u, direct_u = router_url + "/v1/completions", direct_url + "/v1/completions"
    d_lat, p_lat = [], []
    for i in range(args.warmup + args.pairs):
        body = bodies[i % len(bodies)]
        first, second = (through_u, direct_u) if i % 2 else (direct_u, through_u)
        a = await post_once(s, first, body)
        b = await post_once(s, second, body)
        through, direct = (a, b) if i % 2 else (b, a)
        if i >= args.warmup:
            p_lat.append(through)
            d_lat.append(direct)
    res[f"{name}_added_p50_ms"] = rnd(pct(p_lat, 50) - pct(d_lat, 50))
    res[f"{name}_added_p99_ms"] = rnd(pct(p_lat, 99) - pct(d_lat, 99))
    await closed_loop(s, through_u, bodies, args.concurrency, 0.5)  # open the connections
    c0 = [proc_cpu_s(p) for p in pids]
    d0 = proc_cpu_s(os.getpid())
    n, dt = await closed_loop(s, through_u, bodies, args.concurrency, args.seconds)
    c1 = [proc_cpu_s(p) for p in pids]
    d1 = proc_cpu_s(os.getpid())
    res[f"{name}_req_per_s"] = rnd(n / dt, 1)
    res[f"{name}_requests"] = n
    if d0 is not None and d1 is not None and n:
        # This process: the load and the backend together (it answers each request once).
        res[f"{name}_driver_cpu_ms_per_req"] = rnd((d1 - d0) * 1e3 / n, 4)
    if None not in c0 and None not in c1 and n:
        used = [b - a for a, b in zip(c0, c1)]  # type: ignore[operator]
        res[f"{name}_cpu_ms_per_req"] = rnd(sum(used) * 1e3 / n, 4)
        res[f"{name}_cpu_util"] = rnd(sum(used) / dt)
        if len(pids) > 1:
            res[f"{name}_cpu_share"] = [rnd(u / sum(used), 3) for u in used] if sum(used) > 0 else None
    log(f"{name}: added {res[f'{name}_added_p50_ms']}/{res[f'{name}_added_p99_ms']} ms (P50/P99 at one connection); "
        f"{n / dt:,.0f} req/s at {args.concurrency} connections, {res.get(f'{name}_cpu_ms_per_req')} ms CPU a request")


async def _measure_rate(url: str, pids: list[int], bodies: list[bytes], rate: float, args: argparse.Namespace) -> dict[str, Any]:
    """An open loop at ``rate`` requests a second through ``url`` from ``--concurrency``
    clients of their own (so as many connections, spread over the doors of a shared port as
    the closed loop's are): the routers' CPU per request (every process in ``pids``), what was
    served and whether the driver kept the rate."""
    from kvcompass.services.upstream import UpstreamPool

    u = url + "/v1/completions"
    pools = [UpstreamPool(keepalive_s=60.0) for _ in range(args.concurrency)]
    posts = [_pool_post(p) for p in pools]
    try:
        await open_loop(posts, u, bodies, rate, 0.5)  # open the connections at this rate
        c0 = [proc_cpu_s(p) for p in pids]
        n, dt, lag = await open_loop(posts, u, bodies, rate, args.seconds)
        c1 = [proc_cpu_s(p) for p in pids]
    finally:
        for p in pools:
            await p.close()
    out: dict[str, Any] = {"req_per_s": rnd(n / dt, 1), "lag_ms": rnd(lag)}
    if None not in c0 and None not in c1 and n:
        used = [b - a for a, b in zip(c0, c1)]  # type: ignore[operator]
        out["cpu_ms_per_req"] = rnd(sum(used) * 1e3 / n, 4)
        out["cpu_share"] = [rnd(x / sum(used), 3) for x in used] if len(used) > 1 and sum(used) > 0 else None
    return out


async def run(args: argparse.Namespace, res: dict[str, Any]) -> None:
    from kvcompass.engine.tokenizer import load_tokenizer
    from kvcompass.services.upstream import UpstreamPool

    texts = _prompts(args.prompts, args.words, args.seed)
    tok = load_tokenizer(None)
    # What tokenizing one prompt costs (our door must, to route it; sglang-router's tree works on
    # characters): measured here, in this process, so the door's figure can be read net of it.
    t0 = time.perf_counter()
    for _ in range(20):
        for t in texts:
            tok.encode(t)
    res["tokenize_ms_per_prompt"] = rnd((time.perf_counter() - t0) * 1e3 / (20 * len(texts)), 4)
    res["prompt_tokens_mean"] = rnd(float(np.mean([len(tok.encode(t)) for t in texts])), 1)
    bodies = [json.dumps({"model": MODEL, "prompt": t, "max_tokens": 1}).encode() for t in texts]
    backend = _Backend()
    urls = await backend.start(args.ports)
    pool = UpstreamPool(keepalive_s=60.0)
    s = _pool_post(pool)
    try:
        if True:
            spec = {"topology": TOPOLOGY, "region": DOOR_REGION, "holder": DOOR_HOLDER, "prompts": [tok.encode(t).tolist() for t in texts], "worker_url": urls[0]}
            if args.pin is not None:
                spec["cpu"] = args.pin[1]
            door = Child("door", spec)
            try:
                await _measure(s, "ours", door.wait_ready()["url"], urls[0], [door.pid], bodies, args, res)
            finally:
                door.stop()
            # Door processes on one port (SO_REUSEPORT), each its own edge: CPU per request should
            # stay flat as they are added, with the connections spread among them.
            for n in args.doors:
                doors = [Child("door", {**spec, "reuse_port": True})]
                try:
                    url = doors[0].wait_ready()["url"]
                    port = int(url.rsplit(":", 1)[1])
                    for _ in range(n - 1):
                        doors.append(Child("door", {**spec, "reuse_port": True, "port": port}))
                        doors[-1].wait_ready()
                    part: dict[str, Any] = {}
                    await _measure(s, "doors", url, urls[0], [d.pid for d in doors], bodies, args, part)
                    res.setdefault("doors_cpu_ms_per_req", {})[str(n)] = part.get("doors_cpu_ms_per_req")
                    res.setdefault("doors_req_per_s", {})[str(n)] = part.get("doors_req_per_s")
                    res.setdefault("doors_cpu_share", {})[str(n)] = part.get("doors_cpu_share")
                    if args.door_rate > 0:
                        # The same load per door whatever N (weak scaling): what being one of N
                        # costs a door, apart from how full a loop turn is at saturation.
                        r = await _measure_rate(url, [d.pid for d in doors], bodies, args.door_rate * n, args)
                        log(f"doors at {args.door_rate * n:,.0f} req/s ({args.door_rate:,.0f} a door): {r}")
                        for k, v in r.items():
                            res.setdefault(f"doors_rate_{k}", {})[str(n)] = v
                finally:
                    for d in doors:
                        d.stop()
            if args.no_peer:
                res["peer_error"] = "not run (--no-peer)"
                return
            try:
                # In threads: the backend these wait on answers on this process's event loop.
                python = await asyncio.to_thread(_peer_python, args)
                peer, peer_url = await asyncio.to_thread(_start_peer, python, urls)
                if args.pin is not None:
                    # Every thread of the peer on the routers' CPU, as the doors are.
                    for tid in os.listdir(f"/proc/{peer.pid}/task"):
                        with contextlib.suppress(OSError):
                            os.sched_setaffinity(int(tid), {args.pin[1]})
            except (RuntimeError, OSError, subprocess.SubprocessError) as e:
                res["peer_error"] = str(e)
                log(f"peer unavailable: {e}")
                return
            try:
                version = subprocess.run([python, "-c", "import importlib.metadata as m; print(m.version('sglang-router'))"], capture_output=True, text=True)
                res["peer_version"] = version.stdout.strip() or None
                await _measure(s, "peer", peer_url, urls[0], [peer.pid], bodies, args, res)
            finally:
                stop_process(peer, 10)
    finally:
        await pool.close()
        await backend.close()
    rc = res.get("doors_rate_cpu_ms_per_req", {})
    if rc.get("1") and rc.get(str(max(args.doors, default=1))) and max(args.doors, default=1) > 1:
        res["doors_rate_cpu_growth"] = rnd(rc[str(max(args.doors))] / rc["1"])
    if res.get("ours_cpu_ms_per_req") and res.get("peer_cpu_ms_per_req"):
        res["cpu_ratio"] = rnd(res["ours_cpu_ms_per_req"] / res["peer_cpu_ms_per_req"])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="shorter phases (about a minute once the peer is installed)")
    ap.add_argument("--no-peer", action="store_true", help="measure our door only")
    ap.add_argument("--peer-python", type=Path, default=None, help="an interpreter that has sglang-router (default: the bench's own venv)")
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--ports", type=int, default=14, help="backend ports, one per worker (default 14, the testbed's)")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--doors", default="1,2", help="door process counts to measure on one SO_REUSEPORT port, comma list ('' skips; default 1,2)")
    ap.add_argument("--door-rate", type=float, default=1000.0,
                    help="requests a second per door of the fixed-rate phase run for each --doors count (N doors get N times it; 0 skips)")
    ap.add_argument("--pin", action="store_true",
                    help="this process (backend and load) on one CPU, every router process and thread on another: "
                         "the routers do not compete with the driver, and N doors share one CPU (their own cost of being N)")
    args = ap.parse_args(argv)
    if args.pin:
        avail = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
        if len(avail) < 2:
            ap.error("--pin needs two CPUs")
        args.pin = (avail[0], avail[1])
        os.sched_setaffinity(0, {avail[0]})
    else:
        args.pin = None
    try:
        args.doors = [int(x) for x in args.doors.split(",") if x.strip()]
    except ValueError:
        ap.error(f"--doors takes a comma list of counts, got {args.doors!r}")
    if any(n < 1 for n in args.doors):
        ap.error("--doors counts must be >= 1")
    args.prompts, args.words = 16, 120
    args.pairs = 400 if args.quick else 2000
    args.warmup = 50
    args.seconds = 4.0 if args.quick else 15.0
    res: dict[str, Any] = {"mode": "quick" if args.quick else "full", "concurrency": args.concurrency, "backend_ports": args.ports, "prompt_words": args.words, "pinned": args.pin}
    asyncio.run(run(args, res))
    res["targets"] = TARGETS
    res["meets"] = meets(res, TARGETS)
    res["cpu"] = cpu_model()
    res["git_commit"], res["git_dirty"] = git_info()
    res["core_build"] = core_build()
    res["date"] = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
    print(json.dumps(res))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
