"""Stage 03: the policy model and the rollout sampler, written from scratch in plain torch.

GRPO samples G completions per prompt ("rollouts"): most of RL's time, hence QeRL's NVFP4 policy.
Part 1: a Qwen2 decoder with the HF module names (stages 01, 02 find layers by name); `generate`, a
prefill then a `decode_step` per token over a KV cache -> a Rollout (tokens, log-probs, entropies);
`sequence_logprobs`, those log-probs with gradients. Part 2: Llama's and Qwen3's differences, top-k
and top-p, the loader, the CLI."""
from dataclasses import dataclass, field

import importlib
import os
import sys

if __package__ in (None, ""):  # run as a file (python qerl/rollout.py): the checkout heads sys.path, not qerl/
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from qerl import devices
from qerl import quantize
from qerl import engine  # generate's plumbing, the fast paths (False below: the plain computation)
from qerl import hf_files  # a model folder's files: config.json's checks, safetensors, the tokenizer, ChatML

stage03 = importlib.import_module("03_rollout")  # the stage this module extends: its definitions, used as they are
DONE_CHECK_EVERY = stage03.DONE_CHECK_EVERY
KVCache = stage03.KVCache
MLP = stage03.MLP
RMSNorm = stage03.RMSNorm
apply_rope = stage03.apply_rope
entropy_from_logp = stage03.entropy_from_logp
left_pad = stage03.left_pad
token_logprobs = stage03.token_logprobs

DECODE_ATTENTION_CPU = True  # a CPU decode step attends by the plain product: 2x faster than SDPA
CHUNKED_LOGPROBS = True  # log-probs a few tokens at a time: a 7B batch's full logits are ~80 GB

# ---- The model: config.json's fields, RMSNorm, RoPE, a KV cache, attention, SwiGLU MLP, decoder
@dataclass
class ModelConfig:
    model_type: str = "qwen2"
    vocab_size: int = 300
    hidden_size: int = 64
    intermediate_size: int = 128
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 16
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict = None      # Llama 3: {"rope_type": "llama3", "factor": ..., ...} (Part 2)
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = True    # bias on q/k/v (Qwen2 always; Llama/Qwen3 from config)
    o_bias: bool = False           # bias on o_proj (Llama/Qwen3 follow attention_bias)
    mlp_bias: bool = False
    qk_norm: bool = False          # Qwen3: RMSNorm on each head of q and k (Part 2)

    @classmethod
    def from_dict(cls, d, where="config.json"):  # each bad or unsupported field: one clear error
        return cls(**hf_files.model_config_fields(d, where))


def rope_inv_freq(cfg, device=None):  # (D/2,) fp32; Llama 3 stretches the long wavelengths (Part 2)
    D = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, D, 2, device=device).float() / D))  # (D/2,)
    return inv if cfg.rope_scaling is None else llama3_scaled_inv_freq(inv, cfg.rope_scaling)


