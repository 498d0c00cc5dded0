#!/usr/bin/env python3
"""Issue 19's bars, tried as a hostile client would, against ``kvcompass up`` with its defaults.

    python benches/hostile_check.py            # about a minute

Starts a cluster (testbed-14x3, the default settings, its own temporary run directory), then, while
a probe asks the ``us`` door's ``/health`` every 50 ms and records how long each answer took:

1. a 100,000-entry ``ExchangeQueues`` with no edge token to the ``us`` edge's gRPC port;
2. 200 ``ReportOutcome`` calls with no key, each claiming 3,000 tokens reused 0 for ``us-0``,
   with the edge's beliefs read from its dashboard before and after;
3. deeply nested JSON (50,000 ``[``) to the door;
4. a completion naming tenant ``acme`` by header with the default tenant's key, and one with no
   key at all;
5. a ``Route`` of 100 MB (25 M tokens) with no key, with the edge process's resident memory
   read before and after;
6. ``kill -9`` of the ``us`` edge process, timed until its door's ``/health`` answers 200 with
   no stale shard again.

The last line of stdout is one JSON object: each figure, the bar it is held to, and
``passed``. Nothing is hard-coded but the bars.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np

from _provenance import git_info, meets
from kvcompass.services.lifecycle import stop_process

REPO = Path(__file__).resolve().parent.parent
BARS = {
    "probe_max_ms_during_queue_flood": {"max": 1000.0},
    "beliefs_moved_by_forged_outcomes": {"max": 0},
    "nested_json_status": {"eq": 400},
    "header_tenant_status": {"in": [401, 403]},
    "edge_ready_after_kill_s": {"max": 5.0},
    "edge_rss_growth_mib_from_100mb_route": {"max": 64.0},
}


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def http(url: str, body: bytes | None = None, headers: dict[str, str] | None = None, timeout: float = 10.0) -> tuple[int, bytes]:
    req = urllib.request.Request(url, data=body, headers=headers or {}, method="POST" if body is not None else "GET")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def rss_mib(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024.0
    except OSError:
        return None
    return None


_PROBE = """
import sys, time, urllib.request
url = sys.argv[1]
while True:
    t = time.time()
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            r.read()
        ms = (time.time() - t) * 1e3
    except OSError:
        ms = 5000.0
    print(f"{t} {ms}", flush=True)
    time.sleep(0.05)
