"""A step that commits several tokens ends a request where plain decoding would have.

SGLang's scheduler calls ``Req.update_finish_state(n)`` once per decode step, with the ``n``
tokens the step committed already in ``output_ids``. Its checks take the ``n`` tokens as one:

* ``max_new_tokens`` is checked first, so a step that reaches the limit ends with ``length`` even
  where a stop token or string came earlier in it (plain decoding stopped there);
* a ``stop_regex`` is searched in one text that ends at the step's last token, so an end-anchored
  pattern (``[.!?]\\s*$``) misses a match that ended inside the step, and the request runs on;
* a stop string anywhere in the step wins over an earlier stop token.

Plain decoding checks after every token. So on servers running our algorithms,
:func:`finish_per_token` runs SGLang's own check once per committed token, on the output as it
stood after that token (a one-token step, as plain decoding calls it): the request ends at the
first token where plain decoding would have ended, with the same finish reason and the same
``finished_len`` (the output SGLang returns). The tokens committed past that point stay in
``output_ids`` as SGLang leaves them after any speculative step that overshoots a stop (its KV is
released with the request).
"""

from __future__ import annotations


def ours() -> bool:
    """A worker of ours runs in this process (the scheduler's). Imported here: the plugin's
    modules are imported in every SGLang process, and ``.requests`` brings torch."""
    from .requests import worker_active

    return worker_active()


def finish_per_token(update_finish_state, req, new_accepted_len: int = 1):
    """``Req.update_finish_state`` (an AROUND hook): SGLang's check after each of the step's
    tokens in turn, up to the first that finishes the request."""
    n = new_accepted_len
    if n <= 1 or req.finished() or not ours():
        return update_finish_state(req, n)
    ids = req.output_ids
    step = ids[len(ids) - n:]
    del ids[len(ids) - n:]
    grammar = req.grammar
    added = 0
    try:
        for token in step:
            ids.append(token)
            added += 1
            # A grammar's state is the one after the step's last token (SGLang advanced it over
            # the whole step, cut where it terminated): it is read at that token only.
            req.grammar = grammar if added == n else None
            update_finish_state(req, 1)
            if req.finished():
                break
    finally:
        req.grammar = grammar
        ids.extend(step[added:])
