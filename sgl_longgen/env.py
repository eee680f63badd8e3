"""sgl-longgen's environment variables: one prefix, ``SGLANG_LONGGEN_``.

SGLang copies every ``SGL_*`` variable to ``SGLANG_*`` and calls the old name deprecated, so
our variables carry the prefix SGLang itself keeps. A variable still set under the old
``SGL_LONGGEN_`` prefix is honoured, with a warning naming the new one.

======================  ================================================================
``HOME``                where embedded models are built (default ``~/.cache/sgl-longgen``)
``PREFIX_BACKEND``      hybrid verify's prefix path: ``auto``, ``fa3``, ``triton``, ``flashinfer_fold``
``FOLD_MAX_TREE``       trees up to this size fold into FlashInfer's decode (default 32)
``FOLD_WORKSPACE_MB``   scratch space the folded path may take (default 1024)
``CASCADE_MIN_SHARED``  shared prefix (tokens) from which a verify of several requests reads it once (default 0: never)
``PREFILL_BACKEND``     ``auto`` (FA3 for plain prefills where it serves the model) or ``flashinfer``
``ADAPTIVE``            ``1`` / ``0``: adaptive speculation on / off by default (overrides ``[adaptive] enabled``)
``PLAIN_RUN_AHEAD``     ``1`` / ``0``: a run of plain steps queues the next call's first forward (default: on GPUs)
``SPEC_RUN_AHEAD``      ``1`` / ``0``: a speculative step queues the next one's draft and verify (default: off)
``VERIFY_CHECK``        ``1``: compare every hybrid verify layer with FlashInfer's (eager)
``HOST_PROFILE``        a file: cProfile the decode steps of requests that ask for it
``INJECT_DRAFT_FAULT``  ``N``: drafting raises on the N-th decode step (fault-isolation tests)
``ALLOW_UNTESTED_SGLANG``  ``1``: try an SGLang release this version was not built for
======================  ================================================================
"""

from __future__ import annotations

import os
import warnings

PREFIX = "SGLANG_LONGGEN_"
OLD_PREFIX = "SGL_LONGGEN_"


def name(key: str) -> str:
    return PREFIX + key


def get(key: str, default: str | None = None) -> str | None:
    value = os.environ.get(PREFIX + key)
    if value is None and OLD_PREFIX + key in os.environ:
        warnings.warn(f"{OLD_PREFIX}{key} is read as {PREFIX}{key}; please rename it", stacklevel=2)
        value = os.environ[OLD_PREFIX + key]
    return default if value is None else value
