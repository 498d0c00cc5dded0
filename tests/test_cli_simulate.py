"""``kvcompass simulate``: the last stdout line is one JSON object in the documented schema, the
tables and figures land in ``--out``, the trace excerpt replays, and bad inputs give a one-line
error and exit 2."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl
import pytest

from kvcompass.cli import main
from kvcompass.sim.report import FIGURES

ROOT = Path(__file__).resolve().parents[1]
EXCERPT = ROOT / "tests" / "data" / "conversation_excerpt.jsonl"
KEYS = {"ttft_p50_ms", "ttft_p99_ms", "e2e_p50_ms", "e2e_p99_ms", "throughput_tok_s", "hit_rate", "xregion_hit_rate", "false_hit_rate", "peak_load_factor", "requests", "demoted_blocks", "evicted_blocks", "kv_waits", "sent_req_s", "sent_mid_req_s"}


def _last_json(out: str) -> dict[str, Any]:
    lines = out.rstrip("\n").split("\n")
    j = json.loads(lines[-1])
    assert isinstance(j, dict)
    return j


def test_mixed_two_schemes_two_rates(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["simulate", "--topology", "testbed-14x3", "--trace", "mixed", "--max-requests", "150", "--rates", "5,10"]
    assert main([*argv, "--schemes", "kvcompass,oracle", "--seed", "1", "--out", str(tmp_path)]) == 0
    cap = capsys.readouterr()
    j = _last_json(cap.out)
    assert list(j) == ["results", "eviction", "follow_ups", "kv_pool"] and j["eviction"] == "lfu" and j["follow_ups"] == "after-parent"  # the paper's eviction for Mixed
    assert j["kv_pool"] == "shared"
    res = j["results"]
    assert isinstance(res, dict) and list(res) == ["kvcompass", "oracle"]
    for by_rate in res.values():
        assert list(by_rate) == ["5", "10"]
        for row in by_rate.values():
            assert set(row) == KEYS
            assert row["requests"] == 150
            assert all(isinstance(v, (int, float)) for v in row.values())
            assert 0 <= row["hit_rate"] <= 1 and row["ttft_p50_ms"] <= row["ttft_p99_ms"]
    assert "[4/4]" in cap.err  # progress on stderr
    summary = pl.read_parquet(tmp_path / "summary.parquet")
    assert summary.height == 4
    assert summary.filter(pl.col("scheme") == "oracle").get_column("ttft_p99_ms").to_list() == [res["oracle"][r]["ttft_p99_ms"] for r in ("5", "10")]
    assert pl.read_parquet(tmp_path / "requests.parquet").height == 600
    assert pl.read_csv(tmp_path / "summary.csv").height == 4
    assert pl.read_csv(tmp_path / "requests.csv").height == 600
    for name in FIGURES:
        assert (tmp_path / name).stat().st_size > 1000
    run = json.loads((tmp_path / "run.json").read_text())  # what produced the tables
    assert run["topology"] == "testbed-14x3" and run["options"]["seed"] == 1 and run["options"]["rates"] == "5,10"
    assert run["options"]["gpu_sharing"] == "chunked" and run["options"]["max_batched_tokens"] == 2048


def test_trace_excerpt_and_same_seed_same_answer(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["simulate", "--topology", "testbed-14x3", "--trace", str(EXCERPT), "--block-size", "512", "--rates", "20", "--schemes", "kvcompass", "--max-requests", "40"]
    assert main(argv) == 0
    a = _last_json(capsys.readouterr().out)
    assert main(argv) == 0
    assert _last_json(capsys.readouterr().out) == a
    row = a["results"]["kvcompass"]["20"]
    assert row["requests"] == 40 and row["hit_rate"] > 0


def test_tenants_replicate_the_trace_with_private_namespaces(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["simulate", "--topology", "testbed-14x3", "--trace", str(EXCERPT), "--block-size", "512", "--rates", "20", "--schemes", "kvcompass"]
    assert main([*argv, "--max-requests", "30"]) == 0
    one = _last_json(capsys.readouterr().out)["results"]["kvcompass"]["20"]
    assert main([*argv, "--max-requests", "90", "--tenants", "3"]) == 0
    three = _last_json(capsys.readouterr().out)["results"]["kvcompass"]["20"]
    assert (one["requests"], three["requests"]) == (30, 90)
    # The copies cannot reuse each other's caches: reuse stays that of one tenant's replay
    # (three times the load, so not equal, but nowhere near the near-total reuse a shared
    # namespace would give the second and third copies).
    assert three["hit_rate"] < one["hit_rate"] + 0.15


@pytest.mark.parametrize("trace", [str(EXCERPT), "mixed"])
def test_max_requests_is_a_total_whatever_the_tenants(trace: str, capsys: pytest.CaptureFixture[str]) -> None:
    """N requests in all on a trace as on mixed (a trace replayed N per tenant, N x K in all;
    how the copies share the N: tests/test_sim_workload.py)."""
    argv = ["simulate", "--topology", "testbed-14x3", "--trace", trace, "--block-size", "512", "--rates", "20", "--schemes", "oracle", "--max-requests", "30", "--tenants", "3"]
    assert main(argv) == 0
    assert _last_json(capsys.readouterr().out)["results"]["oracle"]["20"]["requests"] == 30


def test_all_schemes_means_every_registered_one(capsys: pytest.CaptureFixture[str]) -> None:
    from kvcompass.sim.schemes import SCHEMES

    assert main(["simulate", "--topology", "testbed-14x3", "--trace", "mixed", "--max-requests", "20", "--rates", "8", "--schemes", "all"]) == 0
    assert list(_last_json(capsys.readouterr().out)["results"]) == list(SCHEMES)


@pytest.mark.parametrize(
    "change",
    [
        {"--schemes": "kvcompass,chord-nope"},
        {"--topology": "nowhere-1x1"},
        {"--trace": "no/such/file.jsonl"},
        {"--trace": "no-such-trace-name"},
        {"--rates": "5,fast"},
        {"--rates": "0"},
        {"--max-requests": "0"},
        {"--tenants": "0"},
        # Review, twenty-fourth session: these were tracebacks or mid-run failures.
        {"--patch-delay-ms": "inf"},
        {"--seed": str(2**64)},
        {"--max-batched-tokens": "99999999999999999999"},
        {"--closed-loop": "99999999999999999999"},
        {"--tenants": "70000"},
    ],
)
def test_bad_input_is_one_line_and_exit_2(change: dict[str, str], capsys: pytest.CaptureFixture[str]) -> None:
    args = {"--topology": "testbed-14x3", "--trace": "mixed", "--rates": "5", "--schemes": "oracle", "--max-requests": "10"}
    args.update(change)
    argv = ["simulate"] + [x for kv in args.items() for x in kv]
    assert main(argv) == 2
    cap = capsys.readouterr()
    assert cap.out == ""
    lines = cap.err.strip("\n").split("\n")
    assert len(lines) == 1 and lines[0].startswith("kvcompass simulate: error: "), cap.err
    assert "Traceback" not in cap.err


def test_a_prompt_past_the_context_window_is_a_load_time_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Named by its trace line, or for a generated workload by its request, before any run."""
    topo = tmp_path / "small-window.toml"
    topo.write_text((ROOT / "kvcompass" / "topologies" / "testbed-14x3.toml").read_text().replace("value_bits = 32", "value_bits = 32\nmax_prefix = 8192").replace('name = "testbed-14x3"', 'name = "small-window"'))
    base = ["simulate", "--topology", str(topo), "--rates", "5", "--schemes", "oracle"]
    for trace, what in (
        ([str(EXCERPT), "--block-size", "512"], f"{EXCERPT}, line 7, field 'input_length': 23141 tokens, longer than the context window of topology 'small-window' (max_prefix 8192)"),
        (["mixed", "--max-requests", "200"], "-token prompt, longer than the context window of topology 'small-window' (max_prefix 8192)"),
    ):
        assert main([*base, "--trace", *trace]) == 2
        cap = capsys.readouterr()
        assert cap.out == "" and len(cap.err.strip().splitlines()) == 1 and what in cap.err, cap.err
        assert "[1/1]" not in cap.err  # before any run


