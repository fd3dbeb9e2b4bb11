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


# e2m1 -> bf16 with integer ops only, two values per 32-bit register (no conversion-unit
# instructions, which bound the e4m3 placement at ~0.8 TB/s): word j of the shifts below holds
# nibbles j and j + 4 of eight packed values, each moved to bf16's bits as sign << 15 | code << 6,
# which is the e2m1 value times 2^-126 exactly (code 1, the value 0.5, lands on bf16's subnormal
# 2^-127); two bf16x2 multiplies by 2^126 and by the group's ue8m0 scale 2^(s-127) finish it, exact.
# One multiply by 2^(s-1) ($9) does the same where every scale byte s is at most 128 (weights under 12 in
# magnitude: bf16's largest exponent), exact there too: the "one_mul" text.
def _e2m1_bf16_asm(one_mul: bool) -> str:
    text = """
{
.reg .b32 a, b, t, z, big;
mov.b32 z, 0x80008000;
mov.b32 big, 0x7E807E80;
shl.b32 a, $8, 6;
shl.b32 b, $8, 12;
and.b32 a, a, 0x01C001C0;
and.b32 b, b, 0x80008000;
or.b32 t, a, b;
fma.rn.bf16x2 t, t, big, z;
fma.rn.bf16x2 t, t, $9, z;
mov.b32 {$0, $4}, t;
shl.b32 a, $8, 2;
shl.b32 b, $8, 8;
and.b32 a, a, 0x01C001C0;
and.b32 b, b, 0x80008000;
or.b32 t, a, b;
fma.rn.bf16x2 t, t, big, z;
fma.rn.bf16x2 t, t, $9, z;
mov.b32 {$1, $5}, t;
shr.b32 a, $8, 2;
shl.b32 b, $8, 4;
and.b32 a, a, 0x01C001C0;
and.b32 b, b, 0x80008000;
or.b32 t, a, b;
fma.rn.bf16x2 t, t, big, z;
fma.rn.bf16x2 t, t, $9, z;
mov.b32 {$2, $6}, t;
shr.b32 a, $8, 6;
and.b32 a, a, 0x01C001C0;
and.b32 b, $8, 0x80008000;
or.b32 t, a, b;
fma.rn.bf16x2 t, t, big, z;
fma.rn.bf16x2 t, t, $9, z;
mov.b32 {$3, $7}, t;
}
"""
    return text.replace("fma.rn.bf16x2 t, t, big, z;\n", "") if one_mul else text


_E2M1_BF16_ASM = tl.constexpr(_e2m1_bf16_asm(False))
_E2M1_BF16_ASM_ONE_MUL = tl.constexpr(_e2m1_bf16_asm(True))


@triton.jit
def _bf16_lanes(t, sf):
    """The interpreter's path of the asm above for one shifted word: both bf16 lanes, read as the
    float32 with the same top bits (code 1 a float32 subnormal, exact) and scaled in float32."""
    lo = (t << 16).to(tl.float32, bitcast=True)
    hi = (t & 0xFFFF0000).to(tl.float32, bitcast=True)
    return (lo * 8.507059173023462e37 * sf).to(tl.bfloat16), (hi * 8.507059173023462e37 * sf).to(tl.bfloat16)  # 2^126


