"""KVCompass: a KV-cache discovery plane for Internet-scale LLM serving.

The hot paths (prefix hashing, the keyless Ludo index, sequence-checked patches and the
lookup-and-score loop) live in the Rust extension ``kvcompass._core``; this package re-exports
them with a few typed helpers in :mod:`kvcompass.index`.
"""

from __future__ import annotations

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
from kvcompass.index import Namespace, Tier, pack_tiers, tier_of, unpack_tiers

__version__ = "0.1.0"

__all__ = [
    "NO_KEY",
    "PATCH_VERSION",
    "ApplyResult",
    "LudoTable",
    "LudoView",
    "Namespace",
    "Router",
    "RouteResult",
    "Tier",
    "decode_batch_header",
    "errors",
    "namespace_digest",
    "pack_tiers",
    "prefix_keys",
    "prefix_keys_batch",
    "shard_of",
    "tier_of",
    "unpack_tiers",
    "__version__",
]
