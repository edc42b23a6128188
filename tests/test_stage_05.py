"""Stage 05 (05_grpo.py) against the trainer (qerl/train.py): the same task, the same command line
names and defaults, and a short run equal to the trainer's plain path number for number."""

import importlib
import json

import pytest
import torch
from safetensors.torch import load_file

from qerl import tasks
from qerl import train as trainer

grpo = importlib.import_module("05_grpo")

SHORT_RUN = ["--steps", "3", "--batch", "2", "--group", "4", "--max-new-tokens", "40"]
SHORT_RUN += ["--eval-size", "8", "--seed", "2", "--device", "cpu"]
TIMES = ("tok/s", "s/step", "time", "seconds")  # a clock's, not the computation's


def default_task():
    """The trainer's task under its default command line (the bundled model: a bare prompt)."""
    return tasks.make_task(trainer.build_parser().parse_args([]), trainer.parser_defaults())


def completions(answer):
    """Well- and ill-formed completions of a problem whose answer is `answer`."""
    a = answer
    return [
        f"<think>x</think><answer>{a}</answer>",
        f" <think>x</think>\n<answer> {a} </answer>\n",
        f"<think>x</think><answer>{a}</answer><|im_end|>",
        f"<answer>{a}</answer>",
        f"<think>x</think><answer>{a + 1}</answer>",
        f"<think>x</think><answer>{a}</answer><answer>{a + 1}</answer>",
        f"<think>x</think><answer>{a + 1}</answer><answer>{a}</answer>",
        f"<think>x</think><answer>{a:,}</answer>",
        f"<think>x</think><answer>{a}.0</answer>",
        f"<think>x</think><answer>{a}.5</answer>",
        f"<think>x</think><answer>is {a} or 7</answer>",
        f"<think>x</think><answer>7 or {a}</answer>",
        "<think>x</think><answer></answer>",
        f"<think><think></think><answer>{a}</answer>",
        f"<think>x</think><answer>{a}",
        f"<answer>1<answer>{a}</answer>",
        f"<answer>{a}<|endoftext|>1</answer>",
        "<think>x</think><answer>-.5</answer>",
        f"<think>x</think><answer>{'9' * 101}</answer>",
        "",
        "no tags at all 12",
    ]


def test_problems_prompts_and_rewards_are_the_trainers_default_task():
    task = default_task()
    held, exclude = grpo.held_out(500)
    assert [(p["question"], str(p["answer"])) for p in held] == [
        (p["question"], p["answer"]) for p in task.held
    ]
    assert exclude == task.exclude
    for seed, step in [(0, 0), (0, 1), (2, 749), (7, 3)]:
        ours, theirs = grpo.problems(seed, step, 16, exclude), task.problems(seed, step, 16)
        assert [p["question"] for p in ours] == [p["question"] for p in theirs]
        assert [grpo.prompt(p) for p in ours] == [task.prompt(p) for p in theirs]
        for p, q in zip(ours, theirs):
            for text in completions(p["answer"]) + [q["solution"]]:
                assert grpo.reward(p, text) == task.reward(q, text), text
                assert grpo.correct(p, text) == task.correct(q, text), text
    assert grpo.reward(ours[0], theirs[0]["solution"]) == 1.1  # correct, and well formed


def test_the_flags_are_the_trainers_with_its_defaults():
    ours, theirs = grpo.build_parser(), trainer.build_parser()

    def flags(parser):
        return {s for a in parser._actions for s in a.option_strings} - {"-h", "--help"}

    assert flags(ours) <= flags(theirs)
    assert grpo.TRAINER_FLAGS == flags(theirs) - flags(ours)  # each of the others is named
    assert len([a for a in ours._actions if "--help" not in a.option_strings]) <= 20
    defaults, trainers = vars(ours.parse_args([])), vars(theirs.parse_args([]))
    assert defaults == {k: trainers[k] for k in defaults}


def test_a_trainer_flag_names_the_trainer_command():
    with pytest.raises(SystemExit) as e:
        grpo.main(["--steps", "5", "--eps-low=0.3", "--show-step"])
    line = str(e.value)
    assert "\n" not in line and "--eps-low is a trainer flag" in line
    assert line.endswith(": python -m qerl.train --steps 5 --eps-low=0.3 --show-step")


def test_a_short_run_is_the_trainers_plain_path_number_for_number(tmp_path, trainer_plain_path):
    # the trainer's plain path (--plain, set again by the fixture, which puts the switches back afterwards)
    ours = grpo.build_parser().parse_args(SHORT_RUN + ["--out", str(tmp_path / "stage")])
    summary = grpo.train(ours)
    theirs = ["--plain", "--eval-k", "0", "--quiet", "--out", str(tmp_path / "trainer")]
    trainer.train(trainer.build_parser().parse_args(SHORT_RUN + theirs))

    def records(folder):
        return [json.loads(line) for line in open(tmp_path / folder / "metrics.jsonl")]

    stage, reference = records("stage"), records("trainer")
    assert len(stage) == len(reference) == 5  # an evaluation, 3 steps, an evaluation
    for a, b in zip(stage, reference):
        a, b = a.get("eval", a), b.get("eval", b)
        assert set(a) <= set(b)
        assert {k: v for k, v in a.items() if k not in TIMES} == {
            k: b[k] for k in a if k not in TIMES
        }
    steps = [r for r in stage if "eval" not in r]
    assert any(r["grad_norm"] > 0 for r in steps)  # the run trained,
    assert any(r["sigma"] > 0 and r["sigma_applied"] > 0 for r in steps)  # under AQN's noise
    adapter = load_file(tmp_path / "stage" / "adapter_model.safetensors")
    expected = load_file(tmp_path / "trainer" / "checkpoint-000003" / "adapter_model.safetensors")
    assert adapter.keys() == expected.keys()
    assert all(torch.equal(adapter[k], expected[k]) for k in adapter)
    assert any(bool(t.abs().sum() > 0) for k, t in adapter.items() if "lora_B" in k)
    saved = json.load(open(tmp_path / "stage" / "summary.json"))
    assert saved["final_eval"] == summary["final_eval"] and saved["steps_done"] == 3
