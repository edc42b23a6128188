"""Stage 01: store a model's Linear weights in 4 bits as NVFP4, QeRL's frozen base model.

NVFP4 keeps each weight as a 4-bit E2M1 value, with an FP8 (E4M3) scale per block of 16 inputs and
one FP32 scale per tensor: 4.5 bits a weight. The bytes here are exactly compressed-tensors'
`nvfp4-pack-quantized` (the checkpoint format vLLM loads). `NVFP4Linear` is a frozen Linear layer
on those bytes and `quantize_model` puts one in place of every Linear of a model but lm_head. Only
LoRA trains on top of it (stage 02); the rounding noise also raises the policy's entropy (04).

    python 01_quantize.py                          # tiny-qwen's weights: bits, bytes, error, time
    python 01_quantize.py --show-block [--seed N]  # one block of 16 weights, step by step
"""

import argparse
import functools
import importlib
import importlib.machinery
import importlib.util
import os
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors.torch import load_file

HERE = os.path.dirname(os.path.abspath(__file__))

# --------------------------------------------------------------------------------------------------
# NVFP4: E2M1 values, an FP8 E4M3 scale per 16 inputs, an FP32 scale per tensor (all maths in fp32)

FP4_MAX, FP8_MAX, NVFP4_BLOCK = 6.0, 448.0, 16
# Code c (bit 3 = sign, bits 0..2 = index into the 8 magnitudes) decodes to E2M1_VALUES[c].
E2M1_VALUES = torch.tensor(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]
)
# Round to nearest, ties to even: the index is how many midpoints |y| passes. Ties stay down where
# the lower neighbour's mantissa is even (0.25, 1.25, 2.5, 5), go up where the upper one's is.
_E2M1_MIDS = [
    (0.25, False),
    (0.75, True),
    (1.25, False),
    (1.75, True),
    (2.5, False),
    (3.5, True),
    (5.0, False),
]
# The projections of a decoder layer (the Linears that get quantized, and LoRA in stage 02)
LINEAR_NAMES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def nvfp4_global_scale(weights):
    """fp32 (1,) scale 448 * 6 / amax: the largest block lands on the FP8 and E2M1 maxima. amax over
    all of `weights` (a list: one tensor, or a fused group sharing one scale). An all-zero tensor
    would give inf; compressed-tensors then uses 1.0, and so do we."""
    amax = torch.stack([w.detach().abs().amax().float() for w in weights]).max().reshape(1)
    gs = (FP8_MAX * FP4_MAX) / amax.clamp(min=torch.finfo(torch.float32).tiny)
    return torch.nan_to_num(gs, nan=1.0, posinf=1.0, neginf=1.0)


