"""Stage 02: LoRA adapters on a frozen (4-bit) base model.

QeRL never updates the quantized weights. Every targeted linear layer y = W x keeps its frozen NVFP4
weight W and gets a small trainable side branch, y = W x + (alpha / r) * B A x, with A [r, in] and
B [out, r]. B starts at zero, so training starts from exactly the base model, and only
r * (in + out) numbers per layer get gradients and AdamW state (about 1% of a 7B model at r = 32).
This is the part of PEFT that QeRL uses, by hand: `LoRALinear` wraps any frozen [..., in] ->
[..., out] module (nn.Linear, NVFP4Linear, NF4Linear); `add_lora` puts one on every projection;
`lora_disabled` gives the base model's output (GRPO's reference policy) without a second copy.
Part 2: `lora_merged` runs each layer as one matmul of W + (alpha / r) B A while the weights are
fixed (sampling: the same function, cheaper); `merge_lora` folds B A into the base for good;
`save_adapter` / `load_adapter` write and read PEFT's files (PeftModel.from_pretrained loads them).

Run the demo (a frozen NVFP4 MLP learns a teacher through LoRA alone, < 30 s on 2 CPU cores):
    python qerl/lora.py
"""
import importlib
import math
import os
import sys
import time
from contextlib import contextmanager

if __package__ in (None, ""):  # run as a file (python qerl/lora.py): the checkout heads sys.path, not qerl/
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from qerl import cli
from qerl import devices
from qerl import files
from qerl import hf_files

from qerl import quantize

stage02 = importlib.import_module("02_lora")  # the stage this module extends: its definitions, used as they are
CONFIG_NAME = stage02.CONFIG_NAME
PEFT_PREFIX = stage02.PEFT_PREFIX
WEIGHTS_NAME = stage02.WEIGHTS_NAME

DEFAULT_TARGETS = quantize.LINEAR_NAMES  # every projection of a decoder layer

# -----------------------------------------------------------------------------
# The LoRA layer


class LoRALinear(nn.Module):
    """y = base(x) + scaling * B (A dropout(x)): the frozen base's W x + b plus a trainable
    rank-r branch, A [r, in] and B [out, r] held in fp32."""

    def __init__(self, base, r, alpha, dropout=0.0, use_rslora=False, generator=None):
        super().__init__()
        _check_rank(r)
        self.base = base.requires_grad_(False)
        self.r, self.alpha, self.use_rslora = int(r), alpha, use_rslora
        # rsLoRA (Kalajdzievski 2023): alpha/sqrt(r) keeps the update size stable as r grows.
        self.scaling = alpha / math.sqrt(r) if use_rslora else alpha / r
        self.lora_dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.disabled = False
        self.merged = None  # (W + scaling * B A, bias) inside lora_merged (Part 2)
        # fp32 adapters whatever the activations: an Adam step of lr 1e-5 is a relative change
        # that bf16's 8 significand bits would round away. Initialised on the CPU, so one seeded
        # generator gives the same adapter on any device.
        device = devices.model_device(base)
        A = torch.empty(r, base.in_features, dtype=torch.float32)  # (r, in)
        # Kaiming-uniform, a=sqrt(5): nn.Linear's (and PEFT's) default, U(-1/sqrt(in), 1/sqrt(in)).
        nn.init.kaiming_uniform_(A, a=math.sqrt(5), generator=generator)
        self.lora_A = nn.Parameter(A.to(device))
        # B = 0 makes the wrapped layer start as exactly the base layer.
        B = torch.zeros(base.out_features, r, dtype=torch.float32, device=device)  # (out, r)
        self.lora_B = nn.Parameter(B)

    in_features = property(lambda self: self.base.in_features)
    out_features = property(lambda self: self.base.out_features)

    def forward(self, x):  # x (..., in) -> (..., out)
        if self.merged is not None:  # sampling (lora_merged): this function as one cheaper matmul
            return F.linear(x, *self.merged)
        y = self.base(x)  # (..., out) in x.dtype: W x + b, W frozen
        if self.disabled:
            return y  # bit-identical to the base: lora_disabled relies on this
        # The low-rank branch runs in the activations' dtype (autocast off, so nothing else picks
        # it): the fp32 master A and B are cast on the way in; their gradients return in fp32.
        with torch.autocast(x.device.type, enabled=False):
            h = self.lora_dropout(x) @ self.lora_A.to(x.dtype).t()  # (..., r)
            return y + (h @ self.lora_B.to(x.dtype).t()) * self.scaling  # (..., out)

    def extra_repr(self):
        return (f"r={self.r}, alpha={self.alpha}, scaling={self.scaling:.4g}, "
                f"disabled={self.disabled}")


