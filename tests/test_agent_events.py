"""The engines' KV-event wire format: decoding, exact encoding, and every refusal.

The byte fixtures in ``fixtures/engine_messages.json`` were written by msgspec with vLLM's and
SGLang's own struct definitions (``fixtures/make_engine_fixtures.py``), so they check the
decoder against the engines' encoder rather than against our own; ``encode_payload`` must
reproduce msgspec's bytes exactly.
"""

from __future__ import annotations

import array
import functools
import json
from pathlib import Path
from typing import Any

import msgpack
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvcompass.agent import events as ev
from kvcompass.agent.events import AllBlocksCleared, BlockRemoved, BlockStored, Event
from kvcompass.errors import InvalidEventError

FIXTURES = json.loads((Path(__file__).parent / "fixtures" / "engine_messages.json").read_text())
U64 = 1 << 64


def unplain(v: Any) -> Any:
    """A fixture value back to Python: {"hex": ..} -> bytes, arrays -> tuples."""
    if isinstance(v, dict):
        return bytes.fromhex(v["hex"])
    if isinstance(v, list):
        return tuple(unplain(x) for x in v)
    return v


def norm_hash(h: Any) -> Any:
    return h % U64 if isinstance(h, int) else h


def expected_event(d: dict[str, Any]) -> Event:
    """What the decoder must return for a described event (hashes normalised to unsigned)."""
    tag = d["tag"]
    if tag == "AllBlocksCleared":
        return AllBlocksCleared()
    hashes = tuple(norm_hash(h) for h in unplain(d["block_hashes"]))
    if tag == "BlockRemoved":
        return BlockRemoved(hashes, d.get("medium"), d.get("group_idx"))
    parent = d["parent_block_hash"]
    return BlockStored(
        hashes,
        None if parent is None else norm_hash(unplain(parent)),
        tuple(d["token_ids"]),
        d["block_size"],
        d.get("lora_id"),
        d.get("medium"),
        d.get("lora_name"),
        None if d.get("extra_keys") is None else unplain(d["extra_keys"]),
        d.get("group_idx"),
        d.get("kv_cache_spec_kind"),
        d.get("kv_cache_spec_sliding_window"),
    )


def frames_of(m: dict[str, Any]) -> list[bytes]:
    return [bytes.fromhex(f) for f in m["frames"]]


def pub(payload: bytes, seq: int = 0) -> list[bytes]:
    return [b"", seq.to_bytes(8, "big"), payload]


def pack(obj: object) -> bytes:
    out: bytes = msgpack.packb(obj, use_bin_type=True)
    return out


STORED = ["BlockStored", [1, 2], None, [10, 11, 12, 13], 2, None, "GPU", None]


# ---- the engines' own bytes ---------------------------------------------------------------

STREAM_MESSAGES = [(name, i) for name, msgs in FIXTURES["streams"].items() for i in range(len(msgs))]


@pytest.mark.parametrize(("stream", "i"), STREAM_MESSAGES, ids=[f"{s}-{i}" for s, i in STREAM_MESSAGES])
def test_engine_fixture_decodes_to_what_was_encoded(stream: str, i: int) -> None:
    m = FIXTURES["streams"][stream][i]
    frames = frames_of(m)
    if len(frames) == 3:
        b = ev.decode_message(frames)
        assert b.topic == b"kv"
    else:
        b = ev.decode_replay(frames)  # type: ignore[assignment]
        if m["events"] is None:
            assert b is None
            return
        assert b is not None
    assert b.seq == int.from_bytes(frames[-2], "big")
    assert b.events == tuple(expected_event(d) for d in m["events"])
    assert len(b.digest) == 16
    payload = ev.decode_payload(frames[-1])
    assert (payload.ts, payload.events, payload.dp_rank) == (b.ts, b.events, b.dp_rank)


