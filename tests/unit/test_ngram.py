"""The n-gram proposer: its index against a brute-force oracle (the tokens after the latest earlier
occurrence of the longest suffix, max_n down to min_n), the copy it follows and realigns where the
output leaves it, and its draft-length policy."""

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
def test_the_index_match_equals_the_brute_force_lookup_as_tokens_arrive(seed):
    rng = random.Random(seed)
    alphabet = rng.randint(2, 6)  # small alphabets: many repeats, many candidate matches
    tokens = [rng.randrange(alphabet) for _ in range(rng.randint(1, 10))]
    p = NgramProposer(tokens, max_draft=5, min_n=rng.randint(1, 2), max_n=rng.randint(2, 5))
    for _ in range(60):
        k = rng.randint(1, 5)
        after = p.match()
        assert (p.tokens[after: after + k] if after is not None else []) == brute_force(p.tokens, k, p.min_n, p.max_n)
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


def _following(passage, prompt_tail=(3, 4), **kw):
    """A proposer whose output has quoted passage[:5] (drafts verified whole)."""
    p = NgramProposer([1, 2, *passage, *prompt_tail], max_draft=8, first=8, **kw)
    p.extend(passage[:2])
    assert p.propose(3) == passage[2:5]
    p.accepted(3, 3)
    p.extend(passage[2:5])
    return p


def test_the_copy_is_followed_where_a_later_occurrence_of_the_suffix_goes_elsewhere():
    passage = list(range(100, 120))
    # the prompt ends with passage[3:5] followed by 7: a suffix lookup of 2 tokens would draft 7
    p = _following(passage, prompt_tail=(passage[3], passage[4], 7), max_n=2)
    after = p.match()
    assert p.tokens[after] == 7
    assert p.propose(4) == passage[5:9]


def test_an_inserted_token_resumes_the_copy_where_it_stood():
    passage = list(range(100, 120))
    p = _following(passage)
    p.extend([55])  # a comma the passage does not have
    assert p.propose(4) == passage[5:9]
    p.accepted(4, 4)
    p.extend(passage[5:10])
    assert p.propose(4) == passage[10:14]  # following again


def test_the_inserted_guess_is_tried_once_where_the_output_leaves_the_copy():
    passage = list(range(100, 120))
    p = _following(passage)
    p.extend([55])
    assert p.propose(2) == passage[5:7]
    p.accepted(2, 0)
    p.extend([66])  # the output wanders off: nothing to realign to, no n-gram, the guess spent
    assert p.propose(2) == []


def test_a_replaced_token_and_a_dropped_token_realign_the_copy_past_them():
    passage = list(range(100, 120))
    p = _following(passage)
    p.extend([55])  # passage[5] renamed
    assert p.propose(2) == passage[5:7]  # first guess: 55 was inserted
    p.accepted(2, 0)
    p.extend([passage[6]])  # the model goes on with passage[6]: 55 replaced passage[5]
    assert p.propose(3) == passage[7:8]  # one token after a miss
    q = _following(passage)
    q.extend([passage[6]])  # passage[5] dropped
    assert q.propose(3) == passage[7:10]


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


def test_a_reference_is_drafted_from_its_start_and_drafts_stop_at_its_end():
    reference = list(range(200, 212))
    p = NgramProposer([1, 2, 3], max_draft=8, first=8, reference=reference)
    assert p.propose(8) == reference[:8]  # before any output: the output is expected to start like it
    p.accepted(8, 8)
    p.extend(reference[:9])
    assert p.propose(8) == reference[9:]  # never the separator or the prompt behind it
    p.accepted(3, 3)
    p.extend(reference[9:] + [7])
    assert p.propose(8) == []  # the reference is used up, and 7 follows nothing


def test_a_reference_is_a_source_of_n_grams_and_never_matches_across_its_end():
    reference = [5, 6, 7, 8, 9]
    p = NgramProposer([8, 9, 1, 2], max_draft=4, first=4, reference=reference)
    p.extend([40, 6, 7])  # the output left the reference's start, then met it again: (6, 7) -> 8, 9
    assert p.propose(4) == [8, 9]
    q = NgramProposer([1, 2], max_draft=4, first=4, reference=[8, 9])
    q.extend([30, 8, 9])  # (8, 9) ends the reference: what follows it there is no text
    assert q.propose(4) == []


def test_a_word_with_and_without_its_leading_space_is_one_class_for_matching(smollm2_tokenizer):
    """A document's sentence starts with `The`; the answer quotes it after a word of its own (` The`):
    the match finds the sentence through the class, and the draft is the document's own tokens."""
    from lmserve.server.engine.ngram import word_classes

    tok = smollm2_tokenizer
    classes = word_classes(tok, len(tok.token_bytes))
    the, space_the = tok.token_to_id("The"), tok.token_to_id("\u0120The")
    assert classes[space_the] == classes[the] == the and classes[tok.token_to_id("\u0120cat")] == tok.token_to_id("cat")
    assert classes[tok.token_to_id("<|im_end|>")] == tok.token_to_id("<|im_end|>")
    document = tok.encode("Notes.\nThe committee approved the budget on Tuesday after a long debate.")
    answer = tok.encode("They said The committee")
    assert answer[-2] == space_the and space_the not in document and the in document
    plain = NgramProposer(document, max_draft=8, first=8, max_n=3)
    plain.extend(answer)
    assert plain.propose(8) == []  # (` The`, ` committee`) never occurred
    classed = NgramProposer(document, max_draft=8, first=8, max_n=3, classes=classes)
    classed.extend(answer)
    at = document.index(the)
    assert classed.propose(8) == document[at + 2: at + 10]  # ` approved the budget on Tuesday after a long`


def test_word_classes_leave_the_brute_force_match_unchanged_where_no_pair_occurs():
    classes = tuple(range(50))  # no pairs: identity
    rng = random.Random(3)
    tokens = [rng.randrange(4) for _ in range(40)]
    a = NgramProposer(tokens[:10], max_draft=5, classes=classes)
    b = NgramProposer(tokens[:10], max_draft=5)
    for t in tokens[10:]:
        a.extend([t])
        b.extend([t])
        assert a.match() == b.match() and a.propose(4) == b.propose(4)
