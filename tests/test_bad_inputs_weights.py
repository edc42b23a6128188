"""Bad weight files (issue 48): a tensor whose dtype lies, a safetensors header whose offsets or names do not
describe its file, a --model that is a file, a tokenizer file that is a link out of the model folder. Each
is one line naming the file, before any work, in every stage that reads the folder; the cases run through
tests/test_bad_inputs.py's harness (one stderr line, files around unchanged)."""
import dataclasses
import json
import os
import shutil

import pytest
import torch

import test_bad_inputs as bad
from test_bad_inputs import Case

hf_files, rollout, quantize = bad.hf_files, bad.STAGES["qerl/rollout"], bad.quantize
M = ["--model", "{model}"]
Q = ["--model", "{model}", "--out", "{tmp}/q"]
RUN = [*M, "--steps", "2", "--batch", "2", "--group", "2", "--eval-size", "4", "--max-new-tokens", "8", *bad.RUN]


def _retype(suffix, dtype, folder="model"):
    """setup: the first tensor of {tmp}/folder/model.safetensors whose name ends with `suffix`, stored as `dtype`
    (save_file writes a true header: the bytes are that dtype's)."""
    def setup(tmp):
        from safetensors.torch import load_file, save_file
        path = os.path.join(tmp, folder, "model.safetensors")
        t = load_file(path)
        name = next(k for k in t if k.endswith(suffix))
        t[name] = t[name].to(dtype)
        save_file(t, path, metadata={"format": "pt"})
    return setup


def _quantized_then(change):  # setup: 01's output of the model at {tmp}/q, then `change` applied to it
    return lambda tmp: (bad._own_output(tmp), change(tmp))


def _header_pairs(change):
    """setup: model.safetensors' header rewritten from change([(name, entry), ...]) -> pairs (a name may repeat,
    as JSON text allows), the data bytes kept."""
    def setup(tmp):
        path = f"{tmp}/model/model.safetensors"
        with open(path, "rb") as f:
            data = f.read()
        n = int.from_bytes(data[:8], "little")
        pairs = change([(k, dict(e)) for k, e in json.loads(data[8:8 + n], object_pairs_hook=list)])
        text = ("{" + ",".join(f"{json.dumps(k)}:{json.dumps(v)}" for k, v in pairs) + "}").encode()
        bad.write(path, len(text).to_bytes(8, "little") + text + data[8 + n:], "wb")
    return setup


def _second_shifted(by):  # the tensor stored second moved `by` bytes, its size kept
    def change(pairs):
        second = sorted((e["data_offsets"], k) for k, e in pairs if k != "__metadata__")[1][1]
        return [(k, {**e, "data_offsets": [o + by for o in e["data_offsets"]]} if k == second else e) for k, e in pairs]
    return change


def _first_negative(pairs):  # the tensor at byte 0 said to start 4 bytes before the data
    return [(k, {**e, "data_offsets": [-4, e["data_offsets"][1] - 4]} if e.get("data_offsets", [1])[0] == 0 else e)
            for k, e in pairs]


def _duplicate_first(pairs):  # the first tensor's name given twice, the second time for the second's bytes
    tensors = [(k, e) for k, e in pairs if k != "__metadata__"]
    return [*pairs, (tensors[0][0], tensors[1][1])]


def _metadata(value):
    return lambda pairs: [("__metadata__", value), *[(k, e) for k, e in pairs if k != "__metadata__"]]


def _dtype_said(dtype):  # the embedding's header says `dtype` while its bytes stay F32
    return lambda pairs: [(k, {**e, "dtype": dtype} if k == "model.embed_tokens.weight" else e) for k, e in pairs]


def _appended(tmp):  # 16 bytes after the last tensor
    with open(f"{tmp}/model/model.safetensors", "ab") as f:
        f.write(bytes(16))


def _linked_out(name):  # setup: the model's `name` a link to {tmp}/secret.txt, outside the model folder
    def setup(tmp):
        bad.write(f"{tmp}/secret.txt", "a private key")
        path = f"{tmp}/model/{name}"
        if os.path.lexists(path):
            os.remove(path)
        os.symlink(os.path.join(tmp, "secret.txt"), path)
    return setup


def _index_moving(name):
    """setup: an index that puts `name` in b.safetensors, a shard that holds only x.weight."""
    def setup(tmp):
        from safetensors.torch import save_file
        save_file({"x.weight": torch.zeros(2)}, f"{tmp}/model/b.safetensors")
        names = hf_files.read_safetensors_header(f"{tmp}/model/model.safetensors")[0]
        weight_map = {**dict.fromkeys(names, "model.safetensors"), name: "b.safetensors"}
        bad.write(f"{tmp}/model/model.safetensors.index.json", json.dumps({"weight_map": weight_map}))
    return setup


