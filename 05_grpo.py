"""
Stage 05: GRPO with LoRA on a 4-bit base, with Adaptive Quantization Noise (the QeRL loop).

QeRL trains reasoning with RL while the base model stays frozen in NVFP4 and only LoRA adapters
learn. Two things make that work: the 4-bit base makes the expensive part (sampling) cheap, and its
rounding noise -- plus AQN's scheduled extra noise on the RMSNorm gains -- raises sampling entropy,
which helps exploration. Here the sampler runs under `aqn_noise` (stage 04) and records its own
log-probabilities; they are the pi_old of the clipped surrogate, so the importance ratio
pi_theta / pi_old corrects for the noise while the update runs on the clean policy.

One step: B prompts x G samples -> rewards (correct answer + 0.1 for the <think>/<answer> format) ->
group-normalised advantages -> clipped surrogate (eps 0.2 / 0.28, token-mean "DAPO" aggregation by
default) -> AdamW on the adapters only. Deliberate simplifications:
  1. Groups whose G rewards are all equal carry no signal and are left out of the loss (the filter
     half of DAPO's dynamic sampling, without resampling).
  2. No reference model copy: the optional KL (--beta) compares with the base under lora_disabled.
  3. The learning-rate and AQN schedules are defined by --steps; --time-budget only stops early.

Run it (CPU, 2 cores, < 10 min: QeRL = NVFP4 + LoRA + AQN on the bundled tiny model, synthetic
arithmetic; the held-out greedy accuracy is printed before and after. Measured: 750 steps at 0.58 s
per step, 464 s in all, greedy 23.0% -> 49.2% and pass@8 44.4% -> 65.0% on 500 held-out problems):
    python 05_grpo.py
    python 05_grpo.py --quant none --no-aqn --steps 200 --out runs/lora-only
    python 05_grpo.py --resume runs/qerl/checkpoint-000200
Data parallel: the same script under torchrun (gloo between CPU processes, NCCL between GPUs). --batch
stays the global number of prompts per step; each rank samples its share of whole groups and the
adapter gradients are summed across ranks (section "Data parallel" below; README "Scaling out"):
    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node 2 05_grpo.py --out runs/dp2
Qwen2.5-7B-Instruct + GSM8K on one GPU, close to the paper's GSM8K setting (Table 4: 128 samples per
step as 16 prompts x 8, lr 1e-5, LoRA rank 32, AQN 1e-2 -> 5e-4 over 10 stages; the official
scripts' gradient clip 0.2 and 10% warmup; the paper's instruction goes in the system prompt). The
JSONL files are GSM8K's train/test splits as {"question", "answer"} lines (answer ends in "#### n").
The update runs 8 rows at a time with activation checkpointing (README "One GPU at 7B": ~19 GiB at the
peak, which is sampling's KV cache; without --grad-checkpoint, --micro-batch 4 fits 80 GB, 8 needs 141 GB):
    python 05_grpo.py --model Qwen2.5-7B-Instruct --data gsm8k/train.jsonl --eval-data gsm8k/test.jsonl \
        --quant nvfp4 --dtype bfloat16 --batch 16 --group 8 --lr 1e-5 --lora-r 32 --lora-alpha 32 \
        --max-new-tokens 1024 --steps 600 --warmup 60 --grad-clip 0.2 --sigma-start 1e-2 --sigma-end 5e-4 \
        --micro-batch 8 --grad-checkpoint \
        --eval-every 50 --eval-size 500 --eval-k 4 --eval-chunk 128 --save-every 50 --time-budget 0 \
        --out runs/qwen7b-gsm8k
On one node with 8 GPUs, the same flags after `torchrun --standalone --nproc_per_node 8 05_grpo.py`
(each GPU then samples 2 of the 16 groups).
"""
import argparse
import contextlib
import datetime
import importlib
import json
import math
import os
import random
import re
import shutil
import sys
import time
from fractions import Fraction

import torch
import torch.distributed as dist
import torch.nn.functional as F
import torch.utils.checkpoint
from safetensors import SafetensorError

quantize = importlib.import_module("01_quantize")
lora = importlib.import_module("02_lora")
rollout = importlib.import_module("03_rollout")
aqn = importlib.import_module("04_aqn")

ROOT = os.path.dirname(os.path.abspath(__file__))
TINY_MODEL = os.path.join(ROOT, "assets", "tiny-qwen")

# -----------------------------------------------------------------------------
# Task and reward
#
# The synthetic task: `a op b op c = ?` with + and -, each operand 1-3 digits (digit count drawn
# first, so small numbers are as common as large ones), worked left to right. Difficulty knobs:
# `digits` and `nops`. With 3 digits and 2 operations there are ~4e9 problems, so the held-out set
# (a fixed seed) practically never meets a training prompt; we exclude its questions anyway.

# The paper's instruction (App. E). For Qwen2.5 it goes in the system prompt; the bundled tiny model
# never saw it: it learned the format from its supervised pretraining, and its prompt is the bare
# problem in a ChatML user turn (a long instruction would triple its prompt length for nothing).
PAPER_INSTRUCTION = ("Solve the following math problem step by step. The reasoning process and direct answer "
                     "are enclosed within <think> </think> and <answer> </answer> tags, respectively, i.e., "
                     "<think> reasoning process here </think> <answer> answer here </answer>.")
EVAL_SEED = 1234  # the held-out stream; its first EVAL_POOL questions never appear in training
EVAL_POOL = 2000
FORMAT_REWARD = 0.1


def make_problem(rng, digits=3, nops=2, ops="+-"):
    """One problem {question, answer, solution} from a random.Random; `solution` is the worked
    completion the tiny model is pretrained on."""
    def operand():
        d = rng.randint(1, digits)
        return rng.randint(0 if d == 1 else 10 ** (d - 1), 10 ** d - 1)

    nums = [operand() for _ in range(nops + 1)]
    chosen = [rng.choice(ops) for _ in range(nops)]
    acc, steps = nums[0], []
    for op, n in zip(chosen, nums[1:]):
        new = acc + n if op == "+" else acc - n
        steps.append(f"{acc}{op}{n}={new}")
        acc = new
    question = str(nums[0]) + "".join(op + str(n) for op, n in zip(chosen, nums[1:])) + "=?"
    solution = "<think>" + ",".join(steps) + "</think><answer>" + str(acc) + "</answer>"
    return {"question": question, "answer": str(acc), "solution": solution}


def arithmetic_problems(n, seed, digits=3, nops=2, exclude=frozenset()):
    """The first n distinct problems of the stream `seed` whose questions are not in `exclude`."""
    rng, seen, out = random.Random(seed), set(exclude), []
    while len(out) < n:
        p = make_problem(rng, digits, nops)
        if p["question"] not in seen:
            seen.add(p["question"])
            out.append(p)
    return out


