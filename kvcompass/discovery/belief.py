"""Cache belief: how far an edge trusts the index's claims about each worker (paper section 3.2,
3.4).

The keyless view can name a worker that does not hold a prefix (a structural false hit), and a
worker may have evicted what it still appears to hold. Each response reports how many prompt
tokens the worker actually reused; the belief is the EWMA of ``min(1, reused / claimed)`` and the
score discounts the claimed match ``m`` to ``b * m``. A worker that keeps over-claiming stops
attracting requests; a worker that is routed to anyway (for load) and proves its claims earns
the trust back.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from kvcompass.errors import InvalidArgumentError

__all__ = ["CacheBelief"]


class CacheBelief:
    """One belief in [0, 1] per worker index, updated by :meth:`observe`."""

    __slots__ = ("_b", "_weight", "_initial", "_samples", "_t", "_away")

    def __init__(self, n_workers: int, weight: float, initial: float = 1.0) -> None:
        if not 0 < weight <= 1:
            raise ValueError(f"belief weight {weight} must be in (0, 1]")
        if not 0 <= initial <= 1:
            raise ValueError(f"initial belief {initial} must be in [0, 1]")
        self._b = np.full(n_workers, float(initial), dtype=np.float64)
        self._weight = float(weight)
        self._initial = float(initial)
        self._samples = np.zeros(n_workers, dtype=np.int64)
        self._t: float | None = None  # when relax last ran
        self._away = False  # whether any belief may differ from the initial value

    @property
    def values(self) -> npt.NDArray[np.float64]:
        """The live per-worker array (the route loop reads it directly; do not write to it)."""
        return self._b

    def __getitem__(self, index: int) -> float:
        return float(self._b[index])

    def samples(self, index: int) -> int:
        """How many responses have moved this worker's belief."""
        return int(self._samples[index])

    def observe(self, index: int, claimed: int, reused: int) -> float:
        """Fold one response: the edge claimed ``claimed`` tokens, the worker reused ``reused``.

        A response without a claim (``claimed == 0``) says nothing about the index and leaves the
        belief unchanged. Returns the new belief.
        """
        if claimed < 0 or reused < 0:
            raise InvalidArgumentError(f"claimed ({claimed}) and reused ({reused}) tokens must be >= 0")
        if claimed == 0:
            return float(self._b[index])
        ratio = min(1.0, reused / claimed)
        b = (1.0 - self._weight) * float(self._b[index]) + self._weight * ratio
        # Rounding must never push a belief outside [0, 1]: the route loop refuses it.
        b = min(1.0, max(0.0, b))
        self._b[index] = b  # a float64 holds a Python float exactly: b is what is stored
        self._samples[index] += 1
        self._away = self._away or b != self._initial
        return b

    def relax(self, now: float, half_life_s: float, step_s: float = 1.0) -> None:
        """Move every belief toward the initial value: ``b = initial + (b - initial) *
        2 ** (-elapsed / half_life_s)``, applied in steps of at least ``step_s`` seconds of
        ``now`` (the exponent uses the exact elapsed time, so steps compose to the continuous
        decay; a step only delays when it shows). ``half_life_s == 0``: no recovery."""
        if half_life_s <= 0:
            return
        if self._t is None:
            self._t = now
            return
        dt = now - self._t
        if dt < step_s:
            return
        self._t = now
        if not self._away:
            return
        f = 2.0 ** (-dt / half_life_s)
        b = self._b
        np.subtract(b, self._initial, out=b)
        np.multiply(b, f, out=b)
        np.add(b, self._initial, out=b)
        np.clip(b, 0.0, 1.0, out=b)
        self._away = bool(np.any(np.abs(b - self._initial) > 1e-12))
        if not self._away:
            b.fill(self._initial)

    def reset(self, index: int) -> None:
        """Forget a worker's history (e.g. it restarted with an empty cache and re-registered)."""
        self._b[index] = self._initial
        self._samples[index] = 0