@triton.jit
def _words_bf16(words, sb, ASM: tl.constexpr, ONE_MUL: tl.constexpr = False):
    """Eight values of each uint32 word (nibble q: value q) times 2^(sb - 127), sb the ue8m0 byte as uint32
    (words' shape): eight bf16 tensors, the q-th value q of every word. ASM: the PTX (GPU), else the same bit
    operations in Triton with the scale applied in float32 (the interpreter runs no inline asm). ONE_MUL: the
    PTX's one multiply, for scale bytes <= 128 only."""
    if ASM:
        if ONE_MUL:
            sc = (sb + 126) << 7  # bf16 2^(s-1)
            o = tl.inline_asm_elementwise(_E2M1_BF16_ASM_ONE_MUL, "=h,=h,=h,=h,=h,=h,=h,=h,r,r",
                                          [words, sc | (sc << 16)], dtype=(tl.int16,) * 8, is_pure=True, pack=1)
        else:
            sc = sb << 7  # bf16 2^(s-127): the ue8m0 byte is bf16's exponent field
            o = tl.inline_asm_elementwise(_E2M1_BF16_ASM, "=h,=h,=h,=h,=h,=h,=h,=h,r,r", [words, sc | (sc << 16)],
                                          dtype=(tl.int16,) * 8, is_pure=True, pack=1)
        o0, o1, o2, o3 = (o[0].to(tl.bfloat16, bitcast=True), o[1].to(tl.bfloat16, bitcast=True),
                          o[2].to(tl.bfloat16, bitcast=True), o[3].to(tl.bfloat16, bitcast=True))
        o4, o5, o6, o7 = (o[4].to(tl.bfloat16, bitcast=True), o[5].to(tl.bfloat16, bitcast=True),
                          o[6].to(tl.bfloat16, bitcast=True), o[7].to(tl.bfloat16, bitcast=True))
    else:
        sf = (sb << 23).to(tl.float32, bitcast=True)  # 2^(s-127)
        o0, o4 = _bf16_lanes(((words << 6) & 0x01C001C0) | ((words << 12) & 0x80008000), sf)
        o1, o5 = _bf16_lanes(((words << 2) & 0x01C001C0) | ((words << 8) & 0x80008000), sf)
        o2, o6 = _bf16_lanes(((words >> 2) & 0x01C001C0) | ((words << 4) & 0x80008000), sf)
        o3, o7 = _bf16_lanes(((words >> 6) & 0x01C001C0) | (words & 0x80008000), sf)
    return o0, o1, o2, o3, o4, o5, o6, o7


