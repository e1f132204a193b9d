"""What llama-server's and OpenAI's clients send, on a tiny random model: their common fields, the
prompt cache's reports, log-probabilities, /tokenize, CORS, and clients that leave."""

from __future__ import annotations

import socket
import threading

import httpx
import pytest
from transformers import MinPLogitsWarper

from specfree import Engine
from specfree.verifiers.processors import LogitBias, PresenceFrequencyPenalty
from tests.serve.conftest import Paced, live, tiny_engine, wait_until
from tests.serve.test_serve import PROMPTS, chat, reference, streamed_text
from tests.tiny_models import tiny_model, tiny_tokenizer


@pytest.fixture(scope="module")
def server(one_thread):
    with live(tiny_engine(), max_tokens=64, cors_origins=["http://ui.example"]) as running:
        yield running


def plain(**knobs) -> Engine:
    """The autoregressive engine: no drafts, every token from the one-row forward."""
    return Engine.from_model(tiny_model("llama"), tiny_tokenizer(), "autoregressive", **knobs)


def ids_of(messages) -> list[int]:
    return plain().encode(messages, chat=True)


def test_llama_servers_common_fields_are_taken_and_unknown_ones_named(server):
    prompt_len = len(ids_of(chat(PROMPTS[8])))
    greedy = plain().generate(chat(PROMPTS[8]), 12).tokens
    bias = {greedy[0]: -100.0, greedy[1]: 5.0}
    body = {"messages": chat(PROMPTS[8]), "model": "anything", "n_predict": 12, "cache_prompt": True,
            "temperature": 0.8, "seed": 4, "top_k": 6, "min_p": 0.05, "repeat_penalty": 1.2,
            "presence_penalty": 0.5, "frequency_penalty": 0.3, "logit_bias": {str(k): v for k, v in bias.items()},
            "mirostat": 0, "slot_id": -1, "typical_p": 1.0}
    answer = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)
    assert answer.status_code == 200, answer.text
    assert answer.headers["X-Specfree-Ignored-Fields"] == "mirostat, slot_id, typical_p"
    assert answer.json()["model"] == "tiny"
    want = plain(do_sample=True, temperature=0.8, top_k=6, repetition_penalty=1.2, seed=4,
                 logits_processors=[PresenceFrequencyPenalty(0.5, 0.3, prompt_len), LogitBias(bias)])
    want.verifier.processors.append(MinPLogitsWarper(0.05))
    assert answer.json()["choices"][0]["message"]["content"] == want.generate(chat(PROMPTS[8]), 12, seed=4).text
    # greedy with llama-server's [[id, bias]] form: the banned first token is not chosen
    first = plain().generate(PROMPTS[9], 1).tokens[0]
    banned = httpx.post(server.url + "/v1/completions", json={"prompt": PROMPTS[9], "max_tokens": 4,
                                                              "logit_bias": [[first, -100]]}).json()
    want = plain(logits_processors=[LogitBias({first: -100.0})]).generate(PROMPTS[9], 4)
    assert banned["choices"][0]["text"] == want.text and want.tokens[0] != first
    drawn = httpx.post(server.url + "/v1/completions", json={"prompt": PROMPTS[9], "max_tokens": 4, "seed": -1,
                                                             "temperature": 0.9}).json()
    assert 0 <= drawn["specfree"]["seed"] < 2**31  # -1: the server draws one, and says which


def test_top_p_alone_samples_at_the_servers_temperature(one_thread):
    with live(tiny_engine(do_sample=True, temperature=0.5), max_tokens=64) as running:
        got = running.client().completions.create(model="x", prompt=PROMPTS[10], max_tokens=16, top_p=0.9, seed=7)
    assert got.choices[0].text == reference(PROMPTS[10], 16, do_sample=True, temperature=0.5, top_p=0.9, seed=7)
    assert got.choices[0].text != reference(PROMPTS[10], 16, do_sample=True, temperature=1.0, top_p=0.9, seed=7)


def test_the_prompt_cache_reports_what_it_reused(server):
    client = server.client()
    first = client.completions.create(model="tiny", prompt=PROMPTS[11], max_tokens=8)
    follow = PROMPTS[11] + first.choices[0].text + " the red car"
    second = client.completions.create(model="tiny", prompt=follow, max_tokens=8)
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached >= first.usage.prompt_tokens  # the first prompt and the answer's kept rows
    assert second.model_extra["timings"]["cache_n"] == cached
    assert second.model_extra["timings"]["prompt_n"] == second.usage.prompt_tokens - cached
    assert second.choices[0].text == reference(follow, 8)
    again = client.completions.create(model="tiny", prompt=follow, max_tokens=8, extra_body={"cache_prompt": False})
    assert again.usage.prompt_tokens_details.cached_tokens == 0 and again.choices[0].text == second.choices[0].text
    metrics = httpx.get(server.url + "/metrics").text
    counted = [line for line in metrics.splitlines() if line.startswith("specfree_prompt_cached_tokens_total")]
    assert float(counted[0].split()[-1]) >= cached


