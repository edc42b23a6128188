"""Peak memory of stage 05's policy update at Qwen2.5's real vocabulary (151,936), on the CPU.

The update's memory has two parts that grow with the batch: the vocabulary-sized log-softmax (rows x T x V
in fp32, ~80 GB for 128 rows x 1,024 tokens) and the decoder's activations. `sequence_logprobs` runs the
vocabulary part in checkpointed chunks and `--micro-batch` bounds the rows per forward/backward, so with a
fixed micro-batch the peak should stay flat as rows and T grow. This script checks that on a random
Qwen2-architecture model with the real vocabulary and a small hidden size (so the vocabulary part
dominates): one `policy_update` (05) per configuration, each in a fresh child process, reporting the
growth of the process's peak resident memory over what it held before the update (the kernel's
high-water mark, reset through /proc/self/clear_refs after the setup). The children run with glibc's
mmap threshold fixed at 64 KiB (MALLOC_MMAP_THRESHOLD_): by default glibc raises that threshold after
each large free, up to 32 MiB, after which freed tensors stay in its heap and count in the RSS, so the
peak then measures the allocator's leftovers as much as the tensors (`--default-malloc` shows that).

    python bench/bench_update_memory.py                    # the table (4 child processes, < 3 GB)
    python bench/bench_update_memory.py --grad-checkpoint  # the same with 05's --grad-checkpoint
    python bench/bench_update_memory.py --default-malloc   # glibc's default (dynamic) mmap threshold
    python bench/bench_update_memory.py --per-token        # activations per token per layer, Qwen2.5-7B widths
    python bench/bench_update_memory.py --write-model DIR --layers 2   # random folder with Qwen2.5-7B widths
    python bench/bench_update_memory.py --smoke DIR -- <qerl/train.py flags>   # 05 on CUDA, rewards 0, 1, 0, ...

`--per-token` counts the bytes autograd saves for backward (saved_tensors_hooks) in one decoder layer
with rank-32 LoRA at Qwen2.5-7B's widths (bf16), at two sequence lengths, and reports the slope: the
activation memory per token per layer with and without `--grad-checkpoint`. The 7B estimate in docs/scaling.md is
built from it. `--smoke` is bench/gpu_check.sh's CUDA run of 05: a random model's rewards are all 0 (no
group would have signal, so no update would run), so it replaces the reward by 0, 1, 0, 1, ... and
reports s/step and the peak GPU memory of sampling and of the update.
"""
import importlib
import json
import itertools
import os
import subprocess
import sys
import time

import torch
import torch.utils.checkpoint

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
cli = importlib.import_module("qerl.cli")
engine = importlib.import_module("qerl.engine")
tasks = importlib.import_module("qerl.tasks")
quantize = importlib.import_module("qerl.quantize")
lora = importlib.import_module("qerl.lora")
rollout = importlib.import_module("qerl.rollout")
grpo = importlib.import_module("qerl.train")

QWEN_VOCAB = 151936
QWEN7B = dict(model_type="qwen2", vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
              num_attention_heads=28, num_key_value_heads=4, head_dim=128, rms_norm_eps=1e-6, rope_theta=1e6,
              max_position_embeddings=32768, tie_word_embeddings=False)
CONFIGS = [(16, 256), (64, 256), (64, 1024)]  # rows x T with the fixed micro-batch
UNCHUNKED = (4, 256)  # before this issue: all rows at once, the full (rows, T, V) logits


def status_kib(field):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def reset_peak():
    with open("/proc/self/clear_refs", "w") as f:  # Linux >= 4.0: resets VmHWM to the current RSS
        f.write("5")


def random_policy(vocab, hidden=64, layers=2, seed=0):
    """A random Qwen2 (untied, like the 7B) with NVFP4 decoder Linears and rank-16 LoRA."""
    torch.manual_seed(seed)
    cfg = rollout.ModelConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, head_dim=16,
                              num_hidden_layers=layers, num_attention_heads=hidden // 16, num_key_value_heads=2,
                              max_position_embeddings=4096)
    model = rollout.CausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.02)
    quantize.quantize_model(model, fmt="nvfp4")
    lora.add_lora(model, r=16, alpha=32, generator=torch.Generator().manual_seed(seed))
    return model.eval()


