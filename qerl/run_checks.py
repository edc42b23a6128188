"""The checks of a 05 run before any work: --resume's arguments, the flags and their combinations, the run
folder, the task and its data, every prompt within the context, --batch within the task, the memory. Imports
no stage: what a check needs of one (05's parser and defaults, 03's config reader, 04's schedule check)
comes in as an argument.
"""
import argparse
import datetime
import os

from qerl import checkpoints
from qerl import devices
from qerl import engine
from qerl import hf_files
from qerl import memory
from qerl import runs
from qerl import tasks

# A flag the chosen options do not read is refused: args.json would record it as if it had counted. Such a
# flag is declared with `add_flag(..., read_when=(whether this run reads it, the options that make it read))`.


def add_flag(group, *names, read_when=None, **kw):
    """group.add_argument(*names, **kw), with the flag's `read_when` kept on its action: check_args refuses the
    flag away from its default in a run that does not read it, and check_resumed_args checks it on --resume
    as every flag, so a new flag needs no second edit."""
    action = group.add_argument(*names, **kw)
    action.read_when = read_when
    return action


def read_when_flags(parser):
    """{flag's action: (whether this run reads it, the options that make it read)}, every flag declared with one."""
    return {a: a.read_when for a in parser._actions if getattr(a, "read_when", None)}


def check_run(args, task, world, device, stage):
    """Before the model loads -> (--resume's checkpoint folder and trainer state or None, None; the task; why
    --dtype auto chose its dtype). --resume takes the run's hyper-parameters from its checkpoint; then every
    check: the flags, the run folder, the task and its data, every prompt within the context, --batch within
    the task, the memory. `stage`: 05, whose parser_defaults, check_resumed_args, check_args, use_gpu_path and
    check_sizes these are."""
    for flag, fix in (("resume", "the run (or checkpoint) folder to continue, or drop --resume for a new run"),
                      ("out", "a folder, or drop --out for runs/<timestamp>")):
        value = getattr(args, flag)
        if value is not None and not value.strip():  # '' (an unset shell variable) would read as "not given"
            raise ValueError(f"--{flag} {value!r} names no folder: give {fix}")
    ckpt, state = checkpoints.resume_args(args, stage.parser_defaults())
    if ckpt:
        stage.check_resumed_args(args)
        checkpoints.check_saved_args(ckpt, state)
        checkpoints.check_progress(ckpt, state, args)
        if getattr(args, "world_size", world) != world:  # args.json records it (a run before that: unknown)
            print(f"note | resuming a run of {args.world_size} rank(s) on {world}: each rank's share of the groups "
                  f"and its sampling stream change, so the run goes on validly but not as the uninterrupted one")
    args.world_size = world
    args.out = args.out or os.path.join("runs", datetime.datetime.now().strftime("%Y%m%d-%H%M%S"))
    stage.check_args(args, world, ckpt)
    if args.gpu_path:
        stage.use_gpu_path(device)
    if getattr(args, "plain", False):
        stage.use_plain_path()
    task = task or tasks.make_task(args, stage.parser_defaults())  # bad data fails here, before the model loads
    return ckpt, state, task, stage.check_sizes(args, task, world, device)


def check_sizes(args, task, world, device, model_config, policy_dtype):
    """Before the model loads: every prompt within the context (tasks.check_prompts_fit), what memory.run_memory
    estimates within the memory free on the device, and --batch within what the task gives a step.
    model_config: a config.json dict -> its ModelConfig (03's); policy_dtype: 05's."""
    raw, weight_map, _ = hf_files.find_weight_files(args.model)
    cfg, tok = model_config(raw), hf_files.load_tokenizer(args.model, raw)
    hf_files.check_config_fits_weights(args.model, raw, weight_map)  # before an estimate made from a wrong config
    tasks.check_reward_text(task, tok, args.model)  # what the reward reads survives the tokenizer
    P = tasks.check_prompts_fit(task, tok, cfg.max_position_embeddings, args.max_new_tokens,
                                task.problems(args.seed, 0, min(args.batch, 64)))  # the longest prompt, in tokens
    dtype, why = policy_dtype(args, device, cfg)
    args.dtype = str(dtype).replace("torch.", "")  # the choice goes into args.json: a resume computes alike
    adapters, phases = memory.run_memory(args, cfg, P, world, dtype.itemsize, device)
    largest = max(phases, key=phases.get)
    what = largest if phases[largest] > adapters else f"--lora-r {args.lora_r}'s adapters"
    devices.check_memory_fits(adapters + phases[largest], device, f"this run (mostly {what})")
    wanted = args.batch * (1 + args.dynamic_sampling)  # --dynamic-sampling's rounds draw on from the batch
    try:  # drawn after the memory check bounded --batch
        given = len(task.problems(args.seed, 0, wanted))
    except tasks.TooFewProblems as e:
        given = e.given
    if given < args.batch:
        raise ValueError(f"--batch {args.batch} is more than --task {args.task} gives a step ({given} problems): "
                         f"lower --batch to {given} or less")
    if given < wanted:
        raise ValueError(f"--dynamic-sampling {args.dynamic_sampling} draws up to {wanted} problems a step (--batch "
                         f"{args.batch} a round), more than --task {args.task} gives ({given}): lower "
                         f"--dynamic-sampling to {given // args.batch - 1} or less")
    return why