_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")
_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.S)
# exactly one think block then one answer block (whitespace allowed between and around)
_FORMAT = re.compile(r"\s*<think>((?!</?think>).)*</think>\s*<answer>((?!</?answer>).)*</answer>\s*", re.S)
_EOS_STRINGS = ("<|im_end|>", "<|endoftext|>")


def parse_number(text):
    """The last number in `text` as an exact Fraction ("1,234.50" -> 2469/2), or None."""
    found = _NUMBER.findall(text or "")
    if not found:
        return None
    try:
        return Fraction(found[-1].replace(",", ""))
    except (ValueError, ZeroDivisionError):
        return None


def extract_answer(completion):
    """The number in the last <answer>...</answer> of a completion, or None."""
    blocks = _ANSWER.findall(completion or "")
    return parse_number(blocks[-1]) if blocks else None


def reward_fn(completion, gold):
    """1.0 if the last <answer> holds the gold number, plus 0.1 if the completion is exactly
    <think>...</think><answer>number</answer>. Never raises: malformed text just scores lower."""
    text = completion if isinstance(completion, str) else ""
    for eos in _EOS_STRINGS:  # a sampler may or may not decode the stop token
        text = text.replace(eos, "")
    pred, want = extract_answer(text), parse_number(str(gold))
    correct = pred is not None and want is not None and pred == want
    formatted = _FORMAT.fullmatch(text) is not None and pred is not None
    return float(correct) + (FORMAT_REWARD if formatted else 0.0)


def is_correct(completion, gold):
    return reward_fn(completion, gold) >= 1.0

# -----------------------------------------------------------------------------
# Data: synthetic arithmetic or GSM8K-style JSONL, with held-out splits


def gsm8k_gold(answer):
    """GSM8K's gold is the text after the last '####' ("... #### 1,200" -> "1200"), or None."""
    if not isinstance(answer, str) or "####" not in answer:
        return None
    gold = answer.rsplit("####", 1)[1].strip().replace(",", "")
    return gold if parse_number(gold) is not None else None


