"""Triton kernels: `nvfp4_matmul`, the fused NVFP4 weight-only matmul.

Read nvfp4_matmul.py first (part one: the format, the general kernel, a runnable check), then
nvfp4_decode.py (part two: the decode kernel, the per-weight cache and the entry point exported here).

Triton is optional (it has no macOS/Windows wheels): without it `HAS_TRITON` is False, the CPU path of
the stages (dequantize + F.linear) still works, and calling `nvfp4_matmul` raises a clear error.
"""
try:
    import triton  # noqa: F401
    HAS_TRITON = True
except ImportError:
    HAS_TRITON = False

if HAS_TRITON:
    from .nvfp4_decode import nvfp4_matmul
else:
    def nvfp4_matmul(x, packed, scale, global_scale, bias=None, **kwargs):
        raise RuntimeError("nvfp4_matmul needs triton, which is not installed (pip install triton, "
                           "Linux only); without it, dequantize the weight and call F.linear")

__all__ = ["HAS_TRITON", "nvfp4_matmul"]
