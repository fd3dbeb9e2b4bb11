"""Checkpoints and drivers shared by the engine tests."""

from __future__ import annotations

import pytest
import torch
from torch.overrides import TorchFunctionMode

from engine.cache import KVCache
from engine.models.deepseek_v4.random_checkpoint import write_checkpoint
from engine.request import SamplingParams
from engine.runner import ModelRunner
from engine.sequence import Sequence

# Three shapes: the tiny preset and two others with a different window, ratios, heads,
# layer mix and index_topk (always below the number of compressed entries the tests reach).
SHAPES = {
    "tiny": None,
    "narrow-window": {"sliding_window": 8, "num_hidden_layers": 4, "compress_ratios": [4, 32, 4, 0],
                      "num_attention_heads": 2, "head_dim": 64, "qk_rope_head_dim": 16, "o_groups": 2,
                      "index_topk": 3, "num_hash_layers": 2, "n_routed_experts": 4},
    "official-ratios": {"sliding_window": 24, "num_hidden_layers": 3, "compress_ratios": [128, 4, 0],
                        "num_attention_heads": 8, "head_dim": 16, "qk_rope_head_dim": 4, "o_groups": 4,
                        "index_topk": 6, "index_head_dim": 8, "num_hash_layers": 0, "n_routed_experts": 6,
                        "num_experts_per_tok": 3},
}


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("ckpt")
    return {name: write_checkpoint(root / name, "tiny", seed=7, override=o) for name, o in SHAPES.items()}


@pytest.fixture(scope="session")
def tiny_dir(checkpoints):
    return checkpoints["tiny"]


# The tiny preset for the fused kernels under the Triton interpreter, where a step costs its kernel
# launches times their grids (rows x heads): each layer kind once (sliding + hash MoE, CSA ratio 4 with its
# indexer, HCA ratio 16) and the MTP layer (the preset's second CSA layer only ran the same kernels again),
# 2 indexer heads, not 8 (the indexer's query heads were most of the rope programs; 2 still weigh and sum
# heads), 3 Sinkhorn iterations, not 20 (a loop in the hc kernel; its count is no code path).
KERNELS_TINY = {"num_hidden_layers": 3, "compress_ratios": [0, 4, 16, 0], "index_n_heads": 2, "hc_sinkhorn_iters": 3}


@pytest.fixture(scope="session")
def kernels_tiny_dir(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("ckpt") / "kernels-tiny", "tiny", seed=7, override=KERNELS_TINY)


def reference_model(path, dtype, dequantize: bool = False):
    """transformers' model on `path`; dequantize=True for FP8 / MXFP4 checkpoints (needs accelerate)."""
    from transformers import DeepseekV4ForCausalLM, FineGrainedFP8Config

    # float32 target: transformers then dequantizes in float32 as the engine does (its bf16 default
    # would round float32-scaled Base weights)
    kw = {"quantization_config": FineGrainedFP8Config(dequantize=True), "dtype": torch.float32} if dequantize else {}
    # eager experts: transformers' grouped_mm path has no float64
    model = DeepseekV4ForCausalLM.from_pretrained(str(path), experts_implementation="eager", **kw).to(dtype).eval()
    for module in model.modules():
        if type(module).__name__ == "DeepseekV4Indexer":
            _ties_to_lower_index(module)
    return model


class _TopkTiesToLowerIndex(TorchFunctionMode):
    """torch.topk with exact ties to the lower index, the engine's rule (kernels.reference.
    topk_by_score_then_index): torch.topk's own tie order changes with the row's length (for the
    oracle, the whole sequence's), and the model defines none. A stable sort keeps the dtype's precision."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not torch.Tensor.topk:
            return func(*args, **kwargs)
        x, k = args[0], kwargs.get("k", args[1] if len(args) > 1 else None)
        dim = kwargs.get("dim", args[2] if len(args) > 2 else -1)
        values, indices = torch.sort(x, dim=dim, descending=True, stable=True)
        return torch.return_types.topk((values.narrow(dim, 0, k), indices.narrow(dim, 0, k)))


def _ties_to_lower_index(indexer) -> None:
    forward = indexer.forward

    def forward_with_tie_rule(*args, **kwargs):
        with _TopkTiesToLowerIndex():
            return forward(*args, **kwargs)
    indexer.forward = forward_with_tie_rule


def incremental_logits(model, ids: list[int], chunks: list[int], block_size: int | None = None) -> torch.Tensor:
    """Run `ids` through the engine's model in prefill chunks then one token per step, as the
    scheduler would; logits of every position [len(ids), vocab]."""
    cfg, dtype = model.cfg, model.embed.weight.dtype
    block_size = block_size or max(16, cfg.compress_block_lcm)
    cache = KVCache(cfg, block_size, 64, 64, 2, dtype)
    runner = ModelRunner(model, cache)
    seq = Sequence("t", list(ids), SamplingParams())
    out, W = [], cfg.sliding_window
    sizes = list(chunks) + [1] * (len(ids) - sum(chunks))
    for n in sizes:
        s = seq.num_computed_tokens
        cache.allocate(seq.blocks, max(0, s - W + 1), s + n)
        out.append(runner.run([(seq, n)], all_logits=True))
        seq.num_computed_tokens = seq.compress_from = s + n
        cache.release_window_below(seq.blocks, s + n - W + 1)
        held = sum(b >= 0 for b in seq.blocks.window_table)
        assert held <= -(-(W - 1 + n) // block_size) + 1, "window blocks must stay bounded by the window"
    return torch.cat(out)


@pytest.fixture
def single_thread():
    """Tiny-model tests whose ops are microseconds of work: on a shared 2-core machine OpenMP's
    thread hand-offs cost 100x that (V4.1's 10-layer oracle: 4 s per decode step vs 0.05 s)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="session")
def v41_golden():
    """transformers' DeepSeek-V4.1 golden outputs (tests/engine/models/deepseek_v41/oracle.py)."""
    from tests.engine.models.deepseek_v41.oracle import load_golden

    return load_golden()
