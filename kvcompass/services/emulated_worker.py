"""``kvcompass worker --emulate``: an OpenAI-compatible inference server that looks like a vLLM
worker to everything KVCompass talks to, with no GPU and no model.

What is real: the HTTP API (``/v1/completions``, ``/v1/chat/completions`` with SSE streaming,
``/v1/models``, ``/health``, ``/metrics``), the reuse report (``usage.prompt_tokens_details.
cached_tokens``) and the KV events, published on ZMQ exactly as vLLM publishes them, with vLLM's
replay socket. So ``kvcompass agent`` and the edge cannot tell it from a vLLM instance started
with ``--kv-events-config '{"enable_kv_cache_events": true, "publisher": "zmq", ...}'`` and
``--enable-prompt-tokens-details``. What is modelled: the prefix cache (the simulator's
:class:`~kvcompass.engine.cache.PrefixCache`, block-granular, VRAM and DRAM, LRU or LFU) and time
(the simulator's :class:`~kvcompass.engine.costs.CostModel`), so the emulated fleet behaves as the
simulated one does and the two can be compared.

**A request's life** (the simulator's worker model, on the wall clock):

1. Parse and validate; a bad request gets a 4xx with OpenAI's error body
   ``{"error": {"message", "type", "param", "code"}}``. Text prompts and chat messages are
   tokenized with the deployment's tokenizer (:mod:`kvcompass.engine.tokenizer`); a prompt
   of token ids is taken as it is (any u32, as trace replays send).
2. Enqueue on the FIFO prefill server. At prefill start ``(vram, dram) = cache.prompt_hit(prompt)``
   (the longest cached prefix of all but the last token, as vLLM schedules it)
   and the prefill takes ``cost.prefill_ms(uncached) + cost.reload_ms(dram)`` modelled ms,
   slept for ``time_scale`` times that (0: no sleeping at all, for tests); with chunked GPU
   sharing (``WorkerConfig.gpu_sharing``, the default, as in the simulator) it runs in chunks
   of up to ``max_batched_tokens`` minus the running sequences, each chunk beside one decode
   step of the batch running then. At prefill end
   ``cache.admit(prompt)`` and its events are published as one vLLM message (next seq).
   A request's ``cache_salt`` (vLLM's per-request salt) seeds its prompt's block chain, so
   prompts of different salts share no block, and the stored event of a salted prompt's first
   block carries the salt in its ``extra_keys``, as vLLM's does.
3. The first token comes out at prefill end; each further token after one decode step of
   ``cost.decode_step_ms(running sequences, their context tokens)`` (continuous batching
   approximated per sequence: every running sequence steps at the rate the current batch
   would, plus, with chunked sharing, the prefill time of the prompt chunk in the same step, so
   a long prompt stalls the sequences decoding beside it). Tokens are fake but deterministic:
   a fixed list of single-token words, starting at an offset derived from the prompt.
4. ``usage.prompt_tokens_details.cached_tokens`` is the reused prefix (VRAM + DRAM hit, whole
   blocks), which the edge reads as the reuse report.

**Load.** The worker's queued prefill work, in *modelled* ms (the unit the edge's score uses, so
independent of ``time_scale``): what remains of the running prefill plus, for each waiting
request, its estimate from a cache lookup at enqueue time (with chunked sharing including one
decode step of the current batch per chunk). Every completion response carries it
in ``x-kvcompass-queue-ms``, with ``x-kvcompass-cached-tokens`` and ``x-kvcompass-worker``.
A streamed response's headers go out at the first token (after its prefill), so an edge has the
reuse report and the load before any body byte; ``GET /kvcompass/load`` gives them on demand.

**KV events.** A ZMQ PUB socket (an XPUB, which is the same to subscribers and tells the worker
how many there are: :attr:`EmulatedWorker.subscribers`) sends ``(topic, seq as 8 bytes big-endian, msgpack batch)``
(:func:`kvcompass.agent.encode_batch`, vLLM's array form); seq starts at 0 and each message
goes into a bounded ring (``replay_buffer`` messages, vLLM's ``buffer_steps``). The ROUTER
replay socket does what vLLM's ``ZmqEventPublisher._service_replay`` does: it takes
``[identity, b"", start_seq]`` (a REQ client, or a DEALER that sends an empty delimiter frame
first), answers ``[identity, b"", seq, payload]`` for every buffered message with
``seq >= start_seq``, then ``[identity, b"", -1 (signed, 8 bytes), b""]``; requests of another
shape are ignored, as vLLM ignores them. :meth:`EmulatedWorker.restart_engine` and
:meth:`EmulatedWorker.lose_next_events` inject the two faults the agent must survive: an
engine restart (cache empty, seq back to 0, ring empty, new block-hash seed) and messages lost
on the PUB socket (still in the ring, so a replay repairs them).

**Drain.** :meth:`EmulatedWorker.stop` turns ``/health`` to 503, refuses new completions with
503, waits (up to ``drain_timeout_s``) for the requests in flight to finish, then closes the
HTTP server and the sockets.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import ssl
import time
import uuid
from collections import deque
from collections.abc import AsyncGenerator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from hashlib import blake2b
from typing import Any

import numpy as np
import numpy.typing as npt
import zmq
import zmq.asyncio
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from kvcompass._core import KvPool
from kvcompass.agent.events import REPLAY_END_SEQ, Event, encode_batch
from kvcompass.discovery.layout import WorkerSpec
from kvcompass.errors import DrainingError, InvalidArgumentError
from kvcompass.services.http_server import App, HttpServer, Request, Response, StreamResponse, json_response, path_tail
from kvcompass.services.openai_api import INLINE_TOKENIZE_CHARS, MODELS_PREFIX, OpenAIError, add_routes, decode_json_object
from kvcompass.services.openai_api import int_field, model_card, model_not_found, models_list, prompt_batch, request_tokens, sampling_fields, stream_usage
from kvcompass.services.openai_api import client_closed
from kvcompass.engine.tokenizer import Tokenizer, load_tokenizer
from kvcompass.engine.cache import DEFAULT_DRAM_TOKENS, DEFAULT_VRAM_TOKENS, Policy, PrefixCache, worker_capacities
from kvcompass.engine.costs import CostModel
from kvcompass.services.lifecycle import AsyncResource, bind_socket, on_signals
from kvcompass.services.loop_metrics import Counter, Gauge, Histogram
from kvcompass.services.wire import CACHED_HEADER, LOAD_PATH, QUEUE_MS_HEADER, WORKER_HEADER

__all__ = [
    "DEFAULT_DRAM_TOKENS",
    "DEFAULT_MODEL",
    "DEFAULT_VRAM_TOKENS",
    "EmulatedWorker",
    "WorkerConfig",
    "WorkerStats",
    "serve_worker",
]

DEFAULT_MODEL = "llama-3.1-8b"
"""The model the cost model is calibrated for (and the simulator and the edge door default to)."""
_END_SEQ = REPLAY_END_SEQ.to_bytes(8, "big", signed=True)
_MAX_BODY = 64 * 1024 * 1024  # a 128k-token prompt as a JSON list of u32 is ~1.5 MB; room to spare
# Common words; the ones the tokenizer encodes as one token are the fake output vocabulary.
_WORDS = (
    " the", " of", " and", " to", " a", " in", " is", " that", " for", " it", " as", " with", " on", " be", " by", " this",
    " are", " or", " not", " from", " at", " which", " an", " all", " can", " one", " if", " has", " each", " when", " new",
    " time", " data", " cache", " token", " prefix", " worker", " region", " key", " value", " batch", " edge", " index",
)


@dataclass(frozen=True, slots=True)
class WorkerConfig:
    """One emulated worker. Capacities are in tokens, multiples of ``block_size``."""

    worker_id: str = "worker-0"
    model: str = DEFAULT_MODEL
    """The served model name (``/v1/models``; requests naming another model get 404)."""
    block_size: int = 16
    vram_tokens: int = DEFAULT_VRAM_TOKENS
    dram_tokens: int = DEFAULT_DRAM_TOKENS
    policy: Policy = "lru"
    cost: CostModel = field(default_factory=CostModel)
    time_scale: float = 1.0
    """Wall seconds slept per modelled second (0: never sleep; responses as fast as possible)."""
    hash_seed: int = 0
    """Varies the engine's block hashes, as vLLM's per-process seed does."""
    max_model_len: int = 131072
    """Prompt plus completion tokens must fit (the model's context window)."""
    default_max_tokens: int = 16
    replay_buffer: int = 10_000
    """Messages the replay ring keeps (vLLM's ``buffer_steps`` default)."""
    topic: bytes = b""
    """The PUB topic frame (vLLM's default topic is empty)."""
    drain_timeout_s: float = 30.0
    tokenizer_path: str | None = None
    """An HF ``tokenizer.json``; None: the built-in default."""
    chat_template: str | None = None
    """An operator's chat template (vLLM's ``--chat-template``: a file or the template itself,
    :func:`~kvcompass.engine.chat_template.read_chat_template`); needs ``tokenizer_path``."""
    inline_tokenize_chars: int = INLINE_TOKENIZE_CHARS
    """Texts longer than this are tokenized off the event loop (as the door does)."""
    gpu_sharing: str = "chunked"
    """``"chunked"``: prefill and decode share the GPU in vLLM's steps (a prompt runs in chunks of
    up to ``max_batched_tokens`` minus the running sequences, each chunk beside one decode step,
    and each decode step waits for the chunk beside it), as the simulator's default;
    ``"lanes"``: a prefill server and decode steps that never slow each other down."""
    max_batched_tokens: int = 2048
    """Tokens one engine step may carry (vLLM's ``max_num_batched_tokens``)."""
    kv_pool: str = "shared"
    """``"shared"``: the running sequences and the prefix cache share VRAM, one pool
    (:class:`kvcompass._core.KvPool`, the simulator's rule): a prompt's prefill waits until its
    blocks and its answers' reservation fit beside theirs, and the cache keeps what the
    reservations leave; ``"unbounded"``: every prompt starts at once and the cache keeps all of
    VRAM. A completions list's prompts are queued together and only the first waits for room
    (they all decode together after the last, so a request queued between them would wait for
    KV that only the list's end frees)."""

    def __post_init__(self) -> None:
        if not isinstance(self.worker_id, str) or not self.worker_id:
            raise InvalidArgumentError(f"worker_id must be a non-empty string, got {self.worker_id!r}")
        if not isinstance(self.model, str) or not self.model:
            raise InvalidArgumentError(f"model must be a non-empty string, got {self.model!r}")
        if self.gpu_sharing not in ("chunked", "lanes"):
            raise InvalidArgumentError(f"gpu_sharing must be 'chunked' or 'lanes', got {self.gpu_sharing!r}")
        if self.kv_pool not in ("shared", "unbounded"):
            raise InvalidArgumentError(f"kv_pool must be 'shared' or 'unbounded', got {self.kv_pool!r}")
        # default_max_tokens too: a request's max_tokens is at least 1, as at vLLM.
        for name in ("block_size", "max_model_len", "replay_buffer", "max_batched_tokens", "default_max_tokens"):
            v = getattr(self, name)
            if type(v) is not int or v < 1:
                raise InvalidArgumentError(f"{name} must be a positive int, got {v!r}")
        for name in ("time_scale", "drain_timeout_s"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v < float("inf"):
                raise InvalidArgumentError(f"{name} must be a finite number >= 0, got {v!r}")
        if not isinstance(self.topic, bytes):
            raise InvalidArgumentError(f"topic must be bytes, got {type(self.topic).__name__}")
        if not isinstance(self.cost, CostModel):
            raise InvalidArgumentError(f"cost must be a CostModel, got {type(self.cost).__name__}")
        try:  # capacities, policy and seed are the cache's to judge
            PrefixCache(self.block_size, self.vram_tokens, self.dram_tokens, self.policy, hash_seed=self.hash_seed)
        except ValueError as e:
            raise InvalidArgumentError(f"worker {self.worker_id}: {e}") from None

    @classmethod
    def from_spec(cls, spec: WorkerSpec, block_size: int, **overrides: Any) -> WorkerConfig:
        """The config of a topology worker: its id, prefill rate and capacities (left-out
        capacities take the testbed defaults, a stated 0 DRAM is no DRAM tier, as in the
        simulator: one :func:`worker_capacities`); ``overrides`` set any other field."""
        vram, dram = worker_capacities(spec.vram_tokens, spec.dram_tokens, block_size)
        kw: dict[str, Any] = {
            "worker_id": spec.id,
            "block_size": block_size,
            "vram_tokens": vram,
            "dram_tokens": dram,
            "cost": CostModel(prefill_ms_per_token=spec.beta_ms_per_token),
        }
        kw.update(overrides)
        return cls(**kw)


@dataclass(slots=True)
class WorkerStats:
    """Counters since start (the same figures ``/metrics`` exports)."""

    requests: int = 0
    rejected: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    generated_tokens: int = 0
    published: int = 0  # KV-event messages (seqs) produced, lost ones included
    lost: int = 0  # of those, not sent on the PUB socket (lose_next_events)
    replay_requests: int = 0
    replayed: int = 0  # messages sent in replies
    engine_restarts: int = 0
    kv_waits: int = 0  # prompts whose prefill waited for room in the KV pool


@dataclass(slots=True)
class _Job:
    tokens: npt.NDArray[np.uint32]
    estimate_ms: float
    done: asyncio.Future[tuple[int, int, int]]
    """``(vram_hit, dram_hit, KV pool handle or -1)``."""
    salt: str | None = None
    extra: int = 0
    """Blocks to reserve in the KV pool beyond the prompt's full blocks (its last partial block
    and its answers)."""
    wait: bool = True
    """Whether its prefill waits for room in the pool (a request's first prompt)."""


class _Stops:
    """One sequence's ``stop`` strings and ``stop_token_ids`` as vLLM applies them: the text
    ends before the first of the stop strings (in the list's order) that it holds (with it when
    ``include_stop_str_in_output``), a stop token ends it and is shown only with that flag,
    ``finish_reason`` is then ``"stop"`` (before ``"length"`` on the last token) and
    ``stop_reason`` the string or the token id. A stream holds back the last ``len(longest
    stop) - 1`` characters until they cannot begin a stop string, so no client sees text that a
    stop string later takes back (found in review: the emulated worker ignored ``stop``)."""

    __slots__ = ("strings", "ids", "include", "text", "sent", "hold", "reason")

    def __init__(self, strings: tuple[str, ...], ids: frozenset[int], include: bool) -> None:
        self.strings, self.ids, self.include = strings, ids, include
        self.text = ""
        self.sent = 0  # characters of text given out
        self.hold = max((len(x) for x in strings), default=1) - 1
        self.reason: str | int | None = None

    def feed(self, token: int, piece: str) -> str:
        """The text that may go out after this token; :attr:`reason` is set once it stopped."""
        if token in self.ids:
            self.reason = token
            if self.include:
                self.text += piece
            return self._out(len(self.text))
        start = max(0, len(self.text) - self.hold)
        self.text += piece
        for x in self.strings:  # the first string of the list that is found, as vLLM checks them
            k = self.text.find(x, start)
            if k >= 0:
                self.reason = x
                return self._out(k + len(x) if self.include else k)
        return self._out(len(self.text) - self.hold)

    def flush(self) -> str:
        """The held-back text, at the end by length."""
        return self._out(len(self.text))

    def _out(self, upto: int) -> str:
        upto = max(upto, self.sent)
        piece, self.sent = self.text[self.sent : upto], upto
        if self.reason is not None:
            self.text = self.text[:upto]
        return piece


@dataclass(frozen=True, slots=True)
class _Request:
    chat: bool
    prompts: list[npt.NDArray[np.uint32]]
    """One prompt, or a completions request's list of them (vLLM serves a list as one request)."""
    max_tokens: int
    stream: bool
    include_usage: bool
    request_id: str
    cache_salt: str | None = None
    n: int = 1
    """Choices to return per prompt: sequences decoded side by side in the batch after one
    prefill. Choice ``i`` is sequence ``i % n`` of prompt ``i // n``, as OpenAI numbers them."""
    stop: tuple[str, ...] = ()
    stop_token_ids: frozenset[int] = frozenset()
    include_stop: bool = False

    @property
    def choices(self) -> int:
        return len(self.prompts) * self.n

    def prompt_of(self, choice: int) -> npt.NDArray[np.uint32]:
        return self.prompts[choice // self.n]


MAX_N = 64
"""The most choices one request may ask for, over all its prompts (each is a sequence in the
decode batch)."""
MAX_PROMPTS = 256
"""The most prompts one completions request may list (the door's default too)."""


class EmulatedWorker(AsyncResource):
    """One emulated vLLM worker: ``await start()``, then HTTP on :attr:`http_url`, KV events on
    :attr:`events_endpoint`, replay on :attr:`replay_endpoint`; ``await stop()`` drains."""

    def __init__(self, config: WorkerConfig = WorkerConfig(), *, tokenizer: Tokenizer | None = None) -> None:
        self.config = config
        self.tokenizer = tokenizer if tokenizer is not None else load_tokenizer(config.tokenizer_path, config.chat_template)
        self.stats = WorkerStats()
        self._hash_seed = config.hash_seed
        self.cache = self._new_cache()
        self._seq = 0
        self._ring: deque[tuple[int, bytes]] = deque(maxlen=config.replay_buffer)
        self._lose = 0
        self._subscribers = 0
        self._words = self._output_words()
        # prefill server
        self._queue: asyncio.Queue[_Job] = asyncio.Queue()
        self._waiting_ms = 0.0
        self._kv_waiting: _Job | None = None  # taken from the queue, waiting for room in the KV pool
        self._running_ms = 0.0  # modelled ms of the prefill in progress (0 when idle)
        self._running_end = 0.0  # loop time it ends (time_scale > 0)
        # the KV pool its sequences and its cache share (None: unbounded)
        self._kv = KvPool(config.vram_tokens // config.block_size) if config.kv_pool == "shared" else None
        self._kv_room = asyncio.Event()  # set when a sequence lets go of its KV
        # decode
        self._decoding = 0
        self._context = 0
        self._chunk_ms = 0.0  # chunked sharing: the prompt chunk in the current step (modelled ms)
        # lifecycle
        self._inflight = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self._draining = False
        self._started = False
        self._tasks: list[asyncio.Task[None]] = []
        self._server: HttpServer | None = None
        self._ctx: zmq.asyncio.Context | None = None
        self._pub: zmq.asyncio.Socket | None = None
        self._router: zmq.asyncio.Socket | None = None
        self.http_url = ""
        self.port = 0
        self.events_endpoint = ""
        self.replay_endpoint = ""
        self._created = int(time.time())
        self.registry = CollectorRegistry()
        self._metrics = _Metrics(self.registry, self)

    # ---- lifecycle --------------------------------------------------------------------------

    async def start(
        self, host: str = "127.0.0.1", port: int = 0, *, events: str | None = None, replay: str | None = None, ssl_context: ssl.SSLContext | None = None
    ) -> None:
        """Bind everything and start serving (HTTPS with ``ssl_context``; the ZMQ endpoints stay
        plain, as vLLM's are). ``port`` 0 picks a free port (see :attr:`port`).
        ``events`` / ``replay``: ZMQ endpoints to bind (e.g. ``tcp://*:5557``, vLLM's default);
        None binds a free port on ``host``. The actual endpoints are in :attr:`events_endpoint`
        and :attr:`replay_endpoint`."""
        if self._started:
            raise RuntimeError("EmulatedWorker.start called twice")
        self._started = True
        ctx = self._ctx = zmq.asyncio.Context()
        try:
            # XPUB, not PUB: the same wire to every SUB (vLLM's agents cannot tell), and the
            # worker learns who subscribed (tests and `kvcompass up` wait for the agent's SUB
            # before sending traffic instead of relying on a replay after a slow join).
            self._pub = ctx.socket(zmq.XPUB)
            self._pub.setsockopt(zmq.XPUB_VERBOSER, 1)  # every (un)subscription, one per peer
            self._pub.setsockopt(zmq.SNDHWM, 100_000)  # vLLM's publisher HWM
            self._pub.setsockopt(zmq.LINGER, 0)
            self.events_endpoint = _bind(self._pub, events, host)
            self._router = ctx.socket(zmq.ROUTER)
            self._router.setsockopt(zmq.SNDHWM, self.config.replay_buffer + 16)  # a whole ring fits in one reply
            self._router.setsockopt(zmq.LINGER, 0)
            self.replay_endpoint = _bind(self._router, replay, host)
            app = App(max_body_bytes=_MAX_BODY, observe=self._observe, cors_origins=("*",))  # vLLM's default
            add_routes(app, completions=self._completions, chat=self._chat, models=self._models, model=self._model, health=self._health, metrics=self._metrics_handler)
            app.add_get(LOAD_PATH, self._load)
            sock = bind_socket(host, port)
            self.port = sock.getsockname()[1]
            self._server = HttpServer(app, sock, ssl_context=ssl_context)
            await self._server.start()
            shown = f"[{host}]" if ":" in host else host
            self.http_url = f"{'https' if ssl_context is not None else 'http'}://{shown}:{self.port}"
            self._tasks = [asyncio.create_task(self._prefill_loop()), asyncio.create_task(self._replay_loop()), asyncio.create_task(self._subscription_loop())]
        except BaseException:
            await self._close()
            raise

    async def stop(self, drain_timeout_s: float | None = None) -> None:
        """Drain (health 503, new requests refused, wait for those in flight) and close."""
        if not self._started or self._draining:
            return
        self._draining = True
        timeout = self.config.drain_timeout_s if drain_timeout_s is None else drain_timeout_s
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._idle.wait(), timeout)
        await self._close()

    async def _close(self) -> None:
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t
        self._tasks = []
        if self._server is not None:
            await self._server.close(timeout_s=1.0)
            self._server.sock.close()
            self._server = None
        for s in (self._pub, self._router):
            if s is not None:
                s.close(linger=0)
        self._pub = self._router = None
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None

    async def open(self) -> None:
        await self.start()

    async def close(self) -> None:
        await self.stop()

    # ---- fault injection and inspection -------------------------------------------------------

    def restart_engine(self) -> None:
        """Behave as a vLLM process that restarted: empty cache, seq back to 0, empty replay
        ring, new block-hash seed. Nothing is published for it (a real restart publishes
        nothing either); the agent recognises it from the seq."""
        self._hash_seed = (self._hash_seed + 1) % (1 << 64)
        self.cache = self._new_cache()
        if self._kv is not None:  # sequences still running keep their share
            self.cache.fit_to_pool(self._kv)
        self._seq = 0
        self._ring.clear()
        self.stats.engine_restarts += 1

    def lose_next_events(self, count: int = 1) -> None:
        """Do not send the next ``count`` KV-event messages on the PUB socket (they still take
        their seqs and enter the replay ring), as if the network lost them."""
        if type(count) is not int or count < 0:
            raise InvalidArgumentError(f"count must be an int >= 0, got {count!r}")
        self._lose += count

    @property
    def subscribers(self) -> int:
        """SUB sockets subscribed to the KV-event stream now."""
        return self._subscribers

    def buffered_events(self) -> list[tuple[int, bytes]]:
        """The replay ring: ``(seq, payload)`` of the messages a replay can still return."""
        return list(self._ring)

    @property
    def next_seq(self) -> int:
        """The seq the next KV-event message will carry."""
        return self._seq

    def queue_ms(self) -> float:
        """Queued prefill work in modelled ms: the running prefill's remainder plus the
        estimates of the waiting requests."""
        running = self._running_ms
        scale = self.config.time_scale
        if running and scale > 0:
            left = (self._running_end - asyncio.get_running_loop().time()) * 1e3 / scale
            running = min(running, max(0.0, left))
        return running + self._waiting_ms

    @property
    def waiting(self) -> int:
        """Requests waiting for their prefill: queued, or first in line for room in the KV pool."""
        return self._queue.qsize() + (self._kv_waiting is not None)

    @property
    def running(self) -> int:
        """Sequences decoding now."""
        return self._decoding

    def _new_cache(self) -> PrefixCache:
        c = self.config
        return PrefixCache(c.block_size, c.vram_tokens, c.dram_tokens, c.policy, hash_seed=self._hash_seed)

    def _output_words(self) -> list[tuple[int, str]]:
        out = []
        for w in _WORDS:
            ids = self.tokenizer.encode(w)
            if len(ids) == 1:
                out.append((int(ids[0]), w))
        if not out:  # a tokenizer without whole-word tokens: single bytes then
            for ch in "abcdefghijklmnopqrstuvwxyz":
                ids = self.tokenizer.encode(ch)
                out.append((int(ids[0]) if len(ids) else 0, ch))
        return out

    # ---- the prefill server -----------------------------------------------------------------

    def _queue_prefills(self, prompts: Sequence[npt.NDArray[np.uint32]], salt: str | None, answer: int, sequences: int) -> list[_Job]:
        """Queue one request's prompts' prefills together, so that nothing gets between them: its
        first prompt waits for room in the KV pool, the others hold theirs behind it (a request
        waiting for room between them would wait for KV that only this request's end frees).
        Each job's ``done`` gives ``(vram_hit, dram_hit, KV pool handle or -1)``; the handle is
        held until :meth:`_release_jobs` (the prompt's blocks and ``sequences`` answers of
        ``answer`` tokens, :meth:`KvPool.extra_blocks`)."""
        loop = asyncio.get_running_loop()
        bs = self.config.block_size
        jobs = []
        for i, tokens in enumerate(prompts):
            v, d = self.cache.prompt_hit(tokens, salt)
            est = self._estimate_ms(len(tokens), v, d)
            job = _Job(tokens, est, loop.create_future(), salt, KvPool.extra_blocks(len(tokens), answer, sequences, bs), i == 0)
            self._waiting_ms += est
            self._queue.put_nowait(job)
            jobs.append(job)
        self._metrics.update_load()
        return jobs

    def _release_jobs(self, jobs: Sequence[_Job]) -> None:
        """A request is over (answered, failed or abandoned): its prefills that have not run are
        cancelled (the loop skips them, or lets go of the KV of one it is computing), and the KV
        its finished prefills hold is let go."""
        for job in jobs:
            if not job.done.done():
                job.done.cancel()
                if job is self._kv_waiting:
                    self._kv_room.set()  # the prefill loop lets it go at once
            elif not job.done.cancelled() and job.done.exception() is None and job.done.result()[2] >= 0:
                self._kv_release(job.done.result()[2])

    def _kv_release(self, handle: int) -> None:
        """A sequence lets go of its KV: the cache gets its room back
        (:meth:`PrefixCache.release_to_pool`), a waiting prompt may start."""
        assert self._kv is not None
        self.cache.release_to_pool(self._kv, handle)
        self._kv_room.set()

    async def _kv_hold(self, job: _Job) -> int:
        """Wait until the job's KV fits in the pool (or it does not wait), then hold it: the
        handle, or -1 when the job was cancelled while it waited."""
        assert self._kv is not None
        chain = np.asarray(self.cache.block_hashes(job.tokens, job.salt), dtype=np.uint64)
        waited = False
        while job.wait and not self._kv.fits(chain, job.extra):
            if not waited:
                waited = True
                self.stats.kv_waits += 1
            self._kv_room.clear()
            await self._kv_room.wait()
            if job.done.cancelled():
                return -1
        return int(self._kv.hold(chain, job.extra))

    def _prefill_ms(self, n: int, v: int, d: int) -> float:
        return self.config.cost.estimate_ms(n, v, d, chunked=False)

    def _estimate_ms(self, n: int, v: int, d: int) -> float:
        """The prompt's prefill with, under chunked sharing, one decode step of the batch running
        now beside each chunk (what the load report prices; the simulator's engine's rule)."""
        cfg = self.config
        return cfg.cost.estimate_ms(n, v, d, batch=self._decoding, context=self._context, max_batched_tokens=cfg.max_batched_tokens, chunked=cfg.gpu_sharing == "chunked")

    async def _compute(self, n: int, v: int, d: int) -> None:
        """Sleep the prompt's prefill: at once with separate lanes, chunk by chunk (each beside a
        decode step of the batch running then, which waits for the chunk) when chunked."""
        cfg = self.config
        scale, cost = cfg.time_scale, cfg.cost
        if cfg.gpu_sharing != "chunked":
            ms = self._prefill_ms(n, v, d)
            await asyncio.sleep(ms * scale / 1e3 if scale > 0 else 0)
            return
        left = n - v - d
        extra = (cost.prefill_base_ms if left else 0.0) + cost.reload_ms(d)
        try:
            while True:
                chunk, compute, decode = cost.chunk_step(left, extra, self._decoding, self._context, cfg.max_batched_tokens)
                extra = 0.0
                self._chunk_ms = compute
                step = compute + decode
                await asyncio.sleep(step * scale / 1e3 if scale > 0 else 0)
                left -= chunk
                if left <= 0:
                    return
        finally:
            self._chunk_ms = 0.0

    async def _prefill_loop(self) -> None:
        loop = asyncio.get_running_loop()
        scale = self.config.time_scale
        while True:
            job = await self._queue.get()
            handle = -1
            if self._kv is not None and not job.done.cancelled():
                # Waiting for room it is still a waiting request, its estimate in the load
                # report, as in the simulator's engine and in vLLM's waiting queue (found in
                # review: it left the report when it left the queue, so a stalled worker looked
                # free and kept being sent work).
                self._kv_waiting = job
                try:
                    handle = await self._kv_hold(job)
                except BaseException:  # the worker stops while the job waits for room
                    if not job.done.done():
                        job.done.set_exception(RuntimeError("worker stopped"))
                    raise
                finally:
                    self._kv_waiting = None
            self._waiting_ms = max(0.0, self._waiting_ms - job.estimate_ms) if self._queue.qsize() else 0.0
            if job.done.cancelled() or (self._kv is not None and handle < 0):  # the client went away while it waited
                self._metrics.update_load()
                continue
            v, d = self.cache.prompt_hit(job.tokens, job.salt)
            ms = self._estimate_ms(len(job.tokens), v, d)
            self._running_ms = ms
            self._running_end = loop.time() + ms * scale / 1e3
            self._metrics.update_load()
            try:
                await self._compute(len(job.tokens), v, d)
                # The answers' reservations take their room from the cache as the prompt lands.
                events = self.cache.fit_to_pool(self._kv) if self._kv is not None else []
                events += self.cache.admit(job.tokens, loop.time(), job.salt)
                await self._publish(events)
            except BaseException as e:
                if handle >= 0:
                    self._kv_release(handle)
                if not job.done.done():
                    job.done.set_exception(e if isinstance(e, Exception) else RuntimeError("worker stopped"))
                raise
            finally:
                self._running_ms = 0.0
                self._metrics.update_load()
            if not job.done.done():
                job.done.set_result((v, d, handle))
            elif handle >= 0:  # the client went away during its prefill
                self._kv_release(handle)

    async def _publish(self, events: Sequence[Event]) -> None:
        if not events:
            return
        seq = self._seq
        self._seq += 1
        frames = encode_batch(events, seq, ts=time.time(), dp_rank=0, topic=self.config.topic)
        self._ring.append((seq, frames[2]))
        self.stats.published += 1
        self._metrics.events.inc(len(events))
        if self._lose:
            self._lose -= 1
            self.stats.lost += 1
            return
        if self._pub is not None:
            await self._pub.send_multipart(frames)

    async def _subscription_loop(self) -> None:
        assert self._pub is not None
        pub = self._pub
        while True:
            msg = await pub.recv()
            if msg[:1] == b"\x01":
                self._subscribers += 1
            elif msg[:1] == b"\x00":
                self._subscribers = max(0, self._subscribers - 1)
            self._metrics.subscribers.set(self._subscribers)

    async def _replay_loop(self) -> None:
        assert self._router is not None
        router = self._router
        while True:
            frames = await router.recv_multipart()
            if len(frames) != 3:  # vLLM logs and ignores requests of another shape
                continue
            ident, _, start = frames
            start_seq = int.from_bytes(start, "big")
            self.stats.replay_requests += 1
            self._metrics.replays.inc()
            for seq, payload in list(self._ring):
                if seq >= start_seq:
                    await router.send_multipart([ident, b"", seq.to_bytes(8, "big"), payload])
                    self.stats.replayed += 1
            await router.send_multipart([ident, b"", _END_SEQ, b""])

    # ---- decoding ---------------------------------------------------------------------------

    async def _decode(self, tokens: npt.NDArray[np.uint32], count: int, choice: int = 0) -> AsyncGenerator[tuple[int, str], None]:
        """The fake output tokens of one sequence (``choice`` of a request's ``n``: each starts
        elsewhere in the word list, as sampled sequences differ), the first at once (it comes
        out of the prefill), each further one after a decode step of the current batch."""
        scale, cost, words = self.config.time_scale, self.config.cost, self._words
        start = (int.from_bytes(blake2b(tokens.tobytes(), digest_size=8).digest(), "little") + 7919 * choice) % len(words)
        n = len(tokens)
        self._decoding += 1
        self._context += n
        made = 0
        try:
            for j in range(count):
                if j:  # a step waits for the prompt chunk it carries (chunked sharing)
                    step = cost.decode_step_ms(self._decoding, self._context) + self._chunk_ms
                    await asyncio.sleep(step * scale / 1e3 if scale > 0 else 0)
                made += 1
                self._context += 1
                self.stats.generated_tokens += 1
                self._metrics.generated.inc()
                yield words[(start + j) % len(words)]
        finally:
            self._decoding -= 1
            self._context -= n + made
            self._metrics.update_load()

    # ---- HTTP -------------------------------------------------------------------------------

    def _observe(self, request: Request, resp: StreamResponse, err: OpenAIError | None) -> None:
        """Refusals counted (the OpenAI error middleware's hook)."""
        if err is not None:
            self.stats.rejected += 1
            self._metrics.reject(err.status)

    async def _health(self, request: Request) -> Response:
        return Response(status=503 if self._draining else 200)

    async def _metrics_handler(self, request: Request) -> Response:
        self._metrics.update_load()
        return Response(body=generate_latest(self.registry), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def _load(self, request: Request) -> Response:
        return json_response({"worker": self.config.worker_id, "queue_ms": self.queue_ms(), "waiting": self.waiting, "running": self.running})

    async def _models(self, request: Request) -> Response:
        return json_response(models_list([self._card()]))

    async def _model(self, request: Request) -> Response:
        model = path_tail(request, MODELS_PREFIX)
        if model != self.config.model:
            raise model_not_found(model, [self.config.model])
        return json_response(self._card())

    def _card(self) -> dict[str, Any]:
        c = self.config
        return model_card(c.model, self._created, root=c.model, parent=None, max_model_len=c.max_model_len)

    async def _completions(self, request: Request) -> StreamResponse:
        return await self._serve(request, chat=False)

    async def _chat(self, request: Request) -> StreamResponse:
        return await self._serve(request, chat=True)

    async def _serve(self, request: Request, *, chat: bool) -> StreamResponse:
        if self._draining:
            raise OpenAIError.of(DrainingError("the worker is shutting down; retry on another worker"))
        self._inflight += 1
        self._idle.clear()
        jobs: list[_Job] = []  # its prefills, whose KV is held until its sequences are done
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                self._release_jobs(jobs)

        # A client gone while its request waits (for its prefill, for room) aborts it, as vLLM
        # aborts a disconnected request: its prefills are cancelled and its KV let go (found
        # in review: an abandoned request kept its place first in line for room).
        gone = False

        def client_gone() -> None:
            nonlocal gone
            gone = True
            if jobs:
                release()

        forget = request.on_disconnect(client_gone)
        try:
            req = await self._parse(request, chat)
            self.stats.requests += 1
            cached = prompt_tokens_n = 0
            # A list of prompts is prefilled prompt by prompt, as vLLM's scheduler would.
            jobs = self._queue_prefills(req.prompts, req.cache_salt, req.max_tokens, req.n)
            if gone:
                raise client_closed()
            for tokens, job in zip(req.prompts, jobs):
                try:
                    v, d, _ = await job.done
                except asyncio.CancelledError:
                    if gone:
                        raise client_closed() from None
                    raise
                # vLLM's usage names the last prompt's cached tokens, not their sum
                # (request_output_to_completion_response: last_final_res.num_cached_tokens).
                cached = v + d
                prompt_tokens_n += len(tokens)
                self.stats.prompt_tokens += len(tokens)
                self.stats.cached_tokens += v + d
                self._metrics.on_prefill(len(tokens), v, d)
            headers = {
                QUEUE_MS_HEADER: f"{self.queue_ms():.3f}",
                CACHED_HEADER: str(cached),
                WORKER_HEADER: self.config.worker_id,
                "x-request-id": req.request_id,
            }
            usage = {
                "prompt_tokens": prompt_tokens_n,
                "total_tokens": prompt_tokens_n + req.choices * req.max_tokens,
                "completion_tokens": req.choices * req.max_tokens,
                # As vLLM with --enable-prompt-tokens-details: the details only when something
                # was cached, null otherwise (found in review: a 0 was always sent, so the door
                # learned from misses that a real vLLM does not report).
                "prompt_tokens_details": {"cached_tokens": cached} if cached else None,
            }
            if req.stream:
                return await self._stream(request, req, headers, usage, release)
            return await self._whole(req, headers, usage, lambda: gone)
        finally:
            forget()
            release()
            self._inflight -= 1
            if not self._inflight:
                self._idle.set()

    async def _sequence(self, req: _Request, i: int, put: Callable[[str, str | None, str | int | None], Awaitable[None]]) -> int:
        """Choice ``i``'s tokens through its stops: ``put(text, finish_reason, stop_reason)`` for
        each piece that may go out (the last with its finish reason); the tokens it generated."""
        stops = _Stops(req.stop, req.stop_token_ids, req.include_stop)
        made = 0
        async with contextlib.aclosing(self._decode(req.prompt_of(i), req.max_tokens, i % req.n)) as gen:
            async for token, text in gen:
                made += 1
                piece = stops.feed(token, text)
                if stops.reason is not None:
                    await put(piece, "stop", stops.reason)
                    return made
                if made == req.max_tokens:
                    await put(piece + stops.flush(), "length", None)
                    return made
                await put(piece, None, None)
        return made

    def _usage(self, usage: dict[str, Any], made: Sequence[int]) -> dict[str, Any]:
        """The usage with the tokens the sequences generated (a stop ends one early)."""
        return {**usage, "completion_tokens": sum(made), "total_tokens": usage["prompt_tokens"] + sum(made)}

    async def _whole(self, req: _Request, headers: dict[str, str], usage: dict[str, Any], gone: Callable[[], bool]) -> Response:
        """The answer in one body. A client gone while its sequences decode aborts them at the
        next token, as vLLM aborts a disconnected request (found in review: they decoded to the
        end for nobody)."""

        async def one(i: int) -> tuple[str, str, str | int | None, int]:
            texts: list[str] = []
            end: list[Any] = ["length", None]

            async def put(text: str, finish: str | None, reason: str | int | None) -> None:
                if gone():
                    raise client_closed()
                texts.append(text)
                if finish is not None:
                    end[:] = [finish, reason]

            made = await self._sequence(req, i, put)
            return "".join(texts), end[0], end[1], made

        outs = await asyncio.gather(*(one(i) for i in range(req.choices)))
        headers[QUEUE_MS_HEADER] = f"{self.queue_ms():.3f}"
        created = int(time.time())
        usage = self._usage(usage, [o[3] for o in outs])
        choices: list[dict[str, Any]]
        if req.chat:
            choices = [{"index": i, "message": {"role": "assistant", "content": t}, "logprobs": None, "finish_reason": f, "stop_reason": r} for i, (t, f, r, _) in enumerate(outs)]
            body = {"id": f"chatcmpl-{req.request_id}", "object": "chat.completion", "created": created, "model": self.config.model, "choices": choices, "usage": usage}
        else:
            choices = [{"index": i, "text": t, "logprobs": None, "finish_reason": f, "stop_reason": r} for i, (t, f, r, _) in enumerate(outs)]
            body = {"id": f"cmpl-{req.request_id}", "object": "text_completion", "created": created, "model": self.config.model, "choices": choices, "usage": usage}
        return json_response(body, headers=headers)

    async def _stream(self, request: Request, req: _Request, headers: dict[str, str], usage: dict[str, Any], release: Callable[[], None]) -> StreamResponse:
        """The answer as server-sent events. ``release`` lets go of the request's KV once every
        sequence is generated, as vLLM frees a finished sequence's blocks whatever its client
        has read (found in review: a client reading slowly held the worker's pool until the
        last byte, and the prompts routed there waited a minute)."""
        resp = StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache", **headers})
        await resp.prepare(request)
        created = int(time.time())
        if req.chat:
            base: dict[str, Any] = {"id": f"chatcmpl-{req.request_id}", "object": "chat.completion.chunk", "created": created, "model": self.config.model}
        else:
            base = {"id": f"cmpl-{req.request_id}", "object": "text_completion", "created": created, "model": self.config.model}
        extra: dict[str, Any] = {"usage": None} if req.include_usage else {}  # OpenAI: null on every chunk but the last

        async def send(choices: list[dict[str, Any]], **more: Any) -> None:
            await resp.write(b"data: " + json.dumps({**base, "choices": choices, **more}, separators=(",", ":")).encode() + b"\n\n")

        # The n sequences decode side by side; their pieces go out as they come, each chunk
        # naming its choice, and a sequence's last chunk carries its finish reason.
        out: asyncio.Queue[tuple[int, str, str | None, str | int | None]] = asyncio.Queue()
        generating = [req.choices]
        made = [0] * req.choices

        async def one(i: int) -> None:
            async def put(text: str, finish: str | None, reason: str | int | None) -> None:
                await out.put((i, text, finish, reason))

            made[i] = await self._sequence(req, i, put)
            generating[0] -= 1
            if not generating[0]:
                release()

        tasks = [asyncio.ensure_future(one(i)) for i in range(req.choices)]
        try:
            if req.chat:
                for i in range(req.choices):
                    await send([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}], **extra)
            left = req.choices
            while left:
                i, text, finish, reason = await out.get()
                if finish is not None:
                    left -= 1
                if req.chat:
                    if text:
                        await send([{"index": i, "delta": {"content": text}, "logprobs": None, "finish_reason": None}], **extra)
                    if finish is not None:
                        await send([{"index": i, "delta": {}, "logprobs": None, "finish_reason": finish, "stop_reason": reason}], **extra)
                elif text or finish is not None:
                    await send([{"index": i, "text": text, "logprobs": None, "finish_reason": finish, "stop_reason": reason}], **extra)
            if req.include_usage:
                await send([], usage=self._usage(usage, made))
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
        except ConnectionResetError:
            pass  # the client went away; its sequences stop with their tasks
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        return resp

    # ---- request parsing ----------------------------------------------------------------------

    async def _parse(self, request: Request, chat: bool) -> _Request:
        raw = await request.read()
        body = decode_json_object(raw, request.headers.get("Content-Type"))
        model = body.get("model")
        if model is not None and model != self.config.model:
            raise model_not_found(model, [self.config.model])
        n = sampling_fields(body)
        if n > MAX_N:
            raise OpenAIError(400, f"n must be an integer in 1..{MAX_N}, got {n}", "n", "invalid_type")
        best_of = body.get("best_of")
        if best_of is not None and best_of != n:
            raise OpenAIError(400, f"best_of is not supported by the emulated worker beyond best_of = n (got {best_of!r}, n = {n})", "best_of")
        if body.get("echo"):
            raise OpenAIError(400, "echo is not supported by the emulated worker", "echo")
        # Tools: a real engine parses calls out of its generations; this one generates no text
        # that could be a call, so it refuses rather than answer as if there were no tools.
        if body.get("tools"):
            raise OpenAIError(400, "tools are not supported by the emulated worker (it cannot generate tool calls); send the request to a real engine", "tools", "unsupported")
        tool_choice = body.get("tool_choice")
        if tool_choice not in (None, "none", "auto"):
            raise OpenAIError(400, f"tool_choice {tool_choice!r} needs tools, which the emulated worker does not support", "tool_choice", "unsupported")
        if body.get("logprobs") not in (None, False) or body.get("top_logprobs") is not None:
            raise OpenAIError(400, "logprobs are not supported by the emulated worker", "logprobs")
        stream = body.get("stream", False)
        if stream is None:
            stream = False
        if not isinstance(stream, bool):
            raise OpenAIError(400, f"stream must be a boolean, got {type(stream).__name__}", "stream")
        include_usage = stream_usage(body, stream)
        max_param = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
        max_tokens = int_field(body, max_param, 1)
        if max_tokens is None:
            max_tokens = self.config.default_max_tokens
        inline = self.config.inline_tokenize_chars
        batch = None if chat else prompt_batch(body, MAX_PROMPTS)
        param = "messages" if chat else "prompt"
        prompts = await request_tokens(body, self.tokenizer.encode_prompt, self.tokenizer.apply_chat_template, chat=chat, batch=batch, inline_chars=inline, raw_bytes=len(raw))
        if len(prompts) * n > MAX_N:
            raise OpenAIError(400, f"{len(prompts)} prompts x n = {n} asks for {len(prompts) * n} sequences; at most {MAX_N} are decoded for one request", "n")
        limit = self.config.max_model_len
        for tokens in prompts:
            if len(tokens) + max_tokens > limit:
                raise OpenAIError(400, f"This model's maximum context length is {limit} tokens. However, you requested {len(tokens) + max_tokens} tokens "
                    f"({len(tokens)} in the {param}, {max_tokens} in the completion). Please reduce the length of the {param} or completion.", param, "context_length_exceeded")
        salt = body.get("cache_salt")
        if salt is not None and (not isinstance(salt, str) or not salt):
            raise OpenAIError(400, "cache_salt must be a non-empty string", "cache_salt")
        stop = body.get("stop")
        stops = (stop,) if isinstance(stop, str) else stop if stop is not None else ()
        if not isinstance(stops, (list, tuple)) or not all(isinstance(x, str) for x in stops):
            raise OpenAIError(400, "stop must be a string or a list of strings", "stop", "invalid_type")
        ids = body.get("stop_token_ids") or []
        if not isinstance(ids, list) or not all(type(x) is int and x >= 0 for x in ids):
            raise OpenAIError(400, "stop_token_ids must be a list of token ids", "stop_token_ids", "invalid_type")
        include = body.get("include_stop_str_in_output", False)
        if not isinstance(include, bool):
            raise OpenAIError(400, "include_stop_str_in_output must be a boolean", "include_stop_str_in_output", "invalid_type")
        rid = request.headers.get("x-request-id") or uuid.uuid4().hex
        return _Request(chat, prompts, max_tokens, stream, include_usage, rid, salt, n, tuple(x for x in stops if x), frozenset(ids), include)

def _bind(sock: zmq.asyncio.Socket, endpoint: str | None, host: str) -> str:
    """Bind ``sock`` (a random port on ``host`` without ``endpoint``). A ZMQ error is an
    OSError naming the endpoint, which the command line answers in one line (found in review:
    ZMQError is no OSError, and a port in use ended ``kvcompass worker`` with a traceback)."""
    try:
        if endpoint is None:
            port = sock.bind_to_random_port(f"tcp://{host}")
            return f"tcp://{host}:{port}"
        sock.bind(endpoint)
    except zmq.ZMQError as e:
        raise OSError(e.errno, f"cannot bind the KV-event socket to {endpoint or f'tcp://{host}:*'}: {e}") from None
    last = sock.getsockopt(zmq.LAST_ENDPOINT)
    return last.decode() if isinstance(last, bytes) else str(last)


class _Metrics:
    """The worker's Prometheus series (one registry per worker, so many can share a process),
    updated per request and per decode step from the worker's loop: hence
    :mod:`kvcompass.services.loop_metrics`' lock-free ones."""

    def __init__(self, registry: CollectorRegistry, worker: EmulatedWorker) -> None:
        self._w = worker
        labels = ["worker"]
        wid = worker.config.worker_id
        self.requests = Counter("kvcompass_worker_requests", "Completions admitted to the prefill queue", labels, registry=registry).labels(wid)
        self._rejected = Counter("kvcompass_worker_rejected_requests", "Requests refused (by HTTP status)", ["worker", "status"], registry=registry)
        self.prompt = Counter("kvcompass_worker_prompt_tokens", "Prompt tokens prefilled or reused", labels, registry=registry).labels(wid)
        self._cached = Counter("kvcompass_worker_cached_tokens", "Prompt tokens reused from the prefix cache, by tier", ["worker", "tier"], registry=registry)
        self.generated = Counter("kvcompass_worker_generation_tokens", "Tokens generated", labels, registry=registry).labels(wid)
        self.events = Counter("kvcompass_worker_kv_events", "KV events published (in messages, lost ones included)", labels, registry=registry).labels(wid)
        self.replays = Counter("kvcompass_worker_replay_requests", "Replay requests served", labels, registry=registry).labels(wid)
        self.queue = Gauge("kvcompass_worker_queue_ms", "Queued prefill work, modelled ms", labels, registry=registry).labels(wid)
        self.waiting = Gauge("kvcompass_worker_waiting_requests", "Requests waiting for prefill", labels, registry=registry).labels(wid)
        self.running = Gauge("kvcompass_worker_running_requests", "Sequences decoding", labels, registry=registry).labels(wid)
        self.subscribers = Gauge("kvcompass_worker_event_subscribers", "SUB sockets on the KV-event stream", labels, registry=registry).labels(wid)
        self._cache_tokens = Gauge("kvcompass_worker_cache_tokens", "Tokens held in the prefix cache, by tier", ["worker", "tier"], registry=registry)
        self.hit_ratio = Histogram(
            "kvcompass_worker_prefix_hit_ratio", "Reused fraction of each prompt", labels, buckets=(0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 1.0), registry=registry
        ).labels(wid)
        self._wid = wid

    def reject(self, status: int) -> None:
        self._rejected.labels(self._wid, str(status)).inc()

    def on_prefill(self, n: int, v: int, d: int) -> None:
        self.requests.inc()
        self.prompt.inc(n)
        self._cached.labels(self._wid, "vram").inc(v)
        self._cached.labels(self._wid, "dram").inc(d)
        self.hit_ratio.observe((v + d) / n if n else 0.0)
        self.update_load()

    def update_load(self) -> None:
        w = self._w
        with contextlib.suppress(RuntimeError):  # no running loop (never, in practice)
            self.queue.set(w.queue_ms())
        self.waiting.set(w.waiting)
        self.running.set(w.running)
        self._cache_tokens.labels(self._wid, "vram").set(w.cache.vram_tokens)
        self._cache_tokens.labels(self._wid, "dram").set(w.cache.dram_tokens)


async def serve_worker(
    config: WorkerConfig,
    host: str = "127.0.0.1",
    port: int = 8000,
    *,
    events: str | None = None,
    replay: str | None = None,
    ready: Callable[[EmulatedWorker], None] | None = None,
    stop: asyncio.Event | None = None,
    handle_signals: bool = True,
    ssl_context: ssl.SSLContext | None = None,
) -> None:
    """Run one emulated worker until ``stop`` is set, SIGTERM or SIGINT arrives (with
    ``handle_signals``), or the task is cancelled; then drain and close. ``ready`` is called
    once everything is bound (the CLI prints the endpoints from it)."""
    worker = EmulatedWorker(config)
    stop = stop if stop is not None else asyncio.Event()
    await worker.start(host, port, events=events, replay=replay, ssl_context=ssl_context)
    try:
        with on_signals(stop.set, () if not handle_signals else (signal.SIGTERM, signal.SIGINT)):
            if ready is not None:
                ready(worker)
            await stop.wait()
    finally:
        await worker.stop()
