"""The OpenAI-compatible routes. `build_app(Settings(...))` -> an ASGI app (uvicorn runs it).

A request's way: admission (requests in progress, body bytes held) -> body limits -> JSON, off the
event loop when large, with the forwarded fields' caps -> request model (400 on a bad field) -> model name (404)
-> prompt (chat template) -> one Triton gRPC stream -> an OpenAI body, or SSE chunks ending in
`data: [DONE]`. Triton's early errors (INVALID_ARG, UNAVAILABLE) come before the first chunk, so
they get their HTTP status; one in the middle of a stream becomes an `error` event."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import time
from dataclasses import dataclass, replace

import orjson
from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException

from backend.openai import admission, body_limits, readiness
from backend.openai.admission import Admission, BodyBudget
from backend.openai.body_parser import BodyParser
from backend.openai.chat_output import ChatOutput, Piece, message
from backend.openai.chat_template import ChatTemplate, opens_thinking
from backend.openai.errors import OpenAIError
from backend.openai.forward_limits import ForwardLimits
from backend.openai.requests import ChatCompletionRequest, CompletionRequest, parse
from backend.openai.responses import Builder
from backend.openai.responses_api import ResponseBuilder, ResponsesRequest
from backend.openai.triton import Call, Output, TritonModel
from backend.openai.utility_routes import add_utility_routes, load_tokenizer, need_tokenizer

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
    triton_metrics: str | None = None  # Triton's /metrics URL, passed through at /metrics
    max_body_bytes: int = body_limits.MAX_BODY_BYTES
    max_json_depth: int = body_limits.MAX_JSON_DEPTH
    max_concurrent_requests: int = admission.MAX_CONCURRENT_REQUESTS
    max_body_bytes_in_flight: int = admission.MAX_BODY_BYTES_IN_FLIGHT
    forward_limits: ForwardLimits = ForwardLimits()  # the served model's caps (its model.json)
    unresponsive_after_s: float = readiness.UNRESPONSIVE_AFTER_S  # /health: 503 once a step runs longer


def build_app(settings: Settings) -> Admission:
    """The routes, behind the bound on requests in progress (an ASGI app; `.app` is the FastAPI one)."""
    name = settings.served_model_name or settings.model
    template = ChatTemplate.load(settings.tokenizer, settings.chat_template)
    tokenizer = load_tokenizer(settings.tokenizer)
    state: dict[str, TritonModel] = {}
    bodies = _Bodies(BodyBudget(settings.max_body_bytes_in_flight), settings.max_body_bytes,
                     BodyParser(settings.max_json_depth, settings.forward_limits))

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        # on the server's event loop
        state["model"] = TritonModel(settings.triton_grpc, settings.model, settings.forward_limits)
        yield
        bodies.parser.close()
        await state["model"].close()

    async def require_key(request: Request) -> None:
        """A dependency, not an HTTP middleware: Starlette's middleware wraps the request's receive
        channel, and `request.is_disconnected()` then never sees the client leave."""
        if settings.api_key and request.url.path not in OPEN_PATHS:
            scheme, _, given = request.headers.get("authorization", "").strip().partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), settings.api_key.encode()):
                raise OpenAIError(401, "invalid or missing API key (Authorization: Bearer KEY)", code="invalid_api_key")

    # the schema as a route of our own: FastAPI's built-in one would skip the key
    app = FastAPI(title="DeepSeek-V4 OpenAI-compatible API", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None, dependencies=[Depends(require_key)])

    @app.get("/openapi.json", include_in_schema=False)
    async def openapi_schema():
        return app.openapi()

    @app.exception_handler(OpenAIError)
    async def _openai_error(_request, error: OpenAIError):
        return JSONResponse(error.body(), status_code=error.status, headers=error.headers)

    @app.exception_handler(HTTPException)
    async def _http_error(_request, error: HTTPException):  # unknown routes, wrong methods
        return JSONResponse(OpenAIError(error.status_code, str(error.detail)).body(), status_code=error.status_code)

    @app.exception_handler(Exception)
    async def _internal(_request, error: Exception):
        body = OpenAIError(500, f"internal error: {type(error).__name__}: {error}", type="internal_error").body()
        return JSONResponse(body, status_code=500)

    @app.get("/health")
    async def health():
        """Ready only while the Triton model is and its engine answers (the launcher waits for this;
        a load balancer probes it)."""
        why = await readiness.not_ready_because(state["model"], settings.triton_metrics,
                                                settings.unresponsive_after_s)
        return JSONResponse({"ready": why is None} if why is None else {"ready": False, "reason": why},
                            status_code=200 if why is None else 503)

    add_utility_routes(app, tokenizer, template, bodies.read_json,
                       lambda model: _check_model(model, name), settings.triton_metrics)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [_model_card(name)]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        _check_model(model_id, name)
        return _model_card(name)

    @app.post("/v1/completions")
    async def completions(request: Request):
        req = parse(CompletionRequest, await bodies.read_json(request))
        _check_model(req.model, name)
        prompts = req.prompts()
        sampling = req.sampling()
        if not req.add_special_tokens:  # no BOS: the ids as the tokenizer gives them, without special tokens
            why = "add_special_tokens=false needs it"
            prompts = [need_tokenizer(tokenizer, why).encode(p, add_special_tokens=False) if isinstance(p, str)
                       else p for p in prompts]
        texts = [_prompt_text(p, tokenizer) for p in prompts] if req.echo else None
        jobs = [p for p in range(len(prompts)) for _ in range(req.n)]  # choice -> its prompt
        builder = Builder("completion", name, req.logprobs, echoes=[texts[p] for p in jobs] if req.echo else None)
        calls: list[Call] = []
        try:  # a prompt of the batch over the caps refuses the request: the calls already made end
            for i, p in enumerate(jobs):
                calls.append(state["model"].generate(prompts[p], _seeded(sampling, i % req.n), req.stream,
                                                     req.logprobs is not None))
        except OpenAIError:
            for call in calls:
                call.cancel()
            raise

        def read(output: Output) -> Output:
            return _prompt_only(output) if req.prompt_only else output

        if not req.stream:
            choices = []
            for i, output in enumerate(await _collect_all(calls, request)):
                output = read(output)
                builder.count(output, jobs[i])
                choices.append(builder.completion_choice(i, (texts[jobs[i]] if req.echo else "") + output.text, output))
            return builder.completion(choices)

        async def chunks(outputs):
            started = set()
            async for i, output in outputs:
                output = read(output)
                builder.count(output, jobs[i])
                echo = texts[jobs[i]] if req.echo and i not in started else ""
                started.add(i)
                yield _with_usage(builder.completion_chunk(i, echo + output.text, output), builder, req)

        return await _stream(request, calls, chunks, builder, req)

    def chat_prompt(req: ChatCompletionRequest):
        """A chat request's prompt, sampling parameters, and a maker of the per-choice output reader."""
        sampling = req.sampling()
        kwargs = {k: v for k, v in req.template_kwargs().items() if k not in _TEMPLATE_RESERVED}
        prompt = template.render(req.template_messages(), add_generation_prompt=True, **kwargs)
        thinking = opens_thinking(prompt)
        tools, forced = bool(req.active_tools()), req.tool_choice if req.forced_tools() else None

        def reader() -> ChatOutput:
            return ChatOutput(thinking, tools, forced, req.parallel_tool_calls)

        return prompt, sampling, thinking, reader

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        req = parse(ChatCompletionRequest, await bodies.read_json(request))
        _check_model(req.model, name)
        prompt, sampling, thinking, reader = chat_prompt(req)
        builder = Builder("chat", name, (req.top_logprobs or 0) if req.logprobs else None)
        calls = [state["model"].generate(prompt, _seeded(sampling, i), req.stream, req.logprobs)
                 for i in range(req.n)]
        if not req.stream:
            outputs = await _collect_all(calls, request)
            choices = []
            for i, output in enumerate(outputs):
                builder.count(output)
                choice = reader()
                pieces = [choice.feed(output.text), choice.finish()]
                choices.append(builder.chat_choice(i, message(pieces, thinking), output,
                                                   choice.finish_reason(output.finish_reason)))
            return builder.chat(choices, outputs[0])

        async def chunks(outputs):
            readers, sent_calls = [reader() for _ in calls], [0] * len(calls)
            for i in range(len(calls)):
                yield builder.chat_chunk(i, {"role": "assistant", "content": ""}, None)
            async for i, output in outputs:
                builder.count(output)
                piece = readers[i].feed(output.text)
                finish_reason = None
                if output.finish_reason is not None:
                    rest = readers[i].finish()
                    piece = Piece(piece.reasoning + rest.reasoning, piece.content + rest.content,
                                  piece.calls + rest.calls)
                    finish_reason = readers[i].finish_reason(output.finish_reason)
                delta = {"reasoning_content": piece.reasoning} if piece.reasoning else {}
                if piece.content or not (piece.reasoning or piece.calls):
                    delta["content"] = piece.content
                if piece.calls:
                    delta["tool_calls"] = [call.openai(sent_calls[i] + k) for k, call in enumerate(piece.calls)]
                    sent_calls[i] += len(piece.calls)
                yield _with_usage(builder.chat_chunk(i, delta, output, finish_reason), builder, req)

        return await _stream(request, calls, chunks, builder, req)

    @app.post("/v1/responses")
    async def responses(request: Request):
        responses_req = parse(ResponsesRequest, await bodies.read_json(request))
        _check_model(responses_req.model, name)
        req = parse(ChatCompletionRequest, responses_req.chat_body())
        prompt, sampling, _thinking, reader = chat_prompt(req)
        builder = ResponseBuilder(name, responses_req)
        call = state["model"].generate(prompt, sampling, req.stream, False)
        choice = reader()
        if not req.stream:
            output = (await _collect_all([call], request))[0]
            builder.count(output)
            builder.add_message([choice.feed(output.text), choice.finish()])
            return builder.final(output.finish_reason)

        async def events(outputs):
            for event in builder.start():
                yield event
            try:
                async for _, output in outputs:
                    builder.count(output)
                    for event in builder.feed(choice.feed(output.text)):
                        yield event
                    if output.finish_reason is not None:
                        for event in builder.feed(choice.finish()) + builder.finish(output.finish_reason):
                            yield event
            except OpenAIError as error:  # after the first event: an error event ends the stream
                yield builder.event("error", code=error.code, message=error.message, param=error.param)

        return await _stream(request, [call], events, sse=_sse_event, done=None)

    return Admission(app, settings.max_concurrent_requests, OPEN_PATHS)


