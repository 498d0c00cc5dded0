#!/usr/bin/env python3
"""Start-up time of every KVCompass process: from spawn to its ready line, and after a kill -9.

A restarted process serves again only once Python has started and imported what it needs, so
its start-up time is part of every recovery time (issue 15's goal: <= 1 s for every service).
Each role is started the way ``kvcompass up`` starts it (``python -m kvcompass ROLE ...`` on
loopback, port 0), ``--rounds`` times, one at a time, with the processes it needs already up:
a maintenance unit per shard, an emulated worker, its agent (pointed at the worker's event
sockets and the units) and an edge (the units, the worker, ``--open``). The figure is wall time
from ``Popen`` to the ready line on stdout. Progress goes to stderr; the LAST line of stdout is
one JSON object ``{"start_s": {ROLE: {"p50", "max"}}, "goal_s": 1.0, "meets": bool, ...}``.

    python benches/bench_start.py            # 5 rounds
    python benches/bench_start.py --rounds 2
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

from _provenance import git_info

GOAL_S = 1.0
TOPOLOGY = "testbed-14x3"
WORKER = "us-0"
REGION = "us"


def _start(args: list[str]) -> tuple[subprocess.Popen[bytes], dict[str, Any], float]:
    """Spawn ``python -m kvcompass ARGS`` and wait for its ready line; (process, line, seconds)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "kvcompass", *args], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    took = time.perf_counter() - t0
    if not line:
        proc.kill()
        raise RuntimeError(f"kvcompass {args[0]} exited before its ready line (exit {proc.wait()})")
    return proc, json.loads(line), took


def _stop(proc: subprocess.Popen[bytes]) -> None:
    proc.kill()
    proc.wait()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    if args.rounds < 1:
        raise SystemExit("--rounds must be >= 1")
    from kvcompass.discovery.topology import load_topology

    shards = load_topology(TOPOLOGY).shards
    times: dict[str, list[float]] = {"maintenance": [], "worker": [], "agent": [], "edge": []}
    keep: list[subprocess.Popen[bytes]] = []
    try:
        units = []
        for s in range(shards):
            p, ready, took = _start(["maintenance", "--shard", str(s), "--topology", TOPOLOGY])
            keep.append(p)
            units.append(ready["grpc"])
            times["maintenance"].append(took)
        maint = ",".join(units)
        p, worker, took = _start(["worker", "--emulate", "--worker", WORKER, "--topology", TOPOLOGY, "--time-scale", "0"])
        keep.append(p)
        times["worker"].append(took)
        roles = {
            "maintenance": ["maintenance", "--shard", "0", "--topology", TOPOLOGY],
            "worker": ["worker", "--emulate", "--worker", "us-1", "--topology", TOPOLOGY, "--time-scale", "0"],
            "agent": ["agent", "--worker", WORKER, "--topology", TOPOLOGY, "--events", worker["events"], "--replay", worker["replay"], "--maintenance", maint],
            "edge": ["edge", "--region", REGION, "--topology", TOPOLOGY, "--maintenance", maint, "--worker", f"{WORKER}={worker['http']}", "--open"],
        }
        for r in range(args.rounds):
            for role, argv in roles.items():
                if role == "maintenance" and r == 0:
                    continue  # measured above, as the units started
                p, _, took = _start(argv)
                _stop(p)
                times[role].append(took)
                print(f"[{r + 1}/{args.rounds}] {role}: {took:.3f} s", file=sys.stderr, flush=True)
    finally:
        for p in keep:
            _stop(p)
    out = {
        "start_s": {k: {"p50": round(statistics.median(v), 3), "max": round(max(v), 3), "runs": len(v)} for k, v in times.items()},
        "goal_s": GOAL_S,
        "meets": all(max(v) <= GOAL_S for v in times.values()),
        "topology": TOPOLOGY,
        "git_commit": git_info()[0],
        "git_dirty": git_info()[1],
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
    }
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
