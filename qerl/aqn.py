"""Stage 04: Adaptive Quantization Noise (AQN): its schedule, the noise in the RMSNorm gains, and
the exploration it buys.

A 4-bit base's rounding error acts like parameter noise that raises sampling entropy, which helps RL
explore. AQN adds scheduled Gaussian noise Z ~ N(0, sigma^2) to the RMSNorm gains w: multiplicative
noise on the input columns of the Linear that reads the norm (paper Eq. 9-10),

    ((w + Z) * rmsnorm(x)) @ W.T  ==  (w * rmsnorm(x)) @ (W * (1 + Z / w)).T

so the packed NVFP4 weights are never touched. The noise acts only in the sampler, one draw per
step; the update runs on the clean policy (05 takes pi_old from it, as the official code does).

Run `python qerl/aqn.py` (the schedule, then the entropy table: ~50 s; --full, --schedule-only);
measured: docs/aqn.md.
"""
import importlib
import collections
import contextlib
import math
import os
import sys
import time

if __package__ in (None, ""):  # run as a file (python qerl/aqn.py): the checkout heads sys.path, not qerl/
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

import torch
import torch.nn.functional as F

from qerl import cli
from qerl import quantize  # its NVFP4_METHODS: the demo's --quant-method
from qerl import lora  # its LoRALinear: the LoRA sites
from qerl import devices
from qerl import hf_files
from qerl import memory

from qerl import rollout

stage04 = importlib.import_module("04_aqn")  # the stage this module extends: its definitions, used as they are
AQN_NORMS = stage04.AQN_NORMS
sigma_stage = stage04.sigma_stage

# -----------------------------------------------------------------------------
# The schedule (the official code's): training splits into K equal stages; stage 0 carries only the
# quantization noise (sigma = 0), stages 1..K-1 decay geometrically from sigma_start to sigma_end
# (the paper's Eq. 8 divides by K - 1, so never reaches sigma_end: docs/paper-notes.md).
DECAYS = {  # kind -> sigma at stage k = 1 .. K-1 of K, from s0 (sigma_start) to s1 (sigma_end)
    "exp": lambda k, K, s0, s1: s0 * (s1 / s0) ** ((k - 1) / max(K - 2, 1)),
}  # linear, cosine, log: below the banner


def sigma_schedule(step, total_steps, sigma_start=1e-2, sigma_end=5e-4, num_stages=10, kind="exp"):
    """The AQN noise std for 0-based `step` of a `total_steps` run."""
    check_schedule(total_steps, num_stages, sigma_start, sigma_end, kind, step)
    stage = sigma_stage(step, total_steps, num_stages)
    if kind == "none" or stage == 0:
        return 0.0
    return DECAYS[kind](stage, num_stages, sigma_start, sigma_end)


# -----------------------------------------------------------------------------
# The noise, in each decoder layer's two pre-norms (o_proj, down_proj, model.norm get none)


def aqn_norms(model):
    """[(name, RMSNorm)]: per decoder layer, input_layernorm then post_attention_layernorm."""
    layers = _check_aqn_layers(model)
    return [(f"model.layers.{i}.{n}", getattr(layer, n)) for i, layer in enumerate(layers)
            for n in AQN_NORMS]


def _standard_normal(w, generator):
    """One fp32 N(0, 1) draw per gain, on the generator's device (the CPU without one)."""
    device = generator.device if generator is not None else torch.device("cpu")
    return torch.randn(w.shape, generator=generator, device=device, dtype=torch.float32)  # (C,)


# A noise kind: (w, sigma, generator) -> Z, fp32 of w's shape, one draw from `generator` (None:
# torch's), called per tensor in the site's order, so a seed fixes every draw.
NOISES = {"absolute": lambda w, sigma, gen: _standard_normal(w, gen) * sigma}  # Z ~ N(0, sigma^2)

