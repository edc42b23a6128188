"""Stage 05: GRPO with LoRA on a 4-bit base, with Adaptive Quantization Noise (the QeRL loop).

A step: B prompts x G samples of the NVFP4 base + LoRA under AQN's noise -> rewards -> group
advantages -> the clipped surrogate on the clean policy -> AdamW on the adapters. Part 2: the other
pi_old readings, the ratio per sequence (GSPO), aggregations and loss terms, the run's checks and its
command line.
    python qerl/train.py [--show-step]  # the tiny model learns arithmetic; or one group by hand
"""
import importlib
import collections
import contextlib
import dataclasses
import functools
import math
import time

import os
import sys

if __package__ in (None, ""):  # run as a file (python qerl/train.py): the checkout heads sys.path, not qerl/
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

import torch

from qerl import checkpoints
from qerl import devices
from qerl import distributed
from qerl import grpo_variants  # what the loop calls besides the method: fast paths, checks, sampler options
from qerl import memory
from qerl import runs

from qerl import quantize
from qerl import lora
from qerl import rollout
from qerl import aqn

stage05 = importlib.import_module("05_grpo")  # the stage this module extends: its definitions, used as they are
lr_factor = stage05.lr_factor

# ---- The policy: the frozen (quantized) base, fresh LoRA adapters, AdamW on the adapters alone
MORE_PARAMS = []  # (model, args) -> more parameters to train (Part 2: --train-norms)

def build_policy(args, device):
    """-> (model, tok, params, opt); the adapters depend on --seed alone (alike on every rank)."""
    dtype = policy_dtype(args, device)[0]  # --dtype auto: devices.pick_dtype
    model, tok = rollout.load_model(args.model, args.quant, dtype, device, args.quant_method)
    model.grad_checkpoint = args.grad_checkpoint  # acts in the update (it needs gradients)
    quantize.keep_dequantized(model, merge_for_sampling(device))  # a CPU rebuilds each W once
    lora.add_lora(model, r=args.lora_r, alpha=args.lora_alpha,
                  generator=torch.Generator().manual_seed(args.seed))
    params = lora.lora_parameters(model) + [p for more in MORE_PARAMS for p in more(model, args)]
    opt = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.99), weight_decay=0.0)
    return model, tok, params, opt


def step_sigma(args, step):  # AQN's noise at `step`: 04's schedule (exp: the official code's)
    return aqn.sigma_schedule(step, args.steps, args.sigma_start, args.sigma_end, args.num_stages,
                              args.aqn_kind) if args.aqn else 0.0

# ---- Sampling under AQN (noise on the RMSNorm gains, stage 04), rewards and group advantages
def merge_for_sampling(device):  # CUDA's kernel reads 4 bits; merged W would cost the model's size
    # a CPU samples on merged W + s B A (02's lora_merged): one matmul a layer, not four
    return torch.device(device).type == "cpu" and not quantize.NVFP4Linear.kernel_on_cpu

def merged_sampling_weights(model, enabled=True):
    return lora.lora_merged(model) if enabled else contextlib.nullcontext(model)

def sample_groups(model, tok, prompts, step, sigma, *, rank=0, group=8, max_new_tokens=42,
                  temperature=1.0, seed=0, compiled=False, noise="absolute", site="norms", draw=0):
    """-> (03's Rollout, `group` completions a prompt, prompt-major; the RMS of AQN's noise)."""
    device, gen_seed = devices.model_device(model), seed * 1_000_003 + step  # resumes sample alike
    gen = torch.Generator(device=device).manual_seed(gen_seed)
    # the noise first, then the merge: merged weights hold noisy LoRA matrices (a LoRA site)
    with torch.inference_mode(), aqn.aqn_noise(model, sigma, gen, kind=noise, site=site) as noisy, \
            merged_sampling_weights(model, merge_for_sampling(device)):
        if rank > 0 or draw > 0:  # every rank drew the same noise; each samples its own stream
            gen = torch.Generator(device=device).manual_seed(gen_seed + rank * 2**40 + draw * 2**50)
        samples = rollout.generate(model, prompts, num_samples=group, max_new_tokens=max_new_tokens,
                                   temperature=temperature, eos_token_ids=tok.eos_token_ids,
                                   generator=gen, tokenizer=tok, compiled=compiled)
    return samples, noisy["applied_std"]

def score(task, problems, texts, group):  # each completion's reward (N,), how many are correct
    rows = [p for p in problems for _ in range(group)]  # (N,) the problem of each row
    rewards = torch.tensor([task.reward(p, text) for p, text in zip(rows, texts)])  # (N,)
    return rewards, sum(task.correct(p, text) for p, text in zip(rows, texts))

def group_advantages(rewards, group, scale_std=True, eps=1e-4):
    """rewards (B*G,) prompt-major -> (r - group mean) / (group std + eps); Dr. GRPO: no std."""
    r = rewards.float().view(-1, group)  # (B, G)
    adv = r - r.mean(dim=1, keepdim=True)  # (B, G)
    if scale_std:
        std = r.std(dim=1, keepdim=True) if group > 1 else torch.zeros_like(r[:, :1])  # (B, 1)
        adv = adv / (std + eps)
    return adv.reshape(-1)  # (B*G,)

