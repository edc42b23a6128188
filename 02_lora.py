"""Stage 02: LoRA adapters on the frozen 4-bit base model.

QeRL never updates the quantized weights. Every targeted linear layer y = W x keeps its frozen NVFP4
weight W (stage 01) and gets a small trainable side branch, y = W x + (alpha / r) * B A x, with
A (r, in) and B (out, r). B starts at zero, so training starts from exactly the base model, and only
r * (in + out) numbers per layer get gradients and AdamW state (about 1% of a 7B model at r = 32).
This is the part of PEFT that QeRL uses, by hand: `add_lora` wraps every projection in a
`LoRALinear`, `lora_disabled` gives the base model's output (GRPO's reference policy) without a
second copy, `lora_merged` samples on W + (alpha / r) B A (one matmul a layer), and `save_adapter` /
`load_adapter` write and read PEFT's files (PeftModel.from_pretrained loads them).

    python 02_lora.py   # LoRA on tiny-qwen's NVFP4 MLP: counts, a fit, merge, save and load
"""

import importlib
import itertools
import json
import math
import os
import tempfile
from contextlib import contextmanager

import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

quantize = importlib.import_module("01_quantize")

# --------------------------------------------------------------------------------------------------
# The LoRA layer


class LoRALinear(nn.Module):
    """y = base(x) + scaling * B (A x): the frozen base's W x + b plus a trainable rank-r branch,
    A (r, in) and B (out, r) held in fp32."""

    def __init__(self, base, r, alpha, generator=None):
        super().__init__()
        if not isinstance(r, int) or r <= 0:
            raise ValueError(f"LoRA rank r must be a positive integer, got r={r!r}")
        self.base = base.requires_grad_(False)
        self.r, self.alpha, self.scaling = r, alpha, alpha / r
        self.disabled = False  # lora_disabled: the base model's output
        self.merged = None  # (W + scaling * B A, bias) inside lora_merged
        # fp32 adapters whatever the activations: an Adam step of lr 1e-5 is a relative change
        # that bf16's 8 significand bits would round away. Initialised on the CPU, so one seeded
        # generator gives the same adapter on any device.
        first = next(itertools.chain(base.parameters(), base.buffers()), None)
        device = first.device if first is not None else torch.device("cpu")
        A = torch.empty(r, base.in_features, dtype=torch.float32)  # (r, in)
        # Kaiming-uniform, a=sqrt(5): nn.Linear's (and PEFT's) default, U(-1/sqrt(in), 1/sqrt(in)).
        nn.init.kaiming_uniform_(A, a=math.sqrt(5), generator=generator)
        self.lora_A = nn.Parameter(A.to(device))
        # B = 0 makes the wrapped layer start as exactly the base layer.
        B = torch.zeros(base.out_features, r, dtype=torch.float32, device=device)  # (out, r)
        self.lora_B = nn.Parameter(B)

    in_features = property(lambda self: self.base.in_features)
    out_features = property(lambda self: self.base.out_features)

    def forward(self, x):  # (..., in) -> (..., out)
        if self.merged is not None:  # sampling (lora_merged): this function as one cheaper matmul
            return F.linear(x, *self.merged)
        y = self.base(x)  # (..., out) in x.dtype: W x + b, W frozen
        if self.disabled:
            return y  # bit-identical to the base: lora_disabled relies on this
        # The low-rank branch runs in the activations' dtype (autocast off, so nothing else picks
        # it): the fp32 master A and B are cast on the way in; their gradients return in fp32.
        with torch.autocast(x.device.type, enabled=False):
            h = x @ self.lora_A.to(x.dtype).t()  # (..., r)
            return y + (h @ self.lora_B.to(x.dtype).t()) * self.scaling  # (..., out)

    def extra_repr(self):
        return f"r={self.r}, alpha={self.alpha}, scaling={self.scaling:.4g}"


# --------------------------------------------------------------------------------------------------
# Wrapping a model


def lora_layers(model):
    """[(module path, LoRALinear)] in module order."""
    return [(name, m) for name, m in model.named_modules() if isinstance(m, LoRALinear)]


def add_lora(model, r=32, alpha=64, targets=quantize.LINEAR_NAMES, generator=None):
    """Wrap every Linear-like module (nn.Linear, NVFP4Linear) whose name ends in one of `targets`
    with a LoRALinear and freeze every other parameter. Returns the model."""
    targets = (targets,) if isinstance(targets, str) else tuple(targets)
    if lora_layers(model):
        raise ValueError("the model already has LoRA adapters: call add_lora once")
    chosen = [
        (n, m)
        for n, m in model.named_modules()
        if n.rsplit(".", 1)[-1] in targets and hasattr(m, "in_features")
    ]
    missing = set(targets) - {n.rsplit(".", 1)[-1] for n, _ in chosen}
    if missing:
        raise ValueError(
            f"LoRA targets {sorted(missing)} match no Linear of {type(model).__name__}"
        )
    for p in model.parameters():
        p.requires_grad_(False)
    for name, m in chosen:  # module order: one seeded generator gives the same adapters each run
        quantize.replace_module(model, name, LoRALinear(m, r, alpha, generator))
    return model


