"""The request fields that constrain the output, parsed into one StructuredOutputsParams.

Accepted (at most one constraint per request; two are a 400, never a silent choice):
- OpenAI's `response_format`: {"type": "text"} (no constraint), {"type": "json_object"}, or
  {"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": ...}};
- vLLM's `structured_outputs`: {"json": schema, "regex": ..., "choice": [...], "grammar": ...,
  "json_object": true}, exactly one of them;
- vLLM's older extras `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`.

Only the shape is checked here; whether a schema, regex or grammar compiles is the engine's
check at admission (a 400 naming the problem, through RequestRejected "invalid").
"""

from __future__ import annotations

from typing import Any

from jserve.sampling_params import STRUCTURED_KINDS, StructuredOutputsParams
from jserve.server.api_errors import APIError

_GUIDED = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}


def _response_format(value: Any) -> dict[str, Any] | None:
    if not isinstance(value, dict):
        raise APIError(400, "'response_format' must be an object", param="response_format")
    kind = value.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        spec = value.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise APIError(
                400,
                "response_format json_schema needs 'json_schema': {'name': ..., 'schema': {...}}",
                param="response_format",
            )
        return {"json": schema}
    raise APIError(
        400,
        f"response_format type must be 'text', 'json_object' or 'json_schema', got {kind!r}",
        param="response_format",
    )


def _vllm_structured(value: Any) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise APIError(400, "'structured_outputs' must be an object", param="structured_outputs")
    unknown = sorted(set(value) - set(STRUCTURED_KINDS) - {"backend", "disable_any_whitespace"})
    if unknown:
        raise APIError(
            400,
            f"'structured_outputs' has unsupported keys {unknown}; use one of "
            f"{list(STRUCTURED_KINDS)}",
            param="structured_outputs",
        )
    return {k: v for k, v in value.items() if k in STRUCTURED_KINDS and v not in (None, False)}


def parse_structured_outputs(body: dict) -> StructuredOutputsParams | None:
    """The request's output constraint, or None. Raises APIError(400) naming the field."""
    found: list[tuple[str, dict[str, Any]]] = []
    if body.get("response_format") is not None:
        fields = _response_format(body["response_format"])
        if fields is not None:
            found.append(("response_format", fields))
    if body.get("structured_outputs") is not None:
        found.append(("structured_outputs", _vllm_structured(body["structured_outputs"])))
    for name, kind in _GUIDED.items():
        if body.get(name) is not None:
            found.append((name, {kind: body[name]}))
    if not found:
        return None
    if len(found) > 1:
        names = [name for name, _ in found]
        raise APIError(400, f"give one output constraint, got {names}", param=names[1])
    name, fields = found[0]
    if "choice" in fields and not isinstance(fields["choice"], list):
        raise APIError(400, f"'{name}' choice must be a list of strings", param=name)
    try:
        return StructuredOutputsParams(**fields)
    except (ValueError, TypeError) as exc:
        raise APIError(400, f"'{name}': {exc}", param=name) from exc
