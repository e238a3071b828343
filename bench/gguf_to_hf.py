"""GGUF SmolLM2 -> plain HF float32 directory (for the vLLM peer, bench/peer_vllm.md):
`python -m bench.gguf_to_hf GGUF_FILE OUT_DIR`."""

import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

gguf_path, out_dir = sys.argv[1], sys.argv[2]
folder, name = gguf_path.rsplit("/", 1)
loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
config = loaded.config
# The GGUF load leaves a quantization_config behind that save_pretrained refuses: rebuild.
if hasattr(config, "quantization_config"):
    del config.quantization_config
config.dtype = torch.float32
plain = LlamaForCausalLM(config)
missing, unexpected = plain.load_state_dict(loaded.state_dict(), strict=False)
assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
plain.tie_weights()
plain.save_pretrained(out_dir)
AutoTokenizer.from_pretrained(folder, gguf_file=name).save_pretrained(out_dir)
print("saved", out_dir, sum(p.numel() for p in plain.parameters()), "parameters")
