"""A model's own chat template, rendered as the engines render it.

Why: prefix keys are computed from token ids, so the door must produce, for a chat request,
exactly the ids the engine will prefill; otherwise every key it looks up differs from the keys
the engine's KV events registered, and no chat request ever finds a cache. vLLM renders a chat
with the model's Jinja template (through ``transformers``' ``apply_chat_template``,
``tokenize=False``) and tokenizes the text with ``add_special_tokens=False`` unless the request
says otherwise; the built-in ChatML format is right only for ChatML models.

**Where the template comes from** (as ``transformers`` loads it): ``chat_template.jinja`` beside
the tokenizer, else ``tokenizer_config.json``'s ``chat_template`` (a string, or named templates);
named templates also from ``additional_chat_templates/*.jinja``. A request with tools takes the
one named ``tool_use`` when there is one, else ``default``.

**Rendering** (as ``transformers`` renders): a sandboxed Jinja environment with ``trim_blocks``
and ``lstrip_blocks`` and the loop controls, the ``tojson`` filter, ``raise_exception`` and
``strftime_now`` (local time: a door and an engine in different time zones disagree on a
template that prints today's date), the tokenizer's special tokens (``bos_token``, ...),
``messages``, ``tools`` and ``documents`` (None when absent), ``add_generation_prompt`` and the
request's ``chat_template_kwargs``; ``continue_final_message`` cuts the text after the last
message's content.

**Messages and tools as vLLM hands them to the template** (``vllm/entrypoints/chat_utils.py``):
only ``role``, ``content``, ``name``, ``tool_call_id``, ``tool_calls`` (an assistant's, when not
empty; each call's ``arguments`` parsed from JSON, ``{}`` when they are not JSON) and the
reasoning fields (``reasoning_content`` and ``reasoning``, each set from either). Content is a
string for templates that print it and a list of parts for templates that loop over it (vLLM's
"openai" content format, found the way vLLM finds it: a ``for`` over a message's
``content``): text parts (``text``, ``input_text``, ``output_text``, ``refusal``, ``thinking``)
joined by newlines in the first case, ``{"type": "text", "text": ...}`` parts in the second, and
media as ``{"type": "image"}`` (``"audio"``, ``"video"``) parts there and as nothing in the first
(vLLM would add its model-specific placeholder text: not reproduced). A tool is rebuilt as
``{"type", "function": {"name", "description", "parameters"}}`` (vLLM's request model).
**An operator's template** (vLLM's ``--chat-template``, the topology's ``chat_template``):
:func:`read_chat_template` reads the value as vLLM does (a file when one opens, else the
template itself when it holds ``{``, ``}`` or a newline, else an error naming the path), and
:func:`override_chat_templates` makes it the one template for every request, tools or not (vLLM
puts the flag before the tokenizer's templates), with the special tokens of the
``tokenizer_config.json`` beside the tokenizer. Not reproduced: vLLM's own fallback templates
named without a path, Mistral's ``mistral_common`` tokenizer mode, ``reasoning_effort``.
"""

from __future__ import annotations

import datetime as dt
import json
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from kvcompass.errors import InvalidArgumentError

__all__ = ["ChatTemplate", "ChatTemplates", "load_chat_templates", "override_chat_templates", "read_chat_template"]

_SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")
_TEXT_PARTS = {"text": "text", "input_text": "text", "output_text": "text", "refusal": "refusal", "thinking": "thinking"}
_MEDIA_PARTS = {"image_url": "image", "input_image": "image", "image": "image", "input_audio": "audio", "audio_url": "audio", "video_url": "video"}
_KEPT = ("role", "content", "name", "tool_call_id")
# A ``for`` over a message's content: the template takes content as a list of parts.
_LOOPS_CONTENT = re.compile(r"\{%-?\s*for\s+\w+\s+in\s+\w+(?:\[\s*['\"]content['\"]\s*\]|\.content(?!\w))")