def _block_scales(amax_b, gs):
    """FP8-representable block scales (as fp32) that map each block's amax to 6."""
    s = (gs * (amax_b / FP4_MAX)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float()  # RNE
    # A block far below the tensor's amax (or all zero) underflows FP8 to 0; compressed-tensors
    # then stores 0.125, which avoids a 0/0 below and still decodes the block to ~all zeros.
    return torch.where(s == 0, 0.125, s)  # (out, nb)


def _e2m1_codes(blocks, s, gs):
    """blocks / (s / gs) rounded to the nearest E2M1 value (ties to even) -> 4-bit codes."""
    y = blocks / (s / gs).unsqueeze(-1)  # (out, nb, 16)
    y = y.clamp(-FP4_MAX, FP4_MAX)
    mag = y.abs()
    idx = torch.zeros(y.shape, dtype=torch.uint8, device=y.device)  # (out, nb, 16), 0..7
    for t, tie_goes_up in _E2M1_MIDS:  # seven compares beat torch.bucketize on a CPU
        idx += (mag >= t) if tie_goes_up else (mag > t)
    # y < 0, not signbit: a tiny negative rounded to 0 keeps its sign (0x8); -0.0 gives 0x0.
    return idx | ((y < 0).to(torch.uint8) << 3)  # (out, nb, 16)


@torch.no_grad()
def quantize_nvfp4(w, global_scale=None):
    """w (out, in) -> packed uint8 (out, K_pad/2), fp8 scale (out, K_pad/16), fp32 global scale (1,),
    byte for byte compressed-tensors' round to nearest. Pass global_scale to share one across fused
    layers (q/k/v, gate/up), as vLLM requires."""
    if w.dim() != 2 or not torch.isfinite(w).all():
        raise ValueError(
            f"quantize_nvfp4: want a finite 2-D weight (out, in), got {tuple(w.shape)}"
        )
    w = w.detach().float()
    out_f, in_f = w.shape
    k_pad = -(-in_f // NVFP4_BLOCK) * NVFP4_BLOCK
    if k_pad != in_f:  # zero columns change no block's amax and quantize to code 0
        w = F.pad(w, (0, k_pad - in_f))
    if global_scale is None:
        gs = nvfp4_global_scale([w])
    else:
        gs = torch.as_tensor(global_scale, dtype=torch.float32).reshape(1).clone().to(w.device)
    blocks = w.view(out_f, k_pad // NVFP4_BLOCK, NVFP4_BLOCK)  # (out, nb, 16)
    amax_b = blocks.abs().amax(dim=-1)  # (out, nb)
    s = _block_scales(amax_b, gs)  # (out, nb)
    code = _e2m1_codes(blocks, s, gs).view(out_f, k_pad)  # (out, K_pad)
    packed = code[:, 0::2] | (code[:, 1::2] << 4)  # (out, K_pad/2), even element: low nibble
    return packed.contiguous(), s.to(torch.float8_e4m3fn), gs


# Byte -> its two values (low nibble first): one gather per byte, not an unpack and two gathers.
_NVFP4_BYTE_LUT = E2M1_VALUES[torch.stack((torch.arange(256) & 0xF, torch.arange(256) >> 4), -1)]


def dequantize_nvfp4(packed, scale, global_scale, dtype=torch.float32):
    """-> (out, K_pad): E2M1 value * (fp8 scale / global scale), in fp32, then cast to dtype."""
    vals = _NVFP4_BYTE_LUT.to(packed.device)[packed.long()]  # (out, K_pad/2, 2)
    step = scale.float() / global_scale.float().to(packed.device)  # (out, nb)
    w = vals.view(*step.shape, NVFP4_BLOCK) * step.unsqueeze(-1)  # (out, nb, 16)
    return w.view(packed.shape[0], -1).to(dtype)  # (out, K_pad)


# --------------------------------------------------------------------------------------------------
# The quantized Linear: frozen buffers under compressed-tensors' names (load_state_dict fills them)


@functools.cache
def nvfp4_kernel():
    """kernels/nvfp4_decode.py's nvfp4_matmul, imported on first use (triton is needed on CUDA only).
    Hugging Face's `kernels` package has that folder's import name, so the folder is loaded by its
    path under a private package name (its files import each other relatively)."""
    if "nvfp4_kernels" not in sys.modules:
        spec = importlib.machinery.ModuleSpec("nvfp4_kernels", None, is_package=True)
        spec.submodule_search_locations = [os.path.join(HERE, "kernels")]
        sys.modules["nvfp4_kernels"] = importlib.util.module_from_spec(spec)
    return importlib.import_module("nvfp4_kernels.nvfp4_decode").nvfp4_matmul


class NVFP4Linear(nn.Module):
    """y = x @ W_hat^T + b, W_hat held as NVFP4 (quantize_nvfp4's three tensors) and never trained."""

    def __init__(self, in_features, out_features, bias=False, device=None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        k_pad = -(-in_features // NVFP4_BLOCK) * NVFP4_BLOCK
        o, u8, fp8 = out_features, torch.uint8, torch.float8_e4m3fn
        self.register_buffer("weight_packed", torch.zeros(o, k_pad // 2, dtype=u8, device=device))
        self.register_buffer("weight_scale", torch.zeros(o, k_pad // 16, dtype=fp8, device=device))
        self.register_buffer("weight_global_scale", torch.ones(1, device=device))
        self.register_buffer("bias", torch.zeros(o, device=device) if bias else None)
        self.kept = {}  # {dtype: W_hat (out, in)}: a CPU's dequantized weight, built once

    @classmethod
    def from_linear(cls, linear, global_scale=None):
        m = cls(
            linear.in_features, linear.out_features, linear.bias is not None, linear.weight.device
        )
        m.weight_packed, m.weight_scale, m.weight_global_scale = quantize_nvfp4(
            linear.weight, global_scale
        )
        if linear.bias is not None:
            m.bias = linear.bias.detach().clone()
        return m

    def dequantized_weight(self, dtype=torch.float32):
        w = dequantize_nvfp4(self.weight_packed, self.weight_scale, self.weight_global_scale, dtype)
        return w[:, : self.in_features]  # (out, in), unpadded

    def forward(self, x):  # (..., in) -> (..., out)
        if x.is_cuda:  # CUDA: the Triton kernel reads the 4-bit bytes (same product, fp32 sums)
            return nvfp4_kernel()(
                x, self.weight_packed, self.weight_scale, self.weight_global_scale, self.bias
            )
        # A CPU has no 4-bit matmul: W_hat is frozen, so it is dequantized at the first forward
        # and kept (outside inference mode, so that a training step may save it for backward).
        if x.dtype not in self.kept:
            with torch.inference_mode(False):
                self.kept[x.dtype] = self.dequantized_weight(x.dtype)
        b = None if self.bias is None else self.bias.to(x.dtype)
        return F.linear(x, self.kept[x.dtype], b)

    def _apply(self, fn, recurse=True):
        # .to(torch.bfloat16) would cast the fp8 scales and the fp32 global scale too (an error in
        # every weight): the format's buffers take only the device. The bias converts as usual.
        names = ("weight_packed", "weight_scale", "weight_global_scale")
        keep = {k: self._buffers[k] for k in names}
        super()._apply(fn, recurse)
        for k, t in keep.items():
            self._buffers[k] = t.to(self._buffers[k].device)
        self.kept = {}
        return self

    def extra_repr(self):
        return f"in={self.in_features}, out={self.out_features}, bias={self.bias is not None}"


# --------------------------------------------------------------------------------------------------
# Whole-model quantization. vLLM runs q/k/v (and gate/up) as one fused matmul with one global
# scale, so each group gets the scale of its largest amax (= the smallest of their own scales).

FUSED_GROUPS = {
    "q_proj": "qkv",
    "k_proj": "qkv",
    "v_proj": "qkv",
    "gate_proj": "gate_up",
    "up_proj": "gate_up",
}


def fused_group(name):
    """'model.layers.0.self_attn.k_proj' -> ('model.layers.0.self_attn', 'qkv'); else (name,)."""
    parent, _, leaf = name.rpartition(".")
    return (parent, FUSED_GROUPS[leaf]) if leaf in FUSED_GROUPS else (name,)


def replace_module(model, name, new):
    """Put `new` where model's submodule `name` (e.g. "model.layers.0.mlp.up_proj") is; -> `new`."""
    parent, _, leaf = name.rpartition(".")
    setattr(model.get_submodule(parent), leaf, new)  # get_submodule("") is the model itself
    return new


@torch.no_grad()
def quantize_model(model, skip=("lm_head",)):
    """Replace every nn.Linear (but names containing a `skip` entry) in place; returns model."""
    linears = {
        n: m
        for n, m in model.named_modules()
        if isinstance(m, nn.Linear) and not any(s in n for s in skip)
    }
    groups = {}  # fused group -> its members' weights
    for n, m in linears.items():
        groups.setdefault(fused_group(n), []).append(m.weight)
    scales = {g: nvfp4_global_scale(ws) for g, ws in groups.items()}
    for n, m in linears.items():
        replace_module(model, n, NVFP4Linear.from_linear(m, scales[fused_group(n)]))
    return model


# --------------------------------------------------------------------------------------------------
# Demo: tiny-qwen's Linear weights in NVFP4 (read with safetensors), and one block step by step


def demo(folder=os.path.join(HERE, "assets", "tiny-qwen")):
    """A table: what NVFP4 costs and how far it rounds, per projection of the bundled model."""
    weights = load_file(os.path.join(folder, "model.safetensors"))
    linears = {  # module name -> its weight (out, in)
        k[: -len(".weight")]: w
        for k, w in weights.items()
        if k.endswith(".weight") and k.split(".")[-2] in LINEAR_NAMES
    }
    groups = {}
    for name, w in linears.items():
        groups.setdefault(fused_group(name), []).append(w)
    rows = {leaf: [0.0] * 5 for leaf in LINEAR_NAMES}  # [weights, bytes, err^2, norm^2, seconds]
    quantize_nvfp4(torch.ones(1, 16))  # the first call pays torch's one-time setup: not timed
    for name, w in linears.items():
        t0 = time.perf_counter()
        packed, scale, gs = quantize_nvfp4(w, nvfp4_global_scale(groups[fused_group(name)]))
        seconds = time.perf_counter() - t0
        err = dequantize_nvfp4(packed, scale, gs)[:, : w.shape[1]] - w.float()  # (out, in)
        nbytes = packed.numel() + scale.numel() + 4  # codes, fp8 scales, the fp32 global scale
        row = rows[name.rsplit(".", 1)[-1]]
        for i, v in enumerate((w.numel(), nbytes, err.pow(2).sum(), w.float().pow(2).sum())):
            row[i] += float(v)
        row[4] += seconds
    rows["all"] = [sum(r[i] for r in rows.values()) for i in range(5)]
    print(
        f"{folder}: its {len(linears)} Linear weights (lm_head: tied to the embedding, not quantized)"
    )
    head = f"{'weights':<10}| {'numbers':>8} | {'bits/weight':>11} | {'bytes vs bf16':>13} | "
    print(head + f"{'rel RMS err':>11} | {'quantize ms':>11}")
    for label, (n, nbytes, err2, norm2, seconds) in rows.items():
        print(
            f"{label:<10}| {int(n):>8} | {8 * nbytes / n:>11.3f} | {nbytes / (2 * n):>13.4f} | "
            f"{(err2 / norm2) ** 0.5:>11.4f} | {1e3 * seconds:>11.2f}"
        )
    print(
        "Why NVFP4, not NF4: NF4 (QLoRA's format) can show a lower error at the same 4.5 bits, but\n"
        "NVFP4 is what FP4 tensor cores (Blackwell) compute on directly: rollouts run as 4-bit\n"
        "matmuls (vLLM's path) instead of dequantizing to bf16 first, the paper's speedup."
    )


def show_block(seed=0):
    """One block of 16 of a small random weight through quantize_nvfp4, step by step; every number
    printed is quantize_nvfp4's or dequantize_nvfp4's own."""
    w = torch.randn(4, 64, generator=torch.Generator().manual_seed(seed)) * 0.02  # (4, 64)
    packed, scale, gs = quantize_nvfp4(w)
    block, s, byte = w[0, :NVFP4_BLOCK], scale[0, 0].float(), scale[0, 0].view(torch.uint8).item()
    code = torch.stack((packed[0, :8] & 0xF, packed[0, :8] >> 4), -1).reshape(-1)  # (16,)
    w_hat = dequantize_nvfp4(packed, scale, gs)[0, :NVFP4_BLOCK]  # (16,)
    e, m = byte >> 3 & 0xF, byte & 7
    fp8 = f"2^({e} - 7) * (1 + {m}/8)" if e else f"2^-6 * {m}/8"
    print(f"NVFP4, one block: w[0, 0:16] of a (4, 64) weight ~ N(0, 0.02^2), seed {seed}")
    print(
        f"1. amax|W| = {w.abs().max().item():.7f}: global scale gs = 2688 / amax = {gs.item():.8g}"
    )
    amax_b = block.abs().max()
    print(
        f"2. block amax {amax_b.item():.7f}: gs * amax / 6 = {(gs * amax_b / FP4_MAX).item():.4f}"
        f" -> FP8 E4M3 s = {s.item():g} (byte 0x{byte:02x} = {fp8})"
    )
    print("3. y = w / (s / gs) -> nearest E2M1 (ties to even); code: bit 3 sign, bits 0-2 index")
    print(
        f"{'i':>3} | {'w':>10} | {'y':>7} | {'E2M1':>4} | {'code':>4} | {'w_hat':>10} | {'error':>10}"
    )
    y = block / (s / gs)  # (16,), before rounding
    for i in range(NVFP4_BLOCK):
        c = code[i].item()
        print(
            f"{i:>3} | {block[i].item():+.7f} | {y[i].item():+7.3f} | {E2M1_VALUES[c].item():+4.1f}"
            f" | 0x{c:x}  | {w_hat[i].item():+.7f} | {(w_hat[i] - block[i]).item():+.3e}"
        )
    hexes = " ".join(f"{b:02x}" for b in packed[0, :8].tolist())
    print(f"4. packed (w[2k] in byte k's low nibble): {hexes}, + 1 scale byte: 4.5 bits a weight")
    err = w_hat - block  # (16,)
    print(f"5. w_hat = E2M1 * s / gs: rel RMS error {(err.norm() / block.norm()).item():.4f}")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description="NVFP4 on tiny-qwen's weights, or one block shown")
    p.add_argument("--show-block", action="store_true", help="one block of 16, step by step")
    p.add_argument("--seed", type=int, default=0, help="--show-block's random weight")
    args = p.parse_args()
    if args.show_block:
        show_block(args.seed)
    else:
        demo()
