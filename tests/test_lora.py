"""Stage 02 (LoRA) tests: exactness at init and when disabled, only adapters train, PEFT file
layout, save/load round trip, merging, and clear errors on bad input. Runs in a few seconds."""
import copy
import importlib
import json
import math
import os
import re

import pytest
import torch
import torch.nn as nn
from safetensors.torch import load_file

lora = importlib.import_module("qerl.lora")


def quant_module():
    """Stage 01, or a skip while it does not exist yet (any other import error fails loudly)."""
    try:
        return importlib.import_module("qerl.quantize")
    except ModuleNotFoundError as e:
        if e.name != "qerl.quantize":
            raise
        pytest.skip("qerl/quantize.py not present")


def weight_formats():
    """01's registry of weight formats (a new one gets the quantized tests below), or none without 01."""
    try:
        return list(importlib.import_module("qerl.quantize").WEIGHT_FORMATS)
    except ModuleNotFoundError as e:
        if e.name != "qerl.quantize":
            raise
        return []


class Block(nn.Module):
    """HF-like names: self_attn.{q,v,o}_proj and mlp.{up,down}_proj, plus a norm that must stay frozen."""

    def __init__(self, d, h):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.self_attn = nn.Module()
        self.self_attn.q_proj, self.self_attn.v_proj = nn.Linear(d, d), nn.Linear(d, d, bias=False)
        self.self_attn.o_proj = nn.Linear(d, d)
        self.mlp = nn.Module()
        self.mlp.up_proj, self.mlp.down_proj = nn.Linear(d, h), nn.Linear(h, d)

    def forward(self, x):
        a = self.norm(x)
        x = x + self.self_attn.o_proj(self.self_attn.q_proj(a) * self.self_attn.v_proj(a))
        return x + self.mlp.down_proj(torch.relu(self.mlp.up_proj(self.norm(x))))


class Tiny(nn.Module):
    def __init__(self, d=32, h=64, n=2):
        super().__init__()
        self.layers = nn.ModuleList(Block(d, h) for _ in range(n))
        self.lm_head = nn.Linear(d, 16)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(x)


TARGETS = ("q_proj", "v_proj", "o_proj", "up_proj", "down_proj")


def make(d=32, seed=0, r=4, **kw):
    torch.manual_seed(seed)
    base = Tiny(d)
    model = lora.add_lora(copy.deepcopy(base), r=r, alpha=8, targets=TARGETS,
                          generator=torch.Generator().manual_seed(seed), **kw)
    return base, model


def randomize_B(model, seed=1):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, t in lora.lora_state_dict(model).items():
            if name.endswith("lora_B"):
                t.copy_(0.1 * torch.randn(t.shape, generator=g))


def x_batch(d=32, seed=2):
    return torch.randn(3, 5, d, generator=torch.Generator().manual_seed(seed))  # (B, T, d)


# -----------------------------------------------------------------------------


def test_wraps_targets_and_freezes_everything_else():
    _, model = make()
    wrapped = [n for n, m in model.named_modules() if isinstance(m, lora.LoRALinear)]
    assert len(wrapped) == 2 * len(TARGETS)
    assert isinstance(model.lm_head, nn.Linear)  # not a target
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all(re.search(r"\.lora_[AB]$", n) for n in trainable)
    m = model.layers[0].self_attn.q_proj
    assert m.lora_A.shape == (4, 32) and m.lora_B.shape == (32, 4)
    assert m.lora_A.dtype == m.lora_B.dtype == torch.float32
    assert m.scaling == 8 / 4 and torch.count_nonzero(m.lora_B) == 0
    bound = 1 / math.sqrt(32)  # kaiming_uniform(a=sqrt(5)) on [r, in]
    assert m.lora_A.abs().max() <= bound and m.lora_A.abs().max() > 0.5 * bound
    _, rs = make(use_rslora=True)
    assert rs.layers[0].mlp.up_proj.scaling == pytest.approx(8 / math.sqrt(4))


def test_output_equals_base_at_init():
    base, model = make()
    x = x_batch()
    assert torch.equal(model(x), base(x))


