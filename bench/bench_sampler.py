"""Decode speed of stage 03's sampler: its decode step run eager vs through torch.compile, against
Hugging Face transformers' `generate` on the same random weights.

Every call is a whole greedy `generate` (prefill + N decode steps, no EOS so every row runs all N
steps), timed as wall-clock time; tok/s = rows * N / seconds. The three samplers run one after the
other inside each repeat, so a busy machine slows all three alike, and the ratios are taken per repeat
(the median is reported). The compiled sampler's first call traces and compiles: that one-time cost is
reported on its own line and kept out of the timed repeats. transformers is not a project dependency:
the HF side runs in whatever interpreter `--hf-python` names (default: this one) and is skipped with a
message when transformers is not importable there. Both sides load the same safetensors file, and the
script reports whether their greedy tokens agree.

    python bench/bench_sampler.py                                      # CPU, the README's table (~3 min)
    python bench/bench_sampler.py --hf-python /path/to/hf-venv/bin/python
    python bench/bench_sampler.py --device cuda --shape qwen2.5-7b --layers 2 --quants none,nvfp4 --no-hf
    python bench/bench_sampler.py --device cuda --shape qwen2.5-7b --layers 2 --quants nvfp4 --no-hf --lora 32
    python bench/bench_sampler.py --kv-vs-recompute                    # KV cache vs recomputing the prefix
    python bench/bench_sampler.py --model assets/smollm2-135m-instruct --batch 8 --new-tokens 64 --hf-python ...

Default model (CPU): random Qwen2, vocab 4096, hidden 256, 4 layers, 8 query / 2 KV heads, fp32; batch
16, 32-token prompts, 96 new tokens, 1 thread (two busy threads on a shared 2-core machine make timings
swing). --kv-vs-recompute measures one decode step at several context lengths with the KV cache vs
re-running the whole prefix, which is what the cache buys (O(N) instead of O(N^2) token-forwards).
"""
import argparse
import importlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
cli = importlib.import_module("qerl.cli")
devices = importlib.import_module("qerl.devices")
hf_files = importlib.import_module("qerl.hf_files")

# The shape of the README's comparison; --shape may also name any shape of bench_rollout.py.
SMALL = dict(vocab_size=4096, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
             num_attention_heads=8, num_key_value_heads=2, head_dim=32)


# ---------------------------------------------------------------------------------------------------
# The transformers side: this same file, run with --hf-worker in the interpreter that has transformers

def hf_worker(folder, threads):
    """Serve timed greedy HF generate calls: one line "run" on stdin -> one JSON line on stdout."""
    if threads:
        torch.set_num_threads(threads)
    from transformers import AutoModelForCausalLM
    job = json.load(open(os.path.join(folder, "job.json")))
    dtype = getattr(torch, job.get("dtype", "float32"))  # the same dtype as our side
    try:
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).eval()
    except TypeError:  # transformers < 4.56 names it torch_dtype
        model = AutoModelForCausalLM.from_pretrained(folder, torch_dtype=dtype).eval()
    ids = torch.tensor(job["prompts"])  # (B, P), no padding: every prompt has the same length
    n = job["new_tokens"]
    print(json.dumps({"ready": True, "transformers": importlib.import_module("transformers").__version__}), flush=True)
    for line in sys.stdin:
        if line.strip() != "run":
            break
        t0, c0 = time.perf_counter(), time.process_time()
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n,
                                 min_new_tokens=n, pad_token_id=0)
        s, cpu = time.perf_counter() - t0, time.process_time() - c0
        print(json.dumps({"s": s, "cpu": cpu, "tokens": out[:, ids.shape[1]:].tolist()}), flush=True)


