"""Queue estimates an edge keeps for every worker, and when it broadcasts its own region's
(paper section 3.4).

* Own region: read live. The driver reports each local worker's queue with
  :meth:`QueueEstimates.set_live`; the newest report replaces the estimate.
* Remote regions: two channels. A response from a remote worker piggybacks that region's
  per-worker queue vector; each region also broadcasts its vector every Delta. Both fold into
  the estimate with an EWMA of weight ``w`` on the new sample (the first sample of a worker
  replaces the initial 0).
* Unknown: a worker no sample has reached yet reads 0 (idle); the first broadcast (within
  Delta of start) replaces that.
* Staleness: estimates do not decay with age; they hold until the next sample. In normal
  operation the broadcast bounds every estimate's age by about Delta + one-way latency; a region
  that stops reporting is more likely partitioned or failed than idle, and decaying its queue
  toward 0 would steer traffic into it. :meth:`QueueEstimates.age` exposes the age so drivers
  and health checks can flag a silent region.
* Dispatched work (beyond the paper): a route charges the chosen worker the prefill it just
  sent there (:meth:`QueueEstimates.charge`), so the next decision, made before any sample
  can reflect that request, does not see the worker as idle. Without it a burst of requests
  arriving together (the Mooncake traces have many with one timestamp) all read the same
  stale estimates, and the speculative entry of the first makes the whole burst herd onto
  one worker: 20-second queues beside idle neighbours. A charge lives until a sample that
  must already include its request arrives (``settled_before`` of :meth:`set_live` /
  :meth:`fold`: the request's one-way trip for a live reading, a round trip for a remote
  vector), or ``charge_ttl_s`` at most, whichever comes first.
* Idleness: per worker, the time since the estimate last went to (about) zero; a worker is
  *persistently idle* once it has stayed there for a window. Only such a worker may receive a
  migrated replica. A charge stops the clock (the estimate, charges included, is no longer
  zero); the next reading of an empty queue starts it again.

:class:`BroadcastSchedule` decides, per target region, when this region's vector is due: every
Delta, unless a piggybacked vector already went to that region within the last Delta.
"""

from __future__ import annotations

import math
from typing import Sequence

from kvcompass import _core

__all__ = ["MAX_QUEUE_MS", "BroadcastSchedule", "QueueEstimates"]

# Slack for "Delta has passed": a driver ticking every Delta accumulates float error
# (0.1 + 0.2 > 0.3), which must not push a broadcast to the following tick.
_EPS_S = 1e-9


MAX_QUEUE_MS: float = _core.MAX_QUEUE_MS
"""The largest queue estimate (ms) a report may carry (a day): larger is a broken or hostile
reporter, refused like a negative or NaN one."""


QueueEstimates = _core.QueueEstimates
"""Per-worker queue estimates (ms) with their ages, idle tracking and open dispatch charges, by
worker index (the rules are the module notes'; ``rust/queues.rs`` holds them, so a route, a live
reading or a folded vector is one call). ``values`` is every worker's samples plus open charges;
``version`` changes on every change. A sample or charge that is not finite and in
[0, :data:`MAX_QUEUE_MS`] is a ValueError; a vector with such a sample, or with a repeated or
out-of-range index, is refused whole before anything changes."""


class BroadcastSchedule:
    """When this region's queue vector is due toward each other region.

    A target is due once Delta has passed since its last broadcast (or at once, the first
    time); a due broadcast is suppressed when a piggybacked vector reached that region within
    the last Delta, and the period restarts either way.

    Per-target times are lists in target order, not dicts by name: a simulated paper-128x16
    fleet asks each of its 16 edges every 100 ms, and the dict walk was 3 % of the run.
    """

    __slots__ = ("_period", "_names", "_at", "_next", "_piggy", "_soonest", "suppressed")

    def __init__(self, targets: Sequence[str], period_s: float) -> None:
        if not (math.isfinite(period_s) and period_s > 0):
            raise ValueError(f"broadcast period {period_s} s must be finite and > 0")
        self._period = float(period_s)
        self._names = list(dict.fromkeys(targets))  # in order, once each
        self._at = {r: i for i, r in enumerate(self._names)}
        self._next = [-math.inf] * len(self._names)
        self._piggy = [-math.inf] * len(self._names)
        self._soonest = -math.inf  # min(_next): before it nothing is due (one comparison a tick)
        self.suppressed = 0
        """Broadcasts skipped because a piggyback made them redundant."""

    @property
    def targets(self) -> tuple[str, ...]:
        return tuple(self._names)

    @property
    def next_due(self) -> float:
        """The earliest time (s) a target can be due; before it :meth:`due` returns nothing."""
        return self._soonest

    def note_piggyback(self, region: str, now: float) -> None:
        """A response carrying this region's vector was sent toward ``region`` at ``now``."""
        i = self._at[region]  # KeyError for a region that is not a target
        self._piggy[i] = max(self._piggy[i], now)

    def due(self, now: float) -> list[str]:
        """Targets to broadcast to now (in a stable order); advances their periods."""
        if now + _EPS_S < self._soonest:
            return []
        out: list[str] = []
        nxt, piggy, names, period = self._next, self._piggy, self._names, self._period
        late, again = now + _EPS_S, now + period
        for i, t in enumerate(nxt):
            if late < t:
                continue
            nxt[i] = again
            if now - piggy[i] < period:
                self.suppressed += 1
            else:
                out.append(names[i])
        self._soonest = min(nxt, default=math.inf)
        return out
