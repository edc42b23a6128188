"""Same results: every variant of qerl/train.py, seeded and tiny, gives the same adapters and metrics as a baseline.

A refactor (stage files restructured, common.py split) must change no number. This runs each CONFIGS entry
(3 steps of the bundled tiny model on the CPU, a few seconds) in a fresh process of the checkout this file
lives in, so a worktree of an old commit measures its own code, and records sha256 of the final checkpoint's
adapter_model.safetensors and adapter_config.json (less its base model's path), and of metrics.jsonl and
summary.json with what depends on the clock, the machine or the paths removed (normalize). The baseline FILE
holds the hashes, a line a configuration; the normalized metrics and summaries go beside it, compressed, in
FILE's name with .details.json.xz, so that --check can name the first differing key. Floats can round
differently on another CPU, so a baseline records its machine and is checked on the same one (--check says so).

    python bench/same_results.py --write bench/results/same_results/baseline-<sha>-<machine>.json
    python bench/same_results.py --check bench/results/same_results/baseline-<sha>-<machine>.json [--only NAME ...]
"""
import argparse
import hashlib
import importlib
import importlib.metadata
import json
import lzma
import os
import pathlib
import platform
import re
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the checkout whose qerl/train.py is measured
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
cli = importlib.import_module("qerl.cli")  # one-line errors, signals (run_cli)
files = importlib.import_module("qerl.files")  # atomic writes
DETAILS = ("metrics", "summary")  # what a baseline keeps compressed beside its hashes

# 32 new tokens, not 12: at 12 the tiny model never finishes an answer, every reward is 0, no group has a
# spread, and the adapters never move, so their hash would prove nothing. Seed 2 gives groups with a spread.
BASE = ["--steps", "3", "--batch", "2", "--group", "4", "--max-new-tokens", "32", "--eval-size", "4",
        "--eval-k", "2", "--time-budget", "0", "--device", "cpu", "--quiet", "--warmup", "0", "--seed", "2"]
GSM8K = "{tmp}/gsm8k.jsonl"  # written by write_gsm8k before the runs

CONFIGS = {  # name -> the flags added to BASE (default: nvfp4 rtn, AQN exp on the norms, pi_old trainer)
    "default": [],
    "quant-none": ["--quant", "none"],
    "quant-none-no-aqn": ["--quant", "none", "--no-aqn"],
    "nf4": ["--quant", "nf4"],
    "4over6": ["--quant-method", "4over6"],
    "no-aqn": ["--no-aqn"],
    "aqn-linear": ["--aqn-kind", "linear"],
    "aqn-cosine": ["--aqn-kind", "cosine"],
    "aqn-log": ["--aqn-kind", "log"],
    "aqn-none": ["--aqn-kind", "none"],
    "aqn-feedback": ["--aqn-kind", "feedback", "--target-entropy", "0.2"],
    "aqn-relative": ["--aqn-scale", "relative"],
    "site-lora-A": ["--aqn-site", "lora-A"],
    "site-lora-B": ["--aqn-site", "lora-B"],
    "site-lora-A-quant-none": ["--aqn-site", "lora-A", "--quant", "none"],
    "pi-sampler": ["--pi-old", "sampler"],
    "pi-tis": ["--pi-old", "tis"],
    "pi-tis-mask": ["--pi-old", "tis-mask", "--tis-cap", "1.5"],
    "pi-trainer-mu2": ["--mu", "2"],
    "pi-sampler-mu2": ["--pi-old", "sampler", "--mu", "2"],
    "pi-tis-mu2": ["--pi-old", "tis", "--mu", "2"],
    "pi-tis-mask-mu2": ["--pi-old", "tis-mask", "--mu", "2"],
    "agg-seq-mean-token-mean": ["--loss-agg", "seq-mean-token-mean"],
    "agg-seq-mean-token-sum-norm": ["--loss-agg", "seq-mean-token-sum-norm"],
    "no-std-scale": ["--no-std-scale"],
    "beta": ["--beta", "0.04"],
    "entropy-coef": ["--entropy-coef", "0.01"],
    "mask-truncated": ["--mask-truncated"],
    "train-norms": ["--train-norms"],
    "dynamic-sampling": ["--dynamic-sampling", "2"],
    "micro-batch-1": ["--micro-batch", "1"],
    "micro-batch-0": ["--micro-batch", "0"],
    "grad-checkpoint": ["--grad-checkpoint"],
    "bfloat16": ["--dtype", "bfloat16"],
    # the Triton kernel interpreted on the CPU takes ~15 s a token step: a smaller run (later flags win)
    "gpu-path": ["--gpu-path", "--steps", "2", "--batch", "1", "--group", "2", "--max-new-tokens", "3",
                 "--eval-size", "0", "--eval-k", "0"],
    "compile": ["--compile"],
    "chat-arithmetic": ["--task", "chat-arithmetic"],
    "gsm8k": ["--task", "gsm8k", "--data", GSM8K],
    "lora-r4": ["--lora-r", "4", "--lora-alpha", "8"],
    "numbers": ["--lr", "2e-3", "--sigma-start", "0.02", "--sigma-end", "0.001", "--num-stages", "3",
                "--temperature", "0.8", "--eps-low", "0.1", "--eps-high", "0.2", "--warmup", "2",
                "--min-lr-ratio", "0.5", "--grad-clip", "0.5", "--digits", "2", "--nops", "1", "--system", "none",
                "--eval-every", "1", "--save-every", "1", "--eval-chunk", "3"],
    "no-eval": ["--eval-size", "0", "--eval-k", "0"],
    "resume": ["--stop-at", "2"],  # then --resume; its adapter must equal default's (the uninterrupted run)
}
ENV = {"gpu-path": {"TRITON_INTERPRET": "1"}}  # the Triton kernel interpreted on the CPU

