"""Decode speed of stage 03's sampler: with the KV cache vs recomputing the whole prefix every token.

Without a cache, producing token t+1 re-runs the model over all t previous tokens, so a completion of
N tokens costs O(N^2) token-forwards instead of O(N). This measures one decode step (one new token per
row) at several context lengths and batch sizes on a small random model, and prints both rates and
their ratio. The cache is filled with random keys/values rather than by a real prefill: decode cost does
not depend on the values, and skipping the prefill keeps the whole run under ~2 minutes on 2 CPU cores.

    python bench/bench_sampler.py                    # CPU (1 thread), hidden 256, 4 layers
    python bench/bench_sampler.py --device cuda --steps 10
"""
import argparse
import importlib
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ro = importlib.import_module("03_rollout")


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
def bench_cell(model, ctx, batch, steps, budget_s, device, sync):
    cfg = model.config
    dtype = model.model.embed_tokens.weight.dtype
    ids = torch.randint(0, cfg.vocab_size, (batch, ctx + 1), device=device)  # (B, ctx+1)

    # Cached: the cache already holds `ctx` tokens; one step feeds one token per row. Each timed call
    # rewinds pos so every step sees exactly ctx keys.
    cache = ro.KVCache(cfg, batch, ctx + 1, device, dtype)
    for k, v in zip(cache.k, cache.v):
        k.normal_(), v.normal_()

    def cached_step():
        cache.pos = ctx
        h = model.hidden_states(ids[:, ctx:], kv_cache=cache)  # (B, 1, C)
        return model.lm_head(h[:, -1])  # (B, V)

    def recompute_step():
        h = model.hidden_states(ids)  # (B, ctx+1, C): every previous token again
        return model.lm_head(h[:, -1])  # (B, V): only the last position is sampled from

    t_cache = timed(cached_step, steps, budget_s, sync)
    t_full = timed(recompute_step, steps, budget_s, sync, warmup=batch * ctx <= 4096)
    return batch / t_cache, batch / t_full


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default=None, help="cpu | cuda (default: autodetect)")
    ap.add_argument("--steps", type=int, default=3, help="decode steps measured per cell")
    ap.add_argument("--budget-s", type=float, default=1.5, help="stop measuring a cell after this long (>= 1 step)")
    ap.add_argument("--contexts", default="64,256,1024")
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (0: torch's default). The ratios are "
                    "the point, and 1 thread keeps them steady on a machine shared with other jobs")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    device = torch.device(args.device or ro.autodetect_device())
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    torch.manual_seed(0)
    cfg = ro.ModelConfig(vocab_size=2048, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=4096)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = ro.CausalLM(cfg).to(device=device, dtype=dtype).eval()
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model | hidden {cfg.hidden_size} | layers {cfg.num_hidden_layers} "
          f"| heads {cfg.num_attention_heads}/{cfg.num_key_value_heads} "
          f"| params {n_params / 1e6:.1f}M | device {device} | dtype {dtype} | threads {torch.get_num_threads()}")
    t0 = time.perf_counter()
    for ctx in map(int, args.contexts.split(",")):
        for batch in map(int, args.batches.split(",")):
            cached, full = bench_cell(model, ctx, batch, args.steps, args.budget_s, device, sync)
            print(f"context {ctx:5d} | batch {batch:3d} | kv-cache tok/s {cached:9.0f} | recompute tok/s {full:9.0f} "
                  f"| speedup {cached / full:7.1f}x")
    print(f"total_s {time.perf_counter() - t0:.1f}")
