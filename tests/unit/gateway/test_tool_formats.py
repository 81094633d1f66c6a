"""Tool-call formats without a model: each parser on hand-written outputs, whole and streamed
in pieces split at every character boundary; the grammars checked against outputs through
llguidance with SmolLM2's tokenizer; the format read off a chat template."""

from __future__ import annotations

import json
from typing import Any

import pytest

from gateway.tool_formats import FORMATS, _by_name, detect_format, tool_format
from gateway.tool_formats.base import CallParser, text_without
from gateway.tools import parse_tools
from llmserve.grammar.llguidance_backend import LLGuidanceBackend, check_grammar
from llmserve.limits import RequestLimits
from llmserve.tool_parsers import TOOL_FORMATS
from tests.support.templates import template_text

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time"}}

# (format, model output, expected content, expected calls as (name, arguments text)).
CASES: list[tuple[str, str, str, list[tuple[str, str]]]] = [
    (
        "hermes",
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris \\"centre\\""}}\n'
        "</tool_call>",
        "",
        [("get_weather", '{"city": "Paris \\"centre\\""}')],
    ),
    (
        "hermes",
        "Let me look.\n<tool_call>\n"
        '{"name": "get_weather", "arguments": {"city": "Lyon {x}"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>\n',
        "Let me look.",
        [("get_weather", '{"city": "Lyon {x}"}'), ("get_time", "{}")],
    ),
    (
        "hermes",  # compact JSON from a model without the grammar
        '<tool_call>{"name":"get_time","arguments":{"zone":"UTC"}}</tool_call>',
        "",
        [("get_time", '{"zone":"UTC"}')],
    ),
    ("hermes", "It is sunny, <tool> or not.\n", "It is sunny, <tool> or not.\n", []),
    (
        "hermes",  # a broken block is text
        "<tool_call>\nnot json\n</tool_call> done",
        "<tool_call>\nnot json\n</tool_call> done",
        [],
    ),
    ("hermes", '<tool_call>\n{"name": 5}', '<tool_call>\n{"name": 5}', []),
    ("hermes", "cut at <tool_ca", "cut at <tool_ca", []),
    (
        "hermes",  # a call that does not close: the rest is text
        '<tool_call>\n{"name": "get_time", "arguments": {}} oops',
        " oops",
        [("get_time", "{}")],
    ),
    (
        "llama3_json",
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Nice"}}',
        "",
        [("get_weather", '{"city": "Nice"}')],
    ),
    (
        "llama3_json",
        '{"name": "get_weather", "parameters": {"city": "a;b"}}; '
        '{"name": "get_time", "arguments": {"zone": "CET"}}',
        "",
        [("get_weather", '{"city": "a;b"}'), ("get_time", '{"zone": "CET"}')],
    ),
    ("llama3_json", "Hello {world}; bye", "Hello {world}; bye", []),
    ("llama3_json", '{"answer": 42}', '{"answer": 42}', []),
    ("llama3_json", "<|python_tag|>print(1)", "<|python_tag|>print(1)", []),
    (
        "llama3_json",
        '{"name": "get_time", "parameters": {}} and more',
        " and more",
        [("get_time", "{}")],
    ),
    (
        "generic",
        '{"tool_calls": [{"name": "get_time", "arguments": {"zone": "UTC"}}]}',
        "",
        [("get_time", '{"zone": "UTC"}')],
    ),
    ("generic", '{"content": "Hi \\u00e9 \\"you\\""}', 'Hi é "you"', []),
]


def run(parser: CallParser, pieces: list[str]) -> tuple[str, list[tuple[str, str]], list]:
    """Content, calls (name, arguments) and every delta, feeding `pieces` then finishing."""
    content, deltas = "", []
    for piece in pieces:
        text, more = parser.feed(piece)
        content += text
        deltas += more
    text, more = parser.finish()
    calls = [(c["function"]["name"], c["function"]["arguments"]) for c in parser.calls]
    return content + text, calls, deltas + more


def check_deltas(deltas: list, calls: list[tuple[str, str]]) -> None:
    """Each call's id, type and name once, first; then its arguments in fragments."""
    headers = [d for d in deltas if d.id is not None]
    assert [(d.index, d.name) for d in headers] == [(i, c[0]) for i, c in enumerate(calls)]
    assert all(d.id.startswith("call_") and d.arguments == "" for d in headers)
    for i, (_, arguments) in enumerate(calls):
        assert "".join(d.arguments for d in deltas if d.index == i) == arguments
        first = next(k for k, d in enumerate(deltas) if d.index == i)
        assert deltas[first].id is not None


