"""/v1/completions as eval harnesses use it, against the session's real tritonserver: token-id
prompts (one or a batch) reach the engine as ids, echo with max_tokens=0 returns the scored prompt,
and lm-evaluation-harness's local-completions (its defaults, batch size 4) gets log-likelihoods
equal to the engine's own prompt logprobs for the continuation tokens."""

from __future__ import annotations

import json
import math
import urllib.request

import openai
import pytest

from backend.openai.process import tokenizer_dir

pytestmark = pytest.mark.slow

MODEL = "deepseek_v4"
PROMPT = "The quick brown fox"


@pytest.fixture(scope="module")
def tokenize(openai_server):
    root = openai_server.base_url.removesuffix("/v1")

    def ids(text: str, add_special_tokens: bool = True) -> list[int]:
        return _post(f"{root}/tokenize", {"prompt": text, "add_special_tokens": add_special_tokens})["tokens"]

    return ids


@pytest.fixture(scope="module")
def engine_prompt_logprobs(triton_server):
    """The engine's own per-token prompt logprobs for a token-id prompt, straight from Triton (HTTP
    generate, the input_ids tensor): None first, as vLLM."""

    def logprobs(ids: list[int]) -> list[float | None]:
        out = _post(f"http://{triton_server.http_url}/v2/models/{MODEL}/generate", {
            "input_ids": ids, "sampling_parameters": json.dumps({"max_tokens": 1, "prompt_logprobs": 0})})
        steps = json.loads(out["prompt_logprobs"])
        return [None if s is None else s[str(t)]["logprob"] for s, t in zip(steps, ids)]

    return logprobs


def _post(url: str, body: dict) -> dict:
    request = urllib.request.Request(url, method="POST", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    return json.loads(urllib.request.urlopen(request, timeout=120).read())


def test_token_id_prompts_are_the_text_prompts_ids(sdk, tokenize):
    ids = tokenize(PROMPT)
    by_text = sdk.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0)
    by_ids = sdk.completions.create(model=MODEL, prompt=ids, max_tokens=6, temperature=0)
    assert by_ids.choices[0].text == by_text.choices[0].text
    assert by_ids.usage.prompt_tokens == by_text.usage.prompt_tokens == len(ids)
    # no BOS is added to ids: the same ids without it are one token shorter
    bare = sdk.completions.create(model=MODEL, prompt=ids[1:], max_tokens=1, temperature=0)
    assert bare.usage.prompt_tokens == len(ids) - 1
    batch = sdk.completions.create(model=MODEL, prompt=[ids, tokenize("A dog")], max_tokens=6, temperature=0)
    assert [c.index for c in batch.choices] == [0, 1] and batch.choices[0].text == by_text.choices[0].text
    streamed = "".join(c.choices[0].text for c in sdk.completions.create(
        model=MODEL, prompt=ids, max_tokens=6, temperature=0, stream=True) if c.choices)
    assert streamed == by_text.choices[0].text
    # add_special_tokens=false (vLLM's): a text prompt without the BOS
    no_bos = sdk.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1, extra_body={"add_special_tokens": False})
    assert no_bos.usage.prompt_tokens == len(tokenize(PROMPT, add_special_tokens=False)) == len(ids) - 1
    for prompt in ([[]], [ids, []]):
        with pytest.raises(openai.BadRequestError, match="prompt must not be empty"):
            sdk.completions.create(model=MODEL, prompt=prompt, max_tokens=1)
    with pytest.raises(openai.BadRequestError, match=r"prompt token ids must be in \[0, "):  # the engine's check
        sdk.completions.create(model=MODEL, prompt=[1, 10**8], max_tokens=1)


def test_echo_with_max_tokens_0_returns_the_scored_prompt(sdk, openai_server, tokenize, engine_prompt_logprobs):
    ids = tokenize(PROMPT)
    want = engine_prompt_logprobs(ids)
    # a token-id prompt is echoed as its ids' text, the BOS's included
    ids_text = _post(f"{openai_server.base_url.removesuffix('/v1')}/detokenize", {"tokens": ids})["prompt"]
    assert ids_text.endswith(PROMPT) and ids_text != PROMPT
    for prompt, text in ((PROMPT, PROMPT), (ids, ids_text)):
        out = sdk.completions.create(model=MODEL, prompt=prompt, max_tokens=0, echo=True, logprobs=1, temperature=0)
        choice = out.choices[0]
        assert choice.text == text and choice.finish_reason == "length"
        assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (len(ids), 0)
        assert choice.logprobs.token_logprobs == want and len(choice.logprobs.tokens) == len(ids)
        assert "".join(choice.logprobs.tokens) == text
    plain = sdk.completions.create(model=MODEL, prompt=PROMPT, max_tokens=0, echo=True)
    assert plain.choices[0].text == PROMPT and plain.choices[0].logprobs is None
    chunks = list(sdk.completions.create(model=MODEL, prompt=ids, max_tokens=0, echo=True, logprobs=1, stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == ids_text
    assert [lp for c in chunks if c.choices and c.choices[0].logprobs
            for lp in c.choices[0].logprobs.token_logprobs] == want
    with pytest.raises(openai.BadRequestError) as info:
        sdk.completions.create(model=MODEL, prompt=PROMPT, max_tokens=0)
    assert info.value.body["param"] == "max_tokens" and "only allowed with echo=true" in info.value.body["message"]


def test_lm_eval_local_completions_loglikelihoods_are_the_engines(openai_server, triton_server,
                                                                  engine_prompt_logprobs):
    from lm_eval.api.instance import Instance
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    model_json = triton_server.workdir / "model_repository" / MODEL / "1" / "model.json"
    lm = LocalCompletionsAPI(model=MODEL, base_url=f"{openai_server.base_url}/completions",
                             tokenizer=tokenizer_dir(model_json), batch_size=4, max_retries=1)
    pairs = [("The quick brown fox", " jumps over"), ("A dog", " barks"), ("Paris is the capital of", " France"),
             ("One, two,", " three, four"), ("Hello", " world"), ("The sky is", " blue today")]
    results = lm.loglikelihood([Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(pairs)])
    assert len(results) == len(pairs)
    for (context, continuation), (loglikelihood, _greedy) in zip(pairs, results):
        context_ids, continuation_ids = lm._encode_pair(context, continuation)
        want = engine_prompt_logprobs(context_ids + continuation_ids)[len(context_ids):]
        assert len(want) == len(continuation_ids)
        assert math.isclose(loglikelihood, sum(want), rel_tol=1e-6, abs_tol=1e-6), (context, continuation)
