"""Structured output through ``serve``: OpenAI's ``response_format`` and llama-server's
``json_schema`` and ``grammar`` constrain the answer exactly as ``Engine.generate`` does; a bad
constraint is a 400 naming its field; requests with different constraints batch together."""

from __future__ import annotations

import copy
import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from specfree import Engine
from tests.serve.conftest import CPU_LIKE, live
from tests.tiny_models import tiny_json_tokenizer, tiny_model

SCHEMA = {"type": "object", "properties": {"a": {"type": "boolean"}, "abc": {"type": "integer", "maximum": 99}},
          "required": ["a", "abc"], "additionalProperties": False}
PROMPT = '{"a": true, "abc": 12} {"a": '


def json_engine(strategy: str = "hybrid") -> Engine:
    return Engine.from_model(copy.deepcopy(tiny_model("llama")), tiny_json_tokenizer(), strategy, costs=CPU_LIKE)


@pytest.fixture(scope="module")
def server(one_thread):
    with live(json_engine(), queue_size=32, max_tokens=64, max_body_bytes=200_000, max_batch=4) as running:
        yield running


def expected(max_tokens: int = 40, **options) -> tuple[str, str]:
    result = json_engine("autoregressive").generate(PROMPT, max_tokens, **options)
    return result.text, {"grammar": "stop", "eos": "stop"}.get(result.stop_reason, "length")


def post(server, body: dict) -> httpx.Response:
    return httpx.post(server.url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 40, **body}, timeout=120)


def test_openai_response_format_json_schema_and_json_object(server):
    client = server.client()
    answer = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=40, temperature=0, extra_body={
        "response_format": {"type": "json_schema", "json_schema": {"name": "t", "schema": SCHEMA, "strict": True}}})
    text, finish = expected(json_schema=SCHEMA)
    assert answer.choices[0].text == text and answer.choices[0].finish_reason == finish
    assert set(json.loads(text)) == {"a", "abc"}
    anything = post(server, {"response_format": {"type": "json_object"}}).json()["choices"][0]
    assert (anything["text"], anything["finish_reason"]) == expected(json_object=True)


def test_llama_servers_json_schema_and_grammar_fields_are_followed(server):
    gbnf = 'root ::= "{" [a-c]+ "}"'
    for body, options in (({"json_schema": SCHEMA}, {"json_schema": SCHEMA}), ({"grammar": gbnf}, {"grammar": gbnf})):
        response = post(server, body)
        assert response.status_code == 200 and "x-specfree-ignored-fields" not in response.headers
        choice = response.json()["choices"][0]
        assert (choice["text"], choice["finish_reason"]) == expected(**options)


def test_an_answer_cut_by_max_tokens_says_length(server):
    choice = post(server, {"grammar": 'root ::= [a-c]{30}', "max_tokens": 5}).json()["choices"][0]
    assert choice["finish_reason"] == "length"


def test_requests_with_different_constraints_answer_as_alone_when_batched(server):
    bodies = [{"json_schema": SCHEMA}, {"grammar": 'root ::= "x" [0-9]+'}, {},
              {"response_format": {"type": "json_object"}}, {"json_schema": {"type": "array", "maxItems": 2}}] * 2
    with ThreadPoolExecutor(len(bodies)) as pool:
        answers = list(pool.map(lambda b: post(server, b).json()["choices"][0]["text"], bodies))
    for body, answer in zip(bodies, answers):
        options = {"json_object": True} if "response_format" in body else body
        assert answer == expected(**options)[0]


@pytest.mark.parametrize("body, param, words", [
    ({"json_schema": {"type": "array", "uniqueItems": True}}, "json_schema", "Unimplemented keys"),
    ({"grammar": "root ::= ( 'a'"}, "grammar", "does not compile"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "nope"}}}},
     "response_format.json_schema.schema", "does not compile"),
    ({"response_format": {"type": "xml"}}, "response_format.type", "not supported"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema", "required"),
    ({"response_format": {"type": "json_object"}, "grammar": "root ::= \"a\""}, "grammar", "one constraint"),
    ({"json_schema": "not an object"}, "json_schema", "must be an object"),
])
def test_a_bad_constraint_is_a_400_naming_its_field(server, body, param, words):
    response = post(server, body)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == param and words in error["message"]
    assert post(server, {"json_schema": SCHEMA}).status_code == 200  # the next request is served


def test_the_warm_up_converts_the_tokenizer_for_constraints_on_the_served_engine():
    from specfree.serve.cli import warm_up

    engine = json_engine()
    assert engine._grammars is None
    warm_up(engine)
    assert engine._grammars is not None  # the first request with a schema or tools converts nothing
