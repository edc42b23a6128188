"""bench/compare_methods.py: a study's runs train from the code snapshot, the report and the pack are
rebuilt from the pack alone, every study's flags are flags 05 accepts, and a study's own defaults
(steps, evaluation) apply unless a flag says otherwise."""
import importlib
import json
import os
import shutil
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))
cmp = importlib.import_module("compare_methods")
grpo = importlib.import_module("05_grpo")


def test_two_runs_train_report_and_rebuild_from_the_pack(tmp_path, capsys):
    out = tmp_path / "cmp"
    argv = ["--methods", "lora", "qerl", "--steps", "2", "--seeds", "0", "--eval-size", "8", "--eval-every", "2",
            "--eval-k", "2", "--out", str(out)]
    cmp.main(argv)  # trains from runs/.code: every file a stage imports must be in the snapshot
    printed = capsys.readouterr().out
    assert "FAILED" not in printed and "missing" not in printed, printed
    results = json.loads((out / "results.json").read_text())
    runs = {r["method"]: r for r in results["runs"]}
    assert sorted(runs) == ["lora", "qerl"]
    for r in runs.values():
        assert r["steps"] == 2 and r["eval_n"] == 8 and r["k"] == 2
        assert 0.0 <= r["start_greedy"] <= 1.0 and 0.0 <= r["final_greedy"] <= 1.0
        assert r["temperature"] == 1.0 and r["code_md5"] and r["model_md5"]
    assert runs["lora"]["quant"] == "none" and runs["qerl"]["quant"] == "nvfp4" and runs["qerl"]["aqn"] is True
    table = (out / "table.md").read_text()
    assert "pass@2 at temperature 1" in table
    assert not (out / "runs" / ".code").exists()  # the last worker out removes the snapshot

    # a fresh checkout has only the pack: the same report from it, and a repack of the same runs is byte-equal
    pack = (out / "runs.tar.xz").read_bytes()
    shutil.rmtree(out / "runs")
    (out / "results.json").unlink()
    cmp.main(argv + ["--from-results"])
    assert json.loads((out / "results.json").read_text())["runs"] == results["runs"]
    cmp.main(argv[:-2] + ["--out", str(out)])  # training again unpacks the pack and reuses both runs
    assert "2 reused" in capsys.readouterr().out
    assert (out / "runs.tar.xz").read_bytes() == pack


@pytest.mark.parametrize("study", [None, *cmp.STUDIES])
def test_every_method_of_every_study_is_a_command_05_accepts(study, tmp_path):
    args = cmp.parse_args((["--study", study] if study else []) + ["--out", str(tmp_path)])
    parser = grpo.build_parser()
    for method in args.methods:
        command = cmp.run_command(args, method, 0, str(tmp_path / method))
        assert command[1].endswith("05_grpo.py")
        parsed = parser.parse_args(command[2:])  # an unknown flag or value exits here
        assert parsed.steps == args.steps and parsed.eval_size == args.eval_size and parsed.eval_k == args.eval_k
        for key, value in cmp.flag_values(args.table[method][1]).items():
            assert cmp.same_value(getattr(parsed, key), value), (study, method, key)


def test_a_study_brings_its_defaults_and_flags_override_them(tmp_path):
    smol = cmp.parse_args(["--study", "smollm2-table1", "--out", str(tmp_path)])
    assert (smol.steps, smol.eval_size, smol.eval_every, smol.eval_k) == (60, 200, 30, 4)
    assert cmp.model_dir(smol) == cmp.SMOLLM2_MODEL
    i = smol.train_args.index("--dtype")
    assert smol.train_args[i + 1] == "bfloat16"  # pinned: "auto" may pick differently on another machine
    assert len(smol.methods) == 7 and {"qerl", "qerl-sampler", "lora-aqn", "lora-aqn-sampler"} <= set(smol.methods)
    mine = cmp.parse_args(["--study", "smollm2-table1", "--steps", "5", "--eval-k", "0", "--out", str(tmp_path)])
    assert (mine.steps, mine.eval_size, mine.eval_k) == (5, 200, 0)
    noise = cmp.parse_args(["--study", "noise", "--out", str(tmp_path)])
    assert (noise.steps, noise.eval_size, noise.eval_every, noise.eval_k) == (300, 1000, 50, 8)
    plain = cmp.parse_args(["--out", str(tmp_path)])
    assert (plain.steps, plain.eval_size) == (300, 500)
    # the wall-time estimate reads the study's own seconds: a SmolLM2 step costs ~8x the bundled model's
    smol.steps = noise.steps = 60
    smol.eval_size = noise.eval_size = 200
    smol.eval_k = noise.eval_k = 4
    smol.eval_every = noise.eval_every = 30
    assert cmp.estimate_wall(smol, 2) > 5 * cmp.estimate_wall(noise, 2)


def test_a_missing_smollm2_folder_says_how_to_build_it(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(cmp.BUILD_HINTS, str(tmp_path / "absent"), cmp.BUILD_HINTS[cmp.SMOLLM2_MODEL])
    monkeypatch.setitem(cmp.STUDIES["smollm2-table1"], "train_args", ["--model", str(tmp_path / "absent")])
    with pytest.raises(FileNotFoundError, match="make smollm2"):
        cmp.main(["--study", "smollm2-table1", "--out", str(tmp_path / "out")])


def test_overlapping_invocations_count_their_wall_time_once():
    inv = [{"started": "2026-12-02 02:00:00", "wall_s": 600}, {"started": "2026-12-02 02:05:00", "wall_s": 600},
           {"started": "2026-12-02 03:00:00", "wall_s": 60}]
    assert cmp.wall_union(inv) == 600 + 300 + 60
