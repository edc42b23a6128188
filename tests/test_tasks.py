"""tasks.py: the task contract (problems pure in (seed, step), held-out problems never trained on, a step
gets the problems it asks for), grading and rewards by hand, the GSM8K-style loader, the registry and
make_task's flag checks, and a forker's task whose answer is a list, not a number."""
import json
import os
import random
import re
from fractions import Fraction

import pytest

from qerl import tasks
from qerl import train as grpo

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "assets", "tiny-qwen")


def task_parser():
    """The trainer's own parser (qerl.train.build_parser): the task flags, their choices and defaults as a run
    reads them, never a copy that could drift."""
    return grpo.build_parser()


def parse(*argv):
    return task_parser().parse_args([str(a) for a in argv])


def make(*argv):
    return tasks.make_task(parse(*argv), task_parser())


def write_jsonl(path, rows):
    path.write_text("".join(r if isinstance(r, str) else json.dumps(r) + "\n" for r in rows))
    return str(path)

# -----------------------------------------------------------------------------
# Grading: what is compared, the reward and the format bonus


def test_problem_is_worked_left_to_right():
    p = tasks.make_problem(random.Random(3), digits=3, nops=2)
    a, op1, b, op2, c = [int(x) if x.isdigit() else x for x in
                         p["question"][:-2].replace("+", " + ").replace("-", " - ").split()]
    want = (a + b if op1 == "+" else a - b)
    want = want + c if op2 == "+" else want - c
    assert p["answer"] == str(want)
    assert p["solution"].endswith(f"<answer>{want}</answer>") and p["solution"].startswith("<think>")
    assert tasks.reward_fn(p["solution"], p["answer"]) == pytest.approx(1.1)


@pytest.mark.parametrize("text, gold, want", [
    ("<think>1+2=3</think><answer>3</answer>", "3", 1.1),          # correct and well formed
    ("<think>1+2=3</think><answer>3</answer><|im_end|>", "3", 1.1),  # a decoded stop token is ignored
    ("<think>1+2=4</think><answer>4</answer>", "3", 0.1),          # wrong, but the format is right
    ("<think>x</think> <answer> 1,200 </answer>\n", "1200", 1.1),   # commas and whitespace
    ("<answer>7</answer>", "7", 1.0),                               # right answer, no think block
    ("<think>a</think><answer>5</answer> and more", "5", 1.0),      # trailing junk costs the format
    ("<think>a</think><answer>1</answer><answer>2</answer>", "2", 1.0),  # the last answer counts
    ("<think>a</think><answer>12.50</answer>", "12.5", 1.1),        # exact decimal comparison
    ("<think>a</think><answer>abc</answer>", "3", 0.0),             # no number: not even format
    ("<think>unfinished <answer>3", "3", 0.0),                      # truncated
    ("", "3", 0.0),
    (None, "3", 0.0),
    ("<think></think><answer>-538</answer>", "-538", 1.1),          # negative numbers
    ("<think></think><answer>538</answer>", "-538", 0.1),
])
def test_reward(text, gold, want):
    assert tasks.reward_fn(text, gold) == pytest.approx(want)
    # the task's reward is the same function of (problem, completion)
    assert tasks.AnswerTask().reward({"question": "q", "answer": gold}, text) == pytest.approx(want)


@pytest.mark.parametrize("text, want", [
    ("<think>1+2=3</think><answer>3</answer>", True),
    (" <think>a</think>\n<answer> -4.5 </answer> <|im_end|>", True),  # whitespace, a decoded stop token
    ("<think></think><answer>0</answer>", True),                # an empty think block is still the format
    ("<answer>3</answer>", False),                              # no think block
    ("<think>a</think><answer>3</answer>tail", False),          # text after the answer
    ("<think>a</think><think>b</think><answer>3</answer>", False),  # two think blocks
    ("<answer>3</answer><think>a</think>", False),              # wrong order
    ("<think>a</think><answer>three</answer>", False),          # no number in the answer
    ("<think>a <answer>3</answer>", False),                     # unclosed think
    ("", False),
    (None, False),
])
def test_format_ok(text, want):
    assert tasks.format_ok(text) is want
    # the reward's format bonus is exactly format_ok (gold "7" is never right here)
    assert tasks.reward_fn(text, "7") == pytest.approx(0.1 if want else 0.0)


