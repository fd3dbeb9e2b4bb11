"""tools.count_decode_ops: the launches of a decode step by layer kind, for the whole tiny model and for rank 0's share
at tensor_parallel_size 2 with expert parallelism (the interpreter runs the CUDA dispatch)."""

import tempfile
from pathlib import Path

import torch

from engine.models.deepseek_v4.random_checkpoint import write_checkpoint
from tools import count_decode_ops as c


def test_a_rank_share_launches_what_the_whole_model_launches_a_layer_and_routers_one_kernel_each():
    """The share's routers give its experts' local ids from the launch that routes (no elementwise launches to map
    them) and its linears are stacked as the loader stacks them, so every layer kind launches as many kernels as
    the whole model's; hash layers route in the same one program per token as the others (the router's GEMM and
    kernel, the MoE's align, gate/up, down and top-k sum, and the shared expert's add: 7)."""
    with tempfile.TemporaryDirectory() as tmp:
        whole = c.count(str(write_checkpoint(Path(tmp) / "tiny", "tiny")), torch.bfloat16)
    share = c.count_model(*c.tp_share("tiny", {}, 2, torch.bfloat16))
    assert share["by_kind"] == whole["by_kind"] and "window +hash" in whole["by_kind"]
    for kind, sources in whole["by_kind_source"].items():
        assert sources["kernels.router_moe (fused)"] == 7, kind
        shared = share["by_kind_source"][kind]
        assert shared["kernels.router_topk (fused)"] + shared["kernels.moe_experts (fused)"] == 7, kind
    assert not any("local_experts" in s or "parallel." in s for s in share["by_source"])


def test_a_bigger_batch_counts_the_paths_it_takes(tmp_path):
    """--batch: the step of 33 sequences takes wo_a's per-group calls (past GROUPED_ONE_LAUNCH_MAX_T rows), a launch
    a group and the concatenation, each group's columns read in place (no copy kernel before them); with kernel
    variant wo_a_one_launch one launch. A one-layer model with wo_a groups of whole 128-row scale blocks (its FP8
    kernels, not the reference's dequantized weight)."""
    from kernels import variants
    from kernels.fused import GROUPED_ONE_LAUNCH_MAX_T

    override = {"o_lora_rank": 256, "num_hidden_layers": 1, "compress_ratios": [0, 0]}  # 2 groups of 128 rows
    model = str(write_checkpoint(tmp_path / "tiny", "tiny", override=override, quant="fp8-fp4"))
    batch = GROUPED_ONE_LAUNCH_MAX_T + 1
    per_group = c.count(model, torch.bfloat16, batch=batch)["by_kind_source"]["window +hash"]
    saved = variants.enabled()
    try:
        variants.set_variants((*saved, "wo_a_one_launch"))
        one = c.count(model, torch.bfloat16, batch=batch)["by_kind_source"]["window +hash"]
    finally:
        variants.set_variants(saved)
    assert per_group["kernels.grouped_linear (fused)"] == 2 + 1 and one["kernels.grouped_linear (fused)"] == 1
