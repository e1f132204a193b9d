"""A chat request's prompt text: the model's chat template, with the tools where the request lists
them (docs/serve.md, "Tool calls").

A template that takes ``tools`` and writes calls as ``<tool_call>`` blocks gets the tools, the
assistant messages' ``tool_calls`` and the ``tool`` messages as transformers passes them. Any
other template gets plain messages: the tools described in one system message (``FALLBACK``),
earlier calls written as the blocks the model is asked for, results as user messages in
``<tool_response>`` blocks.
"""

from __future__ import annotations

import functools
import json

from specfree.serve.tools import CLOSE, OPEN, Tools

FALLBACK = ("You can call these tools, each given by its name, description and parameters (a JSON schema):\n"
            "{tools}\n"
            "To call a tool, answer with one block per call, nothing after them:\n"
            f'{OPEN}\n{{{{"name": "<the tool\'s name>", "arguments": <its arguments as a JSON object>}}}}\n{CLOSE}\n'
            "Each result comes back in a <tool_response> block. When no tool is needed, answer in text.")


def render(tokenizer, messages: list[dict], tools: Tools | None) -> str:
    """The prompt's text: ``messages`` through the chat template, ready for the assistant's answer."""
    listed = [t.spec() for t in tools.tools] if tools is not None and tools.calls else None
    if takes_tools(tokenizer.chat_template):
        return tokenizer.apply_chat_template(messages, tools=listed, add_generation_prompt=True, tokenize=False)
    return tokenizer.apply_chat_template(plain(messages, listed), add_generation_prompt=True, tokenize=False)


@functools.lru_cache(maxsize=8)
def takes_tools(template) -> bool:
    """The template reads ``tools`` and writes calls as ``<tool_call>`` blocks (the format the
    grammar holds the answer to)."""
    if not isinstance(template, str) or OPEN not in template:
        return False
    import jinja2.meta
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    try:
        parsed = ImmutableSandboxedEnvironment().parse(template)
    except jinja2.TemplateSyntaxError:
        return False  # transformers reports it when the template is applied
    return "tools" in jinja2.meta.find_undeclared_variables(parsed)


def plain(messages: list[dict], tools: list[dict] | None) -> list[dict]:
    """``messages`` as {role, content} only, for a template that knows nothing of tools."""
    out = []
    for message in messages:
        role, content = message["role"], message["content"]
        if role == "tool":
            role, content = "user", f"<tool_response>\n{content}\n</tool_response>"
        elif message.get("tool_calls"):
            blocks = [f"{OPEN}\n{json.dumps(dict(name=c['function']['name'], arguments=c['function']['arguments']))}"
                      f"\n{CLOSE}" for c in message["tool_calls"]]
            content = "\n".join(([content] if content else []) + blocks)
        out.append({"role": role, "content": content})
    if tools:
        described = "\n".join(json.dumps(t["function"], ensure_ascii=False) for t in tools)
        text = FALLBACK.format(tools=described)
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": f"{out[0]['content']}\n\n{text}"}
        else:
            out.insert(0, {"role": "system", "content": text})
    return out
