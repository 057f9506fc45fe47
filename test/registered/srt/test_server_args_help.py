"""``launch_server --help``: every option is listed, names its default in words (the parser's
value, or the help's own "Default: ..." where the default depends on the machine, the model or
other flags), and the help speaks of both models the engine serves."""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys

import pytest

from sglang.srt.server_args import ServerArgs, build_parser
from sglang.test.ci_register import register_cpu_ci
from sglang.test.run import run_this_file

register_cpu_ci(est_time=5)

# An option entry of argparse's help: two spaces, then its option strings.
_ENTRY = re.compile(r"^  (-[A-Za-z], )?--[a-z0-9-]+")
_DEFAULT = re.compile(r"\bDefault: \S|\(default: [^)]+\)")


def _entries(help_text: str) -> dict[str, str]:
    """Option (its first long spelling) -> its whole help entry, whitespace collapsed."""
    entries: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in help_text.splitlines():
        if _ENTRY.match(line):
            flag = re.search(r"--[a-z0-9-]+", line)
            assert flag is not None
            current = entries.setdefault(flag.group(0), [])
            current.append(line)
        elif current is not None and line.startswith("   "):
            current.append(line)
        else:
            current = None
    return {flag: " ".join(" ".join(lines).split()) for flag, lines in entries.items()}


@pytest.fixture(scope="module")
def help_text() -> str:
    return build_parser().format_help()


def test_every_server_arg_has_an_option(help_text: str) -> None:
    entries = _entries(help_text)
    missing = [
        f.name
        for f in dataclasses.fields(ServerArgs)
        if "--" + f.name.replace("_", "-") not in entries
    ]
    assert not missing, f"ServerArgs fields without a --flag in --help: {missing}"


def test_every_option_names_its_default(help_text: str) -> None:
    entries = _entries(help_text)
    assert len(entries) >= len(dataclasses.fields(ServerArgs))
    unnamed = [
        flag for flag, text in entries.items() if flag != "--help" and not _DEFAULT.search(text)
    ]
    assert not unnamed, f"options whose help names no default: {unnamed}"
    # A None default says nothing: such an option must state what it means in its own words.
    vague = [flag for flag, text in entries.items() if "(default: None)" in text]
    assert not vague, f"options whose default shows as None: {vague}"


def test_defaults_shown_are_the_parsers(help_text: str) -> None:
    entries = _entries(help_text)
    defaults = ServerArgs()
    assert "(default: 30000)" in entries["--port"]
    assert f"(default: {defaults.mem_fraction_static})" in entries["--mem-fraction-static"]
    assert "(default: off)" in entries["--enable-metrics"]
    assert "(default: none)" in entries["--moe-a2a-backend"]


def test_help_speaks_of_both_models(help_text: str) -> None:
    description = help_text.split("options:")[0]
    assert "DeepSeek V4" in description and "Kimi K3" in description
    entries = _entries(help_text)
    assert "Kimi K3" in entries["--model-path"]
    # Both models capture decode graphs; none of them "decodes eagerly" by default.
    graphs = entries["--disable-cuda-graph"]
    assert "DeepSeek V4 and Kimi K3" in graphs
    assert "Kimi K3, decode eagerly" not in graphs
    # megamoe names both kernels it may run.
    megamoe = entries["--moe-a2a-backend"]
    assert "DeepGEMM" in megamoe and "Triton" in megamoe


def test_metrics_flag_says_metrics_are_off_without_it(help_text: str) -> None:
    assert "/metrics" in _entries(help_text)["--enable-metrics"]


def test_cli_help_shows_defaults() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "sglang.launch_server", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    assert "(default: 30000)" in " ".join(out.split())
    assert "Kimi K3" in out


if __name__ == "__main__":
    run_this_file(__file__)
