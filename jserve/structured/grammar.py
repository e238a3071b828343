"""Compile output constraints into llguidance matchers, cached by constraint.

A compiled constraint is a matcher in its initial state (the "template"); each constrained
sequence gets a `deep_copy` of it, which costs microseconds, so a schema that 64 requests
share is compiled once. JSON is generated without free whitespace (`whitespace_flexible`
off): a small model given the freedom pads with newlines until max_tokens.
"""

from __future__ import annotations

import functools
import json
from collections import OrderedDict

import llguidance

from jserve.loaders.tokenizer import Tokenizer
from jserve.sampling_params import StructuredOutputsParams

_JSON_OPTIONS = {"whitespace_flexible": False}
# llguidance's words for a valid schema that uses something it cannot enforce.
_UNSUPPORTED_MARKERS = ("Unimplemented", "Unknown format", "not supported", "unsupported")


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


def grammar_source(spec: StructuredOutputsParams) -> tuple[str, str]:
    """(kind, text): the constraint in the canonical form that keys the cache."""
    kind = spec.kind
    if kind == "json":
        return kind, _json_schema_text(spec.json)
    if kind == "json_object":
        return "json", json.dumps({"type": "object"})
    if kind == "choice":
        return kind, json.dumps(list(spec.choice))
    return kind, getattr(spec, kind)


def _llguidance_grammar(kind: str, text: str) -> str:
    try:
        if kind == "json":
            return llguidance.LLMatcher.grammar_from_json_schema(text, defaults=_JSON_OPTIONS)
        return llguidance.grammar_from(kind, text)
    except ValueError as e:  # e.g. a GBNF grammar that does not convert to Lark
        raise GrammarError(_explain(kind, str(e))) from None


def _explain(kind: str, error: str) -> str:
    what = {"json": "JSON schema", "regex": "regex", "choice": "choice", "grammar": "grammar"}
    if any(marker in error for marker in _UNSUPPORTED_MARKERS):
        return f"the {what[kind]} uses a feature the grammar engine does not support: {error}"
    return f"invalid {what[kind]}: {error}"


class GrammarCache:
    """Compiled constraints for one tokenizer, least recently used evicted past `capacity`.

    Args:
        tokenizer: the model's tokenizer (its backend is handed to llguidance once, lazily).
        vocab_size: the model's logits width, which may exceed the tokenizer's vocabulary.
        capacity: distinct constraints kept compiled.
    """

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, capacity: int = 256) -> None:
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.capacity = capacity
        self._templates: OrderedDict[tuple[str, str], llguidance.LLMatcher] = OrderedDict()
        self.hits = 0
        self.misses = 0

    @functools.cached_property
    def llg_tokenizer(self) -> llguidance.LLTokenizer:
        """llguidance's view of the tokenizer (about 0.3 s to build, so on first use)."""
        return llguidance.LLTokenizer(
            self._tokenizer.backend.to_str(),
            n_vocab=self.vocab_size,
            eos_token=sorted(self._tokenizer.stop_token_ids),
        )

    def template(self, spec: StructuredOutputsParams) -> llguidance.LLMatcher:
        """The compiled constraint in its initial state (deep_copy it, never advance it).

        Raises:
            GrammarError: the constraint is invalid, or uses what llguidance cannot enforce.
        """
        key = grammar_source(spec)
        template = self._templates.get(key)
        if template is not None:
            self.hits += 1
            self._templates.move_to_end(key)
            return template
        self.misses += 1
        grammar = _llguidance_grammar(*key)
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(
            grammar, self.llg_tokenizer
        )
        if is_error:
            raise GrammarError(_explain(key[0], messages[0].strip()))
        template = llguidance.LLMatcher(self.llg_tokenizer, grammar, log_level=0)
        if template.is_error():
            raise GrammarError(_explain(key[0], template.get_error()))
        self._templates[key] = template
        if len(self._templates) > self.capacity:
            self._templates.popitem(last=False)
        return template
