"""The model over Triton's gRPC API (tritonclient's asyncio client): one request, its responses.

Each request gets its own bidirectional stream, kept open until the final response, so closing
the generator (the HTTP client went away, the task was cancelled) cancels that stream, and
Triton cancels the request in the backend, which aborts it in the engine and frees its cache."""

from __future__ import annotations

import asyncio
import json
import struct
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
import numpy as np
import tritonclient.grpc.aio as grpcclient
from tritonclient.utils import InferenceServerException

from backend.openai.errors import OpenAIError, from_triton
from backend.openai.forward_limits import ForwardLimits, check_forwarded

UNFINISHED = ("", "None")  # finish_reason of a delta that is not the last (vllm_backend sends "None")


@dataclass
class Output:
    """One Triton response, decoded."""

    text: str
    finish_reason: str | None  # set on the last response only
    num_input_tokens: int | None = None
    num_output_tokens: int = 0
    logprobs: list[dict] | None = None  # per token: {token_id: {"logprob", "rank", "decoded_token"}}
    prompt_logprobs: list[dict | None] | None = None  # vLLM's: None, then one such object per prompt token


class TritonModel:
    def __init__(self, url: str, model_name: str, limits: ForwardLimits | None = None):
        self.url, self.model_name, self.limits = url, model_name, limits or ForwardLimits()
        self.client = grpcclient.InferenceServerClient(url)

    async def ready(self) -> bool:
        try:
            return bool(await self.client.is_model_ready(self.model_name))
        except InferenceServerException:
            return False

    async def close(self) -> None:
        await self.client.close()

    def generate(self, prompt: str | list[int], sampling: dict, stream: bool, logprobs: bool) -> Call:
        """Deltas when `stream`, else one Output with the whole text; iterating raises OpenAIError.
        A token-id prompt goes as the input_ids tensor: the engine takes the ids as they are.
        OpenAIError 400, and nothing sent, when a tensor would be over the model's caps."""
        sampling_json = json.dumps(sampling)
        check_forwarded(prompt, sampling_json, sampling, self.limits)
        flags = {"stream": stream, "exclude_input_in_output": True, "return_finish_reason": True,
                 "return_num_input_tokens": True, "return_num_output_tokens": True, "return_logprobs": logprobs}
        prompt_tensor = (_tensor("text_input", np.array([prompt.encode("utf-8")], dtype=np.object_), "BYTES")
                         if isinstance(prompt, str) else _tensor("input_ids", np.array(prompt, dtype=np.int32), "INT32"))
        inputs = [prompt_tensor,
                  _tensor("sampling_parameters", np.array([sampling_json.encode()], dtype=np.object_),
                          "BYTES")]
        inputs += [_tensor(name, np.array([value]), "BOOL") for name, value in flags.items()]
        request = {"model_name": self.model_name, "inputs": inputs, "request_id": f"oai-{uuid.uuid4().hex[:16]}"}
        return Call(self.client, request)


class Call:
    """One request's gRPC stream: iterate for its Outputs; `cancel()` is synchronous, so it also
    works from a `finally` that runs while its task is being cancelled (a client disconnect)."""

    def __init__(self, client: grpcclient.InferenceServerClient, request: dict):
        self._finished = asyncio.Event()

        async def requests():
            yield request
            await self._finished.wait()  # closing the request side early would end the stream

        self._responses = client.stream_infer(requests())

    async def __aiter__(self) -> AsyncIterator[Output]:
        try:
            async for result, error in self._responses:
                if error is not None:
                    raise from_triton(error.message())
                output = _decode(result)
                yield output
                if output.finish_reason is not None:
                    return
            raise OpenAIError(500, "the Triton stream ended before the final response", type="internal_error")
        except InferenceServerException as e:
            raise from_triton(f"{e.status()}: {e.message()}") from e
        except grpc.RpcError as e:  # the RPC itself failed: Triton down or shutting down
            raise from_triton(f"{e.code()}: {e.details()}") from e
        finally:
            self.cancel()

    def cancel(self) -> None:
        """A no-op after the final response; before it, Triton cancels the request in the backend."""
        self._finished.set()
        self._responses.cancel()


def _tensor(name: str, array: np.ndarray, datatype: str) -> grpcclient.InferInput:
    tensor = grpcclient.InferInput(name, list(array.shape), datatype)
    tensor.set_data_from_numpy(array)
    return tensor


def _decode(result) -> Output:
    """One pass over the response's outputs, each tensor's first element read from its raw bytes:
    tritonclient's as_numpy scans every output per name and builds numpy arrays, several times the
    cost of the rest of a streamed token's way through the front (tools/profile_front)."""
    response = result.get_response()
    values = {}
    for output, raw in zip(response.outputs, response.raw_output_contents):
        values[output.name] = _first(output.datatype, raw)
    reason, logprobs, prompt_logprobs = values.get("finish_reason"), values.get("logprobs"), values.get("prompt_logprobs")
    num_input_tokens = values.get("num_input_tokens")
    return Output(text=values.get("text_output") or "", finish_reason=None if reason in UNFINISHED else reason,
                  num_input_tokens=None if num_input_tokens is None else int(num_input_tokens),
                  num_output_tokens=int(values.get("num_output_tokens") or 0),
                  logprobs=None if logprobs in (None, "null") else json.loads(logprobs),
                  prompt_logprobs=None if prompt_logprobs is None else json.loads(prompt_logprobs))


_SCALARS = {"BOOL": struct.Struct("<?"), "INT32": struct.Struct("<i"), "UINT32": struct.Struct("<I"),
            "INT64": struct.Struct("<q"), "UINT64": struct.Struct("<Q"), "FP32": struct.Struct("<f"),
            "FP64": struct.Struct("<d")}


def _first(datatype: str, raw: bytes) -> str | int | float | None:
    """A tensor's first element (None when it has none): BYTES elements are a 4-byte little-endian
    length, then that many bytes (UTF-8 text here)."""
    if datatype == "BYTES":
        if len(raw) < 4:
            return None
        size = int.from_bytes(raw[:4], "little")
        return raw[4:4 + size].decode("utf-8")
    scalar = _SCALARS.get(datatype)
    if scalar is None:
        raise OpenAIError(500, f"unexpected {datatype} output from Triton", type="internal_error")
    return scalar.unpack_from(raw)[0] if len(raw) >= scalar.size else None
