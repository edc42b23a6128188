"""--resume against edited checkpoints (issue 48, item 2): a checkpoint is checked against the run that wrote it.
Each case plants one edit in a copy of a real 2-step run (made once per session, AdamW state in both of its
checkpoints) and runs `qerl/train.py --resume` through test_bad_inputs' harness: one line, exit 1, no file changed.
"""
import itertools
import json
import os
import re
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


def _unsaid(*names):  # settings gone from checkpoint-000001's trainer_state.pt (and run record) and args.json
    def setup(tmp):
        _state(lambda s: [d.pop(k, None) for d in (s["args"], s["run"]) for k in names])(tmp)
        bad.edit_json(f"{tmp}/run/args.json", lambda a: {k: v for k, v in a.items() if k not in names})
    return setup


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
    Case("adapter-layers-to-transform-empty", "qerl/train", RESUME, "layers_to_transform is [], which load_adapter "
         "does not implement", setup=_config(layers_to_transform=[])),
    Case("adapter-init-pissa", "qerl/train", RESUME, "init_lora_weights is 'pissa', which load_adapter does not "
         "implement (plain LoRA only, init_lora_weights true, false or gaussian", setup=_config(init_lora_weights="pissa")),
    # AdamW: only the per-parameter state is read, and checked
    Case("adam-step-negative", "qerl/train", RESUME, "AdamW's step count of parameter 0 is not a whole number in 0..1 "
         "([-1.0]): the checkpoint is damaged", setup=_moment("step", torch.tensor(-1.0))),
    Case("adam-moment-shape", "qerl/train", RESUME, "AdamW's exp_avg (parameter 0) is torch.float32 [3], not of its "
         "parameter's [16, 128]", setup=_moment("exp_avg", torch.zeros(3))),
    Case("adam-moment-nan", "qerl/train", RESUME, "AdamW's exp_avg holds a non-finite value (parameter 0)",
         setup=_moment("exp_avg", torch.full((16, 128), float("nan")))),
    Case("adam-moment-expand", "qerl/train", RESUME, "AdamW's exp_avg (parameter 0) is a view with strides [0, 1] "
         "(elements sharing memory, or apart), not a contiguous tensor: the checkpoint is damaged",
         setup=_moment("exp_avg", torch.zeros(128).expand(16, 128))),
    # the hyper-parameters a resume takes against the run's args.json
    Case("args-lr-1e6", "qerl/train", RESUME, "trainer_state.pt says --lr 1000000.0, but its run's args.json says "
         "0.005: one of them was edited", setup=_state(lambda s: s["args"].update(lr=1e6))),
    # a setting trainer_state.pt does not give, nor its run record or args.json: never the command line's default
    Case("args-quant-missing", "qerl/train", RESUME, "trainer_state.pt does not say --quant, which the run reads, "
         "and neither does its run's args.json: the checkpoint is damaged or edited", setup=_unsaid("quant")),
    Case("args-lr-missing", "qerl/train", RESUME, "does not say --lr, which the run reads", setup=_unsaid("lr")),
    Case("args-aqn-site-missing", "qerl/train", RESUME, "does not say --aqn-site, --dynamic-sampling, which the run "
         "reads", setup=_unsaid("aqn_site", "dynamic_sampling")),  # a later setting (--max-completions) is there
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


@pytest.mark.parametrize("field, value", [
    ("alora_invocation_tokens", [5, 6]), ("alora_invocation_tokens", []), ("arrow_config", {"top_k": 3}),
    ("use_bdlora", {"nblocks": 2}), ("kasa_config", {"beta": 0.1}), ("monteclora_config", {}),
    ("layers_to_transform", []), ("init_lora_weights", "pissa"), ("init_lora_weights", "pissa_niter_4"),
    ("init_lora_weights", "olora"), ("init_lora_weights", "loftq"), ("init_lora_weights", "corda"),
    ("init_lora_weights", 1)])
