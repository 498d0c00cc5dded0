"""How workers map onto index tables: the contract shared by topology, agents, maintenance
units and edges.

A region's workers are split into groups of at most ``value_bits / 2`` (16 for u32 values, 32
for u64); each group is one logical table whose value holds one 2-bit tier field per worker
(field ``f`` = ``workers[f]``). Every table is split into ``shards`` (table, shard) Ludo
instances; a key belongs to shard ``key % shards``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvcompass.errors import UnknownWorkerError

__all__ = ["FieldRef", "IndexLayout", "TableSpec", "WorkerSpec", "ROLES"]

ROLES = ("prefill", "decode", "both")


@dataclass(frozen=True, slots=True)
class WorkerSpec:
    """One inference worker as the discovery plane sees it."""

    id: str
    region: str
    role: str = "both"
    beta_ms_per_token: float = 0.085
    # None: left out of the topology, so the testbed's figures apply (engine.cache's
    # worker_capacities); 0 DRAM is a worker without offloading, not "use the default".
    vram_tokens: int | None = None
    dram_tokens: int | None = None
    endpoint: str = ""


@dataclass(frozen=True, slots=True)
class TableSpec:
    """One logical table: a group of workers of one region."""

    table_id: int
    region: str
    workers: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class FieldRef:
    """Where one worker's tier lives: table and field index."""

    table_id: int
    field: int


@dataclass(frozen=True, slots=True)
class IndexLayout:
    """All tables of a deployment plus the sharding and value shape they share."""

    tables: tuple[TableSpec, ...]
    shards: int = 1
    value_bits: int = 32
    fp_bits: int = 8
    _fields: dict[str, FieldRef] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.shards < 1:
            raise ValueError(f"shards must be >= 1, got {self.shards}")
        if self.value_bits not in (32, 64):
            raise ValueError(f"value_bits must be 32 or 64, got {self.value_bits}")
        per = self.value_bits // 2
        fields: dict[str, FieldRef] = {}
        for i, t in enumerate(self.tables):
            if t.table_id != i:
                raise ValueError(f"tables[{i}] has table_id {t.table_id}; ids must be 0..n-1 in order")
            if not 1 <= len(t.workers) <= per:
                raise ValueError(f"table {i} has {len(t.workers)} workers; 1..{per} fit a {self.value_bits}-bit value")
            for f, w in enumerate(t.workers):
                if w in fields:
                    raise ValueError(f"worker {w!r} appears in two tables")
                fields[w] = FieldRef(t.table_id, f)
        object.__setattr__(self, "_fields", fields)

    def field_of(self, worker: str) -> FieldRef:
        """The table and field a worker writes; UnknownWorkerError if it has none."""
        try:
            return self._fields[worker]
        except KeyError:
            raise UnknownWorkerError(f"unknown worker {worker!r}", worker=worker) from None

    @property
    def workers(self) -> tuple[str, ...]:
        """All indexed workers in table order (the order of the edge's per-worker arrays)."""
        return tuple(w for t in self.tables for w in t.workers)
