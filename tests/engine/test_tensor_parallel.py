"""Tensor-parallel attention and expert-parallel MoE (engine/parallel.py, engine/tp_workers.py) on
CPU processes joined by gloo: world 2 and 4 against world 1, float32, for DeepSeek-V4 and V4.1
(the shared V4.1 oracle checkpoint and a V4.1 tiny preset with more heads and experts).

One scripted run per layout drives both engines through the same schedule: chunked prefill,
decode across the window (16) and compressed-block boundaries (4, 16), a prefix-cache hit with
bounded replay, a preemption and an abort; on V4.1 the 24-token prefill chunks exceed the window,
so decoder trim cuts them, and the Engram tables are split by rows. Every step's logits must agree
within LOGIT_TOL (the all-reduce sums the ranks' partial products in another order than one rank's
GEMM: float32 rounding, measured ~3e-6) and the greedy tokens must be identical.

V4.1's QAT fake-quantisers (window KV in FP8, compressed KV and indexer keys in FP4) round to a
grid, and float32 reordering noise (~1e-6) now and then lands a value on the other side of a grid
point, one quantisation step away (measured: 9e-2 on one step of the oracle script at world 2).
So the oracle checkpoint (whose widths are quantised) runs in float64, where only the routed
experts' float32 arithmetic (the reference's) reorders (measured ~5e-6), and the wider preset runs
in float32 with head widths the quantisers pass through unchanged (not a multiple of their blocks).
"""

from __future__ import annotations

import pytest
import torch

from engine.args import InvalidEngineArgs
from engine.llm_engine import LLMEngine
from engine.models.deepseek_v4.loader import load_model
from engine.models.deepseek_v4.random_checkpoint import write_checkpoint
from engine.models.deepseek_v41.random_checkpoint import write_v41_checkpoint
from engine.models.weights import WeightsError
from engine.parallel import CollectiveFailed, ParallelConfigError, TensorParallel
from engine.recovery import is_fatal
from engine.request import GenerationRequest, SamplingParams
from tests.engine.models.deepseek_v41.oracle import ORACLE

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


# more heads and experts (world 4 cuts each of the 2 output groups in two); head widths off the
# fake-quantisers' blocks (16, 32), so float32 compares to the reordering noise
V41_WIDER = {"n_routed_experts": 16, "num_experts_per_tok": 3, "num_attention_heads": 8, "o_groups": 2,
             "head_dim": 40, "index_head_dim": 24}


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp")
    out = {"tiny": write_checkpoint(root / "tiny", "tiny", seed=3),
           "tiny-16e": write_checkpoint(root / "tiny16", "tiny", seed=4,
                                        override={"n_routed_experts": 16, "num_experts_per_tok": 3}),
           "v41-8h-16e": write_v41_checkpoint(root / "v41", "v41-tiny", seed=4, override=V41_WIDER)}
    if (ORACLE / "model.safetensors").exists():
        out["v41-oracle"] = ORACLE  # 4 heads in 2 output groups: world 4 cuts a group
    return out


def args_for(ckpt: str) -> dict:
    return dict(ARGS, dtype="float64") if ckpt == "v41-oracle" else ARGS


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
    return {name: drive(LLMEngine(dict(args_for(name), model=str(path)))) for name, path in ckpts.items()}


def _assert_expert_slices(m, fm, cfg, rank: int, world: int, ep: bool) -> None:
    """A rank's routed experts: whole experts (expert parallel) or each expert's width slice."""
    if ep:
        e = cfg.n_routed_experts // world
        assert torch.equal(m.experts_w2, fm.experts_w2[rank * e:(rank + 1) * e])
    else:
        i = cfg.moe_intermediate_size // world
        assert torch.equal(m.experts_w1, fm.experts_w1[:, rank * i:(rank + 1) * i])
        assert torch.equal(m.experts_w2, fm.experts_w2[:, :, rank * i:(rank + 1) * i])


