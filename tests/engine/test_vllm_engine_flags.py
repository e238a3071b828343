"""The engine settings of vLLM's flags (jserve.engine.setup): the KV pool's size from
--gpu-memory-utilization (`pool_blocks`: what the weights leave of that fraction of device
memory, or on CPU that fraction of --kv-cache-memory; --num-kv-blocks overrides both), and
--chat-template replacing the model's. Nothing is compiled."""

from __future__ import annotations

import pytest

from jserve.config.engine_args import EngineArgs
from jserve.engine.setup import StepShapes, build_engine_parts, pool_blocks
from tests.shared_engine import SHARED

BLOCK = 1000  # bytes of one KV block across layers
SHAPES = StepShapes("float32", "xla", 256, BLOCK, 7, (8,), (1,))  # 7: kv_cache_memory's worth


@pytest.mark.parametrize(
    ("args", "weights", "device_bytes", "blocks"),
    [
        (EngineArgs(), 5_000, 100_000, 7),  # not set: kv_cache_memory sized it
        (EngineArgs(gpu_memory_utilization=0.5), 20_000, 100_000, 30),  # (50,000 - 20,000) / 1000
        (EngineArgs(gpu_memory_utilization=0.9), 20_000, 100_000, 70),
        (EngineArgs(gpu_memory_utilization=0.5, kv_cache_memory=10_500), 20_000, None, 5),  # CPU
        (EngineArgs(gpu_memory_utilization=0.5, num_kv_blocks=3), 20_000, 100_000, 7),
    ],
)
def test_pool_blocks(args, weights, device_bytes, blocks):
    assert pool_blocks(args, SHAPES, weights, device_bytes) == blocks


def test_a_fraction_the_weights_fill_is_refused_saying_what_to_change():
    with pytest.raises(ValueError, match=r"leaves 0 bytes for the KV pool \(weights take 60000\)"):
        pool_blocks(EngineArgs(gpu_memory_utilization=0.5), SHAPES, 60_000, 100_000)


def test_chat_template_replaces_the_models_own_and_leaves_the_loaded_model_alone(default_model):
    template = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    args = EngineArgs(**{**SHARED, "chat_template": template})
    parts = build_engine_parts(args, loaded=default_model)
    hi = [{"role": "user", "content": "hi"}]
    assert parts.tokenizer.apply_chat_template(hi, add_generation_prompt=False) == "[user] hi\n"
    assert default_model.tokenizer.chat_template != template  # shared: not changed in place
