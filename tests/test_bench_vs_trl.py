"""bench/bench_vs_trl.py refuses bad input with one line and exit code 1 (no TRL needed: the refusals
come before anything runs in the TRL venv)."""
import importlib
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))
vs_trl = importlib.import_module("bench_vs_trl")


def refusal(capsys, argv):
    assert vs_trl.main(argv) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("error: "), err
    return err


def test_missing_trl_python(capsys):
    assert "--trl-python VENV_PYTHON is required" in refusal(capsys, [])


def test_trl_python_not_executable(capsys, tmp_path):
    assert "is not an executable file" in refusal(capsys, ["--trl-python", str(tmp_path / "nothing")])


def test_venv_without_trl(capsys, tmp_path):
    fake = tmp_path / "python"  # an interpreter whose imports fail the way a venv without trl does
    fake.write_text("#!/bin/sh\necho \"ModuleNotFoundError: No module named 'trl'\" >&2\nexit 1\n")
    fake.chmod(0o755)
    err = refusal(capsys, ["--trl-python", str(fake)])
    assert "cannot import trl" in err and "No module named 'trl'" in err and "torch==2.13.0" in err


@pytest.mark.parametrize("argv", [["--model", "no/such/folder"], ["--model", "assets/smollm2-missing"]])
def test_bad_model(capsys, argv):
    assert "model folder" in refusal(capsys, argv + ["--trl-python", sys.executable])


@pytest.mark.parametrize("argv", [["--steps", "1"], ["--group", "1"]])
def test_bad_sizes_are_the_command_lines_error(capsys, argv):
    with pytest.raises(SystemExit) as e:  # argparse, through 01's ArgumentParser: exit 2
        vs_trl.main(argv + ["--trl-python", sys.executable])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and len(err.splitlines()) == 1
    assert err.startswith(f"error: argument {argv[0]}: 1 is out of range: need >= 2"), err


def test_used_workdir(capsys, tmp_path):
    (tmp_path / "ours").mkdir()  # what an earlier comparison left there
    err = refusal(capsys, ["--workdir", str(tmp_path), "--trl-python", sys.executable])
    assert "is not empty" in err
