"""Registration of the ``longgen`` attention backend with SGLang 0.5.17.

``register()`` is meant to run inside the plugin's entry point (``sglang.srt.plugins``), which SGLang
calls in every process it spawns. It only touches SGLang's registries; the backend class and the
Triton/FlashInfer kernels are imported when SGLang first builds a ``longgen`` backend. After it,
``--attention-backend longgen`` (or ``attention_backend="longgen"`` in ``sglang.Engine``) works,
for example with ``--speculative-algorithm NGRAM`` or TOKENSWIFT.
"""

from __future__ import annotations

BACKEND_NAME = "longgen"


def create_longgen_backend(model_runner):
    """SGLang backend factory: the hybrid-verify FlashInfer backend for MHA/GQA models."""
    if model_runner.use_mla_backend:
        raise ValueError("the longgen attention backend supports MHA/GQA models, not MLA")
    from .longgen_backend import LongGenAttnBackend

    return LongGenAttnBackend(model_runner, init_new_workspace=model_runner.init_new_workspace)


def register() -> None:
    """Make ``longgen`` a valid ``--attention-backend`` choice (idempotent)."""
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS, register_attention_backend

    try:  # 0.5.17; later releases moved it
        from sglang.srt.server_args import ATTENTION_BACKEND_CHOICES, add_attention_backend_choices
    except ImportError:  # pragma: no cover - newer SGLang
        from sglang.srt.arg_groups.choices import ATTENTION_BACKEND_CHOICES, add_attention_backend_choices

    if BACKEND_NAME not in ATTENTION_BACKENDS:
        register_attention_backend(BACKEND_NAME)(create_longgen_backend)
    if BACKEND_NAME not in ATTENTION_BACKEND_CHOICES:
        add_attention_backend_choices([BACKEND_NAME])
