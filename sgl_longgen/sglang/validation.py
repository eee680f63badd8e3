"""Requests refused before they reach the scheduler.

SGLang 0.5.17 checks a request's length against the context but not its token ids against the
vocabulary: ``/generate`` with ``input_ids: [0, 99999]`` on a model of 258 tokens reaches the
embedding lookup and kills the scheduler with an ``IndexError``, and every running request with
it. On servers with this plugin the tokenizer manager refuses such a request (HTTP 400 on the
server, ``ValueError`` from ``sgl.Engine``), naming the first bad id. Our own ``custom_params``
(``longgen_speculation``, ``longgen_width``) are checked there too: the worker would otherwise meet a bad value
inside a step, where raising would take the scheduler down.
"""

from __future__ import annotations


def check_input_ids(result, manager, obj, input_ids, *args, **kwargs):
    """AFTER hook of ``TokenizerManager._validate_one_request(obj, input_ids)``."""
    check_custom_params(getattr(obj, "sampling_params", None))
    if not input_ids:
        return None
    vocab = int(manager.model_config.vocab_size)
    if 0 <= min(input_ids) and max(input_ids) < vocab:
        return None
    for position, token in enumerate(input_ids):
        if not 0 <= token < vocab:
            raise ValueError(f"input_ids[{position}] = {token} is not a token id of this model "
                             f"(vocabulary of {vocab}: ids 0 to {vocab - 1})")
    return None


def check_custom_params(sampling_params) -> None:
    """Our ``custom_params`` of one request's (or a batch's) sampling parameters."""
    from .adaptive import MODES, check_width

    for sp in sampling_params if isinstance(sampling_params, list) else [sampling_params]:
        custom = sp.get("custom_params") if isinstance(sp, dict) else getattr(sp, "custom_params", None)
        if not isinstance(custom, dict):
            continue
        mode = custom.get("longgen_speculation")
        if mode is not None and mode not in MODES:
            raise ValueError(f"custom_params.longgen_speculation must be one of {', '.join(MODES)}, got {mode!r}")
        check_width(custom.get("longgen_width"))