class Attention(nn.Module):
    def __init__(self, cfg, layer_idx):
        super().__init__()
        self.layer_idx, self.D = layer_idx, cfg.head_dim
        self.H, self.H_kv = cfg.num_attention_heads, cfg.num_key_value_heads
        C = cfg.hidden_size
        self.q_proj = nn.Linear(C, self.H * self.D, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(C, self.H_kv * self.D, bias=cfg.attention_bias)
        self.v_proj = nn.Linear(C, self.H_kv * self.D, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.H * self.D, C, bias=cfg.o_bias)
    def qkv(self, x):  # x (B, T, C) -> q (B, T, H, D), k, v (B, T, H_kv, D); Qwen3 norms q, k here
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.H, self.D)
        k = self.k_proj(x).view(B, T, self.H_kv, self.D)
        return q, k, self.v_proj(x).view(B, T, self.H_kv, self.D)
    def forward(self, x, cos, sin, mask, kv_cache=None):  # mask (B, 1, T, S): may t see slot s
        B, T, _ = x.shape
        q, k, v = (t.transpose(1, 2) for t in self.qkv(x))  # (B, H, T, D), (B, H_kv, T, D) twice
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if kv_cache is not None:
            k, v = kv_cache.update(self.layer_idx, k, v)  # (B, H_kv, S, D), all the cache's slots
        # Grouped-query attention, K/V not copied: query head h reads K/V head h // G, so the G
        # heads of a group fold into the query axis, the mask with them.
        G, S = self.H // self.H_kv, k.shape[2]
        q = q.reshape(B, self.H_kv, G * T, self.D)  # (B, H_kv, G*T, D)
        if DECODE_ATTENTION_CPU and T == 1 and not q.is_cuda:  # a CPU decode step: the fast path
            y = engine.decode_attention_cpu(q, k, v, mask, self.D ** -0.5)  # (B, H_kv, G, D)
        else:  # softmax(q k^T / sqrt(D)) v over the allowed keys
            mask = mask[:, :, None].expand(B, 1, G, T, S).reshape(B, 1, G * T, S)  # (B, 1, G*T, S)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.D ** -0.5)
        y = y.reshape(B, self.H, T, self.D).transpose(1, 2)  # (B, T, H, D)
        return self.o_proj(y.reshape(B, T, self.H * self.D))  # (B, T, C)


class DecoderLayer(nn.Module):
    def __init__(self, cfg, layer_idx):
        super().__init__()
        self.self_attn = (QKNormAttention if cfg.qk_norm else Attention)(cfg, layer_idx)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
    def forward(self, x, cos, sin, mask, kv_cache=None):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask, kv_cache)  # (B, T, C)
        return x + self.mlp(self.post_attention_layernorm(x))

class CausalLM(nn.Module):
    grad_checkpoint = False  # 05's update: layers keep their input only, rerun forward in backward
    def __init__(self, cfg):
        super().__init__()
        self.config, L = cfg, cfg.num_hidden_layers
        self.model = nn.Module()  # HF's `model.*`, so state-dict names match the checkpoint's
        self.model.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.model.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(L))
        self.model.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self._inv_freq = {}  # device -> RoPE inverse frequencies, computed once (see `rope`)
    def hidden_states(self, input_ids, positions=None, attention_mask=None, kv_cache=None):
        """-> final-norm (B, T, C); attention_mask (B, S): real key slots (S: T or the cache's)"""
        B, T = input_ids.shape
        dev = input_ids.device
        S = T if kv_cache is None else kv_cache.max_len
        if attention_mask is None:
            attention_mask = torch.ones(B, S, dtype=torch.bool, device=dev)
        key_ok = attention_mask.bool()  # (B, S)
        slots = torch.arange(T, device=dev) if kv_cache is None else kv_cache.slots(T)  # (T,)
        if positions is None:  # RoPE position = number of real tokens before this one in the row
            positions = (key_ok.long().cumsum(-1) - 1).clamp(min=0)[:, slots]  # (B, T)
        q_slot, k_slot = slots[:, None], torch.arange(S, device=dev)[None, :]  # (T, 1), (1, S)
        # Causal AND key is real. Each slot also sees itself: a left-pad query has no real key,
        # and a softmax over nothing is NaN (never used, but NaN would spread via 0*NaN).
        mask = ((k_slot <= q_slot) & key_ok[:, None, None, :]) | (k_slot == q_slot)  # (B, 1, T, S)
        x = self.model.embed_tokens(input_ids)  # (B, T, C)
        cos, sin = self.rope(positions, x.dtype)  # (B, 1, T, D) each
        ckpt = self.grad_checkpoint and torch.is_grad_enabled() and kv_cache is None
        for layer in self.model.layers:
            x = (checkpoint(layer, x, cos, sin, mask, kv_cache, use_reentrant=False) if ckpt
                 else layer(x, cos, sin, mask, kv_cache))  # (B, T, C)
        if kv_cache is not None:
            kv_cache.pos.add_(T)  # every layer has written its slots; advance once
        return self.model.norm(x)  # (B, T, C)
    def rope(self, positions, dtype):  # positions (B, T) -> cos, sin (B, 1, T, D)
        dev = str(positions.device)  # inv_freq: fp32 once per device (a buffer would go bf16)
        if dev not in self._inv_freq:
            self._inv_freq[dev] = rope_inv_freq(self.config, positions.device)
        freqs = positions[..., None].float() * self._inv_freq[dev]  # (B, T, D/2), fp32
        emb = torch.cat((freqs, freqs), dim=-1)  # (B, T, D)
        return emb.cos().to(dtype)[:, None], emb.sin().to(dtype)[:, None]  # (B, 1, T, D)
    def forward(self, input_ids, positions=None, attention_mask=None, kv_cache=None):
        h = self.hidden_states(input_ids, positions, attention_mask, kv_cache)  # (B, T, C)
        return self.lm_head(h).float()  # (B, T, V), fp32 so log-softmax is accurate for bf16

