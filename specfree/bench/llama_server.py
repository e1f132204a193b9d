"""llama.cpp's own server as ``bench`` baselines: ``llama_server``, as llama.cpp's users run it.

Each row is one ``llama-server`` process (llama.cpp's tools, built once by
``scripts/build_llama_cpp.sh`` into ``~/.cache/specfree/llama.cpp/VERSION/bin``) on the model's own
GGUF, with llama.cpp's defaults (flash attention ``auto``, its repacked CPU kernels), one slot, the
run's threads. The knob ``spec_type`` picks its draftless speculation (``ngram-mod``,
``ngram-simple``, ``ngram-cache``, ...; ``none``: plain decoding). A turn is one ``/completion``
request fed specfree's token ids, greedy, no prompt cache, timed from the client (as every system);
its prefill is the server's own ``timings`` (the prompt's evaluation), and its steps are the tokens
less the accepted drafts. Like the ``llama_cpp`` rows its kernels are
not torch's, so its ``identical`` column counts the prompts that agree: it is not a lossless baseline.
The structured-output benches send it more: a request's own fields (``json_schema``) and, with
``jinja``, OpenAI chat requests with ``tools`` rendered by the GGUF's chat template.
"""

from __future__ import annotations

import atexit
import json
import os
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from specfree.bench.systems import LLAMA_SERVER_BASELINES, Turn, check_listed_once, describe
from specfree.errors import ConfigError

NAME = LLAMA_SERVER_BASELINES[0]
BUILD = "scripts/build_llama_cpp.sh"  # builds the tools into cache_folder()/llama.cpp/VERSION/bin
SPEC_TYPES = ("none", "ngram-simple", "ngram-map-k", "ngram-map-k4v", "ngram-mod", "ngram-cache")
KNOBS: dict[str, Any] = {"spec_type": "none"}
START_TIMEOUT_S = 300  # loading a 7B file from a cold disk
REQUEST_TIMEOUT_S = 3600


def tool(cache_dir: Path, name: str) -> Path | None:
    """The newest llama.cpp tool ``name`` that ``scripts/build_llama_cpp.sh`` built under ``cache_dir``."""
    found = sorted((cache_dir / "llama.cpp").glob(f"*/bin/{name}"))
    return found[-1] if found else None


def tool_env(exe: Path) -> dict[str, str]:
    """The environment a tool runs in: its libraries sit beside it (the build's run path may name a
    folder long gone)."""
    return {**os.environ, "LD_LIBRARY_PATH": f"{exe.parent}:{os.environ.get('LD_LIBRARY_PATH', '')}"}


def binary(cache_dir: Path) -> Path | None:
    """The newest ``llama-server`` built under ``cache_dir``."""
    return tool(cache_dir, "llama-server")


def select(baselines: Sequence[Any], source: Path | None, cache_dir: Path) -> list[Any]:
    """The ``llama_server`` entries of ``baselines``. They are asked for by name only, so what they
    lack (a GGUF model, the binary) is a ConfigError naming the fix."""
    mine = [b for b in baselines if b.name == NAME]
    for spec in mine:
        check_knobs(spec.knobs)
    if not mine:
        return []
    if source is None:
        raise ConfigError(f"bench.baselines asks for {NAME}, which runs llama.cpp on a GGUF file: give the model "
                          "as one (model.path=FILE.gguf), or leave it out of bench.baselines")
    if binary(cache_dir) is None:
        raise ConfigError(f"bench.baselines asks for {NAME}, but no llama-server is built under "
                          f"{cache_dir / 'llama.cpp'}: run {BUILD} (needs cmake and a C++ compiler), or leave it "
                          "out of bench.baselines")
    return mine


def check_knobs(knobs: dict[str, Any]) -> dict[str, Any]:
    unknown = sorted(set(knobs) - set(KNOBS))
    if unknown:
        raise ConfigError(f"{NAME} takes no {', '.join(unknown)}; its knobs: {', '.join(KNOBS)}")
    spec = knobs.get("spec_type", KNOBS["spec_type"])
    if spec not in SPEC_TYPES:
        raise ConfigError(f"{NAME}.spec_type must be one of {', '.join(SPEC_TYPES)}, not {spec!r}")
    return knobs


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """One ``llama-server`` child process on a free local port; stopped when the bench process ends."""

    def __init__(self, exe: Path, gguf: Path, threads: int, n_ctx: int, spec_type: str, jinja: bool = False):
        self.port = _free_port()
        self.args = [str(exe), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(self.port), "-np", "1",
                     "-t", str(threads), "-tb", str(threads), "-c", str(n_ctx)]
        if spec_type != "none":
            self.args += ["--spec-type", spec_type]
        if jinja:  # the GGUF's chat template renders tools and tool messages (its OpenAI endpoint)
            self.args.append("--jinja")
        self.log = tempfile.TemporaryFile(mode="w+")  # its log, read only to say why it failed
        self.process = subprocess.Popen(self.args, env=tool_env(exe), stdout=subprocess.DEVNULL, stderr=self.log, text=True)
        atexit.register(self.stop)
        self._wait_ready()

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                self.log.seek(0)
                tail = self.log.read().strip().splitlines()[-3:]
                raise ConfigError(f"llama-server exited while loading ({' | '.join(tail)}): {' '.join(self.args)}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=5) as reply:
                    if reply.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.5)
        self.stop()
        raise ConfigError(f"llama-server was not ready within {START_TIMEOUT_S} s: {' '.join(self.args)}")

    def complete(self, ids: list[int], n_predict: int, **fields: Any) -> dict[str, Any]:
        """``/completion`` on token ids, greedy; ``fields`` are more of the request's (``json_schema``)."""
        return self.post("/completion", {"prompt": ids, "n_predict": n_predict, "temperature": 0.0,
                                         "cache_prompt": False, "return_tokens": True, "stream": False, **fields})

    def chat(self, body: dict[str, Any]) -> dict[str, Any]:
        """``/v1/chat/completions``, greedy, no prompt cache (needs ``jinja`` for ``tools``)."""
        return self.post("/v1/chat/completions", {**body, "temperature": 0.0, "cache_prompt": False, "stream": False})

    def post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        request = urllib.request.Request(f"http://127.0.0.1:{self.port}{path}", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT_S) as reply:
            return json.loads(reply.read())

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()


