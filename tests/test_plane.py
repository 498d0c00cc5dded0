"""End to end, in one process: engine KV events (vLLM wire bytes) -> worker agent -> maintenance
units -> patches -> every edge -> route. Checks the pieces agree on keys, sequencing and the
joint score, which the per-module tests cannot."""

from __future__ import annotations

import numpy as np
import pytest

from kvcompass.agent import BlockRemoved, BlockStored, WorkerAgent, encode_batch
from kvcompass.discovery.plane import LocalPlane
from kvcompass.discovery.topology import load_topology
from kvcompass.errors import InvalidArgumentError
from kvcompass.index_types import Namespace, Tier

NS = Namespace("llama-3.1-8b", "e2e")
BLOCK = 16


@pytest.fixture()
def plane() -> LocalPlane:
    return LocalPlane(load_topology("testbed-14x3"), seed=3)


def agent_for(plane: LocalPlane, worker: str) -> WorkerAgent:
    region = next(w.region for w in plane.topology.workers if w.id == worker)
    return WorkerAgent(worker, NS, plane.plan.registration(region), plane.layout.shards, block_size=BLOCK)


def stored(tokens: np.ndarray, base: int, medium: str = "GPU") -> BlockStored:
    n = len(tokens) // BLOCK
    return BlockStored(tuple(range(base, base + n)), None, tuple(int(t) for t in tokens[: n * BLOCK]), BLOCK, None, medium)


def feed(plane: LocalPlane, agent: WorkerAgent, frames: list[bytes]) -> None:
    out = agent.on_message(frames)
    assert out.replay is None
    for b in out.batches:
        plane.ingest(b, sender=b.worker)
    plane.propagate()


def test_remote_prefix_is_found_and_routed_to_when_it_saves_more_than_the_rtt(plane: LocalPlane) -> None:
    rng = np.random.default_rng(11)
    prompt = rng.integers(0, 100_000, size=4096, dtype=np.uint32)
    asia = agent_for(plane, "asia-0")
    feed(plane, asia, encode_batch([stored(prompt, 1000)], seq=0))
    assert plane.converged()

    d = plane.edges["us"].route(prompt, NS, now=0.0)
    # us -> asia plan tops out at 3536 <= 4096 tokens: asia-0 saves 0.085 * 3536 = 300 ms of
    # prefill for a 149.6 ms round trip, so it wins; a local worker would recompute all 4096.
    assert d.worker == "asia-0" and d.expected_match == 3536 and d.tier == Tier.VRAM
    beta, wan = 0.085, plane.plan.rtt_ms("us", "asia")
    assert d.score == pytest.approx(wan + beta * (4096 - 3536))

    # A short prompt whose shared prefix is below n1 (1760 tokens toward asia) is not worth
    # the crossing: nothing at the planned lengths matches, so a local worker serves it.
    short = prompt[:1700]
    assert plane.edges["us"].route(short, NS, now=0.0).region == "us"

    # The holder's queue makes the crossing lose.
    plane.edges["us"].on_broadcast("asia", {"asia-0": 1000.0}, now=0.0)
    assert plane.edges["us"].route(prompt, NS, now=0.0).region == "us"


def test_removal_and_offload_flow_through(plane: LocalPlane) -> None:
    rng = np.random.default_rng(12)
    prompt = rng.integers(0, 100_000, size=2048, dtype=np.uint32)
    eu = agent_for(plane, "eu-1")
    feed(plane, eu, encode_batch([stored(prompt, 1)], seq=0))
    d = plane.edges["eu"].route(prompt, NS, now=0.0)
    # The whole 2048-token prompt is indexed; an engine reuses all but its last block.
    assert (d.worker, d.expected_match, d.tier) == ("eu-1", 2048 - BLOCK, Tier.VRAM)
    longer = np.append(prompt, np.uint32(7))
    assert plane.edges["eu"].lookup(longer, NS, now=0.0).expected_match == 2048  # a longer prompt reuses it all
    # Offload to CPU: stored again on CPU, removed from GPU -> the index says DRAM.
    n = 2048 // BLOCK
    feed(plane, eu, encode_batch([stored(prompt, 1, medium="CPU"), BlockRemoved(tuple(range(1, 1 + n)), "GPU")], seq=1))
    d = plane.edges["eu"].route(prompt, NS, now=10.0)
    assert (d.worker, d.tier) == ("eu-1", Tier.DRAM)
    # Evicted everywhere -> no holder.
    feed(plane, eu, encode_batch([BlockRemoved(tuple(range(1, 1 + n)), "CPU")], seq=2))
    d = plane.edges["eu"].route(prompt, NS, now=20.0)
    assert d.expected_match == 0
    assert plane.converged()


