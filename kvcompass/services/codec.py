"""The request codec of every KVCompass gRPC server: protobuf decoding that refuses malformed
bytes with ``INVALID_ARGUMENT`` instead of letting them through or crashing the handler.

grpclib's ``ProtoCodec`` hands the bytes to betterproto, which is lenient in two ways that
matter for a service facing untrusted peers:

* garbage raises whatever the parser trips over first (``EOFError``, ``KeyError``,
  ``UnicodeDecodeError``, ``struct.error``...), which grpclib answers as ``UNKNOWN`` /
  "Internal Server Error" and logs as an application error;
* a field sent with the wrong wire type, a truncated fixed-width field or a group wire type is
  *accepted* and leaves a value of the wrong Python type (an ``int`` in a ``bytes`` field,
  ``None`` in a ``uint32``), which then fails somewhere inside the handler.

:class:`StrictProtoCodec` first walks the bytes against the message's own schema (wire types,
lengths, UTF-8 strings, 32-bit ranges, nested messages and map entries; unknown field numbers
are skipped as protobuf requires), then lets betterproto build the message. Anything refused
becomes INVALID_ARGUMENT (``InvalidArgumentError: malformed <Message>: ...``) raised from the handler's
``recv_message``, so the client gets a precise status and the server's error counters see it.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping
from typing import Any

import betterproto
from grpclib.encoding.proto import ProtoCodec
from grpclib.exceptions import GRPCError

from kvcompass.errors import InvalidArgumentError, MessageTooLargeError, UnsupportedError
from kvcompass.services.status import grpc_error

__all__ = ["DEFAULT_MAX_MESSAGE_BYTES", "MalformedMessage", "StrictProtoCodec", "check_wire", "install_receive_limit"]

_VARINT, _FIXED64, _LEN, _FIXED32 = 0, 1, 2, 5
_MAX_DEPTH = 32
_U32 = (1 << 32) - 1

_FIXED32_TYPES = frozenset({betterproto.TYPE_FLOAT, betterproto.TYPE_FIXED32, betterproto.TYPE_SFIXED32})
_FIXED64_TYPES = frozenset({betterproto.TYPE_DOUBLE, betterproto.TYPE_FIXED64, betterproto.TYPE_SFIXED64})
_LEN_TYPES = frozenset({betterproto.TYPE_STRING, betterproto.TYPE_BYTES, betterproto.TYPE_MESSAGE, betterproto.TYPE_MAP})
_U32_TYPES = frozenset({betterproto.TYPE_UINT32})
_I32_TYPES = frozenset({betterproto.TYPE_INT32, betterproto.TYPE_ENUM})


class MalformedMessage(ValueError):
    """Bytes that are not a valid encoding of the expected message."""


def _varint(data: bytes, i: int) -> tuple[int, int]:
    value = shift = 0
    for _ in range(10):
        if i >= len(data):
            raise MalformedMessage("truncated varint")
        b = data[i]
        i += 1
        value |= (b & 0x7F) << shift
        if not b & 0x80:
            if value >> 64:
                raise MalformedMessage("varint wider than 64 bits")
            return value, i
        shift += 7
    raise MalformedMessage("varint longer than 10 bytes")


def _wire_type_of(proto_type: str) -> int:
    if proto_type in _LEN_TYPES:
        return _LEN
    if proto_type in _FIXED32_TYPES:
        return _FIXED32
    if proto_type in _FIXED64_TYPES:
        return _FIXED64
    return _VARINT


def check_wire(data: bytes, cls: type[betterproto.Message], depth: int = 0) -> None:
    """Raise :class:`MalformedMessage` unless ``data`` is a well-formed encoding of ``cls``."""
    if depth > _MAX_DEPTH:
        raise MalformedMessage(f"messages nested deeper than {_MAX_DEPTH}")
    meta: Any = cls._betterproto  # type: ignore[arg-type]  # betterproto types its classproperty for subclasses only
    i, n = 0, len(data)
    while i < n:
        key, i = _varint(data, i)
        number, wt = key >> 3, key & 7
        if number == 0 or number > 0x1FFFFFFF:
            raise MalformedMessage(f"field number {number} is outside 1..2**29-1")
        start = i
        value = 0
        if wt == _VARINT:
            value, i = _varint(data, i)
        elif wt == _FIXED64:
            i += 8
        elif wt == _FIXED32:
            i += 4
        elif wt == _LEN:
            length, i = _varint(data, i)
            start = i
            i += length
        else:
            raise MalformedMessage(f"field {number} has wire type {wt} (groups and types 6, 7 are not accepted)")
        if i > n:
            raise MalformedMessage(f"field {number} runs {i - n} bytes past the end of the message")
        name = meta.field_name_by_number.get(number)
        if name is None:
            continue  # an unknown field: skipped, as protobuf requires of a reader
        fm = meta.meta_by_field_name[name]
        want = _wire_type_of(fm.proto_type)
        packed = wt == _LEN and fm.proto_type in betterproto.PACKED_TYPES and _is_repeated(cls, name)
        if wt != want and not packed:
            raise MalformedMessage(f"field {name!r} ({fm.proto_type}) arrived with wire type {wt}, expected {want}")
        if packed:
            _check_packed(data[start:i], fm.proto_type, name)
        elif wt == _VARINT:
            _check_range(value, fm.proto_type, name)
        elif fm.proto_type == betterproto.TYPE_STRING:
            try:
                data[start:i].decode("utf-8")
            except UnicodeDecodeError as e:
                raise MalformedMessage(f"field {name!r} is not UTF-8 ({e.reason} at byte {e.start})") from None
        elif fm.proto_type in (betterproto.TYPE_MESSAGE, betterproto.TYPE_MAP):
            sub = meta.cls_by_field[name]
            if isinstance(sub, type) and issubclass(sub, betterproto.Message):
                check_wire(data[start:i], sub, depth + 1)


def _is_repeated(cls: type[betterproto.Message], name: str) -> bool:
    hint = cls._type_hint(name)
    return getattr(hint, "__origin__", None) in (list, tuple) or str(hint).startswith(("List[", "list["))


def _check_packed(body: bytes, proto_type: str, name: str) -> None:
    wt = _wire_type_of(proto_type)
    if wt == _FIXED32 or wt == _FIXED64:
        if len(body) % (4 if wt == _FIXED32 else 8):
            raise MalformedMessage(f"packed field {name!r} is not a whole number of elements")
        return
    i = 0
    while i < len(body):
        v, i = _varint(body, i)
        _check_range(v, proto_type, name)


def _check_range(value: int, proto_type: str, name: str) -> None:
    if proto_type in _U32_TYPES and value > _U32:
        raise MalformedMessage(f"field {name!r} ({proto_type}) holds {value}, beyond 32 bits")
    if proto_type in _I32_TYPES and _U32 < value < (1 << 64) - (1 << 31):
        raise MalformedMessage(f"field {name!r} ({proto_type}) holds {value}, beyond 32 bits")


DEFAULT_MAX_MESSAGE_BYTES = 4 << 20
"""A received message of a type with no limit of its own: gRPC's usual default (4 MiB)."""