# ---- The loss: the clipped surrogate, token-mean
@dataclasses.dataclass(frozen=True)
class LossOptions:  # grpo_loss's options, each the flag of its name (eps_low: --eps-low)
    eps_low: float = 0.2  # the ratio is clipped to [1 - eps_low, 1 + eps_high]: DAPO's
    eps_high: float = 0.28  # clip-higher leaves a rare token room to rise
    loss_agg: str = "token-mean"  # a key of LOSS_AGGS
    beta: float = 0.0  # the KL term's weight (Part 2); 0 in the paper
    entropy_coef: float = 0.0  # the entropy bonus's weight (Part 2)
    ratio_level: str = "token"  # a key of RATIOS: the ratio per token (Part 2: per sequence, GSPO)
    @classmethod
    def from_args(cls, args):  # --eps-low / --eps-high not given (None): the --ratio-level's own
        given = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls)}
        level = RATIOS[given["ratio_level"]]
        return cls(**{**given, **{k: getattr(level, k) for k in ("eps_low", "eps_high") if given[k] is None}})

def token_mean(values, mask, max_new_tokens=None, denom=None):  # DAPO's: a long answer weighs more
    return (values * mask).sum() / (mask.sum().clamp(min=1) if denom is None else denom)

LOSS_AGGS = {"token-mean": (token_mean, lambda n: max(n["tokens"], 1.0))}  # (reduce, denom)

# Part 2 fills: loss inputs and terms; statistics (token means over the step, MAX_STATS: maxima)
LOSS_INPUTS, LOSS_TERMS, LOSS_STATS, BATCH_STATS, MAX_STATS = [], [], [], [], {}

# ---- The ratio (--ratio-level): RATIOS[level].log_ratio(logp, old_logp, mask) -> log pi_theta / pi_old (N, T)
class Ratio(collections.namedtuple("Ratio", "help log_ratio eps_low eps_high check", defaults=(None,))):
    """A level of the importance ratio: one entry of RATIOS, which --ratio-level offers (its choices are
    read when the parser is built), so a new level is one entry.
      help       the line --ratio-level's help shows for it.
      log_ratio  (logp, old_logp, mask) -> the log of the ratio at each token (N, T), logp's gradient flowing
                 through it. logp (N, T): pi_theta's log-probs, with gradient; old_logp (N, T): --pi-old's
                 reading, without; mask (N, T) float: 1 on the loss's tokens (a row may be all 0). Finite
                 everywhere; off the mask never read. clipped_surrogate clips exp(log_ratio) to
                 [1 - eps_low, 1 + eps_high] at each token and takes min(r A, clip(r) A); --loss-agg reduces
                 it. At old_logp = logp.detach() the ratio is 1 and the gradient the plain policy gradient's.
      eps_low, eps_high   the clip range of a run at this level that does not give --eps-low / --eps-high.
      check      None, or check(args): raise ValueError, one line naming the conflict and the fix, for a
                 flag this level cannot take; print a "note | ..." line for one that makes it moot. check_args
                 runs it before any work."""
    __slots__ = ()

RATIOS = {"token": Ratio(  # Part 2: sequence (GSPO)
    "per token, pi_theta(y_t|y_<t) / pi_old(y_t|y_<t), as PPO, GRPO, DAPO and the paper",
    lambda logp, old_logp, mask: logp - old_logp, LossOptions.eps_low, LossOptions.eps_high)}

def clipped_surrogate(logp, old_logp, adv, mask, options=LossOptions()):
    """Per token (N, T): the surrogate min(r A, clip(r) A), the ratio r (--ratio-level's) and where the
    clamp, not the ratio, set the surrogate (no gradient there). mask (N, T) float."""
    low, high = 1 - options.eps_low, 1 + options.eps_high
    ratio = torch.exp(RATIOS[options.ratio_level].log_ratio(logp, old_logp, mask))  # (N, T) pi_theta / pi_old
    a = adv.view(-1, 1)  # (N, 1)
    surr = torch.minimum(ratio * a, ratio.clamp(low, high) * a)  # (N, T)
    with torch.no_grad():
        clipped = ((ratio < low) & (a < 0)) | ((ratio > high) & (a > 0))  # (N, T)
    return surr, ratio, clipped

def grpo_loss(logp, old_logp, adv, mask, options=LossOptions(), *, weight=None, max_new_tokens=None,
              denom=None, **inputs):
    """The clipped surrogate to minimise, and its statistics. At old_logp = logp.detach() the
    gradient is REINFORCE's: -mean_t A grad log pi_theta, the group's mean reward the baseline."""
    mask = mask.float()
    surr, ratio, clipped = clipped_surrogate(logp, old_logp, adv, mask, options)  # (N, T) each
    per_tok = -surr if weight is None else -surr * weight  # (N, T)
    for term in LOSS_TERMS:
        per_tok = term(per_tok, logp, options, **inputs)  # (N, T)
    loss = LOSS_AGGS[options.loss_agg][0](per_tok, mask, max_new_tokens, denom)  # a scalar
    with torch.no_grad():
        stats = {"clip": float((clipped.float() * mask).sum() / mask.sum().clamp(min=1))}
        for stat in LOSS_STATS:
            stats.update(stat(logp, old_logp, ratio, mask, **inputs))
    return loss, stats

