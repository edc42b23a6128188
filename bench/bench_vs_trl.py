"""Stage 05's GRPO against what a user would otherwise pick, TRL's `GRPOTrainer` + peft LoRA, side by side.

Both sides train LoRA adapters on the same base (05 with `--quant none --no-aqn`: TRL has no NVFP4), each in
its fastest dtype by default (05's --dtype auto; TRL in fp32, --trl-dtype), with one fp32 evaluator for both,
for N steps on the same problems in the same order, the same prompt token ids, the same reward function
(05's task object), batch, group, max new tokens, temperature, clip range (0.2 / 0.28), beta 0, token-mean
loss, AdamW (lr, betas 0.9 / 0.99, weight decay 0, grad clip) with 05's own warmup + cosine LR schedule
(handed to TRL as a LambdaLR), LoRA r / alpha / targets, and even the same initial adapter (05 builds it,
peft loads it). Measured per side, each in its own process, one after the other: s/step split into
sampling (05: its metrics.jsonl's t_sample; TRL: the time inside `generate`) and update (the rest of the
step), peak RSS (ru_maxrss), and, with one evaluator for both (05's `evaluate`: greedy, held-out problems,
TRL's adapter read by 02's PEFT-layout loader), accuracy before -> after.

TRL is not a project dependency: its side runs in the interpreter `--trl-python` names. Make that venv with
    python -m venv /tmp/trlvenv && /tmp/trlvenv/bin/pip install torch==2.13.0 trl peft transformers accelerate
(pin torch: an unpinned one pulls a multi-GB CUDA build). The TRL worker imports this repository's qerl/train.py
for the task's reward (it needs only torch, safetensors and tokenizers, which that venv has).

    python bench/bench_vs_trl.py --trl-python /tmp/trlvenv/bin/python           # tiny model, 150 steps, ~5 min
    python bench/bench_vs_trl.py --trl-python /tmp/trlvenv/bin/python --model assets/smollm2-135m-instruct \\
        --steps 16 --batch 8 --group 8 --max-new-tokens 48 --temperature 0.7 --lr 5e-4 --warmup 5   # ~20 min
    python bench/bench_vs_trl.py --trl-python ... --out runs/vs_trl.json           # results as JSON too

Defaults: the bundled tiny model on `--task arithmetic` (SmolLM2 and other models: `--task chat-arithmetic`),
16 prompts x 8 samples, 42 new tokens, 150 steps, 2 threads per side, 500 held-out problems (200 for
chat-arithmetic). s/step figures are medians over the steps after the first (warm-up; medians: another job on
a shared machine stretches a few steps of one side), in wall seconds and, as a steadier check, CPU seconds.
"""
import argparse
import contextlib
import importlib
import io
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
cli = importlib.import_module("qerl.cli")
devices = importlib.import_module("qerl.devices")
hf_files = importlib.import_module("qerl.hf_files")
tasks = importlib.import_module("qerl.tasks")

TRL_VENV_HINT = ("python -m venv /tmp/trlvenv && /tmp/trlvenv/bin/pip install torch==2.13.0 trl peft transformers "
                 "accelerate")


def peak_rss_mb():
    return devices.peak_rss_bytes() / 2 ** 20


def grpo_flags(job):
    """qerl/train.py's command line for this comparison (both workers parse it with 05's own parser)."""
    return ["--model", job["model"], "--task", job["task"], "--quant", "none", "--no-aqn",
            "--steps", str(job["steps"]), "--batch", str(job["batch"]), "--group", str(job["group"]),
            "--max-new-tokens", str(job["max_new_tokens"]), "--temperature", str(job["temperature"]),
            "--lr", str(job["lr"]), "--warmup", str(job["warmup"]), "--lora-r", str(job["lora_r"]),
            "--lora-alpha", str(job["lora_alpha"]), "--seed", str(job["seed"]),
            "--eval-size", str(job["eval_size"]), "--device", "cpu", "--dtype", job["dtype"]]


