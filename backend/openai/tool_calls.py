"""DeepSeek-V4's tool calls (DSML) in generated text -> OpenAI `tool_calls`, as text streams in.

The model writes (DeepSeek's encoding_dsv4, as the shipped template renders past calls):

    <｜DSML｜tool_calls>
    <｜DSML｜invoke name="get_weather">
    <｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>
    <｜DSML｜parameter name="days" string="false">3</｜DSML｜parameter>
    </｜DSML｜invoke>
    </｜DSML｜tool_calls>

`string="true"` values are the text itself; others are JSON. Text outside a block is content. One
parser serves both forms: a whole response is fed once, a stream delta by delta, so they agree.
A block that does not parse is given back as content, with a log line, never an error."""

from __future__ import annotations

import json
import logging
import re
import uuid
from dataclasses import dataclass, field

from backend.openai.chat_template import partial_suffix

log = logging.getLogger("backend.openai")

DSML = "｜DSML｜"
CALLS_START, CALLS_END = f"<{DSML}tool_calls>", f"</{DSML}tool_calls>"
INVOKE_START, INVOKE_END = f"<{DSML}invoke", f"</{DSML}invoke>"
_INVOKE = re.compile(rf'{re.escape(INVOKE_START)}\s+name="([^"]*)"\s*>(.*?){re.escape(INVOKE_END)}', re.DOTALL)
_PARAMETER = re.compile(rf'<{re.escape(DSML)}parameter\s+name="([^"]*)"(?:\s+string="(true|false)")?\s*>'
                        rf'(.*?)</{re.escape(DSML)}parameter>', re.DOTALL)


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI's function.arguments
    id: str = field(default_factory=lambda: f"chatcmpl-tool-{uuid.uuid4().hex}")

    def openai(self, index: int | None = None) -> dict:
        """The message's tool_calls entry; with `index`, a stream delta's."""
        call = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return call if index is None else {"index": index, **call}


@dataclass
class Parsed:
    """What one feed yields: content text, and the calls completed by it."""

    content: str = ""
    calls: list[ToolCall] = field(default_factory=list)


def parse_invoke(text: str) -> ToolCall:
    """One whole `<｜DSML｜invoke ...>...</｜DSML｜invoke>` -> a ToolCall; ValueError when malformed."""
    match = _INVOKE.fullmatch(text.strip())
    if match is None or not match.group(1):
        raise ValueError(f"not an invoke: {text[:80]!r}")
    name, body = match.groups()
    arguments, end = {}, 0
    for parameter in _PARAMETER.finditer(body):
        if body[end:parameter.start()].strip():
            raise ValueError(f"text between parameters: {body[end:parameter.start()][:80]!r}")
        key, is_string, value = parameter.groups()
        arguments[key] = value if is_string == "true" else _json_or_text(value)
        end = parameter.end()
    if body[end:].strip():
        raise ValueError(f"text after the parameters: {body[end:][:80]!r}")
    return ToolCall(name, json.dumps(arguments, ensure_ascii=False))


def _json_or_text(value: str):
    """A non-string parameter is JSON; a model that wrote bare text there meant the text."""
    try:
        return json.loads(value)
    except json.JSONDecodeError:
        return value


class ToolCallParser:
    """Generated text, fed in pieces -> content and completed calls. A tail that may be the start of
    a block is held back until the next piece decides; `finish()` gives back what is left."""

    def __init__(self):
        self.buffer = ""  # text not yet given out
        self.in_block = False
        self.broken = False  # a malformed block was seen: the rest passes through as content
        self.calls: list[ToolCall] = []

    def feed(self, text: str) -> Parsed:
        self.buffer += text
        out = Parsed()
        while True:
            if self.broken:
                out.content += self.buffer
                self.buffer = ""
                return out
            if not self.in_block:
                start = self.buffer.find(CALLS_START)
                if start < 0:
                    keep = partial_suffix(self.buffer, CALLS_START)
                    out.content += self.buffer[:len(self.buffer) - keep]
                    self.buffer = self.buffer[len(self.buffer) - keep:]
                    return out
                out.content += self.buffer[:start]
                self.buffer = self.buffer[start + len(CALLS_START):]
                self.in_block, self.block_calls = True, 0
                continue
            rest = self.buffer.lstrip()
            if rest.startswith(CALLS_END):
                self.buffer, self.in_block = rest[len(CALLS_END):], False
                continue
            if rest.startswith(INVOKE_START):
                end = rest.find(INVOKE_END)
                if end < 0:
                    return out  # the invoke is still coming
                try:
                    call = parse_invoke(rest[:end + len(INVOKE_END)])
                except ValueError as e:
                    out.content += self._give_up(str(e))
                    continue
                self.calls.append(call)
                out.calls.append(call)
                self.block_calls += 1
                self.buffer = rest[end + len(INVOKE_END):]
                continue
            if not rest or CALLS_END.startswith(rest) or INVOKE_START.startswith(rest):
                return out  # a tag is still coming
            out.content += self._give_up(f"unexpected text in a tool-call block: {rest[:80]!r}")

    def finish(self) -> Parsed:
        """The end of the text: what was held back; an unclosed block's calls stand, its rest is content."""
        out = Parsed()
        if self.in_block and not self.broken:
            rest = self.buffer.strip()
            if rest and not (self.block_calls and CALLS_END.startswith(rest)):
                out.content += self._give_up(f"the tool-call block is cut off: {rest[:80]!r}")
            else:
                self.buffer = ""
        out.content += self.buffer
        self.buffer = ""
        return out

    def _give_up(self, reason: str) -> str:
        """A malformed block: logged, and its unparsed text handed back as content."""
        log.warning("a tool call does not parse, returned as content: %s", reason)
        self.broken = True
        text = (CALLS_START if not self.block_calls else "") + self.buffer
        self.buffer = ""
        return text