# -----------------------------------------------------------------------------
# Wrapping a model


def _is_linear_like(m):  # nn.Linear or a quantized one, not already wrapped
    has_features = hasattr(m, "in_features") and hasattr(m, "out_features")
    return has_features and not isinstance(m, LoRALinear)


def _lora_layers(model):
    return [(name, m) for name, m in model.named_modules() if isinstance(m, LoRALinear)]


def add_lora(model, r=32, alpha=64, targets=DEFAULT_TARGETS, dropout=0.0, use_rslora=False,
             generator=None):
    """Wrap every Linear-like module whose name ends in one of `targets` with a LoRALinear,
    freeze every other parameter, print the trainable/frozen counts. Returns the model."""
    _check_rank(r)
    targets = (targets,) if isinstance(targets, str) else tuple(targets)
    linear = [(n, m) for n, m in model.named_modules() if n and _is_linear_like(m)]
    chosen = [(n, m) for n, m in linear if n.rsplit(".", 1)[-1] in targets]
    _check_targets(model, targets, linear, chosen)  # and that the model has no LoRA yet
    for p in model.parameters():
        p.requires_grad_(False)
    for name, m in chosen:
        lora = LoRALinear(m, r, alpha, dropout, use_rslora, generator)
        quantize.replace_module(model, name, lora)
    _print_added(model, chosen, targets, r, alpha)
    return model


@contextmanager
def lora_disabled(model):
    """Inside this block the model computes exactly its base output (flags restored on exit)."""
    layers = [m for _, m in _lora_layers(model)]
    before = [m.disabled for m in layers]
    for m in layers:
        m.disabled = True
    try:
        yield model
    finally:
        for m, d in zip(layers, before):
            m.disabled = d


def lora_parameters(model):
    """The trainable tensors: [A, B] of every LoRA layer, in module order (give these to AdamW)."""
    return [p for _, m in _lora_layers(model) for p in (m.lora_A, m.lora_B)]


# ======================= Part 2: plumbing (merged weights, PEFT files, demo, command line) =======================
# -----------------------------------------------------------------------------
# Merged weights: for sampling while the adapters are fixed (lora_merged), and for good (merge_lora)


@contextmanager
@torch.no_grad()
def lora_merged(model, dtype=None):
    """Inside this block every enabled LoRA layer runs as one F.linear of W + scaling * B A, built once by one
    addmm in `dtype` (default: the model's first parameter's): the same function up to rounding, and much
    cheaper when fixed weights serve many small forwards (sampling). Costs a float copy of each weight."""
    layers = [m for _, m in _lora_layers(model) if not m.disabled]
    dtype = dtype or next(model.parameters(), torch.empty(0)).dtype
    for m in layers:
        base, bias = m.base, getattr(m.base, "bias", None)
        w = base.weight_in(dtype) if hasattr(base, "weight_in") else base.weight.to(dtype)  # (out, in)
        m.merged = (torch.addmm(w, m.lora_B.to(dtype), m.lora_A.to(dtype), alpha=m.scaling),
                    None if bias is None else bias.to(dtype))
    try:
        yield model
    finally:
        for m in layers:
            m.merged = None


