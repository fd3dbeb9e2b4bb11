"""Weight tiles dequantized in registers (kernels/formats.py is the spec), shared by the FP8
linear and the fused MoE. Each returns the [BLOCK_K, BLOCK_N] tile of W^T as float32 for the
columns `n` and reduction indices `k` of a [N, K] weight; out-of-range entries are 0.
Products of an e4m3 / e2m1 value and a power-of-two scale are exact in bf16, so casting the
tile to bf16 for the tensor cores loses nothing (float32 Base scales round once, as the
reference's own cast does)."""

import triton
import triton.language as tl


@triton.jit
def fp8_block_tile(w_ptr, s_ptr, n, k, N, K, w_off, s_off):
    """e4m3 weight [N, K] with float32 block scales [cdiv(N, 128), cdiv(K, 128)]."""
    mask = (n[None, :] < N) & (k[:, None] < K)
    w = tl.load(w_ptr + w_off + n[None, :] * K + k[:, None], mask=mask, other=0.0).to(tl.float32)
    sk = tl.cdiv(K, 128)
    s = tl.load(s_ptr + s_off + (n[None, :] // 128) * sk + k[:, None] // 128, mask=mask, other=0.0)
    return w * s


@triton.jit
def mxfp4_tile(w_ptr, s_ptr, n, k, N, K, w_off, s_off):
    """e2m1 pairs [N, K/2] (low nibble = even k) with ue8m0 bytes [N, K/32]."""
    mask = (n[None, :] < N) & (k[:, None] < K)
    byte = tl.load(w_ptr + w_off + n[None, :] * (K // 2) + k[:, None] // 2, mask=mask, other=0).to(tl.int32) & 0xFF
    code = (byte >> ((k[:, None] % 2) * 4)) & 0xF
    e = (code >> 1) & 3
    m = (code & 1).to(tl.float32)
    mag = tl.where(e == 0, m * 0.5, (1.0 + m * 0.5) * ((1 << e) >> 1).to(tl.float32))
    value = tl.where((code & 8) != 0, -mag, mag)
    sb = tl.load(s_ptr + s_off + n[None, :] * (K // 32) + k[:, None] // 32, mask=mask, other=127).to(tl.int32) & 0xFF
    return value * (sb << 23).to(tl.float32, bitcast=True)  # 2 ** (sb - 127), exact