def _prompt_text(prompt: str | list[int], tokenizer) -> str:
    """What echo returns: the text, or a token-id prompt's detokenized text."""
    if isinstance(prompt, str):
        return prompt
    return need_tokenizer(tokenizer, "echo of a token-id prompt needs it").decode(prompt, skip_special_tokens=False)


def _prompt_only(output: Output) -> Output:
    """max_tokens=0 with echo: the one token generated (vLLM's way) is dropped, text, logprob and count."""
    return replace(output, text="", num_output_tokens=0, logprobs=None if output.logprobs is None else [],
                   finish_reason=None if output.finish_reason is None else "length")


def _model_card(name: str) -> dict:
    return {"id": name, "object": "model", "created": int(time.time()), "owned_by": "deepseek-v4-triton"}


def _check_model(model: str, served: str) -> None:
    if model != served:
        raise OpenAIError(404, f"The model '{model}' does not exist (this server serves '{served}')",
                          param="model", code="model_not_found")


# what a probe or a scraper reads without the API key (vLLM leaves these open too); everything else,
# the routes and their schema (/openapi.json) included, needs "Authorization: Bearer KEY"
OPEN_PATHS = frozenset({"/health", "/metrics", "/version"})


class _Bodies:
    """Request bodies: read within the size cap and the bytes-in-flight budget, then parsed."""

    def __init__(self, budget: BodyBudget, max_bytes: int, parser: BodyParser):
        self.budget, self.max_bytes, self.parser = budget, max_bytes, parser

    async def read_json(self, request: Request) -> object:
        """The body's JSON value, refused (413 / 400 / 503) by size, nesting and the budget before
        json.loads ever sees it."""
        with self.budget.hold() as held:
            declared = request.headers.get("content-length")
            if declared and declared.isdigit():
                body_limits.check_size(int(declared), self.max_bytes)
                held.reserve(int(declared))
            chunks, size = [], 0
            async for chunk in request.stream():
                size += len(chunk)
                body_limits.check_size(size, self.max_bytes)
                held.reserve(size)
                chunks.append(chunk)
            body = b"".join(chunks)
            del chunks
            return await self.parser.parse(body)


