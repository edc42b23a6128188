"""
Part one: a fused NVFP4 weight-only matmul (W4A16) in Triton, y = x @ dequant(W).T + bias.

The format. An NVFP4 weight stores each element as a 4-bit E2M1 float (one of +-{0, .5, 1, 1.5, 2,
3, 4, 6}), two per byte, plus one FP8 E4M3 scale per block of 16 consecutive inputs and one fp32
global scale per tensor:

    W[n, k] = e2m1(code[n, k]) * fp32(scale[n, k // 16]) / global_scale

That is 4 + 8/16 = 4.5 bits per weight instead of 16 for bf16. Activations stay in 16 bits ("A16"),
so the multiply itself is an ordinary bf16/fp16 (or fp32) matmul: the 4 bits only live in memory.

Why fuse. Dequantizing to a bf16 tensor and calling torch.matmul writes and re-reads 16 bits per
weight, more traffic than the bf16 model we started from. This kernel loads the packed bytes and
the scales tile by tile, decodes them in registers and feeds the decoded tile straight to `tl.dot`,
so the weight crosses the memory bus at 4.5 bits per element. That matters most when generating
text ("decode": one token per sequence, M <= 16 rows of x), where each weight byte serves a few
multiply-adds and the matmul waits on memory; for long prompts ("prefill", M in the thousands) the
matmul is compute-bound and the decoding is amortised over the rows of a tile.

Three ideas, in the order the kernel uses them:

1. Exact decoding with one bit trick. E2M1 and E4M3 are tiny floats, and fp16 (5 exponent bits, 10
   mantissa bits) contains both. Copying a small float's exponent and mantissa bits into the top of
   fp16's exponent and mantissa fields gives the right value times a power of two (the difference of
   the exponent biases), and the small float's subnormals land on fp16 subnormals. For E2M1:
   `(sign << 15) | (magnitude << 9)` read as fp16, times 2**14. For the E4M3 scales we use Triton's
   fp8 type where the GPU has one (sm_89+) and the same trick, `(byte & 0x7F) << 7` times 2**8, on
   older GPUs.

2. Two half-dots instead of interleaving. Byte j of a row holds elements 2j (low nibble) and 2j + 1
   (high nibble). Rather than interleave the two decoded nibbles back into one [BLOCK_K, BLOCK_N]
   tile (a register shuffle that may go through shared memory), we split the *activations*:

       x @ W.T  ==  x[:, 0::2] @ W[:, 0::2].T  +  x[:, 1::2] @ W[:, 1::2].T

   Both nibbles of a byte share a scale (16 is even), so one scale tile serves both halves. x is
   loaded as one contiguous tile and split into even and odd columns in registers (`tl.reshape` to
   [BLOCK_M, BLOCK_K/2, 2], then `tl.split`), so its loads stay vectorized.

3. The global scale comes last. `e2m1 * e4m3` has at most 6 significant bits and lies in
   [2**-10, 2688], so it is exact in fp16 and bf16: the tile handed to `tl.dot` carries no rounding
   error, and the division by the global scale happens once per output element, on the fp32
   accumulator (sum_k x_k w_k / g == (sum_k x_k w_k) / g). An identity x gives back the
   dequantized weight bit for bit.

Part two (kernels/nvfp4_decode.py) adds a second kernel for decode and the entry point everyone
calls, `nvfp4_matmul` (loaded by path: 01_quantize.nvfp4_kernel). This kernel decodes in fp32 and its compiled main loop spends ~10-12
thread instructions per weight (read from the sm_90 machine code by bench/kernel_sass.py, see
docs/kernel.md): fine for prefill, where a decoded tile serves 32-128 rows of x, but at decode the
kernel would be bound by instruction issue rather than memory. No GPU has run either kernel yet.

The same code runs on CPU tensors under Triton's interpreter (TRITON_INTERPRET=1, set before triton
is imported), which is how the tests check it without a GPU. Two interpreter quirks shape the code:
its `tl.dot` on bf16 operands returns wrong values, so bf16 is upcast to fp32 before the dot there;
and every program x K-step costs milliseconds, so it uses one large fixed tile.

    python kernels/nvfp4_matmul.py   # GPU: check against dequantize + matmul, then time it
                                     # CPU: re-runs itself under the interpreter, checks a small
                                     # shape, no timing (~4 s of CPU time)
"""
import functools
import os
import sys

