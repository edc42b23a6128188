#!/usr/bin/env bash
# GPU check: the whole test suite on CUDA, then the GPU benchmarks, in under 8 minutes.
#
# What it runs, each part under its own `timeout` (and all of them under one overall deadline):
#   1. kernel_tests   pytest -x -rfE tests/test_kernels.py        (the NVFP4 kernels on CUDA first: the decode
#                                                                  kernel's PTX against the reference, bit-exact)
#   2. tests          python -m pytest -rfE tests, kernels ignored (the rest of the suite on CUDA)
#   3. kernel_qwen7b  bench/bench_kernel.py --shapes qwen7b       (fused NVFP4 matmul vs bf16 torch.matmul,
#                                                                  Qwen2.5-7B linear shapes, M 1 16 64 4096)
#   4. kernel_square  bench/bench_kernel.py --shapes square       (4096^2 and 8192^2, M 1 16 4096)
#   5. sampler_compile bench/bench_sampler.py --shape qwen2.5-7b --layers 2 (generate() decode tok/s, eager
#                                                                  vs torch.compile + CUDA graphs, bf16 and NVFP4)
#   6. grpo_7b_smoke  bench/bench_update_memory.py --smoke        (3 steps of 05, Qwen2.5-7B widths, 4 layers)
#   7. kernel_ncu     Nsight Compute on the decode kernel, 8192x8192, M = 1 (only when `ncu` exists)
#   8. rollout_7b     bench/bench_rollout.py --shape qwen2.5-7b   (generate() tok/s, bf16 vs NVFP4, random 7B)
#   9. memory         bench/bench_memory.py                       (LoRA step peak memory, none/nf4/nvfp4)
#  10. kernel_tutorial kernels/nvfp4_matmul.py                    (part one's demo: general kernel vs dequantize
#                                                                  + matmul, then vs bf16 torch.matmul, 8192^2)
#  11. kernel_sass    bench/kernel_sass.py --out $OUT/sass        (the machine code this Triton makes, sm_90)
# then prints one summary. Logs go to $OUT (if set) or ./gpu_check_out/. It always exits 0: a part that
# fails or times out is listed as such. Without a CUDA GPU it says so and exits 0.
# The tests run the general kernel with fixed tiles (QERL_NVFP4_TILES) instead of autotuning every test
# shape; the benchmarks autotune and print the autotuner's pick (TRITON_PRINT_AUTOTUNING=1).
# To add a part: one `run_part NAME CAP_SECONDS COMMAND...` line below, and (optionally) a few lines
# in the summary that read its log through part_log NAME.
#
#   bash bench/gpu_check.sh                   # from anywhere; runs in the repository root
#   GPU_CHECK_DEADLINE_S=300 bash bench/gpu_check.sh
#
# Setup on a bare machine: torch is only installed when it is missing, and then only through
# requirements.txt (which pins torch==2.13.0: never an unpinned torch). A machine without internet
# makes pip fail fast (short timeout, one retry); pip's own PIP_* settings (PIP_NO_INDEX,
# PIP_FIND_LINKS, ...) are respected, and a local ./.whl wheel folder is used when present.
set -u
cd "$(dirname "$0")/.." || exit 0
export PYTHONUNBUFFERED=1

OUT_DIR="${OUT:-./gpu_check_out}"
mkdir -p "$OUT_DIR"
SETUP_LOG="$OUT_DIR/0_setup.log"
SUMMARY="$OUT_DIR/summary.txt"
: > "$SETUP_LOG"
DEADLINE_S="${GPU_CHECK_DEADLINE_S:-465}"   # 8 minutes minus a margin for the summary
SECONDS=0

log() { echo "$*" | tee -a "$SETUP_LOG"; }

# ---------------------------------------------------------------------------------------------------
# Python and packages (best effort)

# $PYTHON if given; else the project's .venv when it has torch (a dev machine); else python3.
if [ -n "${PYTHON:-}" ]; then
    PY="$PYTHON"
elif [ -x .venv/bin/python ] && .venv/bin/python -c "import torch" >/dev/null 2>&1; then
    PY=.venv/bin/python
else
    PY=python3
fi
if ! command -v "$PY" >/dev/null 2>&1; then
    log "gpu_check: no Python interpreter ($PY) found; nothing to run"
    exit 0
fi

PIP_OPTS=(-q --disable-pip-version-check --retries 1 --timeout 15)
[ -d .whl ] && PIP_OPTS+=(--find-links .whl)

