"""Stage 05: GRPO with LoRA on a 4-bit base, with Adaptive Quantization Noise (the QeRL loop).

QeRL trains reasoning with RL while the base model stays frozen in NVFP4 and only LoRA adapters learn:
the 4-bit base makes sampling (most of a step) cheap, and its rounding noise, plus AQN's scheduled noise
on the RMSNorm gains, raises sampling entropy, which helps exploration. (Why it should: noise on the weights
is noise on the logits, and averaged over it a softmax of noisy logits is flatter than the clean one; the paper
measures the rise, docs/aqn.md ours.) One step (`train`'s loop): B prompts x G samples drawn under AQN ->
rewards -> group-normalised advantages -> clipped surrogate on the clean policy, pi_old as --pi-old reads it
(PI_OLD) -> AdamW on the adapters. docs/figures/grpo_step.png draws it; `--show-step` works one group by hand.

Run it (2 CPU cores, about 5 min, at most 9 by its --time-budget 540: the bundled tiny model learns synthetic
arithmetic; the numbers are in README's "Results" section and docs/experiments.md):
    python 05_grpo.py
    python 05_grpo.py --quant none --no-aqn --steps 200 --out runs/lora-only
    python 05_grpo.py --resume runs/qerl/checkpoint-000200
    python 05_grpo.py --show-step   # one sampled group's rewards, advantages, ratios and loss, by hand (3 s)
    python 05_grpo.py --task gsm8k --data train.jsonl --eval-data test.jsonl --model Qwen2.5-7B-Instruct
    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node 2 05_grpo.py --out runs/dp2   # data parallel
Qwen2.5-7B + GSM8K on one GPU or eight: docs/scaling.md.

Part 1 is the method and the loop. The engine beneath it, in modules that import no stage: tasks.py (the
tasks and their data), runs.py (the run folder, its log, the time budget, stop signals), checkpoints.py
(checkpoints and --resume), distributed.py (torchrun), memory.py (estimates, --micro-batch auto); the plumbing
beneath every stage: devices.py, files.py, hf_files.py (a model folder's files) and cli.py (the command line).
"""
import argparse
import contextlib
import dataclasses
import datetime
import functools
import importlib
import math
import os
import sys
import time
from typing import Callable

import torch

import checkpoints
import cli
import devices
import hf_files
import engine
import distributed
import memory
import runs
import tasks

quantize = importlib.import_module("01_quantize")
lora = importlib.import_module("02_lora")
rollout = importlib.import_module("03_rollout")
aqn = importlib.import_module("04_aqn")

# -----------------------------------------------------------------------------
# The policy: a frozen (quantized) base with fresh LoRA adapters, and AdamW on the adapters alone


def build_policy(args, device):
    """-> (model, tok, params, opt). The adapter initialisation depends on --seed alone, so every rank
    builds the same one."""
    model, tok = rollout.load_model(args.model, quant=args.quant, dtype=policy_dtype(args, device)[0], device=device,
                                    method=args.quant_method)
    model.grad_checkpoint = args.grad_checkpoint  # acts in the update's forward only (it needs gradients)
    quantize.keep_dequantized(model, merge_for_sampling(device))  # a CPU rebuilds the frozen 4-bit weights once
    lora.add_lora(model, r=args.lora_r, alpha=args.lora_alpha, generator=torch.Generator().manual_seed(args.seed))
    params = lora.lora_parameters(model)
    if args.train_norms:  # fp32 master copies of every layer's pre-norm gains, as the official code trains
        for _, norm in aqn.aqn_norms(model):
            norm.weight = torch.nn.Parameter(norm.weight.detach().float())
            params.append(norm.weight)
    opt = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.99), weight_decay=0.0)
    return model, tok, params, opt


def lr_factor(step, warmup, total, min_ratio):
    """The LR multiplier at `step`: linear warmup over `warmup` steps, then cosine decay to min_ratio at `total`."""
    if step < warmup:
        return (step + 1) / warmup
    u = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * u))


def step_sigma(args, step, feedback=None):
    """AQN's noise level at `step`: none with --no-aqn, the feedback controller's with --aqn-kind feedback,
    else the schedule's (stage 04)."""
    if not args.aqn:
        return 0.0
    if feedback is not None:
        return feedback.sigma
    return aqn.sigma_schedule(step, args.steps, args.sigma_start, args.sigma_end, args.num_stages, args.aqn_kind)

# -----------------------------------------------------------------------------
# Sampling under AQN: G completions per prompt from the policy with noise on its RMSNorm gains (stage 04).


def merge_for_sampling(device):
    """Whether sampling runs on merged weights W + s B A (02's lora_merged): the same function as the
    LoRA layers, but on a CPU one matmul a layer instead of a dequantization and three. On CUDA the kernel
    reads the 4-bit bytes and a merged copy would cost the model's full size (--gpu-path: the same there)."""
    return torch.device(device).type == "cpu" and not quantize.NVFP4Linear.kernel_on_cpu


def merged_sampling_weights(model, enabled=True):
    return lora.lora_merged(model) if enabled else contextlib.nullcontext(model)


def sample_groups(model, tok, prompts, step, sigma, *, rank=0, group=8, max_new_tokens=42, temperature=1.0,
                  seed=0, compiled=False, noise="absolute", site="norms", draw=0):
    """`group` completions of each prompt (token id lists), drawn under AQN noise `sigma` (kind `noise`, on the
    tensors of `site`: 04 NOISES, SITES) -> (stage 03's Rollout, rows prompt-major; the RMS of the noise as it
    landed). `draw` numbers the samplings of one step (--dynamic-sampling's rounds): each its own completions,
    all under the step's one noise draw."""
    # One generator per step, derived from (seed, step): a resumed run samples what an uninterrupted one would.
    device, gen_seed = devices.model_device(model), seed * 1_000_003 + step
    gen = torch.Generator(device=device).manual_seed(gen_seed)
    # The noise first, then the merge: merged weights are built from the noisy LoRA matrices (a LoRA site)
    with torch.inference_mode(), aqn.aqn_noise(model, sigma, gen, kind=noise, site=site) as applied, \
            merged_sampling_weights(model, merge_for_sampling(device)):
        # aqn_noise drew the noise from `gen` on entering: every rank seeded it alike, so every rank perturbs the
        # model alike. Rank 0's first draw samples on from that stream, the others (torchrun ranks, later draws)
        # from streams of their own (draw 0 is the seed of before draws existed).
        if rank > 0 or draw > 0:
            gen = torch.Generator(device=device).manual_seed(gen_seed + rank * 2 ** 40 + draw * 2 ** 50)
        samples = rollout.generate(model, prompts, num_samples=group, max_new_tokens=max_new_tokens,
                                   temperature=temperature, eos_token_ids=tok.eos_token_ids, generator=gen,
                                   tokenizer=tok, compiled=compiled)
    return samples, applied["applied_std"]


def truncated_rows(ids, mask, eos_token_ids):
    """(N,) bool: the rows whose completion has no EOS token, i.e. that max_new_tokens cut off."""
    eos = torch.tensor(list(eos_token_ids), dtype=ids.dtype, device=ids.device)
    return ~(torch.isin(ids, eos) & (mask > 0)).any(1)

# -----------------------------------------------------------------------------
# Rewards and advantages


def score(task, problems, texts, group):
    """The task's reward of each completion (N,) and how many are correct; `texts` prompt-major, `group` each."""
    rows = [p for p in problems for _ in range(group)]  # (N,) the problem of each row
    rewards = torch.tensor([task.reward(p, text) for p, text in zip(rows, texts)])  # (N,)
    correct = sum(task.correct(p, text) for p, text in zip(rows, texts))
    return rewards, correct


def group_advantages(rewards, group, scale_std=True, eps=1e-4):
    """rewards (B*G,) in prompt-major order -> advantages (B*G,): r - mean of its group, divided by
    the group's (unbiased) std + eps unless scale_std is False (Dr. GRPO)."""
    r = rewards.float().view(-1, group)  # (B, G)
    adv = r - r.mean(dim=1, keepdim=True)  # (B, G)
    if scale_std:
        std = r.std(dim=1, keepdim=True) if group > 1 else torch.zeros_like(r[:, :1])  # (B, 1)
        adv = adv / (std + eps)
    return adv.reshape(-1)  # (B*G,)


