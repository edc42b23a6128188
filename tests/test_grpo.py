"""Stage 05: the task, its registry and the reward, advantages, loss aggregations, clipping and LossOptions,
evaluation counts, data loading, and short GRPO runs on the bundled tiny model (smoke, exact resume, bad input)."""
import functools
import importlib
import json
import math
import os
import re
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from qerl import checkpoints  # the engine modules beneath 05 (conftest puts the repository on sys.path)
from qerl import engine
from qerl import grpo_variants
from qerl import hf_files
from qerl import memory
from qerl import runs
from qerl import tasks

grpo = importlib.import_module("qerl.train")
rollout = importlib.import_module("qerl.rollout")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# -----------------------------------------------------------------------------
# The task flags (the tasks themselves: tests/test_tasks.py)


def write_jsonl(path, rows):
    path.write_text("".join(r if isinstance(r, str) else json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_task_registry_and_its_flags(tmp_path, monkeypatch, capsys):
    data = write_jsonl(tmp_path / "d.jsonl", [{"question": f"q{i}", "answer": f"#### {i}"} for i in range(8)])
    assert {"arithmetic", "gsm8k", "chat-arithmetic"} <= set(tasks.TASKS) and parse().task == "arithmetic"  # the default
    arith = tasks.make_task(parse("--digits", "2", "--nops", "1", "--eval-size", "7"), grpo.parser_defaults())
    assert type(arith) is tasks.ArithmeticTask and (arith.digits, arith.nops, len(arith.held)) == (2, 1, 7)
    assert type(tasks.make_task(parse("--task", "gsm8k", "--data", data), grpo.parser_defaults())) is tasks.JsonlTask
    # --task's choices are the registry: an unknown name is argparse's error, and make_task's without the parser
    with pytest.raises(SystemExit):
        parse("--task", "no-such-task")
    assert "invalid choice: 'no-such-task'" in capsys.readouterr().err
    args = parse()
    args.task = "no-such-task"
    with pytest.raises(ValueError, match=r"unknown task 'no-such-task': choose one of arithmetic, gsm8k"):
        tasks.make_task(args, grpo.parser_defaults())
    # --data belongs to gsm8k, and gsm8k needs it: each a one-line error from train, before the model loads
    with pytest.raises(ValueError, match=r"^--data is the file of --task gsm8k, but the task is arithmetic: add "
                                         r"--task gsm8k to train on '\S+d.jsonl', or drop --data$"):
        grpo.train(parse("--data", data, "--out", tmp_path / "o1"))
    with pytest.raises(ValueError, match=r"^--task gsm8k needs --data FILE \(JSONL lines"):
        grpo.train(parse("--task", "gsm8k", "--out", tmp_path / "o2"))
    assert not (tmp_path / "o1").exists() and not (tmp_path / "o2").exists()
    r = subprocess.run([sys.executable, os.path.join(ROOT, "qerl/train.py"), "--data", data, "--out", str(tmp_path / "o3")],
                       capture_output=True, text=True, timeout=120)
    lines = [line for line in r.stderr.splitlines() if line]
    assert r.returncode == 1 and len(lines) == 1 and lines[0].startswith("error: --data is the file of --task gsm8k")
    # a forker's task: one registry entry, and --task offers it (its flags read in from_args)
    class Sum(tasks.ArithmeticTask):
        @classmethod
        def from_args(cls, args, system):
            return cls(digits=2, nops=1, eval_size=args.eval_size, system=system)
    monkeypatch.setitem(tasks.TASKS, "sum", Sum)
    task = tasks.make_task(parse("--task", "sum", "--eval-size", "3"), grpo.parser_defaults())
    assert type(task) is Sum and len(task.held) == 3 and (task.digits, task.nops) == (2, 1)

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
    loss, st = grpo.grpo_loss(logp, old, adv, m, grpo.LossOptions(eps_low=0.2, eps_high=0.28))
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
    loss, st = grpo.grpo_loss(logp, logp.detach(), adv, m, grpo.LossOptions(beta=0.1, entropy_coef=0.01), ref_logp=ref,
                              entropy=ent)
    assert st["kl"] == pytest.approx(k3)
    assert loss.item() == pytest.approx(0.1 * k3 - 0.01 * 0.5, abs=1e-6)

def test_loss_options_come_from_the_flags_and_reach_grpo_loss(lora_policy, monkeypatch):
    # the flags' defaults are the dataclass's, and from_args carries every field
    assert grpo.LossOptions.from_args(parse()) == grpo.LossOptions()
    flags = ("--eps-low", "0.1", "--eps-high", "0.5", "--loss-agg", "seq-mean-token-mean", "--beta", "0.05",
             "--entropy-coef", "0.01")
    want = grpo.LossOptions(eps_low=0.1, eps_high=0.5, loss_agg="seq-mean-token-mean", beta=0.05, entropy_coef=0.01)
    assert grpo.update_options(parse(*flags))["loss_options"] == want
    # a changed eps changes the loss: ratio 1.5 with A > 0 is clipped at 1 + eps_high
    logp, old, adv, m = torch.log(torch.tensor([[1.5]])), torch.zeros(1, 1), torch.ones(1), torch.ones(1, 1)
    assert grpo.grpo_loss(logp, old, adv, m)[0].item() == pytest.approx(-1.28)
    assert grpo.grpo_loss(logp, old, adv, m, grpo.LossOptions(eps_high=0.4))[0].item() == pytest.approx(-1.4)
    # through policy_update: what grpo_loss receives is the LossOptions built from the flags, and a
    # narrower clip range clips more tokens and moves the adapter differently
    model, params, start = lora_policy
    seen, real = [], grpo.grpo_loss
    monkeypatch.setattr(grpo, "grpo_loss", lambda *a, **kw: seen.append(a[4]) or real(*a, **kw))
    moved, clip = {}, {}
    for eps in ("0.2", "0.01"):
        with torch.no_grad():
            for p, p0 in zip(params, start):
                p.copy_(p0)
        args = parse("--group", 4, "--max-new-tokens", 9, "--grad-clip", 1e9, "--eps-low", eps, "--eps-high", eps,
                     "--pi-old", "sampler")  # the batch's own old_logp: ratios away from 1
        out = grpo.policy_update(model, torch.optim.SGD(params, lr=0.2), params, *update_batch(model.config.vocab_size),
                                 **grpo.update_options(args))
        assert seen[-1] == grpo.LossOptions(eps_low=float(eps), eps_high=float(eps))
        moved[eps], clip[eps] = torch.cat([(p.detach() - p0).reshape(-1) for p, p0 in zip(params, start)]), out["clip"]
    assert clip["0.01"] > clip["0.2"] and not torch.allclose(moved["0.01"], moved["0.2"])
    with torch.no_grad():
        for p, p0 in zip(params, start):
            p.copy_(p0)

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
    res = grpo.evaluate_pass_k(torch.nn.Linear(1, 1), Tok(), tasks.ArithmeticTask(eval_size=0), problems, 8, k=4)
    assert res["n"] == 3 and res["greedy_correct"] == 2 and res["greedy"] == pytest.approx(2 / 3)
    assert res["greedy_reward"] == pytest.approx(2 / 3)  # AnswerTask's: 1 if right; no <think>, no format bonus
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
    ids = torch.tensor([tok.encode(tasks.ArithmeticTask(eval_size=0).prompt({"question": "12+3-4=?"}))])  # (1, T)
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
    prompts = [tok.encode(tasks.ArithmeticTask(eval_size=0).prompt({"question": q})) for q in ("12+3-4=?", "7*8=?")]
    kw = dict(num_samples=2, max_new_tokens=12, temperature=1.0, eos_token_ids=tok.eos_token_ids)
    with torch.inference_mode():
        plain = rollout.generate(model, prompts, generator=torch.Generator().manual_seed(3), **kw)
        with grpo.merged_sampling_weights(model):
            merged = rollout.generate(model, prompts, generator=torch.Generator().manual_seed(3), **kw)
        # the adapters unmerged inside the compiled step: what a GPU runs
        compiled = rollout.generate(model, prompts, generator=torch.Generator().manual_seed(3), compiled=True, **kw)
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
    timing = ("s/step", "tok/s", "t_sample", "t_score", "cpu_s", "cpu_sample", "peak_rss_mb", "time", "seconds")
    strip = lambda d: {k: v for k, v in d.items() if k not in timing}  # noqa: E731
    return [strip(r) for r in rows if "eval" not in r], [strip(r["eval"]) for r in rows if "eval" in r]


def test_smoke_run_writes_metrics_checkpoints_and_summary(tmp_path, capsys):
    out = tmp_path / "run"
    summary = grpo.train(tiny_args(out))
    assert "summary | steps 4 | stopped by --steps 4 | greedy" in capsys.readouterr().out  # why it stopped
    steps, evals = step_rows(out)
    assert [r["step"] for r in steps] == [1, 2, 3, 4]
    for r in steps:
        assert 0.0 <= r["reward"] <= 1.1 and 0.0 <= r["acc"] <= 1.0 and math.isfinite(r["loss"])
        assert r["len"] > 0 and r["entropy"] >= 0
    # AQN schedule of a 4-step run with 10 stages: stage 0 has no noise, later stages do; the noise
    # really applied is logged next to the sigma asked for (the draw's RMS over 4 x 128 gains)
    assert steps[0]["sigma"] == 0.0 and steps[-1]["sigma"] > 0
    assert steps[0]["sigma_applied"] == 0.0
    assert all(r["sigma_applied"] == pytest.approx(r["sigma"], rel=0.15) for r in steps[1:])
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


def test_resume_is_exact_with_train_norms_and_mask_truncated(tmp_path):
    extra = ["--train-norms", "--mask-truncated", "--max-new-tokens", "30", "--steps", "3", "--eval-size", "0",
             "--batch", "4"]
    grpo.train(tiny_args(tmp_path / "straight", *extra))
    grpo.train(tiny_args(tmp_path / "split", "--stop-at", "1", *extra))
    grpo.train(grpo.build_parser().parse_args(["--resume", str(tmp_path / "split"), "--quiet"]))
    a_steps, _ = step_rows(tmp_path / "straight")
    assert a_steps == step_rows(tmp_path / "split")[0]  # every logged number, bit for bit
    assert any(0 < r["truncated"] < 1 and r["loss"] != 0 for r in a_steps)  # the flag had rows to act on
    a = load_file(str(tmp_path / "straight" / "checkpoint-000003" / "adapter_model.safetensors"))
    b = load_file(str(tmp_path / "split" / "checkpoint-000003" / "adapter_model.safetensors"))
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=0)
    # the gains are saved as PEFT's modules_to_save (fp32), every pre-norm and not model.norm, and trained
    cfg = json.load(open(tmp_path / "straight" / "checkpoint-000003" / "adapter_config.json"))
    assert cfg["modules_to_save"] == ["input_layernorm", "post_attention_layernorm"]
    norms = {k for k in a if "layernorm" in k or k.endswith("model.norm.weight")}
    assert norms == {f"base_model.model.model.layers.{i}.{n}.weight" for i in range(4)
                     for n in ("input_layernorm", "post_attention_layernorm")}
    base, _ = rollout.load_model(grpo.TINY_MODEL, quant="none", device="cpu")
    moved = [float((a[n] - base.get_parameter(n[len("base_model.model."):]).detach()).abs().max()) for n in norms]
    assert all(a[n].dtype == torch.float32 for n in norms) and max(moved) > 0


def test_train_norms_first_adam_step_by_hand():
    # One step with --train-norms: the pre-norm gains are fp32 parameters of the optimizer, and AdamW's
    # first step (no weight decay) moves each by exactly lr in the direction against its gradient;
    # model.norm stays; without the flag the gains do not move at all.
    moves = {}
    for flag in ([], ["--train-norms"]):
        args = parse("--steps", "5", "--batch", "4", "--group", "4", "--max-new-tokens", "40", "--warmup", "1",
                     "--lr", "1e-3", "--no-aqn", "--device", "cpu", "--seed", "1", *flag)
        model, tok, params, opt = grpo.build_policy(args, "cpu")
        pre = [n for _, n in grpo.aqn.aqn_norms(model)]
        before = [n.weight.detach().clone() for n in pre]
        final = model.model.norm.weight.detach().clone()
        task = tasks.ArithmeticTask(eval_size=0)
        problems = task.problems(args.seed, 0, args.batch)
        samples, _ = grpo.sample_groups(model, tok, [tok.encode(task.prompt(p)) for p in problems], 0, 0.0,
                                        group=args.group, max_new_tokens=args.max_new_tokens, seed=args.seed)
        rewards, _ = grpo.score(task, problems, samples.texts, args.group)
        report = grpo.policy_update(model, opt, params, samples.prompt_ids, samples.completion_ids.clone(),
                                    samples.completion_mask.float().clone(), samples.logprobs.float().clone(),
                                    rewards, **grpo.update_options(args))
        assert report["kept_rows"] > 0 and not report["skipped"]  # some group had signal: an update was taken
        moves[bool(flag)] = torch.cat([n.weight.detach().float() - b.float() for n, b in zip(pre, before)])
        assert torch.equal(model.model.norm.weight.detach(), final)
        if flag:
            assert all(n.weight.dtype == torch.float32 and n.weight.requires_grad for n in pre)
            assert sum(p.numel() for p in params) == sum(p.numel() for p in grpo.lora.lora_parameters(model)) + 8 * 128
            # the gradient, read back from AdamW's first moment (exp_avg = (1 - beta1) g after one step)
            grad = torch.cat([opt.state[n.weight]["exp_avg"] / 0.1 for n in pre])
    assert moves[False].abs().max() == 0
    # Adam's first step, bias-corrected: -lr * g / (|g| + eps), i.e. lr against the gradient's sign
    torch.testing.assert_close(moves[True], -1e-3 * grad / (grad.abs() + 1e-8), rtol=0, atol=3e-7)
    assert float((moves[True].abs() > 0.9e-3).float().mean()) > 0.95  # nearly every gain moved by lr


def test_mask_truncated_update_by_hand(monkeypatch):
    # A stand-in policy with one parameter per token id: logp(row, t) = theta[id]. Two groups of G = 2,
    # rewards [1, 0] each, so A = +-0.5 / (std + 1e-4) with std = 1/sqrt(2). Row 1 hits max_new_tokens
    # without EOS (9); row 3 ends with EOS in its last slot and is not truncated. With ratio 1 and
    # token-mean, SGD(lr 1) moves theta[v] by sum_i A_i * count_i(v) / (number of loss tokens).
    ids = torch.tensor([[1, 9, 0], [2, 2, 2], [3, 9, 0], [4, 4, 9]])
    mask = torch.tensor([[1., 1, 0], [1, 1, 1], [1, 1, 0], [1, 1, 1]])
    trunc = grpo.truncated_rows(ids, mask, [9])
    assert trunc.tolist() == [False, True, False, False]
    A = 0.5 / (2 ** -0.5 + 1e-4)
    policy = torch.nn.Module()
    policy.theta = torch.nn.Parameter(torch.zeros(10))
    monkeypatch.setattr(grpo.rollout, "sequence_logprobs",
                        lambda model, prompts, ids, mask, temperature=1.0, entropy=True:
                        (policy.theta[ids], torch.zeros(ids.shape) if entropy else None))
    got = {}
    for masked in (False, True):
        with torch.no_grad():
            policy.theta.zero_()
        opt = torch.optim.SGD([policy.theta], lr=1.0)
        args = parse("--group", "2", "--max-new-tokens", "3", "--grad-clip", "1e9", *(["--mask-truncated"] * masked))
        loss_mask = mask * (~trunc).float()[:, None] if args.mask_truncated else mask  # as train's loop does
        grpo.policy_update(policy, opt, [policy.theta], [[5]] * 4, ids, loss_mask, torch.zeros(4, 3),
                           torch.tensor([1.0, 0.0, 1.0, 0.0]), **grpo.update_options(args))
        got[masked] = policy.theta.detach().clone()
    want = {False: torch.tensor([0, 1, -3, 1, -2, 0, 0, 0, 0, 1]) * A / 10,  # 10 tokens in the loss
            True: torch.tensor([0, 1, 0, 1, -2, 0, 0, 0, 0, 1]) * A / 7}  # row 1's 3 tokens left out
    for masked in (False, True):
        torch.testing.assert_close(got[masked], want[masked].float(), rtol=1e-6, atol=1e-7)


def test_a_nan_loss_stops_the_run_and_keeps_the_last_good_checkpoint(tmp_path, monkeypatch):
    """From step 2 on the log-probs are NaN: step 2's update is not taken, its record says why, the run stops
    with one line naming the step, and checkpoint-000001 (finite) is the last one."""
    real, calls = grpo.rollout.sequence_logprobs, []

    def poisoned(*a, **kw):
        lp, ent = real(*a, **kw)
        calls.append(torch.is_grad_enabled())
        return (lp * float("nan"), ent) if sum(calls) > 1 else (lp, ent)  # the second update's forward on

    monkeypatch.setattr(grpo.rollout, "sequence_logprobs", poisoned)
    rewards = iter([1.0, 0.0] * 100)  # every group has signal: every step updates, one forward with gradients
    monkeypatch.setattr(tasks.AnswerTask, "reward", lambda self, problem, text: next(rewards))
    out = tmp_path / "nan"
    with pytest.raises(ValueError, match=r"^step 2: the loss is nan: the run diverged and stops; its last good "
                                         r"checkpoint, checkpoint-000001, stays; run again with a lower --lr"):
        grpo.train(tiny_args(out, "--steps", "3", "--eval-size", "0", "--save-every", "1"))
    steps, _ = step_rows(out)
    assert [r["step"] for r in steps] == [1, 2] and steps[1]["diverged"] == "the loss is nan"
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-000001"]
    adapter = load_file(str(out / "checkpoint-000001" / "adapter_model.safetensors"))
    assert all(torch.isfinite(v).all() for v in adapter.values())
    assert not (out / "summary.json").exists()  # no summary of success


def test_a_far_update_is_named_a_likely_divergence(tmp_path, capsys):
    """--lr 1e3 wrecks the policy in one update: the step's kl_after is beyond runs.DIVERGED_KL, the log
    names it, and the summary says so instead of a plain success. The default LR stays far below it."""
    out = tmp_path / "far"
    args = tiny_args(out, "--steps", "2", "--eval-size", "0", "--lr", "1e3", "--warmup", "0", "--kl-after-rows", "16")
    args.quiet = False
    summary = grpo.train(args)
    text = capsys.readouterr().out
    assert summary["likely_divergence_steps"] and "likely divergence" in text
    steps, _ = step_rows(out)
    assert max(r["kl_after"] for r in steps) > runs.DIVERGED_KL
    calm = grpo.train(tiny_args(tmp_path / "calm", "--steps", "2", "--eval-size", "0", "--lr", "1e-3",  # the default
                                "--kl-after-rows", "16"))
    assert calm["likely_divergence_steps"] == []
    assert all(r["kl_after"] < 0.1 * runs.DIVERGED_KL for r in step_rows(tmp_path / "calm")[0])


def test_noise_that_overflows_the_sampler_is_one_line(tmp_path):
    """--sigma-start 1e30: the noisy logits are NaN; the sampler returns (no index out of bounds) and the
    run stops at step 1 with one line, exit 1, no traceback."""
    r = subprocess.run([sys.executable, os.path.join(ROOT, "qerl/train.py"), "--steps", "4", "--batch", "2", "--group",
                        "2", "--max-new-tokens", "8", "--eval-size", "0", "--warmup", "0", "--num-stages", "2",
                        "--sigma-start", "1e30", "--sigma-end", "1e29", "--out", str(tmp_path / "o"), "--quiet"],
                       capture_output=True, text=True, timeout=180)
    lines = [line for line in r.stderr.splitlines() if line]
    assert r.returncode == 1 and len(lines) == 1, r.stderr
    assert lines[0].startswith("error: step 3: the sampler's log-probs are not finite"), lines[0]


def test_unknown_quant_name_is_an_error_in_every_stage(capsys):
    quantize = importlib.import_module("qerl.quantize")
    for parser in (grpo.build_parser(), rollout.build_parser()):  # --quant's choices are 01's registry
        with pytest.raises(SystemExit):
            parser.parse_args(["--quant", "no-such-format"])
        assert "invalid choice: 'no-such-format'" in capsys.readouterr().err
        assert parser.parse_args(["--quant", "nf4"]).quant == "nf4"
    with pytest.raises(ValueError, match="quant must be one of none, nvfp4, nf4.*, got 'no-such-format'"):
        rollout.load_model(grpo.TINY_MODEL, quant="no-such-format")
    with pytest.raises(ValueError, match="unknown weight format 'no-such-format'"):
        quantize.quantize_model(rollout.load_model(grpo.TINY_MODEL)[0], fmt="no-such-format")


def test_quant_method_reaches_the_loaded_weights(tmp_path):
    quantize = importlib.import_module("qerl.quantize")
    four = rollout.load_model(grpo.TINY_MODEL, quant="nvfp4", method="4over6")[0]
    ref = quantize.quantize_model(rollout.load_model(grpo.TINY_MODEL)[0], method="4over6")
    rtn = rollout.load_model(grpo.TINY_MODEL, quant="nvfp4")[0]
    (a, b), c = [m.model.layers[1].mlp.up_proj for m in (four, ref)], rtn.model.layers[1].mlp.up_proj
    assert torch.equal(a.weight_packed, b.weight_packed) and torch.equal(a.weight_scale.view(torch.uint8),
                                                                           b.weight_scale.view(torch.uint8))
    assert not torch.equal(a.weight_scale.view(torch.uint8), c.weight_scale.view(torch.uint8))
    assert grpo.build_parser().parse_args([]).quant_method == "rtn"
    with pytest.raises(ValueError, match="--quant-method 4over6 is a rounding of NVFP4 weights: it needs --quant nvfp4"):
        grpo.train(parse("--quant", "nf4", "--quant-method", "4over6", "--out", tmp_path / "o"))
    assert not (tmp_path / "o").exists()
    with pytest.raises(ValueError, match="method '4over6' is a rounding of NVFP4 weights: it needs quant='nvfp4'"):
        rollout.load_model(grpo.TINY_MODEL, method="4over6")  # quant="none": nothing would be rounded
    for argv in (["--quant-method", "4over6"], ["--system", "Be brief.", "--no-system"]):
        with pytest.raises(SystemExit):  # 03's command line: one argparse line, before any work
            rollout.main(argv)


def test_bad_model_folder_is_one_clear_line(tmp_path):
    (tmp_path / "notamodel").mkdir()
    with pytest.raises(FileNotFoundError, match="not a model folder"):
        grpo.train(parse("--model", tmp_path / "notamodel", "--out", tmp_path / "o"))
    r = subprocess.run([sys.executable, os.path.join(ROOT, "qerl/train.py"), "--model", str(tmp_path / "nope"),
                        "--out", str(tmp_path / "o2")], capture_output=True, text=True, timeout=120)
    assert r.returncode != 0
    lines = [line for line in r.stderr.strip().splitlines() if line]
    assert len(lines) == 1 and lines[0].startswith("error:") and "not a model folder" in lines[0]
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="config.json is not valid JSON"):
        grpo.train(parse("--model", tmp_path / "broken", "--out", tmp_path / "o4"))
    with pytest.raises(FileNotFoundError, match="data file"):
        grpo.train(parse("--task", "gsm8k", "--data", tmp_path / "none.jsonl", "--out", tmp_path / "o3"))

