"""The headline as a pack: `python 05_grpo.py` (what `make demo` runs) over several seeds, one after another
on otherwise idle cores, with the CPU named; its table gives the range and median of each run's gain.

Resumable: a seed whose run folder holds summary.json is not run again (a folder without one, left by a
stopped run, is run again from scratch). The pack is the run folders' metrics.jsonl and summary.json,
packed into runs.tar.xz, plus table.md; --report rebuilds table.md from runs.tar.xz alone.

    python bench/default_runs.py --seeds 0 1 2            # ~6 min a seed on 2 idle cores
    python bench/default_runs.py --report                 # table.md from the committed pack
"""

import argparse
import io
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tarfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACK = os.path.join(ROOT, "bench", "results", "default")
KEPT = ("metrics.jsonl", "summary.json")  # the adapter is not kept: 05 rebuilds it from the seed
WRITTEN = ("metrics.jsonl", "adapter_config.json", "adapter_model.safetensors")  # what a stopped 05 run leaves


def cpu_name():
    """The CPU model, its bf16 instruction sets (they pick oneDNN's kernels: floats part across CPUs), cores."""
    with open("/proc/cpuinfo") as f:
        info = f.read()
    model = next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")), "?")
    flags = next((line.split(":", 1)[1].split() for line in info.splitlines() if line.startswith("flags")), [])
    bf16 = ",".join(f for f in ("avx512_bf16", "amx_bf16") if f in flags) or "no native bf16"
    return f"{model} ({bf16}), {os.cpu_count()} cores, {platform.system()}"


def run_seed(seed, runs, extra):
    out = os.path.join(runs, f"seed-{seed}")
    if os.path.exists(os.path.join(out, "summary.json")):
        print(f"seed {seed}: done before, kept", flush=True)
        return
    if os.path.isdir(out):  # a stopped run's folder: removed only if it holds nothing but what 05 writes
        others = sorted(set(os.listdir(out)) - set(WRITTEN))
        if others:
            raise SystemExit(f"{out} holds {', '.join(others)}, which no run of 05 wrote: move it, or pass another --runs")
        shutil.rmtree(out)
    cmd = [sys.executable, os.path.join(ROOT, "05_grpo.py"), "--seed", str(seed), "--out", out, *extra]
    print("$ " + " ".join(cmd[1:]), flush=True)
    t0 = time.time()
    with open(os.path.join(runs, f"seed-{seed}.log"), "w") as log:
        code = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT).returncode
    if code != 0:
        raise SystemExit(f"seed {seed}: 05_grpo.py exited {code}; its log: {runs}/seed-{seed}.log")
    print(f"seed {seed}: {time.time() - t0:.0f} s", flush=True)


def pack(runs):
    with tarfile.open(os.path.join(PACK, "runs.tar.xz"), "w:xz") as tar:
        for name in sorted(os.listdir(runs)):
            for f in KEPT:
                path = os.path.join(runs, name, f)
                if os.path.isfile(path):
                    tar.add(path, arcname=f"runs/{name}/{f}")


def read_pack():
    runs = {}
    with tarfile.open(os.path.join(PACK, "runs.tar.xz")) as tar:
        for m in tar.getmembers():
            if m.name.endswith("summary.json"):
                runs[m.name.split("/")[1]] = json.load(io.TextIOWrapper(tar.extractfile(m)))
    return runs


def report(machine):
    runs = read_pack()
    rows, gains, finals, walls = [], [], [], []
    for name, s in sorted(runs.items(), key=lambda kv: int(kv[0].split("-")[1])):
        first, final = 100 * s["first_eval"]["greedy"], 100 * s["final_eval"]["greedy"]
        gains.append(final - first)
        finals.append(final)
        walls.append(s["wall_s"])
        rows.append(f"| {name} | {first:.1f} | {final:.1f} | {final - first:+.1f} | {s['wall_s']:.0f} |")
    text = [
        "# The default run over seeds: `python 05_grpo.py --seed S`",
        "",
        f"Machine: {machine}. Bundled model, synthetic arithmetic, 750 steps, greedy % on 500 held-out problems.",
        "Rebuilt by `python bench/default_runs.py --report` from runs.tar.xz.",
        "",
        "| run | start greedy | final greedy | gain (points) | wall (s) |",
        "|---|---|---|---|---|",
        *rows,
        "",
        f"{len(runs)} seeds: final {min(finals):.1f}-{max(finals):.1f}% (median {statistics.median(finals):.1f}), "
        f"gain {min(gains):+.1f} to {max(gains):+.1f} points (median {statistics.median(gains):+.1f}), "
        f"wall {min(walls):.0f}-{max(walls):.0f} s (median {statistics.median(walls):.0f}).",
    ]
    with open(os.path.join(PACK, "table.md"), "w") as f:
        f.write("\n".join(text) + "\n")
    print("\n".join(text))


def main(argv=None):
    p = argparse.ArgumentParser(description="python 05_grpo.py over seeds, packed with its table")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--report", action="store_true", help="only rebuild table.md from runs.tar.xz")
    p.add_argument("--runs", default=os.path.join(ROOT, "runs", "default-pack"), help="where the runs train")
    args, extra = p.parse_known_args(argv)
    machine_file = os.path.join(PACK, "machine.txt")
    if not args.report:
        os.makedirs(args.runs, exist_ok=True)
        os.makedirs(PACK, exist_ok=True)
        for seed in args.seeds:
            run_seed(seed, args.runs, extra)
        pack(args.runs)
        with open(machine_file, "w") as f:
            f.write(cpu_name() + "\n")
    with open(machine_file) as f:
        report(f.read().strip())


if __name__ == "__main__":
    main()
