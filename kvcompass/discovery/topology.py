"""Where the workers and edges are, how fast the workers prefill, and how far apart the regions are.

A topology is the one input that the level plan (:mod:`kvcompass.discovery.plan`) and the index
layout are computed from, so every mistake in it is caught here, once, with a message that names
the field and the value (paper section 3.2 derives every indexed length from the WAN matrix and
the prefill rates; a wrong region or rate silently skews every edge's plan).

Sources: a TOML file, a plain ``dict`` (the same schema), or a built-in name (the TOML files in
``kvcompass/topologies/``). The WAN matrix is looked up by each region's ``aws_region`` label in
the measured AWS p50 RTT matrix (``../shared/data/aws_interregion_rtt_p50_symmetric_ms.csv``, or
the bundled excerpt), unless the topology brings its own matrix (a CSV path or an inline
``[rtt_ms]`` table). All figures are round-trip times in ms; the diagonal is the in-region RTT.

TOML schema (every key but ``regions`` and ``workers`` optional)::

    name = "my-fleet"
    description = "..."
    block_size = 16          # KV block size of the workers, tokens
    levels = 6               # levels toward every region (paper section 3.2)
    own_region_min = 256     # first same-region length; doubles upward
    own_steps = 1            # lengths per doubling up to the last own level (1: the paper)
    long_tail = true         # past the last level, keep querying longer lengths to max_prefix
    tail_steps = 4           # lengths per doubling in that tail (1 = doubling; see the plan)
    tokenizer = "tok.json"   # optional: the model's HF tokenizer.json, relative to this file
                             # (edges and emulated workers tokenize text with it; default:
                             # the built-in BPE in kvcompass/data/tokenizer.json)
    chat_template = "t.jinja" # optional, with tokenizer: the Jinja file the engines get as
                             # vLLM's --chat-template (default: the templates beside tokenizer)
    max_prefix = 131072      # no indexed length beyond this (the model's context window)
    value_bits = 32          # 32: <= 16 workers per table; 64: <= 32
    shards = 4
    fp_bits = 8
    rtt_matrix = "rtt.csv"   # optional: own CSV matrix, relative to this file
    # or: [rtt_ms] us = { us = 2.0, eu = 90.0 }  ... keyed by matrix labels

    [regions]
    us = "us-east-1"                               # shorthand: the AWS region, one edge
    eu = { aws_region = "eu-central-1", edges = 2 }

    [worker_defaults]        # fills fields a worker entry leaves out
    beta_ms_per_token = 0.085

    [[workers]]
    id = "us-0"
    region = "us"            # role, beta_ms_per_token, vram_tokens, dram_tokens, endpoint
                             # (capacities in tokens; left out: the testbed's 98,304 VRAM and
                             # 1,048,576 DRAM, or no DRAM beside a given VRAM; dram_tokens = 0:
                             # no DRAM tier; VRAM at least one block)

    [[workers]]
    region = "eu"
    count = 2                # expands to ids eu-0, eu-1 (id_prefix, default "<region>-")
"""

from __future__ import annotations

import csv
import math
import os
import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvcompass.discovery.layout import ROLES, WorkerSpec
from kvcompass.errors import TopologyError

__all__ = [
    "BUNDLED_RTT",
    "RTT_FILE",
    "RegionSpec",
    "RttMatrix",
    "Topology",
    "builtin_topologies",
    "find_rtt_matrix",
    "load_rtt_matrix",
    "load_topology",
    "topology_from_dict",
    "topology_from_toml",
]

RTT_FILE = "aws_interregion_rtt_p50_symmetric_ms.csv"
_PACKAGE = Path(__file__).resolve().parents[1]
BUNDLED_RTT = _PACKAGE / "data" / "rtt_p50_excerpt.csv"
_BUILTIN_DIR = _PACKAGE / "topologies"
# The largest fingerprint the Rust view supports (rust/ludo/view.rs, MAX_FP_BITS).
_MAX_FP_BITS = 16
# Sixteen lengths per doubling under-credit a long match by at most 4 %; more only add keys.
_MAX_TAIL_STEPS = 16