def refill_flat_groups(args, task, model, tok, step, sigma, rank, world, problems, samples, rewards, correct):
    """DAPO's dynamic sampling (--dynamic-sampling N): a group whose G rewards all tie has zero advantage and
    trains nothing, so up to N more rounds replace such groups with groups whose rewards differ, and the batch
    keeps its size. Round r samples (draw r, under the step's one noise draw) this rank's share of the step's
    next --batch problems, problems(seed, step, B (r + 1))[B r:] (prefix-stable, so fresh ones), as many as it
    has flat groups; a group still flat after N rounds stays. Every draw is a function of (seed, step, r): a
    resumed run refills as an uninterrupted one. -> (problems, samples, rewards, correct) of the batch that
    trains, and {ds_rounds: rounds taken (the most of any rank), ds_flat_before: flat groups before refilling}."""
    G, B = args.group, args.batch

    def flat_of(r):  # rewards (n*G,) -> n bools: whether each group's rewards all tie
        return (r.view(-1, G).std(1) == 0).tolist()
    flat = [g for g, f in enumerate(flat_of(rewards)) if f]  # this rank's flat groups, to replace in order
    picks, problems, flat_before, rounds = [(samples, g) for g in range(len(problems))], list(problems), len(flat), 0
    while flat and rounds < args.dynamic_sampling:
        rounds += 1
        more = distributed.shard(task.problems(args.seed, step, B * (rounds + 1))[B * rounds:], rank, world)
        more = more[:len(flat)]
        new, _ = sample_groups(model, tok, [tok.encode(task.prompt(p)) for p in more], step, sigma, rank=rank,
                               draw=rounds, **sampling_options(args))
        for g, is_flat in enumerate(flat_of(score(task, more, new.texts, G)[0])):
            if not is_flat:
                slot = flat.pop(0)
                picks[slot], problems[slot] = (new, g), more[g]
    if rounds:  # the trained batch: its groups in slot order, scored once more as one batch
        samples = take_groups(picks, G, tok.pad_token_id)
        rewards, correct = score(task, problems, samples.texts, G)
    record = {"ds_rounds": int(distributed.global_sum([rounds], op="max")[0]),
              "ds_flat_before": int(distributed.global_sum([flat_before])[0])}
    return problems, samples, rewards, correct, record


@torch.inference_mode()
def take_groups(picks, group, pad_id):
    """One Rollout of whole groups, picks[i] = (a Rollout, a group index in it), its tensors padded to the longest
    completion (completion_ids with pad_id, the rest with 0: outside the mask)."""
    T = max(r.completion_ids.shape[1] for r, _ in picks)
    rows = [(r, slice(g * group, (g + 1) * group)) for r, g in picks]

    def cat(field, value=0):
        parts = [getattr(r, field)[s] for r, s in rows]  # (G, T_r) each
        return torch.cat([torch.nn.functional.pad(t, (0, T - t.shape[1]), value=value) for t in parts])  # (N, T)
    return rollout.Rollout(prompt_ids=[p for r, s in rows for p in r.prompt_ids[s]],
                           completion_ids=cat("completion_ids", pad_id or 0), completion_mask=cat("completion_mask"),
                           logprobs=cat("logprobs"), entropy=cat("entropy"),
                           texts=[t for r, s in rows for t in r.texts[s]])

# -----------------------------------------------------------------------------
# The loss


LOSS_AGGS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")


def aggregate(values, mask, mode, max_new_tokens=None, denom=None):
    """Reduce per-token values (N, T) under mask (N, T) to a scalar.
    token-mean: sum / number of tokens (DAPO; long answers weigh more).
    seq-mean-token-mean: mean over sequences of each one's token mean (original GRPO).
    seq-mean-token-sum-norm: sum / (N * max_new_tokens), a constant (Dr. GRPO: no length bias).
    denom, when given, replaces the divisor (policy_update passes counts summed over all ranks)."""
    mask = mask.to(values.dtype)
    if mode == "token-mean":
        return (values * mask).sum() / (mask.sum().clamp(min=1) if denom is None else denom)
    if mode == "seq-mean-token-mean":
        per_seq = (values * mask).sum(1) / mask.sum(1).clamp(min=1)  # (N,)
        has = (mask.sum(1) > 0).to(values.dtype)  # (N,) empty rows do not count
        return (per_seq * has).sum() / (has.sum().clamp(min=1) if denom is None else denom)
    if mode == "seq-mean-token-sum-norm":
        if denom is None and not max_new_tokens:
            raise ValueError("loss aggregation seq-mean-token-sum-norm needs max_new_tokens")
        return (values * mask).sum() / (values.shape[0] * max_new_tokens if denom is None else denom)
    raise ValueError(f"unknown loss aggregation {mode!r}; choose one of {', '.join(LOSS_AGGS)}")


@dataclasses.dataclass(frozen=True)
class LossOptions:
    """The options of grpo_loss. Each field is the flag of the same name (eps_low: --eps-low), which
    from_args reads and whose default is the field's: a new option is a field here and a flag in build_parser."""
    eps_low: float = 0.2  # the ratio pi_theta / pi_old is clipped to [1 - eps_low, 1 + eps_high]; the higher
    eps_high: float = 0.28  # upper bound (DAPO's clip-higher) leaves rare tokens room to rise
    loss_agg: str = "token-mean"  # one of LOSS_AGGS (see aggregate)
    beta: float = 0.0  # weight of the k3 KL to the reference policy (the base); 0 in the paper
    entropy_coef: float = 0.0  # weight of the entropy bonus

    @classmethod
    def from_args(cls, args):
        return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)})


# The statistics grpo_loss returns flow by name into the step's record and metrics.jsonl: each is a mean over
# the step's tokens (micro-batches weighted by their tokens, summed over ranks), except these, maximised from
# the value no token gives. A new statistic is one entry in grpo_loss's dict (and here, if it is a maximum).
MAX_STATS = {"ratio_max": 1.0, "is_w_max": 1.0}


def grpo_loss(logp, old_logp, adv, mask, options=LossOptions(), *, weight=None, max_new_tokens=None, ref_logp=None,
              entropy=None, denom=None):
    """The clipped surrogate (to minimise) and its statistics {name: float}.
    logp (N, T) current policy, with gradients; old_logp (N, T) pi_old's (PI_OLD); adv (N,); mask (N, T) 1 on
    completion tokens; weight (N, T) a per-token factor on the surrogate from the pi_old reading (None: 1);
    ref_logp (N, T) the reference policy (for options.beta > 0); entropy (N, T) with gradients (for
    options.entropy_coef > 0); max_new_tokens, denom: see aggregate.
    With old_logp = logp.detach() (--pi-old trainer at --mu 1) the ratio is 1 and never clipped, so the
    gradient is -mean_t A grad log pi_theta: REINFORCE with the group's mean reward as baseline."""
    eps_low, eps_high = options.eps_low, options.eps_high
    mask = mask.float()
    ratio = torch.exp(logp - old_logp)  # (N, T) pi_theta / pi_old per token
    a = adv.view(-1, 1)  # (N, 1)
    surr = torch.minimum(ratio * a, ratio.clamp(1 - eps_low, 1 + eps_high) * a)  # (N, T)
    per_tok = -surr if weight is None else -surr * weight  # (N, T)
    kl = None
    if ref_logp is not None:
        d = ref_logp - logp  # (N, T)
        kl = torch.exp(d) - d - 1  # (N, T) k3 estimate of KL(pi_theta || pi_ref), >= 0
        if options.beta:
            per_tok = per_tok + options.beta * kl
    if entropy is not None and options.entropy_coef:
        per_tok = per_tok - options.entropy_coef * entropy  # a bonus: higher entropy lowers the loss
    loss = aggregate(per_tok, mask, options.loss_agg, max_new_tokens, denom)
    with torch.no_grad():
        # a token is clipped when the clamp, not the raw ratio, sets the surrogate (zero gradient)
        clipped = ((ratio < 1 - eps_low) & (a < 0)) | ((ratio > 1 + eps_high) & (a > 0))  # (N, T)
        n_tok = mask.sum().clamp(min=1)
        d_old = old_logp - logp  # (N, T)
        stats = {"clip": float((clipped.float() * mask).sum() / n_tok),
                 "kl": float((kl * mask).sum() / n_tok) if kl is not None else float("nan"),
                 # how far pi_old (the noisy sampler under --pi-old sampler) is from pi_theta: their k3
                 "kl_old": float(((torch.exp(d_old) - d_old - 1) * mask).sum() / n_tok) if mask.numel() else float("nan"),
                 "ratio_max": float(ratio.masked_fill(mask == 0, 1.0).max()) if mask.numel() else MAX_STATS["ratio_max"]}
    return loss, stats

