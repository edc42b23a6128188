"""Stage 03: the from-scratch decoder against Hugging Face reference logits, the KV-cached sampler against
full recomputes, sampling masks, per-row EOS, sequence log-probs, the loader's error messages, and each fast
path of engine.py (CPU decode attention, compiled step, chunked log-probs) against the plain one it replaces.

The reference data in tests/data/<family>/ was made once by tests/make_reference_logits.py (with
transformers, which the project does not depend on)."""
import copy
import importlib
import json
import math
import os
import runpy
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from qerl import engine  # the fast equivalents 03 runs beneath its plain computations
from qerl import hf_files
ro = importlib.import_module("qerl.rollout")
ROOT = Path(__file__).resolve().parent.parent
DATA = Path(__file__).resolve().parent / "data"
FAMILIES = ["qwen2", "llama", "qwen3"]


def random_model(seed=0, **overrides):
    """A tiny fp32 model with O(1) activations (default inits give near-uniform logits)."""
    cfg = ro.ModelConfig(**{**dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                   max_position_embeddings=128, qk_norm=True, o_bias=True), **overrides})
    g = torch.Generator().manual_seed(seed)
    model = ro.CausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            r = torch.randn(p.shape, generator=g)
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.1 * r)
            elif name.endswith("bias"):
                p.copy_(0.1 * r)
            elif "embed_tokens" in name:  # tied or not, the logits scale comes from here
                p.copy_(0.3 * r)
            else:
                p.copy_(r / p.shape[1] ** 0.5)
    return model.eval()


def left_pad(prompts, pad=0):
    L = max(map(len, prompts))
    ids = torch.full((len(prompts), L), pad, dtype=torch.long)
    mask = torch.zeros(len(prompts), L, dtype=torch.bool)
    for i, p in enumerate(prompts):
        ids[i, L - len(p):] = torch.tensor(p)
        mask[i, L - len(p):] = True
    return ids, mask


PROMPTS = [[5, 17, 3, 40, 2], [7, 1, 9, 33, 12, 8, 61, 4, 20], [11, 2]]


@pytest.fixture(scope="module")
def model():
    return random_model()


@pytest.fixture(scope="module", params=FAMILIES)
def family(request):
    m, tok = ro.load_model(DATA / request.param, device="cpu")
    return request.param, m, tok, load_file(DATA / request.param / "reference.safetensors")


# ---------------------------------------------------------------------------------------------------
# Loader vs Hugging Face

def test_logits_match_hf_reference(family):
    name, m, _, ref = family
    with torch.no_grad():
        logits = m(ref["input_ids"], ref["position_ids"], ref["attention_mask"])  # (B, L, V)
    real = ref["attention_mask"].bool()  # pad positions are garbage in both implementations
    assert logits.dtype == torch.float32 and logits.shape == ref["logits"].shape
    torch.testing.assert_close(logits[real], ref["logits"][real], atol=1e-5, rtol=1e-5)
    # Positions are derived from the mask when not given: same result.
    with torch.no_grad():
        torch.testing.assert_close(m(ref["input_ids"], attention_mask=ref["attention_mask"])[real], logits[real])


def test_greedy_tokens_match_hf_generate(family):
    name, m, tok, ref = family
    for i in range(3):
        hf = ref[f"greedy_{i}"]
        hf = hf[hf >= 0]
        r = ro.generate(m, [ref[f"greedy_prompt_{i}"].tolist()], max_new_tokens=8, temperature=0.0, tokenizer=tok)
        assert r.completion_ids[0][r.completion_mask[0] > 0].tolist() == hf.tolist(), name


def test_family_specific_structure():
    q2, _ = ro.load_model(DATA / "qwen2", device="cpu")
    assert q2.lm_head.weight is q2.model.embed_tokens.weight  # tied
    assert q2.model.layers[0].self_attn.q_proj.bias is not None and q2.model.layers[0].self_attn.o_proj.bias is None
    ll, tok = ro.load_model(DATA / "llama", device="cpu")
    assert ll.lm_head.weight is not ll.model.embed_tokens.weight and ll.config.rope_scaling["rope_type"] == "llama3"
    assert ll.model.layers[0].self_attn.q_proj.bias is None and tok.eos_token_ids == [258]  # int in config.json
    q3, tok = ro.load_model(DATA / "qwen3", device="cpu")
    assert q3.config.head_dim == 24 != q3.config.hidden_size // q3.config.num_attention_heads
    assert q3.model.layers[1].self_attn.k_norm.weight.shape == (24,)
    assert tok.eos_token_ids == [258] and tok.pad_token_id == 256  # int in generation_config.json
    # Everything is materialized (nothing left on meta), norms expose a Parameter for stage 04.
    assert all(p.device.type == "cpu" for p in q3.parameters())
    assert isinstance(q3.model.layers[0].input_layernorm.weight, torch.nn.Parameter)
    # The llama3 rule: short wavelengths kept, long ones divided by `factor`, the middle band blended.
    base = 1.0 / 500000.0 ** (torch.arange(0, 16, 2).float() / 16)
    inv = ro.rope_inv_freq(ll.config)
    assert inv[0] == base[0] and torch.allclose(inv[3:], base[3:] / 8) and base[1] / 8 < inv[1] < base[1]


