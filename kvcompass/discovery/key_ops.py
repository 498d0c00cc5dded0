"""Key ops: what a worker agent sends to the maintenance units.

A batch carries one worker's tier changes for keys of one shard, stamped with the agent's
incarnation (bumped on every engine restart or agent restart) and a per-(incarnation, shard)
sequence number, so a maintenance unit can detect loss, duplication and reordering.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from kvcompass.records import fast_init

__all__ = ["KeyOpBatch"]


@fast_init
@dataclass(frozen=True, slots=True)
class KeyOpBatch:
    """Tier changes of one worker for keys of one shard.

    ``tiers[i]`` is the new tier of ``keys[i]`` for ``worker``: 0 removed, 1 VRAM, 2 DRAM.
    ``reset``: drop every key this worker held in this shard before applying the ops (an engine
    restart, or a full re-report after a gap).
    """

    worker: str
    incarnation: int
    shard: int
    seq: int
    keys: npt.NDArray[np.uint64]
    tiers: npt.NDArray[np.uint8]
    reset: bool = False

    def __post_init__(self) -> None:
        if self.keys.shape != self.tiers.shape or self.keys.ndim != 1:
            raise ValueError(f"keys {self.keys.shape} and tiers {self.tiers.shape} must be equal 1-D shapes")
        if self.keys.dtype != np.uint64 or self.tiers.dtype != np.uint8:
            raise ValueError(f"keys must be uint64 and tiers uint8, got {self.keys.dtype} and {self.tiers.dtype}")
