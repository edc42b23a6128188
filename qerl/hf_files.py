"""A Hugging Face model folder's files: config.json's fields and checks, the weights (found, each shard's
safetensors header checked, the config held against them, before any tensor is read), tensor reads, the
tokenizer, the ChatML prompt.

Engine code beneath the stages (it imports no stage): 01 finds and checks a folder's weights before
quantizing it (find_weight_files, read_weight_headers, check_config_fits_weights); 03's
`ModelConfig.from_dict` and `load_model` call the checks, the readers and `load_tokenizer`; 03, 04 and 05
write prompts with `chat_prompt`. Every bad field or
file is one line naming the file, the problem and what to do (tests/test_bad_inputs.py holds the cases).
"""
import json
import math
import os
from collections import Counter
from pathlib import Path

import tokenizers
import torch
import torch.nn as nn
from safetensors import safe_open

from qerl import files

# ---------------------------------------------------------------------------------------------------
# config.json: the fields 03's ModelConfig reads, checked before any tensor is allocated

SUPPORTED_MODEL_TYPES = ("qwen2", "llama", "qwen3")
CONFIG_SIZES = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")


def check_config(d, where):
    mt = d.get("model_type")
    if mt not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"{where}: unsupported model_type {mt!r}; supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
    if d.get("hidden_act", "silu") != "silu":
        raise ValueError(f"{where}: hidden_act {d['hidden_act']!r} is not supported (only silu)")
    check_config_booleans(d, where)
    if d.get("use_sliding_window"):
        raise ValueError(f"{where}: use_sliding_window=true is not supported; set it to false")
    missing = [k for k in CONFIG_SIZES if k not in d]
    if missing:
        raise ValueError(f"{where}: missing required field(s) {', '.join(missing)}")
    for k in ("rope_parameters", "rope_scaling"):
        if d.get(k) is not None and not isinstance(d[k], dict):
            raise ValueError(f"{where}: {k} must be an object {{...}} or null, got {d[k]!r}")
    for k in (*CONFIG_SIZES, "num_key_value_heads", "head_dim", "max_position_embeddings"):
        if d.get(k) is not None:
            check_positive(where, k, d[k], int)
    for k, v in (("rms_norm_eps", d.get("rms_norm_eps")), ("rope_theta", d.get("rope_theta")),
                 ("rope_parameters.rope_theta", (d.get("rope_parameters") or {}).get("rope_theta"))):
        if v is not None:
            check_positive(where, k, v, float)
    H, H_kv = d["num_attention_heads"], d.get("num_key_value_heads") or d["num_attention_heads"]
    if d.get("head_dim") is None and d["hidden_size"] % H:
        raise ValueError(f"{where}: hidden_size {d['hidden_size']} is not divisible by num_attention_heads {H} "
                         f"(and there is no head_dim)")
    if H % H_kv:
        raise ValueError(f"{where}: num_attention_heads {H} is not a multiple of num_key_value_heads {H_kv}")
    if (d.get("head_dim") or d["hidden_size"] // H) % 2:  # RoPE rotates pairs of lanes
        raise ValueError(f"{where}: head_dim {d.get('head_dim') or d['hidden_size'] // H} must be even for RoPE")


def model_config_fields(d, where="config.json"):
    """config.json's dict, checked -> the keyword arguments of 03's ModelConfig (its defaults filled in as
    Hugging Face fills them: no num_key_value_heads means one per query head, no head_dim hidden / heads)."""
    check_config(d, where)
    mt, heads, bias = d["model_type"], d["num_attention_heads"], d.get("attention_bias", False)
    return dict(
        model_type=mt, vocab_size=d["vocab_size"], hidden_size=d["hidden_size"],
        intermediate_size=d["intermediate_size"], num_hidden_layers=d["num_hidden_layers"],
        num_attention_heads=heads, num_key_value_heads=d.get("num_key_value_heads") or heads,
        head_dim=d.get("head_dim") or d["hidden_size"] // heads, rms_norm_eps=d.get("rms_norm_eps", 1e-6),
        rope_theta=float(d.get("rope_theta", (d.get("rope_parameters") or {}).get("rope_theta", 10000.0))),
        rope_scaling=rope_scaling(d, where), max_position_embeddings=d.get("max_position_embeddings", 2048),
        tie_word_embeddings=d.get("tie_word_embeddings", False),
        attention_bias=True if mt == "qwen2" else bias, o_bias=False if mt == "qwen2" else bias,
        mlp_bias=d.get("mlp_bias", False), qk_norm=(mt == "qwen3"))


def check_positive(where, name, v, kind):
    # bool is an int to Python, and "128" (a number written as a string) is not a size
    number = isinstance(v, int) if kind is int else isinstance(v, (int, float)) and math.isfinite(v)
    if not number or isinstance(v, bool) or v <= 0:
        raise ValueError(f"{where}: {name} must be a positive {'integer' if kind is int else 'number'}, got {v!r}")


def rope_scaling(d, where):
    """config.json's RoPE scaling -> the llama3 dict 03's rope_inv_freq applies, or None (no scaling)."""
    # transformers < 5 writes rope_theta + rope_scaling; transformers 5 writes one rope_parameters dict.
    rope = d.get("rope_parameters") or {}
    scaling = d.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
    if scaling is None:
        return None
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind not in ("default", "llama3"):
        raise ValueError(f"{where}: rope scaling {kind!r} is not supported (only 'llama3')")
    if kind == "llama3":
        for k in ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"):
            check_positive(where, f"rope scaling's {k}", scaling.get(k), float)
        if scaling["high_freq_factor"] <= scaling["low_freq_factor"]:  # rope_inv_freq divides by their gap
            raise ValueError(f"{where}: rope scaling needs high_freq_factor > low_freq_factor, got "
                             f"{scaling['high_freq_factor']} and {scaling['low_freq_factor']}")
    return scaling if kind == "llama3" else None


def check_vocab(tokenizer, vocab_size, path):
    # config.json's vocab_size is the embedding's rows, often padded past the tokenizer for faster matmuls
    # (Qwen2.5-0.5B: 151,665 tokens, 151,936 rows): a few percent more rows is normal. A token id past the
    # rows has no embedding, and a tokenizer under half the rows belongs to another model (288 tokens
    # beside a 49,152-row model: it runs, and samples gibberish).
    top = max(tokenizer.tok.get_vocab(with_added_tokens=True).values(), default=-1)
    if top >= vocab_size or 2 * (top + 1) < vocab_size:
        raise ValueError(f"{Path(path) / 'tokenizer.json'} has token ids up to {top}, but config.json's vocab_size "
                         f"is {vocab_size}: the tokenizer belongs to another model; put this model's own "
                         f"tokenizer.json beside it")
    # an end-of-sequence id with no logit can never be sampled: generation would run to max_new_tokens every time
    past = [i for i in [*tokenizer.eos_token_ids, tokenizer.pad_token_id] if i >= vocab_size]
    if past:
        raise ValueError(f"{Path(path)}: eos_token_id/pad_token_id {past[0]} is past config.json's vocab_size "
                         f"{vocab_size} (generation_config.json or config.json): use this model's own ids")


# ---------------------------------------------------------------------------------------------------
# The folder's weights, found and checked before any tensor is read: config.json against them, and
# each shard's safetensors header. A safetensors file is: 8-byte little-endian header length, a JSON
# header {name: {dtype, shape, data_offsets}}, then the raw bytes.

ST_DTYPE_BYTES = {"F64": 8, "I64": 8, "F32": 4, "I32": 4, "F16": 2, "BF16": 2, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1,
                  "F8_E4M3": 1, "F8_E5M2": 1}


MAX_HEADER_BYTES = 100_000_000  # safetensors' own limit: a longer header is refused before it is read


def _unique_keys(pairs):
    """json's object_pairs_hook: a name given twice is an error (json would keep the last one silently)."""
    obj = dict(pairs)
    if len(obj) != len(pairs):
        seen = set()
        raise ValueError(f"the name {next(k for k, _ in pairs if k in seen or seen.add(k))!r} appears twice in "
                         f"its header")
    return obj


def read_safetensors_header(path):
    """-> ({name: {dtype, shape, data_offsets}}, byte where the data starts). Checked as safetensors checks
    before it reads a tensor, so that a bad file is one line naming it before any work (01 would otherwise
    meet it mid-write): a header of at most MAX_HEADER_BYTES, each name once, string metadata, known dtypes,
    and data_offsets that tile the data exactly, in shape x dtype bytes each (none negative, overlapping,
    apart, past the end, nor bytes left after the last)."""
    try:
        f = files.open_regular(path)  # a pipe or a device: check_regular's line
    except OSError as e:
        raise ValueError(f"{path} is not a readable safetensors file ({e})") from None
    try:
        with f:
            size = os.fstat(f.fileno()).st_size
            n = int.from_bytes(f.read(8), "little")
            if not 2 <= n <= size - 8:  # random bytes: a "header length" of exabytes
                raise ValueError(f"header length {n} does not fit a {size}-byte file")
            if n > MAX_HEADER_BYTES:
                raise ValueError(f"its header is {n} bytes, over the {MAX_HEADER_BYTES} safetensors reads")
            header = json.loads(f.read(n), object_pairs_hook=_unique_keys)
        metadata = header.pop("__metadata__", {})
        if not (isinstance(metadata, dict) and all(isinstance(v, str) for v in metadata.values())):
            raise ValueError("its __metadata__ must map names to strings")
        for k, v in header.items():
            if v["dtype"] not in ST_DTYPE_BYTES:
                raise ValueError(f"tensor {k} has dtype {v['dtype']}, which this reader does not know")
            shape, offsets = v.get("shape"), v.get("data_offsets")  # JSON: anything may be any type
            if not (isinstance(shape, list) and all(type(d) is int and d >= 0 for d in shape) and
                    isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets)):
                raise ValueError(f"tensor {k} needs a list of sizes as its shape and two byte offsets as its "
                                 f"data_offsets, got {shape!r} and {offsets!r}")
    except RecursionError:  # a header of 100,000 nested lists
        raise ValueError(f"{path} is not a readable safetensors file (its header nests too deeply)") from None
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"{path} is not a readable safetensors file ({e})") from None
    end = 0  # checked before anything is written: a cut-off download fails here
    for k, v in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"]):
        (b, e), nbytes = v["data_offsets"], ST_DTYPE_BYTES[v["dtype"]] * math.prod(v["shape"])
        if b < 0 or e - b != nbytes or b != end:
            where = "is negative" if b < 0 else f"overlaps the tensor before it (which ends at {end})" if b < end \
                else f"leaves a gap after the tensor before it (which ends at {end})" if b > end \
                else f"spans {e - b} bytes, while shape {v['shape']} of {v['dtype']} is {nbytes}"
            raise ValueError(f"{path}: tensor {k}'s data_offsets [{b}, {e}] {where}; the header is corrupt, "
                             f"download or write the file again")
        if 8 + n + e > size:
            raise ValueError(f"{path}: tensor {k} needs bytes {8 + n + b}..{8 + n + e} but the file has {size}; "
                             f"the file is truncated or corrupt, download it again")
        end = e
    if 8 + n + end != size:
        raise ValueError(f"{path} holds {size - 8 - n - end} bytes after its last tensor, which its header does "
                         f"not describe; the file is corrupt, download or write it again")
    return header, 8 + n