def _merged_weight(m):
    """W + scaling * B A of one LoRA layer in fp32 (W dequantized for a 4-bit base)."""
    base = m.base
    w = base.dequantized_weight(torch.float32) if hasattr(base, "dequantized_weight") else base.weight.float()
    return w + (m.lora_B.float() @ m.lora_A.float()) * m.scaling  # (out, in)


@torch.no_grad()
def merge_lora(model):
    """Replace each LoRALinear by its base with W + scaling * B A folded in. A quantized base is
    dequantized, merged and re-quantized with its own class, and the error this adds is printed."""
    errors = []
    for name, m in _lora_layers(model):
        base, exact = m.base, _merged_weight(m)  # (out, in) fp32
        if isinstance(base, nn.Linear):
            base.weight.copy_(exact.to(base.weight.dtype))  # one rounding
            merged = base
        elif hasattr(base, "dequantized_weight") and hasattr(type(base), "from_linear"):
            bias = getattr(base, "bias", None)
            tmp = nn.Linear(base.in_features, base.out_features, bias=False, device=exact.device)
            tmp.weight.copy_(exact)
            # Note: every merged module gets its own global scale here; a shared q/k/v scale
            # would need stage 01's quantize_model on a dequantized, merged float model.
            kw = {"blocksize": base.blocksize} if hasattr(base, "blocksize") else {}  # NF4's block size
            merged = type(base).from_linear(tmp, **kw)
            if bias is not None:
                merged.bias = bias.detach().clone()  # the bias is untouched by LoRA: keep it as is
            err = merged.dequantized_weight(torch.float32) - exact
            errors.append((err.pow(2).mean().sqrt() / exact.pow(2).mean().sqrt().clamp_min(1e-30)).item())
        else:
            raise ValueError(f"merge_lora: cannot merge into {name} of type {type(base).__name__}: need "
                             f"nn.Linear or a quantized module with dequantized_weight() and from_linear()")
        quantize.replace_module(model, name, merged.requires_grad_(False))
    if errors:
        print(f"merge_lora | re-quantized {len(errors)} modules | merge error (rel RMS of re-quantized vs "
              f"exact merged weight) mean {sum(errors) / len(errors):.4e} | max {max(errors):.4e}")
    return model


# -----------------------------------------------------------------------------
# Saving and loading in PEFT's layout (the file names and key prefix: stage 02's)


def lora_state_dict(model):
    """{"<module path>.lora_A": tensor, "<module path>.lora_B": tensor} (detached, shared storage)."""
    return {f"{name}.{part}": getattr(m, part).detach()
            for name, m in _lora_layers(model) for part in ("lora_A", "lora_B")}


def _read_adapter_tensors(path):
    try:
        return load_file(path)
    except (SafetensorError, OSError, ValueError) as e:
        raise ValueError(hf_files.safetensors_problem(path) or f"{path} is not a readable safetensors file "
                         f"({e}); the file is truncated or corrupt, write or download it again") from None


def _bad_config_fields(cfg):
    """The adapter_config.json fields load_adapter reads that are missing or do not make sense."""
    def number(v):
        return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
    targets = cfg.get("target_modules")
    ok = {"r": isinstance(cfg.get("r"), int) and not isinstance(cfg.get("r"), bool) and cfg.get("r") > 0,
          "lora_alpha": number(cfg.get("lora_alpha")),
          "target_modules": isinstance(targets, str) or isinstance(targets, list) and targets
          and all(isinstance(t, str) for t in targets),
          "lora_dropout": number(cfg.get("lora_dropout", 0.0)) and 0 <= cfg.get("lora_dropout", 0.0) < 1,
          "use_rslora": isinstance(cfg.get("use_rslora", False), bool),
          "modules_to_save": cfg.get("modules_to_save") is None or isinstance(cfg.get("modules_to_save"), list)
          and all(isinstance(m, str) for m in cfg["modules_to_save"])}
    return [k for k, good in ok.items() if not good]


