"""bench/compare_methods.py: a study's runs train from the code snapshot, the report and the pack are
rebuilt from the pack alone, every study's flags are flags 05 accepts, and a study's own defaults
(steps, evaluation) apply unless a flag says otherwise; and its integrity: only a snapshot it can vouch for
runs, other 05 settings are never mixed into one table, Ctrl-C exits 130 (the file cases: test_bad_inputs.py)."""
import importlib
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))
cmp = importlib.import_module("compare_methods")  # the command line; beside it the modules it is made of
studies, runner = importlib.import_module("studies"), importlib.import_module("study_runner")
files, stats, report = (importlib.import_module(m) for m in ("study_files", "study_stats", "study_report"))
grpo = importlib.import_module("qerl.train")


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

    # each run's versions.txt records its whole 05 command line and the snapshot's hash; a resume giving
    # a flag the finished runs did not have (or another value) is refused before it trains anything
    versions = (out / "runs" / "qerl-s0" / "versions.txt").read_text().splitlines()
    recorded = json.loads(next(v for v in versions if v.startswith("argv "))[5:])
    assert recorded[recorded.index("--eval-size") + 1] == "8" and recorded[recorded.index("--quant") + 1] == "nvfp4"
    assert recorded[recorded.index("--out") + 1] == str(out / "runs" / "qerl-s0") and "--aqn" in recorded
    assert any(v.startswith("snapshot ") and len(v) == len("snapshot ") + 32 for v in versions)
    with pytest.raises(ValueError, match="qerl-s0 was trained without --pi-old, this command runs with --pi-old "):
        cmp.main(["--methods", "qerl"] + argv[3:] + ["--seeds", "0", "1", "--dry-run", "--", "--pi-old", "sampler"])


@pytest.mark.parametrize("study", [None, *studies.STUDIES])
def test_every_method_of_every_study_is_a_command_05_accepts(study, tmp_path):
    args = cmp.parse_args((["--study", study] if study else []) + ["--out", str(tmp_path)])
    parser = grpo.build_parser()
    for method in args.methods:
        command = runner.run_command(args, method, 0, str(tmp_path / method))
        assert command[1].endswith("qerl/train.py")
        parsed = parser.parse_args(command[2:])  # an unknown flag or value exits here
        assert parsed.steps == args.steps and parsed.eval_size == args.eval_size and parsed.eval_k == args.eval_k
        for key, value in files.flag_values(args.table[method][1]).items():
            assert files.same_value(getattr(parsed, key), value), (study, method, key)


def test_a_study_brings_its_defaults_and_flags_override_them(tmp_path):
    smol = cmp.parse_args(["--study", "smollm2-table1", "--out", str(tmp_path)])
    assert (smol.steps, smol.eval_size, smol.eval_every, smol.eval_k) == (60, 200, 30, 4)
    assert runner.model_dir(smol) == studies.SMOLLM2_MODEL
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
    assert runner.estimate_wall(smol, 2) > 5 * runner.estimate_wall(noise, 2)


