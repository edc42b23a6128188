"""Equal-compute comparisons: a run that stops at a budget of sampled completions (--max-completions, its
LR and AQN schedules spread over the budget) and counts what each step sampled, refills included; and
each evaluation's per-problem outcomes, which a study compares problem by problem."""
import importlib
import json
import os
import shutil
import sys

import pytest
import torch

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


def test_a_budget_the_steps_cannot_spend_is_refused_before_any_work(tmp_path, capsys):
    """A budget beyond what --steps can sample (B x G a step, up to 1 + --dynamic-sampling times that) would end
    the run at --steps with its schedules short of their end (before: 10**18 ran with sigma 0 and step 0's LR at
    every step, and said nothing): one line before any file is written. Between --steps x B x G and that, only
    refills spend the rest: a note. A resume keeps its checkpoint's budget, with a note."""
    for extra, most in ((["--max-completions", str(10 ** 18)], 4 * B * G),
                        (["--max-completions", str(3 * 4 * B * G + 1), "--dynamic-sampling", "2"], 3 * 4 * B * G)):
        with pytest.raises(ValueError, match=rf"^--max-completions [0-9,]+ is more than --steps 4 can sample "
                                             rf"\({most} at most.* lower --max-completions to {4 * B * G} "):
            grpo.train(run_args(tmp_path / "run", *extra))
        assert not (tmp_path / "run").exists()
    capsys.readouterr()
    grpo.run_checks.check_budget(run_args(tmp_path, "--max-completions", str(4 * B * G + 1), "--dynamic-sampling",
                                          "1"), None)
    assert "only --dynamic-sampling's refills spend the rest" in capsys.readouterr().out
    grpo.run_checks.check_budget(run_args(tmp_path, "--max-completions", str(10 ** 18)), "checkpoint-000001")
    assert "note | --max-completions 1,000,000,000,000,000,000 is more than --steps 4" in capsys.readouterr().out
    grpo.run_checks.check_budget(run_args(tmp_path, "--max-completions", str(4 * B * G)), None)
    assert capsys.readouterr().out == ""


@pytest.fixture(scope="module")
def budget_checkpoint(tmp_path_factory):
    """A budget run (--max-completions 4 x B x G) stopped after step 1 with its checkpoint."""
    out = tmp_path_factory.mktemp("budget") / "run"
    grpo.train(run_args(out, "--max-completions", str(4 * B * G), "--stop-at", "1"))
    return out


@pytest.mark.parametrize("edit, message", [
    (lambda s: s.update(completions="x"), rf"says its run sampled 'x' completions, but 1 step\(s\) of --batch {B} x "
                                          rf"--group {G} sample {B * G}: the checkpoint is damaged or edited"),
    (lambda s: s.update(completions=-100), "says its run sampled -100 completions"),
    (lambda s: s.update(completions=10 ** 30), "says its run sampled 1000000000000000000000000000000 completions"),
    (lambda s: s.update(completions=B * G + 0.5), f"says its run sampled {B * G + 0.5} completions"),
    (lambda s: s.pop("completions"), rf"does not say how many completions its run sampled, which its "
                                     rf"--max-completions {4 * B * G} counts"),
    (lambda s: s.update(first_eval="x"), r"first_eval is not the record of an evaluation at step 0..1"),
    (lambda s: s.update(first_eval={}), r"first_eval is not the record of an evaluation at step 0..1"),
], ids=["text", "negative", "huge", "fraction", "missing", "eval-text", "eval-empty"])
def test_a_checkpoint_whose_progress_was_edited_is_refused(edit, message, budget_checkpoint, tmp_path):
    """trainer_state.pt's completions (what the budget counts) and first evaluation, edited: one line naming the
    file, before the model loads (before: a traceback for text; -100, 10**30 and NaN an error about a schedule
    step, or a run that stopped at once; a missing count restarted the budget, and the run overran it)."""
    run = tmp_path / "run"
    shutil.copytree(budget_checkpoint, run)
    state_file = run / "checkpoint-000001" / "trainer_state.pt"
    state = torch.load(state_file, weights_only=True)
    assert state["completions"] == B * G
    edit(state)
    torch.save(state, state_file)
    log = (run / "metrics.jsonl").read_text()
    with pytest.raises(ValueError, match=rf"^--resume: {state_file}:? ?.*{message}"):
        grpo.train(grpo.build_parser().parse_args(["--resume", str(run), "--quiet"]))
    assert (run / "metrics.jsonl").read_text() == log


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
