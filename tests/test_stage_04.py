"""Stage 04 (04_aqn.py) against the trainer's qerl/aqn.py: the exp schedule at every step, the
noise each gain gets from the same generator, the logits under it, the gains restored bit for bit,
measure_exploration's rows; the demo's defaults are 05's, and the demo prints the schedule."""

import importlib
import subprocess
import sys
from pathlib import Path

import pytest
import torch

qa = importlib.import_module("qerl.aqn")
ro = importlib.import_module("qerl.rollout")
train = importlib.import_module("qerl.train")
aqn = importlib.import_module("04_aqn")
st = importlib.import_module("03_rollout")
ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "assets" / "tiny-qwen"


# the trainer's --plain path (what 03 and 04 must equal bit for bit), on one thread (tests/conftest.py)
pytestmark = pytest.mark.usefixtures("trainer_plain_path", "one_thread")


@pytest.fixture(scope="module")
def models():
    """qerl's and 03's tiny-qwen, full precision and NVFP4."""
    return {
        q: (ro.load_model(TINY, q, torch.float32, "cpu")[0], st.load_model(TINY, q)[0])
        for q in ("none", "nvfp4")
    }


def test_defaults_are_05s():
    args = train.build_parser().parse_args([])
    assert aqn.SCHEDULE_STEPS == args.steps == 750
    ours = (aqn.SIGMA_START, aqn.SIGMA_END, aqn.NUM_STAGES)
    assert ours == (args.sigma_start, args.sigma_end, args.num_stages)


SETTINGS = [(750, 10, 1e-2, 5e-4), (600, 10, 1e-2, 5e-4), (7, 3, 5e-2, 1e-3), (101, 2, 1e-2, 1e-2)]


@pytest.mark.parametrize("total,K,s0,s1", SETTINGS)
def test_sigma_schedule_equals_qerl_at_every_step(total, K, s0, s1):
    ours = [aqn.sigma_schedule(t, total, s0, s1, K) for t in range(total)]
    assert ours == [qa.sigma_schedule(t, total, s0, s1, K, kind="exp") for t in range(total)]
    assert ours[0] == 0.0 and ours[-1] == s1 and max(ours) == s0
    if total == 750:  # 10 stages of 75 steps, each one sigma
        assert all(len(set(ours[75 * k : 75 * k + 75])) == 1 for k in range(10))
        assert ours[75] == 1e-2 and ours[74] == 0.0 and len(set(ours)) == 10


def test_sigma_schedule_refuses_bad_settings():
    for bad in [(750, 750), (-1, 750), (0, 0)]:
        with pytest.raises(ValueError, match="sigma_schedule needs"):
            aqn.sigma_schedule(*bad)
    with pytest.raises(ValueError, match="num_stages >= 2"):
        aqn.sigma_schedule(0, 10, num_stages=1)
    with pytest.raises(ValueError, match="sigma_end <= sigma_start"):
        aqn.sigma_schedule(0, 10, 1e-3, 1e-2)


