"""Stage 03 (03_rollout.py) against the trainer's qerl/rollout.py on its plain path (no CPU decode
attention, no chunked log-probs): bitwise equal logits, generate() outputs, sequence log-probs and
their gradients, on the bundled tiny-qwen and the small models in tests/data; the committed Hugging
Face reference logits and greedy tokens; the loader (shards, ids, refusals) and the demo."""

import importlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from qerl import hf_files

ro = importlib.import_module("qerl.rollout")
st = importlib.import_module("03_rollout")
ROOT = Path(__file__).resolve().parent.parent
DATA = Path(__file__).resolve().parent / "data"
TINY = ROOT / "assets" / "tiny-qwen"
FIELDS = ("completion_ids", "completion_mask", "logprobs", "entropy")
QUESTIONS = ["12+7-3=?", "5-3+1=?", "999-1+2=?"]


# the trainer's --plain path (what 03 must equal bit for bit), on one thread (tests/conftest.py)
pytestmark = pytest.mark.usefixtures("trainer_plain_path", "one_thread")


@pytest.fixture(scope="module")
def llama_plain(tmp_path_factory):
    """tests/data/llama without its Llama 3 rope_scaling (which 03 refuses): a plain Llama."""
    out = tmp_path_factory.mktemp("llama")
    for f in (DATA / "llama").iterdir():
        shutil.copy(f, out / f.name)
    cfg = json.loads((out / "config.json").read_text())
    cfg["rope_scaling"] = None
    (out / "config.json").write_text(json.dumps(cfg))
    return out


def smollm2_folder():
    cached = Path.home() / ".cache" / "qerl" / "smollm2-135m-instruct"
    for folder in (ROOT / "assets" / "smollm2-135m-instruct", cached):
        if (folder / "model.safetensors").exists():
            return folder
    return None


def both(folder, quant="none", dtype=torch.float32):
    """(qerl's model, tokenizer), (03's model, tokenizer) of one folder."""
    return ro.load_model(folder, quant, dtype, "cpu"), st.load_model(folder, quant, dtype, "cpu")


def prompts_of(tok):
    return [tok.encode(st.chat_prompt(q)) for q in QUESTIONS]


def generate_both(a, tok_a, b, tok_b, temperature, seed):
    """qerl's and 03's generate, 4 samples of each prompt, each from a generator of `seed`."""
    prompts, runs = prompts_of(tok_a), ((ro, a, tok_a), (st, b, tok_b))
    gens = [torch.Generator().manual_seed(seed) for _ in runs]
    return [
        m.generate(model, prompts, 4, 24, temperature, generator=g, tokenizer=tok)
        for (m, model, tok), g in zip(runs, gens)
    ]


