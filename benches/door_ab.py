#!/usr/bin/env python3
"""Two builds of the door side by side, for a change's effect on its latency: both doors run at
once in front of the same instant backend, and requests go to the backend directly, through
door A and through door B in rotating order, one at a time (one connection each).

Why not two runs of ``bench_door.py``: this host's latency drifts by more between runs minutes
apart (its added P50 0.48-0.61 ms for one build) than a change of tens of microseconds; sent in
turns, the three paths see the same host at the same moments.

    python benches/door_ab.py --base /path/to/other/checkout            # A = that checkout, B = this one
    python benches/door_ab.py --base ../old --pairs 5000

The other checkout needs its own ``kvcompass/_core*.so`` (a build, or a link to this one's when
only Python changed). Prints one JSON line: each door's added latency over the direct path at
P50/P90/P99 (ms) and B's minus A's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from pathlib import Path
from typing import Any

from _provenance import git_info
from bench_door import _Backend, _pool_post, _prompts
from bench_service import DOOR_HOLDER, DOOR_REGION, MODEL, TOPOLOGY, Child, pct, post_once, rnd



async def run(args: argparse.Namespace) -> dict[str, Any]:
    from kvcompass.engine.tokenizer import load_tokenizer
    from kvcompass.services.upstream import UpstreamPool

    texts = _prompts(16, 120, args.seed)
    tok = load_tokenizer(None)
    bodies = [json.dumps({"model": MODEL, "prompt": t, "max_tokens": 1}).encode() for t in texts]
    backend = _Backend()
    urls = await backend.start(14)
    pool = UpstreamPool(keepalive_s=60.0)
    post = _pool_post(pool)
    spec = {"topology": TOPOLOGY, "region": DOOR_REGION, "holder": DOOR_HOLDER, "prompts": [tok.encode(t).tolist() for t in texts], "worker_url": urls[0]}
    doors: list[Child] = []
    try:
        doors.append(Child("door", spec, repo=args.base))
        ua = (await asyncio.to_thread(doors[-1].wait_ready))["url"]
        doors.append(Child("door", spec))
        ub = (await asyncio.to_thread(doors[-1].wait_ready))["url"]
        paths = [("direct", urls[0]), ("a", ua), ("b", ub)]
        lat: dict[str, list[float]] = {name: [] for name, _ in paths}
        for i in range(args.warmup + args.pairs):
            k = i % 3
            for name, u in paths[k:] + paths[:k]:
                ms = await post_once(post, u + "/v1/completions", bodies[i % len(bodies)])
                if i >= args.warmup:
                    lat[name].append(ms)
    finally:
        for door in doors:
            door.stop(10)
        await pool.close()
        await backend.close()
    out: dict[str, Any] = {"pairs": args.pairs, "base": str(args.base)}
    for q in (50, 90, 99):
        d = pct(lat["direct"], q)
        a, b = pct(lat["a"], q) - d, pct(lat["b"], q) - d
        out[f"a_added_p{q}_ms"], out[f"b_added_p{q}_ms"], out[f"b_minus_a_p{q}_ms"] = rnd(a), rnd(b), rnd(b - a)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--base", type=Path, required=True, help="the other checkout (door A); door B is this one")
    ap.add_argument("--pairs", type=int, default=3000)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--seed", type=int, default=7)
    args = ap.parse_args()
    if not (args.base / "kvcompass").is_dir():
        ap.error(f"--base {args.base} is not a checkout of this project (no kvcompass/ in it)")
    res = asyncio.run(run(args))
    res["git_commit"], res["git_dirty"] = git_info()
    # Door A's own checkout (found in review: only its path was kept, so a result could not be
    # traced to its baseline).
    res["base_git_commit"], res["base_git_dirty"] = git_info(args.base)
    print(json.dumps(res))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
