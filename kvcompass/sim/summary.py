"""What a simulation run measured: one record per request and the run's summary.

Definitions (all times in virtual ms):

* **TTFT**: arrival at the edge to the first token back at the edge (forward WAN, queueing,
  reload and prefill, return WAN). **E2E**: arrival to the last token back at the edge.
* **reused** prompt tokens: the worker's cache hit at prefill start (VRAM head + DRAM tail);
  **recomputed**: the rest of the prompt. The **hit rate** is token-weighted, reused over all
  prompt tokens (vLLM's prefix-cache hit rate): a per-request "reused anything" rate reads
  about 1 for every scheme on the Mooncake traces, whose first block nearly every request
  shares. **Local** hit rate counts the tokens reused by workers in the request's own region,
  **cross-region** the rest; the two add up to the hit rate.
* **false hit**: the scheme claimed more than the worker reused (``claimed > reused``); the
  rate is over requests with a claim (``claimed > 0``).
* **utilisation** of a worker in a window: the fraction of the window it spent computing
  prompts (prefill chunks and DRAM reload; the decode tokens of a step are not counted, and a
  prompt's chunks are laid end to end from its first one, see :mod:`kvcompass.sim.engine`).
* **load factor** of a worker in a window: its utilisation over the fleet's mean utilisation
  in that window (1 = its fair share; 0 in windows where the whole fleet idles); the heatmap.
  The **peak load factor** follows the paper (section 5.3, figure 14): each worker's compute
  time over the run divided by the mean over all workers, the largest of those (the hottest
  worker's time-averaged load factor; 1 = perfect balance, ``W`` at most). A per-window
  maximum is no measure of a router: at light load any window in which one request runs
  reads ``W``.
* **throughput**: prompt plus generated tokens over the makespan (first arrival to last
  completion), per second.

Plain numpy: percentiles use numpy's default (linear) interpolation.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, overload

import numpy as np
import numpy.typing as npt

from kvcompass import _core
from kvcompass.errors import InvalidArgumentError

__all__ = ["RecordTable", "RequestRecord", "Summary", "busy_matrix", "mid_rate", "summarize"]


@dataclass(frozen=True, slots=True)
class RequestRecord:
    """One completed request."""

    id: int
    region: str
    worker: str
    worker_region: str
    arrival_ms: float
    ttft_ms: float
    e2e_ms: float
    queue_ms: float  # arrival at the worker to prefill start
    input_tokens: int
    output_tokens: int
    vram_hit: int
    dram_hit: int
    claimed: int

    @property
    def reused(self) -> int:
        return self.vram_hit + self.dram_hit

    @property
    def recomputed(self) -> int:
        return self.input_tokens - self.reused

    @property
    def false_hit(self) -> bool:
        return self.claimed > self.reused


_INT_COLUMNS = ("id", "input_tokens", "output_tokens", "vram_hit", "dram_hit", "claimed")
_FLOAT_COLUMNS = ("arrival_ms", "ttft_ms", "e2e_ms", "queue_ms")


class RecordTable(Sequence[RequestRecord]):
    """A run's records as columns, sorted by request id: a sequence of :class:`RequestRecord`
    made on access. A paper-scale run completes hundreds of thousands of requests, and one
    Python object per record was hundreds of megabytes; the columns are about 100 bytes a
    request. Regions and workers are codes into ``names``."""

    __slots__ = ("_c", "_names")

    def __init__(self, columns: dict[str, npt.NDArray[Any]], names: Sequence[str]) -> None:
        n = len(columns["id"])
        for k in (*_INT_COLUMNS, *_FLOAT_COLUMNS, "region", "worker", "worker_region"):
            if len(columns[k]) != n:
                raise ValueError(f"record column {k!r} has {len(columns[k])} rows, not {n}")
        order = np.argsort(columns["id"], kind="stable")
        self._c = {k: np.ascontiguousarray(v[order]) for k, v in columns.items()}
        self._names = tuple(names)

    @classmethod
    def from_records(cls, records: Sequence[RequestRecord]) -> RecordTable:
        names: dict[str, int] = {}

        def code(x: str) -> int:
            return names.setdefault(x, len(names))
        cols: dict[str, npt.NDArray[Any]] = {k: np.array([getattr(r, k) for r in records], dtype=np.int64) for k in _INT_COLUMNS}
        cols.update({k: np.array([getattr(r, k) for r in records], dtype=np.float64) for k in _FLOAT_COLUMNS})
        for k in ("region", "worker", "worker_region"):
            cols[k] = np.array([code(getattr(r, k)) for r in records], dtype=np.int32)
        return cls(cols, list(names))

    def column(self, name: str) -> npt.NDArray[Any]:
        """One column (read-only view); region and worker columns are codes (see :meth:`name`)."""
        v = self._c[name].view()
        v.flags.writeable = False
        return v

    def name(self, code: int) -> str:
        return self._names[code]

    @property
    def names(self) -> tuple[str, ...]:
        """What the region and worker codes stand for."""
        return self._names

    def __eq__(self, other: object) -> bool:
        """Equal to any sequence of the same records in the same order (a tuple of them too)."""
        if not isinstance(other, Sequence) or isinstance(other, (str, bytes)):
            return NotImplemented
        return len(self) == len(other) and all(a == b for a, b in zip(self, other))

    __hash__ = None  # type: ignore[assignment]

    def __len__(self) -> int:
        return len(self._c["id"])

    def _row(self, i: int) -> RequestRecord:
        c, names = self._c, self._names
        return RequestRecord(
            int(c["id"][i]), names[c["region"][i]], names[c["worker"][i]], names[c["worker_region"][i]],
            float(c["arrival_ms"][i]), float(c["ttft_ms"][i]), float(c["e2e_ms"][i]), float(c["queue_ms"][i]),
            int(c["input_tokens"][i]), int(c["output_tokens"][i]), int(c["vram_hit"][i]), int(c["dram_hit"][i]), int(c["claimed"][i]),
        )  # fmt: skip

    @overload
    def __getitem__(self, i: int) -> RequestRecord: ...
    @overload
    def __getitem__(self, i: slice) -> list[RequestRecord]: ...
    def __getitem__(self, i: int | slice) -> RequestRecord | list[RequestRecord]:
        if isinstance(i, slice):
            return [self._row(j) for j in range(*i.indices(len(self)))]
        n = len(self)
        if not -n <= i < n:
            raise IndexError("record index out of range")
        return self._row(i % n if n else i)

    def __iter__(self) -> Iterator[RequestRecord]:
        return (self._row(i) for i in range(len(self)))


@dataclass(frozen=True, slots=True, eq=False)
class Summary:
    """A run's figures (see the module notes for each definition)."""

    scheme: str
    topology: str
    requests: int
    ttft_ms: tuple[float, float, float]  # P50, P90, P99
    e2e_ms: tuple[float, float, float]
    mean_ttft_ms: float
    mean_queue_ms: float
    throughput_tokens_s: float
    reused_tokens: int
    recomputed_tokens: int
    hit_rate: float
    local_hit_rate: float
    cross_region_hit_rate: float
    false_hit_rate: float
    window_ms: float
    workers: tuple[str, ...]
    utilisation: npt.NDArray[np.float64]  # workers x windows
    load_factor: npt.NDArray[np.float64]  # workers x windows
    peak_load_factor: float
    records: RecordTable
    demoted_blocks: int = 0
    """Blocks the run's caches moved from VRAM to DRAM to make room (cache churn)."""
    evicted_blocks: int = 0
    """Blocks the run's caches dropped (from DRAM, or from VRAM without DRAM)."""
    kv_waits: int = 0
    """Requests that waited for room in a KV pool (``kv_pool="shared"``): their prefill on its
    worker, or their hand-off on a decode instance; how often the fleet's batches filled VRAM."""
    drain_s: float = 0.0
    """From the last send to the last answer: when it outlasts the sends' own span, the run's
    throughput is mostly that tail (one long decode can set it; found on ShareGPT chat, a
    42,146-token reply)."""
    sent_req_s: float = 0.0
    """The rate the run actually sent, (requests - 1) over the first to the last send: below the
    rate it is keyed by when follow-ups wait for their parents' answers (they are sent later
    than drawn) or a closed loop throttles (found in review: a nominal 40 req/s sent 29.9)."""
    sent_mid_req_s: float = 0.0
    """The rate sent over the middle half of the sends (second to third quartile of the send
    times): the load the run's steady state carried. Late follow-ups trail on past the drawn
    schedule and pull :attr:`sent_req_s` down with their tail (found in review: an Oracle run
    keyed 278 req/s sent 119 over its whole span and 215 mid-run), so the comparison reads
    this one."""
    drawn_mid_req_s: float = 0.0
    """The same over the drawn schedule (the workload's arrival times; 0 in a closed loop, whose
    sends the completions pace): what ``sent_mid_req_s`` would be had every request been sent
    when drawn."""

    @property
    def token_reuse(self) -> float:
        """Reused share of all prompt tokens."""
        total = self.reused_tokens + self.recomputed_tokens
        return self.reused_tokens / total if total else 0.0


