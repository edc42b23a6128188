"""Build tests/data/nvfp4_golden.safetensors (run by hand; the tests only read the result).

    /tmp/refenv/bin/python tests/make_nvfp4_golden.py /work/shared/reference/nvfp4_golden.safetensors

Input: the project's reference file with three 64x256 weights and what compressed-tensors (CT)
wrote for them. We keep the fp32 cases (`gauss_fp32`, `special_fp32`: all-zero and -0.0 blocks,
far-below-amax blocks, mixed magnitudes) with their `.ct.*` tensors. For `gauss_bf16`, CT does its
arithmetic in bf16, while this project upcasts to fp32 first; so we store what CT writes for
`weight.float()` as `gauss_bf16.ct_fp32.*`. The script first checks that calling CT's functions
(generate_gparam, calculate_qparams, NVFP4PackedCompressor.compress, as llm-compressor does)
reproduces every stored `.ct.*` tensor, bf16 case included, so the new golden comes from the same
path. Needs compressed-tensors (0.20.1 was used); the project itself does not.
"""
import os
import sys

import torch
from safetensors.torch import load_file, save_file

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from crosscheck_refs import ct_nvfp4  # noqa: E402  (exits with "skipped" without compressed-tensors)

NAMES = ("weight_packed", "weight_scale", "weight_global_scale")
src = load_file(sys.argv[1])
out = {}
for case in ("gauss_fp32", "special_fp32", "gauss_bf16"):
    w = src[f"{case}.weight"]
    for k, t in zip(NAMES, ct_nvfp4(w, upcast=False)):  # the harness reproduces the stored CT output
        assert torch.equal(t.view(torch.uint8), src[f"{case}.ct.{k}"].view(torch.uint8)), f"{case}.{k}"
    out[f"{case}.weight"] = w
    tag = "ct_fp32" if w.dtype == torch.bfloat16 else "ct"
    for k, t in zip(NAMES, ct_nvfp4(w)):  # fp32 maths: equals the stored tensors for the fp32 cases
        out[f"{case}.{tag}.{k}"] = t.contiguous()
path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "nvfp4_golden.safetensors")
save_file(out, path, metadata={"source": "compressed-tensors 0.20.1 via tests/make_nvfp4_golden.py"})
os.chmod(path, 0o644)
print(f"wrote {path}: {len(out)} tensors")