@pytest.mark.parametrize("ckpt, world, ep, extra", [
    ("tiny", 2, True, {}), ("tiny", 4, False, {}), ("tiny-16e", 2, False, {}), ("tiny-16e", 4, True, {}),
    ("v41-oracle", 2, True, {}),
    ("v41-8h-16e", 2, False, {"engram_tables": "mmap"}),  # each rank's rows mapped from the file, vs world 1's on the device
    ("v41-8h-16e", 4, True, {})])
def test_world_n_equals_world_1(ckpts, world1, ckpt, world, ep, extra):
    if ckpt not in ckpts:
        pytest.skip(f"the DeepSeek-V4.1 oracle is not at {ORACLE}")
    want_tokens, want_steps, want_stats = world1[ckpt]
    engine = LLMEngine(dict(args_for(ckpt), model=str(ckpts[ckpt]), tensor_parallel_size=world,
                            enable_expert_parallel=ep, **extra))
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
            _assert_expert_slices(m, fm, cfg, rank, world, ep)
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


def test_v41_script_goes_through_decoder_trim(ckpts, world1):
    """The script's V4.1 prefill chunks are trimmed: without decoder trim the logits differ."""
    _, want_steps, _ = world1["v41-8h-16e"]
    _, steps, _ = drive(LLMEngine(dict(ARGS, model=str(ckpts["v41-8h-16e"]), swa_decoder_trim=False)))
    assert any((got[rid] - want[rid]).abs().max().item() > LOGIT_TOL
               for got, want in zip(steps, want_steps) for rid in want if rid in got)


def test_v41_each_rank_reads_only_its_slices(ckpts):
    """A V4.1 rank's tensors are its slices of the full model's: heads, output groups, experts or
    their intermediate slice, the shared expert's slice, its rows of each Engram table; the
    compressors and indexers whole; the head only on rank 0."""
    from engine.models.deepseek_v41.loader import load_model as load_v41

    path = ckpts["v41-8h-16e"]
    full = load_v41(path, "float32")
    cfg = full.cfg
    for world, ep in ((2, True), (4, False)):
        for rank in range(world):
            tp = TensorParallel(rank, world, ep)
            part = load_v41(path, "float32", tp=tp)
            h, hd = cfg.num_heads // world, cfg.head_dim
            a, fa = part.layers[2].attn, full.layers[2].attn  # a KV and index source
            assert torch.equal(a.wq_b.weight, fa.wq_b.weight[rank * h * hd:(rank + 1) * h * hd])
            assert torch.equal(a.attn_sink, fa.attn_sink[rank * h:(rank + 1) * h])
            per_group = cfg.num_heads // cfg.o_groups
            g, n_g = rank * h // per_group, max(1, cfg.o_groups // world)
            rows = slice(g * cfg.o_lora_rank, (g + n_g) * cfg.o_lora_rank)
            off = (rank * h - g * per_group) * hd  # world > o_groups: this rank's heads' part of its group
            cols = slice(off, off + h * hd) if world > cfg.o_groups else slice(None)
            assert torch.equal(a.wo_a.weight, fa.wo_a.weight[rows, cols])
            assert torch.equal(a.wo_b.weight, fa.wo_b.weight[:, rows])
            for name in ("wkv", "compressor.wkv", "compressor.wgate", "indexer.wq_b", "indexer.wk"):
                assert torch.equal(a.get_submodule(name).weight, fa.get_submodule(name).weight), name
            m, fm = part.layers[2].ffn, full.layers[2].ffn
            _assert_expert_slices(m, fm, cfg, rank, world, ep)
            s = cfg.moe_intermediate_size // world
            assert torch.equal(m.shared_experts.w2.weight, fm.shared_experts.w2.weight[:, rank * s:(rank + 1) * s])
            for layer in cfg.engram_layer_ids:
                lo, hi = tp.row_span(cfg.engram_num_embeddings[cfg.engram_layer_ids.index(layer)])
                assert torch.equal(part.layers[layer].engram.embed.weight, full.layers[layer].engram.embed.weight[lo:hi])
            assert (part.head is not None) == (rank == 0)


