"""The ``kvcompass`` command."""

from __future__ import annotations

import argparse
import json
import sys
import textwrap
import time
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

from kvcompass.discovery.plan import LevelPlan
from kvcompass.discovery.topology import Topology, builtin_topologies, load_topology
from kvcompass.errors import InvalidArgumentError, KVCompassError

if TYPE_CHECKING:
    from kvcompass.sim.capacity import Capacity
    from kvcompass.sim.metrics import Summary
    from kvcompass.sim.workload import Request

__all__ = ["DEFAULT_MIXED_REQUESTS", "format_plan", "main"]

# Requests ``--trace mixed`` generates when ``--max-requests`` is not given.
DEFAULT_MIXED_REQUESTS = 1000


def _lengths(xs: Sequence[int]) -> str:
    return " ".join(str(x) for x in xs) if xs else "(none: no match is worth crossing)"


def format_plan(plan: LevelPlan) -> str:
    """The plan as an operator reads it: per edge region, the RTT, n1 and lengths toward each
    region; then what each region's workers register at, and the table groups."""
    t = plan.topology
    lay = plan.layout()
    out: list[str] = []
    out.append(f"Topology {t.name}: {len(t.workers)} workers ({len(lay.workers)} indexed) in {len(t.regions)} regions")
    if t.description:
        out.extend(textwrap.wrap(t.description, width=100, initial_indent="  ", subsequent_indent="  ", break_on_hyphens=False))
    out.append(f"RTT matrix: {t.rtt.source}")
    out.append(
        f"KV block {t.block_size} tokens, {t.levels} levels, own-region minimum {t.own_region_min} doubling, "
        f"max prefix {t.max_prefix}; {t.value_bits}-bit values (<= {t.value_bits // 2} workers per table), "
        f"{t.shards} shards, {t.fp_bits}-bit fingerprints"
    )
    names = {r.name: (r.name if r.aws_region == r.name else f"{r.name} ({r.aws_region})") for r in t.regions}
    width = max(len(n) for n in names.values())
    for o in plan.edge_regions:
        edges = t.region(o).edges
        out.append("")
        out.append(f"Edge region {names[o]}, {edges} edge{'s' if edges != 1 else ''}: prefix lengths queried (tokens)")
        out.append(f"  {'target':<{width}}  {'RTT ms':>7}  {'beta ms/tok':>11}  {'n1':>7}  lengths")
        for r in plan.target_regions:
            own = r == o
            n1 = "own" if own else f"{plan.n1(o, r):.0f}"
            out.append(f"  {names[r]:<{width}}  {plan.rtt_ms(o, r):>7.1f}  {plan.beta(r):>11.4g}  {n1:>7}  {_lengths(plan.lengths(o, r))}")
    out.append("")
    out.append("Registration: lengths each region's workers register a cached prefix at (union over all edges)")
    for r in plan.target_regions:
        reg = plan.registration(r)
        out.append(f"  {names[r]:<{width}}  {len(reg):>3}  {_lengths(reg)}")
    out.append("")
    out.append(f"Tables: {len(lay.tables)}, each split into {lay.shards} shards")
    for s in lay.tables:
        out.append(f"  table {s.table_id:>3}  {names[s.region]:<{width}}  {len(s.workers):>3} workers  {' '.join(s.workers)}")
    skipped = [w.id for w in t.workers if w.role == "decode"]
    if skipped:
        out.append(f"  not indexed (decode workers, paper appendix C): {' '.join(skipped)}")
    return "\n".join(out) + "\n"


def _plan(args: argparse.Namespace) -> int:
    try:
        plan = LevelPlan(load_topology(args.topology, rtt_path=args.rtt_matrix))
    except KVCompassError as e:
        print(f"kvcompass plan: error: {e}", file=sys.stderr)
        return 1
    if args.json:
        sys.stdout.write(json.dumps(plan.to_json(), indent=2) + "\n")
    else:
        sys.stdout.write(format_plan(plan))
    return 0


class _UsageError(Exception):
    """A bad ``simulate`` argument: one line on stderr, exit 2."""


