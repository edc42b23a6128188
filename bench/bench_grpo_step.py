"""Where one GRPO step's time goes: rollout, reward, update -- per base-model quantization.

QeRL's speed claim is about the rollout: sampling runs the model once per generated token, so it is
memory-bound and a 4-bit base streams ~3.5x fewer weight bytes. The update (one forward + backward
over the sampled tokens, AdamW on the adapters) and the reward barely change with the base format.
This script measures that split on the bundled tiny model by running stage 05's own `train()` (its step
code, so every 05 flag after -- means what it means there), default batch 16 prompts x 8 samples, for an
unquantized, an NF4 and an NVFP4 base, and reading each step's record in metrics.jsonl:
  rollout  building the prompts + sampling B*G completions (the record's t_sample, with 05's merged weights)
  reward   scoring the completions (t_score)
  update   the rest of the step (s/step - t_sample - t_score): log-probs with gradients, the clipped loss,
           backward, clip, AdamW, and 05's check after the update (one no-grad forward over 16 rows)
Each quantization runs `--warmup` unmeasured steps then `--steps` measured ones (05's --stop-at, on 05's
schedule of its --steps, 750 by default: the first steps add no noise), one quantization after another, in
a scratch run folder, with no evaluation; the means are over the measured steps.

On the CPU the quantized layers dequantize their weights (05 merges them once per step for
sampling, but the update's forward and backward dequantize in every layer call), so they are
expected to be *slower* here; the rollout gain is a GPU effect (bench/bench_rollout.py).

    python bench/bench_grpo_step.py                          # none, nf4, nvfp4; 1 thread; < 1 min
    python bench/bench_grpo_step.py --quants none nvfp4 --steps 10 --warmup 3 --threads 2
    python bench/bench_grpo_step.py -- --no-aqn --max-new-tokens 64   # after --: qerl/train.py flags
"""
import contextlib
import importlib
import io
import json
import os
import statistics
import sys
import tempfile
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
cli = importlib.import_module("qerl.cli")
devices = importlib.import_module("qerl.devices")
grpo = importlib.import_module("qerl.train")
quantize = importlib.import_module("qerl.quantize")

# ---------------------------------------------------------------------------------------------------
# One quantization: 05's train() for --warmup + --steps steps, its step records split into phases

SET_HERE = ("--quant", "--out", "--resume", "--stop-at", "--eval-size", "--save-every", "--time-budget", "--show-step")


def train_steps(train_argv, quant, steps, scratch):
    """05's train() on `train_argv` with --quant `quant` for `steps` steps, quietly -> (its args, the steps' records
    from metrics.jsonl)."""
    out = os.path.join(scratch, quant)
    args = grpo.build_parser().parse_args([*train_argv, "--quant", quant, "--out", out, "--stop-at", str(steps),
                                           "--eval-size", "0", "--save-every", "0", "--time-budget", "0", "--quiet"])
    with contextlib.redirect_stdout(io.StringIO()):  # its notes and summary: this script prints its own lines
        grpo.train(args)
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return args, [rec for rec in map(json.loads, f) if "s/step" in rec]  # the steps, not the evaluations


def measure(bench_args, train_argv):
    """Mean seconds per phase for each quantization, over the steps after --warmup."""
    results = {}
    with tempfile.TemporaryDirectory() as scratch:
        for q in bench_args.quants:
            args, recs = train_steps(train_argv, q, bench_args.warmup + bench_args.steps, scratch)
            if len(recs) <= bench_args.warmup:
                raise ValueError(f"05's --steps {args.steps} ended the run after {len(recs)} step(s), within the "
                                 f"--warmup {bench_args.warmup}: raise 05's --steps (after --)")
            rows = [{"rollout": rec["t_sample"], "reward": rec["t_score"], "total": rec["s/step"],
                     "update": rec["s/step"] - rec["t_sample"] - rec["t_score"],
                     "tokens": rec["len"] * args.batch * args.group,
                     "rows_updated": (1 - rec["frac_zero_std"]) * args.batch * args.group}
                    for rec in recs[bench_args.warmup:]]
            results[q] = {k: statistics.mean(r[k] for r in rows) for k in rows[0]}
    return results, args

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
                           "per quantization (arguments after -- go to qerl/train.py's parser)")
    p.add_argument("--quants", nargs="+", default=["none", "nf4", "nvfp4"], choices=quantize.quant_choices())
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
    if any(a.split("=")[0] in SET_HERE for a in train_argv):
        raise ValueError(f"{', '.join(SET_HERE)} after -- are set by this script: pick quantizations with --quants, "
                         f"steps with --steps and --warmup")
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
