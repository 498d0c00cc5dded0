"""Proactive replication of hot prefixes into the edge's own region (paper section 3.4).

The rule, as the paper states it, evaluated on the request that makes its family hot (see
:mod:`kvcompass.discovery.hotness`):

* **No local holder, remote holder beyond n1.** No own-region worker holds any indexed prefix of
  the prompt, and some remote worker's match exceeds n1 of its region (RTT(o, r) / beta_r, the
  shortest match worth crossing the WAN for). Moving KV tensors over the WAN costs more than
  recomputing them, so the action is ``recompute``: ship the prompt prefix to a local worker
  and prefill it there. The source is the remote holder with the longest match.
* **Every local holder keeps losing to load.** Own-region holders exist, the request went
  elsewhere, and every one of them would have won (or tied) had its queue been empty
  (``score - Tq <= winning score``). The action is ``copy``: transfer the KV worker-to-worker
  inside the region, from the local holder with the longest match.

What moves is the triggering request's own prefix, up to the source's matched (indexed) length:
it contains the family's shared ancestor, and the rest of the prompt is that request's private
tail. The replica goes only to a *persistently idle* own-region worker (queue estimate at zero
for a window), never one that already holds the prefix that long, and lands in its DRAM so it
evicts nothing serving from VRAM. A family that got an action is left alone for a cooldown.
The edge only emits :class:`MigrationAction` s; drivers carry them out, and the replica becomes
visible through the target's own KV events like any other insert.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Collection, Literal, Sequence

import numpy as np
import numpy.typing as npt

from kvcompass.index_types import Tier

__all__ = ["MigrationAction", "MigrationPlanner", "MigrationTrigger", "evaluate_trigger"]

MigrationKind = Literal["copy", "recompute"]


@dataclass(frozen=True, slots=True)
class MigrationAction:
    """Put a replica of ``tokens`` (the first ``length`` tokens of a hot request) on ``target``.

    ``copy``: transfer the KV cache from ``source`` (same region). ``recompute``: ship the tokens
    to ``target`` and prefill them there (``source`` is the remote holder that made the family
    worth replicating). Either way the replica lands in ``target_tier`` (DRAM).
    """

    kind: MigrationKind
    family: int
    namespace: bytes = field(repr=False)
    length: int
    source: str
    source_region: str
    target: str
    target_region: str
    target_tier: Tier
    at: float
    tokens: npt.NDArray[np.uint32] = field(repr=False, compare=False)


@dataclass(frozen=True, slots=True)
class MigrationTrigger:
    """The evidence of one request that satisfies the migration rule."""

    kind: MigrationKind
    source: int
    length: int
    holders: frozenset[int]
    """Own-region worker indices already holding at least ``length`` (never a target)."""


def evaluate_trigger(
    local: npt.NDArray[np.bool_],
    matches: npt.NDArray[np.uint32],
    scores: npt.NDArray[np.float64],
    tq: npt.NDArray[np.float64],
    n1: npt.NDArray[np.float64],
    winner: int,
) -> MigrationTrigger | None:
    """Apply the paper's rule to one routed request (arrays indexed by worker).

    ``local``: own-region workers that may serve; ``matches``: claimed match lengths; ``scores``:
    joint scores as routed; ``tq``: the queue terms used in them; ``n1``: per worker,
    RTT(o, region) / beta; ``winner``: who got the request. None when the rule does not fire
    (including when a local holder won: that was a local hit).
    """
    local_holders = local & (matches > 0)
    if not local_holders.any():
        remote = ~local & (matches.astype(np.float64) > n1)
        cand = np.flatnonzero(remote)
        if cand.size == 0:
            return None
        # Longest match first; then the cheaper one; then the lower index (np.lexsort: last key major).
        src = int(cand[np.lexsort((cand, scores[cand], -matches[cand].astype(np.int64)))[0]])
        return MigrationTrigger("recompute", src, int(matches[src]), frozenset())
    if local_holders[winner]:
        return None
    hs = np.flatnonzero(local_holders)
    if not bool(np.all(scores[hs] - tq[hs] <= scores[winner])):
        return None
    src = int(hs[np.lexsort((hs, tq[hs], -matches[hs].astype(np.int64)))[0]])
    length = int(matches[src])
    holders = frozenset(int(i) for i in np.flatnonzero(local & (matches >= length)))
    return MigrationTrigger("copy", src, length, holders)


@dataclass(slots=True)
class _Pending:
    family: int
    trigger: MigrationTrigger
    namespace: bytes
    tokens: npt.NDArray[np.uint32]
    at: float


# Pending triggers at which offer() first drops the stale ones (then at twice what is left).
_SWEEP_MIN = 64


class MigrationPlanner:
    """Holds triggers until a driver asks for actions, then picks idle targets.

    A trigger waits at most ``max_age_s`` (its evidence goes stale) and only the newest per
    family is kept. At most one action per family per ``cooldown_s``.
    """

    __slots__ = ("_ids", "_regions", "_cooldown", "_max_age", "_rng", "_pending", "_next_sweep", "_quiet_until", "emitted", "no_target")

    def __init__(self, ids: Sequence[str], regions: Sequence[str], cooldown_s: float, max_age_s: float, rng: np.random.Generator) -> None:
        self._ids = tuple(ids)
        self._regions = tuple(regions)
        self._cooldown = float(cooldown_s)
        self._max_age = float(max_age_s)
        self._rng = rng
        self._pending: dict[int, _Pending] = {}
        self._next_sweep = _SWEEP_MIN
        self._quiet_until: dict[int, float] = {}
        self.emitted = 0
        """Actions handed out."""
        self.no_target = 0
        """Triggers dropped because no own-region worker was persistently idle."""

    def cooling(self, family: int, now: float) -> bool:
        until = self._quiet_until.get(family)
        if until is None:
            return False
        if now >= until:
            del self._quiet_until[family]
            return False
        return True

    def offer(self, family: int, trigger: MigrationTrigger, namespace: bytes, tokens: npt.NDArray[np.uint32], now: float) -> bool:
        """Queue a trigger (its tokens copied up to its length); False if the family is cooling down."""
        if self.cooling(family, now):
            return False
        if len(self._pending) >= self._next_sweep:
            # Stale triggers leave here too, not only in resolve(): an edge nobody asks for
            # actions (the gRPC edge service, a door with migration_poll_s=0) kept every one,
            # with its tokens, for ever (found in review). Amortised: at most once per doubling.
            self._pending = {f: p for f, p in self._pending.items() if now - p.at <= self._max_age}
            self._next_sweep = max(_SWEEP_MIN, 2 * len(self._pending))
        self._pending[family] = _Pending(family, trigger, namespace, np.array(tokens[: trigger.length], dtype=np.uint32), now)
        return True

    @property
    def pending(self) -> int:
        """Triggers waiting for :meth:`resolve`."""
        return len(self._pending)

    def resolve(self, now: float, idle: Sequence[int], unavailable: Collection[int] = ()) -> list[MigrationAction]:
        """Turn pending triggers into actions toward persistently idle workers ``idle`` (own-region
        indices); triggers with no eligible target are dropped (the next hot miss re-triggers),
        and so is a copy whose source is ``unavailable`` (a door's dead worker: the copy would
        fail and its family's cooldown would start for nothing)."""
        out: list[MigrationAction] = []
        if len(self._quiet_until) > 1024:
            self._quiet_until = {f: t for f, t in self._quiet_until.items() if t > now}
        pending, self._pending = self._pending, {}
        for fam, p in pending.items():
            if now - p.at > self._max_age or self.cooling(fam, now):
                continue
            if p.trigger.kind == "copy" and p.trigger.source in unavailable:
                self.no_target += 1
                continue
            cand = [i for i in idle if i != p.trigger.source and i not in p.trigger.holders]
            if not cand:
                self.no_target += 1
                continue
            tgt = cand[int(self._rng.integers(len(cand)))] if len(cand) > 1 else cand[0]
            t = p.trigger
            out.append(
                MigrationAction(
                    kind=t.kind,
                    family=fam,
                    namespace=p.namespace,
                    length=t.length,
                    source=self._ids[t.source],
                    source_region=self._regions[t.source],
                    target=self._ids[tgt],
                    target_region=self._regions[tgt],
                    target_tier=Tier.DRAM,
                    at=now,
                    tokens=p.tokens,
                )
            )
            self._quiet_until[fam] = now + self._cooldown
            self.emitted += 1
        return out
