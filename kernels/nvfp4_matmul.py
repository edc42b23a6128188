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

Decode-sized problems also get split-K: when there are too few N tiles to fill the GPU, the K loop is
cut into SPLIT_K ranges run by separate programs, each writing an fp32 partial sum; the wrapper adds
the partials with torch (deterministic, unlike atomic adds).

Training LoRA on top of the frozen weight needs dL/dx = dL/dy @ W. The wrapper is an autograd
function whose backward dequantizes W with plain torch for the duration of the backward (as QLoRA
does); the packed weight gets no gradient.

The same code runs on CPU tensors under Triton's interpreter (TRITON_INTERPRET=1, set before triton
is imported), which is how the tests check it without a GPU. Two interpreter quirks shape the code:
a `tl.dot` on bf16 operands returns garbage there, so bf16 is upcast to fp32 before the dot; and
every program x K-step costs milliseconds, so the interpreter uses one large fixed tile instead of
the autotuned GPU configurations.

Run the tests (CPU, interpreter) and the benchmark (GPU):
    python -m pytest -q tests/test_kernels.py
    python bench/bench_kernel.py
"""
import functools
import os

import torch
import triton
import triton.language as tl

# Triton reads TRITON_INTERPRET when `triton` is imported (it decides how @triton.jit compiles),
# so reading it once here matches what the decorators below will do.
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


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
    # decode
    _config(16, 16, 512, 4, 3),
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


def _check_inputs(x, packed, scale, global_scale, bias):
    for name, t in (("packed", packed), ("scale", scale), ("global_scale", global_scale), ("bias", bias)):
        if not isinstance(t, torch.Tensor) and not (name == "bias" and t is None):
            raise ValueError(f"nvfp4_matmul: {name} must be a torch.Tensor, got {type(t).__name__}")
    if not isinstance(x, torch.Tensor) or x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        got = x.dtype if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"nvfp4_matmul: x must be a float32, bfloat16 or float16 tensor, got {got}")
    if x.dim() < 1 or x.shape[-1] < 1:
        raise ValueError(f"nvfp4_matmul: x must have shape [..., K] with K >= 1, got {tuple(x.shape)}")
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
    k = x.shape[-1]
    # The weight's input dim was zero-padded to the next multiple of 16; x may carry the true width
    # (its missing tail counts as zero) but nothing else: a wider or much narrower x is a mix-up.
    if not (k_pad - 16 < k <= k_pad):
        raise ValueError(f"nvfp4_matmul: x has K={k} features but the weight holds K_pad={k_pad} "
                         f"(packed.shape[1]={kb}); expected K_pad == K rounded up to a multiple of 16")
    if bias is not None and (bias.dim() != 1 or bias.shape[0] != n or not bias.is_floating_point()):
        raise ValueError(f"nvfp4_matmul: bias must be a 1-D float tensor of size N={n}, got "
                         f"{bias.dtype} {tuple(bias.shape)}")
    devices = {t.device for t in (x, packed, scale, global_scale) + (() if bias is None else (bias,))}
    if len(devices) != 1:
        raise ValueError(f"nvfp4_matmul: all tensors must be on one device, got {sorted(map(str, devices))}")
    if x.device.type == "cpu" and not INTERPRET:
        raise ValueError("nvfp4_matmul: CPU tensors need Triton's interpreter: set TRITON_INTERPRET=1 "
                         "before importing triton, or use dequantize + F.linear on CPU")


def _launch(x2, packed, scale, global_scale, bias, block_sizes, split_k):
    """Allocate y and run the kernel on x2 [M, K] (inputs already checked). Returns y [M, N]."""
    m, k = x2.shape
    n, kb = packed.shape
    # Unit stride along K everywhere (see the kernel's stride arguments); copies only if needed.
    x2, packed, scale = x2.contiguous(), packed.contiguous(), scale.contiguous()
    scale_u8 = scale.view(torch.uint8)  # the kernel reinterprets the bytes itself
    gs = global_scale.reshape(1)
    bias = bias.contiguous() if bias is not None else None

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
    def forward(ctx, x2, packed, scale, global_scale, bias, block_sizes, split_k):
        ctx.save_for_backward(packed, scale, global_scale)
        ctx.has_bias = bias is not None
        ctx.k = x2.shape[1]
        return _launch(x2, packed, scale, global_scale, bias, block_sizes, split_k)

    @staticmethod
    def backward(ctx, grad_y):  # grad_y: (M, N)
        packed, scale, global_scale = ctx.saved_tensors
        grad_x = grad_bias = None
        if ctx.needs_input_grad[0]:
            w = _dequantize(packed, scale, global_scale, ctx.k, grad_y.dtype)  # (N, K)
            grad_x = grad_y @ w  # (M, K)
        if ctx.has_bias and ctx.needs_input_grad[4]:
            grad_bias = grad_y.sum(dim=0)
        return grad_x, None, None, None, grad_bias, None, None


def nvfp4_matmul(x, packed, scale, global_scale, bias=None, *, block_sizes=None, split_k=None):
    """y = x @ W.T + bias with W stored as NVFP4, dequantized on the fly.

    x: [..., K] float32/bfloat16/float16; K may be the unpadded in_features (K <= K_pad < K + 16).
    packed: uint8 [N, K_pad/2], element 2j in the low nibble of byte j.
    scale: float8_e4m3fn [N, K_pad/16]. global_scale: float32 [1] (W = e2m1 * scale / global_scale).
    bias: [N] or None. Returns y [..., N] in x.dtype, accumulated in fp32. Differentiable with
    respect to x and bias.

    block_sizes=(BLOCK_M, BLOCK_N, BLOCK_K) and split_k are for tests and experiments: by default the
    GPU autotunes the tiles and picks split_k by a rule of thumb; the interpreter uses one big tile.
    """
    _check_inputs(x, packed, scale, global_scale, bias)
    if block_sizes is not None:
        bm, bn, bk = block_sizes
        if min(bm, bn) < 16 or bk < 32 or any(b & (b - 1) for b in (bm, bn, bk)):
            raise ValueError(f"nvfp4_matmul: block_sizes must be powers of two with BLOCK_M, BLOCK_N "
                             f">= 16 and BLOCK_K >= 32, got {tuple(block_sizes)}")
    if split_k is not None and (not isinstance(split_k, int) or split_k < 1):
        raise ValueError(f"nvfp4_matmul: split_k must be a positive int, got {split_k!r}")
    n = packed.shape[0]
    k = x.shape[-1]
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)  # (M, K)
    if x2.shape[0] == 0 or n == 0:
        return x.new_zeros(*lead, n)
    needs_grad = torch.is_grad_enabled() and (x.requires_grad or (bias is not None and bias.requires_grad))
    if needs_grad:
        y = _NVFP4Matmul.apply(x2, packed, scale, global_scale, bias, block_sizes, split_k)
    else:
        y = _launch(x2, packed, scale, global_scale, bias, block_sizes, split_k)
    return y.reshape(*lead, n)
