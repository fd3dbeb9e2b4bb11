"""/v1/responses: the subset of OpenAI's Responses API that vLLM serves, on the chat path.

A Responses request becomes a chat request (instructions -> a system message, input items ->
messages, function tools and tool_choice -> chat's, text.format -> response_format,
reasoning.effort -> reasoning_effort), so the template, tool calls and grammars are chat's. The
generated message comes back as output items (reasoning, message with output_text, function_call)
or, streamed, as the Responses events (response.created ... response.completed). Nothing is
stored: previous_response_id and background are refused, store is accepted and ignored."""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Literal

from pydantic import Field

from backend.openai.chat_output import Piece
from backend.openai.errors import bad_request
from backend.openai.requests import REASONING_EFFORTS, _Lenient
from backend.openai.tool_calls import ToolCall

_TEXT_PARTS = ("input_text", "output_text", "text")
# chat fields a Responses body may carry as vLLM's extras (same names, same meaning)
_PASSED_THROUGH = ("seed", "top_k", "min_p", "min_tokens", "stop", "stop_token_ids", "ignore_eos",
                   "repetition_penalty", "presence_penalty", "frequency_penalty", "logit_bias", "chat_template_kwargs",
                   "structured_outputs", "skip_special_tokens")


class Reasoning(_Lenient):
    effort: Literal[tuple(REASONING_EFFORTS)] | None = None
    summary: str | None = None  # accepted: the reasoning comes back whole, not summarised


class ResponsesRequest(_Lenient):
    model: str
    input: str | Annotated[list[dict], Field(min_length=1)]
    instructions: str | None = None
    max_output_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    tools: list[dict] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict | None = None
    parallel_tool_calls: bool | None = None
    stream: bool = False
    reasoning: Reasoning | None = None
    text: dict | None = None  # {"format": {"type": "text" | "json_object" | "json_schema", ...}}
    previous_response_id: str | None = None
    background: bool | None = None
    store: bool | None = None  # accepted: nothing is stored
    metadata: dict | None = None
    user: str | None = None
    truncation: Literal["disabled", "auto"] | None = None
    include: list[str] | None = None

    def chat_body(self) -> dict:
        """The chat completions request this one stands for (ChatCompletionRequest parses it)."""
        if self.previous_response_id is not None:
            raise bad_request("previous_response_id is not supported: this server stores no responses; send the "
                              "conversation as input items", "previous_response_id")
        if self.background:
            raise bad_request("background responses are not supported", "background")
        body = {"model": self.model, "messages": self.messages(), "stream": self.stream}
        for name, value in (("max_tokens", self.max_output_tokens), ("temperature", self.temperature),
                            ("top_p", self.top_p), ("parallel_tool_calls", self.parallel_tool_calls)):
            if value is not None:
                body[name] = value
        extras = self.model_extra or {}
        body.update({k: extras[k] for k in _PASSED_THROUGH if k in extras})
        if self.reasoning is not None and self.reasoning.effort is not None:
            body["reasoning_effort"] = self.reasoning.effort
        if self.tools:
            body["tools"] = [_chat_tool(tool, i) for i, tool in enumerate(self.tools)]
        if self.tool_choice is not None:
            body["tool_choice"] = _chat_tool_choice(self.tool_choice)
        text_format = (self.text or {}).get("format")
        if text_format is not None:
            body["response_format"] = _response_format(text_format)
        return body

    def messages(self) -> list[dict]:
        messages = [{"role": "system", "content": self.instructions}] if self.instructions else []
        items = [{"role": "user", "content": self.input}] if isinstance(self.input, str) else self.input
        for i, item in enumerate(items):
            kind, where = item.get("type", "message"), f"input.{i}"
            if kind == "message":
                if item.get("role") not in ("user", "system", "developer", "assistant"):
                    raise bad_request(f"{where}.role must be 'user', 'system', 'developer' or 'assistant', got "
                                      f"{item.get('role')!r}", f"{where}.role")
                messages.append({"role": item["role"], "content": _text(item.get("content"), f"{where}.content")})
            elif kind == "function_call":
                call = {"id": _field(item, "call_id", where), "type": "function",
                        "function": {"name": _field(item, "name", where), "arguments": item.get("arguments", "{}")}}
                last = messages[-1] if messages else None
                if last is not None and last["role"] == "assistant":  # parallel calls: one assistant turn
                    last.setdefault("tool_calls", []).append(call)
                else:
                    messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
            elif kind == "function_call_output":
                output = item.get("output")
                messages.append({"role": "tool", "tool_call_id": _field(item, "call_id", where),
                                 "content": output if isinstance(output, str) else _text(output, f"{where}.output")})
            elif kind == "reasoning":
                continue  # earlier turns' reasoning: DeepSeek's template drops it from the history
            else:
                raise bad_request(f"{where}.type {kind!r} is not supported (message, function_call, "
                                  "function_call_output, reasoning)", f"{where}.type")
        return messages