@triton.jit
def mxfp4_rows_parts_bf16(w_ptr, s_ptr, n, k0, N, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, ASM: tl.constexpr):
    """e2m1 pairs [N, K/2] with ue8m0 bytes [N, K/32] -> eight bf16 tiles [BLOCK_N, BLOCK_K / 8], decoded
    with integer ops (above): the q-th holds value q of every word (K = k0 + 8 w + q). Loaded as 32-bit
    words, eight values each, 16-byte rows."""
    W: tl.constexpr = BLOCK_K // 8
    G: tl.constexpr = BLOCK_K // 32
    KW = tl.multiple_of(K // 8, 4)  # K % 32 == 0: whole 16-byte groups per row
    wd = tl.max_contiguous(tl.multiple_of(k0 // 8 + tl.arange(0, W), 4), 4)
    nmask = n < N
    wp = tl.multiple_of(w_ptr.to(tl.pointer_type(tl.int32)), 16)  # the cast forgets the byte pointer's alignment
    words = tl.load(wp + n[:, None] * KW + wd[None, :],
                    mask=nmask[:, None] & (wd[None, :] < KW), other=0).to(tl.uint32, bitcast=True)
    g = k0 // 32 + tl.arange(0, G)
    sb = tl.load(s_ptr + n[:, None] * (K // 32) + g[None, :], mask=nmask[:, None] & (g[None, :] < K // 32),
                 other=0).to(tl.uint32)
    sb = tl.reshape(tl.broadcast_to(sb[:, :, None], (BLOCK_N, G, 4)), (BLOCK_N, W))  # 4 words per group
    return _words_bf16(words, sb, ASM)


@triton.jit
def mxfp4_rows_tile_bf16(w_ptr, s_ptr, n, k0, N, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, ASM: tl.constexpr):
    """The parts above joined into one [BLOCK_N, BLOCK_K] tile in natural K order."""
    o0, o1, o2, o3, o4, o5, o6, o7 = mxfp4_rows_parts_bf16(w_ptr, s_ptr, n, k0, N, K, BLOCK_N, BLOCK_K, ASM)
    # a join's new axis is the last: the outermost join picks the fastest bit of the K offset q
    t = tl.join(tl.join(tl.join(o0, o4), tl.join(o2, o6)), tl.join(tl.join(o1, o5), tl.join(o3, o7)))
    return tl.reshape(t, (BLOCK_N, BLOCK_K))


# The "bf16-frag" decode: each thread's values land in the registers wgmma (or mma.sync) reads its A operand from,
# so the decoded tile goes to the tensor cores without a round trip through shared memory. The MMA's K order
# within each 128-wide step is permuted instead of the stored bytes: in an A fragment a thread (quad lane l) holds
# rows r and r + 8 at K offsets 16 j + 8 b2 + 2 l + b0, and in this order those are value 4 b0 + 2 (j % 2) + b2 of
# word l of the row's 32-value group j // 2 (frag_position below). So every word read is one of the stored row's
# words and every word's scale is its group's: four 32-bit words and one 32-bit read of the four groups' scale bytes
# a row per step. The activations come in the same order (to_frag_order; the MoE's hidden h is stored in it by the
# gate / up kernel), so the products and their sums are the same terms.
@triton.jit
def frag_position(k):
    """The MMA position of stored K k (within its 128-wide step): stored 32 g + 8 l + 4 b0 + 2 jp + b2 is position
    32 g + 16 jp + 8 b2 + 2 l + b0."""
    return (k // 128) * 128 + ((k // 32) % 4) * 32 + ((k // 2) % 2) * 16 + (k % 2) * 8 + ((k // 8) % 4) * 2 + (k // 4) % 2


def to_frag_order(a):
    """a [..., K] (K % 128 == 0) with each 128-wide step's columns in the MMA's order (frag_position): what the
    "bf16-frag" decode multiplies, so its activation tiles load as stored, straight into shared memory."""
    *lead, k = a.shape
    v = a.reshape(*lead, k // 128, 4, 4, 2, 2, 2)  # g, l, b0, jp, b2
    n = len(lead) + 1
    return v.permute(*range(n), n, n + 3, n + 4, n + 1, n + 2).reshape(a.shape)


@triton.jit
def _frag_group(wp, sw, row, rmask, KW, k0, l4, G: tl.constexpr, ASM: tl.constexpr, ONE_MUL: tl.constexpr):
    """Word l4 of group G of each row, decoded: [..., b0, b2, jp] (the joins put each new axis last)."""
    words = tl.load(wp + row * KW + (k0 // 8 + 4 * G) + l4, mask=rmask, other=0).to(tl.uint32, bitcast=True)
    return _frag_words(words, sw, G, ASM, ONE_MUL)


@triton.jit
def _frag_words(words, sw, G: tl.constexpr, ASM: tl.constexpr, ONE_MUL: tl.constexpr):
    """Words of group G (sw: each row's four scale bytes of the step as one word) decoded: [..., b0, b2, jp]."""
    o0, o1, o2, o3, o4, o5, o6, o7 = _words_bf16(words, (sw >> (8 * G)) & 0xFF, ASM, ONE_MUL)
    # value q = 4 b0 + 2 jp + b2: the pairs (q, q + 4) are b0's, so each bf16x2 of the decode stays one register
    return tl.join(tl.join(tl.join(o0, o4), tl.join(o1, o5)), tl.join(tl.join(o2, o6), tl.join(o3, o7)))


@triton.jit
def mxfp4_frag_tile(w_ptr, s_ptr, n, k0, N, K, BLOCK_N: tl.constexpr, ASM: tl.constexpr, ONE_MUL: tl.constexpr):
    """e2m1 pairs [N, K/2] with ue8m0 bytes [N, K/32], K % 128 == 0 -> the bf16 [BLOCK_N, 128] tile of rows n
    (BLOCK_N % 16 == 0, n consecutive) at the K step k0, its columns in the MMA's order (frag_position). ONE_MUL: every
    scale byte <= 128 (_words_bf16)."""
    row, rmask, l4, wp, KW, sw = _frag_operands(w_ptr, s_ptr, n, k0, N, K, BLOCK_N)
    f0 = _frag_group(wp, sw, row, rmask, KW, k0, l4, 0, ASM, ONE_MUL)
    f1 = _frag_group(wp, sw, row, rmask, KW, k0, l4, 1, ASM, ONE_MUL)
    f2 = _frag_group(wp, sw, row, rmask, KW, k0, l4, 2, ASM, ONE_MUL)
    f3 = _frag_group(wp, sw, row, rmask, KW, k0, l4, 3, ASM, ONE_MUL)
    return _frag_tile(f0, f1, f2, f3, BLOCK_N)


@triton.jit
def _frag_operands(w_ptr, s_ptr, n, k0, N, K, BLOCK_N: tl.constexpr):
    """The frag decodes' rows [RG, b1, R0, l4] (row 16 RG + 8 b1 + R0, l4 the quad lane), their mask, the lanes, the
    weights as words and a row's words, and each row's four scale bytes of the step as one word."""
    RG: tl.constexpr = BLOCK_N // 16
    row = tl.reshape(n, (RG, 2, 8))[:, :, :, None]
    rmask = row < N
    l4 = tl.arange(0, 4)[None, None, None, :]
    wp = tl.multiple_of(w_ptr.to(tl.pointer_type(tl.int32)), 16)
    KW = tl.multiple_of(K // 8, 16)
    # the four groups' scale bytes of the step as one word, read by each of the quad's lanes (the same address):
    # one full-shaped load keeps every operand of the decode in the layout the MMA wants
    sp = tl.multiple_of(s_ptr.to(tl.pointer_type(tl.int32)), 4)
    sw = tl.load(sp + row * tl.multiple_of(K // 128, 4) + k0 // 128 + 0 * l4, mask=rmask, other=0)
    return row, rmask, l4, wp, KW, sw.to(tl.uint32, bitcast=True)


@triton.jit
def _frag_tile(f0, f1, f2, f3, BLOCK_N: tl.constexpr):
    """The four groups' decoded words [RG, b1, R0, l4, b0, b2, jp] as the [BLOCK_N, 128] tile in the MMA's K order."""
    t = tl.join(tl.join(f0, f1), tl.join(f2, f3))  # [RG, b1, R0, l4, b0, b2, jp, g0, g1]
    t = tl.permute(t, (0, 1, 2, 8, 7, 6, 5, 3, 4))  # [RG, b1, R0, g1, g0, jp, b2, l4, b0]
    return tl.reshape(t, (BLOCK_N, 128))


# The same decode from weights arranged at load for it ("lane-major", to_lane_major): within each row's 128-wide K
# step the 16 stored words are reordered so that word l of group g sits at 4 l + g. A quad lane's four words (one
# per group) are then 16 contiguous bytes, and a row's step one load of 16 words: 16-byte cp.async copies, where the
# stored order's four loads of four words compile to 8-byte ones (Triton 3.6, sm_90: 24 of them a stage against 6).
# Nibbles keep their places inside each word, so the decode and the scales are the stored order's.
def to_lane_major(w):
    """Packed e2m1 pairs [..., K/2] (K % 128 == 0) -> the same bytes, each 128-value step's words lane-major."""
    *lead, kb = w.shape
    if kb % 64:
        raise ValueError(f"lane-major MXFP4 needs whole 128-value K steps, got K = {2 * kb}")
    steps = w.contiguous().view(*lead, kb // 64, 4, 4, 4)  # step, group g, lane l, the word's 4 bytes
    return steps.transpose(-3, -2).contiguous().view(w.shape)


@triton.jit
def mxfp4_frag16_tile(w_ptr, s_ptr, n, k0, N, K, BLOCK_N: tl.constexpr, ASM: tl.constexpr, ONE_MUL: tl.constexpr):
    """mxfp4_frag_tile's tile from lane-major weights (to_lane_major): a row's 16 words of the step in one load (each
    lane's four contiguous), split into the four groups' words, then decoded and joined as mxfp4_frag_tile does."""
    row, rmask, l4, wp, KW, sw = _frag_operands(w_ptr, s_ptr, n, k0, N, K, BLOCK_N)
    kw0 = tl.multiple_of(k0 // 8, 16)  # k0: a multiple of the 128-wide step (the analysis loses it through // 8)
    g = tl.arange(0, 4)[None, None, None, None, :]
    words = tl.load(wp + (row * KW + kw0 + 4 * l4)[:, :, :, :, None] + g, mask=rmask[:, :, :, :, None], other=0)
    words = tl.reshape(words.to(tl.uint32, bitcast=True), (BLOCK_N // 16, 2, 8, 4, 2, 2))  # group g = 2 ga + gb
    e0, e1 = tl.split(words)  # gb
    w0, w2 = tl.split(e0)  # ga
    w1, w3 = tl.split(e1)
    f0 = _frag_words(w0, sw, 0, ASM, ONE_MUL)
    f1 = _frag_words(w1, sw, 1, ASM, ONE_MUL)
    f2 = _frag_words(w2, sw, 2, ASM, ONE_MUL)
    f3 = _frag_words(w3, sw, 3, ASM, ONE_MUL)
    return _frag_tile(f0, f1, f2, f3, BLOCK_N)
