"""What DAPO's dynamic sampling costs a step and a completion, measured side by side on the bundled model.

The ds-matched study (bench/compare_methods.py --study ds-matched) compares QeRL with and without
--dynamic-sampling 2 at an equal budget of sampled completions; this measures their time. Each arm runs the
first --steps steps of the study's schedule (175 steps, --max-completions 22,400, no evaluation) in the
trainer, the arms alternating A B A B ... --rounds times so that a drift of the machine's speed falls on
both, one thread each, one run at a time. Per arm: seconds a step, completions a step, and seconds per
1,000 completions (median over the rounds, each a mean over its steps after --warmup); then the ratios.
Run it on otherwise idle cores: other jobs' load moves these numbers more than the arms do.

    python bench/bench_dynamic_sampling.py                    # 3 rounds of 12 steps (2 warm-up); ~4 min
    python bench/bench_dynamic_sampling.py --rounds 5 --steps 20
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
sys.path.insert(0, os.path.join(ROOT, "bench"))
cli = importlib.import_module("qerl.cli")
grpo = importlib.import_module("qerl.train")
studies = importlib.import_module("studies")

STUDY = studies.STUDIES["ds-matched"]
ARMS = {key: flags for key, (_, flags, _) in STUDY["methods"].items()}  # the study's own flags per arm


def run_arm(flags, steps, seed, out):
    """The trainer's first `steps` steps of the study's schedule for one arm -> its step records."""
    args = grpo.build_parser().parse_args([
        "--model", os.path.join(ROOT, "assets", "tiny-qwen"), "--steps", str(STUDY["defaults"]["steps"]),
        "--stop-at", str(steps), "--seed", str(seed), "--eval-size", "0", "--save-every", "0",
        "--time-budget", "0", "--quiet", "--device", "cpu", "--out", out, *flags])
    with contextlib.redirect_stdout(io.StringIO()):  # its notes and summary: this script prints its own lines
        grpo.train(args)
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [rec for rec in map(json.loads, f) if "s/step" in rec]


def build_parser():
    p = cli.ArgumentParser(description="Time a step and a completion of QeRL with and without dynamic sampling "
                           "(the ds-matched study's two arms), alternating the arms")
    p.add_argument("--rounds", type=cli.number(int, 1, 50), default=3, help="A B pairs")
    p.add_argument("--steps", type=cli.number(int, 2, 175), default=12, help="steps a run, warm-up included")
    p.add_argument("--warmup", type=cli.number(int, 0), default=2, help="first steps of each run not counted")
    p.add_argument("--seed", type=cli.number(int, 0, cli.MAX_SEED), default=0)
    return p


def main(argv=None):
    args = build_parser().parse_args(argv)
    if args.warmup >= args.steps:
        raise ValueError(f"--warmup {args.warmup} leaves none of --steps {args.steps} to measure: lower it")
    torch.set_num_threads(1)
    per = {arm: [] for arm in ARMS}
    t0 = time.time()
    with tempfile.TemporaryDirectory() as scratch:
        for r in range(args.rounds):
            for arm, flags in ARMS.items():
                recs = run_arm(flags, args.steps, args.seed, os.path.join(scratch, f"{arm}-{r}"))[args.warmup:]
                row = {"s_step": statistics.mean(x["s/step"] for x in recs),
                       "completions": statistics.mean(x["completions"] for x in recs),
                       "cpu_step": statistics.mean(x["cpu_s"] for x in recs)}
                row["s_per_1k"] = 1000 * row["s_step"] / row["completions"]
                per[arm].append(row)
                print(f"round {r + 1}/{args.rounds} | {arm} | s/step {row['s_step']:.3f} | cpu/step "
                      f"{row['cpu_step']:.3f} | completions/step {row['completions']:.1f} | s per 1k completions "
                      f"{row['s_per_1k']:.2f}", flush=True)
    med = {arm: {k: statistics.median(row[k] for row in rows) for k in rows[0]} for arm, rows in per.items()}
    (a, ra), (b, rb) = med.items()  # the default arm first, the refilling arm second (the study's order)
    print(f"\n{os.cpu_count()} cores | 1 thread | {args.rounds} rounds x {args.steps - args.warmup} measured steps | "
          f"wall {time.time() - t0:.0f}s")
    print("| arm | s/step | completions/step | s per 1,000 completions |\n|---|---|---|---|")
    for arm, r in med.items():
        print(f"| {arm} | {r['s_step']:.3f} | {r['completions']:.1f} | {r['s_per_1k']:.2f} |")
    print(f"\n{b} / {a}: per step x{rb['s_step'] / ra['s_step']:.2f}, completions per step "
          f"x{rb['completions'] / ra['completions']:.2f}, per completion x{rb['s_per_1k'] / ra['s_per_1k']:.2f}")


if __name__ == "__main__":
    sys.exit(cli.run_cli(main))
