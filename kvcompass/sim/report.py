"""Tables and figures of simulator runs (``kvcompass simulate --out DIR``).

Input everywhere is the runs' results: ``{scheme: {rate: Summary}}`` where ``rate`` is the
request rate as the user wrote it (a string such as ``"5"``), in the order the runs were made.
Every table and figure is computed from those summaries and their per-request records; nothing
is filled in when a run is missing.

Files written:

* ``summary.csv`` / ``summary.parquet``: one row per (scheme, rate) with the figures of
  :func:`summaries_to_frame`.
* ``requests.csv`` / ``requests.parquet``: one row per completed request of every run
  (:func:`records_to_frame`).
* ``p99_ttft_vs_rate.png`` (paper Figure 12 style), ``ttft_cdf.png`` (Figure 13: one panel per
  rate), ``throughput.png`` (Figure 14: grouped bars), ``load_factor_heatmap.png`` (Figure 15:
  the first scheme's run at the highest rate, workers x time windows, each window's busiest
  worker dotted and the run's peak starred), ``reuse.png`` (reused vs recomputed prompt
  tokens, stacked bars per scheme and rate).

Figures are drawn with matplotlib's Agg canvas (no display, no pyplot global state).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import polars as pl
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from kvcompass.sim.summary import Summary

__all__ = ["ABLATION_FIGURE", "FIGURES", "Results", "comparison_text", "records_to_frame", "summaries_to_frame", "summary_row", "write_figures", "write_tables"]

Results = Mapping[str, Mapping[str, Summary]]

# The figure files write_figures produces, in order.
FIGURES = ("p99_ttft_vs_rate.png", "ttft_cdf.png", "throughput.png", "load_factor_heatmap.png", "reuse.png")
ABLATION_FIGURE = "ablations.png"
"""Also written when ``kvcompass`` and at least one of its ablations (``kvcompass-*``) ran: each
one's P99 TTFT and throughput relative to full KVCompass at every rate (paper section 5.4)."""


def summary_row(s: Summary) -> dict[str, float | int]:
    """The figures ``kvcompass simulate`` prints for one run (its JSON schema, in order)."""
    return {
        "ttft_p50_ms": s.ttft_ms[0],
        "ttft_p99_ms": s.ttft_ms[2],
        "e2e_p50_ms": s.e2e_ms[0],
        "e2e_p99_ms": s.e2e_ms[2],
        "throughput_tok_s": s.throughput_tokens_s,
        "hit_rate": s.hit_rate,
        "xregion_hit_rate": s.cross_region_hit_rate,
        "false_hit_rate": s.false_hit_rate,
        "peak_load_factor": s.peak_load_factor,
        "requests": s.requests,
        "demoted_blocks": s.demoted_blocks,
        "evicted_blocks": s.evicted_blocks,
        "kv_waits": s.kv_waits,
        "sent_req_s": s.sent_req_s,
        "sent_mid_req_s": s.sent_mid_req_s,
    }


