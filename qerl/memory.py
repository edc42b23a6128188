"""Memory estimates, in bytes, for refusing up front what cannot fit and for sizing the update's micro-batches:
what stage 03's generate() allocates, what 05's update keeps per row for backward, --micro-batch auto, and a
whole run's peak phase. Each estimate names its assumptions; bench/bench_memory.py and
bench/bench_update_memory.py hold them against measurements (docs/scaling.md). Imports no stage: `cfg` is
any object with a model config's fields (hidden_size, intermediate_size, num_hidden_layers, ...).
"""
import torch

from qerl import devices
from qerl import engine

CONFIG_WIDTHS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                 "num_key_value_heads", "head_dim", "vocab_size")  # what the estimates read of a config


def generate_memory(cfg, rows, prompt_len, max_new_tokens, dtype_bytes):
    """About the bytes generate() allocates, beyond the weights, for `rows` rows (prompts x samples) of
    prompts up to prompt_len tokens: the KV cache, the prefill's largest activations (one layer at a
    time), the sampler's fp32 logits and the outputs. For refusing up front what cannot fit."""
    slots = -(-(prompt_len + max_new_tokens) // 64) * 64  # generate rounds the cache up to 64 slots
    kv_cache = 2 * cfg.num_hidden_layers * rows * cfg.num_key_value_heads * slots * cfg.head_dim * dtype_bytes
    # SwiGLU's three (rows, P, I) tensors, and attention's scores and mask (rows, H, P, slots) if the
    # kernel materialises them
    prefill = rows * prompt_len * (3 * cfg.intermediate_size * dtype_bytes
                                   + cfg.num_attention_heads * slots * (dtype_bytes + 1))
    sampler = 4 * rows * cfg.vocab_size * 4  # logits, tempered, log-probs and probabilities, (rows, V) fp32
    outputs = rows * max_new_tokens * (8 + 3 * 4)  # ids, mask, log-probs and entropies
    return kv_cache + prefill + sampler + outputs


def exploration_memory(cfg, rows, max_new_tokens, b, prompt_len=64):
    """About the bytes 04's measurement allocates, for `rows` rows (prompts x samples) at b bytes per number:
    its three models (the base; NF4 and NVFP4 keep each decoder weight in 4.5 bits, 4-bit codes and a scale
    per 16 or 64, and the embeddings as the base does), one generate() (04's `a+b-c=?` prompts are under
    prompt_len tokens in a chat template), and the KL's five (rows, N, V) fp32 tensors (both log-softmaxes,
    exp, difference, product)."""
    C, I, V = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    q_out, kv_out = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    decoder = cfg.num_hidden_layers * C * (2 * q_out + 2 * kv_out + 3 * I)  # numbers in the quantized Linears
    embeddings = V * C * (1 if cfg.tie_word_embeddings else 2)
    models = (3 * embeddings + decoder) * b + 2 * decoder * 4.5 / 8
    return int(models + generate_memory(cfg, rows, prompt_len, max_new_tokens, b) + 5 * rows * max_new_tokens * V * 4)


UPDATE_MEMORY_CPU = 2 ** 30  # --micro-batch auto on a CPU: the update's activations within 1 GiB


def update_bytes_per_row(cfg, T, b, grad_checkpoint):
    """About the bytes the update keeps per row of T tokens (b bytes per activation) for backward: a token's
    numbers autograd keeps per layer (bench_update_memory.py --per-token: 316 KiB at 7B widths in bf16) and
    SDPA's fp32 additive mask, (rows, 1, G*T, T); a checkpointed layer keeps only its input."""
    C, I, L = cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers
    layer = (18 * C + 5 * I) * b + cfg.num_attention_heads // cfg.num_key_value_heads * T * 4
    return T * (L * (C * b if grad_checkpoint else layer) + layer)


def auto_micro_batch(cfg, rows, T, b, grad_checkpoint, device):
    """--micro-batch auto: all `rows` (T tokens each, b bytes per activation) when their activations fit the
    update's budget, UPDATE_MEMORY_CPU on a CPU or half the free memory on a GPU, else as many as do (>= 1)."""
    free = None if torch.device(device).type == "cpu" else devices.free_memory(device)
    budget = UPDATE_MEMORY_CPU if free is None else free // 2
    per_row = update_bytes_per_row(cfg, T, b, grad_checkpoint)  # 0 for a rank with no rows
    return max(1, min(rows, int(budget // max(per_row, 1))))


def micro_batch_rows(micro_batch, rows, model, T):
    """Rows per forward/backward of the update: --micro-batch, all `rows` for 0, auto_micro_batch for auto."""
    if micro_batch != "auto":
        return min(micro_batch or rows, rows)
    cfg = getattr(model, "config", None)
    if not all(hasattr(cfg, k) for k in CONFIG_WIDTHS):  # a policy without widths to go by
        return rows
    return auto_micro_batch(model.config, rows, T, model.model.embed_tokens.weight.element_size(),
                            model.grad_checkpoint, devices.model_device(model))


def run_memory(args, cfg, P, world, b, device="cpu"):
    """About the bytes a run allocates beyond the model's weights (prompts up to P tokens, b bytes per
    activation) -> (the adapters', {phase: its peak}); the adapters and one phase live at once. Sampling a
    step or an evaluation chunk is generate_memory; the update keeps each layer's activations of
    its rows for backward; the adapters are fp32 with their gradients and AdamW's two moments."""
    C, I, L, N = cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers, args.max_new_tokens
    rows = -(-args.batch // world) * args.group  # this rank's rows of a step
    k = args.eval_k  # rows per generate() call: evaluate's greedy, then pass@k's k samples of fewer prompts
    eval_rows = max(min(args.eval_size, args.eval_chunk), min(args.eval_size, max(1, args.eval_chunk // max(k, 1))) * k)
    T = P + N
    per_row = update_bytes_per_row(cfg, T, b, args.grad_checkpoint)
    update_rows = auto_micro_batch(cfg, rows, T, b, args.grad_checkpoint, device) if args.micro_batch == "auto" \
        else min(args.micro_batch or rows, rows)  # auto as the update decides it, at full length
    logits = 4 * min(engine.LOGITS_CHUNK_BYTES, update_rows * T * cfg.vocab_size * 4)  # a chunk and its gradients
    q_out, kv_out = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    adapter_numbers = args.lora_r * L * (2 * (C + q_out) + 2 * (C + kv_out) + 3 * (C + I))  # A, B of 7 projections
    return 16 * adapter_numbers, {
        f"sampling --batch {args.batch} x --group {args.group}": generate_memory(cfg, rows, P, N, b),
        f"evaluating {eval_rows} rows at a time (--eval-chunk, --eval-k)":
        generate_memory(cfg, eval_rows, P, N, b) if args.eval_size else 0,
        f"the update, {update_rows} rows at a time (--micro-batch)": update_rows * per_row + logits}