def test_answer_task_compares_the_last_number_of_the_last_answer_block_with_the_gold_number():
    task = tasks.AnswerTask()
    text = "<think>12+3=15</think><answer>first 7, then 1,234.50</answer>"
    assert task.answer_of(text) == Fraction(2469, 2) == task.gold_of({"answer": "1234.5"})
    assert task.gold_of({"answer": 42}) == 42 and task.gold_of({"answer": "none"}) is None
    assert task.answer_of("the answer is 7") is None  # a number outside any <answer> block is no answer
    assert not task.correct({"answer": "none"}, "<answer>none</answer>")  # nothing parsed on either side: wrong
    # the documented weakness a list task must override: only the last number counts
    assert task.correct({"answer": "1 3 31"}, "<answer>31</answer>")

# -----------------------------------------------------------------------------
# The contract, for every shipped task and a forker's


def check_contract(task, n, steps=range(12), seeds=(0, 5)):
    """problems is a pure function of (seed, step), gives n problems, and never a held-out one; prompts are
    text; reward a float, correct a bool, for any completion."""
    assert isinstance(task.help, str) and task.help and isinstance(task.reads, tuple)
    assert all(name in tasks.TASK_FLAGS for name in task.reads)
    held = {p["question"] for p in task.held}
    again = [(seed, step, task.problems(seed, step, n)) for seed in seeds for step in reversed(steps)]
    for seed, step, drawn in again:  # the same problems whatever was drawn before: no hidden state
        assert drawn == task.problems(seed, step, n) and len(drawn) == n
        assert task.problems(seed, step, n // 2) == drawn[:n // 2]  # prefix-stable in n
        assert not {p["question"] for p in drawn} & held, (seed, step)
    assert task.problems(seeds[0], 0, n) != task.problems(seeds[0], 1, n)  # the steps differ
    assert task.problems(seeds[0], 0, n) != task.problems(seeds[1], 0, n)  # the seeds differ
    for p in task.held[:3] + task.problems(0, 0, 3):
        assert isinstance(task.prompt(p), str) and p["question"] in task.prompt(p)
        for text in (None, "", "<think>x</think><answer>1</answer>", "no tags 3"):
            assert type(task.reward(p, text)) is float and type(task.correct(p, text)) is bool


@pytest.mark.parametrize("name", list(tasks.TASKS))
def test_every_registered_task_meets_the_contract(name, tmp_path):
    """Each entry of tasks.TASKS, built as --task NAME builds it (a file task given a generic JSONL file of
    question/answer lines), meets the contract: a new task gets this test without editing a list."""
    cls = tasks.TASKS[name]
    assert issubclass(cls, tasks.Task)
    rows = [{"question": f"What is {i} + {i}?", "answer": f"#### {2 * i}"} for i in range(60)]
    data = ["--data", write_jsonl(tmp_path / "d.jsonl", rows)] if cls.reads_data else []
    task = make("--task", name, *data, "--eval-size", "20")
    check_contract(task, 8, steps=range(4))


def test_the_shipped_tasks_meet_the_contract(tmp_path):
    assert {"arithmetic", "gsm8k", "chat-arithmetic"} <= set(tasks.TASKS)
    arith = make("--eval-size", "50")
    assert len(arith.held) == 50
    check_contract(arith, 16)
    # gsm8k with its own held-out file, which repeats two training questions: they never train
    rows = [{"question": f"q{i}", "answer": f"#### {i}"} for i in range(30)]
    held = write_jsonl(tmp_path / "e.jsonl", rows[:2] + [{"question": "fresh", "answer": "#### 1"}])
    gsm8k = make("--task", "gsm8k", "--data", write_jsonl(tmp_path / "d.jsonl", rows), "--eval-data", held)
    assert len(gsm8k.held) == 3 and len(gsm8k.train) == 28
    check_contract(gsm8k, 8, steps=range(20))  # 20 steps of 8 from a file of 28
    chat = make("--task", "chat-arithmetic", "--eval-size", "200")
    assert len(chat.held) == 200 and len(chat.train) == 803
    check_contract(chat, 16)


def test_splits_exclude_eval_and_are_pure_functions_of_seed_and_step():
    pool = {p["question"] for p in tasks.arithmetic_problems(tasks.EVAL_POOL, tasks.EVAL_SEED)}
    exclude = frozenset(list(pool)[:50])
    task = tasks.ArithmeticTask()
    task.exclude = exclude
    b1 = task.problems(1, 5, 16)
    assert b1 == task.problems(1, 5, 16)  # same (seed, step) -> same problems
    assert b1 != task.problems(1, 6, 16)
    assert not {p["question"] for p in b1} & exclude
    # a forced collision: with an exclusion set holding the stream's first problems they are skipped
    first = tasks.make_problem(random.Random(1 * 1_000_003 + 0))["question"]
    task.exclude = frozenset([first])
    assert first not in {p["question"] for p in task.problems(1, 0, 4)}
    # the eval set is a prefix of the held-out stream, so --eval-size 200 is part of --eval-size 500
    assert tasks.arithmetic_problems(20, tasks.EVAL_SEED) == tasks.arithmetic_problems(50, tasks.EVAL_SEED)[:20]
    # training skips the whole held-out pool, not just the part that is evaluated
    task = make("--eval-size", "300")
    assert len(task.held) == 300 and task.exclude == pool


def test_arithmetic_refuses_a_space_too_small():
    with pytest.raises(ValueError, match="has only 200 distinct ones"):
        tasks.arithmetic_problems(201, 0, digits=1, nops=1)
    with pytest.raises(ValueError, match="makes only 4000 distinct problems"):
        tasks.ArithmeticTask(digits=1, nops=2, eval_size=2001)


def test_the_base_task_names_what_a_subclass_must_write():
    with pytest.raises(NotImplementedError, match=r"Task.problems\(seed, step, n\)"):
        tasks.Task().problems(0, 0, 1)
    with pytest.raises(NotImplementedError, match=r"from_args\(args, system\)"):
        tasks.Task.from_args(parse(), False)

# -----------------------------------------------------------------------------
# GSM8K-style data


def test_gsm8k_loader(tmp_path, capsys):
    path = write_jsonl(tmp_path / "train.jsonl", [
        {"question": "Tom has 3 apples and buys 4. How many?", "answer": "3+4=7\n#### 7"},
        "this is not json\n",
        {"question": "Big", "answer": "lots of work #### 1,200"},
        {"question": "no gold", "answer": "forgot the marker"},
        "\n",
        {"question": "Neg", "answer": "#### -3.5"},
        {"answer": "#### 1"},
    ])
    rows = tasks.load_jsonl(path)
    assert rows == [{"question": "Tom has 3 apples and buys 4. How many?", "answer": "7", "where": f"{path}:1"},
                    {"question": "Big", "answer": "1200", "where": f"{path}:3"},
                    {"question": "Neg", "answer": "-3.5", "where": f"{path}:6"}]  # where: its file line, for errors
    out = capsys.readouterr().out
    assert "skipped 3 malformed line(s) (first at line 2)" in out
    assert tasks.reward_fn("<think>..</think><answer>1,200</answer>", rows[1]["answer"]) == pytest.approx(1.1)

    with pytest.raises(FileNotFoundError, match="not found"):
        tasks.load_jsonl(str(tmp_path / "missing.jsonl"))
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(ValueError, match="no usable problems"):
        tasks.load_jsonl(str(tmp_path / "empty.jsonl"))


def test_gold_answers_read_as_the_scorer_reads_numbers(tmp_path, capsys):
    """1e5, 1/2 and a Unicode minus are the numbers they say (scored as 100000, 0.5, -7, not 5, 2, 7); a
    byte-order mark on a line is not a malformed line; a gold no decimal writes is refused with its line."""
    path = tmp_path / "d.jsonl"
    path.write_text("\ufeff" + "".join(json.dumps({"question": f"q{i}", "answer": f"#### {gold}"}) + "\n"
                                       for i, gold in enumerate(["1e5", "1/2", "\u22127", "1,200", "-3.5"])))
    rows = tasks.load_jsonl(str(path))
    assert [r["answer"] for r in rows] == ["100000", "0.5", "-7", "1200", "-3.5"]
    assert "skipped" not in capsys.readouterr().out  # the BOM line is line 1, read
    assert tasks.reward_fn("<think>.</think><answer>100000</answer>", rows[0]["answer"]) == pytest.approx(1.1)
    assert tasks.reward_fn("<think>.</think><answer>5</answer>", rows[0]["answer"]) == pytest.approx(0.1)
    assert tasks.answer_correct("<answer>0.5</answer>", rows[1]["answer"])
    assert tasks.answer_correct("<answer>-7</answer>", rows[2]["answer"])
    assert not tasks.answer_correct("<answer>7</answer>", rows[2]["answer"])
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"question": "a", "answer": "#### 1"}, {"question": "b", "answer": "#### 1/3"}])
    with pytest.raises(ValueError, match=r"bad.jsonl:2: the answer after '####' is '1/3', which no decimal writes"):
        tasks.load_jsonl(bad)