# ---- pi_old (--pi-old): read(current, sampler, before, options) -> (pi_old, weight or None) (N, T)
PiOld = collections.namedtuple("PiOld", "help read needs_before", defaults=(False,))  # --mu > 1
PI_OLD = {"trainer": PiOld(  # the clean policy before the update; Part 2: sampler, tis, tis-mask
    "the clean policy being trained (the official code's): at --mu 1 the ratio is 1",
    lambda current, sampler, before, o: (current if before is None else before, None), True)}

@dataclasses.dataclass(frozen=True)
class UpdateOptions:  # policy_update's options besides the loss's, flags as in LossOptions
    pi_old: str = "trainer"  # a key of PI_OLD
    tis_cap: float = 2.0  # --pi-old tis and tis-mask's bound on pi_trainer / pi_sampler (Part 2)
    mu: int = 1  # optimizer steps on each batch
    micro_batch: int | str = "auto"  # rows per forward/backward ("auto": memory.py; 0: all)
    grad_clip: float = 1.0  # max gradient norm
    no_std_scale: bool = False  # advantages r - mean only (Dr. GRPO)
    @classmethod
    def from_args(cls, args):
        return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)})

# ---- The update: losses divide by global counts, so micro-batches and ranks add up exactly
def micro_batch_loss(model, prompts, ids, mask, sampler_logp, before_logp, adv, denom, temperature,
                     max_new_tokens, options, opts):
    """Loss and statistics of one micro-batch (its share of the step's: denom is global)."""
    logp, ent = rollout.sequence_logprobs(model, prompts, ids, mask, temperature=temperature,
                                          entropy=options.entropy_coef != 0)  # (mb, t), or None
    logp = logp.float()
    old_logp, weight = PI_OLD[opts.pi_old].read(logp.detach(), sampler_logp, before_logp, opts)
    inputs = {"entropy": None if ent is None else ent.float()}  # (mb, t) or None
    for more in LOSS_INPUTS:
        inputs.update(more(model, prompts, ids, mask, temperature, options))
    loss, stats = grpo_loss(logp, old_logp, adv, mask, options, weight=weight,
                            max_new_tokens=max_new_tokens, denom=denom, **inputs)
    for stat in BATCH_STATS:
        stats.update(stat(logp.detach(), sampler_logp, before_logp, mask, opts))
    return loss, stats

def policy_update(model, opt, params, prompt_ids, ids, mask, sampler_logp, rewards, *, group,
                  max_new_tokens, loss_options=LossOptions(), update_options=UpdateOptions(),
                  temperature=1.0):
    """`mu` AdamW steps on this rank's rows (whole groups) -> loss, grad norm and statistics."""
    opts = update_options
    adv = group_advantages(rewards, group, not opts.no_std_scale).to(devices.model_device(model))
    # a group of equal rewards (zero advantage) and a row without loss tokens: nothing to train
    has_signal = (rewards.view(-1, group).std(1) > 0).repeat_interleave(group)  # (N,)
    kept_rows = (has_signal & (mask.sum(1) > 0)).nonzero().squeeze(1).tolist()
    t_max = int(mask[kept_rows].sum(1).max()) if kept_rows else 0  # their longest completion
    kept_ids, kept_mask = ids[kept_rows, :t_max], mask[kept_rows, :t_max]  # (n, t_max) each
    kept_sampler, kept_adv = sampler_logp[kept_rows, :t_max], adv[kept_rows]  # (n, t_max), (n,)
    kept_prompts = [prompt_ids[i] for i in kept_rows]
    tokens, sequences, kept_all, rows, flat = distributed.global_sum([  # over torchrun's ranks
        float(kept_mask.sum()), float((kept_mask.sum(1) > 0).sum()), len(kept_rows), mask.shape[0],
        float((~has_signal).sum())])
    denom = LOSS_AGGS[loss_options.loss_agg][1](
        {"tokens": tokens, "sequences": sequences, "rows": rows, "max_new_tokens": max_new_tokens})
    out = {"loss": 0.0, "grad_norm": 0.0, "skipped": "", "kept_rows": len(kept_rows),
           "kept_rows_all": kept_all, "rows_all": rows, "flat_all": flat}
    unmeasured = None if kept_all and kept_rows else no_token_stats(loss_options, opts)
    if kept_all == 0:  # no rank has a group with signal: nobody updates
        return {**out, **unmeasured}
    slice_rows = memory.micro_batch_rows(opts.micro_batch, max(len(kept_rows), 1), model,
                                         max(map(len, kept_prompts), default=0) + t_max)
    slices = [slice(i, i + slice_rows) for i in range(0, len(kept_rows), slice_rows)]
    before = grpo_variants.policy_logprobs(model, kept_prompts, kept_ids, kept_mask, slices,
        temperature) if PI_OLD[opts.pi_old].needs_before and opts.mu > 1 else None  # (n, t_max)
    for _ in range(opts.mu):
        opt.zero_grad(set_to_none=True)
        loss_sum, means = 0.0, runs.StepStats(MAX_STATS, unmeasured)
        for part in slices:
            t = int(kept_mask[part].sum(1).max())  # this slice's longest completion
            loss, stats = micro_batch_loss(
                model, kept_prompts[part], kept_ids[part, :t], kept_mask[part, :t],
                kept_sampler[part, :t], None if before is None else before[part, :t],
                kept_adv[part], denom, temperature, max_new_tokens, loss_options, opts)
            if torch.isfinite(loss):  # a non-finite loss skips the step below
                loss.backward()  # the slices' gradients add up in .grad
            loss_sum += float(loss.detach())
            means.add(stats, float(kept_mask[part].sum()) / max(tokens, 1.0))  # its token share
        loss_sum = means.global_totals(loss_sum, out)  # summed (maximised) over ranks, into out
        if not math.isfinite(loss_sum):  # the same verdict on every rank
            out["skipped"] = f"loss is {loss_sum}"
            break
        distributed.sum_grads(params)
        grad_norm = float(torch.nn.utils.clip_grad_norm_(params, opts.grad_clip))
        if not math.isfinite(grad_norm):
            out["skipped"] = f"gradient norm is {grad_norm}"
            break
        opt.step()
        out["loss"], out["grad_norm"] = loss_sum, grad_norm
    opt.zero_grad(set_to_none=True)
    return out