def load_jsonl(path):
    """Problems [{question, answer}] from a JSONL file of {"question", "answer": "... #### n"}.
    Malformed lines are skipped and counted (one line of output); no usable line is an error."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"data file {path!r} not found (expected JSONL lines with 'question' and "
                                f"'answer' ending in '#### <number>', or use --data arith)")
    problems, bad, first_bad = [], 0, None
    with open(path, encoding="utf-8", errors="replace") as f:  # undecodable bytes -> a malformed line
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                gold = gsm8k_gold(row.get("answer")) if isinstance(row, dict) else None
                question = row.get("question") if isinstance(row, dict) else None
            except json.JSONDecodeError:
                gold = question = None
            if gold is None or not isinstance(question, str) or not question.strip():
                bad += 1
                first_bad = first_bad or lineno
                continue
            problems.append({"question": question.strip(), "answer": gold})
    if bad:
        print(f"data | {path}: skipped {bad} malformed line(s) (first at line {first_bad}); "
              f"kept {len(problems)}")
    if not problems:
        raise ValueError(f"data file {path!r} has no usable problems (need JSON lines with 'question' and "
                         f"'answer' ending in '#### <number>')")
    return problems


def make_splits(args):
    """(train, eval, exclude). train is a list of problems, or None for the endless synthetic stream;
    exclude is the set of questions the synthetic stream must skip: the whole held-out pool, not just
    the --eval-size of it that is evaluated (a data file's split is already disjoint)."""
    if args.data == "arith":
        pool = arithmetic_problems(max(EVAL_POOL, args.eval_size), EVAL_SEED, args.digits, args.nops)
        return None, pool[:args.eval_size], frozenset(p["question"] for p in pool)
    train = load_jsonl(args.data)
    if args.eval_data:
        held = load_jsonl(args.eval_data)[:args.eval_size]
    else:  # hold out a fixed random slice of the training file
        order = list(range(len(train)))
        random.Random(EVAL_SEED).shuffle(order)
        n_eval = min(args.eval_size, len(train) // 2)
        held, train = [train[i] for i in order[:n_eval]], [train[i] for i in order[n_eval:]]
    held_q = {p["question"] for p in held}
    train = [p for p in train if p["question"] not in held_q]  # eval problems never train
    if not train:
        raise ValueError(f"no training problems left in {args.data!r} after removing the evaluation set")
    return train, held, frozenset()


def train_batch(train, step, n, seed, digits=3, nops=2, exclude=frozenset()):
    """The n training problems of `step`: a pure function of (seed, step), so a resumed run draws
    exactly what an uninterrupted one would, with no RNG state to carry."""
    if train is None:
        rng = random.Random(seed * 1_000_003 + step)
        out = []
        while len(out) < n:
            p = make_problem(rng, digits, nops)
            if p["question"] not in exclude:
                out.append(p)
        return out
    out = []
    for i in range(step * n, step * n + n):  # walk epoch-wise shuffles of the file
        epoch, j = divmod(i, len(train))
        order = list(range(len(train)))
        random.Random(seed * 1_000_003 + epoch).shuffle(order)
        out.append(train[order[j]])
    return out


def prompt_text(question, system):
    return rollout.chat_prompt(question, system=PAPER_INSTRUCTION if system else None)

# -----------------------------------------------------------------------------
# Advantages and loss


def group_advantages(rewards, group, scale_std=True, eps=1e-4):
    """rewards (B*G,) in prompt-major order -> advantages (B*G,): r - mean of its group, divided by
    the group's (unbiased) std + eps unless scale_std is False (Dr. GRPO)."""
    r = rewards.float().view(-1, group)  # (B, G)
    adv = r - r.mean(dim=1, keepdim=True)  # (B, G)
    if scale_std:
        std = r.std(dim=1, keepdim=True) if group > 1 else torch.zeros_like(r[:, :1])  # (B, 1)
        adv = adv / (std + eps)
    return adv.reshape(-1)  # (B*G,)


def aggregate(values, mask, mode, max_new_tokens=None, denom=None):
    """Reduce per-token values (N, T) under mask (N, T) to a scalar.
    token-mean: sum / number of tokens (DAPO; long answers weigh more).
    seq-mean-token-mean: mean over sequences of each one's token mean (original GRPO).
    seq-mean-token-sum-norm: sum / (N * max_new_tokens), a constant (Dr. GRPO: no length bias).
    denom, when given, replaces the divisor (tokens, non-empty sequences, N * max_new_tokens): the
    update passes the count over all rows of the step (all ranks, including the rows it leaves out),
    so each call gets its share of the step's value."""
    mask = mask.to(values.dtype)
    if mode == "token-mean":
        return (values * mask).sum() / (mask.sum().clamp(min=1) if denom is None else denom)
    if mode == "seq-mean-token-mean":
        per_seq = (values * mask).sum(1) / mask.sum(1).clamp(min=1)  # (N,)
        has = (mask.sum(1) > 0).to(values.dtype)  # (N,) empty rows do not count
        return (per_seq * has).sum() / (has.sum().clamp(min=1) if denom is None else denom)
    if mode == "seq-mean-token-sum-norm":
        if denom is None and not max_new_tokens:
            raise ValueError("loss aggregation seq-mean-token-sum-norm needs max_new_tokens")
        return (values * mask).sum() / (values.shape[0] * max_new_tokens if denom is None else denom)
    raise ValueError(f"unknown loss aggregation {mode!r}; choose token-mean, seq-mean-token-mean or "
                     f"seq-mean-token-sum-norm")


LOSS_AGGS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")


def grpo_loss(logp, old_logp, adv, mask, eps_low=0.2, eps_high=0.28, agg="token-mean", max_new_tokens=None,
              ref_logp=None, beta=0.0, entropy=None, entropy_coef=0.0, denom=None):
    """The clipped surrogate (to minimise) and its statistics.
    logp (N, T) current policy, with gradients; old_logp (N, T) the sampler's (pi_old); adv (N,);
    mask (N, T) 1 on completion tokens; ref_logp (N, T) the reference policy (for beta > 0);
    entropy (N, T) with gradients (for entropy_coef > 0); denom: see aggregate."""
    mask = mask.float()
    ratio = torch.exp(logp - old_logp)  # (N, T) pi_theta / pi_old per token
    a = adv.view(-1, 1)  # (N, 1)
    surr = torch.minimum(ratio * a, ratio.clamp(1 - eps_low, 1 + eps_high) * a)  # (N, T)
    per_tok = -surr  # (N, T)
    kl = None
    if ref_logp is not None:
        d = ref_logp - logp  # (N, T)
        kl = torch.exp(d) - d - 1  # (N, T) k3 estimate of KL(pi_theta || pi_ref), >= 0
        if beta:
            per_tok = per_tok + beta * kl
    if entropy is not None and entropy_coef:
        per_tok = per_tok - entropy_coef * entropy  # a bonus: higher entropy lowers the loss
    loss = aggregate(per_tok, mask, agg, max_new_tokens, denom)
    with torch.no_grad():
        # a token is clipped when the clamp, not the raw ratio, sets the surrogate (zero gradient)
        clipped = ((ratio < 1 - eps_low) & (a < 0)) | ((ratio > 1 + eps_high) & (a > 0))  # (N, T)
        n_tok = mask.sum().clamp(min=1)
        stats = {"clip": float((clipped.float() * mask).sum() / n_tok),
                 "ratio_max": float(ratio.masked_fill(mask == 0, 1.0).max()) if mask.numel() else 1.0,
                 "kl": float((kl * mask).sum() / n_tok) if kl is not None else float("nan"),
                 # how far the (noisy) sampler is from the policy being trained: k3 of pi_old vs pi_theta
                 "kl_old": float(((torch.exp(old_logp - logp) - (old_logp - logp) - 1) * mask).sum() / n_tok)}
    return loss, stats

# -----------------------------------------------------------------------------
# Sampling and evaluation
#
# Sampling runs the model once per new token (~40 forwards per step). On CPU each quantized layer
# dequantizes its 4-bit weight on every call and each LoRA layer adds three small ops, and at this
# model size that overhead is most of the cost. Within one step the weights are fixed, so we
# dequantize once and fold the adapter in: W = dequant(W_4bit) + (alpha/r) B A. This is the same
# function up to float rounding (the sampler's log-probs are pi_old anyway, and the clipped ratio
# absorbs any difference). On CUDA the NVFP4 kernel reads the 4-bit weights directly, and a merged
# bf16 copy of a 7B model would cost its full size in memory, so there we sample the modules as they are.
# --gpu-path takes that CUDA path on the CPU too (QERL_TRITON_CPU=1: stage 01 calls the interpreted kernel).


def merge_for_sampling(device):
    """Whether sampling merges the weights: on the CPU, unless the kernel path (--gpu-path) is on."""
    return torch.device(device).type == "cpu" and os.environ.get("QERL_TRITON_CPU") != "1"


def use_gpu_path(device):
    """--gpu-path: run CUDA's code path (NVFP4Linear through the Triton kernel) on any device."""
    if torch.device(device).type == "cpu":
        interpreted = os.environ.get("TRITON_INTERPRET") == "1"
        if "triton" in sys.modules and not interpreted:
            raise ValueError("--gpu-path on the CPU runs the Triton kernel under the interpreter, which must be "
                             "on before triton is imported: set TRITON_INTERPRET=1 in the environment")
        os.environ["TRITON_INTERPRET"] = "1"
    if quantize._nvfp4_kernel() is None:
        raise ValueError("--gpu-path needs triton (pip install triton; Linux only)")
    os.environ["QERL_TRITON_CPU"] = "1"


@contextlib.contextmanager
def merged_sampling_weights(model, enabled=True):
    """Inside: every LoRA-wrapped (or quantized) linear runs as one F.linear with a cached weight."""
    patched = []
    if enabled:
        wrapped = {id(m.base) for m in model.modules() if isinstance(m, lora.LoRALinear)}
        with torch.no_grad():
            for m in model.modules():
                if isinstance(m, lora.LoRALinear):
                    base = m.base
                elif hasattr(m, "dequantized_weight") and id(m) not in wrapped:
                    base = m  # a quantized linear without an adapter
                else:
                    continue
                w = base.dequantized_weight(torch.float32) if hasattr(base, "dequantized_weight") \
                    else base.weight.float()  # (out, in)
                if base is not m and not m.disabled:
                    w = w + (m.lora_B.float() @ m.lora_A.float()) * m.scaling  # (out, in)
                dtype = model.model.embed_tokens.weight.dtype  # the activations' dtype
                bias = base.bias.to(dtype) if getattr(base, "bias", None) is not None else None
                m.forward = lambda x, w=w.to(dtype), b=bias: F.linear(x, w, b)  # instance attribute wins
                patched.append(m)
    try:
        yield model
    finally:
        for m in patched:
            del m.forward  # back to the class's forward


def sample(model, tok, prompts, num_samples, max_new_tokens, temperature, generator, chunk):
    """generate() over prompt chunks (memory), concatenating texts in prompt-major order."""
    texts, tokens = [], 0
    step = max(1, chunk // num_samples)
    for i in range(0, len(prompts), step):
        out = rollout.generate(model, prompts[i:i + step], num_samples=num_samples, max_new_tokens=max_new_tokens,
                               temperature=temperature, eos_token_ids=tok.eos_token_ids, generator=generator,
                               tokenizer=tok)
        texts += out.texts
        tokens += int(out.completion_mask.sum())
    return texts, tokens


@torch.inference_mode()
def evaluate(model, tok, problems, system, max_new_tokens, k=0, temperature=1.0, seed=0, chunk=512):
    """Held-out accuracy without AQN noise: greedy pass@1 always; with k > 0 also pass@1 (mean over
    the k samples) and pass@k (any of k correct) at `temperature`. Returns counts and rates."""
    prompts = [tok.encode(prompt_text(p["question"], system)) for p in problems]
    golds = [p["answer"] for p in problems]
    with merged_sampling_weights(model, enabled=merge_for_sampling(model_device(model))):
        return _evaluate(model, tok, prompts, golds, max_new_tokens, k, temperature, seed, chunk)


def _evaluate(model, tok, prompts, golds, max_new_tokens, k, temperature, seed, chunk):
    texts, _ = sample(model, tok, prompts, 1, max_new_tokens, 0.0, None, chunk)
    greedy = sum(is_correct(t, g) for t, g in zip(texts, golds))
    res = {"n": len(prompts), "greedy_correct": greedy, "greedy": greedy / max(len(prompts), 1)}
    if k > 0:
        gen = torch.Generator(device=model_device(model)).manual_seed(seed)
        texts, _ = sample(model, tok, prompts, k, max_new_tokens, temperature, gen, chunk)
        hits = [[is_correct(texts[i * k + j], golds[i]) for j in range(k)] for i in range(len(prompts))]
        res.update({"k": k, "sample_correct": sum(map(sum, hits)), "pass_k_correct": sum(map(any, hits)),
                    "pass@1": sum(map(sum, hits)) / max(k * len(prompts), 1),
                    f"pass@{k}": sum(map(any, hits)) / max(len(prompts), 1)})
    return res


def model_device(model):
    for t in list(model.parameters()) + list(model.buffers()):
        return t.device
    return torch.device("cpu")


def eval_line(step, res, seconds):
    s = f"eval | step {step} | n {res['n']} | greedy {res['greedy']:.3f}"
    if "k" in res:
        k = res["k"]
        s += f" | pass@1 {res['pass@1']:.3f} | pass@{k} {res['pass@%d' % k]:.3f}"
    return s + f" | {seconds:.1f}s"

# -----------------------------------------------------------------------------
# Data parallel (torchrun)
#
# `torchrun --nproc_per_node N 05_grpo.py ...` starts N copies of this script, and torch.distributed
# connects them: NCCL between GPUs, gloo between CPU processes. Every rank holds the whole (frozen,
# quantized) model and an identical adapter. Each step's B prompts are split across ranks in whole
# groups (a group's advantage needs all G of its rewards); each rank samples and scores its share.
# The loss on a rank is divided by the *global* normaliser (tokens or sequences counted over all
# ranks), so its gradient is exactly its share of the gradient one process would get on all B*G rows:
# one all_reduce (a sum) of the flattened adapter gradients restores that gradient on every rank, and
# every rank takes the same AdamW step, so the adapters never drift apart. Rank 0 alone prints,
# evaluates and writes files. Launched as a plain `python 05_grpo.py`, every helper here is a no-op.


def init_distributed(device):
    """(rank, world_size, device). Joins the process group when torchrun started us (WORLD_SIZE > 1);
    on CUDA each rank takes the GPU of its LOCAL_RANK."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return 0, 1, device
    if device.startswith("cuda"):
        device = f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}"
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        # Rank 0 evaluates while the others wait at their next collective: allow a long evaluation.
        dist.init_process_group("nccl" if device.startswith("cuda") else "gloo",
                                timeout=datetime.timedelta(hours=2))
    return dist.get_rank(), dist.get_world_size(), device


def rank_and_world():
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def shard(items, rank, world):
    """This rank's contiguous share of `items` (shares differ in size by at most one)."""
    n = len(items)
    return items[rank * n // world:(rank + 1) * n // world]


def _comm_device():
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


def all_reduce(values, op="sum"):
    """A list of Python numbers -> the list summed (op "sum") or maximised ("max") over all ranks."""
    if rank_and_world()[1] == 1:
        return [float(v) for v in values]
    t = torch.tensor([float(v) for v in values], dtype=torch.float64, device=_comm_device())  # (n,)
    dist.all_reduce(t, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX)
    return t.tolist()


def all_reduce_grads(params):
    """Sum every parameter's gradient over ranks with one all_reduce of their concatenation (a rank
    with no rows to train on contributes zeros)."""
    if rank_and_world()[1] == 1:
        return
    flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params])  # (P,)
    dist.all_reduce(flat)
    offset = 0
    for p in params:
        p.grad = flat[offset:offset + p.numel()].view_as(p)
        offset += p.numel()


def broadcast_parameters(params):
    """Rank 0's values to every rank: the adapters start equal even if initialisation were to differ."""
    if rank_and_world()[1] == 1:
        return
    with torch.no_grad():
        for p in params:
            dist.broadcast(p.data, src=0)


# -----------------------------------------------------------------------------
# Checkpointing
#
# A checkpoint folder holds the adapter in PEFT's layout (stage 02) and trainer_state.pt: the AdamW
# state, the step (the LR schedule is a pure function of it, so it needs no state of its own), the
# AQN feedback controller, the RNG states (the per-step generators are re-derived from (seed, step),
# so these are only a safety net) and the run's arguments. It is written to a temporary folder and
# renamed, so a crash never leaves half a checkpoint.

RUNTIME_ARGS = ("out", "resume", "time_budget", "stop_at", "eval_every", "save_every", "device", "quiet",
                "micro_batch", "grad_checkpoint", "gpu_path")  # how to compute, not what: a resume may change them


def save_checkpoint(out, step, model, opt, args, feedback=None, extra=None):
    final = os.path.join(out, f"checkpoint-{step:06d}")
    tmp = os.path.join(out, f".tmp-checkpoint-{step:06d}-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    lora.save_adapter(model, tmp, base_model_name_or_path=args.model)
    state = {"step": step, "optimizer": opt.state_dict(), "lr": opt.param_groups[0]["lr"], "args": vars(args),
             "feedback": feedback.state_dict() if feedback is not None else None,
             "torch_rng": torch.get_rng_state(), "python_rng": random.getstate(),
             "cuda_rng": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None, **(extra or {})}
    torch.save(state, os.path.join(tmp, "trainer_state.pt"))
    if os.path.exists(final):  # re-running into the same folder: replace the old one
        old = final + f".old{os.getpid()}"
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, final)
    return final


def find_checkpoint(path):
    """A checkpoint folder itself, or the latest checkpoint-* inside a run folder."""
    if os.path.isfile(os.path.join(path, "trainer_state.pt")):
        return path
    found = sorted(d for d in os.listdir(path) if re.fullmatch(r"checkpoint-\d+", d)) if os.path.isdir(path) else []
    if not found:
        raise FileNotFoundError(f"--resume {path!r}: no checkpoint there (expected a checkpoint-NNNNNN folder "
                                f"with trainer_state.pt, or a run folder containing one)")
    return os.path.join(path, found[-1])


def load_adapter(model, ckpt):
    """Stage 02's load_adapter, with a truncated or corrupt adapter file reported in one line."""
    try:
        lora.load_adapter(model, ckpt)
    except SafetensorError as e:
        file = os.path.join(ckpt, "adapter_model.safetensors")
        raise ValueError(f"--resume: {file}: {rollout._safetensors_problem(file) or e}; the file is truncated "
                         f"or corrupt, resume from another checkpoint") from None


def load_trainer_state(ckpt):
    return torch.load(os.path.join(ckpt, "trainer_state.pt"), map_location="cpu", weights_only=False)

# -----------------------------------------------------------------------------
# Training loop


def lr_lambda(warmup, total, min_ratio):
    """Linear warmup over `warmup` steps, then cosine decay to min_ratio * lr at `total`."""
    def f(step):
        if step < warmup:
            return (step + 1) / warmup
        u = min(1.0, (step - warmup) / max(1, total - warmup))
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * u))
    return f