SAYS_F32 = "but a weight must be one of F32, BF16, F16"
CASES = [
    # dtypes: a weight or bias F32/BF16/F16, NVFP4's own tensors their fixed dtypes; refused from the header
    Case("dtype-01-int-norm", "qerl/quantize", Q, "model.safetensors: tensor model.layers.0.input_layernorm.weight "
         f"has dtype I32, {SAYS_F32}", setup=_retype("input_layernorm.weight", torch.int32)),
    Case("dtype-01-f64-projection", "qerl/quantize", Q, f"self_attn.q_proj.weight has dtype F64, {SAYS_F32}",
         setup=_retype("self_attn.q_proj.weight", torch.float64)),
    Case("dtype-01-int-bias", "qerl/quantize", Q, "k_proj.bias has dtype I64, but a bias must be one of F32",
         setup=_retype("k_proj.bias", torch.int64)),
    Case("dtype-03-int-norm", "qerl/rollout", M, f"input_layernorm.weight has dtype I32, {SAYS_F32}",
         setup=_retype("input_layernorm.weight", torch.int32)),
    Case("dtype-03-f64-projection", "qerl/rollout", M, f"mlp.up_proj.weight has dtype F64, {SAYS_F32}",
         setup=_retype("mlp.up_proj.weight", torch.float64)),
    Case("dtype-03-f8-projection", "qerl/rollout", [*M, "--quant", "nvfp4"],
         f"mlp.down_proj.weight has dtype F8_E4M3, {SAYS_F32}", setup=_retype("mlp.down_proj.weight",
                                                                              torch.float8_e4m3fn)),
    Case("dtype-03-nvfp4-scale-f32", "qerl/rollout", ["--model", "{tmp}/q"], "q/model.safetensors: tensor model.layers"
         ".0.mlp.down_proj.weight_scale has dtype F32, but an NVFP4 weight_scale must be F8_E4M3",
         setup=_quantized_then(_retype("down_proj.weight_scale", torch.float32, "q"))),
    Case("dtype-03-nvfp4-packed-i8", "qerl/rollout", ["--model", "{tmp}/q"], "weight_packed has dtype I8, but an "
         "NVFP4 weight_packed must be U8", setup=_quantized_then(_retype("q_proj.weight_packed", torch.int8, "q"))),
    Case("dtype-04-f64-embedding", "qerl/aqn", M, f"embed_tokens.weight has dtype F64, {SAYS_F32}",
         setup=_retype("embed_tokens.weight", torch.float64)),
    Case("dtype-05-int-norm", "qerl/train", RUN, f"model.norm.weight has dtype I32, {SAYS_F32}",
         setup=_retype("model.norm.weight", torch.int32)),
    # headers that do not describe their file: the INPUT is named (01 named its output folder)
    Case("header-01-overlap", "qerl/quantize", Q, "model/model.safetensors: tensor model.layers.0.input_layernorm"
         ".weight's data_offsets [147452, 147964] overlaps the tensor before it (which ends at 147456)",
         setup=_header_pairs(_second_shifted(-4))),
    Case("header-01-gap", "qerl/quantize", Q, "leaves a gap after the tensor before it",
         setup=_header_pairs(_second_shifted(4))),
    Case("header-01-negative", "qerl/quantize", Q, "model/model.safetensors: tensor model.embed_tokens.weight's "
         "data_offsets [-4, 147452] is negative", setup=_header_pairs(_first_negative)),
    Case("header-01-duplicate-name", "qerl/quantize", Q, "model/model.safetensors is not a readable safetensors file "
         "(the name 'model.embed_tokens.weight' appears twice in its header)", setup=_header_pairs(_duplicate_first)),
    Case("header-01-metadata-not-text", "qerl/quantize", Q, "model.safetensors is not a readable safetensors file "
         "(its __metadata__ must map names to strings)", setup=_header_pairs(_metadata({"format": 1}))),
    Case("header-01-dtype-lies", "qerl/quantize", Q, "tensor model.embed_tokens.weight's data_offsets [0, 147456] spans "
         "147456 bytes, while shape [288, 128] of F16 is 73728", setup=_header_pairs(_dtype_said("F16"))),
    Case("header-01-bytes-after", "qerl/quantize", Q, "model/model.safetensors holds 16 bytes after its last tensor",
         setup=_appended),
    Case("header-03-duplicate-name", "qerl/rollout", M, "appears twice in its header",
         setup=_header_pairs(_duplicate_first)),
    Case("header-03-overlap", "qerl/rollout", M, "overlaps the tensor before it",
         setup=_header_pairs(_second_shifted(-4))),
    # an index that puts a tensor in a shard without it (the embedding: a KeyError in config checks)
    Case("index-01-embedding-elsewhere", "qerl/quantize", Q, "model.safetensors.index.json puts "
         "model.embed_tokens.weight in b.safetensors, which does not hold it", setup=_index_moving(
             "model.embed_tokens.weight")),
    Case("index-03-norm-elsewhere", "qerl/rollout", M, "puts model.norm.weight in b.safetensors, which does not hold it",
         setup=_index_moving("model.norm.weight")),
    # --model that is a file
    Case("model-01-is-a-file", "qerl/quantize", ["--model", "{model}/model.safetensors", "--out", "{tmp}/q"],
         "model/model.safetensors is a file, not a folder: a model is a Hugging Face folder"),
    Case("model-03-is-a-file", "qerl/rollout", ["--model", "{model}/config.json"], "config.json is a file, not a folder"),
    Case("model-05-is-a-file", "qerl/train", ["--model", "{model}/config.json", *bad.RUN], "is a file, not a folder"),
    # a file 01 copies as it is, linked out of the model folder
    Case("link-01-tokenizer-config-outside", "qerl/quantize", Q, "model/tokenizer_config.json is a link to "
         "{tmp}/secret.txt, outside the model folder; 01 copies it into its output",
         setup=_linked_out("tokenizer_config.json")),
    Case("link-01-merges-outside", "qerl/quantize", Q, "model/merges.txt is a link to", setup=_linked_out("merges.txt")),
]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_weights(case, tmp_path, capsys):
    case = dataclasses.replace(case, message=case.message.replace("{tmp}", os.path.realpath(tmp_path)))
    bad.run_case(case, str(tmp_path), capsys)


