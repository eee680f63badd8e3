"""A HF config's RoPE settings in one spelling, whichever transformers wrote them.

transformers 4 writes ``rope_theta`` and ``rope_scaling`` at the top level of ``config.json``;
transformers 5 folds both into one ``rope_parameters`` table (``rope_theta``, ``rope_type`` and the
scaling fields). Everything that needs a model's RoPE (the reference runtime's frequencies, the
target a LongSpec drafter was built for) reads it through :func:`rope_settings`, so a checkpoint
of either age gives the same numbers.
"""

from __future__ import annotations

DEFAULT_THETA = 10000.0


def rope_scaling_key(scaling) -> dict | None:
    """A RoPE scaling table in one spelling, for comparing a checkpoint's with a target's: ``type``
    read as ``rope_type``, a ``rope_theta`` folded in (transformers 5 keeps it in
    ``rope_parameters``) dropped, and no scaling at all (None, empty, ``rope_type = "default"``
    alone) as None."""
    if not scaling:
        return None
    out = {k: v for k, v in dict(scaling).items() if k not in ("rope_theta", "type")}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default" and not set(out) - {"rope_type"}:
        return None
    out["rope_type"] = kind
    return {k: float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else v for k, v in out.items()}


def rope_settings(config) -> tuple[float, dict | None]:
    """``(rope_theta, rope_scaling)`` of a HF config, a mapping or an object, in either spelling:
    top-level ``rope_theta``/``rope_scaling``, or ``rope_parameters`` holding both (transformers 5)."""
    get = config.get if isinstance(config, dict) else (lambda key, default=None: getattr(config, key, default))
    theta = float(get("rope_theta", DEFAULT_THETA) or DEFAULT_THETA)
    params = get("rope_parameters")
    if isinstance(params, dict) and params:
        return float(params.get("rope_theta", theta) or theta), rope_scaling_key(params)
    return theta, rope_scaling_key(get("rope_scaling"))
