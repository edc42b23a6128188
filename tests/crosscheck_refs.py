"""Cross-check qerl/quantize.py against the reference libraries, by hand (not part of `make test`).

Needs an environment with compressed-tensors, bitsandbytes and transformers (this project does not
depend on them); without them it prints "skipped" and exits 0:

    /tmp/refenv/bin/python tests/crosscheck_refs.py [nvfp4] [nf4] [checkpoint]   # a few minutes on 2 cores

1. NVFP4 bytes vs compressed-tensors (generate_gparam + calculate_qparams + NVFP4PackedCompressor,
   the path llm-compressor takes) on many random tensors: seeds, shapes, dtypes, magnitudes from
   1e-38 to 1e30, heavy tails, per-block magnitude spread (FP8 underflow), exact E2M1 midpoints,
   zeros and -0.0, and shared (fused-group) global scales.
2. NF4 bytes and absmax vs bitsandbytes quantize_4bit(nf4) on random tensors (partial last block,
   odd sizes, zeros, ties at code midpoints).
3. A tiny random Qwen2 model saved by transformers -> `qerl/quantize.py --out` -> loaded back by
   transformers + compressed-tensors (decompressed): every weight equals our dequantized weight.
4. `4over6`: the same with `--quant-method 4over6`. compressed-tensors cannot write these bytes (it
   rounds to nearest), so only the decoding is compared: its decompressed weights equal ours.
"""
import importlib
import os
import sys
import tempfile

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
try:
    import bitsandbytes.functional as bnbF
    from bitsandbytes.backends.default.ops import _dequantize_4bit_compute, _get_4bit_code
    import transformers
    from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from compressed_tensors.quantization.utils import calculate_qparams, generate_gparam
except ImportError as e:
    print(f"skipped: reference libraries not importable ({e})")
    sys.exit(0)
q = importlib.import_module("qerl.quantize")

ARGS = QuantizationArgs(num_bits=4, type="float", strategy="tensor_group", group_size=16, symmetric=True,
                        dynamic=False, scale_dtype=torch.float8_e4m3fn)
SCHEME = QuantizationScheme(targets=["Linear"], weights=ARGS)


def ct_nvfp4(w, gs=None, upcast=True):
    """compressed-tensors' own functions (llm-compressor's observer = block min/max); upcast=False
    keeps CT's arithmetic in w's dtype (bf16), which this project deliberately does not do."""
    w = w.float() if upcast else w
    if gs is None:
        gs = generate_gparam(w.min(), w.max())
    b = w.reshape(w.shape[0], -1, 16)
    scale, zp = calculate_qparams(b.amin(-1), b.amax(-1), ARGS, global_scale=gs)
    sd = NVFP4PackedCompressor.compress({"weight": w, "weight_scale": scale, "weight_global_scale": gs,
                                         "weight_zero_point": zp}, SCHEME)
    return sd["weight_packed"], sd["weight_scale"], sd["weight_global_scale"]


