"""Stage 05: GRPO with LoRA on an NVFP4 base, with Adaptive Quantization Noise: the QeRL loop.

A step: B prompts x G samples of the 4-bit base + LoRA under AQN's noise (stages 01-04) -> rewards
-> group advantages -> the clipped surrogate on the clean policy -> one AdamW step on the adapters.
The task is the bundled tiny model's: synthetic arithmetic ("63-4-597=?"), answered as
<think> steps </think><answer> number </answer>. Greedy accuracy on held-out problems is measured
at the start, every --eval-every steps and at the end; each step prints one line. The run folder
(--out) gets metrics.jsonl (a record per step), summary.json and the adapter as PEFT's files.

    python 05_grpo.py              # the tiny model learns arithmetic (~6 min on 2 CPU cores)
    python 05_grpo.py --steps 5    # a quick look: trains, evaluates and saves

The full trainer (the variants, other tasks, checkpoints and --resume, torchrun, --show-step, which
works one group by hand) computes the same numbers: python -m qerl.train --plain.
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
import shlex
import sys
import time
from fractions import Fraction

import torch

lora = importlib.import_module("02_lora")
rollout = importlib.import_module("03_rollout")
aqn = importlib.import_module("04_aqn")

# ---- The task: synthetic arithmetic, qerl/tasks.py's default (same problems, prompts, rewards)
EVAL_SEED, EVAL_POOL = 1234, 2000  # the held-out stream: its first 2000 questions never train
PAPER_INSTRUCTION = (
    "Solve the following math problem step by step. The reasoning process and direct answer are "
    "enclosed within <think> </think> and <answer> </answer> tags, respectively, i.e., "
    "<think> reasoning process here </think> <answer> answer here </answer>."
)
NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")
STOP_TOKENS = re.compile(r"<\|im_end\|>|<\|endoftext\|>")  # a decoded stop token is no text
# the reward's format: exactly one think block, then one answer block, whitespace around them
FORMAT = re.compile(
    r"\s*<think>((?!</?think>).)*</think>\s*<answer>((?!</?answer>).)*</answer>\s*", re.S
)


def make_problem(rng, digits=3, nops=2):
    """`a op b op c =?` from a random.Random, worked left to right -> {question, answer}."""

    def operand():  # the digit count is drawn first: small numbers are as common as large ones
        d = rng.randint(1, digits)
        return rng.randint(0 if d == 1 else 10 ** (d - 1), 10**d - 1)

    nums = [operand() for _ in range(nops + 1)]
    ops = [rng.choice("+-") for _ in range(nops)]
    answer = nums[0]
    for op, n in zip(ops, nums[1:]):
        answer = answer + n if op == "+" else answer - n
    question = str(nums[0]) + "".join(op + str(n) for op, n in zip(ops, nums[1:])) + "=?"
    return {"question": question, "answer": answer}


def arithmetic_problems(n, seed, exclude=frozenset()):
    """The first n distinct problems of the stream `seed` whose questions are not in `exclude`."""
    rng, seen, out = random.Random(seed), set(exclude), []
    while len(out) < n:
        p = make_problem(rng)
        if p["question"] not in seen:
            seen.add(p["question"])
            out.append(p)
    return out


def held_out(eval_size):
    """-> (the held-out pool's first eval_size problems, all its questions: they never train)."""
    pool = arithmetic_problems(max(EVAL_POOL, eval_size), EVAL_SEED)
    return pool[:eval_size], frozenset(p["question"] for p in pool)


def problems(seed, step, n, exclude):  # a step's training problems: a pure function of (seed, step)
    return arithmetic_problems(n, seed * 1_000_003 + step, exclude)


def prompt(problem, system=None):  # ChatML; the bundled model's config says "qerl_prompt": "bare"
    return rollout.chat_prompt(problem["question"], system)


def answer_of(text):
    """The last number in the last <answer>...</answer> block, as an exact Fraction, or None."""
    blocks = re.findall(r"<answer>(.*?)</answer>", STOP_TOKENS.sub("", text), re.S)
    found = NUMBER.findall(blocks[-1]) if blocks else []
    number = found[-1].replace(",", "") if found else ""  # "1,200.50" -> 2401/2
    return Fraction(number) if 0 < len(number) <= 100 else None


def correct(problem, text):
    return answer_of(text) == problem["answer"]  # None never equals an int


def reward(problem, text):  # 1 if correct, + 0.1 for the format (and a number in the answer)
    formatted = FORMAT.fullmatch(STOP_TOKENS.sub("", text)) and answer_of(text) is not None
    return float(correct(problem, text)) + (0.1 if formatted else 0.0)


# ---- The policy: the frozen NVFP4 base (01, via 03's loader), fresh LoRA (02), AdamW on LoRA
def build_policy(args, device):
    """-> (model, tok, params, opt); the adapters depend on --seed alone."""
    dtype = torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    model, tok = rollout.load_model(args.model, quant="nvfp4", dtype=dtype, device=device)
    generator = torch.Generator().manual_seed(args.seed)
    lora.add_lora(model, r=args.lora_r, alpha=args.lora_alpha, generator=generator)
    params = lora.lora_parameters(model)
    opt = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.99), weight_decay=0.0)
    return model, tok, params, opt