def write_hf_folder(model, folder):
    """config.json + model.safetensors in HF's Qwen2 layout (our module names are HF's)."""
    from safetensors.torch import save_file
    c = model.config
    cfg = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "vocab_size": c.vocab_size,
           "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
           "num_hidden_layers": c.num_hidden_layers, "num_attention_heads": c.num_attention_heads,
           "num_key_value_heads": c.num_key_value_heads, "rms_norm_eps": c.rms_norm_eps, "rope_theta": c.rope_theta,
           "max_position_embeddings": c.max_position_embeddings, "tie_word_embeddings": c.tie_word_embeddings,
           "hidden_act": "silu", "torch_dtype": "float32", "use_sliding_window": False}
    if c.head_dim * c.num_attention_heads != c.hidden_size:
        raise ValueError("the HF comparison needs head_dim * num_attention_heads == hidden_size")
    state = {k: v.detach().float().cpu().contiguous() for k, v in model.state_dict().items()
             if not (c.tie_word_embeddings and k == "lm_head.weight")}
    save_file(state, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
    json.dump(cfg, open(os.path.join(folder, "config.json"), "w"))


def start_hf(python, folder, threads):
    """The worker process, or (None, reason) when transformers is not importable with `python`."""
    probe = subprocess.run([python, "-c", "import transformers"], capture_output=True, text=True)
    if probe.returncode != 0:
        return None, (f"transformers is not importable with {python}; skipping the HF column (make a venv with "
                      f"`pip install torch==<this torch> transformers` and pass --hf-python VENV/bin/python)")
    proc = subprocess.Popen([python, os.path.abspath(__file__), "--hf-worker", folder, "--threads", str(threads)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    hello = proc.stdout.readline()
    if not hello:
        return None, "the transformers worker exited before it was ready (its error is above)"
    return proc, json.loads(hello)["transformers"]


def hf_run(proc):
    proc.stdin.write("run\n")
    proc.stdin.flush()
    return json.loads(proc.stdout.readline())


# ---------------------------------------------------------------------------------------------------
# Eager vs compiled (vs HF)

def ours(ro, model, prompts, new_tokens, compiled, sync):
    """Wall seconds of one greedy generate() and its Rollout; r.stats["cpu"] gets the CPU seconds."""
    sync()
    t0, c0 = time.perf_counter(), time.process_time()
    r = ro.generate(model, prompts, max_new_tokens=new_tokens, temperature=0.0, eos_token_ids=[], compiled=compiled)
    sync()
    r.stats["cpu"] = time.process_time() - c0
    return time.perf_counter() - t0, r


def compare(args, ro, br, device, sync):
    overrides = dict(num_hidden_layers=args.layers, max_position_embeddings=4096)
    dtype = br.DTYPES[args.dtype or ("bf16" if device.type == "cuda" else "fp32")]
    if args.model:  # a real Hugging Face folder (e.g. SmolLM2): its own weights on both sides
        try:
            raw, _, sharded = hf_files.find_weight_files(args.model)
        except (FileNotFoundError, ValueError) as e:
            raise SystemExit(f"error: --model: {e}") from None
        if sharded:
            raise SystemExit(f"error: --model {args.model} is sharded; the HF side links one model.safetensors")
        cfg = ro.ModelConfig.from_dict(raw, where=os.path.join(args.model, "config.json"))
    elif args.shape == "small":
        cfg = ro.ModelConfig(model_type="qwen2", rope_theta=1e6,
                             **{**SMALL, **{k: v for k, v in overrides.items() if v is not None}})
    else:
        cfg = br.model_config(args.shape, **overrides)
    B, N = args.batch, args.new_tokens
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, cfg.vocab_size, (B, args.prompt_len), generator=g).tolist()
    print(f"setup | {'model ' + args.model if args.model else 'shape ' + args.shape} | lora r {args.lora} | layers {cfg.num_hidden_layers} | hidden {cfg.hidden_size} | vocab "
          f"{cfg.vocab_size} | heads {cfg.num_attention_heads}/{cfg.num_key_value_heads} | batch {B} | prompt "
          f"{args.prompt_len} | new tokens {N} | greedy | device {device} | dtype {dtype} "
          f"| threads {torch.get_num_threads()} | torch {torch.__version__}", flush=True)
    rows = []
    for quant in args.quants.split(","):
        if args.model:
            model = ro.load_model(args.model, quant=quant, dtype=dtype, device=device)[0]
        else:
            model = br.build_random_model(cfg, quant=quant, dtype=dtype, device=device)
        if args.lora:  # adapters on every projection, B != 0 (as after training), unmerged: GRPO's sampler on a GPU
            lora = importlib.import_module("qerl.lora")
            lora.add_lora(model, r=args.lora, alpha=2 * args.lora, generator=torch.Generator().manual_seed(0))
            with torch.no_grad():
                for p in lora.lora_parameters(model):
                    p.normal_(0.0, 0.01)
        try:
            rows.append(one_quant(args, ro, model, quant, dtype, prompts, sync))
        except Exception as e:  # e.g. a compile failure: report it, go on with the next format
            print(f"error | quant {quant} | {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}", flush=True)
        model = None  # the last reference: free_model can then give the memory back
        br.free_model(model, device)

    print(f"summary | median of {args.repeats} repeats, tok/s = {B} rows x {N} tokens / generate() seconds; "
          f"decode = decode steps only")
    print(f"{'quant':<6} | {'eager':>8} | {'compiled':>8} | {'HF':>8} | {'compiled/eager':>14} | "
          f"{'compiled/HF':>11} | {'eager/HF':>8} | {'decode eager':>12} | {'decode compiled':>15} | {'compile s':>9}")
    for r in rows:
        hf_cols = (f"{r['hf']:8.0f} | {r['c_over_e']:13.2f}x | {r['c_over_hf']:10.2f}x | {r['e_over_hf']:7.2f}x"
                   if "hf" in r else f"{'-':>8} | {r['c_over_e']:13.2f}x | {'-':>11} | {'-':>8}")
        print(f"{r['quant']:<6} | {r['eager']:8.0f} | {r['compiled']:8.0f} | {hf_cols} | {r['dec_e']:12.0f} | "
              f"{r['dec_c']:15.0f} | {r['compile_s']:9.1f}")
        if "hf" in r:
            print(f"{r['quant']:<6} | by CPU seconds instead of wall time: compiled/HF {r['c_over_hf_cpu']:.2f}x | "
                  f"eager/HF {r['e_over_hf_cpu']:.2f}x")


def one_quant(args, ro, model, quant, dtype, prompts, sync):
    """Warm-up, then args.repeats rounds of eager, compiled (and HF) generate -> one summary row."""
    B, N = args.batch, args.new_tokens
    hf, hf_note, tmp = None, "off (--no-hf)", None
    if not args.no_hf and quant == "none" and not args.lora:
        tmp = tempfile.TemporaryDirectory()
        if args.model:  # transformers reads the folder's own config and weights
            for name in ("config.json", "model.safetensors"):
                os.symlink(os.path.abspath(os.path.join(args.model, name)), os.path.join(tmp.name, name))
        else:
            write_hf_folder(model, tmp.name)
        job = {"prompts": prompts, "new_tokens": N, "dtype": str(dtype).replace("torch.", "")}  # what hf_worker runs
        json.dump(job, open(os.path.join(tmp.name, "job.json"), "w"))
        hf, hf_note = start_hf(args.hf_python or sys.executable, tmp.name, args.threads)
        print(f"hf | {'transformers ' + hf_note if hf else hf_note}", flush=True)
    elif not args.no_hf:
        print("hf | off: the HF comparison is for the unquantized model without adapters", flush=True)
    try:
        # Warm-up: the first compiled call compiles (reported); one eager and one HF call warm their caches.
        ours(ro, model, prompts, N, False, sync)
        s_first, r_first = ours(ro, model, prompts, N, True, sync)
        compile_s = r_first.stats["compile_s"]
        print(f"compile | quant {quant} | first compiled generate {s_first:.1f} s, of which compiling "
              f"{compile_s:.1f} s (once per batch / length bucket)", flush=True)
        hf_tokens = hf_run(hf)["tokens"] if hf else None
        times = {"eager": [], "compiled": [], "hf": []}
        cpu = {"eager": [], "compiled": [], "hf": []}  # CPU seconds: steadier than wall time on a shared machine
        dec = {"eager": [], "compiled": []}
        for rep in range(args.repeats):
            s_e, r_e = ours(ro, model, prompts, N, False, sync)
            s_c, r_c = ours(ro, model, prompts, N, True, sync)
            times["eager"].append(s_e)
            times["compiled"].append(s_c)
            for k, r in (("eager", r_e), ("compiled", r_c)):
                dec[k].append(r.stats["decode_tokens"] / r.stats["decode_s"])
                cpu[k].append(r.stats["cpu"])
            line = (f"rep {rep + 1}/{args.repeats} | quant {quant} | eager tok/s {B * N / s_e:7.0f} | compiled "
                    f"tok/s {B * N / s_c:7.0f} | compiled/eager {s_e / s_c:5.2f}x | decode tok/s eager "
                    f"{dec['eager'][-1]:.0f} compiled {dec['compiled'][-1]:.0f}")
            if hf:
                res = hf_run(hf)
                times["hf"].append(res["s"])
                cpu["hf"].append(res["cpu"])
                hf_tokens = res["tokens"]
                line += (f" | hf tok/s {B * N / res['s']:7.0f} | compiled/hf {res['s'] / s_c:5.2f}x "
                         f"(cpu-s {res['cpu'] / r_c.stats['cpu']:5.2f}x) | eager/hf {res['s'] / s_e:5.2f}x")
            print(line, flush=True)
        same = torch.equal(r_e.completion_ids, r_c.completion_ids)
        print(f"check | quant {quant} | compiled greedy tokens == eager: {same} | max |logprob diff| "
              f"{(r_e.logprobs - r_c.logprobs).abs().max().item():.1e}", flush=True)
        if hf_tokens is not None:
            match = sum(a == b for a, b in zip(hf_tokens, r_e.completion_ids.tolist()))
            print(f"check | greedy rows identical to transformers' generate: {match} of {B}", flush=True)
    finally:
        if hf:
            hf.stdin.close()
            hf.wait()
        if tmp:
            tmp.cleanup()
    med = {k: statistics.median(v) for k, v in times.items() if v}
    ratio = lambda a, b: statistics.median(x / y for x, y in zip(times[b], times[a]))  # noqa: E731
    row = dict(quant=quant, eager=B * N / med["eager"], compiled=B * N / med["compiled"], compile_s=compile_s,
               c_over_e=ratio("compiled", "eager"), dec_e=statistics.median(dec["eager"]),
               dec_c=statistics.median(dec["compiled"]))
    if times["hf"]:
        row.update(hf=B * N / med["hf"], c_over_hf=ratio("compiled", "hf"), e_over_hf=ratio("eager", "hf"),
                   c_over_hf_cpu=statistics.median(h / c for h, c in zip(cpu["hf"], cpu["compiled"])),
                   e_over_hf_cpu=statistics.median(h / e for h, e in zip(cpu["hf"], cpu["eager"])))
    return row


# ---------------------------------------------------------------------------------------------------
# KV cache vs recomputing the prefix (one decode step)

def timed(fn, steps, budget_s, sync, warmup=True):
    """Seconds per call: `steps` calls, or fewer (at least one) when they exceed `budget_s`."""
    if warmup:  # first calls allocate and pick kernels; skipped where one call takes seconds anyway
        fn()
        sync()
    t0, n = time.perf_counter(), 0
    while n < steps and (n == 0 or time.perf_counter() - t0 < budget_s):
        fn()
        n += 1
    sync()
    return (time.perf_counter() - t0) / n


@torch.no_grad()
def kv_vs_recompute(args, ro, device, sync):
    torch.manual_seed(0)
    cfg = ro.ModelConfig(vocab_size=2048, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=4096)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = ro.CausalLM(cfg).to(device=device, dtype=dtype).eval()
    print(f"model | hidden {cfg.hidden_size} | layers {cfg.num_hidden_layers} | device {device} | dtype {dtype} "
          f"| threads {torch.get_num_threads()}")
    for ctx in args.contexts:
        for batch in args.batches:
            ids = torch.randint(0, cfg.vocab_size, (batch, ctx + 1), device=device)  # (B, ctx+1)
            # The cache already holds `ctx` tokens (random keys/values: decode cost does not depend on
            # them); each timed call rewinds pos so every step writes slot ctx after ctx keys.
            cache = ro.KVCache(cfg, batch, ctx + 1, device, dtype)
            for k, v in zip(cache.k, cache.v):
                k.normal_(), v.normal_()

            def cached_step():
                cache.pos.fill_(ctx)
                return model.lm_head(model.hidden_states(ids[:, ctx:], kv_cache=cache)[:, -1])  # (B, V)

            def recompute_step():
                return model.lm_head(model.hidden_states(ids)[:, -1])  # every previous token again

            t_cache = timed(cached_step, args.steps, args.budget_s, sync)
            t_full = timed(recompute_step, args.steps, args.budget_s, sync, warmup=batch * ctx <= 4096)
            print(f"context {ctx:5d} | batch {batch:3d} | kv-cache tok/s {batch / t_cache:9.0f} | recompute tok/s "
                  f"{batch / t_full:9.0f} | speedup {t_full / t_cache:7.1f}x", flush=True)


def main(argv=None):
    ro = importlib.import_module("qerl.rollout")
    br = importlib.import_module("bench_rollout")  # its random-model builder, shapes and --batches type
    N = cli.number
    ap = cli.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default=None, help="cpu | cuda (default: autodetect)")
    ap.add_argument("--shape", default="small", help="small (the default above) or a bench_rollout.py shape")
    ap.add_argument("--model", default=None, help="a Hugging Face folder with one model.safetensors (e.g. "
                    "assets/smollm2-135m-instruct) instead of random weights; prompts are random token ids")
    ap.add_argument("--layers", type=N(int, 1), default=None, help="override the shape's number of layers")
    ap.add_argument("--quants", default="none", help="comma list of none / nvfp4 / nf4")
    ap.add_argument("--lora", type=N(int, 0), default=0,
                    help="LoRA rank of unmerged adapters on every projection (0: none)")
    ap.add_argument("--dtype", default=None, choices=["fp32", "bf16", "fp16"], help="default: bf16 on CUDA, else fp32")
    ap.add_argument("--batch", type=N(int, 1), default=16)
    ap.add_argument("--prompt-len", type=N(int, 1), default=32)
    ap.add_argument("--new-tokens", type=N(int, 1), default=96)
    ap.add_argument("--repeats", type=N(int, 1), default=3)
    ap.add_argument("--hf-python", default=None, help="interpreter with transformers (default: this one)")
    ap.add_argument("--no-hf", action="store_true", help="skip the transformers column")
    ap.add_argument("--threads", type=N(int, 0), default=1, help="torch CPU threads, both sides (0: torch's default)")
    ap.add_argument("--kv-vs-recompute", action="store_true", help="the KV cache vs recompute table instead")
    ap.add_argument("--steps", type=N(int, 1), default=3, help="--kv-vs-recompute: decode steps measured per cell")
    ap.add_argument("--budget-s", type=N(above=0), default=1.5, help="--kv-vs-recompute: seconds per cell (>= 1 step)")
    ap.add_argument("--contexts", type=br.int_list, default="64,256,1024", help="--kv-vs-recompute")
    ap.add_argument("--batches", type=br.int_list, default="1,16,64", help="--kv-vs-recompute")
    ap.add_argument("--hf-worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.hf_worker:
        hf_worker(args.hf_worker, args.threads)
        return 0
    if args.threads:
        torch.set_num_threads(args.threads)
    device = devices.pick_device(args.device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    t0 = time.perf_counter()
    if args.kv_vs_recompute:
        kv_vs_recompute(args, ro, device, sync)
    else:
        compare(args, ro, br, device, sync)
    print(f"total_s {time.perf_counter() - t0:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(cli.run_cli(main))
