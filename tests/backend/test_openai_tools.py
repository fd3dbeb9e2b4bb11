"""DeepSeek-V4's tool calls (DSML) without a server: the parser over single and parallel calls,
calls after reasoning and without </think>, every split of a stream, malformed blocks (content
and a log line, never an exception); the shipped template's tools section and history; the
request fields that drive them (tool_choice, response_format, unknown fields)."""

from __future__ import annotations

import json
import logging

import pytest

from backend.openai.chat_output import ChatOutput, message
from backend.openai.chat_template import ChatTemplate
from backend.openai.errors import OpenAIError
from backend.openai.requests import ChatCompletionRequest, CompletionRequest, parse
from backend.openai.structured import forced_calls
from backend.openai.tool_calls import CALLS_END, CALLS_START, ToolCallParser

D = "｜DSML｜"


def invoke(name: str, **params) -> str:
    body = "".join(f'<{D}parameter name="{k}" string="{"true" if isinstance(v, str) else "false"}">'
                   f'{v if isinstance(v, str) else json.dumps(v)}</{D}parameter>\n' for k, v in params.items())
    return f'<{D}invoke name="{name}">\n{body}</{D}invoke>\n'


def block(*invokes: str) -> str:
    return f"{CALLS_START}\n{''.join(invokes)}{CALLS_END}"


WEATHER = invoke("get_weather", city="Paris", days=3)
TIME = invoke("get_time", zone="Europe/Paris", exact=True, offsets=[1, 2], opts={"a": None})


def run(text: str, thinking: bool = False, pieces: list[str] | None = None, **kwargs) -> tuple[dict, str | None]:
    """The message a choice's text gives, fed whole or in `pieces`, and its finish reason."""
    reader = ChatOutput(thinking, tools=True, **kwargs)
    fed = [reader.feed(p) for p in (pieces if pieces is not None else [text])] + [reader.finish()]
    out = message(fed, thinking)
    for call in out.get("tool_calls", []):
        call.pop("id")
    return out, reader.finish_reason("stop")


def calls(out: dict) -> list[tuple[str, dict]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in out.get("tool_calls", [])]


def test_a_single_call_with_text_before_it():
    out, reason = run("Let me check.\n\n" + block(WEATHER))
    assert calls(out) == [("get_weather", {"city": "Paris", "days": 3})]
    assert out["content"] == "Let me check.\n\n" and reason == "tool_calls"


def test_parallel_calls_keep_their_order_and_json_types():
    out, _ = run(block(WEATHER, TIME))
    assert calls(out) == [("get_weather", {"city": "Paris", "days": 3}),
                          ("get_time", {"zone": "Europe/Paris", "exact": True, "offsets": [1, 2], "opts": {"a": None}})]
    assert out["content"] is None  # nothing but calls: OpenAI's null content
    single, _ = run(block(WEATHER, TIME), parallel=False)
    assert calls(single) == calls(out)[:1]


def test_string_parameters_are_verbatim_and_bare_text_in_a_json_parameter_is_text():
    text = block(f'<{D}invoke name="write">\n<{D}parameter name="body" string="true">a "quote"\nline 2 <b>'
                 f'</{D}parameter>\n<{D}parameter name="mode" string="false">append</{D}parameter>\n</{D}invoke>\n')
    assert calls(run(text)[0]) == [("write", {"body": 'a "quote"\nline 2 <b>', "mode": "append"})]


def test_calls_after_reasoning_and_without_the_closing_think():
    closed, _ = run("I need the weather.</think>Checking." + block(WEATHER), thinking=True)
    assert closed["reasoning_content"] == "I need the weather." and closed["content"] == "Checking."
    assert calls(closed) == [("get_weather", {"city": "Paris", "days": 3})]
    # the model forgot </think>: the block still ends the reasoning and is a call
    unclosed, reason = run("I need the weather.\n\n" + block(WEATHER), thinking=True)
    assert unclosed["reasoning_content"] == "I need the weather.\n\n" and unclosed["content"] is None
    assert calls(unclosed) == calls(closed) and reason == "tool_calls"


