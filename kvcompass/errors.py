"""Exceptions raised by KVCompass.

The Rust core returns one error enum; ``rust/python/errors.rs`` maps each variant to exactly one
class here, with the variant's fields as attributes, so callers can branch on the type and read
``.expected``/``.got`` instead of parsing messages.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "KVCompassError",
    "PatchError",
    "SequenceGapError",
    "StalePatchError",
    "EpochChangedError",
    "WrongTableError",
    "MalformedPatchError",
    "UninitialisedViewError",
    "CapacityError",
    "InvalidKeyError",
    "InvalidValueError",
    "InvalidTierError",
    "InvalidFieldError",
    "KeyNotFoundError",
    "InvalidArgumentError",
    "TopologyError",
    "UnknownWorkerError",
    "ForbiddenWriteError",
    "InvalidEventError",
    "AgentSequenceError",
    "WrongShardError",
    "StaleIncarnationError",
    "UsageError",
    "UnauthenticatedError",
    "NotAllowedError",
    "RateLimitedError",
    "DrainingError",
    "SubscriberLaggingError",
    "UnknownRouteError",
    "MessageTooLargeError",
    "UnsupportedError",
    "IngestRejectedError",
]


class KVCompassError(Exception):
    """Base class: every error KVCompass raises on purpose."""

    def __init__(self, message: str, **attrs: Any) -> None:
        super().__init__(message)
        self.message = message
        for name, value in attrs.items():
            setattr(self, name, value)


class PatchError(KVCompassError):
    """A patch batch was refused; the view is unchanged."""


class SequenceGapError(PatchError):
    """Batches were lost: the view needs ``expected`` but received ``got`` (replay from ``expected``)."""

    epoch: int
    expected: int
    got: int


class StalePatchError(PatchError):
    """A duplicate or older batch (already applied); safe to drop."""

    epoch: int
    seq: int
    got_epoch: int
    got_seq: int


class EpochChangedError(PatchError):
    """The writer restarted under a new epoch; resync from a snapshot."""

    epoch: int
    got_epoch: int


class WrongTableError(PatchError):
    """The batch belongs to a different (table, shard)."""

    table: int
    shard: int
    got_table: int
    got_shard: int


class MalformedPatchError(PatchError, ValueError):
    """Bytes that are not a valid batch (truncated, corrupt, wrong version, out of range)."""


class UninitialisedViewError(PatchError):
    """A delta reached a view that has never received a snapshot."""


class CapacityError(KVCompassError):
    """The table would have to grow past its hard maximum; nothing was changed."""

    needed: int
    max: int


class InvalidKeyError(KVCompassError, ValueError):
    """Keys are 63-bit; the top bit is reserved."""

    key: int


class InvalidValueError(KVCompassError, ValueError):
    """A value wider than the table's value width."""

    value: int
    bits: int


class InvalidTierError(KVCompassError, ValueError):
    """Tier outside 0 (absent), 1 (VRAM), 2 (DRAM)."""

    tier: int


class InvalidFieldError(KVCompassError, ValueError):
    """A worker field index outside the table's worker group."""

    field: int
    fields: int


class KeyNotFoundError(KVCompassError, KeyError):
    """An update addressed a key the table does not hold."""

    key: int

    def __str__(self) -> str:  # KeyError would otherwise repr() the message
        return self.message


class InvalidArgumentError(KVCompassError, ValueError):
    """An argument outside its documented range."""


class UsageError(InvalidArgumentError):
    """A bad command-line argument or option file: ``kvcompass`` prints it as one line on
    stderr and exits 2. Raised by the services' and tools' option checks as well as the CLI's,
    so it lives here, below every layer that raises it."""


class TopologyError(KVCompassError, ValueError):
    """A topology file or definition is invalid; the message names the field and the mistake."""


class UnknownWorkerError(KVCompassError, KeyError):
    """A worker id that the topology does not know."""

    worker: str

    def __str__(self) -> str:
        return self.message


class ForbiddenWriteError(KVCompassError, PermissionError):
    """A worker tried to write a field that belongs to another worker; nothing was changed."""

    worker: str


class InvalidEventError(KVCompassError, ValueError):
    """An engine KV event (or batch) that cannot be decoded or violates the schema; the agent's
    state is unchanged."""


class AgentSequenceError(KVCompassError):
    """Key-op batches from an agent arrived out of order (a gap or an old incarnation)."""

    expected: int
    got: int


class WrongShardError(KVCompassError, ValueError):
    """A key-op batch (or one of its keys) addressed to another shard; nothing was changed.

    ``key`` is the offending key, or None when the batch itself names another shard.
    """

    shard: int
    got_shard: int
    key: int | None


class StaleIncarnationError(AgentSequenceError):
    """A batch from an older incarnation of an agent (a zombie process); drop it.

    ``expected``/``got`` are incarnations here: the current one and the batch's.
    """

    worker: str


# ---- refusals of the services (each maps to one gRPC status and one HTTP status) ---------------


class UnauthenticatedError(KVCompassError, PermissionError):
    """A request without a valid credential: an API key, a worker's ingest token, the edges'
    shared secret. Nothing was read past the credential."""


class NotAllowedError(KVCompassError, PermissionError):
    """A valid credential asked for something it may not do: a tenant, model or namespace that is
    not its own. ``code`` names what (e.g. ``tenant_not_allowed``) when there is a name for it."""

    code: str | None


class RateLimitedError(KVCompassError):
    """A credential's request rate is used up; retry after ``retry_after_s`` seconds."""

    retry_after_s: float


class DrainingError(KVCompassError):
    """The service is shutting down and takes no new work: retry on another replica, or on this
    address once it is back."""


class SubscriberLaggingError(KVCompassError):
    """A patch subscriber fell too far behind the unit's stream: resubscribe from its positions
    (the unit replays or snapshots what it missed)."""


class UnknownRouteError(KVCompassError, KeyError):
    """An outcome for a route this edge never issued, already closed, or no longer keeps."""

    def __str__(self) -> str:
        return self.message


class MessageTooLargeError(KVCompassError, ValueError):
    """A request larger than the server's limit for its kind; nothing was read past its size."""

    limit: int


class UnsupportedError(KVCompassError):
    """A request for something this server does not implement (e.g. compressed gRPC messages)."""


class IngestRejectedError(KVCompassError):
    """A maintenance unit refused a key-op batch (or the ingest stream) for a reason resending
    cannot fix. ``cause`` is the class of the unit's refusal (read back from its status and
    reason), ``reason`` that class's name, ``status`` the gRPC status it came with, ``shard`` and
    ``seq`` the batch."""

    shard: int
    seq: int
    status: object
    reason: str
    cause: type[KVCompassError]