def _check_rank(r):
    if not isinstance(r, int) or r <= 0:
        raise ValueError(f"LoRA rank r must be a positive integer, got r={r!r}")


def _check_targets(model, targets, linear, chosen):
    """add_lora's checks: no LoRA yet, and each target names some Linear-like module."""
    if _lora_layers(model):
        raise ValueError("model already has LoRA adapters: call add_lora once (or merge_lora first)")
    leaves = sorted({n.rsplit(".", 1)[-1] for n, _ in linear})
    missing = [t for t in targets if t not in {n.rsplit(".", 1)[-1] for n, _ in chosen}]
    if missing:
        raise ValueError(f"LoRA target(s) {missing} match no Linear-like module in "
                         f"{type(model).__name__}; available leaf names: {leaves}")


def _print_added(model, chosen, targets, r, alpha):
    """add_lora's line: what it wrapped, and the trainable and frozen counts."""
    trainable, frozen = count_parameters(model)
    print(f"add_lora | wrapped {len(chosen)} modules {sorted(set(targets))} | r {r} | alpha {alpha} | "
          f"trainable {trainable:,} ({100 * trainable / max(trainable + frozen, 1):.3f}%) | frozen {frozen:,} "
          f"(quantized weights counted as logical in*out values)")


def count_parameters(model):
    """(trainable, frozen). Quantized modules count as their logical in*out weights (+ bias), not
    as the packed bytes they are stored in, so the numbers compare with a bf16 model's."""
    trainable, frozen, seen = 0, 0, set()
    for m in model.modules():
        for p in m.parameters(recurse=False):
            if id(p) not in seen:  # tied weights (embeddings / lm_head) count once
                seen.add(id(p))
                if p.requires_grad:
                    trainable += p.numel()
                else:
                    frozen += p.numel()
        if hasattr(m, "dequantized_weight"):  # NVFP4Linear / NF4Linear: weights live in buffers
            bias = getattr(m, "bias", None)
            bias_count = bias.numel() if bias is not None and not isinstance(bias, nn.Parameter) else 0
            frozen += m.in_features * m.out_features + bias_count  # (a Parameter bias is counted above)
    return trainable, frozen


def _saved_modules(model, names):
    """{"<module path>.<param>": Parameter} of every module whose leaf name is in `names` (PEFT's
    modules_to_save: trained in full next to the adapters, e.g. the RMSNorm gains). A LoRA layer and the
    modules inside it (its frozen "base") are never among them: PEFT has no such module to save."""
    inside = {id(sub) for m in model.modules() if isinstance(m, LoRALinear) for sub in m.modules()}
    return {f"{path}.{k}": p for path, m in model.named_modules()
            if path and path.rsplit(".", 1)[-1] in names and id(m) not in inside
            for k, p in m.named_parameters(recurse=False)}


def _trained_in_full(model):
    """The leaf names of the modules whose own parameters train beside the LoRA layers (05 --train-norms)."""
    inside = {id(sub) for m in model.modules() if isinstance(m, LoRALinear) for sub in m.modules()}
    return sorted({path.rsplit(".", 1)[-1] for path, m in model.named_modules() if path and id(m) not in inside
                   and any(p.requires_grad for p in m.parameters(recurse=False))})


def _layer_settings(layers):
    """The adapter_config.json fields every LoRA layer shares: r, lora_alpha, lora_dropout, use_rslora."""
    hyper = {(m.r, m.alpha, m.lora_dropout.p if isinstance(m.lora_dropout, nn.Dropout) else 0.0,
              m.use_rslora) for _, m in layers}
    if len(hyper) != 1:  # PEFT would need rank_pattern/alpha_pattern for this; we never do it
        raise ValueError(f"the LoRA layers disagree on (r, alpha, dropout, rslora): {sorted(hyper)}")
    return dict(zip(("r", "lora_alpha", "lora_dropout", "use_rslora"), *hyper))


