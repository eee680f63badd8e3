"""The prompt file: malformed lines are reported with their line numbers, the rest is kept."""

from __future__ import annotations

from sgl_longgen.cluster.prompts import read_prompts


def test_bad_lines_are_reported_and_skipped(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text("\n".join([
        '{"id": "a", "prompt": "hello"}',
        '{"id": "b", "prompt": "unterminated',
        '',
        '{"prompt": "no id"}',
        '{"id": "c", "input_ids": [1, 2, 3]}',
        '{"id": "a", "prompt": "again"}',
        '{"id": "d", "input_ids": [1, -2]}',
        '["not", "an", "object"]',
        '{"id": "e", "prompt": "x", "input_ids": [1]}',
        '{"id": 7, "prompt": "integer ids are fine"}',
    ]) + "\n")
    prompts, bad = read_prompts(path)
    assert [(p.id, p.line) for p in prompts] == [("a", 1), ("c", 5), ("7", 10)]
    assert prompts[1].input_ids == (1, 2, 3) and prompts[0].prompt == "hello"
    by_line = {b.line: b.reason for b in bad}
    assert sorted(by_line) == [2, 4, 6, 7, 8, 9]
    assert by_line[2] == "not valid JSON (Invalid control character at column 36)"
    assert "`id`" in by_line[4]
    assert "duplicate id 'a' (first on line 1)" in by_line[6]
    assert "input_ids" in by_line[7]
    assert "object" in by_line[8]
    assert "exactly one" in by_line[9]
    assert str(bad[0]).startswith("line 2: ")


def test_bad_json_names_the_column_once(tmp_path):
    # The decoder's messages that end in "at" take the column directly: no "at at".
    path = tmp_path / "p.jsonl"
    path.write_text('{"id": "a" "prompt": "x"}\n{"id": "b", "prompt": "tab\there"}\n{"id": "c", "prompt": "x')
    _, bad = read_prompts(path)
    assert [b.reason for b in bad] == [
        "not valid JSON (Expecting ',' delimiter at column 12)",
        "not valid JSON (Invalid control character at column 27)",
        "not valid JSON (Unterminated string starting at column 23)",
    ]
