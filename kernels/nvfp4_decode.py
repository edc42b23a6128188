"""
Part two: the NVFP4 matmul at decode, and the entry point `nvfp4_matmul`, loaded by file path as
`nvfp4_kernels.nvfp4_decode.nvfp4_matmul` (01_quantize.nvfp4_kernel, and the trainer's
qerl/quant_engine.kernel_module: one copy): Hugging Face's `kernels` package has this folder's name.

Read kernels/nvfp4_matmul.py (part one) first: the format, the exact decoding and the general
kernel. This file adds what generation needs, for 16-bit x with at most 16 rows:

1. A decode kernel. At decode each weight byte serves at most 16 rows of x, so the matmul is fast
   only if the instructions spent per weight stay under what the memory bus delivers: about 3.9
   thread instructions per weight on an H200 (computed from its published 4.8 TB/s, 132 SMs and
   1.98 GHz; bench/kernel_sass.py shows the arithmetic). Part one's loop spends ~10-12 on its bf16
   tiles; this one's 3.0-3.5. Both counts are read from the sm_90 machine code by
   bench/kernel_sass.py (docs/kernel.md has the table, its command and date); no GPU has run these
   kernels yet, so no time is known.
2. Split-K inside the one launch: few weight rows still give every SM work, without a second
   kernel to add the partial sums.
3. Host-side caching. One decode step of Qwen2.5-7B calls this 196 times (7 projections x 28
   layers), so the Python around each launch counts: a weight's checks and launch settings are
   worked out at its first call and reused until any of its tensors is replaced or modified.
   `python bench/bench_kernel.py --host` measures a call's Python cost on a CPU (docs/kernel.md).
4. Autograd: dL/dx = dL/dy @ W for LoRA on top of the frozen weight, with W dequantized for the
   duration of the backward (as QLoRA does); the packed weight gets no gradient.

How the decode kernel gets to ~3 instructions per weight:

a. Decoding in 16-bit lanes with bit operations. Four packed bytes are one int32 word holding the
   codes k..k+7 (code i in bits 4i..4i+3). Codes i and i+4 sit 16 bits apart, so one rotation and
   one mask place both magnitudes (3 bits) at bits 6..8 of a bf16 lane, and a second rotation places
   both signs at bit 15: the word becomes two bf16 lanes holding e2m1 * 2**-126 (0.5 becomes the
   bf16 subnormal 2**-127). One packed bf16 multiply by the block scale times 2**119 gives
   e2m1 * scale * 2**-7, exact and normal in bf16; the 2**7 is undone with the global scale.
   (fp16 x: magnitudes at fp16 bits 9..11, e2m1 * 2**-14, times scale * 2**7: the same product.)
   On the GPU this is inline PTX (`DECODE_ASM`); the interpreter runs the same bits with tl
   operations, and tests/test_kernels.py executes the PTX text itself in an emulator against the
   reference, over every code and scale byte.
b. The block scale becomes that bf16 pair once per block of 16: for the scale bytes a checkpoint
   holds (positive normal: 0x08..0x7E) one integer multiply-add on the byte adds the exponent offset
   in both lanes at once; other bytes (zero, subnormal, negative, NaN) take an exact fp32 route,
   chosen once per weight (SCALE_FAST).
c. The weights are the *first* operand of the dot: y.T = W @ x.T. Tensor-core MMAs are 16 rows tall
   and 8 wide, so the weight on the 16-row side and the batch on the 8-wide side wastes nothing at
   M <= 8 and keeps the decoded lanes where the MMA wants them. The pairs (i, i+4) set the order of
   K inside the dot; x is permuted the same way in registers (x[k] still meets w[k]).
d. Split-K: each split writes its fp32 partial, and the last split of a tile to finish (an atomic
   counter per tile) adds them up in a fixed order, so the result is deterministic.
"""
import functools
import weakref

import torch
import triton
import triton.language as tl

from .nvfp4_matmul import (INTERPRET, check_options, check_weight, check_x, dequantize, launch_general,
                           sm_count)