def test_lost_patch_batches_are_repaired_and_views_converge(plane: LocalPlane) -> None:
    rng = np.random.default_rng(13)
    agents = [agent_for(plane, w) for w in ("us-0", "eu-0", "asia-1")]
    seqs = [0, 0, 0]
    for round_ in range(6):
        for i, a in enumerate(agents):
            toks = rng.integers(0, 50_000, size=1024, dtype=np.uint32)
            out = a.on_message(encode_batch([stored(toks, 10_000 * (i + 1) + 100 * round_)], seq=seqs[i]))
            seqs[i] += 1
            for b in out.batches:
                plane.ingest(b, sender=b.worker)
        # Lose the first batch of table 0 on every shard this round.
        drop = {(0, s, plane.units[s].position(0)[1] + 1) for s in range(plane.layout.shards)}
        report = plane.propagate(drop=drop)
        assert report.batches > 0
    assert plane.converged()
    for edge in plane.edges.values():
        assert edge.healthy


def test_forged_write_is_refused_end_to_end(plane: LocalPlane) -> None:
    from kvcompass.errors import ForbiddenWriteError

    prompt = np.arange(512, dtype=np.uint32)
    a = agent_for(plane, "asia-2")
    out = a.on_message(encode_batch([stored(prompt, 5)], seq=0))
    before = [u.digest() for u in plane.units]
    with pytest.raises(ForbiddenWriteError):
        for b in out.batches:
            plane.ingest(b, sender="asia-3")
    assert [u.digest() for u in plane.units] == before


def test_an_edge_only_region_gets_its_own_ladder_and_routes() -> None:
    from kvcompass.discovery.topology import topology_from_dict

    raw = {
        "name": "edge-only",
        "regions": {"us": "us-east-1", "eu": "eu-central-1"},
        "workers": [{"id": "us-0", "region": "us", "beta_ms_per_token": 0.085, "vram_tokens": 4096, "dram_tokens": 8192}],
    }
    topo = topology_from_dict(raw)
    plane = LocalPlane(topo)
    assert plane.plan.lengths("eu", "eu") == plane.plan.lengths("us", "us")
    d = plane.edges["eu"].route(np.arange(300, dtype=np.uint32), NS, now=0.0)
    assert d.worker == "us-0"


def test_a_bad_queue_report_changes_neither_queues_nor_belief(plane: LocalPlane) -> None:


    edge = plane.edges["us"]
    before = (edge.belief("asia-0"), edge.queue_estimate("asia-2"))
    with pytest.raises(InvalidArgumentError):
        edge.on_response("asia-0", 1000, 0, {"asia-2": float("nan")}, 0.0)
    assert (edge.belief("asia-0"), edge.queue_estimate("asia-2")) == before