def safetensors_problem(path):
    """One line saying what is wrong with a safetensors file (unreadable header, a tensor past the end of
    the file), or None when its header and sizes are sound. For reporting a file safetensors refuses."""
    try:
        read_safetensors_header(path)
    except ValueError as e:
        return str(e)
    return None


def find_weight_files(model_dir):
    """-> (config, {tensor name: shard file name}, has_index); one clear error for a bad folder."""
    if os.path.exists(model_dir) and not os.path.isdir(model_dir):
        what = "a file" if os.path.isfile(model_dir) else files.file_kind(os.stat(model_dir).st_mode)
        raise ValueError(f"{model_dir} is {what}, not a folder: a model is a Hugging Face folder (config.json, "
                         f"*.safetensors, tokenizer.json); pass the model's folder, not a file")
    if not os.path.isdir(model_dir):
        raise FileNotFoundError(f"model folder not found: {model_dir}")
    if not os.path.lexists(os.path.join(model_dir, "config.json")):
        raise FileNotFoundError(f"{model_dir} has no config.json (expected a Hugging Face model folder)")
    config = files.read_json(os.path.join(model_dir, "config.json"))  # a pipe or a device: refused, not read
    index = os.path.join(model_dir, "model.safetensors.index.json")
    has_index = os.path.lexists(index)
    if has_index:
        weight_map = files.read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"{index} has no weight_map")
        for tensor, shard in weight_map.items():  # a name from a file: it must not lead out of the folder
            if not files.is_plain_name(shard):
                raise ValueError(f"{index}: weight_map entry {tensor!r} names {shard!r}, which is not a file name "
                                 f"beside the index (a path outside the model folder, or into a subfolder): "
                                 f"every shard must be a file in {model_dir}; fix the index")
    elif os.path.lexists(os.path.join(model_dir, "model.safetensors")):
        weight_map = {k: "model.safetensors" for k in read_safetensors_header(os.path.join(model_dir, "model.safetensors"))[0]}
    else:
        raise FileNotFoundError(f"{model_dir} has neither model.safetensors nor model.safetensors.index.json")
    for shard in sorted(set(weight_map.values())):
        if not os.path.lexists(os.path.join(model_dir, shard)):
            raise FileNotFoundError(f"shard {shard} listed in the index is missing from {model_dir}")
        files.check_regular(os.path.join(model_dir, shard))
    return config, weight_map, has_index