# A site, the tensors AQN perturbs: find(model) -> [(name, module)] in draw order; weight(module),
# the tensor Z is drawn for; add(module, Z) -> (the perturbation as it landed, undo); help: for 05;
# sized: whether NOISES' kinds size its draws differently (False where weight is 1 everywhere: 05 then
# refuses --aqn-scale, which would be recorded as if it had counted).
NoiseSite = collections.namedtuple("NoiseSite", "help find weight add sized", defaults=(True,))


def _add_to_gain(norm, z):
    """03's RMSNorm computes (w + Z) * rmsnorm(x) in fp32: a bf16 gain would round Z = 5e-4 away."""
    norm.noise = z
    w = norm.weight.detach().float()
    return (w + z) - w, lambda: setattr(norm, "noise", None)


SITES = {"norms": NoiseSite(
    "each decoder layer's two pre-norm gains, as the paper (multiplicative noise on the input "
    "columns of q/k/v and gate/up)",
    lambda model: [(f"{name}.weight", norm) for name, norm in aqn_norms(model)],
    lambda norm: norm.weight, _add_to_gain)}  # lora-A, lora-B, block-scales: below the banner


@contextlib.contextmanager
def aqn_noise(model, sigma, generator=None, kind="absolute", site="norms"):
    """Draw Z for each tensor of the site; on exit, even after an error, the model is noise-free
    again, bit for bit. Yields {sigma, site, num_tensors, applied_std: the RMS of what landed}."""
    _check_noise(sigma, kind, site)
    where = SITES[site]
    found = where.find(model)
    info = {"sigma": float(sigma), "site": site, "applied_std": 0.0, "num_tensors": len(found)}
    undo, landed = [], []
    try:
        if sigma > 0:  # at 0 (stage 0) only the quantization noise acts: no draw
            for _, m in found:
                w = where.weight(m)
                delta, restore = where.add(m, NOISES[kind](w, sigma, generator).to(w.device))
                undo.append(restore)
                landed.append(delta.reshape(-1))
            info["applied_std"] = float(torch.cat(landed).double().pow(2).mean().sqrt())
        yield info
    finally:
        for restore in reversed(undo):
            restore()


# -----------------------------------------------------------------------------
# What the noise buys: entropy of the sampling distribution (and KL to the unquantized base)
@torch.inference_mode()
def measure_exploration(reference, variants, prompts, num_samples=8, max_new_tokens=32,
                        temperature=1.0, sigmas=(), seed=0, eos_token_ids=None, rounds=2):
    """Rows {name, sigma, entropy and KL to `reference` per sampled token, len}: each of `variants`,
    then "base" and "NVFP4" under each of `sigmas` (a fresh draw per round, as per RL step)."""
    plan = [(name, model, 0.0) for name, model in variants.items()]
    plan += [(n, variants[n], s) for n in ("base", "NVFP4") if n in variants for s in sigmas]
    rows = []
    for name, model, sigma in plan:
        gen = torch.Generator().manual_seed(seed)  # one seed for all rows: only the model differs
        ent_sum = kl_sum = tok = 0.0
        for _ in range(rounds):
            with aqn_noise(model, sigma, gen):
                out = rollout.generate(model, prompts, num_samples, max_new_tokens, temperature,
                                       eos_token_ids=eos_token_ids, generator=gen)
                ids = (out.prompt_ids, out.completion_ids)
                logp = F.log_softmax(rollout.completion_logits(model, *ids) / temperature, -1)
            logq = F.log_softmax(rollout.completion_logits(reference, *ids) / temperature, -1)
            kl = (logp.exp() * (logp - logq)).sum(-1)  # (B, T) exact KL per position
            m = out.completion_mask.float()  # (B, T)
            ent_sum += float((out.entropy * m).sum())
            kl_sum += float((kl * m).sum())
            tok += float(m.sum())
        rows.append({"name": name, "sigma": sigma, "entropy": ent_sum / max(tok, 1), "kl": kl_sum /
                     max(tok, 1), "len": tok / (rounds * len(prompts) * num_samples)})
    return rows


