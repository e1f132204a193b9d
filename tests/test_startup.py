"""Start-up: the set-up's ``build-kernels`` command, and builds that show their progress in a log."""

from __future__ import annotations

import re

import pytest

from specfree.kernels import find_compiler
from specfree.progress import StepsShown
from tests.helpers import run_cli


def test_build_kernels_without_a_compiler_says_how_to_get_one(tmp_path):
    done = run_cli("build-kernels", f"cache_dir={tmp_path}", env={"PATH": str(tmp_path)})
    assert done.returncode == 2
    assert done.stderr.startswith("error: no C++ compiler found") and "apt-get install g++" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and not list(tmp_path.rglob("*.so"))


def test_build_kernels_takes_only_a_cache_folder(tmp_path):
    done = run_cli("build-kernels", "threads=2", cwd=tmp_path)
    assert done.returncode == 2 and done.stderr == "error: build-kernels takes only cache_dir=PATH; got 'threads=2'\n"


@pytest.mark.skipif(find_compiler() is None, reason="no C++ compiler here")
def test_a_kernel_build_in_a_log_says_what_it_builds_with_an_estimate_then_its_time(tmp_path, capsys):
    from specfree import kernels

    source = tmp_path / "a.cpp"
    source.write_text('extern "C" int specfree_test_a() { return 1; }\n')
    kernels.build._build(tmp_path / "build", progress=True, sources=(source,))
    lines = capsys.readouterr().err.splitlines()  # stderr is not a terminal here, as in a log
    assert re.fullmatch(r"specfree: building specfree's CPU kernels \(first use: about \d+ s\)", lines[0])
    assert re.fullmatch(r"specfree: built specfree's CPU kernels in \d+ s", lines[1]) and len(lines) == 2


def test_steps_of_a_build_in_a_log_are_lines_with_the_time_left(capsys):
    with StepsShown("compiling the forward", 3) as steps:
        for rows in (1, 2, 4):
            steps.starting(f"compiling the forward for {rows} rows")
            steps.advance()
    lines = capsys.readouterr().err.splitlines()
    assert lines[0] == "specfree: compiling the forward: 3 steps"
    assert re.fullmatch(r"specfree: compiling the forward for 1 rows \(1 of 3, \d+ s so far\)", lines[1])
    assert re.fullmatch(r"specfree: compiling the forward for 4 rows \(3 of 3, \d+ s so far, about \d+ s left\)",
                        lines[3]) and len(lines) == 4


def test_a_hidden_build_prints_nothing(capsys):
    with StepsShown("compiling the forward", 2, show=False) as steps:
        steps.starting("compiling the forward for 1 row")
        steps.advance()
    assert capsys.readouterr().err == ""


def test_decode_writes_its_start_up_split_to_result_json(tiny_llama_dir, tmp_path, monkeypatch):
    import json

    from specfree import cli

    monkeypatch.chdir(tmp_path)
    assert cli.main(["decode", "model=local", f"model.path={tiny_llama_dir}", "prompt=the cat", "max_new_tokens=4",
                     f"hydra.run.dir={tmp_path}"]) == 0
    split = json.loads((tmp_path / "result.json").read_text())["startup"]
    phases = ["plugins_s", "config_s", "imports_s", "model_s", "adapter_s", "engine_s", "first_step_s", "other_s"]
    assert list(split) == ["before_main_s", *phases, "total_s"]
    assert all(split[p] >= 0 for p in phases) and split["before_main_s"] > 0  # this process began before main
    assert abs(sum(split[p] for p in phases) + split["before_main_s"] - split["total_s"]) < 0.01


def test_a_model_that_passed_the_probes_here_skips_them_next_time(tmp_path, monkeypatch):
    import copy

    from specfree.adapters import probes
    from specfree.adapters.hf import HFAdapter
    from tests.tiny_models import tiny_model

    calls = []
    inspect = probes.inspect_model
    monkeypatch.setattr(probes, "inspect_model", lambda *a, **k: calls.append(1) or inspect(*a, **k))
    first = HFAdapter(copy.deepcopy(tiny_model("llama")), cache_dir=tmp_path)
    again = HFAdapter(copy.deepcopy(tiny_model("llama")), cache_dir=tmp_path)
    assert len(calls) == 1 and again.capabilities == first.capabilities
    assert len(list((tmp_path / "probes").glob("*.json"))) == 1
    HFAdapter(copy.deepcopy(tiny_model("llama")), cache_dir=tmp_path / "elsewhere")  # another cache probes again
    assert len(calls) == 2


def test_a_refusal_is_never_remembered_and_a_decoder_pass_does_not_admit_its_encoder(tmp_path):
    import transformers

    from specfree.adapters.hf import HFAdapter
    from specfree.errors import UnsupportedModelError

    def roberta(is_decoder: bool):
        config = transformers.RobertaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                            num_attention_heads=4, max_position_embeddings=512, vocab_size=128,
                                            is_decoder=is_decoder)
        return transformers.AutoModelForCausalLM.from_config(config).eval()

    HFAdapter(roberta(is_decoder=True), cache_dir=tmp_path)
    for _ in range(2):
        with pytest.raises(UnsupportedModelError, match="is not causal"):
            HFAdapter(roberta(is_decoder=False), cache_dir=tmp_path)
    assert len(list((tmp_path / "probes").glob("*.json"))) == 1


def test_the_row_exactness_probe_runs_once_per_architecture_then_comes_from_the_cache(tmp_path, monkeypatch):
    import copy

    from specfree.adapters.hf import HFAdapter
    from tests.tiny_models import tiny_model

    calls = []
    probe = HFAdapter._rows_probe
    monkeypatch.setattr(HFAdapter, "_rows_probe", lambda self: calls.append(1) or probe(self))
    verdicts = [HFAdapter(copy.deepcopy(tiny_model("llama")), cache_dir=tmp_path).rows_exact for _ in range(2)]
    assert verdicts == [True, True] and len(calls) == 1
    assert HFAdapter(copy.deepcopy(tiny_model("llama")), cache_dir=tmp_path / "elsewhere").rows_exact
    assert len(calls) == 2  # another cache probes again