def busy_matrix(intervals: Sequence[Sequence[tuple[float, float]] | npt.NDArray[np.float64]], start_ms: float, end_ms: float, window_ms: float) -> npt.NDArray[np.float64]:
    """Busy fraction per (worker, window) from each worker's busy ``(begin, end)`` intervals;
    windows of ``window_ms`` tile ``[start_ms, end_ms)`` (the last one may be shorter and is
    normalised by its own length)."""
    return _busy(intervals, start_ms, end_ms, window_ms)[0]


MAX_WINDOWS = 10_000_000
"""The most utilisation windows a run's summary keeps a worker."""


def _busy(
    intervals: Sequence[Sequence[tuple[float, float]] | npt.NDArray[np.float64]], start_ms: float, end_ms: float, window_ms: float
) -> tuple[npt.NDArray[np.float64], npt.NDArray[np.float64]]:
    """:func:`busy_matrix` and each worker's total busy time, in one pass (the Rust core's
    ``busy_windows``: the sums interval by interval, window by window)."""
    if not window_ms > 0:
        raise ValueError(f"window_ms must be > 0, got {window_ms}")
    span = (end_ms - start_ms) / window_ms
    if not span <= MAX_WINDOWS:
        # A rate of 1e-300 req/s or a year of decode would ask for a matrix of that many
        # windows a worker (found in review: "Maximum allowed size exceeded").
        raise InvalidArgumentError(f"the run spans {(end_ms - start_ms) / 1e3:.3g} s of simulated time, {span:.3g} windows of {window_ms:g} ms: at most {MAX_WINDOWS:,} (raise the rate or the window)")
    n = max(1, int(np.ceil(span)))
    edges = np.asarray(start_ms + window_ms * np.arange(n + 1), dtype=np.float64)
    edges[-1] = max(end_ms, edges[-2] + 1e-9)
    width = np.diff(edges)
    flat = [np.ascontiguousarray(np.asarray(ivs, dtype=np.float64).reshape(-1)) for ivs in intervals]
    out, totals = _core.busy_windows(flat, float(start_ms), float(window_ms), edges)
    busy: npt.NDArray[np.float64] = np.clip(out / width, 0.0, 1.0)
    return busy, totals


