"""``kvcompass trace from-log``: an operator's OpenAI request log as a simulator trace.

Why: the simulator tells an operator what KVCompass would gain on their fleet before they
deploy, and the answer depends on their traffic: which prompts share prefixes, how long the
answers are, where the requests enter. A gateway or logging proxy already records requests;
this turns such a log into the Mooncake-schema trace ``kvcompass simulate --trace`` reads.

**The log.** JSON lines (strict JSON, as the door reads bodies), one request each::

    {"time": 1765100000.25,                      # arrival, seconds (any epoch); required
     "request": {"model": "...", "messages": [...]},   # the OpenAI body; required
     "output_tokens": 212,                       # optional: tokens the request generated
     "response": {"usage": {...}},               # optional: only usage is read
     "region": "us-east-1",                      # optional: where it entered the fleet
     "session": "conversation-42",               # optional: a conversation's requests
     "tenant": "acme"}                           # optional: whose cache it may share

A body with ``messages`` is a chat request, else a completions request (``prompt`` a string,
token ids, or a batch of either). Prompts are tokenized as the door tokenizes them
(:func:`kvcompass.services.openai_api.request_tokens`), by the built-in tokenizer unless
``--tokenizer`` names the model's ``tokenizer.json``: lengths under another tokenizer differ by
some percent (a logged ``usage.prompt_tokens`` measures by how much: the summary's
``tokens_vs_logged``); with the model's tokenizer its chat template renders the chat and its
``tools`` as the engine does (:mod:`kvcompass.engine.chat_template`), while the built-in
tokenizer's ChatML leaves ``tools`` out, as the door does with it; ``--chat-template`` is the
template the engine was started with (vLLM's ``--chat-template``), in place of the model's. The tokens the request generated are ``output_tokens``, else
the response's ``usage.completion_tokens``, shared by the request's sequences (a batch of
``P`` prompts with ``n`` each is ``P * n``; the rows add up to the total over ``n``); else the body's per-sequence
``max_completion_tokens`` or ``max_tokens`` (an upper bound, counted in the summary); a line
with none of them is an error. ``n > 1`` is simulated as one sequence a prompt.

**The trace.** One row a prompt, in time order (ties: shorter prompts first, so a
conversation's turns logged within one clock tick keep their order; then file order), times in
ms from the first request. ``hash_ids`` name the prompt's blocks as Mooncake's do
(:func:`kvcompass.sim.workload.stream_block_ids`), seeded by the export's secret and the
request's tenant and ``cache_salt``: requests of one tenant share leading ids exactly as far
as they share leading full blocks, two tenants never do (their engines keep their KV apart),
and without the secret (``--salt``, random unless given) no one can test a guessed prompt
against the trace. Prompts of one ``session`` are chained by request: each request's prompts
name the previous request's last prompt as ``parent_chat_id``, so the simulator sends a
follow-up after its parent's answer. ``region`` is copied (``--topology`` checks it and maps a
region's ``aws_region`` label to its name; ``simulate`` maps the labels too); rows without one take their root's or are placed
by weight, as for any trace. With ``--topology``, a prompt longer than its context window is
left out and counted: an engine refuses it without computing anything.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import math
import os
import secrets
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from kvcompass.discovery.topology import Topology, load_topology
from kvcompass.errors import InvalidArgumentError
from kvcompass.services.openai_api import OpenAIError, int_field, parse_json, prompt_batch, request_tokens
from kvcompass.sim.workload import MAX_TRACE_TOKENS, MOONCAKE_BLOCK_SIZE, json_number, line_error, region_labels, stream_block_ids

__all__ = ["DEFAULT_BLOCK_SIZE", "LogCounts", "LogRow", "add_parsers", "read_request_log", "trace_lines", "write_trace"]

_KEYS = ("time", "request", "output_tokens", "response", "region", "session", "tenant")
_MAX_BATCH = 1 << 16  # prompts in one logged request (the door accepts far fewer)
DEFAULT_BLOCK_SIZE = 16
"""Tokens a trace hash id stands for by default: vLLM's KV block, the finest sharing an engine
sees (Mooncake's traces use 512, which hides sharing shorter than a block)."""


@dataclass(slots=True)
class LogRow:
    """One prompt of the log: what a trace row holds, before rows are numbered and linked."""

    time_s: float
    line: int
    """The log line of its request (a batch's prompts share it)."""
    input_length: int
    output_length: int
    hash_ids: npt.NDArray[np.uint64]
    region: str | None = None
    session: str | None = None


@dataclass(slots=True)
class LogCounts:
    """What a read saw: logged requests and their prompts, outputs known only as an upper bound,
    prompts left out as longer than the context window (their log lines, the first ten), the
    sessions named, and the engine's own counts where the log has them."""

    requests: int = 0
    prompts: int = 0
    from_bound: int = 0
    over_context: int = 0
    over_context_lines: list[int] = field(default_factory=list)
    sessions: set[str] = field(default_factory=set)
    our_tokens: int = 0  # over the requests whose response logged usage.prompt_tokens
    logged_tokens: int = 0
    logged_cached: int = 0  # usage.prompt_tokens_details.cached_tokens, where logged


def _count(v: object) -> bool:
    return type(v) is int and 0 <= v <= MAX_TRACE_TOKENS


def _usage(obj: dict[str, Any]) -> dict[str, Any] | None:
    response = obj.get("response")
    usage = response.get("usage") if isinstance(response, dict) else None
    return usage if isinstance(usage, dict) else None


def _outputs(path: Path, line: int, obj: dict[str, Any], usage: dict[str, Any] | None, body: dict[str, Any], prompts: int, n: int, counts: LogCounts) -> list[int]:
    """Tokens generated for each of the line's ``prompts`` (each simulated as one sequence of
    its ``n``; see the module doc for the order). A logged total is split so the rows add up to
    it over ``n`` (found in review: 3 tokens over two prompts became 2 each)."""
    for name, total in (("output_tokens", obj.get("output_tokens")), ("response.usage.completion_tokens", usage.get("completion_tokens") if usage else None)):
        if total is not None:
            if not _count(total):
                raise line_error(path, line, name, f"expected an integer in [0, {MAX_TRACE_TOKENS}], got {total!r}")
            each, more = divmod(round(int(total) / n), prompts)
            return [each + (i < more) for i in range(prompts)]
    for name in ("max_completion_tokens", "max_tokens"):
        bound = body.get(name)
        if bound is not None:
            if not _count(bound):
                raise line_error(path, line, f"request.{name}", f"expected an integer in [0, {MAX_TRACE_TOKENS}], got {bound!r}")
            counts.from_bound += 1
            return [int(bound)] * prompts
    raise line_error(path, line, "output_tokens", "missing: give output_tokens, a response with usage.completion_tokens, or a request with max_tokens")


def _seed(salt: bytes, tenant: str | None, cache_salt: object) -> int:
    """The hash seed of a request's blocks: the export's secret, its tenant and its engine salt
    (``cache_salt``: vLLM keeps KV of different salts apart)."""
    h = hashlib.blake2b(salt, digest_size=8)
    for part in (tenant, cache_salt):
        h.update(b"\x00" if part is None else b"\x01" + str(part).encode() + b"\x00")
    return int.from_bytes(h.digest(), "little") >> 1


def read_request_log(
    path: str | Path,
    block_size: int = DEFAULT_BLOCK_SIZE,
    tokenizer: str | Path | None = None,
    counts: LogCounts | None = None,
    *,
    chat_template: str | None = None,
    salt: bytes | None = None,
    topology: Topology | None = None,
) -> list[LogRow]:
    """The log's prompts in time order (see the module doc). ``salt``: the export's secret (None:
    random); ``topology``: regions checked and mapped, over-long prompts left out;
    ``chat_template``: the engine's ``--chat-template`` (a file or the template). Every
    malformed line is an :class:`~kvcompass.errors.InvalidArgumentError` naming the file, the
    line and the field."""
    from kvcompass.engine.tokenizer import load_tokenizer

    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise InvalidArgumentError(f"block_size must be an integer >= 1, got {block_size!r}")
    path = Path(path)
    tok = load_tokenizer(tokenizer, chat_template)
    counts = counts if counts is not None else LogCounts()
    secret = secrets.token_bytes(16) if salt is None else salt
    names = region_labels(topology) if topology is not None else None

    async def one(line: int, raw: bytes) -> list[LogRow]:
        try:
            obj = parse_json(raw)
        except ValueError as e:
            raise line_error(path, line, None, f"not valid JSON ({e})") from None
        if type(obj) is not dict:
            raise line_error(path, line, None, f"expected a JSON object, got {type(obj).__name__}")
        unknown = [k for k in obj if k not in _KEYS]
        if unknown:
            raise line_error(path, line, unknown[0], f"unknown key (accepted: {', '.join(_KEYS)})")
        raw_t: object = obj.get("time")
        t = json_number(raw_t)
        if not (math.isfinite(t) and t >= 0):
            raise line_error(path, line, "time", f"expected the arrival time in seconds (a number >= 0), got {raw_t!r}")
        body = obj.get("request")
        if type(body) is not dict:
            raise line_error(path, line, "request", f"expected the request's JSON body (an object), got {type(body).__name__}")
        region = obj.get("region")
        if region is not None:
            if type(region) is not str or not region:
                raise line_error(path, line, "region", f"expected a region name, got {region!r}")
            if names is not None:
                if region not in names:
                    raise line_error(path, line, "region", f"{region!r} is neither a region of topology {topology.name!r} nor a region's aws_region (its regions: {', '.join(sorted(names))})")  # type: ignore[union-attr]
                region = names[region]
        session, tenant = obj.get("session"), obj.get("tenant")
        for name, v in (("session", session), ("tenant", tenant)):
            if v is not None and type(v) not in (str, int):
                raise line_error(path, line, name, f"expected a string or an integer, got {v!r}")
        if session is not None:
            session = str(session)
            counts.sessions.add(session)
        chat = "messages" in body
        try:
            batch = None if chat else prompt_batch(body, _MAX_BATCH)
            prompts = await request_tokens(body, tok.encode_prompt, tok.apply_chat_template, chat=chat, batch=batch, inline_chars=sys.maxsize)
            n = int_field(body, "n", 1, _MAX_BATCH) or 1
        except OpenAIError as e:
            raise line_error(path, line, f"request.{e.param}" if e.param else "request", e.message) from None
        usage = _usage(obj)
        outs = _outputs(path, line, obj, usage, body, len(prompts), n, counts)
        counts.requests += 1
        counts.prompts += len(prompts)
        logged = usage.get("prompt_tokens") if usage else None
        if _count(logged):
            counts.our_tokens += sum(p.size for p in prompts)
            counts.logged_tokens += int(logged)  # type: ignore[arg-type]
            details = usage.get("prompt_tokens_details") if usage else None
            cached = details.get("cached_tokens") if isinstance(details, dict) else None
            if cached is not None and (not _count(cached) or cached > logged):
                raise line_error(path, line, "response.usage.prompt_tokens_details.cached_tokens", f"expected an integer in [0, prompt_tokens = {logged}], got {cached!r}")
            counts.logged_cached += cached or 0
        seed = _seed(secret, None if tenant is None else str(tenant), body.get("cache_salt"))
        rows = []
        for p, out in zip(prompts, outs):
            if p.size > MAX_TRACE_TOKENS:
                raise line_error(path, line, "request", f"a prompt of {p.size} tokens; a trace holds at most {MAX_TRACE_TOKENS}")
            if topology is not None and p.size > topology.max_prefix:
                counts.over_context += 1
                if len(counts.over_context_lines) < 10:
                    counts.over_context_lines.append(line)
                continue
            rows.append(LogRow(t, line, int(p.size), out, stream_block_ids(p, block_size, seed), region, session))
        return rows

    async def read() -> list[LogRow]:
        rows: list[LogRow] = []
        with path.open("rb") as f:
            for line, raw in enumerate(f, 1):
                if raw.strip():
                    rows += await one(line, raw)
        return rows

    rows = asyncio.run(read())
    if not rows:
        raise InvalidArgumentError(f"{path}: no requests in the log" + (" within the topology's context window" if counts.prompts else ""), path=str(path), line=0, field=None)
    # Ties: a conversation's turns logged within one clock tick, shorter (earlier) first.
    rows.sort(key=lambda r: (r.time_s, r.input_length, r.line))
    return rows


def trace_lines(rows: list[LogRow]) -> Iterator[dict[str, Any]]:
    """The trace's JSON objects: times from the first request, a session's requests chained
    (every prompt of a request names the previous request's last prompt)."""
    t0 = rows[0].time_s
    last: dict[str, tuple[int, int]] = {}  # session -> (its latest request's line, that request's last row)
    parent_of: dict[tuple[str, int], int] = {}  # (session, request line) -> its parent row
    for i, r in enumerate(rows):
        parent = -1
        if r.session is not None:
            key = (r.session, r.line)
            if key not in parent_of:
                prev = last.get(r.session)
                parent_of[key] = prev[1] if prev is not None else -1
            parent = parent_of[key]
            last[r.session] = (r.line, i)
        obj: dict[str, Any] = {
            "timestamp": round((r.time_s - t0) * 1000.0, 3),
            "input_length": r.input_length,
            "output_length": r.output_length,
            "hash_ids": r.hash_ids.tolist(),
            "chat_id": i,
            "parent_chat_id": parent,
        }
        if r.region is not None:
            obj["region"] = r.region
        yield obj


def write_trace(rows: list[LogRow], out: str | Path) -> None:
    """Write the trace beside its final name and rename it into place, so a reader never sees
    half of one and a failed write leaves nothing behind."""
    out = Path(out)
    if out.is_dir():
        raise InvalidArgumentError(f"{out} is a directory; name the trace file to write")
    if not out.parent.is_dir():
        raise InvalidArgumentError(f"cannot write {out}: directory {out.parent} does not exist")
    fd, tmp = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".part", dir=out.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            for obj in trace_lines(rows):
                f.write(json.dumps(obj, separators=(",", ":")))
                f.write("\n")
        os.replace(tmp, out)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _from_log(args: argparse.Namespace) -> int:
    if args.out.exists() and args.log.exists() and args.out.resolve() == args.log.resolve():
        raise InvalidArgumentError(f"--out {args.out} is the log itself; name another file")
    counts = LogCounts()
    topology = load_topology(args.topology) if args.topology else None
    rows = read_request_log(args.log, args.block_size, args.tokenizer, counts, chat_template=args.chat_template, salt=args.salt.encode() if args.salt is not None else None, topology=topology)
    write_trace(rows, args.out)
    regions: dict[str, int] = {}
    for r in rows:
        if r.region is not None:
            regions[r.region] = regions.get(r.region, 0) + 1
    span_s = rows[-1].time_s - rows[0].time_s
    topo = args.topology or "YOURS"
    print(
        f"{counts.requests} logged requests -> {len(rows)} trace rows over {span_s:.1f} s, {len(counts.sessions)} sessions; "
        f"simulate it with: kvcompass simulate --trace {args.out} --block-size {args.block_size} --topology {topo} --arrivals trace",
        file=sys.stderr,
    )
    if counts.from_bound:
        print(f"note: {counts.from_bound} requests gave only max_tokens, an upper bound, as their output length", file=sys.stderr)
    if counts.over_context:
        print(f"note: {counts.over_context} prompts longer than the context window left out (log lines {', '.join(map(str, counts.over_context_lines))}{', ...' if counts.over_context > 10 else ''})", file=sys.stderr)
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
        "over_context": counts.over_context,
        # Our tokenizer's count over the engine's, and the engine's own cache hits: a check of
        # the lengths and today's reuse, beside what the simulator finds.
        "tokens_vs_logged": round(counts.our_tokens / counts.logged_tokens, 4) if counts.logged_tokens else None,
        "logged_hit_rate": round(counts.logged_cached / counts.logged_tokens, 4) if counts.logged_tokens else None,
    }
    print(json.dumps(summary))
    return 0


