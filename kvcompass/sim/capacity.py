"""A workload's no-reuse capacity on a topology: the offered rate that saturates the fleet when
no prompt token is ever reused, under the engine's own step model.

Why: a rate in req/s means nothing across topologies and workloads (150 req/s is 0.8 of
paper-64x8's capacity on the Mixed-like workload, a tenth of it on short chat prompts). Loads
are stated against this figure (``kvcompass simulate --load 0.9``), so "90 % load" means the
same thing on every workload, and reuse is what lets a scheme go beyond 1.0.

The model (the forms are :meth:`kvcompass._core.cost_saturated_ms`, beside the step rule they
derive from): a saturated worker always has a prompt waiting, so with chunked sharing every
step is a mixed one, and a request costs its prefill plus its share of the steps' decode work;
with lanes it costs the larger of its prefill and its decode (the lanes overlap). The mean is
over the workload's prompts, each worker at its own ``beta_ms_per_token``, and the fleet's
capacity is the sum of its workers' (perfect balance: no scheme can exceed it without reuse).
With prefill-decode disaggregation the prefill workers and the decode instances are two
stages paired by region (a region's prefill hands off to its own decode instances, or to the
nearest region's), and in each pair the smaller stage bounds. With the engine's shared KV pool (the default) a
worker's batch (a decode instance's too) is at most what its VRAM holds of prompts and reserved
answers, which binds when
answers are long beside the pool (``Cost::saturated_ms`` says how; with the Mixed workload it
lowers testbed-14x3's capacity by 13 % and paper-64x8's by 2.5 %).

What it leaves out, on purpose: reuse (that is what is being measured), WAN time (it delays
but does not consume GPU time) and migrations. The engine agrees with it to within a few per
cent on a workload without reuse, with short answers and with answers that fill the pool
(``tests/test_sim_capacity.py`` runs the Oracle past it).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np

from kvcompass import _core
from kvcompass.discovery.topology import Topology
from kvcompass.errors import InvalidArgumentError
from kvcompass.engine.cache import worker_capacities
from kvcompass.engine.costs import CostModel
from kvcompass.sim.engine import GPU_SHARING, KV_POOLS
from kvcompass.sim.workload import Request

__all__ = ["Capacity", "no_reuse_capacity", "rates_for_loads"]

Bound = Literal["workers", "prefill", "decode"]


@dataclass(frozen=True, slots=True)
class Capacity:
    """The fleet's no-reuse capacity for one workload."""

    req_per_s: float
    """The offered rate (req/s) at which the fleet is saturated without reuse."""
    per_worker: dict[str, float]
    """Each worker's share (req/s): its own capacity in its stage."""
    bound: Bound
    """What binds: ``workers`` (every worker prefills and decodes), or with disaggregation the
    ``prefill`` workers or the ``decode`` instances (the stage that bounds the larger part of
    the capacity, as the stages pair by region)."""
    mean_input_tokens: float
    mean_output_tokens: float
    gpu_sharing: str

    def as_dict(self) -> dict[str, object]:
        """For ``run.json`` and the JSON line."""
        return {
            "req_per_s": self.req_per_s,
            "bound": self.bound,
            "mean_input_tokens": self.mean_input_tokens,
            "mean_output_tokens": self.mean_output_tokens,
            "gpu_sharing": self.gpu_sharing,
            "per_worker": dict(self.per_worker),
        }