def assert_same_rollout(ra, rb):
    for f in FIELDS:
        assert torch.equal(getattr(ra, f), getattr(rb, f)), f
    assert ra.prompt_ids == rb.prompt_ids and ra.texts == rb.texts


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", ["tiny-qwen", "qwen2", "llama"])
def test_logits_generate_and_logprobs_equal_qerl(name, dtype, llama_plain):
    folder = {"tiny-qwen": TINY, "qwen2": DATA / "qwen2", "llama": llama_plain}[name]
    (a, tok_a), (b, tok_b) = both(folder, dtype=dtype)
    ids = torch.randint(0, a.config.vocab_size, (3, 13), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(3, 13, dtype=torch.bool)
    mask[0, :4] = False  # a left-padded row
    with torch.no_grad():
        assert torch.equal(a(ids, attention_mask=mask), b(ids, attention_mask=mask))
    for temperature in (1.0, 0.7, 0.0):
        ra, rb = generate_both(a, tok_a, b, tok_b, temperature, seed=7)
        assert_same_rollout(ra, rb)
    args = (ra.prompt_ids, ra.completion_ids, ra.completion_mask, 0.7)
    (la, ea), (lb, eb) = ro.sequence_logprobs(a, *args), st.sequence_logprobs(b, *args)
    assert torch.equal(la, lb) and torch.equal(ea, eb) and la.requires_grad
    (la.sum() + ea.sum()).backward()
    (lb.sum() + eb.sum()).backward()
    grads_b = dict(b.named_parameters())
    for n, p in a.named_parameters():
        assert torch.equal(p.grad, grads_b[n].grad), n


def test_structure_of_each_family(llama_plain):
    q2, _ = st.load_model(DATA / "qwen2", quant="none")
    attn = q2.model.layers[0].self_attn
    assert q2.lm_head.weight is q2.model.embed_tokens.weight  # tied
    assert attn.q_proj.bias is not None and attn.o_proj.bias is None
    ll, tok = st.load_model(llama_plain, quant="none")
    assert ll.lm_head.weight is not ll.model.embed_tokens.weight
    assert ll.model.layers[0].self_attn.q_proj.bias is None and tok.eos_token_ids == [258]
    norm = ll.model.layers[1].post_attention_layernorm
    assert isinstance(norm, st.RMSNorm) and isinstance(norm.weight, torch.nn.Parameter)
    assert all(p.device.type == "cpu" for p in ll.parameters())  # nothing left on meta


def test_logits_match_hf_reference_and_greedy_tokens():
    model, tok = st.load_model(DATA / "qwen2", quant="none")
    ref = load_file(DATA / "qwen2" / "reference.safetensors")
    with torch.no_grad():
        logits = model(ref["input_ids"], ref["position_ids"], ref["attention_mask"])  # (B, L, V)
        derived = model(ref["input_ids"], attention_mask=ref["attention_mask"])
    real = ref["attention_mask"].bool()  # pad positions are garbage in both implementations
    torch.testing.assert_close(logits[real], ref["logits"][real], atol=1e-5, rtol=1e-5)
    assert torch.equal(derived[real], logits[real])  # positions derived from the mask: the same
    for i in range(3):
        hf = ref[f"greedy_{i}"][ref[f"greedy_{i}"] >= 0]
        r = st.generate(model, [ref[f"greedy_prompt_{i}"].tolist()], 1, 8, 0.0, tokenizer=tok)
        assert r.completion_ids[0][r.completion_mask[0] > 0].tolist() == hf.tolist()


@pytest.mark.skipif(smollm2_folder() is None, reason="the converted SmolLM2 folder is not here")
def test_smollm2_matches_reference_and_qerl():
    (a, _), (b, _) = both(smollm2_folder())
    ref = load_file(DATA / "smollm2" / "reference.safetensors")
    with torch.no_grad():
        logits = b(ref["ids_3"][None])[0]  # (T, V)
        assert torch.equal(logits, a(ref["ids_3"][None])[0])
    top = ref["top_ids_3"]
    torch.testing.assert_close(logits.gather(-1, top), ref["top_logits_3"], rtol=0, atol=1e-4)


def test_nvfp4_model_equals_qerl():
    (a, tok_a), (b, tok_b) = both(TINY, quant="nvfp4")
    assert type(b.model.layers[0].mlp.up_proj).__name__ == "NVFP4Linear"
    assert isinstance(b.lm_head, torch.nn.Linear)  # lm_head stays in full precision
    ra, rb = generate_both(a, tok_a, b, tok_b, 1.0, seed=3)
    assert_same_rollout(ra, rb)


def test_sampled_logprobs_agree_with_sequence_logprobs():
    model, tok = st.load_model(TINY, quant="none")
    gen = torch.Generator().manual_seed(0)
    r = st.generate(model, prompts_of(tok), 2, 32, 0.8, generator=gen, tokenizer=tok)
    lp, ent = st.sequence_logprobs(model, r.prompt_ids, r.completion_ids, r.completion_mask, 0.8)
    # the cache's prefill and decode steps against one full forward: the same up to rounding
    torch.testing.assert_close(lp.detach(), r.logprobs, atol=1e-4, rtol=0)
    torch.testing.assert_close(ent.detach(), r.entropy, atol=1e-4, rtol=0)
    assert (r.completion_mask[:, 0] == 1).all() and (lp[r.completion_mask == 0] == 0).all()
    ends = [int(m.sum()) - 1 for m in r.completion_mask]  # a row stops at its first EOS
    assert any(r.completion_ids[i, e] in tok.eos_token_ids for i, e in enumerate(ends))
    lp2, none = st.sequence_logprobs(
        model, r.prompt_ids, r.completion_ids, r.completion_mask, 0.8, entropy=False
    )
    assert none is None and torch.equal(lp2, lp)


def test_tokenizer_ids_and_chat_prompt_equal_qerl(tmp_path):
    for folder in (TINY, DATA / "qwen2", DATA / "llama"):
        config = json.loads((folder / "config.json").read_text())
        a, b = hf_files.load_tokenizer(folder, config), st.load_tokenizer(folder, config)
        assert (a.eos_token_ids, a.pad_token_id) == (b.eos_token_ids, b.pad_token_id)
        text = st.chat_prompt("What is 12 + 3.5?", system="Be brief.")
        assert text == hf_files.chat_prompt("What is 12 + 3.5?", system="Be brief.")
        ids = b.encode(text)
        assert ids == a.encode(text) and b.decode(ids) == a.decode(ids)
    assert st.load_tokenizer(TINY, {}).eos_token_ids == [283, 281]  # generation_config.json
    # With no ids in generation_config.json nor config.json: tokenizer_config.json's token strings.
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(TINY / f, tmp_path / f)
    tok = st.load_tokenizer(tmp_path, {})
    assert tok.eos_token_ids == [tok.tok.token_to_id("<|im_end|>")]
    assert tok.pad_token_id == tok.tok.token_to_id("<|endoftext|>")


def test_sharded_checkpoint_loads_the_same(tmp_path):
    src = DATA / "qwen2"
    for f in ("config.json", "tokenizer.json", "generation_config.json"):
        shutil.copy(src / f, tmp_path / f)
    with safe_open(src / "model.safetensors", "pt") as f:
        tensors = {n: f.get_tensor(n) for n in f.keys()}
    names, weight_map = sorted(tensors), {}
    for k, part in enumerate((names[: len(names) // 2], names[len(names) // 2 :])):
        save_file({n: tensors[n] for n in part}, tmp_path / f"model-{k}.safetensors")
        weight_map.update({n: f"model-{k}.safetensors" for n in part})
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    a, _ = st.load_model(src, quant="none")
    b, _ = st.load_model(tmp_path, quant="none")
    ids = load_file(src / "reference.safetensors")["input_ids"]
    with torch.no_grad():
        assert torch.equal(a(ids), b(ids))


def test_refusals_point_to_qerl():
    with pytest.raises(ValueError, match="rope_scaling.*qerl/rollout.py"):
        st.load_model(DATA / "llama", quant="none")
    with pytest.raises(ValueError, match="'qwen3'.*qerl/rollout.py"):
        st.load_model(DATA / "qwen3", quant="none")
    with pytest.raises(ValueError, match="quant must be"):
        st.load_model(TINY, quant="nf4")


def test_demo_prints_what_generate_samples():
    command = [sys.executable, str(ROOT / "03_rollout.py"), "--num-samples", "2"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # the thread count this process runs with
    run = subprocess.run(
        command + ["--max-new-tokens", "16"], capture_output=True, text=True, env=env
    )
    assert run.returncode == 0, run.stderr
    out = run.stdout
    model, tok = st.load_model(TINY, quant="none")
    prompt = tok.encode(st.chat_prompt("12+7-3=?"))
    gen = torch.Generator().manual_seed(0)
    r = st.generate(model, [prompt], 2, 16, 1.0, generator=gen, tokenizer=tok)
    for i, text in enumerate(r.texts):
        assert f"--- sample {i} | tokens {int(r.completion_mask[i].sum())} |" in out
        assert f"---\n{text}\n" in out
