"""backend/openai without a server: the body limits' depth scan, request validation, the chat
template (against the engine's own tokenizer on the tiny checkpoint), the reasoning split."""

from __future__ import annotations

import argparse
import json

import pytest

from backend.openai.body_limits import check_depth, json_depth
from backend.openai.chat_template import ChatTemplate, ReasoningSplitter, opens_thinking
from backend.openai.errors import OpenAIError, from_triton
from backend.openai.requests import ChatCompletionRequest, CompletionRequest, parse
from engine.args import tiny_checkpoint_dir
from engine.tokenizer import Tokenizer


@pytest.mark.parametrize("text, depth", [
    ('{"a": [1, {"b": []}]}', 4),
    ('{"a": "[[[[{{{{"}', 1),  # brackets in strings are text
    ('{"a": "\\"[[[", "b": [[]]}', 3),  # an escaped quote does not end the string
    ('{"a": "\\\\", "b": [[]]}', 3),  # an escaped backslash does not escape the quote after it
    ("[" * 100_000 + "]" * 100_000, 100_000),
    ("7", 0),
])
def test_json_depth(text, depth):
    assert json_depth(text.encode()) == depth
    if depth:
        assert json_depth(text.encode(), stop_above=0) == 1  # counting stops early


def test_deep_bodies_are_400_before_parsing():
    with pytest.raises(OpenAIError) as info:
        check_depth(b"[" * 300_000, 64)
    assert info.value.status == 400 and info.value.code == "json_too_deep"
    check_depth(json.dumps({"messages": [{"content": [{"type": "text", "text": "x"}]}]}).encode(), 64)


def test_request_validation_names_the_parameter():
    with pytest.raises(OpenAIError, match="tools.0.function: Field required") as info:
        parse(ChatCompletionRequest, {"model": "m", "messages": [{"role": "user", "content": "x"}],
                                      "tools": [{"type": "function"}]})
    assert info.value.param == "tools.0.function"
    with pytest.raises(OpenAIError, match="n: Input should be less than or equal to 16"):
        parse(CompletionRequest, {"model": "m", "prompt": "x", "n": 17})
    with pytest.raises(OpenAIError, match="top_logprobs needs logprobs=true"):
        parse(ChatCompletionRequest, {"model": "m", "messages": [{"role": "user", "content": "x"}],
                                      "top_logprobs": 2}).sampling()
    chat = parse(ChatCompletionRequest, {"model": "m", "messages": [{"role": "user", "content": "x"}],
                                         "max_tokens": 5, "max_completion_tokens": 7, "logprobs": True,
                                         "top_logprobs": 3, "seed": 1, "stop": "\n"})
    assert chat.sampling() == {"max_tokens": 7, "logprobs": 3, "seed": 1, "stop": "\n"}
    with pytest.raises(OpenAIError, match="the request body must be a JSON object"):
        parse(CompletionRequest, [1])


def test_triton_codes_map_to_http_statuses():
    assert from_triton("INVALID_ARG: bad").status == 400
    assert from_triton("UNAVAILABLE: engine overloaded: 1024 waiting").status == 429
    assert from_triton("UNAVAILABLE: engine dead: x").status == 503
    assert from_triton("StatusCode.UNAVAILABLE: failed to connect").status == 503
    assert from_triton("INTERNAL: request failed: boom").status == 500
    # not ready (the model unloaded, a server restarting, a core reloading) or overloaded: retry later
    for message, code in (("Request for unknown model: 'deepseek_v4' is not found", "model_not_ready"),
                          ("UNAVAILABLE: the model is unavailable: the engine is not healthy", "service_unavailable"),
                          ("StatusCode.UNAVAILABLE: failed to connect to all addresses", "service_unavailable"),
                          ("UNAVAILABLE: engine overloaded: 1024 waiting", "rate_limit_exceeded")):
        error = from_triton(message)
        assert (error.code, error.headers) == (code, {"Retry-After": "1"}), message
    assert from_triton("INVALID_ARG: bad").headers == {}


def test_the_checkpoints_template_renders_as_the_engines_tokenizer_does():
    checkpoint = tiny_checkpoint_dir()
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello"}, {"role": "user", "content": [{"type": "text", "text": "Bye"}]}]
    ours = ChatTemplate.load(str(checkpoint)).render(messages)
    plain = [{**m, "content": m["content"] if isinstance(m["content"], str) else "Bye"} for m in messages]
    assert ours == Tokenizer(checkpoint).apply_chat_template(plain, add_generation_prompt=True)
    assert not opens_thinking(ours)
    with pytest.raises(OpenAIError, match="only text content parts"):
        ChatTemplate.load(str(checkpoint)).render([{"role": "user", "content": [{"type": "image_url"}]}])