def lora_parameters(model):
    """The trainable tensors: [A, B] of every LoRA layer, in module order (give these to AdamW)."""
    return [p for _, m in lora_layers(model) for p in (m.lora_A, m.lora_B)]


def count_parameters(model):
    """(trainable, frozen). An NVFP4 layer counts as its in * out weights (+ bias), not its bytes,
    so that the numbers compare with a bf16 model's."""
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    for m in model.modules():
        if isinstance(m, quantize.NVFP4Linear):
            frozen += m.in_features * m.out_features + (0 if m.bias is None else m.bias.numel())
    return trainable, frozen


@contextmanager
def lora_disabled(model):
    """Inside this block the model computes exactly its base output (flags restored on exit)."""
    layers = [m for _, m in lora_layers(model)]
    before = [m.disabled for m in layers]
    for m in layers:
        m.disabled = True
    try:
        yield model
    finally:
        for m, d in zip(layers, before):
            m.disabled = d


@contextmanager
@torch.no_grad()
def lora_merged(model, dtype=None):
    """Inside this block every enabled LoRA layer runs as one F.linear of W + scaling * B A, built
    once by one addmm in `dtype` (default: the model's first parameter's): the same function up to
    rounding, and much cheaper while fixed weights serve many small forwards (sampling on a CPU)."""
    layers = [m for _, m in lora_layers(model) if not m.disabled]
    dtype = dtype or next(model.parameters(), torch.empty(0)).dtype
    for m in layers:
        base, bias = m.base, m.base.bias
        if isinstance(base, nn.Linear):
            w = base.weight.to(dtype)  # (out, in)
        else:
            w = base.dequantized_weight(dtype)  # (out, in)
        B, A = m.lora_B.to(dtype), m.lora_A.to(dtype)  # (out, r), (r, in)
        m.merged = (torch.addmm(w, B, A, alpha=m.scaling), None if bias is None else bias.to(dtype))
    try:
        yield model
    finally:
        for m in layers:
            m.merged = None


# --------------------------------------------------------------------------------------------------
# PEFT's adapter files: adapter_model.safetensors (keys base_model.model.<module path>.lora_A.weight
# and .lora_B.weight, PEFT's inner nn.Linear) and adapter_config.json

PEFT_PREFIX = "base_model.model."  # PeftModel.base_model (LoraModel).model
WEIGHTS_NAME, CONFIG_NAME = "adapter_model.safetensors", "adapter_config.json"
# PEFT config fields that would change what an adapter computes, which this file does not do: an
# adapter that sets one is refused, not read as plain LoRA
UNSUPPORTED = (
    "use_dora",
    "use_rslora",
    "fan_in_fan_out",
    "modules_to_save",
    "rank_pattern",
    "alpha_pattern",
)


def save_adapter(model, folder, base_model_name_or_path=""):
    """Write folder/adapter_model.safetensors and folder/adapter_config.json (PEFT loads them)."""
    layers = lora_layers(model)
    hyper = {(m.r, m.alpha) for _, m in layers}
    if len(hyper) != 1:  # PEFT would need rank_pattern / alpha_pattern
        raise ValueError(f"save_adapter: want LoRA layers of one (r, alpha), got {sorted(hyper)}")
    (r, alpha), tensors = hyper.pop(), {}
    for name, m in layers:
        for part in ("lora_A", "lora_B"):
            t = getattr(m, part).detach().float().cpu().contiguous()
            tensors[f"{PEFT_PREFIX}{name}.{part}.weight"] = t
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": r,
        "lora_alpha": alpha,
        "lora_dropout": 0.0,
        "use_rslora": False,
        "target_modules": sorted({n.rsplit(".", 1)[-1] for n, _ in layers}),
        "bias": "none",
        "base_model_name_or_path": base_model_name_or_path,
        # PEFT's defaults spelled out, so that PEFT reads exactly what this file implements
        "fan_in_fan_out": False,
        "inference_mode": True,
        "modules_to_save": None,
        "init_lora_weights": True,
        "layers_to_transform": None,
        "layers_pattern": None,
        "revision": None,
        "use_dora": False,
    }
    os.makedirs(folder, exist_ok=True)
    save_file(tensors, os.path.join(folder, WEIGHTS_NAME), metadata={"format": "pt"})
    with open(os.path.join(folder, CONFIG_NAME), "w") as f:  # last: a config has its weights
        f.write(json.dumps(config, indent=2) + "\n")
    return folder


