"""backend/protocol.py without Triton: tensors and parameters in, GenerationRequest out, and back."""

import json

import numpy as np
import pytest

from backend.protocol import (
    OutputState,
    parse_request,
    parse_sampling,
    render_delta,
    render_final,
)
from engine.request import InvalidRequest, RequestOutput


def text(value) -> np.ndarray:
    return np.array([value.encode() if isinstance(value, str) else value], dtype=np.object_)


def flag(value: bool) -> np.ndarray:
    return np.array([value], dtype=bool)


def parse(prompt="Hello", parameters=None, **inputs):
    tensors = {"text_input": text(prompt)} if prompt is not None else {}
    for name, value in inputs.items():
        if name == "sampling_parameters":
            tensors[name] = text(value if isinstance(value, str) else json.dumps(value))
        else:
            tensors[name] = flag(value)
    return parse_request(tensors, parameters, "r1")


def test_defaults_follow_vllm_backend():
    p = parse()
    assert p.request.prompt == "Hello" and p.request.request_id == "r1"
    assert not p.stream and not p.exclude_input_in_output  # non-streaming echoes the prompt
    assert p.returns == frozenset()
    assert parse(stream=True).exclude_input_in_output  # streaming never does


def test_genai_perf_payload_with_string_values():
    p = parse(stream=True, exclude_input_in_output=True,
              sampling_parameters={"max_tokens": "16", "temperature": "0.5", "top_p": "0.9", "top_k": "-1",
                                   "ignore_eos": "true", "seed": "7"})
    sp = p.request.sampling
    assert (sp.max_tokens, sp.temperature, sp.top_p, sp.top_k, sp.ignore_eos, sp.seed) == (16, 0.5, 0.9, 0, True, 7)
    assert p.stream and p.exclude_input_in_output


def test_request_parameters_carry_flags_and_sampling():
    params = json.dumps({"stream": False, "max_tokens": 8, "temperature": 0, "return_finish_reason": True,
                         "exclude_input_in_output": "true", "triton_enable_empty_final_response": True,
                         "binary_data_output": False})
    p = parse(parameters=params)
    assert p.request.sampling.max_tokens == 8 and p.request.sampling.greedy
    assert p.exclude_input_in_output and p.returns == {"return_finish_reason"}


def test_tensors_win_over_request_parameters():
    p = parse(parameters={"max_tokens": 8, "stream": True}, stream=False, sampling_parameters={"max_tokens": 4})
    assert p.request.sampling.max_tokens == 4 and not p.stream


def test_stop_and_lists():
    sp = parse_sampling({"stop": "###", "stop_token_ids": "[1, 2]"})
    assert sp.stop == ["###"] and sp.stop_token_ids == [1, 2]
    assert parse_sampling({"stop": ["a", "b"]}).stop == ["a", "b"]


def test_neutral_vllm_keys_are_accepted_at_their_neutral_value():
    sp = parse_sampling({"n": 1, "presence_penalty": "0", "frequency_penalty": 0.0, "best_of": None})
    assert sp.max_tokens == 16
    with pytest.raises(InvalidRequest, match="'n' is not supported"):
        parse_sampling({"n": 2})


def test_logprob_outputs_turn_on_sampled_token_logprobs():
    assert parse(return_logprobs=True).request.sampling.logprobs == 0
    assert parse(return_cumulative_logprob=True).request.sampling.logprobs == 0
    assert parse().request.sampling.logprobs is None
    assert parse_sampling({"logprobs": False}).logprobs is None
    assert parse_sampling({"logprobs": "3"}).logprobs == 3


