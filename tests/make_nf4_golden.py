"""Build tests/data/nf4_golden.safetensors with bitsandbytes (run by hand; the tests only read the result).

    /tmp/refenv/bin/python tests/make_nf4_golden.py

For each case we store the input `<case>.weight` and what bitsandbytes returns for
`quantize_4bit(weight, blocksize=64, quant_type="nf4", compress_statistics=False)` (no double
quantization, the QLoRA baseline without its second quantization of the absmax):
`<case>.packed` (uint8, flattened from bnb's [numel/2, 1]), `<case>.absmax` (fp32, one per block of
64) and `<case>.dequant` (in the input dtype). bitsandbytes 0.50.2 was used, on CPU. The dequant
comes from bnb's pure-torch backend (`_dequantize_4bit_compute`, blocks over the flattened tensor as
on CUDA): its CPU C kernel blocks rows instead and gives different values for e.g. a 32x96 weight,
which bnb's own quantize (flattened blocks) does not match. Cases:
  gauss_bf16    32x96 bf16, N(0, 0.02^2): the usual case
  odd_fp32      7x13 fp32: 91 elements -> a partial last block and an odd element count
  special_fp32  4x64 fp32: an all-zero block; exact code values x 3; exact code midpoints (ties) with
                absmax 1; -0.0 and tiny values next to 1e-20
  fp16          3x65 fp16
"""
import os

import torch
from bitsandbytes.backends.default.ops import _dequantize_4bit_compute, _get_4bit_code
from bitsandbytes.functional import quantize_4bit
from safetensors.torch import save_file

CODE = torch.tensor([-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
                     -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
                     0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
                     0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0])
g = torch.Generator().manual_seed(0)
special = torch.zeros(4, 64)
special[1, :16] = CODE * 3.0
special[1, 16:] = torch.randn(48, generator=g)
special[2, :15] = (CODE[:-1] + CODE[1:]) / 2
special[2, 15] = 1.0
special[2, 16:] = torch.rand(48, generator=g) * 2 - 1
special[3, :8] = -0.0
special[3, 8:] = torch.randn(56, generator=g) * 1e-30
special[3, 63] = 1e-20
cases = {
    "gauss_bf16": (torch.randn(32, 96, generator=g) * 0.02).to(torch.bfloat16),
    "odd_fp32": torch.randn(7, 13, generator=g),
    "special_fp32": special,
    "fp16": torch.randn(3, 65, generator=g).to(torch.float16),
}
out = {}
for name, w in cases.items():
    packed, state = quantize_4bit(w, blocksize=64, quant_type="nf4", compress_statistics=False)
    out[f"{name}.weight"] = w
    out[f"{name}.packed"] = packed.reshape(-1).contiguous()
    out[f"{name}.absmax"] = state.absmax.contiguous()
    out[f"{name}.dequant"] = _dequantize_4bit_compute(packed.reshape(-1), state.absmax, _get_4bit_code("nf4", "cpu"),
                                                      64, tuple(w.shape), w.dtype).contiguous()
path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "nf4_golden.safetensors")
save_file(out, path, metadata={"source": "bitsandbytes 0.50.2 via tests/make_nf4_golden.py"})
os.chmod(path, 0o644)
print(f"wrote {path}: {len(out)} tensors")
