"""Typed helpers over the Rust index: namespaces, tiers and the packed per-worker value.

A table's value holds one 2-bit tier field per worker of its group (field f = bits 2f..2f+1),
so one read tells every holder in the group and a tier change rewrites one value.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import numpy.typing as npt

from kvcompass import _core

__all__ = ["Namespace", "Tier", "as_lengths", "as_tokens", "pack_tiers", "tier_of", "unpack_tiers"]


class Tier(enum.IntEnum):
    """Where a worker holds a prefix's KV cache. 3 is reserved and never written."""

    ABSENT = 0
    VRAM = 1
    DRAM = 2


@dataclass(frozen=True, slots=True)
class Namespace:
    """A sharing boundary: prefixes are shared only within one (model, tenant) pair."""

    model: str
    tenant: str = "public"
    digest: bytes = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "digest", _core.namespace_digest(self.model, self.tenant))

    def keys(self, tokens: Sequence[int] | npt.NDArray[np.uint32], lengths: Sequence[int] | npt.NDArray[np.uint32]) -> npt.NDArray[np.uint64]:
        """Keys of ``tokens[:c]`` for each ``c`` (``NO_KEY`` past the prompt)."""
        return _core.prefix_keys(self.digest, as_tokens(tokens), as_lengths(lengths))


def as_tokens(tokens: Sequence[int] | npt.NDArray[np.uint32]) -> npt.NDArray[np.uint32]:
    """Token ids as a contiguous uint32 array, refusing values that do not fit (no wraparound)."""
    return _as_u32("tokens", tokens)


def as_lengths(lengths: Sequence[int] | npt.NDArray[np.uint32]) -> npt.NDArray[np.uint32]:
    """Prefix lengths as a contiguous uint32 array, refusing values that do not fit."""
    return _as_u32("lengths", lengths)


_U32 = np.dtype(np.uint32)


def _as_u32(name: str, values: Sequence[int] | npt.NDArray[np.uint32]) -> npt.NDArray[np.uint32]:
    if type(values) is np.ndarray and values.dtype is _U32 and values.ndim == 1 and values.flags.c_contiguous:
        return values  # already what the core reads (every route of the simulator and the door)
    if type(values) is list or type(values) is tuple:
        # A tokenizer's or a JSON body's ids: one Rust pass (4,096 ids ~20 µs; numpy's census,
        # int64 copy, min, max and cast ~190 µs). Anything it refuses takes the general path
        # below, which says what is wrong (or accepts what it can, e.g. numpy integers).
        arr, bad = _core.token_array(values)
        if bad < 0:
            return arr
    arr = np.asarray(values)
    if arr.ndim != 1:
        raise ValueError(f"{name} must be one-dimensional, got shape {arr.shape}")
    if arr.dtype == np.uint32:
        return np.ascontiguousarray(arr)
    if arr.size and (arr.dtype.kind not in "iu" or int(arr.min()) < 0 or int(arr.max()) > 0xFFFFFFFF):
        raise ValueError(f"{name} must be integers in 0..2**32-1")
    return np.ascontiguousarray(arr, dtype=np.uint32)


def tier_of(value: int, field_index: int) -> Tier:
    """The tier a packed value records for one worker field."""
    return Tier((value >> (2 * field_index)) & 3)


def unpack_tiers(value: int, fields: int) -> list[Tier]:
    """All worker fields of a packed value."""
    return [tier_of(value, f) for f in range(fields)]


def pack_tiers(tiers: Sequence[int]) -> int:
    """Pack per-field tiers into one value (field f at bits 2f..2f+1)."""
    value = 0
    for f, t in enumerate(tiers):
        if t not in (0, 1, 2):
            raise ValueError(f"tier {t} at field {f}: expected 0, 1 or 2")
        value |= int(t) << (2 * f)
    return value