def wants_instruction(args):
    """Whether prompts carry the paper's instruction as system prompt: --system paper / none, or auto:
    yes unless the model says it learned the format in pretraining (the bundled tiny model's
    config.json has "qerl_prompt": "bare")."""
    if args.system != "auto":
        return args.system == "paper"
    with open(os.path.join(args.model, "config.json")) as f:
        return json.load(f).get("qerl_prompt") != "bare"


def check_model_dir(path):
    if not os.path.isdir(path) or not os.path.isfile(os.path.join(path, "config.json")):
        raise FileNotFoundError(f"--model {path!r} is not a model folder (expected a Hugging Face folder with "
                                f"config.json, model.safetensors and tokenizer.json)")
    try:
        with open(os.path.join(path, "config.json")) as f:
            json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"--model {path!r}: config.json is not valid JSON ({e})") from None


def build_policy(args, device):
    """The frozen (quantized) base with fresh LoRA adapters and their AdamW -> (model, tok, params, opt).
    The adapter initialisation depends on --seed alone, so every rank builds the same one."""
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[
        args.dtype or ("bfloat16" if str(device).startswith("cuda") or args.gpu_path else "float32")]
    model, tok = rollout.load_model(args.model, quant=args.quant, dtype=dtype, device=device)
    lora.add_lora(model, r=args.lora_r, alpha=args.lora_alpha, generator=torch.Generator().manual_seed(args.seed))
    params = lora.lora_parameters(model)
    opt = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.99), weight_decay=0.0)
    return model, tok, params, opt


