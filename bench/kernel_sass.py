"""What the fused NVFP4 kernel costs on Hopper, read from its machine code, without a GPU.

Every CUDA configuration of kernels/nvfp4_matmul.py is compiled ahead of time for sm_90 with the
`ptxas` that ships in Triton's wheel, for the signature the wrapper launches on an 8192x8192 bf16
weight (decode configurations with a small M, the others with M = 4096). The cubin is read back with
`cuobjdump -res-usage` (registers, stack) and `nvdisasm` (SASS), and the main loop (the largest
backward branch holding the MMA instructions) is counted. x is bf16 except for the general kernel's
16-row tiles, which now only serve fp32 x (their rows say "fp32 x").

Why instructions per weight. At decode the kernel must stream the weight at memory speed. An H200
issues 132 SMs x 4 schedulers x 1.98 GHz warp instructions per second (x 32 = thread instructions)
and reads 4.8 TB/s; at 0.5625 bytes per NVFP4 weight that leaves 33.4e12 / 8.53e12 = 3.9 thread
instructions per weight. Above that the kernel is bound by issue, not by memory.

    loop instructions x warps x 32 / weights one program handles per loop iteration

One line per configuration (`|`-separated fields); the last line names the worst decode figure.

    python bench/kernel_sass.py                   # ~1-3 minutes on one CPU core
    python bench/kernel_sass.py --out /tmp/sass   # also writes NAME.cubin, NAME.sass, NAME.json

The figures before issue 12 come from commit 8947f01 (this script with a description of the old
kernel's launches): `git archive 8947f01 | tar -x -C /tmp/before && python /tmp/before/bench/kernel_sass.py`.
"""
import argparse
import importlib
import json
import os
import re
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
os.environ.pop("TRITON_INTERPRET", None)  # compile for real, whatever the caller's environment says
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

N = K = 8192  # the problem the signature is built for
ISSUE_LIMIT = 132 * 4 * 1.98e9 * 32 / (4.8e12 / 0.5625)  # thread instructions per weight at 4.8 TB/s


def _tool(name):
    path = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)
    if not os.path.exists(path):
        raise SystemExit(f"kernel_sass: {path} not found; this Triton wheel does not ship {name}")
    return path


# -----------------------------------------------------------------------------
# Compiling one configuration


def signature(kmod, job):
    """(signature, constexprs, attrs) for ASTSource, as the launcher specializes them: pointers and
    ints that are multiples of 16 carry tt.divisibility 16 (M, which is small at decode, does not)."""
    kernel, ptr_types, ints, consts = kmod.sass_launch(job, N, K)
    names = kernel.arg_names
    sig, attrs = {}, {}
    for i, name in enumerate(names):
        if name in consts:
            sig[name] = "constexpr"
        elif name in ptr_types:
            sig[name] = "*" + ptr_types[name]
            attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            sig[name] = "i32"
            if ints[name] % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
    return kernel, sig, consts, attrs


def compile_config(kmod, job):
    kernel, sig, consts, attrs = signature(kmod, job)
    src = ASTSource(fn=kernel, signature=sig, constexprs=consts, attrs=attrs)
    opts = dict(num_warps=job["num_warps"], num_stages=job["num_stages"])
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts)


# -----------------------------------------------------------------------------
# Reading the cubin


def resource_usage(cubin_path):
    out = subprocess.run([_tool("cuobjdump"), "-res-usage", cubin_path], capture_output=True,
                         text=True, check=True).stdout
    fields = dict(re.findall(r"(REG|STACK|SHARED|LOCAL):(\d+)", out))
    return {k.lower(): int(v) for k, v in fields.items()}


INSTR = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
LABEL = re.compile(r"^\s*(\.L_x_\d+):")
MMA = ("HMMA", "HGMMA", "IMMA", "DMMA")


def sass_lines(cubin_path):
    return subprocess.run([_tool("nvdisasm"), "-c", cubin_path], capture_output=True, text=True,
                          check=True).stdout


