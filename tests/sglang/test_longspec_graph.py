"""LONGSPEC's graphed beam: a batch size's first replay checked against the eager beam, and what
happens when the graph cannot serve (on a CPU the graph wrapper runs the function as is, so the
check's own logic is what is tested here; the GPU run replays real graphs)."""

from __future__ import annotations

import torch

from sgl_longgen.sglang.longspec import GraphedBeam


def beam_of(offset: list[int]):
    def fn(roots: torch.Tensor, scale: torch.Tensor):
        tokens = roots[:, None] * scale + offset[0]
        return tokens, tokens - 1, torch.zeros_like(tokens), tokens.double()
    return fn


def test_a_beam_that_agrees_with_the_eager_beam_keeps_replaying():
    beam = GraphedBeam(beam_of([0]))
    roots, scale = torch.tensor([3, 4]), torch.tensor([[1, 2, 3]])
    for _ in range(3):
        out = beam(roots, scale)
        assert out[0].tolist() == [[3, 6, 9], [4, 8, 12]]
    assert beam.enabled and beam.checked == {2}


def test_a_disagreement_falls_back_to_the_eager_beam_for_good(caplog):
    offset = [0]
    fn = beam_of(offset)

    def drifting(*args):  # the "graph" gives other tokens than the eager run on the same inputs
        out = fn(*args)
        offset[0] += 1
        return out

    beam = GraphedBeam(drifting)
    out = beam(torch.tensor([3]), torch.tensor([[1, 2]]))
    assert not beam.enabled and "disagrees with the eager beam" in caplog.text
    assert out[0].tolist() == [[4, 7]]  # the eager beam's answer (the "graph" gave [[3, 6]])
    assert beam(torch.tensor([3]), torch.tensor([[1, 2]]))[0].tolist() == [[5, 8]]  # eager from now on


def test_a_failing_capture_falls_back_to_the_eager_beam(caplog):
    calls = []

    def fn(roots):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("operation not permitted when stream is capturing")
        return roots, roots, roots, roots.double()

    beam = GraphedBeam(fn)
    out = beam(torch.tensor([7]))
    assert out[0].tolist() == [7] and not beam.enabled and "drafting eagerly" in caplog.text