# -----------------------------------------------------------------------------
# The update at real scale: micro-batches, activation checkpointing


def small_lora_policy():
    """A small random fp32 Qwen2 (2 layers, width 32) with a trained-looking adapter (B != 0) -> (model, its
    adapter parameters)."""
    torch.manual_seed(0)
    model = rollout.CausalLM(rollout.ModelConfig(vocab_size=96, hidden_size=32, intermediate_size=64, head_dim=8,
                                                 num_attention_heads=4, num_key_value_heads=2)).eval()
    grpo.lora.add_lora(model, r=4, alpha=8, generator=torch.Generator().manual_seed(0))
    params = grpo.lora.lora_parameters(model)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in params:
            p.add_(torch.randn(p.shape, generator=gen) * 0.1)
    return model, params


@pytest.fixture(scope="module")
def lora_policy():
    """small_lora_policy, and its parameters' starting values."""
    model, params = small_lora_policy()
    return model, params, [p.detach().clone() for p in params]


def update_batch(vocab, group=4, T=9):
    """Three groups of `group` rows (the middle one with equal rewards, so it is left out), prompts of
    different lengths and completions of different lengths."""
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in (4, 7, 2)]
    prompt_ids = [p for p in prompts for _ in range(group)]
    N = len(prompt_ids)
    ids = torch.randint(0, vocab, (N, T), generator=g)  # (N, T)
    lengths = torch.randint(1, T + 1, (N,), generator=g)
    lengths[0] = T
    mask = (torch.arange(T)[None] < lengths[:, None]).float()  # (N, T)
    old_logp = -(torch.rand(N, T, generator=g) * 4 + 1) * mask  # (N, T)
    rewards = torch.tensor([1.1, 0.0, 0.1, 1.0, 1.0, 1.0, 1.0, 1.0, 0.0, 1.1, 0.0, 0.0])
    return prompt_ids, ids, mask, old_logp, rewards


