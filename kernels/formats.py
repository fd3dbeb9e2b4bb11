"""The stored weight formats of DeepSeek-V4 checkpoints, in torch: quantize and dequantize.

- FP8 block: e4m3 weight [N, K], one scale per b x b block, scale [ceil(N/b), ceil(K/b)];
  value = weight * scale. b = 128 in V4, 32 in V4.1 (FP8_BLOCKS; read from the scale's shape
  against the weight's: fp8_block_of). V4-Flash stores the scales as ue8m0 (`float8_e8m0fnu`),
  Flash-Base as float32 (vLLM's DeepseekV4FP8Config says so).
- MXFP4: e2m1 values two per byte in an int8 tensor [N, K/2] (low nibble = even k, as
  transformers' Fp8Dequantize unpacks), one ue8m0 scale per 32 values along K, scale [N, K/32].

ue8m0 is a bare biased exponent: 2 ** (byte - 127); byte 255 is NaN. The kernels read ue8m0
as its uint8 bytes (`.view(torch.uint8)`), so FP8 scales are held as float32 on the device.
"""

from __future__ import annotations

import torch

FP8_BLOCK = 128  # V4's, the default
FP8_BLOCKS = (128, 32)  # the FP8 block sizes DeepSeek ships: V4's, V4.1's
MX_BLOCK = 32
E4M3_MAX = 448.0
E2M1_MAX = 6.0
# e2m1 code -> value; codes 8..15 are the negatives (sign bit 3)
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
SCALE_DTYPES = (torch.float32, torch.float8_e8m0fnu, torch.uint8)  # uint8: raw ue8m0 bytes


def scale_to_float(scale: torch.Tensor) -> torch.Tensor:
    """Any stored scale (float32, ue8m0, ue8m0 bytes) -> float32 values."""
    if scale.dtype in (torch.float8_e8m0fnu, torch.uint8):
        return torch.exp2(scale.view(torch.uint8).float() - 127.0)
    return scale.float()


def ue8m0_ceil(x: torch.Tensor) -> torch.Tensor:
    """The power of two >= x (x > 0) as ue8m0: scales rounded up never overflow the element type."""
    e = torch.ceil(torch.log2(x.float().clamp(min=2.0**-126))).clamp(-127, 127)
    return (e + 127).to(torch.uint8).view(torch.float8_e8m0fnu)


def fp8_block_scale_shape(n: int, k: int, block: int = FP8_BLOCK) -> tuple[int, int]:
    return -(-n // block), -(-k // block)


def fp8_block_of(weight_shape, scale_shape) -> int:
    """The block size b of an FP8 weight [..., N, K] from its scales' shape [..., ceil(N/b), ceil(K/b)],
    b in FP8_BLOCKS (128 first). Unambiguous: two powers of two b1 < b2 give the same scale shape only
    when N, K <= b1, one block either way, so the same values."""
    n, k = weight_shape[-2:]
    for b in FP8_BLOCKS:
        if tuple(scale_shape[-2:]) == fp8_block_scale_shape(n, k, b):
            return b
    raise ValueError(f"FP8 scale {tuple(scale_shape)} does not tile weight {tuple(weight_shape)} in blocks of "
                     f"{' or '.join(map(str, FP8_BLOCKS))}")


def dequantize_fp8_block(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """e4m3 [..., N, K] times its block scales [..., ceil(N/b), ceil(K/b)] -> float32 (b: fp8_block_of)."""
    n, k = weight.shape[-2:]
    b = fp8_block_of(weight.shape, scale.shape)
    s = scale_to_float(scale).repeat_interleave(b, -2)[..., :n, :]
    return weight.float() * s.repeat_interleave(b, -1)[..., :k]


def quantize_fp8_block(w: torch.Tensor, ue8m0: bool = True, block: int = FP8_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., N, K] -> (e4m3 weight, block x block scales: ue8m0, or float32 absmax/448 when ue8m0=False)."""
    n, k = w.shape[-2:]
    rows, cols = fp8_block_scale_shape(n, k, block)
    pad = torch.nn.functional.pad(w.float(), (0, cols * block - k, 0, rows * block - n))
    blocks = pad.unflatten(-1, (cols, block)).unflatten(-3, (rows, block))  # [..., r, b, c, b]
    amax = blocks.abs().amax(dim=(-3, -1)).clamp(min=1e-12)
    scale = ue8m0_ceil(amax / E4M3_MAX) if ue8m0 else amax / E4M3_MAX
    s = scale_to_float(scale)[..., :, None, :, None]
    q = (blocks / s).clamp(-E4M3_MAX, E4M3_MAX).flatten(-4, -3).flatten(-2)[..., :n, :k]
    return q.to(torch.float8_e4m3fn), scale


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """int8 [..., K/2] -> float32 [..., K]: low nibble first."""
    lut = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=packed.device)
    u8 = packed.view(torch.uint8)
    return torch.stack([lut[(u8 & 0xF).long()], lut[(u8 >> 4).long()]], dim=-1).flatten(-2)


def dequantize_mxfp4(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """int8 [..., N, K/2] with ue8m0 scales [..., N, K/32] -> float32 [..., N, K]."""
    return unpack_e2m1(packed) * scale_to_float(scale).repeat_interleave(MX_BLOCK, -1)


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., N, K] (K a multiple of 32) -> (int8 [..., N, K/2], ue8m0 [..., N, K/32]), round to nearest."""
    k = w.shape[-1]
    if k % MX_BLOCK:
        raise ValueError(f"MXFP4 needs K % {MX_BLOCK} == 0, got K={k}")
    groups = w.float().unflatten(-1, (k // MX_BLOCK, MX_BLOCK))
    scale = ue8m0_ceil(groups.abs().amax(-1).clamp(min=1e-12) / E2M1_MAX)
    x = (groups / scale_to_float(scale)[..., None]).flatten(-2)
    mags = torch.tensor(E2M1_VALUES[:8], device=w.device)
    code = (x.abs()[..., None] - mags).abs().argmin(-1).to(torch.uint8) | ((x < 0).to(torch.uint8) << 3)
    packed = code[..., 0::2] | (code[..., 1::2] << 4)
    return packed.view(torch.int8), scale


def act_scale_1x128(amax: torch.Tensor) -> torch.Tensor:
    """The smallest power of two s with 448 * s >= amax (DeepSeek's ue8m0 activation scales), from
    the float32 bits: exact, so kernel and reference divide by the same s and round the same."""
    bits = amax.float().contiguous().view(torch.int32)
    j = ((bits >> 23) & 0xFF) - 8 + ((bits & 0x7FFFFF) > 0x600000).to(torch.int32)  # 448 = 1.75 * 2^8
    return (j.clamp(1, 254) << 23).view(torch.float32)


def quantize_act_1x128(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Activations [M, K] -> (e4m3 [M, K], float32 power-of-two scales [M, ceil(K/128)]) per row and
    128 columns: the on-the-fly quantization of the FP8 tensor-core GEMM."""
    m, k = x.shape
    cols = -(-k // FP8_BLOCK)
    pad = torch.nn.functional.pad(x.float(), (0, cols * FP8_BLOCK - k)).view(m, cols, FP8_BLOCK)
    scale = act_scale_1x128(pad.abs().amax(-1).clamp(min=1e-12))
    q = (pad / scale[..., None]).clamp(-E4M3_MAX, E4M3_MAX).view(m, -1)[:, :k]
    return q.to(torch.float8_e4m3fn), scale
