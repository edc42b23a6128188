"""Stage 05: GRPO with LoRA on a 4-bit base, with Adaptive Quantization Noise (the QeRL loop).

QeRL trains reasoning with RL while the base model stays frozen in NVFP4 and only LoRA adapters learn:
the 4-bit base makes sampling (most of a step) cheap, and its rounding noise, plus AQN's scheduled noise
on the RMSNorm gains, raises sampling entropy, which helps exploration. One step: B prompts x G samples
drawn under AQN -> rewards -> group-normalised advantages -> clipped surrogate on the clean policy, with
pi_old the clean policy itself as the official code has it (--pi-old trainer; --pi-old sampler: the noisy
sampler's log-probs) -> AdamW on the adapters.

Run it (2 CPU cores, ~6.5 min, at most 9 by its --time-budget 540: the bundled tiny model learns
synthetic arithmetic; the numbers are in README's "Results" section and docs/experiments.md):
    python 05_grpo.py
    python 05_grpo.py --quant none --no-aqn --steps 200 --out runs/lora-only
    python 05_grpo.py --resume runs/qerl/checkpoint-000200
    python 05_grpo.py --task gsm8k --data train.jsonl --eval-data test.jsonl --model Qwen2.5-7B-Instruct
    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node 2 05_grpo.py --out runs/dp2   # data parallel
Qwen2.5-7B + GSM8K on one GPU or eight: docs/scaling.md, "One GPU at 7B".

To change the task, add a class to TASKS (or pass any task object to `train(args, task=...)`); to change
the loss or the update, add a field to LossOptions or UpdateOptions and its flag to build_parser.
"""
import argparse
import contextlib
import dataclasses
import datetime
import errno
import hashlib
import importlib
import json
import math
import os
import pickle
import random
import re
import shlex
import signal
import sys
import threading
import time
import warnings
from pathlib import Path
from fractions import Fraction

import torch
import torch.distributed as dist

common = importlib.import_module("common")  # the project's plumbing (imports no stage)
quantize = importlib.import_module("01_quantize")
lora = importlib.import_module("02_lora")
rollout = importlib.import_module("03_rollout")
aqn = importlib.import_module("04_aqn")

# -----------------------------------------------------------------------------
# Sampling under AQN. A step's problems come from the task (Part 2's TASKS), an object with problems(seed,
# step, n), held, prompt(p), reward(p, text), correct(p, text). G completions per prompt come from the policy
# with noise on its RMSNorm gains (stage 04); their log-probs are pi_old in the loss under --pi-old sampler.
# On a CPU it samples from merged weights (Part 2).


def sample_groups(model, tok, prompts, step, sigma, *, rank=0, group=8, max_new_tokens=42, temperature=1.0,
                  seed=0, compiled=False):
    """`group` completions of each prompt (token id lists), drawn under AQN noise `sigma` -> (stage 03's
    Rollout, rows prompt-major; the RMS of the noise really applied)."""
    # One generator per step, derived from (seed, step): a resumed run samples what an uninterrupted one would.
    device, gen_seed = common.model_device(model), seed * 1_000_003 + step
    gen = torch.Generator(device=device).manual_seed(gen_seed)
    with torch.inference_mode(), aqn.aqn_noise(model, sigma, gen) as noise, \
            merged_sampling_weights(model, merge_for_sampling(device)):
        # The rank's sampling stream forks here, after aqn_noise drew the noise from `gen` on entering the
        # `with`: every rank seeded `gen` alike, so every rank perturbs the model with the same noise. Rank 0
        # samples on from that stream, the others from a stream of their own (different completions).
        if rank > 0:
            gen = torch.Generator(device=device).manual_seed(gen_seed + rank * 2 ** 40)
        samples = rollout.generate(model, prompts, num_samples=group, max_new_tokens=max_new_tokens,
                                   temperature=temperature, eos_token_ids=tok.eos_token_ids, generator=gen,
                                   tokenizer=tok, compiled=compiled)
    return samples, noise["applied_std"]


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
    raise ValueError(f"unknown loss aggregation {mode!r}; choose token-mean, seq-mean-token-mean or "
                     f"seq-mean-token-sum-norm")


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


def grpo_loss(logp, old_logp, adv, mask, options=LossOptions(), *, max_new_tokens=None, ref_logp=None,
              entropy=None, denom=None):
    """The clipped surrogate (to minimise) and its statistics.
    logp (N, T) current policy, with gradients; old_logp (N, T) pi_old's (see UpdateOptions.pi_old); adv (N,);
    mask (N, T) 1 on completion tokens; ref_logp (N, T) the reference policy (for options.beta > 0);
    entropy (N, T) with gradients (for options.entropy_coef > 0); max_new_tokens, denom: see aggregate."""
    eps_low, eps_high = options.eps_low, options.eps_high
    mask = mask.float()
    ratio = torch.exp(logp - old_logp)  # (N, T) pi_theta / pi_old per token
    a = adv.view(-1, 1)  # (N, 1)
    surr = torch.minimum(ratio * a, ratio.clamp(1 - eps_low, 1 + eps_high) * a)  # (N, T)
    per_tok = -surr  # (N, T)
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
        stats = {"clip": float((clipped.float() * mask).sum() / n_tok),
                 "ratio_max": float(ratio.masked_fill(mask == 0, 1.0).max()) if mask.numel() else 1.0,
                 "kl": float((kl * mask).sum() / n_tok) if kl is not None else float("nan"),
                 # how far pi_old (the noisy sampler under --pi-old sampler) is from pi_theta: their k3
                 "kl_old": float(((torch.exp(old_logp - logp) - (old_logp - logp) - 1) * mask).sum() / n_tok)}
    return loss, stats

# -----------------------------------------------------------------------------
# The update. With several processes (torchrun), each holds whole groups; `global_sum` and `sum_grads`
# (Part 2) add numbers and gradients over processes, and are no-ops in a single one. Each loss is divided
# by the *global* count of tokens (or sequences, or rows), so the summed gradient is exactly the one a
# single process would compute on all rows, and micro-batches are exact for the same reason.


PI_OLD = {  # --pi-old: whose log-probs are pi_old in the ratio pi_theta / pi_old
    "trainer": "the clean policy being trained, as the official code (TRL) has it: at --mu 1 the ratio is 1 and "
               "AQN's noise reaches the gradient uncorrected",
    "sampler": "the noisy sampler's own, as Algorithm 1 reads: up to the clip the ratio cancels AQN's noise in "
               "expectation",
}


@dataclasses.dataclass(frozen=True)
class UpdateOptions:
    """The options of policy_update besides the loss's; fields and flags as in LossOptions (pi_old: --pi-old)."""
    pi_old: str = "trainer"  # one of PI_OLD
    mu: int = 1  # optimizer steps on each batch
    micro_batch: int | str = 0  # rows per forward/backward (0: all kept rows at once; "auto": within a memory budget)
    grad_clip: float = 1.0  # max gradient norm
    no_std_scale: bool = False  # advantages r - mean only (Dr. GRPO)

    @classmethod
    def from_args(cls, args):
        return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)})


def micro_batch_loss(model, prompts, ids, mask, old_logp, adv, denom, temperature, max_new_tokens, options):
    """Loss and statistics of one micro-batch (its share of the step's loss: denom is global). old_logp None:
    pi_old is the current policy itself (--pi-old trainer at --mu 1), so the ratio is exactly 1."""
    logp, ent = rollout.sequence_logprobs(model, prompts, ids, mask, temperature=temperature,
                                          entropy=options.entropy_coef != 0)  # (mb, t) each; ent None unless used
    logp = logp.float()
    ref_logp = None
    if options.beta > 0:
        with torch.no_grad(), lora.lora_disabled(model):  # the reference policy is the base
            ref_logp, _ = rollout.sequence_logprobs(model, prompts, ids, mask, temperature=temperature, entropy=False)
    return grpo_loss(logp, logp.detach() if old_logp is None else old_logp, adv, mask, options,
                     max_new_tokens=max_new_tokens, ref_logp=ref_logp, entropy=None if ent is None else ent.float(),
                     denom=denom)


