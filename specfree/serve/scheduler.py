"""One engine, one worker thread, a bounded FIFO queue of jobs.

The event loop submits a ``Job``: a ``Request`` (its prompt ids, its own verifier, stops and
budget) and where its events go. ``Scheduler``'s worker runs one job at a time through
``Engine.run`` (a batch of one); ``BatchScheduler``'s runs up to ``max_batch`` together (``specfree.batching``:
one forward a step for all of them, each answer bit-identical to decoding it alone), taking the
next job from the queue as soon as one finishes. Either hands each step's ``Chunk`` back to the loop. A job whose client left (or whose time
ran out) is marked cancelled: a waiting one leaves the queue at once (its place is free for the
next request), a running one is seen by the worker before the next step, which closes the
generator (the drafters end the request as usual) and takes the next job.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from specfree.errors import SpecfreeError, one_line
from specfree.request import Request
from specfree.serve.errors import APIError
from specfree.serve.metrics import Metrics

log = logging.getLogger("specfree.serve")


@dataclass(eq=False)
class Job:
    """One request's decoding (``request``: what it asks, its own verifier among it); events go to
    ``events`` on the loop: ("chunk", Chunk), ("done", Generation), ("error", APIError), ("cancelled", None)."""

    request: Request
    loop: asyncio.AbstractEventLoop | None = None
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    on_cancel: Callable[["Job"], None] | None = None  # the scheduler's: take it out of the queue

    def emit(self, kind: str, value: Any = None) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, value))
        except RuntimeError:  # the loop is gone (the server is shutting down): nobody is listening
            pass

    def cancel(self) -> None:
        if self.cancelled.is_set():
            return
        self.cancelled.set()
        if self.on_cancel is not None:
            self.on_cancel(self)


class Scheduler:
    def __init__(self, engine, queue_size: int, metrics: Metrics | None = None):
        self.engine = engine
        self.metrics = metrics or Metrics()
        self.queue_size = queue_size
        self._queue: deque[Job] = deque()
        self._lock = threading.Condition()
        self._thread: threading.Thread | None = None
        self._running: set[Job] = set()
        self._mean_s = 5.0  # running mean of a job's seconds: Retry-After's estimate
        self._stopping = False

    @property
    def waiting(self) -> int:
        return len(self._queue)

    places = 1  # jobs decoded at once: a place frees every mean job time / places (Retry-After)

    @property
    def running(self) -> list[Job]:
        """The jobs being decoded now."""
        return list(self._running)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._work, name="specfree-engine", daemon=True)
        self._thread.start()

    def submit(self, job: Job) -> None:
        with self._lock:
            if self._stopping:
                raise APIError(503, "the server is shutting down", code="shutting_down")
            if len(self._queue) >= self.queue_size:
                wait = max(1, min(60, round(self._mean_s * (self.waiting + 1) / self.places)))
                raise APIError(429, f"the queue is full ({self.queue_size} requests waiting); retry in about "
                                    f"{wait} s", code="queue_full", headers={"Retry-After": str(wait)})
            job.on_cancel = self._withdraw
            self._queue.append(job)
            self.metrics.queue_length.set(self.waiting)
            self._lock.notify()

    def _withdraw(self, job: Job) -> None:
        """A cancelled job leaves the queue at once (a running one ends before its next step)."""
        with self._lock:
            try:
                self._queue.remove(job)
            except ValueError:  # running, or already taken
                return
            self.metrics.queue_length.set(self.waiting)
            self.metrics.cancelled.inc()
        job.emit("cancelled")

    def stop(self, timeout: float = 120.0) -> bool:
        """Cancel the running job and every waiting one, and wait for the worker to end (so the
        drafters' state is still before it is saved); False if it did not end within ``timeout``."""
        with self._lock:
            self._stopping = True
            waiting, self._queue = list(self._queue), deque()
            self.metrics.queue_length.set(0)
            self._lock.notify()
        for job in waiting:
            job.cancelled.set()
            job.emit("error", APIError(503, "the server is shutting down", code="shutting_down"))
        for job in list(self._running):
            job.cancel()
        if self._thread is None:
            return True
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def _next(self) -> Job | None:
        with self._lock:
            while not self._queue and not self._stopping:
                self._lock.wait()
            if self._stopping:
                return None
            job = self._queue.popleft()
            self._running = {job}
            self.metrics.queue_length.set(self.waiting)
            return job

    def _work(self) -> None:
        while True:
            job = self._next()
            if job is None:
                return
            self.metrics.running.set(1)
            start = time.perf_counter()
            try:
                self._run(job)
            finally:
                self._running = set()
                self.metrics.running.set(0)
                self._mean_s += 0.2 * (time.perf_counter() - start - self._mean_s)

    def _run(self, job: Job) -> None:
        steps = self.engine.run(job.request)
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
        except Exception as exc:  # noqa: BLE001 - this request fails, the server goes on
            job.emit("error", api_error(exc))
        finally:
            steps.close()


def api_error(exc: BaseException) -> APIError:
    """A request's failure as the client sees it: 400 for what it asked, 500 for a bug or a broken model."""
    if isinstance(exc, SpecfreeError):
        return APIError(400, one_line(exc))
    log.error("decoding failed", exc_info=exc)
    return APIError(500, f"decoding failed: {type(exc).__name__}: {one_line(exc)}", code="internal_error")


class BatchScheduler(Scheduler):
    """Up to ``max_batch`` jobs decoded together (continuous batching): a job joins the batch
    between two steps as soon as there is room; the queue holds the rest, ``queue_size`` at most.
    ``hold_prompts``: a finished job's KV waits for the next turn of its chat (the prompt cache).
    ``max_batch`` None: the engine's setting."""

    def __init__(self, engine, queue_size: int, metrics: Metrics | None = None, max_batch: int | None = None,
                 hold_prompts: bool = True):
        super().__init__(engine, queue_size, metrics)
        self.places, self.hold_prompts = max_batch, hold_prompts

    def _admit(self, batch, jobs: dict) -> list[Job] | None:
        """The jobs that join now (waiting for one while nothing runs); None once stopping."""
        with self._lock:
            while not self._queue and not jobs and not self._stopping:
                self._lock.wait()
            if self._stopping:
                return None
            joining = [self._queue.popleft() for _ in range(min(batch.room, len(self._queue)))]
            self._running = set(jobs.values()) | set(joining)
            self.metrics.queue_length.set(self.waiting)
            return joining

    def _work(self) -> None:
        from specfree.batching import Batch

        batch = Batch(self.engine, self.places, hold_prompts=self.hold_prompts)
        jobs: dict = {}  # Member -> Job
        try:
            while (joining := self._admit(batch, jobs)) is not None:
                for job in joining:
                    try:
                        member = batch.add(job.request)
                    except Exception as exc:  # noqa: BLE001 - a setting the batch refuses: this job alone
                        job.emit("error", api_error(exc))
                        continue
                    jobs[member] = job
                for member, job in list(jobs.items()):
                    if job.cancelled.is_set():
                        batch.cancel(member)
                        del jobs[member]
                        self.metrics.cancelled.inc()
                        job.emit("cancelled")
                self._running = set(jobs.values())
                self.metrics.running.set(len(jobs))
                for event in batch.step() if jobs else ():
                    job = jobs.get(event.member)
                    if job is None:
                        continue
                    if event.chunk is not None:
                        job.emit("chunk", event.chunk)
                    if event.result is not None:
                        self.metrics.finished(event.result)
                        job.emit("done", event.result)
                        self._mean_s += 0.2 * (time.perf_counter() - event.member.joined - self._mean_s)
                    elif event.error is not None:
                        job.emit("error", api_error(event.error))
                    if event.result is not None or event.error is not None:
                        del jobs[event.member]
                self._running = set(jobs.values())
        finally:
            for member, job in jobs.items():
                job.emit("error", APIError(503, "the server is shutting down", code="shutting_down"))
            batch.close()
            self._running = set()
            self.metrics.running.set(0)
