"""llama.cpp's own server as bench rows: what it refuses before anything loads, and, where
``scripts/build_llama_cpp.sh`` has built llama-server here, real requests on the SmolLM2 GGUF."""

from __future__ import annotations

from pathlib import Path

import pytest

from specfree.bench import llama_server as server_rows
from specfree.bench.llama_cpp import gguf_precision, source_gguf
from specfree.bench.runner import SystemSpec
from specfree.errors import ConfigError
from specfree.files import DEFAULT_CACHE


def test_knobs_are_checked():
    server_rows.check_knobs({"spec_type": "ngram-mod"})
    with pytest.raises(ConfigError, match="llama_server.spec_type must be one of none, ngram-simple"):
        server_rows.check_knobs({"spec_type": "eagle"})
    with pytest.raises(ConfigError, match="llama_server takes no draft_max; its knobs: spec_type"):
        server_rows.check_knobs({"draft_max": 8})


def test_rows_it_cannot_run_are_one_config_error_naming_the_fix(tmp_path):
    asked = [SystemSpec("hf_generate", {}), SystemSpec("llama_server", {})]
    assert server_rows.select([SystemSpec("hf_generate", {})], None, tmp_path) == []
    with pytest.raises(ConfigError, match=r"runs llama.cpp on a GGUF file: give the model as one \(model.path="):
        server_rows.select(asked, None, tmp_path)
    with pytest.raises(ConfigError, match="no llama-server is built under .*: run scripts/build_llama_cpp.sh"):
        server_rows.select(asked, tmp_path / "model.gguf", tmp_path)


def test_one_row_listed_twice_is_refused_before_a_server_starts(tmp_path):
    """``{spec_type: none}`` is the plain row spelled out: the same label, the same row twice."""
    twice = [SystemSpec("llama_server", {}), SystemSpec("llama_server", {"spec_type": "none"})]
    with pytest.raises(ConfigError, match=r"'llama_server\[\]' is listed twice in bench.baselines"):
        server_rows.build(twice, tmp_path / "model.gguf", "Q4_1", tmp_path, threads=2, n_ctx=256, eos_ids=[2])
    assert server_rows.label({"spec_type": "ngram-mod"}, "Q4_1") == "llama_server(spec_type=ngram-mod)[Q4_1]"


def test_the_newest_build_is_found(tmp_path):
    for version in ("0.3.30", "0.3.36"):
        exe = tmp_path / "llama.cpp" / version / "bin" / "llama-server"
        exe.parent.mkdir(parents=True)
        exe.write_text("")
    assert server_rows.binary(tmp_path) == tmp_path / "llama.cpp" / "0.3.36" / "bin" / "llama-server"


@pytest.mark.skipif(server_rows.binary(DEFAULT_CACHE) is None,
                    reason="llama-server is not built here (scripts/build_llama_cpp.sh)")
@pytest.mark.parametrize("spec_type", ["none", "ngram-mod"])
def test_a_real_server_answers_with_its_own_timings(spec_type):
    gguf = source_gguf("smollm2")
    system = server_rows.build([SystemSpec("llama_server", {"spec_type": spec_type})], gguf, gguf_precision(gguf),
                               DEFAULT_CACHE, threads=2, n_ctx=256, eos_ids=[2])[0]
    try:
        prompt = [1, 9690, 198, 2683, 314, 253, 5356, 30, 2]  # any ids: the server is fed ids, as in bench
        turn = system.run(prompt, 12)
    finally:
        system.server.stop()
    assert 1 <= len(turn.tokens) <= 12 and turn.stop_reason in ("eos", "max_new_tokens")
    assert 0 < turn.prefill_s < turn.wall_s and turn.prompt_tokens == len(prompt)
    assert 1 <= turn.steps <= len(turn.tokens)
    assert system.label == ("llama_server[Q4_1]" if spec_type == "none" else "llama_server(spec_type=ngram-mod)[Q4_1]")
    assert system.server.process.poll() is not None  # stopped
    assert Path(system.details["gguf"]) == gguf


STAND_IN = '''#!{python}
"""A stand-in for llama-server: ready at /health, and every POST answered with what it was sent."""
import json, sys
from http.server import BaseHTTPRequestHandler, HTTPServer

class Echo(BaseHTTPRequestHandler):
    def do_GET(self):
        self.answer({{"status": "ok"}})

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.answer({{"path": self.path, "body": body, "args": sys.argv[1:]}})

    def answer(self, value):
        data = json.dumps(value).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass

HTTPServer(("127.0.0.1", int(sys.argv[sys.argv.index("--port") + 1])), Echo).serve_forever()
'''


def stand_in(tmp_path) -> Path:
    import sys

    exe = tmp_path / "llama-server"
    exe.write_text(STAND_IN.format(python=sys.executable))
    exe.chmod(0o755)
    return exe


def test_requests_carry_their_own_fields_and_jinja_starts_the_chat_templates(tmp_path):
    """What the structured-output benches send: ``json_schema`` beside the ids, and chat requests with
    ``tools`` to a server started with ``--jinja``, every one greedy and uncached."""
    server = server_rows.Server(stand_in(tmp_path), tmp_path / "model.gguf", 2, 256, "ngram-mod", jinja=True)
    try:
        schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
        sent = server.complete([1, 2, 3], 16, json_schema=schema)
        tools = [{"type": "function", "function": {"name": "f", "parameters": schema}}]
        chat = server.chat({"messages": [{"role": "user", "content": "hi"}], "tools": tools, "max_tokens": 8})
    finally:
        server.stop()
    assert sent["path"] == "/completion"
    assert sent["body"] == {"prompt": [1, 2, 3], "n_predict": 16, "temperature": 0.0, "cache_prompt": False,
                            "return_tokens": True, "stream": False, "json_schema": schema}
    assert chat["path"] == "/v1/chat/completions"
    assert chat["body"]["tools"] == tools and chat["body"]["max_tokens"] == 8
    assert (chat["body"]["temperature"], chat["body"]["cache_prompt"], chat["body"]["stream"]) == (0.0, False, False)
    assert "--jinja" in sent["args"] and sent["args"][sent["args"].index("--spec-type") + 1] == "ngram-mod"


def test_without_jinja_the_server_keeps_its_plain_template(tmp_path):
    server = server_rows.Server(stand_in(tmp_path), tmp_path / "model.gguf", 2, 256, "none")
    try:
        args = server.complete([1], 1)["args"]
    finally:
        server.stop()
    assert "--jinja" not in args and "--spec-type" not in args


def test_an_answer_loses_the_eos_the_server_sampled_and_nothing_else():
    system = server_rows.LlamaServerSystem(server=None, precision="Q4_1", eos_ids=[2])
    assert system.answer({"tokens": [5, 6, 2], "stop_type": "eos"}) == ([5, 6], "eos")
    assert system.answer({"tokens": [5, 2, 6], "stop_type": "limit"}) == ([5, 2, 6], "max_new_tokens")
    assert system.answer({"stop_type": "word"}) == ([], "word")
