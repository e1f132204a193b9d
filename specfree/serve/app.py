"""The OpenAI-compatible app: ``create_app(engine, settings)``, or ``create_app(load=...)`` to
answer 503 while a loader builds the engine in the background.

Endpoints: ``POST /v1/chat/completions``, ``POST /v1/completions`` (streamed as server-sent
events or not), ``GET /v1/models``, ``POST /tokenize``, ``POST /detokenize``, ``GET /health``,
``GET /metrics`` (Prometheus).

The event loop only moves bytes: parsing a body, the chat template, tokenizing and building a
request's verifier run in one thread of their own (``Server.prepare``), decoding in the
scheduler's worker. A watcher beside each completion's handler cancels its job as soon as the
client disconnects, streamed or not.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import copy
import hmac
import json
import logging
import secrets
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException
from transformers import (MinPLogitsWarper, RepetitionPenaltyLogitsProcessor, TemperatureLogitsWarper,
                          TopKLogitsWarper, TopPLogitsWarper)

from specfree.conf.schema import ServeConfig
from specfree.errors import SpecfreeError, one_line
from specfree.request import Request as DecodeRequest  # starlette's Request is the HTTP one here
from specfree.serve.errors import APIError, error_body
from specfree.serve.metrics import CONTENT_TYPE_LATEST, Metrics
from specfree.serve.prompt import render
from specfree.serve.protocol import Ask, parse
from specfree.serve.scheduler import BatchScheduler, Job, Scheduler
from specfree.serve.state import SharedState
from specfree.serve.text import FINISH, StopTrim
from specfree.serve.tools import CallSplitter
from specfree.verifiers.processors import LogitBias, PresenceFrequencyPenalty

log = logging.getLogger("specfree.serve")
IGNORED_HEADER = "X-Specfree-Ignored-Fields"


def load_json(body: bytes) -> Any:
    try:
        return json.loads(body)
    except (ValueError, UnicodeDecodeError) as exc:
        raise APIError(400, f"the request body is not valid JSON: {exc}", code="invalid_json") from None


def configured_knobs(verifier) -> dict[str, float]:
    """The sampling knobs a verifier was built with, read from its processors (what a request leaves out keeps)."""
    out: dict[str, float] = {}
    for processor in getattr(verifier, "processors", None) or ():
        if isinstance(processor, TemperatureLogitsWarper):
            out["temperature"] = float(processor.temperature)
        elif isinstance(processor, TopKLogitsWarper):
            out["top_k"] = int(processor.top_k)
        elif isinstance(processor, TopPLogitsWarper):
            out["top_p"] = float(processor.top_p)
        elif isinstance(processor, RepetitionPenaltyLogitsProcessor):
            out["repetition_penalty"] = float(processor.penalty)
    return out


class Server:
    """What the routes share: the settings, the engine once ready, its scheduler and metrics."""

    def __init__(self, engine, settings: ServeConfig, load: Callable[[], Any] | None, model_name: str,
                 on_failure: Callable[[str], None] | None = None):
        self.settings, self.model_name = settings, model_name
        self.engine, self._load, self._on_failure = engine, load, on_failure
        self.metrics = Metrics()
        self.scheduler: Scheduler | None = None
        self.state: SharedState | None = None
        self.failure: str | None = None
        self.created = int(time.time())
        self._encoder = None
        self._pieces = None
        self._reg = None
        self.named: set[str] = set()  # ignored fields already named in the log
        # One thread parses, templates, tokenizes and builds verifiers (a tokenizer is not
        # thread-safe), so a 1 MB prompt never holds up the event loop.
        self.prep = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="specfree-prepare")

    # ---- life ----------------------------------------------------------------------------
    def start(self) -> None:
        if self.engine is not None:
            self._ready(self.engine)
        else:
            threading.Thread(target=self._load_engine, name="specfree-load", daemon=True).start()

    def _load_engine(self) -> None:
        try:
            self._ready(self._load())
        except Exception as exc:  # noqa: BLE001 - reported on /health and by the CLI
            self.failure = one_line(exc) if isinstance(exc, SpecfreeError) else f"{type(exc).__name__}: {one_line(exc)}"
            log.error("the model could not be loaded: %s", self.failure)
            if self._on_failure is not None:
                self._on_failure(self.failure)

    def _ready(self, engine) -> None:
        if self.settings.state_file:
            state = SharedState(engine, self.settings.state_file)
            if state.load():
                log.info("loaded %d requests into the suffix tree from %s", state.requests(), state.path)
            self.state = state
        encoder = copy.copy(engine)  # tokenizes in the preparing thread with a tokenizer of its own
        encoder.tokenizer = copy.deepcopy(engine.tokenizer)
        self._encoder = encoder
        # log-probabilities' token pieces, decoded on the event loop: a third copy (a fast tokenizer
        # may not be used from two threads at once)
        self._pieces = copy.deepcopy(engine.tokenizer)
        # The configured verifier, read here once: while a request runs, the worker lends the engine its own.
        self.verifier = engine.verifier
        self.configured = configured_knobs(engine.verifier)
        engine.prompt_cache = bool(self.settings.prompt_cache)
        if engine.prompt_cache_off is not None:
            log.info("the prompt cache cannot reuse prefixes here: %s", engine.prompt_cache_off)
        batched = self.settings.max_batch > 1 and engine.batch_off is None
        if self.settings.max_batch > 1 and not batched:
            log.info("decoding one request at a time: %s", engine.batch_off)
        scheduler = BatchScheduler(engine, self.settings.queue_size, self.metrics, self.settings.max_batch,
                                   hold_prompts=engine.prompt_cache) if batched \
            else Scheduler(engine, self.settings.queue_size, self.metrics)
        scheduler.start()
        self.engine, self.scheduler = engine, scheduler

    def stop(self) -> None:
        ended = self.scheduler.stop() if self.scheduler is not None else True
        self.prep.shutdown(wait=False, cancel_futures=True)
        if self.state is not None:
            if not ended:  # the worker may still be changing the tree: a save now could be torn
                log.error("the engine did not stop in time; %s was not written", self.state.path)
                return
            self.state.save()
            log.info("saved %d requests of the suffix tree to %s", self.state.requests(), self.state.path)

    # ---- requests ------------------------------------------------------------------------
    def authorize(self, request: Request) -> None:
        key = self.settings.api_key
        if key is None:
            return
        given = request.headers.get("authorization", "")
        scheme, _, token = given.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), key.encode()):
            raise APIError(401, "a valid API key is required: send the header Authorization: Bearer <key>",
                           code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})

    def require_engine(self) -> Scheduler:
        if self.failure is not None:
            raise APIError(500, f"the model could not be loaded: {self.failure}", code="model_load_failed")
        if self.scheduler is None:
            raise APIError(503, "the model is loading; retry shortly", code="model_loading",
                           headers={"Retry-After": "5"})
        return self.scheduler

    async def read_body(self, request: Request) -> bytes:
        limit = self.settings.max_body_bytes
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise APIError(413, f"the request body has {declared} bytes; this server takes at most {limit} "
                                "(serve.max_body_bytes)", code="body_too_large")
        body = bytearray()
        async for part in request.stream():
            body += part
            if len(body) > limit:
                raise APIError(413, f"the request body is larger than {limit} bytes (serve.max_body_bytes)",
                               code="body_too_large")
        return bytes(body)

    async def off_loop(self, fn, *args):
        """``fn(*args)`` in the preparing thread."""
        return await asyncio.get_running_loop().run_in_executor(self.prep, fn, *args)

    def prepare(self, kind: str, body: bytes) -> tuple[Ask, DecodeRequest]:
        """A completion's body checked, its prompt templated and tokenized, its verifier built: the
        request the scheduler decodes (off the loop)."""
        ask = parse(kind, load_json(body), self.settings.max_tokens)
        if ask.tools is not None and ask.tools.calls:
            self.constrain_calls(ask)
        if ask.constraint is not None:
            try:  # compiled here, so that a bad one is this request's 400 before it is queued
                self._encoder.check_constraint(ask.constraint)
            except SpecfreeError as exc:
                raise APIError(400, f"`{ask.constraint_field}`: {one_line(exc)}", ask.constraint_field) from None
        ids = self.encode(ask)
        verifier = self.verifier_for(ask, len(ids))
        try:
            return ask, DecodeRequest(ids, ask.max_tokens or self.settings.max_tokens, verifier, tuple(ask.stop),
                                      self.seed_for(ask, verifier), ask.ignore_eos, ask.logprobs, ask.cache_prompt,
                                      constraint=ask.constraint)
        except SpecfreeError as exc:
            raise APIError(400, one_line(exc)) from None

    def constrain_calls(self, ask: Ask) -> None:
        """The answer held to the tools' call grammar; each tool's schema compiled first, so that one
        that does not compile is named."""
        for where, constraint in ask.tools.parameters_constraints():
            try:
                self._encoder.check_constraint(constraint)
            except SpecfreeError as exc:
                raise APIError(400, f"`{where}`: {one_line(exc)}", where) from None
        ask.constraint, ask.constraint_field = ask.tools.constraint(), ask.tools.field_name

    def name_ignored(self, fields: list[str]) -> None:
        new = [f for f in fields if f not in self.named]
        if new:
            self.named.update(new)
            log.info("ignoring request fields this server does not use: %s (named once)", ", ".join(new))

    def encode(self, ask: Ask) -> list[int]:
        engine = self._encoder
        param = "messages" if ask.kind == "chat" else "prompt"
        try:
            if ask.kind == "chat":
                ids = render(engine.tokenizer, ask.prompt, ask.tools) \
                    if getattr(engine.tokenizer, "chat_template", None) else None
                if ids is None:
                    raise APIError(400, "this model's tokenizer has no chat template: use /v1/completions",
                                   param, "no_chat_template")
                ids = engine.tokenizer(ids, add_special_tokens=False).input_ids
            elif isinstance(ask.prompt, str):
                ids = engine.tokenizer(ask.prompt).input_ids
            else:
                ids = ask.prompt
            context = engine.adapter.max_length
            if len(ids) >= context:
                raise APIError(400, f"the prompt has {len(ids)} tokens but the model's context holds {context}; "
                                    "shorten it", param, "context_length_exceeded")
            return engine.check_ids(ids)  # the engine's own checks: ids in the vocabulary, not empty
        except SpecfreeError as exc:
            raise APIError(400, one_line(exc), param) from None

    def verifier_for(self, ask: Ask, prompt_len: int):
        """The verifier this request asks for, or None for the engine's own (see docs/serve.md).

        A knob the request leaves out keeps the server's configured value (its verifier's), so
        ``top_p`` alone samples at the configured temperature; a greedy server stays greedy."""
        asked = {k: v for k, v in (("top_p", ask.top_p), ("top_k", ask.top_k),
                                   ("repetition_penalty", ask.repetition_penalty)) if v is not None}
        extra = []
        if ask.presence_penalty or ask.frequency_penalty:
            extra.append(PresenceFrequencyPenalty(ask.presence_penalty or 0.0, ask.frequency_penalty or 0.0,
                                                  prompt_len))
        if ask.logit_bias:
            vocab = self.engine.adapter.vocab_size
            outside = [t for t in ask.logit_bias if not 0 <= t < vocab]
            if outside:
                raise APIError(400, f"`logit_bias` names token {outside[0]}, outside the vocabulary [0, {vocab})",
                               "logit_bias")
            extra.append(LogitBias(ask.logit_bias))
        own_samples = getattr(self.verifier, "do_sample", False)
        if ask.temperature is None:
            name = "sampling" if own_samples else "greedy"
        else:
            name = "greedy" if ask.temperature == 0 else "sampling"
        base = dict(self.configured)
        if name == "greedy":  # top_k, top_p, min_p and temperature change nothing there
            asked = {k: v for k, v in asked.items() if k == "repetition_penalty"}
            if not asked and not extra and not own_samples:
                return None  # the engine's own greedy verifier: nothing to change
            knobs = {k: v for k, v in {**base, **asked}.items() if k == "repetition_penalty"}
        else:
            if ask.temperature is None and not asked and not extra and not ask.min_p:
                return None  # the engine's own sampling verifier, as configured
            knobs = {**base, **asked}
            if ask.temperature is not None:
                knobs["temperature"] = ask.temperature
        if extra:
            knobs["logits_processors"] = extra
        from specfree.generation import model_verifier
        from specfree.plugins import build_plugin_manager, registry

        if self._reg is None:
            self._reg = registry(build_plugin_manager())
        try:
            verifier, _ = model_verifier(self._reg, self.engine.adapter.model, knobs,
                                         self.engine.settings.generation, name)
        except (SpecfreeError, ValueError) as exc:
            raise APIError(400, one_line(exc)) from None
        if name == "sampling" and ask.min_p:
            verifier.processors.append(MinPLogitsWarper(ask.min_p))  # after temperature/top-k/top-p, as generate
        return verifier

    def tokenize(self, body: bytes) -> dict:
        """llama-server's ``/tokenize``: ``{"content", "add_special", "with_pieces"}`` -> ``{"tokens"}``."""
        data = load_json(body)
        if not isinstance(data, dict) or not isinstance(data.get("content"), str):
            raise APIError(400, "`content` must be a string", "content", "invalid_type")
        flags = {k: data.get(k, False) for k in ("add_special", "with_pieces")}
        for key, value in flags.items():
            if not isinstance(value, bool):
                raise APIError(400, f"`{key}` must be a boolean", key, "invalid_type")
        tokenizer = self._encoder.tokenizer
        ids = tokenizer(data["content"], add_special_tokens=flags["add_special"]).input_ids
        if not flags["with_pieces"]:
            return {"tokens": ids}
        return {"tokens": [{"id": t, "piece": tokenizer.decode([t])} for t in ids]}

    def detokenize(self, body: bytes) -> dict:
        """llama-server's ``/detokenize``: ``{"tokens": [ids]}`` -> ``{"content"}``."""
        data = load_json(body)
        ids = data.get("tokens") if isinstance(data, dict) else None
        vocab = self.engine.adapter.vocab_size
        if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise APIError(400, "`tokens` must be an array of token ids", "tokens", "invalid_type")
        if any(not 0 <= t < vocab for t in ids):
            raise APIError(400, f"`tokens` must be ids in [0, {vocab})", "tokens")
        return {"content": self._encoder.tokenizer.decode(ids)}

    def seed_for(self, ask: Ask, verifier) -> int | None:
        samples = getattr(verifier if verifier is not None else self.verifier, "do_sample", False)
        if not samples:
            return None
        return ask.seed if ask.seed is not None else secrets.randbelow(2**31)


