"""NVFP4 rounded to nearest (compressed-tensors, "rtn") vs Four Over Six ("4over6") vs NF4: the weight error,
the quantize speed, and what each does to a model's next-token distribution and held-out accuracy.

Four Over Six picks, per block of 16, the scale that maps the block's max to 6 or to 4, whichever
reconstructs the block with the lower squared error (01_quantize.quantize_nvfp4). The bytes are NVFP4 either
way. Every table is measured in one run, side by side:

1. relative RMS error on 1024x1024 Gaussian, Laplace and Student-t(3) weights, and the share of blocks that
   take the max -> 4 scale;
2. relative RMS error per projection type of a model (q/k/v/o/gate/up/down, summed over layers, fused
   q/k/v and gate/up sharing one global scale as in quantize_model);
3. quantize throughput on a 4096x4096 weight (median of 3);
4. against the unquantized model: KL(full || quantized) and the quantized model's entropy per token (nats),
   and top-1 agreement, on completions the full model samples for held-out prompts;
5. held-out greedy accuracy of the full model and each 4-bit copy (stage 05's arithmetic task, or
   chat-arithmetic for an instruct model).

    python bench/bench_quant_methods.py                      # the bundled model; ~3 min on 2 cores
    python bench/bench_quant_methods.py --parts weights      # tables 1 and 3 only (~1 min)
    python bench/bench_quant_methods.py --model assets/smollm2-135m-instruct --task chat-arithmetic --eval-size 200
"""
import copy
import importlib
import os
import statistics
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
cli = importlib.import_module("qerl.cli")
files = importlib.import_module("qerl.files")
quantize = importlib.import_module("qerl.quantize")
rollout = importlib.import_module("qerl.rollout")
grpo = importlib.import_module("qerl.train")

# name -> (weight format, NVFP4 method); "fp32" is the unquantized model
VARIANTS = {"nvfp4-rtn": ("nvfp4", "rtn"), "nvfp4-4over6": ("nvfp4", "4over6"), "nf4": ("nf4", "rtn")}
PROJECTIONS = quantize.LINEAR_NAMES
PARTS = ("weights", "projections", "distribution", "accuracy")  # tables 1 + 3, 2, 4, 5


def synthetic(name, shape, g):
    if name == "gaussian":
        return torch.randn(shape, generator=g)
    if name == "laplace":
        u = torch.rand(shape, generator=g) - 0.5
        return -u.sign() * torch.log1p(-2 * u.abs())
    z, chi2 = torch.randn(shape, generator=g), torch.randn((3,) + shape, generator=g).pow(2).sum(0)
    return z / (chi2 / 3).sqrt()                                         # Student-t, 3 degrees of freedom


def quantized_error(w, variant, global_scale=None):
    """(squared error, squared norm) of w's round trip through `variant`."""
    fmt, method = VARIANTS[variant]
    w = w.float()
    if fmt == "nf4":
        packed, absmax = quantize.quantize_nf4(w)
        d = quantize.dequantize_nf4(packed, absmax, w.shape)
    else:
        d = quantize.dequantize_nvfp4(*quantize.quantize_nvfp4(w, global_scale, method=method))[:, : w.shape[1]]
    return (d - w).pow(2).sum().item(), w.pow(2).sum().item()


def table_synthetic(seed):
    g = torch.Generator().manual_seed(seed)
    print("\n## 1. Relative RMS error on random 1024x1024 weights (x 0.02)")
    print("| weights | nvfp4-rtn | nvfp4-4over6 | nf4 | 4over6 / rtn | blocks at max -> 4 |")
    print("|---|---|---|---|---|---|")
    rows = {}
    for dist in ("gaussian", "laplace", "student-t3"):
        w = synthetic(dist, (1024, 1024), g) * 0.02
        err = {v: (lambda e: (e[0] / e[1]) ** 0.5)(quantized_error(w, v)) for v in VARIANTS}
        s_rtn = quantize.quantize_nvfp4(w, quantize.nvfp4_global_scale([w], "4over6"))[1].float()
        s_46 = quantize.quantize_nvfp4(w, method="4over6")[1].float()
        share4 = (s_46 != s_rtn).float().mean().item()
        rows[dist] = dict(err, ratio=err["nvfp4-4over6"] / err["nvfp4-rtn"], share_max4=share4)
        print(f"| {dist} | {err['nvfp4-rtn']:.4f} | {err['nvfp4-4over6']:.4f} | {err['nf4']:.4f} | "
              f"{rows[dist]['ratio']:.3f}x | {100 * share4:.0f}% |")
    return rows


