"""The OpenAI service (backend/openai) with the official openai SDK, against the session's real
tritonserver: completions and chat, streaming and not, usage, stop, logprobs, errors in OpenAI's
format, the reasoning split, the API key, cancellation, and bodies refused before parsing."""

from __future__ import annotations

import http.client
import json
import select
import socket
import time
import urllib.error
import urllib.request

import openai
import pytest

from backend.openai.chat_template import ChatTemplate
from backend.openai.process import OpenAIProcess, tokenizer_dir
from client.grpc import GrpcClient
from loadtest.scrape import metric, metrics_text
from tests.conftest import SERVER_ENGINE_ARGS

pytestmark = pytest.mark.slow

MODEL = "deepseek_v4"
PROMPT = "The quick brown fox"
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]


@pytest.fixture(scope="module")
def triton_greedy(triton_server):
    """Greedy text straight from Triton (gRPC), the oracle for what the front must return."""
    with GrpcClient(triton_server.grpc_url) as client:
        yield lambda prompt, n: client.generate(prompt, max_tokens=n, temperature=0)


@pytest.fixture(scope="module")
def template(triton_server):
    model_json = triton_server.workdir / "model_repository" / MODEL / "1" / "model.json"
    return tokenizer_dir(model_json)


def test_models(sdk):
    assert [m.id for m in sdk.models.list().data] == [MODEL]
    assert sdk.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        sdk.models.retrieve("gpt-4")


def test_completion_matches_triton_and_counts_usage(sdk, triton_greedy):
    expected = triton_greedy(PROMPT, 8)
    out = sdk.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0)
    assert out.object == "text_completion" and out.choices[0].text == expected.text
    assert out.choices[0].finish_reason == "length"
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (expected.num_input_tokens, 8)
    assert out.usage.total_tokens == expected.num_input_tokens + 8

    chunks = list(sdk.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0, stream=True,
                                         stream_options={"include_usage": True}))
    assert len(chunks) > 2 and "".join(c.choices[0].text for c in chunks if c.choices) == expected.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8  # include_usage: last chunk
    assert all(c.usage is None for c in chunks[:-1])
    echoed = sdk.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0, echo=True)
    assert echoed.choices[0].text == PROMPT + expected.text


def test_chat_renders_the_checkpoints_template(sdk, triton_greedy, template):
    prompt = ChatTemplate.load(template).render(MESSAGES)
    assert prompt.endswith("<｜Assistant｜>") and "<｜User｜>Name a colour." in prompt
    expected = triton_greedy(prompt, 10)
    out = sdk.chat.completions.create(model=MODEL, messages=MESSAGES, max_completion_tokens=10, temperature=0)
    message = out.choices[0].message
    assert message.role == "assistant" and message.content == expected.text
    assert getattr(message, "reasoning_content", None) is None  # this template does not think
    assert out.usage.prompt_tokens == expected.num_input_tokens and out.usage.completion_tokens == 10

    chunks = list(sdk.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=10, temperature=0,
                                              stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected.text
    assert chunks[-1].usage.completion_tokens == 10


def test_stop_string_ends_the_text_before_it(sdk, triton_greedy):
    text = triton_greedy(PROMPT, 16).text
    stop = text[len(text) // 2:len(text) // 2 + 3]
    out = sdk.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0, stop=[stop])
    assert out.choices[0].text == text[:text.index(stop)] and out.choices[0].finish_reason == "stop"
    assert out.usage.completion_tokens < 16


def test_logprobs(sdk):
    out = sdk.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=3)
    lp = out.choices[0].logprobs
    assert "".join(lp.tokens) == out.choices[0].text and len(lp.tokens) == 6
    for sampled, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert len(top) <= 3 and sampled == pytest.approx(max(top.values()))  # greedy: the top-1 was sampled
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(6)]

    chat = sdk.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=5, temperature=0.8, seed=1,
                                       logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert "".join(t.token for t in content) == chat.choices[0].message.content and len(content) == 5
    for token in content:
        assert len(token.top_logprobs) == 2 and token.top_logprobs[0].logprob >= token.top_logprobs[1].logprob
        assert token.logprob <= token.top_logprobs[0].logprob + 1e-6 and token.logprob < 0
        assert bytes(token.bytes).decode("utf-8", "replace") == token.token or not token.bytes
    plain = sdk.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=3)
    assert plain.choices[0].logprobs is None


