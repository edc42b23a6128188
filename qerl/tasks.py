"""The RL tasks that qerl/train.py trains on, and their data files: what a problem is, the prompt it is asked
as, how an answer is graded and rewarded, and which problems are held out. Three ship, chosen by --task
from TASKS: synthetic arithmetic (the bundled tiny model's task), a GSM8K-style JSONL file, and chat
arithmetic for a real instruct model. `Task` below is the whole contract a new task meets. Imports no stage.
"""
import json
import os
import random
import re
from fractions import Fraction
from pathlib import Path

from qerl import files
from qerl import hf_files

# -----------------------------------------------------------------------------
# The contract


class Task:
    """What 05's loop asks of a task, and all it asks. A new task is a subclass with these, and one
    entry in TASKS (or an object passed as `train(args, task=...)`, which skips the registry).

    Class attributes, read by make_task and the command line:
      help        the one line --task's help shows for it.
      reads       the task-only flags (argparse dests, from TASK_FLAGS) that from_args reads. make_task
                  refuses any other task flag given on the command line (differing from its default),
                  since args.json would record it as if it counted. A new task-only flag: add its dest
                  to TASK_FLAGS and its `--flag` to 05's build_parser.
      reads_data  whether --data is this task's file: make_task then requires --data, and refuses
                  --data for every task without it.
      system      whether prompts carry the paper's instruction (PAPER_INSTRUCTION) as the system
                  message. make_task decides it from --system and passes it to from_args.
      reward_text the pieces of text reward and correct read in a completion (digits, signs, tags): the
                  run refuses a tokenizer that does not give each back from encode and decode.

    Built by `from_args(args, system)` (a classmethod): the task from the parsed command line.

    An instance has:
      held        the held-out problems, a list of dicts each with a "question" (what evaluation
                  measures; empty for --eval-size 0). problems() never returns one of them.
      train       optional: the training problems as a list, when the task has a finite set; 05 checks
                  that every prompt of `held` and `train` fits the model's context before any work.
      problems(seed, step, n)   the step's n training problems (dicts, whatever keys the task's own
                  methods need). A pure function of (seed, step), so a resumed run draws what an
                  uninterrupted one would, and prefix-stable: the first k of n are problems(seed, step, k)
                  (05's --dynamic-sampling draws a step's further problems so). Never silently short: n
                  problems, or TooFewProblems when the task cannot give n (05 refuses such a --batch).
      prompt(problem) -> str    the whole prompt text, chat template included, that the model continues.
      correct(problem, completion) -> bool   whether a completion (decoded text, or None) solves it:
                  what accuracy and pass@k count.
      reward(problem, completion) -> float   the RL reward; never raises on malformed text.
    """
    help = ""
    reads = ()
    reads_data = False
    reward_text = ()  # what reward and correct read in a completion: each must survive encode and decode
    system = False

    @classmethod
    def from_args(cls, args, system):
        raise NotImplementedError(f"{cls.__name__}.from_args(args, system): build the task from the command line")

    def problems(self, seed, step, n):
        raise NotImplementedError(f"{type(self).__name__}.problems(seed, step, n)")

    def prompt(self, problem):
        raise NotImplementedError(f"{type(self).__name__}.prompt(problem)")

    def correct(self, problem, completion):
        raise NotImplementedError(f"{type(self).__name__}.correct(problem, completion)")

    def reward(self, problem, completion):  # the plain default: 1.0 if correct, else 0.0
        return float(self.correct(problem, completion))


class TooFewProblems(ValueError):
    """problems(seed, step, n) for an n beyond what the task gives a step; `given` is the most it can."""

    def __init__(self, what, n, given):
        super().__init__(f"{what} gives at most {given} problems a step, not {n}")
        self.given = given


def distinct_draws(pool, n, rng):
    """n distinct items of pool in a seeded order, each the next uniform index not yet drawn: prefix-stable in n,
    and the very picks of random.sample(pool, n) wherever that draws so (n below ~86 for a pool of 803)."""
    taken, out = set(), []
    while len(out) < n:
        j = rng.randrange(len(pool))
        if j not in taken:
            taken.add(j)
            out.append(pool[j])
    return out


