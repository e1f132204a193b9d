"""llama.cpp's own forward curve (``llama-batched-bench``) beside specfree's: the command it runs, its
output read, what it says when the tool is missing or fails, and, where
``scripts/build_llama_cpp.sh`` has built the tool here, a real curve on the SmolLM2 GGUF."""

from __future__ import annotations

import pytest

from specfree.bench import llama_batched
from specfree.bench.llama_cpp import source_gguf
from specfree.bench.llama_server import tool
from specfree.files import DEFAULT_CACHE

# What the tool prints on stdout with --output-format jsonl: log lines, then one object per run.
OUTPUT = """llama_batched_bench: n_kv_max = 576, n_batch = 2048
{"pp": 256, "tg": 16, "pl": 1, "n_kv": 272, "t_pp": 0.40, "speed_pp": 640.0, "t_tg": 0.160, "speed_tg": 100.0}
not json {
{"pp": 256, "tg": 16, "pl": 8, "n_kv": 384, "t_pp": 0.40, "speed_pp": 640.0, "t_tg": 0.400, "speed_tg": 320.0}
"""


def test_the_output_is_read_as_ms_per_step_by_rows():
    assert llama_batched.parse(OUTPUT) == {1: 10.0, 8: 25.0}
    assert llama_batched.parse("no runs at all") == {}


def test_the_command_shares_one_prompt_of_the_curves_context(tmp_path):
    args = llama_batched.command(tmp_path / "llama-batched-bench", tmp_path / "m.gguf", threads=2)
    at = {flag: args[args.index(flag) + 1] for flag in ("-npp", "-ntg", "-npl", "-t", "-tb", "-c")}
    assert at == {"-npp": "256", "-ntg": "16", "-npl": "1,2,4,8,16", "-t": "2", "-tb": "2", "-c": str(256 + 16 * 16 + 64)}
    assert "-pps" in args and "-kvu" in args  # one prompt for every sequence, one KV


def test_a_missing_or_failing_tool_gives_no_curve_and_says_why(tmp_path):
    curve, line = llama_batched.forward_curve(tmp_path / "m.gguf", tmp_path, threads=2)
    assert curve is None and "not built (scripts/build_llama_cpp.sh)" in line
    exe = tmp_path / "llama.cpp" / "0.3.36" / "bin" / "llama-batched-bench"
    exe.parent.mkdir(parents=True)
    exe.write_text("#!/bin/sh\necho 'error: failed to load model' >&2\nexit 3\n")
    exe.chmod(0o755)
    assert tool(tmp_path, "llama-batched-bench") == exe
    curve, line = llama_batched.forward_curve(tmp_path / "m.gguf", tmp_path, threads=2)
    assert curve is None and "failed (exit 3: error: failed to load model)" in line


@pytest.mark.skipif(tool(DEFAULT_CACHE, llama_batched.NAME) is None,
                    reason="llama-batched-bench is not built here (scripts/build_llama_cpp.sh)")
def test_a_real_curve_on_the_smollm2_file():
    curve, line = llama_batched.forward_curve(source_gguf("smollm2"), DEFAULT_CACHE, threads=2)
    assert curve is not None, line
    assert list(curve) == list(llama_batched.ROWS) and all(ms > 0 for ms in curve.values())
    assert line.startswith("llama-batched-bench: -m ") and "-npl 1,2,4,8,16" in line
