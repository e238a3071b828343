"""Layer: layers (jax, flax). Attention, RoPE and RMSNorm; `attention` is the only caller of
the kernels in `jserve.pallas`."""