# ---- Sampler: draw from the tempered logits; generate = a prefill, a decode_step per token

def sample_next(logits, temperature, top_k, top_p, generator):
    """One token per row from logits (B, V) -> (token, logprob, entropy), each (B,)."""
    if temperature == 0:
        logp = logits.log_softmax(-1)  # (B, V), greedy reports the untempered distribution
        tok = logits.argmax(-1)
    else:  # top-k / top-p (Part 2): no-ops at their defaults
        logp = filter_logits(logits / temperature, top_k, top_p).log_softmax(-1)  # (B, V)
    p = logp.exp()  # (B, V)
    if temperature != 0:  # torch.multinomial's draw by inverse CDF, several times faster on a CPU
        tok = engine.sample_from(p, generator)  # (B,)
    return tok, logp.gather(-1, tok[:, None]).squeeze(-1), entropy_from_logp(logp, p)

@dataclass
class Rollout:
    prompt_ids: list               # list[list[int]] per row, prompt-major: rows i*G..i*G+G-1
    completion_ids: torch.Tensor   # (B*G, T) long, pad after EOS
    completion_mask: torch.Tensor  # (B*G, T) float, 1 for sampled tokens including the EOS token
    logprobs: torch.Tensor         # (B*G, T) log-prob under the distribution it was drawn from
    entropy: torch.Tensor          # (B*G, T) entropy of that distribution
    texts: list = None             # decoded completions when a tokenizer is given
    stats: dict = field(default_factory=dict)  # prefill/decode token counts and seconds

def decode_step(model, cache, tok, key_ok, temperature, top_k, top_p, generator):
    """tok (B, T) into the cache's next T slots (key_ok (B, S): real slots) -> sample_next's."""
    h = model.hidden_states(tok, attention_mask=key_ok, kv_cache=cache)  # (B, T, C)
    logits = model.lm_head(h[:, -1]).float()  # (B, V): only the last position is needed
    return sample_next(logits, temperature, top_k, top_p, generator)


