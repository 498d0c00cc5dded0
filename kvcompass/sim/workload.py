"""Workloads for the simulator: trace loading, token expansion, regions, rates, tenants and a
synthetic "Mixed"-like generator.

Everything here is deterministic: the same arguments give the same requests in every run and in
every process (no ``hash()``, no clocks, only seeded numpy generators and fixed integer mixing).

Traces
    Any JSONL file in the Mooncake schema loads (``load_trace(path, block_size)``): one object a
    line with ``timestamp`` (ms), ``input_length``, ``output_length`` and ``hash_ids``, where
    ``len(hash_ids) == ceil(input_length / block_size)``; optional ``chat_id`` /
    ``parent_chat_id`` (the Qwen-Bailian convention: ``parent_chat_id`` is the ``chat_id`` of the
    previous turn, -1 marks a root); optional ``region``, where the request entered the fleet
    (a region of the topology; see "Sessions and regions"). The Qwen-Bailian traces' ``type``
    and ``turn`` are accepted and ignored; any other key is an error naming it, so a misspelt
    ``parent_chat_id`` does not silently make every turn a root. The shared Mooncake traces
    (block size 512, the four required keys only) are found by :func:`find_trace`;
    ``kvcompass trace from-log`` writes one from an OpenAI request log
    (:mod:`kvcompass.cli.trace`).

    Validation is strict and every error is an :class:`~kvcompass.errors.InvalidArgumentError`
    (a ``ValueError``) whose message names the file, the line and the field, with ``path``,
    ``line`` and ``field`` attributes. Decisions a trace might trip over:

    * timestamps must be numbers >= 0 and **non-decreasing**. The schema says the file is sorted;
      a step back means a concatenated or shuffled file, and sorting it silently could put a
      follow-up turn before its parent. Sort the file first.
    * ``input_length`` must be >= 1 (an empty prompt cannot be routed), ``output_length`` >= 0.
    * hash ids are integers in ``0 .. 2**63 - 1``.
    * a ``parent_chat_id`` that names no *earlier* line (its session began before the trace
      window, or the file was cut) starts a new session: the request becomes a root. A
      ``chat_id`` seen twice, or a request naming itself as parent, is an error.
    * blank lines are skipped (line numbers still count them).

Token expansion
    Block id ``b`` stands for ``block_size`` token ids: the first ``block_size`` outputs of a
    SplitMix64 stream seeded by a mix of ``b``, mapped into ``[0, 128000)`` (Llama-3's vocabulary
    without its special tokens). A request's tokens are its blocks' tokens concatenated and cut
    to ``input_length``, so equal leading ids give equal leading tokens, a partial last block is a
    prefix of the full block with the same id, and different ids give different tokens (up to
    a 2**-17 chance per token). Pure integer arithmetic: stable across runs, processes, machines.

Memory
    A :class:`Request` holds no tokens. A trace request keeps a read-only view of its hash ids
    (shared by all tenant copies of the row); a synthetic request keeps a handful of
    ``(chain, blocks)`` runs, from which its ids are derived. ``Request.input_tokens()``
    materialises the tokens on each call (10-15 ns a token here) and keeps nothing, so a workload
    of a million requests costs its ids, not its tokens. The synthetic generator returns a
    :class:`RequestTable` (columns, no object per request; see :mod:`kvcompass.sim.requests`).

Sessions and regions
    A line's ``region`` is where it entered (an operator's log knows; the Mooncake traces do
    not). A line without one takes its root's: the root's own ``region``, else a region drawn
    for the root session by a weight vector (seeded; default: proportional to prefill capacity
    when a topology is given, equal weights for a plain list of names), so follow-up turns
    inherit their root's region (paper appendix D). Region draws are per row, so
    ``max_requests`` does not change the regions of the rows kept; a ``region`` the topology
    lacks is an error naming the line.

Rates
    ``mode="trace"`` keeps the file's times; ``"rescale"`` multiplies them so that the mean
    rate, (N - 1) / (last - first arrival), is exactly ``rate`` req/s; ``"poisson"`` keeps the
    order and draws exponential inter-arrival gaps at ``rate``. ``rate`` is the aggregate over
    all tenants (what a load sweep sets).

Tenants
    ``tenants=K`` replays K copies of the trace. Copy k has a private namespace
    (``Request.namespace``, the ``tenant`` argument of :class:`kvcompass.Namespace`), so the
    copies never share a key even though their tokens are identical: the namespace, not the
    tokens, separates them, exactly as the discovery plane separates sharing groups. A trace's
    prefix tree is opaque, so there is nothing like a system prompt to make private; a private
    namespace has the same effect as a private first block. Copy k is shifted by k/K of the
    trace's mean inter-arrival gap, so copies interleave instead of arriving in bursts of K.
    ``max_requests`` counts rows of the file (K copies of each); ``max_total`` counts requests.

    The synthetic generator is different on purpose: its tenants share one namespace and are
    separated by private system prompt *tokens*, because its tool preambles are shared across
    tenants (see :func:`synthetic_mixed`).
"""

from __future__ import annotations

import bisect
import contextlib
import gc
import json
import math
import os
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, TypeAlias

import numpy as np
import numpy.typing as npt

from kvcompass import _core
from kvcompass.discovery.topology import Topology
from kvcompass.errors import InvalidArgumentError
from kvcompass.sim.requests import ChainBlocks, Request, RequestTable, TraceBlocks, expand_blocks

__all__ = [
    "MOONCAKE_BLOCK_SIZE",
    "TRACE_NAMES",
    "VOCAB",
    "ChainBlocks",
    "MixedConfig",
    "Request",
    "RequestTable",
    "ReuseStats",
    "TraceBlocks",
    "check_context",
    "collector_paused",
    "context_window",
    "dump_trace",
    "expand_blocks",
    "bundled_excerpt",
    "find_trace",
    "json_number",
    "line_error",
    "load_mooncake",
    "load_trace",
    "draw_regions",
    "region_weights",
    "regions_and_cdf",
    "resolve_trace",
    "reuse_stats",
    "synthetic_mixed",
    "spread_ties",
    "stream_block_ids",
]

U64Array: TypeAlias = npt.NDArray[np.uint64]
U32Array: TypeAlias = npt.NDArray[np.uint32]
F64Array: TypeAlias = npt.NDArray[np.float64]
I64Array: TypeAlias = npt.NDArray[np.int64]
RateMode: TypeAlias = Literal["trace", "rescale", "poisson"]

# The Mooncake FAST'25 traces hash 512-token blocks (../shared/data/traces/README.md).
MOONCAKE_BLOCK_SIZE = 512

