"""``kvcompass reproduce``: the paper's transcribed figures beside ours, in report.json (rows with
numeric paper and ours values), report.md and the figure, on a small grid."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvcompass.cli import main
from kvcompass.sim.reproduce import BASELINES, FIGURES, GROUPS, REFERENCE_RATE, paper_rows

KEYS = {"figure", "metric", "scheme", "load", "rate", "paper_rate", "paper", "ours", "ratio", "note"}


def test_every_transcribed_row_names_a_known_scheme_rate_and_source() -> None:
    for figure, spec in FIGURES.items():
        rows = paper_rows(figure)
        assert rows, figure
        for r in rows:
            assert r["paper"] > 0 and r["where"].startswith(("section ", "appendix "))
            if "_over_" in r["metric"]:
                group = r["metric"].split("_over_", 1)[1]
                assert set(GROUPS[group]) <= set(spec.schemes), (figure, group)
            else:
                assert r["scheme"] in spec.schemes
            if spec.closed_loop_per_worker:
                assert r["paper_rate"] == 0  # a closed loop has no rate
            else:
                assert r["paper_rate"] in spec.paper_rates and r["paper_rate"] in spec.quick_rates
    assert set(BASELINES) <= set(FIGURES["12"].schemes)


def test_figure_12_writes_its_report(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["reproduce", "--figure", "12", "--quick", "--requests", "300", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "figure 12: 12 rows" in out
    rows = json.loads((tmp_path / "report.json").read_text())
    assert len(rows) >= 10 and all(set(r) == KEYS for r in rows)
    for r in rows:
        assert isinstance(r["paper"], float) and isinstance(r["ours"], float) and r["ours"] > 0
        assert r["ratio"] == pytest.approx(r["ours"] / r["paper"])
        assert r["load"] == pytest.approx(r["paper_rate"] / REFERENCE_RATE)
        assert r["note"].startswith(("agrees", "disagrees"))
    run = json.loads((tmp_path / "run.json").read_text())
    # Each rate is the load times the workload's no-reuse capacity.
    for p, v in run["rates"].items():
        assert float(v["rate"]) == pytest.approx(float(p) / REFERENCE_RATE * run["capacity"]["req_per_s"], rel=1e-3)
    # Ours is computed from the runs: the P99 ratio of a row is the runs' P99s divided.
    cd = next(r for r in rows if r["metric"] == "p99_ttft_ratio" and r["scheme"] == "central-directory")
    rate = str(cd["rate"]).removesuffix(".0")
    s = run["summaries"]
    key = next(k for k in s["kvcompass"] if float(k) == cd["rate"])
    assert cd["ours"] == pytest.approx(s["central-directory"][key]["ttft_p99_ms"] / s["kvcompass"][key]["ttft_p99_ms"]), rate
    md = (tmp_path / "report.md").read_text()
    assert md.count("\n| p99_ttft_ratio |") == 7 and "Absent:" in md
    # A range the paper gives over its three workloads is not set beside Mixed (audit of the
    # transcription, 2026-12-07): said as left out, not compared.
    assert "- Left out: Figure 12 (Mixed) throughput" in md
    assert "| scheme | rate (req/s) | sent req/s |" in md  # what each run actually sent
    assert md.count("| held for KV room |") == 1  # how often the workers' KV pools were full
    kvc = next(line for line in md.splitlines() if line.startswith(f"| kvcompass | {key} |"))
    assert kvc.split("|")[-2].strip() == str(s["kvcompass"][key]["kv_waits"])
    assert not any(r["metric"] == "throughput_ratio_max_over_hash_placement" for r in rows)
    assert (tmp_path / "figure12.png").stat().st_size > 10_000


def test_unknown_figures_are_refused_with_the_list(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["reproduce", "--figure", "table6", "--out", str(tmp_path / "out")]) == 2
    assert not (tmp_path / "out").exists()  # refused before the directory is made
    err = capsys.readouterr().err
    assert err.startswith("kvcompass reproduce: error: figure 'table6' is not reproduced") and "11, 12, 12-chat, 13, 14, 15, 16, 17, 18, table4, table5" in err
    assert main(["reproduce", "--figure", "12", "--jobs", "0", "--out", str(tmp_path)]) == 2
    # The bounds simulate has, checked the same way (found in review: a traceback, a silent hang).
    capsys.readouterr()
    assert main(["reproduce", "--figure", "table5", "--quick", "--seed", str(2**64), "--out", str(tmp_path / "s")]) == 2
    assert "--seed must be in [0, 2^64)" in capsys.readouterr().err
    assert main(["reproduce", "--figure", "table5", "--quick", "--requests", str(2**40), "--out", str(tmp_path / "r")]) == 2
    assert "--requests must be in [100, 4294967295]" in capsys.readouterr().err


def test_figure_15_runs_the_ablations_closed_loop(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["reproduce", "--figure", "15", "--quick", "--requests", "400", "--jobs", "2", "--out", str(tmp_path)]) == 0
    assert "figure 15: 4 rows" in capsys.readouterr().out
    rows = json.loads((tmp_path / "report.json").read_text())
    run = json.loads((tmp_path / "run.json").read_text())
    assert run["closed_loop"] == 32 * 14 and run["topology"] == "testbed-14x3"
    s = run["summaries"]
    (key,) = s["kvcompass"]
    full = s["kvcompass"][key]["throughput_tok_s"]
    assert {r["scheme"] for r in rows} == {"kvcompass-no-load", "kvcompass-no-xregion", "kvcompass-tier-blind", "kvcompass-no-migration"}
    for r in rows:
        assert r["metric"] == "ablation_throughput" and set(r) == KEYS
        assert r["ours"] == pytest.approx(s[r["scheme"]][key]["throughput_tok_s"] / full)
        assert r["note"].startswith(("agrees", "disagrees"))
    md = (tmp_path / "report.md").read_text()
    assert "Closed loop: 32 requests outstanding per worker" in md
    assert (tmp_path / "figure15.png").stat().st_size > 10_000


def test_testbed_figures_take_the_papers_rates_as_rates(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Figure 18 (prefill-decode) and figure 13 (reuse): the paper's testbed rates are offered
    as they are, each row's load is that rate over the workload's no-reuse capacity, and ours
    is computed from the runs (median ratios over the stock stack's dispatchers; reused tokens)."""
    assert main(["reproduce", "--figure", "18", "--quick", "--requests", "300", "--out", str(tmp_path / "18")]) == 0
    assert "figure 18: 4 rows" in capsys.readouterr().out
    rows = json.loads((tmp_path / "18" / "report.json").read_text())
    run = json.loads((tmp_path / "18" / "run.json").read_text())
    assert run["topology"] == "testbed-pd-10x3" and run["reference_rate"] is None and run["workload"]["tenants"] == 1
    assert list(run["rates"]) == ["24.0"] and float(run["rates"]["24.0"]["rate"]) == 24.0
    s = run["summaries"]
    p50 = {k: s[k]["24"]["ttft_p50_ms"] for k in s}
    for r in rows:
        assert set(r) == KEYS and r["rate"] == 24.0
        assert r["load"] == pytest.approx(24.0 / run["capacity"]["req_per_s"])
    lo = next(r for r in rows if r["metric"] == "p50_ttft_ratio_min_over_pd_baselines")
    assert lo["ours"] == pytest.approx(min(p50[b] for b in ("random", "sglang-cache-aware", "round-robin", "consistent-hash")) / p50["kvcompass"])
    assert (tmp_path / "18" / "figure18.png").stat().st_size > 10_000
    assert main(["reproduce", "--figure", "13", "--quick", "--requests", "300", "--jobs", "2", "--out", str(tmp_path / "13")]) == 0
    rows = json.loads((tmp_path / "13" / "report.json").read_text())
    s = json.loads((tmp_path / "13" / "run.json").read_text())["summaries"]
    assert {r["scheme"] for r in rows} == {"consistent-hash", "chord"}
    for r in rows:
        assert r["ours"] == pytest.approx(s[r["scheme"]]["16"]["hit_rate"] / s["kvcompass"]["16"]["hit_rate"])
    assert (tmp_path / "13" / "figure13.png").stat().st_size > 10_000


