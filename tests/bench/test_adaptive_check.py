"""adaptive_check's comparison of plain-step outputs across engines (the GPU check's equality line)."""

from __future__ import annotations

import pytest

from sgl_longgen.bench.adaptive_check import compare_outputs, with_widths


def test_first_differences_against_plain_decoding_and_the_same_method_without_run_ahead():
    outputs = {
        "plain": {"greedy": [1, 2, 3], "sampled": [5, 5, 5]},
        "TOKENSWIFT": {"greedy": [1, 2, 3], "sampled": [7, 8, 9]},
        "TOKENSWIFT+ahead": {"greedy": [1, 2, 4], "sampled": [7, 8, 9]},
        "OWL+ahead": {"greedy": [1, 2], "sampled": [1]},  # its base engine did not run
    }
    assert compare_outputs(outputs) == {
        "TOKENSWIFT": {"greedy_vs_plain": None},
        "TOKENSWIFT+ahead": {"greedy_vs_plain": 2, "sampled_vs_TOKENSWIFT": None},
        "OWL+ahead": {"greedy_vs_plain": 2},  # shorter: differs where it ends
    }


def test_widths_join_the_draft_directorys_defaults(tmp_path):
    from sgl_longgen.sglang.draft_dir import read_defaults

    (tmp_path / "longgen.toml").write_text("[tokenswift.partial_kv]\nbudget = 4096")
    with_widths(tmp_path, [16, 32])
    with_widths(tmp_path, [16, 32])  # the same directory for a second engine: unchanged
    defaults = read_defaults(tmp_path)
    assert defaults.adaptive.widths == [16, 32] and defaults.tokenswift.partial_kv.budget == 4096
    with pytest.raises(ValueError, match="already has an"):
        with_widths(tmp_path, [8])
