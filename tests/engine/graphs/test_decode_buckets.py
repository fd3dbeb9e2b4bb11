"""The decode graphs' batch sizes (engine/runner.decode_buckets): every decode batch the scheduler can form has one."""

import pytest

from engine.llm import LLM
from engine.request import SamplingParams
from engine.runner import GRAPH_BUCKETS, decode_buckets


@pytest.mark.parametrize("max_num_seqs", [1, 5, 64, 150, 256, 300, 600])
def test_the_buckets_end_at_max_num_seqs(max_num_seqs):
    sizes = decode_buckets(max_num_seqs)
    assert sizes[-1] == max_num_seqs and sizes == sorted(set(sizes))
    assert set(sizes[:-1]) == {b for b in GRAPH_BUCKETS if b < max_num_seqs}


def test_a_full_batch_off_the_buckets_replays_a_decode_graph(tiny_dir):
    """max_num_seqs 5 is no bucket (4 and 8 are): a decode step of all five sequences replays the graph of 5 (before,
    the largest was 4, so such steps ran eagerly, or with mixed graphs as a step padded to 16 tokens) and gives the
    eager engine's tokens. Static decode batches run on the CPU exactly what a replay reads."""
    prompts = [[5 + 7 * i + j for j in range(6 + i)] for i in range(5)]
    sp = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    args = dict(dtype="float64", max_model_len=64, max_num_seqs=5)
    want = [o.token_ids for o in LLM(str(tiny_dir), **args).generate(prompts, sp)]
    llm = LLM(str(tiny_dir), **args)
    runner = llm.engine.runner
    runner.static_decode_batches(decode_buckets(5))
    got = [o.token_ids for o in llm.generate(prompts, sp)]
    assert got == want
    assert max(runner.graphs) == 5
    assert runner.replays == sp.max_tokens - 1 and runner.eager_steps == 1  # one prefill, then five full decodes