# ---- Evaluation: the clean policy (no AQN noise), greedy, on held-out problems
@torch.inference_mode()
def evaluate(model, tok, task, problems, max_new_tokens, chunk=512, compiled=False, outcomes=None):
    """-> greedy pass@1 and the answers' mean task.reward (partial credit), summed over ranks; `outcomes`, a
    list, gets whether each of this rank's problems was answered right."""
    prompts, texts = [tok.encode(task.prompt(p)) for p in problems], []
    with merged_sampling_weights(model, merge_for_sampling(devices.model_device(model))):
        for i in range(0, len(prompts), chunk):  # `chunk` rows a generate() call (memory)
            texts += rollout.generate(model, prompts[i:i + chunk], max_new_tokens=max_new_tokens,
                                      temperature=0.0, eos_token_ids=tok.eos_token_ids,
                                      tokenizer=tok, compiled=compiled).texts
    right_each = [bool(task.correct(p, t)) for p, t in zip(problems, texts)]
    if outcomes is not None:
        outcomes += right_each
    right, reward = sum(right_each), sum(map(task.reward, problems, texts))
    reward, n, greedy = distributed.global_sum([reward, len(problems), right])
    return {"n": int(n), "greedy_correct": int(greedy), "greedy": greedy / max(n, 1),
            "greedy_reward": reward / max(n, 1)}

# ---- The run: setup, then each step's LR, sigma, samples, rewards, update, log line; Part 2 fills:
SIGMA_CONTROLLERS = {}  # --aqn-kind: args -> sigma's controller (.sigma, .update(entropy))
REFILLS = []  # (args, task, ..., correct) -> (problems, samples, rewards, correct, record)
LOSS_MASKS = []  # (args, mask (N, T), truncated (N,)) -> the loss's mask (N, T)

def train(args, task=None):
    """The GRPO run (`task`: a tasks.Task, else --task's) -> its summary (<out>/summary.json)."""
    t_start, device = time.time(), str(devices.pick_device(args.device))
    rank, world, device = distributed.init(device, 60 * args.dist_timeout)  # torchrun's, or (0, 1)
    ckpt, state, task, dtype_why = check_run(args, task, world, device)  # all checks, before work
    if (finished := checkpoints.finished_run(args, ckpt, state)) is not None:
        return finished  # a resume of a finished run adds nothing
    model, tok, params, opt = build_policy(args, device)
    controller = SIGMA_CONTROLLERS.get(args.aqn_kind, lambda args: None)(args) if args.aqn else None
    start = checkpoints.restore(ckpt, state, functools.partial(lora.load_adapter, model), opt,
                                controller) if state else 0
    update_args = dict(loss_options=LossOptions.from_args(args), temperature=args.temperature,
                       update_options=UpdateOptions.from_args(args),
                       max_new_tokens=args.max_new_tokens)
    fast = grpo_variants.fast_paths(model, device, args.compile, merge_for_sampling(device))
    with runs.RunLog(args, rank, start, t_start, model, world, dtype_why, parser_defaults(), fast) \
            as log, runs.StopAtStepEnd(runs.StopAtStepEnd.REPEAT_S if world > 1 else 0.0) as stop:
        run = milestones(log, stop, state, model, tok, task, opt, params, controller)  # Part 2
        for step in run.steps():  # --time-budget ends them early enough for the final evaluation
            clock = runs.StepClock()
            at = run.schedule_step(step)  # `step`, or under --max-completions its place in the budget
            lr = args.lr * lr_factor(at, args.warmup, args.steps, args.min_lr_ratio)
            for param_group in opt.param_groups:
                param_group["lr"] = lr
            sigma = controller.sigma if controller else step_sigma(args, at)
            problems = distributed.shard(task.problems(args.seed, step, args.batch), rank, world)
            prompts = [tok.encode(task.prompt(p)) for p in problems]
            samples, sigma_applied = sample_groups(model, tok, prompts, step, sigma, rank=rank,
                                                   **grpo_variants.sampling_options(args))
            clock.lap("sample")
            rewards, correct = score(task, problems, samples.texts, args.group)  # (N,), a count
            clock.lap("score")
            refilled = {}  # Part 2: --dynamic-sampling replaces the groups whose rewards all tie
            for refill in REFILLS:
                problems, samples, rewards, correct, refilled = refill(args, task, model, tok, step,
                    sigma, rank, world, problems, samples, rewards, correct)
            mask = samples.completion_mask.float().clone()  # (N, T) a copy: not inference-mode
            truncated = runs.truncated_rows(samples.completion_ids, mask, tok.eos_token_ids)  # (N,)
            loss_mask = mask
            for narrow in LOSS_MASKS:
                loss_mask = narrow(args, loss_mask, truncated)  # (N, T)
            ids, sampler_logp = samples.completion_ids.clone(), samples.logprobs.float().clone()
            report = policy_update(model, opt, params, samples.prompt_ids, ids, loss_mask,
                                   sampler_logp, rewards, group=args.group, **update_args)
            checked = grpo_variants.check_step(step + 1, model, params, samples, loss_mask, report,
                                               args.temperature, args.kl_after_rows)  # kl_after
            sampled = args.group * (args.batch + refilled.get("ds_sampled", 0))  # global, every rank
            rec = runs.step_record(step + 1, samples, mask, truncated, rewards, correct, report,
                                   clock, sigma=sigma, sigma_applied=sigma_applied, **refilled,
                                   **checked, completions=sampled)
            run.count(sampled)
            if controller is not None:
                controller.update(rec["entropy"])  # the same global entropy on every rank
            log.step(rec, lr=lr)  # the log line; a step that diverged ends the run here
            run.evaluate_if_due(step + 1)  # every --eval-every steps: `evaluate`, greedy
            halt = run.halt(step + 1)  # a stop signal on any rank, or --stop-at
            run.save_if_due(step + 1, halt)  # rank 0, every --save-every steps and on a halt
            if halt:
                break
        return run.finish()  # a last checkpoint and the full evaluation; the summary

