"""Linears reading one input stacked at load (engine/models/stacked_linears.py): the FP8 pairs (wq_a over wkv,
the shared expert's w1 over w3) and the attention input's bf16 readers (the compressors' wkv / wgate,
the indexer's weights_proj) become views of one tensor each, the model's logits stay those of the
separate linears through prefill, mixed and decode steps (the torch references and the fused kernels,
which read the readers' outputs as strided column slices), and under tensor parallelism each rank
stacks its own slices."""

import pytest
import torch

import kernels as K
from engine.cache import KVCache
from engine.models.deepseek_v4.loader import load_model
from engine.models.deepseek_v4.random_checkpoint import write_checkpoint
from engine.models.stacked_linears import ATTENTION_X_READERS, members
from engine.parallel import TensorParallel
from engine.request import SamplingParams
from engine.runner import ModelRunner
from engine.sequence import Sequence

# N of wq_a (q_lora_rank) and of the shared expert's slice a whole number of 128-row scale blocks
OVERRIDE = {"hidden_size": 128, "num_attention_heads": 2, "head_dim": 128, "q_lora_rank": 128,
            "o_groups": 2, "o_lora_rank": 128, "moe_intermediate_size": 256, "num_hidden_layers": 2,
            "compress_ratios": [4, 16, 0], "num_hash_layers": 1, "sliding_window": 8}


def _unstack(model):
    for m in model.modules():
        if hasattr(m, "stacked"):
            del m.stacked  # linear_group falls back to one launch per linear


def _steps(model, decodes: int = 3) -> torch.Tensor:
    """Every row's logits of: a 21-token prefill of A; a mixed step (A decodes, B prefills 18 tokens);
    `decodes` decode steps of both (the one-row-per-sequence path) -> [rows, vocab]."""
    cfg, dtype = model.cfg, model.embed.weight.dtype
    cache = KVCache(cfg, 16, 64, 64, 2, dtype)
    runner = ModelRunner(model, cache)
    a, b = (Sequence(n, [5 + (7 * j + 3 * k) % 200 for j in range(L)], SamplingParams())
            for n, k, L in (("a", 0, 21), ("b", 1, 18)))
    out = []

    def step(batch):
        for seq, n in batch:
            s = seq.num_computed_tokens
            cache.allocate(seq.blocks, max(0, s - cfg.sliding_window + 1), s + n)
        logits = runner.run(batch, all_logits=True)
        out.append(logits)
        rows = 0
        for seq, n in batch:
            rows += n
            seq.num_computed_tokens = seq.compress_from = seq.num_computed_tokens + n
            if seq.num_computed_tokens >= seq.num_prompt_tokens:
                seq.output_token_ids.append(int(logits[rows - 1].argmax()))
    step([(a, 21)])
    step([(a, 1), (b, 18)])
    for _ in range(decodes):
        step([(a, 1), (b, 1)])
    return torch.cat(out)


def _close(got, want, rtol):
    assert torch.allclose(got.float(), want.float(), rtol=0, atol=rtol * want.float().abs().max()), \
        (got.float() - want.float()).abs().max()


@pytest.fixture(scope="module")
def fp8_path(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("stacked"), "tiny", seed=11, quant="fp8-fp4", override=OVERRIDE)


def test_groups_stack_as_views_and_the_state_dict_is_unchanged(fp8_path):
    model = load_model(fp8_path, torch.float32, quantized=True)
    names = set(model.state_dict())
    csa, hca = model.layers[0].attn, model.layers[1].attn
    for first, second in ((csa.wq_a, csa.wkv), (model.layers[0].ffn.shared_experts.w1,
                                                model.layers[0].ffn.shared_experts.w3)):
        st = first.stacked
        n1, b1 = first.weight.shape[0], first.scale.shape[0]
        assert st.members == (first, second) and not st.views
        assert first.weight.data_ptr() == st.weight.data_ptr() and second.weight.data_ptr() == st.weight[n1:].data_ptr()
        assert second.scale.data_ptr() == st.scale[b1:].data_ptr()
    for attn, n in ((csa, 5), (hca, 2)):  # CSA: both compressors and weights_proj; HCA: its compressor
        readers = members(attn, ATTENTION_X_READERS)
        st = readers[0].stacked
        assert len(readers) == n and st.members == readers and st.views and st.scale is None
        assert st.bounds[-1] == st.weight.shape[0] == sum(m.weight.shape[0] for m in readers)
        for m, lo in zip(readers, st.bounds):
            assert m.weight.data_ptr() == st.weight[lo:].data_ptr()
    assert set(model.state_dict()) == names and "layers.0.attn.indexer.weights_proj.weight" in names
    separate = load_model(fp8_path, torch.float32, quantized=True)
    _unstack(separate)
    for a, b in zip(model.parameters(), separate.parameters()):
        assert torch.equal(a.view(torch.uint8) if a.dtype == torch.float8_e4m3fn else a,
                           b.view(torch.uint8) if b.dtype == torch.float8_e4m3fn else b)