def train(args):
    """The GRPO loop. Returns the summary dict (also written to <out>/summary.json by rank 0)."""
    t_start = time.time()
    rank, world, device = init_distributed(args.device or quantize.autodetect_device())
    if rank > 0:
        sys.stdout = open(os.devnull, "w")  # rank 0 alone prints; errors still reach stderr
    state = None
    if args.resume:
        ckpt = find_checkpoint(args.resume)
        state = load_trainer_state(ckpt)
        defaults = vars(build_parser().parse_args([]))
        for k, v in state["args"].items():  # the run's hyper-parameters come from the checkpoint
            if k not in RUNTIME_ARGS:
                if getattr(args, k, v) not in (v, defaults.get(k)):
                    print(f"note | --{k.replace('_', '-')} {getattr(args, k)} ignored: resuming keeps the "
                          f"checkpoint's {v}")
                setattr(args, k, v)
        if not args.out:
            args.out = os.path.dirname(os.path.abspath(ckpt))
    validate_args(args)
    if args.batch < world:
        raise ValueError(f"--batch {args.batch} is smaller than the number of ranks ({world}): every rank "
                         f"needs at least one prompt group; raise --batch or launch fewer processes")
    check_model_dir(args.model)
    if args.gpu_path:
        use_gpu_path(device)
    train_set, eval_set, exclude = make_splits(args)  # bad data fails here, before the model loads
    if not args.out:
        args.out = os.path.join("runs", datetime.datetime.now().strftime("%Y%m%d-%H%M%S"))
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    system = wants_instruction(args)
    model, tok, params, opt = build_policy(args, device)
    lr_at = lr_lambda(args.warmup, args.steps, args.min_lr_ratio)  # a pure function of the step: nothing to save
    feedback = None
    if args.aqn and args.aqn_kind == "feedback":
        feedback = aqn.FeedbackSigma(args.target_entropy, sigma_init=args.sigma_start)
    start = 0
    if state is not None:
        load_adapter(model, ckpt)
        opt.load_state_dict(state["optimizer"])
        if feedback is not None and state.get("feedback"):
            feedback.load_state_dict(state["feedback"])
        torch.set_rng_state(state["torch_rng"])
        random.setstate(state["python_rng"])
        start = state["step"]
        print(f"resume | {ckpt} | step {start}/{args.steps} | hyper-parameters from the checkpoint")
    broadcast_parameters(params)

    metrics_path = os.path.join(args.out, "metrics.jsonl")
    if rank == 0:
        truncate_metrics(metrics_path, start)
        with open(os.path.join(args.out, "args.json"), "w") as f:
            json.dump(vars(args), f, indent=2)
    dtype = str(model.model.embed_tokens.weight.dtype).replace("torch.", "")
    print(f"run | model {args.model} | quant {args.quant} | aqn {args.aqn_kind if args.aqn else 'off'} | "
          f"device {device} | dtype {dtype} | steps {args.steps} | B {args.batch} | "
          f"G {args.group} | lr {args.lr:g} | out {args.out}" + (f" | ranks {world}" if world > 1 else ""))
    evaluating = rank == 0 and args.eval_size > 0  # rank 0 alone evaluates and writes

    def run_eval(step, k):
        t0 = time.time()
        res = evaluate(model, tok, eval_set, system, args.max_new_tokens, k=k, temperature=args.temperature,
                       seed=EVAL_SEED, chunk=args.eval_chunk)
        res.update(step=step, seconds=time.time() - t0, time=time.time() - t_start)
        print(eval_line(step, res, res["seconds"]), flush=True)
        log_jsonl(metrics_path, {"eval": res})
        return res

    if state is not None and state.get("first_eval"):
        first_eval = state["first_eval"]  # the gain is measured from the start of the whole run
    else:
        first_eval = run_eval(start, args.eval_k) if evaluating else None
    last_eval, done, skipped, stopped, last_ckpt = first_eval, start, 0, "steps", None
    # keep back time for the final evaluation (it also samples pass@k): 1.5x the first one
    reserve = 1.5 * first_eval["seconds"] if first_eval else 0.0
    recent = []  # s/step of the last few steps
    for step in range(start, args.steps):
        next_step = sum(recent[-5:]) / len(recent[-5:]) if recent else 0.0
        out_of_time = args.time_budget and time.time() - t_start + reserve + next_step > args.time_budget
        if all_reduce([rank == 0 and out_of_time])[0]:  # rank 0's clock decides for everyone
            stopped = "time budget"
            break
        rec = grpo_step(args, step, model, tok, opt, lr_at, params, feedback, train_set, exclude, system, device)
        skipped += rec.pop("skipped")
        recent.append(rec["s/step"])
        rec["time"] = time.time() - t_start
        if rank == 0:
            log_jsonl(metrics_path, rec)
        if not args.quiet:
            print(f"step {rec['step']}/{args.steps} | reward {rec['reward']:.3f} | acc {rec['acc']:.3f} | "
                  f"entropy {rec['entropy']:.3f} | kl {fmt(rec['kl'])} | clip {rec['clip']:.4f} | "
                  f"len {rec['len']:.1f} | sigma {rec['sigma']:.2e} | tok/s {rec['tok/s']:.0f} | "
                  f"s/step {rec['s/step']:.2f}", flush=True)
        done = step + 1
        if args.eval_every and done % args.eval_every == 0 and done < args.steps and evaluating:
            last_eval = run_eval(done, 0)
        if rank == 0 and ((args.save_every and done % args.save_every == 0) or done == args.stop_at):
            last_ckpt = checkpoint(args, done, model, opt, feedback, first_eval) or last_ckpt
        if args.stop_at and done >= args.stop_at:
            stopped = "stop-at"
            break
    if stopped != "stop-at" and rank == 0:
        if done > start and (last_ckpt is None or not last_ckpt.endswith(f"{done:06d}")):
            last_ckpt = checkpoint(args, done, model, opt, feedback, first_eval) or last_ckpt
        if evaluating and (last_eval is None or last_eval["step"] != done or "k" not in last_eval):
            last_eval = run_eval(done, args.eval_k)
    summary = {"steps_done": done, "stopped_by": stopped, "skipped_updates": skipped,
               "wall_s": time.time() - t_start, "first_eval": first_eval, "final_eval": last_eval,
               "checkpoint": last_ckpt, "args": vars(args)}
    if first_eval and last_eval:
        summary["greedy_gain"] = last_eval["greedy"] - first_eval["greedy"]
        print(f"summary | steps {done} | greedy {first_eval['greedy']:.3f} -> {last_eval['greedy']:.3f} "
              f"({100 * summary['greedy_gain']:+.1f} points) | wall {summary['wall_s']:.0f}s | out {args.out}")
    if rank == 0:
        write_json(os.path.join(args.out, "summary.json"), summary)
    return summary