# -----------------------------------------------------------------------------
# The paper's answer format: <think> reasoning </think> <answer> number </answer>

# The paper's instruction (App. E). The bundled tiny model learned the format in pretraining, so its
# prompt is the bare problem ("qerl_prompt": "bare" in its config.json).
PAPER_INSTRUCTION = ("Solve the following math problem step by step. The reasoning process and direct answer "
                     "are enclosed within <think> </think> and <answer> </answer> tags, respectively, i.e., "
                     "<think> reasoning process here </think> <answer> answer here </answer>.")
EVAL_SEED, EVAL_POOL = 1234, 2000  # the held-out stream; its first EVAL_POOL questions never train
FORMAT_REWARD = 0.1
# A number longer than this (commas dropped) is no answer a policy is graded on: parse_number reads it as
# none, which bounds the work a completion can ask for, and a gold answer that long is refused at load.
MAX_NUMBER_CHARS = 100
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")
# exactly one think block then one answer block (whitespace allowed between and around); linear: the
# tempered dots stop at the first tag, so a failed match gives back each character once
_FORMAT = re.compile(r"\s*<think>((?!</?think>).)*</think>\s*<answer>((?!</?answer>).)*</answer>\s*", re.S)
_EOS_STRINGS = ("<|im_end|>", "<|endoftext|>")


def parse_number(text):
    """The last number in `text` as an exact Fraction ("1,234.50" -> 2469/2), or None (also when it is
    longer than MAX_NUMBER_CHARS)."""
    found = _NUMBER.findall(text or "")
    number = found[-1].replace(",", "") if found else ""
    try:
        return Fraction(number) if 0 < len(number) <= MAX_NUMBER_CHARS else None
    except (ValueError, ZeroDivisionError):
        return None


def _strip_eos(completion):  # a sampler may or may not decode the stop token
    text = completion if isinstance(completion, str) else ""
    for eos in _EOS_STRINGS:
        text = text.replace(eos, "")
    return text


def answer_block(completion):
    """The text inside the last <answer>...</answer> of a completion (stop tokens removed), or None."""
    # Blocks left to right, each from an <answer> to the first </answer> after it; scanned with find (a
    # lazy regex rescans the rest of the text from every unclosed <answer>: quadratic)
    text, block, end = _strip_eos(completion), None, 0
    while (start := text.find("<answer>", end)) >= 0 and (end := text.find("</answer>", start + 8)) >= 0:
        block, end = text[start + 8:end], end + 9
    return block


def extract_answer(completion):
    """The last number in the last <answer>...</answer> of a completion, or None."""
    block = answer_block(completion)
    return parse_number(block) if block is not None else None


class AnswerTask(Task):
    """Problems {"question", "answer"} answered as <think>...</think><answer>number</answer>.

    correct: the last number in the last <answer> block equals the gold number, the last number in
    problem["answer"] (both exact Fractions: "1,200" == "1200", "12.50" == "12.5"; no number in either:
    not correct). `answer_of(completion)` and `gold_of(problem)` are the two sides, and `correct`
    compares them with ==; a task whose answer is something else (a list, a word) overrides both.
    reward: 1.0 if correct, plus FORMAT_REWARD (0.1) if format_ok: exactly one think block then one answer
    block, whitespace around them, a decoded stop token ignored, and an answer_of that is not None."""
    reads = ("system",)
    reward_text = ("<think>", "</think>", "<answer>", "</answer>", *"0123456789", "-", ".", ",")

    def prompt(self, problem):
        return hf_files.chat_prompt(problem["question"], system=PAPER_INSTRUCTION if self.system else None)

    def answer_of(self, completion):
        """The parsed answer of a completion, or None when it gives none: the last number in its last
        <answer> block, as a Fraction."""
        return extract_answer(completion)

    def gold_of(self, problem):
        """The parsed gold answer, comparable with == to answer_of's: the last number in problem["answer"]."""
        return parse_number(str(problem["answer"]))

    def correct(self, problem, completion):
        answer, gold = self.answer_of(completion), self.gold_of(problem)
        return answer is not None and gold is not None and answer == gold

    def format_ok(self, completion):
        return _FORMAT.fullmatch(_strip_eos(completion)) is not None and self.answer_of(completion) is not None

    def reward(self, problem, completion):
        return float(self.correct(problem, completion)) + (FORMAT_REWARD if self.format_ok(completion) else 0.0)


