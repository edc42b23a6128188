"""Checkpoints and --resume of a 05 run: checkpoint-NNNNNN folders holding the adapter (written and read by
the callables 05 passes in, PEFT's layout from stage 02) and trainer_state.pt (AdamW state, step, the AQN
feedback controller, RNG states as a safety net, the run's arguments and a record of what it ran on). The LR
schedule and the per-step generators are pure functions of (seed, step), so a resumed run is, bit for bit,
the uninterrupted one. trainer_state.pt is read with weights_only=True: tensors and plain values, never code.
Imports no stage.
"""
import errno
import hashlib
import math
import os
import pickle
import random
import re
import warnings

import torch

from qerl import files
from qerl import hf_files

# how to compute or watch, not what: a resume may change them
RUNTIME_ARGS = ("out", "resume", "time_budget", "stop_at", "eval_every", "save_every", "device", "quiet",
                "micro_batch", "grad_checkpoint", "gpu_path", "compile", "dist_timeout", "kl_after_rows",
                "show_step", "plain")
INHERITED_RUNTIME_ARGS = ("time_budget", "eval_every", "save_every", "quiet", "micro_batch", "grad_checkpoint",
                          "compile", "kl_after_rows", "plain")  # a resume keeps these unless given again


# Saved arguments args.json may hold otherwise: the paths as given (the run record checks them) and the number
# of ranks (a resume may change it)
NOT_RECORDED = ("model", "data", "eval_data", "world_size")
RUN_FILES = ("args.json", "metrics.jsonl", "summary.json")  # what a run writes in its folder, beside its checkpoints
CHECKPOINT_FILES = ("trainer_state.pt", "adapter_config.json", "adapter_model.safetensors")  # what a checkpoint holds


def checkpoint_step(name):
    """The step a checkpoint-NNNNNN folder's name gives (ASCII digits), else None."""
    found = re.fullmatch(r"checkpoint-([0-9]+)", name)
    return int(found.group(1)) if found else None


def is_run_file(name):
    """Whether `name` in a run folder is one of the files a run writes."""
    return name in RUN_FILES or checkpoint_step(name) is not None


def check_run_links(folder):
    """Refuse a run folder whose own files (the run files, its checkpoints, the lock) are symbolic links: a run
    writes them, and a planted link would send metrics.jsonl's lines, a checkpoint or the lock's PID into
    its target (a dangling one would make it)."""
    if os.path.isdir(folder):
        files.refuse_links(folder, sorted(n for n in os.listdir(folder) if is_run_file(n) or n == files.LOCK_FILE),
                           "qerl/train.py")


def save_checkpoint(out, step, opt, params, args, write_adapter, lora_targets, feedback=None, extra=None):
    """checkpoint-<step> in `out`: write_adapter(folder) writes the adapter files, then trainer_state.pt; None
    (and the last good checkpoint stays) if a trained tensor is not finite. lora_targets: see run_record."""
    if not all(torch.isfinite(p).all() for p in params):
        print(f"checkpoint | step {step} | adapter has non-finite values | NOT saved")
        return None

    def write(tmp):
        os.makedirs(tmp)
        write_adapter(tmp)
        file = os.path.join(tmp, "trainer_state.pt")
        try:
            torch.save({"step": step, "optimizer": opt.state_dict(), "lr": opt.param_groups[0]["lr"],
                        "args": vars(args), "run": run_record(args, lora_targets),
                        "feedback": feedback.state_dict() if feedback is not None else None,
                        "torch_rng": torch.get_rng_state(), "python_rng": random.getstate(),
                        "cuda_rng": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
                        **(extra or {})}, file)
        except RuntimeError:  # torch's zip writer reports a failed write (a full disk) so, without the reason
            raise OSError(errno.EIO, "torch.save could not write it: is the disk full?", file) from None
    return files.atomic_write(os.path.join(out, f"checkpoint-{step:06d}"), write)


