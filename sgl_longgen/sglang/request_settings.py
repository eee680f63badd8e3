"""Each request's settings of ours, parsed once when the request is admitted.

Our workers read more of a request than its tokens: its target distribution (SGLang's
``temperature``, ``top_p``, ``top_k``, ``min_p``, ``sampling_seed``) and its ``custom_params``:

=========================  =====================================================================
``penalty``                contextual penalty theta, 1.0 (none) to :data:`MAX_PENALTY`
``penalty_window``         tokens the penalty looks back, 0 to :data:`MAX_INT`
``longgen_speculation``    ``"auto"``, ``"on"`` or ``"off"`` (:mod:`.adaptive`)
``longgen_width``          a fixed draft width, 2 to :data:`MAX_INT` trie nodes (:mod:`.adaptive`)
``longgen_report``         true: adaptive speculation's per-step report (:mod:`.adaptive`)
``longgen_timing``         ``"sync"``, ``"host"``, ``"off"``, or true for ``"sync"`` (:mod:`.timing`)
``longgen_timing_steps``   steps timed at most, 0 to :data:`MAX_INT` (:mod:`.timing`)
``longgen_host_profile``   true: the steps are profiled (:mod:`.host_profile`)
=========================  =====================================================================

A key left out, or null, means the server's default (the penalty's comes from the draft
directory, which only the scheduler knows: :func:`penalty_of` merges it there). A value that
would fail inside a step (where raising takes the scheduler down, and every running request
with it) is refused in the tokenizer manager instead, by :func:`parse_request`, with a
``ValueError`` naming the key and what it accepts; so is any other ``longgen_`` key. The
result, one frozen :class:`RequestSettings`, travels to the scheduler inside the request's own
``custom_params`` under :data:`SETTINGS_KEY` (the one field of SGLang's ``SamplingParams`` that
can carry values of ours through its IPC, pickled or msgpack), and the step reads it back with
:func:`settings_of`: nothing is parsed there. A request that reaches a worker without it (built
in the scheduler's process, not admitted by a tokenizer manager) gets the server's defaults.

``penalty`` and ``penalty_window`` are also what :class:`~.penalty.ContextualPenaltyProcessor`
reads on a plain server; admission checks them there for requests that send that processor.
"""

from __future__ import annotations

import math
from typing import Any

import msgspec

SETTINGS_KEY = "longgen_settings"  # where admission leaves a request's settings in its custom_params
PREFIX = "longgen_"

AUTO, ON, OFF = "auto", "on", "off"
SPECULATION_MODES = (AUTO, ON, OFF)
TIMING_PARAM = "longgen_timing"
TIMING_STEPS_PARAM = "longgen_timing_steps"
DEFAULT_TIMING_STEPS = 4096
HOST_PROFILE_PARAM = "longgen_host_profile"

# Bounds that keep every value inside what the step's tensors and SGLang's hold: int32 counts,
# float32 logits (a penalty of 1e6 still leaves a logit of 100 finite).
MAX_INT = (1 << 31) - 1
MAX_PENALTY = 1e6
TOP_K_ALL = 1 << 30  # SGLang's "whole vocabulary" (sampling_params.TOP_K_ALL); top_k == 1 is greedy


class RequestSettings(msgspec.Struct, frozen=True, kw_only=True):
    """What our workers read from one request, parsed and checked when it was admitted."""

    # The target distribution, from SGLang's own sampling parameters once it normalised them.
    temperature: float = 1.0  # 0.0: greedy
    top_p: float = 1.0
    top_k: int = 0  # 0: no top-k filter
    min_p: float = 0.0
    seed: int | None = None  # sampling_seed (None: the worker's shared generator)
    # custom_params; None: the server's default.
    penalty: float | None = None
    penalty_window: int | None = None
    speculation: str | None = None  # one of SPECULATION_MODES
    width: int | None = None
    report: bool = False
    timing: str | None = None  # "sync" or "host" (None: the steps are not timed)
    timing_steps: int = DEFAULT_TIMING_STEPS
    host_profile: bool = False
    # The request's own custom logit processor is ContextualPenaltyProcessor (its drafts can be
    # verified with the penalty); any other processor blocks its drafts (.requests.tree_blocker).
    penalty_processor: bool = False


DEFAULT_SETTINGS = RequestSettings()

# -- custom_params ---------------------------------------------------------------------------------

_BAD = object()  # a converter's answer to a value it does not accept


def _number(low: float, high: float):
    def convert(value):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return _BAD
        value = float(value)
        return value if math.isfinite(value) and low <= value <= high else _BAD

    return convert


def _integer(low: int, high: int):
    def convert(value):
        if isinstance(value, bool) or not isinstance(value, int):
            return _BAD
        return value if low <= value <= high else _BAD

    return convert


def _choice(*choices: str):
    def convert(value):
        return value if isinstance(value, str) and value in choices else _BAD

    return convert


def _flag(value):
    return value if isinstance(value, bool) else _BAD


def _timing(value):
    if value is True:
        return "sync"
    if value is False or value == OFF:
        return None
    return value if value in ("sync", "host") else _BAD