def table_throughput(seed):
    w = (torch.randn((4096, 4096), generator=torch.Generator().manual_seed(seed)) * 0.02).to(torch.bfloat16)
    print("\n## 3. Quantize throughput, 4096x4096 bf16 weight (median of 3, this machine's threads: "
          f"{torch.get_num_threads()})")
    print("| variant | ms | M weights/s |")
    print("|---|---|---|")
    fns = {"nvfp4-rtn": lambda: quantize.quantize_nvfp4(w), "nvfp4-4over6": lambda: quantize.quantize_nvfp4(w, method="4over6"),
           "nf4": lambda: quantize.quantize_nf4(w)}
    rows = {}
    for v, fn in fns.items():
        fn()  # warm-up
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        ms = 1e3 * statistics.median(times)
        rows[v] = {"ms": ms, "mweights_per_s": w.numel() / ms / 1e3}
        print(f"| {v} | {ms:.0f} | {rows[v]['mweights_per_s']:.1f} |")
    return rows


def table_projections(model, label):
    print(f"\n## 2. Relative RMS error per projection type: {label} (fused groups share a global scale)")
    print("| projection | tensors | nvfp4-rtn | nvfp4-4over6 | nf4 | 4over6 / rtn |")
    print("|---|---|---|---|---|---|")
    linears = {n: m.weight.detach() for n, m in model.named_modules()
               if isinstance(m, torch.nn.Linear) and n.rpartition(".")[2] in PROJECTIONS}
    groups = {}
    for n, w in linears.items():
        groups.setdefault(quantize.fused_group(n), []).append(w)
    sums = {p: {v: [0.0, 0.0] for v in VARIANTS} for p in PROJECTIONS}
    counts = dict.fromkeys(PROJECTIONS, 0)
    for n, w in linears.items():
        proj = n.rpartition(".")[2]
        counts[proj] += 1
        for v, (fmt, method) in VARIANTS.items():
            gs = quantize.nvfp4_global_scale(groups[quantize.fused_group(n)], method) if fmt == "nvfp4" else None
            e, s = quantized_error(w, v, gs)
            sums[proj][v][0] += e
            sums[proj][v][1] += s
    rows = {}
    for p in PROJECTIONS:
        if not counts[p]:
            continue
        err = {v: (e / s) ** 0.5 for v, (e, s) in sums[p].items()}
        rows[p] = dict(err, ratio=err["nvfp4-4over6"] / err["nvfp4-rtn"])
        print(f"| {p} | {counts[p]} | {err['nvfp4-rtn']:.4f} | {err['nvfp4-4over6']:.4f} | {err['nf4']:.4f} | "
              f"{rows[p]['ratio']:.3f}x |")
    return rows


@torch.no_grad()
def table_distribution(models, tok, task, n_prompts, max_new_tokens, seed, rows_per_chunk=16):
    """KL(full || q), entropy and top-1 agreement per completion token, on what the full model samples."""
    problems = task.held[:n_prompts]
    prompts = [tok.encode(task.prompt(p)) for p in problems]
    gen = torch.Generator().manual_seed(seed)
    ro = rollout.generate(models["fp32"], prompts, num_samples=1, max_new_tokens=max_new_tokens, temperature=1.0,
                          eos_token_ids=tok.eos_token_ids, generator=gen)
    mask = ro.completion_mask.float()                                    # (N, T)
    sums = {name: {"kl": 0.0, "entropy": 0.0, "top1": 0.0} for name in models}
    for i in range(0, len(prompts), rows_per_chunk):  # (rows, T, V) fp32 logits: chunked for a 49K vocabulary
        rows = slice(i, i + rows_per_chunk)
        ids, m = ro.completion_ids[rows], mask[rows]                     # (n, T)
        ref = torch.log_softmax(rollout.completion_logits(models["fp32"], ro.prompt_ids[rows], ids), -1)  # (n, T, V)
        for name, model in models.items():
            logp = torch.log_softmax(rollout.completion_logits(model, ro.prompt_ids[rows], ids), -1)  # (n, T, V)
            per_token = {"kl": (ref.exp() * (ref - logp)).sum(-1), "entropy": -(logp.exp() * logp).sum(-1),
                         "top1": (logp.argmax(-1) == ref.argmax(-1)).float()}  # each (n, T)
            for k, t in per_token.items():
                sums[name][k] += (t * m).sum().item()
    n_tokens = mask.sum().item()
    print(f"\n## 4. Against the unquantized model: {n_prompts} held-out prompts, one sampled completion each "
          f"({int(n_tokens)} tokens)")
    print("| model | KL(full, model) nats/token | entropy nats/token | top-1 agreement |")
    print("|---|---|---|---|")
    rows = {name: {k: v / n_tokens for k, v in r.items()} for name, r in sums.items()}
    for name, r in rows.items():
        print(f"| {name} | {r['kl']:.4f} | {r['entropy']:.4f} | {100 * r['top1']:.1f}% |")
    return rows


