"""The wire protocol: Triton tensors and request parameters <-> GenerationRequest / RequestOutput.

Pure Python and numpy (no pb_utils) so it is unit-tested without a server. The tensor names
and semantics follow Triton's vLLM backend (see docs/USAGE.md); every mistake a client can
make raises `InvalidRequest` with a message that names the input and the problem.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import numpy as np

from engine.request import GenerationRequest, InvalidRequest, RequestOutput, SamplingParams
from engine.structured_output import json_value, parse_spec

RETURN_FLAGS = (
    "return_finish_reason",
    "return_num_input_tokens",
    "return_num_output_tokens",
    "return_cumulative_logprob",
    "return_logprobs",
)
BOOL_INPUTS = ("stream", "exclude_input_in_output", *RETURN_FLAGS)
OUTPUT_TOKEN_IDS = "output_token_ids"  # in ParsedRequest.returns when detokenize is false (no flag turns it on)
PROMPT_LOGPROBS = "prompt_logprobs"  # in ParsedRequest.returns when the prompt_logprobs sampling key is set

# Request parameters that Triton's frontends or clients set for themselves, not for the model.
_RESERVED_PARAMETERS = {"binary_data_output", "priority", "timeout", "headers", "sequence_id",
                        "sequence_start", "sequence_end", "request_id"}

# vLLM sampling keys we implement: key -> parser.
_INT, _FLOAT, _BOOL = "int", "float", "bool"
_SAMPLING_KEYS = {
    "max_tokens": _INT,
    "min_tokens": _INT,
    "temperature": _FLOAT,
    "top_p": _FLOAT,
    "top_k": _INT,
    "min_p": _FLOAT,
    "seed": _INT,
    "stop": "stop",
    "stop_token_ids": "int_list",
    "ignore_eos": _BOOL,
    "logprobs": "logprobs",
    "prompt_logprobs": _INT,
    "skip_special_tokens": _BOOL,
    "presence_penalty": _FLOAT,
    "frequency_penalty": _FLOAT,
    "repetition_penalty": _FLOAT,
    "logit_bias": "logit_bias",
    "bad_words": "str_list",
    "allowed_token_ids": "int_list",
    "structured_outputs": "structured_outputs",
    "truncate_prompt_tokens": _INT,
    "detokenize": _BOOL,
    "spaces_between_special_tokens": _BOOL,
}
# vLLM's older structured-output keys -> the structured_outputs kind each stands for
_GUIDED_KEYS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
# vLLM keys that clients (Triton's OpenAI frontend, genai-perf) send with their neutral value;
# accepted at that value only, since this backend does not implement them.
_NEUTRAL_KEYS = {
    "n": 1,
    "best_of": 1,
    "use_beam_search": False,
    "include_stop_str_in_output": False,
}
MAX_STOP_TOKEN_IDS = 256
# a token the grammar or a ban masked has logprob -inf, which JSON cannot carry (JS, Go and serde
# parsers reject -Infinity): vLLM's stand-in
MIN_LOGPROB = -9999.0
MAX_JSON_BYTES = 64 << 10  # sampling_parameters / request parameters: far more than any real use
MAX_REQUEST_ID_CHARS = 1024  # a longer client request id is refused
LOGGED_REQUEST_ID_CHARS = 64  # what of a client's id goes into the engine's id (and so into every log line)


def engine_request_id(client_id: str, unique: str) -> str:
    """The engine's id for a request: the head of the client's id (to find it in the logs) and a
    unique suffix (client ids need not be unique). InvalidRequest for an absurd client id."""
    if len(client_id) > MAX_REQUEST_ID_CHARS:
        raise InvalidRequest(f"the request id has {len(client_id)} characters; at most {MAX_REQUEST_ID_CHARS} "
                             "are allowed")
    return f"{client_id[:LOGGED_REQUEST_ID_CHARS] or 'req'}-{unique}"


@dataclass
class ParsedRequest:
    """What the Triton side needs to serve one request."""

    request: GenerationRequest
    stream: bool = False
    exclude_input_in_output: bool = True
    returns: frozenset[str] = frozenset()  # the return_* flags that are on
    id: str | None = None  # HTTP generate's top-level "id" (a request parameter), echoed in every response


def parse_request(
    inputs: Mapping[str, object],
    parameters: str | Mapping | None,
    request_id: str,
    max_prompt_bytes: int | None = None,
) -> ParsedRequest:
    """`inputs`: input name -> numpy array (absent inputs missing or None). `parameters`: the
    request parameters (JSON text from pb_utils' `request.parameters()`, or a dict).
    `max_prompt_bytes`: text_input size limit, checked before the text is decoded.

    Flags and sampling keys may come either way; an input tensor wins over a request parameter,
    and `sampling_parameters` keys win over request-parameter keys."""
    params = _parse_parameters(parameters)
    prompt, prompt_ids = _prompt(inputs, max_prompt_bytes)
    # the generate extension's optional top-level "id" reaches the model as a request parameter
    echo_id = params.pop("id", None)
    if echo_id is not None and not isinstance(echo_id, str | int):
        raise InvalidRequest(f"id must be a string, got {echo_id!r}")

    flags = {}
    for name in BOOL_INPUTS:
        if name in params:
            flags[name] = _to_bool(name, params.pop(name))
        tensor = inputs.get(name)
        if tensor is not None:
            flags[name] = _bool_tensor(name, tensor)
    for name in list(params):
        if name in _RESERVED_PARAMETERS or name.startswith("triton_"):
            params.pop(name)

    sampling = dict(params)
    tensor = inputs.get("sampling_parameters")
    if tensor is not None:
        sampling.update(_sampling_tensor(tensor))

    stream = flags.get("stream", False)
    if "exclude_input_in_output" in flags:
        exclude = flags["exclude_input_in_output"]
        if stream and not exclude:
            raise InvalidRequest(
                "exclude_input_in_output=false is not allowed with stream=true: "
                "a stream sends only new text")
        if prompt is None and not exclude:
            raise InvalidRequest("exclude_input_in_output=false needs text_input: an input_ids prompt has no "
                                 "text to echo")
    else:
        exclude = stream or prompt is None  # vLLM backend's defaults: the prompt is echoed only when not streaming
    returns = frozenset(name for name in RETURN_FLAGS if flags.get(name))

    sp = parse_sampling(sampling)
    if sp.logprobs is None and returns & {"return_logprobs", "return_cumulative_logprob"}:
        sp.logprobs = 0  # the sampled token's logprob only, as vLLM
    if not sp.detokenize:
        returns |= {OUTPUT_TOKEN_IDS}  # no text: the ids are the output
    if sp.prompt_logprobs is not None:
        returns |= {PROMPT_LOGPROBS}
    return ParsedRequest(GenerationRequest(request_id=request_id, prompt=prompt, prompt_token_ids=prompt_ids,
                                           sampling=sp),
                         stream=stream, exclude_input_in_output=exclude, returns=returns,
                         id=None if echo_id is None else str(echo_id))


def parse_sampling(params: Mapping[str, object]) -> SamplingParams:
    """vLLM-named sampling parameters (values possibly strings, genai-perf style) -> SamplingParams.
    Names and types only: the values are checked once, by the engine (engine/sampling_checks.py)."""
    sp = SamplingParams()
    guided = {}
    for key, value in params.items():
        if value is None:
            continue  # unset: keep the default (vLLM's from_dict does the same)
        if key in _NEUTRAL_KEYS:
            neutral = _NEUTRAL_KEYS[key]
            kind = _BOOL if isinstance(neutral, bool) else _FLOAT
            if _coerce(key, value, kind) != neutral:
                raise InvalidRequest(f"sampling parameter {key!r} is not supported (only {key}={neutral})")
            continue
        if key in _GUIDED_KEYS:
            guided[_GUIDED_KEYS[key]] = _json_list(key, value) if key == "guided_choice" else value
            continue
        if key == "guided_decoding_backend":
            if value not in ("xgrammar", "auto"):
                raise InvalidRequest(f"guided_decoding_backend must be 'xgrammar' or 'auto' (the one here), got {value!r}")
            continue
        kind = _SAMPLING_KEYS.get(key)
        if kind is None:
            raise InvalidRequest(f"unknown sampling parameter {key!r}; supported: "
                                 f"{', '.join([*_SAMPLING_KEYS, *_GUIDED_KEYS])}")
        setattr(sp, key, _coerce(key, value, kind))
    if guided:
        if sp.structured_outputs is not None or len(guided) > 1:
            raise InvalidRequest("use one structured-output constraint: structured_outputs or one guided_* key")
        sp.structured_outputs = guided
    if sp.structured_outputs is not None:
        parse_spec(sp.structured_outputs)  # its shape now; the grammar compiles in the engine

    if sp.top_k == -1:
        sp.top_k = 0  # vLLM's spelling of off
    return sp


def _parse_parameters(parameters: str | Mapping | None) -> dict:
    if parameters is None or parameters == "":
        return {}
    if isinstance(parameters, Mapping):
        return dict(parameters)
    if len(parameters) > MAX_JSON_BYTES:
        raise InvalidRequest(f"request parameters are {len(parameters)} bytes; at most {MAX_JSON_BYTES}")
    try:
        params = json.loads(parameters)
    except (json.JSONDecodeError, RecursionError) as e:
        raise InvalidRequest(f"request parameters are not valid JSON: {e}") from e
    if not isinstance(params, dict):
        raise InvalidRequest("request parameters must be a JSON object")
    return params


def _single(name: str, tensor) -> object:
    array = np.asarray(tensor)
    if array.size != 1:
        raise InvalidRequest(f"{name} must hold exactly one element, got shape {list(array.shape)}")
    return array.reshape(-1)[0]


def _text(name: str, value) -> str:
    if isinstance(value, bytes | np.bytes_):
        try:
            return bytes(value).decode("utf-8")
        except UnicodeDecodeError as e:
            raise InvalidRequest(f"{name} is not valid UTF-8 (byte {e.start}: {e.reason})") from e
    if isinstance(value, str):
        return value
    raise InvalidRequest(f"{name} must be a string (TYPE_STRING / BYTES), got {type(value).__name__}")


def _prompt(inputs: Mapping[str, object], max_bytes: int | None) -> tuple[str | None, list[int] | None]:
    """The prompt: text (`text_input`, as Triton's vLLM backend) or token ids (`input_ids`, as
    TensorRT-LLM's backend names them), which reach the engine as they are (no BOS is added)."""
    text, ids = inputs.get("text_input"), inputs.get("input_ids")
    if ids is None:
        return _text_input(text, max_bytes), None
    if text is not None:
        raise InvalidRequest("give the prompt once: text_input or input_ids, not both")
    array = np.asarray(ids)
    if array.ndim != 1 or array.size == 0:
        raise InvalidRequest(f"input_ids must be a non-empty 1-D list of token ids, got shape {list(array.shape)}")
    if array.dtype.kind not in "iu":
        raise InvalidRequest(f"input_ids must be integers (TYPE_INT32), got {array.dtype}")
    return None, [int(t) for t in array]


def _text_input(tensor, max_bytes: int | None = None) -> str:
    if tensor is None:
        raise InvalidRequest("missing required input 'text_input' (or 'input_ids': the prompt as token ids)")
    value = _single("text_input", tensor)
    size = len(value.encode("utf-8")) if isinstance(value, str) else len(value) if isinstance(value, bytes) else 0
    if max_bytes is not None and size > max_bytes:
        raise InvalidRequest(f"text_input is {size} bytes; at most {max_bytes} (max_prompt_bytes)")
    prompt = _text("text_input", value)
    if not prompt:
        raise InvalidRequest("text_input is empty: the prompt needs at least one character")
    return prompt


def _bool_tensor(name: str, tensor) -> bool:
    value = _single(name, tensor)
    if isinstance(value, bool | np.bool_):
        return bool(value)
    return _to_bool(name, value.decode() if isinstance(value, bytes) else value)


def _sampling_tensor(tensor) -> dict:
    value = _single("sampling_parameters", tensor)
    if isinstance(value, bytes | str) and len(value) > MAX_JSON_BYTES:
        raise InvalidRequest(f"sampling_parameters is {len(value)} bytes; at most {MAX_JSON_BYTES}")
    text = _text("sampling_parameters", value)
    if not text.strip():
        return {}
    try:
        params = json.loads(text)
    except (json.JSONDecodeError, RecursionError) as e:
        raise InvalidRequest(f"sampling_parameters is not valid JSON: {e}") from e
    if not isinstance(params, dict):
        raise InvalidRequest(f"sampling_parameters must be a JSON object, got {type(params).__name__}")
    return params


def _to_bool(name: str, value) -> bool:
    if isinstance(value, bool | np.bool_):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in ("true", "false", "1", "0"):
        return value.strip().lower() in ("true", "1")
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    raise InvalidRequest(f"{name} must be a boolean, got {value!r}")


def _to_int(name: str, value) -> int:
    if isinstance(value, bool):
        raise InvalidRequest(f"{name} must be an integer, got {value!r}")
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str):
        try:
            return int(value.strip())
        except ValueError:
            try:
                as_float = float(value)
            except ValueError:
                as_float = math.nan
            if as_float.is_integer():
                return int(as_float)
    raise InvalidRequest(f"{name} must be an integer, got {value!r}")


def _to_float(name: str, value) -> float:
    if isinstance(value, bool):
        raise InvalidRequest(f"{name} must be a number, got {value!r}")
    try:
        number = float(value.strip() if isinstance(value, str) else value)
    except (TypeError, ValueError):
        raise InvalidRequest(f"{name} must be a number, got {value!r}") from None
    if not math.isfinite(number):
        raise InvalidRequest(f"{name} must be finite, got {value!r}")
    return number


def _coerce(name: str, value, kind: str):
    if kind == _INT:
        return _to_int(name, value)
    if kind == _FLOAT:
        return _to_float(name, value)
    if kind == _BOOL:
        return _to_bool(name, value)
    if kind == "logprobs":  # OpenAI-style clients send a bool
        if value is False or (isinstance(value, str) and value.strip().lower() == "false"):
            return None
        if value is True or (isinstance(value, str) and value.strip().lower() == "true"):
            return 0
        return _to_int(name, value)
    if kind == "logit_bias":
        return _logit_bias(value)
    if kind == "structured_outputs":
        value = json_value("structured_outputs", value)
        parse_spec(value)
        return value
    value = _json_list(name, value)
    if kind == "str_list":
        words = [value] if isinstance(value, str) else value
        if not isinstance(words, list) or not all(isinstance(w, str) and w for w in words):
            raise InvalidRequest(f"{name} must be a list of non-empty strings, got {value!r}")
        return words
    if kind == "stop":
        stops = [value] if isinstance(value, str) else value
        if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
            raise InvalidRequest(f"stop must be a non-empty string or a list of them, got {value!r}")
        return stops
    if not isinstance(value, list):  # int_list
        raise InvalidRequest(f"{name} must be a list of integers, got {value!r}")
    limit = MAX_STOP_TOKEN_IDS if name == "stop_token_ids" else MAX_JSON_BYTES  # allowed_token_ids: any size that fits
    if len(value) > limit:
        raise InvalidRequest(f"{name} has {len(value)} entries; at most {limit}")
    return [_to_int(name, v) for v in value]


def _logit_bias(value) -> dict[str, float]:
    """{token id: bias} (JSON keys are strings; the value may itself be a JSON string)."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except (json.JSONDecodeError, RecursionError):
            pass
    if not isinstance(value, dict):
        raise InvalidRequest(f"logit_bias must be an object of token id -> bias, got {value!r}")
    bias = {}
    for token, b in value.items():
        # ASCII digits only: str.isdigit() takes "²" (int() then fails) and int() takes "١٢" as 12
        if not re.fullmatch(r"\s*-?[0-9]+\s*", str(token)):
            raise InvalidRequest(f"logit_bias keys must be token ids (integers), got {token!r}")
        bias[str(int(token))] = _to_float(f"logit_bias[{token!r}]", b)
    return bias


def _json_list(name: str, value):
    """A list may itself arrive as a JSON string ('["a", "b"]'); a plain string stays a string."""
    if isinstance(value, str) and value.lstrip().startswith("["):
        try:
            return json.loads(value)
        except (json.JSONDecodeError, RecursionError):
            return value
    return value


# --------------------------------------------------------------------------------------------
# Outputs


@dataclass
class OutputState:
    """Per-request rendering state: non-streaming requests accumulate every delta here."""

    prompt: str | None  # None: the prompt came as input_ids (never echoed)
    exclude_input_in_output: bool
    returns: frozenset[str]
    text: list[str] = field(default_factory=list)
    num_tokens: int = 0
    token_ids: list[int] = field(default_factory=list)  # non-streaming: the sampled ids, for logprobs' order
    logprobs: list[dict[int, float]] | None = None
    first: bool = True
    id: str | None = None  # echoed as the `id` output (HTTP generate puts it in the response JSON)
    decode_token: Callable[[int], str] | None = None  # token id -> text, for logprobs' decoded_token
    ranks: list[int | None] | None = None  # non-streaming: the engine's rank of each sampled token
    prompt_logprobs: RequestOutput | None = None  # non-streaming: the delta that carried them

    def accumulate(self, delta: RequestOutput) -> None:
        self.text.append(delta.text)
        self.num_tokens += len(delta.token_ids)
        self.token_ids += delta.token_ids
        if delta.logprobs is not None:
            self.logprobs = (self.logprobs or []) + list(delta.logprobs)
        if delta.logprob_ranks is not None:
            self.ranks = (self.ranks or []) + list(delta.logprob_ranks)
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs = delta


def render_delta(state: OutputState, delta: RequestOutput) -> dict[str, np.ndarray]:
    """One streamed response: the new text, the new token count, the cumulative counters."""
    text = "" if OUTPUT_TOKEN_IDS in state.returns else delta.text  # detokenize false: ids, no text (any engine)
    if state.first and not state.exclude_input_in_output:
        text = state.prompt + text
    state.first = False
    return _render(state, delta, text, delta.token_ids, delta.logprobs, delta.logprob_ranks, delta)


def render_final(state: OutputState, last: RequestOutput) -> dict[str, np.ndarray]:
    """The one response of a non-streaming request, from everything `accumulate`d."""
    text = "" if OUTPUT_TOKEN_IDS in state.returns else "".join(state.text)
    if not state.exclude_input_in_output:
        text = state.prompt + text
    return _render(state, last, text, state.token_ids, state.logprobs, state.ranks, state.prompt_logprobs)


def _render(state: OutputState, out: RequestOutput, text: str, token_ids: list[int], logprobs,
            ranks=None, prompt: RequestOutput | None = None) -> dict[str, np.ndarray]:
    returns = state.returns
    tensors = {"text_output": np.array([text.encode("utf-8")], dtype=np.object_)}
    if state.id is not None:
        tensors["id"] = np.array([state.id.encode("utf-8")], dtype=np.object_)
    if "return_finish_reason" in returns:
        # "None" until the end, as vllm_backend sends it (str() of vLLM's unset finish_reason)
        reason = (out.finish_reason or "") if out.finished else "None"
        tensors["finish_reason"] = np.array([reason.encode()], dtype=np.object_)
    if "return_num_input_tokens" in returns:
        tensors["num_input_tokens"] = np.array([out.num_prompt_tokens], dtype=np.uint32)
    if "return_num_output_tokens" in returns:
        tensors["num_output_tokens"] = np.array([len(token_ids)], dtype=np.uint32)
    if "return_cumulative_logprob" in returns:
        tensors["cumulative_logprob"] = np.array([out.cumulative_logprob], dtype=np.float32)
    if OUTPUT_TOKEN_IDS in returns:
        tensors["output_token_ids"] = np.array(token_ids, dtype=np.int32)
    if "return_logprobs" in returns:
        tensors["logprobs"] = np.array([logprobs_json(logprobs, state.decode_token, token_ids, ranks).encode()],
                                       dtype=np.object_)
    if PROMPT_LOGPROBS in returns and prompt is not None and prompt.prompt_logprobs is not None:
        # once per request: the streamed delta that carries them, or the final response
        tensors["prompt_logprobs"] = np.array([prompt_logprobs_json(
            prompt.prompt_logprobs, prompt.prompt_logprob_ranks, state.decode_token).encode()], dtype=np.object_)
    return tensors


def prompt_logprobs_json(prompt_logprobs: list[dict[int, float] | None], ranks: list[int | None] | None,
                         decode_token: Callable[[int], str] | None = None) -> str:
    """vLLM's prompt_logprobs: null for the first prompt token, then one object per prompt token in
    logprobs' shape, the prompt token first (each dict's first key) with the engine's rank."""
    ranks = ranks or [None] * len(prompt_logprobs)
    return json.dumps([None if step is None else _logprob_entry(step, next(iter(step)), rank, decode_token)
                       for step, rank in zip(prompt_logprobs, ranks)])


