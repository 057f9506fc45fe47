"""The typed environment registry: defaults, parsing, overrides and named errors."""

from __future__ import annotations

import os

import pytest

from sglang.srt.environ import EnvBool, EnvFloat, EnvInt, Envs, EnvStr, EnvValueError, envs
from sglang.test.ci_register import register_cpu_ci
from sglang.test.run import run_this_file

register_cpu_ci(est_time=2)

RESERVED = "SGLANG_OPT_DEEPGEMM_MEGA_MOE_RESERVED_SMS"


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in Envs.fields():
        monkeypatch.delenv(name, raising=False)


def test_defaults() -> None:
    assert envs.SGLANG_OPT_DEEPGEMM_MEGA_MOE_RESERVED_SMS.get() == 2
    assert envs.SGLANG_OPT_DEEPGEMM_MEGA_MOE_NUM_MAX_TOKENS_PER_RANK.get() == 8192
    assert not envs.SGLANG_OPT_DEEPGEMM_MEGA_MOE_RESERVED_SMS.is_set()


def test_reads_environment_each_time(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(RESERVED, "8")
    assert envs.SGLANG_OPT_DEEPGEMM_MEGA_MOE_RESERVED_SMS.get() == 8
    monkeypatch.setenv(RESERVED, " 0 ")
    assert envs.SGLANG_OPT_DEEPGEMM_MEGA_MOE_RESERVED_SMS.get() == 0


@pytest.mark.parametrize("raw", ["abc", "-3", "1.5", "", "2x"])
def test_bad_reserved_sms_names_variable_value_and_accepted(
    monkeypatch: pytest.MonkeyPatch, raw: str
) -> None:
    monkeypatch.setenv(RESERVED, raw)
    with pytest.raises(EnvValueError) as info:
        envs.SGLANG_OPT_DEEPGEMM_MEGA_MOE_RESERVED_SMS.get()
    message = str(info.value)
    assert RESERVED in message
    assert repr(raw) in message
    assert "integer >= 0" in message


def test_set_clear_is_set_and_validation_on_set() -> None:
    field = envs.SGLANG_OPT_DEEPGEMM_MEGA_MOE_RESERVED_SMS
    field.set(4)
    assert field.is_set() and field.get() == 4 and os.environ[RESERVED] == "4"
    with pytest.raises(EnvValueError):
        field.set(-1)
    assert field.get() == 4, "a rejected set must leave the old value"
    field.clear()
    assert not field.is_set() and field.get() == 2


def test_override_restores_previous_value_even_on_error(monkeypatch: pytest.MonkeyPatch) -> None:
    field = envs.SGLANG_OPT_DEEPGEMM_MEGA_MOE_RESERVED_SMS
    monkeypatch.setenv(RESERVED, "6")
    with pytest.raises(RuntimeError), field.override(0):
        assert field.get() == 0
        raise RuntimeError("boom")
    assert os.environ[RESERVED] == "6"
    with field.override(None):
        assert not field.is_set()
    assert field.get() == 6
    monkeypatch.delenv(RESERVED)
    with field.override(3):
        assert field.get() == 3
    assert not field.is_set()


def test_other_field_types(monkeypatch: pytest.MonkeyPatch) -> None:
    class Local(Envs):
        SGLANG_TEST_FLAG = EnvBool(False)
        SGLANG_TEST_RATIO = EnvFloat(0.5, min_value=0.0)
        SGLANG_TEST_MODE = EnvStr("a", choices=("a", "b"))
        SGLANG_TEST_SMALL = EnvInt(1, min_value=1, max_value=4)

    for raw, want in [("1", True), ("TRUE", True), ("off", False), ("no", False)]:
        monkeypatch.setenv("SGLANG_TEST_FLAG", raw)
        assert Local.SGLANG_TEST_FLAG.get() is want
    monkeypatch.setenv("SGLANG_TEST_FLAG", "maybe")
    with pytest.raises(EnvValueError, match="SGLANG_TEST_FLAG='maybe'"):
        Local.SGLANG_TEST_FLAG.get()
    monkeypatch.setenv("SGLANG_TEST_RATIO", "0.25")
    assert Local.SGLANG_TEST_RATIO.get() == 0.25
    for bad in ("nan", "-1", "x"):
        monkeypatch.setenv("SGLANG_TEST_RATIO", bad)
        with pytest.raises(EnvValueError, match="SGLANG_TEST_RATIO"):
            Local.SGLANG_TEST_RATIO.get()
    monkeypatch.setenv("SGLANG_TEST_MODE", "c")
    with pytest.raises(EnvValueError, match="one of a, b"):
        Local.SGLANG_TEST_MODE.get()
    monkeypatch.setenv("SGLANG_TEST_SMALL", "5")
    with pytest.raises(EnvValueError, match=r"\[1, 4\]"):
        Local.SGLANG_TEST_SMALL.get()


def test_validate_all_reports_first_bad_knob(monkeypatch: pytest.MonkeyPatch) -> None:
    Envs.validate_all()
    monkeypatch.setenv("SGLANG_OPT_DEEPGEMM_MEGA_MOE_NUM_MAX_TOKENS_PER_RANK", "0")
    with pytest.raises(EnvValueError, match="NUM_MAX_TOKENS_PER_RANK='0'"):
        Envs.validate_all()


def test_no_module_reads_project_knobs_from_os_environ_directly() -> None:
    import pathlib
    import re

    root = pathlib.Path(__file__).resolve().parents[3] / "python" / "sglang"
    pattern = re.compile(r"os\.(environ|getenv)[^\n]*['\"]SGLANG_")
    offenders = [
        str(path.relative_to(root))
        for path in root.rglob("*.py")
        if path.name != "environ.py" and pattern.search(path.read_text())
    ]
    assert offenders == []


if __name__ == "__main__":
    run_this_file(__file__)
