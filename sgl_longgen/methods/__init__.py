"""The speculative methods, written once for every runtime.

Each method keeps its per-request state and decides what to draft and what a commit changes
(``start`` / ``propose`` / ``observe``). The forwards belong to a runtime: the reference runtime
(:mod:`sgl_longgen.runtime`) and the SGLang workers (:mod:`sgl_longgen.sglang`) run them their
own way and hand the method what they produced (head candidates, hidden states). Verification is
the same for all: :func:`sgl_longgen.core.verify.draw_tree` and the per-node walk.
"""

from .base import Draft
from .longspec import LongSpec, LongSpecState
from .owl import Howl, Owl, OwlState
from .suffix import Suffix, SuffixState
from .tokenswift import DraftView, TokenSwift, TokenSwiftState

__all__ = ["Draft", "DraftView", "Howl", "LongSpec", "LongSpecState", "Owl", "OwlState", "Suffix", "SuffixState",
           "TokenSwift", "TokenSwiftState"]