@pytest.mark.parametrize("agg", grpo.LOSS_AGGS)
@pytest.mark.parametrize("beta", [0.0, 0.05])
def test_micro_batches_give_the_same_update(lora_policy, agg, beta, monkeypatch):
    model, params, start = lora_policy
    monkeypatch.setattr(engine, "LOGITS_CHUNK_BYTES", 4 * model.config.vocab_size * 6)  # 6 tokens per chunk
    batch = update_batch(model.config.vocab_size)
    results = []
    monkeypatch.setattr(memory, "UPDATE_MEMORY_CPU", 1)  # --micro-batch auto with no room: one row at a time
    for mb, ckpt in ((0, False), (1, False), (3, False), (3, True), ("auto", False)):
        with torch.no_grad():
            for p, p0 in zip(params, start):
                p.copy_(p0)
        args = parse("--group", 4, "--loss-agg", agg, "--beta", beta, "--entropy-coef", 0.01, "--max-new-tokens", 9,
                     "--grad-clip", 1e9, "--micro-batch", mb, *(["--grad-checkpoint"] if ckpt else []))
        opt = torch.optim.SGD(params, lr=0.2)
        model.grad_checkpoint = ckpt
        out = grpo.policy_update(model, opt, params, *batch, **grpo.update_options(args))
        assert out["kept_rows"] == 8 and not out["skipped"] and math.isfinite(out["loss"])
        results.append(([(p.detach() - p0) for p, p0 in zip(params, start)], out))
    (want, ref), *others = results
    assert max(float(d.abs().max()) for d in want) > 5e-4  # the adapter moved, by far more than the tolerance
    for got, out in others:
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
        for key in ("loss", "grad_norm", "clip", "kl", "kl_old", "ratio_max"):
            if not (math.isnan(ref[key]) and math.isnan(out[key])):
                assert out[key] == pytest.approx(ref[key], rel=1e-5, abs=1e-7), key
    model.grad_checkpoint = False
    with torch.no_grad():
        for p, p0 in zip(params, start):
            p.copy_(p0)


