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