def test_one_step_changes_only_adapters():
    base, model = make()
    frozen = {k: v.clone() for k, v in model.state_dict().items() if "lora_" not in k}
    opt = torch.optim.AdamW(lora.lora_parameters(model), lr=1e-2, weight_decay=0.0)
    A0 = model.layers[0].mlp.up_proj.lora_A.detach().clone()
    for step in range(2):  # step 1 moves B only (A's grad is 0 while B = 0), step 2 moves A too
        opt.zero_grad()
        model(x_batch(seed=step)).pow(2).mean().backward()
        for n, p in model.named_parameters():
            assert (p.grad is not None) == ("lora_" in n), n
        opt.step()
    for k, v in model.state_dict().items():
        if "lora_" not in k:
            assert torch.equal(v, frozen[k]), k
    assert torch.count_nonzero(model.layers[0].mlp.up_proj.lora_B) > 0
    assert not torch.equal(model.layers[0].mlp.up_proj.lora_A, A0)


def test_lora_disabled_is_bit_exact_and_restores_flags():
    base, model = make()
    randomize_B(model)
    x = x_batch()
    assert not torch.equal(model(x), base(x))
    with lora.lora_disabled(model):
        assert torch.equal(model(x), base(x))
    assert not torch.equal(model(x), base(x))
    with pytest.raises(RuntimeError):
        with lora.lora_disabled(model):
            raise RuntimeError("boom")
    assert not any(m.disabled for m in model.modules() if isinstance(m, lora.LoRALinear))


def test_bf16_activations_keep_fp32_adapters():
    torch.manual_seed(0)
    lin = nn.Linear(32, 48).to(torch.bfloat16)
    m = lora.LoRALinear(lin, r=4, alpha=8)
    with torch.no_grad():
        m.lora_B.normal_()
    x = torch.randn(2, 32, dtype=torch.bfloat16, requires_grad=True)
    y = m(x)
    assert y.dtype == torch.bfloat16 and m.lora_A.dtype == torch.float32
    ref = lin(x).float() + (x.float() @ m.lora_A.t() @ m.lora_B.t()) * 2.0
    # the branch runs in bf16 (A and B cast from their fp32 masters): within bf16's rounding of the exact sum
    torch.testing.assert_close(y.float(), ref, rtol=2e-2, atol=2e-2 * float(ref.detach().abs().max()))
    y.float().sum().backward()
    assert m.lora_A.grad.dtype == torch.float32 and x.grad.dtype == torch.bfloat16


def test_dropout_only_in_train_mode():
    _, model = make(dropout=0.5)
    randomize_B(model)
    x = x_batch()
    model.train()
    torch.manual_seed(0)
    a = model(x)
    torch.manual_seed(1)
    assert not torch.equal(a, model(x))
    model.eval()
    e = model(x)
    assert torch.equal(e, model(x))
    _, nodrop = make(dropout=0.0)
    nodrop.load_state_dict(model.state_dict())
    assert torch.equal(e, nodrop(x))


def test_save_layout_is_peft(tmp_path):
    _, model = make()
    randomize_B(model)
    lora.save_adapter(model, str(tmp_path), base_model_name_or_path="Qwen/Qwen2.5-0.5B")
    assert sorted(os.listdir(tmp_path)) == ["adapter_config.json", "adapter_model.safetensors"]
    tensors = load_file(str(tmp_path / "adapter_model.safetensors"))
    want = {f"base_model.model.layers.{i}.{mod}.{p}.weight"
            for i in range(2) for mod in ("self_attn.q_proj", "self_attn.v_proj", "self_attn.o_proj",
                                          "mlp.up_proj", "mlp.down_proj") for p in ("lora_A", "lora_B")}
    assert set(tensors) == want
    assert tensors["base_model.model.layers.1.mlp.down_proj.lora_A.weight"].shape == (4, 64)
    assert tensors["base_model.model.layers.1.mlp.down_proj.lora_B.weight"].shape == (32, 4)
    assert all(t.dtype == torch.float32 for t in tensors.values())
    cfg = json.load(open(tmp_path / "adapter_config.json"))
    assert {k: cfg[k] for k in ("peft_type", "task_type", "r", "lora_alpha", "lora_dropout", "target_modules",
                                "bias", "use_rslora", "base_model_name_or_path")} == {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": 4, "lora_alpha": 8, "lora_dropout": 0.0,
        "target_modules": ["down_proj", "o_proj", "q_proj", "up_proj", "v_proj"], "bias": "none",
        "use_rslora": False, "base_model_name_or_path": "Qwen/Qwen2.5-0.5B"}
    assert cfg["fan_in_fan_out"] is False and cfg["modules_to_save"] is None


