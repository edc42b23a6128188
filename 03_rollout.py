"""Stage 03: the policy model and the rollout sampler, from scratch in plain torch.

GRPO samples G completions per prompt ("rollouts"), most of RL's time, hence QeRL's NVFP4 policy.
This file holds a Qwen2 / Llama decoder with Hugging Face's module names (stages 01, 02 and 04 find
layers by name), read from a Hugging Face folder; `generate`, a prefill then one decode step per
token over a KV cache -> a Rollout (tokens, log-probs, entropies); and `sequence_logprobs`, the
same log-probs with gradients, for the policy update. Qwen3 and Llama 3's RoPE scaling are left
to the full trainer, qerl/rollout.py.

Run it:  python 03_rollout.py            # the bundled assets/tiny-qwen answers 12+7-3=?
         python 03_rollout.py --model DIR --prompt "What is 12 + 7?" --num-samples 4 --quant nvfp4
"""

import argparse
import importlib
import json
import time
from dataclasses import dataclass
from pathlib import Path

import tokenizers
import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors import safe_open


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
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = True  # bias on q/k/v (Qwen2 always; Llama from config.json)
    o_bias: bool = False  # bias on o_proj (Llama follows attention_bias)
    mlp_bias: bool = False

    @classmethod
    def from_dict(cls, d):
        """config.json's dict -> ModelConfig, its gaps filled as Hugging Face fills them."""
        mt, heads, bias = (
            d.get("model_type"),
            d["num_attention_heads"],
            d.get("attention_bias", False),
        )
        if mt not in ("qwen2", "llama"):
            raise ValueError(
                f"config.json: model_type {mt!r} is not a Qwen2 or Llama decoder; the "
                "full trainer's qerl/rollout.py also loads qwen3"
            )
        rope = d.get("rope_parameters") or {}  # transformers 5 writes RoPE settings in one dict
        if d.get("rope_scaling") or rope.get("rope_type", "default") != "default":
            raise ValueError(
                "config.json: rope_scaling (Llama 3's long-context RoPE) is not in this "
                "stage; load the model with the full trainer's qerl/rollout.py"
            )
        return cls(
            model_type=mt,
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_hidden_layers=d["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=d.get("num_key_value_heads") or heads,
            head_dim=d.get("head_dim") or d["hidden_size"] // heads,
            rms_norm_eps=d.get("rms_norm_eps", 1e-6),
            rope_theta=float(d.get("rope_theta", rope.get("rope_theta", 10000.0))),
            max_position_embeddings=d.get("max_position_embeddings", 2048),
            tie_word_embeddings=d.get("tie_word_embeddings", False),
            attention_bias=True if mt == "qwen2" else bias,
            o_bias=False if mt == "qwen2" else bias,
            mlp_bias=d.get("mlp_bias", False),
        )


class RMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.noise = None  # AQN (stage 04): an fp32 (dim,) vector added to the gain while it is set

    def forward(self, x):  # HF's order: normalize in fp32, cast back, scale (bf16 rounds as HF's)
        h = x.float()
        h = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)
        if self.noise is None:  # .to(): a no-op unless the gain is an fp32 master copy
            return (self.weight * h).to(x.dtype)
        # w + Z in fp32, rounded once: Z added to a bf16 gain would mostly round away
        return ((self.weight.float() + self.noise) * h.float()).to(x.dtype)


def rope_inv_freq(cfg, device=None):  # (D/2,) fp32: the rotation speed of each pair of lanes
    D = cfg.head_dim
    return 1.0 / (cfg.rope_theta ** (torch.arange(0, D, 2, device=device).float() / D))  # (D/2,)


def apply_rope(x, cos, sin):  # HF's pairs: the two halves of head_dim, not even/odd lanes
    a, b = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-b, a), dim=-1) * sin  # (B, H, T, D)