# --------------------------------------------------------------------------------------------
# RTT matrix


@dataclass(frozen=True, slots=True)
class RttMatrix:
    """Round-trip times in ms between labelled sites; ``rows[i][j]`` is from ``labels[i]`` to
    ``labels[j]``. Directional on purpose: the symmetrised file gives d(A,B) = d(B,A), the raw
    CloudPing file does not, and the plan uses RTT(edge, target) in that order."""

    labels: tuple[str, ...]
    rows: tuple[tuple[float, ...], ...]
    source: str = "<inline>"
    _index: dict[str, int] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        where = f"RTT matrix {self.source}"
        if not self.labels:
            raise TopologyError(f"{where}: empty (no regions)")
        index: dict[str, int] = {}
        for i, label in enumerate(self.labels):
            if not label:
                raise TopologyError(f"{where}: column {i + 1} has an empty region name")
            if label in index:
                raise TopologyError(f"{where}: region {label!r} appears twice in the header")
            index[label] = i
        if len(self.rows) != len(self.labels):
            raise TopologyError(f"{where}: not square ({len(self.rows)} rows, header has {len(self.labels)} regions)")
        for label, row in zip(self.labels, self.rows):
            if len(row) != len(self.labels):
                raise TopologyError(f"{where}: not square (row {label!r} has {len(row)} cells, header has {len(self.labels)})")
            for to, ms in zip(self.labels, row):
                if not math.isfinite(ms) or ms < 0:
                    raise TopologyError(f"{where}: row {label!r}, column {to!r}: RTT must be a finite number >= 0, got {ms}")
        object.__setattr__(self, "_index", index)

    def __contains__(self, label: object) -> bool:
        return label in self._index

    def rtt_ms(self, a: str, b: str) -> float:
        """RTT from site ``a`` to site ``b`` (matrix labels, e.g. AWS region codes)."""
        for label in (a, b):
            if label not in self._index:
                raise TopologyError(f"RTT matrix {self.source}: region {label!r} is not in the matrix")
        return self.rows[self._index[a]][self._index[b]]

    @classmethod
    def from_csv(cls, path: str | os.PathLike[str]) -> RttMatrix:
        """Read the CloudPing layout: a header ``<corner>,<to>...`` then one row per source site."""
        p = Path(path)
        where = f"RTT matrix {p}"
        try:
            with open(p, newline="", encoding="utf-8") as f:
                table = [[cell.strip() for cell in row] for row in csv.reader(f) if any(c.strip() for c in row)]
        except FileNotFoundError:
            raise TopologyError(f"{where}: no such file") from None
        except (OSError, UnicodeDecodeError, csv.Error) as e:
            raise TopologyError(f"{where}: cannot be read ({e})") from None
        if not table:
            raise TopologyError(f"{where}: empty (no regions)")
        header = tuple(table[0][1:])
        row_labels = [row[0] for row in table[1:]]
        if len(table) - 1 != len(header):
            raise TopologyError(f"{where}: not square ({len(table) - 1} rows, header has {len(header)} regions)")
        rows: list[tuple[float, ...]] = []
        for row in table[1:]:
            if len(row) - 1 != len(header):
                raise TopologyError(f"{where}: not square (row {row[0]!r} has {len(row) - 1} cells, header has {len(header)})")
            cells: list[float] = []
            for to, cell in zip(header, row[1:]):
                try:
                    cells.append(float(cell))
                except ValueError:
                    raise TopologyError(f"{where}: row {row[0]!r}, column {to!r}: {cell!r} is not a number") from None
            rows.append(tuple(cells))
        _check_labels(where, header, row_labels)
        return cls(header, tuple(rows), str(p))

    @classmethod
    def from_mapping(cls, ms: Mapping[str, Mapping[str, float]], source: str = "<inline>") -> RttMatrix:
        """An inline matrix ``{from: {to: ms}}``; it must be complete (every pair, diagonal too)."""
        where = f"RTT matrix {source}"
        labels = tuple(ms)
        rows: list[tuple[float, ...]] = []
        for a in labels:
            row = ms[a]
            if not isinstance(row, Mapping):
                raise TopologyError(f"{where}: row {a!r} must be a table of RTTs by region, got {row!r}")
            extra = [b for b in row if b not in ms]
            if extra:
                raise TopologyError(f"{where}: row {a!r} names {extra[0]!r}, which has no row")
            missing = [b for b in labels if b not in row]
            if missing:
                raise TopologyError(f"{where}: not square (row {a!r} has {len(row)} cells, header has {len(labels)}; missing {missing[0]!r})")
            rows.append(tuple(_number(f"{where}: row {a!r}, column {b!r}", row[b]) for b in labels))
        return cls(labels, tuple(rows), source)