def grpo_step(args, step, model, tok, opt, lr_at, params, feedback, train_set, exclude, system, device):
    """Sample this rank's share of the step's groups, score them, update once (or --mu times) with
    the gradient summed over ranks. Returns the step's metrics, reduced over ranks."""
    t0 = time.time()
    rank, world = rank_and_world()
    lr = args.lr * lr_at(step)
    for group in opt.param_groups:
        group["lr"] = lr
    problems = train_batch(train_set, step, args.batch, args.seed, args.digits, args.nops, exclude)
    problems = shard(problems, rank, world)  # whole groups: a group's advantage needs all G rewards
    prompts = [tok.encode(prompt_text(p["question"], system)) for p in problems]
    if feedback is not None:
        sigma = feedback.sigma
    elif args.aqn:
        sigma = aqn.sigma_schedule(step, args.steps, args.sigma_start, args.sigma_end, args.num_stages,
                                   args.aqn_kind)
    else:
        sigma = 0.0
    # One generator per step, derived from (seed, step): sampling and AQN draws are then the same
    # whether or not the run was interrupted and resumed. Every rank draws the same AQN noise (it
    # perturbs the one model everybody samples from); ranks > 0 then sample from streams of their own,
    # while rank 0 continues the first, so a single process is unchanged by all this.
    seed = args.seed * 1_000_003 + step
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.inference_mode(), aqn.aqn_noise(model, sigma, gen), \
            merged_sampling_weights(model, enabled=merge_for_sampling(device)):
        if rank > 0:
            gen = torch.Generator(device=device).manual_seed(seed + rank * 2 ** 40)
        ro = rollout.generate(model, prompts, num_samples=args.group, max_new_tokens=args.max_new_tokens,
                              temperature=args.temperature, eos_token_ids=tok.eos_token_ids, generator=gen,
                              tokenizer=tok)
    t_sample = time.time() - t0
    golds = [p["answer"] for p in problems for _ in range(args.group)]
    rewards = torch.tensor([reward_fn(t, g) for t, g in zip(ro.texts, golds)])  # (N,) N = this rank's B*G rows
    # inference-mode tensors cannot enter autograd: take plain copies (small) for the update
    mask = ro.completion_mask.float().clone()  # (N, T)
    upd = policy_update(args, model, opt, params, ro.prompt_ids, ro.completion_ids.clone(), mask,
                        ro.logprobs.float().clone(), rewards)

    if upd["skipped"]:
        print(f"step {step + 1} | {upd['skipped']} | skipping this update (no weights changed)")
    # the step's numbers over all ranks: sums in one all_reduce, maxima in another
    reward_sum, correct_sum, ent_sum, tok_sum, trunc_sum = all_reduce([
        float(rewards.sum()), float((rewards >= 1.0).sum()), float((ro.entropy.float() * mask).sum()),
        float(mask.sum()), float((mask.sum(1) >= args.max_new_tokens).sum())])
    rows = upd["rows_all"]  # over all ranks, counted by the update
    t_sample_max, ratio_max = all_reduce([t_sample, upd["ratio_max"]], op="max")
    entropy = ent_sum / max(tok_sum, 1.0)
    if feedback is not None:
        feedback.update(entropy)  # the same global entropy on every rank: sigma stays in step
    return {"step": step + 1, "reward": reward_sum / rows, "acc": correct_sum / rows, "entropy": entropy,
            "kl": upd["kl"], "clip": upd["clip"], "len": tok_sum / rows, "sigma": sigma,
            "tok/s": tok_sum / max(t_sample_max, 1e-9), "s/step": time.time() - t0, "t_sample": t_sample_max,
            "loss": upd["loss"], "grad_norm": upd["grad_norm"], "lr": lr, "kl_old": upd["kl_old"],
            "ratio_max": ratio_max, "frac_zero_std": 1.0 - upd["kept_rows_all"] / rows, "truncated": trunc_sum / rows,
            "skipped": int(bool(upd["skipped"]))}


