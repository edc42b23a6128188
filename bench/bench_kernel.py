"""Speed of the fused NVFP4 matmul (kernels/nvfp4_decode.py) against its two alternatives on a GPU.

For y = x @ W.T with x in bf16 and W of shape [N, K], three ways are timed with triton.testing.do_bench:
  nvfp4    the fused kernel: packed 4-bit weight, dequantized tile by tile in registers;
  bf16     torch.matmul with a bf16 copy of the weight (the unquantized baseline, cuBLAS);
  deq+mm   dequantize the whole NVFP4 weight to bf16, then torch.matmul (what a framework without a
           fused kernel does: more memory traffic than bf16 itself).
At decode sizes (M <= 16) the matmul is limited by memory bandwidth and the 4-bit weight should
win; at prefill sizes (M in the thousands) it is compute-bound and bf16 tensor cores set the pace.
GB/s counts the bytes each method must move at least once (weights, scales, x, y). Each row first
checks that the kernel agrees with deq+mm.

    python bench/bench_kernel.py                    # 4096x4096 and 8192x8192, M in 1 16 128 4096
    python bench/bench_kernel.py --shapes qwen7b    # Qwen2.5-7B's linear layers, M in 1 16 64 4096
    python bench/bench_kernel.py --m 1 8 --split-k 1
    python bench/bench_kernel.py --host [--compare-root DIR]   # CPU: the wrapper's Python cost per call
"""
import importlib
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
cli = importlib.import_module("qerl.cli")
quant_engine = importlib.import_module("qerl.quant_engine")  # loads kernels/ by path (HF's `kernels` shares its name)

# -----------------------------------------------------------------------------
# Shapes: (name, N = out_features, K = in_features)

SQUARE = [("4096x4096", 4096, 4096), ("8192x8192", 8192, 8192)]
# Qwen2.5-7B: hidden 3584, intermediate 18944, 28 query heads and 4 kv heads of head_dim 128.
QWEN7B = [
    ("q_proj", 3584, 3584),
    ("k/v_proj", 512, 3584),
    ("o_proj", 3584, 3584),
    ("gate/up_proj", 18944, 3584),
    ("down_proj", 3584, 18944),
]
DEFAULT_M = {"square": [1, 16, 128, 4096], "qwen7b": [1, 16, 64, 4096]}

# -----------------------------------------------------------------------------
# Weights: the real quantizer when stage 01 is present, else random codes (timing does not care)

E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]


def _stage01():
    try:
        return importlib.import_module("qerl.quantize")
    except ImportError:
        return None


