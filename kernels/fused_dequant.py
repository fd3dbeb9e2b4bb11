"""Weight tiles read from their stored format (kernels/formats.py is the spec), for the fused MoE.
Each takes the rows `n` and the K step starting at k0 of a [N, K] weight, loads row-major (each
row's bytes contiguous: coalesced, 16-byte loads) and returns a [BLOCK_N, BLOCK_K] tile;
out-of-range entries are 0. Products of an e4m3 / e2m1 value and a power-of-two scale are exact
in bf16, so casting a tile to bf16 for the tensor cores loses nothing."""

import triton
import triton.language as tl


@triton.jit
def fp8_rows_tile(w_ptr, s_ptr, n, k0, N, K, BLOCK_K: tl.constexpr):
    """e4m3 [N, K] with float32 128x128 block scales: the raw e4m3 tile and each row's scale for
    this step (BLOCK_K divides 128, so one scale per row), to apply to the partial product."""
    k = k0 + tl.arange(0, BLOCK_K)
    nmask = n < N
    w = tl.load(w_ptr + n[:, None] * K + k[None, :], mask=nmask[:, None] & (k[None, :] < K), other=0.0)
    sw = tl.load(s_ptr + (n // 128) * tl.cdiv(K, 128) + k0 // 128, mask=nmask, other=0.0)
    return w, sw


@triton.jit
def mxfp4_rows_tile(w_ptr, s_ptr, n, k0, N, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """e2m1 pairs [N, K/2] (low nibble = even k) with ue8m0 bytes [N, K/32] -> float32 tile. Loaded
    as [BLOCK_N, groups of 32, 16 bytes]: one scale per 16-byte vector. Each nibble becomes an
    e4m3 byte with the same bits (e2m1's 2 exponent bits low in e4m3's 4, its mantissa bit on
    top of e4m3's 3: the value times 2^-6, subnormals included), so the hardware's e4m3 convert
    decodes it; the scale 2^(s-127) times 2^6 is applied in float32."""
    G: tl.constexpr = BLOCK_K // 32
    g = tl.arange(0, G)
    b = tl.arange(0, 16)
    gmask = (n[:, None] < N) & (k0 + g[None, :] * 32 < K)
    KH = tl.multiple_of(K // 2, 16)  # K % 32 == 0 (the scale groups): rows 16-byte aligned, so 16-byte loads
    byte = tl.load(w_ptr + n[:, None, None] * KH + k0 // 2 + g[None, :, None] * 16 + b[None, None, :],
                   mask=gmask[:, :, None], other=0).to(tl.uint8, bitcast=True)
    sb = tl.load(s_ptr + n[:, None] * (K // 32) + k0 // 32 + g[None, :], mask=gmask, other=0).to(tl.int32)
    scale = ((tl.minimum(sb, 248) + 6) << 23).to(tl.float32, bitcast=True)[:, :, None]  # 2 ** (s - 121)
    lo = (((byte & 7) << 2) | ((byte & 8) << 4)).to(tl.float8e4nv, bitcast=True).to(tl.float32) * scale
    hi = (((byte >> 2) & 0x1C) | (byte & 0x80)).to(tl.float8e4nv, bitcast=True).to(tl.float32) * scale
    return tl.reshape(tl.join(lo, hi), (BLOCK_N, BLOCK_K))
