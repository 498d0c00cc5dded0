"""Soak: a local ``kvcompass up`` cluster under twice its planned load with faults on.

    python benches/soak.py [--seconds 600] [--rate 5] [--fault-every 30] [--run-dir DIR]

Starts ``kvcompass up`` on a small two-region topology (3 workers, 2 shards; the tests' tiny
cluster), sends streaming completions at ``2 x --rate`` requests/s (Poisson) through both edges'
HTTP doors, and every ``--fault-every`` seconds SIGKILLs one process, which ``kvcompass up``'s
supervisor starts again on the same ports (the state file names the new pid): alternately a
maintenance unit (it recovers its shard from its
state file under a new epoch; edges resync, agents re-report) and an emulated worker (an engine
restart: its event seq starts again at 0 and its cache is empty; the doors route around it while
it is down). Nothing else is dropped (the in-process fault harness is ``kvcompass chaos``).

Sampled every second from ``/proc``: RSS, open fds and threads of every process. After a
warm-up of ``min(10 s, seconds / 6)``, the run is cut in thirds and checked:

* bounded memory: per process, max RSS of the last third <= 1.25 x max of the first third + 24 MiB;
* no leaked sockets/tasks: per process, max open fds of the last third <= max of the first
  third + 16, and threads likewise + 4 (processes restarted by a fault are judged from their
  restart on, when they lived long enough to have thirds);
* stable P99: the TTFT P99 of each window of ``seconds / 10``; the median window P99 of the last
  third <= 1.5 x that of the first third + 25 ms (no upward trend);
* failures: HTTP errors and connection failures <= 1 % of requests (streams cut by a worker's
  death after their first byte are counted separately as ``broken_streams``);
* recovery: after each restart, the restarted process reports healthy and then every edge
  (all views current); from the kill to that point, the slowest is ``max_recover_ms``, and a
  restarted process that died again fails the run.

Prints one JSON line with every figure and ``"ok"``; exits 0 iff ok.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from kvcompass.services.lifecycle import stop_process

TOPOLOGY = """
name = "soak-2x"
block_size = 16
levels = 3
own_region_min = 256
shards = 2

[rtt_ms]
a = { a = 1.0, b = 20.0 }
b = { a = 20.0, b = 1.0 }

[regions]
a = "a"
b = "b"

[worker_defaults]
beta_ms_per_token = 0.085
vram_tokens = 65536

[[workers]]
region = "a"
count = 2

