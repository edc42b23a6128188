"""Where one GRPO step's time goes on a real model: the sampler per decode step, the update per micro-batch.

A step is B x G completions sampled under AQN, then one update over the rows with signal. This script builds
the policy with stage 05's own functions (default: SmolLM2-135M-Instruct, NVFP4 + LoRA r16 + AQN, --batch 4
--group 8 --max-new-tokens 48, the documented run's settings), runs one unmeasured step, then profiles:
  sampler  `sample_groups` under torch.profiler: the aten ops by self time, sorted into matmuls, attention,
           the KV-cache write, sampling (softmax, multinomial and the rest of sample_next's ops over the
           vocabulary), dequantization and elementwise work, and "host" (the wall time no op accounts for:
           Python, dispatch), per decode step;
  update   `policy_update` on every row (rewards 0, 1, 0, 1, ...: every group has signal) the same way, per micro-batch (forward with log-probs, backward, AdamW), with the
           dequantization of the 4-bit weights as its own row.
  check    `check_step`, 05's look after each update (finiteness, and the no-grad forward over 16 rows for kl_after that 05 runs with --kl-after-rows 16),
           timed only, with its share of the step.
Each phase's wall time is the median of --repeats runs outside the profiler (the profiler adds its own cost).

    python bench/profile_step.py                                   # SmolLM2 in --dtype auto, ~2 min
    python bench/profile_step.py --dtype float32                   # the same in fp32
    python bench/profile_step.py --model assets/tiny-qwen -- --task arithmetic --max-new-tokens 42
    python bench/profile_step.py -- --micro-batch 8                # after --: any qerl/train.py flag

Needs `make smollm2` for the default model (assets/smollm2-135m-instruct).
"""
import importlib
import os
import statistics
import sys
import tempfile
import time
from collections import defaultdict

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
cli = importlib.import_module("qerl.cli")
devices = importlib.import_module("qerl.devices")
tasks = importlib.import_module("qerl.tasks")
memory = importlib.import_module("qerl.memory")
grpo = importlib.import_module("qerl.train")

SMOLLM2 = os.path.join(ROOT, "assets", "smollm2-135m-instruct")
SMOLLM2_FLAGS = ["--task", "chat-arithmetic", "--quant", "nvfp4", "--batch", "4", "--group", "8",
                 "--max-new-tokens", "48", "--temperature", "0.7", "--lr", "5e-4"]

# aten op name -> the row it is counted in (by self time); anything else is "elementwise and other".
CATEGORIES = {
    "matmul": ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::_mkldnn_mm", "mkldnn::"),
    "attention": ("aten::_scaled_dot_product", "aten::_flash_attention", "sdpa"),
    "KV-cache write": ("aten::index_copy",),
    "softmax, log-softmax, sampling": ("aten::_log_softmax", "aten::_softmax", "aten::multinomial", "aten::topk",
                                       "aten::sort", "aten::argmax", "aten::gather", "aten::_log_softmax_backward",
                                       "aten::exponential_", "aten::cumsum"),
    "dequantize (LUT gather)": ("aten::index",),
    "AdamW": ("aten::_foreach", "aten::_fused_adam"),
}


TOP_OPS = [0]  # --top: also print that many ops by self time


def category(name):
    for cat, prefixes in CATEGORIES.items():
        if any(name.startswith(p) for p in prefixes):
            return cat
    return "elementwise and other"