@contextlib.contextmanager
def grad_checkpointing(model, enabled=True):
    """Inside: activation checkpointing per decoder layer. A layer keeps only its input for backward
    and reruns its forward then, so the update holds one (rows, T, C) tensor per layer plus one
    layer's activations at a time, for the price of a second forward."""
    layers = list(model.model.layers) if enabled else []
    for layer in layers:  # an instance attribute wins over the class's forward, as in merged_sampling_weights
        layer.forward = lambda *a, f=layer.forward: torch.utils.checkpoint.checkpoint(f, *a, use_reentrant=False)
    try:
        yield model
    finally:
        for layer in layers:
            del layer.forward


def policy_update(args, model, opt, params, prompt_ids, ids, mask, old_logp, rewards):
    """--mu optimizer steps on this rank's rows; the gradient is summed over ranks first.

    prompt_ids: list of N token lists; ids, mask, old_logp (N, T) from the sampler; rewards (N,) in
    whole groups of args.group. Each rank's loss is divided by the *global* normaliser (tokens,
    sequences or rows summed over ranks), so it is exactly its share of the loss one process would
    compute on all rows, and the summed gradient is that process's gradient. Returns the global loss,
    gradient norm and clipping/KL statistics, this rank's and all ranks' count of kept rows and all
    ranks' count of rows; "skipped" says why no step was taken (non-finite loss or gradient), the same
    on every rank."""
    device = model_device(model)
    adv = group_advantages(rewards, args.group, scale_std=not args.no_std_scale).to(device)  # (N,)
    # Groups whose G rewards are all equal have zero advantage: they add nothing to the surrogate, so
    # the update (forward + backward, the larger half of a step) runs on the other rows only.
    keep = (rewards.view(-1, args.group).std(1) > 0).repeat_interleave(args.group)  # (N,)
    rows = keep.nonzero().squeeze(1).tolist()
    t_max = int(mask[rows].sum(1).max()) if rows else 0  # the kept rows may all be shorter than T
    k_ids, k_mask, k_old = ids[rows, :t_max], mask[rows, :t_max], old_logp[rows, :t_max]  # (n, t_max) each
    k_adv, k_prompts = adv[rows], [prompt_ids[i] for i in rows]
    k_tok = float(k_mask.sum())
    g_tok, g_seqs, g_kept, g_rows = all_reduce([k_tok, float((k_mask.sum(1) > 0).sum()), float(len(rows)),
                                                float(mask.shape[0])])
    denom = {"token-mean": max(g_tok, 1.0), "seq-mean-token-mean": max(g_seqs, 1.0),
             "seq-mean-token-sum-norm": g_rows * args.max_new_tokens}[args.loss_agg]
    out = {"loss": 0.0, "grad_norm": 0.0, "skipped": "", "clip": 0.0, "kl": float("nan"), "kl_old": float("nan"),
           "ratio_max": 1.0, "kept_rows": len(rows), "kept_rows_all": g_kept, "rows_all": g_rows}
    if g_kept == 0:  # no rank has a group with signal: nobody updates (a global decision)
        return out
    mb = args.micro_batch or max(len(rows), 1)  # rows per forward/backward
    for _ in range(args.mu):
        opt.zero_grad(set_to_none=True)
        # Micro-batches: each slice's loss is its share of the step's loss (the denominator is global),
        # so summing their gradients in .grad gives the all-rows gradient while only one slice's
        # activations are alive. The statistics are token means: weight each slice by its tokens.
        loss_sum, stats = 0.0, {"clip": 0.0, "kl": 0.0, "kl_old": 0.0, "ratio_max": 1.0}
        for i in range(0, len(rows), mb):
            j = slice(i, i + mb)
            t = int(k_mask[j].sum(1).max())  # this slice's longest completion
            s_ids, s_mask, s_old, s_prompts = k_ids[j, :t], k_mask[j, :t], k_old[j, :t], k_prompts[j]
            with grad_checkpointing(model, args.grad_checkpoint):
                logp, ent = rollout.sequence_logprobs(model, s_prompts, s_ids, s_mask,
                                                      temperature=args.temperature)  # (mb, t) each
            ref_logp = None
            if args.beta > 0:
                with torch.no_grad(), lora.lora_disabled(model):
                    ref_logp, _ = rollout.sequence_logprobs(model, s_prompts, s_ids, s_mask,
                                                            temperature=args.temperature)  # (mb, t)
            loss, st = grpo_loss(logp.float(), s_old, k_adv[j], s_mask, args.eps_low, args.eps_high, args.loss_agg,
                                 args.max_new_tokens, ref_logp, args.beta, ent.float(), args.entropy_coef,
                                 denom=denom)
            if torch.isfinite(loss):  # a non-finite loss skips the step below; its backward is wasted work
                loss.backward()
            loss_sum += float(loss.detach())
            w = float(s_mask.sum()) / max(k_tok, 1.0)
            for key in ("clip", "kl", "kl_old"):
                stats[key] += st[key] * w
            stats["ratio_max"] = max(stats["ratio_max"], st["ratio_max"])
        # the statistics are token means over this rank's kept rows: weight them by its share of tokens
        share = k_tok / max(g_tok, 1.0)
        loss_sum, out["clip"], out["kl"], out["kl_old"] = all_reduce([
            loss_sum, stats["clip"] * share, stats["kl"] * share, stats["kl_old"] * share])
        out["ratio_max"] = stats["ratio_max"]
        if not math.isfinite(loss_sum):  # the same verdict on every rank
            out["skipped"] = f"loss is {loss_sum}"
            break
        all_reduce_grads(params)
        grad_norm = float(torch.nn.utils.clip_grad_norm_(params, args.grad_clip))
        if not math.isfinite(grad_norm):
            out["skipped"] = f"gradient norm is {grad_norm}"
            break
        opt.step()
        out["loss"], out["grad_norm"] = loss_sum, grad_norm
    opt.zero_grad(set_to_none=True)
    return out


def checkpoint(args, step, model, opt, feedback, first_eval):
    bad = [p for p in lora.lora_parameters(model) if not torch.isfinite(p).all()]
    if bad:  # never write a broken checkpoint; the last good one stays
        print(f"checkpoint | step {step} | adapter has non-finite values | NOT saved")
        return None
    return save_checkpoint(args.out, step, model, opt, args, feedback, extra={"first_eval": first_eval})


