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

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

__all__ = ["RequestRecord", "Summary", "busy_matrix", "summarize"]


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
    records: tuple[RequestRecord, ...]

    @property
    def token_reuse(self) -> float:
        """Reused share of all prompt tokens."""
        total = self.reused_tokens + self.recomputed_tokens
        return self.reused_tokens / total if total else 0.0


def busy_matrix(intervals: Sequence[Sequence[tuple[float, float]]], start_ms: float, end_ms: float, window_ms: float) -> npt.NDArray[np.float64]:
    """Busy fraction per (worker, window) from each worker's busy ``(begin, end)`` intervals;
    windows of ``window_ms`` tile ``[start_ms, end_ms)`` (the last one may be shorter and is
    normalised by its own length)."""
    if not window_ms > 0:
        raise ValueError(f"window_ms must be > 0, got {window_ms}")
    n = max(1, int(np.ceil((end_ms - start_ms) / window_ms)))
    edges = start_ms + window_ms * np.arange(n + 1)
    edges[-1] = max(end_ms, edges[-2] + 1e-9)
    width = np.diff(edges)
    out = np.zeros((len(intervals), n))
    for w, ivs in enumerate(intervals):
        for b, e in ivs:
            if e <= b:
                continue
            k0 = max(0, int((b - start_ms) // window_ms))
            k1 = min(n - 1, int((e - start_ms) // window_ms))
            for k in range(k0, k1 + 1):
                out[w, k] += max(0.0, min(e, edges[k + 1]) - max(b, edges[k]))
    busy: npt.NDArray[np.float64] = np.clip(out / width, 0.0, 1.0)
    return busy


def _pct(x: npt.NDArray[np.float64]) -> tuple[float, float, float]:
    if not len(x):
        return (0.0, 0.0, 0.0)
    p = np.percentile(x, [50, 90, 99])
    return (float(p[0]), float(p[1]), float(p[2]))


def _peak(busy: Sequence[Sequence[tuple[float, float]]]) -> float:
    """The hottest worker's compute time over the fleet mean (module notes); 0 when idle."""
    totals = np.array([sum(max(0.0, e - b) for b, e in ivs) for ivs in busy], dtype=np.float64)
    mean = float(totals.mean()) if totals.size else 0.0
    return float(totals.max()) / mean if mean > 0 else 0.0


def summarize(
    scheme: str,
    topology: str,
    records: Sequence[RequestRecord],
    workers: Sequence[str],
    busy: Sequence[Sequence[tuple[float, float]]],
    *,
    window_ms: float = 1000.0,
) -> Summary:
    """The summary of a run from its records and each worker's prefill busy intervals."""
    recs = tuple(sorted(records, key=lambda r: r.id))
    ttft = np.array([r.ttft_ms for r in recs], dtype=np.float64)
    e2e = np.array([r.e2e_ms for r in recs], dtype=np.float64)
    n = len(recs)
    reused = sum(r.reused for r in recs)
    recomputed = sum(r.recomputed for r in recs)
    hits = [r for r in recs if r.reused > 0]
    prompt = sum(r.input_tokens for r in recs)
    claims = [r for r in recs if r.claimed > 0]
    if recs:
        start = min(r.arrival_ms for r in recs)
        end = max(r.arrival_ms + r.e2e_ms for r in recs)
    else:
        start = end = 0.0
    span_s = (end - start) / 1e3
    tokens = sum(r.input_tokens + r.output_tokens for r in recs)
    util = busy_matrix(busy, start, end, window_ms) if recs else np.zeros((len(workers), 0))
    mean = util.mean(axis=0) if len(workers) else np.zeros(util.shape[1])
    lf = np.divide(util, mean, out=np.zeros_like(util), where=mean > 0)
    return Summary(
        scheme=scheme,
        topology=topology,
        requests=n,
        ttft_ms=_pct(ttft),
        e2e_ms=_pct(e2e),
        mean_ttft_ms=float(ttft.mean()) if n else 0.0,
        mean_queue_ms=float(np.mean([r.queue_ms for r in recs])) if n else 0.0,
        throughput_tokens_s=tokens / span_s if span_s > 0 else 0.0,
        reused_tokens=reused,
        recomputed_tokens=recomputed,
        hit_rate=reused / prompt if prompt else 0.0,
        local_hit_rate=sum(r.reused for r in hits if r.worker_region == r.region) / prompt if prompt else 0.0,
        cross_region_hit_rate=sum(r.reused for r in hits if r.worker_region != r.region) / prompt if prompt else 0.0,
        false_hit_rate=sum(r.false_hit for r in claims) / len(claims) if claims else 0.0,
        window_ms=window_ms,
        workers=tuple(workers),
        utilisation=util,
        load_factor=lf,
        peak_load_factor=_peak(busy),
        records=recs,
    )
