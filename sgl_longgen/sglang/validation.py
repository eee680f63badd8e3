"""Requests refused before they reach the scheduler, and the settings the admitted ones carry there.

A value a step cannot use, met inside the scheduler, kills it and every running request with
it. SGLang 0.5.17's tokenizer manager checks some fields itself; what it lets through, this
module refuses there (HTTP 400 on the server, ``ValueError`` from ``sgl.Engine``), naming the
field and what it accepts:

* :func:`check_request_shape`, before SGLang splits a request into its prompts
  (``GenerateReqInput.normalize_batch_and_arguments``): ``sampling_params`` an object (or a
  list of them), ``n`` a positive integer, ``input_ids`` a list of ids (or of such lists);
* :func:`check_request`, before SGLang's own checks of a request (``TokenizerManager.
  _validate_one_request``, on every server with the plugin): token ids outside the vocabulary
  (``input_ids: [0, 99999]`` reaches the embedding lookup), and SGLang's sampling fields of the
  wrong type or with values its scheduler cannot hold (a string temperature, a NaN logit bias,
  a top_k past int32, stop token ids outside the vocabulary, a ``custom_params`` its IPC cannot
  carry, ...). SGLang's own range checks (``SamplingParams.verify``) stay SGLang's.
* :func:`admit`, once SGLang built the request's ``SamplingParams`` (``TokenizerManager.
  _create_tokenized_object``): on a server running our algorithms, our ``custom_params`` keys,
  parsed into the request's :class:`~.request_settings.RequestSettings`, which travels with it
  (:mod:`.request_settings`); on a plain server, the penalty keys of a request that sends
  :class:`~.penalty.ContextualPenaltyProcessor`. A custom logit processor that cannot be loaded
  is refused on every server (the scheduler would load it inside a step).
"""

from __future__ import annotations

import math
from typing import Any

import msgspec

from .request_settings import MAX_INT, TOP_K_ALL, parse_custom_params, parse_request, with_settings

# SamplingParams fields SGLang fills itself (normalize()); a request setting them would skip that.
INTERNAL_FIELDS = frozenset({"stop_strs", "stop_regex_strs", "stop_str_max_len", "stop_regex_max_len", "is_normalized"})
# A temperature past float32's range is inf in SGLang's tensors, and a masked logit over it NaN.
MAX_TEMPERATURE = 1e6
MAX_LOGIT_BIAS = 1e6  # far past banning or forcing a token; finite in float32 at any temperature
INT64 = 1 << 63  # every integer travels to the scheduler and into int64 tensors


# -- hooks ------------------------------------------------------------------------------------------


def check_request_shape(obj, *args, **kwargs):
    """BEFORE hook of ``GenerateReqInput.normalize_batch_and_arguments()``."""
    params = obj.sampling_params
    for one in params if isinstance(params, list) else [params]:
        if one is None:
            continue
        if not isinstance(one, dict):
            raise ValueError(f"sampling_params must be an object (a dict) or a list of them, got {one!r}")
        n = one.get("n", 1)  # SGLang reads it here, before a null could mean its default
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_INT:
            raise ValueError(f"sampling_params.n must be an integer from 1 to {MAX_INT}, got {n!r}")
    ids = obj.input_ids
    if ids is not None and not (isinstance(ids, list) and (all(not isinstance(t, (list, tuple)) for t in ids)
                                                           or all(isinstance(t, list) for t in ids))):
        raise ValueError(f"input_ids must be a list of token ids, or a list of such lists, got {ids!r:.200}")
    return None


def check_request(manager, obj, input_ids, *args, **kwargs):
    """BEFORE hook of ``TokenizerManager._validate_one_request(obj, input_ids)``."""
    check_input_ids(input_ids, int(manager.model_config.vocab_size))
    if _is_generate(obj):
        params = obj.sampling_params
        if params is not None and not isinstance(params, dict):
            raise ValueError(f"sampling_params must be an object (a dict), got {params!r}")
        merged = {**(manager.preferred_sampling_params or {}), **(params or {})}
        check_sampling_params(merged, manager.sampling_params_class, int(manager.model_config.vocab_size))
    return None


def admit(result, manager, obj, *args, **kwargs):
    """AFTER hook of ``TokenizerManager._create_tokenized_object(obj, ...)``: ``result`` is the
    tokenized request, its ``sampling_params`` SGLang's (verified)."""
    sp = getattr(result, "sampling_params", None)
    if not _is_generate(obj) or sp is None:
        return None
    processor = getattr(result, "custom_logit_processor", None)
    penalty_processor = bool(processor) and is_penalty_processor(processor)
    if serves_our_algorithm(manager):
        sp.custom_params = with_settings(sp.custom_params, parse_request(sp, penalty_processor))
    elif penalty_processor:
        parse_custom_params(sp.custom_params, ours=False)
    return None


def serves_our_algorithm(manager) -> bool:
    from .plugin import ALGORITHMS

    return (manager.server_args.speculative_algorithm or "").upper() in ALGORITHMS


def _is_generate(obj) -> bool:
    from sglang.srt.managers.io_struct import GenerateReqInput

    return isinstance(obj, GenerateReqInput)


# -- the checks -------------------------------------------------------------------------------------


