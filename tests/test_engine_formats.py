"""Engine event formats encoded exactly as the engines' publishers encode them: msgspec structs
mirroring the engines' own definitions at named versions, ``msgspec.msgpack`` as their
``ZmqEventPublisher`` uses it. Each is decoded by the agent and compared with the same content in
the vLLM form the agent has always read.

Covered here: SGLang's ``BlockStoredWithMetadata`` (SGLang 0.5.18 on: a request's
``cache_salt`` in a metadata map after ``medium``), in the array form and in the tagged-map form
SGLang later switched to."""

from __future__ import annotations

from typing import Any, Optional

import msgspec
import pytest

import kvcompass as kc
from kvcompass.agent import BlockStored, WorkerAgent, encode_batch
from kvcompass.agent.agent import TENANT_SALT_PREFIX
from kvcompass.agent.events import decode_message

NS = kc.Namespace("llama-3.1-8b", "public")
LENGTHS = [16, 32, 64]
BS = 16


def sglang_structs(array_like: bool) -> dict[str, Any]:
    """SGLang's event structs (``sglang/srt/disaggregation/kv_events.py``, 0.5.18 on)."""

    class EventBatch(msgspec.Struct, array_like=array_like, omit_defaults=True, gc=False):  # type: ignore[call-arg]
        ts: float
        events: list[Any]

    class KVCacheEvent(msgspec.Struct, array_like=array_like, omit_defaults=True, gc=False, tag=True):  # type: ignore[call-arg]
        pass

    class BlockStoredMetadata(msgspec.Struct, omit_defaults=True, gc=False):  # type: ignore[call-arg]
        cache_salt: str

    class SgBlockStored(KVCacheEvent, tag="BlockStored"):  # type: ignore[call-arg]
        block_hashes: list[int]
        parent_block_hash: Optional[int]  # noqa: UP045 - the engine's own annotation
        token_ids: list[int]
        block_size: int
        lora_id: Optional[int]  # noqa: UP045
        medium: Optional[str] = None  # noqa: UP045

    class SgBlockStoredWithMetadata(SgBlockStored, tag="BlockStored", kw_only=True):  # type: ignore[call-arg]
        metadata: BlockStoredMetadata

    return {"batch": EventBatch, "stored": SgBlockStored, "salted": SgBlockStoredWithMetadata, "meta": BlockStoredMetadata}


def frames(seq: int, payload: bytes) -> list[bytes]:
    return [b"", seq.to_bytes(8, "big"), payload]


PROMPT = list(range(1000, 1000 + 4 * BS))


def held_after(*payload_frames: list[bytes]) -> dict[int, int]:
    agent = WorkerAgent("w0", NS, LENGTHS, 2, block_size=BS, tenant_salts=True)
    for f in payload_frames:
        agent.on_message(f)
    return {k: int(t) for k, t in agent.held().items()}


@pytest.mark.parametrize("array_like", [True, False], ids=["array", "map"])
def test_sglang_salted_and_unsalted_stores_in_one_batch_key_each_in_its_namespace(array_like: bool) -> None:
    sg = sglang_structs(array_like)
    salt = TENANT_SALT_PREFIX + "acme"
    plain = sg["stored"](block_hashes=[1, 2, 3, 4], parent_block_hash=None, token_ids=PROMPT, block_size=BS, lora_id=None, medium="GPU")
    salted = sg["salted"](block_hashes=[11, 12, 13, 14], parent_block_hash=None, token_ids=PROMPT, block_size=BS, lora_id=None, medium="GPU", metadata=sg["meta"](cache_salt=salt))
    payload = msgspec.msgpack.encode(sg["batch"](ts=1.0, events=[plain, salted]))
    if array_like:  # the wire shape SGLang documents: the metadata map at index 7
        raw = msgspec.msgpack.decode(payload)
        assert len(raw[1][0]) == 7 and len(raw[1][1]) == 8 and raw[1][1][7] == {"cache_salt": salt}
    b = decode_message(frames(0, payload))
    assert [e.cache_salt for e in b.events if isinstance(e, BlockStored)] == [None, salt]
    got = held_after(frames(0, payload))
    # The same two stores in vLLM's form: the salt as the first block's only extra key.
    vllm = encode_batch(
        [
            BlockStored((1, 2, 3, 4), None, tuple(PROMPT), BS, None, "GPU"),
            BlockStored((11, 12, 13, 14), None, tuple(PROMPT), BS, None, "GPU", extra_keys=((salt,), None, None, None)),
        ],
        0,
    )
    assert got == held_after(vllm)
    public_only = held_after(encode_batch([BlockStored((1, 2, 3, 4), None, tuple(PROMPT), BS, None, "GPU")], 0))
    assert set(public_only) < set(got)  # acme's keys are there too, in acme's namespace