def test_jsonl_splits_hold_out_eval(tmp_path):
    rows = [{"question": f"q{i}", "answer": f"#### {i}"} for i in range(20)]
    task = make("--task", "gsm8k", "--data", write_jsonl(tmp_path / "d.jsonl", rows), "--eval-size", "5")
    assert isinstance(task, tasks.JsonlTask) and task.system is False  # --system auto: the bundled model's is bare
    train, held = task.train, task.held
    assert len(held) == 5 and len(train) == 15 and not hasattr(task, "exclude")  # a file's split is disjoint
    assert not {p["question"] for p in held} & {p["question"] for p in train}
    # each step a seeded sample of the file, distinct problems up to its size, then another round
    seen = [p["question"] for p in task.problems(0, 3, 20)]
    assert sorted(seen[:15]) == sorted(p["question"] for p in train) and len(set(seen[15:])) == 5
    # --system: the paper's instruction as the system message, or none
    p = {"question": "Tom has 3 apples."}
    assert tasks.make_task(parse("--task", "gsm8k", "--data", tmp_path / "d.jsonl", "--system", "paper"),
                           task_parser()).prompt(p) == (f"<|im_start|>system\n{tasks.PAPER_INSTRUCTION}<|im_end|>\n"
                                                        "<|im_start|>user\nTom has 3 apples.<|im_end|>\n"
                                                        "<|im_start|>assistant\n")
    assert task.prompt(p) == "<|im_start|>user\nTom has 3 apples.<|im_end|>\n<|im_start|>assistant\n"

