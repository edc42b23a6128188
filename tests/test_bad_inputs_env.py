"""Bad inputs from the environment a command runs in, not its flags: torchrun's variables left in a shell,
memory limits (RAM, a container's cgroup, `ulimit -v`), an allocation that fails anyway, an unwritable
compile cache, Slurm's SIGUSR1 warning, and a standard output that cannot be written. Each ends in one
line (or, where there is a way on, a note) and leaves the files around it as they were; the table harness
is tests/test_bad_inputs.py's.
"""
import importlib
import io
import json
import os
import resource
import signal
import subprocess
import sys
import tempfile
import time

import pytest
import torch

import test_bad_inputs as bad
from test_bad_inputs import Case

ROOT, cli, devices, engine, memory = bad.ROOT, bad.cli, bad.devices, bad.engine, bad.memory
distributed = importlib.import_module("qerl.distributed")
rollout = importlib.import_module("qerl.rollout")

CASES = [
    Case("05-dist-timeout-huge", "qerl/train", ["--dist-timeout", "1e300"], "need >= 0.1 and <= 1440", code=2),
    Case("05-dist-timeout-tiny", "qerl/train", ["--dist-timeout", "1e-6"], "need >= 0.1 and <= 1440", code=2),
    Case("05-mu-past-16", "qerl/train", ["--mu", "100"], "--mu: 100 is out of range: need >= 1 and <= 16", code=2),
    # three models and a KL over 6.4 million rows: refused before any loading, by 04's estimate
    Case("04-exploration-past-ram", "qerl/aqn", ["--model", "{model}", "--prompts", "100000", "--samples", "64"],
         "--prompts 100000 x --samples 64 with --max-new-tokens 48 needs about"),
]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input(case, tmp_path, capsys):
    bad.run_case(case, str(tmp_path), capsys)


# -----------------------------------------------------------------------------
# torchrun's variables without torchrun