@pytest.mark.parametrize("kwargs, message", [
    (dict(prompt=None), "missing required input 'text_input'"),
    (dict(prompt=""), "text_input is empty"),
    (dict(prompt=b"\xff\xfe"), "text_input is not valid UTF-8"),
    (dict(sampling_parameters="{not json"), "sampling_parameters is not valid JSON"),
    (dict(sampling_parameters="[1, 2]"), "sampling_parameters must be a JSON object"),
    # the model's own transport cap (the OpenAI front refuses before it sends): no 24 MB parse in the stub
    (dict(sampling_parameters=json.dumps({"stop_token_ids": [7] * 40_000})), "sampling_parameters is 120020 bytes; at most 65536"),
    (dict(sampling_parameters={"bogus": 1}), "unknown sampling parameter 'bogus'"),
    (dict(sampling_parameters={"max_tokens": "many"}), "max_tokens must be an integer, got 'many'"),
    (dict(sampling_parameters={"max_tokens": 2.5}), "max_tokens must be an integer"),
    (dict(sampling_parameters={"max_tokens": True}), "max_tokens must be an integer"),
    (dict(sampling_parameters={"temperature": "hot"}), "temperature must be a number"),
    (dict(sampling_parameters={"temperature": "nan"}), "temperature must be finite"),
    (dict(sampling_parameters={"stop": 5}), "stop must be a non-empty string"),
    (dict(sampling_parameters={"stop_token_ids": "x"}), "stop_token_ids must be a list of integers"),
    (dict(sampling_parameters={"ignore_eos": "maybe"}), "ignore_eos must be a boolean"),
    (dict(stream=True, exclude_input_in_output=False), "exclude_input_in_output=false is not allowed with stream"),
    (dict(parameters="{oops"), "request parameters are not valid JSON"),
    (dict(parameters={"stream": "yes please"}), "stream must be a boolean"),
    (dict(parameters={"unknown_knob": 1}), "unknown sampling parameter 'unknown_knob'"),
])
def test_bad_inputs_name_the_problem(kwargs, message):
    with pytest.raises(InvalidRequest, match=message):
        parse(**kwargs)


def test_text_input_must_be_one_element():
    with pytest.raises(InvalidRequest, match="text_input must hold exactly one element"):
        parse_request({"text_input": np.array([b"a", b"b"], dtype=np.object_)}, None, "r")


def deltas():
    return [
        RequestOutput("r", text="Hi", token_ids=[5], num_prompt_tokens=3, num_output_tokens=1,
                      cumulative_logprob=-0.5, logprobs=[{5: -0.5}]),
        RequestOutput("r", text=" there", token_ids=[6, 7], num_prompt_tokens=3, num_output_tokens=3,
                      cumulative_logprob=-1.25, logprobs=[{6: -0.25}, {7: -0.5}], finished=True,
                      finish_reason="length"),
    ]


ALL = frozenset({"return_finish_reason", "return_num_input_tokens", "return_num_output_tokens",
                 "return_cumulative_logprob", "return_logprobs"})


def test_stream_rendering_sends_new_text_and_cumulative_counters():
    state = OutputState("Prompt", exclude_input_in_output=True, returns=ALL)
    first, last = (render_delta(state, d) for d in deltas())
    assert first["text_output"][0] == b"Hi" and last["text_output"][0] == b" there"
    assert first["finish_reason"][0] == b"None" and last["finish_reason"][0] == b"length"  # as vllm_backend
    assert last["num_input_tokens"].dtype == np.uint32 and last["num_input_tokens"][0] == 3
    assert list(first["num_output_tokens"]) == [1] and list(last["num_output_tokens"]) == [2]
    assert last["cumulative_logprob"].dtype == np.float32 and last["cumulative_logprob"][0] == -1.25
    assert json.loads(last["logprobs"][0]) == [{"6": {"logprob": -0.25, "rank": 1, "decoded_token": None}},
                                               {"7": {"logprob": -0.5, "rank": 1, "decoded_token": None}}]


def test_final_rendering_accumulates_and_prepends_the_prompt():
    state = OutputState("Prompt", exclude_input_in_output=False, returns=ALL)
    for d in deltas():
        state.accumulate(d)
    out = render_final(state, deltas()[-1])
    assert out["text_output"][0] == b"PromptHi there"
    assert list(out["num_output_tokens"]) == [3]
    assert len(json.loads(out["logprobs"][0])) == 3


