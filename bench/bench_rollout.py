"""Rollout speed of an unquantized vs an NVFP4 (and NF4) policy, with stage 03's `generate`.

QeRL quantizes the frozen base model to NVFP4 mainly to make rollouts cheaper: decoding runs one token
per sequence per step, so every step streams the whole weight set from memory, and 4.5-bit weights
move ~3.5x fewer bytes than bf16. This script measures that end to end: it builds a randomly
initialised Qwen2-shaped model (random weights decode as fast as trained ones), samples with
`generate(..., eos_token_ids=[])` so every row runs the same fixed number of decode steps, and reports
prefill and decode tokens/s separately for each batch size, plus the ratios quantized / unquantized.

The model is built on the meta device (shapes only, no memory) and materialised one decoder layer at
a time, directly on the target device, with N(0, 0.02) weights; for a quantized run each layer is
quantized as soon as it exists, so a 7B NVFP4 model never needs its bf16 copy. One model lives at a
time: the unquantized one is freed before the quantized one is built.

    python bench/bench_rollout.py                              # CPU: --shape tiny, fp32 (~1 min)
    python bench/bench_rollout.py --shape qwen2.5-0.5b         # quick GPU check
    python bench/bench_rollout.py --shape qwen2.5-7b           # H200: ~2-3 min, bf16 vs NVFP4
    python bench/bench_rollout.py --quants none,nvfp4,nf4 --batches 1,4 --decode-steps 16 --threads 1

On the CPU, NVFP4Linear dequantizes its weight on every forward (the Triton kernel is the GPU path),
so there the quantized model is expected to be *slower*; the speed-up is a GPU measurement.
"""
import argparse
import gc
import importlib
import os
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
cli = importlib.import_module("qerl.cli")
devices = importlib.import_module("qerl.devices")
ro = importlib.import_module("qerl.rollout")

# ---------------------------------------------------------------------------------------------------
# Model shapes (Qwen2 family: SwiGLU, GQA, bias on q/k/v). bench_memory.py imports these too.

SHAPES = {
    # CPU-friendly: seconds per cell on 2 cores
    "tiny": dict(vocab_size=2048, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=64),
    # ~333M parameters, weights dominate memory (bench_memory.py's default)
    "350m": dict(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=24,
                 num_attention_heads=16, num_key_value_heads=4, head_dim=64),
    # Qwen2.5-0.5B's shape (tied embeddings): a quick GPU check
    "qwen2.5-0.5b": dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                         num_attention_heads=14, num_key_value_heads=2, head_dim=64, tie_word_embeddings=True),
    # Qwen2.5-7B's shape: ~7.6B parameters, 15 GB in bf16; CUDA only
    "qwen2.5-7b": dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                       num_attention_heads=28, num_key_value_heads=4, head_dim=128),
}
CUDA_ONLY = ("qwen2.5-7b",)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
QUANTS = importlib.import_module("qerl.quantize").quant_choices()  # the trainer's registry


def model_config(shape, **overrides):
    """ModelConfig for a named shape; keyword overrides (None = keep) resize it."""
    if shape not in SHAPES:
        raise ValueError(f"unknown --shape {shape!r}; choose one of {', '.join(SHAPES)}")
    fields = dict(model_type="qwen2", rope_theta=1e6, max_position_embeddings=4096, **SHAPES[shape])
    fields.update({k: v for k, v in overrides.items() if v is not None})
    if fields["num_attention_heads"] % fields["num_key_value_heads"]:
        raise ValueError(f"num_attention_heads {fields['num_attention_heads']} must be a multiple of "
                         f"num_key_value_heads {fields['num_key_value_heads']}")
    return ro.ModelConfig(**fields)


# ---------------------------------------------------------------------------------------------------
# Building a random model layer by layer (quantizing each layer as it appears)

@torch.no_grad()
def _materialise(module, device, gen, std):
    """Give a meta module real storage on `device` and HF-style random values: matrices ~ N(0, std^2),
    biases 0, norm gains 1 (so the model is well-behaved: near-uniform next-token distributions)."""
    module.to_empty(device=device)
    for name, p in module.named_parameters():
        if p.dim() >= 2:
            p.normal_(0.0, std, generator=gen)
        elif name.endswith("bias"):
            p.zero_()
        else:
            p.fill_(1.0)


