"""Load an HF model directory: config.json plus one safetensors file or a sharded index."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from safetensors import safe_open

from jserve.loaders.hf_params import Params, params_from_hf
from jserve.models.config import ModelConfig

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"


def _tensor_files(path: Path) -> dict[str, Path]:
    """Map each tensor name to the file that holds it."""
    index = path / INDEX_NAME
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise ValueError(f"{index}: not a safetensors index ({e})") from None
        return {name: path / fname for name, fname in weight_map.items()}
    single = path / SINGLE_NAME
    files = [single] if single.is_file() else sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{path}: no {SINGLE_NAME}, {INDEX_NAME} or *.safetensors file")
    mapping = {}
    for f in files:
        with safe_open(f, framework="numpy") as handle:
            mapping |= {name: f for name in handle.keys()}  # noqa: SIM118 (not a dict)
    return mapping


def load_safetensors_dir(path: str | Path) -> tuple[ModelConfig, Params]:
    path = Path(path)
    cfg = ModelConfig.from_json_file(path / "config.json")
    files = _tensor_files(path)
    handles: dict[Path, object] = {}

    def get(name: str) -> np.ndarray:
        f = files[name]  # KeyError -> "missing" in params_from_hf
        if f not in handles:
            if not f.is_file():
                raise ValueError(f"{f}: listed in {INDEX_NAME} but missing")
            handles[f] = safe_open(f, framework="numpy")
        return handles[f].get_tensor(name)

    params = params_from_hf(cfg, get, str(path))
    # Some exports write a tied head anyway; it must equal the embedding to be dropped.
    tied_head = cfg.tie_word_embeddings and "lm_head.weight" in files
    if tied_head and not np.array_equal(get("lm_head.weight"), params["embed"]):
        raise ValueError(f"{path}: tie_word_embeddings is set but lm_head.weight differs")
    return cfg, params