def test_load_adapter_refuses_peft_fields_it_does_not_implement(field, value, tmp_path):
    """PEFT 0.22's fields that change what an adapter computes, by name: aLoRA, Arrow, BD-LoRA, KaSA, MonteCLoRA,
    an init that rewrites the base (PiSSA, OLoRA, LoftQ, CorDA), and layers_to_transform [] (no layer adapted,
    unlike its default None)."""
    lora = bad.STAGES["qerl/lora"]
    lora.save_adapter(lora.add_lora(torch.nn.Sequential(torch.nn.Linear(4, 4)), r=2, alpha=4, targets=("0",)),
                      str(tmp_path / "a"))
    bad.edit_json(str(tmp_path / "a" / "adapter_config.json"), lambda c: {**c, field: value})
    with pytest.raises(ValueError, match=f"adapter_config.json: {field} is {re.escape(repr(value))}, which "
                                         f"load_adapter does not implement .*: load this adapter with PEFT"):
        lora.load_adapter(torch.nn.Sequential(torch.nn.Linear(4, 4)), str(tmp_path / "a"))


@pytest.mark.parametrize("field, value", [("init_lora_weights", False), ("init_lora_weights", "gaussian"),
                                          ("exclude_modules", []), ("rank_pattern", {}), ("kasa_config", None)])
def test_load_adapter_takes_what_reads_as_plain_lora(field, value, tmp_path):
    lora = bad.STAGES["qerl/lora"]
    lora.save_adapter(lora.add_lora(torch.nn.Sequential(torch.nn.Linear(4, 4)), r=2, alpha=4, targets=("0",)),
                      str(tmp_path / "a"))
    bad.edit_json(str(tmp_path / "a" / "adapter_config.json"), lambda c: {**c, field: value})
    assert lora.load_adapter(torch.nn.Sequential(torch.nn.Linear(4, 4)), str(tmp_path / "a"))[0].r == 2


@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta")
@pytest.mark.parametrize("key, moment, message", [
    ("exp_avg", lambda: torch.zeros(3).expand(2, 3), r"is a view with strides \[0, 1\]"),
    ("exp_avg", lambda: torch.zeros(4).as_strided((2, 3), (1, 1)), r"is a view with strides \[1, 1\]"),
    ("exp_avg_sq", lambda: torch.zeros(2, 3).to_sparse(), "is a sparse_coo tensor, not a dense one"),
    ("exp_avg", lambda: torch.zeros(2, 3).to_sparse_csr(), "is a sparse_csr tensor, not a dense one"),
    ("exp_avg", lambda: torch.zeros(2, 3).to(torch.float8_e4m3fn), "is torch.float8_e4m3fn, not its parameter's "
     "torch.float32"),
    ("exp_avg_sq", lambda: torch.zeros(2, 3, dtype=torch.float64), "is torch.float64, not its parameter's"),
    ("exp_avg", lambda: torch.zeros(2, 3, dtype=torch.bfloat16), "is torch.bfloat16, not its parameter's"),
    ("exp_avg", lambda: torch.zeros(2, 3, device="meta"), "is a meta tensor, which holds no values"),
    ("step", lambda: torch.tensor(1.0, device="meta"), r"step \(parameter 0\) is a meta tensor"),
    ("exp_avg_sq", None, r"exp_avg_sq \(parameter 0\) shares its memory with exp_avg \(parameter 0\)")])
def test_adam_state_refuses_moments_that_are_not_the_parameters_own(key, moment, message):
    """Moments that passed the finite and shape checks and then failed in AdamW's step (or were cast unseen): each
    through a torch.save / torch.load round trip, as trainer_state.pt gives it (map_location cpu). One line."""
    import io
    good = {"step": torch.tensor(1.0), "exp_avg": torch.zeros(2, 3), "exp_avg_sq": torch.zeros(2, 3)}
    planted = {**good, key: moment() if moment else good["exp_avg"]}  # None: the first moment's tensor again
    buffer = io.BytesIO()
    torch.save({"state": {0: planted}}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer, map_location="cpu", weights_only=True)
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2, 3))])
    with pytest.raises(ValueError, match=r"^--resume: f: AdamW's .*" + message + ".*: the checkpoint is damaged"):
        checkpoints.adam_state("f", saved, opt, 1)


