"""--resume against edited checkpoints (issue 48, item 2): a checkpoint is checked against the run that wrote it.
Each case plants one edit in a copy of a real 2-step run (made once per session, AdamW state in both of its
checkpoints) and runs `qerl/train.py --resume` through test_bad_inputs' harness: one line, exit 1, no file changed.
"""
import itertools
import os
import shutil
import types

import pytest
import torch
from safetensors.torch import load_file, save_file

import test_bad_inputs as bad

grpo, checkpoints, runs = bad.STAGES["qerl/train"], bad.checkpoints, bad.runs
EVAL_RUN = {}  # the same with a held-out evaluation at the start and the end
RUN = {}  # the cached run: --steps 2, a checkpoint at each step, every group with signal


def _run(tmp):
    """{tmp}/run: a copy of the cached run (made on first use, its rewards 1, 0, 1, 0...: AdamW has moments)."""
    with pytest.MonkeyPatch.context() as mp:
        rewards = itertools.cycle([1.0, 0.0])
        mp.setattr(bad.tasks.AnswerTask, "reward", lambda self, problem, text: next(rewards))
        bad._run_once(RUN, "qerl-resume-run-", ["--steps", "2", "--save-every", "1"], tmp)


CKPT = "run/checkpoint-000001"  # resuming it trains on: the checks below run before that


def _config(**change):  # an edit of checkpoint-000001's adapter_config.json (and its tensors)
    def setup(tmp):
        _run(tmp)
        bad.edit_json(f"{tmp}/{CKPT}/adapter_config.json", lambda c: {**c, **change})
        if "modules_to_save" in change:  # the tensors the field names, planted beside the adapter's
            path = f"{tmp}/{CKPT}/adapter_model.safetensors"
            model = grpo.rollout.load_model(bad.TINY, quant="none", device="cpu")[0]
            full = {f"base_model.model.{k}": v for k, v in model.state_dict().items()
                    if k.rsplit(".", 2)[-2] in change["modules_to_save"]}
            save_file({**load_file(path), **full}, path)
    return setup


def _state(change):  # an edit of checkpoint-000001's trainer_state.pt
    def setup(tmp):
        _run(tmp)
        file = f"{tmp}/{CKPT}/trainer_state.pt"
        state = torch.load(file, weights_only=True)
        change(state)
        torch.save(state, file)
    return setup


def _moment(key, value):  # parameter 0's AdamW state entry `key` replaced
    return _state(lambda s: s["optimizer"]["state"][0].__setitem__(key, value))


RESUME = ["--resume", "{tmp}/" + CKPT, "--quiet"]
Case = bad.Case
CASES = [
    # the adapter's config against the run's arguments (02's check_config_fits), and fields 02 does not implement
    Case("adapter-alpha-320", "qerl/train", RESUME, "adapter_config.json: lora_alpha is 320, but the model it loads "
         "into has LoRA layers of 32: the adapter was made with other settings, or edited (resume from another "
         "checkpoint)", setup=_config(lora_alpha=320)),
    Case("adapter-alpha-negative", "qerl/train", RESUME, "lora_alpha is -32, but", setup=_config(lora_alpha=-32)),
    Case("adapter-rslora", "qerl/train", RESUME, "use_rslora is True, but the model it loads into has LoRA layers of "
         "False", setup=_config(use_rslora=True)),
    Case("adapter-targets", "qerl/train", RESUME, "targets ['q_proj'] but the model's LoRA layers wrap",
         setup=_config(target_modules=["q_proj"])),
    Case("adapter-layers-to-transform", "qerl/train", RESUME, "layers_to_transform is [0], which load_adapter does not "
         "implement", setup=_config(layers_to_transform=[0])),
    Case("adapter-embed-tokens-to-save", "qerl/train", RESUME, "modules_to_save is ['embed_tokens'], but the model it "
         "loads into trains in full beside its LoRA layers []", setup=_config(modules_to_save=["embed_tokens"])),
    Case("adapter-base-to-save", "qerl/train", RESUME, "modules_to_save is ['base'], but",
         setup=_config(modules_to_save=["base"])),
    # AdamW: only the per-parameter state is read, and checked
    Case("adam-step-negative", "qerl/train", RESUME, "AdamW's step count of parameter 0 is not a whole number in 0..1 "
         "([-1.0]): the checkpoint is damaged", setup=_moment("step", torch.tensor(-1.0))),
    Case("adam-moment-shape", "qerl/train", RESUME, "AdamW's exp_avg (parameter 0) is torch.float32 [3], not of its "
         "parameter's [16, 128]", setup=_moment("exp_avg", torch.zeros(3))),
    Case("adam-moment-nan", "qerl/train", RESUME, "AdamW's exp_avg holds a non-finite value (parameter 0)",
         setup=_moment("exp_avg", torch.full((16, 128), float("nan")))),
    # the hyper-parameters a resume takes against the run's args.json
    Case("args-lr-1e6", "qerl/train", RESUME, "trainer_state.pt says --lr 1000000.0, but its run's args.json says "
         "0.005: one of them was edited", setup=_state(lambda s: s["args"].update(lr=1e6))),
    # a checkpoint is found by its step's number, and its name must say its step
    Case("ckpt-renamed", "qerl/train", ["--resume", "{tmp}/run", "--quiet"], "checkpoint-000009/trainer_state.pt says "
         "step 1, but its folder's name says 9: the checkpoint was renamed or edited",
         setup=lambda t: (_run(t), os.rename(f"{t}/{CKPT}", f"{t}/run/checkpoint-000009"))),
    # empty folders names, and a run that died before its first checkpoint
    Case("resume-empty", "qerl/train", ["--resume", "", "--quiet"], "--resume '' names no folder: give the run"),
    Case("out-empty", "qerl/train", ["--out", "", "--quiet"], "--out '' names no folder: give a folder, or drop --out"),
    Case("dead-run-out", "qerl/train", ["--out", "{tmp}/run", "--device", "cpu", "--quiet"], "already holds a run "
         "(args.json, metrics.jsonl) that stopped before its first checkpoint: --resume has nothing to continue "
         "there; delete those files", setup=lambda t: (_run(t), [shutil.rmtree(f"{t}/run/checkpoint-00000{i}")
                                                            for i in (1, 2)], os.remove(f"{t}/run/summary.json"))),
    Case("dead-run-resume", "qerl/train", ["--resume", "{tmp}/run", "--quiet"], "no checkpoint there: its run (args.json, "
         "metrics.jsonl) stopped before its first checkpoint, so nothing can be continued; start a new run",
         setup=lambda t: bad.write(f"{t}/run/args.json", "{}") or bad.write(f"{t}/run/metrics.jsonl", "")),
]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_resume(case, tmp_path, capsys):
    bad.run_case(case, str(tmp_path), capsys)


