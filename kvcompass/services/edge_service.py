"""An edge node's decision API as a gRPC service (``kvcompass.v1.Edge``), and its queue exchange.

For gateways that proxy themselves and only want the decision: ``Route`` answers with the
winner and its score terms, ``ReportOutcome`` feeds back what the worker reused (the cache
belief learns from it), ``ExchangeQueues`` swaps region queue vectors between edges.
:class:`QueueBroadcaster` drives the periodic broadcast (every Delta, suppressed toward regions
that just got a piggybacked vector: the schedule is the Edge's own).

The Edge is driven from the event loop only: its calls are microseconds, so no thread hop.
Time is ``clock()`` (monotonic seconds), which the Edge requires to be non-decreasing.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import math
import secrets
import ssl
import time
from collections import OrderedDict
from typing import Callable, Mapping, Sequence

import numpy as np
from grpclib.client import Channel
from grpclib.const import Cardinality, Handler
from grpclib.exceptions import GRPCError, StreamTerminatedError
from grpclib.health.check import CheckBase, ServiceStatus
from grpclib.health.service import Health
from grpclib.server import Stream

from kvcompass._proto.kvcompass.v1 import (
    EdgeBase,
    EdgeStub,
    OutcomeRequest,
    OutcomeResponse,
    QueueVector,
    RouteRequest,
    RouteResponse,
    ScoreTerms,
)
from kvcompass.discovery.edge import Edge
from kvcompass.discovery.queues import MAX_QUEUE_MS
from kvcompass._core import namespace_digest
from kvcompass.errors import InvalidArgumentError, KVCompassError, NotAllowedError, RateLimitedError, UnauthenticatedError, UnknownRouteError
from kvcompass.services.api_keys import ANY_TENANT, ApiKey, KeyStore
from kvcompass.services.grpc_lifecycle import DrainingServer, OwnedChannels
from kvcompass.services.lifecycle import AsyncResource, hostport
from kvcompass.services.metrics import MetricsServer, Route, ServiceMetrics
from kvcompass.services.codec import recv_request
from kvcompass.services.status import grpc_error
from kvcompass.services.wire import EXCHANGE_PATH, OUTCOME_PATH, PEER_TOKEN_HEADER, ROUTE_PATH

__all__ = ["Clock", "EdgeServer", "EdgeService", "QueueBroadcaster"]

Clock = Callable[[], float]

_log = logging.getLogger(__name__)

MAX_PROMPT_TOKENS = 1 << 21
OPEN_ROUTES = 1 << 16
"""Routes whose outcome an edge still accepts (the oldest is forgotten first): about a minute
of decisions at 1,000 routes a second."""


def _bad(msg: str) -> GRPCError:
    return grpc_error(InvalidArgumentError(msg))


class EdgeService(EdgeBase):
    """``kvcompass.v1.Edge`` over one :class:`Edge`."""

    def __init__(
        self,
        edge: Edge,
        *,
        clock: Clock = time.monotonic,
        max_prompt_tokens: int = MAX_PROMPT_TOKENS,
        open_routes: int = OPEN_ROUTES,
        peer_token: str | None = None,
        keys: KeyStore | None = None,
        models: Sequence[str] = ("llama-3.1-8b",),
    ) -> None:
        self.edge = edge
        # Route and ReportOutcome take the doors' API keys (``authorization: Bearer KEY``
        # metadata): a key may route only in the namespaces of its own tenants (and models),
        # as at the door, and report outcomes only of its own routes. None: open.
        self._keys = keys
        self._models = tuple(models)
        # Per key (its grants, so a reloaded keys file that changes them is seen at once).
        self._namespaces: dict[ApiKey, frozenset[bytes] | None] = {}
        if peer_token is not None and not peer_token:
            raise ValueError("peer_token must be a non-empty string or None")
        self._peer_token = peer_token
        self._clock = clock
        self._max_tokens = max_prompt_tokens
        if open_routes < 1:
            raise ValueError(f"open_routes must be >= 1, got {open_routes}")
        # The routes this edge decided whose outcome has not been reported: route id ->
        # (worker, claimed tokens, prompt tokens, caller), at most open_routes of them; and
        # each caller's, oldest first. Past the limit the caller holding the most loses its
        # oldest: one key routing without reporting forgets its own routes, not every other
        # tenant's (found in review: one global order let any key evict the rest).
        self._open: dict[int, tuple[str, int, int, str | None]] = {}
        self._open_by: dict[str | None, OrderedDict[int, None]] = {}
        self._open_max = open_routes

    def __mapping__(self) -> dict[str, Handler]:
        # ExchangeQueues needs the raw stream: only the deployment's edges (holding its peer
        # token) may move this edge's queue estimates.
        m: dict[str, Handler] = dict(super().__mapping__())
        m[EXCHANGE_PATH] = Handler(self._rpc_exchange, Cardinality.UNARY_UNARY, QueueVector, QueueVector)
        m[ROUTE_PATH] = Handler(self._rpc_route, Cardinality.UNARY_UNARY, RouteRequest, RouteResponse)
        m[OUTCOME_PATH] = Handler(self._rpc_outcome, Cardinality.UNARY_UNARY, OutcomeRequest, OutcomeResponse)
        return m

    def _caller(self, stream: Stream[object, object]) -> ApiKey | None:
        """The caller's key (None when the service is open); UNAUTHENTICATED without a valid one,
        RESOURCE_EXHAUSTED past its rate."""
        if self._keys is None:
            return None
        got = stream.metadata.get("authorization") if stream.metadata is not None else None
        key = self._keys.authenticate(got if isinstance(got, str) else None)
        if key is None:
            raise grpc_error(UnauthenticatedError("missing or incorrect API key: send authorization: Bearer <your key> metadata"))
        wait = self._keys.admit(key, time.monotonic())
        if wait > 0:
            raise grpc_error(RateLimitedError(f"rate limit of this API key ({key.rate_per_s:g} requests/s) reached", retry_after_s=wait))
        return key

    def _allowed(self, key: ApiKey, namespace: bytes) -> bool:
        """Whether ``key`` may act in ``namespace`` (a digest of one of its models and tenants;
        any for an any-tenant key with no model list). An any-tenant key limited to models may
        act in none: a namespace is a digest of model and tenant, so which model it names cannot
        be read off it (found in review: such a key routed in every model's namespace)."""
        if key not in self._namespaces:
            if ANY_TENANT in key.tenants:
                self._namespaces[key] = None if key.models is None else frozenset()
            else:
                models = key.models if key.models is not None else self._models
                self._namespaces[key] = frozenset(namespace_digest(m, t) for m in models for t in key.tenants)
        allowed = self._namespaces[key]
        return allowed is None or namespace in allowed

    async def _rpc_route(self, stream: Stream[RouteRequest, RouteResponse]) -> None:
        key = self._caller(stream)  # type: ignore[arg-type]
        request = await recv_request(stream, RouteRequest)
        if key is not None and not self._allowed(key, bytes(request.namespace)):
            raise grpc_error(NotAllowedError("this API key may not route in that namespace (not one of its tenants' and models')", code="namespace_not_allowed"))
        await stream.send_message(await self._route(request, None if key is None else key.name))

    async def _rpc_outcome(self, stream: Stream[OutcomeRequest, OutcomeResponse]) -> None:
        key = self._caller(stream)  # type: ignore[arg-type]
        request = await recv_request(stream, OutcomeRequest)
        # A queue vector moves every tenant's estimates of a whole region, so only the
        # deployment's own doors (an any-tenant key) may send one with an outcome (found in
        # review: any tenant's key could set a remote region's queues to a day).
        if key is not None and request.queue_vector and ANY_TENANT not in key.tenants:
            raise grpc_error(NotAllowedError("queue_vector: only the deployment's doors (an any-tenant key) may report queue estimates; send the outcome without it", code="queue_vector_not_allowed"))
        await stream.send_message(await self._outcome(request, None if key is None else key.name))

    async def _rpc_exchange(self, stream: Stream[QueueVector, QueueVector]) -> None:
        if self._peer_token is None and self._keys is not None:
            # Keys on Route and ReportOutcome but none on the exchange would leave the one call
            # that moves every tenant's estimates open (found in review): an edge with keys
            # exchanges queues only with peers holding the deployment's peer token.
            raise grpc_error(UnauthenticatedError("ExchangeQueues is closed on an edge with API keys and no peer token: start the edges with --peer-key-file"))
        if self._peer_token is not None:
            got = stream.metadata.get(PEER_TOKEN_HEADER) if stream.metadata is not None else None
            if not isinstance(got, str) or not hmac.compare_digest(got.encode(), self._peer_token.encode()):
                raise grpc_error(UnauthenticatedError(f"ExchangeQueues is for this deployment's edges: bad or missing {PEER_TOKEN_HEADER}"))
        request = await recv_request(stream, QueueVector)
        await stream.send_message(await self.exchange_queues(request))

    def message_limits(self) -> dict[type, int]:
        """The largest request of each type this service reads: a prompt of ``max_prompt_tokens``
        (4 bytes a token) plus its namespace; a queue vector or an outcome names at most every
        worker of the topology (an entry: its id, a double and their framing)."""
        vector = sum(len(w.encode()) + 24 for w in self.edge.workers) + 4096
        return {RouteRequest: 4 * self._max_tokens + 4096, QueueVector: vector, OutcomeRequest: vector}

    async def route(self, route_request: RouteRequest) -> RouteResponse:
        """A route for an in-process caller (no key): the gRPC path checks the caller's key
        first (:meth:`_rpc_route`)."""
        return await self._route(route_request, None)

    async def _route(self, route_request: RouteRequest, caller: str | None) -> RouteResponse:
        raw = route_request.tokens
        if len(raw) % 4:
            raise _bad(f"tokens: {len(raw)} bytes is not a whole number of little-endian u32")
        n = len(raw) // 4
        if n == 0 or n > self._max_tokens:
            raise _bad(f"prompt of {n} tokens: must be 1..{self._max_tokens}")
        tokens = np.frombuffer(raw, dtype="<u4").astype(np.uint32, copy=False)
        try:
            if route_request.lookup_only:
                d = self.edge.lookup(tokens, route_request.namespace, self._clock())
            else:
                d = self.edge.route(tokens, route_request.namespace, self._clock())
        except KVCompassError as e:
            raise grpc_error(e) from None
        except ValueError as e:  # the core's argument checks (e.g. a malformed namespace digest)
            raise _bad(str(e)) from None
        t = d.terms
        route_id = 0  # a lookup sends nothing anywhere: it has no outcome to report
        if not route_request.lookup_only:
            route_id = secrets.randbits(63) + 1
            self._open[route_id] = (d.worker, d.expected_match, d.prompt_tokens, caller)
            self._open_by.setdefault(caller, OrderedDict())[route_id] = None
            if len(self._open) > self._open_max:
                heaviest = max(self._open_by, key=lambda c: len(self._open_by[c]))
                self._forget(self._open_by[heaviest].popitem(last=False)[0])
        return RouteResponse(
            route_id=route_id,
            worker=d.worker,
            region=d.region,
            claimed_tokens=d.expected_match,
            tier=int(d.tier),
            score=d.score,
            terms=ScoreTerms(wan=t.wan, queue=t.queue, prefill=t.prefill, reload=t.reload, lam=t.lam, belief=t.belief),
            tie_broken=d.tie_broken,
            candidates=d.candidates,
            prompt_tokens=d.prompt_tokens,
            local_match=d.local_match,
        )

    async def report_outcome(self, outcome_request: OutcomeRequest) -> OutcomeResponse:
        """The outcome of a route this edge decided: counts once, for the worker and the claim
        the edge issued (the reporter's own ``claimed_tokens`` is not trusted), so nobody can
        move a worker's belief with outcomes of routes that never were (issue 19); over gRPC,
        only the key that asked for the route may report it."""
        return await self._outcome(outcome_request, None)

    async def _outcome(self, outcome_request: OutcomeRequest, caller: str | None) -> OutcomeResponse:
        r = outcome_request
        try:
            self.edge.worker_index(r.worker)
            for w, q in r.queue_vector.items():
                if not (math.isfinite(q) and 0 <= q <= MAX_QUEUE_MS):
                    raise InvalidArgumentError(f"queue_vector: {w!r} = {q!r} ms must be finite and in [0, {MAX_QUEUE_MS:g}]")
        except KVCompassError as e:
            raise grpc_error(e) from None
        issued = self._open.get(r.route_id)
        if issued is None or issued[0] != r.worker or (caller is not None and issued[3] != caller):
            raise grpc_error(UnknownRouteError(f"no open route {r.route_id} to {r.worker!r} from this edge: report the route_id of a RouteResponse, once", route_id=r.route_id))
        worker, claimed, prompt_tokens, _ = issued
        if r.reused_tokens > prompt_tokens:
            raise _bad(f"reused_tokens {r.reused_tokens} exceeds the route's prompt of {prompt_tokens} tokens")
        self._forget(r.route_id)
        try:
            self.edge.on_response(worker, claimed, r.reused_tokens, dict(r.queue_vector) or None, self._clock())
            return OutcomeResponse(belief=self.edge.belief(worker))
        except KVCompassError as e:
            raise grpc_error(e) from None

    def _forget(self, route_id: int) -> None:
        """Close an open route (reported, or evicted past the limit)."""
        caller = self._open.pop(route_id)[3]
        mine = self._open_by[caller]
        mine.pop(route_id, None)
        if not mine:
            del self._open_by[caller]

    @property
    def open_routes(self) -> int:
        """Routes whose outcome this edge still accepts."""
        return len(self._open)

    async def exchange_queues(self, queue_vector: QueueVector) -> QueueVector:
        edge, now = self.edge, self._clock()
        try:
            edge.on_broadcast(queue_vector.region, dict(queue_vector.queues), now)
        except KVCompassError as e:
            raise grpc_error(e) from None
        if queue_vector.region != edge.region:
            # The answer carries our vector to the sender's region: it counts as a piggyback.
            with contextlib.suppress(InvalidArgumentError):
                edge.note_piggyback_sent(queue_vector.region, now)
        return QueueVector(region=edge.region, queues=edge.local_vector())


class QueueBroadcaster:
    """Sends :meth:`Edge.broadcast_due` vectors to the peer edges of other regions every
    ``tick_s`` and folds their answers. ``peers`` maps region -> Channel (the caller's) or
    ``"host:port"`` (opened and closed here, over TLS with ``ssl_context``); regions without a
    peer are skipped."""

    def __init__(
        self,
        edge: Edge,
        peers: Mapping[str, Channel | str],
        *,
        clock: Clock = time.monotonic,
        tick_s: float = 0.01,
        timeout_s: float = 1.0,
        token: str | None = None,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        self.edge = edge
        self._clock = clock
        self._tick = tick_s
        self._timeout = timeout_s
        self._metadata = {PEER_TOKEN_HEADER: token} if token else None
        self._channels = OwnedChannels(ssl_context)
        self._stubs = {region: EdgeStub(self._channels.get(target)) for region, target in peers.items()}
        self._task: asyncio.Task[None] | None = None
        self.sent = 0
        self.failed = 0

    async def tick(self) -> int:
        """Send what is due now; returns how many exchanges succeeded."""
        now = self._clock()
        due = [b for b in self.edge.broadcast_due(now) if b.target_region in self._stubs]
        if not due:
            return 0
        answers = await asyncio.gather(
            *(self._stubs[b.target_region].exchange_queues(QueueVector(region=b.source_region, queues=b.vector), timeout=self._timeout, metadata=self._metadata) for b in due),
            return_exceptions=True,
        )
        ok = 0
        for a in answers:
            if isinstance(a, QueueVector):
                with contextlib.suppress(KVCompassError):
                    self.edge.on_broadcast(a.region, dict(a.queues), self._clock())
                ok += 1
            elif isinstance(a, (GRPCError, StreamTerminatedError, OSError, asyncio.TimeoutError)):
                self.failed += 1  # the peer is down or slow: the next Delta tries again
            elif isinstance(a, asyncio.CancelledError):
                raise a
            elif isinstance(a, Exception):
                # An answer the client could not decode (a peer of another version, a broken
                # one) is that peer's failure: one of them used to end the broadcasts to every
                # region for good (found in review).
                self.failed += 1
                _log.warning("queue exchange: bad answer from a peer edge: %s: %s", type(a).__name__, a)
            elif isinstance(a, BaseException):
                raise a
        self.sent += ok
        return ok

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self._tick)
            await self.tick()

    async def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name=f"queues-{self.edge.region}")

    async def close(self) -> None:
        try:
            if self._task is not None:
                task, self._task = self._task, None
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        finally:
            self._channels.close()


