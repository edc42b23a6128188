"""Runs that always finish, records never shortened (issue 56, item 3): a run stopped at any point (in its final
evaluation, after it, in a checkpoint write, or a resume of a finished run from an earlier checkpoint stopped by
SIGTERM or killed) finishes on --resume with one summary.json and one final row in metrics.jsonl, every step's row
as the uninterrupted run logged it; no resume deletes a row it does not write again. Each case starts from a copy
of one finished run (3 steps, a checkpoint each, evaluations at the start and the end), made once per session.
"""
import os
import signal
import subprocess

import pytest

import test_bad_inputs as bad

grpo, files = bad.STAGES["qerl/train"], bad.files
FINISHED = {}  # the cached run: --steps 3, a checkpoint at each step, pass@2 evaluations at steps 0 and 3
TIMING = ("s/step", "tok/s", "t_sample", "t_score", "cpu_s", "cpu_sample", "peak_rss_mb", "time", "seconds")


@pytest.fixture(autouse=True)
def rewards_by_length(monkeypatch):
    """A reward that depends on the completion alone (its length's parity): groups mix 1 and 0, so AdamW moves, and
    a resumed step gets the rewards the uninterrupted one got."""
    monkeypatch.setattr(bad.tasks.AnswerTask, "reward", lambda self, problem, text: float(len(text) % 2))


def _finished(tmp):
    """{tmp}/run: a copy of the finished run; returns its folder."""
    bad._run_once(FINISHED, "qerl-finished-run-", ["--steps", "3", "--save-every", "1", "--eval-size", "4",
                                                   "--eval-k", "2"], tmp)
    return os.path.join(tmp, "run")


def _rows(run):
    """metrics.jsonl's rows without their clocks: (step, "step" or "eval") -> the row."""
    rows = {}
    for row in bad.runs.read_metrics(os.path.join(run, "metrics.jsonl")):
        key = bad.runs.row_key(row)
        assert key not in rows, f"two rows for {key}"
        record = row.get("eval", row)
        rows[key] = {k: v for k, v in record.items() if k not in TIMING}
    return rows


def _resume(run, *more):
    return bad.cli.run_cli(grpo.main, ["--resume", run, "--quiet", *more])


def _drop_last_rows(run, n):
    path = os.path.join(run, "metrics.jsonl")
    lines = open(path).read().splitlines(keepends=True)
    bad.write(path, "".join(lines[:-n]))


def _check_finishes_as_the_run(tmp, run, capsys):
    """Resumed until it says it is finished: the uninterrupted run's rows (one final evaluation) and summary; a
    further resume changes no file."""
    want = _rows(FINISHED["out"])
    assert [k for k in want if k[1] == 1] == [(0, 1), (3, 1)]
    for _ in range(2):
        capsys.readouterr()
        assert _resume(run) == 0
        if "the run is finished, nothing to add" in capsys.readouterr().out:
            break
    assert _rows(run) == want
    summary = files.read_json(os.path.join(run, "summary.json"))
    assert (summary["steps_done"], summary["stopped_by"], summary["final_eval"]["step"]) == (3, "steps", 3)
    before = bad.snapshot(tmp)
    assert _resume(run) == 0
    assert "the run is finished, nothing to add" in capsys.readouterr().out
    assert bad.snapshot(tmp) == before


def test_a_run_killed_in_its_final_evaluation_evaluates_once(tmp_path, capsys):
    """What kill -9 in the final evaluation leaves (checkpoint-000003, no final row, no summary): the resume
    evaluates, writes summary.json and keeps it; the next resume is finished. (Before: every resume evaluated
    again, added a final row, and removed summary.json on its way out.)"""
    run = _finished(str(tmp_path))
    os.remove(os.path.join(run, "summary.json"))
    _drop_last_rows(run, 1)
    _check_finishes_as_the_run(str(tmp_path), run, capsys)


def test_a_run_killed_before_its_summary_takes_its_final_evaluation_from_the_log(tmp_path, capsys):
    """Killed after the final evaluation's row, before summary.json: the resume evaluates nothing, adds no row,
    and writes the summary from that row."""
    run = _finished(str(tmp_path))
    os.remove(os.path.join(run, "summary.json"))
    metrics = open(os.path.join(run, "metrics.jsonl"), "rb").read()
    assert _resume(run) == 0
    assert "the final evaluation is in metrics.jsonl already: not run again" in capsys.readouterr().out
    assert open(os.path.join(run, "metrics.jsonl"), "rb").read() == metrics
    _check_finishes_as_the_run(str(tmp_path), run, capsys)


def test_a_run_killed_in_its_last_checkpoint_write_logs_its_last_step_once(tmp_path, capsys):
    """Killed while writing checkpoint-000003 (its temporary is all there is): the resume starts at step 2, and its
    row of step 3 replaces the killed run's."""
    run = _finished(str(tmp_path))
    writer = subprocess.Popen(["true"])
    gone = writer.pid, writer.wait()  # the killed writer's process id: no process has it now
    os.rename(os.path.join(run, "checkpoint-000003"), os.path.join(run, f".checkpoint-000003.tmp{gone[0]}"))
    os.remove(os.path.join(run, "summary.json"))
    _drop_last_rows(run, 1)
    _check_finishes_as_the_run(str(tmp_path), run, capsys)
    assert not [n for n in os.listdir(run) if n.startswith(".tmp")]


