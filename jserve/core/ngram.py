"""Prompt-lookup drafts (vLLM's "ngram" method): find the sequence's last n tokens earlier in
its own prompt and output, and propose what followed them there.

The longest n in [min_n, max_n] whose n-gram occurs earlier wins; among its occurrences the
latest one (vLLM's proposer makes the same choice). The search runs in C: the int64 tokens as
bytes, searched backwards with `bytes.rfind` for the n-gram's bytes, keeping only hits on a
token boundary, so a proposal over thousands of tokens costs microseconds of host time.
"""

from __future__ import annotations

from array import array

_ITEM = array("q").itemsize


def propose_ngram(tokens: array, k: int, min_n: int, max_n: int) -> array:
    """Up to `k` draft tokens continuing `tokens` (an int64 array: prompt then output), or an
    empty array when no n-gram of `min_n..max_n` of its end occurs earlier."""
    num_tokens = len(tokens)
    if k <= 0 or num_tokens < 2:
        return array("q")
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
                return tokens[start : start + k]
            end = hit + len(pattern) - 1  # a misaligned hit: look again just before it
    return array("q")