def _field(item: dict, name: str, where: str) -> str:
    value = item.get(name)
    if not isinstance(value, str) or not value:
        raise bad_request(f"{where}.{name} must be a non-empty string", f"{where}.{name}")
    return value


def _text(content, where: str) -> str:
    """A message's content: a string, or text parts (input_text / output_text) joined."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{where} must be a string or a list of text parts", where)
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") not in _TEXT_PARTS or not isinstance(part.get("text"), str):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise bad_request(f"{where}.{j}: only text parts are supported (input_text, output_text), got {kind!r}",
                              f"{where}.{j}")
        texts.append(part["text"])
    return "".join(texts)


def _chat_tool(tool: dict, i: int) -> dict:
    if tool.get("type") != "function":
        raise bad_request(f"tools.{i}.type {tool.get('type')!r} is not supported: only function tools",
                          f"tools.{i}.type")
    function = {k: tool[k] for k in ("name", "description", "parameters", "strict") if tool.get(k) is not None}
    return {"type": "function", "function": function}


def _chat_tool_choice(choice):
    if isinstance(choice, str):
        return choice
    if choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise bad_request("tool_choice must be 'none', 'auto', 'required' or {\"type\": \"function\", \"name\": ...}",
                      "tool_choice")


def _response_format(text_format: dict) -> dict:
    if not isinstance(text_format, dict) or text_format.get("type") not in ("text", "json_object", "json_schema"):
        raise bad_request("text.format.type must be 'text', 'json_object' or 'json_schema'", "text.format.type")
    if text_format["type"] != "json_schema":
        return {"type": text_format["type"]}
    schema = {k: text_format[k] for k in ("name", "description", "schema", "strict") if k in text_format}
    return {"type": "json_schema", "json_schema": schema}


class ResponseBuilder:
    """One response's output items and, streamed, its events (each with its sequence_number)."""

    def __init__(self, model: str, req: ResponsesRequest):
        self.id = f"resp_{uuid.uuid4().hex}"
        self.created_at = int(time.time())
        self.model, self.req = model, req
        self.sequence = 0
        self.items: list[dict] = []  # the output items, in order
        self.open: dict | None = None  # the streamed item still growing (reasoning or message)
        self.usage = {"input_tokens": 0, "output_tokens": 0}

    def count(self, output) -> None:
        if output.num_input_tokens is not None:
            self.usage["input_tokens"] = output.num_input_tokens
        self.usage["output_tokens"] += output.num_output_tokens

    # ------------------------------------------------------------------ the response object

    def response(self, status: str = "completed", incomplete: str | None = None) -> dict:
        tools = self.req.tools or []
        usage = {"input_tokens": self.usage["input_tokens"], "input_tokens_details": {"cached_tokens": 0},
                 "output_tokens": self.usage["output_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
                 "total_tokens": self.usage["input_tokens"] + self.usage["output_tokens"]}
        return {"id": self.id, "object": "response", "created_at": self.created_at, "model": self.model,
                "status": status, "incomplete_details": {"reason": incomplete} if incomplete else None,
                "error": None, "output": self.items if status != "in_progress" else [],
                "instructions": self.req.instructions, "max_output_tokens": self.req.max_output_tokens,
                "temperature": self.req.temperature, "top_p": self.req.top_p, "tools": tools,
                "tool_choice": self.req.tool_choice or ("auto" if tools else "none"),
                "parallel_tool_calls": self.req.parallel_tool_calls is not False,
                "text": self.req.text or {"format": {"type": "text"}},
                "reasoning": self.req.reasoning.model_dump() if self.req.reasoning else None,
                "previous_response_id": None, "store": False, "truncation": self.req.truncation or "disabled",
                "metadata": self.req.metadata, "user": self.req.user,
                "usage": usage if status != "in_progress" else None}

    def final(self, engine_reason: str | None) -> dict:
        """The finished response: "incomplete" when max_output_tokens cut it."""
        if engine_reason == "length":
            return self.response("incomplete", "max_output_tokens")
        return self.response()

    def add_message(self, pieces: list[Piece]) -> None:
        """A non-streamed answer's items: reasoning, then text, then the calls."""
        reasoning = "".join(p.reasoning for p in pieces)
        content = "".join(p.content for p in pieces)
        calls = [c for p in pieces for c in p.calls]
        if reasoning:
            self.items.append(_reasoning_item(reasoning))
        if content and (content.strip() or not calls):
            self.items.append(_message_item(content))
        self.items += [_call_item(c) for c in calls]
        if not self.items:
            self.items.append(_message_item(""))

    # ------------------------------------------------------------------ stream events

    def event(self, kind: str, **fields) -> dict:
        self.sequence += 1
        return {"type": kind, "sequence_number": self.sequence - 1, **fields}

    def start(self) -> list[dict]:
        response = self.response("in_progress")
        return [self.event("response.created", response=response),
                self.event("response.in_progress", response=response)]

    def feed(self, piece: Piece) -> list[dict]:
        """The events for one delta's piece: text into the open item (a new one when the kind changes)."""
        events = []
        for kind, text in (("reasoning", piece.reasoning), ("message", piece.content)):
            if not text or (kind == "message" and not text.strip() and self.open is None and piece.calls):
                continue
            if self.open is None or self.open["type"] != kind:
                events += self._close()
                events += self._open(kind)
            part = self.open["content"][0]
            part["text"] += text
            delta = "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
            extra = {} if kind == "reasoning" else {"logprobs": []}
            events.append(self.event(delta, item_id=self.open["id"], output_index=len(self.items) - 1,
                                     content_index=0, delta=text, **extra))
        for call in piece.calls:
            events += self._close()
            item = _call_item(call)
            index = len(self.items)
            self.items.append(item)
            events += [self.event("response.output_item.added", output_index=index,
                                  item={**item, "arguments": "", "status": "in_progress"}),
                       self.event("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                                  delta=item["arguments"]),
                       self.event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                                  name=item["name"], arguments=item["arguments"]),
                       self.event("response.output_item.done", output_index=index, item=item)]
        return events

    def finish(self, engine_reason: str | None) -> list[dict]:
        events = self._close()
        if not self.items:  # nothing was generated: one empty message, as non-streamed
            events += self._open("message") + self._close()
        final = self.final(engine_reason)
        kind = "response.incomplete" if final["status"] == "incomplete" else "response.completed"
        return events + [self.event(kind, response=final)]

    def _open(self, kind: str) -> list[dict]:
        item = _reasoning_item("") if kind == "reasoning" else _message_item("")
        item["status"] = "in_progress"
        self.open = item
        self.items.append(item)
        index = len(self.items) - 1
        part = dict(item["content"][0])
        return [self.event("response.output_item.added", output_index=index,
                           item={**item, "content": []}),
                self.event("response.content_part.added", item_id=item["id"], output_index=index,
                           content_index=0, part=part)]

    def _close(self) -> list[dict]:
        item, self.open = self.open, None
        if item is None:
            return []
        item["status"] = "completed"
        index, part = len(self.items) - 1, item["content"][0]
        done = (self.event("response.reasoning_text.done", item_id=item["id"], output_index=index, content_index=0,
                           text=part["text"]) if item["type"] == "reasoning" else
                self.event("response.output_text.done", item_id=item["id"], output_index=index, content_index=0,
                           text=part["text"], logprobs=[]))
        return [done, self.event("response.content_part.done", item_id=item["id"], output_index=index,
                                 content_index=0, part=part),
                self.event("response.output_item.done", output_index=index, item=item)]


def _message_item(text: str) -> dict:
    return {"type": "message", "id": f"msg_{uuid.uuid4().hex}", "role": "assistant", "status": "completed",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}


def _reasoning_item(text: str) -> dict:
    return {"type": "reasoning", "id": f"rs_{uuid.uuid4().hex}", "summary": [], "status": "completed",
            "content": [{"type": "reasoning_text", "text": text}]}


def _call_item(call: ToolCall) -> dict:
    return {"type": "function_call", "id": f"fc_{uuid.uuid4().hex}", "call_id": call.id, "name": call.name,
            "arguments": call.arguments, "status": "completed"}
