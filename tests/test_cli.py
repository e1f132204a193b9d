"""``python -m specfree``: decode, multirun + compare, help, and one-line errors for user mistakes."""

from __future__ import annotations

import io
import json
import re

import pytest
import torch
from omegaconf import OmegaConf
from rich.console import Console

from specfree import cli
from specfree.config import compose
from specfree.hookspecs import hookimpl
from specfree.plugins import build_plugin_manager, registry
from specfree.strategies.base import Strategy
from specfree.types import Proposal
from specfree.verifiers.greedy import GreedyVerifier, walk
from tests.helpers import run_cli

SUMMARY = re.compile(r"^(\d+) tokens · [\d.]+ tok/s · (\d+) forwards · [\d.]+ tokens/step · (\d+) drafted · "
                     r"(?:\d+ of \d+ rows kept · )?(\w+)")  # an interrupted run's summary counts no rows
PROMPT = "the cat , the dog : the cat ( and ) the dog"  # commas, colons, parentheses reach the model intact


@pytest.fixture(autouse=True)
def in_tmp_path(tmp_path, monkeypatch):
    """Hydra writes run folders under the working directory: keep them out of the checkout."""
    monkeypatch.chdir(tmp_path)


def local(tiny_llama_dir) -> list[str]:
    return ["model=local", f"model.path={tiny_llama_dir}"]


def test_help_lists_commands_and_config_groups(capsys):
    assert cli.main(["--help"]) == 0
    out = capsys.readouterr().out
    for word in ("decode", "bench", "compare", "plugins", "datastore", "build-kernels", "warm-up"):
        assert re.search(rf"^  {word} ", out, re.M), word
    assert re.search(r"^  model +llama2, local, mistral, qwen2, smollm2, tinyllama$", out, re.M)
    assert re.search(r"^  strategy +autoregressive, .*prompt_lookup", out, re.M)


@pytest.mark.parametrize("args, message", [
    (["nope"], "error: unknown command 'nope'; commands: decode, bench, compare, ceiling, roofline, replay, plugins, "
              "datastore, serve, build-kernels, warm-up (see --help)"),
    (["decode", "strategy=prompt_lookup", "strategy.max_ngramm=3"],
     "error: strategy.max_ngramm: strategy 'prompt_lookup' has no knob 'max_ngramm'; its knobs: max_ngram, "
     "min_ngram, draft_len, num_candidates, match, priced, adapt_costs, price_context (did you mean max_ngram?)"),
    (["decode", "strategy=prompt_lookup", "strategy.max_ngram=abc"],
     "error: strategy.max_ngram: expected int, got 'abc'"),
    (["decode", "-m", "strategy=autoregressive,nope", "prompt=hi"],
     "error: unknown strategy 'nope'; available: autoregressive"),
    (["decode", "model=local", "prompt=hi"], "error: model.path is required: add model.path=... "
                                             "(model=local reads a folder or a .gguf file)"),
    (["compare"], "error: usage: python -m specfree compare DIR_OR_FILE..."),
])
def test_mistakes_are_one_line_with_exit_code_2(capsys, args, message):
    assert cli.main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith(message) and err.count("\n") == 1 and "Traceback" not in err


