"""Tool calls through ``serve``: ``tools``, ``tool_choice``, ``parallel_tool_calls`` and the deprecated
``functions``; the prompt through the chat template (or the fallback system message); answers with
``tool_calls`` equal to constrained plain decoding of the call grammar; streamed ``delta.tool_calls``
that the ``openai`` client's stream helper accumulates; 400s naming the field."""

from __future__ import annotations

import copy
import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema
import pytest

from specfree import Engine
from specfree.serve.prompt import FALLBACK, render, takes_tools
from specfree.serve.protocol import parse
from specfree.serve.tools import CallSplitter, Tools, parse_tools
from tests.serve.conftest import CPU_LIKE, live
from tests.tiny_models import tiny_json_tokenizer, tiny_model

PLAIN_TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
                  "{% if add_generation_prompt %}<assistant>{% endif %}")
# a template that takes tools, as Qwen2.5's does: the tools listed, calls and results in blocks
TOOLS_TEMPLATE = (
    "{% if tools %}<tools>{% for t in tools %}{{ t.function.name }};{% endfor %}</tools>\n{% endif %}"
    "{% for m in messages %}<{{ m.role }}>{{ m.content }}"
    "{% for c in m.tool_calls or [] %}<tool_call>{{ c.function | tojson }}</tool_call>{% endfor %}"
    "{% if m.role == 'tool' %}({{ m.tool_call_id }}){% endif %}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}")
ADD = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                        "b": {"type": "integer", "minimum": 0, "maximum": 99}},
       "required": ["a", "b"], "additionalProperties": False}
CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 6}}, "required": ["city"],
        "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "add", "description": "a + b", "parameters": ADD}},
         {"type": "function", "function": {"name": "weather", "parameters": CITY}}]
SCHEMAS = {"add": ADD, "weather": CITY}
MESSAGES = [{"role": "user", "content": "What is 2 + 3?"}]


def tokenizer(template: str = PLAIN_TEMPLATE):
    tok = tiny_json_tokenizer()
    tok.chat_template = template
    return tok


def tool_engine(strategy: str = "hybrid", template: str = PLAIN_TEMPLATE) -> Engine:
    model = copy.deepcopy(tiny_model("llama"))
    model.config.max_position_embeddings = 2048  # the fallback system message is longer than 512 bytes
    return Engine.from_model(model, tokenizer(template), strategy, costs=CPU_LIKE)


@pytest.fixture(scope="module")
def server(one_thread):
    with live(tool_engine(), queue_size=32, max_tokens=64, max_body_bytes=200_000, max_batch=4) as running:
        yield running


def expected(body: dict, template: str = PLAIN_TEMPLATE) -> tuple[str, str]:
    """Constrained plain decoding of the request's prompt under its call grammar: text, stop reason."""
    ask = parse("chat", body, 64)
    engine = tool_engine("autoregressive", template)
    prompt = engine.tokenizer(render(engine.tokenizer, ask.prompt, ask.tools), add_special_tokens=False).input_ids
    result = engine.generate(prompt, body.get("max_tokens", 40), **ask.tools.constraint().options())
    return result.text, result.stop_reason


def chat(server, **body) -> httpx.Response:
    return httpx.post(server.url + "/v1/chat/completions",
                      json={"messages": MESSAGES, "tools": TOOLS, "max_tokens": 40, **body}, timeout=120)


def check_calls(message: dict, names=("add", "weather")) -> None:
    for call in message["tool_calls"]:
        assert call["id"].startswith("call_") and call["type"] == "function"
        assert call["function"]["name"] in names
        jsonschema.validate(json.loads(call["function"]["arguments"]), SCHEMAS[call["function"]["name"]])


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "weather"}}])
@pytest.mark.parametrize("parallel", [True, False])
def test_a_required_or_named_call_is_constrained_plain_decoding_of_the_call_grammar(server, choice, parallel):
    body = {"messages": MESSAGES, "tools": TOOLS, "tool_choice": choice, "parallel_tool_calls": parallel,
            "max_tokens": 60}
    answer = chat(server, **body).json()["choices"][0]
    text, stop = expected(body)
    splitter = CallSplitter()
    calls = splitter.push(text)[1]
    if not calls:  # the limit cut the first call: its text comes back as content
        assert answer["finish_reason"] == "length" and answer["message"]["content"] == text
        return
    assert answer["finish_reason"] == ("length" if stop == "max_new_tokens" else "tool_calls")
    message = answer["message"]
    check_calls(message, ["weather"] if isinstance(choice, dict) else ["add", "weather"])
    assert [c["function"] for c in message["tool_calls"]] == [c.tool_call()["function"] for c in calls]
    assert len({c["id"] for c in message["tool_calls"]}) == len(calls)
    assert message["content"] == (splitter.flush() or None)  # a call cut short after the first
    assert parallel or len(calls) == 1


