"""SmolLM2's shape with seeded random fp32 weights, where the embedded checkpoint is looked for (the GGUF cannot travel)."""
import sys
from pathlib import Path

import torch
from transformers import AutoConfig, LlamaForCausalLM

out = Path(sys.argv[1])
config = AutoConfig.from_pretrained(out)
torch.manual_seed(0)
model = LlamaForCausalLM(config).float().eval()
model.save_pretrained(out)
print("wrote", out, sum(p.numel() for p in model.parameters()))