# The same grading as functions of (completion, gold number), for scripts and tests without a task object.
_NUMERIC = AnswerTask()


def answer_correct(completion, gold):
    """The one definition of "solved": the last number in the last <answer> block is the gold number."""
    return _NUMERIC.correct({"answer": gold}, completion)


def format_ok(completion):
    """Whether a completion is exactly <think>...</think><answer>number</answer>: one block of each, in
    that order, whitespace allowed around them, a decoded stop token ignored."""
    return _NUMERIC.format_ok(completion)


def reward_fn(completion, gold):
    """1.0 if correct, plus 0.1 if format_ok. Never raises: malformed text just scores lower."""
    return _NUMERIC.reward({"answer": gold}, completion)


# -----------------------------------------------------------------------------
# Synthetic arithmetic (--task arithmetic)


def make_problem(rng, digits=3, nops=2, ops="+-"):
    """One problem {question, answer, solution} from a random.Random: `a op b op c = ?`, worked left to
    right; `solution` is the completion the tiny model was pretrained on."""
    def operand():  # the digit count is drawn first: small numbers are as common as large ones
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


def arithmetic_space(digits, nops, ops="+-"):
    """How many distinct questions make_problem can write: 10^digits operand values, len(ops) operators."""
    return (10 ** digits) ** (nops + 1) * len(ops) ** nops


def arithmetic_problems(n, seed, digits=3, nops=2, exclude=frozenset()):
    """The first n distinct problems of the stream `seed` whose questions are not in `exclude`."""
    rng, seen, out = random.Random(seed), set(exclude), []
    if len(seen) + n > arithmetic_space(digits, nops):
        raise ValueError(f"{n} new problems wanted but --digits {digits} --nops {nops} has only "
                         f"{arithmetic_space(digits, nops)} distinct ones, {len(exclude)} of them held out")
    while len(out) < n:
        p = make_problem(rng, digits, nops)
        if p["question"] not in seen:
            seen.add(p["question"])
            out.append(p)
    return out


class ArithmeticTask(AnswerTask):
    """The synthetic task (~4e9 problems at 3 digits and 2 operations); training skips the whole
    held-out pool, not only the part that is evaluated."""
    help = "synthetic arithmetic (63-4-597=?), the bundled model's task"
    reads = ("digits", "nops", "system")

    def __init__(self, digits=3, nops=2, eval_size=500, system=False):
        self.digits, self.nops, self.system = digits, nops, system
        pool_size, space = max(EVAL_POOL, eval_size), arithmetic_space(digits, nops)
        if space < 2 * pool_size:  # drawing distinct problems from a nearly exhausted space never ends
            raise ValueError(f"--digits {digits} --nops {nops} makes only {space} distinct problems, and the held-out "
                             f"pool alone takes {pool_size} (with as many left to train on): raise --digits or --nops")
        pool = arithmetic_problems(max(EVAL_POOL, eval_size), EVAL_SEED, digits, nops)
        self.held, self.exclude = pool[:eval_size], frozenset(p["question"] for p in pool)

    @classmethod
    def from_args(cls, args, system):
        return cls(args.digits, args.nops, args.eval_size, system)

    def problems(self, seed, step, n):
        return arithmetic_problems(n, seed * 1_000_003 + step, self.digits, self.nops, self.exclude)


# -----------------------------------------------------------------------------
# GSM8K-style data (--task gsm8k): a JSONL file of {"question", "answer": "... #### n"} lines


