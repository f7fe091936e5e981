"""Stop strings (specee_core.step.stops): the search, the incremental matcher against a search of the
whole text, and the engine's cut on the bundled model."""
import random

import pytest

from specee_core.step.stops import PARTIAL, StopMatcher, cut_at_stop, find_stop
from tests.conftest import BUNDLED


def first_hit(pieces: list[str], stops) -> tuple[int, int]:
    """Feed the growing text piece by piece: (update at which a stop was found, its index), or (-1, -1)."""
    m, text = StopMatcher(stops), ""
    for n, piece in enumerate(pieces):
        text += piece
        if (cut := m.update(text)) >= 0:
            return n, cut
    return -1, -1


def test_find_stop():
    assert find_stop("hello world", ["o w", "ld"]) == 4
    assert find_stop("hello world", ["ld", "o w"]) == 4  # the earliest, whatever the order of the stops
    assert find_stop("hello world", ["hell"]) == 0
    assert find_stop("hello world", ["o"], start=5) == 7
    assert find_stop("hello world", ["xyz"]) == find_stop("hello world", []) == -1
    assert cut_at_stop("a STOP b STOP", ("STOP",)) == "a " and cut_at_stop("STOP", ["STOP"]) == ""
    assert cut_at_stop("abc", ()) == "abc"


def test_stop_straddling_updates_is_found():
    # "STOP" arrives as "..ST" + "O" + "P..": found at the third update, at its start
    assert first_hit(["abc ST", "O", "P tail"], ["STOP"]) == (2, 4)
    assert first_hit(["abc S", "TO", "P"], ["STOP", "zz"]) == (2, 4)


def test_earliest_of_several_stops_wins():
    # both complete in the same update; the one that starts first is the cut
    assert first_hit(["one tw", "o three"], ["three", "two"]) == (1, 4)
    # the shorter stop completes first, though a longer one starting earlier completes later
    assert first_hit(["xABC", "D"], ["ABCD", "C"]) == (0, 3)


def test_stop_at_offset_zero():
    assert first_hit(["END", " more"], ["END"]) == (0, 0)
    assert first_hit(["E", "ND"], ["END"]) == (1, 0)


def test_no_stops_never_match():
    assert first_hit(["abc", "def"], []) == (-1, -1)
    assert first_hit(["abc", "def"], ["xyz"]) == (-1, -1)
    assert StopMatcher([]).overlap == 0 and StopMatcher(["a", "abcd"]).overlap == 3


def test_a_character_completed_later_is_searched_again():
    # decoding a growing id list: the last character is U+FFFD until its last byte arrives
    m = StopMatcher(["日"])  # one character: no overlap, only the trailing partial makes it be searched
    assert m.update("ab" + PARTIAL) == -1
    assert m.update("ab" + PARTIAL) == -1  # a 4-byte character: still incomplete
    assert m.update("ab日") == 2


def test_text_that_changes_before_its_end_is_searched_from_the_start():
    m = StopMatcher(["a."])
    assert m.update("xxxxxxa ") == -1
    assert m.update("xxxxxxa.") == 6  # a tokenizer tidied " ." into "."


def test_matcher_equals_a_search_of_the_whole_text():
    rng = random.Random(0)
    for _ in range(500):
        text = "".join(rng.choice("abc") for _ in range(rng.randint(0, 40)))
        stops = ["".join(rng.choice("abc") for _ in range(rng.randint(1, 5))) for _ in range(rng.randint(1, 3))]
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(0, 10)))) if text else []
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
        n, cut = first_hit(pieces, stops)
        # found at the first update whose text holds a stop, at the index a full search gives
        grown = [text[: b] for b in [*cuts, len(text)]]
        want = next((i for i, t in enumerate(grown) if find_stop(t, stops) >= 0), -1)
        assert n == want, (text, stops, pieces)
        if n >= 0:
            assert cut == find_stop(grown[n], stops)


@pytest.fixture(scope="module")
def tiny():
    from specee_core import SpecEEEngine

    return SpecEEEngine.from_pretrained(BUNDLED, dtype="float32")


@pytest.mark.parametrize("stop", ["日", "🙂", "lo 日", "語 🙂 d"])
def test_decoded_prefixes_of_multibyte_text(tiny, stop):
    """What the engine feeds the matcher: the whole id list decoded after every token, where a
    character spanning tokens is U+FFFD until its last token."""
    text = "héllo 日本語 🙂 done"
    ids = tiny.tokenizer(text, add_special_tokens=False)["input_ids"]
    prefixes = [tiny.tokenizer.decode(ids[: n + 1]) for n in range(len(ids))]
    assert any(p.endswith(PARTIAL) for p in prefixes)  # some character does span tokens
    m = StopMatcher([stop])
    n = next(n for n, p in enumerate(prefixes) if m.update(p) >= 0)
    assert n == next(n for n, p in enumerate(prefixes) if stop in p)
    assert prefixes[n][: find_stop(prefixes[n], [stop])] == text[: text.find(stop)]


def test_engine_cuts_before_the_earliest_stop_and_emits_no_token_past_it(tiny):
    prompt = ["def add(a, b):\n"]
    full = tiny.generate(prompt, max_new_tokens=24, ignore_eos=True, mode="dense")[0]
    text = full.text
    assert len(text) > 12, text
    mid = len(text) // 2
    for stops in ([text[mid : mid + 3]], [text[:2]], [text[mid + 2 : mid + 4], text[mid : mid + 3]], [text[-1]]):
        r = tiny.generate(prompt, max_new_tokens=24, ignore_eos=True, stop=stops, mode="dense")[0]
        cut = find_stop(text, stops)
        assert r.text == text[:cut] and r.finish_reason == "stop", (stops, r.text)
        n = len(r.token_ids)
        assert r.token_ids == full.token_ids[:n]
        # the last token is the one that completed the stop string: the text before it holds none
        assert find_stop(tiny.tokenizer.decode(full.token_ids[: n - 1]), stops) < 0
        assert find_stop(tiny.tokenizer.decode(full.token_ids[:n]), stops) >= 0
