"""HTTP client over Triton's generate extension: `generate` (one JSON response) and
`generate_stream` (server-sent events, one `data: {...}` per delta).

    from client.http import HttpClient
    print(HttpClient("127.0.0.1:8000").generate("Hello", max_tokens=16).text)

Leaving a `generate_stream` loop early closes the connection; Triton then cancels the request.
"""

from __future__ import annotations

import http.client
import json
import time
from collections.abc import Iterator

from client.types import DEFAULT_RETURNS, MODEL, Delta, Result, ServerError, delta_from_outputs, sampling_json


def request_body(prompt: str, stream: bool, sampling: str, exclude_input_in_output: bool | None,
                 returns: tuple[str, ...]) -> dict:
    """Top-level keys named like inputs become input tensors (generate extension)."""
    body = {"text_input": prompt, "stream": stream, "sampling_parameters": sampling}
    if exclude_input_in_output is not None:
        body["exclude_input_in_output"] = exclude_input_in_output
    body.update(dict.fromkeys(returns, True))
    return body


class HttpClient:
    def __init__(self, url: str = "127.0.0.1:8000", model: str = MODEL, headers: dict | None = None,
                 timeout_s: float = 300.0):
        url = url.removeprefix("http://")
        self.host, _, port = url.partition(":")
        self.port = int(port or 8000)
        self.model = model
        self.headers = dict(headers or {})
        self.timeout_s = timeout_s

    def post(self, path: str, body: dict) -> http.client.HTTPResponse:
        """POST JSON; returns the open response (the caller reads it, then closes the connection)."""
        conn = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout_s)
        conn.request("POST", path, body=json.dumps(body),
                     headers={"Content-Type": "application/json", **self.headers})
        return conn.getresponse()

    def generate(self, prompt: str, max_tokens: int | None = None, temperature: float | None = None,
                 exclude_input_in_output: bool | None = True, returns: tuple[str, ...] = DEFAULT_RETURNS,
                 **sampling) -> Result:
        start = time.perf_counter()
        body = request_body(prompt, False, sampling_json(max_tokens, temperature, **sampling),
                            exclude_input_in_output, returns)
        response = self.post(f"/v2/models/{self.model}/generate", body)
        try:
            payload = _json(response.read())
            if response.status != 200 or "error" in payload:
                raise _error(response.status, payload)
        finally:
            response.close()
        return Result.join([delta_from_outputs(payload, time.perf_counter() - start)])

    def generate_stream(self, prompt: str, max_tokens: int | None = None, temperature: float | None = None,
                        returns: tuple[str, ...] = DEFAULT_RETURNS, **sampling) -> Iterator[Delta]:
        start = time.perf_counter()
        body = request_body(prompt, True, sampling_json(max_tokens, temperature, **sampling), True, returns)
        response = self.post(f"/v2/models/{self.model}/generate_stream", body)
        try:
            if response.status != 200:
                raise _error(response.status, _json(response.read()))
            for raw in response:
                line = raw.decode("utf-8").strip()
                if not line.startswith("data:"):
                    continue
                payload = _json(line[len("data:"):].strip().encode())
                if "error" in payload:
                    raise _error(None, payload)
                yield delta_from_outputs(payload, time.perf_counter() - start)
        finally:
            response.close()  # early exit: the closed connection cancels the request


def _json(raw: bytes) -> dict:
    try:
        payload = json.loads(raw or b"{}")
    except json.JSONDecodeError:
        return {"error": raw.decode("utf-8", "replace")}
    return payload if isinstance(payload, dict) else {"error": str(payload)}


def _error(status: int | None, payload: dict) -> ServerError:
    # Triton 2.51 answers generate with 400 for any error the model sends (INVALID_ARG or not)
    return ServerError(f"HTTP {status}" if status is not None else "UNKNOWN", str(payload.get("error", payload)))