def test_a_missing_smollm2_folder_says_how_to_build_it(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(studies.BUILD_HINTS, str(tmp_path / "absent"), studies.BUILD_HINTS[studies.SMOLLM2_MODEL])
    monkeypatch.setitem(studies.STUDIES["smollm2-table1"], "train_args", ["--model", str(tmp_path / "absent")])
    with pytest.raises(FileNotFoundError, match="make smollm2"):
        cmp.main(["--study", "smollm2-table1", "--out", str(tmp_path / "out")])


def test_overlapping_invocations_count_their_wall_time_once():
    inv = [{"started": "2026-12-02 02:00:00", "wall_s": 600}, {"started": "2026-12-02 02:05:00", "wall_s": 600},
           {"started": "2026-12-02 03:00:00", "wall_s": 60}]
    assert report.wall_union(inv) == 600 + 300 + 60


# ---------------------------------------------------------------------------------------------------
# Integrity: it runs only code it can vouch for, writes only what it made, and never mixes settings

def committed_runs(out, names, pack=os.path.join(ROOT, "bench", "results", files.PACK)):
    """Finished runs of the committed pack written as run folders under out/runs (a study in progress)."""
    runs = files.read_pack(pack)
    for name in names:
        os.makedirs(out / "runs" / name)
        for file, text in runs[name].items():
            (out / "runs" / name / file).write_text(text)


def rebuild_committed_study(study, tmp_path):
    """Copy bench/results/<study> without a local runs/ (which would be read before the pack, and a fresh
    clone has none), re-render it with --from-results in that copy, and check its table.md comes out byte
    for byte as committed. Returns the copy."""
    src = os.path.join(ROOT, "bench", "results", study)
    out = tmp_path / study
    shutil.copytree(src, out, ignore=shutil.ignore_patterns("runs"))
    assert cmp.cli.run_cli(cmp.main, ["--study", study, "--from-results", "--out", str(out)]) == 0
    assert (out / "table.md").read_text() == open(os.path.join(src, "table.md")).read()
    return out


def test_the_committed_six_seed_study_rebuilds_with_its_verdict(tmp_path):
    """The 42-run SmolLM2 mismatch study rebuilds its table.md byte for byte from its pack, and its verdicts
    are the ones docs/experiments.md states: LoRA (bf16) ends above QeRL (p < 0.001) and above NVFP4 + LoRA
    (p 0.025); counted from each base's own start, QeRL - LoRA is -5.2 points, p 0.079, not a ranking; no
    reading or noise scale of QeRL is distinguishable from another; one run of 42 collapsed."""
    out = rebuild_committed_study("smollm2-mismatch", tmp_path)
    results = json.loads((out / "results.json").read_text())
    assert {m: s["runs"] for m, s in results["methods"].items()} == {m: 6 for m in results["methods"]}
    assert len(results["methods"]) == 7
    q = {(q["a"], q["b"]): q for q in results["questions"]}
    ranked = {ab for ab, x in q.items() if x["final_greedy"]["p"] < 0.05}
    assert ranked == {("qerl", "lora"), ("nvfp4-lora", "lora")}
    # and they stay ranked over the family of 9 questions: every LoRA seed ends above every seed of the
    # other (exact permutation p 2/924), Holm-adjusted 9 x 2/924 = 0.019 (issue 55)
    assert {ab for ab, x in q.items() if not x["final_greedy"]["verdict"].startswith("not")} == ranked
    for ab in ranked:
        assert q[ab]["final_greedy"]["p_permutation"] == pytest.approx(2 / 924)
        assert q[ab]["final_greedy"]["p_holm"] == pytest.approx(9 * 2 / 924) and q[ab]["final_greedy"]["family"] == 9
    mde = {ab: x["final_greedy"]["mde"] for ab, x in q.items()}  # what issue 55 computed from the seeds' spreads
    assert mde["qerl", "lora"] == pytest.approx(8.2, abs=0.05) and mde["lora-aqn", "lora"] == pytest.approx(7.8, abs=0.05)
    assert mde["qerl-relative", "qerl"] == pytest.approx(12.7, abs=0.05)
    assert q["lora-aqn", "lora"]["final_greedy"]["verdict"] == ("not distinguishable; the seeds could have detected a "
                                                              "difference of about 7.8 points")
    assert q["qerl", "lora"]["final_greedy"]["diff"] == pytest.approx(-13.67, abs=0.01)
    assert q["qerl", "lora"]["final_greedy"]["p"] < 0.001
    assert q["nvfp4-lora", "lora"]["final_greedy"]["p"] == pytest.approx(0.0250, abs=1e-3)
    gain = q["qerl", "lora"]["gain_points"]  # the bases start 8.5 points apart: the same seeds, from their start
    assert gain["diff"] == pytest.approx(-5.17, abs=0.01) and gain["p"] == pytest.approx(0.079, abs=1e-3)
    assert "gain_points" not in q["qerl-tis", "qerl"]  # same base, same start: nothing to subtract
    assert {m: s["collapsed_seeds"] for m, s in results["methods"].items() if s["collapses"]} == {"nvfp4-lora": [5]}


def test_the_committed_tables_rebuild_in_their_own_folder(tmp_path):
    """The committed SmolLM2 study rebuilds its table.md byte for byte, from its pack, in its own folder
    (recognised as this script's by its manifest); its statistics are the ones issue 39 computed by hand:
    QeRL (trainer) - NVFP4 + LoRA is -24.0 points, t -2.53, df 2.0, p 0.13, not a ranking; one QeRL seed
    collapsed, and only that one."""
    out = rebuild_committed_study("smollm2-table1", tmp_path)
    assert json.loads((out / files.OUT_MANIFEST).read_text())["files"] == sorted(files.OUTPUTS)
    results = json.loads((out / "results.json").read_text())
    q = next(q for q in results["questions"] if (q["a"], q["b"]) == ("qerl", "nvfp4-lora"))["final_greedy"]
    assert q["diff"] == pytest.approx(-24.0) and q["t"] == pytest.approx(-2.527, abs=1e-3)
    assert q["df"] == pytest.approx(2.009, abs=1e-3) and q["p"] == pytest.approx(0.1269, abs=1e-3)
    assert q["verdict"].startswith("not distinguishable; the seeds could have detected a difference of about 50.8 ")
    assert all(q["final_greedy"]["p"] >= 0.05 and q["final_greedy"]["verdict"].startswith("not distinguishable")
               for q in results["questions"])  # at n = 3 no SmolLM2 contrast reaches p < 0.05
    assert q["p_permutation"] == pytest.approx(0.1) and q["p_holm"] == pytest.approx(0.8)  # 8 questions
    assert {m: s["collapses"] for m, s in results["methods"].items() if s["collapses"]} == {"qerl": 1}
    assert results["methods"]["qerl"]["collapsed_seeds"] == [2]
    assert "| 25.2 ± 16.4 | 1 of 3 |" in (out / "table.md").read_text()


# ---------------------------------------------------------------------------------------------------
# Statistics: Welch's t over seeds, its t distribution written out (no scipy), and collapses

@pytest.mark.parametrize("t, df, p", [(2.0, 4, 0.1161165), (2.0, 1, 1 - 2 / 3.141592653589793 * 1.1071487),
                                      (1.5, 2, 1 - 1.5 / (2 + 1.5 ** 2) ** 0.5), (-3.0, 10, 0.0133437),
                                      (0.0, 3, 1.0), (1.959964, 1e7, 0.05)])
def test_the_t_distribution_gives_known_two_sided_p_values(t, df, p):
    """Tables and closed forms: df 1 is Cauchy (1 - 2 atan|t| / pi), df 2 is 1 - |t| / sqrt(2 + t^2), a huge
    df is the normal distribution."""
    assert stats.t_two_sided_p(t, df) == pytest.approx(p, abs=2e-6)
    assert stats.t_cdf(t, df) + stats.t_cdf(-t, df) == pytest.approx(1.0)


@pytest.mark.parametrize("df, q", [(1, 12.706205), (2, 4.302653), (2.5, 3.57465), (4, 2.776445), (30, 2.042272)])
def test_the_t_quantile_inverts_the_cdf(df, q):
    """The 97.5% quantiles of a t table; df 2.5 (the fractional df Welch gives) by integrating the density."""
    assert stats.t_quantile(0.975, df) == pytest.approx(q, abs=1e-4 if df == 2.5 else 1e-5)
    assert stats.t_quantile(0.025, df) == pytest.approx(-stats.t_quantile(0.975, df))
    assert stats.t_cdf(stats.t_quantile(0.9, df), df) == pytest.approx(0.9, abs=1e-9)


def test_welch_gives_the_interval_and_p_and_ranks_only_below_005():
    # a = 1, 2, 3 and b = 4, 5, 6: diff -3, se sqrt(2/3), t -3.674, df 4, p 0.0213 (a t table)
    w = stats.welch(2.0, 1.0, 3, 5.0, 1.0, 3)
    assert w["diff"] == -3.0 and w["df"] == pytest.approx(4.0) and w["t"] == pytest.approx(-3.6742, abs=1e-4)
    assert w["p"] == pytest.approx(0.02131, abs=1e-4)
    assert w["ci"] == pytest.approx([-3 - 2.776445 * (2 / 3) ** 0.5, -3 + 2.776445 * (2 / 3) ** 0.5], abs=1e-4)
    assert stats.verdict("a", "b", {**w, "p_holm": w["p"]}) == "b ends higher than a"  # were it the adjusted p
    assert stats.verdict("a", "b", w) == "not distinguishable"  # no family-adjusted p: no ranking
    assert "[-5.3, -0.7], Welch's t p 0.021" in report.contrast_text(w)
    # the same means at twice the spread: p 0.14, no ranking (the old two-standard-error rule called it)
    wide = stats.welch(2.0, 2.0, 3, 5.0, 2.0, 3)
    assert wide["t"] == pytest.approx(-1.837, abs=1e-3) and wide["p"] == pytest.approx(0.140, abs=1e-3)
    assert stats.verdict("a", "b", {**wide, "p_holm": wide["p"]}) == "not distinguishable"
    # a lone seed, or no spread on either side: nothing to judge by, never a ranking
    for w in (stats.welch(2.0, 0.0, 1, 5.0, 1.0, 3), stats.welch(2.0, 0.0, 3, 5.0, 0.0, 3)):
        assert w["p"] is None and w["ci"] is None and stats.verdict("a", "b", w) == "not distinguishable"


def test_a_collapse_is_a_run_below_its_start_or_with_shrunk_completions():
    """The committed collapsed seed (smollm2-table1 qerl-s2: 11% -> 7.5%, 31.5 -> 2.8 tokens) trips both rules; a
    healthy SmolLM2 run shortens its answers to a third (32 -> 10.5 tokens) and trips neither."""
    both = stats.collapse(0.11, 0.075, 31.5, 2.8)
    assert "ended below its start (7.5% < 11.0%)" in both and "shrank to 2.8 tokens from 31.5" in both
    assert stats.collapse(0.11, 0.49, 32.0, 10.5) is None
    assert stats.collapse(0.11, 0.30, 30.0, 7.0) == "completions shrank to 7.0 tokens from 30.0"
    assert stats.collapse(0.11, 0.30, 30.0, 7.5) is None  # exactly a quarter is not under it
    assert stats.collapse(0.20, 0.19, None, None) == "ended below its start (19.0% < 20.0%)"  # no lengths logged


def test_a_resumed_study_with_other_05_flags_is_refused_before_training(tmp_path):
    """A finished run recorded with other 05 settings is not averaged with new runs: the command stops
    before training, naming the flag (a run from before versions.txt recorded its argv: its args)."""
    out = tmp_path / "cmp"
    committed_runs(out, ["lora-s0"])
    base = ["--methods", "lora", "--seeds", "0", "1", "--out", str(out), "--dry-run"]
    with pytest.raises(ValueError, match=r"runs/lora-s0 was trained with --lr 0.001, this command runs with --lr 5e-3"):
        cmp.main(base + ["--", "--lr", "5e-3"])
    with pytest.raises(ValueError, match=r"was trained with --eval-size 500, this command runs with --eval-size 20"):
        cmp.main(base + ["--eval-size", "20"])
    cmp.main(base)  # the same settings: seed 1 is planned beside the finished seed 0


def test_from_results_refuses_runs_of_other_settings(tmp_path):
    out = tmp_path / "cmp"
    committed_runs(out, ["lora-s0", "lora-s1"])
    path = out / "runs" / "lora-s1" / "summary.json"
    summary = json.loads(path.read_text())
    summary["args"]["lr"] = 0.005
    path.write_text(json.dumps(summary))
    with pytest.raises(ValueError, match=r"lora-s1 was trained with --lr 0.005 and .*lora-s0 with 0.001"):
        cmp.main(["--from-results", "--out", str(out)])


def sleeper(*argv):
    """A live process whose command line names compare_methods.py: to the checks, another copy of it."""
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)", *argv])


