"""Tensor-parallel attention and expert-parallel MoE (engine/parallel.py, engine/tp_workers.py) on
CPU processes joined by gloo: world 2 and 4 against world 1, float32.

One scripted run per layout drives both engines through the same schedule: chunked prefill,
decode across the window (16) and compressed-block boundaries (4, 16), a prefix-cache hit with
bounded replay, a preemption and an abort. Every step's logits must agree within LOGIT_TOL (the
all-reduce sums the ranks' partial products in another order than one rank's GEMM: float32
rounding, measured ~3e-6) and the greedy tokens must be identical.
"""

from __future__ import annotations

import pytest
import torch

from engine.args import InvalidEngineArgs
from engine.llm_engine import LLMEngine
from engine.models.deepseek_v4.loader import load_model
from engine.models.deepseek_v4.random_checkpoint import write_checkpoint
from engine.parallel import ParallelConfigError, TensorParallel
from engine.request import GenerationRequest, SamplingParams

LOGIT_TOL = 1e-4  # max |logit difference| vs world 1, float32 (logits are O(1..10))

SHARED = [7 + (j * 37) % 3000 for j in range(36)]  # a prefix longer than the window plus a block
SCRIPT = {  # step -> events; prompts small, a few tokens each
    0: [("add", "a", SHARED + [11, 12, 13, 14, 15, 16, 17, 18], 6), ("add", "d", [900 + j for j in range(18)], 20)],
    3: [("add", "b", SHARED + [21, 22, 23, 24, 25, 26], 3)],  # hits a's two cached blocks: replay [16, 32)
    4: [("abort", "d")],
    5: [("add", "c", [1500 + 3 * j for j in range(30)], 3)],  # no room for everyone: a preemption
}
ARGS = dict(dtype="float32", max_num_batched_tokens=24, max_num_seqs=4, max_model_len=96, block_size=16,
            enable_prefix_caching=True, num_gpu_blocks_override=6)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp")
    return {"tiny": write_checkpoint(root / "tiny", "tiny", seed=3),
            "tiny-16e": write_checkpoint(root / "tiny16", "tiny", seed=4,
                                         override={"n_routed_experts": 16, "num_experts_per_tok": 3})}


def drive(engine: LLMEngine):
    """Run SCRIPT; per step the logits of each sampling request, the tokens, the engine's stats."""
    tokens, steps, step = {}, [], 0
    while step <= max(SCRIPT) or engine.has_unfinished():
        for ev in SCRIPT.get(step, []):
            if ev[0] == "add":
                sp = SamplingParams(max_tokens=ev[3], temperature=0, ignore_eos=True)
                engine.add_request(GenerationRequest(ev[1], prompt_token_ids=list(ev[2]), sampling=sp))
            else:
                engine.abort(ev[1])
        engine.last_logits = {}
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.token_ids)
        steps.append({rid: t.clone() for rid, t in engine.last_logits.items()})
        step += 1
    return tokens, steps, engine.stats()


@pytest.fixture(scope="module")
def world1(ckpts):
    return {name: drive(LLMEngine(dict(ARGS, model=str(path)))) for name, path in ckpts.items()}


@pytest.mark.parametrize("ckpt, world, ep", [("tiny", 2, True), ("tiny", 4, False),
                                             ("tiny-16e", 2, False), ("tiny-16e", 4, True)])
def test_world_n_equals_world_1(ckpts, world1, ckpt, world, ep):
    want_tokens, want_steps, want_stats = world1[ckpt]
    engine = LLMEngine(dict(ARGS, model=str(ckpts[ckpt]), tensor_parallel_size=world, enable_expert_parallel=ep))
    try:
        tokens, steps, stats = drive(engine)
    finally:
        engine.parallel.close()
    # the schedule did what the script is for
    assert want_stats["num_preemptions"] >= 1 and want_stats["prefix_cache_hits"] >= 1
    assert want_stats["prefix_cache_replayed_tokens"] > 0
    assert 0 < len(want_tokens["d"]) < 20  # aborted mid-decode
    assert (stats["num_preemptions"], stats["prefix_cache_hits"]) == (want_stats["num_preemptions"],
                                                                      want_stats["prefix_cache_hits"])
    assert tokens == want_tokens
    assert len(steps) == len(want_steps)
    worst = 0.0
    for got, want in zip(steps, want_steps):
        assert got.keys() == want.keys()
        for rid in want:
            worst = max(worst, (got[rid] - want[rid]).abs().max().item())
    assert worst <= LOGIT_TOL, f"max logit difference {worst:.2e} vs world 1"


