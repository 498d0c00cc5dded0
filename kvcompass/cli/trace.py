"""``kvcompass trace from-log``: an operator's OpenAI request log as a simulator trace.

Why: the simulator tells an operator what KVCompass would gain on their fleet before they
deploy, and the answer depends on their traffic: which prompts share prefixes, how long the
answers are, where the requests enter. A gateway or logging proxy already records requests;
this turns such a log into the Mooncake-schema trace ``kvcompass simulate --trace`` reads. The
trace holds lengths and block hashes, not text, so it can leave the building where the log
cannot.

**The log.** JSON lines, one request each::

    {"time": 1765100000.25,                      # arrival, seconds (any epoch); required
     "request": {"model": "...", "messages": [...]},   # the OpenAI body; required
     "output_tokens": 212,                       # optional: tokens generated
     "response": {"usage": {"completion_tokens": 212}},  # optional: only usage is read
     "region": "us-east-1",                      # optional: where it entered the fleet
     "session": "conversation-42"}               # optional: a conversation's requests

A body with ``messages`` is a chat request, else a completions request (``prompt`` a string,
token ids, or a batch of either). Prompts are tokenized as the door tokenizes them
(:func:`kvcompass.services.openai_api.request_tokens`), by the built-in tokenizer unless
``--tokenizer`` names the model's ``tokenizer.json``: lengths under another tokenizer differ by
some percent, which shifts every scheme's figures alike. The output length is
``output_tokens``, else the response's ``usage.completion_tokens`` (over the request's
sequences: a batch of ``P`` prompts with ``n`` each is ``P * n`` sequences, each given an equal
share), else the body's ``max_completion_tokens`` or ``max_tokens`` (an upper bound: say so
when that is all the log has); a line with none of them is an error. ``n > 1`` is simulated as
one sequence a prompt (the simulator decodes one answer a request).

**The trace.** One row a prompt, in time order (lines of one time keep their order), times in
ms from the first request; ``hash_ids`` name the prompt's blocks as Mooncake's do
(:func:`kvcompass.sim.workload.stream_block_ids`), so requests share leading ids exactly as
far as they share leading full blocks. Rows of one ``session`` are chained: each names the
previous one as ``parent_chat_id``, so the simulator sends a follow-up after its parent's reply
and keeps it in its region. ``region`` is copied (the simulator checks it against the
topology); rows without one are placed by weight, as for any trace.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from kvcompass.errors import InvalidArgumentError
from kvcompass.services.openai_api import OpenAIError, prompt_batch, request_tokens
from kvcompass.sim.workload import MOONCAKE_BLOCK_SIZE, stream_block_ids

__all__ = ["DEFAULT_BLOCK_SIZE", "LogCounts", "LogRow", "add_parsers", "read_request_log", "trace_lines", "write_trace"]

_KEYS = ("time", "request", "output_tokens", "response", "region", "session")
_MAX_BATCH = 1 << 16  # prompts in one logged request (the door accepts far fewer)
DEFAULT_BLOCK_SIZE = 16
"""Tokens a trace hash id stands for by default: vLLM's KV block, the finest sharing an engine
sees (Mooncake's traces use 512, which hides sharing shorter than a block)."""


@dataclass(slots=True)
class LogRow:
    """One prompt of the log: what a trace row holds, before ids and links are numbered."""

    time_s: float
    line: int
    input_length: int
    output_length: int
    hash_ids: npt.NDArray[np.uint64]
    region: str | None = None
    session: str | None = None


@dataclass(slots=True)
class LogCounts:
    """What a read saw: logged requests, their prompts, outputs known only as an upper bound,
    the sessions named."""

    requests: int = 0
    prompts: int = 0
    from_bound: int = 0  # output lengths taken from max_tokens, an upper bound
    sessions: set[str] = field(default_factory=set)


def _error(path: Path, line: int, name: str | None, problem: str) -> InvalidArgumentError:
    where = f"{path}, line {line}" + (f", field {name!r}" if name else "")
    return InvalidArgumentError(f"{where}: {problem}", path=str(path), line=line, field=name)


def _count(v: object) -> bool:
    return type(v) is int and v >= 0


def _outputs(path: Path, line: int, obj: dict[str, Any], body: dict[str, Any], prompts: int, counts: LogCounts) -> int:
    """Tokens generated for each of the line's prompts (see the module doc for the order)."""
    if "output_tokens" in obj:
        v = obj["output_tokens"]
        if not _count(v):
            raise _error(path, line, "output_tokens", f"expected an integer >= 0, got {v!r}")
        return int(v)
    response = obj.get("response")
    if response is not None:
        usage = response.get("usage") if isinstance(response, dict) else None
        done = usage.get("completion_tokens") if isinstance(usage, dict) else None
        if done is not None:
            if not _count(done):
                raise _error(path, line, "response.usage.completion_tokens", f"expected an integer >= 0, got {done!r}")
            n = body.get("n", 1)
            seqs = prompts * (n if type(n) is int and n >= 1 else 1)
            return round(int(done) / seqs)
    for name in ("max_completion_tokens", "max_tokens"):
        v = body.get(name)
        if v is not None:
            if not _count(v):
                raise _error(path, line, f"request.{name}", f"expected an integer >= 0, got {v!r}")
            counts.from_bound += 1
            return int(v)
    raise _error(path, line, "output_tokens", "missing: give output_tokens, a response with usage.completion_tokens, or a request with max_tokens")


def read_request_log(path: str | Path, block_size: int = DEFAULT_BLOCK_SIZE, tokenizer: str | Path | None = None, counts: LogCounts | None = None) -> list[LogRow]:
    """The log's prompts in time order (see the module doc). Every malformed line is an
    :class:`~kvcompass.errors.InvalidArgumentError` naming the file, the line and the field."""
    from kvcompass.engine.tokenizer import load_tokenizer

    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise InvalidArgumentError(f"block_size must be an integer >= 1, got {block_size!r}")
    path = Path(path)
    tok = load_tokenizer(tokenizer)
    counts = counts if counts is not None else LogCounts()

    async def read() -> list[LogRow]:
        rows: list[LogRow] = []
        with path.open("rb") as f:
            for line, raw in enumerate(f, 1):
                if raw.strip():
                    rows += await _line(path, line, raw)
        return rows

    async def _line(path: Path, line: int, raw: bytes) -> list[LogRow]:
        try:
            obj = json.loads(raw)
        except UnicodeDecodeError as e:
            raise _error(path, line, None, f"not UTF-8 ({e.reason})") from None
        except json.JSONDecodeError as e:
            raise _error(path, line, None, f"not valid JSON ({e.msg} at column {e.colno})") from None
        if type(obj) is not dict:
            raise _error(path, line, None, f"expected a JSON object, got {type(obj).__name__}")
        unknown = [k for k in obj if k not in _KEYS]
        if unknown:
            raise _error(path, line, unknown[0], f"unknown key (accepted: {', '.join(_KEYS)})")
        raw_t: object = obj.get("time")
        try:
            t = float(raw_t) if isinstance(raw_t, (int, float)) and not isinstance(raw_t, bool) else math.nan
        except OverflowError:  # an integer beyond float range
            t = math.nan
        if not (math.isfinite(t) and t >= 0):
            raise _error(path, line, "time", f"expected the arrival time in seconds (a number >= 0), got {raw_t!r}")
        body = obj.get("request")
        if type(body) is not dict:
            raise _error(path, line, "request", f"expected the request's JSON body (an object), got {type(body).__name__}")
        region = obj.get("region")
        if region is not None and (type(region) is not str or not region):
            raise _error(path, line, "region", f"expected a region name, got {region!r}")
        session = obj.get("session")
        if session is not None:
            if type(session) not in (str, int):
                raise _error(path, line, "session", f"expected a string or an integer, got {session!r}")
            session = str(session)
            counts.sessions.add(session)
        chat = "messages" in body
        try:
            batch = None if chat else prompt_batch(body, _MAX_BATCH)
            prompts = await request_tokens(body, tok.encode, tok.apply_chat_template, chat=chat, batch=batch, inline_chars=sys.maxsize)
        except OpenAIError as e:
            raise _error(path, line, f"request.{e.param}" if e.param else "request", e.message) from None
        out = _outputs(path, line, obj, body, len(prompts), counts)
        counts.requests += 1
        counts.prompts += len(prompts)
        return [LogRow(t, line, int(p.size), out, stream_block_ids(p, block_size), region, session) for p in prompts]

    rows = asyncio.run(read())
    if not rows:
        raise InvalidArgumentError(f"{path}: no requests in the log", path=str(path), line=0, field=None)
    rows.sort(key=lambda r: (r.time_s, r.line))  # stable: a batch's prompts keep their order
    return rows


def trace_lines(rows: list[LogRow]) -> Iterator[dict[str, Any]]:
    """The trace's JSON objects: times from the first request, sessions chained."""
    t0 = rows[0].time_s
    last: dict[str, int] = {}
    for i, r in enumerate(rows):
        obj: dict[str, Any] = {
            "timestamp": round((r.time_s - t0) * 1000.0, 3),
            "input_length": r.input_length,
            "output_length": r.output_length,
            "hash_ids": r.hash_ids.tolist(),
            "chat_id": i,
            "parent_chat_id": last.get(r.session, -1) if r.session is not None else -1,
        }
        if r.session is not None:
            last[r.session] = i
        if r.region is not None:
            obj["region"] = r.region
        yield obj


def write_trace(rows: list[LogRow], out: str | Path) -> None:
    """Write the trace (written beside and renamed into place: a reader never sees half)."""
    out = Path(out)
    tmp = out.with_name(out.name + ".part")
    with tmp.open("w", encoding="utf-8") as f:
        for obj in trace_lines(rows):
            f.write(json.dumps(obj, separators=(",", ":")))
            f.write("\n")
    tmp.replace(out)


def _from_log(args: argparse.Namespace) -> int:
    counts = LogCounts()
    rows = read_request_log(args.log, args.block_size, args.tokenizer, counts)
    write_trace(rows, args.out)
    regions: dict[str, int] = {}
    for r in rows:
        if r.region is not None:
            regions[r.region] = regions.get(r.region, 0) + 1
    span_s = rows[-1].time_s - rows[0].time_s
    print(
        f"{counts.requests} logged requests -> {len(rows)} trace rows over {span_s:.1f} s, {len(counts.sessions)} sessions; "
        f"simulate it with: kvcompass simulate --trace {args.out} --block-size {args.block_size} --topology YOURS --arrivals trace",
        file=sys.stderr,
    )
    if counts.from_bound:
        print(f"note: {counts.from_bound} requests gave only max_tokens, an upper bound, as their output length", file=sys.stderr)
    summary = {
        "out": str(args.out),
        "requests": counts.requests,
        "rows": len(rows),
        "sessions": len(counts.sessions),
        "regions": regions,
        "block_size": args.block_size,
        "span_s": round(span_s, 3),
        "mean_input_tokens": round(sum(r.input_length for r in rows) / len(rows), 1),
        "mean_output_tokens": round(sum(r.output_length for r in rows) / len(rows), 1),
        "outputs_from_max_tokens": counts.from_bound,
    }
    print(json.dumps(summary))
    return 0


def add_parsers(sub: Any) -> None:
    t = sub.add_parser("trace", help="make simulator traces: from-log turns an OpenAI request log into one")
    tsub = t.add_subparsers(dest="trace_command", required=True)
    f = tsub.add_parser(
        "from-log",
        help="an OpenAI request log (JSONL: time, request, output_tokens or response, region, session) as a Mooncake-schema trace",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    f.add_argument("log", type=Path, help="the request log, JSON lines")
    f.add_argument("--out", "-o", type=Path, required=True, help="the trace to write (JSONL)")
    f.add_argument("--block-size", type=int, default=DEFAULT_BLOCK_SIZE, metavar="TOKENS", help=f"tokens a hash id stands for (default {DEFAULT_BLOCK_SIZE}; simulate with the same --block-size; Mooncake's traces use {MOONCAKE_BLOCK_SIZE})")
    f.add_argument("--tokenizer", default=None, metavar="TOKENIZER_JSON", help="the model's tokenizer.json (default: the built-in tokenizer)")
    f.set_defaults(func=_from_log)
