"""One engine, one worker thread, a bounded FIFO queue of jobs.

The event loop submits a ``Job``; the worker runs it through ``Engine.stream`` one step at a
time and hands each step's ``Chunk`` back to the loop. A job whose client left (or whose time
ran out) is marked cancelled; the worker sees the mark before the next step, closes the
generator (the drafters end the request as usual) and takes the next job.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from specfree.errors import SpecfreeError, one_line
from specfree.serve.errors import APIError
from specfree.serve.metrics import Metrics

log = logging.getLogger("specfree.serve")


@dataclass(eq=False)
class Job:
    """One request's decoding; events go to ``events`` on the loop: ("chunk", Chunk),
    ("done", Generation), ("error", APIError), ("cancelled", None)."""

    ids: list[int]
    max_tokens: int
    stop: list[str] = field(default_factory=list)
    seed: int | None = None
    verifier: Any = None  # None: the engine's own
    ignore_eos: bool = False
    loop: asyncio.AbstractEventLoop | None = None
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)

    def emit(self, kind: str, value: Any = None) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, value))
        except RuntimeError:  # the loop is gone (the server is shutting down): nobody is listening
            pass

    def cancel(self) -> None:
        self.cancelled.set()


class Scheduler:
    def __init__(self, engine, queue_size: int, metrics: Metrics | None = None):
        self.engine = engine
        self.metrics = metrics or Metrics()
        self._queue: queue.Queue[Job | None] = queue.Queue(maxsize=queue_size)
        self._thread: threading.Thread | None = None
        self._current: Job | None = None
        self._mean_s = 5.0  # running mean of a job's seconds: Retry-After's estimate
        self._stopping = False

    @property
    def waiting(self) -> int:
        return self._queue.qsize()

    def start(self) -> None:
        self._thread = threading.Thread(target=self._work, name="specfree-engine", daemon=True)
        self._thread.start()

    def submit(self, job: Job) -> None:
        if self._stopping:
            raise APIError(503, "the server is shutting down", code="shutting_down")
        try:
            self._queue.put_nowait(job)
        except queue.Full:
            wait = max(1, min(60, round(self._mean_s * (self.waiting + 1))))
            raise APIError(429, f"the queue is full ({self._queue.maxsize} requests waiting); retry in about "
                                f"{wait} s", code="queue_full", headers={"Retry-After": str(wait)}) from None
        self.metrics.queue_length.set(self.waiting)

    def stop(self, timeout: float = 30.0) -> None:
        """Cancel the running job and every waiting one, and end the worker."""
        self._stopping = True
        while True:
            try:
                job = self._queue.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                job.cancel()
                job.emit("error", APIError(503, "the server is shutting down", code="shutting_down"))
        if self._current is not None:
            self._current.cancel()
        self._queue.put(None)
        if self._thread is not None:
            self._thread.join(timeout)

    def _work(self) -> None:
        while True:
            job = self._queue.get()
            self.metrics.queue_length.set(self.waiting)
            if job is None:
                return
            if job.cancelled.is_set():
                job.emit("cancelled")
                continue
            self._current = job
            self.metrics.running.set(1)
            start = time.perf_counter()
            try:
                self._run(job)
            finally:
                self._current = None
                self.metrics.running.set(0)
                self._mean_s += 0.2 * (time.perf_counter() - start - self._mean_s)

    def _run(self, job: Job) -> None:
        engine = self.engine
        own = engine.verifier
        if job.verifier is not None:
            engine.verifier = job.verifier  # read once, when the generator starts (below)
        steps = engine.stream(job.ids, job.max_tokens, stop=job.stop, seed=job.seed, ignore_eos=job.ignore_eos)
        try:
            while True:
                if job.cancelled.is_set():
                    steps.close()  # the drafters end the request; the engine is free
                    self.metrics.cancelled.inc()
                    job.emit("cancelled")
                    return
                try:
                    chunk = next(steps)
                except StopIteration as done:
                    self.metrics.finished(done.value)
                    job.emit("done", done.value)
                    return
                job.emit("chunk", chunk)
        except SpecfreeError as exc:
            job.emit("error", APIError(400, one_line(exc)))
        except Exception as exc:  # a bug or a broken model: this request fails, the server goes on
            log.exception("decoding failed")
            job.emit("error", APIError(500, f"decoding failed: {type(exc).__name__}: {one_line(exc)}",
                                       code="internal_error"))
        finally:
            steps.close()
            engine.verifier = own
