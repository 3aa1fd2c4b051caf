"""Reading the shape an answer must take: OpenAI's ``response_format`` and vLLM's ``structured_outputs``.

- ``response_format``: ``{"type": "text"}`` (no shape), ``{"type": "json_object"}`` (any JSON
  object), ``{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}`` (an object
  that validates against the schema; the mask always holds the answer to it, so ``strict``
  changes nothing here);
- ``structured_outputs`` (vLLM 0.32's ``StructuredOutputsParams``): exactly one of ``json``
  (a schema, as an object or as JSON text), ``regex``, ``choice`` (a list of strings: the
  answer is one of them), ``grammar`` (EBNF, as xgrammar reads it) and ``json_object``; with
  ``disable_any_whitespace`` (JSON with no whitespace between its tokens). Given both,
  ``response_format`` names the shape (vLLM's rule: it overrides ``structured_outputs``'s kind).

Refused with a 400: ``structural_tag`` (either field), a Lark grammar, ``whitespace_pattern``
and ``disable_additional_properties`` (vLLM's xgrammar backend does neither), ``min_tokens``
with a shape (the grammar decides where the answer ends). Whether the shape compiles is the
engine's to say (``models.grammar``): a 400 with the compiler's words.
"""

from __future__ import annotations

from typing import Any

import orjson

from ...models.grammar import Constraint
from ..handling import ClientError

__all__ = ["parse_constraint"]

_KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")  # vLLM's, one per request
_OPTIONS = {"disable_any_whitespace", "disable_additional_properties", "whitespace_pattern", "disable_fallback"}
MAX_CHOICES = 256


def _refuse(message: str, param: str) -> ClientError:
    return ClientError("bad_request", message, param)


def parse_constraint(doc: dict[str, Any]) -> Constraint | None:
    """The request's shape (None: any text); a 400 naming the field for one this server cannot serve."""
    given = doc.get("structured_outputs")
    if given is not None and not isinstance(given, dict):
        raise _refuse('"structured_outputs" must be an object with one of "json", "regex", "choice", "grammar", '
                      '"json_object"', "structured_outputs")
    options = given or {}
    for name in ("whitespace_pattern", "disable_additional_properties"):
        if options.get(name) not in (None, False):
            raise _refuse(f'"structured_outputs.{name}" is not supported (xgrammar does not take it)',
                          "structured_outputs")
    unknown = sorted(set(options) - set(_KINDS) - _OPTIONS)
    if unknown:
        raise _refuse(f'"structured_outputs": unknown field(s) {", ".join(unknown)}; use one of '
                      f'{", ".join(_KINDS[:-1])}', "structured_outputs")
    compact = bool(options.get("disable_any_whitespace"))
    kind = _from_response_format(doc.get("response_format"))
    if kind is None and given is not None:
        kind = _from_structured_outputs(given)
    if kind is None:
        return None
    if doc.get("min_tokens") not in (None, 0):
        raise _refuse('"min_tokens" cannot be combined with a structured output: its grammar decides where the '
                      "answer ends", "min_tokens")
    return Constraint(kind[0], kind[1], any_whitespace=not compact)


def _from_response_format(fmt: Any) -> tuple[str, str] | None:
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return "json_object", ""
    if kind != "json_schema":
        raise _refuse('"response_format" must be {"type": "text"}, {"type": "json_object"} or {"type": '
                      '"json_schema", "json_schema": {"name": ..., "schema": {...}}}', "response_format")
    spec = fmt.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
        raise _refuse('"response_format": "json_schema" needs "json_schema": {"name": "...", "schema": {...}}',
                      "response_format")
    schema = spec.get("schema")
    if not isinstance(schema, dict):
        raise _refuse('"response_format.json_schema.schema" must be a JSON schema (an object)', "response_format")
    return "json", orjson.dumps(schema).decode()


def _from_structured_outputs(given: dict[str, Any]) -> tuple[str, str]:
    named = [k for k in _KINDS if given.get(k) is not None]
    if len(named) != 1:
        raise _refuse("structured outputs take exactly one kind of constraint ('json', 'regex', 'choice', 'grammar' "
                      f"or 'json_object'), got {len(named)}", "structured_outputs")
    kind, value = named[0], given[named[0]]
    if kind == "structural_tag":
        raise _refuse('"structured_outputs.structural_tag" is not supported', "structured_outputs")
    if kind == "json_object":
        return kind, ""
    if kind == "json":
        if isinstance(value, dict):
            return kind, orjson.dumps(value).decode()
        if isinstance(value, str):
            return kind, value
        raise _refuse('"structured_outputs.json" must be a JSON schema: an object, or its JSON text',
                      "structured_outputs")
    if kind == "choice":
        if not (isinstance(value, list) and 0 < len(value) <= MAX_CHOICES and all(isinstance(c, str) for c in value)):
            raise _refuse(f'"structured_outputs.choice" must be a list of 1 to {MAX_CHOICES} strings',
                          "structured_outputs")
        return kind, orjson.dumps(value).decode()
    if not isinstance(value, str) or not value:
        raise _refuse(f'"structured_outputs.{kind}" must be a non-empty string', "structured_outputs")
    if kind == "grammar" and "::=" not in value:
        raise _refuse('"structured_outputs.grammar": EBNF rules ("root ::= ...") are read here, not Lark',
                      "structured_outputs")
    return kind, value
