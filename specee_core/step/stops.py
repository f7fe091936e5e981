"""Stop strings: where a generated text must be cut. The one definition of the search, used by the
engine (per row, as tokens are recorded), the Serve app and its streaming text."""
from __future__ import annotations

from collections.abc import Sequence

PARTIAL = "\ufffd"  # what decoding a character whose bytes have not all arrived yet gives


def find_stop(text: str, stops: Sequence[str], start: int = 0) -> int:
    """Index of the earliest stop string in text[start:] (an index into text), or -1 if none is there."""
    return min((i for i in (text.find(s, start) for s in stops) if i >= 0), default=-1)


def cut_at_stop(text: str, stops: Sequence[str]) -> str:
    """The text before its earliest stop string (all of it when none occurs)."""
    cut = find_stop(text, stops)
    return text if cut < 0 else text[:cut]


class StopMatcher:
    """The stop search of one growing text (a row being generated, a stream). Each update searches
    only where a match can start that no earlier update saw whole: from (longest stop - 1)
    characters before the end of the text already searched, so a stop string split across tokens is
    found, and every character is searched a bounded number of times.

    A text decoded anew from a growing list of token ids need not only grow at its end: a character
    whose bytes are split across tokens decodes to U+FFFD until its last byte arrives, and some
    tokenizers tidy spaces at the join. Trailing U+FFFD are not counted as searched (completing the
    character does not force a search from the start), and a text that no longer starts with what
    was searched is searched from the start."""

    def __init__(self, stops: Sequence[str]):
        self.stops = tuple(stops)
        self.overlap = max((len(s) for s in self.stops), default=1) - 1  # how far back a new match can start
        self._searched = ""  # the text of the last update, without trailing U+FFFD

    def update(self, text: str) -> int:
        """The whole text so far -> index of the earliest stop string in it, or -1. After a match the
        caller cuts the text and stops updating."""
        if not self.stops:
            return -1
        done = self._searched
        start = max(len(done) - self.overlap, 0) if text.startswith(done) else 0
        self._searched = text.rstrip(PARTIAL)
        return find_stop(text, self.stops, start)