def nvfp4_cases(g):
    """Yield (label, weight, shared_gs or None)."""
    shapes = [(1, 16), (3, 32), (16, 48), (64, 256), (257, 128), (128, 1024)]
    dtypes = [torch.float32, torch.bfloat16, torch.float16]
    mags = [1e-38, 1e-30, 1e-8, 1e-3, 0.02, 1.0, 1e3, 1e30]
    for seed in range(6):
        for shape in shapes:
            for dt in dtypes:
                for mag in mags:
                    if dt == torch.float16 and not (1e-4 < mag < 1e4):
                        continue  # outside fp16's range
                    base = torch.randn(shape, generator=g)
                    kind = seed % 3
                    if kind == 1:   # heavy tails
                        base = torch.distributions.StudentT(2.0).sample(shape)
                    elif kind == 2:  # each block its own magnitude: many FP8 underflows / subnormal scales
                        spread = torch.exp(torch.randn(shape[0], shape[1] // 16, generator=g) * 6)
                        base = base * spread.repeat_interleave(16, dim=1)
                    w = (base * mag).to(dt)
                    if torch.isfinite(w).all():  # a spread block times 1e30 can overflow; skip those
                        yield f"s{seed} {shape} {dt} {mag:g}", w, None
    # exact E2M1 midpoints and grid values times powers of two, zeros and -0.0
    grid = torch.tensor([0.0, 0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0])
    for seed in range(20):
        idx = torch.randint(0, len(grid), (64, 128), generator=g)
        sign = torch.where(torch.rand(64, 128, generator=g) < 0.5, -1.0, 1.0)
        w = grid[idx] * sign * 2.0 ** torch.randint(-20, 20, (64, 1), generator=g).float()
        w[::7, :16] = 0.0
        w[::5, 16:32] = -0.0
        yield f"grid s{seed}", w, None
    # shared group scales (gs smaller than the tensor's own, as in fused q/k/v)
    for seed in range(10):
        w = torch.randn(32, 64, generator=g)
        yield f"shared gs s{seed}", w, q.nvfp4_global_scale([w * (1 + 10 * seed)])


def check_nvfp4():
    g = torch.Generator().manual_seed(1234)
    n_t = n_b = bad = 0
    for label, w, gs in nvfp4_cases(g):
        ours = q.quantize_nvfp4(w, gs)
        ref = ct_nvfp4(w, gs)
        n_t += 1
        for a, b in zip(ours, ref):
            a8, b8 = a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)
            n_b += a8.numel()
            if a.shape != b.shape or a.dtype != b.dtype or not torch.equal(a8, b8):
                bad += 1
                print(f"MISMATCH nvfp4 {label}: {a.dtype} {tuple(a.shape)} vs {b.dtype} {tuple(b.shape)}")
                break
    print(f"nvfp4 vs compressed-tensors: {n_t} tensors, {n_b} bytes (codes+scales+global scales), mismatching tensors {bad}")
    return bad == 0


def check_nf4():
    g = torch.Generator().manual_seed(99)
    code = q.NF4_CODE
    n_t = n_b = bad = 0
    shapes = [(64,), (1, 63), (3, 65), (7, 13), (64, 64), (32, 96), (128, 1000), (896, 128), (33, 17, 5)]
    for seed in range(8):
        for shape in shapes:
            for dt in (torch.float32, torch.bfloat16, torch.float16):
                for mag in (1e-30, 1e-3, 1.0, 1e4):
                    if dt == torch.float16 and mag < 1e-4:
                        continue
                    w = torch.randn(shape, generator=g) * mag
                    if seed % 2:  # exact midpoints and code values, times a block absmax of 1, and zero blocks
                        mids = torch.cat([code, (code[:-1] + code[1:]) / 2])
                        w = mids[torch.randint(0, len(mids), shape, generator=g)] * mag
                        w.view(-1)[:64] = 0.0
                    w = w.to(dt)
                    p, st = bnbF.quantize_4bit(w, blocksize=64, quant_type="nf4", compress_statistics=False)
                    ours_p, ours_a = q.quantize_nf4(w, 64)
                    n_t += 1
                    n_b += ours_p.numel() + 4 * ours_a.numel()
                    same = torch.equal(ours_p, p.view(-1)) and torch.equal(ours_a, st.absmax)
                    # bnb's torch backend (flattened blocks, as on CUDA); its CPU C kernel differs on e.g. 32x96
                    deq_ref = _dequantize_4bit_compute(p.reshape(-1), st.absmax, _get_4bit_code("nf4", "cpu"),
                                                       64, tuple(w.shape), dt).float()
                    deq = q.dequantize_nf4(ours_p, ours_a, tuple(w.shape)).to(dt).float()
                    if not same or not torch.equal(deq.reshape(-1), deq_ref.reshape(-1)):  # bnb gives (1, n) for 1-D
                        bad += 1
                        print(f"MISMATCH nf4 s{seed} {shape} {dt} {mag}")
    print(f"nf4 vs bitsandbytes: {n_t} tensors, {n_b} bytes (codes+absmax), dequant compared too, mismatching {bad}")
    return bad == 0


def check_checkpoint(method="rtn"):
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig, Qwen2Config, Qwen2ForCausalLM
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=256, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    model = Qwen2ForCausalLM(cfg).to(torch.bfloat16)
    with tempfile.TemporaryDirectory() as d:
        src, out = os.path.join(d, "src"), os.path.join(d, "out")
        model.save_pretrained(src, max_shard_size="100KB")  # sharded: exercises the index path
        q.quantize_checkpoint(src, out, log=lambda s: None, method=method)
        from safetensors.torch import load_file
        tensors = {k: v for f in sorted(os.listdir(out)) if f.endswith(".safetensors")
                   for k, v in load_file(os.path.join(out, f)).items()}
        loaded = AutoModelForCausalLM.from_pretrained(
            out, quantization_config=CompressedTensorsConfig(dequantize=True), dtype=torch.bfloat16)
        sd = loaded.state_dict()
        n = bad = 0
        for name, p in model.state_dict().items():
            base = name[: -len(".weight")]
            if base + ".weight_packed" in tensors:
                ours = q.dequantize_nvfp4(tensors[base + ".weight_packed"], tensors[base + ".weight_scale"],
                                          tensors[base + ".weight_global_scale"], torch.bfloat16)
                # and our bytes equal compressed-tensors quantizing the original weight with our shared gs
                ref = ct_nvfp4(p, tensors[base + ".weight_global_scale"])
                same_bytes = method != "rtn" or (torch.equal(ref[0], tensors[base + ".weight_packed"]) and torch.equal(
                    ref[1].view(torch.uint8), tensors[base + ".weight_scale"].view(torch.uint8)))
            else:
                ours, same_bytes = p, True
            n += 1
            if not (same_bytes and torch.equal(sd[name], ours)):
                bad += 1
                print(f"MISMATCH checkpoint {name}")
        gs = {k: v.item() for k, v in tensors.items() if k.endswith("weight_global_scale")}
        shared = all(gs[f"model.layers.{i}.self_attn.{a}_proj.weight_global_scale"] ==
                     gs[f"model.layers.{i}.self_attn.q_proj.weight_global_scale"] for i in range(2) for a in "kv")
        print(f"checkpoint ({method}) via transformers {transformers.__version__} + compressed-tensors: {n} weights compared, "
              f"mismatching {bad}, q/k/v share gs: {shared}")
        return bad == 0 and shared


if __name__ == "__main__":
    parts = sys.argv[1:] or ["nvfp4", "nf4", "checkpoint", "4over6"]  # or name the parts to run
    checks = {"nvfp4": check_nvfp4, "nf4": check_nf4, "checkpoint": check_checkpoint,
              "4over6": lambda: check_checkpoint("4over6")}
    ok = [checks[p]() for p in parts]
    print("ALL OK" if all(ok) else "FAILURES")
    sys.exit(0 if all(ok) else 1)
