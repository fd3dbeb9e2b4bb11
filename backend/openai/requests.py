"""OpenAI request bodies (pydantic) -> the model's sampling parameters.

Field names and ranges follow OpenAI's API reference; the extra sampling fields vLLM's OpenAI
server takes (top_k, min_p, min_tokens, ignore_eos, structured_outputs, guided_*, ...) pass
through under the same names. Unknown fields are ignored with one log line (vLLM's behaviour);
known fields with a value this server does not implement are refused with a 400 naming them.
Range checks the engine makes itself (max_tokens against max_model_len, ...) come back from
Triton as INVALID_ARG and are answered 400 too."""

from __future__ import annotations

import logging
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from backend.openai import structured
from backend.openai.errors import bad_request

log = logging.getLogger("backend.openai")

MAX_TOP_LOGPROBS = 20
MAX_N = 16  # choices per request: each is one engine request
# OpenAI's reasoning_effort -> DeepSeek-V4's (thinking, effort prompt); "none" turns thinking off
REASONING_EFFORTS = {"none": (False, None), "minimal": (True, None), "low": (True, None),
                     "medium": (True, None), "high": (True, "high"), "xhigh": (True, "max"), "max": (True, "max")}


class _Lenient(BaseModel):
    """Unknown fields are kept aside (model_extra) for parse() to log, then ignored."""

    model_config = ConfigDict(extra="allow")


class StreamOptions(_Lenient):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _Common(_Lenient):
    model: str
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    n: Annotated[int, Field(ge=1, le=MAX_N)] = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None  # the engine takes only 0 (Triton answers INVALID_ARG otherwise)
    frequency_penalty: float | None = None
    user: str | None = None  # accepted, not used
    metadata: dict | None = None  # accepted, not used
    store: bool | None = None  # accepted, not used: nothing is stored
    service_tier: str | None = None  # accepted, not used
    logit_bias: dict[str, float] | None = None
    response_format: structured.ResponseFormat | None = None
    # vLLM's extra sampling fields
    top_k: int | None = None
    min_p: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    repetition_penalty: float | None = None
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool | None = None
    include_stop_str_in_output: bool | None = None
    prompt_logprobs: Annotated[int, Field(ge=0)] | None = None  # vLLM's: the prompt's logprobs, top-n each
    bad_words: list[str] | None = None
    allowed_token_ids: list[int] | None = None
    structured_outputs: dict | None = None  # vLLM's: {"json" | "regex" | "choice" | "grammar" | ...}
    guided_json: dict | str | None = None  # vLLM's older names of the same
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    def sampling(self) -> dict:
        """The sampling parameters Triton gets (unset ones left out: the engine's defaults)."""
        if self.stream_options is not None and not self.stream:
            raise bad_request("stream_options is only allowed with stream=true", "stream_options")
        if self.stream and self.prompt_logprobs:  # vLLM's rule
            raise bad_request("prompt_logprobs are not available when stream=true", "prompt_logprobs")
        keys = ("temperature", "top_p", "seed", "stop", "presence_penalty", "frequency_penalty", "top_k",
                "min_p", "min_tokens", "ignore_eos", "repetition_penalty", "stop_token_ids",
                "skip_special_tokens", "include_stop_str_in_output", "prompt_logprobs", "bad_words",
                "allowed_token_ids")
        params = {k: getattr(self, k) for k in keys if getattr(self, k) is not None}
        if self.logit_bias:
            params["logit_bias"] = self.logit_bias
        if self.output_limit() is not None:
            params["max_tokens"] = self.output_limit()
        constraint = structured.constraint(self.response_format, self.structured_outputs, {
            "json": self.guided_json, "regex": self.guided_regex, "choice": self.guided_choice,
            "grammar": self.guided_grammar})
        if constraint is not None:
            params["structured_outputs"] = constraint
        return params

    def output_limit(self) -> int | None:
        return self.max_tokens

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_Common):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: Annotated[int, Field(ge=0)] | None = None  # 0: the prompt only (echo), as vLLM
    logprobs: Annotated[int, Field(ge=0)] | None = None  # at most the engine's max_logprobs (vLLM's; OpenAI: 5)
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None
    add_special_tokens: bool = True  # vLLM's: false sends a text prompt without the BOS

    def prompts(self) -> list[str | list[int]]:
        """The prompt, or a batch of them (each gets its n choices, in order): texts or token-id lists."""
        prompt = self.prompt
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
            prompt = [prompt]
        if not prompt or not all(prompt):
            raise bad_request("prompt must not be empty", "prompt")
        return prompt

    @property
    def prompt_only(self) -> bool:
        """echo with max_tokens=0: the (scored) prompt comes back and nothing is generated."""
        return self.max_tokens == 0

    def output_limit(self) -> int | None:
        # vLLM's way: one token is generated and dropped, so the engine's max_tokens >= 1 holds
        return 1 if self.prompt_only else self.max_tokens

    def sampling(self) -> dict:
        if self.best_of not in (None, 1, self.n):
            raise bad_request(f"best_of is not supported (each of the n choices is returned), got {self.best_of}",
                              "best_of")
        if self.suffix:
            raise bad_request("suffix is not supported (DeepSeek-V4 has no fill-in-the-middle format)", "suffix")
        if self.prompt_only and not self.echo:
            raise bad_request("max_tokens=0 is only allowed with echo=true (the prompt comes back, with its "
                              "logprobs when logprobs is set)", "max_tokens")
        params = super().sampling()
        if self.logprobs is not None:
            params["logprobs"] = self.logprobs
            if self.echo and self.prompt_logprobs is None:  # vLLM's: the echoed prompt gets its logprobs too
                params["prompt_logprobs"] = self.logprobs
        return params


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # name, reasoning_content, ...: the template decides
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list | None = None
    tool_calls: list[structured.AssistantToolCall] | None = None
    tool_call_id: str | None = None


