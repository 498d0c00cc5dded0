"""The edge's tunables and ablation switches, each with its source.

Defaults follow the paper's configuration (section 5.1: Delta = 100 ms, w = 0.5, lambda_max = 8,
H = 3, T_h = 1 s) and docs/design.md section 6 (gamma). Where the paper gives no value (tau, the
belief weight, the tie band, the speculative TTL, the idle rule's numbers, the migration
cooldown) the default is ours and the comment says why.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from kvcompass.discovery.layout import IndexLayout

__all__ = ["EdgeParams", "layout_for"]


@dataclass(frozen=True, slots=True)
class EdgeParams:
    """Everything an :class:`~kvcompass.discovery.edge.Edge` can be tuned or ablated by."""

    # -- score ---------------------------------------------------------------------------------
    gamma_ms_per_token: float = 0.005
    """DRAM reload cost: 128 KiB of KV per token over PCIe 4.0 at ~25 GB/s (docs/design.md section 6)."""
    wan_fraction: float = 1.0
    """WAN term = ``wan_fraction * RTT(o, r)``. Default 1.0, the full round trip: a request served
    in another region pays the way out and its first token's way back, so a remote holder is
    worth it exactly when the prefill it saves exceeds the extra RTT, which is also the
    break-even that places the first level at n1 = RTT/beta (paper 3.2). The paper's table 1
    writes WAN(o, r) as a one-way latency; 0.5 reproduces that reading."""
    lambda_max: float = 8.0
    """Cap of the capacity price (paper section 5.1)."""
    tau_ms: float = 200.0
    """Normalisation of the capacity price, lambda = min(lambda_max, min Tq / tau). The paper
    names tau but gives no value. Ours: tau ~ the mean per-request service time, so lambda ~ the
    number of requests queued ahead at the least-loaded worker, i.e. how many requests each
    recomputed millisecond delays. 200 ms ~ prefill of 2.4K tokens at 0.085 ms/token; a driver
    that knows its workload's mean service time should pass that."""
    tie_ms: float = 1.0
    """Scores within ``tie_ms`` of the best are near-equal: the winner is drawn uniformly among
    them so edges sharing a stale estimate do not herd onto one worker. 1 ms is far below the
    error of any queue estimate yet above float noise; 0 randomises exact ties only."""

    # -- queue estimates -----------------------------------------------------------------------
    broadcast_period_s: float = 0.1
    """Delta: each region broadcasts its queue vector this often (paper section 5.1)."""
    queue_weight: float = 0.5
    """w: weight of a new remote sample in the queue-estimate EWMA (paper section 5.1)."""
    dispatch_charge_ttl_s: float = 2.0
    """Beyond the paper: each route charges the chosen worker's estimate with the prefill it
    sends there until a sample must include it (kvcompass.discovery.queues), at most this long.
    2 s covers the longest round trip plus a few broadcast periods; 0 turns charges off."""

    # -- cache belief ----------------------------------------------------------------------------
    belief_weight: float = 0.2
    """Weight of a new reused/claimed ratio in the belief EWMA. Ours (the paper gives none):
    three false claims in a row take a belief from 1 to 0.51, three true ones back to 0.75."""
    belief_initial: float = 1.0
    """Belief in a worker nothing is known about: trust the index until responses say otherwise."""
    belief_half_life_s: float = 60.0
    """Beliefs drift back to ``belief_initial`` with this half-life (beyond the paper; see
    :mod:`kvcompass.discovery.belief`): the causes of false claims (a restart, a lagging agent,
    forged outcomes) pass within seconds to minutes, and a worker at belief 0 would otherwise
    never be routed a claim that could restore it. A minute keeps a persistently over-claiming
    worker discounted (each of its responses pushes it down again) while a recovered one is
    trusted again within a few minutes. 0: no recovery (the paper's belief)."""

    # -- speculative entries -----------------------------------------------------------------------
    speculative_ttl_s: float = 2.0
    """Lifetime of the entry that claims a just-chosen worker holds the prompt, covering the gap
    until its own KV event is indexed (one prefill plus one patch round trip). 0 disables."""

    # -- hotness and migration (paper section 3.4) -------------------------------------------------
    hot_misses: int = 3
    """H: a prefix family is hot at H local misses ... (paper section 5.1)."""
    hot_window_s: float = 1.0
    """T_h: ... within this sliding window (paper section 5.1)."""
    idle_threshold_ms: float = 1.0
    """A queue estimate at or below this counts as "at zero" for the idle rule."""
    idle_window_s: float = 1.0
    """A migration target's estimate must have stayed at zero at least this long ("persistently
    idle"); one hotness window, so a worker idle for a whole burst of misses qualifies."""
    migration_cooldown_s: float = 10.0
    """After an action for a family, no other for it this long: the replica needs one transfer
    or prefill plus one index round trip to become visible, and repeating it would only add load."""

    # -- ablations (paper section 5.4) and modes ---------------------------------------------------
    load_aware: bool = True
    """False: queue estimates read as 0 and lambda = 0 (the "No-load-aware" ablation)."""
    cross_region: bool = True
    """False: no lookups toward other regions and only own-region workers may win."""
    tier_aware: bool = True
    """False: gamma = 0, DRAM holders look as cheap as VRAM holders ("Tier-blind")."""
    migration: bool = True
    """False: no migration actions ("No-KVmigration")."""
    belief: bool = True
    """False: every belief reads 1 (claims are taken at face value)."""
    closure: bool = True
    """False: the route loop skips the prefix-closure check."""
    fingerprints: bool = True
    """False: views must carry no fingerprints. The layout decides what writers build, so build
    it with :func:`layout_for`; the edge refuses a layout that contradicts this switch."""
    handoff: bool = True
    """True: a request forwarded to another region is re-placed by that region's edge on arrival
    (:meth:`Edge.handoff`), which reads its queues live. False: it goes where the origin edge
    sent it, as in the paper (the "No-handoff" ablation)."""
    disaggregated: bool = False
    """Prefill-decode disaggregation (paper appendix C): every indexed worker must be a prefill
    worker; decode selection and KV transfer stay with the serving stack."""

    def __post_init__(self) -> None:
        nonneg = {
            "gamma_ms_per_token": self.gamma_ms_per_token,
            "wan_fraction": self.wan_fraction,
            "lambda_max": self.lambda_max,
            "tie_ms": self.tie_ms,
            "speculative_ttl_s": self.speculative_ttl_s,
            "idle_threshold_ms": self.idle_threshold_ms,
            "idle_window_s": self.idle_window_s,
            "migration_cooldown_s": self.migration_cooldown_s,
            "belief_half_life_s": self.belief_half_life_s,
        }
        for name, x in nonneg.items():
            if not (math.isfinite(x) and x >= 0):
                raise ValueError(f"EdgeParams.{name} = {x}: must be finite and >= 0")
        if not (math.isfinite(self.dispatch_charge_ttl_s) and self.dispatch_charge_ttl_s >= 0):
            raise ValueError(f"EdgeParams.dispatch_charge_ttl_s = {self.dispatch_charge_ttl_s}: must be finite and >= 0")
        positive = {"tau_ms": self.tau_ms, "broadcast_period_s": self.broadcast_period_s, "hot_window_s": self.hot_window_s}
        for name, x in positive.items():
            if not (math.isfinite(x) and x > 0):
                raise ValueError(f"EdgeParams.{name} = {x}: must be finite and > 0")
        for name, x in {"queue_weight": self.queue_weight, "belief_weight": self.belief_weight}.items():
            if not 0 < x <= 1:
                raise ValueError(f"EdgeParams.{name} = {x}: must be in (0, 1]")
        if not 0 <= self.belief_initial <= 1:
            raise ValueError(f"EdgeParams.belief_initial = {self.belief_initial}: must be in [0, 1]")
        if self.hot_misses < 1:
            raise ValueError(f"EdgeParams.hot_misses = {self.hot_misses}: must be >= 1")


def layout_for(layout: IndexLayout, params: EdgeParams) -> IndexLayout:
    """The layout writers and views must use under ``params``: ``fp_bits = 0`` when the
    fingerprint ablation is on, else ``layout`` unchanged."""
    if params.fingerprints or layout.fp_bits == 0:
        return layout
    return dataclasses.replace(layout, fp_bits=0)
