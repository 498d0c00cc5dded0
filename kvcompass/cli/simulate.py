"""``kvcompass simulate`` and ``kvcompass reproduce``: what KVCompass would gain on a fleet, and the paper's figures beside ours."""

from __future__ import annotations

import argparse
import math
import json
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Sequence

from kvcompass.cli.plan import topology_of
from kvcompass.discovery.topology import Topology, builtin_topologies
from kvcompass.errors import InvalidArgumentError, UsageError

if TYPE_CHECKING:
    from kvcompass.sim.capacity import Capacity
    from kvcompass.sim.summary import Summary
    from kvcompass.sim.workload import Request

__all__ = ["DEFAULT_MIXED_REQUESTS", "add_parsers"]

# Requests ``--trace mixed`` generates when ``--max-requests`` is not given.
DEFAULT_MIXED_REQUESTS = 1000
GENERATED_WORKLOADS = ("mixed", "sharegpt")
"""``--trace`` names of workloads built here rather than read from a trace file."""


def _parse_rates(text: str) -> list[str]:
    rates = [r.strip() for r in text.split(",")]
    for r in rates:
        try:
            v = float(r)
        except ValueError:
            raise UsageError(f"--rates: {r!r} is not a number (give req/s, comma-separated)") from None
        if not (v > 0 and v != float("inf")):
            raise UsageError(f"--rates: {r!r} must be > 0 req/s")
    if len({float(r) for r in rates}) != len(rates):
        raise UsageError(f"--rates: {text!r} repeats a rate")
    return rates


def _parse_loads(text: str) -> list[float]:
    loads: list[float] = []
    for part in text.split(","):
        try:
            v = float(part.strip())
        except ValueError:
            raise UsageError(f"--load: {part.strip()!r} is not a number (give fractions of the no-reuse capacity, e.g. 0.5,0.9,1.1)") from None
        if not (v > 0 and v != float("inf")):
            raise UsageError(f"--load: {part.strip()!r} must be > 0")
        loads.append(v)
    if len(set(loads)) != len(loads):
        raise UsageError(f"--load: {text!r} repeats a load")
    return loads


def _parse_region_weights(text: str, topology: Topology) -> list[float]:
    """``REGION=W,...`` -> one weight per region of ``topology`` in its order (unnamed: 0)."""
    names = topology.region_names
    got: dict[str, float] = {}
    for part in text.split(","):
        region, sep, value = part.strip().partition("=")
        region = region.strip()
        if not sep or not region:
            raise UsageError(f"--region-weights: {part.strip()!r} is not REGION=WEIGHT")
        if region not in names:
            raise UsageError(f"--region-weights: unknown region {region!r} (regions of {topology.name}: {', '.join(names)})")
        if region in got:
            raise UsageError(f"--region-weights: region {region!r} given twice")
        try:
            w = float(value)
        except ValueError:
            raise UsageError(f"--region-weights: weight {value.strip()!r} of {region!r} is not a number") from None
        if not (w >= 0 and w != float("inf")):
            raise UsageError(f"--region-weights: weight of {region!r} must be finite and >= 0, got {value.strip()}")
        got[region] = w
    if not sum(got.values()) > 0:
        raise UsageError("--region-weights: at least one region needs a weight > 0")
    return [got.get(r, 0.0) for r in names]


def _trace_rate(requests: Sequence[Request]) -> str:
    """A trace's own offered load as the results' rate key: (N - 1) requests over the span."""
    if len(requests) < 2 or not requests[-1].arrival_ms > requests[0].arrival_ms:
        raise UsageError("--arrivals trace: the replayed requests span no time, so they have no rate of their own (replay more requests, or give --rates)")
    return f"{(len(requests) - 1) * 1e3 / (requests[-1].arrival_ms - requests[0].arrival_ms):.6g}"


def _parse_schemes(text: str) -> list[str]:
    from kvcompass.sim.schemes import SCHEMES

    if text.strip() == "all":
        return list(SCHEMES)
    names = [n.strip() for n in text.split(",")]
    for n in names:
        if n not in SCHEMES:
            raise UsageError(f"--schemes: unknown scheme {n!r} (known: {', '.join(SCHEMES)}, or all)")
    if len(set(names)) != len(names):
        raise UsageError(f"--schemes: {text!r} repeats a scheme")
    return names


_MAX_REQUESTS = 2**32 - 1
"""Requests a run may hold: the engine numbers them in 32 bits."""