def test_a_finished_run_resumes_to_nothing(tmp_path, capsys):
    """--resume of a finished run: exit 0, it says so and shows the summary; no file changes (no evaluation row,
    no checkpoint). checkpoint-1 beside checkpoint-000002 is older by its number, though later by its name."""
    _run(str(tmp_path))
    shutil.copytree(tmp_path / CKPT, tmp_path / "run" / "checkpoint-1")
    before = bad.snapshot(str(tmp_path))
    capsys.readouterr()
    assert bad.cli.run_cli(grpo.main, ["--resume", str(tmp_path / "run"), "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "checkpoint-000002 is step 2 of --steps 2: the run is finished, nothing to add" in out
    assert "summary | steps 2 | stopped by steps" in out
    assert bad.snapshot(str(tmp_path)) == before


def test_a_run_stopped_at_its_last_step_resumes_to_its_final_evaluation_once(tmp_path, capsys):
    """A run stopped by a signal or --stop-at at its last step has its checkpoint but no final evaluation: the
    first resume evaluates (one row) and writes the summary; the next one is finished and adds nothing."""
    bad._run_once(EVAL_RUN, "qerl-eval-run-", ["--steps", "2", "--eval-size", "4", "--eval-k", "0"], str(tmp_path))
    run = tmp_path / "run"
    summary = bad.files.read_json(run / "summary.json")
    bad.files.write_json(str(run / "summary.json"), {**summary, "stopped_by": "SIGTERM"})
    rows = (run / "metrics.jsonl").read_text().splitlines()
    final = [r for r in rows if r.startswith('{"eval"')][-1]
    (run / "metrics.jsonl").write_text("\n".join(r for r in rows if r != final) + "\n")
    argv = ["--resume", str(run), "--quiet"]
    assert bad.cli.run_cli(grpo.main, argv) == 0
    after = (run / "metrics.jsonl").read_text().splitlines()
    assert len(after) == len(rows)  # the final evaluation's row, once
    assert bad.files.read_json(run / "summary.json")["stopped_by"] == "steps"
    capsys.readouterr()
    before = bad.snapshot(str(tmp_path))
    assert bad.cli.run_cli(grpo.main, argv) == 0
    assert "the run is finished, nothing to add" in capsys.readouterr().out
    assert bad.snapshot(str(tmp_path)) == before


def test_resume_rebuilds_adams_settings_from_the_run(tmp_path):
    """AdamW's param_groups in trainer_state.pt (maximize, a weight decay of 1e4, betas above 1, lr 1e6) are
    not read: the resumed step 2 is the uninterrupted run's, bit for bit, and its checkpoint holds the run's
    own settings."""
    _run(str(tmp_path))
    want = load_file(str(tmp_path / "run" / "checkpoint-000002" / "adapter_model.safetensors"))

    def hostile(state):
        for group in state["optimizer"]["param_groups"]:
            group.update(maximize=True, weight_decay=1e4, betas=(1.5, 2.0), lr=1e6, eps=1.0)
    _state(hostile)(str(tmp_path / "planted"))
    shutil.rmtree(tmp_path / "planted" / "run" / "checkpoint-000002")  # the resume writes it again
    with pytest.MonkeyPatch.context() as mp:
        rewards = itertools.cycle([1.0, 0.0])  # the cached run's rewards: step 2 starts the cycle again
        mp.setattr(bad.tasks.AnswerTask, "reward", lambda self, problem, text: next(rewards))
        grpo.train(grpo.build_parser().parse_args(["--resume", str(tmp_path / "planted" / CKPT), "--quiet"]))
    ckpt = tmp_path / "planted" / "run" / "checkpoint-000002"
    got = load_file(str(ckpt / "adapter_model.safetensors"))
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
    group = torch.load(ckpt / "trainer_state.pt", weights_only=True)["optimizer"]["param_groups"][0]
    assert (group["maximize"], group["weight_decay"], group["betas"], group["eps"]) == (False, 0.0, (0.9, 0.99), 1e-8)


def test_adam_state_checks_every_value(tmp_path):
    """adam_state's other refusals, without a model: an index beyond the run's parameters, a missing moment,
    a fractional or too-high step count, a negative second moment, no state at all."""
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2, 3))])
    good = {"step": torch.tensor(1.0), "exp_avg": torch.zeros(2, 3), "exp_avg_sq": torch.zeros(2, 3)}
    assert checkpoints.adam_state("f", {"state": {0: good}}, opt, 1)[0]["step"].dtype == torch.float32
    for state, message in [({5: good}, "AdamW's state names parameter 5, but the run has 1"),
                           ({0: {**good, "exp_avg_sq": None}}, "is not the tensors step, exp_avg and exp_avg_sq"),
                           ({0: {**good, "step": torch.tensor(0.5)}}, "step count of parameter 0 is not a whole"),
                           ({0: {**good, "step": torch.tensor(2.0)}}, r"not a whole number in 0\.\.1 \(\[2\.0\]\)"),
                           ({0: {**good, "exp_avg_sq": -torch.ones(2, 3)}}, "exp_avg_sq .* holds a negative value"),
                           (None, "holds no AdamW state")]:
        with pytest.raises(ValueError, match=r"^--resume: f: .*" + message):
            checkpoints.adam_state("f", {"state": state}, opt, 1)


