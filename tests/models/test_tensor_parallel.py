"""The model's partition annotations shard it over a mesh with no code change.

SmolLM2's 3 KV heads split over 3 (virtual CPU) devices; logits must match one device's.
Runs in a subprocess because the device count is fixed when JAX starts.
"""

from __future__ import annotations

import os
import subprocess
import sys

CHILD = r"""
import jax, jax.numpy as jnp, numpy as np
from flax import nnx
from jserve.layers.attention import DenseCausal
from jserve.loaders.model_source import load_model
from jserve.runtime.params import make_mesh, place_model

assert len(jax.devices()) == 3
loaded = load_model(None)
ids = jnp.asarray(loaded.tokenizer.encode("The capital of France is"), jnp.int32)
t = ids.shape[0]
logits = {}
for tp in (1, 3):
    graphdef, state = place_model(loaded.config, loaded.params, jnp.float32, make_mesh(tp))
    wqkv = state["layers"]["wqkv"][...]
    assert len(wqkv.sharding.device_set) == tp, wqkv.sharding

    @jax.jit
    def forward(state):
        model = nnx.merge(graphdef, state)
        pos = jnp.arange(t, dtype=jnp.int32)
        return model(ids, pos, None, DenseCausal(), jnp.array([t - 1]))[0]

    logits[tp] = np.asarray(forward(state))
print("MAXDIFF", float(np.abs(logits[1] - logits[3]).max()))
"""


def test_three_way_tensor_parallel_matches_one_device(default_model):
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=3"}
    out = subprocess.run(
        [sys.executable, "-c", CHILD], capture_output=True, text=True, env=env, timeout=600
    )
    assert out.returncode == 0, out.stderr[-3000:]
    diff = float(out.stdout.split("MAXDIFF")[1])
    assert diff < 1e-4
