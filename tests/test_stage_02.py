"""02_lora.py against the trainer's qerl.lora (on qerl.quantize's plain path, _QuantLinear.fast = False):
the same seeded adapters, forwards and gradients bit for bit, the merged forward, and PEFT's files
written byte for byte alike and read by each other.

    .venv/bin/pytest -x -q tests/test_stage_02.py
"""

import copy
import importlib
import json
import os
import re

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

s01 = importlib.import_module("01_quantize")
s02 = importlib.import_module("02_lora")
q = importlib.import_module("qerl.quantize")
lora = importlib.import_module("qerl.lora")


@pytest.fixture(autouse=True)
def plain_trainer(monkeypatch):
    monkeypatch.setattr(q._QuantLinear, "fast", False)  # the trainer's --plain path


def perturb_b(model, seed=7):
    """Give every B the same nonzero values in both models (B starts at zero)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in [p for n, p in model.named_parameters() if n.endswith("lora_B")]:
            p.copy_(torch.randn(p.shape, generator=g) * 0.05)


def forward_and_grads(model, x0, params):
    x = x0.clone().requires_grad_(True)
    y = model(x)
    y.float().pow(2).sum().backward()
    return [y.detach(), x.grad] + [p.grad for p in params]


@pytest.mark.parametrize("base_kind", ["nvfp4", "linear"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lora_linear_equals_the_trainers(base_kind, dtype):
    torch.manual_seed(0)
    lin = nn.Linear(40, 24, bias=True)  # in_features not a multiple of 16
    if base_kind == "nvfp4":
        ours_base, theirs_base = s01.NVFP4Linear.from_linear(lin), q.NVFP4Linear.from_linear(lin)
    else:
        ours_base, theirs_base = copy.deepcopy(lin), copy.deepcopy(lin)
    ours_base, theirs_base = ours_base.to(dtype), theirs_base.to(dtype)  # a 4-bit W keeps its dtype
    ours = s02.LoRALinear(ours_base, 8, 16, generator=torch.Generator().manual_seed(5))
    theirs = lora.LoRALinear(theirs_base, 8, 16, generator=torch.Generator().manual_seed(5))
    assert torch.equal(ours.lora_A, theirs.lora_A) and torch.equal(ours.lora_B, theirs.lora_B)
    assert not ours.lora_B.any() and ours.scaling == theirs.scaling == 2.0
    assert [n for n, p in ours.named_parameters() if p.requires_grad] == ["lora_A", "lora_B"]
    x = torch.randn(2, 3, 40, generator=torch.Generator().manual_seed(1)).to(dtype)
    with torch.no_grad():  # B = 0: exactly the base layer
        assert torch.equal(ours(x), ours_base(x))
    perturb_b(ours), perturb_b(theirs)
    a = forward_and_grads(ours, x, [ours.lora_A, ours.lora_B])
    b = forward_and_grads(theirs, x, [theirs.lora_A, theirs.lora_B])
    assert all(torch.equal(u, v) for u, v in zip(a, b))
    assert a[2].dtype == torch.float32  # fp32 masters get fp32 gradients


class Toy(nn.Module):
    """A decoder's names (model.layers.i.self_attn.q_proj ...) with a forward through all of them."""

    def __init__(self, h=32, inter=48, layers=2):
        super().__init__()
        self.model = nn.Module()
        self.model.layers = nn.ModuleList()
        for _ in range(layers):
            layer = nn.Module()
            names = ("q_proj", "k_proj", "v_proj", "o_proj")
            layer.self_attn = nn.ModuleDict({n: nn.Linear(h, h, bias=n != "o_proj") for n in names})
            mlp = {"gate_proj": (h, inter), "up_proj": (h, inter), "down_proj": (inter, h)}
            layer.mlp = nn.ModuleDict({n: nn.Linear(*s, bias=False) for n, s in mlp.items()})
            self.model.layers.append(layer)
        self.lm_head = nn.Linear(h, 20, bias=False)

    def forward(self, x):  # (B, h) -> (B, 20)
        for layer in self.model.layers:
            a, m = layer.self_attn, layer.mlp
            x = x + a.o_proj(a.q_proj(x) * a.k_proj(x) + a.v_proj(x))
            x = x + m.down_proj(F.silu(m.gate_proj(x)) * m.up_proj(x))
        return self.lm_head(x)


def model_pair(seed=0, lora_seed=3, r=4, alpha=8):
    """The same Toy, quantized and given LoRA by the stages (ours) and by qerl (theirs)."""
    torch.manual_seed(seed)
    toy = Toy()
    ours = s02.add_lora(
        s01.quantize_model(copy.deepcopy(toy)),
        r,
        alpha,
        generator=torch.Generator().manual_seed(lora_seed),
    )
    theirs = lora.add_lora(
        q.quantize_model(copy.deepcopy(toy)),
        r,
        alpha,
        generator=torch.Generator().manual_seed(lora_seed),
    )
    return ours, theirs