def test_a_setting_the_checkpoint_lacks_comes_from_its_run_not_the_command_line(tmp_path, capsys):
    """A --quant none run's trainer_state.pt without quant: its run record says none (before: the command line's
    default, nvfp4, and args.json rewritten so); without a record, its args.json."""
    bad.model_copy(str(tmp_path))
    ckpt = bad._state(str(tmp_path), lambda s: {**s, "args": {k: v for k, v in s["args"].items() if k != "quant"}},
                      flags=["--quant", "none"])
    args = grpo.build_parser().parse_args(["--resume", ckpt])
    checkpoints.resume_args(args, grpo.parser_defaults())
    assert args.quant == "none" and "trainer_state.pt does not say --quant none: taken from its run record" in \
        capsys.readouterr().out
    state = torch.load(os.path.join(ckpt, "trainer_state.pt"), weights_only=True)
    del state["run"]
    torch.save(state, os.path.join(ckpt, "trainer_state.pt"))
    bad.write(str(tmp_path / "old" / "args.json"), json.dumps({"quant": "none"}))
    args = grpo.build_parser().parse_args(["--resume", ckpt])
    checkpoints.resume_args(args, grpo.parser_defaults())
    assert args.quant == "none" and "does not say --quant none: taken from its run's args.json" in \
        capsys.readouterr().out


# The arguments trainer_state.pt held as earlier commits wrote them (checked on real checkpoints of 8959e4b,
# dbf19f5, e78cfef, 1672f0d, d68237b and 81ffd39). e78cfef's (2026-12-01) names: --micro-batch's default the int 0
# and --dtype's None until 20a2201; before 04cb920 also no --task (--data arith), --quant-method or --pi-old, nor
# a run record.
E78CFEF_ARGS = ("model task data eval_data digits nops system quant quant_method device compile dtype aqn aqn_kind "
                "sigma_start sigma_end num_stages target_entropy steps batch group max_new_tokens temperature eps_low "
                "eps_high loss_agg no_std_scale mu pi_old beta entropy_coef micro_batch grad_checkpoint gpu_path "
                "mask_truncated train_norms lr warmup min_lr_ratio grad_clip lora_r lora_alpha seed eval_size "
                "eval_every eval_k eval_chunk out resume save_every time_budget stop_at quiet").split()
OF_2026_12_01 = {"keep": E78CFEF_ARGS, "micro_batch": 0, "dtype": None}
BEFORE_TASK = {**OF_2026_12_01, "data": "arith",
               "keep": [k for k in E78CFEF_ARGS if k not in ("task", "quant_method", "pi_old")]}


def test_every_setting_added_since_2026_12_01_says_what_runs_had_before_it():
    """A flag the trainer reads that e78cfef's checkpoints lack is a runtime flag or has its ADDED_LATER entry (the
    value every run had before it): else resuming those checkpoints would be refused for want of it."""
    added = set(grpo.parser_defaults()) - set(E78CFEF_ARGS) - set(checkpoints.RUNTIME_ARGS)
    assert added <= {k for group in checkpoints.ADDED_LATER for k in group}, \
        "give each new flag its entry in checkpoints.ADDED_LATER (or a place in RUNTIME_ARGS)"


@pytest.mark.parametrize("old, notes", [
    (OF_2026_12_01, "was written before --aqn-scale, --tis-cap, --aqn-site, --dynamic-sampling, --max-completions, "
                    "--ratio-level existed: its run had --aqn-scale absolute, --tis-cap 2.0, --aqn-site norms, "
                    "--dynamic-sampling 0, --max-completions 0, --ratio-level token"),
    (BEFORE_TASK, "was written before --task, --quant-method, --pi-old, --aqn-scale")], ids=["2026-12-01", "11-30"])
def test_checkpoints_of_earlier_commits_resume(old, notes, tmp_path, capsys):
    """A checkpoint and args.json as earlier commits wrote them resume (before: --micro-batch's 0 was refused as
    damaged), with a note naming each setting the checkpoint predates and the value its run had; the resumed
    run's args.json records them."""
    def older(args):
        return {**{k: v for k, v in args.items() if k in old["keep"]}, **{k: v for k, v in old.items() if k != "keep"}}
    _state(lambda s: s.update(args=older(s["args"])) or (old is BEFORE_TASK and s.pop("run")))(str(tmp_path))
    bad.edit_json(f"{tmp_path}/run/args.json", older)
    capsys.readouterr()
    assert bad.cli.run_cli(grpo.main, ["--resume", str(tmp_path / CKPT), "--quiet"]) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert notes in out and "says --dtype None, its trainer's default: float32, as that trainer chose on cpu" in out
    resumed = bad.files.read_json(tmp_path / "run" / "args.json")
    assert (resumed["micro_batch"], resumed["dtype"], resumed["aqn_site"], resumed["task"], resumed["data"]) == \
        (0, "float32", "norms", "arithmetic", None)
    assert bad.files.read_json(tmp_path / "run" / "summary.json")["steps_done"] == 2