# ======== Part 2: the variants (registered into Part 1's registries), the checks, the command line ========
import os  # noqa: E402  (Part 2's own imports)
import sys  # noqa: E402

from qerl import cli  # noqa: E402
from qerl import grpo_cli  # noqa: E402
from qerl import grpo_show  # noqa: E402
from qerl import hf_files  # noqa: E402
from qerl import run_checks  # noqa: E402
from qerl import tasks  # noqa: E402

# -----------------------------------------------------------------------------
# pi_old's other readings. The sampler's (q): as a sequence ratio it would cancel AQN's noise in expectation,
# E_{y~q}[(pi_theta(y) / q(y)) A] = E_{y~pi_theta}[A]; the ratio here is per token (pi_theta(y_t|y_<t) / q(y_t|y_<t),
# not the prefix's), a first-order correction, up to the clip. The trainer's reading leaves the noise in.


def trainer_logp(current, before):
    """The clean policy before this batch's update: pi_old as the official code reads it (PI_OLD's trainer)."""
    return current if before is None else before


def is_weights(current, sampler, before):
    """rho = pi_trainer / pi_sampler per token (N, T): how much likelier the clean policy finds each sampled token
    than the noisy sampler that drew it. The field's sampler/trainer correction (TIS) weights the loss by it."""
    return torch.exp(trainer_logp(current, before) - sampler)


PI_OLD["sampler"] = PiOld(
    "the noisy sampler's own, as Algorithm 1 reads: the per-token ratio corrects AQN's noise to first order",
    lambda current, sampler, before, o: (sampler, None))
PI_OLD["tis"] = PiOld(
    "the trainer's, as the official code, with each token's loss weighted by min(rho, --tis-cap), rho = "
    "pi_trainer / pi_sampler (truncated importance sampling, as TRL, verl and ms-swift correct a sampler)",
    lambda current, sampler, before, o: (trainer_logp(current, before),
                                         is_weights(current, sampler, before).clamp(max=o.tis_cap)),
    needs_before=True)
PI_OLD["tis-mask"] = PiOld(
    "the trainer's, with the tokens whose rho exceeds --tis-cap left out of the loss (masked IS)",
    lambda current, sampler, before, o: (trainer_logp(current, before),
                                         (is_weights(current, sampler, before) <= o.tis_cap).float()),
    needs_before=True)


def mismatch_stats(current, sampler, before, mask, cap):
    """How far the sampler is from the clean trainer on this micro-batch's tokens, whatever the reading: their
    k3 KL (mean of rho - 1 - log rho), the weights rho's mean, square's mean (with the mean: the effective sample
    size, runs.step_record) and max, and the fraction of tokens beyond `cap`. Token means, like grpo_loss's."""
    with torch.no_grad():
        rho, m = is_weights(current, sampler, before), mask.float()  # (N, T) each
        n = m.sum()  # no token: NaN means, nothing measured
        return {"mismatch_kl": float(((rho - 1 - rho.log()) * m).sum() / n), "is_w_mean": float((rho * m).sum() / n),
                "is_w_sq_mean": float((rho ** 2 * m).sum() / n),
                "is_beyond_cap": float(((rho > cap).float() * m).sum() / n),
                "is_w_max": float(rho.masked_fill(m == 0, 1.0).max()) if m.numel() else MAX_STATS["is_w_max"]}