def test_a_resume_of_a_finished_run_stopped_by_sigterm_keeps_every_row(tmp_path, capsys, monkeypatch):
    """--resume checkpoint-000001 of a finished run, SIGTERM during step 2: the step finishes, checkpoints and exits
    143. Its row of step 2 replaced the old one; steps 3 and the final evaluation stay (before: they were gone, and
    the next resume evaluated from checkpoint-000003 over a log without them)."""
    run = _finished(str(tmp_path))
    sent = []
    reward = bad.tasks.AnswerTask.reward

    def signalled(self, problem, text):  # the stop request arrives while step 2 scores its samples
        if not sent:
            sent.append(os.kill(os.getpid(), signal.SIGTERM))
        return reward(self, problem, text)
    monkeypatch.setattr(bad.tasks.AnswerTask, "reward", signalled)
    assert _resume(os.path.join(run, "checkpoint-000001")) == 128 + signal.SIGTERM
    assert capsys.readouterr().err.startswith("interrupted (SIGTERM) | checkpoint-")
    assert files.read_json(os.path.join(run, "summary.json"))["stopped_by"] == "SIGTERM"
    assert _rows(run) == _rows(FINISHED["out"])  # every row there, one of each
    monkeypatch.setattr(bad.tasks.AnswerTask, "reward", reward)
    _check_finishes_as_the_run(str(tmp_path), run, capsys)


class Killed(BaseException):
    """A process killed where this is raised: no handler of the run's catches it."""


def test_a_resume_of_a_finished_run_killed_in_a_checkpoint_write_keeps_every_row(tmp_path, capsys, monkeypatch):
    """--resume checkpoint-000001 of a finished run, killed as it writes checkpoint-000002 (after its row of step 2):
    metrics.jsonl still holds every step and the final evaluation, so the next resume, which finds the run
    finished (summary.json and checkpoint-000003 are the run's), is right to say so."""
    run = _finished(str(tmp_path))

    def killed(*args, **kwargs):
        raise Killed
    monkeypatch.setattr(bad.checkpoints, "save_checkpoint", killed)
    with pytest.raises(Killed):
        grpo.main(["--resume", os.path.join(run, "checkpoint-000001"), "--quiet"])
    monkeypatch.undo()
    assert _rows(run) == _rows(FINISHED["out"])
    _check_finishes_as_the_run(str(tmp_path), run, capsys)


def test_rows_past_the_checkpoint_stay_until_the_resume_logs_their_step(tmp_path):
    """RunLog alone: the rows past the checkpoint's step stay after this run's rows; a row of the same step and kind
    replaces one; a later row moves those before it in; a cut-off last line goes."""
    run = tmp_path / "run"
    os.makedirs(run)
    old = ['{"step": 1}', '{"step": 2, "old": 1}', '{"eval": {"step": 2, "old": 1}}', '{"step": 3, "old": 1}',
           '{"eval": {"step": 3, "old": 1}}']
    bad.write(str(run / "metrics.jsonl"), "\n".join(old) + '\n{"step": 4, "rew')
    log = bad.runs.RunLog.__new__(bad.runs.RunLog)
    log.args, log.rank, log.start, log.opened = grpo.build_parser().parse_args(["--out", str(run)]), 0, 1, False
    log.metrics = str(run / "metrics.jsonl")
    rows = bad.runs.read_metrics(log.metrics)
    log.kept_rows, log.later_rows = rows[:1], rows[1:]
    log._append({"step": 2})
    assert (run / "metrics.jsonl").read_text().splitlines() == ['{"step": 1}', '{"step": 2}', *old[2:]]
    log._append({"step": 3})  # the old evaluation of step 2 (this run evaluates less often) stays, before it
    assert (run / "metrics.jsonl").read_text().splitlines() == ['{"step": 1}', '{"step": 2}', old[2], '{"step": 3}',
                                                                 old[4]]
    log._append({"eval": {"step": 3}})
    log._append({"step": 4})  # nothing later: appended
    assert (run / "metrics.jsonl").read_text().splitlines() == ['{"step": 1}', '{"step": 2}', old[2], '{"step": 3}',
                                                                 '{"eval": {"step": 3}}', '{"step": 4}']



def test_a_run_that_spent_its_completions_resumes_to_nothing(tmp_path, capsys):
    """--max-completions ended the run (8 completions: 2 steps of 2 x 2) with its final evaluation: a resume is
    finished, as at --steps, and changes no file (before: it wrote summary.json again)."""
    run = str(tmp_path / "run")
    assert bad.cli.run_cli(grpo.main, [*bad.TINY_RUN, "--steps", "3", "--max-completions", "8", "--eval-size", "4",
                                       "--out", run, "--quiet"]) == 0
    assert files.read_json(os.path.join(run, "summary.json"))["stopped_by"] == "completions"
    before = bad.snapshot(str(tmp_path))
    capsys.readouterr()
    assert _resume(run) == 0
    assert "checkpoint-000002 is step 2 (--max-completions 8 stopped the run there): the run is finished" in \
        capsys.readouterr().out
    assert bad.snapshot(str(tmp_path)) == before
