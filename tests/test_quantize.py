"""Stage 01 tests: NVFP4 and NF4 bytes vs golden data from compressed-tensors / bitsandbytes, edge cases
of the format, the quantized Linear modules, fused-group scales, and the checkpoint writer.

    python -m pytest -q tests/test_quantize.py

Golden data (tests/data/) comes from tests/make_nvfp4_golden.py and tests/make_nf4_golden.py.
"""
import copy
import importlib
import json
import shutil
import os
import re
import subprocess
import sys

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

cli = importlib.import_module("qerl.cli")

devices = importlib.import_module("qerl.devices")
q = importlib.import_module("qerl.quantize")
DATA = os.path.join(os.path.dirname(__file__), "data")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NAMES = ("weight_packed", "weight_scale", "weight_global_scale")


def same_bytes(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def codes(packed):
    """uint8 [out, K_pad/2] -> 4-bit codes [out, K_pad] (low nibble first)."""
    return torch.stack((packed & 0xF, packed >> 4), dim=-1).view(packed.shape[0], -1)


# ---------------------------------------------------------------------------------------------------
# NVFP4 vs compressed-tensors golden bytes


@pytest.fixture(scope="module")
def nvfp4_golden():
    return load_file(os.path.join(DATA, "nvfp4_golden.safetensors"))


@pytest.mark.parametrize("case", ["gauss_fp32", "special_fp32"])
def test_nvfp4_matches_compressed_tensors(nvfp4_golden, case):
    ours = q.quantize_nvfp4(nvfp4_golden[f"{case}.weight"])
    for name, t in zip(NAMES, ours):
        assert same_bytes(t, nvfp4_golden[f"{case}.ct.{name}"]), name


def test_nvfp4_bf16_input_is_upcast_first(nvfp4_golden):
    w = nvfp4_golden["gauss_bf16.weight"]
    assert w.dtype == torch.bfloat16
    ours = q.quantize_nvfp4(w)
    for name, t, t32 in zip(NAMES, ours, q.quantize_nvfp4(w.float())):
        assert same_bytes(t, nvfp4_golden[f"gauss_bf16.ct_fp32.{name}"]), name
        assert same_bytes(t, t32)
    w16 = w.to(torch.float16)  # bf16 -> fp16 is exact here (|w| < 5, no fp16 underflow at this scale)
    assert torch.equal(w16.float(), w.float())
    assert all(same_bytes(a, b) for a, b in zip(q.quantize_nvfp4(w16), ours))


def test_nvfp4_dequant_is_value_times_scale_over_gs(nvfp4_golden):
    packed, scale, gs = q.quantize_nvfp4(nvfp4_golden["gauss_fp32.weight"])
    lut = [0, .5, 1, 1.5, 2, 3, 4, 6]
    c = codes(packed)
    vals = torch.tensor([lut[i & 7] * (-1 if i & 8 else 1) for i in range(16)])[c.long()]
    expect = vals * (scale.float() / gs).repeat_interleave(16, dim=1)
    assert torch.equal(q.dequantize_nvfp4(packed, scale, gs), expect)
    w_hat = q.dequantize_nvfp4(packed, scale, gs)
    w = nvfp4_golden["gauss_fp32.weight"]
    assert ((w_hat - w).norm() / w.norm()).item() < 0.11  # ~0.095 for Gaussian weights
    assert q.dequantize_nvfp4(packed, scale, gs, torch.bfloat16).dtype == torch.bfloat16


# ---------------------------------------------------------------------------------------------------
# NVFP4 edge cases


def test_all_zero_tensor_and_blocks():
    packed, scale, gs = q.quantize_nvfp4(torch.zeros(4, 32))
    assert gs.item() == 1.0                                   # 2688 / tiny -> inf -> 1.0
    assert torch.all(scale.float() == 0.125) and torch.all(packed == 0)
    w = torch.randn(2, 48, generator=torch.Generator().manual_seed(0))
    w[0, 16:32] = 0.0
    packed, scale, gs = q.quantize_nvfp4(w)
    assert scale[0, 1].float().item() == 0.125 and torch.all(codes(packed)[0, 16:32] == 0)


def test_signed_zero_and_small_negatives():
    w = torch.zeros(1, 16)
    w[0, 0] = 6.0      # amax 6 -> gs 448, block scale 448: y == w exactly
    w[0, 1] = -0.0     # -0.0 input -> code 0x0
    w[0, 2] = -0.1     # rounds to zero but keeps its sign -> 0x8
    w[0, 3] = 0.1      # -> 0x0
    c = codes(q.quantize_nvfp4(w)[0])[0]
    assert c[:4].tolist() == [7, 0, 8, 0]


def test_e2m1_midpoints_round_to_even():
    mids = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
    w = torch.tensor([[6.0] + mids + [-m for m in mids] + [-6.0]])   # (1, 16); y == w exactly
    packed, scale, gs = q.quantize_nvfp4(w)
    assert gs.item() == 448.0 and scale.float().item() == 448.0
    # 0.25->0, 0.75->1, 1.25->1, 1.75->2, 2.5->2, 3.5->4, 5->4 (the even mantissa wins each tie)
    expect = [7, 0, 2, 2, 4, 4, 6, 6, 8, 10, 10, 12, 12, 14, 14, 15]
    assert codes(packed)[0].tolist() == expect
    # and just off the midpoints round to the nearer value
    w2 = w.clone()
    w2[0, 1:8] += 1e-3
    assert codes(q.quantize_nvfp4(w2)[0])[0, 1:8].tolist() == [1, 2, 3, 4, 5, 6, 7]


def test_block_far_below_amax_gets_scale_0125():
    w = torch.zeros(1, 48)
    w[0, :16] = 1.0
    w[0, 16:32] = 1e-6    # gs*amax_b/6 = 4.5e-4 < half the smallest fp8 subnormal (2^-9) -> 0 -> 0.125
    w[0, 32:48] = 2e-3    # 0.9: representable as fp8, kept
    packed, scale, gs = q.quantize_nvfp4(w)
    assert scale[0, 1].float().item() == 0.125
    assert torch.all(codes(packed)[0, 16:32] == 0)
    assert torch.all(q.dequantize_nvfp4(packed, scale, gs)[0, 16:32] == 0)
    assert scale[0, 2].float().item() == 0.875  # fp8(0.896) rounds to 0.875 (3 mantissa bits)


def test_shared_global_scale_is_used():
    w = torch.randn(8, 32, generator=torch.Generator().manual_seed(1))
    _, _, gs = q.quantize_nvfp4(w, global_scale=100.0)
    assert gs.dtype == torch.float32 and gs.shape == (1,) and gs.item() == 100.0
    with pytest.raises(ValueError, match="global_scale"):
        q.quantize_nvfp4(w, global_scale=0.0)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_nan_inf_raise_with_name(bad):
    w = torch.randn(4, 32)
    w[1, 3] = bad
    with pytest.raises(ValueError, match="layers.3.mlp.up_proj"):
        q.quantize_nvfp4(w, name="layers.3.mlp.up_proj")
    with pytest.raises(ValueError, match="my.weight"):
        q.quantize_nf4(w, name="my.weight")


def test_rejects_wrong_rank_and_dtype():
    with pytest.raises(ValueError, match="2-D"):
        q.quantize_nvfp4(torch.randn(16))
    with pytest.raises(ValueError, match="dtype"):
        q.quantize_nvfp4(torch.ones(2, 16, dtype=torch.int32))


def test_exact_4p5_bits_accounting():
    for out_f, in_f in [(16, 16), (128, 896), (896, 128), (3, 40)]:
        packed, scale, gs = q.quantize_nvfp4(torch.randn(out_f, in_f))
        k_pad = -(-in_f // 16) * 16
        assert packed.shape == (out_f, k_pad // 2) and packed.dtype == torch.uint8
        assert scale.shape == (out_f, k_pad // 16) and scale.dtype == torch.float8_e4m3fn
        assert gs.shape == (1,) and gs.dtype == torch.float32
        total_bits = 8 * (packed.numel() + scale.numel()) + 32
        assert total_bits == 4.5 * out_f * k_pad + 32     # 4 + 8/16 bits per weight, 4 bytes per tensor


# ---------------------------------------------------------------------------------------------------
# Quantized Linear modules


def test_nvfp4_linear_unpadded_in_features():
    g = torch.Generator().manual_seed(2)
    lin = nn.Linear(40, 24, bias=True)                        # 40 is not a multiple of 16 -> K_pad 48
    m = q.NVFP4Linear.from_linear(lin)
    assert m.weight_packed.shape == (24, 24) and m.weight_scale.shape == (24, 3)
    assert torch.all(codes(m.weight_packed)[:, 40:] == 0)     # the zero padding
    w = m.dequantized_weight()
    assert w.shape == (24, 40)
    x = torch.randn(2, 5, 40, generator=g)
    torch.testing.assert_close(m(x), F.linear(x, w, lin.bias.detach()), rtol=0, atol=0)
    xb = x.to(torch.bfloat16)
    yb = m(xb)
    assert yb.dtype == torch.bfloat16
    torch.testing.assert_close(yb, F.linear(xb, m.dequantized_weight(torch.bfloat16), lin.bias.detach().bfloat16()))


def test_nvfp4_linear_state_dict_and_dtype_safety():
    lin = nn.Linear(32, 16, bias=True)
    m = q.NVFP4Linear.from_linear(lin)
    sd = m.state_dict()
    assert set(sd) == {"weight_packed", "weight_scale", "weight_global_scale", "bias"}
    m2 = q.NVFP4Linear(32, 16, bias=True)
    m2.load_state_dict(sd)
    assert torch.equal(m2.dequantized_weight(), m.dequantized_weight())
    w_before = m.dequantized_weight()
    m.to(torch.bfloat16)                                      # as a whole-model .to(dtype) would
    assert m.weight_scale.dtype == torch.float8_e4m3fn and m.weight_global_scale.dtype == torch.float32
    assert m.bias.dtype == torch.bfloat16
    assert torch.equal(m.dequantized_weight(), w_before)
    assert not list(m.parameters())                           # frozen: nothing for the optimizer


def test_nvfp4_linear_from_checkpoint_tensors():
    lin = nn.Linear(64, 32, bias=False)
    m = q.NVFP4Linear.from_linear(lin)
    tensors = {f"a.b.q_proj.{k}": v for k, v in m.state_dict().items()}
    m2 = q.NVFP4Linear(64, 32)  # an empty shell, filled by checkpoint name as stage 03's loader does
    m2.load_state_dict({k[len("a.b.q_proj."):]: v for k, v in tensors.items()})
    assert m2.in_features == 64 and m2.bias is None
    assert torch.equal(m2.dequantized_weight(), m.dequantized_weight())


def kernel_layer(monkeypatch):
    """An NVFP4Linear (40 -> 24) whose forward takes the Triton kernel: on CUDA with a GPU, else on CPU tensors
    through Triton's interpreter (conftest turns it on), which NVFP4Linear.kernel_on_cpu routes to ->
    (the float Linear it was made from, the layer, an input (3, 40), the device)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        monkeypatch.setattr(q.NVFP4Linear, "kernel_on_cpu", True)
    lin = nn.Linear(40, 24, bias=True)
    m = q.NVFP4Linear.from_linear(lin).to(device)
    x = torch.randn(3, 40, generator=torch.Generator().manual_seed(3)).to(device)  # (3, 40)
    return lin, m, x, device


def test_nvfp4_linear_through_triton_kernel_on_cpu(monkeypatch):
    pytest.importorskip("triton")
    assert q.nvfp4_kernel() is not None  # the kernel loads (else m(x) would be the F.linear path)
    lin, m, x, device = kernel_layer(monkeypatch)  # with a GPU the interpreter is off: CUDA tensors
    ref = F.linear(x, m.dequantized_weight(), lin.bias.detach().to(device))
    torch.testing.assert_close(m(x), ref, rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def nf4_golden():
    return load_file(os.path.join(DATA, "nf4_golden.safetensors"))


@pytest.mark.parametrize("case", ["gauss_bf16", "odd_fp32", "special_fp32", "fp16"])
def test_nf4_matches_bitsandbytes(nf4_golden, case):
    w = nf4_golden[f"{case}.weight"]
    packed, absmax = q.quantize_nf4(w)
    assert same_bytes(packed, nf4_golden[f"{case}.packed"])
    assert same_bytes(absmax, nf4_golden[f"{case}.absmax"])
    deq = q.dequantize_nf4(packed, absmax, tuple(w.shape)).to(w.dtype)
    assert same_bytes(deq, nf4_golden[f"{case}.dequant"])


@pytest.mark.parametrize("fmt", list(q.WEIGHT_FORMATS))  # the registry: a new format gets this test
def test_backward_rebuilds_the_weight_instead_of_saving_it(fmt):
    # A LoRA step only needs dL/dx through the frozen layer; saving the dequantized weight for it
    # would cost the full-precision model's memory. Only x may be kept for backward.
    torch.manual_seed(0)
    lin = nn.Linear(64, 96, bias=True)
    m = q.quantize_model(nn.Sequential(lin), fmt=fmt, skip=())[0]
    x = torch.randn(5, 64, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.shape) or t, lambda t: t):
        y = m(x)
    assert all(s.numel() < 96 * 64 for s in saved), saved  # x (5x64) only, no (96x64) weight
    w = m.dequantized_weight()
    ref = x.detach().clone().requires_grad_(True)
    y_ref = F.linear(ref, w, m.bias)
    torch.testing.assert_close(y, y_ref)
    g = torch.randn_like(y)
    y.backward(g)
    y_ref.backward(g)
    torch.testing.assert_close(x.grad, ref.grad)


def test_nf4_linear_forward():
    lin = nn.Linear(96, 20, bias=True)
    m = q.NF4Linear.from_linear(lin)
    x = torch.randn(4, 96, generator=torch.Generator().manual_seed(4))
    w = m.dequantized_weight()
    assert w.shape == (20, 96) and ((w - lin.weight).norm() / lin.weight.norm()).item() < 0.12
    torch.testing.assert_close(m(x), F.linear(x, w, lin.bias.detach()), rtol=0, atol=0)
    m.to(torch.bfloat16)
    assert m.weight_absmax.dtype == torch.float32


# ---------------------------------------------------------------------------------------------------
# Whole models: fused-group scales, and checkpoints


def tiny_model(seed=0, hidden=32, inter=48, kv=16, layers=2, vocab=64):
    """A random module tree with Hugging Face Qwen2 names (biases on q/k/v, as in Qwen2)."""
    g = torch.Generator().manual_seed(seed)
    root, model = nn.Module(), nn.Module()
    root.model = model
    model.embed_tokens = nn.Embedding(vocab, hidden)
    model.layers = nn.ModuleList()
    for _ in range(layers):
        layer, attn, mlp = nn.Module(), nn.Module(), nn.Module()
        attn.q_proj, attn.k_proj = nn.Linear(hidden, hidden), nn.Linear(hidden, kv)
        attn.v_proj, attn.o_proj = nn.Linear(hidden, kv), nn.Linear(hidden, hidden, bias=False)
        mlp.gate_proj, mlp.up_proj = nn.Linear(hidden, inter, bias=False), nn.Linear(hidden, inter, bias=False)
        mlp.down_proj = nn.Linear(inter, hidden, bias=False)
        layer.self_attn, layer.mlp = attn, mlp
        layer.input_layernorm = nn.LayerNorm(hidden, bias=False)
        layer.post_attention_layernorm = nn.LayerNorm(hidden, bias=False)
        model.layers.append(layer)
    model.norm = nn.LayerNorm(hidden, bias=False)
    root.lm_head = nn.Linear(hidden, vocab, bias=False)
    with torch.no_grad():
        for i, (name, p) in enumerate(root.named_parameters()):
            # different magnitudes per tensor, so a shared group scale differs from each own scale
            p.copy_(torch.randn(p.shape, generator=g) * 0.02 * (1 + i % 5))
    return root.to(torch.bfloat16)


def write_hf_folder(path, model, sharded=False):
    os.makedirs(path)
    sd = {k: v.contiguous() for k, v in model.state_dict().items()}
    if not sharded:
        save_file(sd, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    else:
        # layer 0's k_proj sits in the second shard: a fused group split across files
        first = {k for k in sd if k.startswith("model.layers.0.") and "k_proj" not in k} | {"model.embed_tokens.weight"}
        files = {"model-00001-of-00002.safetensors": {k: sd[k] for k in first},
                 "model-00002-of-00002.safetensors": {k: sd[k] for k in sd if k not in first}}
        for f, part in files.items():
            save_file(part, os.path.join(path, f), metadata={"format": "pt"})
        with open(os.path.join(path, "model.safetensors.index.json"), "w") as fh:
            json.dump({"metadata": {}, "weight_map": {k: f for f, part in files.items() for k in part}}, fh)
    with open(os.path.join(path, "config.json"), "w") as fh:
        json.dump({"model_type": "qwen2", "hidden_size": 32, "torch_dtype": "bfloat16"}, fh)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        with open(os.path.join(path, name), "w") as fh:
            fh.write("{}")


def test_quantize_model_groups_share_global_scale():
    model = tiny_model()
    ref = copy.deepcopy(model)
    q.quantize_model(model)
    assert isinstance(model.lm_head, nn.Linear)               # skipped
    for i, layer in enumerate(model.model.layers):
        attn, mlp = layer.self_attn, layer.mlp
        own = {n: q.quantize_nvfp4(getattr(ref.model.layers[i].self_attn, n).weight)[2]
               for n in ("q_proj", "k_proj", "v_proj")}
        gs = [attn.q_proj.weight_global_scale, attn.k_proj.weight_global_scale, attn.v_proj.weight_global_scale]
        assert gs[0] == gs[1] == gs[2] == min(own.values())   # largest amax -> smallest gs
        assert len(set(v.item() for v in own.values())) > 1    # the test means something
        assert mlp.gate_proj.weight_global_scale == mlp.up_proj.weight_global_scale
        own_o = q.quantize_nvfp4(ref.model.layers[i].self_attn.o_proj.weight)
        assert all(same_bytes(a, b) for a, b in zip(own_o, (attn.o_proj.weight_packed, attn.o_proj.weight_scale,
                                                              attn.o_proj.weight_global_scale)))
    nf4 = q.quantize_model(copy.deepcopy(ref), fmt="nf4")
    assert isinstance(nf4.model.layers[0].mlp.down_proj, q.NF4Linear) and isinstance(nf4.lm_head, nn.Linear)
    with pytest.raises(ValueError, match="format"):
        q.quantize_model(copy.deepcopy(ref), fmt="int3")


def test_quantized_buffers_are_filled_by_name_and_checked():
    lin = nn.Linear(32, 8, bias=False)
    m = q.NVFP4Linear.from_linear(lin)
    assert m.weight_scale.shape == (8, 2) and m.weight_scale.dtype == torch.float8_e4m3fn
    packed, scale, gs = q.quantize_nvfp4(lin.weight)
    swapped = {"weight_packed": packed, "weight_scale": gs, "weight_global_scale": scale}  # two names swapped
    with pytest.raises(ValueError, match=r"NVFP4Linear.weight_scale: got \(1,\) torch.float32, the format needs \(8, 2\)"):
        q.NVFP4Linear._from_linear(lin, swapped)
    with pytest.raises(ValueError, match="got buffers"):
        q.NVFP4Linear._from_linear(lin, {"weight_packed": packed, "weight_scale": scale})
    # NF4 takes no global scale: quantize_model computes none for it
    assert not q.NF4Linear.global_scale and q.NVFP4Linear.global_scale
    seen = []

    class Spy(q.NF4Linear):
        @classmethod
        def from_linear(cls, linear, global_scale=None, **kw):
            seen.append(global_scale)
            return super().from_linear(linear, global_scale, **kw)
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(q.WEIGHT_FORMATS, "spy", Spy)
        q.quantize_model(tiny_model(), fmt="spy")
    assert seen and all(g is None for g in seen)


def test_a_format_registered_after_import_is_in_every_quant_flag(monkeypatch):
    """--quant's choices are read from WEIGHT_FORMATS when a parser is built, not copied at import."""
    from qerl import train
    monkeypatch.setitem(q.WEIGHT_FORMATS, "late-format", q.NVFP4Linear)
    assert train.build_parser().parse_args(["--quant", "late-format"]).quant == "late-format"
    assert "late-format" in q.quant_choices()


def test_weight_format_registry_drives_quantize_model(monkeypatch):
    assert q.quant_choices()[0] == "none" and {"nvfp4", "nf4"} <= set(q.quant_choices())  # a new format may join
    assert q.weight_format("nf4") is q.NF4Linear and q.weight_format("nvfp4") is q.NVFP4Linear
    with pytest.raises(ValueError, match="unknown weight format 'no-such-format'.*nvfp4, nf4"):
        q.weight_format("no-such-format")

    class Int8Linear(q.NF4Linear):  # a forker's new format: one class and one registry line
        pass
    monkeypatch.setitem(q.WEIGHT_FORMATS, "int8", Int8Linear)
    model = q.quantize_model(tiny_model(), fmt="int8")
    assert type(model.model.layers[0].self_attn.q_proj) is Int8Linear and isinstance(model.lm_head, nn.Linear)


def test_quantize_model_nan_names_module():
    model = tiny_model()
    with torch.no_grad():
        model.model.layers[1].mlp.down_proj.weight[0, 0] = float("nan")
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.down_proj"):
        q.quantize_model(model)


@pytest.mark.parametrize("sharded", [False, True])
def test_checkpoint_round_trip(tmp_path, sharded):
    model = tiny_model(seed=5)
    src, out = str(tmp_path / "src"), str(tmp_path / "out")
    write_hf_folder(src, model, sharded)
    lines = []
    summary = q.quantize_checkpoint(src, out, log=lines.append)
    assert summary["quantized"] == 14 and summary["bytes_out"] < summary["bytes_in"]
    assert sum(line.startswith("nvfp4") for line in lines) == 14 and lines[-1].startswith("done |")
    assert sorted(os.listdir(tmp_path)) == ["out", "src"]    # no temp folder left behind
    files = sorted(os.listdir(out))
    assert "tokenizer.json" in files and "tokenizer_config.json" in files
    assert ("model.safetensors.index.json" in files) == sharded

    config = json.load(open(os.path.join(out, "config.json")))
    tensors = {k: v for f in files if f.endswith(".safetensors") for k, v in load_file(os.path.join(out, f)).items()}
    qc = config["quantization_config"]
    assert qc["format"] == "nvfp4-pack-quantized" and qc["quant_method"] == "compressed-tensors"
    assert qc["config_groups"]["group_0"]["input_activations"] is None and qc["ignore"] == ["lm_head"]
    assert qc["config_groups"]["group_0"]["weights"]["group_size"] == 16
    assert config["hidden_size"] == 32

    ref = q.quantize_model(copy.deepcopy(model))
    sd_in = model.state_dict()
    for name, mod in ref.named_modules():
        if isinstance(mod, q.NVFP4Linear):
            for k in NAMES:
                assert same_bytes(tensors[f"{name}.{k}"], getattr(mod, k)), f"{name}.{k}"
            assert f"{name}.weight" not in tensors
    for k, v in sd_in.items():
        if not k.endswith("_proj.weight"):                     # embeddings, norms, biases, lm_head
            assert same_bytes(tensors[k], v), k                 # copied unchanged (bf16)
    # stage 03's path: a model skeleton with plain Linears, swapped and loaded from the checkpoint
    skeleton = tiny_model(seed=99)
    swapped = [n for n, m in skeleton.named_modules() if isinstance(m, nn.Linear) and n + ".weight_packed" in tensors]
    for n in swapped:
        lin = skeleton.get_submodule(n)
        q.replace_module(skeleton, n, q.NVFP4Linear(lin.in_features, lin.out_features, lin.bias is not None))
    assert len(swapped) == 14
    skeleton.load_state_dict(tensors, strict=True)
    for (n1, m1), (n2, m2) in zip(skeleton.named_modules(), ref.named_modules()):
        if isinstance(m2, q.NVFP4Linear):
            assert torch.equal(m1.dequantized_weight(), m2.dequantized_weight()), n1
    if sharded:
        index = json.load(open(os.path.join(out, "model.safetensors.index.json")))
        assert index["weight_map"]["model.layers.0.self_attn.k_proj.weight_packed"] == "model-00002-of-00002.safetensors"
        assert index["weight_map"]["model.layers.0.self_attn.q_proj.weight_scale"] == "model-00001-of-00002.safetensors"
        assert index["metadata"]["total_size"] == summary["bytes_out"]


def test_checkpoint_refuses_existing_out_and_force_replaces(tmp_path):
    src, out = str(tmp_path / "src"), str(tmp_path / "out")
    write_hf_folder(src, tiny_model())
    os.makedirs(out)
    open(os.path.join(out, "keep.txt"), "w").close()
    with pytest.raises(FileExistsError, match="--force"):
        q.quantize_checkpoint(src, out, log=lambda s: None)
    assert cli.run_cli(q.main, ["--model", src, "--out", out]) == 1
    with pytest.raises(ValueError, match="replaces only an earlier output of qerl/quantize.py"):
        q.quantize_checkpoint(src, out, force=True, log=lambda s: None)  # not ours: --force refuses it
    assert os.listdir(out) == ["keep.txt"]
    os.remove(os.path.join(out, "keep.txt"))
    q.quantize_checkpoint(src, out, log=lambda s: None)  # an empty folder is fine
    q.quantize_checkpoint(src, out, force=True, log=lambda s: None)  # our own earlier output: replaced
    assert "model.safetensors" in os.listdir(out)
    assert sorted(os.listdir(tmp_path)) == ["out", "src"]


def test_checkpoint_bad_inputs(tmp_path):
    with pytest.raises(FileNotFoundError, match="not found"):
        q.quantize_checkpoint(str(tmp_path / "nope"), str(tmp_path / "o"))
    os.makedirs(tmp_path / "empty")
    with pytest.raises(FileNotFoundError, match="config.json"):
        q.quantize_checkpoint(str(tmp_path / "empty"), str(tmp_path / "o"))
    (tmp_path / "empty" / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="config.json"):
        q.quantize_checkpoint(str(tmp_path / "empty"), str(tmp_path / "o"))
    (tmp_path / "empty" / "config.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        q.quantize_checkpoint(str(tmp_path / "empty"), str(tmp_path / "o"))
    (tmp_path / "empty" / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00garbage!")
    with pytest.raises(ValueError, match="safetensors"):
        q.quantize_checkpoint(str(tmp_path / "empty"), str(tmp_path / "o"))
    assert not (tmp_path / "o").exists()


def test_checkpoint_failure_midway_leaves_nothing(tmp_path):
    model = tiny_model()
    with torch.no_grad():
        model.model.layers[1].mlp.down_proj.weight[0, 0] = float("inf")
    src, out = str(tmp_path / "src"), str(tmp_path / "out")
    write_hf_folder(src, model)
    with pytest.raises(ValueError, match=r"layers\.1\.mlp\.down_proj"):
        q.quantize_checkpoint(src, out, log=lambda s: None)
    assert sorted(os.listdir(tmp_path)) == ["src"]


def test_cli_error_is_one_line(tmp_path):
    r = subprocess.run([sys.executable, os.path.join(ROOT, "qerl/quantize.py"), "--model", str(tmp_path / "missing"),
                        "--out", str(tmp_path / "o")], capture_output=True, text=True, timeout=120)
    assert r.returncode == 1
    assert r.stderr.startswith("error: model folder not found") and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_autodetect_device():
    assert devices.autodetect_device() == ("cuda" if torch.cuda.is_available() else "cpu")


def test_checkpoint_truncated_or_misshaped_tensor_is_one_line(tmp_path):
    """A cut-off shard or a tensor at odds with config.json fails before anything is written,
    naming the file and the tensor (and the CLI prints one line)."""
    src, out = tmp_path / "src", tmp_path / "out"
    write_hf_folder(str(src), tiny_model(), sharded=True)
    shards = sorted(f for f in os.listdir(src) if f.endswith(".safetensors"))
    data = (src / shards[-1]).read_bytes()
    (src / shards[-1]).write_bytes(data[:-10])
    with pytest.raises(ValueError, match=rf"{shards[-1]}: tensor \S+ needs bytes \d+\.\.{len(data)} but the file "
                                         rf"has {len(data) - 10}; the file is truncated or corrupt"):
        q.quantize_checkpoint(str(src), str(out), log=lambda s: None)
    r = subprocess.run([sys.executable, os.path.join(ROOT, "qerl/quantize.py"), "--model", str(src), "--out", str(out)],
                       capture_output=True, text=True, timeout=120)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 1 and len(lines) == 1 and "is truncated or corrupt" in lines[0], r.stderr
    (src / shards[-1]).write_bytes(data)
    cfg = dict(json.loads((src / "config.json").read_text()), intermediate_size=48, num_attention_heads=4,
               num_key_value_heads=2, vocab_size=64)  # what tiny_model's shapes imply
    (src / "config.json").write_text(json.dumps(cfg))
    q.quantize_checkpoint(str(src), str(out), log=lambda s: None)  # the shapes agree: it is written
    shutil.rmtree(out)
    (src / "config.json").write_text(json.dumps(dict(cfg, intermediate_size=64)))
    with pytest.raises(ValueError, match=r"model-\S+.safetensors: tensor model.layers.\d.mlp.\w+_proj.weight has "
                                         r"shape \(\d+, \d+\), config.json implies"):
        q.quantize_checkpoint(str(src), str(out), log=lambda s: None)
    assert sorted(os.listdir(tmp_path)) == ["src"]  # nothing half-written


# ---------------------------------------------------------------------------------------------------
# Four Over Six: per block, the max -> 6 or the max -> 4 scale, whichever reconstructs it better


def block_sq_error(w, packed, scale, gs):
    d = q.dequantize_nvfp4(packed, scale, gs)[:, : w.shape[1]] - w.float()
    return d.pow(2).view(w.shape[0], -1, 16).sum(-1)                    # (out, nb)


def test_4over6_choice_per_block_matches_hand_computation():
    # global scale 1: block 0 (max 6, fifteen 5s) has scales 1 (max -> 6) and 1.5 (max -> 4). At scale 1
    # each 5 is an E2M1 tie that rounds to even (4): squared error 15 x 1. At 1.5, 5/1.5 = 3.33 -> 3, which
    # decodes to 4.5: 15 x 0.25 = 3.75, so 4/6 keeps 1.5. Block 1 (6, 0.5, zeros) is exact at scale 1 and
    # not at 1.5 (0.5/1.5 = 0.33 -> 0.5, decodes to 0.75), so it keeps 1.
    w = torch.tensor([[6.0] + [5.0] * 15 + [6.0, 0.5] + [0.0] * 14])
    gs = torch.ones(1)
    rtn = q.quantize_nvfp4(w, gs)
    four = q.quantize_nvfp4(w, gs, method="4over6")
    assert rtn[1].float().tolist() == [[1.0, 1.0]] and four[1].float().tolist() == [[1.5, 1.0]]
    deq = q.dequantize_nvfp4(*four)
    assert deq[0, :16].tolist() == [6.0] + [4.5] * 15 and deq[0, 16:18].tolist() == [6.0, 0.5]
    assert block_sq_error(w, *rtn).tolist() == [[15.0, 0.0]]
    assert block_sq_error(w, *four).tolist() == [[3.75, 0.0]]
    # with a global scale that leaves no E4M3 room (the rtn one puts the largest block at 448), that
    # block's max -> 4 scale (672) cannot be stored: it stays at max -> 6
    gs_rtn = q.nvfp4_global_scale([w])
    assert torch.equal(q.quantize_nvfp4(w, gs_rtn, method="4over6")[1].float()[0, 0], torch.tensor(448.0))


@pytest.mark.parametrize("dist", ["gauss", "laplace", "student_t3"])
def test_4over6_never_worse_than_rtn_per_block_and_lower_rms(dist):
    g = torch.Generator().manual_seed(7)
    shape = (256, 1024)
    if dist == "gauss":
        w = torch.randn(shape, generator=g)
    elif dist == "laplace":
        u = torch.rand(shape, generator=g) - 0.5
        w = -u.sign() * torch.log1p(-2 * u.abs())
    else:
        z, chi2 = torch.randn(shape, generator=g), torch.randn((3,) + shape, generator=g).pow(2).sum(0)
        w = z / (chi2 / 3).sqrt()
    w = w * 0.02
    gs = q.nvfp4_global_scale([w], "4over6")
    rtn, four = q.quantize_nvfp4(w, gs), q.quantize_nvfp4(w, gs, method="4over6")
    e_rtn, e_four = block_sq_error(w, *rtn), block_sq_error(w, *four)
    assert (e_four <= e_rtn).all()                                       # same global scale: never worse
    chosen4 = (four[1].float() != rtn[1].float()).float().mean().item()
    assert 0.2 < chosen4 < 0.6                                           # both candidates are really used
    # each with its own global scale (what a user gets): 4/6's RMS error is lower; >= 5% on Gaussian
    rel = (block_sq_error(w, *q.quantize_nvfp4(w, method="4over6")).sum()
           / block_sq_error(w, *q.quantize_nvfp4(w)).sum()).sqrt().item()
    assert rel < (0.95 if dist == "gauss" else 1.0)


def test_4over6_rtn_bytes_unchanged_and_bad_method(nvfp4_golden):
    w = nvfp4_golden["gauss_fp32.weight"]
    for name, t in zip(NAMES, q.quantize_nvfp4(w, method="rtn")):
        assert same_bytes(t, nvfp4_golden[f"gauss_fp32.ct.{name}"]), name
    with pytest.raises(ValueError, match="unknown NVFP4 method 'no-such-method'.*rtn, 4over6"):
        q.quantize_nvfp4(w, method="no-such-method")
    with pytest.raises(ValueError, match="NF4 has only 'rtn'"):
        q.quantize_model(tiny_model(), fmt="nf4", method="4over6")


def test_4over6_checkpoint_loads_to_our_weights(tmp_path):
    from safetensors import safe_open
    model = tiny_model(seed=5)
    src, out = str(tmp_path / "src"), str(tmp_path / "out")
    write_hf_folder(src, model)
    q.quantize_checkpoint(src, out, log=lambda s: None, method="4over6")
    path = os.path.join(out, "model.safetensors")
    with safe_open(path, "pt") as f:
        assert f.metadata()["nvfp4_method"] == "4over6"
    tensors = load_file(path)
    ref = q.quantize_model(copy.deepcopy(model), method="4over6")
    rtn = q.quantize_model(copy.deepcopy(model))
    differs = 0
    for name, mod in ref.named_modules():
        if isinstance(mod, q.NVFP4Linear):
            for k in NAMES:
                assert same_bytes(tensors[f"{name}.{k}"], getattr(mod, k)), f"{name}.{k}"
            differs += not same_bytes(mod.weight_scale, rtn.get_submodule(name).weight_scale)
    assert differs == 14                                                 # every tensor has max -> 4 blocks
    assert json.load(open(os.path.join(out, "config.json")))["quantization_config"]["format"] == "nvfp4-pack-quantized"


# ---------------------------------------------------------------------------------------------------
# Kept dequantized weights (a CPU's frozen base) and --dtype auto


def test_keep_dequantized_gives_the_same_outputs_and_gradients_and_builds_each_weight_once(monkeypatch):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(40, 24), nn.ReLU(), nn.Linear(24, 16, bias=False))
    ref = q.quantize_model(copy.deepcopy(model), "nvfp4")
    kept = q.keep_dequantized(q.quantize_model(copy.deepcopy(model), "nvfp4"))
    x = torch.randn(5, 40, requires_grad=True)
    outs = []
    for m in (ref, kept):
        x.grad = None
        y = m(x)
        y.square().sum().backward()
        outs.append((y.detach(), x.grad.clone()))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
    calls = []
    real = q.NVFP4Linear.dequantized_weight
    monkeypatch.setattr(q.NVFP4Linear, "dequantized_weight", lambda self, dtype=torch.float32: calls.append(1)
                        or real(self, dtype))
    for _ in range(3):
        kept(x).sum().backward()
    assert calls == []  # built in the first pass above, reused by every forward and backward since
    kept.to(torch.bfloat16)
    assert all(m.kept == {} for m in kept.modules() if isinstance(m, q.NVFP4Linear))  # rebuilt after a move
    kept(x.detach().bfloat16())
    assert len(calls) == 2 and all(set(m.kept) == {torch.bfloat16} for m in kept if isinstance(m, q.NVFP4Linear))
    q.keep_dequantized(kept, False)
    kept(x.detach().bfloat16())
    assert len(calls) == 4


def test_dtype_auto_takes_bf16_only_where_it_is_native_and_the_model_wide_enough(monkeypatch):
    monkeypatch.setattr(devices, "cpu_has_native_bf16", lambda: False)
    dtype, why = devices.pick_dtype("auto", "cpu", 576)
    assert dtype == torch.float32 and "no native bf16" in why  # emulated bf16 (most laptops): never
    monkeypatch.setattr(devices, "cpu_has_native_bf16", lambda: True)
    assert devices.pick_dtype("auto", "cpu", 576)[0] == torch.bfloat16  # SmolLM2 on an AMX Xeon
    dtype, why = devices.pick_dtype("auto", "cpu", 128)  # the bundled model: too small to gain
    assert dtype == torch.float32 and "128 < 512" in why
    assert devices.pick_dtype("auto", "cuda")[0] == torch.bfloat16
    assert devices.pick_dtype("float32", "cuda") == (torch.float32, "--dtype")
    assert devices.pick_dtype("bfloat16", "cpu")[0] == torch.bfloat16
    with pytest.raises(ValueError, match="unknown dtype 'no-such-dtype'"):
        devices.pick_dtype("no-such-dtype", "cpu")


# ---------------------------------------------------------------------------------------------------
# The plain forward of Part 1 and the fast one that runs; the worked example of --show-block


@pytest.mark.parametrize("fmt", list(q.WEIGHT_FORMATS))
@pytest.mark.parametrize("keep", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_plain_forward_equals_the_fast_one(fmt, keep, dtype):
    # Part 1's forward, F.linear(x, dequantized_weight, bias) (fast = False), against what runs (fast_forward:
    # W rebuilt in backward by quant_engine, kept under keep_dequantized): the same outputs and input gradients.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(40, 24), nn.ReLU(), nn.Linear(24, 16, bias=False))
    model = q.keep_dequantized(q.quantize_model(model, fmt, skip=()).to(dtype), keep)
    x = torch.randn(3, 5, 40, generator=torch.Generator().manual_seed(1)).to(dtype).requires_grad_(True)  # (B, T, in)
    outs = {}
    for fast in (True, False):
        for m in model.modules():
            if isinstance(m, tuple(q.WEIGHT_FORMATS.values())):
                m.fast = fast
        x.grad = None
        y = model(x)                                                             # (B, T, 16)
        y.float().square().sum().backward()
        outs[fast] = (y.detach(), x.grad.clone())
    assert torch.equal(outs[True][0], outs[False][0])
    torch.testing.assert_close(outs[True][1], outs[False][1], rtol=0, atol=0)
    layers = [m for m in model.modules() if isinstance(m, tuple(q.WEIGHT_FORMATS.values()))]
    assert len(layers) == 2 and all((set(m.kept) == {dtype}) if keep else m.kept is None for m in layers)


def test_show_block_prints_the_real_numbers(capsys):
    # `qerl/quantize.py --show-block --seed 3` walks one block through quantize_nvfp4; each number it prints
    # must be the quantizer's own: weights, global and block scale, codes, packed bytes, reconstruction, error.
    assert q.main(["--show-block", "--seed", "3"]) == 0
    out = capsys.readouterr().out
    w = torch.randn(4, 64, generator=torch.Generator().manual_seed(3)) * 0.02
    packed, scale, gs = q.quantize_nvfp4(w)
    w_hat = q.dequantize_nvfp4(packed, scale, gs)[0, :16]
    block = w[0, :16]
    assert float(re.search(r"= (\S+) \(fp32\)", out).group(1)) == pytest.approx(gs.item(), rel=1e-7)
    s, byte = re.search(r"s = (\S+) \(byte 0x(\w\w) =", out).groups()
    assert float(s) == scale[0, 0].float().item() and int(byte, 16) == scale[0, 0].view(torch.uint8).item()
    rows = re.findall(r"^\s+(\d+) \| (\S+) \| +(\S+) \| +(\S+) \| 0x(\w) \((\d{4})\) \| (\S+) \| (\S+)$", out, re.M)
    assert [int(r[0]) for r in rows] == list(range(16))
    codes = torch.stack((packed[0, :8] & 0xF, packed[0, :8] >> 4), -1).reshape(-1).tolist()  # low nibble first
    for (i, wi, y, v, code, bits, wh, err), c in zip(rows, codes):
        i = int(i)
        assert float(wi) == pytest.approx(block[i].item(), abs=5e-8)
        assert int(code, 16) == c == int(bits, 2) and float(v) == q.E2M1_VALUES[c].item()
        assert float(wh) == pytest.approx(w_hat[i].item(), abs=5e-8)
        assert float(err) == pytest.approx((w_hat[i] - block[i]).item(), rel=1e-3)
    hexes = re.search(r"low nibble: ((?:[0-9a-f]{2} ){7}[0-9a-f]{2})", out).group(1)
    assert bytes.fromhex(hexes) == bytes(packed[0, :8].tolist())
    rel, top = re.search(r"rel RMS error (\S+), max abs error (\S+)", out).groups()
    d = w_hat - block
    assert float(rel) == pytest.approx((d.norm() / block.norm()).item(), abs=5e-5)
    assert float(top) == pytest.approx(d.abs().max().item(), rel=1e-3)


@pytest.mark.parametrize("fmt", list(q.WEIGHT_FORMATS))
def test_a_kept_weight_follows_writes_to_its_buffers(fmt):
    """keep_dequantized keeps W once, but a write into the format's buffers (an AQN site on the scales, a
    load_state_dict) is seen at the next forward: the output equals a fresh layer's, never a stale W's."""
    torch.manual_seed(0)
    layer = q.keep_dequantized(q.quantize_model(torch.nn.Sequential(torch.nn.Linear(32, 8)), fmt, skip=()))[0]
    x = torch.randn(3, 32)
    before = layer(x)
    name = q.weight_format(fmt).BUFFERS[-1]  # NVFP4: the global scale; NF4: the absmax
    with torch.no_grad():
        getattr(layer, name).mul_(2)
    fresh = torch.nn.functional.linear(x, layer.dequantized_weight(torch.float32), layer.bias)
    after = layer(x)
    assert torch.equal(after, fresh) and not torch.equal(after, before)
    with torch.no_grad():
        getattr(layer, name).div_(2)
    assert torch.equal(layer(x), before)


def test_a_kept_weight_follows_a_buffer_replaced_at_a_recycled_address():
    """AQN's block-scales site replaces weight_scale by a new float32 copy each step; the copy freed, the next
    step's may be allocated at the same address, and under inference mode neither keeps a version: the kept W
    must still be rebuilt (the buffers are compared by identity, not address), even with no forward between."""
    torch.manual_seed(0)
    layer = q.keep_dequantized(q.quantize_model(torch.nn.Sequential(torch.nn.Linear(32, 8)), "nvfp4", skip=()))[0]
    x, e4m3 = torch.randn(3, 32), layer.weight_scale
    clean = layer(x)
    with torch.inference_mode():
        room = torch.empty(e4m3.shape)  # one allocation, handed out twice, as an allocator reuses a freed block
        first = room.view(e4m3.shape).copy_(e4m3.float() * 1.5)
        layer.weight_scale = first
        assert torch.equal(layer(x), F.linear(x, layer.dequantized_weight(), layer.bias))
        layer.weight_scale = e4m3  # put back; no forward before the next copy
        second = room.view(e4m3.shape).copy_(e4m3.float() * 0.5)
        layer.weight_scale = second
        assert second.data_ptr() == first.data_ptr() and second is not first
        assert torch.equal(layer(x), F.linear(x, layer.dequantized_weight(), layer.bias))
        layer.weight_scale = e4m3
    assert torch.equal(layer(x), clean)


def test_float32_block_scales_take_the_dequantized_product_where_the_kernel_would_run(monkeypatch):
    """The Triton kernel reads E4M3 scales only: with AQN's float32 copy in place (block-scales) the layer runs
    F.linear on the dequantized W, on CUDA or --gpu-path alike; with the E4M3 scales back, the kernel again."""
    pytest.importorskip("triton")
    lin, m, x, device = kernel_layer(monkeypatch)
    e4m3 = m.weight_scale
    m.weight_scale = e4m3.float() * 1.25
    noisy = F.linear(x, m.dequantized_weight(), lin.bias.detach().to(device))
    torch.testing.assert_close(m(x), noisy, rtol=1e-5, atol=1e-5)
    m.weight_scale = e4m3
    torch.testing.assert_close(m(x), F.linear(x, m.dequantized_weight(), lin.bias.detach().to(device)),
                               rtol=1e-5, atol=1e-5)