@pytest.mark.parametrize(("name", "output", "content", "calls"), CASES)
def test_parser_whole_and_split_at_every_boundary(
    name: str, output: str, content: str, calls: list[tuple[str, str]]
) -> None:
    fmt = FORMATS[name]
    whole = run(fmt.parser(), [output])
    assert whole[:2] == (content, calls)
    check_deltas(whole[2], calls)
    for cut in range(1, len(output)):
        got = run(fmt.parser(), [output[:cut], output[cut:]])
        assert got[:2] == (content, calls), cut
        check_deltas(got[2], calls)
    by_char = run(fmt.parser(), list(output))
    assert by_char[:2] == (content, calls)
    check_deltas(by_char[2], calls)


def test_arguments_stream_before_the_call_ends() -> None:
    parser = FORMATS["hermes"].parser()
    _, deltas = parser.feed('Ok <tool_call>\n{"name": "get_weather", "arguments": {"ci')
    assert [(d.name, d.arguments) for d in deltas] == [("get_weather", ""), (None, '{"ci')]
    assert parser.feed('ty": "X"}}\n</tool_call>')[1][0].arguments == 'ty": "X"}'


def test_text_without_a_marker_matches_exactly_the_texts_without_it() -> None:
    import re

    marker = "<tool_call>"
    pattern = re.compile(text_without(marker), re.S)
    samples = [
        "",
        "plain",
        "<",
        "<tool_cal",
        "<<tool_call",
        "a<too<tool_",
        "<tool_call>",
        "x <tool_call> y",
        "<<tool_call>",
        "<tool_call<tool_call>",
        "\n<\n",
    ]
    for s in samples:
        assert (pattern.fullmatch(s) is not None) == (marker not in s), s


# -- grammars ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def backend(smollm2_tokenizer: Any) -> LLGuidanceBackend:
    return LLGuidanceBackend(smollm2_tokenizer)


