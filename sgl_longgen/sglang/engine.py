"""SGLang's engine for the parts of sgl-longgen outside this package (batch jobs, benchmarks).

They never import SGLang themselves: its import is heavy, and every SGLang-facing piece of the
project stays behind this package.
"""

from __future__ import annotations

from typing import Any


def open_engine(**kwargs: Any):
    """``sglang.Engine(**kwargs)`` (our algorithms are registered by the plugin's entry point)."""
    import sglang

    return sglang.Engine(**kwargs)


def penalty_processor() -> str:
    """The contextual penalty as a custom logit processor, for requests to engines *without* our
    algorithms (``custom_logit_processor`` with ``custom_params`` ``{"penalty", "penalty_window"}``)."""
    from .penalty import ContextualPenaltyProcessor

    return ContextualPenaltyProcessor.to_str()


def stop_engine(engine) -> None:
    """Stop one of several engines of this process.

    ``Engine.shutdown()`` kills every child process of its caller: the other engines' schedulers
    too, whose liveness watchdogs then take the whole process down. This stops only this engine's
    watchdog and its own scheduler and detokenizer processes.
    """
    watchdog = engine.tokenizer_manager._subprocess_watchdog
    processes = list(watchdog._processes)
    watchdog.stop()
    for proc in processes:
        proc.kill()
    for proc in processes:
        proc.join(timeout=30)