def test_only_requested_outputs_are_rendered():
    state = OutputState("p", exclude_input_in_output=True, returns=frozenset())
    assert set(render_delta(state, deltas()[0])) == {"text_output"}
    state = OutputState("p", exclude_input_in_output=True, returns=frozenset({"return_logprobs"}))
    assert render_delta(state, RequestOutput("r", text="x", token_ids=[1]))["logprobs"][0] == b"null"


def test_generate_id_is_a_request_parameter_echoed_in_every_response():
    p = parse(parameters=json.dumps({"id": "42", "max_tokens": 4, "sequence_id": 0, "priority": 0,
                                     "triton_enable_empty_final_response": True}))
    assert p.id == "42" and p.request.sampling.max_tokens == 4  # neither id nor Triton's own parameters are sampling keys
    state = OutputState("p", exclude_input_in_output=True, returns=frozenset(), id=p.id)
    first, last = (render_delta(state, d) for d in deltas())
    assert first["id"][0] == b"42" and last["id"][0] == b"42"
    assert "id" not in render_delta(OutputState("p", True, frozenset()), deltas()[0])
    with pytest.raises(InvalidRequest, match="id must be a string"):
        parse(parameters=json.dumps({"id": [1]}))


def test_logprobs_carry_rank_and_decoded_token_like_vllm_backend():
    # top-2 plus a sampled token outside them: ranks 1, 2 exact, the sampled one's is the bound n + 1;
    # the sampled token comes first (vLLM's order), then the rest by rank
    step = {5: -0.1, 9: -2.0, 3: -4.5}
    state = OutputState("p", True, frozenset({"return_logprobs"}), decode_token=lambda t: f"<{t}>")
    out = render_delta(state, RequestOutput("r", text="x", token_ids=[3], logprobs=[step]))
    entries = json.loads(out["logprobs"][0])
    assert entries == [{"3": {"logprob": -4.5, "rank": 3, "decoded_token": "<3>"},
                        "5": {"logprob": -0.1, "rank": 1, "decoded_token": "<5>"},
                        "9": {"logprob": -2.0, "rank": 2, "decoded_token": "<9>"}}]
    assert list(entries[0]) == ["3", "5", "9"]
    final = OutputState("p", True, frozenset({"return_logprobs"}))
    final.accumulate(RequestOutput("r", text="x", token_ids=[9], logprobs=[step]))
    assert list(json.loads(render_final(final, RequestOutput("r", finished=True))["logprobs"][0])[0]) == ["9", "5", "3"]


def test_penalties_bias_bad_words_and_allowed_ids_parse_with_vllm_names():
    sp = parse_sampling({"presence_penalty": "0.5", "frequency_penalty": -1, "repetition_penalty": 1.2,
                         "logit_bias": '{"5": 2, "7": "-100.5"}', "bad_words": "foo", "allowed_token_ids": "[1, 2, 3]"})
    assert (sp.presence_penalty, sp.frequency_penalty, sp.repetition_penalty) == (0.5, -1.0, 1.2)
    assert sp.logit_bias == {"5": 2.0, "7": -100.5} and sp.bad_words == ["foo"] and sp.allowed_token_ids == [1, 2, 3]
    assert parse_sampling({"allowed_token_ids": list(range(5000))}).allowed_token_ids[-1] == 4999
    for bad, message in [({"logit_bias": {"x": 1}}, "logit_bias keys"), ({"logit_bias": [1]}, "logit_bias must be"),
                         ({"logit_bias": {"1": "inf"}}, "finite"), ({"bad_words": [""]}, "bad_words"),
                         ({"allowed_token_ids": "a"}, "allowed_token_ids")]:
        with pytest.raises(InvalidRequest, match=message):
            parse_sampling(bad)


