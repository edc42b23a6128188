"""Peak memory of one LoRA training step on an unquantized, an NF4 and an NVFP4 base model.

QeRL trains only LoRA adapters on top of a frozen 4-bit base, so the memory a GRPO update needs should
shrink with the base weights. This script measures it on a randomly initialised Qwen2-shaped model
that is big enough for the weights to dominate (default ~333M parameters: hidden 1024, 24 layers,
intermediate 2816, 16/4 heads, vocab 32000). One training step is what stage 05 does per update:
`sequence_logprobs` over prompt + completion (with gradients), a scalar GRPO-like loss, backward, and
an AdamW step on `lora_parameters`. Two steps are run, so the second already holds AdamW's state.

Each configuration runs in its own fresh child process (`--one CONFIG`), so nothing one run allocated
(or the allocator kept) is counted for the next. The model is built on the meta device and
materialised one decoder layer at a time, each quantized as soon as it exists (bench_rollout.py's
`build_random_model`), so the quantized runs never hold a full-precision copy of the model.
  CPU:  peak resident memory (the kernel's high-water mark, `getrusage(RUSAGE_SELF).ru_maxrss`), reset
        after the build through /proc/self/clear_refs where Linux allows it. It includes a baseline
        (Python, torch and the libraries a first training step loads, measured after one step of a
        throwaway tiny model), which the last column subtracts.
  CUDA: torch.cuda.max_memory_allocated, reset after the build.

    python bench/bench_memory.py --threads 1                     # CPU, fp32, none/nf4/nvfp4 (~2-3 min)
    python bench/bench_memory.py --dtype bf16                    # bf16 activations and embeddings
    python bench/bench_memory.py --layers 4 --configs none,nvfp4 # smaller / faster
    python bench/bench_memory.py --one nvfp4                     # one configuration, prints its RESULT line

What to expect on the CPU: NVFP4Linear and NF4Linear run `F.linear(x, dequantized_weight)` there, so
every forward materialises one layer's weight in full precision at a time. Autograd does not keep it:
their backward (01_quantize's _RebuiltWeightLinear, and the Triton kernel's on the GPU) dequantizes the
frozen weight again for dL/dx, so a training step holds only the packed weights plus activations.
"""
import gc
import importlib
import json
import os
import resource
import subprocess
import sys
import time

import torch

BENCH = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(BENCH)
for p in (ROOT, BENCH):
    if p not in sys.path:
        sys.path.insert(0, p)
cli = importlib.import_module("qerl.cli")
ro = importlib.import_module("qerl.rollout")
lora = importlib.import_module("qerl.lora")
from bench_rollout import (DTYPES, QUANTS, SHAPES, build_random_model, model_config, pick_device,  # noqa: E402
                           weight_bytes)

# ---------------------------------------------------------------------------------------------------
# Memory readings (bytes)


def rss_peak():
    """High-water mark of this process's resident memory. Linux reports ru_maxrss in KiB."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def rss_now():
    """Current resident memory (VmRSS in /proc/self/status, kB); the peak where that file is missing."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))
    except (OSError, StopIteration):
        return rss_peak()


