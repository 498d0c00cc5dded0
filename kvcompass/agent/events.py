"""vLLM / SGLang KV-event wire format: strict decoding and exact encoding, no I/O.

An engine publishes its prefix-cache changes on a ZMQ PUB socket as a three-frame message
``(topic, seq, payload)``: ``seq`` is an 8-byte big-endian counter that starts at 0 when the
engine starts (there is no epoch), and ``payload`` is one msgpack ``KVEventBatch``. A ROUTER
"replay" socket answers an 8-byte big-endian start seq with ``(seq, payload)`` frame pairs and a
final ``(-1 as signed 8 bytes, b"")``.

Both msgspec encodings the engines use are accepted, per batch and per event:

* positional arrays (``array_like=True``; older vLLM, SGLang): a batch is ``[ts, events]`` or
  ``[ts, events, data_parallel_rank]``; an event is ``[tag, field, field, ...]``, and arrays
  from older schemas that end before the optional fields (``lora_id``, ``medium``, ...) are
  read with those fields None;
* maps (newer vLLM): ``{"ts": .., "events": .., "data_parallel_rank": ..}`` and events
  ``{"type": tag, field: value, ...}`` (``type`` is msgspec's default tag field).

Fields this module does not know (a newer engine's additions) are ignored, as msgspec does.
Block hashes are ints (vLLM: unsigned 64-bit; SGLang: signed int64) or bytes. Ints are
normalised to unsigned 64-bit so both spellings of one hash compare equal; bytes stay bytes.

Everything else is refused with an :class:`~kvcompass.errors.InvalidEventError` whose message
names the frame, event index and field: a wrong frame count, a seq that is not 8 bytes, bytes
that are not one msgpack object, an unknown tag, a wrong field type, token ids outside u32, a
token count other than ``block_size * len(block_hashes)``, ``extra_keys`` not one entry per
block.

A hash may repeat within an event, and ``parent_block_hash`` may equal one of the event's own
hashes. SGLang's content-hash format hashes a page's tokens alone, so two identical
consecutive pages carry one hash (``[h, h]``, or a page ``h`` whose parent is also ``h``).
With vLLM's chained hashes that cannot happen, but it is not malformed either. The agent files
blocks by their place in the chain and tells such blocks apart.

The encoders write exactly what the engines publish (same field order, same omission of
defaulted fields) so that an emulated worker is indistinguishable from a real one on the wire.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, Union

import msgpack  # type: ignore[import-untyped]  # ships no type information

from kvcompass import _core
from kvcompass.errors import InvalidEventError
from kvcompass.records import fast_init

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt

__all__ = [
    "AllBlocksCleared",
    "BlockHash",
    "BlockRemoved",
    "BlockStored",
    "EngineBatch",
    "Event",
    "EventBatch",
    "REPLAY_END_SEQ",
    "SkippedEvent",
    "decode_message",
    "decode_payload",
    "decode_replay",
    "encode_batch",
    "encode_payload",
    "encode_replay",
    "encode_replay_end",
    "encode_replay_request",
]

BlockHash = Union[int, bytes]
"""An engine block hash: an unsigned 64-bit int (signed spellings are normalised) or bytes."""

REPLAY_END_SEQ = -1
"""The seq (signed) of the replay socket's end-of-stream frame."""

_U64 = 1 << 64
_I64_MIN = -(1 << 63)
_U32_MAX = 0xFFFFFFFF