def save_adapter(model, folder, base_model_name_or_path="", modules_to_save=None):
    """Write folder/adapter_model.safetensors + folder/adapter_config.json (loadable by PEFT).
    modules_to_save: leaf names of modules trained in full (e.g. ["input_layernorm"]); their
    parameters are saved as stored, under the keys PEFT writes for its modules_to_save."""
    layers = _lora_layers(model)
    if not layers:
        raise ValueError("save_adapter: the model has no LoRA layers; call add_lora(model, ...) first")
    if os.path.exists(folder) and not os.path.isdir(folder):
        raise ValueError(f"save_adapter: {folder} is a file, not a folder: choose a folder name for the adapter")
    settings = _layer_settings(layers)
    tensors = {f"{PEFT_PREFIX}{name}.{part}.weight": getattr(m, part).detach().float().cpu().contiguous()
               for name, m in layers for part in ("lora_A", "lora_B")}  # PEFT's inner nn.Linear is ".weight"
    modules_to_save = sorted(modules_to_save) if modules_to_save else None
    if modules_to_save:
        full = _saved_modules(model, modules_to_save)
        found = {k.rsplit(".", 2)[-2] for k in full}
        if set(modules_to_save) - found:
            raise ValueError(f"save_adapter: modules_to_save {sorted(set(modules_to_save) - found)} match no "
                             f"module with parameters in {type(model).__name__}")
        tensors.update({f"{PEFT_PREFIX}{k}": p.detach().cpu().contiguous() for k, p in full.items()})
    config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", **settings,
        "target_modules": sorted({n.rsplit(".", 1)[-1] for n, _ in layers}),
        "bias": "none", "base_model_name_or_path": base_model_name_or_path,
        # Defaults spelled out so that PEFT reads exactly what this file implements:
        "fan_in_fan_out": False, "inference_mode": True, "modules_to_save": modules_to_save, "init_lora_weights": True,
        "layers_to_transform": None, "layers_pattern": None, "revision": None, "use_dora": False,
    }
    files.atomic_write(os.path.join(folder, WEIGHTS_NAME), lambda p: save_file(tensors, p, metadata={"format": "pt"}))
    # The config goes last: a folder with a config always has its weights.
    files.write_json(os.path.join(folder, CONFIG_NAME), config)
    return folder


# adapter_config.json fields that change what an adapter computes, which load_adapter does not implement, with
# PEFT's defaults: an adapter with another value is refused
UNSUPPORTED_FIELDS = {"use_dora": False, "bias": "none", "rank_pattern": {}, "alpha_pattern": {},
                      "fan_in_fan_out": False, "layers_to_transform": None, "layers_pattern": None,
                      "layer_replication": None, "lora_bias": False, "exclude_modules": None,
                      "trainable_token_indices": None, "target_parameters": None, "use_qalora": False,
                      "megatron_config": None, "alora_invocation_tokens": None, "arrow_config": None,
                      "use_bdlora": None, "kasa_config": None, "monteclora_config": None}
# Of those, the fields PEFT reads alike empty and at their default (no pattern, no module excluded, no layer
# replicated...). Any other empty value is refused: layers_to_transform [] adapts no layer at all.
EMPTY_AS_DEFAULT = ("rank_pattern", "alpha_pattern", "layers_pattern", "layer_replication", "exclude_modules",
                    "trainable_token_indices", "target_parameters", "megatron_config")
# init_lora_weights: how PEFT made the adapter before training. These leave the base weights as they are, so the
# file's A and B over the base are the adapter (what load_adapter computes); PiSSA, OLoRA, CorDA, LoftQ, LoRA-GA
# and the rest start from a base rewritten (W - A0 B0, or requantized), which this model does not hold.
PLAIN_INITS = (True, False, "gaussian")


