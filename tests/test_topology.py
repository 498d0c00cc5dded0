"""Topologies: the built-ins match the paper's deployments, loading from TOML and dicts works,
the RTT matrix is found and read correctly, and every mistake gets its own precise error.

Tests that do not need the measured matrix use an inline one or the bundled excerpt, so they
run the same with or without ``../shared/data``.
"""

from __future__ import annotations

import copy
import csv
import math
from pathlib import Path
from typing import Any

import pytest

from kvcompass.discovery import topology as topo_mod
from kvcompass.discovery.layout import WorkerSpec
from kvcompass.discovery.topology import (
    BUNDLED_RTT,
    RTT_FILE,
    RegionSpec,
    RttMatrix,
    Topology,
    builtin_topologies,
    find_rtt_matrix,
    load_rtt_matrix,
    load_topology,
    topology_from_dict,
    topology_from_toml,
)
from kvcompass.errors import TopologyError

SHARED_RTT = Path(__file__).resolve().parents[2] / "shared" / "data" / RTT_FILE

# Inline three-site matrix, deliberately asymmetric so direction mistakes show.
INLINE_RTT: dict[str, dict[str, float]] = {
    "a": {"a": 1.0, "b": 100.0, "c": 200.0},
    "b": {"a": 110.0, "b": 2.0, "c": 150.0},
    "c": {"a": 200.0, "b": 150.0, "c": 3.0},
}


def base() -> dict[str, Any]:
    """A small valid topology as a dict (fresh copy per call)."""
    return copy.deepcopy(
        {
            "name": "t",
            "rtt_ms": INLINE_RTT,
            "regions": {"a": {}, "b": {"edges": 2}},
            "workers": [
                {"id": "w1", "region": "a", "beta_ms_per_token": 0.1},
                {"id": "w2", "region": "a", "beta_ms_per_token": 0.1},
                {"id": "w3", "region": "b", "beta_ms_per_token": 0.05},
            ],
        }
    )


def error_of(data: dict[str, Any]) -> str:
    with pytest.raises(TopologyError) as e:
        topology_from_dict(data)
    return str(e.value)


# ------------------------------------------------------------------ built-ins


def counts(t: Topology) -> dict[str, int]:
    return {r: len(t.workers_in(r)) for r in t.region_names}


def test_builtin_names() -> None:
    assert set(builtin_topologies()) >= {"testbed-14x3", "paper-64x8", "paper-128x16", "testbed-pd-10x3"}


@pytest.mark.parametrize("name", ["testbed-14x3", "paper-64x8", "paper-128x16", "testbed-pd-10x3"])
def test_builtins_load_from_the_bundled_excerpt(name: str) -> None:
    # The excerpt must cover every AWS region a built-in uses, or a machine without
    # ../shared/data could not run them.
    t = load_topology(name, rtt_path=BUNDLED_RTT)
    assert t.name == name
    assert t.rtt.source == str(BUNDLED_RTT)
    assert all(r.edges == 1 for r in t.regions)


def test_testbed_14x3_is_the_paper_testbed() -> None:
    t = load_topology("testbed-14x3", rtt_path=BUNDLED_RTT)
    assert counts(t) == {"us": 8, "eu": 2, "asia": 4}
    assert [r.aws_region for r in t.regions] == ["us-east-1", "eu-central-1", "ap-northeast-1"]
    assert {w.beta_ms_per_token for w in t.workers} == {0.085}  # RTX 5090, paper section 5.2
    assert not t.disaggregated


def test_testbed_pd_has_7_prefill_and_3_decode() -> None:
    t = load_topology("testbed-pd-10x3", rtt_path=BUNDLED_RTT)
    roles = [w.role for w in t.workers]
    assert roles.count("prefill") == 7 and roles.count("decode") == 3 and len(t.regions) == 3
    assert t.disaggregated
    assert {w.id for w in t.indexed_workers} == {w.id for w in t.workers if w.role == "prefill"}
    # Every region keeps a decode instance: decode is drawn within the prefill's region.
    assert all(any(w.role == "decode" for w in t.workers_in(r)) for r in t.region_names)