class ChatTemplate:
    """One compiled template and the special tokens it may name."""

    def __init__(self, source: str, special: Mapping[str, str] | None = None, origin: str = "chat template") -> None:
        import jinja2
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str) -> None:
            raise jinja2.exceptions.TemplateError(message)

        def tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None, sort_keys: bool = False) -> str:
            return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

        def strftime_now(fmt: str) -> str:
            return dt.datetime.now().strftime(fmt)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
        env.filters["tojson"] = tojson
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = strftime_now
        try:
            self._template = env.from_string(source)
        except jinja2.exceptions.TemplateError as e:
            raise InvalidArgumentError(f"{origin} is not a valid Jinja template: {e}") from None
        self._error = jinja2.exceptions.TemplateError
        self.special = dict(special or {})
        self.origin = origin
        self.parts = bool(_LOOPS_CONTENT.search(source))
        """Whether the template takes content as a list of parts (vLLM's "openai" format)."""

    def render(
        self,
        messages: Sequence[Any],
        *,
        tools: Sequence[Any] | None = None,
        documents: Sequence[Any] | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        extra: Mapping[str, Any] | None = None,
    ) -> str:
        """The prompt text of ``messages``; a template that refuses them (``raise_exception``,
        a missing field) is an InvalidArgumentError (a 400 at the door, as at vLLM)."""
        msgs = [_message(i, m, self.parts) for i, m in enumerate(messages)]
        kwargs: dict[str, Any] = {
            **self.special,
            **(extra or {}),
            "messages": msgs,
            "tools": None if tools is None else [_tool(i, t) for i, t in enumerate(tools)],
            "documents": None if documents is None else list(documents),
            "add_generation_prompt": add_generation_prompt and not continue_final_message,
        }
        try:
            text = str(self._template.render(**kwargs))
        except self._error as e:
            raise InvalidArgumentError(f"the model's chat template refused the messages: {e}") from None
        except (TypeError, ValueError, KeyError, AttributeError) as e:
            raise InvalidArgumentError(f"the model's chat template could not render the messages: {e}") from None
        if continue_final_message:
            last = msgs[-1].get("content") if msgs else None
            final = last if isinstance(last, str) else "".join(p.get("text", "") for p in last or [] if isinstance(p, dict))
            if final.strip() and final.strip() in text:
                text = text[: text.rindex(final.strip()) + len(final.strip())]
        return text


class ChatTemplates:
    """A model's templates: the default and any named ones (``tool_use`` for tool requests)."""

    def __init__(self, default: ChatTemplate | None, named: Mapping[str, ChatTemplate] | None = None) -> None:
        self.named = dict(named or {})
        self.default = default if default is not None else self.named.get("default")

    def pick(self, tools: object) -> ChatTemplate | None:
        if tools is not None and "tool_use" in self.named:
            return self.named["tool_use"]
        return self.default


def _message(i: int, m: Any, parts: bool) -> dict[str, Any]:
    where = f"messages[{i}]"
    if not isinstance(m, Mapping):
        raise InvalidArgumentError(f"{where} must be an object")
    out = {k: m[k] for k in _KEPT if k in m and m[k] is not None}
    out["content"] = _content(where, m.get("content"), parts)
    calls = m.get("tool_calls")
    if out.get("role") == "assistant" and isinstance(calls, list) and calls:
        out["tool_calls"] = [_call(c) for c in calls]
    reasoning = m.get("reasoning_content", m.get("reasoning"))
    if reasoning is not None:
        out["reasoning_content"] = out["reasoning"] = reasoning
    return out


def _content(where: str, content: Any, parts: bool) -> Any:
    if content is None:
        return [] if parts else ""
    if isinstance(content, str):
        return [{"type": "text", "text": content}] if parts else content
    if not isinstance(content, list):
        raise InvalidArgumentError(f"{where}.content must be a string, a list of parts or null")
    texts: list[str] = []
    out: list[dict[str, Any]] = []
    for j, p in enumerate(content):
        kind = p.get("type") if isinstance(p, Mapping) else None
        if not isinstance(kind, str):
            raise InvalidArgumentError(f"{where}.content[{j}] must be an object with a string type")
        if kind in _TEXT_PARTS:
            text = p.get(_TEXT_PARTS[kind])
            if text is None:
                continue
            texts.append(str(text))
            out.append({"type": "text", "text": str(text)})
        elif kind in _MEDIA_PARTS:
            out.append({"type": _MEDIA_PARTS[kind]})
    return out if parts else "\n".join(texts)


def _call(c: Any) -> Any:
    fn = c.get("function") if isinstance(c, Mapping) else None
    if not isinstance(fn, Mapping):
        return c
    args = fn.get("arguments")
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            args = {}
    return {**c, "function": {**fn, "arguments": {} if args is None else args}}