@torch.no_grad()
def generate(model, prompts, num_samples=1, max_new_tokens=256, temperature=1.0, top_k=0, top_p=1.0,
             eos_token_ids=None, generator=None, tokenizer=None, compiled=False):
    """`num_samples` completions of each prompt (a list of token ids) -> Rollout, rows prompt-major.
    temperature=0 is greedy; each row stops at its own EOS (default: the tokenizer's)."""
    sampling = (temperature, top_k, top_p, generator)
    engine.check_generate(model.config, prompts, num_samples, max_new_tokens, *sampling)
    dev = devices.model_device(model)
    eos, pad_id = engine.eos_and_pad(eos_token_ids, tokenizer, dev)  # eos (E,): default tokenizer's
    rows = [list(p) for p in prompts for _ in range(num_samples)]  # prompt-major
    B, N = len(rows), max_new_tokens
    out_ids = torch.full((B, N), pad_id, dtype=torch.long, device=dev)  # (B, N)
    out_mask, out_lp, out_ent = (torch.zeros(B, N, device=dev) for _ in range(3))  # (B, N)
    ids, key_ok, P = left_pad(rows, out_ids)  # key_ok (B, P+N): prompt tokens and every new slot
    S = engine.cache_slots(P + N)  # P+N rounded up: prompts of many lengths share a compiled step
    key_ok = F.pad(key_ok, (0, S - P - N))  # (B, S); the slots past P+N are never written
    if compiled:  # the same decode_step through torch.compile over a kept cache: faster on a GPU
        step, cache, compiling = engine.compiled_step(model, B, S, sampling, decode_step, KVCache)
    else:
        step, compiling = decode_step, False
        cache = KVCache(model.config, B, S, dev, model.model.embed_tokens.weight.dtype)
    live = torch.ones(B, dtype=torch.bool, device=dev)  # (B,) rows that have not sampled an EOS
    clock = engine.Clock(dev, "prefill_s", "compile_s", "decode_s")  # seconds (GPU: synced)
    tok, lp, ent = decode_step(model, cache, ids[:, :P], key_ok, *sampling)  # prefill: 0..P-1
    clock.lap("prefill_s")
    for t in range(N):  # done rows are fed pads (outputs ignored): no compacting of the cache
        tok = torch.where(live, tok, pad_id)  # (B,)
        out_ids[:, t], out_mask[:, t] = tok, live.float()
        out_lp[:, t], out_ent[:, t] = lp * live, ent * live
        live = live & ~torch.isin(tok, eos)  # the EOS token itself stays in the completion
        if t == N - 1 or ((t + 1) % DONE_CHECK_EVERY == 0 and not bool(live.any())):
            break
        tok, lp, ent = step(model, cache, tok[:, None], key_ok, *sampling)  # slot P+t, (B,) each
        clock.lap("compile_s", when=compiling and t == 0)  # a new shape or setting compiled
    steps = int(out_mask[:, :t + 1].any(0).sum())  # rows only stop: the live columns are a prefix
    clock.lap("decode_s")
    ids, mask = out_ids[:, :steps], out_mask[:, :steps]
    texts = [tokenizer.decode(r[m > 0].tolist()) for r, m in zip(ids, mask)] if tokenizer else None
    return Rollout(rows, ids, mask, out_lp[:, :steps], out_ent[:, :steps], texts, dict(
        prefill_tokens=sum(map(len, rows)), decode_tokens=int(mask.sum()), decode_steps=steps,
        decode_steps_run=t + 1, **clock.laps))

# ---- Log-probs with gradients, for the policy update

def sequence_logprobs(model, prompt_ids, completion_ids, completion_mask, temperature=1.0,
                      entropy=True):
    """Log-probs and entropies (None unless `entropy`) (B, T) of `completion_ids` after each row's
    prompt, with gradients, 0 after EOS: what `generate` recorded (without top-k/top-p)."""
    completion_ids = completion_ids.to(devices.model_device(model))
    B, T = completion_ids.shape
    ids, key_ok, P = left_pad(prompt_ids, completion_ids)
    h = model.hidden_states(ids, attention_mask=key_ok)[:, P - 1:-1]  # (B, T, C): P-1+t predicts t
    m = completion_mask.to(h.device, torch.float32)  # (B, T)
    sel = m.reshape(-1).nonzero().squeeze(1)  # (n,) flat indices of the completion tokens
    h_sel, ids_sel = h.reshape(B * T, -1)[sel], completion_ids.reshape(-1)[sel]  # (n, C), (n,)
    args = (model.lm_head, h_sel, ids_sel, temperature, entropy)  # only these tokens reach lm_head
    lp, ent = (engine.chunked_token_logprobs(token_logprobs, *args) if CHUNKED_LOGPROBS
               else token_logprobs(*args))  # (n,) each
    zero = h.sum(-1).float().reshape(-1) * 0  # (B*T,) zeros that keep the graph with no token
    lp = zero.index_put((sel,), lp).view(B, T) * m  # (B, T)
    return lp, zero.index_put((sel,), ent).view(B, T) * m if entropy else None  # (B, T) each

