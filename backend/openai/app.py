"""The OpenAI-compatible routes. `build_app(Settings(...))` -> an ASGI app (uvicorn runs it).

A request's way: body limits -> JSON -> request model (400 on a bad field) -> model name (404)
-> prompt (chat template) -> one Triton gRPC stream -> an OpenAI body, or SSE chunks ending in
`data: [DONE]`. Triton's early errors (INVALID_ARG, UNAVAILABLE) come before the first chunk, so
they get their HTTP status; one in the middle of a stream becomes an `error` event."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import time
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException

from backend.openai import body_limits
from backend.openai.chat_template import ChatTemplate, ReasoningSplitter, opens_thinking
from backend.openai.errors import OpenAIError, bad_request
from backend.openai.requests import ChatCompletionRequest, CompletionRequest, parse
from backend.openai.responses import Builder
from backend.openai.triton import Call, Output, TritonModel

DISCONNECT_POLL_S = 0.25  # non-streaming requests: how often to look for a client that went away
_TEMPLATE_RESERVED = ("messages", "add_generation_prompt", "bos_token", "eos_token")


@dataclass
class Settings:
    triton_grpc: str  # host:port of Triton's gRPC endpoint
    model: str = "deepseek_v4"  # the Triton model
    served_model_name: str | None = None  # the name clients use (default: the Triton model's)
    tokenizer: str | None = None  # checkpoint dir whose tokenizer_config.json holds the chat template
    chat_template: str | None = None  # a template file or a shipped name, over the checkpoint's
    api_key: str | None = None
    max_body_bytes: int = body_limits.MAX_BODY_BYTES
    max_json_depth: int = body_limits.MAX_JSON_DEPTH


def build_app(settings: Settings) -> FastAPI:
    name = settings.served_model_name or settings.model
    template = ChatTemplate.load(settings.tokenizer, settings.chat_template)
    state: dict[str, TritonModel] = {}

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        state["model"] = TritonModel(settings.triton_grpc, settings.model)  # on the server's event loop
        yield
        await state["model"].close()

    app = FastAPI(title="DeepSeek-V4 OpenAI-compatible API", lifespan=lifespan, docs_url=None, redoc_url=None)

    @app.exception_handler(OpenAIError)
    async def _openai_error(_request, error: OpenAIError):
        return JSONResponse(error.body(), status_code=error.status)

    @app.exception_handler(HTTPException)
    async def _http_error(_request, error: HTTPException):  # unknown routes, wrong methods
        return JSONResponse(OpenAIError(error.status_code, str(error.detail)).body(), status_code=error.status_code)

    @app.exception_handler(Exception)
    async def _internal(_request, error: Exception):
        body = OpenAIError(500, f"internal error: {type(error).__name__}: {error}", type="internal_error").body()
        return JSONResponse(body, status_code=500)

    @app.middleware("http")
    async def _auth(request: Request, call_next):
        if settings.api_key and request.url.path.startswith("/v1/"):
            given = request.headers.get("authorization", "").removeprefix("Bearer ").strip()
            if not hmac.compare_digest(given.encode(), settings.api_key.encode()):
                error = OpenAIError(401, "invalid or missing API key (Authorization: Bearer KEY)",
                                    code="invalid_api_key")
                return JSONResponse(error.body(), status_code=401)
        return await call_next(request)

    @app.get("/health")
    async def health():
        """Ready only while the Triton model is (the launcher waits for this)."""
        ready = await state["model"].ready()
        return JSONResponse({"ready": ready}, status_code=200 if ready else 503)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [_model_card(name)]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        _check_model(model_id, name)
        return _model_card(name)

    @app.post("/v1/completions")
    async def completions(request: Request):
        req = parse(CompletionRequest, await _read_json(request, settings))
        _check_model(req.model, name)
        prompt = req.prompt_text()
        if not prompt:
            raise bad_request("prompt must not be empty", "prompt")
        sampling = req.sampling()
        builder = Builder("completion", name, req.logprobs, echo=prompt if req.echo else None)
        call = state["model"].generate(prompt, sampling, req.stream, req.logprobs is not None)
        echo = prompt if req.echo else ""
        if not req.stream:
            output = await _collect(call, request)
            builder.count(output)
            return builder.completion(echo + output.text, output)

        async def chunks(outputs):
            first = True
            async for output in outputs:
                builder.count(output)
                text, first = (echo if first else "") + output.text, False
                yield _with_usage(builder.completion_chunk(text, output), builder, req)

        return await _stream(call, chunks, builder, req)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        req = parse(ChatCompletionRequest, await _read_json(request, settings))
        _check_model(req.model, name)
        sampling = req.sampling()
        kwargs = {k: v for k, v in (req.chat_template_kwargs or {}).items() if k not in _TEMPLATE_RESERVED}
        prompt = template.render(req.template_messages(), add_generation_prompt=True, **kwargs)
        thinking = opens_thinking(prompt)
        builder = Builder("chat", name, (req.top_logprobs or 0) if req.logprobs else None)
        call = state["model"].generate(prompt, sampling, req.stream, req.logprobs)
        if not req.stream:
            output = await _collect(call, request)
            builder.count(output)
            splitter = ReasoningSplitter(thinking)
            reasoning, content = splitter.feed(output.text)
            held_reasoning, held_content = splitter.flush()
            return builder.chat(content + held_content, (reasoning + held_reasoning) if thinking else None, output)

        async def chunks(outputs):
            splitter = ReasoningSplitter(thinking)
            yield builder.chat_chunk({"role": "assistant", "content": ""}, None)
            async for output in outputs:
                builder.count(output)
                reasoning, content = splitter.feed(output.text)
                if output.finish_reason is not None:
                    held_reasoning, held_content = splitter.flush()
                    reasoning, content = reasoning + held_reasoning, content + held_content
                delta = {"reasoning_content": reasoning} if reasoning else {}
                if content or not reasoning:
                    delta["content"] = content
                yield _with_usage(builder.chat_chunk(delta, output), builder, req)

        return await _stream(call, chunks, builder, req)

    return app


def _model_card(name: str) -> dict:
    return {"id": name, "object": "model", "created": int(time.time()), "owned_by": "deepseek-v4-triton"}


def _check_model(model: str, served: str) -> None:
    if model != served:
        raise OpenAIError(404, f"The model '{model}' does not exist (this server serves '{served}')",
                          param="model", code="model_not_found")


async def _read_json(request: Request, settings: Settings) -> object:
    """The body, refused (413 / 400) by size and nesting before json.loads ever sees it."""
    declared = request.headers.get("content-length")
    if declared and declared.isdigit():
        body_limits.check_size(int(declared), settings.max_body_bytes)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        body_limits.check_size(size, settings.max_body_bytes)
        chunks.append(chunk)
    body = b"".join(chunks)
    body_limits.check_depth(body, settings.max_json_depth)
    try:
        return json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise bad_request(f"the request body is not valid JSON: {e}") from None


async def _collect(call: Call, request: Request) -> Output:
    """A non-streaming request's one Output; the Triton request is cancelled if the client leaves."""

    async def first():
        async for output in call:
            return output

    task = asyncio.ensure_future(first())
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if done:
                return task.result()
            if await request.is_disconnected():
                raise OpenAIError(499, "the client closed the connection")
    finally:
        if not task.done():
            task.cancel()
        call.cancel()


async def _stream(call: Call, chunks, builder: Builder, req) -> StreamingResponse:
    """SSE of `chunks(outputs)`. The first Triton response is awaited here, so an error that comes
    before any text (a bad parameter, an overloaded engine) is answered with its HTTP status."""
    outputs = aiter(call)
    try:
        first = await anext(outputs)
    except BaseException:
        call.cancel()
        raise

    async def replay():
        yield first
        async for output in outputs:
            yield output

    async def events():
        try:
            async for chunk in chunks(replay()):
                yield _sse(chunk)
            if req.include_usage:
                yield _sse(builder.usage_chunk())
        except OpenAIError as error:
            yield _sse(error.body())
        finally:
            call.cancel()  # synchronous: also runs when the client disconnects and this task is cancelled
        yield "data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def _with_usage(chunk: dict, builder: Builder, req) -> dict:
    if req.stream_options is not None and req.stream_options.continuous_usage_stats:
        chunk["usage"] = builder.usage()
    return chunk


def _sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"