def test_v41_quantized_slices_cut_the_scales_with_them(tmp_path):
    """V4.1 as released (FP8 32x32 linears, MXFP4 experts, FP8 Engram rows) kept as stored: each
    rank's weight and scale slices equal the full model's; a width that would cut a 32x32 tile is
    refused naming it."""
    from engine.models.deepseek_v41.loader import load_model as load_v41

    path = write_v41_checkpoint(tmp_path / "q", "v41-tiny", seed=5, quant="fp8-fp4",
                                override={"moe_intermediate_size": 64})
    kept = dict(experts_as_stored=True, linears_as_stored=True)
    full = load_v41(path, "bfloat16", **kept)
    for rank in range(2):
        tp = TensorParallel(rank, 2, False)
        part = load_v41(path, "bfloat16", tp=tp, **kept)
        a, fa = part.layers[2].attn, full.layers[2].attn
        assert a.wq_b.weight.dtype == torch.float8_e4m3fn
        assert torch.equal(a.wq_b.weight.view(torch.uint8), fa.wq_b.weight.view(torch.uint8)[rank * 128:(rank + 1) * 128])
        assert torch.equal(a.wq_b.scale, fa.wq_b.scale[rank * 4:(rank + 1) * 4])  # 128 rows: 4 tiles of 32
        assert torch.equal(a.wo_b.scale, fa.wo_b.scale[:, rank:rank + 1])
        m, fm = part.layers[2].ffn, full.layers[2].ffn
        assert torch.equal(m.shared_experts.w2.scale, fm.shared_experts.w2.scale[:, rank:rank + 1])
        assert torch.equal(m.experts_w2, fm.experts_w2[:, :, rank * 16:(rank + 1) * 16])  # packed: 2 per byte
        assert torch.equal(m.experts_w2_scale, fm.experts_w2_scale[:, :, rank:rank + 1])
        assert torch.equal(m.experts_w1_scale, fm.experts_w1_scale[:, rank * 32:(rank + 1) * 32])
        cfg = full.cfg
        lo, hi = tp.row_span(cfg.engram_num_embeddings[0])
        layer = cfg.engram_layer_ids[0]
        assert torch.equal(part.layers[layer].engram.embed.weight, full.layers[layer].engram.embed.weight[lo:hi])
    narrow = write_v41_checkpoint(tmp_path / "narrow", "v41-tiny", seed=5, quant="fp8-fp4")  # shared width 32
    with pytest.raises(ParallelConfigError, match=r"shared expert's slice per rank \(16\).*FP8 block 32"):
        LLMEngine(dict(dtype="float32", model=str(narrow), tensor_parallel_size=2))
    with pytest.raises(WeightsError, match=r"shared_experts\.w[123]\.(weight|scale).*cuts a block of 32"):
        load_v41(narrow, "bfloat16", tp=TensorParallel(0, 2, True), **kept)  # the loader itself, unchecked


def test_a_failed_collective_is_the_engines_death(monkeypatch):
    """A rank killed mid-step closes its gloo connections: the survivors' collective raises at once. That is the
    engine's death (the core exits, its requests fail UNAVAILABLE and it restarts with all its ranks), not a
    step fault to retry request by request (which failed them INTERNAL before the rank watcher noticed)."""
    def closed(*args, **kwargs):
        raise RuntimeError("[gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:41234")

    monkeypatch.setattr(torch.distributed, "all_reduce", closed)
    monkeypatch.setattr(torch.distributed, "broadcast", closed)
    tp = TensorParallel(0, 2)
    for collective in (tp.all_reduce, tp.broadcast):
        with pytest.raises(CollectiveFailed, match="Connection closed by peer") as failed:
            collective(torch.zeros(2))
        assert is_fatal(failed.value)
    assert TensorParallel(0, 1).all_reduce(torch.ones(2)).tolist() == [1.0, 1.0]  # one rank: no collective