# ============ Part 2: variants (decays, relative noise, LoRA sites, feedback), checks, demo, command line ============

# -----------------------------------------------------------------------------
# More decays (05 --aqn-kind): linear, cosine and log are our forms of the paper's scheduler ablation
# (Fig. 9 shows only their curves). Each maps u = (k - 1) / (K - 2) in [0, 1], the exponent exp uses,
# from sigma_start to sigma_end; docs/figures/aqn_schedule.png draws each kind over the default run.

def _u(k, K):
    return (k - 1) / max(K - 2, 1)  # 0 at stage 1, 1 at the last stage


DECAYS["linear"] = lambda k, K, s0, s1: s0 + (s1 - s0) * _u(k, K)
DECAYS["cosine"] = lambda k, K, s0, s1: s1 + (s0 - s1) * 0.5 * (1 + math.cos(math.pi * _u(k, K)))
# falls fastest early, like exp, but linearly in log(1 + stage) rather than in stage
DECAYS["log"] = lambda k, K, s0, s1: s0 + (s1 - s0) * math.log1p(k - 1) / math.log1p(max(K - 2, 1))
DECAYING_KINDS = tuple(DECAYS)  # read after every decay is registered
SIGMA_KINDS = DECAYING_KINDS + ("none", "feedback")  # feedback: FeedbackSigma, our extension (below)

# -----------------------------------------------------------------------------
# Relative noise (05 --aqn-scale relative): Z_i ~ N(0, (sigma w_i)^2), so input column i of the next Linear
# is scaled by 1 + sigma * N(0, 1) whatever the gains, and sigma means the same relative perturbation on every
# model (the paper's absolute sigma was sized for Qwen2.5's gains near 1; SmolLM2's are near 0.3, and 0.02 in
# layer 0: docs/aqn.md). Another kind is one more entry.
NOISES["relative"] = lambda w, sigma, gen: _standard_normal(w, gen) * sigma * w.detach().float().abs().to(
    gen.device if gen is not None else "cpu")

# -----------------------------------------------------------------------------
# The LoRA sites (05 --aqn-site lora-A, lora-B). Noise must reach what the sampler runs: 05 samples on a CPU
# with merged weights W + s B A (02 lora_merged), built when that block is entered, so a LoRA site writes the
# matrices themselves before the merge, and refuses to act inside one (its noise would miss the merged copy).

def _lora_matrices(attr):
    """find(model) for a site on every LoRA layer's `attr` (lora_A or lora_B)."""
    def find(model):
        layers = [(f"{name}.{attr}", m) for name, m in model.named_modules() if isinstance(m, lora.LoRALinear)]
        if not layers:
            raise ValueError(f"AQN site on {attr} needs LoRA adapters (02 add_lora); {type(model).__name__} has none")
        if any(m.merged is not None for _, m in layers):
            raise ValueError(f"AQN noise on {attr} inside 02's lora_merged would miss the merged weights the model "
                             f"runs: enter aqn_noise first, then lora_merged (as 05's sample_groups does)")
        return layers
    return find


def _add_to_matrix(attr):
    """add(module, Z) for a LoRA matrix: written in place (fp32), the clean copy put back on undo."""
    @torch.no_grad()
    def add(m, z):
        p = getattr(m, attr)
        clean = p.detach().clone()
        p.add_(z.to(p.dtype))
        return p.detach().float() - clean.float(), torch.no_grad()(lambda: p.copy_(clean))
    return add


SITES["lora-A"] = NoiseSite("every LoRA A matrix (02), before a CPU sampler merges them",
                            _lora_matrices("lora_A"), lambda m: m.lora_A, _add_to_matrix("lora_A"))
SITES["lora-B"] = NoiseSite("every LoRA B matrix (02), before a CPU sampler merges them",
                            _lora_matrices("lora_B"), lambda m: m.lora_B, _add_to_matrix("lora_B"))

