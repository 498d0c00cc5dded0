"""The one place where KVCompass errors become gRPC statuses.

Every class in :mod:`kvcompass.errors` has its own row (a test checks that none is missing), so
a client can branch on the status code alone: ``ABORTED`` always means "a sequence check failed,
resend from the expected position", ``FAILED_PRECONDITION`` "resending will not help until
something else changes" (a newer agent incarnation, a writer epoch), ``PERMISSION_DENIED`` "this
identity may not do that". Classes are looked up along the MRO, so a subclass added later
inherits its parent's row until it gets its own.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Final, Mapping

from grpclib.const import Status
from grpclib.exceptions import GRPCError

from kvcompass.errors import (
    AgentSequenceError,
    CapacityError,
    EpochChangedError,
    ForbiddenWriteError,
    InvalidArgumentError,
    InvalidEventError,
    InvalidFieldError,
    InvalidKeyError,
    InvalidTierError,
    InvalidValueError,
    KeyNotFoundError,
    KVCompassError,
    MalformedPatchError,
    PatchError,
    SequenceGapError,
    StaleIncarnationError,
    StalePatchError,
    TopologyError,
    UninitialisedViewError,
    UnknownWorkerError,
    UsageError,
    WrongShardError,
    WrongTableError,
)

__all__ = ["STATUS_OF", "grpc_error", "status_of"]

STATUS_OF: Final[Mapping[type[KVCompassError], Status]] = MappingProxyType(
    {
        KVCompassError: Status.INTERNAL,
        PatchError: Status.ABORTED,
        SequenceGapError: Status.ABORTED,
        StalePatchError: Status.ALREADY_EXISTS,
        EpochChangedError: Status.FAILED_PRECONDITION,
        WrongTableError: Status.INVALID_ARGUMENT,
        MalformedPatchError: Status.INVALID_ARGUMENT,
        UninitialisedViewError: Status.FAILED_PRECONDITION,
        CapacityError: Status.RESOURCE_EXHAUSTED,
        InvalidKeyError: Status.INVALID_ARGUMENT,
        InvalidValueError: Status.INVALID_ARGUMENT,
        InvalidTierError: Status.INVALID_ARGUMENT,
        InvalidFieldError: Status.INVALID_ARGUMENT,
        KeyNotFoundError: Status.NOT_FOUND,
        InvalidArgumentError: Status.INVALID_ARGUMENT,
        TopologyError: Status.INVALID_ARGUMENT,
        UnknownWorkerError: Status.NOT_FOUND,
        ForbiddenWriteError: Status.PERMISSION_DENIED,
        InvalidEventError: Status.INVALID_ARGUMENT,
        AgentSequenceError: Status.ABORTED,
        WrongShardError: Status.INVALID_ARGUMENT,
        StaleIncarnationError: Status.FAILED_PRECONDITION,
        UsageError: Status.INVALID_ARGUMENT,
    }
)


def status_of(exc: BaseException) -> Status:
    """The status for ``exc``: its class's row, else its nearest ancestor's; ``INTERNAL`` for
    anything that is not a KVCompass error (a bug, not a bad request)."""
    for cls in type(exc).__mro__:
        st = STATUS_OF.get(cls)
        if st is not None:
            return st
    return Status.INTERNAL


def grpc_error(exc: BaseException) -> GRPCError:
    """``exc`` as the GRPCError a handler raises: the mapped status and ``Class: message``."""
    msg = exc.message if isinstance(exc, KVCompassError) else str(exc)
    return GRPCError(status_of(exc), f"{type(exc).__name__}: {msg}")