def test_torchrun_variables_left_in_a_shell_are_one_line_at_once(tmp_path):
    """WORLD_SIZE=2 with a rendezvous address, and no torchrun: gloo would wait 10 minutes for rank 1 and then
    print a traceback. Now: one line naming what to unset, within the seconds a start takes, and no run folder."""
    env = dict(os.environ, OMP_NUM_THREADS="1", WORLD_SIZE="2", RANK="0", MASTER_ADDR="127.0.0.1",
               MASTER_PORT="29531")
    env.pop("TORCHELASTIC_RUN_ID", None)
    t0 = time.time()
    r = subprocess.run([sys.executable, os.path.join(ROOT, "qerl/train.py"), *bad.TINY_RUN, "--out", str(tmp_path / "run")],
                       capture_output=True, text=True, timeout=120, env=env)
    assert time.time() - t0 < 60  # a start: torch's import; not a rendezvous's wait
    assert r.returncode == 1 and len(r.stderr.splitlines()) == 1 and "Traceback" not in r.stderr, r.stderr
    assert "torchrun did not start this process" in r.stderr
    assert "unset RANK WORLD_SIZE MASTER_ADDR MASTER_PORT" in r.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("env, message", [
    ({"RANK": "1"}, "RANK=1 is set, but torchrun did not start this process"),  # trained a whole run unheard
    ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0"}, "unset RANK WORLD_SIZE LOCAL_RANK"),
    ({"RANK": "one"}, "RANK=one: torchrun's variables are whole numbers"),
    ({"TORCHELASTIC_RUN_ID": "x", "RANK": "3", "WORLD_SIZE": "2", "LOCAL_RANK": "0"}, "torchrun's variables disagree"),
    ({"TORCHELASTIC_RUN_ID": "x", "WORLD_SIZE": "2"}, "torchrun's variables disagree (WORLD_SIZE=2)"),
])
def test_an_inconsistent_launch_environment_is_refused(monkeypatch, tmp_path, capsys, env, message):
    for k in (*distributed.TORCHRUN_VARS, "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(k, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    case = Case("launch", "qerl/train", [*bad.TINY_RUN, "--model", "{model}", "--out", "{tmp}/run"], message)
    bad.run_case(case, str(tmp_path), capsys)


def test_a_single_process_however_spelled_is_one(monkeypatch):
    for k in (*distributed.TORCHRUN_VARS, "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(k, raising=False)
    assert distributed.launch() == (0, 1)
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("MASTER_ADDR", "10.0.0.1")  # no second rank to wait for: harmless
    assert distributed.launch() == (0, 1)
    for k, v in {"TORCHELASTIC_RUN_ID": "x", "RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1"}.items():
        monkeypatch.setenv(k, v)
    assert distributed.launch() == (1, 2)  # what torchrun writes


# -----------------------------------------------------------------------------
# Memory limits: the estimate reads each one; a failed allocation is one line

def fake_cgroup(root, version, limit, usage, cache):
    folder = root if version == 2 else root / "memory"
    folder.mkdir(parents=True, exist_ok=True)
    limit_file, usage_file, cache_key = devices.CGROUP_FILES[version == 1]
    (root / limit_file).write_text(f"{limit}\n")
    (root / usage_file).write_text(f"{usage}\n")
    (folder / "memory.stat").write_text(f"anon 1\n{cache_key} {cache}\nfile 9\n")


@pytest.mark.parametrize("version", [1, 2])
def test_the_estimate_reads_a_cgroup_limit(tmp_path, monkeypatch, version):
    """The container's limit less its usage, the page cache it can drop not counted as used (v2 memory.max and
    memory.current, v1 memory.limit_in_bytes and memory.usage_in_bytes)."""
    monkeypatch.setattr(devices, "CGROUP", str(tmp_path))
    fake_cgroup(tmp_path, version, limit=3 * 2 ** 30, usage=2 * 2 ** 30, cache=2 ** 29)
    assert devices.cpu_memory_limits()["memory left in this container's limit (cgroup)"] == 1.5 * 2 ** 30
    assert devices.free_memory("cpu") == 1.5 * 2 ** 30  # far below this machine's RAM
    with pytest.raises(ValueError, match=r"--x 9 needs about 2.0 GiB, and this machine has 1.5 GiB of memory left "
                                         r"in this container's limit \(cgroup\): lower those sizes"):
        devices.check_memory_fits(2 * 2 ** 30, "cpu", "--x 9")


@pytest.mark.parametrize("limit", ["max", "9223372036854771712"])  # v2's and v1's "no limit"
def test_a_cgroup_without_a_limit_is_no_limit(tmp_path, monkeypatch, limit):
    monkeypatch.setattr(devices, "CGROUP", str(tmp_path))
    fake_cgroup(tmp_path, 2 if limit == "max" else 1, limit=limit, usage=2 ** 30, cache=0)
    assert set(devices.cpu_memory_limits()) <= {"RAM available", "address space left under `ulimit -v` (RLIMIT_AS)"}


def test_the_estimate_reads_the_address_space_limit(monkeypatch):
    """ulimit -v (RLIMIT_AS) less what this process maps already (VmSize)."""
    real = resource.getrlimit
    monkeypatch.setattr(resource, "getrlimit", lambda r: (4 * 2 ** 40, resource.RLIM_INFINITY)
                        if r == resource.RLIMIT_AS else real(r))
    with open("/proc/self/status") as f:
        mapped = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
    left = devices.cpu_memory_limits()["address space left under `ulimit -v` (RLIMIT_AS)"]
    assert 4 * 2 ** 40 - mapped - 2 ** 30 < left <= 4 * 2 ** 40 - mapped  # (mapping may grow between the reads)


ULIMIT_SCRIPT = """import resource, sys
sys.path.insert(0, sys.argv[1])
import torch
from qerl import cli, devices
with open("/proc/self/status") as f:  # `ulimit -v` of what torch maps already + 2 GiB
    mapped = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
resource.setrlimit(resource.RLIMIT_AS, (mapped + 2 ** 31, resource.RLIM_INFINITY))
def main(argv):
    devices.check_memory_fits(int(argv[0]), "cpu", "--x 1")
    torch.empty(int(argv[1]) // 4)  # fp32
sys.exit(cli.run_cli(main, sys.argv[2:]))
"""


@pytest.mark.parametrize("estimate, allocate, message", [
    (4 * 2 ** 30, 4 * 2 ** 30, "--x 1 needs about 4.0 GiB, and this machine has"),  # the estimate sees the limit
    (2 ** 30, 8 * 2 ** 30, "error: out of memory (an allocation of 8.00 GiB failed): lower the sizes it was given"),
])
def test_a_real_address_space_limit(estimate, allocate, message):
    """Under a real `ulimit -v` (RLIMIT_AS) 2 GiB above what the process maps: a request past it is refused by
    the estimate, naming the limit; an allocation past it that the estimate did not foresee is the one
    out-of-memory line, not the allocator's traceback."""
    r = subprocess.run([sys.executable, "-c", ULIMIT_SCRIPT, ROOT, str(estimate), str(allocate)], capture_output=True,
                       text=True, timeout=120, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert r.returncode == 1 and len(r.stderr.splitlines()) == 1, r.stderr
    assert message in r.stderr
    if estimate == allocate:
        assert "of address space left under `ulimit -v` (RLIMIT_AS)" in r.stderr


@pytest.mark.parametrize("error, said", [
    (RuntimeError("[enforce fail at alloc_cpu.cpp:117] data. DefaultCPUAllocator: can't allocate memory: you tried "
                  "to allocate 3221225472 bytes. Error code 12 (Cannot allocate memory)"), "an allocation of 3.00 GiB"),
    (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB. GPU 0 has a total capacity of 79 GiB"),
     "an allocation of 20.00 GiB"),
    (MemoryError(), "out of memory: lower --batch, --group, --max-new-tokens, --eval-chunk or --micro-batch"),
])
def test_an_allocation_that_fails_is_one_line_naming_what_to_lower(capsys, error, said):
    def main(argv):
        raise error
    main.__code__ = main.__code__.replace(co_filename=os.path.join(ROOT, "qerl/train.py"))  # as 05's own main
    assert cli.run_cli(main, []) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: out of memory") and said in err, err
    assert "--batch, --group, --max-new-tokens" in err


def test_another_runtime_error_is_still_a_bug():
    def main(argv):
        raise RuntimeError("shape mismatch")
    with pytest.raises(RuntimeError, match="shape mismatch"):
        cli.run_cli(main, [])


# -----------------------------------------------------------------------------
# --compile without a writable cache folder: eager, with a note

def test_compile_without_a_writable_cache_runs_eager_with_a_note(monkeypatch, capsys):
    """Inductor writes its generated code into TORCHINDUCTOR_CACHE_DIR (else the temporary folder); a folder it
    cannot write was a dynamo traceback at the first step. 03 --compile now samples eager, the same tokens."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/proc/self")  # a folder no one can write, not even root
    monkeypatch.setattr(engine, "_compiled_steps", {})
    assert "is not writable" in devices.compile_cache_problem()
    argv = ["--max-new-tokens", "4", "--num-samples", "2", "--seed", "3"]
    assert cli.run_cli(rollout.main, [*argv, "--compile"]) == 0
    out = capsys.readouterr().out
    assert "note | --compile: inductor's cache folder" in out and "the decode steps run eager" in out
    assert cli.run_cli(rollout.main, argv) == 0
    eager = capsys.readouterr().out
    samples = [line for line in out.splitlines() if not line.startswith(("note", "model", "prefill"))]
    assert samples == [line for line in eager.splitlines() if not line.startswith(("model", "prefill"))]


# -----------------------------------------------------------------------------
# SIGUSR1: Slurm's warning before its time limit (`#SBATCH --signal=SIGUSR1@90`) saves like SIGTERM

def test_sigusr1_saves_like_sigterm_and_resumes(tmp_path):
    out = tmp_path / "run"
    proc = bad.start_run(out, "--steps", "30")
    bad.wait_for_line(proc, "step 2/30")
    proc.send_signal(signal.SIGUSR1)
    stdout, err = proc.communicate(timeout=300)
    assert proc.returncode == 128 + signal.SIGUSR1, err
    assert "interrupt | stopping after this step with a checkpoint (SIGUSR1 again: stop now)" in stdout
    summary = json.load(open(out / "summary.json"))
    assert summary["stopped_by"] == "SIGUSR1" and 2 <= summary["steps_done"] < 30
    assert (out / f"checkpoint-{summary['steps_done']:06d}").is_dir()
    assert err.startswith("interrupted (SIGUSR1) | checkpoint-") and err.count("\n") == 1, err
    r = bad.resume_run(out)
    assert r.returncode == 0, r.stderr
    assert json.load(open(out / "summary.json"))["steps_done"] == 30


# -----------------------------------------------------------------------------
# Standard output that cannot be written

def test_a_full_standard_output_names_it(tmp_path):
    """`> out.log` on a full disk (/dev/full): one line naming standard output, exit 1; not `[Errno 28]` alone,
    and no 'Exception ignored' at the interpreter's exit."""
    with open("/dev/full", "w") as full:
        r = subprocess.run([sys.executable, os.path.join(ROOT, "qerl/aqn.py"), "--schedule-only"], stdout=full,
                           stderr=subprocess.PIPE, text=True, timeout=120, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert r.returncode == 1 and r.stderr.count("\n") == 1, r.stderr
    assert r.stderr.startswith("error: standard output: No space left on device (is it redirected to a full disk?)")


def test_an_encoding_that_cannot_write_a_path_names_stdout_and_the_setting(monkeypatch, capsys):
    """PYTHONIOENCODING=ascii and a path with an accent: the line names standard output, the text around the
    character (the path) and the setting to use, not only the codec's 'ordinal not in range(128)'."""
    monkeypatch.setattr(sys, "stdout", io.TextIOWrapper(io.BytesIO(), encoding="ascii"))

    def main(argv):
        print("run | out /data/café/run")
    assert cli.run_cli(main, []) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: standard output cannot write 'é'"), err
    assert "/data/café/run" in err and "ascii" in err and "set PYTHONIOENCODING=utf-8" in err


def test_an_empty_inductor_cache_variable_never_fills_the_current_folder(tmp_path, monkeypatch, capsys):
    """TORCHINDUCTOR_CACHE_DIR="" would make inductor write its cache folders into the current folder: the
    compile check unsets it with one note, and the cache goes to the temporary folder."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "")
    assert bad.devices.compile_cache_problem() is None
    assert "TORCHINDUCTOR_CACHE_DIR" not in os.environ
    assert capsys.readouterr().out.count("note | TORCHINDUCTOR_CACHE_DIR is empty") == 1
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("mask", [0o777, 0o700, 0o200])
def test_a_umask_that_locks_the_owner_out_is_one_line_before_any_folder(tmp_path, capsys, mask):
    """umask 0777 made the run folder mode 000 and the run stopped on the next write: now one line, nothing
    made; umask 022 and 077 (the owner keeps rwx) run as before."""
    old = os.umask(mask)
    try:
        code = bad.cli.run_cli(bad.STAGES["qerl/train"].main, ["--out", str(tmp_path / "run"), "--steps", "1"])
    finally:
        os.umask(old)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1 and len(err) == 1 and f"the umask {mask:04o}" in err[0] and "umask 022" in err[0], err
    assert not (tmp_path / "run").exists()
    for fine in (0o022, 0o077):
        os.umask(fine)
        try:
            bad.files.check_out_path(str(tmp_path / "run"))
        finally:
            os.umask(old)


# -----------------------------------------------------------------------------
# No usable temporary folder: torch needs one from a model's first layer on (its compile cache's folder is read
# when a module is built); "no usable" is tempfile.gettempdir() raising: no folder among TMPDIR, TEMP, TMP, /tmp,
# /var/tmp, /usr/tmp and the current folder takes a file. A bad TMPDIR with a writable fallback runs, with a note.

@pytest.mark.parametrize("kind", ["missing", "read-only", "a file"])
def test_no_usable_temporary_folder_is_one_line_naming_tmpdir(tmp_path, monkeypatch, capsys, kind):
    tmpdir = {"missing": str(tmp_path / "no-such-folder"), "read-only": "/proc/self",  # no one writes there, not root
              "a file": os.path.join(ROOT, "README.md")}[kind]
    monkeypatch.setenv("TMPDIR", tmpdir)
    monkeypatch.setattr(tempfile, "tempdir", None)  # gettempdir looks again (and the cached one comes back after)
    # a machine whose /tmp, /var/tmp, /usr/tmp and current folder are read-only too: Python tries only TMPDIR
    monkeypatch.setattr(tempfile, "_candidate_tempdir_list", lambda: [tmpdir])
    code = cli.run_cli(bad.STAGES["qerl/train"].main, ["--out", str(tmp_path / "run"), "--steps", "1"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1 and len(err) == 1, err
    assert err[0].startswith("error: no usable temporary folder: TMPDIR " + tmpdir), err
    assert {"missing": "does not exist", "read-only": "is not writable", "a file": "is not a folder"}[kind] in err[0]
    assert "set TMPDIR to a writable folder" in err[0] and not (tmp_path / "run").exists()


def test_a_bad_tmpdir_with_a_writable_fallback_runs_with_a_note(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("TMPDIR", str(tmp_path / "no-such-folder"))
    monkeypatch.setattr(tempfile, "tempdir", None)
    assert cli.run_cli(bad.STAGES["qerl/aqn"].main, ["--schedule-only", "--steps", "20"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == f"note | TMPDIR {tmp_path / 'no-such-folder'} does not exist: temporaries (torch's caches) go " \
                     f"to {tempfile.gettempdir()}" and out[1].startswith("AQN schedule")
    monkeypatch.setenv("TMPDIR", str(tmp_path))  # a usable TMPDIR: no note
    monkeypatch.setattr(tempfile, "tempdir", None)
    assert devices.temp_folder_problem() is None and capsys.readouterr().out == ""


def _read_only_temporaries():
    """The command line prefix that runs argv with /tmp, /var/tmp (and /usr/tmp) read-only and the current folder
    /proc, in a private mount namespace (unshare -m: root, or user namespaces); None where one cannot be made."""
    # each folder bound onto itself read-only: what it holds stays readable (a checkout or venv under /tmp)
    mounts = " && ".join(f"mount --bind {d} {d} && mount -o remount,ro,bind {d}"
                         for d in ("/tmp", "/var/tmp", "/usr/tmp") if os.path.isdir(d))
    script = f'{mounts} && cd /proc && exec "$@"'
    try:
        ok = subprocess.run(["unshare", "-m", "sh", "-c", script, "sh", "true"], capture_output=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return ["unshare", "-m", "sh", "-c", script, "sh"] if ok.returncode == 0 else None


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mount namespaces are Linux's")
def test_a_real_trainer_without_any_temporary_folder_stops_in_one_line():
    """The real process, no patching: TMPDIR=/tmp, read-only, as every other folder Python tries; before, the
    trainer stopped at its model's first layer on tempfile's 'No usable temporary directory found in [...]'."""
    wrap = _read_only_temporaries()
    if wrap is None:
        pytest.skip("no private mount namespace here (unshare -m needs root or user namespaces)")
    env = {k: v for k, v in os.environ.items() if k not in ("TEMP", "TMP")}
    env.update(TMPDIR="/tmp", PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    r = subprocess.run([*wrap, sys.executable, "-m", "qerl.train", "--steps", "1", "--out", "/no/such/run"],
                       capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 1 and r.stderr.count("\n") == 1 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.startswith("error: no usable temporary folder: TMPDIR /tmp is not writable, and none of"), r.stderr
    assert "set TMPDIR to a writable folder" in r.stderr and r.stdout == ""