def policy_logprobs(model, prompts, ids, mask, slices, temperature):
    """The current (clean) policy's log-probs (n, T) of the given rows, without gradients, one slice of rows
    at a time: pi_old under --pi-old trainer when --mu > 1 takes several steps on the same batch."""
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
    `loss_options`, pi_old as update_options.pi_old says. Returns the global loss, gradient norm and
    statistics, the kept/flat/all row counts, and "skipped" (why no step was taken: a non-finite loss/gradient)."""
    mu, micro_batch, grad_clip = update_options.mu, update_options.micro_batch, update_options.grad_clip
    adv = group_advantages(rewards, group, not update_options.no_std_scale).to(common.model_device(model))  # (N,)
    # Groups of equal rewards have zero advantage: the update (the larger half of a step) skips them, and
    # rows without a token in the loss (--mask-truncated) too.
    has_signal = (rewards.view(-1, group).std(1) > 0).repeat_interleave(group)  # (N,)
    kept_rows = (has_signal & (mask.sum(1) > 0)).nonzero().squeeze(1).tolist()  # indices of the rows that train
    t_max = int(mask[kept_rows].sum(1).max()) if kept_rows else 0  # the kept rows may all be shorter than T
    kept_ids, kept_mask = ids[kept_rows, :t_max], mask[kept_rows, :t_max]  # (n, t_max) each
    kept_sampler_logp, kept_adv = sampler_logp[kept_rows, :t_max], adv[kept_rows]  # (n, t_max), (n,)
    kept_prompts = [prompt_ids[i] for i in kept_rows]
    total_tokens, total_sequences, total_kept_rows, total_rows, total_flat_rows = global_sum([
        float(kept_mask.sum()), float((kept_mask.sum(1) > 0).sum()), len(kept_rows), mask.shape[0],
        float((~has_signal).sum())])
    denom = {"token-mean": max(total_tokens, 1.0), "seq-mean-token-mean": max(total_sequences, 1.0),
             "seq-mean-token-sum-norm": total_rows * max_new_tokens}[loss_options.loss_agg]
    out = {"loss": 0.0, "grad_norm": 0.0, "skipped": "", "clip": 0.0, "kl": float("nan"), "kl_old": float("nan"),
           "ratio_max": 1.0, "kept_rows": len(kept_rows), "kept_rows_all": total_kept_rows, "rows_all": total_rows,
           "flat_all": total_flat_rows}
    if total_kept_rows == 0:  # no process has a group with signal: nobody updates (a global decision)
        return out
    # rows per forward/backward (one slice's activations live); auto: as many as the memory budget holds (Part 2)
    slice_rows = micro_batch_rows(micro_batch, max(len(kept_rows), 1), model,
                                  max(map(len, kept_prompts), default=0) + t_max)
    slices = [slice(i, i + slice_rows) for i in range(0, len(kept_rows), slice_rows)]
    # pi_old: the sampler's log-probs, or the clean policy's before the first step (trainer). At mu 1 the
    # latter is the first step's own log-probs, detached in micro_batch_loss: no extra forward pass.
    kept_old_logp = kept_sampler_logp if update_options.pi_old == "sampler" else None  # (n, t_max) or None
    if update_options.pi_old == "trainer" and mu > 1:
        kept_old_logp = policy_logprobs(model, kept_prompts, kept_ids, kept_mask, slices, temperature)  # (n, t_max)
    for _ in range(mu):
        opt.zero_grad(set_to_none=True)
        loss_sum, stats, out["ratio_max"] = 0.0, {"clip": 0.0, "kl": 0.0, "kl_old": 0.0}, 1.0
        for part in slices:
            t = int(kept_mask[part].sum(1).max())  # this slice's longest completion
            old_logp = None if kept_old_logp is None else kept_old_logp[part, :t]  # (mb, t) or None
            loss, slice_stats = micro_batch_loss(model, kept_prompts[part], kept_ids[part, :t], kept_mask[part, :t],
                                                 old_logp, kept_adv[part], denom, temperature,
                                                 max_new_tokens, loss_options)
            if torch.isfinite(loss):  # a non-finite loss skips the step below; its backward is wasted work
                loss.backward()  # the slices' gradients add up in .grad
            loss_sum += float(loss.detach())
            token_share = float(kept_mask[part].sum()) / max(total_tokens, 1.0)  # statistics: global token means
            for key in stats:
                stats[key] += slice_stats[key] * token_share
            out["ratio_max"] = max(out["ratio_max"], slice_stats["ratio_max"])
        loss_sum, out["clip"], out["kl"], out["kl_old"] = global_sum([loss_sum, *stats.values()])
        if not math.isfinite(loss_sum):  # the same verdict on every process
            out["skipped"] = f"loss is {loss_sum}"
            break
        sum_grads(params)
        grad_norm = float(torch.nn.utils.clip_grad_norm_(params, grad_clip))
        if not math.isfinite(grad_norm):
            out["skipped"] = f"gradient norm is {grad_norm}"
            break
        opt.step()
        out["loss"], out["grad_norm"] = loss_sum, grad_norm
    opt.zero_grad(set_to_none=True)
    return out

# -----------------------------------------------------------------------------
# One GRPO step


def grpo_step(model, tok, opt, params, task, step, sigma, *, batch=16, group=8, max_new_tokens=42,
              temperature=1.0, seed=0, mask_truncated=False, compiled=False, **update_kw):
    """This process's share of the step's `batch` problems, `group` completions each sampled under AQN
    noise `sigma`, scored, and one policy_update (`update_kw`: its options). Returns the step's metrics,
    summed over processes."""
    t0, cpu0 = time.time(), time.process_time()
    rank, world = rank_and_world()
    problems = shard(task.problems(seed, step, batch), rank, world)  # whole groups: advantages need all G
    prompts = [tok.encode(task.prompt(p)) for p in problems]
    samples, sigma_applied = sample_groups(model, tok, prompts, step, sigma, rank=rank, group=group,
                                           max_new_tokens=max_new_tokens, temperature=temperature, seed=seed,
                                           compiled=compiled)
    t_sample, cpu_sample = time.time() - t0, time.process_time() - cpu0
    rewards, correct = score(task, problems, samples.texts, group)  # (N,), a count
    t_score = time.time() - t0 - t_sample  # the step's record times its phases: benchmarks need no hooks
    mask = samples.completion_mask.float().clone()  # (N, T) plain copies: inference-mode tensors cannot train
    truncated = truncated_rows(samples.completion_ids, mask, tok.eos_token_ids)  # (N,) no EOS: cut off (Part 2)
    # --mask-truncated: those rows keep their reward (their group's advantages need it) but leave the loss
    loss_mask = mask * (~truncated).float()[:, None] if mask_truncated else mask  # (N, T)
    report = policy_update(model, opt, params, samples.prompt_ids, samples.completion_ids.clone(), loss_mask,
                           samples.logprobs.float().clone(), rewards, group=group, max_new_tokens=max_new_tokens,
                           temperature=temperature, **update_kw)
    if report["skipped"]:
        print(f"step {step + 1} | {report['skipped']} | skipping this update (no weights changed)")
    total_reward, total_correct, total_entropy, total_tokens, total_truncated = global_sum([
        float(rewards.sum()), correct, float((samples.entropy.float() * mask).sum()), float(mask.sum()),
        float(truncated.sum())])
    t_sample_max, ratio_max = global_sum([t_sample, report["ratio_max"]], op="max")
    rows = report["rows_all"]
    return {"step": step + 1, "reward": total_reward / rows, "acc": total_correct / rows,
            "entropy": total_entropy / max(total_tokens, 1), "kl": report["kl"], "clip": report["clip"],
            "len": total_tokens / rows, "sigma": sigma, "sigma_applied": sigma_applied,
            "tok/s": total_tokens / max(t_sample_max, 1e-9), "s/step": time.time() - t0, "t_sample": t_sample_max,
            "loss": report["loss"], "grad_norm": report["grad_norm"], "kl_old": report["kl_old"],
            "ratio_max": ratio_max, "frac_zero_std": report["flat_all"] / rows, "truncated": total_truncated / rows,
            "skipped": int(bool(report["skipped"])), "t_score": t_score, "cpu_s": time.process_time() - cpu0,
            "cpu_sample": cpu_sample, "peak_rss_mb": common.peak_rss_bytes() / 2 ** 20}

# -----------------------------------------------------------------------------
# The loop: the policy (a frozen, quantized base, LoRA adapters and their AdamW), then per step its LR and
# AQN noise level, one grpo_step, the log line, evaluations and checkpoints at their intervals. Part 2
# holds what it calls by name: processes, checkpoints, evaluation, the run log, the arguments.


def build_policy(args, device):
    """The frozen (quantized) base with fresh LoRA adapters and their AdamW -> (model, tok, params, opt).
    The adapter initialisation depends on --seed alone, so every rank builds the same one."""
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
    """AQN's noise level at `step`: none with --no-aqn, the feedback controller's current one with
    --aqn-kind feedback, else the schedule's (stage 04)."""
    if not args.aqn:
        return 0.0
    if feedback is not None:
        return feedback.sigma
    return aqn.sigma_schedule(step, args.steps, args.sigma_start, args.sigma_end, args.num_stages, args.aqn_kind)


def train(args, task=None):
    """The GRPO run: grpo_step over --steps, with evaluations and checkpoints at their intervals. `task`, any
    object with the task interface, replaces the one --task names. Returns the summary (also written to
    <out>/summary.json)."""
    # Run (Part 2): processes, every check, the task, build_policy (fresh or resumed from a checkpoint), the
    # run log and its folder, Ctrl-C/SIGTERM/SIGHUP (the step in flight finishes) and the time budget.
    with Run(args, task) as run:
        for step in run.steps():  # from the resumed step to --steps, unless the time budget or a signal ends it
            lr = args.lr * lr_factor(step, args.warmup, args.steps, args.min_lr_ratio)
            for param_group in run.opt.param_groups:
                param_group["lr"] = lr
            sigma = step_sigma(args, step, run.feedback)
            rec = grpo_step(run.model, run.tok, run.opt, run.params, run.task, step, sigma, **run.options)
            run.record(rec, lr)  # the step's line; an evaluation or a checkpoint when one is due
        return run.finish()  # the last checkpoint and the full evaluation, summary.json


# ======== Part 2: plumbing (tasks, data files, evaluation, processes, checkpoints, the run log, command line) ========
# -----------------------------------------------------------------------------
# Tasks: each one object with `problems(seed, step, n)` (a pure function of (seed, step), so a resumed run
# draws what an uninterrupted one would), `held` (the held-out problems), `prompt`, `correct` and `reward`.
# The loop only calls these. Three tasks ship, chosen by --task from TASKS: synthetic arithmetic, a
# GSM8K-style JSONL file, and chat arithmetic for a real instruct model (tests add another).

# The paper's instruction (App. E). The bundled tiny model learned the format in pretraining, so its
# prompt is the bare problem ("qerl_prompt": "bare" in its config.json).
PAPER_INSTRUCTION = ("Solve the following math problem step by step. The reasoning process and direct answer "
                     "are enclosed within <think> </think> and <answer> </answer> tags, respectively, i.e., "
                     "<think> reasoning process here </think> <answer> answer here </answer>.")
EVAL_SEED, EVAL_POOL = 1234, 2000  # the held-out stream; its first EVAL_POOL questions never train
FORMAT_REWARD = 0.1
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")
_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.S)
# exactly one think block then one answer block (whitespace allowed between and around)
_FORMAT = re.compile(r"\s*<think>((?!</?think>).)*</think>\s*<answer>((?!</?answer>).)*</answer>\s*", re.S)
_EOS_STRINGS = ("<|im_end|>", "<|endoftext|>")


def parse_number(text):
    """The last number in `text` as an exact Fraction ("1,234.50" -> 2469/2), or None."""
    found = _NUMBER.findall(text or "")
    try:
        return Fraction(found[-1].replace(",", "")) if found else None
    except (ValueError, ZeroDivisionError):
        return None


def _strip_eos(completion):  # a sampler may or may not decode the stop token
    text = completion if isinstance(completion, str) else ""
    for eos in _EOS_STRINGS:
        text = text.replace(eos, "")
    return text


def extract_answer(completion):
    """The number in the last <answer>...</answer> of a completion, or None."""
    blocks = _ANSWER.findall(_strip_eos(completion))
    return parse_number(blocks[-1]) if blocks else None


