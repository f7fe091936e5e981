"""A draft: each row's proposed continuation as a token tree, verified by the base model in one forward
(specee_core.spec). Node 0 is the row's root: the token the last step chose, not yet fed. Node j's parent
is parent[j] < j, and node j sits at position prefix + depth(j)."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class TreeShape:
    depth: int  # levels below the root
    width: int  # nodes expanded per level, and children drafted per expanded node (EAGLE-2's top-k)
    nodes: int  # drafted nodes kept (the root excluded)


@dataclass
class Draft:
    tokens: torch.Tensor  # [N, T] node tokens; node 0 = the root
    parent: torch.Tensor  # [N, T] parent node (-1 for the root and for padding); parent[j] < j
    valid: torch.Tensor  # [N, T] bool; rows with fewer nodes are padded
    # [N, T, K] the draft's K most likely tokens after each node (-1: none drafted there); the exit
    # predictors of spec+T3 score them. None: the proposer ranks no candidates (prompt lookup)
    cand: torch.Tensor | None = None
    # [N, T, K] the draft's probabilities of those candidates (0 where none): the exit predictors'
    # feature "q" (feature set "zpdq")
    cand_prob: torch.Tensor | None = None

    @property
    def size(self) -> int:
        return self.tokens.shape[1]

    def depth_and_ancestors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """depth [N, T] (root 0) and ancestors [N, T, T] bool: anc[r, j, i] when node i is node j
        itself or on its path to the root. Padding nodes see only themselves."""
        n, t = self.tokens.shape
        anc = torch.eye(t, dtype=torch.bool).expand(n, t, t).clone()
        depth = torch.zeros(n, t, dtype=torch.int64)
        for j in range(1, t):  # parent[j] < j: its row of anc is final
            p = self.parent[:, j]
            has = (p >= 0) & self.valid[:, j]
            if bool(has.any()):
                idx = has.nonzero().squeeze(1)
                anc[idx, j] |= anc[idx, p[idx]]
                depth[idx, j] = depth[idx, p[idx]] + 1
        return depth, anc

    @classmethod
    def chains(cls, roots: list[int], continuations: list[list[int]]) -> Draft:
        """Chains root -> continuation[0] -> ..., padded to the longest."""
        t = 1 + max((len(c) for c in continuations), default=0)
        n = len(roots)
        tokens = torch.zeros(n, t, dtype=torch.int64)
        parent = torch.full((n, t), -1, dtype=torch.int64)
        valid = torch.zeros(n, t, dtype=torch.bool)
        for r, (root, cont) in enumerate(zip(roots, continuations)):
            tokens[r, 0], valid[r, 0] = root, True
            if cont:
                k = len(cont)
                tokens[r, 1 : k + 1] = torch.tensor(cont)
                parent[r, 1 : k + 1] = torch.arange(k)
                valid[r, 1 : k + 1] = True
        return cls(tokens, parent, valid)
    def with_chains(self, continuations: list[list[int]]) -> Draft:
        """This draft with each row's chain root -> continuation[r][0] -> ... added: the chain follows
        existing nodes while their tokens agree and branches off with new nodes where they part."""
        toks, parent, valid = self.tokens.tolist(), self.parent.tolist(), self.valid.tolist()
        for r, cont in enumerate(continuations):
            node = 0
            for tok in cont:
                child = next((j for j in range(1, len(toks[r])) if valid[r][j] and parent[r][j] == node
                              and toks[r][j] == tok), None)
                if child is None:
                    toks[r].append(tok)
                    parent[r].append(node)
                    valid[r].append(True)
                    child = len(toks[r]) - 1
                node = child
        t = max(len(x) for x in toks)
        pad = lambda rows, v: [x + [v] * (t - len(x)) for x in rows]  # noqa: E731
        def widen(x: torch.Tensor | None, fill) -> torch.Tensor | None:  # the chain's new nodes have no ranked candidates
            return x if x is None or t <= x.shape[1] else torch.cat((x, x.new_full((x.shape[0], t - x.shape[1], x.shape[2]), fill)), 1)

        return Draft(torch.tensor(pad(toks, 0)), torch.tensor(pad(parent, -1)), torch.tensor(pad(valid, False)),
                     cand=widen(self.cand, -1), cand_prob=widen(self.cand_prob, 0.0))
    @classmethod
    def by_rows(cls, n: int, parts: list[tuple[list[int], Draft]]) -> Draft:
        """One draft of n rows from drafts of some of them: parts [(row indices, draft of those rows)]."""
        t = max(d.size for _, d in parts)
        k = max((d.cand.shape[2] for _, d in parts if d.cand is not None), default=0)
        tokens = torch.zeros(n, t, dtype=torch.int64)
        parent = torch.full((n, t), -1, dtype=torch.int64)
        valid = torch.zeros(n, t, dtype=torch.bool)
        cand = torch.full((n, t, k), -1, dtype=torch.int64) if k else None
        scored = k and all(d.cand_prob is not None for _, d in parts if d.cand is not None)
        cand_prob = torch.zeros(n, t, k) if scored else None
        for rows, d in parts:
            idx = torch.tensor(rows)
            tokens[idx, : d.size], parent[idx, : d.size], valid[idx, : d.size] = d.tokens, d.parent, d.valid
            if d.cand is not None:
                cand[idx, : d.size] = d.cand
                if scored:
                    cand_prob[idx, : d.size] = d.cand_prob
        return cls(tokens, parent, valid, cand=cand, cand_prob=cand_prob)
