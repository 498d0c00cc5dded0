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

    __slots__ = ("_b", "_weight", "_initial", "_samples")

    def __init__(self, n_workers: int, weight: float, initial: float = 1.0) -> None:
        if not 0 < weight <= 1:
            raise ValueError(f"belief weight {weight} must be in (0, 1]")
        if not 0 <= initial <= 1:
            raise ValueError(f"initial belief {initial} must be in [0, 1]")
        self._b = np.full(n_workers, float(initial), dtype=np.float64)
        self._weight = float(weight)
        self._initial = float(initial)
        self._samples = np.zeros(n_workers, dtype=np.int64)

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
        self._b[index] = min(1.0, max(0.0, b))
        self._samples[index] += 1
        return float(self._b[index])

    def reset(self, index: int) -> None:
        """Forget a worker's history (e.g. it restarted with an empty cache and re-registered)."""
        self._b[index] = self._initial
        self._samples[index] = 0
