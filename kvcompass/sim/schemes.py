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
  as they have propagated, queue vectors as old as the WAN makes them. A request forwarded to
  another region is handed to that region's edge on arrival (:meth:`KVCompassScheme.handoff`).
* ``local-least-loaded``: a region-local load balancer, cache-blind: the own-region worker
  with the least queued prefill work (exact, as a co-located balancer reads it); ties broken
  by a seeded draw. The usual single-region deployment, never crossing the WAN.
* ``oracle``: the globally least-loaded worker by exact queued prefill work, WAN and cache
  ignored. Not a realistic router but the lower bound on load imbalance (peak load factor)
  that any scheme can reach.

* ``kvcompass-no-load``, ``-no-xregion``, ``-tier-blind``, ``-no-migration``, ``-no-handoff``,
  ``-no-belief``, ``-no-closure``, ``-no-fingerprint``: KVCompass with one :class:`EdgeParams`
  switch off (paper section 5.4; the hand-off is ours); the simulator builds its plane with that
  switch (:func:`scheme_params`).
* ``consistent-hash``, ``chord``, ``planetserve``, ``central-directory``, ``skywalker``: the
  paper's baselines (section 5.1); each class's docstring says what it models and simplifies.

* ``dynamo``, ``dynamo-global``: Dynamo-style KV routers, per region with a periodic global
  view, and behind a global region picker. They follow the workers' KV events themselves
  (the simulator hands every admit's events to a scheme's ``on_kv_events``).

