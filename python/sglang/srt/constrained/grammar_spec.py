"""What a request constrains its output to, checked before anything compiles.

Kinds: ``json_schema`` (a JSON schema text), ``json_object`` (any JSON object), ``regex``,
``ebnf`` (xgrammar's EBNF), each optionally wrapped in literal ``prefix`` / ``suffix`` text (a
chat format's content channel). Limits keep one request from tying up the compiler: the source's
size, a JSON schema's nesting depth, no recursive ``$ref`` (the grammar would be unbounded), and
a compile-time limit applied where the grammar compiles.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

GRAMMAR_KINDS = ("json_schema", "json_object", "regex", "ebnf")


class GrammarError(ValueError):
    """The grammar is invalid or over a limit (the client's error); the message says why."""


@dataclass(frozen=True)
class GrammarLimits:
    max_bytes: int = 64 * 1024
    max_depth: int = 32
    compile_timeout_s: float = 10.0
    # Whitespace characters JSON may hold in a row: unbounded whitespace lets a model loop on
    # spaces forever while the grammar stays satisfied.
    max_whitespace: int = 16


@dataclass(frozen=True)
class GrammarSpec:
    kind: str
    source: str = ""
    prefix: str = ""
    suffix: str = ""
    # Built by the server from parts checked on their own (a tool-call grammar from the tools'
    # schemas): its own size is not the client's to limit.
    generated: bool = False

    def __post_init__(self) -> None:
        if self.kind not in GRAMMAR_KINDS:
            raise GrammarError(f"unknown grammar kind {self.kind!r}; one of {GRAMMAR_KINDS}")

    @property
    def key(self) -> tuple[str, str, str, str]:
        """The cache key: the schema text (or pattern, or EBNF) and its wrapping."""
        return (self.kind, self.source, self.prefix, self.suffix)

    def describe(self) -> str:
        return f"{self.kind} ({len(self.source)} characters)"


def _depth_and_refs(schema: Any, max_depth: int) -> dict[str, set[str]]:
    """Walk the schema without recursion: raise past ``max_depth``; return, for the root ("#")
    and every definition ("#/$defs/name"), the local refs it holds."""
    refs: dict[str, set[str]] = {}
    stack: list[tuple[Any, int, str]] = [(schema, 1, "#")]
    while stack:
        node, depth, owner = stack.pop()
        if isinstance(node, dict | list) and depth > max_depth:
            raise GrammarError(
                f"the JSON schema nests deeper than {max_depth} levels; flatten it "
                "(SGLANG_GRAMMAR_MAX_DEPTH)"
            )
        if isinstance(node, dict):
            ref = node.get("$ref")
            if isinstance(ref, str):
                refs.setdefault(owner, set()).add(ref)
            for key, value in node.items():
                child_owner = owner
                if key in ("$defs", "definitions") and isinstance(value, dict) and depth == 1:
                    for name, sub in value.items():
                        stack.append((sub, depth + 2, f"#/{key}/{name}"))
                    continue
                stack.append((value, depth + 1, child_owner))
        elif isinstance(node, list):
            stack.extend((v, depth + 1, owner) for v in node)
    return refs


def _find_cycle(refs: dict[str, set[str]]) -> list[str] | None:
    """A ``$ref`` cycle reachable from the root, as the path that closes it (iterative: a long
    chain of definitions must not exhaust the interpreter's stack)."""

    def targets(node: str) -> list[str]:
        return sorted(r.split("/properties")[0] for r in refs.get(node, ()) if r.startswith("#"))

    state: dict[str, int] = {"#": 1}  # 1: on the path, 2: done
    path = ["#"]
    stack = [iter(targets("#"))]
    while stack:
        nxt = next(stack[-1], None)
        if nxt is None:
            state[path.pop()] = 2
            stack.pop()
        elif state.get(nxt) == 1:
            return [*path[path.index(nxt) :], nxt]
        elif nxt not in state:
            state[nxt] = 1
            path.append(nxt)
            stack.append(iter(targets(nxt)))
    return None


def check_spec(spec: GrammarSpec, limits: GrammarLimits) -> None:
    """Raise :class:`GrammarError` naming what is wrong or over a limit (no compilation)."""
    size = len(spec.source.encode()) + len(spec.prefix.encode()) + len(spec.suffix.encode())
    if size > limits.max_bytes and not spec.generated:
        raise GrammarError(
            f"the {spec.kind} is {size} bytes, over the limit of {limits.max_bytes} "
            "(SGLANG_GRAMMAR_MAX_BYTES)"
        )
    if spec.kind != "json_schema":
        return
    try:
        schema = json.loads(spec.source)
    except json.JSONDecodeError as exc:
        raise GrammarError(f"the JSON schema is not valid JSON: {exc}") from None
    if not isinstance(schema, dict | bool):
        raise GrammarError("the JSON schema must be an object (or true/false)")
    cycle = _find_cycle(_depth_and_refs(schema, limits.max_depth))
    if cycle is not None:
        raise GrammarError(
            "recursive JSON schemas are not supported (the output would have no bound): "
            + " -> ".join(cycle)
        )


def build_grammar(spec: GrammarSpec, limits: GrammarLimits) -> Any:
    """The xgrammar ``Grammar`` for ``spec`` (conversion only: no vocabulary, no compilation).
    Raises :class:`GrammarError` with xgrammar's reason for a bad schema, pattern or EBNF."""
    import xgrammar as xgr

    check_spec(spec, limits)
    try:
        if spec.kind == "json_schema":
            grammar = xgr.Grammar.from_json_schema(
                spec.source, any_whitespace=True, max_whitespace_cnt=limits.max_whitespace
            )
        elif spec.kind == "json_object":
            grammar = xgr.Grammar.from_json_schema(
                '{"type": "object"}', any_whitespace=True, max_whitespace_cnt=limits.max_whitespace
            )
        elif spec.kind == "regex":
            grammar = xgr.Grammar.from_regex(spec.source)
        else:
            grammar = xgr.Grammar.from_ebnf(spec.source)
        parts = [grammar]
        if spec.prefix:
            parts.insert(0, xgr.Grammar.from_ebnf(f"root ::= {_literal(spec.prefix)}"))
        if spec.suffix:
            parts.append(xgr.Grammar.from_ebnf(f"root ::= {_literal(spec.suffix)}"))
        return xgr.Grammar.concat(*parts) if len(parts) > 1 else grammar
    except (RuntimeError, ValueError, TypeError) as exc:
        reason = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
        raise GrammarError(f"invalid {spec.kind}: {_strip_location(reason)}") from None


def _literal(text: str) -> str:
    escaped = text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    return '"' + escaped.replace("\r", "\\r").replace("\t", "\\t") + '"'


def _strip_location(reason: str) -> str:
    # xgrammar prefixes "[10:20:34] /project/cpp/json_schema_converter.cc:5082: ".
    if reason.startswith("[") and "] " in reason:
        reason = reason.split("] ", 1)[1]
        if ".cc:" in reason.split(" ", 1)[0]:
            reason = reason.split(": ", 1)[-1]
    return reason
