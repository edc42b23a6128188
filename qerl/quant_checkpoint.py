"""The plumbing of stage 01's checkpoint writer (01_quantize.quantize_checkpoint). Imports no stage.

01 quantizes a Hugging Face folder into a compressed-tensors `nvfp4-pack-quantized` folder. What it needs
beyond the quantization lives here: the quantization_config the output declares, the checks that run before
any tensor is read (the arguments, the tokenizer files copied beside the weights, each tensor's shape
against config.json) and reading one input shard's tensors. 01 re-exports its four constants.
"""
import os

from qerl import devices
from qerl import files
from qerl import hf_files

NVFP4_QUANT_CONFIG = {  # weight-only NVFP4 (W4A16): no input_activations, unlike the W4A4 example
    "config_groups": {"group_0": {
        "format": "nvfp4-pack-quantized", "input_activations": None, "output_activations": None,
        "targets": ["Linear"],
        "weights": {"dynamic": False, "group_size": 16, "num_bits": 4, "scale_dtype": "torch.float8_e4m3fn",
                    "strategy": "tensor_group", "symmetric": True, "type": "float"}}},
    "format": "nvfp4-pack-quantized", "global_compression_ratio": None, "ignore": ["lm_head"],
    "kv_cache_scheme": None, "moe_sparsity_config": None, "quant_method": "compressed-tensors",
    "quantization_status": "compressed", "sparsity_config": {}, "transform_config": {}}
QUANTIZE_COMMAND = "qerl/quantize.py"  # the command its output folders' manifest names
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "special_tokens_map.json",
                   "vocab.json", "merges.txt", "tokenizer.model", "added_tokens.json", "chat_template.jinja")

# The projections of a decoder layer, and the shapes config.json implies for its weights
LINEAR_NAMES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def check_copied_file_inside(model_dir, name):
    """A tokenizer file is copied into the output byte for byte, never parsed: one that is a link must lead
    inside the model folder, or into the blobs of the Hugging Face cache entry the folder is a snapshot of
    (models--ORG--NAME/snapshots/REV/tokenizer.json -> ../../blobs/SHA). A link to anywhere else (a planted
    one to ~/.ssh/id_rsa, say) would copy that file into an output meant to be shared."""
    real, home = os.path.realpath(os.path.join(model_dir, name)), os.path.realpath(model_dir)
    snapshots, entry = os.path.dirname(home), os.path.dirname(os.path.dirname(home))
    inside = [home]
    if os.path.basename(snapshots) == "snapshots" and os.path.basename(entry).startswith("models--"):
        inside.append(os.path.join(entry, "blobs"))
    if not any(real.startswith(folder + os.sep) for folder in inside):
        raise ValueError(f"{os.path.join(model_dir, name)} is a link to {real}, outside the model folder; 01 copies "
                         f"it into its output as it is: put the file itself in {model_dir}, or remove the link")


def check_checkpoint_args(model_dir, out_dir, fmt, force, device):
    """quantize_checkpoint's checks, before any tensor is read -> (config, weight_map, has_index, device)."""
    if fmt != "nvfp4":
        raise ValueError(f"checkpoint format {fmt!r} not supported: only nvfp4 (compressed-tensors) is written")
    config, weight_map, has_index = hf_files.find_weight_files(model_dir)
    if "quantization_config" in config:
        raise ValueError(f"{model_dir} is already quantized (its config.json has a quantization_config)")
    hf_files.check_config_fits_weights(model_dir, config, weight_map)  # the config is copied into the output as is
    for name in TOKENIZER_FILES:  # copied beside the weights: a pipe or a device there is refused, not skipped
        if os.path.lexists(os.path.join(model_dir, name)):
            files.check_regular(os.path.join(model_dir, name))
            check_copied_file_inside(model_dir, name)
    files.check_out_dir(out_dir, [model_dir], force=force,
                        ours=lambda f: files.output_files(f, QUANTIZE_COMMAND) is not None, command=QUANTIZE_COMMAND)
    return config, weight_map, has_index, devices.pick_device(device)


def expected_shape(name, config):
    """The shape config.json implies for a decoder weight (None for names it does not describe)."""
    C, I, H, V = (config.get(k) for k in ("hidden_size", "intermediate_size", "num_attention_heads", "vocab_size"))
    if not all(isinstance(v, int) for v in (C, I, H)):
        return None
    D = config.get("head_dim") or C // H
    KV = (config.get("num_key_value_heads") or H) * D
    shapes = {"q_proj": (H * D, C), "k_proj": (KV, C), "v_proj": (KV, C), "o_proj": (C, H * D), "gate_proj": (I, C),
              "up_proj": (I, C), "down_proj": (C, I), "input_layernorm": (C,), "post_attention_layernorm": (C,),
              "norm": (C,), "q_norm": (D,), "k_norm": (D,)}  # norms: copied as they are, so checked here
    if isinstance(V, int):
        shapes.update(embed_tokens=(V, C), lm_head=(V, C))
    parent, _, leaf = name.rpartition(".")
    return shapes.get(parent.rpartition(".")[2]) if leaf == "weight" else None


def read_input(path, names):
    """{name: tensor} from the input shard `path`. Its header passed read_safetensors_header's checks, so this
    should not fail; if safetensors still refuses the file, the line names this INPUT file (a SafetensorError
    raised while write_output writes would be reported as the output folder's)."""
    from safetensors import SafetensorError, safe_open
    try:
        with safe_open(path, framework="pt") as f:
            return {k: f.get_tensor(k) for k in names}
    except (OSError, SafetensorError) as e:
        raise ValueError(f"{path}: cannot read this input file ({e}); the file is corrupt, download or write it "
                         f"again") from None


def plan_shards(model_dir, weight_map, config, group_of):
    """-> (headers {shard: {tensor: info}}, where {tensor: shard}, fused groups {group_of(name): [weight names]}).
    Every header, size and shape is checked here, before anything is written."""
    headers = hf_files.read_weight_headers(model_dir, weight_map)  # each sound, each weight's dtype one to quantize
    where = {k: s for s in headers for k in headers[s]}
    for k, s in where.items():
        want, got = expected_shape(k, config), tuple(headers[s][k]["shape"])
        if want is not None and got != want:
            raise ValueError(f"{os.path.join(model_dir, s)}: tensor {k} has shape {got}, config.json implies {want}")
    groups, block = {}, NVFP4_QUANT_CONFIG["config_groups"]["group_0"]["weights"]["group_size"]  # 16
    for k in sorted(where):
        info, parts = headers[where[k]][k], k.split(".")
        if len(parts) >= 2 and parts[-1] == "weight" and parts[-2] in LINEAR_NAMES and len(info["shape"]) == 2:
            if info["shape"][1] % block:
                raise ValueError(f"{k}: in_features {info['shape'][1]} is not a multiple of 16, "
                                 "which compressed-tensors checkpoints need")
            groups.setdefault(group_of(k[: -len(".weight")]), []).append(k)
    return headers, where, groups