# ============ Part 2: other model families, options, plumbing, the loader, the command line ============
# Part 2's own imports (the loader's and the command line's), kept out of Part 1's page
import math  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

from qerl import cli  # noqa: E402
from qerl import memory  # noqa: E402

# ---------------------------------------------------------------------------------------------------
# Other model families (config.json says which): Qwen3's per-head q/k norms; Llama 3's RoPE scaling below

class QKNormAttention(Attention):
    """Qwen3's attention: an RMSNorm over head_dim on each head of q and of k, before RoPE."""

    def __init__(self, cfg, layer_idx):
        super().__init__(cfg, layer_idx)
        self.q_norm = RMSNorm(self.D, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(self.D, cfg.rms_norm_eps)

    def qkv(self, x):
        q, k, v = super().qkv(x)  # q (B, T, H, D), k and v (B, T, H_kv, D)
        return self.q_norm(q), self.k_norm(k), v


def llama3_scaled_inv_freq(inv, s):
    """Llama 3's rope_scaling of inverse frequencies inv (D/2,): the long wavelengths are stretched."""
    factor, lo, hi = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_ctx = s["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv
    # Longer than old_ctx/lo: slowed by `factor`; shorter than old_ctx/hi: kept; between: a linear blend.
    slow = torch.where(wavelen > old_ctx / lo, inv / factor, inv)
    t = (old_ctx / wavelen - lo) / (hi - lo)
    blend = (1 - t) * slow / factor + t * slow
    middle = (wavelen >= old_ctx / hi) & (wavelen <= old_ctx / lo)
    return torch.where(middle, blend, slow)


# ---------------------------------------------------------------------------------------------------
# Options: top-k / top-p (sample_next calls it; no-ops at generate's defaults)

def filter_logits(logits, top_k=0, top_p=1.0):
    """Set to -inf every logit (..., V) outside the top-k (ties at the k-th value stay), then outside the
    nucleus: the fewest most likely tokens whose top-k-renormalized probability sums to >= top_p."""
    if top_k and top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).values[..., -1:]  # (..., 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)  # (..., V)
        p = sorted_logits.softmax(-1)
        mass_before = torch.cat((torch.zeros_like(p[..., :1]), p.cumsum(-1)[..., :-1]), dim=-1)  # exclusive cumsum
        drop = mass_before >= top_p  # the set is already big enough without this token
        drop[..., 0] = False  # the most likely token always stays
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(-1, order, drop), float("-inf"))
    return logits


# ---------------------------------------------------------------------------------------------------
# Batching and logits: left padding (generate, sequence_logprobs), the full logits (stage 04's KL)

sample_from = engine.sample_from  # the inverse-CDF draw sample_next runs, under its old name here


def completion_hidden(model, prompt_ids, completion_ids):
    """Final-norm hidden states (B, T, C) at the positions that predict each completion token (as in
    sequence_logprobs)."""
    ids, key_ok, P = left_pad(prompt_ids, completion_ids.to(devices.model_device(model)))
    return model.hidden_states(ids, attention_mask=key_ok)[:, P - 1:-1]  # (B, T, C): P-1+t predicts token t


def completion_logits(model, prompt_ids, completion_ids):
    """fp32 logits (B, T, V) of the distributions that produced each completion token."""
    return model.lm_head(completion_hidden(model, prompt_ids, completion_ids)).float()  # (B, T, V)


# ---------------------------------------------------------------------------------------------------
# Loader: a meta-device model, filled from safetensors one tensor at a time (peak: about the model's size)