def test_sharded_checkpoint_and_dtype(tmp_path):
    src = DATA / "qwen2"
    for f in ("config.json", "tokenizer.json", "generation_config.json"):
        shutil.copy(src / f, tmp_path / f)
    with safe_open(src / "model.safetensors", "pt") as f:
        names = sorted(f.keys())
        tensors = {n: f.get_tensor(n) for n in names}
    half = len(names) // 2
    weight_map = {}
    for k, part in enumerate((names[:half], names[half:])):
        fname = f"model-0000{k + 1}-of-00002.safetensors"
        save_file({n: tensors[n] for n in part}, tmp_path / fname)
        weight_map.update({n: fname for n in part})
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    ref = load_file(src / "reference.safetensors")
    a, _ = ro.load_model(src, device="cpu")
    b, _ = ro.load_model(tmp_path, device="cpu")
    with torch.no_grad():
        torch.testing.assert_close(b(ref["input_ids"]), a(ref["input_ids"]), atol=0, rtol=0)
    c, _ = ro.load_model(src, device="cpu", dtype=torch.bfloat16)
    assert c.model.layers[0].mlp.up_proj.weight.dtype == torch.bfloat16
    with torch.no_grad():  # a bf16 model still returns fp32 logits, close to the fp32 ones
        lc = c(ref["input_ids"])
    assert lc.dtype == torch.float32 and (lc - a(ref["input_ids"]).detach()).abs().max() < 0.25