def test_a_region_without_decode_instances_hands_off_to_the_nearest() -> None:
    d = base()
    d["workers"][0]["role"] = "prefill"
    d["workers"][1]["role"] = "decode"
    d["workers"][2]["role"] = "prefill"
    t = topology_from_dict(d)
    assert t.decode_region("a") == "a" and t.decode_region("b") == "a"
    with pytest.raises(TopologyError, match="no decode instance"):
        topology_from_dict(base()).decode_region("a")


def test_paper_64x8_matches_section_5_3() -> None:
    t = load_topology("paper-64x8", rtt_path=BUNDLED_RTT)
    c = counts(t)
    assert len(t.workers) == 64 and len(c) == 8
    assert (c["us"], c["china"], c["germany"]) == (30, 13, 8)
    assert all(2 <= c[r] <= 3 for r in ("japan", "singapore", "uk", "korea", "australia"))
    assert t.region("china").aws_region == "ap-east-1"
    assert "ap-east-1" in t.description and "China" in t.description
    assert t.value_bits == 64  # the 30-worker US region in one table, as in the paper


def test_paper_128x16_matches_appendix_a() -> None:
    t = load_topology("paper-128x16", rtt_path=BUNDLED_RTT)
    c = counts(t)
    assert len(t.workers) == 128 and len(c) == 16
    aws = {r.name: r.aws_region for r in t.regions}
    assert sorted([c["us-east"], c["us-west"]]) == [14, 26]
    assert {aws["us-east"], aws["us-west"]} == {"us-east-1", "us-west-2"}
    fixed = {"china": 12, "germany": 10, "ireland": 10, "japan": 8, "uk": 8}
    assert {r: c[r] for r in fixed} == fixed
    small = ("singapore", "korea", "india", "australia", "brazil", "canada", "italy", "bahrain", "south-africa")
    assert all(2 <= c[r] <= 7 for r in small)
    assert aws == {
        "us-east": "us-east-1", "us-west": "us-west-2", "china": "ap-east-1", "germany": "eu-central-1",
        "ireland": "eu-west-1", "japan": "ap-northeast-1", "uk": "eu-west-2", "singapore": "ap-southeast-1",
        "korea": "ap-northeast-2", "india": "ap-south-1", "australia": "ap-southeast-2", "brazil": "sa-east-1",
        "canada": "ca-central-1", "italy": "eu-south-1", "bahrain": "me-south-1", "south-africa": "af-south-1",
    }  # fmt: skip
    assert "ap-east-1" in t.description


def test_load_topology_prefers_builtin_names(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "testbed-14x3").write_text("this is not TOML [[[")
    monkeypatch.chdir(tmp_path)
    assert load_topology("testbed-14x3", rtt_path=BUNDLED_RTT).name == "testbed-14x3"


def test_load_topology_unknown_name_lists_builtins() -> None:
    with pytest.raises(TopologyError, match=r"'no-such' is neither a built-in topology \(.*testbed-14x3.*\) nor a file"):
        load_topology("no-such")


# ------------------------------------------------------------------ RTT matrix


def test_bundled_excerpt_is_square_and_symmetric() -> None:
    m = RttMatrix.from_csv(BUNDLED_RTT)
    assert len(m.labels) == 18
    # It exists so every built-in topology loads without ../shared/data: it covers them all.
    for name in builtin_topologies():
        t = load_topology(name, rtt_path=BUNDLED_RTT)
        assert {r.aws_region for r in t.regions if r.aws_region} <= set(m.labels), name
    for a in m.labels:
        for b in m.labels:
            assert m.rtt_ms(a, b) == m.rtt_ms(b, a)
    assert m.rtt_ms("us-east-1", "eu-central-1") == 92.905  # data README sample value


@pytest.mark.skipif(not SHARED_RTT.is_file(), reason="../shared/data is absent")
def test_bundled_excerpt_cells_equal_the_shared_file() -> None:
    def cells(p: Path) -> dict[tuple[str, str], str]:
        rows = list(csv.reader(p.read_text().splitlines()))
        return {(r[0], to): v for r in rows[1:] for to, v in zip(rows[0][1:], r[1:])}

    full, excerpt = cells(SHARED_RTT), cells(BUNDLED_RTT)
    assert excerpt and all(full[k] == v for k, v in excerpt.items())


