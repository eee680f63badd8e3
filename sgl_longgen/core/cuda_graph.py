"""Replaying a fixed-shape tensor function as a CUDA graph.

Small drafters (OWL's LSTM beam: 8 steps of a few GEMVs, top-k and gathers) are bound by kernel
launches, not by the GPU: at batch 1 a hundred launches cost far more Python time than the
work they launch. Any function whose tensors keep their shapes and that never reads values
back to the host can be captured once per input signature and replayed.
"""

from __future__ import annotations

from typing import Callable

import torch


class GraphedFunction:
    """``fn(*tensors) -> tuple of tensors``, captured once per input shapes/dtypes.

    The returned tensors are the graph's own outputs: the next call overwrites them, so callers
    consume (or clone) them first. On tensors that are not on a CUDA device ``fn`` runs as is.

    ``static_inputs``: the first call's tensors are the graph's inputs themselves (not copies), and
    a later call that passes tensors at those addresses again skips their copy: a caller that
    keeps its inputs in buffers of its own fills them once (one host-to-device copy) where each
    call would otherwise add a device-to-device copy per input. Such a caller must keep those
    buffers alive and in place as long as the graphs.
    """

    def __init__(self, fn: Callable[..., tuple[torch.Tensor, ...]], warmup: int = 2, static_inputs: bool = False):
        self.fn = fn
        self.warmup = warmup
        self.static_inputs = static_inputs
        self.graphs: dict[tuple, tuple[torch.cuda.CUDAGraph, list[torch.Tensor], tuple[torch.Tensor, ...]]] = {}

    def captured(self, leading: int) -> bool:
        """Whether a graph exists for a call whose first tensor has ``leading`` rows."""
        return any(key[0][0][0] == leading for key in self.graphs)

    def __call__(self, *args: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if not args or not args[0].is_cuda:
            return self.fn(*args)
        key = tuple((a.shape, a.dtype, a.device) for a in args)
        entry = self.graphs.get(key)
        if entry is None:
            entry = self.graphs[key] = self._capture(args)
        graph, inputs, outputs = entry
        for dst, src in zip(inputs, args):
            if dst.data_ptr() != src.data_ptr():
                dst.copy_(src)
        graph.replay()
        return outputs

    def _capture(self, args):
        inputs = list(args) if self.static_inputs else [a.clone() for a in args]
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(self.warmup):  # lazy initialisation (cuBLAS workspaces) outside the graph
                self.fn(*inputs)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outputs = tuple(self.fn(*inputs))
        return graph, inputs, outputs
