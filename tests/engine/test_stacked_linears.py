"""FP8 linears reading one input stacked at load (engine/stacked_linears.py): wq_a over wkv and the
shared expert's w1 over w3 become views of one tensor each, the model's logits stay those of the
separate linears, and under tensor parallelism each rank stacks its own slices."""

import torch

from engine.loader import load_model
from engine.parallel import TensorParallel
from engine.random_checkpoint import write_checkpoint
from tests.engine.conftest import incremental_logits

# N of wq_a (q_lora_rank) and of the shared expert's slice a whole number of 128-row scale blocks
OVERRIDE = {"hidden_size": 128, "num_attention_heads": 2, "head_dim": 128, "q_lora_rank": 128,
            "o_groups": 2, "o_lora_rank": 128, "moe_intermediate_size": 256, "num_hidden_layers": 2,
            "compress_ratios": [0, 4, 0], "num_hash_layers": 1, "sliding_window": 8}


def _unstack(model):
    for m in model.modules():
        if hasattr(m, "stacked"):
            del m.stacked  # linear_pair falls back to two launches


def test_pairs_stack_as_views_and_logits_match_separate_linears(tmp_path):
    path = write_checkpoint(tmp_path, "tiny", seed=11, quant="fp8-fp4", override=OVERRIDE)
    model = load_model(path, torch.float32, quantized=True)
    names = set(model.state_dict())
    for layer in model.layers:
        a, s = layer.attn, layer.ffn.shared_experts
        for first, second in ((a.wq_a, a.wkv), (s.w1, s.w3)):
            _, weight, scale = first.stacked
            n1, b1 = first.weight.shape[0], first.scale.shape[0]
            assert first.weight.data_ptr() == weight.data_ptr() and second.weight.data_ptr() == weight[n1:].data_ptr()
            assert second.scale.data_ptr() == scale[b1:].data_ptr()
    assert set(model.state_dict()) == names and "layers.0.attn.wkv.weight" in names
    separate = load_model(path, torch.float32, quantized=True)
    _unstack(separate)
    for a, b in zip(model.parameters(), separate.parameters()):
        assert torch.equal(a.view(torch.uint8) if a.dtype == torch.float8_e4m3fn else a,
                           b.view(torch.uint8) if b.dtype == torch.float8_e4m3fn else b)
    ids = list(range(7, 37))
    got, want = incremental_logits(model, ids, chunks=[20]), incremental_logits(separate, ids, chunks=[20])
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-5 * want.abs().max())


def test_each_rank_stacks_its_own_slices(tmp_path):
    path = write_checkpoint(tmp_path, "tiny", seed=5, quant="fp8-fp4", override=OVERRIDE)
    full = load_model(path, "bfloat16", quantized=True)
    for rank in range(2):
        part = load_model(path, "bfloat16", quantized=True, tp=TensorParallel(rank, 2, False))
        s, fs = part.layers[1].ffn.shared_experts, full.layers[1].ffn.shared_experts
        _, weight, scale = s.w1.stacked  # this rank's w1 rows over its w3 rows
        rows = slice(rank * 128, (rank + 1) * 128)
        assert torch.equal(weight.view(torch.uint8), torch.cat([fs.w1.weight[rows], fs.w3.weight[rows]]).view(torch.uint8))
        assert torch.equal(scale, torch.cat([fs.w1.scale[rank:rank + 1], fs.w3.scale[rank:rank + 1]]))
        assert part.layers[1].attn.wq_a.stacked[1].shape == (256, 128)  # replicated: all of wq_a over wkv


def test_the_mtp_block_stacks_its_pairs_too(tmp_path):
    from engine.mtp import MTP

    path = write_checkpoint(tmp_path, "tiny", seed=3, quant="fp8-fp4", override=OVERRIDE)
    model = load_model(path, torch.float32, quantized=True)
    ffn = model.layers[0].ffn.shared_experts
    want = torch.cat([ffn.w1.weight, ffn.w3.weight]).view(torch.uint8).clone()  # main model's, for the shapes
    mtp = MTP.from_model(model)
    attn, shared = mtp.block.attn, mtp.block.ffn.shared_experts
    assert attn.wq_a.stacked[0] is attn.wkv and shared.w1.stacked[0] is shared.w3
    assert shared.w1.stacked[1].shape == want.shape
    assert shared.w3.weight.data_ptr() == shared.w1.stacked[1][shared.w1.weight.shape[0]:].data_ptr()
