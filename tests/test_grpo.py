"""Stage 05: the task, reward, advantages, loss aggregations, clipping, evaluation counts, data loading,
and short GRPO runs on the bundled tiny model (smoke, exact resume, bad input)."""
import importlib
import json
import math
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

grpo = importlib.import_module("05_grpo")
rollout = importlib.import_module("03_rollout")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# -----------------------------------------------------------------------------
# Task and reward


def test_problem_is_worked_left_to_right():
    import random
    p = grpo.make_problem(random.Random(3), digits=3, nops=2)
    a, op1, b, op2, c = [int(x) if x.isdigit() else x for x in
                         p["question"][:-2].replace("+", " + ").replace("-", " - ").split()]
    want = (a + b if op1 == "+" else a - b)
    want = want + c if op2 == "+" else want - c
    assert p["answer"] == str(want)
    assert p["solution"].endswith(f"<answer>{want}</answer>") and p["solution"].startswith("<think>")
    assert grpo.reward_fn(p["solution"], p["answer"]) == pytest.approx(1.1)


@pytest.mark.parametrize("text, gold, want", [
    ("<think>1+2=3</think><answer>3</answer>", "3", 1.1),          # correct and well formed
    ("<think>1+2=3</think><answer>3</answer><|im_end|>", "3", 1.1),  # a decoded stop token is ignored
    ("<think>1+2=4</think><answer>4</answer>", "3", 0.1),          # wrong, but the format is right
    ("<think>x</think> <answer> 1,200 </answer>\n", "1200", 1.1),   # commas and whitespace
    ("<answer>7</answer>", "7", 1.0),                               # right answer, no think block
    ("<think>a</think><answer>5</answer> and more", "5", 1.0),      # trailing junk costs the format
    ("<think>a</think><answer>1</answer><answer>2</answer>", "2", 1.0),  # the last answer counts
    ("<think>a</think><answer>12.50</answer>", "12.5", 1.1),        # exact decimal comparison
    ("<think>a</think><answer>abc</answer>", "3", 0.0),             # no number: not even format
    ("<think>unfinished <answer>3", "3", 0.0),                      # truncated
    ("", "3", 0.0),
    (None, "3", 0.0),
    ("<think></think><answer>-538</answer>", "-538", 1.1),          # negative numbers
    ("<think></think><answer>538</answer>", "-538", 0.1),
])
def test_reward(text, gold, want):
    assert grpo.reward_fn(text, gold) == pytest.approx(want)


def test_splits_exclude_eval_and_are_pure_functions_of_seed_and_step():
    pool = {p["question"] for p in grpo.arithmetic_problems(grpo.EVAL_POOL, grpo.EVAL_SEED)}
    exclude = frozenset(list(pool)[:50])
    b1 = grpo.train_batch(None, 5, 16, seed=1, exclude=exclude)
    assert b1 == grpo.train_batch(None, 5, 16, seed=1, exclude=exclude)  # same (seed, step) -> same problems
    assert b1 != grpo.train_batch(None, 6, 16, seed=1, exclude=exclude)
    assert not {p["question"] for p in b1} & exclude
    # a forced collision: with an exclusion set holding the stream's first problems they are skipped
    import random
    first = grpo.make_problem(random.Random(1 * 1_000_003 + 0))["question"]
    assert first not in {p["question"] for p in grpo.train_batch(None, 0, 4, seed=1, exclude=frozenset([first]))}
    # the eval set is a prefix of the held-out stream, so --eval-size 200 is part of --eval-size 500
    assert grpo.arithmetic_problems(20, grpo.EVAL_SEED) == grpo.arithmetic_problems(50, grpo.EVAL_SEED)[:20]
    # training skips the whole held-out pool, not just the part that is evaluated
    train, held, skipped = grpo.make_splits(parse("--eval-size", "300"))
    assert train is None and len(held) == 300 and skipped == pool

# -----------------------------------------------------------------------------
# Data


