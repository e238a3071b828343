"""The one process of a test run with 3 virtual CPU devices (the device count is fixed when JAX
starts, so it runs as `python -m tests.parallel.three_device_child` under
XLA_FLAGS=--xla_force_host_platform_device_count=3; tests/parallel/conftest.py starts it).

It prints one JSON report after "REPORT":
- "logits_maxdiff": the largest difference between SmolLM2's logits placed on 1 and on 3
  devices (the model's partition annotations alone shard it);
- per serving run "MODEL/TP" (tests/parallel/workload.py's workload on an engine): greedy
  tokens, preemptions, prefix-cache hits, compiles while serving, and the KV pool's bytes and
  devices (the devices of each of the KV cache's arrays: an int8 pool's scales too).

With the argument `smollm2` it serves SmolLM2 on 1 and 3 devices instead (`smollm2/1`,
`smollm2/3`): two engines of the real model, whose step shapes nothing else in the run
compiles, so the tests that read them are `slow` and start this second process.
"""

from __future__ import annotations

import json
import sys

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jserve.config.engine_args import EngineArgs
from jserve.engine.llm_engine import LLMEngine
from jserve.layers.attention import DenseCausal
from jserve.loaders.model_source import LoadedModel, load_model
from jserve.runtime.compilation import forbid_compilation
from jserve.runtime.params import make_mesh, place_model
from tests.parallel.workload import ENGINE, run_workload, tiny_model


def last_logits(graphdef: nnx.GraphDef, state: nnx.State, ids: jax.Array) -> np.ndarray:
    """The model's logits of the last of `ids` (one sequence, dense causal attention)."""
    t = ids.shape[0]

    def forward(state: nnx.State) -> jax.Array:
        model = nnx.merge(graphdef, state)
        pos = jnp.arange(t, dtype=jnp.int32)
        return model(ids, pos, None, DenseCausal(), jnp.array([t - 1]))[0]

    return np.asarray(jax.jit(forward)(state))


def logits_maxdiff(loaded: LoadedModel) -> float:
    """Max |logits on 1 device - logits on 3| of one prompt's last token."""
    ids = jnp.asarray(loaded.tokenizer.encode("The capital of France is"), jnp.int32)
    logits = []
    for tp in (1, 3):
        graphdef, state = place_model(loaded.config, loaded.params, jnp.float32, make_mesh(tp))
        wqkv = state["layers"]["wqkv"][...]
        assert len(wqkv.sharding.device_set) == tp, wqkv.sharding
        logits.append(last_logits(graphdef, state, ids))
    return float(np.abs(logits[0] - logits[1]).max())


def serve(loaded: LoadedModel, tp: int, impl: str, kv_cache_dtype: str = "auto") -> dict:
    """The workload on an engine over `tp` devices, and where its KV pool lives."""
    args = EngineArgs(
        **ENGINE, tensor_parallel_size=tp, attention_impl=impl, kv_cache_dtype=kv_cache_dtype
    )
    engine = LLMEngine(args, loaded=loaded)
    with forbid_compilation():
        result = run_workload(engine)
    k_pool = engine.runner.kv_cache[0]
    result["pool_bytes"] = k_pool.nbytes
    result["pool_devices"] = len(k_pool.sharding.device_set)
    result["shard_bytes"] = sorted({s.data.nbytes for s in k_pool.addressable_shards})
    result["cache_devices"] = [len(x.sharding.device_set) for x in engine.runner.kv_cache]
    return result


def tiny_report(smollm2: LoadedModel) -> dict:
    """The sharded logits check and every serving run on the tiny model."""
    tiny = tiny_model(smollm2)
    report: dict = {"logits_maxdiff": logits_maxdiff(smollm2)}
    runs = [("tiny", 1, "auto"), ("tiny", 3, "auto"), ("tiny-interpret", 3, "interpret")]
    for name, tp, impl in runs:
        report[f"{name}/{tp}"] = serve(tiny, tp, impl)
    for tp in (1, 3):  # an int8 pool and its scales, split on their KV-head axis
        report[f"tiny-int8/{tp}"] = serve(tiny, tp, "auto", kv_cache_dtype="int8")
    return report


def main(argv: list[str]) -> None:
    assert len(jax.devices()) == 3
    smollm2 = load_model(None)
    if argv == ["smollm2"]:
        report = {f"smollm2/{tp}": serve(smollm2, tp, "auto") for tp in (1, 3)}
    else:
        assert not argv, f"unknown arguments {argv}: none, or `smollm2`"
        report = tiny_report(smollm2)
    print("REPORT" + json.dumps(report))


if __name__ == "__main__":
    main(sys.argv[1:])