@pytest.mark.parametrize("quant", ["none", "nvfp4"])
@pytest.mark.parametrize("sigma", [5e-4, 5e-2])
def test_noise_logits_and_restore_equal_qerl(models, quant, sigma):
    a, b = models[quant]
    ids = torch.randint(0, 280, (2, 9), generator=torch.Generator().manual_seed(0))
    gains = {n: p.detach().clone() for n, p in b.named_parameters() if "norm" in n}
    with torch.no_grad():
        clean = b(ids)
    ga, gb = torch.Generator().manual_seed(11), torch.Generator().manual_seed(11)
    with qa.aqn_noise(a, sigma, ga) as info_a, aqn.aqn_noise(b, sigma, gb) as info_b:
        norms_a, norms_b = qa.aqn_norms(a), aqn.aqn_norms(b)
        assert [n for n, _ in norms_a] == [n for n, _ in norms_b] and len(norms_b) == 8
        for (_, na), (_, nb) in zip(norms_a, norms_b):
            assert torch.equal(na.noise, nb.noise) and nb.noise.dtype == torch.float32
        assert info_b["applied_std"] == info_a["applied_std"] > 0
        assert abs(info_b["applied_std"] / sigma - 1) < 0.1  # 8 x 128 draws: ~2.5% spread
        assert info_b["num_tensors"] == 8 and info_b["sigma"] == sigma
        with torch.no_grad():
            noisy = b(ids)
            assert torch.equal(noisy, a(ids)) and not torch.equal(noisy, clean)
        assert torch.equal(torch.rand(3, generator=ga), torch.rand(3, generator=gb))  # same draws
    assert all(n.noise is None for _, n in aqn.aqn_norms(b))
    for n, p in b.named_parameters():
        if "norm" in n:
            assert torch.equal(p, gains[n])
    with torch.no_grad():
        assert torch.equal(b(ids), clean)


def test_noise_is_removed_after_an_error_and_sigma_0_draws_nothing(models):
    b = models["none"][1]
    with pytest.raises(RuntimeError, match="inside"):
        with aqn.aqn_noise(b, 1e-2, torch.Generator().manual_seed(0)):
            assert all(n.noise is not None for _, n in aqn.aqn_norms(b))
            raise RuntimeError("inside")
    assert all(n.noise is None for _, n in aqn.aqn_norms(b))
    gen = torch.Generator().manual_seed(4)
    with aqn.aqn_noise(b, 0.0, gen) as info:
        assert info["applied_std"] == 0.0 and all(n.noise is None for _, n in aqn.aqn_norms(b))
    assert torch.equal(gen.get_state(), torch.Generator().manual_seed(4).get_state())
    with pytest.raises(ValueError, match="finite number >= 0"):
        with aqn.aqn_noise(b, -1.0):
            pass


def test_measure_exploration_equals_qerl(models):
    (a0, b0), (a4, b4) = models["none"], models["nvfp4"]
    tok = st.load_tokenizer(TINY, {})
    prompts = aqn.arithmetic_prompts(tok, 3, seed=0)
    kw = dict(num_samples=4, max_new_tokens=16, sigmas=[5e-2], seed=1, eos_token_ids=[283, 281])
    ours = aqn.measure_exploration(b0, {"base": b0, "NVFP4": b4}, prompts, **kw)
    assert ours == qa.measure_exploration(a0, {"base": a0, "NVFP4": a4}, prompts, **kw)
    assert [(r["name"], r["sigma"]) for r in ours] == [
        ("base", 0.0),
        ("NVFP4", 0.0),
        ("base", 5e-2),
        ("NVFP4", 5e-2),
    ]
    assert ours[0]["kl"] == 0.0 and all(r["kl"] > 0 and r["entropy"] > 0 for r in ours[1:])


def test_demo_prints_the_schedule_and_the_table():
    flags = "--prompts 2 --samples 2 --max-new-tokens 8 --sigmas 1e-2 --rounds 1".split()
    command = [sys.executable, str(ROOT / "04_aqn.py"), *flags]
    out = subprocess.run(command, capture_output=True, text=True, timeout=120, check=True).stdout
    assert "AQN schedule for a 750-step run (10 stages, 0.01 -> 0.0005, exp decay)" in out
    for k in range(10):
        sigma = aqn.sigma_schedule(75 * k, 750)
        assert f"{k:>5} | {75 * k:>4} - {75 * k + 74:<4} | {sigma:>9.3e}" in out
    rows = [
        line.split(" | ")[:2] for line in out.splitlines() if line.startswith(("base", "NVFP4"))
    ]
    assert [[n.strip(), s.strip()] for n, s in rows] == [
        ["base", "0e+00"],
        ["NVFP4", "0e+00"],
        ["base", "1e-02"],
        ["NVFP4", "1e-02"],
    ]