def test_figure_16_is_figure_12_at_twice_the_scale(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["reproduce", "--figure", "16", "--quick", "--requests", "200", "--jobs", "2", "--out", str(tmp_path)]) == 0
    assert "figure 16: 2 rows" in capsys.readouterr().out
    run = json.loads((tmp_path / "run.json").read_text())
    assert run["topology"] == "paper-128x16" and run["reference_rate"] == 2 * REFERENCE_RATE
    rows = json.loads((tmp_path / "report.json").read_text())
    for r in rows:
        assert r["paper_rate"] == 12000 and r["load"] == pytest.approx(2.0)
    assert (tmp_path / "figure16.png").stat().st_size > 10_000


def test_table_4_turns_one_fault_knob_at_a_time(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["reproduce", "--figure", "table4", "--quick", "--requests", "300", "--out", str(tmp_path)]) == 0
    assert "figure table4: 18 rows" in capsys.readouterr().out
    run = json.loads((tmp_path / "run.json").read_text())
    sweep = {(r["knob"], r["value"]): r for r in run["sensitivity"]}
    assert len(sweep) == 12 and sweep[("patch_delay_ms", 200.0)]["ttft_p99_ms"] > 0
    (key,) = run["summaries"]["kvcompass"]
    base = run["summaries"]["kvcompass"][key]
    assert sweep[("wan_jitter_pct", 0.0)]["ttft_p99_ms"] == base["ttft_p99_ms"]  # the base is the fault-free run
    rows = json.loads((tmp_path / "report.json").read_text())
    loss = next(r for r in rows if r["metric"] == "p99_ttft_vs_base@patch_loss_pct=30")
    assert loss["ours"] == pytest.approx(sweep[("patch_loss_pct", 30.0)]["ttft_p99_ms"] / base["ttft_p99_ms"])
    assert loss["paper"] == pytest.approx(1427 / 1370, abs=1e-4)
    assert all(r["note"].startswith(("agrees", "disagrees")) for r in rows)
    assert "# Table 4, reproduced" in (tmp_path / "report.md").read_text()
    assert (tmp_path / "table4.png").stat().st_size > 10_000