def lr_factor(step, warmup, total, min_ratio):  # linear warmup, then cosine decay to min_ratio
    if step < warmup:
        return (step + 1) / warmup
    u = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * u))


def step_sigma(args, step):  # AQN's noise at `step`: 04's schedule (the official code's)
    if not args.aqn:
        return 0.0
    return aqn.sigma_schedule(step, args.steps, args.sigma_start, args.sigma_end, args.num_stages)


# ---- Sampling under AQN (noise on the RMSNorm gains, stage 04), rewards and group advantages
def merged_weights(model):
    # a CPU samples on merged W + s B A (02's lora_merged): one matmul a layer, not three
    cpu = next(model.parameters()).device.type == "cpu"
    return lora.lora_merged(model) if cpu else contextlib.nullcontext(model)


def sample_groups(model, tok, prompts, step, sigma, args):
    """-> (03's Rollout: G completions a prompt, prompt-major; the RMS of AQN's noise)."""
    device = next(model.parameters()).device
    gen = torch.Generator(device=device).manual_seed(args.seed * 1_000_003 + step)
    # one generator: the noise is drawn first, then the samples
    with torch.inference_mode(), aqn.aqn_noise(model, sigma, gen) as noisy, merged_weights(model):
        samples = rollout.generate(
            model,
            prompts,
            num_samples=args.group,
            max_new_tokens=args.max_new_tokens,
            temperature=args.temperature,
            eos_token_ids=tok.eos_token_ids,
            generator=gen,
            tokenizer=tok,
        )
    return samples, noisy["applied_std"]


def score(problems, texts, group):  # each completion's reward (N,), how many are correct
    rows = [p for p in problems for _ in range(group)]  # (N,) the problem of each row
    rewards = torch.tensor([reward(p, text) for p, text in zip(rows, texts)])  # (N,)
    return rewards, sum(correct(p, text) for p, text in zip(rows, texts))


def group_advantages(rewards, group, eps=1e-4):
    """rewards (B*G,) prompt-major -> (r - group mean) / (group std + eps)."""
    r = rewards.float().view(-1, group)  # (B, G)
    adv = r - r.mean(dim=1, keepdim=True)  # (B, G)
    return (adv / (r.std(dim=1, keepdim=True) + eps)).reshape(-1)  # (B*G,)


# ---- The loss: the clipped surrogate with clip-higher, token-mean
def grpo_loss(logp, old_logp, adv, mask, eps_low=0.2, eps_high=0.28):
    """The clipped surrogate to minimise and the fraction of tokens clipped. pi_old is the clean
    policy being trained (old_logp = logp.detach(), the official code's): at one update per batch
    (the trainer's --mu 1) the ratio is 1 and the gradient is REINFORCE's, -mean_t A grad log
    pi_theta, with the group's mean reward as the baseline. AQN's noisy sampler is not corrected
    for here; the trainer's `--pi-old sampler` puts the sampler's log-probs in old_logp: a
    per-token first-order correction (qerl/train.py)."""
    low, high = 1 - eps_low, 1 + eps_high  # DAPO's clip-higher leaves a rare token room to rise
    ratio = torch.exp(logp - old_logp)  # (N, T) pi_theta / pi_old per token
    a = adv.view(-1, 1)  # (N, 1)
    surr = torch.minimum(ratio * a, ratio.clamp(low, high) * a)  # (N, T)
    # token-mean (DAPO's): a long answer weighs more
    loss = (-surr * mask).sum() / max(float(mask.sum()), 1.0)
    with torch.no_grad():  # clipped: the clamp, not the ratio, sets the surrogate (no gradient)
        clipped = ((ratio < low) & (a < 0)) | ((ratio > high) & (a > 0))  # (N, T)
        clip = float((clipped.float() * mask).sum() / mask.sum().clamp(min=1))
    return loss, clip


