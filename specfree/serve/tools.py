"""OpenAI tool calls: ``tools``, ``tool_choice``, ``parallel_tool_calls`` (and the deprecated
``functions``/``function_call``) checked into ``Tools``; the grammar a call follows; the answer's
text split into content and ``tool_calls`` (docs/serve.md, "Tool calls").

A call is written in one format, Hermes' block, which the templates that take tools mostly use
(Qwen2.5, Hermes, SmolLM3) and the fallback system message asks for::

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

The grammar makes the name one of the tools and the arguments match that tool's ``parameters``
schema: from the first token for ``required`` or a named tool; for ``auto`` from the call's
opening on (any text before it, none after the calls).
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from specfree.constraints import Constraint
from specfree.constraints.compiler import JSON_LAYOUT
from specfree.serve.errors import bad

OPEN, CLOSE = "<tool_call>", "</tool_call>"
NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for a function's name
CHOICES = ("none", "auto", "required")
NO_PARAMETERS = {"type": "object", "properties": {}}


@dataclass(frozen=True)
class Tool:
    name: str
    description: str | None
    parameters: dict

    def spec(self) -> dict:
        """The tool as OpenAI (and transformers' chat templates) write it."""
        described = {"description": self.description} if self.description is not None else {}
        return {"type": "function", "function": {"name": self.name, **described, "parameters": self.parameters}}


@dataclass
class Tools:
    """A request's tools and how it lets the model call them."""

    tools: list[Tool]
    choice: str = "auto"  # none | auto | required | the one tool's name
    parallel: bool = True
    legacy: bool = False  # asked with functions/function_call: answered with function_call
    field_name: str = "tools"  # the field the tools came in

    @property
    def calls(self) -> bool:
        """The model may call a tool (and the prompt lists them)."""
        return self.choice != "none"

    def parameters_constraints(self) -> Iterator[tuple[str, Constraint]]:
        """Each tool's parameters as a constraint, with the field it came from (compiled one by one
        first, so that a schema that does not compile is named)."""
        for i, tool in enumerate(self.tools):
            where = f"functions[{i}].parameters" if self.legacy else f"tools[{i}].function.parameters"
            yield where, Constraint.from_options(json_schema=tool.parameters)

    def constraint(self) -> Constraint:
        """The grammar the answer follows (Lark, the tools' schemas inlined with ``%json``)."""
        named = [t for t in self.tools if t.name == self.choice]
        listed = named or self.tools
        alternatives = " | ".join(f"tool_{i}" for i in range(len(listed)))
        # one newline may end the calls: models write one before their end-of-turn token
        more = (' ("\\n" call)*' if self.parallel and not named else "") + ' "\\n"?'
        if self.choice == "auto":
            # text with no call in it, or text up to the first call's opening and then the calls
            start = [f"start: ANSWER | opened body{more}",
                     f"ANSWER: /(?s:.*)/ & ~/(?s:.*){OPEN}(?s:.*)/",
                     f'opened[lazy]: /(?s:.*)/ "{OPEN}"']
        else:
            start = [f"start: call{more}"]
        lines = [*start, f'call: "{OPEN}" body', f'body: "\\n" ({alternatives}) "\\n{CLOSE}"']
        lines += [f"tool_{i}: %json {json.dumps(call_schema(tool))}" for i, tool in enumerate(listed)]
        return Constraint("grammar", "\n".join(lines) + "\n")


def call_schema(tool: Tool) -> dict:
    """One call of ``tool`` as a JSON schema: its name, then arguments matching its parameters."""
    return {"type": "object", "properties": {"name": {"const": tool.name}, "arguments": tool.parameters},
            "required": ["name", "arguments"], "additionalProperties": False, "x-guidance": JSON_LAYOUT}


# ---- the request ---------------------------------------------------------------------------------
def parse_tools(body: dict) -> Tools | None:
    """The request's tools, or None when it lists none (a 400 naming the field for any mistake)."""
    if body.get("tools") is not None and body.get("functions") is not None:
        raise bad("give tools or the deprecated functions, not both", "functions")
    legacy = body.get("functions") is not None
    if legacy:
        if body.get("tool_choice") is not None:
            raise bad("tool_choice goes with tools; with functions give function_call", "tool_choice")
        tools = _functions(body["functions"])
        choice = _choice(body.get("function_call"), tools, "function_call", legacy=True)
        return Tools(tools, choice, parallel=False, legacy=True, field_name="functions")
    if body.get("tools") is None:
        for key in ("tool_choice", "function_call"):
            if body.get(key) not in (None, "none"):
                raise bad(f"`{key}` needs a list of tools (`tools`)", key)
        if body.get("parallel_tool_calls") is not None and not isinstance(body["parallel_tool_calls"], bool):
            raise bad("`parallel_tool_calls` must be a boolean", "parallel_tool_calls", "invalid_type")
        return None
    if body.get("function_call") is not None:
        raise bad("function_call goes with functions; with tools give tool_choice", "function_call")
    tools = _tools(body["tools"])
    parallel = body.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise bad("`parallel_tool_calls` must be a boolean", "parallel_tool_calls", "invalid_type")
    return Tools(tools, _choice(body.get("tool_choice"), tools, "tool_choice"), parallel)


def _tools(value: Any) -> list[Tool]:
    if not isinstance(value, list) or not value:
        raise bad("`tools` must be a non-empty array of {type: function, function: {...}}", "tools", "invalid_type")
    out = []
    for i, entry in enumerate(value):
        where = f"tools[{i}]"
        if not isinstance(entry, dict) or entry.get("type") != "function" or not isinstance(entry.get("function"), dict):
            raise bad(f'`{where}` must be {{"type": "function", "function": {{name, description, parameters}}}}',
                      where, "invalid_type")
        extra = sorted(set(entry) - {"type", "function"})
        if extra:
            raise bad(f"unknown field `{where}.{extra[0]}`", f"{where}.{extra[0]}", "unknown_parameter")
        out.append(_function(entry["function"], f"{where}.function"))
    return _distinct(out, "tools")


def _functions(value: Any) -> list[Tool]:
    if not isinstance(value, list) or not value:
        raise bad("`functions` must be a non-empty array of {name, description, parameters}", "functions",
                  "invalid_type")
    return _distinct([_function(f, f"functions[{i}]") for i, f in enumerate(value)], "functions")


def _function(value: Any, where: str) -> Tool:
    if not isinstance(value, dict):
        raise bad(f"`{where}` must be an object with name, description and parameters", where, "invalid_type")
    extra = sorted(set(value) - {"name", "description", "parameters", "strict"})
    if extra:
        raise bad(f"unknown field `{where}.{extra[0]}`", f"{where}.{extra[0]}", "unknown_parameter")
    name = value.get("name")
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise bad(f"`{where}.name` must be 1 to 64 letters, digits, _ or -, got {name!r}", f"{where}.name")
    description = value.get("description")
    if description is not None and not isinstance(description, str):
        raise bad(f"`{where}.description` must be a string", f"{where}.description", "invalid_type")
    if value.get("strict") is not None and not isinstance(value["strict"], bool):
        raise bad(f"`{where}.strict` must be a boolean", f"{where}.strict", "invalid_type")
    parameters = value.get("parameters")
    if parameters is None:
        parameters = NO_PARAMETERS
    if not isinstance(parameters, dict):
        raise bad(f"`{where}.parameters` must be a JSON schema (an object)", f"{where}.parameters", "invalid_type")
    return Tool(name, description, parameters)  # strict or not, the schema is enforced


def _distinct(tools: list[Tool], where: str) -> list[Tool]:
    names = [t.name for t in tools]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise bad(f"`{where}` lists the function {twice[0]!r} twice; give each name once", where)
    return tools


def _choice(value: Any, tools: list[Tool], where: str, legacy: bool = False) -> str:
    names = [t.name for t in tools]
    if value is None:
        return "auto"
    if isinstance(value, str):
        allowed = ("none", "auto") if legacy else CHOICES
        if value not in allowed:
            raise bad(f"`{where}` {value!r} is not one of {', '.join(allowed)} or a named function", where)
        return value
    name = value.get("name") if legacy and isinstance(value, dict) else \
        value.get("function", {}).get("name") if isinstance(value, dict) and value.get("type") == "function" \
        and isinstance(value.get("function"), dict) else None
    if not isinstance(name, str):
        shape = '{"name": ...}' if legacy else '{"type": "function", "function": {"name": ...}}'
        raise bad(f"`{where}` must be one of {', '.join(CHOICES[:2 if legacy else 3])} or {shape}", where,
                  "invalid_type")
    if name not in names:
        raise bad(f"`{where}` names the function {name!r}, which is not among the tools ({', '.join(names)})",
                  where)
    return name


# ---- the answer ----------------------------------------------------------------------------------
@dataclass
class Call:
    name: str
    arguments: str  # JSON text, as OpenAI sends it
    id: str = field(default_factory=lambda: "call_" + uuid.uuid4().hex[:24])

    def tool_call(self, index: int | None = None) -> dict:
        out = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return out if index is None else {"index": index, **out}


class CallSplitter:
    """Answer text, pushed as it comes, split into content and finished calls. Text that may be the
    start of a call's opening is held until the next piece says which it is. Text after the first
    call (under the grammar, the newlines between calls) and a call cut short by the token limit
    come back from ``flush``, as content, unless blank."""

    def __init__(self):
        self.held = ""  # text not yet shown: a possible opening's start, or a call's unfinished body
        self.after = ""  # text outside the calls, after the first one
        self.in_call = False
        self.calls: list[Call] = []

    def push(self, text: str) -> tuple[str, list[Call]]:
        """The content that can be shown now, and the calls that finished in ``text``."""
        self.held += text
        content, calls = "", []
        while True:
            if self.in_call:
                end = self.held.find(CLOSE)
                if end < 0:
                    return content, calls
                call = parse_call(self.held[:end])
                if call is None:  # not a call after all (text written without the grammar)
                    self.after += OPEN + self.held[: end + len(CLOSE)]
                else:
                    calls.append(call)
                    self.calls.append(call)
                self.held, self.in_call = self.held[end + len(CLOSE):], False
                continue
            at = self.held.find(OPEN)
            cut = at if at >= 0 else len(self.held) - partial_opening(self.held)
            if self.calls:
                self.after += self.held[:cut]
            else:
                content += self.held[:cut]
            if at < 0:
                self.held = self.held[cut:]
                return content, calls
            self.held, self.in_call = self.held[at + len(OPEN):], True

    def flush(self) -> str:
        """What is left once no more text comes, as content ("" when blank)."""
        out = self.after + (OPEN if self.in_call else "") + self.held
        self.held, self.after, self.in_call = "", "", False
        return out if out.strip() else ""


def partial_opening(text: str) -> int:
    """How many of ``text``'s last characters may start a call's opening."""
    return next((k for k in range(min(len(OPEN) - 1, len(text)), 0, -1) if text.endswith(OPEN[:k])), 0)


def parse_call(body: str) -> Call | None:
    """A call's block between its opening and closing, or None if it is not one (never under the
    grammar; text the model wrote without it, unconstrained, may be anything)."""
    try:
        data = json.loads(body)
    except ValueError:
        return None
    if not isinstance(data, dict) or not isinstance(data.get("name"), str) or not isinstance(data.get("arguments"), dict):
        return None
    return Call(data["name"], json.dumps(data["arguments"], ensure_ascii=False))


# ---- the conversation ---------------------------------------------------------------------------
def assistant_calls(value: Any, where: str) -> list[dict]:
    """An assistant message's ``tool_calls`` (or deprecated ``function_call``) as chat templates take
    them: ``{"id", "type": "function", "function": {"name", "arguments": dict}}``."""
    if isinstance(value, dict):  # function_call: one call, no id
        value = [{"type": "function", "function": value}]
        where = where.rsplit(".", 1)[0] + ".function_call"
    if not isinstance(value, list):
        raise bad(f"`{where}` must be an array of tool calls", where, "invalid_type")
    out = []
    for j, call in enumerate(value):
        at = f"{where}[{j}]"
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise bad(f'`{at}` must be {{"id", "type": "function", "function": {{"name", "arguments"}}}}', at,
                      "invalid_type")
        arguments = function.get("arguments", "{}")
        try:
            arguments = json.loads(arguments) if isinstance(arguments, str) else arguments
        except ValueError as exc:
            raise bad(f"`{at}.function.arguments` is not valid JSON ({exc})", f"{at}.function.arguments") from None
        if not isinstance(arguments, dict):
            raise bad(f"`{at}.function.arguments` must be a JSON object", f"{at}.function.arguments", "invalid_type")
        entry = {"type": "function", "function": {"name": function["name"], "arguments": arguments}}
        if call.get("id") is not None:
            entry["id"] = str(call["id"])
        out.append(entry)
    return out


def check_results(messages: list[dict]) -> None:
    """Each ``tool`` message answers a call an earlier assistant message made, by its id."""
    made: set[str] = set()
    for i, message in enumerate(messages):
        made.update(c["id"] for c in message.get("tool_calls", ()) if "id" in c)
        if message["role"] != "tool" or message.get("tool_call_id", "") is None:  # None: a function's result
            continue
        call_id = message.get("tool_call_id")
        if not isinstance(call_id, str) or not call_id:
            raise bad(f"`messages[{i}].tool_call_id` is required: a tool message answers the call with that id",
                      f"messages[{i}].tool_call_id", "missing_required_parameter")
        if call_id not in made:
            raise bad(f"`messages[{i}].tool_call_id` {call_id!r} answers no call an earlier assistant message made",
                      f"messages[{i}].tool_call_id")
