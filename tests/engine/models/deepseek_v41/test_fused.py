"""DeepSeek-V4.1's prefill and decode through the fused Triton kernels (TRITON_INTERPRET=1 on the CPU)
against the torch references, on the oracle checkpoint.

float32, not bf16: the fused kernels compute in float32 inside, so in a float32 model they agree
with the references to float32 rounding (measured ~1e-6 of the logit scale), a bound that catches
a wrong index or a missing term. In bf16 this 10-layer random-weight model is chaotic: the bf16
references alone move the logits by ~1.0 of their scale against float32 (fake-quant steps flip,
greedy tokens part), so no tolerance there would mean anything; the kernel tests
(tests/kernels/deepseek_v41/test_fused.py) bound each op in bf16 instead.
"""

from __future__ import annotations

import pytest
import torch

import kernels
from kernels import fused
from tests.engine.models.deepseek_v41.oracle import ORACLE, greedy, needs_oracle

pytestmark = [needs_oracle, pytest.mark.usefixtures("single_thread")]


def test_decode_through_the_fused_kernels_equals_the_references(v41_golden):
    """Chunked prefill then greedy decode on the CUDA-graph path's static batch of 1 (index layers with
    and without candidate blocks): the same tokens, and every step's logits within 1e-5 of the logit scale."""
    from engine.models.deepseek_v41.loader import load_model

    model = load_model(ORACLE, torch.float32, decoder_trim=False)
    ids = v41_golden["prompt_ids_0"].tolist()
    try:
        kernels.set_backend("ref")
        want_tokens, want = greedy(model, ids, 16, steps=4, decode_batches=(1,), dtype=torch.float32)
        kernels.set_backend("fused")
        for name in [n for n in kernels.op_names() if n.startswith("v41_")] + ["indexer_topk", "indexer_scores_paged"]:
            assert getattr(kernels, name) is fused.FUSED[name]  # every V4.1 op and the decode indexer: kernels
        got_tokens, got = greedy(model, ids, 16, steps=4, decode_batches=(1,), dtype=torch.float32)
    finally:
        kernels.set_backend("auto")
    err = (got - want).abs().max(-1).values / want.abs().max()
    print(f"fused vs references, per step (of the logit scale): {err.tolist()}")
    assert got_tokens == want_tokens
    assert err.max() <= 1e-5, err
