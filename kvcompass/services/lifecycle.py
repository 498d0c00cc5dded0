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
* **gRPC servers** drain the same way (:class:`DrainingServer`): stop listening, then close the
  accepted connections so clients notice and reconnect (to a successor on the same port).
* **Outbound channels** a service opens from addresses are its own to close; channels handed to
  it are the caller's (:class:`OwnedChannels`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import ssl
import sys
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, AsyncIterator

from grpclib.client import Channel
from grpclib.const import Status
from grpclib.events import SendTrailingMetadata, listen
from grpclib.protocol import H2Protocol
from grpclib.server import Server

from kvcompass.services.codec import StrictProtoCodec, install_receive_limit
from kvcompass.services.metrics import ServiceMetrics, bind_socket
from kvcompass.services.tls import grpc_channel

__all__ = [
    "PARENT_ENV",
    "DrainingServer",
    "OwnedChannels",
    "announce",
    "env_for_child",
    "hostport",
    "on_signals",
    "stop_on_signals",
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


class DrainingServer(Server):
    """A grpclib Server that can also close its accepted connections.

    ``Server.close`` stops listening and cancels handlers but leaves established HTTP/2
    connections open, and they keep accepting new streams; a client would then never notice
    the drain (nor reach a successor on the same port). :meth:`shut` closes them too, so every
    client sees the connection drop and reconnects. Malformed request bytes are
    INVALID_ARGUMENT, never UNKNOWN, and a message larger than its type's limit is
    RESOURCE_EXHAUSTED before it is read (:mod:`kvcompass.services.codec`).
    """

    def __init__(self, handlers: Sequence[Any], metrics: ServiceMetrics | None = None, limits: Mapping[type, int] | None = None) -> None:
        install_receive_limit()
        super().__init__(handlers, codec=StrictProtoCodec(limits))
        self._protocols: weakref.WeakSet[H2Protocol] = weakref.WeakSet()
        if metrics is not None:
            m = metrics

            async def count(ev: SendTrailingMetadata) -> None:
                if ev.status is not Status.OK:
                    m.rpc_error(ev.status.name)

            listen(self, SendTrailingMetadata, count)

    @classmethod
    async def listen(
        cls, handlers: Sequence[Any], host: str, port: int, *, metrics: ServiceMetrics | None = None, limits: Mapping[type, int] | None = None, ssl_context: ssl.SSLContext | None = None
    ) -> tuple[DrainingServer, str]:
        """A server for ``handlers`` listening on ``host:port`` (0: a free port; over TLS with
        ``ssl_context``), and the ``host:port`` it bound."""
        sock = bind_socket(host, port)
        bound = int(sock.getsockname()[1])
        server = cls(handlers, metrics, limits)
        try:
            await server.start(sock=sock, ssl=ssl_context)
        except BaseException:
            sock.close()
            raise
        return server, hostport(host, bound)

    def _protocol_factory(self) -> H2Protocol:
        proto = super()._protocol_factory()
        self._protocols.add(proto)
        return proto

    def close_connections(self) -> None:
        for proto in list(self._protocols):
            processor = getattr(proto, "processor", None)  # absent until the connection is made
            if processor is not None:
                processor.close("server shut down")

    async def shut(self) -> None:
        """Stop listening, close every accepted connection, and wait until all are gone."""
        self.close()
        self.close_connections()
        await self.wait_closed()


class OwnedChannels:
    """gRPC channels by key: a ``host:port`` target is opened here (over TLS with
    ``ssl_context``) and closed by :meth:`close`; a :class:`Channel` given instead (tests, an
    in-process server) is the caller's and left open."""

    def __init__(self, ssl_context: ssl.SSLContext | None = None) -> None:
        self._ssl = ssl_context
        self._owned: list[Channel] = []

    def get(self, target: str | Channel) -> Channel:
        if not isinstance(target, str):
            return target
        ch = grpc_channel(target, self._ssl)
        self._owned.append(ch)
        return ch

    def close(self) -> None:
        for ch in self._owned:
            ch.close()
        self._owned.clear()
