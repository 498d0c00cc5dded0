"""The runs a comparison is made of, one per (rate, scheme) "cell", in this process or side by side
in worker processes.

Each cell is a whole :func:`~kvcompass.sim.engine.simulate` call and shares nothing with the
others (every run builds its own plane, caches and agents from the same requests), so cells
parallelise perfectly across cores; one run stays single-threaded (its event order is the
result). Results are identical either way: a run depends only on its inputs and seed, never on
the process it ran in (a test compares a two-process comparison with a serial one), and they
come back in the order the cells were listed whatever order they finish in.

Workers are started with the ``spawn`` method (a forked child of a process that has started
polars' or BLAS's threads can deadlock); each receives the topology and the workloads once,
at start, and then only (rate, scheme) pairs.

A grid that outgrows one machine runs on Ray (``ray="local"`` or a cluster's address; the
optional extra ``kvcompass[ray]``): each cell is one Ray task running the same
:func:`~kvcompass.sim.engine.simulate` call, the topology and each rate's workload put into
Ray's object store once, so the results are those of a serial run. Every node of a cluster
needs this package installed (a Ray runtime environment can ship it).
"""

from __future__ import annotations

import ctypes
import gc
import multiprocessing
import time
from functools import partial
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from typing import Any

from kvcompass.discovery.topology import Topology
from kvcompass.errors import InvalidArgumentError
from kvcompass.sim.engine import simulate
from kvcompass.sim.summary import Summary
from kvcompass.sim.requests import Request, RequestTable

__all__ = ["Cell", "run_cells"]

Cell = tuple[str, str]
"""``(rate, scheme)``: the rate as the user wrote it (a key of the workloads) and a scheme name."""

OnStart = Callable[[int, int, str, str, int], None]
"""``(k, total, scheme, rate, requests)``: cell k of total is starting."""
OnDone = Callable[[int, int, str, str, int, float], None]
"""``(k, total, scheme, rate, requests, wall_s)``: cell k of total finished in wall_s seconds."""
OnProgress = Callable[[int, int, str, str, int, int], None]
"""``(k, total, scheme, rate, done, requests)``: cell k has completed ``done`` of its requests."""

_worker: dict[str, Any] = {}


def _init(topology: Topology, workloads: Mapping[str, Sequence[Request]], options: Mapping[str, Any]) -> None:
    _worker.update(topology=topology, workloads=workloads, options=dict(options))


def _run(rate: str, scheme: str, progress: Callable[[int, int], None] | None = None) -> tuple[Summary, float]:
    return _cell(_worker["topology"], _worker["workloads"][rate], _worker["options"], scheme, progress)


def run_cells(
    topology: Topology,
    workloads: Mapping[str, Sequence[Request]],
    cells: Sequence[Cell],
    options: Mapping[str, Any],
    *,
    jobs: int = 1,
    on_start: OnStart | None = None,
    on_done: OnDone | None = None,
    on_progress: OnProgress | None = None,
    ray: str | None = None,
) -> dict[str, dict[str, Summary]]:
    """Run every cell (``simulate(topology, workloads[rate], scheme, **options)``) on up to
    ``jobs`` processes (1: here, in order); returns ``{scheme: {rate: Summary}}`` in the order of
    ``cells``. ``on_start``/``on_done`` report progress (with ``jobs > 1`` a cell is reported
    when it finishes, in the order cells finish), ``on_progress`` how far the running cell has
    got (serial runs only). ``ray``: run the cells as Ray tasks instead (``"local"`` starts a
    Ray instance on this machine for the call; an address joins that cluster); ``jobs`` is then
    unused."""
    if type(jobs) is not int or jobs < 1:
        raise ValueError(f"jobs must be an int >= 1, got {jobs!r}")
    for rate, _ in cells:
        if rate not in workloads:
            raise KeyError(f"no workload for rate {rate!r}")
    total = len(cells)
    done: dict[Cell, Summary] = {}
    if ray is not None:
        _run_on_ray(ray, topology, workloads, cells, options, done, on_done)
    elif jobs == 1 or total <= 1:
        _init(topology, workloads, options)
        try:
            for k, (rate, scheme) in enumerate(cells, 1):
                if on_start is not None:
                    on_start(k, total, scheme, rate, len(workloads[rate]))
                tick = None if on_progress is None else partial(on_progress, k, total, scheme, rate)
                done[(rate, scheme)], wall = _run(rate, scheme, tick)
                if on_done is not None:
                    on_done(k, total, scheme, rate, len(workloads[rate]), wall)
        finally:
            _worker.clear()
    else:
        ctx = multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(max_workers=min(jobs, total), mp_context=ctx, initializer=_init, initargs=(topology, workloads, options)) as pool:
            pending: dict[Future[tuple[Summary, float]], Cell] = {pool.submit(_run, rate, scheme): (rate, scheme) for rate, scheme in cells}
            k = 0
            try:
                while pending:
                    finished, _ = wait(pending, return_when=FIRST_COMPLETED)
                    for f in finished:
                        rate, scheme = pending.pop(f)
                        done[(rate, scheme)], wall = f.result()  # a run's error is raised here
                        k += 1
                        if on_done is not None:
                            on_done(k, total, scheme, rate, len(workloads[rate]), wall)
            except BaseException:
                for f in pending:
                    f.cancel()
                raise
    results: dict[str, dict[str, Summary]] = {}
    for rate, scheme in cells:
        results.setdefault(scheme, {})[rate] = done[(rate, scheme)]
    return results