def test_checkpoints_are_ordered_by_their_step(tmp_path):
    for name in ("checkpoint-2", "checkpoint-000004", "checkpoint-10", "checkpoint-000010", "checkpoint-abc",
                 "checkpoint-\u0663\u0663"):  # Arabic-Indic digits: not a step
        os.makedirs(tmp_path / name)
    assert checkpoints.latest_checkpoint(str(tmp_path)) == str(tmp_path / "checkpoint-000010")


@pytest.mark.parametrize("argv, resumed, want", [
    ([], False, "run again with a lower --lr (now 0.001)"),
    (["--beta", "2", "--lora-alpha", "64"], False, "run again with a lower --beta (now 2) or --lora-alpha (now 64)"),
    (["--lr", "0.5"], True, "lower --lr (now 0.5): a resume keeps the checkpoint's values, so start a new run with "
     "lower ones (or, if the checkpoint's state is at fault, resume from an earlier checkpoint)")])
def test_a_divergence_names_the_flags_that_can_cause_it(argv, resumed, want):
    args = grpo.build_parser().parse_args([*argv, *(["--resume", "run"] if resumed else [])])
    log = types.SimpleNamespace(args=args, defaults=grpo.parser_defaults())
    assert runs.RunLog.divergence_fix(log) == want


def test_load_adapter_refuses_what_it_does_not_implement(tmp_path):
    """02 on its own: the fields of UNSUPPORTED_FIELDS (fan_in_fan_out here) are refused, and modules_to_save
    never reaches into a LoRA layer's frozen base."""
    model = bad.STAGES["qerl/lora"].add_lora(torch.nn.Sequential(torch.nn.Linear(4, 4)), r=2, alpha=4, targets=("0",))
    lora = bad.STAGES["qerl/lora"]
    lora.save_adapter(model, str(tmp_path / "a"))
    bad.edit_json(str(tmp_path / "a" / "adapter_config.json"), lambda c: {**c, "fan_in_fan_out": True})
    with pytest.raises(ValueError, match="fan_in_fan_out is True, which load_adapter does not implement"):
        lora.load_adapter(torch.nn.Sequential(torch.nn.Linear(4, 4)), str(tmp_path / "a"))
    assert lora._saved_modules(model, ["base"]) == {}