FLOAT_DTYPES = ("F32", "BF16", "F16")  # a weight or a bias: what torch computes with, as stored
# A compressed-tensors NVFP4 layer's own tensors (qerl/quantize.py's output): 4-bit codes two to a byte, FP8 block
# scales, an FP32 tensor scale (and vLLM's activation scale, which 03 skips)
NVFP4_DTYPES = {"weight_packed": ("U8",), "weight_scale": ("F8_E4M3",), "weight_global_scale": ("F32",),
                "input_global_scale": ("F32",)}


def _listed_tensor(model_dir, header, name, shard):
    """header[name], or one line saying that the index puts `name` in a shard that does not hold it."""
    if name not in header:
        raise ValueError(f"{os.path.join(model_dir, 'model.safetensors.index.json')} puts {name} in {shard}, which "
                         f"does not hold it: fix the index, or download the folder again")
    return header[name]


def read_weight_headers(model_dir, weight_map):
    """Every shard's header, checked (read_safetensors_header), before any tensor is read -> {shard: header}.
    Each tensor the index lists must be in its shard, and each weight stored in a dtype the stages compute
    with: a weight or a bias in FLOAT_DTYPES, an NVFP4 layer's tensors in NVFP4_DTYPES. Without this an I32
    norm gain was copied by 01 and a traceback in 03, and an F64 projection a dtype clash at its first matmul.
    Other tensors (a rotary inv_freq some exports keep) are never computed with, and pass. 01 and 03 (so 04
    and 05, which load through 03) call it."""
    headers = {s: read_safetensors_header(os.path.join(model_dir, s))[0] for s in sorted(set(weight_map.values()))}
    for name, shard in weight_map.items():
        _listed_tensor(model_dir, headers[shard], name, shard)
    for shard, header in headers.items():
        for name, info in header.items():
            leaf = name.rpartition(".")[2]
            allowed = NVFP4_DTYPES.get(leaf) or (FLOAT_DTYPES if leaf in ("weight", "bias") else None)
            if allowed and info["dtype"] not in allowed:
                what = f"an NVFP4 {leaf}" if leaf in NVFP4_DTYPES else f"a {leaf}"
                raise ValueError(f"{os.path.join(model_dir, shard)}: tensor {name} has dtype {info['dtype']}, but "
                                 f"{what} must be {'one of ' * (len(allowed) > 1)}{', '.join(allowed)}: convert the "
                                 f"checkpoint (its export or its header is wrong)")
    return headers


