"""``specfree serve`` against a live server on a tiny random model, through the real ``openai`` client.

The answers must be the engine's own (greedy and seeded sampling alike), under concurrency too;
every bad request gets its status and the server keeps serving.
"""

from __future__ import annotations

import asyncio
import signal
import socket
import subprocess
import sys
import threading

import httpx
import openai
import pytest

from specfree import Engine
from specfree.request import Request
from tests.serve.conftest import Paced, live, tiny_engine, wait_until
from tests.tiny_models import tiny_model, tiny_tokenizer

WORDS = "the cat sat on the red car and the dog ran to the big house one two three".split()
PROMPTS = [" ".join(WORDS[i:] + WORDS[:i]) for i in range(16)]


def chat(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def reference(prompt, max_tokens: int, **sampling) -> str:
    """What ``decode`` gives: the engine's own generate (lossless: plain decoding's output)."""
    engine = Engine.from_model(tiny_model("llama"), tiny_tokenizer(), "autoregressive", **sampling)
    seed = sampling.pop("seed", None)
    return engine.generate(prompt, max_tokens, seed=seed).text


def streamed_text(stream) -> str:
    return "".join(part.choices[0].delta.content or "" for part in stream if part.choices)


def test_greedy_answers_equal_decode(server):
    client = server.client()
    for text in PROMPTS[:3]:
        want = reference(chat(text), 24)
        whole = client.chat.completions.create(model="tiny", messages=chat(text), max_tokens=24)
        assert whole.choices[0].message.content == want
        assert whole.usage.completion_tokens <= 24 and whole.choices[0].finish_reason in ("stop", "length")
        parts = list(client.chat.completions.create(model="tiny", messages=chat(text), max_tokens=24, stream=True,
                                                    stream_options={"include_usage": True}))
        assert streamed_text(parts) == want
        assert parts[-1].usage.completion_tokens == whole.usage.completion_tokens  # the usage chunk comes last
        assert parts[-2].choices[0].finish_reason == whole.choices[0].finish_reason
    plain = client.completions.create(model="tiny", prompt=PROMPTS[4], max_tokens=16, temperature=0)
    assert plain.choices[0].text == reference(PROMPTS[4], 16)
    streamed = "".join(p.choices[0].text for p in client.completions.create(
        model="tiny", prompt=PROMPTS[4], max_tokens=16, temperature=0, stream=True))
    assert streamed == plain.choices[0].text


def test_seeded_sampling_equals_the_engines(server):
    client = server.client()
    for seed in (3, 11):
        want = reference(chat(PROMPTS[5]), 20, do_sample=True, temperature=0.9, top_p=0.95, seed=seed)
        got = client.chat.completions.create(model="tiny", messages=chat(PROMPTS[5]), max_tokens=20,
                                             temperature=0.9, top_p=0.95, seed=seed)
        assert got.choices[0].message.content == want
        assert got.model_extra["specfree"]["seed"] == seed
        parts = client.chat.completions.create(model="tiny", messages=chat(PROMPTS[5]), max_tokens=20,
                                               temperature=0.9, top_p=0.95, seed=seed, stream=True)
        assert streamed_text(parts) == want
    # top_k and a repetition penalty, through specfree's own field
    want = reference(PROMPTS[6], 16, do_sample=True, temperature=0.7, top_k=5, repetition_penalty=1.3, seed=5)
    got = client.completions.create(model="tiny", prompt=PROMPTS[6], max_tokens=16, temperature=0.7, seed=5,
                                    extra_body={"specfree": {"top_k": 5, "repetition_penalty": 1.3}})
    assert got.choices[0].text == want


def test_stop_strings_end_the_answer_before_them(server):
    client = server.client()
    full = reference(PROMPTS[7], 30)
    words = full.split()
    assert len(words) > 4, full
    stop = " ".join(words[2:4])
    want = full[: full.index(stop)]
    assert client.completions.create(model="tiny", prompt=PROMPTS[7], max_tokens=30, stop=stop).choices[0].text == want
    parts = client.completions.create(model="tiny", prompt=PROMPTS[7], max_tokens=30, stop=[stop, "zzz"], stream=True)
    chunks = list(parts)
    assert "".join(p.choices[0].text for p in chunks) == want
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_sixteen_concurrent_streams_each_get_their_own_answer(server):
    wants = [reference(chat(p), 12) for p in PROMPTS]

    async def one(client, text):
        stream = await client.chat.completions.create(model="tiny", messages=chat(text), max_tokens=12, stream=True)
        return "".join([part.choices[0].delta.content or "" async for part in stream if part.choices])

    async def all_at_once():
        client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
        async with client:
            return await asyncio.gather(*(one(client, p) for p in PROMPTS))

    assert asyncio.run(all_at_once()) == wants


def test_requests_that_arrive_together_share_each_forward_and_answer_as_alone():
    """Six jobs queued at once: the worker decodes four together (continuous batching: the last two
    join as the first finish), and every answer is the one the engine gives it alone."""
    from specfree.serve.scheduler import BatchScheduler, Job

    engine = tiny_engine("prompt_lookup")
    prompts = [engine.encode(p) for p in PROMPTS[:6]]

    async def run():
        scheduler = BatchScheduler(engine, queue_size=8, max_batch=4)
        loop = asyncio.get_running_loop()
        jobs = [Job(Request(ids, 6 + 2 * i, ignore_eos=True), loop=loop) for i, ids in enumerate(prompts)]
        for job in jobs:
            scheduler.submit(job)
        scheduler.start()
        done = []
        for job in jobs:
            while (event := await asyncio.wait_for(job.events.get(), 60))[0] == "chunk":
                pass
            done.append(event)
        assert scheduler.stop()
        return done

    done = asyncio.run(run())
    assert [kind for kind, _ in done] == ["done"] * 6
    assert max(step.extra["batch.requests"] for _, result in done for step in result.steps) == 4
    for i, (ids, (_, result)) in enumerate(zip(prompts, done)):
        assert result.tokens == engine.generate(ids, 6 + 2 * i, ignore_eos=True).tokens


BAD = [  # (body, status, words the message must hold)
    ({"messages": chat("hi"), "n": 2}, 400, ["`n`"]),
    ({"messages": chat("hi"), "top_logprobs": 2}, 400, ["`top_logprobs`", "logprobs: true"]),
    ({"messages": chat("hi"), "logprobs": True, "top_logprobs": 21}, 400, ["`top_logprobs`", "20"]),
    ({"messages": chat("hi"), "logit_bias": {"5": 300}}, 400, ["logit_bias[5]"]),
    ({"messages": chat("hi"), "logit_bias": {"999999": 1}}, 400, ["999999", "vocabulary"]),
    ({"messages": chat("hi"), "seed": -2}, 400, ["`seed`"]),
    ({"messages": chat("hi"), "n_predict": 8, "max_tokens": 9}, 400, ["n_predict"]),
    ({"messages": chat("hi"), "cache_prompt": "no"}, 400, ["`cache_prompt`", "boolean"]),
    ({"messages": chat("hi"), "tools": [{"type": "function"}]}, 400, ["`tools[0]`"]),
    ({"messages": chat("hi"), "temperature": "hot"}, 400, ["`temperature`", "number"]),
    ({"messages": chat("hi"), "max_tokens": 65}, 400, ["`max_tokens`", "64"]),
    ({"messages": chat("hi"), "top_p": 0}, 400, ["`top_p`"]),
    ({"messages": chat("hi"), "stream": "yes"}, 400, ["`stream`", "boolean"]),
    ({"messages": chat("hi"), "specfree": {"draft": 3}}, 400, ["specfree.draft"]),
    ({"messages": [{"role": "tool", "content": "x"}]}, 400, ["tool_call_id", "required"]),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400, ["text parts"]),
    ({"messages": chat("hi"), "stream_options": {"include_usage": True}}, 400, ["stream_options"]),
    ({}, 400, ["`messages` is required"]),
    ({"messages": chat(" ".join(["the cat"] * 300))}, 400, ["605 tokens", "512"]),
    ([1, 2], 400, ["JSON object"]),
]


