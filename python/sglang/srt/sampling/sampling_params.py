"""Per-request sampling parameters, parsed and validated from a JSON-like dict.

Names and defaults follow SGLang's ``sampling_params`` of ``/generate``. Parsing is strict: an
unknown key or a value of the wrong type or range raises :class:`SamplingParamsError` naming the
parameter, which the HTTP layer turns into a 400 response.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

# top_k of -1 or 0 means "no top-k"; stored as -1.
TOP_K_ALL = -1
# Bounds of what the engine can take: torch seeds are 64-bit (int64 or uint64 read modulo 2**64),
# token counts and ids fit int64; larger values used to crash the scheduler, not the request.
INT64_MAX = 2**63 - 1
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1
MAX_TEMPERATURE = 100.0  # beyond this the distribution is uniform to fp32 precision
MAX_TOP_K = 2**31 - 1
MAX_N = 128
LOGIT_BIAS_LIMIT = 100.0  # OpenAI's range for logit_bias values
# Stop conditions and biases are checked every step of the request; bound how many there are.
MAX_STOP_STRINGS, MAX_STOP_CHARS = 64, 1024
MAX_STOP_TOKEN_IDS = MAX_LOGIT_BIAS = 1024
GRAMMAR_PARAMS = ("json_schema", "regex", "ebnf")


class SamplingParamsError(ValueError):
    """A sampling parameter is unknown, of the wrong type, or out of range."""


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int | None = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = TOP_K_ALL
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    stop: tuple[str, ...] = field(default_factory=tuple)
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    seed: int | None = None
    n: int = 1
    # token id -> value added to its logit before sampling, as sorted (id, bias) pairs.
    logit_bias: tuple[tuple[int, float], ...] = field(default_factory=tuple)
    # Structured output (SGLang's names; at most one): a JSON schema (text, or an object that is
    # serialized), a regular expression, or an EBNF grammar the output must match.
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None
    # Reasoning tokens before the end-of-thinking marker is forced (thinking requests only).
    thinking_budget: int | None = None

    def __post_init__(self) -> None:
        _check_int("max_new_tokens", self.max_new_tokens, low=0, high=INT64_MAX, optional=True)
        _check_float("temperature", self.temperature, low=0.0, high=MAX_TEMPERATURE)
        _check_float("top_p", self.top_p, low=0.0, high=1.0, low_open=True)
        _check_int("top_k", self.top_k, high=MAX_TOP_K)
        if self.top_k < TOP_K_ALL:
            raise SamplingParamsError(
                f"top_k must be -1 or 0 (no top-k) or a positive integer, got {self.top_k}"
            )
        if self.top_k <= 0:
            object.__setattr__(self, "top_k", TOP_K_ALL)
        _check_float("min_p", self.min_p, low=0.0, high=1.0)
        _check_float(
            "repetition_penalty", self.repetition_penalty, low=0.0, high=2.0, low_open=True
        )
        _check_float("frequency_penalty", self.frequency_penalty, low=-2.0, high=2.0)
        _check_float("presence_penalty", self.presence_penalty, low=-2.0, high=2.0)
        stop = self.stop
        if isinstance(stop, str):
            stop = (stop,)
        if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) for s in stop):
            raise SamplingParamsError("stop must be a string or a list of strings")
        if any(s == "" for s in stop):
            raise SamplingParamsError("stop strings must not be empty")
        if len(stop) > MAX_STOP_STRINGS or any(len(s) > MAX_STOP_CHARS for s in stop):
            raise SamplingParamsError(
                f"stop takes at most {MAX_STOP_STRINGS} strings of at most {MAX_STOP_CHARS} "
                f"characters, got {len(stop)} (longest {max(len(s) for s in stop)})"
            )
        object.__setattr__(self, "stop", tuple(stop))
        ids = self.stop_token_ids
        if not isinstance(ids, (list, tuple)) or not all(
            _is_int(i) and 0 <= i <= INT64_MAX for i in ids
        ):
            raise SamplingParamsError("stop_token_ids must be a list of non-negative integers")
        if len(ids) > MAX_STOP_TOKEN_IDS:
            raise SamplingParamsError(
                f"stop_token_ids takes at most {MAX_STOP_TOKEN_IDS} ids, got {len(ids)}"
            )
        object.__setattr__(self, "stop_token_ids", tuple(int(i) for i in ids))
        for name in ("ignore_eos", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise SamplingParamsError(f"{name} must be a boolean")
        _check_int("seed", self.seed, low=SEED_MIN, high=SEED_MAX, optional=True)
        _check_int("n", self.n, low=1, high=MAX_N)
        object.__setattr__(self, "logit_bias", _parse_logit_bias(self.logit_bias))
        if isinstance(self.json_schema, dict | bool):
            object.__setattr__(self, "json_schema", json.dumps(self.json_schema))
        for name in GRAMMAR_PARAMS:
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise SamplingParamsError(f"{name} must be a string, got {_short(value)}")
        given = [name for name in GRAMMAR_PARAMS if getattr(self, name) is not None]
        if len(given) > 1:
            raise SamplingParamsError(f"give at most one of {list(GRAMMAR_PARAMS)}, got {given}")
        _check_int("thinking_budget", self.thinking_budget, low=0, high=INT64_MAX, optional=True)

    # --- derived -------------------------------------------------------------------------------

    @property
    def grammar_param(self) -> tuple[str, str] | None:
        """(name, value) of the structured-output parameter, if one is given."""
        for name in GRAMMAR_PARAMS:
            value = getattr(self, name)
            if value is not None:
                return name, value
        return None

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.frequency_penalty != 0.0
            or self.presence_penalty != 0.0
        )

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any] | None) -> SamplingParams:
        if raw is None:
            return cls()
        if not isinstance(raw, Mapping):
            raise SamplingParamsError("sampling_params must be a JSON object")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise SamplingParamsError(
                f"unknown sampling parameter(s) {unknown}; known: {sorted(known)}"
            )
        # JSON null means "the default" for every parameter but max_new_tokens (null: no limit).
        values = {k: v for k, v in raw.items() if v is not None or k == "max_new_tokens"}
        return cls(**values)

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _parse_logit_bias(raw: object) -> tuple[tuple[int, float], ...]:
    """``{"50256": -100}`` (JSON keys are strings) or pairs -> sorted ``((id, bias), ...)``."""
    if raw is None:
        return ()
    if isinstance(raw, Mapping):
        items = list(raw.items())
    elif isinstance(raw, (list, tuple)) and all(
        isinstance(p, (list, tuple)) and len(p) == 2 for p in raw
    ):
        items = [tuple(p) for p in raw]
    else:
        raise SamplingParamsError("logit_bias must map token ids to numbers")
    if len(items) > MAX_LOGIT_BIAS:
        raise SamplingParamsError(
            f"logit_bias takes at most {MAX_LOGIT_BIAS} entries, got {len(items)}"
        )
    out: dict[int, float] = {}
    for key, value in items:
        token = key
        if isinstance(key, str) and key.strip().isdigit():
            token = int(key.strip())
        if not _is_int(token) or not 0 <= token <= INT64_MAX:  # type: ignore[operator]
            raise SamplingParamsError(
                f"logit_bias keys must be token ids (non-negative integers), got {key!r}"
            )
        _check_float(f"logit_bias[{key!r}]", value, low=-LOGIT_BIAS_LIMIT, high=LOGIT_BIAS_LIMIT)
        out[int(token)] = float(value)  # type: ignore[arg-type]
    return tuple(sorted(out.items()))


def _check_int(
    name: str,
    v: object,
    *,
    low: int | None = None,
    high: int | None = None,
    optional: bool = False,
) -> None:
    if v is None and optional:
        return
    if not _is_int(v):
        raise SamplingParamsError(f"{name} must be an integer, got {_short(v)}")
    if low is not None and v < low:  # type: ignore[operator]
        raise SamplingParamsError(f"{name} must be >= {low}, got {_short(v)}")
    if high is not None and v > high:  # type: ignore[operator]
        raise SamplingParamsError(f"{name} must be <= {high}, got {_short(v)}")


def _short(v: object) -> str:
    """repr, cut: a 10**100000 in a request must not become a 100 kB error message."""
    text = repr(v) if not _is_int(v) or abs(v) < 10**30 else f"an integer of {len(str(v))} digits"  # type: ignore[arg-type]
    return text if len(text) <= 80 else text[:77] + "..."


def _check_float(
    name: str,
    v: object,
    *,
    low: float | None = None,
    high: float | None = None,
    low_open: bool = False,
) -> None:
    # An int too large for a float (10**400) is not finite either; float() would raise.
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not _finite(v):
        raise SamplingParamsError(f"{name} must be a finite number, got {_short(v)}")
    if low is not None and (v < low or (low_open and v == low)):
        bound = f"> {low}" if low_open else f">= {low}"
        raise SamplingParamsError(f"{name} must be {bound}, got {_short(v)}")
    if high is not None and v > high:
        raise SamplingParamsError(f"{name} must be <= {high}, got {_short(v)}")


def _finite(v: float) -> bool:
    try:
        return math.isfinite(v)
    except OverflowError:
        return False