def _unsupported(cfg):
    """The first adapter_config.json field load_adapter does not implement, as (name, value, what it reads), or None."""
    for k, default in UNSUPPORTED_FIELDS.items():
        v = cfg.get(k, default)
        if v != default and not (v is None or k in EMPTY_AS_DEFAULT and v in ("", [], {})):
            return k, v, repr(default)
    init = cfg.get("init_lora_weights")  # (None: not given, PEFT's true)
    if init is not None and (type(init) not in (bool, str) or init not in PLAIN_INITS):  # 1 is not JSON's true
        return "init_lora_weights", init, "true, false or gaussian: an adapter over the base as it is"
    return None


def check_config_fits(model, cfg, folder):
    """An adapter's config against a model that already has LoRA layers: the file's target_modules, r,
    lora_alpha, lora_dropout, use_rslora and modules_to_save must be the model's (its layers', and the modules
    it trains in full), else one ValueError naming the field and both values."""
    layers = _lora_layers(model)
    wrapped, saved = sorted({n.rsplit(".", 1)[-1] for n, _ in layers}), cfg["target_modules"]
    if sorted([saved] if isinstance(saved, str) else saved) != wrapped:
        raise ValueError(f"adapter in {folder} targets {saved} but the model's LoRA layers wrap {wrapped}: "
                         f"call add_lora with targets={saved}")
    file = {"r": cfg["r"], "lora_alpha": cfg["lora_alpha"], "lora_dropout": cfg.get("lora_dropout", 0.0),
            "use_rslora": cfg.get("use_rslora", False), "modules_to_save": sorted(cfg.get("modules_to_save") or [])}
    for k, v in {**_layer_settings(layers), "modules_to_save": _trained_in_full(model)}.items():
        if file[k] != v:
            what = "trains in full beside its LoRA layers" if k == "modules_to_save" else "has LoRA layers of"
            raise ValueError(f"{os.path.join(folder, CONFIG_NAME)}: {k} is {file[k]!r}, but the model it loads into "
                             f"{what} {v!r}: the adapter was made with other settings, or edited")


