"""01_quantize.py against the trainer's plain path (qerl.quantize with _QuantLinear.fast = False, method
"rtn") and compressed-tensors' golden bytes: every number bitwise equal.

    .venv/bin/pytest -x -q tests/test_stage_01.py
"""

import copy
import importlib
import os
import re

import pytest
import torch
import torch.nn as nn
from safetensors.torch import load_file

s01 = importlib.import_module("01_quantize")
q = importlib.import_module("qerl.quantize")
DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")
NAMES = ("weight_packed", "weight_scale", "weight_global_scale")


def same(a, b):
    """Bitwise equal tensors (fp8 compared as bytes: torch.equal has no float8 kernel everywhere)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.dtype == torch.float8_e4m3fn:
        a, b = a.view(torch.uint8), b.view(torch.uint8)
    return torch.equal(a, b)


@pytest.fixture(autouse=True)
def plain_trainer(monkeypatch):
    monkeypatch.setattr(q._QuantLinear, "fast", False)  # the trainer's --plain path


def random_weight(shape, dtype, seed):
    """N(0, 0.02^2) with some all-zero blocks, a far-below-amax block and an outlier."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(shape, generator=g) * 0.02
    w[0, : min(16, shape[1])] = 0.0  # an all-zero block (all of a narrow row)
    if shape[0] > 2:
        w[1, :] = 0.0  # an all-zero row
        w[2, : min(16, shape[1])] *= 1e-7  # a block whose FP8 scale underflows to 0 -> 0.125
        w[-1, -1] = 0.5  # one outlier sets the global scale
    return w.to(dtype)


def test_constants_match_the_trainer():
    assert (s01.FP4_MAX, s01.FP8_MAX, s01.NVFP4_BLOCK) == (q.FP4_MAX, q.FP8_MAX, q.NVFP4_BLOCK)
    assert torch.equal(s01.E2M1_VALUES, q.E2M1_VALUES)
    assert torch.equal(s01.E2M1_VALUES.signbit(), q.E2M1_VALUES.signbit())  # -0.0 is code 8
    assert s01.LINEAR_NAMES == q.LINEAR_NAMES


@pytest.mark.parametrize("case", ["gauss_fp32", "special_fp32", "gauss_bf16"])
def test_golden_bytes_of_compressed_tensors(case):
    golden = load_file(os.path.join(DATA, "nvfp4_golden.safetensors"))
    tag = "ct_fp32" if case == "gauss_bf16" else "ct"  # bf16: CT's result on weight.float()
    ours = s01.quantize_nvfp4(golden[f"{case}.weight"])
    for name, t in zip(NAMES, ours):
        assert same(t, golden[f"{case}.{tag}.{name}"]), name


