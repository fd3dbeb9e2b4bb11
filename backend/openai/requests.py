"""OpenAI request bodies (pydantic, unknown fields refused) -> the model's sampling parameters.

Field names and ranges follow OpenAI's API reference; the extra sampling fields vLLM's OpenAI
server takes (top_k, min_p, min_tokens, ignore_eos, ...) pass through under the same names. Range
checks the engine makes itself (max_tokens against max_model_len, ...) come back from Triton as
INVALID_ARG and are answered 400 too."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from backend.openai.errors import bad_request

MAX_COMPLETION_LOGPROBS = 5  # OpenAI's limit for /v1/completions
MAX_TOP_LOGPROBS = 20


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _Common(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None  # the engine takes only 0 (Triton answers INVALID_ARG otherwise)
    frequency_penalty: float | None = None
    user: str | None = None  # accepted, not used
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

    def sampling(self) -> dict:
        """The sampling parameters Triton gets (unset ones left out: the engine's defaults)."""
        if self.n != 1:
            raise bad_request(f"n must be 1 (this server returns one choice per request), got {self.n}", "n")
        if self.stream_options is not None and not self.stream:
            raise bad_request("stream_options is only allowed with stream=true", "stream_options")
        if self.stream and self.prompt_logprobs:  # vLLM's rule
            raise bad_request("prompt_logprobs are not available when stream=true", "prompt_logprobs")
        keys = ("temperature", "top_p", "seed", "stop", "presence_penalty", "frequency_penalty", "top_k",
                "min_p", "min_tokens", "ignore_eos", "repetition_penalty", "stop_token_ids",
                "skip_special_tokens", "include_stop_str_in_output", "prompt_logprobs")
        params = {k: getattr(self, k) for k in keys if getattr(self, k) is not None}
        if self.output_limit() is not None:
            params["max_tokens"] = self.output_limit()
        return params

    def output_limit(self) -> int | None:
        return self.max_tokens

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_Common):
    prompt: str | list[str]
    logprobs: Annotated[int, Field(ge=0, le=MAX_COMPLETION_LOGPROBS)] | None = None
    echo: bool = False
    best_of: Literal[1] | None = None
    suffix: None = None

    def prompt_text(self) -> str:
        if isinstance(self.prompt, list):
            if len(self.prompt) != 1:
                raise bad_request(f"prompt must be one string (a batch of {len(self.prompt)} is not supported)",
                                  "prompt")
            return self.prompt[0]
        return self.prompt

    def sampling(self) -> dict:
        params = super().sampling()
        if self.logprobs is not None:
            params["logprobs"] = self.logprobs
            if self.echo and self.prompt_logprobs is None:  # vLLM's: the echoed prompt gets its logprobs too
                params["prompt_logprobs"] = self.logprobs
        return params


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # name, reasoning_content, ...: the template decides
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list | None = None


class ChatCompletionRequest(_Common):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    chat_template_kwargs: dict | None = None  # vLLM's: {"thinking": true} opens DeepSeek's thinking block

    def output_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def sampling(self) -> dict:
        params = super().sampling()
        if self.top_logprobs is not None and not self.logprobs:
            raise bad_request("top_logprobs needs logprobs=true", "top_logprobs")
        if self.logprobs:
            params["logprobs"] = self.top_logprobs or 0
        return params

    def template_messages(self) -> list[dict]:
        # OpenAI's "developer" role is the newer name of "system"
        return [{**m.model_dump(exclude_none=True), "role": "system" if m.role == "developer" else m.role}
                for m in self.messages]


def parse(model: type[BaseModel], body: object):
    """A parsed JSON body -> the request model, or a 400 naming the first bad field."""
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    try:
        return model.model_validate(body)
    except ValidationError as e:
        error = e.errors()[0]
        param = ".".join(str(part) for part in error["loc"]) or None
        if error["type"] == "extra_forbidden":
            raise bad_request(f"unknown parameter {param!r}", param) from None
        raise bad_request(f"{param}: {error['msg']}", param) from None
