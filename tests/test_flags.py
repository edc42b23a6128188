"""qerl/train.py's flags (issue 47, item 4): a flag declared with `add_flag(..., read_when=...)` is refused in a
run that does not read it, and every flag is checked on --resume, with no second edit. The tests walk the
parser, so a new flag is covered as soon as it is declared.
"""
import argparse

import pytest

import test_bad_inputs as bad

grpo, cli = bad.STAGES["qerl/train"], bad.cli
# command lines under which a read_when flag may go unread; a new condition none of them breaks needs one here
WITHOUT = (["--no-aqn"], ["--aqn-kind", "none"], ["--aqn-kind", "feedback"], [])
READ_WHEN = {a.option_strings[0]: (a, when) for a, (_, when) in grpo.read_when_flags().items()}
FLAGS = [a for a in grpo.build_parser()._actions if a.option_strings and a.dest != "help"]


def other_value(action):
    """A valid value of the flag other than its default, as text."""
    if action.choices is not None:
        return next(str(c) for c in action.choices if c != action.default)
    return str(action.default * 2)


def unread(action):
    """A command line under which the flag is not read, and the flag with another value on it."""
    reads = action.read_when[0]
    for argv in WITHOUT:
        if not reads(grpo.build_parser().parse_args(argv)):
            return argv + [action.option_strings[0], other_value(action)]
    raise AssertionError(f"{action.option_strings[0]}: no command line in WITHOUT leaves it unread: add one")


def test_the_aqn_flags_declare_when_they_are_read():
    assert set(READ_WHEN) == {"--aqn-kind", "--aqn-scale", "--aqn-site", "--sigma-start", "--sigma-end",
                              "--num-stages", "--target-entropy"}
    assert READ_WHEN["--target-entropy"][1] == "--aqn-kind feedback"


@pytest.mark.parametrize("flag", sorted(READ_WHEN))
def test_a_flag_given_without_its_condition_is_refused(flag, tmp_path, capsys):
    """Every read_when flag, end to end: one line naming the flag and its condition, exit 1, nothing written."""
    action, when = READ_WHEN[flag]
    argv = unread(action) + ["--out", "{tmp}/run", "--quiet"]
    case = bad.Case(f"unread{flag}", "qerl/train", argv, f"{flag} {argv[argv.index(flag) + 1]} is read only with {when}")
    assert f"drop {flag}" in bad.run_case(case, str(tmp_path), capsys)


def test_the_flag_is_accepted_where_it_is_read(tmp_path):
    args = grpo.build_parser().parse_args(["--aqn-kind", "feedback", "--target-entropy", "0.3", "--out",
                                           str(tmp_path / "run")])
    grpo.check_args(args, 1)  # no error
    assert args.target_entropy == 0.3


def test_check_resumed_args_accepts_every_default():
    grpo.check_resumed_args(grpo.build_parser().parse_args([]))


def damaged(action):
    """A value no command line gives the flag: text for a switch, a name outside its choices, NaN for a number,
    a number for a folder's name."""
    if isinstance(action.default, bool):
        return "yes"
    if action.choices is not None:
        return "not-a-choice"
    return float("nan") if action.type is not None else 7


@pytest.mark.parametrize("action", FLAGS, ids=[a.option_strings[0] for a in FLAGS])
def test_a_damaged_value_of_every_flag_is_refused_on_resume(action):
    args = grpo.build_parser().parse_args([])
    setattr(args, action.dest, damaged(action))
    with pytest.raises(ValueError, match=f"^--resume: the checkpoint's {action.option_strings[0]} .* is not a value "
                                         f"of that flag .*damaged or edited"):
        grpo.check_resumed_args(args)


@pytest.mark.parametrize("flag, value", [("--lr", "0.5"), ("--steps", 16.0), ("--batch", True), ("--aqn", 1),
                                         ("--steps", None)])
def test_a_value_of_another_type_is_refused_on_resume(flag, value):
    """Text for a number would fail mid-run; 16.0 would be a float where an int is counted on."""
    args = grpo.build_parser().parse_args([])
    setattr(args, flag[2:].replace("-", "_"), value)
    with pytest.raises(ValueError, match=f"checkpoint's {flag} {value!r} is not a value of that flag"):
        grpo.check_resumed_args(args)


@pytest.fixture
def new_flag(monkeypatch):
    """05 with one more flag, --fake-knob (read only with --beta > 0), declared as a fork would declare it."""
    real = grpo.build_parser

    def with_knob():
        p = real()
        group = next(g for g in p._action_groups if g.title == "GRPO loss and update")
        grpo.add_flag(group, "--fake-knob", type=cli.number(int, 0), default=0, help="a fork's new flag",
                      read_when=(lambda args: args.beta > 0, "--beta > 0"))
        return p
    grpo._defaults.cache_clear()  # parser_defaults() is cached from the parser
    monkeypatch.setattr(grpo, "build_parser", with_knob)
    yield
    monkeypatch.undo()
    grpo._defaults.cache_clear()


def test_a_new_flag_is_checked_by_its_declaration_alone(new_flag, tmp_path):
    parse = grpo.build_parser().parse_args
    with pytest.raises(ValueError, match=r"^--fake-knob 3 is read only with --beta > 0, which this run does not "
                                         r"have: drop --fake-knob"):
        grpo.check_args(parse(["--fake-knob", "3", "--out", str(tmp_path / "a")]), 1)
    grpo.check_args(parse(["--fake-knob", "3", "--beta", "0.1", "--out", str(tmp_path / "b")]), 1)
    args = parse([])
    args.fake_knob = -1  # a damaged checkpoint's
    with pytest.raises(ValueError, match=r"checkpoint's --fake-knob -1 is not a value of that flag \(-1 is out "
                                         r"of range: need >= 0\)"):
        grpo.check_resumed_args(args)


def test_add_flag_returns_the_action_with_its_condition():
    group = argparse.ArgumentParser().add_argument_group("g")
    action = grpo.add_flag(group, "--x", type=int, default=1)
    assert action.dest == "x" and action.read_when is None


def test_bench_grpo_step_runs_05s_own_steps_with_its_flags(tmp_path, capsys):
    """bench_grpo_step times 05's train(): a 05 flag after -- is checked as 05 checks it, and it acts (here
    --dynamic-sampling's record fields appear in the steps it times)."""
    case = bad.Case("bench-unread", "bench/bench_grpo_step", ["--steps", "1", "--", "--no-aqn", "--sigma-end", "1e-3"],
                    "--sigma-end 0.001 is read only with --aqn")
    bad.run_case(case, str(tmp_path), capsys)
    bench = bad.STAGES["bench/bench_grpo_step"]
    tiny = ["--batch", "2", "--group", "2", "--max-new-tokens", "4", "--dynamic-sampling", "1"]
    args, recs = bench.train_steps(tiny, "none", 2, str(tmp_path))
    assert args.dynamic_sampling == 1 and [r["step"] for r in recs] == [1, 2]
    assert all("ds_rounds" in r and r["t_sample"] > 0 and r["s/step"] >= r["t_sample"] + r["t_score"] for r in recs)