@fast_init
@dataclass(frozen=True, slots=True)
class BlockStored:
    """Blocks entered the engine's prefix cache (on ``medium``).

    ``token_ids`` covers every block: ``len(token_ids) == block_size * len(block_hashes)``;
    ``parent_block_hash`` is the block before the first one (None at the start of a prompt).
    ``extra_keys[i]``, when not None, says block i's KV depends on more than its tokens
    (multimodal inputs, LoRA, cache salt). Field order is vLLM's.

    SGLang (0.5.18 on) sends a request's ``cache_salt`` in a metadata map instead
    (``BlockStoredWithMetadata``: the positional fields up to ``medium``, then the map; in map
    form a ``metadata`` key): it is read into ``cache_salt``, and for a prompt's first blocks
    (no parent) also into ``extra_keys[0]`` as ``(salt,)``, the shape vLLM gives it, so the
    agent keys the chain in the tenant's namespace exactly as for vLLM (a continuation event
    inherits its chain's namespace through its parent).

    With no ``token_ids`` and no ``parent_block_hash`` (and any block size, 0 included) it is a
    *copy*: the blocks named by ``block_hashes``, already known from an earlier store, are now
    also on ``medium``. vLLM's offloading connector reports its CPU copies so; the agent adds
    the medium to the blocks it holds and leaves out hashes it cannot place (counted in
    ``AgentStats.unplaced_copies``), since without tokens nothing new can be keyed.

    ``token_ids`` is a tuple as decoded from an engine, or a uint32 array where the emulated
    engine hands its own tokens to an agent in the same process (the simulator); likewise
    ``block_hashes`` may be the emulated engine's uint64 array (no Python int per block).
    """

    block_hashes: tuple[BlockHash, ...] | npt.NDArray[np.uint64]
    parent_block_hash: BlockHash | None
    token_ids: tuple[int, ...] | npt.NDArray[np.uint32]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: tuple[object, ...] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    cache_salt: str | None = None


@fast_init
@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """Blocks left the engine's prefix cache on ``medium`` (None: the GPU). ``block_hashes``
    may be the emulated engine's uint64 array, as in :class:`BlockStored`."""

    block_hashes: tuple[BlockHash, ...] | npt.NDArray[np.uint64]
    medium: str | None = None
    group_idx: int | None = None


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """The engine dropped its whole prefix cache."""


Event = Union[BlockStored, BlockRemoved, AllBlocksCleared]


@dataclass(frozen=True, slots=True)
class SkippedEvent:
    """An event of a payload that could not be understood: its index in the payload's event
    list and why (the rest of the payload is decoded; see :func:`decode_message`)."""

    index: int
    reason: str


@dataclass(frozen=True, slots=True)
class EventBatch:
    """One decoded payload (a ``KVEventBatch``)."""

    ts: float
    events: tuple[Event, ...]
    dp_rank: int | None = None
    skipped: tuple[SkippedEvent, ...] = ()


@fast_init
@dataclass(frozen=True, slots=True)
class EngineBatch:
    """One decoded message: the payload plus its seq, topic and a digest of the payload bytes
    (the agent tells a re-delivered message from a restarted engine's new one by it)."""

    seq: int
    ts: float
    events: tuple[Event, ...]
    dp_rank: int | None = None
    topic: bytes = b""
    digest: bytes = b""
    skipped: tuple[SkippedEvent, ...] = ()
    """Events of the payload that could not be understood (skipped; the others apply)."""
    cache_events: _core.CacheEvents | None = None
    """An in-process emulated cache's events kept as Rust values (the simulator's engine hands
    them over so, with no Python object per event or block), applied after ``events``."""
    salts: tuple[str, ...] = ()
    """The cache salts ``cache_events`` number 1, 2, ... (vLLM's ``cache_salt``, carried as a
    prompt's first block's extra key)."""


# Field layouts (after the tag), in vLLM's order. In map form msgspec always writes the first
# `*_ALWAYS_WRITTEN` (no default in vLLM's schema) and omits the rest when None; `*_NEEDED` are
# the fields every schema version has had.
_STORED_FIELDS: tuple[str, ...] = (
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
    "extra_keys",
    "group_idx",
    "kv_cache_spec_kind",
    "kv_cache_spec_sliding_window",
)
_STORED_ALWAYS_WRITTEN = 7
_STORED_NEEDED = 4  # older engines omit lora_id/medium/lora_name; these four they never omit
_REMOVED_FIELDS: tuple[str, ...] = ("block_hashes", "medium", "group_idx")
_REMOVED_ALWAYS_WRITTEN = 2
_REMOVED_NEEDED = 1
_TAGS = ("BlockStored", "BlockRemoved", "AllBlocksCleared")
# SGLang's BlockStoredWithMetadata puts its metadata map at this array index (the tag is 0).
_SGLANG_METADATA_AT = 7


# ---- decoding ---------------------------------------------------------------------------------