def accepts(backend: LLGuidanceBackend, spec: Any, tokenizer: Any, text: str) -> bool:
    """Whether the grammar takes `text` whole and may end after it."""
    matcher = backend.compile(spec).matcher()
    for token in tokenizer.encode(text, add_special_tokens=False):
        if not matcher.accept(token):
            return False
    eos = tokenizer.eos_token_id
    return bool(matcher.bitmask()[eos // 8] >> (eos % 8) & 1)


def request(choice: Any, parallel: bool = True) -> Any:
    return parse_tools([WEATHER, TIME], choice, parallel, RequestLimits())


HERMES_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
HERMES_TIME = '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'


@pytest.mark.parametrize(
    ("choice", "parallel", "text", "ok"),
    [
        ("required", True, HERMES_CALL, True),
        ("required", True, HERMES_CALL + "\n" + HERMES_TIME, True),
        ("required", False, HERMES_CALL + "\n" + HERMES_TIME, False),
        ("required", True, "Sure. " + HERMES_CALL, False),
        ("required", True, HERMES_CALL.replace('"city": "Paris"', '"town": "Paris"'), False),
        ("required", True, HERMES_CALL.replace('", "', '","'), False),  # the fixed layout
        ({"type": "function", "function": {"name": "get_time"}}, True, HERMES_CALL, False),
        ({"type": "function", "function": {"name": "get_time"}}, True, HERMES_TIME, True),
        ("auto", True, "It is sunny.", True),
        ("auto", True, "Let me check.\n" + HERMES_CALL, True),
        ("auto", True, "text <tool_call> no call", False),
        ("auto", True, "Hm <tool_call>\n{}\n</tool_call>", False),
    ],
)
def test_hermes_grammar(
    backend: LLGuidanceBackend,
    smollm2_tokenizer: Any,
    choice: Any,
    parallel: bool,
    text: str,
    ok: bool,
) -> None:
    spec = FORMATS["hermes"].grammar(request(choice, parallel))
    check_grammar(spec)
    assert spec.field == "tools"
    assert accepts(backend, spec, smollm2_tokenizer, text) is ok


LLAMA_CALL = '{"name": "get_weather", "parameters": {"city": "Paris"}}'


@pytest.mark.parametrize(
    ("choice", "parallel", "text", "ok"),
    [
        ("required", True, LLAMA_CALL, True),
        ("required", True, LLAMA_CALL + '; {"name": "get_time", "parameters": {}}', True),
        ("required", False, LLAMA_CALL + '; {"name": "get_time", "parameters": {}}', False),
        ("required", True, LLAMA_CALL.replace("parameters", "arguments"), False),
        ("required", True, "Sure.", False),
        ("auto", True, "Sure, it is sunny.", True),
        ("auto", True, LLAMA_CALL, True),
        ("auto", True, '{"answer": 1}', False),
    ],
)
def test_llama3_json_grammar(
    backend: LLGuidanceBackend,
    smollm2_tokenizer: Any,
    choice: Any,
    parallel: bool,
    text: str,
    ok: bool,
) -> None:
    spec = FORMATS["llama3_json"].grammar(request(choice, parallel))
    check_grammar(spec)
    assert accepts(backend, spec, smollm2_tokenizer, text) is ok


# -- choosing the format ----------------------------------------------------------------------


def test_format_is_read_off_the_template(smollm2_tokenizer: Any) -> None:
    assert detect_format(template_text("hermes")) == "hermes"
    assert detect_format(template_text("llama3")) == "llama3_json"
    assert detect_format(smollm2_tokenizer.chat_template) == "generic"
    assert detect_format(None) == "generic"
    # Uses tools, but in no format known here: the generic one.
    assert detect_format("{% for t in tools %}{{ t | tojson }}{% endfor %}") == "generic"
    assert tool_format("generic", template_text("hermes")).name == "generic"
    assert tool_format("auto", template_text("llama3")).name == "llama3_json"


def test_a_bad_choice_names_the_flag(smollm2_tokenizer: Any) -> None:
    with pytest.raises(ValueError, match="^--tool-call-parser: must be one of auto, generic"):
        tool_format("mistral", None)
    with pytest.raises(ValueError, match="^--tool-call-parser: hermes needs a chat template"):
        tool_format("hermes", smollm2_tokenizer.chat_template)


def test_each_parser_name_of_llmserve_has_one_format_here() -> None:
    """llmserve.tool_parsers owns the names (so `llmserve up` checks the flag without
    importing the gateway); the gateway has exactly one format per name."""
    assert sorted(FORMATS) == sorted(TOOL_FORMATS)
    assert all(FORMATS[name].name == name for name in TOOL_FORMATS)
    with pytest.raises(RuntimeError, match="do not match"):
        _by_name(*(f for f in FORMATS.values() if f.name != "hermes"))
    with pytest.raises(RuntimeError, match="do not match"):
        _by_name(*FORMATS.values(), FORMATS["hermes"])


def test_the_gateway_flag_refuses_an_unknown_parser(capsys: pytest.CaptureFixture[str]) -> None:
    from gateway.__main__ import parse_args

    with pytest.raises(SystemExit) as exited:
        parse_args(["--tool-call-parser", "mistral"])
    assert exited.value.code == 2
    assert "--tool-call-parser: invalid choice: 'mistral'" in capsys.readouterr().err


def test_template_formats_hand_history_to_the_template() -> None:
    messages = [
        {"role": "user", "content": "Weather?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": "call_7",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Nice"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_7", "content": "20 C"},
    ]
    out, tools = FORMATS["hermes"].render(messages, request("auto"))
    assert out[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Nice"}
    assert out[1]["tool_calls"][0]["id"] == "call_7"
    assert out[2] == messages[2]
    assert tools is not None and [t["function"]["name"] for t in tools] == [
        "get_weather",
        "get_time",
    ]
    generic, none = FORMATS["generic"].render(messages, request("auto"))
    assert none is None and generic[0]["role"] == "system"
    assert json.loads(generic[2]["content"]) == {
        "tool_calls": [{"name": "get_weather", "arguments": {"city": "Nice"}}]
    }


def test_malformed_history_calls_name_the_field() -> None:
    from llmserve.errors import FieldError

    bad = [{"role": "assistant", "content": "", "tool_calls": [{"function": {"arguments": "{}"}}]}]
    for fmt in FORMATS.values():
        with pytest.raises(FieldError) as exc:
            fmt.render(bad, None)
        assert exc.value.field == "messages[0].tool_calls[0].function.name"
