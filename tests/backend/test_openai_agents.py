"""The OpenAI API for agents, with the official openai SDK against a real tritonserver on the tiny
random-weight model and DeepSeek-V4's shipped template: forced tool calls whose arguments validate
against the tool's schema at temperature 1 (the grammar, not the weights, makes them), a two-turn
agent loop with a tool result, chat.completions.parse(PydanticModel), n choices, batches of
prompts, lenient fields; the Responses API; LangChain and LiteLLM unchanged."""

from __future__ import annotations

import json
import urllib.request
from typing import Literal

import jsonschema
import openai
import pydantic
import pytest

from backend.openai.process import OpenAIProcess, tokenizer_dir
from loadtest.scrape import metric
from tests.conftest import SERVER_ENGINE_ARGS

pytestmark = pytest.mark.slow

MODEL = "deepseek_v4"
SEEDS = range(10)
# bounded fields: a random model inside a string could otherwise write until max_tokens
WEATHER = {"type": "object", "additionalProperties": False, "required": ["city", "unit", "exact"],
           "properties": {"city": {"type": "string", "maxLength": 6}, "unit": {"enum": ["c", "f"]},
                          "exact": {"type": "boolean"}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": {
             "type": "object", "additionalProperties": False, "required": ["zone"],
             "properties": {"zone": {"enum": ["utc", "cet"]}}}}}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}
ASK = [{"role": "user", "content": "Weather in Paris?"}]


class Answer(pydantic.BaseModel):
    ok: bool
    mood: Literal["calm", "busy"]


@pytest.fixture(scope="module")
def agent_server():
    """A server of its own: the template's tools section alone is ~600 tokens of the tiny tokenizer,
    over the session server's max_model_len."""
    from backend.serve import TritonServer

    with TritonServer(engine_args={**SERVER_ENGINE_ARGS, "max_model_len": 2048}, http_port=0, grpc_port=0,
                      metrics_port=0, startup_timeout_s=300) as server:
        model_json = server.workdir / "model_repository" / MODEL / "1" / "model.json"
        with OpenAIProcess(server.grpc_url, port=0, tokenizer=tokenizer_dir(model_json), chat_template="deepseek_v4",
                           triton_metrics=server.metrics_url, log_path=server.workdir / "openai-agents.log") as front:
            yield front


@pytest.fixture(scope="module")
def sdk(agent_server):
    with openai.OpenAI(base_url=agent_server.base_url, api_key="unused", max_retries=0, timeout=300) as client:
        yield client


def _validate(call, name: str = "get_weather") -> dict:
    assert call.type == "function" and call.function.name == name and call.id
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, next(t["function"]["parameters"] for t in TOOLS if t["function"]["name"] == name))
    return arguments


def test_a_named_tool_choice_always_gives_valid_arguments(sdk):
    for seed in SEEDS:
        out = sdk.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=NAMED, temperature=1,
                                          seed=seed, max_tokens=64)
        choice = out.choices[0]
        assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1, choice
        _validate(choice.message.tool_calls[0])
        chunks = list(sdk.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=NAMED,
                                                  temperature=1, seed=seed, max_tokens=64, stream=True))
        deltas = [d for c in chunks for d in (c.choices[0].delta.tool_calls or [])]
        assert [d.index for d in deltas] == [0] and chunks[-1].choices[0].finish_reason == "tool_calls"
        assert _validate(deltas[0]) == json.loads(choice.message.tool_calls[0].function.arguments)


def test_required_picks_tools_from_the_list(sdk):
    for seed in range(3):
        out = sdk.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required",
                                          temperature=1, seed=seed, max_tokens=96, parallel_tool_calls=False)
        calls = out.choices[0].message.tool_calls
        assert len(calls) == 1 and out.choices[0].finish_reason == "tool_calls"
        _validate(calls[0], calls[0].function.name)


def test_a_two_turn_agent_loop_with_a_tool_result(sdk):
    first = sdk.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=NAMED, temperature=1,
                                        seed=3, max_tokens=64)
    call = first.choices[0].message.tool_calls[0]
    history = ASK + [first.choices[0].message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}]
    second = sdk.chat.completions.create(model=MODEL, messages=history, tools=TOOLS, temperature=0, max_tokens=8)
    assert second.choices[0].message.role == "assistant" and second.usage.prompt_tokens > first.usage.prompt_tokens
    # auto: the random model writes text, which comes back as content (no call to parse)
    assert second.choices[0].message.content and not second.choices[0].message.tool_calls
    assert second.choices[0].finish_reason == "length"