"""


class Probe:
    """``/health`` of a door every 50 ms from a process of its own (so nothing this process
    does, such as serialising a huge message, delays the probe): the longest answer in a
    window of wall-clock time."""

    def __init__(self, url: str) -> None:
        self._proc = subprocess.Popen([sys.executable, "-c", _PROBE, url + "/health"], stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True)
        self.samples: list[tuple[float, float]] = []

    def worst(self, since: float, until: float) -> float:
        return max((ms for t, ms in self.samples if since <= t <= until), default=0.0)

    def stop(self) -> None:
        self._proc.terminate()
        out, _ = self._proc.communicate(timeout=10)
        for line in out.splitlines():
            t, ms = line.split()
            self.samples.append((float(t), float(ms)))


def beliefs(dashboard: str) -> dict[str, float]:
    status, raw = http(dashboard + "/data")
    if status != 200:
        raise RuntimeError(f"dashboard answered {status}")
    return {w["id"]: float(w["belief"]) for w in json.loads(raw)["workers"]}


async def attacks(state: dict[str, Any], res: dict[str, Any]) -> None:
    from grpclib.client import Channel
    from grpclib.exceptions import GRPCError

    from kvcompass._proto.kvcompass.v1 import EdgeStub, OutcomeRequest, QueueVector, RouteRequest

    edge = state["edges"]["us"]
    door, grpc, dash = edge["http"], edge["grpc"], edge["dashboard"]
    pid = int(state["pids"]["edge-us"])
    host, port = grpc.rsplit(":", 1)
    probe = Probe(door)
    await asyncio.sleep(0.5)
    ch = Channel(host, int(port))
    try:
        stub = EdgeStub(ch)
        # 1. the queue flood
        t0 = time.time()
        huge = QueueVector(region="eu", queues={f"eu-{i}": 1.0 for i in range(100_000)})
        try:
            await stub.exchange_queues(huge, timeout=30)
            res["queue_flood_answer"] = "accepted"
        except GRPCError as e:
            res["queue_flood_answer"] = e.status.name
        await asyncio.sleep(0.3)
        t0_end = time.time()
        # 2. forged outcomes
        before = beliefs(dash)
        refused = 0
        for i in range(200):
            try:
                await stub.report_outcome(OutcomeRequest(worker="us-0", claimed_tokens=3000, reused_tokens=0, route_id=i + 1), timeout=5)
            except GRPCError:
                refused += 1
        after = beliefs(dash)
        res["forged_outcomes_refused"] = refused
        res["beliefs_moved_by_forged_outcomes"] = sum(1 for w in before if abs(before[w] - after.get(w, before[w])) > 1e-12)
        # 5. the 100 MB route
        rss0 = rss_mib(pid)
        tokens = np.zeros(25_000_000, dtype="<u4").tobytes()
        t1 = time.time()
        try:
            await stub.route(RouteRequest(tokens=tokens, namespace=b"\0" * 32), timeout=60)
            res["big_route_answer"] = "accepted"
        except GRPCError as e:
            res["big_route_answer"] = e.status.name
        except (OSError, ConnectionError) as e:
            res["big_route_answer"] = type(e).__name__
        await asyncio.sleep(0.5)
        rss1 = rss_mib(pid)
        t1_end = time.time()
        if rss0 is not None and rss1 is not None:
            res["edge_rss_growth_mib_from_100mb_route"] = round(rss1 - rss0, 1)
    finally:
        ch.close()
    # 3. nested JSON, 4. a tenant by header
    key = state["api_keys"].get("public")
    auth = {"Authorization": f"Bearer {key}"} if key else {}
    status, _ = http(door + "/v1/completions", b"[" * 50_000, {"Content-Type": "application/json", **auth})
    res["nested_json_status"] = status
    body = json.dumps({"model": "llama-3.1-8b", "prompt": "what does acme keep here?", "max_tokens": 1}).encode()
    status, _ = http(door + "/v1/completions", body, {"Content-Type": "application/json", "x-kvcompass-namespace": "acme", **auth})
    res["header_tenant_status"] = status
    status, _ = http(door + "/v1/completions", body, {"Content-Type": "application/json", "x-kvcompass-namespace": "acme"})
    res["no_key_status"] = status
    probe.stop()
    res["probe_max_ms_during_queue_flood"] = round(probe.worst(t0, t0_end), 1)
    res["probe_max_ms_during_big_route"] = round(probe.worst(t1, t1_end), 1)
    res["probe_samples"] = len(probe.samples)


def kill_and_time(state_file: Path, state: dict[str, Any], res: dict[str, Any]) -> None:
    door = state["edges"]["us"]["http"]
    pid = int(state["pids"]["edge-us"])
    t0 = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    deadline = t0 + 30
    while time.monotonic() < deadline:
        try:
            status, raw = http(door + "/health", timeout=1.0)
        except OSError:
            status, raw = 0, b""
        if status == 200:
            doc = json.loads(raw)
            if not doc.get("stale_shards") and doc.get("behind", 0) == 0:
                res["edge_ready_after_kill_s"] = round(time.monotonic() - t0, 2)
                new = json.loads(state_file.read_text())["pids"].get("edge-us")
                res["edge_pid_changed"] = new is not None and int(new) != pid
                return
        time.sleep(0.05)
    res["edge_ready_after_kill_s"] = None


def main() -> int:
    res: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as d:
        state_file = Path(d) / "state.json"
        log_path = Path(d) / "up.log"
        with open(log_path, "wb") as logf:
            proc = subprocess.Popen(
                [sys.executable, "-m", "kvcompass", "up", "--topology", "testbed-14x3", "--state-file", str(state_file), "--run-dir", str(Path(d) / "run")],
                stdin=subprocess.DEVNULL, stdout=logf, stderr=subprocess.STDOUT, cwd=REPO,
            )
        try:
            deadline = time.monotonic() + 120
            while not state_file.exists():
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit(f"kvcompass up did not come up:\n{log_path.read_text()[-2000:]}")
                time.sleep(0.2)
            state = json.loads(state_file.read_text())
            log("cluster up; attacking the us edge")
            asyncio.run(attacks(state, res))
            log("kill -9 of the us edge")
            kill_and_time(state_file, state, res)
        finally:
            stop_process(proc, 30)
    res["bars"] = BARS
    res["passed"] = meets(res, BARS)
    res["git_commit"], res["git_dirty"] = git_info()
    res["date"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    print(json.dumps(res))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
