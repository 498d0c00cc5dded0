"""The edge's OpenAI-compatible HTTP front door: tokenize, route with the edge's index, proxy to
the chosen worker (streaming), and feed what the response reports back into the edge.

An application (:mod:`kvcompass.services.http_server`) around one :class:`~kvcompass.discovery.edge.Edge`. The edge stays
sans-I/O; this module owns the sockets, the clock and the retries.

**A request's life.**

1. Parse and validate the OpenAI body (``/v1/completions``: ``prompt`` as text or token ids;
   ``/v1/chat/completions``: ``messages``). Every refusal is a 4xx with OpenAI's error body
   ``{"error": {"message", "type", "param", "code"}}``, so OpenAI clients surface it as they
   would OpenAI's own.
2. Tokenize with the injected tokenizer (the same ids the workers key their caches by). Token-id
   prompts are used as they are and forwarded as they are.
3. Route: ``Edge.route(tokens, Namespace(model, tenant), now)``; the tenant comes from
   ``x-kvcompass-namespace`` (sharing is scoped by the namespace digest, docs/design.md section 7). A
   request of any tenant but the default is forwarded with ``cache_salt`` =
   ``TENANT_SALT_PREFIX + tenant`` (vLLM's per-request salt), so the engine keeps that tenant's
   KV apart too and its agent keys it in the tenant's namespace; a client's own ``cache_salt``
   is refused (400), since it could place KV under another tenant's salt.
4. Forward the client's body to ``{worker base URL}{same path}`` after the emulated WAN one way
   (when configured). Streams ask the worker for a usage chunk
   (``stream_options.include_usage``) because that is where ``cached_tokens`` arrives.
5. Relay: a JSON body as received; an SSE stream event by event as each arrives (never buffered
   to the end), dropping the usage-only chunk the client did not ask for.
6. Learn: ``usage.prompt_tokens_details.cached_tokens`` is the reuse report for
   ``Edge.on_response``; ``x-kvcompass-queue-ms`` is a live queue reading (own region:
   ``Edge.set_local_queue``) and ``x-kvcompass-queue-vector`` (JSON ``{worker: ms}``) a remote
   region's vector. A response without ``cached_tokens`` (vLLM without
   ``--enable-prompt-tokens-details``) is *not* read as "reused nothing": it reports with
   ``claimed=0``, which leaves the belief alone.

**Dead workers.** A connection failure, a timeout before the response head, or a 503 (the
worker says it cannot serve: draining, overloaded) marks the worker dead for
``dead_cooldown_s`` and the request is routed again without it (at most ``max_attempts``
workers per request; when every one answered 503 the client gets the last one's answer). Any
other status, a 500 included, is the request's own answer and is relayed as the engine gave it:
an engine fails one request with a 500 while it serves the rest. Once bytes went to the client a
failure cannot be retried: the stream ends with an SSE error event and ``[DONE]``, as vLLM ends
one. A client that leaves takes its request with it (the exchange is abandoned, its connection
closed, nothing retried). A worker that stops
answering the edge's load poll (hung, not gone: its port still accepts) is held dead while it
stays silent (:meth:`FrontDoor.hold_unresponsive`), and back as soon as it answers.

:meth:`Edge.route` is told which workers are excluded (dead, or already tried for this
request), so its joint score picks the best of the rest; with none left the request fails.

**Hand-off** (:meth:`Edge.handoff`). With ``peers`` (region -> that region's door URL) a request
routed to a worker of a peer region goes to the peer door with ``x-kvcompass-handoff: WORKER``
instead of to the worker: the peer door, which reads its workers' queues live, keeps that worker
or moves the request to a better one of its own region (never to a third region, never back),
and names the worker that served in ``x-kvcompass-worker``. When it moved the request the
origin reports ``claimed=0`` for the worker that served (its claim was about another one), so
beliefs move only on claims that were made. Without a peer for the region, or with the edge's
``handoff`` switch off, the door forwards to the worker directly.

**Queue vectors out.** A caller that names its region in ``x-kvcompass-region`` (another edge,
a gateway) gets this edge's piggyback vector for that region in ``x-kvcompass-queue-vector``.

**Drain.** :meth:`DoorServer.stop` turns ``/health`` to 503 and refuses new completions with
503 first, waits for in-flight requests (up to the grace period), then closes the listener and
the upstream connection pool.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import json
import math
import os
import re
import socket
import ssl
import time
from collections import OrderedDict, deque
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import numpy as np
import numpy.typing as npt
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from kvcompass import _core
from kvcompass.discovery.edge import Decision, Edge
from kvcompass.discovery.migration import MigrationAction
from kvcompass.discovery.queues import MAX_QUEUE_MS
from kvcompass.errors import DrainingError, InvalidArgumentError, KVCompassError, MessageTooLargeError, NotAllowedError, RateLimitedError, UnauthenticatedError
from kvcompass.index_types import Namespace
from kvcompass.services.api_keys import ANY_TENANT, ApiKey, KeyStore
from kvcompass.services.conn_guard import ConnGuard
from kvcompass.services.http_server import App, HttpServer, Request, Response, StreamResponse, check_cors_origins, json_response, path_tail
from kvcompass.services.openai_api import (
    INLINE_TOKENIZE_CHARS,
    MODELS_PREFIX,
    OpenAIError,
    add_routes,
    decode_json_object,
    error_body,
    model_card,
    model_not_found,
    models_list,
    parse_json,
    prompt_batch,
    client_closed,
    request_tokens,
    sampling_fields,
    stream_usage,
)
from kvcompass.services.lifecycle import AsyncResource, bind_socket
from kvcompass.services.loop_metrics import Counter, Gauge, Histogram
from kvcompass.services.metrics import export_counter
from kvcompass.services.upstream import UpstreamAbandoned, UpstreamBusy, UpstreamConnectError, UpstreamDisconnected, UpstreamError, UpstreamPool, UpstreamResponse, UpstreamTooLarge
from kvcompass.services.wire import (
    HANDOFF_HEADER,
    HEALTH_PATH,
    MIGRATION_HEADER,
    NAMESPACE_HEADER,
    QUEUE_MS_HEADER,
    QUEUE_VECTOR_HEADER,
    REGION_HEADER,
    TENANT_SALT_PREFIX,
    WORKER_HEADER,
)

__all__ = [
    "FRONT_DOOR",
    "DoorConfig",
    "DoorServer",
    "FrontDoor",
    "TokenizerLike",
    "make_app",
    "serve_door",
]


_TENANT_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:@/+-]{0,127}")
_REGION_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
_NAMESPACE_CACHE = 4096
_TENANT_SERIES = 256  # tenant names with a request-count series of their own
_OTHER_TENANTS = "(other)"  # the series of the rest (not a valid tenant name: no clash)
_log = logging.getLogger("kvcompass.door")

def valid_tenant(name: str) -> bool:
    """Whether ``name`` may name a tenant (the ``x-kvcompass-namespace`` header's syntax)."""
    return _TENANT_RE.fullmatch(name) is not None


_KEY_SLOT = "kvcompass_api_key"
"""Where a request keeps the grants of its API key once looked up (the request's storage)."""

_SILENT = "it stopped answering the edge's load poll"
_CLIENT_GONE = "the client closed its connection"
_REFUSAL_BYTES = 64 * 1024
"""The most of a 503's body the door keeps to relay should no other worker serve the request."""

FailureReason = Literal["connect", "timeout", "status_503", "disconnect", "midstream", "unresponsive"]


class TokenizerLike(Protocol):
    """What the door needs of a tokenizer (:class:`kvcompass.engine.tokenizer.Tokenizer` is one).

    Errors raised for bad input (``ValueError``, :class:`~kvcompass.errors.KVCompassError`) become
    400s; anything else is a bug and a 500.
    """

    def encode(self, text: str) -> npt.NDArray[np.uint32]: ...

    def encode_prompt(self, text: str, add_special_tokens: bool = True) -> npt.NDArray[np.uint32]:
        """A completion prompt's ids as the model's engine computes them (e.g. with its BOS)."""
        ...

    def apply_chat_template(self, messages: list[dict[str, Any]], tools: Any = None, options: Any = None) -> npt.NDArray[np.uint32]: ...


@dataclass(frozen=True, slots=True)
class DoorConfig:
    """The door's knobs. ``models[0]`` serves requests that name no model."""

    models: tuple[str, ...] = ("llama-3.1-8b",)
    default_tenant: str = "public"
    max_prompt_tokens: int = 131072
    """With the model's own tokenizer, a longer prompt is refused (context_length_exceeded);
    with the built-in one, whose counts are not the model's, it is routed on its first
    ``max_prompt_tokens`` and forwarded whole for the engine to judge."""
    max_body_bytes: int = 16 * 1024 * 1024
    max_batch_prompts: int = 256
    """Prompts one ``/v1/completions`` request may list (each is routed on its own)."""
    max_response_bytes: int = 64 * 1024 * 1024
    """The most a worker's whole (not streamed) answer may hold; past it the client gets a 502
    that says so, not a door holding whatever a broken worker sends. Streams are relayed piece
    by piece and not bounded."""
    max_attempts: int = 3
    """Workers tried per request (the first choice included)."""
    dead_cooldown_s: float = 10.0
    connect_timeout_s: float = 3.0
    head_timeout_s: float = 600.0
    """Until the worker's response head; a long prefill queue is legitimate, so generous."""
    answer_timeout_s: float = 3600.0
    """Until a whole (non-streamed) answer's head, which comes after its last token. Past
    ``head_timeout_s`` the worker's ``/health`` is asked every ``head_timeout_s``: a worker that
    answers two probes in a row with nothing has failed (the request is retried elsewhere); one
    that answers at all is generating, and past this deadline the client gets a 504, the worker
    is not marked dead (:class:`_AnswerWatch`)."""
    read_timeout_s: float = 600.0
    """Between two reads of the worker's body (a stalled stream)."""
    client_write_timeout_s: float = 60.0
    """How long a write to a client that reads nothing may wait; the connection is then cut
    (and with it the worker's answer it was holding)."""
    drain_grace_s: float = 30.0
    inline_tokenize_chars: int = INLINE_TOKENIZE_CHARS
    """Texts up to this many characters are tokenized on the event loop (tens of microseconds);
    longer ones in a thread, so one huge prompt does not stall every other request."""
    max_upstream_connections: int = 0
    """0 = unlimited (aiohttp's default of 100 would cap concurrency far below a worker's)."""
    forward_headers: tuple[str, ...] = ("authorization", "x-request-id")
    cors_origins: tuple[str, ...] = ("*",)
    """Origins a browser may call the door from (``*``: any, vLLM's default; ``()``: no CORS
    headers at all). A key is still needed where the door has keys."""
    expose_worker: bool = True
    """Tell the client which worker served (``x-kvcompass-worker``), for load generators and
    debugging; turn off where worker identity is sensitive."""
    body_timeout_s: float = 30.0
    """To read a request's body once its head arrived: a client that announces more than it
    sends (a short body, a slow drip) gets a 408 instead of holding a connection forever."""
    max_inflight_per_client: int = 256
    """Completion requests one client (its API key, or its address on an open door) may have in
    progress; past it, 429. Keeps one client's hundreds of slow streams from starving others."""
    header_timeout_s: float = 10.0
    """How long a new connection may take to send its first request head, and a kept-alive one
    a later head from its first byte, before it is closed (a slowloris client trickling
    headers; :mod:`kvcompass.services.conn_guard`)."""
    max_connections_per_address: int = 1024
    """Open connections one client address may hold; past it, 503 and closed before the
    application sees them."""
    stale_grace_s: float = 10.0
    """How long a shard's subscription may be down (a unit restarting, a repair) before
    ``/health`` says not ready (``stale``)."""
    api_keys: KeyStore | None = None
    """The keys completions need (``Authorization: Bearer``; see
    :mod:`kvcompass.services.api_keys`): the tenant comes from the key, and the
    ``x-kvcompass-namespace`` header only selects among the key's tenants. None: open, any
    client acts as any tenant it names (local experiments only)."""
    peer_key: str | None = None
    """The key this door presents to other regions' doors when it hands a request over (an
    any-tenant key of their keys files)."""
    migration_poll_s: float = 0.1
    """How often the door asks its edge for migration actions and carries them out (0: never;
    :meth:`FrontDoor.migrate`). The edge's hotness window is a second, so a tenth of it."""
    max_migrations_inflight: int = 4
    """Replica prefills the door has outstanding at once (more wait their turn)."""

    def __post_init__(self) -> None:
        if not self.models or any(not isinstance(m, str) or not m for m in self.models):
            raise ValueError(f"models must be non-empty names, got {self.models!r}")
        check_cors_origins(self.cors_origins)
        if not _TENANT_RE.fullmatch(self.default_tenant):
            raise ValueError(f"default_tenant {self.default_tenant!r} is not a valid tenant name")
        for name in ("max_prompt_tokens", "max_body_bytes", "max_response_bytes", "max_attempts", "max_inflight_per_client", "max_connections_per_address", "max_migrations_inflight"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("dead_cooldown_s", "connect_timeout_s", "head_timeout_s", "answer_timeout_s", "read_timeout_s", "drain_grace_s", "stale_grace_s", "body_timeout_s", "migration_poll_s"):
            v = getattr(self, name)
            if not (math.isfinite(v) and v >= 0):
                raise ValueError(f"{name} must be finite and >= 0, got {v}")
        for name in ("header_timeout_s", "client_write_timeout_s"):
            v = getattr(self, name)
            if not (math.isfinite(v) and v > 0):
                raise ValueError(f"{name} must be finite and > 0, got {v}")


# -- errors ------------------------------------------------------------------------------------------


# -- metrics -----------------------------------------------------------------------------------------


class _Metrics:
    """Every metric in one registry of its own, so several doors (tests, ``kvcompass up``) can
    share a process without colliding in prometheus_client's global registry. The metrics are
    :mod:`kvcompass.services.loop_metrics`' (no lock, no validation per update: about ten
    updates a proxied request), exposed as prometheus_client's own would be."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        p = "kvcompass_door_"
        self.requests = Counter(p + "requests", "HTTP requests by endpoint and status code", ["endpoint", "status"], registry=registry)
        self.request_seconds = Histogram(
            p + "request_seconds",
            "Wall time of a completion request, to the last byte relayed",
            ["endpoint"],
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
            registry=registry,
        )
        # Edge.route is a microsecond call: buckets from 5 us to 10 ms.
        self.route_seconds = Histogram(
            p + "route_latency_seconds",
            "Edge.route latency (lookup and joint score)",
            buckets=(5e-6, 1e-5, 2e-5, 5e-5, 1e-4, 2e-4, 5e-4, 1e-3, 2e-3, 5e-3, 1e-2),
            registry=registry,
        )
        self.ttft_seconds = Histogram(
            p + "ttft_seconds",
            "Time to first token as the client sees it from the door: to the first streamed event, or to the whole response when not streaming",
            ["stream"],
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
            registry=registry,
        )
        self.routes = Counter(p + "routes", "Requests routed, by the chosen worker's region", ["worker_region"], registry=registry)
        # Running totals read when scraped, exported as counters (``_total``): the connection
        # guard's refusals and header timeouts (set by the door, which owns the guard) and the
        # process's prefix memo (rust/prefix_memo.rs), how much of the routes' hashing it saved.
        export_counter(registry, p + "prefix_memo_hits", "Plan lengths routes found in the process's prefix memo instead of hashing them", lambda: _core.prefix_memo_stats()[0])
        export_counter(registry, p + "prefix_memo_misses", "Plan lengths routes hashed with SHA-256 and filed in the prefix memo", lambda: _core.prefix_memo_stats()[1])
        self.peer_failures = Counter(p + "peer_failures", "Hand-offs a peer door failed to answer (the worker was then tried directly when its URL is known)", registry=registry)
        self.peer_doors = Gauge(p + "peer_doors", "Other regions' doors this door hands requests to", registry=registry)
        self.migrations = Counter(
            p + "migrations",
            "Replicas of hot prefix families the door placed on idle workers for its edge, by the kind the edge asked for and outcome",
            ["kind", "outcome"],
            registry=registry,
        )
        self.handoffs = Counter(p + "handoffs", "Requests another region's door handed to this one, by outcome (kept: the worker it named)", ["outcome"], registry=registry)
        self.hits = Counter(p + "hits", "Responses where the index claimed a prefix and the worker reused all of it", registry=registry)
        self.false_hits = Counter(p + "false_hits", "Responses where the index claimed a prefix (claimed > 0) and the worker reused less", registry=registry)
        self.claimed = Counter(p + "claimed_tokens", "Prompt tokens the index claimed the chosen worker held", registry=registry)
        self.reused = Counter(p + "reused_tokens", "Prompt tokens workers reported reusing (usage cached_tokens)", registry=registry)
        self.route_truncated = Counter(
            p + "routes_on_truncated_prompts",
            "Prompts over max_prompt_tokens by the built-in tokenizer's count, routed on their first max_prompt_tokens and forwarded whole",
            registry=registry,
        )
        self.no_usage = Counter(p + "responses_without_cached_tokens", "Successful responses that reported no cached_tokens", registry=registry)
        self.retries = Counter(p + "retries", "Attempts beyond the first worker of a request", registry=registry)
        self.failures = Counter(p + "worker_failures", "Worker failures seen by the door", ["worker", "reason"], registry=registry)
        self.bad_feedback = Counter(p + "bad_feedback", "Malformed feedback from workers (headers, usage), ignored", ["kind"], registry=registry)
        self.belief = Gauge(p + "worker_belief", "The edge's cache belief per worker", ["worker"], registry=registry)
        self.queue = Gauge(p + "worker_queue_estimate_ms", "The edge's queue estimate per worker (ms)", ["worker"], registry=registry)
        self.dead = Gauge(p + "worker_dead", "1 while the worker is excluded after a failure", ["worker"], registry=registry)
        self.healthy = Gauge(p + "edge_healthy", "1 while every view of the edge is current", registry=registry)
        self.stale = Gauge(p + "shard_stale_seconds", "Seconds a shard's subscription has not been current (listed only while it is not)", ["shard"], registry=registry)
        self.inflight = Gauge(p + "inflight_requests", "Completion requests in progress", registry=registry)
        self.tenant_requests = Counter(p + "tenant_requests", "Completion requests admitted, by tenant (the API key's)", ["tenant"], registry=registry)
        self.auth_refusals = Counter(p + "auth_refusals", "Completion requests refused for their credentials, by reason (key, rate, concurrency, tenant, model, handoff)", ["reason"], registry=registry)


# -- the door ----------------------------------------------------------------------------------------


@dataclass(slots=True)
class _Choice:
    worker: str
    region: str | None
    claimed: int
    decision: Decision | None
    record: dict[str, Any] | None = None
    """This route's row in :attr:`FrontDoor.recent_routes` (its reuse filled in on response)."""


@dataclass(slots=True)
class _Prepared:
    """A validated request, ready to route and forward."""

    path: str
    raw: bytes
    """The body to forward: the client's bytes unless the door had to ask for usage."""
    tokens: npt.NDArray[np.uint32]
    namespace: Namespace
    stream: bool
    client_usage: bool
    headers: dict[str, str]
    handoff: str | None = None
    """The worker another region's door sent this request to (``x-kvcompass-handoff``)."""
    t0: float = 0.0
    """When the door started serving it (``time.perf_counter``): time to first token and to
    the last byte are measured from here, so they include the door's own time."""
    batch_index: int | None = None
    """For one prompt of a batched request: the index its first choice takes in the merged
    response (prompt position times ``n``, as OpenAI numbers them); None for a plain request."""
    client_usage_asked: bool = False
    """For a batch's prompt: whether the client asked for the (merged) usage chunk."""
    sink: _BatchStream | None = None
    """For a batch's streamed prompt: where its events go instead of a response of its own."""
    prompt_index: int | None = None
    """For one prompt of a batched request: its position in ``prompt`` (named in its errors)."""


@dataclass(slots=True)
class _Feedback:
    """What a response told us, folded into the edge once it is complete."""

    queue_ms: float | None = None
    vector: dict[str, float] | None = None
    reused: int | None = None
    bare_usage: bool = False
    """A usage object came without ``prompt_tokens_details``: vLLM's way of saying nothing was
    cached, when it reports cached tokens at all (see :meth:`FrontDoor._learn`)."""


class _AnswerWatch:
    """Watches a worker while the door waits for a whole (non-streamed) answer: from the head
    deadline on, every ``head_timeout_s`` it asks the worker's ``/health`` (within
    ``connect_timeout_s``). Two probes in a row that get no answer at all (the second
    ``connect_timeout_s`` after the first: a briefly stalled server is not a dead one, and the
    answer it is generating may be ten minutes of work) abandon the wait
    (:meth:`UpstreamResponse.abandon`), which the forward turns into the worker's failure. Any
    HTTP answer is a live process still working on the request: a draining engine answers its
    health 503 and finishes what it has (found in review: a 5xx read as death threw away every
    in-flight answer of a rolling restart). One timer handle per request until the deadline;
    a task only for a probe."""

    __slots__ = ("door", "base", "resp", "timer", "probe", "misses", "failed")

    def __init__(self, door: FrontDoor, base: str) -> None:
        self.door, self.base = door, base
        self.resp: UpstreamResponse | None = None
        self.failed = ""
        self.misses = 0
        self.probe: asyncio.Task[None] | None = None
        self.timer: asyncio.TimerHandle | None = asyncio.get_running_loop().call_later(door.config.head_timeout_s, self._start)

    def watching(self, resp: UpstreamResponse) -> None:
        """The exchange now waited for (a retry on a fresh connection hands over a new one)."""
        self.resp = resp
        if self.failed:
            resp.abandon(self.failed)  # the worker was found gone before this exchange began

    def _start(self) -> None:
        self.timer = None
        self.probe = asyncio.get_running_loop().create_task(self._check())

    async def _check(self) -> None:
        session = self.door._session
        alive, why = session is None, ""
        if session is not None:
            try:
                up = await session.post(self.base + HEALTH_PATH, b"", {}, head_timeout=self.door.config.connect_timeout_s, method=b"GET")
                up.close()
                alive = True
            except UpstreamBusy:
                alive = True  # the door's own connection limit, not the worker's health
            except (UpstreamError, TimeoutError, OSError) as e:
                why = f"its /health did not answer twice ({e})"
        self.probe = None
        loop = asyncio.get_running_loop()
        if alive:
            self.misses = 0
            self.timer = loop.call_later(self.door.config.head_timeout_s, self._start)
            return
        self.misses += 1
        if self.misses < 2:
            self.timer = loop.call_later(self.door.config.connect_timeout_s, self._start)
            return
        self.failed = why
        if self.resp is not None:
            self.resp.abandon(why)

    def close(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
        if self.probe is not None:
            self.probe.cancel()


def _nth_request(headers: dict[str, str], i: int) -> dict[str, str]:
    """Prompt ``i``'s headers of a split batch: its own ``x-request-id`` (the client's with
    ``-i``), since the split prompts run side by side, often on one worker, and vLLM names a
    request by that header: one id for all of them collided there (found in review)."""
    name = next((h for h in headers if h.lower() == "x-request-id"), None)  # as forward_headers spells it
    return headers if name is None else {**headers, name: f"{headers[name]}-{i}"}


class _WorkerFailed(Exception):
    """The worker could not serve the request: routed again without it. ``reply``: what it
    answered (status, body, content type) when it answered at all, for the client should no
    other worker serve."""

    def __init__(self, reason: FailureReason, detail: str, reply: tuple[int, bytes, str] | None = None) -> None:
        super().__init__(detail)
        self.reason: FailureReason = reason
        self.detail = detail
        self.reply = reply




class FrontDoor:
    """The door's state and handlers (one per application; see :func:`make_app`)."""

    def __init__(
        self,
        edge: Edge,
        workers: Mapping[str, str],
        tokenizer: TokenizerLike,
        config: DoorConfig,
        *,
        regions: Mapping[str, str] | None = None,
        wan_one_way_ms: Callable[[str, str], float] | None = None,
        clock: Callable[[], float] = time.monotonic,
        registry: CollectorRegistry | None = None,
        upstream_ssl: ssl.SSLContext | None = None,
        peers: Mapping[str, str] | None = None,
    ) -> None:
        known = set(edge.workers)
        unknown = sorted(set(workers) - known)
        if unknown:
            raise ValueError(f"workers {unknown} are not workers of this edge (it has {sorted(known)})")
        self.edge = edge
        self.config = config
        self.tokenizer = tokenizer
        self._estimated_counts = bool(getattr(tokenizer, "builtin", False))
        self.urls = {w: u.rstrip("/") for w, u in workers.items()}
        # Regions of workers the door may pick itself: the own region's from the edge's local
        # vector, the others given or learned from each Decision.
        self.regions: dict[str, str] = dict(regions or {})
        self.regions.update({w: edge.region for w in edge.local_vector()})
        self._wan = wan_one_way_ms
        self._clock = clock
        self.metrics = _Metrics(registry if registry is not None else CollectorRegistry())
        self._dead: dict[str, float] = {}
        self._unresponsive: set[str] = set()  # held dead by hold_unresponsive
        self._awaiting: dict[str, set[UpstreamResponse]] = {}  # exchanges waiting for a head, by worker
        self._relaying: dict[str, set[UpstreamResponse]] = {}  # streams being relayed, by worker
        # Workers that have reported usage.prompt_tokens_details: a later usage without it means
        # nothing was cached (vLLM omits the field then); from the others it means "unknown".
        self._reports_cached: set[str] = set()
        self._unreachable = frozenset(known - set(self.urls))
        self._namespaces: OrderedDict[tuple[str, str], Namespace] = OrderedDict()
        self._tenant_series: set[str] = set()
        self._models = {m: i for i, m in enumerate(config.models)}
        self._created = int(time.time())
        self._session: UpstreamPool | None = None
        self._poller: asyncio.Task[None] | None = None
        self.draining = False
        self.stale_shards: Callable[[], Mapping[int, float]] | None = None
        """Shard -> seconds its subscription has not been current (the edge's syncer sets it;
        :meth:`health` reports them and turns not-ready past ``stale_grace_s``)."""
        self._inflight = 0
        self.recent_routes: deque[dict[str, Any]] = deque(maxlen=200)
        """The latest routing decisions, for the dashboard (kvcompass.services.dashboard)."""
        self.recent_migrations: deque[dict[str, Any]] = deque(maxlen=50)
        """The last migrations carried out (the dashboard's table)."""
        self._names: dict[bytes, tuple[str, str]] = {}  # namespace digest -> (model, tenant)
        self._migrating: set[asyncio.Task[None]] = set()
        self.conn_guard = ConnGuard(config.max_connections_per_address, config.header_timeout_s)
        g = self.conn_guard
        export_counter(self.metrics.registry, "kvcompass_door_refused_connections", "Connections refused because their client address held max_connections_per_address", lambda: g.refused)
        export_counter(self.metrics.registry, "kvcompass_door_header_timeouts", "Connections closed because a request head was not whole within header_timeout_s of the connection or of its first byte", lambda: g.timed_out)
        self._per_client: dict[str, int] = {}
        self._idle = asyncio.Event()
        self._idle.set()
        self._upstream_ssl = upstream_ssl
        self._region_of = {w: t.region for t in edge.layout.tables for w in t.workers}
        self._known = known
        self._peers: dict[str, str] = {}
        self._peer_down: dict[str, float] = {}
        self.set_peers(peers or {})

    def set_peers(self, peers: Mapping[str, str]) -> None:
        """Other regions' door base URLs, for hand-offs (see the module notes). Workers of a
        peer region are reachable through it even without a URL of their own."""
        own = self.edge.region
        regions = set(self._region_of.values())
        out: dict[str, str] = {}
        for r, u in peers.items():
            if r == own or r not in regions:
                continue  # not a region this edge routes to
            if not isinstance(u, str) or not u.startswith(("http://", "https://")):
                raise ValueError(f"peer door of {r!r} must be an http(s) URL, got {u!r}")
            out[r] = u.rstrip("/")
        self._peers = out
        self.metrics.peer_doors.set(len(out))
        no_url = self._known - set(self.urls)
        self._unreachable = frozenset(w for w in no_url if self._region_of.get(w) not in out)
        # Workers only a peer door reaches: unreachable while that door is cooling down.
        self._via_peer: dict[str, frozenset[str]] = {r: frozenset(w for w in no_url if self._region_of.get(w) == r) for r in out}

    # -- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> None:
        """The upstream pool and the migration poller (the server's start hook)."""
        # upstream_ssl verifies https:// workers (and presents the door's certificate to those
        # that require one); plain http:// workers are unaffected.
        # No total deadline: a stream may legitimately run for minutes; the head and read limits bound stalls.
        cfg = self.config
        self._session = UpstreamPool(limit=cfg.max_upstream_connections, connect_timeout_s=cfg.connect_timeout_s, read_timeout_s=cfg.read_timeout_s, keepalive_s=30.0, ssl=self._upstream_ssl)
        self._poller = asyncio.create_task(self._migration_loop()) if self.config.migration_poll_s > 0 else None

    async def stop(self) -> None:
        """The server's stop hook: the poller and migrations cancelled, the pool closed."""
        tasks = [*([self._poller] if self._poller is not None else []), *self._migrating]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._poller = None
        if self._session is not None:
            await self._session.close()
            self._session = None

    # -- migration ---------------------------------------------------------------------------------

    async def _migration_loop(self) -> None:
        slots = asyncio.Semaphore(self.config.max_migrations_inflight)
        while True:
            await asyncio.sleep(self.config.migration_poll_s)
            if self.draining:
                continue
            try:
                actions = self.edge.migration_actions(self._clock(), exclude=self.dead_workers())
            except KVCompassError as e:
                _log.warning("migration actions failed: %s", e)
                continue
            for a in actions:
                task = asyncio.create_task(self._migrate_in_turn(slots, a))
                self._migrating.add(task)
                task.add_done_callback(self._migrating.discard)

    async def _migrate_in_turn(self, slots: asyncio.Semaphore, action: MigrationAction) -> None:
        async with slots:
            await self.migrate(action)

    async def migrate(self, action: MigrationAction) -> dict[str, Any]:
        """Carry out one of the edge's migration actions (paper section 3.4): place a replica of
        the hot family's prefix on the idle target worker by sending it the prefix as a prompt
        with ``max_tokens`` 1, so the worker prefills it, caches it and publishes the KV events
        that index it, as any request would. An OpenAI endpoint offers no way to move KV
        between engines, so a ``copy`` is carried out as a recompute too (the row says both),
        and the replica lands in the tier the engine puts a fresh prefill in (VRAM), not the
        DRAM the edge names. Returns the dashboard row."""
        row: dict[str, Any] = {
            "at": time.time(),
            "family": f"{action.family:016x}",
            "kind": action.kind,
            "done_as": "recompute",
            "source": action.source,
            "target": action.target,
            "tokens": int(action.length),
        }
        outcome = "ok"
        t0 = time.perf_counter()
        named = self._names.get(action.namespace)
        url = self.urls.get(action.target)
        session = self._session
        if named is None or url is None or session is None:
            outcome = "skipped"
            row["error"] = "no longer known here" if named is None else ("not reachable from this door" if url is None else "the door is stopping")
        else:
            model, tenant = named
            body: dict[str, Any] = {"model": model, "prompt": action.tokens[: action.length].tolist(), "max_tokens": 1, "stream": False}
            if tenant != self.config.default_tenant:
                body["cache_salt"] = TENANT_SALT_PREFIX + tenant
            headers = {"Content-Type": "application/json", NAMESPACE_HEADER: tenant, MIGRATION_HEADER: action.kind}
            try:
                # The requests' own deadlines and answer limit: without them a target that never
                # answered held one of the few migration slots for good (found in review).
                r = await session.post(url + "/v1/completions", json.dumps(body).encode(), headers, head_timeout=self.config.head_timeout_s)
                try:
                    await r.read(limit=self.config.max_response_bytes)
                finally:
                    r.close() if not r.at_eof() else r.release()
                if r.status != 200:
                    outcome = "failed"
                    row["error"] = f"http {r.status}"
            except (UpstreamError, TimeoutError) as e:
                outcome = "failed"
                row["error"] = type(e).__name__
        row["outcome"] = outcome
        row["ms"] = round((time.perf_counter() - t0) * 1e3, 1)
        self.metrics.migrations.labels(action.kind, outcome).inc()
        self.recent_migrations.append(row)
        return row

    @property
    def inflight(self) -> int:
        return self._inflight

    async def wait_idle(self, timeout: float) -> bool:
        """Wait until no completion is in flight; False if ``timeout`` passed first."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
        except TimeoutError:
            return False
        return True

    # -- dead workers ------------------------------------------------------------------------

    def dead_workers(self) -> frozenset[str]:
        """Workers excluded now after a failure (their cooldown has not run out)."""
        now = self._clock()
        for w in [w for w, until in self._dead.items() if until <= now]:
            del self._dead[w]
        return frozenset(self._dead)

    def mark_dead(self, worker: str, reason: FailureReason) -> None:
        self._dead[worker] = self._clock() + self.config.dead_cooldown_s
        self.metrics.failures.labels(worker, reason).inc()

    def hold_unresponsive(self, worker: str, silent: bool) -> None:
        """The edge's load poll of ``worker``: ``silent`` when it has not answered for a while.
        A hung worker (stopped, wedged) still accepts connections, so requests sent to it wait
        out the head deadline (minutes) and nothing marked it dead (found in review: three of
        eight requests hung while it looked healthy). Held dead while silent (counted once a
        silence), and let back in on its first answer, not after a cooldown."""
        if silent:
            if worker in self._unresponsive:
                self._dead[worker] = self._clock() + self.config.dead_cooldown_s  # still silent
                return
            self._unresponsive.add(worker)
            self.mark_dead(worker, "unresponsive")
            # Requests waiting for its answer's head are routed again (nothing of them reached
            # their clients yet); a stream already flowing ends with an error event, as any
            # failure mid-stream does (found in review: it stayed open, silent, until the read
            # deadline, minutes, its in-flight slot held even after its client left).
            for resp in [*self._awaiting.get(worker, ()), *self._relaying.get(worker, ())]:
                resp.abandon(_SILENT)
        elif worker in self._unresponsive:
            self._unresponsive.discard(worker)
            self._dead.pop(worker, None)

    # -- middleware and small endpoints ----------------------------------------------------------

    def _observe(self, request: Request, resp: StreamResponse, err: OpenAIError | None) -> None:
        """Every request counted by its endpoint and final status (the OpenAI error middleware's
        hook)."""
        # A hand-off from another region's door is labelled apart, so a sum over doors counts
        # each client request once.
        if request.method == "OPTIONS":
            endpoint = "preflight"
        else:
            endpoint = "handoff" if HANDOFF_HEADER in request.headers else _ENDPOINTS.get(request.path) or ("models" if request.path.startswith(MODELS_PREFIX) else "other")
        self.metrics.requests.labels(endpoint, str(resp.status)).inc()

    async def models(self, request: Request) -> Response:
        return json_response(models_list([model_card(m, self._created) for m in self.config.models]))

    async def model(self, request: Request) -> Response:
        """``GET /v1/models/{model}`` (OpenAI's ``models.retrieve``)."""
        model = path_tail(request, MODELS_PREFIX)
        if model not in self._models:
            raise model_not_found(model, self.config.models)
        return json_response(model_card(model, self._created))

    async def health(self, request: Request) -> Response:
        """Readiness. 503 while draining (``draining``) or while a view waits for its first
        snapshot from a unit not down past ``stale_grace_s`` (``starting``: nothing to route on
        yet). A shard down past the grace (its views may be behind without the edge knowing, or
        empty) or a view behind its writer is said in the status (``stale``, ``behind``) with a
        200: the door still routes on what it has, and one maintenance unit down must not take
        every door of every region out of its load balancer (found in review: the Kubernetes
        readiness probe did just that). ``kvcompass_door_shard_stale_seconds`` is the figure to
        alert on."""
        e = self.edge
        down = dict(self.stale_shards()) if self.stale_shards is not None else {}
        stale = {str(k): round(v, 1) for k, v in down.items()}
        body: dict[str, Any] = {
            "status": "ok",
            "region": e.region,
            "behind": len(e.behind),
            "uninitialised": len(e.uninitialised),
            "stale_shards": stale,
            "dead_workers": sorted(self.dead_workers()),
        }
        ready = True
        if self.draining:
            body["status"], ready = "draining", False
        elif any(down.get(shard, 0.0) <= self.config.stale_grace_s for _, shard in e.uninitialised):
            # Views still waiting for a first snapshot from a unit that is answering, or has not
            # been down for long: starting. One whose unit has been down past the grace does
            # not hold the door back (found in review: a door restarted while one unit was down
            # never became ready).
            body["status"], ready = "starting", False
        elif e.uninitialised or any(v > self.config.stale_grace_s for v in down.values()):
            body["status"] = "stale"
        elif not e.healthy:
            body["status"] = "behind"
        return json_response(body, status=200 if ready else 503)

    async def metrics_endpoint(self, request: Request) -> Response:
        m, e = self.metrics, self.edge
        dead = self.dead_workers()
        for w in e.workers:
            m.belief.labels(w).set(e.belief(w))
            m.queue.labels(w).set(e.queue_estimate(w))
            m.dead.labels(w).set(1.0 if w in dead else 0.0)
        m.healthy.set(1.0 if e.healthy else 0.0)
        m.stale.clear()
        for shard, s in (self.stale_shards() if self.stale_shards is not None else {}).items():
            m.stale.labels(str(shard)).set(s)
        return Response(body=generate_latest(m.registry), headers={"Content-Type": CONTENT_TYPE_LATEST})

    # -- completions -----------------------------------------------------------------------------

    async def completions(self, request: Request) -> StreamResponse:
        return await self._serve(request, chat=False)

    async def chat_completions(self, request: Request) -> StreamResponse:
        return await self._serve(request, chat=True)

    def _client_of(self, request: Request) -> str | None:
        """Who a request counts against for the per-client cap: its API key's hash, else its
        peer address; None for another region's door handing a request over (its any-tenant
        peer key): hand-offs from a whole region must not queue behind one client's cap."""
        store = self.config.api_keys
        if store is not None:
            # Looked up once a request: _authenticate takes it from here.
            key = request[_KEY_SLOT] = store.authenticate(request.headers.get("Authorization"))
            if key is not None:
                return None if ANY_TENANT in key.tenants else "key:" + key.name
        return "addr:" + (request.remote or "?")

    async def _serve(self, request: Request, *, chat: bool) -> StreamResponse:
        if self.draining:
            raise OpenAIError.of(DrainingError("this edge is shutting down; retry on another"))
        client = self._client_of(request)
        if client is None:
            return await self._serve_counted(request, chat=chat)
        n = self._per_client.get(client, 0)
        if n >= self.config.max_inflight_per_client:
            self.metrics.auth_refusals.labels("concurrency").inc()
            raise OpenAIError.of(RateLimitedError(f"this client already has {n} requests in progress (the limit); retry when one ends", retry_after_s=1.0), code="too_many_concurrent_requests")
        self._per_client[client] = n + 1
        try:
            return await self._serve_counted(request, chat=chat)
        finally:
            left = self._per_client[client] - 1
            if left:
                self._per_client[client] = left
            else:
                del self._per_client[client]

    async def _serve_counted(self, request: Request, *, chat: bool) -> StreamResponse:
        self._inflight += 1
        self._idle.clear()
        self.metrics.inflight.inc()
        t0 = time.perf_counter()
        endpoint = "chat.completions" if chat else "completions"
        try:
            preps = await self._prepare(request, chat=chat)
            for prep in preps:
                prep.t0 = t0
            if len(preps) == 1 and preps[0].batch_index is None:
                return await self._proxy(request, preps[0])
            return await self._proxy_batch(request, preps)
        finally:
            self.metrics.request_seconds.labels(endpoint).observe(time.perf_counter() - t0)
            self.metrics.inflight.dec()
            self._inflight -= 1
            if self._inflight == 0:
                self._idle.set()

    async def _prepare(self, request: Request, *, chat: bool) -> list[_Prepared]:
        """The request validated and ready to route: one :class:`_Prepared`, or one per prompt
        of a batched completions request (each routed and forwarded on its own)."""
        cfg = self.config
        if request.content_length is not None and request.content_length > cfg.max_body_bytes:
            raise OpenAIError.of(MessageTooLargeError(f"request body exceeds {cfg.max_body_bytes} bytes", limit=cfg.max_body_bytes))
        key = self._authenticate(request)
        try:
            if request.complete:
                # The whole body came with the head (most requests): nothing to wait for, so no
                # deadline to arm (a timer per request was a few percent of the door's CPU).
                raw = await request.read()
            else:
                # asyncio.timeout, not wait_for: no task of its own per request. Past
                # max_body_bytes read() raises MessageTooLargeError (413 through the table).
                async with asyncio.timeout(cfg.body_timeout_s):
                    raw = await request.read()
        except TimeoutError:
            raise OpenAIError(408, f"the request body did not arrive within {cfg.body_timeout_s:g} s", code="request_timeout", headers={"Connection": "close"}) from None
        body = decode_json_object(raw, request.headers.get("Content-Type"))

        model = body.get("model")
        if model is None:
            model = cfg.models[0]
        elif not isinstance(model, str):
            raise OpenAIError(400, "model must be a string", "model", "invalid_type")
        elif model not in self._models:
            raise model_not_found(model, cfg.models)
        stream = body.get("stream", False)
        if stream is None:
            stream = False
        if not isinstance(stream, bool):
            raise OpenAIError(400, "stream must be a boolean", "stream", "invalid_type")
        client_usage = stream_usage(body, stream)
        opts = body.get("stream_options")
        n = sampling_fields(body)
        named = request.headers.get(NAMESPACE_HEADER)
        if named is not None and not _TENANT_RE.fullmatch(named):
            raise OpenAIError(400, f"header {NAMESPACE_HEADER} must match {_TENANT_RE.pattern}", NAMESPACE_HEADER, "invalid_namespace")
        if key is None:
            tenant = named if named is not None else cfg.default_tenant
        else:
            granted = key.tenant_for(named, cfg.default_tenant)
            if granted is None:
                self.metrics.auth_refusals.labels("tenant").inc()
                raise OpenAIError.of(NotAllowedError(f"this API key may not act as tenant {named!r} (its tenants: {', '.join(key.tenants)})", code="tenant_not_allowed"), NAMESPACE_HEADER)
            if not key.allows_model(model):
                self.metrics.auth_refusals.labels("model").inc()
                raise OpenAIError.of(NotAllowedError(f"this API key may not use the model {model!r}", code="model_not_allowed"), "model")
            tenant = granted

        batch = None if chat else prompt_batch(body, cfg.max_batch_prompts)
        token_lists = await request_tokens(
            body, self.tokenizer.encode_prompt, self.tokenizer.apply_chat_template, chat=chat, batch=batch, inline_chars=cfg.inline_tokenize_chars, raw_bytes=len(raw)
        )
        for i, tokens in enumerate(token_lists):
            if len(tokens) <= cfg.max_prompt_tokens:
                continue
            if self._estimated_counts:
                # Counted by the built-in tokenizer, not the model's: a prompt in a script it
                # splits finely (CJK, Cyrillic) counts several times what the model sees (found
                # in review: false context_length_exceeded). Route on the first
                # max_prompt_tokens (the route's cost stays bounded) and let the engine judge.
                token_lists[i] = tokens[: cfg.max_prompt_tokens]
                self.metrics.route_truncated.inc()
                continue
            param = "messages" if chat else ("prompt" if batch is None else f"prompt[{i}]")
            raise OpenAIError(400, f"the prompt has {len(tokens)} tokens; this edge accepts at most {cfg.max_prompt_tokens}", param, "context_length_exceeded")

        # The engine keeps tenants' KV apart by salt (no cross-tenant reuse, no timing side
        # channel); the worker's agent keys salted chains in the tenant's namespace.
        salt = TENANT_SALT_PREFIX + tenant if tenant != cfg.default_tenant else None
        if "cache_salt" in body and body["cache_salt"] != salt:
            # Only the salt this door would set itself for the request's tenant passes: another
            # region's door hands a tenant's request over with it already in the body (found in
            # review: every such hand-off was refused 400), and any other value would let a
            # client pick a tenant's salt its key does not grant.
            raise OpenAIError(
                400, f"cache_salt is set by the edge from the tenant in {NAMESPACE_HEADER}; send that header instead", "cache_salt", "cache_salt_not_allowed"
            )
        extra: dict[str, Any] = {}
        if stream and (opts is None or opts.get("include_usage") is not True):
            # The usage chunk is where a stream reports cached_tokens; ask for it, strip it later
            # (a batch's streams always report it: the door sums them into one). Asked for in
            # so many words even when the client's options imply it: SGLang's include_usage
            # defaults to false where vLLM's defaults to true. A body that says so already is
            # forwarded as it came.
            extra["stream_options"] = {**(opts or {}), "include_usage": True}
        if salt is not None:
            extra["cache_salt"] = salt
        if batch is not None:
            raws = [json.dumps({**body, **extra, "prompt": p}).encode() for p in batch]
        elif extra:
            raws = [json.dumps({**body, **extra}).encode()]
        else:
            raws = [raw]
        headers = {"Content-Type": "application/json", "Accept-Encoding": "identity", NAMESPACE_HEADER: tenant}
        for h in cfg.forward_headers:
            if key is not None and h == "authorization":
                continue  # the client's key is the door's credential, not the engine's
            v = request.headers.get(h)
            if v is not None:
                headers[h] = v
        handoff = request.headers.get(HANDOFF_HEADER)
        if handoff is not None and key is not None and ANY_TENANT not in key.tenants:
            # Only another region's door (the any-tenant peer key) hands requests over: from a
            # tenant's key the header picked the worker past the route and kept the request out
            # of the tenant's counts (found in review).
            self.metrics.auth_refusals.labels("handoff").inc()
            raise OpenAIError.of(NotAllowedError(f"header {HANDOFF_HEADER} is for the doors' peer key, not a tenant's", code="handoff_not_allowed"), HANDOFF_HEADER)
        if handoff is not None and self._region_of.get(handoff) != self.edge.region:
            raise OpenAIError(400, f"header {HANDOFF_HEADER} must name a worker of this edge's region {self.edge.region!r}, got {handoff!r}", HANDOFF_HEADER, "invalid_handoff")
        if batch is not None and handoff is not None:
            raise OpenAIError(400, f"a batched request cannot carry {HANDOFF_HEADER} (the door splits batches before any hand-off)", HANDOFF_HEADER, "invalid_handoff")
        ns = self._namespace(model, tenant)
        # Counted once admitted, under at most _TENANT_SERIES tenant names (the rest as
        # "other"): a client of an open door names any tenant it likes, and every name was a
        # new series, kept for the process's life (found in review). A hand-off is counted by
        # the door the client came to, not again here (found in review: every cluster-wide sum
        # of a handed-off request's counters was doubled).
        if handoff is None:
            if tenant in self._tenant_series or len(self._tenant_series) < _TENANT_SERIES:
                self._tenant_series.add(tenant)
                self.metrics.tenant_requests.labels(tenant).inc()
            else:
                self.metrics.tenant_requests.labels(_OTHER_TENANTS).inc()
        if batch is None:
            return [_Prepared(request.path, raws[0], token_lists[0], ns, stream, client_usage, headers, handoff)]
        return [
            _Prepared(request.path, r, t, ns, stream, True, _nth_request(headers, i), None, batch_index=i * n, client_usage_asked=client_usage, prompt_index=i)
            for i, (r, t) in enumerate(zip(raws, token_lists))
        ]

    def _authenticate(self, request: Request) -> ApiKey | None:
        """The request's key (None: the door is open), checked before its body is read, so an
        unauthenticated caller learns nothing about parsing (401, or 429 past the key's rate)."""
        store = self.config.api_keys
        if store is None:
            return None
        key = request[_KEY_SLOT] if _KEY_SLOT in request else store.authenticate(request.headers.get("Authorization"))
        if key is None:
            self.metrics.auth_refusals.labels("key").inc()
            raise OpenAIError.of(UnauthenticatedError("missing or incorrect API key: send Authorization: Bearer <your key>"))
        wait = store.admit(key, time.monotonic())
        if wait > 0:
            self.metrics.auth_refusals.labels("rate").inc()
            raise OpenAIError.of(RateLimitedError(f"rate limit of this API key ({key.rate_per_s:g} requests/s) reached; retry after {wait:.2f} s", retry_after_s=wait))
        return key

    def _namespace(self, model: str, tenant: str) -> Namespace:
        key = (model, tenant)
        ns = self._namespaces.get(key)
        if ns is None:
            ns = Namespace(model, tenant)
            self._namespaces[key] = ns
            self._names[ns.digest] = key
            if len(self._names) > _NAMESPACE_CACHE:
                self._names.pop(next(iter(self._names)))
            # Tenants come from a header: bound the cache so a client cannot grow it forever.
            if len(self._namespaces) > _NAMESPACE_CACHE:
                self._namespaces.popitem(last=False)
        else:
            self._namespaces.move_to_end(key)
        return ns

    # -- routing ---------------------------------------------------------------------------------

    def _route(self, prep: _Prepared, excluded: frozenset[str]) -> _Choice | None:
        e = self.edge
        t0 = time.perf_counter()
        if excluded:
            try:
                d = e.route(prep.tokens, prep.namespace, self._clock(), exclude=excluded)
            except InvalidArgumentError:  # every worker it may route to is excluded
                return None
        else:
            d = e.route(prep.tokens, prep.namespace, self._clock())
        self.metrics.route_seconds.observe(time.perf_counter() - t0)
        self.regions.setdefault(d.worker, d.region)
        t = d.terms
        # For the operators' dashboard: a bounded ring, one small dict a route.
        record: dict[str, Any] = {
            "t": time.time(),
            "tenant": prep.headers.get(NAMESPACE_HEADER, self.config.default_tenant),
            "prompt_tokens": d.prompt_tokens,
            "worker": d.worker,
            "region": d.region,
            "claimed": d.expected_match,
            "tier": int(d.tier),
            "candidates": d.candidates,
            "terms": {"wan": t.wan, "queue": t.queue, "prefill": t.prefill, "reload": t.reload, "lam": t.lam, "belief": t.belief},
            "reused": None,
            "ttft_ms": None,
            "e2e_ms": None,
        }
        self.recent_routes.append(record)
        return _Choice(d.worker, d.region, d.expected_match, d, record)

    def _excluded(self, tried: set[str], *, skip_dead: bool, local_only: bool = False) -> frozenset[str]:
        out = set(tried) | self._unreachable
        if self._peer_down:
            now = self._clock()
            for r, until in self._peer_down.items():
                if until > now:
                    out |= self._via_peer.get(r, frozenset())
        if local_only:  # a handed-off request stays in this region
            out |= {w for w, r in self._region_of.items() if r != self.edge.region}
        if skip_dead:
            out |= self.dead_workers()
        return frozenset(out)

    def _handoff(self, prep: _Prepared) -> _Choice | None:
        """Where a handed-off request goes: the edge's re-placement among the workers of this
        region the door can reach; None (route it as usual, in this region) if there are none
        that are not cooling down."""
        assert prep.handoff is not None
        try:
            d = self.edge.handoff(prep.tokens, prep.namespace, prep.handoff, self._clock(), exclude=self._excluded(set(), skip_dead=True, local_only=True))
        except KVCompassError:
            return None
        self.metrics.handoffs.labels("moved" if d.worker != prep.handoff else "kept").inc()
        return _Choice(d.worker, d.region, d.expected_match, d)

    async def _proxy(self, request: Request, prep: _Prepared) -> StreamResponse:
        tried: set[str] = set()
        last: _WorkerFailed | None = None
        for attempt in range(self.config.max_attempts):
            if request.disconnected:  # its client left: nobody to serve (found in review: retried)
                raise client_closed()
            choice = self._handoff(prep) if attempt == 0 and prep.handoff is not None else None
            if choice is None:
                choice = self._route(prep, self._excluded(tried, skip_dead=True, local_only=prep.handoff is not None))
            if choice is None:
                # Every worker not yet tried is cooling down: a cooldown is a hint, not a verdict.
                choice = self._route(prep, self._excluded(tried, skip_dead=False, local_only=prep.handoff is not None))
            if choice is None:
                break
            if prep.handoff is None:  # a hand-off's placement is counted in handoffs_total
                self.metrics.routes.labels(choice.region or "unknown").inc()
            if attempt:
                self.metrics.retries.inc()
            tried.add(choice.worker)
            try:
                return await self._forward(request, prep, choice)
            except _WorkerFailed as f:
                self.mark_dead(choice.worker, f.reason)
                last = f
        if last is None:
            raise OpenAIError(503, "no worker is available to serve this request", code="no_worker")
        if last.reply is not None:  # the last worker's own refusal, as it gave it
            status, body, ctype = last.reply
            return Response(status=status, body=body, content_type=ctype or "application/json")
        raise OpenAIError(502, f"{len(tried)} worker(s) failed; last: {last.detail}", code="upstream_error")

    # -- forwarding ------------------------------------------------------------------------------

    def _one_way_s(self, region: str | None) -> float:
        if self._wan is None or region is None:
            return 0.0
        return max(0.0, float(self._wan(self.edge.region, region))) / 1e3

    def _reply_headers(self, request: Request, choice: _Choice) -> dict[str, str]:
        h: dict[str, str] = {}
        if self.config.expose_worker:
            h[WORKER_HEADER] = choice.worker
        caller = request.headers.get(REGION_HEADER)
        # Behind API keys only another region's door (the any-tenant peer key) may ask for our
        # queue vector: a piggybacked vector stands in for the next broadcast to that region, so
        # a tenant key naming a region suppressed our broadcasts to it and read our per-worker
        # queues (found in review). An open door (--open, local experiments) trusts everyone.
        store = self.config.api_keys
        if store is not None and caller is not None:
            key = request[_KEY_SLOT] if _KEY_SLOT in request else store.authenticate(request.headers.get("Authorization"))
            if key is None or ANY_TENANT not in key.tenants:
                caller = None
        if caller is not None and caller != self.edge.region and _REGION_RE.fullmatch(caller):
            try:
                h[QUEUE_VECTOR_HEADER] = json.dumps(self.edge.piggyback_vector(caller, self._clock()), separators=(",", ":"))
            except KVCompassError:
                pass  # not a region this edge exchanges queues with
        return h

    async def _forward(self, request: Request, prep: _Prepared, choice: _Choice) -> StreamResponse:
        """Through the chosen worker's region's door when it has one (a hand-off), else straight
        to the worker. A peer door that fails before answering is skipped for
        ``dead_cooldown_s`` and the worker is tried directly when its URL is known: a hand-off
        may improve a placement, never cost availability."""
        peer = None
        region = choice.region or ""
        if prep.handoff is None and region != self.edge.region and self.edge.params.handoff and self._peer_down.get(region, -math.inf) <= self._clock():
            peer = self._peers.get(region)
        if peer is not None:
            try:
                return await self._forward_via(request, prep, choice, peer)
            except _WorkerFailed:
                self._peer_down[region] = self._clock() + self.config.dead_cooldown_s
                self.metrics.peer_failures.inc()
                if choice.worker not in self.urls:
                    raise
        if choice.worker not in self.urls:
            raise _WorkerFailed("connect", f"{choice.worker}: reachable only through the door of {region!r}, which is not answering")
        return await self._forward_via(request, prep, choice, None)

    async def _forward_via(self, request: Request, prep: _Prepared, choice: _Choice, peer: str | None) -> StreamResponse:
        session = self._session
        if session is None:
            raise OpenAIError.of(DrainingError("the door is not running"))
        headers = prep.headers
        if peer is not None:
            url = peer + prep.path
            headers = {**headers, HANDOFF_HEADER: choice.worker, REGION_HEADER: self.edge.region}
            if self.config.peer_key is not None:
                headers["Authorization"] = f"Bearer {self.config.peer_key}"
        else:
            url = self.urls[choice.worker] + prep.path
        delay = self._one_way_s(choice.region)
        if delay:
            await asyncio.sleep(delay)
        watch: _AnswerWatch | None = None
        head_timeout = self.config.head_timeout_s
        if not prep.stream and self.config.answer_timeout_s > head_timeout:
            # A whole answer's head comes after the last token: a long generation outlasts any
            # head deadline, and treating it as the worker's death retried it on two more
            # workers (found in review). Past the head deadline the worker's /health decides.
            head_timeout = self.config.answer_timeout_s
            watch = _AnswerWatch(self, peer or self.urls[choice.worker])
        # The exchange waiting for its head, where hold_unresponsive can abandon it.
        awaiting = self._awaiting.setdefault(choice.worker, set())
        current: list[UpstreamResponse] = []
        # A client that goes away takes its request with it: the exchange is abandoned and its
        # connection closed, so the engine aborts the request as vLLM aborts a disconnected one
        # (found in review: a whole answer whose client timed out kept its GPU generating to the
        # end, and an SDK's retries made that several generations).
        gone = False

        def client_gone() -> None:
            nonlocal gone
            gone = True
            for resp in current:
                resp.abandon(_CLIENT_GONE)

        def on_exchange(resp: UpstreamResponse) -> None:
            if current:
                awaiting.discard(current.pop())
            current.append(resp)
            awaiting.add(resp)
            if watch is not None:
                watch.watching(resp)
            if choice.worker in self._unresponsive:
                resp.abandon(_SILENT)
            if gone:
                resp.abandon(_CLIENT_GONE)

        forget = request.on_disconnect(client_gone)
        try:
            try:
                up = await session.post(url, prep.raw, headers, head_timeout=head_timeout, slot_timeout=self.config.head_timeout_s, on_exchange=on_exchange)
            except UpstreamAbandoned as e:
                if str(e) == _CLIENT_GONE:
                    raise client_closed() from None
                if str(e) == _SILENT:
                    raise _WorkerFailed("unresponsive", f"{choice.worker}: {_SILENT}") from None
                why = watch.failed if watch is not None else "abandoned"
                raise _WorkerFailed("timeout", f"{choice.worker}: no answer after {self.config.head_timeout_s:g} s and {why}") from None
            except UpstreamBusy as e:
                # The door's own connection limit, shared by every worker: not this worker's fault
                # (found in review: each such wait marked a healthy worker dead), and no other
                # worker would be reached sooner.
                raise OpenAIError(503, f"the door's upstream connections are all busy: {e}", code="busy") from None
            except UpstreamConnectError as e:  # a connect timeout too: unreachable, not slow
                raise _WorkerFailed("connect", f"{choice.worker}: {e}") from None
            except TimeoutError as e:
                if watch is not None:
                    # Alive by its /health all along, only slower than answer_timeout_s: a 504 for
                    # this request, not the worker's death, and no other worker repeats it.
                    raise OpenAIError(504, f"{choice.worker} gave no answer within {head_timeout:g} s", code="upstream_timeout") from None
                raise _WorkerFailed("timeout", f"{choice.worker}: no response head: {e!r}") from None
            except UpstreamError as e:
                raise _WorkerFailed("disconnect", f"{choice.worker}: {e!r}") from None
            finally:
                if current:
                    awaiting.discard(current[0])
                if watch is not None:
                    watch.close()
            try:
                if up.status == 503:
                    # The worker says it cannot serve now (draining, overloaded): routed again without
                    # it. Any other status is this request's answer, relayed as the engine gave it:
                    # an engine answers 500 for one request's failure (vLLM's "recoverable"
                    # EngineGenerateError) while it serves the rest, so a 500 is no sign of death
                    # (found in review: one poison request marked a region's workers dead and ran
                    # three times, and its client got the door's 502 instead of the engine's error).
                    try:
                        data = await up.read(limit=_REFUSAL_BYTES)
                    except UpstreamAbandoned as e:
                        if str(e) == _CLIENT_GONE:
                            raise client_closed() from None
                        data = b""
                    except (UpstreamError, TimeoutError):
                        data = b""
                    reply = (503, data, up.headers.get("Content-Type", "")) if data else None
                    raise _WorkerFailed("status_503", f"{choice.worker} answered 503", reply)
                fb = self._header_feedback(up)
                if peer is not None:
                    served = up.headers.get(WORKER_HEADER)
                    if served is not None and served != choice.worker and self._region_of.get(served) == choice.region:
                        # The peer door moved it: that worker served, on no claim of ours.
                        choice = _Choice(served, choice.region, 0, None)
                ctype = up.headers.get("Content-Type", "")
                if prep.stream and up.status == 200 and ctype.startswith("text/event-stream"):
                    return await self._relay_stream(request, prep, choice, up, fb, delay)
                try:
                    data = await up.read(limit=self.config.max_response_bytes)
                except UpstreamTooLarge as e:
                    # Not the worker's health, and not for another worker to repeat: said as it is.
                    raise OpenAIError(502, f"{choice.worker}: {e}; this edge relays at most {self.config.max_response_bytes} bytes of a whole answer", code="upstream_too_large") from None
                except UpstreamAbandoned as e:
                    if str(e) == _CLIENT_GONE:
                        raise client_closed() from None
                    raise _WorkerFailed("disconnect", f"{choice.worker}: body lost: {e!r}") from None
                except (UpstreamError, TimeoutError) as e:
                    raise _WorkerFailed("disconnect", f"{choice.worker}: body lost: {e!r}") from None
            finally:
                # A connection whose body was not read to the end cannot be reused.
                if up.at_eof():
                    up.release()
                else:
                    up.close()
            if delay:
                await asyncio.sleep(delay)
            if 200 <= up.status < 300:
                self._usage_reused(data, fb)
                self._learn(choice, fb, counted=prep.handoff is None)
                self._timed(choice, prep, first=True, last=True)
            headers = self._reply_headers(request, choice)
            headers["Content-Type"] = ctype or "application/json"
            return Response(body=data, status=up.status, headers=headers)
        finally:
            forget()

    async def _relay_stream(
        self, request: Request, prep: _Prepared, choice: _Choice, up: UpstreamResponse, fb: _Feedback, delay: float
    ) -> StreamResponse:
        """:meth:`_relay`, the stream registered where :meth:`hold_unresponsive` finds it from
        the moment its head arrived (found in review: not during the WAN delay and the client's
        head, when a worker found silent left it waiting)."""
        relaying = self._relaying.setdefault(choice.worker, set())
        relaying.add(up)
        try:
            return await self._relay(request, prep, choice, up, fb, delay)
        finally:
            relaying.discard(up)

    async def _relay(self, request: Request, prep: _Prepared, choice: _Choice, up: UpstreamResponse, fb: _Feedback, delay: float) -> StreamResponse:
        if delay:
            await asyncio.sleep(delay)
        headers = self._reply_headers(request, choice)
        headers.update({"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        sink = prep.sink
        if sink is None:
            resp = StreamResponse(status=200, headers=headers)
            await resp.prepare(request)
            write: Callable[[bytes], Awaitable[None]] = resp.write
            end: Callable[[], Awaitable[None]] = resp.write_eof
        else:
            resp = await sink.prepare(headers)
            offset = prep.batch_index or 0
            write = functools.partial(sink.write, offset)
            end = sink.finish
        # An error event ends a stream as vLLM ends one, with [DONE] after it (a batch's merged
        # stream gets its one [DONE] when its last prompt ends).
        done = _DONE if sink is None else b""
        # From here on bytes reached the client: no retry, whatever happens.
        buf = b""
        first = True
        try:
            try:
                async for data in up.iter_chunks():
                    buf += data
                    while True:
                        cut = _event_end(buf)
                        if cut < 0:
                            if len(buf) > MAX_SSE_EVENT_BYTES:
                                # A worker that never ends an event would have the door hold
                                # all it sends: a broken stream, said as one.
                                raise UpstreamDisconnected(f"an event of the stream exceeds {MAX_SSE_EVENT_BYTES} bytes")
                            break
                        event, buf = buf[:cut], buf[cut:]
                        out = self._stream_event(event, prep, fb)
                        if out:
                            await write(out)
                            if first:
                                first = False
                                self._timed(choice, prep, first=True)
            except (UpstreamError, TimeoutError) as e:
                if isinstance(e, UpstreamAbandoned) and str(e) == _CLIENT_GONE:
                    return resp  # nobody left to tell
                if choice.worker not in self._unresponsive:  # held dead already
                    self.mark_dead(choice.worker, "midstream")
                # In a batch's merged stream the client must learn which prompt's choices were
                # cut (found in review: a mid-stream failure named only the worker).
                which = f"prompt[{prep.prompt_index}]: " if prep.prompt_index is not None else ""
                err = error_body(502, f"{which}worker {choice.worker} failed mid-stream: {e!r}", code="upstream_error")
                await write(b"data: " + json.dumps(err).encode() + b"\n\n" + done)
                await end()
                return resp
            if buf.strip():
                out = self._stream_event(buf, prep, fb)
                if out:
                    await write(out)
            self._learn(choice, fb, counted=prep.handoff is None)
            await end()
            self._timed(choice, prep, last=True)
        except ConnectionResetError:
            pass  # the client went away; the upstream response is closed by the caller
        except asyncio.CancelledError:
            # The drain's grace ran out with this stream still open: the client is told so in
            # the stream, which then ends cleanly (found in review: it was cut mid-body, "the
            # response ended prematurely"), and the cancellation goes on.
            if self.draining:
                with contextlib.suppress(ConnectionResetError, OSError, RuntimeError):
                    await write(_drain_event("the stream was cut") + done)
                    await end()
            raise
        return resp

    async def _proxy_batch(self, request: Request, preps: Sequence[_Prepared]) -> StreamResponse:
        """A batched completions request: every prompt routed and forwarded on its own, side by
        side, and their answers merged into one response as OpenAI numbers them (prompt i's
        choice j is choice ``i * n + j``; usage summed, cached tokens included). Streams are
        interleaved event by event; a prompt that fails after others started streaming ends as
        an error event in the stream, one that fails before any did fails the request."""
        if preps[0].stream:
            sink = _BatchStream(request, len(preps), preps[0].client_usage_asked)
            for prep in preps:
                prep.sink = sink
            try:
                got = await asyncio.gather(*(self._proxy(request, prep) for prep in preps), return_exceptions=True)
            except asyncio.CancelledError:
                # The drain's grace ran out: the prompts that were streaming said so and ended
                # (_relay_stream); those still waiting for a worker end here, so the merged
                # stream gets its [DONE] and a whole body (found in review: cut).
                if self.draining and sink.resp is not None:
                    with contextlib.suppress(ConnectionResetError, OSError, RuntimeError):
                        while sink.left > 0:
                            await sink.write(0, _drain_event("the prompt was not answered"))
                            await sink.finish()
                raise
            failed = [(i, g) for i, g in enumerate(got) if isinstance(g, BaseException) or not isinstance(g, StreamResponse) or not g.prepared]
            if sink.resp is None:
                for _, g in failed:
                    if isinstance(g, BaseException):
                        raise g
                    return g
                raise OpenAIError(502, "no prompt of the batch was answered", code="upstream_error")
            for i, g in failed:
                if isinstance(g, OpenAIError):
                    err = error_body(g.status, f"prompt[{i}]: {g.message}", g.param, g.code)
                elif isinstance(g, Response) and isinstance(g.body, bytes):
                    err = _error_of(g.status, g.body, i)
                else:
                    err = error_body(502, f"prompt[{i}]: {g!r}", code="upstream_error")
                await sink.write(preps[i].batch_index or 0, b"data: " + json.dumps(err).encode() + b"\n\n")
                await sink.finish()
            return sink.resp
        got = await asyncio.gather(*(self._proxy(request, prep) for prep in preps), return_exceptions=True)
        bodies: list[dict[str, Any]] = []
        first: Response | None = None
        for g in got:
            if isinstance(g, BaseException):
                raise g
            if not isinstance(g, Response) or not isinstance(g.body, bytes):
                raise OpenAIError(502, "a prompt of the batch got no complete answer", code="upstream_error")
            if not 200 <= g.status < 300:
                return g  # the first prompt that failed, as its worker answered
            try:
                obj = json.loads(g.body)
            except ValueError:
                raise OpenAIError(502, "a worker answered a prompt of the batch with a body that is not JSON", code="upstream_error") from None
            if not isinstance(obj, dict):
                raise OpenAIError(502, "a worker answered a prompt of the batch with a body that is not a JSON object", code="upstream_error")
            bodies.append(obj)
            first = first or g
        assert first is not None
        merged = dict(bodies[0])
        choices: list[Any] = []
        for prep, obj in zip(preps, bodies):
            for c in obj.get("choices") or []:
                if isinstance(c, dict) and isinstance(c.get("index"), int):
                    c = {**c, "index": c["index"] + (prep.batch_index or 0)}
                choices.append(c)
        merged["choices"] = sorted(choices, key=lambda c: c.get("index", 0) if isinstance(c, dict) else 0)
        usage = _sum_usage([obj.get("usage") for obj in bodies])
        if usage is not None:
            merged["usage"] = usage
        headers = {k: v for k, v in first.headers.items() if k.lower() != "content-length"}
        if self.config.expose_worker:
            headers[WORKER_HEADER] = ",".join(g.headers.get(WORKER_HEADER, "") for g in got if isinstance(g, Response))
        return Response(body=json.dumps(merged).encode(), status=200, headers=headers)

    def _timed(self, choice: _Choice, prep: _Prepared, *, first: bool = False, last: bool = False) -> None:
        """Time to first token (histogram, and the route's dashboard row) and to the last byte
        (the row), from when the door started serving the request."""
        ms = (time.perf_counter() - prep.t0) * 1e3
        if first and prep.handoff is None:  # the client's door times a hand-off, from its receipt
            self.metrics.ttft_seconds.labels("true" if prep.stream else "false").observe(ms / 1e3)
        if choice.record is not None:
            if first:
                choice.record["ttft_ms"] = round(ms, 3)
            if last:
                choice.record["e2e_ms"] = round(ms, 3)

    def _stream_event(self, event: bytes, prep: _Prepared, fb: _Feedback) -> bytes | None:
        """One SSE event as the client should see it (None: drop it). Only events that carry a
        non-null usage are parsed; everything else passes through byte for byte."""
        if b'"usage"' not in event or b'"usage":null' in event or b'"usage": null' in event:
            return event
        payload = _sse_data(event)
        if payload is None or payload.strip() == b"[DONE]":
            return event
        try:
            obj = parse_json(payload)
        except ValueError:
            return event
        # The byte test above only screens: the word can sit in a token's text or a logprob, so
        # what the event carries is decided from the parsed object.
        if not isinstance(obj, dict) or obj.get("usage") is None:
            return event
        usage = obj["usage"]
        if isinstance(usage, dict):
            self._usage_into(usage, fb)
        if prep.client_usage:
            return event
        if not obj.get("choices"):
            return None  # the usage-only chunk we asked for on the client's behalf
        del obj["usage"]
        return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"

    def _usage_reused(self, data: bytes, fb: _Feedback) -> None:
        try:
            obj = parse_json(data)
        except ValueError:
            self.metrics.bad_feedback.labels("body").inc()
            return
        usage = obj.get("usage") if isinstance(obj, dict) else None
        if isinstance(usage, dict):
            self._usage_into(usage, fb)

    def _usage_into(self, usage: Mapping[str, Any], fb: _Feedback) -> None:
        reused = _cached_tokens(usage)
        if reused is not None:
            fb.reused = reused
        elif _has_cached_field(usage):
            self.metrics.bad_feedback.labels("usage").inc()
        elif usage.get("prompt_tokens_details") is None:
            fb.bare_usage = True

    # -- learning --------------------------------------------------------------------------------

    def _header_feedback(self, up: UpstreamResponse) -> _Feedback:
        fb = _Feedback()
        q = up.headers.get(QUEUE_MS_HEADER)
        if q is not None:
            try:
                v = float(q)
            except ValueError:
                v = math.nan
            if math.isfinite(v) and 0 <= v <= MAX_QUEUE_MS:
                fb.queue_ms = v
            else:
                # Above MAX_QUEUE_MS the edge refuses the reading (ValueError), which turned a
                # worker's complete answer into a 500, or a cut stream (found in review).
                self.metrics.bad_feedback.labels("queue_ms").inc()
        vec = up.headers.get(QUEUE_VECTOR_HEADER)
        if vec is not None:
            fb.vector = _parse_vector(vec)
            if fb.vector is None:
                self.metrics.bad_feedback.labels("queue_vector").inc()
        return fb

    def _learn(self, choice: _Choice, fb: _Feedback, *, counted: bool = True) -> None:
        """Fold a response into the edge (always) and into the reuse counters (``counted``: not
        for a hand-off, which the client's door counts)."""
        e, m = self.edge, self.metrics
        w = choice.worker
        local = choice.region == e.region
        vector = fb.vector
        if fb.queue_ms is not None:
            if local:
                e.set_local_queue(w, fb.queue_ms, self._clock())
            elif vector is None:
                vector = {w: fb.queue_ms}
        if fb.reused is not None:
            self._reports_cached.add(w)
        elif fb.bare_usage and w in self._reports_cached:
            # vLLM (--enable-prompt-tokens-details) leaves prompt_tokens_details out when no
            # token was cached; without the flag it never sends it. From a worker that has
            # reported cached tokens before, a usage without them is a report of 0 (found in
            # review: every false claim against a real vLLM went unlearned as "unknown").
            fb.reused = 0
        if fb.reused is None:
            if counted:
                m.no_usage.inc()
            claimed, reused = 0, 0  # claimed=0 moves no belief: "unknown" is not "reused nothing"
        else:
            claimed, reused = choice.claimed, fb.reused
            if choice.record is not None:
                choice.record["reused"] = reused
            if counted:
                if claimed > 0:
                    m.claimed.inc(claimed)
                    (m.hits if reused >= claimed else m.false_hits).inc()
                m.reused.inc(reused)
        try:
            e.on_response(w, claimed, reused, vector, self._clock())
        except KVCompassError:
            m.bad_feedback.labels("queue_vector").inc()
            e.on_response(w, claimed, reused, None, self._clock())


class _BatchStream:
    """One client stream fed by the streams of a batch's prompts (see
    :meth:`FrontDoor._proxy_batch`): each event's choice indices shifted by its prompt's offset
    and its id made the first one's, usage-only chunks summed into one sent at the end when
    the client asked for it, one ``[DONE]``."""

    def __init__(self, request: Request, parts: int, client_usage: bool) -> None:
        self._request = request
        self._left = parts
        self._client_usage = client_usage
        self._usage: list[Any] = []
        self._head: dict[str, Any] | None = None
        self._lock = asyncio.Lock()
        self.resp: StreamResponse | None = None

    async def prepare(self, headers: Mapping[str, str]) -> StreamResponse:
        async with self._lock:
            if self.resp is None:
                resp = StreamResponse(status=200, headers={k: v for k, v in headers.items() if k != WORKER_HEADER})
                await resp.prepare(self._request)
                self.resp = resp
            return self.resp

    async def write(self, offset: int, event: bytes) -> None:
        out = self._rewrite(offset, event)
        if out is None:
            return
        async with self._lock:
            if self.resp is None:
                raise RuntimeError("a batch stream written before it was prepared")
            await self.resp.write(out)

    def _rewrite(self, offset: int, event: bytes) -> bytes | None:
        payload = _sse_data(event)
        if payload is None:
            return event
        if payload.strip() == b"[DONE]":
            return None  # one at the end
        try:
            obj = parse_json(payload)
        except ValueError:
            return event
        if not isinstance(obj, dict) or "error" in obj:
            return event
        if self._head is None:
            self._head = {k: obj[k] for k in ("id", "object", "created", "model") if k in obj}
        else:
            for k in ("id", "created"):
                if k in self._head:
                    obj[k] = self._head[k]
        choices = obj.get("choices")
        if isinstance(choices, list):
            for c in choices:
                if isinstance(c, dict) and isinstance(c.get("index"), int):
                    c["index"] += offset
        if "usage" in obj:
            usage = obj.pop("usage")
            if isinstance(usage, dict) and not choices:
                self._usage.append(usage)
                return None  # a prompt's usage chunk: summed into the last one
        if self._client_usage:
            # OpenAI's include_usage: every chunk but the last carries "usage": null, as the
            # door's single-prompt streams do (found in review: batched chunks had none).
            obj["usage"] = None
        return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"

    @property
    def left(self) -> int:
        """Prompts whose stream has not ended."""
        return self._left

    async def finish(self) -> None:
        """One prompt's stream ended; after the last, the summed usage (if asked) and ``[DONE]``."""
        self._left -= 1
        if self._left > 0:
            return
        async with self._lock:
            if self.resp is None:
                return
            usage = _sum_usage(self._usage)
            if self._client_usage and usage is not None:
                chunk = {**(self._head or {}), "choices": [], "usage": usage}
                await self.resp.write(b"data: " + json.dumps(chunk, separators=(",", ":")).encode() + b"\n\n")
            await self.resp.write(b"data: [DONE]\n\n")
            await self.resp.write_eof()


def _sum_usage(usages: Sequence[Any]) -> dict[str, Any] | None:
    """The usage of a batch: each count summed over its prompts, cached tokens included."""
    found = [u for u in usages if isinstance(u, dict)]
    if not found:
        return None
    out: dict[str, Any] = {}
    for name in ("prompt_tokens", "completion_tokens", "total_tokens"):
        vals = [u.get(name) for u in found]
        if all(type(v) is int for v in vals):
            out[name] = sum(vals)
    cached = [_cached_tokens(u) for u in found]
    if all(c is not None for c in cached):
        out["prompt_tokens_details"] = {"cached_tokens": sum(c for c in cached if c is not None)}
    return out


def _error_of(status: int, body: bytes, index: int) -> dict[str, Any]:
    """A worker's error answer to one prompt of a batch, as an error event of the stream."""
    try:
        obj = json.loads(body)
        err = obj.get("error") if isinstance(obj, dict) else None
        message = err.get("message") if isinstance(err, dict) else None
    except ValueError:
        message = None
    return error_body(status, f"prompt[{index}]: {message or body[:200].decode(errors='replace')}", code="upstream_error")


_ENDPOINTS = {
    "/v1/completions": "completions",
    "/v1/chat/completions": "chat.completions",
    "/v1/models": "models",
    "/health": "health",
    "/metrics": "metrics",
}

FRONT_DOOR = "kvcompass_front_door"
"""Where :func:`make_app` keeps its :class:`FrontDoor` (``app.state[FRONT_DOOR]``)."""


# -- helpers -------------------------------------------------------------------------------------------


_DONE = b"data: [DONE]\n\n"


def _drain_event(what: str) -> bytes:
    """The SSE error event a stream still open at the end of a drain's grace ends with."""
    err = error_body(503, f"the door is shutting down; {what} at the end of its drain", code="draining")
    return b"data: " + json.dumps(err).encode() + b"\n\n"


def _cached_tokens(usage: Mapping[str, Any]) -> int | None:
    d = usage.get("prompt_tokens_details")
    if not isinstance(d, dict):
        return None
    c = d.get("cached_tokens")
    if type(c) is not int or c < 0:
        return None
    return c


def _has_cached_field(usage: Mapping[str, Any]) -> bool:
    d = usage.get("prompt_tokens_details")
    return isinstance(d, dict) and d.get("cached_tokens") is not None


def _parse_vector(text: str) -> dict[str, float] | None:
    try:
        obj = json.loads(text)
    except ValueError:
        return None
    if not isinstance(obj, dict):
        return None
    out: dict[str, float] = {}
    for k, v in obj.items():
        if type(v) not in (int, float) or not math.isfinite(v) or v < 0:
            return None
        out[str(k)] = float(v)
    return out


MAX_SSE_EVENT_BYTES = 4 * 1024 * 1024
"""The largest server-sent event the door relays (a completion chunk is a few KB, with
log-probabilities tens)."""


def _event_end(buf: bytes) -> int:
    """Index just past the first complete SSE event in ``buf`` (-1: none yet)."""
    a = buf.find(b"\n\n")
    b = buf.find(b"\r\n\r\n")
    if a < 0 and b < 0:
        return -1
    if b < 0 or (0 <= a < b):
        return a + 2
    return b + 4


def _sse_data(event: bytes) -> bytes | None:
    lines = [ln.rstrip(b"\r") for ln in event.split(b"\n")]
    data = [ln[5:].lstrip(b" ") if ln.startswith(b"data:") else None for ln in lines]
    parts = [d for d in data if d is not None]
    return b"\n".join(parts) if parts else None


# -- entry points ----------------------------------------------------------------------------------------


def _resolve_tokenizer(tokenizer: TokenizerLike | str | os.PathLike[str] | None) -> TokenizerLike:
    if tokenizer is None or isinstance(tokenizer, (str, os.PathLike)):
        # Imported here so a door given a tokenizer object never pays for HF tokenizers.
        from kvcompass.engine.tokenizer import load_tokenizer

        return load_tokenizer(tokenizer)
    return tokenizer


def make_app(
    edge: Edge,
    workers: Mapping[str, str],
    tokenizer: TokenizerLike | str | os.PathLike[str] | None,
    *,
    config: DoorConfig = DoorConfig(),
    regions: Mapping[str, str] | None = None,
    wan_one_way_ms: Callable[[str, str], float] | None = None,
    clock: Callable[[], float] = time.monotonic,
    registry: CollectorRegistry | None = None,
    upstream_ssl: ssl.SSLContext | None = None,
    peers: Mapping[str, str] | None = None,
) -> App:
    """The door as an application of :mod:`kvcompass.services.http_server`.

    ``workers``: worker id -> base URL (``http://host:port``; the door appends the request's
    path). Edge workers missing from it are never forwarded to. ``tokenizer``: an object, or a
    ``tokenizer.json`` path / None for :func:`kvcompass.engine.tokenizer.load_tokenizer`.
    ``regions``: worker id -> region, used when the door must pick a worker itself (otherwise
    learned from the edge's decisions). ``wan_one_way_ms(edge_region, worker_region)``: the
    one-way delay to emulate, applied before forwarding and before relaying the response.
    ``clock``: seconds, non-decreasing, the same clock as every other driver of ``edge``.
    ``upstream_ssl``: the client context for ``https://`` worker URLs (None: system trust).
    ``peers``: region -> that region's door base URL, for hand-offs (module notes; also
    :meth:`FrontDoor.set_peers` once they are known).
    """
    door = FrontDoor(
        edge, workers, _resolve_tokenizer(tokenizer), config, regions=regions, wan_one_way_ms=wan_one_way_ms, clock=clock, registry=registry,
        upstream_ssl=upstream_ssl, peers=peers,
    )
    app = App(max_body_bytes=config.max_body_bytes, observe=door._observe, cors_origins=config.cors_origins)
    app.state[FRONT_DOOR] = door
    app.on_startup.append(door.start)
    app.on_cleanup.append(door.stop)
    add_routes(app, completions=door.completions, chat=door.chat_completions, models=door.models, model=door.model, health=door.health, metrics=door.metrics_endpoint)
    return app


class DoorServer(AsyncResource):
    """A running door: its listening socket, and :meth:`stop` to drain and close it."""

    def __init__(self, app: App, server: HttpServer, sock: socket.socket, *, tls: bool = False) -> None:
        self.app = app
        self.tls = tls
        self._server = server
        self._sock = sock
        host, port = sock.getsockname()[:2]
        self.host: str = host
        self.port: int = port
        self._stopped = False

    @property
    def door(self) -> FrontDoor:
        door: FrontDoor = self.app.state[FRONT_DOOR]
        return door

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{'https' if self.tls else 'http'}://{host}:{self.port}"

    async def stop(self, grace_s: float | None = None) -> None:
        """Drain: health 503 and new completions refused, in-flight ones finish (up to
        ``grace_s``, default the config's), then the listener and upstream pool close."""
        if self._stopped:
            return
        self._stopped = True
        door = self.door
        door.draining = True
        grace = door.config.drain_grace_s if grace_s is None else grace_s
        t0 = time.monotonic()
        await door.wait_idle(grace)
        try:
            # Handlers end before their last bytes have left: what remains of the grace lets
            # those reach slow readers (at least 1 s more for whatever still runs).
            await self._server.close(timeout_s=max(1.0, grace - (time.monotonic() - t0)))
        finally:
            self._sock.close()

    async def close(self) -> None:
        await self.stop()


async def serve_door(
    edge: Edge,
    workers: Mapping[str, str],
    tokenizer: TokenizerLike | str | os.PathLike[str] | None,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    sock: socket.socket | None = None,
    config: DoorConfig = DoorConfig(),
    regions: Mapping[str, str] | None = None,
    wan_one_way_ms: Callable[[str, str], float] | None = None,
    clock: Callable[[], float] = time.monotonic,
    registry: CollectorRegistry | None = None,
    ssl_context: ssl.SSLContext | None = None,
    upstream_ssl: ssl.SSLContext | None = None,
    peers: Mapping[str, str] | None = None,
    reuse_port: bool = False,
) -> DoorServer:
    """Start the door on ``sock`` (a bound socket) or ``host:port`` (0: any free port; read
    :attr:`DoorServer.port`) and return once it accepts connections. ``reuse_port`` lets other
    processes serve the same port (each an edge with its own views; the kernel spreads the
    connections among them). ``ssl_context`` (a
    :meth:`TLSConfig.server_context <kvcompass.services.tls.TLSConfig.server_context>` for
    ``"http"``) serves HTTPS; ``upstream_ssl`` is passed to :func:`make_app`."""
    app = make_app(
        edge, workers, tokenizer, config=config, regions=regions, wan_one_way_ms=wan_one_way_ms, clock=clock, registry=registry, upstream_ssl=upstream_ssl,
        peers=peers,
    )
    if sock is None:
        sock = bind_socket(host, port, reuse_port=reuse_port)
    server = HttpServer(app, sock, guard=app.state[FRONT_DOOR].conn_guard, ssl_context=ssl_context, write_timeout_s=config.client_write_timeout_s)
    try:
        await server.start()
    except BaseException:
        sock.close()
        raise
    return DoorServer(app, server, sock, tls=ssl_context is not None)
