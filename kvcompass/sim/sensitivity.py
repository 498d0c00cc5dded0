"""The paper's robustness tables for one deployment: sensitivity to WAN jitter and to patch loss
and delay (paper table 4), and the two false-hit rates (paper table 5).

Table 4 reruns KVCompass on one workload with one fault knob turned at a time (see
:class:`~kvcompass.sim.engine.SimConfig`: ``wan_jitter``, ``patch_loss``, ``patch_delay_ms``)
and reports P99 TTFT and the hit rate beside the fault-free base. Unlike the paper's
prototype, our edges repair every lost batch (gap or heartbeat, then a replay from the unit's
log), so loss costs a round of staleness, not the entry.

Table 5 sets two different rates side by side, as the paper does: the **structural** rate, how
often a never-inserted key returns a locator from a view at 95 % table load (what the keyless
table itself gives, with and without fingerprints), and the **end-to-end** false-lookup rate,
how often a real request's chosen worker reused less than the edge claimed (the simulation's
``false_hit_rate``; closure checks, fingerprints and beliefs all stand between the two).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from kvcompass import _core
from kvcompass.sim.summary import Summary

__all__ = ["DEFAULT_SWEEPS", "SensitivityRow", "StructuralRate", "structural_false_hit_rate", "sweep"]

# The paper's table 4 columns: jitter +-%, loss %, extra delay ms.
DEFAULT_SWEEPS: dict[str, tuple[float, ...]] = {
    "wan_jitter_pct": (0.0, 25.0, 50.0, 100.0),
    "patch_loss_pct": (0.0, 10.0, 20.0, 30.0),
    "patch_delay_ms": (0.0, 100.0, 200.0, 300.0),
}


@dataclass(frozen=True, slots=True)
class SensitivityRow:
    knob: str
    value: float
    ttft_p99_ms: float
    hit_rate: float
    false_hit_rate: float

    def as_dict(self) -> dict[str, float | str]:
        return {"knob": self.knob, "value": self.value, "ttft_p99_ms": self.ttft_p99_ms, "hit_rate": self.hit_rate, "false_hit_rate": self.false_hit_rate}


def _config_kwargs(knob: str, value: float) -> dict[str, float]:
    if knob == "wan_jitter_pct":
        return {"wan_jitter": value / 100.0}
    if knob == "patch_loss_pct":
        return {"patch_loss": value / 100.0}
    if knob == "patch_delay_ms":
        return {"patch_delay_ms": value}
    raise ValueError(f"unknown sensitivity knob {knob!r} (known: {', '.join(DEFAULT_SWEEPS)})")


def sweep(run: Callable[..., Summary], sweeps: dict[str, Sequence[float]] | None = None, base: Summary | None = None) -> list[SensitivityRow]:
    """One row per (knob, value): ``run(**config)`` with that knob set (``wan_jitter``,
    ``patch_loss`` or ``patch_delay_ms`` keyword), every other knob at 0. A zero value reuses
    ``base`` (the fault-free run) when given, so the base is simulated once."""
    rows: list[SensitivityRow] = []
    for knob, values in (sweeps or DEFAULT_SWEEPS).items():
        for v in values:
            s = base if v == 0 and base is not None else run(**_config_kwargs(knob, float(v)))
            base = base if base is not None or v != 0 else s
            rows.append(SensitivityRow(knob, float(v), s.ttft_ms[2], s.hit_rate, s.false_hit_rate))
    return rows


@dataclass(frozen=True, slots=True)
class StructuralRate:
    fp_bits: int
    load: float
    """Occupied share of the table's slots when probed."""
    entries: int
    probes: int
    rate: float


def structural_false_hit_rate(fp_bits: int, *, load: float = 0.95, entries: int = 1 << 16, probes: int = 200_000, seed: int = 0) -> StructuralRate:
    """Fill a table sized for ``entries`` (its capacity is 95 % of its slots) to ``load`` of its
    slots with random keys and nonzero values, then probe its keyless view with keys never
    inserted: the share that returns a locator (paper table 5 reads it by table load)."""
    if not 0 < load <= 0.95:
        raise ValueError(f"load must be in (0, 0.95], got {load}")
    rng = np.random.default_rng([seed, fp_bits])
    keys = np.unique(rng.integers(1, 1 << 63, size=entries + entries // 4, dtype=np.uint64))
    rng.shuffle(keys)
    vals = rng.integers(1, 1 << 32, size=len(keys), dtype=np.uint64)
    empty = _core.LudoView(0, 0)
    empty.apply_batch(_core.LudoTable(capacity=entries, fp_bits=fp_bits, seed=seed).export_snapshot())
    geo0 = empty.geometry()
    slots = int(geo0["n_buckets"]) * 4 if geo0 else entries
    target = min(entries, int(round(load * slots)))
    table = _core.LudoTable.build(keys[:target], vals[:target], capacity=entries, fp_bits=fp_bits, seed=seed)
    i = target
    while len(table) < target and i < len(keys):
        table.insert(int(keys[i]), int(vals[i]))
        i += 1
    table.take_batch()
    view = _core.LudoView(table.table, table.shard)
    view.apply_batch(table.export_snapshot())
    present = set(keys[:i].tolist())
    fresh = rng.integers(1, 1 << 63, size=probes, dtype=np.uint64)
    fresh = fresh[[int(k) not in present for k in fresh.tolist()]]
    hits = int(np.count_nonzero(view.lookup_batch(fresh)))
    geo = view.geometry()
    load = len(table) / (int(geo["n_buckets"]) * 4) if geo else 0.0  # 4 slots per bucket
    return StructuralRate(fp_bits, load, len(table), len(fresh), hits / len(fresh) if len(fresh) else 0.0)
