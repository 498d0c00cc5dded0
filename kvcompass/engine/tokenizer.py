"""The tokenizer the edge's HTTP door and the emulated workers share: text and chat messages in,
token ids (``uint32`` numpy arrays) out.

Prefix keys are computed from token ids, so every process of a deployment must tokenize the same
text to the same ids: the edge that routes a prompt and the worker that caches it. A topology may
name its own ``tokenizer.json`` (any HF ``tokenizers`` file, e.g. the model's); without one the
built-in default is used.

**The built-in default** (``kvcompass/data/tokenizer.json``) is a byte-level BPE with an
8192-entry vocabulary that this project trains itself (:func:`train_default`) with HF
``tokenizers``, never downloaded from a hub. Its corpus is bundled: the package's own text
(every ``.py``, ``.pyi``, ``.md`` and ``.toml`` file under ``kvcompass/``, in path order) plus
the short English passage in this module (:data:`BUNDLED_TEXT`), so prose and chat text get
sensible merges as well as code. Byte-level means any Unicode text encodes (no unknown token) and
decodes back exactly. Retraining after the package's sources changed gives a different, equally
valid vocabulary; what matters is that all processes of a deployment load the same file, and
they do (the file ships in the package).

**Chat format** (:meth:`Tokenizer.apply_chat_template`), ChatML::

    <|im_start|>{role}\\n{content}<|im_end|>\\n        (each message)
    <|im_start|>assistant\\n                          (the generation prompt)

``<|im_start|>`` and ``<|im_end|>`` are special tokens inserted by id; text inside messages that
spells them is encoded as ordinary text (a user cannot forge a turn boundary). Every message is
encoded on its own and its header (role, newline) separately from its content, so the ids of a
conversation at turn k are an exact prefix of its ids at turn k+1: prefix caching across turns
depends on that, and token boundaries never straddle two messages.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
from tokenizers import Tokenizer as _HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from kvcompass import _core
from kvcompass.engine.chat_template import ChatTemplates, load_chat_templates, override_chat_templates, read_chat_template
from kvcompass.errors import InvalidArgumentError
from kvcompass.index_types import as_tokens

_log = logging.getLogger(__name__)

__all__ = [
    "BUNDLED_TEXT",
    "DEFAULT_TOKENIZER_PATH",
    "DEFAULT_VOCAB_SIZE",
    "SPECIAL_TOKENS",
    "Tokenizer",
    "default_corpus",
    "load_tokenizer",
    "train_default",
]

_PACKAGE = Path(__file__).resolve().parents[1]
DEFAULT_TOKENIZER_PATH = _PACKAGE / "data" / "tokenizer.json"
DEFAULT_VOCAB_SIZE = 8192
END_OF_TEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = (END_OF_TEXT, IM_START, IM_END)
"""Ids 0, 1, 2 of the default tokenizer, in this order."""
_CORPUS_SUFFIXES = (".py", ".pyi", ".md", ".toml")
MAX_TEXT_CHARS = 16 * 1024 * 1024
"""A text longer than this (16 Mi characters, far past any context window) is refused before it
is tokenized, so one request cannot pin a CPU for seconds."""

BUNDLED_TEXT = """\
Hello! How can I help you today? I have a question about my order. Could you tell me when it
will arrive? Of course. Please share the order number and the email address you used, and I will
look it up for you. Thank you for your patience; the package left the warehouse this morning and
should arrive within two or three business days.

You are a helpful assistant. Answer the user's questions clearly and concisely. If you do not
know the answer, say so instead of guessing. Think step by step, explain your reasoning, and give
the final answer at the end. Use short paragraphs and lists where they make the answer easier to
read.

Summarize the following document in three sentences. The report describes how a company serving
large language models in many regions of the world reduced the time to first token by reusing
cached attention keys and values. Requests that share a long prefix, such as a system prompt, a
tool description or a document, can skip most of the prefill work when they reach a worker that
already holds that prefix in its memory. The main difficulty is knowing, quickly and without
asking every worker, which worker holds which prefix, and whether the saving is worth the network
delay of sending the request to another continent.

Write a short story about a lighthouse keeper who finds a message in a bottle. The morning was
grey and the sea was calm. She walked down to the rocks, as she did every day, and saw something
glinting between the stones. Inside the bottle was a letter, written in careful handwriting many
years ago, addressed to whoever might find it.

