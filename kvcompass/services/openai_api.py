"""The OpenAI HTTP surface both the door and the emulated worker serve, written once: the error
class and its body (:class:`kvcompass.services.http_server.App` answers every refusal with it,
the server's own 404, 405 and 413 included), the request body's decoding, and a prompt's or
chat's tokens.

Why a module of its own: the two surfaces had each grown their own reading, error class, error
body and middleware, and their rules had drifted (a body one refused the other served; one
tokenized long texts off the event loop past a configurable size, the other past a hard-coded
one; deeply nested JSON raised ``RecursionError`` into a plain-text 500). What differs between
them is what each serves (the worker refuses sampling options it does not emulate; the door
checks keys and tenants), not how a request is read or refused.
"""

from __future__ import annotations

import asyncio
import functools
import math
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal

import msgspec
import numpy as np
import numpy.typing as npt

from kvcompass import _core
from kvcompass.errors import KVCompassError
from kvcompass.services.status import http_of
from kvcompass.services.wire import HEALTH_PATH

if TYPE_CHECKING:  # http_server imports this module for its error class
    from kvcompass.services.http_server import App, Handler

__all__ = [
    "INLINE_TOKENIZE_CHARS",
    "MODELS_PREFIX",
    "ErrorType",
    "OpenAIError",
    "add_routes",
    "batch_prompt_tokens",
    "chat_tokens",
    "decode_json_object",
    "error_body",
    "int_field",
    "model_card",
    "model_not_found",
    "models_list",
    "one_prompt_tokens",
    "parse_json",
    "prompt_batch",
    "prompt_tokens",
    "token_ids",
]

ErrorType = Literal["invalid_request_error", "server_error", "service_unavailable_error"]

INLINE_TOKENIZE_CHARS = 32768
"""Texts longer than this (characters) are tokenized in a thread, off the event loop (the
tokenizers release the GIL), so one long prompt does not stall every other request."""


Tokenize = Callable[[], Any]