def load_adapter(model, folder):
    """Load a PEFT-layout adapter into `model`: a model without LoRA layers is wrapped first as the file says
    (r, alpha, targets...); one with them must match the file (check_config_fits). Mismatches raise one clear
    ValueError. Returns the model."""
    if not os.path.isdir(folder):
        raise FileNotFoundError(f"adapter folder {folder!r} does not exist (expected {CONFIG_NAME} + {WEIGHTS_NAME})")
    for f in (CONFIG_NAME, WEIGHTS_NAME):
        if not os.path.exists(os.path.join(folder, f)):
            raise FileNotFoundError(f"adapter folder {folder!r} has no {f}: is it a PEFT LoRA adapter folder?")
        files.check_regular(os.path.join(folder, f))  # a pipe would block the reader: one line instead
    path = os.path.join(folder, CONFIG_NAME)
    cfg = files.read_json(path)
    if cfg.get("peft_type") != "LORA":
        raise ValueError(f"{folder}: only plain LoRA adapters are supported, got peft_type={cfg.get('peft_type')!r}")
    unsupported = _unsupported(cfg)  # read as plain LoRA, such an adapter would compute another function
    if unsupported:
        k, v, reads = unsupported
        raise ValueError(f"{path}: {k} is {v!r}, which load_adapter does not implement (plain LoRA only, {k} "
                         f"{reads}): load this adapter with PEFT")
    bad = _bad_config_fields(cfg)
    if bad:
        raise ValueError(f"{path}: missing or malformed {', '.join(bad)}")
    if _lora_layers(model):  # the model's own layers say what the adapter must be (05's --resume: its run's)
        check_config_fits(model, cfg, folder)
    else:
        add_lora(model, r=cfg["r"], alpha=cfg["lora_alpha"], targets=cfg["target_modules"],
                 dropout=cfg.get("lora_dropout", 0.0), use_rslora=cfg.get("use_rslora", False))
    layers = dict(_lora_layers(model))
    tensors = _read_adapter_tensors(os.path.join(folder, WEIGHTS_NAME))
    full = _saved_modules(model, cfg.get("modules_to_save") or [])  # trained in full: loaded as they are
    problems = [f"adapter has no {PEFT_PREFIX}{k} for modules_to_save" for k in full if PEFT_PREFIX + k not in tensors]
    problems += [f"adapter {PEFT_PREFIX}{k} has shape {list(tensors[PEFT_PREFIX + k].shape)} but the model's is "
                 f"{list(p.shape)}" for k, p in full.items()
                 if PEFT_PREFIX + k in tensors and tensors[PEFT_PREFIX + k].shape != p.shape]
    for name, m in layers.items():
        for part in ("lora_A", "lora_B"):
            key = f"{PEFT_PREFIX}{name}.{part}.weight"
            want = list(getattr(m, part).shape)
            if key not in tensors:
                problems.append(f"adapter has no {key} for model module {name}")
            elif list(tensors[key].shape) != want:
                problems.append(f"adapter {key} has shape {list(tensors[key].shape)} but model module {name} "
                                f"expects {want}: was it trained on another model or rank?")
    extra = sorted(set(tensors) - {f"{PEFT_PREFIX}{n}.{p}.weight" for n in layers for p in ("lora_A", "lora_B")}
                   - {PEFT_PREFIX + k for k in full})
    problems += [f"adapter has {k} but the model has no such LoRA module" for k in extra]
    if problems:
        more = f" (and {len(problems) - 1} more mismatches)" if len(problems) > 1 else ""
        raise ValueError(f"load_adapter: {os.path.join(folder, WEIGHTS_NAME)}: {problems[0]}{more}")
    with torch.no_grad():
        for name, m in layers.items():
            m.lora_A.copy_(tensors[f"{PEFT_PREFIX}{name}.lora_A.weight"])
            m.lora_B.copy_(tensors[f"{PEFT_PREFIX}{name}.lora_B.weight"])
        for k, p in full.items():
            p.copy_(tensors[PEFT_PREFIX + k])  # exact when the model holds them in the saved dtype
    return model


# -----------------------------------------------------------------------------
# Demo: a frozen NVFP4 MLP learns a teacher through LoRA alone


class TinyMLP(nn.Module):
    def __init__(self, d=128, h=512):
        super().__init__()
        self.fc1, self.fc2, self.fc3 = nn.Linear(d, h), nn.Linear(h, h), nn.Linear(h, d)

    def forward(self, x):  # (B, d) -> (B, d)
        return self.fc3(torch.relu(self.fc2(torch.relu(self.fc1(x)))))