# key -> (RequestSettings field, converter, what it accepts)
SHARED_KEYS = {
    "penalty": ("penalty", _number(1.0, MAX_PENALTY), f"a number from 1.0 (no penalty) to {MAX_PENALTY:.0f}"),
    "penalty_window": ("penalty_window", _integer(0, MAX_INT), f"an integer from 0 to {MAX_INT}"),
}
OUR_KEYS = {
    **SHARED_KEYS,
    "longgen_speculation": ("speculation", _choice(*SPECULATION_MODES),
                            " or ".join(f'"{m}"' for m in SPECULATION_MODES)),
    "longgen_width": ("width", _integer(2, MAX_INT),
                      f"an integer from 2 to {MAX_INT} (trie nodes, the root included)"),
    "longgen_report": ("report", _flag, "true or false"),
    TIMING_PARAM: ("timing", _timing, '"sync", "host", "off", true (for "sync") or false'),
    TIMING_STEPS_PARAM: ("timing_steps", _integer(0, MAX_INT), f"an integer from 0 to {MAX_INT}"),
    HOST_PROFILE_PARAM: ("host_profile", _flag, "true or false"),
}


def parse_custom_params(custom: dict[str, Any] | None, ours: bool = True) -> RequestSettings:
    """The settings a request's ``custom_params`` ask for (its sampling fields left at their
    defaults); raises ``ValueError`` naming the first bad key. With ``ours`` false (a plain
    server) only :data:`SHARED_KEYS` are read: other ``longgen_`` keys are nobody's there."""
    if custom is None:
        return DEFAULT_SETTINGS
    if not isinstance(custom, dict):
        raise ValueError(f"custom_params must be an object (a dict), got {custom!r}")
    keys = OUR_KEYS if ours else SHARED_KEYS
    values = {}
    for key, value in custom.items():
        spec = keys.get(key)
        if spec is None:
            if ours and isinstance(key, str) and key.startswith(PREFIX):
                _refuse_unknown(key)
            continue
        if value is None:
            continue
        field, convert, accepts = spec
        parsed = convert(value)
        if parsed is _BAD:
            raise ValueError(f"custom_params.{key} must be {accepts}, got {value!r}")
        values[field] = parsed
    return msgspec.structs.replace(DEFAULT_SETTINGS, **values) if values else DEFAULT_SETTINGS


def _refuse_unknown(key: str) -> None:
    if key == SETTINGS_KEY:
        raise ValueError(f"custom_params.{SETTINGS_KEY} is set by the server, not by a request")
    raise ValueError(f"custom_params.{key} is not a setting of this server (its {PREFIX} keys: "
                     f"{', '.join(k for k in OUR_KEYS if k.startswith(PREFIX))})")


# -- the whole request -----------------------------------------------------------------------------


def sampling_fields(sampling_params) -> dict[str, Any]:
    """SGLang's normalised sampling parameters in our terms (its joint filter semantics: top_k == 1
    is greedy, TOP_K_ALL or less than 1 no top-k)."""
    sp = sampling_params
    greedy = sp.top_k == 1
    top_k = 0 if greedy or sp.top_k is None or sp.top_k <= 0 or sp.top_k >= TOP_K_ALL else int(sp.top_k)
    return {
        "temperature": 0.0 if greedy else float(sp.temperature),
        "top_p": float(sp.top_p),
        "top_k": top_k,
        "min_p": float(sp.min_p),
        "seed": None if sp.sampling_seed is None else int(sp.sampling_seed),
    }


def parse_request(sampling_params, penalty_processor: bool = False) -> RequestSettings:
    """One admitted request's settings, from the ``SamplingParams`` SGLang built and verified for
    it (raises ``ValueError`` for a bad ``custom_params`` key)."""
    custom = parse_custom_params(sampling_params.custom_params)
    return msgspec.structs.replace(custom, **sampling_fields(sampling_params), penalty_processor=penalty_processor)


def with_settings(custom: dict[str, Any] | None, settings: RequestSettings) -> dict[str, Any]:
    """A request's ``custom_params`` carrying its settings (a new dict: the caller's stays as it was)."""
    return {**(custom or {}), SETTINGS_KEY: msgspec.structs.asdict(settings)}


def settings_of(req) -> RequestSettings:
    """The settings admission left on a request (SGLang's ``Req``), read back without parsing;
    the server's defaults and SGLang's own sampling fields where it left none.

    The first read keeps the object in the request's ``custom_params`` in place of its encoding:
    the scheduler's copy of that dict is the request's own and never sent on (SGLang's ``Req``
    adds ``__req__`` to it), and every step reads the settings of every request."""
    sp = req.sampling_params
    custom = sp.custom_params
    carried = custom.get(SETTINGS_KEY) if isinstance(custom, dict) else None
    if type(carried) is RequestSettings:
        return carried
    if isinstance(carried, dict):
        try:
            settings = RequestSettings(**carried)
        except TypeError:  # not our encoding: the request was not admitted by a tokenizer manager of ours
            pass
        else:
            custom[SETTINGS_KEY] = settings
            return settings
    return msgspec.structs.replace(DEFAULT_SETTINGS, **sampling_fields(sp))


def penalty_of(settings: RequestSettings, defaults) -> tuple[float, int]:
    """The request's contextual penalty ``(theta, window)``: its own, else the server's ``defaults``
    (:class:`~.requests.PenaltyDefaults`)."""
    theta = defaults.penalty if settings.penalty is None else settings.penalty
    window = defaults.window if settings.penalty_window is None else settings.penalty_window
    return theta, window