def create_app(engine=None, settings: ServeConfig | None = None, *, load: Callable[[], Any] | None = None,
               model_name: str = "specfree", on_failure: Callable[[str], None] | None = None) -> FastAPI:
    """The app over ``engine`` (or the one ``load()`` returns, built in a thread after startup;
    ``on_failure(reason)`` is called if that fails, and the app answers 500 from then on).

    ``model_name`` is the id ``/v1/models`` lists; per-request verifiers follow what the engine's
    ``settings.generation`` says of the model's ``generation_config``."""
    if (engine is None) == (load is None):
        raise ValueError("give an engine or a load function, not both")
    server = Server(engine, settings or ServeConfig(), load, model_name, on_failure)
    if engine is not None and server.settings.state_file:
        SharedState(engine, server.settings.state_file)  # a strategy without a suffix drafter: say so now

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        server.start()
        yield
        await asyncio.to_thread(server.stop)

    app = FastAPI(title="specfree", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = server
    if server.settings.cors_origins:
        app.add_middleware(CORSMiddleware, allow_origins=list(server.settings.cors_origins), allow_methods=["*"],
                           allow_headers=["*"], expose_headers=[IGNORED_HEADER])

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError):
        return JSONResponse(exc.body(), exc.status, headers=exc.headers)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException):
        message = {404: f"no such endpoint: {request.method} {request.url.path}",
                   405: f"{request.method} is not allowed on {request.url.path}"}.get(exc.status_code, str(exc.detail))
        return JSONResponse(error_body(exc.status_code, message), exc.status_code, headers=exc.headers)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception):
        log.exception("request failed")
        return JSONResponse(error_body(500, f"internal error: {type(exc).__name__}"), 500)

    @app.middleware("http")
    async def count(request: Request, call_next):
        response = await call_next(request)
        server.metrics.requests.labels(request.url.path if request.url.path in KNOWN else "other",
                                       str(response.status_code)).inc()
        return response

    @app.get("/health")
    async def health():
        if server.failure is not None:
            return JSONResponse({"status": "failed", "error": server.failure}, 500)
        if server.scheduler is None:
            return JSONResponse({"status": "loading"}, 503, headers={"Retry-After": "5"})
        return {"status": "ok", "model": server.model_name, "waiting": server.scheduler.waiting}

    @app.get("/metrics")
    async def metrics(request: Request):
        server.authorize(request)
        return Response(server.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    def model_card() -> dict:
        return {"id": server.model_name, "object": "model", "created": server.created, "owned_by": "specfree"}

    @app.get("/v1/models")
    async def models(request: Request):
        server.authorize(request)
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{name:path}")
    async def model(name: str, request: Request):
        server.authorize(request)
        if name != server.model_name:
            raise APIError(404, f"the model `{name}` does not exist; this server serves `{server.model_name}`",
                           "model", "model_not_found")
        return model_card()

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await complete(request, "chat")

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await complete(request, "completion")

    @app.post("/tokenize")
    async def tokenize(request: Request):
        server.authorize(request)
        server.require_engine()
        return await server.off_loop(server.tokenize, await server.read_body(request))

    @app.post("/detokenize")
    async def detokenize(request: Request):
        server.authorize(request)
        server.require_engine()
        return await server.off_loop(server.detokenize, await server.read_body(request))

    async def complete(request: Request, kind: str):
        arrived = time.monotonic()
        server.authorize(request)
        scheduler = server.require_engine()
        ask, decode = await server.off_loop(server.prepare, kind, await server.read_body(request))
        headers = {}
        if ask.unknown:
            server.name_ignored(ask.unknown)
            headers[IGNORED_HEADER] = ", ".join(ask.unknown)
        job = Job(decode, loop=asyncio.get_running_loop())
        scheduler.submit(job)
        answer = Answer(server, ask, job, arrived)
        if ask.stream:
            return StreamingResponse(answer.stream(request), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **headers})
        response = await answer.whole(request)
        response.headers.update(headers)
        return response

    return app