def load_model(path, quant="none", dtype=None, device=None, method="rtn"):
    """Load a Hugging Face folder -> (CausalLM in eval mode, Tokenizer). quant="nvfp4"/"nf4" quantizes the
    decoder Linears with stage 01, layer by layer as they arrive (method: NVFP4's rounding, "rtn" or
    "4over6"); a folder written by `qerl/quantize.py --out` loads as NVFP4 with quant "none" or "nvfp4"
    (its weights are already NVFP4; "nf4" is an error). dtype: bf16 on CUDA, fp32 on CPU; device:
    devices.autodetect_device."""
    path = Path(path)
    raw, weight_map, _ = hf_files.find_weight_files(str(path))  # checks the folder: config.json, shards
    files = {name: path / f for name, f in weight_map.items()}  # tensor name -> safetensors file
    cfg = ModelConfig.from_dict(raw, where=str(path / "config.json"))
    hf_files.check_config_fits_weights(str(path), raw, weight_map)  # 2 layers said, 4 stored: not a truncated model
    quant, prequantized = _load_format(path, raw, quant, method)
    hf_files.read_weight_headers(str(path), weight_map)  # every header sound, every weight a dtype we compute with
    tokenizer = hf_files.load_tokenizer(path, raw)  # before the weights: a missing tokenizer should fail fast
    hf_files.check_vocab(tokenizer, cfg.vocab_size, path)
    device = devices.pick_device(device)
    dtype = dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"dtype must be torch.float32, torch.bfloat16 or torch.float16, got {dtype!r}")
    with torch.device("meta"):
        model = CausalLM(cfg)
    for name, mod in list(model.named_modules()):  # stored as NVFP4: an empty NVFP4Linear, filled like the rest
        if prequantized and isinstance(mod, nn.Linear) and name + ".weight_packed" in files:
            quantize.replace_module(model, name, quantize.NVFP4Linear(
                mod.in_features, mod.out_features, bias=mod.bias is not None, device="meta"))
    expected = [n for n in model.state_dict() if not (cfg.tie_word_embeddings and n == "lm_head.weight")]
    missing = [n for n in expected if n not in files]
    if missing:
        raise ValueError(f"{path}: checkpoint lacks {len(missing)} weight(s), first: {missing[0]}")
    _fill(model, expected, files, quant, device, dtype, method)
    extra = sorted(set(files) - set(expected) - {"lm_head.weight"})
    extra = [n for n in extra if not n.endswith(("rotary_emb.inv_freq", "input_global_scale"))]
    if extra:
        print(f"note | ignored {len(extra)} checkpoint tensor(s) the model does not use, first: {extra[0]}")
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    return model.eval(), tokenizer


def _load_format(path, raw, quant, method="rtn"):
    """-> (the format to quantize into while loading, whether the checkpoint is already NVFP4)."""
    if quant not in quantize.quant_choices():
        raise ValueError(f"quant must be one of {', '.join(quantize.quant_choices())}, got {quant!r}")
    if method != "rtn" and quant != "nvfp4":
        raise ValueError(f"method {method!r} is a rounding of NVFP4 weights: it needs quant='nvfp4', got {quant!r}")
    ct = raw.get("quantization_config")
    if ct is None:
        return quant, False
    if ct.get("format") != "nvfp4-pack-quantized":
        raise ValueError(f"{path}: only nvfp4-pack-quantized checkpoints load, got format {ct.get('format')!r}")
    if quant not in ("none", "nvfp4"):
        raise ValueError(f"{path} is already NVFP4-quantized; load it with quant='none' or 'nvfp4'")
    return "none", True  # its Linear layers arrive quantized


