"""The chat encodings against the formats' documented prompts, character for character and
token for token: DeepSeek V4's published examples (the README's quick start, the golden prompts
of its ``encoding/tests``, the encoder's documented rules) and Kimi K3's (its documented tool
prompt, whose SHA-256 is published with it, and its turn layout)."""

from __future__ import annotations

import hashlib
from typing import Any

import pytest

from sglang.srt.chat.deepseek_v4 import DeepseekV4Encoding
from sglang.srt.chat.encoding import ChatEncodingError, ChatOptions, ToolChoice
from sglang.srt.chat.jinja_template import JinjaEncoding
from sglang.srt.chat.kimi_k3 import KimiK3Encoding
from sglang.srt.chat.messages import check_tools, normalize_messages, parse_tool_choice
from sglang.srt.chat.registry import resolve_chat_encoding
from sglang.srt.default_model.tokenizer import build_tokenizer, tokenizer_config
from sglang.srt.managers.tokenizer import TextTokenizer
from sglang.test.ci_register import register_cpu_ci
from sglang.test.run import run_this_file

register_cpu_ci(est_time=4)

BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
USER, ASSISTANT = "<｜User｜>", "<｜Assistant｜>"
SYSTEM = {"role": "system", "content": "You are a helpful assistant."}
WEATHER_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Get the weather for a specific location",
            "parameters": {
                "type": "object",
                "properties": {
                    "location": {"type": "string", "description": "The city name"},
                    "unit": {
                        "type": "string",
                        "enum": ["celsius", "fahrenheit"],
                        "description": "Temperature unit",
                    },
                },
                "required": ["location"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "search",
            "description": "Search the web for information",
            "parameters": {
                "type": "object",
                "properties": {
                    "query": {"type": "string", "description": "Search query"},
                    "num_results": {
                        "type": "integer",
                        "description": "Number of results to return",
                    },
                },
                "required": ["query"],
            },
        },
    },
]


def dsv4(messages: list[dict[str, Any]], **options: Any) -> str:
    return DeepseekV4Encoding().render(normalize_messages(messages), ChatOptions(**options)).text


# --- DeepSeek V4 ---------------------------------------------------------------------------------


def test_dsv4_readme_quick_start() -> None:
    msgs = [SYSTEM, {"role": "user", "content": "What is 2+2?"}]
    want = f"{BOS}You are a helpful assistant.{USER}What is 2+2?{ASSISTANT}<think>"
    assert dsv4(msgs, thinking=True) == want
    chat = dsv4(msgs)  # thinking is off by default: the reasoning is closed at once
    assert chat == f"{BOS}You are a helpful assistant.{USER}What is 2+2?{ASSISTANT}</think>"


