"""Stage 04: the AQN schedule equals its formula, the noise acts where it should and nowhere else,
and the gains come back bit for bit."""
import importlib
import math
import os
import sys

import pytest
import torch
import torch.nn.functional as F

aqn = importlib.import_module("qerl.aqn")
rollout = importlib.import_module("qerl.rollout")
quantize = importlib.import_module("qerl.quantize")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))
landing = importlib.import_module("bench_aqn_landing")  # landed_noise: the measurement behind a docs/aqn.md table


def tiny_model(seed=0, hidden=64, layers=2, dtype=torch.float32):
    cfg = rollout.ModelConfig(model_type="qwen2", vocab_size=96, hidden_size=hidden, intermediate_size=128,
                              num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                              head_dim=hidden // 4, max_position_embeddings=128, tie_word_embeddings=True,
                              attention_bias=True)
    torch.manual_seed(seed)
    model = rollout.CausalLM(cfg)
    with torch.no_grad():  # gains away from 1 so that the sigma/|w| law is tested on varied |w|
        for name, p in model.named_parameters():
            if name.endswith("layernorm.weight"):
                p.copy_(torch.empty_like(p).uniform_(0.2, 2.0))
            elif p.dim() > 1:
                p.normal_(0, 0.1)
    return model.to(dtype).eval()


# -----------------------------------------------------------------------------
# the schedule

