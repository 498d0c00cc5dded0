"""A quiet fleet is not ticked through: once nothing has been in flight for ``IDLE_SETTLE_MS``
the simulator skips, by whole broadcast periods, to ``IDLE_RESUME_MS`` before the next arrival
(found in review: KVCompass runs took minutes per idle day of a replayed log, 10 ms of
simulated time a tick). The skipped and the unskipped run must print the same figures."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from kvcompass.discovery.topology import load_topology
from kvcompass.sim.engine import IDLE_RESUME_MS, IDLE_SETTLE_MS, SimConfig, Simulator
from kvcompass.sim.report import summary_row
from kvcompass.sim.workload import load_trace

EXCERPT = Path(__file__).resolve().parent / "data" / "conversation_excerpt.jsonl"


def _gappy_trace(tmp_path: Path) -> Path:
    """Three bursts of the excerpt's conversations, ten and twenty-five minutes apart, the
    later bursts sharing the earlier ones' prefixes (so the caches and the index matter)."""
    lines = [json.loads(line) for line in EXCERPT.read_text().splitlines()[:60]]
    out = []
    for i, obj in enumerate(lines):
        shift = 0 if i < 20 else 600_000 if i < 40 else 1_500_000
        out.append({**obj, "timestamp": obj["timestamp"] % 20_000 + shift})
    out.sort(key=lambda o: o["timestamp"])
    path = tmp_path / "gappy.jsonl"
    path.write_text("".join(json.dumps(o) + "\n" for o in out))
    return path


@pytest.mark.parametrize("scheme", ["kvcompass", "kvcompass-no-load"])
def test_a_skipped_idle_stretch_changes_no_figure(tmp_path: Path, scheme: str) -> None:
    topo = load_topology("testbed-14x3")
    reqs = load_trace(_gappy_trace(tmp_path), 512, regions=topo, mode="trace", seed=3)
    runs = {}
    for skip in (True, False):
        sim = Simulator(topo, reqs, scheme, SimConfig(seed=3, skip_idle=skip))
        summary = sim.run()
        runs[skip] = (summary_row(summary), [dataclasses.astuple(r) for r in summary.records], sim.events_processed)
    (row, records, events), (row0, records0, events0) = runs[True], runs[False]
    assert row == row0 and records == records0
    # The two gaps of 9-10 and 14-15 minutes cost 61 s of ticks each, not all of them.
    span_ms = 1_500_000 + 20_000
    assert events0 > span_ms / 10  # every 10 ms tick of the unskipped run
    assert events < events0 - 2 * (540_000 - IDLE_SETTLE_MS - IDLE_RESUME_MS) / 10 * 0.9


def test_nothing_is_skipped_while_work_is_in_flight() -> None:
    """The engine says quiet only with nothing in flight: a run at load never skips, and
    with the switch off it ticks the same."""
    from kvcompass.sim.workload import synthetic_mixed

    topo = load_topology("testbed-14x3")
    reqs = synthetic_mixed(150, regions=topo, seed=2, rate=8.0, block_size=topo.block_size)
    rows = []
    for skip in (True, False):
        sim = Simulator(topo, reqs, "kvcompass", SimConfig(seed=2, skip_idle=skip))
        rows.append((summary_row(sim.run()), sim.events_processed))
    assert rows[0] == rows[1]