def test_structured_outputs_and_guided_keys_parse_and_bad_shapes_are_refused():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    assert parse_sampling({"structured_outputs": {"json": schema}}).structured_outputs == {"json": schema}
    assert parse_sampling({"structured_outputs": '{"regex": "a+"}'}).structured_outputs == {"regex": "a+"}
    assert parse_sampling({"guided_json": schema}).structured_outputs == {"json": schema}
    assert parse_sampling({"guided_choice": '["x", "y"]'}).structured_outputs == {"choice": ["x", "y"]}
    assert parse_sampling({"guided_regex": "b", "guided_decoding_backend": "xgrammar"}).structured_outputs == {"regex": "b"}
    for bad, message in [({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "exactly one of"),
                         ({"structured_outputs": {"json": "{oops"}}, "structured_outputs.json is not valid JSON"),
                         ({"structured_outputs": {"foo": 1}}, "unknown key"),
                         ({"guided_json": schema, "guided_regex": "a"}, "use one structured-output constraint"),
                         ({"guided_decoding_backend": "outlines", "guided_regex": "a"}, "guided_decoding_backend")]:
        with pytest.raises(InvalidRequest, match=message):
            parse_sampling(bad)


def test_detokenize_false_renders_output_token_ids():
    p = parse(sampling_parameters=json.dumps({"detokenize": "false", "truncate_prompt_tokens": 5,
                                              "spaces_between_special_tokens": False}))
    sp = p.request.sampling
    assert (sp.detokenize, sp.truncate_prompt_tokens, sp.spaces_between_special_tokens) == (False, 5, False)
    state = OutputState("p", exclude_input_in_output=True, returns=p.returns)
    out = render_delta(state, RequestOutput("r", text="made by a front that detokenizes anyway", token_ids=[7, 8]))
    assert out["output_token_ids"].dtype == np.int32 and list(out["output_token_ids"]) == [7, 8]
    assert out["text_output"][0] == b""
    assert "output_token_ids" not in render_delta(OutputState("p", True, parse().returns), deltas()[0])


def test_logprobs_take_the_engines_rank_for_the_sampled_token():
    step = {5: -0.1, 9: -2.0, 3: -4.5}  # top-2 plus the sampled 3, which the engine ranks 40th
    state = OutputState("p", True, frozenset({"return_logprobs"}))
    out = render_delta(state, RequestOutput("r", text="x", token_ids=[3], logprobs=[step], logprob_ranks=[40]))
    ranks = {t: e["rank"] for t, e in json.loads(out["logprobs"][0])[0].items()}
    assert ranks == {"3": 40, "5": 1, "9": 2}
    state = OutputState("p", True, frozenset({"return_logprobs"}))
    for delta in (RequestOutput("r", token_ids=[3], logprobs=[step], logprob_ranks=[40]),
                  RequestOutput("r", token_ids=[5], logprobs=[step], logprob_ranks=[1], finished=True)):
        state.accumulate(delta)
    final = json.loads(render_final(state, delta)["logprobs"][0])
    assert [final[0]["3"]["rank"], final[1]["5"]["rank"]] == [40, 1]


def test_prompt_logprobs_parse_and_render_once_in_vllms_shape():
    p = parse(sampling_parameters={"prompt_logprobs": "2"})
    assert p.request.sampling.prompt_logprobs == 2 and "prompt_logprobs" in p.returns
    for bad in (True, "x"):  # the range is the engine's check (tests/engine/test_sampling_checks.py)
        with pytest.raises(InvalidRequest, match="prompt_logprobs"):
            parse(sampling_parameters={"prompt_logprobs": bad})
    # the prompt token first, with the engine's rank (30); the top-2 ranked among themselves
    prompt = [None, {7: -5.0, 4: -0.5, 9: -1.5}, {4: -0.2, 9: -2.5}]
    first = RequestOutput("r", text="a", token_ids=[1], prompt_logprobs=prompt, prompt_logprob_ranks=[None, 30, 1])
    state = OutputState("p", True, p.returns, decode_token=lambda t: f"<{t}>")
    entries = json.loads(render_delta(state, first)["prompt_logprobs"][0])
    assert entries == [None, {"7": {"logprob": -5.0, "rank": 30, "decoded_token": "<7>"},
                              "4": {"logprob": -0.5, "rank": 1, "decoded_token": "<4>"},
                              "9": {"logprob": -1.5, "rank": 2, "decoded_token": "<9>"}},
                       {"4": {"logprob": -0.2, "rank": 1, "decoded_token": "<4>"},
                        "9": {"logprob": -2.5, "rank": 2, "decoded_token": "<9>"}}]
    assert list(entries[1]) == ["7", "4", "9"]
    assert "prompt_logprobs" not in render_delta(state, RequestOutput("r", text="b", token_ids=[2]))
    final = OutputState("p", True, p.returns)
    for delta in (first, RequestOutput("r", text="b", token_ids=[2], finished=True)):
        final.accumulate(delta)
    assert json.loads(render_final(final, delta)["prompt_logprobs"][0])[1]["7"]["rank"] == 30
    assert "prompt_logprobs" not in render_final(OutputState("p", True, parse().returns), delta)


def test_input_ids_reach_the_engine_as_ids():
    ids = np.array([0, 17, 42], dtype=np.int32)
    p = parse_request({"input_ids": ids, "sampling_parameters": text('{"max_tokens": 2}')}, None, "r")
    assert p.request.prompt is None and p.request.prompt_token_ids == [0, 17, 42]
    assert p.exclude_input_in_output  # no text to echo, so none is, streaming or not
    state, last = OutputState(None, p.exclude_input_in_output, p.returns), RequestOutput(
        "r", text="x", token_ids=[7], finished=True, finish_reason="length")
    state.accumulate(last)
    rendered = render_final(state, last)
    assert rendered["text_output"][0] == b"x"


@pytest.mark.parametrize("inputs, message", [
    ({"input_ids": np.array([], dtype=np.int32)}, "input_ids must be a non-empty 1-D list"),
    ({"input_ids": np.array([[1, 2]], dtype=np.int32)}, "input_ids must be a non-empty 1-D list"),
    ({"input_ids": np.array([1.5], dtype=np.float32)}, "input_ids must be integers"),
    ({"input_ids": np.array([1], dtype=np.int32), "text_input": text("Hi")}, "give the prompt once"),
    ({"input_ids": np.array([1], dtype=np.int32), "exclude_input_in_output": flag(False)},
     "exclude_input_in_output=false needs text_input"),
])
def test_bad_input_ids_name_the_problem(inputs, message):
    with pytest.raises(InvalidRequest, match=message):
        parse_request(inputs, None, "r")


def test_logit_bias_keys_are_ascii_token_ids():
    assert parse_sampling({"logit_bias": {" 12 ": 1, "-3": 2}}).logit_bias == {"12": 1.0, "-3": 2.0}
    for key in ("²", "١٢", "1.5", "", "0x10"):  # isdigit() / int() would take or crash on some of these
        with pytest.raises(InvalidRequest, match="logit_bias keys must be token ids"):
            parse_sampling({"logit_bias": {key: 1}})


def test_masked_tokens_logprobs_render_as_strict_json():
    """A token a grammar or a ban masked has logprob -inf: rendered as vLLM's -9999.0, never -Infinity."""
    state = OutputState("p", True, frozenset({"return_logprobs"}))
    state.accumulate(RequestOutput("r", text="x", token_ids=[9], logprobs=[{9: 0.0, 5: float("-inf")}]))
    text = render_final(state, RequestOutput("r", finished=True))["logprobs"][0]

    def refuse(constant):
        raise ValueError(f"not JSON: {constant}")

    entry = json.loads(text, parse_constant=refuse)[0]
    assert entry["5"]["logprob"] == -9999.0 and entry["9"]["logprob"] == 0.0