@torch.no_grad()
def build_random_model(cfg, quant="none", dtype=torch.float32, device="cpu", seed=0, std=0.02):
    """A random CausalLM on `device`; decoder Linears in `quant` format ("none", "nvfp4" or "nf4").

    Peak memory is the finished model plus one layer in `dtype`: the meta model costs nothing, and each
    layer is quantized (its `dtype` weights dropped) before the next one is materialised. The random
    stream is consumed in the same order for every `quant`, so the NVFP4 model is exactly the
    quantization of the unquantized one with the same seed. lm_head and the embeddings stay in `dtype`
    (quantize_model's default skip, and what QeRL does)."""
    if quant not in QUANTS:
        raise ValueError(f"unknown quantization {quant!r}; choose one of {', '.join(QUANTS)}")
    device = torch.device(device)
    q = importlib.import_module("qerl.quantize") if quant != "none" else None
    with torch.device("meta"):
        model = ro.CausalLM(cfg).to(dtype)  # on meta, .to only records the dtype
    gen = torch.Generator(device=device).manual_seed(seed)

    _materialise(model.model.embed_tokens, device, gen, std)
    for layer in model.model.layers:
        _materialise(layer, device, gen, std)
        if q is not None:
            # skip=() because inside a layer no name contains "lm_head"; q/k/v and gate/up still share
            # one global scale per group (quantize_model groups by parent module).
            q.quantize_model(layer, fmt=quant, skip=())
    _materialise(model.model.norm, device, gen, std)
    if cfg.tie_word_embeddings:  # to_empty replaced embed's Parameter; point lm_head at the new one
        model.lm_head.weight = model.model.embed_tokens.weight
    else:
        _materialise(model.lm_head, device, gen, std)
    return model.eval()


def weight_bytes(model):
    """Bytes of parameters + buffers (packed codes and scales live in buffers); tied tensors once."""
    seen, total = set(), 0
    for t in list(model.parameters()) + list(model.buffers()):
        if id(t) not in seen:
            seen.add(id(t))
            total += t.numel() * t.element_size()
    return total


def free_model(model, device):
    """Drop the last reference and give the memory back, so the next model starts from empty."""
    del model
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


# ---------------------------------------------------------------------------------------------------
# Timing one batch size with generate()

def bench_cell(model, batch, prompt_len, decode_steps, repeats, device, seed):
    """Best-of-`repeats` prefill and decode tokens/s of generate() at one batch size."""
    cpu_gen = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, model.config.vocab_size, (prompt_len,), generator=cpu_gen).tolist()
               for _ in range(batch)]
    gen = torch.Generator(device=device).manual_seed(seed)

    def run(new_tokens):
        # eos_token_ids=[]: no row ever stops, so every call runs exactly new_tokens - 1 decode forwards
        return ro.generate(model, prompts, max_new_tokens=new_tokens, temperature=1.0,
                           eos_token_ids=[], generator=gen).stats

    # Warm-up with the same shapes: the first GPU calls compile and autotune Triton kernels (per batch
    # bucket) and let the caching allocator grow; none of that belongs in a tokens/s figure.
    run(3)
    prefill_s = decode_s = float("inf")
    for _ in range(repeats):
        # The first sampled token comes from the prefill logits; the other decode_steps each need one
        # decode forward (batch rows x one token), which is what the decode figure counts.
        s = run(decode_steps + 1)
        assert s["decode_steps"] == decode_steps + 1
        prefill_s, decode_s = min(prefill_s, s["prefill_s"]), min(decode_s, s["decode_s"])
    return dict(prefill_tps=batch * prompt_len / prefill_s, decode_tps=batch * decode_steps / decode_s,
                ms_per_step=1e3 * decode_s / decode_steps)


def bench_quant(cfg, quant, args, device, dtype):
    """Build one model, time every batch size, free it. Returns {batch: cell} and model info."""
    t0 = time.perf_counter()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    model = build_random_model(cfg, quant, dtype, device, seed=args.seed)
    if device.type == "cuda":
        torch.cuda.synchronize()
    info = dict(weight_gb=weight_bytes(model) / 1e9, build_s=time.perf_counter() - t0)
    print(f"model | quant {quant} | weights {info['weight_gb']:.3f} GB | build_s {info['build_s']:.1f}", flush=True)
    cells = {}
    for batch in args.batches:
        c = bench_cell(model, batch, args.prompt_len, args.decode_steps, args.repeats, device, args.seed)
        cells[batch] = c
        print(f"quant {quant} | batch {batch} | prompt {args.prompt_len} | prefill tok/s {c['prefill_tps']:.0f} "
              f"| decode steps {args.decode_steps} | decode tok/s {c['decode_tps']:.1f} "
              f"| ms/step {c['ms_per_step']:.2f}", flush=True)
    if device.type == "cuda":
        info["peak_gb"] = torch.cuda.max_memory_allocated() / 1e9
    free_model(model, device)
    return cells, info


# ---------------------------------------------------------------------------------------------------
# Command line

pick_device = devices.pick_device  # --device: the stages' one rule


def int_list(text):
    """An argparse type: comma-separated integers >= 1 ("1,16")."""
    values = [cli.number(int, 1)(v) for v in text.split(",") if v.strip()]
    if not values:
        raise argparse.ArgumentTypeError(f"{text!r} holds no integers: give them comma-separated, e.g. 1,16")
    return values


