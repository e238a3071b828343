"""The request fields that constrain the output, turned into one StructuredOutputsParams.

Accepted (at most one constraint per request; two are a 400, never a silent choice):
- OpenAI's `response_format`: {"type": "text"} (no constraint), {"type": "json_object"}, or
  {"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": ...}};
- vLLM's `structured_outputs`: {"json": schema, "regex": ..., "choice": [...], "grammar": ...,
  "json_object": true}, exactly one of them;
- vLLM's older extras `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`.

Their shapes are the protocol Structs' (server/protocol_types.py); whether a schema, regex or
grammar compiles is the engine's check at admission (a 400 naming the problem, through
RequestRejected "invalid"). A regex in it whose counted repetitions unroll too far is refused
here already, by StructuredOutputsParams (jserve.config.regex_size), a 400 naming the field.
"""

from __future__ import annotations

from typing import Any

from jserve.sampling_params import StructuredKind, StructuredOutputsParams
from jserve.server.api_errors import APIError
from jserve.server.protocol_types import (
    GenerationRequest,
    JSONObjectFormat,
    JSONSchemaFormat,
    ResponseFormat,
    StructuredOutputs,
)

_GUIDED = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}


def _response_format(value: ResponseFormat) -> dict[str, Any] | None:
    if isinstance(value, JSONObjectFormat):
        return {"json_object": True}
    if isinstance(value, JSONSchemaFormat):
        return {"json": value.json_schema.schema}
    return None  # "text"


def _vllm_structured(value: StructuredOutputs) -> dict[str, Any]:
    fields = {str(kind): getattr(value, kind) for kind in StructuredKind}
    return {kind: v for kind, v in fields.items() if v not in (None, False)}


def _constraints(body: GenerationRequest) -> list[tuple[str, dict[str, Any]]]:
    """(field, StructuredOutputsParams fields) of each constraint the request sets."""
    found: list[tuple[str, dict[str, Any]]] = []
    if body.response_format is not None:
        fields = _response_format(body.response_format)
        if fields is not None:
            found.append(("response_format", fields))
    if body.structured_outputs is not None:
        found.append(("structured_outputs", _vllm_structured(body.structured_outputs)))
    for name, kind in _GUIDED.items():
        if getattr(body, name) is not None:
            found.append((name, {kind: getattr(body, name)}))
    return found


def constraint_field(body: GenerationRequest) -> str | None:
    """The field the request's output constraint comes from (for errors), or None."""
    found = _constraints(body)
    return found[0][0] if found else None


def output_constraint(body: GenerationRequest) -> StructuredOutputsParams | None:
    """The constraint the request sets, or None. Raises APIError(400) naming the field."""
    found = _constraints(body)
    if not found:
        return None
    if len(found) > 1:
        names = [name for name, _ in found]
        raise APIError(400, f"give one output constraint, got {names}", param=names[1])
    name, fields = found[0]
    try:
        return StructuredOutputsParams(**fields)
    except ValueError as exc:
        raise APIError(400, f"'{name}': {exc}", param=name) from exc
