"""`--tensor-parallel-size 3` through the whole serving path, on 3 virtual CPU devices.

Greedy tokens must equal one device's, token for token, on a tiny random model (biases, a
vocab-split lm_head) and on SmolLM2 (9 query / 3 KV heads), through chunked prefill, a
preemption and a prefix-cache hit, and with the Pallas interpret kernel inside the shard_map
too; nothing compiles while serving; each device holds a third of the KV pool. Runs in a
subprocess because the device count is fixed when JAX starts.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from jserve.models.config import ModelConfig
from jserve.runtime.params import check_tensor_parallel

CHILD = r"""
import json, jax
from jserve.engine.llm_engine import LLMEngine
from jserve.config.engine_args import EngineArgs
from jserve.loaders.model_source import load_model
from jserve.runtime.compilation import forbid_compilation
from tests.parallel.workload import ENGINE, run_workload, tiny_model

assert len(jax.devices()) == 3
smollm2 = load_model(None)
report = {}
tiny = tiny_model(smollm2)
runs = [("tiny", tiny, 1, "auto"), ("tiny", tiny, 3, "auto"), ("smollm2", smollm2, 1, "auto"),
        ("smollm2", smollm2, 3, "auto"), ("tiny-interpret", tiny, 3, "interpret")]
for name, loaded, tp, impl in runs:
    args = EngineArgs(**ENGINE, tensor_parallel_size=tp, attention_impl=impl)
    engine = LLMEngine(args, loaded=loaded)
    with forbid_compilation():
        result = run_workload(engine)
    k_pool = engine.runner.kv_cache[0]
    result["pool_bytes"] = k_pool.nbytes
    result["pool_devices"] = len(k_pool.sharding.device_set)
    result["shard_bytes"] = sorted({s.data.nbytes for s in k_pool.addressable_shards})
    report[f"{name}/{tp}"] = result
    del engine
print("REPORT" + json.dumps(report))
"""


@pytest.fixture(scope="module")
def report(default_model) -> dict:
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=3"}
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    out = subprocess.run(
        [sys.executable, "-c", CHILD], capture_output=True, text=True, env=env, timeout=900
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.split("REPORT")[1])


@pytest.mark.parametrize("model", ["tiny", "smollm2"])
def test_greedy_tokens_equal_one_device(report, model):
    one, three = report[f"{model}/1"], report[f"{model}/3"]
    assert three["tokens"] == one["tokens"]
    assert len(one["tokens"]) == 9 and all(len(t) == 12 for t in one["tokens"].values())
    # The workload did exercise what it is meant to, on both layouts alike.
    for run in (one, three):
        assert run["preemptions"] > 0 and run["prefix_cache_hits"] > 0, run
    assert three["preemptions"] == one["preemptions"]
    assert three["prefix_cache_hits"] == one["prefix_cache_hits"]


def test_a_pallas_kernel_runs_per_shard(report):
    """The interpret-mode Pallas kernel (a pallas_call XLA cannot partition) inside the
    shard_map, over 3 devices, gives the tokens of the XLA attention on one device."""
    three = report["tiny-interpret/3"]
    assert three["tokens"] == report["tiny/1"]["tokens"]
    assert three["serving_compilations"] == 0
    assert three["shard_bytes"] == [three["pool_bytes"] // 3]


@pytest.mark.parametrize("model", ["tiny", "smollm2"])
def test_nothing_compiles_while_serving(report, model):
    assert report[f"{model}/1"]["serving_compilations"] == 0
    assert report[f"{model}/3"]["serving_compilations"] == 0


@pytest.mark.parametrize("model", ["tiny", "smollm2"])
def test_each_device_holds_a_third_of_the_kv_pool(report, model):
    one, three = report[f"{model}/1"], report[f"{model}/3"]
    assert one["pool_devices"] == 1 and three["pool_devices"] == 3
    assert three["pool_bytes"] == one["pool_bytes"]
    assert three["shard_bytes"] == [one["pool_bytes"] // 3]


def _smollm2_shape(**overrides) -> ModelConfig:
    base = dict(
        architecture="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
        num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64, tie_word_embeddings=True,
    )  # fmt: skip
    return ModelConfig(**{**base, **overrides})


@pytest.mark.parametrize("size", [2, 4])
def test_head_counts_that_do_not_divide_are_refused_naming_them(size):
    with pytest.raises(ValueError) as e:
        check_tensor_parallel(_smollm2_shape(), size)
    message = str(e.value)
    assert f"tensor_parallel_size={size}" in message
    assert "9 query heads" in message and "3 KV heads" in message
    assert "[1, 3]" in message  # what would fit


def test_sizes_that_divide_are_accepted():
    check_tensor_parallel(_smollm2_shape(), 1)
    check_tensor_parallel(_smollm2_shape(), 3)
    with pytest.raises(ValueError, match="49153 vocabulary entries"):
        check_tensor_parallel(_smollm2_shape(vocab_size=49153, tie_word_embeddings=False), 3)
