"""A model's own chat template, rendered as the engines render it.

Why: prefix keys are computed from token ids, so the door must produce, for a chat request,
exactly the ids the engine will prefill; otherwise every key it looks up differs from the keys
the engine's KV events registered, and no chat request ever finds a cache. vLLM renders a chat
with the model's Jinja template from ``tokenizer_config.json`` (through ``transformers``'
``apply_chat_template``, ``tokenize=False``) and tokenizes the text with
``add_special_tokens=False``; the built-in ChatML format is right only for ChatML models.

This module renders the same way: a sandboxed Jinja environment with ``trim_blocks`` and
``lstrip_blocks``, the ``tojson`` filter, ``raise_exception`` and ``strftime_now`` (the
globals ``transformers`` gives templates), the tokenizer's special tokens (``bos_token``,
``eos_token``, ...) as variables, ``messages``, ``tools`` and
``add_generation_prompt`` (``tools`` and ``documents`` None when absent, as ``transformers``
passes them). Messages are normalised as vLLM normalises them for templates that
take string content: a list of content parts becomes its text parts joined by newlines (other
parts, images and audio, add no text), and an assistant's ``tool_calls`` arguments given as a
JSON string are parsed into an object (templates such as Llama 3.1's ``tojson`` them).
Templates that take content as a list of parts, or use ``{% generation %}`` blocks, are not
reproduced.
"""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from kvcompass.errors import InvalidArgumentError

__all__ = ["ChatTemplate", "load_chat_template"]

_SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")
_TEXT_PARTS = ("text", "input_text", "output_text")


class ChatTemplate:
    """A compiled template and the special tokens it may name."""

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

    def render(self, messages: Sequence[Any], *, tools: Sequence[Any] | None = None, add_generation_prompt: bool = True) -> str:
        """The prompt text of ``messages``; a template that refuses them (``raise_exception``,
        a missing field) is an InvalidArgumentError (a 400 at the door, as at vLLM)."""
        # As transformers passes them: tools and documents None when the request has none.
        kwargs: dict[str, Any] = {
            **self.special,
            "messages": [_normalise(m) for m in messages],
            "tools": None if tools is None else list(tools),
            "documents": None,
            "add_generation_prompt": add_generation_prompt,
        }
        try:
            return str(self._template.render(**kwargs))
        except self._error as e:
            raise InvalidArgumentError(f"the model's chat template refused the messages: {e}") from None
        except (TypeError, ValueError, KeyError, AttributeError) as e:
            raise InvalidArgumentError(f"the model's chat template could not render the messages: {e}") from None


def _normalise(m: Any) -> Any:
    if not isinstance(m, Mapping):
        return m
    out = dict(m)
    content = out.get("content")
    if isinstance(content, list):
        out["content"] = "\n".join(str(p.get("text", "")) for p in content if isinstance(p, Mapping) and p.get("type", "text") in _TEXT_PARTS)
    calls = out.get("tool_calls")
    if isinstance(calls, list):
        fixed = []
        for c in calls:
            fn = c.get("function") if isinstance(c, Mapping) else None
            if isinstance(fn, Mapping) and isinstance(fn.get("arguments"), str):
                try:
                    args = json.loads(fn["arguments"])
                except ValueError:
                    args = fn["arguments"]
                c = {**c, "function": {**fn, "arguments": args}}
            fixed.append(c)
        out["tool_calls"] = fixed
    return out


def _token_text(v: Any) -> str | None:
    if isinstance(v, str):
        return v
    if isinstance(v, Mapping) and isinstance(v.get("content"), str):
        return str(v["content"])
    return None


def load_chat_template(config: Path) -> ChatTemplate | None:
    """The chat template of an HF ``tokenizer_config.json`` (its ``chat_template``: a string, or
    a list of named templates of which ``default`` is taken), None when it has none."""
    try:
        d = json.loads(config.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise InvalidArgumentError(f"tokenizer config {str(config)!r} cannot be read as JSON: {e}") from None
    if not isinstance(d, dict):
        raise InvalidArgumentError(f"tokenizer config {str(config)!r} is not a JSON object")
    source = d.get("chat_template")
    if isinstance(source, list):
        named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
        source = named.get("default")
    if source is None:
        return None
    if not isinstance(source, str):
        raise InvalidArgumentError(f"tokenizer config {str(config)!r}: chat_template must be a string or a list of named templates with a 'default'")
    special = {k: t for k in _SPECIAL_KEYS if (t := _token_text(d.get(k))) is not None}
    return ChatTemplate(source, special, f"the chat template of {config}")
