"""ModelConfig: the architecture of a Llama-family decoder, from HF config.json or GGUF metadata."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jserve.layers.rope import RopeScaling

# HF `architectures` entries this model code computes exactly.
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
}
# GGUF `general.architecture` values with the same meaning.
SUPPORTED_GGUF_ARCHITECTURES = ("llama", "mistral", "qwen2")


@dataclass(frozen=True)
class ModelConfig:
    architecture: str  # "llama" | "mistral" | "qwen2"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    max_position_embeddings: int = 2048
    sliding_window: int | None = None

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers"):
            if getattr(self, name) <= 0:
                raise ValueError(f"ModelConfig.{name} must be positive, got {getattr(self, name)}")
        if self.num_heads <= 0 or self.num_kv_heads <= 0 or self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a positive multiple of num_kv_heads "
                f"({self.num_kv_heads})"
            )
        if self.head_dim <= 0 or self.head_dim % 2:
            raise ValueError(f"head_dim must be positive and even for RoPE, got {self.head_dim}")

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any], source: str = "config.json") -> ModelConfig:
        """Build from a parsed HF config.json; `source` names the file in error messages."""
        archs = cfg.get("architectures") or []
        arch = next(
            (SUPPORTED_ARCHITECTURES[a] for a in archs if a in SUPPORTED_ARCHITECTURES), None
        )
        if arch is None:
            raise ValueError(
                f"{source}: unsupported architecture {archs or cfg.get('model_type')!r}; "
                f"jserve supports {sorted(SUPPORTED_ARCHITECTURES)}"
            )
        num_heads = cfg["num_attention_heads"]
        hidden = cfg["hidden_size"]
        rope_theta, scaling = _hf_rope(cfg, source)
        window = (
            cfg.get("sliding_window") if cfg.get("use_sliding_window", arch == "mistral") else None
        )
        return cls(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=hidden,
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=cfg.get("head_dim") or hidden // num_heads,
            rope_theta=rope_theta,
            rope_scaling=scaling,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", arch == "qwen2")),
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            sliding_window=window,
        )

    @classmethod
    def from_json_file(cls, path: str | Path) -> ModelConfig:
        path = Path(path)
        try:
            cfg = json.loads(path.read_text())
        except FileNotFoundError:
            raise FileNotFoundError(f"{path}: no config.json; is this a model directory?") from None
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not valid JSON ({e})") from None
        return cls.from_hf_dict(cfg, source=str(path))

    def to_hf_dict(self) -> dict[str, Any]:
        """The HF config.json equivalent, so a converted cache directory is self-describing."""
        arch_name = {v: k for k, v in SUPPORTED_ARCHITECTURES.items()}[self.architecture]
        d: dict[str, Any] = {
            "architectures": [arch_name],
            "model_type": self.architecture,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "rope_theta": self.rope_theta,
            "rms_norm_eps": self.rms_norm_eps,
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": self.attention_bias,
            "max_position_embeddings": self.max_position_embeddings,
            "sliding_window": self.sliding_window,
            "use_sliding_window": self.sliding_window is not None,
        }
        if self.rope_scaling is not None:
            d["rope_scaling"] = {"rope_type": "llama3", **dataclasses.asdict(self.rope_scaling)}
        return d


def _hf_rope(cfg: dict[str, Any], source: str) -> tuple[float, RopeScaling | None]:
    # transformers 5 nests theta and scaling under `rope_parameters`; 4.x keeps them top-level.
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        return theta, None
    if rope_type != "llama3":
        raise ValueError(f"{source}: unsupported rope_type {rope_type!r}; jserve supports llama3")
    return theta, RopeScaling(
        factor=float(params["factor"]),
        low_freq_factor=float(params["low_freq_factor"]),
        high_freq_factor=float(params["high_freq_factor"]),
        original_max_position_embeddings=int(params["original_max_position_embeddings"]),
    )
