"""Beside stage 05: what its loop calls that is not the paper's method. The policy's log-probs before an update
(--mu > 1), the step's check after it (kl_after, divergence), DAPO's dynamic sampling (--dynamic-sampling:
refill_flat_groups, take_groups), pass@k in the held-out evaluation, --gpu-path, and the fast paths a run takes
(its first log line names them). It imports stages 01 and 03 and the modules beneath, never 05: what it needs of 05
comes in as arguments.
"""
import os
import sys

import torch

from qerl import devices
from qerl import distributed
from qerl import quant_engine

from qerl import quantize
from qerl import rollout


def sampling_options(args):
    """05's sample_groups' keyword arguments from the command line (but rank and draw): its loop's, a bench's."""
    return {"group": args.group, "max_new_tokens": args.max_new_tokens, "temperature": args.temperature,
            "seed": args.seed, "compiled": args.compile, "noise": args.aqn_scale, "site": args.aqn_site}


def policy_logprobs(model, prompts, ids, mask, slices, temperature):
    """The current policy's log-probs (n, T) of the given rows, without gradients, a slice of rows at a time."""
    out = torch.zeros(ids.shape, dtype=torch.float32, device=ids.device)  # (n, T)
    with torch.no_grad():
        for part in slices:
            t = int(mask[part].sum(1).max())
            logp, _ = rollout.sequence_logprobs(model, prompts[part], ids[part, :t], mask[part, :t],
                                                temperature=temperature, entropy=False)  # (mb, t)
            out[part, :t] = logp.float()
    return out


@torch.no_grad()
def check_step(step, model, params, samples, mask, report, temperature, rows=16):
    """After a step's update -> {"kl_after": how far the update moved the policy from the one that sampled,
    the k3 estimate of KL(sampler || updated policy) per token over the first `rows` rows of each rank}, and
    "diverged": why, when the sampler's log-probs, the loss, the gradient or an adapter weight is not finite.
    runs.RunLog.step ends the run on "diverged" and names a kl_after beyond runs.DIVERGED_KL."""
    m = mask[:rows].to(samples.logprobs.device)  # (r, T)
    bad_samples = not bool(torch.isfinite(samples.logprobs[mask.to(samples.logprobs.device) > 0]).all())
    kl_sum = 0.0
    if m.sum() > 0 and not bad_samples and not report["skipped"]:
        logp, _ = rollout.sequence_logprobs(model, samples.prompt_ids[:rows], samples.completion_ids[:rows], m,
                                            temperature=temperature, entropy=False)  # (r, T)
        d = logp.float() - samples.logprobs[:rows].float()  # (r, T) log of pi_updated / pi_sampler
        kl_sum = float(((torch.exp(d) - 1 - d) * m).sum())
    kl_sum, tokens, bad_samples = distributed.global_sum([kl_sum, float(m.sum()), bad_samples])
    why = ("the sampler's log-probs are not finite (its logits overflowed: is --sigma-start far too large?)"
           if bad_samples else f"the {report['skipped']}" if report["skipped"] else
           "an adapter weight is not finite" if not all(bool(torch.isfinite(p).all()) for p in params) else None)
    kl_after = kl_sum / tokens if tokens and not why else float("nan")
    return {"kl_after": kl_after, **({"diverged": why} if why else {})}


def refill_flat_groups(args, task, model, tok, step, sigma, rank, world, problems, samples, rewards, correct,
                       *, sample_groups, score, sampling):
    """DAPO's dynamic sampling (--dynamic-sampling N): a group whose G rewards all tie has zero advantage and
    trains nothing, so up to N more rounds replace such groups with groups whose rewards differ, and the batch
    keeps its size. Round r samples (draw r, under the step's one noise draw) this rank's share of the step's
    next --batch problems, problems(seed, step, B (r + 1))[B r:] (prefix-stable, so fresh ones), as many as it
    has flat groups; a group still flat after N rounds stays. Every draw is a function of (seed, step, r): a
    resumed run refills as an uninterrupted one. sample_groups, score: 05's; sampling: its keyword arguments.
    -> (problems, samples, rewards, correct) of the batch that trains, and {ds_rounds: rounds taken (the most
    of any rank), ds_flat_before: flat groups before refilling, ds_sampled: groups the rounds sampled}."""
    G, B = args.group, args.batch

    def flat_of(r):  # rewards (n*G,) -> n bools: whether each group's rewards all tie
        return (r.view(-1, G).std(1) == 0).tolist()
    flat = [g for g, f in enumerate(flat_of(rewards)) if f]  # this rank's flat groups, to replace in order
    picks, problems, flat_before, rounds = [(samples, g) for g in range(len(problems))], list(problems), len(flat), 0
    sampled = 0  # groups sampled by the refill rounds (--max-completions counts them)
    while flat and rounds < args.dynamic_sampling:
        rounds += 1
        more = distributed.shard(task.problems(args.seed, step, B * (rounds + 1))[B * rounds:], rank, world)
        more = more[:len(flat)]
        sampled += len(more)
        new, _ = sample_groups(model, tok, [tok.encode(task.prompt(p)) for p in more], step, sigma, rank=rank,
                               draw=rounds, **sampling)
        for g, is_flat in enumerate(flat_of(score(task, more, new.texts, G)[0])):
            if not is_flat:
                slot = flat.pop(0)
                picks[slot], problems[slot] = (new, g), more[g]
    if rounds:  # the trained batch: its groups in slot order, scored once more as one batch
        samples = take_groups(picks, G, tok.pad_token_id)
        rewards, correct = score(task, problems, samples.texts, G)
    record = {"ds_rounds": int(distributed.global_sum([rounds], op="max")[0]),
              "ds_flat_before": int(distributed.global_sum([flat_before])[0]),
              "ds_sampled": int(distributed.global_sum([sampled])[0])}
    return problems, samples, rewards, correct, record


