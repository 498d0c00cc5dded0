"""Property-based bad input (hypothesis) against the same entry points as ``test_bad_input.py``:
random bytes and mutations of valid messages never raise anything but the documented refusals,
and a refused input never changes a digest.

Transport-free on purpose (the codec plus the handlers a server would call), so hundreds of
examples run in seconds; ``test_bad_input.py`` covers the loopback transports item by item.
Examples are derandomized (tests/conftest.py) and kept modest; the whole file runs in < 30 s.
"""

from __future__ import annotations

import asyncio
import struct
from typing import Any

import msgpack
import numpy as np
from grpclib.exceptions import GRPCError
from hypothesis import given, settings
from hypothesis import strategies as st

import kvcompass as kc
from kvcompass._proto.kvcompass.v1 import KeyOps, OutcomeRequest, QueueVector, RouteRequest, SnapshotRequest, SubscribeRequest
from kvcompass.agent import BlockStored, WorkerAgent, encode_batch
from kvcompass.discovery.maintenance import MaintenanceUnit
from kvcompass.discovery.key_ops import KeyOpBatch
from kvcompass.discovery.plan import LevelPlan
from kvcompass.discovery.plane import LocalPlane
from kvcompass.discovery.topology import load_topology
from kvcompass.errors import InvalidEventError, KVCompassError
from kvcompass.services.codec import StrictProtoCodec
from kvcompass.services.edge_service import EdgeService
from kvcompass.services.maintenance_service import MaintenanceService, decode_key_ops

NS = kc.Namespace("llama-3.1-8b", "public")
BLOCK = 16
FEW = settings(max_examples=150, deadline=None, derandomize=True, database=None)
CODEC = StrictProtoCodec()

PLAN = LevelPlan(load_topology("testbed-14x3"))
LAYOUT = PLAN.layout()


def mutate(data: bytes, edits: list[tuple[int, int, int]]) -> bytes:
    """Apply (kind, position, byte) edits: 0 overwrite, 1 insert, 2 truncate."""
    b = bytearray(data)
    for kind, pos, val in edits:
        p = pos % (len(b) + 1)
        if kind == 0 and b:
            b[p % len(b)] = val
        elif kind == 1:
            b.insert(p, val)
        else:
            del b[p:]
    return bytes(b)


EDITS = st.lists(st.tuples(st.integers(0, 2), st.integers(0, 1 << 16), st.integers(0, 255)), min_size=1, max_size=4)


def wire(valid: bytes) -> st.SearchStrategy[bytes]:
    return st.one_of(st.binary(max_size=64), EDITS.map(lambda e: mutate(valid, e)))


# ---- KeyOps -> MaintenanceUnit.apply ---------------------------------------------------------------


def unit_with_data() -> MaintenanceUnit:
    unit = MaintenanceUnit(1, LAYOUT, 3, capacity=64)
    keys = np.array([4 * i + 1 for i in range(100, 108)], np.uint64)
    unit.apply(KeyOpBatch("eu-1", 1, 1, 1, keys, np.full(8, 2, np.uint8)), "eu-1")
    unit.flush()
    return unit


UNIT = unit_with_data()
VALID_KEYOPS = bytes(KeyOps(worker="eu-0", incarnation=1, shard=1, seq=1, keys=np.array([5, 9, 13], "<u8").tobytes(), tiers=b"\x01\x02\x00"))


@FEW
@given(raw=wire(VALID_KEYOPS), sender=st.sampled_from(["eu-0", "eu-1", "nobody"]))
def test_key_ops_bytes_are_applied_or_refused_precisely(raw: bytes, sender: str) -> None:
    unit = MaintenanceUnit.from_bytes(UNIT.to_bytes(), LAYOUT, 4, capacity=64)
    digest = unit.digest()
    try:
        msg = CODEC.decode(raw, KeyOps)
    except GRPCError as e:
        assert e.status.name == "INVALID_ARGUMENT"
        return
    assert isinstance(msg.keys, bytes) and isinstance(msg.tiers, bytes) and isinstance(msg.worker, str)
    assert isinstance(msg.shard, int) and 0 <= msg.shard < 1 << 32 and isinstance(msg.seq, int)
    try:
        unit.apply(decode_key_ops(msg, 1 << 16), sender)
    except KVCompassError:
        assert not unit.flush()
        assert unit.digest() == digest
        return
    # Accepted: it came from the sender, for this shard, with valid keys and tiers.
    assert msg.worker == sender and msg.shard == 1