# -----------------------------------------------------------------------------
# pi_old, read by name (--pi-old). A reading is a function of a micro-batch's log-probs (N, T) each:
# current (the policy being trained, detached), sampler (recorded while sampling, under AQN), before (the policy
# before this batch's first optimizer step, or None), and the UpdateOptions -> (pi_old (N, T), a per-token
# weight on the surrogate (N, T), detached, or None). The sampler's reading (q) cancels AQN's noise in
# expectation, up to the clip: E_{y~q}[(pi_theta / q) A] = E_{y~pi_theta}[A]; the trainer's leaves it in.


@dataclasses.dataclass(frozen=True)
class PiOld:
    help: str  # for --pi-old's help
    read: Callable  # (current, sampler, before, options) -> (pi_old, weight or None)
    needs_before: bool = False  # computes `before` (one forward without gradients) when --mu > 1


def trainer_logp(current, before):
    """The clean policy's log-probs before this batch's update: pi_old as the official code reads it."""
    return current if before is None else before


def is_weights(current, sampler, before):
    """rho = pi_trainer / pi_sampler per token (N, T): how much likelier the clean policy finds each sampled token
    than the noisy sampler that drew it. The field's sampler/trainer correction (TIS) weights the loss by it."""
    return torch.exp(trainer_logp(current, before) - sampler)


PI_OLD = {
    "trainer": PiOld("the clean policy being trained, as the official code (TRL) has it: at --mu 1 the ratio is 1 "
                     "and AQN's noise reaches the gradient uncorrected",
                     lambda current, sampler, before, o: (trainer_logp(current, before), None), needs_before=True),
    "sampler": PiOld("the noisy sampler's own, as Algorithm 1 reads: up to the clip the ratio cancels AQN's noise in "
                     "expectation", lambda current, sampler, before, o: (sampler, None)),
    "tis": PiOld("the trainer's, as the official code, with each token's loss weighted by min(rho, --tis-cap), rho = "
                 "pi_trainer / pi_sampler (truncated importance sampling, as TRL, verl and ms-swift correct a sampler)",
                 lambda current, sampler, before, o: (trainer_logp(current, before),
                                                      is_weights(current, sampler, before).clamp(max=o.tis_cap)),
                 needs_before=True),
    "tis-mask": PiOld("the trainer's, with the tokens whose rho exceeds --tis-cap left out of the loss (masked IS)",
                      lambda current, sampler, before, o: (trainer_logp(current, before),
                                                           (is_weights(current, sampler, before) <= o.tis_cap).float()),
                      needs_before=True),
}


def mismatch_stats(current, sampler, before, mask, cap):
    """How far the sampler is from the clean trainer on this micro-batch's tokens, whatever the reading: their
    k3 KL (mean of rho - 1 - log rho), the weights rho's mean, square's mean (with the mean: the effective sample
    size, runs.step_record) and max, and the fraction of tokens beyond `cap`. Token means, like grpo_loss's."""
    with torch.no_grad():
        rho, m = is_weights(current, sampler, before), mask.float()  # (N, T) each
        n = m.sum()  # no token: NaN means, nothing measured
        return {"mismatch_kl": float(((rho - 1 - rho.log()) * m).sum() / n), "is_w_mean": float((rho * m).sum() / n),
                "is_w_sq_mean": float((rho ** 2 * m).sum() / n), "is_beyond_cap": float(((rho > cap).float() * m).sum() / n),
                "is_w_max": float(rho.masked_fill(m == 0, 1.0).max()) if m.numel() else MAX_STATS["is_w_max"]}


@dataclasses.dataclass(frozen=True)
class UpdateOptions:
    """The options of policy_update besides the loss's; fields and flags as in LossOptions (pi_old: --pi-old)."""
    pi_old: str = "trainer"  # a key of PI_OLD
    tis_cap: float = 2.0  # the IS weights' truncation (tis) or mask (tis-mask) threshold; ms-swift's default
    mu: int = 1  # optimizer steps on each batch
    micro_batch: int | str = "auto"  # rows per forward/backward ("auto": within a memory budget; 0: all kept rows)
    grad_clip: float = 1.0  # max gradient norm
    no_std_scale: bool = False  # advantages r - mean only (Dr. GRPO)

    @classmethod
    def from_args(cls, args):
        return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)})

# -----------------------------------------------------------------------------
# The update. Under torchrun each process holds whole groups, and every loss is divided by the *global* count of
# tokens (or sequences, or rows): the gradients summed over processes are exactly those of one process holding
# every row, and micro-batches (slices of rows, gradients accumulated) are exact for the same reason.


def micro_batch_loss(model, prompts, ids, mask, sampler_logp, before_logp, adv, denom, temperature, max_new_tokens,
                     options, update_options):
    """Loss and statistics of one micro-batch (its share of the step's loss: denom is global)."""
    logp, ent = rollout.sequence_logprobs(model, prompts, ids, mask, temperature=temperature,
                                          entropy=options.entropy_coef != 0)  # (mb, t) each; ent None unless used
    logp = logp.float()
    old_logp, weight = PI_OLD[update_options.pi_old].read(logp.detach(), sampler_logp, before_logp, update_options)
    ref_logp = None
    if options.beta > 0:
        with torch.no_grad(), lora.lora_disabled(model):  # the reference policy is the base
            ref_logp, _ = rollout.sequence_logprobs(model, prompts, ids, mask, temperature=temperature, entropy=False)
    loss, stats = grpo_loss(logp, old_logp, adv, mask, options, weight=weight, max_new_tokens=max_new_tokens,
                            ref_logp=ref_logp, entropy=None if ent is None else ent.float(), denom=denom)
    return loss, {**stats, **mismatch_stats(logp.detach(), sampler_logp, before_logp, mask, update_options.tis_cap)}


def policy_logprobs(model, prompts, ids, mask, slices, temperature):
    """The current policy's log-probs (n, T) of the given rows, without gradients, a slice of rows at a time."""
    out = torch.zeros(ids.shape, dtype=torch.float32, device=ids.device)  # (n, T)
    with torch.no_grad():
        for part in slices:
            t = int(mask[part].sum(1).max())
            logp, _ = rollout.sequence_logprobs(model, prompts[part], ids[part, :t], mask[part, :t],
                                                temperature=temperature, entropy=False)  # (mb, t)
            out[part, :t] = logp.float()
    return out


