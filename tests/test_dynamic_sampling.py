"""The sampler as a seam: several fresh, reproducible draws in one step (sample_groups' draw), tasks whose
problems are prefix-stable in n and never silently short, and DAPO's dynamic sampling (--dynamic-sampling),
which replaces the groups whose rewards all tie and resumes exactly."""
import hashlib
import importlib
import json
import random

import pytest
import torch

from qerl import tasks
import test_bad_inputs as bad
from test_grpo import step_rows

grpo = importlib.import_module("qerl.train")
rollout = importlib.import_module("qerl.rollout")
aqn = importlib.import_module("qerl.aqn")


@pytest.fixture(scope="module")
def policy():
    model, tok = rollout.load_model(grpo.TINY_MODEL, quant="none", device="cpu")
    grpo.lora.add_lora(model, r=4, alpha=8, generator=torch.Generator().manual_seed(0))
    return model, tok


class HalfFlatTask(tasks.ArithmeticTask):
    """Arithmetic whose rewards all tie (0) for an odd answer, and depend on the completion for an even one
    (sampled at temperature 2, so that a fresh tiny policy's G completions differ)."""
    def reward(self, problem, completion):
        return 0.0 if int(problem["answer"]) % 2 else float(sum(map(ord, completion or "")) % 2)


def encode(tok, task, problems):
    return [tok.encode(task.prompt(p)) for p in problems]

# -----------------------------------------------------------------------------
# Draws


def test_each_draw_of_a_step_samples_afresh_and_reproducibly(policy):
    model, tok = policy
    prompts = encode(tok, tasks.ArithmeticTask(eval_size=0), [{"question": "12+3-4=?"}, {"question": "70-8=?"}])
    kw = dict(seed=3, group=2, max_new_tokens=6)
    (d0, a0), (d0b, _), (d1, a1), (d1b, _) = (grpo.sample_groups(model, tok, prompts, 5, 2e-2, draw=d, **kw)
                                              for d in (0, 0, 1, 1))
    assert torch.equal(d0.completion_ids, d0b.completion_ids) and torch.equal(d1.completion_ids, d1b.completion_ids)
    assert not torch.equal(d0.completion_ids, d1.completion_ids)  # a second draw in the step is fresh
    assert a0 == a1 > 0  # under the step's one noise draw
    # draw 0 is the seed of before draws existed: (seed, step) alone, the noise drawn first from the same stream
    gen = torch.Generator().manual_seed(3 * 1_000_003 + 5)
    with torch.inference_mode(), aqn.aqn_noise(model, 2e-2, gen), grpo.merged_sampling_weights(model):
        want = rollout.generate(model, prompts, num_samples=2, max_new_tokens=6, eos_token_ids=tok.eos_token_ids,
                                generator=gen, tokenizer=tok)
    assert torch.equal(want.completion_ids, d0.completion_ids) and want.texts == d0.texts

# -----------------------------------------------------------------------------
# Tasks: prefix-stable, never short


def shipped_tasks(tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"question": f"q{i}", "answer": f"#### {i}"}) + "\n" for i in range(24)))
    return {"arithmetic": tasks.ArithmeticTask(eval_size=10), "gsm8k": tasks.JsonlTask(str(data), eval_size=4),
            "chat-arithmetic": tasks.ChatArithmeticTask(eval_size=200)}


def test_problems_are_prefix_stable_in_n_and_never_silently_short(tmp_path):
    for name, task in shipped_tasks(tmp_path).items():
        for seed, step in ((0, 0), (3, 7)):
            drawn = task.problems(seed, step, 50)  # gsm8k: past its 20 problems, another round
            assert len(drawn) == 50, name
            assert all(task.problems(seed, step, k) == drawn[:k] for k in (1, 2, 16, 20, 21, 49)), name
    chat = shipped_tasks(tmp_path)["chat-arithmetic"]
    with pytest.raises(tasks.TooFewProblems, match=r"--task chat-arithmetic gives at most 803 problems a step, not 804"):
        chat.problems(0, 0, 804)
    assert len(chat.problems(0, 0, 803)) == 803


def test_the_bundled_streams_are_unchanged():
    # arithmetic (the bundled results): steps 0-2 of 16 problems, as before prefix-stability was asked for
    task = tasks.ArithmeticTask()
    questions = "|".join(p["question"] for s in range(3) for p in task.problems(0, s, 16))
    assert hashlib.sha256(questions.encode()).hexdigest() == \
        "de5a8f7e59c40ca585a5d09ec15e40f0d5ca7afa506eee787a04bcafc08515ec"
    # chat-arithmetic: random.sample's own picks wherever it drew one at a time (every batch up to 85 here)
    chat = tasks.ChatArithmeticTask()
    assert chat.problems(0, 3, 16) == random.Random(3).sample(chat.train, 16)
    assert chat.problems(2, 1, 85) == random.Random(2 * 1_000_003 + 1).sample(chat.train, 85)