@FEW
@given(
    keys=st.lists(st.integers(0, (1 << 64) - 1), max_size=12),
    tiers=st.lists(st.integers(0, 255), max_size=12),
    shard=st.integers(0, 5),
    seq=st.integers(0, (1 << 64) - 1),
    inc=st.integers(0, 3),
    reset=st.booleans(),
    worker=st.sampled_from(["eu-0", "us-3", "nobody", ""]),
)
def test_any_key_op_batch_leaves_the_unit_valid(keys: list[int], tiers: list[int], shard: int, seq: int, inc: int, reset: bool, worker: str) -> None:
    unit = MaintenanceUnit.from_bytes(UNIT.to_bytes(), LAYOUT, 4, capacity=64)
    view = kc.LudoView(1, 1)
    view.apply_batch(unit.snapshot(1))
    digest = unit.digest()
    msg = KeyOps(worker=worker, incarnation=inc, shard=shard, seq=seq, keys=np.array(keys, "<u8").tobytes(), tiers=bytes(tiers))
    try:
        unit.apply(decode_key_ops(msg, 1 << 16), worker)
    except KVCompassError:
        assert unit.digest() == digest and not unit.flush()
        return
    for b in unit.flush():
        if b.table_id == 1:
            view.apply_batch(b.data)
    assert view.digest() == unit.table_digest(1)


# ---- patch bytes -> Edge.apply_patch / LudoView.apply_batch -----------------------------------------


def writer_and_batches() -> tuple[kc.LudoTable, bytes, list[bytes]]:
    w = kc.LudoTable(table=0, shard=0, capacity=64, fp_bits=8)
    snap = w.export_snapshot()
    out = []
    for i in range(3):
        for k in range(2 + 6 * i, 8 + 6 * i, 2):
            w.set_field(k, i % 4, 1 + i % 2)
        b = w.take_batch()
        assert b is not None
        out.append(b)
    return w, snap, out


WRITER, SNAP, BATCHES = writer_and_batches()


@FEW
@given(base=st.integers(0, 2), edits=EDITS)
def test_mutated_patches_apply_exactly_or_change_nothing(base: int, edits: list[tuple[int, int, int]]) -> None:
    from kvcompass.errors import PatchError

    view = kc.LudoView(0, 0)
    view.apply_batch(SNAP)
    view.apply_batch(BATCHES[0])
    before = (view.state_bytes(), view.epoch, view.seq)
    raw = mutate(BATCHES[base], edits)
    try:
        r = view.apply_batch(raw)
    except PatchError:
        assert (view.state_bytes(), view.epoch, view.seq) == before
        return
    # Accepted: only the genuine next batch (or one with an identical effect) may apply.
    assert r.seq == 2


@FEW
@given(raw=st.binary(max_size=96))
def test_random_patch_bytes_never_raise_from_the_edge(raw: bytes) -> None:
    from kvcompass.discovery.edge import Edge
    from kvcompass.discovery.layout import IndexLayout, TableSpec, WorkerSpec

    layout = IndexLayout((TableSpec(0, "A", ("a0",)),), shards=1, fp_bits=8)
    edge = Edge("A", layout, [WorkerSpec("a0", "A")], {"A": [16]}, {"A": 1.0})
    edge.bootstrap(0, 0, SNAP)
    d = edge.view(0, 0).digest()
    out = edge.apply_patch(raw)
    assert not out.applied and edge.view(0, 0).digest() == d


# ---- engine KV events -> WorkerAgent --------------------------------------------------------------


