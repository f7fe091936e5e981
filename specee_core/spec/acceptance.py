"""Acceptance of a verified draft: which drafted nodes a row keeps and the token after them.

Greedy: the longest root-to-node path whose every token is the base model's argmax after its
parent, plus the base's argmax after the path (the bonus token): equal to dense greedy decoding.
Sampling: rejection sampling down the tree, which keeps the base model's distribution exactly.
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
    """base_next [N, T]: the base model's greedy token after each node."""
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


def accept_sampled(draft: Draft, p: torch.Tensor, generator: torch.Generator | None) -> Verdict:
    """p [N, T, V]: the base's distribution after each node. From the root, each child in turn is
    tested against the residual r (the base's distribution after the current node, less what earlier
    rejected children took): a child x drawn from q is accepted with probability min(1, r(x) / q(x))
    and on rejection r becomes max(0, r - q); a deterministic child (q None) is accepted with
    probability r(x) and on rejection r loses x. An accepted child becomes the current node; when
    every child is rejected the committed token is drawn from the normalised residual. Each test
    draws the token the base distribution would, so the committed tokens follow p exactly."""
    toks, parent, valid = draft.tokens.tolist(), draft.parent.tolist(), draft.valid.tolist()
    accepted, out = [], []
    for r in range(len(toks)):
        kids = _children(parent[r], valid[r])
        path, node = [], 0
        while True:
            res = p[r, node].clone()
            nxt = None
            for c in kids[node]:
                x = toks[r][c]
                res /= res.sum()
                u = float(torch.rand((), generator=generator))
                if draft.q is None:
                    if u < float(res[x]):
                        nxt = c
                        break
                    res[x] = 0
                else:
                    q = draft.q[r, c]
                    if u * float(q[x]) < float(res[x]):  # u < r(x) / q(x), without dividing
                        nxt = c
                        break
                    res = (res - q).clamp_(min=0)
                if float(res.sum()) <= 0:  # nothing left to reject into (r was q's): sample r itself
                    res = p[r, node].clone()
                    break
            if nxt is None:
                path_tokens = [toks[r][j] for j in path]
                extra = int(torch.multinomial(res / res.sum(), 1, generator=generator))
                accepted.append(path)
                out.append(path_tokens + [extra])
                break
            path.append(nxt)
            node = nxt
    return Verdict(accepted, out)