class StrictProtoCodec(ProtoCodec):
    """``ProtoCodec`` whose ``decode`` refuses malformed bytes with ``INVALID_ARGUMENT``
    (see the module doc), and which knows the largest message of each type its server accepts
    (``limits``; other types :data:`DEFAULT_MAX_MESSAGE_BYTES`). Encoding is unchanged."""

    def __init__(self, limits: Mapping[type, int] | None = None, default_limit: int = DEFAULT_MAX_MESSAGE_BYTES) -> None:
        super().__init__()
        self._limits = dict(limits or {})
        self._default = int(default_limit)

    def max_message_bytes(self, message_type: Any) -> int:
        """The largest encoded ``message_type`` this server reads (checked before the message
        is read: see :func:`install_receive_limit`)."""
        return self._limits.get(message_type, self._default)

    def decode(self, data: bytes, message_type: Any) -> Any:
        name = getattr(message_type, "__name__", "message")
        try:
            if isinstance(message_type, type) and issubclass(message_type, betterproto.Message):
                check_wire(bytes(data), message_type)
            return super().decode(data, message_type)
        except GRPCError:
            raise
        except Exception as e:  # noqa: BLE001 - any parser failure is the peer's malformed bytes
            raise grpc_error(InvalidArgumentError(f"malformed {name}: {e}")) from None