@pytest.mark.parametrize("total,K,s0,s1", [(600, 10, 1e-2, 5e-4), (100, 10, 5e-2, 5e-4), (37, 4, 1e-2, 1e-4), (10, 10, 1e-2, 1e-3)])
def test_exp_schedule_matches_formula_at_every_step(total, K, s0, s1):
    for step in range(total):
        stage = min(step * K // total, K - 1)
        want = 0.0 if stage == 0 else s0 * (s1 / s0) ** ((stage - 1) / (K - 2))
        got = aqn.sigma_schedule(step, total, s0, s1, K, "exp")
        assert got == pytest.approx(want, rel=1e-12, abs=0)
    assert aqn.sigma_schedule(0, total, s0, s1, K) == 0.0  # stage 0: quantization noise only
    assert aqn.sigma_schedule(total - 1, total, s0, s1, K) == pytest.approx(s1, rel=1e-12)  # last stage = sigma_end
    first_noisy = next(s for s in range(total) if aqn.sigma_schedule(s, total, s0, s1, K) > 0)
    assert aqn.sigma_schedule(first_noisy, total, s0, s1, K) == pytest.approx(s0, rel=1e-12)


def test_stages_are_even_and_the_paper_example():
    # 600 steps, 10 stages: 60 steps each; the Table 4 range gives the sequence listed in the facts sheet
    sig = [aqn.sigma_schedule(s, 600, 1e-2, 5e-4, 10) for s in range(600)]
    stages = [sig[60 * k] for k in range(10)]
    assert all(sig[60 * k + j] == stages[k] for k in range(10) for j in range(60))
    want = [0, 1e-2, 6.88e-3, 4.73e-3, 3.25e-3, 2.24e-3, 1.54e-3, 1.06e-3, 7.27e-4, 5e-4]
    assert stages == pytest.approx(want, rel=3e-3)


@pytest.mark.parametrize("kind", list(aqn.DECAYS))  # the registry: a new decay gets this test
def test_every_decay_runs_from_start_to_end_monotonically(kind):
    sig = [aqn.sigma_schedule(s, 200, 2e-2, 1e-3, 10, kind) for s in range(200)]
    assert sig[0] == 0.0
    noisy = sig[20:]
    assert noisy[0] == pytest.approx(2e-2) and noisy[-1] == pytest.approx(1e-3)
    assert all(a >= b for a, b in zip(noisy, noisy[1:]))
    if kind == "linear":  # equal steps between stages
        stages = sorted(set(noisy), reverse=True)
        gaps = [a - b for a, b in zip(stages, stages[1:])]
        assert gaps == pytest.approx([gaps[0]] * len(gaps))


def test_none_kind_and_bad_settings():
    assert all(aqn.sigma_schedule(s, 50, kind="none") == 0.0 for s in range(50))
    with pytest.raises(ValueError, match="sigma must be >= 0"):
        aqn.sigma_schedule(5, 50, sigma_start=-1e-2)
    with pytest.raises(ValueError, match="sigma_end .* must be <= sigma_start"):
        aqn.sigma_schedule(5, 50, sigma_start=1e-3, sigma_end=1e-2)
    with pytest.raises(ValueError, match="unknown AQN kind"):
        aqn.sigma_schedule(5, 50, kind="no-such-kind")
    assert set(aqn.DECAYING_KINDS) == set(aqn.DECAYS) and {"exp", "none", "feedback"} <= set(aqn.SIGMA_KINDS)
    with pytest.raises(ValueError, match="FeedbackSigma"):
        aqn.sigma_schedule(5, 50, kind="feedback")
    with pytest.raises(ValueError, match="outside"):
        aqn.sigma_schedule(50, 50)


def test_the_trainers_choices_are_the_registries_with_the_papers_entry_first():
    """--aqn-kind, --aqn-scale and --aqn-site offer exactly what DECAYS, NOISES and SITES hold (a new entry is
    a choice without editing a list), the official code's entry first and default."""
    from qerl import train
    actions = train.build_parser()._option_string_actions
    assert aqn.DECAYING_KINDS == tuple(aqn.DECAYS) and aqn.SIGMA_KINDS == aqn.DECAYING_KINDS + ("none", "feedback")
    for flag, registry, first in (("--aqn-kind", aqn.SIGMA_KINDS, "exp"), ("--aqn-scale", aqn.NOISES, "absolute"),
                                  ("--aqn-site", aqn.SITES, "norms")):
        assert list(actions[flag].choices) == list(registry) and list(registry)[0] == first == actions[flag].default


def test_check_schedule_refuses_what_sigma_schedule_refuses_before_any_step():
    assert aqn.check_schedule(600, 10, 1e-2, 5e-4, "exp") is None
    assert aqn.check_schedule(1, 2, 1e-2, 5e-4, "none") is None
    with pytest.raises(ValueError) as early:
        aqn.check_schedule(50, 1, 1e-2, 5e-4, "exp")  # 05 accepts --num-stages 1; its run would fail at step 0
    with pytest.raises(ValueError) as late:
        aqn.sigma_schedule(0, 50, 1e-2, 5e-4, num_stages=1)
    assert str(early.value) == str(late.value) and "\n" not in str(early.value)
    assert str(early.value).startswith("AQN needs num_stages >= 2 (got 1): stage 0 is noise-free")
    with pytest.raises(ValueError, match="num_stages >= 2"):
        aqn.check_schedule(50, 1, 1e-2, 5e-4, "none")  # sigma_schedule reads the stage for kind none too
    with pytest.raises(ValueError, match="total_steps >= 1"):
        aqn.check_schedule(0, 10, 1e-2, 5e-4, "exp")
    with pytest.raises(ValueError, match="sigma_end .* must be <= sigma_start"):
        aqn.check_schedule(50, 10, 1e-3, 1e-2, "exp")
    with pytest.raises(ValueError, match="unknown AQN kind"):
        aqn.check_schedule(50, 10, 1e-2, 5e-4, "no-such-kind")


def test_feedback_controller_is_bounded_and_moves_the_right_way():
    ctl = aqn.FeedbackSigma(target_entropy=0.2, sigma_init=1e-2, up=2.0, down=0.5, sigma_min=1e-3, sigma_max=4e-2)
    assert ctl.update(0.1) == pytest.approx(2e-2)  # entropy below target: more noise
    assert ctl.update(0.1) == pytest.approx(4e-2)
    assert ctl.update(0.1) == pytest.approx(4e-2)  # clamped at the ceiling
    for _ in range(10):
        ctl.update(0.5)  # entropy above target: less noise, down to the floor
    assert ctl.sigma == pytest.approx(1e-3)
    assert ctl.update(float("nan")) == pytest.approx(1e-3)  # ignores a broken measurement
    state = ctl.state_dict()
    other = aqn.FeedbackSigma(0.2)
    other.load_state_dict(state)
    assert other.sigma == ctl.sigma
    with pytest.raises(ValueError):
        aqn.FeedbackSigma(0.2, up=0.5)

# -----------------------------------------------------------------------------
# the noise


def gains(model):
    return {n: p.detach().clone() for n, p in model.named_parameters() if n.endswith("layernorm.weight")}


def noises(model):
    return {n: m.noise.clone() for n, m in model.named_modules() if getattr(m, "noise", None) is not None}


PRE_NORMS = {f"model.layers.{i}.{k}" for i in range(2) for k in ("input_layernorm", "post_attention_layernorm")}


@pytest.mark.parametrize("kind", list(aqn.NOISES))  # the registry: a new noise kind gets this test
def test_noise_changes_logits_and_hits_exactly_the_pre_norms(kind):
    model = tiny_model()
    ids = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(1))
    clean = model(ids)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    global_rng = torch.get_rng_state()
    with aqn.aqn_noise(model, 1e-2, torch.Generator().manual_seed(0), kind=kind) as info:
        noisy = model(ids)
        inside = {n: p.detach().clone() for n, p in model.named_parameters()}
        z = noises(model)
    assert torch.equal(torch.get_rng_state(), global_rng)  # it draws from the generator it is given only
    with aqn.aqn_noise(model, 1e-2, torch.Generator().manual_seed(0), kind=kind):
        assert all(torch.equal(v, z[n]) for n, v in noises(model).items())  # a seed fixes every draw
    assert info["num_tensors"] == 4
    if kind == "absolute":  # Z ~ N(0, sigma^2)
        assert info["applied_std"] == pytest.approx(1e-2, rel=0.2)
    assert set(z) == PRE_NORMS  # never model.norm (nor Qwen3's q/k norms)
    assert all(v.dtype == torch.float32 and v.shape == (64,) for v in z.values())
    rms = math.sqrt(sum(float((v * v).sum()) for v in z.values()) / sum(v.numel() for v in z.values()))
    assert info["applied_std"] == pytest.approx(rms, rel=1e-6)  # it reports the draw it applied
    assert not torch.allclose(clean, noisy)
    assert all(torch.equal(before[n], inside[n]) for n in before)  # no weight is written, not even the gains
    assert not noises(model) and torch.equal(model(ids), clean)


