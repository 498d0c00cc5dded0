"""Requests: one :class:`Request` of a workload, where its block ids come from, token expansion,
and :class:`RequestTable`, a whole workload held as columns.

Token expansion
    Block id ``b`` stands for ``block_size`` token ids derived from ``b`` alone (see
    :func:`expand_blocks` and :mod:`kvcompass.sim.workload`), so a request holds ids, never
    tokens.

Memory
    A :class:`Request` is an object of a dozen fields with its runs or ids: about 600 bytes for
    a synthetic Mixed request. A :class:`RequestTable` holds the same fields as one array each
    and every request's block ids in one flat array beside offsets: about 160 bytes a request,
    and no object per request for the allocator to keep (why: the paper's scale is 500,000
    requests in a 2 GiB run, and the simulator's engine takes these arrays anyway).
"""

from __future__ import annotations

import operator
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, TypeAlias, overload

import numpy as np
import numpy.typing as npt

from kvcompass import _core
from kvcompass.errors import InvalidArgumentError
from kvcompass.records import fast_init

__all__ = ["BlockSource", "ChainBlocks", "Request", "RequestTable", "TraceBlocks", "expand_blocks"]

U64Array: TypeAlias = npt.NDArray[np.uint64]
U32Array: TypeAlias = npt.NDArray[np.uint32]
I64Array: TypeAlias = npt.NDArray[np.int64]


def _ids_of(hash_ids: Sequence[int] | npt.NDArray[np.integer]) -> U64Array:
    arr = np.asarray(hash_ids)
    if arr.ndim != 1:
        raise InvalidArgumentError(f"hash_ids must be one-dimensional, got shape {arr.shape}")
    if arr.dtype == np.uint64:
        return arr
    if arr.size == 0:
        return np.zeros(0, dtype=np.uint64)
    if arr.dtype.kind not in "iu" or int(arr.min()) < 0:
        raise InvalidArgumentError("hash_ids must be integers in 0..2**63-1")
    return arr.astype(np.uint64)


