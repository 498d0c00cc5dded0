"""Connection limits for an HTTP listener that faces clients: a cap on open connections per
client address, and a deadline for every request head.

Why: a server that bounds a request's size and how long its body may take still keeps a
connection that trickles its first request's headers (slowloris) open as long as bytes arrive,
and accepts any number of them from one address; 200 such connections held a door's file
descriptors and memory until the attacker stopped.

How: :class:`~kvcompass.services.http_server.HttpServer` applies a :class:`ConnGuard` as it
accepts and reads. A connection from an address already at its cap is answered ``503`` and
closed before the application sees it. The first head must be whole within
``header_timeout_s`` of the connection; on a kept-alive connection every later head within
``header_timeout_s`` of its first byte. An idle kept-alive connection (no bytes) is left to the
server's keep-alive limit, so a client's connection pool is not cut while it waits; a client
trickling its second head is, as its first would have been.
"""

from __future__ import annotations

from collections import Counter

__all__ = ["ConnGuard"]


class ConnGuard:
    """The limits and their counters (``refused``: connections over an address's cap;
    ``timed_out``: connections closed before a request head was whole; ``open``: connections
    by client address now)."""

    def __init__(self, max_per_address: int, header_timeout_s: float) -> None:
        if max_per_address < 1:
            raise ValueError(f"max_per_address must be >= 1, got {max_per_address}")
        if not header_timeout_s > 0:
            raise ValueError(f"header_timeout_s must be > 0, got {header_timeout_s}")
        self.max_per_address = max_per_address
        self.header_timeout_s = header_timeout_s
        self.open: Counter[str] = Counter()
        self.refused = 0
        self.timed_out = 0

    def admit(self, addr: str) -> bool:
        """Count a new connection from ``addr``; False (counted as refused) when the address
        already holds its cap."""
        if self.open[addr] >= self.max_per_address:
            self.refused += 1
            return False
        self.open[addr] += 1
        return True

    def release(self, addr: str) -> None:
        """An admitted connection from ``addr`` is gone."""
        self.open[addr] -= 1
        if self.open[addr] <= 0:
            del self.open[addr]
