"""Speculative decoding's settings, spelled as vLLM's `--speculative-config` JSON.

`{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4,
"prompt_lookup_min": 1}`: propose up to `num_speculative_tokens` tokens per decoding sequence
by prompt lookup (jserve.core.ngram) or, with `"method": "suffix"`, from the sequence's own
tokens and its tenant's recent outputs (jserve.core.suffix), and verify them in the same step
(docs/speculative.md). Keys a method does not read are accepted and unused, as in vLLM.
The text is parsed once, when the scheduler's config is built; an unknown key, method or a
value out of range is an InvalidSetting naming it, so the engine refuses to start.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from jserve.config.settings import Bounds, InvalidSetting, check_settings, documented, setting
from jserve.config.validation import show

# A verify step's rows of logits count against the sequence bucket (max_num_seqs), so a
# sequence's drafts are kept well under any bucket.
MAX_SPECULATIVE_TOKENS = 16
MAX_LOOKUP = 64  # n-grams longer than this never pay for their search
MAX_CACHED_REQUESTS = 100_000  # suffix: finished outputs kept for later drafts, at most


class SpeculativeMethod(StrEnum):
    """How draft tokens are proposed."""

    NGRAM = "ngram"  # prompt lookup: the continuation of the last n-gram's earlier occurrence
    # The most frequent continuation of the longest match in the sequence and its tenant's
    # recent outputs, as long as the match and its frequency warrant.
    SUFFIX = "suffix"


@documented
@dataclass(frozen=True)
class SpeculativeConfig:
    """One engine's speculative decoding (parsed from `--speculative-config`)."""

    method: SpeculativeMethod = setting(
        SpeculativeMethod.NGRAM, "how drafts are proposed", choices=SpeculativeMethod
    )
    num_speculative_tokens: int = setting(
        4,
        "draft tokens proposed and verified per decoding sequence and step",
        bounds=Bounds(1, MAX_SPECULATIVE_TOKENS),
    )
    prompt_lookup_max: int = setting(
        4, "longest n-gram looked up in the sequence's tokens", bounds=Bounds(1, MAX_LOOKUP)
    )
    prompt_lookup_min: int = setting(
        1, "shortest n-gram looked up in the sequence's tokens", bounds=Bounds(1, MAX_LOOKUP)
    )

    suffix_decoding_max_tree_depth: int = setting(
        24,
        "suffix: longest match (tokens) looked up at the end of a sequence",
        bounds=Bounds(1, MAX_LOOKUP),
    )
    suffix_decoding_max_cached_requests: int = setting(
        10_000,
        "suffix: finished outputs kept (oldest dropped first) to draft from for their tenant's "
        "later requests; 0 drafts from each sequence's own tokens only",
        bounds=Bounds(0, MAX_CACHED_REQUESTS),
    )
    suffix_decoding_max_spec_factor: float = setting(
        1.0,
        "suffix: drafts per matched token: a match of m tokens proposes at most factor * m drafts",
        bounds=Bounds(0, 16, lo_open=True),
    )
    suffix_decoding_min_token_prob: float = setting(
        0.1,
        "suffix: a draft is proposed only while the frequency of its continuation among the "
        "match's occurrences (times the drafts' before it) stays at least this",
        bounds=Bounds(0, 1),
    )
    disable_by_batch_size: int | None = setting(
        None,
        "no drafts in a step while at least this many sequences run (none: the measured step "
        "costs decide, see docs/speculative.md)",
        bounds=Bounds(1, None),
        default_text="none",
    )

    def __post_init__(self) -> None:
        check_settings(self)
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise InvalidSetting(
                "prompt_lookup_min",
                f"prompt_lookup_min ({self.prompt_lookup_min}) must be <= "
                f"prompt_lookup_max ({self.prompt_lookup_max})",
            )


_KEYS = tuple(f.name for f in dataclasses.fields(SpeculativeConfig))


def parse_speculative_config(text: str | None) -> SpeculativeConfig | None:
    """The config a `--speculative-config` JSON object means (None: no speculation), or
    InvalidSetting naming the key (`speculative_config.KEY`) or the text that is wrong."""
    if text is None:
        return None
    try:
        value: Any = json.loads(text)
    except ValueError as e:
        raise InvalidSetting(
            "speculative_config", f"speculative_config must be a JSON object, got {show(text)}: {e}"
        ) from None
    if not isinstance(value, dict):
        raise InvalidSetting(
            "speculative_config", f"speculative_config must be a JSON object, got {show(value)}"
        )
    for key in value:
        if key not in _KEYS:
            raise InvalidSetting(
                f"speculative_config.{str(key)[:64]}",
                f"speculative_config: unknown key {show(key)}; known: {', '.join(_KEYS)}",
            )
    if "method" not in value:
        raise InvalidSetting(
            "speculative_config.method",
            f"speculative_config needs a method, one of {', '.join(SpeculativeMethod)}",
        )
    try:
        return SpeculativeConfig(**value)
    except InvalidSetting as e:
        raise InvalidSetting(f"speculative_config.{e.name}", f"speculative_config: {e}") from None