def comparison_text(results: Results, loads: Mapping[str, float] | None = None) -> str:
    """What ``kvcompass simulate`` shows a person at the end of a run: per rate, one line per
    scheme (latencies in ms, throughput, hit rates, peak load factor), then KVCompass beside the
    best of the other schemes on each figure, the Oracle and KVCompass's own ablations left out
    (the Oracle reads every worker's queue at once and exactly, which no deployed router can;
    an ablation is not a choice an operator makes). ``x-region`` is the share of prompt tokens
    reused on a worker outside the request's region (part of ``hit``). A
    ratio is KVCompass's figure over the best other's: under 1 wins for latency, over 1 for
    throughput. ``sent/s`` is what each run sent over the middle half of its sends: with
    follow-ups that wait for their parents' answers a slower scheme is offered less than the
    rate, and a note names every run sent under nine tenths of what its drawn schedule sends over
    its middle half (open loop), whose figures are then not at the others' load (found in review: at a rate keyed 278 req/s the Oracle was sent 215 mid-run
    and Dynamo 256). Empty when nothing ran."""
    rates = list(dict.fromkeys(r for by_rate in results.values() for r in by_rate))
    lines: list[str] = []
    head = f"{'scheme':<26}{'TTFT P50':>10}{'TTFT P99':>10}{'E2E P50':>10}{'E2E P99':>10}{'tok/s':>10}{'hit':>8}{'x-region':>10}{'peak load':>11}{'sent/s':>9}"
    for rate in rates:
        runs = {scheme: by_rate[rate] for scheme, by_rate in results.items() if rate in by_rate}
        n = max(s.requests for s in runs.values())
        load = f", load {loads[rate]:.2f}" if loads and rate in loads else ""
        lines += ["", f"at {rate} req/s{load}, {n:,} requests (ms; hit: share of prompt tokens reused, x-region: the part reused in another region):", head]
        for scheme, s in runs.items():
            lines.append(
                f"{scheme:<26}{s.ttft_ms[0]:>10.0f}{s.ttft_ms[2]:>10.0f}{s.e2e_ms[0]:>10.0f}{s.e2e_ms[2]:>10.0f}"
                f"{s.throughput_tokens_s:>10.0f}{100 * s.hit_rate:>7.1f}%{100 * s.cross_region_hit_rate:>9.1f}%{s.peak_load_factor:>11.2f}"
                f"{s.sent_mid_req_s:>9.4g}"
            )
        short = _sent_short(runs)
        drawn = max(s.drawn_mid_req_s for s in runs.values())
        note = (
            f"note: sent under the drawn {drawn:.4g}/s mid-run: {', '.join(short)}; follow-ups wait for their parents' answers, "
            "so a slower scheme is offered less and these figures are not at the others' load (--follow-ups on-time sends as drawn)"
        )
        ours = runs.get("kvcompass")
        others = {k: v for k, v in runs.items() if k != "kvcompass" and k != "oracle" and not k.startswith("kvcompass-")}
        if ours is None or not others:
            lines += [note] if short else []
            continue
        verdicts = []
        figures: dict[str, tuple[dict[str, float], bool]] = {
            "TTFT P99": ({k: v.ttft_ms[2] for k, v in runs.items()}, True),
            "E2E P99": ({k: v.e2e_ms[2] for k, v in runs.items()}, True),
            "throughput": ({k: v.throughput_tokens_s for k, v in runs.items()}, False),
        }
        for label, (fig, lower) in figures.items():
            best = (min if lower else max)(others, key=fig.__getitem__)
            ref = fig[best]
            ratio = fig["kvcompass"] / ref if ref > 0 else float("nan")
            if not math.isfinite(ratio):
                verdicts.append(f"{label} not comparable ({best}'s is {ref:g})")
                continue
            won = ratio < 1 if lower else ratio > 1
            verdicts.append(f"{label} {ratio:.2f}x {best}'s ({'better' if won else 'equal' if ratio == 1 else 'worse'})")
        lines.append(f"kvcompass against the best other: {'; '.join(verdicts)}")
        lines += [note] if short else []
    return "\n".join(lines).lstrip("\n")


def _sent_short(runs: Mapping[str, Summary]) -> list[str]:
    """The runs sent under nine tenths of their drawn schedule's rate mid-run (open loop only),
    as ``scheme (R/s)``."""
    return [f"{k} ({v.sent_mid_req_s:.4g}/s)" for k, v in runs.items() if v.drawn_mid_req_s > 0 and v.sent_mid_req_s < 0.9 * v.drawn_mid_req_s]


