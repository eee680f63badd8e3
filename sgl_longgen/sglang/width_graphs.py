"""CUDA graphs of the target at verify widths narrower than SGLang's: plain steps (TARGET_VERIFY of
the root alone, width 1) and adaptive speculation's draft widths.

SGLang captures a speculative engine's target graphs at one verify width
(``speculative_num_draft_tokens``); a batch of another width runs eagerly, which on a GPU costs
two to three times a graphed decode step. Adaptive speculation takes plain steps exactly where
speculation does not pay, so a plain step must cost what plain decoding costs, and a narrower
draft is worth taking only where its verify costs less than the full one: this module captures
one more set of target graphs per such width, each with SGLang's own ``DecodeCudaGraphRunner``
over an attention backend of its own (a backend's graph state belongs to the graphs captured
with it), and installs one as the runner's graph runner for the length of a forward of its width.
SGLang's input buffers are shared between runners by design (filled before each replay).
"""

from __future__ import annotations

import contextlib
import logging

from . import compat

logger = logging.getLogger(__name__)


class WidthGraphs:
    """The target's graphs at one verify width, installed for a forward at a time."""

    def __init__(self, model_runner, width: int):
        from sglang.srt.model_executor.runner.decode_cuda_graph_runner import DecodeCudaGraphRunner

        self.runner = model_runner
        self.width = width
        backend = type(model_runner.attn_backend)(model_runner)
        self.graph_runner = DecodeCudaGraphRunner(model_runner, attn_backend=backend,
                                                  speculative_num_draft_tokens=width)
        self.backend = backend

    @contextlib.contextmanager
    def installed(self):
        runner = self.runner
        saved = runner.decode_cuda_graph_runner
        runner.decode_cuda_graph_runner = self.graph_runner
        try:
            yield
        finally:
            runner.decode_cuda_graph_runner = saved


def capture_width_graphs(model_runner, num_nodes: int, widths: list[int]) -> list[WidthGraphs]:
    """Graphs at each of ``widths`` (verify rows per request) narrower than ``num_nodes``, where
    the target runs graphed verifies of ``num_nodes`` (none elsewhere: on CPUs, without graphs).
    A width whose capture fails runs eagerly, with an error in the log: slower, never wrong."""
    compat.require_fields("width_graphs", model_runner)
    if model_runner.decode_cuda_graph_runner is None or str(model_runner.device) == "cpu":
        return []
    captured = []
    for width in sorted({w for w in widths if 1 <= w < num_nodes}):
        what = "plain steps" if width == 1 else f"draft widths verified in {width} rows"
        logger.info("adaptive speculation: capturing the target's width-%d verify graphs for %s", width, what)
        try:
            captured.append(WidthGraphs(model_runner, width))
        except Exception as exc:  # noqa: BLE001 - the steps still run, eagerly
            logger.error("adaptive speculation: capturing the width-%d verify graphs failed (%s: %s); %s run "
                         "without a CUDA graph and cost more", width, type(exc).__name__, exc, what, exc_info=exc)
    return captured