if ! "$PY" -c "import torch" >/dev/null 2>&1; then
    log "setup | torch missing: pip install -r requirements.txt (pins torch==2.13.0; best effort, 300 s max)"
    timeout -k 10 300 "$PY" -m pip install "${PIP_OPTS[@]}" -r requirements.txt >>"$SETUP_LOG" 2>&1 \
        || log "setup | pip install -r requirements.txt failed (no internet?); see $SETUP_LOG"
fi
if ! "$PY" -c "import torch" >/dev/null 2>&1; then
    log "gpu_check: torch is not importable with $PY and could not be installed; nothing to run"
    exit 0
fi
# The other requirements, one at a time and only if missing. Not triton: an unpinned triton can break
# the torch it came with (CUDA torch wheels ship a matching one); without it the kernel parts say so.
for mod in numpy safetensors tokenizers pytest; do
    if ! "$PY" -c "import $mod" >/dev/null 2>&1; then
        log "setup | $mod missing: pip install $mod (best effort)"
        timeout -k 10 120 "$PY" -m pip install "${PIP_OPTS[@]}" "$mod" >>"$SETUP_LOG" 2>&1 \
            || log "setup | could not install $mod"
    fi
done

"$PY" - >>"$SETUP_LOG" 2>&1 <<'EOF'
import platform, sys, torch
print(f"python {platform.python_version()} ({sys.executable}) | torch {torch.__version__} "
      f"| cuda {torch.version.cuda} | cuda available {torch.cuda.is_available()}")
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print(f"gpu {p.name} | sm_{p.major}{p.minor} | {p.total_memory / 2**30:.0f} GiB | {p.multi_processor_count} SMs")
try:
    import triton
    print(f"triton {triton.__version__}")
except ImportError:
    print("triton MISSING: the kernel tests and benchmarks will fail or skip")
EOF
command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >>"$SETUP_LOG" 2>&1
cat "$SETUP_LOG"

if ! "$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" >/dev/null 2>&1; then
    echo "gpu_check: no CUDA GPU visible to torch ($PY): nothing to check here. Run this on a GPU machine."
    exit 0
fi

# ---------------------------------------------------------------------------------------------------
# The parts

NAMES=(); STATUS=(); TIMES=(); LOGS=()

