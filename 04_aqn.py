"""Stage 04: Adaptive Quantization Noise (AQN): its schedule, the noise in the RMSNorm gains, and
the exploration it buys.

A 4-bit base's rounding error acts like parameter noise that raises sampling entropy, which helps
RL explore. AQN adds scheduled Gaussian noise Z ~ N(0, sigma^2) to the RMSNorm gains w: that is
multiplicative noise on the input columns of the Linear that reads the norm (paper Eq. 9-10),

    ((w + Z) * rmsnorm(x)) @ W.T  ==  (w * rmsnorm(x)) @ (W * (1 + Z / w)).T

so the packed NVFP4 weights are never touched. The noise acts only in the sampler, one draw per
RL step; the policy update runs on the clean model (stage 05).

Run it:  python 04_aqn.py     # the schedule of 05's default run, then the entropy table (< 1 min)
"""

import argparse
import contextlib
import importlib
import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F

rollout = importlib.import_module("03_rollout")

# 05's defaults (its --steps, --sigma-start, --sigma-end, --num-stages): the demo's schedule is
# the one 05's default run follows.
SCHEDULE_STEPS = 750
SIGMA_START, SIGMA_END, NUM_STAGES = 1e-2, 5e-4, 10


# ---- The schedule (the official code's): training splits into K equal stages; stage 0 carries only
# the quantization noise (sigma = 0), stages 1..K-1 decay geometrically from sigma_start to
# sigma_end (the paper's Eq. 8 divides by K - 1, so never reaches sigma_end).
def sigma_stage(step, total_steps, num_stages):
    """Which of the `num_stages` equal intervals 0-based `step` falls in."""
    return min(step * num_stages // total_steps, num_stages - 1)


def sigma_schedule(
    step, total_steps, sigma_start=SIGMA_START, sigma_end=SIGMA_END, num_stages=NUM_STAGES
):
    """The AQN noise std for 0-based `step` of a `total_steps` run."""
    if not (0 <= step < total_steps and num_stages >= 2 and 0 < sigma_end <= sigma_start):
        raise ValueError(
            f"sigma_schedule needs 0 <= step < total_steps, num_stages >= 2 (stage 0 adds no noise)"
            f" and 0 < sigma_end <= sigma_start; got step {step}, total_steps {total_steps}, "
            f"num_stages {num_stages}, sigma_start {sigma_start}, sigma_end {sigma_end}"
        )
    k, K = sigma_stage(step, total_steps, num_stages), num_stages
    if k == 0:
        return 0.0
    return sigma_start * (sigma_end / sigma_start) ** ((k - 1) / max(K - 2, 1))


# ---- The noise, in each decoder layer's two pre-norms (o_proj, down_proj, model.norm get none)
AQN_NORMS = ("input_layernorm", "post_attention_layernorm")  # read by q/k/v, then by gate/up


def aqn_norms(model):
    """[(name, RMSNorm)]: per decoder layer, input_layernorm then post_attention_layernorm."""
    return [
        (f"model.layers.{i}.{n}", getattr(layer, n))
        for i, layer in enumerate(model.model.layers)
        for n in AQN_NORMS
    ]


@contextlib.contextmanager
def aqn_noise(model, sigma, generator=None):
    """Draw Z ~ N(0, sigma^2) for each AQN gain, in aqn_norms' order, from `generator` (None:
    torch's); on exit, even after an error, the model is noise-free again, bit for bit.
    Yields {sigma, num_tensors, applied_std: the RMS of the noise as it landed}."""
    if not (sigma >= 0 and math.isfinite(sigma)):
        raise ValueError(f"AQN sigma must be a finite number >= 0, got {sigma}")
    norms = aqn_norms(model)
    info = {"sigma": float(sigma), "num_tensors": len(norms), "applied_std": 0.0}
    device = generator.device if generator is not None else torch.device("cpu")
    landed = []
    try:
        if sigma > 0:  # at 0 (stage 0) only the quantization noise acts: no draw
            for _, norm in norms:
                w = norm.weight.detach().float()  # (C,)
                z = torch.randn(w.shape, generator=generator, device=device, dtype=torch.float32)
                z = z * sigma  # (C,)
                # 03's RMSNorm computes (w + Z) * rmsnorm(x) in fp32 while `noise` is set: the
                # gain itself is never written, so a bf16 gain cannot round Z = 5e-4 away.
                norm.noise = z.to(w.device)
                landed.append(((w + norm.noise) - w).reshape(-1))
            info["applied_std"] = float(torch.cat(landed).double().pow(2).mean().sqrt())
        yield info
    finally:
        for _, norm in norms:
            norm.noise = None


# ---- What the noise buys: entropy of the sampling distribution (and KL to the full-precision base)
@torch.inference_mode()
def measure_exploration(
    reference,
    variants,
    prompts,
    num_samples=8,
    max_new_tokens=32,
    temperature=1.0,
    sigmas=(),
    seed=0,
    eos_token_ids=None,
    rounds=2,
):
    """Rows {name, sigma, entropy and KL to `reference` per sampled token, len}: each of
    `variants` ({name: model}), then "base" and "NVFP4" under each of `sigmas` (a fresh noise
    draw per round, as per RL step)."""
    plan = [(name, model, 0.0) for name, model in variants.items()]
    plan += [(n, variants[n], s) for n in ("base", "NVFP4") if n in variants for s in sigmas]
    sampling, rows = (num_samples, max_new_tokens, temperature, eos_token_ids), []
    for name, model, sigma in plan:
        gen = torch.Generator().manual_seed(seed)  # one seed for all rows: only the model differs
        ent_sum = kl_sum = tok = 0.0
        for _ in range(rounds):
            with aqn_noise(model, sigma, gen):
                out = rollout.generate(model, prompts, *sampling, generator=gen)
                ids = (out.prompt_ids, out.completion_ids)
                logp = F.log_softmax(rollout.completion_logits(model, *ids) / temperature, -1)
            logq = F.log_softmax(rollout.completion_logits(reference, *ids) / temperature, -1)
            kl = (logp.exp() * (logp - logq)).sum(-1)  # (B, T) exact KL per position
            m = out.completion_mask.float()  # (B, T)
            ent_sum += float((out.entropy * m).sum())
            kl_sum += float((kl * m).sum())
            tok += float(m.sum())
        n = max(tok, 1)
        rows.append(
            {
                "name": name,
                "sigma": sigma,
                "entropy": ent_sum / n,
                "kl": kl_sum / n,
                "len": tok / (rounds * len(prompts) * num_samples),
            }
        )
    return rows


# ---- The demo: the schedule of 05's default run, then the entropy table on the bundled model
def print_schedule(total, s0=SIGMA_START, s1=SIGMA_END, K=NUM_STAGES):
    """One row per stage: its steps and sigma (a stage k starts at step ceil(k T / K))."""
    print(f"AQN schedule for a {total}-step run ({K} stages, {s0:g} -> {s1:g}, exp decay)")
    print(f"{'stage':>5} | {'steps':>11} | {'sigma':>9}")
    first = [-(-k * total // K) for k in range(K + 1)]
    for k in range(K):
        if first[k] < first[k + 1]:  # a run shorter than K steps leaves some stages empty
            sigma = sigma_schedule(first[k], total, s0, s1, K)
            print(f"{k:>5} | {first[k]:>4} - {first[k + 1] - 1:<4} | {sigma:>9.3e}")


def arithmetic_prompts(tok, n, seed):
    """`n` ChatML prompts `a op b op c=?` (the bundled model's task), three-digit operands."""
    gen, prompts = torch.Generator().manual_seed(seed + 1), []
    for _ in range(n):
        a, b, c = (int(torch.randint(0, 1000, (1,), generator=gen)) for _ in range(3))
        o1, o2 = ("+-"[int(torch.randint(0, 2, (1,), generator=gen))] for _ in range(2))
        prompts.append(tok.encode(rollout.chat_prompt(f"{a}{o1}{b}{o2}{c}=?")))
    return prompts


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description="The AQN schedule and the entropy it adds")
    ap.add_argument("--model", default=str(Path(__file__).parent / "assets" / "tiny-qwen"))
    ap.add_argument("--steps", type=int, default=SCHEDULE_STEPS, help="the schedule's run length")
    ap.add_argument("--sigmas", type=float, nargs="*", default=[1e-2, 5e-2], help="AQN levels")
    ap.add_argument("--prompts", type=int, default=16, help="problems to sample on")
    ap.add_argument("--samples", type=int, default=8, help="completions per problem")
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=2, help="noise draws per row")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    print_schedule(args.steps)
    print()
    # The bundled model's matmuls are too small to gain from more threads; a busy CPU stalls them.
    torch.set_num_threads(1)
    t0 = time.time()
    base, tok = rollout.load_model(args.model, quant="none")
    nvfp4 = rollout.load_model(args.model, quant="nvfp4")[0]  # stage 01's NVFP4Linear layers
    rows = measure_exploration(
        base,
        {"base": base, "NVFP4": nvfp4},
        arithmetic_prompts(tok, args.prompts, args.seed),
        args.samples,
        args.max_new_tokens,
        sigmas=args.sigmas,
        seed=args.seed,
        eos_token_ids=tok.eos_token_ids,
        rounds=args.rounds,
    )
    print(
        f"exploration on {args.model}: {args.prompts} prompts x {args.samples} samples x "
        f"{args.rounds} noise draws, T=1"
    )
    print(
        f"{'model':<6} | {'AQN sigma':>9} | {'entropy (nats/tok)':>18} | {'KL to base':>10} | len"
    )
    for r in rows:
        gain = r["entropy"] / rows[0]["entropy"] - 1
        print(
            f"{r['name']:<6} | {r['sigma']:>9.0e} | {r['entropy']:>9.4f} ({gain:+6.1%}) | "
            f"{r['kl']:>10.5f} | {r['len']:.1f}"
        )
    print(f"time {time.time() - t0:.1f}s")