def _fill(model, names, files, quant, device, dtype, method="rtn"):
    """Read `names` from their files into the meta model: non-layer tensors, then layer 0, 1, ...; with
    quant != "none", layer i is quantized (and its full-precision weights dropped) once it is complete."""
    def layer_of(name):
        return int(name.split(".")[2]) if name.startswith("model.layers.") else -1

    handles = {}
    order = sorted(names, key=layer_of)
    for j, n in enumerate(order):
        t = hf_files.read_tensor(handles, files[n], n)  # checked: readable, and finite if a float
        # Float weights take the compute dtype; packed codes and scales keep theirs (a bf16 global scale would
        # shift every dequantized value), and so do weights about to be quantized (as `qerl/quantize.py --out`).
        keep = (t.dtype not in (torch.float32, torch.float16, torch.bfloat16) or n.endswith("global_scale")
                or (quant != "none" and n.startswith("model.layers.") and n.endswith("_proj.weight")))
        hf_files.put_tensor(model, n, t.to(device=device, dtype=None if keep else dtype), files[n])
        i = layer_of(n)
        if quant != "none" and i >= 0 and (j + 1 == len(order) or layer_of(order[j + 1]) != i):
            quantize.quantize_model(model.model.layers[i], fmt=quant, skip=(), method=method)  # layer i complete


def random_model(tok, seed=0, device="cpu"):
    """A small random Qwen2-shaped model for demos when no checkpoint is at hand."""
    torch.manual_seed(seed)
    model = CausalLM(ModelConfig(vocab_size=tok.vocab_size, hidden_size=128, intermediate_size=384, head_dim=32,
                                 num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True))
    with torch.no_grad():  # HF's init (std 0.02): near-uniform next-token distributions, i.e. random bytes
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.02)
    return model.to(device).eval()


# ---------------------------------------------------------------------------------------------------
# The command line. Run it:
#     python qerl/rollout.py                                 # the bundled assets/tiny-qwen
#     python qerl/rollout.py --model DIR --prompt "What is 12+7?" --num-samples 4 --temperature 0.8
#     python qerl/rollout.py --model DIR --quant nvfp4       # quantize on the way in (stage 01)
#     python qerl/rollout.py --compile                       # decode steps through torch.compile
# On a CPU each takes a few seconds (3-9 s for the bundled model, mostly starting torch); --compile adds a
# one-time compile: 3-9 s with a warm inductor cache, tens of seconds cold.

def build_parser():
    number = cli.number
    ap = cli.ArgumentParser(description="Sample completions from a Qwen2/Llama/Qwen3 folder")
    ap.add_argument("--model", default=str(Path(__file__).parent.parent / "assets" / "tiny-qwen"),
                    help="HF model folder (default: the bundled assets/tiny-qwen)")
    ap.add_argument("--prompt", default="12+7-3=?", help="user message (ChatML-wrapped; the default is the bundled "
                    "model's task; for a chat model such as SmolLM2 ask, say, \"What is 12 + 7?\")")
    system = ap.add_mutually_exclusive_group()
    system.add_argument("--system", default=None, help="system message (default: the one the model's chat "
                        "template writes when there is none, e.g. SmolLM2's; none if it writes none)")
    system.add_argument("--no-system", action="store_true", help="write no system block at all")
    ap.add_argument("--max-new-tokens", type=number(int, 1), default=64)
    ap.add_argument("--num-samples", type=number(int, 1), default=4, help="completions per prompt (GRPO's G)")
    ap.add_argument("--temperature", type=number(float, 0), default=1.0, help="0 = greedy")
    ap.add_argument("--top-k", type=number(int, 0), default=0, help="0 = no top-k filter")
    ap.add_argument("--top-p", type=number(float, hi=1, above=0), default=1.0, help="nucleus mass, in (0, 1]")
    ap.add_argument("--seed", type=number(int, 0, cli.MAX_SEED), default=0)
    ap.add_argument("--quant", default="none", choices=quantize.quant_choices(), help="quantize on load")
    ap.add_argument("--quant-method", default="rtn", choices=quantize.NVFP4_METHODS,
                    help="NVFP4's rounding with --quant nvfp4: rtn (compressed-tensors) or 4over6 (Four Over Six)")
    ap.add_argument("--device", default=None, help="cpu | cuda (default: autodetect)")
    ap.add_argument("--dtype", choices=devices.DTYPES, default="auto", help="activation dtype; auto: bfloat16 on "
                    "CUDA, and on a CPU with native bf16 for a model of hidden size "
                    f"{devices.AUTO_BF16_MIN_HIDDEN} or more, else float32")
    ap.add_argument("--compile", action="store_true", help="run the decode steps through torch.compile "
                    "(the first call compiles: tens of seconds)")
    return ap