def test_noise_kinds_registry_holds_absolute_and_refuses_an_unknown_kind():
    assert "absolute" in aqn.NOISES and all(callable(f) for f in aqn.NOISES.values())
    model = tiny_model()
    with pytest.raises(ValueError, match=r"unknown AQN noise kind 'relativ'; choose one of absolute"):
        with aqn.aqn_noise(model, 1e-2, torch.Generator().manual_seed(0), kind="relativ"):
            pass
    assert not noises(model)


def test_default_noise_kind_is_the_hand_written_gaussian_draw_bit_for_bit():
    # Z = N(0, 1) * sigma in fp32, one draw per pre-norm in aqn_norms' order from the one generator
    model, sigma = tiny_model(layers=3), 3e-2
    gen = torch.Generator().manual_seed(11)
    want = [torch.randn(64, generator=gen, dtype=torch.float32) * sigma for _ in range(6)]
    after = torch.randn(5, generator=gen)  # the generator's state after the six draws
    for kind in ({}, {"kind": "absolute"}):
        gen = torch.Generator().manual_seed(11)
        with aqn.aqn_noise(model, sigma, gen, **kind):
            got = [m.noise.clone() for _, m in aqn.aqn_norms(model)]
        assert all(g.dtype == torch.float32 and torch.equal(g, w) for g, w in zip(got, want)) and len(got) == 6
        assert torch.equal(torch.randn(5, generator=gen), after)  # no draw more, none less
    z = aqn.NOISES["absolute"](model.model.layers[0].input_layernorm.weight, sigma, torch.Generator().manual_seed(11))
    assert z.shape == (64,) and z.dtype == torch.float32 and torch.equal(z, want[0])


