"""Stage 01: store a model's Linear weights in 4 bits, as NVFP4: QeRL's frozen base model.

NVFP4 keeps 4-bit E2M1 values, an FP8 E4M3 scale per 16 inputs and an FP32 scale per tensor.
Rollouts get cheaper, and the rounding noise raises policy entropy, which the paper finds helps
exploration. The bytes are compressed-tensors' `nvfp4-pack-quantized`; --out writes a checkpoint
that it and vLLM load. Part 2: NF4 (bitsandbytes, QLoRA's baseline), Four Over Six, the fast
forward, the checkpoint writer and the demo.

    python qerl/quantize.py                                  # demo: bits, bytes, error, time
    python qerl/quantize.py --model DIR --out DIR [--force]  # HF folder -> NVFP4 checkpoint
    python qerl/quantize.py --show-block [--seed N]          # one block of 16, step by step
"""
import functools
import importlib
import math
import os
import shutil
import sys
import time

if __package__ in (None, ""):  # run as a file (python qerl/quantize.py): the checkout heads sys.path, not qerl/
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

import torch
import torch.nn as nn
import torch.nn.functional as F

from qerl import cli
from qerl import files
from qerl import quant_checkpoint  # the checkpoint writer's config, checks and reads
from qerl import quant_engine  # what the quantized Linears share that is not the method

stage01 = importlib.import_module("01_quantize")  # the stage this module extends: its definitions, used as they are
E2M1_VALUES = stage01.E2M1_VALUES
FP4_MAX = stage01.FP4_MAX
FP8_MAX = stage01.FP8_MAX
FUSED_GROUPS = stage01.FUSED_GROUPS
NVFP4_BLOCK = stage01.NVFP4_BLOCK
_E2M1_MIDS = stage01._E2M1_MIDS
_NVFP4_BYTE_LUT = stage01._NVFP4_BYTE_LUT
_e2m1_codes = stage01._e2m1_codes
dequantize_nvfp4 = stage01.dequantize_nvfp4
fused_group = stage01.fused_group
replace_module = stage01.replace_module

# --------------------------------------------------------------------------------------------------
# NVFP4: E2M1 values, an FP8 E4M3 scale per 16 inputs, an FP32 scale per tensor (all maths in fp32)

# The constants, E2M1 codes (_e2m1_codes), the byte table and dequantize_nvfp4 are stage 01's (above).
# The roundings: name -> (the FP8 scale the largest block gets, a per-block re-pick of codes and
# scales, or None). QeRL's is round to nearest; Part 2 registers Four Over Six ("4over6").
NVFP4_METHODS = {"rtn": (FP8_MAX, None)}


def nvfp4_global_scale(weights, method="rtn"):
    """fp32 [1] scale 448 * 6 / amax: the largest block lands on the FP8 and E2M1 maxima. amax over
    all of `weights` (one tensor, or a fused group sharing one scale). An all-zero tensor would
    give inf; compressed-tensors then uses 1.0, and so do we."""
    _check_method(method)
    top = NVFP4_METHODS[method][0]
    amax = torch.stack([w.detach().abs().amax().float() for w in weights]).max().reshape(1)
    gs = (top * FP4_MAX) / amax.clamp(min=torch.finfo(torch.float32).tiny)
    return torch.nan_to_num(gs, nan=1.0, posinf=1.0, neginf=1.0)


