"""Layer: models (jax, flax). The Llama-family model and its configuration; calls
`jserve.layers`, never the runtime or the scheduler."""
