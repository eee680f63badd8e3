"""What the plugin installs into SGLang (in every SGLang process, through :func:`install`).

* the speculative algorithms (``--speculative-algorithm TOKENSWIFT | OWL | HOWL | LONGSPEC | SUFFIX``), each with a
  ``CustomSpecAlgo`` subclass that adds the members SGLang 0.5.17's scheduler calls;
* a check of the draft directory and of the attention backend when the server arguments are
  built, so a bad setting stops startup with a message naming it, and defaults for
  ``speculative_num_draft_tokens / num_steps / eagle_topk`` from the draft's own settings;
* the ``longgen`` and ``longgen_torch`` attention backends; TOKENSWIFT gets ``longgen`` where
  SGLang would pick FlashInfer;
* the contextual penalty where SGLang samples by itself;
* at admission, the refusal of token ids outside the vocabulary and of sampling fields the
  scheduler cannot hold, and each request's settings of ours, parsed once (:mod:`.validation`);
* slot-table rows that hold SGLang's per-step KV reserve up to the end of the context (:mod:`.slot_rows`);
* a step of several tokens ends its request where plain decoding would have (:mod:`.stops`);
* on SGLang's CPU engine, the ``sgl_kernel`` stand-ins (:mod:`.cpu`).

Every hook target is named in :mod:`.compat`; if this SGLang lacks one, or any other piece we
rely on, a server that asks for one of our algorithms stops with the list.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from . import backends, compat, cpu, slot_rows, stops, token_ids_logprobs
from .validation import admit, check_request, check_request_shape

logger = logging.getLogger(__name__)

_DONE = False
_PROBLEMS: list[str] = []  # why our algorithms cannot run on this SGLang (empty: they can)

# Attention backends our workers were checked with. Others are refused at startup: a backend
# that cannot verify a draft tree (or read a draft's explicit KV indices) would compute wrong
# drafts or crash mid-request.
SUPPORTED_BACKENDS = (backends.HYBRID, "flashinfer", backends.TORCH)
# Backends that write the verify's selection scores and read per-layer draft KV indices
# (TOKENSWIFT's ``[tokenswift.partial_kv] policy = "verify"``).
VERIFY_POLICY_BACKENDS = (backends.HYBRID, backends.TORCH)
# SGLang's FA3 backend cannot verify a draft tree; ``longgen`` runs the verify's long prefix
# through FA3's own paged kernel on Hopper, so a launch that names fa3 (SGLang's default there,
# common in launch scripts) gets ``longgen`` with a warning instead of a refusal.
FA3 = "fa3"
# Algorithms that get the ``longgen`` backend where SGLang would pick FlashInfer.
HYBRID_VERIFY_DEFAULT = ("TOKENSWIFT", "OWL", "HOWL", "LONGSPEC", "SUFFIX")
# Algorithms whose drafters read the verify forward's hidden states: SGLang's verify graphs must
# capture them (its capture mode for target-KV-only tree verifiers is otherwise none).
NEEDS_HIDDEN_STATES = ("OWL", "HOWL")


@dataclass(frozen=True)
class Algorithm:
    name: str
    inspect: Callable  # (draft path, model path) -> DraftDir; raises LonggenError
    widths: Callable  # DraftDir -> (num_draft_tokens, num_steps, eagle_topk) defaults
    check: Callable | None = None  # server args -> None; raises LonggenError for settings it cannot run with


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


def _longspec_widths(draft) -> tuple[int, int, int]:
    from ..core.longspec_beam import verify_width

    c = draft.defaults.longspec
    return verify_width(c.widths, c.tree_size), len(c.widths), max(c.widths)


def _suffix_widths(draft) -> tuple[int, int, int]:
    # The whole tree in one verify; steps x top-k (SGLang's per-step KV reserve) within the width.
    width = draft.defaults.suffix.max_spec_tokens + 1
    return width, max(1, width // 2), 2


def _longspec_check(server_args) -> None:
    from .longspec import check_server_args

    check_server_args(server_args)


ALGORITHMS = {
    "TOKENSWIFT": Algorithm("TOKENSWIFT", _inspect("heads"), _tokenswift_widths),
    "OWL": Algorithm("OWL", _inspect("owl"), _owl_widths),
    "HOWL": Algorithm("HOWL", _inspect("owl"), _howl_widths),
    "LONGSPEC": Algorithm("LONGSPEC", _inspect("longspec"), _longspec_widths, _longspec_check),
    "SUFFIX": Algorithm("SUFFIX", _inspect("suffix"), _suffix_widths),  # no draft model: the path is optional
}


def _worker_factory(server_args):
    from .worker import SpecWorker

    return SpecWorker


def _validate(server_args) -> None:
    """Our algorithms' ``validate_server_args``: refuse an SGLang that lacks what we need."""
    if _PROBLEMS:
        raise ValueError(compat.describe(_PROBLEMS))