BATCH_STATS.append(lambda current, sampler, before, mask, o: mismatch_stats(current, sampler, before, mask, o.tis_cap))

# -----------------------------------------------------------------------------
# The loss's other aggregations, its KL and entropy terms, and its statistics beyond the clip fraction


def seq_mean_token_mean(values, mask, max_new_tokens=None, denom=None):
    """The mean over sequences of each one's token mean (original GRPO); empty rows do not count."""
    per_seq = (values * mask).sum(1) / mask.sum(1).clamp(min=1)  # (N,)
    has = (mask.sum(1) > 0).to(values.dtype)  # (N,)
    return (per_seq * has).sum() / (has.sum().clamp(min=1) if denom is None else denom)


def seq_mean_token_sum_norm(values, mask, max_new_tokens=None, denom=None):
    """sum / (N * max_new_tokens), a constant (Dr. GRPO: no length bias)."""
    if denom is None and not max_new_tokens:
        raise ValueError("loss aggregation seq-mean-token-sum-norm needs max_new_tokens")
    return (values * mask).sum() / (values.shape[0] * max_new_tokens if denom is None else denom)


LOSS_AGGS["seq-mean-token-mean"] = (seq_mean_token_mean, lambda count: max(count["sequences"], 1.0))
LOSS_AGGS["seq-mean-token-sum-norm"] = (seq_mean_token_sum_norm,
                                        lambda count: count["rows"] * count["max_new_tokens"])

# -----------------------------------------------------------------------------
# The ratio per sequence (--ratio-level sequence): GSPO (Zheng et al., arXiv 2507.18071)


def sequence_log_ratio(logp, old_logp, mask):
    """GSPO's log s_i: the mean over row i's tokens of log pi_theta - log pi_old, the log of the length-normalised
    sequence ratio (pi_theta(y_i) / pi_old(y_i))^(1 / |y_i|), the same at each of the row's tokens (N, T); 0 for an
    empty row. The gradient flows through the mean, grad s_i = s_i mean_t grad log pi_theta(y_i,t), as GSPO
    defines it (and as TRL's importance_sampling_level="sequence" computes). GSPO-token's stop-gradient form,
    sg[s_i] pi_theta(y_i,t) / sg[pi_theta(y_i,t)] at each token, gives the same gradient here: the advantage is
    the sequence's and every --loss-agg weighs a row's tokens alike."""
    d = (logp - old_logp).masked_fill(mask == 0, 0.0)  # (N, T): padding's values never enter
    return (d.sum(1) / mask.sum(1).clamp(min=1))[:, None].expand_as(logp)  # (N, T)


SEQUENCE_PI_OLD = ("trainer", "sampler")  # the readings without a per-token weight


def check_sequence_level(args):
    """--ratio-level sequence's rule with the other flags. --pi-old tis and tis-mask weight (or drop) each token by
    its own pi_trainer / pi_sampler, so a row's tokens would no longer share one surrogate: refused (a
    per-sequence correction, as ms-swift's sequence_truncate, is not here). Every --loss-agg weighs a row's tokens
    alike and so takes it: seq-mean-token-mean is the paper's 1/G sum_i, token-mean weighs a sequence by its
    length. --beta and --entropy-coef add their per-token terms as at the token level. At --mu 1 with --pi-old
    trainer every ratio is 1 and the update is the token level's: a note says so."""
    if args.pi_old not in SEQUENCE_PI_OLD:
        raise ValueError(f"--ratio-level sequence gives each sequence one ratio, but --pi-old {args.pi_old} weights "
                         f"each token by its own pi_trainer / pi_sampler: use --pi-old "
                         f"{' or '.join(SEQUENCE_PI_OLD)}, or --ratio-level token")
    if args.mu == 1 and args.pi_old == "trainer":
        print("note | --ratio-level sequence at --mu 1 with --pi-old trainer: pi_old is the policy itself, every "
              "ratio is 1 and the update is the token level's (the sequence ratio acts off-policy: --mu 2 or more, "
              "or --pi-old sampler)")


RATIOS["sequence"] = Ratio(
    "per sequence, GSPO's (arXiv 2507.18071): s_i = exp(mean over the row's tokens of log pi_theta - log pi_old), "
    "clipped per sequence, by default to GSPO's [1 - 3e-4, 1 + 4e-4]; not with --pi-old tis or tis-mask",
    sequence_log_ratio, 3e-4, 4e-4, check_sequence_level)


def check_ratio_level(args):
    """Before any work: --ratio-level's rule with the other flags (its RATIOS entry's check), then its clip range
    where --eps-low / --eps-high were not given, written into args, so args.json and a checkpoint record the
    numbers the run uses."""
    level = RATIOS[args.ratio_level]
    if level.check is not None:
        level.check(args)
    options = LossOptions.from_args(args)
    args.eps_low, args.eps_high = options.eps_low, options.eps_high


def k3(d):
    """exp(d) - d - 1 (N, T): the k3 estimate of a KL per token, d the log-ratio; >= 0."""
    return torch.exp(d) - d - 1