import torch
import triton
import triton.language as tl

# Triton reads TRITON_INTERPRET when `triton` is imported (it decides what @triton.jit does), so
# reading it once here matches what the decorators below do.
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
# QERL_NVFP4_TILES="64,64,64": fixed tiles instead of autotuning (the GPU test run sets it, so that
# each test shape does not benchmark every configuration).
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
        # Older GPUs: the E2M1 trick. 4 exponent + 3 mantissa bits go to fp16 bits 7..13, fp16 bias
        # 15 vs E4M3 bias 7 -> times 2**8. (The NaN code 0x7F would decode as 480; valid checkpoints
        # never contain it.)
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
    # time share weight columns and activation rows in L2 (it matters for prefill; with a single row
    # of tiles this is the identity).
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
            # cast of the weights is exact (idea 3 above).
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
# Tile configurations: starting points, not the result of a sweep (no GPU has run them); the
# autotuner picks per (M bucket, N, K).


def _config(bm, bn, bk, warps, stages):
    return triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk}, num_warps=warps,
                         num_stages=stages)


CUDA_CONFIGS = [
    # M <= 16 with fp32 x (16-bit x at M <= 16 takes part two's decode kernel)
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
INTERPRETER_TILES = (64, 128, 256)  # one big tile: the tests' problems take one or two programs


def _prune_configs(configs, named_args, **kwargs):
    """Benchmark only the configurations whose BLOCK_M fits the batch."""
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
def sm_count(device_index):
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _default_split_k(m, n, k, device):
    """Split K when a decode-sized problem has fewer 32-wide N tiles than the GPU has SMs, each
    split keeping at least 512 columns so that it still streams. A rule of thumb, not tuned."""
    if device.type != "cuda" or INTERPRET or m > 16:
        return 1
    n_tiles = triton.cdiv(n, 32)
    split = 1
    while n_tiles * split < sm_count(device.index or 0) and k // (2 * split) >= 512:
        split *= 2
    return split


def _fp8_native(device):
    """Can Triton use tl.float8e4nv here? The interpreter can; CUDA GPUs from sm_89 (Ada, Hopper)."""
    if device.type != "cuda" or INTERPRET:
        return True
    return torch.cuda.get_device_capability(device) >= (8, 9)


# -----------------------------------------------------------------------------
# The wrapper: allocate, launch


def launch_general(x2, packed, scale_u8, global_scale, bias, block_sizes=None, split_k=None):
    """y [M, N] = x2 [M, K] @ W.T + bias with the kernel above, inputs already checked and
    contiguous (scale_u8: the E4M3 scales viewed as uint8, global_scale: shape [1])."""
    m, k = x2.shape
    n, kb = packed.shape
    if split_k is None:
        split_k = _default_split_k(m, n, k, x2.device)
    # One split writes y directly; several write fp32 partials that torch sums afterwards
    # (deterministic, unlike atomic adds).
    if split_k == 1:
        out = torch.empty((m, n), dtype=x2.dtype, device=x2.device)  # (M, N)
    else:
        out = torch.empty((split_k, m, n), dtype=torch.float32, device=x2.device)  # (S, M, N)

    args = (x2, packed, scale_u8, global_scale, bias if bias is not None else global_scale, out,
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


def nvfp4_matmul_general(x, packed, scale, global_scale, bias=None, *, block_sizes=None, split_k=None):
    """y = x @ W.T + bias with this file's kernel, whatever the shape of x: the tutorial's wrapper.
    The entry point 01 and the trainer call, nvfp4_decode.py's `nvfp4_matmul` (part two), takes the same arguments,
    runs the decode kernel at decode and caches the weight's checks; it is also differentiable.

    x: [..., K] float32/bfloat16/float16; K may be the unpadded in_features (K <= K_pad < K + 16).
    packed: uint8 [N, K_pad/2], element 2j in the low nibble of byte j.
    scale: float8_e4m3fn [N, K_pad/16]. global_scale: float32 [1] (W = e2m1 * scale / global_scale).
    bias: [N] or None. Returns y [..., N] in x.dtype, accumulated in fp32.
    """
    check_weight(packed, scale, global_scale, bias)
    check_x(x, packed.shape[1], packed.device)
    block_sizes = check_options(block_sizes, split_k)
    lead, k, n = x.shape[:-1], x.shape[-1], packed.shape[0]
    x2 = x.reshape(-1, k).contiguous()  # (M, K) unit stride along K
    if x2.shape[0] == 0 or n == 0:
        return x.new_zeros(*lead, n)
    y = launch_general(x2, packed.contiguous(), scale.contiguous().view(torch.uint8),
                       global_scale.reshape(1), bias.contiguous() if bias is not None else None,
                       block_sizes, split_k)
    return y.reshape(*lead, n)  # (..., N)


def dequantize(packed, scale, global_scale, k, dtype):
    """W [N, k] in dtype, in plain torch: the reference, and what the backward pass multiplies by."""
    e2m1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], device=packed.device)
    e2m1 = torch.cat([e2m1, -e2m1]).to(dtype)  # code 0..15 -> value
    codes = torch.stack([packed & 0xF, packed >> 4], dim=-1).flatten(1).int()  # (N, K_pad)
    w = e2m1[codes] * scale.to(dtype).repeat_interleave(16, dim=1)  # exact in fp32/bf16/fp16
    return (w[:, :k] / global_scale).to(dtype)  # (N, k)


