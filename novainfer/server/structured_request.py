"""The request's output constraint: `response_format` (OpenAI), `structured_outputs` (vLLM) or vLLM's older
`guided_json` / `guided_regex` / `guided_choice` / `guided_grammar`; at most one of them may be given."""

from __future__ import annotations

from typing import Any

from novainfer.sampling_params import StructuredOutputsParams
from novainfer.server.errors import APIError
from novainfer.server.protocol import SamplingFields

_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


def structured_outputs_params(req: SamplingFields) -> StructuredOutputsParams | None:
    """StructuredOutputsParams from whichever constraint field the request set; a 400 naming the field when two
    are set or the constraint is malformed."""
    found: list[tuple[str, dict]] = []
    fmt = getattr(req, "response_format", None)
    if fmt is not None and fmt.type != "text":
        if fmt.type == "json_object":
            found.append(("response_format", {"json_object": True}))
        else:
            if fmt.json_schema is None or fmt.json_schema.schema_ is None:
                raise APIError(
                    400, "response_format of type json_schema needs json_schema.schema", param="response_format"
                )
            schema = fmt.json_schema.schema_
            found.append(("response_format", {"json": closed_schema(schema) if fmt.json_schema.strict else schema}))
    if req.structured_outputs is not None:
        so = req.structured_outputs
        kw = {
            "json": so.json_,
            "regex": so.regex,
            "choice": so.choice,
            "grammar": so.grammar,
            "json_object": so.json_object,
        }
        found.append(("structured_outputs", {k: v for k, v in kw.items() if v is not None}))
    for field, kind in _GUIDED.items():
        value = getattr(req, field)
        if value is not None:
            found.append((field, {kind: value}))
    if not found:
        return None
    if len(found) > 1:
        names = ", ".join(name for name, _ in found)
        raise APIError(400, f"give one output constraint, not several: {names}", param=found[1][0])
    field, kw = found[0]
    try:
        return StructuredOutputsParams(**kw)
    except (TypeError, ValueError) as exc:
        raise APIError(400, f"{field}: {exc}", param=field) from None


_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "prefixItems")  # allOf / not / if: closing their parts changes meaning
_SUBSCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties")
_SUBSCHEMAS = ("items", "additionalProperties", "contains")


def closed_schema(schema: Any) -> Any:
    """A copy of a JSON schema where every object schema that does not say otherwise has
    `additionalProperties: false` (xgrammar's strict mode): a forced call never invents an undeclared property."""
    if isinstance(schema, list):
        return [closed_schema(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SUBSCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [closed_schema(s) for s in out[key]]
    for key in _SUBSCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {k: closed_schema(s) for k, s in out[key].items()}
    for key in _SUBSCHEMAS:
        if isinstance(out.get(key), dict):
            out[key] = closed_schema(out[key])
    kind = out.get("type")
    is_object = kind == "object" or (isinstance(kind, list) and "object" in kind) or "properties" in out
    if (
        is_object
        and "additionalProperties" not in out
        and "patternProperties" not in out
        and "unevaluatedProperties" not in out
    ):
        out["additionalProperties"] = False
    return out