def main(argv=None):
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.quant_method != "rtn" and args.quant != "nvfp4":
        ap.error(f"--quant-method {args.quant_method} is a rounding of NVFP4 weights: it needs --quant nvfp4")
    if 0 < args.temperature < engine.MIN_TEMPERATURE:
        ap.error(f"argument --temperature: {args.temperature:g} is too small to sample with: need 0 (greedy) or "
                 f">= {engine.MIN_TEMPERATURE:g}")
    device = devices.pick_device(args.device)  # before loading: no GPU is one line, not a late traceback
    t0 = time.perf_counter()
    hidden = hf_files.find_weight_files(args.model)[0].get("hidden_size") if args.dtype == "auto" else None
    dtype, why = devices.pick_dtype(args.dtype, device, hidden)
    model, tok = load_model(args.model, quant=args.quant, dtype=dtype, device=device, method=args.quant_method)
    cfg = model.config
    print(f"model | {args.model} | type {cfg.model_type} | layers {cfg.num_hidden_layers} "
          f"| hidden {cfg.hidden_size} | quant {args.quant} | device {device} "
          f"| dtype {str(dtype).replace('torch.', '')} ({why}) | load_s {time.perf_counter() - t0:.1f}")

    system = args.system
    if system is None and not args.no_system:
        system = tok.default_system  # what the model's own chat template writes
    for flag, text in (("--prompt", args.prompt), ("--system", system)):
        if text is not None and any("\udc80" <= c <= "\udcff" for c in text):  # Python's escapes of bad bytes
            raise ValueError(f"{flag} is not valid UTF-8 (a byte the shell passed through): write it as UTF-8 text")
    prompt = tok.encode(hf_files.chat_prompt(args.prompt, system))
    if len(prompt) + args.max_new_tokens > cfg.max_position_embeddings:  # before the memory it would need
        raise ValueError(f"--prompt is {len(prompt)} tokens in the chat template; with --max-new-tokens "
                         f"{args.max_new_tokens} that exceeds the model's context of {cfg.max_position_embeddings}: "
                         f"shorten it or lower --max-new-tokens")
    dtype_bytes = model.model.embed_tokens.weight.element_size()
    need = memory.generate_memory(cfg, args.num_samples, len(prompt), args.max_new_tokens, dtype_bytes)
    devices.check_memory_fits(need, device,
                              f"--num-samples {args.num_samples} with --max-new-tokens {args.max_new_tokens}")
    gen = torch.Generator(device=device).manual_seed(args.seed)
    r = generate(model, [prompt], num_samples=args.num_samples, max_new_tokens=args.max_new_tokens,
                 temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, generator=gen, tokenizer=tok,
                 compiled=args.compile)
    for i, text in enumerate(r.texts):
        n = int(r.completion_mask[i].sum())
        print(f"--- sample {i} | tokens {n} | mean logprob {float(r.logprobs[i].sum()) / max(n, 1):.3f} ---")
        print(text)
    s = r.stats
    print(f"prefill | tokens {s['prefill_tokens']} | tok/s {s['prefill_tokens'] / max(s['prefill_s'], 1e-9):.0f} "
          f"| decode | tokens {s['decode_tokens']} | steps {s['decode_steps']} "
          f"| tok/s {s['decode_tokens'] / max(s['decode_s'], 1e-9):.0f}"
          + (f" | compile_s {s['compile_s']:.1f}" if args.compile else ""))
    return 0


if __name__ == "__main__":
    sys.exit(cli.run_cli(main))
