"""What stage 03's sampler and log-probs run beneath the method: fast equivalents of its plain computations.

Each fast path here computes what a plain computation of qerl/rollout.py's Part 1 computes, only faster or in
less memory; one line of 03's Part 1 switches it on, and tests/test_rollout.py proves the two equal:
- `decode_attention_cpu` (03's DECODE_ATTENTION_CPU): a CPU decode step's attention as the plain product,
  where 03's `Attention` otherwise calls SDPA (2x faster than SDPA's CPU kernel at one query per row);
- `chunked_token_logprobs` (03's CHUNKED_LOGPROBS): 03's `token_logprobs` over chunks of tokens, never
  holding the whole batch's logits, not even for backward (docs/scaling.md, "One GPU at 7B");
- `compiled_step` (generate(compiled=True)): 03's `decode_step` through torch.compile (the gpt-fast recipe),
  over one KV cache per shape kept for later calls (docs/scaling.md, "What runs differently on a GPU"),
  with `cache_slots`, the cache lengths rounded up so that prompts of many lengths share one graph.
Then 03's `generate` plumbing: `sample_from` (torch.multinomial's draw, faster), `eos_and_pad`, `Clock`,
and `check_generate`, the checks of its arguments (tests/test_bad_inputs.py holds the cases).
This module imports no stage: where it needs 03's functions or classes, the caller passes them in.
"""
import math
import numbers
import time

import torch
import torch.nn as nn

from qerl import devices

# ---------------------------------------------------------------------------------------------------
# Attention for a CPU decode step

def decode_attention_cpu(q, k, v, mask, scale):
    """softmax(q k^T * scale, masked) v for q (B, H_kv, G, D), one query per head of a group, and k, v
    (B, H_kv, S, D); mask (B, 1, 1, S) bool broadcasts. What SDPA computes, in HF's eager order with the
    softmax in fp32: on a CPU at decode sizes this is 2x faster than SDPA's kernel. -> (B, H_kv, G, D)"""
    a = (q @ k.transpose(-1, -2)).float().mul_(scale)  # (B, H_kv, G, S)
    return a.masked_fill_(~mask, float("-inf")).softmax(-1).to(v.dtype) @ v  # (B, H_kv, G, D)


# ---------------------------------------------------------------------------------------------------
# compiled=True: the same decode step through torch.compile, over a KV cache kept per shape

CACHE_SLOTS_MULTIPLE = 64  # KV cache lengths are rounded up to this: one compiled graph for many prompt lengths


