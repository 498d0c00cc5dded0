"""Prometheus counters, gauges and histograms for the per-request paths of one event loop: an
update is plain attribute arithmetic, and the samples are built only when someone scrapes.

Why not prometheus_client's own classes there: each of their children guards its value with a
``threading.Lock`` and each ``labels()``/``observe()`` call validates its arguments, and the
door updates about ten metrics a proxied request. py-spy on the door under ``bench_door.py``'s
load put those calls at about 6 % of its CPU. A door (and an emulated worker) is one asyncio
thread, so the lock buys nothing. The exposition stays prometheus_client's: each metric here is
a collector in a ``CollectorRegistry`` and yields the samples its native twin would (``_total``
and ``_created`` for a counter; ``_bucket``/``_count``/``_sum``/``_created`` for a histogram),
so ``generate_latest``, ``get_sample_value`` and every dashboard read them unchanged.

Not thread-safe by design: update them from the loop's thread only (a value updated from two
threads at once could lose an increment). The plane's services, which apply batches in worker
threads, keep prometheus_client's classes (:mod:`kvcompass.services.metrics`).
"""

from __future__ import annotations

import abc
import math
import re
import time
from bisect import bisect_left
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Generic, TypeVar

import prometheus_client.metrics as _native
from prometheus_client import CollectorRegistry
from prometheus_client.core import Metric
from prometheus_client.utils import floatToGoString

__all__ = ["Counter", "Gauge", "Histogram"]

_NAME = re.compile(r"^[a-zA-Z_:][a-zA-Z0-9_:]*$")
_LABEL = re.compile(r"^[a-zA-Z_][a-zA-Z0-9_]*$")
# prometheus_client's default histogram buckets.
DEFAULT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, math.inf)


def _with_created() -> bool:
    """Whether ``_created`` samples are exposed: prometheus_client's own switch
    (``PROMETHEUS_DISABLE_CREATED_SERIES``, ``disable_created_metrics()``), read at each scrape."""
    return bool(getattr(_native, "_use_created", True))


class _CounterChild:
    __slots__ = ("value", "created")

    def __init__(self) -> None:
        self.value = 0.0
        self.created = time.time()

    def inc(self, amount: float = 1) -> None:
        if amount < 0:
            raise ValueError(f"counters can only be incremented by non-negative amounts, got {amount}")
        self.value += amount


class _GaugeChild:
    __slots__ = ("value", "fn")

    def __init__(self) -> None:
        self.value = 0.0
        self.fn: Callable[[], float] | None = None

    def inc(self, amount: float = 1) -> None:
        self.value += amount

    def dec(self, amount: float = 1) -> None:
        self.value -= amount

    def set(self, value: float) -> None:
        self.value = float(value)

    def set_function(self, fn: Callable[[], float]) -> None:
        """Read ``fn()`` at every scrape instead of a stored value."""
        self.fn = fn

    def get(self) -> float:
        return float(self.fn()) if self.fn is not None else self.value


class _HistogramChild:
    __slots__ = ("bounds", "counts", "sum", "created")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * len(bounds)
        self.sum = 0.0
        self.created = time.time()

    def observe(self, amount: float) -> None:
        # The first bucket whose upper bound is >= amount (``le`` is inclusive); the last is +Inf.
        self.counts[bisect_left(self.bounds, amount)] += 1
        self.sum += amount


C = TypeVar("C", _CounterChild, _GaugeChild, _HistogramChild)