def decode_message(frames: Sequence[bytes | bytearray | memoryview]) -> EngineBatch:
    """Decode one PUB message ``(topic, seq, payload)``; InvalidEventError if anything is off."""
    if isinstance(frames, (bytes, bytearray, memoryview, str)) or len(frames) != 3:
        n = "a bytes object" if isinstance(frames, (bytes, bytearray, memoryview, str)) else f"{len(frames)} frames"
        raise InvalidEventError(f"a KV-event message has 3 frames (topic, seq, payload), got {n}")
    topic, seq_b, payload = (_frame(f, i) for i, f in enumerate(frames))
    seq = _seq(seq_b, "frame 1 (seq)")
    if seq < 0:
        raise InvalidEventError(f"frame 1 (seq) is {seq}: a published message has a non-negative seq", seq=seq)
    batch = _decode_payload(payload, f"seq {seq}: ", seq)
    return EngineBatch(seq, batch.ts, batch.events, batch.dp_rank, topic, _digest(payload), batch.skipped)


def decode_replay(frames: Sequence[bytes | bytearray | memoryview]) -> EngineBatch | None:
    """Decode one replay reply ``(seq, payload)``; None for the end-of-replay frame (seq -1)."""
    if isinstance(frames, (bytes, bytearray, memoryview, str)) or len(frames) != 2:
        n = "a bytes object" if isinstance(frames, (bytes, bytearray, memoryview, str)) else f"{len(frames)} frames"
        raise InvalidEventError(f"a replay reply has 2 frames (seq, payload), got {n}")
    seq_b, payload = (_frame(f, i) for i, f in enumerate(frames))
    seq = _seq(seq_b, "replay frame 0 (seq)")
    if seq == REPLAY_END_SEQ:
        return None
    if seq < 0:
        raise InvalidEventError(f"replay frame 0 (seq) is {seq}: only -1 (end of replay) may be negative", seq=seq)
    batch = _decode_payload(payload, f"replayed seq {seq}: ", seq)
    return EngineBatch(seq, batch.ts, batch.events, batch.dp_rank, b"", _digest(payload), batch.skipped)


def decode_payload(payload: bytes | bytearray | memoryview) -> EventBatch:
    """Decode one msgpack ``KVEventBatch`` (array or map form)."""
    return _decode_payload(_frame(payload, 0, what="payload"), "", None)


def _frame(f: object, i: int, what: str = "") -> bytes:
    if isinstance(f, bytes):
        return f
    if not isinstance(f, str):
        try:  # bytearray, memoryview, zmq.Frame: anything with the buffer protocol
            return bytes(memoryview(f))  # type: ignore[arg-type]
        except TypeError:
            pass
    raise InvalidEventError(f"{what or f'frame {i}'} must be bytes, got {type(f).__name__}")


def _seq(b: bytes, what: str) -> int:
    if len(b) != 8:
        raise InvalidEventError(f"{what} must be 8 bytes (big-endian), got {len(b)}")
    return int.from_bytes(b, "big", signed=True)


def _digest(payload: bytes) -> bytes:
    return hashlib.blake2b(payload, digest_size=16).digest()


def _decode_payload(payload: bytes, where: str, seq: int | None) -> EventBatch:
    try:
        obj = msgpack.unpackb(payload, raw=False, use_list=True, strict_map_key=True)
    except Exception as e:  # msgpack raises ValueError/ExtraData/FormatError/UnicodeDecodeError/...
        raise InvalidEventError(f"{where}payload is not one msgpack object: {type(e).__name__}: {e}", seq=seq) from None
    return _batch(obj, where, seq)