# What a run records that depends on the clock, the machine or where it ran, not on the computation
TIME_KEYS = {"time", "seconds", "tok/s", "s/step", "peak_rss_mb"}
PATH_KEYS = {"checkpoint", "model", "out", "data", "eval_data", "resume"}
# Flags added after a baseline was written, at the value that leaves the run as it was: dropped from the
# recorded args, so an older baseline still compares (--plain: the fast paths off; off by default; --ratio-level
# token: the ratio per token, as before the flag)
NEW_FLAGS = {"plain": False, "max_completions": 0, "ratio_level": "token"}
# Record fields added after a baseline was written, which say more of the same run (the completions a step
# sampled, the per-problem outcomes of an evaluation): dropped, so an older baseline still compares
NEW_KEYS = {"completions", "ds_sampled", "outcomes"}


def is_volatile(key):
    return (key in TIME_KEYS or key in PATH_KEYS or key in NEW_KEYS or key.startswith(("t_", "cpu_"))
            or key.endswith(("_s", "/s", "_mb")))


def normalize(value):
    """value with every volatile key dropped, at any depth."""
    if isinstance(value, dict):
        return {k: normalize(v) for k, v in value.items() if not is_volatile(k)}
    if isinstance(value, list):
        return [normalize(v) for v in value]
    return value


def sha256(data):
    return hashlib.sha256(data).hexdigest()


def write_gsm8k(path):
    rows = [{"question": f"Tom has {a} apples and buys {b} more. How many apples does he have?",
             "answer": f"{a} + {b} = {a + b}\n#### {a + b}"} for a in range(2, 8) for b in range(3, 7)]
    with open(path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)


def run_05(args, env_extra, tmp):
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONHASHSEED="0", **env_extra)
    cmd = [sys.executable, os.path.join(ROOT, "qerl/train.py"), *[a.format(tmp=tmp) for a in args]]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"{' '.join(cmd)} exited {done.returncode}:\n{done.stderr[-2000:]}")


def final_checkpoint(out):
    found = sorted(n for n in os.listdir(out) if re.fullmatch(r"checkpoint-\d+", n))
    return os.path.join(out, found[-1])


