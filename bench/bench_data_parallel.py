"""Data-parallel GRPO on one machine: torchrun with N ranks x 1 thread vs 1 process x N threads.

Both run stage 05 (`qerl/train.py`) on the bundled tiny model with the same flags and the same global
batch (--batch prompts x --group samples per step), a fixed number of steps and no evaluation:
  1 process   python qerl/train.py                            OMP_NUM_THREADS=N
  N ranks     torchrun --standalone --nproc_per_node N ...  OMP_NUM_THREADS=1 per rank
It reads each run's metrics.jsonl and prints the mean seconds per step after --warmup steps, the
rollout's share, and the speed-up of the ranks over the single process. The two runs alternate
(--repeats times), so a slow spell of a shared machine hits both.

On a CPU the question is whether N processes use N cores better than one process with N threads
(measured on 2 cores: no, 0.94x, see docs/scaling.md); on N GPUs data parallelism is the
only way to use them all. Run on a quiet machine:
    python bench/bench_data_parallel.py                        # 2 ranks vs 1 process x 2 threads, ~2 min
    python bench/bench_data_parallel.py --ranks 4 --steps 40 --repeats 1
    python bench/bench_data_parallel.py -- --quant none --no-aqn   # after --: qerl/train.py flags
"""
import importlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
cli = importlib.import_module("qerl.cli")
OWNED = ("--out", "--steps", "--eval-size", "--time-budget", "--save-every", "--resume", "--device")


def run(ranks, threads, steps, extra, out):
    """One qerl/train.py run -> (its per-step records, wall seconds including start-up)."""
    flags = ["--steps", str(steps), "--eval-size", "0", "--time-budget", "0", "--save-every", "0",
             "--device", "cpu", "--quiet", "--out", out, *extra]
    script = os.path.join(ROOT, "qerl/train.py")
    if ranks == 1:
        cmd = [sys.executable, script, *flags]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(ranks),
               script, *flags]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    t0 = time.time()
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"error: {' '.join(cmd[:6])} ... failed:\n{r.stderr[-2000:]}")
    with open(os.path.join(out, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return [row for row in rows if "eval" not in row], time.time() - t0


def main(argv=None):
    argv, extra = sys.argv[1:] if argv is None else argv, []
    if "--" in argv:
        i = argv.index("--")
        argv, extra = argv[:i], argv[i + 1:]
    N = cli.number
    p = cli.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ranks", type=N(int, 2), default=2,
                   help="torchrun processes (the single process gets as many threads)")
    p.add_argument("--steps", type=N(int, 1), default=30, help="GRPO steps per run")
    p.add_argument("--warmup", type=N(int, 0), default=5, help="first steps left out of the mean")
    p.add_argument("--repeats", type=N(int, 1), default=2, help="runs of each configuration, alternating")
    args = p.parse_args(argv)
    if args.steps <= args.warmup:
        p.error(f"--steps {args.steps} must be more than --warmup {args.warmup}")
    if any(a.split("=")[0] in OWNED for a in extra):
        raise ValueError(f"{', '.join(OWNED)} are set by this script; pass other qerl/train.py flags after --")
    configs = {f"1 process x {args.ranks} threads": (1, args.ranks), f"{args.ranks} ranks x 1 thread": (args.ranks, 1)}
    per_step = {name: [] for name in configs}
    rollout_share = {name: [] for name in configs}
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(args.repeats):
            for name, (ranks, threads) in configs.items():
                rows, wall = run(ranks, threads, args.steps, extra, os.path.join(tmp, f"{ranks}-{rep}"))
                timed = rows[args.warmup:]
                s = statistics.mean(r["s/step"] for r in timed)
                per_step[name].append(s)
                rollout_share[name].append(statistics.mean(r["t_sample"] / r["s/step"] for r in timed))
                print(f"run | {name} | repeat {rep + 1}/{args.repeats} | s/step {s:.3f} | "
                      f"steps {len(rows)} | wall {wall:.0f}s", flush=True)
    print(f"\nbundled model | {args.steps} steps ({args.warmup} warm-up left out) | x {args.repeats} repeats | "
          f"05 flags: {' '.join(extra) or '(defaults)'}")
    print("| configuration | s/step | rollout share | speed-up |")
    print("|---|---|---|---|")
    base = statistics.mean(per_step[next(iter(configs))])
    for name in configs:
        s = statistics.mean(per_step[name])
        print(f"| {name} | {s:.3f} | {100 * statistics.mean(rollout_share[name]):.0f}% | {base / s:.2f}x |")


if __name__ == "__main__":
    sys.exit(cli.run_cli(main))
