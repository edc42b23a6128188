"""The runner of a study (bench/compare_methods.py): the code snapshot every run executes, the claims that
let copies of the script share a study, one qerl/train.py process per (method, seed), and a study's phases."""
import contextlib
import hashlib
import importlib
import json
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
import tempfile
import time

from studies import ROOT, STUDIES, resolve
from study_files import (finished_steps, flag_values, load_json, load_run, owned_outputs, parse_object, read_regular,
                         refuse_bad, run_files, run_problems, same_value, short, stored_runs, versions_argv,
                         write_text)
from study_report import fmt, study_best

cli = importlib.import_module("qerl.cli")

files = importlib.import_module("qerl.files")
checkpoints = importlib.import_module("qerl.checkpoints")  # which files a 05 run writes in its folder

# ---------------------------------------------------------------------------------------------------
# Running: one subprocess per (method, seed), at most --parallel at a time


# what a run imports: the five stages (by their name: a torch.py beside them is never copied) and the .py
# modules of the packages beneath them, qerl/ and kernels/ (read_code: the manifest of what a run executes)
STAGE_FILE = re.compile(r"\d\d_\w+\.py")
CODE_FILES = (*sorted(f for f in os.listdir(ROOT) if STAGE_FILE.fullmatch(f)), "kernels", "qerl")
SNAPSHOT = ".code"              # <runs>/.code: the study's code, by which copies of this script agree on it
SNAPSHOT_RECORD = ".made.json"  # in it: {"md5": tree_hash, "owner": [pid, start]} of the copy that made it
PRIVATE_CODE = "qerl-study-code-"  # the prefix of the folder (mode 0700, in TMPDIR) whose copy the runs import
# how a run's python starts: -E ignores PYTHONPATH (a folder there would come before the site packages) and
# every other PYTHON* variable, so -B and -u say what PYTHONDONTWRITEBYTECODE and PYTHONUNBUFFERED said
PYTHON_FLAGS = ("-E", "-B", "-u")


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


def entries_md5(entries):
    """md5 over entries [(path, kind, data)]: kind "file" (data: its bytes), "dir", "link" (data: its
    target) or "other" (data: its mode), in the order of their paths."""
    h = hashlib.md5()
    for rel, kind, data in sorted(entries, key=lambda e: e[0]):
        if kind == "file":
            h.update(f"file {rel} {len(data)}\n".encode())
            h.update(data)
        else:
            h.update(f"{kind} {rel}{'' if data is None else f' {data}'}\n".encode())
    return h.hexdigest()


def folder_entries(folder):
    """Everything under `folder` but its record, as entries_md5 reads them."""
    found = []
    for root, dirs, names in os.walk(folder):
        for name in dirs + names:
            path = os.path.join(root, name)
            rel = os.path.relpath(path, folder)
            if rel == SNAPSHOT_RECORD:
                continue
            mode = os.lstat(path).st_mode
            if stat.S_ISLNK(mode):
                found.append((rel, "link", os.readlink(path)))
            elif stat.S_ISDIR(mode):
                found.append((rel, "dir", None))
            elif not stat.S_ISREG(mode):  # a pipe or a device: named, never read (a pipe's read would wait)
                found.append((rel, "other", mode))
            else:
                with open(path, "rb") as fh:
                    found.append((rel, "file", fh.read()))
    return found


def tree_hash(folder):
    """md5 over everything under `folder` but its record: each entry's path, kind and bytes (a link: its
    target). Unlike code_hash it misses nothing a run could import: a file added to a copy of the code (a
    torch.py, a __pycache__/*.pyc) changes it too. A copy intact has the md5 of the code it was written
    from (entries_md5 of read_code)."""
    return entries_md5(folder_entries(folder))


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


def read_code(root=ROOT):
    """The code the runs of this invocation execute, read once into memory as entries (entries_md5): the
    manifest is CODE_FILES, of a package its .py files (code_hash's files), nothing else (no __pycache__,
    no file added beside them). Every copy a run or a second copy of this script reads is written from
    these bytes, and the md5 the study records is theirs: what was hashed is what runs."""
    code = []
    for name in CODE_FILES:
        path = os.path.join(root, name)
        if os.path.isdir(path):
            code.append((name, "dir", None))
            found = sorted(os.path.join(name, f) for f in os.listdir(path)
                           if f.endswith(".py") and os.path.isfile(os.path.join(path, f)))
        else:
            found = [name]
        for rel in found:
            with open(os.path.join(root, rel), "rb") as f:
                code.append((rel, "file", f.read()))
    return code