def _check_labels(where: str, header: Sequence[str], row_labels: Sequence[str]) -> None:
    if len(set(header)) != len(header):
        dup = next(h for i, h in enumerate(header) if h in header[:i])
        raise TopologyError(f"{where}: region {dup!r} appears twice in the header")
    seen: set[str] = set()
    for label in row_labels:
        if label in seen:
            raise TopologyError(f"{where}: row {label!r} appears twice")
        seen.add(label)
        if label not in header:
            raise TopologyError(f"{where}: row {label!r} is not in the header")
    for label in header:
        if label not in seen:
            raise TopologyError(f"{where}: header region {label!r} has no row")


def find_rtt_matrix(path: str | os.PathLike[str] | None = None) -> Path:
    """The matrix file to use: ``path``; else the measured 33-region file found through
    ``$KVCOMPASS_DATA``, ``<cwd>/../shared/data`` or ``<repo>/../shared/data``; else the bundled
    excerpt, so a machine without the shared folder still runs (same cells, fewer regions)."""
    if path is not None:
        return Path(path)
    candidates: list[Path] = []
    env = os.environ.get("KVCOMPASS_DATA")
    if env:
        candidates.append(Path(env))
    candidates += [Path.cwd() / ".." / "shared" / "data", _PACKAGE.parent.parent / "shared" / "data"]
    for c in candidates:
        p = c / RTT_FILE
        if p.is_file():
            return p.resolve()
    return BUNDLED_RTT


def load_rtt_matrix(path: str | os.PathLike[str] | None = None) -> RttMatrix:
    """Read the matrix :func:`find_rtt_matrix` picks."""
    return RttMatrix.from_csv(find_rtt_matrix(path))


# --------------------------------------------------------------------------------------------
# Topology


@dataclass(frozen=True, slots=True)
class RegionSpec:
    """A region: its label in the RTT matrix (an AWS region code; defaults to the region's own
    name, so a region may simply be called ``us-east-1``) and how many edge nodes it runs. A
    region with no edge still hosts workers that other regions' edges find."""

    name: str
    aws_region: str = ""
    edges: int = 1

    def __post_init__(self) -> None:
        if not self.aws_region:
            object.__setattr__(self, "aws_region", self.name)