def _batch(obj: object, where: str, seq: int | None) -> EventBatch:
    dp: object = None
    if isinstance(obj, list):
        if len(obj) < 2:
            raise InvalidEventError(f"{where}batch array needs [ts, events(, data_parallel_rank)], got {len(obj)} elements", seq=seq)
        ts, events = obj[0], obj[1]
        if len(obj) > 2:
            dp = obj[2]
    elif isinstance(obj, dict):
        for k in ("ts", "events"):
            if k not in obj:
                raise InvalidEventError(f"{where}batch map has no {k!r} key", seq=seq)
        ts, events, dp = obj["ts"], obj["events"], obj.get("data_parallel_rank")
    else:
        raise InvalidEventError(f"{where}batch must be an array or a map, got {_kind(obj)}", seq=seq)
    if isinstance(ts, bool) or not isinstance(ts, (int, float)):
        raise InvalidEventError(f"{where}batch ts must be a number, got {_kind(ts)}", seq=seq)
    if not isinstance(events, list):
        raise InvalidEventError(f"{where}batch events must be an array, got {_kind(events)}", seq=seq)
    if dp is not None and (type(dp) is not int or dp < 0):
        raise InvalidEventError(f"{where}batch data_parallel_rank must be a non-negative int or nil, got {_kind(dp)}", seq=seq)
    # Event by event: one event that cannot be understood (a newer engine's form, a bad field)
    # must not cost the others of its scheduler step. It is skipped and reported; a payload that
    # is not a batch at all stays a refusal (the agent then asks for a replay).
    decoded: list[Event] = []
    skipped: list[SkippedEvent] = []
    for i, e in enumerate(events):
        try:
            decoded.append(_event(e, f"{where}events[{i}]", seq, i))
        except InvalidEventError as err:
            skipped.append(SkippedEvent(i, err.message))
    return EventBatch(float(ts), tuple(decoded), dp, tuple(skipped))


def _event(obj: object, where: str, seq: int | None, index: int) -> Event:
    fields: dict[str, object]
    if isinstance(obj, list):
        if not obj or not isinstance(obj[0], str):
            raise InvalidEventError(f"{where}: an array event starts with its tag string, got {_kind(obj[0]) if obj else 'an empty array'}", seq=seq, index=index)
        tag = obj[0]
        layout = _layout(tag, where, seq, index)
        if len(obj) - 1 < layout[1]:
            raise InvalidEventError(f"{where} ({tag}): needs at least {layout[1]} fields after the tag, got {len(obj) - 1}", seq=seq, index=index)
        if tag == "BlockStored" and len(obj) > _SGLANG_METADATA_AT and isinstance(obj[_SGLANG_METADATA_AT], dict):
            # SGLang's BlockStoredWithMetadata: its own fields end at medium, then the map sits
            # where vLLM's lora_name (a string or nil, never a map) would be.
            fields = dict(zip(layout[0][: _SGLANG_METADATA_AT - 1], obj[1:_SGLANG_METADATA_AT]))
            fields["metadata"] = obj[_SGLANG_METADATA_AT]
        else:
            fields = dict(zip(layout[0], obj[1:]))  # extra trailing fields (newer engines) are ignored
    elif isinstance(obj, dict):
        tag_v = obj.get("type")
        if not isinstance(tag_v, str):
            raise InvalidEventError(f"{where}: a map event carries its tag string under 'type', got {_kind(tag_v)}", seq=seq, index=index)
        tag = tag_v
        layout = _layout(tag, where, seq, index)
        for name in layout[0][: layout[1]]:
            if name not in obj:
                raise InvalidEventError(f"{where} ({tag}): missing field {name!r}", seq=seq, index=index)
        fields = {k: obj[k] for k in (*layout[0], "metadata", "cache_salt") if k in obj}
    else:
        raise InvalidEventError(f"{where}: an event is an array or a map, got {_kind(obj)}", seq=seq, index=index)
    w = f"{where} ({tag})"
    try:
        if tag == "BlockStored":
            return _stored(fields, w)
        if tag == "BlockRemoved":
            return _removed(fields, w)
        return AllBlocksCleared()
    except _FieldError as e:
        raise InvalidEventError(str(e), seq=seq, index=index) from None


def _layout(tag: str, where: str, seq: int | None, index: int) -> tuple[tuple[str, ...], int]:
    if tag == "BlockStored":
        return _STORED_FIELDS, _STORED_NEEDED
    if tag == "BlockRemoved":
        return _REMOVED_FIELDS, _REMOVED_NEEDED
    if tag == "AllBlocksCleared":
        return (), 0
    raise InvalidEventError(f"{where}: unknown event tag {tag!r} (expected one of {', '.join(_TAGS)})", seq=seq, index=index)


class _FieldError(Exception):
    pass


# The agent's block forest keeps a block's KV group and token count in 16 bits each (112 bytes
# a block: rust/agent_forest.rs); engines use a handful of groups and blocks of 16-1024 tokens.
MAX_GROUP = 0xFFFF
MAX_BLOCK_SIZE = 0xFFFF