def cache_slots(n):
    """The KV cache length for n = prompt + new tokens: n rounded up to CACHE_SLOTS_MULTIPLE (eager runs the
    same length, so compiled and eager compute over the same slots)."""
    return -(-n // CACHE_SLOTS_MULTIPLE) * CACHE_SLOTS_MULTIPLE


def compiled_step(model, batch, slots, sampling, decode_step, make_cache):
    """-> (decode_step through torch.compile, this model's kept KV cache for (batch, slots), whether its
    first step compiles: a new shape or sampling setting). sampling: (temperature, top_k, top_p, generator)."""
    temperature, top_k, top_p, generator = sampling
    step = compiled_decode_step(devices.model_device(model), decode_step)
    cache, first = static_cache(model, batch, slots, (temperature, top_k, top_p, generator is None), make_cache)
    return step, cache, first


_compiled_steps = {}  # (mode, step function) -> it under torch.compile; dynamo keeps one graph per shape and setting


def compiled_decode_step(device, decode_step):
    """`decode_step` through torch.compile, built once per mode: on CUDA "reduce-overhead" replays each step
    as one CUDA graph; on a CPU inductor fuses it into generated C++ loops."""
    mode = "reduce-overhead" if device.type == "cuda" else None
    if (mode, decode_step) not in _compiled_steps and (problem := devices.compile_cache_problem()):
        print(f"note | --compile: {problem}: the decode steps run eager (the same numbers, slower)")
        _compiled_steps[mode, decode_step] = decode_step
    if (mode, decode_step) not in _compiled_steps:
        compiled = torch.compile(decode_step, mode=mode, dynamic=False)
        # One graph per (batch, cache length, sampling settings); dynamo's default allows only 8.
        c = torch._dynamo.config
        limit = "recompile_limit" if hasattr(c, "recompile_limit") else "cache_size_limit"  # older torch
        setattr(c, limit, max(getattr(c, limit), 64))

        def step(*args):
            if mode == "reduce-overhead":
                torch.compiler.cudagraph_mark_step_begin()  # the previous step's outputs are consumed
            return compiled(*args)
        _compiled_steps[mode, decode_step] = step
    return _compiled_steps[mode, decode_step]


def static_cache(model, batch, slots, setting, make_cache):
    """-> (this model's KV cache for (batch, slots), whether `setting` (temperature, top_k, top_p, generator is
    None) is new for it, so that its first compiled step compiles). make_cache(cfg, batch, slots, device,
    dtype) builds one (03's KVCache), once: every compiled call reuses it, since dynamo guards on the cache's
    tensors and a CUDA graph replays on their addresses."""
    w = model.model.embed_tokens.weight
    caches = model.__dict__.setdefault("_static_caches", {})  # (batch, slots, dtype, device) -> (cache, settings)
    key = (batch, slots, w.dtype, w.device)
    if key not in caches:
        cache = make_cache(model.config, batch, slots, w.device, w.dtype)
        for t in (cache.pos, *cache.k, *cache.v):
            torch._dynamo.mark_static_address(t)  # CUDA graphs then read and write them in place, no copies
        caches[key] = (cache, set())
    cache, settings = caches[key]
    cache.pos.zero_()
    first = setting not in settings
    settings.add(setting)
    return cache, first


# ---------------------------------------------------------------------------------------------------
# Log-probs in chunks, for sequence_logprobs (the policy update)

# The full logits of a 7B GRPO batch would be ~80 GB in fp32: lm_head runs over chunks of at most
# LOGITS_CHUNK_BYTES of logits instead, recomputed one at a time in backward.
LOGITS_CHUNK_BYTES = 2 ** 26  # 64 MiB of fp32 logits per chunk: 110 tokens at V = 151,936


class _ChunkLogprobs(torch.autograd.Function):
    """token_logprobs of one chunk of tokens; saves h, not the logits, and recomputes them in backward.
    (torch.utils.checkpoint would keep the recomputed entropy branch alive until the whole backward ends.)"""

    @staticmethod
    def forward(ctx, h, ids, lm_head, temperature, entropy, token_logprobs):  # h (n, C), ids (n,)
        ctx.save_for_backward(h, ids)
        ctx.lm_head, ctx.temperature, ctx.entropy, ctx.token_logprobs = lm_head, temperature, entropy, token_logprobs
        ctx.set_materialize_grads(False)  # an unused output (often the entropy) gets None: skip its branch
        with torch.no_grad():
            lp, ent = token_logprobs(lm_head, h, ids, temperature, entropy)
        return lp, torch.zeros_like(lp) if ent is None else ent  # (n,) each; zeros stand in when not asked

    @staticmethod
    def backward(ctx, g_lp, g_ent):
        h, ids = ctx.saved_tensors
        head = ctx.lm_head
        if g_ent is None and g_lp is not None and isinstance(head, nn.Linear) and head.bias is None \
                and not head.weight.requires_grad:  # the usual case: the log-prob's gradient alone, by hand
            # d log p_id / d logits = (onehot(id) - softmax) / T: one softmax pass over the chunk, no autograd graph
            logits = head(h).float()  # (n, V)
            t = ctx.temperature if ctx.temperature > 0 else 1.0
            g = (logits / t).softmax(-1).mul_(-g_lp[:, None])  # (n, V)
            g.scatter_add_(-1, ids[:, None], g_lp[:, None]).div_(t)
            return g.to(h.dtype) @ head.weight, None, None, None, None, None  # (n, C)
        with torch.enable_grad():
            h = h.detach().requires_grad_()
            outs = ctx.token_logprobs(ctx.lm_head, h, ids, ctx.temperature, ctx.entropy)  # (n,) each, with a graph
            used = [(o, g) for o, g in zip(outs, (g_lp, g_ent)) if g is not None]
            if used:  # also accumulates into any trainable lm_head parameter's .grad
                torch.autograd.backward(*zip(*used))
        return h.grad, None, None, None, None, None


def chunked_token_logprobs(token_logprobs, lm_head, h, ids, temperature, entropy=True, chunk_bytes=None):
    """token_logprobs(lm_head, h, ids, temperature, entropy) for h (n, C), ids (n,), over chunks of at most
    chunk_bytes (default LOGITS_CHUNK_BYTES) of fp32 logits (V = lm_head's rows) -> what token_logprobs
    returns: (log-prob, entropy or None unless `entropy`), each (n,)."""
    if len(ids) == 0:  # no token: nothing to chunk (empty tensors, still in the graph)
        return token_logprobs(lm_head, h, ids, temperature, entropy)
    chunk_bytes = LOGITS_CHUNK_BYTES if chunk_bytes is None else chunk_bytes
    step = max(1, chunk_bytes // (4 * lm_head.weight.shape[0]))  # tokens per chunk
    chunks = [_ChunkLogprobs.apply(h[i:i + step], ids[i:i + step], lm_head, temperature, entropy, token_logprobs)
              for i in range(0, len(ids), step)]  # (log-prob, entropy) pairs, (chunk,) each
    lp, ent = (torch.cat([c[j] for c in chunks]) for j in (0, 1))
    return lp, ent if entropy else None


# ---------------------------------------------------------------------------------------------------
# generate()'s plumbing: the draw, EOS and pad ids, its clock, its arguments checked

def sample_from(p, generator):
    """One index per row of probabilities p (B, V) by inverse CDF: torch.multinomial's distribution, several
    times faster on a CPU at V = 49,152. u < total strictly, so the index found has a nonzero probability."""
    cdf = p.cumsum(-1)  # (B, V)
    total = cdf[:, -1:]  # (B, 1), 1 up to rounding
    dev = generator.device if generator is not None else p.device  # a CPU generator may drive CUDA
    u = torch.rand(p.shape[0], 1, generator=generator, device=dev).to(p.device) * total  # (B, 1)
    u = torch.minimum(u, torch.nextafter(total, torch.zeros_like(total)))
    # (B,) the first cdf > u; a row whose logits overflowed (NaN) would find none: its last index, and its NaN
    # log-prob tells the caller (05 stops the run on it)
    return torch.searchsorted(cdf, u, right=True).squeeze(-1).clamp_(max=p.shape[-1] - 1)


def eos_and_pad(eos_token_ids, tokenizer, device):
    """-> (the EOS ids as a long tensor on device: eos_token_ids, else the tokenizer's, else none; the pad
    id: the tokenizer's, else the first EOS id, else 0)."""
    if eos_token_ids is None:
        eos_token_ids = tokenizer.eos_token_ids if tokenizer is not None else []
    pad_id = tokenizer.pad_token_id if tokenizer is not None else (list(eos_token_ids) or [0])[0]
    return torch.tensor(list(eos_token_ids), dtype=torch.long, device=device), pad_id


class Clock:
    """Wall seconds between laps, each named lap adding to laps[name] (0.0 until then); on CUDA a lap first
    waits for the queue, so that it counts the work queued before it."""

    def __init__(self, device, *names):
        self.sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
        self.laps, self.t = dict.fromkeys(names, 0.0), time.perf_counter()

    def lap(self, name, when=True):
        if when:
            self.sync()
            now = time.perf_counter()
            self.laps[name], self.t = self.laps.get(name, 0.0) + now - self.t, now


# Below this (0 aside, which is greedy) logit / temperature heads for fp32's overflow (1e-40 gives inf,
# then NaN probabilities), and long before it the draw is the greedy token in all but ties.
MIN_TEMPERATURE = 1e-4


def check_generate(cfg, prompts, num_samples, max_new_tokens, temperature, top_k, top_p, generator=None):
    """generate()'s arguments, each bad one a clear error naming it (before any tensor is allocated)."""
    if isinstance(prompts, torch.Tensor):
        raise ValueError("generate: prompts must be a list of token-id lists (prompt.tolist() for a tensor)")
    if not isinstance(prompts, (list, tuple)) or not prompts:
        raise ValueError("generate: prompts must be a non-empty list of prompts, each a list of token ids")
    for i, p in enumerate(prompts):
        if not isinstance(p, (list, tuple)) or not p or not all(isinstance(t, numbers.Integral) for t in p):
            raise ValueError(f"generate: prompt {i} must be a non-empty list of int token ids, got "
                             f"{type(p).__name__} {str(p)[:40]}")
    settings = (temperature, top_k, top_p, max_new_tokens, num_samples)
    if (not all(isinstance(v, (int, float)) and math.isfinite(v) for v in settings)
            or not (temperature == 0 or temperature >= MIN_TEMPERATURE)
            or not 0 < top_p <= 1 or top_k < 0 or max_new_tokens < 1 or num_samples < 1):
        raise ValueError(f"generate: need temperature 0 or >= {MIN_TEMPERATURE:g}, 0 < top_p <= 1, top_k >= 0, "
                         f"max_new_tokens >= 1 and num_samples >= 1, all finite; got temperature={temperature}, "
                         f"top_p={top_p}, top_k={top_k}, max_new_tokens={max_new_tokens}, num_samples={num_samples}")
    for i, p in enumerate(prompts):
        if len(p) + max_new_tokens > cfg.max_position_embeddings:
            raise ValueError(f"prompt {i} has {len(p)} tokens; with max_new_tokens={max_new_tokens} that exceeds the "
                             f"model's context of {cfg.max_position_embeddings} (shorten it or lower max_new_tokens)")
        if max(p) >= cfg.vocab_size or min(p) < 0:
            raise ValueError(f"prompt {i} has a token id outside [0, {cfg.vocab_size})")
