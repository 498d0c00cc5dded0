"""How every KVCompass process starts, listens, stops and is supervised, written once.

Each long-running process (maintenance unit, edge, agent, emulated worker, ``kvcompass up``)
shares one lifecycle, so a supervisor can treat them alike:

* **Ready line.** Any port may be 0: the process binds a free one and says which in one JSON
  object on stdout, ``{"ready": ROLE, "pid": ..., ...endpoints}`` (:func:`announce`), printed once
  everything listens. Nothing else goes to stdout, so a parent reads one line per child and never
  races another process for a port it picked in advance.
* **Stopping.** SIGTERM or SIGINT sets the process's stop event (:func:`stop_on_signals`); it then
  drains and exits 0. With ``KVCOMPASS_PARENT_PID`` in its environment (:func:`env_for_child`) a
  child also stops when that parent is gone, so a supervisor killed with SIGKILL leaves no
  orphans behind.
* **gRPC servers and channels** drain and close the same way everywhere
  (:mod:`kvcompass.services.grpc_lifecycle`).

This module imports nothing heavy, so a command that only needs its process plumbing starts fast.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, AsyncIterator

__all__ = [
    "PARENT_ENV",
    "announce",
    "env_for_child",
    "hostport",
    "on_signals",
    "stop_on_signals",
    "stop_process",
]

PARENT_ENV = "KVCOMPASS_PARENT_PID"
"""The supervising parent's pid, watched by a child (see the module notes)."""

_STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def hostport(host: str, port: int) -> str:
    """``host:port``, with an IPv6 host in brackets."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def announce(role: str, **endpoints: Any) -> None:
    """The ready line (see the module notes): the one thing a process writes to stdout."""
    sys.stdout.write(json.dumps({"ready": role, "pid": os.getpid(), **endpoints}) + "\n")
    sys.stdout.flush()


def env_for_child(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment of a supervised child: this process as its parent to watch."""
    env = dict(os.environ)
    env[PARENT_ENV] = str(os.getpid())
    env.setdefault("PYTHONUNBUFFERED", "1")
    if extra:
        env.update(extra)
    return env


@contextlib.contextmanager
def on_signals(callback: Callable[[], None], signals: Sequence[signal.Signals] = _STOP_SIGNALS) -> Iterator[None]:
    """Call ``callback`` on each of ``signals`` while the block runs (on the running loop), and
    restore the defaults after. Where the loop cannot take signal handlers (not the main thread,
    or a platform without them) nothing is installed: the caller's other stop paths still work."""
    loop = asyncio.get_running_loop()
    installed: list[signal.Signals] = []
    for sig in signals:
        with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
            loop.add_signal_handler(sig, callback)
            installed.append(sig)
    try:
        yield
    finally:
        for sig in installed:
            loop.remove_signal_handler(sig)


@contextlib.asynccontextmanager
async def stop_on_signals(stop: asyncio.Event, *, watch_parent: bool = True) -> AsyncIterator[None]:
    """Set ``stop`` on SIGTERM/SIGINT and, with ``watch_parent``, when the supervising parent
    (``KVCOMPASS_PARENT_PID``) is gone: a reparented child would otherwise outlive a
    ``kvcompass up`` killed with SIGKILL."""
    watch: asyncio.Task[None] | None = None
    parent = os.environ.get(PARENT_ENV) if watch_parent else None
    with on_signals(stop.set):
        if parent and parent.isdigit():
            watch = asyncio.get_running_loop().create_task(_watch_parent(int(parent), stop))
        try:
            yield
        finally:
            if watch is not None:
                watch.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await watch


async def _watch_parent(pid: int, stop: asyncio.Event) -> None:
    while not stop.is_set():
        if os.getppid() != pid:
            stop.set()
            return
        await asyncio.sleep(0.5)


def stop_process(proc: subprocess.Popen[Any], grace_s: float) -> int:
    """Stop a child the way every process here expects: SIGTERM, up to ``grace_s`` for it to
    drain and exit, then SIGKILL. Its exit code (already exited: that code)."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            return proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
    return proc.wait()
