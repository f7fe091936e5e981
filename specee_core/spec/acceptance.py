"""Acceptance of a verified draft: which drafted nodes a row keeps and the token after them.

The longest root-to-node path whose every token is the base model's choice after its parent, plus the
base's choice after the path (the bonus token). The choice is each row's own (specee_core.step.sampling):
the argmax for a greedy row, for a sampled row the token its uniform for that index draws, so the committed
tokens are dense decoding's, token for token, and follow the base model's distribution exactly.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from specee_core.draft.tree import Draft


@dataclass
class Verdict:
    accepted: list[list[int]]  # per row: accepted node indices after the root, in path order
    tokens: list[list[int]]  # per row: the tokens to commit (the accepted nodes' tokens, then the base's next)


def _children(parent: list[int], valid: list[bool]) -> list[list[int]]:
    kids: list[list[int]] = [[] for _ in parent]
    for j in range(1, len(parent)):
        if valid[j] and parent[j] >= 0:
            kids[parent[j]].append(j)
    return kids


def accept_greedy(draft: Draft, base_next: torch.Tensor) -> Verdict:
    """base_next [N, T]: the base model's chosen token after each node (its argmax, or its draw)."""
    toks, parent, valid = draft.tokens.tolist(), draft.parent.tolist(), draft.valid.tolist()
    nxt = base_next.tolist()
    accepted, out = [], []
    for r in range(len(toks)):
        kids, tr, nr = _children(parent[r], valid[r]), toks[r], nxt[r]

        def longest(node: int) -> list[int]:  # the longest agreeing path below node (siblings may repeat a token)
            paths = [[c] + longest(c) for c in kids[node] if tr[c] == nr[node]]
            return max(paths, key=len, default=[])

        path = longest(0)
        accepted.append(path)
        out.append([tr[j] for j in path] + [nr[path[-1] if path else 0]])
    return Verdict(accepted, out)
