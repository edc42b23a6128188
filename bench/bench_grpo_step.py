"""Where one GRPO step's time goes: rollout, reward, update -- per base-model quantization.

QeRL's speed claim is about the rollout: sampling runs the model once per generated token, so it is
memory-bound and a 4-bit base streams ~3.5x fewer weight bytes. The update (one forward + backward
over the sampled tokens, AdamW on the adapters) and the reward barely change with the base format.
This script measures that split on the bundled tiny model with stage 05's own functions, one step
of its loop (`one_step` below), default batch 16 prompts x 8 samples, for an unquantized, an NF4 and an NVFP4 base:
  rollout  building the prompts + sampling B*G completions (05's t_sample, with its merged weights)
  reward   scoring the completions (the step record's t_score)
  update   the rest of the step: log-probs with gradients, the clipped loss, backward, clip, AdamW
Each quantization gets its own model; after `--warmup` unmeasured steps each, the steps of the three
are interleaved and averaged over `--steps` per quantization.

On the CPU the quantized layers dequantize their weights (05 merges them once per step for
sampling, but the update's forward and backward dequantize in every layer call), so they are
expected to be *slower* here; the rollout gain is a GPU effect (bench/bench_rollout.py).

    python bench/bench_grpo_step.py                          # none, nf4, nvfp4; 1 thread; < 1 min
    python bench/bench_grpo_step.py --quants none nvfp4 --steps 10 --warmup 3 --threads 2
    python bench/bench_grpo_step.py -- --no-aqn --max-new-tokens 64   # after --: 05_grpo.py flags
"""
import importlib
import os
import statistics
import sys
import tempfile
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
cli = importlib.import_module("cli")
devices = importlib.import_module("devices")
tasks = importlib.import_module("tasks")
runs = importlib.import_module("runs")
grpo = importlib.import_module("05_grpo")
quantize = importlib.import_module("01_quantize")

# ---------------------------------------------------------------------------------------------------
# One quantization: build what 05's train() builds (with its functions), then run one step of its loop and split its time


def setup(args):
    """Model, tokenizer, optimizer and task, made by 05's own functions."""
    device = str(devices.pick_device(args.device))
    task = tasks.make_task(args, grpo.parser_defaults())
    model, tok, params, opt = grpo.build_policy(args, device)
    return dict(model=model, tok=tok, opt=opt, params=params, task=task)


def one_step(args, s, step):
    """One step of 05's train() loop, phase for phase -> its record (runs.step_record, which times the phases)."""
    clock, model, tok, task = runs.StepClock(), s["model"], s["tok"], s["task"]
    for group in s["opt"].param_groups:  # as 05's train() does before each step
        group["lr"] = args.lr * grpo.lr_factor(step, args.warmup, args.steps, args.min_lr_ratio)
    problems = task.problems(args.seed, step, args.batch)
    prompts = [tok.encode(task.prompt(p)) for p in problems]
    samples, _ = grpo.sample_groups(model, tok, prompts, step, grpo.step_sigma(args, step), seed=args.seed,
                                    group=args.group, max_new_tokens=args.max_new_tokens,
                                    temperature=args.temperature, compiled=args.compile, noise=args.aqn_scale)
    clock.lap("sample")
    rewards, correct = grpo.score(task, problems, samples.texts, args.group)
    clock.lap("score")
    mask = samples.completion_mask.float().clone()  # (N, T)
    truncated = grpo.truncated_rows(samples.completion_ids, mask, tok.eos_token_ids)
    report = grpo.policy_update(model, s["opt"], s["params"], samples.prompt_ids, samples.completion_ids.clone(),
                                mask, samples.logprobs.float().clone(), rewards, **grpo.update_options(args))
    return runs.step_record(step + 1, samples, mask, truncated, rewards, correct, report, clock)