Translate into French: good morning, good evening, please, thank you very much, where is the train
station, how much does this cost, I would like a cup of coffee, the weather is beautiful today.

Question: what is the capital of Japan? Answer: Tokyo. Question: what is twelve times twelve?
Answer: one hundred and forty-four. Question: who wrote the play about a prince of Denmark?
Answer: William Shakespeare wrote Hamlet around the year 1600.

The function takes a list of numbers and returns the largest one. First, check that the list is
not empty; then keep the largest value seen so far while walking through the list once. The
running time is linear in the length of the list, and the memory used is constant.

Monday, Tuesday, Wednesday, Thursday, Friday, Saturday, Sunday. January, February, March, April,
May, June, July, August, September, October, November, December. One, two, three, four, five,
six, seven, eight, nine, ten, eleven, twelve, twenty, thirty, hundred, thousand, million.
"""
"""General English prose and dialogue, written for this project and part of the default
tokenizer's corpus (the package's sources are mostly code and technical prose)."""


class Tokenizer:
    """An HF ``tokenizers`` tokenizer with the two calls the HTTP door needs.

    Thread-safe for concurrent ``encode`` calls (the HF tokenizer is immutable after loading),
    so async callers may run them in ``asyncio.to_thread``.
    """

    def __init__(self, hf: _HFTokenizer, path: Path | None = None, chat_templates: ChatTemplates | None = None) -> None:
        self._hf = hf
        self.path = path
        self.chat_templates = chat_templates
        """The model's own chat templates (from the files beside the tokenizer), or None: chats
        are then in the built-in ChatML format."""
        # Special tokens inside user text are plain text; apply_chat_template inserts them by id.
        hf.encode_special_tokens = True
        self.vocab_size = hf.get_vocab_size(with_added_tokens=True)
        self._im_start = hf.token_to_id(IM_START)
        self._im_end = hf.token_to_id(IM_END)
        # Text of ASCII, Latin and general-punctuation characters goes through the Rust encoder
        # when the file is a plain byte-level BPE (the same ids, ~70x less CPU; see _fast_bpe
        # and rust/bpe.rs); anything else through HF.
        self._fast = _fast_bpe(hf)
        self._newline = self._ids("\n")
        # A model's tokenizer reads a prompt as the model's engine does (vLLM: special tokens in
        # the text are special, and a completion prompt gets what the file's post-processor
        # adds, e.g. Llama's BOS): a copy, as the flag is the tokenizer's. The built-in one is
        # its own engine's (the emulated worker's) and keeps the rules of the module notes.
        self._engine: _HFTokenizer | None = None
        if path is not None and not self.builtin:
            self._engine = _HFTokenizer.from_str(hf.to_str())
            self._engine.encode_special_tokens = False

    def __repr__(self) -> str:
        return f"Tokenizer(path={str(self.path)!r}, vocab_size={self.vocab_size})"

    @property
    def builtin(self) -> bool:
        """Whether this is the built-in default rather than the model's own tokenizer: its
        counts key prefixes consistently but are not the model's, so they cannot judge a
        prompt against the model's context window (the door leaves that to the engine)."""
        return self.path is not None and Path(self.path).resolve() == DEFAULT_TOKENIZER_PATH.resolve()

    @property
    def hf(self) -> _HFTokenizer:
        """The underlying HF tokenizer (for callers that need its full API)."""
        return self._hf

    @property
    def fast(self) -> bool:
        """Whether text the Rust byte-level BPE classifies (ASCII, Latin-1, Latin Extended-A,
        General Punctuation) is encoded by it (same ids as HF) instead of by HF."""
        return self._fast is not None

    def encode(self, text: str) -> npt.NDArray[np.uint32]:
        """Token ids of ``text`` (no special tokens added; an empty text gives an empty array)."""
        text = _text("text", text)
        if self._fast is not None:
            ids = self._fast.encode(text)
            if ids is not None:
                return ids
        return as_tokens(self._ids(text))

    def encode_prompt(self, text: str, add_special_tokens: bool = True) -> npt.NDArray[np.uint32]:
        """Token ids of a completion prompt as the model's engine computes them (what the
        tokenizer's post-processor adds unless the request's ``add_special_tokens`` is false,
        vLLM's default being true; special tokens spelled in the text are special): what the
        door must key a prompt by to find the KV the engine registered. The built-in tokenizer
        gives :meth:`encode`'s ids."""
        if self._engine is None:
            return self.encode(text)
        return as_tokens(self._engine.encode(_text("prompt", text), add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: Sequence[int] | npt.NDArray[np.uint32]) -> str:
        """The text of ``ids`` (special tokens left out)."""
        arr = np.asarray(ids)
        if arr.ndim != 1 or (arr.size and (arr.dtype.kind not in "iu" or int(arr.min()) < 0 or int(arr.max()) > 0xFFFFFFFF)):
            raise InvalidArgumentError("ids must be a one-dimensional sequence of token ids in 0..2**32-1")
        return self._hf.decode([int(i) for i in arr], skip_special_tokens=True)

    def token_id(self, token: str) -> int | None:
        """The id of one vocabulary entry (e.g. a special token), None if there is none."""
        return self._hf.token_to_id(token)

    def apply_chat_template(self, messages: object, tools: object = None, options: Mapping[str, Any] | None = None, *, add_generation_prompt: bool = True) -> npt.NDArray[np.uint32]:
        """Token ids of a chat: under the model's own template when the tokenizer has one
        (:mod:`kvcompass.engine.chat_template`; ``tools``, a request's tool list, rendered as the
        template renders them; ``options``, the request's ``add_generation_prompt``,
        ``continue_final_message``, ``chat_template_kwargs``, ``documents`` and
        ``add_special_tokens``, as vLLM reads them; the text read as the engine reads it), else
        in the ChatML format of the module notes (``tools`` not rendered, of ``options`` only
        ``add_generation_prompt``).

        ``messages``: a non-empty list of OpenAI chat messages, each a mapping with a ``role``
        (any non-empty string) and an optional ``content``: a string, a list of content parts
        (text, ``input_text``, ``output_text`` and ``refusal`` parts as their text, other parts
        such as ``image_url`` as a digest of their JSON), or null/absent (empty). An assistant's
        ``tool_calls`` follow its content as canonical JSON; other keys (``name``) are ignored.
        InvalidArgumentError names the first offending message and field.
        """
        opts = dict(options or {})
        add_generation_prompt = bool(opts.get("add_generation_prompt", add_generation_prompt))
        template = self.chat_templates.pick(tools) if self.chat_templates is not None else None
        if template is not None and self._engine is not None:
            if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence) or not messages:
                raise InvalidArgumentError("messages must be a non-empty list of chat messages")
            if tools is not None and (isinstance(tools, (str, bytes)) or not isinstance(tools, Sequence)):
                raise InvalidArgumentError(f"tools must be a list, got {type(tools).__name__}")
            text = template.render(
                messages,
                tools=tools,
                documents=opts.get("documents"),
                add_generation_prompt=add_generation_prompt,
                continue_final_message=bool(opts.get("continue_final_message", False)),
                extra=opts.get("chat_template_kwargs"),
            )
            return as_tokens(self._engine.encode(_text("the rendered chat", text), add_special_tokens=bool(opts.get("add_special_tokens", False))).ids)
        ids, _ = self.encode_chat(messages)
        if not add_generation_prompt:
            return ids
        return np.concatenate([ids, np.asarray(self.generation_prompt(), dtype=np.uint32)])

    def generation_prompt(self) -> list[int]:
        """The ids a prompt ends with to ask for the assistant's turn: the head of an assistant
        message, so a conversation's prompt at turn k is an exact prefix of its ids at k+1."""
        start, _ = self._chat_ids()
        return [start, *self._ids("assistant"), *self._newline]

    def encode_chat(self, messages: object) -> tuple[npt.NDArray[np.uint32], list[int]]:
        """The ids of ``messages`` (as :meth:`apply_chat_template` without the generation
        prompt) and where each message's ids end."""
        return self.encode_chats([messages])[0]

    def encode_chats(self, chats: Sequence[object]) -> list[tuple[npt.NDArray[np.uint32], list[int]]]:
        """:meth:`encode_chat` of many conversations, their contents encoded as one batch (the
        HF tokenizer spreads a batch over the cores; the simulator's chat workload encodes
        thousands of conversations)."""
        start, end = self._chat_ids()
        parsed: list[list[tuple[str, str]]] = []
        for messages in chats:
            if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
                raise InvalidArgumentError(f"messages must be a list of chat messages, got {type(messages).__name__}")
            if not messages:
                raise InvalidArgumentError("messages must not be empty")
            one: list[tuple[str, str]] = []
            total = 0
            for i, m in enumerate(messages):
                role, content = _message(i, m)
                total += len(content)
                if total > MAX_TEXT_CHARS:
                    raise InvalidArgumentError(f"messages hold more than {MAX_TEXT_CHARS} characters")
                one.append((role, content))
            parsed.append(one)
        texts = [c for one in parsed for _, c in one if c]
        encoded = iter(self._ids_batch(texts) if texts else [])
        heads = {role: [start, *self._ids(role), *self._newline] for role in {r for one in parsed for r, _ in one}}
        trailer = [end, *self._newline]
        result: list[tuple[npt.NDArray[np.uint32], list[int]]] = []
        for one in parsed:
            out: list[int] = []
            ends: list[int] = []
            for role, content in one:
                out += heads[role]
                if content:
                    out += next(encoded)
                out += trailer
                ends.append(len(out))
            result.append((np.asarray(out, dtype=np.uint32), ends))
        return result

    def _chat_ids(self) -> tuple[int, int]:
        if self._im_start is None or self._im_end is None:
            raise InvalidArgumentError(
                f"tokenizer {self.path} has no {IM_START}/{IM_END} special tokens, so it cannot apply the ChatML chat template; "
                "send a completion prompt instead"
            )
        return self._im_start, self._im_end

    def _ids(self, text: str) -> list[int]:
        if not text:
            return []
        return self._ids_batch([text])[0]

    def _ids_batch(self, texts: list[str]) -> list[list[int]]:
        """Ids of each text: those the fast encoder takes by it when there is one, the rest as
        one HF batch."""
        out: list[list[int] | None] = [None] * len(texts)
        rest: list[int] = []
        for i, t in enumerate(texts):
            ids = self._fast.encode(t) if self._fast is not None else None
            if ids is None:
                rest.append(i)
            else:
                out[i] = ids.tolist()
        if rest:
            for i, e in zip(rest, self._encode_batch([texts[i] for i in rest])):
                out[i] = e.ids
        return out  # type: ignore[return-value]  # every slot is filled above

    def _encode_batch(self, texts: list[str]) -> list[Any]:
        """``tokenizers``' batch encoding without character offsets where it has one (0.20.2
        on): the same ids for about a fifth less CPU (offsets are most of what an ``Encoding``
        costs beyond the ids, and nothing here reads them)."""
        fast = getattr(self._hf, "encode_batch_fast", None)
        return list(fast(texts, add_special_tokens=False) if fast is not None else self._hf.encode_batch(texts, add_special_tokens=False))


