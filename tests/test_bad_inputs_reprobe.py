"""A re-run of issue 48's classes with other values and through other doors (the audit of 2026-12-03). The
holes it found, each now one line or the right behaviour: an adapter_config.json whose modules_to_save mixes
names and numbers, AdamW state for only some of the run's parameters or of unequal step counts, a norm of the
wrong shape quantized by 01, a study rerun with `-- --lr=2e-3` (the `=` form) beside finished runs, and a 05
run started with its standard output closed (`>&-`). A few of the re-run cases that held are kept beside
them. Error cases go through test_bad_inputs' harness (one stderr line, files around unchanged)."""
import os

import pytest
import torch

import test_bad_inputs as bad
from test_bad_inputs import Case

lora, checkpoints = bad.STAGES["qerl/lora"], bad.checkpoints
Q = ["--model", "{model}", "--out", "{tmp}/q"]
M = ["--model", "{model}"]
STUDY = ["--methods", "lora", "--seeds", "0", "--out", "{tmp}/cmp", "--dry-run"]


def _retyped(dtype):  # setup: v_proj of layer 0 stored as `dtype` (a true header: the bytes are that dtype's)
    def setup(tmp):
        from safetensors.torch import load_file, save_file
        path = f"{tmp}/model/model.safetensors"
        t = load_file(path)
        name = next(k for k in t if k.endswith("v_proj.weight"))
        t[name] = t[name].to(dtype)
        save_file(t, path)
    return setup


def _norm_0d(tmp):  # the final norm's gain a 0-d tensor: 01 used to copy it into its output as it was
    from safetensors.torch import load_file, save_file
    path = f"{tmp}/model/model.safetensors"
    t = load_file(path)
    t["model.norm.weight"] = torch.tensor(1.0)
    save_file(t, path)


def _shard_is_a_folder(tmp):  # the index puts the final norm in b.safetensors, a folder
    names = bad.hf_files.read_safetensors_header(f"{tmp}/model/model.safetensors")[0]
    os.makedirs(f"{tmp}/model/b.safetensors")
    weight_map = {**dict.fromkeys(names, "model.safetensors"), "model.norm.weight": "b.safetensors"}
    bad.write(f"{tmp}/model/model.safetensors.index.json", bad.json.dumps({"weight_map": weight_map}))


CASES = [
    # holes: found by the re-run, fixed
    Case("reprobe-01-norm-0d", "qerl/quantize", Q, "tensor model.norm.weight has shape (), config.json implies (128,)",
         setup=_norm_0d),
    Case("reprobe-study-lr-with-equals", bad.CMP, [*STUDY, "--", "--lr=2e-3"], "runs/lora-s0 was trained with --lr "
         "0.001, this command runs with --lr 2e-3", setup=bad._study_runs("cmp", ["lora-s0"])),
    # held: other dtypes, shapes and folders than the suite's
    Case("reprobe-01-u16", "qerl/quantize", Q, "v_proj.weight has dtype U16, which this reader does not know",
         setup=_retyped(torch.uint16)),
    Case("reprobe-03-f8-e5m2", "qerl/rollout", M, "v_proj.weight has dtype F8_E5M2, but a weight must be one of F32",
         setup=_retyped(torch.float8_e5m2)),
    Case("reprobe-04-bool", "qerl/aqn", M, "v_proj.weight has dtype BOOL", setup=_retyped(torch.bool)),
    Case("reprobe-03-shard-is-a-folder", "qerl/rollout", M, "b.safetensors is a folder, not a regular file",
         setup=_shard_is_a_folder),
    Case("reprobe-study-eval-k", bad.CMP, [*STUDY, "--eval-k", "2"], "was trained with --eval-k 8, this command runs "
         "with --eval-k 2", setup=bad._study_runs("cmp", ["lora-s0"])),
    Case("reprobe-05-gold-hex", "qerl/train", bad.GSM8K, "d.jsonl:3: the answer after '####' is '0x10', not a number",
         setup=bad._gsm8k_with("0x10")),
    Case("reprobe-05-gold-tiny", "qerl/train", bad.GSM8K, "the answer after '####' is '1e-101', over 100 characters",
         setup=bad._gsm8k_with("1e-101")),
]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_reprobe(case, tmp_path, capsys):
    bad.run_case(case, str(tmp_path), capsys)


def test_adapter_modules_to_save_must_be_names(tmp_path):
    """modules_to_save [1, "a"] into a model with LoRA layers (05's --resume): one line, not sorted()'s TypeError."""
    model = lora.add_lora(torch.nn.Sequential(torch.nn.Linear(4, 4)), r=2, alpha=4, targets=("0",))
    lora.save_adapter(model, str(tmp_path / "a"))
    bad.edit_json(str(tmp_path / "a" / "adapter_config.json"), lambda c: {**c, "modules_to_save": [1, "a"]})
    with pytest.raises(ValueError, match="adapter_config.json: missing or malformed modules_to_save"):
        lora.load_adapter(model, str(tmp_path / "a"))


def test_adam_state_covers_every_parameter_at_one_step_count():
    """AdamW steps all of a run's parameters at once: state for some of them (the others' moments would start
    again from zero), or of unequal step counts, is refused; no state at all (no step taken yet) is not."""
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2, 3)), torch.nn.Parameter(torch.zeros(4))])
    one = {"step": torch.tensor(1.0), "exp_avg": torch.zeros(2, 3), "exp_avg_sq": torch.zeros(2, 3)}
    two = {"step": torch.tensor(1.0), "exp_avg": torch.zeros(4), "exp_avg_sq": torch.zeros(4)}
    assert checkpoints.adam_state("f", {"state": {}}, opt, 1) == {}
    assert set(checkpoints.adam_state("f", {"state": {0: one, 1: two}}, opt, 1)) == {0, 1}
    with pytest.raises(ValueError, match="AdamW's state covers 1 of the run's 2 parameters"):
        checkpoints.adam_state("f", {"state": {0: one}}, opt, 1)
    with pytest.raises(ValueError, match=r"AdamW's step counts differ between parameters \(0 and 1\)"):
        checkpoints.adam_state("f", {"state": {0: one, 1: {**two, "step": torch.tensor(0.0)}}}, opt, 1)


def test_a_run_started_with_stdout_closed_writes_nothing_there():
    """`qerl/train.py >&-`: sys.stdout is None; the run's guard (ClosedPipeGuard) writes nothing instead of
    raising AttributeError at its first line, and does not take it for a closed pipe (the run goes on)."""
    guard = bad.cli.ClosedPipeGuard(None)
    assert guard.write("step 1\n") == 7
    guard.flush()
    assert not guard.closed
