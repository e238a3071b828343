"""Tensor parallelism over 3 virtual CPU devices, from the model's partition annotations to
`--tensor-parallel-size 3` through the whole serving path.

SmolLM2's logits on 3 devices must match one device's. Greedy tokens must equal one device's,
token for token, on a tiny random model (biases, a vocab-split lm_head) and on SmolLM2 (9 query
/ 3 KV heads), through chunked prefill, a preemption and a prefix-cache hit, and with the
Pallas interpret kernel inside the shard_map too; nothing compiles while serving; each device
holds a third of the KV pool. All of it runs in the run's one 3-device process
(`three_devices`, tests/parallel/conftest.py): the device count is fixed when JAX starts.

SmolLM2's serving cases are `slow`: they start a second 3-device process for two engines of
the real model (`three_devices_smollm2`). By default the tiny model's cases cover the same
sharded serving path (its 3 KV heads split over 3 devices as SmolLM2's do), and
test_three_way_tensor_parallel_matches_one_device SmolLM2's own sharding.
"""

from __future__ import annotations

import pytest

from jserve.models.config import ModelConfig
from jserve.runtime.params import check_tensor_parallel

# Each serving check on the tiny model by default, and on SmolLM2 under `slow` (the module
# docstring says what covers it by default).
MODELS = ["tiny", pytest.param("smollm2", marks=pytest.mark.slow)]


@pytest.fixture
def runs(request: pytest.FixtureRequest, model: str) -> dict:
    """The report that holds `model`'s serving runs."""
    return request.getfixturevalue("three_devices" if model == "tiny" else "three_devices_smollm2")


def test_three_way_tensor_parallel_matches_one_device(three_devices):
    """The model's partition annotations shard it over a mesh with no code change: SmolLM2's 3
    KV heads split over 3 devices, and the logits match one device's."""
    assert three_devices["logits_maxdiff"] < 1e-4


@pytest.mark.parametrize("model", MODELS)
def test_greedy_tokens_equal_one_device(runs, model):
    """3 devices' greedy tokens are 1 device's. SmolLM2's case is slow: the tiny model's case
    covers the same sharded serving path by default."""
    one, three = runs[f"{model}/1"], runs[f"{model}/3"]
    assert three["tokens"] == one["tokens"]
    assert len(one["tokens"]) == 9 and all(len(t) == 12 for t in one["tokens"].values())
    # The workload did exercise what it is meant to, on both layouts alike.
    for run in (one, three):
        assert run["preemptions"] > 0 and run["prefix_cache_hits"] > 0, run
    assert three["preemptions"] == one["preemptions"]
    assert three["prefix_cache_hits"] == one["prefix_cache_hits"]


def test_a_pallas_kernel_runs_per_shard(three_devices):
    """The interpret-mode Pallas kernel (a pallas_call XLA cannot partition) inside the
    shard_map, over 3 devices, gives the tokens of the XLA attention on one device."""
    three = three_devices["tiny-interpret/3"]
    assert three["tokens"] == three_devices["tiny/1"]["tokens"]
    assert three["serving_compilations"] == 0
    assert three["shard_bytes"] == [three["pool_bytes"] // 3]


def test_an_int8_pool_and_its_scales_split_over_three_devices(three_devices):
    """--kv-cache-dtype int8 over 3 devices: the pools and their scales split on the KV-head
    axis, the int8 pool's tokens those of one device's int8 pool, nothing compiled."""
    one, three = three_devices["tiny-int8/1"], three_devices["tiny-int8/3"]
    assert one["cache_devices"] == [1] * 4 and three["cache_devices"] == [3] * 4
    assert three["tokens"] == one["tokens"]
    assert three["serving_compilations"] == one["serving_compilations"] == 0
    assert three["shard_bytes"] == [one["pool_bytes"] // 3]


@pytest.mark.parametrize("model", MODELS)
def test_nothing_compiles_while_serving(runs, model):
    """SmolLM2's case is slow: the tiny model's case covers it by default."""
    assert runs[f"{model}/1"]["serving_compilations"] == 0
    assert runs[f"{model}/3"]["serving_compilations"] == 0


@pytest.mark.parametrize("model", MODELS)
def test_each_device_holds_a_third_of_the_kv_pool(runs, model):
    """SmolLM2's case is slow: the tiny model's case (3 KV heads, as SmolLM2's) covers it by
    default."""
    one, three = runs[f"{model}/1"], runs[f"{model}/3"]
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