def reset_rss_peak():
    """Reset the high-water mark (Linux >= 4.0: write 5 to clear_refs). False where not allowed."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak(device):
    return torch.cuda.max_memory_allocated() if device.type == "cuda" else rss_peak()


def reset_peak(device):
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        return True
    return reset_rss_peak()


# ---------------------------------------------------------------------------------------------------
# One configuration (runs in a child process)

def training_step(model, opt, prompts, completion, mask, gen):
    """What stage 05 does per update: log-probs with gradients, a policy-gradient loss, AdamW."""
    lp, _ = ro.sequence_logprobs(model, prompts, completion, mask)  # (B, T) with grad
    adv = torch.randn(lp.shape[0], 1, generator=gen).to(lp.device)  # (B, 1) stand-in advantages
    loss = -(lp * adv).sum() / mask.sum()
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.item()


def run_one(quant, args, device, dtype):
    """Build the model, add LoRA, run the steps; returns a dict of byte counts and timings."""
    cfg = model_config(args.shape, num_hidden_layers=args.layers, hidden_size=args.hidden,
                       intermediate_size=args.intermediate, num_attention_heads=args.heads,
                       num_key_value_heads=args.kv_heads, vocab_size=args.vocab,
                       head_dim=(args.hidden // args.heads) if args.hidden and args.heads else None)
    # Baseline: the process after one training step of a throwaway 2-layer model with the same code
    # path. The first matmuls, autograd and AdamW load and initialise library code and scratch space
    # (~0.2 GB of RSS with oneDNN/MKL on the CPU; cuBLAS workspaces on CUDA), a one-off cost that is
    # not the model's.
    warm = build_random_model(model_config("tiny", num_hidden_layers=2), quant, dtype, device, seed=args.seed)
    lora.add_lora(warm, r=4, alpha=8)
    training_step(warm, torch.optim.AdamW(lora.lora_parameters(warm)), [[1, 2, 3]],
                  torch.tensor([[4, 5]], device=device), torch.ones(1, 2, device=device), torch.Generator())
    del warm
    gc.collect()
    baseline = rss_now() if device.type == "cpu" else torch.cuda.memory_allocated()

    t0 = time.perf_counter()
    model = build_random_model(cfg, quant, dtype, device, seed=args.seed)
    lora.add_lora(model, r=args.rank, alpha=2 * args.rank)  # prints its own one-line summary
    build_s = time.perf_counter() - t0
    build_peak = peak(device)
    w_bytes = weight_bytes(model)  # base weights + LoRA A/B (fp32)
    lora_bytes = sum(p.numel() * p.element_size() for p in lora.lora_parameters(model))

    gen = torch.Generator().manual_seed(args.seed)
    B, P, T = args.batch, args.prompt_len, args.completion_len
    prompts = [torch.randint(0, cfg.vocab_size, (P,), generator=gen).tolist() for _ in range(B)]
    completion = torch.randint(0, cfg.vocab_size, (B, T), generator=gen).to(device)  # (B, T)
    mask = torch.ones(B, T, device=device)  # (B, T)
    opt = torch.optim.AdamW(lora.lora_parameters(model), lr=1e-5)

    resident_before = rss_now() if device.type == "cpu" else torch.cuda.memory_allocated()

    # A no-grad forward first: what a rollout (or the reference policy) costs without the backward.
    reset_ok = reset_peak(device)
    with torch.no_grad():
        ro.sequence_logprobs(model, prompts, completion, mask)
    nograd_peak = peak(device)

    reset_peak(device)
    t1 = time.perf_counter()
    losses = [training_step(model, opt, prompts, completion, mask, gen) for _ in range(args.steps)]
    if device.type == "cuda":
        torch.cuda.synchronize()
    step_s = (time.perf_counter() - t1) / args.steps
    step_peak = peak(device)
    return dict(quant=quant, dtype=str(dtype).replace("torch.", ""), device=device.type,
                params=sum(lora.count_parameters(model)), weight_bytes=w_bytes, lora_bytes=lora_bytes,
                baseline=baseline, build_peak=build_peak, resident=resident_before, nograd_peak=nograd_peak,
                step_peak=step_peak, peak_reset=reset_ok, build_s=build_s, step_s=step_s, loss=losses[-1],
                threads=torch.get_num_threads())


# ---------------------------------------------------------------------------------------------------
# The parent: one child process per configuration, then the table

def gb(n):
    return f"{n / 1e9:.3f}"


def run_children(args, configs, passthrough):
    results = {}
    for quant in configs:
        cmd = [sys.executable, os.path.abspath(__file__), "--one", quant] + passthrough
        t0 = time.perf_counter()
        # A fixed mmap threshold makes glibc hand every large block (> 128 KiB) straight back to the OS
        # when it is freed. By default the threshold grows after the first big free, and freed tensors
        # then stay in the heap, counted in RSS long after torch released them.
        env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="131072")
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
        lines = proc.stdout.splitlines()
        for line in lines:
            if not line.startswith("RESULT "):
                print(f"  [{quant}] {line}")
        found = [json.loads(line[len("RESULT "):]) for line in lines if line.startswith("RESULT ")]
        if proc.returncode != 0 or not found:
            err = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
            print(f"config {quant} | FAILED rc {proc.returncode} | {err}", flush=True)
            continue
        r = results[quant] = found[0]
        print(f"config {quant} | weights {gb(r['weight_bytes'])} GB | step peak {gb(r['step_peak'])} GB "
              f"| no-grad peak {gb(r['nograd_peak'])} GB | build_s {r['build_s']:.1f} | step_s {r['step_s']:.1f} "
              f"| child_s {time.perf_counter() - t0:.0f}", flush=True)
    return results


def print_table(results, configs, args, device):
    base = next((results[c] for c in configs if c in results), None)
    if base is None:
        print("no configuration finished")
        return
    r0 = next(iter(results.values()))
    unit = "max_memory_allocated" if device.type == "cuda" else "peak RSS (ru_maxrss)"
    print(f"\n{unit}; model {args.shape} ({r0['params'] / 1e6:.0f}M params incl. LoRA) | dtype {r0['dtype']} "
          f"| batch {args.batch} x ({args.prompt_len} prompt + {args.completion_len} completion) tokens "
          f"| LoRA r {args.rank} on 7 projections | AdamW | {args.steps} steps | device {device.type} "
          f"| threads {r0['threads']}")
    head = (f"{'quant':<6} | {'weight bytes':>12} | {'resident':>9} | {'peak no-grad':>12} | {'peak step':>9} "
            f"| {'ratio weights':>13} | {'ratio peak step':>15} | {'ratio step-baseline':>19}")
    print(head)
    print("-" * len(head))
    for c in configs:
        if c not in results:
            print(f"{c:<6} | FAILED (see its lines above)")
            continue
        r = results[c]
        print(f"{c:<6} | {gb(r['weight_bytes']):>9} GB | {gb(r['resident']):>6} GB | {gb(r['nograd_peak']):>9} GB "
              f"| {gb(r['step_peak']):>6} GB | {r['weight_bytes'] / base['weight_bytes']:>13.3f} "
              f"| {r['step_peak'] / base['step_peak']:>15.3f} "
              f"| {(r['step_peak'] - r['baseline']) / (base['step_peak'] - base['baseline']):>19.3f}")
    print(f"(ratios vs {configs[0]}; weight bytes = parameters + buffers incl. LoRA A/B "
          f"({gb(r0['lora_bytes'])} GB); embeddings and lm_head stay in {r0['dtype']})")
    if device.type == "cpu":
        print(f"(CPU: resident = RSS with the model loaded, before the steps; every figure includes the Python + torch "
              f"baseline of ~{gb(base['baseline'])} GB, which 'step-baseline' subtracts; peak reset after the build: "
              f"{'yes' if base['peak_reset'] else 'NO, the build peak is included'})")
        print("(CPU: NVFP4Linear/NF4Linear dequantize one layer's weight to a full-precision temporary per forward; "
              "their backward dequantizes again instead of keeping it)")


def main(argv=None):
    N = cli.number
    ap = cli.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--configs", default="none,nf4,nvfp4", help=f"comma-separated from {','.join(QUANTS)} (first = baseline)")
    ap.add_argument("--one", default=None, help="run one configuration in this process and print a RESULT line")
    ap.add_argument("--shape", default="350m", help=f"model shape preset: {', '.join(SHAPES)}")
    ap.add_argument("--layers", type=N(int, 1), default=None, help="override: decoder layers")
    ap.add_argument("--hidden", type=N(int, 1), default=None, help="override: hidden size (head_dim = hidden / heads)")
    ap.add_argument("--intermediate", type=N(int, 1), default=None, help="override: MLP intermediate size")
    ap.add_argument("--heads", type=N(int, 1), default=None, help="override: attention heads")
    ap.add_argument("--kv-heads", type=N(int, 1), default=None, help="override: key/value heads")
    ap.add_argument("--vocab", type=N(int, 1), default=None, help="override: vocabulary size")
    ap.add_argument("--dtype", default=None, choices=list(DTYPES), help="compute dtype (default: fp32 CPU, bf16 CUDA)")
    ap.add_argument("--device", default=None, help="cpu | cuda (default: autodetect)")
    ap.add_argument("--batch", type=N(int, 1), default=2)
    ap.add_argument("--prompt-len", type=N(int, 1), default=32)
    ap.add_argument("--completion-len", type=N(int, 1), default=32)
    ap.add_argument("--rank", type=N(int, 1), default=32, help="LoRA rank (alpha = 2 * rank)")
    ap.add_argument("--steps", type=N(int, 1), default=2, help="training steps (the 2nd one holds AdamW state)")
    ap.add_argument("--threads", type=N(int, 0), default=0, help="torch CPU threads (0: torch's default)")
    ap.add_argument("--seed", type=N(int, 0), default=0)
    args = ap.parse_args(argv)

    device = pick_device(args.device)
    if args.shape not in SHAPES:
        raise SystemExit(f"error: unknown --shape {args.shape!r}; choose one of {', '.join(SHAPES)}")
    if args.hidden and not args.heads:
        args.heads = SHAPES[args.shape]["num_attention_heads"]
    if args.hidden and args.hidden % args.heads:
        raise SystemExit(f"error: --hidden {args.hidden} must be a multiple of the number of heads ({args.heads})")
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = DTYPES[args.dtype or ("bf16" if device.type == "cuda" else "fp32")]
    try:
        model_config(args.shape, num_key_value_heads=args.kv_heads, num_attention_heads=args.heads)
    except ValueError as e:
        raise SystemExit(f"error: {e}")

    if args.one is not None:
        if args.one not in QUANTS:
            raise SystemExit(f"error: --one takes one of {', '.join(QUANTS)}, got {args.one!r}")
        print("RESULT " + json.dumps(run_one(args.one, args, device, dtype)), flush=True)
        return 0

    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    bad = [c for c in configs if c not in QUANTS]
    if bad or not configs:
        raise SystemExit(f"error: --configs takes names from {','.join(QUANTS)}, got {args.configs!r}")
    # Everything but --configs/--one goes to the children unchanged (argv as given, or sys.argv).
    given = list(sys.argv[1:] if argv is None else argv)
    passthrough, skip = [], False
    for a in given:
        if skip:
            skip = False
            continue
        if a == "--configs":
            skip = True
            continue
        if not a.startswith("--configs="):
            passthrough.append(a)
    print(f"bench_memory | {'python bench/bench_memory.py ' + ' '.join(given)} | device {device.type} "
          f"| torch {torch.__version__}", flush=True)
    t0 = time.perf_counter()
    results = run_children(args, configs, passthrough)
    print_table(results, configs, args, device)
    print(f"total_s {time.perf_counter() - t0:.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(cli.run_cli(main))
