"""Our SGLang attention backends.

* ``longgen``: SGLang's FlashInfer backend whose TARGET_VERIFY goes through the hybrid tree
  attention of :mod:`sgl_longgen.kernels.hybrid` (:mod:`.hybrid`); GPUs with FlashInfer.
* ``longgen_torch``: plain PyTorch that understands draft trees and partial-KV decodes
  (:mod:`.torch_tree`); with it SGLang's CPU engine runs our algorithms without a GPU.

Both are registered by the plugin; their modules are imported only when SGLang builds one.
"""

from __future__ import annotations

HYBRID = "longgen"
TORCH = "longgen_torch"


def _create_hybrid(model_runner):
    if model_runner.use_mla_backend:
        raise ValueError("the longgen attention backend supports MHA/GQA models, not MLA")
    from .hybrid import LongGenAttnBackend

    return LongGenAttnBackend(model_runner, init_new_workspace=model_runner.init_new_workspace)


def _create_torch(model_runner):
    from .torch_tree import LonggenTorchBackend

    return LonggenTorchBackend(model_runner)


def register() -> list[str]:
    """Make our backends valid ``--attention-backend`` choices (idempotent); returns their names."""
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS, register_attention_backend
    from sglang.srt.server_args import ATTENTION_BACKEND_CHOICES, add_attention_backend_choices

    names = [(TORCH, _create_torch), (HYBRID, _create_hybrid)]
    for name, create in names:
        if name not in ATTENTION_BACKENDS:
            register_attention_backend(name)(create)
        if name not in ATTENTION_BACKEND_CHOICES:
            add_attention_backend_choices([name])
    return [name for name, _ in names]