def _spec_class(algo: Algorithm):
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
            return True  # see compat: SGLang's branches for target-KV-only tree verifiers

        def get_platform_worker_cls(self):
            return None

        def create_future_map(self, device, req_to_token_pool, needs_cpu_seq_lens=True, needs_confidence_relay=False):
            from sglang.srt.managers.overlap_utils import FutureMap

            return FutureMap(device, self, req_to_token_pool, needs_cpu_seq_lens, needs_confidence_relay)

        def handle_server_args(self, server_args) -> None:
            server_args.enable_mixed_chunk = False

    LonggenSpecAlgo.__name__ = f"{algo.name.title()}SpecAlgo"
    return LonggenSpecAlgo


# -- hooks ----------------------------------------------------------------------------------------


def prepare_server_args(server_args) -> None:
    """Before SGLang resolves the server arguments: check our draft directory and backend, set defaults."""
    name = (server_args.speculative_algorithm or "").upper()
    algo = ALGORITHMS.get(name)
    if algo is None:
        return None
    if _PROBLEMS:
        raise ValueError(compat.describe(_PROBLEMS))
    from ..errors import LonggenError

    try:
        draft = algo.inspect(server_args.speculative_draft_model_path, server_args.model_path)
        if algo.check is not None:
            algo.check(server_args)
    except LonggenError as exc:
        raise ValueError(f"{name}: {exc}") from None
    backend = server_args.attention_backend = backend_for(name, server_args.attention_backend, server_args.device)
    if backend is not None and backend not in SUPPORTED_BACKENDS:
        raise ValueError(f"{name} runs with --attention-backend {', '.join(SUPPORTED_BACKENDS)} "
                         f"(or none: SGLang's choice), not {backend}")
    for field in ("decode_attention_backend", "prefill_attention_backend"):
        value = getattr(server_args, field, None)
        if value is not None and value not in SUPPORTED_BACKENDS:
            raise ValueError(f"{name} runs with --{field.replace('_', '-')} {', '.join(SUPPORTED_BACKENDS)}, "
                             f"not {value}")
    if name == "TOKENSWIFT" and draft.defaults.tokenswift.partial_kv.policy == "verify":
        # The verify's scores and the draft's per-layer slots exist only in our own backends.
        for field in ("attention_backend", "decode_attention_backend", "prefill_attention_backend"):
            value = getattr(server_args, field, None)
            if value is not None and value not in VERIFY_POLICY_BACKENDS:
                from .draft_dir import DEFAULTS_FILE

                raise ValueError(f"{name}: {draft.path / DEFAULTS_FILE}: [tokenswift.partial_kv] policy = \"verify\" "
                                 f"needs the verify forward's selection scores and per-layer draft KV indices: "
                                 f"--{field.replace('_', '-')} {', '.join(VERIFY_POLICY_BACKENDS)} (or none: "
                                 f"SGLang's choice), not {value}")
    # Draft forwards address single-token KV slots and the commit reorders a request's slot
    # table (see .verify): both need one token per page.
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
    if name in NEEDS_HIDDEN_STATES and server_args.return_hidden_states_mode != "full":
        server_args.return_hidden_states_mode = "full"
    if not server_args.disable_overlap_schedule:
        logger.info("%s runs on the synchronous scheduler: disabling overlap scheduling", name)
        server_args.disable_overlap_schedule = True
    return None


def backend_for(name: str, backend: str | None, device: str | None) -> str | None:
    """The attention backend ``name`` runs with when ``--attention-backend backend`` is asked for.

    ``fa3`` on a GPU becomes ``longgen`` (the hybrid verify, FA3 for its prefix on Hopper;
    FlashInfer for prefill and decode, which cost the same as FA3's there); anything else is
    returned as asked and checked against :data:`SUPPORTED_BACKENDS`.
    """
    if backend == FA3 and (device is None or str(device).startswith("cuda")):
        logger.warning("%s: --attention-backend fa3 cannot verify draft trees; running on %s instead (FA3 for the "
                       "verify's prefix on Hopper, FlashInfer for prefill and decode)", name, backends.HYBRID)
        return backends.HYBRID
    return backend