def write_jsonl(path, rows):
    path.write_text("".join(r if isinstance(r, str) else json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_gsm8k_loader(tmp_path, capsys):
    path = write_jsonl(tmp_path / "train.jsonl", [
        {"question": "Tom has 3 apples and buys 4. How many?", "answer": "3+4=7\n#### 7"},
        "this is not json\n",
        {"question": "Big", "answer": "lots of work #### 1,200"},
        {"question": "no gold", "answer": "forgot the marker"},
        "\n",
        {"question": "Neg", "answer": "#### -3.5"},
        {"answer": "#### 1"},
    ])
    rows = grpo.load_jsonl(path)
    assert rows == [{"question": "Tom has 3 apples and buys 4. How many?", "answer": "7"},
                    {"question": "Big", "answer": "1200"}, {"question": "Neg", "answer": "-3.5"}]
    out = capsys.readouterr().out
    assert "skipped 3 malformed line(s) (first at line 2)" in out
    assert grpo.reward_fn("<think>..</think><answer>1,200</answer>", rows[1]["answer"]) == pytest.approx(1.1)

    with pytest.raises(FileNotFoundError, match="not found"):
        grpo.load_jsonl(str(tmp_path / "missing.jsonl"))
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(ValueError, match="no usable problems"):
        grpo.load_jsonl(str(tmp_path / "empty.jsonl"))


def test_jsonl_splits_hold_out_eval(tmp_path):
    rows = [{"question": f"q{i}", "answer": f"#### {i}"} for i in range(20)]
    args = grpo.build_parser().parse_args(["--data", write_jsonl(tmp_path / "d.jsonl", rows), "--eval-size", "5"])
    train, held, exclude = grpo.make_splits(args)
    assert len(held) == 5 and len(train) == 15 and exclude == frozenset()  # a file's split is disjoint already
    assert not {p["question"] for p in held} & {p["question"] for p in train}
    # every training problem is visited once per epoch, in a seeded order
    seen = [p["question"] for s in range(5) for p in grpo.train_batch(train, s, 3, seed=0)]
    assert sorted(seen) == sorted(p["question"] for p in train)

# -----------------------------------------------------------------------------
# Advantages and loss


def test_group_advantages_by_hand():
    r = torch.tensor([1.0, 0.0, 0.0, 0.0, 0.1, 0.1, 0.1, 0.1])  # two groups of G = 4
    std = math.sqrt((0.75 ** 2 + 3 * 0.25 ** 2) / 3)  # unbiased std of [1, 0, 0, 0]
    want = torch.tensor([0.75, -0.25, -0.25, -0.25]) / (std + 1e-4)
    adv = grpo.group_advantages(r, 4)
    torch.testing.assert_close(adv[:4], want)
    torch.testing.assert_close(adv[4:], torch.zeros(4))  # equal rewards: no signal
    plain = grpo.group_advantages(r, 4, scale_std=False)  # Dr. GRPO: r - mean only
    torch.testing.assert_close(plain[:4], torch.tensor([0.75, -0.25, -0.25, -0.25]))


def test_loss_aggregations_by_hand():
    v = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])  # (N=2, T=3)
    m = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    assert grpo.aggregate(v, m, "token-mean").item() == pytest.approx((1 + 2 + 3 + 4) / 4)
    assert grpo.aggregate(v, m, "seq-mean-token-mean").item() == pytest.approx((2.0 + 4.0) / 2)
    assert grpo.aggregate(v, m, "seq-mean-token-sum-norm", max_new_tokens=5).item() == pytest.approx(10 / (2 * 5))
    # an all-masked row does not count as a sequence in seq-mean-token-mean
    m0 = torch.tensor([[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]])
    assert grpo.aggregate(v, m0, "seq-mean-token-mean").item() == pytest.approx(2.0)
    with pytest.raises(ValueError, match="unknown loss aggregation"):
        grpo.aggregate(v, m, "bogus")