def _parse_rates(text: str) -> list[str]:
    rates = [r.strip() for r in text.split(",")]
    for r in rates:
        try:
            v = float(r)
        except ValueError:
            raise _UsageError(f"--rates: {r!r} is not a number (give req/s, comma-separated)") from None
        if not (v > 0 and v != float("inf")):
            raise _UsageError(f"--rates: {r!r} must be > 0 req/s")
    if len({float(r) for r in rates}) != len(rates):
        raise _UsageError(f"--rates: {text!r} repeats a rate")
    return rates


def _parse_loads(text: str) -> list[float]:
    loads: list[float] = []
    for part in text.split(","):
        try:
            v = float(part.strip())
        except ValueError:
            raise _UsageError(f"--load: {part.strip()!r} is not a number (give fractions of the no-reuse capacity, e.g. 0.5,0.9,1.1)") from None
        if not (v > 0 and v != float("inf")):
            raise _UsageError(f"--load: {part.strip()!r} must be > 0")
        loads.append(v)
    if len(set(loads)) != len(loads):
        raise _UsageError(f"--load: {text!r} repeats a load")
    return loads


def _parse_region_weights(text: str, topology: Topology) -> list[float]:
    """``REGION=W,...`` -> one weight per region of ``topology`` in its order (unnamed: 0)."""
    names = topology.region_names
    got: dict[str, float] = {}
    for part in text.split(","):
        region, sep, value = part.strip().partition("=")
        region = region.strip()
        if not sep or not region:
            raise _UsageError(f"--region-weights: {part.strip()!r} is not REGION=WEIGHT")
        if region not in names:
            raise _UsageError(f"--region-weights: unknown region {region!r} (regions of {topology.name}: {', '.join(names)})")
        if region in got:
            raise _UsageError(f"--region-weights: region {region!r} given twice")
        try:
            w = float(value)
        except ValueError:
            raise _UsageError(f"--region-weights: weight {value.strip()!r} of {region!r} is not a number") from None
        if not (w >= 0 and w != float("inf")):
            raise _UsageError(f"--region-weights: weight of {region!r} must be finite and >= 0, got {value.strip()}")
        got[region] = w
    if not sum(got.values()) > 0:
        raise _UsageError("--region-weights: at least one region needs a weight > 0")
    return [got.get(r, 0.0) for r in names]


def _trace_rate(requests: Sequence[Request]) -> str:
    """A trace's own offered load as the results' rate key: (N - 1) requests over the span."""
    if len(requests) < 2 or not requests[-1].arrival_ms > requests[0].arrival_ms:
        raise _UsageError("--arrivals trace: the replayed requests span no time, so they have no rate of their own (replay more requests, or give --rates)")
    return f"{(len(requests) - 1) * 1e3 / (requests[-1].arrival_ms - requests[0].arrival_ms):.6g}"


def _parse_schemes(text: str) -> list[str]:
    from kvcompass.sim.schemes import SCHEMES

    if text.strip() == "all":
        return list(SCHEMES)
    names = [n.strip() for n in text.split(",")]
    for n in names:
        if n not in SCHEMES:
            raise _UsageError(f"--schemes: unknown scheme {n!r} (known: {', '.join(SCHEMES)}, or all)")
    if len(set(names)) != len(names):
        raise _UsageError(f"--schemes: {text!r} repeats a scheme")
    return names


