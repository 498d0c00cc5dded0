"""A simulated worker's running sequences and its prefix cache share one KV pool (VRAM), as in
an engine: a prompt's prefill waits until its blocks fit beside the running sequences' (shared
prompt blocks counted once), and the cache keeps what the sequences' reservations leave.
``kv_pool="unbounded"`` is the earlier model (every prompt at once, the cache keeps all of VRAM)."""

from __future__ import annotations

from typing import Any

import pytest

from kvcompass.discovery.topology import Topology, topology_from_dict
from kvcompass.errors import InvalidArgumentError
from kvcompass.sim.engine import SimConfig, Simulator, simulate
from kvcompass.sim.summary import Summary

from _support import chain_request


def _one_worker(vram_tokens: int, dram_tokens: int = 0) -> Topology:
    raw: dict[str, Any] = {
        "name": "one",
        "rtt_ms": {"a": {"a": 2.0}},
        "regions": {"a": {}},
        "workers": [{"id": "w0", "region": "a", "beta_ms_per_token": 0.085, "vram_tokens": vram_tokens, "dram_tokens": dram_tokens}],
    }
    return topology_from_dict(raw)


def _by_id(s: Summary) -> dict[int, Any]:
    return {r.id: r for r in s.records}


@pytest.mark.parametrize("gpu_sharing", ["chunked", "lanes"])
def test_a_prompt_waits_until_the_running_answer_leaves_room(gpu_sharing: str) -> None:
    """4,096 tokens of VRAM (256 blocks). Request 0 holds 128 prompt blocks and reserves 125 for
    its 2,000-token answer; request 1 (another 2,048-token prompt) needs 129 more, so its prefill
    starts only when request 0's answer is done. Unbounded, it starts at once."""
    topo = _one_worker(4096)
    reqs = [chain_request(0, 0.0, "a", 1, 2048, output=2000), chain_request(1, 1.0, "a", 2, 2048, output=16)]
    shared = simulate(topo, reqs, "oracle", gpu_sharing=gpu_sharing)  # type: ignore[arg-type]
    unbounded = simulate(topo, reqs, "oracle", gpu_sharing=gpu_sharing, kv_pool="unbounded")  # type: ignore[arg-type]
    s, u = _by_id(shared), _by_id(unbounded)
    assert shared.kv_waits == 1 and unbounded.kv_waits == 0
    # Request 1 waited for request 0's last token (which, sharing the GPU with nobody, came no
    # later than beside request 1's prefill).
    assert s[0].e2e_ms <= u[0].e2e_ms
    done_0 = s[0].e2e_ms - 1.0  # request 0 finished at the worker one way (1 ms) before its client had it
    assert s[1].queue_ms == pytest.approx(done_0 - 1.0 - 1.0)  # it reached the worker at 1 + 1 ms
    assert u[1].queue_ms < 0.5 * s[1].queue_ms


def test_sequences_sharing_a_prompt_hold_its_blocks_once() -> None:
    """Two requests with the same 2,048-token prompt and 900-token answers: 128 shared blocks +
    2 x 57 reserved = 242 of 256 fit together; with distinct prompts (128 + 128 + 114) they do
    not, and the second waits."""
    topo = _one_worker(4096)
    same = [chain_request(0, 0.0, "a", 1, 2048, output=900), chain_request(1, 300.0, "a", 1, 2048, output=900)]
    other = [same[0], chain_request(1, 300.0, "a", 2, 2048, output=900)]
    assert simulate(topo, same, "oracle").kv_waits == 0
    assert simulate(topo, other, "oracle").kv_waits == 1


