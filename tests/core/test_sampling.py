import math

import pytest
import torch

from sgl_longgen.config import SamplingConfig
from sgl_longgen.core.penalty import apply_penalty, window_mask, window_tokens
from sgl_longgen.core.sampling import LogitsProcessor, exponential_race

INF = float("-inf")


def proc(**kw) -> LogitsProcessor:
    return LogitsProcessor(SamplingConfig(**kw), vocab_size=6)


def test_penalty_divides_positive_and_multiplies_negative_logits_of_window_tokens():
    logits = torch.tensor([[2.0, -2.0, 1.0, 0.0, 3.0, -1.0]], dtype=torch.float64)
    out = proc(penalty=2.0, penalty_window=3).penalized(logits, [[0, 1, 3, 0]])
    assert out.tolist() == [[1.0, -4.0, 1.0, 0.0, 3.0, -1.0]]


def test_penalty_counts_each_distinct_token_once():
    logits = torch.tensor([[4.0, 1.0, 1.0, 1.0, 1.0, 1.0]], dtype=torch.float64)
    once = proc(penalty=2.0).penalized(logits, [[0]])
    many = proc(penalty=2.0).penalized(logits, [[0, 0, 0]])
    assert torch.equal(once, many)
    assert once[0, 0] == 2.0


def test_greedy_is_the_argmax_of_the_penalized_logits():
    logits = torch.tensor([[3.0, 2.0, 0.0, 0.0, 0.0, 0.0]], dtype=torch.float64)
    assert proc(temperature=0.0).sample(logits, [[0]]).item() == 0
    assert proc(temperature=0.0, penalty=2.0).sample(logits, [[0]]).item() == 1


def test_window_tokens_follow_the_node_path():
    history = [10, 11, 12, 13, 14]
    assert window_tokens(history, [], 3) == [12, 13, 14]
    assert window_tokens(history, [20], 3) == [13, 14, 20]
    assert window_tokens(history, [20, 21, 22, 23], 3) == [21, 22, 23]
    assert window_tokens(history, [20], 0) == []
    assert window_tokens([1], [2], 10) == [1, 2]


def test_node_window_equals_the_plain_decoding_window():
    history = list(range(50))
    path = [7, 8, 9]
    assert window_tokens(history, path, 16) == (history + path)[-16:]


def test_min_p_keeps_tokens_above_the_scaled_max_and_at_least_min_tokens_to_keep():
    probs = torch.tensor([[0.5, 0.3, 0.1, 0.06, 0.03, 0.01]], dtype=torch.float64)
    logits = probs.log()
    out = proc(temperature=1.0, min_p=0.25).process(logits)
    assert torch.isfinite(out).tolist() == [[True, True, False, False, False, False]]
    out = proc(temperature=1.0, min_p=0.25, min_tokens_to_keep=3).process(logits)
    assert torch.isfinite(out).sum().item() == 3


def test_top_p_keeps_the_token_that_crosses_the_threshold():
    probs = torch.tensor([[0.5, 0.3, 0.1, 0.06, 0.03, 0.01]], dtype=torch.float64)
    out = proc(temperature=1.0, top_p=0.7).process(probs.log())
    assert torch.isfinite(out).tolist() == [[True, True, False, False, False, False]]
    out = proc(temperature=1.0, top_p=0.81).process(probs.log())
    assert torch.isfinite(out).sum().item() == 3


def test_top_k_and_temperature():
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0, -1.0]], dtype=torch.float64)
    out = proc(temperature=2.0, top_k=2).process(logits)
    assert out[0, :2].tolist() == [2.0, 1.5]
    assert torch.isinf(out[0, 2:]).all()


def test_eta_drops_low_probability_tokens():
    probs = torch.tensor([[0.6, 0.3, 0.09, 0.009, 0.0009, 0.0001]], dtype=torch.float64)
    eps = 0.02
    out = proc(temperature=1.0, eta=eps).process(probs.log())
    h = -(probs * probs.log()).sum().item()
    eta = min(eps, math.sqrt(eps) * math.exp(-h))
    assert torch.isfinite(out)[0].tolist() == (probs[0] >= eta).tolist()


def test_sequential_filters_renormalise_between_steps_while_joint_filters_do_not():
    # After top-p keeps {0, 1}, min-p=0.5 relative to the renormalised max drops nothing more in
    # joint mode either, so use top-k then min-p where order matters: both judge p_max the same,
    # but top-p after min-p sees a renormalised distribution.
    probs = torch.tensor([[0.4, 0.3, 0.2, 0.1, 0.0, 0.0]], dtype=torch.float64) + 1e-12
    seq = proc(temperature=1.0, min_p=0.4, top_p=0.6).process(probs.log())
    joint = proc(temperature=1.0, min_p=0.4, top_p=0.6, filter_order="joint").process(probs.log())
    # min-p keeps {0,1,2}; renormalised (0.44, 0.33, 0.22): top-p 0.6 keeps {0,1}.
    assert torch.isfinite(seq).sum().item() == 2
    # joint: top-p on the original keeps {0,1}; min-p keeps {0,1,2}; intersection {0,1}.
    assert torch.isfinite(joint).sum().item() == 2
    seq = proc(temperature=1.0, min_p=0.4, top_p=0.75).process(probs.log())
    joint = proc(temperature=1.0, min_p=0.4, top_p=0.75, filter_order="joint").process(probs.log())
    assert torch.isfinite(seq).sum().item() == 2  # 0.44 + 0.33 = 0.78 > 0.75 after min-p
    assert torch.isfinite(joint).sum().item() == 3  # 0.4 + 0.3 = 0.7 < 0.75 on the original


