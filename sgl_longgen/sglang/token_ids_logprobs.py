"""Given token ids' logprobs in a batch where only some requests ask for them.

SGLang's ``get_token_ids_logprobs_raw`` leaves a request that asks for none an empty *list*
among the others' tensors when it keeps them on the device (``no_copy_to_cpu``); the scheduler
then calls ``.tolist()`` on every entry and exits (``'list' object has no attribute 'tolist'``),
taking every running request with it, plain decoding included. After it, such an entry becomes
an empty tensor of the same device and dtype: ``.tolist()`` gives the same empty list SGLang
meant, and nothing else changes. Applied wherever the plugin is installed (every algorithm).
"""

from __future__ import annotations


def empty_entries_as_tensors(result, logprobs, token_ids_logprobs_list, stage,
                             extend_logprob_pruned_lens_cpu=None, no_copy_to_cpu: bool = False):
    """After ``get_token_ids_logprobs_raw``: ``(vals, idxs)`` with each empty ``vals`` entry an
    empty tensor where the others stay on the device (None: SGLang's result stands)."""
    if not no_copy_to_cpu:
        return None
    vals, idxs = result
    if all(not isinstance(v, list) for v in vals):
        return None
    return [logprobs.new_empty(0) if isinstance(v, list) and not v else v for v in vals], idxs