def test_prompt_logprobs_and_echo_with_logprobs(sdk, triton_server):
    direct = json.loads(urllib.request.urlopen(urllib.request.Request(
        f"http://{triton_server.http_url}/v2/models/{MODEL}/generate", method="POST", data=json.dumps({
            "text_input": PROMPT, "sampling_parameters": json.dumps({"max_tokens": 2, "temperature": 0,
                                                                     "prompt_logprobs": 2})}).encode()),
        timeout=60).read())
    want = json.loads(direct["prompt_logprobs"])
    out = sdk.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, temperature=0,
                                 extra_body={"prompt_logprobs": 2})
    assert out.choices[0].prompt_logprobs == want and want[0] is None and len(want) == out.usage.prompt_tokens
    # echo + logprobs (lm-eval's loglikelihood request): the prompt's tokens lead, the first without a logprob
    echo = sdk.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, temperature=0, logprobs=1, echo=True)
    lp = echo.choices[0].logprobs
    n = echo.usage.prompt_tokens
    assert len(lp.tokens) == n + 2 and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1:n] == [next(iter(step.values()))["logprob"] for step in want[1:]]
    assert "".join(lp.tokens) == echo.choices[0].text == PROMPT + out.choices[0].text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(n + 2)]
    chat = sdk.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2, extra_body={"prompt_logprobs": 0})
    assert chat.prompt_logprobs[0] is None and len(chat.prompt_logprobs) == chat.usage.prompt_tokens
    assert all(len(step) == 1 for step in chat.prompt_logprobs[1:])
    for kwargs, message in (({"prompt_logprobs": 21}, "prompt_logprobs must be between 0 and 20"),
                            ({"prompt_logprobs": -1}, "greater than or equal to 0")):
        with pytest.raises(openai.BadRequestError, match=message):
            sdk.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, extra_body=kwargs)
    with pytest.raises(openai.BadRequestError, match="not available when stream=true"):
        sdk.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, stream=True, extra_body={"prompt_logprobs": 1})


@pytest.mark.parametrize("kwargs, param, message", [
    ({"temperature": 5}, "temperature", "less than or equal to 2"),
    ({"n": 17}, "n", "less than or equal to 16"),
    ({"top_p": 0}, "top_p", "greater than 0"),
    ({"max_tokens": 10**6}, None, "INVALID_ARG: max_tokens must be between 1 and 512"),  # the engine's check
    ({"extra_body": {"best_of": 3}}, "best_of", "best_of is not supported"),
    ({"extra_body": {"top_k": -5}}, None, "INVALID_ARG: top_k must be"),  # vLLM's extra field, the engine's check
    ({"stream": True, "max_tokens": 0}, "max_tokens", "max_tokens=0 is only allowed with echo=true"),
])
def test_bad_parameters_are_400_in_openai_format(sdk, kwargs, param, message):
    with pytest.raises(openai.BadRequestError) as info:
        out = sdk.completions.create(model=MODEL, prompt=PROMPT, **{"max_tokens": 4, **kwargs})
        list(out) if kwargs.get("stream") else None
    assert info.value.status_code == 400
    error = info.value.body
    assert error["type"] == "invalid_request_error" and message in error["message"] and error["param"] == param


def test_a_lone_surrogate_is_400_not_500(sdk):
    """JSON may escape a lone surrogate ("\\ud800"); the SDK cannot even send one, raw clients can."""
    base = str(sdk.base_url).rstrip("/")
    for path, body in (("/completions", {"model": MODEL, "prompt": "a\ud800b", "max_tokens": 2}),
                       ("/chat/completions", {"model": MODEL, "max_tokens": 2,
                                              "messages": [{"role": "user", "content": "x\udfff"}]})):
        raw = json.dumps(body).encode()  # ensure_ascii: the surrogate travels as its escape
        request = urllib.request.Request(base + path, raw, {"Content-Type": "application/json",
                                                             "Authorization": f"Bearer {sdk.api_key}"})
        with pytest.raises(urllib.error.HTTPError) as info:
            urllib.request.urlopen(request, timeout=30)
        assert info.value.code == 400 and "surrogate" in json.loads(info.value.read())["error"]["message"]
    assert sdk.completions.create(model=MODEL, prompt="a\U0001F600b", max_tokens=2).choices  # a real pair is fine


def test_unknown_model_is_404(sdk):
    with pytest.raises(openai.NotFoundError) as info:
        sdk.chat.completions.create(model="gpt-4o", messages=MESSAGES, max_tokens=2)
    assert info.value.status_code == 404 and info.value.body["code"] == "model_not_found"