def test_relative_noise_scales_every_column_by_one_plus_sigma_times_a_normal_draw():
    """--aqn-scale relative: Z_i = sigma |w_i| N(0, 1) from the same draws as the absolute kind, so the column
    factor 1 + Z_i / w_i is 1 +- sigma N(0, 1) whatever the gain (here gains from 0.02 to 2)."""
    model, sigma = tiny_model(layers=1), 1e-2
    with torch.no_grad():
        for _, m in aqn.aqn_norms(model):
            m.weight.copy_(torch.linspace(0.02, 2.0, m.weight.numel()) * torch.tensor([1.0, -1.0]).repeat(32))
    gen = torch.Generator().manual_seed(5)
    draws = [torch.randn(64, generator=gen, dtype=torch.float32) for _ in range(2)]
    with aqn.aqn_noise(model, sigma, torch.Generator().manual_seed(5), kind="relative"):
        got = [(m.noise.clone(), m.weight.detach().float()) for _, m in aqn.aqn_norms(model)]
    for (z, w), eps in zip(got, draws):
        torch.testing.assert_close(z, sigma * w.abs() * eps, rtol=1e-6, atol=0)
        torch.testing.assert_close((z / w).abs(), sigma * eps.abs(), rtol=1e-6, atol=0)  # the gain drops out


def test_noisy_norm_computes_w_plus_z_in_fp32():
    # fp32: exactly the old in-place (w + Z) * rmsnorm(x); the noise acts as (1 + Z / w) per channel
    model = tiny_model()
    ids = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(1))
    with aqn.aqn_noise(model, 3e-2, torch.Generator().manual_seed(3)):
        noisy = model(ids)
        z = noises(model)
    with torch.no_grad():
        for n, m in model.named_modules():
            if n in z:
                m.weight.add_(z[n])
    assert torch.equal(model(ids), noisy)


def test_relative_gain_change_matches_sigma_over_w():
    model = tiny_model(hidden=256, layers=4)
    before = gains(model)
    sigma = 3e-2
    with aqn.aqn_noise(model, sigma, torch.Generator().manual_seed(3)):
        z = noises(model)
    # (w + Z) / w - 1 = Z / w: divided by sigma / |w| it must be a standard normal sample
    u = torch.cat([(z[n] / before[n + ".weight"]) / (sigma / before[n + ".weight"].abs())
                   * before[n + ".weight"].sign() for n in z])
    assert u.numel() == 4 * 2 * 256
    assert abs(float(u.mean())) < 0.1
    assert float(u.std()) == pytest.approx(1.0, abs=0.06)
    assert float((u.abs() < 1).float().mean()) == pytest.approx(0.6827, abs=0.04)


@pytest.mark.parametrize("kind", list(aqn.NOISES))
def test_sigma_zero_is_bit_identical(kind):
    model = tiny_model()
    ids = torch.randint(0, 96, (2, 10), generator=torch.Generator().manual_seed(2))
    clean = model(ids)
    with aqn.aqn_noise(model, 0.0, torch.Generator().manual_seed(0), kind=kind) as info:
        assert torch.equal(model(ids), clean)
    assert info["applied_std"] == 0.0


@pytest.mark.parametrize("wdtype, xdtype", [(torch.bfloat16, torch.bfloat16), (torch.float16, torch.float16),
                                            (torch.float32, torch.float32), (torch.float32, torch.bfloat16)])
def test_fp32_product_with_zero_noise_is_bit_identical(wdtype, xdtype):
    # the noisy path with Z = 0 gives the noise-free forward bit for bit (a product of two 16-bit
    # floats is exact in fp32, so rounding it once is the 16-bit product)
    norm = rollout.RMSNorm(512, 1e-6)
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(512, generator=gen) * 3 - 1)
    norm = norm.to(wdtype)
    x = (torch.randn(4, 33, 512, generator=gen) * 10).to(xdtype)  # (B, T, C)
    want = norm(x)
    norm.noise = torch.zeros(512)
    got = norm(x)
    assert got.dtype == want.dtype and torch.equal(got, want)
    # and a whole bf16 model under a zero-size draw
    model = tiny_model(dtype=torch.bfloat16)
    ids = torch.randint(0, 96, (2, 10), generator=torch.Generator().manual_seed(2))
    clean = model(ids)
    with aqn.aqn_noise(model, 1e-30, torch.Generator().manual_seed(0)):
        for _, m in aqn.aqn_norms(model):
            m.noise.zero_()
        assert torch.equal(model(ids), clean)