def check_config_fits_weights(model_dir, config, weight_map):
    """config.json's sizes against the weights it sits beside (dict config; the embedding's shape from its
    safetensors header, the layer indices, lm_head): a config that disagrees is one line naming both, before an
    estimate or an output is made from it. 01 checks a folder before quantizing it, 05 before estimating memory."""
    where = os.path.join(model_dir, "config.json")
    name = "model.embed_tokens.weight"
    if name in weight_map:
        shape = _listed_tensor(model_dir, read_safetensors_header(os.path.join(model_dir, weight_map[name]))[0],
                               name, weight_map[name])["shape"]
        said = [config.get("vocab_size", shape[0]), config.get("hidden_size", shape[-1])]  # what it states
        if shape != said:
            raise ValueError(f"{where} says vocab_size {config.get('vocab_size')} and hidden_size "
                             f"{config.get('hidden_size')}, but {name} is {shape[0]} x {shape[-1]}: the config does "
                             f"not belong to these weights")
    layers = {int(k.split(".")[2]) for k in weight_map if k.startswith("model.layers.") and k.split(".")[2].isdigit()}
    n = config.get("num_hidden_layers")
    if layers and n is not None and (type(n) is not int or layers != set(range(n))):
        raise ValueError(f"{where} says num_hidden_layers {config.get('num_hidden_layers')}, but the weights hold "
                         f"layers {min(layers)}..{max(layers)} ({len(layers)} of them): the config does not belong "
                         f"to these weights")
    check_config_booleans(config, where)  # 01 reads tie_word_embeddings without hf_files.check_config
    if name in weight_map and not config.get("tie_word_embeddings", False) and "lm_head.weight" not in weight_map:
        raise ValueError(f"{where} says tie_word_embeddings false, but the weights have no lm_head.weight: set it "
                         f"to true if the model shares its embedding, or add the missing weights")


