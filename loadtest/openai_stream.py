"""Streamed `/v1/completions` (the OpenAI service, backend/openai) for the load tests: the request
body, each server-sent chunk as a client.types.Delta, and a plain-socket client for the thread
driver. Locust's OpenAIUser (geventhttpclient) reads the same chunks the same way.

The workload's prompt goes as is, so token counts match the Triton users'. `continuous_usage_stats`
puts the running usage on every chunk: each delta's token count is its difference.
"""

from __future__ import annotations

import http.client
import json
from collections.abc import Iterator

from client.types import MODEL, Delta, ServerError

DONE = b"data: [DONE]"


def completion_body(model: str, prompt: str, sampling: dict) -> dict:
    return {"model": model, "prompt": prompt, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}, **sampling}


class ChunkReader:
    """One stream's chunks -> deltas, keeping the running completion-token count."""

    def __init__(self):
        self.tokens = 0

    def delta(self, line: bytes) -> Delta | None:
        """A stripped `data: {...}` line -> its Delta; None for the usage-only chunk and non-data lines."""
        if not line.startswith(b"data:"):
            return None
        payload = json.loads(line.removeprefix(b"data:"))
        if "error" in payload:
            raise ServerError("UNKNOWN", str(payload["error"]))
        if not payload["choices"]:
            return None  # the usage chunk
        choice = payload["choices"][0]
        usage = payload.get("usage") or {}
        new = usage.get("completion_tokens", self.tokens) - self.tokens
        self.tokens += new
        return Delta(text=choice["text"], num_output_tokens=new, num_input_tokens=usage.get("prompt_tokens"),
                     finish_reason=choice.get("finish_reason"))


class OpenAIStreamClient:
    """http.client, one connection per request (the thread driver's users); leaving the loop early
    closes it, which makes the service cancel the request."""

    def __init__(self, url: str, model: str = MODEL, timeout_s: float = 600.0):
        host, _, port = url.removeprefix("http://").partition(":")
        self.host, self.port, self.model, self.timeout_s = host, int(port or 9000), model, timeout_s

    def generate_stream(self, prompt: str, **sampling) -> Iterator[Delta]:
        conn = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout_s)
        try:
            conn.request("POST", "/v1/completions", body=json.dumps(completion_body(self.model, prompt, sampling)),
                         headers={"Content-Type": "application/json"})
            response = conn.getresponse()
            if response.status != 200:
                raise ServerError(f"HTTP {response.status}", response.read().decode("utf-8", "replace"))
            reader = ChunkReader()
            for raw in response:
                line = raw.strip()
                if line == DONE:
                    return
                delta = reader.delta(line)
                if delta is not None:
                    yield delta
            raise ServerError("UNKNOWN", "the stream ended without data: [DONE]")
        finally:
            conn.close()
