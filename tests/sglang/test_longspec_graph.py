"""LONGSPEC's graphed beam: a batch size's first replay checked against the eager beam, and what
happens when the graph cannot serve (on a CPU the graph wrapper runs the function as is, so the
check's own logic is what is tested here; the GPU run replays real graphs)."""

from __future__ import annotations

import pytest
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


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_static_inputs_are_read_in_place_and_other_tensors_copied_in():
    """With ``static_inputs`` the graph reads the first call's tensors themselves: refilling them
    in place (as the drafter's input buffer is, by one host copy) is what the next replay sees;
    a call with other tensors still gets their values copied in."""
    from sgl_longgen.core.cuda_graph import GraphedFunction

    x, y = torch.arange(4.0, device="cuda"), torch.ones(4, device="cuda")
    graphed = GraphedFunction(lambda a, b: (a * 2 + b,), static_inputs=True)
    assert graphed(x, y)[0].tolist() == [1, 3, 5, 7]
    x.copy_(torch.tensor([10.0, 20, 30, 40]), non_blocking=True)
    assert graphed(x, y)[0].tolist() == [21, 41, 61, 81]
    other = torch.full((4,), 5.0, device="cuda")
    assert graphed(other, y)[0].tolist() == [11, 11, 11, 11] and x.tolist() == [5, 5, 5, 5]
    plain = GraphedFunction(lambda a, b: (a * 2 + b,))
    z = torch.zeros(4, device="cuda")
    assert plain(z, y)[0].tolist() == [1, 1, 1, 1]
    z.fill_(1.0)  # a copy was captured: the caller's tensor is copied in at each call, not read in place
    assert plain(z, y)[0].tolist() == [3, 3, 3, 3]