def test_closing_the_stream_cancels_the_triton_request(sdk, triton_server):
    before = metrics_text(triton_server.metrics_url)
    aborted_before = metric(before, "deepseek:request_success_total", finished_reason="abort") or 0
    cancelled_before = metric(before, "deepseek:request_failure_total", code="CANCELLED") or 0
    stream = sdk.completions.create(model=MODEL, prompt=PROMPT, max_tokens=480, stream=True,
                                    extra_body={"ignore_eos": True})
    received = 0
    for _ in stream:
        received += 1
        if received >= 3:
            break
    stream.close()
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        text = metrics_text(triton_server.metrics_url)
        aborted = metric(text, "deepseek:request_success_total", finished_reason="abort") or 0
        if aborted == aborted_before + 1 and metric(text, "deepseek:num_requests_running") == 0:
            break
        time.sleep(0.2)
    else:
        pytest.fail(f"the closed stream's request was not aborted in the engine:\n{triton_server.log_tail()}")
    assert (metric(text, "deepseek:request_failure_total", code="CANCELLED") or 0) == cancelled_before  # counted once


def test_a_non_streaming_client_that_leaves_cancels_its_triton_request(openai_server, triton_server):
    """The client closes its connection while its (non-streaming) request runs: the engine aborts it,
    it does not run its 480 tokens to the end."""
    before = metrics_text(triton_server.metrics_url)
    aborted_before = metric(before, "deepseek:request_success_total", finished_reason="abort") or 0
    length_before = metric(before, "deepseek:request_success_total", finished_reason="length") or 0
    body = json.dumps({"model": MODEL, "prompt": PROMPT, "max_tokens": 480, "ignore_eos": True}).encode()
    with socket.create_connection(("127.0.0.1", openai_server.port), timeout=10) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        deadline = time.monotonic() + 30
        while (metric(metrics_text(triton_server.metrics_url), "deepseek:num_requests_running") or 0) < 1:
            assert time.monotonic() < deadline, "the request never started"
            time.sleep(0.05)
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        text = metrics_text(triton_server.metrics_url)
        if (metric(text, "deepseek:request_success_total", finished_reason="abort") or 0) == aborted_before + 1:
            break
        time.sleep(0.1)
    else:
        pytest.fail("the request of a client that left was not aborted")
    assert (metric(text, "deepseek:request_success_total", finished_reason="length") or 0) == length_before


def _open_request(front: OpenAIProcess, body: dict) -> socket.socket:
    """A request sent on a raw connection, left open (the caller closes it: a client that leaves)."""
    raw = json.dumps(body).encode()
    s = socket.create_connection(("127.0.0.1", front.port), timeout=10)
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Content-Length: " + str(len(raw)).encode() + b"\r\n\r\n" + raw)
    return s


def _wait_metric(triton_server, name: str, ok, timeout_s: float = 30, **labels) -> float:
    deadline = time.monotonic() + timeout_s
    while True:
        value = metric(metrics_text(triton_server.metrics_url), name, **labels) or 0
        if ok(value):
            return value
        assert time.monotonic() < deadline, f"{name} {labels} stayed at {value}"
        time.sleep(0.05)


def test_a_queued_streaming_client_that_leaves_is_dropped_before_it_runs(openai_server, triton_server):
    """Every sequence slot busy, one streaming request queued behind them: its client leaves before
    its first token; it leaves the queue at once and never runs."""
    aborted = metric(metrics_text(triton_server.metrics_url), "deepseek:request_success_total",
                     finished_reason="abort") or 0
    long = {"model": MODEL, "prompt": PROMPT, "max_tokens": 480, "ignore_eos": True}
    fillers = [_open_request(openai_server, long) for _ in range(SERVER_ENGINE_ARGS["max_num_seqs"])]
    try:
        _wait_metric(triton_server, "deepseek:num_requests_running", lambda v: v == len(fillers))
        queued = _open_request(openai_server, {**long, "stream": True})
        _wait_metric(triton_server, "deepseek:num_requests_waiting", lambda v: v == 1)
        queued.close()
        _wait_metric(triton_server, "deepseek:num_requests_waiting", lambda v: v == 0, timeout_s=5)
        assert (metric(metrics_text(triton_server.metrics_url), "deepseek:num_requests_running") or 0) == len(fillers)
    finally:
        for s in fillers:
            s.close()
    _wait_metric(triton_server, "deepseek:request_success_total", lambda v: v == aborted + len(fillers) + 1,
                 finished_reason="abort")


