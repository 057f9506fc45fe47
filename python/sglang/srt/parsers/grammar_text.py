"""Building tool-call grammars from pieces with xgrammar's ``Grammar`` API (literals, JSON
schemas, regexes, sequences and choices), then handing them on as EBNF text, which is what the
grammar cache keys on and compiles."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any


def _xgr() -> Any:
    import xgrammar

    return xgrammar


def ebnf_literal(text: str) -> str:
    escaped = (
        text.replace("\\", "\\\\")
        .replace('"', '\\"')
        .replace("\n", "\\n")
        .replace("\r", "\\r")
        .replace("\t", "\\t")
    )
    return f'"{escaped}"'


def literal(text: str) -> Any:
    return _xgr().Grammar.from_ebnf(f"root ::= {ebnf_literal(text)}")


def seq(*parts: Any) -> Any:
    return _xgr().Grammar.concat(*parts) if len(parts) > 1 else parts[0]


def choice(*parts: Any) -> Any:
    return _xgr().Grammar.union(*parts) if len(parts) > 1 else parts[0]


def optional(part: Any) -> Any:
    return choice(part, _xgr().Grammar.from_ebnf('root ::= ""'))


def repeat(part: Any, separator: str = "") -> Any:
    """``part (separator part)*``."""
    xgr = _xgr()
    # A rule that refers to itself cannot be built by concat/union: write its EBNF around the
    # part's own rules (renamed by a union with itself so that "root" is free).
    inner = str(xgr.Grammar.union(part, part))
    rules = inner.replace("root ::=", "repeated_item ::=", 1)
    sep = f" {ebnf_literal(separator)}" if separator else ""
    return xgr.Grammar.from_ebnf(f"root ::= repeated_item ({sep} repeated_item)*\n{rules}")


def json_value(schema: Mapping[str, Any] | bool) -> Any:
    """A compact JSON value matching ``schema``."""
    if schema is True or not schema:
        schema = {}
    return _xgr().Grammar.from_json_schema(json.dumps(schema), any_whitespace=False)


def regex(pattern: str) -> Any:
    return _xgr().Grammar.from_regex(pattern)


def raw_string(schema: Mapping[str, Any], stop_char: str = "<") -> Any:
    """A string argument written raw (not JSON-quoted) up to the markup that closes it: one of
    its ``enum`` values, its ``pattern``, or any text without ``stop_char`` (at most
    ``maxLength`` characters)."""
    enum = schema.get("enum")
    if isinstance(enum, list) and enum and all(isinstance(v, str) for v in enum):
        return choice(*(literal(v) for v in enum))
    if isinstance(schema.get("pattern"), str):
        return regex(schema["pattern"].removeprefix("^").removesuffix("$"))
    low = int(schema.get("minLength", 0) or 0)
    high = schema.get("maxLength")
    span = f"{{{low},{int(high)}}}" if isinstance(high, int) else f"{{{low},}}"
    return regex(f"[^{stop_char}]{span}")


def is_string_schema(schema: Any) -> bool:
    return isinstance(schema, Mapping) and schema.get("type") == "string"


def properties(parameters: Mapping[str, Any] | None) -> Sequence[tuple[str, Any, bool]]:
    """(name, schema, required) of a tool's parameters, in schema order."""
    if not isinstance(parameters, Mapping):
        return []
    props = parameters.get("properties")
    required = set(parameters.get("required") or [])
    if not isinstance(props, Mapping):
        return []
    return [(str(k), v, k in required) for k, v in props.items()]
