"""Routing schemes the simulator compares: who picks the worker for a request, and from what.

A scheme is built once per run against a :class:`Fleet` (the simulator's read-only face) and
answers :meth:`Scheme.choose` for every arrival. It returns a :class:`Choice`: the worker and the
prefix it expected that worker to reuse (``claimed``; 0 for cache-blind schemes), which the
metrics compare with what the worker then reused (a claim above the reuse is a false hit).

What each scheme models:

* ``kvcompass``: the discovery plane as deployed. The request's region edge (the same
  :class:`~kvcompass.discovery.edge.Edge` the services run) routes it with the joint score over
  its index replica, its cache beliefs and its queue estimates (own region live, remote regions
  from piggybacked vectors and broadcasts), so it sees only what an edge would: patches as far
  as they have propagated, queue vectors as old as the WAN makes them.
* ``local-least-loaded``: a region-local load balancer, cache-blind: the own-region worker
  with the least queued prefill work (exact, as a co-located balancer reads it); ties broken
  by a seeded draw. The usual single-region deployment, never crossing the WAN.
* ``oracle``: the globally least-loaded worker by exact queued prefill work, WAN and cache
  ignored. Not a realistic router but the lower bound on load imbalance (peak load factor)
  that any scheme can reach.

The other baselines of the design (consistent hashing, Chord, central directory, SkyWalker,
Dynamo-style routers, KVCompass ablations) are not here yet.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import numpy.typing as npt

from kvcompass.discovery.edge import Edge
from kvcompass.discovery.topology import Topology
from kvcompass.errors import InvalidArgumentError
from kvcompass.index import Namespace
from kvcompass.sim.workload import Request

__all__ = ["SCHEMES", "Choice", "Fleet", "KVCompassScheme", "LocalLeastLoaded", "Oracle", "Scheme", "make_scheme"]


@dataclass(frozen=True, slots=True)
class Choice:
    """A routing decision: ``worker`` serves the request; the scheme expected it to reuse
    ``claimed`` prompt tokens (0 when the scheme does not look at caches)."""

    worker: str
    claimed: int = 0


class Fleet(Protocol):
    """What a scheme may read of the simulated deployment."""

    @property
    def topology(self) -> Topology: ...

    def edge_for(self, region: str) -> Edge:
        """The edge that receives requests from ``region``."""
        ...

    def namespace(self, request: Request) -> Namespace: ...

    def queued_ms(self, worker: str, now_ms: float) -> float:
        """The worker's exact queued prefill work (ms) at ``now_ms``, the running prefill's
        remainder included."""
        ...

    def rng(self) -> np.random.Generator:
        """The run's seeded generator for tie-breaking."""
        ...


class Scheme(Protocol):
    name: str
    uses_index: bool
    """Whether the scheme reads the discovery plane (the simulator skips feeding it otherwise)."""

    def choose(self, request: Request, tokens: npt.NDArray[np.uint32], now_ms: float) -> Choice: ...


def _least_loaded(fleet: Fleet, workers: list[str], now_ms: float) -> str:
    q = np.array([fleet.queued_ms(w, now_ms) for w in workers])
    cand = np.flatnonzero(q <= q.min() + 1e-9)
    return workers[int(cand[int(fleet.rng().integers(len(cand)))])] if len(cand) > 1 else workers[int(cand[0])]


class KVCompassScheme:
    """Route with the request's region edge (see the module notes)."""

    name = "kvcompass"
    uses_index = True

    def __init__(self, fleet: Fleet) -> None:
        self._fleet = fleet

    def choose(self, request: Request, tokens: npt.NDArray[np.uint32], now_ms: float) -> Choice:
        d = self._fleet.edge_for(request.region).route(tokens, self._fleet.namespace(request), now_ms / 1e3)
        return Choice(d.worker, d.expected_match)


class LocalLeastLoaded:
    """The own-region worker with the least queued prefill work (cache-blind)."""

    name = "local-least-loaded"
    uses_index = False

    def __init__(self, fleet: Fleet) -> None:
        self._fleet = fleet
        self._by_region = {r: [w.id for w in fleet.topology.workers_in(r)] for r in fleet.topology.region_names}

    def choose(self, request: Request, tokens: npt.NDArray[np.uint32], now_ms: float) -> Choice:
        workers = self._by_region.get(request.region) or []
        if not workers:
            raise InvalidArgumentError(f"region {request.region!r} has no workers: local-least-loaded cannot serve request {request.id}")
        return Choice(_least_loaded(self._fleet, workers, now_ms))


class Oracle:
    """The globally least-loaded worker, WAN and caches ignored."""

    name = "oracle"
    uses_index = False

    def __init__(self, fleet: Fleet) -> None:
        self._fleet = fleet
        self._workers = [w.id for w in fleet.topology.workers]

    def choose(self, request: Request, tokens: npt.NDArray[np.uint32], now_ms: float) -> Choice:
        return Choice(_least_loaded(self._fleet, self._workers, now_ms))


SCHEMES: dict[str, Callable[[Fleet], Scheme]] = {
    KVCompassScheme.name: KVCompassScheme,
    LocalLeastLoaded.name: LocalLeastLoaded,
    Oracle.name: Oracle,
}


def make_scheme(name: str, fleet: Fleet) -> Scheme:
    try:
        return SCHEMES[name](fleet)
    except KeyError:
        raise InvalidArgumentError(f"unknown scheme {name!r} (known: {', '.join(SCHEMES)})") from None