# -----------------------------------------------------------------------------
# Chat arithmetic for a real instruct model


def test_chat_arithmetic_task_for_a_real_instruct_model(tmp_path):
    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": (
        "{{ '<|im_start|>system\\nYou are SmolLM.<|im_end|>\\n' }}{% for m in messages %}...{% endfor %}")}))
    args = parse("--task", "chat-arithmetic", "--model", folder, "--eval-size", "200")
    task = tasks.TASKS["chat-arithmetic"].from_args(args, system=True)
    assert len(task.held) == 200 and len(task.train) == 803
    assert not {p["question"] for p in task.held} & {p["question"] for p in task.train}  # held out never trains
    p = {"question": "What is 13 - 4?", "answer": "9"}
    assert task.prompt(p) == ("<|im_start|>system\nYou are SmolLM.<|im_end|>\n<|im_start|>user\nWhat is 13 - 4?"
                              "<|im_end|>\n<|im_start|>assistant\n")
    assert task.reward(p, "13 - 4 = 9.<|im_end|>") == 1.0 and task.correct(p, "The answer is 9")
    assert task.reward(p, "13 - 4 is 9, and 9 + 1 = 10") == 0.0 and task.reward(p, "nine") == 0.0
    assert task.reward(p, "<think>x</think><answer>9</answer>") == 1.0  # no format bonus: the tags earn nothing
    assert task.problems(0, 5, 16) == task.problems(0, 5, 16) != task.problems(0, 6, 16)
    assert all(q in task.train for q in task.problems(3, 1, 16))
    with pytest.raises(ValueError, match="chat-arithmetic has 1003 problems: --eval-size must be 0..501"):
        tasks.ChatArithmeticTask(eval_size=600)
    assert len(tasks.ChatArithmeticTask(eval_size=0).train) == 1003  # --eval-size 0: no evaluation, all train

# -----------------------------------------------------------------------------
# The registry and make_task


