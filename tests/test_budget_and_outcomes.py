"""Equal-compute comparisons: a run that stops at a budget of sampled completions (--max-completions, its
LR and AQN schedules spread over the budget) and counts what each step sampled, refills included; and
each evaluation's per-problem outcomes, which a study compares problem by problem."""
import importlib
import json
import os
import sys

import pytest

from test_dynamic_sampling import HalfFlatTask
from test_grpo import step_rows

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))
grpo = importlib.import_module("qerl.train")
study_files = importlib.import_module("study_files")

B, G = 3, 3


def run_args(out, *extra):
    return grpo.build_parser().parse_args([
        "--out", str(out), "--steps", "4", "--batch", str(B), "--group", str(G), "--max-new-tokens", "8",
        "--eval-size", "6", "--eval-k", "0", "--num-stages", "2", "--time-budget", "0", "--device", "cpu",
        "--quiet", "--warmup", "1", "--lr", "5e-3", "--temperature", "2", *extra])


def summary(out):
    return json.load(open(os.path.join(out, "summary.json")))


def test_a_refilling_run_stops_at_its_budget_and_spreads_its_schedule_over_it(tmp_path):
    budget = 4 * B * G  # the four steps a run without refills would take
    out = tmp_path / "run"
    grpo.train(run_args(out, "--dynamic-sampling", "2", "--max-completions", str(budget)),
               task=HalfFlatTask(eval_size=6))
    steps, evals = step_rows(out)
    assert all(r["completions"] == G * (B + r["ds_sampled"]) for r in steps)  # the refills counted
    assert any(r["ds_sampled"] > 0 for r in steps)
    totals = [sum(r["completions"] for r in steps[:i]) for i in range(len(steps) + 1)]
    assert totals[-2] < budget <= totals[-1] and len(steps) < 4  # stopped at the step that spent it
    s = summary(out)
    assert s["stopped_by"] == "completions" and s["steps_done"] == len(steps)
    assert [e["step"] for e in evals] == [0, len(steps)]  # the final evaluation, once
    for r, done in zip(steps, totals):  # each step's LR sits where its completions so far put it
        at = min(done * 4 // budget, 3)
        assert r["lr"] == pytest.approx(5e-3 * grpo.lr_factor(at, 1, 4, 0.1), rel=1e-12)


def test_a_budget_of_steps_x_batch_x_group_is_the_run_without_one(tmp_path):
    for name, extra in (("plain", []), ("budget", ["--max-completions", str(4 * B * G)])):
        grpo.train(run_args(tmp_path / name, *extra))
    assert step_rows(tmp_path / "plain") == step_rows(tmp_path / "budget")  # every number, bit for bit
    # both ends come at step 4 together: the steps' end is the one named
    assert summary(tmp_path / "budget")["stopped_by"] == summary(tmp_path / "plain")["stopped_by"] == "steps"


def test_a_budget_run_resumes_to_the_uninterrupted_one(tmp_path):
    extra = ["--dynamic-sampling", "2", "--max-completions", str(3 * B * G)]
    grpo.train(run_args(tmp_path / "straight", *extra), task=HalfFlatTask(eval_size=6))
    grpo.train(run_args(tmp_path / "split", *extra, "--stop-at", "1"), task=HalfFlatTask(eval_size=6))
    grpo.train(grpo.build_parser().parse_args(["--resume", str(tmp_path / "split"), "--quiet"]),
               task=HalfFlatTask(eval_size=6))
    assert step_rows(tmp_path / "straight") == step_rows(tmp_path / "split")
    assert summary(tmp_path / "split")["stopped_by"] == "completions"


def test_each_evaluation_records_which_problems_it_got_right(tmp_path):
    out = tmp_path / "run"
    grpo.train(run_args(out, "--steps", "1", "--eval-size", "12", "--max-new-tokens", "32"))
    _, evals = step_rows(out)
    assert len(evals) == 2 and evals[0]["greedy_correct"] > 0  # some right, some wrong
    for e in evals:
        assert len(e["outcomes"]) == e["n"] == 12 and set(e["outcomes"]) <= {"0", "1"}
        assert e["outcomes"].count("1") == e["greedy_correct"]
    assert summary(out)["final_eval"]["outcomes"] == evals[-1]["outcomes"]


def test_the_ranks_shares_of_the_outcomes_make_the_whole_set(monkeypatch):
    # each rank scores its contiguous share (distributed.shard); their vectors summed in place are the set
    answers = [True, False, False, True, True, False, True]
    shares = [grpo.distributed.shard(answers, r, 3) for r in range(3)]
    vectors = []

    def fake_sum(values, op="sum"):
        vectors.append(values)
        return values

    monkeypatch.setattr(grpo.distributed, "global_sum", fake_sum)
    for rank, mine in enumerate(shares):
        grpo.held_out_outcomes(mine, len(answers), rank, 3)
    summed = [sum(column) for column in zip(*vectors)]
    assert "".join("1" if v else "0" for v in summed) == "1001101"
    assert all(v in (0.0, 1.0) for v in summed)  # no problem counted twice


def test_a_study_reads_a_budget_run_as_finished_and_its_outcomes_only_if_sound():
    done = {"args": {"steps": 175}, "steps_done": 98, "stopped_by": "completions", "wall_s": 1.0}
    assert study_files.finished_steps({"summary.json": json.dumps(done)}) == 175
    assert study_files.finished_steps({"summary.json": json.dumps(dict(done, stopped_by="SIGTERM"))}) is None
    assert study_files.outcomes_text({"n": 4, "outcomes": "0110"}) == "0110"
    for bad in ("011", "01102", 1101, None, "0110\n"):
        assert study_files.outcomes_text({"n": 4, "outcomes": bad}) is None