def reference_logprobs(model, prompts, ids, mask, temperature, options):
    """--beta > 0: the reference policy's log-probs (the base: adapters off), for the KL term."""
    if not options.beta > 0:
        return {}
    with torch.no_grad(), lora.lora_disabled(model):
        ref_logp, _ = rollout.sequence_logprobs(model, prompts, ids, mask, temperature=temperature, entropy=False)
    return {"ref_logp": ref_logp}


def kl_term(per_tok, logp, options, ref_logp=None, **_):
    """+ beta * KL(pi_theta || pi_ref) per token (k3), ref_logp (N, T) the reference's (--beta)."""
    return per_tok + options.beta * k3(ref_logp - logp) if ref_logp is not None and options.beta else per_tok


def entropy_bonus(per_tok, logp, options, entropy=None, **_):
    """- entropy_coef * entropy per token (--entropy-coef): higher entropy lowers the loss."""
    return per_tok - options.entropy_coef * entropy if entropy is not None and options.entropy_coef else per_tok


def ratio_stats(logp, old_logp, ratio, mask, ref_logp=None, **_):
    """kl (to the reference, NaN without one), kl_old (how far pi_old, the noisy sampler under --pi-old
    sampler, is from pi_theta: their k3) and ratio_max, over the tokens of mask."""
    n_tok, d_old = mask.sum().clamp(min=1), old_logp - logp  # d_old (N, T)
    return {"kl": float((k3(ref_logp - logp) * mask).sum() / n_tok) if ref_logp is not None else float("nan"),
            "kl_old": float((k3(d_old) * mask).sum() / n_tok) if mask.numel() else float("nan"),
            "ratio_max": float(ratio.masked_fill(mask == 0, 1.0).max()) if mask.numel() else MAX_STATS["ratio_max"]}


LOSS_INPUTS.append(reference_logprobs)
LOSS_TERMS.extend([kl_term, entropy_bonus])
LOSS_STATS.append(ratio_stats)
MAX_STATS.update({"ratio_max": 1.0, "is_w_max": 1.0})


def no_token_stats(loss_options, update_options):
    """Every statistic at no token, in the order a step names them: what a process without rows sums."""
    empty = torch.zeros(0, 0)  # (0, 0)
    stats = grpo_loss(empty, empty, torch.zeros(0), empty, loss_options, max_new_tokens=1)[1]
    for stat in BATCH_STATS:
        stats.update(stat(empty, empty, None, empty, update_options))
    return stats

# -----------------------------------------------------------------------------
# The step's other variants: --train-norms, --aqn-kind feedback, --mask-truncated, --dynamic-sampling


def trained_norms(model, args):
    """--train-norms: fp32 master copies of every layer's pre-norm gains, trained too (as the official code)."""
    gains = []
    for _, norm in aqn.aqn_norms(model) if args.train_norms else ():
        norm.weight = torch.nn.Parameter(norm.weight.detach().float())
        gains.append(norm.weight)
    return gains


MORE_PARAMS.append(trained_norms)
SIGMA_CONTROLLERS["feedback"] = lambda args: aqn.FeedbackSigma(args.target_entropy, args.sigma_start)
LOSS_MASKS.append(lambda args, mask, truncated:  # (N, T): the rows cut off at --max-new-tokens leave the loss
                  mask * (~truncated).float()[:, None] if args.mask_truncated else mask)


def refill_flat_groups(args, task, model, tok, step, sigma, rank, world, problems, samples, rewards, correct):
    """DAPO's dynamic sampling (grpo_variants.refill_flat_groups) with this stage's sampling and scoring."""
    return grpo_variants.refill_flat_groups(args, task, model, tok, step, sigma, rank, world, problems, samples,
                                            rewards, correct, sample_groups=sample_groups, score=score,
                                            sampling=grpo_variants.sampling_options(args))


def dynamic_sampling(args, *batch):
    """REFILLS' entry: --dynamic-sampling's refill; without it the batch as it is (and no record)."""
    return refill_flat_groups(args, *batch) if args.dynamic_sampling else (*batch[-4:], {})


REFILLS.append(dynamic_sampling)

# -----------------------------------------------------------------------------
# The loss's aggregation by name; the run between its steps: evaluations, checkpoints (runs.Milestones)


def aggregate(values, mask, mode, max_new_tokens=None, denom=None):
    """Reduce per-token values (N, T) under mask (N, T) to a scalar as LOSS_AGGS[mode] does, naming the modes
    when mode is unknown (grpo_loss indexes LOSS_AGGS itself). denom, when given, replaces the divisor."""
    if mode not in LOSS_AGGS:
        raise ValueError(f"unknown loss aggregation {mode!r}; choose one of {', '.join(LOSS_AGGS)}")
    return LOSS_AGGS[mode][0](values, mask.to(values.dtype), max_new_tokens, denom)