def test_auto_answers_text_or_calls_as_constrained_plain_decoding(server):
    body = {"messages": MESSAGES, "tools": TOOLS, "max_tokens": 30}
    answer = chat(server, **body).json()["choices"][0]
    text, _ = expected(body)
    assert "tool_calls" not in answer["message"] and answer["message"]["content"] == text  # the random model talks


def test_tool_choice_none_lists_no_tools_and_leaves_the_answer_free(server):
    answer = chat(server, tool_choice="none", max_tokens=20).json()["choices"][0]
    engine = tool_engine("autoregressive")
    assert answer["message"]["content"] == engine.generate(MESSAGES, 20).text


def test_the_openai_stream_helper_accumulates_the_streamed_tool_calls(server):
    client = server.client()
    whole = client.chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice="required",
                                           max_tokens=60, parallel_tool_calls=False)
    with client.chat.completions.stream(model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice="required",
                                        max_tokens=60, parallel_tool_calls=False) as stream:
        final = stream.get_final_completion()
    assert whole.choices[0].finish_reason == final.choices[0].finish_reason == "tool_calls"
    ours = [(c.function.name, c.function.arguments) for c in final.choices[0].message.tool_calls]
    assert ours == [(c.function.name, c.function.arguments) for c in whole.choices[0].message.tool_calls]
    raw = httpx.post(server.url + "/v1/chat/completions", timeout=120, json={
        "messages": MESSAGES, "tools": TOOLS, "tool_choice": "required", "max_tokens": 60, "stream": True})
    deltas = [json.loads(line[6:])["choices"] for line in raw.text.splitlines()
              if line.startswith("data: {")]
    calls = [d[0]["delta"]["tool_calls"][0] for d in deltas if d and d[0]["delta"].get("tool_calls")]
    assert [c["index"] for c in calls] == list(range(len(calls))) and all(c["id"] for c in calls)


def test_the_deprecated_functions_answer_with_function_call(server):
    body = {"messages": MESSAGES, "functions": [t["function"] for t in TOOLS], "function_call": {"name": "add"},
            "max_tokens": 60}
    answer = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=120).json()["choices"][0]
    assert answer["finish_reason"] == "function_call"
    jsonschema.validate(json.loads(answer["message"]["function_call"]["arguments"]), ADD)
    assert answer["message"]["function_call"]["name"] == "add"


def test_requests_with_different_tools_answer_as_alone_when_batched(server):
    bodies = [{"tool_choice": "required"}, {"tools": TOOLS[:1], "tool_choice": "required"}, {"tool_choice": "none"},
              {"tool_choice": {"type": "function", "function": {"name": "add"}}, "parallel_tool_calls": False}] * 2
    with ThreadPoolExecutor(len(bodies)) as pool:
        answers = list(pool.map(lambda b: chat(server, **b).json()["choices"][0]["message"], bodies))
    for body, message in zip(bodies, answers):
        alone = chat(server, **body).json()["choices"][0]["message"]
        strip = (lambda m: [c["function"] for c in m.get("tool_calls") or []] or m["content"])
        assert strip(message) == strip(alone)


def test_a_conversation_with_calls_and_results_goes_through_the_template():
    history = [*MESSAGES, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "5"}]
    ask = parse("chat", {"messages": history, "tools": TOOLS}, 64)
    with_tools = render(tokenizer(TOOLS_TEMPLATE), ask.prompt, ask.tools)
    assert takes_tools(TOOLS_TEMPLATE) and not takes_tools(PLAIN_TEMPLATE)
    assert with_tools.startswith("<tools>add;weather;</tools>")
    assert '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>' in with_tools
    assert "<tool>5(call_1)" in with_tools
    fallback = render(tokenizer(), ask.prompt, ask.tools)
    described = "\n".join(json.dumps(t["function"]) for t in TOOLS)
    assert fallback.startswith("<system>" + FALLBACK.format(tools=described))
    assert '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>' in fallback
    assert "<user><tool_response>\n5\n</tool_response>" in fallback