def model_fingerprint(model_dir):
    """sha256 of a model folder's config.json and its weights' safetensors headers (names, dtypes, shapes,
    offsets): another model, or the same one changed, has another; no tensor is read."""
    _, weight_map, _ = hf_files.find_weight_files(model_dir)
    h = hashlib.sha256()
    for name in ["config.json", *sorted(set(weight_map.values()))]:
        with files.open_regular(os.path.join(model_dir, name)) as f:
            h.update(f.read() if name == "config.json" else f.read(8 + int.from_bytes(f.read(8), "little")))
    return h.hexdigest()


def run_record(args, lora_targets):
    """What a checkpoint says about its run, checked on --resume: the base (an absolute path, so a resume from
    another directory finds it, and its fingerprint), the data files' absolute paths, quant and LoRA shape
    (lora_targets: the module names the adapters wrap)."""
    where = {k: os.path.abspath(getattr(args, k)) if getattr(args, k) else None for k in ("model", "data", "eval_data")}
    return {**where, "model_fingerprint": model_fingerprint(args.model), "quant": args.quant,
            "quant_method": args.quant_method, "lora_r": args.lora_r, "lora_alpha": args.lora_alpha,
            "lora_targets": list(lora_targets)}


def read_trainer_state(file, defaults):
    """trainer_state.pt, loaded without running code, with the types resume_args and restore rely on
    (each saved flag's value of the kind of its default in `defaults`, the parser's)."""
    damaged = f"{file} cannot be read ({{}}): the checkpoint is damaged; resume from an earlier checkpoint-NNNNNN " \
              f"folder beside it"
    try:
        with warnings.catch_warnings():  # torch warns about a bare pickle's protocol: the line below says it all
            warnings.simplefilter("ignore")
            state = torch.load(file, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        if "Weights only load failed" in str(e):
            raise ValueError(f"{file} holds pickled Python objects, which a checkpoint of qerl/train.py never does: "
                             f"refused unread (loading it could run code); resume only from checkpoints you trust") \
                from None
        raise ValueError(damaged.format(type(e).__name__)) from None
    except Exception as e:  # torch.load raises RuntimeError, EOFError or pickle's errors on a damaged file
        raise ValueError(damaged.format(type(e).__name__)) from None
    want = {"step": int, "args": dict}  # what resume_args reads; restore checks the rest as it loads it
    if not isinstance(state, dict):
        raise ValueError(damaged.format(f"a {type(state).__name__}, not a dict"))
    for k, kind in want.items():
        if not isinstance(state.get(k), kind) or isinstance(state[k], bool):
            raise ValueError(damaged.format(f"its {k} is {type(state.get(k)).__name__}, not {kind.__name__}"))
    for k, v in state["args"].items():  # each saved flag's value has the kind of its default (or FLAG_KINDS')
        kinds = FLAG_KINDS.get(k, {type(defaults.get(k))})
        kinds = kinds | {int, float} if kinds & {int, float} else kinds  # 0.0 for a default of 540, say
        if defaults.get(k) is not None and v is not None and type(v) not in kinds:
            raise ValueError(damaged.format(f"its args.{k} is {v!r}, not a value of --{k.replace('_', '-')}"))
    return state


# The flags whose values are of more than one kind: --micro-batch is "auto" or a number of rows. Its default was
# the int 0 (all rows at once) until 20a2201 (2026-12-02) made it "auto"; 0 still means all rows at once, so such
# a checkpoint resumes as it ran.
FLAG_KINDS = {"micro_batch": {str, int}}


def resume_args(args, defaults):
    """--resume: (checkpoint folder, its trainer state), with the run's hyper-parameters taken from it
    (a flag given again is ignored, with a note); (None, None) without --resume. defaults: {flag dest: the
    parser's default}, to tell a flag given again from one left out."""
    if not args.resume:
        return None, None
    ckpt = args.resume
    if not os.path.lexists(os.path.join(ckpt, "trainer_state.pt")):  # a run folder: its latest checkpoint
        found = latest_checkpoint(ckpt)
        ran = sorted(n for n in os.listdir(ckpt) if is_run_file(n)) if os.path.isdir(ckpt) else []
        if not found and ran:  # a run that died before its first checkpoint: --out refuses the folder too
            raise FileNotFoundError(f"--resume {ckpt!r}: no checkpoint there: its run ({', '.join(ran)}) stopped "
                                    f"before its first checkpoint, so nothing can be continued; start a new run "
                                    f"with another --out, or delete those files to reuse {ckpt}")
        if not found:
            raise FileNotFoundError(f"--resume {ckpt!r}: no checkpoint there (expected a checkpoint-NNNNNN folder "
                                    f"with trainer_state.pt, or a run folder containing one)")
        ckpt = found
    # The run folder (its args.json is read below, its checkpoint was found by name) and the checkpoint's files:
    # a run made them all, so a link among them was planted, and would lead the reads outside
    check_run_links(os.path.dirname(os.path.abspath(ckpt)))
    files.refuse_links(ckpt, CHECKPOINT_FILES, "qerl/train.py")
    file = os.path.join(ckpt, "trainer_state.pt")
    files.check_regular(file)  # not a pipe: torch.load would wait on it
    state = read_trainer_state(file, defaults)
    saved = dict(state["args"], **check_run_record(args, ckpt, state, defaults))
    saved.update(settings_not_saved(file, ckpt, state, saved, defaults))
    saved.update(older_values(file, state, saved))
    for k, v in saved.items():
        if k in RUNTIME_ARGS:  # how to compute: the command line's, else the run's own (not the default)
            if k in INHERITED_RUNTIME_ARGS and getattr(args, k, None) == defaults.get(k):
                setattr(args, k, v)
            continue
        if getattr(args, k, v) not in (v, defaults.get(k)):
            print(f"note | --{k.replace('_', '-')} {getattr(args, k)} ignored: resuming keeps the checkpoint's {v}")
        setattr(args, k, v)
    args.out = args.out or os.path.dirname(os.path.abspath(ckpt))
    step = state.get("step")
    if type(step) is not int or not 0 <= step <= args.steps:  # 10**18 would skip the loop and report success
        raise ValueError(f"--resume: {file} says step {step!r}, outside 0..{args.steps} (the run's --steps): the "
                         f"checkpoint is damaged; resume from another checkpoint")
    named = checkpoint_step(os.path.basename(os.path.normpath(ckpt)))
    if named is not None and named != step:  # a renamed checkpoint would be taken for another step's
        raise ValueError(f"--resume: {file} says step {step}, but its folder's name says {named}: the checkpoint "
                         f"was renamed or edited; resume from another checkpoint")
    return ckpt, state


# The settings the trainer gained after it first wrote checkpoints, oldest first, each with the value every run
# had before it existed (a callable: read from the checkpoint's other arguments). A checkpoint written before a
# setting lacks it and every later one; one that lacks it but holds a later one was edited.
ADDED_LATER = (
    {"task": lambda saved: "arithmetic" if saved.get("data") in (None, "arith") else "gsm8k"},  # 04cb920
    {"quant_method": "rtn"},  # 945a4eb
    {"pi_old": "sampler"},  # 0606ce1: the sampler's reading, until the trainer's became the default
    {"aqn_scale": "absolute", "tis_cap": 2.0},  # cd54d4c
    {"aqn_site": "norms", "dynamic_sampling": 0},  # 2f4cd1d
    {"max_completions": 0},  # df557ee
    {"ratio_level": "token"},  # the ratio per token, until --ratio-level
)


def _flag(dest):
    return "--" + dest.replace("_", "-")


def _flags(values):
    return ", ".join(f"{_flag(k)} {v}" for k, v in values.items())


def settings_not_saved(file, ckpt, state, saved, defaults):
    """--resume: the settings the run reads (every flag but RUNTIME_ARGS) that trainer_state.pt's arguments lack
    -> {flag dest: value}: from the checkpoint's run record, else its run's args.json, else, for a checkpoint
    written before the setting existed (ADDED_LATER), the value every run had then; a note names each. Any other
    is one line: the command line's value (its default, mostly) would change the run unseen."""
    missing = [k for k in defaults if k not in saved and k not in RUNTIME_ARGS]
    if not missing:
        return {}
    args_json = os.path.join(os.path.dirname(os.path.abspath(ckpt)), "args.json")
    folder = files.read_json(args_json) if os.path.lexists(args_json) else {}
    found = {}
    for source, where in ((state.get("run"), "its run record"), (folder, "its run's args.json")):
        took = {k: source[k] for k in missing if isinstance(source, dict) and k in source and k not in found}
        if took:
            print(f"note | {file} does not say {_flags(took)}: taken from {where}")
        found.update(took)
    have = set(saved) | set(found)
    era = len(ADDED_LATER)  # the first setting this checkpoint was written before
    while era and not have & set(ADDED_LATER[era - 1]):
        era -= 1
    older = {k: v for group in ADDED_LATER[era:] for k, v in group.items() if k in missing and k not in found}
    unknown = [k for k in missing if k not in found and k not in older]
    if unknown:
        raise ValueError(f"--resume: {file} does not say {', '.join(map(_flag, unknown))}, which the run reads, "
                         f"and neither does its run's args.json: the checkpoint is damaged or edited (this command "
                         f"line's value would change the run unseen); resume from another checkpoint")
    older = {k: v(saved) if callable(v) else v for k, v in older.items()}
    if older:
        print(f"note | {file} was written before {', '.join(map(_flag, older))} existed: its run had "
              f"{_flags(older)}")
    if "task" in older and saved.get("data") == "arith":  # --data arith named the arithmetic task then
        older["data"] = None
    return {**found, **older}


def older_values(file, state, saved):
    """--resume: the saved values an earlier trainer wrote that now read otherwise -> {flag dest: today's value},
    with a note. --dtype None (before 20a2201) was bfloat16 on CUDA and under --gpu-path, else float32: the
    device the run ran on says which (its --device, else whether it saved CUDA's generators)."""
    if "dtype" not in saved or saved["dtype"] is not None:
        return {}
    device = saved.get("device") or ("cuda" if state.get("cuda_rng") is not None else "cpu")
    dtype = "bfloat16" if saved.get("gpu_path") or str(device).startswith("cuda") else "float32"
    print(f"note | {file} says --dtype None, its trainer's default: {dtype}, as that trainer chose on {device}")
    return {"dtype": dtype}


def check_run_record(args, ckpt, state, defaults):
    """--resume: the checkpoint's run record against its run folder's args.json and the model on disk ->
    the saved args to replace (the absolute paths). One line for a checkpoint of another run, or a model
    gone or changed; --model given again points at the run's model if it has moved."""
    run = state.get("run")
    if not isinstance(run, dict):
        print(f"note | {ckpt} has no record of its model (an older checkpoint): not checked")
        return {}
    args_json = os.path.join(os.path.dirname(os.path.abspath(ckpt)), "args.json")
    folder = files.read_json(args_json) if os.path.lexists(args_json) else {}
    keys = [k for k in ("quant", "quant_method", "lora_r", "lora_alpha") if k in folder and k in run]
    ours, theirs = (", ".join(f"{k} {a[k]}" for k in keys) for a in (run, folder))
    if ours != theirs:
        raise ValueError(f"--resume: {ckpt} is of a run with {ours}, but its folder's args.json is of one with "
                         f"{theirs}: it belongs to another run; resume it from its own run folder")
    model = args.model if args.model != defaults["model"] else run.get("model")
    found = model_fingerprint(model) if isinstance(model, str) and os.path.isdir(model) else None
    if found != run.get("model_fingerprint"):
        what = "is not there" if found is None else "is another model (its config.json or weights differ)"
        raise ValueError(f"--resume: {ckpt} was trained on {run.get('model')}, and {model} {what}: pass --model with "
                         f"the folder of the run's model")
    return {"model": model, **{k: run[k] for k in ("data", "eval_data") if run.get(k)}}


def check_saved_args(ckpt, state):
    """--resume: the hyper-parameters the checkpoint gives (each within its flag's range: an edited lr of 1e6
    is) are those its run recorded in args.json; one line naming the first that differs."""
    args_json = os.path.join(os.path.dirname(os.path.abspath(ckpt)), "args.json")
    folder = files.read_json(args_json) if os.path.lexists(args_json) else {}  # a run before args.json: unchecked
    for k, v in state["args"].items():
        if k in folder and k not in (*RUNTIME_ARGS, *NOT_RECORDED) and folder[k] != v:
            raise ValueError(f"--resume: {os.path.join(ckpt, 'trainer_state.pt')} says --{k.replace('_', '-')} {v!r}, "
                             f"but its run's args.json says {folder[k]!r}: one of them was edited; resume from a "
                             f"checkpoint that agrees with args.json")


def check_progress(ckpt, state, args):
    """--resume: what trainer_state.pt says of its run's progress besides the step, against that step and the run's
    arguments. `completions`, the completions sampled so far (what --max-completions counts and its schedules read),
    is a whole number within what the steps done sample: --batch x --group a step, up to (1 + --dynamic-sampling)
    times that; a checkpoint under a budget must say it (one from before --max-completions ran without one).
    `first_eval`, the run's first evaluation (its start, for the summary's gain and --time-budget's reserve), is
    None (--eval-size 0, or a checkpoint from before it was kept) or the record of an evaluation at or before
    the checkpoint's step. One line naming the file for anything else (a traceback, or a budget overrun, unseen)."""
    file, step = os.path.join(ckpt, "trainer_state.pt"), state["step"]
    damaged = "the checkpoint is damaged or edited; resume from another checkpoint"
    done = state.get("completions")
    if done is None and args.max_completions:
        raise ValueError(f"--resume: {file} does not say how many completions its run sampled, which its "
                         f"--max-completions {args.max_completions} counts: {damaged}")
    lo = step * args.batch * args.group
    hi = lo * (1 + args.dynamic_sampling)
    if done is not None and (type(done) is not int or not lo <= done <= hi):
        span = f"{lo:,}" if lo == hi else f"{lo:,} to {hi:,}"
        raise ValueError(f"--resume: {file} says its run sampled {done!r} completions, but {step} step(s) of --batch "
                         f"{args.batch} x --group {args.group} sample {span}: {damaged}")
    first = state.get("first_eval")
    if first is None:
        return
    fields = (first.get("step"), first.get("greedy"), first.get("seconds")) if isinstance(first, dict) else ()
    if not (len(fields) == 3 and type(fields[0]) is int and 0 <= fields[0] <= step
            and all(type(x) in (int, float) and math.isfinite(x) for x in fields[1:])):
        raise ValueError(f"--resume: {file}'s first_eval is not the record of an evaluation at step 0..{step} (a dict "
                         f"with its step, greedy and seconds): {damaged}")


def latest_checkpoint(folder):
    """The run folder's checkpoint-NNNNNN of the highest step, by number (checkpoint-2 is older than
    checkpoint-000004; of two names for one step, the one a run writes); None if it has none."""
    names = [d for d in os.listdir(folder) if checkpoint_step(d) is not None] if os.path.isdir(folder) else []
    newest = max(names, key=lambda d: (checkpoint_step(d), d == f"checkpoint-{checkpoint_step(d):06d}"), default=None)
    return os.path.join(folder, newest) if newest else None


def finished_run(args, ckpt, state):
    """--resume of a run that ended with its final evaluation at its last step, or where --max-completions stopped
    it (its summary.json says it was stopped by "steps", or "completions", at the checkpoint's step): nothing to
    add (no step, evaluation, checkpoint or log line); the summary, as the run wrote it, is printed and returned.
    Else None: a run stopped at its last step by a signal or --stop-at resumes to its final evaluation, once."""
    if not state:
        return None
    file = os.path.join(os.path.dirname(os.path.abspath(ckpt)), "summary.json")
    try:
        summary = files.read_json(file)
    except ValueError:  # missing or damaged: the resume writes it again
        return None
    stopped, done = summary.get("stopped_by"), summary.get("steps_done")
    if done != state["step"] or not (stopped == "steps" and done == args.steps or
                                     stopped == "completions" and getattr(args, "max_completions", 0)):
        return None
    where = f"of --steps {args.steps}" if stopped == "steps" else \
        f"(--max-completions {args.max_completions} stopped the run there)"
    print(f"resume | {ckpt} is step {done} {where}: the run is finished, nothing to add (to train further, start "
          f"a new run)")
    gain = summary.get("greedy_gain")
    print(f"summary | steps {done} | stopped by {stopped}" +
          (f" | greedy {100 * gain:+.1f} points" if isinstance(gain, float) else "") + f" | {file}")
    return summary


def restore(ckpt, state, load_adapter, opt, feedback):
    """Load a checkpoint's adapter (load_adapter(folder), which checks its config against the model's), AdamW's
    per-parameter state (adam_state), the controller and RNG states; returns its step."""
    try:
        load_adapter(ckpt)
    except ValueError as e:  # a truncated adapter file, say: 02's line, naming the file and a tensor
        raise ValueError(f"--resume: {e} (resume from another checkpoint)") from None
    file = os.path.join(ckpt, "trainer_state.pt")
    moments = adam_state(file, state.get("optimizer"), opt, state["step"] * state["args"].get("mu", 1))
    try:
        # AdamW's settings (lr, betas, eps, weight decay, maximize...) stay those build_policy made from the run's
        # arguments: only the per-parameter moments and step counts come from the file
        opt.load_state_dict({"state": moments, "param_groups": opt.state_dict()["param_groups"]})
        if feedback is not None and state.get("feedback"):
            feedback.load_state_dict(state["feedback"])
        torch.set_rng_state(state["torch_rng"])
        random.setstate(state["python_rng"])
    except (KeyError, TypeError, ValueError, RuntimeError) as e:
        raise ValueError(f"--resume: {file} does not fit this run's optimizer or generators ({type(e).__name__}): "
                         f"the checkpoint is damaged; resume from another checkpoint") from None
    check_finite_state(ckpt, opt)
    print(f"resume | {ckpt} | step {state['step']} | hyper-parameters from the checkpoint")
    return state["step"]


def adam_state(file, saved, opt, max_steps):
    """--resume: trainer_state.pt's AdamW state, checked against this run's optimizer -> {parameter index:
    {step, exp_avg, exp_avg_sq}}. One line naming the first bad value (adam_problem)."""
    params = [p for g in opt.param_groups for p in g["params"]]
    state = saved.get("state") if isinstance(saved, dict) else None
    bad = None if isinstance(state, dict) else "it holds no AdamW state"
    for i, one in (state or {}).items():
        bad = bad or adam_problem(i, one, params, max_steps)
    # AdamW steps every parameter at once: a state for some of them, or of unequal step counts, was edited (the
    # moments left out would start again from zero)
    steps = sorted({float(one["step"]) for one in state.values()}) if state and not bad else []
    if steps and len(state) != len(params):
        bad = f"AdamW's state covers {len(state)} of the run's {len(params)} parameters (a step updates them all)"
    elif len(steps) > 1:
        bad = f"AdamW's step counts differ between parameters ({steps[0]:g} and {steps[-1]:g})"
    bad = bad or shared_moment(state)
    if bad:
        raise ValueError(f"--resume: {file}: {bad}: the checkpoint is damaged; resume from another checkpoint")
    return {i: {"step": torch.tensor(float(one["step"]), dtype=torch.float32), "exp_avg": one["exp_avg"],
                "exp_avg_sq": one["exp_avg_sq"]} for i, one in state.items()}


def adam_problem(i, one, params, max_steps):
    """What is wrong with AdamW's state `one` of parameter index `i` (None: nothing): the index one of the run's
    parameters; each tensor dense and its own (tensor_form); each moment finite and of its parameter's shape and
    dtype, every second moment >= 0 (its square root divides the step); the step count a whole number in
    0..max_steps (the run's steps x --mu)."""
    at = f"parameter {i}"
    if type(i) is not int or not 0 <= i < len(params):
        return f"AdamW's state names {at}, but the run has {len(params)}"
    if not (isinstance(one, dict) and all(torch.is_tensor(one.get(k)) for k in ("step", "exp_avg", "exp_avg_sq"))):
        return f"AdamW's state of {at} is not the tensors step, exp_avg and exp_avg_sq"
    for key in ("step", "exp_avg", "exp_avg_sq"):
        form = tensor_form(one[key])
        if form:
            return f"AdamW's {key} ({at}) is {form}"
    step = one["step"]
    n = float(step) if step.numel() == 1 and not step.is_complex() else float("nan")
    if not (math.isfinite(n) and n == int(n) and 0 <= n <= max_steps):
        return f"AdamW's step count of {at} is not a whole number in 0..{max_steps} ({step.flatten()[:1].tolist()})"
    for key in ("exp_avg", "exp_avg_sq"):
        t = one[key]
        if t.shape != params[i].shape:
            return f"AdamW's {key} ({at}) is {t.dtype} {list(t.shape)}, not of its parameter's {list(params[i].shape)}"
        if t.dtype != params[i].dtype:  # load_state_dict would cast it unseen (float8 has no isfinite)
            return f"AdamW's {key} ({at}) is {t.dtype}, not its parameter's {params[i].dtype}"
        if not bool(torch.isfinite(t).all()):
            return f"AdamW's {key} holds a non-finite value ({at})"
        if key == "exp_avg_sq" and bool((t < 0).any()):
            return f"AdamW's exp_avg_sq (a second moment) holds a negative value ({at})"
    return None


def shared_moment(state):
    """The first AdamW moment in `state` ({index: {exp_avg, exp_avg_sq}}) whose memory another one shares, as a
    sentence; None if each holds its own. AdamW updates every moment in place: shared, they would mix unseen."""
    owners = {}  # storage -> the moment that holds it
    for i, one in state.items():
        for key in ("exp_avg", "exp_avg_sq"):
            name = f"{key} (parameter {i})"
            other = owners.setdefault(one[key].untyped_storage().data_ptr(), name) if one[key].numel() else name
            if other != name:  # (an empty tensor holds no memory to share)
                return f"AdamW's {name} shares its memory with {other}"
    return None


def tensor_form(t):
    """What keeps tensor `t` from being AdamW state read from trainer_state.pt (None: nothing): values of its own,
    on the CPU (where the file is loaded), dense and contiguous. A sparse or nested tensor has no isfinite or
    in-place step; a meta tensor no values; an expand()ed view (stride 0) shares one value among many elements,
    and AdamW's in-place update of it fails mid-step."""
    if t.is_nested or t.layout != torch.strided:
        return f"a {'nested' if t.is_nested else str(t.layout).replace('torch.', '')} tensor, not a dense one"
    if t.is_meta:
        return "a meta tensor, which holds no values"
    if t.device.type != "cpu":
        return f"on {t.device}, not on the CPU, where trainer_state.pt is loaded"
    if not t.is_contiguous():
        return f"a view with strides {list(t.stride())} (elements sharing memory, or apart), not a contiguous tensor"
    return None


def check_finite_state(ckpt, opt):
    """--resume: every trained tensor (the adapter, trained norms) finite. One line naming the first bad one."""
    for i, p in enumerate(p for g in opt.param_groups for p in g["params"]):
        if not bool(torch.isfinite(p).all()):
            raise ValueError(f"--resume: {ckpt}: the adapter (or a trained norm) holds a non-finite value (parameter "
                             f"{i}): the checkpoint is damaged; resume from another checkpoint")