def _text(name: str, text: object) -> str:
    if not isinstance(text, str):
        raise InvalidArgumentError(f"{name} must be a string, got {type(text).__name__}")
    if len(text) > MAX_TEXT_CHARS:
        raise InvalidArgumentError(f"{name} has {len(text)} characters; at most {MAX_TEXT_CHARS} are accepted")
    return text


_TEXT_PARTS = {"text": "text", "input_text": "text", "output_text": "text", "refusal": "refusal"}
"""Content part types that carry text, and the field that holds it (OpenAI's chat and responses
shapes; vLLM reads all four)."""


def _message(i: int, m: object) -> tuple[str, str]:
    """A message's role and the text the door keys it by.

    Lenient as the engines are, because a refusal here refuses a request the worker would serve:
    any role string passes (vLLM hands custom roles to the model's template); a missing content
    is empty (an assistant message that only calls tools has none); an assistant's
    ``tool_calls`` and a non-text part (an image, audio, a file) are keyed by their JSON, a part by
    a digest of it, so two conversations share a prefix exactly as far as they send the same
    calls and the same media. Only shapes no engine accepts are errors."""
    where = f"messages[{i}]"
    if not isinstance(m, Mapping):
        raise InvalidArgumentError(f"{where} must be an object with 'role' and 'content', got {type(m).__name__}")
    role = m.get("role")
    if not isinstance(role, str) or not role:
        raise InvalidArgumentError(f"{where}.role must be a non-empty string, got {role!r}")
    content = m.get("content")
    if content is None:
        text = ""
    elif isinstance(content, str):
        text = content
    elif isinstance(content, Sequence) and not isinstance(content, (str, bytes)):
        text = "".join(_part(f"{where}.content[{j}]", part) for j, part in enumerate(content))
    else:
        raise InvalidArgumentError(f"{where}.content must be a string, a list of content parts or null, got {type(content).__name__}")
    calls = m.get("tool_calls")
    if calls:
        text += _canonical_json(f"{where}.tool_calls", calls)
    return role, text


