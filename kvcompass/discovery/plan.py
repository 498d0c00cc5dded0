"""The level plan: which prefix lengths each edge queries toward each region, which lengths each
region's workers register at, and how the workers map onto tables.

Computed once from a :class:`~kvcompass.discovery.topology.Topology`, offline, off the serving
path (paper section 3.2: "all the level lengths derive from a stable WAN latency matrix and
per-worker prefill rates, so the whole structure can be computed offline").

Toward a remote region r an edge in region o queries ``n1 = RTT(o, r) / beta_r`` tokens first:
forwarding to r adds a round trip, and a match of n tokens saves about ``beta_r * n`` ms, so n1
is the shortest match for which crossing pays off (paper section 3.2; docs/design.md section 3.5).
Then equal steps of n1/2 (n1, 1.5 n1, 2 n1, ...), because a match falls to the nearest indexed
length below it and equal steps keep that under-credit bounded by n1/2 at every length, and six
levels capture about three quarters of the exact-match upper bound (paper section 3.2, figure 5).

Inside the edge's own region n1 would be a few dozen tokens, guarding a cost that hardly
exists, so the own region starts at a short fixed minimum and doubles, "following the chunk
sizes by which workers organize their KV caches" (paper section 3.2). It gets the same number of
levels as every remote region ("with the same number of levels toward every region"): with the
defaults 256, 512, ..., 8192.

**Long tail (beyond the paper).** Six levels end at 8192 tokens in the own region and at
3.5 n1 toward a remote one, so a worker holding a 50k-token conversation is credited with at
most that much, and a request whose true saving is seconds of prefill is sent to an idle
worker that recomputes everything (the Mooncake conversation trace has prompts up to 125k
tokens). With ``long_tail`` (the default) every ladder continues past its last level with the
own region's tail lengths up to ``max_prefix``: from the own ladder's last length, ``tail_steps``
lengths per doubling (``8192 * 2**(k / tail_steps)``, block-rounded). Toward a remote region
those lengths are the ones its workers register for their own edge anyway, so the tail adds no
registration there. ``long_tail = false`` gives the paper's plan exactly.

Why four steps per doubling (the default), not doubling (``tail_steps = 1``, the tail until
2026-12-07): a match falls to the indexed length below it, so the tail under-credits a long
match by up to ``1 - 2**(-1/tail_steps)`` of it: half with doubling, 16 % with four steps.
Above 8k tokens that is seconds of prefill, larger than any other term of the score, and it
decided the tail of the paper's Mixed workload: its documents (8-32k tokens) were credited
16,384 tokens for a 29,888-token match, and the request went to an idle worker that recomputed
the document instead of the holder that had a second of queue (docs/evaluation.md). The
price is registrations: each prompt longer than 8192 tokens registers about
``(tail_steps - 1) * log2(length / 8192)`` keys more than with doubling (on paper-64x8 a 30k-token
prompt in the US registers 54 keys instead of 48); shorter prompts are unchanged, and the route
probes those lengths only for prompts that reach them.

Every length is rounded up to the workers' KV block size, because a worker can only hold whole
blocks; lengths that coincide after rounding are merged, and lengths beyond ``max_prefix`` (the
model's context window) are dropped because no prompt reaches them. A worker in region r
registers each cached prefix at the union over all edges of the lengths they query toward r, so
every edge's view is identical and edges stay interchangeable (paper section 3.3).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from kvcompass.discovery.layout import IndexLayout, TableSpec
from kvcompass.discovery.topology import Topology
from kvcompass.errors import TopologyError

__all__ = ["LevelPlan", "own_region_levels", "remote_levels", "round_up", "tail_ladder"]


def _per_doubling(base: int, k: int, steps: int, block_size: int) -> int:
    """The ``k``-th length of a ladder of ``steps`` lengths per doubling from ``base``,
    ``base * 2**(k / steps)`` rounded up to whole blocks (the own ladder's and the tail's)."""
    return round_up(base * 2 ** (k / steps), block_size)


def round_up(n: float, block: int) -> int:
    """``n`` rounded up to a whole number of blocks, at least one block. A float a hair above a
    multiple (1088.0000000002) stays at that multiple: the plan must not depend on float noise."""
    blocks = math.ceil(n / block - 1e-9)
    return max(1, blocks) * block


def remote_levels(rtt_ms: float, beta_ms_per_token: float, *, levels: int, block_size: int, max_prefix: int) -> tuple[int, ...]:
    """``n1 * (1 + i/2)`` for ``i < levels`` with ``n1 = rtt_ms / beta``, block-rounded (paper 3.2)."""
    n1 = rtt_ms / beta_ms_per_token
    lengths = {round_up(n1 * (1 + 0.5 * i), block_size) for i in range(levels)}
    return tuple(sorted(c for c in lengths if c <= max_prefix))


def own_region_levels(minimum: int, *, levels: int, block_size: int, max_prefix: int, steps: int = 1) -> tuple[int, ...]:
    """``min * 2**i`` for ``i < levels`` (the minimum block-rounded first, so doubling keeps
    every length a whole number of blocks), capped at ``max_prefix`` (paper 3.2). With
    ``steps`` > 1, ``steps`` lengths per doubling between the same first and last length
    (``min * 2**(k / steps)``, block-rounded): the topology's ``own_steps``."""
    first = round_up(minimum, block_size)
    out: list[int] = []
    for k in range((levels - 1) * steps + 1):
        c = _per_doubling(first, k, steps, block_size)
        if c <= max_prefix and (not out or c > out[-1]):
            out.append(c)
    return tuple(out)