def no_reuse_capacity(
    topology: Topology,
    requests: Sequence[Request],
    *,
    cost: CostModel | None = None,
    gpu_sharing: str = "chunked",
    max_batched_tokens: int = 2048,
    kv_pool: str = "shared",
) -> Capacity:
    """The capacity of ``topology`` for ``requests`` (only their lengths matter) with the
    engine's step model: ``cost`` for decode, reload and fixed costs (default: the simulator's),
    each worker's prefill at its ``beta_ms_per_token``, and with ``kv_pool="shared"`` (the
    engine's default) each worker's batch bounded by its VRAM, as the engine's KV pool bounds
    it (a decode instance's too, which holds a sequence only while it decodes)."""
    if not requests:
        raise InvalidArgumentError("capacity of an empty workload: give at least one request")
    if gpu_sharing not in GPU_SHARING:
        raise InvalidArgumentError(f"gpu_sharing must be {' or '.join(GPU_SHARING)}, got {gpu_sharing!r}")
    if type(max_batched_tokens) is not int or max_batched_tokens < 1:
        raise InvalidArgumentError(f"max_batched_tokens must be an int >= 1, got {max_batched_tokens!r}")
    if kv_pool not in KV_POOLS:
        raise InvalidArgumentError(f"kv_pool must be {' or '.join(KV_POOLS)}, got {kv_pool!r}")
    base = cost or CostModel()
    inputs = np.fromiter((r.input_length for r in requests), dtype=np.uint64, count=len(requests))
    outputs = np.fromiter((r.output_length for r in requests), dtype=np.uint64, count=len(requests))
    terms: dict[tuple[float, int], tuple[float, float, float, float]] = {}  # by (beta, pool): workers mostly share one
    per_worker: dict[str, float] = {}
    # Per decode region (disaggregated): the prefill rate handed to it and its instances' rates.
    prefill_side: dict[str, float] = {}
    decode_rates: dict[str, list[float]] = {}
    split = topology.disaggregated
    for w in topology.workers:
        # The pool is the worker's VRAM as the engine sizes its cache (a topology may leave it out).
        # A prefill instance computes one prompt at a time and holds it until its decode
        # instance has room: the decode side's bound is the one that counts there.
        bounded = kv_pool == "shared" and (not split or w.role == "decode")
        pool = worker_capacities(w.vram_tokens, w.dram_tokens, topology.block_size)[0] if bounded else 0
        if (w.beta_ms_per_token, pool) not in terms:
            c = dataclasses.replace(base, prefill_ms_per_token=w.beta_ms_per_token)
            terms[w.beta_ms_per_token, pool] = _core.cost_saturated_ms(c.core_args, inputs, outputs, max_batched_tokens, pool)
        prefill, mixed, batched, handed = terms[w.beta_ms_per_token, pool]
        if split:
            # Disaggregated: a prefill worker hands every sequence off, a decode instance
            # only decodes (its batch grows with load up to what its pool holds, so its step
            # floor is shared by that batch).
            if w.role == "decode":
                r = 1000.0 / handed if handed > 0 else float("inf")
                decode_rates.setdefault(w.region, []).append(r)
            else:
                r = 1000.0 / prefill if prefill > 0 else float("inf")
                d = topology.decode_region(w.region)
                prefill_side[d] = prefill_side.get(d, 0.0) + r
        else:
            per_request = prefill + mixed if gpu_sharing == "chunked" else max(prefill, batched)
            r = 1000.0 / per_request if per_request > 0 else float("inf")
        per_worker[w.id] = r
    if split:
        # A region's prefill hands off to one region's decode instances (its own, or the
        # nearest's), so the two stages pair by decode region: no routing of the prompts can
        # make one region's decode instances serve another's hand-offs. The engine draws a
        # region's instance uniformly, so each takes an equal share and the slowest binds.
        decode_side = {d: len(rs) * min(rs) for d, rs in decode_rates.items()}
        by_prefill = sum(p for d, p in prefill_side.items() if p <= decode_side[d])
        by_decode = sum(decode_side[d] for d, p in prefill_side.items() if p > decode_side[d])
        bound: Bound = "prefill" if by_prefill >= by_decode else "decode"
        total = by_prefill + by_decode
    else:
        bound, total = "workers", sum(per_worker.values())
    if not np.isfinite(total):
        raise InvalidArgumentError("the workload costs no GPU time (every prompt empty and no output): it has no capacity to load against")
    return Capacity(
        req_per_s=float(total),
        per_worker=per_worker,
        bound=bound,
        mean_input_tokens=float(inputs.mean()),
        mean_output_tokens=float(outputs.mean()),
        gpu_sharing=gpu_sharing,
    )


def rates_for_loads(capacity: Capacity, loads: Sequence[float]) -> list[str]:
    """The offered rates (req/s, as result keys) for ``loads`` (fractions of ``capacity``):
    four significant figures, so a key reads as a rate and two loads never share one."""
    rates: list[str] = []
    for load in loads:
        if not load > 0:
            raise InvalidArgumentError(f"load must be > 0, got {load}")
        rates.append(np.format_float_positional(float(f"{capacity.req_per_s * load:.4g}"), trim="-"))
    if len(set(rates)) != len(rates):
        raise InvalidArgumentError(f"loads {list(loads)} give the same rate at four figures: use loads further apart")
    return rates