def main(argv=None):
    N = cli.number
    ap = cli.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default=None, help=f"one of {', '.join(SHAPES)} (default: tiny on CPU, qwen2.5-7b on CUDA)")
    ap.add_argument("--quants", default="none,nvfp4", help="comma-separated, from none,nvfp4,nf4 (first = baseline)")
    ap.add_argument("--batches", type=int_list, default="1,16", help="batch sizes (rows decoded together)")
    ap.add_argument("--prompt-len", type=N(int, 1), default=None,
                    help="prompt tokens per row (default 64 CPU, 128 CUDA)")
    ap.add_argument("--decode-steps", type=N(int, 1), default=32, help="decode forwards timed per cell")
    ap.add_argument("--repeats", type=N(int, 1), default=2, help="timed runs per cell (the best is kept)")
    ap.add_argument("--dtype", default=None, choices=list(DTYPES), help="compute dtype (default: bf16 CUDA, fp32 CPU)")
    ap.add_argument("--device", default=None, help="cpu | cuda (default: autodetect)")
    ap.add_argument("--layers", type=N(int, 1), default=None, help="override the shape's number of layers")
    ap.add_argument("--threads", type=N(int, 0), default=0, help="torch CPU threads (0: torch's default)")
    ap.add_argument("--seed", type=N(int, 0), default=0)
    args = ap.parse_args(argv)

    device = pick_device(args.device)
    args.shape = args.shape or ("qwen2.5-7b" if device.type == "cuda" else "tiny")
    if args.shape not in SHAPES:
        raise SystemExit(f"error: unknown --shape {args.shape!r}; choose one of {', '.join(SHAPES)}")
    if args.shape in CUDA_ONLY and device.type != "cuda":
        print(f"bench_rollout: --shape {args.shape} needs a CUDA GPU (it is ~15 GB in bf16 and far too slow on "
              f"a CPU); skipped. Use --shape tiny here.")
        return 0
    quants = [s.strip() for s in args.quants.split(",") if s.strip()]
    bad = [s for s in quants if s not in QUANTS]
    if bad or not quants:
        raise SystemExit(f"error: --quants takes names from {','.join(QUANTS)}, got {args.quants!r}")
    args.prompt_len = args.prompt_len or (128 if device.type == "cuda" else 64)
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = DTYPES[args.dtype or ("bf16" if device.type == "cuda" else "fp32")]
    cfg = model_config(args.shape, num_hidden_layers=args.layers,
                       max_position_embeddings=max(4096, args.prompt_len + args.decode_steps + 8))

    where = torch.cuda.get_device_name() if device.type == "cuda" else f"cpu, {torch.get_num_threads()} threads"
    print(f"bench_rollout | shape {args.shape} | hidden {cfg.hidden_size} | layers {cfg.num_hidden_layers} "
          f"| vocab {cfg.vocab_size} | dtype {str(dtype).replace('torch.', '')} | device {where} "
          f"| torch {torch.__version__}", flush=True)
    if device.type == "cpu" and any(s != "none" for s in quants):
        print("note | on the CPU, NVFP4Linear/NF4Linear dequantize the whole weight on every forward, so the "
              "quantized rows are expected to be slower here; the speed-up needs the GPU kernel")
    t0 = time.perf_counter()
    results, infos = {}, {}
    for quant in quants:
        results[quant], infos[quant] = bench_quant(cfg, quant, args, device, dtype)

    # Summary: absolute rates per quantization, then the ratio to the first entry (the baseline).
    base = quants[0]
    cmd = "python bench/bench_rollout.py " + " ".join(sys.argv[1:] if argv is None else argv)
    print(f"\nsummary | {cmd.strip()} | total_s {time.perf_counter() - t0:.0f}")
    head = f"{'batch':>5} | {'quant':<6} | {'weights GB':>10} | {'prefill tok/s':>13} | {'decode tok/s':>12} " \
           f"| {'ms/step':>8} | {'prefill x':>9} | {'decode x':>8}"
    print(head)
    print("-" * len(head))
    for batch in args.batches:
        for quant in quants:
            c, b = results[quant][batch], results[base][batch]
            print(f"{batch:>5} | {quant:<6} | {infos[quant]['weight_gb']:>10.3f} | {c['prefill_tps']:>13.0f} "
                  f"| {c['decode_tps']:>12.1f} | {c['ms_per_step']:>8.2f} | {c['prefill_tps'] / b['prefill_tps']:>9.2f} "
                  f"| {c['decode_tps'] / b['decode_tps']:>8.2f}")
    if device.type == "cuda":
        print("peak GPU memory (GB): " + ", ".join(f"{q} {infos[q]['peak_gb']:.2f}" for q in quants))
    print(f"(x = tok/s relative to {base}; decode tok/s = batch x {args.decode_steps} decode forwards / their "
          f"seconds, sampling included; prefill = batch x {args.prompt_len} prompt tokens in one forward)")
    return 0


if __name__ == "__main__":
    sys.exit(cli.run_cli(main))