def policy_update(model, opt, params, samples, rewards, args):
    """One AdamW step on the groups with signal -> {loss, grad_norm, clip, frac_zero_std}."""
    G, device = args.group, next(model.parameters()).device
    adv = group_advantages(rewards, G).to(device)  # (N,)
    # copies: the sampler's tensors are inference-mode ones, which autograd cannot save
    ids, mask = samples.completion_ids.clone(), samples.completion_mask.float().clone()  # (N, T)
    # a group of equal rewards (zero advantage) and a row without tokens: nothing to train
    has_signal = (rewards.view(-1, G).std(1) > 0).repeat_interleave(G)  # (N,)
    rows = (has_signal & (mask.sum(1) > 0)).nonzero().squeeze(1).tolist()
    out = {"loss": 0.0, "grad_norm": 0.0, "clip": 0.0}
    out["frac_zero_std"] = float((~has_signal).sum()) / len(rewards)
    if not rows:
        return out
    t = int(mask[rows].sum(1).max())  # their longest completion
    ids, mask, adv = ids[rows, :t], mask[rows, :t], adv[rows]  # (n, t), (n, t), (n,)
    prompts = [samples.prompt_ids[i] for i in rows]
    opt.zero_grad(set_to_none=True)
    logp, _ = rollout.sequence_logprobs(
        model, prompts, ids, mask, temperature=args.temperature, entropy=False
    )
    logp = logp.float()  # (n, t)
    loss, out["clip"] = grpo_loss(logp, logp.detach(), adv, mask)
    loss.backward()
    out["grad_norm"] = float(torch.nn.utils.clip_grad_norm_(params, 1.0))
    opt.step()
    opt.zero_grad(set_to_none=True)
    out["loss"] = float(loss.detach())
    return out


# ---- Evaluation: the clean policy (no AQN noise), greedy, on the held-out problems
@torch.inference_mode()
def evaluate(model, tok, held, max_new_tokens, system=None):
    """-> greedy pass@1 and the answers' mean reward (partial credit)."""
    prompts = [tok.encode(prompt(p, system)) for p in held]
    with merged_weights(model):
        texts = rollout.generate(
            model,
            prompts,
            max_new_tokens=max_new_tokens,
            temperature=0.0,
            eos_token_ids=tok.eos_token_ids,
            tokenizer=tok,
        ).texts
    right, total = sum(map(correct, held, texts)), sum(map(reward, held, texts))
    n = max(len(held), 1)
    return {
        "n": len(held),
        "greedy_correct": right,
        "greedy": right / n,
        "greedy_reward": total / n,
    }


def append_line(path, record):  # one line of metrics.jsonl
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