class OpenAIError(Exception):
    """A request answered with OpenAI's error body instead of a completion: ``status``, a
    ``message`` for people, the ``param`` at fault and a ``code`` for programs (None where
    OpenAI has none), ``kind`` (OpenAI's ``type``; by default from the status) and extra
    response ``headers`` (e.g. ``Retry-After``)."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None, kind: ErrorType | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.kind: ErrorType = kind or ("invalid_request_error" if status < 500 else "server_error")
        self.headers = headers or {}

    @classmethod
    def of(cls, exc: KVCompassError, param: str | None = None, code: str | None = None, headers: dict[str, str] | None = None) -> OpenAIError:
        """``exc`` answered through the one HTTP table (:data:`kvcompass.services.status.HTTP_OF`),
        the door's and the worker's alike: its status and code (the error's own ``code``
        attribute, or ``code``, win over the table's), ``Retry-After`` from a rate refusal's
        ``retry_after_s``, ``WWW-Authenticate`` on a 401."""
        status, table_code = http_of(exc)
        hdrs = dict(headers or {})
        retry = getattr(exc, "retry_after_s", None)
        if status == 429 and retry is not None:
            hdrs.setdefault("Retry-After", str(max(1, math.ceil(retry))))
        if status == 401:
            hdrs.setdefault("WWW-Authenticate", 'Bearer realm="kvcompass"')
        kind: ErrorType | None = "service_unavailable_error" if status == 503 else None
        return cls(status, exc.message, param, code or getattr(exc, "code", None) or table_code, kind, hdrs)


def error_body(status: int, message: str, param: str | None = None, code: str | None = None, kind: ErrorType | None = None) -> dict[str, Any]:
    """``{"error": {"message", "type", "param", "code"}}``, OpenAI's shape."""
    t = kind or ("invalid_request_error" if status < 500 else "server_error")
    return {"error": {"message": message, "type": t, "param": param, "code": code}}


MODELS_PREFIX = "/v1/models/"
"""Where ``GET /v1/models/{model}`` lives (OpenAI's ``models.retrieve``)."""


def add_routes(app: App, *, completions: Handler, chat: Handler, models: Handler, model: Handler, health: Handler, metrics: Handler) -> None:
    """The paths the door and the emulated worker both serve, as vLLM serves them: the two
    completion endpoints, ``GET /v1/models`` and ``/v1/models/{model}``, ``/health`` and
    ``/metrics``. Each adds its own paths beside these (the worker its load report)."""
    app.add_post("/v1/completions", completions)
    app.add_post("/v1/chat/completions", chat)
    app.add_get("/v1/models", models)
    app.add_get_prefix(MODELS_PREFIX, model)
    app.add_get(HEALTH_PATH, health)
    app.add_get("/metrics", metrics)


def int_field(body: Mapping[str, Any], name: str, minimum: int, maximum: int | None = None) -> int | None:
    """``body[name]`` as an int (None when absent or null), or a 400 naming the field.

    An integral float (``16.0``) is that integer: vLLM's and SGLang's request models are lax
    pydantic, which takes it, and clients that build bodies from floats send it (found in
    review: the door refused ``max_tokens: 16.0`` that every engine serves). A bool, a
    fractional or non-finite number and a string are refused."""
    v = body.get(name)
    if v is None:
        return None
    if type(v) is float and math.isfinite(v) and v.is_integer():
        v = int(v)
    if type(v) is not int or v < minimum or (maximum is not None and v > maximum):
        bounds = f">= {minimum}" if maximum is None else f"in {minimum}..{maximum}"
        raise OpenAIError(400, f"{name} must be an integer {bounds}, got {body[name]!r}", name, "invalid_type")
    return v


MAX_INT32 = 2**31 - 1

# vLLM's bounds (SamplingParams._verify_args): (low, high, low included, high included).
_SAMPLING_BOUNDS: dict[str, tuple[float, float, bool, bool]] = {
    "temperature": (0.0, math.inf, True, False),
    "top_p": (0.0, 1.0, False, True),
    "presence_penalty": (-2.0, 2.0, True, True),
    "frequency_penalty": (-2.0, 2.0, True, True),
}


def sampling_fields(body: Mapping[str, Any]) -> int:
    """The request's sampling fields checked as vLLM checks them, so a client gets the engine's
    400 from the door (no WAN round trip) and from the emulated worker alike: ``max_tokens``
    and ``max_completion_tokens`` at least 1 (found in review: 0 was served; 0 with ``echo``,
    the prompt alone, passes), ``n`` at least 1,
    ``temperature`` not negative, ``top_p`` in (0, 1], the penalties in [-2, 2]; integers
    bounded as the engines bound them (1e300 became a 301-digit integer the door carried on).
    Returns ``n`` (1 when absent)."""
    # echo with max_tokens 0 asks for the prompt alone (vLLM's echo_without_generation: scoring a
    # prompt); anything else generates at least one token.
    least = 0 if body.get("echo") is True else 1
    int_field(body, "max_tokens", least, MAX_INT32)
    int_field(body, "max_completion_tokens", least, MAX_INT32)
    n = int_field(body, "n", 1, MAX_INT32) or 1
    for name, (low, high, low_in, high_in) in _SAMPLING_BOUNDS.items():
        v = body.get(name)
        if v is None:
            continue
        if type(v) not in (int, float) or not math.isfinite(v):
            raise OpenAIError(400, f"{name} must be a number", name, "invalid_type")
        if not ((low <= v) if low_in else (low < v)) or not ((v <= high) if high_in else (v < high)):
            span = f"{'[' if low_in else '('}{low:g}, {high:g}{']' if high_in else ')'}"
            raise OpenAIError(400, f"{name} must be in {span}, got {v!r}", name, "invalid_value")
    return n


def stream_usage(body: Mapping[str, Any], stream: bool) -> bool:
    """Whether a streamed answer ends with a usage chunk, as vLLM reads ``stream_options``: only
    with ``stream`` true (a 400 otherwise), and ``include_usage`` true unless it says otherwise
    (vLLM's ``StreamOptions.include_usage`` defaults to true; found in review: ``{}`` lost the
    usage at the door and the emulated worker alike); null reads as false, as vLLM reads it."""
    opts = body.get("stream_options")
    if opts is None:
        return False
    if not isinstance(opts, dict):
        raise OpenAIError(400, "stream_options must be an object", "stream_options", "invalid_type")
    if not stream:
        raise OpenAIError(400, "stream_options is only allowed when stream is true", "stream_options", "invalid_value")
    inc = opts.get("include_usage", True)
    if inc is not None and not isinstance(inc, bool):
        raise OpenAIError(400, "stream_options.include_usage must be a boolean", "stream_options.include_usage", "invalid_type")
    return bool(inc)


def client_closed() -> OpenAIError:
    """What a request whose client closed its connection before the answer ends with (nobody is
    likely to read it): the door and the emulated worker both abort such a request, as vLLM
    aborts a disconnected one."""
    return OpenAIError(400, "the client closed its connection before the answer: the request was aborted", code="client_closed")


def model_card(model: str, created: int, **extra: Any) -> dict[str, Any]:
    """One model as ``GET /v1/models`` lists it and ``GET /v1/models/{model}`` answers it
    (OpenAI's ``Model`` object; ``extra`` adds vLLM's fields such as ``max_model_len``)."""
    return {"id": model, "object": "model", "created": created, "owned_by": "kvcompass", **extra}


def models_list(cards: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """``GET /v1/models``'s body."""
    return {"object": "list", "data": list(cards)}


def model_not_found(model: str, served: Sequence[str]) -> OpenAIError:
    """The refusal of a model this server does not serve, in a request body or in
    ``/v1/models/{model}``: 404 ``model_not_found``, as OpenAI and vLLM answer it, naming what
    is served so a misspelt name is seen at once."""
    return OpenAIError(404, f"the model {model!r} does not exist; this server serves {list(served)}", "model", "model_not_found")


def _is_json(content_type: str) -> bool:
    media = content_type.split(";", 1)[0].strip().lower()
    return media == "application/json" or (media.startswith("application/") and media.endswith("+json"))


_decode_json = msgspec.json.Decoder().decode


def parse_json(raw: bytes | str) -> Any:
    """``raw`` as strict JSON (RFC 8259: no NaN or Infinity, no lone surrogates), decoded by
    msgspec: about six times the standard library's speed on a request body and two and a half
    on a 4,096-token prompt (0.6 against 3.7 us, 78 against 195 us, measured here), and both
    run on every request. ValueError for anything malformed, too deeply nested included."""
    try:
        return _decode_json(raw)
    except RecursionError:
        raise ValueError("the JSON is nested too deeply") from None


def decode_json_object(raw: bytes, content_type: str | None) -> dict[str, Any]:
    """``raw`` as a JSON object. ``content_type`` is the request's Content-Type header as sent
    (None when absent: a bare client that sends none is still served); any other media type
    than JSON is a 415, malformed or too deeply nested JSON a 400 (``invalid_json``), a JSON
    value that is not an object a 400 (``invalid_type``)."""
    if content_type is not None and content_type.strip() and not _is_json(content_type):
        raise OpenAIError(415, f"the request body must be JSON (Content-Type: application/json), got Content-Type {content_type.strip()!r}", None, "unsupported_media_type")
    try:
        body = _decode_json(raw)
    except RecursionError:
        raise OpenAIError(400, "could not parse the JSON body of the request: it is nested too deeply", None, "invalid_json") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise OpenAIError(400, f"could not parse the JSON body of the request: {e}", None, "invalid_json") from None
    if not isinstance(body, dict):
        raise OpenAIError(400, f"the request body must be a JSON object, got {type(body).__name__}", None, "invalid_type")
    return body


def token_ids(p: list[Any], param: str = "prompt") -> npt.NDArray[np.uint32]:
    """A prompt given as token ids: every one an integer in 0..2**32-1 (JSON true and false are
    not), checked and converted in one Rust pass."""
    arr, bad = _core.token_array(p)
    if bad >= 0:
        raise OpenAIError(400, f"{param} token ids must be integers in 0..2**32-1; {param}[{bad}] is {p[bad]!r}", param, "invalid_token_id")
    return arr


def _as_u32(ids: Any) -> npt.NDArray[np.uint32]:
    arr = np.asarray(ids)
    if arr.dtype != np.uint32:
        arr = arr.astype(np.uint32)
    return np.ascontiguousarray(arr.reshape(-1))


async def _run(fn: Tokenize, size: int, inline_chars: int, param: str, what: str, code: str) -> npt.NDArray[np.uint32]:
    try:
        ids = await asyncio.to_thread(fn) if size > inline_chars else fn()
    except (KVCompassError, ValueError, TypeError, KeyError) as e:
        raise OpenAIError(400, f"could not {what}: {e}", param, code) from None
    out = _as_u32(ids)
    if not len(out):
        raise OpenAIError(400, f"the {param} is empty: at least one token is needed", param, "empty_prompt")
    return out


def prompt_batch(body: Mapping[str, Any], limit: int) -> list[Any] | None:
    """The prompts of a batched completions request (``prompt`` a list of two or more strings or
    token-id lists), None for a request with one prompt. More than ``limit`` is a 400."""
    p = body.get("prompt")
    if not (isinstance(p, list) and len(p) > 1 and isinstance(p[0], (str, list))):
        return None
    if len(p) > limit:
        raise OpenAIError(400, f"prompt holds {len(p)} prompts; at most {limit} are accepted in one request", "prompt", "too_many_prompts")
    return p


async def prompt_tokens(body: dict[str, Any], encode: Callable[[str], Any], inline_chars: int = INLINE_TOKENIZE_CHARS) -> npt.NDArray[np.uint32]:
    """The tokens of a completions request's ``prompt``: a string (``encode``d), a list of token
    ids, or a batch of one of those. Several prompts are refused here: a caller that serves
    batches splits them first (:func:`prompt_batch`, :func:`one_prompt_tokens`)."""
    if "prompt" not in body or body["prompt"] is None:
        raise OpenAIError(400, "prompt is required", "prompt", "missing_prompt")
    p = body["prompt"]
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
        p = p[0]  # a batch of one is that prompt
    if isinstance(p, list) and p and isinstance(p[0], (str, list)):
        # Each prompt's own error first, as a caller that serves batches reports it.
        for i, one in enumerate(p):
            await one_prompt_tokens(one, encode, inline_chars, f"prompt[{i}]")
        raise OpenAIError(400, "batched prompts (several prompts in one request) are not supported here; send one request per prompt", "prompt", "unsupported")
    return await one_prompt_tokens(p, encode, inline_chars)


async def one_prompt_tokens(p: Any, encode: Callable[[str], Any], inline_chars: int = INLINE_TOKENIZE_CHARS, param: str = "prompt") -> npt.NDArray[np.uint32]:
    """The tokens of one prompt: a string (``encode``d) or a list of token ids. ``param`` names
    it in errors (``prompt[3]`` for a batch's fourth)."""
    if isinstance(p, str):
        if not p:
            raise OpenAIError(400, f"{param} must not be empty", param, "empty_prompt")
        text = p
        return await _run(lambda: encode(text), len(text), inline_chars, param, "tokenize the prompt", "invalid_prompt")
    if isinstance(p, list):
        if not p:
            raise OpenAIError(400, f"{param} must not be empty", param, "empty_prompt")
        if isinstance(p[0], (str, list)):
            raise OpenAIError(400, f"{param} must be a string or a list of token ids, not a list of prompts", param, "invalid_type")
        return token_ids(p, param)
    raise OpenAIError(400, f"{param} must be a string or a list of token ids, got {type(p).__name__}", param, "invalid_type")


async def batch_prompt_tokens(batch: Sequence[Any], encode: Callable[[str], Any], inline_chars: int = INLINE_TOKENIZE_CHARS) -> list[npt.NDArray[np.uint32]]:
    """The tokens of every prompt of a batch (errors name ``prompt[i]``). Whether the work
    leaves the event loop is decided by the batch's characters, not each prompt's: 256 prompts
    each just under the threshold were 5 million characters tokenized on the loop, every other
    request frozen for two seconds (found in review). Over it, each prompt goes to a thread."""
    total = sum(len(p) for p in batch if isinstance(p, str))
    inline = inline_chars if total <= inline_chars else -1
    return [await one_prompt_tokens(p, encode, inline, f"prompt[{i}]") for i, p in enumerate(batch)]


async def request_tokens(
    body: dict[str, Any],
    encode: Callable[..., Any],
    apply_chat_template: Callable[[list[dict[str, Any]], Any, dict[str, Any]], Any],
    *,
    chat: bool,
    batch: list[Any] | None,
    inline_chars: int = INLINE_TOKENIZE_CHARS,
    raw_bytes: int | None = None,
) -> list[npt.NDArray[np.uint32]]:
    """The prompts of a request body as an engine sees them: a chat's ``messages`` under the
    template, a completions request's one prompt, or each prompt of its batch (``batch``, from
    :func:`prompt_batch`), text prompts through ``encode`` (with ``add_special_tokens=False``
    when the body says so, as vLLM reads it). The door routes on these, the emulated worker
    prefills them, and ``kvcompass trace from-log`` measures a logged request with them: one
    reading of a body."""
    if chat:
        return [await chat_tokens(body, apply_chat_template, inline_chars, raw_bytes)]
    special = _typed_field(body, "add_special_tokens", bool)
    if special is False:
        encode = functools.partial(encode, add_special_tokens=False)
    if batch is None:
        return [await prompt_tokens(body, encode, inline_chars)]
    return await batch_prompt_tokens(batch, encode, inline_chars)


def _text_chars(obj: Any) -> int:
    """Characters of every string in a decoded JSON value: what a chat template may render
    (text inside content parts too; found in review: a 4 MB text part counted as nothing and
    was tokenized on the event loop, stalling every other request for seconds)."""
    n, stack = 0, [obj]
    while stack:
        x = stack.pop()
        if isinstance(x, str):
            n += len(x)
        elif isinstance(x, dict):
            stack.extend(x.values())
        elif isinstance(x, list):
            stack.extend(x)
    return n


async def chat_tokens(
    body: dict[str, Any], apply_chat_template: Callable[[list[dict[str, Any]], Any, dict[str, Any]], Any], inline_chars: int = INLINE_TOKENIZE_CHARS, raw_bytes: int | None = None
) -> npt.NDArray[np.uint32]:
    """The tokens of a chat request's ``messages`` (and ``tools``, which the template may render)
    under the model's chat template; each message an object with a string ``role`` and a
    string, list-of-parts or null ``content``; ``tools`` a list or absent.
    ``raw_bytes``, the body's length, decides whether the template runs off the event loop:
    free to read and never less than what the template renders (counting the strings was not:
    a body of millions of numbers counted as nothing and stalled the loop 2 s walking and
    rendering them, found in review)."""
    if "messages" not in body or body["messages"] is None:
        raise OpenAIError(400, "messages is required", "messages", "missing_messages")
    msgs = body["messages"]
    if not isinstance(msgs, list):
        raise OpenAIError(400, f"messages must be a list, got {type(msgs).__name__}", "messages", "invalid_type")
    if not msgs:
        raise OpenAIError(400, "messages must not be empty", "messages", "empty_prompt")
    for i, m in enumerate(msgs):
        if not isinstance(m, dict):
            raise OpenAIError(400, f"messages[{i}] must be an object", f"messages[{i}]", "invalid_type")
        if not isinstance(m.get("role"), str):
            raise OpenAIError(400, f"messages[{i}].role must be a string", f"messages[{i}].role", "invalid_type")
        c = m.get("content")
        if c is not None and not isinstance(c, (str, list)):
            raise OpenAIError(400, f"messages[{i}].content must be a string, a list of parts or null", f"messages[{i}].content", "invalid_type")
    tools = body.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise OpenAIError(400, f"tools must be a list, got {type(tools).__name__}", "tools", "invalid_type")
    options = _chat_options(body)
    size = raw_bytes if raw_bytes is not None else _text_chars(msgs) + (_text_chars(tools) if tools else 0)
    return await _run(lambda: apply_chat_template(msgs, tools, options), size, inline_chars, "messages", "apply the chat template", "invalid_messages")


_CHAT_OPTIONS = {"add_special_tokens": bool, "add_generation_prompt": bool, "continue_final_message": bool, "chat_template_kwargs": dict, "documents": list}
"""The request fields vLLM reads when it renders a chat, and their JSON types."""


_KIND_NAMES = {bool: "a boolean", dict: "an object", list: "a list"}


def _typed_field(body: Mapping[str, Any], name: str, kind: type) -> Any:
    """``body[name]`` (None when absent or null), a 400 unless it is of JSON type ``kind``."""
    v = body.get(name)
    if v is not None and not isinstance(v, kind):
        raise OpenAIError(400, f"{name} must be {_KIND_NAMES[kind]}", name, "invalid_type")
    return v


def _chat_options(body: Mapping[str, Any]) -> dict[str, Any]:
    """The chat fields the template is rendered with (see :data:`_CHAT_OPTIONS`), checked."""
    out: dict[str, Any] = {}
    for name, kind in _CHAT_OPTIONS.items():
        v = _typed_field(body, name, kind)
        if v is not None:
            out[name] = v
    if out.get("add_generation_prompt") and out.get("continue_final_message"):
        raise OpenAIError(400, "add_generation_prompt and continue_final_message cannot both be true", "continue_final_message", "invalid_value")
    return out
