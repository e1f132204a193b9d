"""Metrics arithmetic on a hand-made record set (numbers worked out by hand in the comments)."""

from __future__ import annotations

import pytest

from specfree.bench.metrics import OVERALL, same_output, summarize, summarize_group, sweeps


def turn(tokens, wall, steps=None, emitted=None, split=None):
    return {"tokens": list(tokens), "wall_s": wall, "steps": steps, "emitted": emitted, "split": split}


def rec(pid, category, system, turns, repeat=0, error=None):
    return {"prompt_id": pid, "category": category, "system": system, "repeat": repeat, "turns": turns,
            "error": error}


SPLIT_AR = {"draft_s": 0.0, "mask_s": 0.1, "forward_s": 1.6, "verify_s": 0.1, "other_s": 0.2}
SPLIT_FAST = {"draft_s": 0.1, "mask_s": 0.1, "forward_s": 0.6, "verify_s": 0.1, "other_s": 0.1}
T10, T20 = list(range(10)), list(range(20))

RECORDS = [
    # p1 (task A): AR 10 tokens in 2.5 s; fast the same tokens in 1.0 s over 4 steps; hf in 2.0 s.
    rec("p1", "A", "autoregressive", [turn(T10, 2.5, 10, [1] * 10, SPLIT_AR)]),
    rec("p1", "A", "fast", [turn(T10, 1.0, 4, [3, 3, 2, 2], SPLIT_FAST)]),
    rec("p1", "A", "hf", [turn(T10, 2.0, 10)]),
    # p2 (task B), two turns: AR 20 tokens in 4 s; fast in 2.5 s, 8 steps.
    rec("p2", "B", "autoregressive", [turn(T10, 2.0, 10), turn(T10, 2.0, 10)]),
    rec("p2", "B", "fast", [turn(T10, 1.0, 3, [4, 4, 2]), turn(T10, 1.5, 5, [2, 2, 2, 2, 2])]),
    # p3 (task B): fast emits DIFFERENT tokens (same count) in 1.5 s over 5 steps.
    rec("p3", "B", "autoregressive", [turn(T10, 2.0, 10)]),
    rec("p3", "B", "fast", [turn([9] * 10, 1.5, 5, [2] * 5)]),
    # p4 (task B): fast failed; AR 10 tokens in 1.0 s. Speedups must pair only p2, p3.
    rec("p4", "B", "autoregressive", [turn(T10, 1.0, 10)]),
    rec("p4", "B", "fast", [], error="RuntimeError: boom"),
]


def rows():
    return {(r.category, r.system): r for r in summarize(RECORDS)}


def test_rows_cover_every_task_and_system_then_overall():
    got = [(r.category, r.system) for r in summarize(RECORDS)]
    assert got == [("A", "autoregressive"), ("A", "fast"), ("A", "hf"),
                   ("B", "autoregressive"), ("B", "fast"),
                   (OVERALL, "autoregressive"), (OVERALL, "fast"), (OVERALL, "hf")]


def test_tokens_per_s_is_total_tokens_over_total_wall():
    r = rows()
    assert r["A", "autoregressive"].tokens_per_s == pytest.approx(10 / 2.5)  # 4.0
    assert r["B", "autoregressive"].tokens_per_s == pytest.approx(40 / 7.0)  # p2 + p3 + p4
    assert r["B", "fast"].tokens_per_s == pytest.approx(30 / 4.0)  # p4 failed: not counted
    assert r[OVERALL, "fast"].tokens_per_s == pytest.approx(40 / 5.0)
    assert r[OVERALL, "fast"].new_tokens == 40 and r[OVERALL, "fast"].wall_s == pytest.approx(5.0)


def test_speedup_pairs_the_same_prompts_of_the_baseline():
    r = rows()
    assert r["A", "autoregressive"].speedup == pytest.approx(1.0)
    assert r["A", "fast"].speedup == pytest.approx(10.0 / 4.0)  # 2.5
    # B: fast ran p2, p3 (30 tokens, 4 s); AR on those same prompts: 30 tokens in 6 s.
    assert r["B", "fast"].speedup == pytest.approx((30 / 4.0) / (30 / 6.0))  # 1.5, not 7.5 / (40/7)
    # overall: fast 40 / 5 s vs AR on p1-p3 40 / 8.5 s
    assert r[OVERALL, "fast"].speedup == pytest.approx(8.0 / (40 / 8.5))  # 1.7
    # hf ran only p1: 5 tok/s vs AR's 4 tok/s on p1
    assert r[OVERALL, "hf"].speedup == pytest.approx(1.25)


def test_mean_accepted_is_tokens_over_steps():
    r = rows()
    assert r["A", "fast"].mean_accepted == pytest.approx(10 / 4)
    assert r["B", "fast"].mean_accepted == pytest.approx(30 / 13)
    assert r[OVERALL, "fast"].mean_accepted == pytest.approx(40 / 17)
    assert r[OVERALL, "hf"].mean_accepted == pytest.approx(1.0)
    assert r[OVERALL, "fast"].accepted_hist == {2: 13, 3: 2, 4: 2}  # p1: 2,2,3,3; p2: 4,4,2 + 2x5; p3: 2x5


