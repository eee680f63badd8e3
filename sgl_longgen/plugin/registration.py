"""What :func:`sgl_longgen.plugin.register` installs into SGLang.

* the speculative algorithms (``--speculative-algorithm TOKENSWIFT | OWL | HOWL``), each with a
  ``CustomSpecAlgo`` subclass that adds the members SGLang 0.5.17's scheduler calls;
* a check of ``--speculative-draft-model-path`` that runs when the server arguments are built,
  so a bad draft directory stops startup with a message naming the file, and that defaults
  ``speculative_num_draft_tokens / num_steps / eagle_topk`` from the draft's own settings;
* the ``longgen_torch`` attention backend (and ``longgen`` when the kernels are importable),
  which TOKENSWIFT gets where SGLang would choose FlashInfer;
* on CPU only, PyTorch stand-ins for the ``sgl_kernel`` CPU ops.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable
from dataclasses import dataclass

logger = logging.getLogger(__name__)

_DONE = False


@dataclass(frozen=True)
class _Algorithm:
    """What registration needs to know of one of our algorithms."""

    name: str
    worker: str  # "module:Class" under sgl_longgen.plugin, imported only by a scheduler
    inspect: Callable  # (draft path, model path) -> DraftDir; raises LonggenError
    widths: Callable  # DraftDir -> (num_draft_tokens, num_steps, eagle_topk) defaults

    def factory(self, server_args):
        module, cls = self.worker.split(":")
        return getattr(importlib.import_module(f"sgl_longgen.plugin.{module}"), cls)


def _inspect(kind: str):
    def inspect(path, model_path):
        from . import draft_dir

        return getattr(draft_dir, f"inspect_{kind}_draft_dir")(path, model_path)

    return inspect


def _tokenswift_widths(draft) -> tuple[int, int, int]:
    # The [1,3,3,3] head tree has 41 nodes; 64 leaves room for n-gram paths.
    tree = draft.defaults.tokenswift.tree
    return 64, len(tree), max(tree)


def _owl_widths(draft) -> tuple[int, int, int]:
    from ..core.owl import verify_width

    o = draft.defaults.owl
    return verify_width(o.tree_size, o.spec), o.depth, o.top_k


def _howl_widths(draft) -> tuple[int, int, int]:
    width, depth, top_k = _owl_widths(draft)
    # Steps x top-k sizes SGLang's per-step KV reserve; the linear chains fit in the width.
    return max(width, draft.defaults.suffix.max_spec_tokens + 1), depth, top_k


ALGORITHMS = {
    "TOKENSWIFT": _Algorithm("TOKENSWIFT", "tokenswift_worker:TokenSwiftWorker", _inspect("heads"), _tokenswift_widths),
    "OWL": _Algorithm("OWL", "owl_worker:OwlWorker", _inspect("owl"), _owl_widths),
    "HOWL": _Algorithm("HOWL", "owl_worker:HowlWorker", _inspect("owl"), _howl_widths),
}


def _spec_class(algo: _Algorithm):
    from sglang.srt.speculative.spec_registry import CustomSpecAlgo

    class LonggenSpecAlgo(CustomSpecAlgo):
        """A self-drafting tree method: no draft model runner, no draft KV pool."""

        def carries_draft_hidden_states(self) -> bool:
            return False

        def need_topk(self) -> bool:
            return False

        def has_draft_kv(self) -> bool:
            return False  # drafts live only in the verify window

        def is_ngram(self) -> bool:
            # SGLang 0.5.17 routes "no draft model, target KV pool only" algorithms through its
            # NGRAM branches (draft KV pool lookup, verify CUDA-graph dummy inputs).
            return True

        def get_platform_worker_cls(self):
            return None

        def create_future_map(self, device, req_to_token_pool, needs_cpu_seq_lens=True, needs_confidence_relay=False):
            from sglang.srt.managers.overlap_utils import FutureMap

            return FutureMap(device, self, req_to_token_pool, needs_cpu_seq_lens, needs_confidence_relay)

        def handle_server_args(self, server_args) -> None:
            server_args.enable_mixed_chunk = False

    LonggenSpecAlgo.__name__ = f"{algo.name.title()}SpecAlgo"
    return LonggenSpecAlgo


def _prepare_server_args(server_args) -> None:
    """Before SGLang resolves the server arguments: check our draft directory, set defaults."""
    name = (server_args.speculative_algorithm or "").upper()
    algo = ALGORITHMS.get(name)
    if algo is None:
        return
    from ..errors import LonggenError

    try:
        draft = algo.inspect(server_args.speculative_draft_model_path, server_args.model_path)
    except LonggenError as exc:
        raise ValueError(f"{name}: {exc}") from None
    # Draft forwards address single-token KV slots and the commit reorders a request's slot
    # table (plugin/tree_worker.py): both need one token per page.
    if server_args.page_size is None:
        server_args.page_size = 1
    elif server_args.page_size != 1:
        raise ValueError(f"{name} needs --page-size 1 (one token per KV page), got {server_args.page_size}")
    width, steps, top_k = algo.widths(draft)
    if server_args.speculative_num_draft_tokens is None:
        server_args.speculative_num_draft_tokens = width
    if server_args.speculative_num_steps is None:
        server_args.speculative_num_steps = steps
    if server_args.speculative_eagle_topk is None:
        # > 1 keeps SGLang's backends on their tree-mask (not chain) verify path.
        server_args.speculative_eagle_topk = max(2, top_k)
    if not server_args.disable_overlap_schedule:
        logger.info("%s runs on the synchronous scheduler: disabling overlap scheduling", name)
        server_args.disable_overlap_schedule = True


def _skip_draft_config_lookup(speculative_algorithm, speculative_draft_model_path, *args, **kwargs):
    """Our draft directories are not HF models: SGLang's alias resolution must not load them."""
    if (speculative_algorithm or "").upper() in ALGORITHMS:
        speculative_draft_model_path = None
    return (speculative_algorithm, speculative_draft_model_path, *args), kwargs