def test_shipped_deepseek_template_marks_thinking():
    template = ChatTemplate.load(None)  # no checkpoint: DeepSeek's format, shipped
    messages = [{"role": "user", "content": "1+1?"}, {"role": "assistant", "content": "2"},
                {"role": "user", "content": "and 2+2?"}]
    thinking = template.render(messages, thinking=True)
    assert thinking == ("<｜begin▁of▁sentence｜><｜User｜>1+1?<｜Assistant｜></think>2<｜end▁of▁sentence｜>"
                        "<｜User｜>and 2+2?<｜Assistant｜><think>")
    assert opens_thinking(thinking) and not opens_thinking(template.render(messages))
    with pytest.raises(OpenAIError, match="unsupported message role 'function'"):
        template.render([{"role": "function", "content": "x"}])


@pytest.mark.parametrize("pieces", [
    ["reason", "ing</think>", "answer"],
    ["reasoning</", "thi", "nk>ans", "wer"],  # the marker split over three deltas
    ["reasoning", "</think>answer"],
])
def test_reasoning_splitter_across_deltas(pieces):
    splitter = ReasoningSplitter(thinking=True)
    parts = [splitter.feed(p) for p in pieces] + [splitter.flush()]
    assert "".join(r for r, _ in parts) == "reasoning" and "".join(c for _, c in parts) == "answer"


def test_reasoning_splitter_without_an_end_or_thinking():
    splitter = ReasoningSplitter(thinking=True)
    parts = [splitter.feed("all </thi"), splitter.flush()]  # ended inside a possible marker: reasoning
    assert "".join(r for r, _ in parts) == "all </thi" and not any(c for _, c in parts)
    assert ReasoningSplitter(thinking=False).feed("a</think>b") == ("", "a</think>b")


def test_prompt_logprobs_map_as_vllms_and_echo_prepends_the_prompts_tokens():
    from backend.openai.responses import Builder
    from backend.openai.triton import Output

    body = {"model": "m", "prompt": "ab c", "max_tokens": 2, "logprobs": 1, "echo": True}
    assert parse(CompletionRequest, body).sampling() == {"max_tokens": 2, "logprobs": 1, "prompt_logprobs": 1}
    assert parse(CompletionRequest, {**body, "prompt_logprobs": 3}).sampling()["prompt_logprobs"] == 3
    assert "prompt_logprobs" not in parse(CompletionRequest, {**body, "echo": False}).sampling()
    with pytest.raises(OpenAIError, match="not available when stream=true") as info:
        parse(CompletionRequest, {**body, "stream": True, "prompt_logprobs": 2}).sampling()
    assert info.value.param == "prompt_logprobs"
    with pytest.raises(OpenAIError, match="prompt_logprobs"):
        parse(ChatCompletionRequest, {"model": "m", "messages": [{"role": "user", "content": "x"}], "prompt_logprobs": -1})

    def entry(token, logprob, rank):
        return {"logprob": logprob, "rank": rank, "decoded_token": token}

    prompt = [None, {"7": entry("b", -3.0, 9), "4": entry("x", -0.1, 1)}, {"8": entry(" c", float("-inf"), 30),
                                                                          "4": entry("x", -0.2, 1)}]
    out = Output("!", "length", 3, 1, logprobs=[{"5": entry("!", -0.5, 1)}], prompt_logprobs=prompt)
    builder = Builder("completion", "m", 1, echoes=["ab c"])
    body = builder.completion([builder.completion_choice(0, "ab c!", out)])
    lp, choice = body["choices"][0]["logprobs"], body["choices"][0]
    assert lp["tokens"] == ["a", "b", " c", "!"] and lp["text_offset"] == [0, 1, 2, 4]
    assert lp["token_logprobs"] == [None, -3.0, -9999.0, -0.5]
    assert lp["top_logprobs"] == [None, {"x": -0.1}, {"x": -0.2}, {"!": -0.5}]
    assert choice["prompt_logprobs"][2]["8"] == entry(" c", -9999.0, 30) and choice["prompt_logprobs"][0] is None
    plain = Builder("completion", "m", 1).completion_choice(0, "!", out)
    assert plain["logprobs"]["tokens"] == ["!"] and plain["prompt_logprobs"][1] == prompt[1]
    builder = Builder("chat", "m", None)
    chat = builder.chat([builder.chat_choice(0, {"role": "assistant", "content": "!"}, out, "length")], out)
    assert chat["prompt_logprobs"][1] == prompt[1] and chat["choices"][0]["logprobs"] is None