def test_save_load_roundtrip_is_exact(tmp_path):
    base, model = make()
    opt = torch.optim.AdamW(lora.lora_parameters(model), lr=1e-2)
    for step in range(3):
        opt.zero_grad()
        model(x_batch(seed=step)).pow(2).mean().backward()
        opt.step()
    lora.save_adapter(model, str(tmp_path))
    x = x_batch()
    fresh = lora.add_lora(copy.deepcopy(base), r=4, alpha=8, targets=TARGETS)  # different random A
    lora.load_adapter(fresh, str(tmp_path))
    assert torch.equal(fresh(x), model(x))
    auto = lora.load_adapter(copy.deepcopy(base), str(tmp_path))  # unwrapped model: wraps from config
    assert torch.equal(auto(x), model(x))


def test_modules_to_save_roundtrip_in_peft_layout(tmp_path):
    # trained norms (LayerNorm weight and bias here) are saved under PEFT's modules_to_save keys and
    # come back exactly; a folder without them loads as before; a missing tensor is one clear error
    base, model = make()
    randomize_B(model)
    with torch.no_grad():
        for layer in model.layers:
            layer.norm.weight.add_(torch.randn(32, generator=torch.Generator().manual_seed(3)))
            layer.norm.bias.add_(0.5)
    lora.save_adapter(model, str(tmp_path / "a"), modules_to_save=["norm"])
    cfg = json.load(open(tmp_path / "a" / "adapter_config.json"))
    assert cfg["modules_to_save"] == ["norm"]
    saved = load_file(str(tmp_path / "a" / "adapter_model.safetensors"))
    assert {k for k in saved if "lora_" not in k} == {f"base_model.model.layers.{i}.norm.{p}"
                                                       for i in range(2) for p in ("weight", "bias")}
    x = x_batch()
    fresh = lora.load_adapter(copy.deepcopy(base), str(tmp_path / "a"))
    assert torch.equal(fresh(x), model(x))
    assert torch.equal(fresh.layers[1].norm.bias, model.layers[1].norm.bias)
    with pytest.raises(ValueError, match="match no module"):
        lora.save_adapter(model, str(tmp_path / "b"), modules_to_save=["no_such_norm"])
    from safetensors.torch import save_file
    del saved["base_model.model.layers.0.norm.bias"]
    save_file(saved, str(tmp_path / "a" / "adapter_model.safetensors"))
    with pytest.raises(ValueError, match="modules_to_save"):
        lora.load_adapter(copy.deepcopy(base), str(tmp_path / "a"))


def test_merge_float_base_matches_unmerged():
    _, model = make()
    randomize_B(model)
    x = x_batch()
    y = model(x)
    merged = lora.merge_lora(model)
    assert not any(isinstance(m, lora.LoRALinear) for m in merged.modules())
    assert type(merged.layers[0].self_attn.q_proj) is nn.Linear
    torch.testing.assert_close(merged(x), y, rtol=1e-5, atol=1e-5)


# -----------------------------------------------------------------------------
# Bad input


def test_target_matching_nothing():
    with pytest.raises(ValueError, match=r"qq_proj.*available leaf names.*'q_proj'"):
        lora.add_lora(Tiny(), targets=("q_proj", "qq_proj"))


def test_rank_zero():
    with pytest.raises(ValueError, match="rank r must be a positive integer, got r=0"):
        lora.add_lora(Tiny(), r=0, targets=TARGETS)


def test_adapter_from_another_model(tmp_path):
    _, small = make(d=32)
    lora.save_adapter(small, str(tmp_path))
    _, big = make(d=48)
    with pytest.raises(ValueError, match=r"lora_A\.weight has shape \[4, 32\] but model module "
                                         r"layers\.0\.self_attn\.q_proj expects \[4, 48\]: was it trained on another"):
        lora.load_adapter(big, str(tmp_path))
    other = lora.add_lora(Tiny(32), r=4, alpha=8, targets=("q_proj", "v_proj"))
    with pytest.raises(ValueError, match=r"targets \['down_proj'.*wrap \['q_proj', 'v_proj'\]"):
        lora.load_adapter(other, str(tmp_path))


def test_missing_folder(tmp_path):
    _, model = make()
    with pytest.raises(FileNotFoundError, match="does not exist"):
        lora.load_adapter(model, str(tmp_path / "nope"))
    with pytest.raises(FileNotFoundError, match="no adapter_config.json"):
        lora.load_adapter(model, str(tmp_path))