def test_parse_returns_a_pydantic_object(sdk):
    for seed in SEEDS:
        out = sdk.chat.completions.parse(model=MODEL, messages=[{"role": "user", "content": "Status?"}],
                                         response_format=Answer, temperature=1, seed=seed, max_tokens=32)
        assert isinstance(out.choices[0].message.parsed, Answer), out.choices[0].message.content
        content = out.choices[0].message.content  # compact: one space after ',' and ':' (xgrammar's), no more
        assert content == json.dumps(json.loads(content), ensure_ascii=False)


def test_json_object_and_vllms_guided_choice(sdk):
    out = sdk.chat.completions.create(model=MODEL, messages=ASK, response_format={"type": "json_object"},
                                      temperature=1, seed=1, max_tokens=48)
    if out.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(out.choices[0].message.content), dict)
    else:  # a random model may keep an object open: what came is still compact JSON's beginning
        assert out.choices[0].message.content.startswith("{")
    chosen = sdk.completions.create(model=MODEL, prompt="Pick:", max_tokens=8, temperature=1,
                                    extra_body={"guided_choice": ["yes", "no"]})
    assert chosen.choices[0].text in ("yes", "no")


def test_n_choices_and_batches_of_prompts(sdk):
    out = sdk.chat.completions.create(model=MODEL, messages=ASK, n=3, temperature=1, seed=5, max_tokens=6)
    assert [c.index for c in out.choices] == [0, 1, 2] and out.usage.completion_tokens == 18
    assert len({c.message.content for c in out.choices}) > 1  # seed + i each: they differ
    chunks = list(sdk.chat.completions.create(model=MODEL, messages=ASK, n=2, temperature=0, max_tokens=4,
                                              stream=True, stream_options={"include_usage": True}))
    texts = {i: "".join(c.choices[0].delta.content or "" for c in chunks if c.choices and c.choices[0].index == i)
             for i in (0, 1)}
    assert texts[0] == texts[1] and chunks[-1].usage.completion_tokens == 8  # greedy: the same twice
    batch = sdk.completions.create(model=MODEL, prompt=["The fox", "A dog"], n=2, max_tokens=3, temperature=0)
    assert [c.index for c in batch.choices] == [0, 1, 2, 3] and batch.choices[0].text == batch.choices[1].text
    single = [sdk.completions.create(model=MODEL, prompt=p, max_tokens=3, temperature=0) for p in ("The fox", "A dog")]
    assert [batch.choices[0].text, batch.choices[2].text] == [s.choices[0].text for s in single]
    assert batch.usage.prompt_tokens == sum(s.usage.prompt_tokens for s in single)
    with pytest.raises(openai.BadRequestError, match="best_of"):
        sdk.completions.create(model=MODEL, prompt="x", max_tokens=2, n=2, best_of=3)


def test_neutral_defaults_and_unknown_fields_are_accepted(sdk):
    out = sdk.chat.completions.create(model=MODEL, messages=ASK, max_tokens=2, tools=[], logit_bias={}, store=False,
                                      metadata={"k": "v"}, response_format={"type": "text"}, reasoning_effort="none",
                                      extra_body={"some_future_field": 1})
    assert out.choices[0].message.content is not None
    with pytest.raises(openai.BadRequestError) as info:
        sdk.chat.completions.create(model=MODEL, messages=ASK, max_tokens=2, tools=TOOLS,
                                    tool_choice={"type": "function", "function": {"name": "nope"}})
    assert info.value.body["param"] == "tool_choice"