def _part(where: str, part: object) -> str:
    if not isinstance(part, Mapping) or not isinstance(part.get("type"), str):
        raise InvalidArgumentError(f"{where} must be a content part, an object with a string 'type'")
    kind = part["type"]
    field = _TEXT_PARTS.get(kind)
    if field is not None:
        value = part.get(field)
        if not isinstance(value, str):
            raise InvalidArgumentError(f"{where}.{field} must be a string for a {kind!r} part, got {type(value).__name__}")
        return value
    body = _canonical_json(where, part)
    return f"<{kind}:{hashlib.sha256(body.encode()).hexdigest()[:32]}>"


def _canonical_json(where: str, value: object) -> str:
    try:
        out = json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise InvalidArgumentError(f"{where} is not JSON: {e}") from None
    except RecursionError:
        # A body nested just shallower than the JSON reader's limit is deeper than json.dumps
        # can go a few frames further down (found in review: a 500).
        raise InvalidArgumentError(f"{where} is nested too deeply") from None
    if len(out) > MAX_TEXT_CHARS:
        raise InvalidArgumentError(f"{where} has {len(out)} characters; at most {MAX_TEXT_CHARS} are accepted")
    return out


# ---- loading ----------------------------------------------------------------------------------


def load_tokenizer(path: str | os.PathLike[str] | None = None, chat_template: str | None = None) -> Tokenizer:
    """The tokenizer in ``path`` (an HF ``tokenizer.json``), or the built-in default for None.

    ``chat_template``: an operator's template as vLLM's ``--chat-template`` takes it (a file's
    path, or the template itself: :func:`~kvcompass.engine.chat_template.read_chat_template`),
    which replaces the model's templates for every request; it needs the model's tokenizer (the
    built-in one keeps its own format, which its emulated engine shares). The default is loaded
    once per process and shared. InvalidArgumentError names the path when the file is missing or
    is not a tokenizer, and the template when it cannot be read or is not Jinja."""
    if chat_template is not None:
        if path is None or Path(path).resolve() == DEFAULT_TOKENIZER_PATH.resolve():
            raise InvalidArgumentError("a chat template needs the model's tokenizer.json (the built-in tokenizer keeps its own ChatML format)")
        return _load(Path(path), read_chat_template(chat_template))
    if path is None:
        return _default()
    return _load(Path(path))


