"""How much of an AQN draw reaches the projections: stage 04's fp32 product against noise added to the gains.

Stage 04's `aqn_noise` never writes the RMSNorm gains: stage 03's RMSNorm multiplies the noisy gain w + Z by
the normalised activation in fp32 and rounds the product once ("fp32 product (this code)"). The official
code adds Z to the gains in their own dtype ("added to the <dtype> gains"), where a bf16 gain near 1 moves
in steps of 2^-8 and a draw of 5e-4 mostly rounds away. For each sigma this script takes one draw Z (the
same seed both ways), runs the prompts' tokens through the NVFP4 model, and fits per channel i, over all
tokens, the gain change g_i that best explains y_noisy - y_clean = g_i * rmsnorm(x)_i at the output of
every pre-norm (the input of q/k/v and gate/up), by least squares. It prints |g| / |Z| and cosine(g, Z):
1.000 / 1.000 means all of the draw arrived. docs/aqn.md's table is the default run.

    python bench/bench_aqn_landing.py                                  # fp32 and bf16, 16 prompts (~15 s)
    python bench/bench_aqn_landing.py --dtypes bfloat16 --sigmas 5e-4 --prompts 4
    python bench/bench_aqn_landing.py --model path/to/hf-folder
"""
import importlib
import os
import sys
import time

import torch
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
cli = importlib.import_module("qerl.cli")
aqn = importlib.import_module("qerl.aqn")


@torch.no_grad()
def landed_noise(model, ids, sigma, generator=None, in_gain=False):
    """How much of an AQN draw reaches the inputs of q/k/v and gate/up: runs `ids` (B, T) under aqn_noise
    and fits per channel i, over all tokens, the gain change g_i that best explains y_noisy - y_clean =
    g_i * rmsnorm(x)_i (least squares). Returns (g, z), both (num_norms * hidden,) fp32, z the draw: g == z
    means all of it arrived. in_gain=True adds Z to the gains in their own dtype instead (official code)."""
    norms = [norm for _, norm in aqn.aqn_norms(model)]
    clean = [norm.weight.detach().clone() for norm in norms]
    fit = [[0.0, 0.0] for _ in norms]  # per norm: sum(dy * n), sum(n * n), each (hidden,)

    def hook(i):
        def f(module, inp, out):
            x = inp[0].float()
            n = (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + module.eps)).to(inp[0].dtype)  # (B, T, C)
            dy = (out.float() - (clean[i] * n).float()).reshape(-1, n.shape[-1])  # (B*T, C)
            n = n.float().reshape(-1, n.shape[-1])  # (B*T, C)
            fit[i] = [fit[i][0] + (dy * n).sum(0), fit[i][1] + (n * n).sum(0)]
        return f

    with aqn.aqn_noise(model, sigma, generator):
        zs = [norm.noise.clone() if norm.noise is not None else torch.zeros_like(w, dtype=torch.float32)
              for norm, w in zip(norms, clean)]
        if in_gain:
            for norm, z in zip(norms, zs):
                norm.noise = None
                norm.weight.add_(z.to(norm.weight.dtype))
        handles = [norm.register_forward_hook(hook(i)) for i, norm in enumerate(norms)]
        try:
            model(ids)
        finally:
            for h in handles:
                h.remove()
            for norm, w in zip(norms, clean):
                norm.weight.copy_(w)
    g = torch.cat([(num / den.clamp_min(1e-30)).cpu() for num, den in fit])
    return g, torch.cat([z.cpu() for z in zs])


def main(argv=None):
    N = cli.number
    p = cli.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=os.path.join(ROOT, "assets", "tiny-qwen"))
    p.add_argument("--sigmas", type=N(above=0), nargs="+", default=[1e-2, 5e-4])
    p.add_argument("--prompts", type=N(int, 1), default=16, help="number of problems whose tokens run through")
    p.add_argument("--seed", type=N(int, 0), default=0)
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"])
    args = p.parse_args(argv)
    for dname in args.dtypes:
        t0 = time.time()
        _, variants, prompts = aqn.demo_models(args.model, getattr(torch, dname), args.seed, args.prompts)
        ids = torch.tensor([p[:min(map(len, prompts))] for p in prompts])  # (B, T) cut to one length
        print(f"noise reaching the q/k/v and gate/up inputs of NVFP4 in {dname} ({ids.numel()} tokens; "
              f"|g| / |Z| and cosine(g, Z), same draw)")
        for sigma in sorted(set(args.sigmas), reverse=True):
            cells = []
            for in_gain in (False, True):
                g, z = landed_noise(variants["NVFP4"], ids, sigma, torch.Generator().manual_seed(args.seed), in_gain)
                cells.append(f"{float(g.norm() / z.norm()):.3f} / {float(F.cosine_similarity(g, z, 0)):.3f}")
            print(f"  sigma {sigma:.0e} | fp32 product (this code) {cells[0]} | added to the {dname} gains "
                  f"{cells[1]}")
        print(f"time {time.time() - t0:.1f}s")
        print()


if __name__ == "__main__":
    sys.exit(cli.run_cli(main))