def _pct(x: npt.NDArray[np.float64]) -> tuple[float, float, float]:
    if not len(x):
        return (0.0, 0.0, 0.0)
    p = np.percentile(x, [50, 90, 99])
    return (float(p[0]), float(p[1]), float(p[2]))


def _peak(totals: npt.NDArray[np.float64]) -> float:
    """The hottest worker's compute time over the fleet mean (module notes); 0 when idle."""
    mean = float(totals.mean()) if totals.size else 0.0
    return float(totals.max()) / mean if mean > 0 else 0.0


def mid_rate(sends_ms: npt.NDArray[np.float64]) -> float:
    """Requests per second sent between the first and third quartile of the send times (0 with
    fewer than 4 requests, or when they share one instant)."""
    n = len(sends_ms)
    if n < 4:
        return 0.0
    t = np.sort(sends_ms)
    lo, hi = n // 4, (3 * n) // 4
    span_s = (float(t[hi]) - float(t[lo])) / 1e3
    return (hi - lo) / span_s if span_s > 0 else 0.0


def summarize(
    scheme: str,
    topology: str,
    records: Sequence[RequestRecord],
    workers: Sequence[str],
    busy: Sequence[Sequence[tuple[float, float]] | npt.NDArray[np.float64]],
    *,
    window_ms: float = 1000.0,
) -> Summary:
    """The summary of a run from its records (objects or a :class:`RecordTable`) and each
    worker's prefill busy intervals."""
    recs = records if isinstance(records, RecordTable) else RecordTable.from_records(records)
    c = recs._c
    ttft, e2e, arrival = c["ttft_ms"], c["e2e_ms"], c["arrival_ms"]
    n = len(recs)
    reused_each = c["vram_hit"] + c["dram_hit"]
    reused = int(reused_each.sum())
    recomputed = int((c["input_tokens"] - reused_each).sum())
    prompt = int(c["input_tokens"].sum())
    claims = c["claimed"] > 0
    if n:
        start = float(arrival.min())
        end = float((arrival + e2e).max())
        sent_span_s = (float(arrival.max()) - start) / 1e3
    else:
        start = end = 0.0
        sent_span_s = 0.0
    span_s = (end - start) / 1e3
    tokens = int((c["input_tokens"] + c["output_tokens"]).sum())
    local = c["worker_region"] == c["region"]
    # With no request there is no span to tile; the totals (for the peak load factor) still
    # come from the intervals, over one window.
    util, totals = _busy(busy, start, end if n else start + window_ms, window_ms)
    if not n:
        util = np.zeros((len(workers), 0))
    mean = util.mean(axis=0) if len(workers) else np.zeros(util.shape[1])
    lf = np.divide(util, mean, out=np.zeros_like(util), where=mean > 0)
    return Summary(
        scheme=scheme,
        topology=topology,
        requests=n,
        ttft_ms=_pct(ttft),
        e2e_ms=_pct(e2e),
        mean_ttft_ms=float(ttft.mean()) if n else 0.0,
        mean_queue_ms=float(np.mean(c["queue_ms"])) if n else 0.0,
        throughput_tokens_s=tokens / span_s if span_s > 0 else 0.0,
        reused_tokens=reused,
        recomputed_tokens=recomputed,
        hit_rate=reused / prompt if prompt else 0.0,
        local_hit_rate=int(reused_each[local].sum()) / prompt if prompt else 0.0,
        cross_region_hit_rate=int(reused_each[~local].sum()) / prompt if prompt else 0.0,
        false_hit_rate=int((c["claimed"][claims] > reused_each[claims]).sum()) / int(claims.sum()) if claims.any() else 0.0,
        window_ms=window_ms,
        workers=tuple(workers),
        utilisation=util,
        load_factor=lf,
        peak_load_factor=_peak(totals),
        records=recs,
        sent_req_s=(n - 1) / sent_span_s if sent_span_s > 0 else 0.0,
        sent_mid_req_s=mid_rate(arrival),
        drain_s=(end - float(arrival.max())) / 1e3 if n else 0.0,
    )
