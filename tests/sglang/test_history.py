import random

import pytest

from sgl_longgen.sglang.requests import TokenHistory


def test_token_history_reads_like_the_concatenated_list():
    rng = random.Random(0)
    prompt, output, extra = [rng.randrange(100) for _ in range(7)], [rng.randrange(100) for _ in range(5)], [3, 4]
    hist = TokenHistory(prompt, output).extended(extra)
    flat = prompt + output + extra
    assert len(hist) == len(flat) and list(hist) == flat
    for i in range(-len(flat), len(flat)):
        assert hist[i] == flat[i]
    for a in range(-15, 16):
        for b in (None, -3, 0, 4, 9, 14, 20):
            assert hist[a:b] == flat[a:b]
    assert hist[::2] == flat[::2]
    with pytest.raises(IndexError):
        hist[len(flat)]
    assert len(TokenHistory()) == 0 and TokenHistory([], [1])[-1] == 1
