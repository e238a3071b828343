"""Session-wide fixtures: the default model's files, the transformers oracle and the engine
every engine test shares (tests/shared_engine.py), each built once a run."""

from __future__ import annotations

import gc
import json
import os
from pathlib import Path

import pytest

# The suite runs on CPU: TPU and GPU code is compiled for them (jserve compile) or interpreted,
# never run, and the dev extra's compilers (libtpu, the CUDA plugin) must not claim a device.
os.environ.setdefault("JAX_PLATFORMS", "cpu")

from tests.budgets import load_profile

# Converted GGUF models are cached per test session, never in the user's cache.
os.environ.setdefault(
    "JSERVE_CACHE_DIR", str(Path(__file__).parent.parent / ".pytest-cache-jserve")
)
load_profile()  # hypothesis budgets: JSERVE_HYPOTHESIS_PROFILE=ci (default) or thorough

# The files that cost the most CPU from a cold cache (a per-test profile), heaviest first.
# pytest-xdist hands files to the workers in collection order (`--dist loadfile
# --no-loadscope-reorder` in pyproject.toml), so these start first and no worker is left
# running one of them alone at the end. The 3-device process (three_devices) starts with the
# first file, and test_multiprocess.py, which reads it too, is third: the first worker's next.
HEAVY_FIRST = (
    "tests/parallel/test_tensor_parallel_serving.py",
    "tests/pallas/test_ragged_attention.py",
    "tests/parallel/test_multiprocess.py",
    "tests/pallas/test_layer_matmul.py",
    "tests/bench/test_offline_buckets_smoke.py",
    "tests/bench/test_decode_step.py",
    "tests/engine/test_engine_features.py",
    "tests/engine/test_structured.py",
    "tests/server/test_fuzz_real_model.py",
    "tests/bench/test_peer_smoke.py",
    "tests/bench/test_roofline.py",
    "tests/bench/test_bench_smoke.py",
    "tests/server/test_real_model_server.py",
    "tests/models/test_real_model.py",
    "tests/aot/test_compile.py",
    "tests/cli/test_generate_cli.py",
    "tests/pallas/test_native_build.py",
    "tests/engine/test_engine_greedy.py",
    "tests/runtime/test_sampler.py",
    "tests/pallas/test_dispatch.py",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The HEAVY_FIRST files' cases first, in its order; the others after, as collected."""
    rank = {path: i for i, path in enumerate(HEAVY_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))


@pytest.fixture(scope="session")
def default_gguf() -> Path:
    """The default model's GGUF; a missing package is a failure that says how to install it."""
    from jserve.loaders.model_source import default_model_path

    return default_model_path()


@pytest.fixture(scope="session")
def hf_default_model(default_gguf, tmp_path_factory, worker_id):
    """transformers' float32 SmolLM2 from the same GGUF: the oracle nobody here wrote.

    Reading the GGUF dequantizes every tensor, which costs far more than building the model
    from its float32 weights: the first worker to ask reads it and leaves the weights and
    configs in the run's shared directory (tests/run_lock.py), and the others build the same
    model from them, bit for bit."""
    import torch
    import transformers
    from safetensors import torch as safetensors_torch

    from tests.run_lock import run_lock

    # One thread: the oracle's matrices are small, and OpenMP workers spinning on cores that
    # JAX's threads (or other processes) also want cost many times the CPU of the work itself.
    torch.set_num_threads(1)
    with run_lock(tmp_path_factory, worker_id, "hf_default_model") as shared:
        weights, configs = shared / "hf_default_model.safetensors", shared / "hf_default_model.json"
        if not weights.exists():
            gc.disable()  # reading the GGUF makes millions of objects: no full collections
            try:
                model = transformers.AutoModelForCausalLM.from_pretrained(
                    default_gguf.parent, gguf_file=default_gguf.name, dtype=torch.float32
                )
            finally:
                gc.enable()
            config = model.config.to_dict()
            config.pop("quantization_config")  # the GGUF's: these weights are float32
            generation = model.generation_config.to_dict()
            configs.write_text(json.dumps({"config": config, "generation": generation}))
            safetensors_torch.save_model(model, str(weights))
            return model.eval()
    saved = json.loads(configs.read_text())
    config = transformers.AutoConfig.for_model(**saved["config"])
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    safetensors_torch.load_model(model, str(weights))
    model.generation_config = transformers.GenerationConfig.from_dict(saved["generation"])
    return model.eval()


@pytest.fixture(scope="session")
def default_model(tmp_path_factory, worker_id):
    """jserve's LoadedModel of the default model (through the conversion cache). The workers
    load it in turn (tests/run_lock.py): the first converts the GGUF into the cache, the
    others read its checkpoint instead of converting it too at the same time."""
    from jserve.loaders.model_source import load_model
    from tests.run_lock import run_lock

    with run_lock(tmp_path_factory, worker_id, "default_model"):
        return load_model(None)


@pytest.fixture(scope="session")
def default_placed(default_model):
    """(graphdef, state) of the default model in float32 on one device."""
    import jax.numpy as jnp

    from jserve.runtime.params import make_mesh, place_model

    return place_model(default_model.config, default_model.params, jnp.float32, make_mesh())


@pytest.fixture(scope="session")
def shared_engine(default_model, tmp_path_factory, worker_id):
    """The run's engine on the real model (tests/shared_engine.py's sizes); tests take it
    through `engine`, which resets and checks it. The workers build theirs in turn
    (tests/run_lock.py): the first compiles its steps into the persistent compilation cache,
    the others load them from it instead of compiling them too at the same time."""
    from tests.run_lock import run_lock
    from tests.shared_engine import assert_no_blocks_held, make_engine

    with run_lock(tmp_path_factory, worker_id, "shared_engine"):
        engine = make_engine(default_model)
    yield engine
    assert_no_blocks_held(engine)


@pytest.fixture
def engine(shared_engine, monkeypatch):
    """The shared engine as a fresh one (LLMEngine.reset: empty prefix cache, zeroed counters)
    for one test, which must leave it idle and unchanged: settings restored, observers
    removed, nothing patched (this test's monkeypatches are undone first), the KV pool live."""
    from tests.shared_engine import EngineState, abort_all, assert_left_as_found

    shared_engine.reset()
    before = EngineState.of(shared_engine)
    yield shared_engine
    monkeypatch.undo()
    try:
        assert_left_as_found(shared_engine, before)
    finally:  # a failed test's requests must not fail the next test too
        abort_all(shared_engine)
