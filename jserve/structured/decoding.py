"""Per-sequence grammar matchers and the step's token bitmasks (host side).

Each step, for the constrained rows the sampler will draw from:
1. `sync` brings each matcher to exactly the sequence's output tokens. Normally it already is
   (it advanced with every sampled token); after a preemption, a rollback or a recompute
   leaves other outputs behind, and the matcher rolls back or replays to match them, so a
   resumed sequence is constrained from exactly where its output stands.
2. `fill_masks` computes every constrained row's allowed tokens into one packed int32 buffer
   in llguidance's thread pool (it releases the GIL). The engine calls it right after
   dispatching the model step, so on an asynchronous device the masks are computed while the
   forward pass runs.
3. After sampling, `advance` feeds each sampled token to its matcher and reports whether the
   grammar is complete (the engine then ends the sequence: nothing more may follow).
A matcher that fails (a grammar past its limits deeper into a sequence than the compile-time
probe reaches, jserve.structured.grammar) fails only its own sequence, with a short message.

The sampler (jserve.runtime.sampler.apply_token_bitmask) turns the bitmask into -inf logits on
device; unconstrained rows carry all ones, so one executable serves any mix of rows.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import llguidance
import llguidance.numpy as llg_numpy
import numpy as np

from jserve.loaders.tokenizer import Tokenizer
from jserve.runtime.sampling_tensors import bitmask_width
from jserve.structured.grammar import GrammarCache, GrammarError, short_error


class SequenceMatcher:
    """One constrained sequence's grammar state, and the output tokens it has consumed."""

    def __init__(self, template: llguidance.LLMatcher) -> None:
        self._template = template
        self.matcher = template.deep_copy()
        self.tokens: list[int] = []

    @property
    def error(self) -> str | None:
        return self.matcher.get_error() if self.matcher.is_error() else None

    @property
    def is_complete(self) -> bool:
        """The grammar is satisfied and admits no further token (only EOS)."""
        return self.matcher.is_stopped() and not self.matcher.is_error()

    def advance(self, token: int) -> bool:
        """Consume a sampled token; False if the grammar rejects it (the matcher is in error)."""
        ok = self.matcher.consume_token(token)
        if ok:
            self.tokens.append(token)
        return ok

    def sync(self, output_token_ids: Sequence[int]) -> None:
        """Make the consumed tokens exactly `output_token_ids`: roll back to the common
        prefix, then consume the rest. Raises GrammarError if the grammar rejects them."""
        n = len(output_token_ids)
        if n == len(self.tokens) and (n == 0 or output_token_ids[-1] == self.tokens[-1]):
            return  # the usual step: nothing changed behind the matcher's back
        common = 0
        for a, b in zip(self.tokens, output_token_ids, strict=False):
            if a != b:
                break
            common += 1
        if common < len(self.tokens) and not self.matcher.rollback(len(self.tokens) - common):
            self.matcher = self._template.deep_copy()  # rebuild, then replay the prefix
            self.matcher.consume_tokens(self.tokens[:common])
        del self.tokens[common:]
        for token in output_token_ids[common:]:
            if not self.advance(int(token)):
                raise GrammarError(f"the output is outside the grammar: {short_error(self.error)}")


class StructuredDecoding:
    """The engine's grammar side: compiled constraints, matchers and the step's bitmasks.

    Args:
        tokenizer: the model's tokenizer.
        vocab_size: the logits' width V (the bitmask covers ceil(V / 32) words).
        max_rows: the largest sequence bucket (rows of the bitmask buffer).
    """

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, max_rows: int) -> None:
        self.grammars = GrammarCache(tokenizer, vocab_size)
        self._bitmask = np.full((max_rows, bitmask_width(vocab_size)), -1, np.int32)
        self._executor: llguidance.LLExecutor | None = None
        self.host_seconds = 0.0  # spent in matchers and masks: the grammar engine's share
        self.num_masked_steps = 0

    def new_matcher(self, template: llguidance.LLMatcher) -> SequenceMatcher:
        """A fresh matcher for one sequence, from a compiled constraint (GrammarCache)."""
        start = time.perf_counter()
        try:
            return SequenceMatcher(template)
        finally:
            self.host_seconds += time.perf_counter() - start

    def fill_masks(
        self, rows: Sequence[tuple[int, SequenceMatcher, Sequence[int]]]
    ) -> tuple[dict[int, np.ndarray], dict[int, str]]:
        """Bitmasks of (row index, matcher, output ids so far): ({row: [W] int32 view},
        {row: why it failed}). Views are valid until the next call."""
        if not rows:
            return {}, {}
        start = time.perf_counter()
        failed: dict[int, str] = {}
        ready = []
        for i, matcher, output in rows:
            try:
                matcher.sync(output)
            except GrammarError as e:
                failed[i] = str(e)
                continue
            if matcher.error is not None:
                failed[i] = f"the grammar matcher failed: {short_error(matcher.error)}"
            else:
                ready.append((matcher.matcher, i))
        if ready:  # llguidance refuses an empty batch
            if self._executor is None:
                self._executor = llguidance.LLExecutor()
            llg_numpy.fill_next_token_bitmask_par(self._executor, ready, self._bitmask)
        masks = {i: self._bitmask[i] for _, i in ready}
        self.host_seconds += time.perf_counter() - start
        self.num_masked_steps += 1
        return masks, failed

    def advance(self, matcher: SequenceMatcher, token: int) -> bool:
        """Feed the sampled token; True once the grammar is complete. Raises GrammarError if
        the grammar rejects the token: the mask allowed it, so only a conflict with another
        rule (e.g. min_tokens banning the only allowed EOS) or a grammar past its limits
        (jserve.structured.grammar.LIMITS) later than its first token gets here."""
        start = time.perf_counter()
        try:
            if not matcher.advance(token):
                raise GrammarError(
                    f"the grammar failed at output token {len(matcher.tokens) + 1}: "
                    f"{short_error(matcher.error)}"
                )
            return matcher.is_complete
        finally:
            self.host_seconds += time.perf_counter() - start
