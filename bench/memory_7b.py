"""Memory of a QeRL step on Qwen2.5-7B-Instruct, bf16 base against NVFP4 base, computed from the config.

Nothing is loaded: the byte counts follow from the widths (the weights exactly; the adapters, gradients and
AdamW state exactly for LoRA on every projection; activations and the KV cache from the trainer's own estimates,
qerl.memory.update_bytes_per_row and generate_memory). The paper's Table 3 (one H100, input 256 tokens, completion
up to 2048) gives the weights as 15.2 GB (bf16 LoRA) and 5.9 GB (QeRL): the first two rows check against it.

    python bench/memory_7b.py                 # rank 32 (the paper's main runs), 8 samples of 256 + 2048 tokens
    python bench/memory_7b.py --rank 16 --rows 16
"""

import argparse
import os
import sys
from types import SimpleNamespace

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
from qerl import memory  # noqa: E402

# Qwen2.5-7B-Instruct's config.json (the widths the estimates read)
QWEN25_7B = SimpleNamespace(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                            num_key_value_heads=4, head_dim=128, vocab_size=152064, tie_word_embeddings=False)
GB = 1e9


def table(cfg, rank, rows, prompt, completion):
    C, I, L, V = cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers, cfg.vocab_size
    q_out, kv_out = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    shapes = [(C, q_out), (C, kv_out), (C, kv_out), (q_out, C), (C, I), (C, I), (I, C)]  # (in, out) per projection
    linear = L * sum(i * o for i, o in shapes)  # the numbers NVFP4 stores in 4.5 bits
    biases = L * (q_out + 2 * kv_out)  # Qwen2's q/k/v biases, kept in bf16
    other = V * C * (1 if cfg.tie_word_embeddings else 2) + L * 2 * C + C  # embeddings, lm_head, RMSNorm gains
    adapters = L * sum(rank * (i + o) for i, o in shapes)  # A (r, in) and B (out, r) on every projection
    T = prompt + completion
    rows_out = [
        ("base weights", 2 * (linear + biases + other), (linear * 4.5 / 8) + 2 * (biases + other)),
        (f"LoRA r={rank} adapters (fp32)", 4 * adapters, 4 * adapters),
        ("their gradients (fp32)", 4 * adapters, 4 * adapters),
        ("AdamW's two moments (fp32)", 8 * adapters, 8 * adapters),
    ]
    act = memory.update_bytes_per_row(cfg, T, 2, False)
    ckpt = memory.update_bytes_per_row(cfg, T, 2, True)
    kv = memory.generate_memory(cfg, rows, prompt, completion, 2)
    return linear, adapters, rows_out, [
        (f"update activations, 1 row of {T} tokens (bf16)", act),
        ("  with --grad-checkpoint", ckpt),
        (f"sampling {rows} rows of {prompt} + {completion} tokens (KV cache, logits)", kv),
    ]


def main(argv=None):
    p = argparse.ArgumentParser(description="Memory of a QeRL step on Qwen2.5-7B: bf16 against NVFP4 base")
    p.add_argument("--rank", type=int, default=32, help="LoRA rank (the paper's main runs: 32)")
    p.add_argument("--rows", type=int, default=8, help="sampled rows at once (prompts x group)")
    p.add_argument("--prompt", type=int, default=256, help="prompt tokens (the paper's Table 3: 256)")
    p.add_argument("--completion", type=int, default=2048, help="completion tokens (Table 3: up to 2048)")
    args = p.parse_args(argv)
    if min(args.rank, args.rows, args.prompt, args.completion) < 1:
        p.error("--rank, --rows, --prompt and --completion must be at least 1")
    linear, adapters, fixed, per_step = table(QWEN25_7B, args.rank, args.rows, args.prompt, args.completion)
    print(f"Qwen2.5-7B-Instruct: {linear / 1e9:.3f}B numbers in the decoder's Linears, {adapters / 1e6:.1f}M LoRA "
          f"parameters at r={args.rank}")
    print(f"| {'':58s} | {'bf16 base':>10s} | {'NVFP4 base':>10s} |")
    print(f"|{'-' * 60}|{'-' * 12}|{'-' * 12}|")
    total = [0.0, 0.0]
    for name, bf16, nvfp4 in fixed:
        total = [total[0] + bf16, total[1] + nvfp4]
        print(f"| {name:58s} | {bf16 / GB:8.2f} GB | {nvfp4 / GB:8.2f} GB |")
    print(f"| {'held for the whole run':58s} | {total[0] / GB:8.2f} GB | {total[1] / GB:8.2f} GB |")
    for name, b in per_step:
        print(f"| {name:58s} | {b / GB:8.2f} GB | {b / GB:8.2f} GB |")


if __name__ == "__main__":
    main()