def test_fixture_details_the_decoder_must_get_right() -> None:
    s = FIXTURES["streams"]
    vmap = ev.decode_message(frames_of(s["vllm_map"][0]))
    assert vmap.dp_rank == 0 and vmap.ts == 1.0
    assert vmap.events[0] == BlockStored((U64 - 1, U64 - 2), None, tuple(range(1000, 1008)), 4, None, "GPU", None)
    sg = ev.decode_message(frames_of(s["sglang"][0]))
    assert sg.dp_rank is None  # [ts, events]: SGLang's two-element batch
    first, second, short = sg.events
    assert isinstance(first, BlockStored) and isinstance(second, BlockStored) and isinstance(short, BlockStored)
    assert first.block_hashes == (U64 - 1,) and second.block_hashes == (1 << 63,)  # signed -1 and -2**63, normalised
    assert second.parent_block_hash == U64 - 1
    assert (short.block_size, short.medium) == (3, None)  # a short last page, and no medium field at all
    removed = ev.decode_message(frames_of(s["sglang"][1])).events[0]
    assert removed == BlockRemoved((42,), None)
    vb = ev.decode_message(frames_of(s["vllm_bytes"][0]))
    lora = vb.events[1]
    assert isinstance(lora, BlockStored)
    assert lora.block_hashes == (b"\x33" * 32,) and lora.parent_block_hash == b"\x22" * 32
    assert (lora.lora_id, lora.lora_name, lora.extra_keys, lora.group_idx, lora.kv_cache_spec_kind) == (7, "adapter", (("lora", "adapter"),), 0, "full_attention")


@pytest.mark.parametrize("case", sorted(FIXTURES["encoder"]))
def test_encoder_writes_msgspec_bytes(case: str) -> None:
    ref = FIXTURES["encoder"][case]
    events = [expected_event(d) for d in ref["events"]]
    payload = ev.encode_payload(events, ref["ts"], ref["dp_rank"], form=ref["form"])
    assert payload.hex() == ref["payload"]
    back = ev.decode_payload(payload)
    assert (back.ts, back.events, back.dp_rank) == (ref["ts"], tuple(events), ref["dp_rank"])


# ---- layouts other than the current schema -----------------------------------------------


def test_older_and_shorter_layouts_read_missing_fields_as_none() -> None:
    old_vllm = pack([0.5, [["BlockStored", [7], None, [1, 2], 2, None], ["BlockRemoved", [7]], ["AllBlocksCleared"]]])
    b = ev.decode_payload(old_vllm)
    assert b.dp_rank is None
    assert b.events == (BlockStored((7,), None, (1, 2), 2), BlockRemoved((7,)), AllBlocksCleared())
    minimal = pack([1, [["BlockStored", [7], 3, [1], 1]]])  # int ts, no lora_id at all
    assert ev.decode_payload(minimal).events == (BlockStored((7,), 3, (1,), 1),)
    assert ev.decode_payload(minimal).ts == 1.0