def policy_update(model, opt, params, prompt_ids, ids, mask, sampler_logp, rewards, *, group, max_new_tokens,
                  loss_options=LossOptions(), update_options=UpdateOptions(), temperature=1.0):
    """`update_options.mu` optimizer steps on this process's rows: prompt_ids (N lists), ids, mask,
    sampler_logp (N, T) the sampler's log-probs, rewards (N,) in whole groups; the loss is grpo_loss under
    `loss_options`, pi_old as PI_OLD[update_options.pi_old] reads it. Returns the global loss, gradient norm and
    grpo_loss's statistics by name, the kept/flat/all row counts, and "skipped" (why no step was taken)."""
    mu, reading = update_options.mu, PI_OLD[update_options.pi_old]
    adv = group_advantages(rewards, group, not update_options.no_std_scale).to(devices.model_device(model))  # (N,)
    # Groups of equal rewards have zero advantage: the update (the larger half of a step) skips them, and
    # rows without a token in the loss (--mask-truncated) too.
    has_signal = (rewards.view(-1, group).std(1) > 0).repeat_interleave(group)  # (N,)
    kept_rows = (has_signal & (mask.sum(1) > 0)).nonzero().squeeze(1).tolist()  # indices of the rows that train
    t_max = int(mask[kept_rows].sum(1).max()) if kept_rows else 0  # the kept rows may all be shorter than T
    kept_ids, kept_mask = ids[kept_rows, :t_max], mask[kept_rows, :t_max]  # (n, t_max) each
    kept_sampler_logp, kept_adv = sampler_logp[kept_rows, :t_max], adv[kept_rows]  # (n, t_max), (n,)
    kept_prompts = [prompt_ids[i] for i in kept_rows]
    total_tokens, total_sequences, total_kept_rows, total_rows, total_flat_rows = distributed.global_sum([
        float(kept_mask.sum()), float((kept_mask.sum(1) > 0).sum()), len(kept_rows), mask.shape[0],
        float((~has_signal).sum())])
    denom = {"token-mean": max(total_tokens, 1.0), "seq-mean-token-mean": max(total_sequences, 1.0),
             "seq-mean-token-sum-norm": total_rows * max_new_tokens}[loss_options.loss_agg]
    out = {"loss": 0.0, "grad_norm": 0.0, "skipped": "", "kept_rows": len(kept_rows), "kept_rows_all": total_kept_rows,
           "rows_all": total_rows, "flat_all": total_flat_rows}
    empty = torch.zeros(0, 0)  # (0, 0): no tokens, so each statistic takes its "nothing measured" value
    unmeasured = {**grpo_loss(empty, empty, torch.zeros(0), empty, loss_options, max_new_tokens=1)[1],
                  **mismatch_stats(empty, empty, None, empty, update_options.tis_cap)} \
        if total_kept_rows == 0 or not kept_rows else None  # no loss of this process names the statistics
    if total_kept_rows == 0:  # no process has a group with signal: nobody updates (a global decision)
        return {**out, **unmeasured}
    # rows per forward/backward: one slice's activations live at a time (--micro-batch; auto: memory.py)
    slice_rows = memory.micro_batch_rows(update_options.micro_batch, max(len(kept_rows), 1), model,
                                         max(map(len, kept_prompts), default=0) + t_max)
    slices = [slice(i, i + slice_rows) for i in range(0, len(kept_rows), slice_rows)]
    before = policy_logprobs(model, kept_prompts, kept_ids, kept_mask, slices, temperature) \
        if reading.needs_before and mu > 1 else None  # (n, t_max): the policy before the first step
    for _ in range(mu):
        opt.zero_grad(set_to_none=True)
        # every process sums the same statistics in the same order, one without rows too (zeros)
        loss_sum, sums, maxes = 0.0, {k: 0.0 for k in unmeasured or () if k not in MAX_STATS}, dict(MAX_STATS)
        for part in slices:
            t = int(kept_mask[part].sum(1).max())  # this slice's longest completion
            loss, stats = micro_batch_loss(model, kept_prompts[part], kept_ids[part, :t], kept_mask[part, :t],
                                           kept_sampler_logp[part, :t], None if before is None else before[part, :t],
                                           kept_adv[part], denom, temperature, max_new_tokens, loss_options,
                                           update_options)
            if torch.isfinite(loss):  # a non-finite loss skips the step below; its backward is wasted work
                loss.backward()  # the slices' gradients add up in .grad
            loss_sum += float(loss.detach())
            token_share = float(kept_mask[part].sum()) / max(total_tokens, 1.0)  # statistics: global token means
            for key, value in stats.items():
                if key in MAX_STATS:
                    maxes[key] = max(maxes.get(key, value), value)
                else:
                    sums[key] = sums.get(key, 0.0) + value * token_share
        loss_sum, *totals = distributed.global_sum([loss_sum, *sums.values()])
        out.update(zip(sums, totals))
        out.update(zip(maxes, distributed.global_sum(maxes.values(), op="max")))
        if not math.isfinite(loss_sum):  # the same verdict on every process
            out["skipped"] = f"loss is {loss_sum}"
            break
        distributed.sum_grads(params)
        grad_norm = float(torch.nn.utils.clip_grad_norm_(params, update_options.grad_clip))
        if not math.isfinite(grad_norm):
            out["skipped"] = f"gradient norm is {grad_norm}"
            break
        opt.step()
        out["loss"], out["grad_norm"] = loss_sum, grad_norm
    opt.zero_grad(set_to_none=True)
    return out

# -----------------------------------------------------------------------------
# Evaluation: held-out accuracy of the clean policy (no AQN), greedy and pass@k


