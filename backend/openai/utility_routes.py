"""vLLM's routes beside the OpenAI ones: /tokenize, /detokenize, /version, and /metrics (Triton's
metrics endpoint, passed through, so tools that scrape the API port find the engine's figures)."""

from __future__ import annotations

import asyncio
import urllib.error
import urllib.request
from importlib.metadata import PackageNotFoundError, version
from typing import Annotated

from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse
from pydantic import Field

from backend.openai.chat_template import ChatTemplate
from backend.openai.errors import OpenAIError, bad_request
from backend.openai.requests import ChatMessage, _Lenient, parse

PACKAGE = "deepseek-v4-triton"
METRICS_TIMEOUT_S = 5


class TokenizeRequest(_Lenient):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_generation_prompt: bool = True
    add_special_tokens: bool = True
    return_token_strs: bool = False
    chat_template_kwargs: dict | None = None


class DetokenizeRequest(_Lenient):
    model: str | None = None
    tokens: Annotated[list[int], Field(max_length=1 << 20)]


def load_tokenizer(tokenizer_dir: str | None):
    if not tokenizer_dir:
        return None
    from engine.tokenizer import Tokenizer

    return Tokenizer(tokenizer_dir)


def need_tokenizer(tokenizer, why: str = "no tokenizer to use"):
    if tokenizer is None:
        raise OpenAIError(501, f"this server was started without --tokenizer: {why}", type="not_implemented")
    return tokenizer


def add_utility_routes(app: FastAPI, tokenizer, template: ChatTemplate, read_json,
                       check_model, triton_metrics: str | None) -> None:

    @app.get("/version")
    async def server_version():
        try:
            return {"version": version(PACKAGE)}
        except PackageNotFoundError:
            return {"version": "unknown"}

    @app.post("/tokenize")
    async def tokenize(request: Request):
        req = parse(TokenizeRequest, await read_json(request))
        if req.model is not None:
            check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise bad_request("give one of prompt or messages", "prompt")
        if req.messages is not None:
            messages = [m.model_dump(exclude_none=True) for m in req.messages]
            text = template.render(messages, add_generation_prompt=req.add_generation_prompt,
                                   **(req.chat_template_kwargs or {}))
            ids = need_tokenizer(tokenizer).encode(text, add_special_tokens=False)  # the template wrote the BOS
        else:
            ids = need_tokenizer(tokenizer).encode(req.prompt, add_special_tokens=req.add_special_tokens)
        body = {"count": len(ids), "max_model_len": None, "tokens": ids, "token_strs": None}
        if req.return_token_strs:
            body["token_strs"] = [tokenizer.decode([i], skip_special_tokens=False) for i in ids]
        return body

    @app.post("/detokenize")
    async def detokenize(request: Request):
        req = parse(DetokenizeRequest, await read_json(request))
        if req.model is not None:
            check_model(req.model)
        return {"prompt": need_tokenizer(tokenizer).decode(req.tokens, skip_special_tokens=False)}

    @app.get("/metrics")
    async def metrics():
        if not triton_metrics:
            raise OpenAIError(404, "no metrics endpoint was given (--triton-metrics)")
        try:
            text = await asyncio.to_thread(_fetch, triton_metrics)
        except (urllib.error.URLError, OSError) as e:
            raise OpenAIError(503, f"Triton's metrics endpoint did not answer: {e}",
                              type="service_unavailable") from None
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")


def _fetch(url: str) -> str:
    with urllib.request.urlopen(url, timeout=METRICS_TIMEOUT_S) as response:
        return response.read().decode("utf-8")