def record(out):
    """The run folder's comparable content: hashes, and the normalized metrics and summary."""
    ckpt = final_checkpoint(out)
    with open(os.path.join(out, "metrics.jsonl")) as f:
        metrics = [normalize(json.loads(line)) for line in f if line.strip()]
    with open(os.path.join(out, "summary.json")) as f:
        summary = normalize(json.load(f))
    for k, v in NEW_FLAGS.items():
        if summary.get("args", {}).get(k, v) == v:
            summary.get("args", {}).pop(k, None)
    with open(os.path.join(ckpt, "adapter_model.safetensors"), "rb") as f:
        files = {"adapter_model.safetensors": sha256(f.read())}
    with open(os.path.join(ckpt, "adapter_config.json")) as f:  # its base model's path is the checkout's
        config = {k: v for k, v in json.load(f).items() if k != "base_model_name_or_path"}
    files["adapter_config.json"] = sha256(json.dumps(config, sort_keys=True).encode())
    files["metrics.jsonl"] = sha256(json.dumps(metrics, sort_keys=True).encode())
    files["summary.json"] = sha256(json.dumps(summary, sort_keys=True).encode())
    trained = sum(1 for m in metrics if (m.get("grad_norm") or 0) > 0)
    return {"checkpoint": os.path.basename(ckpt), "sha256": files, "steps_with_gradient": trained,
            "metrics": metrics, "summary": summary}


def measure(name, tmp):
    out = os.path.join(tmp, name)
    run_05([*BASE, *CONFIGS[name], "--out", out], ENV.get(name, {}), tmp)
    if name == "resume":
        run_05(["--resume", os.path.join(out, "checkpoint-000002"), "--device", "cpu", "--quiet"], {}, tmp)
    return record(out)


def machine():
    """What the floats depend on beyond the code: the CPU (its model and instruction sets pick oneDNN's
    kernels, so a sum can round differently in its last bit) and torch's version."""
    cpu, flags = platform.processor() or platform.machine(), ""
    if os.path.exists("/proc/cpuinfo"):
        with open("/proc/cpuinfo") as f:
            first = [line.split(":", 1) for line in f.read().split("\n\n")[0].splitlines() if ":" in line]
        info = {k.strip(): v.strip() for k, v in first}  # the first CPU's fields
        cpu = info.get("model name", cpu)
        flags = " ".join(sorted(f for f in info.get("flags", "").split() if f.startswith(("avx", "amx"))))
    return {"cpu": cpu, "cpu_flags": flags, "torch": importlib.metadata.version("torch")}


def machine_warning(baseline, here):
    """One line when the baseline was written on another machine (or does not say), else None."""
    there = baseline.get("machine")
    if there == here:
        return None
    was = f"on {there['cpu']} ({there['cpu_flags'] or 'no avx'}), torch {there['torch']}" if there \
        else "on a machine it does not record"
    return (f"note: the baseline was written {was}; this is {here['cpu']} ({here['cpu_flags'] or 'no avx'}), "
            f"torch {here['torch']}. Floats can differ in their last bits between machines: to compare "
            "two commits, --write the old one's baseline here, from a worktree of it")


def differences(want, got):
    """One line per differing file: its name, and for metrics/summary where they first differ."""
    lines = []
    for file, digest in want["sha256"].items():
        if got["sha256"].get(file) == digest:
            continue
        where = ""
        if file == "metrics.jsonl" and "metrics" in want:
            where = first_difference(want["metrics"], got["metrics"], "line")
        elif file == "summary.json" and "summary" in want:
            where = first_difference(want["summary"], got["summary"], "")
        lines.append(f"{file}{where}")
    return lines


def first_difference(a, b, path):
    if isinstance(a, dict) and isinstance(b, dict):
        for k in list(a) + [k for k in b if k not in a]:
            if a.get(k, "<missing>") != b.get(k, "<missing>"):
                return first_difference(a.get(k, "<missing>"), b.get(k, "<missing>"), f"{path}.{k}")
    elif isinstance(a, list) and isinstance(b, list):
        for i, (x, y) in enumerate(zip(a, b)):
            if x != y:
                return first_difference(x, y, f"{path}[{i + 1}]" if path == "line" else f"{path}[{i}]")
        if len(a) != len(b):
            return f": {path} has {len(b)} entries, the baseline {len(a)}"
    return f": first differs at {path.lstrip('.')}: baseline {a!r}, now {b!r}"


def details_path(path):
    return re.sub(r"\.json$", "", path) + ".details.json.xz"