@pytest.mark.parametrize("body, status, words", BAD, ids=[f"{i}-{s}" for i, (_, s, _) in enumerate(BAD)])
def test_a_bad_request_gets_its_status_and_the_next_is_served(server, body, status, words):
    answer = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)
    assert answer.status_code == status, answer.text
    error = answer.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert all(w in error["message"] for w in words), error["message"]
    good = server.client().chat.completions.create(model="tiny", messages=chat("hi"), max_tokens=4)
    assert good.choices[0].message.content == reference(chat("hi"), 4)


def test_malformed_bodies_and_paths(server):
    post = lambda path, **kw: httpx.post(server.url + path, timeout=60, **kw)  # noqa: E731
    assert post("/v1/chat/completions", content=b"{not json").status_code == 400
    assert post("/v1/completions", json={"prompt": ["a", "b"]}).json()["error"]["param"] == "prompt"
    assert post("/v1/completions", json={"prompt": "hi", "echo": True}).status_code == 400
    too_big = post("/v1/completions", json={"prompt": "x" * 30_000})
    assert too_big.status_code == 413 and "max_body_bytes" in too_big.json()["error"]["message"]
    assert post("/v1/nothing", json={}).status_code == 404
    assert httpx.get(server.url + "/v1/chat/completions").status_code == 405
    with pytest.raises(openai.NotFoundError):
        server.client().models.retrieve("other")
    assert httpx.get(server.url + "/health").json()["status"] == "ok"
    assert [m.id for m in server.client().models.list()] == ["tiny"]
    metrics = httpx.get(server.url + "/metrics").text
    for name in ("specfree_requests_total", "specfree_queue_length", "specfree_completion_tokens_total",
                 "specfree_tokens_per_step_bucket", "specfree_request_tokens_per_second_bucket"):
        assert name in metrics


