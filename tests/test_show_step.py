"""`python qerl/train.py --show-step`: every number it prints, recomputed from 05's own functions."""
import contextlib
import importlib
import io

import pytest
import torch

import test_bad_inputs as bad

grpo = importlib.import_module("qerl.train")


@pytest.fixture(scope="module")
def shown():
    """One run of the command through main, as the command line runs it (~3 s): its dict and its stdout."""
    got, real, out = [], grpo.show_step, io.StringIO()
    with pytest.MonkeyPatch.context() as mp, contextlib.redirect_stdout(out):
        mp.setattr(grpo, "show_step", lambda args: got.append(real(args)))
        grpo.main(["--show-step"])
    return got[0], out.getvalue()


def test_the_group_has_signal_and_its_advantages_are_group_advantages(shown):
    d, text = shown
    r = torch.tensor(d["rewards"])  # (G,)
    assert len(r) == 8 and r.std() > 0  # the first group of the step whose rewards differ
    assert d["step"] == 75 and d["sigma"] == pytest.approx(1e-2)  # 750 steps, 10 stages: stage 1 starts at 75
    assert d["mean"] == pytest.approx(float(r.mean())) and d["std"] == pytest.approx(float(r.std()))
    torch.testing.assert_close(torch.tensor(d["adv"]), grpo.group_advantages(r, 8))
    assert " ".join(f"{a:+.4f}" for a in d["adv"]) in text and f"std {d['std']:.4f}" in text


def test_each_token_and_the_loss_are_grpo_losss(shown):
    d, text = shown
    logp, sampler, mask, adv = d["logp"], d["sampler_logp"], d["mask"], torch.tensor(d["adv"])
    n = float(mask.sum())
    assert d["n_tokens"] == n
    trainer, _ = grpo.grpo_loss(logp, logp, adv, mask)  # the default reading at --mu 1: pi_old = pi_theta
    sampled, _ = grpo.grpo_loss(logp, sampler, adv, mask)
    assert d["loss"] == {"trainer": pytest.approx(float(trainer), abs=1e-7),
                         "sampler": pytest.approx(float(sampled), abs=1e-7)}
    # REINFORCE: at ratio 1 the loss is -sum_i A_i |o_i| / N
    assert float(trainer) == pytest.approx(-float((adv * mask.sum(1)).sum()) / n, abs=1e-6)
    assert f"--pi-old sampler {round(d['loss']['sampler'], 6) + 0.0:+.6f}" in text
    assert len(d["tokens"]) == 8 and {k["adv"] for k in d["tokens"]} == {max(d["adv"]), min(d["adv"])}
    for k in d["tokens"]:
        i, t, a = k["row"], k["t"], k["adv"]
        ratio = float(torch.exp(logp[i, t] - sampler[i, t]))
        surrogate = min(ratio * a, min(max(ratio, 1 - 0.2), 1 + 0.28) * a)  # LossOptions' eps_low, eps_high
        assert k["logp"] == float(logp[i, t]) and k["sampler"] == float(sampler[i, t]) and mask[i, t] == 1
        assert k["ratio"] == pytest.approx(ratio) and k["surrogate"] == pytest.approx(surrogate, abs=1e-6)
        assert k["share_trainer"] == pytest.approx(-a / n) and k["share_sampler"] == pytest.approx(-surrogate / n)
        assert f"{k['ratio']:>7.5f} |" in text and f"{k['share_sampler']:>+13.3e}" in text
    assert any(abs(k["ratio"] - 1) > 1e-3 for k in d["tokens"])  # AQN's noise: the sampler is not the policy


@pytest.mark.parametrize("case", [
    bad.Case("show-step-other-loss", "qerl/train", ["--show-step", "--loss-agg", "seq-mean-token-mean"],
             "--show-step works the default loss"),
    bad.Case("show-step-no-model", "qerl/train", ["--show-step", "--model", "{tmp}/none"], "not found"),
], ids=lambda c: c.id)
def test_show_step_bad_inputs(case, tmp_path, capsys):
    bad.run_case(case, tmp_path, capsys)


def test_the_first_noisy_step_is_found_without_walking_the_run(monkeypatch):
    """--steps 1e9 --num-stages 2: the first noisy step is 5e8, found in two looks at the schedule (walking
    every step took minutes); the group is then sampled there as at any step."""
    looked = []
    step_sigma = grpo.step_sigma
    monkeypatch.setattr(grpo, "step_sigma", lambda args, s: looked.append(s) or step_sigma(args, s))
    args = grpo.build_parser().parse_args(["--show-step", "--steps", "1000000000", "--num-stages", "2",
                                           "--batch", "16", "--group", "4", "--max-new-tokens", "40"])
    with contextlib.redirect_stdout(io.StringIO()) as out:
        d = grpo.show_step(args, 2)
    assert d["step"] == 500_000_000 and 1 <= len(looked) <= 3, looked  # the schedule, looked at 2-3 times
    assert "500000000" in out.getvalue()
