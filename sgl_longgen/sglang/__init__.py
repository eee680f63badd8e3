"""The SGLang adapter: the only package of sgl-longgen that imports SGLang.

SGLang calls :func:`register` (entry point group ``sglang.srt.plugins``) in every one of its
processes. It must stay cheap: the workers are imported only when a scheduler builds one.

====================  =======================================================================
``compat``         every SGLang symbol, hook target and private field we rely on; checked
``plugin``         what :func:`register` installs: algorithms, backends, hooks
``worker``         the step: draft -> verify -> draw -> commit (``SpecWorker``)
``verify``         the verify forward, the draws, the walk and the commit on the device
``grammar``        structured output along a draft tree: each node under its path's grammar mask
``request_settings``  a request's settings of ours, parsed once at admission
``validation``     what admission refuses (bad fields, ids outside the vocabulary)
``stops``          a step of several tokens ends its request where plain decoding would
``slot_rows``      slot-table rows wide enough for SGLang's per-step reserve at the context's end
``tokenswift``     TOKENSWIFT's drafter: the partial-KV draft forward and its CUDA graphs
``pipeline``       the draft forward queued ahead of the step that uses it
``owl``            OWL's and HOWL's drafters: hidden states in, [SPEC] embeddings out
``longspec``       LONGSPEC's drafter: a window ring per request, cross-attention into the KV pool
``suffix``         SUFFIX's drafter: trees from the requests' own text on the host, no draft model
``adaptive``       adaptive speculation: each step plain or speculative, runs of plain steps
``backends``       ``longgen`` (hybrid tree attention) and ``longgen_torch`` attention backends
``timing``         opt-in per-request step timing (``custom_params``)
``cpu``            SGLang's CPU engine without sgl_kernel's CPU build
====================  =======================================================================
"""

from __future__ import annotations


def register() -> None:
    from .plugin import install

    install()