MAX_TRACE_TOKENS = (1 << 24) - 1
"""The longest prompt or output a trace line may give (16.8M tokens, past every model's
context): a bigger one is a corrupt line, refused by name rather than overflowing the engine's
integers or spanning years of simulated decode (found in review)."""
# Names find_trace resolves out of the box (the files in ../shared/data/traces/).
TRACE_NAMES = ("conversation", "synthetic")
# Token ids stay below Llama-3's 128,000 ordinary tokens (its 256 special ids come after them).
VOCAB = 128_000

_MAX_ID = (1 << 63) - 1
_M64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
_C1 = 0xBF58476D1CE4E5B9
_C2 = 0x94D049BB133111EB
# Domain separation: token streams, block chains and segment identities never coincide.
_TOKEN_SALT = 0x6B7663_746F6B656E  # "kvc" "token"
_CHAIN_ROOT = 0x6B7663_636861696E  # "kvc" "chain"
_TRACE_FIELDS = ("timestamp", "input_length", "output_length", "hash_ids")
# Every key a trace line may carry: the required four, the session links, and the Qwen-Bailian
# traces' "type" and "turn" (read past: the model needs neither).
_TRACE_OPTIONAL = ("chat_id", "parent_chat_id", "region", "type", "turn")
_TRACE_KEYS = frozenset((*_TRACE_FIELDS, *_TRACE_OPTIONAL))
_TRACE_KEYS_TEXT = ", ".join((*_TRACE_FIELDS, *_TRACE_OPTIONAL))
_TRACES_SUBDIR = "traces"
_WINDOW_FIX = "no engine serves it (if the model's window is longer, raise max_prefix in the topology; else leave the request out)"
_PACKAGE = Path(__file__).resolve().parents[1]


# --------------------------------------------------------------------------------------------
# Integer mixing (SplitMix64's finaliser, ``rust/token_ids.rs``): the only source of token and
# synthetic block ids. Scalars go through ``_core.mix_fold``; the tests hold a reference.


def _mix64_np(x: U64Array) -> U64Array:
    """Elementwise SplitMix64 finaliser of ``x + golden`` (uint64 arithmetic wraps)."""
    z = x + np.uint64(_GOLDEN)
    z ^= z >> np.uint64(30)
    z *= np.uint64(_C1)
    z ^= z >> np.uint64(27)
    z *= np.uint64(_C2)
    z ^= z >> np.uint64(31)
    return z


# --------------------------------------------------------------------------------------------
# Finding traces


def _data_dirs() -> list[Path]:
    dirs: list[Path] = []
    env = os.environ.get("KVCOMPASS_DATA")
    if env:
        dirs.append(Path(env))
    dirs += [Path.cwd() / ".." / "shared" / "data", _PACKAGE.parent.parent / "shared" / "data"]
    # Last: the excerpt shipped in the package (the first 600 conversation requests), so the
    # main job runs on a machine without the shared data folder.
    dirs.append(_PACKAGE / "data")
    return dirs


def find_trace(name: str) -> Path:
    """The file of a named trace: ``{name}_trace.jsonl`` in the ``traces/`` folder of
    ``$KVCOMPASS_DATA``, ``<cwd>/../shared/data``, ``<repo>/../shared/data`` or the package's
    own ``data/`` (an excerpt of the conversation trace; first found).
    ``FileNotFoundError`` listing every place looked at when none holds it."""
    if not name or any(sep in name for sep in ("/", "\\")) or name.startswith("."):
        raise InvalidArgumentError(f"trace name must be a plain name such as {' or '.join(map(repr, TRACE_NAMES))}, got {name!r}")
    filename = f"{name}_trace.jsonl"
    looked: list[str] = []
    for d in _data_dirs():
        p = d / _TRACES_SUBDIR / filename
        if p.is_file():
            return p.resolve()
        looked.append(str(p))
    hint = "" if name in TRACE_NAMES else f" (the shared data ships {', '.join(TRACE_NAMES)})"
    raise FileNotFoundError(f"trace {name!r} not found{hint}; looked at: {'; '.join(looked)}. Set KVCOMPASS_DATA to the folder holding traces/.")


def bundled_excerpt(path: Path) -> bool:
    """Whether ``path`` is the package's own excerpt of a shared trace (what :func:`find_trace`
    falls back to without the shared data folder): a caller says so, since the name then
    stands for 600 requests, not the whole trace."""
    return path.resolve().parent == (_PACKAGE / "data" / _TRACES_SUBDIR).resolve()


def resolve_trace(path_or_name: str | os.PathLike[str]) -> Path:
    """What a ``--trace`` argument means: an existing file, else a name for :func:`find_trace`."""
    p = Path(path_or_name)
    if p.is_file():
        return p
    text = os.fspath(path_or_name)
    if p.suffix or os.sep in text or "/" in text:
        raise FileNotFoundError(f"trace file {text!r} does not exist")
    return find_trace(text)


# --------------------------------------------------------------------------------------------
# Regions


def region_weights(topology: Topology) -> tuple[tuple[str, ...], tuple[float, ...]]:
    """Region names and their prefill capacity (tokens/ms, the sum of ``1 / beta`` over the
    region's indexed workers): the default share of users per region. With equal prefill rates
    this is the worker count, which is how the paper sizes regions (a deployment census, §5.3)."""
    names = topology.region_names
    cap = {r: 0.0 for r in names}
    for w in topology.indexed_workers:
        cap[w.region] += 1.0 / w.beta_ms_per_token
    return names, tuple(cap[r] for r in names)


def regions_and_cdf(regions: Sequence[str] | Topology, weights: Sequence[float] | None) -> tuple[tuple[str, ...], F64Array]:
    """Region names and the cumulative weights to draw sessions' regions with (:func:`draw_regions`):
    ``weights`` or, for a topology, its prefill capacity per region; equal for plain names."""
    if isinstance(regions, Topology):
        names, capacity = region_weights(regions)
        w_in: Sequence[float] = capacity if weights is None else weights
    else:
        if isinstance(regions, str):
            raise InvalidArgumentError(f"regions must be a sequence of region names, got the string {regions!r}")
        names = tuple(regions)
        w_in = [1.0] * len(names) if weights is None else weights
    if not names:
        raise InvalidArgumentError("regions is empty")
    if len(set(names)) != len(names) or not all(isinstance(r, str) and r for r in names):
        raise InvalidArgumentError(f"regions must be distinct non-empty names, got {list(names)}")
    w = np.asarray(list(w_in), dtype=np.float64)
    if w.shape != (len(names),):
        raise InvalidArgumentError(f"weights has {w.size} entries for {len(names)} regions")
    # The sum too: finite weights whose sum overflows made every share NaN, and every session
    # went to the last region, a zero-weight one included (found in review).
    with np.errstate(over="ignore"):
        total = w.sum()
    if not np.all(np.isfinite(w)) or np.any(w < 0) or not 0 < total < np.inf:
        raise InvalidArgumentError(f"weights must be finite, >= 0, not all 0 and of a finite sum, got {w.tolist()}")
    cdf = np.cumsum(w / total)
    cdf[-1] = 1.0
    return names, cdf