@pytest.mark.parametrize("shape", [(64, 256), (33, 100), (7, 17), (5, 8), (3, 1), (128, 48)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_quantize_and_dequantize_equal_the_trainer(shape, dtype):
    w = random_weight(shape, dtype, seed=sum(shape))
    ours, theirs = s01.quantize_nvfp4(w), q.quantize_nvfp4(w, method="rtn")
    k_pad = -(-shape[1] // 16) * 16
    assert ours[0].shape == (shape[0], k_pad // 2) and ours[1].shape == (shape[0], k_pad // 16)
    assert all(same(a, b) for a, b in zip(ours, theirs))
    for out_dtype in (torch.float32, torch.bfloat16):
        assert same(s01.dequantize_nvfp4(*ours, out_dtype), q.dequantize_nvfp4(*theirs, out_dtype))
    # a shared (fused-group) global scale, passed in
    gs = s01.nvfp4_global_scale([w, 3 * w])
    assert same(gs, q.nvfp4_global_scale([w, 3 * w], method="rtn"))
    assert all(same(a, b) for a, b in zip(s01.quantize_nvfp4(w, gs), q.quantize_nvfp4(w, gs)))


def test_zero_weights_and_ties():
    packed, scale, gs = s01.quantize_nvfp4(torch.zeros(4, 32))
    assert gs.item() == 1.0 and torch.all(scale.float() == 0.125) and torch.all(packed == 0)
    mids = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
    w = torch.tensor([[6.0] + mids + [-m for m in mids] + [-6.0]])  # (1, 16): gs = s = 448, y = w
    packed = s01.quantize_nvfp4(w)[0]
    codes = torch.stack((packed & 0xF, packed >> 4), -1).reshape(-1).tolist()
    assert codes == [7, 0, 2, 2, 4, 4, 6, 6, 8, 10, 10, 12, 12, 14, 14, 15]  # ties to even
    tiny = torch.tensor([[6.0, -0.0, -0.1, 0.1] + [0.0] * 12])
    packed = s01.quantize_nvfp4(tiny)[0]
    assert [packed[0, 0].item() & 0xF, packed[0, 0].item() >> 4, packed[0, 1].item()] == [7, 0, 8]
    with pytest.raises(ValueError, match="finite 2-D"):
        s01.quantize_nvfp4(torch.tensor([[float("nan")] * 16]))


def layer_pair(in_f, out_f, bias, seed=0):
    torch.manual_seed(seed)
    lin = nn.Linear(in_f, out_f, bias=bias)
    return s01.NVFP4Linear.from_linear(lin), q.NVFP4Linear.from_linear(lin)


@pytest.mark.parametrize("in_f,out_f,bias", [(40, 24, True), (64, 16, False), (17, 5, True)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_nvfp4_linear_forward_and_gradients_equal_the_trainer(in_f, out_f, bias, dtype):
    ours, theirs = layer_pair(in_f, out_f, bias)
    assert list(ours.state_dict()) == list(theirs.state_dict())
    assert all(same(a, b) for a, b in zip(ours.state_dict().values(), theirs.state_dict().values()))
    assert same(ours.dequantized_weight(dtype), theirs.dequantized_weight(dtype))
    x0 = torch.randn(2, 3, in_f, generator=torch.Generator().manual_seed(1)).to(dtype)
    for _ in range(2):  # the second forward runs on the kept weight
        outs = []
        for m in (ours, theirs):
            x = x0.clone().requires_grad_(True)
            y = m(x)
            y.pow(2).sum().backward()
            outs.append((y.detach(), x.grad))
        assert same(outs[0][0], outs[1][0]) and same(outs[0][1], outs[1][1])
    assert dtype in ours.kept and not any(p.requires_grad for p in ours.buffers())


def test_kept_weight_survives_inference_mode_and_to():
    ours, theirs = layer_pair(32, 8, True)
    x = torch.randn(4, 32, generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        ours(x)  # the first forward: W_hat built here must still serve a training step
    xg = x.clone().requires_grad_(True)
    ours(xg).sum().backward()
    assert xg.grad is not None
    ours.to(torch.bfloat16)  # the format's buffers keep their dtypes; the bias converts
    theirs.to(torch.bfloat16)
    assert ours.kept == {} and ours.weight_scale.dtype == torch.float8_e4m3fn
    assert all(same(a, b) for a, b in zip(ours.state_dict().values(), theirs.state_dict().values()))
    xb = x.to(torch.bfloat16)
    assert same(ours(xb), theirs(xb))


def test_load_state_dict_from_the_trainer():
    _, theirs = layer_pair(48, 12, True)
    ours = s01.NVFP4Linear(48, 12, bias=True)
    ours.load_state_dict(theirs.state_dict())
    x = torch.randn(3, 48, generator=torch.Generator().manual_seed(4))
    assert same(ours(x), theirs(x))


class Toy(nn.Module):
    """A decoder's names: model.layers.i.self_attn.{q,k,v,o}_proj, mlp.{gate,up,down}_proj, lm_head."""

    def __init__(self, h=32, inter=48, layers=2):
        super().__init__()
        attn = {n: nn.Linear(h, h, bias=n != "o_proj") for n in ("q_proj", "k_proj", "v_proj")}
        self.model = nn.Module()
        self.model.layers = nn.ModuleList()
        for i in range(layers):
            layer = nn.Module()
            layer.self_attn = nn.ModuleDict({**copy.deepcopy(attn), "o_proj": nn.Linear(h, h)})
            scale = 10.0**-i  # layer 1's weights 10x smaller: its own global scale
            mlp = {"gate_proj": (h, inter), "up_proj": (h, inter), "down_proj": (inter, h)}
            layer.mlp = nn.ModuleDict({n: nn.Linear(*s, bias=False) for n, s in mlp.items()})
            with torch.no_grad():
                for p in layer.parameters():
                    p.normal_(0, 0.02 * scale)
                layer.self_attn.k_proj.weight[0, 0] = 0.3 * scale  # k's amax sets the qkv scale
            self.model.layers.append(layer)
        self.lm_head = nn.Linear(h, 40, bias=False)


def test_quantize_model_equals_the_trainer():
    torch.manual_seed(0)
    model = Toy()
    ours, theirs = s01.quantize_model(copy.deepcopy(model)), q.quantize_model(copy.deepcopy(model))
    assert isinstance(ours.lm_head, nn.Linear)  # skipped
    assert list(ours.state_dict()) == list(theirs.state_dict())
    for (k, a), b in zip(ours.state_dict().items(), theirs.state_dict().values()):
        assert same(a, b), k
    for layer in ours.model.layers:  # q/k/v share one scale, gate/up another
        a, m = layer.self_attn, layer.mlp
        assert same(a.q_proj.weight_global_scale, a.k_proj.weight_global_scale)
        assert same(a.v_proj.weight_global_scale, a.k_proj.weight_global_scale)
        assert same(m.gate_proj.weight_global_scale, m.up_proj.weight_global_scale)
        assert not same(a.o_proj.weight_global_scale, a.q_proj.weight_global_scale)
    g0 = ours.model.layers[0].self_attn.q_proj.weight_global_scale
    assert not same(g0, ours.model.layers[1].self_attn.q_proj.weight_global_scale)


def test_the_triton_kernel_equals_the_trainers_and_the_product():
    pytest.importorskip("triton")
    # conftest runs Triton's interpreter on CPU tensors when there is no GPU
    device = "cuda" if torch.cuda.is_available() else "cpu"
    ours, theirs = layer_pair(40, 24, True)
    ours, theirs = ours.to(device), theirs.to(device)
    x = torch.randn(3, 40, generator=torch.Generator().manual_seed(3)).to(device)
    bufs = [ours.weight_packed, ours.weight_scale, ours.weight_global_scale, ours.bias]
    y = s01.nvfp4_kernel()(x, *bufs)
    assert same(y, q.nvfp4_kernel()(x, *bufs))
    ref = nn.functional.linear(x, ours.dequantized_weight(), ours.bias)
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)
    if device == "cuda":  # NVFP4Linear's CUDA forward is the kernel: the trainer's fast path
        theirs.fast = True
        assert same(ours(x), theirs(x))


def test_show_block_prints_the_quantizers_numbers(capsys):
    s01.show_block(3)
    out = capsys.readouterr().out
    w = torch.randn(4, 64, generator=torch.Generator().manual_seed(3)) * 0.02
    packed, scale, gs = q.quantize_nvfp4(w)
    w_hat = q.dequantize_nvfp4(packed, scale, gs)[0, :16]
    assert float(re.search(r"gs = 2688 / amax = (\S+)", out).group(1)) == pytest.approx(gs.item())
    s, byte = re.search(r"s = (\S+) \(byte 0x(\w\w) =", out).groups()
    assert float(s) == scale[0, 0].float().item()
    assert int(byte, 16) == scale[0, 0].view(torch.uint8).item()
    rows = re.findall(r"^ *(\d+) \| \S+ \| +\S+ \| +(\S+) \| 0x(\w) +\| (\S+) \|", out, re.M)
    codes = torch.stack((packed[0, :8] & 0xF, packed[0, :8] >> 4), -1).reshape(-1).tolist()
    assert [int(r[0]) for r in rows] == list(range(16))
    for (i, value, code, wh), c in zip(rows, codes):
        assert int(code, 16) == c and float(value) == q.E2M1_VALUES[c].item()
        assert float(wh) == pytest.approx(w_hat[int(i)].item(), abs=5e-8)
    hexes = re.search(r"low nibble\): ((?:[0-9a-f]{2} ){7}[0-9a-f]{2})", out).group(1)
    assert bytes.fromhex(hexes) == bytes(packed[0, :8].tolist())


def test_demo_table_on_tiny_qwen(capsys):
    s01.demo()
    out = capsys.readouterr().out
    rows = dict(re.findall(r"^(\w+) +\| +\d+ \| +(\S+) \|", out, re.M))
    assert set(rows) == {*s01.LINEAR_NAMES, "all"}
    assert all(4.5 <= float(b) < 4.51 for b in rows.values())  # 4 bits + an 8-bit scale per 16
    err = float(re.search(r"^all .*\| +(\S+) \| +\S+$", out, re.M).group(1))
    assert 0.05 < err < 0.12  # ~0.095 for Gaussian-like weights
    assert "NF4" in out and "tensor cores" in out