def _stored(f: Mapping[str, object], w: str) -> BlockStored:
    hashes = _hashes(f["block_hashes"], f"{w}.block_hashes")
    parent_raw = f["parent_block_hash"]
    parent = None if parent_raw is None else _hash(parent_raw, f"{w}.parent_block_hash")
    block_size = f["block_size"]
    tokens = _tokens(f["token_ids"], f"{w}.token_ids")
    # vLLM's offloading connector (0.11 on) reports a copy to host memory with no tokens and no
    # parent, its block size 0 or the offloaded one: a copy of blocks named by hash (see
    # BlockStored), so only the hashes and the medium matter.
    copy = not tokens and parent is None and len(hashes) > 0
    if type(block_size) is not int or not (0 if copy else 1) <= block_size <= MAX_BLOCK_SIZE:
        raise _FieldError(f"{w}.block_size must be an int in 1..{MAX_BLOCK_SIZE}, got {_show(block_size)}")
    if not copy and len(tokens) != block_size * len(hashes):
        raise _FieldError(
            f"{w}.token_ids has {len(tokens)} tokens; {len(hashes)} blocks of {block_size} need {block_size * len(hashes)}"
        )
    salt = _salt_of(f, w)
    extra = f.get("extra_keys")
    extra_t: tuple[object, ...] | None = None
    if extra is not None:
        if not isinstance(extra, list):
            raise _FieldError(f"{w}.extra_keys must be an array or nil, got {_kind(extra)}")
        if len(extra) != len(hashes):
            raise _FieldError(f"{w}.extra_keys has {len(extra)} entries for {len(hashes)} blocks (one per block)")
        for i, e in enumerate(extra):
            if e is not None and not isinstance(e, list):
                raise _FieldError(f"{w}.extra_keys[{i}] must be an array or nil, got {_kind(e)}")
        extra_t = tuple(_freeze(e, f"{w}.extra_keys[{i}]") for i, e in enumerate(extra))
    if salt is not None and parent is None and hashes and (extra_t is None or extra_t[0] is None):
        # A prompt's first blocks: the salt goes where vLLM puts it (see BlockStored).
        extra_t = ((salt,), *((None,) * (len(hashes) - 1) if extra_t is None else extra_t[1:]))
    return BlockStored(
        block_hashes=hashes,
        parent_block_hash=parent,
        token_ids=tokens,
        block_size=block_size,
        lora_id=_opt_int(f.get("lora_id"), f"{w}.lora_id"),
        medium=_opt_str(f.get("medium"), f"{w}.medium"),
        lora_name=_opt_str(f.get("lora_name"), f"{w}.lora_name"),
        extra_keys=extra_t,
        group_idx=_group(f.get("group_idx"), f"{w}.group_idx"),
        kv_cache_spec_kind=_opt_str(f.get("kv_cache_spec_kind"), f"{w}.kv_cache_spec_kind"),
        kv_cache_spec_sliding_window=_opt_int(f.get("kv_cache_spec_sliding_window"), f"{w}.kv_cache_spec_sliding_window", nonneg=True),
        cache_salt=salt,
    )


def _salt_of(f: Mapping[str, object], w: str) -> str | None:
    """SGLang's cache salt: ``metadata.cache_salt`` (unknown metadata keys are ignored, as
    SGLang's own decoders do), or a top-level ``cache_salt`` in map form."""
    salt: object = f.get("cache_salt")
    meta = f.get("metadata")
    if meta is not None:
        if not isinstance(meta, dict):
            raise _FieldError(f"{w}.metadata must be a map or nil, got {_kind(meta)}")
        if salt is None:
            salt = meta.get("cache_salt")
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise _FieldError(f"{w}.cache_salt must be a non-empty string or nil, got {_show(salt)}")
    return salt


def _removed(f: Mapping[str, object], w: str) -> BlockRemoved:
    return BlockRemoved(
        block_hashes=_hashes(f["block_hashes"], f"{w}.block_hashes"),
        medium=_opt_str(f.get("medium"), f"{w}.medium"),
        group_idx=_group(f.get("group_idx"), f"{w}.group_idx"),
    )