def test_tokenize_detokenize_version_and_metrics_on_the_api_port(agent_server):
    def call(path: str, body: dict | None = None):
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(f"http://127.0.0.1:{agent_server.port}{path}", data=data,
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=30) as response:
            text = response.read().decode()
            return json.loads(text) if path != "/metrics" else text

    tokens = call("/tokenize", {"model": MODEL, "prompt": "The fox", "return_token_strs": True})
    assert tokens["count"] == len(tokens["tokens"]) and "".join(tokens["token_strs"][1:]) == "The fox"
    assert call("/detokenize", {"model": MODEL, "tokens": tokens["tokens"][1:]}) == {"prompt": "The fox"}
    chat = call("/tokenize", {"model": MODEL, "messages": ASK})
    assert chat["tokens"][0] == tokens["tokens"][0] and chat["count"] > tokens["count"]  # one BOS, the template's
    assert call("/version")["version"]
    scraped = call("/metrics")  # Triton's, through the API port, under vLLM's names after the requests above
    assert metric(scraped, "vllm:num_requests_running", model_name=MODEL) is not None  # polled: may lag
    assert metric(scraped, "vllm:inter_token_latency_seconds_count", model_name=MODEL) > 0
    assert metric(scraped, "vllm:request_success_total", model_name=MODEL) > 0
    # the engine says when it first scheduled each request: vLLM's phase histograms
    count = {phase: metric(scraped, f"vllm:request_{phase}_time_seconds_count", model_name=MODEL)
             for phase in ("queue", "prefill", "inference", "decode")}
    assert count["queue"] == count["prefill"] == count["inference"] > 0, count
    assert metric(scraped, "vllm:request_inference_time_seconds_sum", model_name=MODEL) >= \
        metric(scraped, "vllm:request_prefill_time_seconds_sum", model_name=MODEL)
    # tokens per engine step, polled from the engine's stats (each step counted once, none beyond the tokens)
    steps = metric(scraped, "vllm:iteration_tokens_total_count", model_name=MODEL)
    assert steps > 0 and metric(scraped, "vllm:iteration_tokens_total_sum", model_name=MODEL) <= \
        metric(scraped, "vllm:prompt_tokens_total", model_name=MODEL) + \
        metric(scraped, "vllm:generation_tokens_total", model_name=MODEL)


RESPONSES_TOOLS = [{"type": "function", **t["function"]} for t in TOOLS]  # the Responses API's flat form


def test_responses_text_is_the_chat_answer_streamed_or_not(sdk):
    chat = sdk.chat.completions.create(model=MODEL, messages=[{"role": "system", "content": "Be brief."}, *ASK],
                                       max_tokens=8, temperature=0)
    out = sdk.responses.create(model=MODEL, input="Weather in Paris?", instructions="Be brief.", max_output_tokens=8,
                               temperature=0)
    assert out.object == "response" and out.id.startswith("resp_") and out.output_text == chat.choices[0].message.content
    assert out.status == "incomplete" and out.incomplete_details.reason == "max_output_tokens"
    assert (out.usage.input_tokens, out.usage.output_tokens) == (chat.usage.prompt_tokens, 8)
    events = list(sdk.responses.create(model=MODEL, input=[{"role": "developer", "content": "Be brief."},
                                                           {"role": "user", "content": [
                                                               {"type": "input_text", "text": "Weather in Paris?"}]}],
                                       max_output_tokens=8, temperature=0, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.incomplete"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert {"response.output_item.added", "response.content_part.added", "response.output_text.done",
            "response.output_item.done"} <= set(kinds)
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == out.output_text
    assert events[-1].response.output_text == out.output_text and events[-1].response.usage.output_tokens == 8


def test_responses_function_calls_and_the_next_turn(sdk):
    for seed in range(3):
        out = sdk.responses.create(model=MODEL, input="Weather in Paris?", tools=RESPONSES_TOOLS, temperature=1,
                                   tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=64,
                                   extra_body={"seed": seed})
        calls = [item for item in out.output if item.type == "function_call"]
        assert out.status == "completed" and len(calls) == 1 and calls[0].name == "get_weather" and calls[0].call_id
        jsonschema.validate(json.loads(calls[0].arguments), WEATHER)
    events = list(sdk.responses.create(model=MODEL, input="Weather in Paris?", tools=RESPONSES_TOOLS, temperature=1,
                                       tool_choice="required", max_output_tokens=96, parallel_tool_calls=False,
                                       stream=True, extra_body={"seed": 1}))
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert len(done) == 1 and events[-1].type == "response.completed"
    assert [i.type for i in events[-1].response.output] == ["function_call"]
    call = events[-1].response.output[0]
    history = [{"role": "user", "content": "Weather in Paris?"},
               {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
               {"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21 C"}]
    second = sdk.responses.create(model=MODEL, input=history, tools=RESPONSES_TOOLS, max_output_tokens=8,
                                  temperature=0)
    assert second.output_text and second.usage.input_tokens > out.usage.input_tokens
    for kwargs, param in (({"previous_response_id": "resp_1"}, "previous_response_id"),
                          ({"tools": [{"type": "web_search"}]}, "tools.0.type"),
                          ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
                           "input.0.content.0")):
        with pytest.raises(openai.BadRequestError) as info:
            sdk.responses.create(**{"model": MODEL, "input": "Hi", "max_output_tokens": 2, **kwargs})
        assert info.value.body["param"] == param


def test_responses_json_schema_and_reasoning(sdk):
    schema = Answer.model_json_schema()
    for seed in range(3):
        out = sdk.responses.create(model=MODEL, input="Status?", temperature=1, max_output_tokens=32,
                                   text={"format": {"type": "json_schema", "name": "answer", "schema": schema,
                                                    "strict": True}}, extra_body={"seed": seed})
        Answer.model_validate_json(out.output_text)
    thinking = sdk.responses.create(model=MODEL, input="Hi", reasoning={"effort": "low"}, max_output_tokens=6,
                                    temperature=0)
    chat = sdk.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                       reasoning_effort="low", max_tokens=6, temperature=0)
    reasoning = [i for i in thinking.output if i.type == "reasoning"]
    assert chat.choices[0].message.reasoning_content and len(reasoning) == 1
    assert "".join(c.text for i in reasoning for c in i.content) == chat.choices[0].message.reasoning_content
    assert thinking.output_text == (chat.choices[0].message.content or "")