def _sensitivity(args: argparse.Namespace, topology: Topology, requests: list[Request], base: Summary | None) -> list[dict[str, float | str]]:
    """Paper table 4 for kvcompass on ``requests``: printed as a polars table, CSV under --out."""
    import polars as pl

    from kvcompass.sim.engine import simulate
    from kvcompass.sim.sensitivity import DEFAULT_SWEEPS, sweep

    total = sum(len(v) for v in DEFAULT_SWEEPS.values())
    done = [0]

    def run(**knob: float) -> Summary:
        done[0] += 1
        print(f"[sensitivity {done[0]}/{total}] kvcompass {knob or 'base'} ...", end="", file=sys.stderr, flush=True)
        t0 = time.perf_counter()
        s = simulate(
            topology,
            requests,
            "kvcompass",
            seed=args.seed,
            wan_jitter=knob.get("wan_jitter", 0.0),
            patch_loss=knob.get("patch_loss", 0.0),
            patch_delay_ms=knob.get("patch_delay_ms", 0.0),
            gpu_sharing=args.gpu_sharing,
            max_batched_tokens=args.max_batched_tokens,
        )
        print(f" done in {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
        return s

    rows = [r.as_dict() for r in sweep(run, base=base)]
    frame = pl.DataFrame(rows)
    with pl.Config(tbl_rows=-1, tbl_hide_dataframe_shape=True):
        print("Sensitivity (kvcompass, paper table 4):")
        print(frame)
    if args.out is not None:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        frame.write_csv(Path(args.out) / "sensitivity.csv")
    return rows


def _false_hits(args: argparse.Namespace, topology: Topology, results: dict[str, dict[str, Summary]]) -> dict[str, object]:
    """Paper table 5: structural rates of the keyless table beside each run's end-to-end rate."""
    from kvcompass.sim.sensitivity import structural_false_hit_rate

    structural = {str(f): structural_false_hit_rate(f, seed=args.seed) for f in sorted({0, 8, 16, topology.fp_bits})}
    print("False hits (paper table 5): structural = never-inserted keys answered by a view at 95 % slot load;")
    print("end-to-end = requests whose worker reused less than the edge claimed")
    for f, r in structural.items():
        print(f"  structural, fp_bits={f:>2}: {100 * r.rate:8.4f} %  ({r.probes} probes, load {r.load:.3f})")
    e2e = {s: {rate: v.false_hit_rate for rate, v in by_rate.items()} for s, by_rate in results.items()}
    for s, by_rate in e2e.items():
        print(f"  end-to-end, {s}: " + ", ".join(f"{rate} req/s {100 * v:.4f} %" for rate, v in by_rate.items()))
    return {"structural": {f: r.rate for f, r in structural.items()}, "end_to_end": e2e}


def _simulate(args: argparse.Namespace) -> int:
    from kvcompass.sim.cells import run_cells
    from kvcompass.sim.capacity import Capacity
    from kvcompass.sim.metrics import Summary
    from kvcompass.sim.workload import MOONCAKE_BLOCK_SIZE, RateMode, Request, load_trace, resolve_trace, synthetic_mixed

    loads: list[float] | None = None
    if args.rates is not None and args.load is not None:
        raise _UsageError("give --rates (req/s) or --load (fractions of the capacity), not both")
    if args.arrivals == "trace":
        if args.rates is not None or args.load is not None:
            raise _UsageError(f"--arrivals trace replays the trace's own timestamps: leave out {'--rates' if args.rates is not None else '--load'}")
        rates: list[str] = []
    elif args.load is not None:
        loads = _parse_loads(args.load)
        rates = []
    elif args.rates is None:
        raise _UsageError("--rates or --load is required (or --arrivals trace, to replay a trace's own timestamps)")
    else:
        rates = _parse_rates(args.rates)
    schemes = _parse_schemes(args.schemes)
    for name in ("max_requests", "block_size", "tenants"):
        v = getattr(args, name)
        if v is not None and v < 1:
            raise _UsageError(f"--{name.replace('_', '-')} must be >= 1, got {v}")
    if args.seed < 0:
        raise _UsageError(f"--seed must be >= 0, got {args.seed}")
    for name in ("wan_jitter", "patch_loss"):
        v = getattr(args, name)
        if not 0 <= v <= 100 or (name == "patch_loss" and v == 100):
            raise _UsageError(f"--{name.replace('_', '-')} must be a percentage in [0, 100{')' if name == 'patch_loss' else ']'}, got {v}")
    if not args.patch_delay_ms >= 0:
        raise _UsageError(f"--patch-delay-ms must be >= 0, got {args.patch_delay_ms}")
    if args.jobs < 1:
        raise _UsageError(f"--jobs must be >= 1, got {args.jobs}")
    if args.max_batched_tokens < 1:
        raise _UsageError(f"--max-batched-tokens must be >= 1, got {args.max_batched_tokens}")
    faults = {"wan_jitter": args.wan_jitter / 100, "patch_loss": args.patch_loss / 100, "patch_delay_ms": args.patch_delay_ms}
    topology = load_topology(args.topology, rtt_path=args.rtt_matrix)
    trace_path = None if args.trace == "mixed" else resolve_trace(args.trace)
    arrivals: RateMode = args.arrivals or ("poisson" if trace_path is None else "rescale")
    if trace_path is None and arrivals != "poisson":
        raise _UsageError(f"--arrivals {arrivals}: the mixed workload has no timestamps of its own; its arrivals are Poisson at each rate")
    weights = None if args.region_weights is None else _parse_region_weights(args.region_weights, topology)

    def workload(rate: float | None) -> list[Request]:
        if trace_path is None:
            assert rate is not None
            n = args.max_requests or DEFAULT_MIXED_REQUESTS
            # K tenants, each replaying the workload from its own prompt pools behind its own
            # system prompt (the paper's Mixed at scale); one tenant is the plain workload.
            return synthetic_mixed(
                n, regions=topology, weights=weights, seed=args.seed, rate=rate, block_size=args.block_size or topology.block_size, tenants=args.tenants, private_pools=args.tenants > 1
            )
        return load_trace(
            trace_path,
            args.block_size or MOONCAKE_BLOCK_SIZE,
            regions=topology,
            weights=weights,
            seed=args.seed,
            rate=rate,
            mode=arrivals,
            max_requests=args.max_requests,
            tenants=args.tenants,
            ties="keep" if args.keep_ties or arrivals == "trace" else "spread",
        )

    own: list[Request] | None = None
    if arrivals == "trace":  # one run per scheme at the trace's own times, keyed by its rate
        own = workload(None)
        rates = [_trace_rate(own)]
    capacity = None
    if loads is not None:
        from kvcompass.sim.capacity import no_reuse_capacity, rates_for_loads

        # Only the prompts' lengths matter, and they do not depend on the rate (the synthetic
        # workload's first N differ by a few sessions: well under 0.1 % of the capacity).
        try:
            capacity = no_reuse_capacity(topology, workload(1.0), gpu_sharing=args.gpu_sharing, max_batched_tokens=args.max_batched_tokens)
            rates = rates_for_loads(capacity, loads)
        except InvalidArgumentError as e:
            raise _UsageError(f"--load: {e}") from None
        print(
            f"no-reuse capacity of {topology.name} for this workload: {capacity.req_per_s:.1f} req/s ({args.gpu_sharing} sharing, bound by "
            f"{capacity.bound}; mean prompt {capacity.mean_input_tokens:.0f} tokens, output {capacity.mean_output_tokens:.0f}); "
            + ", ".join(f"load {load:g} = {rate} req/s" for load, rate in zip(loads, rates)),
            file=sys.stderr,
            flush=True,
        )

    workloads = {rate: own if own is not None else workload(float(rate)) for rate in rates}
    options = {"seed": args.seed, **faults, "gpu_sharing": args.gpu_sharing, "max_batched_tokens": args.max_batched_tokens}
    cells = [(rate, scheme) for rate in rates for scheme in schemes]

    def started(k: int, total: int, scheme: str, rate: str, n: int) -> None:
        print(f"[{k}/{total}] {scheme} at {rate} req/s: {n} requests ...", end="", file=sys.stderr, flush=True)

    def running(k: int, total: int, scheme: str, rate: str, done: int, n: int) -> None:
        # On a terminal the run's line counts its completed requests in place (a progress bar).
        bar = "#" * (20 * done // n)
        print(f"\r[{k}/{total}] {scheme} at {rate} req/s: [{bar:<20}] {done}/{n} requests ...", end="", file=sys.stderr, flush=True)

    def finished(k: int, total: int, scheme: str, rate: str, n: int, wall: float) -> None:
        if args.jobs == 1:
            print(f" done in {wall:.1f} s", file=sys.stderr, flush=True)
        else:
            print(f"[{k}/{total}] {scheme} at {rate} req/s: {n} requests done in {wall:.1f} s", file=sys.stderr, flush=True)

    t0 = time.perf_counter()
    tty = sys.stderr.isatty()
    results: dict[str, dict[str, Summary]] = run_cells(
        topology, workloads, cells, options, jobs=args.jobs, on_start=started if args.jobs == 1 else None, on_done=finished, on_progress=running if tty and args.jobs == 1 else None
    )
    if args.jobs > 1:
        print(f"{len(cells)} runs on {min(args.jobs, len(cells))} processes in {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
    extra: dict[str, object] = {}
    if args.sensitivity:
        extra["sensitivity"] = _sensitivity(args, topology, own if own is not None else workload(float(rates[0])), results.get("kvcompass", {}).get(rates[0]) if not any(faults.values()) else None)
    if args.false_hits:
        extra["false_hits"] = _false_hits(args, topology, results)
    if args.out is not None:
        from kvcompass.sim.report import records_to_frame, summaries_to_frame, write_figures, write_tables

        out = Path(args.out)
        paths = write_tables(out, summaries_to_frame(results), records_to_frame(results))
        paths += write_figures(out, results)
        paths.append(_write_run(out, args, topology, _load_doc(capacity, loads, rates)))
        print(f"wrote {len(paths)} files to {out}: {' '.join(p.name for p in paths)}")
    from kvcompass.sim.report import summary_row

    doc: dict[str, object] = {"results": {s: {r: summary_row(results[s][r]) for r in rates} for s in schemes}}
    doc.update(_load_doc(capacity, loads, rates))
    doc.update(extra)
    sys.stdout.write(json.dumps(doc) + "\n")
    return 0


def _load_doc(capacity: Capacity | None, loads: list[float] | None, rates: list[str]) -> dict[str, object]:
    """With ``--load``: the capacity the rates were computed from and each rate's load."""
    if capacity is None or loads is None:
        return {}
    doc = capacity.as_dict()
    doc.pop("per_worker")
    return {"capacity": doc, "loads": dict(zip(rates, loads))}


def _write_run(out: Path, args: argparse.Namespace, topology: Topology, extra: dict[str, object] | None = None) -> Path:
    """``run.json``: what produced the tables beside it (every option as given, the topology's
    name, the package version and, in a git checkout, the commit), so a result can be rerun."""
    import subprocess

    from kvcompass import __version__

    package = Path(__file__).resolve().parent
    commit: str | None = None
    try:  # only when this package is the checkout's own (not an installed copy under a repo)
        done = subprocess.run(["git", "rev-parse", "--show-toplevel", "HEAD"], capture_output=True, text=True, timeout=10, cwd=package)
        lines = done.stdout.split()
        if done.returncode == 0 and len(lines) == 2 and Path(lines[0]).resolve() / "kvcompass" == package:
            commit = lines[1]
    except (OSError, subprocess.SubprocessError):
        commit = None
    options = {k: v for k, v in sorted(vars(args).items()) if k not in ("command", "func") and not callable(v)}
    doc = {"command": "kvcompass simulate", "options": options, "topology": topology.name, "version": __version__, "git_commit": commit, **(extra or {})}
    path = out / "run.json"
    path.write_text(json.dumps(doc, indent=2, default=str) + "\n")
    return path


def _simulate_main(args: argparse.Namespace) -> int:
    try:
        return _simulate(args)
    except (_UsageError, KVCompassError, OSError) as e:
        msg = " ".join(str(e).split())
        print(f"kvcompass simulate: error: {msg}", file=sys.stderr)
        return 2


def _reproduce_main(args: argparse.Namespace) -> int:
    from kvcompass.sim.reproduce import reproduce

    try:
        if args.jobs < 1:
            raise _UsageError(f"--jobs must be >= 1, got {args.jobs}")
        if args.requests is not None and args.requests < 100:
            raise _UsageError(f"--requests must be >= 100, got {args.requests}")
        if args.seed < 0:
            raise _UsageError(f"--seed must be >= 0, got {args.seed}")
        rows = reproduce(args.figure, args.out, quick=args.quick, jobs=args.jobs, seed=args.seed, requests=args.requests)
    except (_UsageError, KVCompassError, OSError) as e:
        print(f"kvcompass reproduce: error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    agree = sum(1 for r in rows if r.note.startswith("agrees"))
    print(f"figure {args.figure}: {len(rows)} rows, {agree} agree within 1.5x; wrote {args.out}/report.md, report.json, run.json, figure{args.figure}.png")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvcompass", description="KVCompass: a KV-cache discovery plane for Internet-scale LLM serving")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="build views from patches across three regions and route prompts (the built-in default)")
    demo.add_argument("--prompts", type=int, default=24, help="prompts to cache and route (default 24)")
    demo.add_argument("--prompt-tokens", type=int, default=4096, help="tokens per prompt (default 4096)")
    demo.add_argument("--seed", type=int, default=7)
    plan = sub.add_parser("plan", help="print a topology's level plan, registration lengths and tables")
    plan.add_argument(
        "--topology",
        required=True,
        metavar="NAME_OR_PATH",
        help=f"a built-in topology ({', '.join(builtin_topologies())}) or a TOML file",
    )
    plan.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    plan.add_argument(
        "--rtt-matrix",
        metavar="CSV",
        default=None,
        help="RTT matrix to use when the topology has none of its own (default: ../shared/data, else the bundled excerpt)",
    )
    rep = sub.add_parser(
        "reproduce",
        help="run one of the paper's figures' grids and write the paper's numbers beside ours (report.md, report.json, the figure)",
        description="Reproducible here: figures 12 and 14 (Mixed). Absent so far: figures 11, 13, 15-18, tables 4-5, "
        "the WildChat/LMSYS columns (no chat traces offline) and a Ray fan-out.",
    )
    rep.add_argument("--figure", required=True, metavar="N", help="the paper's figure: 12 or 14")
    rep.add_argument("--quick", action="store_true", help="fewer rates and requests (fits in 10 minutes on 2 cores)")
    rep.add_argument("--jobs", type=int, default=1, metavar="N", help="run up to N simulations side by side in worker processes (default 1)")
    rep.add_argument("--requests", type=int, default=None, metavar="N", help="requests a run (default 12000 with --quick, else 100000)")
    rep.add_argument("--seed", type=int, default=1)
    rep.add_argument("--out", required=True, metavar="DIR", help="where report.md, report.json, run.json and the figure go")
    sim = sub.add_parser("simulate", help="replay a workload through the simulator under each scheme and rate; last stdout line is one JSON object")
    sim.add_argument("--topology", required=True, metavar="NAME_OR_PATH", help=f"a built-in topology ({', '.join(builtin_topologies())}) or a TOML file")
    sim.add_argument(
        "--trace",
        required=True,
        metavar="PATH_OR_NAME",
        help="a Mooncake-schema JSONL file, a shared trace name (conversation, synthetic), or mixed: the synthetic "
        f"Mixed workload ({DEFAULT_MIXED_REQUESTS} requests unless --max-requests)",
    )
    sim.add_argument(
        "--block-size",
        type=int,
        default=None,
        metavar="TOKENS",
        help="tokens per trace hash id (default 512, the Mooncake traces'); for mixed, the prompt block (default: the topology's)",
    )
    sim.add_argument("--rates", default=None, metavar="R1,R2,...", help="offered loads in req/s (traces are rescaled to each, or see --arrivals; mixed arrivals are Poisson)")
    sim.add_argument(
        "--load",
        default=None,
        metavar="L1,L2,...",
        help="offered loads as fractions of the workload's no-reuse capacity on the topology (computed under the engine's "
        "step model, printed, and written to run.json and the JSON line); instead of --rates, results keyed by the computed rate",
    )
    sim.add_argument(
        "--arrivals",
        choices=("rescale", "poisson", "trace"),
        default=None,
        help="how a trace's requests arrive: rescale (its times stretched to each rate; default), poisson (a Poisson "
        "process at each rate, the trace's order kept), trace (its own timestamps, no --rates; results keyed by its own rate)",
    )
    sim.add_argument(
        "--jobs",
        type=int,
        default=1,
        metavar="N",
        help="run up to N (scheme, rate) simulations side by side in worker processes (default 1; same results, "
        "in the same order; each process holds its own copy of the workload and of one run's caches)",
    )
    sim.add_argument(
        "--region-weights",
        default=None,
        metavar="REGION=W,...",
        help="share of sessions starting in each region (unnamed regions: 0; default: proportional to prefill capacity)",
    )
    sim.add_argument("--schemes", default="all", metavar="S1,S2,...|all", help="routing schemes to compare (default all)")
    sim.add_argument("--seed", type=int, default=0, help="seed for the workload's regions and arrivals and the simulator (default 0)")
    sim.add_argument("--max-requests", type=int, default=None, metavar="N", help="replay at most the first N requests")
    sim.add_argument("--out", default=None, metavar="DIR", help="write CSV/parquet tables and PNG figures here")
    sim.add_argument("--rtt-matrix", metavar="CSV", default=None, help="RTT matrix for a topology that has none of its own")
    sim.add_argument(
        "--tenants",
        type=int,
        default=1,
        metavar="K",
        help="K tenants (default 1; the rate is the total): on a trace, K copies each in a private namespace (vLLM cache salt); "
        "on mixed, K tenants each replaying the workload from its own prompt pools behind its own system prompt (the paper's Mixed uses 50)",
    )
    sim.add_argument(
        "--keep-ties",
        action="store_true",
        help="replay requests that share a logged timestamp simultaneously (default: spread over the interval to the next one)",
    )
    sim.add_argument("--wan-jitter", type=float, default=0.0, metavar="PCT", help="every WAN traversal varies uniformly by +-PCT %% around the matrix (routing scores the matrix)")
    sim.add_argument("--patch-loss", type=float, default=0.0, metavar="PCT", help="each patch batch is lost on its way to each edge with this probability (%%); edges repair it")
    sim.add_argument("--patch-delay-ms", type=float, default=0.0, metavar="MS", help="patch batches reach the edges this much later")
    sim.add_argument(
        "--gpu-sharing",
        choices=("chunked", "lanes"),
        default="chunked",
        help="how prefill and decode share a worker: chunked (vLLM's steps: each slows the other; default) or lanes (separate, the older model)",
    )
    sim.add_argument("--max-batched-tokens", type=int, default=2048, metavar="N", help="tokens per engine step with chunked sharing (vLLM's max_num_batched_tokens; default 2048)")
    sim.add_argument(
        "--sensitivity",
        action="store_true",
        help="also rerun kvcompass at the first rate with WAN jitter 25/50/100 %%, patch loss 10/20/30 %% and delay 100/300 ms (paper table 4)",
    )
    sim.add_argument("--false-hits", action="store_true", help="also report structural false-hit rates at 95 %% load (fp 0/8/16) beside each run's end-to-end rate (paper table 5)")
    from kvcompass.services.commands import add_commands, run_command

    add_commands(sub)
    args = parser.parse_args(argv)
    r = run_command(args)
    if r is not None:
        return r
    if args.command == "demo":
        from kvcompass.demo import DemoConfig, run_demo

        if args.prompts < 1 or args.prompt_tokens < 3072:
            parser.error("--prompts must be >= 1 and --prompt-tokens >= 3072 (the longest shared preamble)")
        run_demo(DemoConfig(prompts=args.prompts, prompt_tokens=args.prompt_tokens, seed=args.seed))
        return 0
    if args.command == "plan":
        return _plan(args)
    if args.command == "simulate":
        return _simulate_main(args)
    if args.command == "reproduce":
        return _reproduce_main(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