# -----------------------------------------------------------------------------
# Dynamic sampling


def test_flat_groups_are_replaced_by_the_steps_further_problems_and_the_batch_keeps_its_size(policy):
    model, tok = policy
    task, B, G, step = HalfFlatTask(eval_size=0), 4, 4, 1
    args = grpo.build_parser().parse_args(["--batch", str(B), "--group", str(G), "--max-new-tokens", "8",
                                           "--dynamic-sampling", "3", "--temperature", "2"])
    problems = task.problems(args.seed, step, B)
    samples, _ = grpo.sample_groups(model, tok, encode(tok, task, problems), step, 0.0, seed=args.seed, group=G,
                                    max_new_tokens=8, temperature=2.0)
    rewards, correct = grpo.score(task, problems, samples.texts, G)
    flat = (rewards.view(B, G).std(1) == 0).tolist()
    got_problems, got, got_rewards, got_correct, ds = grpo.refill_flat_groups(
        args, task, model, tok, step, 0.0, 0, 1, problems, samples, rewards, correct)
    flat_after = (got_rewards.view(B, G).std(1) == 0).tolist()
    assert ds == {"ds_rounds": ds["ds_rounds"], "ds_flat_before": sum(flat), "ds_sampled": ds["ds_sampled"]}
    assert 1 <= ds["ds_rounds"] <= 3 and sum(flat) <= ds["ds_sampled"] <= 3 * sum(flat)
    assert 0 < sum(flat) and sum(flat_after) < sum(flat)
    assert len(got_problems) == B and len(got.texts) == len(got.prompt_ids) == got.completion_ids.shape[0] == B * G
    want_rewards, want_correct = grpo.score(task, got_problems, got.texts, G)  # the trained batch's own
    assert torch.equal(got_rewards, want_rewards) and got_correct == want_correct
    further = task.problems(args.seed, step, B * (ds["ds_rounds"] + 1))[B:]  # the step's next problems
    for i in range(B):
        rows = slice(i * G, (i + 1) * G)
        if not flat[i]:  # a group with signal stays, row for row
            T = samples.completion_ids.shape[1]
            assert got_problems[i] == problems[i] and got.texts[rows] == samples.texts[rows]
            assert torch.equal(got.completion_ids[rows, :T], samples.completion_ids[rows])
        elif not flat_after[i]:  # a flat one replaced by a fresh problem whose G rewards differ
            assert got_problems[i] in further and got_problems[i] not in problems
            assert got.prompt_ids[rows] == encode(tok, task, [got_problems[i]]) * G


def run_args(out, *extra):
    return grpo.build_parser().parse_args([
        "--out", str(out), "--steps", "2", "--batch", "3", "--group", "3", "--max-new-tokens", "8", "--eval-size", "0",
        "--num-stages", "2", "--time-budget", "0", "--device", "cpu", "--quiet", "--warmup", "1", "--lr", "5e-3",
        "--dynamic-sampling", "2", "--temperature", "2", *extra])


def test_dynamic_sampling_resumes_exactly_and_records_its_rounds(tmp_path):
    grpo.train(run_args(tmp_path / "straight"), task=HalfFlatTask(eval_size=0))
    grpo.train(run_args(tmp_path / "split", "--stop-at", "1"), task=HalfFlatTask(eval_size=0))
    grpo.train(grpo.build_parser().parse_args(["--resume", str(tmp_path / "split"), "--quiet"]),
               task=HalfFlatTask(eval_size=0))
    steps = step_rows(tmp_path / "straight")[0]
    assert steps == step_rows(tmp_path / "split")[0]  # every logged number of the 2 steps, bit for bit
    assert any(r["ds_rounds"] > 0 for r in steps) and all(0 <= r["ds_rounds"] <= 2 for r in steps)
    # frac_zero_std describes the trained batch: never more flat groups than before refilling
    assert all(r["frac_zero_std"] * 3 <= r["ds_flat_before"] for r in steps)
    assert any(r["frac_zero_std"] * 3 < r["ds_flat_before"] for r in steps)


CASES = [
    bad.Case("05-dynamic-sampling-beyond-task", "qerl/train",
             ["--task", "chat-arithmetic", "--batch", "300", "--group", "2", "--dynamic-sampling", "2", *bad.RUN],
             "--dynamic-sampling 2 draws up to 900 problems a step (--batch 300 a round), more than --task "
             "chat-arithmetic gives (503): lower --dynamic-sampling to 0 or less"),
    bad.Case("05-dynamic-sampling-unbounded", "qerl/train", ["--dynamic-sampling", "17", *bad.RUN],
             "need >= 0 and <= 16", code=2),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_bad_dynamic_sampling_flags(case, tmp_path, capsys):
    bad.run_case(case, tmp_path, capsys)