def evaluate_pass_k(model, tok, task, problems, max_new_tokens, k=0, temperature=1.0, seed=0, chunk=512,
                    compiled=False, outcomes=None):
    """Part 1's greedy `evaluate`, and with k > 0 also pass@1 (the mean over k samples) and pass@k (any of k
    correct) at `temperature`, seeded by `seed` (grpo_variants.pass_at_k): the evaluation at a run's ends."""
    res = evaluate(model, tok, task, problems, max_new_tokens, chunk, compiled, outcomes)
    if k > 0:
        with torch.inference_mode(), merged_sampling_weights(model, merge_for_sampling(devices.model_device(model))):
            res.update(grpo_variants.pass_at_k(model, tok, task, problems, max_new_tokens, k, temperature, seed,
                                               chunk, compiled))
    return res


def update_options(args):
    """policy_update's keyword arguments from the command line (its options as LossOptions and UpdateOptions)."""
    return {"group": args.group, "max_new_tokens": args.max_new_tokens, "temperature": args.temperature,
            "loss_options": LossOptions.from_args(args), "update_options": UpdateOptions.from_args(args)}


def milestones(log, stop, state, model, tok, task, opt, params, controller):
    """runs.Milestones of this run: its evaluations (greedy, and pass@k at the start and end; torchrun: each rank
    its share of the held-out problems) and checkpoints (rank 0: the adapter as PEFT's files, trainer_state.pt)."""
    args, rank, world = log.args, log.rank, log.world

    def held_out(step, k):
        devices.release_freed_memory()  # the steps' freed activations go back first: the peaks do not add up
        t0, mine = time.time(), []
        res = evaluate_pass_k(model, tok, task, distributed.shard(task.held, rank, world), args.max_new_tokens, k,
                              args.temperature, tasks.EVAL_SEED, args.eval_chunk, args.compile, mine)
        res["outcomes"] = held_out_outcomes(mine, len(task.held), rank, world)
        return log.eval(res, step, k, time.time() - t0)

    def save(step, first_eval):
        modules = aqn.AQN_NORMS if args.train_norms else None  # trained gains: PEFT's modules_to_save
        write = functools.partial(lora.save_adapter, model, base_model_name_or_path=args.model, modules_to_save=modules)
        return checkpoints.save_checkpoint(args.out, step, opt, params, args, write, lora.DEFAULT_TARGETS,
                                           controller, {"first_eval": first_eval, "completions": run.completions})
    run = runs.Milestones(args, rank, log.start, state, log, stop, held_out, save)
    return run


def held_out_outcomes(mine, n, rank, world):
    """Which held-out problems the greedy answers got right, as text: character i is "1" if problem i (in
    task.held's order) was, else "0". Each rank scored its contiguous share (distributed.shard), so the
    shares summed in place over the ranks are the whole set. A study compares runs problem by problem."""
    flags, share = [0.0] * n, distributed.shard(range(n), rank, world)  # this rank's positions
    flags[share.start:share.stop] = [float(x) for x in mine]
    return "".join("1" if v > 0.5 else "0" for v in distributed.global_sum(flags))


# what moved beside and beneath, under its old name here
take_groups, policy_logprobs, check_step = \
    grpo_variants.take_groups, grpo_variants.policy_logprobs, grpo_variants.check_step
sampling_options = grpo_variants.sampling_options
truncated_rows = runs.truncated_rows

# -----------------------------------------------------------------------------
# The checks before any work (run_checks.py), with this stage's parser, defaults and dtype


def check_run(args, task, world, device):
    """run_checks.check_run: --resume's checkpoint and state, then every check -> (ckpt, state, task, dtype_why)."""
    return run_checks.check_run(args, task, world, device, sys.modules[__name__])


def check_args(args, world, ckpt=None):
    check_ratio_level(args)
    run_checks.check_args(args, world, ckpt, parser_defaults(), read_when_flags(), aqn.check_schedule)


def check_resumed_args(args):
    run_checks.check_resumed_args(args, build_parser())


def read_when_flags():
    return run_checks.read_when_flags(build_parser())


def check_sizes(args, task, world, device):
    return run_checks.check_sizes(args, task, world, device, rollout.ModelConfig.from_dict, policy_dtype)


add_flag, use_gpu_path, use_plain_path = run_checks.add_flag, grpo_variants.use_gpu_path, grpo_variants.use_plain_path


def policy_dtype(args, device, cfg=None):
    """--dtype as (torch dtype, why). auto: bfloat16 on CUDA and on --gpu-path's CUDA code path; on a CPU
    bfloat16 where it is native and the model wide enough to gain, else float32 (devices.pick_dtype)."""
    if args.dtype == "auto" and args.gpu_path:
        return torch.bfloat16, "auto: --gpu-path"
    if args.dtype == "auto" and cfg is None:
        cfg = rollout.ModelConfig.from_dict(hf_files.find_weight_files(args.model)[0])
    return devices.pick_dtype(args.dtype, device, cfg.hidden_size if cfg else None)


# -----------------------------------------------------------------------------
# The command line


def show_step(args, shown=4):
    """--show-step (grpo_show.py): one sampled group of the fresh policy worked by hand; its numbers, as a dict."""
    return grpo_show.show_step(sys.modules[__name__], args, shown)


def build_parser():
    return grpo_cli.build_parser(sys.modules[__name__])


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the checkout
TINY_MODEL = os.path.join(ROOT, "assets", "tiny-qwen")
MAX_EVAL_SIZE = 100_000  # every evaluation samples each held-out problem (greedy, then --eval-k times)


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
