"""
Stage 04: Adaptive Quantization Noise (AQN), its schedule, and the exploration it buys.

QeRL's central claim is that the rounding error of a 4-bit base model acts as parameter noise: it
flattens the policy's softmax, raises sampling entropy, and so helps RL explore. AQN adds a controlled
amount of *extra* noise early in training and decays it, and it does so without touching the packed
NVFP4 weights: a Gaussian vector Z is added to each RMSNorm gain w, and since

    ((w + Z) * rmsnorm(x)) @ W.T  ==  ((1 + Z / w) * rmsnorm(x)) @ W.T

the extra noise acts as row-wise multiplicative noise (relative std sigma / |w_i| on input channel i)
on every matrix that reads that norm's output: q/k/v after `input_layernorm`, gate/up after
`post_attention_layernorm` (paper Eq. 9-10 and App. G). o_proj, down_proj and the final norm get none.

Where the noise acts: only in the sampler. The noisy model is the behaviour policy (the paper's
pi_old, Algorithm 1 line 9): stage 05 samples under `aqn_noise`, records the sampler's
log-probabilities, and uses *them* as the old log-probabilities of the clipped surrogate, while the
update itself runs on the clean (noise-free) policy. The noise is drawn once per step (Algorithm 1;
section 3.3 says "resampled for each forward pass"). In any dtype the noisy gain multiplies the
normalised activation in fp32 and the product is rounded once, so a bf16 model gets the noise it is
asked for (added to a bf16 gain near 1, anything below ~2e-3 would round away).

What the importance ratio does to AQN. The ratio pi_theta / pi_old reweights every sampled token by
how much likelier the clean policy finds it than the noisy sampler did, so (up to the clip, and, as in
PPO, for each token given its prefix) the expected gradient is the clean policy's own: the ratio
cancels AQN in expectation. AQN can then only help through *which* samples get drawn (more varied
groups, fewer all-equal groups without signal), and it pays in variance (ratios away from 1, more
clipping). The 4-bit rounding noise is different: sampler and trainer share the same quantized
weights, so it is part of the policy itself, on-policy and never corrected. The official code takes
pi_old from its clean trainer instead, so its ratio is 1 on the first update and nothing corrects the
sampler's noise; and its `isinstance` check against Hugging Face norm classes may never match vLLM's
own RMSNorm, in which case it adds no noise at all (see qerl-paper-facts, section 2.3). `aqn_noise`
reports the noise it applied (stage 05 logs it as sigma_applied), and `landed_noise` measures how
much of it reaches the projections.

Run it (prints the schedule of a 600-step run, then per dtype (fp32 and bf16) the exploration table on
the bundled tiny model and how much of a draw reaches the projections; on a shared 2-core CPU the fp32
half took 14 min and the bf16 half runs ~2.3x longer, hence the smaller second line):
    python 04_aqn.py
    python 04_aqn.py --prompts 16 --samples 4 --sigmas 5e-4 1e-2       # ~11 min for fp32 + bf16
    python 04_aqn.py --model path/to/hf-folder --samples 8 --sigmas 1e-2 5e-2
"""
import argparse
import contextlib
import copy
import importlib
import math
import os
import time

import torch
import torch.nn.functional as F

quantize = importlib.import_module("01_quantize")
rollout = importlib.import_module("03_rollout")

# -----------------------------------------------------------------------------
# The noise schedule
#
# The paper splits training into K equal intervals ("stages"). Stage 0 carries quantization noise
# only (sigma = 0); stages 1..K-1 decay from sigma_start to sigma_end. Where the sources disagree:
#   - Eq. 8 writes sigma(k) = sigma_start * (sigma_end / sigma_start) ** ((k - 1) / (K - 1)), which
#     with stages 1..K-1 never reaches sigma_end; the official code (noise_scheduler.py) spaces K-1
#     values from sigma_start to sigma_end *inclusive*. We follow the code, so the last stage is
#     exactly sigma_end (the paper's App. F also says the final stage reaches the end value).
#   - The range: 1e-2 -> 5e-4 (Table 4, our default), 5e-2 -> 5e-4 (section 4.1), 1e-2 start
#     (section 3.3); the code's scripts use 1e-2 -> 1e-4. All are flags in stage 05.
#   - Stage boundaries: Algorithm 1 uses floor((step - 1) / floor(M / K)) with 1-based steps. We use
#     0-based steps and stage = floor(step * K / M), which splits M steps as evenly as integers allow
#     and never produces a stage K when M is not a multiple of K.
# The linear, cosine and log kinds are the paper's scheduler ablation (Fig. 9): the paper gives only
# curves, so their exact forms here are ours: each maps progress u = (k - 1) / (K - 2) in [0, 1] to
# a value between sigma_start and sigma_end.