@functools.cache
def _default() -> Tokenizer:
    return _load(DEFAULT_TOKENIZER_PATH)


def _byte_chars() -> list[str]:
    """GPT-2's byte-to-character map, which HF's ByteLevel pre-tokenizer applies: printable
    Latin-1 bytes stand for themselves, the rest for code points from 256 on, in byte order."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1), *range(ord("\u00ae"), ord("\u00ff") + 1)]
    chars: dict[int, str] = {b: chr(b) for b in keep}
    n = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + n)
            n += 1
    return [chars[b] for b in range(256)]


def _fast_bpe(hf: _HFTokenizer) -> _core.ByteLevelBpe | None:
    """The Rust encoder for ``hf`` (texts of the characters it classifies), or None unless ``hf`` is exactly what it
    reproduces: no normalizer, the ByteLevel pre-tokenizer with GPT-2's regex and no prefix
    space, a BPE model without dropout, unknown token, affixes, byte fallback or merge skipping,
    and only special added tokens (which ``encode_special_tokens`` leaves as text)."""
    try:
        d = json.loads(hf.to_str())
    except (TypeError, ValueError):
        return None
    pre, model = d.get("pre_tokenizer") or {}, d.get("model") or {}
    post = d.get("post_processor")
    if d.get("normalizer") is not None or (post is not None and post.get("type") != "ByteLevel"):
        return None
    if pre != {**pre, "type": "ByteLevel", "add_prefix_space": False, "use_regex": True}:
        return None
    if model.get("type") != "BPE" or model.get("dropout") is not None or model.get("unk_token") is not None:
        return None
    if model.get("continuing_subword_prefix") or model.get("end_of_word_suffix") or model.get("byte_fallback") or model.get("ignore_merges"):
        return None
    if any(not t.get("special") for t in d.get("added_tokens") or []):
        return None
    vocab: dict[str, int] = model.get("vocab") or {}
    byte_ids = [vocab.get(c) for c in _byte_chars()]
    if any(i is None for i in byte_ids):
        return None
    merges: list[tuple[int, int, int]] = []
    for m in model.get("merges") or []:
        a, b = m.split(" ", 1) if isinstance(m, str) else m
        ia, ib, im = vocab.get(a), vocab.get(b), vocab.get(a + b)
        if ia is None or ib is None or im is None:
            return None
        merges.append((ia, ib, im))
    return _core.ByteLevelBpe(byte_ids, merges)  # type: ignore[arg-type]  # None excluded above


def _load(p: Path, chat_template: tuple[str, str] | None = None) -> Tokenizer:
    if not p.is_file():
        raise InvalidArgumentError(f"tokenizer file {str(p)!r} does not exist (expected an HF tokenizers tokenizer.json)")
    try:
        hf = _HFTokenizer.from_file(str(p))
    except Exception as e:  # tokenizers raises a bare Exception for unreadable files
        raise InvalidArgumentError(f"tokenizer file {str(p)!r} is not an HF tokenizers tokenizer.json: {e}") from None
    # A model's directory holds its chat templates beside the tokenizer.
    if p.resolve() == DEFAULT_TOKENIZER_PATH.resolve():
        return Tokenizer(hf, p)
    if chat_template is not None:
        return Tokenizer(hf, p, override_chat_templates(*chat_template, p.parent))
    templates = load_chat_templates(p.parent)
    if templates is None:
        _log.warning("tokenizer %s: no chat template beside it (chat_template.jinja or tokenizer_config.json); chats are keyed as ChatML, which matches the engine only for a ChatML model", p)
    return Tokenizer(hf, p, templates)


# ---- training the default ---------------------------------------------------------------------


def default_corpus(root: str | os.PathLike[str] | None = None) -> list[Path]:
    """The package's own text files the default tokenizer is trained on, in path order."""
    base = _PACKAGE if root is None else Path(root)
    files = [p for p in base.rglob("*") if p.is_file() and p.suffix in _CORPUS_SUFFIXES and "__pycache__" not in p.parts]
    return sorted(files, key=lambda p: p.relative_to(base).as_posix())