# ---- The run: each step's LR, sigma, samples, rewards, update, log line; evaluations; the files
def train(args):
    """The GRPO run -> its summary (<out>/summary.json; metrics.jsonl and the adapter beside)."""
    t_start = time.time()
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    out = args.out or os.path.join("runs", datetime.datetime.now().strftime("%Y%m%d-%H%M%S"))
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(args.model, "config.json")) as f:  # the bundled model's prompt is bare
        system = None if json.load(f).get("qerl_prompt") == "bare" else PAPER_INSTRUCTION
    held, exclude = held_out(args.eval_size)
    model, tok, params, opt = build_policy(args, device)
    metrics = os.path.join(out, "metrics.jsonl")
    open(metrics, "w").close()  # a record a line: each step's, each evaluation's

    def held_out_eval(step):
        t0 = time.time()
        res = evaluate(model, tok, held, args.max_new_tokens, system) if held else None
        if res:
            res.update(step=step, seconds=time.time() - t0, time=time.time() - t_start)
            print(
                f"eval | step {step} | n {res['n']} | greedy {res['greedy']:.3f} | "
                f"reward {res['greedy_reward']:.3f} | {res['seconds']:.1f}s"
            )
            append_line(metrics, {"eval": res})
        return res

    first_eval = last_eval = held_out_eval(0)
    for step in range(args.steps):
        t0 = time.time()
        lr = args.lr * lr_factor(step, args.warmup, args.steps, args.min_lr_ratio)
        for param_group in opt.param_groups:
            param_group["lr"] = lr
        sigma = step_sigma(args, step)
        batch = problems(args.seed, step, args.batch, exclude)
        prompts = [tok.encode(prompt(p, system)) for p in batch]
        samples, sigma_applied = sample_groups(model, tok, prompts, step, sigma, args)
        t_sample = time.time() - t0
        rewards, right = score(batch, samples.texts, args.group)  # (N,), a count
        mask, N = samples.completion_mask.float(), len(rewards)  # (N, T)
        eos = torch.tensor(tok.eos_token_ids, device=mask.device)
        truncated = ~(torch.isin(samples.completion_ids, eos) & (mask > 0)).any(1)  # (N,) no EOS
        report = policy_update(model, opt, params, samples, rewards, args)
        tokens = float(mask.sum())
        rec = {
            "step": step + 1,
            "reward": float(rewards.sum()) / N,
            "acc": right / N,
            "entropy": float((samples.entropy.float() * mask).sum()) / max(tokens, 1),
            "len": tokens / N,
            "sigma": sigma,
            "sigma_applied": sigma_applied,
            **report,
            "truncated": float(truncated.sum()) / N,
            "tok/s": tokens / max(t_sample, 1e-9),
            "s/step": time.time() - t0,
            "lr": lr,
            "time": time.time() - t_start,
        }
        append_line(metrics, rec)
        print(
            f"step {step + 1}/{args.steps} | reward {rec['reward']:.3f} | acc {rec['acc']:.3f} | "
            f"entropy {rec['entropy']:.3f} | loss {rec['loss']:.4f} | "
            f"grad_norm {rec['grad_norm']:.3f} | clip {rec['clip']:.4f} | len {rec['len']:.1f} | "
            f"sigma {sigma:.2e} | lr {lr:.2e} | tok/s {rec['tok/s']:.0f} | "
            f"s/step {rec['s/step']:.2f}",
            flush=True,
        )
        if args.eval_every and (step + 1) % args.eval_every == 0 and step + 1 < args.steps:
            last_eval = held_out_eval(step + 1)
    last_eval = held_out_eval(args.steps) if args.steps else last_eval
    lora.save_adapter(model, out, args.model)  # PEFT's adapter_model.safetensors and config
    summary = {
        "steps_done": args.steps,
        "wall_s": time.time() - t_start,
        "first_eval": first_eval,
        "final_eval": last_eval,
        "args": {**vars(args), "out": out},
    }
    gain = ""
    if first_eval and last_eval:
        summary["greedy_gain"] = last_eval["greedy"] - first_eval["greedy"]
        gain = (
            f" | greedy {first_eval['greedy']:.3f} -> {last_eval['greedy']:.3f} "
            f"({100 * summary['greedy_gain']:+.1f} points)"
        )
    with open(os.path.join(out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    print(f"summary | steps {args.steps}{gain} | wall {summary['wall_s']:.0f}s | out {out}")
    return summary


# ---- The command line: the trainer's names and defaults; its other flags belong to it
TRAINER_FLAGS = set(
    """--quant --pi-old --task --data --eval-data --digits --nops --system --aqn-kind --aqn-scale
    --aqn-site --target-entropy --train-norms --eps-low --eps-high --loss-agg --no-std-scale --mu
    --tis-cap --beta --entropy-coef --dynamic-sampling --mask-truncated --grad-clip --dtype
    --quant-method --compile --micro-batch --grad-checkpoint --dist-timeout --plain --gpu-path
    --eval-k --eval-chunk --resume --save-every --time-budget --stop-at --quiet --kl-after-rows
    --show-step --max-completions --ratio-level""".split()
)
TINY_MODEL = os.path.join(os.path.dirname(os.path.abspath(__file__)), "assets", "tiny-qwen")


def build_parser():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    p.add_argument("--model", default=TINY_MODEL, help="Hugging Face model folder")
    p.add_argument("--steps", type=int, default=750, help="planned steps (LR and AQN schedules)")
    p.add_argument("--batch", type=int, default=16, help="prompts per step")
    p.add_argument("--group", type=int, default=8, help="samples per prompt (G)")
    p.add_argument("--max-new-tokens", type=int, default=42)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup", type=int, default=10, help="warmup steps")
    p.add_argument("--min-lr-ratio", type=float, default=0.1, help="cosine decays to this x --lr")
    p.add_argument("--lora-r", type=int, default=16)
    p.add_argument("--lora-alpha", type=int, default=32)
    p.add_argument("--aqn", action=argparse.BooleanOptionalAction, default=True, help="AQN noise")
    p.add_argument("--sigma-start", type=float, default=1e-2, help="AQN's first noisy stage")
    p.add_argument("--sigma-end", type=float, default=5e-4, help="AQN's last stage")
    p.add_argument("--num-stages", type=int, default=10, help="AQN's stages (the first: no noise)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--eval-size", type=int, default=500, help="held-out problems (0: none)")
    p.add_argument("--eval-every", type=int, default=100, help="evaluate every N steps (0: ends)")
    p.add_argument("--out", default=None, help="run folder (default runs/<timestamp>)")
    p.add_argument("--device", default=None, help="cpu / cuda (default: autodetect)")
    return p


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    theirs = [a.split("=")[0] for a in rest if a.split("=")[0] in TRAINER_FLAGS]
    if theirs:  # one line, the command to run instead
        raise SystemExit(
            f"05_grpo.py: {theirs[0]} is a trainer flag (qerl/train.py has the variants, "
            f"other tasks, --resume, --show-step): python -m qerl.train {shlex.join(argv)}"
        )
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    train(args)


if __name__ == "__main__":
    main()
