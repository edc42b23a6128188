"""bench/compare_methods.py against a hostile results folder (issue 48): a planted code snapshot whose record
names a live process is not run, a finished run is not emptied because --steps changed, and deep JSON in
any file the study reads is one line. Each case runs through test_bad_inputs.py's harness: one stderr line,
exit 1, every file around it byte for byte as it was."""
import importlib
import json
import os
import shutil
import subprocess
import sys
import time

import pytest
import test_bad_inputs as bad

CMP, ROOT = bad.CMP, bad.ROOT
runner = importlib.import_module("study_runner")  # bench/ is on sys.path: test_bad_inputs put it there
DEEP = "[" * 100_000  # past json's recursion: a RecursionError inside json.loads
NESTED = "[" * 200 + "]" * 200  # parses, but deeper than anything the study writes (MAX_DEPTH)


def planted_snapshot(owner):
    """setup: runs/.code with this checkout's files but a qerl/train.py that leaves <05>.ran if it runs, and a
    record with the snapshot's true hash naming owner(): [pid, start] of a process."""
    def setup(tmp):
        code = os.path.join(tmp, "cmp", "runs", ".code")
        os.makedirs(code)
        for name in runner.CODE_FILES:
            copy = shutil.copytree if os.path.isdir(os.path.join(ROOT, name)) else shutil.copy
            copy(os.path.join(ROOT, name), os.path.join(code, name))
        bad.write(os.path.join(code, "qerl/train.py"), "open(__file__ + '.ran', 'w')\n")
        bad.write(os.path.join(code, runner.SNAPSHOT_RECORD), json.dumps({"md5": runner.tree_hash(code),
                                                                          "owner": owner()}))
    return setup


@pytest.mark.parametrize("decoy", [["compare_methods.py"], ["bench/compare_methods.py", "--out", "/elsewhere"]],
                         ids=["sleeper-named-compare-methods", "a-study-on-another-out"])
def test_a_planted_snapshot_naming_a_live_process_is_not_run(decoy, tmp_path, capsys):
    """The record names a live process with compare_methods.py on its command line, and the files have the
    hash it records: not this invocation's snapshot, nor this checkout's files, so it is refused and kept."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)", *decoy])
    try:
        time.sleep(0.2)  # its command line is in /proc
        case = bad.Case("study-planted-snapshot-live-decoy", CMP, bad.TRAIN, "runs/.code holds other code than "
                        "this checkout's stage files", setup=planted_snapshot(lambda: runner.process_identity(proc.pid)))
        bad.run_case(case, str(tmp_path / "work"), capsys)
    finally:
        proc.kill()
        proc.wait()
    code = tmp_path / "work" / "cmp" / "runs" / ".code"
    assert (code / "qerl/train.py").exists() and not (code / "qerl/train.py.ran").exists()


def test_a_snapshot_of_this_checkout_named_by_a_live_copy_is_reused(tmp_path):
    """What a second copy of the study reuses: the same files as its own copy would hold, byte for byte."""
    runs_root = str(tmp_path / "runs")
    os.makedirs(runs_root)
    snap, md5, made = runner.prepare_code(runs_root)
    assert made and sorted(os.listdir(runs_root)) == [".code"]  # no temporary left beside it
    assert runner.prepare_code(runs_root) == (snap, md5, False)  # its maker (this process) is live: reused
    assert sorted(os.listdir(runs_root)) == [".code"]


def _deep(path, text):
    return lambda tmp: bad.write(os.path.join(tmp, path), text)


def _run_file(name, text):  # change: one file of lora-s1 replaced
    def change(run, files):
        if run == "lora-s1":
            files[name] = text
    return change


TRAIN_STEPS = ["--methods", "lora", "--seeds", "0", "--eval-size", "2", "--out", "{tmp}/cmp"]
CASES = [
    # a finished run of 300 steps, and a rerun asking for 1: refused, the run's files as they were
    bad.Case("study-rerun-with-other-steps", CMP, [*TRAIN_STEPS, "--steps", "1"], "runs/lora-s0 was trained with "
             "--steps 300, this command runs with --steps 1", setup=bad._study_runs("cmp", ["lora-s0"])),
    bad.Case("study-dry-run-with-other-steps", CMP, [*TRAIN_STEPS, "--steps", "1", "--dry-run"], "--force to retrain",
             setup=bad._study_runs("cmp", ["lora-s0"])),
    bad.Case("study-deep-manifest", CMP, bad.FROM, "compare_methods.json is not this script's record",
             setup=bad._and(bad._study_runs("cmp"), _deep("cmp/compare_methods.json", DEEP))),
    bad.Case("study-deep-summary", CMP, bad.FROM, "lora-s1/summary.json nests its JSON deeper than 64 levels",
             setup=bad._study_runs("cmp", change=_run_file("summary.json", DEEP))),
    bad.Case("study-nested-args", CMP, bad.FROM, "lora-s1/args.json nests its JSON deeper than 64 levels",
             setup=bad._study_runs("cmp", change=_run_file("args.json", '{"lr": ' + NESTED + "}"))),
    bad.Case("study-deep-summary-when-training", CMP, ["--methods", "lora", "--seeds", "1", "--steps", "1",
                                                       "--eval-size", "2", "--out", "{tmp}/cmp"],
             "runs/lora-s1/summary.json nests its JSON deeper", setup=bad._study_runs(
                 "cmp", ["lora-s1"], change=_run_file("summary.json", DEEP))),
    bad.Case("study-deep-users-results-json", CMP, bad.FROM, "cmp/results.json was not written by this script",
             setup=bad._and(bad._study_runs("cmp"), _deep("cmp/results.json", DEEP))),
    bad.Case("study-deep-noise-results", CMP, ["--study", "hard", "--from-results", "--out", "{tmp}/hard"],
             "noise/results.json cannot be read (it nests its JSON deeper", setup=bad._and(
                 bad._study_runs("hard", ["lora-s0"]), _deep("noise/results.json", DEEP))),
    bad.Case("study-deep-snapshot-record", CMP, bad.TRAIN, "runs/.code was not made by a running copy of this "
             "script (its record is missing or unreadable)", setup=bad._and(
                 planted_snapshot(lambda: [1, None]), _deep(f"cmp/runs/.code/{runner.SNAPSHOT_RECORD}", DEEP))),
]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_study_input(case, tmp_path, capsys):
    bad.run_case(case, str(tmp_path / "work"), capsys)