[[workers]]
region = "b"
count = 1
"""
MODEL = "llama-3.1-8b"
MiB = 1 << 20


@dataclass
class Series:
    """Samples of one process life: (t, rss bytes, fds, threads)."""

    name: str
    pid: int
    samples: list[tuple[float, int, int, int]] = field(default_factory=list)


def proc_sample(pid: int) -> tuple[int, int, int] | None:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        fds = len(os.listdir(f"/proc/{pid}/fd"))
    except (OSError, ValueError):
        return None
    rss = threads = 0
    for line in status.splitlines():
        if line.startswith("VmRSS:"):
            rss = int(line.split()[1]) * 1024
        elif line.startswith("Threads:"):
            threads = int(line.split()[1])
    return rss, fds, threads


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1][:1] not in ("Z", "X")
    except (OSError, IndexError):
        return False


class Soak:
    def __init__(self, args: argparse.Namespace, run_dir: Path) -> None:
        self.args = args
        self.run_dir = run_dir
        self.rng = random.Random(args.seed)
        self.series: dict[str, list[Series]] = {}
        self.requests: list[tuple[float, float | None, str]] = []  # (t start, ttft s, outcome)
        self.faults: list[dict[str, Any]] = []
        self.state: dict[str, Any] = {}
        self.pids: dict[str, int] = {}
        self.up: subprocess.Popen[bytes] | None = None
        self.t0 = 0.0
        self.stopping = False

    # ---- the cluster -------------------------------------------------------------------------------

    def start_cluster(self) -> None:
        topo = self.run_dir / "soak.toml"
        topo.write_text(TOPOLOGY)
        state_file = self.run_dir / "state.json"
        log = open(self.run_dir / "up.log", "wb")  # noqa: SIM115 - lives as long as the cluster
        self.up = subprocess.Popen(
            [sys.executable, "-m", "kvcompass", "up", "--topology", str(topo), "--state-file", str(state_file), "--run-dir", str(self.run_dir / "run"),
             "--time-scale", repr(self.args.time_scale), "--drain-grace", "5"],
            stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + 120
        while not state_file.exists():
            if self.up.poll() is not None:
                raise SystemExit(f"kvcompass up exited with {self.up.returncode}; see {self.run_dir / 'up.log'}")
            if time.monotonic() > deadline:
                raise SystemExit("cluster not up in 120 s")
            time.sleep(0.1)
        self.state_file = state_file
        self.state = json.loads(state_file.read_text())
        self.pids = dict(self.state["pids"])
        for name, pid in self.pids.items():
            self.series[name] = [Series(name, pid)]

    def stop_cluster(self) -> None:
        up = self.up
        if up is None:
            return
        stop_process(up, 60)
        # The restarted processes are the supervisor's children; stop any it left behind.
        for f in self.faults:
            pid = f.get("new_pid")
            if isinstance(pid, int) and alive(pid):
                os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + 15
        for f in self.faults:
            pid = f.get("new_pid")
            while isinstance(pid, int) and alive(pid) and time.monotonic() < deadline:
                time.sleep(0.05)
            if isinstance(pid, int) and alive(pid):
                os.kill(pid, signal.SIGKILL)

    # ---- faults ------------------------------------------------------------------------------------

    async def restart(self, name: str) -> dict[str, Any]:
        """SIGKILL ``name``; ``kvcompass up`` starts it again on the same ports (its supervisor),
        and the state file names the new pid. Recovery is timed from the kill."""
        pid = self.pids[name]
        if name.startswith("maintenance-"):
            shard = int(name.rsplit("-", 1)[1])
            unit = next(u for u in self.state["maintenance"] if int(u["shard"]) == shard)
            health = unit["metrics"] + "/healthz"
        else:
            wid = name.removeprefix("worker-")
            health = self.state["workers"][wid]["http"] + "/health"
        t_kill = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        while alive(pid):
            await asyncio.sleep(0.01)
        new_pid = None
        deadline = time.monotonic() + 60
        while new_pid is None and time.monotonic() < deadline:
            with contextlib.suppress(OSError, ValueError):
                got = json.loads(self.state_file.read_text()).get("pids", {}).get(name)
                if isinstance(got, int) and got != pid:
                    new_pid = got
            await asyncio.sleep(0.02)
        recovered = None
        if new_pid is not None:
            self.pids[name] = new_pid
            self.series[name].append(Series(name, new_pid))
            # Recovery: the restarted process healthy, then every edge healthy (views current).
            if await self.wait_healthy([health], timeout=30.0) is not None:
                recovered = await self.wait_healthy([e["http"] + "/health" for e in self.state["edges"].values()], timeout=30.0)
            if recovered is not None:
                recovered = round((time.monotonic() - t_kill) * 1000, 1)
            if not alive(new_pid):
                recovered = None
        return {"t_s": round(t_kill - self.t0, 2), "process": name, "old_pid": pid, "new_pid": new_pid, "recover_ms": recovered}

    async def wait_healthy(self, urls: list[str], timeout: float) -> float | None:
        """Poll until every URL answers 200; the seconds it took, or None on timeout."""
        since = time.monotonic()
        deadline = since + timeout
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as http:
            while time.monotonic() < deadline:
                ok = 0
                for u in urls:
                    try:
                        async with http.get(u) as r:
                            await r.read()
                            ok += r.status == 200
                    except (aiohttp.ClientError, asyncio.TimeoutError, ConnectionError):
                        pass
                if ok == len(urls):
                    return time.monotonic() - since
                await asyncio.sleep(0.02)
        return None

    async def fault_loop(self, end: float) -> None:
        units = sorted(n for n in self.pids if n.startswith("maintenance-"))
        workers = sorted(n for n in self.pids if n.startswith("worker-"))
        i = 0
        while True:
            await asyncio.sleep(self.args.fault_every)
            if time.monotonic() + 5 > end:
                return
            pool = units if i % 2 == 0 else workers
            name = pool[(i // 2) % len(pool)]
            self.faults.append(await self.restart(name))
            i += 1

    # ---- load --------------------------------------------------------------------------------------

    async def one(self, http: aiohttp.ClientSession, url: str, prompt: list[int]) -> None:
        t = time.monotonic()
        ttft: float | None = None
        outcome = "ok"
        try:
            async with http.post(url, json={"model": MODEL, "prompt": prompt, "max_tokens": 4, "stream": True}) as r:
                if r.status != 200:
                    outcome = f"http_{r.status}"
                    await r.read()
                else:
                    async for chunk in r.content.iter_any():
                        if ttft is None and chunk:
                            ttft = time.monotonic() - t
                        if b'"error"' in chunk:
                            outcome = "broken_stream"
        except (aiohttp.ClientError, asyncio.TimeoutError, ConnectionError):
            outcome = "broken_stream" if ttft is not None else "conn_error"
        self.requests.append((t - self.t0, ttft, outcome))

    async def load(self, end: float) -> None:
        rate = 2 * self.args.rate
        doors = [e["http"] + "/v1/completions" for e in self.state["edges"].values()]
        prefixes = [[self.rng.randrange(1000, 100_000) for _ in range(1024)] for _ in range(8)]
        tasks: set[asyncio.Task[None]] = set()
        keys = self.state.get("api_keys") or {}
        auth = {"Authorization": f"Bearer {next(iter(keys.values()))}"} if keys else None
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30), headers=auth) as http:
            nxt = time.monotonic()
            while nxt < end:
                nxt += self.rng.expovariate(rate)
                await asyncio.sleep(max(0.0, nxt - time.monotonic()))
                prompt = self.rng.choice(prefixes) + [self.rng.randrange(1000, 100_000) for _ in range(64)]
                task = asyncio.create_task(self.one(http, self.rng.choice(doors), prompt))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
            if tasks:
                await asyncio.wait(tasks, timeout=35)

    async def sampler(self, end: float) -> None:
        while time.monotonic() < end:
            t = time.monotonic() - self.t0
            for name, lives in self.series.items():
                s = proc_sample(lives[-1].pid)
                if s is not None:
                    lives[-1].samples.append((t, *s))
            await asyncio.sleep(1.0)

    async def main(self) -> dict[str, Any]:
        self.t0 = time.monotonic()
        end = self.t0 + self.args.seconds
        await asyncio.gather(self.load(end), self.sampler(end), self.fault_loop(end))
        return self.report()

    # ---- verdict -----------------------------------------------------------------------------------

    def report(self) -> dict[str, Any]:
        a = self.args
        warm = min(10.0, a.seconds / 6)
        span = a.seconds - warm
        third = span / 3
        first = (warm, warm + third)
        last = (a.seconds - third, a.seconds + 1)
        problems: list[str] = []
        mem: dict[str, Any] = {}
        for name, lives in sorted(self.series.items()):
            for life in lives:
                # A restarted life's first seconds are its interpreter starting: not growth.
                born = life.samples[0][0] + 5.0 if life.samples and life is not lives[0] else 0.0
                s = [x for x in life.samples if x[0] >= max(warm, born)]
                if len(s) < 6:
                    continue
                t_a, t_b = s[0][0], s[-1][0]
                if life is not lives[0] or t_b - t_a < 0.6 * span:
                    # A restarted life: judged on its own thirds.
                    f = [x for x in s if x[0] <= t_a + (t_b - t_a) / 3]
                    lst = [x for x in s if x[0] >= t_b - (t_b - t_a) / 3]
                else:
                    f = [x for x in s if first[0] <= x[0] < first[1]]
                    lst = [x for x in s if last[0] <= x[0] < last[1]]
                if not f or not lst:
                    continue
                rss_f, rss_l = max(x[1] for x in f), max(x[1] for x in lst)
                fd_f, fd_l = max(x[2] for x in f), max(x[2] for x in lst)
                th_f, th_l = max(x[3] for x in f), max(x[3] for x in lst)
                key = name if life is lives[0] else f"{name}#{lives.index(life)}"
                mem[key] = {"rss_mib": [round(rss_f / MiB, 1), round(rss_l / MiB, 1)], "fds": [fd_f, fd_l], "threads": [th_f, th_l]}
                if rss_l > 1.25 * rss_f + 24 * MiB:
                    problems.append(f"{key}: RSS grew {rss_f / MiB:.1f} -> {rss_l / MiB:.1f} MiB")
                if fd_l > fd_f + 16:
                    problems.append(f"{key}: open fds grew {fd_f} -> {fd_l}")
                if th_l > th_f + 4:
                    problems.append(f"{key}: threads grew {th_f} -> {th_l}")
        # P99 TTFT per window.
        nwin = 10
        width = a.seconds / nwin
        p99s: list[float | None] = []
        for w in range(nwin):
            xs = sorted(t for (s, t, o) in self.requests if w * width <= s < (w + 1) * width and t is not None and o == "ok")
            p99s.append(xs[min(len(xs) - 1, int(0.99 * len(xs)))] * 1000 if xs else None)
        win_first = [p for i, p in enumerate(p99s) if p is not None and first[0] <= (i + 0.5) * width < first[1]]
        win_last = [p for i, p in enumerate(p99s) if p is not None and last[0] <= (i + 0.5) * width < last[1]]
        p99_first = statistics.median(win_first) if win_first else None
        p99_last = statistics.median(win_last) if win_last else None
        if p99_first is None or p99_last is None:
            problems.append("not enough requests to compare P99 windows")
        elif p99_last > 1.5 * p99_first + 25:
            problems.append(f"P99 TTFT trended up: {p99_first:.1f} -> {p99_last:.1f} ms")
        n = len(self.requests)
        outcomes: dict[str, int] = {}
        for _, _, o in self.requests:
            outcomes[o] = outcomes.get(o, 0) + 1
        failed = sum(v for k, v in outcomes.items() if k not in ("ok", "broken_stream"))
        if n == 0 or failed > 0.01 * n:
            problems.append(f"{failed} of {n} requests failed")
        dead = sorted(name for name, pid in self.pids.items() if not alive(pid))
        if dead:
            problems.append(f"processes dead at the end: {dead}")
        recov = [f["recover_ms"] for f in self.faults]
        if any(r is None for r in recov):
            problems.append("an edge did not report healthy within 30 s of a restart")
        ttfts = sorted(t for (_, t, o) in self.requests if t is not None and o == "ok")
        return {
            "seconds": a.seconds,
            "planned_rate": a.rate,
            "rate": 2 * a.rate,
            "requests": n,
            "outcomes": outcomes,
            "failed_requests": failed,
            "broken_streams": outcomes.get("broken_stream", 0),
            "ttft_p50_ms": round(ttfts[len(ttfts) // 2] * 1000, 2) if ttfts else None,
            "ttft_p99_ms": round(ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))] * 1000, 2) if ttfts else None,
            "window_p99_ms": [None if p is None else round(p, 2) for p in p99s],
            "p99_first_third_ms": None if p99_first is None else round(p99_first, 2),
            "p99_last_third_ms": None if p99_last is None else round(p99_last, 2),
            "faults": len(self.faults),
            "fault_log": self.faults,
            "max_recover_ms": max((r for r in recov if r is not None), default=None),
            "processes": mem,
            "all_alive_at_end": not dead,
            "problems": problems,
            "ok": not problems,
        }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=600.0, help="length of the loaded run (default 600)")
    ap.add_argument("--rate", type=float, default=5.0, help="the planned request rate; the soak sends twice this (default 5/s)")
    ap.add_argument("--fault-every", type=float, default=30.0, help="seconds between kill -9 + restart faults (default 30)")
    ap.add_argument("--time-scale", type=float, default=0.02, help="the emulated workers' time scale (default 0.02)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--run-dir", default=None, help="logs and state (default: a temporary directory, removed)")
    args = ap.parse_args(argv)
    if args.seconds < 12 or args.rate <= 0 or args.fault_every <= 0:
        ap.error("need --seconds >= 12, --rate > 0 and --fault-every > 0")
    with tempfile.TemporaryDirectory(prefix="kvcompass-soak-") as tmp:
        run_dir = Path(args.run_dir) if args.run_dir else Path(tmp)
        run_dir.mkdir(parents=True, exist_ok=True)
        soak = Soak(args, run_dir)
        try:
            soak.start_cluster()
            out = asyncio.run(soak.main())
        finally:
            soak.stop_cluster()
    print(json.dumps(out, sort_keys=True))
    return 0 if out["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
