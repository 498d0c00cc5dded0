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
* **Event loop.** Every service runs its main coroutine through :func:`run`: uvloop's loop
  (libuv) where it is installed, whose timers, transports and callbacks cost less than the
  standard loop's (the front door's CPU per request was equal or lower with it in every
  interleaved pair measured, docs/services.md); ``KVCOMPASS_LOOP=asyncio`` keeps the standard
  loop.

This module imports nothing heavy, so a command that only needs its process plumbing starts fast.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, AsyncIterator, Self

__all__ = [
    "AsyncResource",
    "bind_socket",
    "PARENT_ENV",
    "announce",
    "env_for_child",
    "hostport",
    "on_signals",
    "run",
    "stop_on_signals",
    "stop_process",
    "stop_process_async",
]

PARENT_ENV = "KVCOMPASS_PARENT_PID"
"""The supervising parent's pid, watched by a child (see the module notes)."""

_STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)

LOOP_ENV = "KVCOMPASS_LOOP"
"""``asyncio`` runs the services on the standard event loop even where uvloop is installed."""


def loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop's loop constructor when uvloop is importable and not switched off, else None (the
    standard loop)."""
    if os.environ.get(LOOP_ENV, "").strip().lower() == "asyncio":
        return None
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


def run(main: Any) -> Any:
    """Run a service's main coroutine to completion on the loop :func:`loop_factory` names."""
    with asyncio.Runner(loop_factory=loop_factory()) as runner:
        return runner.run(main)


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


async def stop_process_async(proc: asyncio.subprocess.Process, grace_s: float) -> tuple[int, bool]:
    """:func:`stop_process` for an asyncio child: its exit code, and whether it had to be killed
    (it outlived its grace period)."""
    if proc.returncode is not None:
        return proc.returncode, False
    with contextlib.suppress(ProcessLookupError):
        proc.send_signal(signal.SIGTERM)
    try:
        return await asyncio.wait_for(proc.wait(), grace_s), False
    except TimeoutError:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        return await proc.wait(), True


class AsyncResource(abc.ABC):
    """A server or client used as ``async with``: entering runs :meth:`open` (nothing for the
    ones built already running), leaving runs :meth:`close`, written once for every service
    object instead of a pair of dunder methods on each. A class that does not say how it
    closes cannot be built."""

    async def open(self) -> None:
        return None

    @abc.abstractmethod
    async def close(self) -> None:
        """Release what the object holds (idempotent in every implementation here)."""

    async def __aenter__(self) -> Self:
        await self.open()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


def bind_socket(host: str, port: int, *, reuse_port: bool = False) -> socket.socket:
    """A listening TCP socket bound before the server starts, so port 0 yields a known port.

    ``reuse_port`` (Linux ``SO_REUSEPORT``): several processes bind the same port and the kernel
    spreads new connections among them, which is how one region's edge serves its door from more
    than one core (each process its own edge, with its own view replica)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuse_port:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
        sock.listen(128)
        sock.setblocking(False)
    except BaseException:
        sock.close()
        raise
    return sock

