"""``run_cells``: a process that runs cells one after another holds at most one run's memory."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvcompass.discovery.topology import load_topology
from kvcompass.sim.cells import _give_back_memory, run_cells
from kvcompass.sim.workload import synthetic_mixed

STATUS = Path("/proc/self/status")


def _kib(field: str) -> int:
    return int(next(line.split()[1] for line in STATUS.read_text().splitlines() if line.startswith(field)))


@pytest.mark.skipif(not STATUS.exists(), reason="reads the process's memory from /proc")
def test_a_finished_cell_gives_its_memory_back() -> None:
    # Without the trim, glibc kept every freed page of the run (all of its peak over the
    # starting size stayed resident); a grid's worker then carried one run's leftovers into the
    # next and was killed out of memory at 13 GiB.
    topo = load_topology("paper-64x8")
    req = synthetic_mixed(3000, regions=topo, seed=1, rate=150.0, block_size=topo.block_size, tenants=50, private_pools=True)
    _give_back_memory()  # what earlier tests left, so that this run's pages are new ones
    Path("/proc/self/clear_refs").write_text("5")  # the peak (VmHWM) restarts from now
    before = _kib("VmRSS")
    out = run_cells(topo, {"150": req}, [("150", "kvcompass")], {"seed": 1}, jobs=1)
    after, peak = _kib("VmRSS"), _kib("VmHWM")
    assert out["kvcompass"]["150"].requests == 3000
    assert peak - before > 50_000, (before, peak)  # the run did use memory (tens of MiB)
    assert after - before < 0.3 * (peak - before), (before, after, peak)