CONFIG_BOOLEANS = ("tie_word_embeddings", "attention_bias", "mlp_bias", "use_sliding_window")


def check_config_booleans(config, where):
    """config.json's true/false fields are JSON booleans (or null): the string "false" is truthy, and read as
    a truth value it would flip the meaning (a tied embedding, and the model's own lm_head dropped)."""
    for k in CONFIG_BOOLEANS:
        if config.get(k) is not None and not isinstance(config[k], bool):
            raise ValueError(f"{where}: {k} must be true or false, got {config[k]!r}")


# ---------------------------------------------------------------------------------------------------
# *.safetensors: one tensor at a time, checked, into a model built on the meta device

def read_tensor(handles, file, name):
    """Tensor `name` of safetensors `file` (handles: file -> open handle, filled as files are met); a file that
    cannot be read, or a float tensor holding NaN or Inf, is one clear error naming it."""
    try:
        if file not in handles:
            handles[file] = safe_open(file, "pt", device="cpu")  # memory-mapped, reads lazily
        t = handles[file].get_tensor(name)
    except Exception as e:  # safetensors raises its own SafetensorError (not an OSError/ValueError)
        raise ValueError(safetensors_problem(file) or f"{file}: cannot read tensor {name} ({e}); "
                         "the file is truncated or corrupt, download or write it again") from None
    if t.dtype in (torch.float32, torch.float16, torch.bfloat16) and not torch.isfinite(t).all():
        raise ValueError(f"{file}: tensor {name} holds NaN or Inf values; the checkpoint is broken (a diverged "
                         "run or a bad conversion): use another one")
    return t


def put_tensor(model, name, t, file="the checkpoint"):
    """Replace the meta tensor `name` by `t` (a Parameter stays a Parameter)."""
    mod_name, _, attr = name.rpartition(".")
    mod = model.get_submodule(mod_name)
    old = getattr(mod, attr)
    if tuple(old.shape) != tuple(t.shape):
        raise ValueError(f"{file}: weight {name} has shape {tuple(t.shape)}, config.json implies {tuple(old.shape)}")
    if attr in mod._parameters:
        mod._parameters[attr] = nn.Parameter(t, requires_grad=old.requires_grad)
    else:
        mod._buffers[attr] = t


# ---------------------------------------------------------------------------------------------------
# tokenizer.json, generation_config.json's ids, and the ChatML template

class Tokenizer:
    """A `tokenizers.Tokenizer` plus the ids generation needs (EOS list, pad) and the system message the
    model's chat template writes when the conversation has none (`default_system`, None if it writes none)."""

    def __init__(self, tok, eos_token_ids, pad_token_id=None, default_system=None):
        self.tok = tok
        self.default_system = default_system
        self.eos_token_ids = list(eos_token_ids)
        self.pad_token_id = pad_token_id if pad_token_id is not None else (self.eos_token_ids or [0])[0]
        self.vocab_size = tok.get_vocab_size()

    def encode(self, text):
        # tokenizer.json's own post-processor decides about BOS: Llama 3 adds <|begin_of_text|>,
        # Qwen adds nothing. ChatML special tokens in `text` map to their single ids.
        return self.tok.encode(text).ids

    def decode(self, ids, skip_special_tokens=True):
        return self.tok.decode(list(ids), skip_special_tokens=skip_special_tokens)