@pytest.fixture(scope="module")
def guarded(one_thread):
    """A server with a key, one waiting place, a short timeout, and steps the test paces."""
    engine = tiny_engine(cls=Paced)
    with live(engine, api_key="sekrit", queue_size=1, request_timeout=4, max_tokens=64, max_batch=1) as running:
        yield running


def test_a_request_without_the_key_gets_401(guarded):
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sekrit"}):
        answer = httpx.post(guarded.url + "/v1/chat/completions", json={"messages": chat("hi")}, headers=headers)
        assert answer.status_code == 401 and answer.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(guarded.url + "/metrics").status_code == 401
    assert httpx.post(guarded.url + "/tokenize", json={"content": "hi"}).status_code == 401
    with pytest.raises(openai.AuthenticationError):
        guarded.client("wrong").models.list()
    got = guarded.client("sekrit").chat.completions.create(model="tiny", messages=chat("hi"), max_tokens=4)
    assert got.choices[0].message.content == reference(chat("hi"), 4)


def test_a_full_queue_answers_429_then_serves_everyone(guarded):
    engine, scheduler = guarded.state.engine, guarded.state.scheduler
    client = guarded.client("sekrit")
    answers: dict[str, str] = {}
    engine.pace()
    try:
        first = threading.Thread(target=lambda: answers.__setitem__(
            "a", client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=8).choices[0].text))
        first.start()
        wait_until(lambda: scheduler.running, "the first request to reach the engine")
        second = threading.Thread(target=lambda: answers.__setitem__(
            "b", client.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=8).choices[0].text))
        second.start()
        wait_until(lambda: scheduler.waiting == 1, "the second request to wait")
        full = httpx.post(guarded.url + "/v1/completions", json={"prompt": "hi"},
                          headers={"Authorization": "Bearer sekrit"})
        assert full.status_code == 429 and int(full.headers["Retry-After"]) >= 1
        assert full.json()["error"]["type"] == "rate_limit_error"
    finally:
        engine.paced = False
        engine.release(100)
    first.join(), second.join()
    assert answers == {"a": reference(PROMPTS[0], 8), "b": reference(PROMPTS[1], 8)}


def test_a_request_past_its_timeout_gets_504_and_frees_the_engine(guarded):
    engine, scheduler = guarded.state.engine, guarded.state.scheduler
    engine.pace()
    try:
        late = httpx.post(guarded.url + "/v1/completions", json={"prompt": PROMPTS[2], "max_tokens": 8},
                          headers={"Authorization": "Bearer sekrit"}, timeout=60)
        assert late.status_code == 504 and "request_timeout" in late.json()["error"]["message"]
    finally:
        engine.paced = False
        engine.release(100)
    wait_until(lambda: not scheduler.running, "the engine to drop the request")
    got = guarded.client("sekrit").completions.create(model="tiny", prompt=PROMPTS[2], max_tokens=8)
    assert got.choices[0].text == reference(PROMPTS[2], 8)


def test_a_client_dropped_mid_stream_frees_the_engine_for_the_next(guarded):
    engine, scheduler = guarded.state.engine, guarded.state.scheduler
    client = guarded.client("sekrit")
    cancelled = guarded.state.metrics.cancelled._value.get()
    engine.pace()
    try:
        stream = client.completions.create(model="tiny", prompt=PROMPTS[3], max_tokens=60, stream=True,
                                           extra_body={"specfree": {"ignore_eos": True}})
        before = engine.steps_run
        engine.release(1)  # one step: the first text
        got = ""
        for part in stream:
            got += part.choices[0].text
            if got:
                break
        job = scheduler.running[0]  # it cannot end without a second step
        stream.close()  # the client goes away after its first text
        wait_until(job.cancelled.is_set, "the server to see the client go")
        engine.release(1)  # the step the worker may be waiting in; before the next one it drops the request
        wait_until(lambda: guarded.state.metrics.cancelled._value.get() == cancelled + 1,
                   "the engine to drop the request")
        assert engine.steps_run - before in (1, 2)  # 1: it saw the client go before asking for step 2
        wait_until(lambda: not scheduler.running, "the worker to be free")
    finally:
        engine.paced = False
        engine.release(100)
    nxt = client.completions.create(model="tiny", prompt=PROMPTS[3], max_tokens=12)
    assert nxt.choices[0].text == reference(PROMPTS[3], 12)