def test_each_rank_reads_only_its_slices(ckpts):
    """Rank r's tensors are exactly its slices of the full model's (heads, groups, experts or their
    intermediate slice, the shared expert's slice); the head only on rank 0."""
    path = ckpts["tiny-16e"]
    full = load_model(path, "float32")
    cfg = full.cfg
    for world, ep in ((2, True), (4, False)):
        for rank in range(world):
            part = load_model(path, "float32", tp=TensorParallel(rank, world, ep))
            h, hd = cfg.num_heads // world, cfg.head_dim
            a, fa = part.layers[1].attn, full.layers[1].attn
            assert torch.equal(a.wq_b.weight, fa.wq_b.weight[rank * h * hd:(rank + 1) * h * hd])
            assert torch.equal(a.attn_sink, fa.attn_sink[rank * h:(rank + 1) * h])
            assert torch.equal(a.wkv.weight, fa.wkv.weight)  # the shared latent: replicated
            g = cfg.num_heads // cfg.o_groups  # heads per group
            group = rank * h // g
            cols = fa.wo_b.weight[:, group * cfg.o_lora_rank:(group + 1) * cfg.o_lora_rank]
            if world <= cfg.o_groups:
                cols = fa.wo_b.weight[:, rank * cfg.o_lora_rank * cfg.o_groups // world:
                                      (rank + 1) * cfg.o_lora_rank * cfg.o_groups // world]
            assert torch.equal(a.wo_b.weight, cols)
            m, fm = part.layers[1].ffn, full.layers[1].ffn
            if ep:
                e = cfg.n_routed_experts // world
                assert torch.equal(m.experts_w2, fm.experts_w2[rank * e:(rank + 1) * e])
            else:
                i = cfg.moe_intermediate_size // world
                assert torch.equal(m.experts_w1, fm.experts_w1[:, rank * i:(rank + 1) * i])
                assert torch.equal(m.experts_w2, fm.experts_w2[:, :, rank * i:(rank + 1) * i])
            assert (part.head is not None) == (rank == 0)


def test_quantized_slices_cut_the_scales_with_them(tmp_path):
    """FP8 linears and MXFP4 experts kept as stored: each rank's weight and scale slices equal the
    full model's (whole 128x128 / 1x32 scale blocks)."""
    path = write_checkpoint(tmp_path, "tiny", seed=5, quant="fp8-fp4", override={
        "hidden_size": 128, "num_attention_heads": 2, "head_dim": 128, "qk_rope_head_dim": 64, "q_lora_rank": 128,
        "o_groups": 2, "o_lora_rank": 128, "moe_intermediate_size": 256, "num_hidden_layers": 2,
        "compress_ratios": [0, 4, 0], "num_hash_layers": 1})
    full = load_model(path, "bfloat16", quantized=True)
    for rank in range(2):
        part = load_model(path, "bfloat16", quantized=True, tp=TensorParallel(rank, 2, False))
        a, fa = part.layers[1].attn, full.layers[1].attn
        assert a.wq_b.weight.dtype == torch.float8_e4m3fn
        assert torch.equal(a.wq_b.weight.view(torch.uint8), fa.wq_b.weight.view(torch.uint8)[rank * 128:(rank + 1) * 128])
        assert torch.equal(a.wq_b.scale, fa.wq_b.scale[rank:rank + 1])
        assert torch.equal(a.wo_b.scale, fa.wo_b.scale[:, rank:rank + 1])
        m, fm = part.layers[1].ffn, full.layers[1].ffn
        assert torch.equal(m.experts_w2, fm.experts_w2[:, :, rank * 64:(rank + 1) * 64])  # packed: 2 per byte
        assert torch.equal(m.experts_w2_scale, fm.experts_w2_scale[:, :, rank * 4:(rank + 1) * 4])
        assert torch.equal(m.experts_w1_scale, fm.experts_w1_scale[:, rank * 128:(rank + 1) * 128])


@pytest.mark.parametrize("change, argument", [
    ({"tensor_parallel_size": 3}, "tensor_parallel_size=3"),  # 4 heads
    ({"tensor_parallel_size": 4, "enable_expert_parallel": True, "model": "six-experts"}, "n_routed_experts=6"),
    ({"pipeline_parallel_size": 2}, "pipeline_parallel_size"),
    ({"data_parallel_size": 2}, "data_parallel_size"),
    ({"tensor_parallel_size": 0}, "tensor_parallel_size"),
])
def test_unsupported_layouts_are_refused_at_start_naming_the_argument(ckpts, tmp_path, change, argument):
    model = str(ckpts["tiny"])
    if change.get("model") == "six-experts":
        model = str(write_checkpoint(tmp_path, "tiny", override={"n_routed_experts": 6}))
    with pytest.raises((ParallelConfigError, InvalidEngineArgs), match=argument):
        LLMEngine(dict(dtype="float32", **{**change, "model": model}))
