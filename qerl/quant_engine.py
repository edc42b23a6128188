"""The engine beneath stage 01's quantized Linear layers (NVFP4Linear, NF4Linear). Imports no stage.

01 shows the method: a quantized layer computes y = F.linear(x, W, b), W dequantized from its 4-bit
buffers. This module holds what its layers inherit beyond that, none of which changes a number:

- `RebuiltWeightLinear`: the same product, with W rebuilt in backward instead of saved for it. Autograd
  would otherwise keep every layer's full-precision W until backward: the unquantized model's memory in a
  LoRA step. W is frozen, so backward needs only dL/dx = dL/dy @ W (the Triton kernel does the same).
- `keep_dequantized` / `FrozenQuantLinear.weight_in`: a CPU has no 4-bit matmul, so each forward and
  backward rebuilds W, which costs more than the matmul; with this on, W is built once per dtype and kept.
- `FrozenQuantLinear._apply`: model.to(torch.bfloat16) casts every floating buffer; a quantized layer's
  must keep their dtypes (fp8 scales; a bf16 global scale would shift every weight).
- `FrozenQuantLinear._from_linear`: a layer from quantized buffers, each checked against the format's.
- `kernel_module`: the Triton kernels of kernels/ (the fast NVFP4 product), imported by file path.
"""
import importlib.machinery
import importlib.util
import os
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F


class RebuiltWeightLinear(torch.autograd.Function):
    """y = x @ W^T + b for a frozen 4-bit weight (module.weight_in(dtype)), W rebuilt in backward, not saved."""

    @staticmethod
    def forward(ctx, x, module):
        ctx.module = module
        b = None if module.bias is None else module.bias.to(x.dtype)
        return F.linear(x, module.weight_in(x.dtype), b)

    @staticmethod
    def backward(ctx, grad_out):                                         # (..., out)
        return grad_out @ ctx.module.weight_in(grad_out.dtype), None     # (..., in)


def version(t):
    """How many times `t` was written in place; None for a tensor made under inference mode, which keeps no
    count (such a buffer cannot be written outside inference mode either)."""
    return None if t.is_inference() else t._version


def _same_source(a, b):
    """Whether two ((tensor, version), ...) name the same tensors, each at the same in-place version."""
    return b is not None and len(a) == len(b) and all(t is u and v == w for (t, v), (u, w) in zip(a, b))


class FrozenQuantLinear(nn.Module):
    """The base of 01's quantized Linears: what they share that is not the method (see the docstring above).
    A subclass registers its format's buffers and defines dequantized_weight(dtype) -> (out, in)."""
    kept = None  # {dtype: dequantized weight} while keep_dequantized is on: a frozen weight rebuilt once
    kept_from = None  # ((buffer, its in-place version), ...): the format's buffers the kept weights came from

    def weight_in(self, dtype):
        """The dequantized weight (out, in) in `dtype`: built once and kept under keep_dequantized, else rebuilt.
        A kept weight follows its buffers: written in place (an AQN site on the scales) or replaced, they are
        read again, so nothing is ever sampled from a stale W. The buffers are compared by identity and held
        (not by address: a replacement freed and the next one allocated in its place would share it)."""
        if self.kept is None:
            return self.dequantized_weight(dtype)
        source = tuple((t, version(t)) for t in self._buffers.values() if t is not None)
        if not _same_source(source, self.kept_from):
            self.kept, self.kept_from = {}, source
        if dtype not in self.kept:
            self.kept[dtype] = self.dequantized_weight(dtype)
        return self.kept[dtype]

    @classmethod
    def _from_linear(cls, linear, quantized, **kwargs):
        """The layer holding `quantized`, {buffer name: tensor}: every buffer of the format, each with the
        shape and dtype the format's __init__ gives it (a mismatch is an error, not a silent reshape)."""
        m = cls(linear.in_features, linear.out_features, linear.bias is not None, linear.weight.device, **kwargs)
        want = {k: t for k, t in m._buffers.items() if k != "bias"}
        if set(quantized) != set(want):
            raise ValueError(f"{cls.__name__}: got buffers {sorted(quantized)}, the format has {sorted(want)}")
        for k, t in quantized.items():
            if t.shape != want[k].shape or t.dtype != want[k].dtype:
                raise ValueError(f"{cls.__name__}.{k}: got {tuple(t.shape)} {t.dtype}, the format needs "
                                 f"{tuple(want[k].shape)} {want[k].dtype}")
            setattr(m, k, t)
        if linear.bias is not None:
            m.bias = linear.bias.detach().clone()
        return m

    def _apply(self, fn, recurse=True):
        """.to()/.cuda()/.half() all end here. The format's buffers take only the device from a conversion,
        never its dtype; the bias converts as usual."""
        keep = {k: t for k, t in self._buffers.items() if k != "bias"}
        nn.Module._apply(self, fn, recurse)
        for k, t in keep.items():
            self._buffers[k] = t.to(self._buffers[k].device)
        if self.kept is not None:  # kept weights are rebuilt on the new device
            self.kept, self.kept_from = {}, None  # (and the old device's buffers are not held)
        return self

    def extra_repr(self):
        return f"in={self.in_features}, out={self.out_features}, bias={self.bias is not None}"


def keep_dequantized(model, enabled=True):
    """Keep each 4-bit layer's dequantized weight once built (per dtype), or stop keeping it (enabled=False).
    A float copy of the model in memory, as the unquantized base would take; the stored bytes stay 4-bit."""
    for m in model.modules():
        if isinstance(m, FrozenQuantLinear):
            m.kept, m.kept_from = ({} if enabled else None), None
    return model


# Hugging Face's `kernels` package (which transformers >= 5.25 imports) has our folder's import name. So kernels/
# has no __init__.py (a namespace portion, which yields to HF's regular package) and its modules load by file
# path under the private name nvfp4_kernels, the one 01_quantize.nvfp4_kernel uses: the stage and the trainer
# share one loaded copy (one compile, one weight cache). No code imports `kernels` by name.
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the checkout


def kernel_module(name, root=ROOT, package="nvfp4_kernels"):
    """`root`/kernels/<name>.py as module `package`.<name>, imported once (relative imports stay in that folder).
    nvfp4_matmul.py is part one (the format, the general kernel), nvfp4_decode.py part two (the decode kernel and
    the entry point `nvfp4_matmul`). Both need triton (no macOS/Windows wheels): without it, an ImportError."""
    if package not in sys.modules:
        spec = importlib.machinery.ModuleSpec(package, None, is_package=True)
        spec.submodule_search_locations = [os.path.join(root, "kernels")]
        sys.modules[package] = importlib.util.module_from_spec(spec)
    return importlib.import_module(f"{package}.{name}")
