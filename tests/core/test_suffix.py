"""SuffixDecoding's index: the drafts equal a brute-force reading of the suffix-tree semantics, the
index grows incrementally, separate sequences never bleed into each other, the global index keeps
finished outputs (FIFO), and a 100K-token history stays fast."""

from __future__ import annotations

import random
import time

import numpy as np
import pytest
from helpers import loop_sequence

from sgl_longgen.config import SuffixConfig
from sgl_longgen.core.suffix import (
    _BULK,
    _BULK_SHARE,
    SENTINEL,
    SuffixCache,
    SuffixIndex,
)


def brute_force(arr: list[int], context: list[int], max_depth: int, max_tokens: int, factor: float,
                offset: float, min_prob: float, own: bool = False, loop_min: int = 0) -> tuple[list[int], float, int]:
    """The suffix tree's path draft, computed by scanning the whole array each time.

    count(g) = occurrences of g; a step goes to the most frequent continuation (ties: the one
    seen last), prob *= count(g + t) / count(g); matches up to max_depth - 1 tokens; budget
    min(max_tokens, factor * p + offset); the best score wins, ties to the longer match.
    ``own`` (the context is arr's own tail): the walk reads arr followed by the tokens drafted so
    far, and a pattern whose latest earlier copy is at most p back, spanning p + back >=
    ``loop_min`` tokens (``loop_min`` > 0), gets the budget max_tokens.
    """
    n = len(arr)
    ctx = context[-(max_depth - 1):]
    best = ([], 0.0, 0)
    for p in range(1, len(ctx) + 1):
        g = ctx[-p:]
        ends = [e for e in range(p, n + 1) if arr[e - p : e] == g]
        if not ends:
            break
        budget = min(max_tokens, int(p * factor + offset + 1e-6))
        mine = own and ends[-1] == n
        if mine and loop_min and len(ends) > 1 and n - ends[-2] <= p and p + n - ends[-2] >= loop_min:
            budget = max_tokens
        tokens, score, prob, count = [], 0.0, 1.0, len(ends)
        while len(tokens) < budget:
            seq = arr + tokens if mine else arr
            stats: dict[int, list[int]] = {}
            for e in ends:
                if e < len(seq) and seq[e] != SENTINEL:
                    entry = stats.setdefault(seq[e], [0, -1])
                    entry[0] += 1
                    entry[1] = max(entry[1], e)
            if not stats:
                break
            tok = max(stats, key=lambda t: (stats[t][0], stats[t][1]))
            c = stats[tok][0]
            if prob * c / count < min_prob:
                break
            prob = prob * c / count
            tokens.append(tok)
            score += prob
            ends = [e + 1 for e in ends if e < len(seq) and seq[e] == tok]
            count = c
        if tokens and (score > best[1] or (score == best[1] and p > best[2])):
            best = (tokens, score, p)
    return best


def random_sequence(rng: random.Random, length: int, vocab: int) -> list[int]:
    """Random text with repeats: pieces copied from earlier parts."""
    out: list[int] = []
    while len(out) < length:
        if out and rng.random() < 0.5:
            start = rng.randrange(len(out))
            out.extend(out[start : start + rng.randint(2, 12)])
        else:
            out.extend(rng.randrange(vocab) for _ in range(rng.randint(1, 5)))
    return out[:length]


@pytest.mark.parametrize("seed", range(6))
def test_drafts_match_the_brute_force_semantics(seed):
    rng = random.Random(seed)
    for _ in range(40):
        vocab = rng.randint(2, 6)
        D = rng.choice([3, 5, 8, 64])
        params = {"max_spec_tokens": rng.choice([4, 16, 64]), "max_spec_factor": rng.choice([0.5, 1.0, 2.0, 4.0]),
                  "max_spec_offset": rng.choice([0.0, 1.0]), "min_token_prob": rng.choice([0.0, 0.1, 0.4])}
        index = SuffixIndex(D)
        arr: list[int] = []
        for part in range(rng.randint(1, 3)):  # several sequences: the global index's layout
            if part:
                index.end_sequence()
                arr.append(SENTINEL)
            seq = random_sequence(rng, rng.randint(5, 150), vocab)
            index.extend(seq)
            arr.extend(seq)
        own_tail = [t for t in arr[-20:] if t != SENTINEL]  # a local query: the context is indexed
        foreign = random_sequence(rng, 12, vocab)  # a global query: it is not
        loop_min = rng.choice([0, 2, 8])
        queries = [(own_tail, False), (foreign, False), (foreign, True)]
        if SENTINEL not in arr[-20:]:  # the request's own index: the context is its tail
            queries.append((own_tail, True))
        for context, own in queries:
            draft = index.speculate(context, **params, own=own, loop_min_tokens=loop_min)
            tokens, score, p = brute_force(arr, context, D, params["max_spec_tokens"], params["max_spec_factor"],
                                           params["max_spec_offset"], params["min_token_prob"], own, loop_min)
            assert draft.tokens == tokens
            assert draft.score == pytest.approx(score)
            if tokens:
                assert draft.match_len == p
                assert len(draft.probs) == len(tokens) and all(params["min_token_prob"] <= q <= 1 for q in draft.probs)


