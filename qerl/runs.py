"""The run folder of a 05 run and what happens around its steps: the one-writer lock, the run log (what a run
prints, and metrics.jsonl, args.json and summary.json that rank 0 writes), the time budget, and stop signals
(Ctrl-C, SIGTERM, SIGHUP let the step in flight finish, then checkpoint and stop). Imports no stage.
"""
import collections
import json
import math
import os
import shlex
import signal
import statistics
import sys
import threading
import time

import torch

from qerl import checkpoints
from qerl import cli
from qerl import devices
from qerl import files
from qerl.checkpoints import RUN_FILES, check_run_links, is_run_file  # the run folder's own files
from qerl.distributed import PeerError, global_sum, rank_and_world

def read_metrics(path, upto=None):
    """metrics.jsonl's rows up to step `upto` (None: all). A cut-off last line (a kill mid-write) is dropped with a
    note; a bad line before it is an error naming the file and line."""
    text = files.read_text(path)  # a pipe planted as metrics.jsonl is refused; a damaged byte: a line not JSON
    lines = [(n, line) for n, line in enumerate(text.split("\n"), 1) if line.strip()]
    rows = []
    for i, (n, line) in enumerate(lines):
        damaged = f"{path} line {n} {{}}: the run log is damaged (fix or delete that line, then resume)"
        try:
            row = json.loads(line)
        except (json.JSONDecodeError, RecursionError):  # RecursionError: a line nested 100,000 levels
            if i + 1 < len(lines):
                raise ValueError(damaged.format("is not JSON")) from None
            print(f"note | {path} line {n} was cut off mid-write: dropped")
            continue
        record = row.get("eval", row) if isinstance(row, dict) else None  # a step's row, or {"eval": {...}}
        step = record.get("step") if isinstance(record, dict) else None
        if not isinstance(step, int) or isinstance(step, bool):
            raise ValueError(damaged.format("has no integer step"))
        if upto is None or step <= upto:
            rows.append(row)
    return rows


def row_key(row):
    """Where a row of metrics.jsonl (read_metrics': it has an integer step) stands in a run: (its step, 0 for a
    step's row or 1 for an evaluation's, which follows the step's)."""
    return (row["eval"]["step"], 1) if "eval" in row else (row["step"], 0)



