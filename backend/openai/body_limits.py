"""Request-body limits: a size cap and a nesting-depth cap checked before JSON parsing, and text
that is valid Unicode after it.

Deeply nested JSON is a known way to crash parsers (Triton's own segfaults on ~200k nested
arrays; Python's raises RecursionError after using the stack): the depth is found by a cheap scan
that drops escapes and strings with two regular expressions, then counts brackets only."""

from __future__ import annotations

import re

from backend.openai.errors import OpenAIError

MAX_BODY_BYTES = 16 << 20  # far above any prompt the engine takes (max_prompt_bytes is per request)
MAX_JSON_DEPTH = 64  # OpenAI bodies nest about 5 deep (messages -> content parts -> fields)

_ESCAPE = re.compile(rb"\\.", re.DOTALL)
_STRING = re.compile(rb'"[^"]*"')
_NOT_BRACKET = re.compile(rb"[^\[\]{}]+")


def json_depth(body: bytes, stop_above: int | None = None) -> int:
    """Deepest bracket nesting of a JSON text, outside strings (stops counting past `stop_above`)."""
    structure = _NOT_BRACKET.sub(b"", _STRING.sub(b"", _ESCAPE.sub(b"", body)))
    depth = deepest = 0
    for char in structure:
        if char in b"[{":
            depth += 1
            if depth > deepest:
                deepest = depth
                if stop_above is not None and deepest > stop_above:
                    break
        else:
            depth -= 1
    return deepest


def check_size(size: int, max_bytes: int = MAX_BODY_BYTES) -> None:
    if size > max_bytes:
        raise OpenAIError(413, f"request body is {size} bytes or more; at most {max_bytes}",
                          code="request_too_large")


def check_depth(body: bytes, max_depth: int = MAX_JSON_DEPTH) -> None:
    depth = json_depth(body, stop_above=max_depth)
    if depth > max_depth:
        raise OpenAIError(400, f"request body nests deeper than {max_depth} levels", code="json_too_deep")


def has_lone_surrogate(value) -> bool:
    """JSON's "\\ud800" escapes decode to a lone UTF-16 surrogate, which no UTF-8 encoder (Triton's
    BYTES tensors, the tokenizer) takes."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return True
        return False
    if isinstance(value, dict):
        return any(has_lone_surrogate(k) or has_lone_surrogate(v) for k, v in value.items())
    if isinstance(value, list):
        return any(has_lone_surrogate(v) for v in value)
    return False


def check_text(value) -> None:
    if has_lone_surrogate(value):
        raise OpenAIError(400, "the request body holds a lone UTF-16 surrogate (an escape such as \\ud800 "
                          "without its pair): not valid Unicode text", code="invalid_unicode")