def expand_blocks(hash_ids: Sequence[int] | npt.NDArray[np.integer], input_length: int, block_size: int) -> U32Array:
    """The token ids of a prompt given its block ids: ``block_size`` tokens per id, derived from
    the id alone, cut to ``input_length``. Equal ids give equal tokens in any request, any
    process. ``InvalidArgumentError`` when ``len(hash_ids) != ceil(input_length / block_size)``."""
    if block_size < 1:
        raise InvalidArgumentError(f"block_size must be >= 1, got {block_size}")
    ids = _ids_of(hash_ids)
    if input_length < 0 or ids.size != -(-input_length // block_size):
        raise InvalidArgumentError(f"{ids.size} hash ids cannot cover input_length {input_length} at block_size {block_size}: need ceil({input_length}/{block_size})")
    # Token j of a block is mix(mix(id ^ TOKEN_SALT) + j * GOLDEN), its top 32 bits mapped onto
    # [0, VOCAB) by multiply-shift; computed in Rust (rust/token_ids.rs), one pass, no temporaries.
    return _core.expand_block_tokens(np.ascontiguousarray(ids, dtype=np.uint64), input_length, block_size)


# --------------------------------------------------------------------------------------------
# Requests


@dataclass(frozen=True, slots=True)
class TraceBlocks:
    """Block ids read from a trace: one read-only array, shared by every tenant copy of the row."""

    ids: U64Array

    @property
    def n_blocks(self) -> int:
        return int(self.ids.size)

    def hash_ids(self) -> U64Array:
        return self.ids


@fast_init
@dataclass(frozen=True, slots=True)
class ChainBlocks:
    """Block ids of a synthetic prompt, stored as runs: run ``(chain, count)`` stands for the ids
    ``mix(chain + j * golden) mod 2**63`` for ``j = 1..count``. ``chain`` identifies everything
    before and including the run's segment, so every id stands for its whole prefix, as in the
    Mooncake traces (the ids form a prefix tree)."""

    runs: tuple[tuple[int, int], ...]

    @property
    def n_blocks(self) -> int:
        return sum(count for _, count in self.runs)

    def hash_ids(self) -> U64Array:
        runs = self.runs
        chains = np.fromiter((c for c, _ in runs), dtype=np.uint64, count=len(runs))
        counts = np.fromiter((n for _, n in runs), dtype=np.uint64, count=len(runs))
        return _core.chain_block_ids(chains, counts)


BlockSource: TypeAlias = TraceBlocks | ChainBlocks


@fast_init  # a paper-scale workload builds half a million
@dataclass(frozen=True, slots=True, eq=False)
class Request:
    """One request of a workload. Holds ids, not tokens: :meth:`input_tokens` materialises them.

    ``id`` is the position in arrival order (0..N-1 within one workload); ``session`` is the id
    of the session's root request (``== id`` for a root) and ``parent`` the id of the previous
    turn (-1 for a root). ``namespace`` is the sharing group, to be passed as the ``tenant`` of
    :class:`kvcompass.Namespace`; ``tenant`` is the tenant's index. ``kind`` says where the
    request came from: ``"trace"``, or the synthetic ``"tool"``, ``"docqa"``, ``"coding"``.
    Equality compares every field and the ids (not object identity).
    """

    id: int
    arrival_ms: float
    region: str
    tenant: int
    namespace: str
    input_length: int
    output_length: int
    block_size: int
    session: int
    parent: int
    blocks: BlockSource
    kind: str = "trace"

    @property
    def is_root(self) -> bool:
        return self.parent < 0

    @property
    def n_blocks(self) -> int:
        return self.blocks.n_blocks

    def hash_ids(self) -> U64Array:
        """The request's block ids in the Mooncake sense (``ceil(input_length / block_size)`` of
        them; equal leading ids mean a shared prefix)."""
        return self.blocks.hash_ids()

    def input_tokens(self) -> U32Array:
        """The prompt's token ids (uint32, ``input_length`` of them), computed on every call."""
        return expand_blocks(self.hash_ids(), self.input_length, self.block_size)

    def _scalars(self) -> tuple[object, ...]:
        return (self.id, self.arrival_ms, self.region, self.tenant, self.namespace, self.input_length, self.output_length, self.block_size, self.session, self.parent, self.kind)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Request):
            return NotImplemented
        return self._scalars() == other._scalars() and bool(np.array_equal(self.hash_ids(), other.hash_ids()))

    def __hash__(self) -> int:
        return hash(self._scalars())


# --------------------------------------------------------------------------------------------
# A workload as columns

_CHUNK = 4096  # rows converted to Python values at a time when iterating


def _column(name: str, values: npt.ArrayLike, dtype: type[np.generic], n: int | None) -> npt.NDArray[Any]:
    a = np.ascontiguousarray(values, dtype=dtype)
    if a.ndim != 1 or (n is not None and a.size != n):
        raise InvalidArgumentError(f"RequestTable: column {name!r} has shape {a.shape}, expected ({n},)")
    a.setflags(write=False)
    return a


