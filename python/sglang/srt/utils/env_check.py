"""Every SGLANG_* variable checked at once, with the messages ``python -m sglang.check_env`` prints:
a bad value of a known knob names the variable, the value and what is accepted; an SGLANG_*
variable no knob reads (usually a typo) is named too, so that it is not silently ignored."""

from __future__ import annotations

import difflib
import os

from sglang.srt.environ import Envs, EnvValueError

PREFIX = "SGLANG_"


def env_errors() -> list[str]:
    """One message per knob whose value does not parse (empty when all are good)."""
    errors = []
    for field in Envs.fields().values():
        try:
            field.get()
        except EnvValueError as exc:
            errors.append(str(exc))
    return errors


def unknown_env_vars() -> list[str]:
    """One message per set SGLANG_* variable that is not a knob, with the closest knob name."""
    known = set(Envs.fields())
    out = []
    for name in sorted(os.environ):
        if name.startswith(PREFIX) and name not in known:
            close = difflib.get_close_matches(name, known, n=1)
            hint = f" (did you mean {close[0]}?)" if close else ""
            out.append(f"{name} is set but no SGLANG_* knob has that name{hint}")
    return out