def test_unknown_trailing_fields_and_map_keys_are_ignored() -> None:
    arr = pack([0.0, [[*STORED, None, None, None, None, "future", 99], ["BlockRemoved", [1], "GPU", None, "future"]], 0, "more"])
    b = ev.decode_payload(arr)
    assert b.events == (BlockStored((1, 2), None, (10, 11, 12, 13), 2, medium="GPU"), BlockRemoved((1,), "GPU"))
    m = pack(
        {
            "ts": 0.0,
            "events": [
                {"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None, "token_ids": [5], "block_size": 1, "new_field": [1, 2]},
                {"type": "AllBlocksCleared", "reason": "reset"},
            ],
            "other": 1,
        }
    )
    assert ev.decode_payload(m).events == (BlockStored((1,), None, (5,), 1), AllBlocksCleared())


def test_array_and_map_events_mix_in_one_batch() -> None:
    b = ev.decode_payload(pack([0.0, [STORED, {"type": "BlockRemoved", "block_hashes": [2], "medium": "CPU"}]]))
    assert b.events[1] == BlockRemoved((2,), "CPU")


def test_hash_spellings_normalise() -> None:
    for spelled in (-1, U64 - 1):
        e = ev.decode_payload(pack([0.0, [["BlockRemoved", [spelled, 0]]]])).events[0]
        assert isinstance(e, BlockRemoved) and e.block_hashes == (U64 - 1, 0)
    e = ev.decode_payload(pack([0.0, [["BlockRemoved", [b"\x00\x01"]]]])).events[0]
    assert isinstance(e, BlockRemoved) and e.block_hashes == (b"\x00\x01",)


# ---- round trips over every form, hash style and omission -------------------------------

hashes = st.one_of(st.integers(0, U64 - 1), st.binary(min_size=1, max_size=40))
media = st.sampled_from([None, "GPU", "CPU", "CPU_PINNED", "DISK"])
opt_text = st.none() | st.text(max_size=8)


@st.composite
def stored(draw: st.DrawFn) -> BlockStored:
    hs = draw(st.lists(hashes, max_size=4))  # repeats allowed: content-hash engines (SGLang)
    parent = draw(st.none() | hashes | (st.sampled_from(hs) if hs else st.none()))
    bs = draw(st.integers(1, 6))
    toks = draw(st.lists(st.integers(0, 2**32 - 1), min_size=bs * len(hs), max_size=bs * len(hs)))
    extra_entry = st.none() | st.tuples(st.text(max_size=4), st.integers(-5, 5))
    extra = draw(st.none() | st.lists(extra_entry, min_size=len(hs), max_size=len(hs)).map(tuple))
    return BlockStored(
        tuple(hs),
        parent,
        tuple(toks),
        bs,
        draw(st.none() | st.integers(0, 2**31)),
        draw(media),
        draw(opt_text),
        extra,
        draw(st.none() | st.integers(0, 3)),
        draw(opt_text),
        draw(st.none() | st.integers(0, 4096)),
    )


removed = st.builds(BlockRemoved, st.lists(hashes, max_size=4).map(tuple), media, st.none() | st.integers(0, 3))
events = st.lists(st.one_of(stored(), removed, st.just(AllBlocksCleared())), max_size=6)


def styled(e: Event, style: str) -> Event:
    """``e`` as the decoder returns it after encoding with ``hash_style=style``."""
    if style != "bytes" or isinstance(e, AllBlocksCleared):
        return e
    f = lambda h: h.to_bytes(8, "big") if isinstance(h, int) else h  # noqa: E731
    if isinstance(e, BlockRemoved):
        return BlockRemoved(tuple(f(h) for h in e.block_hashes), e.medium, e.group_idx)
    p = e.parent_block_hash
    return BlockStored(
        tuple(f(h) for h in e.block_hashes),
        None if p is None else f(p),
        e.token_ids,
        e.block_size,
        e.lora_id,
        e.medium,
        e.lora_name,
        e.extra_keys,
        e.group_idx,
        e.kv_cache_spec_kind,
        e.kv_cache_spec_sliding_window,
    )


@given(
    evs=events,
    seq=st.integers(0, 2**63 - 1),
    ts=st.floats(allow_nan=False),
    dp=st.none() | st.integers(0, 7),
    form=st.sampled_from(["array", "map"]),
    style=st.sampled_from(["int", "signed", "bytes"]),
    omit=st.booleans(),
)
def test_round_trip(evs: list[Event], seq: int, ts: float, dp: int | None, form: Any, style: Any, omit: bool) -> None:
    frames = ev.encode_batch(evs, seq, ts, dp, topic=b"t", form=form, hash_style=style, omit_defaults=omit)
    b = ev.decode_message(frames)
    assert (b.seq, b.ts, b.dp_rank, b.topic) == (seq, ts, dp, b"t")
    assert b.events == tuple(styled(e, style) for e in evs)
    r = ev.decode_replay(ev.encode_replay(seq, frames[2]))
    assert r is not None and (r.events, r.digest) == (b.events, b.digest)


def test_signed_style_writes_negative_ints() -> None:
    p = ev.encode_payload([BlockRemoved((U64 - 1, 5))], hash_style="signed")
    assert msgpack.unpackb(p)[1][0][1] == [-1, 5]


def test_replay_helpers() -> None:
    assert ev.encode_replay_request(258) == b"\x00" * 6 + b"\x01\x02"
    assert ev.encode_replay_end() == [b"\xff" * 8, b""]
    assert ev.decode_replay(ev.encode_replay_end()) is None
    assert ev.decode_replay([b"\xff" * 8, b"ignored"]) is None
    with pytest.raises(ValueError):
        ev.encode_replay_request(-1)
    with pytest.raises(ValueError):
        ev.encode_batch([], -1)
    with pytest.raises(ValueError):
        ev.encode_replay(1 << 63, b"")
    with pytest.raises(ValueError):
        ev.encode_payload([], form="json")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        ev.encode_payload([], hash_style="hex")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        ev.encode_payload([BlockRemoved((U64,))])


# ---- refusals -----------------------------------------------------------------------------


def stored_with(**changes: object) -> bytes:
    names = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name", "extra_keys", "group_idx", "kv_cache_spec_kind", "kv_cache_spec_sliding_window")
    d: dict[str, object] = {"type": "BlockStored", "block_hashes": [1, 2], "parent_block_hash": None, "token_ids": [10, 11, 12, 13], "block_size": 2}
    d.update(changes)
    assert set(d) <= {"type", *names}
    return pack({"ts": 0.0, "events": [{"type": "AllBlocksCleared"}, d]})


BAD_PAYLOADS: list[tuple[str, bytes, str]] = [
    ("not msgpack", b"\xc1", "not one msgpack object"),
    ("truncated", pack([0.0, [STORED]])[:-3], "not one msgpack object"),
    ("trailing bytes", pack([0.0, []]) + b"\x00", "not one msgpack object"),
    ("bad utf-8", b"\x92\xcb" + b"\x00" * 8 + b"\x91\x91\xa2\xff\xfe", "not one msgpack object"),
    ("int map key", pack({1: 2}), "not one msgpack object"),
    ("batch scalar", pack(7), "batch must be an array or a map, got int"),
    ("batch short", pack([0.0]), "needs [ts, events"),
    ("batch map no events", pack({"ts": 0.0}), "no 'events' key"),
    ("ts string", pack(["0", []]), "ts must be a number, got str"),
    ("ts bool", pack([True, []]), "ts must be a number, got bool"),
    ("events map", pack([0.0, {}]), "events must be an array, got dict"),
    ("dp negative", pack([0.0, [], -1]), "data_parallel_rank must be a non-negative int"),
    ("dp string", pack([0.0, [], "0"]), "data_parallel_rank"),
]

# Events that cannot be understood: skipped, the rest of their payload decoded (issue 16).
BAD_EVENTS: list[tuple[str, bytes, str]] = [
    ("event scalar", pack([0.0, [5]]), "events[0]: an event is an array or a map, got int"),
    ("event empty", pack([0.0, [[]]]), "an empty array"),
    ("tag int", pack([0.0, [[1, [1]]]]), "starts with its tag string, got int"),
    ("unknown tag", pack([0.0, [["BlockMoved", [1]]]]), "unknown event tag 'BlockMoved'"),
    ("map no type", pack([0.0, [{"block_hashes": [1]}]]), "under 'type', got nil"),
    ("too few fields", pack([0.0, [["BlockStored", [1], None, [1]]]]), "needs at least 4 fields after the tag, got 3"),
    ("removed no fields", pack([0.0, [["BlockRemoved"]]]), "needs at least 1 fields after the tag, got 0"),
    ("map missing parent", pack([0.0, [{"type": "BlockStored", "block_hashes": [1], "token_ids": [1], "block_size": 1}]]), "missing field 'parent_block_hash'"),
    ("hashes not list", stored_with(block_hashes=5), "events[1] (BlockStored).block_hashes must be an array"),
    ("hash float", stored_with(block_hashes=[1.0, 2]), ".block_hashes[0] must be an int or bytes, got float"),
    ("hash bool", stored_with(block_hashes=[1, True]), ".block_hashes[1] must be an int or bytes, got bool"),
    ("hash empty bytes", stored_with(block_hashes=[b"", 2]), ".block_hashes[0] is empty bytes"),
    ("parent str", stored_with(parent_block_hash="x"), ".parent_block_hash must be an int or bytes, got str"),
    ("block_size zero", stored_with(block_size=0), ".block_size must be an int in 1..65535, got 0"),
    ("block_size bool", stored_with(block_size=True), ".block_size must be an int in 1..65535, got bool"),
    ("block_size float", stored_with(block_size=2.0), ".block_size must be an int in 1..65535, got float"),
    ("block_size past 16 bits", stored_with(block_size=65536), ".block_size must be an int in 1..65535, got 65536"),
    ("token count", stored_with(token_ids=[1, 2, 3]), "has 3 tokens; 2 blocks of 2 need 4"),
    # No tokens is a copy only without a parent (vLLM's offloading connector's form).
    ("no tokens under a parent", stored_with(token_ids=[], parent_block_hash=9), "has 0 tokens; 2 blocks of 2 need 4"),
    ("copy with a negative size", stored_with(token_ids=[], block_size=-1), ".block_size must be an int"),
    ("token negative", stored_with(token_ids=[1, -1, 2, 3]), ".token_ids[1] is -1; token ids are 0..2**32-1"),
    ("token too big", stored_with(token_ids=[1, 2, 3, 2**32]), ".token_ids[3] is 4294967296"),
    ("token float", stored_with(token_ids=[1, 2.0, 3, 4]), ".token_ids[1] must be an int token id, got float"),
    ("token bool", stored_with(token_ids=[1, 2, False, 4]), ".token_ids[2] must be an int token id, got bool"),
    ("token pair", stored_with(token_ids=[[1, 2], 2, 3, 4]), ".token_ids[0] must be an int token id, got list"),
    ("tokens not list", stored_with(token_ids=b"\x01\x02"), ".token_ids must be an array of ints, got bytes"),
    ("lora_id str", stored_with(lora_id="a"), ".lora_id must be an int or nil, got str"),
    ("medium int", stored_with(medium=1), ".medium must be a string or nil, got int"),
    ("lora_name bytes", stored_with(lora_name=b"x"), ".lora_name must be a string or nil, got bytes"),
    ("extra_keys length", stored_with(extra_keys=[None]), ".extra_keys has 1 entries for 2 blocks"),
    ("extra_keys map", stored_with(extra_keys={"a": 1}), ".extra_keys must be an array or nil, got dict"),
    ("extra_keys entry", stored_with(extra_keys=[None, 3]), ".extra_keys[1] must be an array or nil, got int"),
    # Found in review: nested a thousand deep (msgpack decodes it) it raised RecursionError, which
    # ended the agent runner instead of skipping the event.
    ("extra_keys nested deep", stored_with(extra_keys=[None, functools.reduce(lambda x, _: [x], range(1000), ["salt"])]), ".extra_keys[1] nests arrays deeper than 8"),
    ("group_idx negative", stored_with(group_idx=-1), ".group_idx must be a non-negative int or nil, got -1"),
    ("group_idx past 16 bits", stored_with(group_idx=65536), ".group_idx must be at most 65535, got 65536"),
    ("spec kind int", stored_with(kv_cache_spec_kind=3), ".kv_cache_spec_kind must be a string or nil"),
    ("window str", stored_with(kv_cache_spec_sliding_window="8"), ".kv_cache_spec_sliding_window must be a non-negative int"),
    ("removed medium", pack([0.0, [["BlockRemoved", [1], 5]]]), "(BlockRemoved).medium must be a string or nil, got int"),
]


@pytest.mark.parametrize(("payload", "needle"), [(p, n) for _, p, n in BAD_PAYLOADS], ids=[c for c, _, _ in BAD_PAYLOADS])
def test_malformed_payload_is_refused_precisely(payload: bytes, needle: str) -> None:
    with pytest.raises(InvalidEventError) as ei:
        ev.decode_message(pub(payload, seq=9))
    assert needle in str(ei.value)
    assert str(ei.value).startswith("seq 9: ")
    assert ei.value.seq == 9
    with pytest.raises(InvalidEventError):
        ev.decode_payload(payload)


@pytest.mark.parametrize(("payload", "needle"), [(p, n) for _, p, n in BAD_EVENTS], ids=[c for c, _, _ in BAD_EVENTS])
def test_an_event_that_cannot_be_understood_is_skipped_precisely(payload: bytes, needle: str) -> None:
    b = ev.decode_message(pub(payload, seq=9))
    (skipped,) = b.skipped
    assert needle in skipped.reason and skipped.reason.startswith("seq 9: ")
    # Whatever else the payload holds is decoded (stored_with puts a good event first).
    raw = msgpack.unpackb(payload)
    events = raw["events"] if isinstance(raw, dict) else raw[1]
    assert len(b.events) == len(events) - 1
    assert ev.decode_payload(payload).skipped[0].index == skipped.index


def test_a_token_less_parent_less_store_is_a_copy_of_any_block_size() -> None:
    for size in (0, 2, 16):
        b = ev.decode_message(pub(stored_with(token_ids=[], block_size=size, medium="CPU"), seq=3))
        e = b.events[1]
        assert isinstance(e, BlockStored) and not b.skipped
        assert (tuple(e.block_hashes), len(e.token_ids), e.block_size, e.medium) == ((1, 2), 0, size, "CPU")


def test_content_hash_repeats_are_not_malformed() -> None:
    # SGLang hashes a page's tokens alone: two identical consecutive pages share a hash, so a
    # hash may repeat within an event and a page's parent may carry its own hash.
    for hs, parent in (([3, 3], None), ([1, 2], 2), ([3, 3], 3), ([-1, 2**64 - 1], None)):
        b = ev.decode_message(pub(stored_with(block_hashes=hs, parent_block_hash=parent), seq=4))
        e = b.events[1]
        assert isinstance(e, BlockStored)
        assert e.block_hashes == tuple(h % 2**64 for h in hs) and e.parent_block_hash == parent
    b = ev.decode_message(pub(pack([0.0, [["BlockRemoved", [7, 7, -1, 2**64 - 1]]]])))
    assert b.events == (BlockRemoved((7, 7, 2**64 - 1, 2**64 - 1)),)


def test_skipped_events_carry_their_index() -> None:
    b = ev.decode_message(pub(stored_with(block_size=0), seq=3))
    assert [sk.index for sk in b.skipped] == [1] and b.events == (AllBlocksCleared(),)


BAD_FRAMES: list[tuple[str, Any, str]] = [
    ("two frames", [b"", b"\x00" * 8], "3 frames (topic, seq, payload), got 2 frames"),
    ("four frames", [b"", b"\x00" * 8, b"", b""], "got 4 frames"),
    ("one bytes object", b"abc", "got a bytes object"),
    ("str frame", ["t", b"\x00" * 8, pack([0.0, []])], "frame 0 must be bytes, got str"),
    ("short seq", [b"", b"\x00" * 7, pack([0.0, []])], "frame 1 (seq) must be 8 bytes (big-endian), got 7"),
    ("long seq", [b"", b"\x00" * 9, pack([0.0, []])], "got 9"),
    ("negative seq", [b"", b"\xff" * 8, pack([0.0, []])], "frame 1 (seq) is -1"),
]


@pytest.mark.parametrize(("frames", "needle"), [(f, n) for _, f, n in BAD_FRAMES], ids=[c for c, _, _ in BAD_FRAMES])
def test_malformed_frames_are_refused(frames: Any, needle: str) -> None:
    with pytest.raises(InvalidEventError) as ei:
        ev.decode_message(frames)
    assert needle in str(ei.value)


def test_malformed_replay_frames() -> None:
    with pytest.raises(InvalidEventError, match="2 frames"):
        ev.decode_replay([b"", b"\x00" * 8, b""])
    with pytest.raises(InvalidEventError, match="only -1"):
        ev.decode_replay([(-2).to_bytes(8, "big", signed=True), b""])
    with pytest.raises(InvalidEventError, match="replayed seq 4: payload is not one msgpack object"):
        ev.decode_replay([(4).to_bytes(8, "big"), b"\xc1"])


def test_frames_accept_any_buffer() -> None:
    f = ev.encode_batch([AllBlocksCleared()], 3)
    b = ev.decode_message([bytearray(f[0]), memoryview(f[1]), array.array("B", f[2])])  # type: ignore[list-item]
    assert (b.seq, b.events) == (3, (AllBlocksCleared(),))
    with pytest.raises(InvalidEventError, match="frame 2 must be bytes, got int"):
        ev.decode_message([f[0], f[1], 5])  # type: ignore[list-item]


def test_token_checks_in_rust_match_the_rules() -> None:
    """The one-pass check behind every decoded BlockStored (exact ints in 0..2**32-1, no bools)
    and the packing the agent keys by."""
    import struct

    from kvcompass import _core

    assert _core.first_bad_token([]) == -1 and _core.first_bad_token([0, 7, 2**32 - 1]) == -1
    for bad, at in (([1, True], 1), ([1, 2, -1], 2), ([2**32], 0), ([0, 1.0], 1), ([[1]], 0), ([1, 2**70], 1), ([1, None], 1), ((3, "4"), 1)):
        assert _core.first_bad_token(bad) == at, bad
    toks = [0, 1, 65535, 2**32 - 1, 128_000]
    assert _core.pack_tokens(toks) == _core.pack_tokens(tuple(toks)) == struct.pack("<5I", *toks)
