"""Everything sgl-longgen relies on inside SGLang, named in one place and checked at startup.

SGLang has no stable API for a speculative worker that drafts with the target itself: the
worker contract, the hook targets, the batch and request fields a step reads, the attention
backends' graph buffers are all internals that an SGLang release may rename. So every one of
them is listed here, with what it is used for, and checked:

* :func:`problems` (the installed version, every module symbol, hook target and class member)
  runs when the plugin registers; a problem stops any server that asks for one of our
  algorithms, with a message naming each missing piece and the supported version, before a
  scheduler is started (our algorithms' ``validate_server_args``);
* :func:`apply_hooks` registers the plugin's hooks through SGLang's ``HookRegistry``, applies
  them and checks that each one took (the registry itself only logs a failure);
* :func:`require_fields` checks live objects (the model runner, its attention backend) when a
  worker is built.

Two places where our classes take an SGLang role, because SGLang 0.5.17 has no capability flag
for them:

* our algorithms answer ``is_ngram()``: SGLang routes "no draft model, the target's KV pool
  only, a per-request tree mask" algorithms through its NGRAM branches (no draft KV pool in
  ``kv_cache_builder.get_draft_kv_pool``, the verify CUDA-graph dummy inputs in
  ``decode_cuda_graph_runner``), which is exactly what our workers need;
* ``SpecInputType`` is a closed enum: a verify input is an ``NGRAM_VERIFY`` (a padded tree per
  request with explicit positions, which SGLang's FlashInfer/Triton verify paths plan from), a
  draft forward's input an ``EAGLE_DRAFT`` (a DECODE over explicit ``kv_indptr``/``kv_indices``,
  which SGLang's decode paths honour).
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import logging
import pkgutil
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version

from .. import env

logger = logging.getLogger(__name__)

SUPPORTED_SGLANG = ("0.5.17",)
# An SGLang release not listed above is refused unless this is set (a missing piece never is).
ALLOW_UNTESTED_ENV = env.name("ALLOW_UNTESTED_SGLANG")


class IncompatibleSGLang(RuntimeError):
    """The installed SGLang lacks something sgl-longgen needs."""


@dataclass(frozen=True)
class Need:
    path: str  # dotted path resolvable with pkgutil.resolve_name
    why: str


# -- module symbols -------------------------------------------------------------------------------

SYMBOLS: tuple[Need, ...] = (
    Need("sglang.srt.speculative.spec_info.SpeculativeAlgorithm.register", "registering --speculative-algorithm names"),
    Need("sglang.srt.speculative.spec_registry.CustomSpecAlgo", "the base of our algorithms' capability classes"),
    Need("sglang.srt.speculative.spec_registry.get_spec", "registering each algorithm once per process"),
    Need("sglang.srt.speculative.base_spec_worker.BaseSpecWorker", "the V2 speculative worker contract"),
    Need("sglang.srt.speculative.ngram_info.NgramVerifyInput", "the verify input SGLang's backends plan from"),
    Need("sglang.srt.speculative.spec_info.SpecInput", "the draft forward's input"),
    Need("sglang.srt.speculative.spec_info.SpecInputType", "the draft forward's input"),
    Need("sglang.srt.managers.utils.GenerationBatchResult", "a step's results"),
    Need("sglang.srt.managers.overlap_utils.FutureMap", "the relay SGLang's scheduler creates for every algorithm"),
    Need("sglang.srt.model_executor.forward_batch_info.ForwardBatch", "the draft forward's batch"),
    Need("sglang.srt.model_executor.forward_batch_info.ForwardMode", "DECODE / TARGET_VERIFY forwards"),
    Need("sglang.srt.model_executor.forward_batch_info.CaptureHiddenMode", "OWL's hidden states"),
    Need("sglang.srt.model_executor.forward_context.forward_context", "draft graph capture"),
    Need("sglang.srt.model_executor.forward_context.ForwardContext", "draft graph capture"),
    Need("sglang.srt.model_executor.runner_utils.capture_mode", "draft graph capture (is_capture_mode)"),
    Need("sglang.srt.layers.radix_attention.RadixAttention", "partial-KV importance scores per layer"),
    Need("sglang.srt.layers.rotary_embedding.RotaryEmbedding", "LONGSPEC: the target's RoPE table for its queries"),
    Need("sglang.srt.distributed.parallel_state.get_tp_group", "tensor parallelism: the LM head's vocabulary shards"),
    Need("sglang.srt.distributed.parallel_state.get_attn_tp_group",
         "tensor parallelism: summing the ranks' partial-KV scores, the attention-TP LM head's shards"),
    Need("sglang.srt.layers.logprob_processor.compute_spec_v2_logprobs", "logprobs of verified tokens"),
    Need("sglang.srt.layers.sampler.apply_custom_logit_processor", "SGLang's own processing of blocked requests"),
    Need("sglang.srt.sampling.custom_logit_processor.CustomLogitProcessor", "the contextual penalty on plain servers"),
    Need("sglang.srt.layers.attention.attention_registry.register_attention_backend", "longgen / longgen_torch"),
    Need("sglang.srt.layers.attention.attention_registry.ATTENTION_BACKENDS", "longgen / longgen_torch"),
    Need("sglang.srt.server_args.add_attention_backend_choices", "--attention-backend longgen / longgen_torch"),
    Need("sglang.srt.server_args.ATTENTION_BACKEND_CHOICES", "--attention-backend longgen / longgen_torch"),
    Need("sglang.srt.layers.attention.torch_native_backend.TorchNativeAttnBackend", "the longgen_torch backend"),
    Need("sglang.srt.mem_cache.memory_pool.KVWriteLoc", "writing verify KV in our backends"),
    Need("sglang.srt.mem_cache.allocation_sizing.get_alloc_reserve_per_decode",
         "the KV slots reserved per request and step, which its slot-table row must hold"),
    Need("sglang.srt.utils.is_cpu", "the CPU engine's stand-ins"),
    Need("sglang.srt.plugins.hook_registry.HookRegistry", "installing the hooks below"),
    Need("sglang.srt.plugins.hook_registry.HookType", "installing the hooks below"),
)

# The FlashInfer-based hybrid backend (`longgen`), checked only where FlashInfer imports.
GPU_SYMBOLS: tuple[Need, ...] = (
    Need("sglang.srt.layers.attention.flashinfer_backend.FlashInferAttnBackend", "the longgen backend's base"),
    Need("sglang.srt.layers.attention.flashinfer_backend.PrefillMetadata", "the longgen backend's check mode"),
    Need("sglang.srt.runtime_context.get_parallel", "attention heads per TP rank"),
    Need("sglang.srt.model_executor.runner.decode_cuda_graph_runner.DecodeCudaGraphRunner",
         "adaptive speculation: the target's width-1 graphs for plain steps"),
    Need("sglang.srt.layers.attention.flashattention_backend.FlashAttentionBackend",
         "the longgen backend's prefills through FA3 on Hopper, as SGLang's default backend there"),
)

# Private members of FlashInfer's decode wrapper the longgen backend and the draft graphs read,
# checked with the GPU symbols: the draft graphs skip re-planning by the wrapper's plan object; a
# per-layer partial-KV draft (policy "verify") refills the slots the wrapper reads for each layer;
# the folded prefix path shares the wrapper's integer workspace.
GPU_MEMBERS: dict[str, tuple[str, ...]] = {
    "flashinfer.BatchDecodeWithPagedKVCacheWrapper": ("_plan_info", "_paged_kv_indices_buf", "_int_workspace_buffer"),
    # The longgen backend hands plain prefills to SGLang's FA3 backend: planned, then run per layer.
    "sglang.srt.layers.attention.flashattention_backend.FlashAttentionBackend": ("init_forward_metadata",
                                                                                 "forward_extend"),
}

# -- hook targets ---------------------------------------------------------------------------------
# name -> (target, hook type name, why). The hooks themselves live with their concern.

HOOKS: dict[str, tuple[str, str, str]] = {
    "prepare_server_args": ("sglang.srt.server_args.ServerArgs.__post_init__", "BEFORE",
                            "checking the draft directory and setting our defaults before SGLang resolves its arguments"),
    "skip_draft_config": ("sglang.srt.arg_groups.speculative_hook._resolve_speculative_algorithm_alias", "BEFORE",
                          "keeping SGLang from reading our draft directories as HF models"),
    "default_backend": ("sglang.srt.server_args.ServerArgs._get_default_attn_backend", "AFTER",
                        "the longgen backend where SGLang would pick FlashInfer"),
    "penalty": ("sglang.srt.sampling.sampling_batch_info.SamplingBatchInfo.adjusted_from_schedule_batch", "AFTER",
                "the contextual penalty where SGLang samples by itself"),
    "input_ids": ("sglang.srt.managers.tokenizer_manager.TokenizerManager._validate_one_request", "BEFORE",
                  "refusing token ids outside the vocabulary and sampling fields the scheduler cannot hold "
                  "with a 400 instead of a scheduler crash"),
    "request_shape": ("sglang.srt.managers.io_struct.GenerateReqInput.normalize_batch_and_arguments", "BEFORE",
                      "refusing a malformed sampling_params, n or input_ids with a 400 instead of a TypeError"),
    "request_settings": ("sglang.srt.managers.tokenizer_manager.TokenizerManager._create_tokenized_object", "AFTER",
                         "parsing our custom_params once, at admission, into the settings a request carries"),
    "slot_rows": ("sglang.srt.mem_cache.allocation_sizing.get_req_to_token_extra_context_len", "AFTER",
                  "slot-table rows that hold SGLang's per-step KV reserve up to the end of the context"),
    "stops": ("sglang.srt.managers.schedule_batch.Req.update_finish_state", "AROUND",
              "a step of several tokens checked for stops and max_new_tokens after each token, as plain decoding does"),
    "token_ids_logprobs": ("sglang.srt.layers.logprob_processor.get_token_ids_logprobs_raw", "AFTER",
                           "a batch where only some requests ask for given token ids' logprobs served instead of "
                           "crashing the scheduler (every algorithm, plain decoding included)"),
}

CPU_HOOKS: dict[str, tuple[str, str, str]] = {
    "kv_copy_warmup": ("sglang.srt.mem_cache.memory_pool.MHATokenToKVPool._init_kv_copy_and_warmup", "REPLACE",
                       "the tiled KV copy kernel exists only in sgl_kernel's GPU build"),
    "assign_req_to_token_pool": ("sglang.srt.mem_cache.allocation.assign_req_to_token_pool_func", "REPLACE",
                                 "a PyTorch stand-in for sgl_kernel's CPU op"),
    "support_triton": ("sglang.srt.utils.common.support_triton", "REPLACE",
                       "keeping our torch backends off SGLang's Triton helpers on CPU"),
    "no_nccl": ("sglang.srt.distributed.device_communicators.pynccl_wrapper.find_nccl_library", "REPLACE",
                "no NCCL communicator for tensor parallelism on CPU, where a CUDA build of PyTorch ships libnccl"),
}

# -- members of SGLang classes whose instances only exist once requests run --------------------

MEMBERS: dict[str, tuple[str, ...]] = {
    "sglang.srt.managers.schedule_batch.Req": (
        "rid", "origin_input_ids", "output_ids", "sampling_params", "grammar", "custom_logit_processor",
        "return_logprob", "customized_info", "req_pool_idx", "eos_token_ids", "tokenizer",
        # a run of plain steps counts each forward as SGLang's verify (spec_accept_length)
        "spec_verify_ct", "spec_num_correct_drafts", "return_hidden_states",
        # a step's stops checked per token (.stops)
        "finished"),
    "sglang.srt.managers.schedule_batch.ScheduleBatch": (
        "reqs", "forward_mode", "seq_lens", "seq_lens_cpu", "seq_lens_sum", "req_to_token_pool", "req_pool_indices",
        "input_ids", "out_cache_loc", "spec_info", "sampling_info", "return_logprob"),
    "sglang.srt.sampling.sampling_params.SamplingParams": (
        "custom_params", "sampling_seed", "top_k", "temperature", "top_p", "min_p", "frequency_penalty",
        "presence_penalty", "repetition_penalty", "min_new_tokens", "max_new_tokens", "ignore_eos",
        "stop_token_ids", "logit_bias"),
    # Admission (.validation): the request as the tokenizer manager hands it on.
    "sglang.srt.managers.io_struct.TokenizedGenerateReqInput": ("sampling_params", "custom_logit_processor"),
    "sglang.srt.managers.io_struct.GenerateReqInput": ("sampling_params", "input_ids"),
    "sglang.srt.sampling.sampling_batch_info.SamplingBatchInfo": (
        "apply_logits_bias", "has_custom_logit_processor", "logit_bias", "custom_logit_processor", "custom_params",
        "device", "grammar_mask"),
    # Structured output along a draft tree (.grammar): a request's grammar object, walked and rolled back.
    "sglang.srt.constrained.base_grammar_backend.BaseGrammarObject": (
        "accept_token", "rollback", "is_terminated", "finished", "allocate_vocab_mask", "fill_vocab_mask",
        "move_vocab_mask", "apply_vocab_mask"),
    "sglang.srt.managers.utils.GenerationBatchResult": (
        "logits_output", "next_token_ids", "accept_lens", "new_seq_lens", "next_draft_input",
        "speculative_num_draft_tokens", "can_run_cuda_graph"),
    "sglang.srt.speculative.spec_registry.CustomSpecAlgo": ("is_ngram", "has_draft_kv", "handle_server_args"),
    # Tensor parallelism: every rank must draft alike (TOKENSWIFT's candidates and partial KV).
    "sglang.srt.layers.vocab_parallel_embedding.ParallelLMHead": ("tp_size", "use_attn_tp_group", "weight"),
    "sglang.srt.distributed.parallel_state.GroupCoordinator": ("world_size", "all_gather", "all_reduce"),
    "sglang.srt.plugins.hook_registry.HookRegistry": ("register", "apply_hooks", "_patched"),
    "sglang.srt.managers.tokenizer_manager.TokenizerManager": ("model_config", "_subprocess_watchdog", "server_args",
                                                               "preferred_sampling_params", "sampling_params_class"),
    "sglang.srt.server_args.ServerArgs": ("return_hidden_states_mode", "attention_backend", "page_size",
                                          "speculative_num_draft_tokens", "disable_overlap_schedule",
                                          "tp_size", "pp_size", "kv_cache_dtype"),
    # LONGSPEC: the queries' RoPE from the target's own table, the last layer's id in the KV pool.
    "sglang.srt.layers.rotary_embedding.RotaryEmbedding": ("cos_sin_cache", "rotary_dim", "head_size",
                                                           "is_neox_style", "forward_native"),
    "sglang.srt.layers.radix_attention.RadixAttention": ("layer_id",),
}

# -- fields of live objects, checked when a worker is built -------------------------------------

FIELDS: dict[str, tuple[str, ...]] = {
    "target_worker": ("model_runner", "get_memory_pool", "forward_batch_generation"),
    "model_runner": ("model", "device", "model_config", "server_args", "forward"),
    "model": ("get_input_embeddings", "lm_head"),
    # Once SGLang has allocated the pools and built the attention backends.
    "model_runner_ready": ("attn_backend", "token_to_kv_pool", "req_to_token_pool"),
    # Every request's slot row: verify and draft metadata, the cascade's shared-prefix search.
    "req_to_token_pool": ("req_to_token",),
    # What the draft forward's CUDA graphs re-plan and fill (FlashInfer decode wrappers).
    "graph_backend": ("kv_indptr", "cuda_graph_kv_indices", "decode_cuda_graph_metadata",
                      "init_forward_metadata_out_graph", "init_forward_metadata"),
    # FlashInfer's decode wrapper: a re-plan replaces its plan object (read to skip re-planning);
    # the slots it reads when it runs (a per-layer partial-KV draft refills them per layer).
    "decode_wrapper": ("_plan_info", "_paged_kv_indices_buf"),
    # Adaptive speculation: graph runners of narrower verifies (plain steps, draft widths) installed for their forwards.
    "width_graphs": ("decode_cuda_graph_runner", "attn_backend"),
    # The longgen backend's choice of FA3 for plain prefills (SGLang's FA3 backend reads a page size of 1).
    "prefill_runner": ("page_size", "dtype", "device", "model_config"),
    # LONGSPEC: the target's settings its drafter must share; the KV pool its cross-attention reads.
    "model_config": ("hf_text_config", "vocab_size", "context_len"),
    "kv_pool": ("get_kv_buffer", "dtype"),
}


def sglang_version() -> str | None:
    try:
        return version("sglang")
    except PackageNotFoundError:
        return None


def _resolves(path: str) -> bool:
    try:
        pkgutil.resolve_name(path)
        return True
    except Exception:  # noqa: BLE001 - ImportError, AttributeError, or whatever an import raises
        return False


def _declares(cls: type, name: str) -> bool:
    """The class (or a base) defines ``name``, annotates it, or assigns ``self.name`` in its code."""
    if any(name in vars(c) or name in getattr(c, "__annotations__", {}) for c in cls.__mro__):
        return True
    pattern = re.compile(rf"self\.{re.escape(name)}\s*(:[^=\n]*)?=")
    for c in cls.__mro__:
        if c is object:
            continue
        try:
            if pattern.search(inspect.getsource(c)):
                return True
        except (OSError, TypeError):
            continue
    return False


def missing(with_cpu_hooks: bool = False, with_gpu: bool = False) -> list[str]:
    """Each missing piece as ``path (what for)``."""
    out = []
    needs: list[Need] = list(SYMBOLS) + (list(GPU_SYMBOLS) if with_gpu else [])
    hooks = dict(HOOKS, **(CPU_HOOKS if with_cpu_hooks else {}))
    needs += [Need(target, why) for target, _, why in hooks.values()]
    for need in needs:
        if not _resolves(need.path):
            out.append(f"{need.path} ({need.why})")
    members = dict(MEMBERS, **(GPU_MEMBERS if with_gpu else {}))
    for cls_path, names in members.items():
        try:
            cls = pkgutil.resolve_name(cls_path)
        except Exception:  # noqa: BLE001
            out.append(f"{cls_path} (requests and batches)")
            continue
        out += [f"{cls_path}.{name}" for name in names if not _declares(cls, name)]
    return out


def gpu_stack_present() -> bool:
    """FlashInfer imports here (a GPU host): the longgen backend's pieces are then checked too."""
    return importlib.util.find_spec("flashinfer") is not None