def _gsm8k_problem(line):
    """{question, answer} from one JSONL line, the gold being the number after the last '####'; None for a
    line that is no problem (not JSON, no question, no '####'); an error for a gold that is not a number."""
    try:
        row = json.loads(line.lstrip("\ufeff"))  # a byte-order mark, as some editors write, is not content
    except (json.JSONDecodeError, RecursionError):  # RecursionError: a line nested 100,000 levels
        return None
    if not isinstance(row, dict) or not isinstance(row.get("question"), str) or not row["question"].strip() \
            or not isinstance(row.get("answer"), str) or "####" not in row["answer"]:
        return None
    gold = row["answer"].rsplit("####", 1)[1].strip().replace(",", "")  # "... #### 1,200" -> "1200"
    return {"question": row["question"].strip(), "answer": _gold_number(gold)}


# The other ways a gold answer may write a number: a sign, an exponent, a fraction
_GOLD_FORMS = re.compile(r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE](?P<exp>[-+]?\d+))?|[-+]?\d+/\d+")


def _gold_number(text):
    """A gold answer as the scorer reads numbers (parse_number: the digits as written, one sign): itself
    when it is one such number, else 1e5, 1/2 or a Unicode minus (−7) rewritten as one (100000, 0.5, -7).
    Anything else would be scored as its last digits (1e5 as 5), and a number over MAX_NUMBER_CHARS
    written out never: an error."""
    text = text.replace("\u2212", "-")
    form = _GOLD_FORMS.fullmatch(text) if len(text) <= MAX_NUMBER_CHARS else None  # the regex: short text only
    if len(text) > MAX_NUMBER_CHARS or (form and abs(int(form["exp"] or 0)) > MAX_NUMBER_CHARS):
        raise ValueError(_unscorable(text))  # before Fraction("1e100000000") would write out 10^100000000
    if _NUMBER.fullmatch(text):
        return text
    try:
        value = Fraction(text) if form else None
    except ZeroDivisionError:
        value = None
    if value is None:
        raise ValueError(f"the answer after '####' is {text!r}, not a number (write it as 42, -3.5, 1e5 or "
                         f"1/2)")
    for k in range(16):  # the fewest decimals that write it exactly
        scaled = value * 10 ** k
        if scaled.denominator == 1:
            digits = str(abs(scaled.numerator)).rjust(k + 1, "0")
            written = ("-" if value < 0 else "") + (f"{digits[:-k]}.{digits[-k:]}" if k else digits)
            if len(written) > MAX_NUMBER_CHARS:
                raise ValueError(_unscorable(text))
            return written
    raise ValueError(f"the answer after '####' is {text!r}, which no decimal writes exactly (the scorer reads "
                     f"decimals): round it, e.g. {float(value):.6g}")


def _unscorable(text):
    return (f"the answer after '####' is {text[:20]!r}{'...' if len(text) > 20 else ''}, over {MAX_NUMBER_CHARS} "
            "characters written out: the scorer reads no number that long, so it could never be scored; drop the line")


