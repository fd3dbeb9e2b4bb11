"""client/types.py and client/chat.py: what both clients return, without a server."""

import json

from client.chat import chat_prompt
from client.types import Delta, Result, delta_from_outputs, sampling_json


def test_join_sums_token_counts_and_keeps_the_last_reason():
    deltas = [Delta("Hel", num_output_tokens=1, num_input_tokens=4, time_s=0.1),
              Delta("", time_s=0.15),
              Delta("lo", num_output_tokens=2, num_input_tokens=4, finish_reason="stop", cumulative_logprob=-1.0,
                    logprobs=[{"1": {"logprob": -1.0}}], time_s=0.3)]
    result = Result.join(deltas)
    assert (result.text, result.num_output_tokens, result.num_input_tokens) == ("Hello", 3, 4)
    assert result.finish_reason == "stop" and result.cumulative_logprob == -1.0
    assert result.ttft_s == 0.1 and result.e2e_s == 0.3 and len(result.logprobs) == 1


def test_delta_from_http_and_grpc_shaped_outputs():
    d = delta_from_outputs({"text_output": "x", "num_output_tokens": [2], "finish_reason": "",
                            "logprobs": "null"}, 0.5)
    assert (d.text, d.num_output_tokens, d.finish_reason, d.logprobs) == ("x", 2, None, None)
    d = delta_from_outputs({"text_output": "y", "logprobs": json.dumps([{"7": {"logprob": -0.1}}])}, 0.0)
    assert d.logprobs == [{"7": {"logprob": -0.1}}]


def test_sampling_json_leaves_out_unset_values():
    assert json.loads(sampling_json(8, None, top_p=0.5, seed=None)) == {"max_tokens": 8, "top_p": 0.5}


def test_chat_prompt_is_deepseeks_single_turn_format():
    assert chat_prompt("Hi") == "<｜User｜>Hi<｜Assistant｜>"
    assert chat_prompt("Hi", system="Be brief.") == "Be brief.<｜User｜>Hi<｜Assistant｜>"