def write_code(dest, code):
    """Write read_code's entries into the empty folder `dest`: each file new (O_EXCL), no link followed."""
    for rel, kind, data in sorted(code, key=lambda e: e[0]):
        path = os.path.join(dest, rel)
        if kind == "dir":
            os.mkdir(path)
        else:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
            with os.fdopen(fd, "wb") as f:
                f.write(data)


def open_ancestor(folder):
    """The first folder above `folder` through which another user could move it away and put another in
    its place (one writable by a group or by all without /tmp's sticky bit, or owned by another user than
    this one or root); None when there is none."""
    parent = os.path.dirname(folder)
    while True:
        st = os.lstat(parent)
        if st.st_uid not in (0, os.getuid()) or (st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)
                                                 and not st.st_mode & stat.S_ISVTX):
            return parent
        if os.path.dirname(parent) == parent:
            return None
        parent = os.path.dirname(parent)


def private_code(code, md5):
    """A copy of `code` only this user can write, which the runs of this invocation import: a new folder
    (tempfile.mkdtemp: an unpredictable name, mode 0700, in TMPDIR: not in --out, where another process
    may write) written from the bytes that were hashed. A copy in runs/ could be edited between its check
    and a run's imports (and restored after: no trace); only a process of this user can edit this one.
    Its caller removes it (remove_private) when the study ends."""
    try:
        folder = os.path.realpath(tempfile.mkdtemp(prefix=PRIVATE_CODE))  # the path the runs import, no link in it
    except OSError as e:  # gettempdir: no writable folder among TMPDIR, /tmp, /var/tmp and here
        raise ValueError(f"no private folder for the runs' code could be made ({e.strerror or e}): set TMPDIR to "
                         f"a folder of yours that you can write") from None
    try:
        shared = open_ancestor(folder)
        if shared:
            raise ValueError(f"{shared} (above {folder}, where the runs' code goes) can be written by another user, "
                             f"who could replace that code before a run imports it: set TMPDIR to a folder only you "
                             f"can write (or /tmp)")
        write_code(folder, code)
        got = tree_hash(folder)
        if got != md5:  # only a process of this user can write there
            raise ValueError(f"{folder} changed while this script wrote it (md5 {md5}, now {got}): not running it; "
                             f"stop whatever writes in TMPDIR, then rerun")
    except BaseException:
        remove_private(folder)
        raise
    return folder


def remove_private(folder):
    """Remove a private_code folder (only one: named as private_code names them, a folder, this user's)."""
    try:
        st = os.lstat(folder)
    except FileNotFoundError:
        return
    if os.path.basename(folder).startswith(PRIVATE_CODE) and stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid():
        shutil.rmtree(folder, ignore_errors=True)


