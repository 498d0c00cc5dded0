"""Hotness of prefix families at one edge (paper section 3.4).

A *prefix family* is every prompt sharing the same first chunk; it is named by that chunk's key
(the key at the edge's shortest own-region plan length). A request is a *local miss* when it is
not served from a KV cache held in the edge's own region. A family is *hot* while at least H
of its local misses lie within the sliding window T_h (both ends inclusive: misses at 0, 0.5
and 1.0 s make a family hot at T_h = 1 s).

Memory stays bounded by the families missed within the last window: a family's record is
dropped once its last miss leaves the window (checked on every touch and in periodic sweeps).
"""

from __future__ import annotations

from collections import deque

__all__ = ["HotnessTracker"]

# Sweep every this many observations: amortised O(1) cleanup of families that went quiet.
_SWEEP_EVERY = 4096


class HotnessTracker:
    """Sliding-window miss counts per family."""

    __slots__ = ("_h", "_window", "_misses", "_since_sweep")

    def __init__(self, hot_misses: int, window_s: float) -> None:
        if hot_misses < 1 or not window_s > 0:
            raise ValueError(f"need hot_misses >= 1 and window_s > 0, got {hot_misses}, {window_s}")
        self._h = hot_misses
        self._window = float(window_s)
        self._misses: dict[int, deque[float]] = {}
        self._since_sweep = 0

    def _prune(self, q: deque[float], now: float) -> None:
        while q and now - q[0] > self._window:
            q.popleft()

    def observe_miss(self, family: int, now: float) -> bool:
        """Record a local miss of ``family`` at ``now``; True if the family is hot now."""
        q = self._misses.get(family)
        if q is None:
            q = self._misses[family] = deque()
        q.append(now)
        self._prune(q, now)
        # Only the last H misses can matter for "H within the window".
        while len(q) > self._h:
            q.popleft()
        self._since_sweep += 1
        if self._since_sweep >= _SWEEP_EVERY:
            self.sweep(now)
        return len(q) >= self._h

    def misses(self, family: int, now: float) -> int:
        """Local misses of ``family`` within the window ending at ``now`` (capped at H)."""
        q = self._misses.get(family)
        if q is None:
            return 0
        self._prune(q, now)
        if not q:
            del self._misses[family]
            return 0
        return len(q)

    def is_hot(self, family: int, now: float) -> bool:
        return self.misses(family, now) >= self._h

    def hot(self, now: float) -> list[tuple[int, int, float]]:
        """Every family hot at ``now``: ``(family, misses in the window, time of the last
        miss)``, the most recently missed first (an operator's view; a scan of the families
        missed within the window)."""
        out = []
        for f, q in self._misses.items():
            self._prune(q, now)
            if len(q) >= self._h:
                out.append((f, len(q), q[-1]))
        out.sort(key=lambda x: (-x[2], x[0]))
        return out

    def sweep(self, now: float) -> None:
        """Drop every family with no miss inside the window."""
        self._since_sweep = 0
        for f in [f for f, q in self._misses.items() if not q or now - q[-1] > self._window]:
            del self._misses[f]

    def __len__(self) -> int:
        """Families currently tracked (some may have gone quiet since the last sweep)."""
        return len(self._misses)
