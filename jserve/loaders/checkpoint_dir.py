"""jserve's own checkpoint directory: config.json, tokenizer files and orbax parameters.

`jserve convert` writes it and the default model's cache is one, because restoring orbax
arrays skips the reading and dequantizing a GGUF file costs.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import orbax.checkpoint as ocp

from jserve.loaders.hf_params import Params
from jserve.models.config import ModelConfig

PARAMS_SUBDIR = "params"


def is_checkpoint_dir(path: Path) -> bool:
    return (path / PARAMS_SUBDIR).is_dir() and (path / "config.json").is_file()


def save_checkpoint(dst: str | Path, cfg: ModelConfig, params: Params, tokenizer: Any) -> Path:
    """Write config.json, the tokenizer's files and the parameters under `dst` (made absolute)."""
    dst = Path(dst).expanduser().resolve()  # orbax refuses relative paths
    dst.mkdir(parents=True, exist_ok=True)
    (dst / "config.json").write_text(json.dumps(cfg.to_hf_dict(), indent=2))
    tokenizer.save(dst)
    with ocp.StandardCheckpointer() as ckpt:
        ckpt.save(dst / PARAMS_SUBDIR, params, force=True)
    return dst


def restore_params(path: str | Path, target: Any = None) -> Params:
    """Restore the parameter tree; `target` (ShapeDtypeStructs with shardings) places it."""
    path = Path(path).expanduser().resolve() / PARAMS_SUBDIR
    if not path.is_dir():
        raise FileNotFoundError(f"{path}: no orbax parameters; write them with `jserve convert`")
    with ocp.StandardCheckpointer() as ckpt:
        return ckpt.restore(path, target)
