"""Suffix decoding's drafts (vLLM's "suffix" method, after SuffixDecoding, arXiv 2411.04975):
the most frequent continuation of the longest match of a sequence's end, in its own tokens and
in its tenant's recent outputs, as long as the match and its frequency warrant.

For a source of tokens (the sequence's prompt and output, or the tenant's history):
1. **Match**: the longest m <= `max_depth` such that the sequence's last m tokens occur earlier
   in the source, followed by a token (in the sequence itself: ending before its last token).
   If the last m tokens occur, so do the last m - 1 (one token later, with the same next
   token), so m is found by galloping and bisection.
2. **Occurrences**: the latest MAX_OCCURRENCES occurrences of that match: the node of a suffix
   tree the match reaches, and its leaves (recent text weighs most, and the walk stays cheap).
3. **Walk**: the next token most of them continue with (ties: the latest occurrence's) is a
   draft while its probability, the product of each step's frequency among the occurrences
   still followed, stays at least `min_token_prob`; the occurrences that continued otherwise
   drop out. At most `max_spec_factor` drafts per matched token: a long match is a copy worth
   following far, a short one a guess worth one or two tokens.

The draft whose probabilities sum higher wins between the two sources (ties: the sequence's
own). Every search is `bytes.rfind` over int64 tokens in C (the n-gram proposer's technique,
jserve.core.ngram), so a proposal costs a few scans of the sequence and of its tenant's
history, which is bounded (`suffix_decoding_max_cached_requests` outputs, HISTORY_TOKENS tokens,
MAX_TENANTS tenants, least recently finished dropped), and never serves another tenant.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict, deque
from dataclasses import dataclass

from jserve.config.speculative import SpeculativeConfig
from jserve.core.ngram import NO_DRAFT, Draft
from jserve.core.request import Request

SEPARATOR = -1  # after each output in a history: never a token, so no match spans two
MAX_OCCURRENCES = 64  # latest occurrences of a match whose continuations are counted
HISTORY_TOKENS = 1 << 14  # per tenant: bounds memory and the time of a search
MAX_TENANTS = 64  # tenants whose histories are kept
_ITEM = array("q").itemsize


@dataclass(frozen=True)
class SuffixDraft:
    """A proposal from one source: its tokens, the sum of their estimated probabilities, and
    how many of the sequence's last tokens the source matched."""

    tokens: array
    score: float = 0.0
    matched: int = 0


_NONE = SuffixDraft(array("q"))


def _occurrences(data: bytes, tokens: array, pattern: bytes, end: int, limit: int) -> list[int]:
    """Token indices just past the latest `limit` occurrences of `pattern` (int64 bytes) that
    lie inside `data[:end]` on token boundaries and are followed by a token, latest first."""
    found: list[int] = []
    while len(found) < limit:
        hit = data.rfind(pattern, 0, end)
        if hit < 0:
            break
        if hit % _ITEM == 0:
            after = (hit + len(pattern)) // _ITEM
            if tokens[after] != SEPARATOR:
                found.append(after)
        end = hit + len(pattern) - 1  # the next one starts before this one
    return found