def test_task_registry_and_its_flags(tmp_path, monkeypatch):
    data = write_jsonl(tmp_path / "d.jsonl", [{"question": f"q{i}", "answer": f"#### {i}"} for i in range(8)])
    arith = make("--digits", "2", "--nops", "1", "--eval-size", "7")
    assert type(arith) is tasks.ArithmeticTask and (arith.digits, arith.nops, len(arith.held)) == (2, 1, 7)
    assert type(make("--task", "gsm8k", "--data", data)) is tasks.JsonlTask
    assert type(make("--task", "chat-arithmetic", "--eval-size", "3")) is tasks.ChatArithmeticTask
    assert "mnist" not in task_parser()._option_string_actions["--task"].choices  # the parser refuses it first
    args = parse()
    args.task = "mnist"  # make_task's own check, for a caller without the parser (train(args, task=None))
    with pytest.raises(ValueError, match=r"unknown task 'mnist': choose one of arithmetic, gsm8k, chat-arithmetic"):
        tasks.make_task(args, task_parser())
    # --data belongs to gsm8k, and gsm8k needs it
    with pytest.raises(ValueError, match=r"^--data is the file of --task gsm8k, but the task is arithmetic: add "
                                         r"--task gsm8k to train on '\S+d.jsonl', or drop --data$"):
        make("--data", data)
    with pytest.raises(ValueError, match=r"^--task gsm8k needs --data FILE \(JSONL lines"):
        make("--task", "gsm8k")
    # a task flag the task does not read is refused when it differs from its default, allowed when it does not
    with pytest.raises(ValueError, match=r"^--digits 4 is read only by --task arithmetic, and --task gsm8k ignores "
                                         r"it: drop --digits$"):
        make("--task", "gsm8k", "--data", data, "--digits", "4")
    readers = " or ".join(f"--task {n}" for n, c in tasks.TASKS.items() if "system" in c.reads)  # the registry's
    for name in [n for n, c in tasks.TASKS.items() if "system" not in c.reads and not c.reads_data]:
        with pytest.raises(ValueError, match=rf"^--system paper is read only by {readers}, and --task {name} ignores it"):
            make("--task", name, "--system", "paper")
    assert type(make("--task", "gsm8k", "--data", data, "--digits", "3")) is tasks.JsonlTask
    # the defaults as a dict {dest: default} work as the parser does
    defaults = {"data": None, "eval_data": None, "digits": 3, "nops": 2, "system": "auto"}
    assert set(defaults) == set(tasks.TASK_FLAGS)
    assert tasks.make_task(parse("--eval-size", "4"), defaults).held == make("--eval-size", "4").held
    with pytest.raises(ValueError, match=r"^--nops 3 is read only by --task arithmetic"):
        tasks.make_task(parse("--task", "chat-arithmetic", "--nops", "3"), defaults)
    # --system: auto reads the model's config.json ("qerl_prompt": "bare" for the bundled model)
    assert make().system is False and make("--system", "paper").system is True
    # a forker's task: one registry entry, and make_task builds it (its flags read in from_args)
    class Sum(tasks.ArithmeticTask):
        @classmethod
        def from_args(cls, args, system):
            return cls(digits=2, nops=1, eval_size=args.eval_size, system=system)
    monkeypatch.setitem(tasks.TASKS, "sum", Sum)
    task = make("--task", "sum", "--eval-size", "3")
    assert type(task) is Sum and len(task.held) == 3 and (task.digits, task.nops) == (2, 1)


class SortTask(tasks.AnswerTask):
    """A forker's task whose answer is a list: sort three numbers. Its problems are a pure function of
    (seed, step); its held-out set is a fixed seeded draw, and training skips those questions."""
    help = "sort three numbers (31 3 1 -> 1 3 31)"
    reads = ("system",)

    def __init__(self, eval_size=20, system=False):
        self.system = system
        self.held = [self._problem(random.Random(f"held {i}")) for i in range(eval_size)]
        self._held_q = {p["question"] for p in self.held}

    @staticmethod
    def _problem(rng):
        nums = [rng.randint(0, 99) for _ in range(3)]
        return {"question": "Sort ascending: " + " ".join(map(str, nums)), "answer": " ".join(map(str, sorted(nums)))}

    @classmethod
    def from_args(cls, args, system):
        return cls(args.eval_size, system)

    def problems(self, seed, step, n):
        rng, out = random.Random(seed * 1_000_003 + step), []
        while len(out) < n:
            p = self._problem(rng)
            out += [p] if p["question"] not in self._held_q else []
        return out

    def answer_of(self, completion):  # every integer in the last <answer> block, in order
        block = tasks.answer_block(completion)
        nums = [int(x) for x in re.findall(r"-?\d+", block)] if block is not None else []
        return nums or None

    def gold_of(self, problem):
        return [int(x) for x in problem["answer"].split()]