def profile(fn):
    """fn() under the profiler -> {row: its share of the wall time}, "host" being the wall time no op accounts
    for (Python, dispatch, waiting)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        fn()
        wall = time.perf_counter() - t0
    shares = defaultdict(float)
    if TOP_OPS[0]:
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=TOP_OPS[0]))
    for ev in prof.key_averages():
        shares[category(ev.key)] += ev.self_cpu_time_total / 1e6 / wall
    shares["host (Python, dispatch: wall - ops)"] = max(0.0, 1.0 - sum(shares.values()))
    return dict(shares)


def timed(fn, repeats):
    """Median wall seconds of `repeats` calls of fn (outside the profiler)."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def print_rows(title, wall, shares, per, per_name):
    """The profile's shares applied to the median wall time `wall`, also per decode step or micro-batch."""
    print(f"\n{title}: {wall:.3f} s (median of the unprofiled runs)")
    print(f"| where | s | share | ms per {per_name} |")
    print("|---|---|---|---|")
    for name, share in sorted(shares.items(), key=lambda kv: -kv[1]):
        print(f"| {name} | {share * wall:.3f} | {share:.0%} | {1e3 * share * wall / max(per, 1):.1f} |")


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    passthrough = argv[argv.index("--") + 1:] if "--" in argv else []
    own = argv[:argv.index("--")] if "--" in argv else argv
    p = cli.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=SMOLLM2, help="Hugging Face model folder (default: SmolLM2, `make smollm2`)")
    p.add_argument("--dtype", default="auto", help="05's --dtype (auto, float32, bfloat16)")
    p.add_argument("--threads", type=cli.number(int, 1, 256), default=None, help="torch threads (default: torch's)")
    p.add_argument("--repeats", type=cli.number(int, 1, 20), default=3, help="timed runs per phase (median)")
    p.add_argument("--top", type=cli.number(int, 0, 100), default=0, help="also print the N ops of most self time")
    a = p.parse_args(own)
    TOP_OPS[0] = a.top
    if not os.path.isdir(a.model):
        p.error(f"no model folder at {a.model}" + (": run `make smollm2` first" if a.model == SMOLLM2 else ""))
    if a.threads:
        torch.set_num_threads(a.threads)
    flags = (SMOLLM2_FLAGS if a.model == SMOLLM2 else []) + passthrough
    args = grpo.build_parser().parse_args(["--model", a.model, "--dtype", a.dtype, *flags])
    with tempfile.TemporaryDirectory() as scratch:  # check_args checks a run folder; this script writes none
        args.out = scratch
        grpo.check_args(args, 1)
    device = str(devices.pick_device(args.device))
    task = tasks.make_task(args, grpo.parser_defaults())
    model, tok, params, opt = grpo.build_policy(args, device)
    opts = grpo.update_options(args)
    dtype = model.model.embed_tokens.weight.dtype
    print(f"model {os.path.basename(a.model)} | device {device} | dtype {str(dtype).replace('torch.', '')} | "
          f"threads {torch.get_num_threads()} | quant {args.quant} | B {args.batch} x G {args.group} | "
          f"max new tokens {args.max_new_tokens}")

    problems = task.problems(args.seed, 1, args.batch)
    prompts = [tok.encode(task.prompt(p)) for p in problems]
    sigma = grpo.step_sigma(args, 1)

    def sample():
        return grpo.sample_groups(model, tok, prompts, 1, sigma, **grpo.sampling_options(args))[0]

    samples = sample()  # and a warm-up (first-call costs, the allocator), with update() below
    # rewards 0, 1, 0, 1, ...: every group has signal, so the update trains all B x G rows (a step's worst case,
    # and the same work whatever the samples scored)
    rewards = torch.arange(len(samples.prompt_ids)).remainder(2).float()
    mask = samples.completion_mask.float().clone()

    def update():
        return grpo.policy_update(model, opt, params, samples.prompt_ids, samples.completion_ids.clone(), mask,
                                  samples.logprobs.float().clone(), rewards, **opts)

    report = update()

    def check():  # 05 Part 2's check after each update: one forward (no grad) over the first 16 rows
        return grpo.check_step(1, model, params, samples, mask, report, args.temperature)

    check()

    steps = samples.stats["decode_steps_run"]
    rows = int((rewards.view(-1, args.group).std(1) > 0).sum()) * args.group
    micro = memory.micro_batch_rows(opts["update_options"].micro_batch, rows, model,
                                  max(map(len, samples.prompt_ids)) + int(mask.sum(1).max()))
    n_micro = -(-rows // micro)
    t_sample, t_update, t_check = timed(sample, a.repeats), timed(update, a.repeats), timed(check, a.repeats)
    print_rows(f"sampler, {len(samples.prompt_ids)} rows x {steps} decode steps", t_sample, profile(sample), steps,
               "decode step")
    print_rows(f"update, {rows} rows of {int(mask.sum(1).max())} tokens at most, in {n_micro} micro-batches of "
               f"{micro}", t_update, profile(update), n_micro, "micro-batch")
    peak = devices.peak_rss_bytes() / 2 ** 30
    step = t_sample + t_update + t_check
    print(f"\nstep | sampling {t_sample:.2f} s | update {t_update:.2f} s | check {t_check:.2f} s "
          f"({t_check / step:.1%} of the step, {t_check / t_update:.1%} of the update) | peak RSS {peak:.2f} GB")


if __name__ == "__main__":
    cli.run_cli(main)