def _corpus_texts(files: Iterable[Path]) -> Iterator[str]:
    yield BUNDLED_TEXT
    for f in files:
        # Paragraph-sized pieces: the trainer counts words per piece, so piece size only
        # changes memory use, not the result.
        text = f.read_text(encoding="utf-8", errors="replace")
        yield from (text[i : i + 65536] for i in range(0, len(text), 65536))


def train_default(
    path: str | os.PathLike[str] = DEFAULT_TOKENIZER_PATH,
    *,
    files: Sequence[str | os.PathLike[str]] | None = None,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
) -> Tokenizer:
    """Train the default byte-level BPE and write it to ``path`` (how the shipped
    ``kvcompass/data/tokenizer.json`` was made: ``python -m kvcompass.engine.tokenizer``).

    ``files``: the corpus besides :data:`BUNDLED_TEXT` (default :func:`default_corpus`).
    Training is deterministic: the same corpus gives the same file."""
    if type(vocab_size) is not int or vocab_size < 256 + len(SPECIAL_TOKENS) + 1:
        raise InvalidArgumentError(f"vocab_size must be an int above the 256 byte tokens and the special tokens, got {vocab_size!r}")
    corpus = default_corpus() if files is None else [Path(f) for f in files]
    hf = _HFTokenizer(models.BPE())
    # GPT-2 style: split on the usual word/number/punctuation regex, bytes mapped to printable
    # characters, no prefix space (so a message's first word encodes as it does mid-text).
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    hf.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=1,  # the bundled corpus is small; rare merges only memorise whole identifiers
        show_progress=False,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    hf.train_from_iterator(_corpus_texts(corpus), trainer=trainer)
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    hf.save(str(out), pretty=False)
    return _load(out)


if __name__ == "__main__":  # python -m kvcompass.engine.tokenizer [PATH]
    import sys

    tok = train_default(sys.argv[1] if len(sys.argv) > 1 else DEFAULT_TOKENIZER_PATH)
    print(f"wrote {tok.path} ({tok.vocab_size} tokens)")