def test_bf16_noise_lands_like_fp32_at_sigma_5e_4():
    # The last stages of 1e-2 -> 5e-4: the same draw reaches the q/k/v and gate/up inputs of a bf16 model
    # at its full size, where adding it to the bf16 gains keeps almost none of it (gains near 1 move in
    # steps of 2^-8 ~ 8 sigma)
    ids = torch.randint(0, 96, (16, 64), generator=torch.Generator().manual_seed(1))
    fits = {}
    for dtype in (torch.float32, torch.bfloat16):
        model = tiny_model(dtype=torch.float32)
        with torch.no_grad():
            for n, p in model.named_parameters():
                if n.endswith("layernorm.weight"):
                    p.copy_(torch.empty_like(p).uniform_(0.9, 1.1))
        model = model.to(dtype)
        for in_gain in (False, True):
            fits[dtype, in_gain] = landing.landed_noise(model, ids, 5e-4, torch.Generator().manual_seed(3), in_gain)
    g32, z = fits[torch.float32, False]
    torch.testing.assert_close(g32, z, rtol=0, atol=1e-7)  # fp32: all of it, exactly
    g16, z16 = fits[torch.bfloat16, False]
    assert torch.equal(z16, z)  # the same draw in both dtypes
    size = float(g16.norm() / z.norm())
    cos = float(F.cosine_similarity(g16, z, 0))
    assert 0.85 < size < 1.25 and cos > 0.85  # the asked size, along the draw (bf16 rounding dithers it)
    old, _ = fits[torch.bfloat16, True]
    assert float(old.norm() / z.norm()) < 0.05  # noise added to the bf16 gains rounds away


def test_gains_bit_identical_after_many_steps_and_after_an_exception():
    model = tiny_model(dtype=torch.bfloat16)
    start = gains(model)
    gen = torch.Generator().manual_seed(0)
    for step in range(2000):
        with aqn.aqn_noise(model, aqn.sigma_schedule(step, 2000, 5e-2, 5e-4), gen):
            pass
    with pytest.raises(RuntimeError, match="boom"):
        with aqn.aqn_noise(model, 1e-1, gen):
            raise RuntimeError("boom")
    end = gains(model)
    assert all(torch.equal(start[n], end[n]) for n in start)
    assert not noises(model)


def test_trained_gains_get_noise_on_their_current_value_and_keep_their_gradient():
    # with stage 05's --train-norms the gains change every step: the noise must sit on the current
    # value and leave it exactly as it was
    model = tiny_model(dtype=torch.bfloat16)
    ids = torch.randint(0, 96, (2, 10), generator=torch.Generator().manual_seed(2))
    norm = model.model.layers[1].input_layernorm
    with torch.no_grad():
        norm.weight.add_(0.125)  # a "trained" value
    trained = norm.weight.detach().clone()
    with aqn.aqn_noise(model, 1e-2, torch.Generator().manual_seed(0)):
        z = norm.noise.clone()
        x = torch.randn(3, 64, generator=torch.Generator().manual_seed(9)).to(torch.bfloat16)
        h = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + norm.eps)
        torch.testing.assert_close(norm(x), ((trained.float() + z) * h.to(torch.bfloat16).float()).to(torch.bfloat16),
                                   rtol=0, atol=0)
        norm.weight.requires_grad_(True)
        model(ids).sum().backward()  # the gain still trains under noise: gradient w.r.t. w, not w + Z
        assert norm.weight.grad is not None and torch.isfinite(norm.weight.grad).all()
    assert torch.equal(norm.weight.detach(), trained)


def test_same_seed_same_noise():
    model = tiny_model()
    with aqn.aqn_noise(model, 1e-2, torch.Generator().manual_seed(7)):
        a = noises(model)
    with aqn.aqn_noise(model, 1e-2, torch.Generator().manual_seed(7)):
        b = noises(model)
    with aqn.aqn_noise(model, 1e-2, torch.Generator().manual_seed(8)):
        c = noises(model)
    assert all(torch.equal(a[n], b[n]) for n in a)
    assert not all(torch.equal(a[n], c[n]) for n in a)


def test_bad_input():
    model = tiny_model()
    with pytest.raises(ValueError, match="sigma must be a finite number >= 0"):
        with aqn.aqn_noise(model, -1e-3):
            pass
    with pytest.raises(ValueError, match="input_layernorm"):
        with aqn.aqn_noise(torch.nn.Linear(4, 4), 1e-2):
            pass