def _raw_post(front: OpenAIProcess, body: bytes, headers: dict | None = None) -> tuple[int, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", front.port, timeout=60)
    conn.request("POST", "/v1/completions", body=body, headers={"Content-Type": "application/json", **(headers or {})})
    response = conn.getresponse()
    status, payload = response.status, json.loads(response.read())
    conn.close()
    return status, payload


def test_deep_and_huge_bodies_are_refused_before_parsing(openai_server, sdk):
    status, payload = _raw_post(openai_server, b"[" * 200_000 + b"]" * 200_000)
    assert status == 400 and payload["error"]["code"] == "json_too_deep"
    nested = b'{"model": "deepseek_v4", "prompt": "x", "user": ' + b"[" * 70 + b"]" * 70 + b"}"
    assert _raw_post(openai_server, nested)[0] == 400
    strings = b'{"model": "deepseek_v4", "prompt": "' + b"[{" * 100 + b'\\"", "max_tokens": 2}'
    assert _raw_post(openai_server, strings)[0] == 200  # brackets inside strings are text
    # a declared size over the limit is refused before any of the body is read
    with socket.create_connection(("127.0.0.1", openai_server.port), timeout=30) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 999999999\r\n\r\n{")
        assert s.recv(4096).split(b"\r\n")[0].endswith(b"413 Request Entity Too Large")
    assert _raw_post(openai_server, b"{not json")[0] == 400
    assert sdk.models.list().data  # and the service carries on


@pytest.fixture(scope="module")
def thinking_front(triton_server, template):
    """A second front with DeepSeek's shipped template (thinking) and an API key."""
    with OpenAIProcess(triton_server.grpc_url, port=0, tokenizer=template, chat_template="deepseek_v4",
                       api_key="sesame", log_path=triton_server.workdir / "openai-thinking.log") as front:
        yield front


def test_thinking_template_splits_reasoning_content_and_the_key_is_checked(thinking_front, triton_greedy,
                                                                            template):
    with openai.OpenAI(base_url=thinking_front.base_url, api_key="wrong", max_retries=0) as bad:
        with pytest.raises(openai.AuthenticationError):
            bad.models.list()
    urllib.request.urlopen(f"http://127.0.0.1:{thinking_front.port}/health", timeout=5)  # health stays open
    for header in ({}, {"Authorization": "sesame"}, {"Authorization": "Basic sesame"}):  # no key, no Bearer scheme
        for path, data in (("/v1/models", None), ("/openapi.json", None), ("/tokenize", b"{}")):
            with pytest.raises(urllib.error.HTTPError) as info:
                urllib.request.urlopen(urllib.request.Request(f"http://127.0.0.1:{thinking_front.port}{path}",
                                                              data, headers=header), timeout=5)
            assert info.value.code == 401, (path, header)
    prompt = ChatTemplate.load(template, "deepseek_v4").render(MESSAGES, thinking=True)
    assert prompt.endswith("<｜Assistant｜><think>")
    expected = triton_greedy(prompt, 12).text
    with openai.OpenAI(base_url=thinking_front.base_url, api_key="sesame", max_retries=0) as sdk:
        out = sdk.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=12, temperature=0,
                                          extra_body={"chat_template_kwargs": {"thinking": True}})
        message = out.choices[0].message
        # everything before </think> is reasoning (the tiny model's random text never closes it)
        joined = message.reasoning_content + ("</think>" + message.content if message.content else "")
        assert joined == expected and message.reasoning_content
        chunks = list(sdk.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=12, temperature=0,
                                                  stream=True, extra_body={"chat_template_kwargs": {"thinking": True}}))
        streamed = "".join(getattr(c.choices[0].delta, "reasoning_content", None) or "" for c in chunks)
        assert streamed == message.reasoning_content
        plain = sdk.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4, temperature=0)
        assert plain.choices[0].message.content and getattr(plain.choices[0].message, "reasoning_content",
                                                            None) is None  # </think> closed by the template


def _triton_failures(triton_server) -> float:
    """Requests the model answered with an error: what reached Triton and was refused there."""
    return metric(metrics_text(triton_server.metrics_url), "deepseek:request_failure_total") or 0


def test_the_front_refuses_what_the_model_would_not_take_before_sending_it(sdk, triton_server):
    """Item 6: a field over the engine's cap is a 400 naming it, and Triton never sees the request
    (a 16 MiB body of stop_token_ids used to travel as a 24 MB tensor). One request the engine
    refuses itself is the control: the failure count moves by it alone."""
    failures = _triton_failures(triton_server)
    cases = [({"stop_token_ids": [7] * 1_000_000}, "stop_token_ids"),
             ({"stop": [f"s{i}" for i in range(17)]}, "stop"),
             ({"stop": "x" * 300}, "stop"),
             ({"logit_bias": {str(i): 1.0 for i in range(10_000)}}, "logit_bias"),  # 130 KB of JSON
             ({"structured_outputs": {"json": {"enum": ["y" * 70_000]}}}, "structured_outputs")]
    for extra, param in cases:
        with pytest.raises(openai.BadRequestError) as info:
            sdk.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, extra_body=extra)
        assert info.value.body["param"] == param and param in info.value.body["message"], info.value.body
    with pytest.raises(openai.BadRequestError):
        sdk.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, extra_body={"top_k": -5})
    _wait_metric(triton_server, "deepseek:request_failure_total", lambda v: v >= failures + 1)
    assert _triton_failures(triton_server) == failures + 1