class RequestTable(Sequence[Request]):
    """A workload as columns: one array per :class:`Request` field (strings as codes into a
    tuple of names) and every request's block ids in one flat array, request ``i``'s at
    ``flat[offsets[i]:offsets[i + 1]]``: ``(chain, count)`` pairs where ``runs[i]`` (a
    :class:`ChainBlocks`), else the ids themselves (a :class:`TraceBlocks`).

    It is a ``Sequence[Request]``: ``table[i]`` builds that request on the spot (equal to the
    one it was made from), iteration yields every request in order, a slice is a table. The
    columns are read-only. Build one with :meth:`from_requests` or, as the generators do, from
    columns."""

    __slots__ = (
        "ids",
        "arrival_ms",
        "region_codes",
        "region_names",
        "tenant",
        "namespace_codes",
        "namespace_names",
        "input_length",
        "output_length",
        "block_size",
        "session",
        "parent",
        "kind_codes",
        "kind_names",
        "runs",
        "flat",
        "offsets",
    )

    ids: I64Array
    arrival_ms: npt.NDArray[np.float64]
    region_codes: npt.NDArray[np.uint16]
    region_names: tuple[str, ...]
    tenant: I64Array
    namespace_codes: npt.NDArray[np.uint16]
    namespace_names: tuple[str, ...]
    input_length: I64Array
    output_length: I64Array
    block_size: I64Array
    session: I64Array
    parent: I64Array
    kind_codes: npt.NDArray[np.uint8]
    kind_names: tuple[str, ...]
    runs: npt.NDArray[np.bool_]
    flat: U64Array
    offsets: npt.NDArray[np.uint64]

    def __init__(
        self,
        *,
        ids: npt.ArrayLike,
        arrival_ms: npt.ArrayLike,
        region_codes: npt.ArrayLike,
        region_names: Sequence[str],
        tenant: npt.ArrayLike,
        namespace_codes: npt.ArrayLike,
        namespace_names: Sequence[str],
        input_length: npt.ArrayLike,
        output_length: npt.ArrayLike,
        block_size: npt.ArrayLike,
        session: npt.ArrayLike,
        parent: npt.ArrayLike,
        kind_codes: npt.ArrayLike,
        kind_names: Sequence[str],
        runs: npt.ArrayLike,
        flat: npt.ArrayLike,
        offsets: npt.ArrayLike,
    ) -> None:
        set_ = object.__setattr__
        i = _column("ids", ids, np.int64, None)
        n = int(i.size)
        set_(self, "ids", i)
        set_(self, "arrival_ms", _column("arrival_ms", arrival_ms, np.float64, n))
        ints = {"tenant": tenant, "input_length": input_length, "output_length": output_length, "block_size": block_size, "session": session, "parent": parent}
        for name, values in ints.items():
            set_(self, name, _column(name, values, np.int64, n))
        coded = (("region", region_codes, region_names, np.uint16), ("namespace", namespace_codes, namespace_names, np.uint16), ("kind", kind_codes, kind_names, np.uint8))
        for what, codes, names, dtype in coded:
            c = _column(f"{what}_codes", codes, dtype, n)
            names_t = tuple(names)
            if c.size and int(c.max()) >= len(names_t):
                raise InvalidArgumentError(f"RequestTable: {what} codes reach {int(c.max())} with {len(names_t)} names")
            set_(self, f"{what}_codes", c)
            set_(self, f"{what}_names", names_t)
        set_(self, "runs", _column("runs", runs, np.bool_, n))
        f = _column("flat", flat, np.uint64, None)
        o = _column("offsets", offsets, np.uint64, n + 1)
        if o[0] != 0 or int(o[-1]) != f.size or bool(np.any(o[1:] < o[:-1])):
            raise InvalidArgumentError(f"RequestTable: offsets must rise from 0 to len(flat) = {f.size}")
        if n and bool(np.any((o[1:] - o[:-1])[self.runs] % 2)):
            raise InvalidArgumentError("RequestTable: a request's runs are (chain, count) pairs, an even count of values")
        set_(self, "flat", f)
        set_(self, "offsets", o)

    def __reduce__(self) -> tuple[object, ...]:
        # Rebuilt through __init__ (the slots are read-only to setattr, which pickle uses).
        return (_restore, (tuple(getattr(self, k) for k in self.__slots__),))

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"RequestTable is read-only (setting {name!r})")

    @classmethod
    def from_requests(cls, requests: Iterable[Request]) -> RequestTable:
        """The table of ``requests``, in their order (the table itself when it is one)."""
        if isinstance(requests, RequestTable):
            return requests
        reqs = list(requests)
        codes: dict[str, dict[str, int]] = {"region": {}, "namespace": {}, "kind": {}}

        def code(kind: str, name: str) -> int:
            m = codes[kind]
            c = m.get(name)
            if c is None:
                c = m[name] = len(m)
            return c

        # Runs flattened into one list and trace ids gathered as arrays, in one pass (an array
        # per prompt was 5 µs a request).
        parts: list[U64Array] = []
        flat: list[int] = []
        lens = np.zeros(len(reqs), dtype=np.uint64)
        runs = np.zeros(len(reqs), dtype=np.bool_)
        for i, q in enumerate(reqs):
            b = q.blocks
            if isinstance(b, ChainBlocks):
                runs[i] = True
                before = len(flat)
                for chain, count in b.runs:
                    flat += (chain, count)
                lens[i] = len(flat) - before
            else:
                if flat:
                    parts.append(np.array(flat, dtype=np.uint64))
                    flat = []
                h = q.hash_ids()
                parts.append(h)
                lens[i] = len(h)
        if flat:
            parts.append(np.array(flat, dtype=np.uint64))
        offsets = np.zeros(len(reqs) + 1, dtype=np.uint64)
        np.cumsum(lens, out=offsets[1:])
        return cls(
            ids=[q.id for q in reqs],
            arrival_ms=[q.arrival_ms for q in reqs],
            region_codes=[code("region", q.region) for q in reqs],
            region_names=list(codes["region"]),
            tenant=[q.tenant for q in reqs],
            namespace_codes=[code("namespace", q.namespace) for q in reqs],
            namespace_names=list(codes["namespace"]),
            input_length=[q.input_length for q in reqs],
            output_length=[q.output_length for q in reqs],
            block_size=[q.block_size for q in reqs],
            session=[q.session for q in reqs],
            parent=[q.parent for q in reqs],
            kind_codes=[code("kind", q.kind) for q in reqs],
            kind_names=list(codes["kind"]),
            runs=runs,
            flat=np.concatenate(parts) if parts else np.zeros(0, dtype=np.uint64),
            offsets=offsets,
        )

    def __len__(self) -> int:
        return int(self.ids.size)

    @property
    def nbytes(self) -> int:
        """Bytes of the columns (the names aside)."""
        return sum(int(getattr(self, k).nbytes) for k in self.__slots__ if not k.endswith("_names"))

    def _row(self, i: int, blocks: BlockSource) -> Request:
        return Request(
            self.ids.item(i),
            self.arrival_ms.item(i),
            self.region_names[self.region_codes.item(i)],
            self.tenant.item(i),
            self.namespace_names[self.namespace_codes.item(i)],
            self.input_length.item(i),
            self.output_length.item(i),
            self.block_size.item(i),
            self.session.item(i),
            self.parent.item(i),
            blocks,
            self.kind_names[self.kind_codes.item(i)],
        )

    def _blocks(self, i: int) -> BlockSource:
        a, b = self.offsets.item(i), self.offsets.item(i + 1)
        if self.runs.item(i):
            v = self.flat[a:b].tolist()
            return ChainBlocks(tuple(zip(v[::2], v[1::2])))
        return TraceBlocks(self.flat[a:b])

    @overload
    def __getitem__(self, index: int) -> Request: ...
    @overload
    def __getitem__(self, index: slice) -> RequestTable: ...
    def __getitem__(self, index: int | slice) -> Request | RequestTable:
        n = len(self)
        if isinstance(index, slice):
            return self.take(np.arange(n, dtype=np.int64)[index])
        i = operator.index(index)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(f"request {index} of a table of {n}")
        return self._row(i, self._blocks(i))

    def __iter__(self) -> Iterator[Request]:
        n = len(self)
        for lo in range(0, n, _CHUNK):
            yield from self.rows(lo, min(n, lo + _CHUNK))

    def rows(self, lo: int, hi: int) -> list[Request]:
        """Requests ``lo`` to ``hi - 1``, built in one pass over the columns (a request costs
        about a microsecond here, against three one at a time)."""
        n = len(self)
        if not 0 <= lo <= hi <= n:
            raise IndexError(f"rows {lo}..{hi} of a table of {n}")
        base = self.offsets.item(lo)
        offs = (self.offsets[lo : hi + 1] - np.uint64(base)).tolist()
        flat = self.flat[base : self.offsets.item(hi)]
        vals = flat.tolist()
        blocks: list[BlockSource] = []
        for k, run in enumerate(self.runs[lo:hi].tolist()):
            a, b = offs[k], offs[k + 1]
            if run:
                v = vals[a:b]
                blocks.append(ChainBlocks(tuple(zip(v[::2], v[1::2]))))
            else:
                blocks.append(TraceBlocks(flat[a:b]))
        regions, namespaces, kinds = self.region_names, self.namespace_names, self.kind_names
        return [
            Request(*row)
            for row in zip(
                self.ids[lo:hi].tolist(),
                self.arrival_ms[lo:hi].tolist(),
                [regions[c] for c in self.region_codes[lo:hi].tolist()],
                self.tenant[lo:hi].tolist(),
                [namespaces[c] for c in self.namespace_codes[lo:hi].tolist()],
                self.input_length[lo:hi].tolist(),
                self.output_length[lo:hi].tolist(),
                self.block_size[lo:hi].tolist(),
                self.session[lo:hi].tolist(),
                self.parent[lo:hi].tolist(),
                blocks,
                [kinds[c] for c in self.kind_codes[lo:hi].tolist()],
            )
        ]

    def take(self, rows: npt.ArrayLike) -> RequestTable:
        """The table of rows ``rows`` (indices, in that order)."""
        idx = np.asarray(rows, dtype=np.int64)
        if idx.ndim != 1:
            raise InvalidArgumentError(f"rows must be one-dimensional, got shape {idx.shape}")
        n = len(self)
        if idx.size and (int(idx.min()) < -n or int(idx.max()) >= n):
            raise IndexError(f"rows reach outside a table of {n}")
        idx = np.where(idx < 0, idx + n, idx)
        starts = self.offsets[:-1][idx].astype(np.int64)
        lens = (self.offsets[1:][idx] - self.offsets[:-1][idx]).astype(np.int64)
        offsets = np.zeros(idx.size + 1, dtype=np.uint64)
        np.cumsum(lens, out=offsets[1:])
        # Each new position p of row k reads flat[starts[k] + p - offsets[k]].
        gather = np.arange(int(offsets[-1]), dtype=np.int64) + np.repeat(starts - offsets[:-1].astype(np.int64), lens)
        cols: dict[str, Any] = {k: getattr(self, k) for k in self.__slots__}
        for k in self.__slots__:
            if not k.endswith("_names") and k not in ("flat", "offsets"):
                cols[k] = cols[k][idx]  # a column of one value a row
        cols.update(flat=self.flat[gather], offsets=offsets)
        return RequestTable(**cols)

    def by_arrival(self) -> RequestTable:
        """The rows ordered by (arrival, id), ties kept in table order (this table when it is
        ordered already)."""
        order = np.lexsort((self.ids, self.arrival_ms))
        if bool(np.all(order == np.arange(len(self)))):
            return self
        return self.take(order)

    def namespaces_used(self) -> set[str]:
        """The namespaces the requests are in."""
        return {self.namespace_names[c] for c in np.unique(self.namespace_codes).tolist()}

    def first_of_region(self) -> dict[str, int]:
        """Each region the requests come from and the id of its first request."""
        codes, first = np.unique(self.region_codes, return_index=True)
        return {self.region_names[c]: self.ids.item(f) for c, f in zip(codes.tolist(), first.tolist())}

    def __eq__(self, other: object) -> bool:
        if isinstance(other, (RequestTable, list, tuple)):
            return len(self) == len(other) and all(a == b for a, b in zip(self, other))
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]  # equality by content, as a list's

    def __repr__(self) -> str:
        return f"RequestTable({len(self)} requests)"


def _restore(values: tuple[object, ...]) -> RequestTable:
    return RequestTable(**dict(zip(RequestTable.__slots__, values)))  # type: ignore[arg-type]
