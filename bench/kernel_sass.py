"""What the fused NVFP4 kernels cost on Hopper, read from their machine code, without a GPU.

Every CUDA configuration of kernels/nvfp4_decode.py (the decode kernel) and kernels/nvfp4_matmul.py
(the general kernel) is compiled ahead of time for sm_90 with the `ptxas` that ships in Triton's
wheel, for the signature the wrapper launches on an 8192x8192 weight (decode configurations with a
small M, the others with M = 4096). The cubin is read back with `cuobjdump -res-usage` (registers,
stack) and `nvdisasm` (SASS), and the main loop (the largest backward branch holding the MMA
instructions) is counted. x is bf16 except for the general kernel's 16-row tiles, which only serve
fp32 x (their rows say "fp32 x"; 16-bit x at M <= 16 takes the decode kernel).

Why instructions per weight. At decode the kernel must stream the weight at memory speed. An H200
issues 132 SMs x 4 schedulers x 1.98 GHz warp instructions per second (x 32 = thread instructions)
and reads 4.8 TB/s; at 0.5625 bytes per NVFP4 weight that leaves 33.4e12 / 8.53e12 = 3.9 thread
instructions per weight. Above that the kernel is bound by issue, not by memory.

    loop instructions x warps x 32 / weights one program handles per loop iteration

One line per configuration (`|`-separated fields); the last line names the worst decode figure.
These are counts read from machine code, not timings: bench/bench_kernel.py times on a GPU.

    python bench/kernel_sass.py                   # ~1-3 minutes on one CPU core
    python bench/kernel_sass.py --out /tmp/sass   # also writes NAME.cubin, NAME.sass, NAME.json
"""
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
cli = importlib.import_module("qerl.cli")

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

quant_engine = importlib.import_module("qerl.quant_engine")  # loads kernels/ by path (HF's `kernels` shares its name)
general = quant_engine.kernel_module("nvfp4_matmul")  # part one: the general kernel
decode = quant_engine.kernel_module("nvfp4_decode")  # part two: the decode kernel

N = K = 8192  # the problem the signature is built for
ISSUE_LIMIT = 132 * 4 * 1.98e9 * 32 / (4.8e12 / 0.5625)  # thread instructions per weight at 4.8 TB/s


def _tool(name):
    path = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)
    if not os.path.exists(path):
        raise SystemExit(f"kernel_sass: {path} not found; this Triton wheel does not ship {name}")
    return path


# -----------------------------------------------------------------------------
# What to compile: every CUDA configuration, with the signature the wrappers launch


def sass_jobs():
    """One dict per configuration: name, kernel ("decode" / "general"), warps, stages, tiles, and
    the weights one program handles per loop iteration."""
    jobs = []
    for bm, tiles in sorted(decode.DECODE_TILES.items()):
        for bn, bk, warps, stages in tiles:
            jobs.append(dict(name=f"decode_{bm}x{bn}x{bk}_w{warps}_s{stages}", kernel="decode", num_warps=warps,
                             num_stages=stages, weights_per_step=bn * bk, decode=True,
                             tiles=dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk)))
    for c in general.CUDA_CONFIGS:
        bm, bn, bk = (c.kwargs[key] for key in ("BLOCK_M", "BLOCK_N", "BLOCK_K"))
        jobs.append(dict(name=f"general_{bm}x{bn}x{bk}_w{c.num_warps}_s{c.num_stages}", kernel="general",
                         num_warps=c.num_warps, num_stages=c.num_stages, weights_per_step=bn * bk,
                         decode=False, role="fp32 x" if bm == 16 else "prefill", tiles=dict(c.kwargs)))
    return jobs


def sass_launch(job, n, k):
    """(kernel, pointer dtypes, int arguments, constexprs) as the wrapper would launch `job` for a
    bf16 x (fp32 for the "fp32 x" tiles) and an n x k weight."""
    if job["kernel"] == "decode":
        m = 4  # not 1 (Triton would specialise it) and not a multiple of 16
        ptrs = dict(x_ptr="bf16", w_ptr="i32", s_ptr="u8", gs_ptr="fp32", b_ptr="fp32", y_ptr="bf16",
                    part_ptr="fp32", cnt_ptr="i32")
        ints = dict(M=m, N=n, K=k, KW=k // 8, stride_xm=k, stride_wn=k // 8, stride_sn=k // 16, stride_ym=n)
        consts = dict(HAS_BIAS=False, USE_ASM=True, SCALE_FAST=True, IS_F16=False, EVEN_K=True, SPLIT_K=1,
                      **job["tiles"])
        return decode._nvfp4_decode_kernel, ptrs, ints, consts
    fp32 = job["role"] == "fp32 x"
    m, xdt = (4, "fp32") if fp32 else (4096, "bf16")
    ptrs = dict(x_ptr=xdt, w_ptr="u8", s_ptr="u8", gs_ptr="fp32", b_ptr="fp32", y_ptr=xdt)
    ints = dict(M=m, N=n, K=k, KB=k // 2, stride_xm=k, stride_wn=k // 2, stride_sn=k // 16, stride_ym=n,
                stride_ysplit=0, M_BUCKET=general._m_bucket(m))
    consts = dict(HAS_BIAS=False, DOT_FP32=fp32, FP8_NATIVE=True, SPLIT_K=1, GROUP_M=8, **job["tiles"])
    return general._nvfp4_matmul_kernel, ptrs, ints, consts


# -----------------------------------------------------------------------------
# Compiling one configuration


def signature(job):
    """(signature, constexprs, attrs) for ASTSource, as the launcher specializes them: pointers and
    ints that are multiples of 16 carry tt.divisibility 16 (M, which is small at decode, does not)."""
    kernel, ptr_types, ints, consts = sass_launch(job, N, K)
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


def compile_config(job):
    kernel, sig, consts, attrs = signature(job)
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
    parser = cli.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="write NAME.cubin, NAME.sass and NAME.json here")
    parser.add_argument("--only", default=None, help="only configurations whose name contains this")
    parser.add_argument("--ops", action="store_true", help="also print the loop's commonest opcodes")
    args = parser.parse_args(argv)

    jobs = [j for j in sass_jobs() if args.only is None or args.only in j["name"]]
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
            compiled = compile_config(job)
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
    sys.exit(cli.run_cli(main))
