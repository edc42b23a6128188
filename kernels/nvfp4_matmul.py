"""
A fused NVFP4 weight-only matmul (W4A16) in Triton: y = x @ dequant(W).T + bias.

The idea. An NVFP4 weight stores each element as a 4-bit E2M1 float (one of +-{0, .5, 1, 1.5, 2, 3,
4, 6}), two per byte, plus one FP8 E4M3 scale per block of 16 consecutive inputs and one fp32 global
scale per tensor:

    W[n, k] = e2m1(code[n, k]) * fp32(scale[n, k // 16]) / global_scale

That is 4.5 bits per weight instead of 16 for bf16. Activations stay in 16 bits ("A16"), so the
multiply itself is an ordinary bf16/fp16 (or fp32) matmul; the 4 bits only live in memory.

Why fuse the dequantization into the matmul. When a model generates text it runs one token per
sequence per step, so x has only a handful of rows (M <= 16, "decode"). Each weight byte is then
used for a few multiply-adds only, and the matmul is limited by how fast the weight streams from
GPU memory, not by arithmetic. Dequantizing to a bf16 tensor first and calling torch.matmul would
write and re-read 16 bits per weight: more traffic than the bf16 model we started from. This kernel
instead loads the packed bytes and the scales tile by tile, decodes them in registers, and feeds the
decoded tile straight to `tl.dot`, so the weight crosses the memory bus at 4.5 bits per element:
up to ~3.5x less traffic than bf16 at decode. For long prompts ("prefill", M in the thousands) the
matmul is compute-bound and the decode work is amortised over the rows of the tile.

Three choices worth knowing before reading the code:

1. Exact decoding with one bit trick. E2M1 and E4M3 are tiny floats, and fp16 (5 exponent bits, 10
   mantissa bits) contains both. Copying a small float's exponent and mantissa bits into the top of
   fp16's exponent and mantissa fields gives the right value times a power of two (the difference of
   the exponent biases), and the small float's subnormals land on fp16 subnormals, so they decode
   right too. For E2M1: `(sign << 15) | (magnitude << 9)` read as fp16, times 2**14. For the E4M3
   scales we use Triton's native fp8 type where the GPU has one (sm_89+) and the same trick,
   `(byte & 0x7F) << 7` times 2**8, on older GPUs.

2. The global scale is applied once, at the end. `e2m1 * e4m3` has at most 6 significant bits and
   lies in [2**-10, 2688], so it is exact in fp16 and in bf16: the tile we hand to `tl.dot` carries
   no rounding error at all, and the division by the global scale happens once per output element
   on the fp32 accumulator (sum_k x_k * w_k / g == (sum_k x_k * w_k) / g).

3. "Two half-dots" instead of interleaving. Byte j of a row holds elements 2j (low nibble) and
   2j + 1 (high nibble). Rather than decoding both nibbles and interleaving them back into one
   [BLOCK_K, BLOCK_N] tile (a register shuffle that Triton may route through shared memory), we
   split the *activations* instead: x[:, 0::2] meets the low nibbles and x[:, 1::2] the high ones,
   and the two products add up to the full one:

       x @ W.T  ==  x[:, 0::2] @ W[:, 0::2].T  +  x[:, 1::2] @ W[:, 1::2].T

   Both elements of a byte share a scale (16 is even), so one scale tile serves both halves. x is
   loaded as one contiguous tile and split into its even and odd columns in registers
   (`tl.reshape` to [BLOCK_M, BLOCK_K/2, 2], then `tl.split`), so its loads stay vectorized.

Two kernels. The general one below (any M, any x dtype) decodes in fp32 and costs ~11 thread
instructions per weight on Hopper: fine for prefill, where a decoded tile serves 64-128 rows of x,
but at decode (M <= 16) it would be bound by instruction issue, not memory. 16-bit x with at most 16
rows therefore takes the decode kernel further down, which decodes with bit operations straight
into 16-bit lanes (3.0-3.5 instructions per weight, under the ~3.9 that keep an H200's memory bus
busy; `python bench/kernel_sass.py` counts them from the machine code) and sums its split-K partials
inside the same launch. The general kernel's own split-K (fp32 x) writes fp32 partials that the
wrapper adds with torch (deterministic, unlike atomic adds).

Training LoRA on top of the frozen weight needs dL/dx = dL/dy @ W. The wrapper is an autograd
function whose backward dequantizes W with plain torch for the duration of the backward (as QLoRA
does); the packed weight gets no gradient.

The same code runs on CPU tensors under Triton's interpreter (TRITON_INTERPRET=1, set before triton
is imported), which is how the tests check it without a GPU. Two interpreter quirks shape the code:
a `tl.dot` on bf16 operands returns garbage there, so bf16 is upcast to fp32 before the dot; and
every program x K-step costs milliseconds, so the interpreter uses one large fixed tile instead of
the autotuned GPU configurations.

Run the tests (CPU, interpreter), the machine-code count (CPU) and the benchmark (GPU):
    python -m pytest -q tests/test_kernels.py
    python bench/kernel_sass.py
    python bench/bench_kernel.py
"""
import functools
import os
import weakref