class GemmaLikeLayer(rollout.DecoderLayer):
    # a third norm at layer level (Gemma's post-feedforward norm): the two names no longer say where noise lands
    def __init__(self, cfg, layer_idx):
        super().__init__(cfg, layer_idx)
        self.post_feedforward_layernorm = rollout.RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, mask, kv_cache=None):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask, kv_cache)  # (B, T, C)
        return x + self.post_feedforward_layernorm(self.mlp(self.post_attention_layernorm(x)))


class RenamedLayer(rollout.DecoderLayer):
    # the norm feeding gate/up under another name: AQN would find only one of its two norms
    def __init__(self, cfg, layer_idx):
        super().__init__(cfg, layer_idx)
        self.pre_feedforward_layernorm = self.post_attention_layernorm
        del self.post_attention_layernorm

    def forward(self, x, cos, sin, mask, kv_cache=None):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask, kv_cache)  # (B, T, C)
        return x + self.mlp(self.pre_feedforward_layernorm(x))


def with_layers(model, cls):
    for i, layer in enumerate(model.model.layers):
        new = cls(model.config, i)
        new.load_state_dict(layer.state_dict(), strict=False)
        model.model.layers[i] = new
    return model


def test_norms_are_the_two_pre_norms_of_every_layer_in_order():
    model = tiny_model(layers=3)
    got = aqn.aqn_norms(model)
    assert [n for n, _ in got] == ["model.layers.0.input_layernorm", "model.layers.0.post_attention_layernorm",
                                   "model.layers.1.input_layernorm", "model.layers.1.post_attention_layernorm",
                                   "model.layers.2.input_layernorm", "model.layers.2.post_attention_layernorm"]
    want = [n for l in model.model.layers for n in (l.input_layernorm, l.post_attention_layernorm)]
    assert len(got) == 6 and all(m is w for (_, m), w in zip(got, want))
    assert all(model.get_submodule(n) is m for n, m in got)
    assert model.model.norm not in [m for _, m in got]


def test_a_layer_without_both_norms_or_with_another_is_an_error_and_qwen3_qk_norms_are_not():
    with pytest.raises(ValueError, match=r"model\.layers\.0 \(RenamedLayer\) lacks: post_attention_layernorm; "
                                         r"has other norms: pre_feedforward_layernorm"):
        aqn.aqn_norms(with_layers(tiny_model(), RenamedLayer))
    model = with_layers(tiny_model(), GemmaLikeLayer)
    with pytest.raises(ValueError, match=r"model\.layers\.0 \(GemmaLikeLayer\) lacks: nothing; "
                                         r"has other norms: post_feedforward_layernorm"):
        with aqn.aqn_noise(model, 1e-2):
            pass
    assert not noises(model)
    cfg = rollout.ModelConfig(model_type="qwen3", vocab_size=96, hidden_size=64, intermediate_size=128,
                              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                              max_position_embeddings=128, qk_norm=True)
    torch.manual_seed(0)
    qwen3 = rollout.CausalLM(cfg).eval()
    ids = torch.randint(0, 96, (1, 6), generator=torch.Generator().manual_seed(1))
    clean = qwen3(ids)
    with aqn.aqn_noise(qwen3, 1e-2, torch.Generator().manual_seed(0)) as info:
        assert set(noises(qwen3)) == PRE_NORMS and info["num_tensors"] == 4  # no noise on q_norm / k_norm
        assert not torch.allclose(qwen3(ids), clean)


def test_noise_acts_on_a_quantized_model_too():
    model = quantize.quantize_model(tiny_model(), fmt="nvfp4")
    ids = torch.randint(0, 96, (1, 8), generator=torch.Generator().manual_seed(4))
    clean = model(ids)
    packed = {n: b.clone() for n, b in model.named_buffers() if n.endswith("weight_packed")}
    with aqn.aqn_noise(model, 2e-2, torch.Generator().manual_seed(0)):
        noisy = model(ids)
        assert all(torch.equal(packed[n], b) for n, b in model.named_buffers() if n in packed)
    assert (noisy - clean).abs().max() > 1e-4
    assert torch.equal(model(ids), clean)


