"""SGLang plugin: lossless long-generation speculative algorithms behind ``--speculative-algorithm``.

SGLang calls :func:`register` (entry point group ``sglang.srt.plugins``) in every one of its
processes. It must stay cheap and import nothing heavy: the workers are imported only when a
scheduler actually builds one.
"""

from __future__ import annotations


def register() -> None:
    from .registration import register_all

    register_all()
