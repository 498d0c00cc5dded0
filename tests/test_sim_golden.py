"""The simulator's results are pinned (``tests/data/sim_golden.json``, made by
``tests/fixtures/make_sim_golden.py`` from the Python engine before the engine moved to Rust):
every scheme, tenants, faults (WAN jitter, patch loss and delay), prefill-decode
disaggregation, the ``lanes`` GPU model and LFU must give the same records, float for float.
The engine's draws continue numpy's PCG64 stream, so even the runs with random faults match.

Model changes made since, on purpose, re-pin only what they change, from the Rust engine: the
``chord`` entry since Chord runs ceil(log2 N) virtual nodes per worker, the
``central-directory`` entries since its coordinator reads state that crossed the WAN, the
``planetserve`` entries since its balancer applies PlanetServe's load threshold (issue 14);
``random``, ``round-robin`` and ``sglang-cache-aware``, schemes added after the move, are pinned
from the Rust engine;
every other entry is still the Python engine's. Those entries replay follow-ups at their own
times (``follow_ups="on-time"``, as they were pinned); the ``*/follow-ups*`` entries, where
follow-ups wait for their parents' answers (the default since the twenty-sixth session), are
pinned from the Rust engine. Every entry but the ``*/kv-pool*`` ones gives each worker all of its
VRAM for its cache beside any number of running sequences (``kv_pool="unbounded"``, as they were
pinned); the ``*/kv-pool*`` entries, where sequences and cache share one KV pool (the default
since the twenty-seventh session), are pinned from the Rust engine (``kv-pool-disaggregated``
again since decode instances are bounded by their pools, twenty-ninth session). The
``*hot-preamble*`` entries (prompts of exactly 4,096 tokens, a plan length, all cached) are
re-pinned since a prompt never reuses its last token, as vLLM schedules it, and KVCompass's
edges claim no more than that (thirty-second session)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

from kvcompass.sim.engine import simulate

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "fixtures"))
sys.path.insert(0, str(HERE))

from make_sim_golden import cases, figures, topology, workload  # noqa: E402

GOLDEN: dict[str, Any] = json.loads((HERE / "data" / "sim_golden.json").read_text())


@pytest.mark.parametrize("case", cases(), ids=[c[0] for c in cases()])
def test_the_engine_reproduces_the_pinned_runs(case: tuple[str, str, str, dict[str, Any]]) -> None:
    name, topo_name, wl, kw = case
    topo = topology(topo_name)
    got = figures(simulate(topo, workload(wl, topo), **kw))
    assert got == GOLDEN[name]