def test_text_without_calls_is_content_and_the_reason_stays():
    out, reason = run("Paris is sunny. <｜DSML｜ is not a block, nor is <｜DSML｜tool_call")
    assert out["content"] == "Paris is sunny. <｜DSML｜ is not a block, nor is <｜DSML｜tool_call"
    assert "tool_calls" not in out and reason == "stop"


@pytest.mark.parametrize("text, thinking", [
    ("Let me check.\n\n" + block(WEATHER, TIME) + " done", False),
    ("thinking...</think>ok" + block(WEATHER), True),
    ("no close think " + block(TIME), True),
    ("just text < <｜ <｜DSML｜tool", False),
])
def test_every_split_of_a_stream_gives_the_same_message(text, thinking):
    whole, reason = run(text, thinking)
    for cut in range(1, len(text)):
        assert run(text, thinking, [text[:cut], text[cut:]]) == (whole, reason), cut
    assert run(text, thinking, list(text)) == (whole, reason)  # one character at a time


@pytest.mark.parametrize("text", [
    block(f'<{D}invoke name="x">\n<{D}parameter name="a" string="true">1</{D}parameter>\n'),  # cut off
    f'{CALLS_START}\n<{D}invoke name="x">\nstray text</{D}invoke>\n{CALLS_END}',
    f"{CALLS_START}\nnot an invoke{CALLS_END}",
    f'{CALLS_START}\n<{D}invoke name="">\n</{D}invoke>\n{CALLS_END}',
    f'{CALLS_START}\n<{D}invoke name="x">\n<{D}parameter name="a" string="true">1</{D}parameter>\n',  # no ends
])
def test_a_malformed_block_is_content_with_a_log_line(text, caplog):
    with caplog.at_level(logging.WARNING, logger="backend.openai"):
        out, reason = run("Before. " + text)
    assert "tool_calls" not in out and out["content"] == "Before. " + text and reason == "stop"
    assert "does not parse" in caplog.text


def test_a_good_call_before_a_malformed_one_stands():
    parser = ToolCallParser()
    parsed = [parser.feed(f"{CALLS_START}\n{WEATHER}<{D}invoke oops"), parser.finish()]
    assert [c.name for p in parsed for c in p.calls] == ["get_weather"]
    assert "".join(p.content for p in parsed) == f"\n<{D}invoke oops"  # the text after the good call


def test_forced_calls_read_the_grammars_json():
    named = parse(ChatCompletionRequest, {**BASE, "tools": TOOLS, "tool_choice": NAMED}).tool_choice
    assert [(c.name, c.arguments) for c in forced_calls('{"city":"Oslo"}', named)] == [("get_weather",
                                                                                        '{"city": "Oslo"}')]
    assert [c.name for c in forced_calls('[{"name":"get_time","parameters":{}}]', "required")] == ["get_time"]
    assert forced_calls('{"city": "Os', named) is None  # cut off by max_tokens: content


BASE = {"model": "m", "messages": [{"role": "user", "content": "weather?"}]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}},
         {"type": "function", "function": {"name": "get_time"}}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