def load_grpo():
    return importlib.import_module("qerl.train")


# ---------------------------------------------------------------------------------------------------
# Side 1: stage 05, in this project's interpreter

def ours_worker(job, result_file):
    import torch
    torch.set_num_threads(job["threads"])
    grpo = load_grpo()
    args = grpo.build_parser().parse_args(grpo_flags(job) + [
        "--out", os.path.join(job["dir"], "ours"), "--time-budget", "0", "--save-every", "0", "--eval-every", "0",
        "--eval-k", "0"])
    task = tasks.make_task(args, grpo.parser_defaults())  # built with --eval-size: chat-arithmetic's training split depends on it
    args.eval_size = 0  # no evaluation inside the run: the parent evaluates both sides with one evaluator
    # each step's record (metrics.jsonl) has its CPU seconds and the peak RSS so far: no hooks into 05 needed
    summary = grpo.train(args, task=task)
    with open(os.path.join(args.out, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    steps = [r for r in rows if "step" in r and "s/step" in r]
    write_json(result_file, {
        "step_s": [r["s/step"] for r in steps], "sample_s": [r["t_sample"] for r in steps],
        "reward": [r["reward"] for r in steps], "frac_zero_std": [r["frac_zero_std"] for r in steps],
        "step_cpu_s": [r["cpu_s"] for r in steps], "sample_cpu_s": [r["cpu_sample"] for r in steps],
        "peak_rss_by_step_mb": [r["peak_rss_mb"] for r in steps],
        "adapter": summary["checkpoint"], "rss_setup_mb": float("nan"), "peak_rss_mb": peak_rss_mb(),
        "dtype": args.dtype,  # --dtype auto's choice, resolved by 05's check_sizes
        "versions": {"torch": torch.__version__}})


# ---------------------------------------------------------------------------------------------------
# Side 2: TRL's GRPOTrainer + peft, in the interpreter --trl-python names

def trl_worker(job, result_file):
    import torch
    torch.set_num_threads(job["threads"])
    import datasets
    import peft
    import transformers
    import trl
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from transformers.generation.utils import GenerationMixin
    grpo = load_grpo()  # for the task's reward and 05's LR schedule, not reimplemented here
    args = grpo.build_parser().parse_args(grpo_flags(job))
    task = tasks.make_task(args, grpo.parser_defaults())

    tokenizer = AutoTokenizer.from_pretrained(job["model"])
    hf_ids = tokenizer(text=job["prompts"])["input_ids"]  # what TRL's _tokenize_prompts will feed generate
    same_ids = sum(a == b for a, b in zip(hf_ids, job["prompt_ids"]))
    if same_ids != len(hf_ids):
        raise SystemExit(f"error: TRL's tokenizer gives other prompt ids than 05's on {len(hf_ids) - same_ids} of "
                         f"{len(hf_ids)} prompts: the comparison would not feed the same tokens")
    base = AutoModelForCausalLM.from_pretrained(job["model"], dtype=getattr(torch, job["trl_dtype"]))
    model = peft.PeftModel.from_pretrained(base, job["init_adapter"], is_trainable=True)  # 05's initial A, B = 0
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=job["lr"], betas=(0.9, 0.99), weight_decay=0.0)  # build_policy's
    schedule = torch.optim.lr_scheduler.LambdaLR(  # 05's warmup + cosine, step for step
        opt, lambda step: grpo.lr_factor(step, job["warmup"], job["steps"], args.min_lr_ratio))

    seen_questions = []  # the questions of each reward call (one per step): checked against 05's order below

    def reward(prompts, completions, question, answer, **_):
        seen_questions.append(sorted(set(question)))
        return [task.reward({"question": q, "answer": a}, c) for q, a, c in zip(question, answer, completions)]

    rows = [{"prompt": text, **problem} for text, problem in zip(job["train_prompts"], job["train_problems"])]
    config = trl.GRPOConfig(
        output_dir=os.path.join(job["dir"], "trl"), max_steps=job["steps"],
        per_device_train_batch_size=job["batch"] * job["group"], num_generations=job["group"],
        gradient_accumulation_steps=1, steps_per_generation=1, shuffle_dataset=False,
        max_completion_length=job["max_new_tokens"], temperature=job["temperature"], top_p=1.0, top_k=0,
        beta=0.0, epsilon=0.2, epsilon_high=0.28, loss_type="dapo", scale_rewards="group", num_iterations=1,
        learning_rate=job["lr"], adam_beta1=0.9, adam_beta2=0.99, weight_decay=0.0, max_grad_norm=args.grad_clip,
        use_cpu=True, bf16=job["trl_dtype"] == "bfloat16", fp16=False, gradient_checkpointing=False, disable_dropout=True,
        logging_steps=1, report_to="none", save_strategy="no", disable_tqdm=True, log_level="error",
        seed=job["seed"], dataloader_num_workers=0)

    generate_s = [0.0, 0.0]  # wall and CPU seconds inside generate since the step began
    original_generate = GenerationMixin.generate

    def timed_generate(self, *a, **kw):
        t0, c0 = time.perf_counter(), time.process_time()
        try:
            return original_generate(self, *a, **kw)
        finally:
            generate_s[0] += time.perf_counter() - t0
            generate_s[1] += time.process_time() - c0

    GenerationMixin.generate = timed_generate  # PeftModel.generate ends here: one place catches every call
    record = {"step_s": [], "sample_s": [], "step_cpu_s": [], "sample_cpu_s": [], "reward": [], "frac_zero_std": [],
              "rss_setup_mb": None, "peak_rss_by_step_mb": []}

    class StepTimes(TrainerCallback):
        def on_train_begin(self, *_, **__):
            record["rss_setup_mb"] = peak_rss_mb()

        def on_step_begin(self, *_, **__):
            generate_s[:] = [0.0, 0.0]
            self.t0, self.c0 = time.perf_counter(), time.process_time()

        def on_step_end(self, *_, **__):
            record["step_s"].append(time.perf_counter() - self.t0)
            record["step_cpu_s"].append(time.process_time() - self.c0)
            record["sample_s"].append(generate_s[0])
            record["sample_cpu_s"].append(generate_s[1])
            record["peak_rss_by_step_mb"].append(peak_rss_mb())

        def on_log(self, _args, state, control, logs=None, **__):  # after on_step_end (logging_steps=1)
            if logs and "reward" in logs:
                record["reward"].append(logs["reward"])
                record["frac_zero_std"].append(logs.get("frac_reward_zero_std", float("nan")))
                if state.global_step % max(1, job["steps"] // 10) == 0 or state.global_step == job["steps"]:
                    print(f"trl | step {state.global_step}/{job['steps']} | reward {logs['reward']:.3f} | s/step "
                          f"{record['step_s'][-1]:.2f}", flush=True)

    trainer = trl.GRPOTrainer(model=model, reward_funcs=[reward], args=config,
                              train_dataset=datasets.Dataset.from_list(rows), processing_class=tokenizer,
                              optimizers=(opt, schedule), callbacks=[StepTimes()])
    for quiet in (transformers.PrinterCallback, transformers.ProgressCallback):
        trainer.remove_callback(quiet)
    trainer.train()
    B = job["batch"]
    same_problems = sum(q == sorted({p["question"] for p in job["train_problems"][k * B:(k + 1) * B]})
                        for k, q in enumerate(seen_questions))
    if same_problems != job["steps"] or len(seen_questions) != job["steps"]:
        raise SystemExit(f"error: TRL trained on 05's problems in {same_problems} of {job['steps']} steps "
                         f"({len(seen_questions)} reward calls): the dataset order is not 05's")
    print(f"trl | checks | prompt ids identical to 05's: {same_ids} of {len(hf_ids)} | problems identical to 05's: "
          f"{same_problems} of {job['steps']} steps", flush=True)
    adapter = os.path.join(job["dir"], "trl", "adapter")
    trainer.model.save_pretrained(adapter)
    model.eval()
    model.float()  # the parent's evaluator is fp32
    with torch.no_grad():  # last-position logits of one prompt: the parent checks that 02 reads the adapter alike
        probe = model(torch.tensor([job["probe_ids"]])).logits[0, -1].tolist()
    write_json(result_file, {
        **record, "adapter": adapter, "probe_logits": probe, "peak_rss_mb": peak_rss_mb(), "dtype": job["trl_dtype"],
        "versions": {"torch": torch.__version__, "trl": trl.__version__, "peft": peft.__version__,
                     "transformers": transformers.__version__, "accelerate": importlib.import_module(
                         "accelerate").__version__, "datasets": datasets.__version__}})


# ---------------------------------------------------------------------------------------------------
# The parent: setup, the two sides one after the other, one evaluator for both, the table

def write_json(path, obj):
    """Write to a temporary name in the same folder, then rename: a reader never sees half a file."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tmp-", suffix=".json")
    with os.fdopen(fd, "w") as f:
        json.dump(obj, f, indent=1)
    os.replace(tmp, path)


def check_trl_python(python):
    """None if `python` runs and imports trl, peft, transformers and accelerate, else the reason."""
    if not python:
        return f"--trl-python VENV_PYTHON is required (make that venv with: {TRL_VENV_HINT})"
    if not (os.path.isfile(python) and os.access(python, os.X_OK)):
        return f"--trl-python {python!r} is not an executable file (make the venv with: {TRL_VENV_HINT})"
    probe = subprocess.run([python, "-c", "import trl, peft, transformers, accelerate, datasets"],
                           check=False, capture_output=True, text=True)
    if probe.returncode != 0:
        missing = (probe.stderr.strip().splitlines() or ["it exited with an error"])[-1]
        return f"--trl-python {python} cannot import trl/peft/transformers/accelerate ({missing}); install them: " \
               f"{python} -m pip install torch==2.13.0 trl peft transformers accelerate"
    return None


def run_side(name, python, job_file, result_file, log_file, threads):
    """Run one side's worker; its own progress lines are echoed, everything goes to log_file."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads),
           "TRANSFORMERS_VERBOSITY": "error", "TOKENIZERS_PARALLELISM": "false", "PYTHONWARNINGS": "ignore"}
    t0 = time.perf_counter()
    with open(log_file, "w") as log:
        proc = subprocess.Popen([python, os.path.abspath(__file__), "--worker", name, job_file, result_file],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=ROOT)
        for line in proc.stdout:
            log.write(line)
            if line.startswith(f"{name} | "):
                print(line, end="", flush=True)
        code = proc.wait()
    if code != 0 or not os.path.isfile(result_file):
        with open(log_file) as f:
            tail = "".join(f.readlines()[-15:])
        raise SystemExit(f"{tail}error: the {name} side exited with code {code} (its log: {log_file})")
    with open(result_file) as f:
        return json.load(f), time.perf_counter() - t0


def summarise(res):
    """Median wall and CPU seconds per step, of its sampling and of its update (the step less its sampling),
    over the steps after the first (warm-up). Medians, not means: on a shared machine another job's burst
    stretches a few steps of one side by 10x, and a mean would charge them to that side."""
    out = {}
    for unit, step_key, sample_key in (("", "step_s", "sample_s"), ("cpu_", "step_cpu_s", "sample_cpu_s")):
        step_s, sample_s = res[step_key][1:] or res[step_key], res[sample_key][1:] or res[sample_key]
        out.update({f"{unit}s_step": statistics.median(step_s), f"{unit}sample_s_step": statistics.median(sample_s),
                    f"{unit}update_s_step": statistics.median(a - b for a, b in zip(step_s, sample_s)),
                    f"{unit}s_step_mean": statistics.mean(step_s)})
    tail = res["reward"][-10:]
    by_step = res.get("peak_rss_by_step_mb") or [float("nan")]
    return {**out, "peak_rss_mb": res["peak_rss_mb"], "rss_setup_mb": res["rss_setup_mb"],
            "rss_step1_mb": by_step[0], "steps": len(res["step_s"]),
            "reward_last10": statistics.mean(tail) if tail else float("nan"),
            "frac_zero_std": statistics.mean(res["frac_zero_std"]) if res["frac_zero_std"] else float("nan")}


def main(argv=None):
    N = cli.number  # the command-line pieces (torch, not 05, is imported)
    ap = cli.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trl-python", default=None, help="interpreter of a venv with trl, peft, transformers, "
                    "accelerate (required)")
    ap.add_argument("--model", default=os.path.join(ROOT, "assets", "tiny-qwen"),
                    help="Hugging Face model folder (default: the bundled tiny model)")
    ap.add_argument("--task", default=None, choices=("arithmetic", "chat-arithmetic"),
                    help="default: arithmetic for the bundled tiny model, chat-arithmetic for any other")
    ap.add_argument("--steps", type=N(int, 2), default=150)
    ap.add_argument("--batch", type=N(int, 1), default=16, help="prompts per step")
    ap.add_argument("--group", type=N(int, 2), default=8, help="samples per prompt")
    ap.add_argument("--max-new-tokens", type=N(int, 1), default=42)
    ap.add_argument("--temperature", type=N(above=0), default=1.0)
    ap.add_argument("--lr", type=N(above=0), default=1e-3)
    ap.add_argument("--warmup", type=N(int, 0), default=10)
    ap.add_argument("--lora-r", type=N(int, 1), default=16)
    ap.add_argument("--lora-alpha", type=N(int, 1), default=32)
    ap.add_argument("--seed", type=N(int, 0), default=0)
    ap.add_argument("--eval-size", type=N(int, 0), default=None, help="held-out problems (default 500; 200 for "
                    "chat-arithmetic)")
    ap.add_argument("--threads", type=N(int, 1), default=2, help="torch threads of each side")
    ap.add_argument("--dtype", choices=devices.DTYPES, default="auto", help="05's --dtype (default auto: its fastest)")
    ap.add_argument("--trl-dtype", choices=("float32", "bfloat16"), default="float32",
                    help="TRL's model dtype and bf16 flag (default float32, its fastest on this project's AMX CPU: "
                    "median 39.5 s a SmolLM2 step against 51.2 in bf16)")
    ap.add_argument("--workdir", default=None, help="where the runs, adapters and logs go (default: a temp folder)")
    ap.add_argument("--out", default=None, help="also write the results to this JSON file")
    ap.add_argument("--worker", nargs=3, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        side, job_file, result_file = args.worker
        with open(job_file) as f:
            job = json.load(f)
        (ours_worker if side == "ours" else trl_worker)(job, result_file)
        return 0

    if args.workdir and os.path.isdir(args.workdir) and os.listdir(args.workdir):  # 05 refuses a run folder twice
        print(f"error: --workdir {args.workdir} is not empty (an earlier comparison?): choose a new folder",
              file=sys.stderr)
        return 1
    import torch
    torch.set_num_threads(args.threads)
    grpo = load_grpo()
    try:  # the cheap checks first: a wrong folder is reported before the TRL venv is probed
        hf_files.find_weight_files(args.model)
    except (FileNotFoundError, ValueError) as e:
        hint = " (make it with: python assets/smollm2.py)" if "smollm2" in args.model else ""
        print(f"error: --model {args.model!r} is not a model folder{hint}: {e}", file=sys.stderr)
        return 1
    problem = check_trl_python(args.trl_python)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 1
    t_start = time.perf_counter()
    task_name = args.task or ("arithmetic" if os.path.realpath(args.model) == os.path.realpath(grpo.TINY_MODEL)
                              else "chat-arithmetic")
    eval_size = args.eval_size if args.eval_size is not None else (500 if task_name == "arithmetic" else 200)
    tmp = None if args.workdir else tempfile.TemporaryDirectory(prefix="bench_vs_trl-")
    workdir = os.path.abspath(args.workdir or tmp.name)
    os.makedirs(workdir, exist_ok=True)
    job = {"model": os.path.abspath(args.model), "task": task_name, "steps": args.steps, "batch": args.batch,
           "group": args.group, "max_new_tokens": args.max_new_tokens, "temperature": args.temperature,
           "lr": args.lr, "warmup": args.warmup, "lora_r": args.lora_r, "lora_alpha": args.lora_alpha,
           "seed": args.seed, "eval_size": eval_size, "threads": args.threads, "dir": workdir,
           "dtype": args.dtype, "trl_dtype": args.trl_dtype}
    try:  # the parent's own model (the initial adapter, then one evaluator for both sides) is fp32
        g_args = grpo.build_parser().parse_args(grpo_flags(job) + ["--dtype", "float32"])
        task = tasks.make_task(g_args, grpo.parser_defaults())
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1

    # The problems of every step in 05's order (task.problems(seed, step, batch)) become TRL's dataset, read
    # in order (shuffle_dataset=False): step k of both sides trains on the same problems.
    with contextlib.redirect_stdout(io.StringIO()):  # add_lora's report line
        model, tok, _, _ = grpo.build_policy(g_args, "cpu")  # fp32 base + 05's initial adapter (from --seed)
    init_adapter = os.path.join(workdir, "init_adapter")
    grpo.lora.save_adapter(model, init_adapter, base_model_name_or_path=job["model"])
    train_problems = [p for step in range(args.steps) for p in task.problems(args.seed, step, args.batch)]
    train_problems = [{"question": p["question"], "answer": p["answer"]} for p in train_problems]
    job.update(init_adapter=init_adapter, train_problems=train_problems,
               train_prompts=[task.prompt(p) for p in train_problems])
    job["prompts"] = job["train_prompts"][:args.batch] + [task.prompt(p) for p in task.held]
    job["prompt_ids"] = [tok.encode(text) for text in job["prompts"]]
    job["probe_ids"] = tok.encode(task.prompt(task.held[0])) if task.held else job["prompt_ids"][0]
    job_file = os.path.join(workdir, "job.json")
    write_json(job_file, job)
    print(f"setup | model {args.model} | task {task_name} | steps {args.steps} | B {args.batch} | G {args.group} | "
          f"max new tokens {args.max_new_tokens} | lr {args.lr:g} | lora r {args.lora_r} alpha {args.lora_alpha} | "
          f"held-out {len(task.held)} | threads {args.threads} | torch {torch.__version__} | load "
          f"{os.getloadavg()[0]:.2f} | workdir {workdir}",
          flush=True)

    sides = {}
    for name, python in (("ours", sys.executable), ("trl", args.trl_python)):
        res, wall = run_side(name, python, job_file, os.path.join(workdir, f"{name}.json"),
                             os.path.join(workdir, f"{name}.log"), args.threads)
        sides[name] = {**summarise(res), "wall_s": wall, "adapter": res["adapter"],
                       "versions": res["versions"], "dtype": res["dtype"]}
        s = sides[name]
        print(f"{name} | done | steps {s['steps']} | s/step {s['s_step']:.3f} (mean {s['s_step_mean']:.3f}) | sampling "
              f"{s['sample_s_step']:.3f} | update {s['update_s_step']:.3f} | CPU s/step {s['cpu_s_step']:.3f} | "
              f"sampling {s['cpu_sample_s_step']:.3f} | update {s['cpu_update_s_step']:.3f} | peak RSS MB {s['peak_rss_mb']:.0f} (at setup {s['rss_setup_mb']:.0f}, "
              f"after step 1 {s['rss_step1_mb']:.0f}) | train reward last 10 "
              f"{s['reward_last10']:.3f} | groups without signal {s['frac_zero_std']:.2f} | wall {wall:.0f}s | load {os.getloadavg()[0]:.2f}", flush=True)
        if name == "trl":
            probe = res["probe_logits"]

    # One evaluator for both: 05's evaluate (greedy, merged weights) on the held-out problems, each trained
    # adapter read into the same model by 02's PEFT-layout loader; "before" is the initial adapter (B = 0).
    t0 = time.perf_counter()
    accuracy = {}
    for key, folder in (("before", init_adapter), ("ours", sides["ours"]["adapter"]), ("trl", sides["trl"]["adapter"])):
        grpo.lora.load_adapter(model, folder)
        model.eval()
        if key == "trl":
            with torch.no_grad():
                ours_logits = model(torch.tensor([job["probe_ids"]]))[0, -1]
            probe_diff = float((ours_logits - torch.tensor(probe)).abs().max())
        accuracy[key] = grpo.evaluate(model, tok, task, task.held, args.max_new_tokens)["greedy"]
    print(f"eval | held-out {len(task.held)} | greedy before {accuracy['before']:.3f} | ours {accuracy['ours']:.3f} | "
          f"trl {accuracy['trl']:.3f} | TRL adapter through 02's loader: max |logit diff| vs peft {probe_diff:.1e} | "
          f"{time.perf_counter() - t0:.0f}s", flush=True)
    for name, side in sides.items():
        side.update(greedy_before=accuracy["before"], greedy_after=accuracy[name])

    v = sides["trl"]["versions"]
    print(f"\nversions | trl {v['trl']} | peft {v['peft']} | transformers {v['transformers']} | accelerate "
          f"{v['accelerate']} | torch {v['torch']} (ours: torch {sides['ours']['versions']['torch']})")
    print("\n| side | s/step | sampling s/step | update s/step | peak RSS MB | greedy before -> after | steps |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    labels = {"ours": f"qerl/train.py ({sides['ours']['dtype']})",
              "trl": f"TRL {v['trl']} GRPOTrainer + peft {v['peft']} ({sides['trl']['dtype']})"}
    for name, s in sides.items():
        print(f"| {labels[name]} | {s['s_step']:.2f} | {s['sample_s_step']:.2f} | {s['update_s_step']:.2f} | "
              f"{s['peak_rss_mb']:.0f} | {100 * s['greedy_before']:.1f}% -> {100 * s['greedy_after']:.1f}% | "
              f"{s['steps']} |")
    o, t = sides["ours"], sides["trl"]
    print(f"\nours / TRL: s/step {o['s_step'] / t['s_step']:.2f}x | sampling {o['sample_s_step'] / t['sample_s_step']:.2f}x "
          f"| update {o['update_s_step'] / t['update_s_step']:.2f}x | by CPU seconds: s/step "
          f"{o['cpu_s_step'] / t['cpu_s_step']:.2f}x, sampling {o['cpu_sample_s_step'] / t['cpu_sample_s_step']:.2f}x, "
          f"update {o['cpu_update_s_step'] / t['cpu_update_s_step']:.2f}x | peak RSS {o['peak_rss_mb'] / t['peak_rss_mb']:.2f}x "
          f"| held-out n {len(task.held)} | total {time.perf_counter() - t_start:.0f}s")
    if args.out:
        write_json(args.out, {"setup": {k: v for k, v in job.items() if not k.startswith(("train_", "prompt", "probe"))}
                              | {"probe_logit_max_diff": probe_diff}, "sides": sides})
    if tmp:
        tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(cli.run_cli(main))