# ============================== Part 2: plumbing (checks, the demo) ==============================


def check_weight(packed, scale, global_scale, bias):
    """The weight tensors' checks: a clear ValueError for each way they can be wrong."""
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


_X_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def check_x(x, kb, device):
    """x against a checked weight of kb bytes per row on `device`."""
    if not isinstance(x, torch.Tensor) or x.dtype not in _X_DTYPES:
        got = x.dtype if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"nvfp4_matmul: x must be a float32, bfloat16 or float16 tensor, got {got}")
    if x.dim() < 1 or x.shape[-1] < 1:
        raise ValueError(f"nvfp4_matmul: x must have shape [..., K] with K >= 1, got {tuple(x.shape)}")
    k, k_pad = x.shape[-1], 2 * kb
    # The weight's input dim was zero-padded to the next multiple of 16; x may carry the true width
    # (its missing tail counts as zero) but nothing else: a wider or much narrower x is a mix-up.
    if not (k_pad - 16 < k <= k_pad):
        raise ValueError(f"nvfp4_matmul: x has K={k} features but the weight holds K_pad={k_pad} "
                         f"(packed.shape[1]={kb}); expected K_pad == K rounded up to a multiple of 16")
    if x.device != device:
        raise ValueError(f"nvfp4_matmul: all tensors must be on one device, got x on {x.device} and "
                         f"the weight on {device}")
    if x.device.type == "cpu" and not INTERPRET:
        raise ValueError("nvfp4_matmul: CPU tensors need Triton's interpreter: set TRITON_INTERPRET=1 "
                         "before importing triton, or use dequantize + F.linear on CPU")


def check_options(block_sizes, split_k):
    """block_sizes as a tuple (or None) once valid; split_k a positive int or None."""
    if block_sizes is not None:
        bm, bn, bk = block_sizes
        if bm < 8 or bn < 16 or bk < 32 or any(b & (b - 1) for b in (bm, bn, bk)):
            raise ValueError(f"nvfp4_matmul: block_sizes must be powers of two with BLOCK_M >= 8, "
                             f"BLOCK_N >= 16 and BLOCK_K >= 32, got {tuple(block_sizes)}")
        block_sizes = tuple(block_sizes)
    if split_k is not None and (not isinstance(split_k, int) or split_k < 1):
        raise ValueError(f"nvfp4_matmul: split_k must be a positive int, got {split_k!r}")
    return block_sizes