async def _collect(call: Call, request: Request) -> Output:
    """A non-streaming request's one Output; the Triton request is cancelled if the client leaves."""

    async def first():
        async for output in call:
            return output

    try:
        return await _unless_disconnected(first(), request)
    finally:
        call.cancel()


async def _unless_disconnected(awaitable, request: Request):
    """`awaitable`'s result, or OpenAIError 499 (and `awaitable` cancelled) once the client has left."""
    task = asyncio.ensure_future(awaitable)
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


async def _collect_all(calls: list[Call], request: Request) -> list[Output]:
    """Each call's one Output (the n choices run at once); all are cancelled if one fails."""
    try:
        return list(await asyncio.gather(*(_collect(call, request) for call in calls)))
    finally:
        for call in calls:
            call.cancel()


def _seeded(sampling: dict, choice: int) -> dict:
    """Choice i of n samples with seed + i: the choices differ, and the same request repeats them."""
    if choice and sampling.get("seed") is not None:
        return {**sampling, "seed": sampling["seed"] + choice}
    return sampling


async def _stream(request: Request, calls: list[Call], chunks, builder: Builder | None = None, req=None, sse=None,
                  done: bytes | None = b"data: [DONE]\n\n") -> StreamingResponse:
    """SSE of `chunks(outputs)`, `outputs` yielding (choice index, Output) as the calls answer. The
    first Triton response of each is awaited here, so an error that comes before any text (a bad
    parameter, an overloaded engine) is answered with its HTTP status. `sse` frames a chunk
    (default: `data:` only), `done` ends the stream (the Responses API sends no [DONE])."""
    sse = sse or _sse
    streams = [aiter(call) for call in calls]
    try:  # a queued request sends nothing yet: a client that leaves is seen by polling, as in _collect
        firsts = await _unless_disconnected(asyncio.gather(*(anext(stream) for stream in streams)), request)
    except BaseException:
        for call in calls:
            call.cancel()
        raise

    queue: asyncio.Queue = asyncio.Queue()  # (choice, Output | None at its end | the error it raised)

    async def merged():
        async def pump(i: int):
            try:
                await queue.put((i, firsts[i]))
                async for output in streams[i]:
                    await queue.put((i, output))
                await queue.put((i, None))
            except Exception as error:  # noqa: BLE001 - handed to the consumer, which raises it
                await queue.put((i, error))

        tasks = [asyncio.ensure_future(pump(i)) for i in range(len(streams))]
        try:
            left = len(tasks)
            while left:
                i, item = await queue.get()
                if item is None:
                    left -= 1
                elif isinstance(item, Exception):
                    raise item
                else:
                    yield i, item
        finally:
            for task in tasks:
                task.cancel()

    async def events():
        # the chunks of the outputs already here go out in one write: a front (or client) behind the
        # engine sends fewer, larger writes instead of falling further behind, one syscall per token
        framed: list[bytes] = []
        try:
            async for chunk in chunks(merged()):
                framed.append(sse(chunk))
                if queue.empty():
                    yield b"".join(framed)
                    framed.clear()
            if req is not None and req.include_usage:
                framed.append(sse(builder.usage_chunk()))
        except OpenAIError as error:
            framed.append(sse(error.body()))
        finally:
            for call in calls:  # synchronous: also runs when the client disconnects and this task is cancelled
                call.cancel()
        if done:
            framed.append(done)
        if framed:
            yield b"".join(framed)

    return StreamingResponse(events(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def _with_usage(chunk: dict, builder: Builder, req) -> dict:
    if req.stream_options is not None and req.stream_options.continuous_usage_stats:
        chunk["usage"] = builder.usage()
    return chunk


def _json(payload: dict) -> bytes:
    # orjson: a tenth of json.dumps's time per chunk; int keys are vLLM's prompt_logprobs token ids
    return orjson.dumps(payload, option=orjson.OPT_NON_STR_KEYS)


def _sse(payload: dict) -> bytes:
    return b"data: " + _json(payload) + b"\n\n"


def _sse_event(payload: dict) -> bytes:
    """The Responses API's framing: the event's type on its own line, then its data."""
    return b"event: " + payload["type"].encode() + b"\ndata: " + _json(payload) + b"\n\n"