@pytest.mark.parametrize("args, message", [
    (["prompt_file=/nonexistent"], "error: prompt_file not found: /nonexistent"),
    (["prompt=   "], 'error: the prompt is empty: give prompt="..." with some text'),
    (["prompt=hi", "strategy=prompt_lookup", "strategy.draft_len=abc"],
     "error: strategy.draft_len: expected int, got 'abc'"),
    (["prompt=hi", "max_new_tokens=-1"], "error: max_new_tokens must be >= 1, got -1"),
    (["prompt=hi", "threads=0"], "error: threads must be >= 1, got 0"),
    (["prompt=hi", "compile=fast"], "error: compile must be one of auto, true, false, not 'fast' (the compiled "
     "forward: true, false, or auto (compiled only where a compiled forward of this model is ready here within "
     "seconds; adapters/compiled.py))"),
    (["prompt=hi", "dtype=int8"],
     "error: dtype must be one of ['bf16', 'bfloat16', 'float16', 'float32', 'fp16', 'fp32'], got 'int8'"),
    (["prompt=hi", "verifier=sampling", "seed=-1"], "error: seed must be >= 0, got -1"),
    (["prompt=hi", "strategy=trie", "strategy.decay=0"], "error: trie.decay must be > 0.0 and < 1.0, got 0.0"),
    pytest.param(["prompt=hi", "device=cuda"],
                 "error: device='cuda' was asked for but no CUDA GPU is available here; use device=cpu",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a GPU")),
])
def test_bad_decode_inputs_are_one_line_with_exit_code_2(tiny_llama_dir, capsys, args, message):
    assert cli.main(["decode", *local(tiny_llama_dir), *args]) == 2
    err = capsys.readouterr().err
    assert err == message + "\n"


def test_decode_streams_the_answer_writes_result_json_and_a_summary(tiny_llama_dir, tmp_path, capsys):
    run = tmp_path / "run"
    code = cli.main(["decode", *local(tiny_llama_dir), f"prompt={PROMPT}", "max_new_tokens=12",
                     f"hydra.run.dir={run}"])
    assert code == 0
    out, err = capsys.readouterr()
    result = json.loads((run / "result.json").read_text())
    assert result["prompt"] == PROMPT and result["text"] and result["text"] in out
    assert "\x1b[" not in out  # piped (not a terminal): plain text
    lines = err.strip().splitlines()
    summary = SUMMARY.match(lines[-2])  # the hybrid, the default, then says whose drafts were accepted
    assert summary and summary.groups() == (str(len(result["tokens"])), str(len(result["steps"])),
                                            str(sum(result["drafted_mask"])), "hybrid")
    assert lines[-1].startswith("accepted drafts by member: prompt_lookup ")
    assert result["strategy"]["name"] == "hybrid" and result["config"]["max_new_tokens"] == 12
    assert result["strategy"]["priced"] is True and result["summary"]["new_tokens"] == len(result["tokens"])
    kept, offered = sum(s["rows"] for s in result["steps"]), sum(s["offered"] for s in result["steps"])
    assert f" · {kept} of {offered} rows kept · " in lines[-2] and not result["interrupted"]


def test_decode_unpriced_runs_the_strategy_at_its_knobs_and_says_so(tiny_llama_dir, tmp_path):
    code, _, err, result = decode_in_process(tiny_llama_dir, tmp_path, [
        "strategy=prompt_lookup", "strategy.priced=false", "max_new_tokens=12"])
    line = err.strip().splitlines()[-1]
    assert code == 0 and SUMMARY.match(line) and line.endswith(" · prompt_lookup (unpriced)")
    assert all(s["rows"] == s["offered"] for s in result["steps"])  # every row the drafter offered ran


class Oracle(Strategy):
    """Drafts a known continuation (so every draft is accepted), or stops the run like Ctrl-C."""

    name = "oracle"

    def __init__(self, continuation: list[int] = (), interrupt_after: int = 0):
        self.continuation, self.interrupt_after = list(continuation), interrupt_after

    def begin(self, prompt):
        self.start, self.calls = len(prompt), 0

    def propose(self, context, max_depth):
        self.calls += 1
        if self.interrupt_after and self.calls > self.interrupt_after:
            raise KeyboardInterrupt
        done = len(context) - self.start
        draft = self.continuation[done : done + min(4, max_depth)]
        return Proposal([draft] if draft else [], source=self.name)


class FlipOnSecondDraftedStep(GreedyVerifier):
    """Greedy, except that on the second step with drafted rows the root takes the runner-up token:
    what low-precision rounding of a batched forward can do to a near-tie."""

    name = "flip"

    def __init__(self):
        super().__init__()
        self.drafted_steps = 0

    def verify(self, logits, tree, context):
        self.drafted_steps += tree.num_drafted > 0
        if self.drafted_steps != 2 or tree.num_drafted == 0:
            return super().verify(logits, tree, context)
        runner_up = int(logits[0].topk(2).indices[1])
        return walk(tree, context, lambda node, prefix: runner_up if node == 0 else int(logits[node].argmax()))


class OraclePlugin:
    @hookimpl
    def specfree_register(self, registry):
        registry.add("strategy", "oracle", Oracle)
        registry.add("verifier", "flip", FlipOnSecondDraftedStep)


def decode_in_process(tiny_llama_dir, tmp_path, overrides, terminal=False):
    reg = registry(build_plugin_manager(extra_plugins=(OraclePlugin(),)))
    prompt = cli.quote_free_text(f"prompt={PROMPT}")  # as the command line does
    cfg = compose([*local(tiny_llama_dir), prompt, f"output={tmp_path / 'r.json'}", *overrides], reg)
    out, err = io.StringIO(), io.StringIO()
    code = cli.decode(cfg, reg, out=Console(file=out, force_terminal=terminal, color_system="standard"),
                      err=Console(file=err, width=300))
    return code, out.getvalue(), err.getvalue(), json.loads((tmp_path / "r.json").read_text())


def test_on_a_terminal_tokens_from_accepted_drafts_are_green(tiny_llama_dir, tmp_path):
    _, _, _, plain = decode_in_process(tiny_llama_dir, tmp_path, ["strategy=autoregressive", "max_new_tokens=10"])
    oracle = f"strategy.continuation={plain['tokens']}"
    code, out, _, result = decode_in_process(
        tiny_llama_dir, tmp_path, ["strategy=oracle", "strategy.priced=false", oracle, "max_new_tokens=10"], terminal=True)
    assert code == 0 and result["tokens"] == plain["tokens"] and sum(result["drafted_mask"]) > 0
    green = "".join(re.findall(r"\x1b\[32m(.*?)\x1b\[0m", out, re.S))
    assert green and re.sub(r"\x1b\[[0-9;]*m", "", out).strip() == plain["text"].strip()


def test_ctrl_c_keeps_what_was_generated_and_prints_the_summary(tiny_llama_dir, tmp_path):
    code, out, err, result = decode_in_process(
        tiny_llama_dir, tmp_path, ["strategy=oracle", "strategy.interrupt_after=3", "max_new_tokens=20"])
    assert code == 130 and result["interrupted"] and len(result["tokens"]) == 3
    assert SUMMARY.match(err) and err.rstrip().endswith("· oracle · interrupted")
    assert out.strip() == result["text"].strip()


def test_verify_against_baseline_reports_identity_in_the_summary_and_result(tiny_llama_dir, tmp_path, capsys):
    run = tmp_path / "run"
    code = cli.main(["decode", *local(tiny_llama_dir), f"prompt={PROMPT}", "max_new_tokens=12",
                     "strategy=prompt_lookup", "verify_against_baseline=true", f"hydra.run.dir={run}"])
    assert code == 0
    err = capsys.readouterr().err.strip().splitlines()
    result = json.loads((run / "result.json").read_text())
    assert SUMMARY.match(err[-2])  # the check's line comes after the summary
    assert err[-1] == f"identical to plain decoding ({len(result['tokens'])} tokens)"
    assert result["baseline_check"] == {"identical": True, "first_divergence": None, "speculative_token": None,
                                        "baseline_token": None}


def test_verify_against_baseline_names_the_first_divergence_and_exits_1(tiny_llama_dir, tmp_path):
    _, _, _, plain = decode_in_process(tiny_llama_dir, tmp_path, ["strategy=autoregressive", "max_new_tokens=12"])
    oracle = ["strategy=oracle", "strategy.priced=false", f"strategy.continuation={plain['tokens']}"]
    code, _, err, result = decode_in_process(tiny_llama_dir, tmp_path, [
        *oracle, "verifier=flip", "max_new_tokens=12", "verify_against_baseline=true"])
    # Two drafted steps of 4 accepted tokens + 1: the second one's root is token 5.
    assert code == 1 and result["tokens"][:5] == plain["tokens"][:5] and result["tokens"][5] != plain["tokens"][5]
    assert result["baseline_check"] == {"identical": False, "first_divergence": 5,
                                        "speculative_token": result["tokens"][5], "baseline_token": plain["tokens"][5]}
    assert result["text"] and SUMMARY.match(err)  # the output and its summary were printed before the verdict
    assert re.search(r"^differs from plain decoding at new token 5: speculative gave '.+', plain gave '.+' "
                     r"\(batched rows round differently in low precision; use dtype=float32", err.splitlines()[-1])
    _, _, _, unchecked = decode_in_process(tiny_llama_dir, tmp_path, [*oracle, "verifier=flip", "max_new_tokens=12"])
    assert "baseline_check" not in unchecked  # off by default


def test_read_prompt_from_text_file_or_stdin(tmp_path, monkeypatch):
    cfg = lambda **kw: OmegaConf.create({"prompt": None, "prompt_file": None, **kw})  # noqa: E731
    (tmp_path / "p.txt").write_text("from a file")
    assert cli.read_prompt(cfg(prompt="given")) == "given"
    assert cli.read_prompt(cfg(prompt_file=str(tmp_path / "p.txt"))) == "from a file"
    monkeypatch.setattr("sys.stdin", io.StringIO("from stdin\n"))
    assert cli.read_prompt(cfg()) == "from stdin\n"
    assert cli.read_prompt(cfg(), piped="read once for a whole sweep") == "read once for a whole sweep"
    monkeypatch.setattr("sys.stdin", io.StringIO(""))
    with pytest.raises(cli.ConfigError, match='no prompt: give prompt="...", prompt_file=PATH, or pipe text'):
        cli.read_prompt(cfg())
    with pytest.raises(cli.ConfigError, match="not both"):
        cli.read_prompt(cfg(prompt="a", prompt_file="b"))
    with pytest.raises(cli.ConfigError, match="prompt_file not found"):
        cli.read_prompt(cfg(prompt_file=str(tmp_path / "missing.txt")))


@pytest.mark.parametrize("content, message", [
    (b"", "is empty: put the prompt's text in it"),
    (b" \n\n", "is empty: put the prompt's text in it"),
    (b"ok \x8e\xff\x00 binary", r"is not UTF-8 text \(undecodable byte at offset 3\); give a text file"),
])
def test_prompt_files_without_text_are_refused_by_name(tmp_path, content, message):
    path = tmp_path / "prompt.txt"
    path.write_bytes(content)
    with pytest.raises(cli.ConfigError, match=f"^prompt_file {path} {message}$"):
        cli.read_prompt(OmegaConf.create({"prompt": None, "prompt_file": str(path)}))
    with pytest.raises(cli.ConfigError, match=f"^prompt_file {tmp_path} is a folder: give a text file$"):
        cli.read_prompt(OmegaConf.create({"prompt": None, "prompt_file": str(tmp_path)}))


def test_stdin_that_is_not_text_is_refused(monkeypatch):
    # Under a C locale Python reads undecodable bytes as lone surrogates; the tokenizer would choke on them.
    stdin = io.TextIOWrapper(io.BytesIO(b"hello \xff\xfe"), encoding="utf-8", errors="surrogateescape")
    monkeypatch.setattr("sys.stdin", stdin)
    with pytest.raises(cli.ConfigError, match="^the input piped on stdin is not UTF-8 text: pipe a text file$"):
        cli.read_stdin()


def test_an_output_path_that_cannot_be_written_is_one_line(tmp_path):
    with pytest.raises(cli.ConfigError, match=f"^cannot write the result to {tmp_path}: Is a directory"):
        cli._write_result(OmegaConf.create({"output": str(tmp_path)}), {"kind": "decode"})


def test_a_2x2_multirun_then_compare(tiny_llama_dir, tmp_path):
    sweep = tmp_path / "multirun"
    code = cli.main(["decode", "-m", "strategy=autoregressive,prompt_lookup", "verifier=greedy,sampling",
                     *local(tiny_llama_dir), f"prompt={PROMPT}", "max_new_tokens=10", f"hydra.sweep.dir={sweep}"])
    assert code == 0
    results = {p.parent.name: json.loads(p.read_text()) for p in sweep.glob("*/result.json")}
    assert sorted(results) == ["0", "1", "2", "3"]
    greedy = [r["tokens"] for r in results.values() if r["config"]["verifier"]["name"] == "greedy"]
    sampled = [r["tokens"] for r in results.values() if r["config"]["verifier"]["name"] == "sampling"]
    assert greedy[0] != sampled[0]  # so "identical: yes" below needs the right baseline for each row
    console = Console(file=io.StringIO(), width=200, record=True)
    assert cli.compare([str(sweep)], console=console) == 0
    rows = [line for line in console.export_text().splitlines() if "verifier=" in line]
    assert len(rows) == 4 and all(re.search(r"│ yes +│$", row) for row in rows)
    assert all("1.00x" in row for row in rows if "autoregressive" in row)


def test_compare_flags_different_output_and_missing_baselines(tmp_path):
    def result(strategy, tokens, seed=0, tps=10.0):
        return {"kind": "decode", "config": {"seed": seed, "strategy": {"name": strategy}}, "model": "m",
                "strategy": {"name": strategy}, "overrides": [f"strategy={strategy}", f"seed={seed}"],
                "prompt": "p", "tokens": tokens, "summary": {"new_tokens": len(tokens), "tokens_per_s": tps,
                                                             "mean_accepted": 1.5}}
    runs = [result("autoregressive", [1, 2, 3]), result("prompt_lookup", [1, 2, 4], tps=25.0),
            result("prompt_lookup", [1, 2, 3], seed=1)]
    for i, run in enumerate(runs):
        (tmp_path / str(i)).mkdir()
        (tmp_path / str(i) / "result.json").write_text(json.dumps(run))
    console = Console(file=io.StringIO(), width=200, record=True)
    cli.compare([str(tmp_path)], console=console)
    text = console.export_text()
    assert re.search(r"seed=0 .*prompt_lookup .*2\.50x .*NO", text)
    assert re.search(r"seed=1 .*prompt_lookup .*– .*– ", text)  # no autoregressive run with seed=1


def test_llama2_without_weights_or_network_says_so_in_one_line(tmp_path):
    # HF_HUB_OFFLINE makes the hub fail at once instead of retrying; the message is the product's.
    done = run_cli("decode", "model=llama2", "prompt=hi", env={"HF_HUB_OFFLINE": "1"}, cwd=tmp_path)
    assert done.returncode == 2
    assert done.stderr == (
        "error: could not load 'meta-llama/Llama-2-7b-chat-hf': it is not a local folder or .gguf file, and the "
        "Hugging Face hub did not provide it (no network, gated, or a wrong id). Download it first and pass its "
        "folder, or use the embedded model: model=smollm2\n")


@pytest.mark.model
def test_decode_with_smollm2_end_to_end(tmp_path):
    done = run_cli("decode", "strategy=prompt_lookup", "max_new_tokens=16",
                   "prompt=Name three colours, separated by commas.", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    summary = SUMMARY.match(done.stderr.strip().splitlines()[-1])
    assert summary and summary.group(4) == "prompt_lookup" and int(summary.group(1)) > 0
    result = json.loads(next(tmp_path.glob("outputs/*/*/result.json")).read_text())
    assert result["text"].strip() and result["text"] in done.stdout
    assert result["prompt_tokens"] > 20  # the chat template wrapped the 8-token question


@pytest.mark.parametrize("name, text, message", [
    ("notes.json", '{"kind": "something else"}', "is neither a bench records file nor a decode result"),
    ("result.json", "{not json", "is not a readable JSON file: "),
])
def test_compare_names_a_file_it_cannot_read(capsys, tmp_path, name, text, message):
    (tmp_path / name).write_text(text)
    assert cli.main(["compare", str(tmp_path / name)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {tmp_path / name} {message}") and err.count("\n") == 1