def load_adapter(model, folder):
    """Load a PEFT LoRA adapter into `model`: a model without LoRA layers is first wrapped as the
    config says (r, lora_alpha, target_modules); one with them must match the file. -> model."""
    with open(os.path.join(folder, CONFIG_NAME)) as f:
        cfg = json.load(f)
    other = {k: cfg.get(k) for k in UNSUPPORTED}
    if cfg.get("peft_type") != "LORA" or cfg.get("bias", "none") != "none" or any(other.values()):
        raise ValueError(f"{folder}: not a plain LoRA adapter (peft_type LORA, bias none, {other})")
    if not lora_layers(model):
        add_lora(model, cfg["r"], cfg["lora_alpha"], cfg["target_modules"])
    tensors = load_file(os.path.join(folder, WEIGHTS_NAME))
    want = {}  # file key -> the parameter it fills
    for name, m in lora_layers(model):
        if (m.r, m.alpha) != (cfg["r"], cfg["lora_alpha"]):
            file, ours = (cfg["r"], cfg["lora_alpha"]), (m.r, m.alpha)
            raise ValueError(f"{folder}: (r, lora_alpha) {file}, but {name} has LoRA {ours}")
        for part in ("lora_A", "lora_B"):
            want[f"{PEFT_PREFIX}{name}.{part}.weight"] = getattr(m, part)
    bad = set(tensors) ^ set(want) or {k for k, p in want.items() if tensors[k].shape != p.shape}
    if bad:
        raise ValueError(f"{folder}: {len(bad)} tensors missing, extra or misshapen: {min(bad)}")
    with torch.no_grad():
        for k, p in want.items():
            p.copy_(tensors[k])
    return model


# --------------------------------------------------------------------------------------------------
# Demo: LoRA on tiny-qwen's first MLP, frozen in NVFP4, learns a low-rank change of its weights


class MLP(nn.Module):
    """A Qwen2 MLP (SwiGLU), its weights read from a model.safetensors by module path."""

    def __init__(self, weights, prefix):
        super().__init__()
        for name in ("gate_proj", "up_proj", "down_proj"):
            w = weights[f"{prefix}.{name}.weight"]  # (out, in)
            setattr(self, name, nn.Linear(w.shape[1], w.shape[0], bias=False))
            getattr(self, name).weight.data.copy_(w)

    def forward(self, x):  # (B, hidden) -> (B, hidden)
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def demo(steps=120, rank=8, lr=5e-3, seed=0):
    """Counts, a fit through LoRA alone, the merged forward, and a save / load round trip."""
    folder = os.path.join(os.path.dirname(os.path.abspath(__file__)), "assets", "tiny-qwen")
    weights = load_file(os.path.join(folder, "model.safetensors"))
    g = torch.Generator().manual_seed(seed)
    student = quantize.quantize_model(MLP(weights, "model.layers.0.mlp"))
    # The target: the student's own 4-bit weights plus a random rank-`rank` change per projection
    # (30% of the weight's size), which LoRA of that rank can represent exactly.
    teacher = MLP(weights, "model.layers.0.mlp")
    for name, t in teacher.named_children():
        W = getattr(student, name).dequantized_weight()  # (out, in)
        D = torch.randn(W.shape[0], rank, generator=g) @ torch.randn(rank, W.shape[1], generator=g)
        t.weight.data.copy_(W + 0.3 * D * W.norm() / D.norm())
    add_lora(
        student, r=rank, alpha=2 * rank, targets=("gate_proj", "up_proj", "down_proj"), generator=g
    )
    trainable, frozen = count_parameters(student)
    base_bytes = sum(b.numel() * b.element_size() for b in student.buffers())
    print(f"tiny-qwen layer 0 MLP in NVFP4, LoRA r={rank} on gate/up/down_proj")
    print(
        f"parameters: trainable {trainable:,} | frozen base {frozen:,} ({trainable / frozen:.1%})"
    )
    print(
        f"bytes: base {base_bytes:,} in NVFP4 vs {2 * frozen:,} in bf16 | adapters {4 * trainable:,}"
    )
    opt = torch.optim.AdamW(lora_parameters(student), lr=lr, weight_decay=0.0)
    base_before = [b.clone() for b in student.buffers()]
    for step in range(steps + 1):
        x = torch.randn(256, 128, generator=g)  # (B, hidden)
        with torch.no_grad():
            target = teacher(x)  # (B, hidden)
        loss = (student(x) - target).pow(2).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if step % 20 == 0:
            print(f"step {step:4d} | loss {loss.item():.3e}")
    frozen_ok = all(torch.equal(a, b) for a, b in zip(base_before, student.buffers()))
    print(f"the 4-bit base unchanged by training: {frozen_ok}")
    x = torch.randn(64, 128, generator=g)  # (B, hidden)
    with torch.no_grad():
        y = student(x)
        with lora_merged(student):
            y_merged = student(x)
        with lora_disabled(student):
            y_base = student(x)
    print(f"merged W + s B A vs unmerged: max |diff| {(y_merged - y).abs().max().item():.2e}")
    print(f"LoRA's change of the output: max |diff| {(y - y_base).abs().max().item():.2e}")
    with tempfile.TemporaryDirectory() as tmp:
        save_adapter(student, tmp, folder)
        keys = sorted(load_file(os.path.join(tmp, WEIGHTS_NAME)))
        fresh = load_adapter(quantize.quantize_model(MLP(weights, "model.layers.0.mlp")), tmp)
        with torch.no_grad():
            same = torch.equal(fresh(x), y)
    print(f"saved {len(keys)} tensors ({keys[0]}, ...) + {CONFIG_NAME}")
    print(f"loaded into a fresh NVFP4 MLP: the same outputs bit for bit: {same}")


if __name__ == "__main__":
    demo()
