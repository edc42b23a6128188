"""How far each AQN noise site (qerl/aqn.py SITES, the trainer's --aqn-site) moves what the sampler computes.

On the trainer's default CPU path (qerl/train.py build_policy: an NVFP4 base with its dequantized weights kept,
LoRA adapters; sample_groups: the noise, then merged sampling weights), the completions of a clean sample (sigma
0) are scored again under one draw of sigma per step, as the sampler holds its weights: per completion token the
mean and the largest |d log p| of the sampled token, and the KL from the clean next-token distribution to the
noisy one. The adapter: a fresh one (B = 0, a run's first step, where lora-A's noise cannot act: B (A + Z) = 0),
and with --adapter a trained one (a run's checkpoint folder). At sigma 0 every site gives the clean log-probs bit
for bit (tests/test_noise_sites.py).

    python bench/aqn_sites.py                      # the bundled model, sigma 1e-2, 4 draws (~20 s)
    python bench/aqn_sites.py --adapter runs/X/checkpoint-000150 --sigma 5e-4 --draws 8
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
tasks = importlib.import_module("qerl.tasks")
train = importlib.import_module("qerl.train")
rollout = importlib.import_module("qerl.rollout")


@torch.inference_mode()
def site_moves(model, samples, site, sigma, steps, seed):
    """{applied, mean, max, kl} over `steps` draws: |d log p| of the sampled tokens (mean, max) and the KL per
    token from the clean to the noisy distribution, the draw of each step as sample_groups takes it."""
    ids = (samples.prompt_ids, samples.completion_ids)
    mask = samples.completion_mask > 0  # (N, T)
    merge = train.merge_for_sampling("cpu")

    def logp():  # (N, T, V) as the sampler's weights give them
        with train.merged_sampling_weights(model, merge):
            return F.log_softmax(rollout.completion_logits(model, *ids), -1)
    clean = logp()
    tok = samples.completion_ids.unsqueeze(-1)  # (N, T, 1)
    d, kl, applied = [], [], []
    for step in steps:
        gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
        with aqn.aqn_noise(model, sigma, gen, site=site) as info:
            noisy = logp()
        applied.append(info["applied_std"])
        d.append((noisy.gather(-1, tok) - clean.gather(-1, tok)).squeeze(-1)[mask].abs())
        kl.append((clean.exp() * (clean - noisy)).sum(-1)[mask])
    d, kl = torch.cat(d), torch.cat(kl)
    return {"applied": sum(applied) / len(applied), "mean": float(d.mean()), "max": float(d.max()),
            "kl": float(kl.mean())}


def main(argv=None):
    p = cli.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=train.TINY_MODEL)
    p.add_argument("--adapter", default=None, help="a trained adapter (a run's checkpoint folder, default --lora-r "
                   "and --lora-alpha), measured after the fresh one")
    p.add_argument("--sigma", type=cli.number(float, above=0), default=1e-2)
    p.add_argument("--draws", type=cli.number(int, 1, 1000), default=4, help="noise draws (steps) per site")
    p.add_argument("--prompts", type=cli.number(int, 1, 1024), default=16)
    p.add_argument("--group", type=cli.number(int, 1, 64), default=8, help="completions per prompt")
    p.add_argument("--max-new-tokens", type=cli.number(int, 1, 512), default=42)
    p.add_argument("--seed", type=cli.number(int, 0, cli.MAX_SEED), default=0)
    p.add_argument("--threads", type=cli.number(int, 1, 1024), default=1)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    t0 = time.time()
    run = train.build_parser().parse_args(["--model", args.model, "--device", "cpu", "--seed", str(args.seed)])
    model, tok, _, _ = train.build_policy(run, "cpu")
    task = tasks.ArithmeticTask(eval_size=0)
    prompts = [tok.encode(task.prompt(q)) for q in task.problems(args.seed, 0, args.prompts)]
    print(f"AQN sites on {args.model} | --quant {run.quant}, CPU path (kept W, merged sampling weights) | sigma "
          f"{args.sigma:g} | {args.draws} draws | {args.prompts} prompts x {args.group}")
    print(f"{'adapter':<17} | {'site':<12} | {'sigma_applied':>13} | {'mean |d logp|':>13} | {'max |d logp|':>12} | "
          f"{'KL nats/tok':>11} | {'tokens':>6}")
    for adapter in ["fresh"] + ([args.adapter] if args.adapter else []):
        if adapter != "fresh":
            train.lora.load_adapter(model, adapter)
        samples, _ = train.sample_groups(model, tok, prompts, 0, 0.0, seed=args.seed, group=args.group,
                                         max_new_tokens=args.max_new_tokens)  # the clean sample: fixed tokens
        for site in aqn.SITES:
            r = site_moves(model, samples, site, args.sigma, range(1, args.draws + 1), args.seed)
            print(f"{os.path.basename(adapter.rstrip('/')):<17} | {site:<12} | {r['applied']:>13.3e} | "
                  f"{r['mean']:>13.3e} | {r['max']:>12.3e} | {r['kl']:>11.3e} | {int(samples.completion_mask.sum()):>6}")
    print(f"time {time.time() - t0:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(cli.run_cli(main))
