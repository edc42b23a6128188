"""The paper's Table 1 comparison at laptop scale: LoRA vs QLoRA vs NVFP4-LoRA vs QeRL (+ a control).

QeRL's Table 1 trains Qwen2.5-3B/7B on GSM8K with GRPO and reports, after RL, QeRL (NVFP4 + LoRA +
AQN) >= NVFP4 + LoRA >= BF16 LoRA >= NF4 LoRA (QLoRA). Its explanation is exploration: 4-bit rounding
error flattens the sampling distribution, and AQN adds scheduled noise on top. The paper never runs
the control that separates the two causes -- noise on an *unquantized* base -- so we add it.

This script trains every method with stage 05 on the bundled tiny model and the synthetic arithmetic
task, with identical budgets: the same number of GRPO steps (not wall time: quantized layers are
slower on a CPU, and a time budget would hand the unquantized runs more training), the same seeds,
the same held-out set. Each run is a separate `python qerl/train.py` process with one thread, several
at a time, writing to bench/results/runs/<method>-s<seed>/. Then it reads every run's summary.json
and metrics.jsonl and writes:
  results.json  one record per run, one line each (final greedy accuracy, pass@k, steps to reach
                +threshold points, entropy and completion length over the first and last fifth of
                training, whether it collapsed, wall time, the eval curve), per method the mean +- std
                over seeds and the collapses, and per contrast the difference, its interval and p-value
  table.md      per method: mean +- std over seeds and collapses (k of n); per contrast (the paper's
                ordering, a study's questions) the difference with its 95% interval, Welch's p, the permutation and Holm-adjusted p, and the detectable effect
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
  - The stage files are read once at the start (the five stages, qerl/*.py, kernels/*.py: nothing else)
    and hashed; the runs import a copy written from those bytes in a folder only this user can write
    (mode 0700, in TMPDIR, not in --out), checked again before every run and removed at the end,
    with python -E (PYTHONPATH cannot come first). runs/.code, a copy of the same bytes, is what copies of
    this script agree on: a second copy goes on only when its own code is that snapshot byte for byte (a
    record naming a live process proves nothing). Any other snapshot (planted, edited) is refused.
  - Each run's versions.txt records the code's and the model's md5, the snapshot's hash and the run's
    whole 05 command line (argv). A study resumed with other 05 settings (`-- --lr 5e-3`, another
    --eval-size, --steps) is refused before training, naming a differing flag, and a report refuses runs
    whose recorded arguments differ (the methods' own flags apart): one table, one setting. A finished run
    is emptied and trained again only with --force.
  - Every JSON it reads goes through load_json: nesting deeper than MAX_DEPTH is one line, not a traceback.
  - --from-results checks the type and range of every field it reads (summary.json, metrics.jsonl,
    invocations.jsonl, the noise study's best level): one line per bad field, then one error.

Run it (from the repository root; 15 runs of 300 steps took 45 min on 2 cores with --parallel 2):
    python bench/compare_methods.py                                  # 5 methods x seeds 0 1 2, 300 steps
    python bench/compare_methods.py --steps 200 --seeds 0 1 2 3 4 --parallel 2
    python bench/compare_methods.py --methods lora qerl --steps 4 --seeds 0 --eval-size 20 --out /tmp/cmp
    python bench/compare_methods.py --from-results                   # only re-render table and plot (seconds)
    python bench/compare_methods.py --from-results --pack            # ... then repack runs/ (after deleting a run)
    python bench/compare_methods.py -- --lr 5e-4                     # arguments after -- go to qerl/train.py
A second copy started later with the same arguments (e.g. once the machine has a free core) trains
the runs the first has not taken yet, from the first's snapshot (when the stage files are still the
ones it copied); rerun with --from-results at the end to report all of them.

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
  dynamic-sampling  The bundled model, 6 seeds x 100 steps: QeRL as 05 runs it against the same plus
             --dynamic-sampling 2 (DAPO: flat groups replaced by up to 2 more sampling rounds a step).
  ds-matched The same two arms at an equal budget of 22,400 sampled completions each (--max-completions;
             the default's 175 steps, about 100 of the refilling arm's), 6 seeds, per-problem outcomes kept.
The methods, phases and questions are data (bench/studies.py); --methods restricts a study to some of its
methods. Every question is a - b of two methods: the table gives the difference of means of final
greedy accuracy, of pass@k and of first-fifth entropy, each with its 95% interval and p-value from Welch's
t-test over the seeds; on final greedy also the exact permutation p over the seeds, that p Holm-adjusted
over the study's questions, and the smallest difference the seeds could detect at 80% power (the verdict:
"a ends higher than b" when the adjusted p < 0.05, otherwise "not distinguishable" with that detectable
difference; at 3 seeds a side the permutation p cannot go below 0.10, so 3 seeds never rank). Where every
run kept its per-problem outcomes, a paired bootstrap over problems and seeds is given too. Collapses are counted per method, apart from the mean (COLLAPSE_LEN: a run that ends below its
start, or whose completions shrink to under a quarter of their first fifth's length). --max-wall SECONDS starts no run after that long
(running ones finish) and the same command resumes; Ctrl-C or `kill` stops the runs it started, keeping
the finished ones, and exits 130 (143 for kill) with one line. Study runs keep a compact metrics.jsonl
(what the table and the curves read).

The code: this file is the command line (its flags and the order of the steps); beside it studies.py
holds the methods and the studies as data, study_runner.py the code snapshot, the claims and the 05
processes, study_files.py the runs' files, the pack and what it may replace in --out, study_stats.py
the statistics and study_report.py the tables and the curves.
"""
import contextlib
import importlib
import os
import sys
import time

