"""Layer: ahead-of-time compilation. `jserve compile` compiles every executable the engine
would run for a TPU slice or NVIDIA GPUs this machine lacks (their compilers run on a CPU), from
the model's config alone, and reports compile times, costs, memory and what fits: `chips` (the
targets' names and public peak figures, no JAX), `targets` (compile-only devices), `compiler`
(the engine's own set-up on the target's mesh), `costs` (XLA's cost analysis with the layer
scan counted per layer), `report`. Import the submodules: this package imports nothing, so
naming a target costs no JAX start-up."""