def test_grpo_loss_on_policy_equals_minus_advantage():
    # ratio = 1 everywhere: loss = -mean(A) over tokens, gradient wrt logp = -A / n_tokens
    logp = torch.tensor([[-1.0, -2.0], [-0.5, -0.1]], requires_grad=True)
    adv = torch.tensor([2.0, -1.0])
    m = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    loss, st = grpo.grpo_loss(logp, logp.detach(), adv, m)
    assert loss.item() == pytest.approx(-(2 + 2 - 1) / 3)
    loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[-2 / 3, -2 / 3], [1 / 3, 0.0]]))
    assert st["clip"] == 0.0


def test_clipping_acts_only_where_it_should():
    # four tokens, one sequence each: ratios 1.5 (A>0: clipped high), 1.5 (A<0: NOT clipped),
    # 0.5 (A<0: clipped low), 0.5 (A>0: NOT clipped -- the min keeps the unclipped, smaller term)
    old = torch.zeros(4, 1)
    logp = torch.log(torch.tensor([[1.5], [1.5], [0.5], [0.5]])).requires_grad_(True)
    adv = torch.tensor([1.0, -1.0, -1.0, 1.0])
    m = torch.ones(4, 1)
    loss, st = grpo.grpo_loss(logp, old, adv, m, eps_low=0.2, eps_high=0.28)
    # per token surrogate: min(r A, clip(r) A) = 1.28, -1.5, -0.8, 0.5
    assert loss.item() == pytest.approx(-(1.28 - 1.5 - 0.8 + 0.5) / 4)
    loss.backward()
    g = logp.grad.view(-1)  # d(-r A / 4)/d logp = -r A / 4 where unclipped, 0 where clipped
    torch.testing.assert_close(g, torch.tensor([0.0, 1.5 / 4, 0.0, -0.5 / 4]))
    assert st["clip"] == pytest.approx(0.5)


def test_kl_and_entropy_terms():
    logp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    ref = torch.tensor([[-1.5, -1.0]])
    ent = torch.tensor([[0.3, 0.7]], requires_grad=True)
    m = torch.ones(1, 2)
    adv = torch.zeros(1)
    d = ref - logp.detach()
    k3 = (torch.exp(d) - d - 1).mean().item()
    loss, st = grpo.grpo_loss(logp, logp.detach(), adv, m, ref_logp=ref, beta=0.1, entropy=ent, entropy_coef=0.01)
    assert st["kl"] == pytest.approx(k3)
    assert loss.item() == pytest.approx(0.1 * k3 - 0.01 * 0.5, abs=1e-6)

# -----------------------------------------------------------------------------
# Evaluation counts (generate replaced by a scripted fake)


def test_evaluate_counts(monkeypatch):
    problems = [{"question": "1+1+1=?", "answer": "3"}, {"question": "2+2+2=?", "answer": "6"},
                {"question": "5-1-1=?", "answer": "3"}]

    class Tok:
        eos_token_ids = [0]
        pad_token_id = 0

        def encode(self, text):
            return [1, 2, 3]

    def fake_generate(model, prompts, num_samples=1, temperature=1.0, **kw):
        # greedy: right, wrong, right; sampled (k=4): problem 0 all right, 1 none, 2 one of four
        if temperature == 0:
            texts = ["<answer>3</answer>", "<answer>5</answer>", "<answer>3</answer>"]
        else:
            texts = ["<answer>3</answer>"] * 4 + ["<answer>0</answer>"] * 4 + \
                    ["<answer>1</answer>"] * 3 + ["<answer>3</answer>"]
        n = len(prompts) * num_samples
        return rollout.Rollout([[1]] * n, torch.zeros(n, 1, dtype=torch.long), torch.ones(n, 1),
                               torch.zeros(n, 1), torch.zeros(n, 1), texts)

    monkeypatch.setattr(grpo.rollout, "generate", fake_generate)
    res = grpo.evaluate(torch.nn.Linear(1, 1), Tok(), problems, False, 8, k=4)
    assert res["n"] == 3 and res["greedy_correct"] == 2 and res["greedy"] == pytest.approx(2 / 3)
    assert res["sample_correct"] == 5 and res["pass@1"] == pytest.approx(5 / 12)
    assert res["pass_k_correct"] == 2 and res["pass@4"] == pytest.approx(2 / 3)