def test_the_template_writes_tools_and_a_call_history_the_parser_reads_back():
    history = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "weather?"},
               {"role": "assistant", "content": "Checking.", "tool_calls": [
                   {"id": "c1", "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": [1, 2]}'}}]},
               {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    req = parse(ChatCompletionRequest, {**BASE, "messages": history, "tools": TOOLS})
    prompt = ChatTemplate.load(None, "deepseek_v4").render(req.template_messages(), **req.template_kwargs())
    assert prompt.startswith("<｜begin▁of▁sentence｜>Be brief.\n\n## Tools\n")
    assert json.dumps(TOOLS[0]["function"], ensure_ascii=False) + "\n" in prompt
    assert prompt.endswith("<｜User｜><tool_result>sunny</tool_result><｜Assistant｜></think>")
    answer = prompt.split("<｜Assistant｜></think>")[1].split("<｜end▁of▁sentence｜>")[0]
    out, _ = run(answer)
    assert out["content"] == "Checking.\n\n" and calls(out) == [("get_weather", {"city": "Paris", "days": [1, 2]})]


def test_tool_choice_maps_to_the_prompt_and_the_grammar():
    auto = parse(ChatCompletionRequest, {**BASE, "tools": TOOLS})
    assert "structured_outputs" not in auto.sampling() and len(auto.template_kwargs()["tools"]) == 2
    none = parse(ChatCompletionRequest, {**BASE, "tools": TOOLS, "tool_choice": "none"})
    assert "tools" not in none.template_kwargs() and not none.active_tools()
    named = parse(ChatCompletionRequest, {**BASE, "tools": TOOLS, "tool_choice": NAMED,
                                          "chat_template_kwargs": {"thinking": True}})
    assert named.sampling()["structured_outputs"] == {"json": TOOLS[0]["function"]["parameters"],
                                                      "disable_any_whitespace": True}
    assert named.template_kwargs()["thinking"] is False  # the grammar starts at once
    required = parse(ChatCompletionRequest, {**BASE, "tools": TOOLS, "tool_choice": "required",
                                             "parallel_tool_calls": False}).sampling()["structured_outputs"]
    assert required["json"]["minItems"] == 1 and required["json"]["maxItems"] == 1
    assert len(required["json"]["items"]["anyOf"]) == 2
    for body, param in [({"tool_choice": {"type": "function", "function": {"name": "nope"}}, "tools": TOOLS},
                         "tool_choice"),
                        ({"tool_choice": "required"}, "tool_choice"),
                        ({"tools": TOOLS, "tool_choice": NAMED, "response_format": {"type": "json_object"}},
                         "tool_choice"),
                        ({"tool_choice": "sometimes"}, "tool_choice"),
                        ({"messages": [{"role": "assistant", "tool_calls": [
                            {"id": "1", "type": "function", "function": {"name": "f", "arguments": "{bad"}}]}]},
                         "messages.0.tool_calls.0.function.arguments")]:
        with pytest.raises(OpenAIError) as info:
            request = parse(ChatCompletionRequest, {**BASE, **body})
            request.sampling()
            request.template_messages()
        assert info.value.status == 400 and info.value.param.startswith(param), body


def test_response_format_and_vllms_fields_become_one_compact_constraint():
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}}
    spec = parse(ChatCompletionRequest, {**BASE, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": True}}}).sampling()
    assert spec["structured_outputs"] == {"json": schema, "disable_any_whitespace": True}
    assert parse(ChatCompletionRequest, {**BASE, "response_format": {"type": "json_object"}}).sampling()[
        "structured_outputs"] == {"json": {"type": "object"}, "disable_any_whitespace": True}
    assert "structured_outputs" not in parse(ChatCompletionRequest, {**BASE, "response_format": {"type": "text"}}
                                             ).sampling()
    spaced = {"json": schema, "disable_any_whitespace": False}  # vLLM's option: whitespace allowed
    assert parse(CompletionRequest, {"model": "m", "prompt": "x", "structured_outputs": spaced}
                 ).sampling()["structured_outputs"] == spaced
    assert parse(CompletionRequest, {"model": "m", "prompt": "x", "guided_choice": ["a", "b"]}
                 ).sampling()["structured_outputs"] == {"choice": ["a", "b"], "disable_any_whitespace": True}
    with pytest.raises(OpenAIError, match="use one output constraint") as info:
        parse(CompletionRequest, {"model": "m", "prompt": "x", "guided_regex": "a+", "guided_json": schema}).sampling()
    assert info.value.param == "guided_regex"


def test_neutral_and_unknown_fields_are_accepted_and_unsupported_values_named(caplog):
    neutral = {**BASE, "tools": [], "tool_choice": None, "response_format": {"type": "text"}, "logit_bias": {},
               "metadata": {"k": "v"}, "store": False, "parallel_tool_calls": True, "reasoning_effort": "low",
               "service_tier": "auto", "user": "u"}
    with caplog.at_level(logging.WARNING, logger="backend.openai"):
        assert parse(ChatCompletionRequest, {**neutral, "bogus": 1, "prediction": None}).sampling() == {}
    assert caplog.text.count("ignoring unknown request fields: bogus, prediction") == 1
    assert parse(ChatCompletionRequest, {**BASE, "logit_bias": {"42": -100}}).sampling() == {"logit_bias": {"42": -100}}
    for body, param in [({"best_of": 3, "n": 2}, "best_of"), ({"suffix": "x"}, "suffix"), ({"n": 0}, "n"),
                        ({"max_tokens": 0}, "max_tokens"), ({"prompt": [[1], []]}, "prompt"), ({"prompt": []}, "prompt")]:
        with pytest.raises(OpenAIError) as info:
            request = parse(CompletionRequest, {"model": "m", "prompt": "x", **body})
            request.sampling()
            request.prompts()
        assert info.value.param == param


@pytest.mark.parametrize("effort, thinking, prefix", [("none", False, None), ("low", True, ""),
                                                      ("high", True, "Reasoning Effort: Absolute"),
                                                      ("xhigh", True, "Reasoning Effort: Beyond")])
def test_reasoning_effort_switches_thinking_and_the_effort_prompt(effort, thinking, prefix):
    req = parse(ChatCompletionRequest, {**BASE, "reasoning_effort": effort})
    prompt = ChatTemplate.load(None, "deepseek_v4").render(req.template_messages(), **req.template_kwargs())
    assert prompt.endswith("<think>" if thinking else "</think>")
    body = prompt.removeprefix("<｜begin▁of▁sentence｜>")
    assert body.startswith(prefix) if prefix else body.startswith("<｜User｜>")


def test_completion_prompts_are_texts_or_token_ids_and_max_tokens_0_needs_echo():
    def prompts(prompt):
        return parse(CompletionRequest, {"model": "m", "prompt": prompt}).prompts()

    assert prompts("a") == ["a"] and prompts(["a", "b"]) == ["a", "b"]
    assert prompts([1, 2]) == [[1, 2]] and prompts([[1], [2, 3]]) == [[1], [2, 3]]
    echo = parse(CompletionRequest, {"model": "m", "prompt": "x", "echo": True, "max_tokens": 0, "logprobs": 2})
    assert echo.prompt_only and echo.sampling() == {"max_tokens": 1, "logprobs": 2, "prompt_logprobs": 2}
    assert not parse(CompletionRequest, {"model": "m", "prompt": "x", "echo": True, "max_tokens": 1}).prompt_only


def test_a_responses_request_is_the_chat_request_it_stands_for():
    from backend.openai.responses_api import ResponsesRequest

    req = parse(ResponsesRequest, {
        "model": "m", "instructions": "Be brief.", "max_output_tokens": 9, "reasoning": {"effort": "high"},
        "input": [{"role": "user", "content": [{"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}]},
                  {"type": "reasoning", "id": "rs_1", "summary": []},
                  {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
                  {"type": "function_call", "call_id": "c2", "name": "g", "arguments": "{\"x\": 1}"},
                  {"type": "function_call_output", "call_id": "c1", "output": "one"}],
        "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}}],
        "tool_choice": {"type": "function", "name": "f"}, "seed": 3,
        "text": {"format": {"type": "json_schema", "name": "n", "schema": {"type": "object"}}}})
    body = req.chat_body()
    assert body["messages"] == [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "ab"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}},
            {"id": "c2", "type": "function", "function": {"name": "g", "arguments": "{\"x\": 1}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "one"}]
    assert body["tools"] == [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    assert body["tool_choice"] == {"type": "function", "function": {"name": "f"}}
    assert (body["max_tokens"], body["reasoning_effort"], body["seed"]) == (9, "high", 3)
    assert body["response_format"] == {"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "object"}}}
    chat = parse(ChatCompletionRequest, body)
    assert chat.output_limit() == 9 and chat.forced_tools()
    with pytest.raises(OpenAIError) as info:
        parse(ResponsesRequest, {"model": "m", "input": [{"type": "item_reference", "id": "x"}]}).chat_body()
    assert info.value.param == "input.0.type"