def load_tokenizer(path, config=None):
    """The folder's tokenizer.json -> Tokenizer, its EOS and pad ids from generation_config.json, else from
    `config` (config.json's dict). The tokenizer is checked as the project uses it (check_tokenizer), and
    the chat template must be ChatML, the one format chat_prompt writes."""
    path = Path(path)
    file = path / "tokenizer.json"
    if not file.exists():
        raise FileNotFoundError(f"{file} not found: the model folder needs a tokenizer.json "
                                "(the `tokenizers` format Hugging Face saves)")
    gen_file = path / "generation_config.json"  # its ids win over config.json's
    try:  # read here, as a regular file only (a pipe would block the Rust reader for good), then parsed
        with files.open_regular(file, "rb") as f:
            text = f.read().decode("utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"{file} cannot be read ({e}); write or download it again") from None
    try:
        tok = tokenizers.Tokenizer.from_str(text)
    except Exception as e:  # tokenizers raises its own Exception subclass on a corrupt file
        raise ValueError(f"{file} is not a readable tokenizer ({str(e)[:120]}); write or "
                         "download it again") from None
    check_tokenizer(tok, json.loads(text), file)  # valid JSON: the Rust reader just read it
    gen = {**(config or {}), **(files.read_json(gen_file) if gen_file.exists() else {})}
    eos, pad = gen.get("eos_token_id"), gen.get("pad_token_id")
    eos = [] if eos is None else [eos] if isinstance(eos, int) else eos
    token_id = lambda i: type(i) is int and i >= 0  # noqa: E731  (true is an int to Python, and would be id 1)
    if (not isinstance(eos, list) or (gen.get("eos_token_id") is not None and not eos)
            or not all(token_id(i) for i in eos) or not (pad is None or token_id(pad))):
        raise ValueError(f"{gen_file if gen_file.exists() else path / 'config.json'}: eos_token_id must be a token id or "
                         f"a list of them and pad_token_id a token id (or null), got {gen.get('eos_token_id')!r} and "
                         f"{pad!r}")
    template, where = chat_template(path)
    if template is not None and "<|im_start|>" not in template:
        raise ValueError(f"{where}: the chat template is not ChatML (it never writes <|im_start|>), and ChatML is the "
                         "only prompt format this project writes; use a ChatML model (Qwen2.5, SmolLM2)")
    return Tokenizer(tok, eos, pad, default_system(template))


_NOTED = set()  # notes already printed: 05 loads the tokenizer twice, and says each once


def note(line):
    if line not in _NOTED:
        _NOTED.add(line)
        print(line)


# A prompt as the project writes them: ChatML turns, digits, a decimal point, the answer tags
PROBE = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is 12 + 3.5?<|im_end|>\n" \
        "<|im_start|>assistant\n<think> 12 + 3.5 = 15.5 </think> <answer> 15.5 </answer>"


def check_tokenizer(tok, spec, file):
    """What tokenizer.json (`spec`, its JSON) may do to the project's prompts, checked once at load: ids that
    disagree with the file or name two tokens, no ChatML tokens, or a model that cannot encode are errors;
    truncation, padding and BPE dropout are turned off (a note); a post-processor that adds tokens anywhere but before the prompt
    is an error; one that adds tokens before it (BOS, as Llama 3's), or a normalizer that changes the
    prompt's text, is a note naming the file."""
    vocab, owner = spec["model"].get("vocab"), {}  # Unigram's vocab is a list: ids are its positions
    for token, i in vocab.items() if isinstance(vocab, dict) else ():
        if owner.setdefault(i, token) != token:
            raise ValueError(f"{file} gives id {i} to two tokens, {owner[i]!r} and {token!r}: the file is damaged; "
                             "write or download it again")
    for added in spec.get("added_tokens") or ():  # the library renumbers an added token whose id is taken
        if tok.token_to_id(added["content"]) != added["id"]:
            raise ValueError(f"{file} lists {added['content']!r} as id {added['id']}, but that id is taken or "
                             f"skips ahead, and the tokenizer gives it {tok.token_to_id(added['content'])}: the "
                             "file is damaged; write or download it again")
    off = [k for k in ("truncation", "padding") if getattr(tok, k)]  # a prompt cut to max_length, or padded
    if getattr(tok.model, "dropout", None):  # BPE dropout splits every prompt at random: a training trick
        tok.model.dropout, off = None, [*off, "dropout"]
    if off:
        tok.no_truncation()
        tok.no_padding()
        note(f"note | {file}: turned off its {', '.join(off)}: prompts are encoded whole, the same every time")
    for special in ("<|im_start|>", "<|im_end|>"):
        if len(tok.encode(special, add_special_tokens=False).ids) != 1 or tok.token_to_id(special) is None:
            raise ValueError(f"{file} has no {special} token: the project writes ChatML prompts, which this "
                             "model would read as plain text; use a ChatML model (Qwen2.5, SmolLM2)")
    try:
        bare, full = tok.encode(PROBE, add_special_tokens=False).ids, tok.encode(PROBE).ids
        back = tok.decode(bare, skip_special_tokens=False)
    except Exception as e:  # tokenizers raises a bare Exception: a WordLevel model without its [UNK], say
        raise ValueError(f"{file} cannot encode a prompt ({str(e)[:120]}); its model is broken: write or download "
                         "it again") from None
    if full[len(full) - len(bare):] != bare:  # tokens added after or inside the prompt (an EOS at its end)
        extra = [tok.id_to_token(i) for i in (Counter(full) - Counter(bare)).elements()]
        raise ValueError(f"{file}: its post-processor adds {extra} to every prompt, not only before it: the model "
                         "would read them before its turn; remove the post_processor")
    if len(full) > len(bare):
        note(f"note | {file}: its post-processor starts every prompt with "
             f"{tok.decode(full[:len(full) - len(bare)], skip_special_tokens=False)!r}")
    if back != PROBE:
        i = next(k for k, (a, b) in enumerate(zip(PROBE + "\0", back + "\1")) if a != b)
        note(f"note | {file}: its normalizer or pre-tokenizer changes the text of prompts "
             f"({PROBE[max(0, i - 12):i + 12]!r} reads back as {back[max(0, i - 12):i + 12]!r})")


def chat_template(folder):
    """(the chat template of a model folder, the file holding it): tokenizer_config.json's chat_template,
    else chat_template.jinja (where newer transformers save it); (None, None) without one."""
    config_file, jinja = Path(folder) / "tokenizer_config.json", Path(folder) / "chat_template.jinja"
    template = files.read_json(config_file).get("chat_template") if config_file.exists() else None
    if isinstance(template, str):
        return template, config_file
    return (files.read_text(jinja, "chat template "), jinja) if jinja.exists() else (None, None)


def default_system(template):
    """The system message a ChatML chat template writes when the conversation has none, or None.

    Such a template holds it as a literal '<|im_start|>system\\n...<|im_end|>' (Qwen2.5: "You are Qwen,
    ...", SmolLM2: "You are a helpful AI assistant named SmolLM, ..."); the block that prints the user's own
    system message has a quote there. The first such block with no quote in it is the message: found by
    scanning (the regex this replaced backtracked quadratically, a minute on a 371 KiB template)."""
    head = "<|im_start|>system"
    for piece in (template or "").split("<|im_end|>")[:-1]:  # the text before each <|im_end|>
        tail = piece[max(piece.rfind("'"), piece.rfind('"')) + 1:]  # a message holds no quote
        i = tail.find(head)
        while i >= 0:
            i += len(head)
            for newline in ("\n", "\\n"):  # a newline, or the two characters \n of a Jinja string
                if tail.startswith(newline, i) and len(tail) > i + len(newline):
                    return tail[i + len(newline):]
            i = tail.find(head, i)
    return None


def template_default_system(config_file):
    """The default system message of the chat template beside tokenizer_config.json (default_system), or None."""
    return default_system(chat_template(Path(config_file).parent)[0])


def chat_prompt(user, system=None):
    """ChatML prompt (Qwen2.5, SmolLM2), ending where the assistant starts talking. system=None writes no
    system block; pass `tokenizer.default_system` to write what the model's own template writes."""
    if not isinstance(user, str) or not (system is None or isinstance(system, str)):
        raise ValueError(f"chat_prompt: the user message and the system message (or None) must be strings, got "
                         f"{type(user).__name__} and {type(system).__name__}")
    head = f"<|im_start|>system\n{system}<|im_end|>\n" if system is not None else ""
    return f"{head}<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n"


def byte_tokenizer():
    """A byte-level tokenizer built in memory (256 byte tokens + 3 ChatML specials) for random models."""
    alphabet = sorted(tokenizers.pre_tokenizers.ByteLevel.alphabet())  # the 256 printable stand-ins for bytes
    tok = tokenizers.Tokenizer(tokenizers.models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    tok.add_special_tokens(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    return Tokenizer(tok, [tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")],
                     tok.token_to_id("<|endoftext|>"))
