"""AQN's noise sites (04 SITES): every site's noise reaches what 05's sampler runs, judged from the sampler's own
log-probs on the default CPU path (an NVFP4 base, its dequantized weights kept, merged LoRA weights), and is gone
bit for bit at sigma 0; or the combination is refused; and sigma_applied is the perturbation as it landed."""
import importlib

import pytest
import torch

from qerl import tasks
import test_bad_inputs as bad

aqn = importlib.import_module("qerl.aqn")
grpo = importlib.import_module("qerl.train")
rollout = importlib.import_module("qerl.rollout")
quantize = importlib.import_module("qerl.quantize")

SITES = list(aqn.SITES)  # the registry: a new site gets every test here
STEP, SEED, SIGMA = 5, 3, 2e-2
GENERATE = rollout.generate  # the sampler's own, wrapped below


@pytest.fixture(scope="module")
def policy(one_thread):
    """The bundled tiny model as a default run builds it on a CPU (05's build_policy: an NVFP4 base whose
    dequantized weights are kept, LoRA adapters), the adapter made trained-looking (B != 0), and its tokenizer."""
    args = grpo.build_parser().parse_args(["--device", "cpu"])
    model, tok, _, _ = grpo.build_policy(args, "cpu")
    layers = [m for m in model.modules() if isinstance(m, quantize.NVFP4Linear)]
    assert args.quant == "nvfp4" and layers and all(m.kept == {} for m in layers)  # the CPU keeps W
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in grpo.lora.lora_parameters(model):
            p.add_(torch.randn(p.shape, generator=gen) * 0.05)
    prompts = [tok.encode(tasks.ArithmeticTask(eval_size=0).prompt({"question": q})) for q in ("12+3-4=?", "70-8=?")]
    return model, tok, prompts


def state(model):
    """Every tensor the model computes with, as stored (dtype included), and each norm's noise (03 RMSNorm)."""
    out = {n: (t.dtype, t.detach().clone()) for n, t in model.state_dict(keep_vars=True).items()}
    out.update({n + ".noise": getattr(m, "noise", None) for n, m in model.named_modules()})
    return out


def same_state(a, b):
    return a.keys() == b.keys() and all(
        (x is None and y is None) if not isinstance(x, tuple) else (x[0] == y[0] and torch.equal(
            x[1].view(torch.uint8) if x[0] == torch.float8_e4m3fn else x[1],
            y[1].view(torch.uint8) if y[0] == torch.float8_e4m3fn else y[1])) for x, y in zip(a.values(), b.values()))


def logprobs(model, samples):  # (N, T) the model's log-probs of the sampled tokens, at temperature 1
    with torch.inference_mode():
        return rollout.sequence_logprobs(model, samples.prompt_ids, samples.completion_ids, samples.completion_mask,
                                         temperature=1.0, entropy=False)[0].float()


def step_noise(model, site):  # the step's noise exactly as sample_groups draws it
    return aqn.aqn_noise(model, SIGMA, torch.Generator().manual_seed(SEED * 1_000_003 + STEP), site=site)


def sampler_logprobs(model, tok, prompts, fixed, step, sigma, site, monkeypatch):
    """05's sampler at `step` under `sigma` (sample_groups: the noise, then merged weights, then generate) ->
    (the log-probs its weights give `fixed`'s tokens, scored inside it as its generate is called; sigma_applied).
    Its own sampled tokens' log-probs must be those weights' too: what is scored is what it sampled with."""
    seen = {}

    def generate(model, *args, **kwargs):
        seen["merged"] = all(m.merged is not None for m in model.modules() if isinstance(m, grpo.lora.LoRALinear))
        seen["fixed"] = logprobs(model, fixed)
        out = GENERATE(model, *args, **kwargs)
        seen["own"] = logprobs(model, out)
        return out
    monkeypatch.setattr(grpo.rollout, "generate", generate)
    samples, applied = grpo.sample_groups(model, tok, prompts, step, sigma, seed=SEED, group=3, max_new_tokens=10,
                                          site=site)
    monkeypatch.setattr(grpo.rollout, "generate", GENERATE)
    mask = samples.completion_mask > 0
    assert seen["merged"]  # the CPU sampler runs merged weights W + s B A
    torch.testing.assert_close(samples.logprobs.float()[mask], seen["own"][mask], rtol=1e-4, atol=1e-4)
    return seen["fixed"], applied