def run_one(rows, T, micro_batch, chunked, checkpointed=False):
    """One policy update; prints a RESULT line with the peak RSS growth in bytes."""
    torch.set_num_threads(1)
    if not chunked:
        engine.LOGITS_CHUNK_BYTES = 2 ** 62  # one chunk: the full (rows, T, V) logits, as before
    model = random_policy(QWEN_VOCAB)
    model.grad_checkpoint = checkpointed
    params = lora.lora_parameters(model)
    opt = torch.optim.AdamW(params, lr=1e-5)
    g = torch.Generator().manual_seed(1)
    group = 8 if rows >= 8 else rows
    prompts = [torch.randint(0, QWEN_VOCAB, (32,), generator=g).tolist()] * rows
    ids = torch.randint(0, QWEN_VOCAB, (rows, T), generator=g)  # (rows, T)
    mask = torch.ones(rows, T)  # every row at full length: the worst case
    old_logp = -torch.rand(rows, T, generator=g) * 12  # (rows, T)
    rewards = torch.tensor([float(i % 2) for i in range(rows)])  # every group has signal: all rows train
    args = grpo.build_parser().parse_args(["--group", str(group), "--max-new-tokens", str(T),
                                           "--micro-batch", str(micro_batch)])
    before = status_kib("VmRSS")
    reset_peak()
    t0 = time.time()
    out = grpo.policy_update(model, opt, params, prompts, ids, mask, old_logp, rewards, **grpo.update_options(args))
    seconds = time.time() - t0
    growth = (status_kib("VmHWM") - before) * 1024
    assert out["kept_rows"] == rows and not out["skipped"]
    print("RESULT " + json.dumps({"rows": rows, "T": T, "micro_batch": micro_batch, "chunked": chunked,
                                  "checkpointed": checkpointed, "peak_growth": growth, "seconds": seconds}))


MMAP_THRESHOLD = 64 * 1024  # bytes: every tensor this size or larger is returned to the system when freed