import torch
import triton
import triton.language as tl

# Triton reads TRITON_INTERPRET when `triton` is imported (it decides how @triton.jit compiles),
# so reading it once here matches what the decorators below will do.
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
# QERL_NVFP4_TILES="64,64,64": fixed tiles for the general kernel instead of autotuning (the GPU
# test run sets it, so that each test shape does not benchmark every configuration).
FIXED_TILES = tuple(int(v) for v in os.environ["QERL_NVFP4_TILES"].split(",")) \
    if os.environ.get("QERL_NVFP4_TILES") else None


# -----------------------------------------------------------------------------
# Decoding the two small float formats (device helpers)


@triton.jit
def _e2m1_to_fp32(code):
    """E2M1 code (int32, 0..15; bit 3 = sign, bits 0..2 = exponent:mantissa) -> fp32 value.

    The 3 magnitude bits go to fp16 bits 9..11 (two lowest exponent bits + top mantissa bit) and the
    sign to bit 15. Read as fp16 that is value * 2**-14 (fp16's bias is 15, E2M1's is 1); magnitude 1
    becomes the fp16 subnormal 2**-15, i.e. 0.5 after rescaling. All eight magnitudes come out exact.
    """
    bits = ((code & 0x8) << 12) | ((code & 0x7) << 9)
    # fp16 -> fp32 is exact (fp16 subnormals are fp32 normals), then rescale by 2**(15 - 1).
    return bits.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32) * 16384.0


@triton.jit
def _e4m3_to_fp32(byte, FP8_NATIVE: tl.constexpr):
    """FP8 E4M3 (fn variant) byte (uint8) -> fp32 value."""
    if FP8_NATIVE:
        # sm_89+ GPUs and the interpreter know the type: reinterpret the byte and convert.
        value = byte.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    else:
        # Older GPUs: the same trick as E2M1. 4 exponent + 3 mantissa bits go to fp16 bits 7..13,
        # fp16 bias 15 vs E4M3 bias 7 -> times 2**8. (The NaN code 0x7F would decode as 480; valid
        # checkpoints never contain it.)
        b = byte.to(tl.int32)
        bits = ((b & 0x80) << 8) | ((b & 0x7F) << 7)
        value = bits.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32) * 256.0
    return value


# -----------------------------------------------------------------------------
# The kernel
#
# Each program computes one [BLOCK_M, BLOCK_N] tile of y over one of SPLIT_K ranges of the K axis.
# Weights are row-major like nn.Linear's ([N, K_pad/2] bytes), and we load them *transposed*, as
# [BLOCK_K/2, BLOCK_N] tiles whose contiguous axis is K, because that is the [K, N] shape tl.dot
# wants for its second operand.