def _tool(i: int, t: Any) -> dict[str, Any]:
    fn = t.get("function") if isinstance(t, Mapping) else None
    if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str):
        raise InvalidArgumentError(f"tools[{i}] must be an object with a function that has a string name")
    return {"type": t.get("type", "function"), "function": {"name": fn["name"], "description": fn.get("description"), "parameters": fn.get("parameters")}}


def _token_text(v: Any) -> str | None:
    if isinstance(v, str):
        return v
    if isinstance(v, Mapping) and isinstance(v.get("content"), str):
        return str(v["content"])
    return None


def _config(directory: Path) -> tuple[Path, dict[str, Any], dict[str, str]]:
    """The directory's ``tokenizer_config.json``: its path, its object ({} when absent) and the
    special tokens it names."""
    config = directory / "tokenizer_config.json"
    d: dict[str, Any] = {}
    if config.is_file():
        try:
            d = json.loads(config.read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            raise InvalidArgumentError(f"tokenizer config {str(config)!r} cannot be read as JSON: {e}") from None
        if not isinstance(d, dict):
            raise InvalidArgumentError(f"tokenizer config {str(config)!r} is not a JSON object")
    return config, d, {k: t for k in _SPECIAL_KEYS if (t := _token_text(d.get(k))) is not None}


def read_chat_template(value: str, base_dir: Path | None = None) -> tuple[str, str]:
    """``(source, origin)`` of an operator's template as vLLM reads ``--chat-template``: the file
    ``value`` names (relative to ``base_dir``, a topology file's directory) when it opens, else
    ``value`` itself when it holds ``{``, ``}`` or a newline (an inline template), else an
    InvalidArgumentError: a path that does not open is a mistake, not a one-line template. An
    inline template is taken as written, as current vLLM takes it (its older releases decoded
    backslash escapes in it first: with one of those, give the template as a file)."""
    if not isinstance(value, str) or not value:
        raise InvalidArgumentError(f"a chat template must be a file's path or a Jinja template, got {value!r}")
    p = Path(value)
    if base_dir is not None and not p.is_absolute() and "\n" not in value:
        p = base_dir / p
    try:
        return p.read_text(encoding="utf-8"), f"the chat template {p}"
    except (OSError, ValueError) as e:
        if not any(c in value for c in "{}\n"):
            raise InvalidArgumentError(f"the chat template {value!r} looks like a file's path, but {str(p)!r} cannot be read: {e}") from None
    return value, "the inline chat template"


def override_chat_templates(source: str, origin: str, directory: Path) -> ChatTemplates:
    """``source`` as the only template of the model whose tokenizer is in ``directory`` (its
    special tokens from the ``tokenizer_config.json`` there): every request, with tools or
    without, is rendered by it, as vLLM renders with ``--chat-template``."""
    _, _, special = _config(directory)
    return ChatTemplates(ChatTemplate(source, special, origin))


def load_chat_templates(directory: Path) -> ChatTemplates | None:
    """A model directory's chat templates (see the module notes), None when it has none."""
    config, d, special = _config(directory)

    def compile_(source: object, origin: str) -> ChatTemplate:
        if not isinstance(source, str):
            raise InvalidArgumentError(f"{origin} must be a string")
        return ChatTemplate(source, special, origin)

    default: ChatTemplate | None = None
    named: dict[str, ChatTemplate] = {}
    jinja = directory / "chat_template.jinja"
    source = d.get("chat_template")
    if jinja.is_file():
        default = compile_(jinja.read_text(encoding="utf-8"), f"the chat template {jinja}")
    elif isinstance(source, list):
        for t in source:
            if not isinstance(t, dict) or not isinstance(t.get("name"), str):
                raise InvalidArgumentError(f"tokenizer config {str(config)!r}: chat_template must be a string or a list of {{name, template}}")
            named[t["name"]] = compile_(t.get("template"), f"the chat template {t['name']!r} of {config}")
    elif source is not None:
        default = compile_(source, f"the chat template of {config}")
    extra = directory / "additional_chat_templates"
    if extra.is_dir():
        for f in sorted(extra.glob("*.jinja")):
            named.setdefault(f.stem, compile_(f.read_text(encoding="utf-8"), f"the chat template {f}"))
    if default is None and not named:
        return None
    return ChatTemplates(default, named)