def table(micro_batch, checkpointed, default_malloc=False):
    runs = [(r, t, micro_batch, True) for r, t in CONFIGS] + [(*UNCHUNKED, 0, False)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    if not default_malloc:
        env["MALLOC_MMAP_THRESHOLD_"] = str(MMAP_THRESHOLD)
    results = []
    for rows, T, mb, chunked in runs:
        cmd = [sys.executable, os.path.abspath(__file__), "--one", str(rows), str(T), str(mb), str(int(chunked))]
        cmd += ["--grad-checkpoint"] if checkpointed and chunked else []
        r = subprocess.run(cmd, capture_output=True, text=True, env=env)
        line = [x for x in r.stdout.splitlines() if x.startswith("RESULT ")]
        if r.returncode or not line:
            sys.exit(f"error: child {' '.join(cmd[2:])} failed:\n{r.stderr[-2000:]}")
        results.append(json.loads(line[0][7:]))
        res = results[-1]
        print(f"run | rows {rows} | T {T} | micro-batch {mb or 'all'} | chunked {chunked} | "
              f"grad-checkpoint {res['checkpointed']} | "
              f"peak growth {res['peak_growth'] / 2 ** 30:.3f} GiB | {res['seconds']:.1f}s", flush=True)
    base = results[0]["peak_growth"]
    full_logits = UNCHUNKED[0] * UNCHUNKED[1] * QWEN_VOCAB * 4
    malloc = "glibc default" if default_malloc else f"glibc mmap threshold {MMAP_THRESHOLD // 1024} KiB"
    print(f"\nvocab {QWEN_VOCAB} | hidden 64 | 2 layers | NVFP4 + LoRA r16 | CPU, peak RSS growth over the update | "
          f"{malloc}")
    print("| rows x T | micro-batch | log-probs | grad-checkpoint | peak growth | vs 16 x 256 |")
    print("| --- | --- | --- | --- | --- | --- |")
    for res in results:
        print(f"| {res['rows']} x {res['T']} | {res['micro_batch'] or 'all rows'} | "
              f"{'chunked' if res['chunked'] else 'full logits'} | {'yes' if res['checkpointed'] else 'no'} | "
              f"{res['peak_growth'] / 2 ** 30:.2f} GiB | "
              f"{res['peak_growth'] / base:.2f}x |")
    print(f"(one fp32 (rows, T, V) logits tensor at {UNCHUNKED[0]} x {UNCHUNKED[1]}: {full_logits / 2 ** 30:.2f} GiB)")


def per_token():
    """Bytes saved for backward per token in one LoRA decoder layer at Qwen2.5-7B widths (bf16). Runs under
    FakeTensorMode: shapes and dtypes without data or compute (on a small layer it counts exactly what
    real CPU tensors count), so the 7B widths take seconds."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    cfg = rollout.ModelConfig(**{**{k: v for k, v in QWEN7B.items() if k != "tie_word_embeddings"},
                                 "vocab_size": 256, "num_hidden_layers": 1})

    def saved_bytes(T, checkpointed):
        seen = {}

        def pack(t):  # a view counts its base once
            base = t._base if t._base is not None else t
            seen[id(base)] = (base, base.numel() * base.element_size())
            return t

        # A frozen base Linear saves no per-token tensor, bf16 or NVFP4 (01's backward rebuilds the weight,
        # the kernel's saves the packed one), so the layer is bf16; its weights cancel in the slope.
        torch.set_default_dtype(torch.bfloat16)
        model = rollout.CausalLM(cfg)
        torch.set_default_dtype(torch.float32)
        lora.add_lora(model, r=32, alpha=32, generator=torch.Generator().manual_seed(0))
        x = torch.randn(1, T, cfg.hidden_size, dtype=torch.bfloat16, requires_grad=True)  # (1, T, C)
        freqs = torch.arange(T)[None, :, None].float() * rollout.rope_inv_freq(cfg)  # (1, T, D/2)
        emb = torch.cat((freqs, freqs), -1)
        cos, sin = emb.cos().bfloat16()[:, None], emb.sin().bfloat16()[:, None]  # (1, 1, T, D)
        mask = (torch.arange(T)[None, :] <= torch.arange(T)[:, None])[None, None]  # (1, 1, T, T)
        layer = model.model.layers[0]
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):  # what 03 runs with grad_checkpoint
            y = (torch.utils.checkpoint.checkpoint(layer, x, cos, sin, mask, use_reentrant=False) if checkpointed
                 else layer(x, cos, sin, mask))  # (1, T, C)
        y.float().sum().backward()
        return sum(b for _, b in seen.values())

    with FakeTensorMode(allow_non_fake_inputs=True):
        for ck in (False, True):
            a, b = saved_bytes(32, ck), saved_bytes(64, ck)
            print(f"per-token | grad-checkpoint {ck} | saved for backward per token per layer "
                  f"{(b - a) / 32 / 1024:.1f} KiB (slope between T 32 and 64)", flush=True)
    print(f"per-token | KV cache while sampling: {2 * cfg.num_key_value_heads * cfg.head_dim * 2 / 1024:.0f} KiB "
          f"per token per layer ({2 * QWEN7B['num_hidden_layers'] * cfg.num_key_value_heads * cfg.head_dim * 2 / 1024:.0f}"
          f" KiB for all 28 layers, bf16)")


def write_model(path, layers, device):
    """A random Qwen2 folder with Qwen2.5-7B's widths (bf16, N(0, 0.02)) and the bundled byte-level tokenizer."""
    import shutil
    from safetensors.torch import save_file
    cfg = dict(QWEN7B, num_hidden_layers=layers, torch_dtype="bfloat16", architectures=["Qwen2ForCausalLM"],
               hidden_act="silu", use_sliding_window=False, qerl_prompt="bare")
    with torch.device("meta"):
        model = rollout.CausalLM(rollout.ModelConfig.from_dict(cfg))
    g = torch.Generator(device=device).manual_seed(0)
    tensors = {}
    for name, p in model.state_dict().items():
        t = torch.randn(p.shape, generator=g, device=device) * 0.02 if p.dim() == 2 else torch.ones(p.shape) * (
            0.0 if name.endswith("bias") else 1.0)
        tensors[name] = t.to(torch.bfloat16).cpu().contiguous()
    tmp = path.rstrip("/") + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    save_file(tensors, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
    for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(os.path.join(grpo.TINY_MODEL, f), os.path.join(tmp, f))
    with open(os.path.join(tmp, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    shutil.rmtree(path, ignore_errors=True)
    os.rename(tmp, path)
    print(f"model | {path} | Qwen2.5-7B widths | layers {layers} | "
          f"{sum(t.numel() for t in tensors.values()) / 1e9:.2f}B parameters (bf16)")


class AlternatingRewards:
    """05's task with rewards 0, 1, 0, 1, ...: every group has signal, so every row trains. Handed to
    train(args, task=...), its calls also mark a step's phases without touching 05's functions: problems()
    opens a step (the previous update's peak is read), the step's first reward() closes its sampling."""

    def __init__(self, task):
        self.task, self.held, self.count = task, task.held, itertools.count()
        self.peaks, self.updating = {"sample": 0, "update": 0}, False
        self.cuda = torch.cuda.is_available()  # on a CPU (a dry run of this code) only the step lines count

    def peak(self, phase):
        if self.cuda:
            self.peaks[phase] = max(self.peaks[phase], torch.cuda.max_memory_allocated())
            torch.cuda.reset_peak_memory_stats()

    def problems(self, seed, step, n):
        if self.updating:
            self.peak("update")
        self.updating = False
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()
        return self.task.problems(seed, step, n)

    def prompt(self, problem):
        return self.task.prompt(problem)

    def reward(self, problem, text):
        if not self.updating:
            self.peak("sample")
            self.updating = True
        return float(next(self.count) % 2)

    def correct(self, problem, text):
        return self.task.correct(problem, text)


def smoke(model_dir, flags):
    """05's train() with rewards 0, 1, 0, 1, ...; s/step from its lines, peak GPU memory per phase."""
    args = grpo.build_parser().parse_args(["--model", model_dir, *flags])
    task = AlternatingRewards(tasks.make_task(args, grpo.parser_defaults()))
    grpo.train(args, task=task)
    if task.updating:
        task.peak("update")
    if task.cuda:
        print(f"smoke | peak GPU memory | sampling {task.peaks['sample'] / 2 ** 30:.2f} GiB | update "
              f"{task.peaks['update'] / 2 ** 30:.2f} GiB | reserved {torch.cuda.max_memory_reserved() / 2 ** 30:.2f} GiB")


def main(argv=None):
    p = cli.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--micro-batch", type=cli.number(int, 1), default=4,
                   help="rows per forward/backward in the table")
    p.add_argument("--grad-checkpoint", action="store_true", help="the table's chunked rows with 05's --grad-checkpoint")
    p.add_argument("--default-malloc", action="store_true", help="children keep glibc's dynamic mmap threshold")
    p.add_argument("--one", nargs=4, type=cli.number(int, 0), metavar=("ROWS", "T", "MB", "CHUNKED"),
                   help="(child) one configuration")
    p.add_argument("--per-token", action="store_true")
    p.add_argument("--write-model", metavar="DIR")
    p.add_argument("--layers", type=cli.number(int, 1), default=2)
    p.add_argument("--smoke", metavar="DIR")
    args, rest = p.parse_known_args(argv)
    if args.one:
        run_one(*args.one[:3], bool(args.one[3]), args.grad_checkpoint)
    elif args.per_token:
        per_token()
    elif args.write_model:
        write_model(args.write_model, args.layers, "cuda" if torch.cuda.is_available() else "cpu")
    elif args.smoke:
        smoke(args.smoke, [f for f in rest if f != "--"])
    else:
        table(args.micro_batch, args.grad_checkpoint, args.default_malloc)


if __name__ == "__main__":
    sys.exit(cli.run_cli(main))