def test_a_continuation_inherits_its_chains_namespace_and_a_foreign_salt_is_not_indexed() -> None:
    sg = sglang_structs(True)
    salt = TENANT_SALT_PREFIX + "acme"
    first = sg["salted"](block_hashes=[21, 22], parent_block_hash=None, token_ids=PROMPT[: 2 * BS], block_size=BS, lora_id=None, metadata=sg["meta"](cache_salt=salt))
    rest = sg["salted"](block_hashes=[23, 24], parent_block_hash=22, token_ids=PROMPT[2 * BS :], block_size=BS, lora_id=None, metadata=sg["meta"](cache_salt=salt))
    got = held_after(frames(0, msgspec.msgpack.encode(sg["batch"](ts=1.0, events=[first]))), frames(1, msgspec.msgpack.encode(sg["batch"](ts=2.0, events=[rest]))))
    whole = held_after(frames(0, msgspec.msgpack.encode(sg["batch"](ts=1.0, events=[sg["salted"](block_hashes=[21, 22, 23, 24], parent_block_hash=None, token_ids=PROMPT, block_size=BS, lora_id=None, metadata=sg["meta"](cache_salt=salt))]))))
    assert got == whole and len(got) == len(LENGTHS)
    # A salt that names none of our tenants keys nothing: another system's salted KV is
    # reusable by nobody we route for.
    foreign = sg["salted"](block_hashes=[31, 32, 33, 34], parent_block_hash=None, token_ids=PROMPT, block_size=BS, lora_id=None, metadata=sg["meta"](cache_salt="theirs"))
    assert held_after(frames(0, msgspec.msgpack.encode(sg["batch"](ts=1.0, events=[foreign])))) == {}


def test_malformed_sglang_metadata_skips_its_event() -> None:
    import msgpack

    for meta in ({"cache_salt": 5}, {"cache_salt": ""}):
        payload = msgpack.packb([1.0, [["BlockStored", [1], None, list(range(BS)), BS, None, None, meta], ["AllBlocksCleared"]]])
        b = decode_message(frames(0, payload))
        assert [sk.index for sk in b.skipped] == [0] and "cache_salt" in b.skipped[0].reason and len(b.events) == 1
    # Unknown metadata keys are ignored, as SGLang's own decoders do.
    payload = msgpack.packb([1.0, [["BlockStored", [1], None, list(range(BS)), BS, None, None, {"cache_salt": "x", "future": 1}]]])
    assert decode_message(frames(0, payload)).events[0].cache_salt == "x"  # type: ignore[union-attr]


def test_a_top_level_cache_salt_in_map_form_keys_the_tenants_namespace() -> None:
    """A map-form store that carries ``cache_salt`` as a key of its own (not inside
    ``metadata``) is salted the same way: filed in the tenant's namespace, not the public one."""
    import msgpack

    salt = TENANT_SALT_PREFIX + "acme"
    store = {"type": "BlockStored", "block_hashes": [11, 12, 13, 14], "parent_block_hash": None, "token_ids": PROMPT, "block_size": BS, "lora_id": None, "medium": "GPU"}
    top = msgpack.packb({"ts": 1.0, "events": [{**store, "cache_salt": salt}]})
    nested = msgpack.packb({"ts": 1.0, "events": [{**store, "metadata": {"cache_salt": salt}}]})
    plain = msgpack.packb({"ts": 1.0, "events": [store]})
    assert decode_message(frames(0, top)).events[0].cache_salt == salt  # type: ignore[union-attr]
    assert held_after(frames(0, top)) == held_after(frames(0, nested))
    assert not set(held_after(frames(0, top))) & set(held_after(frames(0, plain)))
