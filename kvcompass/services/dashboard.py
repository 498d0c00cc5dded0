"""The operators' live view of one edge: ``GET /dashboard`` (a page shipped in the package: no
CDN, no build step) fed by ``GET /dashboard/data`` (JSON), both on the edge's *metrics*
listener, never on the public door: the page shows tenants' routing details, which are as
sensitive as ``cached_tokens``.

What it costs the routing path: the door appends one small dict per route to a bounded ring
(:attr:`FrontDoor.recent_routes`, 200 entries); everything else is read when the page asks,
once a second while it is open.

What the data holds: ``workers`` (one entry per worker of the topology: region, queue estimate,
cache belief, whether the door holds it dead), ``routes`` (the latest decisions, newest first:
tenant, prompt length, claimed length and tier, worker and region, the score terms, and what
the worker then reused), ``rates`` (local and cross-region reuse and false claims over those
routes), ``latency`` (time to first token and to the last byte, P50 and P99, over the latest
routes, as the door measures them from receiving a request), ``views`` (per table and shard:
epoch, seq, entries, behind), ``stale_shards`` and ``hot`` (the prefix families hot at this
edge: key, local misses within the window, seconds since the last). Not shown: migrations (the
services compute migration actions but do not carry them out; the simulator does).
"""

from __future__ import annotations

import math

import time
from importlib import resources
from typing import TYPE_CHECKING, Any, Callable, Mapping

from kvcompass.services.http_server import Request, Response, json_response

if TYPE_CHECKING:
    from kvcompass.discovery.edge import Edge
    from kvcompass.services.http_door import FrontDoor

__all__ = ["Dashboard"]

_ROUTES_SHOWN = 50
_MIGRATIONS_SHOWN = 10
_HOT_SHOWN = 20


class Dashboard:
    """One edge's dashboard. ``door`` and ``stale_shards`` are attached once they exist (the
    edge process starts its door after its gRPC server)."""

    def __init__(self, edge: Edge, clock: Callable[[], float] = time.monotonic) -> None:
        self.edge = edge
        self.clock = clock
        """The edge's clock (the door's: monotonic seconds), for hotness windows."""
        self.door: FrontDoor | None = None
        self.stale_shards: Callable[[], Mapping[int, float]] | None = None
        self._page = resources.files("kvcompass").joinpath("data/dashboard.html").read_bytes()

    def routes(self) -> list[tuple[str, Callable[[Request], Any]]]:
        """``(path, handler)`` pairs for the metrics listener."""
        return [("/dashboard", self.page), ("/dashboard/data", self.data_handler)]

    async def page(self, _: Request) -> Response:
        return Response(body=self._page, content_type="text/html; charset=utf-8", headers={"Cache-Control": "no-store"})

    async def data_handler(self, _: Request) -> Response:
        return json_response(self.data(), headers={"Cache-Control": "no-store"})

    def data(self) -> dict[str, Any]:
        e, door = self.edge, self.door
        dead = door.dead_workers() if door is not None else set()
        workers = []
        for w in e.workers:
            region = e.worker_region(w)
            workers.append({"id": w, "region": region, "local": region == e.region, "queue_ms": e.queue_estimate(w), "belief": e.belief(w), "dead": w in dead})
        routes = list(door.recent_routes)[-_ROUTES_SHOWN:][::-1] if door is not None else []
        views = []
        behind = set(e.behind)
        for t in e.layout.tables:
            for s in range(e.layout.shards):
                v = e.view(t.table_id, s)
                entries = v.count_entries() if v.initialised else 0
                views.append(
                    {
                        "table": t.table_id,
                        "shard": s,
                        "epoch": v.epoch,
                        "seq": v.seq,
                        "entries": entries,
                        "bits_per_entry": round(8 * v.memory_bytes / entries, 2) if entries else None,
                        "behind": (t.table_id, s) in behind,
                    }
                )
        stale = {str(k): round(v, 1) for k, v in (self.stale_shards() if self.stale_shards is not None else {}).items()}
        recent = list(door.recent_routes) if door is not None else []
        now = self.clock()
        return {
            "region": e.region,
            "time": time.time(),
            "workers": workers,
            "routes": routes,
            "rates": _rates(routes, e.region),
            "latency": _latency(recent),
            "hot": [{"family": f"{f:016x}", "misses": n, "age_s": round(max(0.0, now - last), 3)} for f, n, last in e.hot_families(now)[:_HOT_SHOWN]],
            "migrations": list(door.recent_migrations)[-_MIGRATIONS_SHOWN:][::-1] if door is not None else [],
            "views": views,
            "resyncs": e.stats.resyncs_requested,
            "stale_shards": stale,
        }


def _pct(xs: list[float], q: float) -> float | None:
    """The nearest-rank ``q`` quantile: the smallest value with at least ``q`` of the samples
    at or below it (``int(q * n)`` was one rank high whenever ``q * n`` was whole; review)."""
    if not xs:
        return None
    xs = sorted(xs)
    return xs[max(0, math.ceil(q * len(xs)) - 1)]


def _latency(routes: list[dict[str, Any]]) -> dict[str, float | int | None]:
    """TTFT and end-to-end P50/P99 (ms, nearest rank) over every route in the door's ring that
    got that far."""
    ttft = [float(r["ttft_ms"]) for r in routes if r.get("ttft_ms") is not None]
    e2e = [float(r["e2e_ms"]) for r in routes if r.get("e2e_ms") is not None]
    return {"requests": len(ttft), "ttft_p50_ms": _pct(ttft, 0.5), "ttft_p99_ms": _pct(ttft, 0.99), "e2e_p50_ms": _pct(e2e, 0.5), "e2e_p99_ms": _pct(e2e, 0.99)}


def _rates(routes: list[dict[str, Any]], own: str) -> dict[str, float | int]:
    """Reuse over the routes shown whose worker reported it: tokens reused locally and across
    regions per prompt token, and the share of claims the worker did not honour in full."""
    done = [r for r in routes if r.get("reused") is not None]
    prompt = sum(int(r["prompt_tokens"]) for r in done)
    local = sum(int(r["reused"]) for r in done if r["region"] == own)
    cross = sum(int(r["reused"]) for r in done if r["region"] != own)
    claims = [r for r in done if int(r["claimed"]) > 0]
    false = sum(1 for r in claims if int(r["reused"]) < int(r["claimed"]))
    return {
        "routes": len(done),
        "local_hit_rate": local / prompt if prompt else 0.0,
        "xregion_hit_rate": cross / prompt if prompt else 0.0,
        "false_claim_rate": false / len(claims) if claims else 0.0,
    }