def test_micro_batch_auto_takes_as_many_rows_as_the_memory_budget_holds(lora_policy, monkeypatch):
    model = lora_policy[0]
    per_row = memory.update_bytes_per_row(model.config, 20, 4, False)  # fp32 activations, rows of 20 tokens
    monkeypatch.setattr(memory, "UPDATE_MEMORY_CPU", 3.5 * per_row)
    assert memory.micro_batch_rows("auto", 8, model, 20) == 3
    assert memory.micro_batch_rows("auto", 2, model, 20) == 2  # everything fits: all rows at once
    assert memory.micro_batch_rows("auto", 8, model, 80) == 1  # longer rows: fewer fit, never fewer than 1
    assert memory.micro_batch_rows("auto", 1, model, 0) == 1  # a rank whose groups all lack signal: no rows, no T
    assert [memory.micro_batch_rows(n, 8, model, 20) for n in (0, 5, 12)] == [8, 5, 8]  # explicit sizes as given
    model.grad_checkpoint = True  # a checkpointed layer keeps only its input: more rows fit
    try:
        assert memory.micro_batch_rows("auto", 8, model, 20) > 3
    finally:
        model.grad_checkpoint = False
    assert parse().micro_batch == "auto" and parse("--micro-batch", 4).micro_batch == 4