def answer_correct(completion, gold):
    """The one definition of "solved": the last <answer> holds the gold number."""
    pred, want = extract_answer(completion), parse_number(str(gold))
    return pred is not None and want is not None and pred == want


def format_ok(completion):
    """Whether a completion is exactly <think>...</think><answer>number</answer>: one block of each, in
    that order, whitespace allowed around them, a decoded stop token ignored."""
    return _FORMAT.fullmatch(_strip_eos(completion)) is not None and extract_answer(completion) is not None


def reward_fn(completion, gold):
    """1.0 if correct, plus 0.1 if format_ok. Never raises: malformed text just scores lower."""
    return float(answer_correct(completion, gold)) + (FORMAT_REWARD if format_ok(completion) else 0.0)


class AnswerTask:
    """Problems {"question", "answer"} answered as <think>...</think><answer>number</answer>."""
    system = False  # whether prompts carry PAPER_INSTRUCTION as the system message
    reads_data = False  # whether the task trains on the --data file
    reads = ("system",)  # the task-specific flags (make_task's TASK_FLAGS) that from_args reads

    def prompt(self, problem):
        return rollout.chat_prompt(problem["question"], system=PAPER_INSTRUCTION if self.system else None)

    def reward(self, problem, completion):
        return reward_fn(completion, problem["answer"])

    def correct(self, problem, completion):
        return answer_correct(completion, problem["answer"])


def make_problem(rng, digits=3, nops=2, ops="+-"):
    """One problem {question, answer, solution} from a random.Random: `a op b op c = ?`, worked left to
    right; `solution` is the completion the tiny model was pretrained on."""
    def operand():  # the digit count is drawn first: small numbers are as common as large ones
        d = rng.randint(1, digits)
        return rng.randint(0 if d == 1 else 10 ** (d - 1), 10 ** d - 1)

    nums = [operand() for _ in range(nops + 1)]
    chosen = [rng.choice(ops) for _ in range(nops)]
    acc, steps = nums[0], []
    for op, n in zip(chosen, nums[1:]):
        new = acc + n if op == "+" else acc - n
        steps.append(f"{acc}{op}{n}={new}")
        acc = new
    question = str(nums[0]) + "".join(op + str(n) for op, n in zip(chosen, nums[1:])) + "=?"
    solution = "<think>" + ",".join(steps) + "</think><answer>" + str(acc) + "</answer>"
    return {"question": question, "answer": str(acc), "solution": solution}


def arithmetic_space(digits, nops, ops="+-"):
    """How many distinct questions make_problem can write: 10^digits operand values, len(ops) operators."""
    return (10 ** digits) ** (nops + 1) * len(ops) ** nops


def arithmetic_problems(n, seed, digits=3, nops=2, exclude=frozenset()):
    """The first n distinct problems of the stream `seed` whose questions are not in `exclude`."""
    rng, seen, out = random.Random(seed), set(exclude), []
    if len(seen) + n > arithmetic_space(digits, nops):
        raise ValueError(f"{n} new problems wanted but --digits {digits} --nops {nops} has only "
                         f"{arithmetic_space(digits, nops)} distinct ones, {len(exclude)} of them held out")
    while len(out) < n:
        p = make_problem(rng, digits, nops)
        if p["question"] not in seen:
            seen.add(p["question"])
            out.append(p)
    return out


class ArithmeticTask(AnswerTask):
    """The synthetic task (~4e9 problems at 3 digits and 2 operations); training skips the whole
    held-out pool, not only the part that is evaluated."""
    help = "synthetic arithmetic (63-4-597=?), the bundled model's task"  # for --task's help
    reads = ("digits", "nops", "system")

    def __init__(self, digits=3, nops=2, eval_size=500, system=False):
        self.digits, self.nops, self.system = digits, nops, system
        pool_size, space = max(EVAL_POOL, eval_size), arithmetic_space(digits, nops)
        if space < 2 * pool_size:  # drawing distinct problems from a nearly exhausted space never ends
            raise ValueError(f"--digits {digits} --nops {nops} makes only {space} distinct problems, and the held-out "
                             f"pool alone takes {pool_size} (with as many left to train on): raise --digits or --nops")
        pool = arithmetic_problems(max(EVAL_POOL, eval_size), EVAL_SEED, digits, nops)
        self.held, self.exclude = pool[:eval_size], frozenset(p["question"] for p in pool)

    @classmethod
    def from_args(cls, args, system):
        return cls(args.digits, args.nops, args.eval_size, system)

    def problems(self, seed, step, n):
        return arithmetic_problems(n, seed * 1_000_003 + step, self.digits, self.nops, self.exclude)


