"""Bad inputs and interruptions, every stage: each case is a command line a user might type (or a library
call a forker might make) against files the case sets up. A case passes when the command exits with the
expected code, prints exactly one line on stderr (no traceback) matching the expected message, and leaves
every file around it as it was. Most cases fail before loading anything, so the table runs in seconds.

The cases run in this process, through each stage's own `run_cli(main, argv)` (the same path as the
command line); a few run the real `python NN_stage.py` to show the wiring. docs/reliability.md lists them.
"""
import dataclasses
import hashlib
import importlib
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "assets", "tiny-qwen")
quantize = importlib.import_module("01_quantize")
STAGES = {n: importlib.import_module(n) for n in ("01_quantize", "02_lora", "03_rollout", "04_aqn", "05_grpo")}


@dataclasses.dataclass
class Case:
    """argv's "{tmp}" and "{model}" are filled in; setup(tmp) builds what the case needs first (a
    model copy is at {model} = tmp/model); code 2 is argparse (a flag's value), 1 an expected error."""
    id: str
    stage: str
    argv: list
    message: str                       # a substring of the one stderr line
    code: int = 1
    setup: object = None               # fn(tmp: str) -> None


def snapshot(folder):
    """{relative path: sha1 of the bytes (folders: 'dir')} of everything under folder."""
    out = {}
    for root, dirs, files in os.walk(folder):
        for d in dirs:
            out[os.path.relpath(os.path.join(root, d), folder)] = "dir"
        for f in files:
            with open(os.path.join(root, f), "rb") as fh:
                out[os.path.relpath(os.path.join(root, f), folder)] = hashlib.sha1(fh.read()).hexdigest()
    return out


def model_copy(tmp):
    shutil.copytree(TINY, os.path.join(tmp, "model"))


def edit_json(path, change):
    with open(path) as f:
        obj = json.load(f)
    with open(path, "w") as f:
        json.dump(change(obj), f)


def write(path, text, mode="w"):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, mode) as f:
        f.write(text)


def run_case(case, tmp, capsys):
    os.makedirs(tmp, exist_ok=True)
    model_copy(tmp)
    if case.setup:
        case.setup(tmp)
    argv = [a.format(tmp=tmp, model=os.path.join(tmp, "model")) for a in case.argv]
    before = snapshot(tmp)
    capsys.readouterr()
    try:
        code = quantize.run_cli(STAGES[case.stage].main, argv)
    except SystemExit as e:  # argparse
        code = e.code
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert code == case.code, f"exit {code}, stderr:\n{err}"
    assert len(lines) == 1 and "Traceback" not in err, f"want one line, got:\n{err}"
    assert lines[0].startswith("error: "), lines[0]
    assert case.message in lines[0], lines[0]
    assert snapshot(tmp) == before, "files around the command changed"
    return lines[0]


# -----------------------------------------------------------------------------
# 01: quantize a folder

def _own_output(tmp):  # an earlier output of 01 next to the model
    quantize.quantize_checkpoint(os.path.join(tmp, "model"), os.path.join(tmp, "q"), log=lambda s: None)


def _nan_weight(tmp):
    from safetensors.torch import load_file, save_file
    path = os.path.join(tmp, "model", "model.safetensors")
    t = load_file(path)
    name = next(k for k in t if k.endswith("mlp.up_proj.weight"))
    t[name][0, 0] = float("nan")
    save_file(t, path, metadata={"format": "pt"})