def test_a_second_copy_reuses_only_a_verified_snapshot(tmp_path):
    runs_root = str(tmp_path / "runs")
    os.makedirs(runs_root)
    snap, md5, made = runner.prepare_code(runs_root)
    assert made and md5 == runner.tree_hash(snap)
    record = os.path.join(snap, runner.SNAPSHOT_RECORD)
    other = sleeper("bench/compare_methods.py")
    unrelated = sleeper("something_else.py")
    try:
        time.sleep(0.2)
        as_made_by = lambda owner: open(record, "w").write(json.dumps({"md5": md5, "owner": owner}))  # noqa: E731
        as_made_by(runner.process_identity(other.pid))
        assert runner.prepare_code(runs_root) == (snap, md5, False)  # the first copy's, untouched: reused
        with open(os.path.join(snap, "qerl", "cli.py"), "a") as f:
            f.write("\nimport os; os.system('echo planted')\n")
        with pytest.raises(ValueError, match=f"changed since process {other.pid} made it"):
            runner.prepare_code(runs_root)
        # a record naming PID 1 (always alive) or another program is no live copy: never reused, and what its
        # record does not vouch for is not even removed
        for owner in (runner.process_identity(1), runner.process_identity(unrelated.pid), [other.pid, "1"]):
            as_made_by(owner)
            with pytest.raises(ValueError, match="was not made by a running copy of this script"):
                runner.prepare_code(runs_root)
        assert "planted" in open(os.path.join(snap, "qerl", "cli.py")).read()
        # an untouched snapshot of a copy that has gone is made again, from this checkout
        shutil.copy(os.path.join(ROOT, "qerl", "cli.py"), os.path.join(snap, "qerl", "cli.py"))
        as_made_by(runner.process_identity(unrelated.pid))
        assert runner.prepare_code(runs_root) == (snap, md5, True)
        assert runner.read_record(snap)["owner"] == runner.process_identity(os.getpid())
    finally:
        for p in (other, unrelated):
            p.kill()
            p.wait()