def _send(front: OpenAIProcess, head: bytes, body: bytes) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", front.port), timeout=60)
    s.sendall(head + b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    return s


def _answered(s: socket.socket) -> bool:
    return bool(select.select([s], [], [], 0)[0])


def test_a_large_body_being_parsed_does_not_hold_up_small_requests(openai_server):
    """Item 4: a 14 MiB body takes about a second to parse; while it is parsed, small requests are
    answered, every one before it. Parsed on the event loop, it held them all until its own answer."""
    small = b"GET /v1/models HTTP/1.1\r\nHost: x\r\n"
    big = _send(openai_server, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n",
                b"[" + b'{"a": 1},' * (14 << 17) + b"{}]")
    try:
        time.sleep(0.3)  # the whole body is in: the request is at its parse
        for _ in range(3):
            with _send(openai_server, small, b"") as s:
                assert s.recv(65536).startswith(b"HTTP/1.1 200"), "the small request failed"
            assert not _answered(big), "the large body was answered before a small request sent after it"
        big.settimeout(60)
        assert big.recv(65536).startswith(b"HTTP/1.1 400")  # an array: not a request body
    finally:
        big.close()


@pytest.fixture(scope="module")
def bounded_front(triton_server):
    """A front with two requests in progress at most and 1 MiB of bodies at once."""
    with OpenAIProcess(triton_server.grpc_url, port=0, log_path=triton_server.workdir / "openai-bounded.log",
                       extra_args=("--max-concurrent-requests", "2", "--max-body-bytes-in-flight",
                                   str(1 << 20), "--workers", "1")) as front:  # the bounds are split over workers
        yield front


def _get_models(front: OpenAIProcess) -> http.client.HTTPResponse:
    conn = http.client.HTTPConnection("127.0.0.1", front.port, timeout=30)
    conn.request("GET", "/v1/models")
    response = conn.getresponse()
    response.body = response.read()
    conn.close()
    return response


def _until(check, timeout_s: float = 15):
    deadline = time.monotonic() + timeout_s
    while not (result := check()):
        assert time.monotonic() < deadline, "the front never got there"
        time.sleep(0.05)
    return result


def test_requests_past_the_bound_get_503_with_retry_after(bounded_front):
    """Item 4: two requests in progress (their bodies still coming) fill the front; a third is 503
    with Retry-After at once, the probe still answers; one leaves, and requests are served again."""
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{"
    held = [socket.create_connection(("127.0.0.1", bounded_front.port), timeout=30) for _ in range(2)]
    try:
        for s in held:
            s.sendall(head)
        refused = _until(lambda: (r := _get_models(bounded_front)).status == 503 and r)
        assert refused.getheader("Retry-After") == "1"
        assert json.loads(refused.body)["error"]["code"] == "server_overloaded"
        assert bounded_front.is_ready()  # /health is not bounded: a probe must not read "overloaded" as "dead"
        held.pop().close()
        _until(lambda: _get_models(bounded_front).status == 200)
    finally:
        for s in held:
            s.close()


def test_bodies_past_the_bytes_in_flight_budget_get_503(bounded_front):
    """Item 4: a body still arriving holds its declared 800 KB of the 1 MiB budget; a 300 KB body
    meanwhile is 503 with Retry-After, a small one is served."""
    slow = socket.create_connection(("127.0.0.1", bounded_front.port), timeout=30)
    try:
        slow.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 800000\r\n\r\n{")
        big = json.dumps({"model": MODEL, "prompt": "x" * 300_000, "max_tokens": 1}).encode()
        status, payload = _until(lambda: (r := _raw_post(bounded_front, big))[0] == 503 and r)
        assert "bytes" in payload["error"]["message"] and payload["error"]["code"] == "server_overloaded"
        assert _raw_post(bounded_front, json.dumps({"model": MODEL, "prompt": PROMPT, "max_tokens": 1}).encode())[0] == 200
    finally:
        slow.close()
    assert _until(lambda: _raw_post(bounded_front, big)[0] != 503)
