"""A request's output constraint as the `llm` model's "structured_outputs" object (vLLM's names,
enforced by the engine with xgrammar), and the request field it came from, for errors.

The sources: `response_format` (json_object, json_schema, structural_tag), vLLM's extra fields
`structured_outputs` and the older `guided_json` / `guided_regex` / `guided_choice` /
`guided_grammar`, and for chat a named or "required" `tool_choice` (tools.py). A request gives at
most one; `llm` checks the constraint itself (a bad schema is its error, naming
`structured_outputs.<field>`).
"""
from __future__ import annotations

import contextlib
import json
import re
from dataclasses import dataclass

from inflight.structured import bound_whitespace

from .errors import APIError
from .schemas import SamplingFields

_LLM_FIELD = re.compile(r"'structured_outputs\.[a-z_]+((?:\.[a-z_]+)*)'")     # the kind's field, and below it
GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


@dataclass(frozen=True, slots=True)
class Constraint:
    structured_outputs: dict
    source: str                 # the request field it came from
    written_at: str | None = None   # where the request wrote the schema (or regex, ...), for `llm`'s errors


def _from_response_format(body: SamplingFields) -> dict | None:
    fmt = body.response_format
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return {"json_object": True}
    if fmt.type == "structural_tag":       # JSON text, as vLLM's StructuredOutputsParams takes it
        return {"structural_tag": json.dumps(fmt.structural_tag())}
    return {"json": fmt.json_schema.schema_}


def request_constraints(body: SamplingFields) -> list[Constraint]:
    """The constraints the request's own fields give (before tools)."""
    found = []
    response_format = _from_response_format(body)
    if response_format is not None:
        written_at = "response_format" if "structural_tag" in response_format else "response_format.json_schema.schema"
        found.append(Constraint(response_format, "response_format", written_at))
    if body.structured_outputs is not None:
        found.append(Constraint(body.structured_outputs, "structured_outputs"))
    for field, kind in GUIDED.items():
        value = getattr(body, field)
        if value is not None:
            found.append(Constraint({kind: value}, field, field))
    return found


def single(constraints: list[Constraint], disable_any_whitespace: bool = False) -> Constraint | None:
    """The one constraint, or a 400 naming every field that gave one. The server's
    --disable-any-whitespace applies unless the request's structured_outputs says otherwise (to a
    structural tag's JSON as a bound on its whitespace, structured.bound_whitespace in `llm`)."""
    if len(constraints) > 1:
        names = ", ".join(f"'{c.source}'" for c in constraints)
        raise APIError(400, f"give at most one output constraint; got {names}", constraints[1].source)
    if not constraints:
        return None
    constraint = constraints[0]
    if not disable_any_whitespace:
        return constraint
    value = {"disable_any_whitespace": True, **constraint.structured_outputs}
    if value["disable_any_whitespace"] is True and isinstance(value.get("structural_tag"), str):
        # bounded here too, so that a Triton vLLM backend (which leaves a tag's whitespace free) gets it
        with contextlib.suppress(ValueError, RecursionError):       # not JSON: `llm` names the field
            tag = json.loads(value["structural_tag"])
            if isinstance(tag, dict):
                value["structural_tag"] = json.dumps(bound_whitespace(tag))
    return Constraint(value, constraint.source, constraint.written_at)


def blame(error: APIError, constraint: Constraint | None) -> APIError:
    """`llm`'s error about the constraint, naming the request field it came from where `llm` names
    its own ('structured_outputs', 'structured_outputs.json'): in the message, and in `param` unless
    the error is another field's ('min_tokens' cannot be combined with one)."""
    if constraint is not None and "'structured_outputs" in error.message:
        if error.param == "structured_outputs" or not error.message.startswith(f"'{error.param}' "):
            error.param = constraint.source         # the constraint's own error, not another field's
        if constraint.written_at is not None:
            error.message = _LLM_FIELD.sub(lambda m: f"'{constraint.written_at}{m.group(1)}'", error.message)
        error.message = error.message.replace("'structured_outputs'", f"'{constraint.source}'")
    return error
