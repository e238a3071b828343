"""Default sampling parameters from a model's `generation_config.json`, as vLLM's
`--generation-config` reads them: the fields a request leaves out take these values.

Only sampling fields are read (temperature, top_p, top_k, min_p, repetition_penalty), under
SamplingParams' names; vLLM also reads max_new_tokens, which jserve leaves to the request (a
default max_tokens would have to be capped by each prompt's room in the context).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# generation_config.json's keys that are sampling defaults (the same names in SamplingParams).
SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def sampling_defaults(source: str, model: str | None) -> dict[str, Any]:
    """The defaults `--generation-config source` gives for `model` (a --model value):

    - "vllm": none (SamplingParams' own defaults);
    - "auto": those of generation_config.json in the model's directory, if it is a directory
      holding one (a .gguf file, or the default model, has none);
    - a folder: those of its generation_config.json, which must exist.

    Raises:
        FileNotFoundError: a folder without generation_config.json.
        ValueError: a file that is not a JSON object.
    """
    if source == "vllm":
        return {}
    if source == "auto":
        if model is None or not (Path(model) / "generation_config.json").is_file():
            return {}
        path = Path(model) / "generation_config.json"
    else:
        path = Path(source) / "generation_config.json"
        if not path.is_file():
            raise FileNotFoundError(
                f"--generation-config {source!r}: no generation_config.json there; give auto, "
                "vllm or a folder holding one"
            )
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except ValueError as err:
        raise ValueError(f"{path}: not valid JSON: {err}") from err
    if not isinstance(config, dict):
        raise ValueError(f"{path}: expected a JSON object")
    return {key: config[key] for key in SAMPLING_KEYS if config.get(key) is not None}
