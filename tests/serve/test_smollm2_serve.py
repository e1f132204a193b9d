"""``specfree serve`` on the real embedded model (SmolLM2-135M-Instruct) through the ``openai``
client: a conversation whose prompt cache reuses every earlier turn and still answers as a fresh
engine, and log-probabilities that are the same with and without speculation."""

from __future__ import annotations

import httpx
import pytest

from specfree import Engine
from specfree.conf.schema import ServeConfig
from specfree.serve import create_app
from tests.serve.conftest import LiveServer, wait_until
from tests.serve.test_peers import raw_request
from tests.test_smollm2 import ARTICLE

pytestmark = pytest.mark.model

QUESTIONS = [ARTICLE, "Which year did the railway line close?", "How much will the project cost?",
             "Who offered to help?", "Write one sentence about the museum.", "Thank you. Summarize it in five words."]


@pytest.fixture(scope="module")
def served(one_thread):
    engine = Engine.from_pretrained("smollm2", compile=False)  # the default, priced hybrid
    with LiveServer(create_app(engine, ServeConfig(max_tokens=512), model_name="smollm2")) as running:
        yield running


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def test_a_six_turn_chat_reuses_each_turn_and_answers_as_a_fresh_engine(served):
    fresh = Engine.from_pretrained("smollm2", compile=False, prompt_cache=True)
    client = served.client()
    messages: list[dict] = []
    held: list[int] = []  # the last turn's prompt and answer
    for turn, question in enumerate(QUESTIONS):
        messages.append({"role": "user", "content": question})
        fresh.forget()
        want = fresh.generate(messages, 40)
        got = client.chat.completions.create(model="smollm2", messages=messages, max_tokens=40)
        text = got.choices[0].message.content
        assert text == want.text, f"turn {turn + 1}"
        ids = fresh.encode(messages)
        cached = got.usage.prompt_tokens_details.cached_tokens
        assert got.usage.prompt_tokens == len(ids)
        # only the new ids are prefilled: the common prefix with what the engine kept (all of the last
        # prompt and answer but its last token; that one too when the last step had kept rows past an EOS)
        assert cached in (common_prefix(held[:-1], ids[:-1]), common_prefix(held, ids[:-1])), f"turn {turn + 1}"
        assert got.model_extra["timings"]["prompt_n"] == len(ids) - cached
        if turn:
            assert cached >= previous  # the whole last prompt at least
        previous = len(ids)
        held = ids + want.tokens
        messages.append({"role": "assistant", "content": text})
    assert len(ids) > 2 * 160  # the prompt outgrew two prefill chunks on the way


def test_logprobs_are_the_same_with_and_without_speculation(served):
    plain = Engine.from_pretrained("smollm2", "autoregressive", compile=False)
    # a prompt SmolLM2 copies at the default precision (int8): drafts are accepted
    messages = [{"role": "user", "content": "Repeat exactly: apples, pears, plums, apples, pears, plums."}]
    want = plain.generate(messages, 32, logprobs=4)
    client = served.client()
    whole = client.chat.completions.create(model="smollm2", messages=messages, max_tokens=32, logprobs=True,
                                           top_logprobs=4, extra_body={"cache_prompt": False})
    assert whole.model_extra["specfree"]["accepted_drafts"] > 0  # the rows came from verify steps
    streamed = client.chat.completions.create(model="smollm2", messages=messages, max_tokens=32, logprobs=True,
                                              top_logprobs=4, stream=True)
    for content in (whole.choices[0].logprobs.content,
                    [c for part in streamed if part.choices and part.choices[0].logprobs
                     for c in part.choices[0].logprobs.content]):
        assert [c.logprob for c in content] == [w.logprob for w in want.logprobs]
        assert [[t.logprob for t in c.top_logprobs] for c in content] == [[v for _, v in w.top]
                                                                          for w in want.logprobs]


def test_llama_server_fields_a_bad_request_and_a_client_that_leaves(served):
    body = {"messages": [{"role": "user", "content": "Name a colour."}], "model": "gpt-4o", "n_predict": 8,
            "cache_prompt": True, "temperature": 0.7, "seed": -1, "top_k": 40, "top_p": 0.95, "min_p": 0.05,
            "repeat_penalty": 1.1, "presence_penalty": 0.0, "frequency_penalty": 0.0, "logit_bias": {},
            "typical_p": 1.0, "mirostat": 0, "stream": False}
    answer = httpx.post(served.url + "/v1/chat/completions", json=body, timeout=120)
    assert answer.status_code == 200, answer.text
    assert answer.json()["model"] == "smollm2" and answer.headers["X-Specfree-Ignored-Fields"] == "typical_p, mirostat"
    bad = httpx.post(served.url + "/v1/chat/completions", json={**body, "top_p": 3}, timeout=120)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "top_p"
    # a non-streamed client that leaves: the engine drops its request (512 tokens asked) and is free
    scheduler, metrics = served.state.scheduler, served.state.metrics
    cancelled = metrics.cancelled._value.get()
    sock = raw_request(served.url, b'{"prompt": "Count to one thousand:", "max_tokens": 512, '
                                   b'"specfree": {"ignore_eos": true}}')
    wait_until(lambda: scheduler.running, "the request to reach the engine")
    job = scheduler.running[0]
    sock.close()
    wait_until(lambda: job not in scheduler.running, "the engine to drop the request")
    assert metrics.cancelled._value.get() == cancelled + 1