# run_part NAME CAP_SECONDS COMMAND...: runs COMMAND with a timeout of min(CAP, time left), logs to
# $OUT_DIR/<n>_NAME.log, records ok / FAIL (rc N) / TIMEOUT / SKIPPED.
run_part() {
    local name="$1" cap="$2"
    shift 2
    local n=$(( ${#NAMES[@]} + 1 ))
    local logf="$OUT_DIR/${n}_${name}.log"
    local left=$(( DEADLINE_S - SECONDS ))
    local t=$(( cap < left ? cap : left ))
    NAMES+=("$name"); LOGS+=("$logf")
    if [ "$t" -lt 20 ]; then
        echo "part $name | SKIPPED: only ${left}s left of the ${DEADLINE_S}s budget" | tee "$logf"
        STATUS+=("SKIPPED (no time left)"); TIMES+=(0)
        return
    fi
    echo ""
    echo "=== part $n: $name (timeout ${t}s) | $*" | tee "$logf"
    local t0=$SECONDS rc
    timeout -k 10 "$t" "$@" 2>&1 | tee -a "$logf"
    rc=${PIPESTATUS[0]}
    TIMES+=($(( SECONDS - t0 )))
    if [ "$rc" -eq 0 ]; then
        STATUS+=("ok")
    elif [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
        STATUS+=("TIMEOUT after ${t}s")
    else
        STATUS+=("FAIL (rc $rc)")
    fi
}

# part_log NAME: the log file of an earlier part (empty if it did not run).
part_log() {
    local i
    for i in "${!NAMES[@]}"; do [ "${NAMES[$i]}" = "$1" ] && { echo "${LOGS[$i]}"; return; }; done
    echo ""
}

NCU_PY='
import sys, torch
sys.path.insert(0, ".")
from quant_engine import kernel_module
nvfp4_matmul = kernel_module("nvfp4_decode").nvfp4_matmul
g = torch.Generator().manual_seed(0)
packed = torch.randint(0, 256, (8192, 4096), generator=g, dtype=torch.uint8).cuda()
scale = (torch.rand(8192, 512, generator=g) * 300 + 16).to(torch.float8_e4m3fn).cuda()
gs, x = torch.tensor([2688.0 * 30]).cuda(), torch.randn(1, 8192, generator=g).cuda().bfloat16()
for _ in range(3):
    nvfp4_matmul(x, packed, scale, gs)
torch.cuda.synchronize()
'
run_ncu() {
    if ! command -v ncu >/dev/null 2>&1; then
        echo "ncu not found: no Nsight Compute profile"
        return 0
    fi
    ncu --kernel-name regex:nvfp4_decode --launch-skip 2 --launch-count 1 \
        --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats --section Occupancy \
        --export "$OUT_DIR/ncu_decode_8192_m1" --force-overwrite --print-summary none "$PY" -c "$NCU_PY" \
        && ncu --import "$OUT_DIR/ncu_decode_8192_m1.ncu-rep" --page details
}

export PY OUT_DIR NCU_PY
export -f run_ncu
run_part kernel_tests 120 env QERL_NVFP4_TILES=64,64,64 "$PY" -m pytest -x -rfE -p no:cacheprovider \
    tests/test_kernels.py
run_part tests 130 env QERL_NVFP4_TILES=64,64,64 "$PY" -m pytest -q -rfE -p no:cacheprovider tests \
    --ignore=tests/test_kernels.py
run_part kernel_qwen7b 80 env TRITON_PRINT_AUTOTUNING=1 "$PY" bench/bench_kernel.py --shapes qwen7b \
    --m 1 16 64 4096 --warmup 10 --rep 50
run_part kernel_square 45 env TRITON_PRINT_AUTOTUNING=1 "$PY" bench/bench_kernel.py --shapes square \
    --m 1 16 4096 --warmup 10 --rep 50
# The newer parts first (the deadline skips what does not fit), then the older benchmarks.
# Stage 03's sampler, eager loop vs the compiled static-shape decode step, at Qwen2.5-7B's layer shapes (2 of
# its 28 layers keep the compile short; tok/s is then per 2 layers + embeddings + lm_head).
run_part sampler_compile 110 "$PY" bench/bench_sampler.py --device cuda --shape qwen2.5-7b --layers 2 \
    --quants none,nvfp4 --batch 16 --prompt-len 128 --new-tokens 64 --repeats 2 --no-hf

# --- grpo_7b_smoke (issue 13): 3 steps of 05_grpo.py on CUDA, random model folder with Qwen2.5-7B's widths and
# 4 layers, 4 prompts x 8 samples x 256 new tokens, micro-batch 8 + checkpointing; s/step and peak GPU memory.
# Rewards alternate 0, 1, 0, ... (a random model's are all 0, and no update would run). Self-contained.
SMOKE_DIR="${TMPDIR:-/tmp}/qerl-random-qwen7b-4l"  # ~4 GB: not under $OUT_DIR, removed after
run_part grpo_7b_smoke 150 bash -c "'$PY' bench/bench_update_memory.py --write-model '$SMOKE_DIR' --layers 4 \
    && '$PY' bench/bench_update_memory.py --smoke '$SMOKE_DIR' -- --steps 3 --batch 4 --group 8 \
       --max-new-tokens 256 --micro-batch 8 --grad-checkpoint --eval-size 0 --save-every 0 --time-budget 0 \
       --out '$OUT_DIR/grpo_7b_smoke_run'; rc=\$?; rm -rf '$SMOKE_DIR'; exit \$rc"

run_part kernel_ncu 60 bash -c run_ncu
run_part rollout_7b 170 "$PY" bench/bench_rollout.py --shape qwen2.5-7b --quants none,nvfp4 --batches 1,16 \
    --prompt-len 128 --decode-steps 32 --repeats 2
run_part memory 60 "$PY" bench/bench_memory.py --configs none,nf4,nvfp4 --shape 350m --dtype bf16

# Part one of the kernel tutorial as a reader runs it (autotunes: one tuning per dtype and shape).
run_part kernel_tutorial 120 "$PY" kernels/nvfp4_matmul.py

# CPU-only and reproducible anywhere, so last: the machine code this Triton version makes for sm_90.
run_part kernel_sass 40 "$PY" bench/kernel_sass.py --out "$OUT_DIR/sass"

# ---------------------------------------------------------------------------------------------------
# Summary (also written to $OUT_DIR/summary.txt)

{
    echo ""
    echo "=================================== gpu_check summary ==================================="
    grep -E "^(python|gpu |triton)" "$SETUP_LOG" || true
    printf "%-15s | %-24s | %6s | %s\n" "part" "status" "sec" "log"
    failed=()
    for i in "${!NAMES[@]}"; do
        printf "%-15s | %-24s | %6s | %s\n" "${NAMES[$i]}" "${STATUS[$i]}" "${TIMES[$i]}" "${LOGS[$i]}"
        [ "${STATUS[$i]}" = "ok" ] || failed+=("${NAMES[$i]}")
    done
    echo "total ${SECONDS}s"
    if [ ${#failed[@]} -gt 0 ]; then
        echo "FAILED / incomplete parts: ${failed[*]} (see their logs)"
    else
        echo "all parts ok"
    fi

    echo ""
    echo "-- kernel tests: $(grep -E '(passed|failed|error)' "$(part_log kernel_tests)" 2>/dev/null | tail -n 1)"
    echo "-- other tests: $(grep -E '(passed|failed|error)' "$(part_log tests)" 2>/dev/null | tail -n 1)"

    echo ""
    echo "-- kernel machine code (sm_90, this machine's Triton)"
    [ -f "$(part_log kernel_sass)" ] && grep -E "^(kernel_sass|decode|general|worst)" "$(part_log kernel_sass)" | cut -c1-160

    echo ""
    echo "-- kernel tutorial (kernels/nvfp4_matmul.py: the general kernel alone)"
    [ -f "$(part_log kernel_tutorial)" ] && grep -E "^(check|timing) +\|" "$(part_log kernel_tutorial)" | cut -c1-200

    echo ""
    echo "-- autotuner picks"
    cat "$(part_log kernel_qwen7b)" "$(part_log kernel_square)" 2>/dev/null | grep -iE "best config|finished" | sort | uniq -c | head -n 20

    echo ""
    echo "-- NVFP4 kernel vs bf16 torch.matmul (microseconds; x = bf16 time / nvfp4 time)"
    printf "%-13s %-12s %5s | %9s %9s %9s | %7s\n" "layer" "N x K" "M" "nvfp4" "bf16" "deq+mm" "speedup"
    for f in "$(part_log kernel_qwen7b)" "$(part_log kernel_square)"; do
        [ -f "$f" ] || continue
        sed -nE 's/^ *([^ ]+) +([0-9]+x[0-9]+) *\| M +([0-9]+) \| us nvfp4 +([0-9.]+) bf16 +([0-9.]+) deq\+mm +([0-9.]+) .*vs bf16 nvfp4 +([0-9.]+x).*/\1 \2 \3 \4 \5 \6 \7/p' "$f" |
            while read -r name shape m a b c x; do
                printf "%-13s %-12s %5s | %9s %9s %9s | %7s\n" "$name" "$shape" "$m" "$a" "$b" "$c" "$x"
            done
    done

    echo ""
    echo "-- Nsight Compute, decode kernel, 8192x8192, M = 1"
    [ -f "$(part_log kernel_ncu)" ] && grep -E "Duration|DRAM Throughput|Memory Throughput|Achieved Occupancy|Registers Per|ncu not found" "$(part_log kernel_ncu)" | head -n 12

    echo ""
    echo "-- rollout tok/s, random Qwen2.5-7B-shaped model (bench_rollout.py)"
    [ -f "$(part_log rollout_7b)" ] && sed -n '/^summary |/,$p' "$(part_log rollout_7b)"

    echo ""
    echo "-- LoRA training-step memory (bench_memory.py)"
    [ -f "$(part_log memory)" ] && sed -n '/^max_memory_allocated/,$p' "$(part_log memory)"

    echo ""
    echo "-- sampler decode tok/s, eager vs compiled (bench_sampler.py, Qwen2.5-7B layer shapes, 2 layers)"
    f="$(part_log sampler_compile)"
    [ -f "$f" ] && grep -E '^(compile|error) \|' "$f" && sed -n '/^summary |/,$p' "$f"

    echo ""
    echo "-- 05_grpo.py on CUDA, Qwen2.5-7B widths, 4 layers (grpo_7b_smoke)"
    f="$(part_log grpo_7b_smoke)"
    [ -f "$f" ] && grep -hE "^(model|step [0-9]|smoke) \|" "$f"
} | tee "$SUMMARY"
exit 0
