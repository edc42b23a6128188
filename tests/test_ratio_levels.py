"""--ratio-level (qerl/train.py's RATIOS): the importance ratio per token (the default, 05's) or per sequence
(GSPO, arXiv 2507.18071: one length-normalised ratio a row, clipped as a whole). The tests shared by every level
run over the registry, so a new level gets them."""
import contextlib
import importlib
import io
import json
import math

import pytest
import torch
from safetensors.torch import load_file

import test_bad_inputs as bad
import test_grpo as tg  # its batch, flags and tiny runs

grpo = importlib.import_module("qerl.train")
rollout = importlib.import_module("qerl.rollout")
stage05 = importlib.import_module("05_grpo")
LEVELS = list(grpo.RATIOS)

# The weight c_i each aggregation gives row i's mean gradient in the plain policy gradient at ratio 1,
# -sum_i c_i A_i mean_t grad log pi(y_i,t): L (n,) the kept rows' lengths, rows all the step's rows, T max_new_tokens
ROW_WEIGHTS = {"token-mean": lambda L, rows, T: L / L.sum(),
               "seq-mean-token-mean": lambda L, rows, T: torch.ones_like(L) / len(L),
               "seq-mean-token-sum-norm": lambda L, rows, T: L / (rows * T)}


@pytest.fixture(scope="module")
def policy():
    """test_grpo's small random fp32 Qwen2 (2 layers, width 32) with a trained-looking adapter (B != 0)."""
    return tg.small_lora_policy()


class GradientOfTheStep(torch.optim.SGD):
    """An optimizer that records the gradients its step is given (after the clip) and moves nothing."""

    def step(self, closure=None):
        self.grads = [p.grad.detach().clone() for p in self.param_groups[0]["params"]]


# -----------------------------------------------------------------------------
# Every level (the registry)


@pytest.mark.parametrize("agg", ROW_WEIGHTS)
@pytest.mark.parametrize("level", LEVELS)
def test_at_mu_1_every_level_is_the_sequence_mean_reinforce_gradient(policy, level, agg, capsys):
    """At --mu 1 pi_old is the policy itself (detached): every ratio is 1, nothing is clipped, and the update's
    gradient is -sum_i c_i A_i mean_t grad log pi(y_i,t), c_i the aggregation's weight of row i, written here in
    plain torch over the rows with signal."""
    model, params = policy
    prompt_ids, ids, mask, sampler_logp, rewards = batch = tg.update_batch(model.config.vocab_size)
    kept = (rewards.view(-1, 4).std(1) > 0).repeat_interleave(4).nonzero().squeeze(1).tolist()  # 8 of 12 rows
    adv = grpo.group_advantages(rewards, 4)[kept]  # (n,)
    logp, _ = rollout.sequence_logprobs(model, [prompt_ids[i] for i in kept], ids[kept], mask[kept])  # (n, T)
    L = mask[kept].sum(1)  # (n,)
    row_mean = (logp.float() * mask[kept]).sum(1) / L  # (n,) mean_t log pi(y_i,t)
    plain = -(ROW_WEIGHTS[agg](L, len(rewards), 9) * adv * row_mean).sum()
    want = torch.autograd.grad(plain, params)

    args = tg.parse("--group", 4, "--max-new-tokens", 9, "--grad-clip", 1e9, "--ratio-level", level, "--loss-agg", agg)
    grpo.check_ratio_level(args)  # a level's rule passes at --mu 1 with pi_old the trainer's
    opt = GradientOfTheStep(params, lr=0.0)
    out = grpo.policy_update(model, opt, params, *batch, **grpo.update_options(args))
    assert (out["ratio_max"], out["clip"], out["kl_old"]) == (1.0, 0.0, 0.0)
    assert max(float(w.abs().max()) for w in want) > 1e-3
    for got, w in zip(opt.grads, want):
        torch.testing.assert_close(got, w, rtol=1e-5, atol=1e-8)