class RunLog:
    """What a run prints and what rank 0 writes: metrics.jsonl, args.json, summary.json."""
    NO_SIGNAL_STEPS = 20  # steps in a row without signal before the warning

    def __init__(self, args, rank, start, t_start, model, world, dtype_why="", defaults=None, fast=()):
        self.args, self.rank, self.t_start, self.flat_steps, self.start = args, rank, t_start, 0, start
        self.world = world
        self.defaults = defaults or {}  # the parser's: a divergence names the flags this run changed
        self.metrics = os.path.join(args.out, "metrics.jsonl")
        self.opened, self.steps_logged, self.made, self.recent = False, 0, [], []  # recent: s/step of each step
        self.far_steps = []  # the steps whose update moved the policy beyond DIVERGED_KL
        self.entropies = collections.deque(maxlen=ENTROPY_WINDOW)  # the sampler's recent entropies (entropy_jump)
        self.lock = files.OutputLock(args.out) if rank == 0 else None  # held from __enter__ to __exit__
        rows = read_metrics(self.metrics) if rank == 0 and os.path.exists(self.metrics) else []
        # metrics.jsonl's rows past the checkpoint (a run stopped after logging on, or one resumed from an earlier
        # checkpoint of it) stay until this run writes the row of their step and kind: stopped again, the log
        # still holds every step (a resumed run logs the same numbers)
        self.kept_rows = [r for r in rows if row_key(r)[0] <= start]
        self.later_rows = [r for r in rows if row_key(r)[0] > start]
        dtype = str(model.model.embed_tokens.weight.dtype).replace("torch.", "")
        print(f"run | model {args.model} | quant {args.quant} | aqn {args.aqn_kind if args.aqn else 'off'} | "
              f"pi_old {args.pi_old} | " + (f"ratio {args.ratio_level} (clip [{1 - args.eps_low:g}, "
                                           f"{1 + args.eps_high:g}]) | " if args.ratio_level != "token" else "") +
              f"device {devices.model_device(model)} | dtype {dtype}" + (f" ({dtype_why})" if dtype_why else "") +
              f" | fast {','.join(fast) or 'none'}"  # the fast paths this run takes (05: grpo_variants.fast_paths)
              f" | steps {args.steps} | B {args.batch} | "
              f"G {args.group} | lr {args.lr:g} | out {args.out}" + (f" | ranks {world}" if world > 1 else ""))

    def out_of_time(self, first_eval):
        """--time-budget: whether the next step (the mean of the last five) would eat the time kept for the final
        evaluation (1.5x the first one, which also samples pass@k); rank 0's clock decides for everyone."""
        reserve = 1.5 * first_eval["seconds"] if first_eval else 0.0
        recent = self.recent[-5:]
        next_step = sum(recent) / len(recent) if recent else 0.0
        late = self.args.time_budget and time.time() - self.t_start + reserve + next_step > self.args.time_budget
        return bool(global_sum([self.rank == 0 and late])[0])

    def _open(self):
        """The run folder's files, at the first record (a run that fails before it writes nothing): args.json,
        and metrics.jsonl as read (a line cut off mid-write goes)."""
        os.makedirs(self.args.out, exist_ok=True)
        files.write_json(os.path.join(self.args.out, "args.json"), clean(vars(self.args)))
        if self.kept_rows or self.later_rows or os.path.exists(self.metrics):
            self._write_rows()
        self.opened = True

    def _write_rows(self):  # metrics.jsonl in one atomic write: a kill leaves the old file or the new
        files.write_text(self.metrics, "".join(json.dumps(r) + "\n" for r in self.kept_rows + self.later_rows))

    def _append(self, rec):  # one line of metrics.jsonl, written by rank 0
        if self.rank == 0:
            if not self.opened:
                self._open()
            rec = clean(rec)
            self.kept_rows.append(rec)
            if self.later_rows:  # this row replaces the earlier run's of its step and kind; later ones stay
                key = row_key(rec)
                self.kept_rows[-1:-1] = [r for r in self.later_rows if row_key(r) < key]
                self.later_rows = [r for r in self.later_rows if row_key(r) > key]
                self._write_rows()
            else:
                files.append_line(self.metrics, json.dumps(rec) + "\n")  # never through a planted link

    def logged_eval(self, step, k):
        """The evaluation at `step` with pass@k (k 0: greedy alone) that metrics.jsonl already holds up to this run's
        checkpoint (rank 0), or None: a run stopped after its final evaluation but before its summary has it."""
        for row in reversed(self.kept_rows):
            res = row.get("eval")
            if res is not None and res["step"] == step and res.get("k", 0) == k and "greedy" in res:
                return res
        return None

    def __enter__(self):
        """The run folder is this run's alone until it ends: a second run on it, or a --resume of it, fails
        at once with one line naming this process."""
        if self.lock:
            self.lock.__enter__()
            self.made = [n for n in RUN_FILES if not os.path.lexists(os.path.join(self.args.out, n))]
        return self

    def __exit__(self, kind, exc, tb):
        """A new run that ends before its first step removes the run files it wrote, then the folder if it made
        it and nothing else is in it; every other file stays (a resumed run's files are its run's record, a
        summary.json its final evaluation wrote among them). Ctrl-C (or SIGTERM, SIGHUP) ends in one line
        saying what to run to continue, pasteable into a shell."""
        if self.lock:
            if self.steps_logged == 0 and self.start == 0:
                for name in self.made:
                    if os.path.isfile(os.path.join(self.args.out, name)):  # what it wrote (a link is not)
                        os.remove(os.path.join(self.args.out, name))
            self.lock.__exit__(kind, exc, tb)
        if kind is None:
            return False
        if issubclass(kind, PeerError):  # torchrun: say at which step the other rank went missing
            raise PeerError(f"step {self.start + self.steps_logged + 1}: {exc}") from None
        if issubclass(kind, KeyboardInterrupt) and not str(exc) and self.rank == 0:  # rank 0 saves, and says so
            found = checkpoints.latest_checkpoint(self.args.out)
            hint = (f"{os.path.basename(found)} saved: continue with  python qerl/train.py --resume "
                    f"{shlex.quote(self.args.out)}" if found else "no checkpoint yet: nothing to resume")
            raise cli.Interrupted(hint, getattr(exc, "signum", signal.SIGINT)) from None
        return False

    def eval(self, res, step, k, seconds):
        res.update(step=step, seconds=seconds, time=time.time() - self.t_start)
        line = f"eval | step {step} | n {res['n']} | greedy {res['greedy']:.3f} | reward {res['greedy_reward']:.3f}"
        line += f" | pass@1 {res['pass@1']:.3f} | pass@{k} {res[f'pass@{k}']:.3f}" if k else ""
        print(line + f" | {seconds:.1f}s", flush=True)
        self._append({"eval": res})
        return res

    def step(self, rec, lr):
        rec.update(lr=lr, time=time.time() - self.t_start)
        jump = entropy_jump(self.entropies, rec.get("entropy"))  # the free divergence alarm
        if rec.get("entropy") is not None:
            self.entropies.append(rec["entropy"])
        if jump and not rec.get("diverged"):
            rec["diverged"] = jump  # then the record says why, and the run stops below
        self._append(rec)
        self.steps_logged += 1
        self.recent.append(rec["s/step"])
        self.flat_steps = self.flat_steps + 1 if rec["frac_zero_std"] == 1 else 0
        if not self.args.quiet:
            print(f"step {rec['step']}/{self.args.steps} | reward {rec['reward']:.3f} | acc {rec['acc']:.3f} | "
                  f"entropy {rec['entropy']:.3f} | kl {fmt(rec['kl'])} | clip {rec['clip']:.4f} | len {rec['len']:.1f} | "
                  f"sigma {rec['sigma']:.2e} | sigma_applied {rec['sigma_applied']:.2e} | tok/s {rec['tok/s']:.0f} | "
                  f"s/step {rec['s/step']:.2f}" + (" | no signal (all rewards equal in every group)"
                                                    if self.flat_steps else ""), flush=True)
        if rec.get("diverged"):  # the last good checkpoint stays; this run's state is not saved
            found = checkpoints.latest_checkpoint(self.args.out)
            hint = f"its last good checkpoint, {os.path.basename(found)}, stays" if found else "it saved no checkpoint"
            raise ValueError(f"step {rec['step']}: {rec['diverged']}: the run diverged and stops; {hint}; "
                             f"{self.divergence_fix()}")
        if rec["kl_after"] > DIVERGED_KL:
            self.far_steps.append(rec["step"])
            print(f"warning | step {rec['step']} | kl_after {rec['kl_after']:.3g} > {DIVERGED_KL:g}: the update moved "
                  f"the policy far from the one that sampled (likely divergence: {self.divergence_fix()})", flush=True)
        if self.flat_steps == self.NO_SIGNAL_STEPS:
            never = rec["acc"] < 0.5
            print(f"warning | {self.flat_steps} steps in a row without signal: the base {'never' if never else 'always'}"
                  f" solves this task (acc {rec['acc']:.2f}), so GRPO learns nothing; try an "
                  f"{'easier' if never else 'harder'} task or another base", flush=True)

    def divergence_fix(self):
        """What to change after a divergence: the flags of DIVERGENCE_FLAGS this run set away from their defaults
        (--lr when none); a resumed run took them from its checkpoint, so a new run is how to change them."""
        flags = [k for k in DIVERGENCE_FLAGS if k in self.defaults and getattr(self.args, k) != self.defaults[k]]
        named = " or ".join(f"--{k.replace('_', '-')} (now {getattr(self.args, k):g})" for k in flags or ["lr"])
        if not self.args.resume:
            return f"run again with a lower {named}"
        return (f"lower {named}: a resume keeps the checkpoint's values, so start a new run with lower ones (or, if "
                f"the checkpoint's state is at fault, resume from an earlier checkpoint)")

    def summary(self, done, stopped, first_eval, last_eval, last_ckpt):
        if stopped == "time budget" and not self.steps_logged:  # then the run folder's files go (__exit__)
            took = (f" (the first evaluation took {first_eval['seconds']:.0f} s, and 1.5x that is kept for the last "
                    f"one)") if first_eval else ""
            raise ValueError(f"--time-budget {self.args.time_budget:g} s ran out before the first step{took}: nothing "
                             f"to save; raise --time-budget (0: no limit) or lower --eval-size")
        s = {"steps_done": done, "stopped_by": stopped, "likely_divergence_steps": self.far_steps, "wall_s": time.time() - self.t_start,
             "first_eval": first_eval, "final_eval": last_eval, "checkpoint": last_ckpt, "args": vars(self.args)}
        why = {"steps": f"--steps {self.args.steps}", "time budget": f"--time-budget {self.args.time_budget:g}s",
               "stop-at": f"--stop-at {self.args.stop_at}",
               "completions": f"--max-completions {self.args.max_completions}"}.get(stopped, stopped)  # or the signal's name
        gain = ""
        if first_eval and last_eval:
            s["greedy_gain"] = last_eval["greedy"] - first_eval["greedy"]
            gain = (f" | greedy {first_eval['greedy']:.3f} -> {last_eval['greedy']:.3f} "
                    f"({100 * s['greedy_gain']:+.1f} points)")
            if "greedy_reward" in first_eval:  # a run resumed from an older checkpoint has no first reward
                gain += f" | reward {first_eval['greedy_reward']:.3f} -> {last_eval['greedy_reward']:.3f}"
        far = self.far_steps
        print(f"summary | steps {done} | stopped by {why}{gain} | wall {s['wall_s']:.0f}s | out {self.args.out}"
              + (f" | LIKELY DIVERGED: {len(far)} step(s) moved the policy beyond kl_after {DIVERGED_KL:g} (first: "
                 f"step {far[0]})" if far else ""))
        if self.rank == 0 and (self.steps_logged or self.start):  # a resume's, though it ran no step
            if not self.opened:
                self._open()
            files.write_json(os.path.join(self.args.out, "summary.json"), clean(s))
        return s