def _prepare_hook(server_args, *args, **kwargs) -> None:
    prepare_server_args(server_args)


def skip_draft_config(speculative_algorithm, speculative_draft_model_path, *args, **kwargs):
    """Our draft directories are not HF models: SGLang's alias resolution must not load them."""
    if (speculative_algorithm or "").upper() in ALGORITHMS:
        speculative_draft_model_path = None
    return (speculative_algorithm, speculative_draft_model_path, *args), kwargs


def prefer_longgen_backend(result, server_args, *args, **kwargs):
    """Where SGLang picks FlashInfer for our algorithms, pick its hybrid-verify subclass.

    ``longgen`` is FlashInfer for prefill and decode; its TARGET_VERIFY runs the long prefix
    through FlashInfer and the draft tree through a Triton kernel, about half the verify time of
    FlashInfer's custom-mask prefill at 98K context. An explicit ``--attention-backend`` is
    never overridden.
    """
    if result != "flashinfer" or (server_args.speculative_algorithm or "").upper() not in HYBRID_VERIFY_DEFAULT:
        return None
    logger.info("%s: attention backend %s (FlashInfer with hybrid tree verification)",
                server_args.speculative_algorithm, backends.HYBRID)
    return backends.HYBRID


def penalty_into_sampling_info(result, info, batch, vocab_size, *args, **kwargs):
    """SGLang's own sampling applies our contextual penalty on servers running our algorithms."""
    from .requests import active_penalty_defaults, penalty_settings

    defaults = active_penalty_defaults()
    if defaults is None:
        return None
    from .penalty import add_to_sampling_info

    add_to_sampling_info(info, batch.reqs, lambda req: penalty_settings(req, defaults))
    return None


# -- installation ---------------------------------------------------------------------------------


def _register_algorithms() -> None:
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
    from sglang.srt.speculative.spec_registry import get_spec

    for algo in ALGORITHMS.values():
        if get_spec(algo.name) is None:
            SpeculativeAlgorithm.register(algo.name, supports_overlap=False, validate_server_args=_validate,
                                          spec_class=_spec_class(algo))(_worker_factory)


def install() -> None:
    global _DONE
    if _DONE:
        return
    _DONE = True
    cpu.install_stand_in()  # first: SGLang's modules import sgl_kernel
    on_cpu = cpu.cpu_engine()
    found = compat.problems(with_cpu_hooks=on_cpu, with_gpu=not on_cpu and compat.gpu_stack_present())
    try:
        _register_algorithms()
    except Exception as exc:  # noqa: BLE001 - the registry itself moved: nothing can be selected
        found.append(f"registering the algorithms failed: {type(exc).__name__}: {exc}")
    if found:
        _PROBLEMS[:] = found
        logger.error("%s", compat.describe(found))
        try:  # only to refuse our algorithms with this list, before SGLang reads their draft paths
            compat.apply_hooks({"prepare_server_args": _prepare_hook}, compat.HOOKS)
        except Exception:  # noqa: BLE001 - then validate_server_args refuses them, later
            pass
        return
    names = backends.register()
    failed = compat.apply_hooks({
        "prepare_server_args": _prepare_hook,
        "skip_draft_config": skip_draft_config,
        "default_backend": prefer_longgen_backend,
        "penalty": penalty_into_sampling_info,
        "request_shape": check_request_shape,
        "input_ids": check_request,
        "request_settings": admit,
        "slot_rows": slot_rows.widen_rows,
        "stops": stops.finish_per_token,
        "token_ids_logprobs": token_ids_logprobs.empty_entries_as_tensors,
    }, compat.HOOKS)
    if on_cpu:
        from .cpu import ops

        failed += compat.apply_hooks(ops.hooks(tuple(names)), compat.CPU_HOOKS)
    if failed:
        _PROBLEMS[:] = [f"the hook on {target} did not apply (see the log above)" for target in failed]
        logger.error("%s", compat.describe(_PROBLEMS))