def _check_run_options(args: argparse.Namespace) -> None:
    """The options ``simulate`` and ``reproduce`` share, checked one way for both (found in
    review: ``reproduce`` took a seed past 2^64 to a traceback)."""
    if not 0 <= args.seed < 2**64:
        raise UsageError(f"--seed must be in [0, 2^64), got {args.seed}")
    if args.jobs < 1:
        raise UsageError(f"--jobs must be >= 1, got {args.jobs}")
    if args.ray is not None and args.jobs != 1:
        raise UsageError("give --jobs (processes here) or --ray (a Ray cluster), not both")


def _runnable(schemes: list[str], topology: Topology, every: bool) -> list[str]:
    """The schemes that can run on ``topology``, checked before any run (found in review: an
    ablation that cannot failed after the runs before it, and their results were lost). With
    ``--schemes all`` those that cannot are left out with a note; named ones are an error."""
    from kvcompass.discovery.edge import unservable
    from kvcompass.discovery.params import EdgeParams
    from kvcompass.sim.schemes import scheme_params

    served = [w.region for w in topology.indexed_workers]
    keep: list[str] = []
    for s in schemes:
        params = scheme_params(s, EdgeParams())
        why = next((w for r in topology.regions if r.edges and (w := unservable(r.name, served, params)) is not None), None)
        if why is None:
            keep.append(s)
        elif every:
            print(f"note: {s} left out: on this topology {why}", file=sys.stderr)
        else:
            raise UsageError(f"--schemes: {s} cannot run on this topology: {why}")
    if not keep:
        raise UsageError("--schemes: no scheme can run on this topology")
    return keep


def _sensitivity(args: argparse.Namespace, topology: Topology, requests: Sequence[Request], base: Summary | None) -> list[dict[str, float | str]]:
    """Paper table 4 for kvcompass on ``requests``: printed as a polars table, CSV under --out."""
    import polars as pl

    from kvcompass.sim.engine import simulate
    from kvcompass.sim.sensitivity import DEFAULT_SWEEPS, sweep

    # The runs that will happen: a zero value reuses the fault-free run (``base``, or the first
    # zero simulated), so the counter ends at its total (it stopped at 9/12; review).
    values = [v for vs in DEFAULT_SWEEPS.values() for v in vs]
    total = sum(v != 0 for v in values) + (base is None and any(v == 0 for v in values))
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
            policy=_eviction(args),
            follow_ups=args.follow_ups,  # the base run's (found in review: table 4 compared two workloads)
            kv_pool=args.kv_pool,
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
        print(f"wrote {Path(args.out) / 'sensitivity.csv'}")
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


def _eviction(args: argparse.Namespace) -> Literal["lru", "lfu"]:
    """The workers' eviction: as given, else the paper's per workload (LFU for Mixed, LRU for
    the chat traces; section 5.1)."""
    if args.eviction is not None:
        return "lfu" if args.eviction == "lfu" else "lru"
    return "lfu" if args.trace == "mixed" else "lru"


def _simulate_outputs() -> tuple[str, ...]:
    """Every file ``simulate --out`` may write."""
    from kvcompass.sim.report import ABLATION_FIGURE, FIGURES

    return ("summary.csv", "summary.parquet", "requests.csv", "requests.parquet", "sensitivity.csv", "run.json", *FIGURES, ABLATION_FIGURE)


def _prepare_out(path: str, outputs: Sequence[str]) -> None:
    """Check ``--out`` before any run (found in review: a file there failed the command only
    after every run, losing them all) and clear what an earlier run wrote there, so no figure of
    another run (an ablation plot, a sensitivity table) sits beside this one's."""
    out = Path(path)
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out {path}: exists and is not a directory")
    try:
        out.mkdir(parents=True, exist_ok=True)
        for name in outputs:
            (out / name).unlink(missing_ok=True)
    except OSError as e:
        raise UsageError(f"--out {path}: {e.strerror or e}") from None