@pytest.mark.parametrize("site", SITES)
def test_the_sampler_runs_each_sites_noise_and_is_clean_again_at_sigma_0(policy, site, monkeypatch):
    """Under sigma > 0 the log-probs the sampler gives fixed tokens move (the noise reached the weights it ran),
    the same draw for the same step and another the next step; at sigma 0 they are the clean ones bit for bit,
    and so is every tensor of the model (a stale cache, a noise never taken off, fails here)."""
    model, tok, prompts = policy
    assert grpo.merge_for_sampling("cpu")
    fixed, _ = grpo.sample_groups(model, tok, prompts, 0, 0.0, seed=SEED, group=3, max_new_tokens=10)
    mask = fixed.completion_mask > 0
    before = state(model)

    def run(step, sigma):
        return sampler_logprobs(model, tok, prompts, fixed, step, sigma, site, monkeypatch)
    clean, applied0 = run(STEP, 0.0)
    noisy, applied = run(STEP, SIGMA)
    other, _ = run(STEP + 1, SIGMA)  # straight after, no clean forward between (a step without an update)
    again, _ = run(STEP, SIGMA)
    clean_again, _ = run(STEP + 1, 0.0)
    moved = float((noisy - clean)[mask].abs().mean())
    assert moved > 1e-3, f"{site}: the noise did not reach the sampler (mean |d log p| {moved:.2e})"
    assert float((other - noisy)[mask].abs().max()) > 1e-4  # a fresh draw each step
    assert torch.equal(again[mask], noisy[mask])  # the step's draw, seeded: the same weights again
    assert torch.equal(clean_again[mask], clean[mask]) and applied0 == 0.0
    assert applied == pytest.approx(SIGMA, rel=0.1)  # the RMS of what landed
    assert same_state(state(model), before)


@pytest.mark.parametrize("site", SITES)
def test_sigma_applied_is_the_rms_of_what_landed(policy, site):
    """sigma_applied: the RMS of the perturbation each of the site's tensors received, as it landed (a norm's
    gain: Z; a LoRA matrix: its fp32 change; a block scale: its relative change, held in fp32)."""
    model, _, _ = policy
    found = aqn.SITES[site].find(model)
    before = {name: aqn.SITES[site].weight(m).detach().float().clone() for name, m in found}
    scales = {name: m.weight_scale.float() for name, m in found if site == "block-scales"}
    with step_noise(model, site) as info:
        landed = []
        for name, m in found:
            if site == "norms":
                landed.append(m.noise)
            elif site == "block-scales":
                assert m.weight_scale.dtype == torch.float32  # the noisy scales, not rounded to E4M3
                landed.append(m.weight_scale / scales[name] - 1)
            else:
                landed.append(aqn.SITES[site].weight(m).detach().float() - before[name])
    d = torch.cat([t.reshape(-1) for t in landed]).double()
    assert info["num_tensors"] == len(found) and info["site"] == site
    assert info["applied_std"] == pytest.approx(float(d.pow(2).mean().sqrt()), rel=1e-6)
    assert info["applied_std"] == pytest.approx(SIGMA, rel=0.1)


