"""API keys for the door: who may send completions, as which tenants, how fast.

Why: a tenant's cached prefixes are observable through ``cached_tokens`` (and through timing),
so naming a tenant must take a credential, not a header anyone can send. A key names the
tenants it may act as; the ``x-kvcompass-namespace`` header only selects among them.

The keys file is JSON, readable by the door alone (``kvcompass up`` writes it mode 0600) and
holding no key in the clear::

    {"keys": [{"name": "acme-prod", "sha256": "<hex of SHA-256 of the key>",
               "tenants": ["acme"], "models": ["llama-3.1-8b"],
               "rate_per_s": 50, "burst": 100}]}

``tenants`` lists the tenants the key may act as, its first being the one a request without the
header gets; ``"*"`` is any tenant (the doors' own peer key, for hand-offs). ``models`` (optional)
limits the models, ``rate_per_s``/``burst`` (optional) a token bucket per key. :meth:`KeyStore.reload`
re-reads the file (the edge does on SIGHUP); a malformed file is refused and the keys in force
stay.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import secrets
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvcompass.errors import InvalidArgumentError

__all__ = ["ANY_TENANT", "ApiKey", "KeyStore", "hash_key", "new_key", "write_keys_file"]

ANY_TENANT = "*"
_HEX64 = re.compile(r"[0-9a-f]{64}")


def hash_key(key: str) -> str:
    """The hex SHA-256 of a key (what the keys file holds)."""
    return hashlib.sha256(key.encode()).hexdigest()


def new_key() -> str:
    """A fresh random key (256 bits)."""
    return "kvc-" + secrets.token_urlsafe(32)


@dataclass(frozen=True, slots=True)
class ApiKey:
    """One key's grants (never the key itself)."""

    name: str
    tenants: tuple[str, ...]
    models: tuple[str, ...] | None = None
    rate_per_s: float | None = None
    burst: float | None = None

    def tenant_for(self, requested: str | None, default: str) -> str | None:
        """The tenant a request acts as: the one it names if the key grants it, else None; a
        request naming none gets the key's first tenant (``default`` for an any-tenant key)."""
        if requested is None:
            return default if self.tenants[0] == ANY_TENANT else self.tenants[0]
        if ANY_TENANT in self.tenants or requested in self.tenants:
            return requested
        return None

    def allows_model(self, model: str) -> bool:
        return self.models is None or model in self.models


@dataclass(slots=True)
class _Bucket:
    tokens: float
    at: float


@dataclass(slots=True)
class KeyStore:
    """The door's keys: authenticate a request's ``Authorization`` header, rate-limit its key."""

    path: Path | None = None
    _by_hash: dict[str, ApiKey] = field(default_factory=dict)
    _buckets: dict[str, _Bucket] = field(default_factory=dict)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> KeyStore:
        store = cls(Path(path))
        store.reload()
        return store

    @classmethod
    def of(cls, entries: Mapping[str, ApiKey]) -> KeyStore:
        """From ``{key in the clear: grants}`` (tests, embedding)."""
        return cls(None, {hash_key(k): v for k, v in entries.items()})

    def reload(self) -> int:
        """Re-read the file; returns the number of keys now in force. A malformed file raises
        :class:`InvalidArgumentError` and leaves the keys in force unchanged."""
        if self.path is None:
            return len(self._by_hash)
        try:
            doc = json.loads(self.path.read_text())
        except (OSError, ValueError) as e:
            raise InvalidArgumentError(f"API keys file {self.path}: {e}") from None
        keys = _parse(doc, str(self.path))
        self._by_hash = keys
        names = {k.name for k in keys.values()}
        self._buckets = {n: b for n, b in self._buckets.items() if n in names}
        return len(keys)

    def __len__(self) -> int:
        return len(self._by_hash)

    def authenticate(self, authorization: str | None) -> ApiKey | None:
        """The grants of the key in an ``Authorization: Bearer <key>`` header, or None."""
        if not authorization:
            return None
        scheme, _, token = authorization.strip().partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            return None
        # Looked up by the digest of what was sent: the lookup's timing depends on that digest,
        # which tells a guesser nothing about any real key.
        return self._by_hash.get(hash_key(token.strip()))

    def admit(self, key: ApiKey, now: float) -> float:
        """Take one request from the key's token bucket: 0 if admitted, else the seconds until
        one would be."""
        if key.rate_per_s is None:
            return 0.0
        burst = key.burst if key.burst is not None else max(1.0, key.rate_per_s)
        b = self._buckets.get(key.name)
        if b is None:
            b = self._buckets[key.name] = _Bucket(burst, now)
        b.tokens = min(burst, b.tokens + (now - b.at) * key.rate_per_s)
        b.at = now
        if b.tokens >= 1.0:
            b.tokens -= 1.0
            return 0.0
        return (1.0 - b.tokens) / key.rate_per_s