def test_the_fronts_forward_limits_are_the_engines():
    """The front states the engine's caps without importing it (torch): they must stay equal."""
    import ast
    from pathlib import Path

    from backend import protocol
    from backend.openai import forward_limits
    from engine import sampling_checks
    from engine.args import EngineArgs

    assert forward_limits.MAX_SAMPLING_BYTES == protocol.MAX_JSON_BYTES
    assert forward_limits.MAX_STOP_TOKEN_IDS == protocol.MAX_STOP_TOKEN_IDS
    assert forward_limits.MAX_BAD_WORDS == sampling_checks.MAX_BAD_WORDS
    assert forward_limits.MAX_STOP_STRINGS == EngineArgs.max_stop_strings
    assert forward_limits.MAX_STOP_STRING_LEN == EngineArgs.max_stop_string_len
    # backend/model.py imports Triton's stub module, so its constant is read from the source
    tree = ast.parse((Path(protocol.__file__).parent / "model.py").read_text())
    model_value = next(node.value.value for node in tree.body if isinstance(node, ast.Assign)
                       and getattr(node.targets[0], "id", None) == "PROMPT_BYTES_PER_TOKEN")
    assert forward_limits.PROMPT_BYTES_PER_TOKEN == model_value


def test_forward_limits_follow_model_json(tmp_path):
    from backend.openai.forward_limits import ForwardLimits, check_fields, check_forwarded

    path = tmp_path / "model.json"
    path.write_text(json.dumps({"model": "tiny", "max_model_len": 64, "max_stop_strings": 2}))
    limits = ForwardLimits.from_model_json(path)
    assert (limits.max_stop_strings, limits.max_prompt_tokens, limits.max_prompt_bytes) == (2, 64, 64 * 128)
    check_fields({"stop": ["a", "b"], "prompt": [1] * 64}, limits)
    for body, param in (({"stop": ["a", "b", "c"]}, "stop"), ({"prompt": [[1], [2] * 65]}, "prompt")):
        with pytest.raises(OpenAIError) as info:
            check_fields(body, limits)
        assert (info.value.status, info.value.param) == (400, param)
    with pytest.raises(OpenAIError) as info:
        check_forwarded("x" * (64 * 128 + 1), "{}", {}, limits)
    assert info.value.param == "prompt"


def test_readiness_reads_the_longest_running_step_from_tritons_metrics():
    from backend.openai.readiness import step_running_s

    text = ('# TYPE deepseek:engine_step_running_seconds gauge\n'
            'deepseek:engine_step_running_seconds{model="deepseek_v4",version="1"} 0.25\n'
            'deepseek:engine_step_running_seconds{model="other",version="1"} 7.5\n'
            'deepseek:engine_step_running_seconds_total 99\n'
            'deepseek:num_requests_running{model="deepseek_v4",version="1"} 3\n')
    assert step_running_s(text) == 7.5
    assert step_running_s('deepseek:num_requests_running{model="deepseek_v4"} 3\n') is None  # no gauge: the vLLM engine


def test_workers_split_the_fronts_bounds():
    """--workers N: each process serves its share of the whole front's bounds (rounded up)."""
    from backend.openai.__main__ import app_from, parse_args

    args = parse_args(["--triton-grpc", "127.0.0.1:1", "--workers", "3", "--max-concurrent-requests", "10"])
    assert args.workers == 3 and app_from(args).max_concurrent == 4
    assert parse_args(["--triton-grpc", "127.0.0.1:1", "--workers", "auto"]).workers >= 1
    for bad in ("0", "two"):
        with pytest.raises(SystemExit):
            parse_args(["--triton-grpc", "127.0.0.1:1", "--workers", bad])


def test_launcher_passes_openai_workers_and_refuses_a_bad_count():
    """make serve's --openai-workers reaches the front as --workers; a bad count fails at once, before Triton starts."""
    from backend import serve

    ns = lambda **kw: argparse.Namespace(**{"openai_max_concurrent_requests": None,  # noqa: E731
                                             "openai_max_body_bytes_in_flight": None, "openai_workers": None, **kw})
    assert serve.openai_bounds(ns(openai_workers=3)) == ("--workers", "3")
    assert serve.openai_bounds(ns()) == ()
    with pytest.raises(SystemExit):
        serve.main(["--openai-port", "9000", "--openai-workers", "0"])
