"""Names both ends of a KVCompass connection must agree on: metadata and HTTP headers, paths,
and the tenant salt. Each side imports them from here, so a rename cannot leave one side
speaking an old name."""

from __future__ import annotations

from kvcompass.agent.agent import TENANT_SALT_PREFIX

__all__ = [
    "CACHED_HEADER",
    "EXCHANGE_PATH",
    "HANDOFF_HEADER",
    "HEALTH_PATH",
    "INGEST_PATH",
    "LOAD_PATH",
    "MIGRATION_HEADER",
    "NAMESPACE_HEADER",
    "OUTCOME_PATH",
    "PEER_TOKEN_HEADER",
    "QUEUE_MS_HEADER",
    "QUEUE_VECTOR_HEADER",
    "REGION_HEADER",
    "ROUTE_PATH",
    "SUBSCRIBE_PATH",
    "TENANT_SALT_PREFIX",
    "TOKEN_HEADER",
    "WORKER_HEADER",
]

# gRPC metadata
WORKER_HEADER = "x-kvcompass-worker"
"""The worker an agent's ingest stream speaks for (and, on HTTP, the worker that served a
response)."""
TOKEN_HEADER = "x-kvcompass-token"
"""The worker's ingest token, checked by the maintenance unit when it has a token map."""
PEER_TOKEN_HEADER = "x-kvcompass-edge-token"
"""The deployment's shared edge secret: edges' queue exchange and doors' hand-offs."""
INGEST_PATH = "/kvcompass.v1.Maintenance/Ingest"
"""The ingest RPC, served by a hand-written handler (acks per batch, in order)."""
SUBSCRIBE_PATH = "/kvcompass.v1.Maintenance/Subscribe"
"""The patch stream an edge follows (hand-written on both ends: flow control, catch-up)."""
EXCHANGE_PATH = "/kvcompass.v1.Edge/ExchangeQueues"
"""Queue vectors between edges (the deployment's shared edge secret in ``PEER_TOKEN_HEADER``)."""
ROUTE_PATH = "/kvcompass.v1.Edge/Route"
"""A gateway's route (or, with ``lookup_only``, question) to an edge."""
OUTCOME_PATH = "/kvcompass.v1.Edge/ReportOutcome"
"""What a route's worker reported, back to the edge that decided it."""

# HTTP, worker -> door
QUEUE_MS_HEADER = "x-kvcompass-queue-ms"
"""The worker's queue (ms of work ahead) when the response started."""
CACHED_HEADER = "x-kvcompass-cached-tokens"
"""Prompt tokens the worker reused from its cache."""
QUEUE_VECTOR_HEADER = "x-kvcompass-queue-vector"
"""A region's per-worker queue vector piggybacked on a response from a remote door."""
LOAD_PATH = "/kvcompass/load"
"""A worker's live queue reading, polled by its own region's edge."""
HEALTH_PATH = "/health"
"""An OpenAI server's liveness (vLLM's, SGLang's, the emulated worker's and the door's own):
polled for silence where a worker has no load endpoint, probed while a whole answer is awaited."""

# HTTP, door -> door
REGION_HEADER = "x-kvcompass-region"
"""The region whose door first routed a request (a hand-off's origin)."""
NAMESPACE_HEADER = "x-kvcompass-namespace"
"""The tenant namespace a handed-off request belongs to."""
HANDOFF_HEADER = "x-kvcompass-handoff"
"""Marks a request one door forwards to another region's door for re-placement."""

MIGRATION_HEADER = "x-kvcompass-migration"
"""On a request a door sends to a worker to place a replica of a hot prefix there (the edge's
migration action): ``copy`` or ``recompute``, the kind the edge asked for; not a client's."""