def _parse(doc: Any, where: str) -> dict[str, ApiKey]:
    if not isinstance(doc, dict) or not isinstance(doc.get("keys"), list):
        raise InvalidArgumentError(f"API keys file {where}: expected an object with a list 'keys'")
    out: dict[str, ApiKey] = {}
    names: set[str] = set()
    for i, e in enumerate(doc["keys"]):
        at = f"API keys file {where}, keys[{i}]"
        if not isinstance(e, dict):
            raise InvalidArgumentError(f"{at}: expected an object")
        name, digest, tenants = e.get("name"), e.get("sha256"), e.get("tenants")
        if not isinstance(name, str) or not name or name in names:
            raise InvalidArgumentError(f"{at}: 'name' must be a unique non-empty string")
        if not isinstance(digest, str) or not _HEX64.fullmatch(digest) or digest in out:
            raise InvalidArgumentError(f"{at}: 'sha256' must be the unique lowercase hex SHA-256 of the key")
        if not isinstance(tenants, list) or not tenants or not all(isinstance(t, str) and t for t in tenants):
            raise InvalidArgumentError(f"{at}: 'tenants' must be a non-empty list of tenant names (or [\"*\"])")
        models = e.get("models")
        if models is not None and (not isinstance(models, list) or not all(isinstance(m, str) for m in models)):
            raise InvalidArgumentError(f"{at}: 'models' must be a list of model names")
        rate, burst = e.get("rate_per_s"), e.get("burst")
        # A burst below one request never holds a whole request: every one would be refused,
        # each with a Retry-After that never comes true (found in review).
        for label, v, least in (("rate_per_s", rate, 0.0), ("burst", burst, 1.0)):
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0 or v < least):
                raise InvalidArgumentError(f"{at}: '{label}' must be a number " + ("> 0" if least == 0 else f">= {least:g}"))
        names.add(name)
        out[digest] = ApiKey(name, tuple(tenants), None if models is None else tuple(models), None if rate is None else float(rate), None if burst is None else float(burst))
    return out


def write_keys_file(path: str | os.PathLike[str], entries: Iterable[tuple[str, str, Sequence[str]]], limits: Mapping[str, tuple[float, float | None]] | None = None) -> None:
    """Write a keys file (mode 0600) for ``(name, key in the clear, tenants)`` entries: only
    the keys' digests go to disk. ``limits``: name -> ``(rate_per_s, burst or None)`` for the
    keys that get a token bucket."""
    limits = limits or {}
    doc: dict[str, Any] = {"keys": []}
    for n, k, t in entries:
        e: dict[str, Any] = {"name": n, "sha256": hash_key(k), "tenants": list(t)}
        if n in limits:
            rate, burst = limits[n]
            e["rate_per_s"] = rate
            if burst is not None:
                e["burst"] = burst
        doc["keys"].append(e)
    _parse(doc, str(path))
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(json.dumps(doc, indent=2) + "\n")
