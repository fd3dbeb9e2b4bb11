"""The DeepSeek-V4.1 oracle (transformers' own DeepseekV41ForCausalLM, float64 golden files) and
drivers that run the engine's V4.1 model over it the way the scheduler would."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

ORACLE = Path("/work/shared/oracles/deepseek_v41/tiny")
needs_oracle = pytest.mark.skipif(not (ORACLE / "golden.safetensors").exists(),
                                  reason=f"the DeepSeek-V4.1 oracle is not at {ORACLE}")


def load_golden() -> dict:
    from safetensors.torch import load_file

    return load_file(str(ORACLE / "golden.safetensors"))


def greedy(model, ids: list[int], chunk: int, steps: int = 48, decode_batches: tuple[int, ...] = (),
           dtype: torch.dtype = torch.float64) -> tuple[list[int], torch.Tensor]:
    """Prefill in chunks of `chunk` tokens, then decode greedily as the scheduler would; returns
    the tokens and the logits that chose each. decode_batches: decode steps run on the CUDA-graph
    decode path's static batches of these sizes (eagerly, on the CPU). dtype: the cache's (the model's)."""
    from engine.models.deepseek_v41.cache import V41KVCache
    from engine.request import SamplingParams
    from engine.runner import ModelRunner
    from engine.sequence import Sequence

    W = model.cfg.sliding_window
    cache = V41KVCache(model.cfg, 16, 64, 64, 2, dtype)
    runner = ModelRunner(model, cache, max_model_len=512)
    if decode_batches:
        runner.static_decode_batches(list(decode_batches))
    seq = Sequence("t", list(ids), SamplingParams())
    tokens, logits = [], []
    while len(tokens) < steps:
        s = seq.num_computed_tokens
        n = min(chunk, seq.num_tokens - s)
        cache.allocate(seq.blocks, max(0, s - W + 1), s + n)
        out = runner.run([(seq, n)])
        seq.num_computed_tokens = seq.compress_from = s + n
        cache.release_window_below(seq.blocks, s + n - W + 1)
        if seq.num_computed_tokens == seq.num_tokens:
            logits.append(out[-1].double())
            tokens.append(int(out[-1].argmax()))
            seq.output_token_ids.append(tokens[-1])
    assert runner.replays == (steps - 1 if decode_batches else 0)
    return tokens, torch.stack(logits)


def one_shot(model, ids: list[int]) -> torch.Tensor:
    from engine.models.deepseek_v41.cache import V41KVCache
    from engine.request import SamplingParams
    from engine.runner import ModelRunner
    from engine.sequence import Sequence

    cache = V41KVCache(model.cfg, 16, 64, 64, 1, torch.float64)
    seq = Sequence("t", list(ids), SamplingParams())
    cache.allocate(seq.blocks, 0, len(ids))
    return ModelRunner(model, cache).run([(seq, len(ids))], all_logits=True).double()