def test_find_rtt_matrix_explicit_path_wins(tmp_path: Path) -> None:
    assert find_rtt_matrix(tmp_path / "x.csv") == tmp_path / "x.csv"


def test_find_rtt_matrix_uses_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / RTT_FILE).write_text(BUNDLED_RTT.read_text())
    monkeypatch.setenv("KVCOMPASS_DATA", str(tmp_path))
    assert find_rtt_matrix() == (tmp_path / RTT_FILE).resolve()


def test_find_rtt_matrix_uses_cwd_shared_data(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    data = tmp_path / "shared" / "data"
    data.mkdir(parents=True)
    (data / RTT_FILE).write_text(BUNDLED_RTT.read_text())
    (tmp_path / "repo").mkdir()
    monkeypatch.delenv("KVCOMPASS_DATA", raising=False)
    monkeypatch.chdir(tmp_path / "repo")
    assert find_rtt_matrix() == (data / RTT_FILE).resolve()


def test_find_rtt_matrix_falls_back_to_the_bundled_excerpt(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVCOMPASS_DATA", str(tmp_path / "missing"))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(topo_mod, "_PACKAGE", tmp_path / "a" / "b")  # no <repo>/../shared/data
    assert find_rtt_matrix() == BUNDLED_RTT


@pytest.mark.skipif(not SHARED_RTT.is_file(), reason="../shared/data is absent")
def test_load_rtt_matrix_reads_the_full_matrix() -> None:
    m = load_rtt_matrix(SHARED_RTT)
    assert len(m.labels) == 33 and "il-central-1" in m


def write_csv(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "rtt.csv"
    p.write_text(text)
    return p


GOOD_CSV = "region,x,y\nx,1,50\ny,50,2\n"


def test_matrix_csv_reads_directionally(tmp_path: Path) -> None:
    m = RttMatrix.from_csv(write_csv(tmp_path, "from\\to,x,y\nx,1,50\ny,60,2\n\n"))
    assert (m.rtt_ms("x", "y"), m.rtt_ms("y", "x"), m.rtt_ms("y", "y")) == (50.0, 60.0, 2.0)


def test_matrix_row_with_too_few_cells(tmp_path: Path) -> None:
    p = write_csv(tmp_path, "region,x,y\nx,1\ny,50,2\n")
    with pytest.raises(TopologyError, match=r"RTT matrix .*rtt\.csv: not square \(row 'x' has 1 cells, header has 2\)"):
        RttMatrix.from_csv(p)


def test_matrix_with_more_rows_than_columns(tmp_path: Path) -> None:
    p = write_csv(tmp_path, GOOD_CSV + "z,1,2\n")
    with pytest.raises(TopologyError, match=r"not square \(3 rows, header has 2 regions\)"):
        RttMatrix.from_csv(p)


def test_matrix_row_not_in_header(tmp_path: Path) -> None:
    with pytest.raises(TopologyError, match=r"row 'z' is not in the header"):
        RttMatrix.from_csv(write_csv(tmp_path, "region,x,y\nx,1,50\nz,50,2\n"))


def test_matrix_duplicate_row(tmp_path: Path) -> None:
    with pytest.raises(TopologyError, match=r"row 'x' appears twice"):
        RttMatrix.from_csv(write_csv(tmp_path, "region,x,y\nx,1,50\nx,50,2\n"))


def test_matrix_duplicate_header(tmp_path: Path) -> None:
    with pytest.raises(TopologyError, match=r"region 'x' appears twice in the header"):
        RttMatrix.from_csv(write_csv(tmp_path, "region,x,x\nx,1,50\nx,50,2\n"))


def test_matrix_cell_not_a_number(tmp_path: Path) -> None:
    with pytest.raises(TopologyError, match=r"row 'y', column 'x': 'fast' is not a number"):
        RttMatrix.from_csv(write_csv(tmp_path, "region,x,y\nx,1,50\ny,fast,2\n"))


def test_matrix_negative_cell(tmp_path: Path) -> None:
    with pytest.raises(TopologyError, match=r"row 'x', column 'y': RTT must be a finite number >= 0, got -5.0"):
        RttMatrix.from_csv(write_csv(tmp_path, "region,x,y\nx,1,-5\ny,50,2\n"))


def test_matrix_missing_file(tmp_path: Path) -> None:
    with pytest.raises(TopologyError, match=r"RTT matrix .*nope\.csv: no such file"):
        RttMatrix.from_csv(tmp_path / "nope.csv")


def test_matrix_empty_file(tmp_path: Path) -> None:
    with pytest.raises(TopologyError, match=r"rtt\.csv: empty"):
        RttMatrix.from_csv(write_csv(tmp_path, "\n"))


def test_inline_matrix_missing_cell() -> None:
    d = base()
    del d["rtt_ms"]["b"]["c"]
    assert "RTT matrix topology [rtt_ms]: not square (row 'b' has 2 cells, header has 3; missing 'c')" in error_of(d)


def test_inline_matrix_names_unknown_column() -> None:
    d = base()
    d["rtt_ms"]["a"]["z"] = 5.0
    assert "row 'a' names 'z', which has no row" in error_of(d)


def test_unknown_label_lookup() -> None:
    m = RttMatrix.from_mapping(INLINE_RTT)
    with pytest.raises(TopologyError, match=r"region 'z' is not in the matrix"):
        m.rtt_ms("a", "z")


# ------------------------------------------------------------------ loading


def test_dict_topology_defaults_and_accessors() -> None:
    t = topology_from_dict(base())
    assert (t.block_size, t.levels, t.own_region_min, t.value_bits, t.shards, t.fp_bits) == (16, 6, 256, 32, 4, 8)
    assert t.region_names == ("a", "b") and t.region("a").aws_region == "a" and t.region("b").edges == 2
    assert t.region_index("b") == 1
    assert [w.id for w in t.workers_in("a")] == ["w1", "w2"]
    assert t.rtt_ms("a", "b") == 100.0 and t.rtt_ms("b", "a") == 110.0  # direction kept
    with pytest.raises(TopologyError, match=r"region 'mars' is not defined"):
        t.region("mars")


def test_toml_file_with_counts_defaults_and_own_matrix(tmp_path: Path) -> None:
    (tmp_path / "m.csv").write_text("region,x-1,y-1\nx-1,1,40\ny-1,40,2\n")
    p = tmp_path / "fleet.toml"
    p.write_text(
        """
        description = "two sites"
        block_size = 32
        levels = 4
        shards = 2
        rtt_matrix = "m.csv"

        [regions]
        x = "x-1"
        y = { aws_region = "y-1", edges = 0 }

        [worker_defaults]
        beta_ms_per_token = 0.2
        vram_tokens = 1000
        role = "prefill"

        [[workers]]
        region = "x"
        count = 3
        endpoint = "10.0.0.{i}:7000"

        [[workers]]
        id = "solo"
        region = "y"
        role = "decode"
        beta_ms_per_token = 0.1
        dram_tokens = 5
        """
    )
    t = topology_from_toml(p)
    assert t.name == "fleet" and t.description == "two sites"
    assert (t.block_size, t.levels, t.shards) == (32, 4, 2)
    assert t.rtt.source == str(tmp_path / "m.csv")
    assert t.workers == (
        WorkerSpec("x-0", "x", "prefill", 0.2, 1000, None, "10.0.0.0:7000"),
        WorkerSpec("x-1", "x", "prefill", 0.2, 1000, None, "10.0.0.1:7000"),
        WorkerSpec("x-2", "x", "prefill", 0.2, 1000, None, "10.0.0.2:7000"),
        WorkerSpec("solo", "y", "decode", 0.1, 1000, 5, ""),
    )
    assert load_topology(p) == t


def test_rtt_path_argument_is_used_when_the_topology_has_no_matrix(tmp_path: Path) -> None:
    m = write_csv(tmp_path, "region,a,b\na,1,70\nb,70,1\n")
    d = base()
    del d["rtt_ms"]
    t = topology_from_dict(d, rtt_path=m)
    assert t.rtt.source == str(m) and t.rtt_ms("a", "b") == 70.0


def test_rtt_path_that_is_not_a_file_is_an_error_even_beside_an_own_matrix(tmp_path: Path) -> None:
    # The topology's own matrix wins, so a mistyped rtt_path was ignored in silence.
    for path, what in ((tmp_path / "nope.csv", "no such file"), (tmp_path, "not a file")):
        with pytest.raises(TopologyError) as info:
            topology_from_dict(base(), rtt_path=path)
        assert info.value.message == f"RTT matrix {path}: {what}"
    m = write_csv(tmp_path, "region,a,b\na,1,70\nb,70,1\n")
    assert topology_from_dict(base(), rtt_path=m).rtt.source == "topology [rtt_ms]"  # an existing one: the own matrix wins, as documented


def test_topology_from_code() -> None:
    t = Topology(
        name="code",
        regions=(RegionSpec("us-east-1"),),
        workers=(WorkerSpec("w", "us-east-1"),),
        rtt=RttMatrix.from_csv(BUNDLED_RTT),
    )
    assert t.region("us-east-1").aws_region == "us-east-1"  # a region may be named by its AWS code
    assert t.rtt_ms("us-east-1", "us-east-1") == 5.506  # the diagonal is the in-region RTT


# ------------------------------------------------------------------ one test per mistake


def test_worker_unknown_region() -> None:
    d = base()
    d["workers"][2]["region"] = "mars"
    assert error_of(d) == "worker 'w3': region 'mars' is not defined"


def test_duplicate_worker_id() -> None:
    d = base()
    d["workers"][1]["id"] = "w1"
    assert error_of(d) == "duplicate worker id 'w1'"


def test_duplicate_worker_id_from_count() -> None:
    d = base()
    d["workers"] = [{"region": "a", "count": 2}, {"region": "a", "count": 1}]
    assert error_of(d) == "duplicate worker id 'a-0'"


def test_negative_beta() -> None:
    d = base()
    d["workers"][1]["beta_ms_per_token"] = -1
    assert error_of(d) == "worker 'w2': beta_ms_per_token must be > 0, got -1.0"


def test_zero_beta() -> None:
    d = base()
    d["workers"][1]["beta_ms_per_token"] = 0
    assert error_of(d) == "worker 'w2': beta_ms_per_token must be > 0, got 0.0"


def test_nan_beta() -> None:
    d = base()
    d["workers"][1]["beta_ms_per_token"] = math.nan
    assert error_of(d) == "worker 'w2': beta_ms_per_token must be > 0, got nan"


def test_beta_not_a_number() -> None:
    d = base()
    d["workers"][0]["beta_ms_per_token"] = "fast"
    assert error_of(d) == "workers[0]: beta_ms_per_token must be a number, got 'fast'"


def test_negative_vram() -> None:
    d = base()
    d["workers"][0]["vram_tokens"] = -5
    assert error_of(d) == "worker 'w1': vram_tokens must be an integer >= 16 (one block of block_size tokens; a worker's cache cannot go without VRAM: leave it out for the default), got -5"


@pytest.mark.parametrize("vram", [0, 15])
def test_vram_below_one_block_is_refused_not_defaulted(vram: int) -> None:
    # A 0 once silently became the 98,304-token default.
    d = base()
    d["workers"][0]["vram_tokens"] = vram
    assert error_of(d).startswith(f"worker 'w1': vram_tokens must be an integer >= 16 (one block") and error_of(d).endswith(f"got {vram}")


def test_negative_dram() -> None:
    d = base()
    d["workers"][0]["dram_tokens"] = -1
    assert error_of(d) == "worker 'w1': dram_tokens must be an integer >= 0 (0: no DRAM tier), got -1"


@pytest.mark.parametrize("key", ["vram_tokens", "dram_tokens"])
def test_a_tier_past_the_caches_block_count_is_refused_at_load(key: str) -> None:
    # Found in review: 10^11 tokens loaded and planned, then failed at run time naming no worker.
    d = base()
    d["workers"][0][key] = 16 * (2**32 - 1)
    assert error_of(d) == f"worker 'w1': {key} must hold fewer than 2^32 - 1 blocks of 16 tokens, got {16 * (2**32 - 1)}"
    d["workers"][0][key] = 16 * (2**32 - 2)
    assert getattr(topology_from_dict(d).workers[0], key) == 16 * (2**32 - 2)


def test_capacities_left_out_are_none_and_a_stated_zero_stays_zero() -> None:
    d = base()
    d["workers"][0]["dram_tokens"] = 0
    d["workers"][1]["vram_tokens"] = 4096
    w1, w2, w3 = topology_from_dict(d).workers
    assert (w1.vram_tokens, w1.dram_tokens) == (None, 0)
    assert (w2.vram_tokens, w2.dram_tokens) == (4096, None)
    assert (w3.vram_tokens, w3.dram_tokens) == (None, None)


def test_fractional_capacity() -> None:
    d = base()
    d["workers"][0]["vram_tokens"] = 1.5
    assert error_of(d) == "workers[0]: vram_tokens must be an integer, got 1.5"


def test_bad_role() -> None:
    d = base()
    d["workers"][0]["role"] = "gpu"
    assert error_of(d) == "worker 'w1': role must be one of prefill, decode, both, got 'gpu'"


def test_empty_worker_id() -> None:
    d = base()
    d["workers"][0]["id"] = ""
    assert error_of(d) == "worker #0: id must be non-empty"


def test_worker_missing_region() -> None:
    d = base()
    del d["workers"][0]["region"]
    assert error_of(d) == "workers[0]: missing 'region'"


def test_worker_missing_id() -> None:
    d = base()
    del d["workers"][0]["id"]
    assert error_of(d) == "workers[0]: missing 'id' (or 'count' for several workers)"


def test_worker_id_and_count() -> None:
    d = base()
    d["workers"][0]["count"] = 2
    assert error_of(d) == "workers[0]: give either 'id' or 'count', not both"


def test_worker_count_zero() -> None:
    d = base()
    d["workers"].append({"region": "a", "count": 0})
    assert error_of(d) == "workers[3]: count must be >= 1, got 0"


def test_id_prefix_without_count() -> None:
    d = base()
    d["workers"][0]["id_prefix"] = "x"
    assert error_of(d) == "workers[0]: 'id_prefix' needs 'count'"


def test_shared_endpoint_for_counted_workers() -> None:
    d = base()
    d["workers"].append({"region": "a", "count": 2, "endpoint": "h:1"})
    assert error_of(d) == "workers[3]: endpoint 'h:1' would be shared by 2 workers; use '{id}' or '{i}' in it"


def test_unknown_worker_key() -> None:
    d = base()
    d["workers"][0]["bta"] = 1
    assert error_of(d).startswith("workers[0]: unknown key 'bta' (expected one of id, region, count")


def test_workers_not_an_array() -> None:
    d = base()
    d["workers"] = {"id": "w"}
    assert error_of(d).startswith("workers must be an array of tables")


def test_no_workers_key() -> None:
    d = base()
    del d["workers"]
    assert error_of(d) == "no workers defined (a [[workers]] array is required)"


def test_empty_workers() -> None:
    d = base()
    d["workers"] = []
    assert error_of(d) == "no workers defined"


def test_only_decode_workers() -> None:
    d = base()
    for w in d["workers"]:
        w["role"] = "decode"
    assert error_of(d) == "no worker can prefill: every worker has role 'decode'"


def test_no_regions_key() -> None:
    d = base()
    del d["regions"]
    assert error_of(d) == "no regions defined (a [regions] table is required)"


def test_empty_regions_table() -> None:
    d = base()
    d["regions"] = {}
    assert error_of(d) == "no regions defined"


def test_region_with_no_workers_and_no_edges() -> None:
    d = base()
    d["regions"]["c"] = {"edges": 0}
    assert error_of(d) == "region 'c' is empty: it has no workers and no edges"


def test_no_edges_anywhere() -> None:
    d = base()
    d["regions"] = {"a": {"edges": 0}, "b": {"edges": 0}}
    assert error_of(d) == "no region has an edge, so nothing would query the index"


def test_negative_edges() -> None:
    d = base()
    d["regions"]["a"] = {"edges": -1}
    assert error_of(d) == "region 'a': edges must be an integer >= 0, got -1"


def test_unknown_region_key() -> None:
    d = base()
    d["regions"]["a"] = {"aws": "a"}
    assert error_of(d) == "region 'a': unknown key 'aws' (expected one of aws_region, edges)"


def test_region_not_in_matrix() -> None:
    d = base()
    d["regions"]["b"] = {"aws_region": "eu-foo-1"}
    assert error_of(d) == "region 'b': AWS region 'eu-foo-1' is not in the RTT matrix (topology [rtt_ms])"


def test_duplicate_region_from_code() -> None:
    with pytest.raises(TopologyError, match=r"^duplicate region 'a'$"):
        Topology("t", (RegionSpec("a"), RegionSpec("a")), (WorkerSpec("w", "a"),), RttMatrix.from_mapping(INLINE_RTT))


def test_empty_region_name_from_code() -> None:
    with pytest.raises(TopologyError, match=r"^a region has an empty name$"):
        Topology("t", (RegionSpec(""),), (WorkerSpec("w", "a"),), RttMatrix.from_mapping(INLINE_RTT))


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("block_size", 0, "block_size must be an integer >= 1, got 0"),
        ("levels", 0, "levels must be an integer >= 1, got 0"),
        ("own_region_min", -256, "own_region_min must be an integer >= 1, got -256"),
        ("max_prefix", 0, "max_prefix must be an integer >= 1, got 0"),
        ("max_prefix", 200, "max_prefix (200) is below own_region_min (256, 256 rounded to the block size)"),
        ("shards", 0, "shards must be an integer >= 1, got 0"),
        ("value_bits", 48, "value_bits must be 32 or 64, got 48"),
        ("fp_bits", 17, "fp_bits must be an integer in 0..16, got 17"),
        ("block_size", "16", "block_size must be an integer, got '16'"),
        ("levels", True, "levels must be an integer, got True"),
    ],
)
def test_bad_option(key: str, value: Any, message: str) -> None:
    d = base()
    d[key] = value
    assert error_of(d) == message


def test_unknown_top_level_key() -> None:
    d = base()
    d["blok_size"] = 16
    assert error_of(d).startswith("unknown key 'blok_size' (expected one of name, description, block_size")


def test_both_matrix_kinds() -> None:
    d = base()
    d["rtt_matrix"] = "x.csv"
    assert error_of(d) == "give either 'rtt_ms' (inline) or 'rtt_matrix' (a file), not both"


def test_missing_matrix_file(tmp_path: Path) -> None:
    d = base()
    del d["rtt_ms"]
    d["rtt_matrix"] = "absent.csv"
    with pytest.raises(TopologyError, match=r"^RTT matrix .*absent\.csv: no such file$"):
        topology_from_dict(d, base_dir=tmp_path)


def test_invalid_toml(tmp_path: Path) -> None:
    p = tmp_path / "bad.toml"
    p.write_text("regions = [\n")
    with pytest.raises(TopologyError, match=r"bad\.toml: invalid TOML: "):
        topology_from_toml(p)


def test_missing_toml_file(tmp_path: Path) -> None:
    with pytest.raises(TopologyError, match=r"gone\.toml: no such file"):
        topology_from_toml(tmp_path / "gone.toml")


def test_errors_from_a_file_name_the_file(tmp_path: Path) -> None:
    p = tmp_path / "fleet.toml"
    p.write_text('[rtt_ms]\na = { a = 1.0 }\n[regions]\na = {}\n[[workers]]\nid = "w3"\nregion = "mars"\n')
    with pytest.raises(TopologyError) as e:
        topology_from_toml(p)
    assert str(e.value) == f"{p}: worker 'w3': region 'mars' is not defined"


def test_a_topology_may_name_its_tokenizer_relative_to_its_file(tmp_path: Path) -> None:
    from kvcompass.discovery.topology import load_topology

    bundled = Path(topo_mod.__file__).resolve().parents[1] / "data" / "tokenizer.json"
    (tmp_path / "tok.json").write_bytes(bundled.read_bytes())
    body = 'rtt_ms = { a = { a = 1.0 } }\n[regions]\na = {}\n[[workers]]\nid = "a0"\nregion = "a"\n'
    (tmp_path / "t.toml").write_text('tokenizer = "tok.json"\n' + body)
    t = load_topology(str(tmp_path / "t.toml"))
    assert t.tokenizer == str((tmp_path / "tok.json").resolve())
    from kvcompass.engine.tokenizer import load_tokenizer

    assert load_tokenizer(t.tokenizer).encode("hello world").tolist() == load_tokenizer(None).encode("hello world").tolist()
    (tmp_path / "u.toml").write_text('tokenizer = "missing.json"\n' + body)
    with pytest.raises(TopologyError, match="tokenizer: no file"):
        load_topology(str(tmp_path / "u.toml"))
    assert load_topology("testbed-14x3").tokenizer == ""


def test_the_north_american_testbed_is_the_papers_appendix_b() -> None:
    """Figure 17's testbed: 2 Pennsylvania, 4 Ohio, 1 New York, 4 Calgary, mapped to the nearest
    AWS regions of the bundled matrix, with one-way latencies in the ranges its description
    states (the three eastern regions close together, Calgary far)."""
    t = load_topology("testbed-na-11x4", rtt_path=BUNDLED_RTT)
    assert [(r, len(t.workers_in(r))) for r in t.region_names] == [("pennsylvania", 2), ("ohio", 4), ("new-york", 1), ("calgary", 4)]
    east = ("pennsylvania", "ohio", "new-york")
    one_way = [t.rtt_ms(a, b) / 2 for a in east for b in east if a < b]
    assert min(one_way) == pytest.approx(7.9, abs=0.05) and max(one_way) == pytest.approx(13.7, abs=0.05)
    to_calgary = [t.rtt_ms(a, "calgary") / 2 for a in east]
    assert min(to_calgary) == pytest.approx(20.6, abs=0.05) and max(to_calgary) == pytest.approx(25.8, abs=0.05)
    assert all(w.beta_ms_per_token == 0.085 for w in t.workers)


def test_half_disaggregated_layouts_are_refused_at_load() -> None:
    # Review: prefill workers with no decode pool, or 'both' beside 'decode', loaded and then
    # failed mid-run (an empty min(), a role error).
    d = base()
    for w in d["workers"]:
        w["role"] = "prefill"
    assert "prefill workers but no 'decode' worker" in error_of(d)
    d = base()
    d["workers"][2]["role"] = "decode"
    assert error_of(d).startswith("worker 'w1' has role 'both' beside prefill/decode workers")
    d = base()
    d["workers"][0]["role"], d["workers"][1]["role"], d["workers"][2]["role"] = "prefill", "prefill", "decode"
    assert topology_from_dict(d).disaggregated


def test_a_region_with_an_edge_and_no_workers_simulates_with_kvcompass() -> None:
    # Review: its requests' answers carry queue vectors toward an edge the worker regions'
    # edges did not know ("unknown region" mid-run).
    from kvcompass.sim.engine import simulate
    from kvcompass.sim.workload import synthetic_mixed

    d = base()
    d["regions"]["c"] = {"edges": 1}
    d["rtt_ms"] = {"a": {"a": 1, "b": 80, "c": 120}, "b": {"a": 80, "b": 1, "c": 90}, "c": {"a": 120, "b": 90, "c": 1}}
    t = topology_from_dict(d)
    s = simulate(t, synthetic_mixed(60, rate=5.0, seed=2, regions=["c"]), "kvcompass")
    assert s.requests == 60
