"""The contextual penalty as an SGLang custom logit processor, for plain (non-speculative) decoding.

A TOKENSWIFT server applies the penalty itself, per draft node. A plain SGLang server gets the
same distribution by passing this processor with the same ``custom_params``
(``{"penalty": 1.2, "penalty_window": 1024}``; the server needs
``--enable-custom-logit-processor``)::

    from sgl_longgen.sglang.penalty import ContextualPenaltyProcessor
    engine.generate(..., custom_logit_processor=ContextualPenaltyProcessor.to_str(),
                    sampling_params={..., "custom_params": {"penalty": 1.2, "penalty_window": 64}})

A TOKENSWIFT server recognises the processor and applies the penalty along draft paths. On
every server with the plugin, the two keys of a request that sends this processor are checked
when it is admitted (:mod:`.request_settings`): the processor only reads them.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from sglang.srt.sampling.custom_logit_processor import CustomLogitProcessor

from ..core.penalty import apply_penalty, window_mask, window_tokens

DEFAULT_WINDOW = 1024  # the processor's window where a request gives a penalty but no window


def _row_penalty(params: dict[str, Any]) -> tuple[float, int]:
    """A row's ``(theta, window)`` as admission checked them (no penalty where unset)."""
    theta, window = params.get("penalty"), params.get("penalty_window")
    theta = 1.0 if theta is None else theta
    window = DEFAULT_WINDOW if window is None else window
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or not math.isfinite(theta) \
            or isinstance(window, bool) or not isinstance(window, int):
        return 1.0, 0  # not admitted by a tokenizer manager with the plugin: no penalty rather than a crash
    return theta, window


class ContextualPenaltyProcessor(CustomLogitProcessor):
    def __call__(self, logits: torch.Tensor, custom_param_list: list[dict[str, Any]] | None = None) -> torch.Tensor:
        for row, params in enumerate(custom_param_list or []):
            if not params:
                continue
            theta, window = _row_penalty(params)
            req = params.get("__req__")
            if theta <= 1.0 or window <= 0 or req is None:
                continue
            history = list(req.origin_input_ids) + list(req.output_ids)
            mask = window_mask([window_tokens(history, [], window)], logits.shape[-1], logits.device)
            logits[row : row + 1] = apply_penalty(logits[row : row + 1], mask, theta)
        return logits


PROCESSOR_KEY = "sgl_longgen.contextual_penalty"


def add_to_sampling_info(info, reqs, settings) -> None:
    """Give SGLang's sampler our penalty for the requests of a batch that ask for it.

    On a server running our algorithms, ``settings(req)`` gives a request's ``(theta, window)``
    (its ``custom_params`` or the server default). Wherever SGLang samples by itself (the first
    token after prefill, requests decoded one exact token at a time) the penalty then applies
    exactly as :class:`ContextualPenaltyProcessor` applies it on a plain server — without
    enabling client-supplied processors on the server.
    """
    need = []
    for i, req in enumerate(reqs):
        if req.custom_logit_processor:
            continue  # the client's own processor (ours or not) is SGLang's business
        theta, window = settings(req)
        if theta > 1.0 and window > 0:
            need.append((i, theta, window))
    if not need:
        return
    mask = torch.zeros(len(reqs), dtype=torch.bool)
    mask[[i for i, _, _ in need]] = True
    processors = dict(info.custom_logit_processor or {})
    processors[hash(PROCESSOR_KEY)] = (ContextualPenaltyProcessor(), mask.to(info.device, non_blocking=True))
    params = list(info.custom_params or [r.sampling_params.custom_params for r in reqs])
    for i, theta, window in need:
        params[i] = {**(params[i] or {}), "penalty": theta, "penalty_window": window, "__req__": reqs[i]}
    info.custom_logit_processor = processors
    info.custom_params = params
    info.has_custom_logit_processor = True
