"""The activation the kernels compute in their prologues and epilogues, written once."""

import triton
import triton.language as tl


@triton.jit
def clamped_swiglu(gate, up, limit, CLAMP: tl.constexpr = True):
    """DeepSeek-V4's SwiGLU, float32 in and out (kernels.reference's arithmetic): with CLAMP the gate clamped above
    at `limit` and the up projection to +-limit, then silu(gate) * up."""
    if CLAMP:
        gate = tl.minimum(gate, limit)
        up = tl.minimum(tl.maximum(up, -limit), limit)
    return gate * tl.sigmoid(gate) * up