def test_table_5_puts_structural_and_end_to_end_false_hits_beside_the_papers(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["reproduce", "--figure", "table5", "--quick", "--requests", "300", "--out", str(tmp_path)]) == 0
    assert "figure table5: 6 rows" in capsys.readouterr().out
    rows = {r["metric"]: r for r in json.loads((tmp_path / "report.json").read_text())}
    run = json.loads((tmp_path / "run.json").read_text())
    structural = {round(s["load"], 2): s["rate"] for s in run["structural"]}
    assert sorted(structural) == [0.2, 0.4, 0.6, 0.8, 0.95]
    for load, rate in structural.items():
        # No fingerprint: a never-inserted key reads whatever occupied slot it lands on.
        assert rate == pytest.approx(load, abs=0.01)
        assert rows[f"structural_fp_rate@load={load}"]["ours"] == rate
    assert rows["structural_fp_rate@load=0.95"]["paper"] == pytest.approx(0.453)
    assert run["structural_fp"]["fp_bits"] == 8 and run["structural_fp"]["rate"] < 0.01
    (key,) = run["summaries"]["kvcompass"]
    assert rows["end_to_end_false_lookup_rate"]["ours"] == pytest.approx(run["summaries"]["kvcompass"][key]["false_hit_rate"])
    assert all(r["note"].startswith(("agrees", "disagrees")) for r in rows.values())
    assert "# Table 5, reproduced" in (tmp_path / "report.md").read_text()
    assert (tmp_path / "table5.png").stat().st_size > 10_000