# A fresh process meets 300 bf16 matmul shapes once each, forward and backward (an update's rows change
# length every step), and prints how much its live heap grew, in MiB (glibc's mallinfo2).
MATMUL_SHAPES = r"""
import ctypes, importlib, sys
sys.path.insert(0, sys.argv[1])
importlib.import_module("qerl.devices")  # caps oneDNN's kernel caches, unless the environment already set them
import torch
libc = ctypes.CDLL("libc.so.6")
class Info(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()]
libc.mallinfo2.restype = Info
w = torch.randn(1536, 576, dtype=torch.bfloat16, requires_grad=True)
start = libc.mallinfo2().uordblks
for rows in range(100, 400):
    (torch.randn(rows, 576, dtype=torch.bfloat16, requires_grad=True) @ w.t()).float().sum().backward()
print((libc.mallinfo2().uordblks - start) / 2 ** 20)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mallinfo2 is glibc's")
def test_bf16_matmuls_of_new_shapes_keep_the_heap_bounded():
    devices = importlib.import_module("qerl.devices")

    def growth_mib(cap=None):  # cap None: the child's own import of devices sets the caps
        env = {k: v for k, v in os.environ.items() if k not in devices.ONEDNN_CACHE_VARS} | {"OMP_NUM_THREADS": "1"}
        env |= {name: cap for name in devices.ONEDNN_CACHE_VARS} if cap else {}
        r = subprocess.run([sys.executable, "-c", MATMUL_SHAPES, ROOT], capture_output=True, text=True, env=env)
        if r.returncode != 0 and "mallinfo2" in r.stderr:
            pytest.skip("this libc has no mallinfo2")
        assert r.returncode == 0, r.stderr
        return float(r.stdout)
    uncapped = growth_mib("1024")  # oneDNN's defaults
    if uncapped < 50:
        pytest.skip(f"this torch build keeps no kernel per bf16 matmul shape (the heap grew {uncapped:.0f} MiB)")
    capped = growth_mib()  # devices' caps
    assert capped < 150 and capped < uncapped / 2, (capped, uncapped)


# -----------------------------------------------------------------------------
# pi_old: the clean policy (trainer, the official code's reading) or the noisy sampler


def reset(params, start):
    with torch.no_grad():
        for p, p0 in zip(params, start):
            p.copy_(p0)


def spy_on_loss(monkeypatch):
    """Record (ratio, old_logp) of every grpo_loss call, ratios under the mask (1 elsewhere)."""
    calls, real = [], grpo.grpo_loss

    def spy(logp, old_logp, adv, mask, *a, **kw):
        calls.append((torch.exp(logp - old_logp).detach().masked_fill(mask == 0, 1.0), old_logp.detach().clone()))
        return real(logp, old_logp, adv, mask, *a, **kw)
    monkeypatch.setattr(grpo, "grpo_loss", spy)
    return calls


def plain_policy_gradient_step(model, params, batch, group, lr):
    """The parameter change of one SGD step on the plain policy-gradient loss -sum(A * logp) / tokens over
    the rows with signal, written out without grpo_loss."""
    prompt_ids, ids, mask, _, rewards = batch
    adv = grpo.group_advantages(rewards, group)  # (N,)
    kept = (rewards.view(-1, group).std(1) > 0).repeat_interleave(group).nonzero().squeeze(1).tolist()
    logp, _ = rollout.sequence_logprobs(model, [prompt_ids[i] for i in kept], ids[kept], mask[kept])  # (n, T)
    loss = -(adv[kept, None] * logp * mask[kept]).sum() / mask[kept].sum()
    grads = torch.autograd.grad(loss, params)
    return [-lr * g for g in grads]


def test_pi_old_trainer_at_mu_1_is_the_plain_policy_gradient(lora_policy, monkeypatch):
    model, params, start = lora_policy
    batch = update_batch(model.config.vocab_size)  # its old_logp (the sampler's) is far from the policy's
    want = plain_policy_gradient_step(model, params, batch, group=4, lr=0.2)
    calls = spy_on_loss(monkeypatch)
    moved = {}
    for pi_old in ("trainer", "sampler"):
        reset(params, start)
        args = parse("--group", 4, "--max-new-tokens", 9, "--grad-clip", 1e9, "--pi-old", pi_old)
        out = grpo.policy_update(model, torch.optim.SGD(params, lr=0.2), params, *batch, **grpo.update_options(args))
        moved[pi_old] = [p.detach() - p0 for p, p0 in zip(params, start)]
        if pi_old == "trainer":
            (ratio, _), = calls  # one forward pass: pi_old is that pass's own log-probs, detached
            assert torch.equal(ratio, torch.ones_like(ratio))  # exactly 1: nothing is clipped or reweighted
            assert (out["ratio_max"], out["clip"], out["kl_old"]) == (1.0, 0.0, 0.0)
    assert max(float(d.abs().max()) for d in want) > 1e-3
    for got, w in zip(moved["trainer"], want):
        torch.testing.assert_close(got, w, rtol=1e-5, atol=1e-7)
    # the sampler's log-probs reweight every token: another update
    assert calls[-1][0].max() > 1.5 and not all(torch.allclose(a, b) for a, b in zip(moved["sampler"], want))
    reset(params, start)


@pytest.mark.parametrize("reading", list(grpo.PI_OLD))  # the registry: a new reading gets this test
def test_every_pi_old_reading_is_the_plain_policy_gradient_when_the_sampler_is_the_policy(lora_policy, reading):
    """A reading answers the sampler being another policy than the trainer's: when the sampler's log-probs are
    the policy's own (no noise) at --mu 1, every reading gives the plain policy-gradient step."""
    model, params, start = lora_policy
    prompt_ids, ids, mask, _, rewards = update_batch(model.config.vocab_size)
    with torch.no_grad():
        on_policy, _ = rollout.sequence_logprobs(model, prompt_ids, ids, mask)  # (N, T)
    batch = prompt_ids, ids, mask, on_policy.float() * mask, rewards
    want = plain_policy_gradient_step(model, params, batch, group=4, lr=0.2)
    args = parse("--group", 4, "--max-new-tokens", 9, "--grad-clip", 1e9, "--pi-old", reading)
    grpo.policy_update(model, torch.optim.SGD(params, lr=0.2), params, *batch, **grpo.update_options(args))
    got = [p.detach() - p0 for p, p0 in zip(params, start)]
    reset(params, start)
    assert max(float(d.abs().max()) for d in want) > 1e-3
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-7)


def test_pi_old_trainer_at_mu_2_is_the_policy_before_the_first_step(lora_policy, monkeypatch):
    model, params, start = lora_policy
    prompt_ids, ids, mask, sampler_logp, rewards = batch = update_batch(model.config.vocab_size)
    calls = spy_on_loss(monkeypatch)
    args = parse("--group", 4, "--max-new-tokens", 9, "--grad-clip", 1e9, "--mu", 2, "--micro-batch", 3)
    grpo.policy_update(model, torch.optim.SGD(params, lr=0.5), params, *batch, **grpo.update_options(args))
    first, second = calls[:3], calls[3:]  # 8 kept rows in slices of 3: three losses per step
    assert len(second) == 3
    # the first step's ratio is 1 (pi_old is the same clean policy, from a pass without gradients); after it
    # the policy has moved and the ratio with it
    assert all(torch.allclose(r, torch.ones_like(r), atol=1e-6, rtol=0) for r, _ in first)
    assert max(float((r - 1).abs().max()) for r, _ in second) > 1e-3
    # the same pi_old in both steps, and not the sampler's
    for (_, old_a), (_, old_b) in zip(first, second):
        assert torch.equal(old_a, old_b)
    kept = [0, 1, 2, 3, 8, 9, 10, 11]
    assert not torch.allclose(first[0][1], sampler_logp[kept[:3], :first[0][1].shape[1]])
    reset(params, start)


def test_pi_old_sampler_passes_the_samplers_log_probs(lora_policy, monkeypatch):
    """--pi-old sampler is the update as it was: grpo_loss gets the sampler's log-probs of the kept rows,
    and the step's loss and statistics are grpo_loss's on them."""
    model, params, start = lora_policy
    prompt_ids, ids, mask, sampler_logp, rewards = batch = update_batch(model.config.vocab_size)
    real = grpo.grpo_loss
    kept = [0, 1, 2, 3, 8, 9, 10, 11]  # the middle group has equal rewards
    t = int(mask[kept].sum(1).max())
    logp, _ = rollout.sequence_logprobs(model, [prompt_ids[i] for i in kept], ids[kept, :t], mask[kept, :t])
    want_loss, want = real(logp, sampler_logp[kept, :t], grpo.group_advantages(rewards, 4)[kept], mask[kept, :t])
    calls = spy_on_loss(monkeypatch)
    args = parse("--group", 4, "--max-new-tokens", 9, "--grad-clip", 1e9, "--pi-old", "sampler")
    out = grpo.policy_update(model, torch.optim.SGD(params, lr=0.2), params, *batch, **grpo.update_options(args))
    (_, old), = calls
    assert torch.equal(old, sampler_logp[kept, :t])
    assert out["loss"] == pytest.approx(float(want_loss.detach()), rel=1e-6)
    for key in ("clip", "kl_old", "ratio_max"):
        assert out[key] == pytest.approx(want[key], rel=1e-6), key
    assert out["clip"] > 0.1  # this batch's sampler is far from the policy
    reset(params, start)