# Output register j = (code j, code j + 4): rotate left by MAG_ROT[j] for the magnitudes and by
# SIGN_ROT[j] for the signs (bit 4j -> bit 6, bit 4j + 3 -> bit 15, and the same +16 in lane 1).
MAG_ROT = {"bf16": [(6 - 4 * j) % 32 for j in range(4)], "fp16": [(9 - 4 * j) % 32 for j in range(4)]}
SIGN_ROT = [(12 - 4 * j) % 32 for j in range(4)]
MAG_MASK = {"bf16": 0x01C001C0, "fp16": 0x0E000E00}
SIGN_MASK = 0x80008000
FAST_SCALE_BYTES = (0x08, 0x7E)  # positive normal E4M3: the integer route of _scale_pairs is exact


def _decode_asm(kind):
    """PTX for one word: inputs $8 (word), $9 (scale pair); outputs $0..$7 (bf16 or fp16), output
    2j is code j and output 2j+1 is code j+4. lop3 immediates: 0xC0 = a & b, 0xF8 = a | (b & c)."""
    mag_rot = MAG_ROT[kind]
    rots = sorted(set(mag_rot + SIGN_ROT) - {0})
    reg = {0: "$8", **{r: f"r{i}" for i, r in enumerate(rots)}}
    lines = ["{", f".reg .b32 r<{len(rots)}>, o, nz;", "mov.b32 nz, 0x80008000;"]
    lines += [f"shf.l.wrap.b32 r{i}, $8, $8, {r};" for i, r in enumerate(rots)]
    for j in range(4):
        lines += [f"lop3.b32 o, {reg[mag_rot[j]]}, {MAG_MASK[kind]:#010x}, 0, 0xC0;",
                  f"lop3.b32 o, o, {reg[SIGN_ROT[j]]}, {SIGN_MASK:#010x}, 0xF8;",
                  f"fma.rn.{kind.replace('fp', 'f')}x2 o, o, $9, nz;",  # + (-0.0): a plain product
                  f"mov.b32 {{${2 * j}, ${2 * j + 1}}}, o;"]
    return "\n".join(lines + ["}"])


DECODE_ASM = {kind: _decode_asm(kind) for kind in ("bf16", "fp16")}
_ASM_BF16 = tl.constexpr(DECODE_ASM["bf16"])
_ASM_FP16 = tl.constexpr(DECODE_ASM["fp16"])


# -----------------------------------------------------------------------------
# Device helpers: the interpreter's twin of DECODE_ASM, and the scale pairs


@triton.jit
def _rotl(u, n: tl.constexpr):
    if n == 0:
        return u
    else:
        return (u << n) | (u >> (32 - n))


@triton.jit
def _lane_fp32(bits, IS_F16: tl.constexpr):
    """uint32 holding a bf16/fp16 bit pattern in its low 16 bits -> fp32 value (exact)."""
    if IS_F16:
        return bits.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
    else:
        return (bits << 16).to(tl.float32, bitcast=True)  # a bf16 is the top half of an fp32


@triton.jit
def _lanes(u, mag_rot: tl.constexpr, sign_rot: tl.constexpr, scale, IS_F16: tl.constexpr):
    """The interpreter's copy of one output register of DECODE_ASM, in fp32: (code j, code j+4)."""
    if IS_F16:
        o = (_rotl(u, mag_rot) & 0x0E000E00) | (_rotl(u, sign_rot) & 0x80008000)  # two fp16 lanes
    else:
        o = (_rotl(u, mag_rot) & 0x01C001C0) | (_rotl(u, sign_rot) & 0x80008000)  # two bf16 lanes
    # Exact: e2m1 * scale has at most 6 significant bits, so the fp32 product is the 16-bit one.
    return _lane_fp32(o & 0xFFFF, IS_F16) * scale, _lane_fp32(o >> 16, IS_F16) * scale