def problems(with_cpu_hooks: bool = False, with_gpu: bool = False) -> list[str]:
    """Why this SGLang cannot run our algorithms (empty: it can)."""
    out = []
    found = sglang_version()
    if found not in SUPPORTED_SGLANG and env.get("ALLOW_UNTESTED_SGLANG") not in ("1", "true", "yes"):
        out.append(f"sglang {found} is not a supported version (set {ALLOW_UNTESTED_ENV}=1 to try it anyway)")
    return out + [f"missing {m}" for m in missing(with_cpu_hooks, with_gpu)]


def describe(found: Iterable[str]) -> str:
    lines = list(found)
    return (f"sgl-longgen supports SGLang {', '.join(SUPPORTED_SGLANG)}; the installed SGLang "
            f"({sglang_version()}) cannot run it:\n  - " + "\n  - ".join(lines))


def require_fields(group: str, obj: object) -> None:
    """Stop a worker from starting on an object that lacks what we read from it."""
    lacking = [name for name in FIELDS[group] if not hasattr(obj, name)]
    if lacking:
        raise IncompatibleSGLang(describe(f"{type(obj).__module__}.{type(obj).__qualname__}.{name} ({group})"
                                          for name in lacking))


def apply_hooks(hooks: dict[str, Callable], table: dict[str, tuple[str, str, str]]) -> list[str]:
    """Register ``hooks[name]`` on ``table[name]``'s target, apply them, and return the targets that
    did not take (SGLang's registry logs such a failure and goes on)."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    targets = []
    for name, hook in hooks.items():
        target, kind, _ = table[name]
        HookRegistry.register(target, hook, getattr(HookType, kind))
        targets.append(target)
    HookRegistry.apply_hooks()
    return [t for t in targets if t not in HookRegistry._patched]


def import_module(name: str):
    """Import an SGLang module, turning a failure into :class:`IncompatibleSGLang`."""
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        raise IncompatibleSGLang(describe([f"missing module {name} ({exc})"])) from None