def test_measure_exploration_rows():
    base = tiny_model()
    nvfp4 = quantize.quantize_model(tiny_model(), fmt="nvfp4")
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8]]
    rows = aqn.measure_exploration(base, {"base": base, "NVFP4": nvfp4}, prompts, num_samples=4,
                                   max_new_tokens=6, sigmas=(5e-2,), rounds=1)
    assert [(r["name"], r["sigma"]) for r in rows] == [("base", 0.0), ("NVFP4", 0.0), ("base", 5e-2), ("NVFP4", 5e-2)]
    assert rows[0]["kl"] == pytest.approx(0.0, abs=1e-6)  # the reference against itself
    assert rows[1]["kl"] > 1e-6 and rows[2]["kl"] > 1e-6
    assert all(r["entropy"] > 0 and math.isfinite(r["entropy"]) and r["len"] == 6 for r in rows)


# -----------------------------------------------------------------------------
# the command line's work


@pytest.mark.parametrize("total,K", [(600, 10), (7, 10), (10, 10), (37, 4), (1, 2), (101, 3)])
def test_stage_steps_are_the_steps_of_each_stage(total, K):
    want = {}
    for s in range(total):
        want.setdefault(aqn.sigma_stage(s, total, K), []).append(s)
    assert aqn.stage_steps(total, K) == [(k, v[0], v[-1]) for k, v in sorted(want.items())]


def test_schedule_table_of_a_huge_run_has_one_row_per_stage(capsys):
    total, K = 100_000_000, 10
    assert aqn.stage_steps(total, K)[-1] == (9, 90_000_000, 99_999_999)
    aqn.print_schedule(total, 1e-2, 5e-4, K)
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2 + K  # title, header, one row per stage
    assert lines[3].split("|")[1].split() == ["10000000", "-", "19999999"]
    assert float(lines[3].split("|")[2]) == pytest.approx(1e-2) and float(lines[-1].split("|")[2]) == pytest.approx(5e-4)


def test_default_run_is_the_quick_table_and_flags_override_the_presets():
    args = aqn.parse_args([])
    assert (args.prompts, args.samples, args.sigmas, args.dtypes, args.threads) == (32, 8, [1e-2, 5e-2], ["float32"], 1)
    args = aqn.parse_args(["--full"])
    assert (args.prompts, args.samples, args.sigmas, args.dtypes) == (64, 8, [5e-4, 1e-2, 5e-2], ["float32", "bfloat16"])
    args = aqn.parse_args(["--full", "--dtypes", "float32", "--prompts", "5", "--sigmas"])
    assert (args.prompts, args.samples, args.sigmas, args.dtypes) == (5, 8, [], ["float32"])


def test_quant_method_picks_the_nvfp4_rows_rounding():
    assert aqn.parse_args([]).quant_method == "rtn"
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "assets", "tiny-qwen")
    _, rtn, _ = aqn.demo_models(path, torch.float32, 0, 1)
    _, four, _ = aqn.demo_models(path, torch.float32, 0, 1, method="4over6")
    a, b = (v["NVFP4"].model.layers[0].self_attn.q_proj for v in (rtn, four))
    torch.testing.assert_close(a.weight_global_scale * 256 / 448, b.weight_global_scale)  # 4over6: 256 * 6 / amax
    assert not torch.equal(a.weight_scale.view(torch.uint8), b.weight_scale.view(torch.uint8))
    assert torch.equal(rtn["NF4"].model.layers[0].mlp.up_proj.weight_packed, four["NF4"].model.layers[0].mlp.up_proj.weight_packed)


def test_negative_threads_is_refused_before_any_work(capsys):
    with pytest.raises(SystemExit):
        aqn.parse_args(["--threads", "-1"])
    assert "argument --threads: -1 is out of range: need >= 0" in capsys.readouterr().err


def test_schedule_only_prints_the_table_without_a_model(capsys):
    assert aqn.main(["--schedule-only", "--steps", "100", "--model", "/no/such/folder"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[1].split("|")[2:] and [c.strip() for c in out[1].split("|")[2:]] == list(aqn.DECAYING_KINDS)
    assert len(out) == 2 + 10 and out[2].split("|")[1].strip() == "0 - 9"  # one row per stage, no measurement
