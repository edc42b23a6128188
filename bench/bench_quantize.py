"""Benchmark stage 01: how fast NVFP4 and NF4 quantize and dequantize a 4096x4096 bf16 weight.

Throughput is in MB of bf16 weight per second (4096*4096*2 bytes = 33.6 MB per call), median of a
few repeats after one warm-up. Runs on the default device (the GPU when there is one) in well under
a minute on 2 CPU cores.

    python bench/bench_quantize.py [--size 4096] [--repeats 3] [--device cpu]
"""
import importlib
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
cli = importlib.import_module("qerl.cli")
devices = importlib.import_module("qerl.devices")
q = importlib.import_module("qerl.quantize")


def timed(fn, repeats, device):
    """Median seconds of fn() over `repeats` runs, after one warm-up run."""
    fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main(argv=None):
    p = cli.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", type=cli.number(int, 1, 65536), default=4096, help="weight is size x size")
    p.add_argument("--repeats", type=cli.number(int, 1), default=3)
    p.add_argument("--device", default=None, help="cpu | cuda (default: autodetect)")
    args = p.parse_args(argv)
    device = devices.pick_device(args.device)
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(args.size, args.size, generator=g) * 0.02).to(torch.bfloat16).to(device)
    mb = w.numel() * 2 / 1e6                                             # MB of bf16 weight per call
    nv = q.quantize_nvfp4(w)
    nf = q.quantize_nf4(w)
    rows = [
        ("nvfp4", "quantize", lambda: q.quantize_nvfp4(w)),
        ("nvfp4", "dequantize", lambda: q.dequantize_nvfp4(*nv, dtype=torch.bfloat16)),
        ("nf4", "quantize", lambda: q.quantize_nf4(w)),
        ("nf4", "dequantize", lambda: q.dequantize_nf4(nf[0], nf[1], w.shape).to(torch.bfloat16)),
    ]
    print(f"device {device} | threads {torch.get_num_threads()} | weight {args.size}x{args.size} bf16 "
          f"({mb:.1f} MB) | median of {args.repeats}")
    print(f"{'format':<7}| {'op':<11}| {'ms':>9} | {'MB/s (bf16)':>11} | {'Mweights/s':>10}")
    for fmt, op, fn in rows:
        sec = timed(fn, args.repeats, device)
        print(f"{fmt:<7}| {op:<11}| {sec * 1e3:>9.1f} | {mb / sec:>11.0f} | {w.numel() / sec / 1e6:>10.1f}")


if __name__ == "__main__":
    sys.exit(cli.run_cli(main))
