"""Progress bars for long generations: tokens done, tokens/s and tau."""

from __future__ import annotations

import sys

from tqdm import tqdm


class TokenProgress:
    """A tqdm bar fed by a decoder's progress callback ``(tokens, stats)``."""

    def __init__(self, total: int, desc: str = "", disable: bool | None = None):
        self._bar = tqdm(total=total, desc=desc, unit="tok", file=sys.stderr, disable=disable,
                         dynamic_ncols=True, leave=False)
        self._done = 0

    def update(self, tokens, stats) -> None:
        done = len(tokens)
        self._bar.update(done - self._done)
        self._done = done
        if stats.steps:
            tau = done / stats.steps
            self._bar.set_postfix(tau=f"{tau:.2f}", refresh=False)

    def __enter__(self) -> "TokenProgress":
        return self

    def __exit__(self, *exc) -> None:
        self._bar.close()