DECAYING_KINDS = ("exp", "linear", "cosine", "log")
SIGMA_KINDS = DECAYING_KINDS + ("none", "feedback")


def check_sigma_range(sigma_start, sigma_end, kind):
    if sigma_start < 0 or sigma_end < 0:
        raise ValueError(f"AQN sigma must be >= 0, got sigma_start={sigma_start}, sigma_end={sigma_end}")
    if kind in DECAYING_KINDS and sigma_end > sigma_start:
        raise ValueError(f"AQN kind '{kind}' decays: sigma_end ({sigma_end}) must be <= sigma_start "
                         f"({sigma_start}); swap them or use kind 'feedback'")
    if kind in ("exp", "log") and sigma_end <= 0:
        raise ValueError(f"AQN kind '{kind}' decays geometrically and needs sigma_end > 0 (got "
                         f"{sigma_end}); use kind 'linear' or 'cosine' to decay to zero")


def sigma_stage(step, total_steps, num_stages):
    """Which of the `num_stages` equal intervals 0-based `step` falls in."""
    if total_steps < 1 or num_stages < 2:
        raise ValueError(f"AQN needs total_steps >= 1 and num_stages >= 2 (got {total_steps}, {num_stages})")
    if not 0 <= step < total_steps:
        raise ValueError(f"step {step} is outside [0, {total_steps})")
    return min(step * num_stages // total_steps, num_stages - 1)


def sigma_schedule(step, total_steps, sigma_start=1e-2, sigma_end=5e-4, num_stages=10, kind="exp"):
    """The AQN noise std for 0-based `step` of a `total_steps` run (paper Eq. 8, Algorithm 1)."""
    if kind not in SIGMA_KINDS:
        raise ValueError(f"unknown AQN kind '{kind}'; choose one of {', '.join(SIGMA_KINDS)}")
    if kind == "feedback":
        raise ValueError("AQN kind 'feedback' depends on the measured entropy: use FeedbackSigma, "
                         "which stage 05 updates after every step")
    check_sigma_range(sigma_start, sigma_end, kind)
    stage = sigma_stage(step, total_steps, num_stages)
    if kind == "none" or stage == 0:
        return 0.0
    u = (stage - 1) / max(num_stages - 2, 1)  # 0 at stage 1, 1 at the last stage
    if kind == "exp":
        return sigma_start * (sigma_end / sigma_start) ** u
    if kind == "linear":
        return sigma_start + (sigma_end - sigma_start) * u
    if kind == "cosine":
        return sigma_end + (sigma_start - sigma_end) * 0.5 * (1 + math.cos(math.pi * u))
    # "log": falls fastest early, like exp, but linearly in log(1 + stage) rather than in stage
    return sigma_start + (sigma_end - sigma_start) * math.log1p(stage - 1) / math.log1p(max(num_stages - 2, 1))


class FeedbackSigma:
    """An extension, NOT the paper's method: set sigma from the measured policy entropy.

    The fixed decay assumes the policy's entropy falls on a predictable timetable. This controller
    instead nudges sigma up (multiplicatively, by `up`) while the last step's mean sampling entropy is
    below `target_entropy`, and down (by `down`) otherwise, clamped to [sigma_min, sigma_max]. It is a
    bounded integral controller: one number of state, so stage 05 can checkpoint it as a float.
    """

    def __init__(self, target_entropy, sigma_init=1e-2, up=1.25, down=0.8, sigma_min=0.0, sigma_max=5e-2):
        if target_entropy < 0 or sigma_init < 0 or sigma_min < 0 or sigma_max < sigma_min:
            raise ValueError("FeedbackSigma needs target_entropy >= 0 and 0 <= sigma_min <= sigma_max, "
                             "sigma_init >= 0")
        if not (up >= 1.0 and 0.0 < down <= 1.0):
            raise ValueError(f"FeedbackSigma needs up >= 1 and 0 < down <= 1 (got up={up}, down={down})")
        self.target_entropy, self.up, self.down = target_entropy, up, down
        self.sigma_min, self.sigma_max = sigma_min, sigma_max
        self.sigma = min(max(sigma_init, sigma_min), sigma_max)

    def update(self, entropy):
        """Feed the last step's mean token entropy (nats); returns the sigma for the next step."""
        if not math.isfinite(entropy):
            return self.sigma  # a broken measurement should not move the controller
        factor = self.up if entropy < self.target_entropy else self.down
        # from 0 a multiplicative step cannot move: restart from a tenth of the ceiling
        base = self.sigma if self.sigma > 0 else 0.1 * self.sigma_max
        self.sigma = min(max(base * factor, self.sigma_min), self.sigma_max)
        return self.sigma

    def state_dict(self):
        return {"sigma": self.sigma}

    def load_state_dict(self, state):
        self.sigma = float(state["sigma"])

# -----------------------------------------------------------------------------
# Folding the noise into the RMSNorm gains


def aqn_norms(model):
    """The (name, RMSNorm) pairs AQN perturbs: both pre-norms of every decoder layer, never model.norm."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    norms = []
    for i, layer in enumerate(layers or []):
        for name in ("input_layernorm", "post_attention_layernorm"):
            norm = getattr(layer, name, None)
            if norm is not None and isinstance(getattr(norm, "weight", None), torch.Tensor):
                norms.append((f"model.layers.{i}.{name}", norm))
    if not layers or len(norms) != 2 * len(layers):
        raise ValueError("AQN needs a decoder with model.layers[i].input_layernorm and "
                         ".post_attention_layernorm gains (Qwen2/Llama layout); this model has "
                         f"{len(norms)} of them over {len(layers or [])} layers")
    return norms


@contextlib.contextmanager
def aqn_noise(model, sigma, generator=None):
    """Draw Z ~ N(0, sigma^2), one independent fp32 [hidden] vector per pre-norm, and make every
    pre-norm compute (w + Z) * rmsnorm(x) in fp32, rounded once to the activation dtype (stage 03's
    RMSNorm.noise); on exit, whatever happens inside, the norms are noise-free again.

    The gains themselves are never written, so a trained gain (stage 05's --train-norms) comes back
    exactly, in any dtype. Adding Z to a bf16 gain instead would keep almost nothing of a small draw:
    near 1 a bf16 gain moves in steps of 2^-8 ~ 0.004, eight times sigma 5e-4. The product is rounded
    to bf16 too, but each token's product sits at a different place between two bf16 values, so the
    rounding dithers the noise rather than erasing it: on average over tokens it arrives in full
    (`landed_noise` measures it).

    Yields a dict with the sigma asked for and `applied_std`: the RMS of the Z really applied (the
    draw's own spread; stage 05 logs it as sigma_applied).
    """
    if not (sigma >= 0 and math.isfinite(sigma)):
        raise ValueError(f"AQN sigma must be a finite number >= 0, got {sigma}")
    norms = aqn_norms(model)
    info = {"sigma": float(sigma), "applied_std": 0.0, "num_norms": len(norms)}
    if sigma == 0:
        yield info  # stage 0: quantization noise only; the model is untouched
        return
    gen_device = generator.device if generator is not None else torch.device("cpu")
    try:
        sq_sum, count = 0.0, 0
        for _, norm in norms:
            w = norm.weight  # (hidden,)
            z = torch.randn(w.shape, generator=generator, device=gen_device, dtype=torch.float32) * sigma
            norm.noise = z.to(w.device)  # (hidden,) fp32
            sq_sum += float((z * z).sum())
            count += z.numel()
        info["applied_std"] = math.sqrt(sq_sum / max(count, 1))
        yield info
    finally:
        for _, norm in norms:
            norm.noise = None


@torch.no_grad()
def landed_noise(model, ids, sigma, generator=None, in_gain=False):
    """How much of an AQN draw reaches the inputs of q/k/v and gate/up, where it acts.

    Runs `ids` (B, T) under aqn_noise; at every pre-norm a hook also computes the noise-free output
    of the same input, and fits per channel i the gain change g_i that best explains
    y_noisy - y_clean = g_i * rmsnorm(x)_i over all tokens (least squares). Returns (g, z), both
    (num_norms * hidden,) fp32 with z the draw: g == z means all of the noise arrived.
    in_gain=True instead adds Z to the stored gains in their own dtype (what this project did before,
    and what the official code does), to show how much of a draw survives that rounding.
    """
    norms = [norm for _, norm in aqn_norms(model)]
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

    with aqn_noise(model, sigma, generator):
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

# -----------------------------------------------------------------------------
# Measuring exploration: entropy of the sampling distribution and KL to the unquantized base


@torch.inference_mode()
def measure_exploration(reference, variants, prompts, num_samples=8, max_new_tokens=32, temperature=1.0,
                        sigmas=(), seed=0, eos_token_ids=None, rounds=2):
    """Entropy and KL-to-reference of several versions of one policy.

    reference: the unquantized model (the KL is measured against it, noise-free).
    variants: dict name -> model, e.g. {"bf16": ref, "NF4": nf4_model, "NVFP4": nvfp4_model}.
    For every variant, and for every variant named in ("base", "NVFP4") with each sigma in `sigmas`,
    samples `num_samples` completions per prompt (a fresh AQN draw per round, like one per RL step)
    and returns rows: {name, sigma, entropy (mean nats per sampled token), kl (mean per-token
    KL(variant || reference) over the sampled positions), len (mean completion tokens)}.
    """
    plan = [(name, model, 0.0) for name, model in variants.items()]
    plan += [(name, variants[name], s) for name in ("base", "NVFP4") if name in variants for s in sigmas]
    rows = []
    for name, model, sigma in plan:
        gen = torch.Generator().manual_seed(seed)  # same seed for every row: differences come from the model
        ent_sum = kl_sum = tok = 0.0
        for _ in range(rounds):
            with aqn_noise(model, sigma, gen):
                out = rollout.generate(model, prompts, num_samples=num_samples, max_new_tokens=max_new_tokens,
                                       temperature=temperature, eos_token_ids=eos_token_ids, generator=gen)
                logp = F.log_softmax(rollout.completion_logits(model, out.prompt_ids, out.completion_ids) / temperature, -1)
            logq = F.log_softmax(rollout.completion_logits(reference, out.prompt_ids, out.completion_ids) / temperature, -1)
            kl = (logp.exp() * (logp - logq)).sum(-1)  # (B, T) exact KL per position
            m = out.completion_mask.float()
            ent_sum += float((out.entropy * m).sum())
            kl_sum += float((kl * m).sum())
            tok += float(m.sum())
        rows.append({"name": name, "sigma": sigma, "entropy": ent_sum / max(tok, 1),
                     "kl": kl_sum / max(tok, 1), "len": tok / (rounds * len(prompts) * num_samples)})
    return rows

# -----------------------------------------------------------------------------
# Demo


def print_schedule(total_steps, sigma_start, sigma_end, num_stages):
    print(f"AQN schedule for a {total_steps}-step run ({num_stages} stages, {sigma_start:g} -> {sigma_end:g})")
    print(f"{'stage':>5} | {'steps':>11} | " + " | ".join(f"{k:>9}" for k in DECAYING_KINDS))
    for stage in range(num_stages):
        first = next(s for s in range(total_steps) if sigma_stage(s, total_steps, num_stages) == stage)
        last = max(s for s in range(total_steps) if sigma_stage(s, total_steps, num_stages) == stage)
        sig = [sigma_schedule(first, total_steps, sigma_start, sigma_end, num_stages, k) for k in DECAYING_KINDS]
        print(f"{stage:>5} | {first:>4} - {last:<4} | " + " | ".join(f"{s:>9.3e}" for s in sig))


def demo_prompts(tokenizer, n, seed):
    """Problems in the bundled model's format (`a op b op c`); stage 05 owns the full task."""
    gen = torch.Generator().manual_seed(seed)
    prompts = []
    for _ in range(n):
        a, b, c = (int(torch.randint(0, 1000, (1,), generator=gen)) for _ in range(3))
        o1, o2 = ("+-"[int(torch.randint(0, 2, (1,), generator=gen))] for _ in range(2))
        prompts.append(tokenizer.encode(rollout.chat_prompt(f"{a}{o1}{b}{o2}{c}=?")))
    return prompts


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="AQN schedule and exploration measurements")
    parser.add_argument("--model", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "assets", "tiny-qwen"))
    parser.add_argument("--steps", type=int, default=600, help="run length for the printed schedule")
    parser.add_argument("--sigma-start", type=float, default=1e-2)
    parser.add_argument("--sigma-end", type=float, default=5e-4)
    parser.add_argument("--num-stages", type=int, default=10)
    parser.add_argument("--sigmas", type=float, nargs="*", default=[5e-4, 1e-2, 5e-2])
    parser.add_argument("--prompts", type=int, default=64, help="number of problems to sample on")
    parser.add_argument("--samples", type=int, default=8, help="completions per problem")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=2, help="noise draws per row")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"],
                        help="activation dtypes to measure in")
    args = parser.parse_args()

    check_sigma_range(args.sigma_start, args.sigma_end, "exp")
    print_schedule(args.steps, args.sigma_start, args.sigma_end, args.num_stages)
    print()

    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16}
    prompts, where = None, args.model if os.path.isdir(args.model) else "a random model"
    for dname in args.dtypes:
        t0 = time.time()
        dtype = dtypes[dname]
        if os.path.isdir(args.model):
            base, tok = rollout.load_model(args.model, quant="none", dtype=dtype, device="cpu")
            nf4 = rollout.load_model(args.model, quant="nf4", dtype=dtype, device="cpu")[0]
            nvfp4 = rollout.load_model(args.model, quant="nvfp4", dtype=dtype, device="cpu")[0]
        else:  # no bundled model: the mechanics still run, on a random model
            print(f"note | {args.model} not found: measuring a small RANDOM model (the numbers mean nothing)")
            tok = rollout.byte_tokenizer()
            base = rollout.random_model(tok, args.seed).to(dtype)
            nf4 = quantize.quantize_model(copy.deepcopy(base), fmt="nf4")
            nvfp4 = quantize.quantize_model(copy.deepcopy(base), fmt="nvfp4")
        variants = {"base": base, "NF4": nf4, "NVFP4": nvfp4}
        prompts = prompts or demo_prompts(tok, args.prompts, args.seed + 1)
        rows = measure_exploration(base, variants, prompts, num_samples=args.samples,
                                   max_new_tokens=args.max_new_tokens, sigmas=args.sigmas, seed=args.seed,
                                   eos_token_ids=tok.eos_token_ids, rounds=args.rounds)
        print(f"exploration in {dname} on {where}: {args.prompts} prompts x {args.samples} samples x "
              f"{args.rounds} noise draws, T=1")
        print(f"{'model':<8} | {'AQN sigma':>9} | {'entropy (nats/tok)':>18} | {'KL to base':>10} | {'len':>5}")
        ref = rows[0]["entropy"]
        for r in rows:
            print(f"{r['name']:<8} | {r['sigma']:>9.0e} | {r['entropy']:>9.4f} ({r['entropy'] / ref - 1:+6.1%}) | "
                  f"{r['kl']:>10.5f} | {r['len']:>5.1f}")
        # Where the noise lands: the least-squares gain change seen at the q/k/v and gate/up inputs,
        # over the prompts' tokens, against the draw (1.00 = all of it arrives)
        ids = torch.tensor([p[:min(map(len, prompts))] for p in prompts])  # (B, T) cut to one length
        print(f"noise reaching the q/k/v and gate/up inputs of NVFP4 in {dname} ({ids.numel()} tokens; "
              f"|g| / |Z| and cosine(g, Z), same draw)")
        for sigma in sorted(set(args.sigmas) | {args.sigma_end}, reverse=True):
            cells = []
            for in_gain in (False, True):
                g, z = landed_noise(nvfp4, ids, sigma, torch.Generator().manual_seed(args.seed), in_gain)
                cells.append(f"{float(g.norm() / z.norm()):.3f} / {float(F.cosine_similarity(g, z, 0)):.3f}")
            print(f"  sigma {sigma:.0e} | fp32 product (this code) {cells[0]} | added to the {dname} gains "
                  f"{cells[1]}")
        print(f"time {time.time() - t0:.1f}s")
        print()