def prepare_code(runs_root, code=None):
    """The study's code snapshot <runs>/.code of `code` (read_code's entries; default: this checkout's, read
    now): (folder, its md5, made here). No run imports it: each invocation's runs import a private_code copy
    of the same bytes, which no other process can edit between its check and a run's imports. The snapshot
    is what copies of this script sharing a study agree on: a second copy, started while the first runs,
    goes on only if its own code is the snapshot's byte for byte, so every run of a study executes the same
    code even if someone edits qerl/train.py meanwhile (15 runs take most of an hour). Which process a
    record names proves nothing (any process can put compare_methods.py on its command line), so a live
    maker only keeps its snapshot from being removed: one with other code is refused. Any other .code
    (planted, edited, or left by a version of this script without records) is refused too, and left as it
    is; a snapshot of this checkout's files left by a copy that has exited is made again. It is written in
    a new folder (tempfile.mkdtemp: an unpredictable name, mode 0700) and renamed into place only when that
    holds the code's bytes and nothing else."""
    code = read_code() if code is None else code
    md5 = entries_md5(code)
    snap = os.path.join(runs_root, SNAPSHOT)
    for _ in range(2):
        record = read_record(snap)
        if record and is_live_copy(record["owner"]):
            got = tree_hash(snap)
            if got != record["md5"]:
                raise ValueError(f"{short(snap)} changed since process {record['owner'][0]} made it (md5 "
                                 f"{record['md5']}, now {got}): not running it; wait for that process to end "
                                 f"(or stop it), delete {short(snap)}, then rerun")
            if got != md5:
                raise ValueError(f"{short(snap)} holds other code than this checkout's stage files (md5 {got}, "
                                 f"here {md5}; its record names process {record['owner'][0]}): not running it; "
                                 f"wait for that study to end, or use another --out")
            return snap, got, False
        if os.path.lexists(snap):
            if not os.path.islink(snap) and tree_hash(snap) == md5:
                shutil.rmtree(snap)  # this checkout's files, left by a copy of this script that was killed
            else:
                why = ("it is a link" if os.path.islink(snap) else "its record is missing or unreadable"
                       if not record else "its files differ from its record" if tree_hash(snap) != record["md5"]
                       else "its files are not this checkout's stage files")
                raise ValueError(f"{short(snap)} was not made by a running copy of this script ({why}): this "
                                 f"script runs or removes only a code snapshot of this checkout's stage files; "
                                 f"delete {short(snap)} and rerun")
        tmp = tempfile.mkdtemp(prefix=SNAPSHOT + ".tmp", dir=runs_root)
        try:
            write_code(tmp, code)
            got = tree_hash(tmp)
            if got != md5:  # a file dropped in beside the code's: never made the study's snapshot
                raise ValueError(f"{short(tmp)} changed while this script wrote the code snapshot there (md5 {md5}, "
                                 f"now {got}): not using it; stop whatever writes in {short(runs_root)}, then rerun")
            write_text(os.path.join(tmp, SNAPSHOT_RECORD),
                       json.dumps({"md5": md5, "owner": process_identity(os.getpid())}))
            try:
                os.rename(tmp, snap)  # the snapshot and its record appear at once; fails if a second copy was quicker
            except OSError:
                continue
            tmp = None
            return snap, md5, True
        finally:
            if tmp:  # what this call made, where it was not renamed into place
                shutil.rmtree(tmp, ignore_errors=True)
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
        rec = load_json(read_regular(path))
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
    """The exact qerl/train.py command line of one run."""
    model = [] if any(a.split("=")[0] == "--model" for a in args.train_args) else ["--model", model_dir(args)]
    return ([sys.executable, os.path.join(code_dir, "qerl/train.py"), "--out", run_dir, "--seed", str(seed), "--steps", str(args.steps),
             "--time-budget", "0",  # a fixed number of steps, never cut short by the clock
             "--eval-size", str(args.eval_size), "--eval-every", str(args.eval_every), "--eval-k", str(args.eval_k),
             "--save-every", "0", "--quiet"] + model + args.table[method][1] + args.train_args)


def launch(command):
    """A run's command line as it starts: python with PYTHON_FLAGS, so that only the code's copy, the
    standard library and the site packages come on its sys.path (run as a file, its sys.path starts at the
    copy, never at the working folder)."""
    return [command[0], *PYTHON_FLAGS, *command[1:]]


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
        return name in RUN_LOG or name == files.LOCK_FILE or checkpoints.is_run_file(name)
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
        a = load_json(files["summary.json"])["args"]  # is_done checked it is an object
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


STOP_WAIT_S = 60  # Ctrl-C or kill: how long a run this script started has to stop before it is killed