def summaries_to_frame(results: Results) -> pl.DataFrame:
    """One row per run: ``scheme``, ``rate`` (as given), ``rate_req_s``, ``topology``, the
    :func:`summary_row` figures, then P90s, means, token counts and local hit rate."""
    rows: list[dict[str, object]] = []
    for scheme, by_rate in results.items():
        for rate, s in by_rate.items():
            row: dict[str, object] = {"scheme": scheme, "rate": rate, "rate_req_s": float(rate), "topology": s.topology}
            row.update(summary_row(s))
            row.update(
                {
                    "ttft_p90_ms": s.ttft_ms[1],
                    "e2e_p90_ms": s.e2e_ms[1],
                    "mean_ttft_ms": s.mean_ttft_ms,
                    "mean_queue_ms": s.mean_queue_ms,
                    "local_hit_rate": s.local_hit_rate,
                    "reused_tokens": s.reused_tokens,
                    "recomputed_tokens": s.recomputed_tokens,
                    "token_reuse": s.token_reuse,
                }
            )
            rows.append(row)
    schema: dict[str, type[pl.DataType]] = {
        "scheme": pl.String,
        "rate": pl.String,
        "rate_req_s": pl.Float64,
        "topology": pl.String,
        "ttft_p50_ms": pl.Float64,
        "ttft_p99_ms": pl.Float64,
        "e2e_p50_ms": pl.Float64,
        "e2e_p99_ms": pl.Float64,
        "throughput_tok_s": pl.Float64,
        "hit_rate": pl.Float64,
        "xregion_hit_rate": pl.Float64,
        "false_hit_rate": pl.Float64,
        "peak_load_factor": pl.Float64,
        "requests": pl.Int64,
        "demoted_blocks": pl.Int64,
        "evicted_blocks": pl.Int64,
        "kv_waits": pl.Int64,
        "sent_req_s": pl.Float64,
        "sent_mid_req_s": pl.Float64,
        "ttft_p90_ms": pl.Float64,
        "e2e_p90_ms": pl.Float64,
        "mean_ttft_ms": pl.Float64,
        "mean_queue_ms": pl.Float64,
        "local_hit_rate": pl.Float64,
        "reused_tokens": pl.Int64,
        "recomputed_tokens": pl.Int64,
        "token_reuse": pl.Float64,
    }
    return pl.DataFrame(rows, schema=schema, orient="row") if rows else pl.DataFrame(schema=schema)


_RECORD_SCHEMA: dict[str, type[pl.DataType]] = {
    "scheme": pl.String,
    "rate": pl.String,
    "id": pl.Int64,
    "region": pl.String,
    "worker": pl.String,
    "worker_region": pl.String,
    "arrival_ms": pl.Float64,
    "ttft_ms": pl.Float64,
    "e2e_ms": pl.Float64,
    "queue_ms": pl.Float64,
    "input_tokens": pl.Int64,
    "output_tokens": pl.Int64,
    "vram_hit": pl.Int64,
    "dram_hit": pl.Int64,
    "reused": pl.Int64,
    "recomputed": pl.Int64,
    "claimed": pl.Int64,
    "false_hit": pl.Boolean,
}


def records_to_frame(results: Results) -> pl.DataFrame:
    """Every completed request of every run, tagged with its ``scheme`` and ``rate`` (built from
    the runs' record columns, not an object per request)."""
    frames = []
    for scheme, by_rate in results.items():
        for rate, s in by_rate.items():
            t = s.records
            names = np.array(t.names, dtype=object)
            reused = t.column("vram_hit") + t.column("dram_hit")
            cols: dict[str, object] = {
                "scheme": [scheme] * len(t),
                "rate": [rate] * len(t),
                "id": t.column("id"),
                "region": names[t.column("region")].tolist(),
                "worker": names[t.column("worker")].tolist(),
                "worker_region": names[t.column("worker_region")].tolist(),
                "arrival_ms": t.column("arrival_ms"),
                "ttft_ms": t.column("ttft_ms"),
                "e2e_ms": t.column("e2e_ms"),
                "queue_ms": t.column("queue_ms"),
                "input_tokens": t.column("input_tokens"),
                "output_tokens": t.column("output_tokens"),
                "vram_hit": t.column("vram_hit"),
                "dram_hit": t.column("dram_hit"),
                "reused": reused,
                "recomputed": t.column("input_tokens") - reused,
                "claimed": t.column("claimed"),
                "false_hit": t.column("claimed") > reused,
            }
            frames.append(pl.DataFrame(cols, schema=_RECORD_SCHEMA))
    return pl.concat(frames) if frames else pl.DataFrame(schema=_RECORD_SCHEMA)


