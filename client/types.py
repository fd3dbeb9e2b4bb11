"""What both clients (client/grpc.py, client/http.py) return, and the request they both send."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

MODEL = "deepseek_v4"
# Outputs a client always asks for: cheap, and they make the result self-describing.
DEFAULT_RETURNS = ("return_finish_reason", "return_num_input_tokens", "return_num_output_tokens")


class ServerError(RuntimeError):
    """The server refused or failed a request. `message` is the model's (or Triton's) message;
    `code` is what the transport kept of the status: "HTTP 400" (Triton 2.51's generate endpoints
    answer 400 for every error the model sends), a gRPC status name ("UNAVAILABLE" when the server
    is unreachable), or "UNKNOWN" (errors inside a gRPC stream carry only the message)."""

    def __init__(self, code: str, message: str):
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


@dataclass
class Delta:
    """One streamed response."""

    text: str
    num_output_tokens: int | None = None  # tokens in this delta
    num_input_tokens: int | None = None
    finish_reason: str | None = None  # set on the last delta only
    cumulative_logprob: float | None = None
    logprobs: list[dict] | None = None
    time_s: float = 0.0  # since the request was sent


@dataclass
class Result:
    """A whole generation (a non-streaming response, or a stream's deltas joined)."""

    text: str = ""
    finish_reason: str | None = None
    num_input_tokens: int | None = None
    num_output_tokens: int | None = None
    cumulative_logprob: float | None = None
    logprobs: list[dict] | None = None
    ttft_s: float | None = None  # first non-empty delta
    e2e_s: float = 0.0
    deltas: list[Delta] = field(default_factory=list)

    @classmethod
    def join(cls, deltas: list[Delta]) -> Result:
        result = cls(text="".join(d.text for d in deltas), deltas=list(deltas))
        for d in deltas:
            if d.num_output_tokens is not None:
                result.num_output_tokens = (result.num_output_tokens or 0) + d.num_output_tokens
            if d.num_input_tokens is not None:
                result.num_input_tokens = d.num_input_tokens
            if d.finish_reason:
                result.finish_reason = d.finish_reason
            if d.cumulative_logprob is not None:
                result.cumulative_logprob = d.cumulative_logprob
            if d.logprobs is not None:
                result.logprobs = (result.logprobs or []) + d.logprobs
            if result.ttft_s is None and (d.text or d.num_output_tokens):
                result.ttft_s = d.time_s
        if deltas:
            result.e2e_s = deltas[-1].time_s
        return result


def sampling_json(max_tokens: int | None = None, temperature: float | None = None, **sampling) -> str:
    """The sampling_parameters input: vLLM's names, unset values left out."""
    params = {"max_tokens": max_tokens, "temperature": temperature, **sampling}
    return json.dumps({k: v for k, v in params.items() if v is not None})


def delta_from_outputs(outputs: dict, time_s: float) -> Delta:
    """Output name -> value (python values; one-element lists are unwrapped) -> Delta."""
    outputs = {k: v[0] if isinstance(v, list) and len(v) == 1 else v for k, v in outputs.items()}
    logprobs = outputs.get("logprobs")
    if isinstance(logprobs, str):
        logprobs = json.loads(logprobs)
    return Delta(
        text=outputs.get("text_output", ""),
        num_output_tokens=_int(outputs.get("num_output_tokens")),
        num_input_tokens=_int(outputs.get("num_input_tokens")),
        # mid-stream the server sends "None", as vllm_backend does
        finish_reason=None if outputs.get("finish_reason") in (None, "", "None") else outputs["finish_reason"],
        cumulative_logprob=None if outputs.get("cumulative_logprob") is None else float(outputs["cumulative_logprob"]),
        logprobs=logprobs,
        time_s=time_s,
    )


def _int(value) -> int | None:
    return None if value is None else int(value)