def test_the_cache_keeps_what_the_reservations_leave() -> None:
    """Request 0 leaves a 2,048-token prefix cached (128 of 256 blocks). Request 1's 3,000-token
    answer reserves 188 blocks, so the cache keeps 68 and demotes the rest of that prefix to
    DRAM; request 2, the first prompt again after request 1 is done, finds most of it in DRAM.
    Unbounded, the prefix stays in VRAM."""
    topo = _one_worker(4096, dram_tokens=8192)
    reqs = [chain_request(0, 0.0, "a", 1, 2048), chain_request(1, 500.0, "a", 2, 1024, output=3000), chain_request(2, 60_000.0, "a", 1, 2048)]
    shared, unbounded = simulate(topo, reqs, "oracle"), simulate(topo, reqs, "oracle", kv_pool="unbounded")
    assert unbounded.demoted_blocks == 0 and _by_id(unbounded)[2].vram_hit == 2048 - 16  # all but the last block: vLLM recomputes it
    assert shared.demoted_blocks >= 128 - 68
    r2 = _by_id(shared)[2]
    assert r2.vram_hit + r2.dram_hit == 2048 - 16 and r2.dram_hit >= (128 - 68 - 1) * 16  # the last block is recomputed


def test_a_prompt_larger_than_the_pool_runs_alone() -> None:
    """A prompt past the pool cannot wait for room that never comes: it starts when nothing
    runs (as an engine sized for its context runs it), and a small prompt behind it waits."""
    topo = _one_worker(1024)
    reqs = [chain_request(0, 0.0, "a", 1, 2048, output=50), chain_request(1, 1.0, "a", 2, 64, output=2)]
    s = simulate(topo, reqs, "oracle")
    assert s.requests == 2 and s.kv_waits == 1
    r = _by_id(s)
    assert r[1].queue_ms >= r[0].e2e_ms - 4.0


def test_the_pool_is_named_in_the_config_and_the_json_line() -> None:
    with pytest.raises(InvalidArgumentError, match="kv_pool must be one of shared, unbounded, got 'none'"):
        SimConfig(kv_pool="none")  # type: ignore[arg-type]
    assert SimConfig().kv_pool == "shared"
    from kvcompass.sim.report import summary_row

    sim = Simulator(_one_worker(4096), [chain_request(0, 0.0, "a", 1, 2048, output=2000), chain_request(1, 1.0, "a", 2, 2048)], "oracle")
    assert summary_row(sim.run())["kv_waits"] == 1


def _disaggregated(decode_vram_tokens: int, prefill_vram_tokens: int = 65536) -> Topology:
    raw: dict[str, Any] = {
        "name": "pd",
        "rtt_ms": {"a": {"a": 2.0}},
        "regions": {"a": {}},
        "workers": [
            {"id": "p0", "region": "a", "role": "prefill", "beta_ms_per_token": 0.085, "vram_tokens": prefill_vram_tokens, "dram_tokens": 0},
            {"id": "d0", "region": "a", "role": "decode", "beta_ms_per_token": 0.085, "vram_tokens": decode_vram_tokens, "dram_tokens": 0},
        ],
    }
    return topology_from_dict(raw)


def test_a_decode_instance_admits_a_handed_off_sequence_when_its_kv_fits() -> None:
    """Disaggregated: the decode instance has 4,096 tokens of VRAM (256 blocks). Request 0's
    sequence holds its 128 prompt blocks and 125 for its 2,000-token answer; request 1's
    (another 2,048-token prompt, 16-token answer) needs 129, so it starts decoding only when
    request 0's answer is done. Unbounded, it joins the batch on arrival. The prefill instance
    is not bounded by the decode side, so the first tokens come at the same times."""
    reqs = [chain_request(0, 0.0, "a", 1, 2048, output=2000), chain_request(1, 1.0, "a", 2, 2048, output=16)]
    shared = simulate(_disaggregated(4096), reqs, "oracle")
    unbounded = simulate(_disaggregated(4096), reqs, "oracle", kv_pool="unbounded")
    s, u = _by_id(shared), _by_id(unbounded)
    assert shared.kv_waits == 1 and unbounded.kv_waits == 0
    assert [s[i].ttft_ms for i in (0, 1)] == pytest.approx([u[i].ttft_ms for i in (0, 1)])
    assert s[1].e2e_ms > s[0].e2e_ms > 10 * u[1].e2e_ms  # request 1 decoded after request 0's last token
    # A larger pool holds both at once.
    assert simulate(_disaggregated(8192), reqs, "oracle").kv_waits == 0


