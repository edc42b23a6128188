"""One 05 run at a glance: its per-10-step table (markdown) and its curves, from the run folder's metrics.jsonl.

    python bench/plot_run.py runs/qerl                              # the table
    python bench/plot_run.py runs/qerl --png bench/results/smollm2/curves.png --every 10

The table: mean reward, completion length, sampling entropy, s/step and sampling seconds of each block of
--every steps. The picture (matplotlib, an optional extra): reward and held-out greedy accuracy, and the mean
completion length, over the steps.
"""
import importlib
import json
import os
import statistics
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
cli = importlib.import_module("qerl.cli")
files = importlib.import_module("qerl.files")


def read_run(folder):
    """(step records, evaluation records) of a run folder's metrics.jsonl."""
    path = os.path.join(folder, "metrics.jsonl")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{folder}: no metrics.jsonl (is it a qerl/train.py run folder?)")
    with open(path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    steps = [r for r in rows if "eval" not in r and "step" in r]
    if not steps:
        raise ValueError(f"{path}: no step records")
    return steps, [r["eval"] for r in rows if "eval" in r]


def table(steps, every):
    lines = ["| steps | mean reward | mean length (tokens) | sampling entropy (nats/token) | s/step | of which sampling (s) |",
             "|---|---|---|---|---|---|"]
    for i in range(0, len(steps), every):
        block = steps[i:i + every]
        mean = lambda k: statistics.mean(r[k] for r in block)  # noqa: E731
        lines.append(f"| {block[0]['step']}-{block[-1]['step']} | {mean('reward'):.3f} | {mean('len'):.1f} | "
                     f"{mean('entropy'):.3f} | {mean('s/step'):.2f} | {mean('t_sample'):.2f} |")
    return "\n".join(lines)


def plot(steps, evals, png):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("plot | matplotlib is not installed: skipped (pip install matplotlib to get it)")
        return
    x = [r["step"] for r in steps]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 3.8))
    ax1.plot(x, [r["reward"] for r in steps], lw=0.8, alpha=0.5, label="train reward (per step)")
    ax1.plot([e["step"] for e in evals], [e["greedy"] for e in evals], "o-", label="held-out greedy accuracy")
    ax1.set_xlabel("step")
    ax1.set_ylim(0, 1)
    ax1.legend()
    ax2.plot(x, [r["len"] for r in steps], lw=1.0)
    ax2.set_xlabel("step")
    ax2.set_ylabel("mean completion length (tokens)")
    fig.tight_layout()
    files.atomic_write(png, lambda tmp: fig.savefig(tmp, dpi=110, format="png"))
    print(f"plot | {png}")


def main(argv=None):
    p = cli.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("run", help="a qerl/train.py run folder (with metrics.jsonl)")
    p.add_argument("--every", type=cli.number(int, 1), default=10, help="steps per table row")
    p.add_argument("--png", default=None, help="also draw the curves into this PNG file")
    a = p.parse_args(argv)
    steps, evals = read_run(a.run)
    print(table(steps, a.every))
    if a.png:
        plot(steps, evals, a.png)
    return 0


if __name__ == "__main__":
    sys.exit(cli.run_cli(main))