@triton.jit
def _decode_words(w, pair, USE_ASM: tl.constexpr, IS_F16: tl.constexpr):
    """int32 words (8 codes each) and scale pairs -> (..., 8), entry q = code q // 2 + 4 * (q % 2)."""
    if USE_ASM:
        if IS_F16:
            e = tl.inline_asm_elementwise(_ASM_FP16, "=h,=h,=h,=h,=h,=h,=h,=h,r,r", [w, pair],
                                          dtype=(tl.float16,) * 8, is_pure=True, pack=1)
        else:
            e = tl.inline_asm_elementwise(_ASM_BF16, "=h,=h,=h,=h,=h,=h,=h,=h,r,r", [w, pair],
                                          dtype=(tl.bfloat16,) * 8, is_pure=True, pack=1)
        e0, e1, e2, e3, e4, e5, e6, e7 = e
    else:
        u = w.to(tl.uint32, bitcast=True)
        scale = _lane_fp32(pair.to(tl.uint32, bitcast=True) & 0xFFFF, IS_F16)  # both lanes are equal
        if IS_F16:  # rotations: MAG_ROT["fp16"][j], SIGN_ROT[j]
            e0, e1 = _lanes(u, 9, 12, scale, True)
            e2, e3 = _lanes(u, 5, 8, scale, True)
            e4, e5 = _lanes(u, 1, 4, scale, True)
            e6, e7 = _lanes(u, 29, 0, scale, True)
        else:  # MAG_ROT["bf16"][j], SIGN_ROT[j]
            e0, e1 = _lanes(u, 6, 12, scale, False)
            e2, e3 = _lanes(u, 2, 8, scale, False)
            e4, e5 = _lanes(u, 30, 4, scale, False)
            e6, e7 = _lanes(u, 26, 0, scale, False)
    # Joins stack on a new last axis, hence the bit-reversed order that makes entry q = e_q.
    return tl.join(tl.join(tl.join(e0, e4), tl.join(e2, e6)), tl.join(tl.join(e1, e5), tl.join(e3, e7)))