def _simulate(args: argparse.Namespace) -> int:
    from kvcompass.sim.cells import run_cells
    from kvcompass.sim.workload import MOONCAKE_BLOCK_SIZE, RateMode, bundled_excerpt, check_context, load_trace, resolve_trace, synthetic_mixed

    loads: list[float] | None = None
    if args.rates is not None and args.load is not None:
        raise UsageError("give --rates (req/s) or --load (fractions of the capacity), not both")
    if args.arrivals == "trace":
        if args.rates is not None or args.load is not None:
            raise UsageError(f"--arrivals trace replays the trace's own timestamps: leave out {'--rates' if args.rates is not None else '--load'}")
        rates: list[str] = []
    elif args.load is not None:
        loads = _parse_loads(args.load)
        rates = []
    elif args.rates is None:
        raise UsageError("--rates or --load is required (or --arrivals trace, to replay a trace's own timestamps)")
    else:
        rates = _parse_rates(args.rates)
    schemes = _parse_schemes(args.schemes)
    for name in ("max_requests", "block_size", "tenants"):
        v = getattr(args, name)
        if v is not None and v < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be >= 1, got {v}")
    _check_run_options(args)
    # Bounds of the engine's own integers, so a huge value is an error line, not an overflow's
    # traceback (found in review).
    for name, most in (("tenants", 65_535), ("max_batched_tokens", 2**32 - 1), ("closed_loop", 2**32 - 1), ("max_requests", _MAX_REQUESTS)):
        v = getattr(args, name)
        if v is not None and v > most:
            raise UsageError(f"--{name.replace('_', '-')} must be at most {most}, got {v}")
    for name in ("wan_jitter", "patch_loss"):
        v = getattr(args, name)
        if not 0 <= v <= 100 or (name == "patch_loss" and v == 100):
            raise UsageError(f"--{name.replace('_', '-')} must be a percentage in [0, 100{')' if name == 'patch_loss' else ']'}, got {v}")
    if not (args.patch_delay_ms >= 0 and math.isfinite(args.patch_delay_ms)):
        raise UsageError(f"--patch-delay-ms must be a finite number >= 0, got {args.patch_delay_ms}")
    if args.max_batched_tokens < 1:
        raise UsageError(f"--max-batched-tokens must be >= 1, got {args.max_batched_tokens}")
    if args.closed_loop < 0:
        raise UsageError(f"--closed-loop must be >= 1 outstanding requests (or 0, open loop), got {args.closed_loop}")
    if args.closed_loop and (args.sensitivity or args.false_hits):
        raise UsageError("--sensitivity and --false-hits run open loop; leave out --closed-loop")
    faults = {"wan_jitter": args.wan_jitter / 100, "patch_loss": args.patch_loss / 100, "patch_delay_ms": args.patch_delay_ms}
    topology = topology_of(args.topology, args.rtt_matrix)
    schemes = _runnable(schemes, topology, args.schemes.strip() == "all")
    if args.out is not None:  # once the topology and the schemes are known good (found in review: an empty --out was left)
        _prepare_out(args.out, _simulate_outputs())
    edgeless = [r.name for r in topology.regions if r.edges == 0]
    if edgeless:
        # A stated limit of the model (docs/simulator.md, "What the model leaves out").
        print(f"note: region(s) {', '.join(edgeless)} run no edge: their requests start at their nearest edge's clock, so the leg from the client to that edge and back is not charged", file=sys.stderr)
    generated = args.trace in GENERATED_WORKLOADS
    trace_path = None if generated else resolve_trace(args.trace)
    if trace_path is not None and bundled_excerpt(trace_path):
        # Found in review: --trace conversation ran 600 requests in silence when the shared
        # data folder was not where it was looked for.
        print(
            f"note: trace {args.trace!r} is the package's excerpt ({trace_path}); the shared data folder was not found: set KVCOMPASS_DATA to the folder holding traces/",
            file=sys.stderr,
        )
    arrivals: RateMode = args.arrivals or ("poisson" if generated else "rescale")
    if generated and arrivals != "poisson":
        raise UsageError(f"--arrivals {arrivals}: the {args.trace} workload has no timestamps of its own; its arrivals are Poisson at each rate")
    if args.trace == "sharegpt" and args.tenants != 1:
        raise UsageError("--tenants: the sharegpt workload is one namespace (its conversations share only what their text shares)")
    if args.think_s is not None and not (math.isfinite(args.think_s) and args.think_s >= 0):
        raise UsageError(f"--think-s must be >= 0 seconds, got {args.think_s}")
    if args.trace != "sharegpt" and (args.think_s is not None or args.split is not None):
        raise UsageError(f"--{'think-s' if args.think_s is not None else 'split'} applies to --trace sharegpt only")
    weights = None if args.region_weights is None else _parse_region_weights(args.region_weights, topology)

    def workload(rate: float | None) -> Sequence[Request]:
        """The requests at ``rate``, every prompt checked against the topology's context window
        here, at load time, rather than when a run (perhaps in another process) starts."""
        reqs = build(rate)
        check_context(reqs, topology)
        return reqs

    def build(rate: float | None) -> Sequence[Request]:
        if args.trace == "sharegpt":
            from kvcompass.sim.sharegpt import DEFAULT_THINK_S, sharegpt_chat

            assert rate is not None
            return sharegpt_chat(
                args.max_requests or DEFAULT_MIXED_REQUESTS,
                regions=topology,
                weights=weights,
                seed=args.seed,
                rate=rate,
                think_s=DEFAULT_THINK_S if args.think_s is None else args.think_s,
                block_size=args.block_size or topology.block_size,
                split=args.split or "evaluation",
            )
        if trace_path is None:
            assert rate is not None
            n = args.max_requests or DEFAULT_MIXED_REQUESTS
            # K tenants, each replaying the workload from its own prompt pools behind its own
            # system prompt (the paper's Mixed at scale); one tenant is the plain workload.
            return synthetic_mixed(
                n, regions=topology, weights=weights, seed=args.seed, rate=rate, block_size=args.block_size or topology.block_size, tenants=args.tenants, private_pools=args.tenants > 1
            )
        try:
            return load_trace(
                trace_path,
                args.block_size or MOONCAKE_BLOCK_SIZE,
                regions=topology,
                weights=weights,
                seed=args.seed,
                rate=rate,
                mode=arrivals,
                max_requests=args.max_requests,
                max_total=args.max_requests,  # N in all, as --rates is a total and mixed gives N
                tenants=args.tenants,
                ties="keep" if args.keep_ties or arrivals == "trace" else "spread",
            )
        except InvalidArgumentError as e:
            # The library names its own argument (mode='poisson'); say it as the user typed it.
            if getattr(e, "argument", None) == "mode":
                more = "a larger --max-requests, or " if args.max_requests is not None else ""
                raise UsageError(
                    f"--arrivals {arrivals}: every request replayed has the same timestamp, so there is no span to stretch to a rate ({more}use --arrivals poisson)"
                ) from None
            raise

    own: Sequence[Request] | None = None
    if arrivals == "trace":  # one run per scheme at the trace's own times, keyed by its rate
        own = workload(None)
        rates = [_trace_rate(own)]
    capacity = None
    if loads is not None:
        from kvcompass.sim.capacity import no_reuse_capacity, rates_for_loads

        # Only the prompts' lengths matter, and they do not depend on the rate (the synthetic
        # workload's first N differ by a few sessions: well under 0.1 % of the capacity).
        sized = workload(1.0)  # outside the try: a bad trace line is not a --load error
        try:
            capacity = no_reuse_capacity(topology, sized, gpu_sharing=args.gpu_sharing, max_batched_tokens=args.max_batched_tokens, kv_pool=args.kv_pool)
            rates = rates_for_loads(capacity, loads)
        except InvalidArgumentError as e:
            raise UsageError(f"--load: {e}") from None
        print(
            f"no-reuse capacity of {topology.name} for this workload: {capacity.req_per_s:.1f} req/s ({args.gpu_sharing} sharing, {args.kv_pool} KV pool, bound by "
            f"{capacity.bound}; mean prompt {capacity.mean_input_tokens:.0f} tokens, output {capacity.mean_output_tokens:.0f}); "
            + ", ".join(f"load {load:g} = {rate} req/s" for load, rate in zip(loads, rates)),
            file=sys.stderr,
            flush=True,
        )

    workloads = {rate: own if own is not None else workload(float(rate)) for rate in rates}
    eviction = _eviction(args)
    options = {"seed": args.seed, **faults, "gpu_sharing": args.gpu_sharing, "max_batched_tokens": args.max_batched_tokens, "policy": eviction, "closed_loop": args.closed_loop, "follow_ups": args.follow_ups, "kv_pool": args.kv_pool}
    cells = [(rate, scheme) for rate in rates for scheme in schemes]

    def started(k: int, total: int, scheme: str, rate: str, n: int) -> None:
        print(f"[{k}/{total}] {scheme} at {rate} req/s: {n} requests ...", end="", file=sys.stderr, flush=True)

    def running(k: int, total: int, scheme: str, rate: str, done: int, n: int) -> None:
        # On a terminal the run's line counts its completed requests in place (a progress bar).
        bar = "#" * (20 * done // n)
        print(f"\r[{k}/{total}] {scheme} at {rate} req/s: [{bar:<20}] {done}/{n} requests ...", end="", file=sys.stderr, flush=True)

    def finished(k: int, total: int, scheme: str, rate: str, n: int, wall: float) -> None:
        if args.jobs == 1 and args.ray is None:
            print(f" done in {wall:.1f} s", file=sys.stderr, flush=True)
        else:
            print(f"[{k}/{total}] {scheme} at {rate} req/s: {n} requests done in {wall:.1f} s", file=sys.stderr, flush=True)

    t0 = time.perf_counter()
    tty = sys.stderr.isatty()
    serial = args.jobs == 1 and args.ray is None
    results: dict[str, dict[str, Summary]] = run_cells(
        topology, workloads, cells, options, jobs=args.jobs, on_start=started if serial else None, on_done=finished, on_progress=running if tty and serial else None, ray=args.ray
    )
    if args.ray is not None:
        print(f"{len(cells)} runs on Ray ({args.ray}) in {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
    elif args.jobs > 1:
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
        paths.append(_write_run(out, args, topology, {**_load_doc(capacity, loads, rates), "trace_file": None if trace_path is None else str(trace_path.resolve())}))
        print(f"wrote {len(paths)} files to {out}: {' '.join(p.name for p in paths)}")
    from kvcompass.sim.report import comparison_text, summary_row

    print(comparison_text(results, dict(zip(rates, loads)) if loads is not None else None), file=sys.stderr, flush=True)
    doc: dict[str, object] = {"results": {s: {r: summary_row(results[s][r]) for r in rates} for s in schemes}, "eviction": eviction, "follow_ups": args.follow_ups, "kv_pool": args.kv_pool}
    if args.closed_loop:
        doc["closed_loop"] = args.closed_loop
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

    # The package folder, kvcompass/ (this file is kvcompass/cli/simulate.py: its own folder
    # never matched the checkout's kvcompass/, so every run.json said null; review).
    package = Path(__file__).resolve().parents[1]
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


def _reproduce_main(args: argparse.Namespace) -> int:
    from kvcompass.sim.reproduce import figure_spec, image_name, reproduce

    _check_run_options(args)
    if args.requests is not None and not 100 <= args.requests <= _MAX_REQUESTS:
        raise UsageError(f"--requests must be in [100, {_MAX_REQUESTS}], got {args.requests}")
    figure_spec(args.figure)  # refused before --out is made (found by a newcomer: an empty directory was left)
    _prepare_out(args.out, ())
    rows = reproduce(args.figure, args.out, quick=args.quick, jobs=args.jobs, seed=args.seed, requests=args.requests, ray=args.ray)
    agree = sum(1 for r in rows if r.note.startswith("agrees"))
    print(f"figure {args.figure}: {len(rows)} rows, {agree} agree with the paper; wrote {args.out}/report.md, report.json, run.json, {image_name(args.figure)}")
    return 0


_RAY_HELP = (
    "run the (scheme, rate) simulations as Ray tasks: local starts Ray on this machine, an address joins a cluster whose "
    "nodes have kvcompass installed (optional extra kvcompass[ray]); same results as a serial run"
)


def add_parsers(sub: Any) -> None:
    """``kvcompass simulate`` and ``kvcompass reproduce``."""
    rep = sub.add_parser(
        "reproduce",
        help="run one of the paper's figures' grids and write the paper's numbers beside ours (report.md, report.json, the figure)",
        description="Reproducible here: figures 11 and 13 (the three-continent testbed), 12 and 14 (64 workers), 15 (the ablations, "
        "closed loop), 16 (128 workers), 17 (the North-American testbed) and 18 (prefill-decode disaggregation), on Mixed, and "
        "table 4 (fault sensitivity: --figure table4), table 5 (false hits: --figure table5); figure 12's chat columns on ShareGPT chat, "
        "the nearest stand-in for WildChat and LMSYS (--figure 12-chat, needs kvcompass[traces]). Absent: the WildChat/LMSYS columns of the other figures.",
    )
    rep.add_argument("--figure", required=True, metavar="N", help="the paper's figure: 11 to 18, 12-chat, table4 or table5")
    rep.add_argument("--quick", action="store_true", help="fewer rates and requests (fits in 10 minutes on 2 cores)")
    rep.add_argument("--jobs", type=int, default=1, metavar="N", help="run up to N simulations side by side in worker processes (default 1)")
    rep.add_argument("--ray", default=None, metavar="ADDRESS|local", help=_RAY_HELP)
    rep.add_argument("--requests", type=int, default=None, metavar="N", help="requests a run (default 12000 with --quick, else 100000)")
    rep.add_argument("--seed", type=int, default=1)
    rep.add_argument("--out", required=True, metavar="DIR", help="where report.md, report.json, run.json and the figure go")
    rep.set_defaults(func=_reproduce_main)
    sim = sub.add_parser("simulate", help="replay a workload through the simulator under each scheme and rate; last stdout line is one JSON object")
    sim.add_argument("--topology", required=True, metavar="NAME_OR_PATH", help=f"a built-in topology ({', '.join(builtin_topologies())}) or a TOML file")
    sim.add_argument(
        "--trace",
        required=True,
        metavar="PATH_OR_NAME",
        help="a Mooncake-schema JSONL file, a shared trace name (conversation, synthetic), mixed: the synthetic "
        "Mixed workload, or sharegpt: multi-turn chat from ShareGPT (needs kvcompass[traces]); "
        f"the last two give {DEFAULT_MIXED_REQUESTS} requests unless --max-requests",
    )
    sim.add_argument(
        "--eviction",
        choices=("lru", "lfu"),
        default=None,
        help="the workers' cache eviction (default: lfu for mixed, lru otherwise, the paper's choice per workload)",
    )
    sim.add_argument(
        "--closed-loop",
        type=int,
        default=0,
        metavar="N",
        help="N requests outstanding at any time, each completion issuing the next (the paper's closed-loop throughput, its "
        "ablation figure); the rate then only spaces the first N and shapes the workload. Default 0: open loop",
    )
    sim.add_argument(
        "--think-s",
        type=float,
        default=None,
        metavar="S",
        help="sharegpt: mean think time between a conversation's turns, seconds (default 30; exponential, open loop)",
    )
    sim.add_argument(
        "--split",
        choices=("evaluation", "validation"),
        default=None,
        help="sharegpt: the conversations to use (default evaluation; validation is the first 5,000 records, kept for checking design changes)",
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
    sim.add_argument("--ray", default=None, metavar="ADDRESS|local", help=_RAY_HELP)
    sim.add_argument(
        "--region-weights",
        default=None,
        metavar="REGION=W,...",
        help="share of sessions starting in each region (unnamed regions: 0; default: proportional to prefill capacity)",
    )
    sim.add_argument("--schemes", default="all", metavar="S1,S2,...|all", help="routing schemes to compare (default all)")
    sim.add_argument("--seed", type=int, default=0, help="seed for the workload's regions and arrivals and the simulator (default 0)")
    sim.add_argument("--max-requests", type=int, default=None, metavar="N", help="replay at most the first N requests in all, whatever --tenants (a trace's K copies: about N/K each, interleaved)")
    sim.add_argument("--out", default=None, metavar="DIR", help="write CSV/parquet tables and PNG figures here")
    sim.add_argument("--rtt-matrix", metavar="CSV", default=None, help="RTT matrix for a topology that has none of its own (an error for one that has)")
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
    sim.add_argument(
        "--follow-ups",
        choices=("after-parent", "on-time"),
        default="after-parent",
        help="when a follow-up (an agent's next call, a chat's next turn) is sent: at its own time or when its parent's answer has "
        "reached the client, whichever is later (after-parent, default: its prompt holds that answer), or at its own time "
        "whatever the parent's progress (on-time, earlier versions' replay)",
    )
    sim.add_argument(
        "--kv-pool",
        choices=("shared", "unbounded"),
        default="shared",
        help="how a worker's VRAM is shared: its running sequences and its prefix cache share one KV pool, a prompt waiting "
        "for room (shared, default: as an engine), or every prompt starts at once and the cache keeps all of VRAM "
        "(unbounded, earlier versions' model)",
    )
    sim.add_argument("--max-batched-tokens", type=int, default=2048, metavar="N", help="tokens per engine step with chunked sharing (vLLM's max_num_batched_tokens; default 2048)")
    sim.add_argument(
        "--sensitivity",
        action="store_true",
        help="also rerun kvcompass at the first rate with WAN jitter 25/50/100 %%, patch loss 10/20/30 %% and delay 100/200/300 ms (paper table 4)",
    )
    sim.add_argument("--false-hits", action="store_true", help="also report structural false-hit rates at 95 %% load (fp 0/8/16) beside each run's end-to-end rate (paper table 5)")
    sim.set_defaults(func=_simulate)