def test_grad_checkpointing_keeps_only_layer_inputs(lora_policy):
    """With --grad-checkpoint the update's forward saves no intermediate activations for backward
    (checkpointing keeps each layer's input itself), and the modules are restored afterwards."""
    model, params, _ = lora_policy
    ids = torch.arange(40).view(2, 20) % model.config.vocab_size
    counts = []
    for enabled in (False, True):
        saved = []
        model.grad_checkpoint = enabled
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t, lambda t: t):
            h = model.hidden_states(ids)  # (2, 20, C)
        h.float().pow(2).sum().backward()
        counts.append(sum(saved))
    model.zero_grad()
    model.grad_checkpoint = False
    assert counts[1] < counts[0] / 5  # what is left: the embedding, RoPE tables and final norm
    assert not any("forward" in vars(m) for m in model.modules())


def random_model_folder(path, layers=1, hidden=64):
    """A random Qwen2 folder with the bundled model's tokenizer (the interpreted kernel is slow: keep it tiny)."""
    import shutil
    from safetensors.torch import save_file
    cfg = json.load(open(os.path.join(grpo.TINY_MODEL, "config.json")))
    cfg.update(num_hidden_layers=layers, hidden_size=hidden, intermediate_size=hidden, head_dim=hidden // 4)
    torch.manual_seed(0)
    model = rollout.CausalLM(rollout.ModelConfig.from_dict(cfg))
    path.mkdir()
    tensors = {k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}  # tied
    save_file(tensors, str(path / "model.safetensors"))
    for f in ("tokenizer.json", "generation_config.json"):
        shutil.copy(os.path.join(grpo.TINY_MODEL, f), path / f)
    (path / "config.json").write_text(json.dumps(cfg))
    return str(path)


def test_gpu_code_path_runs_two_steps(tmp_path, monkeypatch, capsys):
    """--gpu-path runs on the CPU what CUDA runs: NVFP4Linear through the Triton kernel (interpreted),
    no merged sampling weights, bf16 activations; here with micro-batches and checkpointing on.
    On a GPU machine the same test runs on CUDA itself."""
    monkeypatch.setattr(grpo.quantize.NVFP4Linear, "kernel_on_cpu", False)  # restored after (--gpu-path sets it)
    real_kernel, calls = grpo.quantize.nvfp4_kernel(), []
    assert real_kernel is not None

    def counting_kernel(x, *a, **kw):
        calls.append((x.dtype, torch.is_grad_enabled() and x.requires_grad))
        return real_kernel(x, *a, **kw)

    monkeypatch.setattr(grpo.quantize, "nvfp4_kernel", lambda: counting_kernel)
    merged = []
    real_merged = grpo.merged_sampling_weights
    monkeypatch.setattr(grpo, "merged_sampling_weights", lambda m, enabled=True: merged.append(enabled) or
                        real_merged(m, enabled))
    rewards = iter([1.1, 0.0, 0.1, 1.0] * 2)  # every group has signal, so both steps update
    monkeypatch.setattr(tasks.AnswerTask, "reward", lambda self, problem, text: next(rewards))
    out = tmp_path / "gpu-path"
    grpo.train(grpo.build_parser().parse_args([
        "--model", random_model_folder(tmp_path / "model"), "--lora-r", "4",
        "--out", str(out), "--steps", "2", "--batch", "1", "--group", "4", "--max-new-tokens", "3",
        "--eval-size", "0", "--save-every", "0", "--time-budget", "0", "--quiet", "--warmup", "1", "--lr", "1e-2",
        "--device", "cuda" if torch.cuda.is_available() else "cpu",
        "--gpu-path", "--micro-batch", "2", "--grad-checkpoint"]))
    steps, _ = step_rows(out)
    assert [r["step"] for r in steps] == [1, 2] and all(math.isfinite(r["loss"]) and r["loss"] != 0 for r in steps)
    assert merged == [False, False]  # sampled through the modules, as on CUDA
    run_line = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("run |"))
    on_cpu = "" if torch.cuda.is_available() else ",decode-attention-cpu"  # the first line names the fast paths
    assert f"| fast fast-forward,nvfp4-kernel{on_cpu},chunked-logprobs |" in run_line, run_line
    assert calls and {dt for dt, _ in calls} == {torch.bfloat16}
    assert any(g for _, g in calls) and any(not g for _, g in calls)  # the update and the sampler
    adapter = load_file(str(out / "checkpoint-000002" / "adapter_model.safetensors"))
    assert all(torch.isfinite(v).all() for v in adapter.values())
    assert any(k.endswith("lora_B.weight") and v.abs().sum() > 0 for k, v in adapter.items())  # it moved


@pytest.mark.parametrize("flags, fast", [
    ((), "merged-sampling,kept-dequantized,fast-forward,decode-attention-cpu,chunked-logprobs"),
    (("--quant", "none"), "merged-sampling,decode-attention-cpu,chunked-logprobs")])  # no 4-bit layer
def test_the_first_log_line_names_the_fast_paths_in_use(tmp_path, capsys, flags, fast):
    """Issue 46 item 3: what runs is what's read. A CPU run's first line names each fast path it takes (each
    computes what Part 1 reads, and a test shows each equal); --gpu-path's: test_gpu_code_path_runs_two_steps."""
    grpo.train(tiny_args(tmp_path / "run", "--steps", "1", "--eval-size", "0", "--max-new-tokens", "4", *flags))
    run_line = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("run |"))
    assert f"| fast {fast} |" in run_line, run_line
    if not flags:  # --compile adds the compiled decode step (a run would compile for tens of seconds)
        model = grpo.build_policy(tiny_args(tmp_path / "unused"), "cpu")[0]
        assert grpo_variants.fast_paths(model, "cpu", True, True) == fast.split(",")[:3] + [
            "compiled-step", "decode-attention-cpu", "chunked-logprobs"]