# ---------------------------------------------------------------------------------------------------
# KV cache and batching

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cached_logits_equal_full_recompute(model, dtype):
    # a decode step on a CPU attends by the plain product, a full forward by SDPA: the same logits
    model = copy.deepcopy(model).to(dtype)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=6e-2, rtol=2e-2)  # bf16 logits: 1-2 ulp
    ids, mask = left_pad(PROMPTS)  # (3, 9)
    B, P = ids.shape
    steps = 6
    cache = ro.KVCache(model.config, B, P + steps, "cpu", dtype)
    key_ok = torch.cat([mask, torch.ones(B, steps, dtype=torch.bool)], dim=1)  # (B, P+steps): every cache slot
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        logits = model(ids, attention_mask=key_ok, kv_cache=cache)[:, -1]  # prefill
        seq = ids
        for t in range(steps + 1):
            full = model(seq, attention_mask=key_ok[:, :seq.shape[1]])[:, -1]  # (B, V), no cache
            torch.testing.assert_close(logits, full, **tol)
            if t == steps:
                break
            nxt = torch.randint(0, model.config.vocab_size, (B, 1), generator=g)  # (B, 1)
            seq = torch.cat([seq, nxt], dim=1)
            logits = model(nxt, attention_mask=key_ok, kv_cache=cache)[:, -1]
    assert int(cache.pos) == P + steps


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_decode_attention_equals_sdpa(dtype):
    """engine.decode_attention_cpu, the plain product a CPU decode step runs, equals the SDPA call beside it in
    03's Attention (the one every other step runs) on the same grouped queries, keys, values and mask."""
    g = torch.Generator().manual_seed(0)
    B, H_kv, G, S, D = 3, 2, 4, 37, 16
    q, k, v = (torch.randn(B, H_kv, n, D, generator=g).to(dtype) for n in (G, S, S))  # q (B, H_kv, G, D)
    mask = torch.rand(B, 1, 1, S, generator=g) < 0.6  # (B, 1, 1, S): random real slots,
    mask[..., -1] = True  # and the query's own slot is always one
    mask[1, ..., :20] = False  # a left-padded row
    plain = engine.decode_attention_cpu(q, k, v, mask, D ** -0.5)  # (B, H_kv, G, D)
    sdpa = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask.expand(B, 1, G, S),
                                                            scale=D ** -0.5)  # (B, H_kv, G, D)
    assert plain.dtype == dtype and plain.shape == (B, H_kv, G, D)
    tol = dict(atol=1e-6, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-2, rtol=1e-2)  # bf16: an ulp or two
    torch.testing.assert_close(plain, sdpa, **tol)
    # a masked slot is ignored: changing its key and value changes nothing
    k2, v2 = k.clone(), v.clone()
    k2[1, ..., 3, :], v2[1, ..., 3, :] = 100, -100
    assert torch.equal(engine.decode_attention_cpu(q, k2, v2, mask, D ** -0.5), plain)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_decode_attention_switch_gives_the_plain_sdpa_rollout(model, monkeypatch, temperature):
    """DECODE_ATTENTION_CPU, the one line that chooses engine.decode_attention_cpu for a CPU decode step:
    switched off, every step runs Part 1's SDPA, and the rollout is the same (tokens, log-probs, entropies)."""
    kw = dict(num_samples=2, max_new_tokens=12, temperature=temperature, eos_token_ids=[3])
    runs, calls, fast_path = [], [], engine.decode_attention_cpu

    def counted(*args):
        calls.append(1)
        return fast_path(*args)
    monkeypatch.setattr(engine, "decode_attention_cpu", counted)
    for fast in (True, False):
        monkeypatch.setattr(ro, "DECODE_ATTENTION_CPU", fast)
        calls.clear()
        runs.append(ro.generate(model, PROMPTS, generator=torch.Generator().manual_seed(4), **kw))
        assert bool(calls) == fast  # the switch decides what runs
    fast, plain = runs
    assert torch.equal(fast.completion_ids, plain.completion_ids)
    assert torch.equal(fast.completion_mask, plain.completion_mask)
    torch.testing.assert_close(fast.logprobs, plain.logprobs, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(fast.entropy, plain.entropy, atol=1e-5, rtol=1e-5)


def test_batched_greedy_equals_each_prompt_alone(model):
    batch = ro.generate(model, PROMPTS, max_new_tokens=10, temperature=0.0)
    for i, p in enumerate(PROMPTS):
        alone = ro.generate(model, [p], max_new_tokens=10, temperature=0.0)
        assert batch.completion_ids[i].tolist() == alone.completion_ids[0].tolist()
        torch.testing.assert_close(batch.logprobs[i], alone.logprobs[0], atol=1e-5, rtol=1e-5)
    assert batch.completion_ids.shape == (3, 10) and batch.completion_mask.sum() == 30


def test_seeded_sampling_is_reproducible(model):
    kw = dict(num_samples=4, max_new_tokens=12, temperature=1.0)
    a = ro.generate(model, PROMPTS, generator=torch.Generator().manual_seed(7), **kw)
    b = ro.generate(model, PROMPTS, generator=torch.Generator().manual_seed(7), **kw)
    c = ro.generate(model, PROMPTS, generator=torch.Generator().manual_seed(8), **kw)
    assert torch.equal(a.completion_ids, b.completion_ids) and torch.equal(a.logprobs, b.logprobs)
    assert not torch.equal(a.completion_ids, c.completion_ids)
    # Prompt-major rows: rows 4i..4i+3 belong to prompt i, and the G samples differ from each other.
    assert a.prompt_ids == [p for p in PROMPTS for _ in range(4)]
    assert len({tuple(r) for r in a.completion_ids[:4].tolist()}) > 1
    assert a.completion_ids.shape == (12, 12) and bool((a.logprobs <= 0).all()) and bool((a.entropy >= 0).all())


def test_per_row_eos_stops_and_masks(model):
    free = ro.generate(model, PROMPTS, max_new_tokens=12, temperature=0.0).completion_ids  # (3, 12), no EOS
    eos = [free[0, 3].item(), free[1, 6].item(), free[2, 8].item()]  # each row meets one by step 9 at the latest
    r = ro.generate(model, PROMPTS, max_new_tokens=12, temperature=0.0, eos_token_ids=eos)
    stops = [next(t + 1 for t, x in enumerate(row) if x in eos) for row in free.tolist()]  # EOS included
    assert len(set(stops)) == 3 and max(stops) < 12  # rows stop at different steps, all before the limit
    assert r.completion_ids.shape[1] == max(stops)  # the loop ends when the last row is done
    for b, stop in enumerate(stops):
        assert r.completion_mask[b].tolist() == [1.0] * stop + [0.0] * (max(stops) - stop)
        assert r.completion_ids[b, :stop].tolist() == free[b, :stop].tolist()
        assert (r.completion_ids[b, stop:] == eos[0]).all()  # pad = first EOS id when no tokenizer is given
        assert (r.logprobs[b, stop:] == 0).all() and (r.entropy[b, stop:] == 0).all()
        assert (r.logprobs[b, :stop] < 0).all()


def test_sequence_logprobs_equal_sampler_records(model):
    r = ro.generate(model, PROMPTS, num_samples=2, max_new_tokens=10, temperature=0.7,
                    eos_token_ids=[3], generator=torch.Generator().manual_seed(0))
    assert (r.completion_mask.sum(-1) < 10).any()  # some rows stopped early: masked tails are compared too
    lp, ent = ro.sequence_logprobs(model, r.prompt_ids, r.completion_ids, r.completion_mask, temperature=0.7)
    torch.testing.assert_close(lp, r.logprobs, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ent, r.entropy, atol=1e-5, rtol=1e-5)
    g = ro.generate(model, PROMPTS, max_new_tokens=6, temperature=0.0)  # greedy records raw log-softmax
    lp0, _ = ro.sequence_logprobs(model, g.prompt_ids, g.completion_ids, g.completion_mask, temperature=0.0)
    torch.testing.assert_close(lp0, g.logprobs, atol=1e-5, rtol=1e-5)
    # With gradients: the policy update backpropagates through this.
    model.zero_grad()
    lp, _ = ro.sequence_logprobs(model, r.prompt_ids, r.completion_ids, r.completion_mask, temperature=0.7)
    lp.sum().backward()
    grad = model.model.layers[0].self_attn.q_proj.weight.grad
    assert grad is not None and torch.isfinite(grad).all() and grad.abs().sum() > 0
    model.zero_grad()


def test_grad_checkpoint_same_logits_and_gradients():
    """CausalLM.grad_checkpoint reruns each layer's forward in backward: same numbers, a second forward."""
    model = random_model(seed=4)
    ids, mask = left_pad(PROMPTS)
    runs, calls = [], []
    hook = model.model.layers[1].register_forward_pre_hook(lambda m, i: calls.append(1))
    for checkpoint in (False, True):
        model.grad_checkpoint, calls[:] = checkpoint, []
        model.zero_grad()
        logits = model(ids, attention_mask=mask)  # (B, T, V)
        logits[mask].log_softmax(-1)[:, 5].sum().backward()
        runs.append((logits.detach(), [p.grad.clone() for p in model.parameters()], len(calls)))
    hook.remove()
    (l0, g0, n0), (l1, g1, n1) = runs
    assert (n0, n1) == (1, 2)  # checkpointed: layer 1 ran again during backward
    torch.testing.assert_close(l1, l0, atol=0, rtol=0)
    for a, b in zip(g1, g0):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
    assert sum(float(g.abs().sum()) for g in g0) > 0
    with torch.no_grad():  # no grad: plain layers, nothing to recompute
        calls[:] = []
        hook = model.model.layers[1].register_forward_pre_hook(lambda m, i: calls.append(1))
        model(ids, attention_mask=mask)
        hook.remove()
    assert len(calls) == 1

# ---------------------------------------------------------------------------------------------------
# No per-token host sync; the static-shape decode step under torch.compile

def test_no_host_sync_per_token(model, monkeypatch):
    """Reading a device value on the host (bool, item, int, ...) stalls a GPU's queue: the decode loop may
    do it once every DONE_CHECK_EVERY tokens, plus a few times at the end, never once per token."""
    for compiled in (False, True):
        ro.generate(model, PROMPTS, max_new_tokens=2, temperature=0.0, compiled=compiled)  # compile outside the count
        calls = []
        with monkeypatch.context() as mp:
            for name in ("__bool__", "item", "__int__", "__float__", "__index__", "tolist"):
                orig = getattr(torch.Tensor, name)
                mp.setattr(torch.Tensor, name, lambda self, *a, _f=orig, _n=name: (calls.append(_n), _f(self, *a))[1])
            r = ro.generate(model, PROMPTS, max_new_tokens=40, temperature=0.0, compiled=compiled)
        assert r.completion_ids.shape == (3, 40)
        assert 0 < len(calls) <= 40 // ro.DONE_CHECK_EVERY + 3, (compiled, calls)


def test_compiled_greedy_equals_eager_and_is_reused(model):
    from torch._dynamo.utils import counters
    free = ro.generate(model, PROMPTS, max_new_tokens=12, temperature=0.0).completion_ids  # (3, 12)
    eos = [free[0, 3].item(), free[1, 6].item(), free[2, 8].item()]  # rows stop at different steps
    for kw in (dict(), dict(eos_token_ids=eos)):
        e = ro.generate(model, PROMPTS, max_new_tokens=12, temperature=0.0, **kw)
        c = ro.generate(model, PROMPTS, max_new_tokens=12, temperature=0.0, compiled=True, **kw)
        assert torch.equal(c.completion_ids, e.completion_ids) and torch.equal(c.completion_mask, e.completion_mask)
        torch.testing.assert_close(c.logprobs, e.logprobs, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(c.entropy, e.entropy, atol=1e-5, rtol=1e-5)
    assert e.completion_ids.shape[1] == 9 and e.stats["decode_steps_run"] == 12  # trimmed after the last EOS
    # Another prompt length and batch content in the same (batch, length) bucket: no new graph.
    graphs = counters["stats"]["unique_graphs"]
    e = ro.generate(model, [[4, 4], [9], [1, 2, 3]], max_new_tokens=30, temperature=0.0)
    c = ro.generate(model, [[4, 4], [9], [1, 2, 3]], max_new_tokens=30, temperature=0.0, compiled=True)
    assert counters["stats"]["unique_graphs"] == graphs and c.stats["compile_s"] == 0.0
    assert torch.equal(c.completion_ids, e.completion_ids)
    torch.testing.assert_close(c.logprobs, e.logprobs, atol=1e-5, rtol=1e-5)


def test_compiled_sampling_draws_what_eager_draws(model):
    kw = dict(max_new_tokens=10, temperature=0.7, top_k=40, top_p=0.9, eos_token_ids=[3])
    e = ro.generate(model, PROMPTS, generator=torch.Generator().manual_seed(5), **kw)
    c = ro.generate(model, PROMPTS, generator=torch.Generator().manual_seed(5), compiled=True, **kw)
    assert torch.equal(c.completion_ids, e.completion_ids) and torch.equal(c.completion_mask, e.completion_mask)
    torch.testing.assert_close(c.logprobs, e.logprobs, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(c.entropy, e.entropy, atol=1e-5, rtol=1e-5)
    assert len({tuple(r) for r in c.completion_ids.tolist()}) == 3 and (c.logprobs <= 0).all()


# ---------------------------------------------------------------------------------------------------
# Sampling masks

def test_top_k_top_p_masks():
    probs = torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05])
    perm = torch.tensor([3, 0, 4, 1, 2])  # scramble the order so sorting has work to do
    logits = probs[perm].log()[None].repeat(2, 1)  # (2, 5)

    def kept(out):  # the probabilities that survive the filter, largest first
        return sorted(probs[perm][torch.isfinite(out[0])].tolist(), reverse=True)
    assert kept(ro.filter_logits(logits, top_k=2)) == pytest.approx([0.5, 0.2])
    assert kept(ro.filter_logits(logits, top_p=0.6)) == pytest.approx([0.5, 0.2])  # 0.5 < 0.6 <= 0.7
    assert kept(ro.filter_logits(logits, top_p=0.5)) == pytest.approx([0.5])  # 0.5 already reaches 0.5
    assert kept(ro.filter_logits(logits, top_p=0.8)) == pytest.approx([0.5, 0.2, 0.15])
    assert kept(ro.filter_logits(logits, top_p=1e-4)) == pytest.approx([0.5])  # the top token always stays
    # top-p acts on the top-k-renormalized distribution: [.5,.2,.15]/.85 -> .588, .824 >= 0.8 keeps two.
    assert kept(ro.filter_logits(logits, top_k=3, top_p=0.8)) == pytest.approx([0.5, 0.2])
    assert torch.equal(ro.filter_logits(logits), logits)
    # Sampling only draws kept tokens, and its log-prob is under the renormalized distribution.
    g = torch.Generator().manual_seed(0)
    big = probs.log()[None].repeat(2000, 1)  # (2000, 5)
    tok, lp, ent = ro.sample_next(big, 1.0, 0, 0.6, g)
    assert set(tok.tolist()) == {0, 1}
    torch.testing.assert_close(lp[tok == 0], torch.full_like(lp[tok == 0], math.log(0.5 / 0.7)))
    p = torch.tensor([0.5, 0.2]) / 0.7
    torch.testing.assert_close(ent[0], -(p * p.log()).sum())
    tok, lp, _ = ro.sample_next(big[:3], 0.0, 0, 1.0, None)  # greedy: argmax, raw log-softmax
    assert tok.tolist() == [0, 0, 0] and torch.allclose(lp, torch.tensor(0.5).log())

# ---------------------------------------------------------------------------------------------------
# Tokenizer, chat template, CLI

def test_chat_prompt_and_tokenizer():
    assert hf_files.chat_prompt("hi") == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert hf_files.chat_prompt("hi", system="Be brief.") == ("<|im_start|>system\nBe brief.<|im_end|>\n"
                                                       "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    _, tok = ro.load_model(DATA / "qwen2", device="cpu")
    ids = tok.encode(hf_files.chat_prompt("2+3?"))
    assert ids[0] == tok.tok.token_to_id("<|im_start|>") == 257 and ids.count(258) == 1  # specials are single ids
    assert tok.decode(ids) == "user\n2+3?\nassistant\n" and tok.decode(tok.encode("héllo")) == "héllo"
    assert tok.eos_token_ids == [258, 256] and tok.pad_token_id == 256
    m, _ = ro.load_model(DATA / "qwen2", device="cpu")
    r = ro.generate(m, [ids], max_new_tokens=4, temperature=0.0, tokenizer=tok)
    assert r.texts == [tok.decode(r.completion_ids[0].tolist())]


QWEN25_TEMPLATE = (  # the system-message part of Qwen2.5-Instruct's chat template, as its tokenizer_config.json holds it
    "{%- if tools %}\n    {{- '<|im_start|>system\\n' }}\n    {%- if messages[0]['role'] == 'system' %}\n"
    "        {{- messages[0]['content'] }}\n    {%- else %}\n        {{- 'You are Qwen, created by Alibaba Cloud. "
    "You are a helpful assistant.' }}\n    {%- endif %}\n{%- else %}\n    {%- if messages[0]['role'] == 'system' %}"
    "\n        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}\n    {%- else %}\n"
    "        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant."
    "<|im_end|>\\n' }}\n    {%- endif %}\n{%- endif %}")
SMOLLM2_TEMPLATE = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ "
                    "'<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
                    "<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
                    "'<|im_end|>' + '\n'}}{% endfor %}")


@pytest.mark.parametrize("template, want", [
    (QWEN25_TEMPLATE, "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."),
    (SMOLLM2_TEMPLATE, "You are a helpful AI assistant named SmolLM, trained by Hugging Face"),
    (None, None)])  # the bundled model's template writes no system block
def test_default_system_message_comes_from_the_chat_template(tmp_path, template, want):
    import shutil
    folder = tmp_path / "m"
    shutil.copytree(DATA / "qwen2", folder)
    if template is None:
        shutil.copy(ROOT / "assets" / "tiny-qwen" / "tokenizer_config.json", folder / "tokenizer_config.json")
    else:
        (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    tok = hf_files.load_tokenizer(folder)
    assert tok.default_system == want
    if want:
        assert hf_files.chat_prompt("hi", tok.default_system).startswith(f"<|im_start|>system\n{want}<|im_end|>\n")
    (folder / "tokenizer_config.json").write_text("[1, 2")
    with pytest.raises(ValueError, match="tokenizer_config.json is not valid JSON"):
        hf_files.load_tokenizer(folder)


def test_cli_runs_on_a_model_folder(monkeypatch, capsys):
    # In-process (runpy) rather than a subprocess: saves re-importing torch.
    monkeypatch.setattr(sys, "argv", ["qerl/rollout.py", "--model", str(DATA / "qwen3"), "--prompt", "hi",
                                      "--max-new-tokens", "5", "--num-samples", "2", "--device", "cpu"])
    with pytest.raises(SystemExit) as exit:
        runpy.run_path(str(ROOT / "qerl/rollout.py"), run_name="__main__")
    assert exit.value.code == 0
    out = capsys.readouterr().out
    n_prompt = len(hf_files.byte_tokenizer().encode(hf_files.chat_prompt("hi")))  # the same byte tokenizer as the folder's
    assert "--- sample 1 | tokens" in out and f"prefill | tokens {2 * n_prompt} |" in out and "decode | tokens" in out


def test_default_command_gets_answers_from_the_bundled_model(capsys):
    """`python qerl/rollout.py` with no flags: the bundled model answers its default prompt in the task's
    format (a prompt outside its training prints garbage)."""
    assert ro.main(["--device", "cpu"]) == 0
    texts = [t for t in capsys.readouterr().out.splitlines() if t.startswith("<think>")]
    assert len(texts) == 4 and all(t.endswith("</answer>") for t in texts)


# ---------------------------------------------------------------------------------------------------
# Bad input: one clear line each

def _copy(tmp_path, family="qwen2"):
    dst = tmp_path / family
    shutil.copytree(DATA / family, dst)
    return dst


def test_missing_config(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"has no config.json"):
        ro.load_model(tmp_path, device="cpu")


def test_unsupported_model_type(tmp_path):
    d = _copy(tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    cfg["model_type"] = "gpt2"
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"unsupported model_type 'gpt2'; supported: qwen2, llama, qwen3"):
        ro.load_model(d, device="cpu")


def test_missing_weight(tmp_path):
    d = _copy(tmp_path)
    t = load_file(d / "model.safetensors")
    del t["model.layers.1.mlp.down_proj.weight"]
    save_file(t, d / "model.safetensors")
    with pytest.raises(ValueError, match=r"checkpoint lacks 1 weight\(s\), first: model.layers.1.mlp.down_proj.weight"):
        ro.load_model(d, device="cpu")


def test_missing_tokenizer(tmp_path):
    d = _copy(tmp_path)
    os.remove(d / "tokenizer.json")
    with pytest.raises(FileNotFoundError, match=r"tokenizer.json not found"):
        ro.load_model(d, device="cpu")


def test_prompt_longer_than_context(model):
    with pytest.raises(ValueError, match=r"prompt 1 has 120 tokens; with max_new_tokens=16 that exceeds "
                                         r"the model's context of 128"):
        ro.generate(model, [[1, 2], [5] * 120], max_new_tokens=16)


def test_wrong_shape_weight(tmp_path):
    d = _copy(tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    cfg["intermediate_size"] = 96
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"has shape \(128, 64\), config.json implies \(96, 64\)"):
        ro.load_model(d, device="cpu")


# ---------------------------------------------------------------------------------------------------
# Quantized loading (stage 01)

def test_quant_on_load_equals_quantized_checkpoint(tmp_path):
    src = DATA / "qwen2"
    ref = load_file(src / "reference.safetensors")
    a, _ = ro.load_model(src, quant="nvfp4", device="cpu")
    q = importlib.import_module("qerl.quantize")
    assert isinstance(a.model.layers[0].self_attn.q_proj, q.NVFP4Linear) and isinstance(a.lm_head, torch.nn.Linear)
    out = tmp_path / "qwen2-nvfp4"
    run = subprocess.run([sys.executable, str(ROOT / "qerl/quantize.py"), "--model", str(src), "--out", str(out)],
                         capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert run.returncode == 0, run.stderr
    b, _ = ro.load_model(out, device="cpu")
    assert isinstance(b.model.layers[1].mlp.down_proj, q.NVFP4Linear)
    with torch.no_grad():
        la = a(ref["input_ids"], attention_mask=ref["attention_mask"])
        lb = b(ref["input_ids"], attention_mask=ref["attention_mask"])
    torch.testing.assert_close(la, lb, atol=0, rtol=0)  # same bytes, same maths
    real = ref["attention_mask"].bool()  # 4-bit weights move the logits, but not wildly
    err = (la[real] - ref["logits"][real]).abs().mean() / ref["logits"][real].abs().mean()
    assert 0 < err < 0.5
    nf4, _ = ro.load_model(src, quant="nf4", device="cpu")
    assert isinstance(nf4.model.layers[0].mlp.gate_proj, q.NF4Linear)
    with torch.no_grad():
        assert torch.isfinite(nf4(ref["input_ids"])).all()


# ---------------------------------------------------------------------------------------------------
# Log-probs in chunks: no (rows, T, vocab) tensor in the forward or the backward

def full_logits_reference(model, r, temperature):
    """What sequence_logprobs computed before it was chunked: one (B, T, V) log-softmax."""
    logp = (ro.completion_logits(model, r.prompt_ids, r.completion_ids) / temperature).log_softmax(-1)  # (B, T, V)
    lp = logp.gather(-1, r.completion_ids[..., None]).squeeze(-1)  # (B, T)
    return lp * r.completion_mask, ro.entropy_from_logp(logp) * r.completion_mask


@pytest.mark.parametrize("temperature", [0.7, 0.0])
@pytest.mark.parametrize("entropy,head_trained", [(True, True), (True, False), (False, False), (False, True)])
def test_chunked_token_logprobs_equal_the_plain_token_logprobs(temperature, entropy, head_trained):
    """engine.chunked_token_logprobs, what sequence_logprobs runs, equals 03's plain token_logprobs (full
    logits, log-softmax, gather, entropy): values, and gradients into h and a trained lm_head, with the entropy
    and without (a frozen head without it: the backward written by hand)."""
    g = torch.Generator().manual_seed(1)
    n, C, V = 23, 16, 50
    head = torch.nn.Linear(C, V, bias=False)
    with torch.no_grad():
        head.weight.copy_(torch.randn(V, C, generator=g))
    head.weight.requires_grad_(head_trained)
    h0, ids = torch.randn(n, C, generator=g), torch.randint(0, V, (n,), generator=g)
    w_lp, w_ent = torch.rand(n, generator=g), torch.rand(n, generator=g)  # unequal weights per token
    runs = []
    for chunked in (False, True):
        h = h0.clone().requires_grad_()
        head.weight.grad = None
        if chunked:  # 4 tokens per chunk: 23 tokens make five full chunks and a partial one
            lp, ent = engine.chunked_token_logprobs(ro.token_logprobs, head, h, ids, temperature, entropy,
                                                   chunk_bytes=4 * V * 4)
        else:
            lp, ent = ro.token_logprobs(head, h, ids, temperature, entropy)
        loss = (w_lp * lp).sum() + ((w_ent * ent).sum() if entropy else 0)
        loss.backward()
        runs.append((lp.detach(), ent.detach() if entropy else ent, h.grad,
                     head.weight.grad.clone() if head_trained else None))
    (lp_p, ent_p, gh_p, gw_p), (lp_c, ent_c, gh_c, gw_c) = runs
    torch.testing.assert_close(lp_c, lp_p, atol=1e-6, rtol=1e-5)
    assert (lp_c < 0).all()
    if entropy:
        torch.testing.assert_close(ent_c, ent_p, atol=1e-6, rtol=1e-5)
        assert (ent_c > 0).all()
    torch.testing.assert_close(gh_c, gh_p, atol=1e-6, rtol=1e-5)
    assert gh_p.abs().sum() > 0
    if head_trained:
        torch.testing.assert_close(gw_c, gw_p, atol=1e-6, rtol=1e-5)
        assert gw_p.abs().sum() > 0
    assert ent_c is None if not entropy else ent_c.shape == (n,)  # what token_logprobs returns
    lp0, ent0 = engine.chunked_token_logprobs(ro.token_logprobs, head, h0[:0], ids[:0], temperature)  # no token
    assert lp0.shape == ent0.shape == (0,)


def test_chunked_logprobs_equal_full_logits_values_and_gradients(model, monkeypatch):
    r = ro.generate(model, PROMPTS, num_samples=3, max_new_tokens=12, temperature=0.9,
                    eos_token_ids=[3, 7], generator=torch.Generator().manual_seed(2))
    assert (r.completion_mask.sum(-1) < 12).any()  # some rows end early: padded positions are skipped
    monkeypatch.setattr(engine, "LOGITS_CHUNK_BYTES", 4 * model.config.vocab_size * 5)  # 5 tokens per chunk
    grads = []
    for fn in (full_logits_reference, lambda m, r, t: ro.sequence_logprobs(m, r.prompt_ids, r.completion_ids,
                                                                         r.completion_mask, temperature=t)):
        model.zero_grad()
        lp, ent = fn(model, r, 0.9)
        (lp.sum() + 0.3 * ent.sum()).backward()
        grads.append([p.grad.clone() for p in model.parameters()])
        grads[-1] += [lp.detach(), ent.detach()]
    model.zero_grad()
    (*g_full, lp_full, ent_full), (*g_chunk, lp_chunk, ent_chunk) = grads
    torch.testing.assert_close(lp_chunk, lp_full, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent_chunk, ent_full, rtol=1e-5, atol=1e-5)
    assert (lp_chunk[r.completion_mask == 0] == 0).all() and (lp_chunk[r.completion_mask > 0] < 0).all()
    for a, b in zip(g_chunk, g_full):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert sum(float(g.abs().sum()) for g in g_chunk) > 0


@pytest.mark.parametrize("temperature", [0.9, 0.0])
@pytest.mark.parametrize("entropy,head_trained", [(True, True), (False, True), (False, False)])
def test_chunked_logprobs_switch_gives_the_plain_values_and_gradients(model, monkeypatch, temperature, entropy,
                                                                       head_trained):
    """CHUNKED_LOGPROBS, the one line that chooses engine.chunked_token_logprobs in sequence_logprobs: switched
    off, token_logprobs runs over all selected tokens at once; the log-probs, entropies and every gradient are
    the same (a frozen lm_head without the entropy: the chunk's backward written by hand)."""
    r = ro.generate(model, PROMPTS, num_samples=3, max_new_tokens=12, temperature=0.9,
                    eos_token_ids=[3, 7], generator=torch.Generator().manual_seed(2))
    monkeypatch.setattr(engine, "LOGITS_CHUNK_BYTES", 4 * model.config.vocab_size * 5)  # 5 tokens per chunk
    model.lm_head.weight.requires_grad_(head_trained)
    trained = [p for p in model.parameters() if p.requires_grad]
    runs = []
    try:
        for chunked in (True, False):
            monkeypatch.setattr(ro, "CHUNKED_LOGPROBS", chunked)
            model.zero_grad()
            lp, ent = ro.sequence_logprobs(model, r.prompt_ids, r.completion_ids, r.completion_mask,
                                           temperature=temperature, entropy=entropy)
            assert (ent is None) == (not entropy)
            loss = (lp * torch.linspace(0.5, 2.0, lp.shape[1])).sum() + (0.3 * ent.sum() if entropy else 0)
            loss.backward()
            runs.append([lp.detach()] + ([ent.detach()] if entropy else []) + [p.grad.clone() for p in trained])
    finally:
        model.lm_head.weight.requires_grad_(True)
        model.zero_grad()
    for a, b in zip(*runs):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert (runs[0][0][r.completion_mask == 0] == 0).all() and sum(float(g.abs().sum()) for g in runs[0][1:]) > 0
    # no completion token at all: zeros, and still a graph to backpropagate through
    for chunked in (True, False):
        monkeypatch.setattr(ro, "CHUNKED_LOGPROBS", chunked)
        lp, _ = ro.sequence_logprobs(model, r.prompt_ids, r.completion_ids, r.completion_mask * 0)
        assert (lp == 0).all() and lp.requires_grad
        lp.sum().backward()
    model.zero_grad()


def test_chunked_logprobs_never_hold_a_vocabulary_sized_tensor(model, monkeypatch):
    """Structural check of the memory claim: the forward saves nothing vocabulary-sized for backward,
    and lm_head only ever sees one chunk, once in the forward and once again (recomputed) in backward."""
    V, chunk = model.config.vocab_size, 4
    monkeypatch.setattr(engine, "LOGITS_CHUNK_BYTES", 4 * V * chunk)
    r = ro.generate(model, PROMPTS, num_samples=2, max_new_tokens=9, temperature=1.0,
                    generator=torch.Generator().manual_seed(3))
    n_tok = int(r.completion_mask.sum())
    assert n_tok > 4 * chunk
    rows_seen, saved = [], []
    hook = model.lm_head.register_forward_hook(lambda m, i, out: rows_seen.append(out.shape))

    def pack(t):
        saved.append(t.numel() if t.shape and t.shape[-1] == V else 0)
        return t

    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            lp, ent = ro.sequence_logprobs(model, r.prompt_ids, r.completion_ids, r.completion_mask)
        n_forward = len(rows_seen)
        (lp.sum() + ent.sum()).backward()
    finally:
        hook.remove()
        model.zero_grad()
    assert max(saved) == 0  # no logits-shaped tensor is kept for backward
    assert n_forward == -(-n_tok // chunk) and len(rows_seen) == 2 * n_forward  # recomputed chunk by chunk
    assert all(s[0] <= chunk and s[-1] == V for s in rows_seen)
    # the sampler's own records still match (temperature 1, no top-k/top-p)
    torch.testing.assert_close(lp.detach(), r.logprobs, rtol=1e-5, atol=1e-5)


def test_truncated_or_corrupt_safetensors_is_one_line(tmp_path):
    d = _copy(tmp_path)
    data = (d / "model.safetensors").read_bytes()
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + n])
    last = max((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][1])
    (d / "model.safetensors").write_bytes(data[:-100])  # an interrupted download: the last tensor is cut
    with pytest.raises(ValueError, match=rf"model.safetensors: tensor {last} needs bytes \d+\.\.{len(data)} but the "
                                         rf"file has {len(data) - 100}; the file is truncated or corrupt"):
        ro.load_model(d, device="cpu")
    (d / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not json at all!" + data[100:])
    with pytest.raises(ValueError, match=r"model.safetensors is not a readable safetensors file"):
        ro.load_model(d, device="cpu")


def test_truncated_shard_and_wrong_shape_name_the_file(tmp_path):
    d = _copy(tmp_path)
    t = load_file(d / "model.safetensors")
    names = sorted(t)
    save_file({k: t[k] for k in names[:5]}, d / "model-00001-of-00002.safetensors")
    save_file({k: t[k] for k in names[5:]}, d / "model-00002-of-00002.safetensors")
    os.remove(d / "model.safetensors")
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        k: f"model-0000{1 + (i >= 5)}-of-00002.safetensors" for i, k in enumerate(names)}}))
    good = (d / "model-00002-of-00002.safetensors").read_bytes()
    (d / "model-00002-of-00002.safetensors").write_bytes(good[:len(good) // 2])
    with pytest.raises(ValueError, match=r"model-00002-of-00002.safetensors: tensor \S+ needs bytes \d+\.\.\d+ but "
                                         r"the file has \d+; the file is truncated or corrupt"):
        ro.load_model(d, device="cpu")
    (d / "model-00002-of-00002.safetensors").write_bytes(good)
    cfg = json.loads((d / "config.json").read_text())
    cfg["intermediate_size"] = 96
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"model-0000\d-of-00002.safetensors: weight model.layers.0.mlp.\w+_proj.weight "
                                         r"has shape \(\d+, \d+\), config.json implies"):
        ro.load_model(d, device="cpu")


def test_logprob_only_backward_by_hand_equals_autograd(model, monkeypatch):
    """With the entropy not asked for and lm_head frozen (LoRA training), the chunk's backward is written by
    hand, (onehot - softmax) / T @ W; its gradients must be autograd's through one full log-softmax."""
    r = ro.generate(model, PROMPTS, num_samples=3, max_new_tokens=12, temperature=0.9,
                    eos_token_ids=[3, 7], generator=torch.Generator().manual_seed(2))
    monkeypatch.setattr(engine, "LOGITS_CHUNK_BYTES", 4 * model.config.vocab_size * 5)  # 5 tokens per chunk
    model.lm_head.weight.requires_grad_(False)
    trained = [p for p in model.parameters() if p.requires_grad]
    try:
        grads = []
        for temperature in (0.9, 0.0):
            for full in (True, False):
                model.zero_grad()
                if full:
                    lp, _ = full_logits_reference(model, r, temperature or 1.0)
                else:
                    lp, ent = ro.sequence_logprobs(model, r.prompt_ids, r.completion_ids, r.completion_mask,
                                                   temperature=temperature, entropy=False)
                    assert ent is None
                (lp * torch.linspace(0.5, 2.0, lp.shape[1])).sum().backward()  # unequal weights per token
                grads.append([p.grad.clone() for p in trained] + [lp.detach()])
        for full, chunk in ((grads[0], grads[1]), (grads[2], grads[3])):
            for a, b in zip(chunk, full):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
        assert sum(float(g.abs().sum()) for g in grads[1][:-1]) > 0
    finally:
        model.lm_head.weight.requires_grad_(True)
        model.zero_grad()


def test_sample_from_draws_each_token_at_its_probability_and_never_a_zero_one():
    p = torch.tensor([[0.5, 0.0, 0.2, 0.3, 0.0], [0.0, 0.0, 0.0, 0.0, 1.0]])  # (2, 5)
    gen = torch.Generator().manual_seed(0)
    draws = torch.stack([ro.sample_from(p, gen) for _ in range(20_000)])  # (20000, 2)
    freq = torch.stack([(draws[:, 0] == i).float().mean() for i in range(5)])
    torch.testing.assert_close(freq, p[0], atol=0.015, rtol=0)  # 20,000 draws: std of a share <= 0.0036
    assert (draws[:, 1] == 4).all()
    # a row whose mass sits on the last token still never returns past it, even for u at the top of [0, 1)
    edge = torch.zeros(3, 49_152)
    edge[:, -1] = 1.0
    assert (ro.sample_from(edge, torch.Generator().manual_seed(1)) == 49_151).all()
    # the same seed gives the same tokens: a resumed run samples what an uninterrupted one would
    a = ro.sample_from(p.repeat(50, 1), torch.Generator().manual_seed(5))
    assert torch.equal(a, ro.sample_from(p.repeat(50, 1), torch.Generator().manual_seed(5)))



def test_cli_refuses_a_prompt_past_the_context_or_not_utf8_in_one_line():
    """A 100k-character prompt is refused for the context (128 tokens), not as a memory request of hundreds of
    GiB; bytes that are not UTF-8 (as a shell passes them) are one line, not a TypeError in the tokenizer."""
    for argv, want in [(["--prompt", "1+" * 50_000], r"--prompt is \d+ tokens in the chat template; with "
                        r"--max-new-tokens 64 that exceeds the model's context of 128"),
                       (["--prompt", "ok \udcff"], r"--prompt is not valid UTF-8"),
                       (["--system", "\udcfe"], r"--system is not valid UTF-8")]:
        with pytest.raises(ValueError, match=want):
            ro.main(["--device", "cpu", *argv])
