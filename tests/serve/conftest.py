"""A live server in a thread on a free port of 127.0.0.1, over a tiny random Llama."""

from __future__ import annotations

import copy
import threading
import time

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("openai")

import uvicorn  # noqa: E402

from specfree import Engine  # noqa: E402
from specfree.conf.schema import ServeConfig  # noqa: E402
from specfree.cost import CostModel  # noqa: E402
from specfree.serve import create_app  # noqa: E402
from specfree.serve.cli import listen  # noqa: E402
from tests.tiny_models import tiny_model, tiny_tokenizer  # noqa: E402

CPU_LIKE = CostModel([1, 2, 4, 8, 16, 32], [1.0, 1.2, 1.5, 1.8, 2.0, 2.4])
WAIT_S = 120  # an upper bound for waits on a busy machine, never a timing assertion


def wait_until(check, what: str) -> None:
    end = time.monotonic() + WAIT_S
    while not check():
        if time.monotonic() > end:
            raise AssertionError(f"gave up waiting for {what}")
        time.sleep(0.01)


class Paced(Engine):
    """An engine whose steps each wait for a permit while ``paced`` is set: tests decide when
    the worker moves on (a request held at its first step, a client gone between two steps)."""

    paced = False
    permits: threading.Semaphore
    steps_run = 0

    def run(self, request):
        inner = super().run(request)
        try:
            while True:
                if self.paced:
                    self.permits.acquire(timeout=WAIT_S)
                try:
                    chunk = next(inner)
                except StopIteration as done:
                    return done.value
                self.steps_run += 1
                yield chunk
        finally:
            inner.close()

    def pace(self) -> None:
        """From now on every step waits for a permit (none are left over from before)."""
        self.permits = threading.Semaphore(0)
        self.paced = True

    def release(self, n: int = 1) -> None:
        for _ in range(n):
            self.permits.release()


def tiny_engine(strategy: str = "hybrid", cls=Engine, **knobs) -> Engine:
    """A model of its own (the tests decode on the same weights in their own thread)."""
    engine = cls.from_model(copy.deepcopy(tiny_model("llama")), tiny_tokenizer(), strategy, costs=CPU_LIKE, **knobs)
    if cls is Paced:
        engine.permits = threading.Semaphore(0)
    return engine


class LiveServer:
    def __init__(self, app):
        self.app = app
        self.sock = listen("127.0.0.1", 0)
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=2))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    @property
    def state(self):
        return self.app.state.server

    def __enter__(self) -> LiveServer:
        self.thread.start()
        wait_until(lambda: self.server.started, "the server to start")
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(WAIT_S)

    def client(self, key: str | None = None, **kw):
        import openai

        return openai.OpenAI(base_url=self.url + "/v1", api_key=key or "none", max_retries=0, **kw)


def live(engine, **settings) -> LiveServer:
    return LiveServer(create_app(engine, ServeConfig(**settings), model_name="tiny"))


@pytest.fixture(scope="module")
def server(one_thread):
    with live(tiny_engine(), queue_size=32, max_tokens=64, max_body_bytes=20_000) as running:
        yield running