def fed_agent() -> WorkerAgent:
    agent = WorkerAgent("us-0", NS, [256, 512], 4, block_size=BLOCK)
    agent.on_message(encode_batch([BlockStored(tuple(range(1, 33)), None, tuple(range(512)), BLOCK, None, "GPU")], 0))
    return agent


VALID_EVENTS = encode_batch([BlockStored((40, 41), 32, tuple(range(900, 932)), BLOCK, None, "GPU")], 1)[2]
MSGPACK_ATOMS = st.one_of(st.none(), st.booleans(), st.integers(-(1 << 63), (1 << 64) - 1), st.floats(allow_nan=True), st.text(max_size=8), st.binary(max_size=8))
MSGPACK = st.recursive(MSGPACK_ATOMS, lambda inner: st.one_of(st.lists(inner, max_size=6), st.dictionaries(st.text(max_size=6), inner, max_size=4)), max_leaves=20)


@FEW
@given(payload=st.one_of(wire(VALID_EVENTS), MSGPACK.map(msgpack.packb)))
def test_event_payloads_are_decoded_or_refused_without_changing_the_agent(payload: bytes) -> None:
    agent = fed_agent()
    digest = agent.digest()
    try:
        agent.on_message([b"kv", struct.pack(">q", 1), payload])
    except InvalidEventError:
        assert agent.digest() == digest and agent.stats.malformed == 1


# ---- the edge's RPC handlers -------------------------------------------------------------------------


PLANE = LocalPlane(load_topology("testbed-14x3"), seed=3)
EDGE = PLANE.edges["us"]


def edge_digests() -> tuple[bytes, ...]:
    return tuple(EDGE.view(t.table_id, s).digest() for t in EDGE.layout.tables for s in range(EDGE.layout.shards))


DIGESTS = edge_digests()
VALID_ROUTE = bytes(RouteRequest(tokens=np.arange(64, dtype="<u4").tobytes(), namespace=NS.digest))
VALID_OUTCOME = bytes(OutcomeRequest(worker="eu-0", claimed_tokens=16, reused_tokens=8, queue_vector={"eu-0": 3.0}))
VALID_QUEUES = bytes(QueueVector(region="eu", queues={"eu-0": 1.0, "eu-1": 2.0}))


@FEW
@given(which=st.sampled_from(["route", "outcome", "exchange"]), data=st.data())
def test_edge_rpc_bytes_answer_or_refuse_with_a_status(which: str, data: Any) -> None:
    svc = EdgeService(EDGE, clock=lambda: 1.0, max_prompt_tokens=4096)
    valid, typ, call = {
        "route": (VALID_ROUTE, RouteRequest, svc.route),
        "outcome": (VALID_OUTCOME, OutcomeRequest, svc.report_outcome),
        "exchange": (VALID_QUEUES, QueueVector, svc.exchange_queues),
    }[which]
    raw = data.draw(wire(valid))

    async def go() -> None:
        try:
            await call(CODEC.decode(raw, typ))
        except GRPCError as e:
            assert e.status.name in {"INVALID_ARGUMENT", "NOT_FOUND"}, e
            assert e.message

    asyncio.run(go())
    assert edge_digests() == DIGESTS


@FEW
@given(raw=st.one_of(wire(bytes(SubscribeRequest(shard=1))), wire(bytes(SnapshotRequest(shard=1, tables=[0, 2])))), snap=st.booleans())
def test_unit_request_bytes_decode_or_refuse(raw: bytes, snap: bool) -> None:
    unit = MaintenanceUnit.from_bytes(UNIT.to_bytes(), LAYOUT, 4, capacity=64)
    svc = MaintenanceService(unit)
    digest = unit.digest()

    async def go() -> None:
        try:
            if snap:
                await svc.snapshot(CODEC.decode(raw, SnapshotRequest))
            else:
                CODEC.decode(raw, SubscribeRequest)
        except GRPCError as e:
            assert e.status.name == "INVALID_ARGUMENT" and e.message

    asyncio.run(go())
    assert unit.digest() == digest