def measure(bench_args, train_argv):
    """Mean seconds per phase for each quantization. All models are loaded first and the steps are
    interleaved (none, nf4, nvfp4, none, ...), so a slow spell of a shared CPU hits every format alike
    instead of whichever happened to run then."""
    runs = {}
    for q in bench_args.quants:
        args = grpo.build_parser().parse_args(train_argv + ["--quant", q])
        with tempfile.TemporaryDirectory() as scratch:  # check_args checks a run folder; this script writes none
            args.out = scratch
            grpo.check_args(args, 1)
        runs[q] = (args, setup(args), [])
    for step in range(bench_args.warmup + bench_args.steps):
        for q, (args, s, rows) in runs.items():
            rec = one_step(args, s, step)
            if step >= bench_args.warmup:  # the step's own record times its phases (t_score: the rewards)
                total, roll, rew = rec["s/step"], rec["t_sample"], rec["t_score"]
                rows.append({"rollout": roll, "reward": rew, "update": total - roll - rew, "total": total,
                             "tokens": rec["len"] * args.batch * args.group,
                             "rows_updated": (1 - rec["frac_zero_std"]) * args.batch * args.group})
    results = {q: {k: statistics.mean(r[k] for r in rows) for k in rows[0]} for q, (_, _, rows) in runs.items()}
    return results, next(iter(runs.values()))[0]

# ---------------------------------------------------------------------------------------------------
# Report


def print_table(results, base):
    # 05 updates only the rows of groups with mixed rewards, and that count differs between runs, so
    # the update is also given per updated row (the cost the base format actually changes)
    for r in results.values():
        r["update_per_row"] = r["update"] / max(r["rows_updated"], 1)
    print(f"\n| quant | rollout s | reward s | update s | step s | rollout share | rows updated | update ms/row | "
          f"rollout x | update/row x | step x (vs {base}) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    ref = results.get(base)
    for q, r in results.items():
        ratio = (lambda k: f"{r[k] / ref[k]:.2f}") if ref else (lambda k: "-")
        print(f"| {q} | {r['rollout']:.3f} | {r['reward']:.4f} | {r['update']:.3f} | {r['total']:.3f} | "
              f"{100 * r['rollout'] / r['total']:.0f}% | {r['rows_updated']:.0f} | {1000 * r['update_per_row']:.2f} | "
              f"{ratio('rollout')} | {ratio('update_per_row')} | {ratio('total')} |")


def build_parser():
    p = cli.ArgumentParser(description="Split one GRPO step (05_grpo's loop) into rollout / reward / update "
                           "per quantization (arguments after -- go to 05_grpo.py's parser)")
    p.add_argument("--quants", nargs="+", default=["none", "nf4", "nvfp4"], choices=quantize.QUANT_CHOICES)
    p.add_argument("--steps", type=cli.number(int, 1), default=5, help="measured steps per quantization")
    p.add_argument("--warmup", type=cli.number(int, 0), default=2, help="unmeasured steps first")
    p.add_argument("--threads", type=cli.number(int, 1), default=1,
                   help="torch CPU threads (1 on a shared machine)")
    return p


def main(argv=None):
    argv, train_argv = sys.argv[1:] if argv is None else argv, []
    if "--" in argv:
        i = argv.index("--")
        argv, train_argv = argv[:i], argv[i + 1:]
    args = build_parser().parse_args(argv)
    if any(a.split("=")[0] in ("--quant", "--out", "--resume") for a in train_argv):
        raise ValueError("--quant/--out/--resume after -- are not used here: pick quantizations with --quants")
    torch.set_num_threads(args.threads)
    t0 = time.time()
    results, last = measure(args, train_argv)
    for q, r in results.items():
        print(f"quant {q} | rollout {r['rollout']:.3f}s | reward {r['reward']:.4f}s | update {r['update']:.3f}s | "
              f"step {r['total']:.3f}s", flush=True)
    print(f"({time.time() - t0:.0f}s incl. loading and warm-up)")
    print(f"\nbundled model {os.path.relpath(last.model, ROOT)} | B {last.batch} x G {last.group} | "
          f"max_new_tokens {last.max_new_tokens} | aqn {'on' if last.aqn else 'off'} | device "
          f"{last.device or devices.autodetect_device()} | threads {args.threads} | mean of {args.steps} steps "
          f"after {args.warmup} warm-up")
    print_table(results, args.quants[0])


if __name__ == "__main__":
    sys.exit(cli.run_cli(main))