def test_the_answer_after_a_tool_result_is_constrained_plain_decoding(server):
    history = [*MESSAGES, {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "5"}]
    body = {"messages": history, "tools": TOOLS, "max_tokens": 20}
    answer = chat(server, **body).json()["choices"][0]["message"]
    assert "tool_calls" not in answer and answer["content"] == expected(body)[0]  # the random model talks


@pytest.mark.parametrize("body, param, words", [
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}]},
     "tools[0].function.parameters", "does not compile"),
    ({"tool_choice": {"type": "function", "function": {"name": "missing"}}}, "tool_choice", "not among the tools"),
    ({"tool_choice": "sometimes"}, "tool_choice", "not one of"),
    ({"tools": None, "tool_choice": "required"}, "tool_choice", "needs a list of tools"),
    ({"messages": [*MESSAGES, {"role": "tool", "content": "5"}]}, "messages[1].tool_call_id", "required"),
    ({"messages": [*MESSAGES, {"role": "tool", "content": "5", "tool_call_id": "x"}]}, "messages[1].tool_call_id",
     "answers no call"),
    ({"messages": [*MESSAGES, {"role": "assistant", "tool_calls": [{"type": "function", "function": {
        "name": "add", "arguments": "{nope"}}]}]}, "messages[1].tool_calls[0].function.arguments", "not valid JSON"),
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools[0].function.name", "letters"),
    ({"tools": [TOOLS[0], TOOLS[0]]}, "tools", "twice"),
    ({"functions": [{"name": "f", "parameters": {"type": "nope"}}], "tools": None}, "functions[0].parameters",
     "does not compile"),
    ({"response_format": {"type": "json_object"}}, "response_format", "not both"),
    ({"parallel_tool_calls": "yes"}, "parallel_tool_calls", "boolean"),
])
def test_a_bad_tool_request_is_a_400_naming_its_field(server, body, param, words):
    response = chat(server, **body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and words in error["message"], error
    assert chat(server, tool_choice="required").status_code == 200  # the next request is served


def test_the_splitter_holds_a_possible_opening_and_returns_a_cut_call_as_content():
    splitter = CallSplitter()
    assert splitter.push("Let me <tool") == ("Let me ", [])
    content, calls = splitter.push('_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>\n<tool_call>\n{"na')
    assert content == "" and [c.name for c in calls] == ["add"] and calls[0].arguments == '{"a": 1}'
    assert splitter.flush() == '\n<tool_call>\n{"na'
    assert CallSplitter().push("a <b> c") == ("a <b> c", [])


def test_tools_are_only_for_chat(server):
    response = httpx.post(server.url + "/v1/completions", json={"prompt": "x", "tools": TOOLS}, timeout=60)
    assert response.status_code == 400 and response.json()["error"]["param"] == "tools"


def test_a_tool_without_parameters_takes_an_empty_object():
    tools = Tools(parse_tools({"tools": [{"type": "function", "function": {"name": "now"}}]}).tools, "required")
    assert '"arguments": {"type": "object", "properties": {}}' in tools.constraint().text


WEATHER = {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city"], "additionalProperties": False}


@pytest.mark.model
def test_smollm2_calls_a_tool_through_the_openai_client_as_constrained_plain_decoding(one_thread):
    from specfree.conf.schema import ServeConfig
    from specfree.serve import create_app
    from tests.serve.conftest import LiveServer

    tools = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                               "parameters": WEATHER}}]
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    engine = Engine.from_pretrained("smollm2", compile=False)  # the default, priced hybrid
    with LiveServer(create_app(engine, ServeConfig(max_tokens=128), model_name="smollm2")) as served:
        answer = served.client().chat.completions.create(model="smollm2", messages=messages, tools=tools,
                                                          tool_choice="required", parallel_tool_calls=False,
                                                          max_tokens=60)
    ask = parse("chat", {"messages": messages, "tools": tools, "tool_choice": "required",
                         "parallel_tool_calls": False}, 128)
    plain = Engine.from_pretrained("smollm2", compile=False, strategy="autoregressive")
    prompt = plain.tokenizer(render(plain.tokenizer, ask.prompt, ask.tools), add_special_tokens=False).input_ids
    want = plain.generate(prompt, 60, **ask.tools.constraint().options())
    assert answer.choices[0].finish_reason == "tool_calls", want.text
    call = answer.choices[0].message.tool_calls[0]
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER)
    assert [c.function.model_dump() for c in answer.choices[0].message.tool_calls] == \
        [c.tool_call()["function"] for c in CallSplitter().push(want.text)[1]]