def test_run_json_records_the_checkouts_commit(tmp_path: Path) -> None:
    """In a git checkout, ``run.json`` names the commit that produced the tables (it was always
    null: the check compared the checkout's kvcompass/ with kvcompass/cli/)."""
    import argparse

    from kvcompass.cli.simulate import _write_run
    from kvcompass.discovery.topology import load_topology

    head = subprocess.run(["git", "rev-parse", "--show-toplevel", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=10, check=False)
    if head.returncode != 0 or Path(head.stdout.split()[0]).resolve() != ROOT:
        pytest.skip("not run from a git checkout of this repository")
    path = _write_run(tmp_path, argparse.Namespace(command="simulate", seed=1), load_topology("testbed-14x3"))
    commit = json.loads(path.read_text())["git_commit"]
    assert isinstance(commit, str) and len(commit) == 40 and set(commit) <= set("0123456789abcdef")
    assert commit == head.stdout.split()[1]


def test_errors_name_the_flags_not_the_librarys_arguments(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Requests all logged at one instant cannot be rescaled to a rate: said as ``--arrivals``,
    not as the library's ``mode='poisson'``, which the user never typed."""
    path = tmp_path / "one-instant.jsonl"
    path.write_text("".join(json.dumps({"timestamp": 5, "input_length": 20, "output_length": 3, "hash_ids": [i]}) + "\n" for i in range(3)))
    base = ["simulate", "--topology", "testbed-14x3", "--trace", str(path), "--schemes", "oracle", "--block-size", "512"]
    for extra, more in ((["--rates", "5"], False), (["--rates", "5", "--keep-ties", "--max-requests", "2"], True), (["--load", "0.5"], False)):
        assert main([*base, *extra]) == 2
        err = capsys.readouterr().err
        assert err.startswith("kvcompass simulate: error: --arrivals rescale: every request replayed has the same timestamp") and err.count("\n") == 1, err
        assert "mode=" not in err and "--arrivals poisson" in err and ("--max-requests" in err) == more
    assert main([*base, "--rates", "5", "--arrivals", "poisson"]) == 0
    assert _last_json(capsys.readouterr().out)["results"]["oracle"]["5"]["requests"] == 3


def test_console_script_exit_code() -> None:
    p = subprocess.run(
        [sys.executable, "-m", "kvcompass", "simulate", "--topology", "testbed-14x3", "--trace", "mixed", "--rates", "5", "--schemes", "nope"],
        cwd=ROOT, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert p.returncode == 2 and p.stdout == "" and len(p.stderr.strip().splitlines()) == 1 and "Traceback" not in p.stderr


def test_sensitivity_and_false_hit_tables(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["simulate", "--topology", "testbed-14x3", "--trace", "mixed", "--max-requests", "60", "--rates", "8", "--schemes", "kvcompass"]
    assert main([*argv, "--seed", "2", "--sensitivity", "--false-hits", "--out", str(tmp_path)]) == 0
    cap = capsys.readouterr()
    j = _last_json(cap.out)
    rows = j["sensitivity"]
    assert [(r["knob"], r["value"]) for r in rows] == [
        ("wan_jitter_pct", 0.0), ("wan_jitter_pct", 25.0), ("wan_jitter_pct", 50.0), ("wan_jitter_pct", 100.0),
        ("patch_loss_pct", 0.0), ("patch_loss_pct", 10.0), ("patch_loss_pct", 20.0), ("patch_loss_pct", 30.0),
        ("patch_delay_ms", 0.0), ("patch_delay_ms", 100.0), ("patch_delay_ms", 200.0), ("patch_delay_ms", 300.0),
    ]  # fmt: skip
    base = j["results"]["kvcompass"]["8"]
    assert rows[0]["ttft_p99_ms"] == base["ttft_p99_ms"] and rows[0]["hit_rate"] == base["hit_rate"]
    # Jitter moves every WAN traversal, so it moves the latencies.
    assert rows[3]["ttft_p99_ms"] != base["ttft_p99_ms"]
    assert pl.read_csv(tmp_path / "sensitivity.csv").height == 12
    fh = j["false_hits"]
    s = fh["structural"]
    assert s["0"] > 0.9 and 0 < s["8"] < 0.005 and s["16"] < s["8"]  # fingerprints are what make a keyless view usable
    assert fh["end_to_end"]["kvcompass"]["8"] == base["false_hit_rate"]
    assert "paper table 4" in cap.out and "paper table 5" in cap.out


def test_fault_flags_are_checked(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["simulate", "--topology", "testbed-14x3", "--trace", "mixed", "--max-requests", "10", "--rates", "8", "--schemes", "kvcompass"]
    assert main([*argv, "--patch-loss", "100"]) == 2
    assert main([*argv, "--wan-jitter", "-1"]) == 2
    assert main([*argv, "--patch-delay-ms", "-5"]) == 2
    err = capsys.readouterr().err
    assert "--patch-loss" in err and "--wan-jitter" in err and "--patch-delay-ms" in err


def test_gpu_sharing_flags(capsys: pytest.CaptureFixture[str]) -> None:
    """``--gpu-sharing lanes`` gives the separate-lanes model (decodes never wait for a prompt, so
    end-to-end latency is lower than with vLLM's chunked steps); a smaller step budget stalls
    decodes in more, shorter steps; bad values exit 2 with one line."""
    argv = ["simulate", "--topology", "testbed-14x3", "--trace", "mixed", "--max-requests", "120", "--rates", "10", "--schemes", "oracle", "--seed", "2"]
    runs = {}
    for extra in ([], ["--gpu-sharing", "lanes"], ["--max-batched-tokens", "512"]):
        assert main([*argv, *extra]) == 0
        runs[" ".join(extra)] = _last_json(capsys.readouterr().out)["results"]["oracle"]["10"]
    chunked, lanes = runs[""], runs["--gpu-sharing lanes"]
    assert lanes["e2e_p99_ms"] < chunked["e2e_p99_ms"]
    assert runs["--max-batched-tokens 512"]["ttft_p99_ms"] != chunked["ttft_p99_ms"]
    assert main([*argv, "--max-batched-tokens", "0"]) == 2
    assert "--max-batched-tokens" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main([*argv, "--gpu-sharing", "shared"])
    assert e.value.code == 2


def test_arrival_modes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``--arrivals trace`` replays the file's own timestamps (results keyed by the trace's own
    rate, no ``--rates``); ``rescale`` stretches them to the rate; ``poisson`` draws a Poisson
    process at it in the trace's order."""
    base = ["simulate", "--topology", "testbed-14x3", "--trace", str(EXCERPT), "--block-size", "512", "--schemes", "oracle", "--max-requests", "40", "--seed", "3"]
    stamps = [float(json.loads(line)["timestamp"]) for line in EXCERPT.read_text().splitlines()[:40]]
    arrivals: dict[str, list[float]] = {}
    for mode, extra in (("trace", []), ("rescale", ["--rates", "2"]), ("poisson", ["--rates", "2"])):
        out = tmp_path / mode
        assert main([*base, "--arrivals", mode, *extra, "--out", str(out)]) == 0
        res = _last_json(capsys.readouterr().out)["results"]["oracle"]
        key = f"{39e3 / (stamps[-1] - stamps[0]):.6g}" if mode == "trace" else "2"
        assert list(res) == [key] and res[key]["requests"] == 40
        t = sorted(pl.read_parquet(out / "requests.parquet").get_column("arrival_ms").to_list())
        arrivals[mode] = [x - t[0] for x in t]
    assert arrivals["trace"] == pytest.approx([s - stamps[0] for s in sorted(stamps)])
    assert arrivals["rescale"][-1] == pytest.approx(39e3 / 2) and arrivals["poisson"] != arrivals["rescale"]
    gaps = sorted({round(b - a, 6) for a, b in zip(arrivals["trace"], arrivals["trace"][1:])})
    assert gaps[0] == 0.0  # the trace's shared timestamps arrive together, as logged
    for bad, what in (
        (["--arrivals", "trace", "--rates", "2"], "leave out --rates"),
        (["--arrivals", "rescale"], "--rates or --load is required"),
    ):
        assert main([*base, *bad]) == 2
        assert what in capsys.readouterr().err
    mixed = ["simulate", "--topology", "testbed-14x3", "--trace", "mixed", "--max-requests", "10", "--schemes", "oracle"]
    assert main([*mixed, "--arrivals", "rescale", "--rates", "5"]) == 2
    assert "Poisson" in capsys.readouterr().err


def test_region_weights(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``--region-weights`` sets where sessions start (unnamed regions get none), for traces and
    the mixed workload alike; bad weights are one-line errors."""
    trace = ["simulate", "--topology", "testbed-14x3", "--trace", str(EXCERPT), "--block-size", "512", "--max-requests", "40"]
    mixed = ["simulate", "--topology", "testbed-14x3", "--trace", "mixed", "--max-requests", "60"]
    for i, (argv, weights, want) in enumerate(((trace, "us=1", {"us"}), (mixed, "eu=1,asia=3", {"eu", "asia"}), (trace, "us=0,asia=2", {"asia"}))):
        out = tmp_path / str(i)
        assert main([*argv, "--rates", "5", "--schemes", "oracle", "--region-weights", weights, "--out", str(out)]) == 0
        capsys.readouterr()
        assert set(pl.read_parquet(out / "requests.parquet").get_column("region").to_list()) == want
    for bad, what in (("mars=1", "unknown region 'mars'"), ("us=-1", ">= 0"), ("us=x", "not a number"), ("us=0", "weight > 0"), ("us", "REGION=WEIGHT"), ("us=1,us=2", "twice")):
        assert main([*mixed, "--rates", "5", "--schemes", "oracle", "--region-weights", bad]) == 2
        err = capsys.readouterr().err
        assert what in err and len(err.strip().splitlines()) == 1, err


def test_jobs_run_side_by_side_with_the_same_results(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``--jobs 2`` runs the cells in two worker processes: the JSON line and the tables are
    those of the serial run, in the same order (runs depend on their inputs and seed only)."""
    argv = ["simulate", "--topology", "testbed-14x3", "--trace", "mixed", "--max-requests", "80", "--rates", "6,12", "--schemes", "kvcompass,oracle,dynamo", "--seed", "4"]
    assert main([*argv, "--out", str(tmp_path / "serial")]) == 0
    serial = capsys.readouterr()
    assert main([*argv, "--jobs", "2", "--out", str(tmp_path / "jobs")]) == 0
    jobs = capsys.readouterr()
    assert serial.out.rstrip("\n").split("\n")[-1] == jobs.out.rstrip("\n").split("\n")[-1]
    assert list(_last_json(jobs.out)["results"]) == ["kvcompass", "oracle", "dynamo"]
    for table in ("summary.parquet", "requests.parquet"):
        assert pl.read_parquet(tmp_path / "serial" / table).equals(pl.read_parquet(tmp_path / "jobs" / table))
    assert "[6/6]" in jobs.err and "6 runs on 2 processes" in jobs.err
    assert main([*argv, "--jobs", "0"]) == 2
    assert "--jobs must be >= 1" in capsys.readouterr().err


def test_ray_runs_the_grid_as_tasks_with_the_serial_results(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``--ray local`` starts Ray on this machine and runs every (scheme, rate) cell as a Ray
    task: the JSON line is the serial run's (issue 14: sweeps fan out on Ray, not on a
    scheduler of our own); Ray absent, or Ray with --jobs, is a clear error."""
    pytest.importorskip("ray")
    argv = ["simulate", "--topology", "testbed-14x3", "--trace", "mixed", "--max-requests", "60", "--rates", "6,12", "--schemes", "kvcompass,oracle", "--seed", "4"]
    assert main(argv) == 0
    serial = capsys.readouterr()
    assert main([*argv, "--ray", "local"]) == 0
    on_ray = capsys.readouterr()
    assert serial.out.rstrip("\n").split("\n")[-1] == on_ray.out.rstrip("\n").split("\n")[-1]
    assert "[4/4]" in on_ray.err and "4 runs on Ray (local)" in on_ray.err
    assert main([*argv, "--ray", "local", "--jobs", "2"]) == 2
    assert "not both" in capsys.readouterr().err


def test_ray_absent_is_said_plainly(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    import sys

    monkeypatch.setitem(sys.modules, "ray", None)
    argv = ["simulate", "--topology", "testbed-14x3", "--trace", "mixed", "--max-requests", "20", "--rates", "6", "--schemes", "oracle", "--ray", "local"]
    assert main(argv) == 2
    assert "pip install 'kvcompass[ray]'" in capsys.readouterr().err


def test_run_cells_checks_its_arguments() -> None:
    from kvcompass.discovery.topology import load_topology
    from kvcompass.sim.cells import run_cells

    topo = load_topology("testbed-14x3")
    with pytest.raises(ValueError, match="jobs must be"):
        run_cells(topo, {}, [], {}, jobs=0)
    with pytest.raises(KeyError, match="no workload for rate '5'"):
        run_cells(topo, {}, [("5", "oracle")], {}, jobs=2)


def test_progress_is_reported_as_requests_complete() -> None:
    """``simulate(progress=...)`` hears about every hundredth of the workload completing and the
    end; ``run_cells`` passes that on per cell (the CLI draws it as a bar on a terminal)."""
    from kvcompass.discovery.topology import load_topology
    from kvcompass.sim.cells import run_cells
    from kvcompass.sim.engine import simulate
    from kvcompass.sim.workload import synthetic_mixed

    topo = load_topology("testbed-14x3")
    reqs = synthetic_mixed(250, regions=topo, seed=2, rate=10.0, block_size=topo.block_size)
    seen: list[tuple[int, int]] = []
    quiet = simulate(topo, reqs, "oracle", seed=2)
    loud = simulate(topo, reqs, "oracle", seed=2, progress=lambda d, n: seen.append((d, n)))
    assert loud.ttft_ms == quiet.ttft_ms  # watching changes nothing
    assert [d for d, _ in seen] == list(range(2, 251, 2)) and {n for _, n in seen} == {250}
    cells: list[tuple[int, str, int]] = []
    run_cells(topo, {"10": reqs}, [("10", "oracle"), ("10", "dynamo")], {"seed": 2}, on_progress=lambda k, t, s, r, d, n: cells.append((k, s, d)))
    assert cells[0][:2] == (1, "oracle") and cells[-1] == (2, "dynamo", 250)


def test_load_is_a_fraction_of_the_no_reuse_capacity(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from kvcompass.discovery.topology import load_topology
    from kvcompass.sim.capacity import no_reuse_capacity
    from kvcompass.sim.workload import synthetic_mixed

    argv = ["simulate", "--topology", "testbed-14x3", "--trace", "mixed", "--max-requests", "60", "--schemes", "oracle", "--seed", "4"]
    assert main([*argv, "--load", "0.5,1.2", "--out", str(tmp_path)]) == 0
    cap = capsys.readouterr()
    doc = _last_json(cap.out)
    topo = load_topology("testbed-14x3")
    want = no_reuse_capacity(topo, synthetic_mixed(60, regions=topo, seed=4, rate=1.0, block_size=topo.block_size)).req_per_s
    assert doc["capacity"]["req_per_s"] == pytest.approx(want)
    assert doc["capacity"]["bound"] == "workers" and doc["capacity"]["gpu_sharing"] == "chunked"
    rates = list(doc["results"]["oracle"])
    assert [float(r) for r in rates] == pytest.approx([0.5 * want, 1.2 * want], rel=1e-3)
    assert doc["loads"] == dict(zip(rates, [0.5, 1.2]))
    assert "no-reuse capacity of testbed-14x3" in cap.err
    run = json.loads((tmp_path / "run.json").read_text())
    assert run["capacity"] == doc["capacity"] and run["loads"] == doc["loads"]
    # The rates it computed are the rates it ran: the same as giving them by hand.
    assert main([*argv, "--rates", ",".join(rates)]) == 0
    assert _last_json(capsys.readouterr().out)["results"] == doc["results"]
    # The capacity is the engine's: without the shared KV pool the batch is not bounded by it.
    assert main([*argv, "--load", "0.5", "--kv-pool", "unbounded"]) == 0
    cap = capsys.readouterr()
    free = no_reuse_capacity(topo, synthetic_mixed(60, regions=topo, seed=4, rate=1.0, block_size=topo.block_size), kv_pool="unbounded").req_per_s
    assert _last_json(cap.out)["capacity"]["req_per_s"] == pytest.approx(free) and free > 1.02 * want
    assert "unbounded KV pool" in cap.err


@pytest.mark.parametrize("extra", [["--load", "0"], ["--load", "0.5,x"], ["--load", "0.5,0.5"], ["--load", "0.5", "--rates", "5"]])
def test_bad_loads_are_usage_errors(extra: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["simulate", "--topology", "testbed-14x3", "--trace", "mixed", "--max-requests", "10", "--schemes", "oracle"]
    assert main([*argv, *extra]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvcompass simulate: error: ") and ("--load" in err or "--rates" in err)


def test_mixed_tenants_share_nothing(capsys: pytest.CaptureFixture[str]) -> None:
    from kvcompass.sim.workload import synthetic_mixed

    def firsts(private: bool) -> dict[int, set[tuple[int, ...]]]:
        """Each tenant's first blocks (16 tokens)."""
        reqs = synthetic_mixed(400, regions=("a", "b"), seed=2, tenants=4, rate=10.0, private_pools=private)
        by: dict[int, set[tuple[int, ...]]] = {}
        for r in reqs:
            by.setdefault(r.tenant, set()).add(tuple(r.input_tokens()[:16].tolist()))
        return by

    shared, private = firsts(False), firsts(True)
    assert len(private) == 4
    # With shared pools, tool catalogues (the first segment of agent prompts) recur across
    # tenants; with private pools no first block is common to two tenants.
    assert any(shared[a] & shared[b] for a in shared for b in shared if a < b)
    assert not any(private[a] & private[b] for a in private for b in private if a < b)
    argv = ["simulate", "--topology", "testbed-14x3", "--trace", "mixed", "--max-requests", "40", "--rates", "8", "--schemes", "oracle", "--tenants", "5"]
    assert main(argv) == 0
    assert _last_json(capsys.readouterr().out)["results"]["oracle"]["8"]["requests"] == 40


def test_closed_loop_keeps_n_requests_outstanding_and_measures_sustained_throughput(capsys: pytest.CaptureFixture[str]) -> None:
    """--closed-loop N: the first N requests arrive at their own times and every completion
    issues the next when its client has the last token, so no more than N are ever in flight,
    and throughput is what the fleet sustains (the offered rate no longer sets it)."""
    from kvcompass.discovery.topology import load_topology
    from kvcompass.sim.engine import SimConfig, Simulator
    from kvcompass.sim.workload import synthetic_mixed

    topo = load_topology("testbed-14x3")
    reqs = synthetic_mixed(200, regions=topo, seed=1, rate=1.0, block_size=topo.block_size)
    sims = {}
    for n in (4, 16):
        sim = Simulator(topo, reqs, "kvcompass", SimConfig(seed=1, closed_loop=n))
        s = sim.run()
        rec = s.records
        arrive = np.array([r.arrival_ms for r in rec])
        done = arrive + np.array([r.e2e_ms for r in rec])
        # At every arrival, at most n requests are in flight (issued and not yet back).
        for t in arrive:
            assert int(np.count_nonzero((arrive <= t) & (done > t))) <= n
        # Every request after the first n arrived exactly when an earlier one came back.
        back = set(np.round(done, 6).tolist())
        later = [float(t) for r, t in zip(rec, arrive) if r.id >= n]
        assert later and all(round(t, 6) in back for t in later)
        sims[n] = s
    # Open loop at 1 req/s, the same 200 requests take 200 s; closed loop sustains far more.
    open_ = Simulator(topo, reqs, "kvcompass", SimConfig(seed=1)).run()
    assert sims[16].throughput_tokens_s > sims[4].throughput_tokens_s > open_.throughput_tokens_s
    # The command line: --closed-loop N lands in the JSON line; 0 and a negative are told apart.
    argv = ["simulate", "--topology", "testbed-14x3", "--trace", "mixed", "--max-requests", "60", "--rates", "2", "--schemes", "oracle", "--seed", "1"]
    assert main([*argv, "--closed-loop", "8", "--eviction", "lru"]) == 0
    j = _last_json(capsys.readouterr().out)
    assert j["closed_loop"] == 8 and j["eviction"] == "lru" and j["results"]["oracle"]["2"]["requests"] == 60
    assert main([*argv, "--closed-loop", "-1"]) == 2
    assert "--closed-loop" in capsys.readouterr().err


def test_out_is_checked_before_any_run_and_old_outputs_go(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # Review: a file at --out failed the command after every run; a rerun into the same folder
    # kept the earlier run's ablation plot and sensitivity table beside the new results.
    argv = ["simulate", "--topology", "testbed-14x3", "--trace", "mixed", "--max-requests", "30", "--rates", "8", "--schemes", "oracle"]
    afile = tmp_path / "afile"
    afile.write_text("x")
    assert main([*argv, "--out", str(afile)]) == 2
    cap = capsys.readouterr()
    assert "is not a directory" in cap.err and "oracle at" not in cap.err  # refused before running
    out = tmp_path / "out"
    out.mkdir()
    (out / "ablations.png").write_bytes(b"old")
    (out / "sensitivity.csv").write_text("old")
    (out / "notes.txt").write_text("mine")
    assert main([*argv, "--out", str(out)]) == 0
    assert not (out / "ablations.png").exists() and not (out / "sensitivity.csv").exists()
    assert (out / "notes.txt").read_text() == "mine" and (out / "summary.csv").exists()


def test_a_run_spanning_too_many_windows_is_a_clear_error(capsys: pytest.CaptureFixture[str]) -> None:
    # Review: --rates 1e-300 ended in numpy's "Maximum allowed size exceeded".
    assert main(["simulate", "--topology", "testbed-14x3", "--trace", "mixed", "--max-requests", "10", "--rates", "1e-300", "--schemes", "oracle"]) == 2
    err = capsys.readouterr().err
    assert "kvcompass simulate: error: the run spans" in err and "Traceback" not in err


def test_the_sensitivity_runs_send_follow_ups_as_the_main_run_does(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    # Review: the table-4 runs took the default follow-ups whatever --follow-ups said, so with
    # on-time the fault runs and the base replayed two different workloads.
    import kvcompass.sim.engine as engine

    seen: list[str] = []
    real = engine.simulate

    def spy(*a: Any, **kw: Any) -> Any:
        seen.append(kw.get("follow_ups", "default"))
        return real(*a, **kw)

    monkeypatch.setattr(engine, "simulate", spy)
    argv = ["simulate", "--topology", "testbed-14x3", "--trace", "mixed", "--max-requests", "30", "--rates", "8", "--schemes", "kvcompass", "--follow-ups", "on-time", "--sensitivity"]
    assert main(argv) == 0
    assert seen and set(seen) == {"on-time"}, seen
    assert _last_json(capsys.readouterr().out)["follow_ups"] == "on-time"


def test_a_person_reads_the_comparison_on_stderr(capsys: pytest.CaptureFixture[str]) -> None:
    """The end of a run shows a table per rate and KVCompass beside the best other deployable
    scheme (the Oracle and the ablations left out), figures read back from the JSON line."""
    argv = ["simulate", "--topology", "testbed-14x3", "--trace", "mixed", "--max-requests", "200", "--load", "0.8"]
    assert main([*argv, "--schemes", "kvcompass,round-robin,random,oracle,kvcompass-no-load", "--seed", "1"]) == 0
    cap = capsys.readouterr()
    j = _last_json(cap.out)
    (rate,) = j["loads"]
    lines = cap.err.splitlines()
    start = lines.index(next(line for line in lines if line.startswith(f"at {rate} req/s, load 0.80, 200 requests")))
    table = {line.split()[0]: line.split()[1:] for line in lines[start + 2 : start + 7]}
    assert list(table) == ["kvcompass", "round-robin", "random", "oracle", "kvcompass-no-load"]
    for scheme, cells in table.items():
        r = j["results"][scheme][rate]
        assert [float(c) for c in cells[:5]] == [round(r[k]) for k in ("ttft_p50_ms", "ttft_p99_ms", "e2e_p50_ms", "e2e_p99_ms", "throughput_tok_s")]
        assert cells[5] == f"{100 * r['hit_rate']:.1f}%" and float(cells[7]) == round(r["peak_load_factor"], 2)
    verdict = lines[start + 7]
    res = {s: j["results"][s][rate] for s in ("round-robin", "random")}
    best = min(res, key=lambda s: res[s]["ttft_p99_ms"])
    ratio = j["results"]["kvcompass"][rate]["ttft_p99_ms"] / res[best]["ttft_p99_ms"]
    assert verdict.startswith(f"kvcompass against the best other: TTFT P99 {ratio:.2f}x {best}'s (")
    assert "oracle" not in verdict and "no-load" not in verdict


def test_the_comparison_names_runs_sent_under_their_schedule(capsys: pytest.CaptureFixture[str]) -> None:
    """Past capacity a slow scheme's follow-ups wait for its answers, so it is offered less than
    the rate its figures are keyed by: the table shows what each run sent mid-run and a note
    names the runs sent under nine tenths of the drawn schedule (found in review: at a rate keyed
    278 req/s the Oracle was sent 215 mid-run, the label read as its load). Sent as drawn, no note."""
    argv = ["simulate", "--topology", "testbed-14x3", "--trace", "mixed", "--max-requests", "1500", "--load", "2.5", "--schemes", "kvcompass,random,oracle", "--seed", "1"]
    assert main(argv) == 0
    cap = capsys.readouterr()
    res = next(iter(_last_json(cap.out)["results"]["random"].values()))
    lines = cap.err.splitlines()
    row = next(line for line in lines if line.startswith("random "))
    assert float(row.split()[-1]) == float(f"{res['sent_mid_req_s']:.4g}")
    (note,) = [line for line in lines if line.startswith("note: sent under the drawn")]
    assert f"random ({res['sent_mid_req_s']:.4g}/s)" in note and "kvcompass (" not in note
    assert main([*argv, "--follow-ups", "on-time"]) == 0
    assert "note: sent under" not in capsys.readouterr().err


def test_a_shared_trace_name_that_falls_back_to_the_excerpt_says_so(tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """Without the shared data folder ``--trace conversation`` is the package's 600-request
    excerpt: said on stderr, and run.json names the file replayed (found in review: silent)."""
    from kvcompass.sim import workload

    package_data = Path(workload.__file__).resolve().parents[1] / "data"
    monkeypatch.setattr(workload, "_data_dirs", lambda: [tmp_path / "nowhere", package_data])
    argv = ["simulate", "--topology", "testbed-14x3", "--trace", "conversation", "--max-requests", "20", "--rates", "5", "--schemes", "oracle", "--out", str(tmp_path)]
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert "note: trace 'conversation' is the package's excerpt" in err and "KVCOMPASS_DATA" in err
    assert json.loads((tmp_path / "run.json").read_text())["trace_file"] == str(package_data / "traces" / "conversation_trace.jsonl")
    monkeypatch.setattr(workload, "_data_dirs", lambda: [tmp_path / "nowhere"])
    assert main(argv) == 2  # and with no excerpt either, a clear error


def test_a_scheme_that_cannot_run_on_the_topology_is_found_before_any_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """eu runs an edge but has no workers: without cross-region reuse its edge could route
    nowhere. Named, that ablation is an error before any run; under ``all`` it is left out with
    a note and the rest run (found in review: it failed after seven runs, whose results were lost)."""
    topo = tmp_path / "edge-only.toml"
    topo.write_text(
        'rtt_ms = { us = { us = 2.0, eu = 90.0 }, eu = { us = 90.0, eu = 2.0 } }\n'
        '[regions]\nus = {}\neu = {}\n[[workers]]\nregion = "us"\ncount = 3\nid_prefix = "us-"\n'
    )
    argv = ["simulate", "--topology", str(topo), "--trace", "mixed", "--max-requests", "30", "--rates", "2", "--seed", "1"]
    assert main([*argv, "--schemes", "oracle,kvcompass-no-xregion", "--out", str(tmp_path / "out")]) == 2
    assert not (tmp_path / "out").exists()  # refused before --out is made
    cap = capsys.readouterr()
    assert "kvcompass-no-xregion cannot run on this topology" in cap.err and "region 'eu' has no indexed worker" in cap.err
    assert "[1/" not in cap.err  # nothing ran
    assert main([*argv, "--schemes", "all"]) == 0
    cap = capsys.readouterr()
    assert "note: kvcompass-no-xregion left out" in cap.err
    res = _last_json(cap.out)["results"]
    assert "kvcompass-no-xregion" not in res and {"kvcompass", "oracle", "kvcompass-no-load"} <= set(res)
