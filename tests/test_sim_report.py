"""``kvcompass.sim.report``: the summary frame carries each run's figures, the tables round-trip
through CSV and parquet, and every figure is drawn (non-empty PNG) from real run data."""

from __future__ import annotations

from pathlib import Path

import polars as pl
import pytest

from kvcompass.discovery.topology import Topology, load_topology
from kvcompass.sim.engine import simulate
from kvcompass.sim.summary import Summary
from kvcompass.sim.report import ABLATION_FIGURE, FIGURES, records_to_frame, summaries_to_frame, summary_row, write_figures, write_tables
from kvcompass.sim.workload import synthetic_mixed

KEYS = {"ttft_p50_ms", "ttft_p99_ms", "e2e_p50_ms", "e2e_p99_ms", "throughput_tok_s", "hit_rate", "xregion_hit_rate", "false_hit_rate", "peak_load_factor", "requests", "demoted_blocks", "evicted_blocks", "kv_waits", "sent_req_s", "sent_mid_req_s"}


@pytest.fixture(scope="module")
def testbed() -> Topology:
    return load_topology("testbed-14x3")


@pytest.fixture(scope="module")
def results(testbed: Topology) -> dict[str, dict[str, Summary]]:
    out: dict[str, dict[str, Summary]] = {"kvcompass": {}, "oracle": {}}
    for rate in ("4", "8"):
        reqs = synthetic_mixed(60, regions=testbed, seed=2, rate=float(rate), block_size=testbed.block_size)
        for scheme in out:
            out[scheme][rate] = simulate(testbed, reqs, scheme, seed=2)
    return out


def test_summary_row_has_exactly_the_schema(results: dict[str, dict[str, Summary]]) -> None:
    s = results["kvcompass"]["4"]
    row = summary_row(s)
    assert set(row) == KEYS
    assert row["ttft_p99_ms"] == s.ttft_ms[2] and row["e2e_p50_ms"] == s.e2e_ms[0]
    assert row["xregion_hit_rate"] == s.cross_region_hit_rate and row["requests"] == 60


def test_frame_has_one_row_per_run(results: dict[str, dict[str, Summary]]) -> None:
    f = summaries_to_frame(results)
    assert f.height == 4
    assert KEYS <= set(f.columns)
    assert f.get_column("scheme").to_list() == ["kvcompass", "kvcompass", "oracle", "oracle"]
    assert f.get_column("rate").to_list() == ["4", "8", "4", "8"]
    row = f.filter((pl.col("scheme") == "oracle") & (pl.col("rate") == "8")).row(0, named=True)
    s = results["oracle"]["8"]
    assert row["ttft_p99_ms"] == s.ttft_ms[2] and row["peak_load_factor"] == s.peak_load_factor
    assert row["reused_tokens"] + row["recomputed_tokens"] == sum(r.input_tokens for r in s.records)
    assert summaries_to_frame({}).height == 0


def test_tables_round_trip(results: dict[str, dict[str, Summary]], tmp_path: Path) -> None:
    f, recs = summaries_to_frame(results), records_to_frame(results)
    assert recs.height == 4 * 60
    paths = write_tables(tmp_path, f, recs)
    assert {p.name for p in paths} == {"summary.csv", "summary.parquet", "requests.csv", "requests.parquet"}
    assert pl.read_parquet(tmp_path / "summary.parquet").equals(f)
    assert pl.read_parquet(tmp_path / "requests.parquet").equals(recs)
    assert pl.read_csv(tmp_path / "summary.csv").height == 4
    back = pl.read_csv(tmp_path / "requests.csv")
    assert back.get_column("ttft_ms").to_list() == recs.get_column("ttft_ms").to_list()


def test_figures_are_drawn(results: dict[str, dict[str, Summary]], tmp_path: Path) -> None:
    paths = write_figures(tmp_path / "figs", results)
    assert [p.name for p in paths] == list(FIGURES)
    for p in paths:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size > 1000
    with pytest.raises(ValueError):
        write_figures(tmp_path, {})


def test_the_ablation_figure_is_drawn_when_ablations_ran(results: dict[str, dict[str, Summary]], testbed: Topology, tmp_path: Path) -> None:
    reqs = synthetic_mixed(60, regions=testbed, seed=2, rate=8.0, block_size=testbed.block_size)
    with_ablation = {**results, "kvcompass-no-xregion": {"8": simulate(testbed, reqs, "kvcompass-no-xregion", seed=2)}}
    paths = write_figures(tmp_path, with_ablation)
    assert [p.name for p in paths] == [*FIGURES, ABLATION_FIGURE]
    assert paths[-1].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and paths[-1].stat().st_size > 1000
    # Without full KVCompass there is nothing to compare an ablation to.
    only = {"kvcompass-no-xregion": with_ablation["kvcompass-no-xregion"], "oracle": results["oracle"]}
    assert [p.name for p in write_figures(tmp_path / "b", only)] == list(FIGURES)
