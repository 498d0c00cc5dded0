"""Prometheus metrics and the ``/metrics`` + ``/healthz`` HTTP endpoint every process serves.

Each process builds one :class:`ServiceMetrics` on its own :class:`CollectorRegistry` (never the
global default registry, so several services can live in one test process without name
clashes). Other services add their own collectors to ``metrics.registry`` and reuse
:class:`MetricsServer` for the endpoint.
"""

from __future__ import annotations

from collections.abc import Awaitable, Sequence
from typing import Callable

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from kvcompass.services.http_server import App, HttpServer, Request, Response, StreamResponse, json_response
from kvcompass.services.lifecycle import AsyncResource, bind_socket

__all__ = ["MetricsServer", "ServiceMetrics", "export_counter", "metrics_app"]

# Patch lag on loopback is sub-millisecond; across regions it is a WAN RTT plus the flush period.
_LAG_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)


class ServiceMetrics:
    """The discovery plane's counters; a maintenance unit uses the ingest/patch-out half, an
    edge the patch-in half. ``role`` becomes a constant label so one Prometheus can scrape a
    whole ``kvcompass up`` cluster and still tell the processes apart."""

    def __init__(self, role: str, registry: CollectorRegistry | None = None) -> None:
        self.role = role
        self.registry = registry if registry is not None else CollectorRegistry(auto_describe=True)
        r, lbl = self.registry, {"role": role}
        # maintenance side
        self.batches_in = Counter("kvcompass_agent_batches", "Agent key-op batches accepted (duplicates included)", ["role"], registry=r).labels(**lbl)
        self.events_in = Counter("kvcompass_key_ops", "Key ops received in accepted agent batches", ["role"], registry=r).labels(**lbl)
        self.rejected = Counter("kvcompass_rejected_batches", "Agent batches refused, by error class", ["role", "reason"], registry=r)
        self.patches_out = Counter("kvcompass_patches_out", "Patch batches emitted by flushes", ["role"], registry=r).labels(**lbl)
        self.patch_bytes_out = Counter("kvcompass_patch_bytes_out", "Bytes of emitted patch batches", ["role"], registry=r).labels(**lbl)
        self.catchups = Counter("kvcompass_catchups", "Subscriber catch-ups served, by kind (replay or snapshot)", ["role", "kind"], registry=r)
        self.subscribers = Gauge("kvcompass_subscribers", "Live patch subscriptions", ["role"], registry=r).labels(**lbl)
        self.subscribers_cut = Counter("kvcompass_subscribers_cut", "Subscribers cut off for falling behind", ["role"], registry=r).labels(**lbl)
        self.index_entries = Gauge("kvcompass_index_entries", "Keys held by the index tables (writer) or views (edge)", ["role"], registry=r).labels(**lbl)
        self.index_bytes = Gauge("kvcompass_index_bytes", "Memory of the index tables or views", ["role"], registry=r).labels(**lbl)
        # edge side
        self.patches_in = Counter("kvcompass_patches_applied", "Patch batches applied to views", ["role"], registry=r).labels(**lbl)
        self.patches_refused = Counter("kvcompass_patches_refused", "Patch batches refused, by outcome", ["role", "status"], registry=r)
        self.gaps = Counter("kvcompass_patch_gaps", "Views found behind their writer (gap, epoch change, heartbeat)", ["role"], registry=r).labels(**lbl)
        self.resyncs = Counter("kvcompass_resyncs", "Resubscriptions made to repair a view", ["role"], registry=r).labels(**lbl)
        self.reconnects = Counter("kvcompass_reconnects", "Streams re-opened after a transport failure", ["role"], registry=r).labels(**lbl)
        self.patch_lag = Histogram(
            "kvcompass_patch_lag_seconds", "From the unit's flush to the edge's apply (wall clock)", ["role"], buckets=_LAG_BUCKETS, registry=r
        ).labels(**lbl)
        self.ready = Gauge("kvcompass_ready", "1 while the process reports healthy", ["role"], registry=r).labels(**lbl)
        # resource limits (both sides)
        self.table_bytes = Gauge("kvcompass_table_memory_bytes", "Memory of each writer table (maintenance)", ["role", "table", "shard"], registry=r)
        self.view_bytes = Gauge("kvcompass_view_memory_bytes", "Memory of each keyless view (an edge replica; the writer's mirror)", ["role", "table", "shard"], registry=r)
        self.memory_budget = Gauge("kvcompass_memory_budget_bytes", "Configured memory budget by scope (shard, view); absent: none", ["role", "scope"], registry=r)
        self.over_budget = Gauge("kvcompass_over_budget", "Shards or views at or over their memory budget, by scope", ["role", "scope"], registry=r)
        self.budget_refusals = Counter("kvcompass_budget_refusals", "Agent batches whose new keys a spent memory budget refused (the rest of each batch applies), by scope", ["role", "scope"], registry=r)
        self.trimmed_keys = Counter("kvcompass_trimmed_keys", "New keys left out of agent batches by a spent memory budget or the unit's --max-keys (not indexed: under-claimed)", ["role"], registry=r)
        self.queue_capacity = Gauge("kvcompass_queue_capacity", "Bound of each kind of bounded queue", ["role", "queue"], registry=r)
        self.queue_depth = Gauge("kvcompass_queue_depth", "Fullest queue of each kind at the last sample", ["role", "queue"], registry=r)
        # both sides
        self.state_write_failures = Counter(
            "kvcompass_state_write_failures", "Writes of the unit's state file that failed (it keeps serving and retries at the next interval)", ["role"], registry=r
        ).labels(**lbl)
        self.rpc_errors = Counter("kvcompass_rpc_errors", "RPCs ended with a non-OK gRPC status (malformed requests included), by status", ["role", "status"], registry=r)

    def rpc_error(self, status: str) -> None:
        self.rpc_errors.labels(role=self.role, status=status).inc()

    def reject(self, reason: str) -> None:
        self.rejected.labels(role=self.role, reason=reason).inc()

    def refused(self, status: str) -> None:
        self.patches_refused.labels(role=self.role, status=status).inc()

    def catchup(self, kind: str) -> None:
        self.catchups.labels(role=self.role, kind=kind).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


