"""Session-wide fixtures: the default model's files and the transformers oracle, loaded once."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# The suite runs on CPU: TPU and GPU code is compiled for them (jserve compile) or interpreted,
# never run, and the dev extra's compilers (libtpu, the CUDA plugin) must not claim a device.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Converted GGUF models are cached per test session, never in the user's cache.
os.environ.setdefault(
    "JSERVE_CACHE_DIR", str(Path(__file__).parent.parent / ".pytest-cache-jserve")
)


@pytest.fixture(scope="session")
def default_gguf() -> Path:
    """The default model's GGUF; a missing package is a failure that says how to install it."""
    from jserve.loaders.model_source import default_model_path

    return default_model_path()


@pytest.fixture(scope="session")
def hf_default_model(default_gguf):
    """transformers' float32 SmolLM2 from the same GGUF: the oracle nobody here wrote."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(
        default_gguf.parent, gguf_file=default_gguf.name, dtype=torch.float32
    )
    return model.eval()


@pytest.fixture(scope="session")
def default_model():
    """jserve's LoadedModel of the default model (through the conversion cache)."""
    from jserve.loaders.model_source import load_model

    return load_model(None)


@pytest.fixture(scope="session")
def default_placed(default_model):
    """(graphdef, state) of the default model in float32 on one device."""
    import jax.numpy as jnp

    from jserve.runtime.params import make_mesh, place_model

    return place_model(default_model.config, default_model.params, jnp.float32, make_mesh())