class KVCache:
    """Layer i's keys/values k[i], v[i] (B, H_kv, S, D); `pos` (1,): the next slot, every row's."""

    def __init__(self, cfg, batch, max_len, device, dtype):
        shape, L = (batch, cfg.num_key_value_heads, max_len, cfg.head_dim), cfg.num_hidden_layers
        self.k = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(L)]
        self.v = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(L)]
        self.pos, self.max_len = torch.zeros(1, dtype=torch.long, device=device), max_len

    def slots(self, T):
        return self.pos + torch.arange(T, device=self.pos.device)  # (T,) the next T tokens' slots

    def update(self, layer, k, v):  # k, v (B, H_kv, T, D) -> all S slots' keys and values
        slots = self.slots(k.shape[2])  # (T,)
        self.k[layer].index_copy_(2, slots, k)  # in place: no reallocation per step
        self.v[layer].index_copy_(2, slots, v)
        return self.k[layer], self.v[layer]  # (B, H_kv, S, D): unwritten slots are masked


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

    def forward(self, x, cos, sin, mask, kv_cache=None):  # mask (B, 1, T, S): may t see slot s
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.H, self.D).transpose(1, 2)  # (B, H, T, D)
        k = self.k_proj(x).view(B, T, self.H_kv, self.D).transpose(1, 2)  # (B, H_kv, T, D)
        v = self.v_proj(x).view(B, T, self.H_kv, self.D).transpose(1, 2)  # (B, H_kv, T, D)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if kv_cache is not None:
            k, v = kv_cache.update(self.layer_idx, k, v)  # (B, H_kv, S, D), all the cache's slots
        # Grouped-query attention, K/V not copied: query head h reads K/V head h // G, so the G
        # heads of a group fold into the query axis, the mask with them.
        G, S = self.H // self.H_kv, k.shape[2]
        q = q.reshape(B, self.H_kv, G * T, self.D)  # (B, H_kv, G*T, D)
        mask = mask[:, :, None].expand(B, 1, G, T, S).reshape(B, 1, G * T, S)  # (B, 1, G*T, S)
        # softmax(q k^T / sqrt(D)) v over the allowed keys
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.D**-0.5)
        y = y.reshape(B, self.H, T, self.D).transpose(1, 2)  # (B, T, H, D)
        return self.o_proj(y.reshape(B, T, self.H * self.D))  # (B, T, C)


class MLP(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        C, I = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = nn.Linear(C, I, bias=cfg.mlp_bias)
        self.up_proj = nn.Linear(C, I, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(I, C, bias=cfg.mlp_bias)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))  # SwiGLU, (B, T, C)


class DecoderLayer(nn.Module):
    def __init__(self, cfg, layer_idx):
        super().__init__()
        self.self_attn = Attention(cfg, layer_idx)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, mask, kv_cache=None):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask, kv_cache)  # (B, T, C)
        return x + self.mlp(self.post_attention_layernorm(x))


class CausalLM(nn.Module):
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
        for layer in self.model.layers:
            x = layer(x, cos, sin, mask, kv_cache)  # (B, T, C)
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


# ---- The sampler: draw from the tempered logits; generate = a prefill, a decode step per token
def entropy_from_logp(logp, p=None):
    p = logp.exp() if p is None else p  # clamping -inf keeps 0 * log 0 at 0, value and gradient
    return -(p * logp.clamp(min=torch.finfo(logp.dtype).min)).sum(-1)


def sample_from(p, generator):
    """One index per row of probabilities p (B, V) by inverse CDF: torch.multinomial's
    distribution, several times faster on a CPU. u < total, so the index has p > 0."""
    cdf = p.cumsum(-1)  # (B, V)
    total = cdf[:, -1:]  # (B, 1), 1 up to rounding
    dev = generator.device if generator is not None else p.device  # a CPU generator may drive CUDA
    u = torch.rand(p.shape[0], 1, generator=generator, device=dev).to(p.device) * total  # (B, 1)
    u = torch.minimum(u, torch.nextafter(total, torch.zeros_like(total)))
    # the first cdf > u; a row of NaN logits finds none: its last index (and a NaN log-prob)
    return torch.searchsorted(cdf, u, right=True).squeeze(-1).clamp_(max=p.shape[-1] - 1)  # (B,)


def sample_next(logits, temperature, generator):
    """One token per row from logits (B, V) -> (token, logprob, entropy), each (B,)."""
    if temperature == 0:
        logp = logits.log_softmax(-1)  # (B, V), greedy reports the untempered distribution
        tok = logits.argmax(-1)
    else:
        logp = (logits / temperature).log_softmax(-1)  # (B, V)
    p = logp.exp()  # (B, V)
    if temperature != 0:
        tok = sample_from(p, generator)  # (B,)
    return tok, logp.gather(-1, tok[:, None]).squeeze(-1), entropy_from_logp(logp, p)