CASES_01 = [
    Case("01-out-is-model", "01_quantize", ["--model", "{model}", "--out", "{model}", "--force"], "is the input"),
    Case("01-out-above-model", "01_quantize", ["--model", "{model}", "--out", "{tmp}", "--force"], "contains the input"),
    Case("01-out-exists", "01_quantize", ["--model", "{model}", "--out", "{tmp}/other"], "pass --force",
         setup=lambda t: write(f"{t}/other/notes.txt", "mine")),
    Case("01-force-not-ours", "01_quantize", ["--model", "{model}", "--out", "{tmp}/other", "--force"],
         "replaces only an earlier output of 01_quantize.py", setup=lambda t: write(f"{t}/other/notes.txt", "mine")),
    Case("01-out-is-file", "01_quantize", ["--model", "{model}", "--out", "{tmp}/f.txt"], "is a file",
         setup=lambda t: write(f"{t}/f.txt", "x")),
    Case("01-missing-model", "01_quantize", ["--model", "{tmp}/nope", "--out", "{tmp}/q"], "model folder not found"),
    Case("01-already-quantized", "01_quantize", ["--model", "{tmp}/q", "--out", "{tmp}/q2"], "already quantized",
         setup=_own_output),
    Case("01-nan-weight", "01_quantize", ["--model", "{model}", "--out", "{tmp}/q"], "NaN or Inf", setup=_nan_weight),
    Case("01-random-bytes", "01_quantize", ["--model", "{model}", "--out", "{tmp}/q"], "not a readable safetensors",
         setup=lambda t: write(f"{t}/model/model.safetensors", os.urandom(64), "wb")),
    Case("01-config-list", "01_quantize", ["--model", "{model}", "--out", "{tmp}/q"], "config.json",
         setup=lambda t: write(f"{t}/model/config.json", "[1, 2]")),
    Case("01-no-gpu", "01_quantize", ["--model", "{model}", "--out", "{tmp}/q", "--device", "cuda"], "no GPU"),
    Case("01-bad-device", "01_quantize", ["--model", "{model}", "--out", "{tmp}/q", "--device", "tpu"], "device"),
    Case("01-model-without-out", "01_quantize", ["--model", "{model}"], "go together", code=2),
    Case("01-negative-seed", "01_quantize", ["--seed", "-1"], "out of range", code=2),
]

# -----------------------------------------------------------------------------
# 02: the LoRA demo and adapter folders

CASES_02 = []

# -----------------------------------------------------------------------------
# 03: load a folder and sample

CASES_03 = []

# -----------------------------------------------------------------------------
# 04: the AQN measurements

CASES_04 = []

# -----------------------------------------------------------------------------
# 05: GRPO runs and run folders

CASES_05 = []

# -----------------------------------------------------------------------------
# The table

CASES = CASES_01 + CASES_02 + CASES_03 + CASES_04 + CASES_05
if torch.cuda.is_available():  # the GPU cases are a CPU machine's
    CASES = [c for c in CASES if "gpu" not in c.id]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input(case, tmp_path, capsys):
    run_case(case, str(tmp_path / "work"), capsys)


def test_force_replaces_own_output_only(tmp_path):
    """--force replaces an earlier output of the same command, and nothing else."""
    src, out = str(tmp_path / "model"), str(tmp_path / "q")
    model_copy(str(tmp_path))
    assert quantize.run_cli(quantize.main, ["--model", src, "--out", out]) == 0
    assert quantize.run_cli(quantize.main, ["--model", src, "--out", out, "--force"]) == 0
    assert quantize.is_quantized_output(out) and not quantize.is_quantized_output(src)


def test_stale_temporaries_are_cleared(tmp_path):
    """What atomic_write leaves when killed: its temporaries of a dead PID go; a live PID's stay; a folder
    moved aside between the two renames is put back."""
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True).stdout.strip()
    os.makedirs(tmp_path / f".checkpoint-000010.tmp{dead}")
    write(str(tmp_path / f".metrics.jsonl.tmp{dead}"), "half")
    os.makedirs(tmp_path / f".checkpoint-000020.tmp{dead}.old")  # checkpoint-000020 itself is missing
    os.makedirs(tmp_path / f".checkpoint-000030.tmp{os.getpid()}")  # a live writer's (ours)
    removed = quantize.remove_stale_temps(str(tmp_path))
    assert removed == [f".checkpoint-000010.tmp{dead}", f".metrics.jsonl.tmp{dead}"]
    assert sorted(os.listdir(tmp_path)) == [f".checkpoint-000030.tmp{os.getpid()}", "checkpoint-000020"]


def test_cli_wiring_is_one_line():
    """The real command lines end in the handler: one line, exit 1, for every stage."""
    for stage, argv in [("01_quantize.py", ["--model", "/nonexistent", "--out", "/tmp/x"])]:
        r = subprocess.run([sys.executable, os.path.join(ROOT, stage), *argv], capture_output=True, text=True,
                           timeout=120)
        assert r.returncode == 1 and len(r.stderr.strip().splitlines()) == 1, (stage, r.stderr)
        assert r.stderr.startswith("error: "), (stage, r.stderr)
