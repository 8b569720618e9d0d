"""Stop strings across token boundaries: property checks against a plain search of the full text."""

import random

from lmserve.server.engine.stopping import StopStringMatcher


def run(pieces, stops):
    m = StopStringMatcher(tuple(stops))
    out = []
    for p in pieces:
        out.append(m.push(p))
        if m.stopped:
            break
    else:
        out.append(m.flush())
    return "".join(out), m.stopped, out


def expected(text, stops):
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    return (text[: min(hits)], True) if hits else (text, False)


def test_stop_split_across_pieces_is_not_emitted():
    text, stopped, pieces = run(["Hello wo", "rld. E", "ND", " more"], ["END"])
    assert stopped and text == "Hello world. "
    assert all("E" not in p for p in pieces[2:])  # the held-back "E" never leaked


def test_prefix_that_does_not_complete_is_released():
    text, stopped, pieces = run(["a <", "|x", "y"], ["<|end|>"])
    assert not stopped and text == "a <|xy"
    assert pieces[0] == "a "  # "<" was held until it could no longer start the stop string


def test_random_splits_match_full_text_search():
    rng = random.Random(0)
    alphabet = "ab c\n"
    for _ in range(2000):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 30)))
        stops = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(0, 3))]
        cuts = sorted(rng.sample(range(len(text) + 1), k=min(len(text) + 1, rng.randint(0, 8))))
        pieces = [text[i:j] for i, j in zip([0] + cuts, cuts + [len(text)])]
        got, stopped, _ = run(pieces, stops)
        want, want_stopped = expected(text, stops)
        assert (got, stopped) == (want, want_stopped), (pieces, stops)