def test_dsv4_golden_thinking_with_tools_and_results() -> None:
    """``encoding/tests/test_output_1.txt``: tools in the system turn, a DSML call after the
    reasoning, the result merged into the next user turn, the reasoning of every turn kept
    (tools are declared)."""
    msgs = [
        SYSTEM,
        {"role": "user", "content": "What's the weather in Beijing?"},
        {
            "role": "assistant",
            "content": "",
            "reasoning_content": "The user wants to know the weather in Beijing. I should use "
            "the get_weather tool.",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {
                        "name": "get_weather",
                        "arguments": '{"location": "Beijing", "unit": "celsius"}',
                    },
                }
            ],
        },
        {
            "role": "tool",
            "tool_call_id": "call_1",
            "content": '{"temperature": 22, "condition": "sunny", "humidity": 45}',
        },
        {
            "role": "assistant",
            "reasoning_content": "Got the weather data. Let me format a nice response.",
            "content": "The weather in Beijing is currently sunny with a temperature of 22°C and "
            "45% humidity.",
        },
    ]
    want = (
        f"{BOS}You are a helpful assistant.\n\n## Tools\n\n"
        "You have access to a set of tools to help answer the user's question. You can invoke "
        'tools by writing a "<｜DSML｜tool_calls>" block like the following:\n\n'
        "<｜DSML｜tool_calls>\n"
        '<｜DSML｜invoke name="$TOOL_NAME">\n'
        '<｜DSML｜parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE'
        "</｜DSML｜parameter>\n...\n</｜DSML｜invoke>\n"
        '<｜DSML｜invoke name="$TOOL_NAME2">\n...\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>\n\n'
        'String parameters should be specified as is and set `string="true"`. For all other '
        "types (numbers, booleans, arrays, objects), pass the value in JSON format and set "
        '`string="false"`.\n\n'
        "If thinking_mode is enabled (triggered by <think>), you MUST output your complete "
        "reasoning inside <think>...</think> BEFORE any tool calls or final response.\n\n"
        "Otherwise, output directly after </think> with tool calls or final response.\n\n"
        "### Available Tool Schemas\n\n"
        '{"name": "get_weather", "description": "Get the weather for a specific location", '
        '"parameters": {"type": "object", "properties": {"location": {"type": "string", '
        '"description": "The city name"}, "unit": {"type": "string", "enum": ["celsius", '
        '"fahrenheit"], "description": "Temperature unit"}}, "required": ["location"]}}\n'
        '{"name": "search", "description": "Search the web for information", "parameters": '
        '{"type": "object", "properties": {"query": {"type": "string", "description": "Search '
        'query"}, "num_results": {"type": "integer", "description": "Number of results to '
        'return"}}, "required": ["query"]}}\n\n'
        "You MUST strictly follow the above defined tool name and parameter schemas to invoke "
        "tool calls.\n"
        f"{USER}What's the weather in Beijing?{ASSISTANT}"
        "<think>The user wants to know the weather in Beijing. I should use the get_weather "
        "tool.</think>\n\n<｜DSML｜tool_calls>\n"
        '<｜DSML｜invoke name="get_weather">\n'
        '<｜DSML｜parameter name="location" string="true">Beijing</｜DSML｜parameter>\n'
        '<｜DSML｜parameter name="unit" string="true">celsius</｜DSML｜parameter>\n'
        f"</｜DSML｜invoke>\n</｜DSML｜tool_calls>{EOS}"
        f'{USER}<tool_result>{{"temperature": 22, "condition": "sunny", "humidity": 45}}'
        f"</tool_result>{ASSISTANT}"
        "<think>Got the weather data. Let me format a nice response.</think>"
        f"The weather in Beijing is currently sunny with a temperature of 22°C and 45% "
        f"humidity.{EOS}"
    )
    assert dsv4(msgs, tools=check_tools(WEATHER_TOOLS), thinking=True) == want


def test_dsv4_golden_drops_earlier_reasoning() -> None:
    """``encoding/tests/test_output_2.txt``: without tools, the reasoning of turns before the
    last user turn is dropped."""
    msgs = [
        SYSTEM,
        {"role": "user", "content": "Hello"},
        {
            "role": "assistant",
            "content": "Hi there! How can I help you?",
            "reasoning_content": "The user said hello, I should greet back.",
        },
        {"role": "user", "content": "What is the capital of France?"},
        {
            "role": "assistant",
            "content": "The capital of France is Paris.",
            "reasoning_content": "The user asks about the capital of France. It is Paris.",
        },
    ]
    want = (
        f"{BOS}You are a helpful assistant.{USER}Hello{ASSISTANT}</think>Hi there! How can I "
        f"help you?{EOS}{USER}What is the capital of France?{ASSISTANT}<think>The user asks "
        f"about the capital of France. It is Paris.</think>The capital of France is Paris.{EOS}"
    )
    assert dsv4(msgs, thinking=True) == want


THREE_TURNS = [
    SYSTEM,
    {"role": "user", "content": "One"},
    {"role": "assistant", "content": "First answer.", "reasoning_content": "First reasoning."},
    {"role": "user", "content": "Two"},
    {"role": "assistant", "content": "Second answer.", "reasoning_content": "Second reasoning."},
    {"role": "user", "content": "Three"},
]


@pytest.mark.parametrize(
    ("options", "want"),
    [
        (
            {"thinking": True},
            (
                f"{BOS}You are a helpful assistant.{USER}One{ASSISTANT}</think>First answer.{EOS}"
                f"{USER}Two{ASSISTANT}</think>Second answer.{EOS}{USER}Three{ASSISTANT}<think>"
            ),
        ),
        (
            {"thinking": True, "template_kwargs": {"drop_thinking": False}},
            (
                f"{BOS}You are a helpful assistant.{USER}One{ASSISTANT}<think>First reasoning."
                f"</think>First answer.{EOS}{USER}Two{ASSISTANT}<think>Second reasoning.</think>"
                f"Second answer.{EOS}{USER}Three{ASSISTANT}<think>"
            ),
        ),
        (
            {},
            (
                f"{BOS}You are a helpful assistant.{USER}One{ASSISTANT}</think>First answer.{EOS}"
                f"{USER}Two{ASSISTANT}</think>Second answer.{EOS}{USER}Three{ASSISTANT}</think>"
            ),
        ),
    ],
    ids=["drop-earlier-reasoning", "keep-earlier-reasoning", "thinking-off"],
)
def test_dsv4_multi_turn_reasoning(options: dict[str, Any], want: str) -> None:
    assert dsv4(THREE_TURNS, **options) == want