Route = tuple[str, Callable[[Request], Awaitable[StreamResponse]]]
"""An extra ``GET`` route of the metrics listener: ``(path, handler)``."""


def metrics_app(registry: CollectorRegistry, ready: Callable[[], bool], routes: Sequence[Route] = ()) -> App:
    """``GET /metrics`` (Prometheus text) and ``GET /healthz`` (200 while ``ready()``, else 503,
    so load balancers and ``kvcompass up`` can poll it without speaking gRPC)."""

    async def metrics(_: Request) -> Response:
        return Response(body=generate_latest(registry), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def healthz(_: Request) -> Response:
        ok = ready()
        return json_response({"status": "SERVING" if ok else "NOT_SERVING"}, status=200 if ok else 503)

    app = App()
    app.add_get("/metrics", metrics)
    app.add_get("/healthz", healthz)
    for path, handler in routes:
        app.add_get(path, handler)
    return app


class MetricsServer(AsyncResource):
    """The metrics endpoint as a start/close pair (for ``AsyncExitStack`` lifecycles)."""

    def __init__(self, registry: CollectorRegistry, ready: Callable[[], bool], routes: Sequence[Route] = ()) -> None:
        self._app = metrics_app(registry, ready, routes)
        self._server: HttpServer | None = None
        self.port = 0

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> int:
        """Serve on ``host:port`` (0: any free port); returns the bound port."""
        sock = bind_socket(host, port)
        self.port = int(sock.getsockname()[1])
        server = HttpServer(self._app, sock)
        try:
            await server.start()
        except BaseException:
            sock.close()
            raise
        self._server = server
        return self.port

    async def close(self) -> None:
        if self._server is not None:
            server, self._server = self._server, None
            await server.close()
            server.sock.close()



StateRow = tuple[int, int, int, int, bytes]
"""(table, shard, epoch, seq, digest) of one writer table or view."""


def export_states(registry: CollectorRegistry, role: str, states: Callable[[], list[StateRow]]) -> None:
    """Export, per table (maintenance) or view (edge), ``kvcompass_state_digest{role,table,shard}``
    (the first 48 bits of its state digest) beside ``kvcompass_state_epoch`` and
    ``kvcompass_state_seq`` (its position), all computed once per scrape. A view matches its
    writer when epoch, seq and digest all agree; ``kvcompass chaos --processes`` checks exactly
    that (a writer's digest includes edits not yet flushed into a batch, so compare while no
    edits are pending). The position is a value, not a label: as labels, every flush made a new
    series (found in review: unbounded cardinality, driven by client traffic)."""
    from prometheus_client.core import GaugeMetricFamily
    from prometheus_client.registry import Collector

    class _States(Collector):
        def collect(self) -> list[GaugeMetricFamily]:
            lab = ["role", "table", "shard"]
            d = GaugeMetricFamily("kvcompass_state_digest", "First 48 bits of each table's or view's state digest (at kvcompass_state_epoch, kvcompass_state_seq)", labels=lab)
            e = GaugeMetricFamily("kvcompass_state_epoch", "Epoch of each table's or view's state", labels=lab)
            q = GaugeMetricFamily("kvcompass_state_seq", "Last batch sequence number of each table's or view's state", labels=lab)
            for table, shard, epoch, seq, digest in states():
                key = [role, str(table), str(shard)]
                d.add_metric(key, float(int.from_bytes(digest[:6], "big")))
                e.add_metric(key, float(epoch))
                q.add_metric(key, float(seq))
            return [d, e, q]

    registry.register(_States())


def export_counter(registry: CollectorRegistry, name: str, documentation: str, value: Callable[[], float], labels: dict[str, str] | None = None) -> None:
    """Export a running total kept elsewhere (a guard's or a runner's count since start) as the
    counter ``name_total``, read when scraped. Such totals used to be gauges with
    ``set_function``, on which ``rate()`` and ``increase()`` mishandle restarts (review)."""
    from prometheus_client.core import CounterMetricFamily
    from prometheus_client.registry import Collector

    keys = list(labels or {})
    values = [str(v) for v in (labels or {}).values()]

    class _Total(Collector):
        def collect(self) -> list[CounterMetricFamily]:
            c = CounterMetricFamily(name, documentation, labels=keys)
            c.add_metric(values, float(value()))
            return [c]

        def describe(self) -> list[CounterMetricFamily]:
            return [CounterMetricFamily(name, documentation, labels=keys)]

    registry.register(_Total())
