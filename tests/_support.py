"""Plain helpers shared by the test modules (imported as ``_support``; not fixtures).

The wire-format helpers re-implement the documented batch framing (rust/patch.rs) so tests can
forge batches with a valid checksum around a chosen payload.
"""

from __future__ import annotations

import contextlib
import struct
import zlib
from collections.abc import AsyncIterator, Callable
from typing import Any

import numpy as np
import numpy.typing as npt

import kvcompass as kc
from kvcompass.sim.requests import ChainBlocks, Request
from kvcompass.sim.workload import MixedConfig

M64 = (1 << 64) - 1


# A Mixed workload of short prompts and outputs, so a few hundred requests run in a fraction of
# a second (the simulator's and the schemes' tests, the golden runs).
SMALL = MixedConfig(
    system_prompt=(32, 96),
    toolsets=4,
    tool_preamble=(200, 600),
    tool_calls_max=4,
    tool_query=(10, 50),
    tool_observation=(50.0, 10, 200),
    tool_output=(20.0, 4, 60),
    documents=8,
    document=(400, 1200),
    question=(10, 40),
    answer=(20.0, 4, 60),
    problems=20,
    problem=(100.0, 32, 400),
    instruction=(10, 40),
    code=(30.0, 4, 80),
)


def chain_request(i: int, arrival_ms: float, region: str, chain: int, length: int, output: int = 1) -> Request:
    """A root request of ``length`` tokens in 16-token blocks, one run of chain ``chain``."""
    blocks = ChainBlocks(((chain, -(-length // 16)),))
    return Request(i, arrival_ms, region, 0, "public", length, output, 16, i, -1, blocks)


def mix64(x: int) -> int:
    """SplitMix64's finaliser of ``x + golden``, written out: the reference the package's
    (Rust) mixing of token and synthetic block ids is checked against."""
    z = (x + 0x9E3779B97F4A7C15) & M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    return z ^ (z >> 31)


# "KVCP" | version u8 | flags u8 | reserved u16 | table u32 | shard u32 | epoch u64 | seq u64
#        | n_ops u32 | payload_len u32 | payload | crc32 u32
HEADER_LEN = 4 + 1 + 1 + 2 + 4 + 4 + 8 + 8 + 4 + 4
TAG_SET_VALUE = 1
TAG_SNAPSHOT = 6


def frame(table: int, shard: int, epoch: int, seq: int, n_ops: int, payload: bytes, *, version: int | None = None, flags: int = 0) -> bytes:
    """Encode a batch around ``payload`` exactly as the writer frames it (CRC-32 over the rest)."""
    v = kc.PATCH_VERSION if version is None else version
    body = b"KVCP" + struct.pack("<BBHIIQQII", v, flags, 0, table, shard, epoch, seq, n_ops, len(payload)) + payload
    return body + struct.pack("<I", zlib.crc32(body))


def split(batch: bytes) -> tuple[dict[str, int], bytes]:
    """(header fields, payload) of a well-formed batch, decoded independently of the library."""
    _, _, _, _, table, shard, epoch, seq, n_ops, plen = struct.unpack_from("<4sBBHIIQQII", batch)
    return {"table": table, "shard": shard, "epoch": epoch, "seq": seq, "n_ops": n_ops}, batch[HEADER_LEN : HEADER_LEN + plen]


def reframe(batch: bytes, payload: bytes) -> bytes:
    """The same header around a different payload, with a correct length and checksum."""
    h, _ = split(batch)
    return frame(h["table"], h["shard"], h["epoch"], h["seq"], h["n_ops"], payload)


def snapshot_frame(state: bytes, *, table: int = 0, shard: int = 0, epoch: int = 1, seq: int = 0) -> bytes:
    """A snapshot batch carrying ``state`` (the bytes of ``LudoView.state_bytes``)."""
    return frame(table, shard, epoch, seq, 1, bytes([TAG_SNAPSHOT]) + struct.pack("<Q", len(state)) + state)


def unique_keys(seed: int, n: int) -> npt.NDArray[np.uint64]:
    """``n`` distinct, nonzero 63-bit keys, deterministic in ``seed``."""
    rng = np.random.default_rng(seed)
    out = np.unique(rng.integers(1, 2**63, size=n + n // 8 + 16, dtype=np.uint64))
    rng.shuffle(out)
    assert len(out) >= n
    return np.ascontiguousarray(out[:n])


def follower(t: kc.LudoTable) -> kc.LudoView:
    """An edge view of ``t`` started from its snapshot (``t`` must have nothing pending)."""
    v = kc.LudoView(t.table, t.shard)
    r = v.apply_batch(t.export_snapshot())
    assert r.snapshot
    return v


def flush(t: kc.LudoTable, *views: kc.LudoView) -> bytes | None:
    """Take the table's next batch (if any) and apply it to every view."""
    b = t.take_batch()
    if b is not None:
        for v in views:
            v.apply_batch(b)
    return b


def table_state(t: kc.LudoTable) -> tuple[object, ...]:
    """Everything a rejected call must leave unchanged."""
    keys, values = t.entries()
    order = np.argsort(keys)
    return (
        t.digest(),
        t.view_state(),
        t.pending_ops,
        t.seq,
        t.epoch,
        len(t),
        t.capacity,
        t.rebuilds,
        tuple(keys[order].tolist()),
        tuple(values[order].tolist()),
    )


def view_state(v: kc.LudoView) -> tuple[object, ...]:
    return (v.digest(), v.state_bytes(), v.epoch, v.seq, v.initialised, v.fallback_len)


class ByteTokenizer:
    """One token per UTF-8 byte: deterministic, dependency-free, and enough to key prefixes (the
    doors' tokenizer in the service tests)."""

    def encode(self, text: str) -> npt.NDArray[np.uint32]:
        return np.frombuffer(text.encode(), dtype=np.uint8).astype(np.uint32)

    def encode_prompt(self, text: str, add_special_tokens: bool = True) -> npt.NDArray[np.uint32]:
        return self.encode(text)

    def apply_chat_template(self, messages: list[dict[str, Any]], tools: Any = None, options: Any = None) -> npt.NDArray[np.uint32]:
        return self.encode("".join(f"<{m['role']}>{m.get('content') or ''}\n" for m in messages) + "<assistant>")


@contextlib.asynccontextmanager
async def serve_app(app: Any) -> AsyncIterator[str]:
    """An aiohttp application served on a loopback port of its own for the block: its base URL."""
    from aiohttp import web

    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


async def wait_until(cond: Callable[[], bool], timeout: float = 5.0) -> None:
    """Wait until ``cond()`` holds, failing past ``timeout`` seconds: a bound for slow hosts,
    not a timing claim."""
    import asyncio

    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while not cond():
        assert loop.time() < end, "condition not reached"
        await asyncio.sleep(0.005)