KNOWN = {"/health", "/metrics", "/v1/models", "/v1/chat/completions", "/v1/completions", "/tokenize", "/detokenize"}


async def watch_disconnect(request: Request, job: Job) -> None:
    """Beside a completion's handler: cancel its job the moment the client disconnects (the body
    was read already, so the next message is the disconnect)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            job.cancel()
            return


class Answer:
    """One request's answer, streamed as server-sent events or whole."""

    def __init__(self, server: Server, ask: Ask, job: Job, arrived: float):
        self.server, self.ask, self.job, self.arrived = server, ask, job, arrived
        self.deadline = arrived + server.settings.request_timeout
        self.id = ("chatcmpl-" if ask.kind == "chat" else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())
        self.trim = StopTrim(ask.stop)
        self.first: float | None = None
        self.offset = 0  # characters of text before the next token (completions' text_offset)
        self.calls = CallSplitter() if ask.tools is not None and ask.tools.calls else None

    async def events(self, request: Request) -> AsyncIterator[tuple[str, Any]]:
        """The job's events until it ends; a timeout or a client gone cancels it."""
        job = self.job
        watcher = asyncio.create_task(watch_disconnect(request, job))
        try:
            while True:
                left = self.deadline - time.monotonic()
                if left <= 0:
                    raise APIError(504, f"the request took longer than {self.server.settings.request_timeout:g} s "
                                        "(serve.request_timeout)", code="timeout")
                try:
                    kind, value = await asyncio.wait_for(job.events.get(), left)
                except asyncio.TimeoutError:
                    continue
                if kind == "error":
                    raise value
                if kind == "chunk" and self.first is None and value.tokens:
                    self.first = time.monotonic()
                    self.server.metrics.ttft.observe(self.first - self.arrived)
                yield kind, value
                if kind in ("done", "cancelled"):
                    return
        finally:
            watcher.cancel()
            job.cancel()  # a no-op once it ended; else it leaves the queue, or the engine drops it before its next step

    def _stats(self, generation) -> dict:
        return {"steps": generation.forwards, "tokens_per_step": round(generation.mean_accepted, 4),
                "accepted_drafts": sum(s.accepted for s in generation.steps),
                "tokens_per_s": round(generation.tokens_per_s, 3), "prefill_s": round(generation.prefill_s, 4),
                "stop_reason": generation.stop_reason, "seed": self.job.request.seed,
                "verifier": getattr(self.job.request.verifier or self.server.verifier, "name", None)}

    def _usage(self, generation) -> dict:
        n, m = generation.prompt_tokens, len(generation.tokens)
        return {"prompt_tokens": n, "completion_tokens": m, "total_tokens": n + m,
                "prompt_tokens_details": {"cached_tokens": generation.cached_tokens}}

    @staticmethod
    def _timings(generation) -> dict:
        """llama-server's ``timings``: the prompt's tokens this request ran (not the reused ones) and
        the prefill's time; the generated tokens and the steps' time (the first step also runs the
        prompt's last token); ``cache_n``: prompt tokens reused from the last request."""
        prompt_n = generation.prompt_tokens - generation.cached_tokens
        prompt_ms = generation.prefill_s * 1000
        predicted_n, predicted_ms = len(generation.tokens), (generation.wall_s - generation.prefill_s) * 1000
        return {"cache_n": generation.cached_tokens, "prompt_n": prompt_n, "prompt_ms": round(prompt_ms, 3),
                "prompt_per_second": round(prompt_n / prompt_ms * 1000, 3) if prompt_ms > 0 else None,
                "predicted_n": predicted_n, "predicted_ms": round(predicted_ms, 3),
                "predicted_per_second": round(predicted_n / predicted_ms * 1000, 3) if predicted_ms > 0 else None}

    # ---- log-probabilities ----------------------------------------------------------------------
    def _piece(self, token: int) -> str:
        return self.server._pieces.decode([token])

    def _chat_logprobs(self, logprobs) -> dict:
        def entry(token: int, logprob: float) -> dict:
            piece = self._piece(token)
            return {"token": piece, "logprob": logprob, "bytes": list(piece.encode("utf-8"))}

        return {"content": [{**entry(lp.token, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]}
                            for lp in logprobs]}

    def _completion_logprobs(self, logprobs) -> dict:
        out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for lp in logprobs:
            piece = self._piece(lp.token)
            out["tokens"].append(piece)
            out["token_logprobs"].append(lp.logprob)
            out["top_logprobs"].append({self._piece(t): v for t, v in lp.top})
            out["text_offset"].append(self.offset)
            self.offset += len(piece)
        return out

    def _logprobs(self, logprobs):
        if self.ask.logprobs is None or logprobs is None:
            return None
        return self._chat_logprobs(logprobs) if self.ask.kind == "chat" else self._completion_logprobs(logprobs)

    # ---- the answer -------------------------------------------------------------------------
    async def whole(self, request: Request) -> JSONResponse:
        text, generation = "", None
        async for kind, value in self.events(request):
            if kind == "chunk":
                text += self.trim.push(value.text)
            elif kind == "done":
                generation = value
        if generation is None:  # the client left: nobody reads this
            return JSONResponse(error_body(499, "the client closed the request"), 499)
        text += self.trim.flush()
        finish = FINISH.get(generation.stop_reason, "stop")
        logprobs = self._logprobs(generation.logprobs)
        if self.ask.kind == "chat":
            message, finish = self._message(text, finish)
            choice = {"index": 0, "message": message, "logprobs": logprobs, "finish_reason": finish}
            kind = "chat.completion"
        else:
            choice = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish}
            kind = "text_completion"
        return JSONResponse({"id": self.id, "object": kind, "created": self.created, "model": self.server.model_name,
                             "choices": [choice], "usage": self._usage(generation),
                             "timings": self._timings(generation), "specfree": self._stats(generation)})

    # ---- tool calls ---------------------------------------------------------------------------
    def _message(self, text: str, finish: str) -> tuple[dict, str]:
        """The assistant's message and finish_reason: the calls in ``text`` taken out of its content."""
        if self.calls is None:
            return {"role": "assistant", "content": text}, finish
        content, calls = self.calls.push(text)
        content += self.calls.flush()
        if not calls:
            return {"role": "assistant", "content": text}, finish
        message = {"role": "assistant", "content": content or None}
        if self.ask.tools.legacy:
            message["function_call"] = calls[0].tool_call()["function"]
        else:
            message["tool_calls"] = [call.tool_call() for call in calls]
        return message, self._finish_calls(finish)

    def _finish_calls(self, finish: str) -> str:
        if finish != "stop" or self.calls is None or not self.calls.calls:
            return finish
        return "function_call" if self.ask.tools.legacy else "tool_calls"

    def _call_deltas(self, calls) -> list[dict]:
        """A chunk for each call that finished: the whole call in one delta (OpenAI clients join a
        call's deltas by its index)."""
        done = len(self.calls.calls) - len(calls)
        if self.ask.tools.legacy:
            return [self._chunk(None, delta={"function_call": call.tool_call()["function"]}) for call in calls]
        return [self._chunk(None, delta={"tool_calls": [call.tool_call(done + i)]}) for i, call in enumerate(calls)]

    def _chunk(self, content: str | None, finish: str | None = None, role: bool = False, logprobs=None,
               delta: dict | None = None) -> dict:
        if self.ask.kind == "chat":
            if delta is None:
                delta = {"role": "assistant", "content": ""} if role else ({} if content is None else {"content": content})
            choice = {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
            kind = "chat.completion.chunk"
        else:
            choice = {"index": 0, "text": content or "", "logprobs": logprobs, "finish_reason": finish}
            kind = "text_completion"
        chunk = {"id": self.id, "object": kind, "created": self.created, "model": self.server.model_name,
                 "choices": [choice]}
        if self.ask.include_usage:
            chunk["usage"] = None
        return chunk

    async def stream(self, request: Request) -> AsyncIterator[bytes]:
        def event(data: dict) -> bytes:
            return b"data: " + json.dumps(data, ensure_ascii=False).encode() + b"\n\n"

        try:
            if self.ask.kind == "chat":
                yield event(self._chunk(None, role=True))
            async for kind, value in self.events(request):
                if kind == "chunk":
                    text = self.trim.push(value.text)
                    logprobs = self._logprobs(value.logprobs)  # the step's tokens, held text or not
                    calls = []
                    if self.calls is not None:
                        text, calls = self.calls.push(text)
                    if text or logprobs:
                        yield event(self._chunk(text, logprobs=logprobs))
                    for chunk in self._call_deltas(calls) if calls else ():
                        yield event(chunk)
                elif kind == "done":
                    tail = self.trim.flush()
                    if self.calls is not None:
                        tail, calls = self.calls.push(tail)
                        for chunk in self._call_deltas(calls) if calls else ():
                            yield event(chunk)
                        tail += self.calls.flush()
                    if tail:
                        yield event(self._chunk(tail))
                    last = self._chunk(None, self._finish_calls(FINISH.get(value.stop_reason, "stop")))
                    last["specfree"] = self._stats(value)
                    last["timings"] = self._timings(value)
                    yield event(last)
                    if self.ask.include_usage:
                        yield event({"id": self.id, "object": last["object"], "created": self.created,
                                     "model": self.server.model_name, "choices": [], "usage": self._usage(value)})
                elif kind == "cancelled":
                    return
        except APIError as exc:  # the answer has begun: the error goes in the stream
            yield event(exc.body())
        yield b"data: [DONE]\n\n"