@pytest.mark.parametrize("site", SITES)
def test_noise_entered_inside_merged_weights_reaches_them_or_is_refused(policy, site):
    """The other order (the fork's bug: merged weights built before the noise): a site either still reaches the
    model as it runs, or refuses with one line, never reports a draw that the sampler did not see."""
    model, tok, prompts = policy
    ids = torch.tensor([prompts[0]])  # (1, P)
    with torch.inference_mode():
        with step_noise(model, site):
            want = model(ids)  # the unmerged noisy model
        clean = model(ids)
        with grpo.merged_sampling_weights(model):
            try:
                with step_noise(model, site) as info:
                    got = model(ids)
            except ValueError as e:
                assert "lora_merged" in str(e) and "enter aqn_noise first" in str(e)
                return
    assert info["applied_std"] > 0 and not torch.allclose(got, clean, rtol=0, atol=1e-4)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_weight_sites_refused_inside_merged_weights_and_on_a_model_without_their_tensors(policy):
    model, _, prompts = policy
    before = state(model)
    with torch.inference_mode(), grpo.merged_sampling_weights(model):
        with pytest.raises(ValueError, match=r"AQN noise on lora_B inside 02's lora_merged would miss"):
            with step_noise(model, "lora-B"):
                pass
        with pytest.raises(ValueError, match=r"AQN noise on block scales inside 02's lora_merged would miss"):
            with step_noise(model, "block-scales"):
                pass
    assert same_state(state(model), before)
    bare = rollout.CausalLM(rollout.ModelConfig(vocab_size=96, hidden_size=32, intermediate_size=64, head_dim=8,
                                                num_attention_heads=4, num_key_value_heads=2))  # no adapters
    with pytest.raises(ValueError, match=r"AQN site on lora_A needs LoRA adapters \(02 add_lora\)"):
        with step_noise(bare, "lora-A"):
            pass
    with pytest.raises(ValueError, match=r"AQN site block-scales needs an NVFP4 base \(--quant nvfp4\)"):
        with step_noise(quantize.quantize_model(bare, fmt="nf4"), "block-scales"):
            pass
    with pytest.raises(ValueError, match=r"unknown AQN noise site 'no-such-site'; choose one of norms, lora-A"):
        with step_noise(bare, "no-such-site"):
            pass


def test_the_default_site_is_the_norms_draw_for_draw():
    # --aqn-site norms (the default) draws what aqn_noise drew before sites existed: one N(0, 1) vector per
    # pre-norm in aqn_norms' order, times sigma, set as the norm's `noise`
    assert grpo.build_parser().parse_args([]).aqn_site == "norms" == next(iter(aqn.SITES))
    model, _ = rollout.load_model(grpo.TINY_MODEL, quant="none", device="cpu")
    gen = torch.Generator().manual_seed(11)
    want = [torch.randn(m.weight.shape, generator=gen) * SIGMA for _, m in aqn.aqn_norms(model)]
    with aqn.aqn_noise(model, SIGMA, torch.Generator().manual_seed(11)):
        got = [m.noise.clone() for _, m in aqn.aqn_norms(model)]
    assert len(got) == len(want) and all(torch.equal(g, w) for g, w in zip(got, want))


CASES = [
    bad.Case("05-aqn-site-unknown", "qerl/train", ["--aqn-site", "no-such-site", *bad.RUN],
             "invalid choice: 'no-such-site'", code=2),
    bad.Case("05-aqn-site-without-aqn", "qerl/train", ["--aqn-site", "lora-B", "--no-aqn", *bad.RUN],
             "--aqn-site lora-B is read only with --aqn with an --aqn-kind other than none, which this run does not "
             "have: drop --aqn-site"),
    # no noise (--aqn-kind none) reads no site; block scales times 1 + Z are relative already: neither flag would
    # count, and args.json would record it as if it had
    bad.Case("05-aqn-site-without-noise", "qerl/train", ["--aqn-site", "block-scales", "--aqn-kind", "none",
             "--quant", "none", *bad.RUN], "--aqn-site block-scales is read only with --aqn with an --aqn-kind other "
             "than none, which this run does not have: drop --aqn-site"),
    bad.Case("05-aqn-scale-at-block-scales", "qerl/train", ["--aqn-site", "block-scales", "--aqn-scale", "relative",
             *bad.RUN], "--aqn-scale relative is read only with --aqn with an --aqn-kind other than none, at an "
             "--aqn-site other than block-scales, which this run does not have: drop --aqn-scale"),
    bad.Case("05-aqn-site-block-scales-unquantized", "qerl/train", ["--aqn-site", "block-scales", "--quant", "none",
             *bad.RUN], "--aqn-site block-scales puts the noise on NVFP4's block scales: it needs --quant nvfp4"),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_bad_site_flags(case, tmp_path, capsys):
    bad.run_case(case, tmp_path, capsys)
