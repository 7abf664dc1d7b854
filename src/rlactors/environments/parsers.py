"""Tool-call parsers: how the rollout finds the tool calls in a model's turn.

A parser has `stop`, the strings that end a model turn at a tool call (passed to vLLM as stop
strings; the turn's tokens keep the stop string), and `parse(text) -> list[ToolCall]`. Only calls
that are closed count: an unclosed call (a turn cut by its token budget) is plain text. A call
that is closed but does not parse is a `ToolCall(name="", error=...)`, for the environment to
answer. Text outside calls is ignored.

- "hermes": Hermes / Qwen's format, one or more per turn, each
  `<tool_call>\\n{"name": "calc", "arguments": {"expression": "2+2"}}\\n</tool_call>`; `arguments`
  may also be a JSON string holding an object. No stop strings: a Qwen turn ends at EOS.
- "plain": `[name argument text]`, e.g. `[calc 37*58]` -> `ToolCall("calc", {"input": "37*58"})`, a
  format a character-level tiny model can learn; stop `"]"`, so the argument cannot hold a `]`.

Standard library only: environment workers import it.
"""

from __future__ import annotations

import json
import re
from typing import Protocol

from rlactors.environments.protocol import ToolCall


class ToolCallParser(Protocol):
    stop: list[str]

    def parse(self, text: str) -> list[ToolCall]: ...


class HermesParser:
    _CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)

    def __init__(self) -> None:
        self.stop: list[str] = []

    def parse(self, text: str) -> list[ToolCall]:
        return [self._parse_one(match.group(1)) for match in self._CALL.finditer(text)]

    @staticmethod
    def _parse_one(body: str) -> ToolCall:
        try:
            call = json.loads(body)
        except json.JSONDecodeError as error:
            return ToolCall(name="", error=f"tool call is not valid JSON: {error}")
        if not isinstance(call, dict) or not isinstance(call.get("name"), str) or not call["name"]:
            return ToolCall(name="", error='tool call must be a JSON object with a "name" string')
        arguments = call.get("arguments", {})
        if isinstance(arguments, str):  # some models (and OpenAI's API) send the arguments as JSON text
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError as error:
                return ToolCall(name=call["name"], error=f"tool call arguments are not valid JSON: {error}")
        if not isinstance(arguments, dict):
            return ToolCall(name=call["name"], error="tool call arguments must be a JSON object")
        return ToolCall(name=call["name"], arguments=arguments)


class PlainParser:
    # The innermost bracket pair: `[` inside the argument would make the call ambiguous.
    _CALL = re.compile(r"\[([^\[\]]*)\]")
    _NAME = re.compile(r"([A-Za-z_][A-Za-z0-9_.-]*)(?:\s+|$)(.*)", re.DOTALL)

    def __init__(self) -> None:
        self.stop: list[str] = ["]"]  # a list per parser: the rollout may extend its own

    def parse(self, text: str) -> list[ToolCall]:
        calls = []
        for match in self._CALL.finditer(text):
            named = self._NAME.fullmatch(match.group(1))
            if named is None:
                calls.append(ToolCall(name="", error=f"no tool name after '[' in {match.group()[:100]!r}"))
            else:
                calls.append(ToolCall(name=named.group(1), arguments={"input": named.group(2).strip()}))
        return calls


PARSERS: dict[str, type] = {"hermes": HermesParser, "plain": PlainParser}


def parser_for(name: str) -> ToolCallParser:
    """A fresh parser of the named format; an unknown name is a ValueError listing the known ones."""
    if name not in PARSERS:
        raise ValueError(f"tool-call parser {name!r}: known parsers are {', '.join(sorted(PARSERS))}")
    return PARSERS[name]()