def main_loop(sass):
    """(instructions, mma opcodes) of the main loop: among the backward branches (a BRA to an earlier
    label), the one whose body holds the most MMA instructions, then the longest."""
    instrs, labels = [], {}
    for line in sass.splitlines():
        m = LABEL.match(line)
        if m:
            labels[m.group(1)] = len(instrs)
            continue
        m = INSTR.search(line)
        if m:
            instrs.append(m.group(2))
    best = None
    for end, text in enumerate(instrs):
        m = re.search(r"\bBRA\b.*?(\.L_x_\d+)", text)
        if not m or labels.get(m.group(1), end + 1) > end:
            continue
        body = [t for t in instrs[labels[m.group(1)]:end + 1] if not t.endswith("NOP")]
        n_mma = sum(1 for t in body if any(op in t for op in MMA))
        key = (n_mma, len(body))
        if best is None or key > best[0]:
            best = (key, body)
    if best is None:
        return [], []
    body = best[1]
    ops = sorted({op for t in body for op in MMA if re.search(rf"\b{op}\b", t)})
    return body, ops


def opcode_histogram(body, top=8):
    counts = {}
    for t in body:
        op = re.sub(r"^@!?U?P\w+\s+", "", t).split()[0]
        counts[op] = counts.get(op, 0) + 1
    return sorted(counts.items(), key=lambda kv: -kv[1])[:top]


# -----------------------------------------------------------------------------
# Main


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="write NAME.cubin, NAME.sass and NAME.json here")
    parser.add_argument("--only", default=None, help="only configurations whose name contains this")
    parser.add_argument("--ops", action="store_true", help="also print the loop's commonest opcodes")
    args = parser.parse_args(argv)

    kmod = importlib.import_module("kernels.nvfp4_matmul")  # its sass_jobs() / sass_launch() say what to compile
    jobs = [j for j in kmod.sass_jobs() if args.only is None or args.only in j["name"]]
    if args.out:
        os.makedirs(args.out, exist_ok=True)
    tmp = args.out or os.path.join("/tmp", f"kernel_sass_{os.getpid()}")
    os.makedirs(tmp, exist_ok=True)
    print(f"kernel_sass | triton {triton.__version__} | sm_90 | {N}x{K} bf16 | issue limit "
          f"{ISSUE_LIMIT:.2f} thread instructions per weight at 4.8 TB/s", flush=True)
    worst = None
    for job in jobs:
        t0 = time.time()
        try:
            compiled = compile_config(kmod, job)
        except Exception as e:  # a configuration that does not compile is a finding, not a crash
            print(f"{job['name']:<28} | COMPILE FAILED: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
            continue
        cubin = os.path.join(tmp, job["name"] + ".cubin")
        with open(cubin, "wb") as f:
            f.write(compiled.asm["cubin"])
        res = resource_usage(cubin)
        sass = sass_lines(cubin)
        body, ops = main_loop(sass)
        per_weight = len(body) * job["num_warps"] * 32 / job["weights_per_step"]
        mma = "wgmma" if "HGMMA" in ops else ("mma.sync" if "HMMA" in ops else ("+".join(ops) or "none"))
        role = job.get("role", "decode" if job["decode"] else "prefill")
        print(f"{job['name']:<28} | {role:<7} "
              f"| warps {job['num_warps']} | stages {job['num_stages']} | regs {res.get('reg', -1):>3} "
              f"| spill {res.get('stack', 0) + res.get('local', 0):>3} B | smem {compiled.metadata.shared:>6} B "
              f"| {mma:<8} | loop {len(body):>4} instr | {job['weights_per_step']:>6} weights/step "
              f"| {per_weight:5.2f} instr/weight | {time.time() - t0:4.1f}s", flush=True)
        if args.ops:
            print("    " + "  ".join(f"{op} {n}" for op, n in opcode_histogram(body)))
        if args.out:
            with open(os.path.join(args.out, job["name"] + ".sass"), "w") as f:
                f.write(sass)
            meta = {k: job[k] for k in ("num_warps", "num_stages", "weights_per_step", "decode")}
            meta.update(name=job["name"], registers=res.get("reg"), spill_bytes=res.get("stack", 0) + res.get("local", 0),
                        shared=compiled.metadata.shared, mma=mma, loop_instructions=len(body),
                        instr_per_weight=per_weight, triton=triton.__version__)
            with open(os.path.join(args.out, job["name"] + ".json"), "w") as f:
                json.dump(meta, f, indent=1)
        if job["decode"] and (worst is None or per_weight > worst[1]):
            worst = (job["name"], per_weight, res.get("stack", 0) + res.get("local", 0))
    if worst:
        verdict = "within" if worst[1] <= 4 and worst[2] == 0 else "ABOVE"
        print(f"worst decode | {worst[0]} | {worst[1]:.2f} instr/weight | spill {worst[2]} B | {verdict} "
              f"the 4 instr/weight target (memory limit {ISSUE_LIMIT:.2f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
