"""
Make assets/tiny-qwen: the small Qwen2-architecture model that `python qerl/train.py` trains with RL.

QeRL's experiments start from an instruction-tuned model that already solves some problems: RL can only
sharpen what the policy sometimes gets right. On a 2-core CPU we cannot run Qwen2.5, so this script makes
a stand-in in the same Hugging Face folder layout (config.json with model_type "qwen2",
model.safetensors, tokenizer.json, tokenizer_config.json, generation_config.json), small enough
(~0.8M parameters, ~3 MB) to ship in the repository:

  1. A tokenizer trained with the `tokenizers` library: byte-level BPE whose merges only join letters
     (digits and symbols stay one token each, as in Qwen2), the ChatML special tokens <|endoftext|>,
     <|im_start|>, <|im_end|>, and the tags <think> </think> <answer> </answer> as single tokens.
  2. A Qwen2 decoder from stage 03 (CausalLM): d_model 128, 4 layers, 4 query / 2 KV heads of 32,
     SwiGLU 384, q/k/v biases (as every Qwen2), tied embeddings, RoPE theta 1e4.
  3. Plain supervised next-token training on worked solutions of stage 05's task (loss on the
     completion tokens only), prompt = the bare problem in a ChatML user turn. So the model learns the
     <think>/<answer> format in pretraining and needs no system instruction.
  4. Training is stopped early on purpose: every 25 steps the greedy accuracy on 200 held-out
     problems is measured, and training stops at the first checkpoint at or above --target (0.25).
     RL needs room: greedy ~25% while pass@8 at temperature 1 is far higher (the policy *can* solve
     about half the problems, just not reliably). `python qerl/train.py` took this one from 23.0% to
     49.2% greedy (NVFP4, 500 held-out problems) in 750 steps and 464 s; a 33% checkpoint gained
     only 15 points in the same time, because the RL runs end near the same accuracy.

Run it (about 6 minutes on one CPU core; with the default --threads 1 it rebuilds the shipped model bit
for bit):
    python assets/make_tiny_model.py
    python assets/make_tiny_model.py --target 0.25 --out /tmp/tiny-qwen
"""
import argparse
import copy
import importlib
import json
import os
import random
import shutil
import sys
import time

import torch
import torch.nn.functional as F
from safetensors.torch import save_file

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
rollout = importlib.import_module("qerl.rollout")
grpo = importlib.import_module("qerl.train")  # the evaluation
tasks = importlib.import_module("qerl.tasks")  # the task: problems, prompts, reward
hf_files = importlib.import_module("qerl.hf_files")  # the tokenizer wrapper
TASK = tasks.ArithmeticTask(eval_size=0)  # its prompt (bare, no system message) and its `correct`

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TAGS = ["<think>", "</think>", "<answer>", "</answer>"]
CHAT_TEMPLATE = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + "
                 "'<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
                 "{% endif %}")
PRETRAIN_SEED = 7  # the training stream; stage 05's held-out stream (seed 1234) is excluded from it

# -----------------------------------------------------------------------------
# Tokenizer


