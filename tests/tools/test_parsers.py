"""The hermes tool-call parser on well-formed, malformed and multiple calls."""

import pytest

from arl.tools.parsers import HermesParser, get_parser

P = HermesParser()


def test_well_formed_call_and_surrounding_text():
    r = P.parse('Let me compute. <tool_call>{"name": "calculator", "arguments": {"expression": "2+2"}}</tool_call>')
    assert [(c.name, c.arguments) for c in r.calls] == [("calculator", {"expression": "2+2"})]
    assert r.errors == [] and not r.unclosed and r.content == "Let me compute." and r.attempted


def test_arguments_as_json_string_and_whitespace():
    r = P.parse('<tool_call>\n{"name": "f", "arguments": "{\\"x\\": 1}"}\n</tool_call>')
    assert [(c.name, c.arguments) for c in r.calls] == [("f", {"x": 1})]
    r = P.parse('<tool_call>{"name": "f"}</tool_call>')
    assert r.calls[0].arguments == {}


def test_multiple_calls_in_order():
    r = P.parse('<tool_call>{"name": "a", "arguments": {}}</tool_call> and '
                '<tool_call>{"name": "b", "arguments": {"k": [1, 2]}}</tool_call> done')
    assert [c.name for c in r.calls] == ["a", "b"] and r.calls[1].arguments == {"k": [1, 2]}
    assert r.content == "and  done"


def test_malformed_calls_become_errors_not_exceptions():
    cases = {
        '<tool_call>{"name": "a", "arguments": {</tool_call>': "invalid JSON",
        '<tool_call>[1, 2]</tool_call>': "expected a JSON object",
        '<tool_call>{"arguments": {}}</tool_call>': "missing 'name'",
        '<tool_call>{"name": "a", "arguments": [1]}</tool_call>': "must be an object",
        '<tool_call>{"name": "a", "arguments": "not json"}</tool_call>': "not JSON",
        '</tool_call> 42': "stray",
    }
    for text, msg in cases.items():
        r = P.parse(text)
        assert r.calls == [] and len(r.errors) == 1 and msg in r.errors[0], (text, r.errors)
        assert r.attempted


def test_mixed_good_and_bad_and_unclosed():
    r = P.parse('<tool_call>{"name": "a"}</tool_call><tool_call>{bad}</tool_call><tool_call>{"name": "b"')
    assert [c.name for c in r.calls] == ["a"] and len(r.errors) == 2 and r.unclosed


def test_no_call_is_plain_content_and_bad_input_is_an_error():
    r = P.parse("The answer is 42.")
    assert r.calls == [] and r.errors == [] and not r.attempted and r.content == "The answer is 42."
    assert P.parse(None).errors  # type: ignore[arg-type]


def test_too_many_calls_are_capped():
    r = HermesParser(max_calls=2).parse('<tool_call>{"name": "a"}</tool_call>' * 5)
    assert len(r.calls) == 2 and "too many" in r.errors[0]


def test_format_call_round_trips_and_registry():
    text = P.format_call("calculator", {"expression": "1+2"})
    assert P.parse(text).calls[0].arguments == {"expression": "1+2"}
    assert isinstance(get_parser("hermes"), HermesParser)
    with pytest.raises(KeyError, match=r"unknown tool-call parser 'xml'; registered tool-call parsers: \['hermes'\]"):
        get_parser("xml")