def _hashes(v: object, w: str) -> tuple[BlockHash, ...]:
    if not isinstance(v, list):
        raise _FieldError(f"{w} must be an array, got {_kind(v)}")
    return tuple(_hash(h, f"{w}[{i}]") for i, h in enumerate(v))  # repeats allowed (content hashes)


def _hash(v: object, w: str) -> BlockHash:
    if type(v) is int:
        if not _I64_MIN <= v < _U64:
            raise _FieldError(f"{w} must fit 64 bits (signed or unsigned), got {v}")
        return v % _U64
    if isinstance(v, bytes):
        if not v:
            raise _FieldError(f"{w} is empty bytes")
        return v
    raise _FieldError(f"{w} must be an int or bytes, got {_kind(v)}")


def _tokens(v: object, w: str) -> tuple[int, ...]:
    if not isinstance(v, list):
        raise _FieldError(f"{w} must be an array of ints, got {_kind(v)}")
    if _core.first_bad_token(v) < 0:  # the usual case, checked in one Rust pass
        return tuple(v)
    # Something is wrong: name it as the checks below always have (types before ranges).
    if len(set(map(type, v)) - {int}):  # every element exactly an int (bool too is refused)
        i = next(i for i, t in enumerate(v) if type(t) is not int)
        raise _FieldError(f"{w}[{i}] must be an int token id, got {_kind(v[i])}")
    if v and (min(v) < 0 or max(v) > _U32_MAX):
        i = next(i for i, t in enumerate(v) if not 0 <= t <= _U32_MAX)
        raise _FieldError(f"{w}[{i}] is {v[i]}; token ids are 0..2**32-1")
    return tuple(v)


def _opt_int(v: object, w: str, nonneg: bool = False) -> int | None:
    if v is None:
        return None
    if type(v) is not int or (nonneg and v < 0):
        raise _FieldError(f"{w} must be {'a non-negative ' if nonneg else 'an '}int or nil, got {_show(v)}")
    return v


def _group(v: object, w: str) -> int | None:
    g = _opt_int(v, w, nonneg=True)
    if g is not None and g > MAX_GROUP:
        raise _FieldError(f"{w} must be at most {MAX_GROUP}, got {g}")
    return g


def _opt_str(v: object, w: str) -> str | None:
    if v is None or isinstance(v, str):
        return v
    raise _FieldError(f"{w} must be a string or nil, got {_kind(v)}")


_EXTRA_DEPTH = 8
"""How deep a block's extra keys may nest (vLLM's are a flat tuple of LoRA name, multi-modal
hashes and cache salt, with the hashes as pairs): deeper is malformed, and without a bound a
payload nested a thousand arrays deep (msgpack decodes it) raised RecursionError, which ended
the agent runner instead of skipping the event."""


def _freeze(v: object, where: str, depth: int = 0) -> object:
    """``v`` with its arrays as tuples (hashable, to key a block's extra keys)."""
    if not isinstance(v, list):
        return v
    if depth >= _EXTRA_DEPTH:
        raise _FieldError(f"{where} nests arrays deeper than {_EXTRA_DEPTH}")
    return tuple(_freeze(x, where, depth + 1) for x in v)


def _kind(v: object) -> str:
    return "nil" if v is None else type(v).__name__


def _show(v: object) -> str:
    return repr(v) if type(v) is int else _kind(v)


# ---- encoding ---------------------------------------------------------------------------------

Form = Literal["array", "map"]
HashStyle = Literal["int", "signed", "bytes"]


def encode_payload(
    events: Sequence[Event],
    ts: float = 0.0,
    dp_rank: int | None = None,
    *,
    form: Form = "array",
    hash_style: HashStyle = "int",
    omit_defaults: bool = True,
) -> bytes:
    """One msgpack ``KVEventBatch``, byte-for-byte as msgspec writes vLLM's structs.

    ``form``: ``"array"`` (``array_like=True``) or ``"map"``. ``hash_style`` spells int hashes
    as unsigned (vLLM), ``"signed"`` int64 (SGLang) or 8 big-endian ``"bytes"``; bytes hashes
    are written as they are. ``omit_defaults`` (map form) leaves out the fields that vLLM's
    schema gives a default when they hold it (None), as msgspec's ``omit_defaults`` does; the
    array form always carries every field, as msgspec writes it.
    """
    if form not in ("array", "map"):
        raise ValueError(f"form must be 'array' or 'map', got {form!r}")
    if hash_style not in ("int", "signed", "bytes"):
        raise ValueError(f"hash_style must be 'int', 'signed' or 'bytes', got {hash_style!r}")
    evs = [_enc_event(e, form, hash_style, omit_defaults) for e in events]
    obj: object
    if form == "map":
        m: dict[str, object] = {"ts": float(ts), "events": evs}
        if dp_rank is not None or not omit_defaults:
            m["data_parallel_rank"] = dp_rank
        obj = m
    else:
        obj = [float(ts), evs, dp_rank]
    out: bytes = msgpack.packb(obj, use_bin_type=True)
    return out