def test_dsv4_reasoning_effort_and_switches() -> None:
    msgs = [SYSTEM, {"role": "user", "content": "Hello"}]
    preface = (
        "Reasoning Effort: Absolute maximum with no shortcuts permitted.\nYou MUST be very "
        "thorough in your thinking and comprehensively decompose the problem to resolve the root "
        "cause, rigorously stress-testing your logic against all potential paths, edge cases, and "
        "adversarial scenarios.\nExplicitly write out your entire deliberation process, "
        "documenting every intermediate step, considered alternative, and rejected hypothesis to "
        "ensure absolutely no assumption is left unchecked.\n\n"
    )
    tail = f"You are a helpful assistant.{USER}Hello{ASSISTANT}"
    assert dsv4(msgs, thinking=True, reasoning_effort="max") == f"{BOS}{preface}{tail}<think>"
    assert dsv4(msgs, thinking=True, reasoning_effort="high") == f"{BOS}{tail}<think>"
    assert dsv4(msgs, reasoning_effort="max") == f"{BOS}{tail}</think>"  # thinking off
    assert dsv4(msgs, thinking=True, reasoning_effort="none") == f"{BOS}{tail}</think>"
    on = {"template_kwargs": {"thinking": True}}
    assert dsv4(msgs, **on) == f"{BOS}{tail}<think>"


def test_dsv4_tool_results_follow_call_order_and_users_merge() -> None:
    calls = [
        {
            "id": "second",
            "type": "function",
            "function": {"name": "second_tool", "arguments": "{}"},
        },
        {"id": "first", "type": "function", "function": {"name": "first_tool", "arguments": "{}"}},
    ]
    msgs = [
        {"role": "assistant", "content": None, "tool_calls": calls},
        {"role": "tool", "tool_call_id": "first", "content": "first result"},
        {"role": "tool", "tool_call_id": "second", "content": "second result"},
    ]
    want = (
        f'{BOS}\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="second_tool">\n\n</｜DSML｜invoke>\n'
        '<｜DSML｜invoke name="first_tool">\n\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>'
        f"{EOS}{USER}<tool_result>second result</tool_result>\n\n"
        f"<tool_result>first result</tool_result>{ASSISTANT}</think>"
    )
    assert dsv4(msgs) == want
    users = [SYSTEM, {"role": "user", "content": "One"}, {"role": "user", "content": "Two"}]
    assert dsv4(users) == f"{BOS}You are a helpful assistant.{USER}One\n\nTwo{ASSISTANT}</think>"


def test_dsv4_arguments_and_continuation() -> None:
    call = {
        "id": "c",
        "type": "function",
        "function": {"name": "f", "arguments": {"n": 2, "tags": ["x"], "s": "a b"}},
    }
    msgs = [{"role": "user", "content": "go"}, {"role": "assistant", "tool_calls": [call]}]
    text = dsv4(msgs)
    assert '<｜DSML｜parameter name="n" string="false">2</｜DSML｜parameter>' in text
    assert '<｜DSML｜parameter name="tags" string="false">["x"]</｜DSML｜parameter>' in text
    assert '<｜DSML｜parameter name="s" string="true">a b</｜DSML｜parameter>' in text
    raw = {**call, "function": {"name": "f", "arguments": "not json"}}
    text = dsv4([{"role": "user", "content": "go"}, {"role": "assistant", "tool_calls": [raw]}])
    assert 'name="arguments" string="true">not json<' in text  # passed as one string parameter
    partial = [{"role": "user", "content": "write"}, {"role": "assistant", "content": "partial"}]
    assert dsv4(partial, continue_final_message=True) == (
        f"{BOS}{USER}write{ASSISTANT}</think>partial"
    )
    assert dsv4(partial).endswith(f"partial{EOS}")


def test_dsv4_response_format_and_tool_choice_none() -> None:
    rf = {"type": "json_object"}
    text = dsv4([{"role": "user", "content": "x"}], response_format=rf)
    want_system = (
        "\n\n## Response Format:\n\nYou MUST strictly adhere to the following schema to reply:\n"
        '{"type": "json_object"}'
    )
    assert text == f"{BOS}{want_system}{USER}x{ASSISTANT}</think>"
    none = ToolChoice("none")
    plain = dsv4(
        [{"role": "user", "content": "x"}], tools=check_tools(WEATHER_TOOLS), tool_choice=none
    )
    assert "## Tools" not in plain  # tools that may not be called are not offered


