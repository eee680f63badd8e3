"""Every request's slot-table row holds SGLang's per-step reserve, up to the end of the context.

SGLang's speculative decode step (``eagle_prepare_for_decode`` -> ``alloc_for_spec_decode``)
reserves KV slots for each request up to ``kv_committed_len + get_alloc_reserve_per_decode()``,
that is ``2 * max(num_steps * topk, num_draft_tokens)`` past its committed KV at page size 1, and
writes their ids into the request's ``req_to_token`` row. The row is ``context_len +
get_req_to_token_extra_context_len()`` wide, ``context_len + 4 + num_draft_tokens``: SGLang widens
it to its reserve only for page sizes above 1, and our algorithms run with one token per page. A
request that decodes to the end of the context has up to ``context_len - 4`` committed tokens at
its last step (the scheduler clips ``max_new_tokens`` to ``context_len - 2 - prompt``; the last
token drawn has no KV yet), so its reserve would end up to ``reserve - num_draft_tokens - 8``
entries past its row (56 with TOKENSWIFT's defaults): on the CPU engine the row write raises in
the scheduler; on a GPU SGLang's kernel writes the excess slot ids over the next row (another
request's first slots) and those slots are never freed (SGLang's idle check then stops the
scheduler on the leak).

:func:`widen_rows` (a hook on SGLang's row headroom, only for our algorithms) makes every row
``4 + reserve`` past the context instead. Why that is enough, and what it changes:

* **bounded**: a request's committed KV never exceeds ``context_len - 4`` at a decode step, so
  its reserve ends at ``context_len - 4 + reserve`` at most, inside the row. Everything our
  steps address lies inside that reserve: a verify window is ``[seq_len, seq_len + N)``; a run
  of plain steps uses its first ``k <= N`` slots; the next step queued ahead
  (:mod:`.spec_ahead`, :mod:`.run_ahead`) starts at most ``N`` further on, its window ending by
  ``seq_len + 2N``; the drafters read committed slots only (``[0, seq_len)``) or the window's
  first. Tree nodes past the context's end (deeper than any budget reaches) have positions inside
  the RoPE table SGLang extends for speculative servers. :func:`check_rows` stops a worker whose
  rows SGLang built narrower (a pool kind that sizes its rows by its own rule) at startup, with
  the widths, before a request can overrun one;
* **lossless**: only the table's width changes. The same slots are reserved, the same tokens
  verified and committed, and a request near the end of the context ends exactly where plain
  decoding ends it: SGLang's length clip, the same ``max_new_tokens`` and finish reason, the
  tokens a step accepted past the budget dropped by SGLang as at any budget;
* **cheap**: ``reserve - num_draft_tokens`` more int32 entries per row (a few hundred bytes a
  request), no KV memory: the KV pool's size and the slots reserved per step are SGLang's.
"""

from __future__ import annotations

# SGLang's own headroom past the context besides the speculative reserve (its decode over-allocation).
BASE_HEADROOM = 4


def runs_ours(server_args) -> bool:
    from .plugin import ALGORITHMS

    return (getattr(server_args, "speculative_algorithm", None) or "").upper() in ALGORITHMS


def reserve(server_args) -> int:
    """KV slots SGLang reserves past a request's committed tokens at each speculative decode step."""
    from sglang.srt.mem_cache.allocation_sizing import get_alloc_reserve_per_decode

    return int(get_alloc_reserve_per_decode(server_args))


def headroom(server_args) -> int:
    """Row entries past ``context_len`` that hold a request's reserve at its last step."""
    return BASE_HEADROOM + reserve(server_args)


def widen_rows(result: int, server_args, *args, **kwargs) -> int | None:
    """After SGLang's ``get_req_to_token_extra_context_len``: at least :func:`headroom` where one of
    our algorithms runs (None: SGLang's value stands)."""
    if not runs_ours(server_args):
        return None
    return max(int(result), headroom(server_args))


def check_rows(req_to_token_pool, context_len: int, server_args) -> None:
    """Stop a worker whose slot rows cannot hold a request's reserve at the end of the context."""
    width = int(req_to_token_pool.req_to_token.shape[1])
    need = int(context_len) + headroom(server_args)
    if width < need:
        raise RuntimeError(
            f"{server_args.speculative_algorithm}: the slot table's rows hold {width} entries, fewer than the "
            f"context length {context_len} plus {headroom(server_args)} (SGLang reserves {reserve(server_args)} "
            f"slots past a request's committed tokens at each step): a request at the end of the context would "
            f"write past its row. This kind of SGLang memory pool sizes its rows without the plugin's headroom")
