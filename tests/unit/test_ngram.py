"""The n-gram proposer against a brute-force oracle: the tokens after the latest earlier occurrence
of the longest suffix (max_n down to min_n) of the tokens so far; and its draft-length policy."""

import random

import pytest

from lmserve.server.engine.ngram import NgramProposer, Speculation


def brute_force(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    end = len(tokens)
    for n in range(min(max_n, end), min_n - 1, -1):
        suffix = tokens[end - n:]
        for start in range(end - n - 1, -1, -1):  # latest occurrence ending before the last token
            if tokens[start: start + n] == suffix:
                return tokens[start + n: start + n + k]
    return []


@pytest.mark.parametrize("seed", range(20))
def test_drafts_equal_the_brute_force_lookup_as_tokens_arrive(seed):
    rng = random.Random(seed)
    alphabet = rng.randint(2, 6)  # small alphabets: many repeats, many candidate matches
    tokens = [rng.randrange(alphabet) for _ in range(rng.randint(1, 10))]
    p = NgramProposer(tokens, max_draft=5, min_n=rng.randint(1, 2), max_n=rng.randint(2, 5))
    for _ in range(60):
        k = rng.randint(1, 5)
        p.length = 5
        assert p.propose(k) == brute_force(p.tokens, k, p.min_n, p.max_n)
        new = [rng.randrange(alphabet) for _ in range(rng.randint(1, 3))]
        p.extend(new)
        tokens += new
        assert p.tokens == tokens


def test_a_quoted_passage_is_drafted_from_the_prompt():
    passage = list(range(100, 140))
    p = NgramProposer([1, 2, *passage, 3, 4], max_draft=8, first=8)
    p.extend(passage[:3])  # the output starts quoting
    assert p.propose(8) == passage[3:11]
    assert p.propose(2) == passage[3:5]  # never more than asked


def test_no_match_no_draft():
    p = NgramProposer([1, 2, 3, 4, 5])
    assert p.propose(4) == []


def test_length_starts_short_doubles_on_full_acceptance_shrinks_on_partial_and_rests_after_misses():
    p = NgramProposer([1, 2, 1, 2, 1, 2], max_draft=4, patience=2, cooldown=3, first=2)
    assert p.length == 2  # the first draft's length
    p.accepted(2, 2)
    assert p.length == 4
    p.accepted(4, 1)
    assert p.length == 2
    p.accepted(2, 2)
    assert p.length == 4  # doubled, at most max_draft
    p.accepted(4, 0)
    p.accepted(1, 0)  # second miss in a row: rest
    assert p.propose(4) == []
    p.extend([1, 2])
    assert p.propose(4) == []  # still resting (one token to go)
    p.extend([1])
    assert p.propose(4) == [2]  # one token, then it may grow again
    assert (p.drafted_total, p.accepted_total) == (13, 5)


def test_the_settings_first_draft_length_bounded_by_max_draft():
    assert Speculation().proposer([1, 2, 1]).length == 4
    assert Speculation(max_draft=3).proposer([1, 2, 1]).length == 3
    assert Speculation(first=2).proposer([1, 2, 1, 2, 1]).propose(8) == [2, 1]
    with pytest.raises(ValueError):
        Speculation(first=0)