def test_sampling_draws_follow_the_processed_distribution():
    logits = torch.tensor([[2.0, 1.0, 0.0, -5.0, -5.0, -5.0]], dtype=torch.float64)
    p = proc(temperature=1.0, top_k=3)
    gen = torch.Generator().manual_seed(0)
    draws = torch.stack([p.sample(logits, None, gen) for _ in range(6000)]).flatten()
    freq = torch.bincount(draws, minlength=6).double() / draws.numel()
    expected = torch.softmax(logits[0, :3], -1)
    assert torch.allclose(freq[:3], expected, atol=0.02)
    assert freq[3:].sum() == 0


def test_the_exponential_race_is_multinomials_draw_without_its_checks():
    """Same random numbers, same tokens: torch.multinomial's one-draw algorithm is the race (on the
    normalised probabilities), so the race on raw logits inherits its exactness; a race that read
    other numbers, dropped the log or compared p * E would differ."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(400, 50, dtype=torch.float32, generator=gen) * 3
    logits[:100, 10:] = float("-inf")  # rows with impossible tokens
    ours = exponential_race(logits, torch.Generator().manual_seed(7))
    probs = torch.softmax(logits.double(), -1)
    theirs = torch.multinomial(probs, 1, generator=torch.Generator().manual_seed(7)).squeeze(-1)
    assert torch.equal(ours, theirs)
    assert (ours[:100] < 10).all()
    # and the tokens follow the rows' law: one row drawn many times
    row = torch.tensor([0.5, 0.3, 0.2, 0.0], dtype=torch.float64)
    counts = torch.bincount(exponential_race(row.log().expand(20000, 4), gen), minlength=4).double() / 20000
    assert counts[3] == 0 and torch.allclose(counts[:3], row[:3], atol=0.015)


def test_joint_filters_left_unset_change_nothing():
    logits = torch.randn(3, 6, dtype=torch.float64)
    unset = LogitsProcessor(SamplingConfig(temperature=1.0, filter_order="joint"), 6)
    assert torch.equal(unset.process(logits), logits)
    top2 = LogitsProcessor(SamplingConfig(temperature=1.0, filter_order="joint", top_k=2), 6).process(logits)
    assert (top2.isfinite().sum(-1) == 2).all()


def test_banned_tokens_are_never_produced():
    p = LogitsProcessor(SamplingConfig(temperature=0.0), 6, banned=[0])
    logits = torch.tensor([[9.0, 1.0, 0.0, 0.0, 0.0, 0.0]])
    assert p.sample(logits).item() == 1


def test_window_mask_and_apply_penalty_shapes():
    m = window_mask([[1, 2], []], 4)
    assert m.tolist() == [[False, True, True, False], [False] * 4]
    out = apply_penalty(torch.tensor([[1.0, 1.0, -1.0, -1.0]] * 2), m, 2.0)
    assert out.tolist() == [[1.0, 0.5, -2.0, -1.0], [1.0, 1.0, -1.0, -1.0]]


@pytest.mark.parametrize("bad", [{"temperature": -1.0}, {"top_p": 0.0}, {"penalty": 0.5}, {"penalty_window": -1}])
def test_invalid_sampling_values_are_rejected(bad):
    import msgspec

    with pytest.raises(msgspec.ValidationError):
        msgspec.convert(bad, SamplingConfig)


def test_tree_window_mask_equals_per_node_windows():
    import random

    from sgl_longgen.core.penalty import tree_window_mask

    rng = random.Random(0)
    for _ in range(500):
        vocab = 12
        history = [rng.randrange(vocab) for _ in range(rng.randrange(1, 30))]
        window = rng.randrange(0, 12)
        paths = [[rng.randrange(vocab) for _ in range(rng.randrange(0, 9))] for _ in range(rng.randrange(1, 6))]
        want = window_mask([window_tokens(history, p, window) for p in paths], vocab)
        assert torch.equal(tree_window_mask(history, paths, window, vocab), want)


def test_a_precomputed_mask_and_windows_penalize_alike():
    logits = torch.tensor([[2.0, -2.0, 1.0, 0.5, 3.0, -1.0]], dtype=torch.float64)
    p = proc(penalty=1.5, penalty_window=4)
    assert torch.equal(p.penalized(logits, [[0, 1]]), p.penalized(logits, window_mask([[0, 1]], 6)))