def add_parsers(sub: Any) -> None:
    t = sub.add_parser("trace", help="make simulator traces: from-log turns an OpenAI request log into one")
    tsub = t.add_subparsers(dest="trace_command", required=True)
    f = tsub.add_parser(
        "from-log",
        help="an OpenAI request log (JSONL: time, request, output_tokens or response, region, session, tenant) as a Mooncake-schema trace",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    f.add_argument("log", type=Path, help="the request log, JSON lines")
    f.add_argument("--out", "-o", type=Path, required=True, help="the trace to write (JSONL)")
    f.add_argument(
        "--block-size", type=int, default=DEFAULT_BLOCK_SIZE, metavar="TOKENS",
        help=f"tokens a hash id stands for (default {DEFAULT_BLOCK_SIZE}; simulate with the same --block-size; Mooncake's traces use {MOONCAKE_BLOCK_SIZE})",
    )
    f.add_argument("--tokenizer", default=None, metavar="TOKENIZER_JSON", help="the model's tokenizer.json (default: the built-in tokenizer)")
    f.add_argument(
        "--chat-template", default=None, metavar="FILE_OR_TEMPLATE",
        help="the chat template the engine was started with (vLLM's --chat-template: a file, or the template itself); needs --tokenizer (default: the templates beside it)",
    )
    f.add_argument("--topology", default=None, metavar="NAME_OR_PATH", help="check regions against it (a region's aws_region label names it too) and leave out prompts longer than its context window")
    f.add_argument("--salt", default=None, metavar="SECRET", help="the secret the block hashes are keyed with (default: random, so the trace cannot confirm a guessed prompt); give the same one to make exports comparable")
    f.set_defaults(func=_from_log)
