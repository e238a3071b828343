"""Layer: configuration (pure Python, no jax). Engine and server settings declared once
(`settings.setting`: help, vLLM name, default, valid range; flags, docstrings and constructor
checks generated from it), the scheduler's and the KV pool's frozen configs, value validators
for numbers and token ids, and where caches live."""