def make_weight(n, k, gen, device):
    """(bf16 weight [N, K], packed, scale, global_scale) on `device`."""
    w = (torch.randn(n, k, generator=gen) * k ** -0.5).to(device)  # (N, K)
    q = _stage01()
    if q is not None:
        packed, scale, gs = q.quantize_nvfp4(w)
    else:
        packed = torch.randint(0, 256, (n, k // 2), generator=gen, dtype=torch.uint8).to(device)
        scale = (torch.rand(n, k // 16, generator=gen) * 300 + 16).to(torch.float8_e4m3fn).to(device)
        gs = torch.tensor([2688.0 * k ** 0.5 / 3], device=device)  # keeps |W| around k**-0.5
    return w.to(torch.bfloat16), packed, scale, gs


def dequantize(packed, scale, gs, dtype=torch.bfloat16):
    """W [N, K_pad] in dtype, in plain torch (stage 01's dequantize_nvfp4 when present)."""
    q = _stage01()
    if q is not None:
        return q.dequantize_nvfp4(packed, scale, gs, dtype)
    lut = torch.tensor(E2M1, device=packed.device)
    codes = torch.stack([packed & 0xF, packed >> 4], dim=-1).flatten(1).int()  # (N, K_pad)
    return (lut[codes] * scale.float().repeat_interleave(16, dim=1) / gs).to(dtype)


# -----------------------------------------------------------------------------
# Host overhead: what the Python wrapper costs per call, with the kernel launch stubbed out


class _NoLaunch:
    """Stands in for a Triton kernel: `kernel[grid](*args)` does nothing."""

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


def _stubbed_kernels(root, name):
    """Load `root`/kernels/nvfp4_decode.py (the entry point) under package `name` (its own copy, beside
    any other checkout's), every Triton kernel of every kernels/ module it imports a no-op."""
    import triton
    entry = quant_engine.kernel_module("nvfp4_decode", root, package=name)
    for mod_name, mod in list(sys.modules.items()):
        if mod_name.startswith(name + "."):
            for attr, obj in list(vars(mod).items()):
                if isinstance(obj, triton.runtime.jit.KernelInterface):
                    setattr(mod, attr, _NoLaunch())
    return entry


def bench_host(args):
    """Microseconds per nvfp4_matmul call spent in Python (checks, allocation, launch settings), on
    CPU tensors through the interpreter branch, with every Triton kernel replaced by a no-op: the
    figure that a Qwen2.5-7B decode step pays 196 times (7 projections x 28 layers), independent of
    the GPU. --compare-root DIR times another checkout's kernels/ in the same run, interleaved (a
    ratio that survives a busy machine)."""
    import time

    os.environ["TRITON_INTERPRET"] = "1"  # the CPU branch of the wrapper (set before triton is imported)
    roots = [("this", ROOT)] + ([("other", os.path.abspath(args.compare_root))] if args.compare_root else [])
    mods = {label: _stubbed_kernels(root, f"_kernels_{label}") for label, root in roots}
    gen = torch.Generator().manual_seed(args.seed)
    n = k = 4096
    packed = torch.randint(0, 256, (n, k // 2), generator=gen, dtype=torch.uint8)
    scale = torch.full((n, k // 16), 1.0).to(torch.float8_e4m3fn)
    gs = torch.tensor([448.0])
    bias = torch.randn(n, generator=gen).to(torch.bfloat16)
    x = torch.randn(1, k, generator=gen).to(torch.bfloat16)  # (M, K) one decode token
    best = {label: float("inf") for label in mods}
    for kmod in mods.values():
        for _ in range(200):  # warm the caches the wrapper keeps
            kmod.nvfp4_matmul(x, packed, scale, gs, bias)
    for _ in range(args.host_repeats):
        for label, kmod in mods.items():
            t0 = time.perf_counter()
            for _ in range(1000):
                kmod.nvfp4_matmul(x, packed, scale, gs, bias)
            best[label] = min(best[label], (time.perf_counter() - t0) * 1e3)  # us/call = ms per 1000
    line = " | ".join(f"{label} us/call {best[label]:.1f}" for label in mods)
    ratio = f" | other/this {best['other'] / best['this']:.2f}x" if args.compare_root else ""
    print(f"host overhead | nvfp4_matmul wrapper, launch stubbed | x bf16 1x{k} | weight {n}x{k} | {line}{ratio} "
          f"| best of {args.host_repeats} x 1000 calls, interleaved", flush=True)
    return 0


# -----------------------------------------------------------------------------
# One row of the table


def bench_row(name, n, k, m, args, gen, nvfp4_matmul, do_bench):
    device = "cuda"
    w_bf16, packed, scale, gs = make_weight(n, k, gen, device)
    x = torch.randn(m, k, generator=gen).to(device, torch.bfloat16)  # (M, K)

    def run_kernel():
        return nvfp4_matmul(x, packed, scale, gs, split_k=args.split_k)

    def run_bf16():
        return torch.matmul(x, w_bf16.T)

    def run_deq_mm():
        return torch.matmul(x, dequantize(packed, scale, gs).T)

    # The first call autotunes (not timed); then make sure we time a correct kernel.
    y, y_ref = run_kernel().float(), run_deq_mm().float()
    rel_err = ((y - y_ref).norm() / y_ref.norm().clamp_min(1e-30)).item()
    if rel_err > 1e-2:
        raise SystemExit(f"kernel disagrees with dequantize+matmul on {name} M={m}: rel err {rel_err:.2e}")

    ms = {key: do_bench(fn, warmup=args.warmup, rep=args.rep)
          for key, fn in (("nvfp4", run_kernel), ("bf16", run_bf16), ("deq+mm", run_deq_mm))}
    flops = 2.0 * m * n * k
    act_bytes = 2 * m * (k + n)  # x read and y written, bf16
    bytes_moved = {"nvfp4": n * k // 2 + n * k // 16 + act_bytes, "bf16": 2 * n * k + act_bytes}
    us = {key: 1e3 * t for key, t in ms.items()}
    print(f"{name:>12} {n:>5}x{k:<5} | M {m:>4} "
          f"| us nvfp4 {us['nvfp4']:8.1f} bf16 {us['bf16']:8.1f} deq+mm {us['deq+mm']:8.1f} "
          f"| TFLOP/s nvfp4 {flops / us['nvfp4'] / 1e6:6.1f} bf16 {flops / us['bf16'] / 1e6:6.1f} "
          f"| GB/s nvfp4 {bytes_moved['nvfp4'] / us['nvfp4'] / 1e3:5.0f} bf16 {bytes_moved['bf16'] / us['bf16'] / 1e3:5.0f} "
          f"| vs bf16 nvfp4 {us['bf16'] / us['nvfp4']:4.2f}x deq+mm {us['bf16'] / us['deq+mm']:4.2f}x "
          f"| err {rel_err:.0e}", flush=True)


def main(argv=None):
    N = cli.number
    parser = cli.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", choices=["square", "qwen7b"], default="square")
    parser.add_argument("--m", type=N(int, 1), nargs="+", default=None, help="batch sizes (rows of x)")
    parser.add_argument("--split-k", type=N(int, 1), default=None, help="force split-K (default: rule of thumb)")
    parser.add_argument("--warmup", type=N(int, 1), default=25, help="do_bench warmup, ms")
    parser.add_argument("--rep", type=N(int, 1), default=100, help="do_bench repetitions, ms")
    parser.add_argument("--seed", type=N(int, 0), default=0)
    parser.add_argument("--host", action="store_true",
                        help="CPU only: the wrapper's microseconds per call with the launch stubbed out")
    parser.add_argument("--host-repeats", type=N(int, 1), default=5)
    parser.add_argument("--compare-root", default=None,
                        help="with --host: also time the kernels/ of another checkout (e.g. an older commit)")
    args = parser.parse_args(argv)
    if args.compare_root and not os.path.isfile(os.path.join(args.compare_root, "kernels", "nvfp4_decode.py")):
        raise ValueError(f"--compare-root {args.compare_root} has no kernels/nvfp4_decode.py: give a checkout of "
                         f"this repository")
    if args.host:
        return bench_host(args)

    if not torch.cuda.is_available():
        print("bench_kernel: needs a CUDA GPU (the kernel's CPU path is Triton's interpreter, which is "
              "for testing, not timing); nothing to do")
        return 0
    try:
        nvfp4_matmul = quant_engine.kernel_module("nvfp4_decode").nvfp4_matmul
    except ImportError:
        print("bench_kernel: needs triton (pip install triton); nothing to do")
        return 0
    from triton.testing import do_bench

    gen = torch.Generator().manual_seed(args.seed)
    shapes = SQUARE if args.shapes == "square" else QWEN7B
    ms = args.m or DEFAULT_M[args.shapes]
    print(f"device {torch.cuda.get_device_name()} | torch {torch.__version__} | x bf16 | "
          f"weights {'01_quantize' if _stage01() else 'random codes'}", flush=True)
    for name, n, k in shapes:
        for m in ms:
            bench_row(name, n, k, m, args, gen, nvfp4_matmul, do_bench)
    return 0


if __name__ == "__main__":
    sys.exit(cli.run_cli(main))
