"""The one place where KVCompass errors become gRPC and HTTP statuses, and statuses become errors
again on the client side.

Every class in :mod:`kvcompass.errors` has its own row (a test checks that none is missing), so
a client can branch on the status code alone: ``ABORTED`` always means "a sequence check failed,
resend from the expected position", ``FAILED_PRECONDITION`` "resending will not help until
something else changes" (a newer agent incarnation, a writer epoch), ``PERMISSION_DENIED`` "this
identity may not do that". Classes are looked up along the MRO, so a subclass added later
inherits its parent's row until it gets its own.

Handlers never build a ``GRPCError`` themselves (a test reads every module for one): they raise
a class from :mod:`kvcompass.errors` through :func:`grpc_error`, whose message starts with the
class's name, so :func:`error_from` on the client side gives back the same class. The HTTP
surfaces (the door and the emulated worker) answer the same classes through :data:`HTTP_OF`.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Final, Mapping

from grpclib.const import Status
from grpclib.exceptions import GRPCError

from kvcompass.errors import (
    AgentSequenceError,
    CapacityError,
    DrainingError,
    IngestRejectedError,
    MessageTooLargeError,
    NotAllowedError,
    RateLimitedError,
    SubscriberLaggingError,
    UnauthenticatedError,
    UnknownRouteError,
    UnsupportedError,
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

__all__ = ["HTTP_OF", "STATUS_OF", "error_class", "error_from", "grpc_error", "http_of", "status_of"]

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
        UnauthenticatedError: Status.UNAUTHENTICATED,
        NotAllowedError: Status.PERMISSION_DENIED,
        RateLimitedError: Status.RESOURCE_EXHAUSTED,
        DrainingError: Status.UNAVAILABLE,
        SubscriberLaggingError: Status.RESOURCE_EXHAUSTED,
        UnknownRouteError: Status.NOT_FOUND,
        MessageTooLargeError: Status.RESOURCE_EXHAUSTED,
        UnsupportedError: Status.UNIMPLEMENTED,
        IngestRejectedError: Status.FAILED_PRECONDITION,
    }
)

# The class a status stands for when a peer sent no class name with it (another implementation,
# or a proxy's own refusal).
_CLASS_OF_STATUS: Final[Mapping[Status, type[KVCompassError]]] = MappingProxyType(
    {
        Status.INVALID_ARGUMENT: InvalidArgumentError,
        Status.UNAUTHENTICATED: UnauthenticatedError,
        Status.PERMISSION_DENIED: NotAllowedError,
        Status.RESOURCE_EXHAUSTED: CapacityError,
        Status.UNAVAILABLE: DrainingError,
        Status.NOT_FOUND: KeyNotFoundError,
        Status.UNIMPLEMENTED: UnsupportedError,
        Status.ABORTED: PatchError,
        Status.ALREADY_EXISTS: StalePatchError,
        Status.FAILED_PRECONDITION: UninitialisedViewError,
    }
)

_BY_NAME: Final[Mapping[str, type[KVCompassError]]] = MappingProxyType({c.__name__: c for c in STATUS_OF})

# HTTP: (status, OpenAI error code) per class, for the door and the emulated worker alike.
HTTP_OF: Final[Mapping[type[KVCompassError], tuple[int, str | None]]] = MappingProxyType(
    {
        KVCompassError: (500, None),
        InvalidArgumentError: (400, "invalid_value"),
        InvalidEventError: (400, "invalid_value"),
        TopologyError: (400, "invalid_value"),
        InvalidKeyError: (400, "invalid_value"),
        InvalidValueError: (400, "invalid_value"),
        InvalidTierError: (400, "invalid_value"),
        InvalidFieldError: (400, "invalid_value"),
        UnauthenticatedError: (401, "invalid_api_key"),
        NotAllowedError: (403, "not_allowed"),
        ForbiddenWriteError: (403, "not_allowed"),
        KeyNotFoundError: (404, "not_found"),
        UnknownWorkerError: (404, "not_found"),
        UnknownRouteError: (404, "not_found"),
        MessageTooLargeError: (413, "request_too_large"),
        RateLimitedError: (429, "rate_limit_exceeded"),
        CapacityError: (503, "capacity"),
        DrainingError: (503, "draining"),
        UnsupportedError: (501, "unsupported"),
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


def http_of(exc: BaseException) -> tuple[int, str | None]:
    """The HTTP status and OpenAI error code for ``exc`` (its class's row or its nearest
    ancestor's); ``(500, None)`` for anything that is not a KVCompass error."""
    for cls in type(exc).__mro__:
        row = HTTP_OF.get(cls)
        if row is not None:
            return row
    return 500, None


def error_class(name: str | None, status: Status | None = None) -> type[KVCompassError]:
    """The class a peer named (an ack's ``reason``, a status message's prefix), else the one its
    status stands for, else :class:`KVCompassError`."""
    cls = _BY_NAME.get(name or "")
    if cls is None and status is not None:
        cls = _CLASS_OF_STATUS.get(status)
    return cls or KVCompassError


def error_from(status: Status, message: str | None) -> KVCompassError:
    """A status received by a client, as the KVCompass error the server raised: the class named at
    the start of ``message`` (``Class: text``, as :func:`grpc_error` writes it), else the class
    the status stands for."""
    text = message or ""
    name, sep, rest = text.partition(": ")
    if sep and name in _BY_NAME:
        return _BY_NAME[name](rest)
    return error_class(None, status)(text or status.name)

