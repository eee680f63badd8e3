"""What :func:`sgl_longgen.plugin.register` installs into SGLang.

* the speculative algorithms (``--speculative-algorithm TOKENSWIFT``), each with a
  ``CustomSpecAlgo`` subclass that adds the members SGLang 0.5.17's scheduler calls and picks
  defaults for ``speculative_num_steps / eagle_topk / num_draft_tokens``;
* a check of ``--speculative-draft-model-path`` that runs when the server arguments are built,
  so a bad draft directory stops startup with a message naming the file;
* the ``longgen_torch`` attention backend (and ``longgen`` when the kernels are importable);
* on CPU only, PyTorch stand-ins for the ``sgl_kernel`` CPU ops.
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)

_DONE = False


class _Algorithm:
    """Per-algorithm facts the registration needs."""

    def __init__(self, name: str, factory, tree_depth: int, branching: int, num_draft_tokens: int, check_draft):
        self.name = name
        self.factory = factory
        self.tree_depth = tree_depth
        self.branching = branching
        self.num_draft_tokens = num_draft_tokens
        self.check_draft = check_draft


def _tokenswift_worker(server_args):
    from .tokenswift_worker import TokenSwiftWorker

    return TokenSwiftWorker


def _check_tokenswift_draft(server_args) -> None:
    from .draft_dir import inspect_heads_draft_dir, target_hidden_size

    inspect_heads_draft_dir(server_args.speculative_draft_model_path, target_hidden_size(server_args.model_path))


ALGORITHMS = {
    # The [1,3,3,3] head tree has 41 nodes; 64 leaves room for n-gram paths.
    "TOKENSWIFT": _Algorithm("TOKENSWIFT", _tokenswift_worker, tree_depth=4, branching=3, num_draft_tokens=64,
                             check_draft=_check_tokenswift_draft),
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
            if server_args.speculative_num_draft_tokens is None:
                server_args.speculative_num_draft_tokens = algo.num_draft_tokens
            if server_args.speculative_num_steps is None:
                server_args.speculative_num_steps = algo.tree_depth
            if server_args.speculative_eagle_topk is None:
                # > 1 keeps SGLang's backends on their tree-mask (not chain) verify path.
                server_args.speculative_eagle_topk = algo.branching
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
        algo.check_draft(server_args)
    except LonggenError as exc:
        raise ValueError(f"{name}: {exc}") from None
    if not server_args.disable_overlap_schedule:
        logger.info("%s runs on the synchronous scheduler: disabling overlap scheduling", name)
        server_args.disable_overlap_schedule = True


def _skip_draft_config_lookup(speculative_algorithm, speculative_draft_model_path, *args, **kwargs):
    """Our draft directories are not HF models: SGLang's alias resolution must not load them."""
    if (speculative_algorithm or "").upper() in ALGORITHMS:
        speculative_draft_model_path = None
    return (speculative_algorithm, speculative_draft_model_path, *args), kwargs


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
