"""The contextual penalty as an SGLang custom logit processor, for plain (non-speculative) decoding.

A TOKENSWIFT server applies the penalty itself, per draft node. A plain SGLang server gets the
same distribution by passing this processor with the same ``custom_params``
(``{"penalty": 1.2, "penalty_window": 1024}``; the server needs
``--enable-custom-logit-processor``)::

    from sgl_longgen.plugin.penalty_processor import ContextualPenaltyProcessor
    engine.generate(..., custom_logit_processor=ContextualPenaltyProcessor.to_str(),
                    sampling_params={..., "custom_params": {"penalty": 1.2, "penalty_window": 64}})

A TOKENSWIFT server recognises the processor and applies the penalty along draft paths.
"""

from __future__ import annotations

from typing import Any

import torch
from sglang.srt.sampling.custom_logit_processor import CustomLogitProcessor

from ..core.penalty import apply_penalty, window_mask, window_tokens


class ContextualPenaltyProcessor(CustomLogitProcessor):
    def __call__(self, logits: torch.Tensor, custom_param_list: list[dict[str, Any]] | None = None) -> torch.Tensor:
        for row, params in enumerate(custom_param_list or []):
            if not params:
                continue
            theta = float(params.get("penalty", 1.0))
            window = int(params.get("penalty_window", 1024))
            req = params.get("__req__")
            if theta <= 1.0 or window <= 0 or req is None:
                continue
            history = list(req.origin_input_ids) + list(req.output_ids)
            mask = window_mask([window_tokens(history, [], window)], logits.shape[-1], logits.device)
            logits[row : row + 1] = apply_penalty(logits[row : row + 1], mask, theta)
        return logits