def test_dsv4_prompt_tokens_markers_are_single_tokens() -> None:
    """Token for token on the built-in model's tokenizer (DeepSeek V4's markers): every marker of
    the prompt is one token, and the text between markers tokenizes as plain text."""
    tok = TextTokenizer(build_tokenizer(), tokenizer_config())
    prompt = DeepseekV4Encoding().render(
        normalize_messages([SYSTEM, {"role": "user", "content": "What is 2+2?"}]),
        ChatOptions(thinking=True),
    )
    ids = tok.encode_segments(prompt.segments)
    markers = [BOS, USER, ASSISTANT, "<think>"]
    want: list[int] = []
    rest = prompt.text
    for marker in markers:
        before, rest = rest.split(marker, 1)
        want += tok.encode(before, add_special_tokens=False) if before else []
        marker_id = tok.token_id(marker)
        assert marker_id is not None, marker
        want.append(marker_id)
    assert rest == "" and ids == want


# --- Kimi K3 -------------------------------------------------------------------------------------

K3_TOOL_PROMPT = (
    '<|open|>message role="system" type="tool-declare"<|sep|># Tools\n'
    "Here are the available tools, described in JSONSchema.\n\n```json\n"
    '[{"function":{"description":"Get current weather for a location",'
    '"name":"get_weather","parameters":{"properties":{"location":'
    '{"description":"City name","type":"string"}},"required":["location"],'
    '"type":"object"}},"type":"function"}]\n```<|close|>message<|sep|>'
    '<|end_of_msg|><|open|>message role="user"<|sep|>What\'s the weather in '
    "San Francisco?<|close|>message<|sep|><|end_of_msg|><|open|>message "
    'role="system" type="tool-choice"<|sep|>The system is invoked with '
    "`tool_choice=required`.\nYou MUST call tools in the next message.<|close|>"
    'message<|sep|><|end_of_msg|><|open|>message role="assistant"<|sep|>'
    "<|open|>response<|sep|>"
)
K3_TOOL_PROMPT_SHA256 = "fa05c4fc98a796f387838fdef2aef89aaa5805ca2bbb1c7101ed428f80439d14"
K3_EFFORT = (
    '<|open|>message role="system" type="thinking-effort"<|sep|>'
    "`thinking_effort` guides on how much to think in your thinking channel (not including the "
    "response channel), supported values include `low`, `medium`, `high`, and `max`.\n"
    "Now the system is invoked with `thinking_effort=max`.<|close|>message<|sep|><|end_of_msg|>"
)


def k3(messages: list[dict[str, Any]], **options: Any) -> str:
    return KimiK3Encoding().render(normalize_messages(messages), ChatOptions(**options)).text


def test_k3_documented_tool_prompt() -> None:
    tools = check_tools(
        [
            {
                "type": "function",
                "function": {
                    "name": "get_weather",
                    "description": "Get current weather for a location",
                    "parameters": {
                        "type": "object",
                        "properties": {"location": {"type": "string", "description": "City name"}},
                        "required": ["location"],
                    },
                },
            }
        ]
    )
    msgs = [{"role": "user", "content": "What's the weather in San Francisco?"}]
    choice = parse_tool_choice("required", tools)
    text = k3(msgs, tools=tools, tool_choice=choice, thinking=False)
    assert text == K3_TOOL_PROMPT
    assert hashlib.sha256(text.encode()).hexdigest() == K3_TOOL_PROMPT_SHA256


def test_k3_thinking_effort_and_turns() -> None:
    msgs = [{"role": "system", "content": "Be concise."}, {"role": "user", "content": "hello"}]
    want = (
        K3_EFFORT + '<|open|>message role="system"<|sep|>Be concise.<|close|>message<|sep|>'
        '<|end_of_msg|><|open|>message role="user"<|sep|>hello<|close|>message<|sep|>'
        '<|end_of_msg|><|open|>message role="assistant"<|sep|><|open|>think<|sep|>'
    )
    assert k3(msgs) == want  # thinking on, effort max: the render program's defaults
    assert k3(msgs, reasoning_effort="low").startswith(K3_EFFORT.replace("=max", "=low"))
    off = k3(msgs, template_kwargs={"thinking": False})
    assert not off.startswith(K3_EFFORT) and off.endswith("<|open|>response<|sep|>")
    with pytest.raises(ChatEncodingError, match="thinking_effort"):
        k3(msgs, template_kwargs={"thinking_effort": "medium"})


