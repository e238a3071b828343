"""Compile output constraints into llguidance matchers: bounded, off the step thread, cached.

A compiled constraint is a matcher in its initial state (the "template"); each constrained
sequence gets a `deep_copy` of it, which costs little next to a compile, so a schema that 64
requests share is compiled once. JSON is generated without free whitespace (`whitespace_flexible`
off): a small model given the freedom pads with newlines until max_tokens.

Where compiling runs: `GrammarCache.submit` hands it to a small thread pool and returns a
future, so the server's requests await their grammar before they reach the step thread
(jserve.engine.async_engine), and the step loop never waits for one. llguidance releases
the GIL while it builds a matcher, so a compile in the pool does not stall Python threads; and
the pool's threads run at a lower CPU priority (`COMPILE_NICENESS`, where the OS allows it), so
on a machine with few cores a storm of compiles takes the cores the engine's step leaves idle
rather than slowing every other tenant's tokens: the constrained requests wait, not the rest.
`GrammarCache.template` compiles on the calling thread (the offline engine's path); both go
through one function and one cache. Requests that ask for the same constraint at the same
time wait for one compile.

What is served is bounded, so that a request cannot hold a worker for long, take the
memory of the host, or fail at its first token:
- before the compiler: unrolling the counted repetitions of the constraint's regexes and
  Lark definitions adds at most jserve.config.regex_size.MAX_REGEX_SIZE nodes (checked when
  StructuredOutputsParams is built, so a regex like `a{1000000}` never reaches the pool);
  at most MAX_CHOICES options in a choice, and at most MAX_CONSTRAINT_CHARS characters of
  schema, regex, grammar or choices (in the canonical text form that keys the cache);
- in the compiler: llguidance's `LLParserLimits` (`LIMITS`), which cap the grammar's size,
  the lexer's states and the work ("fuel") of building the lexer and of each token's mask;
- after it: the first mask is computed, and one allowed token consumed on a copy
  (`_probe`), so a grammar past the limits at its first token is refused at admission.
  (This also fills the lexer caches that every copy shares, so the first step of each
  sequence is cheap.) A limit reached later in a sequence fails only that
  sequence (jserve.structured.decoding).
Every refusal is a GrammarError whose message is short: at most ERROR_CHARS characters of
llguidance's error, never its state dump or the grammar.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor

import llguidance
import numpy as np

from jserve.config.regex_size import MAX_CONSTRAINT_CHARS
from jserve.loaders.tokenizer import Tokenizer
from jserve.sampling_params import StructuredKind, StructuredOutputsParams

# Options of one choice constraint. Each option is one alternative of a single grammar rule,
# and llguidance's parser refuses a rule with more alternatives than max_items_in_row (below).
MAX_CHOICES = 1_000
# llguidance's limits; the values are its defaults, except where noted.
LIMITS = llguidance.LLParserLimits(
    max_items_in_row=2_000,  # alternatives of one rule in one parser row
    initial_lexer_fuel=1_000_000,  # work to build the lexer's regexes
    step_lexer_fuel=200_000,  # lexer work per token mask
    step_max_items=50_000,  # parser items per token mask
    max_lexer_states=50_000,  # each ~1-2 kB (default 250,000)
    max_grammar_size=200_000,  # symbols in the grammar's rules (default 500,000)
    verbose_errors=False,  # errors without the parser's state and the grammar
)
ERROR_CHARS = 200  # of llguidance's error message in a GrammarError
COMPILE_THREADS = 2  # the pool's workers: compiles that run at once
COMPILE_NICENESS = 10  # added to the pool threads' niceness: the step thread goes first

log = logging.getLogger(__name__)

_JSON_OPTIONS = {"whitespace_flexible": False}
# llguidance's words for a valid schema that uses something it cannot enforce.
_UNSUPPORTED_MARKERS = ("Unimplemented", "Unknown format", "not supported", "unsupported")
_WHAT = {
    StructuredKind.JSON: "JSON schema",
    StructuredKind.REGEX: "regex",
    StructuredKind.CHOICE: "choice",
    StructuredKind.GRAMMAR: "grammar",
}


class GrammarError(ValueError):
    """A constraint that cannot be compiled; the message says what to fix."""


def _json_schema_text(schema: str | dict) -> str:
    if isinstance(schema, dict):
        return json.dumps(schema)
    try:
        parsed = json.loads(schema)
    except json.JSONDecodeError as e:
        raise GrammarError(f"the JSON schema is not valid JSON: {e}") from None
    if not isinstance(parsed, dict):
        raise GrammarError(f"a JSON schema must be an object, got {type(parsed).__name__}")
    return json.dumps(parsed)


def grammar_source(spec: StructuredOutputsParams) -> tuple[StructuredKind, str]:
    """(kind, text): the constraint in the canonical form that keys the cache.

    Raises:
        GrammarError: the text is not a JSON schema, or is over MAX_CHOICES or
            MAX_CONSTRAINT_CHARS.
    """
    kind = spec.kind
    if kind is StructuredKind.CHOICE and len(spec.choice) > MAX_CHOICES:
        raise GrammarError(
            f"a choice has {len(spec.choice)} options; at most {MAX_CHOICES} are served"
        )
    if kind is StructuredKind.JSON:
        key = kind, _json_schema_text(spec.json)
    elif kind is StructuredKind.JSON_OBJECT:
        key = StructuredKind.JSON, json.dumps({"type": "object"})
    elif kind is StructuredKind.CHOICE:
        key = kind, json.dumps(list(spec.choice))
    else:
        key = kind, getattr(spec, kind)
    if len(key[1]) > MAX_CONSTRAINT_CHARS:
        raise GrammarError(
            f"the {_WHAT[key[0]]} is {len(key[1]):,} characters; at most "
            f"{MAX_CONSTRAINT_CHARS:,} are served"
        )
    return key


def short_error(error: str) -> str:
    """The gist of an llguidance error: its first line (and a regex parser's `error:` line,
    which says what is wrong), at most ERROR_CHARS characters."""
    lines = [line.strip() for line in error.replace("<non-verbose/>", "").splitlines()]
    lines = [line for line in lines if line]
    if not lines:
        return "unknown error"
    reason = next((line for line in lines[1:] if line.startswith("error:")), None)
    text = lines[0] if reason is None else f"{lines[0]} {reason}"
    return text if len(text) <= ERROR_CHARS else text[: ERROR_CHARS - 3] + "..."


def _explain(kind: StructuredKind, error: str) -> str:
    error = short_error(error)
    if any(marker in error for marker in _UNSUPPORTED_MARKERS):
        return f"the {_WHAT[kind]} uses a feature the grammar engine does not support: {error}"
    return f"invalid {_WHAT[kind]}: {error}"


def _llguidance_grammar(kind: StructuredKind, text: str) -> str:
    try:
        if kind is StructuredKind.JSON:
            return llguidance.LLMatcher.grammar_from_json_schema(text, defaults=_JSON_OPTIONS)
        return llguidance.grammar_from(str(kind), text)
    except ValueError as e:  # e.g. a GBNF grammar that does not convert to Lark
        raise GrammarError(_explain(kind, str(e))) from None


def _probe(kind: StructuredKind, template: llguidance.LLMatcher, stop_ids: frozenset[int]) -> None:
    """Compute the template's first mask and consume one allowed token on a copy: a grammar
    whose lexer or parser is past LIMITS at its first token fails here, not at a step."""
    mask = np.frombuffer(template.compute_bitmask(), np.uint8)
    if template.is_error():
        raise GrammarError(_explain(kind, template.get_error()))
    allowed = np.flatnonzero(np.unpackbits(mask, bitorder="little"))
    token = next((int(t) for t in allowed if int(t) not in stop_ids), None)
    if token is None:
        return  # only EOS (or nothing) may follow: nothing for the lexer to build
    probe = template.deep_copy()
    if not probe.consume_token(token):
        raise GrammarError(_explain(kind, probe.get_error()))


class GrammarCache:
    """Compiled constraints for one tokenizer, least recently used evicted past `capacity`
    (refusals included: the same bad constraint is refused again without compiling).

    Thread-safe: `submit` is called on the server's event loop, `template` on the step
    thread, and the compiles run in the pool.

    Args:
        tokenizer: the model's tokenizer (its backend is handed to llguidance once, lazily).
        vocab_size: the model's logits width, which may exceed the tokenizer's vocabulary.
        capacity: distinct constraints kept compiled.
    """

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, capacity: int = 256) -> None:
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.capacity = capacity
        self._lock = threading.Lock()
        self._entries: OrderedDict[tuple[str, str], Future] = OrderedDict()
        self._llg_tokenizer: llguidance.LLTokenizer | None = None
        self._pool = ThreadPoolExecutor(
            COMPILE_THREADS, thread_name_prefix="jserve-grammar", initializer=_lower_priority
        )

    @property
    def llg_tokenizer(self) -> llguidance.LLTokenizer:
        """llguidance's view of the tokenizer (built on first use: it takes a moment)."""
        with self._lock:
            if self._llg_tokenizer is None:
                self._llg_tokenizer = llguidance.LLTokenizer(
                    self._tokenizer.backend.to_str(),
                    n_vocab=self.vocab_size,
                    eos_token=sorted(self._tokenizer.stop_token_ids),
                )
            return self._llg_tokenizer

    def submit(self, spec: StructuredOutputsParams) -> Future:
        """Compile `spec` in the pool (or find it compiled, or join its compile under way).

        The future's result is the template (see `template`); its exception a GrammarError.
        """
        return self._pool.submit(self.template, spec)

    def template(self, spec: StructuredOutputsParams) -> llguidance.LLMatcher:
        """The compiled constraint in its initial state (deep_copy it, never advance it),
        compiled on this thread unless it is cached or another thread is compiling it.

        Raises:
            GrammarError: the constraint is invalid, over a limit, or uses what llguidance
                cannot enforce.
        """
        key = grammar_source(spec)
        with self._lock:
            entry = self._entries.get(key)
            compiles_here = entry is None
            if compiles_here:
                entry = self._entries[key] = Future()
                if len(self._entries) > self.capacity:
                    self._entries.popitem(last=False)  # its waiters keep their future
            else:
                self._entries.move_to_end(key)
        if compiles_here:
            try:
                entry.set_result(self._compile(*key))
            except BaseException as e:  # every waiter gets it; raised below for this caller
                entry.set_exception(e)
                if not isinstance(e, GrammarError):  # only a refusal is worth remembering
                    self._forget(key, entry)
        return entry.result()

    def _forget(self, key: tuple[str, str], entry: Future) -> None:
        with self._lock:
            if self._entries.get(key) is entry:
                del self._entries[key]

    def _compile(self, kind: StructuredKind, text: str) -> llguidance.LLMatcher:
        grammar = _llguidance_grammar(kind, text)
        template = llguidance.LLMatcher(self.llg_tokenizer, grammar, log_level=0, limits=LIMITS)
        if template.is_error():
            raise GrammarError(_explain(kind, template.get_error()))
        _probe(kind, template, self._tokenizer.stop_token_ids)
        return template


def _lower_priority() -> None:
    """Make the calling (pool) thread yield the CPU to the engine's threads. Linux applies a
    thread id's priority to that thread alone; elsewhere, or where it is not allowed, the
    compile runs at the default priority."""
    try:
        tid = threading.get_native_id()
        niceness = os.getpriority(os.PRIO_PROCESS, tid) + COMPILE_NICENESS
        os.setpriority(os.PRIO_PROCESS, tid, niceness)
    except (AttributeError, OSError) as e:
        log.debug("grammar compiles keep the default CPU priority: %s", e)