def test_503_while_the_model_loads(one_thread):
    from specfree.serve import create_app
    from tests.serve.conftest import LiveServer

    loaded = threading.Event()
    engine = tiny_engine()

    def load():
        loaded.wait(60)
        return engine

    with LiveServer(create_app(load=load, model_name="tiny")) as running:
        assert httpx.get(running.url + "/health").status_code == 503
        with pytest.raises(openai.InternalServerError) as busy:
            running.client().chat.completions.create(model="tiny", messages=chat("hi"), max_tokens=2)
        assert busy.value.status_code == 503
        loaded.set()
        wait_until(lambda: httpx.get(running.url + "/health").status_code == 200, "the model to load")
        got = running.client().chat.completions.create(model="tiny", messages=chat("hi"), max_tokens=4)
        assert got.choices[0].message.content == reference(chat("hi"), 4)


def test_the_suffix_tree_is_saved_at_shutdown_and_loaded_at_start(tmp_path, one_thread):
    path = tmp_path / "suffix.state"
    with live(tiny_engine(), state_file=str(path)) as running:
        for text in PROMPTS[:3]:
            running.client().completions.create(model="tiny", prompt=text, max_tokens=8)
        assert not path.exists()  # written at shutdown, not per request
    assert path.exists()
    with live(tiny_engine(), state_file=str(path)) as running:
        assert running.state.state.requests() == 3


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_the_cli_serves_a_model_folder(tiny_llama_dir, tmp_path):
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "specfree", "serve", "model=local", f"model.path={tiny_llama_dir}",
                             "strategy=autoregressive", "threads=1", f"serve.port={port}", "serve.model_name=tiny",
                             f"hydra.run.dir={tmp_path}"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        url = f"http://127.0.0.1:{port}"

        def healthy() -> bool:
            assert proc.poll() is None, proc.communicate()[1]
            try:
                return httpx.get(url + "/health").status_code == 200
            except httpx.TransportError:
                return False

        wait_until(healthy, "the CLI's server to load the model")
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        got = client.chat.completions.create(model="tiny", messages=chat("hi"), max_tokens=4)
        assert got.choices[0].message.content == reference(chat("hi"), 4)
    finally:
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0 and "Traceback" not in err, err  # a clean shutdown, quietly


def test_the_cli_says_why_it_cannot_serve(tiny_llama_dir, tmp_path):
    from specfree.conf.schema import ServeConfig
    from specfree.errors import ConfigError
    from specfree.serve.cli import check_settings, listen
    from tests.helpers import run_cli

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        with pytest.raises(ConfigError, match=f"cannot listen on 127.0.0.1:{port}"):
            listen("127.0.0.1", port)
    for bad in ({"queue_size": 0}, {"port": 70000}, {"api_key": " "}, {"log_level": "loud"}):
        with pytest.raises(ConfigError, match="serve."):
            check_settings(ServeConfig(**bad))
    # the model loads after the server listens: a failure there stops it, with the reason
    no_tree = run_cli("serve", "model=local", f"model.path={tiny_llama_dir}", "strategy=prompt_lookup",
                      "strategy.priced=false", "serve.port=0", "threads=1", f"serve.state_file={tmp_path / 'x.state'}",
                      f"hydra.run.dir={tmp_path}")
    assert no_tree.returncode == 2 and "no suffix drafters" in no_tree.stderr.splitlines()[-1], no_tree.stderr


def test_a_state_file_needs_a_suffix_drafter(tmp_path):
    from specfree.conf.schema import ServeConfig
    from specfree.errors import ConfigError
    from specfree.serve import create_app

    with pytest.raises(ConfigError, match="suffix drafter"):
        create_app(tiny_engine("prompt_lookup"), ServeConfig(state_file=str(tmp_path / "s.state")))


def test_the_warm_up_before_health_leaves_what_the_engine_drafts_and_prices_as_it_was():
    from specfree.serve.cli import warm_up

    warmed, fresh = tiny_engine(), tiny_engine()
    warm_up(warmed)
    prompt = chat("the cat and the dog")
    a, b = warmed.generate(prompt, 24, chat=True), fresh.generate(prompt, 24, chat=True)
    assert a.tokens == b.tokens
    assert [(s.offered, s.rows, s.accepted) for s in a.steps] == [(s.offered, s.rows, s.accepted) for s in b.steps]