def tail_ladder(ladder: tuple[int, ...], own: tuple[int, ...], max_prefix: int, *, steps: int = 1, block_size: int = 1) -> tuple[int, ...]:
    """``ladder`` continued with the own-region lengths that exceed its last entry: ``own``, then
    ``steps`` lengths per doubling past its end (``own[-1] * 2**(k / steps)``, rounded up to
    ``block_size``) up to ``max_prefix``: the module notes' long tail."""
    if not own:
        return ladder
    full = list(own)
    base = own[-1]
    k = 1
    while (c := _per_doubling(base, k, steps, block_size)) <= max_prefix:
        if c > full[-1]:
            full.append(c)
        k += 1
    top = ladder[-1] if ladder else 0
    return ladder + tuple(c for c in full if c > top)


@dataclass(frozen=True, slots=True)
class LevelPlan:
    """The plan of one topology. Per-region prefill rate ``beta_r`` is the mean over the region's
    indexed workers: the plan keeps one length list per (edge, region), shared by all of the
    region's tables, so differing per-worker rates have to collapse to one figure, and the mean
    is the rate of work spread evenly over the region (the joint score still uses each worker's
    own beta)."""

    topology: Topology
    _beta: dict[str, float] = field(init=False, repr=False, compare=False)
    _lengths: dict[tuple[str, str], tuple[int, ...]] = field(init=False, repr=False, compare=False)
    _registration: dict[str, tuple[int, ...]] = field(init=False, repr=False, compare=False)
    _layout: IndexLayout = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        t = self.topology
        indexed = t.indexed_workers
        beta: dict[str, float] = {}
        for r in t.region_names:
            rates = [w.beta_ms_per_token for w in indexed if w.region == r]
            if rates:
                beta[r] = sum(rates) / len(rates)
        lengths: dict[tuple[str, str], tuple[int, ...]] = {}
        own = own_region_levels(t.own_region_min, levels=t.levels, block_size=t.block_size, max_prefix=t.max_prefix, steps=t.own_steps)
        if t.long_tail:
            own = tail_ladder(own, own, t.max_prefix, steps=t.tail_steps, block_size=t.block_size)
        for o in self.edge_regions:
            # An edge always has its own-region ladder, even in a region without workers: its
            # shortest length names prefix families (hotness) for the requests it receives.
            lengths[(o, o)] = own
            for r in beta:
                if o == r:
                    lengths[(o, r)] = own
                else:
                    ladder = remote_levels(t.rtt_ms(o, r), beta[r], levels=t.levels, block_size=t.block_size, max_prefix=t.max_prefix)
                    # No tail toward a region whose ladder is empty: its n1 is past max_prefix,
                    # so no match there ever pays for the crossing (found in review: the tail
                    # then copied the whole own ladder from 256 up, probed and registered).
                    lengths[(o, r)] = tail_ladder(ladder, own, t.max_prefix) if t.long_tail and ladder else ladder
        registration = {r: tuple(sorted({c for o in self.edge_regions for c in lengths.get((o, r), ())})) for r in beta}
        per = t.value_bits // 2
        tables: list[TableSpec] = []
        for r in beta:
            ids = [w.id for w in indexed if w.region == r]
            for i in range(0, len(ids), per):
                tables.append(TableSpec(len(tables), r, tuple(ids[i : i + per])))
        object.__setattr__(self, "_beta", beta)
        object.__setattr__(self, "_lengths", lengths)
        object.__setattr__(self, "_registration", registration)
        object.__setattr__(self, "_layout", IndexLayout(tuple(tables), shards=t.shards, value_bits=t.value_bits, fp_bits=t.fp_bits))

    @property
    def edge_regions(self) -> tuple[str, ...]:
        """Regions that run at least one edge, in declaration order: the origins of queries."""
        return tuple(r.name for r in self.topology.regions if r.edges > 0)

    @property
    def target_regions(self) -> tuple[str, ...]:
        """Regions with at least one indexed worker, in declaration order: what edges query."""
        return tuple(self._beta)

    def beta(self, region: str) -> float:
        """The region's prefill rate in ms/token (mean over its indexed workers)."""
        self.topology.region(region)
        try:
            return self._beta[region]
        except KeyError:
            raise TopologyError(f"region {region!r} has no indexed (prefill) workers") from None

    def rtt_ms(self, a: str, b: str) -> float:
        """RTT in ms from region ``a`` to region ``b``; ``a == b`` is the in-region RTT."""
        return self.topology.rtt_ms(a, b)

    def n1(self, edge_region: str, target_region: str) -> float:
        """The first latency-derived length RTT/beta, unrounded. For the own region this is what
        the formula would give, not what the plan uses (the plan uses ``own_region_min``)."""
        return self.rtt_ms(edge_region, target_region) / self.beta(target_region)

    def _check_edge(self, region: str) -> None:
        if self.topology.region(region).edges == 0:
            raise TopologyError(f"region {region!r} runs no edge, so it queries nothing")

    def lengths(self, edge_region: str, target_region: str) -> tuple[int, ...]:
        """Ascending prefix lengths an edge in ``edge_region`` queries toward ``target_region``;
        empty when the target has no indexed workers."""
        self._check_edge(edge_region)
        self.topology.region(target_region)
        return self._lengths.get((edge_region, target_region), ())

    def registration(self, region: str) -> tuple[int, ...]:
        """Ascending lengths at which the region's workers register each cached prefix: the union
        over every edge of what it queries toward the region (paper section 3.3)."""
        self.topology.region(region)
        return self._registration.get(region, ())

    def router_plan(self, edge_region: str) -> list[list[int]]:
        """``lengths`` toward every region in declaration order, the ``plan`` argument of
        ``kvcompass.Router`` (regions without indexed workers get an empty list)."""
        return [list(self.lengths(edge_region, r)) for r in self.topology.region_names]

    def layout(self) -> IndexLayout:
        """Tables: each region's indexed workers in declaration order, in groups of at most
        ``value_bits / 2`` (one 2-bit tier field each), table ids 0..n-1 in region order."""
        return self._layout

    def to_json(self) -> dict[str, Any]:
        """The plan as plain JSON data (``kvcompass plan --json``). Keys ``block_size``,
        ``beta_ms_per_token``, ``rtt_ms``, ``plan``, ``registration`` and ``tables`` are the
        documented schema; the others are extra context."""
        t = self.topology
        edges = self.edge_regions
        targets = self.target_regions
        return {
            "block_size": t.block_size,
            "beta_ms_per_token": {r: self._beta[r] for r in targets},
            "rtt_ms": {o: {r: self.rtt_ms(o, r) for r in targets} for o in edges},
            "plan": {o: {r: list(self._lengths[(o, r)]) for r in targets} for o in edges},
            "registration": {r: list(self._registration[r]) for r in targets},
            "tables": {r: [list(s.workers) for s in self._layout.tables if s.region == r] for r in targets},
            "topology": t.name,
            "description": t.description,
            "rtt_source": t.rtt.source,
            "aws_region": {r.name: r.aws_region for r in t.regions},
            "edges": {r.name: r.edges for r in t.regions},
            "n1": {o: {r: self.n1(o, r) for r in targets if r != o} for o in edges},
            "levels": t.levels,
            "long_tail": t.long_tail,
            "tail_steps": t.tail_steps,
            "own_region_min": t.own_region_min,
            "own_steps": t.own_steps,
            "max_prefix": t.max_prefix,
            "value_bits": t.value_bits,
            "shards": t.shards,
            "fp_bits": t.fp_bits,
            "table_ids": {r: [s.table_id for s in self._layout.tables if s.region == r] for r in targets},
            "workers": len(t.workers),
            "indexed_workers": len(self._layout.workers),
        }