class ChatCompletionRequest(_Common):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    chat_template_kwargs: dict | None = None  # vLLM's: {"thinking": true} opens DeepSeek's thinking block
    tools: list[structured.Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | structured.NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    reasoning_effort: Literal[tuple(REASONING_EFFORTS)] | None = None

    def output_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def sampling(self) -> dict:
        params = super().sampling()
        if self.top_logprobs is not None and not self.logprobs:
            raise bad_request("top_logprobs needs logprobs=true", "top_logprobs")
        if self.logprobs:
            params["logprobs"] = self.top_logprobs or 0
        forced = structured.tool_choice_constraint(self.active_tools(), self.tool_choice, self.parallel_tool_calls)
        if forced is not None:
            if "structured_outputs" in params:
                raise bad_request("tool_choice 'required' or a named function cannot be combined with "
                                  "response_format or structured_outputs", "tool_choice")
            params["structured_outputs"] = forced
        return params

    def active_tools(self) -> list[structured.Tool]:
        """The tools the model may call: none with tool_choice "none"."""
        structured.check_tool_choice(self.tools, self.tool_choice)
        return [] if self.tool_choice == "none" else list(self.tools or [])

    def forced_tools(self) -> bool:
        """tool_choice required or named: the output is a grammar-constrained call, not free text."""
        return bool(self.active_tools()) and self.tool_choice not in (None, "auto")

    def template_kwargs(self) -> dict:
        """What the template gets besides the messages: tools, the thinking switch, the effort."""
        kwargs = dict(self.chat_template_kwargs or {})
        if self.reasoning_effort is not None:
            thinking, effort = REASONING_EFFORTS[self.reasoning_effort]
            kwargs.setdefault("thinking", thinking)
            kwargs.setdefault("reasoning_effort", effort)
        if self.forced_tools():
            kwargs["thinking"] = False  # the grammar starts at the first token: no room to think
        if self.active_tools():
            kwargs["tools"] = [t.model_dump(exclude_none=True) for t in self.active_tools()]
        return kwargs

    def template_messages(self) -> list[dict]:
        # OpenAI's "developer" role is the newer name of "system"
        messages = []
        for i, m in enumerate(self.messages):
            message = {**m.model_dump(exclude_none=True), "role": "system" if m.role == "developer" else m.role}
            if m.tool_calls:
                message["tool_calls"] = [call.template_form(f"messages.{i}.tool_calls.{j}")
                                         for j, call in enumerate(m.tool_calls)]
            messages.append(message)
        return messages


def parse(model: type[BaseModel], body: object):
    """A parsed JSON body -> the request model, or a 400 naming the first bad field. Unknown
    fields are logged in one line and ignored."""
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    try:
        request = model.model_validate(body)
    except ValidationError as e:
        error = e.errors()[0]
        param = ".".join(str(part) for part in error["loc"]) or None
        raise bad_request(f"{param}: {error['msg']}", param) from None
    unknown = sorted(request.model_extra or {})
    if isinstance(getattr(request, "stream_options", None), _Lenient):
        unknown += [f"stream_options.{k}" for k in sorted(request.stream_options.model_extra or {})]
    if unknown:
        log.warning("ignoring unknown request fields: %s", ", ".join(unknown))
    return request
