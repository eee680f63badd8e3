"""A step's verification on SGLang: the padded tries through one TARGET_VERIFY forward, one draw
per node, the walk and the commit, all queued on the device before the host reads anything.

1. Every request's trie is padded to the step's verify width (SGLang verifies a fixed width per
   request; padding hangs off the root and is never walked): ``speculative_num_draft_tokens``,
   or 1 for a plain step of adaptive speculation (the root alone, through its own CUDA graph
   where SGLang captured the target's, see :mod:`.width_graphs`).
2. Each node's logits become its target distribution (SGLang's logit bias, the node's own
   contextual-penalty window, temperature and SGLang's joint top-k/top-p/min-p) and one token is
   drawn there (:func:`sgl_longgen.core.verify.draw_tree`, the reference runtime's draw).
3. The walk runs on the device (:func:`sgl_longgen.core.verify.walk_trees`, or one fused kernel on
   GPUs) and commits each walked path by permuting the request's ``req_to_token`` window: with
   one token per page, SGLang names KV slots only through that row.
4. The draws and counts come back in one page-locked copy; the host repeats the walk
   (:func:`sgl_longgen.core.verify.walk_tree`) for its bookkeeping and checks that both agree.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import msgspec
import numpy as np
import torch
from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardMode

from ..core.sampling import LogitsProcessor
from ..core.tree import DraftTree, bits_to_rows
from ..core.verify import TreeWalks, Verdict, draw_tree, walk_tree, walk_trees
from ..methods import Draft
from .buffers import Staging, VerifyBuffers
from .grammar import apply_masks, tree_masks
from .inputs import TreeVerifyInput
from .requests import StepRequest


def draw_groups(steps: list[StepRequest],
                no_bias: bool) -> list[tuple[list[int], object, torch.Generator | None]]:
    """Requests whose draws are taken in one call, as ``(rows, settings, generator)``: nothing of
    SGLang's processing on their rows (no blocker, no logit bias, no grammar) and no contextual
    penalty (whose window is each node's own path). The greedy ones form one group whatever their settings (one
    argmax over all their rows). Sampled ones group, two or more, by the same settings and the same
    generator (requests without a seed share the table's): each node's token is still drawn from
    its own row's distribution with noise of its own (:func:`~sgl_longgen.core.sampling.exponential_race`
    over the rows together), so the law is the per-request draw's; what changes is the launches: a
    batch's plain step, one row per request, draws in one call instead of one per request between
    two forwards. Drawing at every row of the padded width, where a request walks fewer, costs noise
    nobody reads. A request's own seed keeps its own generator and its own draw (its sample stays
    pinned by the seed). The others draw one by one (:func:`~sgl_longgen.core.verify.draw_tree`)."""
    if not no_bias:
        return []
    greedy: list[int] = []
    sampled: dict[tuple, list[int]] = {}
    for b, step in enumerate(steps):
        if step.blocker is not None or step.sampling.penalty_active or step.grammar is not None:
            continue
        if step.sampling.greedy:
            greedy.append(b)
        else:
            sampled.setdefault((id(step.state.generator), msgspec.structs.astuple(step.sampling)), []).append(b)
    groups = [(greedy, steps[greedy[0]].sampling, None)] if greedy else []
    return groups + [(members, steps[members[0]].sampling, steps[members[0]].state.generator)
                     for members in sampled.values() if len(members) > 1]


def batch_rows(members: list[int], cache: dict[tuple[int, ...], torch.Tensor], device) -> slice | torch.Tensor:
    """An index of these batch rows (ascending) that never makes the host wait: a slice where they
    are contiguous, else a device tensor made once per set of rows (kept in ``cache``). A list
    index copies itself to the device from pageable memory, which synchronizes the stream: in a run
    of plain steps that is before every forward, and the GPU then idles while the host queues the next."""
    if members[-1] - members[0] == len(members) - 1:
        return slice(members[0], members[-1] + 1)
    key = tuple(members)
    index = cache.get(key)
    if index is None:
        if len(cache) >= 256:
            cache.clear()
        index = cache[key] = torch.tensor(key, dtype=torch.int64, device=device)
    return index


@dataclass
class VerifyWindows:
    """Verify inputs known before the tries: slots and the FULL custom mask's prefix part."""

    out_cache_loc: torch.Tensor  # [bs * N] int64: each request's verify window
    custom_mask: torch.Tensor | None  # flat FULL-layout mask, all True until the tries go in
    mask_offsets: list[int]  # where each request's [N, seq_len + N] block starts
    width: int  # N: nodes per request in this step's verify