def draw_regions(cdf: F64Array, u: F64Array) -> I64Array:
    """Region indices for uniform draws ``u`` under ``cdf``."""
    # side="right": a uniform equal to a boundary goes to the next region, so a zero-weight
    # region (an empty interval) is never drawn.
    return np.minimum(np.searchsorted(cdf, u, side="right"), cdf.size - 1).astype(np.int64)


def _draw_one(cdf: list[float], u: float) -> int:
    """:func:`draw_regions` for one uniform, the cdf a list (a generator drawing one at a time
    made two small arrays a draw)."""
    return min(bisect.bisect_right(cdf, u), len(cdf) - 1)


# --------------------------------------------------------------------------------------------
# Trace parsing


@dataclass(slots=True)
class _Rows:
    timestamps: list[float] = field(default_factory=list)
    input_lengths: list[int] = field(default_factory=list)
    output_lengths: list[int] = field(default_factory=list)
    hash_ids: list[U64Array] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    roots: list[int] = field(default_factory=list)
    regions: list[int] = field(default_factory=list)  # index into the region names; -1: none given


def stream_block_ids(tokens: npt.NDArray[np.uint32], block_size: int, seed: int = 0) -> U64Array:
    """Trace hash ids of a token stream, made as Mooncake's ``hash_ids`` are: the stream cut into
    ``block_size``-token blocks (the last, partial one padded with zeros), each named by the
    chained hash of ``seed`` and the stream up to it, so two streams of one seed share their
    leading ids exactly as far as they share their leading full blocks, and streams of two
    seeds share none. The ShareGPT workload and ``kvcompass trace from-log`` name blocks with
    it."""
    pad = (-tokens.size) % block_size
    padded = np.concatenate([tokens, np.zeros(pad, dtype=np.uint32)]) if pad else tokens
    return _core.block_chain_hashes(np.ascontiguousarray(padded, dtype=np.uint32), block_size, seed) & np.uint64(_MAX_ID)


def json_number(v: object) -> float:
    """A JSON value as a float: NaN unless it is a number (a bool is not; an integer beyond the
    float range neither), so one finiteness check refuses everything else."""
    if type(v) not in (int, float):
        return math.nan
    try:
        return float(v)  # type: ignore[arg-type]
    except OverflowError:
        return math.nan


def line_error(path: Path, line: int, name: str | None, problem: str) -> InvalidArgumentError:
    """The error of a bad line of a JSONL input (a trace, a request log): the file, the line
    and the field in the message and as attributes."""
    where = f"{path}, line {line}" + (f", field {name!r}" if name else "")
    return InvalidArgumentError(f"{where}: {problem}", path=str(path), line=line, field=name)


def _is_int(v: object) -> bool:
    return type(v) is int  # bool is an int subclass; exactly int refuses it


def _parse_ids(path: Path, line: int, raw: object) -> U64Array:
    if type(raw) is not list:
        raise line_error(path, line, "hash_ids", f"expected a list of integers, got {type(raw).__name__}")
    if not all(map(_is_int, raw)):
        i = next(i for i, v in enumerate(raw) if not _is_int(v))
        raise line_error(path, line, "hash_ids", f"element {i} is {raw[i]!r}, expected an integer")
    try:
        arr = np.array(raw, dtype=np.int64)
    except OverflowError:
        i = next(i for i, v in enumerate(raw) if not 0 <= v <= _MAX_ID)
        raise line_error(path, line, "hash_ids", f"element {i} is {raw[i]}, outside 0..2**63-1") from None
    if arr.size and int(arr.min()) < 0:
        i = int(np.argmax(arr < 0))
        raise line_error(path, line, "hash_ids", f"element {i} is {raw[i]}, outside 0..2**63-1")
    ids = arr.view(np.uint64)
    ids.setflags(write=False)
    return ids


def region_labels(topology: Topology) -> dict[str, str]:
    """A region's name, and its ``aws_region`` label, -> its name: what a trace line's or a
    request log's ``region`` may say (a log written by a gateway knows the AWS region)."""
    out = {r.aws_region: r.name for r in topology.regions}
    out.update({r.name: r.name for r in topology.regions})
    return out


