"""An OpenAI-compatible HTTP API in front of the Triton server, in its own process.

    python -m backend.openai --triton-grpc 127.0.0.1:8001 --port 9000 [--tokenizer CHECKPOINT_DIR]

`/v1/models`, `/v1/completions`, `/v1/chat/completions` (streaming and not) translated to the
model's wire protocol (backend/protocol.py's tensors) and sent over gRPC, so it fronts either
engine unchanged. One request here is one gRPC stream there: a client that goes away cancels it.

    app.py            routes, auth, error responses, SSE
    admission.py      requests in progress and body bytes held at once: past either, 503 + Retry-After
    body_limits.py    size and nesting limits, checked before the body is parsed
    body_parser.py    body -> checked JSON, large bodies in worker processes (off the event loop)
    forward_limits.py what may be sent to Triton: the engine's caps, a 400 naming the field
    readiness.py      /health: the Triton model ready and its engine's step not running too long
    requests.py       the OpenAI request bodies (pydantic) -> Triton sampling parameters
    responses.py      Triton outputs -> OpenAI responses and stream chunks (logprobs, usage)
    chat_template.py  the checkpoint's chat template (or DeepSeek's, shipped), thinking split
    triton.py         the asyncio gRPC client: one request, its responses, its cancellation
    errors.py         OpenAI's error body, and Triton's codes -> HTTP statuses
"""