def write_baseline(path, head, results):
    """FILE: the header and one line of hashes per configuration; beside it the metrics and summaries, xz."""
    lines = [f"{json.dumps(n)}: {json.dumps({k: v for k, v in r.items() if k not in DETAILS}, sort_keys=True)}"
             for n, r in results.items()]
    text = json.dumps(head, sort_keys=True)[:-1] + ', "configs": {\n' + ",\n".join(lines) + "\n}}\n"
    details = {n: {k: r[k] for k in DETAILS if k in r} for n, r in results.items()}
    packed = lzma.compress(json.dumps(details, sort_keys=True).encode())
    files.atomic_write(details_path(path), lambda p: pathlib.Path(p).write_bytes(packed))
    files.atomic_write(path, lambda p: pathlib.Path(p).write_text(text))


def read_baseline(path):
    """The baseline's header and configurations, with the compressed details merged in where they exist."""
    try:
        with open(path) as f:
            baseline = json.load(f)
    except FileNotFoundError:
        raise ValueError(f"--check {path}: no such baseline; write one with --write") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"--check {path}: not a baseline of this script ({e})") from None
    if not isinstance(baseline, dict) or not isinstance(baseline.get("configs"), dict):
        raise ValueError(f"--check {path}: not a baseline of this script (no configs)")
    if os.path.exists(details_path(path)):
        with open(details_path(path), "rb") as f:
            for name, extra in json.loads(lzma.decompress(f.read())).items():
                baseline["configs"].get(name, {}).update(extra)
    return baseline


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("--write", metavar="FILE", help="run every config and record its results in FILE")
    mode.add_argument("--check", metavar="FILE", help="run every config and list those that differ from FILE")
    p.add_argument("--only", nargs="+", metavar="NAME", choices=list(CONFIGS), help="these configs alone")
    args = p.parse_args(argv)
    names = args.only or list(CONFIGS)
    baseline = None
    if args.check:
        baseline = read_baseline(args.check)
        missing = [n for n in names if n not in baseline["configs"]]
        if missing and args.only:
            raise ValueError(f"--only {' '.join(missing)}: not in the baseline {args.check}; it holds "
                             f"{len(baseline['configs'])} configurations")
        names = [n for n in names if n in baseline["configs"]]
    results, failed, start, here = {}, [], time.time(), machine()
    warning = baseline and machine_warning(baseline, here)
    if warning:
        print(warning, flush=True)
    with tempfile.TemporaryDirectory(prefix="same_results_") as tmp:
        write_gsm8k(GSM8K.format(tmp=tmp))
        for name in names:
            t0 = time.time()
            try:
                results[name] = measure(name, tmp)
            except RuntimeError as e:
                failed.append(name)
                print(f"{name:28s} FAILED: {e}", flush=True)
                continue
            status = f"{results[name]['steps_with_gradient']} steps with a gradient"
            if baseline:
                diff = differences(baseline["configs"][name], results[name])
                failed += [name] if diff else []
                status = "same" if not diff else "DIFFERS: " + "; ".join(diff)
            print(f"{name:28s} {time.time() - t0:5.1f}s | {status}", flush=True)
    if "resume" in results and "default" in results:
        same = results["resume"]["sha256"]["adapter_model.safetensors"] == \
            results["default"]["sha256"]["adapter_model.safetensors"]
        results["resume"]["adapter_equals_default"] = same
        print(f"resume: adapter {'equals' if same else 'DIFFERS FROM'} the uninterrupted run's (default)")
    commit = subprocess.run(["git", "-C", ROOT, "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    print(f"{len(names)} configs in {time.time() - start:.0f}s at {ROOT} ({commit[:7] or 'no git'})", flush=True)
    if args.write:
        os.makedirs(os.path.dirname(os.path.abspath(args.write)), exist_ok=True)
        write_baseline(args.write, {"commit": commit, "machine": here, "base_args": BASE,
                                    "flags": {n: CONFIGS[n] for n in results}}, results)
    if failed:
        print(f"{len(failed)} differ or failed: {' '.join(failed)}")
        if warning:
            print(warning)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(cli.run_cli(main))
