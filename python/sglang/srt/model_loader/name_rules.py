"""Rules on checkpoint and parameter names: regex patterns compiled once, each with a value (a
replacement or a label). A model's checkpoint file rewrites names through them in order
(:func:`rename`); the resident-weights report labels a name by the first that occurs in it
(:func:`first_match`)."""

from __future__ import annotations

import re

NameRules = tuple[tuple[re.Pattern[str], str], ...]


def name_rules(*rules: tuple[str, str]) -> NameRules:
    """``(pattern, value)`` pairs, their patterns compiled."""
    return tuple((re.compile(pattern), value) for pattern, value in rules)


def rename(name: str, rules: NameRules) -> str:
    """``name`` through every rule in order, each substituting into the previous result."""
    for pattern, replacement in rules:
        name = pattern.sub(replacement, name)
    return name


def first_match(name: str, rules: NameRules, default: str) -> str:
    """The value of the first rule whose pattern occurs anywhere in ``name`` (else ``default``)."""
    for pattern, value in rules:
        if pattern.search(name):
            return value
    return default