def encode_batch(
    events: Sequence[Event],
    seq: int,
    ts: float = 0.0,
    dp_rank: int | None = None,
    *,
    topic: bytes = b"",
    form: Form = "array",
    hash_style: HashStyle = "int",
    omit_defaults: bool = True,
) -> list[bytes]:
    """The three frames ``[topic, seq (8 bytes big-endian), payload]`` of one PUB message."""
    if not 0 <= seq < 1 << 63:
        raise ValueError(f"seq must be in 0..2**63-1, got {seq}")
    payload = encode_payload(events, ts, dp_rank, form=form, hash_style=hash_style, omit_defaults=omit_defaults)
    return [bytes(topic), seq.to_bytes(8, "big"), payload]


def encode_replay(seq: int, payload: bytes) -> list[bytes]:
    """One replay reply ``[seq, payload]`` (what a replay client receives per stored batch)."""
    if not 0 <= seq < 1 << 63:
        raise ValueError(f"seq must be in 0..2**63-1, got {seq}")
    return [seq.to_bytes(8, "big"), payload]


def encode_replay_end() -> list[bytes]:
    """The replay socket's end-of-stream reply ``[-1 as signed 8 bytes, b""]``."""
    return [REPLAY_END_SEQ.to_bytes(8, "big", signed=True), b""]


def encode_replay_request(start_seq: int) -> bytes:
    """The request a replay client sends: the first wanted seq, 8 bytes big-endian."""
    if not 0 <= start_seq < 1 << 63:
        raise ValueError(f"start_seq must be in 0..2**63-1, got {start_seq}")
    return start_seq.to_bytes(8, "big")


def _enc_hash(h: BlockHash, style: HashStyle) -> object:
    if isinstance(h, bytes):
        return h
    if not _I64_MIN <= h < _U64:
        raise ValueError(f"block hash {h} does not fit 64 bits")
    u = h % _U64
    if style == "signed":
        return u - _U64 if u >= 1 << 63 else u
    if style == "bytes":
        return struct.pack(">Q", u)
    return u


def _enc_event(e: Event, form: Form, style: HashStyle, omit: bool) -> object:
    if isinstance(e, BlockStored):
        names, always = _STORED_FIELDS, _STORED_ALWAYS_WRITTEN
        values: list[object] = [
            [_enc_hash(h, style) for h in e.block_hashes],
            None if e.parent_block_hash is None else _enc_hash(e.parent_block_hash, style),
            list(e.token_ids),
            e.block_size,
            e.lora_id,
            e.medium,
            e.lora_name,
            None if e.extra_keys is None else list(e.extra_keys),
            e.group_idx,
            e.kv_cache_spec_kind,
            e.kv_cache_spec_sliding_window,
        ]
        tag = "BlockStored"
    elif isinstance(e, BlockRemoved):
        names, always = _REMOVED_FIELDS, _REMOVED_ALWAYS_WRITTEN
        values = [[_enc_hash(h, style) for h in e.block_hashes], e.medium, e.group_idx]
        tag = "BlockRemoved"
    elif isinstance(e, AllBlocksCleared):
        return {"type": "AllBlocksCleared"} if form == "map" else ["AllBlocksCleared"]
    else:
        raise TypeError(f"not a KV event: {type(e).__name__}")
    if form == "map":
        out: dict[str, object] = {"type": tag}
        for i, (n, v) in enumerate(zip(names, values)):
            if i < always or v is not None or not omit:
                out[n] = v
        return out
    return [tag, *values]