def test_add_lora_equals_the_trainers():
    ours, theirs = model_pair()
    assert [n for n, _ in s02.lora_layers(ours)] == [n for n, _ in lora._lora_layers(theirs)]
    assert len(s02.lora_layers(ours)) == 14 and isinstance(ours.lm_head, nn.Linear)
    po, pt = s02.lora_parameters(ours), lora.lora_parameters(theirs)
    assert len(po) == 28 and all(torch.equal(a, b) for a, b in zip(po, pt))
    trainable = [n for n, p in ours.named_parameters() if p.requires_grad]
    assert trainable == [n for n, p in theirs.named_parameters() if p.requires_grad]
    assert all(n.endswith(("lora_A", "lora_B")) for n in trainable)
    assert s02.count_parameters(ours) == lora.count_parameters(theirs)
    with pytest.raises(ValueError, match="already has LoRA"):
        s02.add_lora(ours)
    with pytest.raises(ValueError, match="match no Linear"):
        s02.add_lora(Toy(), targets=("c_attn",))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_forward_gradients_disabled_and_merged_equal_the_trainers(dtype):
    ours, theirs = model_pair()
    perturb_b(ours), perturb_b(theirs)
    ours, theirs = ours.to(dtype), theirs.to(dtype)  # the bias and lm_head convert; A, B too
    x = torch.randn(5, 32, generator=torch.Generator().manual_seed(2)).to(dtype)
    a = forward_and_grads(ours, x, s02.lora_parameters(ours))
    b = forward_and_grads(theirs, x, lora.lora_parameters(theirs))
    assert all(torch.equal(u, v) for u, v in zip(a, b))
    with torch.no_grad():
        with s02.lora_disabled(ours), lora.lora_disabled(theirs):
            base = ours(x)
            assert torch.equal(base, theirs(x))
        assert not any(m.disabled for _, m in s02.lora_layers(ours))  # restored
        torch.manual_seed(0)  # the same base, without LoRA: lora_disabled is exactly it
        assert torch.equal(base, s01.quantize_model(Toy()).to(dtype)(x))
        with s02.lora_merged(ours), lora.lora_merged(theirs):
            merged = ours(x)
            assert torch.equal(merged, theirs(x))
        assert all(m.merged is None for _, m in s02.lora_layers(ours))
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(merged, a[0], rtol=tol, atol=tol)
    assert not torch.equal(a[0], base)  # the adapters change the output


def test_adapter_files_equal_the_trainers_and_load_both_ways(tmp_path):
    ours, theirs = model_pair()
    perturb_b(ours), perturb_b(theirs)
    d_ours = s02.save_adapter(ours, str(tmp_path / "ours"), "assets/tiny-qwen")
    d_theirs = lora.save_adapter(theirs, str(tmp_path / "theirs"), "assets/tiny-qwen")
    for name in (s02.WEIGHTS_NAME, s02.CONFIG_NAME):  # byte for byte what the trainer writes
        with (
            open(os.path.join(d_ours, name), "rb") as f,
            open(os.path.join(d_theirs, name), "rb") as g,
        ):
            assert f.read() == g.read(), name
    tensors = load_file(os.path.join(d_ours, "adapter_model.safetensors"))
    pattern = r"base_model\.model\.model\.layers\.\d\.(self_attn|mlp)\.\w+_proj\.lora_[AB]\.weight"
    assert len(tensors) == 28 and all(re.fullmatch(pattern, k) for k in tensors)
    key = "base_model.model.model.layers.1.mlp.down_proj.lora_A.weight"
    assert torch.equal(tensors[key], ours.model.layers[1].mlp.down_proj.lora_A)
    with open(os.path.join(d_ours, "adapter_config.json")) as f:
        cfg = json.load(f)
    assert cfg["peft_type"] == "LORA" and cfg["task_type"] == "CAUSAL_LM" and cfg["bias"] == "none"
    assert (cfg["r"], cfg["lora_alpha"], cfg["base_model_name_or_path"]) == (
        4,
        8,
        "assets/tiny-qwen",
    )
    assert cfg["target_modules"] == sorted(s01.LINEAR_NAMES)
    # ours -> the trainer's load_adapter, and the trainer's -> ours: the same tensors
    torch.manual_seed(0)
    toy = Toy()
    into_theirs = lora.load_adapter(q.quantize_model(copy.deepcopy(toy)), d_ours)
    into_ours = s02.load_adapter(s01.quantize_model(copy.deepcopy(toy)), d_theirs)
    for p, a, b in zip(
        s02.lora_parameters(ours), lora.lora_parameters(into_theirs), s02.lora_parameters(into_ours)
    ):
        assert torch.equal(p, a) and torch.equal(p, b)
    x = torch.randn(3, 32, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        assert torch.equal(into_ours(x), ours(x))
    # into a model that already has LoRA layers of the same shape
    again, _ = model_pair(lora_seed=9)
    s02.load_adapter(again, d_ours)
    assert all(
        torch.equal(a, b) for a, b in zip(s02.lora_parameters(again), s02.lora_parameters(ours))
    )


def test_load_adapter_refuses_what_does_not_fit(tmp_path):
    ours, _ = model_pair()
    folder = s02.save_adapter(ours, str(tmp_path / "a"))
    other_rank, _ = model_pair(r=8, alpha=8)
    with pytest.raises(ValueError, match="r, lora_alpha"):
        s02.load_adapter(other_rank, folder)
    tensors = load_file(os.path.join(folder, s02.WEIGHTS_NAME))
    tensors.pop("base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight")
    save_file(tensors, os.path.join(folder, s02.WEIGHTS_NAME))
    with pytest.raises(ValueError, match="1 tensors missing, extra or misshapen"):
        s02.load_adapter(Toy(), folder)
    cfg_path = os.path.join(folder, s02.CONFIG_NAME)
    with open(cfg_path) as f:
        cfg = json.load(f)
    with open(cfg_path, "w") as f:
        json.dump(dict(cfg, use_dora=True), f)
    with pytest.raises(ValueError, match="not a plain LoRA adapter"):
        s02.load_adapter(Toy(), folder)


def test_demo_fits_merges_and_round_trips(capsys):
    s02.demo(steps=20)
    out = capsys.readouterr().out
    losses = [float(v) for v in re.findall(r"loss (\S+)", out)]
    assert losses[-1] < 0.5 * losses[0]
    assert "the 4-bit base unchanged by training: True" in out
    assert float(re.search(r"vs unmerged: max \|diff\| (\S+)", out).group(1)) < 1e-5
    assert "bit for bit: True" in out