def truncate_metrics(path, step):
    """On resume, drop metric lines past the checkpoint's step (a crash may have logged more)."""
    if not os.path.exists(path):
        return
    with open(path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    keep = [r for r in rows if r.get("step", r.get("eval", {}).get("step", 0)) <= step]
    write_lines(path, [json.dumps(r) for r in keep])


def clean(obj):
    """NaN/inf -> None, so the files are strict JSON."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [clean(v) for v in obj]
    return obj


def log_jsonl(path, rec):
    with open(path, "a") as f:
        f.write(json.dumps(clean(rec)) + "\n")


def write_lines(path, lines):
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write("".join(line + "\n" for line in lines))
    os.replace(tmp, path)


def write_json(path, obj):
    write_lines(path, [json.dumps(clean(obj), indent=2)])


def fmt(x):
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.4f}"


def validate_args(args):
    if args.batch < 1 or args.group < 2:
        raise ValueError(f"need --batch >= 1 and --group >= 2 (got {args.batch}, {args.group}): GRPO compares "
                         f"samples within a group")
    if args.loss_agg not in LOSS_AGGS:
        raise ValueError(f"unknown --loss-agg {args.loss_agg!r}; choose one of {', '.join(LOSS_AGGS)}")
    if args.steps < 1 or args.mu < 1:
        raise ValueError(f"need --steps >= 1 and --mu >= 1 (got {args.steps}, {args.mu})")
    if args.micro_batch < 0:
        raise ValueError(f"need --micro-batch >= 0 (0: all rows at once), got {args.micro_batch}")
    if args.aqn and args.aqn_kind != "feedback":
        aqn.check_sigma_range(args.sigma_start, args.sigma_end, args.aqn_kind)

# -----------------------------------------------------------------------------
# CLI


def build_parser():
    p = argparse.ArgumentParser(description="GRPO with LoRA on a quantized base and AQN (QeRL)")
    # model and data
    p.add_argument("--model", default=TINY_MODEL, help="Hugging Face model folder (default: the bundled tiny model)")
    p.add_argument("--data", default="arith", help="'arith' (synthetic) or a GSM8K-style JSONL file")
    p.add_argument("--eval-data", default=None, help="held-out JSONL (default: a slice of --data is held out)")
    p.add_argument("--digits", type=int, default=3, help="arith: max digits per operand")
    p.add_argument("--nops", type=int, default=2, help="arith: number of operations")
    p.add_argument("--system", choices=("auto", "paper", "none"), default="auto",
                   help="system prompt: the paper's instruction, none, or auto (the instruction unless "
                   "config.json says \"qerl_prompt\": \"bare\", as the bundled model's does)")
    p.add_argument("--quant", choices=("nvfp4", "nf4", "none"), default="nvfp4")
    p.add_argument("--device", default=None, help="cpu / cuda (default: autodetect)")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None,
                   help="activation dtype (default: bfloat16 on CUDA, float32 on CPU)")
    # AQN
    p.add_argument("--aqn", action=argparse.BooleanOptionalAction, default=True, help="adaptive quantization noise")
    p.add_argument("--aqn-kind", default="exp", choices=aqn.SIGMA_KINDS)
    p.add_argument("--sigma-start", type=float, default=1e-2)
    p.add_argument("--sigma-end", type=float, default=5e-4)
    p.add_argument("--num-stages", type=int, default=10)
    p.add_argument("--target-entropy", type=float, default=0.15, help="aqn-kind feedback: entropy to hold")
    # GRPO
    p.add_argument("--steps", type=int, default=750, help="planned steps (sets the LR and AQN schedules)")
    p.add_argument("--batch", type=int, default=16, help="prompts per step")
    p.add_argument("--group", type=int, default=8, help="samples per prompt (G)")
    p.add_argument("--max-new-tokens", type=int, default=42)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--eps-low", type=float, default=0.2)
    p.add_argument("--eps-high", type=float, default=0.28)
    p.add_argument("--loss-agg", default="token-mean", choices=LOSS_AGGS)
    p.add_argument("--no-std-scale", action="store_true", help="advantage r - mean only (Dr. GRPO)")
    p.add_argument("--mu", type=int, default=1, help="policy updates per batch")
    p.add_argument("--beta", type=float, default=0.0, help="k3 KL to the base (reference) policy")
    p.add_argument("--entropy-coef", type=float, default=0.0, help="entropy bonus coefficient")
    # memory (the update at real scale; README "Scaling out")
    p.add_argument("--micro-batch", type=int, default=0, help="rows per forward/backward of the update, "
                   "gradients accumulated before the one optimizer step (0: all rows at once)")
    p.add_argument("--grad-checkpoint", action="store_true", help="activation checkpointing per decoder layer "
                   "in the update (less memory, one more forward)")
    p.add_argument("--gpu-path", action="store_true", help="on the CPU, run what CUDA runs: NVFP4Linear through "
                   "the Triton kernel (interpreted), no merged sampling weights, bfloat16 by default")
    # optimisation
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup", type=int, default=10, help="warmup steps")
    p.add_argument("--min-lr-ratio", type=float, default=0.1, help="cosine decays to this fraction of --lr")
    p.add_argument("--grad-clip", type=float, default=1.0)
    p.add_argument("--lora-r", type=int, default=16)
    p.add_argument("--lora-alpha", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    # evaluation, output
    p.add_argument("--eval-size", type=int, default=500, help="held-out problems (0: no evaluation)")
    p.add_argument("--eval-every", type=int, default=100, help="greedy evaluation every N steps")
    p.add_argument("--eval-k", type=int, default=8, help="pass@k at --temperature at the start and end (0: off)")
    p.add_argument("--eval-chunk", type=int, default=1024, help="rows per generate() call in evaluation")
    p.add_argument("--out", default=None, help="run folder (default runs/<timestamp>)")
    p.add_argument("--resume", default=None, help="checkpoint (or run) folder to continue exactly")
    p.add_argument("--save-every", type=int, default=100)
    p.add_argument("--time-budget", type=float, default=540, help="stop after this many seconds incl. the "
                   "final evaluation (0: no limit)")
    p.add_argument("--stop-at", type=int, default=0, help="stop after this step with a checkpoint, as if "
                   "interrupted (for testing --resume)")
    p.add_argument("--quiet", action="store_true", help="no per-step lines")
    return p


if __name__ == "__main__":
    try:
        train(build_parser().parse_args())
    except (FileNotFoundError, ValueError) as e:
        sys.exit(f"error: {e}")
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