def _cell(topology: Topology, requests: Sequence[Request], options: Mapping[str, Any], scheme: str, progress: Callable[[int, int], None] | None = None) -> tuple[Summary, float]:
    """One cell's run and its wall time, wherever it runs (here, a worker process, a Ray task)."""
    t0 = time.perf_counter()
    try:
        s = simulate(topology, requests, scheme, progress=progress, **options)
    finally:
        _give_back_memory()
    return s, time.perf_counter() - t0


def _give_back_memory() -> None:
    """Return a finished run's freed memory to the system before the next run in this process.

    A paper-scale run peaks at several GiB (caches, agents' forests, queued prompts), and glibc's
    allocator keeps most of what it frees for reuse; a worker that ran a few such cells held
    their leftovers on top of the next run's peak (one was killed out of memory at 13 GiB in a
    figure-16 grid whose runs each peak under 5 GiB). ``malloc_trim`` hands the free pages back,
    so a process holds at most one run's peak. Elsewhere than glibc this is a no-op."""
    gc.collect()
    try:
        libc = ctypes.CDLL(None)
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return
    trim.argtypes = [ctypes.c_size_t]
    trim(0)


def _run_on_ray(
    address: str,
    topology: Topology,
    workloads: Mapping[str, Sequence[Request]],
    cells: Sequence[Cell],
    options: Mapping[str, Any],
    done: dict[Cell, Summary],
    on_done: OnDone | None,
) -> None:
    try:
        import ray
    except ImportError:
        raise InvalidArgumentError("running on Ray needs Ray, which is not installed: pip install 'kvcompass[ray]'") from None
    started = False
    if not ray.is_initialized():
        # A local instance is this call's own and goes when it ends; a cluster is joined.
        kw: dict[str, Any] = {"include_dashboard": False, "log_to_driver": False, "configure_logging": False}
        ray.init(address=None if address == "local" else address, **kw)
        started = True
    try:
        cell = ray.remote(_cell)
        topo_ref = ray.put(topology)
        refs = {rate: ray.put(RequestTable.from_requests(workloads[rate])) for rate in {r for r, _ in cells}}  # columns pickle compactly
        opts = dict(options)
        pending = {cell.remote(topo_ref, refs[rate], opts, scheme): (rate, scheme) for rate, scheme in cells}
        k, total = 0, len(cells)
        try:
            while pending:
                ready, _ = ray.wait(list(pending), num_returns=1)
                for ref in ready:
                    rate, scheme = pending.pop(ref)
                    done[(rate, scheme)], wall = ray.get(ref)  # a run's error is raised here
                    k += 1
                    if on_done is not None:
                        on_done(k, total, scheme, rate, len(workloads[rate]), wall)
        except BaseException:
            for ref in pending:
                ray.cancel(ref)
            raise
    finally:
        if started:
            ray.shutdown()