def table_accuracy(models, tok, task, max_new_tokens):
    print(f"\n## 5. Held-out greedy accuracy ({len(task.held)} problems)")
    print("| model | greedy |")
    print("|---|---|")
    rows = {}
    for name, m in models.items():
        t0 = time.perf_counter()
        res = grpo.evaluate(m, tok, task, task.held, max_new_tokens)
        rows[name] = res["greedy"]
        print(f"| {name} | {100 * res['greedy']:.1f}% ({res['greedy_correct']}/{res['n']}) |")
        print(f"eval | model {name} | seconds {time.perf_counter() - t0:.0f}", file=sys.stderr)
    return rows


def main(argv=None):
    N = cli.number
    ap = cli.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=grpo.TINY_MODEL, help="Hugging Face folder (default: the bundled model)")
    ap.add_argument("--parts", default=",".join(PARTS), help=f"a comma-separated subset of {','.join(PARTS)}")
    ap.add_argument("--task", default="arithmetic", choices=["arithmetic", "chat-arithmetic"],
                    help="05's task whose held-out prompts tables 4 and 5 use (chat-arithmetic for an instruct model)")
    ap.add_argument("--kl-prompts", type=N(int, 1), default=128)
    ap.add_argument("--eval-size", type=N(int, 1), default=1000)
    ap.add_argument("--max-new-tokens", type=N(int, 1), default=42)
    ap.add_argument("--seed", type=N(int, 0), default=0)
    ap.add_argument("--json", default=None, help="also write every figure to this file")
    args = ap.parse_args(argv)
    parts = set(args.parts.split(","))
    if not parts <= set(PARTS):
        ap.error(f"--parts takes names from {','.join(PARTS)}, got {args.parts!r}")
    print(f"bench_quant_methods | {time.strftime('%Y-%m-%d')} | torch {torch.__version__} | threads "
          f"{torch.get_num_threads()} | model {os.path.relpath(args.model, ROOT)}")
    out = {}
    if "weights" in parts:
        out["synthetic"] = table_synthetic(args.seed)
        out["throughput"] = table_throughput(args.seed)
    if parts & {"projections", "distribution", "accuracy"}:
        base, tok = rollout.load_model(args.model, device="cpu")
        if "projections" in parts:
            out["projections"] = table_projections(base, os.path.basename(os.path.normpath(args.model)))
        models = {"fp32": base}
        for v, (fmt, method) in VARIANTS.items():
            models[v] = quantize.quantize_model(copy.deepcopy(base), fmt=fmt, method=method)
        task = grpo.make_task(grpo.build_parser().parse_args(  # 05's task, as `qerl/train.py --task` builds it
            ["--model", args.model, "--task", args.task, "--eval-size", str(args.eval_size)]))
        if "distribution" in parts:
            out["distribution"] = table_distribution(models, tok, task, args.kl_prompts, args.max_new_tokens,
                                                     args.seed)
        if "accuracy" in parts:
            out["greedy"] = table_accuracy(models, tok, task, args.max_new_tokens)
    if args.json:
        files.write_json(args.json, out)


if __name__ == "__main__":
    sys.exit(cli.run_cli(main))