# -----------------------------------------------------------------------------
# The block-scale site (05 --aqn-site block-scales), our extension: every NVFP4 layer's FP8-E4M3 block scales
# (weight_scale, one per 16 weights) times (1 + Z), Z ~ N(0, sigma^2) per block: each block of 16 weights scaled
# by 1 + Z, the packed codes untouched. E4M3 steps by 6-12%, so a 1e-2 change rounds away in it: while the noise
# acts, each layer's weight_scale buffer is a float32 copy (what the dequantization reads; a CPU's kept weight
# follows its buffers, quant_engine's weight_in; the Triton kernel reads only E4M3, so those layers run the
# dequantized product meanwhile), and the E4M3 tensor itself is put back on exit. The draw: one N(0, 1) per
# block, (out, K/16) per layer in module order, from the step's generator as every site; Z is drawn for each
# block's multiplier 1, so --aqn-scale absolute and relative are the same here. Like the LoRA sites, it acts
# before 02's lora_merged and refuses inside it (the merged weights were built from the clean scales).

def _nvfp4_layers(model):
    """find(model) for the block-scales site: every NVFP4Linear as [(its weight_scale's name, the layer)]."""
    layers = [(f"{name}.weight_scale", m) for name, m in model.named_modules() if isinstance(m, quantize.NVFP4Linear)]
    if not layers:
        raise ValueError(f"AQN site block-scales needs an NVFP4 base (--quant nvfp4); {type(model).__name__} has no "
                         f"NVFP4 layer")
    if any(m.merged is not None for m in model.modules() if isinstance(m, lora.LoRALinear)):
        raise ValueError("AQN noise on block scales inside 02's lora_merged would miss the merged weights the model "
                         "runs: enter aqn_noise first, then lora_merged (as 05's sample_groups does)")
    return layers


@torch.no_grad()
def _scale_blocks(layer, z):
    """add(layer, Z): weight_scale becomes float32 s * (1 + Z); lands (s' - s) / s, the relative change per block
    (0 for a zero scale); undo puts the E4M3 tensor back."""
    e4m3 = layer.weight_scale
    s = e4m3.float()  # (out, nb)
    layer.weight_scale = s * (1 + z)
    landed = torch.where(s != 0, (layer.weight_scale - s) / s.where(s != 0, 1), 0)
    return landed, lambda: setattr(layer, "weight_scale", e4m3)


SITES["block-scales"] = NoiseSite(
    "NVFP4's block scales (one per 16 weights) times 1 + Z, held in fp32 while sampling (needs --quant nvfp4; "
    "relative already: takes no --aqn-scale)",
    _nvfp4_layers, lambda m: torch.ones(m.weight_scale.shape, device=m.weight_scale.device), _scale_blocks,
    sized=False)

# -----------------------------------------------------------------------------
# --aqn-kind feedback: sigma from an entropy-feedback controller instead of the schedule (our extension)

class FeedbackSigma:
    """An extension, NOT the paper's method: instead of a fixed timetable, nudge sigma up (times `up`)
    while the last step's mean sampling entropy is below `target_entropy` and down (times `down`)
    otherwise, clamped to [sigma_min, sigma_max]. One number of state, checkpointed by stage 05."""

    def __init__(self, target_entropy, sigma_init=1e-2, up=1.25, down=0.8, sigma_min=0.0, sigma_max=5e-2):
        _check_feedback(target_entropy, sigma_init, up, down, sigma_min, sigma_max)
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
# Checks

