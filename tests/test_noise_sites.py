"""AQN's noise sites (04 SITES): every site's noise reaches what 05's sampler runs (merged LoRA weights on a CPU),
or the combination is refused, and sigma_applied is the perturbation as it landed, not the draw."""
import importlib

import pytest
import torch

from qerl import tasks
import test_bad_inputs as bad

aqn = importlib.import_module("qerl.aqn")
grpo = importlib.import_module("qerl.train")
rollout = importlib.import_module("qerl.rollout")

SITES = list(aqn.SITES)  # the registry: a new site gets every test here
STEP, SEED, SIGMA = 5, 3, 2e-2


@pytest.fixture(scope="module")
def policy():
    """The bundled tiny model (fp32 base) with a trained-looking adapter (B != 0), and its tokenizer."""
    model, tok = rollout.load_model(grpo.TINY_MODEL, quant="none", device="cpu")
    grpo.lora.add_lora(model, r=4, alpha=8, generator=torch.Generator().manual_seed(0))
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in grpo.lora.lora_parameters(model):
            p.add_(torch.randn(p.shape, generator=gen) * 0.05)
    prompts = [tok.encode(tasks.ArithmeticTask(eval_size=0).prompt({"question": q})) for q in ("12+3-4=?", "70-8=?")]
    return model, tok, prompts


def effective(model):
    """What the model computes with: every parameter, and a norm's gain plus its noise (03 RMSNorm)."""
    out = {n: p.detach().float().clone() for n, p in model.named_parameters()}
    for n, m in model.named_modules():
        if getattr(m, "noise", None) is not None:
            out[n + ".weight"] = m.weight.detach().float() + m.noise
    return out


def logprobs(model, samples):  # (N, T) the model's log-probs of the sampled tokens, at temperature 1
    with torch.inference_mode():
        return rollout.sequence_logprobs(model, samples.prompt_ids, samples.completion_ids, samples.completion_mask,
                                         temperature=1.0, entropy=False)[0].float()


def step_noise(model, site):  # the step's noise exactly as sample_groups draws it
    return aqn.aqn_noise(model, SIGMA, torch.Generator().manual_seed(SEED * 1_000_003 + STEP), site=site)


@pytest.mark.parametrize("site", SITES)
def test_noise_reaches_the_merged_sampler_and_sigma_applied_is_what_landed(policy, site):
    model, tok, prompts = policy
    assert grpo.merge_for_sampling("cpu")  # the CPU sampler runs merged weights W + s B A
    clean = effective(model)
    samples, applied = grpo.sample_groups(model, tok, prompts, STEP, SIGMA, seed=SEED, group=3, max_new_tokens=10,
                                          site=site)
    mask = samples.completion_mask > 0
    # the sampler's log-probs are the unmerged noisy model's (the same tokens scored under the same draw) ...
    with step_noise(model, site) as info:
        inside = effective(model)
        noisy = logprobs(model, samples)
    torch.testing.assert_close(samples.logprobs.float()[mask], noisy[mask], rtol=1e-4, atol=1e-4)
    # ... and not the clean model's: the noise reached the weights the sampler ran
    assert float((samples.logprobs.float() - logprobs(model, samples))[mask].abs().max()) > 1e-3
    # sigma_applied: the RMS of (the tensors computed with) - (the clean ones), over exactly the site's tensors
    moved = [k for k in clean if not torch.equal(clean[k], inside[k])]
    assert set(moved) == {name for name, _ in aqn.SITES[site].find(model)} and len(moved) == info["num_tensors"]
    d = torch.cat([(inside[k] - clean[k]).reshape(-1) for k in moved]).double()
    assert applied == info["applied_std"] == pytest.approx(float(d.pow(2).mean().sqrt()), rel=1e-12)
    assert applied == pytest.approx(SIGMA, rel=0.1) and info["site"] == site
    after = effective(model)
    assert all(torch.equal(after[k], clean[k]) for k in clean)  # clean again, bit for bit


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


def test_lora_sites_refused_inside_merged_weights_and_on_a_model_without_adapters(policy):
    model, _, prompts = policy
    before = effective(model)
    with torch.inference_mode(), grpo.merged_sampling_weights(model):
        with pytest.raises(ValueError, match=r"AQN noise on lora_B inside 02's lora_merged would miss"):
            with step_noise(model, "lora-B"):
                pass
    after = effective(model)
    assert all(torch.equal(v, after[k]) for k, v in before.items())
    bare = rollout.CausalLM(rollout.ModelConfig(vocab_size=96, hidden_size=32, intermediate_size=64, head_dim=8,
                                                num_attention_heads=4, num_key_value_heads=2))  # no adapters
    with pytest.raises(ValueError, match=r"AQN site on lora_A needs LoRA adapters \(02 add_lora\)"):
        with step_noise(bare, "lora-A"):
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
             "--aqn-site lora-B is read only with --aqn, which this run does not have: drop --aqn-site"),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_bad_site_flags(case, tmp_path, capsys):
    bad.run_case(case, tmp_path, capsys)