@dataclass
class LlamaServerSystem:
    """One llama-server process; its prefill timed by the server's own ``timings``."""

    server: Server
    precision: str  # the GGUF's type, as llama.cpp names it
    eos_ids: list[int]
    knobs: dict[str, Any] = field(default_factory=dict)
    details: dict[str, Any] = field(default_factory=dict)
    strategy: str = NAME
    kind: str = "llama.cpp"
    path: str = "llama.cpp"

    @property
    def label(self) -> str:
        return label(self.knobs, self.precision)

    @property
    def params(self) -> dict[str, Any]:
        return {**KNOBS, **self.knobs, "precision": self.precision, **self.details}

    def answer(self, reply: dict[str, Any]) -> tuple[list[int], str | None]:
        """A reply's tokens and why it stopped. The server's tokens end with the EOS it sampled, which
        specfree's answers leave out: cut, so that equal answers compare equal."""
        tokens = [int(t) for t in reply.get("tokens") or []]
        if tokens and tokens[-1] in self.eos_ids:
            tokens = tokens[:-1]
        return tokens, {"eos": "eos", "limit": "max_new_tokens"}.get(reply.get("stop_type"), reply.get("stop_type"))

    def run(self, ids: list[int], max_new_tokens: int) -> Turn:
        start = time.perf_counter()
        reply = self.server.complete(ids, max_new_tokens)
        wall = time.perf_counter() - start
        timings = reply.get("timings") or {}
        tokens, stop = self.answer(reply)
        accepted = int(timings.get("draft_n_accepted") or 0)
        # the server's own prompt evaluation (which samples the first token); the rest of the wall time
        # is its decode (and a request's HTTP, under a millisecond)
        prefill = timings["prompt_ms"] / 1e3 if "prompt_ms" in timings else None
        return Turn(tokens=tokens, wall_s=wall, prompt_tokens=len(ids), stop_reason=stop, prefill_s=prefill,
                    prefill_emitted=min(1, len(tokens)), steps=max(1, len(tokens) - accepted))


def build(specs: Sequence[Any], source: Path, precision: str, cache_dir: Path, threads: int, n_ctx: int,
          eos_ids: Sequence[int], jinja: bool = False) -> list[LlamaServerSystem]:
    """A server for every ``llama_server`` row asked for, each started and ready (``jinja``: see ``Server``)."""
    exe = binary(cache_dir)
    check_listed_once([label(spec.knobs, "") for spec in specs])
    systems = []
    for spec in specs:
        knobs = dict(spec.knobs)
        server = Server(exe, source, threads, n_ctx, knobs.get("spec_type", KNOBS["spec_type"]), jinja)
        details = {"gguf": str(source), "n_threads": threads, "n_ctx": n_ctx, "server": exe.parent.parent.name,
                   "flash_attn": "auto"}
        systems.append(LlamaServerSystem(server, precision, sorted(eos_ids), knobs, details))
    return systems


def label(knobs: dict[str, Any], precision: str) -> str:
    """``llama_server(spec_type=ngram-mod)[Q4_1]``: the knobs that differ from the defaults, the weights."""
    shown = {k: v for k, v in knobs.items() if KNOBS.get(k) != v}
    return f"{describe(NAME, shown)}[{precision}]"


def describe_rows(systems: Sequence[Any]) -> str:
    mine = [s for s in systems if isinstance(s, LlamaServerSystem)]
    if not mine:
        return ""
    first = mine[0]
    return (f"llama-server rows: llama.cpp as llama-cpp-python {first.details['server']} vendors it, its own tools "
            f"({BUILD}), {first.details['n_threads']} threads, flash attention auto, one slot, on "
            f"{Path(first.details['gguf']).name}; timed by the server's own prompt and decode timings; greedy, "
            "fed specfree's token ids (other kernels: not lossless)")