@triton.jit
def _nvfp4_matmul_kernel(
    # Pointers. x: [M, K] (fp32/bf16/fp16), w: [N, KB] uint8 codes, s: [N, KB/8] fp8 scales viewed as
    # uint8, gs: [1] fp32 global scale, b: [N] bias (unused unless HAS_BIAS), y: [SPLIT_K?, M, N].
    x_ptr, w_ptr, s_ptr, gs_ptr, b_ptr, y_ptr,
    # Problem sizes. K is x's (possibly unpadded) width; KB = K_pad / 2 is the packed width.
    M, N, K, KB,
    # Row strides. Every tensor is contiguous along K (the wrapper makes it so), which lets the
    # compiler see unit strides along K and vectorize those loads.
    stride_xm, stride_wn, stride_sn, stride_ym, stride_ysplit,
    # Only read by the autotuner: a coarse M so that every prompt length does not retune.
    M_BUCKET,
    # Compile-time switches.
    HAS_BIAS: tl.constexpr,
    DOT_FP32: tl.constexpr,  # run the dot on fp32 operands (fp32 x, or bf16 x in the interpreter)
    FP8_NATIVE: tl.constexpr,  # decode the scales with tl.float8e4nv (sm_89+) or with bit arithmetic
    SPLIT_K: tl.constexpr,
    # Tile sizes (autotuned on GPU). BLOCK_K counts unpacked elements, so a K step reads BLOCK_K/2
    # bytes per weight row; it must be >= 32 so that each half-dot has the 16-deep K tl.dot needs.
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    # --- Which tile. Programs are grouped GROUP_M tiles tall, so that programs running at the same
    # time share weight columns and activation rows in L2 (it matters for prefill; at decode there is
    # a single row of tiles and this is the identity).
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    tiles_per_group = GROUP_M * num_pid_n
    first_pid_m = (pid // tiles_per_group) * GROUP_M
    group_rows = tl.minimum(num_pid_m - first_pid_m, GROUP_M)
    pid_m = first_pid_m + (pid % tiles_per_group) % group_rows
    pid_n = (pid % tiles_per_group) // group_rows

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # (BM,)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # (BN,)
    offs_j = tl.arange(0, BLOCK_K // 2)  # (BK/2,) byte index inside a K step
    m_ok = offs_m < M
    n_ok = offs_n < N
    # Row offsets in int64: M * K passes 2**31 for long prefills (131072 tokens x 18944 inputs).
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm  # (BM, 1) row starts of x

    # --- Which K steps. Split s runs steps [s * per_split, (s + 1) * per_split); the last split may
    # get fewer (or none: it then writes zeros, which is what its partial sum is).
    k_steps = tl.cdiv(K, BLOCK_K)
    per_split = tl.cdiv(k_steps, SPLIT_K)
    step_lo = pid_k * per_split
    step_hi = tl.minimum(step_lo + per_split, k_steps)

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)  # (BM, BN)
    for step in range(step_lo, step_hi):
        kb = step * (BLOCK_K // 2) + offs_j  # (BK/2,) byte column = element pair (2kb, 2kb+1)

        # Activations: one contiguous tile (vectorized, pipelined loads), then split into even and
        # odd columns in registers. Columns >= K (x's unpadded tail) load as zero, so the padded
        # weight columns never contribute, whatever finite values they hold.
        offs_k = step * BLOCK_K + tl.arange(0, BLOCK_K)  # (BK,)
        x = tl.load(x_rows + offs_k[None, :], mask=m_ok[:, None] & (offs_k[None, :] < K),
                    other=0.0)  # (BM, BK)
        x_even, x_odd = tl.split(tl.reshape(x, (BLOCK_M, BLOCK_K // 2, 2)))  # 2 x (BM, BK/2)

        # Packed codes and their scales, loaded transposed: [K, N] for the dot. The mask keeps the
        # last K step inside the tensor; masked lanes read code 0 / scale 0, i.e. weight 0.
        w_mask = (kb[:, None] < KB) & n_ok[None, :]  # (BK/2, BN)
        q = tl.load(w_ptr + offs_n[None, :] * stride_wn + kb[:, None],
                    mask=w_mask, other=0).to(tl.int32)  # (BK/2, BN) one byte = two codes
        # One scale per 16 elements = per 8 bytes: load the step's BK/16 scales of each row, decode
        # them, then repeat each 8 times along K (broadcast + reshape stay in registers) so that
        # byte kb meets scale kb // 8. KB // 8 = K_pad / 16 is the number of scale blocks per row.
        blk = step * (BLOCK_K // 16) + tl.arange(0, BLOCK_K // 16)  # (BK/16,)
        s_raw = tl.load(s_ptr + offs_n[None, :] * stride_sn + blk[:, None],
                        mask=(blk[:, None] < KB // 8) & n_ok[None, :], other=0)  # (BK/16, BN) uint8
        s = _e4m3_to_fp32(s_raw, FP8_NATIVE)  # (BK/16, BN)
        s = tl.broadcast_to(s[:, None, :], (BLOCK_K // 16, 8, BLOCK_N))  # (BK/16, 8, BN)
        s = tl.reshape(s, (BLOCK_K // 2, BLOCK_N))  # (BK/2, BN) row kb holds scale kb // 8

        # Decoded weights times block scale, still without the global scale: exact in fp16/bf16.
        w_even = _e2m1_to_fp32(q & 0xF) * s  # (BK/2, BN) low nibbles = even columns
        w_odd = _e2m1_to_fp32(q >> 4) * s  # (BK/2, BN) high nibbles = odd columns

        if DOT_FP32:
            # fp32 activations: ask for a true fp32 product (the GPU default would be tf32, which
            # rounds x to 10 mantissa bits). In the interpreter this also covers bf16 x.
            acc = tl.dot(x_even.to(tl.float32), w_even, acc, input_precision="ieee")
            acc = tl.dot(x_odd.to(tl.float32), w_odd, acc, input_precision="ieee")
        else:
            # bf16/fp16 activations: tensor-core dot on 16-bit operands, fp32 accumulation. The
            # cast of the weights is exact (see the module docstring).
            acc = tl.dot(x_even, w_even.to(x_even.dtype), acc)
            acc = tl.dot(x_odd, w_odd.to(x_odd.dtype), acc)

    # --- Epilogue: the global scale once per output element, bias (first split only), store.
    # div_rn is IEEE division (plain `/` may be approximate on GPU), so that an identity x
    # reproduces the reference dequantization bit for bit.
    acc = tl.math.div_rn(acc, tl.load(gs_ptr) + tl.zeros_like(acc))
    if HAS_BIAS:
        if pid_k == 0:  # with split-K the partial sums are added up: only one of them gets the bias
            bias = tl.load(b_ptr + offs_n, mask=n_ok, other=0.0)  # (BN,)
            acc += bias.to(tl.float32)[None, :]
    y_ptrs = y_ptr + pid_k * stride_ysplit + offs_m.to(tl.int64)[:, None] * stride_ym + offs_n[None, :]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


# -----------------------------------------------------------------------------
# The decode kernel (bf16 or fp16 x, M <= 16): the weight streams at memory speed
#
# At decode every weight byte is used by at most 16 rows of x, so the kernel is fast only if the
# instructions it spends per weight stay below what the memory bus delivers: on an H200 about 3.9
# thread instructions per weight (bench/kernel_sass.py counts them in the compiled loop). The
# general kernel above spends ~11. This one spends 3.0-3.5, by four changes:
#
# 1. Decoding in 16-bit lanes with bit operations. Four packed bytes are one int32 word holding the
#    codes k..k+7 (code i in bits 4i..4i+3). Codes i and i+4 sit 16 bits apart, so one rotation and
#    one mask place both magnitudes (3 bits) at bits 6..8 of a bf16 lane, and a second rotation
#    places both signs at bit 15: the word becomes two bf16 lanes holding e2m1 * 2**-126 (0.5
#    becomes the bf16 subnormal 2**-127). One packed bf16 multiply by the block scale times 2**119
#    gives e2m1 * scale * 2**-7, exact and normal in bf16; the 2**7 is undone with the global scale.
#    (fp16 x: magnitudes at fp16 bits 9..11, e2m1 * 2**-14, times scale * 2**7: the same product.)
#    On the GPU this is inline PTX (`DECODE_ASM`, ~2.4 instructions per weight); the interpreter
#    runs the same bits with tl operations, and tests/test_kernels.py checks the PTX text itself,
#    emulated instruction by instruction, against the reference over every code and scale byte.
# 2. The block scale becomes that bf16 pair once per block of 16: for the scale bytes a checkpoint
#    holds (normal, positive: 0x08..0x7E) it is one integer multiply-add on the byte, which adds
#    the exponent offset in both lanes at once; other bytes (zero, subnormal, negative, NaN) take an
#    exact fp32 route, chosen once per weight (SCALE_FAST).
# 3. The weights are the *first* operand of the dot: y.T = W @ x.T. Tensor cores are 16 rows tall
#    and 8 wide, so putting the weight on the 16-row side and the batch on the 8-wide side wastes
#    nothing at M <= 8 and keeps the decoded lanes where the MMA wants them (no register moves).
#    The pairs (i, i+4) define the order of K inside the dot; x is permuted the same way in
#    registers (x[k] meets w[k] whatever the order of the sum).
# 4. Split-K without extra launches: each split writes its fp32 partial, and the last split of a
#    tile to finish (an atomic counter per tile) adds them up in a fixed order, deterministic.

# Output register j = (code j, code j + 4): rotate left by MAG_ROT[j] for the magnitudes and by
# SIGN_ROT[j] for the signs (bit 4j -> bit 6, bit 4j + 3 -> bit 15, and the same +16 in lane 1).
# fp16 x works the same way with the magnitude at fp16 bits 9..11 (e2m1 * 2**-14, scale * 2**7).
MAG_ROT = {"bf16": [(6 - 4 * j) % 32 for j in range(4)], "fp16": [(9 - 4 * j) % 32 for j in range(4)]}
SIGN_ROT = [(12 - 4 * j) % 32 for j in range(4)]
MAG_MASK = {"bf16": 0x01C001C0, "fp16": 0x0E000E00}
SIGN_MASK = 0x80008000
FAST_SCALE_BYTES = (0x08, 0x7E)  # positive normal E4M3: the integer route below is exact


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
    # The decoded weights carry a factor 2**-7 (see above): acc * 128 is exact, then one IEEE division.
    acc = tl.math.div_rn(acc * 128.0, tl.load(gs_ptr) + tl.zeros_like(acc))
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[:, None]  # (BN, 1)
    if ROUND_BF16:
        acc = _round_to_bf16(acc)
    tl.store(y_ptr + offs_m[None, :] * stride_ym + offs_n[:, None], acc.to(y_ptr.dtype.element_ty), mask=y_mask)


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
        else:  # the interpreter: fp32 dot (its bf16 dot is broken), same products
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
# Tile configurations
#
# Decode (M <= 16): one 16-row tile covers the whole batch (16 is the smallest M tl.dot accepts), so
# the only question is how to cut the weight: narrow N tiles give more programs to spread over the
# SMs, long K tiles give each program more bytes in flight. Prefill: classic square-ish tiles.
# These are starting points, not the result of a sweep; the autotuner picks per (M bucket, N, K).


def _config(bm, bn, bk, warps, stages):
    return triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk}, num_warps=warps,
                         num_stages=stages)


CUDA_CONFIGS = [
    # M <= 16 with fp32 x (16-bit x takes the decode kernel)
    _config(16, 32, 256, 4, 4),
    _config(16, 64, 256, 8, 3),
    _config(16, 64, 128, 4, 4),
    # small batches
    _config(32, 64, 128, 4, 4),
    _config(64, 64, 128, 4, 3),
    # prefill
    _config(64, 128, 128, 4, 3),
    _config(128, 64, 128, 4, 3),
    _config(128, 128, 64, 8, 3),
    _config(128, 256, 64, 8, 3),
]

# The decode kernel: (BLOCK_N, BLOCK_K, warps, stages) per BLOCK_M (8 covers M <= 8, 16 covers
# M <= 16), best first. Chosen by their SASS (bench/kernel_sass.py): no spills, the fewest
# instructions per weight, which come with many weight rows per warp (x's permutation is shared by
# more weights). The wide tile is used when the weight has enough rows to keep every SM busy.
DECODE_TILES = {8: [(128, 256, 2, 4), (64, 256, 2, 4)], 16: [(128, 256, 2, 3), (64, 256, 2, 3)]}
INTERPRETER_DECODE_TILES = (64, 256)  # (BLOCK_N, BLOCK_K)

# The interpreter: one big tile, so that the tests' problems take one or two programs and steps.
INTERPRETER_TILES = (64, 128, 256)


def _prune_configs(configs, named_args, **kwargs):
    """Benchmark only the configurations whose BLOCK_M fits the batch: 16 rows for decode."""
    m_bucket = {**named_args, **kwargs}["M_BUCKET"]
    if m_bucket <= 16:
        keep = [c for c in configs if c.kwargs["BLOCK_M"] == 16]
    elif m_bucket <= 64:
        keep = [c for c in configs if c.kwargs["BLOCK_M"] <= 64]
    else:
        keep = [c for c in configs if c.kwargs["BLOCK_M"] >= 64]
    return keep or configs


_nvfp4_matmul_autotuned = triton.autotune(
    configs=CUDA_CONFIGS,
    key=["M_BUCKET", "N", "K", "SPLIT_K", "HAS_BIAS"],
    prune_configs_by={"early_config_prune": _prune_configs},
)(_nvfp4_matmul_kernel)


def _m_bucket(m):
    """16 for decode, then powers of two up to 4096: the autotuner retunes per bucket, not per M."""
    return 16 if m <= 16 else min(triton.next_power_of_2(m), 4096)


@functools.lru_cache(maxsize=None)
def _sm_count(device_index):
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _default_split_k(m, n, k, device):
    """Split K when a decode-sized problem has fewer 32-wide N tiles than the GPU has SMs.

    Each split must keep at least 512 columns (a couple of K steps) so that it still streams.
    An untuned rule of thumb: `split_k=` overrides it.
    """
    if device.type != "cuda" or INTERPRET or m > 16:
        return 1
    n_tiles = triton.cdiv(n, 32)
    split = 1
    while n_tiles * split < _sm_count(device.index or 0) and k // (2 * split) >= 512:
        split *= 2
    return split


def _fp8_native(device):
    """Can Triton use tl.float8e4nv here? The interpreter can; CUDA GPUs from sm_89 (Ada, Hopper)."""
    if device.type != "cuda" or INTERPRET:
        return True
    return torch.cuda.get_device_capability(device) >= (8, 9)


# -----------------------------------------------------------------------------
# The Python wrapper: check, allocate, launch


def _check_weight(packed, scale, global_scale, bias):
    """The weight tensors' checks (run once per weight, see _weight_info)."""
    for name, t in (("packed", packed), ("scale", scale), ("global_scale", global_scale), ("bias", bias)):
        if not isinstance(t, torch.Tensor) and not (name == "bias" and t is None):
            raise ValueError(f"nvfp4_matmul: {name} must be a torch.Tensor, got {type(t).__name__}")
    if packed.dtype != torch.uint8 or packed.dim() != 2:
        raise ValueError(f"nvfp4_matmul: packed must be a 2-D uint8 tensor [N, K_pad/2], got "
                         f"{packed.dtype} {tuple(packed.shape)}")
    n, kb = packed.shape
    k_pad = 2 * kb
    if k_pad % 16 != 0:
        raise ValueError(f"nvfp4_matmul: packed has {kb} bytes per row, i.e. K_pad={k_pad} elements; "
                         f"K_pad must be a multiple of 16 (the NVFP4 block size)")
    if scale.dtype != torch.float8_e4m3fn or tuple(scale.shape) != (n, k_pad // 16):
        raise ValueError(f"nvfp4_matmul: scale must be float8_e4m3fn of shape [N, K_pad/16] = "
                         f"[{n}, {k_pad // 16}], got {scale.dtype} {tuple(scale.shape)}")
    if global_scale.dtype != torch.float32 or global_scale.numel() != 1:
        raise ValueError(f"nvfp4_matmul: global_scale must be a float32 tensor with one element, got "
                         f"{global_scale.dtype} of shape {tuple(global_scale.shape)}")
    if bias is not None and (bias.dim() != 1 or bias.shape[0] != n or not bias.is_floating_point()):
        raise ValueError(f"nvfp4_matmul: bias must be a 1-D float tensor of size N={n}, got "
                         f"{bias.dtype} {tuple(bias.shape)}")
    devices = {t.device for t in (packed, scale, global_scale) + (() if bias is None else (bias,))}
    if len(devices) != 1:
        raise ValueError(f"nvfp4_matmul: all tensors must be on one device, got {sorted(map(str, devices))}")


class _WeightInfo:
    """What a weight needs at every call, worked out at its first: checks passed, contiguous
    copies (made once, only if needed), the packed bytes as int32 words, and whether its scale
    bytes all take the fast route. Stale as soon as any of its tensors is replaced or modified."""

    def __init__(self, packed, scale, global_scale, bias):
        _check_weight(packed, scale, global_scale, bias)
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
    v = lambda t: getattr(t, "_version", None)  # noqa: E731 (bad inputs reach the checks)
    return (v(packed), scale, v(scale), global_scale, v(global_scale), bias, v(bias))


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


def _same_key(a, b):
    return all(u is v or (type(u) is int and u == v) for u, v in zip(a, b))


_X_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _check_x(x, info):
    if not isinstance(x, torch.Tensor) or x.dtype not in _X_DTYPES:
        got = x.dtype if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"nvfp4_matmul: x must be a float32, bfloat16 or float16 tensor, got {got}")
    if x.dim() < 1 or x.shape[-1] < 1:
        raise ValueError(f"nvfp4_matmul: x must have shape [..., K] with K >= 1, got {tuple(x.shape)}")
    k, k_pad = x.shape[-1], 2 * info.kb
    # The weight's input dim was zero-padded to the next multiple of 16; x may carry the true width
    # (its missing tail counts as zero) but nothing else: a wider or much narrower x is a mix-up.
    if not (k_pad - 16 < k <= k_pad):
        raise ValueError(f"nvfp4_matmul: x has K={k} features but the weight holds K_pad={k_pad} "
                         f"(packed.shape[1]={info.kb}); expected K_pad == K rounded up to a multiple of 16")
    if x.device != info.device:
        raise ValueError(f"nvfp4_matmul: all tensors must be on one device, got x on {x.device} and "
                         f"the weight on {info.device}")
    if x.device.type == "cpu" and not INTERPRET:
        raise ValueError("nvfp4_matmul: CPU tensors need Triton's interpreter: set TRITON_INTERPRET=1 "
                         "before importing triton, or use dequantize + F.linear on CPU")


def _use_decode(x2, block_sizes):
    """16-bit x with at most 16 rows (or block_sizes asking for the decode kernel's BLOCK_M <= 16)."""
    if x2.dtype == torch.float32:
        return False
    return x2.shape[0] <= (16 if block_sizes is None else min(block_sizes[0], 16))


@functools.lru_cache(maxsize=None)
def _decode_plan(m, n, kw, k, device_type, device_index, block_sizes, split_k):
    """(BLOCK_M, BLOCK_N, BLOCK_K, warps, stages, SPLIT_K, EVEN_K, grid), once per problem shape."""
    on_gpu = device_type == "cuda" and not INTERPRET
    target = 4 * _sm_count(device_index or 0) if on_gpu else 1  # a few small programs per SM
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
        # Enough programs to reach the target, each split keeping at least two K steps. An untuned
        # rule of thumb: `split_k=` overrides it.
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
    """Everything _launch_decode passes besides x and y: worked out once per weight and shape."""
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


def _launch_decode(x2, info, block_sizes, split_k):
    m, k = x2.shape
    key = (m, k, x2.dtype, block_sizes, split_k)
    launch = info.launches.get(key)
    if launch is None:
        launch = info.launches[key] = _decode_launch(m, k, x2.dtype, x2.device, info, block_sizes, split_k)
    grid, mid, tail, flags = launch
    y = torch.empty((m, info.n), dtype=x2.dtype, device=x2.device)  # (M, N)
    _nvfp4_decode_kernel[grid](x2, *mid, y, *tail, **flags)
    return y


def _launch(x2, info, block_sizes, split_k):
    """Allocate y and run a kernel on x2 [M, K] (inputs already checked). Returns y [M, N]."""
    x2 = x2.contiguous()  # unit stride along K (a no-op for contiguous x)
    if _use_decode(x2, block_sizes):
        return _launch_decode(x2, info, block_sizes, split_k)
    m, k = x2.shape
    n, kb = info.n, info.kb
    packed, scale_u8, gs, bias = info.packed, info.scale_u8, info.gs, info.bias

    if split_k is None:
        split_k = _default_split_k(m, n, k, x2.device)
    # One split writes y directly; several write fp32 partials that torch sums afterwards.
    if split_k == 1:
        out = torch.empty((m, n), dtype=x2.dtype, device=x2.device)  # (M, N)
    else:
        out = torch.empty((split_k, m, n), dtype=torch.float32, device=x2.device)  # (S, M, N)

    args = (x2, packed, scale_u8, gs, bias if bias is not None else gs, out,
            m, n, k, kb,
            x2.stride(0), packed.stride(0), scale_u8.stride(0), out.stride(-2),
            out.stride(0) if split_k > 1 else 0,
            _m_bucket(m))
    flags = dict(
        HAS_BIAS=bias is not None,
        DOT_FP32=x2.dtype == torch.float32 or (INTERPRET and x2.dtype == torch.bfloat16),
        FP8_NATIVE=_fp8_native(x2.device),
        SPLIT_K=split_k,
        GROUP_M=8,
    )
    if block_sizes is None and INTERPRET:
        block_sizes = INTERPRETER_TILES
    if block_sizes is None and FIXED_TILES is not None:
        block_sizes = FIXED_TILES
    if block_sizes is not None:
        bm, bn, bk = block_sizes
        grid = (triton.cdiv(m, bm) * triton.cdiv(n, bn), split_k)
        _nvfp4_matmul_kernel[grid](*args, **flags, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
                                   num_warps=4, num_stages=3)
    else:
        def grid(meta):
            return (triton.cdiv(m, meta["BLOCK_M"]) * triton.cdiv(n, meta["BLOCK_N"]), split_k)
        _nvfp4_matmul_autotuned[grid](*args, **flags)
    return out if split_k == 1 else out.sum(dim=0).to(x2.dtype)  # (M, N)


def _dequantize(packed, scale, global_scale, k, dtype):
    """W [N, k] in dtype, in plain torch: only the backward pass needs the weight materialised."""
    e2m1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], device=packed.device)
    e2m1 = torch.cat([e2m1, -e2m1]).to(dtype)  # code 0..15 -> value
    codes = torch.stack([packed & 0xF, packed >> 4], dim=-1).flatten(1).int()  # (N, K_pad)
    w = e2m1[codes] * scale.to(dtype).repeat_interleave(16, dim=1)  # exact in fp32/bf16/fp16
    return (w[:, :k] / global_scale).to(dtype)  # (N, k)


class _NVFP4Matmul(torch.autograd.Function):
    """Makes the kernel differentiable with respect to x (and bias), for LoRA training on top of a
    frozen NVFP4 weight: dL/dx = dL/dy @ W, with W dequantized for the duration of the backward
    (what QLoRA does too). The packed weight itself gets no gradient."""

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
            w = _dequantize(packed, scale, global_scale, ctx.k, grad_y.dtype)  # (N, K)
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

    16-bit x with at most 16 rows (decode) runs the decode kernel, everything else the general one.
    block_sizes=(BLOCK_M, BLOCK_N, BLOCK_K) and split_k are for tests and experiments: by default the
    decode kernel takes fixed tiles, the general one autotunes on GPU, split_k follows a rule of
    thumb, and the interpreter uses big tiles. The weight's checks and launch settings are worked
    out at its first call and cached: later calls only check x.
    """
    info = _weight_info(packed, scale, global_scale, bias)
    _check_x(x, info)
    if block_sizes is not None:
        bm, bn, bk = block_sizes
        if bm < 8 or bn < 16 or bk < 32 or any(b & (b - 1) for b in (bm, bn, bk)):
            raise ValueError(f"nvfp4_matmul: block_sizes must be powers of two with BLOCK_M >= 8, "
                             f"BLOCK_N >= 16 and BLOCK_K >= 32, got {tuple(block_sizes)}")
        block_sizes = tuple(block_sizes)
    if split_k is not None and (not isinstance(split_k, int) or split_k < 1):
        raise ValueError(f"nvfp4_matmul: split_k must be a positive int, got {split_k!r}")
    n, k = info.n, x.shape[-1]
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)  # (M, K)
    if x2.shape[0] == 0 or n == 0:
        return x.new_zeros(*lead, n)
    if torch.is_grad_enabled() and (x.requires_grad or (bias is not None and bias.requires_grad)):
        y = _NVFP4Matmul.apply(x2, packed, scale, global_scale, bias, info, block_sizes, split_k)
    else:
        y = _launch(x2, info, block_sizes, split_k)
    return y.reshape(*lead, n)


# -----------------------------------------------------------------------------
# What bench/kernel_sass.py compiles: every CUDA configuration, with the signature the wrapper
# launches for a bf16 x and an n x k weight.


def sass_jobs():
    jobs = []
    for bm, tiles in sorted(DECODE_TILES.items()):
        for bn, bk, warps, stages in tiles:
            jobs.append(dict(name=f"decode_{bm}x{bn}x{bk}_w{warps}_s{stages}", kernel="decode", num_warps=warps,
                             num_stages=stages, weights_per_step=bn * bk, decode=True,
                             tiles=dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk)))
    for c in CUDA_CONFIGS:
        bm, bn, bk = (c.kwargs[key] for key in ("BLOCK_M", "BLOCK_N", "BLOCK_K"))
        jobs.append(dict(name=f"general_{bm}x{bn}x{bk}_w{c.num_warps}_s{c.num_stages}", kernel="general",
                         num_warps=c.num_warps, num_stages=c.num_stages, weights_per_step=bn * bk,
                         decode=False, role="fp32 x" if bm == 16 else "prefill", tiles=dict(c.kwargs)))
    return jobs


def sass_launch(job, n, k):
    """(kernel, pointer dtypes, int arguments, constexprs) as the wrapper would launch `job`."""
    if job["kernel"] == "decode":
        m = 4  # not 1 (Triton would specialise it) and not a multiple of 16
        ptrs = dict(x_ptr="bf16", w_ptr="i32", s_ptr="u8", gs_ptr="fp32", b_ptr="fp32", y_ptr="bf16",
                    part_ptr="fp32", cnt_ptr="i32")
        ints = dict(M=m, N=n, K=k, KW=k // 8, stride_xm=k, stride_wn=k // 8, stride_sn=k // 16, stride_ym=n)
        consts = dict(HAS_BIAS=False, USE_ASM=True, SCALE_FAST=True, IS_F16=False, EVEN_K=True, SPLIT_K=1,
                      **job["tiles"])
        return _nvfp4_decode_kernel, ptrs, ints, consts
    fp32 = job["role"] == "fp32 x"  # the general kernel's 16-row tiles only serve fp32 x now
    m, xdt = (4, "fp32") if fp32 else (4096, "bf16")
    ptrs = dict(x_ptr=xdt, w_ptr="u8", s_ptr="u8", gs_ptr="fp32", b_ptr="fp32", y_ptr=xdt)
    ints = dict(M=m, N=n, K=k, KB=k // 2, stride_xm=k, stride_wn=k // 2, stride_sn=k // 16, stride_ym=n,
                stride_ysplit=0, M_BUCKET=_m_bucket(m))
    consts = dict(HAS_BIAS=False, DOT_FP32=fp32, FP8_NATIVE=True, SPLIT_K=1, GROUP_M=8, **job["tiles"])
    return _nvfp4_matmul_kernel, ptrs, ints, consts
