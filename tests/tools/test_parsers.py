"""The tool-call parsers (hermes, qwen3_coder, llama3_json, mistral) on well-formed, malformed and multiple calls,
each on its own text form, and the choice of one from a chat template."""

import pytest

from arl.tools.parsers import HermesParser, LlamaJsonParser, MistralParser, Qwen3CoderParser, get_parser, parser_for_template

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
    with pytest.raises(KeyError, match=r"unknown tool-call parser 'xml'; registered tool-call parsers: \['hermes', "
                                       r"'llama3_json', 'mistral', 'qwen3', 'qwen3_coder'\]"):
        get_parser("xml")


def calls(parsed):
    return [(c.name, c.arguments) for c in parsed.calls]


@pytest.mark.parametrize("name", ["hermes", "qwen3", "qwen3_coder", "llama3_json", "mistral"])
def test_every_parser_reads_what_it_writes(name):
    p = get_parser(name)
    args = {"expression": "2+3", "n": 4, "flags": [True, None]}
    assert calls(p.parse(p.format_call("calculator", args))) == [("calculator", args)]
    plain = p.parse("The answer is 5.")
    assert plain.content == "The answer is 5." and not plain.attempted


def test_qwen3_coder_xml():
    p = Qwen3CoderParser()
    text = ("Let me check.\n<tool_call>\n<function=search>\n<parameter=query>\nasync RL\n</parameter>\n"
            "<parameter=limit>\n5\n</parameter>\n</function>\n</tool_call>")
    r = p.parse(text)
    assert calls(r) == [("search", {"query": "async RL", "limit": 5})] and r.content == "Let me check."
    bad = p.parse("<tool_call>{\"name\": \"f\"}</tool_call>")
    assert bad.errors and not bad.calls and "function=" in bad.errors[0]


def test_llama3_json_calls_tag_and_plain_json():
    p = LlamaJsonParser()
    r = p.parse('{"name": "get_weather", "parameters": {"city": "Paris"}}')
    assert calls(r) == [("get_weather", {"city": "Paris"})] and r.content == ""
    r = p.parse('<|python_tag|>{"name": "a", "parameters": {}}; {"name": "b", "parameters": {"x": 1}}')
    assert calls(r) == [("a", {}), ("b", {"x": 1})]
    assert p.parse('{"answer": 5}').content == '{"answer": 5}' and not p.parse('{"answer": 5}').attempted
    r = p.parse('<|python_tag|>{"name": "a", "parameters": {')
    assert r.errors and not r.calls
    r = p.parse('{"name": "a", "parameters": {}} {"name": ')  # one good call, then garbage
    assert calls(r) == [("a", {})] and len(r.errors) == 1


def test_mistral_v3_list_and_v11_forms():
    p = MistralParser()
    r = p.parse('Sure. [TOOL_CALLS][{"name": "a", "arguments": {"x": 1}}, {"name": "b", "arguments": "{}"}]')
    assert calls(r) == [("a", {"x": 1}), ("b", {})] and r.content == "Sure."
    r = p.parse('[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{}')
    assert calls(r) == [("get_weather", {"city": "Paris"}), ("get_time", {})]
    for bad in ('[TOOL_CALLS][{"name": "a", "arguments": ', "[TOOL_CALLS]get_weather", "[TOOL_CALLS]f[ARGS]{nope}"):
        r = p.parse(bad)
        assert r.errors and not r.calls, bad


class _Tok:
    def __init__(self, template):
        self.chat_template = template


def test_parser_for_template_reads_the_template_markers():
    assert parser_for_template(_Tok("{{ '[TOOL_CALLS]' + tools }}")) == "mistral"
    assert parser_for_template(_Tok("<tool_call>\n<function={{ name }}>")) == "qwen3_coder"
    assert parser_for_template(_Tok("<|start_header_id|>ipython<|end_header_id|>")) == "llama3_json"
    assert parser_for_template(_Tok("<tool_call>{{ tool_call | tojson }}</tool_call>")) == "hermes"
    assert parser_for_template(_Tok(None)) == "hermes"
    assert parser_for_template(_Tok({"default": "x", "tool_use": "[TOOL_CALLS]"})) == "mistral"