def logprobs_json(logprobs: list[dict[int, float]] | None, decode_token: Callable[[int], str] | None = None,
                  token_ids: list[int] | None = None, ranks: list[int | None] | None = None) -> str:
    """vllm_backend's shape: one {token_id: {"logprob", "rank", "decoded_token"}} object per output
    token, or null; the sampled token first, as vLLM orders them. `rank` (1 = most likely) is the
    position among the step's entries, exact for the top-n; the sampled token's is the engine's
    (`ranks`: vLLM's count over the whole vocabulary) when it sends one, else that position."""
    if logprobs is None:
        return "null"
    return json.dumps([_logprob_entry(step, token_ids[i] if token_ids is not None and i < len(token_ids) else None,
                                      ranks[i] if ranks is not None and i < len(ranks) else None, decode_token)
                       for i, step in enumerate(logprobs)])


def _logprob_entry(step: dict[int, float], sampled: int | None, engine_rank: int | None,
                   decode_token: Callable[[int], str] | None) -> dict:
    order = sorted(step, key=lambda t: (t != sampled, -step[t]))
    return {str(t): {"logprob": max(float(step[t]), MIN_LOGPROB),
                     "rank": engine_rank if t == sampled and engine_rank is not None
                     else 1 + sum(v > step[t] for v in step.values()),
                     "decoded_token": decode_token(t) if decode_token else None}
            for t in order}