def build_tokenizer(digits, nops):
    """Byte-level BPE trained on the task's text; returns a tokenizers.Tokenizer."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    # Runs of letters may merge (so "assistant" is one token); every other character is its own
    # pre-token, so digits are never merged: the model sees numbers digit by digit.
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(r"[A-Za-z]+|[^A-Za-z]"), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    # The corpus: the chat roles and the task's text, without the special tokens and tags (added below
    # as whole tokens, so BPE must not spend merges on their pieces).
    rng = random.Random(0)
    corpus = []
    for _ in range(200):
        p = tasks.make_problem(rng, digits, nops)
        text = TASK.prompt(p) + p["solution"]
        for t in SPECIALS + TAGS:
            text = text.replace(t, "\n")
        corpus.append(text)
    corpus += ["system\nYou are a helpful assistant.\n"] * 20
    trainer = trainers.BpeTrainer(vocab_size=320, min_frequency=20, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus, trainer)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIALS])
    # not special: the tags must survive decode(skip_special_tokens=True), the reward reads them
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in TAGS])
    return tok


def write_folder(out, tok, cfg, state):
    """The HF folder layout, written to a temp folder and renamed."""
    tmp = out.rstrip("/") + f".tmp{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    tok.save(os.path.join(tmp, "tokenizer.json"))
    ids = {t: tok.token_to_id(t) for t in SPECIALS}
    config = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_act": "silu",
              "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
              "intermediate_size": cfg.intermediate_size, "num_hidden_layers": cfg.num_hidden_layers,
              "num_attention_heads": cfg.num_attention_heads, "num_key_value_heads": cfg.num_key_value_heads,
              "head_dim": cfg.head_dim, "max_position_embeddings": cfg.max_position_embeddings,
              "rms_norm_eps": cfg.rms_norm_eps, "rope_theta": cfg.rope_theta, "tie_word_embeddings": True,
              "use_sliding_window": False, "max_window_layers": cfg.num_hidden_layers, "attention_dropout": 0.0,
              "initializer_range": 0.02, "use_cache": True, "torch_dtype": "float32",
              "bos_token_id": None, "eos_token_id": ids["<|im_end|>"], "pad_token_id": ids["<|endoftext|>"],
              # read by stage 05: prompt with the bare problem, no system instruction (see the docstring)
              "qerl_prompt": "bare"}
    gen = {"eos_token_id": [ids["<|im_end|>"], ids["<|endoftext|>"]], "pad_token_id": ids["<|endoftext|>"],
           "bos_token_id": None, "do_sample": True, "temperature": 1.0, "max_new_tokens": 42}
    tok_cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
               "bos_token": None, "unk_token": None, "model_max_length": cfg.max_position_embeddings,
               "clean_up_tokenization_spaces": False, "chat_template": CHAT_TEMPLATE,
               "additional_special_tokens": ["<|im_start|>", "<|im_end|>"]}
    for name, obj in (("config.json", config), ("generation_config.json", gen), ("tokenizer_config.json", tok_cfg)):
        with open(os.path.join(tmp, name), "w") as f:
            json.dump(obj, f, indent=2)
            f.write("\n")
    # tied: like HF, store the embedding once and no lm_head.weight
    tensors = {k: v.detach().float().contiguous() for k, v in state.items() if k != "lm_head.weight"}
    save_file(tensors, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
    for name in os.listdir(tmp):
        os.chmod(os.path.join(tmp, name), 0o644)
    if os.path.exists(out):
        shutil.rmtree(out)
    os.replace(tmp, out)

# -----------------------------------------------------------------------------
# Model and supervised training


def init_weights(model, generator):
    """GPT-2 style: N(0, 0.02) weights, zero biases, residual outputs scaled by 1/sqrt(2 * layers)."""
    n_layers = model.config.num_hidden_layers
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith(".bias"):
                p.zero_()
            else:
                std = 0.02 / (2 * n_layers) ** 0.5 if name.endswith(("o_proj.weight", "down_proj.weight")) else 0.02
                p.copy_(torch.randn(p.shape, generator=generator) * std)


def make_batch(problems, tok, im_end):
    """Right-padded (prompt + completion + <|im_end|>) ids and labels; labels are -100 on the prompt
    and the padding, so the loss covers only what the model will have to generate."""
    rows = []
    for p in problems:
        prompt = tok.encode(TASK.prompt(p))
        completion = tok.encode(p["solution"]) + [im_end]
        rows.append((prompt + completion, [-100] * len(prompt) + completion))
    T = max(len(ids) for ids, _ in rows)
    ids = torch.full((len(rows), T), im_end, dtype=torch.long)  # (B, T)
    labels = torch.full((len(rows), T), -100, dtype=torch.long)  # (B, T)
    for i, (x, y) in enumerate(rows):
        ids[i, :len(x)] = torch.tensor(x)
        labels[i, :len(y)] = torch.tensor(y)
    return ids, labels


def main(args):
    # One thread: the float summation order is then fixed, and the same command rebuilds the shipped
    # model bit for bit (with more threads tiny rounding differences grow through training).
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    tok_raw = build_tokenizer(args.digits, args.nops)
    im_end = tok_raw.token_to_id("<|im_end|>")
    tok = hf_files.Tokenizer(tok_raw, [im_end, tok_raw.token_to_id("<|endoftext|>")],
                            tok_raw.token_to_id("<|endoftext|>"))
    cfg = rollout.ModelConfig(model_type="qwen2", vocab_size=tok_raw.get_vocab_size(), hidden_size=128,
                              intermediate_size=384, num_hidden_layers=4, num_attention_heads=4,
                              num_key_value_heads=2, head_dim=32, rms_norm_eps=1e-6, rope_theta=1e4,
                              max_position_embeddings=128, tie_word_embeddings=True, attention_bias=True)
    model = rollout.CausalLM(cfg)
    init_weights(model, torch.Generator().manual_seed(args.seed))
    n_params = sum(p.numel() for p in model.parameters())
    print(f"tokenizer | vocab {cfg.vocab_size} | model | params {n_params:,}")

    eval_pool = tasks.arithmetic_problems(tasks.EVAL_POOL, tasks.EVAL_SEED, args.digits, args.nops)
    exclude = {p["question"] for p in eval_pool}
    select_set, final_set = eval_pool[:args.select_size], eval_pool[:args.eval_size]
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / args.warmup))
    rng = random.Random(PRETRAIN_SEED + args.seed)
    t0, chosen, history = time.time(), None, []
    for step in range(1, args.max_steps + 1):
        problems = []
        while len(problems) < args.batch:
            p = tasks.make_problem(rng, args.digits, args.nops)
            if p["question"] not in exclude:
                problems.append(p)
        ids, labels = make_batch(problems, tok, im_end)  # (B, T) each
        model.train()
        logits = model(ids)  # (B, T, V); right padding needs no attention mask
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, cfg.vocab_size), labels[:, 1:].reshape(-1),
                               ignore_index=-100)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if step % args.eval_every == 0:
            model.eval()
            acc = grpo.evaluate(model, tok, TASK, select_set, args.max_new_tokens)["greedy"]
            history.append({"step": step, "seconds": round(time.time() - t0, 1), "loss": loss.item(), "greedy": acc})
            print(f"step {step} | loss {loss.item():.4f} | greedy {acc:.3f} (n {len(select_set)}) | "
                  f"{time.time() - t0:.0f}s", flush=True)
            if acc >= args.target:
                chosen = step
                break
    if chosen is None:
        print(f"note | greedy never reached {args.target} in {args.max_steps} steps; keeping the last model")
        chosen = step
    model.eval()
    res = grpo.evaluate_pass_k(model, tok, TASK, final_set, args.max_new_tokens, k=8, temperature=1.0, seed=tasks.EVAL_SEED)
    # what `python qerl/train.py` starts from: the same weights with every decoder linear in NVFP4
    q = copy.deepcopy(model)
    importlib.import_module("qerl.quantize").quantize_model(q, fmt="nvfp4")
    res_q = grpo.evaluate_pass_k(q, tok, TASK, final_set, args.max_new_tokens, k=8, temperature=1.0, seed=tasks.EVAL_SEED)
    info = {"train_steps": chosen, "train_seconds": round(time.time() - t0, 1), "params": n_params,
            "eval_n": res["n"], "fp32": res, "nvfp4": res_q, "seed": args.seed, "threads": torch.get_num_threads()}
    write_folder(args.out, tok_raw, cfg, model.state_dict())
    size = sum(os.path.getsize(os.path.join(args.out, f)) for f in os.listdir(args.out))
    print(f"saved {args.out} | {size / 1e6:.2f} MB | params {n_params:,} | step {chosen} | "
          f"{info['train_seconds']:.0f}s | held-out n {res['n']}")
    for name, r in (("fp32", res), ("nvfp4", res_q)):
        print(f"{name:>6} | greedy {r['greedy']:.3f} | pass@1 T=1 {r['pass@1']:.3f} | pass@8 T=1 {r['pass@8']:.3f}")
    return info


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description="Pretrain the bundled tiny Qwen2 model on stage 05's arithmetic task")
    ap.add_argument("--out", default=os.path.join(ROOT, "assets", "tiny-qwen"))
    ap.add_argument("--target", type=float, default=0.25, help="stop at the first checkpoint with this greedy accuracy")
    ap.add_argument("--digits", type=int, default=3)
    ap.add_argument("--nops", type=int, default=2)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--max-steps", type=int, default=4000)
    ap.add_argument("--eval-every", type=int, default=25, help="measure greedy accuracy every N steps")
    ap.add_argument("--select-size", type=int, default=200, help="held-out problems used to pick the checkpoint")
    ap.add_argument("--eval-size", type=int, default=500, help="held-out problems for the reported numbers")
    ap.add_argument("--max-new-tokens", type=int, default=42)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1, help="torch threads; 1 makes the result bit-reproducible")
    main(ap.parse_args())