@dataclass
class Rollout:
    prompt_ids: list  # list[list[int]] per row, prompt-major: rows i*G..i*G+G-1
    completion_ids: torch.Tensor  # (B*G, T) long, pad after EOS
    completion_mask: torch.Tensor  # (B*G, T) float, 1 for sampled tokens including the EOS token
    logprobs: torch.Tensor  # (B*G, T) log-prob under the distribution it was drawn from
    entropy: torch.Tensor  # (B*G, T) entropy of that distribution
    texts: list = None  # decoded completions when a tokenizer is given


def decode_step(model, cache, tok, key_ok, temperature, generator):
    """tok (B, T) into the cache's next T slots (key_ok (B, S): real slots) -> sample_next's."""
    h = model.hidden_states(tok, attention_mask=key_ok, kv_cache=cache)  # (B, T, C)
    logits = model.lm_head(h[:, -1]).float()  # (B, V): only the last position is needed
    return sample_next(logits, temperature, generator)


def left_pad(prompt_ids, completion_ids):
    """Prompts left-padded to one length P, then completions (B, T) -> ids, key_ok (B, P+T), P."""
    P = max(len(p) for p in prompt_ids)
    ids = F.pad(completion_ids, (P, 0))  # (B, P+T)
    key_ok = torch.ones_like(ids, dtype=torch.bool)  # (B, P+T): the real slots
    for i, p in enumerate(prompt_ids):
        ids[i, P - len(p) : P] = torch.tensor(list(p), device=ids.device)
        key_ok[i, : P - len(p)] = False
    return ids, key_ok, P


# The KV cache's length: prompt + new tokens rounded up to a multiple of this, as the trainer's
# is (there a compiled step serves many prompt lengths). SDPA's sums over another number of
# (masked) slots round differently: the log-probs would part from the trainer's in the last bits.
CACHE_SLOTS_MULTIPLE = 64
# "All rows done?" every 8 tokens only: a host read waits for a GPU's queue. It also fixes how
# many draws a call takes from `generator`, the same as the trainer's sampler.
DONE_CHECK_EVERY = 8