def check_sigma_range(sigma_start, sigma_end, kind):
    """The settings of a sigma_schedule: a known timetable kind, sigmas >= 0, and a decay that decays."""
    if kind not in SIGMA_KINDS:
        raise ValueError(f"unknown AQN kind '{kind}'; choose one of {', '.join(SIGMA_KINDS)}")
    if kind == "feedback":
        raise ValueError("AQN kind 'feedback' depends on the measured entropy: use FeedbackSigma, "
                         "which stage 05 updates after every step")
    if sigma_start < 0 or sigma_end < 0:
        raise ValueError(f"AQN sigma must be >= 0, got sigma_start={sigma_start}, sigma_end={sigma_end}")
    if kind in DECAYING_KINDS and sigma_end > sigma_start:
        raise ValueError(f"AQN kind '{kind}' decays: sigma_end ({sigma_end}) must be <= sigma_start "
                         f"({sigma_start}); swap them or use kind 'feedback'")
    if kind in ("exp", "log") and sigma_end <= 0:
        raise ValueError(f"AQN kind '{kind}' decays geometrically and needs sigma_end > 0 (got "
                         f"{sigma_end}); use kind 'linear' or 'cosine' to decay to zero")


def check_schedule(total_steps, num_stages, sigma_start, sigma_end, kind, step=0):
    """Everything sigma_schedule(step, total_steps, sigma_start, sigma_end, num_stages, kind) refuses, as one
    ValueError line; a trainer calls it before any work (stage 05's --num-stages)."""
    check_sigma_range(sigma_start, sigma_end, kind)
    _check_stage(step, total_steps, num_stages)


def _check_stage(step, total_steps, num_stages):
    if total_steps < 1:
        raise ValueError(f"AQN needs total_steps >= 1 (got {total_steps})")
    if num_stages < 2:  # stage 0 is noise-free: with one stage, AQN would never add noise
        raise ValueError(f"AQN needs num_stages >= 2 (got {num_stages}): stage 0 is noise-free, so one stage "
                         f"would never add noise; use kind 'none' to train without AQN")
    if not 0 <= step < total_steps:
        raise ValueError(f"step {step} is outside [0, {total_steps})")


def _check_feedback(target_entropy, sigma_init, up, down, sigma_min, sigma_max):
    if target_entropy < 0 or sigma_init < 0 or sigma_min < 0 or sigma_max < sigma_min:
        raise ValueError("FeedbackSigma needs target_entropy >= 0 and 0 <= sigma_min <= sigma_max, "
                         "sigma_init >= 0")
    if not (up >= 1.0 and 0.0 < down <= 1.0):
        raise ValueError(f"FeedbackSigma needs up >= 1 and 0 < down <= 1 (got up={up}, down={down})")


def _check_noise(sigma, kind, site="norms"):
    if not (sigma >= 0 and math.isfinite(sigma)):
        raise ValueError(f"AQN sigma must be a finite number >= 0, got {sigma}")
    if kind not in NOISES:
        raise ValueError(f"unknown AQN noise kind '{kind}'; choose one of {', '.join(NOISES)}")
    if site not in SITES:
        raise ValueError(f"unknown AQN noise site '{site}'; choose one of {', '.join(SITES)}")