class EdgeServer(AsyncResource):
    """:class:`EdgeService` plus grpclib Health on one server, and optionally the metrics
    endpoint. ``health`` is the readiness check (EdgeSync's), reported for the Edge service and
    overall; ``ready`` backs ``/healthz``."""

    def __init__(
        self, service: EdgeService, *, health: CheckBase | None = None, metrics: ServiceMetrics | None = None, ready: Callable[[], bool] | None = None, routes: Sequence[Route] = ()
    ) -> None:
        self.service = service
        self._routes = list(routes)
        self.status: CheckBase = health if health is not None else ServiceStatus()
        if health is None:
            assert isinstance(self.status, ServiceStatus)
            self.status.set(True)
        self.health = Health({service: [self.status]})
        self.metrics = metrics if metrics is not None else ServiceMetrics("edge")
        self._ready = ready if ready is not None else (lambda: self.status.__status__() is True)
        self._server: DrainingServer | None = None
        self._metrics_server: MetricsServer | None = None
        self.grpc = ""
        self.metrics_url: str | None = None

    async def start(self, host: str = "127.0.0.1", port: int = 0, *, metrics_port: int | None = None, ssl_context: ssl.SSLContext | None = None) -> str:
        """Listen on ``host:port`` (0: a free port; over TLS with ``ssl_context``); returns
        ``host:port`` as bound."""
        self._server, self.grpc = await DrainingServer.listen(
            [self.service, self.health], host, port, metrics=self.metrics, limits=self.service.message_limits(), ssl_context=ssl_context
        )
        if metrics_port is not None:
            self._metrics_server = MetricsServer(self.metrics.registry, self._ready, self._routes)
            self.metrics_url = f"http://{hostport(host, await self._metrics_server.start(host, metrics_port))}"
        return self.grpc

    async def close(self) -> None:
        if isinstance(self.status, ServiceStatus):
            self.status.set(False)
        if self._server is not None:
            server, self._server = self._server, None
            await server.shut()
        if self._metrics_server is not None:
            m, self._metrics_server = self._metrics_server, None
            await m.close()

