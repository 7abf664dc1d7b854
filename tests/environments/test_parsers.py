import pytest

from rlactors.environments.parsers import PARSERS, parser_for
from rlactors.environments.protocol import ToolCall


def test_hermes_several_calls_and_text_outside():
    text = ('Let me compute.\n<tool_call>\n{"name": "calc", "arguments": {"expression": "2+2"}}\n</tool_call>\n'
            'and\n<tool_call>\n{"name": "python", "arguments": "{\\"code\\": \\"print(1)\\"}"}\n</tool_call>')
    parser = parser_for("hermes")
    assert parser.stop == []
    assert parser.parse(text) == [ToolCall("calc", {"expression": "2+2"}), ToolCall("python", {"code": "print(1)"})]


def test_hermes_malformed_and_unclosed():
    parser = parser_for("hermes")
    [call] = parser.parse('<tool_call>\n{"name": "calc", "arguments": {"expression": }\n</tool_call>')
    assert call.name == "" and "not valid JSON" in call.error
    [call] = parser.parse('<tool_call>["calc"]</tool_call>')
    assert call.name == "" and '"name"' in call.error
    [call] = parser.parse('<tool_call>{"name": "calc", "arguments": "{oops"}</tool_call>')
    assert call.name == "calc" and "arguments are not valid JSON" in call.error
    [call] = parser.parse('<tool_call>{"name": "calc", "arguments": [1]}</tool_call>')
    assert "must be a JSON object" in call.error
    assert parser.parse('<tool_call>\n{"name": "calc", "arguments": {}}') == []  # cut by the token budget
    assert parser.parse('<tool_call>{"name": "calc"}</tool_call>') == [ToolCall("calc", {})]


def test_plain():
    parser = parser_for("plain")
    assert parser.stop == ["]"]
    assert parser.parse("37*58=[calc 37*58]") == [ToolCall("calc", {"input": "37*58"})]
    assert parser.parse("[calc 1+1] then [python print(2)]") == [
        ToolCall("calc", {"input": "1+1"}), ToolCall("python", {"input": "print(2)"})]
    assert parser.parse("[calc]") == [ToolCall("calc", {"input": ""})]
    [call] = parser.parse("[ 37*58]")
    assert call.name == "" and "no tool name" in call.error
    assert parser.parse("[calc 37*5") == []  # unclosed: no call
    assert parser.parse("no calls here") == []


def test_parser_for_unknown_lists_names():
    with pytest.raises(ValueError, match="'xml'.*hermes, plain"):
        parser_for("xml")
    assert set(PARSERS) == {"hermes", "plain"}
    assert parser_for("plain").stop is not parser_for("plain").stop