@triton.jit
def _scale_pairs(s, SCALE_FAST: tl.constexpr, IS_F16: tl.constexpr):
    """E4M3 scale bytes (uint8) -> int32 holding scale * 2**119 (bf16) or scale * 2**7 (fp16) in
    both 16-bit lanes."""
    if SCALE_FAST:
        # A normal positive E4M3 byte b = 0eeeemmm shifted left by 4 (bf16) or 7 (fp16) lands on the
        # exponent and mantissa bits; the constant rebiases the exponent (bf16: 7 -> 127 plus 119;
        # fp16: 7 -> 15 plus 7). Multiplying by 0x00100010 / 0x00800080 fills both lanes at once.
        if IS_F16:
            pair = s.to(tl.int32) * 0x00800080 + 0x3C003C00
        else:
            pair = s.to(tl.int32) * 0x00100010 + 0x77807780
    else:  # zero, subnormal, negative or NaN scales: the exact route through fp32
        # E4M3 bits into fp32 (bias 7 vs 127: value * 2**-120, subnormals included), no fp8 type
        # needed (sm_80 has none); 0x7F / 0xFF are NaN.
        b = s.to(tl.uint32)
        v = (((b & 0x80) << 24) | ((b & 0x7F) << 20)).to(tl.float32, bitcast=True) * 1.329227995784916e+36
        v = tl.where((b & 0x7F) == 0x7F, float("nan"), v)  # (the constant is 2**120)
        if IS_F16:
            u = (v * 128.0).to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
        else:
            u = (v * 6.646139978924579e+35).to(tl.bfloat16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
        pair = u | (u << 16)
    return pair


@triton.jit
def _round_to_bf16(v):
    """fp32 -> nearest bf16 value (ties to even), still as fp32. The interpreter's own fp32 -> bf16
    conversion truncates; the GPU's rounds, and this makes the interpreter do the same."""
    u = v.to(tl.uint32, bitcast=True)
    r = ((u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000).to(tl.float32, bitcast=True)
    return tl.where(v != v, v, r)


@triton.jit
def _decode_epilogue(acc, gs_ptr, b_ptr, y_ptr, offs_n, offs_m, N, stride_ym, y_mask,
                     HAS_BIAS: tl.constexpr, ROUND_BF16: tl.constexpr):
    # The decoded weights carry a factor 2**-7 (see a.): acc * 128 is exact, then one IEEE division.
    acc = tl.math.div_rn(acc * 128.0, tl.load(gs_ptr) + tl.zeros_like(acc))
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[:, None]  # (BN, 1)
    if ROUND_BF16:
        acc = _round_to_bf16(acc)
    tl.store(y_ptr + offs_m[None, :] * stride_ym + offs_n[:, None], acc.to(y_ptr.dtype.element_ty), mask=y_mask)


# -----------------------------------------------------------------------------
# The decode kernel


@triton.jit
def _nvfp4_decode_kernel(
    # x: [M, K] bf16, w: [N, KW] int32 (the packed bytes, 4 per word), s: [N, KW/2] uint8 scales,
    # gs: [1] fp32, b: [N] bias, y: [M, N], part: [SPLIT_K, M, N] fp32, cnt: int32 counters (zeros).
    x_ptr, w_ptr, s_ptr, gs_ptr, b_ptr, y_ptr, part_ptr, cnt_ptr,
    M, N, K, KW,
    stride_xm, stride_wn, stride_sn, stride_ym,
    HAS_BIAS: tl.constexpr, USE_ASM: tl.constexpr, SCALE_FAST: tl.constexpr, IS_F16: tl.constexpr,
    EVEN_K: tl.constexpr,  # K == K_pad and K_pad % BLOCK_K == 0: no masks in the loop
    SPLIT_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # (BN,)
    offs_m = tl.arange(0, BLOCK_M)  # (BM,) the whole batch
    # Rows past N or M are clamped onto real ones instead of masked (their results are dropped at
    # the store), so the loads in the loop need no masks.
    rows_w = tl.minimum(offs_n, N - 1)
    rows_x = tl.minimum(offs_m, M - 1)
    offs_w = tl.arange(0, BLOCK_K // 8)  # (BK/8,) words in a step
    offs_s = tl.arange(0, BLOCK_K // 16)  # (BK/16,) scale blocks in a step
    offs_k = tl.arange(0, BLOCK_K)  # (BK,)
    w_rows = w_ptr + rows_w[:, None] * stride_wn  # (BN, 1)
    s_rows = s_ptr + rows_w[:, None] * stride_sn  # (BN, 1)
    x_rows = x_ptr + rows_x[:, None] * stride_xm  # (BM, 1)

    k_steps = tl.cdiv(KW, BLOCK_K // 8)
    per_split = tl.cdiv(k_steps, SPLIT_K)
    step_lo = pid_k * per_split
    step_hi = tl.minimum(step_lo + per_split, k_steps)

    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)  # (BN, BM) = y.T tile
    for step in range(step_lo, step_hi):
        kw = step * (BLOCK_K // 8) + offs_w  # (BK/8,)
        ks = step * (BLOCK_K // 16) + offs_s  # (BK/16,)
        kx = step * BLOCK_K + offs_k  # (BK,)
        if EVEN_K:
            w = tl.load(w_rows + kw[None, :])  # (BN, BK/8) int32
            s = tl.load(s_rows + ks[None, :])  # (BN, BK/16) uint8
            x = tl.load(x_rows + kx[None, :])  # (BM, BK)
        else:  # masked lanes read code 0 (weight 0) and x = 0
            w = tl.load(w_rows + kw[None, :], mask=kw[None, :] < KW, other=0)
            s = tl.load(s_rows + ks[None, :], mask=ks[None, :] < KW // 2, other=0)
            x = tl.load(x_rows + kx[None, :], mask=kx[None, :] < K, other=0.0)
        pair = _scale_pairs(s, SCALE_FAST, IS_F16)  # (BN, BK/16)
        pair = tl.reshape(tl.broadcast_to(pair[:, :, None], (BLOCK_N, BLOCK_K // 16, 2)),
                          (BLOCK_N, BLOCK_K // 8))  # (BN, BK/8): two words per scale block
        wt = tl.reshape(_decode_words(w, pair, USE_ASM, IS_F16), (BLOCK_N, BLOCK_K))  # (BN, BK) pair order
        # x in the same order: inside each 8 columns, position 2j + l holds column j + 4l.
        x = tl.reshape(tl.permute(tl.reshape(x, (BLOCK_M, BLOCK_K // 8, 2, 4)), (0, 1, 3, 2)),
                       (BLOCK_M, BLOCK_K))  # (BM, BK)
        if USE_ASM:
            acc = tl.dot(wt, tl.trans(x), acc)  # bf16 tensor cores, fp32 accumulation
        else:  # the interpreter: fp32 dot (its bf16 dot is wrong), same products
            acc = tl.dot(wt, tl.trans(x.to(tl.float32)), acc, input_precision="ieee")

    y_mask = (offs_n[:, None] < N) & (offs_m[None, :] < M)  # (BN, BM)
    if SPLIT_K > 1:
        # Publish this split's partial; the last of the SPLIT_K programs of this tile sums them.
        part = part_ptr + offs_m[None, :] * N + offs_n[:, None]  # (BN, BM) in [.., M, N]
        tl.store(part + pid_k * M * N, acc, mask=y_mask)
        tl.debug_barrier()  # every thread's store happens before the counter's release
        arrived = tl.atomic_add(cnt_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT_K - 1:
            acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
            for split in range(SPLIT_K):  # fixed order: deterministic
                acc += tl.load(part + split * M * N, mask=y_mask, other=0.0, cache_modifier=".cg")
            tl.atomic_xchg(cnt_ptr + pid_n, 0)  # ready for the next launch
            _decode_epilogue(acc, gs_ptr, b_ptr, y_ptr, offs_n, offs_m, N, stride_ym, y_mask, HAS_BIAS,
                             not USE_ASM and not IS_F16)
    else:
        _decode_epilogue(acc, gs_ptr, b_ptr, y_ptr, offs_n, offs_m, N, stride_ym, y_mask, HAS_BIAS,
                         not USE_ASM and not IS_F16)


# -----------------------------------------------------------------------------
# Tiles and launch settings
#
# (BLOCK_N, BLOCK_K, warps, stages) per BLOCK_M (8 covers M <= 8, 16 covers M <= 16; 16 is the
# smallest M tl.dot accepts, and the MMA's 8-wide side serves M <= 8), best first. Chosen by their
# SASS (bench/kernel_sass.py): no spills and the fewest instructions per weight, which come with many
# weight rows per warp (x's permutation is shared by more weights). The wide tile is used when the
# weight has enough rows to keep every SM busy. Not timed: no GPU has run them.
DECODE_TILES = {8: [(128, 256, 2, 4), (64, 256, 2, 4)], 16: [(128, 256, 2, 3), (64, 256, 2, 3)]}
INTERPRETER_DECODE_TILES = (64, 256)  # (BLOCK_N, BLOCK_K)


def use_decode(x2, block_sizes):
    """16-bit x with at most 16 rows (or block_sizes asking for the decode kernel's BLOCK_M <= 16)."""
    if x2.dtype == torch.float32:
        return False
    return x2.shape[0] <= (16 if block_sizes is None else min(block_sizes[0], 16))


@functools.lru_cache(maxsize=None)
def _decode_plan(m, n, kw, k, device_type, device_index, block_sizes, split_k):
    """(BLOCK_M, BLOCK_N, BLOCK_K, warps, stages, SPLIT_K, EVEN_K, grid), once per problem shape."""
    on_gpu = device_type == "cuda" and not INTERPRET
    target = 4 * sm_count(device_index or 0) if on_gpu else 1  # a few small programs per SM
    if block_sizes is not None:
        bm, bn, bk = block_sizes
        warps, stages = 4, 3
    elif not on_gpu:
        bm, (bn, bk), warps, stages = 16, INTERPRETER_DECODE_TILES, 4, 1
    else:
        bm = 8 if m <= 8 else 16
        for bn, bk, warps, stages in DECODE_TILES[bm]:  # the widest tile that can reach the target
            if triton.cdiv(n, bn) * max(1, triton.cdiv(kw, bk // 8) // 2) >= target:
                break
    n_tiles, k_steps = triton.cdiv(n, bn), triton.cdiv(kw, bk // 8)
    if split_k is None:
        # Enough programs to reach the target, each split keeping at least two K steps. A rule of
        # thumb, not tuned: `split_k=` overrides it.
        split_k = 1
        while n_tiles * split_k < target and k_steps >= 4 * split_k:
            split_k *= 2
    even_k = k == 8 * kw and kw % (bk // 8) == 0
    return bm, bn, bk, warps, stages, split_k, even_k, (n_tiles, split_k)


_SPLIT_BUFFERS = {}  # device -> (partials fp32, counters int32): reused, counters reset by the kernel


def _split_buffers(device, numel, n_tiles):
    part, cnt = _SPLIT_BUFFERS.get(device, (None, None))
    if part is None or part.numel() < numel:
        part = torch.empty(max(numel, 1 << 20), dtype=torch.float32, device=device)
    if cnt is None or cnt.numel() < n_tiles:
        cnt = torch.zeros(max(n_tiles, 4096), dtype=torch.int32, device=device)
    _SPLIT_BUFFERS[device] = (part, cnt)
    return part, cnt


def _decode_launch(m, k, dtype, device, info, block_sizes, split_k):
    """Everything launch_decode passes besides x and y: worked out once per weight and shape."""
    kw = info.kb // 4
    bm, bn, bk, warps, stages, split, even_k, grid = _decode_plan(
        m, info.n, kw, k, device.type, device.index, block_sizes, split_k)
    part, cnt = _split_buffers(device, split * m * info.n, grid[0]) if split > 1 else (info.gs, info.gs)
    bias = info.bias
    mid = (info.words(), info.scale_u8, info.gs, bias if bias is not None else info.gs)
    tail = (part, cnt, m, info.n, k, kw, k, kw, info.scale_u8.stride(0), info.n)  # x, y contiguous
    flags = dict(HAS_BIAS=bias is not None, USE_ASM=not INTERPRET, SCALE_FAST=info.scale_fast(),
                 IS_F16=dtype == torch.float16, EVEN_K=even_k, SPLIT_K=split,
                 BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, num_stages=stages)
    return grid, mid, tail, flags


def launch_decode(x2, info, block_sizes, split_k):
    """y [M, N] for a contiguous, checked x2 [M, K] (M <= 16, bf16/fp16) and a _WeightInfo."""
    m, k = x2.shape
    key = (m, k, x2.dtype, block_sizes, split_k)
    launch = info.launches.get(key)
    if launch is None:
        launch = info.launches[key] = _decode_launch(m, k, x2.dtype, x2.device, info, block_sizes, split_k)
    grid, mid, tail, flags = launch
    y = torch.empty((m, info.n), dtype=x2.dtype, device=x2.device)  # (M, N)
    _nvfp4_decode_kernel[grid](x2, *mid, y, *tail, **flags)
    return y


# -----------------------------------------------------------------------------
# The per-weight cache: a weight's checks and launch settings, worked out at its first call


class _WeightInfo:
    """What a weight needs at every call: checks passed, contiguous copies (made once, only if
    needed), the packed bytes as int32 words, and whether its scale bytes all take the fast route.
    Stale as soon as any of its tensors is replaced or modified."""

    def __init__(self, packed, scale, global_scale, bias):
        check_weight(packed, scale, global_scale, bias)
        self.key = _weight_key(packed, scale, global_scale, bias)
        self.device = packed.device
        self.n, self.kb = packed.shape
        # Views, not packed itself: the cache entry must not keep the tensor alive.
        self.packed = packed.contiguous().view(torch.uint8)
        self.scale_u8 = scale.contiguous().view(torch.uint8)  # the kernels reinterpret the bytes
        self.gs = global_scale.reshape(1)
        self.bias = bias.contiguous() if bias is not None else None
        self._words = self._scale_fast = None
        self.launches = {}  # (M, K, dtype, block_sizes, split_k) -> the decode kernel's arguments

    def words(self):  # [N, K_pad/8] int32: four packed bytes per word, same memory when aligned
        if self._words is None:
            p = self.packed if self.packed.data_ptr() % 4 == 0 else self.packed.clone()
            self._words = p.view(torch.int32)
        return self._words

    def scale_fast(self):  # one reduction (and one GPU sync) per weight, not per call
        if self._scale_fast is None:
            lo, hi = FAST_SCALE_BYTES
            self._scale_fast = bool(((self.scale_u8 >= lo) & (self.scale_u8 <= hi)).all())
        return self._scale_fast


def _weight_key(packed, scale, global_scale, bias):
    """The tensors (by identity) and their in-place version counters (load_state_dict bumps them)."""
    v = lambda t: getattr(t, "_version", None)  # noqa: E731 (bad inputs reach the checks)
    return (v(packed), scale, v(scale), global_scale, v(global_scale), bias, v(bias))


def _same_key(a, b):
    return all(u is v or (type(u) is int and u == v) for u, v in zip(a, b))


# id(packed) -> (weak reference to packed, _WeightInfo). Not an attribute of the tensor, which
# deepcopy or pickle would carry along; the entry goes when the tensor does.
_WEIGHTS = {}


def _cached_info(packed):
    entry = _WEIGHTS.get(id(packed))
    return entry[1] if entry is not None and entry[0]() is packed else None


def _weight_info(packed, scale, global_scale, bias):
    info = _cached_info(packed)
    if info is None or not _same_key(info.key, _weight_key(packed, scale, global_scale, bias)):
        info = _WeightInfo(packed, scale, global_scale, bias)  # checks first: packed is a tensor
        key = id(packed)
        _WEIGHTS[key] = (weakref.ref(packed, lambda _, key=key: _WEIGHTS.pop(key, None)), info)
    return info


# -----------------------------------------------------------------------------
# The entry point


def _launch(x2, info, block_sizes, split_k):
    """Run the kernel that fits x2 [M, K] (inputs already checked). Returns y [M, N]."""
    x2 = x2.contiguous()  # unit stride along K (a no-op for contiguous x)
    if use_decode(x2, block_sizes):
        return launch_decode(x2, info, block_sizes, split_k)
    return launch_general(x2, info.packed, info.scale_u8, info.gs, info.bias, block_sizes, split_k)


class _NVFP4Matmul(torch.autograd.Function):
    """dL/dx = dL/dy @ W (and dL/dbias), with W dequantized for the duration of the backward."""

    @staticmethod
    def forward(ctx, x2, packed, scale, global_scale, bias, info, block_sizes, split_k):
        ctx.save_for_backward(packed, scale, global_scale)
        ctx.has_bias = bias is not None
        ctx.k = x2.shape[1]
        return _launch(x2, info, block_sizes, split_k)

    @staticmethod
    def backward(ctx, grad_y):  # grad_y: (M, N)
        packed, scale, global_scale = ctx.saved_tensors
        grad_x = grad_bias = None
        if ctx.needs_input_grad[0]:
            w = dequantize(packed, scale, global_scale, ctx.k, grad_y.dtype)  # (N, K)
            grad_x = grad_y @ w  # (M, K)
        if ctx.has_bias and ctx.needs_input_grad[4]:
            grad_bias = grad_y.sum(dim=0)
        return grad_x, None, None, None, grad_bias, None, None, None


def nvfp4_matmul(x, packed, scale, global_scale, bias=None, *, block_sizes=None, split_k=None):
    """y = x @ W.T + bias with W stored as NVFP4, dequantized on the fly.

    x: [..., K] float32/bfloat16/float16; K may be the unpadded in_features (K <= K_pad < K + 16).
    packed: uint8 [N, K_pad/2], element 2j in the low nibble of byte j.
    scale: float8_e4m3fn [N, K_pad/16]. global_scale: float32 [1] (W = e2m1 * scale / global_scale).
    bias: [N] or None. Returns y [..., N] in x.dtype, accumulated in fp32. Differentiable with
    respect to x and bias.

    16-bit x with at most 16 rows (decode) runs the decode kernel above, everything else part one's
    general kernel. block_sizes=(BLOCK_M, BLOCK_N, BLOCK_K) and split_k are for tests and
    experiments: by default the decode kernel takes fixed tiles, the general one autotunes on GPU,
    split_k follows a rule of thumb, and the interpreter uses big tiles. The weight's checks and
    launch settings are worked out at its first call and cached: later calls only check x.
    """
    info = _weight_info(packed, scale, global_scale, bias)
    check_x(x, info.kb, info.device)
    block_sizes = check_options(block_sizes, split_k)
    n, k = info.n, x.shape[-1]
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)  # (M, K)
    if x2.shape[0] == 0 or n == 0:
        return x.new_zeros(*lead, n)
    if torch.is_grad_enabled() and (x.requires_grad or (bias is not None and bias.requires_grad)):
        y = _NVFP4Matmul.apply(x2, packed, scale, global_scale, bias, info, block_sizes, split_k)
    else:
        y = _launch(x2, info, block_sizes, split_k)
    return y.reshape(*lead, n)  # (..., N)
