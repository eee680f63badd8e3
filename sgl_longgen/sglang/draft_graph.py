"""CUDA graphs of the 1-token draft forward over a partial KV.

SGLang captures graphs of speculative algorithms only at their verify width, so our draft decode
(one root token per request over an explicit ``kv_indices`` list) ran eagerly: at batch 1 an
8B model's 32 layers spend several times longer in Python and kernel launches than in GPU work. This
runner captures that same model forward once per batch size, with the attention backend's own
graph-mode decode wrappers (``init_forward_metadata_out_graph``), and replays it after
re-planning the wrappers with the step's indices (and copying those indices into the buffers the
graph reads: see :meth:`DraftGraphRunner._bind`). The graph runs the decoder stack only (no
LM head): the method's own device work on the final states (``post``: TokenSwift's base and extra
heads in one GEMM, and their top-k) is captured in the same graph.

A replay needs only the few tensors the graph reads (:data:`INPUTS`), so a step whose graph
exists skips building a ``ForwardBatch`` (:meth:`DraftGraphRunner.replay`).

Drafts that read one slot list per layer (``PartialDraftInput.layer_kv_indices``, the ``verify``
partial-KV policy) replay from a persistent ``[layers, bs * kv_width]`` buffer of their own: the
graph captures each layer's copy of its row into the decode wrapper's indices (see the ``longgen``
backend's ``forward_decode``), so the copy is as wide as any draft of that batch size can be.

Steps that re-score the committed positions for the partial-KV policy (forward hooks that read
each layer's query) stay eager, as does anything the runner cannot serve. The first replay of
each captured size is compared with the eager forward it was captured from, and so is the first
replay after it (new slots, after a verify forward has used the same buffers); a mismatch turns
the runner off with a warning rather than risk a wrong draft (drafts never change the output,
but a wrong one would cost acceptance silently).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from . import compat

logger = logging.getLogger(__name__)

_STATIC = ("input_ids", "positions", "out_cache_loc", "req_pool_indices", "seq_lens")
# What a replay reads: the static tensors, plus what re-plans the attention wrappers.
INPUTS = (*_STATIC, "seq_lens_cpu", "seq_lens_sum", "spec_info")

Post = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, ...]]


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    batch: object  # the ForwardBatch whose tensors the graph reads
    normed: torch.Tensor  # the final norm's output: compared with the eager forward's
    outputs: tuple[torch.Tensor, ...]
    checked: bool = False  # a replay on other inputs than the capture's matched the eager forward
    plan: tuple | None = None  # (KV lengths, the wrappers' plan objects) of the last plan we made
    layer_indices: torch.Tensor | None = None  # [layers, bs * kv_width]: per-layer drafts' slots


class DraftGraphRunner:
    """``post(normed_states, pre_norm_states)`` runs after the forward, in the graph when there is one.

    ``kv_width``: the most KV slots one request's draft reads (per-layer drafts only).
    """

    def __init__(self, model_runner, capture, post: Post, max_bs: int = 8, kv_width: int | None = None):
        self.runner = model_runner
        self.capture = capture  # PreNormCapture on the same model
        self.post = post
        self.max_bs = max_bs
        self.kv_width = kv_width
        self.graphs: dict[int, _Graph] = {}
        self.enabled: bool | None = None  # decided at the first draft: the backend exists by then

    def _supported(self) -> bool:
        """Graphs are captured with FlashInfer's graph-mode decode wrappers (``longgen`` and
        ``flashinfer`` backends on a GPU); other backends draft eagerly."""
        runner = self.runner
        if not str(runner.device).startswith("cuda") or runner.server_args.disable_cuda_graph:
            return False
        from sglang.srt.layers.attention.flashinfer_backend import FlashInferAttnBackend

        backend = runner.attn_backend
        if not isinstance(backend, FlashInferAttnBackend):
            return False
        compat.require_fields("graph_backend", backend)
        return backend.cuda_graph_kv_indices is not None and backend.kv_indptr is not None

    def can_run(self, forward_batch) -> bool:
        if self.enabled is None:
            self.enabled = self._supported()
        spec = forward_batch.spec_info
        return self.enabled and forward_batch.batch_size <= self.max_bs and not spec.wants_scores

    def would_capture(self, batch_size: int) -> bool:
        """A draft forward of this batch size could capture its graph now (none captured yet;
        True also while it is not known yet whether this runner serves at all)."""
        if self.enabled is None:
            return True
        return bool(self.enabled) and batch_size <= self.max_bs and batch_size not in self.graphs

    def ready(self, batch_size: int) -> bool:
        """A checked graph for this batch size exists: :meth:`load` and :meth:`launch` can serve the step."""
        entry = self.graphs.get(batch_size)
        return bool(self.enabled) and entry is not None and entry.checked

    def run(self, forward_batch) -> tuple[torch.Tensor, ...]:
        """``post``'s outputs for this forward (captured first if its batch size is new)."""
        entry = self.graphs.get(forward_batch.batch_size)
        if entry is None:
            return self._capture(forward_batch)
        if not entry.checked:
            return self._check(entry, forward_batch)
        return self.replay(forward_batch)

    def replay(self, inputs) -> tuple[torch.Tensor, ...]:
        """Replay the graph of ``inputs.input_ids``'s batch size; ``inputs`` has :data:`INPUTS`."""
        self.load(inputs)
        return self.launch(inputs.input_ids.shape[0])

    def load(self, inputs) -> None:
        """Host half of a replay: the graph's inputs and the attention plan for ``inputs``."""
        self._load(self.graphs[inputs.input_ids.shape[0]], inputs)

    def launch(self, batch_size: int) -> tuple[torch.Tensor, ...]:
        """Device half of a replay (after :meth:`load`): ``post``'s outputs, computed asynchronously."""
        entry = self.graphs[batch_size]
        entry.graph.replay()
        return entry.outputs

    # -- internals ---------------------------------------------------------------------------------

    def _context(self):
        from sglang.srt.model_executor.forward_context import ForwardContext, forward_context

        return forward_context(ForwardContext(attn_backend=self.runner.attn_backend))

    def _load(self, entry: _Graph, inputs) -> None:
        static = entry.batch
        for name in _STATIC:
            getattr(static, name).copy_(getattr(inputs, name), non_blocking=True)
        static.seq_lens_cpu = inputs.seq_lens_cpu
        static.seq_lens_sum = inputs.seq_lens_sum
        static.spec_info = inputs.spec_info  # its kv_indptr / kv_indices plan the wrappers
        lens = tuple(inputs.seq_lens_cpu.tolist())
        if not self._plan_current(entry, lens):
            with self._context():
                self.runner.attn_backend.init_forward_metadata_out_graph(static, in_capture=False)
            entry.plan = (lens, self._plan_infos(static.batch_size))
        self._bind(entry, inputs.spec_info)

    def _plan_infos(self, bs: int) -> tuple:
        wrappers = self.runner.attn_backend.decode_cuda_graph_metadata.get(bs, ())
        for w in wrappers:
            compat.require_fields("decode_wrapper", w)
        return tuple(w._plan_info for w in wrappers)

    def _plan_current(self, entry: _Graph, lens: tuple) -> bool:
        """The wrappers still hold our plan for these KV lengths, so re-planning can be skipped.

        A decode plan depends only on the per-request KV lengths, which stay at the partial-KV
        budget step after step; the slots themselves are copied in by :meth:`_bind`. Every plan
        replaces a wrapper's ``_plan_info`` object, so another plan of the same wrappers in
        between is seen by identity.
        """
        if entry.plan is None or entry.plan[0] != lens:
            return False
        current = self._plan_infos(entry.batch.batch_size)
        return len(current) == len(entry.plan[1]) and all(
            a is not None and a is b for a, b in zip(current, entry.plan[1]))

    def _bind(self, entry: _Graph, spec) -> None:
        """Put this step's ``kv_indptr`` / ``kv_indices`` where the captured kernels read them.

        Re-planning a graph's decode wrappers goes through FlashInfer's ``fast_decode_plan``,
        which copies neither: SGLang's own draft backends write them straight into the
        backend's graph buffers (``kv_indptr[i]``, ``cuda_graph_kv_indices[i]``). The verify
        graph fills the same buffers with its slots, so without this copy a replay would attend
        to the last verify's first positions instead of the partial KV. Per-layer slot lists go
        into the graph's own buffer, which its captured per-layer copies read.
        """
        backend = self.runner.attn_backend
        bs = entry.batch.batch_size
        n = spec.kv_indices.numel()
        for i in range(getattr(backend, "num_wrappers", 1)):
            backend.kv_indptr[i][: bs + 1].copy_(spec.kv_indptr, non_blocking=True)
            backend.cuda_graph_kv_indices[i][:n].copy_(spec.kv_indices, non_blocking=True)
        per_layer = getattr(spec, "layer_kv_indices", None)
        if (per_layer is None) != (entry.layer_indices is None):
            raise RuntimeError("a draft graph replayed with and without per-layer KV indices")
        if per_layer is not None and per_layer is not entry.layer_indices:
            entry.layer_indices[:, : per_layer.shape[1]].copy_(per_layer, non_blocking=True)

    def _forward(self, forward_batch):
        model = self.runner.model
        decoder = getattr(model, "model", None)  # the decoder stack without the LM head
        run = decoder if isinstance(decoder, torch.nn.Module) else model
        with self.capture:
            run(forward_batch.input_ids, forward_batch.positions, forward_batch)
        normed, pre_norm = self.capture.normed, self.capture.value
        return normed, self.post(normed, pre_norm)

    def _matches(self, graph_normed: torch.Tensor, eager_normed: torch.Tensor) -> tuple[bool, str]:
        err = (graph_normed.float() - eager_normed.float()).abs().max().item()
        tol = 2e-2 * max(1.0, eager_normed.float().abs().max().item())
        return err <= tol, f"replayed draft states differ from eager by {err:.3g} (tolerance {tol:.3g})"

    def _check(self, entry: _Graph, forward_batch) -> tuple[torch.Tensor, ...]:
        """The first replay after capture, against the eager forward on the same inputs."""
        bs = forward_batch.batch_size
        self.replay(forward_batch)
        graph_normed = entry.normed.clone()
        with self._context():
            self.runner.attn_backend.init_forward_metadata(forward_batch)
            eager_normed, outputs = self._forward(forward_batch)
        ok, why = self._matches(graph_normed, eager_normed)
        if ok:
            entry.checked = True
            logger.info("draft CUDA graph for batch size %d checked against the eager forward", bs)
        else:
            self.enabled = False
            logger.warning("draft CUDA graphs off (batch size %d): %s", bs, why)
        return outputs

    def _layer_buffer(self, spec, bs: int) -> torch.Tensor | None:
        """A per-layer draft's persistent slot buffer, holding this draft's lists (None otherwise)."""
        per_layer = getattr(spec, "layer_kv_indices", None)
        if per_layer is None:
            return None
        if self.kv_width is None:
            raise RuntimeError("per-layer draft KV indices need the draft graph runner's kv_width")
        layers, n = per_layer.shape
        if n > bs * self.kv_width:
            raise RuntimeError(f"a draft of {n} KV slots for {bs} requests, at most {self.kv_width} each")
        buf = torch.zeros(layers, bs * self.kv_width, dtype=per_layer.dtype, device=per_layer.device)
        buf[:, :n].copy_(per_layer)
        spec.layer_kv_indices = buf  # what the captured per-layer copies read
        return buf

    def _capture(self, forward_batch) -> tuple[torch.Tensor, ...]:
        """Capture for this batch size, then check one replay against the eager forward."""
        from sglang.srt.model_executor.runner_utils import capture_mode

        bs = forward_batch.batch_size
        for name in _STATIC:  # the graph's inputs: tensors this runner owns from now on
            setattr(forward_batch, name, getattr(forward_batch, name).clone())
        layer_indices = self._layer_buffer(forward_batch.spec_info, bs)
        backend = self.runner.attn_backend
        try:
            with self._context():
                backend.init_forward_metadata_out_graph(forward_batch, in_capture=True)
                eager_normed, eager_outputs = self._forward(forward_batch)  # warm-up and reference
                eager_normed = eager_normed.clone()
                eager_outputs = tuple(t.clone() for t in eager_outputs)
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                previous, capture_mode.is_capture_mode = capture_mode.is_capture_mode, True
                try:
                    with torch.cuda.graph(graph):
                        normed, outputs = self._forward(forward_batch)
                finally:
                    capture_mode.is_capture_mode = previous
            entry = _Graph(graph, forward_batch, normed, outputs, layer_indices=layer_indices)
            self._load(entry, forward_batch)
            graph.replay()
            torch.cuda.synchronize()
            ok, why = self._matches(normed, eager_normed)
            if not ok:
                raise RuntimeError(why)
        except Exception as exc:  # keep serving eagerly; say why once
            self.enabled = False
            logger.warning("draft CUDA graphs off (batch size %d): %s", bs, exc)
            with self._context():
                backend.init_forward_metadata(forward_batch)
                return self._forward(forward_batch)[1]
        self.graphs[bs] = entry
        logger.info("captured the draft forward for batch size %d", bs)
        return eager_outputs