@torch.inference_mode()
def evaluate(model, tok, task, problems, max_new_tokens, k=0, temperature=1.0, seed=0, chunk=512, compiled=False):
    """Greedy pass@1 and the greedy completions' mean task.reward (partial credit: a format bonus, a near
    answer); with k > 0 also pass@1 (mean over the k samples) and pass@k (any of k correct) at `temperature`.
    Returns counts and rates; under torchrun the counts (and reward sums) of every rank's problems, summed."""
    prompts, n, device = [tok.encode(task.prompt(p)) for p in problems], len(problems), devices.model_device(model)

    def solved(num_samples, temperature, gen):  # generate() over chunks of rows (memory): the texts, their hits
        texts, step = [], max(1, chunk // num_samples)
        for i in range(0, n, step):
            texts += rollout.generate(model, prompts[i:i + step], num_samples=num_samples, max_new_tokens=max_new_tokens,
                                      temperature=temperature, eos_token_ids=tok.eos_token_ids, generator=gen,
                                      tokenizer=tok, compiled=compiled).texts
        return texts, [[task.correct(p, texts[i * num_samples + j]) for j in range(num_samples)]
                       for i, p in enumerate(problems)]

    with merged_sampling_weights(model, merge_for_sampling(device)):
        texts, hits = solved(1, 0.0, None)
        greedy, reward = sum(h[0] for h in hits), sum(map(task.reward, problems, texts))
        hits = solved(k, temperature, torch.Generator(device=device).manual_seed(seed))[1] if k > 0 else []
    reward, *counts = distributed.global_sum([reward, n, greedy, sum(map(sum, hits)), sum(map(any, hits))])
    n, greedy, sampled, passed = map(int, counts)
    res = {"n": n, "greedy_correct": greedy, "greedy": greedy / max(n, 1), "greedy_reward": reward / max(n, 1)}
    if k > 0:
        res.update({"k": k, "sample_correct": sampled, "pass_k_correct": passed, "pass@1": sampled / max(k * n, 1),
                    f"pass@{k}": passed / max(n, 1)})
    return res

# -----------------------------------------------------------------------------
# The run: setup, then the loop. Each step: its LR and noise level, sampling under AQN, rewards, the update;
# then the log line, an evaluation and a checkpoint when due. Ctrl-C, SIGTERM or SIGHUP finish the step in
# flight, checkpoint and stop; --time-budget stops early enough for the final evaluation.


def train(args, task=None):
    """The GRPO run. `task`, any object with tasks.Task's interface, replaces the one --task names. Returns the
    summary (also written to <out>/summary.json)."""
    t_start = time.time()
    rank, world, device = distributed.init(str(devices.pick_device(args.device)), 60 * args.dist_timeout)  # torchrun
    # --resume: the checkpoint and its hyper-parameters; then every check before any work (Part 2)
    ckpt, state, task, dtype_why = check_run(args, task, world, device)
    finished = checkpoints.finished_run(args, ckpt, state)  # a resume of a finished run adds nothing
    if finished is not None:
        return finished
    model, tok, params, opt = build_policy(args, device)
    feedback = aqn.FeedbackSigma(args.target_entropy, args.sigma_start) if args.aqn and args.aqn_kind == "feedback" \
        else None
    start = checkpoints.restore(ckpt, state, functools.partial(lora.load_adapter, model), opt, feedback) if state else 0
    loss_options, update_options = LossOptions.from_args(args), UpdateOptions.from_args(args)
    sampling = sampling_options(args)

    with runs.RunLog(args, rank, start, t_start, model, world, dtype_why, parser_defaults()) as log, \
            runs.StopAtStepEnd(runs.StopAtStepEnd.REPEAT_S if world > 1 else 0.0) as stop:
        def held_out(step, k):  # greedy, and pass@k for k > 0; torchrun: each rank its share, the counts summed
            if not args.eval_size:
                return None
            devices.release_freed_memory()  # the steps' freed activations go back first: the peaks do not add up
            t0 = time.time()
            res = evaluate(model, tok, task, distributed.shard(task.held, rank, world), args.max_new_tokens, k,
                           args.temperature, tasks.EVAL_SEED, args.eval_chunk, args.compile)
            return log.eval(res, step, k, time.time() - t0)

        def save(step):  # rank 0 writes checkpoint-<step>: the adapter (PEFT's files) and trainer_state.pt
            modules = aqn.AQN_NORMS if args.train_norms else None  # trained gains: PEFT's modules_to_save
            write = functools.partial(lora.save_adapter, model, base_model_name_or_path=args.model,
                                      modules_to_save=modules)
            return checkpoints.save_checkpoint(args.out, step, opt, params, args, write, lora.DEFAULT_TARGETS,
                                               feedback, {"first_eval": first_eval}) or last_ckpt

        first_eval = (state or {}).get("first_eval") or held_out(start, args.eval_k)
        last_eval, last_ckpt, done, stopped, signum = first_eval, None, start, "steps", 0
        for step in range(start, args.steps):
            if log.out_of_time(first_eval):
                stopped = "time budget"
                break
            clock = runs.StepClock()
            lr = args.lr * lr_factor(step, args.warmup, args.steps, args.min_lr_ratio)
            for param_group in opt.param_groups:
                param_group["lr"] = lr
            sigma = step_sigma(args, step, feedback)
            # sample: this rank's whole groups of the step's problems, G completions each under AQN noise sigma
            problems = distributed.shard(task.problems(args.seed, step, args.batch), rank, world)
            prompts = [tok.encode(task.prompt(p)) for p in problems]
            samples, sigma_applied = sample_groups(model, tok, prompts, step, sigma, rank=rank, **sampling)
            clock.lap("sample")
            rewards, correct = score(task, problems, samples.texts, args.group)  # (N,), a count
            clock.lap("score")
            refilled = {}  # --dynamic-sampling: flat groups replaced; every statistic below is the trained batch's
            if args.dynamic_sampling:
                problems, samples, rewards, correct, refilled = refill_flat_groups(
                    args, task, model, tok, step, sigma, rank, world, problems, samples, rewards, correct)
            mask = samples.completion_mask.float().clone()  # (N, T) plain copies: inference-mode tensors cannot train
            truncated = truncated_rows(samples.completion_ids, mask, tok.eos_token_ids)  # (N,) cut off, no EOS
            loss_mask = mask * (~truncated).float()[:, None] if args.mask_truncated else mask  # (N, T)
            # advantages within each group -> the clipped loss on the clean policy -> AdamW (micro-batches, ranks)
            report = policy_update(model, opt, params, samples.prompt_ids, samples.completion_ids.clone(), loss_mask,
                                   samples.logprobs.float().clone(), rewards, group=args.group,
                                   max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                                   loss_options=loss_options, update_options=update_options)
            # kl_after: how far the update moved the policy from the sampler; "diverged" when something is not finite
            checked = check_step(step + 1, model, params, samples, loss_mask, report, args.temperature,
                                 args.kl_after_rows)  # Part 2
            rec = runs.step_record(step + 1, samples, mask, truncated, rewards, correct, report, clock,
                                   sigma=sigma, sigma_applied=sigma_applied, **refilled, **checked)
            if feedback is not None:
                feedback.update(rec["entropy"])  # the same global entropy on every rank: sigma stays in step
            log.step(rec, lr=lr)  # the log line; a step that diverged ends the run here (the last checkpoint stays)
            done = step + 1
            if args.eval_every and done % args.eval_every == 0 and done < args.steps:
                last_eval = held_out(done, 0) or last_eval
            signum = stop.requested()  # asked on every rank: they stop together
            halt = "stop-at" if args.stop_at and done >= args.stop_at else runs.halt_reason(signum)
            if rank == 0 and ((args.save_every and done % args.save_every == 0) or halt):
                last_ckpt = save(done)
            if halt:
                stopped = halt
                break
        if stopped in ("steps", "time budget"):  # the end: a last checkpoint, the full evaluation
            if rank == 0 and done > start and (last_ckpt is None or not last_ckpt.endswith(f"{done:06d}")):
                last_ckpt = save(done)
            if last_eval is None or last_eval["step"] != done or "k" not in last_eval:
                last_eval = held_out(done, args.eval_k) or last_eval
        summary = log.summary(done, stopped, first_eval, last_eval, last_ckpt)
        if stopped not in ("steps", "time budget", "stop-at"):  # a signal: the log's line says how to resume
            raise cli.Interrupted(signum=signum)
        return summary


# ======== Part 2: plumbing (the checks before any work, the command line) ========


def check_run(args, task, world, device):
    """Before the model loads -> (--resume's checkpoint folder and trainer state or None, None; the task; why
    --dtype auto chose its dtype). --resume takes the run's hyper-parameters from its checkpoint; then every
    check: the flags, the run folder, the task and its data, every prompt within the context, --batch within
    the task, the memory."""
    for flag, fix in (("resume", "the run (or checkpoint) folder to continue, or drop --resume for a new run"),
                      ("out", "a folder, or drop --out for runs/<timestamp>")):
        value = getattr(args, flag)
        if value is not None and not value.strip():  # '' (an unset shell variable) would read as "not given"
            raise ValueError(f"--{flag} {value!r} names no folder: give {fix}")
    ckpt, state = checkpoints.resume_args(args, parser_defaults())
    if ckpt:
        check_resumed_args(args)
        checkpoints.check_saved_args(ckpt, state)
        if getattr(args, "world_size", world) != world:  # args.json records it (a run before that: unknown)
            print(f"note | resuming a run of {args.world_size} rank(s) on {world}: each rank's share of the groups "
                  f"and its sampling stream change, so the run goes on validly but not as the uninterrupted one")
    args.world_size = world
    args.out = args.out or os.path.join("runs", datetime.datetime.now().strftime("%Y%m%d-%H%M%S"))
    check_args(args, world, ckpt)
    if args.gpu_path:
        use_gpu_path(device)
    task = task or tasks.make_task(args, parser_defaults())  # bad data fails here, before the model loads
    return ckpt, state, task, check_sizes(args, task, world, device)


def policy_dtype(args, device, cfg=None):
    """--dtype as (torch dtype, why). auto: bfloat16 on CUDA and on --gpu-path's CUDA code path; on a CPU
    bfloat16 where it is native and the model wide enough to gain, else float32 (devices.pick_dtype)."""
    if args.dtype == "auto" and args.gpu_path:
        return torch.bfloat16, "auto: --gpu-path"
    if args.dtype == "auto" and cfg is None:
        cfg = rollout.ModelConfig.from_dict(hf_files.find_weight_files(args.model)[0])
    return devices.pick_dtype(args.dtype, device, cfg.hidden_size if cfg else None)


def check_sizes(args, task, world, device):
    """Before the model loads: every prompt within the context (tasks.check_prompts_fit), what memory.run_memory
    estimates within the memory free on the device, and --batch within what the task gives a step."""
    raw, weight_map, _ = hf_files.find_weight_files(args.model)
    cfg, tok = rollout.ModelConfig.from_dict(raw), hf_files.load_tokenizer(args.model, raw)
    hf_files.check_config_fits_weights(args.model, raw, weight_map)  # before an estimate made from a wrong config
    P = tasks.check_prompts_fit(task, tok, cfg.max_position_embeddings, args.max_new_tokens,
                                  task.problems(args.seed, 0, min(args.batch, 64)))  # the longest prompt, in tokens
    dtype, why = policy_dtype(args, device, cfg)
    args.dtype = str(dtype).replace("torch.", "")  # the choice goes into args.json: a resume computes alike
    adapters, phases = memory.run_memory(args, cfg, P, world, dtype.itemsize, device)
    largest = max(phases, key=phases.get)
    what = largest if phases[largest] > adapters else f"--lora-r {args.lora_r}'s adapters"
    devices.check_memory_fits(adapters + phases[largest], device, f"this run (mostly {what})")
    wanted = args.batch * (1 + args.dynamic_sampling)  # --dynamic-sampling's rounds draw on from the batch
    try:  # drawn after the memory check bounded --batch
        given = len(task.problems(args.seed, 0, wanted))
    except tasks.TooFewProblems as e:
        given = e.given
    if given < args.batch:
        raise ValueError(f"--batch {args.batch} is more than --task {args.task} gives a step ({given} problems): "
                         f"lower --batch to {given} or less")
    if given < wanted:
        raise ValueError(f"--dynamic-sampling {args.dynamic_sampling} draws up to {wanted} problems a step (--batch "
                         f"{args.batch} a round), more than --task {args.task} gives ({given}): lower "
                         f"--dynamic-sampling to {given // args.batch - 1} or less")
    return why


@torch.no_grad()
def check_step(step, model, params, samples, mask, report, temperature, rows=16):
    """After a step's update -> {"kl_after": how far the update moved the policy from the one that sampled,
    the k3 estimate of KL(sampler || updated policy) per token over the first `rows` rows of each rank}, and
    "diverged": why, when the sampler's log-probs, the loss, the gradient or an adapter weight is not finite.
    runs.RunLog.step ends the run on "diverged" and names a kl_after beyond runs.DIVERGED_KL."""
    m = mask[:rows].to(samples.logprobs.device)  # (r, T)
    bad_samples = not bool(torch.isfinite(samples.logprobs[mask.to(samples.logprobs.device) > 0]).all())
    kl_sum = 0.0
    if m.sum() > 0 and not bad_samples and not report["skipped"]:
        logp, _ = rollout.sequence_logprobs(model, samples.prompt_ids[:rows], samples.completion_ids[:rows], m,
                                            temperature=temperature, entropy=False)  # (r, T)
        d = logp.float() - samples.logprobs[:rows].float()  # (r, T) log of pi_updated / pi_sampler
        kl_sum = float(((torch.exp(d) - 1 - d) * m).sum())
    kl_sum, tokens, bad_samples = distributed.global_sum([kl_sum, float(m.sum()), bad_samples])
    why = ("the sampler's log-probs are not finite (its logits overflowed: is --sigma-start far too large?)"
           if bad_samples else f"the {report['skipped']}" if report["skipped"] else
           "an adapter weight is not finite" if not all(bool(torch.isfinite(p).all()) for p in params) else None)
    kl_after = kl_sum / tokens if tokens and not why else float("nan")
    return {"kl_after": kl_after, **({"diverged": why} if why else {})}


MAX_EVAL_SIZE = 100_000  # every evaluation samples each held-out problem (greedy, then --eval-k times)
# A flag the chosen options do not read is refused: args.json would record it as if it had counted. Such a
# flag is declared with `add_flag(..., read_when=(whether this run reads it, the options that make it read))`.


def add_flag(group, *names, read_when=None, **kw):
    """group.add_argument(*names, **kw), with the flag's `read_when` kept on its action: check_args refuses the
    flag away from its default in a run that does not read it, and check_resumed_args checks it on --resume
    as every flag, so a new flag needs no second edit."""
    action = group.add_argument(*names, **kw)
    action.read_when = read_when
    return action


def read_when_flags():
    """{flag's action: (whether this run reads it, the options that make it read)}, every flag declared with one."""
    return {a: a.read_when for a in build_parser()._actions if getattr(a, "read_when", None)}


def check_args(args, world, ckpt=None):
    """What argparse's ranges cannot see: combinations of flags, the model folder and the run folder."""
    if args.batch < 1 or args.group < 2:
        raise ValueError(f"need --batch >= 1 and --group >= 2 (got {args.batch}, {args.group}): GRPO compares "
                         f"samples within a group")
    if args.steps < 1 or args.mu < 1 or (args.micro_batch != "auto" and args.micro_batch < 0):
        raise ValueError(f"need --steps >= 1, --mu >= 1 and --micro-batch >= 0 (0: all rows at once), got "
                         f"{args.steps}, {args.mu}, {args.micro_batch}")
    if args.quant_method != "rtn" and args.quant != "nvfp4":
        raise ValueError(f"--quant-method {args.quant_method} is a rounding of NVFP4 weights: it needs --quant nvfp4 "
                         f"(got --quant {args.quant})")
    defaults = parser_defaults()
    for action, (reads, when) in read_when_flags().items():
        if getattr(args, action.dest) != defaults[action.dest] and not reads(args):
            flag = action.option_strings[0]
            raise ValueError(f"{flag} {getattr(args, action.dest)} is read only with {when}, which this run does not "
                             f"have: drop {flag}")
    if args.aqn and args.aqn_kind != "feedback":  # the schedule's stages and range, before any work
        aqn.check_schedule(args.steps, args.num_stages, args.sigma_start, args.sigma_end, args.aqn_kind)
    if args.warmup >= args.steps:
        print(f"note | --warmup {args.warmup} is not below --steps {args.steps}: the LR never leaves its warmup and "
              f"peaks at {args.steps / args.warmup:.0%} of --lr {args.lr:g}")
    if args.temperature < engine.MIN_TEMPERATURE:
        raise ValueError(f"--temperature {args.temperature:g} is too small to sample with: need >= "
                         f"{engine.MIN_TEMPERATURE:g}")
    if args.train_norms and args.beta > 0:
        raise ValueError("--train-norms with --beta > 0 is not supported: the KL reference (the base under "
                         "lora_disabled) would keep the trained gains; drop one of the two")
    if args.batch < world:
        raise ValueError(f"--batch {args.batch} is smaller than the number of ranks ({world}): every rank "
                         f"needs at least one prompt group; raise --batch or launch fewer processes")
    try:  # fail before the data and the model load
        hf_files.find_weight_files(args.model)
    except FileNotFoundError as e:
        raise FileNotFoundError(f"--model {args.model!r} is not a model folder ({e})") from None
    runs.check_run_folder(args, ckpt)


def check_resumed_args(args):
    """--resume: every argument the checkpoint gave, within its flag's own range and choices (an edited or
    damaged trainer_state.pt could hold --grad-clip -1, which would flip the clipped gradient's sign)."""
    for action in build_parser()._actions:  # every flag: a new one is checked here as it is declared
        value = getattr(args, action.dest, None)
        unset = value is None and action.default is None  # --data, --out...: not given
        if not action.option_strings or action.default == argparse.SUPPRESS or unset:  # SUPPRESS: --help
            continue
        switch = isinstance(action.default, bool)  # --aqn, --quiet...: True or False, and only they are
        try:
            if switch or isinstance(value, bool):
                if not (switch and isinstance(value, bool)):
                    raise ValueError("not True or False" if switch else "a switch's value")
            elif action.choices is not None and value not in action.choices:
                raise ValueError(f"not one of {', '.join(map(str, action.choices))}")
            elif action.type is not None and action.type(str(value)) != value:  # '0.5' (text) for 0.5
                raise ValueError(f"a {type(value).__name__}")
            elif action.type is None and not isinstance(value, str):  # a folder, a device: text
                raise ValueError(f"a {type(value).__name__}, not text")
        except (argparse.ArgumentTypeError, ValueError) as e:
            raise ValueError(f"--resume: the checkpoint's {action.option_strings[0]} {value!r} is not a value of that "
                             f"flag ({e}): its trainer_state.pt is damaged or edited; resume from another "
                             f"checkpoint") from None


def use_gpu_path(device):
    """--gpu-path: run CUDA's code path (NVFP4Linear through the Triton kernel) on any device."""
    if torch.device(device).type == "cpu":
        if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError("--gpu-path on the CPU runs the Triton kernel under the interpreter, which must be "
                             "on before triton is imported: set TRITON_INTERPRET=1 in the environment")
        os.environ["TRITON_INTERPRET"] = "1"
    if quantize.nvfp4_kernel() is None:
        raise ValueError("--gpu-path needs triton (pip install triton; Linux only)")
    quantize.NVFP4Linear.kernel_on_cpu = True


def sampling_options(args):
    """sample_groups' keyword arguments from the command line (but rank and draw): train's, and a bench's."""
    return {"group": args.group, "max_new_tokens": args.max_new_tokens, "temperature": args.temperature,
            "seed": args.seed, "compiled": args.compile, "noise": args.aqn_scale, "site": args.aqn_site}


def update_options(args):
    """policy_update's keyword arguments from the command line (its options as LossOptions and UpdateOptions)."""
    return {"group": args.group, "max_new_tokens": args.max_new_tokens, "temperature": args.temperature,
            "loss_options": LossOptions.from_args(args), "update_options": UpdateOptions.from_args(args)}


ROOT = os.path.dirname(os.path.abspath(__file__))
TINY_MODEL = os.path.join(ROOT, "assets", "tiny-qwen")


@torch.no_grad()
def show_step(args, shown=4):
    """--show-step: one sampled group of the fresh policy (adapters B = 0) worked by hand, at the first step
    with AQN noise: rewards, advantages, and for `shown` tokens of its best and worst row the log-probs,
    ratio, surrogate and share of the loss under pi_old's two readings. Every number is 05's own (sample_groups,
    score, group_advantages, PI_OLD, grpo_loss, 03's sequence_logprobs); printed, and returned as a dict
    (tests/test_show_step.py recomputes it)."""
    if args.loss_agg != "token-mean" or args.beta or args.entropy_coef:
        raise ValueError("--show-step works the default loss (token-mean, no KL, no entropy bonus): drop "
                         "--loss-agg, --beta and --entropy-coef")
    task, device = tasks.make_task(args, parser_defaults()), devices.pick_device(args.device)
    model, tok, _, _ = build_policy(args, device)
    feedback = aqn.FeedbackSigma(args.target_entropy, args.sigma_start) if args.aqn and args.aqn_kind == "feedback" \
        else None
    step = next((s for s in range(args.steps) if step_sigma(args, s, feedback) > 0), 0)  # the first noisy one
    sigma, G = step_sigma(args, step, feedback), args.group
    # the step's batch, sampled as train samples it; the first group whose rewards differ (the others carry no signal)
    problems = task.problems(args.seed, step, args.batch)
    samples, _ = sample_groups(model, tok, [tok.encode(task.prompt(p)) for p in problems], step, sigma,
                               **sampling_options(args))
    rewards, _ = score(task, problems, samples.texts, G)  # (B*G,)
    flat = rewards.view(-1, G).std(1) == 0  # (B,)
    if flat.all():
        raise ValueError(f"--show-step: every group of step {step}'s {len(problems)} problems has equal rewards (no "
                         f"signal to show): raise --batch or try another --seed")
    g = int((~flat).nonzero()[0])
    rows = slice(g * G, (g + 1) * G)
    r, adv = rewards[rows], group_advantages(rewards, G, not args.no_std_scale)[rows]  # (G,) each
    ids, mask = samples.completion_ids[rows].clone(), samples.completion_mask[rows].float().clone()  # (G, T) each
    logp, _ = rollout.sequence_logprobs(model, samples.prompt_ids[rows], ids, mask, temperature=args.temperature,
                                        entropy=False)  # (G, T) the clean policy, as the update computes it
    logp, sampler = logp.float(), samples.logprobs[rows].float().clone()  # (G, T): sampler, under AQN
    loss_options, n = LossOptions.from_args(args), float(mask.sum())
    # pi_old as each reading gives it at --mu 1 (no `before`), and each loss: the token mean of -surrogate
    old = {name: PI_OLD[name].read(logp, sampler, None, UpdateOptions.from_args(args))[0]
           for name in ("trainer", "sampler")}
    loss = {name: float(grpo_loss(logp, o, adv, mask, loss_options)[0]) for name, o in old.items()}
    picked = []  # (row, t): in the best and the worst row, the tokens where sampler and policy differ most
    for i in sorted({int(adv.argmax()), int(adv.argmin())}):
        gap = ((logp[i] - sampler[i]).abs() * mask[i]).masked_fill(mask[i] == 0, -1)  # (T,)
        picked += [(i, t) for t in sorted(gap.topk(min(shown, int(mask[i].sum()))).indices.tolist())]
    tokens = []
    for i, t in picked:  # grpo_loss on this one token alone: its -surrogate, and whether the clip set it
        one = torch.zeros_like(mask)
        one[i, t] = 1
        (l_tr, _), (l_s, s_stats) = (grpo_loss(logp, old[k], adv, one, loss_options) for k in ("trainer", "sampler"))
        tokens.append({"row": i, "t": t, "token": tok.decode([int(ids[i, t])], skip_special_tokens=False),
                       "adv": float(adv[i]), "logp": float(logp[i, t]), "sampler": float(sampler[i, t]),
                       "ratio": float(torch.exp(logp[i, t] - sampler[i, t])), "clipped": s_stats["clip"] > 0,
                       "surrogate": -float(l_s), "share_trainer": float(l_tr) / n, "share_sampler": float(l_s) / n})
    out = {"step": step, "sigma": sigma, "group": g, "problem": task.prompt(problems[g]), "rewards": r.tolist(),
           "mean": float(r.mean()), "std": float(r.std()), "adv": adv.tolist(), "n_tokens": int(n), "loss": loss,
           "tokens": tokens, "logp": logp, "sampler_logp": sampler, "mask": mask}
    eps_low, eps_high = loss_options.eps_low, loss_options.eps_high
    noise = f"the first with AQN noise: sigma {sigma:.2e}" if sigma else "no AQN noise: q and pi_theta differ by rounding"
    print(f"GRPO, one group by hand: step {step} of {args.steps} ({noise}), the fresh policy (adapters B = 0) on "
          f"{os.path.basename(os.path.normpath(args.model))}, --quant {args.quant}")
    print(f"problem {g} of the step's {len(problems)} (the first whose {G} rewards differ), the prompt the model "
          f"sees:\n   {out['problem']!r}")
    print("1. its G completions and rewards r (05 score: 1 if correct, +0.1 if format_ok):")
    for i, (text, v) in enumerate(zip(samples.texts[rows], out["rewards"])):
        print(f"   row {i} | r {v:g} | {text!r}")
    print(f"2. mean {out['mean']:.4f}, std {out['std']:.4f} (unbiased); advantages A = (r - mean) / (std + 1e-4) "
          f"(05 group_advantages):\n   " + " ".join(f"{a:+.4f}" for a in out["adv"]))
    print("3. per token: log pi_theta, the clean policy the update differentiates (03 sequence_logprobs), and\n"
          "   log q, the sampler's, recorded under AQN. pi_old: --pi-old trainer (the default, the official code)\n"
          "   reads log pi_theta detached: ratio 1, surrogate A, share -A / N. --pi-old sampler reads log q:\n"
          f"   ratio pi_theta / q, clipped to [1 - eps_low, 1 + eps_high] = [{1 - eps_low:g}, {1 + eps_high:g}] "
          "on the side A pushes,\n   surrogate min(ratio A, clip(ratio) A), share -surrogate / N. "
          f"N = {int(n)} tokens in this group; {shown} tokens of\n   the best and the worst row, where q and "
          "pi_theta differ most:")
    print(f"{'row':>4} | {'t':>3} | {'token':<10} | {'A':>7} | {'log pi_theta':>12} | {'log q':>8} | {'ratio':>7} | "
          f"{'clip':>4} | {'surrogate':>9} | {'share trainer':>13} | {'share sampler':>13}")
    for k in tokens:
        print(f"{k['row']:>4} | {k['t']:>3} | {repr(k['token'])[:10]:<10} | {k['adv']:>+7.4f} | {k['logp']:>12.5f} | "
              f"{k['sampler']:>8.5f} | {k['ratio']:>7.5f} | {'yes' if k['clipped'] else 'no':>4} | "
              f"{k['surrogate']:>+9.5f} | {k['share_trainer']:>+13.3e} | {k['share_sampler']:>+13.3e}")
    print(f"4. loss = the sum of every token's share (05 grpo_loss, token-mean over this group alone; a run divides "
          f"by the step's\n   kept tokens): --pi-old trainer {round(loss['trainer'], 6) + 0.0:+.6f}, --pi-old sampler "
          f"{round(loss['sampler'], 6) + 0.0:+.6f}\n   (the trainer's is 0 when the rows are equally long, as the A sum to 0; "
          "its gradient is not)")
    print("   At --mu 1 the trainer's ratio is 1: nothing is clipped, and the gradient is REINFORCE's,\n"
          "   -mean_t A grad log pi_theta, with the group's mean reward as baseline. The sampler's ratio cancels\n"
          "   the noise in expectation, E_{y~q}[(pi_theta/q) A] = E_{y~pi_theta}[A], at a cost in variance.")
    return out


def build_parser():
    N = cli.number  # each number's allowed range: what makes no sense is refused before any work
    p = cli.ArgumentParser(description="GRPO with LoRA on a quantized base and AQN (QeRL). The first group "
                           "defines QeRL; the rest have defaults that work.")
    # when a flag is read (add_flag's read_when): a run without it refuses the flag
    with_aqn = (lambda args: args.aqn, "--aqn")
    noisy = (lambda args: args.aqn and args.aqn_kind != "none", "--aqn with an --aqn-kind other than none")
    decaying = (lambda args: args.aqn and args.aqn_kind in aqn.DECAYING_KINDS, "--aqn with a decaying --aqn-kind")
    q = p.add_argument_group("QeRL: the model, its 4-bit base, LoRA, AQN, pi_old and the GRPO batch")
    q.add_argument("--model", default=TINY_MODEL, help="Hugging Face model folder (default: the bundled tiny model)")
    q.add_argument("--quant", choices=quantize.QUANT_CHOICES, default="nvfp4", help="the frozen base's format")
    q.add_argument("--lora-r", type=N(int, 1), default=16)
    q.add_argument("--lora-alpha", type=N(int, 1), default=32)
    q.add_argument("--aqn", action=argparse.BooleanOptionalAction, default=True, help="adaptive quantization noise")
    add_flag(q, "--sigma-start", type=N(above=0), default=1e-2, help="AQN's noise in its first noisy stage",
             read_when=noisy)
    add_flag(q, "--sigma-end", type=N(above=0), default=5e-4, help="AQN's noise in its last stage", read_when=decaying)
    add_flag(q, "--num-stages", type=N(int, 1), default=10, help="AQN's stages (the first adds no noise)",
             read_when=decaying)
    q.add_argument("--pi-old", choices=list(PI_OLD), default=UpdateOptions.pi_old, help="pi_old in the ratio: "
                   + "; ".join(f"{k}: {v.help}" for k, v in PI_OLD.items()))
    q.add_argument("--steps", type=N(int, 1), default=750, help="planned steps (sets the LR and AQN schedules)")
    q.add_argument("--batch", type=N(int, 1), default=16, help="prompts per step")
    q.add_argument("--group", type=N(int, 2), default=8, help="samples per prompt (G)")
    q.add_argument("--lr", type=N(above=0), default=1e-3)
    t = p.add_argument_group("task and data")
    t.add_argument("--task", choices=list(tasks.TASKS), default="arithmetic",
                   help="; ".join(f"{name}: {cls.help}" for name, cls in tasks.TASKS.items()))
    t.add_argument("--data", default=None, help="gsm8k: the GSM8K-style JSONL file to train on")
    t.add_argument("--eval-data", default=None, help="gsm8k: held-out JSONL (default: a slice of --data is held out)")
    t.add_argument("--digits", type=N(int, 1, 100), default=3, help="arithmetic: max digits per operand")
    t.add_argument("--nops", type=N(int, 1, 100), default=2, help="arithmetic: number of operations")
    t.add_argument("--system", choices=("auto", "paper", "none"), default="auto",
                   help="system prompt: the paper's instruction, none, or auto (the instruction unless "
                   "config.json says \"qerl_prompt\": \"bare\", as the bundled model's does)")
    a = p.add_argument_group("AQN, more")
    add_flag(a, "--aqn-kind", default="exp", choices=aqn.SIGMA_KINDS, help="the schedule (exp: the official code's "
             "geometric decay; linear, cosine, log: our forms of the paper's ablation)", read_when=with_aqn)
    add_flag(a, "--aqn-scale", default="absolute", choices=list(aqn.NOISES), help="how a noise draw is sized "
             "(04 NOISES): absolute, Z ~ N(0, sigma^2) as the paper; relative, Z_i ~ N(0, (sigma w_i)^2)",
             read_when=with_aqn)
    add_flag(a, "--aqn-site", default="norms", choices=list(aqn.SITES), help="where the noise lands (04 SITES): "
             + "; ".join(f"{k}: {v.help}" for k, v in aqn.SITES.items()), read_when=with_aqn)
    add_flag(a, "--target-entropy", type=N(above=0), default=0.15, help="aqn-kind feedback: entropy to hold",
             read_when=(lambda args: args.aqn and args.aqn_kind == "feedback", "--aqn-kind feedback"))
    a.add_argument("--train-norms", action="store_true", help="train the RMSNorm gains of every decoder layer "
                   "(input/post-attention, fp32) with the adapters; saved as PEFT modules_to_save")
    g = p.add_argument_group("GRPO loss and update")
    g.add_argument("--max-new-tokens", type=N(int, 1), default=42)
    g.add_argument("--temperature", type=N(above=0), default=1.0,
                   help="sampling temperature (> 0: at 0 a prompt's G samples are all the same: no signal)")
    g.add_argument("--eps-low", type=N(float, 0, below=1), default=LossOptions.eps_low)
    g.add_argument("--eps-high", type=N(float, 0), default=LossOptions.eps_high)
    g.add_argument("--loss-agg", default=LossOptions.loss_agg, choices=LOSS_AGGS)
    g.add_argument("--no-std-scale", action="store_true", help="advantage r - mean only (Dr. GRPO)")
    # PPO-style reuse takes a few passes (TRL's num_iterations, PPO's 3-10 epochs); past 16 the batch is far
    # off-policy (the clip zeroes most tokens) and one step's updates alone can outlast --time-budget
    g.add_argument("--mu", type=N(int, 1, 16), default=UpdateOptions.mu, help="policy updates per batch (<= 16)")
    g.add_argument("--tis-cap", type=N(above=1), default=UpdateOptions.tis_cap, help="--pi-old tis: the IS weight "
                   "pi_trainer / pi_sampler is truncated here (tis-mask: tokens beyond it leave the loss); every reading "
                   "logs the fraction beyond it (is_beyond_cap)")
    g.add_argument("--beta", type=N(float, 0), default=LossOptions.beta, help="k3 KL to the base (reference) policy")
    g.add_argument("--entropy-coef", type=N(float, 0), default=LossOptions.entropy_coef, help="entropy bonus coefficient")
    g.add_argument("--dynamic-sampling", type=N(int, 0, 16), default=0, help="DAPO's dynamic sampling: up to N more "
                   "rounds of problems a step replace the groups whose rewards all tie (0: off; the step's statistics "
                   "describe the trained batch, its record says ds_rounds and ds_flat_before)")
    g.add_argument("--mask-truncated", action="store_true", help="completions cut off at --max-new-tokens "
                   "(no EOS) leave the loss; their rewards still count in their group's advantages")
    g.add_argument("--warmup", type=N(int, 0), default=10, help="warmup steps")
    g.add_argument("--min-lr-ratio", type=N(float, 0, 1), default=0.1, help="cosine decays to this fraction of --lr")
    g.add_argument("--grad-clip", type=N(above=0), default=UpdateOptions.grad_clip, help="max gradient norm")
    g.add_argument("--seed", type=N(int, 0, cli.MAX_SEED), default=0)
    m = p.add_argument_group("speed and memory (how to compute, not what)")
    m.add_argument("--device", default=None, help="cpu / cuda (default: autodetect)")
    m.add_argument("--dtype", choices=devices.DTYPES, default="auto",
                   help="activation dtype; auto: bfloat16 on CUDA, and on a CPU with native bf16 (AMX, AVX512-BF16) "
                   f"for a model of hidden size {devices.AUTO_BF16_MIN_HIDDEN} or more, else float32")
    m.add_argument("--quant-method", choices=quantize.NVFP4_METHODS, default="rtn",
                   help="NVFP4 rounding: rtn (compressed-tensors) or 4over6 (per block, max -> 6 or 4)")
    m.add_argument("--compile", action="store_true", help="sample with stage 03's torch.compile'd decode step "
                   "(compiles once per batch/length bucket: tens of seconds on a CPU; pays off on long runs and GPUs)")
    m.add_argument("--micro-batch", type=lambda v: v if v == "auto" else N(int, 0)(v), default=UpdateOptions.micro_batch,
                   help="rows per forward/backward of the update, gradients accumulated before the one optimizer "
                   "step (0: all rows at once; auto: as many as keep the update's activations within "
                   f"{memory.UPDATE_MEMORY_CPU // 2 ** 20} MiB on a CPU, half the free memory on a GPU)")
    m.add_argument("--grad-checkpoint", action="store_true", help="activation checkpointing per decoder layer "
                   "in the update (less memory, one more forward)")
    m.add_argument("--dist-timeout", type=N(float, distributed.MIN_TIMEOUT_MIN, distributed.MAX_TIMEOUT_MIN),
                   default=10.0, help="torchrun: minutes a rank waits for the others at a collective before the job "
                   "ends with a line naming the missing rank")
    m.add_argument("--gpu-path", action="store_true", help="on the CPU, run what CUDA runs: NVFP4Linear through "
                   "the Triton kernel (interpreted), no merged sampling weights, bfloat16 by default")
    o = p.add_argument_group("evaluation and the run folder")
    o.add_argument("--eval-size", type=N(int, 0, MAX_EVAL_SIZE), default=500,
                   help=f"held-out problems (0: no evaluation; at most {MAX_EVAL_SIZE:,})")
    o.add_argument("--eval-every", type=N(int, 0), default=100,
                   help="greedy evaluation every N steps (0: at the start and end only)")
    o.add_argument("--eval-k", type=N(int, 0), default=8, help="pass@k at --temperature at the start and end (0: off)")
    o.add_argument("--eval-chunk", type=N(int, 1), default=1024, help="rows per generate() call in evaluation")
    o.add_argument("--out", default=None, help="run folder (default runs/<timestamp>)")
    o.add_argument("--resume", default=None, help="checkpoint (or run) folder to continue exactly")
    o.add_argument("--save-every", type=N(int, 0), default=100, help="checkpoint every N steps (0: at the end only)")
    o.add_argument("--time-budget", type=N(float, 0), default=540, help="stop after this many seconds incl. the "
                   "final evaluation (0: no limit)")
    o.add_argument("--stop-at", type=N(int, 0), default=0, help="stop after this step with a checkpoint, as if "
                   "interrupted (for testing --resume)")
    o.add_argument("--quiet", action="store_true", help="no per-step lines")
    o.add_argument("--kl-after-rows", type=N(int, 0), default=0, help="after each update, kl_after (KL from the "
                   "sampler to the updated policy; beyond runs.DIVERGED_KL the log warns) over this many rows: one "
                   "more forward, 0.9 s of a 12 s SmolLM2 step at 16 (0: off, kl_after null)")
    o.add_argument("--show-step", action="store_true", help="train nothing: work one sampled group through "
                   "the rewards, advantages, ratio and loss by hand, and print it (a few seconds)")
    return p


@functools.cache
def _defaults():
    return tuple(vars(build_parser().parse_args([])).items())


def parser_defaults():
    """{flag dest: its default}: what --resume and the task and flag checks compare a command line against."""
    return dict(_defaults())


def main(argv=None):
    args = build_parser().parse_args(argv)
    if args.show_step:
        show_step(args)
        return
    rank = distributed.launch()[0]  # torchrun's: rank 0 alone prints; errors still reach stderr
    with open(os.devnull, "w") as devnull, contextlib.redirect_stdout(devnull if rank > 0 else sys.stdout):
        train(args)


if __name__ == "__main__":
    code = cli.run_cli(main)
    if distributed.is_initialized():
        distributed.leave(code)
    sys.exit(code)
