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


def _run(topo: object, reqs: list, skip: bool, **kw: object) -> tuple[dict, list, int]:  # type: ignore[type-arg]
    sim = Simulator(topo, reqs, "kvcompass", SimConfig(seed=3, skip_idle=skip, **kw))  # type: ignore[arg-type]
    summary = sim.run()
    return summary_row(summary), [dataclasses.astuple(r) for r in summary.records], sim.events_processed


def test_nothing_is_skipped_while_a_request_is_in_flight(tmp_path: Path) -> None:
    """A long answer keeps the fleet busy through a quiet stretch of arrivals: every 10 ms tick
    of its decode runs (the skip starts only a minute after it ends), with the same figures."""
    path = tmp_path / "long.jsonl"
    rows = [
        {"timestamp": 0, "input_length": 1024, "output_length": 16_000, "hash_ids": [1, 2]},
        {"timestamp": 900_000, "input_length": 1024, "output_length": 4, "hash_ids": [1, 3]},
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    topo = load_topology("testbed-14x3")
    reqs = load_trace(path, 512, regions=topo, mode="trace", seed=3)
    skipped, ticked = _run(topo, reqs, True), _run(topo, reqs, False)
    assert skipped[:2] == ticked[:2]
    e2e = next(r for r in Simulator(topo, reqs, "kvcompass", SimConfig(seed=3)).run().records if r.id == 0).e2e_ms
    assert e2e > 2 * IDLE_SETTLE_MS  # the answer outlasts the settling time twice over
    assert skipped[2] > e2e / 10  # ... and each of its ticks ran
    assert skipped[2] < ticked[2] - (900_000 - e2e - IDLE_SETTLE_MS - IDLE_RESUME_MS) / 10 * 0.9  # the quiet after it was skipped


def test_a_lone_region_skips_too(tmp_path: Path) -> None:
    """A single-region fleet's edge broadcasts to nobody, so no phase holds the skip back
    (found in review: it never skipped)."""
    from kvcompass.discovery.topology import topology_from_dict

    topo = topology_from_dict({"rtt_ms": {"us": {"us": 2.0}}, "regions": {"us": {}}, "workers": [{"region": "us", "count": 3, "id_prefix": "us-"}]})
    reqs = load_trace(_gappy_trace(tmp_path), 512, regions=topo, mode="trace", seed=3)
    skipped, ticked = _run(topo, reqs, True), _run(topo, reqs, False)
    assert skipped[:2] == ticked[:2] and skipped[2] < ticked[2] / 2


def test_wan_jitter_skips_nothing(tmp_path: Path) -> None:
    """With WAN jitter every broadcast draws its way from the stream the requests draw theirs
    from: nothing is skipped and the figures are the unskipped run's (found in review: they
    differed)."""
    topo = load_topology("testbed-14x3")
    reqs = load_trace(_gappy_trace(tmp_path), 512, regions=topo, mode="trace", seed=3)
    jittered, ticked = _run(topo, reqs, True, wan_jitter=0.3), _run(topo, reqs, False, wan_jitter=0.3)
    assert jittered == ticked