def test_a_sequence_queued_behind_a_held_one_waits_and_is_counted() -> None:
    """Request 2's 3 blocks would fit beside request 0 (253 of 256 taken), but request 1 waits
    ahead of it for room: hand-offs are admitted in order, so request 2 waits too, and counts
    as held back (found in review: only a queue's head was counted)."""
    reqs = [chain_request(0, 0.0, "a", 1, 2048, output=2000), chain_request(1, 1.0, "a", 2, 2048, output=16), chain_request(2, 300.0, "a", 3, 32, output=2)]
    s = simulate(_disaggregated(4096), reqs, "oracle")
    r = _by_id(s)
    assert s.kv_waits == 2
    assert r[2].arrival_ms + r[2].e2e_ms >= r[0].arrival_ms + r[0].e2e_ms


def test_a_handed_off_sequence_larger_than_the_decode_pool_runs_alone() -> None:
    """A sequence past the decode instance's pool decodes when nothing else is held there,
    and a sequence handed in while it decodes waits for it, however small."""
    reqs = [chain_request(0, 0.0, "a", 1, 2048, output=100), chain_request(1, 300.0, "a", 2, 64, output=2)]
    s = simulate(_disaggregated(1024), reqs, "oracle")
    assert s.requests == 2 and s.kv_waits == 1
    r = _by_id(s)
    assert r[1].arrival_ms + r[1].e2e_ms >= r[0].arrival_ms + r[0].e2e_ms  # done after request 0
    assert simulate(_disaggregated(1024), reqs, "oracle", kv_pool="unbounded").kv_waits == 0


def test_a_saturated_decode_instance_pushes_back_on_the_prefills() -> None:
    """Prefill and decode instances of 4,096 tokens (256 blocks). Request 1 waits for request
    0's long answer to leave the decode instance, its prompt's 128 blocks still in the prefill
    instance's pool (the decode side pulls KV only into room it has); request 2's 129-block
    prompt then does not fit beside them, so its prefill starts only once request 1 has moved
    on, after request 0's last token. Unbounded, request 2 is served at once."""

    pd = _disaggregated(4096, 4096)
    reqs = [chain_request(0, 0.0, "a", 1, 2048, output=2000), chain_request(1, 1.0, "a", 2, 2048, output=16), chain_request(2, 2.0, "a", 3, 2064, output=2)]
    shared, unbounded = simulate(pd, reqs, "oracle"), simulate(pd, reqs, "oracle", kv_pool="unbounded")
    s, u = _by_id(shared), _by_id(unbounded)
    assert shared.kv_waits == 2 and unbounded.kv_waits == 0
    done_0 = s[0].arrival_ms + s[0].e2e_ms - 1.0  # request 0's last token at the decode instance
    assert s[2].arrival_ms + 1.0 + s[2].queue_ms >= done_0  # request 2's prefill began after it
    assert u[2].ttft_ms < 1000.0 < done_0 - 5000.0


def test_a_prefill_instance_holds_the_kv_through_its_transfer() -> None:
    """A prefill instance of 4,096 tokens (256 blocks) and a 1 Gbit/s hand-off (about 2 s for
    request 0's 2,048 tokens): request 1's 129-block prompt fits only once request 0's KV has
    left, at the end of its transfer (the decode side reads it until then), not at its start."""
    reqs = [chain_request(0, 0.0, "a", 1, 2048, output=2), chain_request(1, 1.0, "a", 2, 2064, output=2)]
    shared = Simulator(_disaggregated(65536, 4096), reqs, "oracle", SimConfig(transfer_gbps=1.0)).run()
    unbounded = Simulator(_disaggregated(65536, 4096), reqs, "oracle", SimConfig(transfer_gbps=1.0, kv_pool="unbounded")).run()
    s, u = _by_id(shared), _by_id(unbounded)
    transfer = s[0].e2e_ms - s[0].ttft_ms  # its hand-off, then one decode step and the way back
    assert transfer > 2000.0 and shared.kv_waits == 1
    assert s[1].queue_ms >= s[0].ttft_ms - 2.0 + transfer - 200.0
    assert u[1].queue_ms < 200.0
