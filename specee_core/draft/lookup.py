"""Prompt lookup: what followed earlier occurrences of a row's last n tokens (n = max_ngram..1) in its own
prompt and output. Training-free; one index per lane answers every use of it: SpecEE's candidates, the
calibration's lookup veto, and speculative decoding's chains."""
from __future__ import annotations

from collections import Counter

import torch

LOOKUP_NGRAM = 3  # the longest n-gram looked up


class NgramIndex:
    """Per row: every start of every n-gram (n <= max_ngram) that some token follows, in order, and how
    often each token occurs, brought up to date with the tokens the row gained since the last query. A
    query costs O(max_ngram) (plus the occurrences it walks), not a scan of the row's history.

    hist is the row's whole token list (specee_core.step.state.Batch.tokens[b]), read, never copied."""

    def __init__(self, max_ngram: int = LOOKUP_NGRAM):
        self.max_ngram = max_ngram
        # row -> (n-gram -> its starts, ascending; token counts; tokens indexed)
        self.rows: dict[int, tuple[dict[tuple[int, ...], list[int]], Counter, int]] = {}

    def reset(self, row: int) -> None:
        self.rows.pop(row, None)

    def _index(self, row: int, hist: list[int]) -> dict[tuple[int, ...], list[int]]:
        index, counts, seen = self.rows.get(row) or ({}, Counter(), 0)
        size = len(hist)
        counts.update(hist[seen:size])
        for end in range(max(seen, 1), size):  # the n-grams hist[end - n:end], followed by hist[end]
            for n in range(1, min(self.max_ngram, end) + 1):
                index.setdefault(tuple(hist[end - n : end]), []).append(end - n)
        self.rows[row] = (index, counts, size)
        return index

    def _matches(self, row: int, hist: list[int]):
        """(n, start) of every earlier occurrence of hist's last n tokens that something follows: the
        longest n first, the latest occurrence first."""
        index, size = self._index(row, hist), len(hist)
        for n in range(min(self.max_ngram, size - 1), 0, -1):
            for start in reversed(index.get(tuple(hist[size - n :]), ())):
                yield n, start

    def continuation(self, row: int, hist: list[int], depth: int) -> list[int]:
        """Up to depth tokens that followed the latest occurrence of the longest matching n-gram."""
        for n, start in self._matches(row, hist):
            return hist[start + n : start + n + depth]
        return []

    def candidates(self, row: int, hist: list[int], k: int) -> list[int]:
        """Up to k distinct next tokens: the followers of the matching n-grams, in _matches' order."""
        found: list[int] = []
        for n, start in self._matches(row, hist):
            tok = hist[start + n]
            if tok not in found:
                found.append(tok)
                if len(found) == k:
                    break
        return found

    def frequent(self, row: int, hist: list[int], k: int) -> list[int]:
        """The row's k most frequent tokens."""
        self._index(row, hist)
        return [t for t, _ in self.rows[row][1].most_common(k)]

    def followers(self, row: int, hist: list[int]) -> list[int]:
        """Per n = 1..max_ngram: the token that followed the latest earlier occurrence of hist's last n
        tokens, -1 where there is none."""
        index, size = self._index(row, hist), len(hist)
        out = [-1] * self.max_ngram
        for n in range(1, min(self.max_ngram, size - 1) + 1):
            starts = index.get(tuple(hist[size - n :]))
            if starts:
                out[n - 1] = hist[starts[-1] + n]
        return out


def lookup_tokens(followers: torch.Tensor, min_ngram: int) -> torch.Tensor:
    """followers [S, n_max] (NgramIndex.followers per row) -> [S]: the token that followed the latest
    earlier occurrence of the row's longest matching n-gram with n >= min_ngram, -1 where none matches."""
    out = torch.full(followers.shape[:1], -1, dtype=torch.int64, device=followers.device)
    for n in range(min_ngram, followers.shape[1] + 1):  # a longer match overrides
        out = torch.where(followers[:, n - 1] >= 0, followers[:, n - 1], out)
    return out


def lookup_veto(exit_tokens: torch.Tensor, looked_up: torch.Tensor) -> torch.Tensor:
    """Where an exit's token [S] (or [S, L-1]) contradicts prompt lookup's token looked_up [S] (-1: none):
    the text is being copied from the prompt or the output so far, and the exit would emit something else
    (measured on HumanEval: exits that rewrote a signature the prompt spells out)."""
    lk = looked_up if exit_tokens.dim() == 1 else looked_up[:, None]
    return (lk >= 0) & (exit_tokens != lk)