def test_figure_12_chat_runs_the_grid_on_sharegpt_chat(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """Figure 12's chat columns: the same grid on ShareGPT's multi-turn chat (a small file in
    the ShareGPT format here), LRU, rates as loads against the chat workload's own capacity,
    and the paper's chat rows with notes that name the stand-in."""
    from kvcompass.sim import sharegpt

    records = []
    for i in range(80):
        turns: list[dict[str, str]] = []
        for k in range(1 + i % 4):
            turns.append({"from": "human", "value": f"conversation {i} question {k}: " + "tell me more about the topic " * (3 + (i * 7 + k) % 11)})
            turns.append({"from": "gpt", "value": f"answer {k} to {i}: " + "here is a detailed reply " * (2 + (i * 5 + k) % 13)})
        records.append({"id": f"c{i}_0", "conversations": turns})
    data = tmp_path / "sharegpt.json"
    data.write_text(json.dumps(records), encoding="utf-8")
    monkeypatch.setenv(sharegpt.ENV_PATH, str(data))
    monkeypatch.setenv("KVCOMPASS_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(sharegpt, "HOLDOUT_CONVERSATIONS", 20)
    sharegpt._memo.clear()
    out = tmp_path / "out"
    assert main(["reproduce", "--figure", "12-chat", "--quick", "--requests", "200", "--out", str(out)]) == 0
    assert "figure 12-chat: 4 rows" in capsys.readouterr().out
    run = json.loads((out / "run.json").read_text())
    assert run["workload"]["name"] == "chat" and run["workload"]["eviction"] == "lru" and run["workload"]["tenants"] == 1
    for p, v in run["rates"].items():
        assert float(v["rate"]) == pytest.approx(float(p) / REFERENCE_RATE * run["capacity"]["req_per_s"], rel=1e-3)
    rows = json.loads((out / "report.json").read_text())
    assert {(r["metric"], r["scheme"]) for r in rows} == {(p["metric"], p["scheme"]) for p in paper_rows("12-chat")}
    for r in rows:
        assert r["ours"] > 0 and r["note"].startswith(("agrees", "disagrees"))
        if r["note"].startswith("disagrees"):
            assert "ShareGPT" in r["note"] and "Mixed-like" not in r["note"]
    md = (out / "report.md").read_text()
    assert "ShareGPT's multi-turn chat" in md and "Absent:" not in md and "synthetic Mixed" not in md
    assert (out / "figure12-chat.png").stat().st_size > 10_000
    sharegpt._memo.clear()


def test_a_ratio_on_the_other_side_of_one_from_the_papers_disagrees() -> None:
    # Review: within 1.5x of the paper's was "agrees" even where ours said the opposite (0.96
    # beside the paper's 1.14: hash placement reusing less, the paper's more).
    from kvcompass.sim.reproduce import _note

    assert _note("p99_ttft_ratio", "dynamo", 1.3, 1.1).startswith("agrees")
    for metric, scheme, paper, ours in (("p99_ttft_ratio", "dynamo", 1.3, 0.9), ("throughput_ratio", "central-directory", 1.2, 0.85), ("reused_tokens_ratio", "consistent-hash", 1.14, 0.96)):
        assert _note(metric, scheme, paper, ours).startswith("disagrees"), metric
    assert "consistent-hash reuses 0.96x KVCompass's tokens" in _note("reused_tokens_ratio", "consistent-hash", 1.14, 0.96)


def test_the_figure_14_cells_are_time_averaged_load_factors_whose_largest_is_the_peak() -> None:
    # Review: the heatmap averaged per-window ratios (idle windows as 0), so the hottest cell
    # read 0.78 beside a peak of 1.75.
    from kvcompass.discovery.topology import load_topology
    from kvcompass.sim.engine import simulate
    from kvcompass.sim.reproduce import _worker_load_factors
    from kvcompass.sim.workload import synthetic_mixed

    topo = load_topology("testbed-14x3")
    s = simulate(topo, synthetic_mixed(300, rate=20.0, seed=3, regions=list(topo.region_names)), "kvcompass")
    lf = _worker_load_factors(s.utilisation)
    assert lf.mean() == pytest.approx(1.0) and float(lf.max()) == pytest.approx(s.peak_load_factor, rel=1e-6)