async def _capped_recv_message(stream: Any, codec: Any, message_type: Any) -> Any:
    """grpclib's ``recv_message`` with a size check between the 5-byte gRPC message prefix and
    the payload: a message longer than the codec's limit for its type is refused with
    ``RESOURCE_EXHAUSTED`` before its bytes are read (HTTP/2 flow control then holds the sender
    at the window), so a peer cannot make the server buffer and parse a message of any size."""
    limit = getattr(codec, "max_message_bytes", None)
    if limit is None:
        return await _grpclib_recv_message(stream, codec, message_type)
    # grpclib asserts that a stream that ends early delivered what was asked: a short read is
    # the peer's truncated message, not a server fault (found in review: it answered UNKNOWN).
    try:
        meta = await stream.recv_data(5)
    except AssertionError:
        raise grpc_error(InvalidArgumentError("message truncated in its 5-byte prefix")) from None
    if not meta:
        return None
    if len(meta) != 5:
        raise grpc_error(InvalidArgumentError(f"message truncated: {len(meta)} of its 5-byte prefix"))
    compressed, n = struct.unpack(">?I", meta)
    if compressed:
        raise grpc_error(UnsupportedError("compressed messages are not supported"))
    cap = limit(message_type)
    if n > cap:
        name = getattr(message_type, "__name__", "message")
        raise grpc_error(MessageTooLargeError(f"{name} of {n} bytes exceeds this server's limit of {cap} bytes", limit=cap))
    try:
        data = await stream.recv_data(n)
    except AssertionError:
        raise grpc_error(InvalidArgumentError(f"message truncated: fewer than its {n} bytes")) from None
    if len(data) != n:
        raise grpc_error(InvalidArgumentError(f"message truncated: {len(data)} of {n} bytes"))
    return codec.decode(data, message_type)


REQUEST_TIMEOUT_S = 10.0
"""How long a call with one request message waits for it after the call's headers (the
servers' :class:`~kvcompass.services.grpc_lifecycle.DrainingServer` bounds every such call)."""


async def recv_request(stream: Any, message_type: Any) -> Any:
    """A unary call's one request message; INVALID_ARGUMENT if the call ended without it (a
    handler used to assert it and answer UNKNOWN, found in review)."""
    request = await stream.recv_message()
    if request is None:
        raise grpc_error(InvalidArgumentError(f"the call ended without its {getattr(message_type, '__name__', 'request')} message"))
    return request


_grpclib_recv_message: Any = None


def install_receive_limit() -> None:
    """Make grpclib's server streams check the message size before reading it.

    Why a patch: grpclib 0.4 has no server option for a receive limit (its issue 195), and its
    server ``Stream.recv_message`` reads the whole announced payload into memory and parses it
    on the event loop (a 20 MB queue vector stalled a door for a minute). The patched function
    is used only by server streams whose codec has ``max_message_bytes`` (ours); clients and
    other codecs keep grpclib's own. Idempotent."""
    global _grpclib_recv_message
    import grpclib.server

    if _grpclib_recv_message is None:
        _grpclib_recv_message = getattr(grpclib.server, "recv_message")
        setattr(grpclib.server, "recv_message", _capped_recv_message)
