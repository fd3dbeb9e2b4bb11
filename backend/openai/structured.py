"""What constrains a chat or completion's output: `response_format`, vLLM's `structured_outputs` /
`guided_*`, and a forced `tool_choice` -> the engine's `structured_outputs` spec (xgrammar).

JSON comes out compact unless the client asks otherwise: xgrammar's any_whitespace lets a
random-weight or unsure model write whitespace until max_tokens, so `disable_any_whitespace` is
on unless the request's structured_outputs sets it (vLLM's option of that name).

A forced tool call follows vLLM: tool_choice naming a function constrains the output to that
function's parameters schema (the whole output is its arguments); "required" constrains it to a
JSON list of {"name", "parameters"}, one of the tools each. Either way the arguments parse and
validate against the schema, whatever the weights."""

from __future__ import annotations

import json
import logging
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from backend.openai.errors import bad_request
from backend.openai.tool_calls import ToolCall

log = logging.getLogger("backend.openai")

NO_PARAMETERS = {"type": "object", "properties": {}}


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="allow", populate_by_name=True)
    name: str | None = None
    description: str | None = None
    json_schema: dict | bool | None = Field(default=None, alias="schema")
    strict: bool | None = None  # the output is constrained either way


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class Function(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None


class Tool(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["function"] = "function"
    function: Function


class _ChosenFunction(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"] = "function"
    function: _ChosenFunction


class _CalledFunction(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: str
    arguments: str | dict = "{}"


class AssistantToolCall(BaseModel):
    """A past call in the history (an assistant message's tool_calls)."""

    model_config = ConfigDict(extra="allow")
    id: str | None = None
    type: Literal["function"] = "function"
    function: _CalledFunction

    def template_form(self, where: str) -> dict:
        """The call with its arguments as an object, which the template writes as DSML parameters."""
        arguments = self.function.arguments
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments or "{}")
            except json.JSONDecodeError as e:
                raise bad_request(f"{where}.function.arguments is not valid JSON: {e}",
                                  f"{where}.function.arguments") from None
        if not isinstance(arguments, dict):
            raise bad_request(f"{where}.function.arguments must be a JSON object", f"{where}.function.arguments")
        return {"id": self.id, "type": "function", "function": {"name": self.function.name, "arguments": arguments}}


def constraint(response_format: ResponseFormat | None, structured_outputs: dict | None,
               guided: dict[str, object]) -> dict | None:
    """The request's one output constraint as a structured_outputs spec, or None; 400 when it names two."""
    specs = []
    if response_format is not None and response_format.type != "text":
        if response_format.type == "json_object":
            specs.append(("response_format", {"json": {"type": "object"}}))
        else:
            schema = response_format.json_schema.json_schema if response_format.json_schema else None
            if schema is None:
                raise bad_request("response_format json_schema needs json_schema.schema",
                                  "response_format.json_schema")
            specs.append(("response_format", {"json": schema}))
    if structured_outputs is not None:
        specs.append(("structured_outputs", dict(structured_outputs)))
    specs += [(f"guided_{kind}", {kind: value}) for kind, value in guided.items() if value is not None]
    if len(specs) > 1:
        raise bad_request(f"use one output constraint, got {', '.join(name for name, _ in specs)}", specs[1][0])
    if not specs:
        return None
    spec = specs[0][1]
    spec.setdefault("disable_any_whitespace", True)
    return spec


def check_tool_choice(tools: list[Tool] | None, tool_choice) -> None:
    if isinstance(tool_choice, NamedToolChoice):
        if not any(t.function.name == tool_choice.function.name for t in tools or []):
            raise bad_request(f"tool_choice names the function {tool_choice.function.name!r}, which is not in tools",
                              "tool_choice")
    elif tool_choice == "required" and not tools:
        raise bad_request("tool_choice 'required' needs tools", "tool_choice")


def tool_choice_constraint(tools: list[Tool], tool_choice, parallel: bool | None) -> dict | None:
    """The grammar of a forced call (named or required), or None when the model chooses."""
    if not tools or tool_choice in (None, "auto", "none"):
        return None
    if isinstance(tool_choice, NamedToolChoice):
        chosen = next(t for t in tools if t.function.name == tool_choice.function.name)
        return {"json": chosen.function.parameters or NO_PARAMETERS, "disable_any_whitespace": True}
    calls = {"anyOf": [{"type": "object", "properties": {"name": {"type": "string", "enum": [t.function.name]},
                                                         "parameters": t.function.parameters or NO_PARAMETERS},
                        "required": ["name", "parameters"]} for t in tools]}
    schema = {"type": "array", "minItems": 1, "items": calls}
    if parallel is False:
        schema["maxItems"] = 1
    return {"json": schema, "disable_any_whitespace": True}


def forced_calls(text: str, tool_choice) -> list[ToolCall] | None:
    """A forced call's output -> its calls; None (logged) when it does not parse (cut off by max_tokens)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        log.warning("a forced tool call's output is not JSON, returned as content: %s", e)
        return None
    if isinstance(tool_choice, NamedToolChoice):
        return [ToolCall(tool_choice.function.name, json.dumps(value, ensure_ascii=False))]
    if not isinstance(value, list) or not all(isinstance(c, dict) and isinstance(c.get("name"), str) for c in value):
        log.warning("a required tool call's output is not a list of calls, returned as content")
        return None
    return [ToolCall(c["name"], json.dumps(c.get("parameters", {}), ensure_ascii=False)) for c in value]
