"""Verifying draft tokens, and the counts operators read (vLLM's spec_decode metrics).

A decode with drafts d_1..d_k is computed as k+1 query tokens, and the sampler picks the
target's token t_0..t_k at each of its k+1 rows, each row with the drafts before it in its
history (penalties, min_tokens) and the random draw decoding one token at a time would use at
that position (a row's draws depend only on its seed and its output's length). While
t_{j-1} == d_j the drafts are the tokens the target produces; the sequence keeps d_1..d_m
(m accepted) and t_m, the target's own next token. So every token is the target's:

- greedy rows give token for token the output without speculation;
- sampled rows keep the target distribution exactly. For a deterministic draft (a point mass
  on d) the standard rule accepts d with probability p(d) and otherwise samples from p with d
  removed, renormalized; drawing t ~ p and accepting when t == d does exactly that (accept
  with probability p(d); on rejection t is distributed as p given t != d). With a seed the
  output is token for token the one without speculation too.

Constrained rows do not speculate: a draft's row would need the grammar's mask after the
drafts before it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from jserve.sampling_params import SamplingParams


def may_speculate(params: SamplingParams) -> bool:
    """Whether a request's drafts can be verified exactly here: it has no output constraint."""
    return params.structured_outputs is None


def num_accepted(drafts: Sequence[int], targets: Sequence[int]) -> int:
    """How many leading drafts equal the target's tokens (`targets` has one more row)."""
    accepted = 0
    for draft, target in zip(drafts, targets, strict=False):
        if draft != target:
            break
        accepted += 1
    return accepted


@dataclass
class SpecDecodeCounters:
    """Cumulative counts since start (vLLM's names): verify steps of a sequence (drafts),
    draft tokens proposed, accepted, and accepted at each draft position."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)

    def record(self, num_draft_tokens: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        per_pos = self.num_accepted_tokens_per_pos
        if len(per_pos) < num_draft_tokens:
            per_pos.extend([0] * (num_draft_tokens - len(per_pos)))
        for position in range(num_accepted):
            per_pos[position] += 1
