"""Beside stage 05: `python qerl/train.py --show-step`, one sampled group of the fresh policy worked by hand.
It imports stages 03 and 04 and the modules beneath, never 05: 05 passes itself in (`stage`).
"""
import os
import textwrap

import torch

from qerl import devices
from qerl import tasks

from qerl import aqn
from qerl import rollout


@torch.no_grad()
def show_step(stage, args, shown=4):
    """--show-step: one sampled group of the fresh policy (adapters B = 0) worked by hand, at the first step
    with AQN noise: rewards, advantages, and for `shown` tokens of its best and worst row the log-probs,
    ratio (--ratio-level's), surrogate and share of the loss under pi_old's two readings. Every number is 05's own
    (sample_groups, score, group_advantages, PI_OLD, grpo_loss and its clipped_surrogate, 03's sequence_logprobs);
    printed, and returned as a dict (tests/test_show_step.py recomputes it)."""
    if args.loss_agg != "token-mean" or args.beta or args.entropy_coef:
        raise ValueError("--show-step works the default loss (token-mean, no KL, no entropy bonus): drop "
                         "--loss-agg, --beta and --entropy-coef")
    stage.check_ratio_level(args)  # --ratio-level's rule with the other flags: what a run refuses is not shown
    task, device = tasks.make_task(args, stage.parser_defaults()), devices.pick_device(args.device)
    model, tok, _, _ = stage.build_policy(args, device)
    feedback = aqn.FeedbackSigma(args.target_entropy, args.sigma_start) if args.aqn and args.aqn_kind == "feedback" \
        else None
    sigma_at = (lambda s: feedback.sigma) if feedback else (lambda s: stage.step_sigma(args, s))
    # the first noisy step: step 0 (a controller's sigma), or the first of stage 1 (stage 0 adds no noise), found
    # in two looks, not by walking --steps (1e9 would take minutes)
    step = next((s for s in (0, -(-args.steps // args.num_stages)) if s < args.steps and sigma_at(s) > 0), 0)
    sigma, G = sigma_at(step), args.group
    # the step's batch, sampled as train samples it; the first group whose rewards differ (the others carry no signal)
    problems = task.problems(args.seed, step, args.batch)
    samples, _ = stage.sample_groups(model, tok, [tok.encode(task.prompt(p)) for p in problems], step, sigma,
                               **stage.sampling_options(args))
    rewards, _ = stage.score(task, problems, samples.texts, G)  # (B*G,)
    flat = rewards.view(-1, G).std(1) == 0  # (B,)
    if flat.all():
        raise ValueError(f"--show-step: every group of step {step}'s {len(problems)} problems has equal rewards (no "
                         f"signal to show): raise --batch or try another --seed")
    g = int((~flat).nonzero()[0])
    rows = slice(g * G, (g + 1) * G)
    r, adv = rewards[rows], stage.group_advantages(rewards, G, not args.no_std_scale)[rows]  # (G,) each
    ids, mask = samples.completion_ids[rows].clone(), samples.completion_mask[rows].float().clone()  # (G, T) each
    logp, _ = rollout.sequence_logprobs(model, samples.prompt_ids[rows], ids, mask, temperature=args.temperature,
                                        entropy=False)  # (G, T) the clean policy, as the update computes it
    logp, sampler = logp.float(), samples.logprobs[rows].float().clone()  # (G, T): sampler, under AQN
    loss_options, n = stage.LossOptions.from_args(args), float(mask.sum())
    # pi_old as each reading gives it at --mu 1 (no `before`), and each loss: the token mean of -surrogate
    old = {name: stage.PI_OLD[name].read(logp, sampler, None, stage.UpdateOptions.from_args(args))[0]
           for name in ("trainer", "sampler")}
    loss = {name: float(stage.grpo_loss(logp, o, adv, mask, loss_options)[0]) for name, o in old.items()}
    picked = []  # (row, t): in the best and the worst row, the tokens where sampler and policy differ most
    for i in sorted({int(adv.argmax()), int(adv.argmin())}):
        gap = ((logp[i] - sampler[i]).abs() * mask[i]).masked_fill(mask[i] == 0, -1)  # (T,)
        picked += [(i, t) for t in sorted(gap.topk(min(shown, int(mask[i].sum()))).indices.tolist())]
    # each reading's surrogate, ratio and clip at every token of the group, as grpo_loss computes them (over the
    # whole mask: at --ratio-level sequence a token's ratio is its row's)
    (surr_tr, _, _), (surr_s, ratio_s, clipped_s) = (stage.clipped_surrogate(logp, old[k], adv, mask, loss_options)
                                                     for k in ("trainer", "sampler"))  # (G, T) each
    tokens = []
    for i, t in picked:  # a token's share of the loss: its -surrogate / N (token-mean)
        tokens.append({"row": i, "t": t, "token": tok.decode([int(ids[i, t])], skip_special_tokens=False),
                       "adv": float(adv[i]), "logp": float(logp[i, t]), "sampler": float(sampler[i, t]),
                       "ratio": float(ratio_s[i, t]), "clipped": bool(clipped_s[i, t]),
                       "surrogate": float(surr_s[i, t]), "share_trainer": -float(surr_tr[i, t]) / n,
                       "share_sampler": -float(surr_s[i, t]) / n})
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
    if args.ratio_level != "token":  # the ratio and clip columns are this level's
        print(textwrap.fill(f"--ratio-level {args.ratio_level}: {stage.RATIOS[args.ratio_level].help}", 110,
                            initial_indent="   ", subsequent_indent="   "))
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
          "   -mean_t A grad log pi_theta, with the group's mean reward as baseline. The sampler's sequence ratio\n"
          "   would cancel the noise in expectation, E_{y~q}[(pi_theta(y)/q(y)) A] = E_{y~pi_theta}[A]; " + (
              "the ratio here\n   is per token (each token's own probability, not its prefix's), a first-order "
              "correction, at a cost in variance." if args.ratio_level == "token" else "the ratio here\n   is "
              f"--ratio-level {args.ratio_level}'s (above)."))
    return out

