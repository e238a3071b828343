"""Which drafts a step verifies: the proposer interface, its methods, and when drafts pay.

A proposer (`DraftProposer`) guesses up to k tokens that continue a sequence, on the host, in
microseconds: `ngram` (jserve.core.ngram) or `suffix` (jserve.core.suffix); a draft-model
method would join behind the same two calls. The scheduler owns one for its life, so a
proposer may remember what finished requests produced (`on_finish`).

Drafts cost the verify step their extra query rows whether they are accepted or not, so the
planner takes a sequence's drafts only while they pay (`num_drafts_that_pay`): where the step
is bound by reading weights (a GPU at low batch) a few more rows cost next to nothing and any
accepted draft is a gain; where a step's cost grows with its padded tokens (a CPU, or any chip
at high batch) drafts must be accepted often enough to pay for the bucket they push the step
into. The rule reads the step costs the scheduler measures per bucket
(jserve.core.step_costs), so it follows the machine and its load rather than a fixed
threshold.
"""

from __future__ import annotations

from typing import Protocol

from jserve.config.speculative import SpeculativeConfig, SpeculativeMethod
from jserve.core.ngram import Draft, propose_ngram
from jserve.core.request import Request
from jserve.core.step_costs import StepCosts
from jserve.core.suffix import SuffixProposer

# Served steps after which a bucket's cost is tried again: load and first runs move a cost,
# and a bucket priced too high would otherwise never be served, so never corrected.
RETRY_AFTER = 256


class DraftProposer(Protocol):
    """Guesses a sequence's next tokens; the planner verifies them in the next step."""

    def propose(self, request: Request, k: int) -> Draft:
        """Up to `k` draft tokens continuing `request`'s tokens (int64; none: empty), and how
        many of its last tokens their source matched."""
        ...

    def on_finish(self, request: Request) -> None:
        """`request` finished with its output: a proposer may draft later requests from it."""
        ...


class NgramProposer:
    """vLLM's `ngram` (prompt lookup) over the sequence's own prompt and output."""

    def __init__(self, spec: SpeculativeConfig) -> None:
        self.min_n = spec.prompt_lookup_min
        self.max_n = spec.prompt_lookup_max

    def propose(self, request: Request, k: int) -> Draft:
        return propose_ngram(request.all_token_ids, k, self.min_n, self.max_n)

    def on_finish(self, request: Request) -> None:
        """Prompt lookup keeps nothing across requests."""


def make_proposer(spec: SpeculativeConfig) -> DraftProposer:
    """The proposer of `spec.method`."""
    if spec.method is SpeculativeMethod.SUFFIX:
        return SuffixProposer.from_config(spec)
    return NgramProposer(spec)


def num_drafts_that_pay(
    costs: StepCosts | None,
    num_tokens: int,
    num_rows: int,
    acceptance: float,
    max_drafts: int,
) -> int:
    """How many of a sequence's `max_drafts` proposed drafts the step should verify: the d in
    0..max_drafts that maximizes the step's expected tokens per second,

        (num_tokens + a + a^2 + ... + a^d) / (cost(num_tokens + d, num_rows + d) + between steps),

    for a step already holding `num_tokens` tokens and `num_rows` rows of logits, and a
    sequence whose drafts are accepted, each given the ones before it, at the rate
    a = `acceptance` (jserve.core.ngram.note_acceptance): draft j yields a token only if
    drafts 1..j are all accepted, with chance a^j; the step's other tokens yield one each.
    Costs are the scheduler's measured ones, priced optimistically (`StepCosts.optimistic`):
    a bucket not served within the last RETRY_AFTER steps is taken to cost what the step
    costs without the drafts, so it is tried again and then priced by what it measured.
    Without measured costs (no table, or the step's own bucket not served lately) every
    draft is taken."""
    if costs is None or max_drafts <= 0:
        return max(0, max_drafts)
    base = costs.optimistic(num_tokens, num_rows, RETRY_AFTER)
    if base is None:
        return max_drafts
    between = costs.between_steps
    best, best_rate = 0, num_tokens / (base + between)
    expected = float(num_tokens)
    for d in range(1, max_drafts + 1):
        expected += acceptance**d
        seconds = costs.optimistic(num_tokens + d, num_rows + d, RETRY_AFTER)
        rate = expected / ((base if seconds is None else seconds) + between)
        if rate > best_rate:
            best, best_rate = d, rate
    return best
