"""adaptive_check's comparison of plain-step outputs across engines (the GPU check's equality line)."""

from __future__ import annotations

import pytest

from sgl_longgen.bench.adaptive_check import (compare_outputs, engine_runs, rotated, section_medians, timeline,
                                              with_widths)


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


def test_section_medians_per_kind_of_step_after_the_set_up():
    # meta_info as SGLang streams it: one entry per token, a step's values on its first token.
    meta = {"longgen_plain_step": [1.0, None, 0.0, None, 1.0, 0.0, 0.0, 1.0],
            "longgen_verify_ms": [90.0, None, 5.0, None, 2.0, 7.0, 6.0, 4.0],
            "longgen_draft_ms": [None, None, 1.0, None, None, 3.0, 2.0, None]}
    got = section_medians(timeline(meta))
    # The first two steps (tokens 0 and 2) are the set-up; then plain at 4 and 7, speculative at 5 and 6.
    assert got == {"plain": {"steps": 2, "verify_ms": 3.0}, "spec": {"steps": 2, "verify_ms": 6.5, "draft_ms": 2.5}}


def test_each_repeat_starts_with_another_setting():
    names = ["greedy", "greedy_on", "greedy_off"]
    firsts = [rotated(names, r)[0] for r in range(4)]
    assert firsts == ["greedy", "greedy_on", "greedy_off", "greedy"]
    assert sorted(rotated(names, 2)) == sorted(names)


def test_a_resumed_run_measures_only_the_engines_not_in_its_report():
    from argparse import Namespace

    args = Namespace(algorithms=["OWL", "HOWL"], plain_run_ahead="default", spec_run_ahead="both", skip_plain=False,
                     resume=False)
    names = [run[0] for run in engine_runs(args, {})]
    assert names == ["plain", "OWL", "OWL+spec", "HOWL", "HOWL+spec"]
    report = {"plain": {}, "OWL": {}, "plain_step_outputs": {}}  # a call that ended after OWL's engine
    assert [run[0] for run in engine_runs(args, report)] == names  # without --resume: all again
    args.resume = True
    assert engine_runs(args, report) == [("OWL+spec", "OWL", None, True), ("HOWL", "HOWL", None, False),
                                         ("HOWL+spec", "HOWL", None, True)]
    assert engine_runs(args, {name: {} for name in names}) == []