def test_a_snapshot_changed_during_the_study_is_not_run(tmp_path, monkeypatch):
    """The copy the runs import is hashed again before every run: a file added to it between two runs stops
    the study, and the copy (this invocation's own folder) is removed with what was added."""
    out = tmp_path / "cmp"
    marker = tmp_path / "second-run-started"
    copies = []

    def command(args, method, seed, run_dir, code_dir=studies.ROOT):  # each "run" adds a module to its code
        copies.append(code_dir)
        return [sys.executable, "-c", f"open({os.path.join(code_dir, 'torch.py')!r}, 'w');"
                f"open({str(marker)!r}, 'a').write('x')"]
    monkeypatch.setattr(runner, "run_command", command)
    with pytest.raises(ValueError, match="changed since this invocation checked it"):
        cmp.main(["--methods", "lora", "--steps", "1", "--seeds", "0", "1", "--parallel", "1", "--eval-size", "2",
                  "--out", str(out)])
    assert marker.read_text() == "x"  # the first run only
    assert not os.path.exists(copies[0]) and not (out / "runs" / ".code").exists()


def test_the_runs_import_the_checked_bytes_whatever_changes_in_out(tmp_path, monkeypatch):
    """Issue 56: the snapshot in --out was checked, then a run imported it 2 s later: a process that could
    write there edited runs/.code/qerl/files.py in that window and restored it after, with no trace. Now
    a run imports its invocation's own copy (mode 0700, this user's, in TMPDIR, removed at the end),
    written from the bytes that were hashed; python -E keeps a PYTHONPATH folder from coming first."""
    out, marker = tmp_path / "cmp", tmp_path / "planted-code-ran"
    planted = tmp_path / "pythonpath"
    planted.mkdir()
    (planted / "json.py").write_text(f"open({str(marker)!r}, 'a').write('PYTHONPATH json ')\n")
    monkeypatch.setenv("PYTHONPATH", str(planted))
    seen = {}

    def command(args, method, seed, run_dir, code_dir=studies.ROOT):  # the run: imports qerl.files as 05 would
        st = os.stat(code_dir)
        seen.update(script=real_command(args, method, seed, run_dir, code_dir)[1], code_dir=code_dir,
                    mode=stat.S_IMODE(st.st_mode), uid=st.st_uid)
        return [sys.executable, "-c", f"import sys; sys.path.insert(0, {code_dir!r}); import qerl.files as f; "
                f"open({os.path.join(run_dir, 'imported')!r}, 'w').write(f.__file__)"]
    real_command, real_popen = runner.run_command, subprocess.Popen

    def window(argv, **kwargs):  # between the check and the imports: another process edits runs/.code, restores it
        target = out / "runs" / ".code" / "qerl" / "files.py"
        original = target.read_bytes()
        target.write_bytes(f"open({str(marker)!r}, 'a').write('snapshot files.py ')\n".encode() + original)
        try:
            proc = real_popen(argv, **kwargs)
            proc.wait()
        finally:
            target.write_bytes(original)
        return proc
    monkeypatch.setattr(runner, "run_command", command)
    monkeypatch.setattr(runner.subprocess, "Popen", window)
    with pytest.raises(ValueError):  # the double writes no summary.json: nothing to report
        cmp.main(["--methods", "lora", "--steps", "1", "--seeds", "0", "--eval-size", "2", "--out", str(out)])
    assert not marker.exists(), marker.read_text()
    imported = (out / "runs" / "lora-s0" / "imported").read_text()
    assert imported == os.path.join(seen["code_dir"], "qerl", "files.py")
    assert seen["script"] == os.path.join(seen["code_dir"], "qerl/train.py")  # what a real run starts
    assert not seen["code_dir"].startswith(str(tmp_path)) and os.path.basename(seen["code_dir"]).startswith(
        runner.PRIVATE_CODE)
    assert seen["mode"] == 0o700 and seen["uid"] == os.getuid()
    assert not os.path.exists(seen["code_dir"]) and not (out / "runs" / ".code").exists()  # both removed