@pytest.mark.parametrize("dtype, rtol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_logits_match_separate_linears_through_prefill_mixed_and_decode(fp8_path, dtype, rtol, single_thread):
    """The torch references (the CPU path): the stacked GEMM's columns against one GEMM per linear
    (bitwise equal on this machine; the tolerance allows a GEMM that blocks a wider N differently)."""
    model = load_model(fp8_path, dtype, quantized=True)
    assert model.layers[0].attn.compressor.wkv.stacked.views and model.layers[1].attn.compressor.wkv.stacked
    separate = load_model(fp8_path, dtype, quantized=True)
    _unstack(separate)
    _close(_steps(model), _steps(separate), rtol)


def test_fused_kernels_read_the_stacked_outputs_in_place(fp8_path, monkeypatch, single_thread):
    """The stacked outputs' consumers as CUDA dispatches them (Triton interpreter; the rest of the model
    on the references, for time): compress_decode / compress_blocks / indexer_topk read the column
    slices in place and take the head weights' scale inside, against the separate linears' contiguous
    outputs and the scale applied in torch."""
    from kernels import fused

    for name in ("compress_decode", "compress_blocks", "indexer_topk"):
        monkeypatch.setattr(K, name, fused.FUSED[name])
    model = load_model(fp8_path, torch.bfloat16, quantized=True)
    attn = model.layers[0].attn
    assert attn.compressor.wkv.stacked.members[-1] is attn.indexer.weights_proj  # the indexer's outputs: slices
    separate = load_model(fp8_path, torch.bfloat16, quantized=True)
    _unstack(separate)
    _close(_steps(model, decodes=2), _steps(separate, decodes=2), 2e-2)


def test_each_rank_stacks_its_own_slices(fp8_path):
    full = load_model(fp8_path, "bfloat16", quantized=True)
    for rank in range(2):
        part = load_model(fp8_path, "bfloat16", quantized=True, tp=TensorParallel(rank, 2, False))
        s, fs = part.layers[1].ffn.shared_experts, full.layers[1].ffn.shared_experts
        st = s.w1.stacked  # this rank's w1 rows over its w3 rows
        rows = slice(rank * 128, (rank + 1) * 128)
        assert torch.equal(st.weight.view(torch.uint8),
                           torch.cat([fs.w1.weight[rows], fs.w3.weight[rows]]).view(torch.uint8))
        assert torch.equal(st.scale, torch.cat([fs.w1.scale[rank:rank + 1], fs.w3.scale[rank:rank + 1]]))
        assert part.layers[1].attn.wq_a.stacked.weight.shape == (256, 128)  # replicated: all of wq_a over wkv
        readers = members(part.layers[0].attn, ATTENTION_X_READERS)  # replicated too: the whole group
        assert torch.equal(readers[0].stacked.weight, full.layers[0].attn.compressor.wkv.stacked.weight)


def test_the_mtp_block_stacks_its_pairs_too(fp8_path):
    from engine.models.deepseek_v4.mtp import MTP

    model = load_model(fp8_path, torch.float32, quantized=True)
    ffn = model.layers[0].ffn.shared_experts
    want = torch.cat([ffn.w1.weight, ffn.w3.weight]).view(torch.uint8).clone()  # main model's, for the shapes
    mtp = MTP.from_model(model)
    attn, shared = mtp.block.attn, mtp.block.ffn.shared_experts
    assert attn.wq_a.stacked.members == (attn.wq_a, attn.wkv) and shared.w1.stacked.members == (shared.w1, shared.w3)
    assert shared.w1.stacked.weight.shape == want.shape and not members(attn, ATTENTION_X_READERS)  # window only
    assert shared.w3.weight.data_ptr() == shared.w1.stacked.weight[shared.w1.weight.shape[0]:].data_ptr()