def test_truncated_safetensors_is_one_clear_line(tmp_path):
    import shutil
    model_dir = tmp_path / "model"
    shutil.copytree(grpo.TINY_MODEL, model_dir)
    data = (model_dir / "model.safetensors").read_bytes()
    (model_dir / "model.safetensors").write_bytes(data[:len(data) // 3])
    r = subprocess.run([sys.executable, os.path.join(ROOT, "qerl/train.py"), "--model", str(model_dir),
                        "--out", str(tmp_path / "o"), "--device", "cpu"], capture_output=True, text=True, timeout=120)
    lines = [line for line in r.stderr.strip().splitlines() if line]
    assert r.returncode != 0 and len(lines) == 1, r.stderr
    assert re.match(r"error: \S+model.safetensors: tensor \S+ needs bytes \d+\.\.\d+ but the file has \d+; the file "
                    r"is truncated or corrupt", lines[0]), lines[0]
    # a checkpoint whose adapter file was cut short: --resume names the file and a tensor
    args = tiny_args(tmp_path / "run", "--eval-size", "0")
    model, tok, params, opt = grpo.build_policy(args, "cpu")
    ckpt = checkpoints.save_checkpoint(str(tmp_path / "run"), 1, opt, params, args,
                                       functools.partial(grpo.lora.save_adapter, model), grpo.lora.DEFAULT_TARGETS)
    adapter = os.path.join(ckpt, "adapter_model.safetensors")
    data = open(adapter, "rb").read()
    open(adapter, "wb").write(data[:-8])
    with pytest.raises(ValueError, match=r"--resume: \S+adapter_model.safetensors: tensor \S+lora_\w.weight needs "
                                         r"bytes \d+\.\.\d+ but the file has \d+; the file is truncated or corrupt"):
        grpo.train(parse("--resume", ckpt, "--quiet"))

# -----------------------------------------------------------------------------
# The task interface and silent failures made loud


class SumTask:
    """A second task, written only against 05's task interface: add two numbers. Its problems carry the
    operands (no gold string), its reward has no format bonus, and "correct" is decided here alone."""
    def __init__(self):
        self.calls = []
        self.held = self.problems(99, 0, 6)

    def problems(self, seed, step, n):
        import random
        rng = random.Random(seed * 7919 + step)
        return [{"question": f"{a}+{b}=?", "operands": (a, b)} for a, b in
                ((rng.randint(0, 99), rng.randint(0, 99)) for _ in range(n))]

    def prompt(self, problem):
        return hf_files.chat_prompt(problem["question"])

    def correct(self, problem, completion):
        return tasks.extract_answer(completion) == sum(problem["operands"])

    def reward(self, problem, completion):
        self.calls.append(problem)
        return 1.0 if self.correct(problem, completion) else 0.0


def test_a_new_task_trains_through_the_interface_alone(tmp_path):
    task = SumTask()
    out = tmp_path / "sum"
    summary = grpo.train(tiny_args(out, "--steps", "2", "--eval-k", "0"), task=task)
    steps, evals = step_rows(out)
    assert [r["step"] for r in steps] == [1, 2]
    # each held-out evaluation (before step 1 and after step 2) also scores its greedy completions: their mean
    # reward is the eval's greedy_reward; the training steps' calls lie between
    assert task.calls[:6] == task.held and task.calls[-6:] == task.held
    train_calls = task.calls[6:-6]
    assert len(train_calls) == 2 * 3 * 4 and all("operands" in p for p in train_calls)  # B x G rows a step
    assert train_calls[0] == task.problems(0, 0, 3)[0]  # the step's problems: a pure function of (seed, step)
    for r in steps:  # rewards are this task's: 0 or 1 per row, no format bonus; acc counts its `correct`
        assert r["reward"] == pytest.approx(r["acc"])
    assert [e["n"] for e in evals] == [6, 6] and summary["steps_done"] == 2  # the task's held-out set


class PartialCreditTask(SumTask):
    """SumTask with a reward known by hand whatever the completion: a + b's last digit / 10."""
    def reward(self, problem, completion):
        return sum(problem["operands"]) % 10 / 10


def test_evaluation_reports_the_mean_reward_beside_exact_accuracy(tmp_path, capsys):
    # Partial credit visible: each evaluation's greedy_reward, the mean task.reward of the greedy completions,
    # is in the dict evaluate returns, metrics.jsonl's eval rows, the eval and summary lines and summary.json.
    task = PartialCreditTask()
    want = sum(sum(p["operands"]) % 10 for p in task.held) / 10 / len(task.held)
    assert 0 < want < 1
    out = tmp_path / "credit"
    summary = grpo.train(tiny_args(out, "--steps", "1", "--eval-k", "0", "--max-new-tokens", "8"), task=task)
    _, evals = step_rows(out)
    saved = json.load(open(out / "summary.json"))
    assert [e["step"] for e in evals] == [0, 1]
    for res in (*evals, summary["first_eval"], summary["final_eval"], saved["first_eval"], saved["final_eval"]):
        assert res["greedy_reward"] == pytest.approx(want)
    printed = capsys.readouterr().out
    assert printed.count(f" | reward {want:.3f} | ") == 2  # the two eval lines
    assert f"| reward {want:.3f} -> {want:.3f} |" in printed


def test_steps_without_signal_are_reported(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(tasks.AnswerTask, "reward", lambda self, problem, text: 0.0)  # every group's rewards are equal
    monkeypatch.setattr(runs.RunLog, "NO_SIGNAL_STEPS", 2)
    args = tiny_args(tmp_path / "flat", "--steps", "3", "--eval-size", "0")
    args.quiet = False
    grpo.train(args)
    out = capsys.readouterr().out
    steps = [line for line in out.splitlines() if line.startswith("step ")]
    assert len(steps) == 3 and all("no signal" in line for line in steps)
    warnings = [line for line in out.splitlines() if line.startswith("warning")]
    assert len(warnings) == 1 and "2 steps in a row without signal" in warnings[0] and "never solves" in warnings[0]
    assert all(r["frac_zero_std"] == 1 and r["loss"] == 0 for r in step_rows(tmp_path / "flat")[0])



# -----------------------------------------------------------------------------
# The seams a fork uses: a pi_old reading, a logged statistic, the flags a run reads


def test_a_new_pi_old_reading_is_one_registry_entry(lora_policy, monkeypatch):
    """A reading added to PI_OLD alone is offered by --pi-old and acts: its per-token weight scales the
    surrogate, so a weight of 2 moves the adapter by exactly twice the plain reading's SGD step."""
    model, params, start = lora_policy
    batch = update_batch(model.config.vocab_size)
    double = grpo.PiOld("the trainer's pi_old, each token's surrogate weighted twice",
                        lambda current, sampler, before, options: (current, torch.full_like(current, 2.0)))
    monkeypatch.setitem(grpo.PI_OLD, "double", double)
    moved = {}
    for name in ("trainer", "double"):
        with torch.no_grad():
            for p, p0 in zip(params, start):
                p.copy_(p0)
        args = parse("--group", 4, "--max-new-tokens", 9, "--grad-clip", 1e9, "--pi-old", name)
        assert args.pi_old == name  # the parser's choices are the registry
        grpo.policy_update(model, torch.optim.SGD(params, lr=0.2), params, *batch, **grpo.update_options(args))
        moved[name] = torch.cat([(p.detach() - p0).reshape(-1) for p, p0 in zip(params, start)])
    assert moved["trainer"].abs().max() > 0
    torch.testing.assert_close(moved["double"], 2 * moved["trainer"], rtol=1e-5, atol=1e-7)
    with torch.no_grad():
        for p, p0 in zip(params, start):
            p.copy_(p0)


def test_a_new_loss_statistic_reaches_the_log_by_name(tmp_path, monkeypatch):
    """A statistic added in grpo_loss's dict alone reaches metrics.jsonl: a token mean of a constant is the
    constant, and one named in MAX_STATS is the maximum over micro-batches."""
    real = grpo.grpo_loss

    def with_more(*a, **kw):
        loss, stats = real(*a, **kw)
        return loss, {**stats, "answer_const": 0.5, "max_tokens": float(a[3].sum())}

    monkeypatch.setattr(grpo, "grpo_loss", with_more)
    monkeypatch.setitem(grpo.MAX_STATS, "max_tokens", 0.0)
    out = tmp_path / "stats"
    grpo.train(tiny_args(out, "--steps", "2", "--eval-size", "0", "--micro-batch", "2"))
    steps, _ = step_rows(out)
    updated = [r for r in steps if r["frac_zero_std"] < 1]
    assert updated and all(r["answer_const"] == pytest.approx(0.5) for r in updated)
    assert all(0 < r["max_tokens"] <= 2 * 40 for r in updated)  # one micro-batch of 2 rows' tokens, at most


def test_num_stages_and_unread_flags_are_refused_before_any_work(tmp_path, capsys):
    """--num-stages 1 (04 refuses it: stage 0 is noise-free) and a flag the chosen options do not read are
    one line before the model loads and before any file is written."""
    cases = [(["--num-stages", "1"], r"AQN needs num_stages >= 2 \(got 1\)"),
             (["--no-aqn", "--sigma-start", "0.02"], r"--sigma-start 0.02 is read only with --aqn"),
             (["--aqn-kind", "feedback", "--num-stages", "4"], r"--num-stages 4 is read only with --aqn with a "
                                                                r"decaying --aqn-kind"),
             (["--target-entropy", "0.3"], r"--target-entropy 0.3 is read only with --aqn-kind feedback")]
    for i, (flags, message) in enumerate(cases):
        with pytest.raises(ValueError, match=message):
            grpo.train(parse(*flags, "--out", tmp_path / f"o{i}"))
        assert not (tmp_path / f"o{i}").exists()


def test_help_puts_the_flags_that_define_qerl_first():
    groups = grpo.build_parser()._action_groups
    first = [g for g in groups if g.title.startswith("QeRL")][0]
    flags = {s for a in first._group_actions for s in a.option_strings}
    assert {"--model", "--quant", "--aqn", "--sigma-start", "--sigma-end", "--num-stages", "--pi-old", "--lora-r",
            "--steps", "--batch", "--group", "--lr"} <= flags and len(flags) <= 16
    text = grpo.build_parser().format_help().split("options:", 1)[1]  # the groups, after the usage line
    assert text.index("QeRL:") < text.index("--lr") < text.index("task and data") < text.index("--eval-size")


def test_a_damaged_checkpoint_is_refused_on_resume(tmp_path, monkeypatch):
    """--resume checks what it would continue from: each saved argument within its flag's range, the adapter
    finite, AdamW's moments finite and its second moments >= 0; one line each, nothing written."""
    import shutil
    from safetensors.torch import save_file
    rewards = iter([1.0, 0.0] * 100)  # every group has signal: the step updates, and AdamW has moments
    monkeypatch.setattr(tasks.AnswerTask, "reward", lambda self, problem, text: next(rewards))
    grpo.train(tiny_args(tmp_path / "run", "--steps", "2", "--stop-at", "1", "--eval-size", "0"))  # unfinished

    def damaged(name, edit):
        run = tmp_path / name
        shutil.copytree(tmp_path / "run", run)
        edit(run / "checkpoint-000001")
        return ["--resume", str(run / "checkpoint-000001"), "--quiet"]

    def state_edit(change):
        def edit(ckpt):
            state = torch.load(ckpt / "trainer_state.pt", weights_only=True)
            change(state)
            torch.save(state, ckpt / "trainer_state.pt")
        return edit

    def nan_adapter(ckpt):
        tensors = load_file(str(ckpt / "adapter_model.safetensors"))
        next(iter(tensors.values())).view(-1)[0] = float("nan")
        save_file(tensors, str(ckpt / "adapter_model.safetensors"))

    def negative_moment(state):
        next(iter(state["optimizer"]["state"].values()))["exp_avg_sq"].view(-1)[0] = -1.0

    cases = [("clip", state_edit(lambda s: s["args"].update(grad_clip=-1.0)), r"--grad-clip -1.0 is not a value"),
             ("eval", state_edit(lambda s: s["args"].update(eval_size=10_000_000)), r"--eval-size 10000000 is not a"),
             ("nan", nan_adapter, r"the adapter \(or a trained norm\) holds a non-finite value"),
             ("adam", state_edit(negative_moment), r"exp_avg_sq \(a second moment\) holds a negative value")]
    for name, edit, message in cases:
        argv = damaged(name, edit)
        before = sorted(p.name for p in (tmp_path / name).iterdir())
        with pytest.raises(ValueError, match=r"^--resume: .*" + message):
            grpo.train(grpo.build_parser().parse_args(argv))
        assert sorted(p.name for p in (tmp_path / name).iterdir()) == before, name


@pytest.mark.parametrize("reading", ["tis", "tis-mask"])
def test_tis_is_the_policy_gradient_weighted_by_the_capped_ratio(lora_policy, reading):
    """--pi-old tis at --mu 1: the ratio is the trainer's own (1), and each token's term is weighted by
    min(rho, cap), rho = pi_trainer / pi_sampler, detached (tis-mask: 1 if rho <= cap, else 0): one SGD step
    equals the hand-written -sum(A * w * logp) / tokens. This batch's sampler is far from the policy, so the
    cap acts; the logged mismatch says so."""
    model, params, start = lora_policy
    batch = update_batch(model.config.vocab_size)
    prompt_ids, ids, mask, sampler, rewards = batch
    adv = grpo.group_advantages(rewards, 4)  # (N,)
    kept = (rewards.view(-1, 4).std(1) > 0).repeat_interleave(4).nonzero().squeeze(1).tolist()
    logp, _ = rollout.sequence_logprobs(model, [prompt_ids[i] for i in kept], ids[kept], mask[kept])  # (n, T)
    rho = torch.exp(logp.detach().float() - sampler[kept])  # (n, T)
    w = rho.clamp(max=2.0) if reading == "tis" else (rho <= 2.0).float()
    loss = -(adv[kept, None] * w * logp * mask[kept]).sum() / mask[kept].sum()
    want = [-0.2 * g for g in torch.autograd.grad(loss, params)]
    assert float((rho * mask[kept]).max()) > 2.0  # the cap acts on this batch
    args = parse("--group", 4, "--max-new-tokens", 9, "--grad-clip", 1e9, "--pi-old", reading, "--tis-cap", 2)
    out = grpo.policy_update(model, torch.optim.SGD(params, lr=0.2), params, *batch, **grpo.update_options(args))
    got = [p.detach() - p0 for p, p0 in zip(params, start)]
    with torch.no_grad():
        for p, p0 in zip(params, start):
            p.copy_(p0)
    for g, w_ in zip(got, want):
        torch.testing.assert_close(g, w_, rtol=1e-4, atol=1e-7)
    m = mask[kept]
    assert out["is_w_max"] == pytest.approx(float(rho.masked_fill(m == 0, 1.0).max()), rel=1e-5)
    assert out["is_beyond_cap"] == pytest.approx(float(((rho > 2.0).float() * m).sum() / m.sum()), rel=1e-5)
    assert out["mismatch_kl"] == pytest.approx(float(((rho - 1 - rho.log()) * m).sum() / m.sum()), rel=1e-5)


def test_without_noise_the_sampler_and_trainer_agree_and_the_mismatch_is_logged(tmp_path):
    """At sigma 0 the IS weights are 1 up to rounding (the sampler's merged weights against the trainer's
    modules), nothing is beyond the cap, and every step's record carries the mismatch under every reading."""
    out = tmp_path / "tis"
    grpo.train(tiny_args(out, "--steps", "2", "--eval-size", "0", "--no-aqn", "--pi-old", "tis"))
    steps, _ = step_rows(out)
    updated = [r for r in steps if r["frac_zero_std"] < 1]
    assert updated
    for r in updated:
        assert abs(r["is_w_max"] - 1) < 1e-3 and r["is_beyond_cap"] == 0 and r["mismatch_kl"] < 1e-6
        assert r["is_ess"] == pytest.approx(1.0, abs=1e-6)
    grpo.train(tiny_args(tmp_path / "noisy", "--steps", "2", "--eval-size", "0", "--sigma-start", "0.5",
                         "--sigma-end", "0.05", "--num-stages", "2", "--warmup", "1"))  # the default reading
    for r in step_rows(tmp_path / "noisy")[0]:
        assert {"mismatch_kl", "is_w_mean", "is_w_max", "is_beyond_cap", "is_ess"} <= set(r)


def test_a_config_that_disagrees_with_its_weights_is_named_before_any_estimate(tmp_path):
    """hidden_size 100000 (or 100,000 layers) over the bundled weights: one line naming config.json and what the
    weights hold, not a memory error blaming --eval-chunk; nothing written."""
    import shutil
    for field, value, want in [("hidden_size", 100_000, r"says vocab_size \d+ and hidden_size 100000, but "
                                r"model.embed_tokens.weight is \d+ x 128"),
                               ("num_hidden_layers", 100_000, r"says num_hidden_layers 100000, but the weights hold layers 0..3 \(4 of them\)")]:
        model = tmp_path / field
        shutil.copytree(grpo.TINY_MODEL, model)
        cfg = json.loads((model / "config.json").read_text())
        (model / "config.json").write_text(json.dumps({**cfg, field: value}))
        with pytest.raises(ValueError, match=want):
            grpo.train(parse("--model", model, "--out", tmp_path / f"o-{field}"))
        assert not (tmp_path / f"o-{field}").exists()