def test_a_relative_tmpdir_names_one_folder_for_the_study_and_its_runs(tmp_path, monkeypatch):
    """TMPDIR=scratch (relative): the study makes its private copy in ./scratch, and its runs, which start in the
    checkout, get that folder's absolute path (before: they read scratch in the checkout, which did not exist, and
    put their temporaries in /tmp, with a note only in each run's train.log)."""
    (tmp_path / "scratch").mkdir()
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("TMPDIR", "scratch")
    monkeypatch.setattr(tempfile, "tempdir", None)  # read TMPDIR again, as a new process does
    seen = {}

    def command(args, method, seed, run_dir, code_dir=studies.ROOT):  # the run: says where its temporaries go
        seen["code_dir"] = code_dir
        return [sys.executable, "-c", f"import os, tempfile; open({os.path.join(run_dir, 'tmp')!r}, 'w').write("
                f"os.environ['TMPDIR'] + ' ' + tempfile.gettempdir())"]
    monkeypatch.setattr(runner, "run_command", command)
    out = tmp_path / "cmp"
    with pytest.raises(ValueError):  # the double writes no summary.json: nothing to report
        cmp.main(["--methods", "lora", "--steps", "1", "--seeds", "0", "--eval-size", "2", "--out", str(out)])
    scratch = str(tmp_path / "scratch")
    assert (out / "runs" / "lora-s0" / "tmp").read_text() == f"{scratch} {scratch}"
    assert os.path.dirname(seen["code_dir"]) == os.path.realpath(scratch)