def check_args(args, world, ckpt, defaults, read_when, check_schedule):
    """What argparse's ranges cannot see: combinations of flags, the model folder and the run folder.
    defaults: the parser's {dest: default}; read_when: read_when_flags(the parser); check_schedule: 04's."""
    if args.batch < 1 or args.group < 2:
        raise ValueError(f"need --batch >= 1 and --group >= 2 (got {args.batch}, {args.group}): GRPO compares "
                         f"samples within a group")
    if args.steps < 1 or args.mu < 1 or (args.micro_batch != "auto" and args.micro_batch < 0):
        raise ValueError(f"need --steps >= 1, --mu >= 1 and --micro-batch >= 0 (0: all rows at once), got "
                         f"{args.steps}, {args.mu}, {args.micro_batch}")
    if args.quant_method != "rtn" and args.quant != "nvfp4":
        raise ValueError(f"--quant-method {args.quant_method} is a rounding of NVFP4 weights: it needs --quant nvfp4 "
                         f"(got --quant {args.quant})")
    if args.aqn and args.aqn_kind != "none" and args.aqn_site == "block-scales" and args.quant != "nvfp4":  # 04 SITES
        raise ValueError(f"--aqn-site block-scales puts the noise on NVFP4's block scales: it needs --quant nvfp4 "
                         f"(got --quant {args.quant})")
    for action, (reads, when) in read_when.items():
        if getattr(args, action.dest) != defaults[action.dest] and not reads(args):
            flag = action.option_strings[0]
            raise ValueError(f"{flag} {getattr(args, action.dest)} is read only with {when}, which this run does not "
                             f"have: drop {flag}")
    if args.aqn and args.aqn_kind != "feedback":  # the schedule's stages and range, before any work
        check_schedule(args.steps, args.num_stages, args.sigma_start, args.sigma_end, args.aqn_kind)
    if args.warmup >= args.steps:
        print(f"note | --warmup {args.warmup} is not below --steps {args.steps}: the LR never leaves its warmup and "
              f"peaks at {args.steps / args.warmup:.0%} of --lr {args.lr:g}")
    check_budget(args, ckpt)
    if args.temperature < engine.MIN_TEMPERATURE:
        raise ValueError(f"--temperature {args.temperature:g} is too small to sample with: need >= "
                         f"{engine.MIN_TEMPERATURE:g}")
    if args.train_norms and args.beta > 0:
        raise ValueError("--train-norms with --beta > 0 is not supported: the KL reference (the base under "
                         "lora_disabled) would keep the trained gains; drop one of the two")
    if args.batch < world:
        raise ValueError(f"--batch {args.batch} is smaller than the number of ranks ({world}): every rank "
                         f"needs at least one prompt group; raise --batch or launch fewer processes")
    try:  # fail before the data and the model load
        hf_files.find_weight_files(args.model)
    except FileNotFoundError as e:
        raise FileNotFoundError(f"--model {args.model!r} is not a model folder ({e})") from None
    runs.check_run_folder(args, ckpt)


def check_budget(args, ckpt):
    """--max-completions against what --steps can sample: a step samples --batch x --group completions, and up to
    --dynamic-sampling more rounds of as many. The LR and AQN schedules run over the budget (runs.Milestones
    .schedule_step), so a budget the steps cannot spend ends the run at --steps with its schedules short of their
    end (at 1e18, never past their first step: no noise, the LR of step 0). Refused for a new run; a resume keeps
    its checkpoint's, with a note. Beyond --steps x --batch x --group, only refills spend the rest: a note."""
    plain = args.steps * args.batch * args.group
    most = plain * (1 + args.dynamic_sampling)
    if args.max_completions > most:
        line = (f"--max-completions {args.max_completions:,} is more than --steps {args.steps} can sample ({most:,} at "
                f"most: --batch x --group{' x (1 + --dynamic-sampling)' if args.dynamic_sampling else ''} a step), so "
                f"the run would end at --steps with its LR and AQN schedules, which run over the budget, at most "
                f"{most / args.max_completions:.0%} of their way")
        if ckpt is None:
            raise ValueError(f"{line}: lower --max-completions to {plain:,} (--steps x --batch x --group) or less, or "
                             f"raise --steps")
        print(f"note | {line} (a resume keeps its checkpoint's budget)")
    elif args.max_completions > plain:
        print(f"note | --max-completions {args.max_completions:,} is more than --steps x --batch x --group ({plain:,}): "
              f"only --dynamic-sampling's refills spend the rest, and a run that refills less ends at --steps with its "
              f"LR and AQN schedules short of their end")


def check_resumed_args(args, parser):
    """--resume: every argument the checkpoint gave, within its flag's own range and choices (an edited or
    damaged trainer_state.pt could hold --grad-clip -1, which would flip the clipped gradient's sign)."""
    for action in parser._actions:  # every flag: a new one is checked here as it is declared
        value = getattr(args, action.dest, None)
        unset = value is None and action.default is None  # --data, --out...: not given
        if not action.option_strings or action.default == argparse.SUPPRESS or unset:  # SUPPRESS: --help
            continue
        switch = isinstance(action.default, bool)  # --aqn, --quiet...: True or False, and only they are
        try:
            if switch or isinstance(value, bool):
                if not (switch and isinstance(value, bool)):
                    raise ValueError("not True or False" if switch else "a switch's value")
            elif action.choices is not None and value not in action.choices:
                raise ValueError(f"not one of {', '.join(map(str, action.choices))}")
            elif action.type is not None and action.type(str(value)) != value:  # '0.5' (text) for 0.5
                raise ValueError(f"a {type(value).__name__}")
            elif action.type is None and not isinstance(value, str):  # a folder, a device: text
                raise ValueError(f"a {type(value).__name__}, not text")
        except (argparse.ArgumentTypeError, ValueError) as e:
            raise ValueError(f"--resume: the checkpoint's {action.option_strings[0]} {value!r} is not a value of that "
                             f"flag ({e}): its trainer_state.pt is damaged or edited; resume from another "
                             f"checkpoint") from None
