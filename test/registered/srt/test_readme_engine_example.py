"""The README's offline-engine example, run verbatim as a script (the built-in default model, on
whatever device the machine has): it must exit 0 and print what the README says it prints."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from sglang.test.ci_register import register_cpu_ci
from sglang.test.run import run_this_file

register_cpu_ci(est_time=25)

README = Path(__file__).resolve().parents[3] / "README.md"


def engine_example() -> str:
    """The first ```python block of the README's "Offline engine" section, as written."""
    text = README.read_text(encoding="utf-8")
    _, sep, section = text.partition("### Offline engine")
    assert sep, "the README has no 'Offline engine' section"
    block = re.search(r"```python\n(.*?)```", section, re.DOTALL)
    assert block is not None, "the 'Offline engine' section has no python block"
    return block.group(1)


def test_example_uses_the_engine_on_the_default_model() -> None:
    code = engine_example()
    assert "from sglang import Engine" in code
    assert "model_path" not in code.replace("no model_path", "")  # the built-in default model
    assert 'if __name__ == "__main__":' in code  # the ranks are spawned processes


def test_readme_engine_example_runs_verbatim(tmp_path: Path) -> None:
    script = tmp_path / "engine_example.py"
    script.write_text(engine_example(), encoding="utf-8")
    out = subprocess.run(
        [sys.executable, str(script)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,  # a hang guard: the script takes ~10 s on 2 CPU cores
        check=False,
    )
    assert out.returncode == 0, out.stderr[-4000:]
    text = out.stdout
    assert re.search(r"^['\"].*['\"] \{'type': '(length|stop)'", text, re.MULTILINE), text
    assert re.search(r"^Hello, my name is -> ['\"]", text, re.MULTILINE), text
    assert re.search(r"^def main\(\): -> ['\"]", text, re.MULTILINE), text
    assert re.search(r"^streamed: ['\"].*['\"] \d+$", text, re.MULTILINE), text


if __name__ == "__main__":
    run_this_file(__file__)