def test_time_split_fractions_and_missing_split():
    r = rows()
    assert r["A", "autoregressive"].split == pytest.approx(
        {"draft_s": 0.0, "mask_s": 0.05, "forward_s": 0.8, "verify_s": 0.05, "other_s": 0.1})
    assert r["A", "fast"].split["forward_s"] == pytest.approx(0.6)
    assert r["A", "hf"].split is None  # transformers exposes no phases
    assert r["B", "fast"].split is None  # some turns have no split: no made-up numbers


def test_identity_catches_a_different_output():
    r = rows()
    assert (r["A", "fast"].identical, r["A", "fast"].compared) == (1, 1)
    assert (r["B", "fast"].identical, r["B", "fast"].compared) == (1, 2)  # p3 differs
    assert (r[OVERALL, "fast"].identical, r[OVERALL, "fast"].compared) == (2, 3)
    assert r["B", "fast"].errors == 1
    assert not same_output(RECORDS[6], RECORDS[5])
    assert same_output(RECORDS[4], RECORDS[3])
    # a missing turn is a difference too
    assert not same_output(rec("x", "B", "s", [turn(T10, 1)]), rec("x", "B", "t", [turn(T10, 1), turn(T10, 1)]))


def test_repeats_give_median_and_range():
    records = []
    for repeat, fast_wall in enumerate([2.0, 1.0, 1.333333333]):  # speedups 1.0, 2.0, 1.5
        records.append(rec("p", "A", "autoregressive", [turn(T10, 2.0, 10)], repeat))
        records.append(rec("p", "A", "fast", [turn(T10, fast_wall, 5)], repeat))
    row = summarize_group(records, "fast", category="A")
    assert row.repeats == 3
    assert row.speedup == pytest.approx(1.5, rel=1e-6)
    assert row.speedup_range == pytest.approx((1.0, 2.0), rel=1e-6)
    assert row.tokens_per_s == pytest.approx(7.5, rel=1e-6)
    assert row.tokens_per_s_range == pytest.approx((5.0, 10.0), rel=1e-6)
    assert (row.identical, row.compared) == (3, 3)


def test_no_baseline_means_no_speedup():
    row = summarize_group([rec("p", "A", "fast", [turn(T10, 1.0, 5)])], "fast")
    assert row.tokens_per_s == 10 and row.speedup is None and row.compared == 0


def test_sweeps_find_one_varying_numeric_knob():
    metas = [
        {"label": "autoregressive", "strategy": "autoregressive", "params": {}},
        {"label": "pl", "strategy": "prompt_lookup", "params": {"draft_len": 10, "max_ngram": 3}},
        {"label": "pl(4)", "strategy": "prompt_lookup", "params": {"draft_len": 4, "max_ngram": 3}},
        {"label": "hf", "strategy": "hf_prompt_lookup", "params": {"prompt_lookup_num_tokens": 10}},
        {"label": "la1", "strategy": "lookahead", "params": {"window": 4, "ngram": 3}},
        {"label": "la2", "strategy": "lookahead", "params": {"window": 8, "ngram": 5}},  # two knobs vary
    ]
    assert sweeps(metas) == {("prompt_lookup", "draft_len"): [(4, "pl(4)"), (10, "pl")]}


def test_rows_per_step_say_what_pricing_kept_of_what_was_offered():
    def priced(tokens, steps, rows, offered):
        return {**turn(tokens, 1.0, steps), "rows": rows, "offered": offered}

    records = [rec("p1", "A", "trie", [priced(T10, 4, 12, 40), priced(T10, 6, 8, 20)]),  # 20 of 60 rows over 10 steps
               rec("p2", "A", "trie(priced=False)", [priced(T10, 5, 30, 30)]),
               rec("p3", "A", "hf", [turn(T10, 1.0, 10)])]  # transformers records no rows
    r = {(row.category, row.system): row for row in summarize(records)}
    assert r["A", "trie"].rows_per_step == pytest.approx((2.0, 6.0))
    assert r["A", "trie(priced=False)"].rows_per_step == pytest.approx((6.0, 6.0))
    assert r["A", "hf"].rows_per_step is None


def test_accepted_drafts_add_up_per_member_and_the_report_lists_hybrids_only():
    from specfree.bench.report import members_section

    def with_members(accepted_by):
        return {**turn(T10, 1.0, 4, [3, 3, 2, 2]), "accepted_by": accepted_by}

    records = [
        rec("p1", "A", "autoregressive", [turn(T10, 2.0, 10)]),
        rec("p1", "A", "hybrid", [with_members({"trie": 3, "recycling": 1})]),
        rec("p2", "B", "hybrid", [with_members({"trie": 1}), with_members({"prompt_lookup": 2, "trie": 2})]),
        rec("p1", "A", "lookup", [with_members({"prompt_lookup": 6})]),
        rec("p1", "A", "old", [turn(T10, 1.0, 4, [3, 3, 2, 2])]),  # recorded before accepted_by was kept
    ]
    got = {(r.category, r.system): r for r in summarize(records)}
    assert got[OVERALL, "hybrid"].accepted_by == {"trie": 6, "recycling": 1, "prompt_lookup": 2}
    assert got["B", "hybrid"].accepted_by == {"trie": 3, "prompt_lookup": 2}
    assert got[OVERALL, "old"].accepted_by is None and got[OVERALL, "autoregressive"].accepted_by is None
    section = members_section(list(got.values()))
    assert "| hybrid | 9 | trie 6 (67%) · prompt_lookup 2 (22%) · recycling 1 (11%) |" in section
    assert "lookup |" not in section  # one source: nothing to split
    assert members_section([got[OVERALL, "old"]]) == ""