@dataclass(frozen=True, slots=True)
class Topology:
    """A validated deployment: constructing one checks everything (see :func:`_validate`), so any
    ``Topology`` in hand yields a plan."""

    name: str
    regions: tuple[RegionSpec, ...]
    workers: tuple[WorkerSpec, ...]
    rtt: RttMatrix
    description: str = ""
    block_size: int = 16
    levels: int = 6
    own_region_min: int = 256
    # Llama-3.1's context window: no prompt reaches a longer prefix, so indexing one only costs.
    max_prefix: int = 131072
    value_bits: int = 32
    shards: int = 4
    fp_bits: int = 8
    # Beyond the paper: past the last of the ``levels`` lengths toward any region, keep querying
    # the own-region doubling ladder up to max_prefix, so a 50k-token match is not credited as
    # 8k (kvcompass.discovery.plan). False reproduces the paper's six levels exactly.
    long_tail: bool = True
    # Lengths per doubling in the long tail: a match falls to the indexed length below it, so
    # the tail under-credits a long match by up to 1 - 2**(-1/tail_steps) of it (50 % for
    # doubling, 16 % for four steps); kvcompass.discovery.plan says why four.
    tail_steps: int = 4
    # Lengths per doubling between the own region's first and last level (1: the paper's
    # doubling, ``own_region_min * 2**i``); more steps bound the own region's under-credit as
    # ``tail_steps`` bounds the tail's, at the price of registrations (kvcompass.discovery.plan).
    own_steps: int = 1
    tokenizer: str = ""
    """Absolute path of the model's ``tokenizer.json`` ("" = the built-in default tokenizer)."""
    chat_template: str = ""
    """Absolute path of the operator's Jinja chat template, which replaces the model's (vLLM's
    ``--chat-template``; "" = the templates beside the tokenizer)."""
    _regions: dict[str, RegionSpec] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_regions", _validate(self))

    def region(self, name: str) -> RegionSpec:
        """The region called ``name``; TopologyError if the topology has none."""
        try:
            return self._regions[name]
        except KeyError:
            raise TopologyError(f"region {name!r} is not defined (regions: {', '.join(self.region_names)})") from None

    @property
    def region_names(self) -> tuple[str, ...]:
        """Region names in declaration order (the order of table ids and of the Router's regions)."""
        return tuple(r.name for r in self.regions)

    def region_index(self, name: str) -> int:
        """Position of a region in declaration order (the Router's region id)."""
        self.region(name)
        return self.region_names.index(name)

    def workers_in(self, region: str) -> tuple[WorkerSpec, ...]:
        """All workers of a region (every role) in declaration order."""
        self.region(region)
        return tuple(w for w in self.workers if w.region == region)

    @property
    def disaggregated(self) -> bool:
        """Prefill and decode run on separate pools (paper appendix C)."""
        return any(w.role != "both" for w in self.workers)

    def decode_region(self, region: str) -> str:
        """Where ``region``'s prefill hands its sequences off under disaggregation: its own
        decode instances, or the nearest region's (by RTT, then declaration order) when it has
        none. The simulator's engine hands off by this and the no-reuse capacity pairs the
        stages by it."""
        with_decode = [r for r in self.region_names if any(w.role == "decode" for w in self.workers_in(r))]
        if not with_decode:
            raise TopologyError(f"topology {self.name!r} has no decode instance to hand off to")
        return min(with_decode, key=lambda d: (d != region, self.rtt_ms(region, d), self.region_index(d)))

    @property
    def indexed_workers(self) -> tuple[WorkerSpec, ...]:
        """The workers the index tracks. Reuse saves prefill only, so under prefill-decode
        disaggregation the discovery plane routes the prefill request and indexes only prefill
        workers (paper appendix C); decode pools are left to the serving stack."""
        return tuple(w for w in self.workers if w.role != "decode")

    def rtt_ms(self, a: str, b: str) -> float:
        """RTT in ms from region ``a`` to region ``b`` (topology names); a == b is the in-region RTT."""
        return self.rtt.rtt_ms(self.region(a).aws_region, self.region(b).aws_region)