class JsonlTask(AnswerTask):
    """A GSM8K-style file (read by load_jsonl); the held-out set is --eval-data, or a fixed random slice
    of the file."""
    help = "GSM8K-style JSONL problems from --data"  # for --task's help
    reads_data, reads = True, ("data", "eval_data", "system")

    def __init__(self, path, eval_path=None, eval_size=500, system=True):
        train, self.system = load_jsonl(path), system
        if eval_path:
            held = load_jsonl(eval_path)[:eval_size]
        else:
            n_eval = min(eval_size, len(train) // 2)
            random.Random(EVAL_SEED).shuffle(train)
            held, train = train[:n_eval], train[n_eval:]
        self.held, held_q = held, {p["question"] for p in held}
        self.train = [p for p in train if p["question"] not in held_q]  # eval problems never train
        if not self.train:
            raise ValueError(f"no training problems left in {path!r} after removing the evaluation set")
        if eval_size > 0 and not self.held:
            raise ValueError(f"{path!r} has {len(train)} problem(s), too few to hold any out for evaluation: pass "
                             f"--eval-data FILE, or --eval-size 0 for no evaluation")

    @classmethod
    def from_args(cls, args, system):
        return cls(args.data, args.eval_data, args.eval_size, system)

    def problems(self, seed, step, n):  # walk epoch-wise seeded shuffles of the file
        out = []
        for i in range(step * n, step * n + n):
            epoch, j = divmod(i, len(self.train))
            order = list(range(len(self.train)))
            random.Random(seed * 1_000_003 + epoch).shuffle(order)
            out.append(self.train[order[j]])
        return out


class ChatArithmeticTask(AnswerTask):
    """For a real instruct model (SmolLM2-135M-Instruct, assets/smollm2.py): "What is 13 - 4?" in its own
    chat template, system message included, answered in its own words. Correct = the last number of the
    reply; no format bonus, since such a model writes no tags. +/- on 0..20 and x on 2..12 (1,003
    problems): SmolLM2 solves 17% of the held-out ones greedily, mostly losing to long-winded replies
    that run out of tokens."""
    help = "What is 13 - 4? in a chat model's own template (SmolLM2)"  # for --task's help
    reads = ()  # its system message is the model's own

    def __init__(self, eval_size=200, system_message=None):
        pool = [(f"What is {a} + {b}?", a + b) for a in range(21) for b in range(21)]
        pool += [(f"What is {a} - {b}?", a - b) for a in range(21) for b in range(21)]
        pool += [(f"What is {a} times {b}?", a * b) for a in range(2, 13) for b in range(2, 13)]
        if not 0 <= eval_size <= len(pool) // 2:
            raise ValueError(f"--task chat-arithmetic has {len(pool)} problems: --eval-size must be 0..{len(pool) // 2}")
        problems = [{"question": q, "answer": str(a)} for q, a in pool]
        random.Random(EVAL_SEED).shuffle(problems)
        self.held, self.train, self.system_message = problems[:eval_size], problems[eval_size:], system_message

    @classmethod
    def from_args(cls, args, system):  # the model's own default system message, not the paper's instruction
        return cls(args.eval_size, rollout.template_default_system(Path(args.model) / "tokenizer_config.json"))

    def prompt(self, problem):
        return rollout.chat_prompt(problem["question"], system=self.system_message)

    def reward(self, problem, completion):
        return float(self.correct(problem, completion))

    def correct(self, problem, completion):
        return parse_number(_strip_eos(completion)) == parse_number(problem["answer"])

    def problems(self, seed, step, n):  # a fresh seeded sample of the training problems each step
        return random.Random(seed * 1_000_003 + step).sample(self.train, min(n, len(self.train)))


# --task NAME -> its class; make_task builds it with `from_args(args, system)`
TASKS = {"arithmetic": ArithmeticTask, "gsm8k": JsonlTask, "chat-arithmetic": ChatArithmeticTask}

# GSM8K-style data (--task gsm8k): a JSONL file of {"question", "answer": "... #### n"} lines, and make_task


def _gsm8k_problem(line):
    """{question, answer} from one JSONL line, the gold being the number after the last '####'; None for a
    line that is no problem (not JSON, no question, no '####'); an error for a gold that is not a number."""
    try:
        row = json.loads(line.lstrip("\ufeff"))  # a byte-order mark, as some editors write, is not content
    except json.JSONDecodeError:
        return None
    if not isinstance(row, dict) or not isinstance(row.get("question"), str) or not row["question"].strip() \
            or not isinstance(row.get("answer"), str) or "####" not in row["answer"]:
        return None
    gold = row["answer"].rsplit("####", 1)[1].strip().replace(",", "")  # "... #### 1,200" -> "1200"
    return {"question": row["question"].strip(), "answer": _gold_number(gold)}


def _gold_number(text):
    """A gold answer as the scorer reads numbers (parse_number: the digits as written, one sign): itself
    when it is one such number, else 1e5, 1/2 or a Unicode minus (−7) rewritten as one (100000, 0.5, -7).
    Anything else would be scored as its last digits (1e5 as 5): an error."""
    text = text.replace("\u2212", "-")
    if _NUMBER.fullmatch(text):
        return text
    try:
        value = Fraction(text)
    except (ValueError, ZeroDivisionError):
        raise ValueError(f"the answer after '####' is {text!r}, not a number (write it as 42, -3.5, 1e5 or "
                         f"1/2)") from None
    for k in range(16):  # the fewest decimals that write it exactly
        scaled = value * 10 ** k
        if scaled.denominator == 1:
            digits = str(abs(scaled.numerator)).rjust(k + 1, "0")
            return ("-" if value < 0 else "") + (f"{digits[:-k]}.{digits[-k:]}" if k else digits)
    raise ValueError(f"the answer after '####' is {text!r}, which no decimal writes exactly (the scorer reads "
                     f"decimals): round it, e.g. {float(value):.6g}")


def load_jsonl(path):
    """Problems [{question, answer}] from a GSM8K-style JSONL file; malformed lines are skipped and
    counted (one line of output), a file without one usable line is an error."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"data file {path!r} not found (expected JSONL lines with 'question' and "
                                f"'answer' ending in '#### <number>', or use --task arithmetic)")
    parsed = []
    with open(path, encoding="utf-8", errors="replace") as f:  # undecodable bytes -> a malformed line
        for n, line in enumerate(f, 1):
            try:
                parsed += [(n, _gsm8k_problem(line))] if line.strip() else []
            except ValueError as e:  # a gold the scorer would misread
                raise ValueError(f"{path}:{n}: {e}") from None
    problems, bad = [dict(p, where=f"{path}:{n}") for n, p in parsed if p], [n for n, p in parsed if not p]
    if bad:
        print(f"data | {path}: skipped {len(bad)} malformed line(s) (first at line {bad[0]}); kept {len(problems)}")
    if not problems:
        raise ValueError(f"data file {path!r} has no usable problems (need JSON lines with 'question' and "
                         f"'answer' ending in '#### <number>')")
    return problems


TASK_FLAGS = ("data", "eval_data", "digits", "nops", "system")  # the flags that only some tasks read


def make_task(args):
    """The task --task names, built from its flags (`from_args`); its prompts carry the paper's instruction
    as --system says. --data is the file of a task that reads one (gsm8k), and only of such a task."""
    if args.task not in TASKS:
        raise ValueError(f"unknown task {args.task!r}: choose one of {', '.join(TASKS)}")
    cls, file_tasks = TASKS[args.task], " or ".join(f"--task {n}" for n, c in TASKS.items() if c.reads_data)
    if cls.reads_data and not args.data:
        raise ValueError(f"--task {args.task} needs --data FILE (JSONL lines with 'question' and 'answer' ending in "
                         f"'#### <number>')")
    if args.data and not cls.reads_data:
        raise ValueError(f"--data is the file of {file_tasks}, but the task is {args.task}: add {file_tasks} to "
                         f"train on {args.data!r}, or drop --data")
    defaults = build_parser()
    for name in TASK_FLAGS:  # a flag the task does not read would be recorded in args.json as if it counted
        value = getattr(args, name)
        if name not in cls.reads and value != defaults.get_default(name):
            readers = " or ".join(f"--task {n}" for n, c in TASKS.items() if name in c.reads)
            flag = "--" + name.replace("_", "-")
            raise ValueError(f"{flag} {value} is read only by {readers}, and --task {args.task} ignores it: drop "
                             f"{flag}")
    system = args.system == "paper" or (args.system == "auto" and
                                        common.find_weight_files(args.model)[0].get("qerl_prompt") != "bare")
    return cls.from_args(args, system)

# -----------------------------------------------------------------------------
# Samples (truncated rows), sampling weights and evaluation
#
# On the CPU every sampled token would dequantize each 4-bit weight and run each adapter as three small
# ops, so sampling uses merged float weights (02's lora_merged). On CUDA the kernel reads the 4-bit
# weights, and a merged copy of a 7B model costs its full size: the modules run as they are.


def truncated_rows(ids, mask, eos_token_ids):
    """(N,) bool: the rows whose completion has no EOS token, i.e. that max_new_tokens cut off."""
    eos = torch.tensor(list(eos_token_ids), dtype=ids.dtype, device=ids.device)
    return ~(torch.isin(ids, eos) & (mask > 0)).any(1)


def merge_for_sampling(device):  # --gpu-path (NVFP4Linear.kernel_on_cpu) takes the CUDA path on the CPU too
    return torch.device(device).type == "cpu" and not quantize.NVFP4Linear.kernel_on_cpu


def merged_sampling_weights(model, enabled=True):
    return lora.lora_merged(model) if enabled else contextlib.nullcontext(model)


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


@torch.inference_mode()
def evaluate(model, tok, task, problems, max_new_tokens, k=0, temperature=1.0, seed=0, chunk=512, compiled=False):
    """Held-out accuracy without AQN noise: greedy pass@1; with k > 0 also pass@1 (mean over the k
    samples) and pass@k (any of k correct) at `temperature`. Returns counts and rates."""
    prompts, n, device = [tok.encode(task.prompt(p)) for p in problems], len(problems), common.model_device(model)

    def solved(num_samples, temperature, gen):  # generate() over chunks of rows (memory)
        texts, step = [], max(1, chunk // num_samples)
        for i in range(0, n, step):
            texts += rollout.generate(model, prompts[i:i + step], num_samples=num_samples, max_new_tokens=max_new_tokens,
                                      temperature=temperature, eos_token_ids=tok.eos_token_ids, generator=gen,
                                      tokenizer=tok, compiled=compiled).texts
        return [[task.correct(p, texts[i * num_samples + j]) for j in range(num_samples)] for i, p in enumerate(problems)]

    with merged_sampling_weights(model, merge_for_sampling(device)):
        greedy = sum(h[0] for h in solved(1, 0.0, None))
        res = {"n": n, "greedy_correct": greedy, "greedy": greedy / max(n, 1)}
        if k > 0:
            hits = solved(k, temperature, torch.Generator(device=device).manual_seed(seed))
            res.update({"k": k, "sample_correct": sum(map(sum, hits)), "pass_k_correct": sum(map(any, hits)),
                        "pass@1": sum(map(sum, hits)) / max(k * n, 1), f"pass@{k}": sum(map(any, hits)) / max(n, 1)})
    return res

# -----------------------------------------------------------------------------
# Data parallel: `torchrun --nproc_per_node N 05_grpo.py ...` starts N copies of this script (NCCL between
# GPUs, gloo between CPU processes), each with the same adapter (built from --seed) and a share of the groups
# (see "The update"). Process 0 alone prints, evaluates and writes files. In a plain run these are no-ops.


def init_distributed(device):
    """(rank, world_size, device). Joins the process group when torchrun started us (WORLD_SIZE > 1);
    on CUDA each rank takes the GPU of its LOCAL_RANK."""
    if int(os.environ.get("WORLD_SIZE", "1")) == 1:
        return 0, 1, device
    if device.startswith("cuda"):
        device = f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}"
        torch.cuda.set_device(device)
    if not dist.is_initialized():  # rank 0 evaluates while the others wait: allow a long evaluation
        dist.init_process_group("nccl" if device.startswith("cuda") else "gloo", timeout=datetime.timedelta(hours=2))
    return dist.get_rank(), dist.get_world_size(), device


def leave_distributed(code=0):
    """End a torchrun process. On success the ranks leave together (one that tears gloo down while another
    still works aborts), and every rank skips the interpreter's teardown, where gloo's worker threads can
    still free tensors after Python is gone and abort the process."""
    if code == 0:
        dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def rank_and_world():
    return (dist.get_rank(), dist.get_world_size()) if dist.is_available() and dist.is_initialized() else (0, 1)


def shard(items, rank, world):
    """This rank's contiguous share of `items` (shares differ in size by at most one)."""
    return items[rank * len(items) // world:(rank + 1) * len(items) // world]


def global_sum(values, op="sum"):
    """A list of numbers -> each summed (or, op "max", maximised) over all processes."""
    values = [float(v) for v in values]
    if rank_and_world()[1] == 1:
        return values
    dev = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
    t = torch.tensor(values, dtype=torch.float64, device=dev)  # (n,)
    dist.all_reduce(t, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX)
    return t.tolist()


def sum_grads(params):
    """Sum every parameter's gradient over processes, in one all_reduce of their concatenation (a
    process with no rows to train on contributes zeros)."""
    if rank_and_world()[1] == 1:
        return
    flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params])  # (P,)
    dist.all_reduce(flat)
    for p, g in zip(params, flat.split([p.numel() for p in params])):
        p.grad = g.view_as(p)

# -----------------------------------------------------------------------------
# Checkpoints: the adapter in PEFT's layout (stage 02) and trainer_state.pt (AdamW state, step, AQN feedback
# controller, RNG states as a safety net, the run's arguments and what it ran on). The LR schedule and the
# per-step generators are pure functions of (seed, step), so a resumed run is, bit for bit, the uninterrupted
# one. trainer_state.pt is read with weights_only=True: tensors and plain values, never code.

RUNTIME_ARGS = ("out", "resume", "time_budget", "stop_at", "eval_every", "save_every", "device", "quiet",
                "micro_batch", "grad_checkpoint", "gpu_path", "compile")  # how to compute, not what: a resume may change them
INHERITED_RUNTIME_ARGS = ("time_budget", "eval_every", "save_every", "quiet", "micro_batch", "grad_checkpoint",
                          "compile")  # a resume keeps these unless given again
TRAINED_NORMS = aqn.AQN_NORMS  # --train-norms trains the norms AQN perturbs: the official --ln True's modules_to_save


def save_checkpoint(out, step, model, opt, params, args, feedback=None, extra=None):
    """checkpoint-<step> in `out`; None (and the last good one stays) if a trained tensor is not finite."""
    if not all(torch.isfinite(p).all() for p in params):
        print(f"checkpoint | step {step} | adapter has non-finite values | NOT saved")
        return None

    def write(tmp):
        os.makedirs(tmp)
        lora.save_adapter(model, tmp, base_model_name_or_path=args.model,
                          modules_to_save=TRAINED_NORMS if getattr(args, "train_norms", False) else None)
        file = os.path.join(tmp, "trainer_state.pt")
        try:
            torch.save({"step": step, "optimizer": opt.state_dict(), "lr": opt.param_groups[0]["lr"],
                        "args": vars(args), "run": run_record(args),
                        "feedback": feedback.state_dict() if feedback is not None else None,
                        "torch_rng": torch.get_rng_state(), "python_rng": random.getstate(),
                        "cuda_rng": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
                        **(extra or {})}, file)
        except RuntimeError:  # torch's zip writer reports a failed write (a full disk) so, without the reason
            raise OSError(errno.EIO, "torch.save could not write it: is the disk full?", file) from None
    return common.atomic_write(os.path.join(out, f"checkpoint-{step:06d}"), write)


