"""transformers as the oracle: greedy continuations made, or checked, by an implementation
nobody here wrote."""

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


def hf_greedy_choices(model, prompt_ids: list[int], continuation: list[int]) -> list[int]:
    """transformers' greedy (argmax) token after the prompt and after each prefix of
    `continuation`, from one forward pass over both.

    The result equals `continuation` exactly when `continuation` is transformers' greedy
    continuation of the prompt: each token is its choice given the tokens before it, which by
    the same argument are its choices too. One pass instead of one generate step a token.
    """
    ids = list(prompt_ids) + list(continuation)
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, len(prompt_ids) - 1 : len(ids) - 1]
    return logits.argmax(-1).tolist()