def run_all(args, methods=None):
    """Train every (method, seed) not already done (methods: default --methods). Returns the (method,
    seed) list in order; sets args.stopped when --max-wall left runs unstarted."""
    runs_root = os.path.join(args.out, "runs")
    # seed-major order: if the runs are stopped early, every method has the same number of seeds
    jobs = [(m, s) for s in args.seeds for m in (methods or args.methods)]
    _, stored = stored_runs(args.out)  # the pack only in a --dry-run without runs/ (else main unpacked it)
    todo, reused, bad = [], [], []
    for m, s in jobs:
        name, run_dir = f"{m}-s{s}", os.path.join(runs_root, f"{m}-s{s}")
        had = None if args.force else finished_steps(stored.get(name))
        if had == args.steps:
            print(f"skip | {name} | already done with {args.steps} steps (--force to retrain)")
            reused.append((m, s))
        elif had is not None:  # a finished run is emptied only by --force, never because a flag changed
            raise ValueError(settings_line(name, "steps", had, args.steps))
        else:
            # 05 writes summary.json whole: one that cannot be read is damage to show, not a run to empty
            if not args.force and "summary.json" in (stored.get(name) or {}):
                parse_object(stored[name]["summary.json"], f"runs/{name}/summary.json", bad)
            todo.append((m, s, run_dir))
    # what would stop the runs later is refused now: a reused run's bad file, other settings, a user's file
    bad += [p for m, s in reused for p in run_problems(stored[f"{m}-s{s}"], f"runs/{m}-s{s}")]
    if bad:
        refuse_bad(bad)
    check_settings(args, reused, stored)
    for _, _, run_dir in todo:
        refuse_foreign(run_dir)
    # the runs start with PYTHON_FLAGS: -B (no __pycache__ in the code's copy: its hash holds) and -u, as -E
    # leaves every PYTHON* variable of this environment unread
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), MKL_NUM_THREADS=str(args.threads))
    if env.get("TMPDIR"):  # the runs start in the checkout: a relative TMPDIR would name another folder there
        env["TMPDIR"] = os.path.abspath(env["TMPDIR"])
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
    print(f"code | running this invocation's copy of the stage files in {short(code_dir)} (only you can write "
          f"there) | md5 {code} (snapshot {md5}" + (")" if args.code_made else ", made by another copy of this script)"))
    if todo:
        m, s, d = todo[0]
        print("command | " + shlex.join(short(c) for c in launch(run_command(args, m, s, d, code_dir))))
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
                done = not args.force and finished_steps(run_files(run_dir)) is not None  # since the plan
                if done or not claim(runs_root, f"{m}-s{s}"):
                    print(f"skip | {m}-s{s} | done or being trained by another copy of this script")
                    continue
                if foreign_files(run_dir):  # appeared since the check above: leave the folder as it is
                    os.remove(os.path.join(runs_root, f".{m}-s{s}.claim"))
                    print(f"skip | {m}-s{s} | {short(run_dir)} now holds {', '.join(foreign_files(run_dir)[:3])}, "
                          f"which neither this script nor 05 wrote")
                    continue
                got = tree_hash(code_dir)
                if got != md5:  # edited since it was written and checked (by this user: it is 0700): never run it
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
                proc = subprocess.Popen(launch(run_command(args, m, s, run_dir, code_dir)), cwd=ROOT, env=env,
                                        stdout=log, stderr=subprocess.STDOUT)
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
            try:  # 05 stops at its step's end with a checkpoint; one that does not is killed (a bounded wait)
                proc.wait(timeout=STOP_WAIT_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            log.close()
            os.remove(os.path.join(runs_root, f".{m}-s{s}.claim"))
        if isinstance(e, KeyboardInterrupt):  # run_cli: one line, exit 130 (143 for kill)
            raise cli.Interrupted("finished runs are kept; rerun the same command to train the rest",
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
             "grad_norm", "s/step", "mismatch_kl", "is_w_mean", "is_w_max", "is_beyond_cap", "is_ess",
             "frac_zero_std", "ds_rounds", "ds_flat_before", "ds_sampled", "completions", "lr")


def compact_metrics(run_dir):
    """Keep what the report and the curves read (and a few diagnostics): the evaluations whole, of each
    step record STEP_KEYS at 4 significant digits. A 300-step run's metrics.jsonl: ~140 KB -> ~35 KB."""
    path = os.path.join(run_dir, "metrics.jsonl")
    with open(path) as f:
        recs = [load_json(line) for line in f if line.strip()]
    lines = [json.dumps(r if "eval" in r else {k: (float(f"{r[k]:.4g}") if isinstance(r[k], float) else r[k])
                                               for k in STEP_KEYS if k in r}) for r in recs]
    write_text(path, "\n".join(lines) + "\n")


# ---------------------------------------------------------------------------------------------------
# Studies: two phases (the runs that need the noise sweep's best level come second), the invocation log


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
