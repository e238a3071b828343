"""Layer: runtime (mechanism, jax). The donated KV pool, step inputs, one compiled executable per
bucket, the sampler, compilation discipline, the device mesh and multi-process runs. It never
decides what runs: it executes the plan `jserve.core` hands it."""