def test_only_the_manifest_is_copied_and_a_file_dropped_in_is_never_used(tmp_path, monkeypatch):
    """The code is the five stages, qerl/*.py and kernels/*.py, read once: a torch.py beside the stages, a
    __pycache__ or notes in the packages are never copied; a file dropped into a copy while it is written
    (the snapshot's new folder in runs/, or the private copy) stops the command before anything runs."""
    assert runner.CODE_FILES == (*(f"0{i}_{n}.py" for i, n in enumerate(
        ["quantize", "lora", "rollout", "aqn", "grpo"], 1)), "kernels", "qerl")
    checkout = tmp_path / "checkout"
    checkout.mkdir()
    for name in runner.CODE_FILES:
        src = os.path.join(ROOT, name)
        if os.path.isdir(src):
            shutil.copytree(src, checkout / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy(src, checkout / name)
    for extra in ("torch.py", "qerl/notes.txt", "qerl/__pycache__/torch.cpython-311.pyc", "kernels/data.bin"):
        (checkout / extra).parent.mkdir(exist_ok=True)
        (checkout / extra).write_text("open('/nonexistent/ran', 'w')\n")
    code = runner.read_code(str(checkout))
    assert code == runner.read_code()
    md5 = runner.entries_md5(code)

    runs_root, made = tmp_path / "runs", []
    runs_root.mkdir()
    real_write = runner.write_code

    def write_and_drop(dest, entries):  # another process drops torch.py in while the copy is written
        made.append(dest)
        real_write(dest, entries)
        (Path(dest) / "torch.py").write_text("open('/nonexistent/ran', 'w')\n")
    monkeypatch.setattr(runner, "write_code", write_and_drop)
    with pytest.raises(ValueError, match="changed while this script wrote the code snapshot"):
        runner.prepare_code(str(runs_root), code)
    assert os.path.basename(made[0]).startswith(".code.tmp") and os.listdir(runs_root) == []  # not renamed, gone
    with pytest.raises(ValueError, match="changed while this script wrote it"):
        runner.private_code(code, md5)
    assert not os.path.exists(made[1])
    monkeypatch.setattr(runner, "write_code", real_write)
    folder = runner.private_code(code, md5)
    try:
        assert runner.tree_hash(folder) == md5 and sorted(os.listdir(folder)) == sorted(runner.CODE_FILES)
        assert stat.S_IMODE(os.stat(folder).st_mode) == 0o700
    finally:
        runner.remove_private(folder)
    assert not os.path.exists(folder)


def test_a_private_copy_under_a_folder_others_can_write_is_refused(tmp_path, monkeypatch):
    """A folder above the copy that another user can write (without /tmp's sticky bit) lets them move the
    copy away and put theirs in its place: refused in one line naming TMPDIR; with the sticky bit, used."""
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    monkeypatch.setattr(runner.tempfile, "tempdir", str(shared))
    code = runner.read_code()
    with pytest.raises(ValueError, match=f"{shared} .* can be written by another user.*set TMPDIR"):
        runner.private_code(code, runner.entries_md5(code))
    assert os.listdir(shared) == []
    shared.chmod(0o1777)
    folder = runner.private_code(code, runner.entries_md5(code))
    assert os.path.dirname(folder) == str(shared)
    runner.remove_private(folder)
    assert os.listdir(shared) == []


@pytest.mark.parametrize("signum, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_ctrl_c_or_kill_stops_the_runs_and_exits_128_plus_the_signal(tmp_path, monkeypatch, capsys, signum, code):
    out = tmp_path / "cmp"
    started = []
    monkeypatch.setattr(runner, "run_command", lambda *a, **k: [sys.executable, "-c", "import time; time.sleep(60)"])

    real_sleep = time.sleep

    def tick(seconds):  # the first second of the wait loop: the signal arrives (later sleeps: the stop's wait)
        if started:
            return real_sleep(seconds)
        started.extend(p for p in os.listdir(out / "runs") if p.endswith(".claim"))
        raise cmp.cli.Interrupted(signum=signum)
    monkeypatch.setattr(runner.time, "sleep", tick)
    capsys.readouterr()
    assert cmp.cli.run_cli(cmp.main, ["--methods", "lora", "--steps", "1", "--seeds", "0", "--eval-size", "2",
                                         "--out", str(out)]) == code
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("interrupted") and "rerun the same command" in err[0], err
    assert started == [".lora-s0.claim"]
    assert sorted(os.listdir(out / "runs")) == ["lora-s0"]  # its claim and the snapshot are gone


def test_the_flags_after_dashes_name_one_model_and_never_help(tmp_path, monkeypatch):
    """A relative -- --model is the folder as seen from where the study was started (the runs start in the
    checkout: it would otherwise train another model than the one recorded); -- --help is refused."""
    monkeypatch.chdir(tmp_path)
    args = cmp.parse_args(["--methods", "lora", "--", "--model", "mine/model"])
    assert args.train_args[-1] == str(tmp_path / "mine" / "model") == runner.model_dir(args)
    args = cmp.parse_args(["--methods", "lora", "--", "--model=mine/model"])
    assert args.train_args[-1] == "--model=" + str(tmp_path / "mine" / "model")
    for flag in ("--help", "-h"):
        with pytest.raises(ValueError, match=f"{flag} after -- would make every run print the trainer's help"):
            cmp.parse_args(["--methods", "lora", "--", flag])
