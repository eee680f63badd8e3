"""A CUDA graph of the target for plain steps: TARGET_VERIFY of the root alone (width 1).

SGLang captures a speculative engine's target graphs at one verify width
(``speculative_num_draft_tokens``); a batch of another width runs eagerly, which on a GPU costs
two to three times a graphed decode step. Adaptive speculation takes plain steps exactly where
speculation does not pay, so a plain step must cost what plain decoding costs: this module
captures a second set of target graphs at width 1, with SGLang's own ``DecodeCudaGraphRunner``
over an attention backend of its own (a backend's graph state belongs to the graphs captured
with it), and installs it as the runner's graph runner for the length of a width-1 forward.
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


def capture_plain_graphs(model_runner, num_nodes: int) -> WidthGraphs | None:
    """Width-1 graphs where the target runs graphed verifies of ``num_nodes`` (None elsewhere)."""
    compat.require_fields("plain_graphs", model_runner)
    if num_nodes == 1 or model_runner.decode_cuda_graph_runner is None:
        return None
    if str(model_runner.device) == "cpu":
        return None
    logger.info("adaptive speculation: capturing the target's width-1 verify graphs for plain steps")
    try:
        return WidthGraphs(model_runner, 1)
    except Exception as exc:  # noqa: BLE001 - plain steps still run, eagerly
        logger.error("adaptive speculation: capturing the width-1 verify graphs failed (%s: %s); plain steps "
                     "run without a CUDA graph and cost more than plain decoding", type(exc).__name__, exc,
                     exc_info=exc)
        return None
