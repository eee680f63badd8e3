"""adaptive_check's comparison of plain-step outputs across engines (the GPU check's equality line)."""

from __future__ import annotations

from sgl_longgen.bench.adaptive_check import compare_outputs


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