def _rounds(plane: LocalPlane, rounds: int, seed: int) -> list[np.ndarray]:
    """Several agents store and remove prompts round after round (enough blocks to grow the
    tables past their 4,096-entry start); returns the prompts stored."""
    rng = np.random.default_rng(seed)
    names = ("us-0", "eu-1", "asia-1", "us-2")
    agents = {w: agent_for(plane, w) for w in names}
    seqs = dict.fromkeys(names, 0)
    prompts: list[np.ndarray] = []
    for r in range(rounds):
        for i, w in enumerate(names):
            toks = rng.integers(0, 50_000, size=16 * int(rng.integers(8, 160)), dtype=np.uint32)
            base = 1_000_000 * (i + 1) + 10_000 * r
            events: list[BlockStored | BlockRemoved] = [stored(toks, base)]
            if r and rng.random() < 0.5:  # drop the previous round's prompt of this worker
                prev = prompts[-len(names)]
                events.append(BlockRemoved(tuple(range(base - 10_000, base - 10_000 + len(prev) // BLOCK)), "GPU"))
            out = agents[w].on_message(encode_batch(events, seq=seqs[w]))
            seqs[w] += 1
            for b in out.batches:
                plane.ingest(b, sender=b.worker)
            prompts.append(toks)
        plane.propagate()
    return prompts


def test_edges_that_share_views_route_exactly_as_edges_with_replicas() -> None:
    """``LocalPlane(share_views=True)``: every edge reads the first edge's views, each batch is
    applied once. Same events, same seeds: every edge decides as its replica-keeping twin,
    through table growth, removals and rounds of patches."""
    topo = load_topology("testbed-14x3")
    own, shared = LocalPlane(topo, seed=5), LocalPlane(topo, seed=5, share_views=True)
    first = next(iter(shared.edges))
    assert [e.views_of for e in shared.edges.values()] == [None] + [first] * (len(shared.edges) - 1)
    assert all(e.views_of is None for e in own.edges.values())
    for rounds, seed in ((3, 1), (6, 2)):
        p_own, p_shared = _rounds(own, rounds, seed), _rounds(shared, rounds, seed)
        assert all((a == b).all() for a, b in zip(p_own, p_shared))
        assert own.converged() and shared.converged()
        for region in own.edges:
            for k, toks in enumerate(p_own):
                a = own.edges[region].route(toks, NS, now=float(k))
                b = shared.edges[region].route(toks, NS, now=float(k))
                assert (a.worker, a.expected_match, a.tier, a.score) == (b.worker, b.expected_match, b.tier, b.score)
    assert max(len(shared.units[s].snapshot(0)) for s in range(shared.layout.shards)) > 4096  # the tables grew


def test_an_edge_that_reads_anothers_views_refuses_patches_and_follows_its_snapshots() -> None:
    topo = load_topology("testbed-14x3")
    plane = LocalPlane(topo, seed=5, share_views=True)
    leader, reader = list(plane.edges.values())[:2]
    unit = plane.units[0]
    batch = unit.snapshot(0)
    for call in (lambda: reader.apply_patch(batch), lambda: reader.apply_patches_in_order([batch]), lambda: reader.bootstrap(0, 0, batch), lambda: reader.note_writer_position(0, 0, 1, 99)):
        with pytest.raises(InvalidArgumentError, match="reads the views of"):
            call()
    with pytest.raises(InvalidArgumentError, match="one level"):
        leader.read_views_of(reader)
    # The leader re-bootstraps every view (new objects): the reader routes over the new ones.
    for t in plane.layout.tables:
        for s in range(plane.layout.shards):
            leader.bootstrap(t.table_id, s, plane.units[s].snapshot(t.table_id))
    prompt = np.random.default_rng(4).integers(0, 50_000, size=8192, dtype=np.uint32)
    feed(plane, agent_for(plane, "eu-1"), encode_batch([stored(prompt, 7)], seq=0))
    d = plane.edges["eu"].route(prompt, NS, now=0.0)
    assert d.worker == "eu-1" and d.expected_match > 0
    others = [w for w in leader.workers if w != "eu-1"]
    for edge in plane.edges.values():  # every edge's views (the leader's) hold the new claim
        assert edge.lookup(prompt, NS, now=0.0, exclude=others).expected_match > 0


def test_shared_views_repair_lost_batches_for_every_edge() -> None:
    plane = LocalPlane(load_topology("testbed-14x3"), seed=3, share_views=True)
    agents = [agent_for(plane, w) for w in ("us-0", "eu-0", "asia-1")]
    rng = np.random.default_rng(13)
    for round_ in range(4):
        for i, a in enumerate(agents):
            toks = rng.integers(0, 50_000, size=1024, dtype=np.uint32)
            for b in a.on_message(encode_batch([stored(toks, 10_000 * (i + 1) + 100 * round_)], seq=round_)).batches:
                plane.ingest(b, sender=b.worker)
        drop = {(0, s, plane.units[s].position(0)[1] + 1) for s in range(plane.layout.shards)}
        assert plane.propagate(drop=drop).resyncs > 0
    assert plane.converged()
    assert all(edge.healthy for edge in plane.edges.values())


def test_a_batch_for_a_shard_the_plane_does_not_have_is_refused(plane: LocalPlane) -> None:
    """Review, twenty-fifth session: shard = n raised IndexError, shard -1 reached the last unit
    (and counted against it)."""
    from kvcompass.discovery.key_ops import KeyOpBatch
    from kvcompass.errors import WrongShardError

    w = plane.layout.workers[0]
    n = plane.layout.shards
    for shard in (n, -1):
        with pytest.raises(WrongShardError, match=f"shard {shard}: this plane's shards are 0..{n - 1}"):
            plane.ingest(KeyOpBatch(w, 1, shard, 1, np.array([], np.uint64), np.array([], np.uint8)), w)
    assert all(u.stats.rejected == {} for u in plane.units)


def test_a_snapshot_from_a_writer_restarted_at_a_lower_epoch_closes_an_open_gap() -> None:
    """Review, twenty-fifth session: a gap open toward epoch 10 when the unit restarted at epoch
    5 stayed open after the edge took the new unit's snapshot (its view (5, s) is below the
    target (10, s')), so the edge resubscribed for ever and never reported ready."""
    from kvcompass.discovery.key_ops import KeyOpBatch
    from kvcompass.discovery.maintenance import MaintenanceUnit

    plane = LocalPlane(load_topology("testbed-14x3"), epoch=10)
    edge = plane.edges["us"]
    unit = plane.units[0]
    w = plane.layout.tables[0].workers[0]
    n = plane.layout.shards
    out = []
    for seq in (1, 2, 3):
        unit.apply(KeyOpBatch(w, 1, 0, seq, np.array([n * seq], np.uint64), np.array([1], np.uint8)), w)
        out += unit.flush()
    assert edge.apply_patch(out[0].data).applied
    assert not edge.apply_patch(out[2].data).applied  # out[1] lost: a gap toward epoch 10
    assert not edge.healthy
    again = MaintenanceUnit(0, plane.layout, 5)  # restarted, no state file, clock stepped back
    again.apply(KeyOpBatch(w, 2, 0, 1, np.array([n * 7], np.uint64), np.array([1], np.uint8)), w)
    again.flush()
    for t in plane.layout.tables:
        edge.bootstrap(t.table_id, 0, again.snapshot(t.table_id))
    assert edge.healthy and edge.pending_resyncs() == []
    assert edge.view(0, 0).digest() == again.table_digest(0)
