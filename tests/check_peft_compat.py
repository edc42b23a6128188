"""Hand-run cross-check (NOT part of the pytest suite: it needs transformers + peft, which the
project does not depend on): an adapter written by 02_lora.save_adapter loads in PEFT and gives
the same logits, and an adapter written by PEFT loads with 02_lora.load_adapter.

    /tmp/refenv/bin/python tests/check_peft_compat.py      # any env with torch, transformers, peft

It builds a tiny random Qwen2 (hidden 64, 2 layers), so it downloads nothing, and checks:
1) ours -> PEFT, 2) PEFT (rsLoRA, 3 targets) -> ours, 3) merge_lora == PEFT's merge_and_unload,
4) stage 03's CausalLM + LoRA == HF Qwen2 + PEFT on tests/data/qwen2 (if present),
5) trained RMSNorm gains saved as modules_to_save load both ways (05 --train-norms).
"""
import copy
import importlib
import os
import sys
import tempfile

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import Qwen2Config, Qwen2ForCausalLM

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
lora = importlib.import_module("qerl.lora")

torch.manual_seed(0)
cfg = Qwen2Config(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
base = Qwen2ForCausalLM(cfg).eval()
ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(1))  # (B, T)
with torch.no_grad():
    y_base = base(ids).logits  # (B, T, V)

# 1) ours -> PEFT
ours = lora.add_lora(copy.deepcopy(base), r=8, alpha=16, generator=torch.Generator().manual_seed(2))
g = torch.Generator().manual_seed(3)
with torch.no_grad():
    for name, t in lora.lora_state_dict(ours).items():
        if name.endswith("lora_B"):
            t.copy_(0.05 * torch.randn(t.shape, generator=g))
    y_ours = ours(ids).logits  # (B, T, V)
with tempfile.TemporaryDirectory() as d:
    lora.save_adapter(ours, d, base_model_name_or_path="tiny-random-qwen2")
    peft_model = PeftModel.from_pretrained(copy.deepcopy(base), d).eval()
    with torch.no_grad():
        y_peft = peft_model(ids).logits
        with peft_model.disable_adapter():
            y_peft_off = peft_model(ids).logits
print(f"ours->peft | max |ours - peft| {(y_ours - y_peft).abs().max():.3e} | "
      f"max |ours - base| {(y_ours - y_base).abs().max():.3e} | "
      f"peft disabled == base {torch.equal(y_peft_off, y_base)}")
torch.testing.assert_close(y_peft, y_ours, rtol=1e-5, atol=1e-5)

# 2) PEFT -> ours
pcfg = LoraConfig(r=4, lora_alpha=12, target_modules=["q_proj", "v_proj", "down_proj"], task_type="CAUSAL_LM",
                  use_rslora=True, init_lora_weights=False)  # random A and B: not a no-op
pm = get_peft_model(copy.deepcopy(base), pcfg).eval()
with torch.no_grad():
    y_pm = pm(ids).logits
with tempfile.TemporaryDirectory() as d:
    pm.save_pretrained(d)
    mine = lora.load_adapter(copy.deepcopy(base), d)  # wraps from adapter_config.json
with torch.no_grad():
    y_mine = mine(ids).logits
print(f"peft->ours | max |peft - ours| {(y_pm - y_mine).abs().max():.3e} | "
      f"max |peft - base| {(y_pm - y_base).abs().max():.3e}")
torch.testing.assert_close(y_mine, y_pm, rtol=1e-5, atol=1e-5)

# 3) merged weights agree with PEFT's merge_and_unload
with torch.no_grad():
    y_merged_peft = pm.merge_and_unload()(ids).logits
    y_merged_ours = lora.merge_lora(mine)(ids).logits
print(f"merge      | max |peft merged - ours merged| {(y_merged_peft - y_merged_ours).abs().max():.3e}")
torch.testing.assert_close(y_merged_ours, y_merged_peft, rtol=1e-5, atol=1e-5)