def test_a_task_with_a_list_answer_registers_and_grades_the_whole_list(monkeypatch):
    monkeypatch.setitem(tasks.TASKS, "sort", SortTask)
    task = make("--task", "sort", "--eval-size", "20")
    assert type(task) is SortTask and len(task.held) == 20 and task.system is False
    check_contract(task, 16)
    p = {"question": "Sort ascending: 31 3 1", "answer": "1 3 31"}
    assert tasks.AnswerTask().correct(p, "<answer>31</answer>")  # the numeric grading would pass it ...
    assert not task.correct(p, "<answer>31</answer>")  # ... this task compares the list
    assert task.reward(p, "<think>1<3<31</think><answer>31</answer>") == pytest.approx(0.1)  # the format only
    assert not task.correct(p, "<answer>31 3 1</answer>") and not task.correct(p, "1 3 31")  # unsorted; no tags
    assert task.correct(p, "<answer>1, 3, 31</answer>")
    assert task.reward(p, "<think>1<3<31</think><answer>1 3 31</answer><|im_end|>") == pytest.approx(1.1)
    assert task.reward(p, "<think>x</think><answer>none</answer>") == 0.0  # no list parsed: not even the format


def test_a_prompt_too_long_for_any_context_is_refused_before_the_tokenizer(tmp_path, monkeypatch):
    """A 2 MB question: one line naming its file line, and the tokenizer never sees it (a 1 GB line aborted
    the Rust tokenizer); a question that merely overflows the context is still measured in tokens."""
    from qerl import hf_files
    tok = hf_files.load_tokenizer(TINY)
    encode = tok.encode
    monkeypatch.setattr(tok, "encode", lambda text: encode(text) if len(text) < 100_000 else pytest.fail("tokenized"))
    rows = [{"question": f"What is {i}+1?", "answer": f"#### {i + 1}"} for i in range(20)]
    rows.append({"question": "x" * 2_000_000, "answer": "#### 1"})
    task = make("--task", "gsm8k", "--data", write_jsonl(tmp_path / "d.jsonl", rows), "--eval-size", "2")
    with pytest.raises(ValueError, match=r"d\.jsonl:21: the prompt has 2,0\d\d,\d\d\d characters, more than the "
                                         r"model's context of 2048 tokens can hold"):
        tasks.check_prompts_fit(task, tok, 2048, 32)
    rows[-1] = {"question": "y " * 3000, "answer": "#### 1"}  # over the context, but short enough to count
    task = make("--task", "gsm8k", "--data", write_jsonl(tmp_path / "e.jsonl", rows), "--eval-size", "2")
    with pytest.raises(ValueError, match=r"e\.jsonl:21: the prompt has \d+ tokens; with --max-new-tokens 32"):
        tasks.check_prompts_fit(task, tok, 2048, 32)


def tokenizer_copy(tmp_path, change):
    """A copy of the bundled model whose tokenizer.json went through change(dict)."""
    import shutil
    folder = tmp_path / "model"
    shutil.copytree(TINY, folder)
    spec = json.loads((folder / "tokenizer.json").read_text())
    change(spec)
    (folder / "tokenizer.json").write_text(json.dumps(spec))
    return str(folder)


def mark_special(name):
    def change(spec):
        for added in spec["added_tokens"]:
            if added["content"] == name:
                added["special"] = True
    return change


def rewrite_seven(spec):
    spec["decoder"] = {"type": "Sequence", "decoders": [
        spec["decoder"], {"type": "Replace", "pattern": {"String": "7"}, "content": "1"}]}


@pytest.mark.parametrize("change, text", [(mark_special("<answer>"), "<answer>"), (rewrite_seven, "7")],
                         ids=["answer-tag-special", "decoder-rewrites-7"])
def test_a_tokenizer_that_changes_what_the_reward_reads_is_refused(tmp_path, change, text):
    from qerl import hf_files
    model = tokenizer_copy(tmp_path, change)
    tok = hf_files.load_tokenizer(model)
    with pytest.raises(ValueError, match=rf"its tokenizer turns '{re.escape(text)}' into .* the task's reward reads"):
        tasks.check_reward_text(make("--model", model), tok, model)
    tasks.check_reward_text(make(), hf_files.load_tokenizer(TINY), TINY)  # the bundled model's passes


def test_every_task_says_what_its_reward_reads():
    for name, cls in tasks.TASKS.items():
        assert cls.reward_text and all(isinstance(t, str) and t for t in cls.reward_text), name


def test_the_trainer_refuses_such_a_tokenizer_in_one_line_before_any_work(tmp_path, capsys):
    from qerl import cli
    model = tokenizer_copy(tmp_path, rewrite_seven)
    code = cli.run_cli(grpo.main, ["--model", model, "--out", str(tmp_path / "run"), "--device", "cpu"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1 and len(err) == 1 and "its tokenizer turns '7' into '1'" in err[0], err
    assert not (tmp_path / "run").exists()