def check_input_ids(input_ids, vocab: int) -> None:
    """Every id a token of the model (SGLang refuses an empty list itself)."""
    if not input_ids:
        return
    if set(map(type, input_ids)) == {int} and 0 <= min(input_ids) and max(input_ids) < vocab:
        return
    for position, token in enumerate(input_ids):
        if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token < vocab:
            raise ValueError(f"input_ids[{position}] = {token!r} is not a token id of this model "
                             f"(vocabulary of {vocab}: ids 0 to {vocab - 1})")


def check_sampling_params(params: dict[str, Any], sampling_params_class, vocab: int) -> None:
    """SGLang's sampling fields of one request: of their declared types, and within what its
    scheduler (and our step) can hold. A null means the field's default, as in SGLang."""
    fields = {f.name: f.type for f in msgspec.structs.fields(sampling_params_class)}
    for key, value in params.items():
        if key not in fields or key in INTERNAL_FIELDS:
            raise ValueError(f"sampling_params.{key} is not a sampling parameter")
        if value is None or fields[key] is bool:  # flags: SGLang reads only their truth
            continue
        if key == "logit_bias":
            _check_logit_bias(value, vocab)
            continue
        if key == "stop_token_ids" and isinstance(value, (list, tuple, set)):
            value = [t for t in value if t is not None]  # SGLang drops nulls itself
        # A JSON client may write an integer field as 50.0: SGLang takes it, and so does this check.
        probe = int(value) if isinstance(value, float) and value.is_integer() else value
        try:
            try:
                msgspec.convert(probe, fields[key])
            except msgspec.ValidationError:
                msgspec.convert(value, fields[key])
        except msgspec.ValidationError as exc:
            raise ValueError(f"sampling_params.{key} has the wrong type: {exc} (got {value!r})") from None
        _check_sizes(key, value)
        _check_value(key, value, vocab)


def _check_sizes(key: str, value) -> None:
    """Integers that fit int64 (SGLang's IPC and tensors hold no larger one) and finite floats (a
    NaN or an infinity is no setting; NaN values of other people's custom_params keys pass)."""
    if isinstance(value, bool):
        return
    if isinstance(value, int) and not -INT64 <= value < INT64:
        raise ValueError(f"sampling_params.{key} must fit a signed 64-bit integer, got {value}")
    if isinstance(value, float) and not math.isfinite(value) and key != "custom_params":
        raise ValueError(f"sampling_params.{key} must be a finite number, got {value}")
    if isinstance(value, dict):
        for item in value.values():
            _check_sizes(key, item)
    elif isinstance(value, (list, tuple, set)):
        for item in value:
            _check_sizes(key, item)


def _check_value(key: str, value, vocab: int) -> None:
    if key == "temperature" and value > MAX_TEMPERATURE:
        raise ValueError(f"sampling_params.temperature must be at most {MAX_TEMPERATURE:.0f}, got {value}")
    if key == "top_k" and value > TOP_K_ALL:
        raise ValueError(f"sampling_params.top_k must be -1 (the whole vocabulary) or from 1 to {TOP_K_ALL}, "
                         f"got {value}")
    if key == "min_new_tokens" and value > MAX_INT:
        raise ValueError(f"sampling_params.min_new_tokens must be at most {MAX_INT}, got {value}")
    if key == "stop_token_ids":
        for token in value:
            if token is not None and not 0 <= token < vocab:
                raise ValueError(f"sampling_params.stop_token_ids holds {token}, not a token id of this model "
                                 f"(vocabulary of {vocab}: ids 0 to {vocab - 1})")


def _check_logit_bias(bias, vocab: int) -> None:
    """Token id (an integer, or its decimal string as JSON has it) -> a finite bias."""
    if not isinstance(bias, dict):
        raise ValueError(f"sampling_params.logit_bias must be an object of token id -> bias, got {bias!r}")
    for key, value in bias.items():
        token = key if type(key) is int else int(key) if isinstance(key, str) and _is_decimal(key) else None
        if token is None or not 0 <= token < vocab:
            raise ValueError(f"sampling_params.logit_bias has the key {key!r}, not a token id of this model "
                             f"(vocabulary of {vocab}: ids 0 to {vocab - 1})")
        if (isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value)
                or abs(value) > MAX_LOGIT_BIAS):
            raise ValueError(f"sampling_params.logit_bias[{key!r}] must be a number from {-MAX_LOGIT_BIAS:.0f} to "
                             f"{MAX_LOGIT_BIAS:.0f}, got {value!r}")


def _is_decimal(text: str) -> bool:
    digits = text[1:] if text[:1] in "+-" else text
    return digits.isascii() and digits.isdigit() and len(digits) <= 19


def is_penalty_processor(processor) -> bool:
    """Whether a request's custom logit processor is :class:`~.penalty.ContextualPenaltyProcessor`;
    one that cannot be loaded is refused (SGLang's scheduler would load it inside a step)."""
    from sglang.srt.sampling.custom_logit_processor import CustomLogitProcessor

    from .penalty import ContextualPenaltyProcessor

    try:
        loaded = CustomLogitProcessor.from_str(processor)
    except Exception as exc:  # noqa: BLE001 - whatever unpickling a client's string raises
        raise ValueError(f"custom_logit_processor cannot be loaded ({type(exc).__name__}: {exc}); it must be "
                         f"the to_str() of a CustomLogitProcessor subclass") from None
    return isinstance(loaded, ContextualPenaltyProcessor)
