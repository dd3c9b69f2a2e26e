"""N-gram / prompt-lookup proposer on plain token ids."""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest

from llmc.runtime.speculative.ngram import NgramProposer


def reference_propose(ids: list[int], k: int, max_n: int, min_n: int) -> list[int]:
    """The definition, quadratic: for n = max_n..min_n, the most recent earlier occurrence."""
    for n in range(max_n, min_n - 1, -1):
        if len(ids) <= n:
            continue
        suffix = ids[-n:]
        for start in range(len(ids) - n - 1, -1, -1):
            if ids[start:start + n] == suffix:
                return ids[start + n:start + n + k]
    return []


def test_repetitive_text_proposes_its_continuation():
    ids = [1, 2, 3, 4, 5, 1, 2, 3]
    assert NgramProposer().propose(ids, 2) == [4, 5]
    assert NgramProposer().propose(ids, 5) == [4, 5, 1, 2, 3]


def test_no_earlier_occurrence_proposes_nothing():
    assert NgramProposer().propose(list(range(20)), 4) == []
    assert NgramProposer().propose([], 4) == []
    assert NgramProposer().propose([7], 4) == []
    assert NgramProposer().propose([7, 7], 0) == []


def test_never_proposes_beyond_the_tokens_that_exist():
    ids = [9, 9, 9]
    assert NgramProposer().propose(ids, 10) == [9]         # "9 9" ends at 1; only ids[2] follows
    ids = [1, 2, 3, 1, 2, 3, 1, 2]
    assert NgramProposer().propose(ids, 100) == [3, 1, 2]


def test_the_most_recent_occurrence_wins_among_equally_long_matches():
    assert NgramProposer().propose([1, 2, 9, 1, 2, 8, 1, 2], 1) == [8]


def test_a_longer_match_wins_over_a_more_recent_shorter_one():
    ids = [5, 1, 2, 7, 6, 1, 2, 8, 5, 1, 2]
    assert NgramProposer().propose(ids, 1) == [7]
    assert NgramProposer(max_n=2).propose(ids, 1) == [8]


def test_min_n_refuses_shorter_matches():
    ids = [4, 1, 2, 3, 5, 1]                                # only a one-token match
    assert NgramProposer(min_n=1).propose(ids, 2) == [2, 3]
    assert NgramProposer(min_n=2).propose(ids, 2) == []


def test_matches_outside_the_window_are_not_seen():
    ids = [1, 2, 3, 4] + list(range(100, 120)) + [1, 2, 3]
    assert NgramProposer(window=30).propose(ids, 1) == [4]
    assert NgramProposer(window=10).propose(ids, 1) == []


class ReadLog(Sequence):
    """A token list that records the lowest index any read touched."""

    def __init__(self, ids: list[int]):
        self.ids, self.lowest = ids, len(ids)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index):
        start = index.indices(len(self.ids))[0] if isinstance(index, slice) else index % len(self.ids)
        self.lowest = min(self.lowest, start)
        return self.ids[index]


def test_a_call_reads_only_the_window_not_the_whole_context():
    ids = ReadLog(list(range(100_000)) + [5, 6, 7, 5, 6])
    assert NgramProposer(window=64).propose(ids, 3) == [7, 5, 6]
    assert ids.lowest >= len(ids) - 65


@pytest.mark.parametrize("seed", range(20))
def test_agrees_with_the_quadratic_definition(seed):
    rng = random.Random(seed)
    vocab = rng.choice([2, 3, 5, 8])
    ids = [rng.randrange(vocab) for _ in range(rng.randrange(1, 60))]
    max_n, k = rng.randrange(1, 5), rng.randrange(0, 6)
    min_n = rng.randrange(1, max_n + 1)
    got = NgramProposer(max_n=max_n, min_n=min_n, window=1000).propose(ids, k)
    assert got == reference_propose(ids, k, max_n, min_n)


def test_bad_sizes_are_one_sentence():
    with pytest.raises(ValueError, match="1 <= min_n <= max_n"):
        NgramProposer(max_n=2, min_n=3)
    with pytest.raises(ValueError, match="window=0"):
        NgramProposer(window=0)
