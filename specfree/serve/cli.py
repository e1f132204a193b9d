"""``python -m specfree serve [overrides]``: load the configured engine behind the app and run uvicorn.

The server listens at once and answers 503 while the model loads; a model that cannot be loaded
stops it with the reason (exit code 2). Ctrl-C (or SIGTERM) ends the running request, answers the
waiting ones 503 and saves ``serve.state_file``.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import socket
import sys
import time
from pathlib import Path

from specfree.errors import ConfigError, SpecfreeError, check_float, check_int
from specfree.settings import EngineSettings, use_threads

log = logging.getLogger("specfree.serve")
LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")


class CleanShutdown(logging.Filter):
    """Drops the one error uvicorn logs on Ctrl-C after a clean shutdown: it re-raises the signal,
    which cancels the app's lifespan task; starlette reports the cancellation as a failed shutdown
    with its traceback's text, which uvicorn logs as an error."""

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage().rstrip()
        return not (text.startswith("Traceback") and text.endswith("CancelledError"))


def check_settings(s) -> None:
    check_int("serve.port", s.port, low=0, high=65535)
    check_int("serve.queue_size", s.queue_size, low=1)
    check_float("serve.request_timeout", s.request_timeout, low=0.0, low_open=True)
    check_int("serve.max_body_bytes", s.max_body_bytes, low=1024)
    check_int("serve.max_tokens", s.max_tokens, low=1)
    if s.api_key is not None and not str(s.api_key).strip():
        raise ConfigError("serve.api_key is empty: give a key, or null for none")
    if s.log_level not in LOG_LEVELS:
        raise ConfigError(f"serve.log_level must be one of {', '.join(LOG_LEVELS)}, got {s.log_level!r}")


def served_name(cfg) -> str:
    if cfg.serve.model_name:
        return str(cfg.serve.model_name)
    return Path(str(cfg.model.path)).name if cfg.model.path else str(cfg.model.name)


def listen(host: str, port: int) -> socket.socket:
    """The listening socket, opened before anything loads: a port in use is one clear line."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise ConfigError(f"cannot listen on {host}:{port}: {exc.strerror} (set serve.host=... serve.port=...)") from None
    sock.listen(128)
    sock.set_inheritable(True)
    return sock


WARM_UP_TOKENS = 4


def warm_up(engine) -> None:
    """One short request before ``/health`` says ok, so the first client's request pays none of the
    first calls' costs (the chat template's compile, the first forwards through the kernels and the
    mapped codes, the drafters' compiled functions) and is as fast as the tenth. It runs on a copy
    whose drafter and pricing statistics are copies too: what the served engine drafts and prices
    afterwards is what it would have been without it. The grammar compiler's conversion of the
    tokenizer is made on the served engine itself: the first request with a schema or tools pays
    none of it (a tokenizer constraints cannot use says so in each such request's 400)."""
    from specfree.constraints import Constraint

    if engine.tokenizer is not None:
        with contextlib.suppress(SpecfreeError):
            engine.check_constraint(Constraint.from_options(json_object=True))
    warm = copy.copy(engine)
    warm.strategy, warm.pricer = copy.deepcopy(engine.strategy), copy.deepcopy(engine.pricer)
    chat = bool(getattr(engine.tokenizer, "chat_template", None))
    prompt = [{"role": "user", "content": "Hello!"}] if chat else "Hello!"
    warm.generate(prompt if engine.tokenizer is not None else [1, 2, 3], WARM_UP_TOKENS, chat=chat,
                  cache_prompt=False)


def run(cfg, reg=None) -> int:
    """Serve until interrupted; 2 when the model cannot be loaded."""
    from omegaconf import OmegaConf

    from specfree.conf.schema import ServeConfig
    from specfree.config import engine_parts

    try:
        import uvicorn

        from specfree.serve.app import create_app
    except ImportError as exc:
        raise ConfigError(f"serve needs the serve extra ({exc.name} is missing): pip install \"specfree[serve]\"") from None
    if reg is None:
        from specfree.plugins import build_plugin_manager, registry

        reg = registry(build_plugin_manager())
    settings = ServeConfig(**OmegaConf.to_container(cfg.serve, resolve=True))
    check_settings(settings)
    use_threads(EngineSettings.from_config(cfg).threads)  # every setting checked (serve.max_batch too) before loading
    sock = listen(settings.host, settings.port)
    failed: list[str] = []

    def load():
        from transformers.utils import logging as hf_logging

        from specfree.engine import Engine

        hf_logging.disable_progress_bar()
        engine = Engine(**engine_parts(cfg, reg, warm=True))
        start = time.perf_counter()
        warm_up(engine)
        log.info("model %s ready (strategy %s; warmed up in %.2f s)", served_name(cfg), cfg.strategy.name,
                 time.perf_counter() - start)
        return engine

    def stop(reason: str) -> None:  # nothing to serve: stop, and say why below
        failed.append(reason)
        server.should_exit = True

    app = create_app(load=load, settings=settings, model_name=served_name(cfg), on_failure=stop)
    config = uvicorn.Config(app, log_level=settings.log_level, timeout_graceful_shutdown=5, lifespan="on")
    server = uvicorn.Server(config)
    host = f"[{settings.host}]" if ":" in settings.host else settings.host
    print(f"specfree serve: http://{host}:{sock.getsockname()[1]}/v1 (model {served_name(cfg)}, loading)",
          file=sys.stderr, flush=True)
    if settings.host not in ("127.0.0.1", "localhost", "::1") and settings.api_key is None:
        print(f"warning: listening on {settings.host} without serve.api_key: anyone who reaches this port "
              "can use the model", file=sys.stderr, flush=True)
    quiet = CleanShutdown()
    logging.getLogger("uvicorn.error").addFilter(quiet)
    try:
        server.run(sockets=[sock])
    except KeyboardInterrupt:  # uvicorn shut down cleanly, then re-raised the Ctrl-C it caught
        pass
    finally:
        logging.getLogger("uvicorn.error").removeFilter(quiet)
    if failed:
        print(f"error: {failed[0]}", file=sys.stderr, flush=True)
        return 2
    return 0