def test_header_over_the_limit_names_the_input(tmp_path, capsys, monkeypatch):
    """A header longer than safetensors reads (100 MB; lowered here, so that the file stays small) is refused
    from its length, naming the input file, before 01 writes anything."""
    monkeypatch.setattr(hf_files, "MAX_HEADER_BYTES", 1000)
    line = bad.run_case(Case("header-01-too-long", "qerl/quantize", Q, "model/model.safetensors is not a readable "
                             "safetensors file (its header is "), str(tmp_path), capsys)
    assert "over the 1000 safetensors reads" in line


def test_what_stays_accepted_loads_and_quantizes(tmp_path):
    """BF16 and F16 weights, an I64 tensor that is not a weight (a rotary inv_freq some exports keep), and a
    tokenizer file linked into the Hugging Face cache's blobs (snapshots/REV/x -> ../../blobs/SHA): 01 quantizes
    the folder, copying the linked file's content, and 03 loads the input and the output."""
    from safetensors.torch import load_file, save_file
    snapshot = tmp_path / "models--org--tiny" / "snapshots" / "rev"
    blobs = tmp_path / "models--org--tiny" / "blobs"
    shutil.copytree(bad.TINY, snapshot)
    t = load_file(snapshot / "model.safetensors")
    t = {k: v.to(torch.bfloat16 if "mlp" in k else torch.float16) for k, v in t.items()}
    t["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.arange(16, dtype=torch.int64)
    save_file(t, snapshot / "model.safetensors", metadata={"format": "pt"})
    os.makedirs(blobs)
    os.replace(snapshot / "tokenizer_config.json", blobs / "abc123")
    os.symlink("../../blobs/abc123", snapshot / "tokenizer_config.json")

    model, _ = rollout.load_model(snapshot, device="cpu")
    assert model.model.layers[0].mlp.up_proj.weight.dtype == torch.float32  # the compute dtype
    torch.testing.assert_close(model.model.layers[0].mlp.up_proj.weight, t["model.layers.0.mlp.up_proj.weight"].float(),
                               rtol=0, atol=0)
    r = quantize.quantize_checkpoint(str(snapshot), str(tmp_path / "q"), log=lambda s: None)
    assert (r["quantized"], r["tensors"]) == (28, 51)
    out = tmp_path / "q" / "tokenizer_config.json"
    assert not out.is_symlink() and out.read_bytes() == (blobs / "abc123").read_bytes()
    q, _ = rollout.load_model(tmp_path / "q", device="cpu")
    assert isinstance(q.model.layers[0].mlp.up_proj, quantize.NVFP4Linear)
