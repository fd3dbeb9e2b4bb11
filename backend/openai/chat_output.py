"""One chat choice's generated text -> the OpenAI message: reasoning_content, content, tool_calls.

Fed piece by piece (a stream's deltas, or a whole response at once), so streamed and
non-streamed answers split the same way. Thinking text runs until </think>, or until a tool-call
block starts (a model that forgets </think> still calls); tool-call blocks become `tool_calls`
when tools are on; a forced call (tool_choice required or named) is the grammar's JSON, read
whole at the end."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from backend.openai.chat_template import ReasoningSplitter
from backend.openai.structured import forced_calls
from backend.openai.tool_calls import CALLS_START, ToolCall, ToolCallParser

log = logging.getLogger("backend.openai")


@dataclass
class Piece:
    reasoning: str = ""
    content: str = ""
    calls: list[ToolCall] = field(default_factory=list)


class ChatOutput:
    def __init__(self, thinking: bool, tools: bool, forced_choice=None, parallel: bool | None = None):
        """`tools`: calls are parsed from the text; `forced_choice`: tool_choice of a forced call."""
        self.thinking = thinking
        self.splitter = ReasoningSplitter(thinking, CALLS_START if tools else None)
        self.parser = ToolCallParser() if tools and forced_choice is None else None
        self.forced_choice, self.forced_text = forced_choice, ""
        self.single = parallel is False
        self.calls: list[ToolCall] = []

    def feed(self, text: str) -> Piece:
        if self.forced_choice is not None:
            self.forced_text += text
            return Piece()
        reasoning, content = self.splitter.feed(text)
        return self._calls(Piece(reasoning, content))

    def finish(self) -> Piece:
        if self.forced_choice is not None:
            calls = forced_calls(self.forced_text, self.forced_choice)
            return self._keep(Piece(calls=calls)) if calls else Piece(content=self.forced_text)
        reasoning, content = self.splitter.flush()
        piece = self._calls(Piece(reasoning, content))
        if self.parser is not None:
            piece.content += self.parser.finish().content
        return piece

    def finish_reason(self, engine_reason: str | None) -> str | None:
        """A response that ends in calls finishes with "tool_calls" (OpenAI's)."""
        return "tool_calls" if self.calls and engine_reason == "stop" else engine_reason

    def _calls(self, piece: Piece) -> Piece:
        if self.parser is None:
            return piece
        parsed = self.parser.feed(piece.content)
        piece.content, piece.calls = parsed.content, parsed.calls
        return self._keep(piece)

    def _keep(self, piece: Piece) -> Piece:
        """parallel_tool_calls=false: the first call only."""
        if self.single:
            room = 0 if self.calls else 1
            if len(piece.calls) > room:
                log.warning("parallel_tool_calls is false: %d further call(s) dropped", len(piece.calls) - room)
            piece.calls = piece.calls[:room]
        self.calls += piece.calls
        return piece


def message(pieces: list[Piece], thinking: bool) -> dict:
    """The non-streamed message from a choice's pieces."""
    reasoning = "".join(p.reasoning for p in pieces)
    content = "".join(p.content for p in pieces)
    calls = [c for p in pieces for c in p.calls]
    out = {"role": "assistant", "content": content if content.strip() or not calls else None}
    if thinking:
        out["reasoning_content"] = reasoning
    if calls:
        out["tool_calls"] = [c.openai() for c in calls]
    return out
