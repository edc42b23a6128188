"""Beside stage 05: its command line (build_parser). It imports stages 01 and 04 and the modules beneath,
never 05: 05 passes itself in (`stage`), whose registries (PI_OLD, LOSS_AGGS, RATIOS) give the choices of their
flags.
"""
import argparse

from qerl import cli
from qerl import devices
from qerl import distributed
from qerl import memory
from qerl import run_checks
from qerl import tasks

from qerl import quantize
from qerl import aqn


def build_parser(stage):
    """05's command line; `stage` is 05 (its registries, option defaults and bundled model)."""
    N = cli.number  # each number's allowed range: what makes no sense is refused before any work
    p = cli.ArgumentParser(description="GRPO with LoRA on a quantized base and AQN (QeRL). The first group "
                           "defines QeRL; the rest have defaults that work.")
    # when a flag is read (add_flag's read_when): a run without it refuses the flag
    with_aqn = (lambda args: args.aqn, "--aqn")
    noisy = (lambda args: args.aqn and args.aqn_kind != "none", "--aqn with an --aqn-kind other than none")
    decaying = (lambda args: args.aqn and args.aqn_kind in aqn.DECAYING_KINDS, "--aqn with a decaying --aqn-kind")
    unsized = " or ".join(k for k, site in aqn.SITES.items() if not site.sized)  # 04 SITES: a draw's size is fixed
    sized = (lambda args: noisy[0](args) and aqn.SITES[args.aqn_site].sized,
             noisy[1] + (f", at an --aqn-site other than {unsized}" if unsized else ""))
    q = p.add_argument_group("QeRL: the model, its 4-bit base, LoRA, AQN, pi_old and the GRPO batch")
    q.add_argument("--model", default=stage.TINY_MODEL, help="Hugging Face model folder (default: the bundled tiny model)")
    q.add_argument("--quant", choices=quantize.quant_choices(), default="nvfp4", help="the frozen base's format")
    q.add_argument("--lora-r", type=N(int, 1), default=16)
    q.add_argument("--lora-alpha", type=N(int, 1), default=32)
    q.add_argument("--aqn", action=argparse.BooleanOptionalAction, default=True, help="adaptive quantization noise")
    run_checks.add_flag(q, "--sigma-start", type=N(above=0), default=1e-2, help="AQN's noise in its first noisy stage",
             read_when=noisy)
    run_checks.add_flag(q, "--sigma-end", type=N(above=0), default=5e-4, help="AQN's noise in its last stage", read_when=decaying)
    run_checks.add_flag(q, "--num-stages", type=N(int, 1), default=10, help="AQN's stages (the first adds no noise)",
             read_when=decaying)
    q.add_argument("--pi-old", choices=list(stage.PI_OLD), default=stage.UpdateOptions.pi_old, help="pi_old in the ratio: "
                   + "; ".join(f"{k}: {v.help}" for k, v in stage.PI_OLD.items()))
    q.add_argument("--steps", type=N(int, 1), default=750, help="planned steps (sets the LR and AQN schedules)")
    q.add_argument("--batch", type=N(int, 1), default=16, help="prompts per step")
    q.add_argument("--group", type=N(int, 2), default=8, help="samples per prompt (G)")
    q.add_argument("--lr", type=N(above=0), default=1e-3)
    t = p.add_argument_group("task and data")
    t.add_argument("--task", choices=list(tasks.TASKS), default="arithmetic",
                   help="; ".join(f"{name}: {cls.help}" for name, cls in tasks.TASKS.items()))
    t.add_argument("--data", default=None, help="gsm8k: the GSM8K-style JSONL file to train on")
    t.add_argument("--eval-data", default=None, help="gsm8k: held-out JSONL (default: a slice of --data is held out)")
    t.add_argument("--digits", type=N(int, 1, 100), default=3, help="arithmetic: max digits per operand")
    t.add_argument("--nops", type=N(int, 1, 100), default=2, help="arithmetic: number of operations")
    t.add_argument("--system", choices=("auto", "paper", "none"), default="auto",
                   help="system prompt: the paper's instruction, none, or auto (the instruction unless "
                   "config.json says \"qerl_prompt\": \"bare\", as the bundled model's does)")
    a = p.add_argument_group("AQN, more")
    run_checks.add_flag(a, "--aqn-kind", default="exp", choices=aqn.SIGMA_KINDS, help="the schedule (exp: the official code's "
             "geometric decay; linear, cosine, log: our forms of the paper's ablation)", read_when=with_aqn)
    run_checks.add_flag(a, "--aqn-scale", default="absolute", choices=list(aqn.NOISES), help="how a noise draw is sized "
             "(04 NOISES): absolute, Z ~ N(0, sigma^2) as the paper; relative, Z_i ~ N(0, (sigma w_i)^2)",
             read_when=sized)
    run_checks.add_flag(a, "--aqn-site", default="norms", choices=list(aqn.SITES), help="where the noise lands (04 SITES): "
             + "; ".join(f"{k}: {v.help}" for k, v in aqn.SITES.items()), read_when=noisy)
    run_checks.add_flag(a, "--target-entropy", type=N(above=0), default=0.15, help="aqn-kind feedback: entropy to hold",
             read_when=(lambda args: args.aqn and args.aqn_kind == "feedback", "--aqn-kind feedback"))
    a.add_argument("--train-norms", action="store_true", help="train the RMSNorm gains of every decoder layer "
                   "(input/post-attention, fp32) with the adapters; saved as PEFT modules_to_save")
    g = p.add_argument_group("GRPO loss and update")
    g.add_argument("--max-new-tokens", type=N(int, 1), default=42)
    g.add_argument("--temperature", type=N(above=0), default=1.0,
                   help="sampling temperature (> 0: at 0 a prompt's G samples are all the same: no signal)")
    # the clip range's default is the --ratio-level's (None: not given; LossOptions.from_args and check_args read it)
    clip_defaults = ", ".join(f"{k} {v.eps_low:g} and {v.eps_high:g}" for k, v in stage.RATIOS.items())
    g.add_argument("--eps-low", type=N(float, 0, below=1), default=None, help="the ratio is clipped to [1 - eps_low, "
                   f"1 + eps_high] (default: the --ratio-level's: {clip_defaults})")
    g.add_argument("--eps-high", type=N(float, 0), default=None, help="see --eps-low")
    levels = "; ".join(f"{k}: {v.help}" for k, v in stage.RATIOS.items())
    g.add_argument("--ratio-level", choices=list(stage.RATIOS), default=stage.LossOptions.ratio_level,
                   help=f"the importance ratio pi_theta / pi_old: {levels}")
    g.add_argument("--loss-agg", default=stage.LossOptions.loss_agg, choices=list(stage.LOSS_AGGS))
    g.add_argument("--no-std-scale", action="store_true", help="advantage r - mean only (Dr. GRPO)")
    # PPO-style reuse takes a few passes (TRL's num_iterations, PPO's 3-10 epochs); past 16 the batch is far
    # off-policy (the clip zeroes most tokens) and one step's updates alone can outlast --time-budget
    g.add_argument("--mu", type=N(int, 1, 16), default=stage.UpdateOptions.mu, help="policy updates per batch (<= 16)")
    g.add_argument("--tis-cap", type=N(above=1), default=stage.UpdateOptions.tis_cap, help="--pi-old tis: the IS weight "
                   "pi_trainer / pi_sampler is truncated here (tis-mask: tokens beyond it leave the loss); every reading "
                   "logs the fraction beyond it (is_beyond_cap)")
    g.add_argument("--beta", type=N(float, 0), default=stage.LossOptions.beta, help="k3 KL to the base (reference) policy")
    g.add_argument("--entropy-coef", type=N(float, 0), default=stage.LossOptions.entropy_coef, help="entropy bonus coefficient")
    g.add_argument("--dynamic-sampling", type=N(int, 0, 16), default=0, help="DAPO's dynamic sampling: up to N more "
                   "rounds of problems a step replace the groups whose rewards all tie (0: off; the step's statistics "
                   "describe the trained batch, its record says ds_rounds and ds_flat_before)")
    g.add_argument("--mask-truncated", action="store_true", help="completions cut off at --max-new-tokens "
                   "(no EOS) leave the loss; their rewards still count in their group's advantages")
    g.add_argument("--warmup", type=N(int, 0), default=10, help="warmup steps")
    g.add_argument("--min-lr-ratio", type=N(float, 0, 1), default=0.1, help="cosine decays to this fraction of --lr")
    g.add_argument("--grad-clip", type=N(above=0), default=stage.UpdateOptions.grad_clip, help="max gradient norm")
    g.add_argument("--seed", type=N(int, 0, cli.MAX_SEED), default=0)
    m = p.add_argument_group("speed and memory (how to compute, not what)")
    m.add_argument("--device", default=None, help="cpu / cuda (default: autodetect)")
    m.add_argument("--dtype", choices=devices.DTYPES, default="auto",
                   help="activation dtype; auto: bfloat16 on CUDA, and on a CPU with native bf16 (AMX, AVX512-BF16) "
                   f"for a model of hidden size {devices.AUTO_BF16_MIN_HIDDEN} or more, else float32")
    m.add_argument("--quant-method", choices=quantize.NVFP4_METHODS, default="rtn",
                   help="NVFP4 rounding: rtn (compressed-tensors) or 4over6 (per block, max -> 6 or 4)")
    m.add_argument("--compile", action="store_true", help="sample with stage 03's torch.compile'd decode step "
                   "(compiles once per batch/length bucket: tens of seconds on a CPU; pays off on long runs and GPUs)")
    m.add_argument("--micro-batch", type=lambda v: v if v == "auto" else N(int, 0)(v), default=stage.UpdateOptions.micro_batch,
                   help="rows per forward/backward of the update, gradients accumulated before the one optimizer "
                   "step (0: all rows at once; auto: as many as keep the update's activations within "
                   f"{memory.UPDATE_MEMORY_CPU // 2 ** 20} MiB on a CPU, half the free memory on a GPU)")
    m.add_argument("--grad-checkpoint", action="store_true", help="activation checkpointing per decoder layer "
                   "in the update (less memory, one more forward)")
    m.add_argument("--dist-timeout", type=N(float, distributed.MIN_TIMEOUT_MIN, distributed.MAX_TIMEOUT_MIN),
                   default=10.0, help="torchrun: minutes a rank waits for the others at a collective before the job "
                   "ends with a line naming the missing rank")
    m.add_argument("--plain", action="store_true", help="the trainer's own fast paths off (01's fast forward, "
                   "03's CPU decode attention and chunked log-probs): the code of 05_grpo.py, which gives the same "
                   "step records and adapter")
    m.add_argument("--gpu-path", action="store_true", help="on the CPU, run what CUDA runs: NVFP4Linear through "
                   "the Triton kernel (interpreted), no merged sampling weights, bfloat16 by default")
    o = p.add_argument_group("evaluation and the run folder")
    o.add_argument("--eval-size", type=N(int, 0, stage.MAX_EVAL_SIZE), default=500,
                   help=f"held-out problems (0: no evaluation; at most {stage.MAX_EVAL_SIZE:,})")
    o.add_argument("--eval-every", type=N(int, 0), default=100,
                   help="greedy evaluation every N steps (0: at the start and end only)")
    o.add_argument("--eval-k", type=N(int, 0), default=8, help="pass@k at --temperature at the start and end (0: off)")
    o.add_argument("--eval-chunk", type=N(int, 1), default=1024, help="rows per generate() call in evaluation")
    o.add_argument("--out", default=None, help="run folder (default runs/<timestamp>)")
    o.add_argument("--resume", default=None, help="checkpoint (or run) folder to continue exactly")
    o.add_argument("--save-every", type=N(int, 0), default=100, help="checkpoint every N steps (0: at the end only)")
    o.add_argument("--time-budget", type=N(float, 0), default=540, help="stop after this many seconds incl. the "
                   "final evaluation (0: no limit)")
    o.add_argument("--max-completions", type=N(int, 0), default=0, help="stop once the run has sampled this many "
                   "completions (refills included), then evaluate; the LR and AQN schedules then run over the budget: "
                   "step s sits where its completions so far put it among --steps (0: no budget)")
    o.add_argument("--stop-at", type=N(int, 0), default=0, help="stop after this step with a checkpoint, as if "
                   "interrupted (for testing --resume)")
    o.add_argument("--quiet", action="store_true", help="no per-step lines")
    o.add_argument("--kl-after-rows", type=N(int, 0), default=0, help="after each update, kl_after (KL from the "
                   "sampler to the updated policy; beyond runs.DIVERGED_KL the log warns) over this many rows: one "
                   "more forward, 0.9 s of a 12 s SmolLM2 step at 16 (0: off, kl_after null)")
    o.add_argument("--show-step", action="store_true", help="train nothing: work one sampled group through "
                   "the rewards, advantages, ratio and loss by hand, and print it (a few seconds)")
    return p