@pytest.mark.parametrize("level", LEVELS)
def test_every_level_is_offered_with_its_clip_range_and_a_given_one_wins(level):
    """--ratio-level's choices are the registry; without --eps-low / --eps-high a run takes the level's clip range,
    and check_args writes it into args (args.json records the numbers); a given one is kept."""
    entry = grpo.RATIOS[level]
    args = tg.parse("--ratio-level", level, "--mu", 2)
    assert (args.ratio_level, args.eps_low, args.eps_high) == (level, None, None)  # None: not given
    options = grpo.LossOptions.from_args(args)
    assert (options.ratio_level, options.eps_low, options.eps_high) == (level, entry.eps_low, entry.eps_high)
    grpo.check_ratio_level(args)
    assert (args.eps_low, args.eps_high) == (entry.eps_low, entry.eps_high)
    given = tg.parse("--ratio-level", level, "--mu", 2, "--eps-low", 0.1, "--eps-high", 0.15)
    grpo.check_ratio_level(given)
    assert (given.eps_low, given.eps_high) == (0.1, 0.15)
    assert grpo.LossOptions.from_args(given) == grpo.LossOptions(eps_low=0.1, eps_high=0.15, ratio_level=level)


@pytest.mark.parametrize("level", LEVELS)
def test_show_step_works_every_level(level):
    """--show-step at each level: the losses are grpo_loss's at that level, and each token shown carries its ratio
    as the level gives it (per sequence: its row's, exp of the row's mean log-ratio), its clip and surrogate."""
    args = tg.parse("--show-step", "--ratio-level", level)
    with contextlib.redirect_stdout(io.StringIO()) as printed:
        d = grpo.show_step(args)
    text = printed.getvalue()
    options = grpo.LossOptions.from_args(args)
    logp, sampler, mask, adv = d["logp"], d["sampler_logp"], d["mask"], torch.tensor(d["adv"])
    n = float(mask.sum())
    for name, old in (("trainer", logp), ("sampler", sampler)):
        assert d["loss"][name] == pytest.approx(float(grpo.grpo_loss(logp, old, adv, mask, options)[0]), abs=1e-7)
    ratio = torch.exp(grpo.RATIOS[level].log_ratio(logp, sampler, mask))  # (G, T)
    low, high = 1 - options.eps_low, 1 + options.eps_high
    for k in d["tokens"]:
        i, t, a = k["row"], k["t"], k["adv"]
        if level == "sequence":  # the row's, by hand
            assert k["ratio"] == pytest.approx(math.exp(float(((logp[i] - sampler[i]) * mask[i]).sum() / mask[i].sum())))
        r = float(ratio[i, t])
        surrogate = min(r * a, min(max(r, low), high) * a)
        assert k["ratio"] == pytest.approx(r) and k["clipped"] == ((r < low and a < 0) or (r > high and a > 0))
        assert k["surrogate"] == pytest.approx(surrogate, abs=1e-6) and k["share_sampler"] == pytest.approx(-surrogate / n)
        assert k["share_trainer"] == pytest.approx(-a / n)
        assert f"{k['ratio']:>7.5f} |" in text
    assert f"[{low:g}, {high:g}]" in text
    if level == "sequence":  # one ratio a row
        assert len({(k["row"], k["ratio"]) for k in d["tokens"]}) == len({k["row"] for k in d["tokens"]})
        assert "--ratio-level sequence: per sequence, GSPO's" in text


def test_a_new_level_is_one_registry_entry(monkeypatch):
    """A level added to RATIOS alone is offered by --ratio-level, brings its clip range, and grpo_loss computes its
    ratio (here half the token log-ratio, clipped at 1 +- 0.1)."""
    monkeypatch.setitem(grpo.RATIOS, "half", grpo.Ratio("half the token log-ratio", lambda lp, o, m: 0.5 * (lp - o),
                                                        0.1, 0.1))
    args = tg.parse("--ratio-level", "half")
    options = grpo.LossOptions.from_args(args)
    assert (options.eps_low, options.eps_high) == (0.1, 0.1)
    logp, old, adv, m = torch.log(torch.tensor([[1.44], [1.1]])), torch.zeros(2, 1), torch.ones(2), torch.ones(2, 1)
    loss, stats = grpo.grpo_loss(logp, old, adv, m, options)  # ratios 1.2 (clipped at 1.1) and sqrt(1.1)
    assert loss.item() == pytest.approx(-(1.1 + math.sqrt(1.1)) / 2) and stats["clip"] == 0.5


# -----------------------------------------------------------------------------
# The token level: the default, 05's loss bit for bit