def _longest_match(context: bytes, source: bytes, tokens: array, end: int, longest: int) -> int:
    """The longest m <= `longest` whose last m tokens of `context` occur in `source[:end]`,
    followed by a token (0: none). Galloping (1, 2, 4, ...) then bisection: a search that
    finds no occurrence scans the whole source, and most matches are short."""

    def occurs(m: int) -> bool:
        return bool(_occurrences(source, tokens, context[len(context) - m * _ITEM :], end, 1))

    lo, hi = 0, 1
    while hi <= longest and occurs(hi):
        lo, hi = hi, 2 * hi
    hi = min(hi - 1, longest)  # lo occurs; hi + 1 does not, or is past `longest`
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if occurs(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo


def _walk(
    tokens: array, after: list[int], max_drafts: int, min_prob: float, matched: int
) -> SuffixDraft:
    """Follow the most frequent continuation of the occurrences, of a `matched`-token match,
    ending just before `after`."""
    drafts, prob, score, n = array("q"), 1.0, 0.0, len(tokens)
    while len(drafts) < max_drafts and after:
        counts: dict[int, int] = {}
        for q in after:
            if q < n and tokens[q] != SEPARATOR:
                counts[tokens[q]] = counts.get(tokens[q], 0) + 1
        if not counts:
            break
        token = max(counts, key=counts.__getitem__)  # the first (latest) of the most frequent
        prob *= counts[token] / len(after)
        if prob < min_prob:
            break
        drafts.append(token)
        score += prob
        after = [q + 1 for q in after if q < n and tokens[q] == token]
    return SuffixDraft(drafts, score, matched)


def suffix_draft(
    context: array,
    source: array | None,
    k: int,
    max_depth: int,
    max_spec_factor: float,
    min_token_prob: float,
    source_bytes: bytes | None = None,
) -> SuffixDraft:
    """Up to `k` drafts continuing `context` (int64 tokens) from `source`'s occurrences of its
    end (None: from `context` itself, matches ending before its last token); see above.
    `source_bytes`, if given, is `source.tobytes()`, kept by the caller."""
    if k <= 0 or not context:
        return _NONE
    data = context.tobytes()
    if source is None:
        tokens, source_data, longest = context, data, len(context) - 1
        end = longest * _ITEM
    else:
        source_data = source.tobytes() if source_bytes is None else source_bytes
        tokens, longest = source, len(context)
        end = (len(source) - 1) * _ITEM
    m = _longest_match(data, source_data, tokens, end, min(max_depth, longest))
    max_drafts = min(k, int(max_spec_factor * m))
    if max_drafts <= 0:
        return _NONE
    after = _occurrences(source_data, tokens, data[len(data) - m * _ITEM :], end, MAX_OCCURRENCES)
    return _walk(tokens, after, max_drafts, min_token_prob, m)


class _History:
    """One tenant's recent outputs, each followed by SEPARATOR, oldest first."""

    def __init__(self) -> None:
        self.tokens = array("q")
        self.lengths: deque[int] = deque()  # tokens of each output, separator included
        self.data = b""  # tokens.tobytes(), for the searches

    def add(self, output: array, max_outputs: int) -> None:
        self.tokens.extend(output)
        self.tokens.append(SEPARATOR)
        self.lengths.append(len(output) + 1)
        while self.lengths and (
            len(self.lengths) > max_outputs or len(self.tokens) > HISTORY_TOKENS
        ):
            del self.tokens[: self.lengths.popleft()]
        self.data = self.tokens.tobytes()


class SuffixProposer:
    """The `suffix` method's proposer (jserve.core.drafting.DraftProposer)."""

    def __init__(
        self,
        max_depth: int,
        max_cached_requests: int,
        max_spec_factor: float,
        min_token_prob: float,
    ) -> None:
        self.max_depth = max_depth
        self.max_cached_requests = max_cached_requests
        self.max_spec_factor = max_spec_factor
        self.min_token_prob = min_token_prob
        self._histories: OrderedDict[str, _History] = OrderedDict()  # least recent first

    @classmethod
    def from_config(cls, spec: SpeculativeConfig) -> SuffixProposer:
        return cls(
            spec.suffix_decoding_max_tree_depth,
            spec.suffix_decoding_max_cached_requests,
            spec.suffix_decoding_max_spec_factor,
            spec.suffix_decoding_min_token_prob,
        )

    def propose(self, request: Request, k: int) -> Draft:
        settings = (k, self.max_depth, self.max_spec_factor, self.min_token_prob)
        context = request.all_token_ids
        draft = suffix_draft(context, None, *settings)
        history = self._histories.get(request.tenant)
        if history is not None and history.tokens:
            other = suffix_draft(context, history.tokens, *settings, history.data)
            if other.score > draft.score:
                draft = other
        return Draft(draft.tokens, draft.matched) if draft.tokens else NO_DRAFT

    def on_finish(self, request: Request) -> None:
        """Keep `request`'s output for its tenant's later requests."""
        if not self.max_cached_requests or not request.output_token_ids:
            return
        history = self._histories.pop(request.tenant, None) or _History()
        self._histories[request.tenant] = history
        history.add(request.output_token_ids, self.max_cached_requests)
        while len(self._histories) > MAX_TENANTS:
            self._histories.popitem(last=False)