def _read_trace(
    path: Path, block_size: int, max_requests: int | None, window: tuple[int, str] | None = None, regions: Sequence[str] = (), labels: Mapping[str, str] | None = None
) -> _Rows:
    """The trace's rows, each checked; ``window``: the longest prompt accepted and what sets it
    (a topology's context window), or None for no bound; ``regions``: the names a line's
    ``region`` may take."""
    rows = _Rows()
    region_index = {r: i for i, r in enumerate(regions)}
    for label, name in (labels or {}).items():
        if name in region_index:
            region_index.setdefault(label, region_index[name])
    row_of_chat: dict[int, int] = {}
    prev_ts = 0.0
    with path.open("rb") as f:
        for line, raw in enumerate(f, 1):
            if max_requests is not None and len(rows.timestamps) >= max_requests:
                break
            if not raw.strip():
                continue
            try:
                obj = json.loads(raw)
            except UnicodeDecodeError as e:
                raise line_error(path, line, None, f"not UTF-8 ({e.reason})") from None
            except json.JSONDecodeError as e:
                raise line_error(path, line, None, f"not valid JSON ({e.msg} at column {e.colno})") from None
            if type(obj) is not dict:
                raise line_error(path, line, None, f"expected a JSON object, got {type(obj).__name__}")
            for name in _TRACE_FIELDS:
                if name not in obj:
                    raise line_error(path, line, name, "missing")
            if len(obj) > len(_TRACE_FIELDS) and not _TRACE_KEYS.issuperset(obj):
                key = next(k for k in obj if k not in _TRACE_KEYS)
                raise line_error(path, line, key, f"unknown key (accepted: {_TRACE_KEYS_TEXT})")

            raw_ts = obj["timestamp"]
            ts = json_number(raw_ts)
            if not (math.isfinite(ts) and ts >= 0):
                raise line_error(path, line, "timestamp", f"expected a number of ms >= 0, got {raw_ts!r}")
            if rows.timestamps and ts < prev_ts:
                raise line_error(path, line, "timestamp", f"{raw_ts} is earlier than the previous request's {prev_ts:g}: timestamps must be non-decreasing (sort the file)")
            n_in = obj["input_length"]
            if not _is_int(n_in) or not 1 <= n_in <= MAX_TRACE_TOKENS:
                raise line_error(path, line, "input_length", f"expected an integer in [1, {MAX_TRACE_TOKENS}], got {n_in!r}")
            if window is not None and n_in > window[0]:
                raise line_error(path, line, "input_length", f"{n_in} tokens, longer than {window[1]}: {_WINDOW_FIX}")
            n_out = obj["output_length"]
            if not _is_int(n_out) or not 0 <= n_out <= MAX_TRACE_TOKENS:
                raise line_error(path, line, "output_length", f"expected an integer in [0, {MAX_TRACE_TOKENS}], got {n_out!r}")
            ids = _parse_ids(path, line, obj["hash_ids"])
            need = -(-n_in // block_size)
            if ids.size != need:
                raise line_error(
                    path, line, "hash_ids",
                    f"has {ids.size} ids, expected ceil(input_length / block_size) = ceil({n_in} / {block_size}) = {need} (a trace written at another block size? say which: --block-size)",
                )
            region = -1
            if "region" in obj:
                name = obj["region"]
                if type(name) is not str or name not in region_index:
                    raise line_error(path, line, "region", f"{name!r} is not a region of the fleet (its regions: {', '.join(regions)})")
                region = region_index[name]

            row = len(rows.timestamps)
            parent_row = -1
            if "chat_id" in obj:
                chat = obj["chat_id"]
                if not _is_int(chat) or chat < 0:
                    raise line_error(path, line, "chat_id", f"expected an integer >= 0, got {chat!r}")
                if chat in row_of_chat:
                    raise line_error(path, line, "chat_id", f"{chat} already used on an earlier line")
            else:
                chat = None
            if "parent_chat_id" in obj:
                parent = obj["parent_chat_id"]
                if not _is_int(parent) or parent < -1:
                    raise line_error(path, line, "parent_chat_id", f"expected an integer >= -1 (-1: a root), got {parent!r}")
                if parent >= 0 and parent == chat:
                    raise line_error(path, line, "parent_chat_id", f"{parent} is the request's own chat_id")
                parent_row = row_of_chat.get(parent, -1)
            if chat is not None:
                row_of_chat[chat] = row

            prev_ts = ts
            rows.timestamps.append(ts)
            rows.input_lengths.append(n_in)
            rows.output_lengths.append(n_out)
            rows.hash_ids.append(ids)
            rows.parents.append(parent_row)
            rows.roots.append(row if parent_row < 0 else rows.roots[parent_row])
            rows.regions.append(region)
    if not rows.timestamps:
        raise InvalidArgumentError(f"{path}: no requests in the trace", path=str(path), line=0, field=None)
    return rows


def context_window(topology: Topology) -> str:
    """How an error names a topology's context window."""
    return f"the context window of topology {topology.name!r} (max_prefix {topology.max_prefix})"


def check_context(requests: Sequence[Request], topology: Topology) -> None:
    """Refuse a workload with a prompt longer than ``topology``'s context window (its
    ``max_prefix``), naming the first such request: no engine of that fleet serves it, and the
    simulator ran it as if one did (an operator's review). Traces are checked line by line as
    they load (:func:`load_trace`); this covers every workload, generated ones too."""
    if isinstance(requests, RequestTable):
        lengths = np.asarray(requests.input_length)
    else:
        lengths = np.fromiter((r.input_length for r in requests), dtype=np.int64, count=len(requests))
    over = np.flatnonzero(lengths > topology.max_prefix)
    if over.size:
        r = requests[int(over[0])]
        raise InvalidArgumentError(f"request {r.id} has a {r.input_length}-token prompt, longer than {context_window(topology)}: {_WINDOW_FIX}", request=r.id)


# --------------------------------------------------------------------------------------------
# Arrival times


def _check_rate(mode: str, rate: float | None) -> float:
    if mode not in ("trace", "rescale", "poisson"):
        raise InvalidArgumentError(f"mode must be 'trace', 'rescale' or 'poisson', got {mode!r}")
    if mode == "trace":
        if rate is not None:
            raise InvalidArgumentError("mode='trace' replays the file's own times; rate must be None (use mode='rescale' or 'poisson')")
        return 0.0
    if rate is None or isinstance(rate, bool) or not isinstance(rate, (int, float)) or not math.isfinite(rate) or rate <= 0:
        raise InvalidArgumentError(f"mode={mode!r} needs a rate > 0 in req/s, got {rate!r}")
    return float(rate)


def _poisson_times(n: int, rate: float, seed: int) -> F64Array:
    """Arrival times (ms) of a Poisson process at ``rate`` req/s: the first at 0."""
    gaps = np.random.default_rng([seed, 2]).exponential(1000.0 / rate, size=n)
    gaps[0] = 0.0
    return np.cumsum(gaps)


def spread_ties(ts: F64Array, seed: int) -> F64Array:
    """Trace times with each run of equal timestamps spread over the interval up to the next
    distinct timestamp (uniform, seeded, sorted so file order is kept; the last run over the
    median interval).

    The Mooncake traces log arrivals in coarse buckets (the conversation trace: 12,031
    requests on 1,180 distinct timestamps, 3 s apart, up to 28 per bucket). Replayed as given,
    every bucket is a burst of simultaneous arrivals at different edges, a race no real fleet
    sees at that scale; spreading reconstructs arrivals within the logging resolution. Every
    scheme replays the same spread times."""
    t = np.asarray(ts, dtype=np.float64)
    if t.size < 2:
        return t.copy()
    distinct = np.unique(t)
    if distinct.size == t.size:
        return t.copy()
    gaps = np.diff(distinct)
    last = float(np.median(gaps)) if gaps.size else 0.0
    nxt = np.append(distinct[1:], distinct[-1] + last)
    width = (nxt - distinct)[np.searchsorted(distinct, t)]
    u = np.random.default_rng([seed, 3]).random(t.size) * width
    out = t + u
    # Sorted within each run, so rows keep their file order (parents before follow-ups).
    starts = np.flatnonzero(np.r_[True, t[1:] != t[:-1]])
    for a, b in zip(starts, np.append(starts[1:], t.size)):
        if b - a > 1:
            out[a:b] = np.sort(out[a:b])
    return out


def _schedule(ts: F64Array, tenants: int, mode: str, rate: float, seed: int, limit: int | None = None) -> tuple[I64Array, I64Array, F64Array]:
    """Merge ``tenants`` copies of a trace: (row, tenant, arrival ms) in arrival order, the first
    ``limit`` of them (all: None), cut before the rate is applied so it holds for those kept."""
    n = ts.size
    span = float(ts[-1] - ts[0])
    gap = span / (n - 1) if n > 1 else 0.0
    rows = np.tile(np.arange(n, dtype=np.int64), tenants)
    ten = np.repeat(np.arange(tenants, dtype=np.int64), n)
    t = ts[rows] + ten * (gap / tenants)
    # Primary key time; ties in file order, then tenant: parents (earlier rows, times no later)
    # always precede their follow-ups.
    order = np.lexsort((ten, rows, t))[:limit]
    rows, ten, t = rows[order], ten[order], t[order]
    if mode == "trace":
        return rows, ten, t
    total = rows.size
    if mode == "rescale":
        width = float(t[-1] - t[0])
        if total == 1:
            return rows, ten, np.zeros(1)
        if width <= 0:
            # ``argument``: what a front end (the CLI's --arrivals) reports it under.
            raise InvalidArgumentError(
                "cannot rescale to a rate: every request replayed has the same timestamp (replay more requests, or use Poisson arrivals: mode='poisson')", argument="mode"
            )
        return rows, ten, (t - t[0]) * ((total - 1) * 1000.0 / (rate * width))
    return rows, ten, _poisson_times(total, rate, seed)


def _check_int(name: str, value: object, low: int) -> int:
    """An integer argument (numpy integers welcome, bools refused) at least ``low``."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or int(value) < low:
        raise InvalidArgumentError(f"{name} must be an integer >= {low}, got {value!r}")
    return int(value)


# --------------------------------------------------------------------------------------------
# Loading


def load_trace(
    path: str | os.PathLike[str],
    block_size: int,
    *,
    regions: Sequence[str] | Topology,
    weights: Sequence[float] | None = None,
    seed: int = 0,
    rate: float | None = None,
    mode: RateMode = "trace",
    tenants: int = 1,
    max_requests: int | None = None,
    namespace: str = "public",
    ties: Literal["spread", "keep"] | None = None,
    max_input_length: int | None = None,
    max_total: int | None = None,
) -> list[Request]:
    """Load a JSONL trace in the Mooncake schema (see the module docstring for the rules).

    ``ties``: ``"spread"`` spreads requests that share a logged timestamp over the interval to
    the next one (:func:`spread_ties`) before any rescaling; ``"keep"`` replays them
    simultaneously. Default: spread when rescaling to a rate, keep in ``"trace"`` mode (the
    file's times exactly as logged); Poisson arrivals ignore the file's times.

    ``regions`` is a list of region names (``weights`` default: equal) or a
    :class:`~kvcompass.discovery.topology.Topology` (default: prefill capacity). ``max_requests``
    keeps the first rows of the file (before tenant replication: K copies give K times as
    many requests). ``max_total`` keeps the first requests in arrival order once the copies are
    merged (about ``max_total / K`` rows of each), before the rate is applied: what
    ``kvcompass simulate --max-requests`` means, a total as ``--rates`` is and as the generated
    workloads' counts are (it replayed N per tenant, found in review). Tenant k's namespace is ``namespace`` when ``tenants == 1``, else
    ``f"{namespace}/tenant-{k}"``. Returns the requests in arrival order, ``id`` = position.

    ``max_input_length``: the longest prompt accepted, default the topology's context window
    (``max_prefix``) when ``regions`` is a topology, else no bound. A longer prompt is an error
    naming its line, not a request simulated as if an engine served it (vLLM refuses a prompt
    past ``max_model_len``); cutting it instead would change the workload behind the user's
    back. The output length is replayed as logged.
    """
    block_size = _check_int("block_size", block_size, 1)
    tenants = _check_int("tenants", tenants, 1)
    seed = _check_int("seed", seed, 0)
    if max_requests is not None:
        max_requests = _check_int("max_requests", max_requests, 1)
    if max_total is not None:
        max_total = _check_int("max_total", max_total, 1)
        # The first max_total of the merged copies come from each copy's first max_total rows.
        max_requests = max_total if max_requests is None else min(max_requests, max_total)
    rate_v = _check_rate(mode, rate)
    names, cdf = regions_and_cdf(regions, weights)
    window: tuple[int, str] | None = None
    if max_input_length is not None:
        window = (_check_int("max_input_length", max_input_length, 1), f"max_input_length {max_input_length}")
    elif isinstance(regions, Topology):
        window = (regions.max_prefix, context_window(regions))
    rows = _read_trace(Path(path), block_size, max_requests, window, names, region_labels(regions) if isinstance(regions, Topology) else None)

    n = len(rows.timestamps)
    roots = np.asarray(rows.roots, dtype=np.int64)
    given = np.asarray(rows.regions, dtype=np.int64)
    region_of = np.empty((tenants, n), dtype=np.int64)
    for k in range(tenants):
        # Drawn for every row (so a region given on some lines moves no other line's draw),
        # then the root's own region over its draw, then the line's own over its root's.
        root_region = np.where(given >= 0, given, draw_regions(cdf, np.random.default_rng([seed, 1, k]).random(n)))[roots]
        region_of[k] = np.where(given >= 0, given, root_region)
    if ties not in (None, "spread", "keep"):
        raise InvalidArgumentError(f"ties must be 'spread' or 'keep', got {ties!r}")
    stamps = np.asarray(rows.timestamps, dtype=np.float64)
    if (ties or ("spread" if mode == "rescale" else "keep")) == "spread" and mode != "poisson":
        stamps = spread_ties(stamps, seed)
    order_rows, order_ten, arrival = _schedule(stamps, tenants, mode, rate_v, seed, max_total)
    id_of = np.full((tenants, n), -1, dtype=np.int64)  # -1: a copy's row past max_total
    id_of[order_ten, order_rows] = np.arange(order_rows.size)

    spaces = [namespace] if tenants == 1 else [f"{namespace}/tenant-{k}" for k in range(tenants)]
    blocks = [TraceBlocks(ids) for ids in rows.hash_ids]
    out: list[Request] = []
    for i, (row, k, t) in enumerate(zip(order_rows.tolist(), order_ten.tolist(), arrival.tolist())):
        p = rows.parents[row]
        out.append(
            Request(
                id=i,
                arrival_ms=t,
                region=names[region_of[k, row]],
                tenant=k,
                namespace=spaces[k],
                input_length=rows.input_lengths[row],
                output_length=rows.output_lengths[row],
                block_size=block_size,
                session=int(id_of[k, rows.roots[row]]),
                parent=int(id_of[k, p]) if p >= 0 else -1,
                blocks=blocks[row],
            )
        )
    return out


def load_mooncake(
    name: str,
    *,
    regions: Sequence[str] | Topology,
    weights: Sequence[float] | None = None,
    seed: int = 0,
    rate: float | None = None,
    mode: RateMode = "trace",
    tenants: int = 1,
    max_requests: int | None = None,
) -> list[Request]:
    """A shared Mooncake trace by name (``"conversation"``, ``"synthetic"``) at its block size
    (512); same options as :func:`load_trace`."""
    return load_trace(
        find_trace(name), MOONCAKE_BLOCK_SIZE, regions=regions, weights=weights, seed=seed, rate=rate, mode=mode, tenants=tenants, max_requests=max_requests
    )


def dump_trace(requests: Sequence[Request], path: str | os.PathLike[str]) -> None:
    """Write requests as a Mooncake-schema JSONL trace with ``chat_id`` (the request id) and
    ``parent_chat_id``, so a synthetic workload can be replayed by any tool that reads the
    schema. Regions and namespaces are not part of the schema: a workload spanning several
    namespaces or block sizes is refused rather than silently merged."""
    if len({r.namespace for r in requests}) > 1:
        raise InvalidArgumentError("requests span several namespaces; the trace schema has no namespace field (dump one tenant at a time)")
    if len({r.block_size for r in requests}) > 1:
        raise InvalidArgumentError("requests use several block sizes; a trace has one")
    with Path(path).open("w", encoding="utf-8") as f:
        for r in sorted(requests, key=lambda r: (r.arrival_ms, r.id)):
            row = {
                "timestamp": r.arrival_ms,
                "input_length": r.input_length,
                "output_length": r.output_length,
                "hash_ids": r.hash_ids().tolist(),
                "chat_id": r.id,
                "parent_chat_id": r.parent,
            }
            f.write(json.dumps(row, separators=(", ", ": ")) + "\n")


# --------------------------------------------------------------------------------------------
# Synthetic "Mixed"


@dataclass(frozen=True, slots=True)
class MixedConfig:
    """Shape of the synthetic Mixed-like workload. Lengths are tokens; ``(lo, hi)`` pairs are
    uniform ranges, ``(median, lo, hi)`` triples lognormal with shape ``sigma``, clipped (the
    usual fit for LLM prompt parts and output lengths: a long right tail, no negatives).

    The request shares follow the paper's Mixed (§5.1): ToolBench agent traces 50 %, LooGLE
    long-document QA 5 %, APPS coding problems 45 %. Popularity of tool sets, documents and
    problems is Zipf over a finite pool: item of rank i (from 1) has weight i**-zipf_s. With
    s = 1.0 and 1000 problems, the top 10 draw 39 % of the picks."""

    shares: tuple[float, float, float] = (0.50, 0.05, 0.45)
    zipf_s: float = 1.0
    sigma: float = 0.8
    # Private system prompt, one per tenant.
    system_prompt: tuple[int, int] = (300, 1500)
    # Tool-calling agents: a tool catalogue preamble shared across tenants, then the tenant's
    # system prompt and a user query; each further LLM call appends the previous call's output
    # and the tool's observation (growing context). Calls per session: geometric with the given
    # mean, capped.
    toolsets: int = 32
    tool_preamble: tuple[int, int] = (2000, 6000)
    tool_calls_mean: float = 4.0
    tool_calls_max: int = 12
    tool_query: tuple[int, int] = (30, 300)
    tool_observation: tuple[float, int, int] = (300.0, 20, 2000)
    tool_output: tuple[float, int, int] = (80.0, 10, 400)
    # Long-document QA: one question per request on a popular document.
    documents: int = 200
    document: tuple[int, int] = (8192, 32768)
    question: tuple[int, int] = (20, 200)
    answer: tuple[float, int, int] = (150.0, 8, 1024)
    # Coding problems: a shared problem statement and a short instruction.
    problems: int = 1000
    problem: tuple[float, int, int] = (600.0, 150, 3000)
    instruction: tuple[int, int] = (20, 120)
    code: tuple[float, int, int] = (350.0, 32, 2048)
    # Mean gap between an agent's calls in the virtual schedule that fixes the request order.
    call_gap_ms: float = 3000.0

    def __post_init__(self) -> None:
        s = np.asarray(self.shares, dtype=np.float64)
        if s.shape != (3,) or not np.all(np.isfinite(s)) or np.any(s < 0) or s.sum() <= 0:
            raise InvalidArgumentError(f"shares must be three finite weights >= 0, not all 0, got {self.shares}")
        if not (math.isfinite(self.zipf_s) and self.zipf_s >= 0):
            raise InvalidArgumentError(f"zipf_s must be >= 0, got {self.zipf_s}")
        if not (math.isfinite(self.sigma) and self.sigma >= 0):
            raise InvalidArgumentError(f"sigma must be >= 0, got {self.sigma}")
        for name in ("toolsets", "documents", "problems", "tool_calls_max"):
            _check_int(name, getattr(self, name), 1)
        if not (math.isfinite(self.tool_calls_mean) and self.tool_calls_mean >= 1):
            raise InvalidArgumentError(f"tool_calls_mean must be >= 1, got {self.tool_calls_mean}")
        if not (math.isfinite(self.call_gap_ms) and self.call_gap_ms >= 0):
            raise InvalidArgumentError(f"call_gap_ms must be >= 0, got {self.call_gap_ms}")
        for name in ("system_prompt", "tool_preamble", "tool_query", "document", "question", "instruction"):
            lo, hi = getattr(self, name)
            if not (_is_int(lo) and _is_int(hi) and 1 <= lo <= hi):
                raise InvalidArgumentError(f"{name} must be integers 1 <= lo <= hi, got {(lo, hi)}")
        for name in ("tool_observation", "tool_output", "answer", "problem", "code"):
            med, lo, hi = getattr(self, name)
            if not (_is_int(lo) and _is_int(hi) and 1 <= lo <= hi and math.isfinite(med) and med > 0):
                raise InvalidArgumentError(f"{name} must be (median > 0, lo, hi) with 1 <= lo <= hi, got {(med, lo, hi)}")

    def calls_mean(self) -> float:
        """Exact mean calls per agent session (the geometric law truncated at the cap)."""
        q = 1.0 - 1.0 / self.tool_calls_mean
        return float(sum(q**t for t in range(self.tool_calls_max)))


# Segment tags: what a piece of a synthetic prompt is (part of its identity).
_SEG_TOOLSET, _SEG_SYSTEM, _SEG_QUERY, _SEG_CALL, _SEG_OBS, _SEG_DOC, _SEG_QUESTION, _SEG_PROBLEM, _SEG_INSTR = range(1, 10)
_KINDS = ("tool", "docqa", "coding")


def _seg_id(*parts: int) -> int:
    return _core.mix_fold(_CHAIN_ROOT, parts)


class _Prompt:
    """A prompt under construction: segments as (chain, blocks) runs plus the token count."""

    __slots__ = ("runs", "chain", "tokens", "block_size")

    def __init__(self, block_size: int) -> None:
        self.runs: tuple[tuple[int, int], ...] = ()
        self.chain = _CHAIN_ROOT
        self.tokens = 0
        self.block_size = block_size

    def extended(self, seg: int, length: int) -> _Prompt:
        """This prompt plus one segment. The previous last segment is padded to its block
        boundary (the padding stands for chat-template tokens), so every earlier prompt of a
        session is a token prefix of the later ones."""
        bs = self.block_size
        p = _new_prompt(_Prompt)  # every field set below (a paper-scale workload extends millions)
        p.block_size = bs
        p.chain = chain = _core.mix_fold(self.chain, (seg,))
        p.runs = self.runs + ((chain, -(-length // bs)),)
        p.tokens = -(-self.tokens // bs) * bs + length
        return p


_new_prompt = object.__new__


@dataclass(slots=True)
class _Draft:
    vtime: float
    session: int
    turn: int
    kind: int
    tenant: int
    region: int
    prompt: _Prompt
    output: int


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """The cyclic garbage collector off for the block (restored after, as it was).

    Why: building a workload or running a simulation creates millions of long-lived objects
    and no reference cycles (a test checks that a run leaves none), so every full collection
    traversed them all to find nothing: a third of building 500,000 Mixed requests. Reference
    counting still frees everything."""
    collecting = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if collecting:
            gc.enable()


def _zipf_cdf(n: int, s: float) -> F64Array:
    w = np.arange(1, n + 1, dtype=np.float64) ** -s
    cdf = np.cumsum(w / w.sum())
    cdf[-1] = 1.0
    return cdf


@collector_paused()
def synthetic_mixed(
    n: int,
    *,
    regions: Sequence[str] | Topology,
    weights: Sequence[float] | None = None,
    tenants: int = 1,
    seed: int = 0,
    rate: float = 16.0,
    block_size: int = 16,
    config: MixedConfig | None = None,
    namespace: str = "public",
    private_pools: bool = False,
) -> RequestTable:
    """``n`` requests of a seeded Mixed-like workload (see :class:`MixedConfig` for every
    parameter and its source).

    Prompts (segments in order; a private system prompt per tenant):

    * ``tool``: tool catalogue (Zipf over ``toolsets``, shared across tenants) | system prompt |
      query, then per further call: previous output | observation. Multi-turn: each call is a
      follow-up of the previous one, with the whole previous prompt as its prefix.
    * ``docqa``: system prompt | document (8-32k tokens, Zipf over ``documents``) | question.
    * ``coding``: system prompt | problem statement (Zipf over ``problems``) | instruction.

    All tenants share ``namespace``: the shared tool catalogues are reusable across tenants,
    everything after a system prompt only within its tenant (the paper's tenants each have a
    unique private system prompt, §5.3). Tenants are drawn uniformly per session, regions per
    root session by ``weights``. Sessions start in a virtual schedule (agent calls
    ``call_gap_ms`` apart on average) that fixes the request order; arrival times are then a
    Poisson process at ``rate`` req/s over that order, so the offered load is exactly ``rate``.

    ``private_pools``: every tenant draws from its own copy of the tool catalogues, documents
    and problems (same sizes and popularity, different content), so tenants share nothing at
    all: the paper's Mixed at scale, "50 independent tenants each replaying the workload with
    a unique private system prompt" (§5.3, ``kvcompass simulate --trace mixed --tenants 50``).
    """
    n = _check_int("n", n, 1)
    tenants = _check_int("tenants", tenants, 1)
    seed = _check_int("seed", seed, 0)
    block_size = _check_int("block_size", block_size, 1)
    if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not math.isfinite(rate) or rate <= 0:
        raise InvalidArgumentError(f"rate must be a number > 0 in req/s, got {rate!r}")  # this function has no mode
    rate_v = float(rate)
    cfg = config if config is not None else MixedConfig()
    names, region_cdf = regions_and_cdf(regions, weights)

    rng = np.random.default_rng([seed, 3])
    sys_len = np.random.default_rng([seed, 4]).integers(cfg.system_prompt[0], cfg.system_prompt[1] + 1, size=tenants).tolist()
    systems = [_seg_id(_SEG_SYSTEM, k, ln) for k, ln in enumerate(sys_len)]
    pools = {
        _SEG_TOOLSET: rng.integers(cfg.tool_preamble[0], cfg.tool_preamble[1] + 1, size=cfg.toolsets).tolist(),
        _SEG_DOC: rng.integers(cfg.document[0], cfg.document[1] + 1, size=cfg.documents).tolist(),
        _SEG_PROBLEM: [_lognormal(rng, cfg.problem, cfg.sigma) for _ in range(cfg.problems)],
    }
    cdfs = {tag: _zipf_cdf(len(lens), cfg.zipf_s).tolist() for tag, lens in pools.items()}
    per_session = np.array([cfg.calls_mean(), 1.0, 1.0])
    kind_p = np.asarray(cfg.shares, dtype=np.float64) / per_session
    kind_cdf = np.cumsum(kind_p / kind_p.sum())
    kind_cdf[-1] = 1.0
    session_gap_ms = 1000.0 * float(np.dot(kind_p / kind_p.sum(), per_session)) / rate_v
    kind_list, region_list = kind_cdf.tolist(), region_cdf.tolist()

    def pick(tag: int, tenant: int) -> tuple[int, int]:
        item = _draw_one(cdfs[tag], rng.random())
        length = pools[tag][item]
        return (_seg_id(tag, item, length, tenant) if private_pools else _seg_id(tag, item, length)), length

    drafts: list[_Draft] = []
    t = 0.0
    session = 0
    while len(drafts) < n:
        t += float(rng.exponential(session_gap_ms))
        kind = _draw_one(kind_list, rng.random())
        # One uniform whatever the tenant count, so K tenants see the same sessions as one.
        tenant = min(int(rng.random() * tenants), tenants - 1)
        region = _draw_one(region_list, rng.random())
        base = _Prompt(block_size)
        if kind == 0:
            seg, ln = pick(_SEG_TOOLSET, tenant)
            prompt = base.extended(seg, ln).extended(systems[tenant], sys_len[tenant])
            ln = int(rng.integers(cfg.tool_query[0], cfg.tool_query[1] + 1))
            prompt = prompt.extended(_seg_id(_SEG_QUERY, seed, session, ln), ln)
            calls = min(cfg.tool_calls_max, int(rng.geometric(1.0 / cfg.tool_calls_mean)))
            vt = t
            for turn in range(calls):
                out = _lognormal(rng, cfg.tool_output, cfg.sigma)
                drafts.append(_Draft(vt, session, turn, kind, tenant, region, prompt, out))
                obs = _lognormal(rng, cfg.tool_observation, cfg.sigma)
                prompt = prompt.extended(_seg_id(_SEG_CALL, seed, session, turn, out), out)
                prompt = prompt.extended(_seg_id(_SEG_OBS, seed, session, turn, obs), obs)
                vt += float(rng.exponential(cfg.call_gap_ms)) if cfg.call_gap_ms > 0 else 0.0
        else:
            tag, tail_tag, tail, out_law = (
                (_SEG_DOC, _SEG_QUESTION, cfg.question, cfg.answer) if kind == 1 else (_SEG_PROBLEM, _SEG_INSTR, cfg.instruction, cfg.code)
            )
            seg, ln = pick(tag, tenant)
            prompt = base.extended(systems[tenant], sys_len[tenant]).extended(seg, ln)
            ln = int(rng.integers(tail[0], tail[1] + 1))
            prompt = prompt.extended(_seg_id(tail_tag, seed, session, ln), ln)
            drafts.append(_Draft(t, session, 0, kind, tenant, region, prompt, _lognormal(rng, out_law, cfg.sigma)))
        session += 1

    # Keep the first n in virtual time: a dropped call's later calls are dropped with it.
    drafts.sort(key=lambda d: (d.vtime, d.session, d.turn))
    drafts = drafts[:n]
    # Columns, not Request objects: half a million of those were 0.3 GiB (RequestTable).
    id_of: dict[tuple[int, int], int] = {}
    session_col = np.zeros(n, dtype=np.int64)
    parent_col = np.full(n, -1, dtype=np.int64)
    flat: list[int] = []
    lens = np.zeros(n, dtype=np.uint64)
    for i, d in enumerate(drafts):
        id_of[(d.session, d.turn)] = i
        if d.turn:
            parent_col[i] = id_of[(d.session, d.turn - 1)]
        session_col[i] = id_of[(d.session, 0)]
        before = len(flat)
        for chain, count in d.prompt.runs:
            flat += (chain, count)
        lens[i] = len(flat) - before
    offsets = np.zeros(n + 1, dtype=np.uint64)
    np.cumsum(lens, out=offsets[1:])
    return RequestTable(
        ids=np.arange(n, dtype=np.int64),
        arrival_ms=_poisson_times(n, rate_v, seed),
        region_codes=[d.region for d in drafts],
        region_names=names,
        tenant=[d.tenant for d in drafts],
        namespace_codes=np.zeros(n, dtype=np.uint16),
        namespace_names=(namespace,),
        input_length=[d.prompt.tokens for d in drafts],
        output_length=[d.output for d in drafts],
        block_size=np.full(n, block_size, dtype=np.int64),
        session=session_col,
        parent=parent_col,
        kind_codes=[d.kind for d in drafts],
        kind_names=_KINDS,
        runs=np.ones(n, dtype=np.bool_),
        flat=np.array(flat, dtype=np.uint64),
        offsets=offsets,
    )


def _lognormal(rng: np.random.Generator, law: tuple[float, int, int], sigma: float) -> int:
    median, lo, hi = law
    return int(min(hi, max(lo, round(median * math.exp(sigma * float(rng.standard_normal()))))))


# --------------------------------------------------------------------------------------------
# Reuse statistics


@dataclass(frozen=True, slots=True)
class ReuseStats:
    """How much of a workload's input an infinite prefix cache could reuse, replayed in arrival
    order: a token counts as reused when an earlier request (in the same namespace) had the same
    prefix up to and including it, anywhere (``reused_global``) or in the same region
    (``reused_same_region``). The difference is the reuse only another region can offer (the
    paper's Figure 2 / Figure 19 measure)."""

    requests: int
    input_tokens: int
    reused_global: int
    reused_same_region: int

    @property
    def global_fraction(self) -> float:
        return self.reused_global / self.input_tokens if self.input_tokens else 0.0

    @property
    def region_fraction(self) -> float:
        return self.reused_same_region / self.input_tokens if self.input_tokens else 0.0

    @property
    def remote_only_fraction(self) -> float:
        """Share of input reusable only from another region."""
        return self.global_fraction - self.region_fraction


def reuse_stats(requests: Iterable[Request]) -> ReuseStats:
    """Prefix reuse of a workload (see :class:`ReuseStats`). Works on block ids, so it needs no
    tokens: a block (or the partial last block) is reused when an earlier request held the same
    chain of ids at least as far; counting stops at the first block that was not."""
    reqs = sorted(requests, key=lambda r: (r.arrival_ms, r.id))
    if len({r.block_size for r in reqs}) > 1:
        raise InvalidArgumentError("reuse_stats needs one block size across the workload")
    region_ix: dict[str, int] = {}
    ns_root: dict[str, int] = {}
    # Prefix trie: (parent node, block id) -> node. Roots are negative, one per namespace.
    nodes: dict[tuple[int, int], int] = {}
    seen_len: list[int] = []  # longest length of the node's block any request held
    region_len: dict[tuple[int, int], int] = {}  # (node, region) -> same, per region
    total = reused_g = reused_r = 0
    for req in reqs:
        r = region_ix.setdefault(req.region, len(region_ix))
        parent = ns_root.setdefault(req.namespace, -1 - len(ns_root))
        bs = req.block_size
        n_in = req.input_length
        total += n_in
        match_g = match_r = True
        for k, b in enumerate(req.hash_ids().tolist()):
            ln = min(bs, n_in - k * bs)
            key = (parent, b)
            node = nodes.get(key)
            if node is None:
                node = len(seen_len)
                nodes[key] = node
                seen_len.append(ln)
                region_len[(node, r)] = ln
                match_g = match_r = False
            else:
                if match_g:
                    g = seen_len[node]
                    reused_g += min(g, ln)
                    match_g = g >= ln
                if ln > seen_len[node]:
                    seen_len[node] = ln
                rk = (node, r)
                rl = region_len.get(rk, 0)
                if match_r:
                    reused_r += min(rl, ln)
                    match_r = rl >= ln
                if ln > rl:
                    region_len[rk] = ln
            parent = node
    return ReuseStats(requests=len(reqs), input_tokens=total, reused_global=reused_g, reused_same_region=reused_r)
