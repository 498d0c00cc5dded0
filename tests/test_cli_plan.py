"""``kvcompass plan``: the readable table, exactly one JSON object with ``--json``, and a one-line
error (no traceback, non-zero exit) for a bad topology. Also a smoke run of the demo, which
now takes its plan from the topology module."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvcompass.cli import main
from kvcompass.demo import DemoConfig, run_demo
from kvcompass.discovery.plan import LevelPlan
from kvcompass.discovery.topology import BUNDLED_RTT, builtin_topologies, load_topology

ROOT = Path(__file__).resolve().parents[1]
RTT = ["--rtt-matrix", str(BUNDLED_RTT)]


def test_json_is_one_object_in_the_documented_schema(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--topology", "testbed-14x3", "--json", *RTT]) == 0
    out = capsys.readouterr()
    assert out.err == ""
    j = json.loads(out.out)  # the whole of stdout is one JSON document
    assert isinstance(j, dict)
    assert {"block_size", "beta_ms_per_token", "rtt_ms", "plan", "registration", "tables"} <= set(j)
    assert j == json.loads(json.dumps(LevelPlan(load_topology("testbed-14x3", rtt_path=BUNDLED_RTT)).to_json()))
    tail = [9744, 11600, 13792, 16384, 19488, 23184, 27568, 32768]  # four lengths a doubling past 8192
    assert j["plan"]["us"]["eu"][:16] == [1104, 1648, 2192, 2736, 3280, 3840, 4096, 8192, *tail]
    assert j["plan"]["us"]["eu"][-1] == 131072 and j["tail_steps"] == 4 and j["own_steps"] == 1
    assert j["tables"]["us"] == [[f"us-{i}" for i in range(8)]]


@pytest.mark.parametrize("name", builtin_topologies())
def test_every_builtin_prints_both_ways(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--topology", name, *RTT]) == 0
    assert main(["plan", "--topology", name, "--json", *RTT]) == 0
    text, js = capsys.readouterr().out.split("\n{", 1)
    assert f"Topology {name}:" in text
    assert json.loads("{" + js)["topology"] == name


def test_readable_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--topology", "testbed-pd-10x3", *RTT]) == 0
    out = capsys.readouterr().out
    assert "Edge region eu (eu-central-1), 1 edge" in out
    # RTT, n1 and lengths in one row per target region.
    assert any(line.split()[:3] == ["us", "(us-east-1)", "92.9"] and line.split()[4:6] == ["1093", "1104"] for line in out.splitlines())
    assert "own  256 512 1024 2048 4096 8192" in out
    assert "Registration:" in out and "Tables: 3, each split into 4 shards" in out
    assert "us-p0 us-p1 us-p2" in out
    assert "not indexed (decode workers, paper appendix C): us-d0 eu-d0 asia-d0" in out


def test_topology_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    p = tmp_path / "two.toml"
    p.write_text('[rtt_ms]\nx = { x = 1.0, y = 85.0 }\ny = { x = 85.0, y = 1.0 }\n[regions]\nx = {}\ny = {}\n'
                 '[[workers]]\nregion = "x"\ncount = 2\n[[workers]]\nid = "solo"\nregion = "y"\n')  # fmt: skip
    assert main(["plan", "--topology", str(p), "--json"]) == 0
    j = json.loads(capsys.readouterr().out)
    assert j["plan"]["x"]["y"][0] == 1008  # 85 ms / 0.085 ms/token = 1000 -> 1008
    assert j["tables"] == {"x": [["x-0", "x-1"]], "y": [["solo"]]}


def test_the_table_shows_each_workers_cache_capacities(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """What each worker's caches became, defaults applied, so a capacity left out or stated as
    0 shows as what the simulator will run."""
    p = tmp_path / "caps.toml"
    p.write_text('[rtt_ms]\nx = { x = 1.0 }\n[regions]\nx = {}\n'
                 '[[workers]]\nregion = "x"\ncount = 2\n'
                 '[[workers]]\nid = "no-offload"\nregion = "x"\ndram_tokens = 0\n'
                 '[[workers]]\nid = "small"\nregion = "x"\nvram_tokens = 1000\ndram_tokens = 4096\n')  # fmt: skip
    assert main(["plan", "--topology", str(p)]) == 0
    out = capsys.readouterr().out
    rows = [line.split() for line in out.split("Worker caches", 1)[1].splitlines()[1:]]
    assert rows == [
        ["VRAM", "98304", "DRAM", "1048576", "2", "workers", "x-0", "x-1"],
        ["VRAM", "98304", "DRAM", "0", "1", "worker", "no-offload"],
        ["VRAM", "992", "DRAM", "4096", "1", "worker", "small"],
    ]


def test_bad_topology_is_one_line_on_stderr(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    p = tmp_path / "bad.toml"
    p.write_text('[rtt_ms]\na = { a = 1.0 }\n[regions]\na = {}\n[[workers]]\nid = "w1"\nregion = "mars"\n')
    assert main(["plan", "--topology", str(p)]) == 2
    out = capsys.readouterr()
    assert out.out == ""
    assert out.err == f"kvcompass plan: error: {p}: worker 'w1': region 'mars' is not defined\n"


def test_rtt_matrix_flag_is_never_ignored_in_silence(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``--rtt-matrix`` naming no file, or a file a topology's own matrix would override, is a
    one-line error naming it (both were ignored when the topology had its own matrix)."""
    own = tmp_path / "own.toml"
    own.write_text('[rtt_ms]\nx = { x = 1.0 }\n[regions]\nx = {}\n[[workers]]\nregion = "x"\ncount = 2\n')
    missing = tmp_path / "nope.csv"
    for cmd in (["plan"], ["simulate", "--trace", "mixed", "--rates", "1", "--schemes", "oracle", "--max-requests", "5"]):
        for topology, matrix, what in (
            (str(own), missing, f"--rtt-matrix {missing}: no such file"),
            ("testbed-14x3", missing, f"--rtt-matrix {missing}: no such file"),
            (str(own), BUNDLED_RTT, f"--rtt-matrix {BUNDLED_RTT}: topology own has its own RTT matrix ({own} [rtt_ms]), which it would use"),
        ):
            assert main([cmd[0], "--topology", topology, "--rtt-matrix", str(matrix), *cmd[1:]]) == 2
            out = capsys.readouterr()
            assert out.out == "" and out.err.startswith(f"kvcompass {cmd[0]}: error: {what}") and out.err.count("\n") == 1, out.err
    assert main(["plan", "--topology", "testbed-14x3", *RTT]) == 0  # a topology without a matrix of its own takes it
    assert f"RTT matrix: {BUNDLED_RTT}" in capsys.readouterr().out


