"""Prompt-lookup drafts (vLLM's "ngram" method): find the sequence's last n tokens earlier in
its own prompt and output, and propose what followed them there.

The longest n in [min_n, max_n] whose n-gram occurs earlier wins; among its occurrences the
latest one (vLLM's proposer makes the same choice). The search runs in C: the int64 tokens as
bytes, searched backwards with `bytes.rfind` for the n-gram's bytes, keeping only hits on a
token boundary, so a proposal over thousands of tokens costs microseconds of host time.

Drafts cost a verify step's extra tokens whether accepted or not, so a sequence whose drafts
keep being rejected pauses drafting (`drafts_pay`) and tries again after a while. What every
method shares lives here: the `Draft` a proposer returns, its kind (guess or copy), and the
acceptance average each kind keeps per sequence.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass

_ITEM = array("q").itemsize

# Per sequence, drafts pay only while enough of them are accepted: a verify step computes and
# pads more tokens than a plain decode. A sequence's acceptance is the chance that a draft is
# accepted given that the drafts before it were (verification stops at the first rejection,
# so a verify step of m accepted drafts out of d tried m + 1 of them when m < d, m when all
# were accepted), averaged with weight ACCEPTANCE_WEIGHT. d drafts are then expected to yield
# a + a^2 + ... + a^d tokens (jserve.core.drafting.num_drafts_that_pay). Where no step costs
# are measured, below ACCEPTANCE_FLOOR a sequence gets no drafts; either way, each decode
# without drafts raises the average by RETRY_STEP, so it tries again after a while (the text
# it copies may come back).
ACCEPTANCE_WEIGHT = 0.3
ACCEPTANCE_FLOOR = 0.3
RETRY_STEP = 0.005

# A draft whose source matched only the sequence's last token is a guess (common tokens recur
# with many continuations); one whose source matched COPY_MATCH tokens or more is a copy, and
# is accepted far more often. A sequence keeps one acceptance average per kind
# (`Request.draft_acceptance`), so rejected guesses do not price out the copies that follow
# them, nor accepted copies buy room for guesses.
GUESS, COPY = 0, 1
COPY_MATCH = 2


@dataclass(frozen=True)
class Draft:
    """A proposal: its tokens, and how many of the sequence's last tokens its source matched."""

    tokens: array
    matched: int = 0

    @property
    def kind(self) -> int:
        """GUESS or COPY: which of the sequence's acceptance averages prices this draft."""
        return COPY if self.matched >= COPY_MATCH else GUESS


NO_DRAFT = Draft(array("q"))


def note_acceptance(acceptance: float, num_drafts: int, num_accepted: int) -> float:
    """A sequence's average acceptance after a verify step of `num_drafts` drafts of which the
    first `num_accepted` were accepted."""
    tried = num_accepted + (num_accepted < num_drafts)
    return acceptance + ACCEPTANCE_WEIGHT * (num_accepted / tried - acceptance)


def drafts_pay(acceptance: float) -> bool:
    """Whether a sequence of this average acceptance gets drafts this step."""
    return acceptance >= ACCEPTANCE_FLOOR


def propose_ngram(tokens: array, k: int, min_n: int, max_n: int) -> Draft:
    """Up to `k` draft tokens continuing `tokens` (an int64 array: prompt then output), matched
    on n tokens; none when no n-gram of `min_n..max_n` of its end occurs earlier."""
    num_tokens = len(tokens)
    if k <= 0 or num_tokens < 2:
        return NO_DRAFT
    data = tokens.tobytes()
    # An occurrence must end before the last token, so at least one token follows it.
    search_end = (num_tokens - 1) * _ITEM
    for n in range(min(max_n, num_tokens - 1), min_n - 1, -1):
        pattern = data[(num_tokens - n) * _ITEM :]
        end = search_end
        while True:
            hit = data.rfind(pattern, 0, end)
            if hit < 0:
                break
            if hit % _ITEM == 0:
                start = hit // _ITEM + n
                return Draft(tokens[start : start + k], n)
            end = hit + len(pattern) - 1  # a misaligned hit: look again just before it
    return NO_DRAFT