def test_k3_assistant_turns_keep_reasoning_and_calls() -> None:
    call = {
        "id": "call_a",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 2}'},
    }
    msgs = [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "", "reasoning_content": "why", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_a", "content": "sunny"},
    ]
    text = k3(msgs, template_kwargs={"thinking_effort": None})
    assert text == (
        '<|open|>message role="user"<|sep|>Weather?<|close|>message<|sep|><|end_of_msg|>'
        '<|open|>message role="assistant"<|sep|><|open|>think<|sep|>why<|close|>think<|sep|>'
        "<|open|>response<|sep|><|close|>response<|sep|><|open|>tools<|sep|>"
        '<|open|>call tool="get_weather" index="1"<|sep|>'
        '<|open|>argument key="city" type="string"<|sep|>Paris<|close|>argument<|sep|>'
        '<|open|>argument key="days" type="number"<|sep|>2<|close|>argument<|sep|>'
        "<|close|>call<|sep|><|close|>tools<|sep|><|close|>message<|sep|><|end_of_msg|>"
        '<|open|>message role="tool" tool="get_weather" index="1"<|sep|>sunny<|close|>message'
        '<|sep|><|end_of_msg|><|open|>message role="assistant"<|sep|><|open|>think<|sep|>'
    )
    orphan = [{"role": "user", "content": "x"}, {"role": "tool", "content": "?"}]
    with pytest.raises(ChatEncodingError, match="name of its tool"):
        k3(orphan)


def test_k3_segments_keep_client_text_out_of_the_markup() -> None:
    """Markers are control tokens; a literal ``<|open|>`` a client writes stays text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    specials = ["<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>"]
    raw = Tokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    raw.train_from_iterator(["message role user assistant think response"], trainer=trainer)
    tok = TextTokenizer(raw, {})
    ids = {s: tok.token_id(s) for s in specials}
    prompt = KimiK3Encoding().render(
        normalize_messages([{"role": "user", "content": "say <|open|> please"}]),
        ChatOptions(template_kwargs={"thinking": False}),
    )
    got = tok.encode_segments(prompt.segments)
    controls = [i for i in got if i in ids.values()]
    # 2 per tag (open/sep or close/sep), 1 end per message: user + the assistant's opening.
    assert len(controls) == 2 + 2 + 1 + 2 + 2
    assert got.count(ids["<|open|>"]) == 3  # the user's literal one is text
    end_think = tok.encode_segments(
        KimiK3Encoding().render([], ChatOptions(template_kwargs={"thinking": True})).segments
    )
    think = tok.encode("think", add_special_tokens=False)
    assert end_think[-len(think) - 2 :] == [ids["<|open|>"], *think, ids["<|sep|>"]]


# --- selection -----------------------------------------------------------------------------------


def test_encoding_chosen_by_model_type_flag_or_template(tmp_path: Any) -> None:
    assert resolve_chat_encoding(None, "deepseek_v4", None).name == "deepseek-v4"
    assert resolve_chat_encoding(None, "kimi_k3", "{{ 'x' }}").name == "kimi-k3"
    assert resolve_chat_encoding("kimi-k3", "deepseek_v4", None).name == "kimi-k3"
    own = resolve_chat_encoding(None, "llama", "{{ messages[0]['content'] }}!")
    assert isinstance(own, JinjaEncoding)
    assert own.render([{"role": "user", "content": "hi"}], ChatOptions()).text == "hi!"
    path = tmp_path / "t.jinja"
    path.write_text("{% for m in messages %}[{{ m['role'] }}]{% endfor %}{{ extra }}")
    flagged = resolve_chat_encoding(str(path), "deepseek_v4", None)
    opts = ChatOptions(template_kwargs={"extra": "E"})
    assert flagged.render([{"role": "user", "content": "x"}], opts).text == "[user]E"


def test_tools_and_tool_choice_are_checked() -> None:
    with pytest.raises(ChatEncodingError, match="twice"):
        check_tools([WEATHER_TOOLS[0], WEATHER_TOOLS[0]])
    with pytest.raises(ChatEncodingError, match="name"):
        check_tools([{"type": "function", "function": {"name": "bad name!"}}])
    with pytest.raises(ChatEncodingError, match="not among the tools"):
        parse_tool_choice({"type": "function", "function": {"name": "nope"}}, WEATHER_TOOLS)
    with pytest.raises(ChatEncodingError, match="needs tools"):
        parse_tool_choice("required", [])
    assert parse_tool_choice(None, WEATHER_TOOLS) == ToolChoice("auto")
    assert parse_tool_choice(None, []) == ToolChoice("none")


if __name__ == "__main__":
    run_this_file(__file__)