from studies import BUILD_HINTS, METHODS, NOISE_LEVELS, OWNED_FLAGS, ROOT, STUDIES
from study_files import OUTPUTS, PACK, REPORT, check_outputs, collect, pack_runs, read_invocations, short, unpack_runs, \
    write_text
from study_report import noise_results_best, report
from study_runner import (estimate_wall, log_invocation, model_dir, owner_text, prepare_code, private_code, read_code,
                          release_code, remove_private, run_all, run_study, snapshot_claim)
# what tests/test_bad_inputs.py reads from this module, which held everything before it was split
from study_files import read_pack as read_pack
from study_runner import CODE_FILES as CODE_FILES, SNAPSHOT_RECORD as SNAPSHOT_RECORD, live_claims as live_claims, \
    process_identity as process_identity, tree_hash as tree_hash

cli = importlib.import_module("qerl.cli")
quantize = importlib.import_module("qerl.quantize")  # the command-line pieces
GRPO = os.path.join(ROOT, "qerl/train.py")
DEFAULT_OUT = os.path.join(ROOT, "bench", "results")

# ---------------------------------------------------------------------------------------------------
# CLI


def build_parser():
    N = cli.number
    p = cli.ArgumentParser(description="Train LoRA / QLoRA / NVFP4-LoRA / QeRL / LoRA+AQN with identical "
                           "budgets and compare them (arguments after -- go to qerl/train.py)")
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


def resolved_model(train_args):
    """train_args with --model's folder made absolute from where this script was started: the runs start in
    the checkout, so a relative folder would name another model there than the one recorded. --help after --
    is refused: every run would print the trainer's help and exit 0."""
    out = list(train_args)
    for i, a in enumerate(out):
        if a in ("-h", "--help"):
            raise ValueError(f"{a} after -- would make every run print the trainer's help instead of training: "
                             "see the trainer's flags with  python -m qerl.train --help")
        if a == "--model" and i + 1 < len(out):
            out[i + 1] = os.path.abspath(out[i + 1])
        elif a.startswith("--model="):
            out[i] = "--model=" + os.path.abspath(a.split("=", 1)[1])
    return out


def parse_args(argv):
    train_args = []
    if "--" in argv:  # everything after -- is passed to qerl/train.py unchanged
        i = argv.index("--")
        argv, train_args = argv[:i], argv[i + 1:]
    train_args = resolved_model(train_args)
    args = build_parser().parse_args(argv)
    args.started, args.stopped, args.trained = time.time(), False, False
    # the copy of the code the runs import (private_code), its md5, the study's snapshot (prepare_code)
    args.code_dir, args.code_md5, args.code_made, args.snapshot = None, None, False, None
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
            code = read_code()  # read once: the snapshot and the copy the runs import are these bytes
            args.snapshot, args.code_md5, args.code_made = prepare_code(runs_root, code)
            if not args.code_made:  # a claim on the snapshot: its maker, ending first, leaves it to this copy
                write_text(snapshot_claim(runs_root), owner_text())
            args.code_dir = private_code(code, args.code_md5)  # what the runs import: mode 0700, in TMPDIR
            unpack_runs(args.out)
        jobs = run_study(args) if study else run_all(args)
    finally:
        if args.code_dir:
            remove_private(args.code_dir)
        if args.snapshot:
            with contextlib.suppress(FileNotFoundError):
                os.remove(snapshot_claim(runs_root))
            release_code(runs_root, args.snapshot, args.code_md5)
        if study and not args.dry_run and (jobs or args.trained):  # an interrupted invocation's wall time counts too
            log_invocation(args, len(jobs))
    if not args.dry_run:
        report(args, collect(args, jobs))
        pack_runs(args.out)


if __name__ == "__main__":
    sys.exit(cli.run_cli(main))