@torch.inference_mode()
def take_groups(picks, group, pad_id):
    """One Rollout of whole groups, picks[i] = (a Rollout, a group index in it), its tensors padded to the longest
    completion (completion_ids with pad_id, the rest with 0: outside the mask)."""
    T = max(r.completion_ids.shape[1] for r, _ in picks)
    rows = [(r, slice(g * group, (g + 1) * group)) for r, g in picks]

    def cat(field, value=0):
        parts = [getattr(r, field)[s] for r, s in rows]  # (G, T_r) each
        return torch.cat([torch.nn.functional.pad(t, (0, T - t.shape[1]), value=value) for t in parts])  # (N, T)
    return rollout.Rollout(prompt_ids=[p for r, s in rows for p in r.prompt_ids[s]],
                           completion_ids=cat("completion_ids", pad_id or 0), completion_mask=cat("completion_mask"),
                           logprobs=cat("logprobs"), entropy=cat("entropy"),
                           texts=[t for r, s in rows for t in r.texts[s]])


def pass_at_k(model, tok, task, problems, max_new_tokens, k, temperature, seed, chunk=512, compiled=False):
    """k samples a problem at `temperature` (a generator seeded by `seed`) -> pass@1 (the mean over the k
    samples) and pass@k (any of k correct), with their counts; under torchrun every rank's counts, summed.
    05's evaluate_pass_k runs it on its merged sampling weights, after the greedy evaluation."""
    prompts, texts, step = [tok.encode(task.prompt(p)) for p in problems], [], max(1, chunk // k)
    generator = torch.Generator(device=devices.model_device(model)).manual_seed(seed)
    for i in range(0, len(prompts), step):  # `chunk` rows a generate() call
        texts += rollout.generate(model, prompts[i:i + step], num_samples=k, max_new_tokens=max_new_tokens,
                                  temperature=temperature, eos_token_ids=tok.eos_token_ids, generator=generator,
                                  tokenizer=tok, compiled=compiled).texts
    hits = [[task.correct(p, texts[i * k + j]) for j in range(k)] for i, p in enumerate(problems)]
    n, sampled, passed = map(int, distributed.global_sum([len(problems), sum(map(sum, hits)), sum(map(any, hits))]))
    return {"k": k, "sample_correct": sampled, "pass_k_correct": passed, "pass@1": sampled / max(k * n, 1),
            f"pass@{k}": passed / max(n, 1)}


def fast_paths(model, device, compiled, merged):
    """The names of the fast paths this run takes, each computing what the stages' Part 1 reads (a test shows
    each equal): merged-sampling (02's lora_merged, `merged`: 05's merge_for_sampling), kept-dequantized (01's
    keep_dequantized), fast-forward (01's _QuantLinear.fast), nvfp4-kernel (the Triton kernel: CUDA or
    --gpu-path), compiled-step (--compile), decode-attention-cpu and chunked-logprobs (03's switches)."""
    quantized = [m for m in model.modules() if isinstance(m, quant_engine.FrozenQuantLinear)]
    on_cpu = torch.device(device).type == "cpu"
    kernel = any(m.fast and isinstance(m, quantize.NVFP4Linear) and (not on_cpu or m.kernel_on_cpu)
                 for m in quantized) and quantize.nvfp4_kernel() is not None
    used = {"merged-sampling": merged,
            "kept-dequantized": any(m.kept is not None for m in quantized),
            "fast-forward": any(m.fast for m in quantized),
            "nvfp4-kernel": kernel,
            "compiled-step": compiled,
            "decode-attention-cpu": on_cpu and getattr(rollout, "DECODE_ATTENTION_CPU", True),
            "chunked-logprobs": getattr(rollout, "CHUNKED_LOGPROBS", True)}
    return [name for name, on in used.items() if on]


# The switches --plain turns off, each (owner, attribute): the one list use_plain_path and the tests' fixture read
PLAIN_SWITCHES = ((quantize._QuantLinear, "fast"), (rollout, "DECODE_ATTENTION_CPU"), (rollout, "CHUNKED_LOGPROBS"))


def use_plain_path():
    """--plain: the stages' plain computations (what 05_grpo.py runs) in place of the trainer's fast forward, CPU
    decode attention and chunked log-probs; merged sampling and the kept dequantized weight stay (05 has them)."""
    for owner, name in PLAIN_SWITCHES:
        setattr(owner, name, False)


def use_gpu_path(device):
    """--gpu-path: run CUDA's code path (NVFP4Linear through the Triton kernel) on any device."""
    if torch.device(device).type == "cpu":
        if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError("--gpu-path on the CPU runs the Triton kernel under the interpreter, which must be "
                             "on before triton is imported: set TRITON_INTERPRET=1 in the environment")
        os.environ["TRITON_INTERPRET"] = "1"
    if quantize.nvfp4_kernel() is None:
        raise ValueError("--gpu-path needs triton (pip install triton; Linux only)")
    quantize.NVFP4Linear.kernel_on_cpu = True
