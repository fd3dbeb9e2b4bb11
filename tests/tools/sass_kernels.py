"""Small kernels for tools/sass_report's smoke test (imported by a subprocess without the interpreter)."""

import triton
import triton.language as tl


@triton.jit
def tile_product(a_ptr, b_ptr, c_ptr, K, BLOCK: tl.constexpr):
    """c = a @ b for one BLOCK x BLOCK tile, K a multiple of BLOCK: a plain pipelined matmul loop."""
    r = tl.arange(0, BLOCK)
    acc = tl.zeros((BLOCK, BLOCK), tl.float32)
    for k in range(0, K, BLOCK):
        a = tl.load(a_ptr + r[:, None] * K + k + r[None, :])
        b = tl.load(b_ptr + (k + r[:, None]) * BLOCK + r[None, :])
        acc = tl.dot(a, b, acc)
    tl.store(c_ptr + r[:, None] * BLOCK + r[None, :], acc)