def _block_scales(amax_b, gs, block_max):
    """fp8-representable block scales (as fp32) that map each block's amax to `block_max`."""
    s = (gs * (amax_b / block_max)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float()  # RNE
    # A block far below the tensor's amax (or all zero) underflows FP8 to 0; compressed-tensors
    # then stores 0.125, which avoids a 0/0 below and still decodes the block to ~all zeros.
    return torch.where(s == 0, 0.125, s)                                 # (out, nb)


@torch.no_grad()
def quantize_nvfp4(w, global_scale=None, name="weight", method="rtn"):
    """w [out, in] -> packed uint8 [out, K_pad/2], fp8 scale [out, K_pad/16], fp32 global scale [1].
    Pass global_scale to share one across fused layers (q/k/v, gate/up), as vLLM requires.
    "rtn" is compressed-tensors' round to nearest, byte for byte."""
    _check_weight(w, name, global_scale)
    _check_method(method)
    w = w.detach().float()
    out_f, in_f = w.shape
    k_pad = -(-in_f // NVFP4_BLOCK) * NVFP4_BLOCK
    if k_pad != in_f:  # zero columns change no block's amax and quantize to code 0
        w = F.pad(w, (0, k_pad - in_f))
    if global_scale is None:
        gs = nvfp4_global_scale([w], method)
    else:
        gs = torch.as_tensor(global_scale, dtype=torch.float32).reshape(1).clone().to(w.device)
    blocks = w.view(out_f, k_pad // NVFP4_BLOCK, NVFP4_BLOCK)             # (out, nb, 16)
    amax_b = blocks.abs().amax(dim=-1)                                   # (out, nb)
    s = _block_scales(amax_b, gs, FP4_MAX)                               # (out, nb)
    code = _e2m1_codes(blocks, s, gs)                                    # (out, nb, 16)
    repick = NVFP4_METHODS[method][1]
    if repick is not None:  # a variant's per-block choice (Four Over Six, Part 2)
        code, s = repick(blocks, amax_b, gs, code, s)                    # same shapes
    code = code.view(out_f, k_pad)                                       # (out, K_pad)
    packed = code[:, 0::2] | (code[:, 1::2] << 4)                        # (out, K_pad/2), even: low
    return packed.contiguous(), s.to(torch.float8_e4m3fn), gs


# --------------------------------------------------------------------------------------------------
# Quantized Linear modules (frozen buffers; only LoRA trains on top of them in stage 02)


class _QuantLinear(quant_engine.FrozenQuantLinear):
    """A weight format's layer: its buffers under their checkpoint names (load_state_dict fills
    them), an optional bias, the forward. `methods`: its roundings; `global_scale`: whether it takes
    the one quantize_model shares within a fused group."""
    methods = ("rtn",)
    global_scale = False
    fast = True  # what runs: this product, cheaper (fast_forward: Triton, or W rebuilt in backward)

    def __init__(self, in_features, out_features, bias, device, **format_buffers):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        for k, t in format_buffers.items():
            self.register_buffer(k, t)
        self.register_buffer("bias", torch.zeros(out_features, device=device) if bias else None)

    def forward(self, x):                                                # (..., in) -> (..., out)
        if self.fast:
            return fast_forward(self, x)
        b = None if self.bias is None else self.bias.to(x.dtype)
        return F.linear(x, self.dequantized_weight(x.dtype), b)          # W (out, in) from 4 bits


class NVFP4Linear(_QuantLinear):
    """y = x @ W_hat^T + b, W_hat stored as NVFP4 in a compressed-tensors checkpoint's buffers."""
    methods = NVFP4_METHODS
    global_scale = True
    BUFFERS = ("weight_packed", "weight_scale", "weight_global_scale")  # quantize_nvfp4's outputs

    def __init__(self, in_features, out_features, bias=False, device=None):
        k_pad = -(-in_features // NVFP4_BLOCK) * NVFP4_BLOCK
        o, nb = out_features, k_pad // NVFP4_BLOCK
        super().__init__(in_features, out_features, bias, device,
                         weight_packed=torch.zeros(o, k_pad // 2, dtype=torch.uint8, device=device),
                         weight_scale=torch.zeros(o, nb, dtype=torch.float8_e4m3fn, device=device),
                         weight_global_scale=torch.ones(1, dtype=torch.float32, device=device))

    @classmethod
    def from_linear(cls, linear, global_scale=None, name="weight", method="rtn"):
        quantized = quantize_nvfp4(linear.weight, global_scale, name=name, method=method)
        return cls._from_linear(linear, dict(zip(cls.BUFFERS, quantized)))

    def dequantized_weight(self, dtype=torch.float32):
        w = dequantize_nvfp4(self.weight_packed, self.weight_scale, self.weight_global_scale, dtype)
        return w[:, : self.in_features]                                  # (out, in), unpadded


# --------------------------------------------------------------------------------------------------
# Whole-model quantization. vLLM runs q/k/v (and gate/up) as one fused matmul with one global
# scale, so each group gets the scale of its largest amax (= the smallest of their own scales).


# The weight formats: one registry that --quant, the loaders, quantize_model and the demo read. A
# new one is a _QuantLinear subclass and one line; Part 2 registers NF4; quant_choices() reads it.
WEIGHT_FORMATS = {"nvfp4": NVFP4Linear}


def weight_format(fmt):
    """The quantized Linear class of format `fmt`; an unknown name is an error, never a fallback."""
    if fmt not in WEIGHT_FORMATS:
        choices = ", ".join(WEIGHT_FORMATS)
        raise ValueError(f"unknown weight format {fmt!r}: choose one of {choices}")
    return WEIGHT_FORMATS[fmt]


@torch.no_grad()
def quantize_model(model, fmt="nvfp4", skip=("lm_head",), method="rtn"):
    """Replace every nn.Linear (but names containing a `skip` entry) in place; returns model."""
    linear_cls = weight_format(fmt)
    linears = {n: m for n, m in model.named_modules()
               if isinstance(m, nn.Linear) and not any(s in n for s in skip)}
    groups = {}  # fused group -> its members' weights
    for n, m in linears.items():
        _check_weight(m.weight, n)
        groups.setdefault(fused_group(n), []).append(m.weight)
    scales = {g: nvfp4_global_scale(ws, method) if linear_cls.global_scale else None
              for g, ws in groups.items()}
    for n, m in linears.items():
        new = linear_cls.from_linear(m, scales[fused_group(n)], name=n, method=method)
        replace_module(model, n, new)
    return model


# ========= Part 2: variants (Four Over Six, NF4), the fast forward, checks, checkpoint writer, demo, CLI =========

# -----------------------------------------------------------------------------------------------------
# Four Over Six (arXiv 2512.02010), an extension: NVFP4_METHODS["4over6"], in NVFP4's bytes. E2M1 has nothing
# between 4 and 6, so a weight at 67-100% of its block's max loses up to a sixth of its size. Scaling the block
# max to 4 instead of 6 (a 1.5x larger block scale) trades range for resolution there; per block, keep whichever
# candidate reconstructs the block better. The larger candidate must still fit E4M3: the tensor scale puts the
# largest block's max -> 6 scale at 256 instead of 448, so its max -> 4 scale is 384 (the reference code's choice).

FOUR_OVER_SIX_SCALE_MAX = 256.0


def four_over_six(blocks, amax_b, gs, code, s):
    """quantize_nvfp4's "4over6": per block, the max -> 4 candidate where its squared reconstruction error is
    lower than the max -> 6 one's (code, s) -> the chosen (code (out, nb, 16), s (out, nb)). A max -> 4 scale
    that E4M3 cannot hold (only with a global scale meant for "rtn") leaves that block at max -> 6."""
    s4 = _block_scales(amax_b, gs, FP4_MAX / 1.5)                        # (out, nb), the max -> 4 candidate
    code4 = _e2m1_codes(blocks, s4, gs)                                  # (out, nb, 16)
    values = E2M1_VALUES.to(blocks.device)

    def sq_error(c, sc):                                                 # (out, nb)
        return (values[c.long()] * (sc / gs).unsqueeze(-1) - blocks).pow(2).sum(-1)
    fits = gs * amax_b / (FP4_MAX / 1.5) <= FP8_MAX
    use4 = fits & (sq_error(code4, s4) < sq_error(code, s))              # (out, nb); ties keep max -> 6
    return torch.where(use4.unsqueeze(-1), code4, code), torch.where(use4, s4, s)


NVFP4_METHODS["4over6"] = (FOUR_OVER_SIX_SCALE_MAX, four_over_six)  # its tensor scale: 256 * 6 / amax

# -----------------------------------------------------------------------------------------------------
# NF4 (bitsandbytes quantize_4bit, quant_type="nf4", no double quantization): QLoRA's baseline, --quant nf4

NF4_CODE = torch.tensor([
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
    -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
    0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
    0.7229568362236023, 1.0])


@torch.no_grad()
def quantize_nf4(w, blocksize=64, name="weight"):
    """Any-shape w -> packed uint8 [ceil(numel/2)], absmax fp32 [ceil(numel/blocksize)].
    Blocks run over the flattened weight; the first element of a pair goes in the HIGH nibble."""
    if not w.is_floating_point() or not torch.isfinite(w).all():
        raise ValueError(f"{name}: weight must be floating point without NaN or Inf")
    x = w.detach().reshape(-1).float()
    n = x.numel()
    full = n - n % blocksize
    blocks = x[:full].view(-1, blocksize)                                # (nb, 64)
    absmax = blocks.abs().amax(dim=-1)                                   # (nb,)
    # bitsandbytes multiplies by the reciprocal (not a division) and clamps to [-1, 1]; for the partial
    # last block it divides and stores the clamped absmax. Copying that keeps the bytes identical.
    scaled = (blocks * (1.0 / absmax.clamp(min=1e-38)).unsqueeze(1)).clamp(-1, 1).reshape(-1)
    if full < n:
        tail_max = x[full:].abs().max().clamp(min=1e-38)
        absmax = torch.cat([absmax, tail_max.reshape(1)])
        scaled = torch.cat([scaled, (x[full:] / tail_max).clamp(-1, 1)])
    if scaled.numel() % 2:
        scaled = F.pad(scaled, (0, 1))
    code = NF4_CODE.to(x.device)
    # Nearest code value: bucketize against the fp32 midpoints (a tie goes to the lower code).
    q = torch.bucketize(scaled, (code[:-1] + code[1:]) / 2).to(torch.uint8)
    return (q[0::2] << 4) | q[1::2], absmax


_NF4_BYTE_LUT = torch.stack((NF4_CODE[torch.arange(256) >> 4], NF4_CODE[torch.arange(256) & 0xF]), -1)


def dequantize_nf4(packed, absmax, shape, blocksize=64):
    """-> fp32 tensor of `shape`: code book value * its block's absmax."""
    n = math.prod(shape)
    vals = _NF4_BYTE_LUT.to(packed.device)[packed.long()].reshape(-1)[:n]  # (numel,), high nibble first
    per_elem = absmax.float().repeat_interleave(blocksize)[:n]
    return (vals * per_elem).view(*shape)


class NF4Linear(_QuantLinear):
    """The QLoRA baseline: NF4 weight, dequantized to x.dtype on every forward."""
    BUFFERS = ("weight_packed", "weight_absmax")  # quantize_nf4's outputs, in order

    def __init__(self, in_features, out_features, bias=False, device=None, blocksize=64):
        n = in_features * out_features
        super().__init__(in_features, out_features, bias, device,
                         weight_packed=torch.zeros((n + 1) // 2, dtype=torch.uint8, device=device),
                         weight_absmax=torch.zeros(-(-n // blocksize), dtype=torch.float32, device=device))
        self.blocksize = blocksize

    @classmethod
    def from_linear(cls, linear, global_scale=None, name="weight", method="rtn", blocksize=64):
        # global_scale and method are NVFP4's: NF4's absmax per block is all its scale, and it rounds one way
        if method not in cls.methods:
            raise ValueError(f"{name}: method {method!r} is an NVFP4 rounding; NF4 has only 'rtn'")
        quantized = quantize_nf4(linear.weight, blocksize, name=name)
        return cls._from_linear(linear, dict(zip(cls.BUFFERS, quantized)), blocksize=blocksize)

    def dequantized_weight(self, dtype=torch.float32):
        shape = (self.out_features, self.in_features)
        return dequantize_nf4(self.weight_packed, self.weight_absmax, shape, self.blocksize).to(dtype)


WEIGHT_FORMATS["nf4"] = NF4Linear
def quant_choices():
    """What --quant takes, read from WEIGHT_FORMATS when asked (a format registered later, from any module, is
    in): "none" keeps the float weights."""
    return ("none", *WEIGHT_FORMATS)

# -----------------------------------------------------------------------------------------------------
# The fast forward: _QuantLinear.forward's product, cheaper. NVFP4 on CUDA goes through the Triton kernel
# (kernels/), which reads the 4-bit bytes; on the CPU too when NVFP4Linear.kernel_on_cpu is True (Triton's
# interpreter, as 05's --gpu-path sets). Otherwise F.linear on the dequantized W, W rebuilt in backward instead
# of saved (quant_engine.py has the why), and kept under keep_dequantized. tests/test_quantize.py checks that
# both give the plain forward's outputs and input gradients.

NVFP4Linear.kernel_on_cpu = False  # True: CPU inputs too go through the Triton kernel (05's --gpu-path)
keep_dequantized = quant_engine.keep_dequantized  # a CPU's frozen base: each 4-bit weight rebuilt once per dtype


@functools.cache
def nvfp4_kernel():
    """kernels/nvfp4_decode.py's nvfp4_matmul when Triton is usable, else None (imported lazily: CPU-only installs
    work)."""
    try:
        return quant_engine.kernel_module("nvfp4_decode").nvfp4_matmul
    except ImportError:
        return None


def fast_forward(layer, x):                                              # (..., in) -> (..., out)
    """What a quantized layer runs: NVFP4 on CUDA (or kernel_on_cpu) through the Triton kernel, which reads the
    4-bit bytes; otherwise F.linear on the dequantized W, W rebuilt in backward (and kept under keep_dequantized)."""
    # the kernel reads E4M3 scales: a float32 copy (AQN's block-scales site, while it samples) takes the F.linear path
    kernel = nvfp4_kernel() if isinstance(layer, NVFP4Linear) and (x.is_cuda or layer.kernel_on_cpu) \
        and layer.weight_scale.dtype == torch.float8_e4m3fn else None
    if kernel is not None:  # None without Triton
        return kernel(x, layer.weight_packed, layer.weight_scale, layer.weight_global_scale, layer.bias)
    return quant_engine.RebuiltWeightLinear.apply(x, layer)  # without grad: just F.linear on the dequantized W


# -----------------------------------------------------------------------------------------------------
# Checks (the model folder's own checks are hf_files.py's; atomic writes and output folders, files.py's)


def _check_weight(w, name, global_scale=None):
    if w.dim() != 2:
        raise ValueError(f"{name}: expected a 2-D weight [out, in], got shape {tuple(w.shape)}")
    if w.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"{name}: dtype {w.dtype} not supported (use float32, bfloat16 or float16)")
    if not torch.isfinite(w).all():
        raise ValueError(f"{name}: weight contains NaN or Inf; fix the checkpoint before quantizing")
    gs = None if global_scale is None else torch.as_tensor(global_scale, dtype=torch.float32).reshape(1)
    if gs is not None and not (torch.isfinite(gs).all() and gs.item() > 0):
        raise ValueError(f"{name}: global_scale must be a finite positive number, got {gs.item()}")


def _check_method(method):
    if method not in NVFP4_METHODS:
        raise ValueError(f"unknown NVFP4 method {method!r}: choose one of {', '.join(NVFP4_METHODS)}")


# -----------------------------------------------------------------------------------------------------
# Checkpoint writer: HF folder -> compressed-tensors nvfp4-pack-quantized folder, one output shard at a time
# (HF shards are <= ~5 GB): memory holds that shard's tensors plus the fused group being quantized. Its config,
# checks and reads are quant_checkpoint.py's (its four constants are re-exported here).

NVFP4_QUANT_CONFIG, LINEAR_NAMES = quant_checkpoint.NVFP4_QUANT_CONFIG, quant_checkpoint.LINEAR_NAMES
TOKENIZER_FILES, QUANTIZE_COMMAND = quant_checkpoint.TOKENIZER_FILES, quant_checkpoint.QUANTIZE_COMMAND


def _shard_tensors(model_dir, s, plan, device, log, progress, method="rtn"):
    """Output shard s as {name: tensor}: its other tensors as they are, its weights quantized one fused
    group at a time (progress: [weights done, weights in all])."""
    (headers, where, groups), tensors, read_input = plan, {}, quant_checkpoint.read_input
    quant = {k for members in groups.values() for k in members}
    tensors.update(read_input(os.path.join(model_dir, s), [k for k in headers[s] if k not in quant]))
    for k in tensors:
        log(f"copy   {k} | dtype {headers[s][k]['dtype']} | shape {'x'.join(map(str, headers[s][k]['shape']))}")
    for members in groups.values():
        # The group's global scale needs every member's amax: read the group together (a member
        # stored in another shard is read again there).
        if not any(where[k] == s for k in members):
            continue
        ws = {}
        for k in members:
            ws[k] = read_input(os.path.join(model_dir, where[k]), [k])[k].to(device)
            _check_weight(ws[k], k)  # before the group scale: an Inf would make it 0 and blame a sibling
        gs = nvfp4_global_scale(ws.values(), method)
        for k in (k for k in members if where[k] == s):
            packed, scale, gs_k = quantize_nvfp4(ws[k], gs, name=k, method=method)
            tensors.update({k + "_packed": packed.cpu(), k + "_scale": scale.cpu(), k + "_global_scale": gs_k.cpu()})
            w32 = ws[k].float()
            err = (dequantize_nvfp4(packed, scale, gs_k) - w32).norm() / w32.norm().clamp(min=1e-30)
            progress[0] += 1
            log(f"nvfp4  [{progress[0]}/{progress[1]}] {k} | shape {'x'.join(map(str, w32.shape))} | gs "
                f"{gs.item():.4g} | rel_rms_err {err.item():.4f} | bytes {ws[k].numel() * ws[k].element_size()} "
                f"-> {packed.numel() + scale.numel() + 4}")
    return tensors


def quantize_checkpoint(model_dir, out_dir, fmt="nvfp4", force=False, device=None, log=print, method="rtn"):
    """Write the compressed-tensors NVFP4 version of the HF folder model_dir to out_dir. Everything goes
    to a hidden temporary folder whose files move into place at the end (write_output): nothing half-written,
    and a user's other files in out_dir stay.
    method ("rtn" or "4over6") is recorded in each shard's safetensors metadata; readers ignore it."""
    from safetensors.torch import save_file
    _check_method(method)
    checked = quant_checkpoint.check_checkpoint_args(model_dir, out_dir, fmt, force, device)
    config, weight_map, has_index, device = checked
    plan = headers, where, groups = quant_checkpoint.plan_shards(model_dir, weight_map, config, fused_group)
    n_quant = sum(map(len, groups.values()))
    t0, progress, new_map, sizes = time.time(), [0, n_quant], {}, []

    def write(tmp):
        os.makedirs(tmp)
        for s in headers:
            tensors = _shard_tensors(model_dir, s, plan, device, log, progress, method)
            save_file(tensors, os.path.join(tmp, s), metadata={"format": "pt", "nvfp4_method": method})
            sizes.append(sum(t.numel() * t.element_size() for t in tensors.values()))
            new_map.update(dict.fromkeys(tensors, s))
        files.write_json(os.path.join(tmp, "config.json"), dict(config, quantization_config=NVFP4_QUANT_CONFIG))
        if has_index:
            files.write_json(os.path.join(tmp, "model.safetensors.index.json"),
                             {"metadata": {"total_size": sum(sizes)}, "weight_map": dict(sorted(new_map.items()))})
        for name in TOKENIZER_FILES:
            if os.path.isfile(os.path.join(model_dir, name)):
                shutil.copy2(os.path.join(model_dir, name), os.path.join(tmp, name))

    out_dir = files.write_output(out_dir, write, QUANTIZE_COMMAND)
    bytes_in = sum(v["data_offsets"][1] - v["data_offsets"][0] for h in headers.values() for v in h.values())
    bytes_out = sum(sizes)
    log(f"done | tensors {len(where)} | quantized {n_quant} | bytes {bytes_in / 1e6:.1f} MB -> "
        f"{bytes_out / 1e6:.1f} MB ({bytes_out / max(bytes_in, 1):.3f}x) | time {time.time() - t0:.1f}s | out {out_dir}")
    return {"bytes_in": bytes_in, "bytes_out": bytes_out, "quantized": n_quant, "tensors": len(where)}


# -----------------------------------------------------------------------------------------------------
# Demo (bits, bytes and error of both formats on weights shaped like real layers) and command line


def demo(seed=0):
    g = torch.Generator().manual_seed(seed)
    h, inter, kv = 896, 4864, 2 * 64  # Qwen2.5-0.5B: hidden 896, intermediate 4864, 2 kv heads x 64
    suites = {"4096x4096": [(4096, 4096)],
              "Qwen2.5-0.5B layer": [(h, h), (kv, h), (kv, h), (h, h), (inter, h), (inter, h), (h, inter)]}
    print("random N(0, 0.02^2) bf16 weights; errors relative to the bf16 weight; NF4 without double quantization")
    print(f"{'weights':<20}| {'format':<6}| {'bits/weight':>11} | {'bytes vs bf16':>13} | {'rel RMS err':>11} | "
          f"{'max abs err':>11} | {'quantize ms':>11}")
    for label, shapes in suites.items():
        ws = [(torch.randn(s, generator=g) * 0.02).to(torch.bfloat16) for s in shapes]  # bf16, like checkpoints
        flat = torch.cat([w.float().reshape(-1) for w in ws])                            # (numel,)
        linears = [nn.Linear(w.shape[1], w.shape[0], bias=False, dtype=w.dtype) for w in ws]
        for linear, w in zip(linears, ws):
            linear.weight.data = w
        for fmt, method in [(f, m) for f, cls in WEIGHT_FORMATS.items() for m in cls.methods]:
            t0 = time.perf_counter()
            qs = [WEIGHT_FORMATS[fmt].from_linear(linear, method=method) for linear in linears]
            ms = (time.perf_counter() - t0) * 1e3
            nbytes = sum(t.numel() * t.element_size() for q in qs for t in q.buffers())  # codes, scales, global scale
            d = torch.cat([q.dequantized_weight().reshape(-1) for q in qs]) - flat        # (numel,)
            fmt = fmt if method == "rtn" else method
            print(f"{label:<20}| {fmt:<6}| {8 * nbytes / flat.numel():>11.4f} | {nbytes / (2 * flat.numel()):>13.5f} | "
                  f"{(d.norm() / flat.norm()).item():>11.4f} | {d.abs().max().item():>11.2e} | {ms:>11.1f}")
    print("NVFP4: 4-bit code + one 8-bit scale per 16 + 4 bytes/tensor (fp32 global scale); 4over6 is the same\n"
          "bytes with each block's scale chosen between max -> 6 and max -> 4. NF4 without double\n"
          "quantization: 4-bit code + one fp32 absmax per 64; QLoRA's double quantization brings it to ~4.127 bits.")
    print("Why NVFP4 though NF4's error can be lower: FP4 tensor cores (NVIDIA Blackwell) multiply NVFP4 directly,\n"
          "so the sampler runs 4-bit matmuls instead of dequantizing to bf16 first; that is QeRL's rollout speed-up.")


def show_block(seed=0):
    """--show-block: the first block of 16 of a small random weight through quantize_nvfp4, step by step.
    Every number printed is quantize_nvfp4's or dequantize_nvfp4's own (tests/test_quantize.py checks)."""
    w = torch.randn(4, 64, generator=torch.Generator().manual_seed(seed)) * 0.02  # (4, 64): 16 blocks
    packed, scale, gs = quantize_nvfp4(w)
    block, s, byte = w[0, :NVFP4_BLOCK], scale[0, 0].float(), scale[0, 0].view(torch.uint8).item()
    code = torch.stack((packed[0, :8] & 0xF, packed[0, :8] >> 4), -1).reshape(-1)  # (16,), low nibble first
    w_hat = dequantize_nvfp4(packed, scale, gs)[0, :NVFP4_BLOCK]                    # (16,)
    y = block / (s / gs)                                                            # (16,), before rounding
    e, m = byte >> 3 & 0xF, byte & 7
    fp8 = f"2^({e} - 7) * (1 + {m}/8)" if e else f"2^-6 * {m}/8"
    print(f"NVFP4, one block: a (4, 64) weight ~ N(0, 0.02^2) (seed {seed}), its first 16 weights w[0, 0:16]")
    print(f"1. tensor scale gs = 448 * 6 / amax|W| = 2688 / {w.abs().max().item():.7f} = {gs.item():.8g} (fp32)")
    print(f"2. block scale gs * amax|block| / 6 = {(gs * (block.abs().max() / FP4_MAX)).item():.4f} -> FP8 E4M3 "
          f"s = {s.item():g} (byte 0x{byte:02x} = {fp8})")
    print(f"3. y = w / (s / gs), s / gs = {(s / gs).item():.7f}, rounds to the nearest E2M1 value (ties to even);\n"
          "   its 4-bit code: bit 3 the sign, bits 0-2 which of 0, 0.5, 1, 1.5, 2, 3, 4, 6")
    print(f"{'i':>4} | {'w':>10} | {'y':>7} | {'E2M1':>4} | {'code':>11} | {'w_hat':>10} | {'w_hat - w':>10}")
    for i in range(NVFP4_BLOCK):
        c = code[i].item()
        print(f"{i:>4} | {block[i].item():+.7f} | {y[i].item():+7.3f} | {E2M1_VALUES[c].item():+4.1f} | "
              f"0x{c:x} ({c:04b}) | {w_hat[i].item():+.7f} | {(w_hat[i] - block[i]).item():+.3e}")
    print("4. packed, w[2k] in byte k's low nibble: " + " ".join(f"{b:02x}" for b in packed[0, :8].tolist())
          + " (+ 1 scale byte: 4.5 bits a weight)")
    err = w_hat - block                                                              # (16,)
    print(f"5. w_hat = E2M1 * s / gs: rel RMS error {(err.norm() / block.norm()).item():.4f}, "
          f"max abs error {err.abs().max().item():.3e}")


def main(argv=None):
    p = cli.ArgumentParser(description="NVFP4/NF4 demo, or HF folder -> compressed-tensors NVFP4 checkpoint")
    p.add_argument("--model", help="Hugging Face model folder (config.json + safetensors)")
    p.add_argument("--out", help="output folder for the quantized checkpoint")
    p.add_argument("--format", default="nvfp4", choices=["nvfp4"], help="checkpoint format")
    p.add_argument("--quant-method", default="rtn", choices=NVFP4_METHODS,
                   help="NVFP4 rounding: rtn (compressed-tensors) or 4over6 (per block, max -> 6 or 4)")
    p.add_argument("--force", action="store_true", help="replace --out if it is an earlier output of this command")
    p.add_argument("--device", default=None, help="where to quantize (default: cuda if available, else cpu)")
    p.add_argument("--seed", type=cli.number(int, 0, cli.MAX_SEED), default=0, help="demo and --show-block seed")
    p.add_argument("--show-block", action="store_true", help="print one 16-weight block quantized step by step")
    args = p.parse_args(argv)
    if args.show_block:
        show_block(args.seed)
        return 0
    if args.model is None and args.out is None:
        demo(args.seed)
        return 0
    if not (args.model and args.out):
        p.error("--model and --out go together")
    quantize_checkpoint(args.model, args.out, args.format, args.force, args.device, method=args.quant_method)
    return 0


if __name__ == "__main__":
    sys.exit(cli.run_cli(main))
