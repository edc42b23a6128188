"""A study's files (bench/compare_methods.py): JSON read within bounds, regular files only, whole files
written; the runs in <out>/runs/ and their committed pack <out>/runs.tar.xz; one run read and checked
field by field; what this script may replace in --out (its manifest); the invocation log."""
import contextlib
import fcntl
import io
import json
import lzma
import math
import os
import re
import shutil
import stat
import statistics
import tarfile
import time

from studies import METHODS, ROOT
from study_stats import collapse

# ---------------------------------------------------------------------------------------------------
# Reading and writing: JSON within bounds, regular files only, whole files (a temporary, then a rename)

MAX_DEPTH = 64  # this script writes 5 levels, 05 about 4; json's own limit is the stack's (a RecursionError)


def load_json(text, where="it"):
    """json.loads, bounded as files.read_json is: nesting deeper than MAX_DEPTH (up to the 100,000 "[" that
    overflow json's recursion) is a ValueError naming `where`, which each reader turns into its one line."""
    try:
        obj = json.loads(text)
    except RecursionError:
        obj = None
    else:
        stack = [(obj, 1)]
        while stack:  # a loop, not a recursion: the check must not overflow where json did not
            value, depth = stack.pop()
            if depth > MAX_DEPTH:
                break
            if isinstance(value, (dict, list)):
                stack.extend((v, depth + 1) for v in (value.values() if isinstance(value, dict) else value))
        else:
            return obj
    raise ValueError(f"{where} nests its JSON deeper than {MAX_DEPTH} levels")


def read_regular(path):
    """The text of a regular file. A link, a FIFO (whose read would wait forever) or a device is refused
    (ValueError naming it); a missing file is FileNotFoundError."""
    if not stat.S_ISREG(os.lstat(path).st_mode):
        raise ValueError(f"{path} is not a regular file (a link, a pipe or a device): replace it with the file, or "
                         f"delete it")
    with open(path) as f:
        return f.read()


def write_text(path, text):
    tmp = path + f".tmp{os.getpid()}"  # copies of this script run at once: each its own temporary
    try:
        with open(tmp, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.remove(tmp)


def short(path):
    """A path inside the repository as a relative one (for printing commands)."""
    full = os.path.abspath(path) if os.sep in path else path
    return os.path.relpath(full, ROOT) if full.startswith(ROOT + os.sep) else path


def finished_steps(files):
    """The budget of a finished run (its summary.json: as many steps done as its --steps), None for a run
    that did not finish. files: {file name: text} of the run (run_files, or one run of stored_runs), None
    if it never started."""
    try:
        s = load_json((files or {})["summary.json"])
    except (KeyError, ValueError):
        return None
    done = isinstance(s, dict) and isinstance(s.get("args"), dict) and is_count(s.get("steps_done"))
    if done and s.get("stopped_by") == "completions" and is_count(s["args"].get("steps")):
        return s["args"]["steps"]  # it spent its --max-completions: finished, its --steps its schedule's length
    return s["steps_done"] if done and s["args"].get("steps") == s["steps_done"] else None


def is_done(files, steps):
    """A finished run of the same budget is reused instead of trained again (unless --force)."""
    return finished_steps(files) == steps


# ---------------------------------------------------------------------------------------------------
# Where the runs are kept: <out>/runs/, the working area, and <out>/runs.tar.xz, its committed copy
# (which command reads and writes which: the docstring)

PACK = "runs.tar.xz"
PACKED_FILES = ("args.json", "metrics.jsonl", "summary.json", "versions.txt")  # train.log repeats the evals
RUN_DIR = re.compile(r"^(?P<method>[a-z0-9-]+)-s(?P<seed>\d+)$")  # a run's folder: <method>-s<seed>


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
            rec = load_json(line)
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
    flags = [part for f in flags for part in (f.split("=", 1) if f.startswith("--") else [f])]  # --lr=2e-3
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
        obj = load_json(text, where)
    except json.JSONDecodeError as e:
        problems.append(f"{where} is not JSON ({e})")
        return None
    except ValueError as e:  # nested too deep
        problems.append(str(e))
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
            argv = load_json(argv)
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
    summary = load_json(files["summary.json"])
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
            "max_completions": a.get("max_completions") or None,
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
            "skipped_updates": summary.get("skipped_updates", 0), **read_versions(files.get("versions.txt", "")),
            # what it sampled (runs from before the trainer counted it: None), and which held-out problems its
            # final greedy answers got right ("0"/"1" a problem, in the evaluation's order; older runs: None)
            "completions": sum(r["completions"] for r in steps)
            if all(is_count(r.get("completions")) for r in steps) else None,
            "final_outcomes": outcomes_text(final)}


def outcomes_text(evaluation):
    """An evaluation's per-problem outcomes ("0"/"1" a problem) if it holds them, one per problem it
    counted, else None: a run's file is untrusted text."""
    text = evaluation.get("outcomes")
    ok = isinstance(text, str) and len(text) == evaluation["n"] and not text.strip("01")
    return text if ok else None


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
    return load_json(line[5:]) if line else None


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
                           load_json(runs[name]["summary.json"])["args"]))
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
    budgets = sorted({budget(r) for r in records})
    if len(budgets) > 1:
        raise ValueError(f"runs in {where} have different budgets {budgets}: an unequal budget is not a "
                         f"fair comparison (move the odd ones away or retrain them with --force)")
    check_same_settings(args, loaded)
    return records


def budget(record):
    """What a run was given: its --max-completions where it had one (its steps then differ by design: a
    refilling run samples more a step), else its steps."""
    if record.get("max_completions"):
        return f"{record['max_completions']:,} completions"
    return f"{record['steps']} steps"


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
        obj = load_json(read_regular(path))
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
            obj = load_json(read_regular(path))
            return isinstance(obj, dict) and {"threshold_points", "methods", "runs"} <= set(obj)
        if name == "invocations.jsonl":
            recs = [load_json(line) for line in read_regular(path).splitlines() if line.strip()]
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


# ---------------------------------------------------------------------------------------------------
# The invocation log: <out>/invocations.jsonl, one line per command of a study


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
