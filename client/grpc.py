"""gRPC client over tritonclient's bidirectional stream (the model is decoupled, so even a
non-streaming request goes through `start_stream` / `async_stream_infer`).

    from client.grpc import GrpcClient
    result = GrpcClient("127.0.0.1:8001").generate("Hello", max_tokens=16, temperature=0)
    for delta in GrpcClient().generate_stream("Hello", max_tokens=16):
        print(delta.text, end="", flush=True)

One client keeps one stream open and sends its requests on it one after another: opening a stream
starts two client threads and a server-side stream, ~5 ms of a request's TTFT on a busy host
(tools.profile_serving --ttft). Leaving a `generate_stream` loop early (break, exception) cancels
the request on the server (`stop_stream(cancel_requests=True)`, which aborts it in the engine) and
closes the stream; the next request opens a new one.
"""

from __future__ import annotations

import queue
import time
from collections.abc import Iterator

import numpy as np
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from client.types import DEFAULT_RETURNS, MODEL, Delta, Result, ServerError, delta_from_outputs, sampling_json

_OUTPUTS = ("text_output", "finish_reason", "num_input_tokens", "num_output_tokens", "cumulative_logprob",
            "logprobs")


def build_inputs(prompt: str, stream: bool, sampling: str, exclude_input_in_output: bool | None,
                 returns: tuple[str, ...]) -> list[grpcclient.InferInput]:
    def tensor(name, value, datatype):
        array = np.array([value], dtype=np.object_ if datatype == "BYTES" else bool)
        t = grpcclient.InferInput(name, [1], datatype)
        t.set_data_from_numpy(array)
        return t

    inputs = [tensor("text_input", prompt.encode("utf-8"), "BYTES"), tensor("stream", stream, "BOOL"),
              tensor("sampling_parameters", sampling.encode(), "BYTES")]
    if exclude_input_in_output is not None:
        inputs.append(tensor("exclude_input_in_output", exclude_input_in_output, "BOOL"))
    inputs += [tensor(name, True, "BOOL") for name in returns]
    return inputs


def to_server_error(error: InferenceServerException) -> ServerError:
    # errors inside the stream carry only a message; connection-level ones a gRPC status
    status = error.status()
    return ServerError(str(status).removeprefix("StatusCode.") if status else "UNKNOWN", error.message())


class GrpcClient:
    def __init__(self, url: str = "127.0.0.1:8001", model: str = MODEL, headers: dict | None = None,
                 verbose: bool = False):
        self.url = url
        self.model = model
        self.headers = headers
        self.client = grpcclient.InferenceServerClient(url, verbose=verbose)
        self._responses: queue.Queue | None = None  # the open stream's (result, error) pairs

    def close(self) -> None:
        self.client.close()  # closes an open stream too
        self._responses = None

    def __enter__(self) -> GrpcClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def generate(self, prompt: str, max_tokens: int | None = None, temperature: float | None = None,
                 exclude_input_in_output: bool | None = True, returns: tuple[str, ...] = DEFAULT_RETURNS,
                 timeout_s: float | None = 300.0, **sampling) -> Result:
        """One request, one final response (the whole text)."""
        deltas = list(self._run(prompt, False, sampling_json(max_tokens, temperature, **sampling),
                                exclude_input_in_output, returns, timeout_s))
        return Result.join(deltas)

    def generate_stream(self, prompt: str, max_tokens: int | None = None, temperature: float | None = None,
                        returns: tuple[str, ...] = DEFAULT_RETURNS, timeout_s: float | None = 300.0,
                        request_id: str = "", **sampling) -> Iterator[Delta]:
        """Yield deltas as the server streams them; the last has `finish_reason` set. `request_id`: the
        head of the engine's id for it (its logs; tools.profile_serving --hops matches by it)."""
        yield from self._run(prompt, True, sampling_json(max_tokens, temperature, **sampling), True, returns,
                             timeout_s, request_id)

    def _run(self, prompt, stream, sampling, exclude_input_in_output, returns, timeout_s,
             request_id: str = "") -> Iterator[Delta]:
        responses = self._stream()
        finished = reuse = False
        try:
            start = time.perf_counter()
            self.client.async_stream_infer(
                self.model, build_inputs(prompt, stream, sampling, exclude_input_in_output, returns),
                outputs=[grpcclient.InferRequestedOutput(n) for n in _OUTPUTS if n == "text_output"
                         or f"return_{n}" in returns],
                request_id=request_id, enable_empty_final_response=True)
            deadline = None if timeout_s is None else start + timeout_s
            while True:
                remaining = None if deadline is None else max(0.0, deadline - time.perf_counter())
                try:
                    result, error = responses.get(timeout=remaining)
                except queue.Empty:
                    raise ServerError("DEADLINE_EXCEEDED", f"no final response after {timeout_s} s") from None
                if error is not None:
                    finished = True  # the server ended the request with this error
                    raise to_server_error(error)
                final = result.get_response().parameters["triton_final_response"].bool_param
                outputs = {}
                for name in _OUTPUTS:
                    array = result.as_numpy(name)
                    if array is not None and array.size:
                        value = array.reshape(-1)[0]
                        outputs[name] = value.decode("utf-8") if isinstance(value, bytes) else value.item()
                if outputs:  # an empty final response carries only the flag
                    yield delta_from_outputs(outputs, time.perf_counter() - start)
                if final:
                    finished = reuse = True
                    return
        finally:
            if not reuse:  # a request still running (the caller stopped reading) is cancelled; after an
                # error the stream may be broken: either way the next request opens a new one
                self._close_stream(cancel=not finished)

    def _stream(self) -> queue.Queue:
        if self._responses is None:
            responses: queue.Queue = queue.Queue()
            # keyword arguments: tritonclient calls back with result= and error=
            self.client.start_stream(callback=lambda result, error: responses.put((result, error)),
                                     headers=self.headers)
            self._responses = responses
        return self._responses

    def _close_stream(self, cancel: bool) -> None:
        if self._responses is not None:
            self._responses = None
            self.client.stop_stream(cancel_requests=cancel)
