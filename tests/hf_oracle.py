"""transformers as the oracle: greedy continuations computed by an implementation nobody here
wrote."""

from __future__ import annotations

import torch


def hf_greedy(model, prompt_ids: list[int], num_tokens: int) -> list[int]:
    """Exactly `num_tokens` greedy tokens after `prompt_ids` (no stop token ends it early)."""
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt_ids]),
            attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
            do_sample=False,
            max_new_tokens=num_tokens,
            eos_token_id=None,
            pad_token_id=0,
        )
    return out[0, len(prompt_ids) :].tolist()