def load_jsonl(path):
    """Problems [{question, answer}] from a GSM8K-style JSONL file; malformed lines, and lines holding bytes
    that are not UTF-8, are skipped and counted (a line of output each), a file without one usable line is
    an error."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"data file {path!r} not found (expected JSONL lines with 'question' and "
                                f"'answer' ending in '#### <number>', or use --task arithmetic)")
    text = files.read_text(path, "data file ")  # a pipe is refused; undecodable bytes -> U+FFFD
    parsed, garbled = [], []
    for n, line in enumerate(text.split("\n"), 1):
        if "\ufffd" in line:  # bytes that are not UTF-8 (or a converter's mark of them): a garbled question
            garbled.append(n)
            continue
        try:
            parsed += [(n, _gsm8k_problem(line))] if line.strip() else []
        except ValueError as e:  # a gold the scorer would misread
            raise ValueError(f"{path}:{n}: {e}") from None
    problems, bad = [dict(p, where=f"{path}:{n}") for n, p in parsed if p], [n for n, p in parsed if not p]
    if garbled:
        print(f"data | {path}:{garbled[0]}: bytes that are not UTF-8 (U+FFFD): skipped {len(garbled)} such line(s)")
    if bad:
        print(f"data | {path}: skipped {len(bad)} malformed line(s) (first at line {bad[0]}); kept {len(problems)}")
    if not problems:
        raise ValueError(f"data file {path!r} has no usable problems (need JSON lines with 'question' and "
                         f"'answer' ending in '#### <number>')")
    return problems


class JsonlTask(AnswerTask):
    """A GSM8K-style file (read by load_jsonl); the held-out set is --eval-data, or a fixed random slice
    of the file."""
    help = "GSM8K-style JSONL problems from --data"
    reads_data, reads = True, ("data", "eval_data", "system")

    def __init__(self, path, eval_path=None, eval_size=500, system=True):
        train, self.system = load_jsonl(path), system
        if eval_path:
            held = load_jsonl(eval_path)[:eval_size]
        else:
            n_eval = min(eval_size, len(train) // 2)
            random.Random(EVAL_SEED).shuffle(train)
            held, train = train[:n_eval], train[n_eval:]
        self.held, held_q = held, {p["question"] for p in held}
        self.train = [p for p in train if p["question"] not in held_q]  # eval problems never train
        if not self.train:
            raise ValueError(f"no training problems left in {path!r} after removing the evaluation set")
        if eval_size > 0 and not self.held:
            raise ValueError(f"{path!r} has {len(train)} problem(s), too few to hold any out for evaluation: pass "
                             f"--eval-data FILE, or --eval-size 0 for no evaluation")

    @classmethod
    def from_args(cls, args, system):
        return cls(args.data, args.eval_data, args.eval_size, system)

    def problems(self, seed, step, n):  # a seeded sample of the file each step; past its size, another round
        rng, out = random.Random(seed * 1_000_003 + step), []
        while len(out) < n:
            out += distinct_draws(self.train, min(n - len(out), len(self.train)), rng)
        return out


# -----------------------------------------------------------------------------
# Chat arithmetic for a real instruct model (--task chat-arithmetic)


class ChatArithmeticTask(AnswerTask):
    """For a real instruct model (SmolLM2-135M-Instruct, assets/smollm2.py): "What is 13 - 4?" in its own
    chat template, system message included, answered in its own words. Correct = the last number of the
    whole reply equals the gold number; no format bonus, since such a model writes no tags. +/- on 0..20
    and x on 2..12 (1,003 problems): SmolLM2 solves 17% of the held-out ones greedily, mostly losing to
    long-winded replies that run out of tokens."""
    help = "What is 13 - 4? in a chat model's own template (SmolLM2)"
    reads = ()  # its system message is the model's own
    reward_text = (*"0123456789", "-")  # the reply's last number: no tags

    def __init__(self, eval_size=200, system_message=None):
        pool = [(f"What is {a} + {b}?", a + b) for a in range(21) for b in range(21)]
        pool += [(f"What is {a} - {b}?", a - b) for a in range(21) for b in range(21)]
        pool += [(f"What is {a} times {b}?", a * b) for a in range(2, 13) for b in range(2, 13)]
        if not 0 <= eval_size <= len(pool) // 2:
            raise ValueError(f"--task chat-arithmetic has {len(pool)} problems: --eval-size must be 0..{len(pool) // 2}")
        problems = [{"question": q, "answer": str(a)} for q, a in pool]
        random.Random(EVAL_SEED).shuffle(problems)
        self.held, self.train, self.system_message = problems[:eval_size], problems[eval_size:], system_message

    @classmethod
    def from_args(cls, args, system):  # the model's own default system message, not the paper's instruction
        return cls(args.eval_size, hf_files.template_default_system(Path(args.model) / "tokenizer_config.json"))

    def prompt(self, problem):
        return hf_files.chat_prompt(problem["question"], system=self.system_message)

    def answer_of(self, completion):  # the last number of the whole reply: no tags
        return parse_number(_strip_eos(completion))

    def reward(self, problem, completion):
        return float(self.correct(problem, completion))

    def problems(self, seed, step, n):  # a fresh seeded sample of the training problems each step
        if n > len(self.train):
            raise TooFewProblems("--task chat-arithmetic", n, len(self.train))
        return distinct_draws(self.train, n, random.Random(seed * 1_000_003 + step))


# -----------------------------------------------------------------------------
# The registry and the command line

# --task NAME -> its class; make_task builds it with `from_args(args, system)`
TASKS = {"arithmetic": ArithmeticTask, "gsm8k": JsonlTask, "chat-arithmetic": ChatArithmeticTask}

TASK_FLAGS = ("data", "eval_data", "digits", "nops", "system")  # the flags that only some tasks read


def make_task(args, defaults):
    """The task --task names, built from its flags (`from_args`); its prompts carry the paper's instruction
    as --system says. --data is the file of a task that reads one (gsm8k), and only of such a task.

    `defaults` gives each flag's default, to tell a task flag given on the command line from one left
    alone: the argparse parser that parsed `args` (05's build_parser(); its get_default is read), or a
    dict {dest: default} holding every name in TASK_FLAGS."""
    if args.task not in TASKS:
        raise ValueError(f"unknown task {args.task!r}: choose one of {', '.join(TASKS)}")
    cls, file_tasks = TASKS[args.task], " or ".join(f"--task {n}" for n, c in TASKS.items() if c.reads_data)
    if cls.reads_data and not args.data:
        raise ValueError(f"--task {args.task} needs --data FILE (JSONL lines with 'question' and 'answer' ending in "
                         f"'#### <number>')")
    if args.data and not cls.reads_data:
        raise ValueError(f"--data is the file of {file_tasks}, but the task is {args.task}: add {file_tasks} to "
                         f"train on {args.data!r}, or drop --data")
    default_of = defaults.get_default if hasattr(defaults, "get_default") else defaults.__getitem__
    for name in TASK_FLAGS:  # a flag the task does not read would be recorded in args.json as if it counted
        value = getattr(args, name)
        if name not in cls.reads and value != default_of(name):
            readers = " or ".join(f"--task {n}" for n, c in TASKS.items() if name in c.reads)
            flag = "--" + name.replace("_", "-")
            raise ValueError(f"{flag} {value} is read only by {readers}, and --task {args.task} ignores it: drop "
                             f"{flag}")
    system = args.system == "paper" or (args.system == "auto" and
                                        hf_files.find_weight_files(args.model)[0].get("qerl_prompt") != "bare")
    return cls.from_args(args, system)


def check_reward_text(task, tok, model):
    """Each piece of text the task's reward reads (task.reward_text: digits, signs, answer tags) must come back
    from the tokenizer's encode and decode as it went in: a digit or a tag marked special vanishes on decode,
    and a decoder can rewrite a character, so the reward would read another answer than the model wrote."""
    for text in getattr(task, "reward_text", ()):
        back = tok.decode(tok.encode(text))
        if back.strip() != text:
            raise ValueError(f"{model}: its tokenizer turns {text!r} into {back!r} (encode, then decode), and the "
                             f"task's reward reads {text!r}: a token marked special, or a decoder that rewrites "
                             f"it; fix tokenizer.json or use another model")


def check_prompts_fit(task, tok, context, max_new_tokens, problems=()):
    """Every held-out and file problem's prompt (and those of `problems`) plus --max-new-tokens fits the
    model's context, checked at the start with the problem's file line (not found steps later as 'prompt
    1'). Returns the longest prompt's length in tokens."""
    longest = 0
    # A token stands for at most `widest` bytes of text (its vocabulary entry's UTF-8 length bounds it), so a
    # prompt of more than 4 x widest x context characters cannot fit (the 4 covers normalizers that shorten
    # text): refused before the tokenizer sees it (a 1 GB line aborts the Rust tokenizer).
    widest = max((len(t.encode()) for t in tok.tok.get_vocab(with_added_tokens=True)), default=1)
    for p in [*task.held, *getattr(task, "train", []), *problems]:
        prompt, where = task.prompt(p), p.get("where", f"question {p['question'][:40]!r}")
        if len(prompt) > 4 * widest * context:
            raise ValueError(f"{where}: the prompt has {len(prompt):,} characters, more than the model's context of "
                             f"{context} tokens can hold (shorten or drop it)")
        n = len(tok.encode(prompt))
        if n + max_new_tokens > context:
            raise ValueError(f"{where}: the prompt has {n} tokens; with --max-new-tokens {max_new_tokens} that exceeds "
                             f"the model's context of {context} (shorten or drop it, or lower --max-new-tokens)")
        longest = max(longest, n)
    return longest