Besides the edge, a baseline may read what its design gives it exactly: a worker's cached
prefix (:meth:`Fleet.cached`, for schemes that hold exact KV state) and its count of waiting
requests (:meth:`Fleet.waiting`, the "pending queue").
"""

from __future__ import annotations

import bisect
import dataclasses
import hashlib
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import ClassVar, Protocol

import numpy as np
import numpy.typing as npt

from kvcompass import _core
from kvcompass.discovery.edge import Edge
from kvcompass.discovery.layout import WorkerSpec
from kvcompass.discovery.params import EdgeParams
from kvcompass.discovery.plan import own_region_levels
from kvcompass.discovery.topology import Topology
from kvcompass.errors import InvalidArgumentError
from kvcompass.index_types import Namespace
from kvcompass.records import fast_init
from kvcompass.sim.requests import Request, RequestTable

__all__ = [
    "SCHEMES",
    "CentralDirectory",
    "Choice",
    "ChordDHT",
    "Dynamo",
    "DynamoGlobal",
    "ConsistentHash",
    "Fleet",
    "KVCompassAblation",
    "KVCompassScheme",
    "LocalLeastLoaded",
    "Oracle",
    "NoHandoff",
    "PlanetServe",
    "Scheme",
    "EnginePolicy",
    "SkyWalker",
    "make_scheme",
    "salt_key",
    "scheme_params",
]


@fast_init
@dataclass(frozen=True, slots=True)
class Choice:
    """A routing decision: ``worker`` serves the request; the scheme expected it to reuse
    ``claimed`` prompt tokens (0 when the scheme does not look at caches); its lookup took
    ``delay_ms`` beyond the edge (a coordinator round trip, DHT hops), which passes before the
    request is forwarded."""

    worker: str
    claimed: int = 0
    delay_ms: float = 0.0


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

    def dispatched_ms(self, worker: str, origin: str | None = None) -> float:
        """Estimated prefill work (ms) of requests routed to the worker and still on their way
        to it (not in :meth:`queued_ms` yet); only those routed for requests from region
        ``origin`` (what that region's router itself sent), or all of them with None. A router
        that tracks what it dispatched (Dynamo's active sequences, a balancer's pending count)
        reads its own share; an omniscient one (Oracle, Central Directory) reads all."""
        ...

    def rng(self) -> np.random.Generator:
        """The run's seeded generator for tie-breaking."""
        ...

    def cached(self, worker: str, tokens: npt.NDArray[np.uint32], salt: str | None = None) -> tuple[int, int]:
        """``(vram_hit, dram_hit)`` tokens of the worker's exact cache for ``tokens`` under cache
        salt ``salt`` (changes nothing)."""
        ...

    def salt(self, request: Request) -> str | None:
        """The request's cache salt (its tenant's namespace) in a run of several tenants; None
        in a one-namespace run. Content-keyed schemes fold it into their keys, as a multi-tenant
        deployment of them must (a tenant's prompt may not hit another tenant's cache)."""
        ...

    def waiting(self, worker: str) -> int:
        """How many requests wait at the worker for prefill (the running one excluded)."""
        ...

    def pending(self, worker: str) -> int:
        """How many requests routed to the worker have not finished their prefill (on their way,
        waiting or prefilling): a router's count of its own outstanding requests."""
        ...

    def worker_index(self, worker: str) -> int:
        """The worker's index in the engine (topology order)."""
        ...

    def region_index(self, region: str) -> int:
        """The region's index in the engine (topology order)."""
        ...

    def chord_lookup(self, origin: str, key: int) -> tuple[str, int, float]:
        """The engine's Chord lookup of ``key`` from ``origin``: ``(owner worker, hops, delay_ms)``
        (in a run of the chord scheme)."""
        ...


class Scheme(Protocol):
    """A scheme routes with :meth:`choose` (called by the engine for every arrival) or, for a
    baseline implemented in the simulator's Rust engine, names that implementation with
    ``engine_policy(requests) -> EnginePolicy`` instead (no call per request)."""

    name: str
    uses_index: bool
    """Whether the scheme reads the discovery plane (the simulator skips feeding it otherwise)."""


@dataclass(frozen=True, slots=True)
class EnginePolicy:
    """A baseline run inside the engine (``rust/sim/policy.rs``): the engine method that installs
    it (``_core.SimEngine.set_<method>``) and its arguments, workers and regions as the fleet's
    indices (:meth:`Fleet.worker_index`, :meth:`Fleet.region_index`)."""

    method: str
    args: tuple[object, ...]


def _served(requests: RequestTable, by_region: Mapping[str, Sequence[str]], scheme: str) -> None:
    """InvalidArgumentError naming the first request from a region without workers (a scheme
    that keeps requests in their region cannot serve it)."""
    for region, first in requests.first_of_region().items():
        if not by_region.get(region):
            raise InvalidArgumentError(f"region {region!r} has no workers: {scheme} cannot serve request {first}")


def _servers_in(t: Topology, region: str) -> list[WorkerSpec]:
    """The workers of ``region`` a request may be routed to: under prefill-decode
    disaggregation only prefill workers (the decode instance is the simulator's to draw)."""
    return [w for w in t.workers_in(region) if w.role != "decode"]


class KVCompassScheme:
    """Route with the request's region edge (see the module notes)."""

    name = "kvcompass"
    uses_index = True

    def __init__(self, fleet: Fleet) -> None:
        self._fleet = fleet

    def choose(self, request: Request, tokens: npt.NDArray[np.uint32], now_ms: float) -> Choice:
        d = self._fleet.edge_for(request.region).route(tokens, self._fleet.namespace(request), now_ms / 1e3)
        return Choice(d.worker, d.expected_match)

    def handoff(self, request: Request, tokens: npt.NDArray[np.uint32], worker: str, region: str, now_ms: float) -> Choice | None:
        """The request has reached ``worker`` in ``region``, another edge's region: that edge
        re-places it (:meth:`Edge.handoff`). None when ``region`` runs no edge of its own or
        hand-off is switched off (the request stays where it was sent)."""
        edge = self._fleet.edge_for(region)
        if edge.region != region or not edge.params.handoff:
            return None
        d = edge.handoff(tokens, self._fleet.namespace(request), worker, now_ms / 1e3)
        return Choice(d.worker, d.expected_match)


class LocalLeastLoaded:
    """The own-region worker with the least queued prefill work plus the work this region's
    balancer dispatched that has not arrived (cache-blind), ties drawn from the run's generator.
    Runs in the engine (``least-loaded`` with a pool per region)."""

    name = "local-least-loaded"
    uses_index = False

    def __init__(self, fleet: Fleet) -> None:
        self._fleet = fleet
        self._by_region = {r: tuple(w.id for w in _servers_in(fleet.topology, r)) for r in fleet.topology.region_names}

    def engine_policy(self, requests: RequestTable) -> EnginePolicy:
        _served(requests, self._by_region, self.name)
        f = self._fleet
        return EnginePolicy("least_loaded", ([[f.worker_index(w) for w in self._by_region[r]] for r in f.topology.region_names], True))


class Oracle:
    """The globally least-loaded worker by queued plus all dispatched prefill work, WAN and caches
    ignored, ties drawn. Runs in the engine (``least-loaded`` with one pool)."""

    name = "oracle"
    uses_index = False

    def __init__(self, fleet: Fleet) -> None:
        self._fleet = fleet

    def engine_policy(self, requests: RequestTable) -> EnginePolicy:
        return EnginePolicy("least_loaded", ([[self._fleet.worker_index(w.id) for w in self._fleet.topology.indexed_workers]], False))


class RandomDispatch:
    """A uniform draw among every prefill worker, blind to load, caches and the WAN (the
    paper's M/G/1 check of figure 9, and the stock prefill-decode stack's dispatch in figure
    18). Runs in the engine."""

    name = "random"
    uses_index = False
    round_robin = False

    def __init__(self, fleet: Fleet) -> None:
        self._fleet = fleet

    def engine_policy(self, requests: RequestTable) -> EnginePolicy:
        return EnginePolicy("oblivious", ([self._fleet.worker_index(w.id) for w in self._fleet.topology.indexed_workers], self.round_robin))


class RoundRobin(RandomDispatch):
    """Every prefill worker in turn, in topology order, blind to load, caches and the WAN
    (a baseline of the paper's figure 18). Runs in the engine."""

    name = "round-robin"
    round_robin = True


class SGLangCacheAware:
    """SGLang's router with its ``cache_aware`` policy (the baseline of the paper's figure 18),
    as its source documents it: one router over every prefill worker that keeps an approximate
    radix tree per worker of the prompts it sent there, and

    * when the load is imbalanced, both ``max - min > balance_abs_threshold`` (32) and
      ``max > balance_rel_threshold * min`` (1.0001), the least-loaded worker;
    * else the worker whose tree matches the longest prefix of the prompt when that match
      exceeds ``cache_threshold`` (0.5) of the prompt, else the worker with the smallest tree
      (the most free cache, as the router reckons it);
    * the prompt is then inserted into the chosen worker's tree; every ``eviction_interval_s``
      (60 s) each tree is cut back to ``max_tree_size`` by dropping least recently used leaves.

    Simplifications, stated: the trees hold the prompts' KV blocks (chained hashes of
    ``block_size`` tokens, so a match is whole blocks) where SGLang's hold characters or
    tokens, so ``max_tree_size`` (2**24 characters in SGLang) is taken as 2**24 / 4 tokens; the
    load is the requests routed to a worker until their prefill ends (:meth:`Fleet.pending`;
    SGLang counts them until they complete, which under prefill-decode disaggregation, the
    paper's figure 18, is the prefill); the router decides at the request's edge with no lookup
    delay, as random and round-robin dispatch do here."""

    name = "sglang-cache-aware"
    uses_index = False
    cache_threshold = 0.5
    balance_abs_threshold = 32
    balance_rel_threshold = 1.0001
    eviction_interval_s = 60.0
    max_tree_tokens = 2**24 // 4

    def __init__(self, fleet: Fleet) -> None:
        self._fleet = fleet

    def engine_policy(self, requests: RequestTable) -> EnginePolicy:
        f = self._fleet
        t = f.topology
        return EnginePolicy(
            "sglang",
            (
                [f.worker_index(w.id) for w in t.indexed_workers],
                max(1, self.max_tree_tokens // t.block_size),
                self.eviction_interval_s * 1e3,
                self.cache_threshold,
                self.balance_abs_threshold,
                self.balance_rel_threshold,
            ),
        )


class KVCompassAblation(KVCompassScheme):
    """KVCompass with the :class:`EdgeParams` switches in ``ablation`` flipped (paper 5.4). The
    switches are applied to the whole plane the simulator builds (:func:`scheme_params`), so a
    no-fingerprint run also builds its views without fingerprints."""

    ablation: ClassVar[dict[str, bool]] = {}

    def __init__(self, fleet: Fleet) -> None:
        super().__init__(fleet)
        self._checked = False

    def choose(self, request: Request, tokens: npt.NDArray[np.uint32], now_ms: float) -> Choice:
        if not self._checked:  # the fleet's edges exist only once it is built: check at first use
            p = self._fleet.edge_for(request.region).params
            wrong = [k for k, v in self.ablation.items() if getattr(p, k) != v]
            if wrong:
                raise InvalidArgumentError(f"scheme {self.name!r} needs its plane built with {', '.join(f'{k}={self.ablation[k]}' for k in wrong)} (see scheme_params)")
            self._checked = True
        return super().choose(request, tokens, now_ms)


class NoLoad(KVCompassAblation):
    """Queue estimates read as 0 and lambda = 0 ("No-load-aware")."""

    name = "kvcompass-no-load"
    ablation = {"load_aware": False}


class NoCrossRegion(KVCompassAblation):
    """Only own-region workers are looked up and may win ("No-cross-region")."""

    name = "kvcompass-no-xregion"
    ablation = {"cross_region": False}


class TierBlind(KVCompassAblation):
    """gamma = 0: DRAM holders look as cheap as VRAM holders ("Tier-blind")."""

    name = "kvcompass-tier-blind"
    ablation = {"tier_aware": False}


class NoMigration(KVCompassAblation):
    """No migration actions ("No-KVmigration"): hot prefixes stay where requests put them."""

    name = "kvcompass-no-migration"
    ablation = {"migration": False}


class NoHandoff(KVCompassAblation):
    """Forwarded requests stay where the origin edge sent them (the paper's forwarding; our
    hand-off, :meth:`Edge.handoff`, is off)."""

    name = "kvcompass-no-handoff"
    ablation = {"handoff": False}


class NoBelief(KVCompassAblation):
    """Every belief reads 1: claims are taken at face value."""

    name = "kvcompass-no-belief"
    ablation = {"belief": False}


class NoClosure(KVCompassAblation):
    """The route loop skips the prefix-closure check."""

    name = "kvcompass-no-closure"
    ablation = {"closure": False}


class NoFingerprint(KVCompassAblation):
    """Views carry no fingerprints (the plane's layout has ``fp_bits = 0``)."""

    name = "kvcompass-no-fingerprint"
    ablation = {"fingerprints": False}


# ---- helpers shared by the baselines ---------------------------------------------------------------

HISTORY_CAPACITY = 1 << 20
"""Prefixes a region balancer's routing history holds (PlanetServe, SkyWalker), least recently
routed evicted first: a hash radix tree of what it routed where (SGLang-router style), every
whole-block prefix of a routed prompt mapped to the workers it was sent to."""

_M64 = (1 << 64) - 1
_GOLD = np.uint64(0x9E3779B97F4A7C15)


def _mix(x: npt.NDArray[np.uint64]) -> npt.NDArray[np.uint64]:
    """splitmix64's finaliser, elementwise (uint64 arithmetic wraps)."""
    x = x ^ (x >> np.uint64(30))
    x = x * np.uint64(0xBF58476D1CE4E5B9)
    x = x ^ (x >> np.uint64(27))
    x = x * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def salt_key(salt: str) -> int:
    """The key content-keyed baselines mix a tenant's salt into (BLAKE2b-64 of its repr, as
    ``_h64("salt", salt)``): what the engine's baselines are given per salt."""
    return _h64("salt", salt)


def _h64(*parts: object) -> int:
    return int.from_bytes(hashlib.blake2b(repr(parts).encode(), digest_size=8).digest(), "little")


def _levels(fleet: Fleet) -> tuple[int, ...]:
    """The six own-region chunk-size levels of the topology (paper 3.2: ``min * 2**i``)."""
    t = fleet.topology
    return own_region_levels(t.own_region_min, levels=t.levels, block_size=t.block_size, max_prefix=t.max_prefix)


class _Ring:
    """A consistent-hash ring of ``workers`` with ``vnodes`` virtual nodes each (Karger et al.): a
    key belongs to the first position at or after it, wrapping around (the engine's lookup)."""

    def __init__(self, workers: list[str], salt: object, vnodes: int = 64) -> None:
        pts = sorted((_h64("ring", salt, w, v), w) for w in workers for v in range(vnodes))
        self.positions = np.array([p for p, _ in pts], dtype=np.uint64)
        self.owners = [w for _, w in pts]


class ConsistentHash:
    """Hash placement over six content-hash rings, one per chunk-size level (paper 5.1 (1)).

    Models: the prompt's longest fitting level (the own-region ladder ``min * 2**i``) names its
    ring and its key, the prefix hash at that length; the request goes to the key's owner on
    that ring (64 virtual nodes per worker), so identical prefixes always meet on one worker
    and placement ignores load and the WAN. The lookup is local (the rings are static).
    Simplifies: the ring membership is static (no joins or failures); claims nothing (the
    scheme does not see caches)."""

    name = "consistent-hash"
    uses_index = False

    def __init__(self, fleet: Fleet) -> None:
        self._fleet = fleet
        self._levels = _levels(fleet)
        workers = [w.id for w in fleet.topology.indexed_workers]
        self._rings = [_Ring(workers, ("level", i)) for i in range(max(1, len(self._levels)))]

    def engine_policy(self, requests: RequestTable) -> EnginePolicy:
        f = self._fleet
        rings = [(r.positions, [f.worker_index(w) for w in r.owners]) for r in self._rings]
        return EnginePolicy("consistent_hash", (list(self._levels), rings))


class ChordDHT:
    """Chord (Stoica et al. 2001) over all workers, one DHT key per chunk-size level (paper 5.1 (2)).

    Models: every worker runs ``ceil(log2 N)`` virtual Chord nodes (N workers; ids = hashes of
    its name and the node's number, 64-bit identifier space), as the Chord paper prescribes to
    balance keys over real nodes ("each real node runs O(log N) virtual nodes", Stoica et al.
    2001, section 6.1); with one node per worker the hottest worker held several times the mean
    key share. Every node has a full finger table; the key of the prompt's longest fitting level (as in
    :class:`ConsistentHash`) is looked up recursively from a node in the request's edge region:
    the edge's query reaches that node (one in-region way), each hop forwards to the closest
    preceding finger and pays the one-way WAN between the two nodes' regions, and the key's
    successor's predecessor answers the edge directly (one way back); a hop between two virtual
    nodes of one worker, or of one region, costs the in-region way. The request then goes to
    the worker running the key's successor, the hash-designated holder. ``Choice.delay_ms`` is the whole lookup,
    O(log N) hops. Simplifies: static membership (no stabilisation, no churn); the lookup
    resolves only the longest level's key, since with hash placement its owner is where that
    prefix lives (the shorter levels' keys would only add parallel lookups); no claims."""

    name = "chord"
    uses_index = False

    def __init__(self, fleet: Fleet, virtual_nodes: int | None = None) -> None:
        self._fleet = fleet
        self._levels = _levels(fleet)
        t = fleet.topology
        workers = t.indexed_workers
        if virtual_nodes is not None and (type(virtual_nodes) is not int or virtual_nodes < 1):
            raise InvalidArgumentError(f"virtual_nodes must be an int >= 1, got {virtual_nodes!r}")
        self.virtual_nodes = virtual_nodes or (max(1, math.ceil(math.log2(len(workers)))) if len(workers) > 1 else 1)
        nodes = sorted((_h64("chord", w.id, v), w.id, w.region) for w in workers for v in range(self.virtual_nodes))
        self._ids = [n for n, _, _ in nodes]
        self._names = [w for _, w, _ in nodes]
        self._regions = [r for _, _, r in nodes]
        n = len(nodes)
        self._fingers: list[list[int]] = [[self._successor((self._ids[i] + (1 << k)) & _M64) for k in range(64)] for i in range(n)]
        self._entry = {r: next((i for i in range(n) if self._regions[i] == r), None) for r in t.region_names}

    def _successor(self, key: int) -> int:
        """Index of the first node clockwise from ``key`` (inclusive)."""
        i = bisect.bisect_left(self._ids, key)
        return i % len(self._ids)

    @staticmethod
    def _between(x: int, a: int, b: int) -> bool:
        """``x`` in the open ring interval (a, b)."""
        return a < x < b if a < b else (x > a or x < b) if a != b else x != a

    def engine_policy(self, requests: RequestTable) -> EnginePolicy:
        f = self._fleet
        return EnginePolicy(
            "chord",
            (
                list(self._levels),
                list(self._ids),
                [f.worker_index(w) for w in self._names],
                [f.region_index(r) for r in self._regions],
                self._fingers,
                [self._entry[r] for r in f.topology.region_names],
            ),
        )

    def lookup(self, origin_region: str, key: int) -> tuple[str, int, float]:
        """``(owner worker, hops, delay_ms)`` of a recursive lookup of ``key`` from
        ``origin_region``, as the engine routes requests (for inspection and tests)."""
        return self._fleet.chord_lookup(origin_region, key)


class PlanetServe:
    """PlanetServe-style routing with a hash radix tree per region (paper 5.1 (3)).

    Models: each region's balancer keeps a hash radix tree of the prefixes it routed to each of
    its workers (routing history) and sends a request to the own-region worker holding the
    longest matched prefix (the least loaded among equal holders), else to the least-loaded
    own-region worker; the claim is the matched length. Its load threshold, as PlanetServe's
    evaluation code applies it (``eval/hrt+lb``): when the holder's load is above the 80th
    percentile of its region's loads, the request walks up the tree to the first holder of a
    shorter prefix whose load is below that percentile, else goes to the least-loaded worker.
    Simplifies: the load is queued plus dispatched prefill (PlanetServe's is a moving average
    of its workers' latency); the tree learns from routing, not from the workers' evictions (so
    its claims can be false); the tree is bounded by LRU over prefixes; requests never leave
    their region."""

    name = "planetserve"
    uses_index = False

    def __init__(self, fleet: Fleet) -> None:
        self._fleet = fleet
        self._by_region = {r: [w.id for w in _servers_in(fleet.topology, r)] for r in fleet.topology.region_names}

    def engine_policy(self, requests: RequestTable) -> EnginePolicy:
        _served(requests, self._by_region, self.name)
        f = self._fleet
        return EnginePolicy("planetserve", ([[f.worker_index(w) for w in self._by_region[r]] for r in f.topology.region_names], HISTORY_CAPACITY))


class CentralDirectory:
    """One coordinator with global KV cache and queue state (paper 5.1 (4): "a centralized
    coordinator with global KV cache state" that "pays a WAN round trip to a single coordinator
    per request").

    Models: the coordinator sits in the region with the least total RTT to the edge regions
    (the best single placement; :attr:`coordinator`, e.g. Singapore on paper-64x8); every
    lookup pays the RTT between the request's region and the coordinator's
    (``Choice.delay_ms``, in-region RTT when they coincide). Its state is what has crossed the
    WAN to it: every worker's KV events and queue reports reach it one way (worker region to
    coordinator) after they leave the worker, and it decides when the request reaches it, one
    way after its arrival; since it routes every request, it adds what it dispatched to a
    worker after that worker's last report. It scores every worker with KVCompass's joint score
    on that state: the cached prefix and tier it knows, the queue it estimates (the last report
    drained since, plus its own later dispatches), the prefill rate and the WAN RTT from the
    request's region, ``wan + queue + (1 + lambda) * beta * uncached + gamma * dram_hit`` with
    ``lambda = min(lambda_max, min queue / tau)`` (default EdgeParams); near-equal scores
    (within ``tie_ms``) are drawn among. Its lookup costs no compute time, as our edges' route
    calls do not in the simulator. Simplifies: no coordinator queueing or capacity limit; a
    worker nearer the coordinator than the request is seen as of the arrival (the engine cannot
    look ahead), a little fresher than it could be."""

    name = "central-directory"
    uses_index = False
    follows_kv_events = True

    def __init__(self, fleet: Fleet, params: EdgeParams = EdgeParams()) -> None:
        self._fleet = fleet
        self._p = params
        t = fleet.topology
        self._workers = list(t.indexed_workers)
        origins = [r.name for r in t.regions if r.edges > 0] or list(t.region_names)
        self.coordinator = min(t.region_names, key=lambda c: (sum(t.rtt_ms(o, c) for o in origins), t.region_index(c)))

    def engine_policy(self, requests: RequestTable) -> EnginePolicy:
        f, p = self._fleet, self._p
        return EnginePolicy(
            "central_directory",
            (
                [f.worker_index(w.id) for w in self._workers],
                [w.beta_ms_per_token for w in self._workers],
                # Every emulated cache names its blocks with its worker index as seed.
                [f.worker_index(w.id) for w in f.topology.workers],
                f.region_index(self.coordinator),
                p.wan_fraction,
                p.lambda_max,
                p.tau_ms,
                p.gamma_ms_per_token,
                p.tie_ms,
            ),
        )


class SkyWalker:
    """SkyWalker-style locality-first balancing with selective pushing (paper 5.1 (5)).

    Models: a balancer per region, prefix-aware within it (a routing-history hash radix tree per
    region as in :class:`PlanetServe`). A request stays in its region while a local replica is
    free: the longest-prefix holder if its pending queue (waiting requests) is empty, else the
    least-loaded local worker with an empty pending queue. Only when every local pending queue
    is non-empty is it pushed to a remote replica whose pending queue is empty (nearest region
    first, least loaded there), else it stays with the local holder or least-loaded worker.
    Simplifies: pending queues of remote regions are read exactly (the balancers' exchange of
    load is not delayed); a pushed request is recorded in the remote region's tree."""

    name = "skywalker"
    uses_index = False

    def __init__(self, fleet: Fleet) -> None:
        self._fleet = fleet
        t = fleet.topology
        self._by_region = {r: [w.id for w in _servers_in(t, r)] for r in t.region_names}
        self._remote = {r: sorted((o for o in t.region_names if o != r and self._by_region[o]), key=lambda o: (t.rtt_ms(r, o), t.region_index(o))) for r in t.region_names}

    def engine_policy(self, requests: RequestTable) -> EnginePolicy:
        f, t = self._fleet, self._fleet.topology
        return EnginePolicy(
            "skywalker",
            (
                [[f.worker_index(w) for w in self._by_region[r]] for r in t.region_names],
                [[f.region_index(o) for o in self._remote[r]] for r in t.region_names],
                [f.region_index(w.region) for w in t.workers],
                HISTORY_CAPACITY,
            ),
        )


def _dynamo_policy(fleet: Fleet, period_ms: float, global_router: bool) -> EnginePolicy:
    """The engine's Dynamo-style state (``rust/sim/policy.rs``, ``DynamoState``): what the
    routers know of each worker's KV state from its events, exact (the region router's own
    stream) and as of the last global broadcast, the per-region prefix filter and the queues
    sampled per broadcast. Blocks are keyed by the content of their prefix (tokens and salt),
    worker-independently, as a KV indexer keys what every worker reports."""
    t = fleet.topology
    indexed = list(t.indexed_workers)
    by_region = {r: [w for w in indexed if w.region == r] for r in t.region_names}
    glob = None
    if global_router:
        regions = [r for r in t.region_names if by_region[r]]
        beta = [sum(w.beta_ms_per_token for w in by_region[r]) / len(by_region[r]) for r in regions]
        glob = ([fleet.region_index(r) for r in regions], beta, [[fleet.worker_index(w.id) for w in by_region[r]] for r in regions])
    # Every emulated cache names its blocks with its worker index as seed (engine.Simulator).
    return EnginePolicy("dynamo", (period_ms, [fleet.worker_index(w.id) for w in indexed], [w.beta_ms_per_token for w in t.workers], [fleet.worker_index(w.id) for w in t.workers], glob))


class Dynamo:
    """A Dynamo-style KV-aware router per region with a periodic global view (paper 5.1 (6)).

    Models: the request's region router follows its own workers' KV events exactly (as
    Dynamo's KV indexer does) and reads their queues exactly; other regions' workers it knows
    only from a global broadcast every ``period_ms`` (default the paper's Delta = 100 ms): their
    KV state as of the last broadcast instant and their queued work sampled then, stale until
    the next. Each worker scores ``RTT(origin, region) + queue + beta * (prompt - overlap)``
    (Dynamo's cost: load plus the prefill its overlap leaves, with the WAN a cross-region choice
    adds), where the load also counts the prefill this router dispatched that has not reached
    the worker yet (Dynamo's router tracks the active sequences it routed); the best wins, near-equal scores (1 ms) drawn among; the claim is the overlap.
    Simplifies: the local event stream has no delay; the broadcast's own WAN time is not
    modelled (every region sees a broadcast at its instant), and the queue of a broadcast is
    sampled at the first arrival after its instant (never staler than the broadcast); overlap
    counts both tiers, reload cost ignored (Dynamo's router is tier-blind)."""

    name = "dynamo"
    uses_index = False

    follows_kv_events = True

    def __init__(self, fleet: Fleet, period_ms: float = 1e3 * EdgeParams().broadcast_period_s) -> None:
        self._fleet = fleet
        self._period_ms = period_ms

    def engine_policy(self, requests: RequestTable) -> EnginePolicy:
        return _dynamo_policy(self._fleet, self._period_ms, global_router=False)


class DynamoGlobal:
    """A Dynamo-style multi-datacenter global router over per-region KV routers.

    Models: a global tier picks the region, from each region's load (its least queued worker)
    and a compact per-region prefix filter (the prefixes any of its workers held at the last
    refresh), both refreshed every ``period_ms`` (default 100 ms): region score
    ``RTT(origin, r) + load + beta_r * (prompt - filter match)``. The chosen region's KV router
    then picks its worker on exact local state (events and queues), ``queue + beta * (prompt -
    overlap)``; the claim is that worker's overlap. Simplifies: the filter is exact (a Bloom
    filter's false positives are not modelled, which only helps the scheme); the region router
    decides at arrival time, not after the request's WAN way; broadcasts as in :class:`Dynamo`."""

    name = "dynamo-global"
    uses_index = False

    follows_kv_events = True

    def __init__(self, fleet: Fleet, period_ms: float = 1e3 * EdgeParams().broadcast_period_s) -> None:
        self._fleet = fleet
        self._period_ms = period_ms

    def engine_policy(self, requests: RequestTable) -> EnginePolicy:
        return _dynamo_policy(self._fleet, self._period_ms, global_router=True)


SCHEMES: dict[str, Callable[[Fleet], Scheme]] = {
    KVCompassScheme.name: KVCompassScheme,
    LocalLeastLoaded.name: LocalLeastLoaded,
    Oracle.name: Oracle,
    RandomDispatch.name: RandomDispatch,
    RoundRobin.name: RoundRobin,
    SGLangCacheAware.name: SGLangCacheAware,
    NoLoad.name: NoLoad,
    NoCrossRegion.name: NoCrossRegion,
    TierBlind.name: TierBlind,
    NoMigration.name: NoMigration,
    NoHandoff.name: NoHandoff,
    NoBelief.name: NoBelief,
    NoClosure.name: NoClosure,
    NoFingerprint.name: NoFingerprint,
    ConsistentHash.name: ConsistentHash,
    ChordDHT.name: ChordDHT,
    PlanetServe.name: PlanetServe,
    CentralDirectory.name: CentralDirectory,
    SkyWalker.name: SkyWalker,
    Dynamo.name: Dynamo,
    DynamoGlobal.name: DynamoGlobal,
}


def scheme_params(scheme: str | Callable[[Fleet], Scheme], params: EdgeParams) -> EdgeParams:
    """The :class:`EdgeParams` the plane must be built with to run ``scheme``: ``params`` with
    the scheme's ablation switches applied (unchanged for every other scheme)."""
    factory = SCHEMES.get(scheme) if isinstance(scheme, str) else scheme
    ablation = getattr(factory, "ablation", None)
    return dataclasses.replace(params, **ablation) if ablation else params


def make_scheme(name: str, fleet: Fleet) -> Scheme:
    try:
        return SCHEMES[name](fleet)
    except KeyError:
        raise InvalidArgumentError(f"unknown scheme {name!r} (known: {', '.join(SCHEMES)})") from None