def model_fingerprint(model_dir):
    """sha256 of a model folder's config.json and its weights' safetensors headers (names, dtypes, shapes,
    offsets): another model, or the same one changed, has another; no tensor is read."""
    _, weight_map, _ = common.find_weight_files(model_dir)
    h = hashlib.sha256()
    for name in ["config.json", *sorted(set(weight_map.values()))]:
        with open(os.path.join(model_dir, name), "rb") as f:
            h.update(f.read() if name == "config.json" else f.read(8 + int.from_bytes(f.read(8), "little")))
    return h.hexdigest()


def run_record(args):
    """What a checkpoint says about its run, checked on --resume: the base (an absolute path, so a resume from
    another directory finds it, and its fingerprint), the data files' absolute paths, quant and LoRA shape."""
    where = {k: os.path.abspath(getattr(args, k)) if getattr(args, k) else None for k in ("model", "data", "eval_data")}
    return {**where, "model_fingerprint": model_fingerprint(args.model), "quant": args.quant,
            "quant_method": args.quant_method, "lora_r": args.lora_r, "lora_alpha": args.lora_alpha,
            "lora_targets": list(lora.DEFAULT_TARGETS)}


def read_trainer_state(file, defaults):
    """trainer_state.pt, loaded without running code, with the types resume_args and restore rely on
    (each saved flag's value of the kind of its default in `defaults`, the parser's)."""
    damaged = f"{file} cannot be read ({{}}): the checkpoint is damaged; resume from an earlier checkpoint-NNNNNN " \
              f"folder beside it"
    try:
        with warnings.catch_warnings():  # torch warns about a bare pickle's protocol: the line below says it all
            warnings.simplefilter("ignore")
            state = torch.load(file, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        if "Weights only load failed" in str(e):
            raise ValueError(f"{file} holds pickled Python objects, which a checkpoint of 05_grpo.py never does: "
                             f"refused unread (loading it could run code); resume only from checkpoints you trust") \
                from None
        raise ValueError(damaged.format(type(e).__name__)) from None
    except Exception as e:  # torch.load raises RuntimeError, EOFError or pickle's errors on a damaged file
        raise ValueError(damaged.format(type(e).__name__)) from None
    want = {"step": int, "args": dict}  # what resume_args reads; restore checks the rest as it loads it
    if not isinstance(state, dict):
        raise ValueError(damaged.format(f"a {type(state).__name__}, not a dict"))
    for k, kind in want.items():
        if not isinstance(state.get(k), kind) or isinstance(state[k], bool):
            raise ValueError(damaged.format(f"its {k} is {type(state.get(k)).__name__}, not {kind.__name__}"))
    for k, v in state["args"].items():  # each saved flag's value has the kind of its default
        d = defaults.get(k)
        if d is not None and v is not None and type(v) is not type(d) and {type(v), type(d)} != {int, float}:
            raise ValueError(damaged.format(f"its args.{k} is {v!r}, not a value of --{k.replace('_', '-')}"))
    return state


def resume_args(args):
    """--resume: (checkpoint folder, its trainer state), with the run's hyper-parameters taken from it
    (a flag given again is ignored, with a note); (None, None) without --resume."""
    if not args.resume:
        return None, None
    ckpt = args.resume
    if not os.path.isfile(os.path.join(ckpt, "trainer_state.pt")):  # a run folder: its latest checkpoint
        found = latest_checkpoint(ckpt)
        if not found:
            raise FileNotFoundError(f"--resume {ckpt!r}: no checkpoint there (expected a checkpoint-NNNNNN folder "
                                    f"with trainer_state.pt, or a run folder containing one)")
        ckpt = found
    file = os.path.join(ckpt, "trainer_state.pt")
    defaults = vars(build_parser().parse_args([]))
    state = read_trainer_state(file, defaults)
    saved = dict(state["args"], **check_run_record(args, ckpt, state, defaults))
    for k, v in saved.items():
        if k in RUNTIME_ARGS:  # how to compute: the command line's, else the run's own (not the default)
            if k in INHERITED_RUNTIME_ARGS and getattr(args, k, None) == defaults.get(k):
                setattr(args, k, v)
            continue
        if getattr(args, k, v) not in (v, defaults.get(k)):
            print(f"note | --{k.replace('_', '-')} {getattr(args, k)} ignored: resuming keeps the checkpoint's {v}")
        setattr(args, k, v)
    if "pi_old" not in saved:  # a run from before --pi-old existed took pi_old from the sampler
        args.pi_old = "sampler"
    args.out = args.out or os.path.dirname(os.path.abspath(ckpt))
    return ckpt, state


def check_run_record(args, ckpt, state, defaults):
    """--resume: the checkpoint's run record against its run folder's args.json and the model on disk ->
    the saved args to replace (the absolute paths). One line for a checkpoint of another run, or a model
    gone or changed; --model given again points at the run's model if it has moved."""
    run = state.get("run")
    if not isinstance(run, dict):
        print(f"note | {ckpt} has no record of its model (an older checkpoint): not checked")
        return {}
    args_json = os.path.join(os.path.dirname(os.path.abspath(ckpt)), "args.json")
    folder = common.read_json(args_json) if os.path.isfile(args_json) else {}
    keys = [k for k in ("quant", "quant_method", "lora_r", "lora_alpha") if k in folder and k in run]
    ours, theirs = (", ".join(f"{k} {a[k]}" for k in keys) for a in (run, folder))
    if ours != theirs:
        raise ValueError(f"--resume: {ckpt} is of a run with {ours}, but its folder's args.json is of one with "
                         f"{theirs}: it belongs to another run; resume it from its own run folder")
    model = args.model if args.model != defaults["model"] else run.get("model")
    found = model_fingerprint(model) if isinstance(model, str) and os.path.isdir(model) else None
    if found != run.get("model_fingerprint"):
        what = "is not there" if found is None else "is another model (its config.json or weights differ)"
        raise ValueError(f"--resume: {ckpt} was trained on {run.get('model')}, and {model} {what}: pass --model with "
                         f"the folder of the run's model")
    return {"model": model, **{k: run[k] for k in ("data", "eval_data") if run.get(k)}}


def latest_checkpoint(folder):
    """The run folder's newest checkpoint-NNNNNN (None if it has none)."""
    found = sorted(d for d in os.listdir(folder) if re.fullmatch(r"checkpoint-\d+", d)) if os.path.isdir(folder) else []
    return os.path.join(folder, found[-1]) if found else None


def read_metrics(path, upto):
    """metrics.jsonl's rows up to step `upto`. A cut-off last line (a kill mid-write) is dropped with a note;
    a bad line before it is an error naming the file and line."""
    with open(path) as f:
        lines = [(n, line) for n, line in enumerate(f, 1) if line.strip()]
    rows = []
    for i, (n, line) in enumerate(lines):
        damaged = f"{path} line {n} {{}}: the run log is damaged (fix or delete that line, then resume)"
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            if i + 1 < len(lines):
                raise ValueError(damaged.format("is not JSON")) from None
            print(f"note | {path} line {n} was cut off mid-write: dropped")
            continue
        record = row.get("eval", row) if isinstance(row, dict) else None  # a step's row, or {"eval": {...}}
        step = record.get("step") if isinstance(record, dict) else None
        if not isinstance(step, int) or isinstance(step, bool):
            raise ValueError(damaged.format("has no integer step"))
        if step <= upto:
            rows.append(row)
    return rows


def restore(ckpt, state, model, opt, feedback):
    """Load a checkpoint's adapter, optimizer, controller and RNG states; returns its step."""
    try:
        lora.load_adapter(model, ckpt)
    except ValueError as e:  # a truncated adapter file, say: 02's line, naming the file and a tensor
        raise ValueError(f"--resume: {e} (resume from another checkpoint)") from None
    try:
        opt.load_state_dict(state["optimizer"])
        if feedback is not None and state.get("feedback"):
            feedback.load_state_dict(state["feedback"])
        torch.set_rng_state(state["torch_rng"])
        random.setstate(state["python_rng"])
    except (KeyError, TypeError, ValueError, RuntimeError) as e:
        raise ValueError(f"--resume: {os.path.join(ckpt, 'trainer_state.pt')} does not fit this run's optimizer or "
                         f"generators ({type(e).__name__}): the checkpoint is damaged; resume from another "
                         f"checkpoint") from None
    print(f"resume | {ckpt} | step {state['step']} | hyper-parameters from the checkpoint")
    return state["step"]

# -----------------------------------------------------------------------------
# The run around train's loop


class Run:
    """What train's loop runs inside: the processes, every check, the task, the policy (build_policy, then a
    checkpoint's state on --resume), the run log (RunLog) and stop signals (StopAtStepEnd), the time budget,
    and the evaluations and checkpoints at their intervals and at the end."""

    def __init__(self, args, task=None):
        self.t_start, self.args = time.time(), args
        self.rank, self.world, device = init_distributed(str(common.pick_device(args.device)))
        self.ckpt, self.state = resume_args(args)  # --resume: the checkpoint's hyper-parameters replace the flags
        args.out = args.out or os.path.join("runs", datetime.datetime.now().strftime("%Y%m%d-%H%M%S"))
        check_args(args, self.world, self.ckpt)  # every flag and the run folder, before any work
        if args.gpu_path:
            use_gpu_path(device)
        self.task = task or make_task(args)  # bad data fails here, before the model loads
        # prompts within the context, --batch within the task, memory; --dtype auto's choice and why
        self.dtype_why = check_sizes(args, self.task, self.world, device)
        self.model, self.tok, self.params, self.opt = build_policy(args, device)
        self.feedback = aqn.FeedbackSigma(args.target_entropy, args.sigma_start) \
            if args.aqn and args.aqn_kind == "feedback" else None
        self.start = restore(self.ckpt, self.state, self.model, self.opt, self.feedback) if self.state else 0
        self.options = step_options(args)  # grpo_step's keyword arguments, the LossOptions among them
        self.evaluating = self.rank == 0 and args.eval_size > 0  # rank 0 alone evaluates and writes
        self.stack = contextlib.ExitStack()

    def __enter__(self):
        # The run log holds and writes the run folder (and removes what it wrote if no step is done); Ctrl-C,
        # SIGTERM or SIGHUP lets the step in flight finish, then checkpoints and stops.
        self.log = self.stack.enter_context(RunLog(self.args, self.rank, self.start, self.t_start, self.model,
                                                   self.world, self.dtype_why))
        self.interrupt = self.stack.enter_context(StopAtStepEnd(StopAtStepEnd.REPEAT_S if self.world > 1 else 0.0))
        return self

    def __exit__(self, *exc):
        return self.stack.__exit__(*exc)

    def evaluate(self, step, k):
        if not self.evaluating:
            return None
        common.release_freed_memory()  # the steps' freed activations to the OS: the evaluation's peak does not add to them
        t0 = time.time()
        res = evaluate(self.model, self.tok, self.task, self.task.held, self.args.max_new_tokens, k,
                       self.args.temperature, EVAL_SEED, self.args.eval_chunk, self.args.compile)
        return self.log.eval(res, step, k, time.time() - t0)

    def save(self):  # the new checkpoint, or the last one if the adapter is not finite
        return save_checkpoint(self.args.out, self.done, self.model, self.opt, self.params, self.args, self.feedback,
                               {"first_eval": self.first_eval}) or self.last_ckpt

    def steps(self):
        """The steps to run: from the resumed one to --steps, ending early when the next step would eat the
        time kept for the final evaluation, or after a step that --stop-at or a signal ends."""
        self.first_eval = (self.state or {}).get("first_eval") or self.evaluate(self.start, self.args.eval_k)
        self.last_eval, self.done, self.skipped, self.last_ckpt, self.recent = self.first_eval, self.start, 0, None, []
        self.stopped, self.signum = "steps", 0
        for step in range(self.start, self.args.steps):
            if self.log.out_of_time(self.recent, self.first_eval):
                self.stopped = "time budget"
                return
            yield step
            if self.stopped != "steps":
                return

    def record(self, rec, lr):
        """After a step: the feedback controller, the log, an evaluation or a checkpoint when one is due, and
        whether to stop (--stop-at, or a stop signal on any rank)."""
        args = self.args
        if self.feedback is not None:
            self.feedback.update(rec["entropy"])  # the same global entropy on every rank: sigma stays in step
        self.skipped += rec.pop("skipped")
        self.recent.append(rec["s/step"])
        self.log.step(rec, lr=lr)
        self.done = done = rec["step"]
        if args.eval_every and done % args.eval_every == 0 and done < args.steps:
            self.last_eval = self.evaluate(done, 0) or self.last_eval
        self.signum = self.interrupt.requested()  # asked on every rank: they stop together
        halt = ("interrupt" if self.signum == signal.SIGINT else signal.Signals(self.signum).name) if self.signum \
            else None
        if args.stop_at and done >= args.stop_at:
            halt = "stop-at"
        if self.rank == 0 and ((args.save_every and done % args.save_every == 0) or halt):
            self.last_ckpt = self.save()
        if halt:
            self.stopped = halt

    def finish(self):
        """The end: a last checkpoint and the full evaluation (unless stopped by --stop-at or a signal), the
        summary; a signal then exits 128 + its number, with the line saying how to resume."""
        done = self.done
        if self.stopped in ("steps", "time budget") and self.rank == 0:
            if done > self.start and (self.last_ckpt is None or not self.last_ckpt.endswith(f"{done:06d}")):
                self.last_ckpt = self.save()
            if self.last_eval is None or self.last_eval["step"] != done or "k" not in self.last_eval:
                self.last_eval = self.evaluate(done, self.args.eval_k) or self.last_eval
        summary = self.log.summary(done, self.stopped, self.skipped, self.first_eval, self.last_eval, self.last_ckpt)
        if self.stopped not in ("steps", "time budget", "stop-at"):  # a signal
            raise common.Interrupted(signum=self.signum)  # the run log turns it into the line saying how to resume
        return summary


# -----------------------------------------------------------------------------
# The run log


class RunLog:
    """What a run prints and what rank 0 writes: metrics.jsonl, args.json, summary.json."""
    NO_SIGNAL_STEPS = 20  # steps in a row without signal before the warning

    def __init__(self, args, rank, start, t_start, model, world, dtype_why=""):
        self.args, self.rank, self.t_start, self.flat_steps = args, rank, t_start, 0
        self.metrics = os.path.join(args.out, "metrics.jsonl")
        self.opened, self.steps_logged, self.made = False, 0, []
        self.lock = common.OutputLock(args.out) if rank == 0 else None  # held from __enter__ to __exit__
        self.kept_rows = read_metrics(self.metrics, start) if rank == 0 and os.path.exists(self.metrics) else []
        dtype = str(model.model.embed_tokens.weight.dtype).replace("torch.", "")
        print(f"run | model {args.model} | quant {args.quant} | aqn {args.aqn_kind if args.aqn else 'off'} | "
              f"pi_old {args.pi_old} | "
              f"device {common.model_device(model)} | dtype {dtype}" + (f" ({dtype_why})" if dtype_why else "") +
              f" | steps {args.steps} | B {args.batch} | "
              f"G {args.group} | lr {args.lr:g} | out {args.out}" + (f" | ranks {world}" if world > 1 else ""))

    def out_of_time(self, recent, first_eval):
        """Whether the next step would eat the time kept for the final evaluation (1.5x the first one,
        which also samples pass@k); rank 0's clock decides for everyone."""
        reserve = 1.5 * first_eval["seconds"] if first_eval else 0.0
        next_step = sum(recent[-5:]) / len(recent[-5:]) if recent else 0.0
        late = self.args.time_budget and time.time() - self.t_start + reserve + next_step > self.args.time_budget
        return bool(global_sum([self.rank == 0 and late])[0])

    def _open(self):
        """The run folder's files, at the first record (a run that fails before it writes nothing): args.json,
        and metrics.jsonl cut back to the checkpoint's step (a crash may have logged past it)."""
        os.makedirs(self.args.out, exist_ok=True)
        common.write_json(os.path.join(self.args.out, "args.json"), clean(vars(self.args)))
        if self.kept_rows or os.path.exists(self.metrics):
            common.write_text(self.metrics, "".join(json.dumps(r) + "\n" for r in self.kept_rows))
        self.opened = True

    def _append(self, rec):  # one line of metrics.jsonl, written by rank 0
        if self.rank == 0:
            if not self.opened:
                self._open()
            with open(self.metrics, "a") as f:
                f.write(json.dumps(clean(rec)) + "\n")

    def __enter__(self):
        """The run folder is this run's alone until it ends: a second run on it, or a --resume of it, fails
        at once with one line naming this process."""
        if self.lock:
            self.lock.__enter__()
            self.made = [n for n in RUN_FILES if not os.path.exists(os.path.join(self.args.out, n))]
        return self

    def __exit__(self, kind, exc, tb):
        """A run that ends before its first step removes the run files it wrote, then the folder if it made
        it and nothing else is in it; every other file stays. Ctrl-C (or SIGTERM, SIGHUP) ends in one line
        saying what to run to continue, pasteable into a shell."""
        if self.lock:
            if self.steps_logged == 0:
                for name in self.made:
                    if os.path.exists(os.path.join(self.args.out, name)):
                        os.remove(os.path.join(self.args.out, name))
            self.lock.__exit__(kind, exc, tb)
        if kind is None:
            return False
        if issubclass(kind, KeyboardInterrupt) and not str(exc) and self.rank == 0:  # rank 0 saves, and says so
            found = latest_checkpoint(self.args.out)
            hint = (f"{os.path.basename(found)} saved: continue with  python 05_grpo.py --resume "
                    f"{shlex.quote(self.args.out)}" if found else "no checkpoint yet: nothing to resume")
            raise common.Interrupted(hint, getattr(exc, "signum", signal.SIGINT)) from None
        return False

    def eval(self, res, step, k, seconds):
        res.update(step=step, seconds=seconds, time=time.time() - self.t_start)
        line = f"eval | step {step} | n {res['n']} | greedy {res['greedy']:.3f}"
        line += f" | pass@1 {res['pass@1']:.3f} | pass@{k} {res[f'pass@{k}']:.3f}" if k else ""
        print(line + f" | {seconds:.1f}s", flush=True)
        self._append({"eval": res})
        return res

    def step(self, rec, lr):
        rec.update(lr=lr, time=time.time() - self.t_start)
        self._append(rec)
        self.steps_logged += 1
        self.flat_steps = self.flat_steps + 1 if rec["frac_zero_std"] == 1 else 0
        if not self.args.quiet:
            print(f"step {rec['step']}/{self.args.steps} | reward {rec['reward']:.3f} | acc {rec['acc']:.3f} | "
                  f"entropy {rec['entropy']:.3f} | kl {fmt(rec['kl'])} | clip {rec['clip']:.4f} | len {rec['len']:.1f} | "
                  f"sigma {rec['sigma']:.2e} | sigma_applied {rec['sigma_applied']:.2e} | tok/s {rec['tok/s']:.0f} | "
                  f"s/step {rec['s/step']:.2f}" + (" | no signal (all rewards equal in every group)"
                                                    if self.flat_steps else ""), flush=True)
        if self.flat_steps == self.NO_SIGNAL_STEPS:
            never = rec["acc"] < 0.5
            print(f"warning | {self.flat_steps} steps in a row without signal: the base {'never' if never else 'always'}"
                  f" solves this task (acc {rec['acc']:.2f}), so GRPO learns nothing; try an "
                  f"{'easier' if never else 'harder'} task or another base", flush=True)

    def summary(self, done, stopped, skipped, first_eval, last_eval, last_ckpt):
        if stopped == "time budget" and not self.steps_logged:  # then the run folder's files go (__exit__)
            took = (f" (the first evaluation took {first_eval['seconds']:.0f} s, and 1.5x that is kept for the last "
                    f"one)") if first_eval else ""
            raise ValueError(f"--time-budget {self.args.time_budget:g} s ran out before the first step{took}: nothing "
                             f"to save; raise --time-budget (0: no limit) or lower --eval-size")
        s = {"steps_done": done, "stopped_by": stopped, "skipped_updates": skipped, "wall_s": time.time() - self.t_start,
             "first_eval": first_eval, "final_eval": last_eval, "checkpoint": last_ckpt, "args": vars(self.args)}
        if first_eval and last_eval:
            s["greedy_gain"] = last_eval["greedy"] - first_eval["greedy"]
            why = {"steps": f"--steps {self.args.steps}", "time budget": f"--time-budget {self.args.time_budget:g}s",
                   "stop-at": f"--stop-at {self.args.stop_at}"}.get(stopped, stopped)  # or the signal's name
            print(f"summary | steps {done} | stopped by {why} | greedy {first_eval['greedy']:.3f} -> "
                  f"{last_eval['greedy']:.3f} ({100 * s['greedy_gain']:+.1f} points) | wall {s['wall_s']:.0f}s | "
                  f"out {self.args.out}")
        if self.rank == 0 and self.steps_logged:
            common.write_json(os.path.join(self.args.out, "summary.json"), clean(s))
        return s

# -----------------------------------------------------------------------------
# Files, checks, command line


def clean(obj):
    """NaN/inf -> None, so the files are strict JSON."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: clean(v) for k, v in obj.items()}
    return [clean(v) for v in obj] if isinstance(obj, (list, tuple)) else obj


def fmt(x):
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.4f}"


class StopAtStepEnd:
    """Ctrl-C, SIGTERM or SIGHUP during a run: the step in flight finishes, a checkpoint is written, the run
    stops. A second signal stops at once, unless it comes within repeat_s of the first: under torchrun
    (repeat_s REPEAT_S) that is the same request arriving twice (a terminal or Slurm signals torchrun and
    the ranks, and torchrun passes it on); a single process takes a quick second Ctrl-C as meant. Only the
    main thread can take signals; elsewhere this is a no-op."""
    REPEAT_S = 1.0

    def __init__(self, repeat_s=0.0):
        self.repeat_s = repeat_s

    def __enter__(self):
        self.signum, self.at, self.previous = 0, 0.0, {}
        if threading.current_thread() is threading.main_thread():
            self.previous = {s: signal.signal(s, self._ask) for s in common.STOP_SIGNALS}
        return self

    def _ask(self, signum, frame):
        if self.signum:
            if time.monotonic() - self.at >= self.repeat_s:
                raise common.Interrupted(signum=signum)
            return
        self.signum, self.at = signum, time.monotonic()
        again = "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name
        print(f"interrupt | stopping after this step with a checkpoint ({again} again: stop now)", flush=True)

    def requested(self):
        """The number of the stop signal any rank got (0: none)."""
        return int(global_sum([self.signum], "max")[0])

    def __exit__(self, *exc):
        for s, handler in self.previous.items():
            signal.signal(s, handler)
        return False


RUN_FILES = ("args.json", "metrics.jsonl", "summary.json")


def is_run_file(name):
    """Whether `name` in a run folder is one of the files a run writes."""
    return name in RUN_FILES or bool(re.fullmatch(r"checkpoint-\d+", name))


def check_run_folder(args, ckpt=None):
    """--out: a folder without a run in it (other files are left alone, e.g. a launcher's log), or the
    folder of the run that `ckpt` (--resume) continues. Never a file, the model or a data file, or a
    folder holding them."""
    inputs = [x for x in (args.model, args.data, args.eval_data) if x]
    common.check_out_path(args.out, inputs)
    if os.path.isdir(args.out) and rank_and_world()[0] == 0:
        with common.OutputLock(args.out):  # a live run on this folder is named here, before any work
            common.remove_stale_temps(args.out, is_run_file)  # what a killed run left: half-written checkpoints
    held = sorted(os.listdir(args.out)) if os.path.isdir(args.out) else []
    run = [n for n in held if is_run_file(n)]  # what a run would overwrite
    own = ckpt is not None and os.path.realpath(os.path.dirname(os.path.abspath(ckpt))) == os.path.realpath(args.out)
    if run and not own:
        raise ValueError(f"--out {args.out} already holds a run ({', '.join(run[:3])}): continue it with --resume "
                         f"{args.out} (without --out), or choose a new --out")


def check_prompts_fit(task, tok, context, max_new_tokens, problems=()):
    """Every held-out and file problem's prompt (and those of `problems`) plus --max-new-tokens fits the
    model's context, checked at the start with the problem's file line (not found steps later as 'prompt
    1'). Returns the longest prompt's length in tokens."""
    longest = 0
    for p in [*task.held, *getattr(task, "train", []), *problems]:
        n = len(tok.encode(task.prompt(p)))
        if n + max_new_tokens > context:
            where = p.get("where", f"question {p['question'][:40]!r}")
            raise ValueError(f"{where}: the prompt has {n} tokens; with --max-new-tokens {max_new_tokens} that exceeds "
                             f"the model's context of {context} (shorten or drop it, or lower --max-new-tokens)")
        longest = max(longest, n)
    return longest


def policy_dtype(args, device, cfg=None):
    """--dtype as (torch dtype, why). auto: bfloat16 on CUDA and on --gpu-path's CUDA code path; on a CPU
    bfloat16 where it is native and the model wide enough to gain, else float32 (common.pick_dtype)."""
    if args.dtype == "auto" and args.gpu_path:
        return torch.bfloat16, "auto: --gpu-path"
    if args.dtype == "auto" and cfg is None:
        cfg = rollout.ModelConfig.from_dict(common.find_weight_files(args.model)[0])
    return common.pick_dtype(args.dtype, device, cfg.hidden_size if cfg else None)


UPDATE_MEMORY_CPU = 2 ** 30  # --micro-batch auto on a CPU: the update's activations within 1 GiB


def update_bytes_per_row(cfg, T, b, grad_checkpoint):
    """About the bytes the update keeps per row of T tokens (b bytes per activation) for backward: a token's
    numbers autograd keeps per layer (bench_update_memory.py --per-token: 316 KiB at 7B widths in bf16) and
    SDPA's fp32 additive mask, (rows, 1, G*T, T); a checkpointed layer keeps only its input."""
    C, I, L = cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers
    layer = (18 * C + 5 * I) * b + cfg.num_attention_heads // cfg.num_key_value_heads * T * 4
    return T * (L * (C * b if grad_checkpoint else layer) + layer)


def auto_micro_batch(cfg, rows, T, b, grad_checkpoint, device):
    """--micro-batch auto: all `rows` (T tokens each, b bytes per activation) when their activations fit the
    update's budget, UPDATE_MEMORY_CPU on a CPU or half the free memory on a GPU, else as many as do (>= 1)."""
    free = None if torch.device(device).type == "cpu" else common.free_memory(device)
    budget = UPDATE_MEMORY_CPU if free is None else free // 2
    per_row = update_bytes_per_row(cfg, T, b, grad_checkpoint)  # 0 for a rank with no rows
    return max(1, min(rows, int(budget // max(per_row, 1))))


def micro_batch_rows(micro_batch, rows, model, T):
    """Rows per forward/backward of the update: --micro-batch, all `rows` for 0, auto_micro_batch for auto."""
    if micro_batch != "auto":
        return min(micro_batch or rows, rows)
    if not isinstance(getattr(model, "config", None), rollout.ModelConfig):  # a policy without widths to go by
        return rows
    return auto_micro_batch(model.config, rows, T, model.model.embed_tokens.weight.element_size(),
                            model.grad_checkpoint, common.model_device(model))


def run_memory(args, cfg, P, world, b, device="cpu"):
    """About the bytes a run allocates beyond the model's weights (prompts up to P tokens, b bytes per
    activation) -> (the adapters', {phase: its peak}); the adapters and one phase live at once. Sampling a
    step or an evaluation chunk is stage 03's generate_memory; the update keeps each layer's activations of
    its rows for backward; the adapters are fp32 with their gradients and AdamW's two moments."""
    C, I, L, N = cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers, args.max_new_tokens
    rows = -(-args.batch // world) * args.group  # this rank's rows of a step
    k = args.eval_k  # evaluate()'s rows per generate() call: greedy, then k samples of fewer prompts
    eval_rows = max(min(args.eval_size, args.eval_chunk), min(args.eval_size, max(1, args.eval_chunk // max(k, 1))) * k)
    T = P + N
    per_row = update_bytes_per_row(cfg, T, b, args.grad_checkpoint)
    update_rows = auto_micro_batch(cfg, rows, T, b, args.grad_checkpoint, device) if args.micro_batch == "auto" \
        else min(args.micro_batch or rows, rows)  # auto as the update decides it, at full length
    logits = 4 * min(rollout.LOGITS_CHUNK_BYTES, update_rows * T * cfg.vocab_size * 4)  # a chunk and its gradients
    q_out, kv_out = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    adapter_numbers = args.lora_r * L * (2 * (C + q_out) + 2 * (C + kv_out) + 3 * (C + I))  # A, B of 7 projections
    return 16 * adapter_numbers, {
        f"sampling --batch {args.batch} x --group {args.group}": rollout.generate_memory(cfg, rows, P, N, b),
        f"evaluating {eval_rows} rows at a time (--eval-chunk, --eval-k)":
        rollout.generate_memory(cfg, eval_rows, P, N, b) if args.eval_size else 0,
        f"the update, {update_rows} rows at a time (--micro-batch)": update_rows * per_row + logits}


def check_sizes(args, task, world, device):
    """Before the model loads: every prompt within the context (check_prompts_fit), what run_memory
    estimates within the memory free on the device, and --batch within what the task gives a step."""
    raw = common.find_weight_files(args.model)[0]
    cfg, tok = rollout.ModelConfig.from_dict(raw), rollout.load_tokenizer(args.model, raw)
    P = check_prompts_fit(task, tok, cfg.max_position_embeddings, args.max_new_tokens,
                          task.problems(args.seed, 0, min(args.batch, 64)))  # the longest prompt, in tokens
    dtype, why = policy_dtype(args, device, cfg)
    args.dtype = str(dtype).replace("torch.", "")  # the choice goes into args.json: a resume computes alike
    adapters, phases = run_memory(args, cfg, P, world, dtype.itemsize, device)
    largest = max(phases, key=phases.get)
    what = largest if phases[largest] > adapters else f"--lora-r {args.lora_r}'s adapters"
    common.check_memory_fits(adapters + phases[largest], device, f"this run (mostly {what})")
    given = len(task.problems(args.seed, 0, args.batch))  # drawn after the memory check bounded --batch
    if given < args.batch:
        raise ValueError(f"--batch {args.batch} is more than --task {args.task} gives a step ({given} problems): "
                         f"lower --batch to {given} or less")
    return why


MAX_EVAL_SIZE = 100_000  # every evaluation samples each held-out problem (greedy, then --eval-k times)


def check_args(args, world, ckpt=None):
    """What argparse's ranges cannot see: combinations of flags, the model folder and the run folder."""
    if args.batch < 1 or args.group < 2:
        raise ValueError(f"need --batch >= 1 and --group >= 2 (got {args.batch}, {args.group}): GRPO compares "
                         f"samples within a group")
    if args.steps < 1 or args.mu < 1 or (args.micro_batch != "auto" and args.micro_batch < 0):
        raise ValueError(f"need --steps >= 1, --mu >= 1 and --micro-batch >= 0 (0: all rows at once), got "
                         f"{args.steps}, {args.mu}, {args.micro_batch}")
    if args.aqn and args.aqn_kind != "feedback":
        aqn.check_sigma_range(args.sigma_start, args.sigma_end, args.aqn_kind)
    if args.quant_method != "rtn" and args.quant != "nvfp4":
        raise ValueError(f"--quant-method {args.quant_method} is a rounding of NVFP4 weights: it needs --quant nvfp4 "
                         f"(got --quant {args.quant})")
    if args.temperature < rollout.MIN_TEMPERATURE:
        raise ValueError(f"--temperature {args.temperature:g} is too small to sample with: need >= "
                         f"{rollout.MIN_TEMPERATURE:g}")
    if args.train_norms and args.beta > 0:
        raise ValueError("--train-norms with --beta > 0 is not supported: the KL reference (the base under "
                         "lora_disabled) would keep the trained gains; drop one of the two")
    if args.batch < world:
        raise ValueError(f"--batch {args.batch} is smaller than the number of ranks ({world}): every rank "
                         f"needs at least one prompt group; raise --batch or launch fewer processes")
    try:  # fail before the data and the model load
        common.find_weight_files(args.model)
    except FileNotFoundError as e:
        raise FileNotFoundError(f"--model {args.model!r} is not a model folder ({e})") from None
    check_run_folder(args, ckpt)


def update_options(args):
    """policy_update's keyword arguments from the command line (its options as LossOptions and UpdateOptions)."""
    return {"group": args.group, "max_new_tokens": args.max_new_tokens, "temperature": args.temperature,
            "loss_options": LossOptions.from_args(args), "update_options": UpdateOptions.from_args(args)}


def step_options(args):
    """grpo_step's keyword arguments from the command line."""
    return {**update_options(args), "batch": args.batch, "seed": args.seed, "mask_truncated": args.mask_truncated,
            "compiled": args.compile}


ROOT = os.path.dirname(os.path.abspath(__file__))
TINY_MODEL = os.path.join(ROOT, "assets", "tiny-qwen")


def build_parser():
    N = common.number  # each number's allowed range: what makes no sense is refused before any work
    p = common.ArgumentParser(description="GRPO with LoRA on a quantized base and AQN (QeRL)")
    # model and data
    p.add_argument("--model", default=TINY_MODEL, help="Hugging Face model folder (default: the bundled tiny model)")
    p.add_argument("--task", choices=list(TASKS), default="arithmetic",
                   help="; ".join(f"{name}: {getattr(cls, 'help', '')}" for name, cls in TASKS.items()))
    p.add_argument("--data", default=None, help="gsm8k: the GSM8K-style JSONL file to train on")
    p.add_argument("--eval-data", default=None, help="gsm8k: held-out JSONL (default: a slice of --data is held out)")
    p.add_argument("--digits", type=N(int, 1, 100), default=3, help="arithmetic: max digits per operand")
    p.add_argument("--nops", type=N(int, 1, 100), default=2, help="arithmetic: number of operations")
    p.add_argument("--system", choices=("auto", "paper", "none"), default="auto",
                   help="system prompt: the paper's instruction, none, or auto (the instruction unless "
                   "config.json says \"qerl_prompt\": \"bare\", as the bundled model's does)")
    p.add_argument("--quant", choices=quantize.QUANT_CHOICES, default="nvfp4")
    p.add_argument("--quant-method", choices=quantize.NVFP4_METHODS, default="rtn",
                   help="NVFP4 rounding: rtn (compressed-tensors) or 4over6 (per block, max -> 6 or 4)")
    p.add_argument("--device", default=None, help="cpu / cuda (default: autodetect)")
    p.add_argument("--compile", action="store_true", help="sample with stage 03's torch.compile'd decode step "
                   "(compiles once per batch/length bucket: tens of seconds on a CPU; pays off on long runs and GPUs)")
    p.add_argument("--dtype", choices=common.DTYPES, default="auto",
                   help="activation dtype; auto: bfloat16 on CUDA, and on a CPU with native bf16 (AMX, AVX512-BF16) "
                   f"for a model of hidden size {common.AUTO_BF16_MIN_HIDDEN} or more, else float32")
    # AQN
    p.add_argument("--aqn", action=argparse.BooleanOptionalAction, default=True, help="adaptive quantization noise")
    p.add_argument("--aqn-kind", default="exp", choices=aqn.SIGMA_KINDS)
    p.add_argument("--sigma-start", type=N(above=0), default=1e-2)
    p.add_argument("--sigma-end", type=N(above=0), default=5e-4)
    p.add_argument("--num-stages", type=N(int, 1), default=10)
    p.add_argument("--target-entropy", type=N(above=0), default=0.15, help="aqn-kind feedback: entropy to hold")
    # GRPO
    p.add_argument("--steps", type=N(int, 1), default=750, help="planned steps (sets the LR and AQN schedules)")
    p.add_argument("--batch", type=N(int, 1), default=16, help="prompts per step")
    p.add_argument("--group", type=N(int, 2), default=8, help="samples per prompt (G)")
    p.add_argument("--max-new-tokens", type=N(int, 1), default=42)
    p.add_argument("--temperature", type=N(above=0), default=1.0,
                   help="sampling temperature (> 0: at 0 a prompt's G samples are all the same: no signal)")
    p.add_argument("--eps-low", type=N(float, 0, below=1), default=LossOptions.eps_low)
    p.add_argument("--eps-high", type=N(float, 0), default=LossOptions.eps_high)
    p.add_argument("--loss-agg", default=LossOptions.loss_agg, choices=LOSS_AGGS)
    p.add_argument("--no-std-scale", action="store_true", help="advantage r - mean only (Dr. GRPO)")
    p.add_argument("--mu", type=N(int, 1), default=UpdateOptions.mu, help="policy updates per batch")
    p.add_argument("--pi-old", choices=list(PI_OLD), default=UpdateOptions.pi_old, help="pi_old in the ratio: "
                   + "; ".join(f"{k}: {v}" for k, v in PI_OLD.items()))
    p.add_argument("--beta", type=N(float, 0), default=LossOptions.beta, help="k3 KL to the base (reference) policy")
    p.add_argument("--entropy-coef", type=N(float, 0), default=LossOptions.entropy_coef, help="entropy bonus coefficient")
    # memory (the update at real scale; docs/scaling.md)
    p.add_argument("--micro-batch", type=lambda v: v if v == "auto" else N(int, 0)(v), default="auto",
                   help="rows per forward/backward of the update, gradients accumulated before the one optimizer "
                   "step (0: all rows at once; auto: as many as keep the update's activations within "
                   f"{UPDATE_MEMORY_CPU // 2 ** 20} MiB on a CPU, half the free memory on a GPU)")
    p.add_argument("--grad-checkpoint", action="store_true", help="activation checkpointing per decoder layer "
                   "in the update (less memory, one more forward)")
    p.add_argument("--gpu-path", action="store_true", help="on the CPU, run what CUDA runs: NVFP4Linear through "
                   "the Triton kernel (interpreted), no merged sampling weights, bfloat16 by default")
    p.add_argument("--mask-truncated", action="store_true", help="completions cut off at --max-new-tokens "
                   "(no EOS) leave the loss; their rewards still count in their group's advantages")
    p.add_argument("--train-norms", action="store_true", help="train the RMSNorm gains of every decoder layer "
                   "(input/post-attention, fp32) with the adapters; saved as PEFT modules_to_save")
    # optimisation
    p.add_argument("--lr", type=N(above=0), default=1e-3)
    p.add_argument("--warmup", type=N(int, 0), default=10, help="warmup steps")
    p.add_argument("--min-lr-ratio", type=N(float, 0, 1), default=0.1, help="cosine decays to this fraction of --lr")
    p.add_argument("--grad-clip", type=N(above=0), default=UpdateOptions.grad_clip, help="max gradient norm")
    p.add_argument("--lora-r", type=N(int, 1), default=16)
    p.add_argument("--lora-alpha", type=N(int, 1), default=32)
    p.add_argument("--seed", type=N(int, 0), default=0)
    # evaluation, output
    p.add_argument("--eval-size", type=N(int, 0, MAX_EVAL_SIZE), default=500,
                   help=f"held-out problems (0: no evaluation; at most {MAX_EVAL_SIZE:,})")
    p.add_argument("--eval-every", type=N(int, 0), default=100,
                   help="greedy evaluation every N steps (0: at the start and end only)")
    p.add_argument("--eval-k", type=N(int, 0), default=8, help="pass@k at --temperature at the start and end (0: off)")
    p.add_argument("--eval-chunk", type=N(int, 1), default=1024, help="rows per generate() call in evaluation")
    p.add_argument("--out", default=None, help="run folder (default runs/<timestamp>)")
    p.add_argument("--resume", default=None, help="checkpoint (or run) folder to continue exactly")
    p.add_argument("--save-every", type=N(int, 0), default=100, help="checkpoint every N steps (0: at the end only)")
    p.add_argument("--time-budget", type=N(float, 0), default=540, help="stop after this many seconds incl. the "
                   "final evaluation (0: no limit)")
    p.add_argument("--stop-at", type=N(int, 0), default=0, help="stop after this step with a checkpoint, as if "
                   "interrupted (for testing --resume)")
    p.add_argument("--quiet", action="store_true", help="no per-step lines")
    return p


def main(argv=None):
    args = build_parser().parse_args(argv)
    rank = int(os.environ.get("RANK", "0"))  # torchrun's: rank 0 alone prints; errors still reach stderr
    with open(os.devnull, "w") as devnull, contextlib.redirect_stdout(devnull if rank > 0 else sys.stdout):
        train(args)


if __name__ == "__main__":
    code = common.run_cli(main)
    if dist.is_initialized():
        leave_distributed(code)
    sys.exit(code)