class _Family(abc.ABC, Generic[C]):
    """A metric and its children by label values, registered in ``registry`` as a collector."""

    _type = ""

    def __init__(self, name: str, documentation: str, labelnames: Sequence[str] = (), *, registry: CollectorRegistry) -> None:
        if not _NAME.match(name):
            raise ValueError(f"invalid metric name {name!r}")
        for ln in labelnames:
            if not _LABEL.match(ln) or ln.startswith("__"):
                raise ValueError(f"invalid label name {ln!r} of metric {name!r}")
        self._name = name
        self._doc = documentation
        self._labelnames = tuple(labelnames)
        # Children by their label values as strings, in creation order. An unlabelled metric's
        # one child is not in it, so labels() on it finds nothing and says so.
        self._children: dict[tuple[str, ...], C] = {}
        self._only: C | None = None
        if not self._labelnames:
            self._only = self._new()
        registry.register(self)

    @abc.abstractmethod
    def _new(self) -> C:
        """A fresh child (its value zero)."""

    def labels(self, *values: Any, **named: Any) -> C:
        """The child for these label values (positional in the metric's label order, or all by
        name; converted with ``str`` as prometheus_client does, so ``labels(200)`` and
        ``labels("200")`` are one series), made on first use and the same object after."""
        if not named:
            c = self._children.get(values)  # a hit only for values given as strings
            if c is not None:
                return c
        if not self._labelnames:
            raise ValueError(f"metric {self._name!r} has no labels")
        if named:
            if values or set(named) != set(self._labelnames):
                raise ValueError(f"metric {self._name!r} takes the labels {list(self._labelnames)}, got {sorted(named)}")
            values = tuple(named[n] for n in self._labelnames)
        if len(values) != len(self._labelnames):
            raise ValueError(f"metric {self._name!r} takes {len(self._labelnames)} label values, got {len(values)}")
        key = tuple(str(v) for v in values)
        c = self._children.get(key)
        if c is None:
            c = self._children[key] = self._new()
        return c

    def clear(self) -> None:
        """Drop every child of a labelled metric (prometheus_client's ``clear``): for a gauge
        whose series exist only while a condition holds."""
        self._children.clear()

    def _one(self) -> C:
        """The child of an unlabelled metric (ValueError for a labelled one, as prometheus_client)."""
        c = self._only
        if c is None:
            raise ValueError(f"metric {self._name!r} has labels {list(self._labelnames)}: update a child from labels()")
        return c

    @abc.abstractmethod
    def _samples(self, m: Metric, labels: dict[str, str], c: C) -> None:
        """Add child ``c``'s samples under ``labels`` to ``m``."""

    def _family(self) -> Metric:
        return Metric(self._name, self._doc, self._type)

    def describe(self) -> list[Metric]:
        return [self._family()]

    def collect(self) -> Iterator[Metric]:
        m = self._family()
        if self._only is not None:
            self._samples(m, {}, self._only)
        for key, c in self._children.items():
            self._samples(m, dict(zip(self._labelnames, key)), c)
        yield m


class Counter(_Family[_CounterChild]):
    """A monotonically increasing count, exposed as ``<name>_total`` (``_total`` in ``name`` is
    dropped, as prometheus_client does)."""

    _type = "counter"

    def __init__(self, name: str, documentation: str, labelnames: Sequence[str] = (), *, registry: CollectorRegistry) -> None:
        super().__init__(name.removesuffix("_total"), documentation, labelnames, registry=registry)

    def _new(self) -> _CounterChild:
        return _CounterChild()

    def inc(self, amount: float = 1) -> None:
        self._one().inc(amount)

    def _samples(self, m: Metric, labels: dict[str, str], c: _CounterChild) -> None:
        m.add_sample(self._name + "_total", labels, c.value)
        if _with_created():
            m.add_sample(self._name + "_created", labels, c.created)


class Gauge(_Family[_GaugeChild]):
    """A value that goes up and down, or is read from a function at each scrape."""

    _type = "gauge"

    def _new(self) -> _GaugeChild:
        return _GaugeChild()

    def inc(self, amount: float = 1) -> None:
        self._one().value += amount

    def dec(self, amount: float = 1) -> None:
        self._one().value -= amount

    def set(self, value: float) -> None:
        self._one().set(value)

    def set_function(self, fn: Callable[[], float]) -> None:
        self._one().set_function(fn)

    def _samples(self, m: Metric, labels: dict[str, str], c: _GaugeChild) -> None:
        m.add_sample(self._name, labels, c.get())


class Histogram(_Family[_HistogramChild]):
    """Observations counted in cumulative buckets (``le`` inclusive, +Inf added when missing)."""

    _type = "histogram"

    def __init__(
        self, name: str, documentation: str, labelnames: Sequence[str] = (), *, buckets: Sequence[float] = DEFAULT_BUCKETS, registry: CollectorRegistry
    ) -> None:
        bounds = [float(b) for b in buckets]
        if bounds and bounds[-1] != math.inf:
            bounds.append(math.inf)
        if len(bounds) < 2 or any(a >= b for a, b in zip(bounds, bounds[1:])):
            raise ValueError(f"histogram {name!r} needs at least one bucket before +Inf, in increasing order: {list(buckets)}")
        if "le" in labelnames:
            raise ValueError(f"histogram {name!r} may not have a label named 'le'")
        self._bounds = tuple(bounds)
        super().__init__(name, documentation, labelnames, registry=registry)

    def _new(self) -> _HistogramChild:
        return _HistogramChild(self._bounds)

    def observe(self, amount: float) -> None:
        self._one().observe(amount)

    def _samples(self, m: Metric, labels: dict[str, str], c: _HistogramChild) -> None:
        acc = 0
        for bound, n in zip(c.bounds, c.counts):
            acc += n
            m.add_sample(self._name + "_bucket", {**labels, "le": floatToGoString(bound)}, acc)
        m.add_sample(self._name + "_count", labels, acc)
        m.add_sample(self._name + "_sum", labels, c.sum)
        if _with_created():
            m.add_sample(self._name + "_created", labels, c.created)
