"""What a method hands a runtime to verify."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..core.howl import Route
from ..core.tree import DraftTree


@dataclass
class Draft:
    """One request's trie for one step.

    ``leaves[node]`` is the [SPEC] leaf of each walkable node (OWL; empty without [SPEC]): rows
    the verify forward computes for their hidden state only, never drawn from. ``depth`` is the
    draft depth offered (the denominator of the acceptance rate). ``route`` says how HOWL drafted
    it (None for the other methods).
    """

    tree: DraftTree
    leaves: list[int] = field(default_factory=list)
    depth: int = 0
    route: Route | None = None

    @classmethod
    def root_only(cls, root: int) -> "Draft":
        """No draft: the verify forward draws one exact token at the root (a plain decode step)."""
        return cls(DraftTree(root))
