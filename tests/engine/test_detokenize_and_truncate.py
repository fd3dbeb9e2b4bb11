"""vLLM's detokenize and truncate_prompt_tokens on the tiny model."""

import pytest

from engine.llm import LLM
from engine.request import InvalidRequest, SamplingParams


@pytest.fixture(scope="module")
def llm(tiny_dir):
    return LLM(str(tiny_dir), dtype="float32", max_model_len=256)


def test_detokenize_false_gives_the_same_tokens_and_no_text(llm):
    sp = dict(max_tokens=9, temperature=0, ignore_eos=True)
    text, ids = llm.generate(["Hello there"] * 2, [SamplingParams(**sp), SamplingParams(**sp, detokenize=False)])
    assert ids.token_ids == text.token_ids and text.text and ids.text == ""
    with pytest.raises(InvalidRequest, match="stop strings need detokenize"):
        llm.generate(["Hello"], [SamplingParams(max_tokens=4, detokenize=False, stop=["x"])])


def test_truncate_prompt_tokens_keeps_the_last_k(llm):
    prompt = list(range(5, 45))
    sp = dict(max_tokens=6, temperature=0, ignore_eos=True)
    cut = llm.generate([prompt], [SamplingParams(**sp, truncate_prompt_tokens=11)])[0]
    assert cut.prompt_token_ids == prompt[-11:]
    assert cut.token_ids == llm.generate([prompt[-11:]], [SamplingParams(**sp)])[0].token_ids
    whole = llm.generate([prompt], [SamplingParams(**sp, truncate_prompt_tokens=-1)])[0]
    assert whole.prompt_token_ids == prompt  # -1: as long as max_model_len allows
    long = [5 + i % 1000 for i in range(llm.engine.max_model_len + 50)]
    assert len(llm.generate([long], [SamplingParams(**sp, truncate_prompt_tokens=-1)])[0].prompt_token_ids) \
        == llm.engine.max_model_len - 1
    for bad in (0, -2):
        with pytest.raises(InvalidRequest, match="truncate_prompt_tokens"):
            llm.generate([prompt], [SamplingParams(**sp, truncate_prompt_tokens=bad)])