# -----------------------------------------------------------------------------
# Short runs on the bundled tiny model


def test_merged_sampling_weights_compute_the_same_function():
    model, tok = rollout.load_model(grpo.TINY_MODEL, quant="nvfp4", device="cpu")
    grpo.lora.add_lora(model, r=4, alpha=8, generator=torch.Generator().manual_seed(0))
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in grpo.lora.lora_parameters(model):  # a trained-looking adapter: B != 0
            p.add_(torch.randn(p.shape, generator=gen) * 0.05)
    ids = torch.tensor([tok.encode(grpo.prompt_text("12+3-4=?", False))])  # (1, T)
    want = model(ids)  # (1, T, V)
    with grpo.merged_sampling_weights(model):
        got = model(ids)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert not any("forward" in vars(m) for m in model.modules())  # the modules are restored
    torch.testing.assert_close(model(ids), want, rtol=0, atol=0)


def test_lora_sampler_merged_unmerged_and_compiled_draw_the_same_samples():
    """LoRA in the sampler: the merged shortcut (CPU) and the compiled decode step with unmerged adapters
    (GPU) sample what the plain unmerged modules sample, from the same seed, up to float rounding. (An fp32
    base keeps the compile short; test_merged_sampling_weights_compute_the_same_function covers NVFP4.)"""
    model, tok = rollout.load_model(grpo.TINY_MODEL, quant="none", device="cpu")
    grpo.lora.add_lora(model, r=4, alpha=8, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        for p in grpo.lora.lora_parameters(model):  # a trained-looking adapter: B != 0
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(2)) * 0.05)
    prompts = [tok.encode(grpo.prompt_text(q, False)) for q in ("12+3-4=?", "7*8=?")]
    kw = dict(num_samples=2, max_new_tokens=12, temperature=1.0, eos_token_ids=tok.eos_token_ids)
    with torch.inference_mode():
        plain = rollout.generate(model, prompts, generator=torch.Generator().manual_seed(3), **kw)
        with grpo.merged_sampling_weights(model):
            merged = rollout.generate(model, prompts, generator=torch.Generator().manual_seed(3), **kw)
        # the adapters unmerged inside the compiled step: what a GPU runs
        compiled = rollout.generate(model, prompts, generator=torch.Generator().manual_seed(3), compile=True, **kw)
    assert len({tuple(r) for r in plain.completion_ids.tolist()}) > 1  # real samples, not one repeated row
    for r in (merged, compiled):
        assert torch.equal(r.completion_ids, plain.completion_ids)
        torch.testing.assert_close(r.logprobs, plain.logprobs, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(r.entropy, plain.entropy, rtol=1e-4, atol=1e-4)


def parse(*argv):
    return grpo.build_parser().parse_args([str(a) for a in argv])


def tiny_args(out, *extra):
    return grpo.build_parser().parse_args([
        "--out", str(out), "--steps", "4", "--batch", "3", "--group", "4", "--max-new-tokens", "40",
        "--eval-size", "6", "--eval-k", "2", "--eval-every", "2", "--save-every", "2", "--time-budget", "0",
        "--device", "cpu", "--quiet", "--warmup", "1", "--lr", "5e-3", *extra])


def step_rows(out):
    rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    timing = ("s/step", "tok/s", "t_sample", "time", "seconds")
    strip = lambda d: {k: v for k, v in d.items() if k not in timing}  # noqa: E731
    return [strip(r) for r in rows if "eval" not in r], [strip(r["eval"]) for r in rows if "eval" in r]


def test_smoke_run_writes_metrics_checkpoints_and_summary(tmp_path):
    out = tmp_path / "run"
    summary = grpo.train(tiny_args(out))
    steps, evals = step_rows(out)
    assert [r["step"] for r in steps] == [1, 2, 3, 4]
    for r in steps:
        assert 0.0 <= r["reward"] <= 1.1 and 0.0 <= r["acc"] <= 1.0 and math.isfinite(r["loss"])
        assert r["len"] > 0 and r["entropy"] >= 0
    # AQN schedule of a 4-step run with 10 stages: stage 0 has no noise, later stages do
    assert steps[0]["sigma"] == 0.0 and steps[-1]["sigma"] > 0
    assert [e["step"] for e in evals] == [0, 2, 4] and evals[0]["n"] == 6 and "pass@2" in evals[-1]
    for ck in ("checkpoint-000002", "checkpoint-000004"):
        files = set(os.listdir(out / ck))
        assert {"adapter_config.json", "adapter_model.safetensors", "trainer_state.pt"} <= files
    adapter = load_file(str(out / "checkpoint-000004" / "adapter_model.safetensors"))
    assert any(k.endswith("lora_B.weight") and v.abs().sum() > 0 for k, v in adapter.items())  # it learned
    s = json.load(open(out / "summary.json"))
    assert s["steps_done"] == 4 and s["final_eval"]["step"] == 4 and "greedy_gain" in s
    assert summary["steps_done"] == 4
    assert not [d for d in os.listdir(out) if d.startswith(".tmp")]  # no half-written checkpoints


def test_resume_is_exact(tmp_path):
    extra = ["--loss-agg", "seq-mean-token-mean"]
    grpo.train(tiny_args(tmp_path / "straight", *extra))
    grpo.train(tiny_args(tmp_path / "split", "--stop-at", "2", *extra))
    assert json.load(open(tmp_path / "split" / "summary.json"))["steps_done"] == 2
    args = grpo.build_parser().parse_args(["--resume", str(tmp_path / "split"), "--quiet"])
    grpo.train(args)
    a_steps, a_evals = step_rows(tmp_path / "straight")
    b_steps, b_evals = step_rows(tmp_path / "split")
    assert a_steps == b_steps  # every logged number of all 4 steps, bit for bit
    assert a_evals[-1] == b_evals[-1]
    a = load_file(str(tmp_path / "straight" / "checkpoint-000004" / "adapter_model.safetensors"))
    b = load_file(str(tmp_path / "split" / "checkpoint-000004" / "adapter_model.safetensors"))
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=0)


