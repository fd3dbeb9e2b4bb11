"""DeepSeek-V4.1's Engram row gather in one launch (`kernels.v41_engram_gather`; the spec is
kernels/deepseek_v41/reference.py's engram_gather): each program takes BLOCK_R of the step's table ids,
loads those rows as stored (e4m3 or float) with their scales, dequantizes in float32 and writes them
in the model dtype; an id outside this rank's rows writes zeros without a load.

The table may sit in host memory: page-locked and mapped into the GPU's address space
(engine/models/deepseek_v41/mapped_tables.py), so these loads travel over PCIe and only the rows a step
reads cross it (the zero-copy access of unified virtual addressing), with no host thread, no copy
and no synchronisation, which is what lets the gather sit inside a CUDA graph. A row is 256 contiguous
bytes at V4.1-Flash (256 channels in e4m3) plus 8 scale bytes, loaded as whole rows so each
becomes a few full PCIe read requests.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_UE8M0 = (torch.uint8, torch.float8_e8m0fnu)


@triton.jit(do_not_specialize=["R", "lo", "n"])
def _gather_kernel(ids_ptr, rows_ptr, scale_ptr, out_ptr, R, lo, n, D: tl.constexpr, G: tl.constexpr,
                   C: tl.constexpr, GP: tl.constexpr, CP: tl.constexpr, SCALE: tl.constexpr, BLOCK_R: tl.constexpr):
    """A row is G groups of C channels (D = G * C; G = 1 without scales), padded to GP x CP.
    SCALE: 0 none, 1 ue8m0 bytes, 2 float scales."""
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    live = r < R
    local = tl.load(ids_ptr + r, mask=live, other=0).to(tl.int64) - lo
    mine = live & (local >= 0) & (local < n)
    idx = tl.where(mine, local, 0)
    g = tl.arange(0, GP)
    c = tl.arange(0, CP)
    col = g[:, None] * C + c[None, :]
    inside = (g[:, None] < G) & (c[None, :] < C)
    v = tl.load(rows_ptr + idx[:, None, None] * D + col[None, :, :], mask=mine[:, None, None] & inside[None, :, :],
                other=0.0)
    if SCALE != 0:
        smask = mine[:, None] & (g[None, :] < G)
        if SCALE == 1:
            sb = tl.load(scale_ptr + idx[:, None] * G + g[None, :], mask=smask, other=127).to(tl.int32)
            # 2 ** (sb - 127) built from its bits: exact; byte 0 is the subnormal 2^-127, 255 gives inf (as torch)
            s = tl.where(sb == 0, 0x00400000, sb << 23).to(tl.float32, bitcast=True)
        else:
            s = tl.load(scale_ptr + idx[:, None] * G + g[None, :], mask=smask, other=1.0).to(tl.float32)
        v = v.to(tl.float32) * s[:, :, None]
    tl.store(out_ptr + r[:, None, None].to(tl.int64) * D + col[None, :, :], v.to(out_ptr.dtype.element_ty),
             mask=live[:, None, None] & inside[None, :, :])


def engram_gather_fused(ids: torch.Tensor, rows: torch.Tensor, scale: torch.Tensor | None, lo: int,
                        dtype: torch.dtype, out: torch.Tensor | None = None) -> torch.Tensor:
    """The reference's signature; rows / scale may be views of mapped host memory."""
    n, D = rows.shape
    if out is None:
        out = torch.empty(*ids.shape, D, dtype=dtype, device=ids.device)
    flat = ids.reshape(-1)
    R = flat.numel()
    if R == 0:
        return out
    if scale is None:
        G, kind = 1, 0
    else:
        G, kind = scale.shape[-1], 1 if scale.dtype in _UE8M0 else 2
        if D % G:
            raise ValueError(f"Engram table scale {tuple(scale.shape)} does not fit rows {tuple(rows.shape)}")
        scale = scale.view(torch.uint8) if kind == 1 else scale
    C = D // G
    GP, CP = triton.next_power_of_2(G), triton.next_power_of_2(C)
    block_r = max(1, min(64, 4096 // (GP * CP)))  # a 4096-channel tile: 16 rows at V4.1-Flash's 256
    _gather_kernel[(triton.cdiv(R, block_r),)](flat, rows, rows if scale is None else scale, out, R, lo, n,
                                               D=D, G=G, C=C, GP=GP, CP=CP, SCALE=kind, BLOCK_R=block_r)
    return out
