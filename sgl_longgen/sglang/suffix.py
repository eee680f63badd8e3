"""SUFFIX's drafter on SGLang: draft trees from the requests' own text, no draft model.

No draft forward, no hidden states: after each step the method
(:class:`~sgl_longgen.methods.Suffix`) grows each request's index by the tokens just committed,
and each speculative step drafts a tree from it on the host while the verify's inputs that do
not depend on the tries are queued (``shadow``). A prompt is indexed while its prefill runs
(:meth:`SuffixDrafter.prepare`).

``--speculative-draft-model-path`` is optional: a directory whose ``longgen.toml`` holds the
server's ``[suffix]``, ``[adaptive]`` and penalty settings (:func:`.draft_dir.inspect_suffix_draft_dir`).
Adaptive speculation is on by default, so a workload whose text does not repeat itself decodes
at plain decoding's pace.
"""

from __future__ import annotations

from ..core.verify import Verdict
from ..errors import LonggenError
from ..methods import Draft, Suffix
from .draft_dir import inspect_suffix_draft_dir
from .drafter import Drafter, Shadow
from .requests import PenaltyDefaults, StepRequest


class SuffixDrafter(Drafter):
    def __init__(self, env):
        self.env = env
        sa = env.server_args
        settings = inspect_suffix_draft_dir(sa.speculative_draft_model_path, sa.model_path)
        self.defaults = settings.defaults
        if env.num_nodes < 2:
            raise LonggenError(f"SUFFIX drafts trees of at least one node: speculative_num_draft_tokens >= 2, "
                               f"got {env.num_nodes}")
        self.method = Suffix(settings.defaults.suffix)
        sampling = settings.defaults.sampling
        self.penalty = PenaltyDefaults(sampling.penalty, sampling.penalty_window)

    # -- per request -------------------------------------------------------------------------------

    def prepare(self, rid: str, history, sampling) -> None:
        self.method.prepare(rid, history)

    def start(self, step: StepRequest):
        return self.method.start(step.rid, step.history)

    def finish(self, rid: str) -> None:
        self.method.finish(rid)

    def reset(self) -> None:
        self.method.reset()

    # -- the step --------------------------------------------------------------------------------

    def hint(self, step: StepRequest) -> float | None:
        return self.method.history_hint(step.state.method, step.history, self.env.num_nodes)

    def observe(self, steps: list[StepRequest], drafts: list[Draft], verdicts: list[Verdict]) -> None:
        """Index each request's new tokens now (the next draft would): a request that finishes
        after this step hands its whole output to the shared corpus."""
        for step in steps:
            self.method.sync(step.state.method, step.history)

    def draft(self, batch, steps: list[StepRequest], shadow: Shadow, max_nodes: int) -> list[Draft]:
        shadow()
        full = self.env.num_nodes
        return [Draft.root_only(step.root) if step.blocker is not None
                else self.method.propose(step.state.method, step.history, full, max_nodes) for step in steps]