def clean(obj):
    """NaN/inf -> None, so the files are strict JSON."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: clean(v) for k, v in obj.items()}
    return [clean(v) for v in obj] if isinstance(obj, (list, tuple)) else obj


def fmt(x):
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.4f}"


class StopAtStepEnd:
    """Ctrl-C, SIGTERM or SIGHUP during a run: the step in flight finishes, a checkpoint is written, the run
    stops. A second signal stops at once, unless it comes within repeat_s of the first: under torchrun
    (repeat_s REPEAT_S) that is the same request arriving twice (a terminal or Slurm signals torchrun and
    the ranks, and torchrun passes it on); a single process takes a quick second Ctrl-C as meant. Only the
    main thread can take signals; elsewhere this is a no-op."""
    REPEAT_S = 1.0

    def __init__(self, repeat_s=0.0):
        self.repeat_s = repeat_s

    def __enter__(self):
        self.signum, self.at, self.previous = 0, 0.0, {}
        if threading.current_thread() is threading.main_thread():
            self.previous = {s: signal.signal(s, self._ask) for s in cli.STOP_SIGNALS}
        self.stdout, sys.stdout = sys.stdout, cli.ClosedPipeGuard(sys.stdout)  # `| head`: stop as for SIGPIPE
        return self

    def _ask(self, signum, frame):
        if self.signum:
            if time.monotonic() - self.at >= self.repeat_s:
                raise cli.Interrupted(signum=signum)
            return
        self.signum, self.at = signum, time.monotonic()
        again = "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name
        print(f"interrupt | stopping after this step with a checkpoint ({again} again: stop now)", flush=True)

    def requested(self):
        """The number of the stop signal any rank got (0: none); a closed standard output counts as SIGPIPE."""
        mine = self.signum or (signal.SIGPIPE if sys.stdout.closed else 0)
        return int(global_sum([mine], "max")[0])

    def __exit__(self, *exc):
        for s, handler in self.previous.items():
            signal.signal(s, handler)
        sys.stdout = self.stdout
        return False


# The flags whose raised values can make an update too large (what a divergence names, RunLog.divergence_fix)
DIVERGENCE_FLAGS = ("lr", "sigma_start", "beta", "entropy_coef", "lora_alpha", "mu")

# A step whose update moves the policy more than this from the one that sampled (kl_after, nats per token) is
# named a likely divergence. Measured 2026-12-02: the bundled model's default run stays below 0.03 (60 steps) and
# SmolLM2's documented QeRL run below 0.17 (60 steps, AQN noise included); --lr 1e3 passes 1 in its first update.
DIVERGED_KL = 1.0

# The free alarm (RunLog.entropy_jump): a step whose sampler entropy is more than ENTROPY_JUMP_NATS above, and more
# than ENTROPY_JUMP_RATIO times, the median of the last ENTROPY_WINDOW steps ends the run as diverged. Measured
# 2026-12-07 over the 156 committed runs (36,774 steps: the bundled model's default pack and 750-step and ablation
# studies, SmolLM2's two Table-1 studies; docs/reliability.md): the largest rise above that median was 0.39 nats,
# the largest ratio 3.98 (at a rise of 0.35); --lr 3e4 rises 3.0 nats (32x) in its first update.
ENTROPY_JUMP_NATS, ENTROPY_JUMP_RATIO, ENTROPY_WINDOW = 1.0, 3.0, 20


def entropy_jump(recent, entropy):
    """The divergence alarm that costs nothing: the sampler's mean token entropy at this step (every step has it)
    far above its median over `recent` (the previous steps' entropies, up to ENTROPY_WINDOW), as when the last
    update left a policy that samples near-uniformly. -> the reason, or None."""
    if entropy is None or not math.isfinite(entropy) or not recent:
        return None
    median = statistics.median(recent)
    if entropy - median <= ENTROPY_JUMP_NATS or entropy <= ENTROPY_JUMP_RATIO * median:
        return None
    return (f"the sampler's entropy jumped to {entropy:.3f} nats a token from a median of {median:.3f} over the "
            f"last {len(recent)} step(s) (the last update wrecked the policy)")


def halt_reason(signum):
    """The name a stop signal gives a run's end ("interrupt" for Ctrl-C, else SIGTERM or SIGHUP); None for 0."""
    if not signum:
        return None
    return "interrupt" if signum == signal.SIGINT else "closed output" if signum == signal.SIGPIPE \
        else signal.Signals(signum).name


def check_run_folder(args, ckpt=None):
    """--out: a folder without a run in it (other files are left alone, e.g. a launcher's log), or the
    folder of the run that `ckpt` (--resume) continues. Never a file, the model or a data file, or a
    folder holding them."""
    inputs = [x for x in (args.model, args.data, args.eval_data) if x]
    files.check_out_path(args.out, inputs)
    check_run_links(args.out)
    if os.path.isdir(args.out) and rank_and_world()[0] == 0:
        with files.OutputLock(args.out):  # a live run on this folder is named here, before any work
            files.remove_stale_temps(args.out, is_run_file)  # what a killed run left: half-written checkpoints
    held = sorted(os.listdir(args.out)) if os.path.isdir(args.out) else []
    run = [n for n in held if is_run_file(n)]  # what a run would overwrite
    own = ckpt is not None and os.path.realpath(os.path.dirname(os.path.abspath(ckpt))) == os.path.realpath(args.out)
    if run and not own and not any(checkpoints.checkpoint_step(n) is not None for n in run):
        raise ValueError(f"--out {args.out} already holds a run ({', '.join(run[:3])}) that stopped before its first "
                         f"checkpoint: --resume has nothing to continue there; delete those files to reuse "
                         f"{args.out}, or choose a new --out")
    if run and not own:
        raise ValueError(f"--out {args.out} already holds a run ({', '.join(run[:3])}): continue it with --resume "
                         f"{args.out} (without --out), or choose a new --out")


class StepClock:
    """Wall and CPU seconds of a step and of its phases (lap), for its record: benchmarks read the record,
    so they need no hooks into 05."""

    def __init__(self):
        self.t0, self.cpu0, self.last, self.laps, self.cpu_laps = time.time(), time.process_time(), 0.0, {}, {}

    def lap(self, name):
        """The phase `name` ends now: its seconds since the previous lap (wall, and CPU since the start)."""
        now = time.time() - self.t0
        self.laps[name], self.cpu_laps[name], self.last = now - self.last, time.process_time() - self.cpu0, now


def truncated_rows(ids, mask, eos_token_ids):
    """(N,) bool: the rows whose completion (ids, mask (N, T)) has no EOS token: max_new_tokens cut them off."""
    eos = torch.tensor(list(eos_token_ids), dtype=ids.dtype, device=ids.device)
    return ~(torch.isin(ids, eos) & (mask > 0)).any(1)


def step_record(step, samples, mask, truncated, rewards, correct, report, clock, **extra):
    """A step's line of metrics.jsonl, every number global (summed, or maximised, over ranks): the rewards and
    samples (stage 03's Rollout, its completion mask (N, T), the truncated rows (N,)), the update's report
    (every statistic of the loss by name; its bookkeeping counts stay out), the clock's phases, and `extra`."""
    total_reward, total_correct, total_entropy, total_tokens, total_truncated = global_sum([
        float(rewards.sum()), correct, float((samples.entropy.float() * mask).sum()), float(mask.sum()),
        float(truncated.sum())])
    t_sample = global_sum([clock.laps["sample"]], op="max")[0]
    rows = report["rows_all"]
    stats = {k: v for k, v in report.items() if k not in UPDATE_BOOKKEEPING}
    if "is_w_mean" in stats and "is_w_sq_mean" in stats:  # the IS weights' effective sample size, in [0, 1]
        stats["is_ess"] = stats["is_w_mean"] ** 2 / stats["is_w_sq_mean"] if stats["is_w_sq_mean"] else float("nan")
    return {"step": step, "reward": total_reward / rows, "acc": total_correct / rows,
            "entropy": total_entropy / max(total_tokens, 1), "len": total_tokens / rows, **extra, **stats,
            "frac_zero_std": report["flat_all"] / rows, "truncated": total_truncated / rows,
            "tok/s": total_tokens / max(t_sample, 1e-9), "s/step": time.time() - clock.t0, "t_sample": t_sample,
            "t_score": clock.laps["score"], "cpu_s": time.process_time() - clock.cpu0,
            "cpu_sample": clock.cpu_laps["sample"], "peak_rss_mb": devices.peak_rss_bytes() / 2 ** 20}


FINISHED = ("steps", "time budget", "completions")  # the ends that take a final checkpoint and evaluation


class Milestones:
    """What a run does between its steps besides the step: held-out evaluations (the first one, every
    --eval-every steps, the full one with pass@k at the end), checkpoints (every --save-every steps, on a stop,
    at the end) and the stop (a signal on any rank, --stop-at; --time-budget before a step). evaluate(step, k)
    -> the evaluation's record; save(step, first_eval) -> the checkpoint's folder or None (rank 0 alone)."""

    def __init__(self, args, rank, start, state, log, stop, evaluate, save):
        self.args, self.rank, self.start, self.log, self.stop, self._save = args, rank, start, log, stop, save
        self.evaluate = lambda step, k: evaluate(step, k) if args.eval_size else None
        # --max-completions: the completions sampled so far (every rank counts the same global number; a
        # checkpoint keeps it, so a resumed run stops and schedules as the uninterrupted one)
        self.completions = (state or {}).get("completions", 0)
        self.first_eval = (state or {}).get("first_eval") or self.evaluate(start, args.eval_k)
        self.last_eval, self.last_ckpt, self.done, self.stopped, self.signum = \
            self.first_eval, None, start, "steps", 0

    def steps(self):
        """The steps still to run; the time budget ends them early enough for the final evaluation, and
        --max-completions once the run has sampled that many."""
        for step in range(self.start, self.args.steps):
            if self.args.max_completions and self.completions >= self.args.max_completions:
                self.stopped = "completions"
                return
            if self.log.out_of_time(self.first_eval):
                self.stopped = "time budget"
                return
            yield step

    def schedule_step(self, step):
        """The step the LR and AQN schedules read: `step`, or under --max-completions where the completions
        sampled so far put the run among --steps (a refilling run, sampling more a step, goes through its
        schedule in fewer steps; a run sampling B x G a step at a budget of --steps x B x G reads `step`)."""
        if not self.args.max_completions:
            return step
        return min(self.completions * self.args.steps // self.args.max_completions, self.args.steps - 1)

    def count(self, completions):
        self.completions += completions

    def save(self, step):
        self.last_ckpt = self._save(step, self.first_eval) or self.last_ckpt

    def evaluate_if_due(self, done):
        """Every --eval-every steps (but the last: finish evaluates it in full), a greedy evaluation."""
        if self.args.eval_every and done % self.args.eval_every == 0 and done < self.args.steps:
            self.last_eval = self.evaluate(done, 0) or self.last_eval

    def halt(self, done):
        """Why the run stops after step `done` ("stop-at", or the signal's halt_reason), or None to go on; asked on
        every rank (a signal reaches them apart): they stop together."""
        self.done, self.signum = done, self.stop.requested()
        halt = "stop-at" if self.args.stop_at and done >= self.args.stop_at else halt_reason(self.signum)
        if halt:
            self.stopped = halt
        return halt

    def save_if_due(self, done, halt):
        """Rank 0 writes a checkpoint every --save-every steps and on a halt."""
        if self.rank == 0 and ((self.args.save_every and done % self.args.save_every == 0) or halt):
            self.save(done)

    def logged_final_eval(self, done):
        """A resume that ran no step (its checkpoint is at `done`) of a run stopped after its final evaluation but
        before its summary: that evaluation, from metrics.jsonl (the policy is the same), on rank 0 (the others:
        the last one they hold); None to evaluate. Every rank agrees."""
        resumed_here = done == self.start > 0 and self.args.eval_size
        found = self.log.logged_eval(done, self.args.eval_k) if resumed_here else None
        if not global_sum([found is not None], "max")[0]:
            return None
        print(f"eval | step {done} | the final evaluation is in metrics.jsonl already: not run again", flush=True)
        return found if found is not None else self.last_eval

    def finish(self):
        """The end: a last checkpoint and the full evaluation (unless a stop came), then the summary; a signal
        raises cli.Interrupted once the summary is out (the log's line says how to resume)."""
        done, last = self.done, self.last_eval
        if self.stopped in FINISHED:
            if self.rank == 0 and done > self.start and not (self.last_ckpt or "").endswith(f"{done:06d}"):
                self.save(done)
            if last is None or last["step"] != done or "k" not in last:
                logged = self.logged_final_eval(done)
                self.last_eval = logged if logged is not None else self.evaluate(done, self.args.eval_k) or last
        summary = self.log.summary(done, self.stopped, self.first_eval, self.last_eval, self.last_ckpt)
        if self.stopped not in (*FINISHED, "stop-at"):
            raise cli.Interrupted(signum=self.signum)
        return summary


class StepStats:
    """A step's statistics over its micro-batches: each a token mean (a micro-batch's value weighted by its share
    of the step's tokens), but those named in max_stats, maxima from the value there; summed (maximised) over
    ranks. `names`: every statistic, for a process without rows, so that every process sums the same list."""

    def __init__(self, max_stats, names=None):
        self.max_stats, self.maxes = max_stats, dict(max_stats)
        self.sums = {k: 0.0 for k in names or () if k not in max_stats}

    def add(self, stats, token_share):
        for key, value in stats.items():
            if key in self.max_stats:
                self.maxes[key] = max(self.maxes.get(key, value), value)
            else:
                self.sums[key] = self.sums.get(key, 0.0) + value * token_share

    def global_totals(self, loss_sum, out):
        """The loss summed over ranks (returned), and every statistic's total, into `out` by name."""
        loss_sum, *totals = global_sum([loss_sum, *self.sums.values()])
        out.update(zip(self.sums, totals))
        out.update(zip(self.maxes, global_sum(self.maxes.values(), op="max")))
        return loss_sum


UPDATE_BOOKKEEPING = ("skipped", "kept_rows", "kept_rows_all", "rows_all", "flat_all")  # policy_update's, not stats