def demo(steps=300, rank=8, lr=5e-3, batch=256, seed=0, device=None, fmt="nvfp4"):
    """fmt: any of quantize.WEIGHT_FORMATS (--quant's choices but "none": the demo's base is frozen 4-bit)."""
    device = device or devices.autodetect_device()
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)  # nn.Linear's own init
    student = quantize.quantize_model(TinyMLP().to(device), fmt=fmt, skip=())
    targets = ("fc1", "fc2", "fc3")
    # The teacher is what the student can represent exactly: the student's own 4-bit weights
    # plus a rank-`rank` change per layer (30% of the weight's size). LoRA must find that change.
    teacher = TinyMLP().to(device)
    with torch.no_grad():
        for t in targets:
            W, b = getattr(student, t).dequantized_weight(torch.float32), getattr(student, t).bias  # (out, in)
            U = torch.randn(W.shape[0], rank, generator=g).to(device)  # (out, r)
            V = torch.randn(rank, W.shape[1], generator=g).to(device)  # (r, in)
            D = U @ V  # (out, in)
            getattr(teacher, t).weight.copy_(W + 0.3 * D * W.norm() / D.norm())
            getattr(teacher, t).bias.copy_(b.float())
    add_lora(student, r=rank, alpha=2 * rank, targets=targets, generator=g)
    opt = torch.optim.AdamW(lora_parameters(student), lr=lr, weight_decay=0.0)
    loss0 = None
    for step in range(steps + 1):
        t0 = time.time()
        x = torch.randn(batch, 128, generator=g).to(device)  # (B, d)
        with torch.no_grad():
            y = teacher(x)  # (B, d)
        loss = (student(x) - y).pow(2).mean()
        if not torch.isfinite(loss):  # else the merge below would blame the weights it is handed
            raise ValueError(f"step {step}: the loss is {loss.item()}: training diverged; lower --lr (now {lr:g})")
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        loss0 = loss0 or loss.item()
        if step % 25 == 0:
            print(f"step {step:4d} | loss {loss.item():.6f} | loss/loss0 {loss.item() / loss0:.4f} | "
                  f"lr {lr:.0e} | {1000 * (time.time() - t0):.1f} ms")
    trainable, frozen = count_parameters(student)
    base_bytes = sum(b.numel() * b.element_size() for n, b in student.named_buffers() if ".base." in n)
    adapter_bytes = sum(p.numel() * p.element_size() for p in lora_parameters(student))
    adam_bytes = sum(v.numel() * v.element_size() for s in opt.state.values() for v in s.values()
                     if torch.is_tensor(v))
    share = trainable / (trainable + frozen)
    print(f"\nparameters: trainable {trainable:,} | frozen {frozen:,} | trainable share {share:.2%}")
    print(f"{'memory':<42}{'bytes':>12}")
    for label, n in [(f"base weights, {fmt.upper()} (packed+scales+bias)", base_bytes),
                     ("  same weights in bf16 (for comparison)", 2 * frozen),
                     ("LoRA adapters A, B (fp32)", adapter_bytes),
                     ("LoRA gradients (fp32)", adapter_bytes),
                     ("AdamW state (exp_avg, exp_avg_sq, step)", adam_bytes),
                     ("  full fine-tune AdamW state, fp32", 8 * frozen)]:
        print(f"{label:<42}{n:>12,}")
    with torch.no_grad():
        x = torch.randn(1024, 128, generator=g).to(device)  # (B, d)
        y = teacher(x)  # (B, d)
        unmerged = (student(x) - y).pow(2).mean().item()
        merged = (merge_lora(student)(x) - y).pow(2).mean().item()
    print(f"held-out loss | LoRA unmerged {unmerged:.6f} | merged into {fmt.upper()} {merged:.6f} | start {loss0:.6f}")
    return loss0, loss.item()


def main(argv=None):
    number = cli.number
    ap = cli.ArgumentParser(description="LoRA on a frozen 4-bit MLP (stage 02 demo)")
    ap.add_argument("--quant", default="nvfp4", choices=list(quantize.WEIGHT_FORMATS),
                    help="the frozen base's format (the registry's, read when this parser is built)")
    ap.add_argument("--steps", type=number(int, 1), default=300, help="AdamW steps")
    ap.add_argument("--rank", type=number(int, 1, 128), default=8,
                    help="LoRA rank (also the teacher's change rank; at most 128, the MLP's narrowest side)")
    ap.add_argument("--lr", type=number(float, above=0), default=5e-3, help="AdamW learning rate")
    ap.add_argument("--seed", type=number(int, 0, cli.MAX_SEED), default=0, help="seed of the torch.Generator")
    ap.add_argument("--device", default=None, help="cuda | cpu (default: autodetect)")
    args = ap.parse_args(argv)
    demo(args.steps, args.rank, args.lr, seed=args.seed, device=devices.pick_device(args.device), fmt=args.quant)
    return 0


if __name__ == "__main__":
    sys.exit(cli.run_cli(main))