@pytest.mark.parametrize("stream", [False, True])
def test_logprobs_are_the_one_row_forwards(server, stream):
    want = plain().generate(chat(PROMPTS[12]), 10, logprobs=3).logprobs
    got = server.client().chat.completions.create(model="tiny", messages=chat(PROMPTS[12]), max_tokens=10,
                                                  logprobs=True, top_logprobs=3, stream=stream)
    parts = [p.choices[0].logprobs.content for p in got if p.choices and p.choices[0].logprobs] if stream else \
        [got.choices[0].logprobs.content]
    content = [entry for part in parts for entry in part]
    assert [c.logprob for c in content] == [w.logprob for w in want]  # bit for bit, through JSON
    assert [[t.logprob for t in c.top_logprobs] for c in content] == [[v for _, v in w.top] for w in want]
    plain_text = plain().generate(PROMPTS[12], 6, logprobs=2).logprobs
    legacy = httpx.post(server.url + "/v1/completions", json={"prompt": PROMPTS[12], "max_tokens": 6,
                                                              "logprobs": 2, "stream": stream}, timeout=60)
    if stream:
        chunks = [line[6:] for line in legacy.text.splitlines() if line.startswith("data: {")]
        import json

        tables = [json.loads(c)["choices"][0]["logprobs"] for c in chunks]
        values = [v for t in tables if t for v in t["token_logprobs"]]
    else:
        values = legacy.json()["choices"][0]["logprobs"]["token_logprobs"]
    assert values == [w.logprob for w in plain_text]


def test_tokenize_detokenize_and_cors(server):
    text = "the cat and the dog run to the big house"
    tokens = httpx.post(server.url + "/tokenize", json={"content": text}).json()["tokens"]
    assert tokens == tiny_tokenizer()(text, add_special_tokens=False).input_ids
    pieces = httpx.post(server.url + "/tokenize", json={"content": text, "with_pieces": True}).json()["tokens"]
    assert [p["id"] for p in pieces] == tokens
    assert httpx.post(server.url + "/detokenize", json={"tokens": tokens}).json()["content"] == text
    assert httpx.post(server.url + "/detokenize", json={"tokens": ["x"]}).status_code == 400
    preflight = httpx.options(server.url + "/v1/chat/completions", headers={
        "Origin": "http://ui.example", "Access-Control-Request-Method": "POST"})
    assert preflight.headers["access-control-allow-origin"] == "http://ui.example"
    other = httpx.get(server.url + "/health", headers={"Origin": "http://elsewhere.example"})
    assert "access-control-allow-origin" not in other.headers


def test_no_cors_headers_by_default(one_thread):
    with live(tiny_engine("autoregressive")) as running:
        answer = httpx.get(running.url + "/health", headers={"Origin": "http://ui.example"})
    assert answer.status_code == 200 and "access-control-allow-origin" not in answer.headers


# ---- clients that leave ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def paced(one_thread):
    with live(tiny_engine(cls=Paced), max_tokens=64, queue_size=4, max_batch=1) as running:
        yield running


def raw_request(url: str, body: bytes) -> socket.socket:
    """A non-streamed completion sent by hand, so the test can leave without reading the answer."""
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)))
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    return sock


def test_a_non_streamed_client_that_leaves_frees_the_engine(paced):
    engine, scheduler, metrics = paced.state.engine, paced.state.scheduler, paced.state.metrics
    cancelled = metrics.cancelled._value.get()
    engine.pace()
    try:
        body = b'{"prompt": "' + PROMPTS[13].encode() + b'", "max_tokens": 60, "specfree": {"ignore_eos": true}}'
        running = raw_request(paced.url, body)
        wait_until(lambda: scheduler.running, "the request to reach the engine")
        job = scheduler.running[0]
        waiting = raw_request(paced.url, body)
        wait_until(lambda: scheduler.waiting == 1, "a second request to wait")
        waiting.close()  # a waiting client leaves: its place is free at once, before any step
        wait_until(lambda: scheduler.waiting == 0, "the waiting request to leave the queue")
        assert scheduler.running == [job]
        engine.release(1)
        wait_until(lambda: engine.steps_run >= 1, "one step")
        before = engine.steps_run
        running.close()  # the running client leaves, without reading anything
        wait_until(job.cancelled.is_set, "the server to see the client go")
        engine.release(1)  # the step the worker may be waiting in; before the next one it drops the request
        wait_until(lambda: not scheduler.running, "the worker to be free")
        assert engine.steps_run - before <= 1
        assert metrics.cancelled._value.get() == cancelled + 2
    finally:
        engine.paced = False
        engine.release(100)
    nxt = paced.client().completions.create(model="tiny", prompt=PROMPTS[13], max_tokens=6)
    assert nxt.choices[0].text == reference(PROMPTS[13], 6)


def test_health_answers_while_a_large_prompt_is_tokenized(paced):
    """The tokenizer runs beside the event loop: held inside it, the server still answers."""
    encoder = paced.state._encoder
    inside, go_on = threading.Event(), threading.Event()
    real = encoder.tokenizer

    class Held:
        def __getattr__(self, name):
            return getattr(real, name)

        def __call__(self, *args, **kwargs):
            inside.set()
            go_on.wait(60)
            return real(*args, **kwargs)

    encoder.tokenizer = Held()
    result: dict = {}
    try:
        big = " ".join(["cat"] * 180_000)  # ~0.7 MB of text
        sender = threading.Thread(target=lambda: result.setdefault("r", httpx.post(
            paced.url + "/v1/completions", json={"prompt": big, "max_tokens": 2}, timeout=120)))
        sender.start()
        wait_until(inside.is_set, "the prompt to reach the tokenizer")
        assert httpx.get(paced.url + "/health", timeout=30).json()["status"] == "ok"
    finally:
        go_on.set()
        encoder.tokenizer = real
    sender.join()
    assert result["r"].status_code == 400 and result["r"].json()["error"]["code"] == "context_length_exceeded"