# Algorithms whose SGLang runs have been checked on a GPU with the ``longgen`` backend. OWL and
# HOWL verify with [SPEC] input embeddings (eager verify batches) and keep SGLang's choice.
HYBRID_VERIFY_DEFAULT = ("TOKENSWIFT",)


def _prefer_longgen_backend(result, server_args, *args, **kwargs):
    """Where SGLang picks FlashInfer for TOKENSWIFT, pick its hybrid-verify subclass.

    ``longgen`` is FlashInfer for prefill and decode; its TARGET_VERIFY runs the long prefix
    through FlashInfer and the draft tree through a Triton kernel, about half the verify time of
    FlashInfer's custom-mask prefill at 98K context. An explicit ``--attention-backend`` is
    never overridden.
    """
    if result != "flashinfer" or (server_args.speculative_algorithm or "").upper() not in HYBRID_VERIFY_DEFAULT:
        return None
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS

    from ..kernels.sglang_backend import BACKEND_NAME

    if BACKEND_NAME not in ATTENTION_BACKENDS:
        return None
    logger.info("%s: attention backend %s (FlashInfer with hybrid tree verification)",
                server_args.speculative_algorithm, BACKEND_NAME)
    return BACKEND_NAME


def _penalty_into_sampling_info(result, info, batch, vocab_size, *args, **kwargs):
    """SGLang's own sampling applies our contextual penalty on servers running our algorithms."""
    from .requests import active_penalty_defaults, penalty_settings

    defaults = active_penalty_defaults()
    if defaults is None:
        return None
    from .penalty_processor import add_to_sampling_info

    add_to_sampling_info(info, batch.reqs, lambda req: penalty_settings(req, defaults))
    return None


def register_all() -> None:
    global _DONE
    if _DONE:
        return
    _DONE = True
    from sglang.srt.layers.attention.attention_registry import register_attention_backend
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType
    from sglang.srt.server_args import add_attention_backend_choices
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
    from sglang.srt.speculative.spec_registry import get_spec
    from sglang.srt.utils import is_cpu

    for algo in ALGORITHMS.values():
        if get_spec(algo.name) is None:
            SpeculativeAlgorithm.register(algo.name, supports_overlap=False, spec_class=_spec_class(algo))(algo.factory)

    from .torch_backend import NAME as TORCH_BACKEND

    add_attention_backend_choices([TORCH_BACKEND])

    @register_attention_backend(TORCH_BACKEND)
    def _create_torch_backend(runner):
        from .torch_backend import LonggenTorchBackend

        return LonggenTorchBackend(runner)

    HookRegistry.register("sglang.srt.server_args.ServerArgs.__post_init__",
                          lambda self, *a, **k: _prepare_server_args(self), HookType.BEFORE)
    HookRegistry.register("sglang.srt.arg_groups.speculative_hook._resolve_speculative_algorithm_alias",
                          _skip_draft_config_lookup, HookType.BEFORE)
    HookRegistry.register("sglang.srt.sampling.sampling_batch_info.SamplingBatchInfo.adjusted_from_schedule_batch",
                          _penalty_into_sampling_info, HookType.AFTER)
    HookRegistry.register("sglang.srt.server_args.ServerArgs._get_default_attn_backend",
                          _prefer_longgen_backend, HookType.AFTER)
    if is_cpu():
        from . import cpu_ops

        cpu_ops.install((TORCH_BACKEND,))

    # Last: the hybrid-kernel backend needs a GPU stack that may be absent.
    try:
        from ..kernels.sglang_backend import register as register_kernel_backend
    except ImportError as exc:
        logger.debug("longgen attention backend unavailable: %s", exc)
    else:
        register_kernel_backend()