# -----------------------------------------------------------------------------
# Quantized bases (stage 01)


def test_nvfp4_base_trains_only_adapters():
    q = quant_module()
    torch.manual_seed(0)
    base = q.quantize_model(Tiny(), fmt="nvfp4", skip=())
    model = lora.add_lora(copy.deepcopy(base), r=4, alpha=8, targets=TARGETS)
    assert isinstance(model.layers[0].self_attn.q_proj.base, q.NVFP4Linear)
    x = x_batch()
    assert torch.equal(model(x), base(x))
    buffers = {k: v.clone() for k, v in model.named_buffers()}
    opt = torch.optim.AdamW(lora.lora_parameters(model), lr=1e-2)
    for step in range(2):
        opt.zero_grad()
        model(x_batch(seed=step)).pow(2).mean().backward()
        opt.step()
    for k, v in model.named_buffers():
        assert torch.equal(v, buffers[k]), k
    assert not torch.equal(model(x), base(x))
    with lora.lora_disabled(model):
        assert torch.equal(model(x), base(x))


@pytest.mark.parametrize("fmt", weight_formats())
def test_merge_quantized_reports_requantization_error(capsys, fmt):
    q = quant_module()
    torch.manual_seed(0)
    model = lora.add_lora(q.quantize_model(Tiny(), fmt=fmt, skip=()), r=4, alpha=8, targets=TARGETS)
    bias = model.layers[0].self_attn.q_proj.base.bias.clone()
    randomize_B(model)
    x = x_batch()
    y = model(x)
    lora.merge_lora(model)
    out = capsys.readouterr().out
    q_proj = model.layers[0].self_attn.q_proj
    assert type(q_proj) is q.WEIGHT_FORMATS[fmt]
    assert torch.equal(dict(q_proj.named_buffers())["bias"], bias)  # bias kept, still a buffer
    err = float(re.search(r"merge error .* mean (\S+) \| max (\S+)", out).group(2))
    assert math.isfinite(err) and 0 < err < 0.2  # 4-bit rounding is ~10% relative RMS
    rel = (model(x) - y).norm() / y.norm()
    assert rel < 0.2


@pytest.mark.parametrize("fmt", ["float", *weight_formats()])
@pytest.mark.parametrize("keep", [False, True])
def test_lora_merged_equals_the_plain_forward(fmt, keep):
    # lora_merged (sampling) runs each layer as one F.linear of W + scaling * B A; the plain forward is
    # W x + scaling * B (A x). The same function up to fp32 rounding; a disabled layer stays the base.
    torch.manual_seed(0)
    base = Tiny() if fmt == "float" else quant_module().quantize_model(Tiny(), fmt=fmt, skip=())
    if fmt != "float":
        quant_module().keep_dequantized(base, keep)
    model = lora.add_lora(base, r=4, alpha=8, targets=TARGETS, generator=torch.Generator().manual_seed(0))
    randomize_B(model)
    x = x_batch()                                                            # (B, T, d)
    with torch.no_grad():
        y = model(x)                                                         # (B, T, 16)
        with lora.lora_merged(model):
            y_merged = model(x)
            assert all(m.merged is not None for _, m in lora._lora_layers(model))
        assert all(m.merged is None for _, m in lora._lora_layers(model))  # unmerged on exit
        torch.testing.assert_close(y_merged, y, rtol=1e-5, atol=1e-6)
        with lora.lora_disabled(model):
            assert not torch.allclose(model(x), y, rtol=1e-3, atol=1e-3)     # the adapters do change y
        q_proj = model.layers[0].self_attn.q_proj
        q_proj.disabled = True
        with lora.lora_merged(model):
            assert q_proj.merged is None
            torch.testing.assert_close(q_proj(x), q_proj.base(x), rtol=0, atol=0)


@pytest.mark.parametrize("fmt", list(importlib.import_module("qerl.quantize").WEIGHT_FORMATS))
def test_the_demo_learns_on_every_registered_format(fmt, capsys):
    # python -m qerl.lora --quant takes the registry's formats: each one's frozen base learns through LoRA
    first, last = lora.demo(steps=40, seed=0, device="cpu", fmt=fmt)
    assert last < 0.5 * first
    assert f"merged into {fmt.upper()}" in capsys.readouterr().out