@dataclass
class Launched:
    """A verify forward on its way: SGLang's result and the inputs it read."""

    result: object  # GenerationBatchResult of the target's forward
    inputs: VerifyBuffers
    spec: TreeVerifyInput


class Verifier:
    def __init__(self, target_worker, num_nodes: int, vocab_size: int, device: torch.device, staging: Staging,
                 capture_hidden_mode: CaptureHiddenMode):
        self.target_worker = target_worker
        self.runner = target_worker.model_runner
        self.num_nodes = num_nodes
        self.vocab_size = vocab_size
        self.device = device
        self.staging = staging
        self.capture_hidden_mode = capture_hidden_mode
        self.full_mask: bool | None = None  # decided at the first step: the backend exists by then
        self._buffers: dict[tuple[int, int], VerifyBuffers] = {}
        self.graphs_by_width: dict[int, object] = {}  # verify widths with a CUDA-graph runner of their own
        self._windows: VerifyWindows | None = None
        self._last: tuple[list[StepRequest], list[Draft]] | None = None  # for the rehearsal
        self._columns = torch.arange(num_nodes, device=device)  # a verify window's columns
        self._row_index: dict[tuple[int, ...], torch.Tensor] = {}  # see batch_rows
        self._fused = None  # the fused walk-and-commit kernel, on GPUs
        # The last draw's root rows after SGLang's processing (None: no blocked request): a
        # request's logprobs are those of the distribution its token was drawn from.
        self.root_logits: torch.Tensor | None = None
        if device.type == "cuda":
            from ..kernels.tree_accept import MAX_NODES, walk_and_commit

            if num_nodes <= MAX_NODES:
                self._fused = walk_and_commit

    def warm_up(self, widths: list[int]) -> None:
        """Compile the fused walk for each verify width before a request needs it.

        Triton specializes the kernel per width (its block size), and it runs outside the
        captured graphs: the first step of each width would compile it inside some request,
        a fraction of a second on that request's clock. It runs here on scratch tensors of the
        real ones' dtypes and strides, so the variant compiled is the one the steps launch.
        """
        if self._fused is None:
            return
        table = self.runner.req_to_token_pool.req_to_token
        scratch = torch.zeros(1, table.shape[1], dtype=table.dtype, device=self.device)
        one = torch.zeros(1, dtype=torch.int64, device=self.device)
        for n in sorted({w for w in widths if 1 <= w <= self.num_nodes}):
            zeros = torch.zeros(1, n, dtype=torch.int64, device=self.device)
            self._fused(zeros, zeros, torch.full_like(zeros, -1),
                        torch.zeros(1, n, n, dtype=torch.bool, device=self.device), scratch, one, one)

    # -- inputs ------------------------------------------------------------------------------------

    def prepare(self, batch, steps: list[StepRequest], width: int | None = None) -> None:
        """What does not need the tries, queued now (a drafter calls it while its forward runs).

        Also fills the verify inputs once from the previous step's tries and drops them: run
        cold, after SGLang's scheduler has been through its own data between steps, that Python
        takes 3-4 times as long as warm, and here the host waits for the draft forward anyway.
        """
        if self.full_mask is None:
            # Backends that verify from TreeVerifyInput.tree_mask alone (ours) say so; for the
            # others each step builds SGLang's FULL custom mask ([N, seq_len + N] per request).
            reads_tree_blocks = getattr(self.runner.attn_backend, "reads_tree_blocks", None)
            self.full_mask = not (callable(reads_tree_blocks) and reads_tree_blocks())
        n = width or self.num_nodes
        table = batch.req_to_token_pool.req_to_token
        windows = [table[s.req.req_pool_idx, s.seq_len : s.seq_len + n] for s in steps]
        # A copy, never a view of the table: the commit permutes the table's window entries.
        out_cache_loc = windows[0].to(torch.int64, copy=True) if len(windows) == 1 else torch.cat(windows).to(torch.int64)
        custom_mask, offsets = None, []
        if self.full_mask:
            total = 0
            for s in steps:
                offsets.append(total)
                total += n * (s.seq_len + n)
            custom_mask = torch.ones(total, dtype=torch.bool, device=self.device)
        self._windows = VerifyWindows(out_cache_loc, custom_mask, offsets, n)
        last = self._last
        if last is not None and len(last[1]) == len(steps) and n > 1 and all(len(d.tree) <= n for d in last[1]):
            self._fill(steps, last[1], n)

    def _buffers_for(self, bs: int, n: int) -> VerifyBuffers:
        buffers = self._buffers.get((bs, n))
        if buffers is None:
            buffers = self._buffers[bs, n] = VerifyBuffers(bs, n, self.device)
        return buffers

    def _fill(self, steps: list[StepRequest], drafts: list[Draft], n: int) -> VerifyBuffers:
        """The tries' verify inputs in the page-locked host buffer (nothing queued on the device)."""
        buf = self._buffers_for(len(drafts), n)
        tokens, positions, parents, walk_tokens = buf.ints
        for b, (step, draft) in enumerate(zip(steps, drafts)):
            tree = draft.tree
            t, walkable = len(tree), tree.num_walkable
            if t > n:
                raise RuntimeError(f"draft produced {t} nodes, more than the verify width {n}")
            pad = n - t
            bits = tree.ancestor_bits()
            bits.extend(1 | (1 << i) for i in range(t, n))  # padding nodes: the root and themselves
            bits_to_rows(bits, n, buf.masks[b])
            tokens[b] = tree.tokens + [step.root] * pad
            positions[b] = tree.depths + [1] * pad
            positions[b] += step.seq_len
            parents[b] = [0, *tree.parents[1:]] + [0] * pad
            walk_tokens[b] = [-1, *tree.tokens[1:walkable]] + [-1] * (n - walkable)
        return buf

    # -- the forward ---------------------------------------------------------------------------------

    def launch(self, batch, steps: list[StepRequest], drafts: list[Draft],
               before_forward: Callable[[object], None]) -> Launched:
        """Queue the verify forward of the padded tries (``before_forward(batch)``: a drafter's last
        changes to the batch, such as input-embedding overrides)."""
        if self._windows is None:
            self.prepare(batch, steps)
        windows, self._windows = self._windows, None
        n = windows.width
        buf = self._fill(steps, drafts, n)
        if n > 1:  # a plain step's inputs are filled in no time: nothing to rehearse
            self._last = (steps, drafts)
        buf.device.copy_(buf.host, non_blocking=True)
        if windows.custom_mask is not None:
            for b, (step, offset) in enumerate(zip(steps, windows.mask_offsets)):
                width = step.seq_len + n
                windows.custom_mask[offset : offset + n * width].view(n, width)[:, step.seq_len :].copy_(buf.tree_mask[b])
        return self._forward(batch, buf, windows, before_forward)

    def relaunch(self, batch, steps: list[StepRequest], last: Launched, roots: torch.Tensor,
                 before_forward: Callable[[object], None]) -> Launched:
        """The next forward of a run of plain steps: the roots alone one position further on.

        ``roots`` (``[bs]`` int64, on the device) are the tokens the last forward drew, and the
        positions move by one on the device too, so the host queues the whole run without waiting
        for a draw. The page-locked inputs are not refilled: the device may not have read them
        yet (:mod:`.buffers`). ``steps`` carry this forward's ``seq_len``.
        """
        buf = last.inputs
        if tuple(buf.tree_mask.shape[1:]) != (1, 1):
            raise ValueError("only a width-1 verify can be relaunched")
        self.prepare(batch, steps, width=1)
        windows, self._windows = self._windows, None
        buf.draft_token.copy_(roots)
        buf.positions.add_(1)
        return self._forward(batch, buf, windows, before_forward)

    def _forward(self, batch, buf: VerifyBuffers, windows: VerifyWindows,
                 before_forward: Callable[[object], None]) -> Launched:
        n = windows.width
        spec = TreeVerifyInput(draft_token=buf.draft_token, positions=buf.positions, tree_mask=buf.tree_mask,
                               custom_mask=windows.custom_mask, draft_token_num=n,
                               capture_hidden_mode=self.capture_hidden_mode)
        batch.forward_mode = ForwardMode.TARGET_VERIFY
        batch.input_ids = spec.draft_token
        batch.out_cache_loc = windows.out_cache_loc
        batch.spec_info = spec
        before_forward(batch)
        graphs = self.graphs_by_width.get(n)
        if graphs is None:
            result = self.target_worker.forward_batch_generation(batch, is_verify=True)
        else:
            with graphs.installed():
                result = self.target_worker.forward_batch_generation(batch, is_verify=True)
        return Launched(result, buf, spec)

    # -- draws, walk, commit ---------------------------------------------------------------------------

    def draw(self, batch, steps: list[StepRequest], drafts: list[Draft], logits: torch.Tensor) -> torch.Tensor:
        """One token per node, each from that node's exact target distribution: ``[bs, N]``.

        Queued on the device without a host sync; nodes a walk never draws at (padding, leaves)
        hold any value.
        """
        vocab, bs = self.vocab_size, len(steps)
        n = logits.shape[0] // bs
        logits = logits[:, :vocab].view(bs, n, vocab)
        info = batch.sampling_info
        root_sglang = self.root_logits = None
        if any(s.blocker is not None for s in steps):
            # SGLang's own processing of the root rows: penalizers, bias, custom processors (the
            # grammar's mask is ours, below: SGLang's may still be the prefill's).
            from sglang.srt.layers.sampler import apply_custom_logit_processor

            root_sglang = logits[:, 0].clone()
            info.grammar_mask = None
            info.apply_logits_bias(root_sglang)
            if info.has_custom_logit_processor:
                apply_custom_logit_processor(root_sglang, info)
            self.root_logits = root_sglang
        groups = draw_groups(steps, info.logit_bias is None)
        if len(groups) == 1 and len(groups[0][0]) == bs:
            _, sampling, generator = groups[0]
            return LogitsProcessor(sampling, vocab).sample(logits.flatten(0, 1), None, generator).view(bs, n)
        draws = torch.full((bs, n), -2, dtype=torch.int64, device=logits.device)  # no token, no walk token
        done = set()
        for members, sampling, generator in groups:
            rows = batch_rows(members, self._row_index, self.device)
            draws[rows] = LogitsProcessor(sampling, vocab).sample(logits[rows].flatten(0, 1), None, generator).view(
                len(members), n)
            done.update(members)
        for b, (step, draft) in enumerate(zip(steps, drafts)):
            if b in done:
                continue
            grammar = step.grammar
            if step.blocker is not None:
                # Any penalty is already in SGLang's processing of the root.
                root = root_sglang[b : b + 1]
                if grammar is not None:
                    apply_masks(grammar, root, tree_masks(grammar, DraftTree(step.root), vocab))
                proc = LogitsProcessor(msgspec.structs.replace(step.sampling, penalty=1.0), vocab)
                draws[b, :1] = proc.sample(root, None, step.state.generator)
                continue
            tree = draft.tree
            rows = logits[b, : tree.num_walkable]  # leaves (e.g. [SPEC]) are never drawn from
            if info.logit_bias is not None:
                rows = rows + info.logit_bias[b, :vocab]
            elif grammar is not None:
                rows = rows.clone()  # masked below: the verify's logits stay as the forward left them
            if grammar is not None:
                apply_masks(grammar, rows, tree_masks(grammar, tree, vocab))
            draws[b, : tree.num_walkable] = draw_tree(rows, tree, LogitsProcessor(step.sampling, vocab), step.history,
                                                      step.state.generator)
        return draws

    def walk_and_commit(self, batch, seq_lens: torch.Tensor, draws: torch.Tensor, inputs: VerifyBuffers) -> TreeWalks:
        """The device walk of every trie, and each walked path's KV put at the front of its window.

        On a GPU one fused kernel does both (:mod:`sgl_longgen.kernels.tree_accept`): the ~20
        small torch ops would each leave the device idle for a launch between the two forwards.
        """
        table = batch.req_to_token_pool.req_to_token
        if self._fused is not None:
            count, last, order = self._fused(draws, inputs.parents, inputs.walk_tokens, inputs.tree_mask,
                                             table, batch.req_pool_indices, seq_lens)
            return TreeWalks(count, last, order)
        walks = walk_trees(draws, inputs.parents, inputs.walk_tokens, inputs.tree_mask)
        # Permuting the window's entries commits the path without touching the KV: SGLang frees
        # and reuses over-allocated slots through the row, and the root stays in place.
        rows = batch.req_pool_indices[:, None]
        cols = seq_lens[:, None] + self._columns[: draws.shape[1]]
        table[rows, cols] = table[rows, cols].gather(1, walks.order)
        return walks

    def read_back(self, draws: torch.Tensor, counts: torch.Tensor) -> Callable[[], tuple[np.ndarray, list[int]]]:
        """Queue the draws and the device walk's counts to the host; returns the wait for them.

        One page-locked copy and an event: the host then waits for the verify forward and the
        draws only, not for anything queued after them (a chained draft).
        """
        bs, n = draws.shape
        host = self.staging("readback", bs * n + bs, torch.int64)
        host[: bs * n].view(bs, n).copy_(draws, non_blocking=True)
        host[bs * n :].copy_(counts, non_blocking=True)
        event = None
        if self.device.type == "cuda":
            event = torch.cuda.Event()
            event.record()

        def wait() -> tuple[np.ndarray, list[int]]:
            if event is not None:
                event.synchronize()
            values = host.numpy()
            return values[: bs * n].reshape(bs, n), values[bs * n :].tolist()

        return wait

    @staticmethod
    def host_walks(drafts: list[Draft], drawn: np.ndarray, counts: list[int]) -> list[Verdict]:
        """The walk repeated on the host draws; a disagreement with the device walk is an error."""
        verdicts = []
        for b, (draft, count) in enumerate(zip(drafts, counts)):
            verdict = walk_tree(draft.tree, drawn[b].__getitem__)
            if len(verdict.nodes) != count:
                raise RuntimeError(f"device walk committed {count} tokens, host walk {len(verdict.nodes)}")
            verdicts.append(verdict)
        return verdicts

    def logprobs(self, batch, logits_output, drafts: list[Draft], drawn: np.ndarray, verdicts: list[Verdict]) -> None:
        from sglang.srt.layers.logprob_processor import compute_spec_v2_logprobs

        n = drawn.shape[1]
        if self.root_logits is not None:
            # Logprob requests are blocked (root-only): their root rows as SGLang processed them,
            # penalties and grammar included, as plain decoding's sampler returns them.
            rows = logits_output.next_token_logits.view(len(drafts), n, -1)
            rows[:, 0, : self.vocab_size] = self.root_logits
        predict = torch.zeros(len(drafts) * n, dtype=torch.int64)
        accept_index = torch.full((len(drafts), n), -1, dtype=torch.int64)
        for b, (draft, verdict) in enumerate(zip(drafts, verdicts)):
            k = draft.tree.num_walkable  # the nodes drawn at
            predict[b * n : b * n + k] = torch.from_numpy(drawn[b, :k].copy())
            accept_index[b, : len(verdict.nodes)] = torch.tensor(verdict.nodes) + b * n
        compute_spec_v2_logprobs(batch, logits_output, predict.to(self.device), accept_index.to(self.device), n - 1)