def _validate(t: Topology) -> dict[str, RegionSpec]:
    """Every structural check, one precise message each; returns the region index."""
    for key, value, low in (
        ("block_size", t.block_size, 1),
        ("levels", t.levels, 1),
        ("own_region_min", t.own_region_min, 1),
        ("max_prefix", t.max_prefix, 1),
        ("shards", t.shards, 1),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise TopologyError(f"{key} must be an integer >= {low}, got {value!r}")
    if not isinstance(t.long_tail, bool):
        raise TopologyError(f"long_tail must be true or false, got {t.long_tail!r}")
    if isinstance(t.tail_steps, bool) or not isinstance(t.tail_steps, int) or not 1 <= t.tail_steps <= _MAX_TAIL_STEPS:
        raise TopologyError(f"tail_steps must be an integer in 1..{_MAX_TAIL_STEPS} (lengths per doubling in the long tail), got {t.tail_steps!r}")
    if isinstance(t.own_steps, bool) or not isinstance(t.own_steps, int) or not 1 <= t.own_steps <= _MAX_TAIL_STEPS:
        raise TopologyError(f"own_steps must be an integer in 1..{_MAX_TAIL_STEPS} (lengths per doubling up to the own region's last level), got {t.own_steps!r}")
    if isinstance(t.value_bits, bool) or not isinstance(t.value_bits, int) or t.value_bits not in (32, 64):
        raise TopologyError(f"value_bits must be 32 or 64, got {t.value_bits!r}")
    if isinstance(t.fp_bits, bool) or not isinstance(t.fp_bits, int) or not 0 <= t.fp_bits <= _MAX_FP_BITS:
        raise TopologyError(f"fp_bits must be an integer in 0..{_MAX_FP_BITS}, got {t.fp_bits!r}")
    own_min = -(-t.own_region_min // t.block_size) * t.block_size
    if own_min > t.max_prefix:
        raise TopologyError(f"max_prefix ({t.max_prefix}) is below own_region_min ({t.own_region_min}, {own_min} rounded to the block size)")

    if not t.regions:
        raise TopologyError("no regions defined")
    regions: dict[str, RegionSpec] = {}
    for r in t.regions:
        if not r.name:
            raise TopologyError("a region has an empty name")
        if r.name in regions:
            raise TopologyError(f"duplicate region {r.name!r}")
        if isinstance(r.edges, bool) or not isinstance(r.edges, int) or r.edges < 0:
            raise TopologyError(f"region {r.name!r}: edges must be an integer >= 0, got {r.edges!r}")
        if r.aws_region not in t.rtt:
            raise TopologyError(f"region {r.name!r}: AWS region {r.aws_region!r} is not in the RTT matrix ({t.rtt.source})")
        regions[r.name] = r

    if not t.workers:
        raise TopologyError("no workers defined")
    ids: set[str] = set()
    populated: set[str] = set()
    for i, w in enumerate(t.workers):
        if not w.id:
            raise TopologyError(f"worker #{i}: id must be non-empty")
        if w.id in ids:
            raise TopologyError(f"duplicate worker id {w.id!r}")
        ids.add(w.id)
        if w.region not in regions:
            raise TopologyError(f"worker {w.id!r}: region {w.region!r} is not defined")
        if w.role not in ROLES:
            raise TopologyError(f"worker {w.id!r}: role must be one of {', '.join(ROLES)}, got {w.role!r}")
        beta = w.beta_ms_per_token
        if isinstance(beta, bool) or not isinstance(beta, (int, float)) or not math.isfinite(beta) or beta <= 0:
            raise TopologyError(f"worker {w.id!r}: beta_ms_per_token must be > 0, got {beta!r}")
        # Left out (None) takes the default; a stated 0 DRAM is no offload tier. VRAM needs a
        # block: the simulated and emulated caches keep every prompt's head there (a 0 once
        # silently took the 98,304-token default, found in review).
        for key, cap, low in (("vram_tokens", w.vram_tokens, t.block_size), ("dram_tokens", w.dram_tokens, 0)):
            if cap is None:
                continue
            if isinstance(cap, bool) or not isinstance(cap, int) or cap < low:
                what = f">= {low} (one block of block_size tokens; a worker's cache cannot go without VRAM: leave it out for the default)" if low else ">= 0 (0: no DRAM tier)"
                raise TopologyError(f"worker {w.id!r}: {key} must be an integer {what}, got {cap!r}")
            if cap // t.block_size >= 2**32 - 1:  # the caches count a tier's blocks in 32 bits (block_cache.rs)
                raise TopologyError(f"worker {w.id!r}: {key} must hold fewer than 2^32 - 1 blocks of {t.block_size} tokens, got {cap!r}")
        if not isinstance(w.endpoint, str):
            raise TopologyError(f"worker {w.id!r}: endpoint must be a string, got {w.endpoint!r}")
        populated.add(w.region)

    for r in t.regions:
        if r.edges == 0 and r.name not in populated:
            raise TopologyError(f"region {r.name!r} is empty: it has no workers and no edges")
    if not any(r.edges for r in t.regions):
        raise TopologyError("no region has an edge, so nothing would query the index")
    if all(w.role == "decode" for w in t.workers):
        raise TopologyError("no worker can prefill: every worker has role 'decode'")
    # Prefill-decode disaggregation is all or nothing: one prefill pool handing off to decode
    # pools. A half layout loaded, then failed mid-run with an empty min() or a role error
    # (found in review).
    roles = {w.role for w in t.workers}
    if roles != {"both"}:
        if "both" in roles:
            mixed = next(w.id for w in t.workers if w.role == "both")
            raise TopologyError(f"worker {mixed!r} has role 'both' beside prefill/decode workers: a disaggregated topology has 'prefill' and 'decode' workers only")
        if "decode" not in roles:
            raise TopologyError("prefill workers but no 'decode' worker: a disaggregated topology needs both pools (or give every worker role 'both')")
    return regions


# --------------------------------------------------------------------------------------------
# Loading

_TOP_KEYS = (
    "name", "description", "block_size", "levels", "own_region_min", "max_prefix", "value_bits",
    "shards", "fp_bits", "long_tail", "tail_steps", "own_steps", "tokenizer", "chat_template", "rtt_matrix", "rtt_ms", "regions", "worker_defaults", "workers",
)  # fmt: skip
_REGION_KEYS = ("aws_region", "edges")
_WORKER_FIELDS = ("role", "beta_ms_per_token", "vram_tokens", "dram_tokens", "endpoint")
_WORKER_KEYS = ("id", "region", "count", "id_prefix", *_WORKER_FIELDS)


def _unknown(where: str, table: Mapping[str, Any], allowed: Sequence[str]) -> None:
    for key in table:
        if key not in allowed:
            raise TopologyError(f"{where}unknown key {key!r} (expected one of {', '.join(allowed)})")


def _integer(where: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TopologyError(f"{where} must be an integer, got {value!r}")
    return value


def _number(where: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TopologyError(f"{where} must be a number, got {value!r}")
    return float(value)


def _string(where: str, value: Any) -> str:
    if not isinstance(value, str):
        raise TopologyError(f"{where} must be a string, got {value!r}")
    return value


def _table(where: str, value: Any) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise TopologyError(f"{where} must be a table, got {value!r}")
    return value


def _regions(raw: Any) -> tuple[RegionSpec, ...]:
    out: list[RegionSpec] = []
    for name, spec in _table("regions", raw).items():
        if isinstance(spec, str):
            out.append(RegionSpec(name, spec))
            continue
        spec = _table(f"region {name!r}", spec)
        _unknown(f"region {name!r}: ", spec, _REGION_KEYS)
        aws = _string(f"region {name!r}: aws_region", spec.get("aws_region", name))
        out.append(RegionSpec(name, aws, _integer(f"region {name!r}: edges", spec.get("edges", 1))))
    return tuple(out)


def _worker_fields(where: str, entry: Mapping[str, Any]) -> dict[str, Any]:
    fields: dict[str, Any] = {}
    for key in _WORKER_FIELDS:
        if key not in entry:
            continue
        value = entry[key]
        if key == "beta_ms_per_token":
            fields[key] = _number(f"{where}{key}", value)
        elif key in ("vram_tokens", "dram_tokens"):
            fields[key] = _integer(f"{where}{key}", value)
        else:
            fields[key] = _string(f"{where}{key}", value)
    return fields


def _workers(raw: Any, defaults_raw: Any) -> tuple[WorkerSpec, ...]:
    defaults_table = _table("worker_defaults", defaults_raw)
    _unknown("worker_defaults: ", defaults_table, _WORKER_FIELDS)
    defaults = _worker_fields("worker_defaults: ", defaults_table)
    if not isinstance(raw, list):
        raise TopologyError(f"workers must be an array of tables ([[workers]]), got {raw!r}")
    out: list[WorkerSpec] = []
    for i, entry in enumerate(raw):
        where = f"workers[{i}]: "
        entry = _table(f"workers[{i}]", entry)
        _unknown(where, entry, _WORKER_KEYS)
        if "region" not in entry:
            raise TopologyError(f"{where}missing 'region'")
        region = _string(f"{where}region", entry["region"])
        fields = {**defaults, **_worker_fields(where, entry)}
        if "count" not in entry:
            if "id" not in entry:
                raise TopologyError(f"{where}missing 'id' (or 'count' for several workers)")
            if "id_prefix" in entry:
                raise TopologyError(f"{where}'id_prefix' needs 'count'")
            out.append(WorkerSpec(id=_string(f"{where}id", entry["id"]), region=region, **fields))
            continue
        if "id" in entry:
            raise TopologyError(f"{where}give either 'id' or 'count', not both")
        count = _integer(f"{where}count", entry["count"])
        if count < 1:
            raise TopologyError(f"{where}count must be >= 1, got {count}")
        prefix = _string(f"{where}id_prefix", entry.get("id_prefix", f"{region}-"))
        endpoint = str(fields.pop("endpoint", ""))
        if endpoint and count > 1 and "{id}" not in endpoint and "{i}" not in endpoint:
            raise TopologyError(f"{where}endpoint {endpoint!r} would be shared by {count} workers; use '{{id}}' or '{{i}}' in it")
        for k in range(count):
            wid = f"{prefix}{k}"
            ep = endpoint.replace("{id}", wid).replace("{i}", str(k))
            out.append(WorkerSpec(id=wid, region=region, endpoint=ep, **fields))
    return tuple(out)


def topology_from_dict(
    data: Mapping[str, Any],
    *,
    name: str = "",
    base_dir: str | os.PathLike[str] | None = None,
    rtt_path: str | os.PathLike[str] | None = None,
    source: str = "",
) -> Topology:
    """Build and validate a topology from the TOML schema as a mapping.

    The topology's own matrix (``rtt_ms`` inline, or ``rtt_matrix``: a path relative to
    ``base_dir``) wins; otherwise ``rtt_path``, then the default search of :func:`find_rtt_matrix`.
    An ``rtt_path`` that is not a file is an error even when the topology's own matrix wins: a
    mistyped path was ignored in silence for such a topology (an operator's review).
    Every error message starts with ``source`` (the file name, when loading one), but for that
    one, which is not the topology's.
    """
    if rtt_path is not None and not Path(rtt_path).is_file():
        raise TopologyError(f"RTT matrix {rtt_path}: {'not a file' if Path(rtt_path).exists() else 'no such file'}")
    prefix = f"{source}: " if source else ""
    try:
        data = _table("topology", data)
        _unknown("", data, _TOP_KEYS)
        if "regions" not in data:
            raise TopologyError("no regions defined (a [regions] table is required)")
        if "workers" not in data:
            raise TopologyError("no workers defined (a [[workers]] array is required)")
        if "rtt_ms" in data and "rtt_matrix" in data:
            raise TopologyError("give either 'rtt_ms' (inline) or 'rtt_matrix' (a file), not both")
        if "rtt_ms" in data:
            raw = _table("rtt_ms", data["rtt_ms"])
            rtt = RttMatrix.from_mapping({k: _table(f"rtt_ms.{k}", v) for k, v in raw.items()}, f"{source or 'topology'} [rtt_ms]")
        elif "rtt_matrix" in data:
            p = Path(_string("rtt_matrix", data["rtt_matrix"]))
            rtt = RttMatrix.from_csv(p if p.is_absolute() or base_dir is None else Path(base_dir) / p)
        else:
            rtt = load_rtt_matrix(rtt_path)
        options: dict[str, Any] = {}
        for key in ("block_size", "levels", "own_region_min", "max_prefix", "value_bits", "shards", "fp_bits", "tail_steps", "own_steps"):
            if key in data:
                options[key] = _integer(key, data[key])
        if "tokenizer" in data:
            tp = Path(_string("tokenizer", data["tokenizer"]))
            tp = tp if tp.is_absolute() or base_dir is None else Path(base_dir) / tp
            if not tp.is_file():
                raise TopologyError(f"tokenizer: no file at {str(tp)!r}")
            options["tokenizer"] = str(tp.resolve())
        if "chat_template" in data:
            cp = Path(_string("chat_template", data["chat_template"]))
            cp = cp if cp.is_absolute() or base_dir is None else Path(base_dir) / cp
            if "tokenizer" not in options:
                raise TopologyError("chat_template replaces the model's chat template: it needs the model's tokenizer too")
            if not cp.is_file():
                raise TopologyError(f"chat_template: no file at {str(cp)!r} (a Jinja template file, as vLLM's --chat-template names)")
            options["chat_template"] = str(cp.resolve())
        if "long_tail" in data:
            if not isinstance(data["long_tail"], bool):
                raise TopologyError(f"long_tail must be true or false, got {data['long_tail']!r}")
            options["long_tail"] = data["long_tail"]
        if "tail_steps" in options and options.get("long_tail") is False:
            raise TopologyError("tail_steps shapes the long tail, which long_tail = false turns off: give one or the other")
        return Topology(
            name=_string("name", data.get("name", name)) or name,
            description=_string("description", data.get("description", "")),
            regions=_regions(data["regions"]),
            workers=_workers(data["workers"], data.get("worker_defaults", {})),
            rtt=rtt,
            **options,
        )
    except TopologyError as e:
        raise TopologyError(f"{prefix}{e.message}") from None


def topology_from_toml(path: str | os.PathLike[str], *, rtt_path: str | os.PathLike[str] | None = None) -> Topology:
    """Load a topology file; a relative ``rtt_matrix`` in it is resolved against its folder."""
    p = Path(path)
    try:
        with open(p, "rb") as f:
            data = tomllib.load(f)
    except FileNotFoundError:
        raise TopologyError(f"{p}: no such file") from None
    except tomllib.TOMLDecodeError as e:
        raise TopologyError(f"{p}: invalid TOML: {e}") from None
    except OSError as e:
        raise TopologyError(f"{p}: cannot be read ({e})") from None
    return topology_from_dict(data, name=p.stem, base_dir=p.parent, rtt_path=rtt_path, source=str(p))


def builtin_topologies() -> tuple[str, ...]:
    """Names of the topologies shipped in ``kvcompass/topologies/``."""
    return tuple(sorted(p.stem for p in _BUILTIN_DIR.glob("*.toml")))


def load_topology(name_or_path: str | os.PathLike[str], *, rtt_path: str | os.PathLike[str] | None = None) -> Topology:
    """A built-in topology by name (names win over files of the same name), else a TOML file."""
    key = str(name_or_path)
    if key in builtin_topologies():
        return topology_from_toml(_BUILTIN_DIR / f"{key}.toml", rtt_path=rtt_path)
    p = Path(name_or_path)
    if not p.is_file():
        raise TopologyError(f"{key!r} is neither a built-in topology ({', '.join(builtin_topologies())}) nor a file")
    return topology_from_toml(p, rtt_path=rtt_path)
