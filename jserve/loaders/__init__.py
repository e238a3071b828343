"""Layer: loaders. Model files (GGUF, safetensors, jserve checkpoints) into parameters and
configs, tokenizers, chat templates and incremental detokenization; no model code."""