def write_tables(out_dir: str | Path, frame: pl.DataFrame, records: pl.DataFrame) -> list[Path]:
    """Write the summary ``frame`` and per-request ``records`` as CSV and parquet; returns the paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "summary.csv", out / "summary.parquet", out / "requests.csv", out / "requests.parquet"]
    frame.write_csv(paths[0])
    frame.write_parquet(paths[1])
    records.write_csv(paths[2])
    records.write_parquet(paths[3])
    return paths


def _save(fig: Figure, path: Path) -> Path:
    FigureCanvasAgg(fig)
    fig.savefig(path, dpi=110)
    return path


def _rates(results: Results) -> list[str]:
    """Every rate that appears, in ascending numeric order."""
    seen = {rate for by_rate in results.values() for rate in by_rate}
    return sorted(seen, key=float)


def write_figures(out_dir: str | Path, results: Results) -> list[Path]:
    """Draw the five figures of :data:`FIGURES` (and :data:`ABLATION_FIGURE` when ablations ran
    beside ``kvcompass``) from ``results`` into ``out_dir``; returns the paths. ``ValueError``
    when there is no run to draw."""
    if not any(results.values()):
        raise ValueError("no runs to draw")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rates = _rates(results)
    schemes = [s for s, by_rate in results.items() if by_rate]
    topology = next(iter(results[schemes[0]].values())).topology
    paths: list[Path] = []

    # P99 TTFT vs offered rate, one line per scheme.
    fig = Figure(figsize=(6.4, 4.2), layout="constrained")
    ax = fig.add_subplot()
    for scheme in schemes:
        pts = sorted((float(r), s.ttft_ms[2]) for r, s in results[scheme].items())
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=scheme)
    ax.set_xlabel("rate as drawn (req/s; a run may send less, see sent_mid_req_s)")
    ax.set_ylabel("P99 TTFT (ms)")
    ax.set_title(f"P99 TTFT vs load ({topology})")
    ax.grid(True, alpha=0.3)
    ax.legend()
    paths.append(_save(fig, out / FIGURES[0]))

    # TTFT CDF, one panel per rate.
    fig = Figure(figsize=(4.2 * len(rates), 3.8), layout="constrained")
    axes = fig.subplots(1, len(rates), squeeze=False)[0]
    for ax, rate in zip(axes, rates):
        for scheme in schemes:
            s = results[scheme].get(rate)
            if s is None or not s.records:
                continue
            x = np.sort(np.array([r.ttft_ms for r in s.records], dtype=np.float64))
            y = np.arange(1, x.size + 1) / x.size
            ax.step(x, y, where="post", label=scheme)
        ax.set_xscale("log")
        ax.set_xlabel("TTFT (ms)")
        ax.set_title(f"{rate} req/s")
        ax.grid(True, alpha=0.3)
    axes[0].set_ylabel("fraction of requests")
    axes[0].legend()
    paths.append(_save(fig, out / FIGURES[1]))

    # Throughput: grouped bars (rates on x, one bar per scheme).
    fig = Figure(figsize=(6.4, 4.2), layout="constrained")
    ax = fig.add_subplot()
    width = 0.8 / len(schemes)
    xs = np.arange(len(rates), dtype=np.float64)
    for i, scheme in enumerate(schemes):
        vals = [results[scheme][r].throughput_tokens_s if r in results[scheme] else 0.0 for r in rates]
        ax.bar(xs + (i - (len(schemes) - 1) / 2) * width, vals, width, label=scheme)
    ax.set_xticks(xs, [f"{r} req/s" for r in rates])
    ax.set_ylabel("throughput (tokens/s)")
    ax.set_title("Throughput (prompt + generated tokens)")
    ax.legend()
    paths.append(_save(fig, out / FIGURES[2]))

    # Load-factor heatmap of the first scheme's run at its highest rate, peaks marked.
    first = schemes[0]
    rate = max(results[first], key=float)
    s = results[first][rate]
    lf = s.load_factor
    fig = Figure(figsize=(8.0, 0.3 * max(len(s.workers), 8) + 1.5), layout="constrained")
    ax = fig.add_subplot()
    if lf.size:
        im = ax.imshow(lf, aspect="auto", origin="lower", cmap="viridis", interpolation="nearest")
        fig.colorbar(im, ax=ax, label="load factor (utilisation / fleet mean)")
        busiest = np.argmax(lf, axis=0)
        cols = np.arange(lf.shape[1])
        active = lf[busiest, cols] > 0
        ax.scatter(cols[active], busiest[active], s=10, c="white", marker="o", label="busiest worker per window")
        # The largest single cell, labelled with its own value: the peak load factor (the
        # hottest worker over the whole run, in the title) is another quantity (found in
        # review: the star carried the peak's value on a cell of 6.3).
        w, k = np.unravel_index(int(np.argmax(lf)), lf.shape)
        ax.scatter([k], [w], s=160, c="red", marker="*", label=f"largest window {float(lf[w, k]):.2f}")
        ax.legend(loc="upper right", fontsize="small")
    ax.set_yticks(np.arange(len(s.workers)), list(s.workers))
    ax.set_xlabel(f"time window ({s.window_ms:g} ms each)")
    ax.set_title(f"Load factor: {first} at {rate} req/s ({s.topology}); peak load factor {s.peak_load_factor:.2f}")
    paths.append(_save(fig, out / FIGURES[3]))

    # Reused vs recomputed prompt tokens, stacked per (scheme, rate).
    fig = Figure(figsize=(max(6.4, 0.9 * len(schemes) * len(rates) + 2), 4.2), layout="constrained")
    ax = fig.add_subplot()
    labels: list[str] = []
    reused: list[int] = []
    recomputed: list[int] = []
    for scheme in schemes:
        for rate in rates:
            if rate in results[scheme]:
                s = results[scheme][rate]
                labels.append(f"{scheme}\n{rate} req/s")
                reused.append(s.reused_tokens)
                recomputed.append(s.recomputed_tokens)
    pos = np.arange(len(labels), dtype=np.float64)
    ax.bar(pos, reused, 0.7, label="reused")
    ax.bar(pos, recomputed, 0.7, bottom=reused, label="recomputed")
    ax.set_xticks(pos, labels, fontsize="small")
    ax.set_ylabel("prompt tokens")
    ax.set_title("Prefill tokens reused vs recomputed")
    ax.legend()
    paths.append(_save(fig, out / FIGURES[4]))

    # Ablations against full KVCompass: ratio of P99 TTFT and of throughput, per rate.
    full = results.get("kvcompass") or {}
    ablations = [a for a in schemes if a.startswith("kvcompass-") and any(r in full for r in results[a])]
    if full and ablations:
        fig = Figure(figsize=(max(6.4, 0.7 * len(ablations) * len(rates) + 3), 6.4), layout="constrained")
        top, bottom = fig.subplots(2, 1, sharex=True)
        width = 0.8 / len(rates)
        xs = np.arange(len(ablations), dtype=np.float64)
        seen: dict[str, list[float]] = {"P99 TTFT": [], "throughput": []}
        for j, rate in enumerate(rates):
            base = full.get(rate)
            if base is None:
                continue
            p99 = [results[a][rate].ttft_ms[2] / base.ttft_ms[2] if rate in results[a] and base.ttft_ms[2] > 0 else np.nan for a in ablations]
            tput = [results[a][rate].throughput_tokens_s / base.throughput_tokens_s if rate in results[a] and base.throughput_tokens_s > 0 else np.nan for a in ablations]
            off = (j - (len(rates) - 1) / 2) * width
            seen["P99 TTFT"] += [v for v in p99 if np.isfinite(v) and v > 0]
            seen["throughput"] += [v for v in tput if np.isfinite(v) and v > 0]
            top.bar(xs + off, p99, width, label=f"{rate} req/s")
            bottom.bar(xs + off, tput, width, label=f"{rate} req/s")
        for ax, what in ((top, "P99 TTFT"), (bottom, "throughput")):
            ax.axhline(1.0, color="black", linewidth=0.8)
            vals = seen[what]
            if vals and max(max(vals), 1.0) / min(min(vals), 1.0) > 20:  # an ablation off by orders of magnitude
                ax.set_yscale("log")
            ax.set_ylabel(f"{what} / KVCompass's")
            ax.grid(True, axis="y", alpha=0.3)
        top.set_title("Ablations vs full KVCompass (worse: P99 above 1, throughput below 1)")
        top.legend(fontsize="small")
        bottom.set_xticks(xs, [a.removeprefix("kvcompass-") for a in ablations], rotation=30, ha="right")
        paths.append(_save(fig, out / ABLATION_FIGURE))
    return paths
