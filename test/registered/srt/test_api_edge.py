"""The API edge in isolation (no server): JSON limits, the strict request models, ``n`` expansion
and the SGLANG_* startup check."""

from __future__ import annotations

import json

import pytest

from sglang.srt.entrypoints.json_body import JSONBodyError, parse_json
from sglang.srt.entrypoints.protocol import ChatCompletionRequest, CompletionRequest
from sglang.srt.environ import envs
from sglang.srt.managers.prompts import build_requests
from sglang.srt.managers.tokenizer_manager import GenerateRequest, RequestError, expand_n
from sglang.srt.sampling.sampling_params import SamplingParams
from sglang.srt.utils.env_check import env_errors, unknown_env_vars
from sglang.test.ci_register import register_cpu_ci
from sglang.test.run import run_this_file

register_cpu_ci(est_time=3)


@pytest.mark.parametrize(
    ("raw", "needle"),
    [
        (b"[" * 100000, "deeper than the limit of 8"),
        (json.dumps({"a": [[[[[[[[[1]]]]]]]]]}).encode(), "at a"),
        (b'{"a": "ok \\ud800"}', "a is not valid Unicode"),
        (b'{"a": ["x", {"b": "\\udc00"}]}', "a[1].b"),
        (b'{"\\ud800": 1}', "a key in the body"),
        (b'{"a": 1', "not valid JSON"),
        (b"\xff", "not valid JSON"),
    ],
)
def test_parse_json_limits(raw: bytes, needle: str) -> None:
    with pytest.raises(JSONBodyError) as info:
        parse_json(raw, max_depth=8)
    assert needle in str(info.value)


def test_parse_json_accepts_good_bodies() -> None:
    body = {"prompt": "héllo 🙂", "ids": list(range(100000)), "nested": [[[1]]]}
    assert parse_json(json.dumps(body).encode(), max_depth=8) == body
    assert parse_json(json.dumps(body, ensure_ascii=False).encode(), max_depth=8) == body


def test_unsupported_parameters_are_named() -> None:
    chat = ChatCompletionRequest.model_validate(
        {
            "messages": [{"role": "user", "content": "x"}],
            "functions": [{"name": "f"}],
            "tools": [{"type": "function", "function": {"name": "f"}}],
            "tool_choice": "none",
            "response_format": {"type": "text"},
            "frob": 1,
            "zap": 2,
        }
    )
    problems = chat.unsupported()
    assert problems[0].startswith("functions") and "['frob', 'zap']" in problems[-1]
    assert not any(p.startswith(("tools", "tool_choice", "response_format")) for p in problems)
    assert CompletionRequest.model_validate({"prompt": "x", "best_of": 1}).unsupported() == []
    assert (
        "best_of"
        in CompletionRequest.model_validate({"prompt": "x", "best_of": 2}).unsupported()[0]
    )


def test_expand_n() -> None:
    req = GenerateRequest(text="x", sampling_params=SamplingParams(n=3, seed=2**64 - 2))
    seeds = [c.sampling_params.seed for c in expand_n(req)]
    assert seeds == [2**64 - 2, 2**64 - 1, 0]  # modulo 2**64, as torch reads seeds
    assert all(c.sampling_params.n == 1 for c in expand_n(req))
    unseeded = expand_n(GenerateRequest(text="x", sampling_params=SamplingParams(n=2)))
    assert [c.sampling_params.seed for c in unseeded] == [None, None]
    with pytest.raises(RequestError):
        expand_n(GenerateRequest(text="x", rid="a", sampling_params=SamplingParams(n=2)))


def test_build_requests_is_the_one_prompt_path() -> None:
    """Engine, /generate and the OpenAI routes share it: batches, n expansion, the choice cap."""
    built = build_requests(["a", "b"], None, {"n": 3, "seed": 5}, GenerateRequest(stream=False))
    assert built.batch and [len(g) for g in built.groups] == [3, 3]
    assert [r.text for r in built.requests] == ["a"] * 3 + ["b"] * 3
    assert [r.sampling_params.seed for r in built.groups[1]] == [5, 6, 7]
    one = build_requests(None, [1, 2], None)
    assert not one.batch and one.requests[0].input_ids == [1, 2]
    per_prompt = build_requests(None, [[1], [2]], [{"max_new_tokens": 1}, {"max_new_tokens": 2}])
    assert [r.sampling_params.max_new_tokens for r in per_prompt.requests] == [1, 2]
    with pytest.raises(RequestError, match="at most 1024"):
        build_requests(["x"] * 600, None, {"n": 2})  # the cap the offline Engine used to miss
    with pytest.raises(RequestError, match="rid"):
        build_requests(["x", "y"], None, None, GenerateRequest(rid="r"))
    with pytest.raises(RequestError, match="empty"):
        build_requests([], None, None)
    assert build_requests([], None, None, allow_empty=True).requests == []
    with pytest.raises(RequestError, match="2 sampling_params for 1 prompts"):
        build_requests("x", None, [{}, {}])


def test_env_check_names_every_bad_knob(monkeypatch: pytest.MonkeyPatch) -> None:
    assert env_errors() == [] or all("SGLANG_" in e for e in env_errors())
    monkeypatch.setenv("SGLANG_OPT_DEEPGEMM_MEGA_MOE_RESERVED_SMS", "1.5")
    monkeypatch.setenv("SGLANG_CPU_THREADS", "-2")
    errors = env_errors()
    assert "SGLANG_OPT_DEEPGEMM_MEGA_MOE_RESERVED_SMS='1.5' is invalid" in " ".join(errors)
    assert "SGLANG_CPU_THREADS='-2' is invalid" in " ".join(errors)
    monkeypatch.setenv("SGLANG_OPT_DEEPGEMM_MEGA_MOE_RESERVED_SM", "2")  # a typo
    assert any(
        "did you mean SGLANG_OPT_DEEPGEMM_MEGA_MOE_RESERVED_SMS" in m for m in unknown_env_vars()
    )
    from sglang.srt.server_args import ServerArgs, ServerArgsError

    with pytest.raises(ServerArgsError) as info:
        ServerArgs(device="cpu").resolved().validate()
    assert "SGLANG_CPU_THREADS='-2'" in str(info.value)
    assert envs.SGLANG_CPU_THREADS.name == "SGLANG_CPU_THREADS"


if __name__ == "__main__":
    run_this_file(__file__)