def test_nan_loss_skips_the_step_and_saves_nothing_broken(tmp_path, monkeypatch, capsys):
    real = grpo.rollout.sequence_logprobs

    def poisoned(*a, **kw):
        lp, ent = real(*a, **kw)
        return lp * float("nan"), ent

    monkeypatch.setattr(grpo.rollout, "sequence_logprobs", poisoned)
    out = tmp_path / "nan"
    args = tiny_args(out, "--steps", "2", "--eval-size", "0")
    summary = grpo.train(args)
    assert "skipping this update" in capsys.readouterr().out
    assert summary["skipped_updates"] >= 1
    adapter = load_file(str(out / "checkpoint-000002" / "adapter_model.safetensors"))
    for k, v in adapter.items():
        assert torch.isfinite(v).all()
        if k.endswith("lora_B.weight"):
            assert v.abs().sum() == 0  # no update was applied


def test_bad_model_folder_is_one_clear_line(tmp_path):
    (tmp_path / "notamodel").mkdir()
    with pytest.raises(FileNotFoundError, match="not a model folder"):
        grpo.train(parse("--model", tmp_path / "notamodel", "--out", tmp_path / "o"))
    r = subprocess.run([sys.executable, os.path.join(ROOT, "05_grpo.py"), "--model", str(tmp_path / "nope"),
                        "--out", str(tmp_path / "o2")], capture_output=True, text=True, timeout=120)
    assert r.returncode != 0
    lines = [line for line in r.stderr.strip().splitlines() if line]
    assert len(lines) == 1 and lines[0].startswith("error:") and "not a model folder" in lines[0]
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="config.json is not valid JSON"):
        grpo.train(parse("--model", tmp_path / "broken", "--out", tmp_path / "o4"))
    with pytest.raises(FileNotFoundError, match="data file"):
        grpo.train(parse("--data", tmp_path / "none.jsonl", "--out", tmp_path / "o3"))