def test_unknown_topology_name(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--topology", "mars-1x1", "--json"]) == 2
    out = capsys.readouterr()
    assert out.out == "" and out.err.count("\n") == 1 and "testbed-14x3" in out.err


def test_exit_status_and_no_traceback_from_the_process(tmp_path: Path) -> None:
    p = tmp_path / "broken.toml"
    p.write_text("block_size = [\n")
    r = subprocess.run([sys.executable, "-m", "kvcompass", "plan", "--topology", str(p)], cwd=ROOT, capture_output=True, text=True, timeout=60, check=False)
    assert r.returncode == 2
    assert r.stdout == "" and "Traceback" not in r.stderr
    assert r.stderr.startswith("kvcompass plan: error: ") and "invalid TOML" in r.stderr and r.stderr.count("\n") == 1


def test_demo_runs_on_the_testbed_plan() -> None:
    buf = io.StringIO()
    figures = run_demo(DemoConfig(prompts=4, route_repeats=10), out=buf)
    out = buf.getvalue()
    for needle in ("Topology testbed-14x3", "Level plan", "digest matches its writer", "Routes", "Found a cached prefix for 4/4 prompts"):
        assert needle in out
    assert "edge     eu (eu-central-1) -> us (us-east-1)" in out
    assert figures["found"] == figures["prompts"] == 4.0