def _check_aqn_layers(model):
    """model.layers, each with both of AQN's norms (_check_layer_norms)."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    if not layers:
        raise ValueError(f"{type(model).__name__} has no model.layers: AQN needs a Qwen2/Llama-like decoder, "
                         "with input_layernorm feeding q/k/v and post_attention_layernorm feeding gate/up")
    for i, layer in enumerate(layers):
        _check_layer_norms(i, layer)
    return layers


def _check_layer_norms(i, layer):
    """Layer i has both of AQN's norms, as stage 03 RMSNorms (they read `noise`), and no other layer-level norm:
    with more (Gemma's four), the names no longer say which norm feeds q/k/v and which gate/up."""
    norms = {n for n, m in layer.named_children() if isinstance(m, rollout.RMSNorm)}
    missing, other = [n for n in AQN_NORMS if n not in norms], sorted(norms - set(AQN_NORMS))
    if missing or other:
        raise ValueError(f"AQN perturbs each decoder layer's input_layernorm (feeding q/k/v) and "
                         f"post_attention_layernorm (feeding gate/up), stage 03 RMSNorms, and no other norm; "
                         f"model.layers.{i} ({type(layer).__name__}) lacks: {', '.join(missing) or 'nothing'}; "
                         f"has other norms: {', '.join(other) or 'none'}")


def stage_steps(total_steps, num_stages):
    """(stage, first step, last step) of each stage that has steps: stage k starts at ceil(k T / K), the
    inverse of sigma_stage, so the table has at most `num_stages` rows however long the run."""
    _check_stage(0, total_steps, num_stages)
    first = [-(-k * total_steps // num_stages) for k in range(num_stages + 1)]
    return [(k, first[k], first[k + 1] - 1) for k in range(num_stages) if first[k] < first[k + 1]]


def print_schedule(total, s0, s1, K):
    w = len(str(total - 1))
    print(f"AQN schedule for a {total}-step run ({K} stages, {s0:g} -> {s1:g})")
    print(f"{'stage':>5} | {'steps':>{2 * w + 3}} | " + " | ".join(f"{k:>9}" for k in DECAYING_KINDS))
    for stage, first, last in stage_steps(total, K):
        sig = [sigma_schedule(first, total, s0, s1, K, k) for k in DECAYING_KINDS]
        print(f"{stage:>5} | {first:>{w}} - {last:<{w}} | " + " | ".join(f"{s:>9.3e}" for s in sig))


def demo_models(model_dir, dtype, seed, num_prompts, method="rtn"):
    """The tokenizer, {base, and each registered weight format (quantize.WEIGHT_FORMATS, by name: NF4, NVFP4)} of
    the folder model_dir in `dtype`, `num_prompts` problems. method: NVFP4's rounding ("rtn" or "4over6")."""
    base, tok = rollout.load_model(model_dir, quant="none", dtype=dtype, device="cpu")  # a missing folder: an error
    models = {"base": base}
    for fmt in sorted(quantize.WEIGHT_FORMATS):  # a format registered later joins the table
        models[fmt.upper()] = rollout.load_model(model_dir, quant=fmt, dtype=dtype, device="cpu",
                                                 **({"method": method} if fmt == "nvfp4" else {}))[0]
    gen, prompts = torch.Generator().manual_seed(seed + 1), []  # `a op b op c`; tasks.py owns 05's tasks
    for _ in range(num_prompts):
        a, b, c = (int(torch.randint(0, 1000, (1,), generator=gen)) for _ in range(3))
        o1, o2 = ("+-"[int(torch.randint(0, 2, (1,), generator=gen))] for _ in range(2))
        prompts.append(tok.encode(hf_files.chat_prompt(f"{a}{o1}{b}{o2}{c}=?")))
    return tok, models, prompts


# The default run is the quick one (its time: the docstring); --full is the table measured at size
# (docs/aqn.md). A flag given explicitly wins over either.
QUICK = {"prompts": 32, "samples": 8, "sigmas": [1e-2, 5e-2], "dtypes": ["float32"]}
FULL = {"prompts": 64, "samples": 8, "sigmas": [5e-4, 1e-2, 5e-2], "dtypes": ["float32", "bfloat16"]}


def build_parser():
    number = cli.number
    parser = cli.ArgumentParser(description="AQN schedule and exploration measurements")
    parser.add_argument("--model", default=os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "assets", "tiny-qwen"))
    parser.add_argument("--steps", type=number(int, 1), default=stage04.SCHEDULE_STEPS, help="run length for the printed schedule (05's --steps)")
    # The table prints every decaying kind, and exp/log need sigma_end > 0 (check_sigma_range).
    parser.add_argument("--sigma-start", type=number(float, above=0), default=1e-2)
    parser.add_argument("--sigma-end", type=number(float, above=0), default=5e-4)
    # check_schedule needs >= 2 stages (stage 0 is noise-free); the table has a row per stage.
    parser.add_argument("--num-stages", type=number(int, 2, 1000), default=10)
    parser.add_argument("--full", action="store_true",
                        help=f"the table at size: {FULL} (default: {QUICK}); explicit flags override either")
    parser.add_argument("--sigmas", type=number(float, 0), nargs="*",
                        help="AQN levels for base and NVFP4 (default 1e-2 5e-2)")
    parser.add_argument("--prompts", type=number(int, 1), help="number of problems to sample on (default 32)")
    parser.add_argument("--samples", type=number(int, 1), help="completions per problem (default 8)")
    parser.add_argument("--max-new-tokens", type=number(int, 1), default=48)
    parser.add_argument("--rounds", type=number(int, 1), default=2, help="noise draws per row")
    parser.add_argument("--seed", type=number(int, 0, cli.MAX_SEED), default=0)
    parser.add_argument("--threads", type=number(int, 0, 1024), default=1, help="torch CPU threads (0: torch's default); "
                        "the bundled model's matmuls are too small to gain from more, and a busy CPU stalls them")
    parser.add_argument("--quant-method", default="rtn", choices=quantize.NVFP4_METHODS,
                        help="the NVFP4 row's rounding: rtn (compressed-tensors) or 4over6 (Four Over Six)")
    parser.add_argument("--dtypes", nargs="+", choices=["float32", "bfloat16"],
                        help="activation dtypes to measure in (default float32)")
    parser.add_argument("--schedule-only", action="store_true", help="print the schedule table and stop (no model)")
    return parser


def parse_args(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.sigma_end > args.sigma_start:
        parser.error(f"--sigma-end {args.sigma_end:g} must be <= --sigma-start {args.sigma_start:g}: the "
                     f"schedule decays")
    for k, v in (FULL if args.full else QUICK).items():
        if getattr(args, k) is None:
            setattr(args, k, list(v) if isinstance(v, list) else v)
    return args


def main(argv=None):
    args = parse_args(argv)
    if args.schedule_only:
        print_schedule(args.steps, args.sigma_start, args.sigma_end, args.num_stages)
        return 0
    # a missing or broken folder, or a weight stored in a dtype 03 cannot load: one line, before any work
    hf_files.read_weight_headers(args.model, hf_files.find_weight_files(args.model)[1])
    if args.threads:
        torch.set_num_threads(args.threads)
    # the measurement's memory (three models, one sampling, the KL), before any model loads
    cfg = rollout.ModelConfig.from_dict(hf_files.find_weight_files(args.model)[0],
                                        os.path.join(args.model, "config.json"))
    need = memory.exploration_memory(cfg, args.prompts * args.samples, args.max_new_tokens,
                                     max(getattr(torch, d).itemsize for d in args.dtypes))
    devices.check_memory_fits(need, "cpu", f"--prompts {args.prompts} x --samples {args.samples} with "
                              f"--max-new-tokens {args.max_new_tokens}")
    print_schedule(args.steps, args.sigma_start, args.sigma_end, args.num_stages)
    print()
    for dname in args.dtypes:
        t0 = time.time()
        tok, variants, prompts = demo_models(args.model, getattr(torch, dname), args.seed, args.prompts,
                                             args.quant_method)
        rows = measure_exploration(variants["base"], variants, prompts, num_samples=args.samples,
                                   max_new_tokens=args.max_new_tokens, sigmas=args.sigmas, seed=args.seed,
                                   eos_token_ids=tok.eos_token_ids, rounds=args.rounds)
        print(f"exploration in {dname} on {args.model}: {args.prompts} prompts x {args.samples} samples x "
              f"{args.rounds} noise draws, T=1 | NVFP4 rounding {args.quant_method}")
        print(f"{'model':<8} | {'AQN sigma':>9} | {'entropy (nats/tok)':>18} | {'KL to base':>10} | {'len':>5}")
        for r in rows:
            print(f"{r['name']:<8} | {r['sigma']:>9.0e} | {r['entropy']:>9.4f} "
                  f"({r['entropy'] / rows[0]['entropy'] - 1:+6.1%}) | {r['kl']:>10.5f} | {r['len']:>5.1f}")
        print(f"time {time.time() - t0:.1f}s")
        print()
    return 0


if __name__ == "__main__":
    sys.exit(cli.run_cli(main))
