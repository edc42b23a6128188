"""Make the golden data for tests/test_rollout.py: one tiny random model per family, saved as a Hugging
Face folder, plus the logits and greedy tokens Hugging Face transformers computes for it.

Run ONCE, from the repository root, with a Python that has `transformers` (a reference-only tool; the
project never imports it and CI does not have it):
    /tmp/refenv/bin/python tests/make_reference_logits.py
It writes tests/data/{qwen2,llama,qwen3}/ with config.json, model.safetensors (bf16, like real
checkpoints), tokenizer.json (byte-level + ChatML specials), generation_config.json (not for llama:
its EOS comes from config.json) and reference.safetensors:
    input_ids, attention_mask, position_ids  (3, L)  a left-padded batch
    logits                                   (3, L, V) fp32, HF eager attention, fp32 compute
    greedy_prompt_<i>                        (L_i,)  each prompt alone
    greedy_<i>                               (8,)    HF generate(do_sample=False, max_new_tokens=8),
                                                     -1 after an early EOS
"""
import importlib
import json
import os
import shutil
import sys
import tempfile

import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
hf_files = importlib.import_module("qerl.hf_files")  # byte_tokenizer and chat_prompt

V = 272  # >= the 259 ids of the byte tokenizer, like real models whose embedding is padded past the tokenizer
COMMON = dict(vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-6)


def family_configs(im_end, eot):
    return {
        # Qwen2: q/k/v biases, tied embeddings, plain RoPE.
        "qwen2": Qwen2Config(**COMMON, tie_word_embeddings=True, rope_theta=10000.0, use_sliding_window=False,
                             eos_token_id=eot, pad_token_id=eot),
        # Llama: no biases, untied lm_head, llama3 RoPE scaling chosen so all three frequency bands occur
        # for head_dim 16 (wavelengths 6, 32, 168, ... against the 16 / 64 thresholds).
        "llama": LlamaConfig(**COMMON, tie_word_embeddings=False, rope_theta=500000.0,
                             rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                           "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
                             bos_token_id=None, eos_token_id=im_end, pad_token_id=None),
        # Qwen3: q_norm/k_norm and an explicit head_dim (24) != hidden/heads (16).
        "qwen3": Qwen3Config(**COMMON, head_dim=24, tie_word_embeddings=True, rope_theta=1000000.0,
                             eos_token_id=eot, pad_token_id=eot),
    }


def randomize(model, seed):
    """HF's default init (std 0.02) gives near-uniform logits, where greedy ties would make the token test
    fragile. Use O(1) activations instead: fan-in scaled matrices, norms near 1, visible biases."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            r = torch.randn(p.shape, generator=g)
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.1 * r)
            elif name.endswith("bias"):
                p.copy_(0.1 * r)
            elif "embed_tokens" in name or "lm_head" in name:
                p.copy_(0.3 * r)
            else:
                p.copy_(r / p.shape[1] ** 0.5)


def classic_rope_fields(path):
    """transformers 5 writes `rope_parameters`; released Qwen2.5 / Llama-3 checkpoints use rope_theta +
    rope_scaling. Rewrite to the released layout so the loader is tested on what it will meet."""
    cfg = json.load(open(path))
    rope = cfg.pop("rope_parameters")
    cfg["rope_theta"] = rope.pop("rope_theta")
    cfg["rope_scaling"] = rope if rope.get("rope_type", "default") != "default" else None
    json.dump(cfg, open(path, "w"), indent=2)


def main():
    tok = hf_files.byte_tokenizer()
    im_end, eot = tok.tok.token_to_id("<|im_end|>"), tok.tok.token_to_id("<|endoftext|>")
    texts = [hf_files.chat_prompt("2+3?"), "hello world", "<|im_start|>user\nhi<|im_end|>\n"]
    prompts = [tok.encode(t) for t in texts]
    L = max(map(len, prompts))
    for seed, (family, hf_cfg) in enumerate(family_configs(im_end, eot).items()):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(hf_cfg, attn_implementation="eager")
        randomize(model, seed)
        out = os.path.join(ROOT, "tests", "data", family)
        tmp = tempfile.mkdtemp(dir=os.path.dirname(out), prefix=f".{family}-")
        model.to(torch.bfloat16).save_pretrained(tmp)
        os.remove(os.path.join(tmp, "generation_config.json"))
        if family != "qwen3":
            classic_rope_fields(os.path.join(tmp, "config.json"))
        tok.tok.save(os.path.join(tmp, "tokenizer.json"))
        gen_file = os.path.join(tmp, "generation_config.json")
        if family == "qwen2":  # Qwen2.5-Instruct's layout: an EOS list in generation_config.json
            json.dump({"eos_token_id": [im_end, eot], "pad_token_id": eot}, open(gen_file, "w"))
        elif family == "qwen3":  # a single int
            json.dump({"eos_token_id": im_end, "pad_token_id": eot}, open(gen_file, "w"))

        # Reference numbers come from the SAVED folder, reloaded in fp32: HF reads it the way we must.
        ref = AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32, attn_implementation="eager").eval()
        if family == "llama":  # HF must have read the classic rope_scaling field, or the reference is moot
            assert ref.config.rope_parameters["rope_type"] == "llama3", ref.config.rope_parameters
        eos = [im_end, eot] if family == "qwen2" else im_end
        ids = torch.full((len(prompts), L), eot, dtype=torch.long)
        mask = torch.zeros(len(prompts), L, dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, L - len(p):] = torch.tensor(p)
            mask[i, L - len(p):] = 1
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        tensors = {"input_ids": ids, "attention_mask": mask, "position_ids": pos}
        with torch.no_grad():
            tensors["logits"] = ref(input_ids=ids, attention_mask=mask, position_ids=pos).logits.float()
            gaps = []
            for i, p in enumerate(prompts):
                x = torch.tensor([p])
                g = ref.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=8,
                                 eos_token_id=eos, pad_token_id=eot, output_scores=True, return_dict_in_generate=True)
                new = g.sequences[0, len(p):]
                tensors[f"greedy_prompt_{i}"] = torch.tensor(p)
                tensors[f"greedy_{i}"] = torch.cat([new, torch.full((8 - len(new),), -1)])
                for s in g.scores:  # how far the chosen token is ahead of the runner-up
                    top2 = s[0].float().topk(2).values
                    gaps.append(float(top2[0] - top2[1]))
        save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(tmp, "reference.safetensors"))
        shutil.rmtree(out, ignore_errors=True)
        os.rename(tmp, out)
        os.chmod(out, 0o755)  # mkdtemp makes 0700
        for f in os.listdir(out):
            os.chmod(os.path.join(out, f), 0o644)
        size = sum(os.path.getsize(os.path.join(out, f)) for f in os.listdir(out))
        greedy = [tensors[f"greedy_{i}"].tolist() for i in range(3)]
        print(f"{family} | files {sorted(os.listdir(out))} | bytes {size} | greedy {greedy} "
              f"| min top-2 logit gap {min(gaps):.4f}")


if __name__ == "__main__":
    main()
