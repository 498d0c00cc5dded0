"""The queue estimates' rules in plain Python: the class ``kvcompass.discovery.queues`` had
before the estimates moved into the Rust core, kept as the reference model the Rust one is
checked against step by step (tests/test_queues.py). Not used by the package."""

from __future__ import annotations

import math
from collections import deque
from typing import Sequence

import numpy as np
import numpy.typing as npt

MAX_QUEUE_MS = 86_400_000.0


def _check_sample(tq_ms: float) -> float:
    x = float(tq_ms)
    if not (math.isfinite(x) and 0 <= x <= MAX_QUEUE_MS):
        raise ValueError(f"queue estimate {tq_ms!r} ms must be finite and in [0, {MAX_QUEUE_MS:g}]")
    return x


class ReferenceEstimates:
    """Per-worker queue estimates (ms) with their ages and idle tracking."""

    __slots__ = ("_tq", "_obs", "_pend", "_charges", "_order", "_ttl", "_at", "_idle_since", "_weight", "_idle_ms", "version")

    def __init__(self, n_workers: int, weight: float, idle_threshold_ms: float, charge_ttl_s: float = 2.0) -> None:
        if not 0 < weight <= 1:
            raise ValueError(f"queue weight {weight} must be in (0, 1]")
        if not (math.isfinite(charge_ttl_s) and charge_ttl_s >= 0):
            raise ValueError(f"charge TTL {charge_ttl_s} s must be finite and >= 0")
        # _tq = _obs + _pend, kept in step: the route loop reads _tq directly.
        self._tq = np.zeros(n_workers, dtype=np.float64)
        self._obs = np.zeros(n_workers, dtype=np.float64)
        self._pend = np.zeros(n_workers, dtype=np.float64)
        self._charges: list[deque[tuple[float, float]]] = [deque() for _ in range(n_workers)]
        # Every charge's (time, worker) in issue order, to run the TTL out across all workers.
        self._order: deque[tuple[float, int]] = deque()
        self._ttl = float(charge_ttl_s)
        # Time of the last sample; -inf = never heard of (its estimate is the initial 0).
        self._at = np.full(n_workers, -math.inf, dtype=np.float64)
        # Since when the estimate has been at zero; nan = not idle (or never reported).
        self._idle_since = np.full(n_workers, math.nan, dtype=np.float64)
        self._weight = float(weight)
        self._idle_ms = float(idle_threshold_ms)
        self.version = 0
        """Bumped on every change, so readers can cache what they derive from the estimates."""

    @property
    def values(self) -> npt.NDArray[np.float64]:
        """The live per-worker array, samples plus open charges (the route loop reads it
        directly; do not write to it)."""
        return self._tq

    def __getitem__(self, index: int) -> float:
        return float(self._tq[index])

    def observed(self, index: int) -> float:
        """The estimate from samples alone, without open charges."""
        return float(self._obs[index])

    def pending(self, index: int) -> float:
        """Open charges (ms) of work dispatched to this worker that no sample reflects yet."""
        return float(self._pend[index])

    def known(self, index: int) -> bool:
        """Whether any sample for this worker has arrived."""
        return bool(self._at[index] > -math.inf)

    def age(self, index: int, now: float) -> float:
        """Seconds since this worker's last sample (inf if none ever arrived)."""
        return now - float(self._at[index])

    def charge(self, index: int, work_ms: float, now: float) -> None:
        """This edge just sent ``work_ms`` of prefill to the worker (see the module notes)."""
        x = _check_sample(work_ms)
        self.expire(now)
        if x > 0:
            self._charges[index].append((now, x))
            self._order.append((now, index))
            self._pend[index] += x
            self._tq[index] += x
            self._idle_since[index] = math.nan
            self.version += 1

    def expire(self, now: float) -> None:
        """Close every charge older than the TTL (the route loop calls this before reading)."""
        order, before = self._order, now - self._ttl
        while order and order[0][0] <= before:
            self._settle(order.popleft()[1], before)

    def _settle(self, index: int, before: float) -> None:
        q = self._charges[index]
        if not q or q[0][0] > before:
            return
        while q and q[0][0] <= before:
            self._pend[index] -= q.popleft()[1]
        if not q:
            self._pend[index] = 0.0  # no float residue once nothing is open
        self._tq[index] = self._obs[index] + self._pend[index]
        self.version += 1

    def set_live(self, index: int, tq_ms: float, now: float, settled_before: float | None = None) -> None:
        """A live reading (own region): replaces the estimate. Charges made at or before
        ``settled_before`` are in the reading and close (default: all of them)."""
        x = _check_sample(tq_ms)
        self._settle(index, max(now if settled_before is None else settled_before, now - self._ttl))
        self._store(index, x, now)

    def fold(self, index: int, tq_ms: float, now: float, settled_before: float | None = None) -> float:
        """A remote sample (piggyback or broadcast): EWMA with weight ``w``; returns the estimate
        from samples. ``settled_before`` as in :meth:`set_live`."""
        x = _check_sample(tq_ms)
        if self.known(index):
            x = (1.0 - self._weight) * float(self._obs[index]) + self._weight * x
        self._settle(index, max(now if settled_before is None else settled_before, now - self._ttl))
        self._store(index, x, now)
        return x

    def set_live_many(self, indices: npt.NDArray[np.int64], tq_ms: npt.NDArray[np.float64], now: float, settled_before: npt.NDArray[np.float64]) -> None:
        """:meth:`set_live` of ``tq_ms[j]`` for worker ``indices[j]`` for every j at once (the
        live readings of a region's busy workers, polled together; indices distinct). Same
        result as the loop, in one Rust pass: a live reading is a fold of weight 1."""
        self._fold(indices, tq_ms, now, settled_before, None, 1.0)

    def fold_many(self, indices: npt.NDArray[np.int64], tq_ms: npt.NDArray[np.float64], now: float, settled_before: npt.NDArray[np.float64]) -> None:
        """:meth:`fold` of ``tq_ms[j]`` into worker ``indices[j]`` for every j at once (a whole
        queue vector: indices distinct; a sample that is not finite and >= 0 is a ValueError
        before anything changes). Same result as the loop, in one Rust pass."""
        self._fold(indices, tq_ms, now, settled_before, None)

    def fold_lagged(self, indices: npt.NDArray[np.int64], tq_ms: npt.NDArray[np.float64], now: float, lag_s: npt.NDArray[np.float64]) -> None:
        """:meth:`fold_many` with ``settled_before = now - lag_s``, computed only for workers with
        open charges (most vectors find none)."""
        self._fold(indices, tq_ms, now, None, lag_s)

    def _fold(self, indices: npt.NDArray[np.int64], tq_ms: npt.NDArray[np.float64], now: float, before: npt.NDArray[np.float64] | None, lag: npt.NDArray[np.float64] | None, weight: float | None = None) -> None:
        if len(indices) == 0:
            return
        # The EWMA, live totals, ages and idle clocks in one Rust pass (it checks every sample
        # and index first); then the charges the samples include close, which moves only the
        # charges and the live totals (recomputed from the new estimates), so the order is free.
        w = self._weight if weight is None else weight
        for i, s in zip(indices.tolist(), tq_ms.tolist()):
            x = (1.0 - w) * float(self._obs[i]) + w * s if self._at[i] > -math.inf else s
            self._obs[i] = x
            self._tq[i] = x + self._pend[i]
            self._at[i] = max(float(self._at[i]), now)
            if x <= self._idle_ms:
                if math.isnan(self._idle_since[i]):
                    self._idle_since[i] = now
            else:
                self._idle_since[i] = math.nan
        if self._order:  # some charge is open
            if before is None:
                assert lag is not None
                before = now - lag
            floor = now - self._ttl
            charges = self._charges
            for j, i in enumerate(indices.tolist()):
                if charges[i]:
                    self._settle(i, max(float(before[j]), floor))
        self.version += len(indices)

    def _store(self, index: int, x: float, now: float) -> None:
        self.version += 1
        self._obs[index] = x
        self._tq[index] = x + self._pend[index]
        self._at[index] = max(float(self._at[index]), now)
        if x <= self._idle_ms:
            if math.isnan(self._idle_since[index]):
                self._idle_since[index] = now
        else:
            self._idle_since[index] = math.nan

    def idle_for(self, index: int, now: float) -> float:
        """How long the estimate has been at zero (0 when it is not)."""
        since = float(self._idle_since[index])
        return 0.0 if math.isnan(since) else max(0.0, now - since)

    def persistently_idle(self, index: int, now: float, window_s: float) -> bool:
        """At zero for at least ``window_s`` (a worker never reported is not idle: unknown)."""
        since = float(self._idle_since[index])
        return not math.isnan(since) and now - since >= window_s

    def idle_among(self, indices: npt.NDArray[np.int64], now: float, window_s: float) -> list[int]:
        """The workers of ``indices`` that are :meth:`persistently_idle`, in that order."""
        since = self._idle_since[indices]
        with np.errstate(invalid="ignore"):
            ok = now - since >= window_s  # nan (not idle) compares False
        out: list[int] = indices[ok].tolist()
        return out

    def vector(self, indices: Sequence[int], ids: Sequence[str]) -> dict[str, float]:
        """``{ids[i]: estimate of indices[i]}``: a region's queue vector to send."""
        return {w: float(self._tq[i]) for i, w in zip(indices, ids)}
