"""The body of an OpenAI-style request, decoded once for every HTTP surface (the door and the
emulated worker), so both refuse the same bodies with the same status and code.

Why a module of its own: the two surfaces had each grown their own reading, and a body one of
them refused the other served (or answered with a traceback: deeply nested JSON raised
``RecursionError`` out of ``json.loads`` into a plain-text 500).
"""

from __future__ import annotations

import json
from typing import Any

__all__ = ["BodyError", "decode_json_object"]


class BodyError(Exception):
    """A body the surface refuses: ``status`` (400 or 415), ``code`` as OpenAI names it."""

    def __init__(self, status: int, message: str, code: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code


def _is_json(content_type: str) -> bool:
    media = content_type.split(";", 1)[0].strip().lower()
    return media == "application/json" or (media.startswith("application/") and media.endswith("+json"))


def decode_json_object(raw: bytes, content_type: str | None) -> dict[str, Any]:
    """``raw`` as a JSON object. ``content_type`` is the request's Content-Type header as sent
    (None when absent: a bare client that sends none is still served); any other media type
    than JSON is a 415, malformed or too deeply nested JSON a 400 (``invalid_json``), a JSON
    value that is not an object a 400 (``invalid_type``)."""
    if content_type is not None and content_type.strip() and not _is_json(content_type):
        raise BodyError(415, f"the request body must be JSON (Content-Type: application/json), got Content-Type {content_type.strip()!r}", "unsupported_media_type")
    try:
        body = json.loads(raw)
    except RecursionError:
        raise BodyError(400, "could not parse the JSON body of the request: it is nested too deeply", "invalid_json") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise BodyError(400, f"could not parse the JSON body of the request: {e}", "invalid_json") from None
    if not isinstance(body, dict):
        raise BodyError(400, f"the request body must be a JSON object, got {type(body).__name__}", "invalid_type")
    return body