def test_langchain_bind_tools_and_with_structured_output(agent_server):
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_openai import ChatOpenAI

    def chat(seed: int, **kwargs) -> ChatOpenAI:
        return ChatOpenAI(model=MODEL, base_url=agent_server.base_url, api_key="unused", temperature=1, seed=seed,
                          max_tokens=64, max_retries=0, timeout=300, **kwargs)

    for seed in SEEDS:
        bound = chat(seed).bind_tools(TOOLS, tool_choice="get_weather")
        message = bound.invoke("Weather in Paris?")
        assert [c["name"] for c in message.tool_calls] == ["get_weather"], message
        jsonschema.validate(message.tool_calls[0]["args"], WEATHER)
        for method in ("json_schema", "function_calling"):
            answer = chat(seed).with_structured_output(Answer, method=method).invoke("Status?")
            assert isinstance(answer, Answer), (method, answer)
    streamed = None
    for chunk in chat(3).bind_tools(TOOLS, tool_choice="get_weather").stream("Weather in Paris?"):
        streamed = chunk if streamed is None else streamed + chunk
    assert [c["name"] for c in streamed.tool_calls] == ["get_weather"]
    jsonschema.validate(streamed.tool_calls[0]["args"], WEATHER)
    history = [HumanMessage("Weather in Paris?"), message,
               ToolMessage("sunny, 21 C", tool_call_id=message.tool_calls[0]["id"])]
    second = chat(0).bind_tools(TOOLS).invoke(history)
    assert second.content and not second.tool_calls


def test_litellm_tools(agent_server, monkeypatch):
    monkeypatch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no download of the price list at import
    import litellm

    kwargs = {"model": f"openai/{MODEL}", "api_base": agent_server.base_url, "api_key": "unused", "max_tokens": 64,
              "temperature": 1, "num_retries": 0, "timeout": 300}
    for seed in SEEDS:
        out = litellm.completion(messages=ASK, tools=TOOLS, tool_choice=NAMED, seed=seed, **kwargs)
        assert out.choices[0].finish_reason == "tool_calls"
        _validate(out.choices[0].message.tool_calls[0])
    chunks = list(litellm.completion(messages=ASK, tools=TOOLS, tool_choice=NAMED, seed=1, stream=True, **kwargs))
    deltas = [d for c in chunks for d in (c.choices[0].delta.tool_calls or [])]
    assert deltas and deltas[0].function.name == "get_weather"
    jsonschema.validate(json.loads("".join(d.function.arguments or "" for d in deltas)), WEATHER)
    call = out.choices[0].message.tool_calls[0]
    history = ASK + [out.choices[0].message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}]
    second = litellm.completion(messages=history, tools=TOOLS, **{**kwargs, "temperature": 0, "max_tokens": 8})
    assert second.choices[0].message.content and second.choices[0].finish_reason == "length"
