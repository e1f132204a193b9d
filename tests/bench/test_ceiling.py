"""The perfect-copier ceiling: copyable lengths against brute force, and the bench's own prompts replayed."""

from __future__ import annotations

import json

from hypothesis import given
from hypothesis import strategies as st
from rich.console import Console

from specfree.bench import ceiling, cli
from specfree.cli import main
from tests.bench.test_end_to_end import config, quiet

tokens = st.lists(st.integers(0, 4), max_size=30)


def brute_copyable(context: list[int], output: list[int], limit: int) -> list[int]:
    out = []
    for i in range(len(output)):
        seen = context + output[:i]
        best = 0
        for length in range(1, min(limit, len(output) - i) + 1):
            piece = output[i : i + length]
            if any(seen[j : j + length] == piece for j in range(len(seen) - length + 1)):
                best = length
        out.append(best)
    return out


def brute_matched(context: list[int], output: list[int], limit: int) -> list[int]:
    """The longest continuation of an earlier occurrence of the last committed token that agrees with the output."""
    out = []
    for i in range(len(output)):
        seen = context + output[:i]
        best = 0
        for j in range(len(seen) - 1):  # an occurrence of the last token with something after it
            if seen[j] == seen[-1]:
                agree = 0
                while (agree < limit and i + agree < len(output) and j + 1 + agree < len(seen)
                       and seen[j + 1 + agree] == output[i + agree]):
                    agree += 1
                best = max(best, agree)
        out.append(best)
    return out


@given(context=tokens, output=tokens, limit=st.integers(1, 8))
def test_copyable_lengths_match_brute_force(context, output, limit):
    assert ceiling.copyable(context, output, limit).tolist() == brute_copyable(context, output, limit)
    matched = ceiling.copyable(context, output, limit, matched=True)
    assert matched.tolist() == brute_matched(context, output, limit)
    # Matching the last token first can only find less than copying from anywhere.
    assert (matched <= ceiling.copyable(context, output, limit)).all()


def test_a_copy_the_last_token_never_preceded_is_not_a_matched_copy():
    # 7 8 occurs in the prompt, but never after the last token (9): only the perfect copier finds it.
    assert ceiling.copyable([7, 8, 9], [7, 8], 4).tolist() == [2, 1]
    assert ceiling.copyable([7, 8, 9], [7, 8], 4, matched=True).tolist() == [0, 1]


def test_the_wall_bound_keeps_the_prefill():
    assert ceiling.wall_speedup(10.0, 0.0, 2.0) == 2.0
    assert ceiling.wall_speedup(10.0, 4.0, 2.0) == 10.0 / 7.0  # 4 s prefill + 6 s decode at twice the speed
    assert ceiling.wall_speedup(10.0, 4.0, 1e9) < 2.5  # no decode speed beats the prefill


@given(output=tokens, context=tokens, rows=st.integers(1, 8))
def test_perfect_copier_emits_every_token_within_its_rows(output, context, rows):
    lengths = ceiling.copyable(context, output, rows - 1)
    steps = ceiling.perfect_copier(lengths, rows)
    assert sum(steps) == len(output) and all(1 <= k <= rows for k in steps)
    if rows > 1 and output and output == context[: len(output)]:  # all copyable from the prompt
        assert len(steps) == -(-len(output) // rows)


def test_ceiling_replays_the_bench_prompts_and_prints_a_table(tiny_model_dir, prompts, tmp_path):
    out = tmp_path / "out"
    assert cli.run(config(tiny_model_dir, prompts, out, limit=2, baselines=[], warmup=0), quiet()) == 0
    data = json.loads((out / "bench.json").read_text())
    contexts, cost, _ = ceiling._conversation_and_cost(data["meta"])
    for record in data["records"]:
        # The replayed ids are the ones the bench ran: every turn's prompt length agrees.
        assert [len(ids) for ids in contexts(record)] == [t["prompt_tokens"] for t in record["turns"]]
    rows = ceiling.ceiling_rows(data["records"], contexts, cost)
    assert [r.task for r in rows] == ["code", "chat", "overall"]  # tasks as the run met them
    assert all(r.speedup[c] > 0 for r in rows for c in ceiling.ROWS)
    for r in rows:  # the matched copier finds no more than the perfect one; the prefill caps the wall bound
        assert all(r.matched_tokens_per_step[c] <= r.tokens_per_step[c] for c in ceiling.ROWS)
        assert all(0 < matched <= perfect <= max(1.0, r.speedup[c]) for c, (perfect, matched) in r.wall.items())
    assert rows[-1].wall  # the bench records every turn's prefill
    console = Console(record=True, width=200, file=open("/dev/null", "w"))  # noqa: SIM115
    assert ceiling.main([str(out)], console) == 0
    assert "overall" in console.export_text()
    written = (out / "ceiling.md").read_text()
    assert "| overall | " in written and "forward cost by rows: 1: " in written and "wall ≤8" in written


def test_ceiling_without_a_bench_output_is_one_clear_error(tmp_path, capsys):
    assert main(["ceiling", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "ceiling:" in err and "pass a bench output folder" in err


def test_the_ceiling_prices_with_the_curve_of_the_path_the_run_took():
    curves = {"eager, library linears": {"1": 60.0, "8": 120.0}, "eager, few_row-panels-avx2": {"1": 30.0, "8": 45.0},
              "compiled, few_row-panels-avx2": {"1": 18.0, "8": 31.0}}
    name, cost = ceiling.run_curve({"compile": "true", "forward_curves_ms": curves})
    assert name.startswith("compiled") and cost(1) == 0.018 and cost(8) == 0.031
    name, cost = ceiling.run_curve({"compile": "false", "forward_curves_ms": curves})
    assert name == "eager, few_row-panels-avx2" and cost(8) == 0.045
    assert ceiling.run_curve({"compile": "true"}) is None  # a run without curves: the cached one is used