def test_incremental_extension_equals_bulk_indexing():
    rng = random.Random(3)
    seq = random_sequence(rng, 3000, 7)
    bulk, step = SuffixIndex(32), SuffixIndex(32)
    bulk.extend(seq)
    i = 0
    while i < len(seq):
        n = rng.choice([1, 2, 5, 100])  # both the per-token and the grouped append path
        step.extend(seq[i : i + n])
        i += n
    assert len(bulk) == len(step) == len(seq)
    for cut in (10, 500, 2999, 3000):
        ctx = seq[:cut]
        a, b = bulk.speculate(ctx, 32, 2.0), step.speculate(ctx, 32, 2.0)
        assert (a.tokens, a.score) == (b.tokens, b.score)


def token_by_token(pieces: list[list[int] | None], max_occurrences: int = 0) -> SuffixIndex:
    """The index the per-token path builds: one extend per token (None: end the sequence)."""
    index = SuffixIndex(64, max_occurrences)
    for piece in pieces:
        if piece is None:
            index.end_sequence()
        for t in piece or ():
            index.extend([t])
    return index


def assert_same_index(got: SuffixIndex, want: SuffixIndex, seq: list[int]) -> None:
    """Same sequence, the brute-force occurrences of every token (and of one never seen), and the
    same matches and drafts (foreign and own, with and without the loop budget) at several ends."""
    assert len(got) == len(want) == len(seq)
    assert np.array_equal(got._seq.view(), np.asarray(seq, dtype=np.int64))
    where: dict[int, list[int]] = {}
    for e, t in enumerate(seq, 1):
        if t != SENTINEL:
            where.setdefault(t, []).append(e)
    for t in [*where, max(where) + 1]:
        occ = got._occurrences(t)
        assert (occ is None and t not in where) or occ.tolist() == where[t], t
    config = SuffixConfig(max_occurrences=got.max_occurrences)
    real = [i for i, t in enumerate(seq) if t != SENTINEL]
    for cut in {real[0] + 1, real[len(real) // 2] + 1, real[-1], real[-1] + 1}:
        ctx = [t for t in seq[max(0, cut - 80) : cut] if t != SENTINEL]
        assert [m.tolist() for m in got.matches(ctx)] == [m.tolist() for m in want.matches(ctx)]
        for own in (False, True):
            for cfg in (config, SuffixConfig(max_occurrences=got.max_occurrences, loop_min_tokens=0)):
                a, b = got.draft(ctx, cfg, own=own), want.draft(ctx, cfg, own=own)
                assert (a.tokens, a.probs, a.score, a.match_len) == (b.tokens, b.probs, b.score, b.match_len)


@pytest.mark.parametrize("kind", ["random", "loop"])
@pytest.mark.parametrize("size", [_BULK - 1, _BULK, _BULK + 1, 3 * _BULK + 17])
def test_a_long_extend_packs_exactly_what_the_per_token_path_indexes(kind, size):
    """One extend of a prompt-sized piece (packed at and above ``_BULK`` tokens) holds the same
    occurrences, matches and drafts as indexing the tokens one by one."""
    rng = random.Random(size)
    seq = random_sequence(rng, size, 5000) if kind == "random" else loop_sequence(rng, size, 50)
    index = SuffixIndex(64)
    index.extend(seq)
    assert index._packed_until == (size if size >= _BULK else 0)  # the bulk path was taken, or not
    assert_same_index(index, token_by_token([seq]), seq)


@pytest.mark.parametrize("cap", [0, 16])
def test_packed_then_incremental_then_packed_again_equals_the_per_token_path(cap):
    """A packed prompt, short extends touching its tokens (each copies its packed positions),
    another long extend merged into the packed layer, a long one too small beside it to merge,
    and a second sequence: every stage equals the per-token index (``max_occurrences`` included)."""
    rng = random.Random(cap)
    prompt = loop_sequence(rng, _BULK_SHARE * _BULK + 5, 40)
    pieces: list[list[int] | None] = [prompt]
    index = SuffixIndex(64, cap)
    index.extend(prompt)
    assert index._packed_until == len(prompt)
    seq = list(prompt)
    for _ in range(60):  # the steps of a generation: one to a few tokens, mostly seen before
        piece = [rng.choice(prompt) for _ in range(rng.randint(1, 4))]
        pieces.append(piece)
        index.extend(piece)
        seq += piece
    assert index._ends and index._packed_until == len(prompt)
    assert_same_index(index, token_by_token(pieces, cap), seq)
    for piece, merged in ((random_sequence(rng, 2 * _BULK + 300, 60), True),  # the packed and the loose merge
                          (None, False),
                          (loop_sequence(rng, 70, 40), False),
                          (random_sequence(rng, _BULK, 60), False)):  # below 1/_BULK_SHARE of the packed
        if piece is None:
            index.end_sequence()
            seq.append(SENTINEL)
        else:
            assert merged == (len(piece) >= _BULK and len(piece) * _BULK_SHARE >= len(seq))
            index.extend(piece)
            seq += piece
            assert (index._packed_until == len(seq)) == merged
        pieces.append(piece)
        assert_same_index(index, token_by_token(pieces, cap), seq)
    index.end_sequence()
    big = random_sequence(rng, len(seq) // _BULK_SHARE + _BULK, 70)  # a global index's next output
    index.extend(big)
    assert index._packed_until == len(seq) + 1 + len(big) and not index._ends
    assert_same_index(index, token_by_token([*pieces, None, big], cap), seq + [SENTINEL] + big)


def test_a_long_extend_with_a_bad_token_is_refused_and_changes_nothing():
    index = SuffixIndex(64)
    prompt = list(range(2 * _BULK))
    index.extend(prompt)
    with pytest.raises(ValueError, match="non-negative"):
        index.extend(prompt[:-1] + [-3])
    assert len(index) == len(prompt) and index._occurrences(5).tolist() == [6]


def test_a_repeated_block_is_drafted_in_full_within_the_budget():
    rng = random.Random(5)
    block = [rng.randrange(1000) for _ in range(30)]
    seq = [rng.randrange(1000) for _ in range(50)] + block * 5 + block[:7]
    index = SuffixIndex(64)
    index.extend(seq)
    draft = index.speculate(seq, max_spec_tokens=64, max_spec_factor=2.0)
    expected = (block * 3)[7:]
    assert draft.tokens == expected[: len(draft.tokens)]
    # The whole budget: the continuation is not cut where match + draft would reach max_depth.
    assert len(draft.tokens) == 64 and 2 * draft.match_len >= 64
    assert draft.score > 40  # four earlier copies: every token is predicted with probability >= 4/5
    assert index.speculate(seq, max_spec_tokens=5, max_spec_factor=2.0).tokens == expected[:5]
    short = index.speculate(seq, max_spec_factor=0.1)  # budget floor(0.1 p): at most 6
    assert 1 <= len(short.tokens) <= 6 and short.tokens == expected[: len(short.tokens)]


def test_sequences_do_not_bleed_into_each_other():
    index = SuffixIndex(16)
    index.extend([1, 2, 3])
    index.end_sequence()
    index.extend([4, 5, 6])
    assert index.speculate([9, 3], max_spec_factor=8.0).tokens == []  # 3 ends a sequence
    assert index.speculate([9, 2], max_spec_factor=8.0).tokens == [3]
    assert index.speculate([9, 4], max_spec_factor=8.0).tokens == [5, 6]
    with pytest.raises(ValueError):
        index.extend([-1])


def test_cache_local_and_global_indexes():
    cfg = SuffixConfig(max_spec_factor=4.0, global_requests=1, min_token_prob=0.0)
    cache = SuffixCache(cfg)
    story = [7, 8, 9, 10, 11, 12]
    cache.start_request("a", [1, 2, 3])
    cache.extend("a", story)
    assert cache.speculate("a", [1, 2, 3, *story]).tokens == []  # nothing followed 12 yet
    cache.extend("a", [1, 2])
    assert cache.speculate("a", [1, 2, 3, 7, 8, 9, 10, 11, 12, 1, 2]).tokens[:6] == [3, 7, 8, 9, 10, 11]
    cache.stop_request("a")
    with pytest.raises(KeyError):
        cache.extend("a", [1])
    cache.start_request("b", [50, 51])
    assert cache.speculate("b", [50, 51, 7, 8]).tokens[:4] == [9, 10, 11, 12]  # from a's output
    cache.extend("b", [60, 61, 62])
    cache.stop_request("b")  # global_requests = 1; eviction is lazy: up to 2 outputs stay
    cache.start_request("c", [0])
    assert cache.speculate("c", [0, 7, 8]).tokens[:2] == [9, 10]
    cache.extend("c", [70, 71])
    cache.stop_request("c")  # a third output: rebuilt with the last one only
    cache.start_request("d", [0])
    assert cache.speculate("d", [0, 7, 8]).tokens == [] and cache.speculate("d", [0, 60]).tokens == []
    assert cache.speculate("d", [0, 70]).tokens == [71]
    off = SuffixCache(SuffixConfig(max_spec_factor=4.0))
    off.start_request("a", [])
    off.extend("a", story)
    off.stop_request("a")
    off.start_request("b", [0])
    assert off.speculate("b", [0, 7, 8]).tokens == []  # no global index by default


def test_long_history_stays_fast():
    rng = np.random.default_rng(0)
    text = (rng.zipf(1.3, 100_000) % 5000).tolist()
    block = rng.integers(0, 5000, 40).tolist()
    history = text + block * 200
    index = SuffixIndex(64)
    t = time.perf_counter()
    for lo in range(0, len(history), 4096):
        index.extend(history[lo : lo + 4096])
    t_index = time.perf_counter() - t
    t = time.perf_counter()
    drafts = [index.speculate(history[: len(history) - k], 64, 2.0) for k in range(20)]
    drafts += [index.speculate(text[: len(text) - k], 64, 2.0) for k in range(20)]
    t_query = (time.perf_counter() - t) / 40
    assert all(len(d.tokens) >= 30 for d in drafts[:20])  # the repeated block is found
    # Generous bounds for a loaded machine (typically ~0.05 s and ~3 ms).
    assert t_index < 5.0 and t_query < 0.25, (t_index, t_query)


class CountingIndex(SuffixIndex):
    """A suffix index that counts its walks."""

    walks = 0

    def walk(self, ends, budget, min_token_prob, own=False):
        self.walks += 1
        return super().walk(ends, budget, min_token_prob, own)


def test_a_repeating_stretch_takes_one_walk_per_occurrence_set():
    """Every match length from the loop's length up has the same occurrences: one walk serves
    them all (the draft is the one a walk per match length would pick; the brute-force test
    above checks the choice)."""
    rng = random.Random(0)
    loop = [rng.randrange(1000) for _ in range(37)]
    history = [rng.randrange(1000, 100_000) for _ in range(2000)] + loop * 20
    index = CountingIndex(64)
    index.extend(history)
    draft = index.speculate(history, 64, 2.0, 0.0, 0.1)
    assert len(draft.tokens) == 64 and draft.tokens[:37] == loop
    assert index.walks <= 3  # a walk per match length would be 32 here (every p >= 32 has budget 64)


def test_the_index_holds_no_object_the_collector_tracks_per_token():
    """Indexing 20K tokens of a large vocabulary (thousands of distinct tokens, each with its own
    occurrence array, or a slice of the packed layer after one long extend) leaves a handful of
    objects for the garbage collector, not one per token."""
    from helpers import gc_tracked_reachable

    rng = random.Random(4)
    seq = random_sequence(rng, 20_000, 50_000)
    bulk, step = SuffixIndex(32), SuffixIndex(32)
    bulk.extend(seq)
    for i in range(0, len(seq), 3):
        step.extend(seq[i : i + 3])
    assert len(step._ends) > 5_000 and bulk._packed_tokens.size > 5_000
    assert gc_tracked_reachable(bulk) <= 8 and gc_tracked_reachable(step) <= 8
    for cut in (1000, 19_999, 20_000):
        a, b = bulk.speculate(seq[:cut], 32, 2.0), step.speculate(seq[:cut], 32, 2.0)
        assert (a.tokens, a.score) == (b.tokens, b.score)


@pytest.mark.parametrize("period", [1, 2, 7, 19, 40])
def test_a_loop_seen_twice_fills_the_budget(period):
    """Two back-to-back copies of a period at the end of a request's history: the chain is the
    loop, as long as ``max_spec_tokens``, with a score above HOWL's threshold. Read from the
    history alone it would stop where the history does (``period`` tokens at most) or at the
    match's factor budget (``2 * period``)."""
    rng = random.Random(period)
    loop = [rng.randrange(1000) for _ in range(period)]
    copies = 2 if 2 * period >= 8 else -(-8 // period)  # at least loop_min_tokens (8) tokens
    history = [rng.randrange(1000, 100_000) for _ in range(3000)] + loop * copies
    cache = SuffixCache(SuffixConfig())
    cache.start_request("r", history)
    draft = cache.speculate("r", history)
    assert draft.tokens == (loop * 64)[:64]
    assert draft.score > 9.0  # HowlConfig's default threshold: a linear round
    # Without the loop budget the factor still caps it (2 * match length), the draft past the
    # history's end still reads the loop.
    plain = SuffixCache(SuffixConfig(loop_min_tokens=0))
    plain.start_request("r", history)
    capped = plain.speculate("r", history)
    assert capped.tokens == (loop * 64)[: len(capped.tokens)] and len(capped.tokens) == min(64, 2 * capped.match_len)


def test_a_long_loop_is_drafted_in_one_walk_and_fast():
    """A loop of 20K tokens after a 98K-token history: every match length shares the loop's
    continuation, and the pattern with the most copies reaches the most any walk could score."""
    rng = np.random.default_rng(1)
    loop = rng.integers(0, 128_000, 3).tolist()
    history = rng.integers(0, 128_000, 98_304).tolist() + loop * 7000
    index = CountingIndex(64)
    index.extend(history)
    draft = index.speculate(history, 64, 2.0, 0.0, 0.1, own=True, loop_min_tokens=8)
    assert draft.tokens == (loop * 30)[len(history) % 3 : len(history) % 3 + 64]
    assert index.walks == 1


class WidestWalk(SuffixIndex):
    """A suffix index that records the most occurrences one walk started from."""

    widest = 0

    def walk(self, ends, budget, min_token_prob, own=False):
        self.widest = max(self.widest, int(ends.size))
        return super().walk(ends, budget, min_token_prob, own)


@pytest.mark.parametrize("own", [False, True])
def test_a_query_reads_at_most_max_occurrences_copies_of_a_loop(own):
    """90K tokens of a period-2 loop (a greedy model that loops): 45K copies of every pattern. With
    ``max_occurrences`` a query's walks start from at most that many, and the draft is still the
    loop; without it they read every copy (what made a query's cost grow with the loop)."""
    rng = random.Random(5)
    history = [rng.randrange(1000, 100_000) for _ in range(512)] + [7, 9] * 45_000
    drafts = {}
    for cap in (0, 1024):
        index = WidestWalk(64, cap)
        index.extend(history)
        drafts[cap] = index.speculate(history, 64, 2.0, 0.0, 0.1, own=own, loop_min_tokens=8)
        assert drafts[cap].tokens == [7, 9] * 32
        assert index.widest <= 1024 if cap else index.widest > 40_000
    with pytest.raises(ValueError, match="max_occurrences"):
        SuffixIndex(64, -1)


def test_a_prompt_prepared_in_chunks_is_the_prompt_indexed_at_start():
    """A runtime indexes a prompt chunk by chunk during its prefill (SuffixCache.prepare); the
    request's start then indexes only the rest, and the request drafts what it drafts when its
    start indexes the whole prompt."""
    cfg = SuffixConfig(min_token_prob=0.0)
    rng = random.Random(3)
    prompt = [rng.randrange(50) for _ in range(3000)] + loop_sequence(rng, 400, 50)
    history = [*prompt, 5]
    whole, chunked = SuffixCache(cfg), SuffixCache(cfg)
    whole.start_request("r", history)
    for end in (1024, 2048, 2100, len(prompt)):
        chunked.prepare("r", prompt[:end])
    chunked.start_request("r", history)
    for context in (history, history[:1500], [*history, 9, 9]):
        assert chunked.speculate("r", context) == whole.speculate("r", context)
    assert chunked.speculate("r", history).tokens  # the loop is drafted at all
    # What was prepared for another history (a longer one) is not taken: that start indexes afresh.
    other = SuffixCache(cfg)
    other.prepare("r", [*history, 1, 2, 3])
    other.start_request("r", history)
    assert other.speculate("r", history) == whole.speculate("r", history)
    other.stop_request("r")
    other.prepare("s", prompt)
    other.stop_request("s")  # a request aborted in its prefill leaves nothing behind
    assert len(other._prepared) == 0
