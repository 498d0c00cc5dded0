"""The simulator's cost model: the cited constants, the forms, the presets and the Vidur fit."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from kvcompass.discovery.params import EdgeParams
from kvcompass.engine import costs
from kvcompass.engine.costs import CostModel, LinearFit, fit_line, fit_vidur_profile, kv_capacity_tokens, load_vidur_profile, preset


def test_constants_follow_their_sources() -> None:
    assert costs.KV_BYTES_PER_TOKEN == 128 * 1024
    # gamma ~ 128 KiB over ~25 GB/s, and the edge's score charges the same value.
    exact = costs.KV_BYTES_PER_TOKEN / costs.PCIE4_BYTES_PER_S * 1e3
    assert abs(costs.RELOAD_MS_PER_TOKEN - exact) / exact < 0.05
    assert CostModel().reload_ms_per_token == EdgeParams().gamma_ms_per_token
    assert CostModel().prefill_ms_per_token == 0.085
    assert costs.VLLM_CI_CONTEXT == 768


def test_prefill_and_reload_are_linear() -> None:
    m = CostModel()
    assert m.prefill_ms(0) == 0.0 and m.prefill_ms(1000) == pytest.approx(85.0)
    m2 = CostModel(prefill_base_ms=3.0)
    assert m2.prefill_ms(0) == 0.0 and m2.prefill_ms(100) == pytest.approx(11.5)
    assert m.reload_ms(0) == 0.0 and m.reload_ms(4096) == pytest.approx(20.48)
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError):
            m.prefill_ms(bad)  # type: ignore[arg-type]
        with pytest.raises(ValueError):
            m.reload_ms(bad)  # type: ignore[arg-type]


def test_decode_step_is_weights_bound_then_compute_bound_plus_attention() -> None:
    m = CostModel()
    assert m.decode_step_ms(0, 0) == 0.0
    assert m.decode_step_ms(1, 0) == pytest.approx(9.71 + 0.0291)
    # Attention: b per context token, 128 KiB / 2.04 TB/s.
    assert m.decode_ms_per_context_token == pytest.approx(131072 / 2.04e12 * 1e3)
    assert m.decode_step_ms(8, 10_000) - m.decode_step_ms(8, 0) == pytest.approx(10_000 * m.decode_ms_per_context_token)
    # Small batches: weights bound (slowly growing); large ones: c per token.
    assert m.decode_step_ms(128, 0) == pytest.approx(9.71 + 128 * 0.0291)
    assert m.decode_step_ms(2048, 0) == pytest.approx(2048 * 0.066)
    steps = [m.decode_step_ms(b, 512 * b) for b in range(1, 600, 7)]
    assert steps == sorted(steps)
    # The small-batch figure is the calibration README's ~9.7 ms/step on A100.
    assert 9.7 <= m.decode_step_ms(1, 128) < 9.8
    with pytest.raises(ValueError):
        m.decode_step_ms(-1, 0)
    with pytest.raises(ValueError):
        m.decode_step_ms(1, -5)


def test_presets() -> None:
    assert preset("paper") == CostModel()
    a100, h100, h200 = preset("a100"), preset("h100"), preset("h200")
    assert a100.prefill_ms_per_token == 0.066 and h100.prefill_ms_per_token == h200.prefill_ms_per_token == 0.030
    # H100 and H200 reproduce vLLM CI's measured step (batch 8, mean context 768) by construction.
    for m, want in ((h100, 997.54 / 128), (h200, 833.42 / 128)):
        assert m.decode_step_ms(8, 768) == pytest.approx(want)
    # A100 from Vidur leaves out the LM head, sampling and scheduling: below vLLM CI's 12.4 ms.
    ratio = a100.decode_step_ms(8, 768) / (1585.43 / 128)
    assert 0.75 < ratio < 0.85
    assert h200.decode_step_ms(64, 64_000) < h100.decode_step_ms(64, 64_000) < a100.decode_step_ms(64, 64_000)
    with pytest.raises(ValueError, match="choices"):
        preset("b200")


def test_fields_override_and_are_checked() -> None:
    m = dataclasses.replace(CostModel(), prefill_ms_per_token=0.05, name="mine")
    assert m.prefill_ms(100) == pytest.approx(5.0) and m.decode_base_ms == CostModel().decode_base_ms
    assert CostModel(decode_base_ms=5.0).decode_step_ms(1, 0) == pytest.approx(5.0291)
    with pytest.raises(dataclasses.FrozenInstanceError):
        m.prefill_ms_per_token = 1.0  # type: ignore[misc]
    for kw in ({"prefill_ms_per_token": -0.1}, {"reload_ms_per_token": float("nan")}, {"decode_base_ms": float("inf")}, {"kv_bytes_per_token": 0}):
        with pytest.raises(ValueError):
            CostModel(**kw)
    assert m.kv_bytes(10) == 10 * 131072


def test_kv_capacity_tokens_rounds_down_to_blocks() -> None:
    assert kv_capacity_tokens(32 * 2**30, 16) == 262_144  # paper section 5.3: 32 GB of VRAM for KV
    assert kv_capacity_tokens(32 * 10**9, 16) == 244_128
    assert kv_capacity_tokens(131072 * 31, 16) == 16
    with pytest.raises(ValueError):
        kv_capacity_tokens(-1, 16)


def test_fit_line_is_least_squares() -> None:
    pts = [(1, 3.0), (2, 5.0), (3, 7.0), (100, 1000.0)]
    f = fit_line(pts, hi=3)
    assert isinstance(f, LinearFit) and f.points == 3
    assert f.intercept_ms == pytest.approx(1.0) and f.slope_ms_per_token == pytest.approx(2.0)
    with pytest.raises(ValueError):
        fit_line(pts, lo=50)


_HEADER = [f"time_stats.{op}.{s}" for op in ("emb", *costs._VIDUR_LAYER_OPS) for s in ("min", "max", "mean", "median", "std")]


def _profile(tmp: Path, rows: list[tuple[int, int, float]]) -> Path:
    """A synthetic profile: every per-layer op median is ``per_op`` ms, embedding 1 ms."""
    lines = [",".join([*_HEADER, "num_tokens", "num_tensor_parallel_workers"])]
    for n, tp, per_op in rows:
        vals = []
        for op in ("emb", *costs._VIDUR_LAYER_OPS):
            v = 1.0 if op == "emb" else per_op
            vals += [str(v)] * 5
        lines.append(",".join([*vals, str(n), str(tp)]))
    p = tmp / costs.VIDUR_FILE
    p.write_text("\n".join(lines) + "\n")
    return p


def test_the_loader_reads_a_profile_and_picks_tp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # 9 ops x 32 layers x per_op + 1 ms; per_op linear in n, so the fit is exact.
    rows = [(n, 1, 0.001 * n) for n in (1, 64, 128, 1024, 2048, 4096)] + [(4096, 2, 99.0)]
    p = _profile(tmp_path, rows)
    pts = load_vidur_profile(p)
    assert pts is not None and len(pts) == 6 and pts[0][0] == 1 and pts[0][1] == pytest.approx(1.0 + 288 * 0.001)
    fit = fit_vidur_profile(p)
    assert fit is not None
    assert fit.prefill.slope_ms_per_token == pytest.approx(0.288) and fit.prefill.points == 3
    assert fit.decode.intercept_ms == pytest.approx(1.0) and fit.decode.points == 3
    m = fit.cost_model()
    assert m.prefill_ms_per_token == pytest.approx(0.288) and m.decode_base_ms == pytest.approx(1.0) and m.name == "a100"
    # Found through $KVCOMPASS_DATA/calibration.
    (tmp_path / "calibration").mkdir()
    p.rename(tmp_path / "calibration" / costs.VIDUR_FILE)
    monkeypatch.setenv("KVCOMPASS_DATA", str(tmp_path))
    assert costs.find_calibration_file(costs.VIDUR_FILE) == (tmp_path / "calibration" / costs.VIDUR_FILE).resolve()
    assert load_vidur_profile() == pts


def test_the_loader_refuses_other_files(tmp_path: Path) -> None:
    bad = tmp_path / "x.csv"
    bad.write_text("a,b\n1,2\n")
    with pytest.raises(ValueError, match="missing columns"):
        load_vidur_profile(bad)
    p = _profile(tmp_path, [(1, 1, 0.5)])
    p.write_text(p.read_text().replace(",1,1\n", ",one,1\n"))
    with pytest.raises(ValueError, match="line 2"):
        load_vidur_profile(p)


_SHARED = costs.find_calibration_file(costs.VIDUR_FILE)


@pytest.mark.skipif(_SHARED is None, reason="../shared/data/calibration is not on this machine")
def test_the_shared_vidur_profile_fits_the_readme() -> None:
    pts = load_vidur_profile(_SHARED)
    assert pts is not None
    table = dict(pts)  # the README's derived table (rows with one measurement per size)
    for n, want in ((1, 9.70), (8, 9.99), (32, 10.92), (128, 13.19), (256, 19.50), (512, 34.67), (1024, 75.2)):
        assert table[n] == pytest.approx(want, abs=0.01)
    fit = fit_vidur_profile(_SHARED)
    assert fit is not None
    # The README's "linear at ~0.066 ms/token" above ~1k tokens.
    assert abs(fit.prefill.slope_ms_per_token - 0.066) / 0.066 < 0.10
    assert fit.prefill.points > 300
    # The constants in costs.py are this fit, rounded.
    assert fit.prefill.slope_ms_per_token == pytest.approx(costs.A100_PREFILL_MS_PER_TOKEN, rel=0.01)
    assert fit.decode.intercept_ms == pytest.approx(costs.VIDUR_DECODE_BASE_MS, rel=0.001)
    assert fit.decode.slope_ms_per_token == pytest.approx(costs.VIDUR_DECODE_MS_PER_SEQ, rel=0.01)