def test_the_default_is_the_token_level_and_05s_loss_bit_for_bit():
    """No flag: the ratio per token with DAPO's clip range, and grpo_loss (value, gradient, clip fraction) is
    05_grpo's own, bit for bit, on ratios on both sides of the clip. tests/test_stage_05.py compares whole runs
    and bench/same_results.py every variant's adapters and metrics with a baseline."""
    args = tg.parse()
    assert (args.ratio_level, grpo.LossOptions.from_args(args)) == ("token", grpo.LossOptions())
    assert (grpo.LossOptions().eps_low, grpo.LossOptions().eps_high) == (0.2, 0.28) == \
        (grpo.RATIOS["token"].eps_low, grpo.RATIOS["token"].eps_high)
    gen = torch.Generator().manual_seed(3)
    old = -torch.rand(6, 7, generator=gen) * 3  # (N, T)
    mask = (torch.arange(7)[None] < torch.tensor([7, 5, 1, 7, 3, 6])[:, None]).float()  # (N, T)
    adv = torch.randn(6, generator=gen)
    grads = []
    for loss_of in (lambda lp: grpo.grpo_loss(lp, old, adv, mask), lambda lp: stage05.grpo_loss(lp, old, adv, mask)):
        logp = (old + torch.randn(6, 7, generator=torch.Generator().manual_seed(4)) * 0.3).requires_grad_(True)
        loss, stats = loss_of(logp)
        loss.backward()
        grads.append((loss.detach(), logp.grad, stats["clip"] if isinstance(stats, dict) else stats))
    (loss_t, grad_t, clip_t), (loss_s, grad_s, clip_s) = grads
    assert torch.equal(loss_t, loss_s) and torch.equal(grad_t, grad_s) and clip_t == clip_s
    assert 0 < clip_t < 1  # some tokens clipped, some not


# -----------------------------------------------------------------------------
# The sequence level (GSPO)


def test_sequence_ratio_clips_whole_rows(policy):
    """One ratio a row, s_i = exp(mean_t log-ratio): a row whose s_i leaves [1 - eps_low, 1 + eps_high] on the side
    its advantage pushes gets no gradient at any token, even one whose own ratio is 1; a row whose tokens leave the
    range but whose mean does not gets -s_i A_i / N at each token (token-mean over N tokens)."""
    d = torch.tensor([[0.6, 0.6, 0.0],    # A > 0, s = e^0.4 > 1.28: clipped, token 2's own ratio 1 included
                      [0.9, -0.9, 0.0],   # A > 0, s = 1: kept, though tokens 0 and 1 are outside alone
                      [0.6, 0.6, 5.0],    # A < 0, s = e^0.6 > 1.28 (the last token is off the mask): kept
                      [-0.5, -0.5, -0.5]])  # A < 0, s = e^-0.5 < 0.8: clipped
    adv, mask = torch.tensor([1.0, 1.0, -1.0, -1.0]), torch.tensor([[1.0, 1, 1], [1, 1, 1], [1, 1, 0], [1, 1, 1]])
    old = -torch.rand(4, 3, generator=torch.Generator().manual_seed(0)) * 2
    N, s = 11.0, torch.exp(torch.tensor([0.4, 0.0, 0.6, -0.5]))
    options = grpo.LossOptions(eps_low=0.2, eps_high=0.28, ratio_level="sequence")
    logp = (old + d).requires_grad_(True)
    loss, stats = grpo.grpo_loss(logp, old, adv, mask, options)
    loss.backward()
    assert loss.item() == pytest.approx(-(3 * 1.28 + 3 * 1.0 - 2 * float(s[2]) - 3 * 0.8) / N)
    want = (-s * adv / N)[:, None] * mask * torch.tensor([0.0, 1, 1, 0])[:, None]  # (4, 3)
    torch.testing.assert_close(logp.grad, want)
    assert stats["clip"] == pytest.approx(6 / N) and stats["ratio_max"] == pytest.approx(float(s[2]))
    # per token the same rows clip otherwise: row 0's token 2 (ratio 1) and row 1's token 0 get a gradient
    token = grpo.LossOptions(eps_low=0.2, eps_high=0.28)
    logp.grad = None
    grpo.grpo_loss(logp, old, adv, mask, token)[0].backward()
    assert logp.grad[0, 2] != 0 and logp.grad[1, 0] == 0 and logp.grad[1, 2] != 0
    # GSPO's own range (the level's default): 1 + 4e-4 is the edge for a row with A > 0
    gspo = grpo.LossOptions.from_args(tg.parse("--ratio-level", "sequence"))
    for log_s, clipped in ((math.log(1.0003), False), (math.log(1.0005), True)):
        logp = (old[:1] + log_s).requires_grad_(True)
        _, stats = grpo.grpo_loss(logp, old[:1], torch.ones(1), torch.ones(1, 3), gspo)
        assert stats["clip"] == (1.0 if clipped else 0.0)


