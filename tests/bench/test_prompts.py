"""Prompt sets: Spec-Bench files, generic JSONL with a field mapping, selection and errors."""

from __future__ import annotations

import pytest

from specfree.bench.prompts import load_prompts
from specfree.errors import ConfigError

SPEC_ROWS = [
    {"question_id": 81, "category": "writing", "turns": ["Write a poem.", "Now shorter."]},
    {"question_id": 82, "category": "writing", "turns": ["Write an email.", "Make it formal."]},
    {"question_id": 91, "category": "roleplay", "turns": ["Be a pirate.", "Keep going."]},
    {"question_id": 161, "category": "translation", "turns": ["Translate: hallo"], "reference": ["hello"]},
    {"question_id": 162, "category": "translation", "turns": ["Translate: welt"]},
    {"question_id": 163, "category": "translation", "turns": ["Translate: tag"]},
]


@pytest.fixture
def spec_file(tmp_path, write_jsonl):
    return write_jsonl(tmp_path / "question.jsonl", SPEC_ROWS)


def test_spec_bench_groups_mt_bench_and_keeps_turns(spec_file):
    items = load_prompts(spec_file)
    assert [i.id for i in items] == ["81", "82", "91", "161", "162", "163"]
    assert items[0].category == "mt_bench" and items[0].subcategory == "writing"
    assert items[0].turns == ["Write a poem.", "Now shorter."]
    assert items[3].category == "translation" and items[3].turns == ["Translate: hallo"]


def test_per_category_is_round_robin_over_subcategories_then_limit(spec_file):
    items = load_prompts(spec_file, per_category=2)
    assert [i.id for i in items] == ["81", "91", "161", "162"]  # writing + roleplay, not two writings
    assert [i.id for i in load_prompts(spec_file, per_category=2, limit=3)] == ["81", "91", "161"]
    assert [i.id for i in load_prompts(spec_file, limit=1)] == ["81"]


def test_jsonl_prompt_field_humaneval_style(tmp_path, write_jsonl):
    path = write_jsonl(tmp_path / "he.jsonl", [{"task_id": "HumanEval/0", "prompt": "def f():\n"},
                                                {"task_id": "HumanEval/1", "prompt": "def g():\n"}])
    items = load_prompts(path, "jsonl", {"id": "task_id"})
    assert [(i.id, i.category, i.turns) for i in items] == [("HumanEval/0", "all", ["def f():\n"]),
                                                           ("HumanEval/1", "all", ["def g():\n"])]


def test_jsonl_question_field_gsm8k_style(tmp_path, write_jsonl):
    path = write_jsonl(tmp_path / "gsm.jsonl", [{"question": "2+2?", "answer": "4"}, {"question": "3*3?"}])
    items = load_prompts(path, "jsonl", {"prompt": "question", "category": None})
    assert [(i.id, i.turns) for i in items] == [("1", ["2+2?"]), ("2", ["3*3?"])]  # ids: line numbers


def test_jsonl_with_prompt_and_turns_mapped_uses_what_each_row_has(tmp_path, write_jsonl):
    path = write_jsonl(tmp_path / "mix.jsonl", [{"prompt": "one"}, {"turns": ["a", "b"]}])
    items = load_prompts(path, "jsonl", {"prompt": "prompt", "turns": "turns"})
    assert [i.turns for i in items] == [["one"], ["a", "b"]]


def test_missing_file_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="prompt file not found"):
        load_prompts(tmp_path / "nope.jsonl")


def test_bad_json_names_the_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "ok"}\n\n{"prompt": oops}\n', encoding="utf-8")
    with pytest.raises(ConfigError, match=r"bad.jsonl:3: not valid JSON"):
        load_prompts(path, "jsonl")


def test_missing_field_names_it_and_lists_keys(tmp_path, write_jsonl):
    path = write_jsonl(tmp_path / "q.jsonl", [{"question": "2+2?", "answer": "4"}])
    with pytest.raises(ConfigError) as err:
        load_prompts(path, "jsonl")
    assert "missing field 'prompt'" in str(err.value) and "['answer', 'question']" in str(err.value)
    assert "bench.fields.prompt" in str(err.value)
    spec = write_jsonl(tmp_path / "s.jsonl", [{"question_id": 1, "turns": ["hi"]}])
    with pytest.raises(ConfigError, match=r"s.jsonl:1: missing field 'category'"):
        load_prompts(spec)


def test_other_errors(tmp_path, spec_file, write_jsonl):
    with pytest.raises(ConfigError, match="bench.format"):
        load_prompts(spec_file, "csv")
    with pytest.raises(ConfigError, match="unknown role"):
        load_prompts(spec_file, fields={"text": "x"})
    with pytest.raises(ConfigError, match="per_category must be"):
        load_prompts(spec_file, per_category=0)
    dup = write_jsonl(tmp_path / "dup.jsonl", [{"id": 1, "prompt": "a"}, {"id": 1, "prompt": "b"}])
    with pytest.raises(ConfigError, match="appears more than once"):
        load_prompts(dup, "jsonl")
    empty = write_jsonl(tmp_path / "e.jsonl", [{"prompt": ""}])
    with pytest.raises(ConfigError, match="non-empty string"):
        load_prompts(empty, "jsonl")