@torch.no_grad()
def generate(
    model,
    prompts,
    num_samples=1,
    max_new_tokens=256,
    temperature=1.0,
    eos_token_ids=None,
    generator=None,
    tokenizer=None,
):
    """`num_samples` completions of each prompt (a list of token ids) -> Rollout, rows
    prompt-major. temperature=0 is greedy; each row stops at its own EOS (default: the
    tokenizer's); the pad id is the tokenizer's, else the first EOS id."""
    dev = model.lm_head.weight.device
    if eos_token_ids is None:
        eos_token_ids = tokenizer.eos_token_ids if tokenizer is not None else []
    pad_id = tokenizer.pad_token_id if tokenizer is not None else (list(eos_token_ids) or [0])[0]
    eos = torch.tensor(list(eos_token_ids), dtype=torch.long, device=dev)  # (E,)
    rows = [list(p) for p in prompts for _ in range(num_samples)]  # prompt-major
    B, N = len(rows), max_new_tokens
    out_ids = torch.full((B, N), pad_id, dtype=torch.long, device=dev)  # (B, N)
    out_mask, out_lp, out_ent = (torch.zeros(B, N, device=dev) for _ in range(3))  # (B, N)
    ids, key_ok, P = left_pad(rows, out_ids)  # key_ok (B, P+N): prompt tokens and every new slot
    S = -(-(P + N) // CACHE_SLOTS_MULTIPLE) * CACHE_SLOTS_MULTIPLE
    key_ok = F.pad(key_ok, (0, S - P - N))  # (B, S); the slots past P+N are never written
    cache = KVCache(model.config, B, S, dev, model.model.embed_tokens.weight.dtype)
    live = torch.ones(B, dtype=torch.bool, device=dev)  # (B,) rows that have not sampled an EOS
    tok, lp, ent = decode_step(model, cache, ids[:, :P], key_ok, temperature, generator)  # prefill
    for t in range(N):  # done rows are fed pads (outputs ignored): no compacting of the cache
        tok = torch.where(live, tok, pad_id)  # (B,)
        out_ids[:, t], out_mask[:, t] = tok, live.float()
        out_lp[:, t], out_ent[:, t] = lp * live, ent * live
        live = live & ~torch.isin(tok, eos)  # the EOS token itself stays in the completion
        if t == N - 1 or ((t + 1) % DONE_CHECK_EVERY == 0 and not bool(live.any())):
            break
        tok, lp, ent = decode_step(model, cache, tok[:, None], key_ok, temperature, generator)
    steps = int(out_mask[:, : t + 1].any(0).sum())  # rows only stop: the live columns are a prefix
    ids, mask = out_ids[:, :steps], out_mask[:, :steps]
    texts = None
    if tokenizer is not None:
        texts = [tokenizer.decode(r[m > 0].tolist()) for r, m in zip(ids, mask)]
    return Rollout(rows, ids, mask, out_lp[:, :steps], out_ent[:, :steps], texts)


# ---- Log-probs with gradients, for the policy update
def token_logprobs(lm_head, h, ids, temperature, entropy=True):
    """Log-probs of ids and entropies (None unless `entropy`), each (n,), from h (n, C)."""
    logits = lm_head(h).float()  # (n, V)
    logp = (logits / temperature if temperature > 0 else logits).log_softmax(-1)  # (n, V)
    return logp.gather(-1, ids[:, None]).squeeze(-1), entropy_from_logp(logp) if entropy else None


def sequence_logprobs(
    model, prompt_ids, completion_ids, completion_mask, temperature=1.0, entropy=True
):
    """Log-probs and entropies (None unless `entropy`) (B, T) of `completion_ids` after each
    row's prompt, with gradients, 0 after EOS: what `generate` recorded."""
    completion_ids = completion_ids.to(model.lm_head.weight.device)
    B, T = completion_ids.shape
    ids, key_ok, P = left_pad(prompt_ids, completion_ids)
    h = model.hidden_states(ids, attention_mask=key_ok)  # (B, P+T, C)
    h = h[:, P - 1 : -1]  # (B, T, C): position P-1+t predicts token t
    m = completion_mask.to(h.device, torch.float32)  # (B, T)
    sel = m.reshape(-1).nonzero().squeeze(1)  # (n,) flat indices of the completion tokens
    h_sel, ids_sel = h.reshape(B * T, -1)[sel], completion_ids.reshape(-1)[sel]  # (n, C), (n,)
    # only these tokens reach lm_head: (n, V) logits, not (B*T, V)
    lp, ent = token_logprobs(model.lm_head, h_sel, ids_sel, temperature, entropy)  # (n,) each
    zero = h.sum(-1).float().reshape(-1) * 0  # (B*T,) zeros that keep the graph with no token
    lp = zero.index_put((sel,), lp).view(B, T) * m  # (B, T)
    return lp, zero.index_put((sel,), ent).view(B, T) * m if entropy else None  # (B, T) each


def completion_logits(model, prompt_ids, completion_ids):
    """fp32 logits (B, T, V) of the distributions that produced each completion token (04's KL)."""
    ids, key_ok, P = left_pad(prompt_ids, completion_ids.to(model.lm_head.weight.device))
    h = model.hidden_states(ids, attention_mask=key_ok)[:, P - 1 : -1]  # (B, T, C)
    return model.lm_head(h).float()  # (B, T, V)


# ---- A Hugging Face folder: config.json, *.safetensors, tokenizer.json, the ChatML prompt
def read_json(path):
    return json.loads(Path(path).read_text()) if Path(path).exists() else {}


class Tokenizer:
    """A `tokenizers.Tokenizer` plus the ids generation needs: the EOS list and the pad id."""

    def __init__(self, tok, eos_token_ids, pad_token_id=None):
        self.tok = tok
        self.eos_token_ids = list(eos_token_ids)
        self.pad_token_id = pad_token_id if pad_token_id is not None else (eos_token_ids or [0])[0]
        self.vocab_size = tok.get_vocab_size()

    def encode(self, text):  # ChatML's special tokens in `text` map to their single ids
        return self.tok.encode(text).ids

    def decode(self, ids, skip_special_tokens=True):
        return self.tok.decode(list(ids), skip_special_tokens=skip_special_tokens)


def load_tokenizer(folder, config):
    """tokenizer.json; EOS and pad ids from generation_config.json, else config.json, else
    tokenizer_config.json's token strings. The chat template must be ChatML (chat_prompt)."""
    folder = Path(folder)
    tok = tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json"))
    ids = {**config, **read_json(folder / "generation_config.json")}  # the latter's ids win
    tok_config = read_json(folder / "tokenizer_config.json")
    eos, pad = ids.get("eos_token_id"), ids.get("pad_token_id")
    if eos is None and tok_config.get("eos_token"):
        eos = tok.token_to_id(tok_config["eos_token"])
    if pad is None and tok_config.get("pad_token"):
        pad = tok.token_to_id(tok_config["pad_token"])
    template = tok_config.get("chat_template")
    if template is not None and "<|im_start|>" not in template:
        raise ValueError(f"{folder}: the chat template is not ChatML, the one format written here")
    return Tokenizer(tok, [] if eos is None else [eos] if isinstance(eos, int) else eos, pad)


def chat_prompt(user, system=None):
    """The ChatML prompt (Qwen2.5, SmolLM2), ending where the assistant starts to talk."""
    head = f"<|im_start|>system\n{system}<|im_end|>\n" if system is not None else ""
    return f"{head}<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n"


def load_model(folder, quant="nvfp4", dtype=torch.float32, device="cpu"):
    """A Hugging Face folder -> (CausalLM in eval mode, Tokenizer). quant="nvfp4" swaps every
    decoder Linear for stage 01's NVFP4Linear; "none" keeps the weights in `dtype`."""
    if quant not in ("nvfp4", "none"):
        raise ValueError(f"quant must be 'nvfp4' or 'none', got {quant!r}")
    folder = Path(folder)
    raw = json.loads((folder / "config.json").read_text())  # a missing file: an error naming it
    cfg = ModelConfig.from_dict(raw)
    index = read_json(folder / "model.safetensors.index.json")  # a sharded checkpoint's map
    shards = sorted(set(index["weight_map"].values())) if index else ["model.safetensors"]
    with torch.device("meta"):  # no memory yet: the checkpoint's tensors become the parameters
        model = CausalLM(cfg)
    tied = cfg.tie_word_embeddings  # lm_head reads embed_tokens' matrix: not in the checkpoint
    names = [n for n in model.state_dict() if not (tied and n == "lm_head.weight")]
    state = {}
    for shard in shards:
        with safe_open(folder / shard, "pt") as f:
            state.update({n: f.get_tensor(n) for n in f.keys() if n in names})
    missing = [n for n in names if n not in state]
    if missing:
        raise ValueError(f"{folder}: the checkpoint lacks {len(missing)} weights: {missing[0]}...")
    for n in names:  # weights about to be quantized keep their stored precision until then
        keep = quant != "none" and n.startswith("model.layers.") and n.endswith("_proj.weight")
        state[n] = state[n].to(device=device, dtype=None if keep else dtype)
    model.load_state_dict(state, strict=False, assign=True)
    if tied:
        model.lm_head.weight = model.model.embed_tokens.weight
    if quant == "nvfp4":
        importlib.import_module("01_quantize").quantize_model(model)  # lm_head stays as it is
    return model.eval(), load_tokenizer(folder, raw)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description="Sample completions from a Qwen2/Llama folder")
    ap.add_argument("--model", default=str(Path(__file__).parent / "assets" / "tiny-qwen"))
    ap.add_argument("--prompt", default="12+7-3=?", help="the user message, ChatML-wrapped")
    ap.add_argument("--num-samples", type=int, default=4, help="completions (GRPO's G)")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=1.0, help="0 = greedy")
    ap.add_argument("--quant", choices=["none", "nvfp4"], default="none", help="NVFP4 via 01")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    t0 = time.perf_counter()
    model, tok = load_model(args.model, quant=args.quant, dtype=dtype, device=device)
    cfg = model.config
    print(
        f"model | {args.model} | {cfg.model_type} | layers {cfg.num_hidden_layers} | hidden "
        f"{cfg.hidden_size} | quant {args.quant} | {device} | load {time.perf_counter() - t0:.1f}s"
    )
    prompt = tok.encode(chat_prompt(args.prompt))
    gen = torch.Generator(device=device).manual_seed(args.seed)
    t0 = time.perf_counter()
    G, N, temperature = args.num_samples, args.max_new_tokens, args.temperature
    r = generate(model, [prompt], G, N, temperature, generator=gen, tokenizer=tok)
    seconds = time.perf_counter() - t0
    for i, text in enumerate(r.texts):
        n = int(r.completion_mask[i].sum())
        mean = float(r.logprobs[i].sum()) / n
        print(f"--- sample {i} | tokens {n} | mean logprob {mean:.3f} ---")
        print(text)
    print(f"decode | tokens {int(r.completion_mask.sum())} | {seconds:.2f}s")