def random_nvfp4(n, k, gen, device):
    """A random NVFP4 weight for in_features k: codes 0..15, positive normal E4M3 scales (bytes
    0x30..0x4F: 0.5 to 7.5), a global scale that keeps |W| of order k**-0.5."""
    k_pad = -(-k // 16) * 16
    packed = torch.randint(0, 256, (n, k_pad // 2), generator=gen, dtype=torch.uint8)
    scale = torch.randint(0x30, 0x50, (n, k_pad // 16), generator=gen, dtype=torch.uint8)
    gs = torch.tensor([3.0 * k ** 0.5])
    return packed.to(device), scale.view(torch.float8_e4m3fn).to(device), gs.to(device)


def main():
    on_gpu = torch.cuda.is_available() and not INTERPRET
    if not on_gpu and not INTERPRET:
        print("No CUDA GPU: re-running under Triton's interpreter (TRITON_INTERPRET=1, which triton "
              "reads when it is imported) to check a small shape; timing needs a GPU.", flush=True)
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, "TRITON_INTERPRET": "1"})
    device = "cuda" if on_gpu else "cpu"
    gen = torch.Generator().manual_seed(0)
    # Check: against the plain-torch reference, dequantize then matmul. (M, N, K) with an unpadded K.
    m, n, k = (512, 1024, 1000) if on_gpu else (40, 96, 200)
    packed, scale, gs = random_nvfp4(n, k, gen, device)
    bias = torch.randn(n, generator=gen).to(device)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        x = torch.randn(m, k, generator=gen).to(device, dtype)  # (M, K)
        y = nvfp4_matmul_general(x, packed, scale, gs, bias.to(dtype))  # (M, N)
        ref = x.float() @ dequantize(packed, scale, gs, k, torch.float32).T + bias.to(dtype).float()
        if dtype == torch.float32:
            torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-4)
        else:  # 16-bit x: the same exact products, one rounding to dtype (rtol), fp32 sums in another
            ref = ref.to(dtype)  # order (atol)
            torch.testing.assert_close(y, ref, rtol=1.6e-2 if dtype == torch.bfloat16 else 1e-3, atol=1e-4)
        print(f"check  | x {str(dtype).replace('torch.', ''):<8} | M {m} N {n} K {k} | matches dequantize + "
              f"matmul (max |diff| {(y.float() - ref.float()).abs().max().item():.1e})", flush=True)
    if not on_gpu:
        print("timing | skipped: the interpreter is for checking, not timing (run this on a CUDA GPU)")
        return
    # Time: against torch.matmul with a bf16 copy of the weight (cuBLAS). Prefill is this kernel's
    # job; at M = 16 bf16 x takes part two's decode kernel (bench/bench_kernel.py times that).
    from triton.testing import do_bench
    n = k = 8192
    packed, scale, gs = random_nvfp4(n, k, gen, device)
    w_bf16 = dequantize(packed, scale, gs, k, torch.bfloat16)  # (N, K)
    for m in (16, 4096):
        x = torch.randn(m, k, generator=gen).to(device, torch.bfloat16)
        us = {"nvfp4": 1e3 * do_bench(lambda: nvfp4_matmul_general(x, packed, scale, gs)),
              "bf16": 1e3 * do_bench(lambda: torch.matmul(x, w_bf16.T))}
        tflops = {key: 2 * m * n * k / t / 1e6 for key, t in us.items()}
        print(f"timing | {torch.cuda.get_device_name()} | x bf16 | M {m} N {n} K {k} | us nvfp4 "
              f"{us['nvfp4']:.1f} bf16 {us['bf16']:.1f} | TFLOP/s nvfp4 {tflops['nvfp4']:.1f} bf16 "
              f"{tflops['bf16']:.1f} | bf16 time / nvfp4 time {us['bf16'] / us['nvfp4']:.2f}x", flush=True)


if __name__ == "__main__":
    main()