# 5) trained RMSNorm gains as modules_to_save (05 --train-norms), both ways
norms = ["input_layernorm", "post_attention_layernorm"]
ours = lora.add_lora(copy.deepcopy(base), r=8, alpha=16, generator=torch.Generator().manual_seed(6))
with torch.no_grad():
    for name, t in lora.lora_state_dict(ours).items():
        if name.endswith("lora_B"):
            t.copy_(0.05 * torch.randn(t.shape, generator=g))
    for name, p in ours.named_parameters():
        if name.endswith(("input_layernorm.weight", "post_attention_layernorm.weight")):
            p.add_(0.1 * torch.randn(p.shape, generator=g))
    y_ours = ours(ids).logits
with tempfile.TemporaryDirectory() as d:
    lora.save_adapter(ours, d, base_model_name_or_path="tiny-random-qwen2", modules_to_save=norms)
    peft_model = PeftModel.from_pretrained(copy.deepcopy(base), d).eval()
    with torch.no_grad():
        y_peft = peft_model(ids).logits
print(f"ours->peft, modules_to_save | max |ours - peft| {(y_ours - y_peft).abs().max():.3e} | "
      f"max |ours - base| {(y_ours - y_base).abs().max():.3e}")
torch.testing.assert_close(y_peft, y_ours, rtol=1e-5, atol=1e-5)
pcfg = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM",
                  modules_to_save=norms, init_lora_weights=False)
pm = get_peft_model(copy.deepcopy(base), pcfg).eval()
with torch.no_grad():
    for name, p in pm.named_parameters():
        if "modules_to_save" in name:
            p.add_(0.1 * torch.randn(p.shape, generator=g))
    y_pm = pm(ids).logits
with tempfile.TemporaryDirectory() as d:
    pm.save_pretrained(d)
    mine = lora.load_adapter(copy.deepcopy(base), d)
with torch.no_grad():
    y_mine = mine(ids).logits
print(f"peft->ours, modules_to_save | max |peft - ours| {(y_pm - y_mine).abs().max():.3e} | "
      f"max |peft - base| {(y_pm - y_base).abs().max():.3e}")
torch.testing.assert_close(y_mine, y_pm, rtol=1e-5, atol=1e-5)

# 4) stage 03's own model (HF module names) -> PEFT on the HF model of the same checkpoint
tiny = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "qwen2")
if os.path.isdir(tiny):
    rollout = importlib.import_module("qerl.rollout")
    ours, _ = rollout.load_model(tiny, quant="none", dtype=torch.float32, device="cpu")
    hf = Qwen2ForCausalLM.from_pretrained(tiny, dtype=torch.float32).eval()
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(4))  # (B, T)
    with torch.no_grad():
        gap_base = (ours(ids).float() - hf(ids).logits).abs().max()
        lora.add_lora(ours, r=8, alpha=16, generator=torch.Generator().manual_seed(5))
        for name, t in lora.lora_state_dict(ours).items():
            if name.endswith("lora_B"):
                t.copy_(0.05 * torch.randn(t.shape, generator=g))
        y_ours = ours(ids).float()
    with tempfile.TemporaryDirectory() as d:
        lora.save_adapter(ours, d, base_model_name_or_path=tiny)
        peft_hf = PeftModel.from_pretrained(hf, d).eval()
        with torch.no_grad():
            y_hf = peft_hf(ids).logits
            with peft_hf.disable_adapter():
                moved = (y_hf - peft_hf(ids).logits).abs().max()
    gap = (y_ours - y_hf).abs().max()
    print(f"03 model   | max |ours+LoRA - HF+PEFT| {gap:.3e} | same without LoRA {gap_base:.3e} | "
          f"LoRA moves logits by up to {moved:.3e}")
    torch.testing.assert_close(y_ours, y_hf, rtol=1e-4, atol=1e-4)
print("PEFT cross-check passed")
