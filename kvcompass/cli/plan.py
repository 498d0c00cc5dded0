"""``kvcompass plan`` (a topology's level plan as an operator reads it) and ``kvcompass demo``."""

from __future__ import annotations

import argparse
import json
import sys
import textwrap
from pathlib import Path
from typing import Any, Sequence

from kvcompass.discovery.plan import LevelPlan
from kvcompass.discovery.topology import Topology, builtin_topologies, load_topology
from kvcompass.engine.cache import worker_capacities
from kvcompass.errors import UsageError

__all__ = ["add_parsers", "format_plan", "topology_of"]


def _lengths(xs: Sequence[int]) -> str:
    return " ".join(str(x) for x in xs) if xs else "(none: no match is worth crossing)"


def format_plan(plan: LevelPlan) -> str:
    """The plan as an operator reads it: per edge region, the RTT, n1 and lengths toward each
    region; then what each region's workers register at, the table groups and the workers'
    cache capacities."""
    t = plan.topology
    lay = plan.layout()
    out: list[str] = []
    out.append(f"Topology {t.name}: {len(t.workers)} workers ({len(lay.workers)} indexed) in {len(t.regions)} regions")
    if t.description:
        out.extend(textwrap.wrap(t.description, width=100, initial_indent="  ", subsequent_indent="  ", break_on_hyphens=False))
    out.append(f"RTT matrix: {t.rtt.source}")
    out.append(
        f"KV block {t.block_size} tokens, {t.levels} levels, own-region minimum {t.own_region_min} {'doubling' if t.own_steps == 1 else f'{t.own_steps} per doubling'}, "
        f"{f'long tail {t.tail_steps} per doubling' if t.long_tail else 'no long tail'}, max prefix {t.max_prefix}; {t.value_bits}-bit values (<= {t.value_bits // 2} workers per table), "
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
    out.append("")
    out.extend(_caches(t))
    return "\n".join(out) + "\n"


def _caches(t: Topology) -> list[str]:
    """The workers' cache capacities as the simulator and the emulated workers size them, one
    line per distinct pair: a capacity the topology leaves out takes a default, and printing
    what it became is how an operator sees that (a 0 once silently became the default)."""
    groups: dict[tuple[int, int], list[str]] = {}
    for w in t.workers:
        groups.setdefault(worker_capacities(w.vram_tokens, w.dram_tokens, t.block_size), []).append(w.id)
    out = ["Worker caches (tokens, whole blocks; left out: the testbed's defaults; no DRAM beside a given VRAM)"]
    for (vram, dram), ids in groups.items():
        who = " ".join(ids) if len(ids) <= 8 else f"{' '.join(ids[:3])} ... {ids[-1]}"
        out.append(f"  VRAM {vram:>9}  DRAM {dram:>9}  {len(ids):>3} worker{'s' if len(ids) != 1 else ' '}  {who}")
    return out


def topology_of(name_or_path: str, rtt_matrix: str | None) -> Topology:
    """``--topology`` with ``--rtt-matrix``. The flag is for a topology without a matrix of its
    own: a file that is not there, or one the topology's own matrix would override, is an error
    naming it (both were ignored in silence when the topology had its own; review)."""
    if rtt_matrix is not None and not Path(rtt_matrix).is_file():
        raise UsageError(f"--rtt-matrix {rtt_matrix}: {'not a file' if Path(rtt_matrix).exists() else 'no such file'}")
    topology = load_topology(name_or_path, rtt_path=rtt_matrix)
    if rtt_matrix is not None and Path(topology.rtt.source).resolve() != Path(rtt_matrix).resolve():
        raise UsageError(f"--rtt-matrix {rtt_matrix}: topology {topology.name} has its own RTT matrix ({topology.rtt.source}), which it would use; leave out --rtt-matrix or the topology's matrix")
    return topology


def _plan(args: argparse.Namespace) -> int:
    plan = LevelPlan(topology_of(args.topology, args.rtt_matrix))
    if args.json:
        sys.stdout.write(json.dumps(plan.to_json(), indent=2) + "\n")
    else:
        sys.stdout.write(format_plan(plan))
    return 0


def _demo(args: argparse.Namespace) -> int:
    from kvcompass.demo import DemoConfig, run_demo

    if args.prompts < 1 or args.prompt_tokens < 3072:
        raise UsageError("--prompts must be >= 1 and --prompt-tokens >= 3072 (the longest shared preamble)")
    run_demo(DemoConfig(prompts=args.prompts, prompt_tokens=args.prompt_tokens, seed=args.seed))
    return 0


def add_parsers(sub: Any) -> None:
    """``kvcompass demo`` and ``kvcompass plan``."""
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
        help="RTT matrix for a topology that has none of its own (an error for one that has; default: ../shared/data, else the bundled excerpt)",
    )
    demo.set_defaults(func=_demo)
    plan.set_defaults(func=_plan)