def test_the_sequence_level_refuses_the_readings_with_a_per_token_weight(tmp_path, capsys):
    """--pi-old tis and tis-mask weight each token by its own rho: one line before any work, nothing written; the
    sequence level at --mu 1 with pi_old the trainer's says it is the token level's update; an unknown level is
    argparse's one line."""
    for reading in ("tis", "tis-mask"):
        with pytest.raises(ValueError, match=rf"^--ratio-level sequence gives each sequence one ratio, but --pi-old "
                                             rf"{reading} weights each token .*: use --pi-old trainer or sampler"):
            grpo.check_args(tg.parse("--ratio-level", "sequence", "--pi-old", reading, "--mu", 2), 1)
    bad.run_case(bad.Case("ratio-sequence-tis", "qerl/train", ["--ratio-level", "sequence", "--pi-old", "tis",
                                                               "--out", "{tmp}/run"],
                          "--ratio-level sequence gives each sequence one ratio, but --pi-old tis"), str(tmp_path / "a"),
                 capsys)
    bad.run_case(bad.Case("ratio-unknown", "qerl/train", ["--ratio-level", "prefix", "--out", "{tmp}/run"],
                          "argument --ratio-level: invalid choice: 'prefix'", code=2), str(tmp_path / "b"), capsys)
    capsys.readouterr()
    grpo.check_ratio_level(tg.parse("--ratio-level", "sequence"))
    assert "note | --ratio-level sequence at --mu 1 with --pi-old trainer" in capsys.readouterr().out
    for quiet in (("--mu", 2), ("--pi-old", "sampler")):
        grpo.check_ratio_level(tg.parse("--ratio-level", "sequence", *quiet))
        assert capsys.readouterr().out == ""


def test_show_step_refuses_what_a_run_at_its_level_refuses():
    """--show-step works a group under the trainer's and the sampler's readings: a level's rule with the other flags
    (--ratio-level sequence with --pi-old tis) is refused there as a run refuses it, before the model loads (before:
    shown without a word)."""
    with pytest.raises(ValueError, match=r"^--ratio-level sequence gives each sequence one ratio, but --pi-old tis "):
        grpo.show_step(tg.parse("--show-step", "--ratio-level", "sequence", "--pi-old", "tis"))


def test_a_two_step_gspo_run_trains_and_records_its_clip_range(tmp_path, capsys):
    """The bundled model, 2 steps at --ratio-level sequence --mu 2: the run line names the level and clip range,
    args.json records GSPO's numbers, the first update of a step with signal trains the adapter, and the second
    sees ratios off 1 (pi_old is the policy before the first; a step's record holds its last update's numbers)."""
    out = tmp_path / "gspo"
    flags = ("--steps", "2", "--ratio-level", "sequence", "--mu", "2", "--eval-size", "0", "--eval-k", "0",
             "--eval-every", "0", "--save-every", "0")
    grpo.train(tg.tiny_args(out, *flags))
    assert "| pi_old trainer | ratio sequence (clip [0.9997, 1.0004]) |" in capsys.readouterr().out
    saved = json.loads((out / "args.json").read_text())
    assert (saved["ratio_level"], saved["eps_low"], saved["eps_high"]) == ("sequence", 3e-4, 4e-4)
    steps, _ = tg.step_rows(out)
    with_signal = [r for r in steps if r["frac_zero_std"] < 1]
    assert len(steps) == 2 and with_signal and all(r["ratio_max"] > 1.0 and r["clip"] > 0 for r in with_signal)
    adapter = load_file(out / "checkpoint-000002" / "adapter_model.safetensors")
    assert any(bool(t.abs().sum() > 0) for k, t in adapter.items() if "lora_B" in k)  # B starts at 0: it trained
    # stopped after step 1 and resumed with no flag: the checkpoint gives the level and its clip range back
    grpo.train(tg.tiny_args(tmp_path / "stopped", *flags, "--stop-at", "1"))
    grpo.train(tg.parse("--resume", tmp_path / "stopped", "--device", "cpu", "--quiet"))
    resumed = load_file(tmp_path / "stopped" / "checkpoint-000002" / "adapter_model.safetensors")
    assert resumed.keys() == adapter.keys() and all(torch.equal(resumed[k], adapter[k]) for k in adapter)
