"""KVCompass: a KV-cache discovery plane for Internet-scale LLM serving.

The hot paths (prefix hashing, the keyless Ludo index, sequence-checked patches and the
lookup-and-score loop) live in the Rust extension ``kvcompass._core``; this package re-exports
them with a few typed helpers in :mod:`kvcompass.index_types`.

The main objects of each layer are importable from here too: :class:`Edge` (an edge's index
replica and router), :class:`MaintenanceUnit` (a shard's single writer), :class:`LocalPlane`
(a whole plane in one process), :class:`WorkerAgent` (engine KV events to key ops) and
:func:`simulate`. They load on first use, so ``import kvcompass`` stays as cheap as the Rust
core (a service's start-up time counts toward its recovery after a crash).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from kvcompass import errors
from kvcompass._core import (
    NO_KEY,
    PATCH_VERSION,
    ApplyResult,
    LudoTable,
    LudoView,
    Router,
    RouteResult,
    decode_batch_header,
    namespace_digest,
    prefix_keys,
    prefix_keys_batch,
    shard_of,
)
from kvcompass.index_types import Namespace, Tier, pack_tiers, tier_of, unpack_tiers

if TYPE_CHECKING:
    from kvcompass.agent.agent import WorkerAgent
    from kvcompass.discovery.edge import Edge
    from kvcompass.discovery.maintenance import MaintenanceUnit
    from kvcompass.discovery.plane import LocalPlane
    from kvcompass.sim.engine import simulate

__version__ = "0.1.0"

_LAZY = {
    "Edge": "kvcompass.discovery.edge",
    "LocalPlane": "kvcompass.discovery.plane",
    "MaintenanceUnit": "kvcompass.discovery.maintenance",
    "WorkerAgent": "kvcompass.agent.agent",
    "simulate": "kvcompass.sim.engine",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'kvcompass' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


__all__ = [
    "NO_KEY",
    "PATCH_VERSION",
    "ApplyResult",
    "Edge",
    "LocalPlane",
    "MaintenanceUnit",
    "LudoTable",
    "LudoView",
    "Namespace",
    "Router",
    "RouteResult",
    "Tier",
    "WorkerAgent",
    "decode_batch_header",
    "errors",
    "namespace_digest",
    "pack_tiers",
    "prefix_keys",
    "prefix_keys_batch",
    "shard_of",
    "simulate",
    "tier_of",
    "unpack_tiers",
    "__version__",
]
